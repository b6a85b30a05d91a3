//! Event descriptors for sleeping instead of polling: an [`EventFd`] (a counter that reads as
//! readable once signalled, for wake-ups within a process, from any thread), an [`EventSet`]
//! (an epoll set that aggregates descriptors into one, itself pollable), and [`wait_readable`]
//! (`poll(2)` on one descriptor with a timeout). Every system call of these lives here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A Linux eventfd, non-blocking and close-on-exec: [`signal`](Self::signal) makes it
/// readable, [`drain`](Self::drain) makes it idle again. Signalling is safe from any thread
/// (and from a CUDA host callback: a single `write(2)`).
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new, idle eventfd.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain system call with valid flags; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// The descriptor to poll.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Make the descriptor readable (adds one to the counter).
    pub fn signal(&self) {
        signal_fd(self.fd.as_raw_fd());
    }

    /// Reset the counter: the descriptor is idle until the next signal. Returns whether it was
    /// signalled.
    pub fn drain(&self) -> bool {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a local u64 from a descriptor we own; non-blocking.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        n == 8
    }
}

/// Add one to the eventfd `fd` (see [`EventFd::signal`]); for callers that hold only the
/// descriptor number (a callback of a foreign library). A full counter or a closed descriptor
/// is ignored: the first means it is readable already.
pub fn signal_fd(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a local u64; a bad descriptor makes the call fail, which is
    // ignored (documented above).
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), std::mem::size_of::<u64>()) };
}

/// A one-shot timer descriptor (Linux timerfd on `CLOCK_MONOTONIC`, the clock of
/// [`std::time::Instant`]; non-blocking, close-on-exec): readable from its expiry until it is
/// drained or set again. A sleeper that needs to wake for timers now and then watches it next
/// to its other descriptors and sets it once per period, instead of giving every sleep a
/// timeout (a kernel timer armed and cancelled per sleep).
#[derive(Debug)]
pub struct TimerFd {
    fd: OwnedFd,
}

impl TimerFd {
    /// A new timer, not set (never readable until [`set`](Self::set)).
    pub fn new() -> io::Result<TimerFd> {
        // SAFETY: plain system call with valid arguments; the result is checked before use.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by timerfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(TimerFd { fd })
    }

    /// The descriptor to poll.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Expire once, `after` from now (at least a nanosecond), replacing an earlier setting;
    /// an expiry not yet drained is forgotten (the descriptor is idle until the new one).
    pub fn set(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: libc::time_t::try_from(after.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: `spec` is a valid itimerspec the kernel copies; the old value is not asked
        // for (null); the descriptor is ours.
        let rc =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Consume an expiry: whether the timer had expired (the descriptor is idle afterwards).
    pub fn drain(&self) -> bool {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a local u64 from a descriptor we own; non-blocking.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        n == 8
    }
}

/// An epoll set (level triggered) whose own descriptor is readable while any descriptor added
/// to it is: several event sources become one.
#[derive(Debug)]
pub struct EventSet {
    fd: OwnedFd,
}

impl EventSet {
    /// An empty set.
    pub fn new() -> io::Result<EventSet> {
        // SAFETY: plain system call with a valid flag; the result is checked before use.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventSet { fd })
    }

    /// The set's descriptor: readable while a member is readable.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Watch `fd` for readability, reported with `key`. The caller keeps `fd` open while it is
    /// in the set (closing it removes it).
    pub fn add(&self, fd: RawFd, key: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: key,
        };
        // SAFETY: `ev` is a valid event the kernel copies; both descriptors are open.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watch `fd` for readability and, with `writable`, writability too (a non-blocking
    /// connect finishing, room to send), reported with `key`; `modify`: change the interest of
    /// a member instead of adding it. The caller keeps `fd` open while it is in the set.
    pub fn watch(&self, fd: RawFd, key: u64, writable: bool, modify: bool) -> io::Result<()> {
        let mut events = libc::EPOLLIN as u32;
        if writable {
            events |= libc::EPOLLOUT as u32;
        }
        let mut ev = libc::epoll_event { events, u64: key };
        let op = if modify {
            libc::EPOLL_CTL_MOD
        } else {
            libc::EPOLL_CTL_ADD
        };
        // SAFETY: `ev` is a valid event the kernel copies; both descriptors are open.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stop watching `fd` (added with [`add`](Self::add), still open).
    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: a valid (ignored) event; both descriptors are open.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wait until a member is readable or `timeout` passed (`None`: no limit); returns whether
    /// one is. An interrupted wait (a signal) returns `Ok(false)`.
    pub fn wait(&self, timeout: Option<Duration>) -> io::Result<bool> {
        wait_readable(self.fd.as_raw_fd(), timeout)
    }
}

/// `poll(2)` one descriptor for readability for at most `timeout` (`None`: no limit, rounded up
/// to whole milliseconds otherwise). Returns whether it is readable; an interrupted wait
/// returns `Ok(false)`.
pub fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    wait_any_readable(&[fd], timeout)
}

/// [`wait_readable`] on several descriptors: whether one of them is readable.
pub fn wait_any_readable(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<bool> {
    let ms: libc::c_int = match timeout {
        None => -1,
        Some(t) => {
            let ms = t.as_micros().div_ceil(1000);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        }
    };
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` is an initialized array of `p.len()` pollfds that lives across the call.
    let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventfd_is_readable_after_signal_until_drained_and_a_set_shows_it() {
        let e = EventFd::new().unwrap();
        let set = EventSet::new().unwrap();
        set.add(e.fd(), 7).unwrap();
        assert!(!wait_readable(e.fd(), Some(Duration::ZERO)).unwrap());
        assert!(!set.wait(Some(Duration::from_millis(1))).unwrap());
        e.signal();
        e.signal();
        assert!(wait_readable(e.fd(), Some(Duration::ZERO)).unwrap());
        assert!(set.wait(Some(Duration::ZERO)).unwrap());
        assert!(e.drain());
        assert!(!e.drain(), "one drain resets the counter");
        assert!(!set.wait(Some(Duration::ZERO)).unwrap());
    }

    #[test]
    fn a_removed_member_no_longer_shows_and_a_second_removal_fails() {
        let e = EventFd::new().unwrap();
        let set = EventSet::new().unwrap();
        set.add(e.fd(), 1).unwrap();
        e.signal();
        assert!(set.wait(Some(Duration::ZERO)).unwrap());
        set.remove(e.fd()).unwrap();
        assert!(
            !set.wait(Some(Duration::ZERO)).unwrap(),
            "still readable, not a member"
        );
        assert!(set.remove(e.fd()).is_err());
    }

    #[test]
    fn a_timer_is_idle_until_set_readable_after_its_expiry_and_idle_when_drained_or_set_again() {
        let t = TimerFd::new().unwrap();
        assert!(!wait_readable(t.fd(), Some(Duration::ZERO)).unwrap());
        assert!(!t.drain());
        t.set(Duration::from_millis(5)).unwrap();
        // Ends the wait without a limit of its own (a failure hangs rather than passes).
        assert!(wait_readable(t.fd(), None).unwrap());
        assert!(t.drain());
        assert!(!wait_readable(t.fd(), Some(Duration::ZERO)).unwrap());
        // Expired, not drained: setting it again forgets that expiry.
        t.set(Duration::from_nanos(1)).unwrap();
        assert!(wait_readable(t.fd(), None).unwrap());
        t.set(Duration::from_secs(3600)).unwrap();
        assert!(!wait_readable(t.fd(), Some(Duration::ZERO)).unwrap());
        assert!(!t.drain());
    }

    #[test]
    fn a_signal_from_another_thread_ends_a_wait_without_limit() {
        let e = std::sync::Arc::new(EventFd::new().unwrap());
        let e2 = e.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            signal_fd(e2.fd());
        });
        assert!(wait_readable(e.fd(), None).unwrap());
        t.join().unwrap();
    }
}
