//! Which interfaces a progress call polls: the *hot* ones on every call, the *cold* ones on
//! every [`COLD_EVERY`]th call and before the worker arms or sleeps.
//!
//! A worker opens an interface for every transport resource it may use (with `RUCX_TLS` unset:
//! two tcp interfaces, `self` and posix on a host without a network card besides `lo`), while
//! its peers usually talk over one or two of them. Polling an interface nobody uses costs its
//! empty poll on every call (tcp 54 instructions, `self` 26: an empty progress call of a
//! shared-memory ping-pong was 328 instructions with every transport against 149 with posix
//! alone). UCX activates an interface when an endpoint uses it; here an interface becomes
//! hot, and stays hot for the worker's life, when
//!
//! - a lane is connected on it ([`State::connect_lane`](super::state::State): every endpoint
//!   this worker makes, including those made for a peer's wire-up and for the connection
//!   manager's and listener's connections, goes through it),
//! - it is the memory-type copy lane or a local copy engine (their copies run in this process
//!   for protocols in flight: staging, GPU RMA), from the start,
//! - or it reported any event in a pass over the cold ones (a peer that reached us over an
//!   interface we have no endpoint on yet: its wire-up comes in there).
//!
//! A cold interface is still polled on every [`COLD_EVERY`]th progress call, so a peer that
//! connects to this worker over an interface it has no endpoint on is heard at most that many
//! calls later, and then the interface is hot. Before the worker arms its interfaces or sleeps
//! ([`Worker::arm`](crate::Worker::arm), [`Worker::wait`](crate::Worker::wait), and so every
//! blocking wait that sleeps), the cold interfaces the last progress call skipped are polled
//! ([`Worker::poll_cold`]); events they bring make the arm busy and are counted
//! by the next progress call, which is a full pass. Nothing is dropped or reordered: an
//! interface's events are handled in the order it reports them, only later; interfaces are
//! independent (a peer's messages on one lane never wait for another lane's).

/// Progress calls between passes over the cold interfaces. A pass over the cold interfaces
/// of the default set (two tcp, `self`) costs about 135 instructions, so at 32 it adds about
/// 4 instructions per call (3% of the 149 of an empty call over posix alone), while the first
/// message of a peer that reached this worker over an interface without an endpoint here waits
/// at most 31 calls of a polling loop (a few microseconds). A larger count saves less than an
/// instruction per call more; a smaller one costs more on every call. tcp's own look at its
/// listener while it has no connection counts its own calls on top of this (its count adapts
/// to the time between its calls, see `rucx_uct_tcp`'s `IDLE_POLL_GAP`).
pub(crate) const COLD_EVERY: u32 = 32;

use rucx_uct::Iface;

use super::Worker;
use super::state::State;

/// Interfaces by index: one bit each. A worker with more than [`Active::BITS`] interfaces
/// polls all of them on every call (every pass is a full one).
#[derive(Debug)]
pub(crate) struct Active {
    /// The interfaces polled on every call.
    hot: u64,
    /// Every interface.
    all: u64,
    /// The interfaces the last pass (or [`Worker::poll_cold`]) polled.
    last: u64,
    /// Progress calls left until the next pass over all interfaces, and the count between
    /// such passes ([`COLD_EVERY`]; 1 with more interfaces than bits: every pass is full).
    left: u32,
    every: u32,
    /// Events the cold interfaces reported outside a progress call (before arming): the next
    /// progress call counts them (it is a full pass).
    carried: usize,
}

impl Active {
    /// Interfaces beyond this many make every pass a full one.
    pub(crate) const BITS: usize = u64::BITS as usize;

    /// `n` interfaces, all cold.
    pub(crate) fn new(n: usize) -> Active {
        let all = if n >= Self::BITS {
            u64::MAX
        } else {
            (1u64 << n) - 1
        };
        let every = if n > Self::BITS { 1 } else { COLD_EVERY };
        Active {
            hot: 0,
            all,
            last: 0,
            left: every,
            every,
            carried: 0,
        }
    }

    /// Interface `i` is used: poll it on every call from now on.
    pub(crate) fn mark(&mut self, i: usize) {
        self.hot |= 1u64 << (i % Self::BITS);
    }

    /// Whether interface `i` is hot.
    #[cfg(test)]
    pub(crate) fn is_hot(&self, i: usize) -> bool {
        self.hot & (1u64 << (i % Self::BITS)) != 0
    }

    /// The hot interfaces' bits.
    #[inline(always)]
    pub(crate) fn hot(&self) -> u64 {
        self.hot
    }

    /// A progress call begins: whether it polls every interface (true: every
    /// [`COLD_EVERY`]th call, out of line) or only the hot ones. With every interface hot the
    /// hot pass is the full one; the count runs on regardless (one branch fewer per call).
    #[inline(always)]
    pub(crate) fn begin(&mut self) -> bool {
        self.left -= 1;
        if self.left == 0 {
            self.left = self.every;
            self.last = self.all;
            return true;
        }
        self.last = self.hot;
        false
    }

    /// The interfaces the last pass did not poll (cold ones, and any that became hot since).
    pub(crate) fn unpolled(&self) -> u64 {
        self.all & !self.last
    }

    /// The interfaces the last pass did not poll were polled outside a progress call,
    /// reporting `events`: the next call counts those and is a full pass.
    pub(crate) fn polled_rest(&mut self, events: usize) {
        self.last = self.all;
        if events > 0 {
            self.carried += events;
            self.left = 1;
        }
    }

    /// Events carried from a poll outside progress (taken by a full pass).
    pub(crate) fn take_carried(&mut self) -> usize {
        std::mem::take(&mut self.carried)
    }
}

impl State {
    /// A progress pass over every interface, in index order; those that report events become
    /// hot. Counts the events carried from a poll before arming.
    #[inline(never)]
    pub(crate) fn progress_all(&mut self, ifaces: &mut [Box<dyn Iface>]) -> usize {
        let mut n = self.active.take_carried();
        for (i, iface) in ifaces.iter_mut().enumerate() {
            let k = iface.progress(&mut |ev| self.on_event(i, ev));
            if k > 0 {
                self.active.mark(i);
            }
            n += k;
        }
        n
    }
}

impl Worker {
    /// Poll the interfaces the last progress call skipped (the cold ones): before arming or
    /// sleeping, so that nothing waiting there is slept over. The events found (those make
    /// the arm busy) are counted by the next progress call, a full pass; 0 when the last pass
    /// was full.
    #[cold]
    #[inline(never)]
    pub(crate) fn poll_cold(&self) -> usize {
        let mut ifaces = self.ifaces.borrow_mut();
        let mut st = self.st.borrow_mut();
        let mut rest = st.active.unpolled();
        let mut n = 0;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let st = &mut *st;
            let k = ifaces[i].progress(&mut |ev| st.on_event(i, ev));
            if k > 0 {
                st.active.mark(i);
            }
            n += k;
        }
        st.active.polled_rest(n);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With nothing hot, one call in [`COLD_EVERY`] is a full pass, the others poll nothing.
    #[test]
    fn cold_interfaces_get_every_nth_call() {
        let mut a = Active::new(4);
        let fulls: Vec<u32> = (1..=3 * COLD_EVERY).filter(|_| a.begin()).collect();
        assert_eq!(fulls, [COLD_EVERY, 2 * COLD_EVERY, 3 * COLD_EVERY]);
        assert_eq!(a.hot(), 0);
        assert_eq!(a.unpolled(), 0, "the last call was the full pass");
        assert!(!a.begin());
        assert_eq!(a.unpolled(), 0b1111);
    }

    #[test]
    fn marked_interfaces_are_hot_and_all_hot_means_every_pass_is_full() {
        let mut a = Active::new(3);
        a.mark(1);
        assert!(a.is_hot(1) && !a.is_hot(0) && !a.is_hot(2));
        assert_eq!(a.hot(), 0b010);
        assert!(!a.begin());
        assert_eq!(a.unpolled(), 0b101);
        a.mark(0);
        a.mark(2);
        assert!(!a.begin());
        assert_eq!(a.unpolled(), 0, "all hot: the hot pass polls everything");
    }

    /// An interface that became hot after the last pass was not polled by it.
    #[test]
    fn one_made_hot_after_a_pass_counts_as_unpolled() {
        let mut a = Active::new(2);
        assert!(!a.begin());
        a.polled_rest(0);
        assert_eq!(a.unpolled(), 0);
        assert!(!a.begin());
        a.mark(0);
        assert_eq!(a.unpolled(), 0b11, "neither was polled by the last pass");
        assert!(!a.begin());
        assert_eq!(a.unpolled(), 0b10);
    }

    /// Events found before arming make the next call a full pass that counts them.
    #[test]
    fn events_of_a_poll_before_arming_are_carried_to_the_next_full_pass() {
        let mut a = Active::new(2);
        assert!(!a.begin());
        a.polled_rest(3);
        assert_eq!(a.unpolled(), 0);
        assert!(a.begin(), "the next call polls everything");
        assert_eq!(a.take_carried(), 3);
        assert_eq!(a.take_carried(), 0);
        a.polled_rest(0);
        assert!(!a.begin(), "nothing found: the count goes on");
    }

    #[test]
    fn more_interfaces_than_bits_are_all_hot() {
        let mut a = Active::new(Active::BITS + 1);
        assert!((0..5).all(|_| a.begin()), "every pass is full");
        assert_eq!(a.unpolled(), 0);
        let mut b = Active::new(Active::BITS);
        assert!(!b.begin(), "exactly 64 still have a mask");
        assert_eq!(b.unpolled(), u64::MAX);
        (0..Active::BITS).for_each(|i| b.mark(i));
        assert!(!b.begin());
        assert_eq!(b.unpolled(), 0, "the hot pass polled them all");
    }
}

/// The worker's use of the mask: a peer heard only over an interface this worker has no
/// endpoint on, polling and sleeping.
#[cfg(test)]
mod worker_tests {
    use std::time::{Duration, Instant};

    use super::COLD_EVERY;
    use crate::{Context, Worker};

    fn ctx(vars: &[(&str, &str)]) -> Context {
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let cfg = rucx_ucs::Config::from_vars(&tables, vars.iter().copied()).unwrap();
        Context::new(&rucx_transports::registry(), cfg).unwrap()
    }

    fn hot(w: &Worker) -> Vec<bool> {
        let st = w.st.borrow();
        (0..st.slots.len()).map(|i| st.active.is_hot(i)).collect()
    }

    /// Only `a` connects: `b` has no endpoint, so its posix interface is cold, and the message
    /// (with `a`'s wire-up ahead of it, both in `b`'s ring already) is taken in by the pass
    /// over the cold interfaces, the `COLD_EVERY`th call; from then on the interface is hot.
    #[test]
    fn a_peer_over_a_cold_interface_is_heard_within_the_count() {
        let c = ctx(&[("RUCX_TLS", "posix")]);
        let (a, b) = (Worker::new(&c).unwrap(), Worker::new(&c).unwrap());
        assert_eq!(hot(&b), [false]);
        let ab = a.connect(&b.address()).unwrap();
        assert_eq!(hot(&a), [true], "a lane is connected on it");
        let msg = *b"cold ring";
        a.scope(|s| s.tag_send(ab, &msg[..], 7).wait()).unwrap();
        let mut got = [0u8; 9];
        let calls = b.scope(|s| {
            let r = s.tag_recv(&mut got[..], 7, u64::MAX);
            let mut calls = 0;
            while r.test().is_none() {
                assert!(calls < 2 * COLD_EVERY, "not heard within {calls} calls");
                b.progress();
                calls += 1;
            }
            r.wait().unwrap();
            calls
        });
        assert_eq!(got, msg);
        assert!(
            calls >= COLD_EVERY,
            "heard after {calls} calls: the interface was polled"
        );
        assert_eq!(
            hot(&b),
            [true],
            "hot once it reported events (and b's reply lane)"
        );
        // The reply goes back on the endpoint the wire-up made, every call polling it.
        let ba = b.connect(&a.address()).unwrap();
        b.scope(|s| s.tag_send(ba, &msg[..], 8).wait()).unwrap();
        let mut back = [0u8; 9];
        a.scope(|s| {
            let r = s.tag_recv(&mut back[..], 8, u64::MAX);
            while r.test().is_none() {
                a.progress();
            }
            r.wait().unwrap();
        });
        assert_eq!(back, msg);
    }

    /// Arming looks at the interfaces the last progress call skipped: a message waiting on a
    /// cold interface makes the arm busy and is taken in by it, and the next progress call
    /// reports it (a full pass).
    #[test]
    fn arming_polls_the_cold_interfaces_first() {
        let c = ctx(&[("RUCX_TLS", "posix")]);
        let (a, b) = (Worker::new(&c).unwrap(), Worker::new(&c).unwrap());
        let ab = a.connect(&b.address()).unwrap();
        a.scope(|s| s.tag_send(ab, &[5u8; 8][..], 1).wait())
            .unwrap();
        let mut got = [0u8; 8];
        b.scope(|s| {
            let r = s.tag_recv(&mut got[..], 1, u64::MAX);
            assert_eq!(
                b.progress(),
                0,
                "the cold interface is not polled on this call"
            );
            assert!(r.test().is_none());
            assert!(matches!(b.arm(), Err(rucx_ucs::Error::Busy(_))));
            assert!(b.progress() > 0, "the events the arm found are reported");
            while r.test().is_none() {
                b.progress();
            }
            r.wait().unwrap();
        });
        assert_eq!(got, [5u8; 8]);
        assert_eq!(hot(&b), [true]);
        // Nothing waits anywhere now: after a progress call that skipped nothing new, arming
        // succeeds.
        while b.progress() > 0 {}
        b.arm().unwrap();
    }

    /// A worker that sleeps in a blocking wait (its interfaces all cold: no endpoint) wakes for
    /// a peer that connects meanwhile from another thread and receives its message.
    #[test]
    fn a_sleeping_worker_hears_a_peer_it_has_no_endpoint_to() {
        let c = ctx(&[("RUCX_TLS", "posix")]);
        let b = Worker::new(&c).unwrap();
        let addr = b.address();
        let c2 = c.clone();
        let sender = std::thread::spawn(move || {
            let a = Worker::new(&c2).unwrap();
            // Long enough for `b` to give up polling and sleep on its events.
            std::thread::sleep(Duration::from_millis(300));
            let ab = a.connect(&addr).unwrap();
            a.scope(|s| s.tag_send(ab, &[9u8; 16][..], 3).wait())
                .unwrap();
            a
        });
        let mut got = [0u8; 16];
        let done = b.scope(|s| {
            let r = s.tag_recv(&mut got[..], 3, u64::MAX);
            let ok = b.progress_until(Some(Instant::now() + Duration::from_secs(30)), || {
                r.test().is_some()
            });
            if ok {
                r.wait().unwrap();
            }
            ok
        });
        let a = sender.join().unwrap();
        assert!(done, "the message never arrived");
        assert_eq!(got, [9u8; 16]);
        drop(a);
    }

    /// Over tcp (loopback), where the peer's connection must first be accepted by the
    /// interface that has no endpoint: messages both ways arrive, each side's interface
    /// ends hot.
    #[test]
    fn tcp_connection_from_a_peer_without_an_endpoint_here_is_accepted() {
        let c = ctx(&[("RUCX_TLS", "tcp"), ("RUCX_TCP_IFACES", "lo")]);
        let (a, b) = (Worker::new(&c).unwrap(), Worker::new(&c).unwrap());
        assert!(hot(&b).iter().all(|h| !h));
        let ab = a.connect(&b.address()).unwrap();
        let mut got = vec![0u8; 300];
        let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        a.scope(|sa| {
            let sr = sa.tag_send(ab, &data[..], 11);
            b.scope(|sb| {
                let r = sb.tag_recv(&mut got[..], 11, u64::MAX);
                let t = Instant::now();
                while r.test().is_none() || sr.test().is_none() {
                    assert!(t.elapsed() < Duration::from_secs(30), "tcp message hangs");
                    a.progress();
                    b.progress();
                }
                r.wait().unwrap();
            });
            sr.wait().unwrap();
        });
        assert_eq!(got, data);
        assert!(hot(&b).iter().any(|h| *h), "{:?}", hot(&b));
    }
}
