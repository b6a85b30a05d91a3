//! GPU memory: the bounce eager protocol for small messages, the staged pipeline through pinned
//! host fragments (sender and receiver sides), the receiver's choice of GPU path, and the
//! staging and copy-lane registrations they share, and host-to-GPU remote writes. Both sides of
//! the pipeline (`pipeline_send.rs`, `pipeline_recv.rs`) and the receiver's path choice
//! (`recv.rs`) are state machines over [`stage_io::StageIo`]; the worker runs their steps
//! (`stage_io.rs`).

pub(crate) mod bounce;
pub(crate) mod offer;
mod pipeline_recv;
mod pipeline_send;
mod recv;
#[cfg(test)]
mod recv_tests;
#[cfg(test)]
mod send_tests;
pub(crate) mod stage_io;
pub(crate) mod staging;
pub(crate) mod write;

pub(crate) use bounce::Bounced;
pub(crate) use pipeline_recv::{Chunk, FragMsg, PendingCopy, Posting, StagedNext};
pub(crate) use pipeline_send::{PullChoice, StageSend};
pub(crate) use recv::GpuRecvChoice;
pub(crate) use stage_io::StageIo;
pub(crate) use staging::Staging;
pub(crate) use write::{GPU_SHARED_HINT, GPU_WRITE_HINT};

use rucx_ucs::MemoryType;
use rucx_uct::{MemHandle, RemoteKey};

use crate::proto::io::ProtoIo;
use crate::proto::rndv::{RecvNext, RndvRecv};
use crate::wire::Msg;

/// The staged part of a GPU rendezvous receive (part of [`crate::proto::rndv::RndvRecv`]):
/// reads still to post, in chunks, into the user buffer or through receive staging. Empty
/// (and unused) for other rendezvous receives.
pub(crate) struct StagedRecv {
    /// Reads still to post (host keyed pull into GPU memory, or staged fragments).
    pub(crate) chunks: std::collections::VecDeque<Chunk>,
    /// Bytes that reached the user buffer through chunks.
    pub(crate) landed: usize,
    /// Fragments are announced by the sender (staged pipeline).
    pub(crate) pull: bool,
    /// Lane the chunks are read on (`usize::MAX`: not chosen yet).
    pub(crate) lane: usize,
    /// A host buffer that no lane could register: its chunks are read into receive staging and
    /// copied on by the CPU.
    pub(crate) staged_host: bool,
    /// The receive buffer: its address, memory type and device.
    pub(crate) dst: usize,
    pub(crate) mem: MemoryType,
    pub(crate) dev: Option<u32>,
    /// A host buffer's registration with the read lane's domain (kept with the request).
    pub(crate) reg: Option<MemHandle>,
    /// A GPU buffer's key on the copy lane (its registration is kept with the request).
    pub(crate) copy_key: Option<RemoteKey>,
    /// Announced fragments given up unread (the receive is ending), acknowledged to the sender
    /// after the abort ([`RndvRecv::release_chunks`]).
    pub(crate) unread: Vec<(u64, usize)>,
    /// Chunks read into staging slots whose copy to the GPU waits for the copy lane.
    pub(crate) copies: std::collections::VecDeque<PendingCopy>,
}

impl Default for StagedRecv {
    fn default() -> Self {
        StagedRecv {
            chunks: std::collections::VecDeque::new(),
            landed: 0,
            pull: false,
            lane: usize::MAX,
            staged_host: false,
            dst: 0,
            mem: MemoryType::Host,
            dev: None,
            reg: None,
            copy_key: None,
            unread: Vec::new(),
            copies: std::collections::VecDeque::new(),
        }
    }
}

impl StagedRecv {
    /// Whether the receive reads in chunks (a lane was chosen for them).
    pub(crate) fn active(&self) -> bool {
        self.lane != usize::MAX
    }
}

/// The staged pipeline's receive steps: the chunks land, or the receive ends early.
impl RndvRecv {
    /// `len` more bytes of a chunk reached the user buffer, of `want` in all. Once every byte
    /// landed and no chunk is left the receive completes; one that read the sender's own
    /// buffer (not fragments it announced) acknowledges the reads first (ATS).
    pub(crate) fn chunk_landed(
        &mut self,
        io: &mut impl ProtoIo,
        len: usize,
        want: usize,
    ) -> RecvNext {
        let st = &mut self.staged;
        st.landed += len;
        if st.landed < want || !st.chunks.is_empty() {
            return RecvNext::Wait;
        }
        if !st.pull {
            io.ctrl(
                self.peer,
                &Msg::Ats {
                    src: io.uuid(),
                    sreq: self.sreq,
                    ok: true,
                },
            );
        }
        RecvNext::Complete
    }

    /// The receive ended early: hand the sender back every fragment it announced that was
    /// not read (each acknowledgement carries the fragment's whole staged length, which the
    /// sender counts against its message), and give back the staging slots whose copy to the
    /// GPU had not started.
    pub(crate) fn release_chunks(&mut self, io: &mut impl StageIo) {
        for c in self.staged.copies.drain(..) {
            io.release_slot(c.slot);
        }
        for (frag, staged) in self.staged.unread.drain(..) {
            pipeline_recv::release_unread(io, self.peer, self.sreq, frag, staged);
        }
        for c in self.staged.chunks.drain(..) {
            if let Some((frag, staged)) = c.sfrag {
                io.ctrl(
                    self.peer,
                    &Msg::FragAck {
                        src: io.uuid(),
                        sreq: self.sreq,
                        frag,
                        len: staged as u64,
                    },
                );
            }
        }
    }
}
