//! Active messages (`UCP_FEATURE_AM`): `ucp_worker_set_am_recv_handler`, `ucp_am_send_nbx`,
//! `ucp_am_recv_data_nbx` and `ucp_am_data_release`, over rucx's active messages
//! ([`rucx_ucp::Worker::set_am_handler`], [`rucx_ucp::Worker::am_send_queued`]).
//!
//! A handler is called from `ucp_worker_progress` with the message's header and payload, and
//! `param->recv_attr` says what the payload is:
//! - `UCP_AM_RECV_ATTR_FLAG_DATA`: the bytes came with the message (rucx's eager protocols);
//!   a handler that returns `UCS_INPROGRESS` keeps them until `ucp_am_data_release` (or
//!   hands them to `ucp_am_recv_data_nbx`, which copies them);
//! - `UCP_AM_RECV_ATTR_FLAG_RNDV`: `data` is a descriptor of a payload that stayed with the
//!   sender (rucx's rendezvous, for large payloads); the handler returns `UCS_INPROGRESS` and
//!   fetches it with `ucp_am_recv_data_nbx` into memory of its choice, or `UCS_OK` to drop it
//!   (the sender's request then ends with `UCS_ERR_REJECTED`, rucx's `PeerAborted`).
//!
//! `param->reply_ep` (with `UCP_AM_RECV_ATTR_FIELD_REPLY_EP`) is always given: an endpoint to
//! the sender, owned by the worker (never closed by the application). The send flags
//! `UCP_AM_SEND_FLAG_EAGER`/`_RNDV` are hints rucx's plan does not need (it picks the protocol
//! by size and memory); `UCP_AM_SEND_FLAG_COPY_HEADER` is what rucx does anyway (the header is
//! copied when posted). Contiguous and IOV datatypes ([`crate::iov`]), for the payload sent
//! and the buffer a payload is fetched into.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rucx_ucp::{AmMessage, AmPayload, EpId};

use crate::endpoint::AbiEp;
use crate::nbx::{CbKind, iov_buf, post, post_with, target_and_opts};
use crate::status::status_ptr;
use crate::types::*;
use crate::worker::AbiWorker;

/// A payload a handler kept (`UCS_INPROGRESS`): the pointer it was handed names it.
#[derive(Debug)]
enum Kept {
    /// Bytes that came with the message (`data` pointed at them).
    Here(Vec<u8>),
    /// A payload still at the sender (`data` pointed at this box).
    Remote(Box<AmPayload>),
}

impl Kept {
    fn addr(&self) -> usize {
        match self {
            Kept::Here(v) => v.as_ptr() as usize,
            Kept::Remote(b) => &**b as *const AmPayload as usize,
        }
    }
}

/// A worker's active-message state.
#[derive(Debug, Default)]
pub struct AmState {
    kept: RefCell<Vec<Kept>>,
    /// The endpoints handed to handlers as `reply_ep`, one per rucx endpoint.
    reply_eps: RefCell<HashMap<EpId, *mut AbiEp>>,
}

impl AmState {
    fn reply_ep(&self, w: *const AbiWorker, id: EpId) -> *mut AbiEp {
        *self
            .reply_eps
            .borrow_mut()
            .entry(id)
            .or_insert_with(|| Box::into_raw(Box::new(AbiEp { worker: w, id })))
    }

    /// Take the kept payload `data` names.
    fn take(&self, data: *mut c_void) -> Option<Kept> {
        let mut kept = self.kept.borrow_mut();
        let i = kept.iter().position(|k| k.addr() == data as usize)?;
        Some(kept.swap_remove(i))
    }
}

impl Drop for AmState {
    fn drop(&mut self) {
        for (_, ep) in self.reply_eps.get_mut().drain() {
            // SAFETY: made by `Box::into_raw` in `reply_ep`, owned by this state.
            drop(unsafe { Box::from_raw(ep) });
        }
    }
}

/// What a rucx handler needs of its C handler and worker.
struct Target {
    w: *const AbiWorker,
    watching: Arc<AtomicBool>,
    cb: unsafe extern "C" fn(
        *mut c_void,
        *const c_void,
        usize,
        *mut c_void,
        usize,
        *const AmRecvParam,
    ) -> Status,
    arg: *mut c_void,
}

// SAFETY: the rucx worker that owns the handler is single-threaded and owned by the
// `AbiWorker` at `w`; the handler runs from that worker's progress while `watching` is set
// (cleared by `ucp_worker_destroy` before the rucx worker goes). `arg` is the C caller's,
// handed back to its callback on that thread.
unsafe impl Send for Target {}

impl Target {
    fn deliver(&self, mut m: AmMessage) {
        if !self.watching.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: see `Send` above: live while `watching` is set.
        let w = unsafe { &*self.w };
        let len = m.len();
        let reply = w.extra.am.reply_ep(self.w, m.reply_ep);
        let header = std::mem::take(&mut m.header);
        let (mut kept, attr) = match m.take_payload() {
            AmPayload::Here(v) => (Kept::Here(v), UCP_AM_RECV_ATTR_FLAG_DATA),
            p @ AmPayload::Remote(_) => (Kept::Remote(Box::new(p)), UCP_AM_RECV_ATTR_FLAG_RNDV),
        };
        let data = match &mut kept {
            Kept::Here(v) => v.as_mut_ptr().cast::<c_void>(),
            Kept::Remote(b) => (&mut **b as *mut AmPayload).cast(),
        };
        let param = AmRecvParam {
            recv_attr: UCP_AM_RECV_ATTR_FIELD_REPLY_EP | attr,
            reply_ep: reply.cast(),
        };
        // Kept before the call: the handler may fetch the payload from inside it
        // (`ucp_am_recv_data_nbx`), which takes it from there.
        w.extra.am.kept.borrow_mut().push(kept);
        // SAFETY: the caller's handler, with the message's header and payload, valid for the
        // call (and after it, when it keeps the payload).
        let status = unsafe {
            (self.cb)(
                self.arg,
                header.as_ptr().cast(),
                header.len(),
                data,
                len,
                &param,
            )
        };
        if status != UCS_INPROGRESS {
            // Not kept by the handler: dropped (a remote payload dropped unfetched releases
            // its sender), unless the handler fetched it already.
            drop(w.extra.am.take(data));
        }
    }
}

/// `ucs_status_t ucp_worker_set_am_recv_handler(ucp_worker_h worker, const
/// ucp_am_handler_param_t *param)`: the handler of active message `param->id` (< 65536;
/// `cb` NULL: messages with that id are dropped from now on).
///
/// # Safety
/// `worker` NULL or live; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_set_am_recv_handler(
    worker: *const AbiWorker,
    param: *const AmHandlerParam,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(w), Some(p)) = (unsafe { worker.as_ref() }, unsafe { param.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    let m = p.field_mask;
    if m & !UCP_AM_HANDLER_PARAM_FIELDS_KNOWN != 0 || m & UCP_AM_HANDLER_PARAM_FIELD_ID == 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    let Ok(id) = u16::try_from(p.id) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if m & UCP_AM_HANDLER_PARAM_FIELD_FLAGS != 0 && p.flags & !UCP_AM_FLAGS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    let cb = if m & UCP_AM_HANDLER_PARAM_FIELD_CB != 0 {
        p.cb
    } else {
        None
    };
    let arg = if m & UCP_AM_HANDLER_PARAM_FIELD_ARG != 0 {
        p.arg
    } else {
        std::ptr::null_mut()
    };
    match cb {
        Some(cb) => {
            let t = Target {
                w: worker,
                watching: w.watching.clone(),
                cb,
                arg,
            };
            w.worker.set_am_handler(id, move |_, m| t.deliver(m));
        }
        None => w.worker.set_am_handler(id, move |_, m| {
            tracing::debug!(
                "active message {id} from {} dropped: handler removed",
                m.reply_ep
            );
        }),
    }
    UCS_OK
}

/// `ucs_status_ptr_t ucp_am_send_nbx(ucp_ep_h ep, unsigned id, const void *header, size_t
/// header_length, const void *buffer, size_t count, const ucp_request_param_t *param)`.
///
/// # Safety
/// `ep` NULL or live; `header` `header_length` readable bytes (for the call); `buffer`
/// `count` elements readable until the send ends; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_am_send_nbx(
    ep: *const AbiEp,
    id: c_uint,
    header: *const c_void,
    header_length: usize,
    buffer: *const c_void,
    count: usize,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    let (ep, opts) = match unsafe { target_and_opts(ep, param, CbKind::Send) } {
        Ok(t) => t,
        Err(s) => return status_ptr(s),
    };
    let Ok(id) = u16::try_from(id) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if opts.flags & !UCP_AM_SEND_FLAGS_KNOWN != 0 || (header_length > 0 && header.is_null()) {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let hdr: &[u8] = if header_length == 0 {
        &[]
    } else {
        // SAFETY: the caller's promise: `header_length` readable bytes for the call (rucx
        // copies the header when posted).
        unsafe { std::slice::from_raw_parts(header.cast(), header_length) }
    };
    let to = ep.id;
    if opts.is_iov() {
        // SAFETY: the caller's promise on the entries and their memory.
        return match unsafe { iov_buf(ep.worker(), buffer, count, true) } {
            Ok((buf, fin, data)) => post_with(
                ep.worker(),
                &opts,
                true,
                fin,
                data,
                |w, token| w.am_send_queued(to, id, hdr, buf, token),
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
        |w, token| w.am_send_queued(to, id, hdr, buf, token),
        |_| {},
    )
}

/// `ucs_status_ptr_t ucp_am_recv_data_nbx(ucp_worker_h worker, void *data_desc, void *buffer,
/// size_t count, const ucp_request_param_t *param)`: receive a payload a handler kept
/// (`UCS_INPROGRESS`) into `buffer`; a descriptor that is not one is refused
/// (`UCS_ERR_INVALID_PARAM`). A longer payload fills the buffer and ends with
/// `UCS_ERR_MESSAGE_TRUNCATED`.
///
/// # Safety
/// `worker` NULL or live; `buffer` `count` elements writable until the receive ends; `param`
/// NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_am_recv_data_nbx(
    worker: *const AbiWorker,
    data_desc: *mut c_void,
    buffer: *mut c_void,
    count: usize,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    let (w, opts) = match unsafe { target_and_opts(worker, param, CbKind::Length) } {
        Ok(t) => t,
        Err(s) => return status_ptr(s),
    };
    // SAFETY: the caller's promise on the buffer (or entries, and their memory).
    let planned = unsafe {
        if opts.is_iov() {
            iov_buf(w, buffer, count, false)
        } else {
            opts.contig_buf(buffer, count)
                .map(|b| (b, crate::tag::Finish::Recv, None))
        }
    };
    let (buf, fin, data) = match planned {
        Ok(p) => p,
        Err(s) => return status_ptr(s),
    };
    let payload = match w.extra.am.take(data_desc) {
        Some(Kept::Here(v)) => AmPayload::Here(v),
        Some(Kept::Remote(b)) => *b,
        None => return status_ptr(UCS_ERR_INVALID_PARAM),
    };
    post_with(
        w,
        &opts,
        false,
        fin,
        data,
        |rw, token| rw.am_recv_queued(payload, buf, token),
        |_| {},
    )
}

/// `void ucp_am_data_release(ucp_worker_h worker, void *data)`: drop a payload a handler kept
/// (a remote one releases its sender); anything else is ignored.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_am_data_release(worker: *const AbiWorker, data: *mut c_void) {
    // SAFETY: the caller's promise.
    if let Some(w) = unsafe { worker.as_ref() } {
        drop(w.extra.am.take(data));
    }
}
