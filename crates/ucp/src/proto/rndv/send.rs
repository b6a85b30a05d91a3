//! Rendezvous, sender side: the request to send (RTS), the receiver's answer (RTR: stream to
//! it, write its buffer, or write the tail of a split while it reads the head), its
//! acknowledgement (ATS), the completions of what the send posted, and what a failure tells
//! the receiver. Each step is a method of [`RndvSend`] over [`SendIo`] that returns
//! [`SendNext`]; the worker only takes the state out of the request, runs the step and does
//! what it says. The data itself moves in `put.rs` (writes) and `eager_multi.rs` (streamed
//! fragments); GPU memory sent through staging in `gpu/pipeline_send.rs`.

use crate::proto::io::SendIo;
use crate::worker::prelude::*;

/// What every send has: the common part of its request ([`SendState`]), which the protocols'
/// steps read (and may change: the protocol, when re-selected, and the length, capped by the
/// receiver).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendHead {
    pub(crate) peer: usize,
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) tag: Tag,
    /// The protocol the plan chose (re-selected from a new plan after a registration failure).
    pub(crate) proto: Proto,
    /// The operation, whose table of the plan the protocol is selected from (and re-selected
    /// from after a registration failure): a tag send, a synchronous one, or a stream send.
    pub(crate) op: Op,
    /// Memory type and device of the buffer.
    pub(crate) mem: MemoryType,
    pub(crate) dev: Option<u32>,
}

impl SendHead {
    /// The send buffer as a region to register.
    pub(crate) fn region(&self) -> MemRegion {
        MemRegion {
            addr: self.addr,
            len: self.len,
            mem_type: self.mem,
            device: self.dev,
        }
    }
}

/// What a send does after a step of its protocol.
#[derive(Debug, PartialEq)]
pub(crate) enum SendNext {
    /// Nothing more now: an answer or completions are still to come.
    Wait,
    /// Operations are to be posted: queue the request on its peer.
    Post,
    /// Every byte went where it goes: complete the send.
    Complete,
    /// End the send with this error and tell the receiver.
    Fail(Error),
    /// The receiver gave the rendezvous up (why): end the send; nothing to tell it.
    Aborted(String),
}

/// The sender's side of a rendezvous: where it stands, the receive it goes to, the lane it
/// started on, and how the data moves (written, streamed, split, staged).
#[derive(Default)]
pub(crate) struct RndvSend {
    /// Announcing (or waiting for a lane to announce), waiting for the receiver, posting the
    /// data it asked for, or waiting for their completions.
    pub(crate) wait: SendWait,
    /// The receive request, once the receiver answered.
    pub(crate) rreq: Option<u64>,
    /// The lane the send registered its buffer on for the receiver's reads, chosen from the plan
    /// when the send started and kept (a later re-plan moves the plan's lanes, not this send's).
    pub(crate) lane: Option<usize>,
    /// Bytes of the message written or streamed so far (from the split point for a split).
    pub(crate) posted: usize,
    /// Remote buffer of a put rendezvous, and the lane writing it.
    pub(crate) put: Option<(u64, RemoteKey, usize)>,
    /// Staging pipeline (GPU memory sent through host fragments).
    pub(crate) stage: Option<Box<StageSend>>,
    /// Split rendezvous: the send finishes after both its writes and the receiver's reads.
    pub(crate) split_left: u8,
    /// The request to send waits for a lane the new plan wants (at most once; cleared when it
    /// is sent).
    pub(crate) deferred: bool,
}

/// The protocol and lane the plan gives a rendezvous send ([`SendIo::rndv_pick`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RndvPick {
    pub(crate) proto: Proto,
    /// The lane its data moves on (the GPU lane of its memory, or the host RMA lane), when the
    /// plan has one connected.
    pub(crate) lane: Option<usize>,
    /// The plan wants lanes that are not connected yet.
    pub(crate) lanes_pending: bool,
}

/// What the worker found for the receiver's answer: lanes and their domains.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RtrChoice {
    /// A lane of ours that writes with the domain of the receiver's key (the send's own lane
    /// first), and that domain: a put, or the tail of a split.
    pub(crate) write: Option<(usize, usize)>,
    /// The active-message lane, its domain, and whether it sends zero-copy fragments (the
    /// stream is then sent from a registration of the buffer).
    pub(crate) am: (usize, usize, bool),
}

/// Register send `req`'s buffer with the domain of `lane`, kept with the request, through the
/// context's one register path (a failure demotes the domain, or refuses the buffer, and
/// warns). A demoted domain is not asked. Returns the domain.
pub(crate) fn register_send(
    io: &mut impl SendIo,
    req: u64,
    head: &SendHead,
    lane: usize,
) -> Result<usize> {
    let md = io.lane_md(lane);
    if !io.may_register(md, head.mem, head.dev) {
        return Err(Error::Unsupported {
            what: "registration".into(),
            why: format!(
                "the domain of lane {lane} (md {md}) is demoted for {} memory",
                head.mem
            ),
        });
    }
    io.register(req, lane, head.region())?;
    Ok(md)
}

crate::spare::spare_type!(RndvSend, RndvSend::default());

impl RndvSend {
    /// Announce send `req` to the receiver (RTS), with a key of the send buffer's registration
    /// when the protocol is a read (or the hint that we write, for a put). A registration that
    /// fails demotes its domain (or refuses the buffer): the send is re-selected from the plan
    /// made after it, at most once per lane the plan offers; when the new plan's lane is not
    /// connected yet, the announcement waits for it ([`SendNext::Post`]: the progress loop
    /// connects it, then posts the request, which comes back here), and when nothing is left to
    /// register the receiver pulls the data through active messages (or asks a GPU sender to
    /// stage). `am`: a user active message's id and header (its rendezvous is announced with
    /// them).
    pub(crate) fn send_rts(
        &mut self,
        io: &mut impl SendIo,
        req: u64,
        head: &mut SendHead,
        am: Option<(u16, &[u8])>,
    ) -> SendNext {
        let deferred = self.deferred;
        // A send that waited for a lane is selected again from the plan that wanted it.
        let pick = io.rndv_pick(req, head, deferred);
        let (mut proto, mut lane) = (if deferred { pick.proto } else { head.proto }, pick.lane);
        let mut keys = Vec::new();
        let mut tries = 0;
        loop {
            match (proto, lane) {
                (Proto::RndvGet, Some(l)) => match register_send(io, req, head, l) {
                    Ok(md) => match io.req_key(req, md) {
                        Ok(k) => keys.push(k),
                        Err(e) => tracing::debug!("packing a key failed, streaming instead: {e}"),
                    },
                    Err(e) => {
                        tracing::debug!("rendezvous send registration on lane {l} failed: {e}");
                        let np = io.rndv_pick(req, head, true);
                        tries += 1;
                        if tries < 4 && np.proto.is_rndv() && np.lane.is_some() && np.lane != lane {
                            (proto, lane) = (np.proto, np.lane);
                            continue;
                        }
                        if np.lane.is_none() && np.lanes_pending && !deferred {
                            head.proto = np.proto;
                            self.deferred = true;
                            self.wait = SendWait::Posting;
                            return SendNext::Post;
                        }
                        // Nothing else to register: the receiver pulls the data through active
                        // messages (or asks a GPU sender to stage).
                        tracing::debug!("rendezvous send without a key");
                        lane = None;
                    }
                },
                (Proto::RndvPut, Some(_)) => keys.push(NamedKey {
                    md: PUT_HINT.into(),
                    key: Vec::new(),
                }),
                _ => {}
            }
            break;
        }
        // A GPU receiver may have us write into its buffer (see `gpu/write.rs`): from host
        // memory, or, next to the key for a read, from GPU memory on a GPU we share with it
        // when we are the pair's copier.
        if !head.mem.is_gpu()
            && let Some(h) = io.write_hint(head.peer)
        {
            keys.push(h);
        } else if head.mem.is_gpu()
            && proto == Proto::RndvGet
            && !keys.is_empty()
            && let Some(l) = lane
            && let Some(h) = io.shared_gpu_hint(head.peer, head.dev, l)
        {
            keys.push(h);
        }
        self.wait = SendWait::Receiver;
        head.proto = proto;
        self.lane = lane;
        self.deferred = false;
        let (src, sreq, size, addr) = (io.uuid(), req, head.len as u64, head.addr as u64);
        let smem = wire::mem_code(head.mem);
        let msg = match am {
            // A user active message's payload (`am.rs`): the same rendezvous, announced with
            // the user id and header for the receiver's handler.
            Some((id, header)) => Msg::AmRts {
                src,
                sreq,
                size,
                addr,
                smem,
                id,
                header,
                keys,
            },
            None => Msg::Rts {
                src,
                tag: head.tag,
                sreq,
                size,
                addr,
                smem,
                keys,
            },
        };
        io.ctrl(head.peer, &msg);
        SendNext::Wait
    }

    /// The receiver answered (RTR) for its receive `rreq` of `size` bytes: with its key (`keys`,
    /// and `addr`), we write its buffer from byte `offset` on (all of it, or the tail of a
    /// split whose head it reads); without, we stream the data (from `offset` for a split
    /// whose tail we cannot write). GPU memory cannot be streamed: the send fails, and the
    /// receiver is told.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_rtr(
        &mut self,
        io: &mut impl SendIo,
        req: u64,
        head: &mut SendHead,
        rreq: u64,
        addr: u64,
        size: usize,
        offset: usize,
        keys: &[NamedKey],
        c: &RtrChoice,
    ) -> SendNext {
        self.rreq = Some(rreq);
        // GPU memory is written only on a GPU shared with the receiver (its key, for the lane
        // we offered: `gpu/write.rs`); it cannot be streamed.
        let gpu_write = head.mem.is_gpu() && !keys.is_empty() && c.write.is_some() && offset == 0;
        if head.mem.is_gpu() && !gpu_write {
            return SendNext::Fail(Error::Unsupported {
                what: "streaming GPU memory through active messages".into(),
                why: "the receiver asked for a streamed rendezvous; GPU buffers need the staged \
                      pipeline, which needs a transport with remote memory access (posix or tcp) \
                      and cuda_copy in RUCX_TLS on both sides"
                    .into(),
            });
        }
        head.len = head.len.min(size);
        self.posted = 0;
        self.wait = SendWait::Posting;
        // Split: the receiver reads the head itself; we write the tail.
        let split = !keys.is_empty() && offset > 0 && offset < head.len;
        // Put: the receiver gave us its key; write with our own registration of that domain,
        // on the lane the worker found for it.
        if let Some(k) = keys.first()
            && let Some((lane, md)) = c.write
        {
            let unpacked = io.unpack_key(md, &k.key);
            let reg_ok = io.reg(req, md).is_some() || io.register_write_source(req, lane).is_ok();
            match (unpacked, reg_ok) {
                (Ok(rkey), true) => {
                    self.put = Some((addr, rkey, lane));
                    if split {
                        self.posted = offset;
                        self.split_left = 2;
                    }
                }
                (Err(e), _) => {
                    tracing::warn!("receiver's key did not unpack ({e}); streaming instead")
                }
                (_, false) => {
                    io.replan_peer(head.peer);
                    tracing::debug!("send registration failed; streaming the rendezvous instead");
                }
            }
        }
        if gpu_write {
            if self.put.is_none() {
                return SendNext::Fail(Error::Unsupported {
                    what: "writing into the receiver's GPU buffer".into(),
                    why: "its key did not unpack or this send holds no registration of its \
                          domain; GPU memory cannot be streamed"
                        .into(),
                });
            }
            io.count("rendezvous send by remote write on a shared GPU");
        }
        if self.put.is_none() && split {
            // The receiver reads the head from our registration while we could not write the
            // tail: stream the tail (copied in), keep every registration until its reads are
            // done, and finish after both (the receiver counts the tail's bytes).
            self.posted = offset;
            self.split_left = 2;
            io.count("rendezvous split: tail streamed (no remote write)");
        } else if self.put.is_none() {
            // Streaming through active messages: zero-copy from a registration of the AM
            // lane's domain, copied in otherwise.
            let (am, am_md, zc) = c.am;
            if zc {
                io.keep_regs(req, Some(am_md));
                if io.reg(req, am_md).is_none()
                    && io.may_register(am_md, MemoryType::Host, None)
                    && let Err(e) = register_send(io, req, head, am)
                {
                    tracing::debug!("streaming with copies: {e}");
                }
            } else {
                io.keep_regs(req, None);
            }
        }
        SendNext::Post
    }

    /// Every operation the send posted is complete (`wait` is [`SendWait::Completions`]): a
    /// put tells the receiver its data landed (FIN); the send completes unless it is half of a
    /// split whose other half (the receiver's reads) is still running.
    pub(crate) fn transfers_done(&mut self, io: &mut impl ProtoIo, head: &SendHead) -> SendNext {
        if self.put.is_some() {
            io.ctrl(
                head.peer,
                &Msg::Fin {
                    src: io.uuid(),
                    rreq: self.rreq.unwrap_or(0),
                },
            );
        }
        if self.split_step() {
            SendNext::Complete
        } else {
            SendNext::Wait
        }
    }

    /// One operation of the send completed with `res`, `outstanding` still in flight.
    pub(crate) fn on_transfer(
        &mut self,
        io: &mut impl ProtoIo,
        head: &SendHead,
        outstanding: usize,
        res: Result<()>,
    ) -> SendNext {
        match res {
            Err(e) => SendNext::Fail(e),
            Ok(()) if outstanding == 0 && self.wait == SendWait::Completions => {
                self.transfers_done(io, head)
            }
            Ok(()) => SendNext::Wait,
        }
    }

    /// The receiver acknowledged (ATS): its reads are done (`ok`), or it gave the rendezvous
    /// up.
    pub(crate) fn on_ats(&mut self, ok: bool) -> SendNext {
        if !ok {
            return SendNext::Aborted("the receiver gave the rendezvous up".into());
        }
        if self.split_step() {
            SendNext::Complete
        } else {
            SendNext::Wait
        }
    }

    /// One of the two halves of a split send is done; true when the send may finish (always
    /// for a send that is not split).
    pub(crate) fn split_step(&mut self) -> bool {
        if self.split_left > 0 {
            self.split_left -= 1;
            self.split_left == 0
        } else {
            true
        }
    }

    /// The receive request to name when telling the receiver the send ended (0: not known
    /// yet; the receiver finds it by the send request).
    pub(crate) fn peer_rreq(&self) -> u64 {
        self.stage
            .as_ref()
            .map(|st| st.rreq)
            .or(self.rreq)
            .unwrap_or(0)
    }

    /// Tell the receiver that send `sreq` ended on this side, and why (ABORT): its receive
    /// ends too rather than waiting for data that will never come.
    pub(crate) fn abort(&self, io: &mut impl ProtoIo, head: &SendHead, sreq: u64, reason: &str) {
        io.ctrl(
            head.peer,
            &Msg::Abort {
                src: io.uuid(),
                sreq,
                rreq: self.peer_rreq(),
                by_sender: true,
                reason,
            },
        );
    }

    /// Nothing of the data phase started: no answer, no write, no staging (a cancel may still
    /// ask the receiver to drop the announcement).
    pub(crate) fn untouched(&self) -> bool {
        self.rreq.is_none() && self.put.is_none() && self.stage.is_none()
    }
}

/// The worker's side: run a send's protocol steps on its state and do what they say.
impl State {
    /// Run `step` on send `id`'s protocol state (taken out of the request while it runs, so
    /// that it acts on the worker through [`SendIo`]) and on a copy of its [`SendHead`]; the
    /// protocol and length it leaves in that copy are written back to the request's. `None`:
    /// not a send.
    pub(crate) fn with_send<R>(
        &mut self,
        id: u64,
        step: impl FnOnce(&mut SendProto, &mut SendHead, &mut Self) -> R,
    ) -> Option<R> {
        let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return None;
        };
        let mut head = s.head;
        let mut sp = std::mem::replace(&mut s.state, SendProto::Copied);
        let out = step(&mut sp, &mut head, self);
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.state = sp;
            s.head.proto = head.proto;
            s.head.len = head.len;
        }
        Some(out)
    }

    /// [`Self::with_send`] for a rendezvous send's state. `None`: not a rendezvous send.
    pub(crate) fn with_rndv_send<R>(
        &mut self,
        id: u64,
        step: impl FnOnce(&mut RndvSend, &mut SendHead, &mut Self) -> R,
    ) -> Option<R> {
        self.with_send(id, |sp, head, st| match sp {
            SendProto::Rndv(rv) => Some(step(rv, head, st)),
            _ => None,
        })
        .flatten()
    }

    /// An operation send `id` posted completed with `res`, `outstanding` still in flight.
    pub(crate) fn send_transfer(&mut self, id: u64, outstanding: usize, res: Result<()>) {
        let next = self.with_send(id, |sp, head, st| match sp {
            SendProto::Rndv(rv) => rv.on_transfer(st, head, outstanding, res),
            SendProto::Frags(f) => f.on_transfer(outstanding, res),
            SendProto::Copied | SendProto::Sync => match res {
                Err(e) => SendNext::Fail(e),
                Ok(()) => SendNext::Wait,
            },
        });
        if let Some(next) = next {
            self.send_next(id, next);
        }
    }

    /// Do what a step of send `id`'s protocol said.
    pub(crate) fn send_next(&mut self, id: u64, next: SendNext) {
        match next {
            SendNext::Wait => {}
            SendNext::Post => {
                if let Some(Req {
                    kind: ReqKind::Send(s),
                    ..
                }) = self.reqs.get(&id)
                {
                    self.peers[s.head.peer].queue.push_back(Pending::Stream(id));
                }
            }
            SendNext::Complete => {
                if let Some(Req {
                    kind: ReqKind::Send(s),
                    ..
                }) = self.reqs.get(&id)
                {
                    let (len, tag) = (s.head.len, s.head.tag);
                    self.finish(
                        id,
                        Ok(Completion {
                            len,
                            tag,
                            sender: None,
                        }),
                    );
                }
            }
            SendNext::Fail(e) => self.fail(id, e),
            SendNext::Aborted(reason) => {
                let peer = match self.reqs.get(&id) {
                    Some(Req {
                        kind: ReqKind::Send(s),
                        ..
                    }) => self.peers[s.head.peer].remote.describe(),
                    _ => return,
                };
                self.finish(id, Err(Error::PeerAborted { peer, reason }));
            }
        }
    }

    /// Run one step of send `id`'s rendezvous and do what it says.
    pub(crate) fn rndv_send_step(
        &mut self,
        id: u64,
        step: impl FnOnce(&mut RndvSend, &mut SendHead, &mut Self) -> SendNext,
    ) {
        if let Some(next) = self.with_rndv_send(id, step) {
            self.send_next(id, next);
        }
    }

    /// Announce rendezvous send `id` (see [`RndvSend::send_rts`]).
    pub(crate) fn send_rts(&mut self, id: u64) {
        // A user active message's id and header, kept until the announcement goes.
        let am = self.am_rts.remove(&id);
        let next = self.with_rndv_send(id, |rv, head, st| {
            rv.send_rts(st, id, head, am.as_ref().map(|(i, h)| (*i, h.as_slice())))
        });
        if next == Some(SendNext::Post)
            && let Some(am) = am
        {
            self.am_rts.insert(id, am);
        }
        if let Some(next) = next {
            self.send_next(id, next);
        }
    }

    /// The receiver of rendezvous send `sreq` answered (see [`RndvSend::on_rtr`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_rtr(
        &mut self,
        p: usize,
        sreq: u64,
        rreq: u64,
        addr: u64,
        size: usize,
        offset: usize,
        keys: Vec<NamedKey>,
    ) {
        let lane = match self.reqs.get(&sreq) {
            Some(Req {
                kind:
                    ReqKind::Send(SendState {
                        head: SendHead { peer, .. },
                        state: SendProto::Rndv(rv),
                        ..
                    }),
                result: None,
                ..
            }) if *peer == p => rv.lane,
            _ => {
                self.answer_for_gone_send(p, sreq, rreq);
                return;
            }
        };
        // The receiver's key is of the domain it chose: the lane this send started on when it
        // is of that domain (the plan's RMA lane may have moved since, after a demotion: the
        // send keeps its lane), else a connected lane of it that writes (the receiver's plan
        // differs).
        let started = lane.or(self.peers[p].rma);
        let write = keys.first().and_then(|k| {
            started
                .into_iter()
                .chain(self.peers[p].eps.keys().copied())
                .find(|&l| {
                    self.ctx.domain(self.slots[l].md).name() == k.md
                        && self.slots[l].attr.has(IfaceCaps::PUT_ZCOPY)
                })
                .map(|l| (l, self.slots[l].md))
        });
        let am = self.peers[p].am;
        let zc = self.slots[am].attr.has(IfaceCaps::AM_ZCOPY)
            && self.slots[am].attr.limits.am_max_hdr >= proto::FIRST_OVERHEAD;
        let c = RtrChoice {
            write,
            am: (am, self.slots[am].md, zc),
        };
        self.rndv_send_step(sreq, |rv, head, st| {
            rv.on_rtr(st, sreq, head, rreq, addr, size, offset, &keys, &c)
        });
        self.pump(p);
    }

    /// An acknowledgement (ATS) for send `sreq` from peer `p`: a rendezvous whose reads are
    /// done, or a synchronous send's match.
    pub(crate) fn on_ats(&mut self, p: usize, sreq: u64, ok: bool) {
        let next = match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: None,
                ..
            }) if s.head.peer == p => match s.state {
                SendProto::Rndv(_) => None,
                _ if ok => Some(SendNext::Complete),
                _ => Some(SendNext::Aborted(
                    "the receiver gave the rendezvous up".into(),
                )),
            },
            _ => return,
        };
        match next {
            Some(next) => self.send_next(sreq, next),
            None => self.rndv_send_step(sreq, |rv, _, _| rv.on_ats(ok)),
        }
    }
}

#[cfg(test)]
mod tests;
