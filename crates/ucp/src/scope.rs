//! Scopes and requests: non-blocking operations on borrowed buffers, made sound the way
//! `std::thread::scope` is: a [`Scope`] finishes every request made in it before it ends, so no
//! transfer outlives the buffers it borrowed.

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use rucx_ucs::Result;

use crate::buf::{RecvBuf, SendBuf};
use crate::matching::Tag;
use crate::worker::{Completion, EpId, Posted, RkeyBundle, Worker};

/// A scope of requests; see [`Worker::scope`].
pub struct Scope<'scope, 'w: 'scope> {
    worker: &'w Worker,
    reqs: RefCell<Vec<u64>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("requests", &self.reqs.borrow().len())
            .finish()
    }
}

/// A request in flight. Poll it with [`test`](Self::test), block with [`wait`](Self::wait), or
/// `.await` it.
///
/// # Awaiting: who wakes the future
///
/// A poll of the future progresses the worker once and, when the request is still pending,
/// registers the task's waker with the worker and returns `Pending` (it does not wake itself,
/// so an executor does not spin). The waker is woken by the [`Worker::progress`] call (or the
/// cancel) that finishes the request. Something must therefore progress the worker while
/// tasks await its requests: the facade's `tokio` driver (`rucx::tokio`), which progresses
/// the worker whenever its [event descriptor](Worker::event_fd) is readable, or any loop
/// that calls `progress`/[`Worker::wait`].
#[must_use = "a request does nothing useful unless waited for or tested"]
pub struct Request<'scope> {
    worker: &'scope Worker,
    state: ReqState,
}

/// Where a request stands (small: it is returned by value from every post).
enum ReqState {
    /// In the worker's table.
    Pending(u64),
    /// Finished when posted (eager sends): no table entry at all.
    Done(Completion),
    /// Refused when posted: every look (`test`, `wait`, `.await`) reports this error.
    Failed(Box<rucx_ucs::Error>),
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = match self.state {
            ReqState::Pending(id) => Some(id),
            _ => None,
        };
        f.debug_struct("Request").field("id", &id).finish()
    }
}

impl<'scope, 'w> Scope<'scope, 'w> {
    pub(crate) fn new(worker: &'w Worker) -> Self {
        Scope {
            worker,
            reqs: RefCell::new(worker.take_id_list()),
            _scope: PhantomData,
        }
    }

    fn track(&'scope self, r: Result<u64>) -> Request<'scope> {
        self.track_posted(r.map(Posted::Pending))
    }

    /// The scope's worker.
    pub(crate) fn worker(&self) -> &'w Worker {
        self.worker
    }

    pub(crate) fn track_posted(&'scope self, r: Result<Posted>) -> Request<'scope> {
        let state = match r {
            Ok(Posted::Pending(id)) => {
                self.reqs.borrow_mut().push(id);
                ReqState::Pending(id)
            }
            Ok(Posted::Done(c)) => ReqState::Done(c),
            Err(e) => ReqState::Failed(Box::new(e)),
        };
        Request {
            worker: self.worker,
            state,
        }
    }

    /// Send `buf` with `tag` to `ep`. `buf` is any [`Memory`](rucx_ucs::Memory) borrowed
    /// shared: a host slice (`&[u8]`, `&Vec<u8>`), a GPU buffer of `rucx-cuda`
    /// (`&DeviceBuffer`, ...), a part of either (`buf.slice(a..b)`); or any memory by address
    /// ([`SendBuf::from_raw`], GPU memory included).
    pub fn tag_send(
        &'scope self,
        ep: EpId,
        buf: impl Into<SendBuf<'scope>>,
        tag: Tag,
    ) -> Request<'scope> {
        self.track_posted(self.worker.post_send(ep, buf.into(), tag, false))
    }

    /// A synchronous [`tag_send`](Self::tag_send) (MPI's `MPI_Issend`): the request completes
    /// only once a receive on the peer matched the message, not merely when the buffer may be
    /// reused. Small messages carry a request for an acknowledgement; larger ones use the
    /// rendezvous protocol.
    pub fn tag_send_sync(
        &'scope self,
        ep: EpId,
        buf: impl Into<SendBuf<'scope>>,
        tag: Tag,
    ) -> Request<'scope> {
        self.track_posted(self.worker.post_send(ep, buf.into(), tag, true))
    }

    /// Receive a message whose tag matches `tag` under `mask` (0 = any) into `buf` (any
    /// [`Memory`](rucx_ucs::Memory) borrowed mutably: `&mut Vec<u8>`, `&mut DeviceBuffer`,
    /// `buf.slice_mut(a..b)`, ...; or [`RecvBuf::from_raw`]). A longer message completes the request with
    /// [`Error::Truncated`](rucx_ucs::Error::Truncated); nothing is written past the buffer.
    pub fn tag_recv(
        &'scope self,
        buf: impl Into<RecvBuf<'scope>>,
        tag: Tag,
        mask: Tag,
    ) -> Request<'scope> {
        let id = self.worker.post_recv(buf.into(), tag, mask);
        self.track(Ok(id))
    }

    /// Send active message `id` with `header` and the payload `buf` to `ep` (UCX's
    /// `ucp_am_send_nbx`). `buf` is host or GPU memory, as for [`tag_send`](Self::tag_send);
    /// the request completes when `buf` may be reused.
    ///
    /// The plan's active-message table (`Worker::proto_info`) picks the protocol by size and
    /// memory: small payloads are copied in (GPU memory copied out through the copy lane
    /// first) and the request is complete at once; the handler gets the bytes in
    /// [`AmMessage::data`](crate::AmMessage). Large ones go by rendezvous: the handler gets a
    /// descriptor ([`AmMessage::remote`](crate::AmMessage)) and fetches the payload with
    /// [`am_recv_data`](Self::am_recv_data); the request completes once it was fetched, or
    /// ends with [`Error::PeerAborted`](rucx_ucs::Error::PeerAborted) when the handler dropped
    /// the descriptor unfetched. The header of a rendezvous message travels in one control
    /// message: at most the active-message lane's size less 1 KiB (longer ones are refused
    /// with `InvalidParam`).
    pub fn am_send(
        &'scope self,
        ep: EpId,
        id: u16,
        header: &[u8],
        buf: impl Into<SendBuf<'scope>>,
    ) -> Request<'scope> {
        self.track_posted(self.worker.post_am(ep, id, header, buf.into()))
    }

    /// Fetch an active message's payload (taken with
    /// [`AmMessage::take_payload`](crate::AmMessage::take_payload)) into `buf`, host or GPU
    /// memory (UCX's `ucp_am_recv_data_nbx`). A payload that came with the message is copied
    /// at once; a remote one is received by the rendezvous the tag receives use (a read
    /// through cuda_ipc or a host transport, the staged pipeline, demotion after a
    /// registration failure): the request completes when the data landed. A payload longer
    /// than `buf` fills it and ends with [`Error::Truncated`](rucx_ucs::Error::Truncated).
    ///
    /// Call it outside the handler (a handler may keep the payload and hand it on), or in it:
    /// a handler may open a scope and wait, and messages that arrive meanwhile are handed to
    /// the handlers after it returns.
    pub fn am_recv_data(
        &'scope self,
        payload: crate::AmPayload,
        buf: impl Into<RecvBuf<'scope>>,
    ) -> Request<'scope> {
        self.track_posted(self.worker.post_am_recv(payload, buf.into()))
    }

    /// Append `buf` to the ordered byte stream to `ep` (UCX's `ucp_stream_send_nbx`). The
    /// request completes once every byte was handed to the transport (the buffer may then be
    /// reused); the peer reads them with
    /// [`stream_recv`](Self::stream_recv) in any split (message boundaries are not kept).
    ///
    /// `buf` is host memory, or GPU memory, which is copied to host memory by the copy lane
    /// (cuda_copy) before the call returns and streamed from there.
    pub fn stream_send(&'scope self, ep: EpId, buf: impl Into<SendBuf<'scope>>) -> Request<'scope> {
        self.track_posted(self.worker.post_stream_send(ep, buf.into()))
    }

    /// Receive exactly `buf.len()` bytes of the byte stream from `ep` (UCX's stream receive
    /// with `UCP_STREAM_RECV_FLAG_WAITALL`). Stream receives of one endpoint are filled in the
    /// order they were posted; one canceled (or left at the end of its scope) gives the bytes
    /// it took back to the stream.
    ///
    /// When the endpoint ends first (the peer closed it, it failed or timed out, this worker
    /// closed it), the receive ends with
    /// [`Error::StreamIncomplete`](rucx_ucs::Error::StreamIncomplete): its `received` first
    /// bytes are the stream's next bytes, intact; [`Error::cause`](rucx_ucs::Error::cause)
    /// says why. Bytes that arrived before the peer's close or failure stay receivable by
    /// receives posted later.
    ///
    /// `buf` is host memory, or GPU memory: the stream then fills a host buffer of the same
    /// size, copied to `buf` by the copy lane (cuda_copy) when full, and the request completes
    /// after that copy. GPU memory the copy lane cannot register is refused when posted.
    pub fn stream_recv(&'scope self, ep: EpId, buf: impl Into<RecvBuf<'scope>>) -> Request<'scope> {
        self.track(self.worker.post_stream_recv(ep, buf.into()))
    }

    /// Write `buf` to the peer's memory at `remote` (inside `rkey`'s region). `buf` is any
    /// [`Memory`](rucx_ucs::Memory) borrowed shared (a host slice, a GPU buffer of
    /// `rucx-cuda`, a part of either) or [`SendBuf::from_raw`]; the region is the peer's host
    /// or GPU memory ([`Worker::mem_map`]). The endpoint's plan picks the path for the pair
    /// (zero-copy through a lane that reaches both, else staged through pinned host memory:
    /// see [`Worker::path_query`]); with none, the request fails with
    /// [`Error::Unsupported`](rucx_ucs::Error::Unsupported) naming the pair and why.
    pub fn put(
        &'scope self,
        ep: EpId,
        buf: impl Into<SendBuf<'scope>>,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Request<'scope> {
        let b = buf.into();
        self.track(
            self.worker
                .post_rma(ep, true, (b.addr, b.len, b.mem), remote, rkey),
        )
    }

    /// Read the peer's memory at `remote` into `buf` (any [`Memory`](rucx_ucs::Memory)
    /// borrowed mutably, host or GPU, or [`RecvBuf::from_raw`]); paths as for
    /// [`put`](Self::put).
    pub fn get(
        &'scope self,
        ep: EpId,
        buf: impl Into<RecvBuf<'scope>>,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Request<'scope> {
        let b = buf.into();
        self.track(
            self.worker
                .post_rma(ep, false, (b.addr, b.len, b.mem), remote, rkey),
        )
    }

    /// Complete every operation posted to `ep` so far, remotely too.
    pub fn flush(&'scope self, ep: EpId) -> Request<'scope> {
        self.track(self.worker.post_flush(ep))
    }

    /// End of scope: cancel receives that never matched, wait for everything else.
    pub(crate) fn finish(&self) {
        let ids = std::mem::take(&mut *self.reqs.borrow_mut());
        self.worker.finish_scope(ids);
    }

    /// End of a [`Worker::scope_timeout`]: cancel what can be, wait at most `limit` for the
    /// rest, then fail the endpoints of what is left.
    fn finish_within(&self, limit: Duration) -> Result<()> {
        let ids = std::mem::take(&mut *self.reqs.borrow_mut());
        self.worker.finish_scope_within(ids, limit)
    }
}

impl Worker {
    /// A [`scope`](Worker::scope) that can be left when its requests do not end: its end
    /// cancels every request that can be canceled (receives that never matched, sends that
    /// no receive has seen: see [`Request::cancel`]), waits at most `limit` for the others,
    /// and if some are still pending then, fails the endpoints they are bound to (every
    /// request on such an endpoint ends with
    /// [`Error::EndpointFailure`](rucx_ucs::Error::EndpointFailure), as after
    /// `RUCX_PEER_TIMEOUT`; the endpoint cannot be used again) and returns
    /// [`Error::Timeout`](rucx_ucs::Error::Timeout) naming what was still pending. Either way
    /// no request outlives the scope, and the worker and its other endpoints stay usable.
    ///
    /// `limit` bounds the wait at the scope's end, not `f`: bound `f`'s own waits with
    /// [`Request::wait_timeout`] (a request left pending by a timed-out wait is what the end
    /// of the scope then cancels).
    ///
    /// ```
    /// # fn demo(w: &rucx_ucp::Worker, ep: rucx_ucp::EpId) -> rucx_ucs::Result<()> {
    /// use std::time::Duration;
    /// let mut buf = vec![0u8; 4096];
    /// let r = w.scope_timeout(Duration::from_secs(1), |s| {
    ///     s.tag_recv(&mut buf, 7, rucx_ucp::TAG_MASK_FULL)
    ///         .wait_timeout(Duration::from_millis(10))
    /// })?; // Ok: the receive that never matched was canceled at the scope's end
    /// assert!(matches!(r, Err(rucx_ucs::Error::Timeout { .. })));
    /// # Ok(()) }
    /// ```
    pub fn scope_timeout<'w, F, T>(&'w self, limit: Duration, f: F) -> Result<T>
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'w>) -> T,
    {
        let scope = Scope::new(self);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&scope)));
        let end = scope.finish_within(limit);
        match res {
            Ok(v) => end.map(|()| v),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

impl Request<'_> {
    /// The result if the request finished, without progressing.
    pub fn test(&self) -> Option<Result<Completion>> {
        match &self.state {
            ReqState::Pending(id) => self.worker.req_result(*id),
            ReqState::Done(c) => Some(Ok(*c)),
            ReqState::Failed(e) => Some(Err(rucx_ucs::Error::clone(e))),
        }
    }

    /// Progress until finished, or until `limit` passed when one is given.
    fn wait_inner(self, limit: Option<Duration>) -> Result<Completion> {
        match self.state {
            ReqState::Pending(id) => self.worker.wait_req(id, limit),
            ReqState::Done(c) => Ok(c),
            ReqState::Failed(e) => Err(*e),
        }
    }

    /// Progress until finished.
    pub fn wait(self) -> Result<Completion> {
        self.wait_inner(None)
    }

    /// Progress until finished or `limit` passed ([`Error::Timeout`](rucx_ucs::Error::Timeout)).
    pub fn wait_timeout(self, limit: Duration) -> Result<Completion> {
        self.wait_inner(Some(limit))
    }

    /// Cancel the request where that is still possible; true when it was canceled (it then
    /// completes with [`Error::Canceled`](rucx_ucs::Error::Canceled)) or, for a send the peer
    /// was told about, the peer is asked to drop it.
    ///
    /// - A **receive** is canceled while no message matched it (a stream receive gives back
    ///   the bytes it took).
    /// - A **send** is canceled while no receive has seen any of it: still queued (nothing
    ///   on the wire), at once; announced but unmatched (a rendezvous send waiting for the
    ///   receiver, a synchronous eager send waiting for its match), by asking the receiver,
    ///   which drops the message if no receive matched it; the request then ends with
    ///   `Canceled`, or completes as usual when a receive had matched it first. An eager send
    ///   handed to the transport (most are complete when posted), a stream send, or a
    ///   rendezvous whose data is moving cannot be canceled: `false`.
    ///
    /// A canceled request still belongs to its scope (its buffer stays lent until it ends).
    pub fn cancel(&self) -> bool {
        match self.state {
            ReqState::Pending(id) => self.worker.cancel_req(id),
            _ => false,
        }
    }
}

/// Progress the distinct workers of `reqs` (each once per round) until `done` says so or
/// `limit` passed; polls flat out first and, after many idle rounds and a few idle
/// milliseconds, sleeps on the workers' events, as a single request's wait does.
fn wait_many(
    reqs: &[&Request<'_>],
    limit: Option<Duration>,
    what: &str,
    mut done: impl FnMut() -> bool,
) -> Result<()> {
    let mut workers: Vec<&Worker> = Vec::new();
    for r in reqs {
        if !workers.iter().any(|w| std::ptr::eq(*w, r.worker)) {
            workers.push(r.worker);
        }
    }
    let start = limit.map(|_| std::time::Instant::now());
    let mut idle = 0u32;
    let mut idle_since: Option<std::time::Instant> = None;
    loop {
        if done() {
            return Ok(());
        }
        if let (Some(l), Some(t)) = (limit, start)
            && t.elapsed() > l
        {
            return Err(rucx_ucs::Error::Timeout {
                after: l,
                what: what.to_string(),
            });
        }
        let n: usize = workers.iter().map(|w| w.progress()).sum();
        if n == 0 {
            idle = idle.saturating_add(1);
            if idle > 1000 {
                std::hint::spin_loop();
                if idle.is_multiple_of(256) {
                    let now = std::time::Instant::now();
                    let since = *idle_since.get_or_insert(now);
                    if now - since >= SLEEP_AFTER {
                        let left = limit
                            .zip(start)
                            .map(|(l, t)| l.saturating_sub(now.saturating_duration_since(t)));
                        Worker::wait_many(&workers, left)?;
                    }
                }
            }
        } else {
            idle = 0;
            idle_since = None;
        }
    }
}

/// Idle this long, [`wait_many`] sleeps on the workers' events (as a request's own wait).
const SLEEP_AFTER: Duration = Duration::from_millis(4);

/// Wait for every request of `reqs`, which may belong to scopes of different workers (each
/// worker is progressed, not only one): the results in the same order. Two workers of one
/// process exchanging (e.g. GPU 0 to GPU 1) need this, since a request's own
/// [`wait`](Request::wait) progresses only its worker.
pub fn wait_all(reqs: &[&Request<'_>]) -> Vec<Result<Completion>> {
    wait_all_timeout(reqs, None).expect("no limit, no timeout")
}

/// [`wait_all`] giving up after `limit` (when given) with
/// [`Error::Timeout`](rucx_ucs::Error::Timeout); the requests stay as they are (still pending
/// ones can be waited for again, or canceled where possible).
pub fn wait_all_timeout(
    reqs: &[&Request<'_>],
    limit: Option<Duration>,
) -> Result<Vec<Result<Completion>>> {
    wait_many(reqs, limit, "every request of a wait_all", || {
        reqs.iter().all(|r| r.test().is_some())
    })?;
    Ok(reqs.iter().map(|r| r.test().expect("finished")).collect())
}

/// Wait until one request of `reqs` (of any workers) finished: its index and result. `None`
/// for an empty slice.
pub fn wait_any(reqs: &[&Request<'_>]) -> Option<(usize, Result<Completion>)> {
    wait_any_timeout(reqs, None).expect("no limit, no timeout")
}

/// [`wait_any`] giving up after `limit` (when given) with
/// [`Error::Timeout`](rucx_ucs::Error::Timeout).
pub fn wait_any_timeout(
    reqs: &[&Request<'_>],
    limit: Option<Duration>,
) -> Result<Option<(usize, Result<Completion>)>> {
    if reqs.is_empty() {
        return Ok(None);
    }
    let mut found = None;
    wait_many(reqs, limit, "any request of a wait_any", || {
        found = reqs
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.test().map(|res| (i, res)));
        found.is_some()
    })?;
    Ok(found)
}

impl Future for Request<'_> {
    type Output = Result<Completion>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        // A finished request answers every poll alike (as `test` does), so polling it again
        // after it was ready reports the same result rather than a made-up error.
        let id = match &self.state {
            ReqState::Pending(id) => *id,
            ReqState::Done(c) => return Poll::Ready(Ok(*c)),
            ReqState::Failed(e) => return Poll::Ready(Err(rucx_ucs::Error::clone(e))),
        };
        if let Some(r) = self.worker.req_result(id) {
            return Poll::Ready(r);
        }
        self.worker.progress();
        if let Some(r) = self.worker.req_result(id) {
            return Poll::Ready(r);
        }
        // Whoever progresses the worker next and finishes the request wakes this task.
        self.worker.register_waker(id, cx.waker());
        Poll::Pending
    }
}
