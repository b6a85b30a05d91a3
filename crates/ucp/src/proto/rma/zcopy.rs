//! The zero-copy path: the local buffer registered with (or, where the domain only describes
//! host memory, described by) the lane's domain, moved to or from the remote region in
//! fragments of at most what one operation of the lane moves.

use rucx_ucs::Result;
use rucx_uct::{Iov, MemHandle, MemRegion, RemoteKey};

use super::{RmaIo, RmaNext, RmaPath, RmaPosted, RmaReq};
use crate::context::RegGuard;
use crate::proto::gpu::stage_io::On;

/// A zero-copy put or get.
pub(crate) struct ZcopyRma {
    lane: usize,
    /// Local start address.
    addr: usize,
    /// Remote start address.
    remote: u64,
    key: RemoteKey,
    /// The local buffer's registration (held by the request).
    memh: MemHandle,
    /// Bytes posted so far.
    posted: usize,
    /// Every fragment is posted.
    all_posted: bool,
}

/// Register the local buffer with the domain of `lane`: the path, and the registration the
/// request holds.
pub(super) fn start(
    io: &mut impl RmaIo,
    r: &RmaReq<'_>,
    lane: usize,
    key: RemoteKey,
) -> Result<(RmaPath, RegGuard)> {
    let region = MemRegion {
        addr: r.addr,
        len: r.len,
        mem_type: r.local.mem,
        device: r.local.dev,
    };
    let g = io.register_local(lane, region)?;
    let z = ZcopyRma {
        lane,
        addr: r.addr,
        remote: r.remote,
        key,
        memh: g.registration().clone(),
        posted: 0,
        all_posted: false,
    };
    Ok((RmaPath::Zcopy(z), g))
}

impl ZcopyRma {
    /// Every fragment is posted.
    pub(super) fn all_posted(&self) -> bool {
        self.all_posted
    }

    /// Post the fragments not posted yet (of `len` bytes in all, to peer `p`); complete once
    /// all are posted and none is in flight.
    pub(super) fn advance(
        &mut self,
        io: &mut impl RmaIo,
        id: u64,
        p: usize,
        put: bool,
        len: usize,
    ) -> Result<RmaNext> {
        if !self.all_posted {
            let max = io.lane_max(self.lane, put).max(1);
            while self.posted < len {
                let off = self.posted;
                let n = max.min(len - off);
                let iov = [Iov {
                    addr: self.addr + off,
                    len: n,
                    memh: &self.memh,
                }];
                let at = self.remote + off as u64;
                let key = &self.key;
                let on = On::Lane { p, lane: self.lane };
                let posted = io.post_on(id, on, |ep, t| {
                    if put {
                        ep.put_zcopy(&iov, at, key, t)
                    } else {
                        ep.get_zcopy(&iov, at, key, t)
                    }
                })?;
                if posted == RmaPosted::Later {
                    return Ok(RmaNext::Later);
                }
                self.posted = off + n;
            }
            self.all_posted = true;
        }
        Ok(if io.outstanding(id) == 0 {
            RmaNext::Complete
        } else {
            RmaNext::Wait
        })
    }
}
