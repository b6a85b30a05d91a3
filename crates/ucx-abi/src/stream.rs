//! Streams (`UCP_FEATURE_STREAM`): `ucp_stream_send_nbx` and `ucp_stream_recv_nbx` over
//! rucx's ordered byte stream per endpoint ([`rucx_ucp::Worker::stream_send_queued`]).
//!
//! A send completes once every byte was handed to the transport. A receive with
//! `UCP_STREAM_RECV_FLAG_WAITALL` completes with exactly `count` elements; without it, as soon
//! as bytes are at hand (its length says how many; into GPU memory, or with elements larger
//! than a byte, it waits for all, so that a receive never ends inside an element). Receives of
//! one endpoint are filled in the order they were posted. Contiguous and IOV datatypes
//! ([`crate::iov`]: `count` is the number of entries, lengths are bytes, and a receive without
//! `WAITALL` may end inside an entry, as UCX's does); generic ones: `UCS_ERR_UNSUPPORTED`.

use std::cell::RefCell;
use std::ffi::{c_uint, c_void};

use rucx_ucp::EpId;

use crate::endpoint::AbiEp;
use crate::nbx::{CbKind, Opts, iov_buf, post, post_with};
use crate::status::{status_of, status_ptr};
use crate::types::*;
use crate::worker::AbiWorker;

/// `ucs_status_ptr_t ucp_stream_send_nbx(ucp_ep_h ep, const void *buffer, size_t count,
/// const ucp_request_param_t *param)`.
///
/// # Safety
/// `ep` NULL or live; `buffer` `count` elements readable until the send ends; `param` NULL or
/// valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_send_nbx(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    let opts = match unsafe { Opts::read(param, CbKind::Send) } {
        Ok(o) => o,
        Err(s) => return status_ptr(s),
    };
    // SAFETY: forwarded.
    unsafe { stream_send(ep, buffer, count, opts) }
}

/// The stream send of `ucp_stream_send_nbx` and `ucp_stream_send_nb` ([`crate::compat`]),
/// with the options read from either.
///
/// # Safety
/// As [`ucp_stream_send_nbx`].
pub(crate) unsafe fn stream_send(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    opts: Opts,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(ep) = (unsafe { ep.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    let id = ep.id;
    if opts.is_iov() {
        // SAFETY: the caller's promise on the entries and their memory.
        return match unsafe { iov_buf(ep.worker(), buffer, count, true) } {
            Ok((buf, fin, data)) => post_with(
                ep.worker(),
                &opts,
                true,
                fin,
                data,
                |w, token| w.stream_send_queued(id, buf, token),
                |_| {},
            ),
            Err(s) => status_ptr(s),
        };
    }
    // SAFETY: the caller's promise on the buffer.
    let buf = match unsafe { opts.contig_buf(buffer, count) } {
        Ok(b) => b,
        Err(s) => return status_ptr(s),
    };
    post(
        ep.worker(),
        &opts,
        true,
        |w, token| w.stream_send_queued(id, buf, token),
        |_| {},
    )
}

/// `ucs_status_ptr_t ucp_stream_recv_nbx(ucp_ep_h ep, void *buffer, size_t count, size_t
/// *length, const ucp_request_param_t *param)`: `*length` is the byte length received when
/// the receive completed in place (NULL returned).
///
/// # Safety
/// `ep` NULL or live; `buffer` `count` elements writable until the receive ends; `length`
/// writable; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_recv_nbx(
    ep: *const AbiEp,
    buffer: *mut c_void,
    count: usize,
    length: *mut usize,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    let opts = match unsafe { Opts::read(param, CbKind::Length) } {
        Ok(o) => o,
        Err(s) => return status_ptr(s),
    };
    // SAFETY: forwarded.
    unsafe { stream_recv(ep, buffer, count, length, opts) }
}

/// The stream receive of `ucp_stream_recv_nbx` and `ucp_stream_recv_nb` ([`crate::compat`]),
/// with the options read from either.
///
/// # Safety
/// As [`ucp_stream_recv_nbx`].
pub(crate) unsafe fn stream_recv(
    ep: *const AbiEp,
    buffer: *mut c_void,
    count: usize,
    length: *mut usize,
    opts: Opts,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(ep) = (unsafe { ep.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if length.is_null() || opts.flags & !UCP_STREAM_RECV_FLAG_WAITALL != 0 {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let id = ep.id;
    if opts.is_iov() {
        // Bytes are the elements of an IOV stream: without WAITALL, what is at hand.
        let partial = opts.flags & UCP_STREAM_RECV_FLAG_WAITALL == 0;
        // SAFETY: the caller's promise on the entries and their memory.
        return match unsafe { iov_buf(ep.worker(), buffer, count, false) } {
            Ok((buf, fin, data)) => post_with(
                ep.worker(),
                &opts,
                false,
                fin,
                data,
                |w, token| w.stream_recv_queued(id, buf, partial, token),
                // SAFETY: checked non-NULL, writable by the caller's promise.
                |c| unsafe { *length = c.len },
            ),
            Err(s) => status_ptr(s),
        };
    }
    // SAFETY: the caller's promise on the buffer.
    let buf = match unsafe { opts.contig_buf(buffer, count) } {
        Ok(b) => b,
        Err(s) => return status_ptr(s),
    };
    let elem_is_byte = (opts.dt >> UCP_DATATYPE_SHIFT) == 1;
    let partial = opts.flags & UCP_STREAM_RECV_FLAG_WAITALL == 0 && elem_is_byte;
    post(
        ep.worker(),
        &opts,
        false,
        |w, token| w.stream_recv_queued(id, buf, partial, token),
        // SAFETY: checked non-NULL, writable by the caller's promise.
        |c| unsafe { *length = c.len },
    )
}

/// What the stream calls keep per worker ([`crate::extra::Extra`]): the data handed out by
/// `ucp_stream_recv_data_nb` until released, and the endpoints handed out with their user
/// data, for `ucp_stream_worker_poll`.
#[derive(Debug, Default)]
pub struct StreamState {
    kept: RefCell<Vec<Vec<u8>>>,
    eps: RefCell<Vec<(EpId, *mut AbiEp, *mut c_void)>>,
}

impl StreamState {
    /// Endpoint `ep` (rucx endpoint `id`) was handed out, with `user_data`.
    pub fn note_ep(&self, id: EpId, ep: *mut AbiEp, user_data: *mut c_void) {
        self.eps.borrow_mut().push((id, ep, user_data));
    }

    /// Endpoint `ep` is closed.
    pub fn forget_ep(&self, ep: *mut AbiEp) {
        self.eps.borrow_mut().retain(|e| e.1 != ep);
    }
}

/// `ucp_stream_poll_ep_t`.
#[repr(C)]
#[derive(Debug)]
pub struct StreamPollEp {
    pub ep: *mut AbiEp,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub reserved: [u8; 16],
}

/// `ucs_status_ptr_t ucp_stream_recv_data_nb(ucp_ep_h ep, size_t *length)`: the bytes of
/// the endpoint's stream that arrived and no receive took, all of them, in order, without a
/// receive (`*length` says how many; `ucp_stream_data_release` gives them back); NULL when
/// there are none.
///
/// # Safety
/// `ep` NULL or live; `length` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_recv_data_nb(
    ep: *const AbiEp,
    length: *mut usize,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(e) = (unsafe { ep.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if length.is_null() {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let w = e.worker();
    match w.worker.stream_take(e.id) {
        Ok(Some(v)) => {
            // SAFETY: checked non-NULL, writable by the caller's promise.
            unsafe { *length = v.len() };
            let p = v.as_ptr() as *mut c_void;
            w.extra.streams.kept.borrow_mut().push(v);
            p
        }
        Ok(None) => std::ptr::null_mut(),
        Err(err) => status_ptr(status_of(&err)),
    }
}

/// `void ucp_stream_data_release(ucp_ep_h ep, void *data)`: give back what
/// `ucp_stream_recv_data_nb` handed out; anything else is ignored.
///
/// # Safety
/// `ep` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_data_release(ep: *const AbiEp, data: *mut c_void) {
    // SAFETY: the caller's promise.
    if let Some(e) = unsafe { ep.as_ref() } {
        let mut kept = e.worker().extra.streams.kept.borrow_mut();
        if let Some(i) = kept
            .iter()
            .position(|v| std::ptr::eq(v.as_ptr(), data.cast::<u8>()))
        {
            kept.swap_remove(i);
        }
    }
}

/// `ssize_t ucp_stream_worker_poll(ucp_worker_h worker, ucp_stream_poll_ep_t *poll_eps,
/// size_t max_eps, unsigned flags)`: up to `max_eps` endpoints whose streams hold bytes no
/// receive took, each with the user data it was created with; how many (a negative status
/// for bad arguments). It does not progress the worker.
///
/// # Safety
/// `worker` NULL or live; `poll_eps` `max_eps` writable entries (or NULL with 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_worker_poll(
    worker: *const AbiWorker,
    poll_eps: *mut StreamPollEp,
    max_eps: usize,
    flags: c_uint,
) -> isize {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM as isize;
    };
    if flags != 0 || (poll_eps.is_null() && max_eps > 0) {
        return UCS_ERR_INVALID_PARAM as isize;
    }
    let eps = w.extra.streams.eps.borrow();
    let mut n = 0;
    for id in w.worker.streams_ready() {
        if n == max_eps {
            break;
        }
        if let Some(&(_, ep, user_data)) = eps.iter().find(|e| e.0 == id) {
            // SAFETY: `n < max_eps` writable entries (the caller's promise).
            unsafe {
                poll_eps.add(n).write(StreamPollEp {
                    ep,
                    user_data,
                    flags: 0,
                    reserved: [0; 16],
                })
            };
            n += 1;
        }
    }
    n as isize
}

/// `ucs_status_t ucp_stream_recv_request_test(void *request, size_t *length_p)`: the
/// request's status, and once it ended well the bytes it received.
///
/// # Safety
/// `request` a live request of this library; `length_p` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_stream_recv_request_test(
    request: *mut c_void,
    length_p: *mut usize,
) -> Status {
    // SAFETY: forwarded.
    match unsafe { crate::request::state(request) } {
        Ok((s, info)) => {
            if s == UCS_OK && !length_p.is_null() {
                // SAFETY: checked non-NULL, writable by the caller's promise.
                unsafe { *length_p = info.length };
            }
            s
        }
        Err(s) => s,
    }
}
