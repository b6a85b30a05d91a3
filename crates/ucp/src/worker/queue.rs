//! A peer's queue of work (control messages, fragments to post, stream pieces), posting
//! transport operations with completion tokens, and the events interfaces report.

use crate::proto::io::SendIo;
use crate::worker::prelude::*;

impl State {
    /// Send a control message to peer `p` behind its queued work: at once when nothing is
    /// queued before it (encoded into a reused buffer and copied into the transport, as
    /// [`pump`](Self::pump) would send it right after), queued otherwise, and queued when the
    /// transport pushes back or fails (`pump` then retries it, or fails the peer, in order).
    pub(crate) fn send_msg(&mut self, p: usize, m: &Msg<'_>) {
        let mut buf = std::mem::take(&mut self.ctrl_buf);
        buf.clear();
        let id = m.encode_into(&mut buf);
        rucx_ucs::profile::mark("am.send", u64::from(id));
        let peer = &mut self.peers[p];
        if peer.queue.is_empty() && peer.connected && peer.failed.is_none() {
            let am = peer.am;
            if let Some(ep) = peer.eps.get_mut(&am)
                && ep
                    .am_bcopy(id, &mut rucx_uct::iface::pack_bytes(&buf))
                    .is_ok()
            {
                self.ctrl_buf = buf;
                return;
            }
        }
        self.queue_ctrl(p, id, buf);
    }

    pub(crate) fn queue_ctrl(&mut self, p: usize, id: AmId, bytes: Vec<u8>) {
        self.peers[p].queue.push_back(Pending::Ctrl { id, bytes });
    }

    /// Post queued work of peer `p` in order until the transport pushes back.
    pub(crate) fn pump(&mut self, p: usize) {
        if !self.peers[p].connected || self.peers[p].failed.is_some() {
            return;
        }
        while let Some(front) = self.peers[p].queue.pop_front() {
            match front {
                Pending::Ctrl { id, bytes } => {
                    let am = self.peers[p].am;
                    let ep = self.peers[p].eps.get_mut(&am).expect("am lane connected");
                    let res = ep.am_bcopy(id, &mut rucx_uct::iface::pack_bytes(&bytes));
                    match res {
                        Ok(_) => {}
                        Err(e) if e.is_retryable() => {
                            self.peers[p].queue.push_front(Pending::Ctrl { id, bytes });
                            return;
                        }
                        Err(e) => {
                            self.fail_peer(p, &format!("sending a control message: {e}"));
                            return;
                        }
                    }
                }
                Pending::StreamPiece { id, off, len } => {
                    let addr = match self.reqs.get(&id) {
                        Some(Req {
                            kind: ReqKind::Send(s),
                            result: None,
                            ..
                        }) => s.head.addr,
                        // Finished otherwise (endpoint failure): nothing more to send.
                        _ => continue,
                    };
                    // SAFETY: the stream send's buffer is lent to its scope until the request
                    // finishes, which is after its last piece (the `Finish` behind it).
                    let data = unsafe { host_slice(addr + off, len) };
                    let am = self.peers[p].am;
                    match proto::stream::post_piece(self, id, p, am, data) {
                        Ok(true) => {}
                        Ok(false) => {
                            self.peers[p]
                                .queue
                                .push_front(Pending::StreamPiece { id, off, len });
                            return;
                        }
                        Err(e) => {
                            self.fail_peer(p, &format!("sending stream bytes: {e}"));
                            return;
                        }
                    }
                }
                Pending::Finish { id, len } => self.finish_ok(id, len),
                Pending::Stream(req) => match self.stream(req) {
                    Ok(true) => {}
                    Ok(false) => {
                        self.peers[p].queue.push_front(Pending::Stream(req));
                        return;
                    }
                    Err(e) => self.fail(req, e),
                },
            }
        }
    }

    /// Post the next operations of a request. Ok(true): all posted; Ok(false): the transport
    /// pushed back, call again after progress.
    pub(crate) fn stream(&mut self, id: u64) -> Result<bool> {
        match self.reqs.get(&id) {
            None => Ok(true),
            Some(r) if r.result.is_some() => Ok(true),
            Some(Req {
                kind: ReqKind::Send(_),
                ..
            }) => self.stream_send(id),
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(_),
                        ..
                    }),
                ..
            }) => self.pump_landing(id),
            Some(Req {
                kind: ReqKind::Recv(_),
                ..
            }) => self.stream_get(id),
            Some(Req {
                kind: ReqKind::Rma(_),
                ..
            }) => self.stream_rma(id),
        }
    }

    /// Post one operation on `lane` of peer `p` with a fresh token and count it in request `id`.
    /// `Ok(false)`: the transport pushed back; progress and call again.
    pub(crate) fn post_counted(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        let token = self.next_token;
        let ep = self.peers[p]
            .eps
            .get_mut(&lane)
            .ok_or_else(|| Error::Internal(format!("lane {lane} of ep{p} is not connected")))?;
        match op(ep.as_mut(), token) {
            Ok(st) => {
                self.next_token += 1;
                let local = self.lane_local(lane);
                self.account(id, token, st, local);
                Ok(true)
            }
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Count an in-progress operation of request `id` posted with `token`, or forget the token
    /// when the operation completed at once (`local`: on a lane of copies this process runs,
    /// see [`Tok::local`]).
    pub(crate) fn account(&mut self, id: u64, token: u64, st: OpStatus, local: bool) {
        match st {
            OpStatus::Done => {}
            OpStatus::InProgress => {
                self.tokens.insert(
                    token,
                    Tok {
                        req: id,
                        what: TokWhat::Plain,
                        local,
                    },
                );
                if let Some(r) = self.reqs.get_mut(&id) {
                    r.outstanding += 1;
                }
            }
        }
    }

    /// Record a posted operation of a pipeline (`local`: see [`Tok::local`]).
    pub(crate) fn post_tok(
        &mut self,
        req: u64,
        token: u64,
        st: OpStatus,
        what: TokWhat,
        local: bool,
    ) {
        let tok = Tok { req, what, local };
        match st {
            OpStatus::InProgress => {
                self.tokens.insert(token, tok);
            }
            OpStatus::Done => self.done_q.push_back((tok, Ok(()))),
        }
    }

    pub(crate) fn on_event(&mut self, _iface: usize, ev: Event<'_>) {
        match ev {
            Event::Am { id, data } => {
                if let Err(e) = self.on_am(id, data) {
                    tracing::warn!("dropped a malformed or unexpected protocol message: {e}");
                }
            }
            Event::Completion { token, result } => {
                let Some(tok) = self.tokens.remove(&token) else {
                    return;
                };
                self.on_tok(tok, result);
            }
            Event::EpError { user_id, error } => {
                self.fail_peer(user_id as usize, &error.to_string());
            }
        }
    }

    /// A completion arrived (or an operation finished at once).
    /// Handle the pipeline steps that finished at once; how many.
    #[inline(never)]
    pub(crate) fn run_done_q(&mut self) -> usize {
        let mut n = 0;
        while let Some((tok, res)) = self.done_q.pop_front() {
            self.on_tok(tok, res);
            n += 1;
        }
        n
    }

    pub(crate) fn on_tok(&mut self, tok: Tok, result: Result<()>) {
        match tok.what {
            TokWhat::Plain => self.on_completion(tok.req, result),
            // The staged receive's reads and copies: its state machine goes on.
            what @ (TokWhat::PullGet { .. } | TokWhat::H2D { .. } | TokWhat::DirectH2D { .. }) => {
                self.on_recv_step(tok.req, what, result)
            }
            // A staged send's copy to staging: its state machine announces the fragments.
            what @ TokWhat::StageD2H { .. } => self.on_stage_copy(tok.req, what, result),
        }
    }

    pub(crate) fn on_completion(&mut self, id: u64, result: Result<()>) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        r.outstanding = r.outstanding.saturating_sub(1);
        if let ReqKind::Rma(rm) = &mut r.kind {
            rm.note_outstanding(r.outstanding);
        }
        if let ReqKind::Recv(RecvState {
            proto: RecvProto::Landing(l),
            ..
        }) = &mut r.kind
        {
            l.inflight = r.outstanding;
        }
        if r.outstanding == 0 && r.result.is_some() {
            // The last operation of a request that ended early (a failure): its pinned window
            // goes back to the worker.
            self.reclaim_window(id);
            return;
        }
        if let ReqKind::Recv(RecvState {
            proto: RecvProto::Rndv(rv),
            ..
        }) = &r.kind
            && r.result.is_none()
            && (rv.via_get || result.is_err())
        {
            // A read of a rendezvous receive: its state machine says what comes next (a failed
            // read falls back to streaming: not one byte lost).
            let outstanding = r.outstanding;
            self.rndv_recv_step(id, |rv, io| rv.on_read(io, id, outstanding, result));
            return;
        }
        if matches!(r.kind, ReqKind::Rma(_)) && r.result.is_none() {
            // A put, get or flush: its state machine says what comes next (a failure ends it).
            self.on_rma_done(id, result);
            return;
        }
        if matches!(r.kind, ReqKind::Send(_)) && r.result.is_none() {
            // The send's protocol says what comes next (a failure ends it, and tells the
            // receiver).
            let outstanding = r.outstanding;
            self.send_transfer(id, outstanding, result);
            return;
        }
        if let Err(e) = result {
            self.fail(id, e);
            return;
        }
        if let ReqKind::Recv(RecvState {
            proto: RecvProto::Landing(_),
            ..
        }) = &r.kind
        {
            // A GPU stream receive's copies to the GPU: each completion frees a slot.
            self.on_landing_op(id);
        }
    }
}

/// The protocols' I/O over the worker's interfaces, peers and context.
impl ProtoIo for State {
    #[inline]
    fn post(
        &mut self,
        req: u64,
        p: usize,
        lane: usize,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        self.post_counted(req, p, lane, op)
    }

    fn register(&mut self, req: u64, lane: usize, region: MemRegion) -> Result<()> {
        let md = self.slots[lane].md;
        let g = self.register_md(md, region)?;
        if let Some(r) = self.reqs.get_mut(&req) {
            crate::spare::push_guard(&mut r.guards, g);
        }
        Ok(())
    }

    fn register_md(&mut self, md: usize, region: MemRegion) -> Result<RegGuard> {
        self.ctx.register(md, region)
    }

    fn may_register(&self, md: usize, mem: MemoryType, dev: Option<u32>) -> bool {
        self.ctx.can_register(md, mem, dev)
    }

    #[inline]
    fn ctrl(&mut self, p: usize, m: &Msg<'_>) {
        self.send_msg(p, m);
    }

    fn unpack_key(&self, md: usize, key: &[u8]) -> Result<RemoteKey> {
        self.ctx.domain(md).rkey_unpack(key)
    }

    fn pack_key(&self, md: usize, g: &RegGuard) -> Result<NamedKey> {
        let d = self.ctx.domain(md);
        Ok(NamedKey {
            md: d.name().to_string(),
            key: d.mkey_pack(g.registration())?,
        })
    }

    #[inline]
    fn uuid(&self) -> u64 {
        self.address.uuid
    }

    fn count(&mut self, what: &'static str) {
        State::count(self, what);
    }

    fn lane_md(&self, lane: usize) -> usize {
        self.slots[lane].md
    }

    fn keep_regs(&mut self, req: u64, md: Option<usize>) {
        let ctx = &self.ctx;
        if let Some(r) = self.reqs.get_mut(&req) {
            match md {
                Some(m) => {
                    let name = ctx.domain(m).name();
                    r.guards.retain(|g| g.registration().domain() == name)
                }
                None => r.guards.clear(),
            }
        }
    }

    fn outstanding(&self, req: u64) -> usize {
        self.reqs.get(&req).map_or(0, |r| r.outstanding)
    }

    fn next_msg(&mut self, p: usize) -> u64 {
        State::next_msg(self, p)
    }
}

/// What the send side of a rendezvous asks of the worker: the plan's choice, the send's
/// registrations.
impl SendIo for State {
    fn rndv_pick(&mut self, _req: u64, head: &SendHead, replan: bool) -> RndvPick {
        let (p, key) = (head.peer, MemKey::new(head.mem, head.dev));
        let proto = if replan {
            self.refresh_plan(p);
            // From the table of the send's own operation (a synchronous send's rows all wait
            // for the match); a rendezvous stays one.
            self.peers[p]
                .plan
                .select(head.op, key, head.len)
                .filter(|x| x.is_rndv())
                .unwrap_or(head.proto)
        } else {
            head.proto
        };
        // The lane the data moves on, as the plan says now: the GPU lane of that memory, or
        // the host RMA lane.
        let lane = if key.mem.is_gpu() {
            self.peers[p].plan.lanes.gpu(key)
        } else {
            self.peers[p].rma
        };
        RndvPick {
            proto,
            lane,
            lanes_pending: self.peers[p].needs_lanes,
        }
    }

    fn req_key(&self, req: u64, md: usize) -> Result<NamedKey> {
        let g = self.reg_guard(req, md).ok_or_else(|| {
            Error::Internal(format!(
                "request {req} holds no registration with {}",
                self.ctx.domain(md).name()
            ))
        })?;
        self.pack_key(md, g)
    }

    fn reg(&self, req: u64, md: usize) -> Option<MemHandle> {
        self.reg_guard(req, md).map(|g| g.registration().clone())
    }

    fn register_write_source(&mut self, req: u64, lane: usize) -> Result<()> {
        self.register_put_source(req, lane)
    }

    fn replan_peer(&mut self, p: usize) {
        self.refresh_plan(p);
    }

    fn write_hint(&self, p: usize) -> Option<NamedKey> {
        self.gpu_write_hint(p)
    }

    fn shared_gpu_hint(&self, p: usize, dev: Option<u32>, lane: usize) -> Option<NamedKey> {
        State::shared_gpu_hint(self, p, dev, lane)
    }
}

impl State {
    /// Request `req`'s registration with domain `md` (the latest, when it holds several).
    fn reg_guard(&self, req: u64, md: usize) -> Option<&RegGuard> {
        let name = self.ctx.domain(md).name();
        self.reqs
            .get(&req)?
            .guards
            .iter()
            .rev()
            .find(|g| g.registration().domain() == name)
    }
}
