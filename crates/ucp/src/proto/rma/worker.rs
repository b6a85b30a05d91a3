//! The worker's side of remote memory access: [`RmaIo`] over its state (its lanes, copy lane,
//! context and windows), and the glue that finds a request, runs a step of its state machine
//! ([`RmaState`]'s methods) and does what the step says. Nothing here decides a path.

use super::{RmaIo, RmaNext, RmaPath, RmaPosted, RmaReq, RmaStart, RmaState, RmaWindow};
use crate::proto::gpu::stage_io::On;
use crate::worker::prelude::*;

/// The copy lane is needed and not open.
fn no_copy_lane() -> Error {
    Error::Unsupported {
        what: "staging GPU memory".into(),
        why: "no copy transport (cuda_copy) is open".into(),
    }
}

impl RmaIo for State {
    fn post_on(
        &mut self,
        req: u64,
        on: On,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<RmaPosted> {
        let token = self.next_token;
        // Copies this process runs (cuda_ipc, the copy lane) always complete: a request that
        // ends early waits for them (`Tok::local`).
        let local = match on {
            On::Lane { lane, .. } => self.lane_local(lane),
            On::Copy => true,
        };
        let ep = match on {
            On::Lane { p, lane } => self.peers[p]
                .eps
                .get_mut(&lane)
                .ok_or_else(|| Error::Internal(format!("lane {lane} of ep{p} is not connected")))?,
            On::Copy => &mut self.copy.as_mut().ok_or_else(no_copy_lane)?.1,
        };
        match op(ep.as_mut(), token) {
            Ok(st) => {
                self.next_token += 1;
                self.account(req, token, st, local);
                Ok(match st {
                    OpStatus::Done => RmaPosted::Done,
                    OpStatus::InProgress => RmaPosted::InFlight(token),
                })
            }
            Err(e) if e.is_retryable() => Ok(RmaPosted::Later),
            Err(e) => Err(e),
        }
    }

    fn in_flight(&self, token: u64) -> bool {
        self.tokens.contains_key(&token)
    }

    fn lane_max(&self, lane: usize, put: bool) -> usize {
        let attr = &self.slots[lane].attr;
        let lim = if put {
            attr.limits.put_max_zcopy
        } else {
            attr.limits.get_max_zcopy
        };
        // An accelerator lane (cuda_ipc: one copy-engine copy) moves the whole range in one
        // operation, as rendezvous reads through it do; host lanes in fragments.
        if attr.dev_type == rucx_uct::DeviceType::Accelerator {
            lim
        } else {
            lim.min(self.frag)
        }
        .max(1)
    }

    fn md_name(&self, md: usize) -> String {
        self.ctx.domain(md).name().to_string()
    }

    fn register_local(&mut self, lane: usize, region: MemRegion) -> Result<RegGuard> {
        let md = self.slots[lane].md;
        if self
            .ctx
            .domain(md)
            .attr()
            .reg_mem_types()
            .has(region.mem_type)
        {
            self.ctx.register(md, region)
        } else {
            // Described for this request alone (cuda_ipc's local host side of a copy).
            self.ctx.register_uncached(md, region)
        }
    }

    fn staging_copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        let cmd = self.copy_md().ok_or_else(no_copy_lane)?;
        self.copy_not_demoted(cmd, MemoryType::Host, None)?;
        self.copy_key(region.addr, region.len, region.mem_type, region.device)
    }

    fn map_remote(
        &mut self,
        lane: usize,
        key: &RemoteKey,
        remote: u64,
    ) -> Option<(usize, MemHandle)> {
        let md = self.slots[lane].md;
        self.map_fragment(md, key, remote)
    }

    fn frag(&self) -> usize {
        self.frag
    }

    fn windows_waited(&self) -> bool {
        self.rma_windows.has_waiters()
    }

    fn take_window(&mut self, put: bool) -> Result<Option<RmaWindow>> {
        let cmd = self.copy_md().ok_or_else(no_copy_lane)?;
        self.take_rma_window(cmd, put)
    }

    fn window_memh(&mut self, w: &mut RmaWindow, lane: usize) -> Result<MemHandle> {
        let md = self.slots[lane].md;
        let ctx = &self.ctx;
        w.lane_memh(md, |r| {
            ctx.register_uncached(md, r)
                .map(|g| g.registration().clone())
        })
    }

    fn keep_window(&mut self, w: RmaWindow) {
        self.keep_rma_window(w);
    }

    fn ended(&self, req: u64) -> bool {
        self.reqs.get(&req).is_none_or(|r| r.result.is_some())
    }
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
        let plan = self.peers[p]
            .plan
            .rma_plan(op, local, rkey.mem_type())
            .cloned();
        let r = RmaReq {
            peer: p,
            put,
            addr,
            len,
            local,
            remote,
            rmem: rkey.mem_type(),
            keys: &rkey.keys,
            peer_name: self.peers[p].remote.describe(),
        };
        match RmaState::start(self, &r, plan.as_ref())? {
            RmaStart::Empty(state) => {
                let id = self.new_req(ReqKind::Rma(state));
                self.finish_ok(id, 0);
                Ok(id)
            }
            RmaStart::Go {
                state,
                guard,
                proto,
            } => {
                let id = self.new_req(ReqKind::Rma(state));
                if let Some(r) = self.reqs.get_mut(&id) {
                    r.guards.push(guard);
                }
                self.count(proto.name());
                self.peers[p].queue.push_back(Pending::Stream(id));
                self.pump(p);
                Ok(id)
            }
        }
    }

    /// A caller's flush of peer `p`: it ends with the error the peer's puts, gets and atomics
    /// left since the last one ([`Self::take_rma_error`]).
    pub(crate) fn post_flush(&mut self, p: usize) -> Result<u64> {
        self.check_peer(p)?;
        Ok(self.flush_req_of(p, true))
    }

    /// A flush of every lane of peer `p` (checked by the caller), ending after the peer's
    /// staged puts and gets running now; it reports no error of theirs (a close's).
    pub(crate) fn flush_req(&mut self, p: usize) -> u64 {
        self.flush_req_of(p, false)
    }

    /// [`flush_req`](Self::flush_req), reporting the peer's errors when `report`.
    fn flush_req_of(&mut self, p: usize, report: bool) -> u64 {
        let lanes: Vec<usize> = self.peers[p].eps.keys().copied().collect();
        let after: Vec<u64> = self
            .reqs
            .iter()
            .filter_map(|(i, r)| match &r.kind {
                ReqKind::Rma(rm) if r.result.is_none() && rm.peer == p && rm.pipelined() => Some(i),
                _ => None,
            })
            .collect();
        let mut state = RmaState::flush(p, lanes, after);
        if let RmaPath::Flush(f) = &mut state.path {
            f.report = report;
        }
        let id = self.new_req(ReqKind::Rma(state));
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
        id
    }

    /// Run `step` on request `id`'s state (taken out of the request while it runs, so that
    /// it acts on the worker through [`RmaIo`]). `None`: not a put, get or flush.
    fn with_rma<R>(
        &mut self,
        id: u64,
        step: impl FnOnce(&mut RmaState, &mut Self) -> R,
    ) -> Option<R> {
        let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return None;
        };
        let placeholder = RmaState::flush(rm.peer, Vec::new(), Vec::new());
        let mut rm_out = std::mem::replace(rm, placeholder);
        let out = step(&mut rm_out, self);
        if let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        {
            *rm = rm_out;
        }
        Some(out)
    }

    /// Post the operations of a put, get or flush request; `Ok(false)`: a transport pushed
    /// back (call again after progress).
    pub(crate) fn stream_rma(&mut self, id: u64) -> Result<bool> {
        match self.with_rma(id, |rm, st| rm.advance(st, id)) {
            None => Ok(true),
            Some(next) => match next? {
                RmaNext::Later => Ok(false),
                next => {
                    self.rma_next(id, next);
                    Ok(true)
                }
            },
        }
    }

    /// An operation of put, get or flush `id` (not ended) completed with `res`.
    pub(crate) fn on_rma_done(&mut self, id: u64, res: Result<()>) {
        match self.with_rma(id, |rm, st| rm.on_done(st, id, res)) {
            Some(Ok(next)) => self.rma_next(id, next),
            Some(Err(e)) => self.fail(id, e),
            None => {}
        }
    }

    /// Do what a step of request `id` said.
    fn rma_next(&mut self, id: u64, next: RmaNext) {
        let (p, len) = match self.reqs.get(&id) {
            Some(Req {
                kind: ReqKind::Rma(rm),
                ..
            }) => (rm.peer, rm.len),
            _ => return,
        };
        match next {
            RmaNext::Wait => {}
            RmaNext::NeedWindow => self.wait_for_window(p, id),
            RmaNext::Post | RmaNext::Later => {
                self.peers[p].queue.push_back(Pending::Stream(id));
                self.pump(p);
            }
            RmaNext::Complete => self.complete_rma(id, len),
            RmaNext::FlushWait => {
                if !self.rma_flushes.contains(&id) {
                    self.rma_flushes.push(id);
                }
            }
        }
    }

    /// Put, get or flush `id` did all it had to: it ends well, but a caller's flush ends
    /// with the error of a put, get or atomic of its peer that failed since the last such
    /// flush (`Peer::rma_error`).
    fn complete_rma(&mut self, id: u64, len: usize) {
        let flush_of = match self.reqs.get(&id) {
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        peer,
                        path: RmaPath::Flush(f),
                        ..
                    }),
                ..
            }) if f.report => Some(*peer),
            _ => None,
        };
        match flush_of.and_then(|p| self.take_rma_error(p)) {
            Some(e) => self.fail(id, e),
            None => self.finish_ok(id, len),
        }
    }

    /// The error of a put, get or atomic of peer `p` that failed after it was posted and that
    /// no flush reported yet, taken (a flush reports it once).
    pub(crate) fn take_rma_error(&mut self, p: usize) -> Option<Error> {
        self.peers.get_mut(p)?.rma_error.take()
    }

    /// Request `id` just ended with an error: a put, get or atomic keeps it for its peer's
    /// next flush (the first one, until a flush reports it); a flush that failed (its peer
    /// failed: it reported the peer's error) takes what it would have reported.
    #[cold]
    pub(crate) fn note_rma_failure(&mut self, id: u64) {
        let Some(Req {
            kind: ReqKind::Rma(rm),
            result: Some(Err(e)),
            ..
        }) = self.reqs.get(&id)
        else {
            return;
        };
        let p = rm.peer;
        let report = match &rm.path {
            RmaPath::Flush(f) => Some(f.report),
            _ => None,
        };
        let e = e.clone();
        if let Some(peer) = self.peers.get_mut(p) {
            match report {
                // A put, get or atomic.
                None => {
                    peer.rma_error.get_or_insert(e);
                }
                Some(true) => peer.rma_error = None,
                // A close's flush: it reports nothing of theirs.
                Some(false) => {}
            }
        }
    }

    /// End the flushes whose lanes are flushed and whose staged puts and gets ended; how many.
    pub(crate) fn end_waiting_flushes(&mut self) -> usize {
        let mut n = 0;
        for id in std::mem::take(&mut self.rma_flushes) {
            if self.reqs.get(&id).is_none_or(|r| r.result.is_some()) {
                // Ended otherwise (its endpoint failed).
                continue;
            }
            match self.with_rma(id, |rm, st| rm.flush_ready(st, id)).flatten() {
                Some(RmaNext::Complete) => {
                    self.complete_rma(id, 0);
                    n += 1;
                }
                Some(next) => self.rma_next(id, next),
                // Its lanes' flushes still run: their completion looks again.
                None => {}
            }
        }
        n
    }

    /// A window for a staged request or a landing stream receive: one the worker keeps, or a
    /// new one (registered with copy domain `cmd`) while fewer than [`MAX_WINDOWS`](super::window::MAX_WINDOWS) exist;
    /// `Ok(None)`: the request waits for one ([`Self::wait_for_window`]).
    pub(crate) fn take_rma_window(&mut self, cmd: usize, put: bool) -> Result<Option<RmaWindow>> {
        let what = if put {
            "put"
        } else {
            "get or a stream receive"
        };
        let ctx = &self.ctx;
        let taken = self.rma_windows.take(self.frag, what, |r| {
            ctx.register_uncached(cmd, r)
                .map(|g| g.registration().clone())
        })?;
        Ok(taken.map(|(w, made)| {
            if made {
                self.count("staged put/get window made");
            }
            w
        }))
    }

    /// Give a window back to the worker for the next staged request (the waiting ones are
    /// woken by the next progress call: [`Self::wake_window_waiters`]).
    pub(crate) fn keep_rma_window(&mut self, w: RmaWindow) {
        self.rma_windows.keep(w);
    }

    /// Request `id` ended (with an error: a success hands its window back itself) and nothing
    /// of it is in flight any more: its window goes back to the worker now rather than when
    /// the caller drops the request, so that requests waiting for one go on.
    pub(crate) fn reclaim_window(&mut self, id: u64) {
        let win = match self.reqs.get_mut(&id) {
            Some(Req {
                kind: ReqKind::Rma(rm),
                outstanding: 0,
                result: Some(_),
                ..
            }) => rm.take_window(),
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
        if self.rma_windows.wait(p, id) {
            self.count("request waited for a pinned window");
        }
    }

    /// Windows are free (kept, or fewer than the most exist): the requests waiting for one
    /// go on, in the order they came, as many as there are windows for (a request that ended
    /// meanwhile is dropped from the line). Returns how many went on.
    pub(crate) fn wake_window_waiters(&mut self) -> usize {
        let mut free = self.rma_windows.free();
        let mut woken = 0;
        while free > 0
            && let Some((p, id)) = self.rma_windows.next_waiter()
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
}
