//! The stream protocol's receive side: one endpoint's ordered byte stream, handed to stream
//! receives in the order they were posted (UCX's `WAITALL`: a receive completes when full).
//!
//! When the endpoint ends (the peer closed it or it failed), bytes that arrived before stay
//! receivable: receives posted later take them, and a receive the stream cannot fill any more
//! ends early, reporting how many bytes it holds ([`StreamRecvs::end`]). Closing the endpoint
//! on this side drops them ([`StreamRx::clear`]).
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
    /// The stream ended before receive `id` was full: the receive ends early, reporting the
    /// bytes it holds in its buffer. Returns the bytes it took but cannot keep (none for a
    /// receive that holds them in the caller's buffer), which go back to the stream.
    fn end(&mut self, id: u64) -> Vec<u8>;
}

/// One endpoint's stream receive state.
#[derive(Debug, Default)]
pub(crate) struct StreamRx {
    /// Bytes that arrived and no receive took yet; the front chunk from `off`.
    buffered: VecDeque<Vec<u8>>,
    off: usize,
    /// Receives waiting for bytes, in the order they were posted.
    waiting: VecDeque<u64>,
    /// No more bytes will arrive (the endpoint ended): a receive that the buffered bytes do
    /// not fill ends at once.
    ended: bool,
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
        if self.ended {
            self.end_waiting(io);
        }
    }

    /// The endpoint ended: no byte arrives any more. Waiting receives end with what they hold;
    /// the bytes buffered stay for receives posted later.
    pub(crate) fn end(&mut self, io: &mut impl StreamRecvs) {
        self.ended = true;
        self.end_waiting(io);
    }

    /// Whether the endpoint ended ([`end`](Self::end)).
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// End every waiting receive (the stream cannot fill them). Only the first can hold bytes,
    /// and only while nothing is buffered: bytes it gives back go to the front, in order.
    fn end_waiting(&mut self, io: &mut impl StreamRecvs) {
        for id in std::mem::take(&mut self.waiting) {
            let back = io.end(id);
            if !back.is_empty() {
                self.put_back(back);
            }
        }
    }

    /// Put bytes a receive took back at the front of the stream.
    fn put_back(&mut self, taken: Vec<u8>) {
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

    /// Cancel receive `id` if it is waiting: the bytes it took go back to the front of the
    /// stream, so nothing is lost and a receive behind it may take them. True when canceled.
    pub(crate) fn cancel(&mut self, io: &mut impl StreamRecvs, id: u64) -> bool {
        let Some(pos) = self.waiting.iter().position(|&r| r == id) else {
            return false;
        };
        self.waiting.remove(pos);
        let taken = io.cancel(id);
        if !taken.is_empty() {
            self.put_back(taken);
        }
        self.fill(io);
        true
    }

    /// This side closed the endpoint: waiting receives end with what they hold, and buffered
    /// bytes are dropped (nobody can receive them any more).
    pub(crate) fn clear(&mut self, io: &mut impl StreamRecvs) {
        self.end(io);
        self.buffered.clear();
        self.off = 0;
    }

    /// Take every byte buffered and not yet taken, in order (UCX's `ucp_stream_recv_data_nb`:
    /// no receive is posted for them). `None` when nothing is buffered. Bytes are buffered
    /// only while no receive waits, so none is passed over.
    pub(crate) fn take_buffered(&mut self) -> Option<Vec<u8>> {
        let first = self.buffered.pop_front()?;
        let off = std::mem::take(&mut self.off);
        if self.buffered.is_empty() && off == 0 {
            return Some(first);
        }
        let rest: usize = self.buffered.iter().map(Vec::len).sum();
        let mut all = Vec::with_capacity(first.len() - off + rest);
        all.extend_from_slice(&first[off..]);
        for chunk in self.buffered.drain(..) {
            all.extend_from_slice(&chunk);
        }
        Some(all)
    }

    /// Whether bytes are buffered (a receive posted now would get some at once).
    pub(crate) fn has_buffered(&self) -> bool {
        !self.buffered.is_empty()
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
        /// Completed (full) or ended early, in that order.
        done: Vec<u64>,
        canceled: Vec<u64>,
        /// Ended early, with the bytes they reported.
        ended: Vec<(u64, usize)>,
        /// Receives that hold their bytes elsewhere (as a GPU receive its host buffer): at the
        /// end they give them back rather than keep them.
        gives_back: Vec<u64>,
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

        fn end(&mut self, id: u64) -> Vec<u8> {
            assert!(!self.done.contains(&id) && !self.canceled.contains(&id));
            self.done.push(id);
            let (b, got) = self.bufs.get_mut(&id).unwrap();
            assert!(*got < b.len(), "a full receive is not ended");
            if self.gives_back.contains(&id) {
                let back = b[..*got].to_vec();
                *got = 0;
                self.ended.push((id, 0));
                return back;
            }
            self.ended.push((id, *got));
            Vec::new()
        }
    }

    /// Taking the buffered bytes without a receive: all of them, in order, from where a
    /// receive stopped in the front chunk; after that nothing is buffered.
    #[test]
    fn taking_the_buffered_bytes_gets_all_of_them_in_order_once() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        assert!(rx.take_buffered().is_none() && !rx.has_buffered());
        rx.arrive(&mut io, b"abc");
        assert_eq!(
            rx.take_buffered().as_deref(),
            Some(&b"abc"[..]),
            "one chunk"
        );
        assert!(rx.take_buffered().is_none());
        rx.arrive(&mut io, b"0123");
        rx.arrive(&mut io, b"45");
        rx.arrive(&mut io, b"6789");
        // A receive takes the first three bytes, leaving an offset into the front chunk.
        io.bufs.insert(1, (vec![0; 3], 0));
        rx.post(&mut io, 1);
        assert_eq!((&io.done[..], &io.bufs[&1].0[..]), (&[1][..], &b"012"[..]));
        assert!(rx.has_buffered());
        assert_eq!(rx.take_buffered().as_deref(), Some(&b"3456789"[..]));
        assert!(!rx.has_buffered() && rx.take_buffered().is_none());
        // What arrives next goes to a receive posted after the take, from its first byte.
        rx.arrive(&mut io, b"xy");
        io.bufs.insert(2, (vec![0; 2], 0));
        rx.post(&mut io, 2);
        assert_eq!(&io.bufs[&2].0[..], b"xy");
    }

    /// The endpoint ends while a receive is part-filled: it ends reporting the bytes it holds,
    /// intact; the bytes that arrived and no receive took stay for later receives, which end
    /// at once with what they get when the stream cannot fill them.
    #[test]
    fn an_ended_stream_reports_what_each_receive_holds_and_keeps_the_rest() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 10], 0));
        rx.post(&mut io, 1);
        rx.arrive(&mut io, b"0123456");
        rx.end(&mut io);
        assert!(rx.ended());
        assert_eq!(io.ended, vec![(1, 7)]);
        assert_eq!(&io.bufs[&1].0[..7], b"0123456");
        assert_eq!(&io.bufs[&1].0[7..], &[0, 0, 0], "nothing written past them");

        // Bytes that arrived before the end, buffered, stay receivable.
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        rx.arrive(&mut io, b"abcdef");
        rx.end(&mut io);
        io.bufs.insert(2, (vec![0; 4], 0));
        rx.post(&mut io, 2);
        assert_eq!(io.done, vec![2]);
        assert!(io.ended.is_empty(), "filled: completes as usual");
        assert_eq!(&io.bufs[&2].0, b"abcd");
        io.bufs.insert(3, (vec![0; 4], 0));
        rx.post(&mut io, 3);
        assert_eq!(io.ended, vec![(3, 2)], "the rest, then the end");
        assert_eq!(&io.bufs[&3].0[..2], b"ef");
        io.bufs.insert(4, (vec![0; 4], 0));
        rx.post(&mut io, 4);
        assert_eq!(io.ended, vec![(3, 2), (4, 0)], "nothing left: ends at once");
    }

    /// A receive that cannot keep its bytes gives them back at the end: a later receive gets
    /// them, in order, ahead of what was buffered behind them.
    #[test]
    fn an_ended_receive_that_cannot_keep_its_bytes_gives_them_back() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 4], 0));
        io.gives_back.push(1);
        rx.post(&mut io, 1);
        rx.arrive(&mut io, b"xyz");
        rx.end(&mut io);
        assert_eq!(io.ended, vec![(1, 0)]);
        io.bufs.insert(2, (vec![0; 3], 0));
        rx.post(&mut io, 2);
        assert_eq!(&io.bufs[&2].0, b"xyz");

        // Also when it took them from the stream's buffer.
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 2], 0));
        rx.post(&mut io, 1);
        rx.arrive(&mut io, b"abcde");
        assert_eq!(rx.off, 0, "the rest is buffered from its start");
        io.bufs.insert(2, (vec![0; 5], 0));
        io.gives_back.push(2);
        rx.post(&mut io, 2);
        assert_eq!(io.bufs[&2].1, 3);
        rx.end(&mut io);
        io.bufs.insert(3, (vec![0; 3], 0));
        rx.post(&mut io, 3);
        assert_eq!(&io.bufs[&3].0, b"cde");
    }

    /// Closing on this side ends waiting receives and drops what is buffered.
    #[test]
    fn clearing_ends_waiting_receives_and_drops_buffered_bytes() {
        let mut rx = StreamRx::default();
        let mut io = Bufs::default();
        io.bufs.insert(1, (vec![0; 4], 0));
        rx.post(&mut io, 1);
        rx.arrive(&mut io, b"ab");
        rx.clear(&mut io);
        assert_eq!(io.ended, vec![(1, 2)]);
        assert_eq!(rx.buffered_len(), 0);
        rx.arrive(&mut io, b"late");
        io.bufs.insert(2, (vec![0; 8], 0));
        rx.post(&mut io, 2);
        assert_eq!(
            io.ended,
            vec![(1, 2), (2, 4)],
            "ended: takes what is there, then ends"
        );
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
        /// A receive of this many bytes; true: one that gives its bytes back at the end.
        Post(usize, bool),
        Cancel(usize),
        /// The endpoint ends (no byte arrives after it).
        End,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            8 => (1usize..50).prop_map(Step::Arrive),
            8 => (1usize..40, any::<bool>()).prop_map(|(n, b)| Step::Post(n, b)),
            4 => (0usize..8).prop_map(Step::Cancel),
            1 => Just(Step::End),
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
                    Step::Arrive(_) if rx.ended() => {}
                    Step::Arrive(n) => {
                        let chunk: Vec<u8> = (0..n).map(|i| (sent.len() + i) as u8).collect();
                        sent.extend_from_slice(&chunk);
                        rx.arrive(&mut io, &chunk);
                    }
                    Step::End => rx.end(&mut io),
                    Step::Post(n, gives_back) => {
                        next_id += 1;
                        io.bufs.insert(next_id, (vec![0; n], 0));
                        if gives_back {
                            io.gives_back.push(next_id);
                        }
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
            // Completed receives are filled in posting order (a cancel may leave gaps); one
            // that ended early holds the bytes it reported, at its start.
            let mut got: Vec<u8> = Vec::new();
            for id in &io.done {
                let (b, n) = &io.bufs[id];
                if let Some(&(_, k)) = io.ended.iter().find(|(e, _)| e == id) {
                    prop_assert_eq!(k, *n);
                }
                got.extend_from_slice(&b[..*n]);
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
            // Once ended, no receive waits.
            if rx.ended() {
                prop_assert!(waiting.is_empty());
            }
        }
    }
}
