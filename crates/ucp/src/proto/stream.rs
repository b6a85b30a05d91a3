//! The stream protocol's receive side: one endpoint's ordered byte stream, handed to stream
//! receives in the order they were posted (UCX's `WAITALL`: a receive completes when full).
//!
//! A state machine behind a narrow I/O trait ([`StreamRecvs`]: the receive buffers), so it is
//! tested without a transport or a worker. The sender's side: a send is cut into pieces
//! ([`pieces`]) queued behind the peer's other messages, each posted in order by the worker's
//! queue as one copied-in `AM_STREAM_DATA` message packed straight from the caller's buffer
//! ([`post_piece`], over [`ProtoIo`]).

use std::collections::VecDeque;

use rucx_ucs::Result;
use rucx_uct::OpStatus;

use crate::proto::io::ProtoIo;
use crate::wire;

/// Bytes of a piece's header: the sender's id.
const PIECE_HEADER: usize = 8;

/// The pieces a stream send of `len` bytes goes in, as (offset, length): as many bytes each as
/// the active-message lane copies in at once (`max_bcopy`, less the header), in order, covering
/// `0..len` once (none for an empty send).
pub(crate) fn pieces(len: usize, max_bcopy: usize) -> impl Iterator<Item = (usize, usize)> {
    let piece = max_bcopy.saturating_sub(PIECE_HEADER).max(1);
    (0..len.div_ceil(piece)).map(move |i| {
        let off = i * piece;
        (off, piece.min(len - off))
    })
}

/// Post `data` (a piece of stream send `req`) to peer `p` on its active-message lane `lane`:
/// one `AM_STREAM_DATA` message, copied in. `Ok(false)`: the transport pushed back (post it
/// again after progress, before anything queued behind it).
pub(crate) fn post_piece(
    io: &mut impl ProtoIo,
    req: u64,
    p: usize,
    lane: usize,
    data: &[u8],
) -> Result<bool> {
    let src = io.uuid().to_le_bytes();
    io.post(req, p, lane, |ep, _| {
        ep.am_bcopy(wire::AM_STREAM_DATA, &mut |buf: &mut [u8]| {
            let need = PIECE_HEADER + data.len();
            if let Some(dst) = buf.get_mut(..need) {
                dst[..PIECE_HEADER].copy_from_slice(&src);
                dst[PIECE_HEADER..].copy_from_slice(data);
            }
            need
        })
        .map(|_| OpStatus::Done)
    })
}

/// The receives a stream fills, as the worker keeps them.
pub(crate) trait StreamRecvs {
    /// The part of receive `id` still to fill (its buffer from the bytes it has to its end), or
    /// `None` when the receive ended otherwise (its endpoint failed).
    fn room(&mut self, id: u64) -> Option<&mut [u8]>;
    /// `n` more bytes of receive `id` were written; `full`: its buffer is full. Returns whether
    /// the receive is complete now (a full one is; a partial one, UCX's stream receive
    /// without `WAITALL`, is as soon as it holds a byte).
    fn filled(&mut self, id: u64, n: usize, full: bool) -> bool;
    /// The bytes receive `id` holds so far, and the receive ended as canceled.
    fn cancel(&mut self, id: u64) -> Vec<u8>;
}

/// One endpoint's stream receive state.
#[derive(Debug, Default)]
pub(crate) struct StreamRx {
    /// Bytes that arrived and no receive took yet; the front chunk from `off`.
    buffered: VecDeque<Vec<u8>>,
    off: usize,
    /// Receives waiting for bytes, in the order they were posted.
    waiting: VecDeque<u64>,
}

impl StreamRx {
    /// Bytes arrived: straight into the waiting receives when nothing older is buffered (no
    /// copy into the stream buffer), the rest kept for later receives.
    pub(crate) fn arrive(&mut self, io: &mut impl StreamRecvs, data: &[u8]) {
        let used = if self.buffered.is_empty() {
            self.hand_to_waiting(io, data)
        } else {
            0
        };
        if used < data.len() {
            self.buffered.push_back(data[used..].to_vec());
            self.fill(io);
        }
    }

    /// A receive was posted (with room for at least one byte).
    pub(crate) fn post(&mut self, io: &mut impl StreamRecvs, id: u64) {
        self.waiting.push_back(id);
        self.fill(io);
    }

    /// Cancel receive `id` if it is waiting: the bytes it took go back to the front of the
    /// stream, so nothing is lost and a receive behind it may take them. True when canceled.
    pub(crate) fn cancel(&mut self, io: &mut impl StreamRecvs, id: u64) -> bool {
        let Some(pos) = self.waiting.iter().position(|&r| r == id) else {
            return false;
        };
        self.waiting.remove(pos);
        let taken = io.cancel(id);
        if !taken.is_empty() {
            if self.off > 0 {
                let front = self
                    .buffered
                    .pop_front()
                    .expect("offset into a front chunk");
                self.buffered.push_front(front[self.off..].to_vec());
                self.off = 0;
            }
            self.buffered.push_front(taken);
        }
        self.fill(io);
        true
    }

    /// The endpoint failed: drop buffered bytes and forget waiting receives (the worker ends
    /// them with the failure).
    pub(crate) fn clear(&mut self) {
        self.buffered.clear();
        self.off = 0;
        self.waiting.clear();
    }

    /// Bytes buffered and not yet taken.
    #[cfg(test)]
    fn buffered_len(&self) -> usize {
        self.buffered.iter().map(Vec::len).sum::<usize>() - self.off
    }

    /// Hand buffered bytes to the waiting receives, in order.
    fn fill(&mut self, io: &mut impl StreamRecvs) {
        while let Some(front) = self.buffered.pop_front() {
            let used = self.hand_to_waiting(io, &front[self.off..]);
            if self.off + used < front.len() {
                // The waiting receives are full: keep the rest for later ones.
                self.off += used;
                self.buffered.push_front(front);
                return;
            }
            self.off = 0;
        }
    }

    /// Copy `data` into the waiting receives in posting order, completing those it fills;
    /// returns how many bytes they took.
    fn hand_to_waiting(&mut self, io: &mut impl StreamRecvs, data: &[u8]) -> usize {
        let mut used = 0;
        while used < data.len() {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(room) = io.room(id) else {
                // Ended otherwise: no longer waiting.
                self.waiting.pop_front();
                continue;
            };
            let n = room.len().min(data.len() - used);
            room[..n].copy_from_slice(&data[used..used + n]);
            let full = n == room.len();
            used += n;
            if io.filled(id, n, full) {
                self.waiting.pop_front();
            }
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::proto::fake_io::{FAKE_UUID, FakeIo, Op as FakeOp};
    use crate::wire::Msg;

    proptest! {
        /// A send's pieces cover it once, in order, each within what the lane copies in.
        #[test]
        fn pieces_cover_the_send_once(len in 0usize..20_000, max in 0usize..3000) {
            let mut at = 0;
            for (off, n) in pieces(len, max) {
                prop_assert_eq!(off, at);
                prop_assert!(n >= 1 && n <= max.saturating_sub(PIECE_HEADER).max(1));
                at += n;
            }
            prop_assert_eq!(at, len);
        }
    }

    /// A piece goes as one stream message of the wire's layout, from our id; a push-back
    /// posts nothing and says so.
    #[test]
    fn a_piece_is_one_stream_message() {
        let mut io = FakeIo::default();
        assert!(post_piece(&mut io, 5, 3, 1, b"bytes of the stream").unwrap());
        match &io.ep.ops[..] {
            [FakeOp::Bcopy { id, bytes }] => match crate::wire::parse(*id, bytes).unwrap() {
                Msg::StreamData { src, data } => {
                    assert_eq!((src, data), (FAKE_UUID, &b"bytes of the stream"[..]))
                }
                m => panic!("{m:?}"),
            },
            ops => panic!("{ops:?}"),
        }
        assert!(io.in_flight.is_empty(), "copied in: done at once");
        io.push_back_after = Some(0);
        assert!(!post_piece(&mut io, 5, 3, 1, b"more").unwrap());
        assert_eq!(io.ep.ops.len(), 1);
    }

    /// Receives as plain buffers.
    #[derive(Default)]
    struct Bufs {
        bufs: HashMap<u64, (Vec<u8>, usize)>,
        done: Vec<u64>,
        canceled: Vec<u64>,
        /// Receives that complete with any byte.
        partial: Vec<u64>,
    }

    impl StreamRecvs for Bufs {
        fn room(&mut self, id: u64) -> Option<&mut [u8]> {
            if self.done.contains(&id) || self.canceled.contains(&id) {
                return None;
            }
            self.bufs.get_mut(&id).map(|(b, got)| &mut b[*got..])
        }

        fn filled(&mut self, id: u64, n: usize, full: bool) -> bool {
            let (b, got) = self.bufs.get_mut(&id).unwrap();
            *got += n;
            assert!(*got <= b.len());
            assert_eq!(full, *got == b.len());
            let done = full || (*got > 0 && self.partial.contains(&id));
            if done {
                self.done.push(id);
            }
            done
        }

        fn cancel(&mut self, id: u64) -> Vec<u8> {
            self.canceled.push(id);
            let (b, got) = &self.bufs[&id];
            b[..*got].to_vec()
        }
    }

    #[test]
    fn bytes_go_to_receives_in_posting_order() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 3], 0));
        io.bufs.insert(2, (vec![0; 4], 0));
        rx.post(&mut io, 1);
        rx.post(&mut io, 2);
        rx.arrive(&mut io, b"abcde");
        assert_eq!(io.done, vec![1]);
        assert_eq!(&io.bufs[&1].0, b"abc");
        rx.arrive(&mut io, b"fgh");
        assert_eq!(io.done, vec![1, 2]);
        assert_eq!(&io.bufs[&2].0, b"defg");
        assert_eq!(rx.buffered_len(), 1);
        io.bufs.insert(3, (vec![0; 1], 0));
        rx.post(&mut io, 3);
        assert_eq!(&io.bufs[&3].0, b"h");
        assert_eq!(rx.buffered_len(), 0);
    }

    #[test]
    fn a_canceled_receive_gives_its_bytes_back_in_front() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 10], 0));
        rx.post(&mut io, 1);
        rx.arrive(&mut io, b"0123");
        assert!(rx.cancel(&mut io, 1));
        assert!(!rx.cancel(&mut io, 1), "only once");
        rx.arrive(&mut io, b"45");
        io.bufs.insert(2, (vec![0; 6], 0));
        rx.post(&mut io, 2);
        assert_eq!(&io.bufs[&2].0, b"012345");
    }

    #[test]
    fn a_partial_receive_ends_with_the_bytes_at_hand_and_the_rest_goes_on() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 8], 0));
        io.bufs.insert(2, (vec![0; 3], 0));
        io.partial.push(1);
        rx.post(&mut io, 1);
        rx.post(&mut io, 2);
        rx.arrive(&mut io, b"");
        assert!(io.done.is_empty(), "no byte: not complete");
        rx.arrive(&mut io, b"abcde");
        // 1 takes what came (5 of its 8), then 2 waits for its 3.
        assert_eq!(io.done, vec![1]);
        assert_eq!((&io.bufs[&1].0[..5], io.bufs[&1].1), (&b"abcde"[..], 5));
        rx.arrive(&mut io, b"fgh");
        assert_eq!(io.done, vec![1, 2]);
        assert_eq!(&io.bufs[&2].0, b"fgh");
        // Posted with bytes buffered: complete at once with them.
        rx.arrive(&mut io, b"ij");
        io.bufs.insert(3, (vec![0; 4], 0));
        io.partial.push(3);
        rx.post(&mut io, 3);
        assert_eq!(io.done, vec![1, 2, 3]);
        assert_eq!((&io.bufs[&3].0[..2], io.bufs[&3].1), (&b"ij"[..], 2));
    }

    #[test]
    fn a_receive_that_ended_otherwise_is_skipped() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 2], 0));
        io.bufs.insert(2, (vec![0; 2], 0));
        rx.post(&mut io, 1);
        rx.post(&mut io, 2);
        io.done.push(1); // e.g. failed by its endpoint
        rx.arrive(&mut io, b"xy");
        assert_eq!(&io.bufs[&2].0, b"xy");
    }

    #[derive(Clone, Debug)]
    enum Step {
        Arrive(usize),
        Post(usize),
        Cancel(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1usize..50).prop_map(Step::Arrive),
            (1usize..40).prop_map(Step::Post),
            (0usize..8).prop_map(Step::Cancel),
        ]
    }

    proptest! {
        /// Whatever the chunking of arrivals, the sizes of receives and the cancels: completed
        /// receives, in completion order, followed by the bytes still buffered and those held
        /// by receives still waiting, are exactly the stream, in order; no byte lost or doubled.
        #[test]
        fn the_stream_survives_any_split_and_cancel(steps in prop::collection::vec(step(), 1..80)) {
            let mut rx = StreamRx::default();
            let mut io = Bufs::default();
            let mut sent: Vec<u8> = Vec::new();
            let mut next_id = 0u64;
            let mut posted: Vec<u64> = Vec::new();
            for s in steps {
                match s {
                    Step::Arrive(n) => {
                        let chunk: Vec<u8> = (0..n).map(|i| (sent.len() + i) as u8).collect();
                        sent.extend_from_slice(&chunk);
                        rx.arrive(&mut io, &chunk);
                    }
                    Step::Post(n) => {
                        next_id += 1;
                        io.bufs.insert(next_id, (vec![0; n], 0));
                        posted.push(next_id);
                        rx.post(&mut io, next_id);
                    }
                    Step::Cancel(k) => {
                        let waiting: Vec<u64> = posted.iter().copied()
                            .filter(|id| !io.done.contains(id) && !io.canceled.contains(id)).collect();
                        if let Some(&id) = waiting.get(k % waiting.len().max(1)) {
                            prop_assert!(rx.cancel(&mut io, id));
                        }
                    }
                }
            }
            // Completed receives are filled in posting order (a cancel may leave gaps).
            let mut got: Vec<u8> = Vec::new();
            for id in &io.done {
                got.extend_from_slice(&io.bufs[id].0);
            }
            let waiting: Vec<u64> = posted.iter().copied()
                .filter(|id| !io.done.contains(id) && !io.canceled.contains(id)).collect();
            for id in &waiting {
                let (b, n) = &io.bufs[id];
                got.extend_from_slice(&b[..*n]);
            }
            for c in &rx.buffered {
                got.extend_from_slice(c);
            }
            let got: Vec<u8> = {
                // The front buffered chunk is consumed from `off`.
                let skip = rx.off;
                let head = got.len() - rx.buffered.iter().map(Vec::len).sum::<usize>();
                got[..head].iter().chain(got[head + skip..].iter()).copied().collect()
            };
            prop_assert_eq!(got, sent);
            // At most one waiting receive holds bytes (the first), and only while nothing is
            // buffered.
            let partial = waiting.iter().filter(|id| io.bufs[id].1 > 0).count();
            prop_assert!(partial <= 1);
            if rx.buffered_len() > 0 {
                prop_assert!(waiting.is_empty());
            }
        }
    }
}
