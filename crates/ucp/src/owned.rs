//! Requests on owned buffers: the buffer is handed to the worker by value, the request may
//! outlive any [`Scope`](crate::Scope) (it is `'static`, and `Send` when the buffer is), and the
//! buffer comes back with the result: from [`OwnedRequest::wait`], the [`Future`], or a
//! completion callback ([`OwnedRequest::on_complete`]).
//!
//! Buffers are any [`OwnedBuf`](rucx_ucs::OwnedBuf) (send) or
//! [`OwnedBufMut`](rucx_ucs::OwnedBufMut) (receive): `Vec<u8>`, `Box<[u8]>`, `bytes::Bytes`
//! (send), `bytes::BytesMut`, the GPU buffers of `rucx-cuda`, and
//! [`RawBuf`](rucx_ucs::RawBuf) (memory by address, `unsafe` to make).
//!
//! # The buffer and the worker's end
//! The buffer is the worker's until the request ends, and the caller's again once it is handed
//! back; from then on nothing of rucx touches it. When the [`Worker`] is dropped with owned
//! requests outstanding, its `drop`:
//! 1. ends them with [`Error::Canceled`](rucx_ucs::Error::Canceled): receives that have not
//!    matched a message, sends (a rendezvous peer is told; its receive ends with
//!    [`Error::PeerAborted`](rucx_ucs::Error::PeerAborted)), and receives this worker fills
//!    itself (reading the peer's memory, or from eager fragments);
//! 2. waits, progressing the worker, for the receives a peer may be writing into (a matched
//!    rendezvous the peer writes or streams) to end: with their data, or with an endpoint
//!    failure when the peer dies meanwhile (a stopped peer holds the drop, as it holds the
//!    end of a scope, unless `RUCX_PEER_TIMEOUT` is set);
//! 3. closes the transports, so nothing of this process touches the buffers any more;
//! 4. hands every buffer back, through its callback (run from the drop), future (woken) or
//!    handle, with the result.
//!
//! So a handle always gets its buffer back, intact apart from what its own transfer wrote.
//!
//! ```
//! # fn main() -> rucx_ucs::Result<()> {
//! # let mut tables = rucx_transports::config_tables();
//! # tables.push(rucx_ucp::CONFIG);
//! # let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", "self")])?;
//! # let ctx = rucx_ucp::Context::new(&rucx_transports::registry(), cfg)?;
//! let worker = rucx_ucp::Worker::new(&ctx)?;
//! let ep = worker.connect(&worker.address())?;
//! // Neither request borrows anything: both may be kept, moved, or awaited elsewhere.
//! let recv = worker.tag_recv_owned(vec![0u8; 5], 7, rucx_ucp::TAG_MASK_FULL);
//! let send = worker.tag_send_owned(ep, b"hello".to_vec(), 7);
//! let (res, sent) = send.wait(&worker);
//! res?;
//! let (res, got) = recv.wait(&worker);
//! assert_eq!((res?.len, &got[..]), (5, &sent[..]));
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use rucx_ucs::Result;

use crate::worker::{Completion, Worker};

/// A completion callback: the result and the buffer.
type Callback<B> = Box<dyn FnOnce(Result<Completion>, B) + Send>;

/// What the worker runs once its borrows are released: a callback, or a waker.
pub(crate) type Deferred = Box<dyn FnOnce() + Send>;

/// Run every action, even when one of them panics: each is a request's callback with its
/// buffer, or a waker, and none may be lost to another's panic (its request would never be seen
/// to end). The first panic then goes on to the caller.
pub(crate) fn run_deferred(actions: impl IntoIterator<Item = Deferred>) {
    let mut first = None;
    for a in actions {
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(a)) {
            first.get_or_insert(p);
        }
    }
    if let Some(p) = first {
        std::panic::resume_unwind(p);
    }
}

/// The state a handle and the worker share.
struct Slot<B> {
    /// The caller's buffer, while nobody took it back.
    buf: Option<B>,
    result: Option<Result<Completion>>,
    waker: Option<Waker>,
    callback: Option<Callback<B>>,
}

pub(crate) struct Shared<B> {
    slot: Mutex<Slot<B>>,
}

impl<B> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, Slot<B>> {
        // A panic in a callback runs outside the lock; a poisoned lock still holds valid state.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The worker's side of an owned request, whatever its buffer type.
pub(crate) trait Finish: Send + Sync {
    /// The request ended with `res`: store it and return what to run once the worker's borrows
    /// are released (the callback with the buffer, or the waker).
    fn finish(&self, res: Result<Completion>) -> Option<Deferred>;
}

impl<B: Send + 'static> Finish for Shared<B> {
    fn finish(&self, res: Result<Completion>) -> Option<Deferred> {
        let mut s = self.lock();
        if s.result.is_some() {
            return None;
        }
        if let Some(cb) = s.callback.take() {
            let buf = s
                .buf
                .take()
                .expect("a buffer until the result is handed out");
            s.result = Some(res.clone());
            return Some(Box::new(move || cb(res, buf)));
        }
        s.result = Some(res);
        s.waker
            .take()
            .map(|w| Box::new(move || w.wake()) as Deferred)
    }
}

/// A request on a buffer it owns; see the [module](self) for the rule at the worker's end.
///
/// It is `'static` (it borrows nothing, not even the worker: the calls that progress take
/// `&Worker`), and `Send` when the buffer is. Awaiting it does not progress the worker:
/// something else must (a thread or task calling [`Worker::progress`], the event-driven
/// driver), or await [`progressing`](Self::progressing), which progresses on every poll.
/// Dropping the handle does not cancel the request: the worker keeps the buffer until the
/// request ends and then drops it.
#[must_use = "dropping the handle leaves the request running; its buffer is dropped when it ends"]
pub struct OwnedRequest<B> {
    shared: Arc<Shared<B>>,
    /// The worker's request id; 0 when the request ended as it was posted.
    id: u64,
    /// The posting worker's uuid.
    worker: u64,
}

impl<B> fmt::Debug for OwnedRequest<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedRequest")
            .field("id", &self.id)
            .field("done", &self.shared.lock().result.is_some())
            .finish()
    }
}

/// A handle on a request whose buffer went to a completion callback
/// ([`OwnedRequest::on_complete`]): it can only cancel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnedHandle {
    id: u64,
    worker: u64,
}

impl OwnedHandle {
    /// Cancel the request if it is a receive that has not matched yet (its callback then runs
    /// with [`Error::Canceled`](rucx_ucs::Error::Canceled) from this call); true when it was canceled. False for another
    /// worker's request, a send, or one that ended or matched already.
    pub fn cancel(&self, worker: &Worker) -> bool {
        self.id != 0 && worker.owned_uuid() == self.worker && worker.owned_cancel(self.id)
    }
}

impl<B: Send + 'static> OwnedRequest<B> {
    /// A request that the worker keeps under `id` (the worker registers `shared`).
    pub(crate) fn new(worker: u64, buf: B) -> (Self, Arc<Shared<B>>) {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                buf: Some(buf),
                result: None,
                waker: None,
                callback: None,
            }),
        });
        let r = OwnedRequest {
            shared: shared.clone(),
            id: 0,
            worker,
        };
        (r, shared)
    }

    pub(crate) fn set_id(&mut self, id: u64) {
        self.id = id;
    }

    /// Run `f` with the buffer's range while the buffer is still in the shared slot (where it
    /// stays until handed back, so the range stays valid).
    pub(crate) fn with_buf<T>(&self, f: impl FnOnce(&mut B) -> T) -> T {
        let mut s = self.shared.lock();
        f(s.buf.as_mut().expect("a buffer while posting"))
    }

    /// End the request at once (it was refused or finished when posted).
    pub(crate) fn end_now(&self, res: Result<Completion>) {
        self.shared.lock().result = Some(res);
    }

    /// The result if the request ended, without progressing.
    pub fn test(&self) -> Option<Result<Completion>> {
        self.shared.lock().result.clone()
    }

    /// True once the request ended (its buffer can be taken back).
    pub fn is_done(&self) -> bool {
        self.shared.lock().result.is_some()
    }

    /// The result and the buffer if the request ended, else the request itself.
    pub fn try_take(self) -> std::result::Result<(Result<Completion>, B), Self> {
        let mut s = self.shared.lock();
        match (&s.result, s.buf.is_some()) {
            (Some(r), true) => {
                let r = r.clone();
                let b = s.buf.take().expect("checked");
                Ok((r, b))
            }
            _ => {
                drop(s);
                Err(self)
            }
        }
    }

    /// Progress `worker` (the one that posted the request) until the request ended: its
    /// result and the buffer.
    ///
    /// # Panics
    /// When `worker` is not the worker that posted the request (progressing another worker
    /// would never end it).
    pub fn wait(self, worker: &Worker) -> (Result<Completion>, B) {
        match self.wait_inner(worker, None) {
            Ok(v) => v,
            Err(_) => unreachable!("no limit, no timeout"),
        }
    }

    /// [`wait`](Self::wait) giving up after `limit`: the request comes back, still running.
    ///
    /// # Panics
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(
        self,
        worker: &Worker,
        limit: Duration,
    ) -> std::result::Result<(Result<Completion>, B), Self> {
        self.wait_inner(worker, Some(limit))
    }

    fn wait_inner(
        self,
        worker: &Worker,
        limit: Option<Duration>,
    ) -> std::result::Result<(Result<Completion>, B), Self> {
        let mut me = match self.try_take() {
            Ok(v) => return Ok(v),
            Err(me) => me,
        };
        assert!(
            worker.owned_uuid() == me.worker,
            "OwnedRequest waited on with a worker that did not post it"
        );
        let start = limit.map(|_| Instant::now());
        let mut backoff = crate::worker::Backoff::new();
        loop {
            if worker.progress() == 0 {
                backoff.idle(worker);
            } else {
                backoff.busy();
            }
            me = match me.try_take() {
                Ok(v) => return Ok(v),
                Err(me) => me,
            };
            if let (Some(l), Some(t)) = (limit, start)
                && t.elapsed() > l
            {
                return Err(me);
            }
        }
    }

    /// Cancel the request if it is a receive that has not matched yet; true when it was
    /// canceled (it then ends with [`Error::Canceled`](rucx_ucs::Error::Canceled) and hands the buffer back untouched).
    /// False for another worker's request, a send, or one that ended or matched already.
    pub fn cancel(&self, worker: &Worker) -> bool {
        self.id != 0 && worker.owned_uuid() == self.worker && worker.owned_cancel(self.id)
    }

    /// Hand the result and the buffer to `f` when the request ends, instead of keeping a
    /// handle: `f` runs from [`Worker::progress`] (or from the worker's drop, see the
    /// [module](self)) on the thread that calls it; when the request already ended, `f` runs
    /// now, before this returns. Returns a handle to cancel the request with.
    pub fn on_complete(
        self,
        f: impl FnOnce(Result<Completion>, B) + Send + 'static,
    ) -> OwnedHandle {
        let handle = OwnedHandle {
            id: self.id,
            worker: self.worker,
        };
        let mut s = self.shared.lock();
        match s.result.clone() {
            Some(r) => {
                let b = s
                    .buf
                    .take()
                    .expect("a buffer until the result is handed out");
                drop(s);
                f(r, b);
            }
            None => s.callback = Some(Box::new(f)),
        }
        handle
    }

    /// A future that progresses `worker` on every poll (and asks to be polled again), for
    /// executors that nothing else drives the worker in.
    ///
    /// # Panics
    /// When polled with a worker that did not post the request.
    pub fn progressing(self, worker: &Worker) -> Progressing<'_, B> {
        Progressing {
            req: Some(self),
            worker,
        }
    }
}

/// Waits for the request: ready with its result and the buffer. Polling registers the waker,
/// which the worker wakes from the progress call that ends the request (or from its drop).
/// The future itself does not progress the worker (see
/// [`progressing`](OwnedRequest::progressing)). Polling it again after it was ready panics.
impl<B: Send + 'static> Future for OwnedRequest<B> {
    type Output = (Result<Completion>, B);

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let mut s = self.shared.lock();
        if let Some(r) = &s.result {
            let r = r.clone();
            let b = s
                .buf
                .take()
                .expect("an owned request polled after it was ready");
            return Poll::Ready((r, b));
        }
        match &mut s.waker {
            Some(w) => w.clone_from(cx.waker()),
            None => s.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// See [`OwnedRequest::progressing`].
#[must_use = "futures do nothing unless polled"]
pub struct Progressing<'w, B> {
    req: Option<OwnedRequest<B>>,
    worker: &'w Worker,
}

impl<B> fmt::Debug for Progressing<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progressing")
            .field("req", &self.req)
            .finish()
    }
}

impl<B: Send + 'static> Future for Progressing<'_, B> {
    type Output = (Result<Completion>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let req = self
            .req
            .take()
            .expect("a progressing request polled after it was ready");
        assert!(
            self.worker.owned_uuid() == req.worker,
            "OwnedRequest progressed with a worker that did not post it"
        );
        let req = match req.try_take() {
            Ok(v) => return Poll::Ready(v),
            Err(r) => r,
        };
        self.worker.progress();
        match req.try_take() {
            Ok(v) => Poll::Ready(v),
            Err(r) => {
                self.req = Some(r);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}
