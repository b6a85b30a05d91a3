//! Rendezvous by read (`get_zcopy`): the receiver reads the sender's registered buffer in
//! fragments and acknowledges; a read that cannot start or fails asks the sender to stream.
//! Posting the reads is a step of [`RndvRecv`] over [`StageIo`] (for the read lane's state)
//! that answers [`ReadStep`]; the worker runs it from the peer's queue.

use crate::proto::gpu::stage_io::{LaneState, StageIo};
use crate::worker::prelude::*;

/// The reads of a rendezvous receive: where from, where to, and with what.
#[derive(Clone)]
pub(crate) struct Reads {
    /// The lane they go on.
    pub(crate) lane: usize,
    /// The sender's buffer (offset 0 of the message) and its key.
    pub(crate) remote: u64,
    pub(crate) rkey: RemoteKey,
    /// The receive buffer, and its registration with the lane's domain (the guard is kept
    /// with the request).
    pub(crate) local: usize,
    pub(crate) memh: MemHandle,
}

/// How posting a receive's reads ended.
#[derive(Debug, PartialEq)]
pub(crate) enum ReadStep {
    /// The transport pushed back, or the read lane is being connected: post again after
    /// progress.
    Later,
    /// Posted (or given up for streaming): what the receive does next.
    Next(RecvNext),
}

impl RndvRecv {
    /// Post the reads of this receive (request `rid`) from byte `posted` on, `max` bytes at
    /// most each, up to `get_end`. Once all are posted and none is in flight (every one
    /// completed at once) the reads are acknowledged. A lane that is gone, or a read that
    /// cannot be posted, asks the sender to stream instead (no byte lost); the endpoint
    /// failing ends the receive.
    pub(crate) fn post_reads(&mut self, io: &mut impl StageIo, rid: u64, max: usize) -> ReadStep {
        let Some(r) = self.get.clone() else {
            return ReadStep::Next(RecvNext::Wait);
        };
        if !self.via_get {
            return ReadStep::Next(RecvNext::Wait);
        }
        match io.lane_state(self.peer, r.lane) {
            LaneState::Ready => {}
            // Being connected (asked for again: a re-plan meanwhile makes a new list of wanted
            // lanes): the reads wait for it.
            LaneState::Connecting => return ReadStep::Later,
            // It could not be connected: the sender streams instead.
            LaneState::Absent => return ReadStep::Next(self.restart_as_stream(io, rid)),
        }
        let max = max.max(1);
        while self.posted < self.get_end {
            let off = self.posted;
            let n = max.min(self.get_end - off);
            let iov = [Iov {
                addr: r.local + off,
                len: n,
                memh: &r.memh,
            }];
            let at = r.remote + off as u64;
            match io.post(rid, self.peer, r.lane, |ep, t| {
                ep.get_zcopy(&iov, at, &r.rkey, t)
            }) {
                Ok(true) => self.posted = off + n,
                Ok(false) => return ReadStep::Later,
                Err(e @ Error::EndpointFailure { .. }) => {
                    return ReadStep::Next(RecvNext::Fail(e));
                }
                Err(e) => {
                    // Could not read: steer the sender to stream instead (no byte lost).
                    tracing::warn!(
                        "rendezvous read failed to start ({e}); asking the sender to stream"
                    );
                    return ReadStep::Next(self.restart_as_stream(io, rid));
                }
            }
        }
        if io.outstanding(rid) == 0 && !self.gets_done {
            return ReadStep::Next(self.reads_done(io));
        }
        ReadStep::Next(RecvNext::Wait)
    }
}

/// The worker's side: run the reads' steps on a live receive and do what they say.
impl State {
    /// Post the reads of a rendezvous receive (or the chunks of a staged one).
    pub(crate) fn stream_get(&mut self, rid: u64) -> Result<bool> {
        let (lane, gpu) = match self.reqs.get(&rid) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                ..
            }) => match rs.rndv() {
                Some(rv) if rv.staged.active() => return self.stream_chunks(rid),
                Some(rv) => match (&rv.get, rv.via_get) {
                    (Some(r), true) => (r.lane, rs.mem.is_gpu()),
                    _ => return Ok(true),
                },
                None => return Ok(true),
            },
            _ => return Ok(true),
        };
        // GPU zero-copy lanes move the whole buffer in one operation (into GPU memory, or out
        // of a GPU sender's buffer into host memory through an accelerator lane); host lanes in
        // fragments.
        let accel = self.slots[lane].attr.dev_type == rucx_uct::DeviceType::Accelerator;
        let frag = if accel || gpu { usize::MAX } else { self.frag };
        let max = self.slots[lane].attr.limits.get_max_zcopy.min(frag);
        let mut later = false;
        self.rndv_recv_step(rid, |rv, io| match rv.post_reads(io, rid, max) {
            ReadStep::Later => {
                later = true;
                RecvNext::Wait
            }
            ReadStep::Next(next) => next,
        });
        Ok(!later)
    }

    /// Run one step of rendezvous receive `rid`'s state machine (taken out of the request
    /// while it runs, so that it acts on the worker through [`ProtoIo`]) and do what it says
    /// (what it queued goes out with the peer's queue). While the receive reads, the bytes
    /// received are the bytes of reads posted; a receive that gave its reads up for a stream
    /// starts counting again from none.
    pub(crate) fn rndv_recv_step(
        &mut self,
        rid: u64,
        step: impl FnOnce(&mut RndvRecv, &mut Self) -> RecvNext,
    ) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        else {
            return;
        };
        let RecvProto::Rndv(mut rv) = std::mem::replace(&mut rs.proto, RecvProto::Tag) else {
            return;
        };
        let was_reading = rv.via_get;
        let next = step(&mut rv, self);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            if rv.via_get {
                rs.received = rv.posted;
            } else if was_reading {
                rs.received = 0;
            }
            rs.proto = RecvProto::Rndv(rv);
            if next == RecvNext::Complete {
                rs.received = rs.total.min(rs.cap);
            }
        }
        match next {
            RecvNext::Wait => {}
            RecvNext::Complete => self.complete_recv(rid),
            RecvNext::Fail(e) => self.fail(rid, e),
        }
    }

    /// The lane a rendezvous receive from peer `p` reads on, and which of the sender's `keys` it
    /// uses: the plan's read lane (`planned`; none: the plan does not read) when the sender
    /// keyed its domain, else a lane of ours of a keyed domain that reads, connected now or by
    /// the next progress (the sender's plan moved after a demotion on its side).
    pub(crate) fn read_lane(
        &mut self,
        p: usize,
        planned: Option<usize>,
        keys: &[NamedKey],
    ) -> Option<(usize, usize)> {
        let planned = planned?;
        let named = |st: &Self, l: usize, md: &str| st.ctx.domain(st.slots[l].md).name() == md;
        if let Some(i) = keys.iter().position(|k| named(self, planned, &k.md)) {
            return Some((planned, i));
        }
        let found = keys.iter().enumerate().find_map(|(i, k)| {
            let reads =
                |l: &usize| named(self, *l, &k.md) && self.slots[*l].attr.has(IfaceCaps::GET_ZCOPY);
            let peer = &self.peers[p];
            peer.eps
                .keys()
                .copied()
                .find(reads)
                .or_else(|| peer.targets.iter().map(|(l, _)| *l).find(reads))
                .map(|l| (l, i))
        })?;
        self.want_lane(p, found.0);
        Some(found)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::proto::fake_io::{FakeIo, Op as FakeOp};

    const PEER: usize = 3;
    const SREQ: u64 = 0x51;
    const RREQ: u64 = 0x77;
    const LANE: usize = 7;
    const REMOTE: u64 = 0x10_0000;
    const LOCAL: usize = 0x20_0000;

    /// A receive of `want` bytes that reads the sender's buffer on `LANE`, its buffer's
    /// registration held by the fake for the request.
    fn reading(io: &mut FakeIo, want: usize) -> RndvRecv {
        let mut rv = RndvRecv::new(PEER, SREQ, want);
        let region = MemRegion::host(LOCAL, want);
        io.regs.push((RREQ, LANE, region));
        rv.via_get = true;
        rv.get = Some(Reads {
            lane: LANE,
            remote: REMOTE,
            rkey: RemoteKey::new("fake7", REMOTE, want as u64, Arc::new(())),
            local: LOCAL,
            memh: MemHandle::new(region, "fake7", Arc::new(())),
        });
        rv
    }

    /// The reads posted, as (offset, length), each checked: from the sender's buffer at that
    /// offset into ours at that offset.
    fn reads(io: &FakeIo) -> Vec<(usize, usize)> {
        io.ep
            .ops
            .iter()
            .map(|op| match op {
                FakeOp::Rma {
                    get: true,
                    iov,
                    remote,
                    ..
                } => {
                    let [(local, len)] = iov[..] else {
                        panic!("{iov:?}")
                    };
                    let off = local - LOCAL;
                    assert_eq!(*remote, REMOTE + off as u64);
                    (off, len)
                }
                op => panic!("{op:?}"),
            })
            .collect()
    }

    fn ats_count(io: &FakeIo) -> usize {
        io.ctrl_msgs(PEER)
            .iter()
            .filter(|m| {
                matches!(
                    m,
                    Msg::Ats {
                        sreq: SREQ,
                        ok: true,
                        ..
                    }
                )
            })
            .count()
    }

    /// The only message queued: an RTR without a key (stream the whole message to us).
    fn asked_to_stream(io: &FakeIo, want: usize) -> bool {
        matches!(
            io.ctrl_msgs(PEER).as_slice(),
            [Msg::Rtr { rreq: RREQ, size, keys, .. }] if keys.is_empty() && *size == want as u64
        )
    }

    /// The reads go in fragments of the largest read, up to the bytes wanted; the last
    /// completion acknowledges them (ATS) and completes the receive.
    #[test]
    fn reads_go_in_fragments_and_the_last_completion_acknowledges() {
        let mut io = FakeIo::default();
        let mut rv = reading(&mut io, 1000);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert_eq!(reads(&io), [(0, 300), (300, 300), (600, 300), (900, 100)]);
        assert_eq!(rv.posted, 1000);
        assert!(
            io.ctrls.is_empty(),
            "no acknowledgement before the reads completed"
        );
        for left in (0..4).rev() {
            io.in_flight.pop();
            let next = rv.on_read(&mut io, RREQ, left, Ok(()));
            assert_eq!(
                next,
                if left == 0 {
                    RecvNext::Complete
                } else {
                    RecvNext::Wait
                }
            );
        }
        assert_eq!(ats_count(&io), 1);
    }

    /// Reads that complete at once (shared memory) acknowledge and complete from the post
    /// itself; posting again after that acknowledges nothing twice.
    #[test]
    fn reads_done_at_once_complete_from_the_post() {
        let mut io = FakeIo::default();
        io.ep.done_at_once = true;
        let mut rv = reading(&mut io, 1000);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 600),
            ReadStep::Next(RecvNext::Complete)
        );
        assert_eq!(reads(&io), [(0, 600), (600, 400)]);
        assert_eq!(ats_count(&io), 1);

        // A split reads its head only, then waits for the sender's finish after its ATS.
        let mut io = FakeIo::default();
        io.ep.done_at_once = true;
        let mut rv = reading(&mut io, 1000);
        rv.get_end = 512;
        rv.fin_pending = true;
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert_eq!(reads(&io), [(0, 300), (300, 212)]);
        assert!(rv.gets_done);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert_eq!(ats_count(&io), 1, "acknowledged once");
    }

    /// The transport pushing back stops the reads; posting again resumes at the first byte
    /// not read: no gap, nothing twice.
    #[test]
    fn a_push_back_resumes_where_it_stopped() {
        let mut io = FakeIo::default();
        let mut rv = reading(&mut io, 1000);
        io.push_back_after = Some(2);
        assert_eq!(rv.post_reads(&mut io, RREQ, 300), ReadStep::Later);
        assert_eq!(rv.posted, 600);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert_eq!(reads(&io), [(0, 300), (300, 300), (600, 300), (900, 100)]);
    }

    /// A read lane being connected: the reads wait for it. One that is gone (not reachable
    /// any more): the sender is asked to stream, the registration dropped.
    #[test]
    fn a_lane_being_connected_waits_and_a_lane_gone_streams() {
        let mut io = FakeIo::default();
        io.connecting.push(LANE);
        let mut rv = reading(&mut io, 1000);
        assert_eq!(rv.post_reads(&mut io, RREQ, 300), ReadStep::Later);
        assert!(io.ep.ops.is_empty() && io.ctrls.is_empty());
        io.connecting.clear();
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert_eq!(rv.posted, 1000);

        let mut io = FakeIo::default();
        io.absent.push(LANE);
        let mut rv = reading(&mut io, 1000);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert!(io.ep.ops.is_empty());
        assert!(!rv.via_get && rv.get.is_none());
        assert!(asked_to_stream(&io, 1000));
        assert!(io.regs.is_empty(), "the registration is dropped");
    }

    /// A read the transport refuses part-way asks the sender to stream the whole message
    /// (the reads posted complete to no effect); the endpoint failing ends the receive, and
    /// a split (whose tail the sender writes) cannot fall back: it fails.
    #[test]
    fn a_read_that_cannot_be_posted() {
        let refused = || Error::io("reading", std::io::Error::from_raw_os_error(22));
        let mut io = FakeIo {
            fail_post_after: Some((1, refused())),
            ..FakeIo::default()
        };
        let mut rv = reading(&mut io, 1000);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Wait)
        );
        assert_eq!(reads(&io), [(0, 300)]);
        assert!(asked_to_stream(&io, 1000));
        assert!(io.regs.is_empty());
        assert_eq!(rv.on_read(&mut io, RREQ, 0, Ok(())), RecvNext::Wait);
        assert_eq!(ats_count(&io), 0, "the stream completes it, not the reads");

        let gone = Error::EndpointFailure {
            peer: "b".into(),
            reason: "gone".into(),
        };
        let mut io = FakeIo {
            fail_post_after: Some((0, gone.clone())),
            ..FakeIo::default()
        };
        let mut rv = reading(&mut io, 1000);
        assert_eq!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Fail(gone))
        );
        assert!(io.ctrls.is_empty());

        let mut io = FakeIo {
            fail_post_after: Some((0, refused())),
            ..FakeIo::default()
        };
        let mut rv = reading(&mut io, 1000);
        rv.get_end = 512;
        rv.fin_pending = true;
        assert!(matches!(
            rv.post_reads(&mut io, RREQ, 300),
            ReadStep::Next(RecvNext::Fail(Error::Internal(_)))
        ));
        assert!(io.ctrls.is_empty());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Whatever the push-backs and the order reads complete in, and reads failing: the
        /// receive ends once (complete after every byte was read exactly once and the reads
        /// were acknowledged once; or asking the sender to stream, once, with nothing
        /// acknowledged), and no read goes past the bytes wanted.
        #[test]
        fn reads_end_once_whatever_the_order(
            want in 1usize..5000,
            max in 1usize..2000,
            at_once in proptest::bool::ANY,
            actions in proptest::collection::vec((0u8..3, 0u8..8), 0..60),
            fail_at in proptest::collection::btree_set(1usize..8, 0..3),
        ) {
            let mut io = FakeIo::default();
            io.ep.done_at_once = at_once;
            let mut rv = reading(&mut io, want);
            let mut ends = Vec::new();
            let mut completions = 0;
            let mut step = |rv: &mut RndvRecv, io: &mut FakeIo, a: u8, x: u8, ends: &mut Vec<RecvNext>| {
                match a {
                    0 => {
                        if let ReadStep::Next(n) = rv.post_reads(io, RREQ, max)
                            && n != RecvNext::Wait
                        {
                            ends.push(n);
                        }
                    }
                    1 if !io.in_flight.is_empty() => {
                        let i = x as usize % io.in_flight.len();
                        io.in_flight.remove(i);
                        completions += 1;
                        let res = if fail_at.contains(&completions) {
                            Err(Error::io("reading", std::io::Error::from_raw_os_error(5)))
                        } else {
                            Ok(())
                        };
                        let left = io.in_flight.len();
                        match rv.on_read(io, RREQ, left, res) {
                            RecvNext::Wait => {}
                            n => ends.push(n),
                        }
                    }
                    _ => io.push_back_after = Some(x as usize % 3),
                }
            };
            for (a, x) in actions {
                step(&mut rv, &mut io, a, x, &mut ends);
            }
            io.push_back_after = None;
            for _ in 0..(want / max + 10) {
                step(&mut rv, &mut io, 0, 0, &mut ends);
                while !io.in_flight.is_empty() {
                    step(&mut rv, &mut io, 1, 0, &mut ends);
                }
            }
            let streamed = io
                .ctrl_msgs(PEER)
                .iter()
                .filter(|m| matches!(m, Msg::Rtr { .. }))
                .count();
            let mut read = vec![0u8; want];
            for (off, len) in reads(&io) {
                proptest::prop_assert!(off + len <= want, "read past the buffer");
                for b in &mut read[off..off + len] {
                    *b += 1;
                }
            }
            if streamed == 0 {
                proptest::prop_assert_eq!(&ends, &[RecvNext::Complete]);
                proptest::prop_assert_eq!(ats_count(&io), 1);
                proptest::prop_assert!(read.iter().all(|b| *b == 1), "each byte read once");
            } else {
                proptest::prop_assert_eq!(streamed, 1, "asked to stream once");
                proptest::prop_assert!(ends.is_empty(), "{:?}", ends);
                proptest::prop_assert_eq!(ats_count(&io), 0);
                proptest::prop_assert!(read.iter().all(|b| *b <= 1), "a byte read twice");
                proptest::prop_assert!(!rv.via_get);
            }
        }
    }
}
