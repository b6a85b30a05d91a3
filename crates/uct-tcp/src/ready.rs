//! Readiness: which connections a progress call handles. Sockets are registered once with a
//! [`Watch`] (epoll, mirrored in a `poll(2)` array used while there are a few), which names
//! the ready ones without waiting; a [`Kick`] lists the connections that need attention
//! although their socket may have no event (an endpoint queued output, failed or went away).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Connections that need the interface's attention although their socket may have no event:
/// an endpoint queued output, failed it or went away. Shared by the interface and every
/// connection; the interface takes the list in its next progress.
#[derive(Debug, Default)]
pub(crate) struct Kick {
    any: AtomicBool,
    keys: Mutex<Vec<usize>>,
}

impl Kick {
    /// Ask for connection `key` to be handled in the next progress.
    pub(crate) fn push(&self, key: usize) {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(key);
        self.any.store(true, Ordering::Release);
    }

    /// Whether a kick waits for the next progress.
    pub(crate) fn pending(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Take the connections kicked since the last call into `out`.
    pub(crate) fn take(&self, out: &mut Vec<usize>) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        // Cleared before the list is taken: a kick racing with this either lands in the list
        // taken now or sets the flag again for the next call.
        self.any.store(false, Ordering::Release);
        out.append(&mut self.keys.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

/// Epoll (and `poll`) event bits as the interface keeps them.
pub(crate) const IN: u32 = libc::EPOLLIN as u32;
/// Writable.
pub(crate) const OUT: u32 = libc::EPOLLOUT as u32;
/// Error or hang-up (reported whether asked for or not).
pub(crate) const ERR_HUP: u32 = (libc::EPOLLERR | libc::EPOLLHUP) as u32;

/// An epoll instance (level triggered) that the interface registers its listener and
/// connections with once, so a progress call asks the kernel for the ready ones only.
#[derive(Debug)]
pub(crate) struct Epoll {
    fd: OwnedFd,
    /// Room for the events one wait returns.
    buf: Vec<libc::epoll_event>,
}

/// Most events one [`Epoll::wait`] returns; the rest stay ready for the next call.
const EPOLL_BATCH: usize = 64;

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: plain system call with a valid flag; the result is checked before use.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor epoll_create1 just returned, owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Epoll {
            fd,
            buf: vec![libc::epoll_event { events: 0, u64: 0 }; EPOLL_BATCH],
        })
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: key };
        // SAFETY: `self.fd` is our epoll descriptor, `ev` a valid event that lives across the
        // call (the kernel copies it); `fd` is a descriptor the caller keeps open.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watch `fd` for `events`, reported with `key`.
    pub(crate) fn add(&self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, key)
    }

    /// Change what `fd` is watched for.
    pub(crate) fn modify(&self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, key)
    }

    /// Stop watching `fd` (before it may be closed or handed on).
    pub(crate) fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    /// The epoll descriptor: readable while a watched socket is ready (level triggered).
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The ready descriptors, waiting up to `timeout_ms` milliseconds (0: not at all) for
    /// one: `(key, events)`. An error (EINTR) reads as nothing ready; the next call asks
    /// again.
    pub(crate) fn wait(&mut self, timeout_ms: i32) -> impl Iterator<Item = (u64, u32)> + '_ {
        // SAFETY: `buf` holds EPOLL_BATCH initialized events and outlives the call.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr(),
                EPOLL_BATCH as i32,
                timeout_ms,
            )
        };
        let n = usize::try_from(n).unwrap_or(0);
        self.buf[..n].iter().map(|e| {
            // Copies: the struct is packed on some targets.
            let (key, events) = (e.u64, e.events);
            (key, events)
        })
    }
}

/// The interface's set of watched sockets: registered with epoll, and mirrored in a `poll(2)`
/// array used while the set is small. With a handful of sockets, `poll` reads each socket's
/// state where it is; `epoll_wait` shares its ready list (and its lock) with the softirq that
/// delivers every packet, which costs a spinning reader more than scanning a few sockets.
#[derive(Debug)]
pub(crate) struct Watch {
    epoll: Epoll,
    pollfds: Vec<libc::pollfd>,
    /// Key of each `pollfds` entry.
    keys: Vec<u64>,
    /// Index in `pollfds` by key, for keys below `u32::MAX` (slot indices).
    pos: Vec<usize>,
    /// The caller's timer (see `watch_timer`), in the epoll set only.
    timer: Option<RawFd>,
}

/// Epoll key of the caller's timer; never reported.
const TIMER_KEY: u64 = u64::MAX - 1;

/// At most this many sockets are polled with `poll(2)`; more go through `epoll_wait`.
pub(crate) const POLL_MAX: usize = 8;

fn to_poll(events: u32) -> i16 {
    let mut p = 0;
    for (e, q) in [
        (libc::EPOLLIN, libc::POLLIN),
        (libc::EPOLLOUT, libc::POLLOUT),
    ] {
        if events & e as u32 != 0 {
            p |= q;
        }
    }
    p
}

fn from_poll(revents: i16) -> u32 {
    let mut e = 0;
    for (q, x) in [
        (libc::POLLIN, libc::EPOLLIN),
        (libc::POLLOUT, libc::EPOLLOUT),
        (libc::POLLERR, libc::EPOLLERR),
        (libc::POLLHUP, libc::EPOLLHUP),
        (libc::POLLNVAL, libc::EPOLLERR),
    ] {
        if revents & q != 0 {
            e |= x as u32;
        }
    }
    e
}

impl Watch {
    pub(crate) fn new() -> io::Result<Watch> {
        Ok(Watch {
            epoll: Epoll::new()?,
            pollfds: Vec::new(),
            keys: Vec::new(),
            pos: Vec::new(),
            timer: None,
        })
    }

    /// Watch `fd` for `events` (epoll flags), reported with `key`.
    pub(crate) fn add(&mut self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.epoll.add(fd, events, key)?;
        if let Ok(k) = usize::try_from(key)
            && key < u64::from(u32::MAX)
        {
            if self.pos.len() <= k {
                self.pos.resize(k + 1, usize::MAX);
            }
            self.pos[k] = self.pollfds.len();
        }
        self.pollfds.push(libc::pollfd {
            fd,
            events: to_poll(events),
            revents: 0,
        });
        self.keys.push(key);
        Ok(())
    }

    fn index(&self, key: u64) -> Option<usize> {
        let i = *self.pos.get(usize::try_from(key).ok()?)?;
        (i != usize::MAX).then_some(i)
    }

    /// Change what `fd` (watched with `key`) is watched for.
    pub(crate) fn modify(&mut self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.epoll.modify(fd, events, key)?;
        if let Some(i) = self.index(key) {
            self.pollfds[i].events = to_poll(events);
        }
        Ok(())
    }

    /// Stop watching `fd` (watched with `key`), before it may be closed.
    pub(crate) fn delete(&mut self, fd: RawFd, key: u64) {
        let _ = self.epoll.delete(fd);
        if let Some(i) = self.index(key) {
            self.pos[key as usize] = usize::MAX;
            self.pollfds.swap_remove(i);
            self.keys.swap_remove(i);
            if let Some(&moved) = self.keys.get(i)
                && let Some(p) = self.pos.get_mut(moved as usize)
            {
                *p = i;
            }
        }
    }

    /// The epoll descriptor every watched socket is registered with.
    pub(crate) fn fd(&self) -> RawFd {
        self.epoll.fd()
    }

    /// Report every ready socket now, without waiting: `f(key, epoll events)`. An error
    /// (EINTR) reads as nothing ready; the next call asks again. `epoll` asks epoll whatever
    /// the number of sockets (a caller that sleeps between messages: see `TcpIface`).
    pub(crate) fn wait(&mut self, epoll: bool, mut f: impl FnMut(u64, u32)) {
        if epoll || self.pollfds.len() > POLL_MAX {
            self.sleep(Some(Duration::ZERO), f);
            return;
        }
        // SAFETY: `pollfds` is an initialized array of `len` pollfd structures that lives
        // across the call; every descriptor in it is kept open by its owner until `delete`.
        let rc = unsafe {
            libc::poll(
                self.pollfds.as_mut_ptr(),
                self.pollfds.len() as libc::nfds_t,
                0,
            )
        };
        if rc <= 0 {
            return;
        }
        for (p, &key) in self.pollfds.iter().zip(&self.keys) {
            if p.revents != 0 {
                f(key, from_poll(p.revents));
            }
        }
    }

    /// Sleep until a watched socket is ready, the timer (`watch_timer`) expired, or
    /// `timeout` passed (`None`: no limit; rounded up to whole milliseconds), then report the
    /// ready sockets as [`wait`](Self::wait) does: one `epoll_wait`, whatever the number of
    /// sockets. Level triggered: a socket that was ready before the call ends it at once. An
    /// interrupted sleep reports nothing.
    pub(crate) fn sleep(&mut self, timeout: Option<Duration>, mut f: impl FnMut(u64, u32)) {
        let ms = timeout.map_or(-1, |t| {
            i32::try_from(t.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        });
        for (key, ev) in self.epoll.wait(ms) {
            if key != TIMER_KEY {
                f(key, ev);
            }
        }
    }

    /// Also end sleeps when `fd` (a timer of the caller's that it keeps open and re-arms)
    /// becomes readable: watched by epoll alone and edge triggered, so each expiry ends one
    /// sleep (or is consumed by a check that finds nothing) and is never read here. Watching
    /// the same descriptor again does nothing; a different one is added next to it (a closed
    /// descriptor leaves the set by itself).
    pub(crate) fn watch_timer(&mut self, fd: RawFd) -> io::Result<()> {
        if self.timer == Some(fd) {
            return Ok(());
        }
        self.epoll.add(fd, IN | libc::EPOLLET as u32, TIMER_KEY)?;
        self.timer = Some(fd);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn ready(w: &mut Watch) -> Vec<(u64, u32)> {
        let mut v = Vec::new();
        w.wait(false, |k, e| v.push((k, e)));
        let mut e = Vec::new();
        w.wait(true, |k, ev| e.push((k, ev)));
        e.sort_unstable();
        v.sort_unstable();
        assert_eq!(v, e, "poll and epoll disagree");
        v
    }

    /// Readiness is reported the same way through `poll` (few sockets) and epoll (many), and
    /// deleting sockets from the middle keeps the others' keys.
    #[test]
    fn watch_reports_ready_sockets_by_key_in_both_modes() {
        const IN: u32 = libc::EPOLLIN as u32;
        const OUT: u32 = libc::EPOLLOUT as u32;
        let mut w = Watch::new().unwrap();
        let pairs: Vec<(UnixStream, UnixStream)> = (0..POLL_MAX + 4)
            .map(|_| UnixStream::pair().unwrap())
            .collect();
        let watched = |n: usize| (0..n).map(|k| k as u64);
        // Few sockets: poll.
        for k in watched(3) {
            w.add(pairs[k as usize].0.as_raw_fd(), IN, k).unwrap();
        }
        assert!(ready(&mut w).is_empty());
        (&pairs[1].1).write_all(b"x").unwrap();
        assert_eq!(ready(&mut w), vec![(1, IN)]);
        w.modify(pairs[2].0.as_raw_fd(), IN | OUT, 2).unwrap();
        assert_eq!(ready(&mut w), vec![(1, IN), (2, OUT)]);
        // Many: epoll, same answers.
        for k in 3..pairs.len() as u64 {
            w.add(pairs[k as usize].0.as_raw_fd(), IN, k).unwrap();
        }
        (&pairs[9].1).write_all(b"x").unwrap();
        assert_eq!(ready(&mut w), vec![(1, IN), (2, OUT), (9, IN)]);
        // Delete from the middle until poll is used again; the moved entries keep their keys.
        for k in [0u64, 1, 4, 5, 6] {
            w.delete(pairs[k as usize].0.as_raw_fd(), k);
        }
        assert!(w.pollfds.len() <= POLL_MAX);
        assert_eq!(ready(&mut w), vec![(2, OUT), (9, IN)]);
        w.modify(pairs[2].0.as_raw_fd(), IN, 2).unwrap();
        (&pairs[pairs.len() - 1].1).write_all(b"x").unwrap();
        assert_eq!(ready(&mut w), vec![(9, IN), ((pairs.len() - 1) as u64, IN)]);
    }

    /// A sleep names the sockets that are ready, ends at once when one is ready before it,
    /// and ends when a socket becomes ready while it sleeps (level triggered: reporting does
    /// not consume readiness).
    #[test]
    fn sleep_reports_what_is_ready_and_wakes_on_input() {
        let mut w = Watch::new().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        w.add(a.as_raw_fd(), IN, 1).unwrap();
        w.add(c.as_raw_fd(), IN, 2).unwrap();
        let slept = |w: &mut Watch, t: Duration| {
            let mut v = Vec::new();
            w.sleep(Some(t), |k, e| v.push((k, e)));
            v
        };
        assert!(slept(&mut w, Duration::ZERO).is_empty());
        (&b).write_all(b"x").unwrap();
        assert_eq!(slept(&mut w, Duration::from_secs(60)), vec![(1, IN)]);
        assert_eq!(slept(&mut w, Duration::from_secs(60)), vec![(1, IN)]);
        let mut buf = [0u8; 1];
        std::io::Read::read(&mut &a, &mut buf).unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            (&b).write_all(b"y").unwrap();
            b
        });
        // Woken by the write, long before the limit (a failure would hang for a minute, not
        // pass).
        assert_eq!(slept(&mut w, Duration::from_secs(60)), vec![(1, IN)]);
        drop(writer.join().unwrap());
    }

    /// The caller's timer ends a sleep without a limit once per expiry and is never reported;
    /// checks (epoll) consume an expiry they meet, so it cannot keep a socket-less interface
    /// looking busy.
    #[test]
    fn a_timer_ends_one_sleep_per_expiry_and_is_never_reported() {
        let mut w = Watch::new().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        w.add(a.as_raw_fd(), IN, 3).unwrap();
        let t = rucx_ucs::event::TimerFd::new().unwrap();
        w.watch_timer(t.fd()).unwrap();
        w.watch_timer(t.fd()).unwrap();
        t.set(Duration::from_millis(5)).unwrap();
        let mut got = Vec::new();
        // No limit: only the timer can end it (a failure hangs rather than passes).
        w.sleep(None, |k, e| got.push((k, e)));
        assert!(got.is_empty(), "{got:?}");
        let readable =
            |w: &Watch| rucx_ucs::event::wait_readable(w.fd(), Some(Duration::ZERO)).unwrap();
        // The expiry was consumed: the set is idle although the timer was never drained.
        assert!(!readable(&w));
        // An expiry that no sleep met is consumed by the next check, which reports nothing.
        t.set(Duration::from_millis(1)).unwrap();
        assert!(rucx_ucs::event::wait_readable(t.fd(), None).unwrap());
        assert!(readable(&w), "the expiry is pending");
        w.wait(true, |k, e| got.push((k, e)));
        assert!(got.is_empty(), "{got:?}");
        assert!(!readable(&w));
        // Sockets are reported as before.
        (&b).write_all(b"x").unwrap();
        w.wait(true, |k, e| got.push((k, e)));
        assert_eq!(got, vec![(3, IN)]);
        got.clear();
        w.sleep(Some(Duration::ZERO), |k, e| got.push((k, e)));
        assert_eq!(got, vec![(3, IN)], "level triggered sockets stay ready");
    }
}
