//! Incoming protocol messages: each is parsed once (`wire`) and handed to the protocol it
//! belongs to.

use crate::worker::prelude::*;

impl State {
    #[inline(always)]
    pub(crate) fn src_peer(&self, src: u64) -> Result<usize> {
        // Messages come in runs from one peer: remember the last one (uuids are never 0).
        let (last, p) = self.last_src.get();
        if last == src
            && let Some(peer) = self.peers.get(p)
        {
            peer.live.heard.set(true);
            return Ok(p);
        }
        self.src_peer_lookup(src)
    }

    /// [`src_peer`](Self::src_peer) for another peer than the last one: by its uuid.
    #[inline(never)]
    fn src_peer_lookup(&self, src: u64) -> Result<usize> {
        let p = self.by_uuid.get(&src).copied().ok_or_else(|| {
            Error::InvalidAddress(format!(
                "message from unknown worker {src:#x} (no wire-up yet)"
            ))
        })?;
        self.last_src.set((src, p));
        self.peers[p].live.heard.set(true);
        Ok(p)
    }

    /// `Ok(true)` when `rreq` is a live rendezvous receive matched to a message of peer `p`:
    /// what the data and the finish of a rendezvous may name; `Ok(false)` when it ended already
    /// (late bytes of a canceled or failed receive, dropped quietly). Anything else (a request
    /// of another peer, one not matched yet, a send) is refused, so a peer cannot write into
    /// or complete a receive that is not its own by naming its id.
    fn rndv_recv_from(&self, rreq: u64, p: usize) -> Result<bool> {
        match self.reqs.get(&rreq) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) if rs.sender == Some(p)
                && matches!(&rs.proto, RecvProto::Rndv(rv) if rv.peer == p) =>
            {
                Ok(true)
            }
            // Ended already (canceled, failed, truncated): late data is dropped quietly.
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: Some(_),
                ..
            }) if rs.sender == Some(p) => Ok(false),
            None => Ok(false),
            _ => Err(Error::InvalidParam(format!(
                "rendezvous data or finish from peer {p} names receive {rreq:#x}, which is not \
                 a rendezvous receive matched to that peer"
            ))),
        }
    }

    pub(crate) fn on_am(&mut self, id: AmId, data: &[u8]) -> Result<()> {
        rucx_ucs::profile::mark("am.recv", u64::from(id));
        // The most frequent message, decoded in place (`wire::parse` reads the same layout).
        if id == wire::AM_EAGER_SHORT
            && let Some((tag, rest)) = data.split_first_chunk::<8>()
            && let Some((src, payload)) = rest.split_first_chunk::<8>()
        {
            return self.on_eager_one(
                u64::from_le_bytes(*src),
                u64::from_le_bytes(*tag),
                payload,
                None,
            );
        }
        if let Some(r) = self.on_atomic_am(id, data) {
            return r;
        }
        match wire::parse(id, data)? {
            Msg::Wireup { ep, addr } => {
                let remote = WorkerAddress::unpack(addr)?;
                let p = self.peer_for_wireup(remote, ep)?;
                self.peers[p].live.heard.set(true);
            }
            Msg::EagerOne { src, tag, data } => self.on_eager_one(src, tag, data, None)?,
            Msg::StreamData { src, data } => {
                let p = self.src_peer(src)?;
                let (reqs, peer) = (&mut self.reqs, &mut self.peers[p]);
                let mut io = StreamReqs::new(reqs, EpId::new(p, self.ep_base));
                peer.stream_rx.arrive(&mut io, data);
                let StreamReqs { ended, landed, .. } = io;
                if !ended.is_empty() {
                    self.note_stream_ends(&ended);
                }
                if !landed.is_empty() {
                    self.land_gpu_streams(p, landed);
                }
            }
            Msg::EagerSync {
                src,
                tag,
                sreq,
                data,
            } => self.on_eager_one(src, tag, data, Some(sreq))?,
            Msg::EagerFirst {
                src,
                kind,
                tag,
                msg_id,
                total,
                data,
            } => self.on_eager_first(src, kind, tag, msg_id, total as usize, data)?,
            Msg::EagerMiddle {
                src,
                msg_id,
                offset,
                data,
            } => self.on_eager_middle(src, msg_id, offset as usize, data)?,
            Msg::EagerAbort {
                src,
                msg_id,
                reason,
            } => self.on_eager_abort(src, msg_id, reason)?,
            Msg::Rts {
                src,
                tag,
                sreq,
                size,
                addr,
                smem,
                keys,
            } => {
                let p = self.src_peer(src)?;
                let u = Unexp::Rts {
                    src: p,
                    sreq,
                    size: size as usize,
                    addr,
                    smem,
                    keys,
                };
                if let Some((w, u)) = self.matcher.arrive(tag, u) {
                    let rid = self.waiter_req(w);
                    self.matched(rid, tag, u);
                }
            }
            Msg::Ats { src, sreq, ok } => {
                let p = self.src_peer(src)?;
                self.on_ats(p, sreq, ok);
            }
            Msg::Rtr {
                src,
                sreq,
                rreq,
                addr,
                size,
                offset,
                keys,
            } => {
                let p = self.src_peer(src)?;
                self.on_rtr(p, sreq, rreq, addr, size as usize, offset as usize, keys);
            }
            Msg::RndvData {
                src,
                rreq,
                offset,
                data,
            } => {
                let p = self.src_peer(src)?;
                if !self.rndv_recv_from(rreq, p)? {
                    return Ok(());
                }
                if !self.split_tail_data(rreq, offset as usize, data) {
                    self.recv_data(rreq, offset as usize, data);
                    self.recv_complete(rreq);
                }
            }
            Msg::Fin { src, rreq } => {
                let p = self.src_peer(src)?;
                if !self.rndv_recv_from(rreq, p)? {
                    return Ok(());
                }
                self.tail_landed(rreq);
            }
            Msg::Abort {
                src,
                sreq,
                rreq,
                by_sender,
                reason,
            } => {
                let p = self.src_peer(src)?;
                self.on_abort(p, sreq, rreq, by_sender, reason);
            }
            Msg::Pull { src, sreq, rreq } => {
                let p = self.src_peer(src)?;
                self.on_pull(p, sreq, rreq);
            }
            Msg::Frag {
                src,
                rreq,
                sreq,
                offset,
                len,
                addr,
                frag,
                key,
            } => {
                let p = self.src_peer(src)?;
                self.on_frag(
                    p,
                    rreq,
                    sreq,
                    offset as usize,
                    len as usize,
                    addr,
                    frag,
                    key,
                );
            }
            Msg::FragAck {
                src,
                sreq,
                frag,
                len,
            } => {
                let p = self.src_peer(src)?;
                self.on_frag_ack(p, sreq, frag as usize, len as usize);
            }
            Msg::StagingOffer { src, key } => {
                let _ = self.src_peer(src)?;
                self.on_staging_offer(key);
            }
            Msg::Cancel { src, sreq, step } => {
                let p = self.src_peer(src)?;
                self.on_cancel(p, sreq, step);
            }
            Msg::Keepalive { src, reply } => {
                // Any message shows the peer alive; a probe is answered.
                let p = self.src_peer(src)?;
                if !reply {
                    self.send_keepalive(p, true);
                }
            }
            Msg::Disconnect { src } => {
                let p = self.src_peer(src)?;
                self.closed_by_peer(p);
            }
            Msg::User {
                src,
                id,
                header,
                data,
            } => {
                let p = self.src_peer(src)?;
                self.am_inbox.push(AmMessage {
                    id,
                    header: header.to_vec(),
                    data: data.to_vec(),
                    reply_ep: self.ep_id(p),
                    remote: None,
                });
            }
            Msg::AmRts {
                src,
                sreq,
                size,
                addr,
                smem,
                id,
                header,
                keys,
            } => {
                let p = self.src_peer(src)?;
                self.on_am_rts(p, sreq, size as usize, addr, smem, id, header, keys);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::TAG_MASK_FULL;
    use crate::worker::prelude::*;

    /// A message claiming source 0 (a uuid no worker has) from a stranger that sent no
    /// wire-up is refused as from an unknown worker, whichever peers exist: before, the empty
    /// one-entry cache of the last source, `(0, 0)`, gave it to peer 0, so anybody could close
    /// endpoint 0 (or feed it messages) knowing no uuid at all.
    #[test]
    fn a_message_from_source_zero_is_from_nobody() {
        let w = crate::worker::tests::self_worker();
        let ep = w.connect(&w.address()).unwrap();
        for m in [
            Msg::Disconnect { src: 0 },
            Msg::Keepalive {
                src: 0,
                reply: true,
            },
            Msg::EagerOne {
                src: 0,
                tag: 5,
                data: b"forged",
            },
        ] {
            let (id, bytes) = m.encode();
            let e = w.st.borrow_mut().on_am(id, &bytes);
            assert!(
                matches!(&e, Err(Error::InvalidAddress(s)) if s.contains("unknown worker")),
                "{e:?}"
            );
        }
        let st = w.st.borrow();
        assert!(st.peers[0].closed.is_none() && st.peers[0].failed.is_none());
        assert_eq!(st.matcher.unexpected_len(), 0);
        drop(st);
        // The endpoint still carries messages.
        let mut buf = [0u8; 4];
        w.scope(|s| {
            let r = s.tag_recv(&mut buf[..], 9, TAG_MASK_FULL);
            let sreq = s.tag_send(ep, &b"real"[..], 9);
            while r.test().is_none() || sreq.test().is_none() {
                w.progress();
            }
        });
        assert_eq!(&buf, b"real");
    }

    /// A peer that names a receive it was not matched with (one posted and waiting, whose id it
    /// guessed) in rendezvous data or a rendezvous finish is refused: the receive neither takes
    /// the bytes nor completes (before, the finish completed it with the buffer's old bytes).
    #[test]
    fn rendezvous_data_or_finish_naming_an_unmatched_receive_is_refused() {
        let w = crate::worker::tests::self_worker();
        w.connect(&w.address()).unwrap();
        let mut buf = vec![7u8; 64];
        w.scope(|s| {
            let r = s.tag_recv(&mut buf[..], 5, TAG_MASK_FULL);
            let (rid, uuid) = {
                let st = w.st.borrow();
                let rid = st
                    .reqs
                    .iter()
                    .find(|(_, q)| matches!(q.kind, ReqKind::Recv(_)))
                    .map(|(id, _)| id)
                    .unwrap();
                (rid, st.uuid())
            };
            let forged = [
                Msg::RndvData {
                    src: uuid,
                    rreq: rid,
                    offset: 0,
                    data: &[1u8; 64],
                },
                Msg::Fin {
                    src: uuid,
                    rreq: rid,
                },
            ];
            for m in forged {
                let (id, bytes) = m.encode();
                let e = w.st.borrow_mut().on_am(id, &bytes);
                assert!(matches!(e, Err(Error::InvalidParam(_))), "{e:?}");
            }
            for _ in 0..100 {
                w.progress();
            }
            assert!(r.test().is_none(), "{:?}", r.test());
            assert!(r.cancel());
        });
        assert_eq!(buf, vec![7u8; 64]);
        assert_eq!(w.live_requests(), 0);
    }
}
