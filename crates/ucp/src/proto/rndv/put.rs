//! Rendezvous by write (`put_zcopy`): the sender writes the receiver's registered buffer (all of
//! it, or the tail of a split), flushes, and sends the finish message once the writes completed
//! ([`RndvSend::transfers_done`]); or, when it cannot write, streams the data through active
//! messages.

use crate::proto::eager_multi::{AmFrags, FragHead, FragSend};
use crate::proto::io::SendIo;
use crate::worker::prelude::*;

impl RndvSend {
    /// Post the data the receiver asked for, from byte `posted` on: written (put, in fragments
    /// of at most `put_max` bytes, then a flush), or streamed on the active-message lane `am`.
    /// `Ok(true)`: all posted, waiting for the completions; `Ok(false)`: the transport pushed
    /// back (call again after progress); an error ends the send.
    pub(crate) fn post_data(
        &mut self,
        io: &mut impl SendIo,
        req: u64,
        head: &SendHead,
        am: &AmFrags,
        put_max: usize,
    ) -> Result<bool> {
        if self.wait != SendWait::Posting {
            // Announced, not answered yet (or posted already): nothing to post now.
            return Ok(true);
        }
        let Some(rreq) = self.rreq else {
            return Ok(true);
        };
        let done = match self.put.clone() {
            Some((raddr, rkey, lane)) => {
                self.post_writes(io, req, head, lane, raddr, &rkey, put_max)?
            }
            None => {
                // Zero-copy from a registration of the AM lane's domain; a streamed split tail
                // is copied in (its registrations serve the receiver's reads of the head).
                let memh = if self.split_left > 0 {
                    None
                } else {
                    io.reg(req, am.md)
                };
                let frags = FragSend {
                    req,
                    peer: head.peer,
                    lane: am.lane,
                    src: io.uuid(),
                    head: FragHead::Rndv { rreq },
                    addr: head.addr,
                    len: head.len,
                    max_bcopy: am.max_bcopy,
                    zcopy: memh.as_ref().map(|m| (am.max_zcopy, m)),
                };
                let mut off = self.posted;
                let res = frags.post(io, &mut off);
                self.posted = off;
                res?
            }
        };
        if done {
            self.wait = SendWait::Completions;
        }
        Ok(done)
    }

    /// Write `posted..len` of the send to `raddr` on `lane`, then flush (the writes are visible
    /// before the receiver is told).
    #[allow(clippy::too_many_arguments)]
    fn post_writes(
        &mut self,
        io: &mut impl SendIo,
        req: u64,
        head: &SendHead,
        lane: usize,
        raddr: u64,
        rkey: &RemoteKey,
        max: usize,
    ) -> Result<bool> {
        // The registration of the lane's domain (a send may hold another domain's as well: the
        // one made for the receiver's reads when it offered them).
        let memh = io.reg(req, io.lane_md(lane)).ok_or_else(|| {
            Error::Internal(format!(
                "a rendezvous write on lane {lane} without a registration of its domain"
            ))
        })?;
        while self.posted < head.len {
            let off = self.posted;
            let n = max.max(1).min(head.len - off);
            let iov = [Iov {
                addr: head.addr + off,
                len: n,
                memh: &memh,
            }];
            let at = raddr + off as u64;
            if !io.post(req, head.peer, lane, |ep, t| {
                ep.put_zcopy(&iov, at, rkey, t)
            })? {
                return Ok(false);
            }
            self.posted = off + n;
        }
        io.post(req, head.peer, lane, |ep, t| ep.flush(t))
    }
}
