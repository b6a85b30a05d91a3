//! Remote memory access requests (put, get, flush on an endpoint) and the fragmented zero-copy
//! transfers that rendezvous reads and writes use too.

use crate::worker::prelude::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum RmaDir {
    Put,
    Get,
    Flush,
}

pub(crate) struct RmaState {
    pub(crate) peer: usize,
    pub(crate) dir: RmaDir,
    pub(crate) len: usize,
    pub(crate) lane: usize,
    pub(crate) addr: usize,
    pub(crate) remote: u64,
    pub(crate) key: Option<RemoteKey>,
    pub(crate) posted: usize,
    /// Lanes still to flush (flush requests).
    pub(crate) flush_lanes: Vec<usize>,
}

/// A fragmented zero-copy transfer between a registered local range and a remote one.
pub(crate) struct Frags<'a> {
    /// Write (`put_zcopy`) or read (`get_zcopy`).
    pub(crate) put: bool,
    /// Local start address (offset 0 of the transfer).
    pub(crate) local: usize,
    /// Remote start address.
    pub(crate) remote: u64,
    pub(crate) key: &'a RemoteKey,
    pub(crate) memh: &'a MemHandle,
    /// Largest fragment.
    pub(crate) max: usize,
    /// End offset.
    pub(crate) end: usize,
}

impl State {
    pub(crate) fn post_rma(
        &mut self,
        p: usize,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Result<u64> {
        self.check_peer(p)?;
        self.refresh_plan(p);
        let t = self.peers[p]
            .plan
            .table(if put { Op::Put } else { Op::Get }, MemKey::HOST);
        if t.rows.is_empty() {
            return Err(t.refusal(&self.peers[p].remote.describe()));
        }
        let lane = self.peers[p]
            .rma
            .ok_or_else(|| t.refusal(&self.peers[p].remote.describe()))?;
        let md = self.slots[lane].md;
        let mdname = self.ctx.domain(md).name().to_string();
        let key = rkey
            .keys
            .iter()
            .find(|(n, _)| *n == mdname)
            .map(|(_, k)| k.clone())
            .ok_or_else(|| Error::InvalidRkey {
                domain: mdname.clone(),
                reason: "the remote key bundle has no key for the transport to this peer".into(),
            })?;
        // The region the peer mapped, not only the domain's key: a registration is aligned out
        // to whole pages (and the registration cache may merge it with its neighbours), so the
        // key alone lets an access run past the mapped buffer.
        rkey.check(remote, len as u64)?;
        key.check(remote, len as u64)?;
        let g = if len > 0 {
            Some(self.register_md(md, MemRegion::host(addr, len))?)
        } else {
            None
        };
        let id = self.new_req(ReqKind::Rma(RmaState {
            peer: p,
            dir: if put { RmaDir::Put } else { RmaDir::Get },
            len,
            lane,
            addr,
            remote,
            key: Some(key),
            posted: 0,
            flush_lanes: Vec::new(),
        }));
        if let Some(g) = g {
            self.reqs.get_mut(&id).expect("req").guards.push(g);
        } else {
            self.finish(
                id,
                Ok(Completion {
                    len: 0,
                    tag: 0,
                    sender: None,
                }),
            );
            return Ok(id);
        }
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
        Ok(id)
    }

    pub(crate) fn post_flush(&mut self, p: usize) -> Result<u64> {
        self.check_peer(p)?;
        Ok(self.flush_req(p))
    }

    /// A flush of every lane of peer `p` (checked by the caller).
    pub(crate) fn flush_req(&mut self, p: usize) -> u64 {
        let lanes: Vec<usize> = self.peers[p].eps.keys().copied().collect();
        let id = self.new_req(ReqKind::Rma(RmaState {
            peer: p,
            dir: RmaDir::Flush,
            len: 0,
            lane: 0,
            addr: 0,
            remote: 0,
            key: None,
            posted: 0,
            flush_lanes: lanes,
        }));
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
        id
    }

    /// Post the operations of a put, get or flush request.
    pub(crate) fn stream_rma(&mut self, id: u64) -> Result<bool> {
        let ReqKind::Rma(rm) = &self.reqs[&id].kind else {
            return Ok(true);
        };
        let (p, dir, len, lane, addr, remote, posted) = (
            rm.peer, rm.dir, rm.len, rm.lane, rm.addr, rm.remote, rm.posted,
        );
        if dir == RmaDir::Flush {
            while let Some(&l) = match &self.reqs[&id].kind {
                ReqKind::Rma(rm) => rm.flush_lanes.last(),
                _ => None,
            } {
                if !self.post(id, p, l, |ep, t| ep.flush(t))? {
                    return Ok(false);
                }
                if let Some(Req {
                    kind: ReqKind::Rma(rm),
                    ..
                }) = self.reqs.get_mut(&id)
                {
                    rm.flush_lanes.pop();
                }
            }
        } else {
            let key = match &self.reqs[&id].kind {
                ReqKind::Rma(rm) => rm.key.clone().expect("rma key"),
                _ => unreachable!("rma request"),
            };
            let memh = self.reqs[&id].guards[0].registration().clone();
            let lim = &self.slots[lane].attr.limits;
            let max = if dir == RmaDir::Put {
                lim.put_max_zcopy
            } else {
                lim.get_max_zcopy
            }
            .min(self.frag)
            .max(1);
            let mut off = posted;
            let f = Frags {
                put: dir == RmaDir::Put,
                local: addr,
                remote,
                key: &key,
                memh: &memh,
                max,
                end: len,
            };
            let res = self.post_frags(id, p, lane, &f, &mut off);
            if let Some(Req {
                kind: ReqKind::Rma(rm),
                ..
            }) = self.reqs.get_mut(&id)
            {
                rm.posted = off;
            }
            if !res? {
                return Ok(false);
            }
        }
        if let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        {
            rm.posted = usize::MAX;
        }
        if self.reqs[&id].outstanding == 0 {
            self.finish(
                id,
                Ok(Completion {
                    len,
                    tag: 0,
                    sender: None,
                }),
            );
        }
        Ok(true)
    }

    /// Post the zero-copy fragments of `f` from `*off` to `f.end` on `lane`, at most `f.max`
    /// bytes each, advancing `*off` past every posted one; `Ok(false)`: the transport pushed
    /// back (resume from `*off`).
    pub(crate) fn post_frags(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        f: &Frags<'_>,
        off: &mut usize,
    ) -> Result<bool> {
        while *off < f.end {
            let n = f.max.min(f.end - *off);
            let iov = [Iov {
                addr: f.local + *off,
                len: n,
                memh: f.memh,
            }];
            let at = f.remote + *off as u64;
            let posted = self.post(id, p, lane, |ep, t| {
                if f.put {
                    ep.put_zcopy(&iov, at, f.key, t)
                } else {
                    ep.get_zcopy(&iov, at, f.key, t)
                }
            })?;
            if !posted {
                return Ok(false);
            }
            *off += n;
        }
        Ok(true)
    }
}
