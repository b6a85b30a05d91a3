//! [`RmaIo`] for the fake I/O ([`FakeIo`]): operations are recorded, completed at once or held
//! in flight until a test completes them (in any order, successfully or not), pushed back at
//! random, and their bytes are tracked by where each one came from. A byte's value is its
//! origin (the address it was read from first), so a test checks that every byte of a target
//! range came from the right source offset, how often it was written, and that no operation
//! touched memory another one in flight was using. Windows come from a real [`Windows`] pool.

use std::collections::HashMap;
use std::sync::Arc;

use rucx_ucs::{Error, Result};
use rucx_uct::{Endpoint, MemHandle, MemRegion, OpStatus, RemoteKey};

use super::{RmaIo, RmaPosted, RmaWindow, Windows};
use crate::context::RegGuard;
use crate::proto::fake_io::{COPY_MD, FakeIo, Op, count_down};
use crate::proto::gpu::stage_io::{On, StageIo};
use crate::proto::io::ProtoIo;

/// Local buffers of the fake's requests (addresses with no memory behind them, far from any
/// real allocation, such as the windows).
pub(crate) const LOCAL: usize = 0x9000_0000_0000_0000;
/// The peer's region as mapped into this process (a mapped request's copies land there).
pub(crate) const MAPPED: usize = 0xa000_0000_0000_0000;
/// The peer's region, in its address space.
pub(crate) const REMOTE: u64 = 0x5000_0000;

/// Where a byte lies: in this process, or in the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum At {
    Here(usize),
    Peer(u64),
}

impl At {
    fn plus(self, n: usize) -> At {
        match self {
            At::Here(a) => At::Here(a + n),
            At::Peer(a) => At::Peer(a + n as u64),
        }
    }

    /// Whether `[self, self + n)` and `[o, o + m)` share a byte.
    fn overlaps(self, n: usize, o: At, m: usize) -> bool {
        let (a, b) = match (self, o) {
            (At::Here(a), At::Here(b)) => (a as u64, b as u64),
            (At::Peer(a), At::Peer(b)) => (a, b),
            _ => return false,
        };
        a < b + m as u64 && b < a + n as u64
    }

    /// A byte of a request's buffer or of the peer's region (not of a window).
    fn is_target(self) -> bool {
        match self {
            At::Here(a) => (LOCAL..MAPPED).contains(&a),
            At::Peer(_) => true,
        }
    }
}

/// Where an address an operation names lies (a mapped address is the peer's byte).
fn resolve(a: usize) -> At {
    if a >= MAPPED {
        At::Peer(REMOTE + (a - MAPPED) as u64)
    } else {
        At::Here(a)
    }
}

/// One data movement: `len` bytes from `src` to `dst`, with the origins read when posted.
#[derive(Clone, Debug)]
struct Move {
    src: At,
    dst: At,
    len: usize,
    data: Vec<At>,
}

/// An operation in flight.
#[derive(Debug)]
struct Flight {
    req: u64,
    token: u64,
    mv: Option<Move>,
}

/// The remote memory access side of the fake.
#[derive(Default)]
pub(crate) struct RmaSide {
    /// The worker's windows.
    pub(crate) windows: Windows,
    /// Bytes of a staging fragment.
    pub(crate) frag: usize,
    /// Most bytes one zero-copy operation moves (0: a fragment).
    pub(crate) lane_max: usize,
    /// The peer's region is mapped here.
    pub(crate) maps: bool,
    /// Operations stay in flight until the test completes them (else they finish at once).
    pub(crate) in_progress: bool,
    /// Random push-backs and completions at once, from this seed.
    pub(crate) rng: Option<u64>,
    /// Requests that ended.
    pub(crate) ended: Vec<u64>,
    /// Operations posted: (request, where, bytes; none for a flush), in order.
    pub(crate) posted: Vec<(u64, On, usize)>,
    /// Operations that touched bytes another operation in flight used.
    pub(crate) hazards: Vec<String>,
    /// Each byte's origin (bytes never written are their own).
    mem: HashMap<At, At>,
    /// How often each byte of a buffer or of the peer's region was written.
    pub(crate) writes: HashMap<At, u32>,
    flights: Vec<Flight>,
}

impl RmaSide {
    /// A number from the seed (xorshift).
    pub(crate) fn roll(&mut self) -> Option<u64> {
        let x = self.rng.as_mut()?;
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        Some(*x)
    }

    /// The origin of the byte at `a`.
    pub(crate) fn origin(&self, a: At) -> At {
        self.mem.get(&a).copied().unwrap_or(a)
    }

    /// Tokens in flight, in the order they were posted.
    pub(crate) fn tokens(&self) -> Vec<u64> {
        self.flights.iter().map(|f| f.token).collect()
    }

    fn apply(&mut self, mv: &Move) {
        for (i, o) in mv.data.iter().enumerate() {
            let d = mv.dst.plus(i);
            self.mem.insert(d, *o);
            if d.is_target() {
                *self.writes.entry(d).or_default() += 1;
            }
        }
    }

    /// Record a hazard when `mv` touches what an operation in flight uses.
    fn check(&mut self, mv: &Move) {
        for f in &self.flights {
            let Some(o) = &f.mv else { continue };
            if mv.dst.overlaps(mv.len, o.src, o.len)
                || mv.src.overlaps(mv.len, o.dst, o.len)
                || mv.dst.overlaps(mv.len, o.dst, o.len)
            {
                self.hazards
                    .push(format!("{mv:?} overlaps {o:?} (request {})", f.req));
            }
        }
    }

    /// The movement of an operation `op` posted on `on`.
    fn movement(&self, on: On, op: &Op) -> Option<Move> {
        let Op::Rma {
            get, iov, remote, ..
        } = op
        else {
            return None;
        };
        let (addr, len) = iov[0];
        let (src, dst) = match (on, *get) {
            // The copy lane: the GPU buffer is its "remote" side, in this process.
            (On::Copy, true) => (At::Here(*remote as usize), resolve(addr)),
            (On::Copy, false) => (resolve(addr), At::Here(*remote as usize)),
            (On::Lane { .. }, true) => (At::Peer(*remote), resolve(addr)),
            (On::Lane { .. }, false) => (resolve(addr), At::Peer(*remote)),
        };
        let data = (0..len).map(|i| self.origin(src.plus(i))).collect();
        Some(Move {
            src,
            dst,
            len,
            data,
        })
    }
}

impl FakeIo {
    /// A fake for remote memory access with fragments of `frag` bytes.
    pub(crate) fn rma(frag: usize) -> FakeIo {
        let mut io = FakeIo::default();
        io.rma.frag = frag;
        io
    }

    /// Complete in-flight operation `token` (`ok`: its bytes land): its request.
    pub(crate) fn complete(&mut self, token: u64, ok: bool) -> u64 {
        let i = self
            .rma
            .flights
            .iter()
            .position(|f| f.token == token)
            .expect("an operation in flight");
        let f = self.rma.flights.remove(i);
        self.in_flight.retain(|&(_, t)| t != token);
        if ok && let Some(mv) = &f.mv {
            self.rma.apply(mv);
        }
        f.req
    }
}

fn window_reg(fails: &mut Option<usize>, md: usize, r: MemRegion) -> Result<MemHandle> {
    if count_down(fails) {
        return Err(Error::NoMemory(format!(
            "injected: registering a window with fake{md}"
        )));
    }
    Ok(FakeIo::handle(md, r))
}

impl RmaIo for FakeIo {
    fn post_on(
        &mut self,
        req: u64,
        on: On,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<RmaPosted> {
        if !self.gate()? || self.rma.roll().is_some_and(|x| x % 4 == 0) {
            return Ok(RmaPosted::Later);
        }
        let at_once = match self.rma.roll() {
            Some(x) => x % 3 == 0,
            None => !self.rma.in_progress,
        };
        self.ep.done_at_once = at_once;
        let before = self.ep.ops.len();
        self.next_token += 1;
        let token = self.next_token;
        op(&mut self.ep, token)?;
        let mv = self
            .ep
            .ops
            .get(before)
            .and_then(|o| self.rma.movement(on, o));
        self.rma
            .posted
            .push((req, on, mv.as_ref().map_or(0, |m| m.len)));
        if let Some(m) = &mv {
            self.rma.check(m);
        }
        if at_once {
            if let Some(m) = &mv {
                self.rma.apply(m);
            }
            return Ok(RmaPosted::Done);
        }
        self.in_flight.push((req, token));
        self.rma.flights.push(Flight { req, token, mv });
        Ok(RmaPosted::InFlight(token))
    }

    fn in_flight(&self, token: u64) -> bool {
        self.in_flight.iter().any(|&(_, t)| t == token)
    }

    fn lane_max(&self, _lane: usize, _put: bool) -> usize {
        match self.rma.lane_max {
            0 => self.rma.frag.max(1),
            n => n,
        }
    }

    fn md_name(&self, md: usize) -> String {
        format!("fake{md}")
    }

    fn register_local(&mut self, lane: usize, region: MemRegion) -> Result<RegGuard> {
        self.register_md(lane, region)
    }

    fn staging_copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        self.send_copy_key(region)
    }

    fn map_remote(
        &mut self,
        _lane: usize,
        _key: &RemoteKey,
        remote: u64,
    ) -> Option<(usize, MemHandle)> {
        let at = MAPPED + (remote - REMOTE) as usize;
        self.rma
            .maps
            .then(|| (at, FakeIo::handle(COPY_MD, MemRegion::host(at, 1))))
    }

    fn frag(&self) -> usize {
        self.rma.frag.max(1)
    }

    fn windows_waited(&self) -> bool {
        self.rma.windows.has_waiters()
    }

    fn take_window(&mut self, put: bool) -> Result<Option<RmaWindow>> {
        let fails = &mut self.fail_reg_after;
        let what = if put { "put" } else { "get" };
        let w = self
            .rma
            .windows
            .take(self.rma.frag, what, |r| window_reg(fails, COPY_MD, r))?;
        Ok(w.map(|(w, _)| w))
    }

    fn window_memh(&mut self, w: &mut RmaWindow, lane: usize) -> Result<MemHandle> {
        let fails = &mut self.fail_reg_after;
        w.lane_memh(lane, |r| window_reg(fails, lane, r))
    }

    fn keep_window(&mut self, w: RmaWindow) {
        self.rma.windows.keep(w);
    }

    fn ended(&self, req: u64) -> bool {
        self.rma.ended.contains(&req)
    }
}

/// A key of the peer's region for the fake's domain `md`.
pub(crate) fn peer_key(md: usize) -> (String, RemoteKey) {
    (
        format!("fake{md}"),
        RemoteKey::new(&format!("fake{md}"), REMOTE, 1 << 40, Arc::new(())),
    )
}
