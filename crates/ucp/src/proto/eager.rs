//! Eager protocols of whole messages: eager short (`am_short`, the fast path without a request),
//! eager copy-in (one `am_bcopy`), and the eager message of a synchronous send (acknowledged by
//! the receiver once matched); their receive side delivers a whole message in one copy.
//! `start_send` starts a send request on the protocol the plan chose.

use crate::worker::prelude::*;

impl State {
    /// Send a host message the plan gave eager short (so it fits the lane's `am_short`) with
    /// one `am_short` if the AM lane is idle, without a request: at every size the plan gives
    /// the protocol (over tcp up to 8 KiB; a cap of 256 bytes here once sent 256 B and 4 KiB
    /// through a request and a fresh heap copy of the payload). `Ok(false)`: not sent (queue
    /// busy, lane not connected, or the transport pushed back).
    #[inline]
    pub(crate) fn try_eager_short(
        &mut self,
        p: usize,
        addr: usize,
        len: usize,
        tag: Tag,
    ) -> Result<bool> {
        let peer = &mut self.peers[p];
        if !peer.queue.is_empty() || !peer.connected {
            return Ok(false);
        }
        // SAFETY: the caller's buffer is borrowed for the call (and the scope).
        let data = unsafe { host_slice(addr, len) };
        // The source, then the data (joined by the transport, or in a reused buffer: nothing
        // to zero or allocate).
        let src = self.address.uuid;
        let ep = peer.eps.get_mut(&peer.am).expect("am lane");
        match ep.am_short_word(wire::AM_EAGER_SHORT, tag, src, data, &mut self.short_buf) {
            Ok(()) => Ok(true),
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn start_send(&mut self, id: u64) {
        let (p, proto, len, addr) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.head.peer, s.head.proto, s.head.len, s.head.addr),
            _ => unreachable!("start_send on a send request"),
        };
        self.count(proto.name());
        let src = self.address.uuid;
        match proto {
            Proto::EagerSync => {
                // Copied now; complete when the receiver's acknowledgement of the match comes.
                // SAFETY: the scope keeps the send buffer alive while this runs.
                let data = unsafe { host_slice(addr, len) };
                let tag = self.send_tag(id);
                self.ctrl(
                    p,
                    &Msg::EagerSync {
                        src,
                        tag,
                        sreq: id,
                        data,
                    },
                );
                self.pump(p);
            }
            Proto::EagerShort | Proto::EagerBcopy => {
                // Copy now: the request is complete once the bytes are in our queue or ring.
                // SAFETY: the scope keeps the send buffer alive while this runs.
                let data = unsafe { host_slice(addr, len) };
                let tag = self.send_tag(id);
                if proto == Proto::EagerShort
                    && self.peers[p].queue.is_empty()
                    && self.peers[p].connected
                {
                    let am = self.peers[p].am;
                    // The source word, then the data: joined by the transport, or in the
                    // reused buffer (nothing allocated per message).
                    let ep = self.peers[p].eps.get_mut(&am).expect("am lane");
                    match ep.am_short_word(
                        wire::AM_EAGER_SHORT,
                        tag,
                        src,
                        data,
                        &mut self.short_buf,
                    ) {
                        Ok(()) => {
                            self.finish(
                                id,
                                Ok(Completion {
                                    len,
                                    tag,
                                    sender: None,
                                }),
                            );
                            return;
                        }
                        Err(e) if e.is_retryable() => {}
                        Err(e) => {
                            self.finish(id, Err(e));
                            return;
                        }
                    }
                }
                self.ctrl(p, &Msg::EagerOne { src, tag, data });
                self.finish(
                    id,
                    Ok(Completion {
                        len,
                        tag,
                        sender: None,
                    }),
                );
                self.pump(p);
            }
            Proto::EagerBcopyMulti
            | Proto::EagerZcopy
            | Proto::RndvAm
            | Proto::RndvGet
            | Proto::RndvPut
            | Proto::RndvPipeline => {
                if proto.is_rndv() {
                    self.send_rts(id);
                } else {
                    let msg_id = self.next_msg(p);
                    if let Some(Req {
                        kind:
                            ReqKind::Send(SendState {
                                state: SendProto::Frags(f),
                                ..
                            }),
                        ..
                    }) = self.reqs.get_mut(&id)
                    {
                        f.msg_id = msg_id;
                    }
                    let am = self.peers[p].am;
                    if proto == Proto::EagerZcopy
                        && let Err(e) = self.register_send(id, am)
                    {
                        // Re-selected from the plan made after the failure (a demotion takes
                        // the zero-copy rows of that domain away; the size may now be a
                        // rendezvous on another lane). A plan that still says zero-copy did
                        // not change (the failure was this buffer's own): copy it in.
                        let np = self.reselect_send(id, p, len);
                        tracing::debug!("zero-copy send not registered ({e}); now {}", np.name());
                        let np = if np == Proto::EagerZcopy {
                            Proto::EagerBcopyMulti
                        } else {
                            np
                        };
                        if let Some(Req {
                            kind: ReqKind::Send(s),
                            ..
                        }) = self.reqs.get_mut(&id)
                        {
                            s.set_proto(np);
                        }
                        if np != Proto::EagerBcopyMulti {
                            self.start_send(id);
                            return;
                        }
                    }
                    self.peers[p].queue.push_back(Pending::Stream(id));
                }
                self.pump(p);
            }
            Proto::EagerBounce
            | Proto::StreamCopy
            | Proto::AmCopy
            | Proto::PutZcopy
            | Proto::GetZcopy
            | Proto::PutStaged
            | Proto::GetStaged => {
                // Not tag-send protocols: the plan never puts them in a send request.
                self.finish(
                    id,
                    Err(Error::Internal(format!(
                        "{} is not a tag-send protocol",
                        proto.name()
                    ))),
                );
            }
        }
    }

    /// The protocol the current plan (re-made first if stale) gives send `id` of `len` bytes to
    /// peer `p` (its own protocol when the table has no row for it).
    pub(crate) fn reselect_send(&mut self, id: u64, p: usize, len: usize) -> Proto {
        self.refresh_plan(p);
        let (mem, dev, proto, op) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.head.mem, s.head.dev, s.head.proto, s.head.op),
            _ => return Proto::EagerBcopyMulti,
        };
        self.peers[p]
            .plan
            .select(op, MemKey::new(mem, dev), len)
            .unwrap_or(proto)
    }

    /// Register the send buffer with the domain of `lane` (see [`register_send`]); on failure
    /// the context demotes the domain and the error is returned for re-planning.
    pub(crate) fn register_send(&mut self, id: u64, lane: usize) -> Result<()> {
        let head = match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.head,
            _ => return Ok(()),
        };
        register_send(self, id, &head, lane).map(|_| ())
    }

    /// A whole tagged message in one packet (eager short or single-fragment copy-in).
    #[inline]
    pub(crate) fn on_eager_one(
        &mut self,
        src: u64,
        tag: Tag,
        data: &[u8],
        sync: Option<u64>,
    ) -> Result<()> {
        let p = self.src_peer(src)?;
        let queued = || Unexp::Eager {
            src: p,
            msg_id: None,
            total: data.len(),
            data: Vec::new(),
            sync,
            lost: false,
        };
        match self.matcher.arrive_with(tag, queued) {
            Some(w) => {
                self.deliver_to(w, p, tag, data);
                if let Some(sreq) = sync {
                    self.send_ats(p, sreq);
                    self.pump(p);
                }
            }
            None => self.store_unexpected(data),
        }
        Ok(())
    }

    /// Store the data of the eager message just queued as unexpected in its entry (out of
    /// line: the matched message, the hot path, keeps its registers).
    #[inline(never)]
    fn store_unexpected(&mut self, data: &[u8]) {
        let a = self.msg_alloc;
        if let Some(Unexp::Eager { data: d, lost, .. }) = self.matcher.unexpected_mut().last() {
            match a.reserve(d, data.len()) {
                Ok(()) => d.extend_from_slice(data),
                Err(e) => {
                    tracing::warn!("unexpected message dropped: {e}");
                    *lost = true;
                }
            }
        }
    }

    /// A whole eager message matched a posted receive: copy it and finish the receive with one
    /// lookup of the request (the common small-message path).
    #[inline]
    pub(crate) fn deliver_whole(&mut self, rid: u64, src: usize, tag: Tag, data: &[u8]) {
        let base = self.ep_base;
        let res = match self.reqs.get_mut(&rid) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result,
                ..
            }) if result.is_none() => {
                rs.sender = Some(src);
                rs.tag = tag;
                rs.total = data.len();
                if rs.mem.is_gpu() {
                    None
                } else {
                    let n = data.len().min(rs.cap);
                    // SAFETY: the receive buffer was lent mutably to the scope, which keeps it
                    // alive and unaliased until the request is finished; `n <= cap`.
                    let dst = unsafe { host_slice_mut(rs.addr, n) };
                    copy_small(dst, &data[..n]);
                    rs.received = data.len();
                    Some(if data.len() > rs.cap {
                        Err(Error::Truncated {
                            incoming: data.len(),
                            capacity: rs.cap,
                            tag: Some(tag),
                        })
                    } else {
                        Ok(Completion {
                            len: data.len(),
                            tag,
                            sender: Some(EpId::new(src, base)),
                        })
                    })
                }
            }
            _ => return,
        };
        match res {
            None => {
                self.recv_data(rid, 0, data);
                self.recv_complete(rid);
            }
            Some(res) => self.end_in_place(rid, res),
        }
    }
}

/// Copy `src` into `dst` (of the same length). The payload of a short message, a few words,
/// goes by two overlapping moves of a word (or half a word) instead of a call of `memcpy`,
/// which costs more than the copy at this size; longer ones by `copy_from_slice`.
#[inline(always)]
pub(crate) fn copy_small(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    assert_eq!(dst.len(), n, "copy_small: lengths differ");
    if (8..=16).contains(&n) {
        dst[..8].copy_from_slice(&src[..8]);
        dst[n - 8..].copy_from_slice(&src[n - 8..]);
    } else if (4..8).contains(&n) {
        dst[..4].copy_from_slice(&src[..4]);
        dst[n - 4..].copy_from_slice(&src[n - 4..]);
    } else {
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
mod copy_tests {
    #[test]
    fn copy_small_copies_every_length_exactly() {
        let src: Vec<u8> = (1..=40).collect();
        for n in 0..=40 {
            let mut dst = vec![0u8; n + 2];
            super::copy_small(&mut dst[1..n + 1], &src[..n]);
            assert_eq!(&dst[1..n + 1], &src[..n], "length {n}");
            assert_eq!((dst[0], dst[n + 1]), (0, 0), "length {n}: wrote outside");
        }
    }
}
