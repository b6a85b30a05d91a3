//! Request plumbing used by [`Scope`](crate::Scope): posting sends, receives, streams, remote
//! memory access and flushes, reading results, waiting, canceling, and ending a scope. A send
//! looks its protocol up in the plan and hands the request to `proto/`.

use crate::worker::prelude::*;

impl Worker {
    /// Post a tag send; with `sync`, it completes only once the receiver matched it (small
    /// messages carry a request for an acknowledgement, larger ones use the rendezvous, which
    /// completes after the match anyway).
    pub(crate) fn post_send(
        &self,
        ep: EpId,
        buf: SendBuf<'_>,
        tag: Tag,
        sync: bool,
    ) -> Result<Posted> {
        rucx_ucs::profile::mark("tag.send", buf.len as u64);
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        let (addr, len) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(addr, len)?,
        };
        let key = MemKey::new(mem, dev);
        if mem.is_gpu() {
            st.note_gpu_key(key);
        }
        self.ensure_plan(&mut st, p);
        // Fast path: a small host message the plan sends eager-short (its cached size range:
        // what `select` would answer, without the table look-ups) that finds the lane idle
        // goes out at once, without a request in the table; otherwise the general path below
        // decides, as before.
        let cached_short = !sync
            && mem == MemoryType::Host
            && dev.is_none()
            && st.peers[p]
                .plan
                .short_tag_host
                .is_some_and(|(from, to)| (from..=to).contains(&len));
        if cached_short && st.try_eager_short(p, addr, len, tag)? {
            st.inline_short += 1;
            return Ok(Posted::Done(Completion {
                len,
                tag,
                sender: None,
            }));
        }
        let op = if sync { Op::TagSync } else { Op::Tag };
        let proto = match st.peers[p].plan.select(op, key, len) {
            Some(p) => p,
            None => {
                let table = st.peers[p].plan.table(op, key);
                return Err(table.refusal(&st.peers[p].remote.describe()));
            }
        };
        let proto = if proto == Proto::EagerBounce {
            match self.send_bounce(&mut st, p, addr, len, tag, (mem, dev), op)? {
                Bounced::Sent(posted) => return Ok(posted),
                Bounced::Instead(proto) => proto,
            }
        } else {
            proto
        };
        // Fast path: a small host message that fits one `am_short` and finds the lane idle is
        // sent at once, without a request in the table.
        if !sync
            && !cached_short
            && proto == Proto::EagerShort
            && !mem.is_gpu()
            && st.try_eager_short(p, addr, len, tag)?
        {
            st.inline_short += 1;
            return Ok(Posted::Done(Completion {
                len,
                tag,
                sender: None,
            }));
        }
        let id = st.new_req(ReqKind::Send(SendState::new(
            p, addr, len, tag, proto, op, mem, dev,
        )));
        st.start_send(id);
        Ok(Posted::Pending(id))
    }

    #[inline]
    pub(crate) fn post_recv(&self, buf: RecvBuf<'_>, tag: Tag, mask: Tag) -> u64 {
        rucx_ucs::profile::mark("tag.recv", buf.len as u64);
        let mut st = self.st.borrow_mut();
        let (addr, cap) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => match st.ctx.detect(addr, cap) {
                Ok(m) => m,
                Err(e) => {
                    let id = st.new_req(ReqKind::Rma(RmaState::flush(
                        usize::MAX,
                        Vec::new(),
                        Vec::new(),
                    )));
                    st.finish(id, Err(e));
                    return id;
                }
            },
        };
        // Built in its slot (the request is a few hundred bytes; a move costs a memcpy call).
        let id = st.reqs.insert_with(|| Req {
            kind: ReqKind::Recv(RecvState::tag(addr, cap, tag, mem, dev)),
            result: None,
            outstanding: 0,
            guards: Vec::new(),
        });
        if let Some((mtag, u, _)) = st.matcher.post_recv(tag, mask, Waiter::Req(id)) {
            st.matched(id, mtag, u);
        }
        id
    }

    /// Append `buf` to the byte stream to `ep` in pieces packed straight from `buf`; the request
    /// finishes once every piece was handed to the transport (the sender's flow control).
    pub(crate) fn post_stream_send(&self, ep: EpId, buf: SendBuf<'_>) -> Result<Posted> {
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(buf.addr, buf.len)?,
        };
        let key = MemKey::new(mem, dev);
        if mem.is_gpu() {
            st.note_gpu_key(key);
        }
        st.refresh_plan(p);
        let t = st.peers[p].plan.table(Op::Stream, key);
        if t.rows.is_empty() {
            return Err(t.refusal(&st.peers[p].remote.describe()));
        }
        // GPU memory is copied to host memory first, by the copy lane (`proto/memcopy.rs`);
        // the pieces are packed from that copy, held until the request ends.
        let (addr, held) = if mem.is_gpu() {
            let host = self.gpu_to_host(&mut st, buf.addr, buf.len, mem, dev)?;
            (host.as_ptr() as usize, Some(host))
        } else {
            (buf.addr, None)
        };
        // The pieces are packed from `buf` as the transport takes them: the buffer stays lent
        // to the request's scope until the request finishes, after the last piece.
        let id = st.new_req(ReqKind::Send(SendState::new(
            p,
            addr,
            buf.len,
            0,
            Proto::EagerBcopy,
            Op::Stream,
            MemoryType::Host,
            None,
        )));
        if let Some(h) = held {
            st.stream_host.insert(id, h);
        }
        let am = st.peers[p].am;
        let len = buf.len;
        let max_bcopy = st.slots[am].attr.limits.am_max_bcopy;
        for (off, n) in proto::stream::pieces(len, max_bcopy) {
            st.peers[p]
                .queue
                .push_back(Pending::StreamPiece { id, off, len: n });
        }
        st.peers[p].queue.push_back(Pending::Finish { id, len });
        st.pump(p);
        st.count("stream send");
        Ok(Posted::Pending(id))
    }

    /// Receive exactly `buf.len` bytes into `buf` (host or GPU memory) from the byte stream of
    /// `ep`.
    pub(crate) fn post_stream_recv(&self, ep: EpId, buf: RecvBuf<'_>) -> Result<u64> {
        self.post_stream_recv_with(ep, buf, false)
    }

    /// [`post_stream_recv`](Self::post_stream_recv), or with `partial` a receive that
    /// completes with the bytes at hand as soon as there is one (host memory; into GPU memory
    /// it waits for all).
    pub(crate) fn post_stream_recv_with(
        &self,
        ep: EpId,
        buf: RecvBuf<'_>,
        partial: bool,
    ) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        let p = st.ep_index(ep)?;
        let (addr, cap) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(addr, cap)?,
        };
        // GPU memory: the stream fills a host buffer, copied on by the copy lane when full
        // (`proto/memcopy.rs`); registered with the copy lane now, so a refusal is told here.
        let (stream_bounce, dev_memh) = if mem.is_gpu() && cap > 0 {
            let (b, k) = st.gpu_stream_bounce(addr, cap, mem, dev)?;
            (Some(b), Some(Box::new(k)))
        } else {
            (None, None)
        };
        let id = st.new_req(ReqKind::Recv(RecvState {
            total: cap,
            sender: Some(p),
            dev_memh,
            proto: RecvProto::Stream {
                partial: partial && stream_bounce.is_none(),
                bounce: stream_bounce,
            },
            ..RecvState::tag(addr, cap, 0, mem, dev)
        }));
        if cap == 0 {
            // Needs no bytes: complete now rather than wait in line.
            st.finish(id, Ok(Completion::from_peer(0, ep)));
            return Ok(id);
        }
        let st = &mut *st;
        // The endpoint ended (the peer closed it, it failed): the bytes that arrived before
        // are still received; what they do not fill ends with `StreamIncomplete`.
        let cause = st.peers[p].stream_rx.ended().then(|| {
            st.check_peer(p).err().unwrap_or_else(|| {
                Error::Internal(format!("the stream of ep{p} ended on a usable endpoint"))
            })
        });
        if let Some(c) = &cause
            && mem.is_gpu()
        {
            // Its copy to the GPU would go through the endpoint, which is gone: the bytes
            // stay for a host receive.
            st.finish(
                id,
                Err(Error::StreamIncomplete {
                    received: 0,
                    wanted: cap,
                    cause: Box::new(c.clone()),
                }),
            );
            return Ok(id);
        }
        let (reqs, peer) = (&mut st.reqs, &mut st.peers[p]);
        let mut io = StreamReqs::new(reqs, EpId::new(p, st.ep_base));
        if let Some(c) = cause {
            io = io.ended_by(c);
        }
        peer.stream_rx.post(&mut io, id);
        let StreamReqs { ended, landed, .. } = io;
        if !ended.is_empty() {
            st.note_stream_ends(&ended);
        }
        if !landed.is_empty() {
            st.land_gpu_streams(p, landed);
        }
        Ok(id)
    }

    pub(crate) fn post_rma(
        &self,
        ep: EpId,
        put: bool,
        (addr, len, mem): (usize, usize, Option<(MemoryType, Option<u32>)>),
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        let (mem, dev) = match mem {
            Some(m) => m,
            None => st.ctx.detect(addr, len)?,
        };
        let local = MemKey::new(mem, dev);
        if mem.is_gpu() {
            st.note_gpu_key(local);
        } else if rkey.mem_type().is_gpu() {
            // A peer's GPU region: plan the lane that reaches it (connected below).
            st.note_gpu_key(MemKey::new(MemoryType::Cuda, None));
        }
        self.ensure_plan(&mut st, p);
        st.post_rma(p, put, addr, len, local, remote, rkey)
    }

    /// A flush of `ep`; refused when the endpoint is not usable (failed, closed), with the
    /// error that says why, which also stands for the unreported error of its puts, gets and
    /// atomics ([`State::take_rma_error`]: dropped, reported once).
    pub(crate) fn post_flush(&self, ep: EpId) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        match st.check_ep(ep) {
            Ok(p) => st.post_flush(p),
            Err(e) => {
                if let Ok(p) = st.ep_index(ep) {
                    st.take_rma_error(p);
                }
                Err(e)
            }
        }
    }

    pub(crate) fn req_result(&self, id: u64) -> Option<Result<Completion>> {
        let st = self.st.borrow();
        match st.reqs.get(&id) {
            // The usual looks first: still pending, or ended well.
            Some(Req { result: None, .. }) => None,
            Some(Req {
                result: Some(Ok(c)),
                ..
            }) => Some(Ok(*c)),
            // Ended early, with copies still on its buffer: not reported until they finish.
            Some(Req {
                result: Some(Err(_)),
                ..
            }) if st.draining(id) => None,
            // Every look (test, wait, await) reports the error the request really had.
            Some(r) => r.result.clone(),
            None => Some(Err(Error::Internal(format!("request {id} is unknown")))),
        }
    }

    /// An empty list for a new scope's request ids.
    pub(crate) fn take_id_list(&self) -> Vec<u64> {
        self.id_lists.borrow_mut().pop().unwrap_or_default()
    }

    /// End of a scope: cancel its receives that never matched, wait for everything else, and
    /// release the requests.
    pub(crate) fn finish_scope(&self, mut ids: Vec<u64>) {
        {
            let mut st = self.st.borrow_mut();
            // Requests that ended well (the usual case) are released in this pass, under the
            // same borrow: nothing of ours can still run on their buffers (only a request that
            // ended with an error can be draining).
            let mut kept = 0;
            for i in 0..ids.len() {
                let id = ids[i];
                match st.reqs.get(&id) {
                    Some(Req {
                        result: Some(Ok(_)),
                        ..
                    }) => {
                        st.reqs.remove(&id);
                        continue;
                    }
                    Some(Req { result: None, .. }) => {
                        if st
                            .matcher
                            .cancel_expected(|e| *e == Waiter::Req(id))
                            .is_some()
                        {
                            st.finish(id, Err(Error::Canceled));
                        } else {
                            st.stream_cancel(id);
                        }
                    }
                    _ => {}
                }
                ids[kept] = id;
                kept += 1;
            }
            ids.truncate(kept);
        }
        if !ids.is_empty() {
            self.finish_scope_wait(&ids);
        }
        ids.clear();
        let mut lists = self.id_lists.borrow_mut();
        if lists.len() < 8 {
            lists.push(ids);
        }
    }

    /// The rest of a scope's end: wait for the requests still pending (or draining) and
    /// release each once it is done.
    #[inline(never)]
    fn finish_scope_wait(&self, ids: &[u64]) {
        let mut backoff = liveness::Backoff::new();
        for id in ids {
            loop {
                let mut st = self.st.borrow_mut();
                match st.reqs.get(id) {
                    Some(r) if r.result.is_none() => {}
                    // Ended early (an abort, a failed peer, a forced close) while copies of
                    // this process (the copy lane, a copy engine's lane) or, canceled, the
                    // transport's operations still run on its buffer: they finish first, so
                    // the buffer is the caller's again only once nothing of ours touches it.
                    // (Only a request that ended with an error can; the check scans the
                    // tokens, so successful requests skip it.)
                    Some(r)
                        if r.result.as_ref().is_some_and(|x| x.is_err()) && st.draining(*id) => {}
                    _ => {
                        st.reqs.remove(id);
                        break;
                    }
                }
                drop(st);
                if self.progress() == 0 {
                    backoff.idle(self);
                } else {
                    backoff.busy();
                }
            }
        }
    }

    /// Fault injection for tests: buffers the worker allocates by a message's size (an eager
    /// message that arrived before its receive, a user active message) fail above `limit`
    /// bytes as if the system had no memory for them (`None`: no limit but the system's).
    #[doc(hidden)]
    pub fn inject_alloc_limit(&self, limit: Option<usize>) {
        self.st.borrow_mut().msg_alloc.limit = limit;
    }

    /// Requests in the worker's table: those of open scopes (a leak check for tests).
    pub fn live_requests(&self) -> usize {
        self.st.borrow().reqs.len()
    }

    /// Cancel a receive that has not matched yet. Returns true when it was canceled.
    pub(crate) fn cancel_recv(&self, id: u64) -> bool {
        let canceled = {
            let mut st = self.st.borrow_mut();
            if st
                .matcher
                .cancel_expected(|e| *e == Waiter::Req(id))
                .is_some()
            {
                st.finish(id, Err(Error::Canceled));
                true
            } else {
                st.stream_cancel(id)
            }
        };
        if canceled {
            self.wake_finished();
        }
        canceled
    }

    /// Progress until request `id` finished or `limit` passed.
    pub(crate) fn wait_req(&self, id: u64, limit: Option<Duration>) -> Result<Completion> {
        // The clock is read only when there is a limit: it is not free on the hot path.
        let start = limit.map(|_| Instant::now());
        let mut backoff = liveness::Backoff::until(start.zip(limit).map(|(s, l)| s + l));
        loop {
            if let Some(r) = self.req_result(id) {
                return r;
            }
            if let (Some(l), Some(t)) = (limit, start)
                && t.elapsed() > l
            {
                return Err(Error::Timeout {
                    after: l,
                    what: format!("request {id}"),
                });
            }
            if self.progress() == 0 {
                // Poll flat out first (a pause instruction costs tens of cycles on some CPUs,
                // straight onto the latency), and ease off only when nothing comes for a while:
                // after a millisecond, yield, then arm and sleep on the worker's events
                // (`events.rs`) until a message or completion comes.
                backoff.idle(self);
            } else {
                backoff.busy();
            }
        }
    }
}
