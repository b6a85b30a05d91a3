//! What the copy-lane protocols ask of the worker ([`CopyIo`]: post an operation on the copy
//! lane, register a buffer for the copy lane, write host memory; [`BounceIo`] besides: take and
//! give back a send staging fragment, wait for one copy), and their implementations over the
//! worker's state (and, for [`BounceIo`], its interfaces). Nothing here decides anything.

use std::cell::RefCell;

use crate::worker::prelude::*;

/// What became of an operation posted on the copy lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyPost {
    /// The lane pushed back: nothing happened (post again after progress).
    PushedBack,
    /// Done on return.
    Done,
    /// In progress, with this token.
    InProgress(u64),
}

/// The copy lane, as the copy protocols see it.
pub(crate) trait CopyIo {
    /// Post one operation on the copy lane. With `req`, one in progress is counted in that
    /// request until its completion (which the worker hands to the request); without, its
    /// completion is waited for with [`BounceIo::copy_poll`].
    fn copy_post(
        &mut self,
        req: Option<u64>,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<CopyPost>;

    /// Most bytes one `put_short` of the copy lane takes.
    fn copy_short_max(&self) -> Result<usize>;

    /// Register `region` (a user buffer) with the copy lane's domain for one request, through
    /// the context's one register path (demoting and warning on a failure); the key the copy
    /// lane reaches it with.
    fn copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)>;

    /// Write `data` to host memory at `addr` by the CPU (a receive buffer lent to a live
    /// request, or a free slot of a pinned window).
    fn write_host(&mut self, addr: usize, data: &[u8]);

    /// Count one run of `what`.
    fn count(&mut self, what: &'static str);
}

/// The bounce protocols' I/O besides [`CopyIo`]: the worker's send staging fragments, and
/// waiting for one copy.
pub(crate) trait BounceIo: CopyIo {
    /// The send staging (made on first use): its fragment size and the copy lane's handle on it.
    fn bounce_staging(&mut self) -> Result<(usize, MemHandle)>;

    /// Take a free send staging fragment: its index and address (`None`: all are in use).
    fn take_bounce(&mut self) -> Option<(usize, usize)>;

    /// Give send staging fragment `f` back.
    fn release_bounce(&mut self, f: usize);

    /// Progress the copy lane once: the result of copy `mine` once it came (other copies'
    /// completions are kept for the worker).
    fn copy_poll(&mut self, mine: Option<u64>) -> Option<Result<()>>;

    /// Append `n` bytes of host memory at `addr` (a staging fragment a copy filled) to `out`.
    fn read_host(&self, addr: usize, n: usize, out: &mut Vec<u8>);
}

impl CopyIo for State {
    fn copy_post(
        &mut self,
        req: Option<u64>,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<CopyPost> {
        let token = self.next_token;
        let (_, ep) = self.copy.as_mut().ok_or_else(|| Error::Unsupported {
            what: "copying between host and GPU memory".into(),
            why: "no copy transport (cuda_copy) is open; add cuda_copy to RUCX_TLS".into(),
        })?;
        match op(ep.as_mut(), token) {
            Ok(st) => {
                self.next_token += 1;
                if let Some(id) = req {
                    self.account(id, token, st, true);
                }
                Ok(match st {
                    OpStatus::Done => CopyPost::Done,
                    OpStatus::InProgress => CopyPost::InProgress(token),
                })
            }
            Err(e) if e.is_retryable() => Ok(CopyPost::PushedBack),
            Err(e) => Err(e),
        }
    }

    fn copy_short_max(&self) -> Result<usize> {
        let (ci, _) = self.copy.as_ref().ok_or_else(|| Error::Unsupported {
            what: "copying into GPU memory".into(),
            why: "no copy transport (cuda_copy) is open; add cuda_copy to RUCX_TLS".into(),
        })?;
        Ok(self.slots[*ci].attr.limits.put_max_short)
    }

    fn copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        State::copy_key(
            self,
            region.addr,
            region.len,
            region.mem_type,
            region.device,
        )
    }

    fn write_host(&mut self, addr: usize, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        // SAFETY: the copy protocols write only into a receive buffer lent mutably to a live
        // request's scope (within its capacity) or into a free slot of a pinned window the
        // request owns; nothing else reads or writes those bytes meanwhile.
        unsafe { host_slice_mut(addr, data.len()) }.copy_from_slice(data);
    }

    fn count(&mut self, what: &'static str) {
        State::count(self, what);
    }
}

/// The worker's state with its interfaces: what a copy waited for needs.
pub(crate) struct CopyLane<'a> {
    pub(crate) ifaces: &'a RefCell<Vec<Box<dyn Iface>>>,
    pub(crate) st: &'a mut State,
}

impl Worker {
    /// The copy lane of state `st` with this worker's interfaces.
    pub(crate) fn copy_lane<'a>(&'a self, st: &'a mut State) -> CopyLane<'a> {
        CopyLane {
            ifaces: &self.ifaces,
            st,
        }
    }
}

impl CopyIo for CopyLane<'_> {
    fn copy_post(
        &mut self,
        req: Option<u64>,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<CopyPost> {
        self.st.copy_post(req, op)
    }

    fn copy_short_max(&self) -> Result<usize> {
        self.st.copy_short_max()
    }

    fn copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        CopyIo::copy_key(self.st, region)
    }

    fn write_host(&mut self, addr: usize, data: &[u8]) {
        self.st.write_host(addr, data);
    }

    fn count(&mut self, what: &'static str) {
        State::count(self.st, what);
    }
}

impl BounceIo for CopyLane<'_> {
    fn bounce_staging(&mut self) -> Result<(usize, MemHandle)> {
        self.st.ensure_staging()?;
        let stg = self
            .st
            .staging
            .as_ref()
            .ok_or_else(|| Error::Internal("send staging missing after it was made".into()))?;
        Ok((stg.frag, stg.copy_memh.clone()))
    }

    fn take_bounce(&mut self) -> Option<(usize, usize)> {
        let stg = self.st.staging.as_mut()?;
        let f = stg.free_send.pop()?;
        Some((f, stg.addr(f)))
    }

    fn release_bounce(&mut self, f: usize) {
        if let Some(stg) = self.st.staging.as_mut() {
            stg.free_send.push(f);
        }
    }

    fn copy_poll(&mut self, mine: Option<u64>) -> Option<Result<()>> {
        let ci = self.st.copy.as_ref()?.0;
        let mut got = None;
        let mut others = Vec::new();
        // Progress the copy interface alone: the other completions are kept for later.
        self.ifaces.borrow_mut()[ci].progress(&mut |ev| {
            if let Event::Completion { token, result } = ev {
                if Some(token) == mine {
                    got = Some(result);
                } else {
                    others.push((token, result));
                }
            }
        });
        for (t, r) in others {
            if let Some(tok) = self.st.tokens.remove(&t) {
                self.st.done_q.push_back((tok, r));
            }
        }
        got
    }

    fn read_host(&self, addr: usize, n: usize, out: &mut Vec<u8>) {
        if n == 0 {
            return;
        }
        // SAFETY: `addr..addr + n` is a send staging fragment the worker owns, written by the
        // copy just waited for and not handed out again until its taker gives it back.
        out.extend_from_slice(unsafe { host_slice(addr, n) });
    }
}
