//! Remote memory access requests (put, get, flush on an endpoint) and the fragmented zero-copy
//! transfers that rendezvous reads and writes use too.
//!
//! A put or get takes the first step of the endpoint's plan for its pair of memory types
//! ([`plan::RmaPlan`]) that works now: zero-copy on a lane that reaches both buffers (host RMA;
//! cuda_ipc, whose copy engine reads or writes the peer's mapped GPU buffer from local GPU or
//! host memory), else staged through pinned host memory of the request (the copy lane moves
//! between the local GPU buffer and the staging, the lane moves the staging to or from the
//! remote region). A registration that fails on the way (and demotes its domain, one warning)
//! sends the request on to the next step; with none left it ends with the error.

use crate::plan::RmaStep;
use crate::worker::prelude::*;

/// Staging fragments a staged put or get keeps in flight per wave.
const STAGED_FRAGS: usize = 4;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum RmaDir {
    Put,
    Get,
    Flush,
}

pub(crate) struct RmaState {
    pub(crate) peer: usize,
    pub(crate) dir: RmaDir,
    pub(crate) len: usize,
    pub(crate) lane: usize,
    pub(crate) addr: usize,
    pub(crate) remote: u64,
    pub(crate) key: Option<RemoteKey>,
    pub(crate) posted: usize,
    /// Lanes still to flush (flush requests).
    pub(crate) flush_lanes: Vec<usize>,
    /// A put or get staged through pinned host memory (`None`: zero-copy).
    pub(crate) staged: Option<Box<StagedRma>>,
}

/// Host memory of a staged put or get.
struct StagingBuf(Vec<u8>);

/// The state of a put or get staged through pinned host memory, in waves of up to
/// [`STAGED_FRAGS`] fragments: a put copies the wave out of the GPU (copy lane), then writes
/// it (remote lane); a get reads it (remote lane), then copies it into the GPU (copy lane).
pub(crate) struct StagedRma {
    /// The local GPU buffer's key on the copy lane.
    gpu_key: RemoteKey,
    /// The staging window registered with the copy lane's domain and with the remote lane's.
    copy_memh: MemHandle,
    lane_memh: MemHandle,
    /// Fragment size.
    frag: usize,
    /// Window size (a whole number of fragments, or the transfer when smaller).
    window: usize,
    /// The wave: transfer offsets `[wave_start, wave_end)`.
    wave_start: usize,
    wave_end: usize,
    /// 0: the first stage of the wave (put: out of the GPU; get: the remote read), 1: the
    /// second.
    phase: u8,
    /// Bytes of the wave whose operation of this phase was posted.
    cursor: usize,
    /// Every operation of the phase is posted; its completions step the request on.
    waiting: bool,
    /// Operations in flight (mirrors the request's count): memory still in use when dropped.
    pub(crate) inflight: usize,
    /// Last: the memory the handles describe (dropped after them).
    buf: Option<StagingBuf>,
}

impl Drop for StagedRma {
    fn drop(&mut self) {
        if self.inflight > 0 {
            // A request that ended with operations still in flight (its endpoint failed):
            // a transport may still touch the staging, so it is never freed.
            tracing::debug!(
                "staged put/get ended with {} operations in flight; its {} bytes of staging \
                 are kept",
                self.inflight,
                self.window
            );
            std::mem::forget(self.buf.take());
        }
    }
}

/// A fragmented zero-copy transfer between a registered local range and a remote one.
pub(crate) struct Frags<'a> {
    /// Write (`put_zcopy`) or read (`get_zcopy`).
    pub(crate) put: bool,
    /// Local start address (offset 0 of the transfer).
    pub(crate) local: usize,
    /// Remote start address.
    pub(crate) remote: u64,
    pub(crate) key: &'a RemoteKey,
    pub(crate) memh: &'a MemHandle,
    /// Largest fragment.
    pub(crate) max: usize,
    /// End offset.
    pub(crate) end: usize,
}

impl State {
    /// Post a put (`put`) or get of `len` bytes of local `local` memory at `addr` against the
    /// peer's region `remote` of `rkey`, by the first step of the plan that works now.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn post_rma(
        &mut self,
        p: usize,
        put: bool,
        addr: usize,
        len: usize,
        local: MemKey,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Result<u64> {
        self.check_peer(p)?;
        self.refresh_plan(p);
        // The region the peer mapped, not only the domain's key: a registration is aligned out
        // to whole pages (and the registration cache may merge it with its neighbours), so the
        // key alone lets an access run past the mapped buffer.
        rkey.check(remote, len as u64)?;
        let op = if put { Op::Put } else { Op::Get };
        let rmem = rkey.mem_type();
        let peer = self.peers[p].remote.describe();
        let what = || {
            format!(
                "a {} between local {local} memory and {peer}'s {rmem} memory",
                op.name()
            )
        };
        let plan = self.peers[p].plan.rma_plan(op, local, rmem).cloned();
        let Some(plan) = plan else {
            return Err(Error::Unsupported {
                what: what(),
                why: format!("no plan for local {local} memory"),
            });
        };
        let mut tried: Vec<String> = Vec::new();
        for step in plan.steps.iter().copied() {
            let lane = step.lane();
            let md = self.slots[lane].md;
            let mdname = self.ctx.domain(md).name().to_string();
            let Some(key) = rkey
                .keys
                .iter()
                .find(|(n, _)| *n == mdname)
                .map(|(_, k)| k.clone())
            else {
                tried.push(format!(
                    "the remote key bundle has no {mdname} key (the peer's {mdname} did not \
                     register the region; bundle: {:?})",
                    rkey.domains()
                ));
                continue;
            };
            key.check(remote, len as u64)?;
            let proto = step.proto(op);
            if len == 0 {
                let id = self.new_rma(p, put, 0, lane, addr, remote, Some(key), None);
                self.finish(
                    id,
                    Ok(Completion {
                        len: 0,
                        tag: 0,
                        sender: None,
                    }),
                );
                return Ok(id);
            }
            let started = match step {
                RmaStep::Zcopy { .. } => {
                    self.rma_zcopy(p, put, addr, len, local, lane, remote, key)
                }
                RmaStep::Staged { .. } => {
                    self.rma_staged(p, put, addr, len, local, lane, remote, key)
                }
            };
            match started {
                Ok(id) => {
                    self.count(proto.name());
                    self.peers[p].queue.push_back(Pending::Stream(id));
                    self.pump(p);
                    return Ok(id);
                }
                Err(e) => {
                    // A registration that failed demoted its domain (one warning) or refused
                    // this buffer: the next step of the plan carries the request.
                    tracing::debug!("{} on {mdname} not possible ({e}); next path", proto.name());
                    tried.push(format!("{} on {mdname}: {e}", proto.name()));
                }
            }
        }
        let mut why = plan.notes.clone();
        why.extend(tried);
        if why.is_empty() {
            why.push("no path covers this pair".into());
        }
        why.push("see Worker::path_query, RUCX_PROTO_INFO=y and RUCX_TLS".into());
        Err(Error::Unsupported {
            what: what(),
            why: why.join("; "),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn new_rma(
        &mut self,
        p: usize,
        put: bool,
        len: usize,
        lane: usize,
        addr: usize,
        remote: u64,
        key: Option<RemoteKey>,
        staged: Option<Box<StagedRma>>,
    ) -> u64 {
        self.new_req(ReqKind::Rma(RmaState {
            peer: p,
            dir: if put { RmaDir::Put } else { RmaDir::Get },
            len,
            lane,
            addr,
            remote,
            key,
            posted: 0,
            flush_lanes: Vec::new(),
            staged,
        }))
    }

    /// A zero-copy put or get: the local buffer registered with (or, where the domain only
    /// describes host memory, described by) the lane's domain.
    #[allow(clippy::too_many_arguments)]
    fn rma_zcopy(
        &mut self,
        p: usize,
        put: bool,
        addr: usize,
        len: usize,
        local: MemKey,
        lane: usize,
        remote: u64,
        key: RemoteKey,
    ) -> Result<u64> {
        let md = self.slots[lane].md;
        let region = MemRegion {
            addr,
            len,
            mem_type: local.mem,
            device: local.dev,
        };
        let g = if self.ctx.domain(md).attr().reg_mem_types().has(local.mem) {
            self.ctx.register(md, region)?
        } else {
            // Described for this request alone (cuda_ipc's local host side of a copy).
            self.ctx.register_uncached(md, region)?
        };
        let id = self.new_rma(p, put, len, lane, addr, remote, Some(key), None);
        self.reqs.get_mut(&id).expect("req").guards.push(g);
        Ok(id)
    }

    /// A put or get staged through a pinned host window of the request's own.
    #[allow(clippy::too_many_arguments)]
    fn rma_staged(
        &mut self,
        p: usize,
        put: bool,
        addr: usize,
        len: usize,
        local: MemKey,
        lane: usize,
        remote: u64,
        key: RemoteKey,
    ) -> Result<u64> {
        let cmd = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: "staging GPU memory".into(),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(cmd, MemoryType::Host, None)?;
        let (gpu_guard, gpu_key) = self.copy_key(addr, len, local.mem, local.dev)?;
        let frag = self.frag.max(1);
        let window = len.min(frag.saturating_mul(STAGED_FRAGS)).max(1);
        let mut mem = Vec::new();
        mem.try_reserve_exact(window).map_err(|e| {
            Error::NoMemory(format!(
                "{window} bytes of staging for a {} of GPU memory (RUCX_RNDV_FRAG_SIZE x \
                 {STAGED_FRAGS}): {e}",
                if put { "put" } else { "get" }
            ))
        })?;
        mem.resize(window, 0);
        let buf = StagingBuf(mem);
        let base = buf.0.as_ptr() as usize;
        let host = MemRegion::host(base, window);
        // Registered for this request alone; the handles are dropped (with the request)
        // before the memory, which is kept whenever operations are still in flight then.
        let copy_memh = self
            .ctx
            .register_uncached(cmd, host)?
            .registration()
            .clone();
        let md = self.slots[lane].md;
        let lane_memh = self.ctx.register_uncached(md, host)?.registration().clone();
        let staged = StagedRma {
            gpu_key,
            copy_memh,
            lane_memh,
            frag,
            window,
            wave_start: 0,
            wave_end: window.min(len),
            phase: 0,
            cursor: 0,
            waiting: false,
            inflight: 0,
            buf: Some(buf),
        };
        let id = self.new_rma(
            p,
            put,
            len,
            lane,
            addr,
            remote,
            Some(key),
            Some(Box::new(staged)),
        );
        self.reqs.get_mut(&id).expect("req").guards.push(gpu_guard);
        Ok(id)
    }

    pub(crate) fn post_flush(&mut self, p: usize) -> Result<u64> {
        self.check_peer(p)?;
        Ok(self.flush_req(p))
    }

    /// A flush of every lane of peer `p` (checked by the caller).
    pub(crate) fn flush_req(&mut self, p: usize) -> u64 {
        let lanes: Vec<usize> = self.peers[p].eps.keys().copied().collect();
        let id = self.new_req(ReqKind::Rma(RmaState {
            peer: p,
            dir: RmaDir::Flush,
            len: 0,
            lane: 0,
            addr: 0,
            remote: 0,
            key: None,
            posted: 0,
            flush_lanes: lanes,
            staged: None,
        }));
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
        id
    }

    /// Post the operations of a put, get or flush request.
    pub(crate) fn stream_rma(&mut self, id: u64) -> Result<bool> {
        let ReqKind::Rma(rm) = &self.reqs[&id].kind else {
            return Ok(true);
        };
        if rm.staged.is_some() {
            return self.stream_staged(id);
        }
        let (p, dir, len, lane, addr, remote, posted) = (
            rm.peer, rm.dir, rm.len, rm.lane, rm.addr, rm.remote, rm.posted,
        );
        if dir == RmaDir::Flush {
            while let Some(&l) = match &self.reqs[&id].kind {
                ReqKind::Rma(rm) => rm.flush_lanes.last(),
                _ => None,
            } {
                if !self.post(id, p, l, |ep, t| ep.flush(t))? {
                    return Ok(false);
                }
                if let Some(Req {
                    kind: ReqKind::Rma(rm),
                    ..
                }) = self.reqs.get_mut(&id)
                {
                    rm.flush_lanes.pop();
                }
            }
        } else {
            let key = match &self.reqs[&id].kind {
                ReqKind::Rma(rm) => rm.key.clone().expect("rma key"),
                _ => unreachable!("rma request"),
            };
            let memh = self.reqs[&id].guards[0].registration().clone();
            let lim = &self.slots[lane].attr.limits;
            let max = if dir == RmaDir::Put {
                lim.put_max_zcopy
            } else {
                lim.get_max_zcopy
            }
            .min(self.frag)
            .max(1);
            let mut off = posted;
            let f = Frags {
                put: dir == RmaDir::Put,
                local: addr,
                remote,
                key: &key,
                memh: &memh,
                max,
                end: len,
            };
            let res = self.post_frags(id, p, lane, &f, &mut off);
            if let Some(Req {
                kind: ReqKind::Rma(rm),
                ..
            }) = self.reqs.get_mut(&id)
            {
                rm.posted = off;
            }
            if !res? {
                return Ok(false);
            }
        }
        if let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        {
            rm.posted = usize::MAX;
        }
        if self.reqs[&id].outstanding == 0 {
            self.finish(
                id,
                Ok(Completion {
                    len,
                    tag: 0,
                    sender: None,
                }),
            );
        }
        Ok(true)
    }

    /// Post the zero-copy fragments of `f` from `*off` to `f.end` on `lane`, at most `f.max`
    /// bytes each, advancing `*off` past every posted one; `Ok(false)`: the transport pushed
    /// back (resume from `*off`).
    pub(crate) fn post_frags(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        f: &Frags<'_>,
        off: &mut usize,
    ) -> Result<bool> {
        while *off < f.end {
            let n = f.max.min(f.end - *off);
            let iov = [Iov {
                addr: f.local + *off,
                len: n,
                memh: f.memh,
            }];
            let at = f.remote + *off as u64;
            let posted = self.post(id, p, lane, |ep, t| {
                if f.put {
                    ep.put_zcopy(&iov, at, f.key, t)
                } else {
                    ep.get_zcopy(&iov, at, f.key, t)
                }
            })?;
            if !posted {
                return Ok(false);
            }
            *off += n;
        }
        Ok(true)
    }
}

impl State {
    /// Post the operations of a staged put or get, wave after wave; `Ok(false)`: a transport
    /// pushed back (call again after progress).
    fn stream_staged(&mut self, id: u64) -> Result<bool> {
        loop {
            let Some(Req {
                kind: ReqKind::Rma(rm),
                outstanding,
                ..
            }) = self.reqs.get_mut(&id)
            else {
                return Ok(true);
            };
            let outstanding = *outstanding;
            let (p, lane, addr, remote, len, put) = (
                rm.peer,
                rm.lane,
                rm.addr,
                rm.remote,
                rm.len,
                rm.dir == RmaDir::Put,
            );
            let key = rm.key.clone().expect("rma key");
            let sg = rm.staged.as_mut().expect("staged");
            if sg.wave_start >= len {
                rm.posted = usize::MAX;
                if outstanding == 0 {
                    self.finish(
                        id,
                        Ok(Completion {
                            len,
                            tag: 0,
                            sender: None,
                        }),
                    );
                }
                return Ok(true);
            }
            let (wave_start, wave_end, frag, phase) =
                (sg.wave_start, sg.wave_end, sg.frag, sg.phase);
            let gpu_key = sg.gpu_key.clone();
            let copy_memh = sg.copy_memh.clone();
            let lane_memh = sg.lane_memh.clone();
            let base = copy_memh.region().addr;
            let mut cursor = sg.cursor;
            // Put: out of the GPU, then to the peer. Get: from the peer, then into the GPU.
            let on_copy_lane = put == (phase == 0);
            while wave_start + cursor < wave_end {
                let off = wave_start + cursor;
                let n = frag.min(wave_end - off);
                let at = base + cursor;
                let posted = if on_copy_lane {
                    let iov = [Iov {
                        addr: at,
                        len: n,
                        memh: &copy_memh,
                    }];
                    let gpu_at = (addr + off) as u64;
                    self.post_copy(id, |ep, t| {
                        if put {
                            ep.get_zcopy(&iov, gpu_at, &gpu_key, t)
                        } else {
                            ep.put_zcopy(&iov, gpu_at, &gpu_key, t)
                        }
                    })?
                } else {
                    let iov = [Iov {
                        addr: at,
                        len: n,
                        memh: &lane_memh,
                    }];
                    let r_at = remote + off as u64;
                    self.post_counted(id, p, lane, |ep, t| {
                        if put {
                            ep.put_zcopy(&iov, r_at, &key, t)
                        } else {
                            ep.get_zcopy(&iov, r_at, &key, t)
                        }
                    })?
                };
                self.mirror_inflight(id);
                if !posted {
                    self.with_staged(id, |sg| sg.cursor = cursor);
                    return Ok(false);
                }
                cursor += n;
            }
            let Some(r) = self.reqs.get_mut(&id) else {
                return Ok(true);
            };
            let outstanding = r.outstanding;
            let ReqKind::Rma(RmaState {
                staged: Some(sg), ..
            }) = &mut r.kind
            else {
                return Ok(true);
            };
            sg.cursor = cursor;
            if outstanding > 0 {
                // The completions of this phase step the request on (`on_staged_done`).
                sg.waiting = true;
                return Ok(true);
            }
            sg.advance(len);
        }
    }

    /// Every operation of the current phase of staged request `id` completed: step it on.
    pub(crate) fn on_staged_done(&mut self, id: u64) {
        let p = match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        staged: Some(sg),
                        peer,
                        len,
                        ..
                    }),
                result: None,
                outstanding: 0,
                ..
            }) if sg.waiting => {
                sg.waiting = false;
                sg.advance(*len);
                *peer
            }
            _ => return,
        };
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
    }

    /// Keep a staged request's count of operations in flight equal to its `outstanding`.
    pub(crate) fn mirror_inflight(&mut self, id: u64) {
        if let Some(Req {
            kind: ReqKind::Rma(RmaState {
                staged: Some(sg), ..
            }),
            outstanding,
            ..
        }) = self.reqs.get_mut(&id)
        {
            sg.inflight = *outstanding;
        }
    }

    fn with_staged(&mut self, id: u64, f: impl FnOnce(&mut StagedRma)) {
        if let Some(Req {
            kind: ReqKind::Rma(RmaState {
                staged: Some(sg), ..
            }),
            ..
        }) = self.reqs.get_mut(&id)
        {
            f(sg);
        }
    }

    /// Post one operation on the copy lane with a fresh token, counted in request `id`.
    fn post_copy(
        &mut self,
        id: u64,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        let token = self.next_token;
        let (_, ep) = self.copy.as_mut().ok_or_else(|| Error::Unsupported {
            what: "staging GPU memory".into(),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        match op(ep.as_mut(), token) {
            Ok(st) => {
                self.next_token += 1;
                self.account(id, token, st);
                Ok(true)
            }
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl StagedRma {
    /// The phase is done: on to the second phase, or to the next wave.
    fn advance(&mut self, len: usize) {
        self.cursor = 0;
        if self.phase == 0 {
            self.phase = 1;
        } else {
            self.phase = 0;
            self.wave_start = self.wave_end;
            self.wave_end = (self.wave_start + self.window).min(len);
        }
    }
}
