//! The receiver's path for a rendezvous that involves GPU memory on either side: the plan's
//! steps for the pair of memory types (`plan::recv_steps`), tried in the plan's order, each
//! falling through to the next when its registration or key fails (GPU zero-copy read, remote
//! write by a host sender, staged read of a host sender, staged pipeline). The choice is
//! [`RndvRecv::start_gpu`], over [`StageIo`]; the worker builds [`GpuRecvChoice`] from its plan
//! and dispatches.

use rucx_ucs::Error;
use rucx_uct::MemRegion;

use super::stage_io::StageIo;
use super::{Chunk, StagedNext};
use crate::plan::RecvStep;
use crate::proto::rndv::{Reads, RndvRecv};
use crate::wire::{Msg, NamedKey};

/// A lane one of the plan's steps names, as the receive needs it.
#[derive(Clone, Debug)]
pub(crate) struct StepLane {
    pub(crate) lane: usize,
    /// Its domain.
    pub(crate) md: usize,
    /// Which of the sender's keys is of that domain (both sides' lanes share it).
    pub(crate) key: Option<usize>,
    /// Most bytes one read on it moves.
    pub(crate) max_get: usize,
}

/// What the plan offers a GPU rendezvous receive, and what the request to send brought.
pub(crate) struct GpuRecvChoice<'a> {
    /// The plan's steps for (sender memory, receiver memory), in order.
    pub(crate) steps: &'a [RecvStep],
    /// The lanes the steps name.
    pub(crate) lanes: Vec<StepLane>,
    /// Why the plan has no step for this pair (empty: no reason recorded).
    pub(crate) notes: String,
    /// The peer, described (for errors).
    pub(crate) peer_name: String,
    /// The sender's keys (its registrations, named by domain; markers included).
    pub(crate) keys: &'a [NamedKey],
    /// The sender's buffer is GPU memory.
    pub(crate) sgpu: bool,
    /// The sender's buffer.
    pub(crate) saddr: u64,
    /// The receive buffer's bytes wanted (`want` of the rendezvous).
    pub(crate) region: MemRegion,
    /// The receive buffer's capacity (its copy-lane registration covers all of it).
    pub(crate) cap: usize,
    /// Fragment size for reads of a host sender's buffer.
    pub(crate) frag: usize,
}

impl GpuRecvChoice<'_> {
    fn lane(&self, lane: usize) -> Option<&StepLane> {
        self.lanes.iter().find(|l| l.lane == lane)
    }

    fn key(&self, lane: usize) -> Option<&NamedKey> {
        self.lane(lane).and_then(|l| l.key).map(|i| &self.keys[i])
    }
}

impl RndvRecv {
    /// Start a rendezvous receive (request `rid`) that involves GPU memory: the first of the
    /// plan's steps that works. `Post`: reads are to be posted; `Wait`: the sender was answered
    /// (it writes, or stages and announces fragments); `Fail`: no step is left (both sides end).
    pub(crate) fn start_gpu(
        &mut self,
        io: &mut impl StageIo,
        rid: u64,
        c: &GpuRecvChoice<'_>,
    ) -> StagedNext {
        let r = c.region;
        self.staged.dst = r.addr;
        self.staged.mem = r.mem_type;
        self.staged.dev = r.device;
        for step in c.steps {
            let started = match *step {
                // From GPU memory, zero-copy through a lane whose domain registers GPU memory:
                // into GPU memory registered with that domain, or into host memory the domain
                // only describes (a device-to-host copy out of the mapped sender's buffer).
                RecvStep::Get { lane } if c.sgpu => self
                    .start_gpu_get(io, rid, c, lane)
                    .then_some(StagedNext::Post),
                // From host memory into GPU memory: the sender writes through the zero-copy GPU
                // lane's mapping of our buffer (when it offered to).
                RecvStep::Put { lane } if !c.sgpu && r.mem_type.is_gpu() => io
                    .gpu_write_key(rid, self.peer, r, lane, c.keys, false)
                    .map(|key| {
                        self.rtr(io, rid, Some((r.addr as u64, 0, key)));
                        StagedNext::Wait
                    }),
                // From GPU memory on the GPU of ours, the sender being the pair's copier: it
                // writes into our buffer (when it offered to), so that it issues every copy.
                RecvStep::SharedGpuWrite { lane } if c.sgpu && r.mem_type.is_gpu() => io
                    .gpu_write_key(rid, self.peer, r, lane, c.keys, true)
                    .map(|key| {
                        self.rtr(io, rid, Some((r.addr as u64, 0, key)));
                        StagedNext::Wait
                    }),
                // Staged through host memory: the sender's buffer read in fragments, or its
                // staging fragments as it announces them.
                RecvStep::StagedRead { lane } | RecvStep::Pull { lane } => {
                    let staged_read = c.steps.contains(&RecvStep::StagedRead { lane });
                    Some(self.start_staged(io, rid, c, lane, staged_read))
                }
                _ => None,
            };
            if let Some(next) = started {
                return next;
            }
        }
        StagedNext::Fail(Error::Unsupported {
            what: format!("receiving into {} memory from {}", r.mem_type, c.peer_name),
            why: if c.notes.is_empty() {
                "no path left for this pair of memory types".into()
            } else {
                c.notes.clone()
            },
        })
    }

    /// The zero-copy read of a GPU sender's buffer on `lane`; false when its registration or
    /// the sender's key fails (the next step is tried).
    fn start_gpu_get(
        &mut self,
        io: &mut impl StageIo,
        rid: u64,
        c: &GpuRecvChoice<'_>,
        lane: usize,
    ) -> bool {
        let (Some(l), Some(k)) = (c.lane(lane), c.key(lane)) else {
            return false;
        };
        let r = c.region;
        if r.mem_type.is_gpu() && !io.may_register(l.md, r.mem_type, r.device) {
            return false;
        }
        // Host memory is registered for this request alone, never cached: nothing may outlive
        // a host buffer that is freed.
        let local = if r.mem_type.is_gpu() {
            io.register_md(l.md, r)
        } else {
            io.register_uncached(l.md, r)
        };
        let g = match local {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!("GPU receive registration failed ({e}); staging instead");
                return false;
            }
        };
        match io.unpack_key(l.md, &k.key) {
            Ok(rkey) => {
                io.count("rendezvous receive by read (GPU zero-copy)");
                // First: the read's local handle (a host buffer may hold another domain's
                // registration already, e.g. the one that typed it).
                let memh = g.registration().clone();
                io.keep(rid, g, true);
                self.via_get = true;
                self.get = Some(Reads {
                    lane,
                    remote: c.saddr,
                    rkey,
                    local: r.addr,
                    memh,
                });
                true
            }
            Err(e) => {
                tracing::warn!("sender's GPU key did not unpack ({e}); staging instead");
                false
            }
        }
    }

    /// Staged on `lane`: a GPU buffer gets its copy-lane key (no other path into it is left
    /// when that fails: both sides end), a host buffer its registration there (when that fails
    /// the first fragment decides how fragments are read: `read_lane_for`). A host sender's
    /// keyed buffer is then read in fragments (`staged_read`), else the sender is asked to
    /// stage and announce fragments (PULL).
    fn start_staged(
        &mut self,
        io: &mut impl StageIo,
        rid: u64,
        c: &GpuRecvChoice<'_>,
        lane: usize,
        staged_read: bool,
    ) -> StagedNext {
        let r = c.region;
        let md = io.lane_md(lane);
        let mut registered = true;
        if r.mem_type.is_gpu() {
            let whole = MemRegion { len: c.cap, ..r };
            match io.gpu_copy_key(rid, whole) {
                Ok(k) => self.staged.copy_key = Some(k),
                Err(e) => return StagedNext::Fail(e),
            }
        } else if !io.may_register(md, r.mem_type, r.device) {
            registered = false;
        } else {
            match io.register_md(md, r) {
                Ok(g) => {
                    self.staged.reg = Some(g.registration().clone());
                    io.keep(rid, g, false);
                }
                Err(e) => {
                    // Not the end of this receive: the sender stages (a host buffer is only
                    // ever received from a GPU sender here), and the first fragment finds a
                    // lane of its key's domain that registers this buffer, or reads through
                    // our receive staging.
                    tracing::debug!(
                        "host receive registration failed ({e}); continuing without it"
                    );
                    registered = false;
                }
            }
        }
        if registered {
            self.staged.lane = lane;
        }
        if registered
            && staged_read
            && let Some(k) = c.key(lane)
        {
            // Host sender with a key: read it in fragments (into staging, then to the GPU).
            match io.unpack_key(md, &k.key) {
                Ok(rkey) => {
                    let max = c.lane(lane).map_or(usize::MAX, |l| l.max_get);
                    let frag = c.frag.min(max.max(1));
                    let want = self.want;
                    let mut off = 0;
                    while off < want {
                        let n = frag.min(want - off);
                        self.staged.chunks.push_back(Chunk {
                            raddr: c.saddr + off as u64,
                            len: n,
                            off,
                            rkey: rkey.clone(),
                            sfrag: None,
                            local: None,
                        });
                        off += n;
                    }
                    io.count("rendezvous receive by read, staged to the GPU");
                    return StagedNext::Post;
                }
                Err(e) => tracing::warn!("sender's key did not unpack ({e}); asking it to stage"),
            }
        }
        // GPU sender (or no usable key): ask it to stage and announce fragments.
        self.staged.pull = true;
        io.count("rendezvous receive pipelined through host staging");
        io.ctrl(
            self.peer,
            &Msg::Pull {
                src: io.uuid(),
                sreq: self.sreq,
                rreq: rid,
            },
        );
        StagedNext::Wait
    }
}

/// The worker's side: build the choice from the plan, run it, dispatch.
mod worker {
    use super::StepLane;
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
            let steps = plan::recv_steps(&self.peers[p].plan, smem, rkey).to_vec();
            let lanes = steps
                .iter()
                .filter_map(|s| s.lane())
                .map(|lane| {
                    let md = self.slots[lane].md;
                    let name = self.ctx.domain(md).name();
                    StepLane {
                        lane,
                        md,
                        key: keys.iter().position(|k| k.md == name),
                        max_get: self.slots[lane].attr.limits.get_max_zcopy,
                    }
                })
                .collect();
            let notes = self.peers[p]
                .plan
                .recv_plan(smem, rkey)
                .map(|r| r.notes.join("; "))
                .unwrap_or_default();
            let choice = GpuRecvChoice {
                steps: &steps,
                lanes,
                notes,
                peer_name: self.peers[p].remote.describe(),
                keys: &keys,
                sgpu,
                saddr,
                region: MemRegion {
                    addr: raddr,
                    len: want,
                    mem_type: rmem,
                    device: rdev,
                },
                cap,
                frag: self.frag,
            };
            self.staged_step(rid, |rv, io| rv.start_gpu(io, rid, &choice));
            // A registration that failed demoted its domain (or refused the buffer): re-plan.
            self.refresh_plan(p);
            self.pump(p);
        }
    }
}
