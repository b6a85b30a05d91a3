//! Remote memory access, atomics and memory mapping: what Open MPI's osc/ucx, spml/ucx,
//! atomic/ucx and sshmem/ucx import. They are exported so that those components load (a
//! missing symbol would fail their `dlopen` with a warning), and each refuses with
//! `UCS_ERR_UNSUPPORTED`. They are never reached through the pml: `ucp_init` already refuses
//! the RMA and atomic features those components ask for, so they step aside at their own init.

use std::ffi::{c_int, c_void};

use crate::status::status_ptr;
use crate::types::*;

/// The status every refused call returns.
const REFUSED: Status = UCS_ERR_UNSUPPORTED;

macro_rules! refused_status {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: refused (`UCS_ERR_UNSUPPORTED`).")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> Status {
            let _ = ($($arg,)*);
            REFUSED
        }
    )*};
}

macro_rules! refused_ptr {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: refused (`UCS_STATUS_PTR(UCS_ERR_UNSUPPORTED)`).")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> *mut c_void {
            let _ = ($($arg,)*);
            status_ptr(REFUSED)
        }
    )*};
}

type P = *mut c_void;

refused_status! {
    ucp_atomic_post(ep: P, opcode: c_int, value: u64, op_size: usize, remote_addr: u64, rkey: P);
    ucp_ep_rkey_unpack(ep: P, rkey_buffer: P, rkey_p: P);
    ucp_get_nbi(ep: P, buffer: P, length: usize, remote_addr: u64, rkey: P);
    ucp_put_nbi(ep: P, buffer: P, length: usize, remote_addr: u64, rkey: P);
    ucp_mem_map(context: P, params: P, memh_p: P);
    ucp_mem_query(memh: P, attr: P);
    ucp_mem_unmap(context: P, memh: P);
    ucp_mem_advise(context: P, memh: P, params: P);
    ucp_rkey_pack(context: P, memh: P, rkey_buffer_p: P, size_p: P);
    ucp_rkey_ptr(rkey: P, raddr: u64, addr_p: P);
}

refused_ptr! {
    ucp_atomic_fetch_nb(ep: P, opcode: c_int, value: u64, result: P, op_size: usize, remote_addr: u64, rkey: P, cb: P);
    ucp_atomic_op_nbx(ep: P, opcode: c_int, buffer: P, count: usize, remote_addr: u64, rkey: P, param: P);
    ucp_get_nbx(ep: P, buffer: P, count: usize, remote_addr: u64, rkey: P, param: P);
    ucp_put_nbx(ep: P, buffer: P, count: usize, remote_addr: u64, rkey: P, param: P);
}

/// `void ucp_rkey_buffer_release(void *rkey_buffer)`: nothing was ever packed.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_rkey_buffer_release(_rkey_buffer: *mut c_void) {}

/// `void ucp_rkey_destroy(ucp_rkey_h rkey)`: nothing was ever unpacked.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_rkey_destroy(_rkey: *mut c_void) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_calls_say_unsupported() {
        let n = std::ptr::null_mut();
        assert_eq!(ucp_mem_map(n, n, n), UCS_ERR_UNSUPPORTED);
        assert_eq!(ucp_put_nbx(n, n, 0, 0, n, n) as isize, -22);
        assert!(crate::status::ptr_is_err(ucp_atomic_fetch_nb(
            n, 0, 0, n, 8, 0, n, n
        )));
    }
}
