//! Peer liveness (`RUCX_PEER_TIMEOUT`, keepalive probes) and how blocking waits ease off when
//! nothing happens.
//!
//! Nothing here reads the clock per message or per busy poll: a message from a peer only sets a
//! flag; the flags are looked at by [`State::check_peers`], which runs every
//! [`CHECK_POLLS`] progress calls or from a wait that is easing off (which reads the clock
//! anyway), and at most every `timeout / 16`.

use std::cell::Cell;
use std::time::{Duration, Instant};

use rucx_ucs::{Config, Error, units};

use super::Worker;
use super::state::{ReqKind, State};
use crate::wire::Msg;

/// Progress calls between two looks at the clock for the peer check (when a timeout is set).
pub(super) const CHECK_POLLS: u32 = 128;

/// Idle polls of a wait made flat out, as before this module (no pause instruction).
const SPIN_POLLS: u32 = 1000;
/// Past [`SPIN_POLLS`], idle polls between two clock reads.
const CLOCK_POLLS: u32 = 256;
/// Idle this long, a wait yields the CPU between polls ...
const YIELD_AFTER: Duration = Duration::from_millis(1);
/// ... and idle this long, it arms the worker and sleeps on its event descriptor until
/// something happens (`events.rs`); should that fail, it sleeps between polls instead, from
/// [`NAP_MIN`] doubling up to [`NAP_MAX`].
const SLEEP_AFTER: Duration = Duration::from_millis(4);
const NAP_MIN: Duration = Duration::from_micros(20);
const NAP_MAX: Duration = Duration::from_millis(1);

/// The worker's peer timeout, when one is set.
pub(crate) struct Keepalive {
    pub(super) timeout: Duration,
    /// A peer silent this long with requests bound to it is probed (and again this often).
    pub(super) probe_every: Duration,
    /// Shortest time between two peer checks.
    check_every: Duration,
    next_check: Option<Instant>,
    /// Progress calls since the last look at the clock.
    pub(super) polls: u32,
    /// The option as the user wrote it, for the error.
    raw: String,
}

impl Keepalive {
    /// Shortest time between two peer checks (a sleeping worker wakes this often).
    pub(super) fn check_every(&self) -> Duration {
        self.check_every
    }

    /// From `RUCX_PEER_TIMEOUT` (`None` for `inf`, the default).
    pub(super) fn from_config(cfg: &Config) -> Option<Keepalive> {
        Keepalive::new(
            cfg.time("PEER_TIMEOUT"),
            cfg.raw("PEER_TIMEOUT").unwrap_or_default(),
        )
    }

    pub(super) fn new(timeout: Duration, raw: &str) -> Option<Keepalive> {
        if timeout == Duration::MAX || timeout.is_zero() {
            return None;
        }
        Some(Keepalive {
            timeout,
            probe_every: timeout / 4,
            check_every: (timeout / 16).clamp(Duration::from_millis(1), Duration::from_secs(1)),
            next_check: None,
            polls: 0,
            raw: raw.to_string(),
        })
    }
}

/// What a worker knows of a peer's liveness.
#[derive(Default)]
pub(crate) struct PeerLive {
    /// A message came from the peer since the last check (set on every message: no clock).
    pub(super) heard: Cell<bool>,
    /// The first check that found the peer silent with requests bound to it.
    silent_since: Option<Instant>,
    /// When the last probe went out.
    probed_at: Option<Instant>,
}

impl State {
    /// The peer a pending request is bound to: one whose answer or data it waits for. Receives
    /// not matched yet are bound to none.
    fn bound_peer(kind: &ReqKind) -> Option<usize> {
        match kind {
            ReqKind::Send(s) => Some(s.head.peer),
            ReqKind::Recv(rs) => rs.sender,
            ReqKind::Rma(rm) => Some(rm.peer),
        }
    }

    /// Look at every peer with requests bound to it: probe those silent for a quarter of the
    /// timeout, fail those silent for all of it. Returns at once when the last check was less
    /// than `timeout / 16` ago, or when no timeout is set.
    pub(super) fn check_peers(&mut self, now: Instant) {
        let Some(ka) = &mut self.keepalive else {
            return;
        };
        if ka.next_check.is_some_and(|t| now < t) {
            return;
        }
        ka.next_check = Some(now + ka.check_every);
        let (timeout, probe_every) = (ka.timeout, ka.probe_every);
        let mut bound = vec![false; self.peers.len()];
        for (_, r) in self.reqs.iter() {
            if r.result.is_none()
                && let Some(b) = State::bound_peer(&r.kind).and_then(|p| bound.get_mut(p))
            {
                *b = true;
            }
        }
        for (p, is_bound) in bound.into_iter().enumerate() {
            let peer = &mut self.peers[p];
            if peer.failed.is_some() {
                continue;
            }
            let connected = peer.connected;
            let live = &mut peer.live;
            if live.heard.replace(false) || !is_bound || !connected {
                // Alive, or nobody waits for it: silence is not counted.
                live.silent_since = None;
                live.probed_at = None;
                continue;
            }
            let silent = now.saturating_duration_since(*live.silent_since.get_or_insert(now));
            if silent >= timeout {
                let (reason, err) = self.timeout_error(p, silent);
                self.fail_peer_with(p, &reason, err);
            } else if silent >= probe_every
                && live
                    .probed_at
                    .is_none_or(|t| now.saturating_duration_since(t) >= probe_every)
            {
                live.probed_at = Some(now);
                self.send_keepalive(p, false);
                self.count("keepalive probe");
            }
        }
    }

    /// Why peer `p` is failed after `silent` without a word (the reason `Worker::ep_error`
    /// tells), and the typed error its requests end with.
    fn timeout_error(&self, p: usize, silent: Duration) -> (String, Error) {
        let ka = self.keepalive.as_ref().expect("a timeout is set");
        let silent = Duration::from_millis(silent.as_millis() as u64);
        let knob = format!("RUCX_PEER_TIMEOUT={}", ka.raw);
        let reason = format!(
            "it answered nothing for {} (no message, no answer to keepalive probes), the peer \
             timeout {knob}: the peer is frozen, stopped, unreachable or not calling into rucx",
            units::format_time(silent),
        );
        let err = Error::PeerTimeout {
            peer: self.peers[p].remote.describe(),
            silent,
            knob,
        };
        (reason, err)
    }

    /// Send peer `p` a keepalive probe, or the answer to one.
    pub(super) fn send_keepalive(&mut self, p: usize, reply: bool) {
        if self.peers[p].failed.is_some() {
            return;
        }
        let src = self.address.uuid;
        self.send_msg(p, &Msg::Keepalive { src, reply });
        self.pump(p);
    }
}

/// How a blocking wait polls: flat out first (no clock read, no system call), then, after a
/// long idle stretch, yielding the CPU and sleeping a little longer each time. Any event puts
/// it back to polling flat out.
pub(crate) struct Backoff {
    idle: u32,
    /// Idle long enough to yield or sleep at every idle poll.
    slow: bool,
    since: Option<Instant>,
    nap: Duration,
    /// The wait's deadline: a sleep on the worker's events ends there.
    deadline: Option<Instant>,
    /// Sleeps on the worker's events so far.
    slept: u32,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff::until(None)
    }

    /// For a wait that ends at `deadline`.
    pub(crate) fn until(deadline: Option<Instant>) -> Backoff {
        Backoff {
            idle: 0,
            slow: false,
            since: None,
            nap: NAP_MIN,
            deadline,
            slept: 0,
        }
    }

    /// Something happened: poll flat out again.
    #[inline(always)]
    pub(crate) fn busy(&mut self) {
        self.idle = 0;
        if self.since.is_some() {
            *self = Backoff::until(self.deadline);
        }
    }

    /// A poll found nothing.
    #[inline]
    pub(crate) fn idle(&mut self, w: &Worker) {
        if self.slow {
            return self.ease_off(w);
        }
        self.idle = self.idle.saturating_add(1);
        if self.idle <= SPIN_POLLS {
            return;
        }
        std::hint::spin_loop();
        if self.idle.is_multiple_of(CLOCK_POLLS) {
            self.ease_off(w);
        }
    }

    #[cold]
    fn ease_off(&mut self, w: &Worker) {
        let now = Instant::now();
        let idle_for = now.saturating_duration_since(*self.since.get_or_insert(now));
        w.check_peers(now);
        if idle_for < YIELD_AFTER {
            return;
        }
        // From here on every idle poll yields or sleeps (the system call dwarfs the clock).
        self.slow = true;
        if idle_for < SLEEP_AFTER {
            std::thread::yield_now();
            return;
        }
        // Sleep on the worker's events (armed: any message or completion wakes it), up to the
        // deadline; should that fail, nap, a little longer each time.
        let left = self.deadline.map(|d| d.saturating_duration_since(now));
        match w.wait(left) {
            Ok(()) => self.slept += 1,
            Err(e) => {
                tracing::warn!("a blocking wait cannot sleep on the worker's events: {e}");
                std::thread::sleep(self.nap);
                self.nap = (self.nap * 2).min(NAP_MAX);
            }
        }
    }
}

impl Worker {
    /// Run the peer and process checks now (rate-limited inside); for waits that read the
    /// clock anyway, and [`arm`](Worker::arm) before a sleep.
    pub(super) fn check_peers(&self, now: Instant) {
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.check_peers(now);
            st.check_procs(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inf_and_zero_mean_no_timeout_and_the_fractions_follow_the_timeout() {
        assert!(Keepalive::new(Duration::MAX, "inf").is_none());
        assert!(Keepalive::new(Duration::ZERO, "0s").is_none());
        let ka = Keepalive::new(Duration::from_secs(2), "2s").unwrap();
        assert_eq!(ka.probe_every, Duration::from_millis(500));
        assert_eq!(ka.check_every, Duration::from_millis(125));
        let long = Keepalive::new(Duration::from_secs(3600), "1h").unwrap();
        assert_eq!(long.check_every, Duration::from_secs(1));
        let short = Keepalive::new(Duration::from_millis(10), "10ms").unwrap();
        assert_eq!(short.check_every, Duration::from_millis(1));
    }

    #[test]
    fn a_wait_spins_first_then_yields_then_sleeps_on_events_and_events_reset_it() {
        let w = super::super::tests::self_worker();
        while w.progress() > 0 {}
        let deadline = Instant::now() + Duration::from_millis(300);
        let mut b = Backoff::until(Some(deadline));
        // The flat-out polls never look at the clock.
        for _ in 0..SPIN_POLLS {
            b.idle(&w);
        }
        assert!(b.since.is_none() && !b.slow);
        // Past them, the clock is read every CLOCK_POLLS idle polls; after YIELD_AFTER the
        // wait yields or sleeps at every poll.
        let t = Instant::now();
        while !b.slow {
            b.idle(&w);
            assert!(t.elapsed() < Duration::from_secs(5), "never eased off");
        }
        assert!(b.since.is_some());
        let t = Instant::now();
        while b.slept == 0 {
            b.idle(&w);
            assert!(t.elapsed() < Duration::from_secs(5), "never slept");
        }
        assert!(
            t.elapsed() >= SLEEP_AFTER - YIELD_AFTER,
            "slept from SLEEP_AFTER on"
        );
        // Nothing happens on this worker: the sleep on its events lasted until the deadline
        // (not a nap).
        assert!(Instant::now() >= deadline, "woke before the deadline");
        assert_eq!(b.nap, NAP_MIN, "no naps on a worker with events");
        b.busy();
        assert!(b.idle == 0 && !b.slow && b.since.is_none() && b.nap == NAP_MIN);
        assert_eq!(b.deadline, Some(deadline), "the deadline stays");
    }

    fn worker(vars: &[(&str, &str)]) -> Worker {
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let mut all = vec![("RUCX_TLS", "self")];
        all.extend_from_slice(vars);
        let cfg = rucx_ucs::Config::from_vars(&tables, all).unwrap();
        let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
        Worker::new(&ctx).unwrap()
    }

    fn flush_req(st: &mut State, peer: usize) -> u64 {
        st.new_req(ReqKind::Rma(crate::proto::rma::RmaState::flush(
            peer,
            Vec::new(),
            Vec::new(),
        )))
    }

    fn probes(st: &State) -> u64 {
        st.counters
            .iter()
            .find(|(n, _)| *n == "keepalive probe")
            .map_or(0, |c| c.1)
    }

    #[test]
    fn the_option_defaults_to_inf_and_is_read() {
        assert!(worker(&[]).st.borrow().keepalive.is_none(), "default inf");
        let w = worker(&[("RUCX_PEER_TIMEOUT", "2s")]);
        assert_eq!(
            w.st.borrow().keepalive.as_ref().map(|k| k.timeout),
            Some(Duration::from_secs(2))
        );
    }

    /// The bookkeeping on a clock of its own (no progress, so the probes go unanswered):
    /// silence counts only while a request is bound to the peer, a probe goes out after a
    /// quarter of the timeout and not again before another quarter, any message resets the
    /// silence, and the whole timeout fails the peer's requests once, naming the option.
    #[test]
    fn silence_is_counted_only_while_requests_wait_and_ends_in_an_endpoint_failure() {
        let w = worker(&[("RUCX_PEER_TIMEOUT", "80ms")]);
        let ep = w.connect(&w.address()).unwrap();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut st = w.st.borrow_mut();
        let p = ep.idx();
        // No request: a silence of any length is not counted.
        st.check_peers(ms(0));
        st.check_peers(ms(10_000));
        assert!(st.peers[p].failed.is_none() && st.peers[p].live.silent_since.is_none());
        // An unmatched receive is bound to no peer.
        let mut buf = [0u8; 8];
        drop(st);
        let rid = w.post_recv(crate::buf::RecvBuf::from(&mut buf[..]), 5, u64::MAX);
        let mut st = w.st.borrow_mut();
        st.check_peers(ms(20_000));
        st.check_peers(ms(30_000));
        assert!(st.peers[p].failed.is_none() && st.peers[p].live.silent_since.is_none());
        // A request bound to the peer: silence counts from the next check.
        let id = flush_req(&mut st, p);
        let t = 40_000;
        st.check_peers(ms(t));
        assert_eq!(st.peers[p].live.silent_since, Some(ms(t)));
        assert_eq!(probes(&st), 0);
        st.check_peers(ms(t + 10));
        assert_eq!(probes(&st), 0, "probed only after a quarter of the timeout");
        st.check_peers(ms(t + 21));
        assert_eq!(probes(&st), 1);
        st.check_peers(ms(t + 30));
        assert_eq!(probes(&st), 1, "not again before another quarter");
        st.check_peers(ms(t + 42));
        assert_eq!(probes(&st), 2);
        // A message from it: the silence starts over.
        st.peers[p].live.heard.set(true);
        st.check_peers(ms(t + 60));
        assert!(st.peers[p].live.silent_since.is_none());
        st.check_peers(ms(t + 70));
        st.check_peers(ms(t + 149));
        assert!(st.peers[p].failed.is_none(), "79 ms of silence");
        st.check_peers(ms(t + 152));
        assert!(
            st.peers[p].failed.is_none(),
            "checked at most every timeout / 16"
        );
        st.check_peers(ms(t + 155));
        let reason = st.peers[p].failed.clone().expect("80 ms of silence");
        assert!(reason.contains("RUCX_PEER_TIMEOUT=80ms"), "{reason}");
        // Typed: the request, and one posted to the endpoint later, end with the timeout,
        // which names the knob.
        let timed_out = |e: &Error| match e {
            Error::PeerTimeout { silent, knob, .. } => {
                assert!(*silent >= Duration::from_millis(80), "{silent:?}");
                assert_eq!(knob, "RUCX_PEER_TIMEOUT=80ms");
                assert!(e.to_string().contains("RUCX_PEER_TIMEOUT=80ms"), "{e}");
            }
            other => panic!("{other:?}"),
        };
        match st.reqs.get(&id).and_then(|r| r.result.clone()) {
            Some(Err(e)) => timed_out(&e),
            other => panic!("{other:?}"),
        }
        timed_out(&st.check_peer(p).unwrap_err());
        // The unmatched receive is not the peer's: it still waits.
        assert!(st.reqs.get(&rid).is_some_and(|r| r.result.is_none()));
        st.reqs.remove(&id);
        drop(st);
        assert!(w.cancel_recv(rid));
        w.st.borrow_mut().reqs.remove(&rid);
        assert_eq!(w.live_requests(), 0);
    }

    /// A peer that keeps calling progress answers the probes: a rendezvous send to a receive
    /// posted only after several timeouts is not failed (here the worker is its own peer).
    #[test]
    fn a_peer_that_answers_probes_is_not_failed() {
        let w = worker(&[("RUCX_PEER_TIMEOUT", "40ms"), ("RUCX_RNDV_THRESH", "1K")]);
        let ep = w.connect(&w.address()).unwrap();
        let msg = vec![7u8; 64 << 10];
        let mut got = vec![0u8; 64 << 10];
        let mut other = [0u8; 8];
        w.scope(|s| {
            let sd = s.tag_send(ep, &msg, 3);
            // Busy elsewhere for six timeouts, in a wait (which eases off and sleeps).
            let r = s.tag_recv(&mut other[..], 4, u64::MAX);
            assert!(matches!(
                r.wait_timeout(Duration::from_millis(250)),
                Err(Error::Timeout { .. })
            ));
            assert!(sd.test().is_none(), "the send waits for the receive");
            s.tag_recv(&mut got, 3, u64::MAX).wait().unwrap();
            sd.wait().unwrap();
        });
        assert!(got == msg);
        assert!(w.ep_error(ep).is_none());
        assert!(probes(&w.st.borrow()) >= 2, "{:?}", w.counters());
    }
}
