//! A flush of a peer's lanes: one flush per lane, and the end of every staged or mapped put
//! and get of the peer that was running when the flush was posted (their operations are not
//! all posted yet, so the lanes' flushes do not cover them).

use rucx_ucs::Result;

use super::{RmaIo, RmaNext, RmaPosted};
use crate::proto::gpu::stage_io::On;

/// A flush request's state.
pub(crate) struct FlushRma {
    /// Lanes still to flush.
    lanes: Vec<usize>,
    /// Staged puts and gets of the peer still running when the flush was posted.
    after: Vec<u64>,
    /// Every lane's flush is posted.
    posted: bool,
    /// A caller's flush, which ends with the error its peer's puts, gets and atomics left
    /// (`Peer::rma_error`); a close's flush does not (the close goes on).
    pub(crate) report: bool,
}

impl FlushRma {
    pub(super) fn new(lanes: Vec<usize>, after: Vec<u64>) -> FlushRma {
        FlushRma {
            lanes,
            after,
            posted: false,
            report: false,
        }
    }

    /// Every lane's flush is posted.
    pub(super) fn posted(&self) -> bool {
        self.posted
    }

    /// Post the lanes' flushes to peer `p`; once none is in flight, end if every request it
    /// waits for ended.
    pub(super) fn advance(&mut self, io: &mut impl RmaIo, id: u64, p: usize) -> Result<RmaNext> {
        while let Some(&lane) = self.lanes.last() {
            if io.post_on(id, On::Lane { p, lane }, |ep, t| ep.flush(t))? == RmaPosted::Later {
                return Ok(RmaNext::Later);
            }
            self.lanes.pop();
        }
        self.posted = true;
        Ok(if io.outstanding(id) == 0 {
            self.may_end(io)
        } else {
            RmaNext::Wait
        })
    }

    /// The lanes are flushed: the flush ends once every request it waits for ended.
    pub(super) fn may_end(&mut self, io: &mut impl RmaIo) -> RmaNext {
        self.after.retain(|&i| !io.ended(i));
        if self.after.is_empty() {
            RmaNext::Complete
        } else {
            RmaNext::FlushWait
        }
    }
}
