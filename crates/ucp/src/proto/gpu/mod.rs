//! GPU memory: the bounce eager protocol for small messages, the staged pipeline through pinned
//! host fragments (sender and receiver sides), the receiver's choice of GPU path, and the
//! staging and copy-lane registrations they share.

mod bounce;
mod pipeline_recv;
mod pipeline_send;
mod recv;
pub(crate) mod staging;

pub(crate) use bounce::Bounced;
pub(crate) use pipeline_recv::Chunk;
pub(crate) use pipeline_send::StageSend;
pub(crate) use staging::Staging;

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
