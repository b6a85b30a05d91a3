//! Split rendezvous: the receiver reads the head while the sender writes (or, when it cannot,
//! streams) the tail; each side finishes after both halves (the sender's count of halves is
//! [`RndvSend::split_step`]).

use std::ops::Range;

use crate::worker::prelude::*;

/// Streamed bytes of a split's tail, as the receive takes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TailPart {
    /// The part of them to copy into the receive buffer, as offsets of the message (within
    /// the tail and the buffer; empty when none of them is).
    pub(crate) range: Range<usize>,
    /// The whole tail is here now (it counts as the sender's finish).
    pub(crate) whole: bool,
}

impl RndvRecv {
    /// `len` streamed bytes at `offset` of the message came for this receive (capacity
    /// `cap`): when it is a split whose sender streams the tail (it could not write it), the
    /// part of them that is the tail's and fits the buffer, counted apart from the reads of the
    /// head. `None`: not a split tail (ordinary streaming).
    pub(crate) fn tail_part(&mut self, offset: usize, len: usize, cap: usize) -> Option<TailPart> {
        if self.get_end >= self.want || !self.fin_pending {
            return None;
        }
        // Only the tail `get_end..want` is the sender's to stream; never past the buffer.
        let (lo, hi) = (self.get_end, self.want.min(cap));
        let from = offset.max(lo);
        let to = offset.saturating_add(len).min(hi);
        let range = if from < to { from..to } else { from..from };
        self.tail_got += range.len();
        Some(TailPart {
            range,
            whole: self.tail_got >= hi.saturating_sub(lo),
        })
    }

    /// The sender's part of this receive landed (its finish message, or the whole streamed
    /// tail of a split): complete, unless the reads of a split's head are still running (their
    /// end completes it).
    pub(crate) fn tail_landed(&mut self) -> RecvNext {
        if self.fin_pending {
            self.fin_pending = false;
            if !self.gets_done {
                return RecvNext::Wait;
            }
        }
        RecvNext::Complete
    }
}

impl State {
    /// Streamed bytes of the tail of a split receive (the sender could not write it): copied in
    /// place (see [`RndvRecv::tail_part`]); once the whole tail came it counts as the sender's
    /// finish. False when `rreq` is not a split receive (ordinary streaming).
    pub(crate) fn split_tail_data(&mut self, rreq: u64, offset: usize, data: &[u8]) -> bool {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&rreq)
        else {
            return false;
        };
        let RecvProto::Rndv(rv) = &mut rs.proto else {
            return false;
        };
        if rs.mem.is_gpu() {
            return false;
        }
        let Some(t) = rv.tail_part(offset, data.len(), rs.cap) else {
            return false;
        };
        if !t.range.is_empty() {
            let (from, to) = (t.range.start, t.range.end);
            // SAFETY: the receive buffer was lent mutably to the scope, which keeps it alive and
            // unaliased until the request is finished; `get_end <= from < to <= cap`
            // (`tail_part`), and the reads of the head write only below `get_end`.
            let dst = unsafe { host_slice_mut(rs.addr + from, to - from) };
            dst.copy_from_slice(&data[from - offset..to - offset]);
        }
        if t.whole {
            self.tail_landed(rreq);
        }
        true
    }

    /// The sender's part of rendezvous receive `rreq` has landed (see
    /// [`RndvRecv::tail_landed`]).
    pub(crate) fn tail_landed(&mut self, rreq: u64) {
        let rndv = matches!(
            self.reqs.get(&rreq),
            Some(Req {
                kind: ReqKind::Recv(RecvState {
                    proto: RecvProto::Rndv(_),
                    ..
                }),
                ..
            })
        );
        if rndv {
            self.rndv_recv_step(rreq, |rv, _| rv.tail_landed());
            return;
        }
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rreq)
        {
            rs.received = rs.total.min(rs.cap);
        }
        self.complete_recv(rreq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::fake_io::FakeIo;

    /// A split of 1000 bytes: reads `0..512`, the sender streams `512..1000`.
    fn split() -> RndvRecv {
        let mut rv = RndvRecv::new(3, 0x51, 1000);
        rv.via_get = true;
        rv.get_end = 512;
        rv.fin_pending = true;
        rv
    }

    /// Only the tail's bytes that fit the buffer are taken, in any order; the tail is whole
    /// once every one of them came. A receive that is not a split takes none.
    #[test]
    fn the_tail_takes_its_own_bytes_only() {
        let mut rv = split();
        let t = rv.tail_part(400, 200, 1000).unwrap();
        assert_eq!(
            t,
            TailPart {
                range: 512..600,
                whole: false
            }
        );
        assert_eq!(rv.tail_part(800, 300, 1000).unwrap().range, 800..1000);
        let t = rv.tail_part(600, 200, 1000).unwrap();
        assert_eq!(
            t,
            TailPart {
                range: 600..800,
                whole: true
            }
        );
        // A smaller buffer: the tail ends at its capacity.
        let mut rv = split();
        let t = rv.tail_part(512, 488, 700).unwrap();
        assert_eq!(
            t,
            TailPart {
                range: 512..700,
                whole: true
            }
        );
        assert!(
            RndvRecv::new(3, 0x51, 1000)
                .tail_part(0, 10, 1000)
                .is_none()
        );
    }

    /// The receive completes after both halves, in either order: the sender's part landing
    /// first waits for the reads; the reads done first wait for the sender's part.
    #[test]
    fn a_split_completes_after_both_halves() {
        let mut io = FakeIo::default();
        let mut rv = split();
        assert_eq!(rv.tail_landed(), RecvNext::Wait);
        assert_eq!(rv.reads_done(&mut io), RecvNext::Complete);

        let mut rv = split();
        assert_eq!(rv.reads_done(&mut io), RecvNext::Wait);
        assert_eq!(rv.tail_landed(), RecvNext::Complete);
        // Not a split (a put's finish): complete at once.
        assert_eq!(RndvRecv::new(3, 0x51, 10).tail_landed(), RecvNext::Complete);
    }
}
