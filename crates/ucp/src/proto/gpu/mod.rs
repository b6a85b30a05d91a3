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
