//! The staged pipeline, sender side, as a state machine over [`StageIo`]: asked to stage
//! (`PULL`), the sender registers its GPU buffer with the copy lane, copies it device -> pinned
//! host staging in runs of free fragments, announces each fragment (`FRAG`) once its copy
//! completed, and reuses a fragment once the receiver acknowledged it (`FRAG_ACK`). Each step
//! is a method of [`RndvSend`] returning what the worker does next ([`SendNext`], or
//! [`Posting`] for the copies); the worker only dispatches (`stage_io.rs`).

use rucx_ucs::{Error, Result};
use rucx_uct::{Iov, RemoteKey};

use super::pipeline_recv::Posting;
use super::stage_io::{On, StageIo};
use crate::context::RegGuard;
use crate::proto::io::SendIo;
use crate::proto::rndv::{RndvSend, SendHead, SendNext};
use crate::wire::Msg;
use crate::worker::state::{SendWait, TokWhat};

/// Most bytes one staging copy fills (a run of consecutive fragments; a fragment larger than
/// this is copied alone).
const RUN_BYTES: usize = 1 << 20;

/// Sender side of a staged pipeline.
pub(crate) struct StageSend {
    pub(crate) rreq: u64,
    /// The host RMA lane the receiver reads the fragments through (their keys are of its
    /// domain), chosen from the plan when asked to stage and kept for the whole send.
    pub(crate) lane: Option<usize>,
    /// Most bytes the receiver reads at once on that lane (one fragment holds no more).
    pub(crate) max_get: usize,
    /// Bytes of one staging fragment.
    pub(crate) frag: usize,
    /// Bytes of the message copied to staging (or being copied) so far.
    pub(crate) next_off: usize,
    /// Bytes the receiver acknowledged.
    pub(crate) acked: usize,
    /// The user buffer, registered with the copy lane's domain, and its key.
    pub(crate) _dev_memh: RegGuard,
    pub(crate) dev_key: RemoteKey,
}

/// What the worker found for a request to stage: the lane and the staging's geometry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PullChoice {
    /// The plan's host RMA lane to the receiver (none: no lane reads remote memory).
    pub(crate) lane: Option<usize>,
    /// Most bytes that lane reads at once (`usize::MAX` without a lane).
    pub(crate) max_get: usize,
    /// Bytes of one staging fragment.
    pub(crate) frag: usize,
}

impl RndvSend {
    /// The receiver of send `req` (`head`) asked us to stage (PULL) for its receive `rreq`:
    /// register the buffer with the copy lane's domain (through the one register path, which
    /// demotes and warns), make sure the staging exists, drop the registration made for the
    /// request to send; the copies are then to be posted. When that fails the send ends, and
    /// the receiver, which waits for fragments, is told.
    pub(crate) fn on_pull(
        &mut self,
        io: &mut (impl SendIo + StageIo),
        req: u64,
        head: &SendHead,
        rreq: u64,
        c: &PullChoice,
    ) -> SendNext {
        match io.send_copy_key(head.region()) {
            Ok((memh, key)) => {
                // A zero-copy registration made for the RTS is no longer needed.
                io.keep_regs(req, None);
                self.staged(StageSend {
                    rreq,
                    lane: c.lane,
                    max_get: c.max_get,
                    frag: c.frag,
                    next_off: 0,
                    acked: 0,
                    _dev_memh: memh,
                    dev_key: key,
                })
            }
            Err(e) => {
                self.rreq = Some(rreq);
                SendNext::Fail(e)
            }
        }
    }

    /// Copy the next part of the message to staging (device -> pinned host, on the copy
    /// lane): consecutive free fragments are filled by one copy (one call, one completion), up
    /// to [`RUN_BYTES`], so small fragments cost the copy engine what large ones do; only whole
    /// fragments make a run (a lane that reads less than a fragment at once stages one at a
    /// time, each holding what it reads). Nothing is copied past the message. A copy the lane
    /// pushes back or refuses gives its fragments back at once.
    pub(crate) fn post_staging(
        &mut self,
        io: &mut impl StageIo,
        req: u64,
        head: &SendHead,
    ) -> Result<Posting> {
        let Some(st) = self.stage.as_deref_mut() else {
            return Ok(Posting::Done);
        };
        let len = head.len;
        while st.next_off < len {
            let (frag, limit, off) = (st.frag.max(1), st.max_get.max(1), st.next_off);
            let max_run = if frag <= limit {
                (RUN_BYTES / frag).max(1)
            } else {
                1
            };
            let want = (len - off).div_ceil(frag).min(max_run);
            let Some((f, k)) = io.take_send_run(req, want) else {
                // Resumed when a fragment comes back.
                return Ok(Posting::NoSlot);
            };
            let n = if k == 1 {
                frag.min(limit).min(len - off)
            } else {
                (k * frag).min(len - off)
            };
            if k > 1 {
                io.count("staging fragments copied in runs");
            }
            let memh = match io.copy_staging() {
                Ok(m) => m,
                Err(e) => {
                    io.release_send(req, f, n);
                    return Err(e);
                }
            };
            let iov = [Iov {
                addr: io.slot_addr(f),
                len: n,
                memh: &memh,
            }];
            let src = (head.addr + off) as u64;
            let what = TokWhat::StageD2H {
                frag: f,
                off,
                len: n,
            };
            let key = &st.dev_key;
            match io.post_step(req, On::Copy, what, |ep, t| ep.get_zcopy(&iov, src, key, t)) {
                Ok(true) => st.next_off = off + n,
                Ok(false) => {
                    io.release_send(req, f, n);
                    return Ok(Posting::Later);
                }
                Err(e) => {
                    io.release_send(req, f, n);
                    return Err(e);
                }
            }
        }
        Ok(Posting::Done)
    }

    /// A staging copy of send `req` completed with `res`: the `len` bytes at offset `off` of
    /// the message are in the fragments from `frag` on. Announce each fragment to the receiver
    /// (FRAG, with the staging's key for the lane's domain, registered there on first use); a
    /// failed copy, no lane, or a staging registration that fails gives the fragments back
    /// and ends the send (the receiver is told).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_staged(
        &mut self,
        io: &mut impl StageIo,
        req: u64,
        head: &SendHead,
        frag: usize,
        off: usize,
        len: usize,
        res: Result<()>,
    ) -> SendNext {
        let Some(st) = self.stage.as_deref() else {
            io.release_send(req, frag, len);
            return SendNext::Wait;
        };
        let key = res
            .and_then(|()| {
                st.lane.ok_or_else(|| Error::Unsupported {
                    what: "the staged pipeline".into(),
                    why: "no transport with remote memory access reaches the receiver".into(),
                })
            })
            .and_then(|lane| io.staging_key(io.lane_md(lane)));
        let key = match key {
            Ok(k) => k,
            Err(e) => {
                io.release_send(req, frag, len);
                return SendNext::Fail(e);
            }
        };
        io.announce_send(req, head.peer, frag, len);
        // One announcement per fragment of the run (each read and acknowledged on its own,
        // whatever the receiver's fragment size).
        let fsz = st.frag.max(1);
        for i in 0..len.div_ceil(fsz).max(1) {
            let (at, n) = if len <= fsz {
                (0, len)
            } else {
                (i * fsz, fsz.min(len - i * fsz))
            };
            let f = frag + i;
            io.ctrl(
                head.peer,
                &Msg::Frag {
                    src: io.uuid(),
                    rreq: st.rreq,
                    sreq: req,
                    offset: (off + at) as u64,
                    len: n as u64,
                    addr: io.slot_addr(f) as u64,
                    frag: f as u64,
                    key: key.clone(),
                },
            );
        }
        SendNext::Wait
    }

    /// The receiver read `len` bytes of send `req`'s staged fragments from `frag` on (or gave
    /// them back unread): they are free again; the send completes once the whole message (`total`
    /// bytes) was acknowledged, else its next copies may go. An acknowledgement of fragments
    /// the send does not hold (a second one, or a confused one) counts for nothing.
    pub(crate) fn on_frag_ack(
        &mut self,
        io: &mut impl StageIo,
        req: u64,
        frag: usize,
        len: usize,
        total: usize,
    ) -> SendNext {
        let back = io.release_send(req, frag, len);
        let Some(st) = &mut self.stage else {
            return SendNext::Wait;
        };
        if back == 0 {
            // Not fragments of ours (acknowledged twice, or confused): counts for nothing.
            return SendNext::Wait;
        }
        st.acked += len;
        if st.acked >= total {
            SendNext::Complete
        } else {
            SendNext::Post
        }
    }

    /// The receiver asked us to stage (GPU memory through host fragments): the pipeline `st`
    /// is ready, its fragments are to be posted.
    pub(crate) fn staged(&mut self, st: StageSend) -> SendNext {
        self.rreq = Some(st.rreq);
        self.stage = Some(Box::new(st));
        self.wait = SendWait::Posting;
        SendNext::Post
    }
}
