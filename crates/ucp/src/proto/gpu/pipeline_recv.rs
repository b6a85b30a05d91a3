//! The staged pipeline, receiver side, as a state machine over [`StageIo`]: announced fragments
//! (or a host sender's buffer) read in chunks over a host RMA lane, into the host buffer or
//! through receive staging slots to the GPU (or, mapped from a peer on this host, copied
//! straight to the GPU), each acknowledged so the sender reuses it. Every method returns what
//! the worker does next ([`StagedNext`], [`Posting`]); the worker only dispatches
//! (`stage_io.rs`).

use rucx_ucs::{Error, Result};
use rucx_uct::{Iov, MemHandle, MemRegion, RemoteKey};

use super::stage_io::{LaneState, On, StageIo};
use crate::proto::io::ProtoIo;
use crate::proto::rndv::{RecvNext, RndvRecv};
use crate::wire::{Msg, NamedKey};
use crate::worker::state::{FragAck, TokWhat};

/// Most bytes of consecutive mapped fragments copied to the GPU at once.
const MERGE_BYTES: usize = 4 << 20;

/// A piece of a rendezvous receive to read.
pub(crate) struct Chunk {
    pub(crate) raddr: u64,
    pub(crate) len: usize,
    pub(crate) off: usize,
    pub(crate) rkey: RemoteKey,
    /// Staging fragment of the sender to acknowledge once read, and the length it staged there
    /// (more than `len` when the receive buffer is smaller: the sender counts acknowledged
    /// bytes against its whole message).
    pub(crate) sfrag: Option<(u64, usize)>,
    /// The remote fragment mapped into this process (shared memory), with its registration
    /// on the copy lane: copied straight to the GPU, without a read into local staging.
    pub(crate) local: Option<(usize, MemHandle)>,
}

/// A chunk read into receive staging slot `slot`, whose copy to the GPU the copy lane pushed
/// back: posted again before any new read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PendingCopy {
    pub(crate) slot: usize,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// A fragment the sender staged and announced (FRAG).
#[derive(Clone, Debug)]
pub(crate) struct FragMsg {
    /// Offset in the message.
    pub(crate) off: usize,
    /// Bytes staged.
    pub(crate) len: usize,
    /// Where, in the sender's staging.
    pub(crate) addr: u64,
    /// The sender's fragment id.
    pub(crate) frag: u64,
    /// The sender's key for its staging, named by its domain.
    pub(crate) key: NamedKey,
}

/// What the worker does after a step of a staged receive.
#[derive(Debug, PartialEq)]
pub(crate) enum StagedNext {
    /// Nothing more now: messages or completions are still to come.
    Wait,
    /// Reads or copies can be posted: queue the request on its peer ([`RndvRecv::post_chunks`]).
    Post,
    /// Every byte is in the buffer: complete the receive (its length, or the truncation).
    Complete,
    /// End the receive with this error, and tell the sender (what the receive still holds is
    /// handed back by [`RndvRecv::release_chunks`], after the abort).
    Fail(Error),
}

impl From<RecvNext> for StagedNext {
    fn from(n: RecvNext) -> Self {
        match n {
            RecvNext::Wait => StagedNext::Wait,
            RecvNext::Complete => StagedNext::Complete,
            RecvNext::Fail(e) => StagedNext::Fail(e),
        }
    }
}

/// How posting a staged receive's chunks ended.
#[derive(Debug, PartialEq)]
pub(crate) enum Posting {
    /// Every queued chunk and copy is posted (or there were none).
    Done,
    /// The transport pushed back, or the read lane is being connected: post again after
    /// progress.
    Later,
    /// Every receive staging slot is in use: post again when one comes back.
    NoSlot,
}

/// Hand sender fragment `frag` (`staged` bytes) of send `sreq` of peer `p` back unread.
pub(crate) fn release_unread(io: &mut impl ProtoIo, p: usize, sreq: u64, frag: u64, staged: usize) {
    io.ctrl(
        p,
        &Msg::FragAck {
            src: io.uuid(),
            sreq,
            frag,
            len: staged as u64,
        },
    );
}

/// Acknowledge a fragment read (or no longer needed).
fn ack(io: &mut impl ProtoIo, a: FragAck) {
    release_unread(io, a.peer, a.sreq, a.frag, a.staged);
}

/// A step of a receive that ended meanwhile completed: give its staging slot back and the
/// sender its fragment; copy nothing more into the buffer.
pub(crate) fn step_orphaned(io: &mut impl StageIo, what: TokWhat) {
    match what {
        TokWhat::PullGet { sfrag, rfrag, .. } => {
            if let Some(sf) = sfrag {
                ack(io, sf);
            }
            if let Some(f) = rfrag {
                io.release_slot(f);
            }
        }
        TokWhat::DirectH2D { sfrag, .. } => {
            if let Some(sf) = sfrag {
                ack(io, sf);
            }
        }
        TokWhat::H2D { rfrag, .. } => io.release_slot(rfrag),
        TokWhat::Plain | TokWhat::StageD2H { .. } => {}
    }
}

impl RndvRecv {
    /// The sender announced a staged fragment for this receive (request `rid`): read it on a
    /// lane of its key's domain (chosen on the first fragment, or again when the key's domain
    /// changes), clamped to the bytes wanted; a fragment wholly past them is acknowledged
    /// unread. A key that does not unpack, or no lane (or registration) left to read it, ends
    /// the receive; the fragment is handed back after the abort.
    pub(crate) fn on_frag(&mut self, io: &mut impl StageIo, rid: u64, f: FragMsg) -> StagedNext {
        let (mi, rkey) = match io.unpack_named(&f.key) {
            Ok(k) => k,
            Err(e) => {
                self.staged.unread.push((f.frag, f.len));
                return StagedNext::Fail(e);
            }
        };
        if let Err(e) = self.read_lane_for(io, rid, mi) {
            self.staged.unread.push((f.frag, f.len));
            return StagedNext::Fail(e);
        }
        // Never read past the receive buffer (truncation): acknowledge the rest unread. The
        // acknowledgement of a clamped chunk still carries the whole staged length.
        let n = f.len.min(self.want.saturating_sub(f.off));
        if n == 0 {
            release_unread(io, self.peer, self.sreq, f.frag, f.len);
            return StagedNext::Wait;
        }
        let local = if self.staged.mem.is_gpu() {
            io.map_fragment(mi, &rkey, f.addr)
        } else {
            None
        };
        self.staged.chunks.push_back(Chunk {
            raddr: f.addr,
            len: n,
            off: f.off,
            rkey,
            sfrag: Some((f.frag, f.len)),
            local,
        });
        StagedNext::Post
    }

    /// Fragments staged by the sender carry a key of its RMA lane's domain, which need not be
    /// the domain of our lane (a demotion on either side moves a lane): read them through a
    /// lane of domain `mi`, the buffer registered there when it is read into directly (host
    /// memory). A host buffer no lane can register is read through receive staging and copied
    /// on by the CPU; when even the staging cannot be registered, no path is left.
    pub(crate) fn read_lane_for(
        &mut self,
        io: &mut impl StageIo,
        rid: u64,
        mi: usize,
    ) -> Result<()> {
        if self.staged.active() && io.lane_md(self.staged.lane) == mi {
            return Ok(());
        }
        let lane = io.read_lane(self.peer, mi).ok_or_else(|| {
            let (md, peer) = io.names(mi, self.peer);
            Error::Unsupported {
                what: format!("reading fragments staged with {md}"),
                why: format!("no lane to {peer} reads with that domain"),
            }
        })?;
        let st = &mut self.staged;
        let mut staged_host = false;
        if !st.mem.is_gpu() {
            let region = MemRegion {
                addr: st.dst,
                len: self.want,
                mem_type: st.mem,
                device: st.dev,
            };
            let reg = if io.may_register(mi, st.mem, st.dev) {
                io.register_md(mi, region)
            } else {
                let (md, _) = io.names(mi, self.peer);
                Err(Error::Unsupported {
                    what: format!("registering a receive buffer with {md}"),
                    why: "the domain is demoted for host memory".into(),
                })
            };
            match reg {
                Ok(g) => {
                    st.reg = Some(g.registration().clone());
                    io.keep(rid, g, true);
                }
                // The buffer cannot be read into directly: read into receive staging (which
                // that domain registers apart) and copy on.
                Err(e) => {
                    tracing::debug!("receive buffer not registered ({e}); reading through staging");
                    io.recv_staging(mi)?;
                    st.reg = None;
                    staged_host = true;
                    io.count("rendezvous receive staged into host memory");
                }
            }
        }
        st.lane = lane;
        st.staged_host = staged_host;
        Ok(())
    }

    /// Post the copies the copy lane pushed back, then reads of the queued chunks: straight
    /// into a host buffer, or into a receive staging slot (then copied on), or, for a fragment
    /// mapped here, one copy to the GPU for it and the fragments behind it that continue it.
    pub(crate) fn post_chunks(&mut self, io: &mut impl StageIo, rid: u64) -> Result<Posting> {
        if !self.flush_copies(io, rid)? {
            return Ok(Posting::Later);
        }
        let (p, sreq) = (self.peer, self.sreq);
        loop {
            let st = &mut self.staged;
            let Some(c) = st.chunks.front() else {
                return Ok(Posting::Done);
            };
            let (lane, raddr, len, off) = (st.lane, c.raddr, c.len, c.off);
            let sfrag = c.sfrag.map(|(frag, staged)| FragAck {
                peer: p,
                sreq,
                frag,
                staged,
            });
            let gpu = st.mem.is_gpu();
            if c.local.is_none() && io.lane_state(p, lane) == LaneState::Connecting {
                return Ok(Posting::Later);
            }
            if gpu && let Some((laddr, lmemh)) = c.local.clone() {
                // The sender's fragment is mapped here: one DMA copy to the GPU, for it and the
                // fragments queued behind it that continue it in both the mapping and the
                // buffer (consecutive fragments of the sender's staging, each whole but the
                // last): one copy, one completion, one acknowledgement for them all.
                let key = st
                    .copy_key
                    .clone()
                    .ok_or_else(|| Error::Internal("GPU receive without its copy key".into()))?;
                let (len, k, sfrag) = st.mapped_run(laddr, len, off, sfrag);
                let iov = [Iov {
                    addr: laddr,
                    len,
                    memh: &lmemh,
                }];
                let dst = (st.dst + off) as u64;
                let what = TokWhat::DirectH2D { len, sfrag };
                if !io.post_step(rid, On::Copy, what, |ep, tok| {
                    ep.put_zcopy(&iov, dst, &key, tok)
                })? {
                    return Ok(Posting::Later);
                }
                self.staged.chunks.drain(..k);
                io.count("staged fragment copied to the GPU from shared memory");
                if k > 1 {
                    io.count("staged fragments copied to the GPU in runs");
                }
                continue;
            }
            let rkey = c.rkey.clone();
            let (iov_addr, memh, rfrag) = if gpu || st.staged_host {
                let md = io.lane_md(lane);
                let memh = io.recv_staging(md)?;
                let Some((f, addr)) = io.take_slot() else {
                    return Ok(Posting::NoSlot);
                };
                (addr, memh, Some(f))
            } else {
                let memh = st.reg.clone().ok_or_else(|| {
                    Error::Internal("a staged read without its registration".into())
                })?;
                (st.dst + off, memh, None)
            };
            let iov = [Iov {
                addr: iov_addr,
                len,
                memh: &memh,
            }];
            let what = TokWhat::PullGet {
                off,
                len,
                sfrag,
                rfrag,
            };
            match io.post_step(rid, On::Lane { p, lane }, what, |ep, tok| {
                ep.get_zcopy(&iov, raddr, &rkey, tok)
            }) {
                Ok(true) => {
                    self.staged.chunks.pop_front();
                }
                Ok(false) => {
                    if let Some(f) = rfrag {
                        io.release_slot(f);
                    }
                    return Ok(Posting::Later);
                }
                Err(e) => {
                    if let Some(f) = rfrag {
                        io.release_slot(f);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Post the copies to the GPU that wait for the copy lane, in order. False: pushed back.
    fn flush_copies(&mut self, io: &mut impl StageIo, rid: u64) -> Result<bool> {
        while let Some(&c) = self.staged.copies.front() {
            let key = self
                .staged
                .copy_key
                .clone()
                .ok_or_else(|| Error::Internal("GPU receive without its copy key".into()))?;
            let memh = io.copy_staging()?;
            let iov = [Iov {
                addr: io.slot_addr(c.slot),
                len: c.len,
                memh: &memh,
            }];
            let dst = (self.staged.dst + c.off) as u64;
            let what = TokWhat::H2D {
                rfrag: c.slot,
                len: c.len,
            };
            match io.post_step(rid, On::Copy, what, |ep, tok| {
                ep.put_zcopy(&iov, dst, &key, tok)
            }) {
                Ok(true) => {
                    self.staged.copies.pop_front();
                }
                Ok(false) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// A step of this receive completed with `res`: a read of a chunk (into the buffer, or a
    /// staging slot then copied on), or a copy to the GPU. A failed step ends the receive; its
    /// slot goes back now, the sender's fragment after the abort.
    pub(crate) fn on_step_done(
        &mut self,
        io: &mut impl StageIo,
        rid: u64,
        what: TokWhat,
        res: Result<()>,
    ) -> StagedNext {
        if let Err(e) = res {
            match what {
                TokWhat::PullGet { sfrag, rfrag, .. } => {
                    if let Some(f) = rfrag {
                        io.release_slot(f);
                    }
                    if let Some(sf) = sfrag {
                        self.staged.unread.push((sf.frag, sf.staged));
                    }
                }
                TokWhat::DirectH2D { sfrag, .. } => {
                    if let Some(sf) = sfrag {
                        self.staged.unread.push((sf.frag, sf.staged));
                    }
                }
                TokWhat::H2D { rfrag, .. } => io.release_slot(rfrag),
                TokWhat::Plain | TokWhat::StageD2H { .. } => {}
            }
            return StagedNext::Fail(e);
        }
        match what {
            TokWhat::PullGet {
                off,
                len,
                sfrag,
                rfrag,
            } => {
                if let Some(sf) = sfrag {
                    ack(io, sf);
                }
                match rfrag {
                    // Into a host buffer no lane could register: copied on from staging.
                    Some(f) if self.staged.staged_host => {
                        io.unstage(f, self.staged.dst + off, len);
                        io.release_slot(f);
                        self.land(io, len)
                    }
                    // Into the GPU buffer: staging -> device by the copy lane.
                    Some(f) => {
                        self.staged
                            .copies
                            .push_back(PendingCopy { slot: f, off, len });
                        match self.flush_copies(io, rid) {
                            Ok(true) => StagedNext::Wait,
                            Ok(false) => StagedNext::Post,
                            Err(e) => StagedNext::Fail(e),
                        }
                    }
                    None => self.land(io, len),
                }
            }
            TokWhat::DirectH2D { len, sfrag } => {
                if let Some(sf) = sfrag {
                    ack(io, sf);
                }
                self.land(io, len)
            }
            TokWhat::H2D { rfrag, len } => {
                io.release_slot(rfrag);
                self.land(io, len)
            }
            TokWhat::Plain | TokWhat::StageD2H { .. } => StagedNext::Wait,
        }
    }

    /// `len` more bytes reached the user buffer.
    fn land(&mut self, io: &mut impl StageIo, len: usize) -> StagedNext {
        let want = self.want;
        self.chunk_landed(io, len, want).into()
    }
}

impl super::StagedRecv {
    /// Whether the receive holds anything to hand back when it ends.
    pub(crate) fn holds_any(&self) -> bool {
        !self.chunks.is_empty() || !self.unread.is_empty() || !self.copies.is_empty()
    }

    /// The run of mapped fragments starting with the front chunk (mapped at `laddr`, `len`
    /// bytes at offset `off`, fragment `sfrag`): its bytes, how many chunks, and the
    /// acknowledgement covering them all.
    fn mapped_run(
        &self,
        laddr: usize,
        len: usize,
        off: usize,
        sfrag: Option<FragAck>,
    ) -> (usize, usize, Option<FragAck>) {
        let (mut len, mut k, mut sfrag) = (len, 1usize, sfrag);
        let Some(first) = sfrag else {
            return (len, k, sfrag);
        };
        let whole = first.staged;
        let mut last_whole = self.chunks.front().is_some_and(|c| c.len == whole);
        for d in self.chunks.iter().skip(1) {
            let next = match (d.local.as_ref(), d.sfrag) {
                (Some((a, _)), Some((f, st)))
                    if last_whole
                        && *a == laddr + len
                        && d.off == off + len
                        && f == first.frag + k as u64
                        && st <= whole
                        && len + d.len <= MERGE_BYTES =>
                {
                    (d.len, st)
                }
                _ => break,
            };
            len += next.0;
            k += 1;
            last_whole = next.0 == whole && next.1 == whole;
            if let Some(s) = sfrag.as_mut() {
                s.staged += next.1;
            }
        }
        (len, k, sfrag)
    }
}
