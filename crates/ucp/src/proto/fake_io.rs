//! A fake [`ProtoIo`] (and [`StageIo`]) for protocol unit tests: it records what a protocol
//! posts and queues, and can push back (`NoResource`), fail the Nth post or registration, and
//! report completions later (in progress) so a test hands them to the protocol with the result
//! it wants. Its receive staging is a pool of slots whose free count a test checks.

use rucx_ucs::{Error, MemoryType, Result};
use std::sync::Arc;

use rucx_uct::{AmId, Endpoint, Iov, MemHandle, MemRegion, OpStatus, RemoteKey};

use super::gpu::stage_io::{LaneState, On, StageIo};
use super::gpu::staging::{FreeFrags, SendFrags};
use super::io::{ProtoIo, SendIo};
use super::rndv::{RndvPick, SendHead};
use crate::context::RegGuard;
use crate::wire::{Msg, NamedKey};
use crate::worker::state::TokWhat;

/// One operation the fake endpoint took.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    /// An `am_bcopy`: its id and the packed bytes.
    Bcopy { id: AmId, bytes: Vec<u8> },
    /// An `am_zcopy`: its id, header, the iov as (address, length), and its token.
    Zcopy {
        id: AmId,
        header: Vec<u8>,
        iov: Vec<(usize, usize)>,
        token: u64,
    },
    /// A `get_zcopy` or `put_zcopy`: local iov, remote address, token.
    Rma {
        get: bool,
        iov: Vec<(usize, usize)>,
        remote: u64,
        token: u64,
    },
    /// A CPU copy out of receive staging (`StageIo::unstage`), in order with the operations.
    Cpu { from: usize, to: usize, len: usize },
}

/// The endpoint behind the fake: it records, and answers zero-copy operations as in progress.
#[derive(Debug, Default)]
pub(crate) struct FakeEp {
    pub(crate) ops: Vec<Op>,
    /// Reads and writes complete at once (as on shared memory), not in progress.
    pub(crate) done_at_once: bool,
}

impl FakeEp {
    fn status(&self) -> OpStatus {
        if self.done_at_once {
            OpStatus::Done
        } else {
            OpStatus::InProgress
        }
    }
}

fn iov_of(iov: &[Iov<'_>]) -> Vec<(usize, usize)> {
    iov.iter().map(|i| (i.addr, i.len)).collect()
}

impl Endpoint for FakeEp {
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
        let mut bytes = header.to_le_bytes().to_vec();
        bytes.extend_from_slice(payload);
        self.ops.push(Op::Bcopy { id, bytes });
        Ok(())
    }

    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        let mut buf = vec![0u8; 1 << 16];
        let n = pack(&mut buf);
        if n > buf.len() {
            return Err(Error::InvalidParam(format!("packed {n} bytes into 64 KiB")));
        }
        buf.truncate(n);
        self.ops.push(Op::Bcopy { id, bytes: buf });
        Ok(n)
    }

    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        token: u64,
    ) -> Result<OpStatus> {
        self.ops.push(Op::Zcopy {
            id,
            header: header.to_vec(),
            iov: iov_of(iov),
            token,
        });
        Ok(OpStatus::InProgress)
    }

    fn put_short(&mut self, _: &[u8], _: u64, _: &RemoteKey) -> Result<()> {
        Err(Error::InvalidParam(
            "the fake endpoint does no put_short".into(),
        ))
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote: u64,
        _: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.ops.push(Op::Rma {
            get: false,
            iov: iov_of(iov),
            remote,
            token,
        });
        Ok(self.status())
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote: u64,
        _: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.ops.push(Op::Rma {
            get: true,
            iov: iov_of(iov),
            remote,
            token,
        });
        Ok(self.status())
    }

    fn flush(&mut self, _: u64) -> Result<OpStatus> {
        Ok(OpStatus::Done)
    }
}

/// The fake I/O.
#[derive(Default)]
pub(crate) struct FakeIo {
    pub(crate) ep: FakeEp,
    /// Posts that go through before the next one is pushed back (once).
    pub(crate) push_back_after: Option<usize>,
    /// Posts that go through before the next one fails with this error (once).
    pub(crate) fail_post_after: Option<(usize, Error)>,
    /// Registrations that succeed before the next one fails (once).
    pub(crate) fail_reg_after: Option<usize>,
    /// Domains that may not register (demoted).
    pub(crate) demoted: Vec<usize>,
    /// Operations in progress, by (request, token).
    pub(crate) in_flight: Vec<(u64, u64)>,
    /// Registrations made, by (request, lane, region).
    pub(crate) regs: Vec<(u64, usize, MemRegion)>,
    /// Control messages queued, by peer, as (id, bytes).
    pub(crate) ctrls: Vec<(usize, AmId, Vec<u8>)>,
    /// What was counted, in order.
    pub(crate) counted: Vec<&'static str>,
    pub(crate) next_token: u64,
    /// The plan's lane for rendezvous sends (lanes are their own domains in the fake).
    pub(crate) rndv_lane: Option<usize>,
    /// The plan wants lanes not connected yet.
    pub(crate) lanes_pending: bool,
    /// What each re-plan gives a rendezvous send, in order (then the plan stays as it is).
    pub(crate) replans: std::collections::VecDeque<RndvPick>,
    /// Re-plans asked for (sends re-selected, or a peer's plan refreshed).
    pub(crate) replanned: usize,
    /// The marker a host send carries for a GPU receiver.
    pub(crate) write_hint: Option<NamedKey>,
    /// Pipeline steps posted, by (request, where, what).
    pub(crate) steps: Vec<(u64, On, TokWhat)>,
    /// Receive staging slots (none unless a test makes them: [`FakeIo::with_slots`]).
    pub(crate) slots: Option<FreeFrags>,
    /// Receive staging cannot be registered (with any domain).
    pub(crate) staging_fails: bool,
    /// Peers' staging fragments are mapped here (shared memory).
    pub(crate) maps: bool,
    /// Lanes being connected; lanes neither connected nor reachable.
    pub(crate) connecting: Vec<usize>,
    pub(crate) absent: Vec<usize>,
    /// Domains no lane reads with.
    pub(crate) no_read_lane: Vec<usize>,
    /// CPU copies out of staging, by (slot, destination, length).
    pub(crate) unstaged: Vec<(usize, usize, usize)>,
    /// Registrations kept with a request, by (request, as its first).
    pub(crate) kept: Vec<(u64, bool)>,
    /// The key a host-to-GPU remote write offer yields (none: not offered).
    pub(crate) write_key: Option<NamedKey>,
    /// The key a shared-GPU write offer yields (none: not offered, or another GPU).
    pub(crate) shared_write_key: Option<NamedKey>,
    /// The marker a GPU send carries as the pair's copier on a shared GPU (none: not).
    pub(crate) shared_hint: Option<NamedKey>,
    /// Send staging fragments (none unless a test makes them: [`FakeIo::with_send_frags`]),
    /// numbered from [`SEND_LO`].
    pub(crate) send_frags: Option<SendFrags>,
    /// Domains the send staging was registered with (each once, as the worker caches it).
    pub(crate) staging_regs: Vec<usize>,
    /// Multi-fragment message ids handed out.
    pub(crate) msgs: u64,
    /// What the remote memory access requests use (`proto/rma/fake.rs`).
    pub(crate) rma: super::rma::fake::RmaSide,
}

/// Bytes of one fake staging slot, and where the slots lie.
pub(crate) const SLOT: usize = 4096;
pub(crate) const SLOT_BASE: usize = 0x5000_0000;
/// The first send staging fragment's id (the receive slots are numbered from 0).
pub(crate) const SEND_LO: usize = 64;
/// The copy lane's domain in the fake.
pub(crate) const COPY_MD: usize = 99;

impl FakeIo {
    /// A fake with `n` receive staging slots.
    pub(crate) fn with_slots(n: usize) -> FakeIo {
        FakeIo {
            slots: Some(FreeFrags::new(0, n)),
            ..FakeIo::default()
        }
    }

    /// A fake with `n` send staging fragments of [`SLOT`] bytes.
    pub(crate) fn with_send_frags(n: usize) -> FakeIo {
        FakeIo {
            send_frags: Some(SendFrags::new(SEND_LO, n, SLOT)),
            ..FakeIo::default()
        }
    }

    /// Free send staging fragments now.
    pub(crate) fn free_send(&self) -> usize {
        self.send_frags.as_ref().map_or(0, |f| f.len())
    }

    /// Free receive staging slots now.
    pub(crate) fn free_slots(&self) -> usize {
        self.slots.as_ref().map_or(0, |s| s.len())
    }

    /// Push back or fail a post as configured; true: it goes through.
    pub(crate) fn gate(&mut self) -> Result<bool> {
        if count_down(&mut self.push_back_after) {
            return Ok(false);
        }
        if let Some((n, _)) = &mut self.fail_post_after {
            if *n == 0 {
                let (_, e) = self.fail_post_after.take().expect("set");
                return Err(e);
            }
            *n -= 1;
        }
        Ok(true)
    }

    pub(crate) fn handle(md: usize, region: MemRegion) -> MemHandle {
        MemHandle::new(region, &format!("fake{md}"), Arc::new(()))
    }

    /// The control messages queued to `p`, parsed.
    pub(crate) fn ctrl_msgs(&self, p: usize) -> Vec<Msg<'_>> {
        self.ctrls
            .iter()
            .filter(|(q, _, _)| *q == p)
            .map(|(_, id, b)| crate::wire::parse(*id, b).expect("a well-formed control message"))
            .collect()
    }
}

/// A packed key the fake refuses to unpack.
pub(crate) const BAD_KEY: &[u8] = b"bad key";

/// The source id of every message of the fake.
pub(crate) const FAKE_UUID: u64 = 0xfa4e;

pub(crate) fn count_down(n: &mut Option<usize>) -> bool {
    match n {
        Some(0) => {
            *n = None;
            true
        }
        Some(k) => {
            *k -= 1;
            false
        }
        None => false,
    }
}

impl ProtoIo for FakeIo {
    fn post(
        &mut self,
        req: u64,
        _p: usize,
        _lane: usize,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        if !self.gate()? {
            return Ok(false);
        }
        self.next_token += 1;
        let token = self.next_token;
        match op(&mut self.ep, token)? {
            OpStatus::InProgress => self.in_flight.push((req, token)),
            OpStatus::Done => {}
        }
        Ok(true)
    }

    fn register(&mut self, req: u64, lane: usize, region: MemRegion) -> Result<()> {
        if count_down(&mut self.fail_reg_after) {
            return Err(Error::NoMemory(format!(
                "injected: registering {} bytes for lane {lane}",
                region.len
            )));
        }
        self.regs.push((req, lane, region));
        Ok(())
    }

    fn register_md(&mut self, md: usize, region: MemRegion) -> Result<RegGuard> {
        if count_down(&mut self.fail_reg_after) {
            return Err(Error::NoMemory(format!(
                "injected: registering {} bytes with domain {md}",
                region.len
            )));
        }
        self.regs.push((0, md, region));
        Ok(RegGuard::Direct(FakeIo::handle(md, region)))
    }

    fn unpack_key(&self, md: usize, key: &[u8]) -> Result<RemoteKey> {
        if key == BAD_KEY {
            return Err(Error::InvalidRkey {
                domain: format!("fake{md}"),
                reason: "injected: a key that does not unpack".into(),
            });
        }
        Ok(RemoteKey::new(
            &format!("fake{md}"),
            0,
            u64::MAX,
            Arc::new(()),
        ))
    }

    fn pack_key(&self, md: usize, _g: &RegGuard) -> Result<NamedKey> {
        Ok(NamedKey {
            md: format!("fake{md}"),
            key: vec![md as u8],
        })
    }

    fn may_register(&self, md: usize, _mem: MemoryType, _dev: Option<u32>) -> bool {
        !self.demoted.contains(&md)
    }

    fn ctrl(&mut self, p: usize, m: &Msg<'_>) {
        let (id, bytes) = m.encode();
        self.ctrls.push((p, id, bytes));
    }

    fn uuid(&self) -> u64 {
        FAKE_UUID
    }

    fn count(&mut self, what: &'static str) {
        self.counted.push(what);
    }

    fn lane_md(&self, lane: usize) -> usize {
        lane
    }

    fn keep_regs(&mut self, req: u64, md: Option<usize>) {
        self.regs.retain(|(r, l, _)| *r != req || Some(*l) == md);
    }

    fn outstanding(&self, req: u64) -> usize {
        self.in_flight.iter().filter(|(r, _)| *r == req).count()
    }

    fn next_msg(&mut self, _p: usize) -> u64 {
        self.msgs += 1;
        self.msgs
    }
}

impl SendIo for FakeIo {
    fn rndv_pick(&mut self, _req: u64, head: &SendHead, replan: bool) -> RndvPick {
        if replan {
            self.replanned += 1;
            if let Some(p) = self.replans.pop_front() {
                self.rndv_lane = p.lane;
                self.lanes_pending = p.lanes_pending;
                return p;
            }
        }
        RndvPick {
            proto: head.proto,
            lane: self.rndv_lane,
            lanes_pending: self.lanes_pending,
        }
    }

    fn req_key(&self, req: u64, md: usize) -> Result<NamedKey> {
        match self.reg(req, md) {
            Some(_) => Ok(NamedKey {
                md: format!("fake{md}"),
                key: vec![md as u8],
            }),
            None => Err(Error::Internal(format!(
                "request {req}: no registration with {md}"
            ))),
        }
    }

    fn reg(&self, req: u64, md: usize) -> Option<MemHandle> {
        self.regs
            .iter()
            .rev()
            .find(|(r, l, _)| *r == req && *l == md)
            .map(|(_, _, region)| MemHandle::new(*region, &format!("fake{md}"), Arc::new(())))
    }

    fn register_write_source(&mut self, req: u64, lane: usize) -> Result<()> {
        if count_down(&mut self.fail_reg_after) {
            return Err(Error::NoMemory(format!(
                "injected: registering a write source for lane {lane}"
            )));
        }
        self.regs.push((req, lane, MemRegion::host(0, 0)));
        Ok(())
    }

    fn replan_peer(&mut self, _p: usize) {
        self.replanned += 1;
    }

    fn write_hint(&self, _p: usize) -> Option<NamedKey> {
        self.write_hint.clone()
    }

    fn shared_gpu_hint(&self, _p: usize, _dev: Option<u32>, _lane: usize) -> Option<NamedKey> {
        self.shared_hint.clone()
    }
}

impl StageIo for FakeIo {
    fn post_step(
        &mut self,
        req: u64,
        on: On,
        what: TokWhat,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        if !self.gate()? {
            return Ok(false);
        }
        self.next_token += 1;
        op(&mut self.ep, self.next_token)?;
        self.steps.push((req, on, what));
        Ok(true)
    }

    fn lane_state(&mut self, _p: usize, lane: usize) -> LaneState {
        if self.connecting.contains(&lane) {
            LaneState::Connecting
        } else if self.absent.contains(&lane) {
            LaneState::Absent
        } else {
            LaneState::Ready
        }
    }

    /// Lane `md` of domain `md` reads, unless listed in `no_read_lane`.
    fn read_lane(&mut self, _p: usize, md: usize) -> Option<usize> {
        (!self.no_read_lane.contains(&md)).then_some(md)
    }

    fn names(&self, md: usize, p: usize) -> (String, String) {
        (format!("fake{md}"), format!("peer{p}"))
    }

    fn unpack_named(&self, key: &NamedKey) -> Result<(usize, RemoteKey)> {
        let md = key
            .md
            .strip_prefix("fake")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Error::InvalidRkey {
                domain: key.md.clone(),
                reason: "no such local domain".into(),
            })?;
        self.unpack_key(md, &key.key).map(|k| (md, k))
    }

    fn map_fragment(
        &mut self,
        md: usize,
        _rkey: &RemoteKey,
        addr: u64,
    ) -> Option<(usize, MemHandle)> {
        self.maps.then(|| {
            (
                addr as usize,
                FakeIo::handle(md, MemRegion::host(addr as usize, SLOT)),
            )
        })
    }

    fn recv_staging(&mut self, md: usize) -> Result<MemHandle> {
        if self.staging_fails {
            return Err(Error::NoMemory(format!(
                "injected: registering the receive staging with fake{md}"
            )));
        }
        Ok(FakeIo::handle(md, MemRegion::host(SLOT_BASE, SLOT)))
    }

    fn copy_staging(&self) -> Result<MemHandle> {
        Ok(FakeIo::handle(99, MemRegion::host(SLOT_BASE, SLOT)))
    }

    fn take_slot(&mut self) -> Option<(usize, usize)> {
        let f = self.slots.as_mut()?.pop()?;
        Some((f, self.slot_addr(f)))
    }

    fn slot_addr(&self, f: usize) -> usize {
        SLOT_BASE + f * SLOT
    }

    fn release_slot(&mut self, f: usize) {
        self.slots
            .as_mut()
            .expect("a fake with staging slots")
            .push(f);
    }

    fn unstage(&mut self, f: usize, dst: usize, len: usize) {
        self.unstaged.push((f, dst, len));
        let from = self.slot_addr(f);
        self.ep.ops.push(Op::Cpu { from, to: dst, len });
    }

    fn keep(&mut self, req: u64, _g: RegGuard, first: bool) {
        self.kept.push((req, first));
    }

    fn gpu_copy_key(&mut self, req: u64, region: MemRegion) -> Result<RemoteKey> {
        if count_down(&mut self.fail_reg_after) {
            return Err(Error::NoMemory(format!(
                "injected: registering {} bytes of GPU memory for copies",
                region.len
            )));
        }
        self.regs.push((req, COPY_MD, region));
        Ok(RemoteKey::new(
            "fake99",
            region.addr as u64,
            region.len as u64,
            Arc::new(()),
        ))
    }

    fn register_uncached(&mut self, md: usize, region: MemRegion) -> Result<RegGuard> {
        self.register_md(md, region)
    }

    fn take_send_run(&mut self, req: u64, max: usize) -> Option<(usize, usize)> {
        self.send_frags.as_mut()?.take_run(req, max)
    }

    fn announce_send(&mut self, req: u64, p: usize, first: usize, len: usize) {
        self.send_frags
            .as_mut()
            .expect("a fake with send staging fragments")
            .announced(req, p, first, len);
    }

    fn release_send(&mut self, req: u64, first: usize, len: usize) -> usize {
        self.send_frags
            .as_mut()
            .expect("a fake with send staging fragments")
            .release(req, first, len)
    }

    fn staging_key(&mut self, md: usize) -> Result<NamedKey> {
        if self.staging_fails {
            return Err(Error::NoMemory(format!(
                "injected: registering the staging with fake{md}"
            )));
        }
        if !self.staging_regs.contains(&md) {
            if count_down(&mut self.fail_reg_after) {
                return Err(Error::NoMemory(format!(
                    "injected: registering the staging with fake{md}"
                )));
            }
            self.staging_regs.push(md);
        }
        Ok(NamedKey {
            md: format!("fake{md}"),
            key: vec![md as u8],
        })
    }

    fn send_copy_key(&mut self, region: MemRegion) -> Result<(RegGuard, RemoteKey)> {
        if self.demoted.contains(&COPY_MD) {
            return Err(Error::Unsupported {
                what: format!("copying {} memory with fake{COPY_MD}", region.mem_type),
                why: "injected: the copy domain is demoted".into(),
            });
        }
        let g = self.register_md(COPY_MD, region)?;
        let key = RemoteKey::new(
            &format!("fake{COPY_MD}"),
            region.addr as u64,
            region.len as u64,
            Arc::new(()),
        );
        Ok((g, key))
    }

    fn gpu_write_key(
        &mut self,
        _req: u64,
        _p: usize,
        _region: MemRegion,
        _lane: usize,
        _keys: &[NamedKey],
        shared: bool,
    ) -> Option<NamedKey> {
        if shared {
            self.shared_write_key.clone()
        } else {
            self.write_key.clone()
        }
    }
}
