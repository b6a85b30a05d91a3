//! Rendezvous: the request to send (RTS), the receiver's choice among the plan's steps for host
//! memory, its answer (RTR), acknowledgement and abort. The data moves in `get.rs` (receiver
//! reads), `put.rs` (sender writes), `split.rs` (both at once), or as active-message fragments
//! (`eager_multi.rs`); GPU memory in `gpu/`.

use crate::worker::prelude::*;

mod get;
mod put;
mod split;

/// The sender's side of a rendezvous: the receive it goes to, the lane it started on, and how
/// the data moves (written, staged, split).
#[derive(Default)]
pub(crate) struct RndvSend {
    /// The receive request, once the receiver answered.
    pub(crate) rreq: Option<u64>,
    /// The lane the send registered its buffer on for the receiver's reads, chosen from the plan
    /// when the send started and kept (a later re-plan moves the plan's lanes, not this send's).
    pub(crate) lane: Option<usize>,
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

pub(crate) struct RndvRecv {
    pub(crate) peer: usize,
    pub(crate) sreq: u64,
    /// Bytes wanted (capacity-limited).
    pub(crate) want: usize,
    pub(crate) via_get: bool,
    /// The reads to post: lane, remote address, remote key, local address.
    pub(crate) get: Option<(usize, u64, RemoteKey, usize)>,
    /// Bytes of reads posted.
    pub(crate) posted: usize,
    /// Reads cover `0..get_end` (`want` unless split with the sender's writes).
    pub(crate) get_end: usize,
    /// Split rendezvous: the sender writes `get_end..want`; set until its finish message.
    pub(crate) fin_pending: bool,
    /// The reads are complete (split rendezvous waiting for the finish message).
    pub(crate) gets_done: bool,
    /// Bytes of a split's tail the sender streamed (it could not write them).
    pub(crate) tail_got: usize,
}

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
        }
    }
}

/// Marker key name that asks the receiver to hand out its key (put rendezvous).
pub(crate) const PUT_HINT: &str = "*put";

impl State {
    pub(crate) fn send_rts(&mut self, id: u64) {
        let (p, addr, len, tag, mut proto, mem, dev) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.peer, s.addr, s.len, s.tag, s.proto, s.mem, s.dev),
            _ => return,
        };
        let deferred = match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.rndv.deferred,
            _ => false,
        };
        let mut keys = Vec::new();
        let mut lane = self.rndv_lane(p, MemKey::new(mem, dev));
        if deferred {
            // Selected again from the plan with the lane it waited for.
            (proto, lane) = self.reselect_rndv(id, p, len, MemKey::new(mem, dev));
        }
        // A registration that fails demotes its domain (or refuses this buffer): the send is
        // re-selected from the plan made after it, at most once per lane the plan offers.
        let mut tries = 0;
        loop {
            match (proto, lane) {
                (Proto::RndvGet, Some(l)) => match self.register_send(id, l) {
                    Ok(()) => {
                        let g = self.reqs[&id].guards.last().expect("just registered");
                        let md = self.ctx.domain(self.slots[l].md);
                        match md.mkey_pack(g.registration()) {
                            Ok(k) => keys.push(NamedKey {
                                md: md.name().to_string(),
                                key: k,
                            }),
                            Err(e) => {
                                tracing::debug!("packing a key failed, streaming instead: {e}")
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!("rendezvous send registration on lane {l} failed: {e}");
                        let (np, nl) = self.reselect_rndv(id, p, len, MemKey::new(mem, dev));
                        tries += 1;
                        if tries < 4 && np.is_rndv() && nl.is_some() && nl != Some(l) {
                            (proto, lane) = (np, nl);
                            continue;
                        }
                        if nl.is_none() && self.peers[p].needs_lanes && !deferred {
                            // The new plan's lane is not connected yet: the request to send
                            // goes once it is (the progress loop connects it, then posts this
                            // send's queue entry, which comes back here).
                            if let Some(Req {
                                kind: ReqKind::Send(s),
                                ..
                            }) = self.reqs.get_mut(&id)
                            {
                                s.proto = np;
                                s.rndv.deferred = true;
                                s.wait = SendWait::Posting;
                            }
                            self.peers[p].queue.push_back(Pending::Stream(id));
                            return;
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
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.wait = SendWait::Receiver;
            s.proto = proto;
            s.rndv.lane = lane;
            s.rndv.deferred = false;
        }
        let src = self.address.uuid;
        match self.am_rts.remove(&id) {
            // A user active message's payload (`am.rs`): the same rendezvous, announced with
            // the user id and header for the receiver's handler.
            Some((am_id, header)) => self.ctrl(
                p,
                &Msg::AmRts {
                    src,
                    sreq: id,
                    size: len as u64,
                    addr: addr as u64,
                    smem: wire::mem_code(mem),
                    id: am_id,
                    header: &header,
                    keys,
                },
            ),
            None => self.ctrl(
                p,
                &Msg::Rts {
                    src,
                    tag,
                    sreq: id,
                    size: len as u64,
                    addr: addr as u64,
                    smem: wire::mem_code(mem),
                    keys,
                },
            ),
        }
    }

    /// The lane a rendezvous of memory `key` to peer `p` moves its data on, as the plan says
    /// now: the GPU lane of that memory, or the host RMA lane.
    fn rndv_lane(&self, p: usize, key: MemKey) -> Option<usize> {
        if key.mem.is_gpu() {
            self.peers[p].plan.lanes.gpu(key)
        } else {
            self.peers[p].rma
        }
    }

    /// Send `id` (`len` bytes of memory `key` to peer `p`) could not register its buffer:
    /// re-plan (a demotion changed the registration view) and select its protocol and lane
    /// again, as a new send would.
    fn reselect_rndv(
        &mut self,
        id: u64,
        p: usize,
        len: usize,
        key: MemKey,
    ) -> (Proto, Option<usize>) {
        self.refresh_plan(p);
        let proto = self.peers[p]
            .plan
            .table(Op::Tag, key)
            .lookup(len)
            .map(|r| r.proto)
            .filter(|p| p.is_rndv())
            .unwrap_or(match &self.reqs[&id].kind {
                ReqKind::Send(s) => s.proto,
                _ => Proto::RndvAm,
            });
        (proto, self.rndv_lane(p, key))
    }

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
                    && matches!(&r.kind, ReqKind::Recv(RecvState { rndv: Some(rv), .. })
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
                }) if s.peer == p => Some(sreq),
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
            }) if s.peer == p => match res {
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
        let keys: Vec<NamedKey> = keys.into_iter().filter(|k| k.md != PUT_HINT).collect();
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.rndv = Some(Box::new(RndvRecv::new(p, sreq, want)));
        }
        if self.peers[p].failed.is_some() {
            let reason = self.peers[p].failed.clone().unwrap_or_default();
            self.finish(
                rid,
                Err(Error::EndpointFailure {
                    peer: self.peers[p].remote.describe(),
                    reason,
                }),
            );
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
        let split_thresh = self.peers[p].plan.split_thresh;
        let region = MemRegion::host(raddr, want);
        // Get: the sender offered a key of the lane's domain (both sides share it), or of
        // another lane of ours that reads (the sender's plan moved after a demotion on its
        // side), and we can register.
        if !wants_put
            && let Some((lane, ki)) = self.read_lane(p, get_lane, &keys)
            && let Some(k) = keys.get(ki)
        {
            let md = self.slots[lane].md;
            if self.may_register(md, MemoryType::Host, None) {
                match self.register_md(md, region) {
                    Ok(g) => match self.ctx.domain(md).rkey_unpack(&k.key) {
                        Ok(rkey) => {
                            // Large messages: read the head while the sender writes the tail,
                            // so both sides' cores copy.
                            let split_at = (want / 2) & !4095;
                            let split_key = if want >= split_thresh
                                && split_at > 0
                                && self.slots[lane].attr.has(IfaceCaps::PUT_ZCOPY)
                            {
                                self.ctx.domain(md).mkey_pack(g.registration()).ok()
                            } else {
                                None
                            };
                            let r = self.reqs.get_mut(&rid).expect("req");
                            r.guards.push(g);
                            if let ReqKind::Recv(RecvState { rndv: Some(rv), .. }) = &mut r.kind {
                                rv.via_get = true;
                                rv.get = Some((lane, addr, rkey, raddr));
                                if split_key.is_some() {
                                    rv.get_end = split_at;
                                    rv.fin_pending = true;
                                }
                            }
                            if let Some(k) = split_key {
                                let key = NamedKey {
                                    md: self.ctx.domain(md).name().to_string(),
                                    key: k,
                                };
                                self.send_rtr(p, sreq, rid, Some((raddr as u64, split_at, key)));
                                self.count(
                                    "rendezvous receive split: read head, remote writes tail",
                                );
                            } else {
                                self.count("rendezvous receive by read");
                            }
                            self.peers[p].queue.push_back(Pending::Stream(rid));
                            self.pump(p);
                            return;
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
        }
        // Put: register our buffer and hand the sender a key.
        if wants_put && let Some(lane) = put_lane {
            let md = self.slots[lane].md;
            if self.may_register(md, MemoryType::Host, None) {
                match self.register_md(md, region) {
                    Ok(g) => match self.ctx.domain(md).mkey_pack(g.registration()) {
                        Ok(k) => {
                            self.reqs.get_mut(&rid).expect("req").guards.push(g);
                            let key = NamedKey {
                                md: self.ctx.domain(md).name().to_string(),
                                key: k,
                            };
                            self.count("rendezvous receive by remote write");
                            self.send_rtr(p, sreq, rid, Some((raddr as u64, 0, key)));
                            self.pump(p);
                            return;
                        }
                        Err(e) => tracing::warn!("packing our key failed ({e}); streaming instead"),
                    },
                    Err(e) => tracing::debug!(
                        "receive registration failed ({e}); steering the sender to stream"
                    ),
                }
            }
        }
        self.send_rtr(p, sreq, rid, None);
        self.pump(p);
    }

    pub(crate) fn send_rtr(
        &mut self,
        p: usize,
        sreq: u64,
        rreq: u64,
        put: Option<(u64, usize, NamedKey)>,
    ) {
        if put.is_none() {
            self.count("rendezvous receive streamed");
        }
        let want = match &self.reqs.get(&rreq).map(|r| &r.kind) {
            Some(ReqKind::Recv(RecvState { rndv: Some(rv), .. })) => rv.want,
            _ => 0,
        };
        let (addr, offset, keys) = match put {
            Some((a, off, k)) => (a, off as u64, vec![k]),
            None => (0, 0, Vec::new()),
        };
        self.ctrl(
            p,
            &Msg::Rtr {
                src: self.address.uuid,
                sreq,
                rreq,
                addr,
                size: want as u64,
                offset,
                keys,
            },
        );
    }

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
        let Some(Req {
            kind: ReqKind::Send(s),
            result: None,
            ..
        }) = self.reqs.get_mut(&sreq)
        else {
            self.answer_for_gone_send(p, sreq, rreq);
            return;
        };
        if s.mem.is_gpu() {
            s.rndv.rreq = Some(rreq);
            let e = Error::Unsupported {
                what: "streaming GPU memory through active messages".into(),
                why: "the receiver asked for a streamed rendezvous; GPU buffers need the staged \
                      pipeline, which needs a transport with remote memory access (posix or tcp) \
                      and cuda_copy in RUCX_TLS on both sides"
                    .into(),
            };
            self.fail(sreq, e);
            return;
        }
        s.rndv.rreq = Some(rreq);
        s.len = s.len.min(size);
        s.posted = 0;
        s.wait = SendWait::Posting;
        // Split: the receiver reads the head itself; we write the tail.
        let split = !keys.is_empty() && offset > 0 && offset < s.len;
        // Put: the receiver gave us its key; write with our own registration, on the lane this
        // send started on when the key is of its domain (the plan's RMA lane may have moved
        // since, after a demotion: the send keeps its lane); else the receiver, whose plan
        // differs, chose the domain: a connected lane of it.
        let started = s.rndv.lane.or(self.peers[p].rma);
        let key_lane = |st: &Self, md: &str| {
            started
                .into_iter()
                .chain(st.peers[p].eps.keys().copied())
                .find(|&l| {
                    st.ctx.domain(st.slots[l].md).name() == md
                        && st.slots[l].attr.has(IfaceCaps::PUT_ZCOPY)
                })
        };
        if let Some(k) = keys.first()
            && let Some(lane) = key_lane(self, &k.md)
        {
            let md = self.slots[lane].md;
            let unpacked = self.ctx.domain(md).rkey_unpack(&k.key);
            let have_reg = self.reqs[&sreq]
                .guards
                .iter()
                .any(|g| g.registration().domain() == self.ctx.domain(md).name());
            let reg_ok = have_reg || self.register_send(sreq, lane).is_ok();
            match (unpacked, reg_ok) {
                (Ok(rkey), true) => {
                    if let Some(Req {
                        kind: ReqKind::Send(s),
                        ..
                    }) = self.reqs.get_mut(&sreq)
                    {
                        s.rndv.put = Some((addr, rkey, lane));
                        if split {
                            s.posted = offset;
                            s.rndv.split_left = 2;
                        }
                    }
                }
                (Err(e), _) => {
                    tracing::warn!("receiver's key did not unpack ({e}); streaming instead")
                }
                (_, false) => {
                    self.refresh_plan(p);
                    tracing::debug!("send registration failed; streaming the rendezvous instead");
                }
            }
        }
        // Streaming through active messages: zero-copy from a registration when we have one on
        // the AM lane's domain, copy-in otherwise.
        let am_md = self.slots[self.peers[p].am].md;
        let put = matches!(&self.reqs[&sreq].kind, ReqKind::Send(s) if s.rndv.put.is_some());
        if !put && split {
            // The receiver reads the head from our registration while we could not write the
            // tail: stream the tail (copied in), keep every registration until its reads are
            // done, and finish after both (the receiver counts the tail's bytes).
            if let Some(Req {
                kind: ReqKind::Send(s),
                ..
            }) = self.reqs.get_mut(&sreq)
            {
                s.posted = offset;
                s.rndv.split_left = 2;
            }
            self.count("rendezvous split: tail streamed (no remote write)");
        } else if !put {
            let am = self.peers[p].am;
            let zc = self.slots[am].attr.has(IfaceCaps::AM_ZCOPY)
                && self.slots[am].attr.limits.am_max_hdr >= proto::FIRST_OVERHEAD;
            let am_name = self.ctx.domain(am_md).name().to_string();
            let may = self.may_register(am_md, MemoryType::Host, None);
            let r = self.reqs.get_mut(&sreq).expect("req");
            r.guards.retain(|g| g.registration().domain() == am_name);
            if zc && r.guards.is_empty() && may {
                if let Err(e) = self.register_send(sreq, am) {
                    tracing::debug!("streaming with copies: {e}");
                }
            } else if !zc {
                r.guards.clear();
            }
        }
        self.peers[p].queue.push_back(Pending::Stream(sreq));
        self.pump(p);
    }
}
