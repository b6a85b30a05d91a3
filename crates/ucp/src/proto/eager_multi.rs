//! Multi-fragment eager (copy-in `am_bcopy` fragments, or zero-copy `am_zcopy` from the
//! registered buffer), whose fragment loop also streams a rendezvous through active messages
//! (the `am` scheme, and a split's tail).

use crate::worker::prelude::*;

impl State {
    pub(crate) fn stream_send(&mut self, id: u64) -> Result<bool> {
        if let ReqKind::Send(s) = &self.reqs[&id].kind
            && s.rndv.deferred
            && s.rndv.rreq.is_none()
            && s.wait == SendWait::Posting
        {
            // A request to send that waits for a lane (see `send_rts`); the progress loop
            // connects it before it posts the queue again.
            if self.peers[s.peer].needs_lanes {
                return Ok(false);
            }
            self.send_rts(id);
            return Ok(true);
        }
        if matches!(&self.reqs[&id].kind, ReqKind::Send(s) if s.rndv.stage.is_some()) {
            return self.stream_stage(id);
        }
        let ReqKind::Send(s) = &self.reqs[&id].kind else {
            return Ok(true);
        };
        let (p, addr, len, proto, posted, msg_id, tag) =
            (s.peer, s.addr, s.len, s.proto, s.posted, s.msg_id, s.tag);
        let rndv_to = s.rndv.rreq;
        let put = s.rndv.put.clone();
        let src = self.address.uuid;
        if let Some((raddr, rkey, lane)) = put {
            return self.stream_put(id, p, lane, addr, len, raddr, &rkey);
        }
        let am = self.peers[p].am;
        let limits = self.slots[am].attr.limits;
        // Zero-copy from a registration of the AM lane's domain; a streamed split tail is
        // copied in (its registrations serve the receiver's reads of the head).
        let split_tail = s.rndv.split_left > 0;
        let am_name = self.ctx.domain(self.slots[am].md).name();
        let zcopy = !split_tail
            && self.reqs[&id]
                .guards
                .first()
                .is_some_and(|g| g.registration().domain() == am_name)
            && (proto == Proto::EagerZcopy || rndv_to.is_some());
        let total = len;
        let mut off = posted;
        loop {
            // Header for this fragment: the message without its data.
            let (head, room) = match rndv_to {
                Some(rreq) => (
                    Msg::RndvData {
                        src,
                        rreq,
                        offset: off as u64,
                        data: &[],
                    },
                    proto::MIDDLE_OVERHEAD,
                ),
                None if off == 0 => (
                    Msg::EagerFirst {
                        src,
                        kind: MsgKind::Tag,
                        tag,
                        msg_id,
                        total: total as u64,
                        data: &[],
                    },
                    proto::FIRST_OVERHEAD,
                ),
                None => (
                    Msg::EagerMiddle {
                        src,
                        msg_id,
                        offset: off as u64,
                        data: &[],
                    },
                    proto::MIDDLE_OVERHEAD,
                ),
            };
            let mut h = Vec::with_capacity(40);
            let am_id = head.encode_into(&mut h);
            let n;
            if zcopy {
                n = limits.am_max_zcopy.min(self.frag).min(total - off);
                let memh = self.reqs[&id].guards[0].registration().clone();
                let iov = [Iov {
                    addr: addr + off,
                    len: n,
                    memh: &memh,
                }];
                let iov: &[Iov<'_>] = if n == 0 { &[] } else { &iov };
                if !self.post(id, p, am, |ep, t| ep.am_zcopy(am_id, &h, iov, t))? {
                    return Ok(false);
                }
            } else {
                n = (limits.am_max_bcopy - room).min(total - off);
                // SAFETY: the scope keeps the send buffer alive while the request exists.
                let data = unsafe { host_slice(addr + off, n) };
                let ep = self.peers[p].eps.get_mut(&am).expect("am lane");
                let res = ep.am_bcopy(am_id, &mut |buf: &mut [u8]| {
                    let need = h.len() + n;
                    if let Some(dst) = buf.get_mut(..need) {
                        dst[..h.len()].copy_from_slice(&h);
                        dst[h.len()..].copy_from_slice(data);
                    }
                    need
                });
                match res {
                    Ok(_) => {}
                    Err(e) if e.is_retryable() => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            off += n;
            if let Some(Req {
                kind: ReqKind::Send(s),
                ..
            }) = self.reqs.get_mut(&id)
            {
                s.posted = off;
            }
            if off >= total {
                break;
            }
        }
        let r = self.reqs.get_mut(&id).expect("request");
        if let ReqKind::Send(s) = &mut r.kind {
            s.wait = SendWait::Completions;
        }
        if r.outstanding == 0 && self.split_step(id) {
            self.finish(
                id,
                Ok(Completion {
                    len,
                    tag,
                    sender: None,
                }),
            );
        }
        Ok(true)
    }

    /// The first fragment of a multi-fragment message (tagged, or a user active message).
    pub(crate) fn on_eager_first(
        &mut self,
        src: u64,
        kind: MsgKind,
        tag: Tag,
        msg_id: u64,
        total: usize,
        data: &[u8],
    ) -> Result<()> {
        if self.rx_aborted > 0
            && let Some(RxDest::Aborted) = self.rx.get(&(src, msg_id))
        {
            // Given up by the sender before this fragment came: dropped.
            self.rx.remove(&(src, msg_id));
            self.rx_aborted -= 1;
            let _ = self.src_peer(src)?;
            return Ok(());
        }
        let p = self.src_peer(src)?;
        if kind == MsgKind::Am {
            let mut d = Vec::new();
            if let Err(e) = self.msg_alloc.reserve(&mut d, total) {
                tracing::warn!("active message {tag} dropped: {e}");
                let left = total.saturating_sub(data.len());
                if left > 0 {
                    self.rx.insert((src, msg_id), RxDest::Discard { left });
                }
                return Ok(());
            }
            d.extend_from_slice(data);
            let dest = RxDest::UserAm {
                id: tag as u16,
                total,
                data: d,
            };
            self.rx.insert((src, msg_id), dest);
            self.maybe_finish_user_am(src, msg_id, p);
            return Ok(());
        }
        let u = Unexp::Eager {
            src: p,
            msg_id: Some(msg_id),
            total,
            data: Vec::new(),
            sync: None,
            lost: false,
        };
        match self.matcher.arrive(tag, u) {
            Some((rid, _)) => {
                self.rx.insert((src, msg_id), RxDest::Req(rid));
                self.recv_begin(rid, p, tag, total);
                self.recv_data(rid, 0, data);
                if self.recv_complete(rid) {
                    self.rx.remove(&(src, msg_id));
                }
            }
            None => {
                let a = self.msg_alloc;
                let mut dest = RxDest::Unexpected;
                if let Some(Unexp::Eager { data: d, lost, .. }) =
                    self.matcher.unexpected_mut().last()
                {
                    match a.reserve(d, total) {
                        Ok(()) => d.extend_from_slice(data),
                        Err(e) => {
                            tracing::warn!("unexpected message dropped: {e}");
                            *lost = true;
                            let left = total.saturating_sub(data.len());
                            dest = RxDest::Discard { left };
                        }
                    }
                }
                if !matches!(dest, RxDest::Discard { left: 0 }) {
                    self.rx.insert((src, msg_id), dest);
                }
            }
        }
        Ok(())
    }

    /// A later fragment: into the matched receive, the unexpected message, or the user active
    /// message it belongs to.
    pub(crate) fn on_eager_middle(
        &mut self,
        src: u64,
        msg_id: u64,
        offset: usize,
        data: &[u8],
    ) -> Result<()> {
        let p = self.src_peer(src)?;
        let key = (src, msg_id);
        match self.rx.get_mut(&key) {
            Some(RxDest::Req(rid)) => {
                let rid = *rid;
                self.recv_data(rid, offset, data);
                if self.recv_complete(rid) {
                    self.rx.remove(&key);
                }
            }
            Some(RxDest::Unexpected) => {
                let mut done = false;
                for u in self.matcher.unexpected_mut() {
                    if let Unexp::Eager {
                        src: s,
                        msg_id: Some(m),
                        total,
                        data: d,
                        ..
                    } = u
                        && *s == p
                        && *m == msg_id
                    {
                        if d.len() == offset {
                            d.extend_from_slice(data);
                        }
                        done = d.len() >= *total;
                        break;
                    }
                }
                if done {
                    self.rx.remove(&key);
                }
            }
            Some(RxDest::UserAm { data: d, .. }) => {
                if d.len() == offset {
                    d.extend_from_slice(data);
                }
                self.maybe_finish_user_am(src, msg_id, p);
            }
            Some(RxDest::Discard { left }) => {
                *left = left.saturating_sub(data.len());
                if *left == 0 {
                    self.rx.remove(&key);
                }
            }
            Some(RxDest::Aborted) => {}
            None => {
                return Err(Error::InvalidAddress(format!(
                    "fragment of unknown message {msg_id}"
                )));
            }
        }
        Ok(())
    }

    /// Tell peer `p` that multi-fragment message `msg_id` will not be completed.
    pub(crate) fn send_eager_abort(&mut self, p: usize, msg_id: u64, reason: &str) {
        if self.peers.get(p).is_none_or(|x| x.failed.is_some()) {
            return;
        }
        tracing::debug!(
            "multi-fragment message {msg_id} to {} given up part-way: {reason}",
            self.peers[p].remote.describe()
        );
        let src = self.address.uuid;
        self.ctrl(
            p,
            &Msg::EagerAbort {
                src,
                msg_id,
                reason,
            },
        );
        self.pump(p);
    }

    /// The sender gave multi-fragment message `msg_id` up: a receive that matched it ends with
    /// `PeerAborted`; an unexpected partial message is dropped; fragments still to come (or,
    /// delivered out of order, the first one) are dropped when they arrive.
    pub(crate) fn on_eager_abort(&mut self, src: u64, msg_id: u64, reason: &str) -> Result<()> {
        let p = self.src_peer(src)?;
        let key = (src, msg_id);
        match self.rx.remove(&key) {
            Some(RxDest::Req(rid)) => {
                let peer = self.peers[p].remote.describe();
                self.finish(
                    rid,
                    Err(Error::PeerAborted {
                        peer,
                        reason: reason.to_string(),
                    }),
                );
            }
            Some(RxDest::Unexpected) => {
                self.matcher.drop_unexpected(|u| {
                    matches!(u, Unexp::Eager { src: s, msg_id: Some(m), .. } if *s == p && *m == msg_id)
                });
            }
            Some(RxDest::UserAm { .. }) => {}
            // Dropped already (no memory for it); the fragments still to come are not.
            Some(RxDest::Discard { .. }) => {}
            Some(RxDest::Aborted) => {
                self.rx.insert(key, RxDest::Aborted);
            }
            None => {
                // Its first fragment has not come yet (delivered out of order; the sender
                // aborts only messages it stopped posting part-way, so a first fragment went
                // out and will come).
                self.rx.insert(key, RxDest::Aborted);
                self.rx_aborted += 1;
            }
        }
        Ok(())
    }
}
