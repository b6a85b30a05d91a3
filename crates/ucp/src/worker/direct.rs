//! Direct receives: a queued receive ([`Worker::tag_recv_queued`]) into host memory, posted
//! while no message waits, is only an entry of the expected queue (its buffer, capacity, tag
//! and token), with no request in the table. A whole eager message that matches it is copied
//! from the transport's buffer into its memory, and its end goes to the completion queue in
//! the same step. Any other match (a message in fragments, a rendezvous, or an end that must
//! wait behind earlier ones for the reap, to keep ends in the order they happened) first makes
//! it the ordinary queued request it stands for ([`State::waiter_req`]), which the protocols
//! then run as before. Cancel finds it in the expected queue; the worker's drop ends those
//! still waiting there (nothing touched their memory).

use crate::worker::owned::{Queued, QueuedReq};
use crate::worker::prelude::*;

/// A posted receive in the expected queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waiter {
    /// A request of the table.
    Req(u64),
    /// A direct receive, with no request yet.
    Direct(DirectRecv),
}

/// What a direct receive needs to deliver a message, or to become a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirectRecv {
    /// Host memory of `cap` bytes (the queued request's, under `RawBuf::new`'s contract).
    pub(crate) addr: usize,
    pub(crate) cap: usize,
    /// The tag it was posted with.
    pub(crate) tag: Tag,
    /// The caller's token, its end is queued with.
    pub(crate) token: u64,
    /// Names it for cancel ([`QueuedReq`]), unique in its worker.
    pub(crate) key: u64,
}

impl Worker {
    /// Post queued receive `buf` as a direct receive when it can be one: host memory, and no
    /// message waiting (so it matches nothing now and goes to the end of the expected queue).
    /// `None`: post it as a request (with the memory type found here, if it was looked up).
    #[inline]
    pub(super) fn recv_direct(
        &self,
        buf: &mut RecvBuf<'_>,
        tag: Tag,
        mask: Tag,
        token: u64,
    ) -> Option<Queued> {
        let mut st = self.st.borrow_mut();
        if st.matcher.unexpected_len() != 0 {
            return None;
        }
        let mem = match buf.mem {
            Some(m) => m,
            // Classified once: the request it may become keeps the answer.
            None => {
                let m = st.ctx.detect(buf.addr, buf.len).ok()?;
                buf.mem = Some(m);
                m
            }
        };
        if mem != (MemoryType::Host, None) {
            return None;
        }
        let key = st.next_direct;
        st.next_direct += 1;
        let d = DirectRecv {
            addr: buf.addr,
            cap: buf.len,
            tag,
            token,
            key,
        };
        // Nothing waits (checked above): queued, never matched here.
        st.matcher.push_expected(tag, mask, Waiter::Direct(d));
        Some(Queued::Pending(QueuedReq::direct(key, st.address.uuid)))
    }

    /// Cancel the queued receive posted with `token` if it has not matched a message yet,
    /// as [`cancel_queued`](Self::cancel_queued) does, for a caller that kept the token rather
    /// than the [`QueuedReq`] (tokens unique among its outstanding requests; a search of the
    /// outstanding ones, not a look-up). False for a send, or one that ended or matched.
    pub fn cancel_queued_token(&self, token: u64) -> bool {
        if self.cancel_direct_by(|d| d.token == token) {
            return true;
        }
        let id = self.st.borrow().owned.find_queued(token);
        id.is_some_and(|id| self.owned_cancel(id))
    }

    /// Cancel direct receive `key` if it is still waiting for a message: its end (canceled)
    /// is queued after every end noted before.
    pub(super) fn cancel_direct(&self, key: u64) -> bool {
        self.cancel_direct_by(|d| d.key == key)
    }

    fn cancel_direct_by(&self, which: impl Fn(&DirectRecv) -> bool) -> bool {
        let found = self
            .st
            .borrow_mut()
            .matcher
            .cancel_expected(|e| matches!(e, Waiter::Direct(d) if which(d)));
        let Some(Waiter::Direct(d)) = found else {
            return false;
        };
        self.reap_owned();
        self.st
            .borrow_mut()
            .owned
            .push_completed(d.token, Err(Error::Canceled));
        true
    }
}

impl State {
    /// The request of a posted receive that matched a message: its own, or the queued request
    /// a direct receive stands for, made now (registered for the completion queue with its
    /// token).
    #[inline]
    pub(crate) fn waiter_req(&mut self, w: Waiter) -> u64 {
        match w {
            Waiter::Req(id) => id,
            Waiter::Direct(d) => self.promote_direct(d),
        }
    }

    #[cold]
    #[inline(never)]
    fn promote_direct(&mut self, d: DirectRecv) -> u64 {
        let id = self.new_req(ReqKind::Recv(RecvState::tag(
            d.addr,
            d.cap,
            d.tag,
            MemoryType::Host,
            None,
        )));
        self.owned.insert_queued(id, d.token);
        id
    }

    /// A whole message (`data`, from peer `src` with `tag`) matched posted receive `w`:
    /// delivered into its memory; a direct receive ends here when no earlier end waits for
    /// the reap.
    #[inline]
    pub(crate) fn deliver_to(&mut self, w: Waiter, src: usize, tag: Tag, data: &[u8]) {
        match w {
            Waiter::Direct(d) if self.owned.ends_in_order() => {
                let n = data.len().min(d.cap);
                // SAFETY: the direct receive's memory is host memory of `cap` bytes, lent to
                // it until its end is queued (`RawBuf::new`'s contract); `n <= cap`.
                let dst = unsafe { host_slice_mut(d.addr, n) };
                copy_small(dst, &data[..n]);
                let res = if data.len() > d.cap {
                    Err(Error::Truncated {
                        incoming: data.len(),
                        capacity: d.cap,
                        tag: Some(tag),
                    })
                } else {
                    Ok(Completion {
                        len: data.len(),
                        tag,
                        sender: Some(EpId::new(src, self.ep_base)),
                    })
                };
                self.owned.push_completed(d.token, res);
            }
            w => {
                let rid = self.waiter_req(w);
                self.deliver_whole(rid, src, tag, data);
            }
        }
    }

    /// The worker's drop: direct receives still waiting end canceled (nothing touched their
    /// memory, and nothing will).
    pub(super) fn cancel_all_direct(&mut self) {
        while let Some(Waiter::Direct(d)) = self
            .matcher
            .cancel_expected(|e| matches!(e, Waiter::Direct(_)))
        {
            self.owned.push_completed(d.token, Err(Error::Canceled));
        }
    }
}

/// `dst.copy_from_slice(src)` (same lengths), without a call to `memcpy` for up to 16 bytes
/// (the small messages of the direct path): two loads and two stores that may overlap.
#[inline(always)]
fn copy_small(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    assert_eq!(dst.len(), n, "copy_small: lengths differ");
    if n > 16 {
        dst.copy_from_slice(src);
    } else if n >= 8 {
        let (a, b) = (word::<8>(src, 0), word::<8>(src, n - 8));
        dst[..8].copy_from_slice(&a);
        dst[n - 8..].copy_from_slice(&b);
    } else if n >= 4 {
        let (a, b) = (word::<4>(src, 0), word::<4>(src, n - 4));
        dst[..4].copy_from_slice(&a);
        dst[n - 4..].copy_from_slice(&b);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s;
        }
    }
}

/// The `N` bytes of `s` at `at`.
#[inline(always)]
fn word<const N: usize>(s: &[u8], at: usize) -> [u8; N] {
    let mut w = [0u8; N];
    w.copy_from_slice(&s[at..at + N]);
    w
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    use proptest::prelude::*;

    use rucx_ucs::{MemInfo, RawBuf};

    use super::*;
    use crate::TAG_MASK_FULL;
    use crate::worker::tests::self_worker;

    /// Message sizes: eager short, copied in, in fragments, rendezvous.
    const SIZES: [usize; 6] = [0, 8, 200, 3000, 20_000, 150_000];

    #[derive(Clone, Debug)]
    enum Op {
        /// A receive of `tag` (any tag when `wild`), whose buffer holds `cap` thousandths of
        /// the largest message; `known`: posted with its memory type given (host) or left to
        /// be classified.
        Recv {
            tag: u8,
            wild: bool,
            cap: u16,
            known: bool,
        },
        Send {
            tag: u8,
            size: usize,
        },
        /// Cancel the `k`-th receive posted (modulo their number), by its handle or its token.
        Cancel(usize, bool),
        Progress(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..3, prop::bool::weighted(0.15), 0u16..1200, any::<bool>())
                .prop_map(|(tag, wild, cap, known)| Op::Recv { tag, wild, cap, known }),
            4 => (0u8..3, 0..SIZES.len()).prop_map(|(tag, s)| Op::Send { tag, size: SIZES[s] }),
            1 => (any::<usize>(), any::<bool>()).prop_map(|(k, t)| Op::Cancel(k, t)),
            2 => (1u8..6).prop_map(Op::Progress),
        ]
    }

    /// The bytes of message `m` of `len` bytes (its number first, so no two messages agree).
    fn pattern(m: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| match i {
                0..8 => (m as u64).to_le_bytes()[i],
                _ => (i * 31 + m * 7) as u8,
            })
            .collect()
    }

    struct Posted {
        tag: u8,
        wild: bool,
        buf: Vec<u8>,
        h: QueuedReq,
        /// Canceled by a `Cancel` step (not by the final sweep).
        canceled_early: bool,
    }

    const GUARD: usize = 8;
    const FILL: u8 = 0xEE;

    fn raw_of(v: &mut [u8], known: bool) -> RawBuf {
        let info = known.then_some(MemInfo::HOST);
        // SAFETY: the test keeps each buffer allocated and untouched (it reads it only after
        // the request's end was taken) until every request ended.
        unsafe { RawBuf::new(v.as_mut_ptr() as usize + GUARD, v.len() - 2 * GUARD, info) }
    }

    /// Run `ops` on one worker that sends to itself, then end everything: receives still
    /// waiting are canceled, messages nobody took are drained by receives of any tag. Checks
    /// what direct receives must not break: every request ends once; a receive holds exactly
    /// the message it reports (or its first `cap` bytes, truncated), nothing past it; each
    /// message is received once; the receives of one exact tag take that tag's messages in
    /// the order they were sent, and none is left waiting while a later one of its tag took
    /// a message; a canceled receive's memory is untouched.
    fn run(ops: &[Op]) -> std::result::Result<(), TestCaseError> {
        let w = self_worker();
        let ep = w.connect(&w.address()).unwrap();
        let largest = *SIZES.iter().max().unwrap();
        let mut recvs: Vec<Posted> = Vec::new();
        let mut sends: Vec<(u8, Vec<u8>)> = Vec::new();
        let mut ends: HashMap<u64, Result<Completion>> = HashMap::new();
        let take = |w: &Worker, ends: &mut HashMap<u64, Result<Completion>>| {
            let mut got = Vec::new();
            w.take_completed(&mut got);
            for (t, r) in got {
                assert!(ends.insert(t, r).is_none(), "token {t} ended twice");
            }
        };
        // Receive tokens are their index, send tokens 1 << 32 and up.
        const SEND: u64 = 1 << 32;
        for o in ops {
            match *o {
                Op::Recv {
                    tag,
                    wild,
                    cap,
                    known,
                } => {
                    let n = largest * cap as usize / 1000;
                    let mut buf = vec![FILL; n + 2 * GUARD];
                    let mask = if wild { 0 } else { TAG_MASK_FULL };
                    let token = recvs.len() as u64;
                    let h =
                        match w.tag_recv_queued(raw_of(&mut buf, known), tag.into(), mask, token) {
                            Queued::Pending(h) => Some(h),
                            Queued::Ended(r) => {
                                ends.insert(token, r);
                                None
                            }
                        };
                    recvs.push(Posted {
                        tag,
                        wild,
                        buf,
                        h: h.unwrap_or(QueuedReq::direct(u64::MAX, 0)),
                        canceled_early: false,
                    });
                }
                Op::Send { tag, size } => {
                    let m = sends.len();
                    let mut data = pattern(m, size);
                    data.splice(0..0, [0u8; GUARD]);
                    data.extend_from_slice(&[0u8; GUARD]);
                    sends.push((tag, data));
                    let b = raw_of(&mut sends[m].1, true);
                    if let Queued::Ended(r) =
                        w.tag_send_queued(ep, b, tag.into(), false, SEND + m as u64)
                    {
                        ends.insert(SEND + m as u64, r);
                    }
                }
                Op::Cancel(k, by_token) if !recvs.is_empty() => {
                    let k = k % recvs.len();
                    let cancel = |w: &Worker| match by_token {
                        true => w.cancel_queued_token(k as u64),
                        false => w.cancel_queued(recvs[k].h),
                    };
                    if cancel(&w) {
                        prop_assert!(!cancel(&w), "canceled twice");
                        recvs[k].canceled_early = true;
                    }
                }
                Op::Cancel(..) => {}
                Op::Progress(n) => {
                    for _ in 0..n {
                        w.progress();
                    }
                }
            }
            take(&w, &mut ends);
        }
        // Drain: a receive of any tag per message, each big enough.
        for _ in 0..sends.len() {
            let mut buf = vec![FILL; largest + 2 * GUARD];
            let token = recvs.len() as u64;
            let h = match w.tag_recv_queued(raw_of(&mut buf, true), 0, 0, token) {
                Queued::Pending(h) => h,
                Queued::Ended(r) => {
                    ends.insert(token, r);
                    QueuedReq::direct(u64::MAX, 0)
                }
            };
            recvs.push(Posted {
                tag: 0,
                wild: true,
                buf,
                h,
                canceled_early: false,
            });
        }
        let t = Instant::now();
        while (0..sends.len()).any(|m| !ends.contains_key(&(SEND + m as u64))) {
            prop_assert!(t.elapsed() < Duration::from_secs(20), "sends hang");
            w.progress();
            take(&w, &mut ends);
        }
        for _ in 0..100 {
            w.progress();
        }
        take(&w, &mut ends);
        for r in &recvs {
            w.cancel_queued(r.h);
        }
        take(&w, &mut ends);
        prop_assert_eq!(ends.len(), recvs.len() + sends.len(), "every request ended");
        for m in 0..sends.len() {
            prop_assert!(ends[&(SEND + m as u64)].is_ok(), "send {}", m);
        }
        // What each receive got: the message's number, read from its first bytes.
        let mut got: Vec<Option<usize>> = vec![None; recvs.len()];
        let mut taken = vec![false; sends.len()];
        for (k, r) in recvs.iter().enumerate() {
            let cap = r.buf.len() - 2 * GUARD;
            prop_assert!(
                r.buf[..GUARD]
                    .iter()
                    .chain(&r.buf[cap + GUARD..])
                    .all(|&b| b == FILL)
            );
            let body = &r.buf[GUARD..GUARD + cap];
            let (len, tag) = match &ends[&(k as u64)] {
                Err(Error::Canceled) => {
                    prop_assert!(body.iter().all(|&b| b == FILL), "canceled {} written", k);
                    continue;
                }
                Ok(c) => (c.len, c.tag),
                Err(Error::Truncated {
                    incoming,
                    capacity,
                    tag,
                }) => {
                    prop_assert_eq!(*capacity, cap);
                    let Some(tag) = *tag else {
                        return Err(TestCaseError::fail(format!("receive {k}: cut, no tag")));
                    };
                    (*incoming, tag)
                }
                Err(e) => return Err(TestCaseError::fail(format!("receive {k}: {e}"))),
            };
            // Find the message: by number when 8 bytes or more landed, else by length and
            // tag among those not taken (short ones carry no number that fits).
            let m = if len.min(cap) >= 8 {
                u64::from_le_bytes(body[..8].try_into().unwrap()) as usize
            } else {
                match (0..sends.len()).find(|&m| {
                    !taken[m]
                        && sends[m].1.len() - 2 * GUARD == len
                        && u64::from(sends[m].0) == tag
                        && (r.wild || sends[m].0 == r.tag)
                        && sends[m].1[GUARD..GUARD + len.min(cap)] == body[..len.min(cap)]
                }) {
                    Some(m) => m,
                    None => return Err(TestCaseError::fail(format!("receive {k}: no message"))),
                }
            };
            prop_assert!(
                m < sends.len() && !taken[m],
                "receive {} got message {} again",
                k,
                m
            );
            taken[m] = true;
            let msg = &sends[m].1[GUARD..sends[m].1.len() - GUARD];
            prop_assert_eq!(len, msg.len());
            prop_assert_eq!(tag, u64::from(sends[m].0), "sender tag of {}", k);
            prop_assert!(r.wild || sends[m].0 == r.tag, "tag of {}", k);
            let n = len.min(cap);
            prop_assert_eq!(&body[..n], &msg[..n], "bytes of receive {}", k);
            prop_assert!(
                body[n..].iter().all(|&b| b == FILL),
                "past the message {}",
                k
            );
            got[k] = Some(m);
        }
        prop_assert!(taken.iter().all(|&t| t), "every message received");
        // One exact tag's receives take its messages in order; none waits while a later one
        // takes a message.
        for k2 in 0..recvs.len() {
            let (r2, Some(m2)) = (&recvs[k2], got[k2]) else {
                continue;
            };
            if r2.wild {
                continue;
            }
            for k1 in 0..k2 {
                let r1 = &recvs[k1];
                if r1.wild || r1.tag != r2.tag {
                    continue;
                }
                match got[k1] {
                    Some(m1) => prop_assert!(m1 < m2, "receives {} {} out of order", k1, k2),
                    None => prop_assert!(r1.canceled_early, "{} waited while {} matched", k1, k2),
                }
            }
        }
        prop_assert_eq!(w.live_requests(), 0);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn queued_receives_match_in_order_with_or_without_requests(
            ops in proptest::collection::vec(op(), 1..60)
        ) {
            run(&ops)?;
        }
    }

    #[test]
    fn small_copies_write_exactly_the_source_bytes() {
        for n in 0..=40usize {
            let src: Vec<u8> = (0..n)
                .map(|i| (i as u8).wrapping_mul(37).wrapping_add(1))
                .collect();
            // Guard bytes around the destination: none may change.
            let mut buf = vec![0xEEu8; n + 16];
            copy_small(&mut buf[8..8 + n], &src);
            assert_eq!(&buf[8..8 + n], &src[..], "{n} bytes");
            assert!(
                buf[..8].iter().chain(&buf[8 + n..]).all(|&b| b == 0xEE),
                "{n} bytes"
            );
        }
    }
}
