//! What the staged pipeline's receive side and the GPU receiver's path choice ask of the worker
//! beyond [`ProtoIo`] ([`StageIo`]: post a pipeline step whose completion says what it was, take
//! and give back receive staging slots, map a peer's staging fragment, find a lane that reads a
//! domain's memory), its implementation over the worker's state, and the worker's side of the
//! staged receive: running one step of the receive's state machine ([`RndvRecv`]'s methods in
//! `pipeline_recv.rs` and `recv.rs`) and doing what it returns. Nothing here decides a path.

use super::pipeline_recv::{release_unread, step_orphaned};
use crate::worker::prelude::*;

/// Where a pipeline step is posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum On {
    /// Lane `lane` to peer `p` (a read of the sender's memory).
    Lane { p: usize, lane: usize },
    /// The copy lane (host <-> GPU copies in this process).
    Copy,
}

/// Whether a lane to a peer takes operations now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaneState {
    /// Connected.
    Ready,
    /// Being connected (asked for): post after progress.
    Connecting,
    /// Not connected and not reachable: a post on it fails.
    Absent,
}

/// The staged pipeline's I/O, beyond [`ProtoIo`].
pub(crate) trait StageIo: ProtoIo {
    /// Post one pipeline step for request `req` on `on`; its completion comes back as `what`
    /// (not counted in the request's outstanding operations). `Ok(false)`: the transport
    /// pushed back (nothing happened; post again after progress).
    fn post_step(
        &mut self,
        req: u64,
        on: On,
        what: TokWhat,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool>;

    /// Whether `lane` to peer `p` takes operations now (one being connected is asked for).
    fn lane_state(&mut self, p: usize, lane: usize) -> LaneState;

    /// A lane to peer `p` of domain `md` that reads remote memory: connected, else one that
    /// reaches the peer (asked for; connected by the next progress).
    fn read_lane(&mut self, p: usize, md: usize) -> Option<usize>;

    /// Domain `md`'s name and peer `p`'s description, for error messages.
    fn names(&self, md: usize, p: usize) -> (String, String);

    /// Unpack a key the peer packed, named by its domain: our domain of that name, and the key.
    fn unpack_named(&self, key: &NamedKey) -> Result<(usize, RemoteKey)>;

    /// Map a peer's staging fragment at `addr` (key `rkey` of domain `md`) into this process,
    /// registered with the copy lane, when the domain allows (shared memory on this host).
    /// `None`: read it instead.
    fn map_fragment(
        &mut self,
        md: usize,
        rkey: &RemoteKey,
        addr: u64,
    ) -> Option<(usize, MemHandle)>;

    /// Receive staging, registered with domain `md` (made on first use): its handle there.
    fn recv_staging(&mut self, md: usize) -> Result<MemHandle>;

    /// The copy lane's handle on the staging memory.
    fn copy_staging(&self) -> Result<MemHandle>;

    /// Take a free receive staging slot: its index and address. `None`: all are in use (one
    /// comes back with [`Self::release_slot`]).
    fn take_slot(&mut self) -> Option<(usize, usize)>;

    /// The address of staging fragment `f` (a receive slot, or a send fragment).
    fn slot_addr(&self, f: usize) -> usize;

    /// Give receive staging slot `f` back.
    fn release_slot(&mut self, f: usize);

    /// Copy the first `len` bytes of receive staging slot `f` to host buffer `dst` (a receive
    /// buffer no lane could register, live while its request is), by the CPU.
    fn unstage(&mut self, f: usize, dst: usize, len: usize);

    /// Keep registration `g` with request `req` until it ends (`first`: as its first handle,
    /// the one its reads use).
    fn keep(&mut self, req: u64, g: RegGuard, first: bool);

    /// Register GPU buffer `region` of receive `req` with the copy lane's domain (kept with the
    /// request) and make sure staging exists: the key the copy lane writes it with.
    fn gpu_copy_key(&mut self, req: u64, region: MemRegion) -> Result<RemoteKey>;

    /// Register `region` with domain `md` for one request alone (never cached: nothing may
    /// outlive a host buffer that is freed).
    fn register_uncached(&mut self, md: usize, region: MemRegion) -> Result<RegGuard>;

    /// Lend staged send `req` a run of up to `max` consecutive free send staging fragments
    /// (one at least when any is free): the first and how many. `None`: all are in use (they
    /// come back with [`Self::release_send`]).
    fn take_send_run(&mut self, req: u64, max: usize) -> Option<(usize, usize)>;

    /// The run of send `req` from `first` holding `len` bytes was announced to peer `p` (if
    /// the peer fails, it comes back without its acknowledgement).
    fn announce_send(&mut self, req: u64, p: usize, first: usize, len: usize);

    /// Send `req` gives back its run from `first` holding `len` bytes (fragments it does not
    /// hold stay as they are): how many came back.
    fn release_send(&mut self, req: u64, first: usize, len: usize) -> usize;

    /// The staging registered with domain `md` (on first use, through the one register path,
    /// which demotes and warns), its key packed for a peer.
    fn staging_key(&mut self, md: usize) -> Result<NamedKey>;

    /// Register GPU send buffer `region` with the copy lane's domain (for this send alone)
    /// and make sure the staging exists: the registration, and the key the copy lane reads the
    /// buffer with.
    fn send_copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)>;

    /// Remote write into GPU memory (`write.rs`): when the sender of peer `p` offered it for
    /// `lane`'s domain (a host sender; or, `shared`, a GPU sender on the GPU of our buffer that
    /// is the pair's copier), register receive `req`'s GPU buffer there (kept with the
    /// request): the key to hand the sender. `None` when this path is not taken.
    fn gpu_write_key(
        &mut self,
        req: u64,
        p: usize,
        region: MemRegion,
        lane: usize,
        keys: &[NamedKey],
        shared: bool,
    ) -> Option<NamedKey>;
}

impl StageIo for State {
    fn post_step(
        &mut self,
        req: u64,
        on: On,
        what: TokWhat,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        let token = self.next_token;
        let local = match on {
            On::Lane { lane, .. } => self.lane_local(lane),
            On::Copy => true,
        };
        let ep = match on {
            On::Lane { p, lane } => self.peers[p]
                .eps
                .get_mut(&lane)
                .ok_or_else(|| Error::Internal(format!("lane {lane} of ep{p} is not connected")))?,
            On::Copy => {
                &mut self
                    .copy
                    .as_mut()
                    .ok_or_else(|| Error::Internal("no copy lane for a staged copy".into()))?
                    .1
            }
        };
        match op(ep.as_mut(), token) {
            Ok(st) => {
                self.next_token += 1;
                self.post_tok(req, token, st, what, local);
                Ok(true)
            }
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn lane_state(&mut self, p: usize, lane: usize) -> LaneState {
        if self.peers[p].eps.get_mut(&lane).is_some() {
            LaneState::Ready
        } else if self.peers[p].targets.iter().any(|(l, _)| *l == lane) {
            self.want_lane(p, lane);
            LaneState::Connecting
        } else {
            LaneState::Absent
        }
    }

    fn read_lane(&mut self, p: usize, md: usize) -> Option<usize> {
        let reads = |l: usize| {
            self.slots[l].md == md && self.slots[l].attr.caps.contains(IfaceCaps::GET_ZCOPY)
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
            })?;
        self.want_lane(p, lane);
        Some(lane)
    }

    fn names(&self, md: usize, p: usize) -> (String, String) {
        (
            self.ctx.domain(md).name().to_string(),
            self.peers[p].remote.describe(),
        )
    }

    fn unpack_named(&self, key: &NamedKey) -> Result<(usize, RemoteKey)> {
        match self.ctx.domain_index(&key.md) {
            Some(mi) => self.ctx.domain(mi).rkey_unpack(&key.key).map(|k| (mi, k)),
            None => Err(Error::InvalidRkey {
                domain: key.md.clone(),
                reason: "no such local domain".into(),
            }),
        }
    }

    fn map_fragment(
        &mut self,
        md: usize,
        rkey: &RemoteKey,
        addr: u64,
    ) -> Option<(usize, MemHandle)> {
        State::map_fragment(self, md, rkey, addr)
    }

    fn recv_staging(&mut self, md: usize) -> Result<MemHandle> {
        self.staging_reg(md).map(|(h, _)| h)
    }

    fn copy_staging(&self) -> Result<MemHandle> {
        self.staging
            .as_ref()
            .map(|s| s.copy_memh.clone())
            .ok_or_else(|| Error::Internal("a staged copy without staging".into()))
    }

    fn take_slot(&mut self) -> Option<(usize, usize)> {
        let stg = self.staging.as_mut()?;
        let f = stg.free_recv.pop()?;
        Some((f, stg.addr(f)))
    }

    fn slot_addr(&self, f: usize) -> usize {
        self.staging.as_ref().map_or(0, |s| s.addr(f))
    }

    fn release_slot(&mut self, f: usize) {
        if let Some(stg) = self.staging.as_mut() {
            stg.free_recv.push(f);
        }
    }

    fn unstage(&mut self, f: usize, dst: usize, len: usize) {
        let Some(stg) = self.staging.as_ref() else {
            return;
        };
        let from = stg.addr(f);
        // SAFETY: `from..from + len` is our receive staging slot `f` (`len` is at most a
        // fragment), which a completed read filled and which is not handed out again before
        // its owner gives it back after this copy; `dst..dst + len` is within the receive
        // buffer (the protocol never reads past the bytes it wants, at most its capacity),
        // lent mutably to the request's scope and alive and unaliased while the request has
        // not ended, which the caller checked (the step runs for a live receive only).
        unsafe { host_slice_mut(dst, len).copy_from_slice(host_slice(from, len)) };
    }

    fn keep(&mut self, req: u64, g: RegGuard, first: bool) {
        if let Some(r) = self.reqs.get_mut(&req) {
            if first {
                r.guards.insert(0, g);
            } else {
                r.guards.push(g);
            }
        }
    }

    fn gpu_copy_key(&mut self, req: u64, region: MemRegion) -> Result<RemoteKey> {
        let (g, key) = self.copy_key(region.addr, region.len, region.mem_type, region.device)?;
        self.ensure_staging()?;
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&req)
        {
            rs.dev_memh = Some(Box::new((g, key.clone())));
        }
        Ok(key)
    }

    fn register_uncached(&mut self, md: usize, region: MemRegion) -> Result<RegGuard> {
        self.ctx.register_uncached(md, region)
    }

    fn take_send_run(&mut self, req: u64, max: usize) -> Option<(usize, usize)> {
        self.staging.as_mut()?.free_send.take_run(req, max)
    }

    fn announce_send(&mut self, req: u64, p: usize, first: usize, len: usize) {
        if let Some(stg) = self.staging.as_mut() {
            stg.free_send.announced(req, p, first, len);
        }
    }

    fn release_send(&mut self, req: u64, first: usize, len: usize) -> usize {
        self.staging
            .as_mut()
            .map_or(0, |stg| stg.free_send.release(req, first, len))
    }

    fn staging_key(&mut self, md: usize) -> Result<NamedKey> {
        self.staging_reg(md).map(|(_, key)| key)
    }

    fn send_copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        let k = self.copy_key(region.addr, region.len, region.mem_type, region.device)?;
        self.ensure_staging()?;
        Ok(k)
    }

    fn gpu_write_key(
        &mut self,
        req: u64,
        p: usize,
        region: MemRegion,
        lane: usize,
        keys: &[NamedKey],
        shared: bool,
    ) -> Option<NamedKey> {
        State::gpu_write_key(self, req, p, region, lane, keys, shared)
    }
}

/// The worker's side of a staged receive: find the live receive, run one step of its state
/// machine, do what it returns.
impl State {
    /// The peer and send request of live rendezvous receive `rid`.
    fn live_rndv(&self, rid: u64) -> Option<(usize, u64)> {
        match self.reqs.get(&rid) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => rs.rndv().map(|rv| (rv.peer, rv.sreq)),
            _ => None,
        }
    }

    /// Run one step of live rendezvous receive `rid`'s staged state machine (taken out of the
    /// request while it runs, so that it acts on the worker through [`StageIo`]) and do what
    /// it says. `None`: the receive is not live.
    pub(crate) fn staged_step(
        &mut self,
        rid: u64,
        step: impl FnOnce(&mut RndvRecv, &mut Self) -> StagedNext,
    ) -> Option<StagedNext> {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&rid)
        else {
            return None;
        };
        let RecvProto::Rndv(mut rv) = std::mem::replace(&mut rs.proto, RecvProto::Tag) else {
            return None;
        };
        let p = rv.peer;
        let next = step(&mut rv, self);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            if rv.staged.landed > 0 {
                rs.received = rv.staged.landed;
            }
            rs.proto = RecvProto::Rndv(rv);
            if next == StagedNext::Complete {
                rs.received = rs.total.min(rs.cap);
            }
        }
        match &next {
            StagedNext::Wait => {}
            StagedNext::Post => self.queue_stream(p, rid),
            StagedNext::Complete => self.complete_recv(rid),
            StagedNext::Fail(e) => self.fail(rid, e.clone()),
        }
        self.wake_slot_waiters();
        Some(next)
    }

    /// Queue request `rid` to post its next operations when peer `p`'s queue is pumped (once).
    fn queue_stream(&mut self, p: usize, rid: u64) {
        if !self.peers[p]
            .queue
            .iter()
            .any(|q| matches!(q, Pending::Stream(x) if *x == rid))
        {
            self.peers[p].queue.push_back(Pending::Stream(rid));
        }
    }

    /// Receives that found every staging slot in use post again once one is free (queued; the
    /// progress loop pumps their peers).
    fn wake_slot_waiters(&mut self) {
        let Some(stg) = self.staging.as_mut() else {
            return;
        };
        if stg.slot_waiters.is_empty() || stg.free_recv.len() == 0 {
            return;
        }
        let waiters = std::mem::take(&mut stg.slot_waiters);
        for rid in waiters {
            if let Some((p, _)) = self.live_rndv(rid) {
                self.queue_stream(p, rid);
            }
        }
    }

    /// A staged fragment of the sender is ready (FRAG): the receive queues its read. A fragment
    /// for no live receive of that sender is handed back unread.
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
        let f = FragMsg {
            off,
            len,
            addr,
            frag,
            key,
        };
        let next = if self.live_rndv(rreq) == Some((p, sreq)) {
            self.staged_step(rreq, |rv, io| rv.on_frag(io, rreq, f))
        } else {
            // The receive is gone (canceled or failed): still release the sender's fragment.
            release_unread(self, p, sreq, frag, len);
            None
        };
        // Posted when this progress call has handled every message that arrived (the progress
        // loop pumps each peer's queue after its interfaces' events): fragments announced
        // together are then copied together (see `RndvRecv::post_chunks`).
        if next != Some(StagedNext::Post) {
            self.pump(p);
        }
    }

    /// Post reads and copies of the queued chunks of receive `rid` (from its peer's queue).
    /// `Ok(false)`: post again after progress.
    pub(crate) fn stream_chunks(&mut self, rid: u64) -> Result<bool> {
        let mut posting = Ok(Posting::Done);
        self.staged_step(rid, |rv, io| {
            posting = rv.post_chunks(io, rid);
            StagedNext::Wait
        });
        match posting? {
            Posting::Done => Ok(true),
            Posting::Later => Ok(false),
            Posting::NoSlot => {
                if let Some(stg) = self.staging.as_mut()
                    && !stg.slot_waiters.contains(&rid)
                {
                    stg.slot_waiters.push(rid);
                }
                // A slot freed meanwhile (none can: nothing completed) would wake it here.
                self.wake_slot_waiters();
                Ok(true)
            }
        }
    }

    /// A step of the staged receive pipeline completed (a read of a chunk, a copy to the GPU):
    /// the receive's state machine goes on, or, when the receive ended meanwhile, the step's
    /// staging slot and the sender's fragment are handed back.
    pub(crate) fn on_recv_step(&mut self, rid: u64, what: TokWhat, res: Result<()>) {
        let p = self.live_rndv(rid).map(|(p, _)| p);
        let ran = self.staged_step(rid, |rv, io| rv.on_step_done(io, rid, what, res.clone()));
        if ran.is_none() {
            step_orphaned(self, what);
            self.wake_slot_waiters();
        }
        if let Some(p) = p.or_else(|| step_peer(what)) {
            self.pump(p);
        }
    }

    /// A pipelined receive ended early: hand the sender back the staging fragments it announced
    /// and we will not read (it reuses them for other transfers), and our staging slots.
    pub(crate) fn release_chunks(&mut self, id: u64) {
        let p = match self.reqs.get(&id) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                ..
            }) => match rs.rndv() {
                Some(rv) if rv.staged.holds_any() => rv.peer,
                _ => return,
            },
            _ => return,
        };
        // Run on an ended receive too (this is how it lets go).
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return;
        };
        let RecvProto::Rndv(mut rv) = std::mem::replace(&mut rs.proto, RecvProto::Tag) else {
            return;
        };
        rv.release_chunks(self);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&id)
        {
            rs.proto = RecvProto::Rndv(rv);
        }
        self.wake_slot_waiters();
        self.pump(p);
    }

    /// The live staged send `sreq` and its peer.
    fn live_staged_send(&self, sreq: u64) -> Option<usize> {
        match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: None,
                ..
            }) if s.stage().is_some() => Some(s.head.peer),
            _ => None,
        }
    }

    /// The receiver asked us to stage send `sreq` (PULL) for its receive `rreq`: the send's
    /// state machine takes it ([`RndvSend::on_pull`]) with the plan's RMA lane to the peer.
    /// A send that is not waiting for it has the receiver told.
    pub(crate) fn on_pull(&mut self, p: usize, sreq: u64, rreq: u64) {
        match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: None,
                ..
            }) if s.head.peer == p && s.rndv().is_some() => {}
            _ => {
                self.answer_for_gone_send(p, sreq, rreq);
                return;
            }
        }
        let lane = self.peers[p].rma;
        let c = PullChoice {
            lane,
            max_get: lane.map_or(usize::MAX, |l| {
                self.slots[l].attr.limits.get_max_zcopy.max(1)
            }),
            frag: self.frag,
        };
        self.rndv_send_step(sreq, |rv, head, st| rv.on_pull(st, sreq, head, rreq, &c));
        self.pump(p);
    }

    /// Post the staging copies of send `id` (from its peer's queue). `Ok(false)`: pushed back,
    /// post again after progress; a send that found every fragment in use waits for one.
    pub(crate) fn stream_stage(&mut self, id: u64) -> Result<bool> {
        let posting = self
            .with_rndv_send(id, |rv, head, st| rv.post_staging(st, id, head))
            .unwrap_or(Ok(Posting::Done));
        match posting {
            Ok(Posting::Done) => Ok(true),
            Ok(Posting::Later) => Ok(false),
            Ok(Posting::NoSlot) => {
                if let Some(stg) = self.staging.as_mut()
                    && !stg.send_waiters.contains(&id)
                {
                    stg.send_waiters.push(id);
                }
                Ok(true)
            }
            Err(e) => {
                self.wake_send_waiters(false);
                Err(e)
            }
        }
    }

    /// A staging copy of send `id` completed with `res` ([`TokWhat::StageD2H`]): the send's
    /// state machine announces its fragments, or, when the send ended meanwhile (aborted),
    /// they go back unannounced.
    pub(crate) fn on_stage_copy(&mut self, id: u64, what: TokWhat, res: Result<()>) {
        let TokWhat::StageD2H { frag, off, len } = what else {
            return;
        };
        match self.live_staged_send(id) {
            Some(p) => {
                self.rndv_send_step(id, |rv, head, st| {
                    rv.on_staged(st, id, head, frag, off, len, res)
                });
                self.pump(p);
            }
            None => {
                StageIo::release_send(self, id, frag, len);
            }
        }
        self.wake_send_waiters(false);
    }

    /// The receiver read (or gave back) our staged fragments from `frag` on, `len` bytes, of
    /// send `sreq`: they are free again whether or not the send still runs (an aborted send's
    /// fragments still come back); a live send goes on or completes.
    pub(crate) fn on_frag_ack(&mut self, p: usize, sreq: u64, frag: usize, len: usize) {
        match self.live_staged_send(sreq) {
            Some(q) if q == p => {
                let next = self.with_rndv_send(sreq, |rv, head, st| {
                    rv.on_frag_ack(st, sreq, frag, len, head.len)
                });
                if let Some(next) = next {
                    let post = next == SendNext::Post;
                    self.send_next(sreq, next);
                    if post {
                        self.pump(p);
                    }
                }
            }
            // An ended send (or a peer naming a send to another peer): only what was
            // announced to the acknowledging peer comes back.
            _ => {
                if let Some(stg) = self.staging.as_mut() {
                    stg.free_send.release_announced(p, sreq, frag, len);
                }
            }
        }
        self.wake_send_waiters(true);
    }

    /// Peer `p` is gone: the send staging fragments announced to it come back (it will never
    /// acknowledge them), and the sends waiting for one may go on.
    pub(crate) fn release_staged_to(&mut self, p: usize) {
        let Some(stg) = self.staging.as_mut() else {
            return;
        };
        if stg.free_send.release_peer(p) > 0 {
            self.count("staging fragments taken back from a failed peer");
            self.wake_send_waiters(false);
        }
    }

    /// Staged sends that found every send fragment in use may go on once one is free: queued
    /// on their peers, which the progress loop pumps, or pumped at once when `pump`.
    pub(crate) fn wake_send_waiters(&mut self, pump: bool) {
        let Some(stg) = self.staging.as_mut() else {
            return;
        };
        if stg.send_waiters.is_empty() || stg.free_send.len() == 0 {
            return;
        }
        let waiters = std::mem::take(&mut stg.send_waiters);
        for id in waiters {
            if let Some(p) = self.live_staged_send(id) {
                self.queue_stream(p, id);
                if pump {
                    self.pump(p);
                }
            }
        }
    }
}

/// The peer whose fragment a step acknowledges.
fn step_peer(what: TokWhat) -> Option<usize> {
    match what {
        TokWhat::PullGet {
            sfrag: Some(sf), ..
        }
        | TokWhat::DirectH2D {
            sfrag: Some(sf), ..
        } => Some(sf.peer),
        _ => None,
    }
}
