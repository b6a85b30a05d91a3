//! Driving a worker from tokio (feature `tokio`): [`drive`] runs a future to completion while
//! it progresses the worker whenever the worker's event descriptor is readable
//! ([`tokio::io::unix::AsyncFd`]), re-arms it, and so wakes the
//! tasks whose requests finished (see [`Request`](crate::Request)).
//!
//! A worker is not `Sync`, so the future [`drive`] returns is not `Send`: run it with
//! `block_on`, on a current-thread runtime, or in a `LocalSet`. The worker itself is `Send`,
//! so it may be created on another thread and moved in.
//!
//! ```no_run
//! # async fn f(w: &rucx::Worker, ep: rucx::EpId) -> rucx::Result<()> {
//! let data = vec![7u8; 4096];
//! let mut got = vec![0u8; 4096];
//! w.scope(|s| {
//!     let rt = ::tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
//!     rt.block_on(rucx::tokio::drive(w, async {
//!         let r = s.tag_recv(&mut got, 1, rucx::TAG_MASK_FULL);
//!         s.tag_send(ep, &data, 1).await?;
//!         r.await
//!     }))?
//! })?;
//! # Ok(()) }
//! ```

use std::future::{Future, poll_fn};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::pin;
use std::task::Poll;

use ::tokio::io::Interest;
use ::tokio::io::unix::AsyncFd;

use crate::ucp::Listener;
use crate::{EpId, Error, Result, Worker};

/// Progress calls that find nothing before the driver arms the worker and waits for its
/// descriptor.
const SPIN_IDLE: u32 = 16;

/// The worker's (or a listener's) descriptor as tokio registers it (owned by the worker or the
/// listener, not closed here).
struct WorkerFd(RawFd);

impl AsRawFd for WorkerFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Run `fut` to completion, progressing `worker` meanwhile: flat out while things happen, and,
/// when nothing does, armed and waiting (without CPU) until the worker's event descriptor is
/// readable. Must run inside a tokio runtime with I/O and time enabled (`enable_all`).
///
/// Errors when the worker's event set or the registration with tokio fails. The worker is
/// progressed at least every [`Worker::wait_tick`] (its timers; transports that cannot signal).
pub async fn drive<F: Future>(worker: &Worker, fut: F) -> Result<F::Output> {
    let raw = worker.event_fd()?;
    // SAFETY: the descriptor is the worker's event set, which stays open, the same
    // description, for the worker's whole life; `worker` is borrowed for this whole function,
    // and the `AsyncFd` is dropped before it returns.
    let fd = unsafe { AsyncFd::register_with_interest(WorkerFd(raw), Interest::READABLE) }
        .map_err(|e| {
            Error::io(
                "tokio: registering the worker's event descriptor",
                e.into_parts().1,
            )
        })?;
    let mut fut = pin!(fut);
    let period = worker.wait_tick();
    let mut tick = pin!(::tokio::time::sleep(period));
    poll_fn(|cx| {
        loop {
            if let Poll::Ready(v) = fut.as_mut().poll(cx) {
                return Poll::Ready(Ok(v));
            }
            // Progress until quiet; finished requests' wakers are woken by these calls (this
            // very task included, which then runs this loop again).
            let mut idle = 0;
            while idle < SPIN_IDLE {
                if worker.progress() > 0 {
                    idle = 0;
                } else {
                    idle += 1;
                }
            }
            match worker.arm() {
                Ok(()) => {}
                Err(Error::Busy(_)) => {
                    // Events pending that progress did not take yet (or a message waits for
                    // room): let other tasks run, then come back.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
            match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    // Readable: cleared before progressing, so an event after this point is
                    // reported again; then round the loop.
                    guard.clear_ready();
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Error::io(
                        "tokio: waiting for the worker's event descriptor",
                        e,
                    )));
                }
                Poll::Pending => {}
            }
            // Timers of the worker (peer checks, transport deadlines) need a progress call now
            // and then, even when nothing happens.
            if tick.as_mut().poll(cx).is_ready() {
                tick.as_mut().reset(::tokio::time::Instant::now() + period);
                continue;
            }
            return Poll::Pending;
        }
    })
    .await
}

/// The next peer of `listener` whose handshake completed ([`Worker::accept`]), waiting without
/// CPU on the listener's descriptor (and, while a handshake is in progress, until its deadline)
/// in between. Await it inside [`drive`] on the same worker, next to the service's other work
/// (`tokio::select!`, `join!`): it needs nothing from them, and they need nothing from it.
///
/// An error concerns one connecting peer, which was dropped (a stranger, a bad address, a peer
/// that hung up or stayed silent past the handshake timeout), or the listening socket (e.g. out
/// of descriptors): log it and await `accept` again. Errors too when tokio refuses the
/// listener's descriptor.
pub async fn accept(worker: &Worker, listener: &Listener) -> Result<EpId> {
    // SAFETY: the descriptor is the listener's event set, open and the same description for
    // the listener's whole life; `listener` is borrowed for this whole function, and the
    // `AsyncFd` is dropped before it returns.
    let fd = unsafe {
        AsyncFd::register_with_interest(WorkerFd(listener.as_raw_fd()), Interest::READABLE)
    }
    .map_err(|e| {
        Error::io(
            format!(
                "tokio: registering the descriptor of the listener on {}",
                listener.local_addr()
            ),
            e.into_parts().1,
        )
    })?;
    loop {
        if let Some(ep) = worker.accept(listener)? {
            return Ok(ep);
        }
        // Nothing ready now; a readiness seen before this call was consumed by it.
        let ready = fd.readable();
        match listener.next_deadline() {
            Some(at) => {
                if let Ok(guard) = ::tokio::time::timeout_at(at.into(), ready).await {
                    guard
                        .map_err(|e| Error::io("tokio: waiting for the listener", e))?
                        .clear_ready();
                }
            }
            None => ready
                .await
                .map_err(|e| Error::io("tokio: waiting for the listener", e))?
                .clear_ready(),
        }
    }
}
