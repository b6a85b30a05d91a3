//! The staged put/get pipeline: a GPU buffer moved to or from the remote region through a
//! pinned host window of [`STAGED_FRAGS`] fragment slots. Each slot moves one fragment
//! through its two operations (put: the copy lane out of the GPU, then the remote write; get:
//! the remote read, then the copy lane into the GPU) and then takes the next fragment, so the
//! copies of some fragments overlap the transfers of others. When the peer's region is mapped
//! here the request copies through the mapping instead (`mapped.rs`).

use rucx_ucs::Result;
use rucx_uct::{Iov, MemHandle, MemRegion, RemoteKey};

use super::{MappedRma, RmaIo, RmaNext, RmaPath, RmaPosted, RmaReq, RmaWindow, STAGED_FRAGS};
use crate::context::RegGuard;
use crate::proto::gpu::stage_io::On;

/// Where a fragment slot of a staged window stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Unused.
    Free,
    /// The fragment's first operation (put: out of the GPU; get: the remote read) is in flight.
    First { off: usize, n: usize, token: u64 },
    /// The first operation finished; the second is still to post.
    Ready { off: usize, n: usize },
    /// The second operation (put: the remote write; get: into the GPU) is in flight.
    Second { off: usize, n: usize, token: u64 },
}

/// The state of a put or get staged through a pinned window, pipelined (see the module).
pub(crate) struct StagedRma {
    /// The lane that reaches the remote region.
    lane: usize,
    /// The local GPU buffer's address.
    addr: usize,
    /// Remote start address, and its key.
    remote: u64,
    key: RemoteKey,
    /// The local GPU buffer's key on the copy lane.
    gpu_key: RemoteKey,
    /// The window's registration with the remote lane's domain (once it has a window).
    lane_memh: Option<MemHandle>,
    /// Fragment size.
    frag: usize,
    /// Fragment slots of the window.
    slots: Vec<SlotState>,
    /// Next transfer offset to stage.
    next: usize,
    /// Bytes that went through both operations.
    done: usize,
    /// Operations in flight (mirrors the request's count): memory still in use when dropped.
    pub(crate) inflight: usize,
    /// Last: the window (`None` while waiting for one; handed back to the worker once the
    /// request completes).
    win: Option<RmaWindow>,
}

impl Drop for StagedRma {
    fn drop(&mut self) {
        if self.inflight > 0
            && let Some(w) = self.win.take()
        {
            // A request that ended with operations still in flight (its endpoint failed):
            // a transport may still touch the window, so it is never freed.
            tracing::debug!(
                "staged put/get ended with {} operations in flight; its {} bytes of staging \
                 are kept",
                self.inflight,
                w.len
            );
            w.leak();
        }
    }
}

/// Start a staged put or get on `lane`: register the GPU buffer with the copy lane; copy
/// through the peer's region when it is mapped here, else take a window now if one is free
/// (or may be made; a failure to make or register it fails this step, so the plan's next step
/// is tried), else wait for one, behind the requests waiting already.
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
    let (gpu_guard, gpu_key) = io.staging_copy_key(region)?;
    if let Some((at, memh)) = io.map_remote(lane, &key, r.remote) {
        // The peer's region is mapped here (its shared memory on this host): the copy lane
        // moves the bytes straight between it and the GPU buffer, in one copy.
        io.count("staged put/get copied straight to or from the peer's mapped memory");
        let m = MappedRma {
            gpu_key,
            addr: r.addr,
            at,
            memh,
            posted: false,
        };
        return Ok((RmaPath::Mapped(Box::new(m)), gpu_guard));
    }
    let frag = io.frag().max(1);
    let mut win = if io.windows_waited() {
        None
    } else {
        io.take_window(r.put)?
    };
    let lane_memh = match win.as_mut() {
        Some(w) => match io.window_memh(w, lane) {
            Ok(h) => Some(h),
            Err(e) => {
                if let Some(w) = win.take() {
                    io.keep_window(w);
                }
                return Err(e);
            }
        },
        None => None,
    };
    let nslots = r.len.div_ceil(frag).clamp(1, STAGED_FRAGS);
    let staged = StagedRma {
        lane,
        addr: r.addr,
        remote: r.remote,
        key,
        gpu_key,
        lane_memh,
        frag,
        slots: vec![SlotState::Free; nslots],
        next: 0,
        done: 0,
        inflight: 0,
        win,
    };
    Ok((RmaPath::Staged(Box::new(staged)), gpu_guard))
}

impl StagedRma {
    /// Post what the request (`len` bytes, to peer `p`) can post now: the second operation of
    /// every fragment whose first one finished, then the first operation of new fragments
    /// into free slots. Without a window it takes one first (none free: it waits for one).
    /// Every byte through: the window goes back and the request completes.
    pub(super) fn advance(
        &mut self,
        io: &mut impl RmaIo,
        id: u64,
        p: usize,
        put: bool,
        len: usize,
    ) -> Result<RmaNext> {
        loop {
            let Some(win) = &self.win else {
                let Some(mut w) = io.take_window(put)? else {
                    return Ok(RmaNext::NeedWindow);
                };
                match io.window_memh(&mut w, self.lane) {
                    Ok(h) => self.lane_memh = Some(h),
                    Err(e) => {
                        io.keep_window(w);
                        return Err(e);
                    }
                }
                self.win = Some(w);
                continue;
            };
            if self.done >= len {
                if io.outstanding(id) > 0 {
                    return Ok(RmaNext::Wait);
                }
                if let Some(w) = self.win.take() {
                    io.keep_window(w);
                }
                return Ok(RmaNext::Complete);
            }
            // One operation per pass: the first slot with something to post.
            let Some((k, second, off, n)) = self
                .slots
                .iter()
                .enumerate()
                .find_map(|(k, s)| match *s {
                    SlotState::Ready { off, n } => Some((k, true, off, n)),
                    _ => None,
                })
                .or_else(|| {
                    let k = self.slots.iter().position(|s| *s == SlotState::Free)?;
                    (self.next < len).then(|| (k, false, self.next, self.frag.min(len - self.next)))
                })
            else {
                // Everything possible is in flight: completions step the request on.
                return Ok(RmaNext::Wait);
            };
            let at = win.base() + k * self.frag;
            // Put: out of the GPU, then to the peer. Get: from the peer, then into the GPU.
            let on_copy_lane = put != second;
            let posted = if on_copy_lane {
                let iov = [Iov {
                    addr: at,
                    len: n,
                    memh: &win.copy_memh,
                }];
                let (gpu_at, key) = ((self.addr + off) as u64, &self.gpu_key);
                io.post_on(id, On::Copy, |ep, t| {
                    if put {
                        ep.get_zcopy(&iov, gpu_at, key, t)
                    } else {
                        ep.put_zcopy(&iov, gpu_at, key, t)
                    }
                })?
            } else {
                let memh = self
                    .lane_memh
                    .as_ref()
                    .expect("a staged request's window is registered with its lane");
                let iov = [Iov {
                    addr: at,
                    len: n,
                    memh,
                }];
                let (r_at, key) = (self.remote + off as u64, &self.key);
                io.post_on(id, On::Lane { p, lane: self.lane }, |ep, t| {
                    if put {
                        ep.put_zcopy(&iov, r_at, key, t)
                    } else {
                        ep.get_zcopy(&iov, r_at, key, t)
                    }
                })?
            };
            self.inflight = io.outstanding(id);
            if !second && posted != RmaPosted::Later {
                self.next = off + n;
            }
            self.slots[k] = match (second, posted) {
                (_, RmaPosted::Later) => return Ok(RmaNext::Later),
                (false, RmaPosted::InFlight(token)) => SlotState::First { off, n, token },
                (false, RmaPosted::Done) => SlotState::Ready { off, n },
                (true, RmaPosted::InFlight(token)) => SlotState::Second { off, n, token },
                (true, RmaPosted::Done) => {
                    self.done += n;
                    SlotState::Free
                }
            };
        }
    }

    /// An operation of request `id` completed (successfully): the slots whose operation is no
    /// longer in flight step on (the request is then posted again).
    pub(super) fn on_done(&mut self, io: &mut impl RmaIo, id: u64) {
        self.inflight = io.outstanding(id);
        for s in self.slots.iter_mut() {
            match *s {
                SlotState::First { off, n, token } if !io.in_flight(token) => {
                    *s = SlotState::Ready { off, n };
                }
                SlotState::Second { n, token, .. } if !io.in_flight(token) => {
                    self.done += n;
                    *s = SlotState::Free;
                }
                _ => {}
            }
        }
    }

    /// The window, out of the request.
    pub(super) fn take_window(&mut self) -> Option<RmaWindow> {
        self.win.take()
    }
}
