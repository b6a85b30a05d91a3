//! GPU bounce eager: a small GPU message copied to a pinned bounce fragment by the copy lane
//! and sent eagerly; eager bytes that land in GPU memory copied on with the copy lane.

use crate::worker::prelude::*;

impl State {
    /// Copy arrived eager bytes into GPU memory through the copy lane (small messages).
    pub(crate) fn copy_to_gpu(&mut self, rid: u64, offset: usize, data: &[u8]) -> Result<()> {
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

impl Worker {
    /// Copy a small GPU buffer into a send staging fragment and wait for the copy (it takes a
    /// few microseconds); returns the fragment's address and index.
    pub(crate) fn bounce(
        &self,
        st: &mut State,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(usize, usize)> {
        st.ensure_staging()?;
        let (memh, key) = st.copy_key(addr, len, mem, dev)?;
        let stg = st.staging.as_mut().expect("staging");
        let f = stg
            .free_send
            .pop()
            .ok_or_else(|| Error::NoResource("every send staging fragment is in use".into()))?;
        if len > stg.frag {
            stg.free_send.push(f);
            return Err(Error::InvalidParam("bounce larger than a fragment".into()));
        }
        let host = stg.addr(f);
        let smemh = stg.copy_memh.clone();
        let iov = [Iov {
            addr: host,
            len,
            memh: &smemh,
        }];
        let token = st.next_token;
        st.next_token += 1;
        let ci = st.copy.as_ref().expect("copy lane").0;
        // Progress the copy interface alone: `token`'s result once it came; other completions
        // are kept for later.
        let poll = |st: &mut State| {
            let mut mine = None;
            let mut others = Vec::new();
            self.ifaces.borrow_mut()[ci].progress(&mut |ev| {
                if let Event::Completion { token: t, result } = ev {
                    if t == token {
                        mine = Some(result);
                    } else {
                        others.push((t, result));
                    }
                }
            });
            for (t, r) in others {
                if let Some(tok) = st.tokens.remove(&t) {
                    st.done_q.push_back((tok, r));
                }
            }
            mine
        };
        let posted = loop {
            let (_, ep) = st.copy.as_mut().expect("copy lane");
            match ep.get_zcopy(&iov, addr as u64, &key, token) {
                // The copy lane is full: its copies in flight finish by themselves.
                Err(e) if e.is_retryable() => {
                    poll(st);
                }
                other => break other,
            }
        };
        let res = match posted {
            Ok(OpStatus::Done) => Ok(()),
            Ok(OpStatus::InProgress) => loop {
                if let Some(r) = poll(st) {
                    break r;
                }
            },
            Err(e) => Err(e),
        };
        drop(memh);
        match res {
            Ok(()) => Ok((host, f)),
            Err(e) => {
                if let Some(stg) = st.staging.as_mut() {
                    stg.free_send.push(f);
                }
                Err(e)
            }
        }
    }
}

/// What became of a small GPU send the plan gave to the bounce protocol.
pub(crate) enum Bounced {
    /// Copied out and sent eagerly.
    Sent(Posted),
    /// No bounce fragment now (or the copy failed): the table's rendezvous protocol carries it
    /// instead.
    Instead(Proto),
}

impl Worker {
    /// Send `len` bytes of GPU memory at `addr` to peer `p` through a pinned bounce fragment
    /// (the plan's protocol for small GPU messages of operation `op`), or say which protocol
    /// carries it instead.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_bounce(
        &self,
        st: &mut State,
        p: usize,
        addr: usize,
        len: usize,
        tag: Tag,
        (mem, dev): (MemoryType, Option<u32>),
        op: Op,
    ) -> Result<Bounced> {
        // Copied to a pinned bounce fragment and sent eagerly, rather than paying a rendezvous
        // round trip.
        match self.bounce(st, addr, len, mem, dev) {
            Ok((host, frag)) => {
                // The host table of the same operation: a synchronous send stays one.
                let hproto = st.peers[p]
                    .plan
                    .select(op, MemKey::HOST, len)
                    .unwrap_or(Proto::EagerBcopy);
                let id = st.new_req(ReqKind::Send(SendState::new(
                    p,
                    host,
                    len,
                    tag,
                    hproto,
                    op,
                    MemoryType::Host,
                    None,
                )));
                st.count(Proto::EagerBounce.name());
                // Eager protocols copy the bytes out before returning.
                st.start_send(id);
                if let Some(stg) = st.staging.as_mut() {
                    stg.free_send.push(frag);
                }
                return Ok(Bounced::Sent(Posted::Pending(id)));
            }
            Err(e) => tracing::debug!("no bounce buffer for a small GPU message ({e}); rendezvous"),
        }
        // Not bounced: the large-message protocol of the same table.
        let proto = st.peers[p]
            .plan
            .table(op, MemKey::new(mem, dev))
            .rows
            .last()
            .map(|r| r.proto)
            .filter(|p| p.is_rndv())
            .ok_or_else(|| Error::Internal("a GPU table without a rendezvous row".into()))?;
        Ok(Bounced::Instead(proto))
    }
}
