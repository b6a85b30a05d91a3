//! GPU memory: the zero-copy GPU lane, the staged pipeline through pinned host fragments (with
//! shared-memory staging on one host), the memory-type copy lane and small-message bounce buffers.

use super::*;
impl State {
    pub(super) fn copy_md(&self) -> Option<usize> {
        self.copy.as_ref().map(|(i, _)| self.slots[*i].md)
    }

    /// Register a user buffer with the copy lane's domain and make the key the copy lane's
    /// endpoint needs to reach it. The registration goes through the context (demotion,
    /// warning, GPU registration reuse) and is made for this request alone: the buffer belongs
    /// to a request of a scope, which keeps it allocated until the request finished, and the
    /// guard is dropped with the request.
    pub(super) fn copy_key(
        &self,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(RegGuard, RemoteKey)> {
        let mi = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: format!("copying {mem} memory"),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(mi, mem, dev)?;
        let g = self.ctx.register_uncached(
            mi,
            MemRegion {
                addr,
                len: len.max(1),
                mem_type: mem,
                device: dev,
            },
        )?;
        let md = self.ctx.domain(mi);
        let key = md.rkey_unpack(&md.mkey_pack(g.registration())?)?;
        Ok((g, key))
    }

    /// The copy lane's domain `mi` may still register `mem` memory of `dev` for its copies:
    /// once demoted there, fail at once with the reason and the knob rather than asking the
    /// driver again.
    fn copy_not_demoted(&self, mi: usize, mem: MemoryType, dev: Option<u32>) -> Result<()> {
        match self.ctx.demotion_of(mi, mem, dev) {
            None => Ok(()),
            Some(d) => Err(Error::Unsupported {
                what: format!(
                    "copying {mem} memory{} with {}",
                    dev.map(|d| format!(" of GPU {d}")).unwrap_or_default(),
                    d.md
                ),
                why: format!("{d}; {}", d.knob),
            }),
        }
    }

    /// The pinned staging fragments, made on first use.
    pub(super) fn ensure_staging(&mut self) -> Result<()> {
        if self.staging.is_some() {
            return Ok(());
        }
        let mi = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: "staging GPU memory".into(),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(mi, MemoryType::Host, None)?;
        let count = self.stage_count;
        let total = self.frag * count * 2;
        // Shared memory when a domain offers it: a receiver on this host then copies straight
        // from our fragments to its GPU (two DMA copies in all, no CPU copy).
        let mut shared = None;
        for d in 0..self.ctx.domain_count() {
            match self.ctx.domain(d).mem_alloc_shared(total) {
                Ok(Some(a)) => {
                    shared = Some((d, a));
                    break;
                }
                Ok(None) => {}
                Err(e) => tracing::debug!("shared staging from {}: {e}", self.ctx.domain(d).name()),
            }
        }
        let mem = if shared.is_some() {
            Vec::new()
        } else {
            // Fallible: a staging size the system cannot serve fails the transfer that asked.
            let mut m = Vec::new();
            m.try_reserve_exact(total).map_err(|e| {
                Error::NoMemory(format!(
                    "{total} bytes of GPU staging (RUCX_RNDV_FRAG_SIZE x 2 x RUCX_RNDV_FRAG_COUNT): {e}"
                ))
            })?;
            m.resize(total, 0);
            m
        };
        let base = shared
            .as_ref()
            .map_or(mem.as_ptr() as usize, |(_, a)| a.addr);
        // Registered for the staging alone (not cached: the memory goes with the worker). `mem`
        // (or the shared allocation) is stored in the same `Staging` after this handle (fields
        // drop in order), so the memory outlives the registration; it is never resized.
        let copy_memh = self
            .ctx
            .register_uncached(mi, MemRegion::host(base, total))?
            .registration()
            .clone();
        self.staging = Some(Staging {
            copy_memh,
            rma: FxHashMap::default(),
            frag: self.frag,
            free_send: (0..count).rev().collect(),
            free_recv: (count..2 * count).rev().collect(),
            base,
            shared,
            _mem: mem,
        });
        Ok(())
    }

    /// The staging memory registered with domain `mi`, and its packed key.
    pub(super) fn staging_reg(&mut self, mi: usize) -> Result<(MemHandle, NamedKey)> {
        self.ensure_staging()?;
        let stg = self.staging.as_ref().expect("staging");
        if let Some((g, k)) = stg.rma.get(&mi) {
            return Ok((g.registration().clone(), k.clone()));
        }
        let total = stg.frag * self.stage_count * 2;
        if let Some((d, a)) = &stg.shared
            && *d == mi
        {
            let md = self.ctx.domain(mi);
            let key = NamedKey {
                md: md.name().to_string(),
                key: md.mkey_pack(&a.memh)?,
            };
            let memh = a.memh.clone();
            self.staging
                .as_mut()
                .expect("staging")
                .rma
                .insert(mi, (RegGuard::Direct(memh.clone()), key.clone()));
            return Ok((memh, key));
        }
        let g = self.ctx.register(mi, MemRegion::host(stg.base, total))?;
        let md = self.ctx.domain(mi);
        let key = NamedKey {
            md: md.name().to_string(),
            key: md.mkey_pack(g.registration())?,
        };
        let memh = g.registration().clone();
        self.staging
            .as_mut()
            .expect("staging")
            .rma
            .insert(mi, (g, key.clone()));
        Ok((memh, key))
    }

    /// Record a posted operation of a pipeline.
    pub(super) fn post_tok(&mut self, req: u64, token: u64, st: OpStatus, what: TokWhat) {
        let tok = Tok { req, what };
        match st {
            OpStatus::InProgress => {
                self.tokens.insert(token, tok);
            }
            OpStatus::Done => self.done_q.push_back((tok, Ok(()))),
        }
    }

    /// A completion arrived (or an operation finished at once).
    pub(super) fn on_tok(&mut self, tok: Tok, result: Result<()>) {
        match tok.what {
            TokWhat::Plain => self.on_completion(tok.req, result),
            what => {
                // Give staging fragments back whatever happened.
                if result.is_err()
                    && let Some(stg) = self.staging.as_mut()
                {
                    match what {
                        TokWhat::StageD2H { frag, .. } => stg.free_send.push(frag),
                        TokWhat::PullGet { rfrag: Some(f), .. } | TokWhat::H2D { rfrag: f, .. } => {
                            stg.free_recv.push(f)
                        }
                        _ => {}
                    }
                }
                if result.is_err() && matches!(what, TokWhat::StageD2H { .. }) {
                    self.wake_staged_sends(tok.req, false);
                }
                if result.is_err() {
                    // A read or copy of an announced fragment failed: the sender may still
                    // reuse the fragment (we no longer need it).
                    if let TokWhat::PullGet {
                        sfrag: Some(sf), ..
                    }
                    | TokWhat::DirectH2D {
                        sfrag: Some(sf), ..
                    } = what
                    {
                        self.ack_fragment(sf);
                    }
                }
                match result {
                    Ok(()) => {
                        if let Err(e) = self.on_pipeline(tok.req, what) {
                            self.fail(tok.req, e);
                        }
                    }
                    Err(e) => self.fail(tok.req, e),
                }
            }
        }
    }

    pub(super) fn on_pipeline(&mut self, id: u64, what: TokWhat) -> Result<()> {
        match what {
            TokWhat::Plain => Ok(()),
            TokWhat::StageD2H { frag, off, len } => {
                // A fragment is staged: announce it to the receiver.
                let (p, rreq) = match self.reqs.get(&id) {
                    Some(Req {
                        kind:
                            ReqKind::Send(SendState {
                                peer,
                                stage: Some(st),
                                ..
                            }),
                        result: None,
                        ..
                    }) => (*peer, st.rreq),
                    // Ended meanwhile (aborted): the fragment is not announced.
                    _ => {
                        if let Some(stg) = self.staging.as_mut() {
                            stg.free_send.push(frag);
                        }
                        self.wake_staged_sends(id, false);
                        return Ok(());
                    }
                };
                let key = match self.peers[p]
                    .rma
                    .ok_or_else(|| Error::Unsupported {
                        what: "the staged pipeline".into(),
                        why: "no transport with remote memory access reaches the receiver".into(),
                    })
                    .and_then(|lane| self.staging_reg(self.slots[lane].md))
                {
                    Ok((_, key)) => key,
                    Err(e) => {
                        if let Some(stg) = self.staging.as_mut() {
                            stg.free_send.push(frag);
                        }
                        self.wake_staged_sends(id, false);
                        return Err(e);
                    }
                };
                let addr = self.staging.as_ref().expect("staging").addr(frag);
                self.send_msg(
                    p,
                    &Msg::Frag {
                        src: self.address.uuid,
                        rreq,
                        sreq: id,
                        offset: off as u64,
                        len: len as u64,
                        addr: addr as u64,
                        frag: frag as u64,
                        key,
                    },
                );
                self.pump(p);
                Ok(())
            }
            TokWhat::PullGet {
                off,
                len,
                sfrag,
                rfrag,
            } => {
                let (p, live) = match self.reqs.get(&id) {
                    Some(Req {
                        kind: ReqKind::Recv(RecvState { rndv: Some(rv), .. }),
                        result,
                        ..
                    }) => (rv.peer, result.is_none()),
                    _ => (usize::MAX, false),
                };
                if let Some(sf) = sfrag {
                    self.ack_fragment(sf);
                }
                if !live {
                    // The receive ended meanwhile: copy nothing more into its buffer.
                    if let (Some(f), Some(stg)) = (rfrag, self.staging.as_mut()) {
                        stg.free_recv.push(f);
                    }
                    return Ok(());
                }
                match rfrag {
                    Some(f) => {
                        // Into the GPU buffer: host staging -> device.
                        let (addr, key) = match &self.reqs[&id].kind {
                            ReqKind::Recv(RecvState {
                                addr,
                                dev_memh: Some(dm),
                                ..
                            }) => (*addr, dm.1.clone()),
                            _ => {
                                return Err(Error::Internal(
                                    "GPU receive without its copy key".into(),
                                ));
                            }
                        };
                        let stg = self.staging.as_ref().expect("staging");
                        let memh = stg.copy_memh.clone();
                        let iov = [Iov {
                            addr: stg.addr(f),
                            len,
                            memh: &memh,
                        }];
                        let token = self.next_token;
                        self.next_token += 1;
                        let ep = &mut self.copy.as_mut().expect("copy lane").1;
                        let st = loop {
                            match ep.put_zcopy(&iov, (addr + off) as u64, &key, token) {
                                Err(e) if e.is_retryable() => std::hint::spin_loop(),
                                other => break other,
                            }
                        };
                        match st {
                            Ok(st) => self.post_tok(id, token, st, TokWhat::H2D { rfrag: f, len }),
                            Err(e) => {
                                if let Some(stg) = self.staging.as_mut() {
                                    stg.free_recv.push(f);
                                }
                                return Err(e);
                            }
                        }
                    }
                    None => self.chunk_landed(id, len),
                }
                self.pump(p);
                Ok(())
            }
            TokWhat::DirectH2D { len, sfrag } => {
                if let Some(sf) = sfrag {
                    self.ack_fragment(sf);
                }
                self.chunk_landed(id, len);
                Ok(())
            }
            TokWhat::H2D { rfrag, len } => {
                if let Some(stg) = self.staging.as_mut() {
                    stg.free_recv.push(rfrag);
                }
                self.chunk_landed(id, len);
                // Chunks that waited for a fragment may go on; so may other receives.
                let waiting: Vec<(usize, u64)> = self
                    .reqs
                    .iter()
                    .filter_map(|(rid, r)| match &r.kind {
                        ReqKind::Recv(rs) if r.result.is_none() && !rs.chunks.is_empty() => {
                            rs.rndv.as_ref().map(|rv| (rv.peer, rid))
                        }
                        _ => None,
                    })
                    .collect();
                for (p, rid) in waiting {
                    if !self.peers[p]
                        .queue
                        .iter()
                        .any(|q| matches!(q, Pending::Stream(x) if *x == rid))
                    {
                        self.peers[p].queue.push_back(Pending::Stream(rid));
                    }
                    self.pump(p);
                }
                Ok(())
            }
        }
    }

    /// Tell a sender that its staging fragment is free again.
    pub(super) fn ack_fragment(&mut self, a: FragAck) {
        self.send_msg(
            a.peer,
            &Msg::FragAck {
                src: self.address.uuid,
                sreq: a.sreq,
                frag: a.frag,
                len: a.staged as u64,
            },
        );
        self.pump(a.peer);
    }

    /// Bytes of a chunked receive reached the user buffer; finish when all did.
    pub(super) fn chunk_landed(&mut self, id: u64, len: usize) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return;
        };
        rs.landed += len;
        rs.received = rs.landed;
        let want = rs.rndv.as_ref().map_or(rs.total, |r| r.want);
        if rs.landed >= want && rs.chunks.is_empty() {
            let (pull, p, sreq) = (
                rs.pull,
                rs.rndv.as_ref().map(|r| r.peer),
                rs.rndv.as_ref().map(|r| r.sreq),
            );
            if !pull && let (Some(p), Some(sreq)) = (p, sreq) {
                self.send_ats(p, sreq);
                self.pump(p);
            }
            self.complete_recv(id);
        }
    }

    /// A rendezvous that involves GPU memory on either side.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rndv_recv_gpu(
        &mut self,
        rid: u64,
        p: usize,
        sreq: u64,
        size: usize,
        saddr: u64,
        sgpu: bool,
        keys: Vec<NamedKey>,
    ) {
        let (raddr, cap, rmem, rdev) = match &self.reqs[&rid].kind {
            ReqKind::Recv(rs) => (rs.addr, rs.cap, rs.mem, rs.dev),
            _ => return,
        };
        let want = size.min(cap);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.rndv = Some(Box::new(RndvRecv::new(p, sreq, want)));
        }
        if let Some(reason) = self.peers[p].failed.clone() {
            let peer = self.peers[p].remote.describe();
            self.finish(rid, Err(Error::EndpointFailure { peer, reason }));
            return;
        }
        if want == 0 {
            self.send_ats(p, sreq);
            self.complete_recv(rid);
            self.pump(p);
            return;
        }
        let region = MemRegion {
            addr: raddr,
            len: want,
            mem_type: rmem,
            device: rdev,
        };
        // The plan's steps for this pair, in order.
        let rkey = MemKey::new(rmem, rdev);
        if rmem.is_gpu() {
            self.note_gpu_key(rkey);
        }
        self.refresh_plan(p);
        let smem = if sgpu {
            MemoryType::Cuda
        } else {
            MemoryType::Host
        };
        let plan = &self.peers[p].plan;
        let steps = plan::recv_steps(plan, smem, rkey).to_vec();
        let notes = plan
            .recv_plan(smem, rkey)
            .map(|r| r.notes.join("; "))
            .unwrap_or_default();
        let md_name = |st: &Self, lane: usize| st.ctx.domain(st.slots[lane].md).name().to_string();
        // 1. GPU to GPU, zero-copy through a lane whose domain registers GPU memory.
        if let Some(lane) = steps.iter().find_map(|s| match s {
            RecvStep::Get { lane } if sgpu && rmem.is_gpu() => Some(*lane),
            _ => None,
        }) && let Some(k) = keys.iter().find(|k| k.md == md_name(self, lane))
        {
            let md = self.slots[lane].md;
            if self.ctx.can_register(md, rmem, rdev) {
                match self.ctx.register(md, region) {
                    Ok(g) => match self.ctx.domain(md).rkey_unpack(&k.key) {
                        Ok(rkey) => {
                            self.count("rendezvous receive by read (GPU zero-copy)");
                            let r = self.reqs.get_mut(&rid).expect("req");
                            r.guards.push(g);
                            if let ReqKind::Recv(RecvState { rndv: Some(rv), .. }) = &mut r.kind {
                                rv.via_get = true;
                                rv.get = Some((lane, saddr, rkey, raddr));
                            }
                            self.peers[p].queue.push_back(Pending::Stream(rid));
                            self.pump(p);
                            return;
                        }
                        Err(e) => {
                            tracing::warn!("sender's GPU key did not unpack ({e}); staging instead")
                        }
                    },
                    Err(e) => {
                        tracing::debug!("GPU receive registration failed ({e}); staging instead")
                    }
                }
            }
        }
        // 2. Staged: read host memory (the sender's buffer, or its staging fragments).
        let Some(lane) = steps.iter().find_map(|s| match s {
            RecvStep::StagedRead { lane } | RecvStep::Pull { lane } => Some(*lane),
            _ => None,
        }) else {
            let e = Error::Unsupported {
                what: format!(
                    "receiving into {rmem} memory from {}",
                    self.peers[p].remote.describe()
                ),
                why: if notes.is_empty() {
                    "no path left for this pair of memory types".into()
                } else {
                    notes
                },
            };
            self.fail(rid, e);
            return;
        };
        let staged_read = steps.contains(&RecvStep::StagedRead { lane });
        let md = self.slots[lane].md;
        // The user buffer: host memory is read into directly; GPU memory through staging.
        if rmem.is_gpu() {
            match self
                .copy_key(raddr, cap, rmem, rdev)
                .and_then(|k| self.ensure_staging().map(|_| k))
            {
                Ok(k) => {
                    if let Some(Req {
                        kind: ReqKind::Recv(rs),
                        ..
                    }) = self.reqs.get_mut(&rid)
                    {
                        rs.dev_memh = Some(Box::new(k));
                    }
                }
                // No other path into this GPU buffer: end both sides with the reason.
                Err(e) => {
                    self.fail(rid, e);
                    return;
                }
            }
        } else {
            match self.ctx.register(md, region) {
                Ok(g) => self.reqs.get_mut(&rid).expect("req").guards.push(g),
                Err(e) => {
                    self.fail(rid, e);
                    return;
                }
            }
        }
        let host_md = md_name(self, lane);
        let host_key = keys.iter().find(|k| k.md == host_md);
        let r = self.reqs.get_mut(&rid).expect("req");
        let ReqKind::Recv(rs) = &mut r.kind else {
            return;
        };
        rs.chunk_lane = lane;
        if staged_read && let Some(k) = host_key {
            // Host sender with a key: read it in fragments (into staging, then to the GPU).
            match self.ctx.domain(md).rkey_unpack(&k.key) {
                Ok(rkey) => {
                    let frag = self
                        .frag
                        .min(self.slots[lane].attr.limits.get_max_zcopy.max(1));
                    let mut off = 0;
                    while off < want {
                        let n = frag.min(want - off);
                        rs.chunks.push_back(Chunk {
                            raddr: saddr + off as u64,
                            len: n,
                            off,
                            rkey: rkey.clone(),
                            sfrag: None,
                            local: None,
                        });
                        off += n;
                    }
                    self.count("rendezvous receive by read, staged to the GPU");
                    self.peers[p].queue.push_back(Pending::Stream(rid));
                    self.pump(p);
                    return;
                }
                Err(e) => tracing::warn!("sender's key did not unpack ({e}); asking it to stage"),
            }
        }
        // GPU sender (or no usable key): ask it to stage and announce fragments.
        rs.pull = true;
        self.count("rendezvous receive pipelined through host staging");
        self.send_msg(
            p,
            &Msg::Pull {
                src: self.address.uuid,
                sreq,
                rreq: rid,
            },
        );
        self.pump(p);
    }

    /// The receiver asked us to stage a (GPU) buffer.
    pub(super) fn on_pull(&mut self, p: usize, sreq: u64, rreq: u64) {
        let (addr, len, mem, dev) = match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: None,
                ..
            }) if s.peer == p => (s.addr, s.len, s.mem, s.dev),
            _ => {
                self.answer_for_gone_send(p, sreq, rreq);
                return;
            }
        };
        let staged = self
            .copy_key(addr, len, mem, dev)
            .and_then(|k| self.ensure_staging().map(|_| k));
        match staged {
            Ok((memh, key)) => {
                let r = self.reqs.get_mut(&sreq).expect("req");
                // A zero-copy registration made for the RTS is no longer needed.
                r.guards.clear();
                if let ReqKind::Send(s) = &mut r.kind {
                    s.stage = Some(Box::new(StageSend {
                        rreq,
                        next_off: 0,
                        acked: 0,
                        _dev_memh: memh,
                        dev_key: key,
                    }));
                    s.wait = SendWait::Posting;
                }
                self.peers[p].queue.push_back(Pending::Stream(sreq));
                self.pump(p);
            }
            // We cannot stage, and the receiver waits for fragments: end both sides.
            Err(e) => {
                if let Some(Req {
                    kind: ReqKind::Send(s),
                    ..
                }) = self.reqs.get_mut(&sreq)
                {
                    s.rndv_to = Some(rreq);
                }
                self.fail(sreq, e);
            }
        }
    }

    /// Stage the next fragments of a pipelined send (device -> pinned host).
    pub(super) fn stream_stage(&mut self, id: u64) -> Result<bool> {
        loop {
            let (addr, len, next_off) = match &self.reqs[&id].kind {
                ReqKind::Send(SendState {
                    addr,
                    len,
                    stage: Some(st),
                    ..
                }) => (*addr, *len, st.next_off),
                _ => return Ok(true),
            };
            if next_off >= len {
                return Ok(true);
            }
            let stg = self.staging.as_mut().expect("staging");
            let Some(f) = stg.free_send.pop() else {
                // Resumed when the receiver acknowledges a fragment.
                return Ok(true);
            };
            let limit = self.peers[p_of(&self.reqs[&id])]
                .rma
                .map_or(usize::MAX, |l| {
                    self.slots[l].attr.limits.get_max_zcopy.max(1)
                });
            let stg = self.staging.as_mut().expect("staging");
            let n = stg.frag.min(limit).min(len - next_off);
            let faddr = stg.addr(f);
            let memh = stg.copy_memh.clone();
            let key = match &self.reqs[&id].kind {
                ReqKind::Send(SendState {
                    stage: Some(st), ..
                }) => st.dev_key.clone(),
                _ => unreachable!("checked above"),
            };
            let iov = [Iov {
                addr: faddr,
                len: n,
                memh: &memh,
            }];
            let token = self.next_token;
            let ep = &mut self.copy.as_mut().expect("copy lane").1;
            match ep.get_zcopy(&iov, (addr + next_off) as u64, &key, token) {
                Ok(st) => {
                    self.next_token += 1;
                    self.post_tok(
                        id,
                        token,
                        st,
                        TokWhat::StageD2H {
                            frag: f,
                            off: next_off,
                            len: n,
                        },
                    );
                }
                Err(e) => {
                    self.staging.as_mut().expect("staging").free_send.push(f);
                    if e.is_retryable() {
                        return Ok(false);
                    }
                    self.wake_staged_sends(id, false);
                    return Err(e);
                }
            }
            if let Some(Req {
                kind:
                    ReqKind::Send(SendState {
                        stage: Some(st), ..
                    }),
                ..
            }) = self.reqs.get_mut(&id)
            {
                st.next_off += n;
            }
        }
    }

    /// A staged fragment of the sender is ready: queue its read.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_frag(
        &mut self,
        p: usize,
        rreq: u64,
        sreq: u64,
        off: usize,
        len: usize,
        addr: u64,
        frag: u64,
        key: NamedKey,
    ) {
        let rkey = match self.ctx.domain_index(&key.md) {
            Some(mi) => self.ctx.domain(mi).rkey_unpack(&key.key).map(|k| (mi, k)),
            None => Err(Error::InvalidRkey {
                domain: key.md.clone(),
                reason: "no such local domain".into(),
            }),
        };
        let (mi, rkey) = match rkey {
            Ok(k) => k,
            Err(e) => {
                // Only a live receive of this sender may be ended by its message.
                if self.reqs.get(&rreq).is_some_and(|r| {
                    matches!(&r.kind, ReqKind::Recv(RecvState { rndv: Some(rv), .. })
                        if rv.peer == p && rv.sreq == sreq)
                }) {
                    self.fail(rreq, e);
                }
                self.send_msg(
                    p,
                    &Msg::FragAck {
                        src: self.address.uuid,
                        sreq,
                        frag,
                        len: len as u64,
                    },
                );
                self.pump(p);
                return;
            }
        };
        if let Err(e) = self.chunk_lane_for(rreq, p, mi) {
            self.fail(rreq, e);
        }
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&rreq)
        else {
            // The receive is gone (canceled or failed): still release the sender's fragment.
            self.send_msg(
                p,
                &Msg::FragAck {
                    src: self.address.uuid,
                    sreq,
                    frag,
                    len: len as u64,
                },
            );
            self.pump(p);
            return;
        };
        // Never read past the receive buffer (truncation): acknowledge the rest unread. The
        // acknowledgement of a clamped chunk still carries the whole staged length.
        let want = rs.rndv.as_ref().map_or(0, |r| r.want);
        let n = len.min(want.saturating_sub(off));
        if n == 0 {
            self.send_msg(
                p,
                &Msg::FragAck {
                    src: self.address.uuid,
                    sreq,
                    frag,
                    len: len as u64,
                },
            );
            self.pump(p);
            return;
        }
        let gpu = rs.mem.is_gpu();
        let local = if gpu {
            self.map_fragment(mi, &rkey, addr)
        } else {
            None
        };
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rreq)
        else {
            return;
        };
        rs.chunks.push_back(Chunk {
            raddr: addr,
            len: n,
            off,
            rkey,
            sfrag: Some((frag, len)),
            local,
        });
        if !self.peers[p]
            .queue
            .iter()
            .any(|q| matches!(q, Pending::Stream(x) if *x == rreq))
        {
            self.peers[p].queue.push_back(Pending::Stream(rreq));
        }
        self.pump(p);
    }

    /// Fragments staged by the sender carry a key of its RMA lane's domain, which need not be
    /// the domain of our lane (a demotion on either side moves a lane): receive `rid` from peer
    /// `p` reads them through a connected lane of domain `mi`, its buffer registered there when
    /// it is read into directly (host memory).
    fn chunk_lane_for(&mut self, rid: u64, p: usize, mi: usize) -> Result<()> {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get(&rid)
        else {
            return Ok(());
        };
        if self.slots.get(rs.chunk_lane).is_some_and(|s| s.md == mi) {
            return Ok(());
        }
        let region = MemRegion {
            addr: rs.addr,
            len: rs.rndv.as_ref().map_or(rs.cap, |r| r.want),
            mem_type: rs.mem,
            device: rs.dev,
        };
        // A connected lane of that domain, else one that reaches the peer (connected by the
        // next progress; the reads wait for it).
        let reads = |l: usize| {
            self.slots[l].md == mi && self.slots[l].attr.caps.contains(IfaceCaps::GET_ZCOPY)
        };
        let lane = self.peers[p]
            .eps
            .keys()
            .copied()
            .find(|&l| reads(l))
            .or_else(|| {
                self.peers[p]
                    .targets
                    .iter()
                    .map(|(l, _)| *l)
                    .find(|&l| reads(l))
            })
            .ok_or_else(|| Error::Unsupported {
                what: format!(
                    "reading fragments staged with {}",
                    self.ctx.domain(mi).name()
                ),
                why: format!(
                    "no lane to {} reads with that domain",
                    self.peers[p].remote.describe()
                ),
            })?;
        self.want_lane(p, lane);
        let guard = if region.mem_type.is_gpu() {
            None
        } else {
            Some(self.ctx.register(mi, region)?)
        };
        let r = self.reqs.get_mut(&rid).expect("req");
        if let Some(g) = guard {
            r.guards.insert(0, g);
        }
        if let ReqKind::Recv(rs) = &mut r.kind {
            rs.chunk_lane = lane;
        }
        Ok(())
    }

    /// Have the progress loop connect `lane` to peer `p`, unless it is connected or asked for.
    fn want_lane(&mut self, p: usize, lane: usize) {
        let peer = &mut self.peers[p];
        if peer.eps.get_mut(&lane).is_none() && !peer.plan.wanted.contains(&lane) {
            peer.plan.wanted.push(lane);
            peer.needs_lanes = true;
        }
    }

    /// A send staging fragment came free: every staged send still waiting for one (but
    /// `except`) may go on. Queued on their peers, which the progress loop pumps, or pumped at
    /// once when `pump`.
    pub(super) fn wake_staged_sends(&mut self, except: u64, pump: bool) {
        let waiting: Vec<(usize, u64)> = self
            .reqs
            .iter()
            .filter_map(|(id, r)| match &r.kind {
                ReqKind::Send(s)
                    if r.result.is_none()
                        && id != except
                        && s.stage.as_ref().is_some_and(|st| st.next_off < s.len) =>
                {
                    Some((s.peer, id))
                }
                _ => None,
            })
            .collect();
        for (q, id) in waiting {
            if !self.peers[q]
                .queue
                .iter()
                .any(|x| matches!(x, Pending::Stream(y) if *y == id))
            {
                self.peers[q].queue.push_back(Pending::Stream(id));
            }
            if pump {
                self.pump(q);
            }
        }
    }

    /// The receiver read one of our staged fragments.
    pub(super) fn on_frag_ack(&mut self, sreq: u64, frag: usize, len: usize) {
        if let Some(stg) = self.staging.as_mut() {
            stg.free_send.push(frag);
        }
        // The send may have ended meanwhile (aborted): its fragments still come back.
        if let Some(Req {
            kind: ReqKind::Send(s),
            result: None,
            ..
        }) = self.reqs.get_mut(&sreq)
            && let Some(st) = &mut s.stage
        {
            st.acked += len;
            let (p, done, total, tag) = (s.peer, st.acked >= s.len, s.len, s.tag);
            if done {
                self.finish(
                    sreq,
                    Ok(Completion {
                        len: total,
                        tag,
                        sender: None,
                    }),
                );
            } else {
                self.peers[p].queue.push_back(Pending::Stream(sreq));
                self.pump(p);
            }
        }
        // Not only this one, which may just have finished or ended.
        self.wake_staged_sends(sreq, true);
    }

    /// Post reads of queued chunks: straight into a host buffer, or into receive staging for a
    /// GPU buffer (then copied on by the copy lane).
    pub(super) fn stream_chunks(&mut self, rid: u64) -> Result<bool> {
        loop {
            let r = &self.reqs[&rid];
            if r.result.is_some() {
                return Ok(true);
            }
            let ReqKind::Recv(rs) = &r.kind else {
                return Ok(true);
            };
            let Some(c) = rs.chunks.front() else {
                return Ok(true);
            };
            let (p, sreq) = rs.rndv.as_ref().map_or((0, 0), |v| (v.peer, v.sreq));
            let (lane, raddr, len, off, rkey) =
                (rs.chunk_lane, c.raddr, c.len, c.off, c.rkey.clone());
            let sfrag = c.sfrag.map(|(frag, staged)| FragAck {
                peer: p,
                sreq,
                frag,
                staged,
            });
            let gpu = rs.mem.is_gpu();
            let uaddr = rs.addr;
            if c.local.is_none()
                && self.peers[p].eps.get_mut(&lane).is_none()
                && self.peers[p].targets.iter().any(|(l, _)| *l == lane)
            {
                // Being connected (see `chunk_lane_for`).
                self.want_lane(p, lane);
                return Ok(false);
            }
            if gpu && let Some((laddr, lmemh)) = c.local.clone() {
                // The sender's fragment is mapped here: one DMA copy to the GPU.
                let key = match &rs.dev_memh {
                    Some(dm) => dm.1.clone(),
                    None => return Err(Error::Internal("GPU receive without its copy key".into())),
                };
                let iov = [Iov {
                    addr: laddr,
                    len,
                    memh: &lmemh,
                }];
                let token = self.next_token;
                let ep = &mut self.copy.as_mut().expect("copy lane").1;
                match ep.put_zcopy(&iov, (uaddr + off) as u64, &key, token) {
                    Ok(st) => {
                        self.next_token += 1;
                        if let Some(Req {
                            kind: ReqKind::Recv(rs),
                            ..
                        }) = self.reqs.get_mut(&rid)
                        {
                            rs.chunks.pop_front();
                        }
                        self.count("staged fragment copied to the GPU from shared memory");
                        self.post_tok(rid, token, st, TokWhat::DirectH2D { len, sfrag });
                        continue;
                    }
                    Err(e) if e.is_retryable() => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            let (iov_addr, memh, rfrag) = if gpu {
                let md = self.slots[lane].md;
                let (memh, _) = self.staging_reg(md)?;
                let stg = self.staging.as_mut().expect("staging");
                let Some(f) = stg.free_recv.pop() else {
                    // Resumed when a staging fragment frees up.
                    return Ok(true);
                };
                (stg.addr(f), memh, Some(f))
            } else {
                (uaddr + off, r.guards[0].registration().clone(), None)
            };
            let iov = [Iov {
                addr: iov_addr,
                len,
                memh: &memh,
            }];
            let token = self.next_token;
            let ep = self.peers[p]
                .eps
                .get_mut(&lane)
                .ok_or_else(|| Error::Internal("rma lane not connected".into()))?;
            match ep.get_zcopy(&iov, raddr, &rkey, token) {
                Ok(st) => {
                    self.next_token += 1;
                    if let Some(Req {
                        kind: ReqKind::Recv(rs),
                        ..
                    }) = self.reqs.get_mut(&rid)
                    {
                        rs.chunks.pop_front();
                    }
                    self.post_tok(
                        rid,
                        token,
                        st,
                        TokWhat::PullGet {
                            off,
                            len,
                            sfrag,
                            rfrag,
                        },
                    );
                }
                Err(e) => {
                    if let (Some(f), Some(stg)) = (rfrag, self.staging.as_mut()) {
                        stg.free_recv.push(f);
                    }
                    if e.is_retryable() {
                        return Ok(false);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Copy arrived eager bytes into GPU memory through the copy lane (small messages).
    pub(super) fn copy_to_gpu(&mut self, rid: u64, offset: usize, data: &[u8]) -> Result<()> {
        let (addr, cap, mem, dev) = match &self.reqs[&rid].kind {
            ReqKind::Recv(rs) => (rs.addr, rs.cap, rs.mem, rs.dev),
            _ => return Ok(()),
        };
        if !matches!(
            &self.reqs[&rid].kind,
            ReqKind::Recv(RecvState {
                dev_memh: Some(_),
                ..
            })
        ) {
            let k = self.copy_key(addr, cap, mem, dev)?;
            if let Some(Req {
                kind: ReqKind::Recv(rs),
                ..
            }) = self.reqs.get_mut(&rid)
            {
                rs.dev_memh = Some(Box::new(k));
            }
        }
        let key = match &self.reqs[&rid].kind {
            ReqKind::Recv(RecvState {
                dev_memh: Some(dm), ..
            }) => dm.1.clone(),
            _ => unreachable!("set above"),
        };
        let (ci, ep) = self.copy.as_mut().expect("copy_key checked the copy lane");
        let max = self.slots[*ci].attr.limits.put_max_short.max(1);
        let mut done = 0;
        while done < data.len() {
            let n = max.min(data.len() - done);
            loop {
                match ep.put_short(&data[done..done + n], (addr + offset + done) as u64, &key) {
                    Err(e) if e.is_retryable() => std::hint::spin_loop(),
                    other => break other?,
                }
            }
            done += n;
        }
        Ok(())
    }
}

impl State {
    /// Map a peer's staging fragment into this process when its domain allows (shared memory on
    /// this host), registered with the copy lane once per mapping. `None`: read it instead.
    pub(super) fn map_fragment(
        &mut self,
        mi: usize,
        rkey: &RemoteKey,
        addr: u64,
    ) -> Option<(usize, MemHandle)> {
        let base = match self.ctx.domain(mi).rkey_ptr(rkey) {
            Ok(Some(b)) => b,
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!("cannot map the peer's staging ({e}); reading it instead");
                return None;
            }
        };
        let memh = match self.mapped.get(&base) {
            Some(h) => h.clone(),
            None => {
                let cmd = self.copy_md()?;
                self.copy_not_demoted(cmd, MemoryType::Host, None).ok()?;
                // Registered for this mapping alone (not cached): the domain keeps the peer's
                // segment mapped until it is dropped, which is after this worker (the context
                // outlives its workers), and the mapping covers the key's whole region.
                let h = self
                    .ctx
                    .register_uncached(cmd, MemRegion::host(base, rkey.len() as usize))
                    .map(|g| g.registration().clone());
                match h {
                    Ok(h) => {
                        self.mapped.insert(base, h.clone());
                        h
                    }
                    Err(e) => {
                        tracing::debug!("cannot register the mapped staging for copies ({e})");
                        return None;
                    }
                }
            }
        };
        Some((base + (addr - rkey.base()) as usize, memh))
    }
}
