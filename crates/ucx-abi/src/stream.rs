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

use std::ffi::c_void;

use crate::endpoint::AbiEp;
use crate::nbx::{CbKind, iov_buf, post, post_with, target_and_opts};
use crate::status::status_ptr;
use crate::types::*;

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
    let (ep, opts) = match unsafe { target_and_opts(ep, param, CbKind::Send) } {
        Ok(t) => t,
        Err(s) => return status_ptr(s),
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
    let (ep, opts) = match unsafe { target_and_opts(ep, param, CbKind::Length) } {
        Ok(t) => t,
        Err(s) => return status_ptr(s),
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
