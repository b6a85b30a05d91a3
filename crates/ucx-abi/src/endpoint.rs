//! `ucp_ep_h`: a rucx endpoint of a worker, created from a peer's worker address (the bytes
//! `ucp_worker_query` handed out on the peer, exchanged by Open MPI's modex), closed by
//! flushing the worker's sends.
//!
//! # Error handlers
//! An endpoint created with `UCP_EP_PARAM_FIELD_ERR_HANDLER` (a non-NULL `cb`) has its handler
//! called as UCX calls it: `cb(arg, ep, status)` once, from `ucp_worker_progress` only (never
//! from inside another call, flush and close included), when its peer fails (connection broken,
//! process gone: `UCS_ERR_CONNECTION_RESET`; silent past `RUCX_PEER_TIMEOUT`:
//! `UCS_ERR_ENDPOINT_TIMEOUT`) or closes its rucx endpoint, after the requests bound to it
//! ended with the error (their callbacks ran first, in the same progress call: UCX purges a
//! failed endpoint's requests before it calls the handler). `arg` is `user_data` when
//! `UCP_EP_PARAM_FIELD_USER_DATA` is given too, `err_handler.arg` otherwise (UCX's rule). An
//! endpoint the application closed is never reported, even when it failed before the close and
//! the report was still pending. The handler may close the endpoint (`ucp_ep_close_nbx` with
//! `UCP_EP_CLOSE_FLAG_FORCE`, the usual answer), or others. As in UCX, the handler is called in
//! either error mode (`UCP_ERR_HANDLING_MODE_NONE` or `_PEER`: rucx ends the requests of a
//! failed peer with an error in both).

use std::ffi::{c_uint, c_void};
use std::sync::atomic::Ordering;

use rucx_ucp::EpId;

use crate::status::{status_of, status_ptr};
use crate::types::*;
use crate::worker::{ADDR_MAGIC, AbiWorker, EpErrHandler, flush};

/// What a `ucp_ep_h` points to.
#[derive(Debug)]
pub struct AbiEp {
    pub worker: *const AbiWorker,
    pub id: EpId,
}

impl AbiEp {
    pub fn worker(&self) -> &AbiWorker {
        // SAFETY: UCX's rule, which callers keep: a worker outlives its endpoints.
        unsafe { &*self.worker }
    }
}

/// Longest address accepted (a sanity bound on the length prefix).
const ADDR_MAX: usize = 1 << 20;

/// rucx's packed address inside a worker address this library handed out.
///
/// # Safety
/// `p` points at an address from `ucp_worker_query`/`ucp_worker_get_address` (its 8-byte
/// prefix is read first, then as many bytes as the prefix says, once it checked out).
pub(crate) unsafe fn unpack_address<'a>(p: *const c_void) -> Option<&'a [u8]> {
    if p.is_null() {
        return None;
    }
    let mut head = [0u8; 8];
    // SAFETY: an address is at least its 8-byte prefix (the caller's promise).
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), head.as_mut_ptr(), 8) };
    let magic = u32::from_le_bytes(head[..4].try_into().ok()?);
    let len = u32::from_le_bytes(head[4..].try_into().ok()?) as usize;
    if magic != ADDR_MAGIC || len > ADDR_MAX {
        return None;
    }
    // SAFETY: the prefix checked out: `len` bytes follow it.
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(8), len) })
}

/// `ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h
/// *ep_p)`: by remote worker address, or client/server by socket address or connection
/// request (`crate::listener`). Error handling modes `NONE` and `PEER` are accepted (others are
/// refused); an error handler is called as the module says.
///
/// # Safety
/// `worker` NULL or live; `params` NULL or valid, its address one handed out by this library;
/// `ep_p` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_create(
    worker: *const AbiWorker,
    params: *const EpParams,
    ep_p: *mut *mut AbiEp,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(w), Some(p)) = (unsafe { worker.as_ref() }, unsafe { params.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if ep_p.is_null() || p.field_mask & !UCP_EP_PARAM_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    let client_server = p.field_mask
        & (UCP_EP_PARAM_FIELD_SOCK_ADDR
            | UCP_EP_PARAM_FIELD_CONN_REQUEST
            | UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR)
        != 0;
    if !client_server && p.field_mask & UCP_EP_PARAM_FIELD_REMOTE_ADDRESS == 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if p.field_mask & UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE != 0
        && !matches!(
            p.err_mode,
            UCP_ERR_HANDLING_MODE_NONE | UCP_ERR_HANDLING_MODE_PEER
        )
    {
        return UCS_ERR_INVALID_PARAM;
    }
    let handler = if p.field_mask & UCP_EP_PARAM_FIELD_ERR_HANDLER != 0 {
        p.err_handler.cb.map(|cb| {
            let arg = if p.field_mask & UCP_EP_PARAM_FIELD_USER_DATA != 0 {
                p.user_data
            } else {
                p.err_handler.arg
            };
            (cb, arg)
        })
    } else {
        None
    };
    let connected = if client_server {
        // SAFETY: the caller's promise on the socket address or connection request.
        match unsafe { crate::listener::connect(w, p) } {
            Ok(id) => Ok(id),
            Err(s) => return s,
        }
    } else {
        // SAFETY: the caller's promise on the address.
        let Some(addr) = (unsafe { unpack_address(p.address) }) else {
            return UCS_ERR_INVALID_ADDR;
        };
        w.worker.connect(addr)
    };
    match connected {
        Ok(id) => {
            let ep = Box::into_raw(Box::new(AbiEp { worker, id }));
            if let Some((cb, arg)) = handler {
                if let Err(e) = watch(w, worker, id) {
                    // SAFETY: just made by `Box::into_raw`, never handed out.
                    drop(unsafe { Box::from_raw(ep) });
                    eprintln!("rucx libucp: ucp_ep_create failed: {e}");
                    return status_of(&e);
                }
                w.err_handlers
                    .borrow_mut()
                    .entry(id)
                    .or_default()
                    .push(EpErrHandler { ep, cb, arg });
            }
            let user_data = if p.field_mask & UCP_EP_PARAM_FIELD_USER_DATA != 0 {
                p.user_data
            } else {
                std::ptr::null_mut()
            };
            w.extra.streams.note_ep(id, ep, user_data);
            // SAFETY: checked non-NULL, writable by the caller's promise.
            unsafe { *ep_p = ep };
            UCS_OK
        }
        Err(e) => {
            eprintln!("rucx libucp: ucp_ep_create failed: {e}");
            status_of(&e)
        }
    }
}

/// A worker's address, for its rucx worker's error handler.
struct WorkerPtr(*const AbiWorker);

impl WorkerPtr {
    fn get(&self) -> *const AbiWorker {
        self.0
    }
}

// SAFETY: the pointer is only used by the rucx worker's error handler, which that worker (owned
// by this `AbiWorker`, single-threaded) calls from its progress, while the `AbiWorker` is live
// (`ucp_worker_destroy` clears `watching` before it drops the rucx worker).
unsafe impl Send for WorkerPtr {}

/// Have rucx tell worker `wp` (`w`) when endpoint `id` fails (from its progress).
fn watch(w: &AbiWorker, wp: *const AbiWorker, id: EpId) -> rucx_ucs::Result<()> {
    let wp = WorkerPtr(wp);
    let watching = w.watching.clone();
    w.worker.set_ep_error_handler(id, move |_, id, err| {
        if !watching.load(Ordering::Relaxed) {
            return; // `ucp_worker_destroy` is dropping the rucx worker
        }
        // SAFETY: see `WorkerPtr`: the `AbiWorker` owns the rucx worker calling this, and is
        // live while `watching` is set.
        let w = unsafe { &*wp.get() };
        w.note_failure(id, err);
    })
}

/// Close an endpoint: its error handler is dropped (never called from now on), then flush
/// (unless forced), then free it.
///
/// # Safety
/// `ep` NULL or live, closed once.
unsafe fn close(ep: *mut AbiEp, force: bool) -> *mut c_void {
    if ep.is_null() {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    // SAFETY: made by `Box::into_raw` in `ucp_ep_create`, closed once.
    let abi_ep = unsafe { Box::from_raw(ep) };
    abi_ep.worker().extra.streams.forget_ep(ep);
    {
        let mut hs = abi_ep.worker().err_handlers.borrow_mut();
        if let Some(list) = hs.get_mut(&abi_ep.id) {
            list.retain(|h| h.ep != ep);
            if list.is_empty() {
                hs.remove(&abi_ep.id);
            }
        }
    }
    let w = abi_ep.worker();
    if w.worker.is_connecting(abi_ep.id) {
        // Not connected yet (a client by socket address): nothing went out, and a flush would
        // wait for the server. The connection is dropped; what waited for it ends with
        // `UCS_ERR_CANCELED` (delivered by the next progress).
        drop(w.worker.close(abi_ep.id, rucx_ucp::CloseMode::Force));
        return std::ptr::null_mut();
    }
    if !force {
        flush(w);
    }
    std::ptr::null_mut()
}

/// `ucs_status_ptr_t ucp_ep_close_nb(ucp_ep_h ep, unsigned mode)`: completes in place.
///
/// # Safety
/// `ep` NULL or live, closed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_close_nb(ep: *mut AbiEp, mode: c_uint) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { close(ep, mode == UCP_EP_CLOSE_MODE_FORCE) }
}

/// `ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param)`:
/// completes in place; `UCP_EP_CLOSE_FLAG_FORCE` in `param->flags` skips the flush.
///
/// # Safety
/// `ep` NULL or live, closed once; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_close_nbx(
    ep: *mut AbiEp,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let force = unsafe { param.as_ref() }.is_some_and(|p| {
        p.op_attr_mask & UCP_OP_ATTR_FIELD_FLAGS != 0 && p.flags & UCP_EP_CLOSE_FLAG_FORCE != 0
    });
    // SAFETY: forwarded.
    unsafe { close(ep, force) }
}

/// `ucs_status_ptr_t ucp_disconnect_nb(ucp_ep_h ep)`: a flushing close.
///
/// # Safety
/// `ep` NULL or live, closed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_disconnect_nb(ep: *mut AbiEp) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { close(ep, false) }
}

/// `void ucp_ep_destroy(ucp_ep_h ep)`: a flushing close.
///
/// # Safety
/// `ep` NULL or live, closed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_destroy(ep: *mut AbiEp) {
    // SAFETY: forwarded.
    let _ = unsafe { close(ep, false) };
}

/// `ucs_status_ptr_t ucp_ep_flush_nb(ucp_ep_h ep, unsigned flags, ucp_send_callback_t cb)`:
/// a flush of the endpoint ([`crate::flush`]): NULL when nothing was outstanding, else a
/// request that progress completes (`cb` called then) once the worker's operations posted
/// before it ended and the endpoint's lanes were flushed; on an endpoint still connecting (a
/// client by socket address), once it is connected and what was posted on it before is out.
/// It ends with the endpoint's error when it failed, and with the error of a put, get or
/// atomic on it that failed after it was posted (an implicit one's too).
///
/// # Safety
/// `ep` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_flush_nb(
    ep: *const AbiEp,
    _flags: c_uint,
    cb: SendCb,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { ep.as_ref() } {
        Some(ep) => crate::flush::post(
            ep.worker(),
            Some(ep.id),
            &crate::rma::plain(crate::worker::Callback::Send(cb)),
        ),
        None => status_ptr(UCS_ERR_INVALID_PARAM),
    }
}

/// `ucs_status_ptr_t ucp_ep_flush_nbx(ucp_ep_h ep, const ucp_request_param_t *param)`: as
/// [`ucp_ep_flush_nb`], with the request parameters.
///
/// # Safety
/// `ep` NULL or live; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_flush_nbx(
    ep: *const AbiEp,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    match unsafe { crate::nbx::target_and_opts(ep, param, crate::nbx::CbKind::Send) } {
        Ok((e, opts)) => crate::flush::post(e.worker(), Some(e.id), &opts),
        Err(s) => status_ptr(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_prefix_is_checked() {
        let mut good = Vec::new();
        good.extend_from_slice(&ADDR_MAGIC.to_le_bytes());
        good.extend_from_slice(&3u32.to_le_bytes());
        good.extend_from_slice(b"abc");
        // SAFETY: each buffer is at least 8 bytes and holds what its prefix says.
        unsafe {
            assert_eq!(unpack_address(good.as_ptr().cast()), Some(&b"abc"[..]));
            let mut bad = good.clone();
            bad[0] ^= 1;
            assert_eq!(unpack_address(bad.as_ptr().cast()), None);
            let mut huge = good.clone();
            huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
            assert_eq!(unpack_address(huge.as_ptr().cast()), None);
            assert_eq!(unpack_address(std::ptr::null()), None);
        }
    }
}
