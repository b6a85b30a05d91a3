//! Driving a worker while futures await its requests: [`block_on`] without any runtime, and
//! (feature `tokio`) `rucx::tokio::drive` inside a tokio runtime.
//!
//! The rule (see [`Request`](crate::Request)): an awaited request registers its task's waker
//! with the worker and is woken by the progress call that finishes it. A driver therefore
//! runs the future and, while it is pending, progresses the worker: flat out while things
//! happen, and asleep on the worker's event descriptor ([`Worker::wait`]) when nothing does.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use rucx_ucs::event::{EventFd, wait_any_readable};

use crate::{Error, Result, Worker};

/// Progress calls that find nothing before the driver sleeps on the worker's events.
const SPIN_IDLE: u32 = 64;

/// Wakes [`block_on`]: sets the flag (the worker's progress calls it from this thread) and
/// signals an eventfd that the sleeping thread polls next to the worker's descriptor (for
/// wakes from other threads).
struct Flag {
    woken: AtomicBool,
    fd: EventFd,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.woken.swap(true, Ordering::AcqRel) {
            self.fd.signal();
        }
    }
}

/// Run `fut` to completion on this thread, progressing `worker` meanwhile, with no async
/// runtime: the blocking way to await requests (e.g. several of one scope with a join, or a
/// request with a timeout future of one's own). Sleeps on the worker's events when nothing
/// happens, so an idle wait uses no CPU. Errors only when the worker cannot wait (its event
/// set failed); a worker with a transport that cannot signal wakes every
/// [`Worker::wait_tick`] to poll it.
pub fn block_on<F: Future>(worker: &Worker, fut: F) -> Result<F::Output> {
    let flag = Arc::new(Flag {
        woken: AtomicBool::new(true),
        fd: EventFd::new().map_err(|e| Error::io("block_on: creating its eventfd", e))?,
    });
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    let mut idle = 0u32;
    loop {
        if flag.woken.swap(false, Ordering::AcqRel)
            && let Poll::Ready(v) = fut.as_mut().poll(&mut cx)
        {
            return Ok(v);
        }
        if worker.progress() > 0 || flag.woken.load(Ordering::Acquire) {
            idle = 0;
            continue;
        }
        idle += 1;
        if idle < SPIN_IDLE {
            continue;
        }
        // Nothing for a while: sleep until the worker's events (a message, a completion) or a
        // wake from another thread.
        idle = 0;
        flag.fd.drain();
        if flag.woken.load(Ordering::Acquire) {
            continue;
        }
        match worker.arm() {
            Ok(()) => {
                let fds = [worker.event_fd()?, flag.fd.fd()];
                wait_any_readable(&fds, Some(worker.wait_tick()))
                    .map_err(|e| Error::io("block_on: waiting for events", e))?;
            }
            Err(Error::Busy(_)) => {}
            Err(e) => return Err(e),
        }
    }
}
