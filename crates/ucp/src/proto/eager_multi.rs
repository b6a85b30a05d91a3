//! Multi-fragment eager (copy-in `am_bcopy` fragments, or zero-copy `am_zcopy` from the
//! registered buffer), whose fragment loop also streams a rendezvous through active messages
//! (the `am` scheme, and a split's tail).

use crate::proto::io::SendIo;
use crate::worker::prelude::*;

/// What each fragment of a send starts with: the first or a later fragment of a tagged
/// multi-fragment message, or streamed rendezvous data for receive `rreq`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FragHead {
    Eager { tag: Tag, msg_id: u64 },
    Rndv { rreq: u64 },
}

/// The fragment loop of one send (a multi-fragment eager message, copied in or zero-copy, or
/// a rendezvous the sender streams): what it reads of its request and lane. It acts only
/// through [`ProtoIo`], so it runs the same over the worker and over a fake in tests.
pub(crate) struct FragSend<'a> {
    pub(crate) req: u64,
    pub(crate) peer: usize,
    /// The active-message lane.
    pub(crate) lane: usize,
    /// This worker's id (the source of every message).
    pub(crate) src: u64,
    pub(crate) head: FragHead,
    /// The message: `addr..addr + len` of host memory, lent to the request's scope.
    pub(crate) addr: usize,
    pub(crate) len: usize,
    /// The lane's largest `am_bcopy` (header included).
    pub(crate) max_bcopy: usize,
    /// Zero-copy: the largest fragment, and the buffer's registration with the lane's domain.
    pub(crate) zcopy: Option<(usize, &'a MemHandle)>,
}

impl FragSend<'_> {
    /// Post fragments from byte `*posted` on until the whole message is out (`Ok(true)`) or
    /// the transport pushes back (`Ok(false)`: call again after progress). `*posted` always
    /// says how far the message went out, an error included (the caller decides from it
    /// whether the receiver must be told: [`EagerFrags::abort_needed`]).
    pub(crate) fn post(&self, io: &mut impl ProtoIo, posted: &mut usize) -> Result<bool> {
        let src = self.src;
        let mut h = Vec::with_capacity(40);
        loop {
            let off = *posted;
            // Header for this fragment: the message without its data.
            let (head, room) = match self.head {
                FragHead::Rndv { rreq } => (
                    Msg::RndvData {
                        src,
                        rreq,
                        offset: off as u64,
                        data: &[],
                    },
                    proto::MIDDLE_OVERHEAD,
                ),
                FragHead::Eager { tag, msg_id } if off == 0 => (
                    Msg::EagerFirst {
                        src,
                        kind: MsgKind::Tag,
                        tag,
                        msg_id,
                        total: self.len as u64,
                        data: &[],
                    },
                    proto::FIRST_OVERHEAD,
                ),
                FragHead::Eager { msg_id, .. } => (
                    Msg::EagerMiddle {
                        src,
                        msg_id,
                        offset: off as u64,
                        data: &[],
                    },
                    proto::MIDDLE_OVERHEAD,
                ),
            };
            h.clear();
            let am_id = head.encode_into(&mut h);
            let left = self.len - off;
            let n;
            let went = if let Some((max, memh)) = self.zcopy {
                n = max.max(1).min(left);
                let iov = [Iov {
                    addr: self.addr + off,
                    len: n,
                    memh,
                }];
                let iov: &[Iov<'_>] = if n == 0 { &[] } else { &iov };
                io.post(self.req, self.peer, self.lane, |ep, t| {
                    ep.am_zcopy(am_id, &h, iov, t)
                })?
            } else {
                n = self.max_bcopy.saturating_sub(room).min(left);
                if n == 0 && left > 0 {
                    return Err(Error::Internal(format!(
                        "am_bcopy of {} bytes leaves no room for data after a {room}-byte header",
                        self.max_bcopy
                    )));
                }
                // SAFETY: the scope keeps the send buffer alive while the request exists, and
                // `off + n <= len`.
                let data = unsafe { host_slice(self.addr + off, n) };
                let hdr = &h;
                io.post(self.req, self.peer, self.lane, |ep, _| {
                    ep.am_bcopy(am_id, &mut |buf: &mut [u8]| {
                        let need = hdr.len() + n;
                        if let Some(dst) = buf.get_mut(..need) {
                            dst[..hdr.len()].copy_from_slice(hdr);
                            dst[hdr.len()..].copy_from_slice(data);
                        }
                        need
                    })
                    .map(|_| OpStatus::Done)
                })?
            };
            if !went {
                return Ok(false);
            }
            *posted = off + n;
            if *posted >= self.len {
                return Ok(true);
            }
        }
    }
}

/// The active-message lane a send's fragments go on, as the worker found it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AmFrags {
    pub(crate) lane: usize,
    /// The lane's domain (zero-copy fragments come from a registration with it).
    pub(crate) md: usize,
    /// The lane's largest `am_bcopy` (header included).
    pub(crate) max_bcopy: usize,
    /// The largest zero-copy fragment.
    pub(crate) max_zcopy: usize,
}

/// The send-side state of a multi-fragment eager message: its id (in every fragment), how far
/// it went out, and whether every fragment was posted.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct EagerFrags {
    pub(crate) msg_id: u64,
    /// Bytes of the message posted so far.
    pub(crate) posted: usize,
    /// Every fragment was posted: waiting for the completions of zero-copy ones.
    pub(crate) all_posted: bool,
}

impl EagerFrags {
    /// Post the fragments of send `req` from byte `posted` on: zero-copy from the buffer's
    /// registration with the AM lane's domain when the send is zero-copy, copied in otherwise.
    /// `Ok(true)`: all posted; `Ok(false)`: the transport pushed back (call again after
    /// progress); an error ends the send (the receiver is told once a fragment went:
    /// [`Self::abort_needed`]).
    pub(crate) fn post(
        &mut self,
        io: &mut impl SendIo,
        req: u64,
        head: &SendHead,
        am: &AmFrags,
    ) -> Result<bool> {
        let memh = if head.proto == Proto::EagerZcopy {
            io.reg(req, am.md)
        } else {
            None
        };
        let frags = FragSend {
            req,
            peer: head.peer,
            lane: am.lane,
            src: io.uuid(),
            head: FragHead::Eager {
                tag: head.tag,
                msg_id: self.msg_id,
            },
            addr: head.addr,
            len: head.len,
            max_bcopy: am.max_bcopy,
            zcopy: memh.as_ref().map(|m| (am.max_zcopy, m)),
        };
        let mut off = self.posted;
        let res = frags.post(io, &mut off);
        self.posted = off;
        if !res? {
            return Ok(false);
        }
        self.all_posted = true;
        Ok(true)
    }

    /// One zero-copy fragment completed with `res`, `outstanding` still in flight: the send
    /// completes once every fragment was posted and completed; a failed one ends it.
    pub(crate) fn on_transfer(&self, outstanding: usize, res: Result<()>) -> SendNext {
        match res {
            Err(e) => SendNext::Fail(e),
            Ok(()) if outstanding == 0 && self.all_posted => SendNext::Complete,
            Ok(()) => SendNext::Wait,
        }
    }

    /// Whether the send, ending with an error now (its request still pending), must tell the
    /// receiver with `AM_EAGER_ABORT`: once any fragment went out, the receive it matched (or
    /// the unexpected message it started) would otherwise wait for bytes that never come. That
    /// holds also after every fragment was posted: a zero-copy fragment whose completion failed
    /// may not have arrived.
    pub(crate) fn abort_needed(&self) -> bool {
        self.posted > 0
    }
}

impl State {
    /// Post the next operations of send `id`: its fragments (multi-fragment eager), the data
    /// of its rendezvous (streamed or written), its staged fragments, or the request to send
    /// that waited for a lane. `Ok(true)`: all posted; `Ok(false)`: pushed back.
    pub(crate) fn stream_send(&mut self, id: u64) -> Result<bool> {
        let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get(&id)
        else {
            return Ok(true);
        };
        let p = s.head.peer;
        let put_lane = match &s.state {
            SendProto::Rndv(rv)
                if rv.deferred && rv.rreq.is_none() && rv.wait == SendWait::Posting =>
            {
                // A request to send that waits for a lane (see `send_rts`); the progress loop
                // connects it before it posts the queue again.
                if self.peers[p].needs_lanes {
                    return Ok(false);
                }
                self.send_rts(id);
                return Ok(true);
            }
            SendProto::Rndv(rv) if rv.stage.is_some() => return self.stream_stage(id),
            SendProto::Rndv(rv) => rv.put.as_ref().map(|(_, _, l)| *l),
            SendProto::Frags(_) => None,
            SendProto::Copied | SendProto::Sync => return Ok(true),
        };
        let am = self.am_frags(p);
        // Writes on a GPU zero-copy lane (cuda_ipc: one copy-engine copy, also from a host
        // buffer into the receiver's GPU memory) move the whole range in one operation, as reads
        // through it do: a copy per fragment costs the driver's setup each time (a pageable
        // host source pays it most); host lanes write in fragments.
        let put_max = put_lane.map_or(1, |l| {
            let attr = &self.slots[l].attr;
            if attr.dev_type == rucx_uct::DeviceType::Accelerator {
                attr.limits.put_max_zcopy
            } else {
                attr.limits.put_max_zcopy.min(self.frag)
            }
        });
        let done = self
            .with_send(id, |sp, head, st| match sp {
                SendProto::Frags(f) => f.post(st, id, head, &am),
                SendProto::Rndv(rv) => rv.post_data(st, id, head, &am, put_max),
                _ => Ok(true),
            })
            .unwrap_or(Ok(true))?;
        if done && self.reqs.get(&id).is_some_and(|r| r.outstanding == 0) {
            self.send_transfer(id, 0, Ok(()));
        }
        Ok(done)
    }

    /// The active-message lane to peer `p`, for fragments.
    pub(crate) fn am_frags(&self, p: usize) -> AmFrags {
        let am = self.peers[p].am;
        let limits = self.slots[am].attr.limits;
        AmFrags {
            lane: am,
            md: self.slots[am].md,
            max_bcopy: limits.am_max_bcopy,
            max_zcopy: limits.am_max_zcopy.min(self.frag),
        }
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
            Some((w, _)) => {
                let rid = self.waiter_req(w);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rucx_uct::MemHandle;

    use super::*;
    use crate::proto::fake_io::{FakeIo, Op};

    /// The source of every fragment: this worker (the fake's id).
    const SRC: u64 = crate::proto::fake_io::FAKE_UUID;

    /// The send state of a message that went out up to `posted`.
    fn sent(posted: usize) -> EagerFrags {
        EagerFrags {
            posted,
            ..EagerFrags::default()
        }
    }

    fn message(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    fn send<'a>(msg: &[u8], head: FragHead, zcopy: Option<(usize, &'a MemHandle)>) -> FragSend<'a> {
        FragSend {
            req: 9,
            peer: 1,
            lane: 0,
            src: SRC,
            head,
            addr: msg.as_ptr() as usize,
            len: msg.len(),
            max_bcopy: 100,
            zcopy,
        }
    }

    /// Rebuild the message from copied-in fragments; checks every header on the way (source,
    /// tag, id, total, contiguous offsets).
    fn reassemble(io: &FakeIo, head: FragHead, total: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for op in &io.ep.ops {
            let Op::Bcopy { id, bytes } = op else {
                panic!("a copy-in send posted {op:?}");
            };
            match (wire::parse(*id, bytes).expect("fragment parses"), head) {
                (
                    Msg::EagerFirst {
                        src,
                        tag,
                        msg_id,
                        total: t,
                        data,
                        ..
                    },
                    FragHead::Eager {
                        tag: wt,
                        msg_id: wm,
                    },
                ) => {
                    assert_eq!((src, tag, msg_id, t), (SRC, wt, wm, total as u64));
                    assert!(out.is_empty(), "a first fragment after others");
                    out.extend_from_slice(data);
                }
                (
                    Msg::EagerMiddle {
                        src,
                        msg_id,
                        offset,
                        data,
                    },
                    FragHead::Eager { msg_id: wm, .. },
                ) => {
                    assert_eq!((src, msg_id, offset), (SRC, wm, out.len() as u64));
                    out.extend_from_slice(data);
                }
                (
                    Msg::RndvData {
                        src,
                        rreq,
                        offset,
                        data,
                    },
                    FragHead::Rndv { rreq: wr },
                ) => {
                    assert_eq!((src, rreq, offset), (SRC, wr, out.len() as u64));
                    out.extend_from_slice(data);
                }
                (m, h) => panic!("{m:?} in a send with head {h:?}"),
            }
        }
        out
    }

    /// A copy-in send that the transport pushes back part-way resumes where it stopped: every
    /// byte goes out once, in order, with no fragment sent twice.
    #[test]
    fn copy_in_resumes_after_a_push_back() {
        let msg = message(1000);
        let head = FragHead::Eager { tag: 77, msg_id: 5 };
        let f = send(&msg, head, None);
        let mut io = FakeIo {
            push_back_after: Some(3),
            ..FakeIo::default()
        };
        let mut posted = 0;
        assert!(!f.post(&mut io, &mut posted).unwrap(), "pushed back");
        assert_eq!(io.ep.ops.len(), 3);
        // First fragment: 100 - 33 bytes of data, then 100 - 24 each.
        assert_eq!(posted, 67 + 2 * 76);
        assert!(f.post(&mut io, &mut posted).unwrap());
        assert_eq!(posted, msg.len());
        assert_eq!(reassemble(&io, head, msg.len()), msg);
        assert!(io.in_flight.is_empty(), "copy-in completes at once");
    }

    /// Streamed rendezvous data carries the receive request and offsets.
    #[test]
    fn streamed_rendezvous_fragments() {
        let msg = message(333);
        let head = FragHead::Rndv { rreq: 0x55 };
        let mut io = FakeIo::default();
        let mut posted = 0;
        assert!(send(&msg, head, None).post(&mut io, &mut posted).unwrap());
        assert_eq!(reassemble(&io, head, msg.len()), msg);
    }

    /// A post that fails part-way returns the error and says how far the message went: the
    /// receiver is to be told (it may have matched the first fragment); a failure of the first
    /// post needs no abort.
    #[test]
    fn a_failed_post_reports_how_far_the_message_went() {
        let msg = message(500);
        let head = FragHead::Eager { tag: 1, msg_id: 2 };
        let f = send(&msg, head, None);
        let mut io = FakeIo {
            fail_post_after: Some((
                2,
                Error::io("writing", std::io::Error::from_raw_os_error(32)),
            )),
            ..FakeIo::default()
        };
        let mut posted = 0;
        let e = f.post(&mut io, &mut posted).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert_eq!(posted, 67 + 76);
        assert!(sent(posted).abort_needed());

        let mut io = FakeIo {
            fail_post_after: Some((0, Error::NoMemory("ring".into()))),
            ..FakeIo::default()
        };
        let mut posted = 0;
        assert!(f.post(&mut io, &mut posted).is_err());
        assert_eq!(posted, 0);
        assert!(
            !sent(posted).abort_needed(),
            "nothing went out: nothing to abort"
        );
    }

    /// Zero-copy fragments cover the message from the registration, each in progress under its
    /// own token; a push-back in between leaves no gap.
    #[test]
    fn zero_copy_fragments_cover_the_message() {
        let msg = message(1000);
        let addr = msg.as_ptr() as usize;
        let memh = MemHandle::new(MemRegion::host(addr, msg.len()), "fake", Arc::new(()));
        let head = FragHead::Eager { tag: 3, msg_id: 4 };
        let f = send(&msg, head, Some((256, &memh)));
        let mut io = FakeIo {
            push_back_after: Some(1),
            ..FakeIo::default()
        };
        let mut posted = 0;
        assert!(!f.post(&mut io, &mut posted).unwrap());
        assert_eq!(posted, 256);
        assert!(f.post(&mut io, &mut posted).unwrap());
        let mut next = 0;
        let mut tokens = Vec::new();
        for (i, op) in io.ep.ops.iter().enumerate() {
            let Op::Zcopy {
                id,
                header,
                iov,
                token,
            } = op
            else {
                panic!("a zero-copy send posted {op:?}");
            };
            assert_eq!(iov, &vec![(addr + next, 256.min(msg.len() - next))]);
            match wire::parse(*id, header).unwrap() {
                Msg::EagerFirst { total, data, .. } if i == 0 => {
                    assert_eq!((total, data.len()), (1000, 0))
                }
                Msg::EagerMiddle { offset, data, .. } if i > 0 => {
                    assert_eq!((offset, data.len()), (next as u64, 0))
                }
                m => panic!("fragment {i}: {m:?}"),
            }
            next += iov[0].1;
            tokens.push(*token);
        }
        assert_eq!(next, msg.len());
        assert_eq!(
            io.in_flight,
            tokens.iter().map(|t| (9, *t)).collect::<Vec<_>>(),
            "every fragment awaits its completion"
        );
        // Completions may fail after the last post: the receiver must still be told.
        assert!(sent(posted).abort_needed());
    }

    /// The send state of a multi-fragment message: a copy-in send completes once all went out;
    /// a zero-copy one goes from the buffer's registration with the AM lane's domain and
    /// completes with the last fragment's completion, after a push-back resumed it; a failed
    /// completion ends it, and the receiver is to be told.
    #[test]
    fn a_multi_fragment_send_completes_after_its_last_fragment() {
        let msg = message(1000);
        let am = AmFrags {
            lane: 4,
            md: 4,
            max_bcopy: 100,
            max_zcopy: 400,
        };
        let mut head = SendHead {
            peer: 1,
            addr: msg.as_ptr() as usize,
            len: msg.len(),
            tag: 3,
            proto: Proto::EagerBcopyMulti,
            op: crate::plan::Op::Tag,
            mem: MemoryType::Host,
            dev: None,
        };
        let mut io = FakeIo::default();
        let mut f = EagerFrags {
            msg_id: 6,
            ..EagerFrags::default()
        };
        assert!(f.post(&mut io, 9, &head, &am).unwrap());
        assert!(f.all_posted && f.posted == 1000);
        assert_eq!(f.on_transfer(0, Ok(())), SendNext::Complete);
        let head_of = FragHead::Eager { tag: 3, msg_id: 6 };
        assert_eq!(reassemble(&io, head_of, msg.len()), msg);

        head.proto = Proto::EagerZcopy;
        let mut io = FakeIo {
            push_back_after: Some(1),
            ..FakeIo::default()
        };
        io.regs.push((9, 4, MemRegion::host(head.addr, msg.len())));
        let mut f = EagerFrags::default();
        assert!(!f.post(&mut io, 9, &head, &am).unwrap(), "pushed back");
        assert!(!f.all_posted);
        assert_eq!(f.on_transfer(0, Ok(())), SendNext::Wait, "not all posted");
        assert!(f.post(&mut io, 9, &head, &am).unwrap());
        assert_eq!(
            io.in_flight.len(),
            3,
            "1000 bytes in 400-byte zero-copy fragments"
        );
        assert_eq!(f.on_transfer(1, Ok(())), SendNext::Wait);
        let e = Error::io("sending", std::io::Error::from_raw_os_error(104));
        assert_eq!(f.on_transfer(0, Err(e.clone())), SendNext::Fail(e));
        assert!(f.abort_needed(), "the fragments may have matched a receive");
    }
}
