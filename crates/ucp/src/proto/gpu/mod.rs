//! GPU memory: the bounce eager protocol for small messages, the staged pipeline through pinned
//! host fragments (sender and receiver sides), the receiver's choice of GPU path, and the
//! staging and copy-lane registrations they share, and host-to-GPU remote writes.

mod bounce;
pub(crate) mod offer;
mod pipeline_recv;
mod pipeline_send;
mod recv;
pub(crate) mod staging;
mod write;

pub(crate) use bounce::Bounced;
pub(crate) use pipeline_recv::Chunk;
pub(crate) use pipeline_send::StageSend;
pub(crate) use staging::Staging;
pub(crate) use write::GPU_WRITE_HINT;

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
}

impl Default for StagedRecv {
    fn default() -> Self {
        StagedRecv {
            chunks: std::collections::VecDeque::new(),
            landed: 0,
            pull: false,
            lane: usize::MAX,
            staged_host: false,
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
    /// sender counts against its message).
    pub(crate) fn release_chunks(&mut self, io: &mut impl ProtoIo) {
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
