//! GPU memory: the bounce eager protocol for small messages, the staged pipeline through pinned
//! host fragments (sender and receiver sides), the receiver's choice of GPU path, and the
//! staging and copy-lane registrations they share, and host-to-GPU remote writes.

mod bounce;
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
