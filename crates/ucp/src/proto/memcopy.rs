//! Whole-buffer copies between GPU memory and host memory by the copy lane, for the protocols
//! that carry GPU payloads through host memory: streams (the byte stream is host bytes in
//! order; a GPU send is copied out before its pieces go, a GPU receive fills a host buffer that
//! is copied on when full) and active messages copied in (a small GPU payload copied out, an
//! inline payload fetched into GPU memory).
//!
//! The decisions and sequencing are state machines over a narrow I/O ([`copy_io::CopyIo`],
//! [`copy_io::BounceIo`]) in `memcopy/state.rs`, unit-tested over a fake (`memcopy/fake.rs`,
//! `memcopy/tests.rs`); what follows is the worker's glue: finding the request, running a step,
//! doing what it returns.

pub(crate) mod copy_io;
#[cfg(test)]
pub(crate) mod fake;
pub(crate) mod state;
#[cfg(test)]
mod tests;

use crate::proto::rma::RmaWindow;
use crate::worker::prelude::*;
use state::{LandNext, LandState, Slots};

impl Worker {
    /// Copy `len` bytes of GPU memory at `addr` into a new host buffer, fragment by fragment
    /// through the send staging (each copy waited for).
    pub(crate) fn gpu_to_host(
        &self,
        st: &mut State,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<Vec<u8>> {
        let from = MemRegion {
            addr,
            len,
            mem_type: mem,
            device: dev,
        };
        state::gpu_to_host(&mut self.copy_lane(st), from)
    }
}

impl State {
    /// The host buffer a stream receive of `cap` bytes into GPU memory at `addr` fills, and the
    /// copy lane's registration of the GPU buffer.
    pub(crate) fn gpu_stream_bounce(
        &mut self,
        addr: usize,
        cap: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(Vec<u8>, (RegGuard, RemoteKey))> {
        let to = MemRegion {
            addr,
            len: cap,
            mem_type: mem,
            device: dev,
        };
        state::stream_bounce(self, to)
    }

    /// GPU stream receives of peer `p` whose host buffer is full: copy each on to its GPU
    /// buffer through pinned staging slots (several copies in flight, each fragment copied into
    /// a slot by the CPU while the copy lane moves others to the GPU); each completes once its
    /// last copy finished (or fails with the first error).
    pub(crate) fn land_gpu_streams(&mut self, p: usize, ids: Vec<u64>) {
        for id in ids {
            let Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) = self.reqs.get_mut(&id)
            else {
                continue;
            };
            let bounce = match &mut rs.proto {
                RecvProto::Stream { bounce, .. } => bounce.take(),
                _ => None,
            };
            let Some(host) = bounce else {
                continue;
            };
            rs.proto = RecvProto::Landing(Box::new(Landing {
                m: LandState::new(p, host, self.frag),
                inflight: 0,
                win: None,
            }));
            self.count("stream receive copied to GPU");
            self.peers[p].queue.push_back(Pending::Stream(id));
        }
        self.pump(p);
    }

    /// Copy what fits into free slots and post their copies to the GPU ([`LandState::pump`],
    /// once the receive holds a window); `Ok(false)`: the copy lane pushed back (call again
    /// after progress).
    pub(crate) fn pump_landing(&mut self, id: u64) -> Result<bool> {
        let Some(Req {
            kind:
                ReqKind::Recv(RecvState {
                    proto: RecvProto::Landing(l),
                    addr,
                    dev_memh,
                    ..
                }),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return Ok(true);
        };
        let addr = *addr;
        let key = dev_memh
            .as_ref()
            .map(|d| d.1.clone())
            .ok_or_else(|| Error::Internal("a GPU stream receive without its key".into()))?;
        if l.win.is_none() {
            // A window of the worker's, or a new one while fewer than the most exist; else
            // the receive waits for one (its bytes wait in its host buffer).
            let p = l.m.peer;
            let cmd = self.copy_md().ok_or_else(|| Error::Unsupported {
                what: "copying a stream receive into GPU memory".into(),
                why: "no copy transport (cuda_copy) is open; add cuda_copy to RUCX_TLS".into(),
            })?;
            let Some(w) = self.take_rma_window(cmd, false)? else {
                self.wait_for_window(p, id);
                return Ok(true);
            };
            if let Some(l) = self.landing_mut(id) {
                l.win = Some(w);
            }
        }
        // Taken out of the request while its step acts on the worker.
        let Some(mut l) = self.take_landing(id) else {
            return Ok(true);
        };
        let next = match l.win.as_ref() {
            Some(w) => {
                let slots = Slots {
                    base: w.base(),
                    memh: &w.copy_memh,
                };
                l.m.pump(self, id, (addr, &key), &slots)
            }
            None => Ok(LandNext::Wait),
        };
        l.inflight = self.reqs.get(&id).map_or(0, |r| r.outstanding);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&id)
        {
            rs.proto = RecvProto::Landing(l);
        }
        match next? {
            LandNext::Complete => {
                self.finish_landing(id);
                Ok(true)
            }
            LandNext::Wait => Ok(true),
            LandNext::Later => Ok(false),
        }
    }

    /// A copy of landing receive `id` completed: free the slots whose copy finished and go on.
    pub(crate) fn on_landing_op(&mut self, id: u64) {
        let tokens = &self.tokens;
        let p = match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(l),
                        ..
                    }),
                result: None,
                ..
            }) => {
                l.m.on_copies_done(|t| tokens.contains_key(&t));
                l.m.peer
            }
            _ => return,
        };
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
    }

    /// Every byte of landing receive `id` reached the GPU: hand the window back, complete.
    fn finish_landing(&mut self, id: u64) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            outstanding: 0,
            result: None,
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return;
        };
        let cap = rs.cap;
        let (win, p) = match &mut rs.proto {
            RecvProto::Landing(l) => (l.win.take(), l.m.peer),
            _ => return,
        };
        rs.dev_memh = None;
        if let Some(w) = win {
            self.keep_rma_window(w);
        }
        self.finish(id, Ok(Completion::from_peer(cap, self.ep_id(p))));
    }

    /// Landing receive `id`'s state, taken out of the request (put back by the caller).
    fn take_landing(&mut self, id: u64) -> Option<Box<Landing>> {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return None;
        };
        if !matches!(rs.proto, RecvProto::Landing(_)) {
            return None;
        }
        match std::mem::replace(&mut rs.proto, RecvProto::Tag) {
            RecvProto::Landing(l) => Some(l),
            _ => None,
        }
    }

    fn landing_mut(&mut self, id: u64) -> Option<&mut Landing> {
        match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(l),
                        ..
                    }),
                ..
            }) => Some(l),
            _ => None,
        }
    }
}

/// A full stream receive into GPU memory on its way from its host buffer to the GPU
/// ([`LandState`]), through the slots of a pinned window ([`RmaWindow`], from the worker's pool).
pub(crate) struct Landing {
    pub(crate) m: LandState,
    /// Copies in flight (mirrors the request's count): the window is kept, not freed, if the
    /// receive ends with copies still running.
    pub(crate) inflight: usize,
    /// Last: the window (`None` while waiting for one).
    win: Option<RmaWindow>,
}

impl Landing {
    /// The window, once nothing of the receive is in flight (see [`State::reclaim_window`]).
    pub(crate) fn take_window(&mut self) -> Option<RmaWindow> {
        self.win.take()
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if self.inflight > 0
            && let Some(w) = self.win.take()
        {
            // Ended (its endpoint failed) with copies still reading the window: never freed.
            w.leak();
        }
    }
}
