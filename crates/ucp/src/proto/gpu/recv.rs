//! The receiver's choice for a rendezvous that involves GPU memory on either side: the plan's
//! steps in order (GPU zero-copy read, staged read of a host sender, staged pipeline).

use crate::worker::prelude::*;

impl State {
    /// A rendezvous that involves GPU memory on either side.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rndv_recv_gpu(
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
            rs.proto = RecvProto::Rndv(Box::new(RndvRecv::new(p, sreq, want)));
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
        // What this receive needs of the plan's steps (read in place, not copied).
        let steps = plan::recv_steps(&self.peers[p].plan, smem, rkey);
        let gpu_get = steps.iter().find_map(|s| match s {
            RecvStep::Get { lane } if sgpu => Some(*lane),
            _ => None,
        });
        let put_lane = steps.iter().find_map(|s| match s {
            RecvStep::Put { lane } => Some(*lane),
            _ => None,
        });
        let staged = steps.iter().find_map(|s| match s {
            RecvStep::StagedRead { lane } | RecvStep::Pull { lane } => {
                Some((*lane, steps.contains(&RecvStep::StagedRead { lane: *lane })))
            }
            _ => None,
        });
        // The sender's key for a lane: the one its domain (the lane's, on both sides) packed.
        let key_of = |st: &Self, lane: usize| {
            let md = st.ctx.domain(st.slots[lane].md).name();
            keys.iter().position(|k| k.md == md)
        };
        // 1. From GPU memory, zero-copy through a lane whose domain registers GPU memory: into
        // GPU memory registered with that domain, or into host memory the domain only
        // describes (a device-to-host copy out of the mapped sender's buffer; registered for
        // this request alone, never cached: nothing may outlive a host buffer that is freed).
        if let Some(lane) = gpu_get
            && let Some(k) = key_of(self, lane).map(|i| &keys[i])
        {
            let md = self.slots[lane].md;
            if !rmem.is_gpu() || self.may_register(md, rmem, rdev) {
                let local = if rmem.is_gpu() {
                    self.register_md(md, region)
                } else {
                    self.ctx.register_uncached(md, region)
                };
                match local {
                    Ok(g) => match self.ctx.domain(md).rkey_unpack(&k.key) {
                        Ok(rkey) => {
                            self.count("rendezvous receive by read (GPU zero-copy)");
                            let r = self.reqs.get_mut(&rid).expect("req");
                            // First: the read's local handle (a host buffer may hold another
                            // domain's registration already, e.g. the one that typed it).
                            r.guards.insert(0, g);
                            if let ReqKind::Recv(RecvState {
                                proto: RecvProto::Rndv(rv),
                                ..
                            }) = &mut r.kind
                            {
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
        // 1b. From host memory into GPU memory: the sender writes through the zero-copy GPU
        // lane's mapping of our buffer (when it offered to).
        if !sgpu
            && rmem.is_gpu()
            && let Some(lane) = put_lane
            && self.gpu_write_offer(rid, p, sreq, region, lane, &keys)
        {
            return;
        }
        // 2. Staged: read host memory (the sender's buffer, or its staging fragments).
        let Some((lane, staged_read)) = staged else {
            let notes = self.peers[p]
                .plan
                .recv_plan(smem, rkey)
                .map(|r| r.notes.join("; "))
                .unwrap_or_default();
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
        let md = self.slots[lane].md;
        let mut registered = true;
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
        } else if !self.may_register(md, rmem, rdev) {
            registered = false;
        } else if let Err(e) = self.register_md(md, region).map(|g| {
            self.reqs.get_mut(&rid).expect("req").guards.push(g);
        }) {
            // Not the end of this receive: the sender stages (a host buffer is only ever
            // received from a GPU sender here), and the first fragment decides how its
            // fragments are read: through a lane of their key's domain that can register this
            // buffer, or through our receive staging (`chunk_lane_for`). Only when neither is
            // left do both sides end.
            tracing::debug!("host receive registration failed ({e}); continuing without it");
            self.refresh_plan(p);
            registered = false;
        }
        let host_key = key_of(self, lane).map(|i| &keys[i]);
        let r = self.reqs.get_mut(&rid).expect("req");
        let ReqKind::Recv(RecvState {
            proto: RecvProto::Rndv(rv),
            ..
        }) = &mut r.kind
        else {
            return;
        };
        let sr = &mut rv.staged;
        if registered {
            sr.lane = lane;
        }
        if registered
            && staged_read
            && let Some(k) = host_key
        {
            // Host sender with a key: read it in fragments (into staging, then to the GPU).
            match self.ctx.domain(md).rkey_unpack(&k.key) {
                Ok(rkey) => {
                    let frag = self
                        .frag
                        .min(self.slots[lane].attr.limits.get_max_zcopy.max(1));
                    let mut off = 0;
                    while off < want {
                        let n = frag.min(want - off);
                        sr.chunks.push_back(Chunk {
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
        sr.pull = true;
        self.count("rendezvous receive pipelined through host staging");
        self.ctrl(
            p,
            &Msg::Pull {
                src: self.address.uuid,
                sreq,
                rreq: rid,
            },
        );
        self.pump(p);
    }
}
