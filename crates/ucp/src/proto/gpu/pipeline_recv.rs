//! The staged pipeline, receiver side: announced fragments (or a host sender's buffer) read in
//! chunks over a host RMA lane, into the host buffer or through receive staging to the GPU, each
//! acknowledged so the sender reuses it.

use crate::worker::prelude::*;

/// Most bytes of consecutive mapped fragments copied to the GPU at once.
const MERGE_BYTES: usize = 4 << 20;

/// A piece of a rendezvous receive to read.
pub(crate) struct Chunk {
    pub(crate) raddr: u64,
    pub(crate) len: usize,
    pub(crate) off: usize,
    pub(crate) rkey: RemoteKey,
    /// Staging fragment of the sender to acknowledge once read, and the length it staged there
    /// (more than `len` when the receive buffer is smaller: the sender counts acknowledged
    /// bytes against its whole message).
    pub(crate) sfrag: Option<(u64, usize)>,
    /// The remote fragment mapped into this process (shared memory), with its registration
    /// on the copy lane: copied straight to the GPU, without a read into local staging.
    pub(crate) local: Option<(usize, MemHandle)>,
}

impl State {
    pub(crate) fn on_pipeline(&mut self, id: u64, what: TokWhat) -> Result<()> {
        match what {
            TokWhat::Plain => Ok(()),
            TokWhat::StageD2H { frag, off, len } => {
                // A fragment is staged: announce it to the receiver.
                let staged = match self.reqs.get(&id) {
                    Some(Req {
                        kind: ReqKind::Send(s),
                        result: None,
                        ..
                    }) => s.stage().map(|st| (s.peer, st.rreq, st.lane)),
                    _ => None,
                };
                let (p, rreq, lane) = match staged {
                    Some(x) => x,
                    // Ended meanwhile (aborted): the fragments are not announced.
                    _ => {
                        if let Some(stg) = self.staging.as_mut() {
                            stg.release_send(frag, len);
                        }
                        self.wake_staged_sends(id, false);
                        return Ok(());
                    }
                };
                let key = match lane
                    .ok_or_else(|| Error::Unsupported {
                        what: "the staged pipeline".into(),
                        why: "no transport with remote memory access reaches the receiver".into(),
                    })
                    .and_then(|lane| self.staging_reg(self.slots[lane].md))
                {
                    Ok((_, key)) => key,
                    Err(e) => {
                        if let Some(stg) = self.staging.as_mut() {
                            stg.release_send(frag, len);
                        }
                        self.wake_staged_sends(id, false);
                        return Err(e);
                    }
                };
                // One announcement per fragment of the run (each read and acknowledged on
                // its own, whatever the receiver's fragment size).
                let stg = self.staging.as_ref().expect("staging");
                let fsz = stg.frag;
                let pieces: Vec<(usize, usize, usize)> = (0..len.div_ceil(fsz).max(1))
                    .map(|i| {
                        let n = if len <= fsz {
                            len
                        } else {
                            fsz.min(len - i * fsz)
                        };
                        (frag + i, i * fsz, n)
                    })
                    .collect();
                for (f, at, n) in pieces {
                    let addr = self.staging.as_ref().expect("staging").addr(f);
                    self.ctrl(
                        p,
                        &Msg::Frag {
                            src: self.address.uuid,
                            rreq,
                            sreq: id,
                            offset: (off + at) as u64,
                            len: n as u64,
                            addr: addr as u64,
                            frag: f as u64,
                            key: key.clone(),
                        },
                    );
                }
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
                        kind:
                            ReqKind::Recv(RecvState {
                                proto: RecvProto::Rndv(rv),
                                ..
                            }),
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
                    Some(f) if matches!(&self.reqs[&id].kind, ReqKind::Recv(rs) if rs.staged().is_some_and(|s| s.staged_host)) =>
                    {
                        // Into a host buffer no lane could register: copied from staging.
                        let uaddr = match &self.reqs[&id].kind {
                            ReqKind::Recv(rs) => rs.addr,
                            _ => unreachable!("matched above"),
                        };
                        let from = self.staging.as_ref().expect("staging").addr(f);
                        // SAFETY: `from..from + len` is our receive staging fragment `f`, which
                        // the completed read filled and which is not reused before it is freed
                        // below; the destination is the receive buffer, lent mutably to the
                        // scope and alive and unaliased while the request has not ended (it is
                        // live), and chunks never pass it (`off + len <= want <= cap`).
                        unsafe {
                            host_slice_mut(uaddr + off, len).copy_from_slice(host_slice(from, len))
                        };
                        return self.on_pipeline(id, TokWhat::H2D { rfrag: f, len });
                    }
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
                        ReqKind::Recv(RecvState {
                            proto: RecvProto::Rndv(rv),
                            ..
                        }) if r.result.is_none() && !rv.staged.chunks.is_empty() => {
                            Some((rv.peer, rid))
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
    pub(crate) fn ack_fragment(&mut self, a: FragAck) {
        self.ctrl(
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
    pub(crate) fn chunk_landed(&mut self, id: u64, len: usize) {
        let (want, p) = match self.reqs.get(&id) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => match rs.rndv() {
                Some(rv) => (rs.want(), rv.peer),
                None => return,
            },
            _ => return,
        };
        self.rndv_recv_step(id, |rv, io| rv.chunk_landed(io, len, want));
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&id)
            && let Some(landed) = rs.staged().map(|s| s.landed)
        {
            rs.received = landed;
        }
        self.pump(p);
    }

    /// A pipelined receive ended early: hand the sender back the staging fragments it announced
    /// and we will not read (it reuses them for other transfers).
    pub(crate) fn release_chunks(&mut self, id: u64) {
        let p = match self.reqs.get(&id) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                ..
            }) => match rs.rndv() {
                Some(rv) if !rv.staged.chunks.is_empty() => rv.peer,
                _ => return,
            },
            _ => return,
        };
        self.rndv_recv_step(id, |rv, io| {
            rv.release_chunks(io);
            RecvNext::Wait
        });
        self.pump(p);
    }

    /// A staged fragment of the sender is ready: queue its read.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_frag(
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
                    matches!(&r.kind, ReqKind::Recv(RecvState { proto: RecvProto::Rndv(rv), .. })
                        if rv.peer == p && rv.sreq == sreq)
                }) {
                    self.fail(rreq, e);
                }
                self.ctrl(
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
            self.ctrl(
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
        let want = rs.rndv().map_or(0, |r| r.want);
        let n = len.min(want.saturating_sub(off));
        if n == 0 {
            self.ctrl(
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
        let Some(sr) = rs.staged_mut() else {
            return;
        };
        sr.chunks.push_back(Chunk {
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
        // Posted when this progress call has handled every message that arrived (the
        // progress loop pumps each peer's queue after its interfaces' events): fragments
        // announced together are then copied together (see `stream_chunks`).
    }

    /// Fragments staged by the sender carry a key of its RMA lane's domain, which need not be
    /// the domain of our lane (a demotion on either side moves a lane): receive `rid` from peer
    /// `p` reads them through a connected lane of domain `mi`, its buffer registered there when
    /// it is read into directly (host memory).
    pub(crate) fn chunk_lane_for(&mut self, rid: u64, p: usize, mi: usize) -> Result<()> {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get(&rid)
        else {
            return Ok(());
        };
        if self
            .slots
            .get(rs.staged().map_or(usize::MAX, |s| s.lane))
            .is_some_and(|s| s.md == mi)
        {
            return Ok(());
        }
        let region = MemRegion {
            addr: rs.addr,
            len: rs.rndv().map_or(rs.cap, |r| r.want),
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
        let mut guard = None;
        let mut staged_host = false;
        if !region.mem_type.is_gpu() {
            let reg = if self.may_register(mi, region.mem_type, region.device) {
                self.register_md(mi, region)
            } else {
                Err(Error::Unsupported {
                    what: format!(
                        "registering a receive buffer with {}",
                        self.ctx.domain(mi).name()
                    ),
                    why: "the domain is demoted for host memory".into(),
                })
            };
            match reg {
                Ok(g) => guard = Some(g),
                // The buffer cannot be read into directly: read into receive staging (which
                // that domain registers apart) and copy on; when even that fails, no path is
                // left.
                Err(e) => {
                    tracing::debug!("receive buffer not registered ({e}); reading through staging");
                    self.ensure_staging()?;
                    self.staging_reg(mi)?;
                    staged_host = true;
                    self.count("rendezvous receive staged into host memory");
                }
            }
        }
        let r = self.reqs.get_mut(&rid).expect("req");
        if let Some(g) = guard {
            r.guards.insert(0, g);
        }
        if let ReqKind::Recv(rs) = &mut r.kind
            && let Some(sr) = rs.staged_mut()
        {
            sr.lane = lane;
            sr.staged_host = staged_host;
        }
        Ok(())
    }

    /// Post reads of queued chunks: straight into a host buffer, or into receive staging for a
    /// GPU buffer (then copied on by the copy lane).
    pub(crate) fn stream_chunks(&mut self, rid: u64) -> Result<bool> {
        loop {
            let r = &self.reqs[&rid];
            if r.result.is_some() {
                return Ok(true);
            }
            let ReqKind::Recv(rs) = &r.kind else {
                return Ok(true);
            };
            let Some(rv) = rs.rndv() else {
                return Ok(true);
            };
            let Some(c) = rv.staged.chunks.front() else {
                return Ok(true);
            };
            let (p, sreq) = (rv.peer, rv.sreq);
            let (lane, raddr, len, off, rkey) =
                (rv.staged.lane, c.raddr, c.len, c.off, c.rkey.clone());
            let sfrag = c.sfrag.map(|(frag, staged)| FragAck {
                peer: p,
                sreq,
                frag,
                staged,
            });
            let gpu = rs.mem.is_gpu();
            let staged = gpu || rv.staged.staged_host;
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
                // The sender's fragment is mapped here: one DMA copy to the GPU, for it and the
                // fragments queued behind it that continue it in both the mapping and the
                // buffer (consecutive fragments of the sender's staging, each whole but the
                // last): one copy, one completion, one acknowledgement for them all.
                let key = match &rs.dev_memh {
                    Some(dm) => dm.1.clone(),
                    None => return Err(Error::Internal("GPU receive without its copy key".into())),
                };
                let (mut len, mut k, mut sfrag) = (len, 1usize, sfrag);
                if let Some(first) = sfrag {
                    let whole = first.staged;
                    let mut last_whole = c.len == whole;
                    for d in rv.staged.chunks.iter().skip(1) {
                        let next = match (d.local.as_ref(), d.sfrag) {
                            (Some((a, _)), Some((f, st)))
                                if last_whole
                                    && *a == laddr + len
                                    && d.off == off + len
                                    && f == first.frag + k as u64
                                    && st <= whole
                                    && len + d.len <= MERGE_BYTES =>
                            {
                                (d.len, st)
                            }
                            _ => break,
                        };
                        len += next.0;
                        k += 1;
                        last_whole = next.0 == whole && next.1 == whole;
                        if let Some(s) = sfrag.as_mut() {
                            s.staged += next.1;
                        }
                    }
                }
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
                            && let Some(sr) = rs.staged_mut()
                        {
                            sr.chunks.drain(..k);
                        }
                        self.count("staged fragment copied to the GPU from shared memory");
                        if k > 1 {
                            self.count("staged fragments copied to the GPU in runs");
                        }
                        self.post_tok(rid, token, st, TokWhat::DirectH2D { len, sfrag });
                        continue;
                    }
                    Err(e) if e.is_retryable() => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            let (iov_addr, memh, rfrag) = if staged {
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
                        && let Some(sr) = rs.staged_mut()
                    {
                        sr.chunks.pop_front();
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
}
