//! The staged pipeline, sender side: asked to stage (`PULL`), the sender copies fragments
//! device -> pinned host with the copy lane, announces each (`FRAG`) and reuses it once
//! acknowledged.

use crate::worker::prelude::*;

/// Most bytes one staging copy fills (a run of consecutive fragments; a fragment larger than
/// this is copied alone).
const RUN_BYTES: usize = 1 << 20;

/// Sender side of a staged pipeline.
pub(crate) struct StageSend {
    pub(crate) rreq: u64,
    /// The host RMA lane the receiver reads the fragments through (their keys are of its
    /// domain), chosen from the plan when asked to stage and kept for the whole send.
    pub(crate) lane: Option<usize>,
    pub(crate) next_off: usize,
    pub(crate) acked: usize,
    /// The user buffer, registered with the copy lane's domain, and its key.
    pub(crate) _dev_memh: RegGuard,
    pub(crate) dev_key: RemoteKey,
}

impl State {
    /// The receiver asked us to stage a (GPU) buffer.
    pub(crate) fn on_pull(&mut self, p: usize, sreq: u64, rreq: u64) {
        let (addr, len, mem, dev) = match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: None,
                ..
            }) if s.peer == p && s.rndv().is_some() => (s.addr, s.len, s.mem, s.dev),
            _ => {
                self.answer_for_gone_send(p, sreq, rreq);
                return;
            }
        };
        let staged = self
            .copy_key(addr, len, mem, dev)
            .and_then(|k| self.ensure_staging().map(|_| k));
        match staged {
            Ok((memh, key)) => {
                // A zero-copy registration made for the RTS is no longer needed.
                self.reqs.get_mut(&sreq).expect("req").guards.clear();
                let st = StageSend {
                    rreq,
                    lane: self.peers[p].rma,
                    next_off: 0,
                    acked: 0,
                    _dev_memh: memh,
                    dev_key: key,
                };
                self.rndv_send_step(sreq, |rv, _, _| rv.staged(st));
                self.pump(p);
            }
            // We cannot stage, and the receiver waits for fragments: end both sides.
            Err(e) => self.rndv_send_step(sreq, |rv, _, _| {
                rv.rreq = Some(rreq);
                SendNext::Fail(e)
            }),
        }
    }

    /// Stage the next fragments of a pipelined send (device -> pinned host).
    pub(crate) fn stream_stage(&mut self, id: u64) -> Result<bool> {
        loop {
            let (addr, len, next_off, lane) = match &self.reqs[&id].kind {
                ReqKind::Send(s) => match s.stage() {
                    Some(st) => (s.addr, s.len, st.next_off, st.lane),
                    None => return Ok(true),
                },
                _ => return Ok(true),
            };
            if next_off >= len {
                return Ok(true);
            }
            let limit = lane.map_or(usize::MAX, |l| {
                self.slots[l].attr.limits.get_max_zcopy.max(1)
            });
            let stg = self.staging.as_mut().expect("staging");
            // Consecutive free fragments are filled by one copy (one call, one completion),
            // up to RUN_BYTES: small fragments then cost the copy engine what large ones do.
            // Only whole fragments make a run (a lane that reads less than a fragment at once
            // stages one at a time).
            let max_run = if stg.frag <= limit {
                (RUN_BYTES / stg.frag).max(1)
            } else {
                1
            };
            let want = (len - next_off).div_ceil(stg.frag).min(max_run);
            let Some((f, k)) = stg.free_send.take_run(want) else {
                // Resumed when the receiver acknowledges a fragment.
                return Ok(true);
            };
            let n = if k == 1 {
                stg.frag.min(limit).min(len - next_off)
            } else {
                (k * stg.frag).min(len - next_off)
            };
            if k > 1 {
                self.count("staging fragments copied in runs");
            }
            let stg = self.staging.as_mut().expect("staging");
            let faddr = stg.addr(f);
            let memh = stg.copy_memh.clone();
            let key = match &self.reqs[&id].kind {
                ReqKind::Send(s) => s.stage().map(|st| st.dev_key.clone()),
                _ => None,
            }
            .expect("checked above");
            let iov = [Iov {
                addr: faddr,
                len: n,
                memh: &memh,
            }];
            let token = self.next_token;
            let ep = &mut self.copy.as_mut().expect("copy lane").1;
            match ep.get_zcopy(&iov, (addr + next_off) as u64, &key, token) {
                Ok(st) => {
                    self.next_token += 1;
                    self.post_tok(
                        id,
                        token,
                        st,
                        TokWhat::StageD2H {
                            frag: f,
                            off: next_off,
                            len: n,
                        },
                    );
                }
                Err(e) => {
                    self.staging.as_mut().expect("staging").release_send(f, n);
                    if e.is_retryable() {
                        return Ok(false);
                    }
                    self.wake_staged_sends(id, false);
                    return Err(e);
                }
            }
            if let Some(Req {
                kind: ReqKind::Send(s),
                ..
            }) = self.reqs.get_mut(&id)
                && let Some(st) = s.stage_mut()
            {
                st.next_off += n;
            }
        }
    }

    /// A send staging fragment came free: every staged send still waiting for one (but
    /// `except`) may go on. Queued on their peers, which the progress loop pumps, or pumped at
    /// once when `pump`.
    pub(crate) fn wake_staged_sends(&mut self, except: u64, pump: bool) {
        let waiting: Vec<(usize, u64)> = self
            .reqs
            .iter()
            .filter_map(|(id, r)| match &r.kind {
                ReqKind::Send(s)
                    if r.result.is_none()
                        && id != except
                        && s.stage().is_some_and(|st| st.next_off < s.len) =>
                {
                    Some((s.peer, id))
                }
                _ => None,
            })
            .collect();
        for (q, id) in waiting {
            if !self.peers[q]
                .queue
                .iter()
                .any(|x| matches!(x, Pending::Stream(y) if *y == id))
            {
                self.peers[q].queue.push_back(Pending::Stream(id));
            }
            if pump {
                self.pump(q);
            }
        }
    }

    /// The receiver read one of our staged fragments.
    pub(crate) fn on_frag_ack(&mut self, sreq: u64, frag: usize, len: usize) {
        if let Some(stg) = self.staging.as_mut() {
            stg.release_send(frag, len);
        }
        // The send may have ended meanwhile (aborted): its fragments still come back.
        if let Some(Req {
            kind: ReqKind::Send(s),
            result: None,
            ..
        }) = self.reqs.get(&sreq)
            && s.stage().is_some()
        {
            let p = s.peer;
            let next = self.with_rndv_send(sreq, |rv, head, _| rv.on_frag_ack(len, head.len));
            if let Some(next) = next {
                let post = next == SendNext::Post;
                self.send_next(sreq, next);
                if post {
                    self.pump(p);
                }
            }
        }
        // Not only this one, which may just have finished or ended.
        self.wake_staged_sends(sreq, true);
    }
}
