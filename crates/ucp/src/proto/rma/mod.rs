//! Remote memory access requests (put, get, flush on an endpoint), as a state machine over the
//! narrow I/O [`RmaIo`].
//!
//! A put or get takes the first step of the endpoint's plan for its pair of memory types
//! ([`plan::RmaPlan`](crate::plan::RmaPlan)) that works now ([`RmaState::start`]): zero-copy on
//! a lane that reaches both buffers (`zcopy.rs`: host RMA; cuda_ipc, whose copy engine reads or
//! writes the peer's mapped GPU buffer from local GPU or host memory), else staged through a
//! pinned host window (`staged.rs`: the copy lane moves between the local GPU buffer and a
//! fragment of the window, the lane moves the fragment to or from the remote region; the
//! fragments are pipelined, so the copy of one overlaps the transfer of another, and the
//! windows, `window.rs`, are kept by the worker for the next staged request), or, when the
//! peer's region is mapped here, one copy through the mapping (`mapped.rs`). A registration
//! that fails on the way (and demotes its domain, one warning) sends the request on to the next
//! step; with none left it ends with the error. A flush (`flush.rs`) flushes every lane of the
//! peer and ends after the staged requests posted before it.
//!
//! The request's methods ([`RmaState::advance`], [`RmaState::on_done`]) post through
//! [`RmaIo`] and return what the worker does next ([`RmaNext`]); the worker's side
//! (`worker.rs`) implements [`RmaIo`] over its state and only finds the request, runs the
//! method and acts on the answer.

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::{Endpoint, MemHandle, MemRegion, OpStatus, RemoteKey};

use crate::context::RegGuard;
use crate::plan::{MemKey, Op, RmaPlan, RmaStep};
use crate::proto::Proto;
use crate::proto::gpu::stage_io::On;
use crate::proto::io::ProtoIo;

mod flush;
mod mapped;
mod staged;
mod window;
mod worker;
mod zcopy;

#[cfg(test)]
pub(crate) mod fake;
#[cfg(test)]
mod tests;

pub(crate) use flush::FlushRma;
pub(crate) use mapped::MappedRma;
pub(crate) use staged::StagedRma;
pub(crate) use window::{RmaWindow, Windows};
pub(crate) use zcopy::ZcopyRma;

/// Staging fragments a staged put or get keeps in flight (and fragment slots of a window).
pub(crate) const STAGED_FRAGS: usize = 4;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum RmaDir {
    Put,
    Get,
    Flush,
}

/// A put, get or flush request: its peer, what it does, its bytes, and how they move.
pub(crate) struct RmaState {
    pub(crate) peer: usize,
    pub(crate) dir: RmaDir,
    pub(crate) len: usize,
    pub(crate) path: RmaPath,
}

/// How a request's bytes move.
pub(crate) enum RmaPath {
    /// Nothing to move (no bytes): ends when started.
    Empty,
    /// Straight between the registered local buffer and the remote region on a lane.
    Zcopy(ZcopyRma),
    /// Through a pinned host window, pipelined.
    Staged(Box<StagedRma>),
    /// One copy through the peer's region mapped into this process.
    Mapped(Box<MappedRma>),
    /// A flush of the peer's lanes.
    Flush(FlushRma),
    /// An atomic carried out by the target's worker, waiting for its answer
    /// (`worker/atomic.rs`).
    Atomic(crate::worker::atomic::AtomicRma),
}

/// What became of one operation posted through [`RmaIo::post_on`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RmaPosted {
    /// The transport pushed back: nothing happened (post again after progress).
    Later,
    /// Finished at once.
    Done,
    /// In flight until its completion (counted in the request), under this token.
    InFlight(u64),
}

/// What the worker does after a step of a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RmaNext {
    /// Nothing now: completions step the request on.
    Wait,
    /// A transport pushed back: post again after progress (first in the peer's line).
    Later,
    /// No pinned window is free: the request waits in the worker's line for one.
    NeedWindow,
    /// Operations are to be posted: queue the request on its peer.
    Post,
    /// Every byte moved (a flush: everything before it ended): complete the request.
    Complete,
    /// A flush whose lanes are flushed waits for staged requests posted before it to end
    /// (looked at again by each progress call).
    FlushWait,
}

/// What a put, get or flush asks of the worker beyond [`ProtoIo`].
pub(crate) trait RmaIo: ProtoIo {
    /// Post one operation for request `req` on `on` (a lane to the peer, or the copy lane);
    /// one in flight is counted in the request until its completion.
    fn post_on(
        &mut self,
        req: u64,
        on: On,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<RmaPosted>;

    /// Whether the operation posted under `token` is still in flight.
    fn in_flight(&self, token: u64) -> bool;

    /// Most bytes one put (`put`) or get on `lane` moves (an accelerator lane moves a whole
    /// range at once; host lanes a fragment).
    fn lane_max(&self, lane: usize, put: bool) -> usize;

    /// Domain `md`'s name (the peer's keys are named by their domains).
    fn md_name(&self, md: usize) -> String;

    /// Register local buffer `region` with the domain of `lane` for one request (cached where
    /// the domain registers that memory; else described for this request alone).
    fn register_local(&mut self, lane: usize, region: MemRegion) -> Result<RegGuard>;

    /// Register GPU buffer `region` with the copy lane's domain for a staged request (the copy
    /// lane must be open and may still copy host memory): the registration and its key.
    fn staging_copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)>;

    /// The remote region at `remote` (key `key` of the domain of `lane`) mapped into this
    /// process and registered with the copy lane, where the domain allows (the peer's shared
    /// memory on this host). `None`: go through a window.
    fn map_remote(
        &mut self,
        lane: usize,
        key: &RemoteKey,
        remote: u64,
    ) -> Option<(usize, MemHandle)>;

    /// Bytes of one staging fragment.
    fn frag(&self) -> usize;

    /// Whether requests wait in line for a window (a new one waits behind them).
    fn windows_waited(&self) -> bool;

    /// A kept window, or a new one while fewer than [`MAX_WINDOWS`](window::MAX_WINDOWS) exist, for a put (`put`)
    /// or get. `Ok(None)`: none is free now.
    fn take_window(&mut self, put: bool) -> Result<Option<RmaWindow>>;

    /// The window's registration with the domain of `lane` (made the first time).
    fn window_memh(&mut self, w: &mut RmaWindow, lane: usize) -> Result<MemHandle>;

    /// Give a window back for the next staged request.
    fn keep_window(&mut self, w: RmaWindow);

    /// Whether request `req` ended (or is gone).
    fn ended(&self, req: u64) -> bool;
}

/// A put or get to start: what the caller asked for, with the peer's keys.
pub(crate) struct RmaReq<'a> {
    pub(crate) peer: usize,
    pub(crate) put: bool,
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) local: MemKey,
    pub(crate) remote: u64,
    /// The remote region's memory type.
    pub(crate) rmem: MemoryType,
    /// The peer's keys for the region, by domain name.
    pub(crate) keys: &'a [(String, RemoteKey)],
    /// The peer, for error messages.
    pub(crate) peer_name: String,
}

/// How a put or get started.
pub(crate) enum RmaStart {
    /// Nothing to move: the request ends at once (nothing counted).
    Empty(RmaState),
    /// Its bytes move by `proto`; `guard` is the registration it holds until it ends.
    Go {
        state: RmaState,
        guard: RegGuard,
        proto: Proto,
    },
}

impl RmaState {
    /// A flush of `lanes` of peer `peer` that also waits for requests `after` to end.
    pub(crate) fn flush(peer: usize, lanes: Vec<usize>, after: Vec<u64>) -> RmaState {
        RmaState {
            peer,
            dir: RmaDir::Flush,
            len: 0,
            path: RmaPath::Flush(FlushRma::new(lanes, after)),
        }
    }

    /// Start a put or get by the first step of `plan` that works now (its registrations and
    /// keys): an error names every step tried and why it did not work.
    pub(crate) fn start(
        io: &mut impl RmaIo,
        r: &RmaReq<'_>,
        plan: Option<&RmaPlan>,
    ) -> Result<RmaStart> {
        let op = if r.put { Op::Put } else { Op::Get };
        let what = || {
            format!(
                "a {} between local {} memory and {}'s {} memory",
                op.name(),
                r.local,
                r.peer_name,
                r.rmem
            )
        };
        let Some(plan) = plan else {
            return Err(Error::Unsupported {
                what: what(),
                why: format!("no plan for local {} memory", r.local),
            });
        };
        let dir = if r.put { RmaDir::Put } else { RmaDir::Get };
        let mut tried: Vec<String> = Vec::new();
        for step in plan.steps.iter().copied() {
            let lane = step.lane();
            let mdname = io.md_name(io.lane_md(lane));
            let Some(key) = r
                .keys
                .iter()
                .find(|(n, _)| *n == mdname)
                .map(|(_, k)| k.clone())
            else {
                let names: Vec<&str> = r.keys.iter().map(|(n, _)| n.as_str()).collect();
                tried.push(format!(
                    "the remote key bundle has no {mdname} key (the peer's {mdname} did not \
                     register the region; bundle: {names:?})"
                ));
                continue;
            };
            key.check(r.remote, r.len as u64)?;
            let proto = step.proto(op);
            if r.len == 0 {
                return Ok(RmaStart::Empty(RmaState {
                    peer: r.peer,
                    dir,
                    len: 0,
                    path: RmaPath::Empty,
                }));
            }
            let started = match step {
                RmaStep::Zcopy { .. } => zcopy::start(io, r, lane, key),
                RmaStep::Staged { .. } => staged::start(io, r, lane, key),
            };
            match started {
                Ok((path, guard)) => {
                    let state = RmaState {
                        peer: r.peer,
                        dir,
                        len: r.len,
                        path,
                    };
                    return Ok(RmaStart::Go {
                        state,
                        guard,
                        proto,
                    });
                }
                Err(e) => {
                    // A registration that failed demoted its domain (one warning) or refused
                    // this buffer: the next step of the plan carries the request.
                    tracing::debug!("{} on {mdname} not possible ({e}); next path", proto.name());
                    tried.push(format!("{} on {mdname}: {e}", proto.name()));
                }
            }
        }
        let mut why = plan.notes.clone();
        why.extend(tried);
        if why.is_empty() {
            why.push("no path covers this pair".into());
        }
        why.push("see Worker::path_query, RUCX_PROTO_INFO=y and RUCX_TLS".into());
        Err(Error::Unsupported {
            what: what(),
            why: why.join("; "),
        })
    }

    /// Post what request `id` can post now. An error ends the request.
    pub(crate) fn advance(&mut self, io: &mut impl RmaIo, id: u64) -> Result<RmaNext> {
        let (p, put, len) = (self.peer, self.dir == RmaDir::Put, self.len);
        match &mut self.path {
            RmaPath::Empty => Ok(RmaNext::Wait),
            RmaPath::Zcopy(z) => z.advance(io, id, p, put, len),
            RmaPath::Staged(s) => s.advance(io, id, p, put, len),
            RmaPath::Mapped(m) => m.advance(io, id, put, len),
            RmaPath::Flush(f) => f.advance(io, id, p),
            // Its request went out when posted; the answer ends it.
            RmaPath::Atomic(_) => Ok(RmaNext::Wait),
        }
    }

    /// An operation of request `id` completed with `res` (the request has not ended): what
    /// comes next. An error ends the request.
    pub(crate) fn on_done(
        &mut self,
        io: &mut impl RmaIo,
        id: u64,
        res: Result<()>,
    ) -> Result<RmaNext> {
        res?;
        let idle = io.outstanding(id) == 0;
        Ok(match &mut self.path {
            RmaPath::Staged(s) => {
                s.on_done(io, id);
                RmaNext::Post
            }
            RmaPath::Zcopy(z) if idle && z.all_posted() => RmaNext::Complete,
            RmaPath::Mapped(m) if idle && m.posted() => RmaNext::Complete,
            RmaPath::Flush(f) if idle && f.posted() => f.may_end(io),
            _ => RmaNext::Wait,
        })
    }

    /// A flush waiting for staged requests: whether it may end now (its lanes flushed, nothing
    /// of it in flight, and every request it waits for ended). `None`: not such a flush.
    pub(crate) fn flush_ready(&mut self, io: &mut impl RmaIo, id: u64) -> Option<RmaNext> {
        match &mut self.path {
            RmaPath::Flush(f) if f.posted() && io.outstanding(id) == 0 => Some(f.may_end(io)),
            _ => None,
        }
    }

    /// A staged or mapped put or get, or an atomic (a flush posted after it waits for it to
    /// end: the lanes' flushes do not cover it).
    pub(crate) fn pipelined(&self) -> bool {
        matches!(
            self.path,
            RmaPath::Staged(_) | RmaPath::Mapped(_) | RmaPath::Atomic(_)
        )
    }

    /// The request's operations in flight are now `n` (a staged request that ends with some
    /// keeps its window forever).
    pub(crate) fn note_outstanding(&mut self, n: usize) {
        if let RmaPath::Staged(s) = &mut self.path {
            s.inflight = n;
        }
    }

    /// The window of a staged request (to give back once the request ended and nothing of it
    /// is in flight).
    pub(crate) fn take_window(&mut self) -> Option<RmaWindow> {
        match &mut self.path {
            RmaPath::Staged(s) => s.take_window(),
            _ => None,
        }
    }
}
