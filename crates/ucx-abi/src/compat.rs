//! The rest of libucp's public calls (UCX 1.13's `ucp.h` and `ucp_compat.h`), so that a
//! program linked against UCX finds every symbol it names:
//! - the blocking forms UCX keeps for old programs (`ucp_put`, `ucp_get`, `ucp_ep_flush`,
//!   `ucp_worker_flush`, `ucp_atomic_add32` and the other typed atomics): each posts its
//!   non-blocking form and progresses the endpoint's worker until that ended, as UCX's do;
//! - the callback forms of the stream calls (`ucp_stream_send_nb`, `ucp_stream_recv_nb`);
//! - queries and printing (`ucp_lib_query`, `ucp_worker_address_query`, `ucp_ep_query`,
//!   `ucp_request_query`, `ucp_ep_print_info`, `ucp_mem_print_info`), `ucp_request_alloc`,
//!   `ucp_worker_wait_mem`;
//! - what rucx does not offer, refused with a status rather than missing:
//!   `ucp_ep_modify_nb` and `ucp_ep_evaluate_perf` (`UCS_ERR_UNSUPPORTED`), and UCX's first
//!   active-message API (`ucp_worker_set_am_handler`, `ucp_am_send_nb`: `UCS_ERR_UNSUPPORTED`;
//!   `ucp_worker_set_am_recv_handler` and `ucp_am_send_nbx` are the ones served).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use crate::endpoint::AbiEp;
use crate::rma::{
    AbiRkey, UCP_ATOMIC_FETCH_OP_CSWAP, UCP_ATOMIC_FETCH_OP_FADD, UCP_ATOMIC_FETCH_OP_SWAP,
    UCP_ATOMIC_POST_OP_ADD,
};
use crate::status::{ptr_is_err, status_ptr};
use crate::types::*;
use crate::worker::{AbiWorker, Callback};

/// `ucp_lib_attr_t`.
#[repr(C)]
#[derive(Debug, Default)]
pub struct LibAttr {
    pub field_mask: u64,
    pub max_thread_level: c_int,
}

/// `UCP_LIB_ATTR_FIELD_MAX_THREAD_LEVEL`.
pub const UCP_LIB_ATTR_FIELD_MAX_THREAD_LEVEL: u64 = 1;

/// `ucp_worker_address_attr_t`.
#[repr(C)]
#[derive(Debug, Default)]
pub struct WorkerAddressAttr {
    pub field_mask: u64,
    pub worker_uid: u64,
}

/// `UCP_WORKER_ADDRESS_ATTR_FIELD_UID`.
pub const UCP_WORKER_ADDRESS_ATTR_FIELD_UID: u64 = 1;

/// `ucp_ep_attr_t` (UCX 1.13: the name and the connection's socket addresses).
#[repr(C)]
pub struct EpAttr {
    pub field_mask: u64,
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
    pub local_sockaddr: libc::sockaddr_storage,
    pub remote_sockaddr: libc::sockaddr_storage,
}

/// `UCP_EP_ATTR_FIELD_NAME`.
pub const UCP_EP_ATTR_FIELD_NAME: u64 = 1;
/// `UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR`.
pub const UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR: u64 = 1 << 1;
/// `UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR`.
pub const UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR: u64 = 1 << 2;

/// `ucp_request_attr_t`.
#[repr(C)]
#[derive(Debug)]
pub struct RequestAttr {
    pub field_mask: u64,
    pub debug_string: *mut c_char,
    pub debug_string_size: usize,
    pub status: Status,
    pub mem_type: u32,
}

/// `UCP_REQUEST_ATTR_FIELD_INFO_STRING`.
pub const UCP_REQUEST_ATTR_FIELD_INFO_STRING: u64 = 1;
/// `UCP_REQUEST_ATTR_FIELD_INFO_STRING_SIZE`.
pub const UCP_REQUEST_ATTR_FIELD_INFO_STRING_SIZE: u64 = 1 << 1;
/// `UCP_REQUEST_ATTR_FIELD_STATUS`.
pub const UCP_REQUEST_ATTR_FIELD_STATUS: u64 = 1 << 2;
/// `UCP_REQUEST_ATTR_FIELD_MEM_TYPE`.
pub const UCP_REQUEST_ATTR_FIELD_MEM_TYPE: u64 = 1 << 3;
const UCP_REQUEST_ATTR_KNOWN: u64 = 0xf;

/// Longest debug string `ucp_request_query` says it may write (UCX's
/// `UCP_REQUEST_ATTR_FIELD_INFO_STRING_SIZE` answer).
const REQUEST_INFO_MAX: usize = 128;

/// Progress `w` until the request `r` (what a non-blocking call returned) ended; its status.
/// NULL is a call that ended in place, an error pointer a refusal.
///
/// # Safety
/// `r` is what one of this library's calls on `w` returned, not freed yet.
unsafe fn wait(w: &AbiWorker, r: *mut c_void) -> Status {
    if r.is_null() {
        return UCS_OK;
    }
    if ptr_is_err(r) {
        return r as isize as Status;
    }
    let status = loop {
        // SAFETY: a live request of this library (the caller's promise).
        let s = unsafe { crate::tag::ucp_request_check_status(r) };
        if s != UCS_INPROGRESS {
            break s;
        }
        // SAFETY: a live worker.
        unsafe { crate::worker::ucp_worker_progress(w) };
    };
    // SAFETY: ended and ours to free (nobody else saw it).
    unsafe { crate::tag::ucp_request_free(r) };
    status
}

/// The worker of a live endpoint (NULL: none).
///
/// # Safety
/// `ep` NULL or live.
unsafe fn worker_of<'a>(ep: *const AbiEp) -> Option<&'a AbiWorker> {
    // SAFETY: the caller's promise; a worker outlives its endpoints.
    unsafe { ep.as_ref() }.map(|e| unsafe { &*e.worker })
}

/// Post on `ep` with `post` (a non-blocking call on it) and wait for its end.
///
/// # Safety
/// `ep` NULL or live; `post` makes one call of this library on `ep`.
unsafe fn on_ep(ep: *const AbiEp, post: impl FnOnce() -> *mut c_void) -> Status {
    // SAFETY: the caller's promise.
    match unsafe { worker_of(ep) } {
        // SAFETY: the request is the one `post` just returned.
        Some(w) => unsafe { wait(w, post()) },
        None => UCS_ERR_INVALID_PARAM,
    }
}

/// `ucs_status_t ucp_put(ucp_ep_h ep, const void *buffer, size_t length, uint64_t
/// remote_addr, ucp_rkey_h rkey)`: blocking, returns once the buffer may be reused.
///
/// # Safety
/// As [`crate::rma::ucp_put_nb`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_put(
    ep: *const AbiEp,
    buffer: *const c_void,
    length: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
) -> Status {
    // SAFETY: the caller's promises.
    let Some(w) = (unsafe { worker_of(ep) }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    // SAFETY: forwarded; the request is the one just returned.
    unsafe {
        wait(
            w,
            crate::rma::ucp_put_nb(ep, buffer, length, remote_addr, rkey, None),
        )
    }
}

/// `ucs_status_t ucp_get(ucp_ep_h ep, void *buffer, size_t length, uint64_t remote_addr,
/// ucp_rkey_h rkey)`: blocking, returns once the bytes are in `buffer`.
///
/// # Safety
/// As [`crate::rma::ucp_get_nb`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_get(
    ep: *const AbiEp,
    buffer: *mut c_void,
    length: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
) -> Status {
    // SAFETY: the caller's promises.
    let Some(w) = (unsafe { worker_of(ep) }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    // SAFETY: forwarded; the request is the one just returned.
    unsafe {
        wait(
            w,
            crate::rma::ucp_get_nb(ep, buffer, length, remote_addr, rkey, None),
        )
    }
}

/// `ucs_status_t ucp_ep_flush(ucp_ep_h ep)`: blocking [`crate::endpoint::ucp_ep_flush_nb`].
///
/// # Safety
/// `ep` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_flush(ep: *const AbiEp) -> Status {
    // SAFETY: forwarded.
    unsafe {
        on_ep(ep, || {
            crate::endpoint::ucp_ep_flush_nbx(ep, std::ptr::null())
        })
    }
}

/// `ucs_status_t ucp_worker_flush(ucp_worker_h worker)`: blocking
/// [`crate::worker::ucp_worker_flush_nb`].
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_flush(worker: *const AbiWorker) -> Status {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    // SAFETY: forwarded; the request is the one just returned.
    unsafe {
        wait(
            w,
            crate::worker::ucp_worker_flush_nbx(worker, std::ptr::null()),
        )
    }
}

/// A fetching atomic of `size` bytes, waited for: `*result` is the word's old value (for
/// compare-and-swap it holds the value to swap in when called).
///
/// # Safety
/// As [`crate::rma::ucp_atomic_fetch_nb`]; `result` `size` bytes.
unsafe fn fetch_wait(
    ep: *const AbiEp,
    op: c_int,
    value: u64,
    result: *mut c_void,
    size: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
) -> Status {
    if result.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: forwarded.
    unsafe {
        on_ep(ep, || {
            crate::rma::ucp_atomic_fetch_nb(ep, op, value, result, size, remote_addr, rkey, None)
        })
    }
}

macro_rules! typed_atomics {
    ($bits:literal, $t:ty, $add:ident, $fadd:ident, $swap:ident, $cswap:ident) => {
        #[doc = concat!("`ucs_status_t ", stringify!($add), "(ucp_ep_h ep, uint", $bits,
            "_t add, uint64_t remote_addr, ucp_rkey_h rkey)`: posted (a flush completes it).")]
        ///
        /// # Safety
        /// `ep`, `rkey` NULL or live.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $add(
            ep: *const AbiEp,
            add: $t,
            remote_addr: u64,
            rkey: *const AbiRkey,
        ) -> Status {
            // SAFETY: forwarded.
            unsafe {
                crate::rma::ucp_atomic_post(
                    ep,
                    UCP_ATOMIC_POST_OP_ADD,
                    u64::from(add),
                    size_of::<$t>(),
                    remote_addr,
                    rkey,
                )
            }
        }

        #[doc = concat!("`ucs_status_t ", stringify!($fadd), "(ucp_ep_h ep, uint", $bits,
            "_t add, uint64_t remote_addr, ucp_rkey_h rkey, uint", $bits,
            "_t *result)`: blocking, `*result` the old value.")]
        ///
        /// # Safety
        /// `ep`, `rkey` NULL or live; `result` NULL or writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $fadd(
            ep: *const AbiEp,
            add: $t,
            remote_addr: u64,
            rkey: *const AbiRkey,
            result: *mut $t,
        ) -> Status {
            // SAFETY: forwarded.
            unsafe {
                fetch_wait(
                    ep,
                    UCP_ATOMIC_FETCH_OP_FADD,
                    u64::from(add),
                    result.cast(),
                    size_of::<$t>(),
                    remote_addr,
                    rkey,
                )
            }
        }

        #[doc = concat!("`ucs_status_t ", stringify!($swap), "(ucp_ep_h ep, uint", $bits,
            "_t swap, uint64_t remote_addr, ucp_rkey_h rkey, uint", $bits,
            "_t *result)`: blocking, `*result` the old value.")]
        ///
        /// # Safety
        /// `ep`, `rkey` NULL or live; `result` NULL or writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $swap(
            ep: *const AbiEp,
            swap: $t,
            remote_addr: u64,
            rkey: *const AbiRkey,
            result: *mut $t,
        ) -> Status {
            // SAFETY: forwarded.
            unsafe {
                fetch_wait(
                    ep,
                    UCP_ATOMIC_FETCH_OP_SWAP,
                    u64::from(swap),
                    result.cast(),
                    size_of::<$t>(),
                    remote_addr,
                    rkey,
                )
            }
        }

        #[doc = concat!("`ucs_status_t ", stringify!($cswap), "(ucp_ep_h ep, uint", $bits,
            "_t compare, uint", $bits, "_t swap, uint64_t remote_addr, ucp_rkey_h rkey, uint",
            $bits, "_t *result)`: blocking; `swap` is written where the word equals `compare`, \
            `*result` the old value.")]
        ///
        /// # Safety
        /// `ep`, `rkey` NULL or live; `result` NULL or writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $cswap(
            ep: *const AbiEp,
            compare: $t,
            swap: $t,
            remote_addr: u64,
            rkey: *const AbiRkey,
            result: *mut $t,
        ) -> Status {
            if result.is_null() {
                return UCS_ERR_INVALID_PARAM;
            }
            // SAFETY: checked non-NULL, writable by the caller's promise: the fetch's
            // compare-and-swap takes the value to swap in from there.
            unsafe { result.write_unaligned(swap) };
            // SAFETY: forwarded.
            unsafe {
                fetch_wait(
                    ep,
                    UCP_ATOMIC_FETCH_OP_CSWAP,
                    u64::from(compare),
                    result.cast(),
                    size_of::<$t>(),
                    remote_addr,
                    rkey,
                )
            }
        }
    };
}

typed_atomics!(
    "32",
    u32,
    ucp_atomic_add32,
    ucp_atomic_fadd32,
    ucp_atomic_swap32,
    ucp_atomic_cswap32
);
typed_atomics!(
    "64",
    u64,
    ucp_atomic_add64,
    ucp_atomic_fadd64,
    ucp_atomic_swap64,
    ucp_atomic_cswap64
);

/// `ucs_status_ptr_t ucp_stream_send_nb(ucp_ep_h ep, const void *buffer, size_t count,
/// ucp_datatype_t datatype, ucp_send_callback_t cb, unsigned flags)`: as
/// [`crate::stream::ucp_stream_send_nbx`] with that datatype and callback.
///
/// # Safety
/// As [`crate::stream::ucp_stream_send_nbx`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_send_nb(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    datatype: u64,
    cb: SendCb,
    flags: c_uint,
) -> *mut c_void {
    if flags != 0 {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let opts = crate::nbx::Opts {
        cb: Callback::Send(cb),
        dt: datatype,
        flags: 0,
        req: None,
        no_imm: false,
    };
    // SAFETY: forwarded.
    unsafe { crate::stream::stream_send(ep, buffer, count, opts) }
}

/// `ucs_status_ptr_t ucp_stream_recv_nb(ucp_ep_h ep, void *buffer, size_t count,
/// ucp_datatype_t datatype, ucp_stream_recv_callback_t cb, size_t *length, unsigned flags)`:
/// as [`crate::stream::ucp_stream_recv_nbx`] with that datatype, callback and flags
/// (`UCP_STREAM_RECV_FLAG_WAITALL` or none).
///
/// # Safety
/// As [`crate::stream::ucp_stream_recv_nbx`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_recv_nb(
    ep: *const AbiEp,
    buffer: *mut c_void,
    count: usize,
    datatype: u64,
    cb: StreamRecvCb,
    length: *mut usize,
    flags: c_uint,
) -> *mut c_void {
    let opts = crate::nbx::Opts {
        cb: Callback::StreamRecv(cb),
        dt: datatype,
        flags,
        req: None,
        no_imm: false,
    };
    // SAFETY: forwarded.
    unsafe { crate::stream::stream_recv(ep, buffer, count, length, opts) }
}

/// `ucs_status_t ucp_lib_query(ucp_lib_attr_t *attr)`: rucx's libucp serves one thread per
/// worker (`UCS_THREAD_MODE_SINGLE`).
///
/// # Safety
/// `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_lib_query(attr: *mut LibAttr) -> Status {
    // SAFETY: the caller's promise.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_LIB_ATTR_FIELD_MAX_THREAD_LEVEL != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & UCP_LIB_ATTR_FIELD_MAX_THREAD_LEVEL != 0 {
        a.max_thread_level = UCS_THREAD_MODE_SINGLE;
    }
    UCS_OK
}

/// `ucs_status_t ucp_worker_address_query(ucp_address_t *address, ucp_worker_address_attr_t
/// *attr)`: the worker's unique id (rucx's address's `uuid`); an address this library did not
/// hand out is refused (`UCS_ERR_INVALID_PARAM`).
///
/// # Safety
/// `address` NULL or an address handed out by this library (or at least 8 readable bytes);
/// `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_address_query(
    address: *const c_void,
    attr: *mut WorkerAddressAttr,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_WORKER_ADDRESS_ATTR_FIELD_UID != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: the caller's promise on the address.
    let Some(bytes) = (unsafe { crate::endpoint::unpack_address(address) }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    let Ok(addr) = rucx_ucp::address::WorkerAddress::unpack(bytes) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & UCP_WORKER_ADDRESS_ATTR_FIELD_UID != 0 {
        a.worker_uid = addr.uuid;
    }
    UCS_OK
}

/// `ucs_status_t ucp_ep_query(ucp_ep_h ep, ucp_ep_attr_t *attr)`: the endpoint's name
/// (`rucx:<endpoint>`). Socket addresses: `UCS_ERR_UNSUPPORTED` (rucx's client/server
/// endpoints do not keep the connection's addresses), nothing written.
///
/// # Safety
/// `ep` NULL or live; `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_query(ep: *const AbiEp, attr: *mut EpAttr) -> Status {
    // SAFETY: the caller's promises.
    let (Some(e), Some(a)) = (unsafe { ep.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    let known = UCP_EP_ATTR_FIELD_NAME
        | UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
        | UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR;
    if a.field_mask & !known != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & (UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR | UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR) != 0 {
        return UCS_ERR_UNSUPPORTED;
    }
    if a.field_mask & UCP_EP_ATTR_FIELD_NAME != 0 {
        write_name(&mut a.name, &format!("rucx:{}", e.id));
    }
    UCS_OK
}

/// `text` into a fixed C name field, cut to fit and NUL-terminated.
fn write_name(field: &mut [c_char], text: &str) {
    let n = text.len().min(field.len() - 1);
    for (d, s) in field.iter_mut().zip(text.as_bytes()[..n].iter()) {
        *d = *s as c_char;
    }
    field[n] = 0;
}

/// `ucs_status_t ucp_request_query(void *request, ucp_request_attr_t *attr)`: the status
/// (`UCS_INPROGRESS` while it runs), a one-line description, and the memory type
/// (`UCS_MEMORY_TYPE_UNKNOWN`: requests do not keep it).
///
/// # Safety
/// `request` NULL or a live request of this library; `attr` NULL or valid, its
/// `debug_string` `debug_string_size` writable bytes when asked for.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_query(request: *mut c_void, attr: *mut RequestAttr) -> Status {
    // SAFETY: the caller's promise.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_REQUEST_ATTR_KNOWN != 0 || request.is_null() || ptr_is_err(request) {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: the caller's promise.
    let status = match unsafe { crate::request::state(request) } {
        Ok((s, _)) => s,
        Err(s) => return s,
    };
    if a.field_mask & UCP_REQUEST_ATTR_FIELD_STATUS != 0 {
        a.status = status;
    }
    if a.field_mask & UCP_REQUEST_ATTR_FIELD_MEM_TYPE != 0 {
        a.mem_type = crate::rma::UCS_MEMORY_TYPE_UNKNOWN;
    }
    if a.field_mask & UCP_REQUEST_ATTR_FIELD_INFO_STRING_SIZE != 0 {
        a.debug_string_size = REQUEST_INFO_MAX;
    }
    if a.field_mask & UCP_REQUEST_ATTR_FIELD_INFO_STRING != 0 {
        if a.debug_string.is_null() || a.debug_string_size == 0 {
            return UCS_ERR_INVALID_PARAM;
        }
        let text = format!("rucx request {request:p}: {}", status_text(status));
        // SAFETY: `debug_string_size` writable bytes at `debug_string` (the caller's promise).
        let field = unsafe { std::slice::from_raw_parts_mut(a.debug_string, a.debug_string_size) };
        write_name(field, &text);
    }
    UCS_OK
}

fn status_text(s: Status) -> String {
    // SAFETY: `ucs_status_string` returns a static NUL-terminated string for any status.
    unsafe { CStr::from_ptr(crate::status::ucs_status_string(s)) }
        .to_string_lossy()
        .into_owned()
}

/// `void ucp_ep_print_info(ucp_ep_h ep, FILE *stream)`: the endpoint's peer and the
/// protocols its plan chose (what `rucx-info` prints for an endpoint).
///
/// # Safety
/// `ep` NULL or live; `stream` NULL or an open `FILE *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_print_info(ep: *const AbiEp, stream: *mut c_void) {
    // SAFETY: the caller's promise.
    let Some(e) = (unsafe { ep.as_ref() }) else {
        return;
    };
    let text = match e.worker().worker.proto_info(e.id) {
        Ok(t) => t,
        Err(err) => format!("rucx endpoint {}: {err}", e.id),
    };
    let text: String = text.lines().map(|l| format!("# {l}\n")).collect();
    // SAFETY: the caller's promise on the stream.
    unsafe { crate::config::write_stream(stream, &text) };
}

/// `void ucp_mem_print_info(const char *mem_size, ucp_context_h context, FILE *stream)`:
/// the size asked for (UCX's size syntax: a number with an optional k, m, g or t suffix) and
/// the memory domains of the context that would register it, in order.
///
/// # Safety
/// `mem_size` NULL or a C string; `context` NULL or live; `stream` NULL or an open `FILE *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_mem_print_info(
    mem_size: *const c_char,
    context: *const crate::context::AbiContext,
    stream: *mut c_void,
) {
    // SAFETY: the caller's promises.
    let (Some(c), false) = (unsafe { context.as_ref() }, mem_size.is_null()) else {
        return;
    };
    // SAFETY: a C string (the caller's promise).
    let size = unsafe { CStr::from_ptr(mem_size) }.to_string_lossy();
    let text = match rucx_ucs::units::parse_memunits(&size) {
        Ok(rucx_ucs::MemUnits::Bytes(n)) => {
            let mut t = format!("#\n# rucx memory map of {n} bytes ({size})\n#\n");
            for md in c.ctx.domain_names() {
                t.push_str(&format!("#   domain: {md}\n"));
            }
            t.push_str("#\n");
            t
        }
        Ok(_) => format!("# rucx: memory size '{size}' is not a byte count\n"),
        Err(e) => format!("# rucx: cannot read memory size '{size}': {e}\n"),
    };
    // SAFETY: the caller's promise on the stream.
    unsafe { crate::config::write_stream(stream, &text) };
}

/// `void ucp_worker_wait_mem(ucp_worker_h worker, void *address)`: a hint that the caller
/// waits for a change at `address` (UCX waits on Arm with `wfe` and returns at once
/// elsewhere); here a spin-loop hint, then return: the caller reads the word again.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_worker_wait_mem(_worker: *const AbiWorker, _address: *mut c_void) {
    std::hint::spin_loop();
}

/// `void *ucp_request_alloc(ucp_worker_h worker)`: an empty request from the worker's pool,
/// already complete (`UCS_OK`); `ucp_request_free` gives it back.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_alloc(worker: *const AbiWorker) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return std::ptr::null_mut();
    };
    let r = w.context().pool.alloc_for(None, Callback::None);
    // SAFETY: a fresh request of the pool.
    unsafe { crate::request::complete(r, UCS_OK, TagRecvInfo::default()) };
    r
}

/// `ucs_status_ptr_t ucp_ep_modify_nb(ucp_ep_h ep, const ucp_ep_params_t *params)`:
/// `UCS_ERR_UNSUPPORTED` (an endpoint's parameters are fixed when it is created).
#[unsafe(no_mangle)]
pub extern "C" fn ucp_ep_modify_nb(_ep: *const AbiEp, _params: *const EpParams) -> *mut c_void {
    status_ptr(UCS_ERR_UNSUPPORTED)
}

/// `ucs_status_t ucp_ep_evaluate_perf(ucp_ep_h ep, const ucp_ep_evaluate_perf_param_t
/// *param, ucp_ep_evaluate_perf_attr_t *attr)`: `UCS_ERR_UNSUPPORTED` (rucx's lanes' models
/// are not offered as time estimates).
#[unsafe(no_mangle)]
pub extern "C" fn ucp_ep_evaluate_perf(
    _ep: *const AbiEp,
    _param: *const c_void,
    _attr: *mut c_void,
) -> Status {
    UCS_ERR_UNSUPPORTED
}

/// `ucs_status_t ucp_worker_set_am_handler(ucp_worker_h worker, uint16_t id,
/// ucp_am_callback_t cb, void *arg, uint32_t flags)`: UCX's first active-message API, not
/// served (`UCS_ERR_UNSUPPORTED`): `ucp_worker_set_am_recv_handler` is.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_worker_set_am_handler(
    _worker: *const AbiWorker,
    _id: u16,
    _cb: *const c_void,
    _arg: *mut c_void,
    _flags: u32,
) -> Status {
    UCS_ERR_UNSUPPORTED
}

/// `ucs_status_ptr_t ucp_am_send_nb(ucp_ep_h ep, uint16_t id, const void *buffer, size_t
/// count, ucp_datatype_t datatype, ucp_send_callback_t cb, unsigned flags)`: not served
/// (`UCS_ERR_UNSUPPORTED`): `ucp_am_send_nbx` is.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_am_send_nb(
    _ep: *const AbiEp,
    _id: u16,
    _buffer: *const c_void,
    _count: usize,
    _datatype: u64,
    _cb: SendCb,
    _flags: c_uint,
) -> *mut c_void {
    status_ptr(UCS_ERR_UNSUPPORTED)
}
