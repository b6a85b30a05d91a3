//! Rendezvous: the request to send (RTS), the receiver's choice among the plan's steps for host
//! memory, its answer (RTR), acknowledgement and abort. The data moves in `get.rs` (receiver
//! reads), `put.rs` (sender writes), `split.rs` (both at once), or as active-message fragments
//! (`eager_multi.rs`); GPU memory in `gpu/`.

use crate::worker::prelude::*;

mod get;
mod put;
mod send;
mod split;

pub(crate) use get::Reads;
pub(crate) use send::{RndvPick, RndvSend, SendHead, SendNext, register_send};

pub(crate) struct RndvRecv {
    pub(crate) peer: usize,
    pub(crate) sreq: u64,
    /// Bytes wanted (capacity-limited).
    pub(crate) want: usize,
    pub(crate) via_get: bool,
    /// The reads to post.
    pub(crate) get: Option<Reads>,
    /// Bytes of reads posted.
    pub(crate) posted: usize,
    /// Reads cover `0..get_end` (`want` unless split with the sender's writes).
    pub(crate) get_end: usize,
    /// Split rendezvous: the sender writes `get_end..want`; set until its finish message.
    pub(crate) fin_pending: bool,
    /// The reads are complete and acknowledged (a split then waits for the finish message).
    pub(crate) gets_done: bool,
    /// Bytes of a split's tail the sender streamed (it could not write them).
    pub(crate) tail_got: usize,
    /// GPU memory on either side, staged: the chunks to read (`gpu/`).
    pub(crate) staged: StagedRecv,
}

crate::spare::spare_type!(RndvRecv, RndvRecv::new(0, 0, 0));

impl RndvRecv {
    /// A rendezvous receive of `want` bytes from peer `p`'s send request `sreq`.
    pub(crate) fn new(peer: usize, sreq: u64, want: usize) -> Self {
        RndvRecv {
            peer,
            sreq,
            want,
            via_get: false,
            get: None,
            posted: 0,
            get_end: want,
            fin_pending: false,
            gets_done: false,
            tail_got: 0,
            staged: StagedRecv::default(),
        }
    }
}

/// What a rendezvous receive does after an event its state machine handled.
#[derive(Debug, PartialEq)]
pub(crate) enum RecvNext {
    /// Nothing more now: messages or completions are still to come.
    Wait,
    /// Every byte is in the buffer: complete the receive (its length, or the truncation).
    Complete,
    /// End the receive with this error (and tell the sender).
    Fail(Error),
}

impl RndvRecv {
    /// One read of this receive (request `rid`) completed with `res`, `outstanding` still in
    /// flight. A failed read asks the sender to stream the whole message instead (no byte is
    /// lost), and once it did, another read of the ones given up failing changes nothing (the
    /// stream brings every byte); the last read done acknowledges the reads to the sender.
    pub(crate) fn on_read(
        &mut self,
        io: &mut impl ProtoIo,
        rid: u64,
        outstanding: usize,
        res: Result<()>,
    ) -> RecvNext {
        match res {
            Err(e @ Error::EndpointFailure { .. }) => RecvNext::Fail(e),
            Err(e) if self.via_get => {
                tracing::warn!("rendezvous read failed ({e}); asking the sender to stream instead");
                self.restart_as_stream(io, rid)
            }
            Err(e) if self.posted > 0 => {
                tracing::debug!("a read given up for the stream failed ({e}); ignored");
                RecvNext::Wait
            }
            Err(e) => RecvNext::Fail(e),
            Ok(())
                if outstanding == 0
                    && self.via_get
                    && self.posted >= self.get_end
                    && !self.gets_done =>
            {
                self.reads_done(io)
            }
            Ok(()) => RecvNext::Wait,
        }
    }

    /// Every read is complete: acknowledge them to the sender (ATS); complete, unless the
    /// sender still writes the tail of a split (its finish message completes the receive).
    pub(crate) fn reads_done(&mut self, io: &mut impl ProtoIo) -> RecvNext {
        io.ctrl(
            self.peer,
            &Msg::Ats {
                src: io.uuid(),
                sreq: self.sreq,
                ok: true,
            },
        );
        self.gets_done = true;
        if self.fin_pending {
            return RecvNext::Wait;
        }
        RecvNext::Complete
    }

    /// The reads could not go on: drop the receive's registrations and ask the sender to
    /// stream the whole message through active messages (an RTR without a key). A split whose
    /// sender writes the tail fails instead: streaming the whole message could race with those
    /// writes.
    pub(crate) fn restart_as_stream(&mut self, io: &mut impl ProtoIo, rid: u64) -> RecvNext {
        io.keep_regs(rid, None);
        if self.fin_pending || self.gets_done {
            return RecvNext::Fail(Error::Internal(
                "the read half of a split rendezvous failed; the message is lost".into(),
            ));
        }
        self.via_get = false;
        self.get = None;
        self.rtr(io, rid, None);
        RecvNext::Wait
    }
}

/// Where a host rendezvous receive may move its data: what the worker found in the plan's
/// steps, the peer's lanes and the sender's request.
pub(crate) struct HostRecvChoice {
    /// Read: the lane, its domain, the sender's key of that domain, and whether the lane also
    /// writes (a large read is then split with the sender's writes).
    pub(crate) read: Option<(usize, usize, NamedKey, bool)>,
    /// The sender asked for our key (put rendezvous): the plan's write lane and its domain.
    pub(crate) put: Option<(usize, usize)>,
    /// From this size on a read is split with the sender's writes.
    pub(crate) split_thresh: usize,
    /// The sender's buffer.
    pub(crate) saddr: u64,
    /// The receive buffer (host memory, `want` bytes of it used).
    pub(crate) raddr: usize,
}

/// What starting a host rendezvous receive left the worker to do.
pub(crate) struct HostStarted {
    /// The receive buffer's registration, kept with the request.
    pub(crate) guard: Option<RegGuard>,
    /// Reads are to be posted (queue the request).
    pub(crate) reads: bool,
}

impl RndvRecv {
    /// Start a host rendezvous receive (request `rid`) on the first path of `c` that works: read
    /// the sender's buffer (split with its writes when large), or hand the sender our key to
    /// write, or, when a registration or key fails (the domain is demoted or the buffer
    /// refused, through [`ProtoIo`]), ask the sender to stream: no failure ends the receive.
    pub(crate) fn start_host(
        &mut self,
        io: &mut impl ProtoIo,
        rid: u64,
        c: &HostRecvChoice,
    ) -> HostStarted {
        let want = self.want;
        let region = MemRegion::host(c.raddr, want);
        if let Some((lane, md, k, writes)) = &c.read
            && io.may_register(*md, MemoryType::Host, None)
        {
            match io.register_md(*md, region) {
                Ok(g) => match io.unpack_key(*md, &k.key) {
                    Ok(rkey) => {
                        // Large messages: read the head while the sender writes the tail, so
                        // both sides' cores copy.
                        let split_at = (want / 2) & !4095;
                        let split_key = if want >= c.split_thresh && split_at > 0 && *writes {
                            io.pack_key(*md, &g).ok()
                        } else {
                            None
                        };
                        self.via_get = true;
                        self.get = Some(Reads {
                            lane: *lane,
                            remote: c.saddr,
                            rkey,
                            local: c.raddr,
                            memh: g.registration().clone(),
                        });
                        match split_key {
                            Some(key) => {
                                self.get_end = split_at;
                                self.fin_pending = true;
                                self.rtr(io, rid, Some((c.raddr as u64, split_at, key)));
                                io.count("rendezvous receive split: read head, remote writes tail");
                            }
                            None => io.count("rendezvous receive by read"),
                        }
                        return HostStarted {
                            guard: Some(g),
                            reads: true,
                        };
                    }
                    Err(e) => {
                        tracing::warn!("sender's key did not unpack ({e}); streaming instead")
                    }
                },
                Err(e) => tracing::debug!(
                    "receive registration failed ({e}); steering the sender to stream"
                ),
            }
        }
        if let Some((_, md)) = c.put
            && io.may_register(md, MemoryType::Host, None)
        {
            match io.register_md(md, region) {
                Ok(g) => match io.pack_key(md, &g) {
                    Ok(key) => {
                        io.count("rendezvous receive by remote write");
                        self.rtr(io, rid, Some((c.raddr as u64, 0, key)));
                        return HostStarted {
                            guard: Some(g),
                            reads: false,
                        };
                    }
                    Err(e) => tracing::warn!("packing our key failed ({e}); streaming instead"),
                },
                Err(e) => tracing::debug!(
                    "receive registration failed ({e}); steering the sender to stream"
                ),
            }
        }
        self.rtr(io, rid, None);
        HostStarted {
            guard: None,
            reads: false,
        }
    }

    /// Answer the sender (RTR): with our key and the offset it writes from, or without a key
    /// (stream the message to us).
    pub(crate) fn rtr(&self, io: &mut impl ProtoIo, rid: u64, put: Option<(u64, usize, NamedKey)>) {
        if put.is_none() {
            io.count("rendezvous receive streamed");
        }
        let (addr, offset, keys) = match put {
            Some((a, off, k)) => (a, off as u64, vec![k]),
            None => (0, 0, Vec::new()),
        };
        io.ctrl(
            self.peer,
            &Msg::Rtr {
                src: io.uuid(),
                sreq: self.sreq,
                rreq: rid,
                addr,
                size: self.want as u64,
                offset,
                keys,
            },
        );
    }
}

/// Marker key name that asks the receiver to hand out its key (put rendezvous).
pub(crate) const PUT_HINT: &str = "*put";

impl State {
    pub(crate) fn send_ats(&mut self, p: usize, sreq: u64) {
        self.ctrl(
            p,
            &Msg::Ats {
                src: self.address.uuid,
                sreq,
                ok: true,
            },
        );
    }

    /// Tell peer `p` that rendezvous `sreq` -> `rreq` is given up on this side, and why.
    pub(crate) fn send_abort(
        &mut self,
        p: usize,
        sreq: u64,
        rreq: u64,
        by_sender: bool,
        reason: &str,
    ) {
        if self.peers.get(p).is_none_or(|x| x.failed.is_some()) {
            return;
        }
        tracing::debug!(
            "rendezvous {sreq:#x} -> {rreq:#x} with {} aborted on this side: {reason}",
            self.peers[p].remote.describe()
        );
        self.ctrl(
            p,
            &Msg::Abort {
                src: self.address.uuid,
                sreq,
                rreq,
                by_sender,
                reason,
            },
        );
        self.pump(p);
    }

    /// The peer gave a rendezvous up: end our side of it with its reason.
    pub(crate) fn on_abort(
        &mut self,
        p: usize,
        sreq: u64,
        rreq: u64,
        by_sender: bool,
        reason: &str,
    ) {
        let target = if by_sender {
            let ours = |r: &Req| {
                r.result.is_none()
                    && matches!(&r.kind, ReqKind::Recv(RecvState { proto: RecvProto::Rndv(rv), .. })
                        if rv.peer == p && rv.sreq == sreq)
            };
            if rreq != 0 && self.reqs.get(&rreq).is_some_and(ours) {
                Some(rreq)
            } else {
                // The sender did not know our request yet.
                self.reqs.iter().find(|(_, r)| ours(r)).map(|(id, _)| id)
            }
        } else {
            match self.reqs.get(&sreq) {
                Some(Req {
                    kind: ReqKind::Send(s),
                    result: None,
                    ..
                }) if s.head.peer == p => Some(sreq),
                _ => None,
            }
        };
        // Not found: finished already, or not matched yet. An announced message the sender
        // gave up on leaves the unexpected queue (the sender may be gone by the time a receive
        // would match it and ask); a receive the abort overtook asks the sender, which answers
        // with another abort.
        let Some(id) = target else {
            if by_sender {
                self.matcher.drop_unexpected(
                    |u| matches!(u, Unexp::Rts { src, sreq: s, .. } if *src == p && *s == sreq),
                );
            }
            return;
        };
        tracing::debug!(
            "{} aborted the rendezvous {sreq:#x} -> {rreq:#x}: {reason}",
            self.peers[p].remote.describe()
        );
        let peer = self.peers[p].remote.describe();
        self.finish(
            id,
            Err(Error::PeerAborted {
                peer,
                reason: reason.to_string(),
            }),
        );
    }

    /// A reply (PULL, RTR) came for send `sreq` that is no longer waiting for it: unless it
    /// finished well, tell the receiver, whose request would otherwise wait forever.
    pub(crate) fn answer_for_gone_send(&mut self, p: usize, sreq: u64, rreq: u64) {
        let reason = match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: Some(res),
                ..
            }) if s.head.peer == p => match res {
                Ok(_) => return,
                Err(e) => e.to_string(),
            },
            _ => "the send request is gone (it failed or was canceled)".to_string(),
        };
        self.send_abort(p, sreq, rreq, true, &reason);
    }

    /// Start the data phase of a matched rendezvous.
    pub(crate) fn rndv_recv(
        &mut self,
        rid: u64,
        p: usize,
        sreq: u64,
        size: usize,
        addr: u64,
        keys: Vec<NamedKey>,
    ) {
        let (raddr, cap) = match &self.reqs[&rid].kind {
            ReqKind::Recv(rs) => (rs.addr, rs.cap),
            _ => return,
        };
        let want = size.min(cap);
        let wants_put = keys.iter().any(|k| k.md == PUT_HINT);
        let mut keys: Vec<NamedKey> = keys
            .into_iter()
            .filter(|k| k.md != PUT_HINT && k.md != GPU_WRITE_HINT && k.md != GPU_SHARED_HINT)
            .collect();
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.proto = RecvProto::Rndv(Pooled::new(RndvRecv::new(p, sreq, want)));
        }
        if self.peers[p].failed.is_some() {
            self.finish(rid, Err(self.failure_of(p)));
            return;
        }
        if want == 0 {
            self.send_ats(p, sreq);
            self.complete_recv(rid);
            self.pump(p);
            return;
        }
        self.refresh_plan(p);
        let steps = plan::recv_steps(&self.peers[p].plan, MemoryType::Host, MemKey::HOST);
        let get_lane = steps.iter().find_map(|s| match s {
            RecvStep::Get { lane } => Some(*lane),
            _ => None,
        });
        let put_lane = steps.iter().find_map(|s| match s {
            RecvStep::Put { lane } => Some(*lane),
            _ => None,
        });
        // Read: the sender offered a key of the lane's domain (both sides share it), or of
        // another lane of ours that reads (the sender's plan moved after a demotion on its
        // side). Put: the sender asked for our key, for the plan's write lane.
        let read = if wants_put {
            None
        } else {
            // The key moves out of the parsed message (a clone was two allocations per
            // rendezvous).
            self.read_lane(p, get_lane, &keys).and_then(|(lane, ki)| {
                let writes = self.slots[lane].attr.has(IfaceCaps::PUT_ZCOPY);
                (ki < keys.len()).then(|| (lane, self.slots[lane].md, keys.swap_remove(ki), writes))
            })
        };
        let choice = HostRecvChoice {
            read,
            put: put_lane
                .filter(|_| wants_put)
                .map(|l| (l, self.slots[l].md)),
            split_thresh: self.peers[p].plan.split_thresh,
            saddr: addr,
            raddr,
        };
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
        let started = rv.start_host(self, rid, &choice);
        if let Some(r) = self.reqs.get_mut(&rid) {
            if let ReqKind::Recv(rs) = &mut r.kind {
                rs.proto = RecvProto::Rndv(rv);
            }
            if let Some(g) = started.guard {
                crate::spare::push_guard(&mut r.guards, g);
            }
        }
        if started.reads {
            self.peers[p].queue.push_back(Pending::Stream(rid));
        }
        self.pump(p);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::proto::fake_io::{BAD_KEY, FAKE_UUID, FakeIo};

    const PEER: usize = 3;
    const SREQ: u64 = 0x51;
    const RREQ: u64 = 0x77;

    /// A receive of 1000 bytes reading the sender's buffer, `posted` bytes of reads posted.
    fn reading(posted: usize) -> RndvRecv {
        let mut rv = RndvRecv::new(PEER, SREQ, 1000);
        rv.via_get = true;
        rv.get = Some(Reads {
            lane: 0,
            remote: 0x1000,
            rkey: key(),
            local: 0x2000,
            memh: MemHandle::new(MemRegion::host(0x2000, 1000), "fake0", Arc::new(())),
        });
        rv.posted = posted;
        rv
    }

    fn key() -> RemoteKey {
        RemoteKey::new("fake", 0x1000, 1000, Arc::new(()))
    }

    fn chunk(off: usize, len: usize, frag: Option<(u64, usize)>) -> Chunk {
        Chunk {
            raddr: 0x1000 + off as u64,
            len,
            off,
            rkey: key(),
            sfrag: frag,
            local: None,
        }
    }

    /// A read that fails (not the endpoint) asks the sender to stream the whole message:
    /// an RTR without a key for the bytes wanted, the reads given up (another of them failing
    /// then asks nothing more and does not end the receive).
    #[test]
    fn a_failed_read_asks_the_sender_to_stream() {
        let mut io = FakeIo::default();
        let mut rv = reading(1000);
        let e = Error::io("reading", std::io::Error::from_raw_os_error(5));
        assert_eq!(rv.on_read(&mut io, RREQ, 2, Err(e)), RecvNext::Wait);
        assert!(!rv.via_get && rv.get.is_none());
        match io.ctrl_msgs(PEER).as_slice() {
            [
                Msg::Rtr {
                    src,
                    sreq,
                    rreq,
                    size,
                    keys,
                    ..
                },
            ] => {
                assert_eq!((*src, *sreq, *rreq, *size), (FAKE_UUID, SREQ, RREQ, 1000));
                assert!(keys.is_empty(), "no key: the sender streams");
            }
            m => panic!("{m:?}"),
        }
        assert_eq!(io.counted, ["rendezvous receive streamed"]);
        // Completions of the reads still in flight do nothing more, failed or not.
        let e = Error::io("reading", std::io::Error::from_raw_os_error(5));
        assert_eq!(rv.on_read(&mut io, RREQ, 1, Err(e)), RecvNext::Wait);
        assert_eq!(rv.on_read(&mut io, RREQ, 0, Ok(())), RecvNext::Wait);
        assert_eq!(io.ctrls.len(), 1);
    }

    /// The endpoint failing ends the receive with that error; nothing is sent to the peer.
    #[test]
    fn an_endpoint_failure_ends_the_receive() {
        let mut io = FakeIo::default();
        let mut rv = reading(1000);
        let e = Error::EndpointFailure {
            peer: "b".into(),
            reason: "gone".into(),
        };
        assert_eq!(
            rv.on_read(&mut io, RREQ, 0, Err(e.clone())),
            RecvNext::Fail(e)
        );
        assert!(io.ctrls.is_empty());
    }

    /// The read half of a split failing cannot fall back to streaming (the sender writes the
    /// tail meanwhile): the receive fails, and no RTR goes out.
    #[test]
    fn a_failed_read_of_a_split_fails_the_receive() {
        let mut io = FakeIo::default();
        let mut rv = reading(512);
        rv.get_end = 512;
        rv.fin_pending = true;
        let e = Error::io("reading", std::io::Error::from_raw_os_error(5));
        assert!(matches!(
            rv.on_read(&mut io, RREQ, 0, Err(e)),
            RecvNext::Fail(Error::Internal(_))
        ));
        assert!(io.ctrls.is_empty());
    }

    /// The last read done acknowledges to the sender and completes; earlier ones, or reads
    /// not all posted yet, wait; a split waits for the sender's finish after its ATS.
    #[test]
    fn the_last_read_acknowledges_and_completes() {
        let mut io = FakeIo::default();
        let mut rv = reading(1000);
        assert_eq!(rv.on_read(&mut io, RREQ, 1, Ok(())), RecvNext::Wait);
        let mut part = reading(600);
        assert_eq!(part.on_read(&mut io, RREQ, 0, Ok(())), RecvNext::Wait);
        assert!(io.ctrls.is_empty());
        assert_eq!(rv.on_read(&mut io, RREQ, 0, Ok(())), RecvNext::Complete);
        assert!(matches!(
            io.ctrl_msgs(PEER).as_slice(),
            [Msg::Ats {
                sreq: SREQ,
                ok: true,
                ..
            }]
        ));

        let mut io = FakeIo::default();
        let mut split = reading(512);
        split.get_end = 512;
        split.fin_pending = true;
        assert_eq!(split.on_read(&mut io, RREQ, 0, Ok(())), RecvNext::Wait);
        assert!(split.gets_done);
        assert_eq!(io.ctrls.len(), 1, "the ATS");
        // Another completion (none is left) does not acknowledge twice.
        assert_eq!(split.on_read(&mut io, RREQ, 0, Ok(())), RecvNext::Wait);
        assert_eq!(io.ctrls.len(), 1);
    }

    /// Staged chunks: the receive completes once every byte landed and no chunk is queued;
    /// it acknowledges only reads of the sender's own buffer (announced fragments are
    /// acknowledged one by one).
    #[test]
    fn staged_chunks_complete_once_all_landed() {
        for pull in [false, true] {
            let mut io = FakeIo::default();
            let mut rv = RndvRecv::new(PEER, SREQ, 1000);
            rv.staged.pull = pull;
            rv.staged.lane = 1;
            rv.staged.chunks.push_back(chunk(600, 400, None));
            assert_eq!(rv.chunk_landed(&mut io, 600, 1000), RecvNext::Wait);
            rv.staged.chunks.clear();
            assert_eq!(rv.chunk_landed(&mut io, 300, 1000), RecvNext::Wait);
            assert!(io.ctrls.is_empty());
            assert_eq!(rv.chunk_landed(&mut io, 100, 1000), RecvNext::Complete);
            assert_eq!(io.ctrls.len(), usize::from(!pull), "pull {pull}");
        }
    }

    /// A staged receive that ends early hands back every announced fragment it did not read,
    /// each with its whole staged length (more than the chunk when the receive truncates).
    #[test]
    fn an_ended_staged_receive_releases_its_announced_fragments() {
        let mut io = FakeIo::default();
        let mut rv = RndvRecv::new(PEER, SREQ, 1000);
        rv.staged.pull = true;
        rv.staged.chunks.push_back(chunk(0, 256, Some((4, 256))));
        rv.staged.chunks.push_back(chunk(256, 100, Some((5, 256))));
        rv.staged.chunks.push_back(chunk(356, 10, None));
        rv.release_chunks(&mut io);
        assert!(rv.staged.chunks.is_empty());
        let acks: Vec<(u64, u64, u64)> = io
            .ctrl_msgs(PEER)
            .into_iter()
            .map(|m| match m {
                Msg::FragAck {
                    sreq, frag, len, ..
                } => (sreq, frag, len),
                m => panic!("{m:?}"),
            })
            .collect();
        assert_eq!(acks, [(SREQ, 4, 256), (SREQ, 5, 256)]);
    }

    const READ_MD: usize = 2;
    const PUT_MD: usize = 4;

    fn choice(want_put: bool, key: &[u8], writes: bool) -> HostRecvChoice {
        HostRecvChoice {
            read: (!want_put).then(|| {
                (
                    7,
                    READ_MD,
                    NamedKey {
                        md: "fake2".into(),
                        key: key.to_vec(),
                    },
                    writes,
                )
            }),
            put: want_put.then_some((8, PUT_MD)),
            split_thresh: 64 << 10,
            saddr: 0x10_0000,
            raddr: 0x20_0000,
        }
    }

    /// The only answer queued: an RTR; its offset and keys.
    fn rtr_of(io: &FakeIo) -> (u64, u64, Vec<NamedKey>) {
        match io.ctrl_msgs(PEER).as_slice() {
            [
                Msg::Rtr {
                    src,
                    sreq,
                    rreq,
                    size,
                    offset,
                    keys,
                    ..
                },
            ] => {
                assert_eq!((*src, *sreq, *rreq), (FAKE_UUID, SREQ, RREQ));
                (*size, *offset, keys.clone())
            }
            m => panic!("{m:?}"),
        }
    }

    /// A receive whose registration fails (or whose domain is demoted, or whose sender's key
    /// does not unpack) does not end: it asks the sender to stream, without a key.
    #[test]
    fn a_host_receive_that_cannot_read_asks_the_sender_to_stream() {
        for case in [
            "registration fails",
            "demoted",
            "bad key",
            "put: registration fails",
        ] {
            let mut io = FakeIo::default();
            let c = match case {
                "bad key" => choice(false, BAD_KEY, false),
                "put: registration fails" => choice(true, b"k", false),
                _ => choice(false, b"k", false),
            };
            match case {
                "demoted" => io.demoted.push(READ_MD),
                "bad key" => {}
                _ => io.fail_reg_after = Some(0),
            }
            let mut rv = RndvRecv::new(PEER, SREQ, 1000);
            let started = rv.start_host(&mut io, RREQ, &c);
            assert!(started.guard.is_none() && !started.reads, "{case}");
            assert!(!rv.via_get && rv.get.is_none(), "{case}");
            let (size, _, keys) = rtr_of(&io);
            assert_eq!(size, 1000, "{case}");
            assert!(keys.is_empty(), "{case}: stream to me");
            assert_eq!(io.counted, ["rendezvous receive streamed"], "{case}");
            if case == "demoted" {
                assert!(io.regs.is_empty(), "a demoted domain is not asked");
            }
        }
    }

    /// With a registration and the sender's key, the receive reads: nothing is sent yet (the
    /// reads acknowledge when done), the registration is kept with the request.
    #[test]
    fn a_host_receive_reads_the_senders_buffer() {
        let mut io = FakeIo::default();
        let mut rv = RndvRecv::new(PEER, SREQ, 1000);
        let started = rv.start_host(&mut io, RREQ, &choice(false, b"k", true));
        assert!(started.guard.is_some() && started.reads);
        assert!(rv.via_get && !rv.fin_pending);
        let r = rv.get.clone().unwrap();
        assert_eq!((r.lane, r.remote, r.local), (7, 0x10_0000, 0x20_0000));
        assert!(io.ctrls.is_empty());
        assert_eq!(io.counted, ["rendezvous receive by read"]);
        assert_eq!(io.regs.len(), 1);
        assert_eq!(io.regs[0].2.len, 1000);
    }

    /// A large receive on a lane that also writes is split: it reads the head and hands the
    /// sender its key for the tail (from the 4 KiB-aligned middle).
    #[test]
    fn a_large_host_receive_is_split() {
        let mut io = FakeIo::default();
        let want = 1 << 20;
        let mut rv = RndvRecv::new(PEER, SREQ, want);
        let started = rv.start_host(&mut io, RREQ, &choice(false, b"k", true));
        assert!(started.reads);
        assert_eq!(rv.get_end, want / 2);
        assert!(rv.fin_pending);
        let (size, offset, keys) = rtr_of(&io);
        assert_eq!((size, offset), (want as u64, (want / 2) as u64));
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].md, "fake2");
        // Not split on a lane that does not write.
        let mut io = FakeIo::default();
        let mut rv = RndvRecv::new(PEER, SREQ, want);
        rv.start_host(&mut io, RREQ, &choice(false, b"k", false));
        assert_eq!((rv.get_end, rv.fin_pending), (want, false));
        assert!(io.ctrls.is_empty());
    }

    /// A sender that asked for our key gets it (put rendezvous); no reads.
    #[test]
    fn a_put_rendezvous_hands_the_sender_our_key() {
        let mut io = FakeIo::default();
        let mut rv = RndvRecv::new(PEER, SREQ, 5000);
        let started = rv.start_host(&mut io, RREQ, &choice(true, b"", false));
        assert!(started.guard.is_some() && !started.reads);
        let (size, offset, keys) = rtr_of(&io);
        assert_eq!((size, offset), (5000, 0));
        assert_eq!(keys[0].md, "fake4");
        assert_eq!(io.counted, ["rendezvous receive by remote write"]);
    }
}
