//! Event-driven progress: the worker's event descriptor ([`Worker::event_fd`]), arming
//! ([`Worker::arm`]) and sleeping until something happens ([`Worker::wait`]); and how a
//! blocking wait uses them once polling found nothing for a while.
//!
//! # The protocol (as UCX's `ucp_worker_get_efd` / `ucp_worker_arm` / `ucp_worker_wait`)
//!
//! ```text
//! loop {
//!     while worker.progress() > 0 {}          // 1. drain
//!     match worker.arm() {                     // 2. nothing pending? then ask for a wake-up
//!         Ok(()) => poll(worker.event_fd()),   // 3. sleep until readable (or a timeout)
//!         Err(Error::Busy(_)) => continue,     //    events are pending: progress again
//!         Err(e) => return Err(e),
//!     }
//! }
//! ```
//!
//! [`Worker::wait`] is steps 2 and 3: with a single interface that has a descriptor (the
//! others silent) it sleeps on that interface directly
//! ([`Iface::arm_and_wait`](rucx_uct::Iface::arm_and_wait)), its timers ending the sleep
//! through a timerfd set once per tick; otherwise as follows. The worker's descriptor is an
//! epoll set of its own that
//! holds every interface's descriptor ([`EventSource::Fd`]); interfaces that never have
//! anything later ([`EventSource::Silent`]) are left out. An interface that cannot signal
//! ([`EventSource::PollOnly`]: the simulated fabric of the tests, rc_verbs on a device without
//! completion channels) makes
//! the worker *poll-only*: its sleeps last at most [`POLL_ONLY_TICK`]
//! ([`Worker::wait_tick`]), so that interface is still looked at a thousand times a second
//! (a little CPU instead of none).
//!
//! Besides its interfaces' events, the worker has work of its own that no descriptor shows:
//! messages queued for a peer whose transport said "no resources", wire-up of a new endpoint,
//! copies that finished at once, active messages not yet handed to their handlers, owned
//! requests, closes and endpoint errors to hand out. `arm` reports those as busy too.
//!
//! Timers: the peer check of `RUCX_PEER_TIMEOUT`, the process check of same-host peers
//! (`RUCX_PROC_CHECK_INTERVAL`) and the deadlines of transports (a tcp connect) run in
//! `progress` (which reads the clock only every so many calls) and in `arm` (which reads it
//! every time: a worker that sleeps makes few progress calls), so a sleep lasts at most
//! [`WAIT_TICK`], or the peer-check or process-check interval when shorter, before `wait`
//! returns for a progress call. A sleeping worker thus wakes twice a second when nothing
//! happens (the process check's 500 ms; once a second with it off).

use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::task::Waker;
use std::time::{Duration, Instant};

use rucx_ucs::event::{EventSet, TimerFd};
use rucx_ucs::{Error, Result};
use rucx_uct::EventSource;

use super::{State, Worker};

/// Longest sleep of [`Worker::wait`] before it returns for a progress call (timers).
pub const WAIT_TICK: Duration = Duration::from_secs(1);
/// Longest sleep of a poll-only worker (see the module documentation).
pub const POLL_ONLY_TICK: Duration = Duration::from_millis(1);

/// The event set and whether an interface is left out of it (poll-only).
#[derive(Debug)]
struct Set {
    set: EventSet,
    poll_only: bool,
    /// The only interface with a descriptor, when the others are silent: [`Worker::wait`]
    /// sleeps on it directly ([`Iface::arm_and_wait`](rucx_uct::Iface::arm_and_wait)).
    single: Option<usize>,
}

/// The timer that ends the direct sleeps of [`Worker::wait`] when the worker's timers are
/// due: set once per [`wait_tick`](Worker::wait_tick), not once per sleep (a sleep with a
/// timeout arms and cancels a kernel timer every time, which a ping-pong that sleeps between
/// messages pays on every message).
#[derive(Debug, Default)]
enum SleepTimer {
    /// Not needed yet.
    #[default]
    Unmade,
    /// No timerfd: sleeps carry a timeout instead.
    Failed,
    /// The timer and when it expires (`None`: not set).
    Made(TimerFd, Option<Instant>),
}

/// The worker's event set, made at the first use, and the wakers of awaited requests.
#[derive(Debug, Default)]
pub(super) struct Events {
    set: std::cell::OnceCell<std::result::Result<Set, Error>>,
    /// See [`SleepTimer`].
    timer: RefCell<SleepTimer>,
    /// Descriptors of the worker's own in the set besides the interfaces' (the connection
    /// manager's sockets, `connecting.rs`): added to it when it is made, or at once.
    extra: RefCell<Vec<RawFd>>,
    /// Requests polled as futures and not finished then: woken when a progress call (or a
    /// cancel) finishes them.
    wakers: RefCell<Vec<(u64, Waker)>>,
    /// `wakers` is not empty (checked on every progress call without a borrow).
    any_waker: Cell<bool>,
}

impl Events {
    /// The sleep timer's descriptor, set to expire within `tick` of `now`: left as it is
    /// while its expiry lies ahead and no later than that, set again otherwise. `None` when
    /// there is no timer (sleep with a timeout instead).
    fn sleep_timer(&self, now: Instant, tick: Duration) -> Option<RawFd> {
        let mut t = self.timer.borrow_mut();
        if let SleepTimer::Unmade = *t {
            *t = match TimerFd::new() {
                Ok(fd) => SleepTimer::Made(fd, None),
                Err(e) => {
                    tracing::debug!("worker: no timerfd ({e}); sleeps carry a timeout");
                    SleepTimer::Failed
                }
            };
        }
        let SleepTimer::Made(fd, due) = &mut *t else {
            return None;
        };
        if due.is_none_or(|d| d <= now || d > now + tick) {
            if let Err(e) = fd.set(tick) {
                tracing::debug!("worker: setting the sleep timer failed ({e}); using a timeout");
                *due = None;
                return None;
            }
            *due = Some(now + tick);
        }
        Some(fd.fd())
    }

    /// Have the set watch `fd` (readable) too, from now on, whether or not it is made yet.
    pub(super) fn add_extra(&self, ifaces: &[Box<dyn rucx_uct::Iface>], fd: RawFd) {
        if self.extra.borrow().contains(&fd) {
            return;
        }
        self.extra.borrow_mut().push(fd);
        if self.set.get().is_some()
            && let Ok(s) = self.get(ifaces)
            && let Err(e) = s.set.add(fd, u64::MAX)
        {
            tracing::warn!("worker: its event set does not take descriptor {fd}: {e}");
        }
    }

    /// The set over `ifaces`' descriptors.
    fn get(&self, ifaces: &[Box<dyn rucx_uct::Iface>]) -> Result<&Set> {
        self.set
            .get_or_init(|| {
                let set = EventSet::new()
                    .map_err(|e| Error::io("worker: creating its event set (epoll)", e))?;
                let mut poll_only = false;
                let mut with_fd = Vec::new();
                for (i, iface) in ifaces.iter().enumerate() {
                    match iface.event_source() {
                        EventSource::Fd(fd) => {
                            with_fd.push(i);
                            set.add(fd, i as u64).map_err(|e| {
                                Error::io(
                                    format!(
                                        "worker: adding the event descriptor of {} to its set",
                                        iface.attr().tl_name
                                    ),
                                    e,
                                )
                            })?
                        }
                        EventSource::Silent => {}
                        EventSource::PollOnly => {
                            tracing::debug!(
                                "{}/{} cannot signal events: the worker sleeps {:?} at most",
                                iface.attr().tl_name,
                                iface.attr().dev_name,
                                POLL_ONLY_TICK
                            );
                            poll_only = true;
                        }
                    }
                }
                for &fd in self.extra.borrow().iter() {
                    set.add(fd, u64::MAX).map_err(|e| {
                        Error::io("worker: adding the connection manager's set to its set", e)
                    })?;
                }
                let single = match with_fd[..] {
                    [i] if !poll_only => Some(i),
                    _ => None,
                };
                Ok(Set {
                    set,
                    poll_only,
                    single,
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl State {
    /// Work of the worker itself that the next progress call does (no descriptor shows it).
    fn pending_work(&self) -> Option<String> {
        if !self.done_q.is_empty() {
            return Some("copies that finished at once wait to be handled".into());
        }
        if !self.am_inbox.is_empty() {
            return Some("active messages wait for their handlers".into());
        }
        if self.owned.has_work() || self.life.has_work() {
            return Some("owned requests, closes or endpoint errors wait to be handed out".into());
        }
        for p in &self.peers {
            // One the connection manager is connecting waits for its socket, which is in
            // the event set (`connecting.rs`).
            if p.failed.is_none() && !p.cm_pending && (!p.connected || p.needs_lanes) {
                return Some("an endpoint is being connected".into());
            }
            if !p.queue.is_empty() {
                return Some("messages wait for room on a transport".into());
            }
        }
        None
    }

    /// The longest a sleep may last before timers need a progress call.
    fn wait_tick(&self) -> Duration {
        let tick = match &self.keepalive {
            Some(ka) => ka.check_every().min(WAIT_TICK),
            None => WAIT_TICK,
        };
        match self.procs.interval() {
            Some(every) => tick.min(every),
            None => tick,
        }
    }
}

impl Worker {
    /// Make progress on the interfaces in use (every interface on every 32nd call, see
    /// `active.rs`; [`arm`](Self::arm) looks at the ones skipped before anything sleeps);
    /// returns the number of events handled. Requests awaited as futures that this call
    /// finished are woken.
    #[inline]
    pub fn progress(&self) -> usize {
        let (n, _) = self.progress_once();
        if n > 0 && self.events.any_waker.get() {
            self.wake_finished();
        }
        n
    }

    /// [`progress`](Self::progress), and whether ends of queued requests wait to be taken
    /// ([`has_completed`](Self::has_completed)) after it, read under the pass's own borrow of
    /// the worker when nothing ran after it (the idle poll's usual case: one look fewer).
    #[inline(always)]
    pub fn progress_queued(&self) -> (usize, bool) {
        let (n, completed) = self.progress_once();
        if n > 0 && self.events.any_waker.get() {
            self.wake_finished();
            // A woken task may have run (a local executor): read again.
            return (n, self.has_completed());
        }
        (n, completed)
    }

    /// Remember `waker` for request `id`, to wake once a progress call finishes the request
    /// (the rule for futures: see [`Request`](crate::Request)'s `Future` impl).
    pub(crate) fn register_waker(&self, id: u64, waker: &Waker) {
        let mut ws = self.events.wakers.borrow_mut();
        match ws.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) => w.clone_from(waker),
            None => ws.push((id, waker.clone())),
        }
        self.events.any_waker.set(true);
    }

    /// Wake the registered wakers of requests that finished.
    pub(super) fn wake_finished(&self) {
        let done: Vec<Waker> = {
            let mut ws = self.events.wakers.borrow_mut();
            let mut done = Vec::new();
            ws.retain(|(id, w)| {
                if self.req_result(*id).is_some() {
                    done.push(w.clone());
                    false
                } else {
                    true
                }
            });
            self.events.any_waker.set(!ws.is_empty());
            done
        };
        // Woken after the borrow ends: a waker may poll at once (a local executor).
        for w in done {
            w.wake();
        }
    }

    /// The worker's event descriptor: it becomes readable after [`arm`](Self::arm) succeeded
    /// and then something happened that [`progress`](Self::progress) handles (a message, a
    /// completion, a failed peer). Poll it with `poll(2)`/epoll or an async runtime (the
    /// facade's `tokio` feature); it lives as long as the worker. Wait on it for
    /// [`wait_tick`](Self::wait_tick) at most: timers (and poll-only transports) need progress
    /// calls even when it stays idle.
    pub fn event_fd(&self) -> Result<RawFd> {
        let ifaces = self.ifaces.borrow();
        self.events.get(&ifaces).map(|s| s.set.fd())
    }

    /// The longest a sleeper may wait on the [event descriptor](Self::event_fd) before it
    /// calls [`progress`](Self::progress) anyway: [`WAIT_TICK`], the peer-check interval of
    /// `RUCX_PEER_TIMEOUT` when shorter, [`POLL_ONLY_TICK`] when a transport cannot signal.
    pub fn wait_tick(&self) -> Duration {
        let tick = self.st.borrow().wait_tick();
        let poll_only = {
            let ifaces = self.ifaces.borrow();
            self.events.get(&ifaces).map_or(true, |s| s.poll_only)
        };
        if poll_only {
            tick.min(POLL_ONLY_TICK)
        } else {
            tick
        }
    }

    /// Ask for the [event descriptor](Self::event_fd) to become readable at the next event.
    /// Returns [`Error::Busy`] (nothing armed, or a wake-up may come anyway) when events are
    /// pending: progress the worker and arm again. Call it only after progress found nothing,
    /// as `ucp_worker_arm`.
    /// With a poll-only transport, arming succeeds for the others (see
    /// [`wait_tick`](Self::wait_tick)).
    pub fn arm(&self) -> Result<()> {
        // Timers (the peer and process checks) go by the clock, which the few progress calls
        // of a worker that sleeps most of the time would seldom read: they run here, before
        // a sleep; a peer found dead makes this arm busy (its error to hand out).
        self.check_peers(Instant::now());
        // The interfaces the last progress call skipped (cold ones, `active.rs`) are looked
        // at before anything sleeps.
        if self.poll_cold() > 0 {
            return Err(Error::Busy(
                "worker: events arrived on interfaces the last progress did not poll".into(),
            ));
        }
        let mut ifaces = self.ifaces.borrow_mut();
        self.events.get(&ifaces)?;
        if let Some(why) = self.st.borrow().pending_work() {
            return Err(Error::Busy(format!("worker: {why}")));
        }
        for iface in ifaces.iter_mut() {
            if let EventSource::Fd(_) = iface.event_source() {
                iface.arm()?;
            }
        }
        Ok(())
    }

    /// Sleep until an event (the worker armed itself; see [`arm`](Self::arm)), `timeout`
    /// passed (`None`: no limit), or a timer needs a progress call
    /// ([`wait_tick`](Self::wait_tick) at most). Returns at once when events are pending.
    /// Progress the worker afterwards and look at what you wait for: a return without an event
    /// is possible, as with `ucp_worker_wait`.
    ///
    /// With one interface that has a descriptor (the others silent), it sleeps on that
    /// interface directly ([`Iface::arm_and_wait`](rucx_uct::Iface::arm_and_wait): tcp sleeps
    /// in the `epoll_wait` that also names its ready sockets); otherwise it arms every
    /// interface and sleeps on the worker's set.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let single = {
            let ifaces = self.ifaces.borrow();
            self.events.get(&ifaces)?.single
        };
        // Connections under way are in the set, not on the interface: sleep on the set then.
        if let Some(i) = single.filter(|_| !self.cm_any.get()) {
            // `arm` without the interface's part, which `arm_and_wait` does.
            let now = Instant::now();
            self.check_peers(now);
            if self.poll_cold() > 0 || self.st.borrow().pending_work().is_some() {
                return Ok(());
            }
            let tick = self.wait_tick();
            // The timer ends the sleep when the timers are due; without one, the sleep's own
            // limit does.
            let (limit, timer) = match self.events.sleep_timer(now, tick) {
                Some(fd) => (timeout, Some(fd)),
                None => (Some(timeout.map_or(tick, |t| t.min(tick))), None),
            };
            return self.ifaces.borrow_mut()[i].arm_and_wait(limit, timer);
        }
        match self.arm() {
            Ok(()) => {}
            Err(Error::Busy(_)) => return Ok(()),
            Err(e) => return Err(e),
        }
        let tick = self.wait_tick();
        let limit = timeout.map_or(tick, |t| t.min(tick));
        let ifaces = self.ifaces.borrow();
        let set = self.events.get(&ifaces)?;
        set.set
            .wait(Some(limit))
            .map_err(|e| Error::io("worker: waiting on its event set", e))?;
        Ok(())
    }

    /// Sleep until an event on any of `workers` (each armed), `timeout`, or the shortest
    /// [`wait_tick`](Self::wait_tick); at once when one has events pending.
    pub(crate) fn wait_many(workers: &[&Worker], timeout: Option<Duration>) -> Result<()> {
        let mut fds = Vec::with_capacity(workers.len());
        let mut tick = WAIT_TICK;
        for w in workers {
            match w.arm() {
                Ok(()) => {}
                Err(Error::Busy(_)) => return Ok(()),
                Err(e) => return Err(e),
            }
            fds.push(w.event_fd()?);
            tick = tick.min(w.wait_tick());
        }
        let limit = timeout.map_or(tick, |t| t.min(tick));
        rucx_ucs::event::wait_any_readable(&fds, Some(limit))
            .map_err(|e| Error::io("waiting on the events of several workers", e))?;
        Ok(())
    }

    /// Progress until `done` says so or `deadline` passed (false then), polling flat out
    /// first and sleeping on the worker's events once nothing happened for a while; the
    /// runtime-free way to block on a worker.
    pub fn progress_until(
        &self,
        deadline: Option<Instant>,
        mut done: impl FnMut() -> bool,
    ) -> bool {
        let mut backoff = super::liveness::Backoff::until(deadline);
        loop {
            if done() {
                return true;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            if self.progress() == 0 {
                backoff.idle(self);
            } else {
                backoff.busy();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // `Worker` may move to another thread (one thread at a time uses it).
    const _: () = {
        const fn assert_send<T: Send>() {}
        assert_send::<Worker>();
    };

    fn due(e: &Events) -> Option<Instant> {
        match &*e.timer.borrow() {
            SleepTimer::Made(_, due) => *due,
            other => panic!("{other:?}"),
        }
    }

    /// The sleep timer is set once per tick, not per sleep: left alone while its expiry lies
    /// ahead within the tick, set again once it passed or when the tick shrank below it.
    #[test]
    fn the_sleep_timer_is_set_again_only_when_due_or_too_late() {
        let e = Events::default();
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let fd = e.sleep_timer(t0, s).unwrap();
        assert_eq!(due(&e), Some(t0 + s));
        assert_eq!(e.sleep_timer(t0 + s / 2, s), Some(fd));
        assert_eq!(due(&e), Some(t0 + s), "not set again before it is due");
        let t1 = t0 + s / 2;
        e.sleep_timer(t1, s / 10).unwrap();
        assert_eq!(due(&e), Some(t1 + s / 10), "a shorter tick sets it sooner");
        let t2 = t1 + s;
        e.sleep_timer(t2, s).unwrap();
        assert_eq!(due(&e), Some(t2 + s), "set again once due");
        // The descriptor is readable at the expiry it was last set to.
        e.sleep_timer(Instant::now() + s * 10, Duration::from_millis(1))
            .unwrap();
        assert!(rucx_ucs::event::wait_readable(fd, None).unwrap());
    }

    /// A sleep without a limit still ends for the worker's timers (the sleep timer).
    #[test]
    fn a_wait_without_a_timeout_ends_for_the_timers() {
        let w = super::super::tests::self_worker();
        while w.progress() > 0 {}
        for _ in 0..2 {
            w.wait(None).unwrap();
        }
    }

    #[test]
    fn an_idle_worker_arms_its_descriptor_stays_idle_and_wait_honours_the_timeout() {
        let w = super::super::tests::self_worker();
        while w.progress() > 0 {}
        let fd = w.event_fd().unwrap();
        assert_eq!(
            w.event_fd().unwrap(),
            fd,
            "one descriptor for the worker's life"
        );
        w.arm().unwrap();
        assert!(!rucx_ucs::event::wait_readable(fd, Some(Duration::ZERO)).unwrap());
        let t = Instant::now();
        w.wait(Some(Duration::from_millis(30))).unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_message_to_an_armed_worker_wakes_it_and_arming_with_it_pending_is_busy() {
        let w = super::super::tests::self_worker();
        let ep = w.connect(&w.address()).unwrap();
        let got = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let g = got.clone();
        w.set_am_handler(3, move |_, _| {
            g.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        // Wire-up traffic first: arm only once the worker is quiet.
        let mut spins = 0;
        loop {
            while w.progress() > 0 {}
            match w.arm() {
                Ok(()) => break,
                Err(Error::Busy(_)) => spins += 1,
                Err(e) => panic!("{e}"),
            }
            assert!(spins < 1_000_000, "never quiet");
        }
        let fd = w.event_fd().unwrap();
        w.am_send(ep, 3, b"h", b"data").unwrap();
        assert!(rucx_ucs::event::wait_readable(fd, Some(Duration::from_secs(5))).unwrap());
        assert!(
            matches!(w.arm(), Err(Error::Busy(_))),
            "a message is pending"
        );
        // Returns at once: events are pending.
        w.wait(None).unwrap();
        assert!(
            w.progress_until(Some(Instant::now() + Duration::from_secs(5)), || got
                .load(std::sync::atomic::Ordering::Relaxed)
                == 1)
        );
    }
}
