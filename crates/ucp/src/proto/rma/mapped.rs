//! A staged put or get whose remote region this process maps (the peer's shared memory on
//! this host): one copy by the copy lane between the local GPU buffer and the mapping, no
//! window.

use rucx_ucs::Result;
use rucx_uct::{Iov, MemHandle, RemoteKey};

use super::{RmaIo, RmaNext, RmaPosted};
use crate::proto::gpu::stage_io::On;

/// A staged put or get copied straight between the local GPU buffer and the peer's region
/// mapped into this process ([`MemoryDomain::rkey_ptr`](rucx_uct::MemoryDomain::rkey_ptr),
/// registered with the copy lane once per mapping).
pub(crate) struct MappedRma {
    /// The local GPU buffer's key on the copy lane.
    pub(super) gpu_key: RemoteKey,
    /// The local GPU buffer's address.
    pub(super) addr: usize,
    /// The remote range's address in this process.
    pub(super) at: usize,
    /// The mapping's registration with the copy lane's domain.
    pub(super) memh: MemHandle,
    /// The copy is posted.
    pub(super) posted: bool,
}

impl MappedRma {
    /// The copy is posted.
    pub(super) fn posted(&self) -> bool {
        self.posted
    }

    /// Post the one copy of `len` bytes (put: out of the GPU into the mapping; get: out of the
    /// mapping into the GPU); the request completes with it.
    pub(super) fn advance(
        &mut self,
        io: &mut impl RmaIo,
        id: u64,
        put: bool,
        len: usize,
    ) -> Result<RmaNext> {
        if self.posted {
            return Ok(RmaNext::Wait);
        }
        let iov = [Iov {
            addr: self.at,
            len,
            memh: &self.memh,
        }];
        let (gpu_at, key) = (self.addr as u64, &self.gpu_key);
        let posted = io.post_on(id, On::Copy, |ep, t| {
            if put {
                ep.get_zcopy(&iov, gpu_at, key, t)
            } else {
                ep.put_zcopy(&iov, gpu_at, key, t)
            }
        })?;
        if posted == RmaPosted::Later {
            return Ok(RmaNext::Later);
        }
        self.posted = true;
        Ok(if io.outstanding(id) == 0 {
            RmaNext::Complete
        } else {
            RmaNext::Wait
        })
    }
}
