//! Remote memory access requests (put, get, flush on an endpoint) and the fragmented zero-copy
//! transfers that rendezvous reads and writes use too.
//!
//! A put or get takes the first step of the endpoint's plan for its pair of memory types
//! ([`plan::RmaPlan`]) that works now: zero-copy on a lane that reaches both buffers (host RMA;
//! cuda_ipc, whose copy engine reads or writes the peer's mapped GPU buffer from local GPU or
//! host memory), else staged through a pinned host window (the copy lane moves between the
//! local GPU buffer and a fragment of the window, the lane moves the fragment to or from the
//! remote region; the fragments are pipelined, so the copy of one overlaps the transfer of
//! another, and the windows are kept by the worker for the next staged request). A
//! registration that fails on the way (and demotes its domain, one warning) sends the request
//! on to the next step; with none left it ends with the error.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::plan::RmaStep;
use crate::worker::prelude::*;

/// Staging fragments a staged put or get keeps in flight.
pub(crate) const STAGED_FRAGS: usize = 4;

/// Most pinned windows a worker has at once (4 x 4 x `RUCX_RNDV_FRAG_SIZE`: 64 MiB pinned at
/// the default fragment size); staged requests beyond wait for one to come back.
const MAX_WINDOWS: usize = 4;

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
    /// Staged puts and gets of the peer still running when the flush was posted (flush
    /// requests): the flush ends after them too (their operations are not all posted yet, so
    /// the lanes' flushes do not cover them).
    pub(crate) flush_after: Vec<u64>,
    /// A put or get staged through pinned host memory (`None`: zero-copy).
    pub(crate) staged: Option<Box<StagedRma>>,
    /// A put or get of the staged step whose remote region this process maps (the peer's
    /// shared memory on this host): one copy by the copy lane between the GPU buffer and the
    /// mapping, no window.
    pub(crate) mapped: Option<Box<MappedRma>>,
}

/// A staged put or get copied straight between the local GPU buffer and the peer's region
/// mapped into this process ([`MemoryDomain::rkey_ptr`](rucx_uct::MemoryDomain::rkey_ptr),
/// registered with the copy lane once per mapping).
pub(crate) struct MappedRma {
    /// The local GPU buffer's key on the copy lane.
    gpu_key: RemoteKey,
    /// The remote range's address in this process.
    at: usize,
    /// The mapping's registration with the copy lane's domain.
    memh: MemHandle,
}

/// Host memory of a staged window.
struct StagingBuf(Vec<u8>);

/// Pinned host memory for staged puts and gets (and GPU stream receives landing): page-locked
/// once through the copy lane's domain and registered with each remote lane's domain that used
/// it, then kept by the worker ([`Windows`]) for the next request, so a request pays for neither.
pub(crate) struct RmaWindow {
    /// First: counts the window among the worker's live ones until it is freed (or kept
    /// forever, see [`RmaWindow::leak`]).
    _ticket: WindowTicket,
    /// The window registered with the copy lane's domain.
    pub(crate) copy_memh: MemHandle,
    /// Its registrations with remote lanes' domains, by domain index.
    lane_memh: Vec<(usize, MemHandle)>,
    /// Bytes.
    pub(crate) len: usize,
    /// Last: the memory the handles describe (dropped after them).
    buf: StagingBuf,
}

impl RmaWindow {
    /// The start address.
    pub(crate) fn base(&self) -> usize {
        self.buf.0.as_ptr() as usize
    }

    /// Never free the window's memory or registrations (a transport may still touch it: its
    /// request ended with operations in flight), but stop counting it, so the worker may make
    /// another.
    pub(crate) fn leak(self) {
        let RmaWindow {
            _ticket,
            copy_memh,
            lane_memh,
            buf,
            ..
        } = self;
        std::mem::forget((copy_memh, lane_memh, buf));
    }
}

/// One live window of the worker's count.
struct WindowTicket(Arc<AtomicUsize>);

impl Drop for WindowTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The worker's pinned windows: those not in use, how many exist, and the requests waiting
/// for one.
#[derive(Default)]
pub(crate) struct Windows {
    pool: Vec<RmaWindow>,
    live: Arc<AtomicUsize>,
    /// (peer, request) waiting for a window, in order.
    waiters: VecDeque<(usize, u64)>,
}

impl Windows {
    /// Whether requests wait for a window.
    #[inline]
    pub(crate) fn has_waiters(&self) -> bool {
        !self.waiters.is_empty()
    }
}

/// Where a fragment slot of a staged window stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Unused.
    Free,
    /// The fragment's first operation (put: out of the GPU; get: the remote read) is in flight.
    First { off: usize, n: usize, token: u64 },
    /// The first operation finished; the second is still to post.
    Ready { off: usize, n: usize },
    /// The second operation (put: the remote write; get: into the GPU) is in flight.
    Second { off: usize, n: usize, token: u64 },
}

/// The state of a put or get staged through a pinned window of [`STAGED_FRAGS`] fragment
/// slots, pipelined: each slot moves one fragment through its two operations (put: copy lane
/// out of the GPU, then the remote write; get: the remote read, then copy lane into the GPU)
/// and then takes the next fragment, so the copies of some fragments overlap the transfers of
/// others.
pub(crate) struct StagedRma {
    /// The local GPU buffer's key on the copy lane.
    gpu_key: RemoteKey,
    /// The window's registration with the remote lane's domain (once it has a window).
    lane_memh: Option<MemHandle>,
    /// Fragment size.
    frag: usize,
    /// Fragment slots of the window.
    slots: Vec<SlotState>,
    /// Next transfer offset to stage.
    next: usize,
    /// Bytes that went through both operations.
    done: usize,
    /// Operations in flight (mirrors the request's count): memory still in use when dropped.
    pub(crate) inflight: usize,
    /// Last: the window (`None` while waiting for one; handed back to the worker once the
    /// request completes).
    win: Option<RmaWindow>,
}

impl Drop for StagedRma {
    fn drop(&mut self) {
        if self.inflight > 0
            && let Some(w) = self.win.take()
        {
            // A request that ended with operations still in flight (its endpoint failed):
            // a transport may still touch the window, so it is never freed.
            tracing::debug!(
                "staged put/get ended with {} operations in flight; its {} bytes of staging \
                 are kept",
                self.inflight,
                w.len
            );
            w.leak();
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
            flush_after: Vec::new(),
            staged,
            mapped: None,
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

    /// A put or get staged through a pinned host window (one the worker kept, or a new one).
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
        let md = self.slots[lane].md;
        if let Some((at, memh)) = self.map_fragment(md, &key, remote) {
            // The peer's region is mapped here (its shared memory on this host): the copy
            // lane moves the bytes straight between it and the GPU buffer, in one copy.
            let id = self.new_rma(p, put, len, lane, addr, remote, Some(key), None);
            let r = self.reqs.get_mut(&id).expect("req");
            r.guards.push(gpu_guard);
            if let ReqKind::Rma(rm) = &mut r.kind {
                rm.mapped = Some(Box::new(MappedRma { gpu_key, at, memh }));
            }
            self.count("staged put/get copied straight to or from the peer's mapped memory");
            return Ok(id);
        }
        let frag = self.frag.max(1);
        // A window now if one is free (or may be made; a failure to make or register it ends
        // this step here, so the plan's next step is tried), else the request waits for one,
        // behind the requests waiting already.
        let mut win = if self.rma_windows.has_waiters() {
            None
        } else {
            self.take_rma_window(cmd, put)?
        };
        let lane_memh = match win.as_mut() {
            Some(w) => match self.window_lane_memh(w, md) {
                Ok(h) => Some(h),
                Err(e) => {
                    if let Some(w) = win.take() {
                        self.keep_rma_window(w);
                    }
                    return Err(e);
                }
            },
            None => None,
        };
        let nslots = len.div_ceil(frag).clamp(1, STAGED_FRAGS);
        let staged = StagedRma {
            gpu_key,
            lane_memh,
            frag,
            slots: vec![SlotState::Free; nslots],
            next: 0,
            done: 0,
            inflight: 0,
            win,
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

    /// A window for a staged request or a landing stream receive: one the worker keeps, or a
    /// new one while fewer than [`MAX_WINDOWS`] exist; `Ok(None)`: the request waits for one
    /// ([`Self::wait_for_window`]).
    pub(crate) fn take_rma_window(&mut self, cmd: usize, put: bool) -> Result<Option<RmaWindow>> {
        if let Some(w) = self.rma_windows.pool.pop() {
            return Ok(Some(w));
        }
        if self.rma_windows.live.load(Ordering::Relaxed) >= MAX_WINDOWS {
            return Ok(None);
        }
        let len = self.frag.max(1).saturating_mul(STAGED_FRAGS);
        let mut mem = Vec::new();
        mem.try_reserve_exact(len).map_err(|e| {
            Error::NoMemory(format!(
                "{len} bytes of staging for a {} of GPU memory (RUCX_RNDV_FRAG_SIZE x \
                 {STAGED_FRAGS}): {e}",
                if put {
                    "put"
                } else {
                    "get or a stream receive"
                }
            ))
        })?;
        mem.resize(len, 0);
        let buf = StagingBuf(mem);
        let host = MemRegion::host(buf.0.as_ptr() as usize, len);
        // Kept with the window, whose memory is freed after its handles (field order).
        let copy_memh = self
            .ctx
            .register_uncached(cmd, host)?
            .registration()
            .clone();
        self.rma_windows.live.fetch_add(1, Ordering::Relaxed);
        self.count("staged put/get window made");
        Ok(Some(RmaWindow {
            _ticket: WindowTicket(self.rma_windows.live.clone()),
            copy_memh,
            lane_memh: Vec::new(),
            len,
            buf,
        }))
    }

    /// The window's registration with domain `md` (made the first time, kept with it).
    fn window_lane_memh(&mut self, w: &mut RmaWindow, md: usize) -> Result<MemHandle> {
        if let Some((_, h)) = w.lane_memh.iter().find(|(m, _)| *m == md) {
            return Ok(h.clone());
        }
        let host = MemRegion::host(w.base(), w.len);
        // Kept with the window: the handle is dropped before the window's memory.
        let h = self.ctx.register_uncached(md, host)?.registration().clone();
        w.lane_memh.push((md, h.clone()));
        Ok(h)
    }

    /// Give a window back to the worker for the next staged request (the waiting ones are
    /// woken by the next progress call: [`Self::wake_window_waiters`]).
    pub(crate) fn keep_rma_window(&mut self, w: RmaWindow) {
        if self.rma_windows.pool.len() < MAX_WINDOWS {
            self.rma_windows.pool.push(w);
        }
    }

    /// Request `id` ended (with an error: a success hands its window back itself) and nothing
    /// of it is in flight any more: its window goes back to the worker now rather than when
    /// the caller drops the request, so that requests waiting for one go on.
    pub(crate) fn reclaim_window(&mut self, id: u64) {
        let win = match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        staged: Some(sg), ..
                    }),
                outstanding: 0,
                result: Some(_),
                ..
            }) => sg.win.take(),
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(l),
                        ..
                    }),
                outstanding: 0,
                result: Some(_),
                ..
            }) => l.take_window(),
            _ => None,
        };
        if let Some(w) = win {
            self.keep_rma_window(w);
        }
    }

    /// Request `id` of peer `p` waits for a window.
    pub(crate) fn wait_for_window(&mut self, p: usize, id: u64) {
        if !self.rma_windows.waiters.iter().any(|&(_, i)| i == id) {
            self.rma_windows.waiters.push_back((p, id));
            self.count("request waited for a pinned window");
        }
    }

    /// Windows are free (kept, or fewer than the most exist): the requests waiting for one
    /// go on, in the order they came, as many as there are windows for (a request that ended
    /// meanwhile is dropped from the line). Returns how many went on.
    pub(crate) fn wake_window_waiters(&mut self) -> usize {
        let live = self.rma_windows.live.load(Ordering::Relaxed);
        let mut free = self.rma_windows.pool.len() + MAX_WINDOWS.saturating_sub(live);
        let mut woken = 0;
        while free > 0
            && let Some((p, id)) = self.rma_windows.waiters.pop_front()
        {
            if self.reqs.get(&id).is_some_and(|r| r.result.is_none()) {
                self.peers[p].queue.push_back(Pending::Stream(id));
                self.pump(p);
                free -= 1;
                woken += 1;
            }
        }
        woken
    }

    pub(crate) fn post_flush(&mut self, p: usize) -> Result<u64> {
        self.check_peer(p)?;
        Ok(self.flush_req(p))
    }

    /// A flush of every lane of peer `p` (checked by the caller).
    pub(crate) fn flush_req(&mut self, p: usize) -> u64 {
        let lanes: Vec<usize> = self.peers[p].eps.keys().copied().collect();
        let after: Vec<u64> = self
            .reqs
            .iter()
            .filter_map(|(i, r)| match &r.kind {
                ReqKind::Rma(rm)
                    if r.result.is_none()
                        && rm.peer == p
                        && (rm.staged.is_some() || rm.mapped.is_some()) =>
                {
                    Some(i)
                }
                _ => None,
            })
            .collect();
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
            flush_after: after,
            staged: None,
            mapped: None,
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
        if rm.mapped.is_some() {
            return self.stream_mapped(id);
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
            let attr = &self.slots[lane].attr;
            let lim = if dir == RmaDir::Put {
                attr.limits.put_max_zcopy
            } else {
                attr.limits.get_max_zcopy
            };
            // An accelerator lane (cuda_ipc: one copy-engine copy) moves the whole range in one
            // operation, as rendezvous reads through it do; host lanes in fragments.
            let max = if attr.dev_type == rucx_uct::DeviceType::Accelerator {
                lim
            } else {
                lim.min(self.frag)
            }
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
        if self.reqs[&id].outstanding == 0 && self.flush_may_end(id) {
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

    /// Whether flush `id` (its lanes flushed) may end: every staged put or get it waits for
    /// ended. Otherwise it is noted, and the progress loop ends it once they have
    /// ([`Self::end_waiting_flushes`]). True for other requests.
    pub(crate) fn flush_may_end(&mut self, id: u64) -> bool {
        let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return true;
        };
        let mut after = std::mem::take(&mut rm.flush_after);
        after.retain(|i| self.reqs.get(i).is_some_and(|r| r.result.is_none()));
        let done = after.is_empty();
        if let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        {
            rm.flush_after = after;
        }
        if !done && !self.rma_flushes.contains(&id) {
            self.rma_flushes.push(id);
        }
        done
    }

    /// End the flushes whose lanes are flushed and whose staged puts and gets ended; how many.
    pub(crate) fn end_waiting_flushes(&mut self) -> usize {
        let mut n = 0;
        for id in std::mem::take(&mut self.rma_flushes) {
            let ready = match self.reqs.get(&id) {
                Some(Req {
                    kind: ReqKind::Rma(rm),
                    outstanding: 0,
                    result: None,
                    ..
                }) => rm.posted == usize::MAX,
                // Ended otherwise (its endpoint failed), or its lanes' flushes still run
                // (their completion looks again).
                _ => continue,
            };
            if ready && self.flush_may_end(id) {
                self.rma_flushes.retain(|&i| i != id);
                self.finish(
                    id,
                    Ok(Completion {
                        len: 0,
                        tag: 0,
                        sender: None,
                    }),
                );
                n += 1;
            }
        }
        n
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
    /// Post the one copy of a put or get through the peer's mapped region (see
    /// [`MappedRma`]); it completes with that copy.
    fn stream_mapped(&mut self, id: u64) -> Result<bool> {
        let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get(&id)
        else {
            return Ok(true);
        };
        if rm.posted == usize::MAX {
            return Ok(true);
        }
        let (len, addr, put) = (rm.len, rm.addr, rm.dir == RmaDir::Put);
        let m = rm.mapped.as_ref().expect("mapped request");
        let (at, memh, gpu_key) = (m.at, m.memh.clone(), m.gpu_key.clone());
        let iov = [Iov {
            addr: at,
            len,
            memh: &memh,
        }];
        // Put: out of the GPU into the mapping; get: out of the mapping into the GPU.
        let posted = self.post_copy(id, |ep, t| {
            if put {
                ep.get_zcopy(&iov, addr as u64, &gpu_key, t)
            } else {
                ep.put_zcopy(&iov, addr as u64, &gpu_key, t)
            }
        })?;
        if !posted {
            return Ok(false);
        }
        let Some(r) = self.reqs.get_mut(&id) else {
            return Ok(true);
        };
        if let ReqKind::Rma(rm) = &mut r.kind {
            rm.posted = usize::MAX;
        }
        if r.outstanding == 0 {
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

    /// Post what a staged put or get can post now: the second operation of every fragment
    /// whose first one finished, then the first operation of new fragments into free slots;
    /// `Ok(false)`: a transport pushed back (call again after progress).
    fn stream_staged(&mut self, id: u64) -> Result<bool> {
        loop {
            let Some(Req {
                kind: ReqKind::Rma(rm),
                ..
            }) = self.reqs.get_mut(&id)
            else {
                return Ok(true);
            };
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
            if sg.win.is_none() {
                // Waiting for a window: take one now if there is one.
                let cmd = self.copy_md().ok_or_else(|| Error::Unsupported {
                    what: "staging GPU memory".into(),
                    why: "no copy transport (cuda_copy) is open".into(),
                })?;
                let Some(mut w) = self.take_rma_window(cmd, put)? else {
                    self.wait_for_window(p, id);
                    return Ok(true);
                };
                let md = self.slots[lane].md;
                let h = match self.window_lane_memh(&mut w, md) {
                    Ok(h) => h,
                    Err(e) => {
                        self.keep_rma_window(w);
                        return Err(e);
                    }
                };
                if let Some(sg) = self.staged_mut(id) {
                    sg.win = Some(w);
                    sg.lane_memh = Some(h);
                }
                continue;
            }
            if sg.done >= len {
                self.finish_staged(id);
                return Ok(true);
            }
            // One operation per pass: the first slot with something to post.
            let Some((k, second, off, n)) = sg
                .slots
                .iter()
                .enumerate()
                .find_map(|(k, s)| match *s {
                    SlotState::Ready { off, n } => Some((k, true, off, n)),
                    _ => None,
                })
                .or_else(|| {
                    let k = sg.slots.iter().position(|s| *s == SlotState::Free)?;
                    (sg.next < len).then(|| (k, false, sg.next, sg.frag.min(len - sg.next)))
                })
            else {
                // Everything possible is in flight: completions step the request on.
                return Ok(true);
            };
            let win = sg.win.as_ref().expect("window of a staged request");
            let at = win.base() + k * sg.frag;
            let copy_memh = win.copy_memh.clone();
            let lane_memh = sg.lane_memh.clone().expect("registered with the window");
            let gpu_key = sg.gpu_key.clone();
            // Put: out of the GPU, then to the peer. Get: from the peer, then into the GPU.
            let on_copy_lane = put != second;
            let token = self.next_token;
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
                return Ok(false);
            }
            // Finished at once (no token kept), or in flight until its completion.
            let in_flight = self.tokens.contains_key(&token);
            let Some(sg) = self.staged_mut(id) else {
                return Ok(true);
            };
            if !second {
                sg.next = off + n;
            }
            sg.slots[k] = match (second, in_flight) {
                (false, true) => SlotState::First { off, n, token },
                (false, false) => SlotState::Ready { off, n },
                (true, true) => SlotState::Second { off, n, token },
                (true, false) => {
                    sg.done += n;
                    SlotState::Free
                }
            };
        }
    }

    /// An operation of staged request `id` completed (successfully): step the slots whose
    /// operation is no longer in flight on, and post what that allows.
    pub(crate) fn on_staged_op(&mut self, id: u64) {
        let tokens = &self.tokens;
        let p = match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        staged: Some(sg),
                        peer,
                        ..
                    }),
                result: None,
                ..
            }) => {
                for s in sg.slots.iter_mut() {
                    match *s {
                        SlotState::First { off, n, token } if !tokens.contains_key(&token) => {
                            *s = SlotState::Ready { off, n };
                        }
                        SlotState::Second { n, token, .. } if !tokens.contains_key(&token) => {
                            sg.done += n;
                            *s = SlotState::Free;
                        }
                        _ => {}
                    }
                }
                *peer
            }
            _ => return,
        };
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
    }

    /// Every byte of staged request `id` went through: hand its window back and complete it.
    fn finish_staged(&mut self, id: u64) {
        let Some(Req {
            kind: ReqKind::Rma(rm),
            outstanding: 0,
            result: None,
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return;
        };
        rm.posted = usize::MAX;
        let len = rm.len;
        let win = rm.staged.as_mut().and_then(|sg| sg.win.take());
        if let Some(w) = win {
            self.keep_rma_window(w);
        }
        self.finish(
            id,
            Ok(Completion {
                len,
                tag: 0,
                sender: None,
            }),
        );
    }

    fn staged_mut(&mut self, id: u64) -> Option<&mut StagedRma> {
        match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        staged: Some(sg), ..
                    }),
                ..
            }) => Some(sg),
            _ => None,
        }
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
                self.account(id, token, st, true);
                Ok(true)
            }
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }
}
