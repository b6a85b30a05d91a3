//! The worker's bounded pinned windows: host memory page-locked once through the copy lane's
//! domain for staged puts and gets (and GPU stream receives landing), registered with each
//! remote lane's domain that used it, and kept for the next request. At most [`MAX_WINDOWS`]
//! exist; requests beyond wait in line for one, in the order they came.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rucx_ucs::{Error, Result};
use rucx_uct::{MemHandle, MemRegion};

use super::STAGED_FRAGS;

/// Most pinned windows a worker has at once (4 x 4 x `RUCX_RNDV_FRAG_SIZE`: 64 MiB pinned at
/// the default fragment size); staged requests beyond wait for one to come back.
pub(crate) const MAX_WINDOWS: usize = 4;

/// Host memory of a staged window.
struct StagingBuf(Vec<u8>);

/// Pinned host memory for staged puts and gets (and GPU stream receives landing): page-locked
/// once through the copy lane's domain and registered with each remote lane's domain that used
/// it, then kept by the worker ([`Windows`]) for the next request, so a request pays for neither.
pub(crate) struct RmaWindow {
    /// First: counts the window among the worker's live ones until it is freed (or kept
    /// forever, see [`RmaWindow::leak`]).
    _ticket: WindowTicket,
    /// The window registered with the copy lane's domain.
    pub(crate) copy_memh: MemHandle,
    /// Its registrations with remote lanes' domains, by domain index.
    lane_memh: Vec<(usize, MemHandle)>,
    /// Bytes.
    pub(crate) len: usize,
    /// Last: the memory the handles describe (dropped after them).
    buf: StagingBuf,
}

impl RmaWindow {
    /// The start address.
    pub(crate) fn base(&self) -> usize {
        self.buf.0.as_ptr() as usize
    }

    /// The window's registration with domain `md`: made by `reg` the first time (for the
    /// whole window), then kept with it.
    pub(crate) fn lane_memh(
        &mut self,
        md: usize,
        reg: impl FnOnce(MemRegion) -> Result<MemHandle>,
    ) -> Result<MemHandle> {
        if let Some((_, h)) = self.lane_memh.iter().find(|(m, _)| *m == md) {
            return Ok(h.clone());
        }
        // Kept with the window: the handle is dropped before the window's memory.
        let h = reg(MemRegion::host(self.base(), self.len))?;
        self.lane_memh.push((md, h.clone()));
        Ok(h)
    }

    /// Never free the window's memory or registrations (a transport may still touch it: its
    /// request ended with operations in flight), but stop counting it, so the worker may make
    /// another.
    pub(crate) fn leak(self) {
        let RmaWindow {
            _ticket,
            copy_memh,
            lane_memh,
            buf,
            ..
        } = self;
        std::mem::forget((copy_memh, lane_memh, buf));
    }
}

/// One live window of the worker's count.
struct WindowTicket(Arc<AtomicUsize>);

impl Drop for WindowTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The worker's pinned windows: those not in use, how many exist, and the requests waiting
/// for one.
#[derive(Default)]
pub(crate) struct Windows {
    pool: Vec<RmaWindow>,
    live: Arc<AtomicUsize>,
    /// (peer, request) waiting for a window, in order.
    waiters: VecDeque<(usize, u64)>,
}

impl Windows {
    /// Whether requests wait for a window.
    #[inline]
    pub(crate) fn has_waiters(&self) -> bool {
        !self.waiters.is_empty()
    }

    /// Windows that exist (in use or kept).
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Windows kept, not in use.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.pool.len()
    }

    /// Windows a request could have now: kept ones, and those that may still be made.
    pub(crate) fn free(&self) -> usize {
        self.pool.len() + MAX_WINDOWS.saturating_sub(self.live())
    }

    /// A kept window, or a new one of `STAGED_FRAGS` fragments of `frag` bytes (registered with
    /// the copy lane's domain by `reg`) while fewer than [`MAX_WINDOWS`] exist: the window and
    /// whether it was made now. `Ok(None)`: the request waits for one ([`Self::wait`]). `what`
    /// names the transfer in an allocation error.
    pub(crate) fn take(
        &mut self,
        frag: usize,
        what: &str,
        reg: impl FnOnce(MemRegion) -> Result<MemHandle>,
    ) -> Result<Option<(RmaWindow, bool)>> {
        if let Some(w) = self.pool.pop() {
            return Ok(Some((w, false)));
        }
        if self.live() >= MAX_WINDOWS {
            return Ok(None);
        }
        let len = frag.max(1).saturating_mul(STAGED_FRAGS);
        let mut mem = Vec::new();
        mem.try_reserve_exact(len).map_err(|e| {
            Error::NoMemory(format!(
                "{len} bytes of staging for a {what} of GPU memory (RUCX_RNDV_FRAG_SIZE x \
                 {STAGED_FRAGS}): {e}"
            ))
        })?;
        mem.resize(len, 0);
        let buf = StagingBuf(mem);
        // Kept with the window, whose memory is freed after its handles (field order).
        let copy_memh = reg(MemRegion::host(buf.0.as_ptr() as usize, len))?;
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(Some((
            RmaWindow {
                _ticket: WindowTicket(self.live.clone()),
                copy_memh,
                lane_memh: Vec::new(),
                len,
                buf,
            },
            true,
        )))
    }

    /// Keep a window for the next staged request (the waiting ones are woken by the next
    /// progress call).
    pub(crate) fn keep(&mut self, w: RmaWindow) {
        if self.pool.len() < MAX_WINDOWS {
            self.pool.push(w);
        }
    }

    /// Request `id` of peer `p` waits for a window, behind those waiting already; false when
    /// it was in line already.
    pub(crate) fn wait(&mut self, p: usize, id: u64) -> bool {
        if self.waiters.iter().any(|&(_, i)| i == id) {
            return false;
        }
        self.waiters.push_back((p, id));
        true
    }

    /// The first request in line, out of it.
    pub(crate) fn next_waiter(&mut self) -> Option<(usize, u64)> {
        self.waiters.pop_front()
    }
}
