//! Credit-based flow control of `rc_verbs` active messages, as pure accounting.
//!
//! Each endpoint pre-posts `window` receive buffers for data plus a few for credit grants. A
//! sender holds one credit per data buffer the peer has posted for it and spends one per
//! message, so a message never arrives without a buffer (which RC would answer with
//! receiver-not-ready retries). The receiver re-posts a buffer after delivering its message and
//! owes the sender one credit; owed credits ride on every message it sends back (a 16-bit field
//! of the header), and when `threshold` are owed with no traffic to carry them, a *grant*
//! message returns them. Grants need no credit: they land in the extra buffers, and at most
//! `window / threshold` can be outstanding, because each returns at least `threshold` of the
//! `window` credits in circulation ([`grant_slots`]).

/// Receive buffers reserved for grants beyond the data window.
pub fn grant_slots(window: u32, threshold: u32) -> u32 {
    window.div_ceil(threshold.max(1)) + 1
}

/// Credits of one endpoint, towards one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credits {
    tx: u32,
    owed: u32,
    threshold: u32,
}

impl Credits {
    /// A connected endpoint: the peer posted `peer_window` data buffers for us; we posted
    /// `local_window` for it and return credits in batches of half of that.
    pub fn new(peer_window: u32, local_window: u32) -> Self {
        Credits {
            tx: peer_window,
            owed: 0,
            threshold: Self::threshold_for(local_window),
        }
    }

    /// The grant threshold for a local window.
    pub fn threshold_for(local_window: u32) -> u32 {
        (local_window / 2).max(1)
    }

    /// Messages we may still send.
    pub fn available(&self) -> u32 {
        self.tx
    }

    /// Credits we owe the peer.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// Whether a data message may go now.
    pub fn can_send(&self) -> bool {
        self.tx > 0
    }

    /// Spend a credit for a data message and take the owed credits to piggyback on it.
    /// Returns `None` when no credit is left.
    pub fn send(&mut self) -> Option<u16> {
        if self.tx == 0 {
            return None;
        }
        self.tx -= 1;
        Some(self.take_owed())
    }

    /// Undo [`send`](Self::send) when posting failed.
    pub fn unsend(&mut self, piggyback: u16) {
        self.tx += 1;
        self.owed += u32::from(piggyback);
    }

    fn take_owed(&mut self) -> u16 {
        let n = self.owed.min(u32::from(u16::MAX));
        self.owed -= n;
        n as u16
    }

    /// A data message arrived carrying `piggyback` returned credits; its buffer has been
    /// re-posted, so we owe one more.
    pub fn data_received(&mut self, piggyback: u16) {
        self.tx += u32::from(piggyback);
        self.owed += 1;
    }

    /// A data message arrived: take its returned credits now (before the buffer is re-posted).
    pub fn credits_received(&mut self, n: u16) {
        self.tx += u32::from(n);
    }

    /// The buffer of a delivered data message has been re-posted: we owe one more credit.
    pub fn buffer_reposted(&mut self) {
        self.owed += 1;
    }

    /// Whether a grant message should go.
    pub fn grant_due(&self) -> bool {
        self.owed >= self.threshold
    }

    /// Take the owed credits for a grant message.
    pub fn take_grant(&mut self) -> u16 {
        self.take_owed()
    }

    /// Undo [`take_grant`](Self::take_grant) when posting failed.
    pub fn ungrant(&mut self, n: u16) {
        self.owed += u32::from(n);
    }
}

/// Send-queue slots of one QP (every work request is signaled, so each completion frees one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendSlots {
    capacity: u32,
    used: u32,
}

impl SendSlots {
    /// A send queue of `capacity` entries.
    pub fn new(capacity: u32) -> Self {
        SendSlots { capacity, used: 0 }
    }

    /// Take a slot; `false` when full.
    pub fn take(&mut self) -> bool {
        if self.used < self.capacity {
            self.used += 1;
            true
        } else {
            false
        }
    }

    /// Give a slot back (a completion arrived, or posting failed).
    pub fn give(&mut self) {
        self.used = self.used.saturating_sub(1);
    }

    /// Slots in use.
    pub fn used(&self) -> u32 {
        self.used
    }

    /// Free slots.
    pub fn free(&self) -> u32 {
        self.capacity - self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[test]
    fn window_is_spent_and_returned() {
        let mut a = Credits::new(4, 4);
        let mut b = Credits::new(4, 4);
        for _ in 0..4 {
            assert_eq!(a.send(), Some(0));
        }
        assert!(!a.can_send());
        assert_eq!(a.send(), None);
        // b receives all four, owes four; threshold is 2.
        for _ in 0..4 {
            b.credits_received(0);
            b.buffer_reposted();
        }
        assert!(b.grant_due());
        let g = b.take_grant();
        assert_eq!(g, 4);
        a.credits_received(g);
        assert_eq!(a.available(), 4);
        // Piggybacking: b sends data, carrying what it owes.
        b.data_received(0);
        assert_eq!(b.send(), Some(1));
        assert_eq!(b.owed(), 0);
        // Undo restores both.
        b.unsend(1);
        assert_eq!((b.available(), b.owed()), (4, 1));
        assert_eq!(grant_slots(64, 32), 3);
        assert_eq!(grant_slots(3, 1), 4);
    }

    #[test]
    fn send_slots() {
        let mut s = SendSlots::new(2);
        assert!(s.take() && s.take());
        assert!(!s.take());
        s.give();
        assert_eq!((s.used(), s.free()), (1, 1));
        s.give();
        s.give();
        assert_eq!(s.used(), 0);
    }

    /// A message on the wire.
    #[derive(Clone, Copy, Debug)]
    enum Msg {
        Data(u16),
        Grant(u16),
    }

    /// One side of a simulated connection: its credits, the buffers it has posted, and the
    /// messages that arrived but are not processed yet.
    struct Side {
        credits: Credits,
        posted: u32,
        arrived: VecDeque<Msg>,
        delivered: u64,
    }

    impl Side {
        fn new(local_window: u32, peer_window: u32) -> Side {
            let t = Credits::threshold_for(local_window);
            Side {
                credits: Credits::new(peer_window, local_window),
                posted: local_window + grant_slots(local_window, t),
                arrived: VecDeque::new(),
                delivered: 0,
            }
        }
    }

    /// Deliver the next message in flight to `to`: it consumes a posted buffer (or the
    /// simulation fails, as RC would with receiver-not-ready).
    fn land(wire: &mut VecDeque<Msg>, to: &mut Side) -> Result<(), String> {
        if let Some(m) = wire.pop_front() {
            if to.posted == 0 {
                return Err("message arrived with no receive buffer posted".into());
            }
            to.posted -= 1;
            to.arrived.push_back(m);
        }
        Ok(())
    }

    /// Process one arrived message at `at` (deliver, re-post, account), then send a grant
    /// when due.
    fn process(at: &mut Side, back: &mut VecDeque<Msg>) {
        if let Some(m) = at.arrived.pop_front() {
            match m {
                Msg::Data(c) => {
                    at.credits.credits_received(c);
                    at.delivered += 1;
                    at.posted += 1;
                    at.credits.buffer_reposted();
                }
                Msg::Grant(c) => {
                    at.credits.credits_received(c);
                    at.posted += 1;
                }
            }
        }
        if at.credits.grant_due() {
            back.push_back(Msg::Grant(at.credits.take_grant()));
        }
    }

    proptest! {
        /// Any interleaving of sends, arrivals and processing on both sides: no message ever
        /// lacks a receive buffer, and once everything in flight is processed, both sides can
        /// send again (no deadlock).
        #[test]
        fn credits_never_overrun_and_never_deadlock(
            wa in 2u32..40, wb in 2u32..40,
            ops in proptest::collection::vec(0u8..6, 0..600),
        ) {
            let mut a = Side::new(wa, wb);
            let mut b = Side::new(wb, wa);
            let mut a2b = VecDeque::new();
            let mut b2a = VecDeque::new();
            let mut sent = (0u64, 0u64);
            for op in ops {
                match op {
                    0 => if let Some(p) = a.credits.send() { a2b.push_back(Msg::Data(p)); sent.0 += 1 },
                    1 => if let Some(p) = b.credits.send() { b2a.push_back(Msg::Data(p)); sent.1 += 1 },
                    2 => land(&mut a2b, &mut b).map_err(TestCaseError::fail)?,
                    3 => land(&mut b2a, &mut a).map_err(TestCaseError::fail)?,
                    4 => process(&mut b, &mut b2a),
                    _ => process(&mut a, &mut a2b),
                }
            }
            // Drain: land and process everything, grants included, until quiet.
            for _ in 0..10_000 {
                if a2b.is_empty() && b2a.is_empty() && a.arrived.is_empty() && b.arrived.is_empty() {
                    break;
                }
                land(&mut a2b, &mut b).map_err(TestCaseError::fail)?;
                land(&mut b2a, &mut a).map_err(TestCaseError::fail)?;
                process(&mut b, &mut b2a);
                process(&mut a, &mut a2b);
            }
            prop_assert!(a2b.is_empty() && b2a.is_empty());
            prop_assert_eq!(b.delivered, sent.0);
            prop_assert_eq!(a.delivered, sent.1);
            // Conservation: our credits plus what the peer owes us equals the peer's window.
            prop_assert_eq!(a.credits.available() + b.credits.owed(), wb);
            prop_assert_eq!(b.credits.available() + a.credits.owed(), wa);
            // Liveness: what is still owed is below the grant threshold, so credits remain.
            prop_assert!(a.credits.can_send() && b.credits.can_send());
        }
    }
}
