//! Wake-up (`UCP_FEATURE_WAKEUP`): `ucp_worker_get_efd`, `ucp_worker_arm`, `ucp_worker_wait`
//! and `ucp_worker_signal`, over rucx's event-driven progress ([`rucx_ucp::Worker::arm`]).
//!
//! The descriptor handed out is an epoll set of this library's own holding the rucx worker's
//! event descriptor (its interfaces': a message, a completion, a failed peer), the worker's
//! listeners (a client connecting) and an eventfd that `ucp_worker_signal` writes (from any
//! thread). `ucp_worker_arm` says `UCS_ERR_BUSY` while anything waits for progress: ends not
//! delivered yet, a signal, a listener with a peer at the door, or the rucx worker's own
//! pending work; after `UCS_OK` the descriptor becomes readable at the next event, as UCX's
//! contract says, so a caller may sleep in `poll`/`epoll_wait` on it without a timeout.
//! `ucp_worker_wait` arms and sleeps on it, at most the rucx worker's wait tick (its timers
//! need progress calls). A worker created with a descriptor of the caller's
//! (`UCP_WORKER_PARAM_FIELD_EVENT_FD`, an epoll set) has that set watch the worker's
//! descriptor, reported with the worker's `user_data`: UCX's external event descriptor.

use std::cell::OnceCell;
use std::ffi::c_int;
use std::os::fd::RawFd;
use std::sync::OnceLock;
use std::time::Duration;

use rucx_ucs::Error;
use rucx_ucs::event::{EventFd, EventSet, wait_readable};

use crate::status::status_of;
use crate::types::*;
use crate::worker::AbiWorker;

/// A worker's wake-up state, made at first use.
#[derive(Debug, Default)]
pub struct Wake {
    /// The set handed out by `ucp_worker_get_efd` (or why it could not be made).
    set: OnceCell<Result<EventSet, Status>>,
    /// Written by `ucp_worker_signal`, from any thread (hence the lock-free cell).
    signal: OnceLock<Option<EventFd>>,
}

impl Wake {
    fn signal_fd(&self) -> Option<&EventFd> {
        self.signal
            .get_or_init(|| match EventFd::new() {
                Ok(e) => Some(e),
                Err(e) => {
                    eprintln!("rucx libucp: ucp_worker_signal: no eventfd: {e}");
                    None
                }
            })
            .as_ref()
    }

    /// The set, made on first use with the worker's descriptor, the signal's and those of
    /// the listeners open now (later ones are added by [`Wake::watch`]).
    fn set(&self, w: &AbiWorker) -> Result<&EventSet, Status> {
        self.set
            .get_or_init(|| {
                let inner = w.worker.event_fd().map_err(|e| status_of(&e))?;
                let set = EventSet::new().map_err(|_| UCS_ERR_IO_ERROR)?;
                set.add(inner, 0).map_err(|_| UCS_ERR_IO_ERROR)?;
                if let Some(s) = self.signal_fd() {
                    set.add(s.fd(), 1).map_err(|_| UCS_ERR_IO_ERROR)?;
                }
                for fd in w.extra.listener_fds() {
                    set.add(fd, 2).map_err(|_| UCS_ERR_IO_ERROR)?;
                }
                Ok(set)
            })
            .as_ref()
            .map_err(|s| *s)
    }

    /// The caller's epoll set `epfd` (`UCP_WORKER_PARAM_FIELD_EVENT_FD`) watches the worker's
    /// descriptor from now on, reported with `data` (`UCP_WORKER_PARAM_FIELD_USER_DATA`, as
    /// UCX reports it): the caller arms the worker and sleeps in `epoll_wait` on its own set.
    /// A descriptor that is not an epoll set: `UCS_ERR_INVALID_PARAM`.
    pub fn attach_to(&self, w: &AbiWorker, epfd: c_int, data: u64) -> Status {
        let set = match self.set(w) {
            Ok(s) => s,
            Err(s) => return s,
        };
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: data,
        };
        // SAFETY: `ev` is a valid event the kernel copies; `set.fd()` is open while the
        // worker lives (closing it when the worker goes removes it from the caller's set), and
        // a bad `epfd` is an error the kernel reports.
        let rc = unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, set.fd(), &mut ev) };
        if rc == 0 {
            return UCS_OK;
        }
        let e = std::io::Error::last_os_error();
        eprintln!(
            "rucx libucp: ucp_worker_create: cannot add the worker's descriptor to the \
             caller's event descriptor {epfd} (UCP_WORKER_PARAM_FIELD_EVENT_FD): {e}"
        );
        match e.raw_os_error() {
            Some(libc::EBADF | libc::EINVAL | libc::EPERM | libc::ELOOP) => UCS_ERR_INVALID_PARAM,
            _ => UCS_ERR_IO_ERROR,
        }
    }

    /// A listener opened: its descriptor joins the set, if one was handed out.
    pub fn watch(&self, fd: RawFd) {
        if let Some(Ok(set)) = self.set.get()
            && let Err(e) = set.add(fd, 2)
        {
            eprintln!("rucx libucp: a listener's descriptor cannot join the worker's: {e}");
        }
    }

    /// A listener closes: its descriptor leaves the set.
    pub fn unwatch(&self, fd: RawFd) {
        if let Some(Ok(set)) = self.set.get() {
            let _ = set.remove(fd);
        }
    }
}

/// `UCS_ERR_BUSY` while progress has something to do; `UCS_OK` once armed.
fn arm(w: &AbiWorker) -> Status {
    if let Err(s) = w.extra.wake.set(w) {
        return s;
    }
    let signaled = w.extra.wake.signal_fd().is_some_and(EventFd::drain);
    if signaled || !w.ready.borrow().is_empty() || w.worker.has_completed() {
        return UCS_ERR_BUSY;
    }
    let door = w
        .extra
        .listener_fds()
        .into_iter()
        .any(|fd| wait_readable(fd, Some(Duration::ZERO)).unwrap_or(true));
    if door {
        return UCS_ERR_BUSY;
    }
    match w.worker.arm() {
        Ok(()) => UCS_OK,
        Err(Error::Busy(_)) => UCS_ERR_BUSY,
        Err(e) => status_of(&e),
    }
}

/// `ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd)`: the worker's event
/// descriptor (owned by the worker; see the module).
///
/// # Safety
/// `worker` NULL or live; `fd` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_get_efd(worker: *const AbiWorker, fd: *mut c_int) -> Status {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if fd.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    match w.extra.wake.set(w) {
        Ok(set) => {
            // SAFETY: checked non-NULL, writable by the caller's promise.
            unsafe { *fd = set.fd() };
            UCS_OK
        }
        Err(s) => s,
    }
}

/// `ucs_status_t ucp_worker_arm(ucp_worker_h worker)`: `UCS_OK` once the descriptor will
/// become readable at the next event, `UCS_ERR_BUSY` while events wait for progress.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_arm(worker: *const AbiWorker) -> Status {
    // SAFETY: the caller's promise.
    match unsafe { worker.as_ref() } {
        Some(w) => arm(w),
        None => UCS_ERR_INVALID_PARAM,
    }
}

/// `ucs_status_t ucp_worker_wait(ucp_worker_h worker)`: sleep until an event (or a signal),
/// at once when events wait; the rucx worker's wait tick at most, for its timers. As in UCX, a
/// return says "progress now", not that an event happened.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_wait(worker: *const AbiWorker) -> Status {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    match arm(w) {
        UCS_OK => {}
        UCS_ERR_BUSY => return UCS_OK,
        s => return s,
    }
    let set = match w.extra.wake.set(w) {
        Ok(s) => s,
        Err(s) => return s,
    };
    match set.wait(Some(w.worker.wait_tick())) {
        Ok(_) => UCS_OK,
        Err(_) => UCS_ERR_IO_ERROR,
    }
}

/// `ucs_status_t ucp_worker_signal(ucp_worker_h worker)`: wake a `ucp_worker_wait` (or a
/// sleeper on the descriptor) of this worker; callable from any thread.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_signal(worker: *const AbiWorker) -> Status {
    // SAFETY: the caller's promise. Only the signal's cell is touched, which is made for use
    // from any thread (`OnceLock`, an eventfd).
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    match w.extra.wake.signal_fd() {
        Some(e) => {
            e.signal();
            UCS_OK
        }
        None => UCS_ERR_IO_ERROR,
    }
}
