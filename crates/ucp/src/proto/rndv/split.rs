//! Split rendezvous: the receiver reads the head while the sender writes (or, when it cannot,
//! streams) the tail; each side finishes after both halves (the sender's count of halves is
//! [`RndvSend::split_step`]).

use crate::worker::prelude::*;

impl State {
    /// Streamed bytes of the tail of a split receive (the sender could not write it): copied in
    /// place, counted apart from the reads of the head; once the whole tail came it counts as
    /// the sender's finish. False when `rreq` is not a split receive (ordinary streaming).
    pub(crate) fn split_tail_data(&mut self, rreq: u64, offset: usize, data: &[u8]) -> bool {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&rreq)
        else {
            return false;
        };
        let RecvProto::Rndv(rv) = &mut rs.proto else {
            return false;
        };
        if rv.get_end >= rv.want || !rv.fin_pending || rs.mem.is_gpu() {
            return false;
        }
        // Only the tail `get_end..want` is the sender's to stream; never past the buffer.
        let (lo, hi) = (rv.get_end, rv.want.min(rs.cap));
        let from = offset.max(lo);
        let to = offset.saturating_add(data.len()).min(hi);
        if from < to {
            // SAFETY: the receive buffer was lent mutably to the scope, which keeps it alive and
            // unaliased until the request is finished; `lo <= from < to <= cap`, and the reads
            // of the head write only below `get_end`.
            let dst = unsafe { host_slice_mut(rs.addr + from, to - from) };
            dst.copy_from_slice(&data[from - offset..to - offset]);
            rv.tail_got += to - from;
        }
        if rv.tail_got >= hi - lo {
            // The whole tail is here: as the finish message of a written tail.
            self.tail_landed(rreq);
        }
        true
    }

    /// The sender's part of a rendezvous receive has landed (its finish message, or the whole
    /// streamed tail of a split): complete the receive, or, for a split whose reads of the head
    /// are still running, let those complete it.
    pub(crate) fn tail_landed(&mut self, rreq: u64) {
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rreq)
        {
            if let Some(rv) = rs.rndv_mut()
                && rv.fin_pending
            {
                rv.fin_pending = false;
                if !rv.gets_done {
                    return;
                }
            }
            rs.received = rs.total.min(rs.cap);
        }
        self.complete_recv(rreq);
    }
}
