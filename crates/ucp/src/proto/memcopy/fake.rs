//! A fake copy lane for the copy protocols' unit tests: one flat memory (host and GPU addresses
//! alike) whose bytes an operation moves when it completes (a `put_short` at once, a zero-copy
//! when its completion is handed over, or at once with `at_once`), send staging fragments, and
//! knobs: push back given posts, fail a post or a copy's completion, refuse registrations.

use std::collections::BTreeMap;
use std::sync::Arc;

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::{AmId, Endpoint, Iov, MemHandle, MemRegion, OpStatus, RemoteKey};

use super::copy_io::{BounceIo, CopyIo, CopyPost};
use crate::context::RegGuard;
use crate::plan::{MemKey, Op};
use crate::proto::Proto;
use crate::proto::gpu::bounce::BounceSendIo;
use crate::worker::state::SendState;

/// One operation the fake copy lane took: bytes from `from` to `to`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Move {
    /// `put_short`, `put_zcopy` or `get_zcopy`.
    pub(crate) kind: &'static str,
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) len: usize,
    /// A `put_short`'s bytes.
    pub(crate) data: Option<Vec<u8>>,
}

/// The endpoint an operation runs on: it records the one operation.
#[derive(Debug, Default)]
struct CopyEp {
    took: Option<Move>,
    at_once: bool,
}

impl CopyEp {
    fn zcopy(&mut self, kind: &'static str, from: usize, to: usize, iov: &[Iov<'_>]) -> OpStatus {
        assert_eq!(iov.len(), 1, "one buffer per copy");
        self.took = Some(Move {
            kind,
            from,
            to,
            len: iov[0].len,
            data: None,
        });
        if self.at_once {
            OpStatus::Done
        } else {
            OpStatus::InProgress
        }
    }
}

impl Endpoint for CopyEp {
    fn am_short(&mut self, _: AmId, _: u64, _: &[u8]) -> Result<()> {
        Err(Error::InvalidParam(
            "no active messages on a copy lane".into(),
        ))
    }

    fn am_bcopy(&mut self, _: AmId, _: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        Err(Error::InvalidParam(
            "no active messages on a copy lane".into(),
        ))
    }

    fn am_zcopy(&mut self, _: AmId, _: &[u8], _: &[Iov<'_>], _: u64) -> Result<OpStatus> {
        Err(Error::InvalidParam(
            "no active messages on a copy lane".into(),
        ))
    }

    fn put_short(&mut self, data: &[u8], remote: u64, _: &RemoteKey) -> Result<()> {
        self.took = Some(Move {
            kind: "put_short",
            from: 0,
            to: remote as usize,
            len: data.len(),
            data: Some(data.to_vec()),
        });
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote: u64,
        _: &RemoteKey,
        _: u64,
    ) -> Result<OpStatus> {
        Ok(self.zcopy("put_zcopy", iov[0].addr, remote as usize, iov))
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote: u64,
        _: &RemoteKey,
        _: u64,
    ) -> Result<OpStatus> {
        Ok(self.zcopy("get_zcopy", remote as usize, iov[0].addr, iov))
    }

    fn flush(&mut self, _: u64) -> Result<OpStatus> {
        Ok(OpStatus::Done)
    }
}

/// Where the fake's send staging fragments lie.
pub(crate) const FRAG_BASE: usize = 0x7000_0000;

/// The fake copy lane.
pub(crate) struct CopyFake {
    /// The memory, byte by byte (an unwritten byte reads 0).
    pub(crate) mem: BTreeMap<usize, u8>,
    /// Most bytes of one `put_short`.
    pub(crate) short_max: usize,
    /// Zero-copy operations complete on return.
    pub(crate) at_once: bool,
    /// Post attempts (numbered from 0) pushed back.
    pub(crate) push_back: Vec<usize>,
    /// The post attempt that fails, and with what.
    pub(crate) fail_post: Option<(usize, Error)>,
    /// Zero-copy posts (numbered from 0 among those that went through) whose copy fails.
    pub(crate) fail_copy: Vec<usize>,
    /// Registrations are refused (the copy domain demoted for that memory).
    pub(crate) refuse_reg: bool,
    /// Registrations made, in order.
    pub(crate) regs: Vec<MemRegion>,
    /// Held by each live registration.
    live: Arc<()>,
    /// Send staging: fragment size, free fragments, how many; making it fails.
    pub(crate) frag: usize,
    pub(crate) free: Vec<usize>,
    pub(crate) nfrags: usize,
    pub(crate) staging_fails: bool,
    /// Zero-copies in progress: (request, token, move, whether it fails).
    pub(crate) in_flight: Vec<(Option<u64>, u64, Move, bool)>,
    /// Every operation that went through, in order.
    pub(crate) moves: Vec<Move>,
    attempts: usize,
    zcopies: usize,
    /// Polls of the copy lane; polls a waited copy takes before it completes.
    pub(crate) polls: usize,
    pub(crate) poll_delay: usize,
    pub(crate) counted: Vec<&'static str>,
    next_token: u64,
    /// Bounce sends: the host protocol and the rendezvous row the plan gives, and the sends
    /// started, each with the bytes at its address when started.
    pub(crate) host_proto: Option<Proto>,
    pub(crate) rndv_row: Option<Proto>,
    pub(crate) sent: Vec<(SendState, Vec<u8>)>,
}

impl CopyFake {
    /// A lane of `short_max`-byte short copies, with `nfrags` staging fragments of `frag` bytes.
    pub(crate) fn new(short_max: usize, frag: usize, nfrags: usize) -> CopyFake {
        CopyFake {
            mem: BTreeMap::new(),
            short_max,
            at_once: false,
            push_back: Vec::new(),
            fail_post: None,
            fail_copy: Vec::new(),
            refuse_reg: false,
            regs: Vec::new(),
            live: Arc::new(()),
            frag,
            free: (0..nfrags).rev().collect(),
            nfrags,
            staging_fails: false,
            in_flight: Vec::new(),
            moves: Vec::new(),
            attempts: 0,
            zcopies: 0,
            polls: 0,
            poll_delay: 0,
            counted: Vec::new(),
            next_token: 0,
            host_proto: None,
            rndv_row: None,
            sent: Vec::new(),
        }
    }

    /// Write `data` at `addr`.
    pub(crate) fn fill(&mut self, addr: usize, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            self.mem.insert(addr + i, *b);
        }
    }

    /// The `n` bytes at `addr`.
    pub(crate) fn bytes(&self, addr: usize, n: usize) -> Vec<u8> {
        (addr..addr + n)
            .map(|a| self.mem.get(&a).copied().unwrap_or(0))
            .collect()
    }

    /// Whether any byte in `addr..addr + n` was written.
    pub(crate) fn touched(&self, addr: usize, n: usize) -> bool {
        self.mem.range(addr..addr + n).next().is_some()
    }

    /// Registrations not yet released.
    pub(crate) fn live_regs(&self) -> usize {
        Arc::strong_count(&self.live) - 1
    }

    /// The address of staging fragment `f`.
    pub(crate) fn frag_addr(&self, f: usize) -> usize {
        FRAG_BASE + f * self.frag
    }

    fn apply(&mut self, m: &Move) {
        match &m.data {
            Some(d) => self.fill(m.to, &d.clone()),
            None => {
                let b = self.bytes(m.from, m.len);
                self.fill(m.to, &b);
            }
        }
    }

    /// Hand over the completion of copy `token` (its bytes move unless it fails): its request
    /// and whether it failed.
    pub(crate) fn complete(&mut self, token: u64) -> (Option<u64>, bool) {
        let i = self
            .in_flight
            .iter()
            .position(|(_, t, _, _)| *t == token)
            .expect("a copy in flight");
        let (req, _, m, fails) = self.in_flight.remove(i);
        if !fails {
            self.apply(&m);
        }
        (req, fails)
    }

    /// Whether copy `token` is in flight.
    pub(crate) fn is_in_flight(&self, token: u64) -> bool {
        self.in_flight.iter().any(|(_, t, _, _)| *t == token)
    }
}

/// The error a failed copy of the fake ends with.
pub(crate) fn copy_error() -> Error {
    Error::Device {
        device: "fake copy lane".into(),
        reason: "injected: the copy failed".into(),
    }
}

impl CopyIo for CopyFake {
    fn copy_post(
        &mut self,
        req: Option<u64>,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<CopyPost> {
        let i = self.attempts;
        self.attempts += 1;
        if self.push_back.contains(&i) {
            return Ok(CopyPost::PushedBack);
        }
        if matches!(&self.fail_post, Some((n, _)) if *n == i) {
            return Err(self.fail_post.take().expect("set").1);
        }
        self.next_token += 1;
        let token = self.next_token;
        let mut ep = CopyEp {
            took: None,
            at_once: self.at_once,
        };
        let st = op(&mut ep, token)?;
        let m = ep.took.expect("the operation reached the endpoint");
        self.moves.push(m.clone());
        if m.data.is_some() {
            self.apply(&m);
            return Ok(CopyPost::Done);
        }
        let fails = self.fail_copy.contains(&self.zcopies);
        self.zcopies += 1;
        match st {
            OpStatus::Done => {
                self.apply(&m);
                Ok(CopyPost::Done)
            }
            OpStatus::InProgress => {
                self.in_flight.push((req, token, m, fails));
                Ok(CopyPost::InProgress(token))
            }
        }
    }

    fn copy_short_max(&self) -> Result<usize> {
        Ok(self.short_max)
    }

    fn copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        if self.refuse_reg {
            return Err(Error::Unsupported {
                what: format!("copying {} memory with fakecopy", region.mem_type),
                why: "injected: demoted for that memory".into(),
            });
        }
        self.regs.push(region);
        let h = MemHandle::new(region, "fakecopy", self.live.clone());
        let key = RemoteKey::new(
            "fakecopy",
            region.addr as u64,
            region.len as u64,
            Arc::new(()),
        );
        Ok((RegGuard::Direct(h), key))
    }

    fn write_host(&mut self, addr: usize, data: &[u8]) {
        self.fill(addr, data);
    }

    fn count(&mut self, what: &'static str) {
        self.counted.push(what);
    }
}

impl BounceIo for CopyFake {
    fn bounce_staging(&mut self) -> Result<(usize, MemHandle)> {
        if self.staging_fails {
            return Err(Error::NoMemory("injected: pinning the staging".into()));
        }
        let region = MemRegion::host(FRAG_BASE, self.frag * self.nfrags.max(1));
        Ok((self.frag, MemHandle::new(region, "fakecopy", Arc::new(()))))
    }

    fn take_bounce(&mut self) -> Option<(usize, usize)> {
        let f = self.free.pop()?;
        Some((f, self.frag_addr(f)))
    }

    fn release_bounce(&mut self, f: usize) {
        assert!(!self.free.contains(&f), "fragment {f} given back twice");
        self.free.push(f);
    }

    fn copy_poll(&mut self, mine: Option<u64>) -> Option<Result<()>> {
        self.polls += 1;
        let t = mine?;
        if !self.is_in_flight(t) {
            return None;
        }
        if self.poll_delay > 0 {
            self.poll_delay -= 1;
            return None;
        }
        match self.complete(t) {
            (_, false) => Some(Ok(())),
            (_, true) => Some(Err(copy_error())),
        }
    }

    fn read_host(&self, addr: usize, n: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.bytes(addr, n));
    }
}

impl BounceSendIo for CopyFake {
    fn host_proto(&self, _p: usize, _op: Op, _len: usize) -> Option<Proto> {
        self.host_proto
    }

    fn rndv_row(&self, _p: usize, _op: Op, _key: MemKey) -> Option<Proto> {
        self.rndv_row
    }

    fn start_host_send(&mut self, send: SendState) -> u64 {
        let bytes = self.bytes(send.head.addr, send.head.len);
        self.sent.push((send, bytes));
        100 + self.sent.len() as u64
    }
}

/// A GPU region of the fake.
pub(crate) fn gpu(addr: usize, len: usize) -> MemRegion {
    MemRegion {
        addr,
        len,
        mem_type: MemoryType::Cuda,
        device: Some(0),
    }
}
