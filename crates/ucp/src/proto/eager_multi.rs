//! Multi-fragment eager (copy-in `am_bcopy` fragments, or zero-copy `am_zcopy` from the
//! registered buffer), whose fragment loop also streams a rendezvous through active messages
//! (the `am` scheme, and a split's tail).

use crate::worker::prelude::*;

impl State {
    pub(crate) fn stream_send(&mut self, id: u64) -> Result<bool> {
        if matches!(&self.reqs[&id].kind, ReqKind::Send(s) if s.stage.is_some()) {
            return self.stream_stage(id);
        }
        let ReqKind::Send(s) = &self.reqs[&id].kind else {
            return Ok(true);
        };
        let (p, addr, len, proto, posted, msg_id, tag) =
            (s.peer, s.addr, s.len, s.proto, s.posted, s.msg_id, s.tag);
        let rndv_to = s.rndv_to;
        let put = s.put.clone();
        let src = self.address.uuid;
        if let Some((raddr, rkey, lane)) = put {
            return self.stream_put(id, p, lane, addr, len, raddr, &rkey);
        }
        let am = self.peers[p].am;
        let limits = self.slots[am].attr.limits;
        // Zero-copy from a registration of the AM lane's domain; a streamed split tail is
        // copied in (its registrations serve the receiver's reads of the head).
        let split_tail = s.split_left > 0;
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
}
