//! `ucp_worker_h`: a rucx worker, the operations in flight on it and their completion.
//!
//! Every operation in flight is an entry of the worker's table ([`Ops`]), and a queued request
//! of the rucx worker whose token is the entry's index; except header receives, the common
//! contiguous receive: its callback lives in its request's header ([`crate::request`]) and its
//! token is the request's address ([`HEADER_TOKEN`]), so it needs no entry (it is canceled by
//! that token). Progress (`ucp_worker_progress`)
//! progresses the rucx worker, then delivers the operations that ended, and only those: the
//! rucx worker queued their tokens as they ended. A delivered request's header gets the status
//! (and receive information), and the caller's callback runs unless the request was freed
//! first. Callbacks run only from progress, never inside the call that posted the operation
//! (an operation that ended while posted and has a callback waits in [`AbiWorker::ready`] for
//! the next progress), and with nothing of the worker borrowed, so a callback may post, free or
//! cancel.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rucx_ucp::{Completion, EpId, QueuedReq, Worker};
use rucx_ucs::{Error, Result};

use crate::context::{AbiContext, fill_name};
use crate::request;
use crate::status::{status_of, status_ptr};
use crate::tag::Finish;
use crate::types::*;

/// The token of a header receive is its request's address with this bit set (table tokens are
/// small indices, never with it).
pub const HEADER_TOKEN: u64 = 1 << 63;

/// The token in [`AbiWorker::ready`] that says endpoints failed ([`AbiWorker::failed`]): a
/// header token no request has (requests are aligned: bit 0 of their address is clear).
pub const EP_FAILED_TOKEN: u64 = HEADER_TOKEN | 1;

/// The token of the header receive whose request is `user`.
#[inline(always)]
pub fn header_token(user: *mut c_void) -> u64 {
    HEADER_TOKEN | user as usize as u64
}

/// What a `ucp_worker_h` points to.
#[derive(Debug)]
pub struct AbiWorker {
    pub ctx: *const AbiContext,
    pub worker: Worker,
    pub ops: RefCell<Ops>,
    /// Operations that ended outside progress (while posted, or a probed message before it
    /// was received), delivered by the next progress: their tokens and ends.
    pub ready: RefCell<Vec<(u64, Result<Completion>)>>,
    /// The list the rucx worker's queued ends are taken into (kept for its memory).
    pub ended: RefCell<Vec<(u64, Result<Completion>)>>,
    /// The last host range this worker's posts hit ([`crate::memtype`]).
    pub last_host: crate::memtype::LastHost,
    /// The error handlers of the open endpoints that have one, by rucx endpoint (several
    /// `ucp_ep_h` may share one: endpoints created to the same worker address).
    pub err_handlers: RefCell<HashMap<EpId, Vec<EpErrHandler>>>,
    /// Endpoints that failed and have a handler, to report from the next `ucp_worker_progress`
    /// (after the ends of their requests); [`EP_FAILED_TOKEN`] in `ready` says there are some.
    pub failed: RefCell<Vec<(EpId, Error)>>,
    /// Cleared when the worker is destroyed, before its rucx worker (whose drop may progress):
    /// the rucx error handlers, which point back to this worker, then do nothing.
    pub watching: Arc<AtomicBool>,
    /// What the client/server, stream, active-message and wake-up calls keep per worker
    /// ([`crate::extra`]).
    pub extra: crate::extra::Extra,
    /// The flushes in flight ([`crate::flush`]).
    pub flushes: RefCell<Vec<crate::flush::FlushOp>>,
}

/// An endpoint's error handler (`ucp_err_handler_t`, with `ucp_ep_params_t::user_data` as its
/// argument when both were given, as UCX does).
#[derive(Debug, Clone, Copy)]
pub struct EpErrHandler {
    pub ep: *mut crate::endpoint::AbiEp,
    pub cb: ErrHandlerCb,
    pub arg: *mut c_void,
}

/// How a request's end is told to its caller.
#[derive(Debug, Clone, Copy)]
pub enum Callback {
    None,
    Send(SendCb),
    SendNbx(SendNbxCb, *mut c_void),
    Recv(RecvCb),
    RecvNbx(RecvNbxCb, *mut c_void),
    /// A stream receive's or an active message's data receive: the length received.
    Length(LengthCb, *mut c_void),
    /// `ucp_stream_recv_nb`'s callback: the length received.
    StreamRecv(StreamRecvCb),
}

/// An operation in flight: the request it completes, its callback, what to make of its
/// result, and our buffer when it has one.
#[derive(Debug)]
pub struct Pending {
    /// NULL for a message a probe took out of matching that no receive took yet.
    pub user: *mut c_void,
    pub cb: Callback,
    pub fin: Finish,
    /// Our buffer (generic datatypes, probed messages), which rucx fills or sends from.
    pub data: Option<Vec<u8>>,
    /// The rucx request, while it runs (for cancel).
    pub req: Option<QueuedReq>,
    pub send: bool,
    /// The end of a probed message's receive that ended before a receive took the message
    /// (boxed: the table's entries stay small, and this is rare).
    pub ended: Option<Box<Result<Completion>>>,
}

/// The operations in flight of a worker, by token: a table of entries and a list of free
/// ones (tokens are dense and reused: no hashing, no allocation once the table has grown to
/// the largest number in flight).
#[derive(Debug, Default)]
pub struct Ops {
    slots: Vec<Option<Pending>>,
    free: Vec<u64>,
    /// Sends among them (for flush).
    sends: usize,
    /// The number of each entry's send, by token (valid while the entry is a send), in the
    /// order they were posted: a flush waits for the sends numbered below its own
    /// ([`sends_before`](Self::sends_before)).
    seqs: Vec<u64>,
    /// The number the next send gets.
    next_seq: u64,
}

impl Ops {
    /// The token the next [`fill`](Self::fill) takes.
    pub fn vacant(&self) -> u64 {
        self.free.last().copied().unwrap_or(self.slots.len() as u64)
    }

    /// Store `p` under the token [`vacant`](Self::vacant) returned (nothing was stored since).
    #[inline(always)]
    pub fn fill(&mut self, token: u64, p: Pending) {
        if self.free.last() == Some(&token) {
            self.free.pop();
        } else {
            debug_assert_eq!(token, self.slots.len() as u64, "the vacant token");
            self.slots.push(None);
            self.seqs.push(0);
        }
        if p.send {
            self.sends += 1;
            self.seqs[token as usize] = self.next_seq;
            self.next_seq += 1;
        }
        self.slots[token as usize] = Some(p);
    }

    #[inline]
    pub fn get_mut(&mut self, token: u64) -> Option<&mut Pending> {
        self.slots.get_mut(token as usize)?.as_mut()
    }

    #[inline(always)]
    pub fn remove(&mut self, token: u64) -> Option<Pending> {
        let p = self.slots.get_mut(token as usize)?.take()?;
        self.sends -= usize::from(p.send);
        self.free.push(token);
        Some(p)
    }

    /// The number the next send gets (a flush posted now waits for the sends below it).
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// True while a send numbered below `seq` is in flight.
    pub fn sends_before(&self, seq: u64) -> bool {
        self.sends > 0
            && self
                .slots
                .iter()
                .zip(&self.seqs)
                .any(|(s, &q)| q < seq && s.as_ref().is_some_and(|p| p.send))
    }

    /// Entries in the table.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

impl AbiWorker {
    pub fn context(&self) -> &AbiContext {
        // SAFETY: UCX's rule, which callers keep: a context outlives its workers.
        unsafe { &*self.ctx }
    }

    /// `ucp_worker_progress`: progress once and deliver what ended, then report the endpoints
    /// that failed to their error handlers; the number of events.
    #[inline(always)]
    pub fn progress(&self) -> usize {
        self.progress_with::<true>()
    }

    /// Progress once and deliver what ended, but keep endpoint failures for the next
    /// `ucp_worker_progress` (for the calls that progress inside: flush, close).
    pub fn progress_quiet(&self) -> usize {
        self.progress_with::<false>()
    }

    #[inline(always)]
    fn progress_with<const REPORT: bool>(&self) -> usize {
        let (n, completed) = self.worker.progress_queued();
        if !completed && self.ready.borrow().is_empty() {
            return n;
        }
        n + self.deliver_ended::<REPORT>()
    }

    /// Deliver what ended ([`deliver_ends`](Self::deliver_ends)), then move the flushes in
    /// flight along (what ended may be what they wait for); how many.
    #[inline(always)]
    fn deliver_ended<const REPORT: bool>(&self) -> usize {
        let n = self.deliver_ends::<REPORT>();
        if self.flushes.borrow().is_empty() {
            n
        } else {
            n + self.advance_flushes()
        }
    }

    /// Deliver what ended (outside progress, or queued by the rucx worker); how many. Endpoint
    /// failures are reported after the ends of the requests (UCX's order: a failed endpoint's
    /// requests are purged, with the error, before its error handler is called), when `REPORT`.
    #[inline(never)]
    fn deliver_ends<const REPORT: bool>(&self) -> usize {
        let mut n = 0;
        if !self.ready.borrow().is_empty() {
            let mut ready = std::mem::take(&mut *self.ready.borrow_mut());
            let mut failures = false;
            // Read in place, then cleared: the ends (large, for their errors) are not moved.
            for &(token, ref res) in ready.iter() {
                if token & HEADER_TOKEN != 0 {
                    if token == EP_FAILED_TOKEN {
                        failures = true;
                        continue;
                    }
                    deliver_header(token, res);
                    n += 1;
                    continue;
                }
                let p = self.ops.borrow_mut().remove(token);
                if let Some(p) = p {
                    finish(p, res);
                    n += 1;
                }
            }
            ready.clear();
            // Keep the list's memory unless a callback queued more meanwhile.
            {
                let mut r = self.ready.borrow_mut();
                if r.is_empty() {
                    *r = ready;
                }
            }
            if failures {
                n += self.deliver_queued();
                if REPORT {
                    n += self.report_failures();
                } else {
                    self.ready
                        .borrow_mut()
                        .push((EP_FAILED_TOKEN, Err(Error::Canceled)));
                }
                return n;
            }
        }
        n + self.deliver_queued()
    }

    /// Deliver the ends the rucx worker queued; how many.
    #[inline(always)]
    fn deliver_queued(&self) -> usize {
        let mut n = 0;
        // The ends the rucx worker queued, taken all at once (the lists trade places).
        let mut ended = {
            let mut slot = self.ended.borrow_mut();
            self.worker.take_completed(&mut slot);
            if slot.is_empty() {
                return n;
            }
            std::mem::take(&mut *slot)
        };
        for &(token, ref res) in ended.iter() {
            if token & HEADER_TOKEN != 0 {
                deliver_header(token, res);
                n += 1;
                continue;
            }
            let mut ops = self.ops.borrow_mut();
            let Some(p) = ops.get_mut(token) else {
                if token & crate::flush::FLUSH_TOKEN != 0 {
                    drop(ops);
                    self.flush_part_ended(token & !crate::flush::FLUSH_TOKEN, res);
                }
                continue;
            };
            if p.user.is_null() {
                // A probed message no receive took yet: delivered once one does.
                p.req = None;
                p.ended = Some(Box::new(res.clone()));
                continue;
            }
            let p = ops.remove(token).expect("looked up");
            drop(ops);
            finish(p, res);
            n += 1;
        }
        ended.clear();
        // Keep the list's memory (unless a callback's own progress call left one there).
        let mut slot = self.ended.borrow_mut();
        if slot.capacity() == 0 {
            *slot = ended;
        }
        n
    }

    /// Call the error handlers of the endpoints that failed, once each, with nothing of the
    /// worker borrowed (a handler may close its endpoint, or another, or progress); how many.
    #[inline(never)]
    fn report_failures(&self) -> usize {
        let mut n = 0;
        let failed = std::mem::take(&mut *self.failed.borrow_mut());
        for (id, err) in failed {
            let status = failure_status(&err);
            // One handler at a time, taken out before its call: one that an earlier handler
            // closed is gone by then, and each is called once.
            loop {
                let h = {
                    let mut hs = self.err_handlers.borrow_mut();
                    let Some(list) = hs.get_mut(&id) else { break };
                    let h = list.pop();
                    if list.is_empty() {
                        hs.remove(&id);
                    }
                    h
                };
                let Some(h) = h else { break };
                // SAFETY: the caller's handler, for its endpoint, still open (closing an
                // endpoint removes its handler).
                unsafe { (h.cb)(h.arg, h.ep.cast(), status) };
                n += 1;
            }
        }
        n
    }

    /// A rucx endpoint failed (called by its rucx error handler, from rucx's progress): keep
    /// it for the next `ucp_worker_progress` if a `ucp_ep_h` on it has a handler.
    pub fn note_failure(&self, id: EpId, err: &Error) {
        if !self.err_handlers.borrow().contains_key(&id) {
            return;
        }
        self.failed.borrow_mut().push((id, err.clone()));
        self.ready
            .borrow_mut()
            .push((EP_FAILED_TOKEN, Err(Error::Canceled)));
    }

    /// Cancel the receive whose request is `user`, if it has not matched. Its end (canceled)
    /// is delivered by progress.
    pub fn cancel(&self, user: *mut c_void) {
        // SAFETY: the caller's promise (`ucp_request_cancel`): a request of this library.
        let Some(token) = (unsafe { request::token(user) }) else {
            return;
        };
        if token & HEADER_TOKEN != 0 {
            // A header receive: by its token, which is its request's own address.
            if token == header_token(user) {
                self.worker.cancel_queued_token(token);
            }
            return;
        }
        let req = match self.ops.borrow_mut().get_mut(token) {
            Some(p) if p.user == user => p.req,
            _ => None,
        };
        if let Some(r) = req {
            self.worker.cancel_queued(r);
        }
    }

    /// True while any send is in flight (for flush).
    pub fn sends_in_flight(&self) -> bool {
        self.ops.borrow().sends > 0
    }
}

/// The status an endpoint's error handler is called with: `UCS_ERR_ENDPOINT_TIMEOUT` for a
/// peer that answered nothing within `RUCX_PEER_TIMEOUT` ([`Error::PeerTimeout`], told by
/// its kind), `UCS_ERR_CONNECTION_RESET` for the rest (a broken connection, a peer process
/// gone, a peer that closed its endpoint), as UCX reports them: [`status_of`]'s, where it is
/// one of those two (an endpoint's own transport error fails it as a reset too).
pub fn failure_status(e: &Error) -> Status {
    match status_of(e) {
        // A peer silent past `RUCX_PEER_TIMEOUT`; a client's connection the server turned
        // away, or one the network refused (`crate::listener`).
        s @ (UCS_ERR_ENDPOINT_TIMEOUT
        | UCS_ERR_REJECTED
        | UCS_ERR_NOT_CONNECTED
        | UCS_ERR_UNREACHABLE) => s,
        _ => UCS_ERR_CONNECTION_RESET,
    }
}

/// Deliver the end `res` of the header receive of `token`.
#[inline(always)]
fn deliver_header(token: u64, res: &Result<Completion>) {
    let user = (token & !HEADER_TOKEN) as usize as *mut c_void;
    let (status, info) = Finish::Recv.run(res, None);
    // SAFETY: `user` is the live request of the receive that just ended (a request stays the
    // caller's, and live, until it completed).
    if let Some(cb) = unsafe { request::complete_take_cb(user, status, info) } {
        run_callback(user, cb, status, info);
    }
}

/// Deliver the end `res` of operation `p`.
#[inline(always)]
pub(crate) fn finish(p: Pending, res: &Result<Completion>) {
    let (status, info) = p.fin.run(res, p.data);
    deliver(p.user, p.cb, status, info);
}

/// Record a request's end and run its callback (unless it was freed before).
#[inline(always)]
pub fn deliver(user: *mut c_void, cb: Callback, status: Status, info: TagRecvInfo) {
    // SAFETY: `user` is a live request of this library (made when the operation was posted).
    if unsafe { request::complete(user, status, info) } {
        run_callback(user, cb, status, info);
    }
}

/// Run request `user`'s callback `cb` for its end.
#[inline(always)]
fn run_callback(user: *mut c_void, cb: Callback, status: Status, mut info: TagRecvInfo) {
    // The callbacks are the caller's, called as UCX calls them: with the request, its status,
    // and for receives the information of the message.
    match cb {
        Callback::None => {}
        // SAFETY: the caller's callback, for its live request `user`.
        Callback::Send(Some(f)) => unsafe { f(user, status) },
        // SAFETY: the caller's callback, for its live request `user`.
        Callback::SendNbx(Some(f), data) => unsafe { f(user, status, data) },
        // SAFETY: the caller's callback, for its live request `user`.
        Callback::Recv(Some(f)) => unsafe { f(user, status, &mut info) },
        // SAFETY: the caller's callback, for its live request `user`.
        Callback::RecvNbx(Some(f), data) => unsafe { f(user, status, &info, data) },
        // SAFETY: the caller's callback, for its live request `user`.
        Callback::Length(Some(f), data) => unsafe { f(user, status, info.length, data) },
        // SAFETY: the caller's callback, for its live request `user`.
        Callback::StreamRecv(Some(f)) => unsafe { f(user, status, info.length) },
        _ => {}
    }
}

/// `ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
/// ucp_worker_h *worker_p)`. Thread modes other than single are answered with single (see
/// `ucp_worker_query`); event file descriptors and CPU masks are refused.
///
/// # Safety
/// `context` NULL or live; `params` NULL or valid; `worker_p` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_create(
    context: *const AbiContext,
    params: *const WorkerParams,
    worker_p: *mut *mut AbiWorker,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(c), Some(p)) = (unsafe { context.as_ref() }, unsafe { params.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if worker_p.is_null() || p.field_mask & !UCP_WORKER_PARAM_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    // `events` is a hint (which completions wake the worker): every event does here. A
    // descriptor of the caller's (an epoll set) is made to watch the worker's own
    // (`crate::wait`).
    let external = (p.field_mask & UCP_WORKER_PARAM_FIELD_EVENT_FD != 0).then(|| {
        let data = if p.field_mask & UCP_WORKER_PARAM_FIELD_USER_DATA != 0 {
            p.user_data as u64
        } else {
            0
        };
        (p.event_fd, data)
    });
    match Worker::new(&c.ctx) {
        Ok(worker) => {
            let extra = crate::extra::Extra::default();
            if p.field_mask & UCP_WORKER_PARAM_FIELD_CLIENT_ID != 0 {
                extra.listeners.set_client_id(p.client_id);
            }
            let w = AbiWorker {
                ctx: context,
                worker,
                ops: RefCell::new(Ops::default()),
                ready: RefCell::new(Vec::new()),
                ended: RefCell::new(Vec::new()),
                last_host: Default::default(),
                err_handlers: RefCell::new(HashMap::new()),
                failed: RefCell::new(Vec::new()),
                watching: Arc::new(AtomicBool::new(true)),
                extra,
                flushes: RefCell::new(Vec::new()),
            };
            if let Some((fd, data)) = external {
                let s = w.extra.wake.attach_to(&w, fd, data);
                if s != UCS_OK {
                    return s;
                }
            }
            // SAFETY: checked non-NULL, writable by the caller's promise.
            unsafe { *worker_p = Box::into_raw(Box::new(w)) };
            UCS_OK
        }
        Err(e) => {
            eprintln!("rucx libucp: ucp_worker_create failed: {e}");
            status_of(&e)
        }
    }
}

/// `void ucp_worker_destroy(ucp_worker_h worker)`: operations still in flight end without
/// callbacks (rucx's worker ends them as it closes: after that nothing touches their memory,
/// and our buffers are dropped).
///
/// # Safety
/// `worker` NULL or live, its endpoints closed or abandoned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_destroy(worker: *mut AbiWorker) {
    if worker.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in `ucp_worker_create`, destroyed once.
    let w = unsafe { Box::from_raw(worker) };
    // The rucx worker's drop may progress: its error handlers must not reach this one, gone.
    w.watching.store(false, Ordering::Relaxed);
    let AbiWorker { worker, ops, .. } = *w;
    // The worker's drop cancels what it can and waits for what a peer may still be writing.
    drop(worker);
    drop(ops);
}

/// `unsigned ucp_worker_progress(ucp_worker_h worker)`.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_progress(worker: *const AbiWorker) -> c_uint {
    // SAFETY: the caller's promise.
    match unsafe { worker.as_ref() } {
        Some(w) => (w.progress() + w.extra.progress(w)).min(c_uint::MAX as usize) as c_uint,
        None => 0,
    }
}

/// The packed worker address handed out: a length prefix (so that `ucp_ep_create`, which gets
/// only a pointer, knows how much to read) and rucx's own validated address.
pub(crate) const ADDR_MAGIC: u32 = 0x5255_4358;

fn packed_address(w: &AbiWorker) -> Vec<u8> {
    let inner = w.worker.address();
    let mut v = Vec::with_capacity(8 + inner.len());
    v.extend_from_slice(&ADDR_MAGIC.to_le_bytes());
    v.extend_from_slice(&(inner.len() as u32).to_le_bytes());
    v.extend_from_slice(&inner);
    v
}

/// Copy `bytes` into `malloc`ed memory (released by `ucp_worker_release_address`).
fn malloc_copy(bytes: &[u8]) -> *mut c_void {
    // SAFETY: plain allocation of at least one byte.
    let p = unsafe { libc::malloc(bytes.len().max(1)) };
    if !p.is_null() {
        // SAFETY: `p` has room for `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast(), bytes.len()) };
    }
    p
}

/// `ucs_status_t ucp_worker_query(ucp_worker_h worker, ucp_worker_attr_t *attr)`.
///
/// # Safety
/// `worker` NULL or live; `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_query(
    worker: *const AbiWorker,
    attr: *mut WorkerAttr,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(w), Some(a)) = (unsafe { worker.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_WORKER_ATTR_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_THREAD_MODE != 0 {
        a.thread_mode = UCS_THREAD_MODE_SINGLE;
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_ADDRESS != 0 {
        // ADDRESS_FLAGS (NET_ONLY) is an input: rucx's address lists every transport, and
        // each peer picks the ones that reach it.
        let bytes = packed_address(w);
        let p = malloc_copy(&bytes);
        if p.is_null() {
            return UCS_ERR_NO_MEMORY;
        }
        a.address = p;
        a.address_length = bytes.len();
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER != 0 {
        a.max_am_header = 0;
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_NAME != 0 {
        fill_name(&mut a.name, &format!("rucx:{}", std::process::id()));
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_MAX_INFO_STRING != 0 {
        a.max_debug_string = 0;
    }
    UCS_OK
}

/// `ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
/// size_t *address_length_p)`.
///
/// # Safety
/// `worker` NULL or live; the out pointers NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_get_address(
    worker: *const AbiWorker,
    address_p: *mut *mut c_void,
    length_p: *mut usize,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if address_p.is_null() || length_p.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    let bytes = packed_address(w);
    let p = malloc_copy(&bytes);
    if p.is_null() {
        return UCS_ERR_NO_MEMORY;
    }
    // SAFETY: checked non-NULL, writable by the caller's promise.
    unsafe {
        *address_p = p;
        *length_p = bytes.len();
    }
    UCS_OK
}

/// `void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address)`.
///
/// # Safety
/// `address` NULL or from `ucp_worker_query`/`ucp_worker_get_address`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_release_address(
    _worker: *const AbiWorker,
    address: *mut c_void,
) {
    // SAFETY: `malloc`ed by this library (or NULL, which free ignores).
    unsafe { libc::free(address) };
}

/// `ucs_status_t ucp_worker_fence(ucp_worker_h worker)`: a strong fence. Each endpoint keeps
/// its tag, stream and active-message operations in order already; puts and gets (on the RMA
/// lanes) and atomics (carried out by the target's worker) are not ordered among themselves,
/// so the fence returns once every one posted before it completed ([`rucx_ucp::Worker::fence`]),
/// progressing this worker (see docs/c-abi.md, "Known gaps"). It is a flush: it ends with the
/// error a flush would report (a put, get or atomic that failed after it was posted), which
/// is then reported by the fence and not by the next flush.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_fence(worker: *const AbiWorker) -> Status {
    // SAFETY: the caller's promise.
    match unsafe { worker.as_ref() } {
        None => UCS_ERR_INVALID_PARAM,
        Some(w) => {
            flush(w);
            match w.worker.fence(None) {
                Ok(()) => UCS_OK,
                Err(e) => {
                    tracing::debug!("ucp_worker_fence: {e}");
                    status_of(&e)
                }
            }
        }
    }
}

/// Progress until no send of this worker is in flight.
pub(crate) fn flush(w: &AbiWorker) {
    while w.sends_in_flight() {
        w.progress_quiet();
    }
}

/// `ucs_status_ptr_t ucp_worker_flush_nb(ucp_worker_h worker, unsigned flags,
/// ucp_send_callback_t cb)`: a flush of every endpoint ([`crate::flush`]): NULL when nothing
/// was outstanding, else a request that progress completes (`cb` called then) once the
/// worker's operations posted before it ended (sends, puts, gets, atomics) and every
/// endpoint's lanes were flushed; with an error when one of them failed.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_flush_nb(
    worker: *const AbiWorker,
    _flags: c_uint,
    cb: SendCb,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { worker.as_ref() } {
        Some(w) => crate::flush::post(w, None, &crate::rma::plain(Callback::Send(cb))),
        None => status_ptr(UCS_ERR_INVALID_PARAM),
    }
}

/// `ucs_status_ptr_t ucp_worker_flush_nbx(ucp_worker_h worker, const ucp_request_param_t
/// *param)`: as [`ucp_worker_flush_nb`], with the request parameters (callback, user data,
/// the caller's request memory, `UCP_OP_ATTR_FLAG_NO_IMM_CMPL`).
///
/// # Safety
/// `worker` NULL or live; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_flush_nbx(
    worker: *const AbiWorker,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    match unsafe { crate::nbx::target_and_opts(worker, param, crate::nbx::CbKind::Send) } {
        Ok((w, opts)) => crate::flush::post(w, None, &opts),
        Err(s) => status_ptr(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(send: bool) -> Pending {
        Pending {
            user: std::ptr::null_mut(),
            cb: Callback::None,
            fin: if send { Finish::Send } else { Finish::Recv },
            data: None,
            req: None,
            send,
            ended: None,
        }
    }

    #[test]
    fn the_table_reuses_freed_tokens_and_counts_sends() {
        let mut ops = Ops::default();
        let mut tokens = Vec::new();
        for k in 0..4 {
            let t = ops.vacant();
            ops.fill(t, op(k % 2 == 0));
            tokens.push(t);
        }
        assert_eq!(tokens, [0, 1, 2, 3]);
        assert_eq!((ops.len(), ops.sends), (4, 2));
        assert!(ops.remove(2).is_some_and(|p| p.send));
        assert!(ops.remove(2).is_none(), "once");
        assert!(ops.get_mut(2).is_none());
        assert_eq!((ops.len(), ops.sends), (3, 1));
        let t = ops.vacant();
        assert_eq!(t, 2, "a freed token is reused before the table grows");
        ops.fill(t, op(false));
        assert_eq!(ops.vacant(), 4);
        for t in [0, 1, 2, 3] {
            assert!(ops.remove(t).is_some());
        }
        assert_eq!((ops.len(), ops.sends), (0, 0));
        assert!(ops.get_mut(9).is_none() && ops.remove(9).is_none());
    }

    /// A flush waits for the sends posted before it, not for receives nor for sends posted
    /// after it, also when their tokens were reused.
    #[test]
    fn sends_before_a_flush_are_the_ones_posted_before_it() {
        let mut ops = Ops::default();
        let (a, b) = (ops.vacant(), 1);
        ops.fill(a, op(true));
        ops.fill(b, op(false));
        let flush = ops.next_seq();
        assert!(ops.sends_before(flush), "send a is in flight");
        assert!(
            !ops.sends_before(0),
            "nothing was posted before the first send"
        );
        // A send after the flush, in a reused token: not waited for.
        assert!(ops.remove(a).is_some());
        assert!(!ops.sends_before(flush), "receives are not waited for");
        let c = ops.vacant();
        assert_eq!(c, a, "the token is reused");
        ops.fill(c, op(true));
        assert!(!ops.sends_before(flush), "posted after the flush");
        assert!(
            ops.sends_before(ops.next_seq()),
            "a later flush waits for it"
        );
    }
}
