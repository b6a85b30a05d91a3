//! The fabric: the state every sim domain, interface and endpoint of one test shares, and the
//! controls the test uses to steer it.
//!
//! # Delivery model
//!
//! Data moves when an operation is posted (an active message is copied into the fabric, a
//! put or get copies between the two registered regions at once); what the fabric delays is the
//! *notification*: the arrival of an active message at the peer's interface, and the completion
//! of a zero-copy operation or flush at the poster's interface. So reordering never changes
//! bytes, only the order in which protocols learn about them, and no delayed copy can touch a
//! buffer after its request ended. (An operation lost on purpose, [`Fabric::fail_completions_after`],
//! moves nothing; only its failed completion is delivered.)
//!
//! Three [`Delivery`] modes:
//! - [`Delivery::InOrder`]: everything is delivered in posting order at the next progress of the
//!   receiving interface.
//! - [`Delivery::Random`]: items are held; each progress of an interface releases a random,
//!   non-empty subset of the items held for it, in random order, and zero-copy operations
//!   randomly complete at once (`OpStatus::Done`) or later. Optionally, any operation fails with
//!   `NoResource` with a given probability. Seeded: the same seed and the same calls give the
//!   same run.
//! - [`Delivery::Manual`]: items are held until the test releases them ([`Fabric::held`],
//!   [`Fabric::release`], [`Fabric::release_all`]); completions of the in-process copy lane
//!   (`sim_copy`) are not held, because protocols wait for those inline.
//!
//! Ordering guarantees kept in every mode (what real transports guarantee and protocols rely
//! on): active messages of one endpoint arrive in the order they were sent (FIFO per lane
//! between two workers: UCP relies on it for wire-up before traffic, for the fragments of one
//! eager message, whose unexpected copy only appends a fragment at the current end, and for the
//! bytes of a stream); a flush completes only after every item its endpoint posted before it.
//! Everything else (active messages of different endpoints, completions among themselves and
//! against active messages) may be reordered.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rucx_ucs::{Error, MemoryType, RegErrorKind, Result};
use rucx_uct::{AmId, IfaceLimits, Iov, MemHandle, MemRegion, Registry, RemoteKey};

use crate::mem::Span;

static FABRIC_IDS: AtomicU64 = AtomicU64::new(1);

/// The kinds of lanes a fabric can offer (each is one memory domain and one transport of the
/// same name on every node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaneKind {
    /// Host memory between workers, like posix shared memory: active messages and put/get,
    /// intra-node.
    Shm,
    /// Host memory between workers, like tcp: a network device with a slower model.
    Net,
    /// Simulated GPU memory between workers, like cuda_ipc: registers device memory, get/put
    /// zero-copy, intra-node.
    Ipc,
    /// Copies between host and simulated GPU memory inside one worker, like cuda_copy: the
    /// memory-type copy lane of UCP.
    Copy,
}

impl LaneKind {
    /// Every kind.
    pub const ALL: [LaneKind; 4] = [LaneKind::Shm, LaneKind::Net, LaneKind::Ipc, LaneKind::Copy];

    /// Name of the memory domain and of the transport.
    pub fn name(self) -> &'static str {
        match self {
            LaneKind::Shm => "sim_shm",
            LaneKind::Net => "sim_net",
            LaneKind::Ipc => "sim_ipc",
            LaneKind::Copy => "sim_copy",
        }
    }

    /// Device name.
    pub fn device(self) -> &'static str {
        match self {
            LaneKind::Shm => "shm0",
            LaneKind::Net => "net0",
            LaneKind::Ipc => "ipc0",
            LaneKind::Copy => "copy0",
        }
    }

    /// The kind of a domain or transport name.
    pub fn from_name(name: &str) -> Option<LaneKind> {
        LaneKind::ALL.into_iter().find(|k| k.name() == name)
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> Option<LaneKind> {
        LaneKind::ALL.into_iter().find(|k| k.code() == c)
    }
}

impl fmt::Display for LaneKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Size limits of a host lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLimits {
    /// Largest `am_short` payload.
    pub am_max_short: usize,
    /// Largest `am_bcopy` message.
    pub am_max_bcopy: usize,
    /// Largest `am_zcopy` payload.
    pub am_max_zcopy: usize,
    /// Largest `am_zcopy` header.
    pub am_max_hdr: usize,
    /// Largest `put_short`.
    pub put_max_short: usize,
    /// Largest `put_zcopy` / `get_zcopy`.
    pub rma_max_zcopy: usize,
    /// Most iov entries.
    pub max_iov: usize,
}

impl HostLimits {
    /// Close to posix shared memory with its default cells.
    pub fn posix_like() -> HostLimits {
        HostLimits {
            am_max_short: 8120,
            am_max_bcopy: 8128,
            am_max_zcopy: 8000,
            am_max_hdr: 128,
            put_max_short: 4096,
            rma_max_zcopy: usize::MAX >> 1,
            max_iov: 64,
        }
    }

    /// Close to tcp.
    pub fn tcp_like() -> HostLimits {
        HostLimits {
            am_max_short: 256,
            am_max_bcopy: 8 << 10,
            am_max_zcopy: 64 << 10,
            am_max_hdr: 128,
            put_max_short: 256,
            rma_max_zcopy: 1 << 20,
            max_iov: 16,
        }
    }
}

/// How the fabric delivers active messages and completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// In posting order, at the next progress of the receiving interface.
    InOrder,
    /// Held and released in a seeded random order at progress (see the module docs).
    Random {
        /// Seed of the fabric's generator.
        seed: u64,
        /// Chance, in thousandths, that any operation fails with `NoResource`.
        noresource_per_mille: u32,
    },
    /// Held until the test releases them.
    Manual,
}

/// What a fabric offers. Every node gets the same lanes.
#[derive(Clone, Debug, PartialEq)]
pub struct FabricSpec {
    /// The shared-memory-like host lane and its limits.
    pub shm: Option<HostLimits>,
    /// The network-like host lane and its limits.
    pub net: Option<HostLimits>,
    /// The GPU zero-copy lane between workers (`sim_ipc`).
    pub ipc: bool,
    /// The in-process copy lane between host and GPU memory (`sim_copy`).
    pub copy: bool,
    /// The shm domain allocates shared staging that peers can map (`mem_alloc_shared` /
    /// `rkey_ptr`), as posix does.
    pub shared_staging: bool,
    /// Every node's GPU `d` is one physical GPU (`sim_ipc` tells the same UUID for it on
    /// every node, as two processes sharing a GPU see): the pair's copier writes its sends.
    /// Off: each node's GPUs are its own.
    pub shared_gpus: bool,
    /// Delivery mode.
    pub delivery: Delivery,
}

impl FabricSpec {
    /// Host memory only: the shm lane.
    pub fn host() -> FabricSpec {
        FabricSpec {
            shm: Some(HostLimits::posix_like()),
            net: None,
            ipc: false,
            copy: false,
            shared_staging: true,
            shared_gpus: false,
            delivery: Delivery::InOrder,
        }
    }

    /// Host and simulated GPU memory: shm, ipc and copy lanes.
    pub fn gpu() -> FabricSpec {
        FabricSpec {
            ipc: true,
            copy: true,
            ..FabricSpec::host()
        }
    }

    /// Builder: set the delivery mode.
    pub fn delivery(mut self, d: Delivery) -> Self {
        self.delivery = d;
        self
    }

    /// Builder: add the network-like lane (tcp limits).
    pub fn with_net(mut self) -> Self {
        self.net = Some(HostLimits::tcp_like());
        self
    }

    /// Builder: no shm lane.
    pub fn without_shm(mut self) -> Self {
        self.shm = None;
        self
    }

    /// Builder: every node's GPU `d` is one physical GPU ([`FabricSpec::shared_gpus`]).
    pub fn shared_gpus(mut self, on: bool) -> Self {
        self.shared_gpus = on;
        self
    }

    /// Builder: with or without the GPU zero-copy lane.
    pub fn ipc(mut self, on: bool) -> Self {
        self.ipc = on;
        self
    }

    /// Builder: with or without the copy lane.
    pub fn copy(mut self, on: bool) -> Self {
        self.copy = on;
        self
    }

    /// Builder: shared staging on or off.
    pub fn shared_staging(mut self, on: bool) -> Self {
        self.shared_staging = on;
        self
    }

    /// The lane kinds this spec offers, in domain order (the copy domain first: it classifies
    /// GPU memory, as cuda_copy does ahead of cuda_ipc).
    pub fn lanes(&self) -> Vec<LaneKind> {
        let mut v = Vec::new();
        if self.shm.is_some() {
            v.push(LaneKind::Shm);
        }
        if self.net.is_some() {
            v.push(LaneKind::Net);
        }
        if self.copy {
            v.push(LaneKind::Copy);
        }
        if self.ipc {
            v.push(LaneKind::Ipc);
        }
        v
    }
}

/// A node: one worker's view of the fabric (its domains, interfaces and endpoints).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

/// A held item, as the test sees it ([`Fabric::held`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldInfo {
    /// Sequence number (posting order); pass it to [`Fabric::release`].
    pub seq: u64,
    /// Node that will see the item.
    pub to: NodeId,
    /// Lane of the receiving interface.
    pub lane: LaneKind,
    /// What it is.
    pub what: HeldWhat,
    /// Whether it may be released now (FIFO and flush order allow it).
    pub releasable: bool,
}

/// Kind of a held item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeldWhat {
    /// An active message of `len` bytes with id `id`.
    Am {
        /// Active-message id.
        id: AmId,
        /// Bytes.
        len: usize,
    },
    /// The completion of an operation.
    Completion {
        /// Whether it reports success.
        ok: bool,
    },
    /// The completion of a flush.
    Flush,
}

/// Counters of what the fabric did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Active messages posted.
    pub ams: u64,
    /// Put and get operations posted.
    pub rma: u64,
    /// Bytes moved by put and get.
    pub rma_bytes: u64,
    /// Operations refused with `NoResource` on purpose.
    pub noresource: u64,
    /// Registrations failed on purpose.
    pub reg_faults: u64,
    /// Items delivered in another order than posted.
    pub reordered: u64,
    /// Endpoint errors reported.
    pub ep_errors: u64,
}

pub(crate) enum Payload {
    Am { id: AmId, data: Vec<u8> },
    Completion { token: u64, result: Result<()> },
    EpError { user_id: u64, error: Error },
}

pub(crate) struct Item {
    seq: u64,
    /// Receiving interface.
    dst: usize,
    /// Endpoint that posted it (ordering channel).
    ep: Option<usize>,
    flush: bool,
    payload: Payload,
}

#[derive(Default)]
struct LaneCtl {
    reg_attempts: u64,
    /// (n, kind): the n-th registration attempt (1-based) fails.
    reg_fail: Vec<(u64, RegErrorKind)>,
    budget: Option<u64>,
    live: u64,
    noresource: u64,
    /// (ops to let through first, ops to fail then): a hard operation failure.
    op_fail: Option<(u64, u64)>,
    /// (zero-copy ops to let through first, ops whose completion fails then): the post is
    /// taken, its data is lost, and its completion reports an error.
    completion_fail: Option<(u64, u64)>,
}

struct Node {
    name: String,
    failed: Option<String>,
    lanes: BTreeMap<LaneKind, LaneCtl>,
}

pub(crate) struct IfaceSlot {
    pub(crate) node: usize,
    pub(crate) kind: LaneKind,
    inbox: VecDeque<Item>,
}

pub(crate) struct EpSlot {
    pub(crate) iface: usize,
    pub(crate) target: usize,
    user_id: u64,
    err_reported: bool,
}

pub(crate) struct RegInfo {
    pub(crate) node: usize,
    pub(crate) kind: LaneKind,
    pub(crate) region: MemRegion,
    /// The device allocation (simulated GPU memory).
    pub(crate) alloc: Option<u64>,
    shared: bool,
    charged: u64,
}

struct DevRange {
    len: usize,
    device: u32,
    alloc: u64,
}

/// Memory of a shared staging allocation; kept alive by the fabric until it is dropped, so a
/// peer that mapped it can never read freed memory.
#[derive(Debug)]
pub(crate) struct SharedBacking {
    _mem: Vec<u8>,
}

impl SharedBacking {
    pub(crate) fn new(mem: Vec<u8>) -> SharedBacking {
        SharedBacking { _mem: mem }
    }

    /// Whether `addr..addr + len` lies inside this memory.
    fn holds(&self, addr: usize, len: usize) -> bool {
        let base = self._mem.as_ptr() as usize;
        addr >= base && addr.saturating_add(len) <= base + self._mem.len()
    }
}

/// A tiny seeded generator (splitmix64): deterministic and dependency free.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub(crate) fn chance(&mut self, per_mille: u32) -> bool {
        self.next() % 1000 < u64::from(per_mille)
    }
}

const LOG_KEEP: usize = 400;

pub(crate) struct State {
    pub(crate) id: u64,
    pub(crate) spec: FabricSpec,
    rng: Rng,
    nodes: Vec<Node>,
    pub(crate) ifaces: Vec<IfaceSlot>,
    pub(crate) eps: Vec<EpSlot>,
    pub(crate) regs: BTreeMap<u64, RegInfo>,
    next_reg: u64,
    devices: BTreeMap<usize, DevRange>,
    next_alloc: u64,
    held: Vec<Item>,
    next_seq: u64,
    violations: Vec<String>,
    log: VecDeque<String>,
    shared: Vec<Arc<SharedBacking>>,
    stats: Stats,
}

/// A handle on a fabric; clones share it. The test keeps one and hands registries made from
/// it ([`Fabric::registry`]) to the contexts it builds.
#[derive(Clone)]
pub struct Fabric {
    pub(crate) st: Arc<Mutex<State>>,
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("Fabric")
            .field("id", &st.id)
            .field(
                "nodes",
                &st.nodes.iter().map(|n| &n.name).collect::<Vec<_>>(),
            )
            .field("delivery", &st.spec.delivery)
            .field("held", &st.held.len())
            .finish()
    }
}

impl Fabric {
    /// A fabric offering the lanes of `spec`.
    pub fn new(spec: FabricSpec) -> Fabric {
        let seed = match spec.delivery {
            Delivery::Random { seed, .. } => seed,
            _ => 0,
        };
        Fabric {
            st: Arc::new(Mutex::new(State {
                id: FABRIC_IDS.fetch_add(1, Ordering::Relaxed),
                spec,
                rng: Rng::new(seed),
                nodes: Vec::new(),
                ifaces: Vec::new(),
                eps: Vec::new(),
                regs: BTreeMap::new(),
                next_reg: 1,
                devices: BTreeMap::new(),
                next_alloc: 1,
                held: Vec::new(),
                next_seq: 1,
                violations: Vec::new(),
                log: VecDeque::new(),
                shared: Vec::new(),
                stats: Stats::default(),
            })),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn weak(&self) -> Weak<Mutex<State>> {
        Arc::downgrade(&self.st)
    }

    /// Add a node (one worker's component) named `name`.
    pub fn add_node(&self, name: &str) -> NodeId {
        let mut st = self.lock();
        let lanes = st
            .spec
            .lanes()
            .into_iter()
            .map(|k| (k, LaneCtl::default()))
            .collect();
        st.nodes.push(Node {
            name: name.to_string(),
            failed: None,
            lanes,
        });
        NodeId(st.nodes.len() - 1)
    }

    /// A registry holding one `sim` component bound to `node`, for `Context::new`.
    pub fn registry(&self, node: NodeId) -> Registry {
        let mut r = Registry::new();
        r.register(Arc::new(crate::SimComponent::new(self.clone(), node)));
        r
    }

    /// The spec the fabric was built with.
    pub fn spec(&self) -> FabricSpec {
        self.lock().spec.clone()
    }

    /// Change the delivery mode (items already held stay held; switching to
    /// [`Delivery::InOrder`] releases them in posting order).
    pub fn set_delivery(&self, d: Delivery) {
        let mut st = self.lock();
        if let Delivery::Random { seed, .. } = d {
            st.rng = Rng::new(seed);
        }
        st.spec.delivery = d;
        if d == Delivery::InOrder {
            while let Some(i) = st.first_releasable(None) {
                st.release_at(i);
            }
        }
    }

    /// Mark `[addr, addr + len)`, real host memory of the test, as simulated GPU memory of
    /// `device`: the copy domain classifies it as [`MemoryType::Cuda`], only the ipc and copy
    /// lanes touch it, and host lanes refuse it. Returns the allocation id.
    ///
    /// Give the range pages of its own (a page-aligned allocation of whole pages): host
    /// registrations are widened to pages by the registration cache, and one that reached into
    /// simulated device memory would be reported as a violation.
    pub fn mark_device(&self, addr: usize, len: usize, device: u32) -> u64 {
        let mut st = self.lock();
        let alloc = st.next_alloc;
        st.next_alloc += 1;
        st.devices.insert(addr, DevRange { len, device, alloc });
        alloc
    }

    /// Forget the device range starting at `addr` (the test freed it). Later accesses through
    /// registrations of it are errors and violations.
    pub fn unmark_device(&self, addr: usize) {
        self.lock().devices.remove(&addr);
    }

    /// The next `n` operations on every endpoint of `node`'s `lane` interface fail with
    /// `NoResource` (retryable: nothing happens).
    pub fn fail_next_ops(&self, node: NodeId, lane: LaneKind, n: u64) {
        let mut st = self.lock();
        st.log(format!(
            "control: next {n} ops of {lane} on node {} fail with NoResource",
            node.0
        ));
        if let Some(c) = st.nodes[node.0].lanes.get_mut(&lane) {
            c.noresource += n;
        }
    }

    /// After the next `after` operations on the endpoints of `node`'s `lane` interface succeed,
    /// the `n` following ones fail with an I/O error (not retryable: the operation did nothing,
    /// the endpoint stays usable), as a transport error in the middle of a transfer would.
    pub fn fail_ops_after(&self, node: NodeId, lane: LaneKind, after: u64, n: u64) {
        let mut st = self.lock();
        st.log(format!(
            "control: after {after} ops of {lane} on node {}, {n} fail",
            node.0
        ));
        if let Some(c) = st.nodes[node.0].lanes.get_mut(&lane) {
            c.op_fail = Some((after, n));
        }
    }

    /// After `after` zero-copy operations (`am_zcopy`, `put_zcopy`, `get_zcopy`) on the
    /// endpoints of `node`'s `lane` interface go through, the `n` following ones are taken (the
    /// post succeeds, in progress) but do nothing: an active message is not delivered, no
    /// memory is read or written, and the completion reports an I/O error (a transport that
    /// lost an operation after accepting it).
    pub fn fail_completions_after(&self, node: NodeId, lane: LaneKind, after: u64, n: u64) {
        let mut st = self.lock();
        st.log(format!(
            "control: after {after} zero-copy ops of {lane} on node {}, {n} complete with an error",
            node.0
        ));
        if let Some(c) = st.nodes[node.0].lanes.get_mut(&lane) {
            c.completion_fail = Some((after, n));
        }
    }

    /// The `nth` registration attempt (counting from 1, every attempt so far included) with
    /// `node`'s `lane` domain fails with `kind`.
    pub fn fail_registration(&self, node: NodeId, lane: LaneKind, nth: u64, kind: RegErrorKind) {
        let mut st = self.lock();
        if let Some(c) = st.nodes[node.0].lanes.get_mut(&lane) {
            c.reg_fail.push((nth, kind));
        }
    }

    /// Registrations with `node`'s `lane` domain fail with `ApertureExhausted` once the live
    /// registered bytes would pass `bytes` (released registrations give their bytes back).
    pub fn set_reg_budget(&self, node: NodeId, lane: LaneKind, bytes: Option<u64>) {
        let mut st = self.lock();
        if let Some(c) = st.nodes[node.0].lanes.get_mut(&lane) {
            c.budget = bytes;
        }
    }

    /// Registration attempts with `node`'s `lane` domain so far.
    pub fn reg_attempts(&self, node: NodeId, lane: LaneKind) -> u64 {
        self.lock().nodes[node.0]
            .lanes
            .get(&lane)
            .map_or(0, |c| c.reg_attempts)
    }

    /// Live registrations of `node`'s `lane` domain.
    pub fn live_registrations(&self, node: NodeId, lane: LaneKind) -> usize {
        self.lock()
            .regs
            .values()
            .filter(|r| r.node == node.0 && r.kind == lane)
            .count()
    }

    /// Fail `node`: every endpoint from or to it reports `Event::EpError` at the next progress
    /// of its interface, operations on them fail with `EndpointFailure`, what is in flight to
    /// or from it is lost (but not the completions of its own copy and ipc lanes: a copy engine
    /// finishes what it was given), and held completions of operations towards it report the
    /// failure.
    pub fn fail_node(&self, node: NodeId, reason: &str) {
        let mut st = self.lock();
        st.fail_node(node.0, reason);
    }

    /// Whether `node` failed.
    pub fn node_failed(&self, node: NodeId) -> bool {
        self.lock().nodes[node.0].failed.is_some()
    }

    /// Items held by the fabric, oldest first.
    pub fn held(&self) -> Vec<HeldInfo> {
        let st = self.lock();
        (0..st.held.len())
            .map(|i| {
                let it = &st.held[i];
                let slot = &st.ifaces[it.dst];
                HeldInfo {
                    seq: it.seq,
                    to: NodeId(slot.node),
                    lane: slot.kind,
                    what: match &it.payload {
                        Payload::Am { id, data } => HeldWhat::Am {
                            id: *id,
                            len: data.len(),
                        },
                        Payload::Completion { .. } if it.flush => HeldWhat::Flush,
                        Payload::Completion { result, .. } => {
                            HeldWhat::Completion { ok: result.is_ok() }
                        }
                        Payload::EpError { .. } => HeldWhat::Completion { ok: false },
                    },
                    releasable: st.releasable(i),
                }
            })
            .collect()
    }

    /// Release the held item `seq` to its interface. Errors when there is none, or when the
    /// ordering guarantees forbid it now (an older message of the same endpoint, or an older
    /// item before a flush, is still held).
    pub fn release(&self, seq: u64) -> Result<()> {
        let mut st = self.lock();
        let i = st
            .held
            .iter()
            .position(|it| it.seq == seq)
            .ok_or_else(|| Error::InvalidParam(format!("no held item {seq}")))?;
        if !st.releasable(i) {
            return Err(Error::InvalidParam(format!(
                "item {seq} cannot overtake older items of its endpoint"
            )));
        }
        st.release_at(i);
        Ok(())
    }

    /// Release every held item, oldest first. Returns how many.
    pub fn release_all(&self) -> usize {
        let mut st = self.lock();
        let mut n = 0;
        while let Some(i) = st.first_releasable(None) {
            st.release_at(i);
            n += 1;
        }
        n
    }

    /// Items posted and not delivered yet (held, or waiting in an interface).
    pub fn in_flight(&self) -> usize {
        let st = self.lock();
        st.held.len() + st.ifaces.iter().map(|i| i.inbox.len()).sum::<usize>()
    }

    /// What protocols did that a correct one must not: access past a registration or a key,
    /// memory of the wrong type on a lane, freed device memory, a released registration.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// The last few hundred notable events (controls, injected faults, failures, violations),
    /// for reports of failing runs.
    pub fn log(&self) -> Vec<String> {
        self.lock().log.iter().cloned().collect()
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        self.lock().stats.clone()
    }
}

impl State {
    pub(crate) fn log(&mut self, s: String) {
        if self.log.len() >= LOG_KEEP {
            self.log.pop_front();
        }
        self.log.push_back(s);
    }

    pub(crate) fn violation(&mut self, s: String) -> String {
        self.log(format!("VIOLATION: {s}"));
        self.violations.push(s.clone());
        s
    }

    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub(crate) fn new_iface(&mut self, node: usize, kind: LaneKind) -> usize {
        self.ifaces.push(IfaceSlot {
            node,
            kind,
            inbox: VecDeque::new(),
        });
        self.ifaces.len() - 1
    }

    pub(crate) fn new_ep(&mut self, iface: usize, target: usize, user_id: u64) -> usize {
        self.eps.push(EpSlot {
            iface,
            target,
            user_id,
            err_reported: false,
        });
        let ep = self.eps.len() - 1;
        // An endpoint to (or of) a node that already failed reports it at once.
        let (a, b) = (self.ifaces[iface].node, self.ifaces[target].node);
        if let Some(reason) = self.nodes[a]
            .failed
            .clone()
            .or_else(|| self.nodes[b].failed.clone())
        {
            self.report_ep_error(ep, &reason);
        }
        ep
    }

    fn peer_desc(&self, ep: usize) -> String {
        let t = self.ifaces[self.eps[ep].target].node;
        format!("sim node {}", self.nodes[t].name)
    }

    /// Checks every operation starts with: the endpoint works, and no `NoResource` is due.
    pub(crate) fn pre_op(&mut self, ep: usize, what: &str) -> Result<()> {
        let e = &self.eps[ep];
        let (own, peer) = (self.ifaces[e.iface].node, self.ifaces[e.target].node);
        for n in [own, peer] {
            if let Some(reason) = &self.nodes[n].failed {
                return Err(Error::EndpointFailure {
                    peer: self.peer_desc(ep),
                    reason: reason.clone(),
                });
            }
        }
        let kind = self.ifaces[e.iface].kind;
        let random = match self.spec.delivery {
            Delivery::Random {
                noresource_per_mille,
                ..
            } => noresource_per_mille,
            _ => 0,
        };
        let hard = match self.nodes[own].lanes.get_mut(&kind) {
            Some(LaneCtl {
                op_fail: Some((after, n)),
                ..
            }) if *n > 0 => {
                if *after > 0 {
                    *after -= 1;
                    false
                } else {
                    *n -= 1;
                    true
                }
            }
            _ => false,
        };
        if hard {
            let n = self.nodes[own].name.clone();
            self.log(format!("injected failure: {what} on {kind} of node {n}"));
            return Err(Error::io(
                format!("{what} on {kind} (injected by the sim fabric)"),
                std::io::Error::from(std::io::ErrorKind::BrokenPipe),
            ));
        }
        let ctl = self.nodes[own].lanes.get_mut(&kind);
        let forced = match ctl {
            Some(c) if c.noresource > 0 => {
                c.noresource -= 1;
                true
            }
            _ => false,
        };
        if forced || (random > 0 && self.rng.chance(random)) {
            self.stats.noresource += 1;
            let n = self.nodes[own].name.clone();
            self.log(format!("NoResource: {what} on {kind} of node {n}"));
            return Err(Error::NoResource(format!(
                "{kind}: no resources (injected by the sim fabric)"
            )));
        }
        Ok(())
    }

    /// Whether the zero-copy operation about to be posted on `ep` is to be lost, its completion
    /// failed ([`Fabric::fail_completions_after`]); counts it down.
    pub(crate) fn completion_fails(&mut self, ep: usize) -> bool {
        let own = self.ifaces[self.eps[ep].iface].node;
        let kind = self.ifaces[self.eps[ep].iface].kind;
        match self.nodes[own].lanes.get_mut(&kind) {
            Some(LaneCtl {
                completion_fail: Some((after, n)),
                ..
            }) if *n > 0 => {
                if *after > 0 {
                    *after -= 1;
                    false
                } else {
                    *n -= 1;
                    true
                }
            }
            _ => false,
        }
    }

    /// The failed completion of a lost operation `what` posted on `ep` with `token`: always
    /// later (the post itself succeeded).
    pub(crate) fn complete_failed(
        &mut self,
        ep: usize,
        token: u64,
        what: &str,
    ) -> rucx_uct::OpStatus {
        let dst = self.eps[ep].iface;
        let kind = self.ifaces[dst].kind;
        let n = self.nodes[self.ifaces[dst].node].name.clone();
        self.log(format!(
            "injected completion failure: {what} on {kind} of node {n}"
        ));
        let hold = self.holds(dst);
        let result = Err(Error::io(
            format!("{what} on {kind} (completion failure injected by the sim fabric)"),
            std::io::Error::from(std::io::ErrorKind::ConnectionReset),
        ));
        self.push(
            dst,
            Some(ep),
            false,
            Payload::Completion { token, result },
            hold,
        );
        rucx_uct::OpStatus::InProgress
    }

    fn push(&mut self, dst: usize, ep: Option<usize>, flush: bool, payload: Payload, hold: bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let it = Item {
            seq,
            dst,
            ep,
            flush,
            payload,
        };
        if hold {
            self.held.push(it);
        } else {
            self.ifaces[dst].inbox.push_back(it);
        }
    }

    fn holds(&self, dst: usize) -> bool {
        match self.spec.delivery {
            Delivery::InOrder => false,
            Delivery::Random { .. } => true,
            // The copy lane's completions are awaited inline by protocols: never held by hand.
            Delivery::Manual => self.ifaces[dst].kind != LaneKind::Copy,
        }
    }

    /// An active message from endpoint `ep` to its target interface.
    pub(crate) fn send_am(&mut self, ep: usize, id: AmId, data: Vec<u8>) {
        let dst = self.eps[ep].target;
        self.stats.ams += 1;
        let hold = self.holds(dst);
        self.push(dst, Some(ep), false, Payload::Am { id, data }, hold);
    }

    /// The completion of an operation posted on `ep` with `token`: at once (`Done`) or later.
    pub(crate) fn complete(&mut self, ep: usize, token: u64, flush: bool) -> rucx_uct::OpStatus {
        let dst = self.eps[ep].iface;
        let hold = self.holds(dst);
        if let Delivery::Random { .. } = self.spec.delivery {
            let older = self.held.iter().any(|it| it.ep == Some(ep));
            if !(flush && older) && self.rng.below(2) == 0 {
                return rucx_uct::OpStatus::Done;
            }
        }
        self.push(
            dst,
            Some(ep),
            flush,
            Payload::Completion {
                token,
                result: Ok(()),
            },
            hold,
        );
        rucx_uct::OpStatus::InProgress
    }

    fn releasable(&self, i: usize) -> bool {
        let it = &self.held[i];
        let Some(ep) = it.ep else { return true };
        match (&it.payload, it.flush) {
            (Payload::Am { .. }, _) => !self.held[..i]
                .iter()
                .any(|o| o.ep == Some(ep) && matches!(o.payload, Payload::Am { .. })),
            (_, true) => !self.held[..i].iter().any(|o| o.ep == Some(ep)),
            _ => true,
        }
    }

    fn first_releasable(&self, dst: Option<usize>) -> Option<usize> {
        (0..self.held.len())
            .find(|&i| dst.is_none_or(|d| self.held[i].dst == d) && self.releasable(i))
    }

    fn release_at(&mut self, i: usize) {
        if i > 0 {
            self.stats.reordered += 1;
        }
        let it = self.held.remove(i);
        let dst = it.dst;
        self.ifaces[dst].inbox.push_back(it);
    }

    /// Random mode: move a random non-empty subset of what is held for `iface` to its inbox.
    fn release_random(&mut self, iface: usize) {
        let mut first = true;
        loop {
            let cands: Vec<usize> = (0..self.held.len())
                .filter(|&i| self.held[i].dst == iface && self.releasable(i))
                .collect();
            if cands.is_empty() || (!first && self.rng.below(3) == 0) {
                return;
            }
            first = false;
            let pick = cands[self.rng.below(cands.len())];
            self.release_at(pick);
        }
    }

    /// Prepare a progress call of `iface`: how many items it may deliver now.
    pub(crate) fn start_progress(&mut self, iface: usize) -> usize {
        if let Delivery::Random { .. } = self.spec.delivery {
            self.release_random(iface);
        }
        self.ifaces[iface].inbox.len()
    }

    pub(crate) fn pop(&mut self, iface: usize) -> Option<Payload> {
        self.ifaces[iface].inbox.pop_front().map(|it| it.payload)
    }

    fn report_ep_error(&mut self, ep: usize, reason: &str) {
        if self.eps[ep].err_reported {
            return;
        }
        self.eps[ep].err_reported = true;
        self.stats.ep_errors += 1;
        let (iface, user_id) = (self.eps[ep].iface, self.eps[ep].user_id);
        let error = Error::EndpointFailure {
            peer: self.peer_desc(ep),
            reason: reason.to_string(),
        };
        self.push(
            iface,
            None,
            false,
            Payload::EpError { user_id, error },
            false,
        );
    }

    fn fail_node(&mut self, n: usize, reason: &str) {
        if self.nodes[n].failed.is_some() {
            return;
        }
        let name = self.nodes[n].name.clone();
        self.log(format!("control: node {name} fails ({reason})"));
        self.nodes[n].failed = Some(reason.to_string());
        let node_of_iface = |st: &State, i: usize| st.ifaces[i].node;
        // In flight to or from it: lost. Completions of operations towards it: failed. The
        // completions of a node's own copies (its copy lane: an endpoint from the node to
        // itself; its ipc lane: copies its engine runs through a mapping of the peer's memory)
        // still come: a copy engine finishes what it was given whatever the network does, and
        // the node's worker waits for them before it lets go of a buffer (`LOCAL_COPY`).
        let engine = |st: &State, i: usize| matches!(st.ifaces[i].kind, LaneKind::Ipc);
        let mut kept = Vec::new();
        for mut it in std::mem::take(&mut self.held) {
            let dst_node = node_of_iface(self, it.dst);
            let src_node = it.ep.map(|e| node_of_iface(self, self.eps[e].iface));
            let peer_node = it.ep.map(|e| node_of_iface(self, self.eps[e].target));
            let local = src_node == Some(dst_node)
                && (peer_node == Some(dst_node) || (dst_node == n && engine(self, it.dst)));
            match &mut it.payload {
                Payload::Completion { .. } if local => {}
                _ if dst_node == n => continue,
                Payload::Am { .. } if src_node == Some(n) => continue,
                Payload::Completion { result, .. } if peer_node == Some(n) => {
                    *result = Err(Error::EndpointFailure {
                        peer: format!("sim node {name}"),
                        reason: reason.to_string(),
                    });
                }
                _ => {}
            }
            kept.push(it);
        }
        self.held = kept;
        for i in 0..self.ifaces.len() {
            if self.ifaces[i].node == n {
                // What arrived is lost, but not the reports of failed endpoints: a test that
                // fails both nodes still sees every endpoint's error.
                let eps = &self.eps;
                let ifaces_node: Vec<usize> = self.ifaces.iter().map(|f| f.node).collect();
                let own_engine = engine(self, i);
                self.ifaces[i].inbox.retain(|it| {
                    let local = it.ep.is_some_and(|e| {
                        ifaces_node[eps[e].iface] == n
                            && (own_engine || ifaces_node[eps[e].target] == n)
                    });
                    matches!(it.payload, Payload::EpError { .. })
                        || local && matches!(it.payload, Payload::Completion { .. })
                });
            }
        }
        for ep in 0..self.eps.len() {
            let (a, b) = (
                node_of_iface(self, self.eps[ep].iface),
                node_of_iface(self, self.eps[ep].target),
            );
            if a == n || b == n {
                self.report_ep_error(ep, reason);
            }
        }
    }

    // ----- registrations -----

    fn device_range(&self, addr: usize, len: usize) -> Option<(usize, &DevRange)> {
        let (&start, r) = self.devices.range(..=addr).next_back()?;
        (addr < start + r.len.max(1) && addr + len <= start + r.len).then_some((start, r))
    }

    /// The device range `[addr, addr + len)` reaches into, if any.
    fn overlaps_device(&self, addr: usize, len: usize) -> Option<(usize, usize, u32)> {
        let end = addr.saturating_add(len.max(1));
        self.devices
            .range(..end)
            .next_back()
            .filter(|(s, r)| *s + r.len > addr)
            .map(|(s, r)| (*s, r.len, r.device))
    }

    /// Classify a pointer (the copy domain's `detect_mem_type`).
    pub(crate) fn detect(&self, addr: usize, len: usize) -> Result<Option<MemRegion>> {
        match self.devices.range(..=addr).next_back() {
            Some((&s, r)) if addr < s + r.len => {
                if addr + len > s + r.len {
                    return Err(Error::InvalidParam(format!(
                        "buffer {addr:#x}+{len} runs past the end of simulated device memory \
                         {s:#x}+{} of GPU {}",
                        r.len, r.device
                    )));
                }
                Ok(Some(MemRegion {
                    addr,
                    len,
                    mem_type: MemoryType::Cuda,
                    device: Some(r.device),
                }))
            }
            _ => Ok(None),
        }
    }

    /// Register `region` with `node`'s `kind` domain; returns the registration id.
    pub(crate) fn register(
        &mut self,
        node: usize,
        kind: LaneKind,
        region: MemRegion,
        shared: bool,
    ) -> Result<u64> {
        let md = kind.name();
        let nname = self.nodes[node].name.clone();
        let accepts = match kind {
            LaneKind::Shm | LaneKind::Net => region.mem_type == MemoryType::Host,
            // As cuda_ipc: exports device memory; host memory is only described (the local
            // side of a copy out of a peer's device buffer).
            LaneKind::Ipc | LaneKind::Copy => {
                matches!(region.mem_type, MemoryType::Host | MemoryType::Cuda)
            }
        };
        if !accepts {
            return Err(region.reg_error(
                md,
                RegErrorKind::UnsupportedMemoryType,
                format!("{md} does not register {} memory", region.mem_type),
                "",
            ));
        }
        let alloc = match region.mem_type {
            MemoryType::Cuda => match self.device_range(region.addr, region.len) {
                Some((_, r)) if Some(r.device) == region.device => Some(r.alloc),
                _ => {
                    let v = self.violation(format!(
                        "node {nname}: {md} asked to register {:#x}+{} as device memory of GPU \
                         {:?}, which the test did not mark so",
                        region.addr, region.len, region.device
                    ));
                    return Err(region.reg_error(md, RegErrorKind::BadAddress, v, ""));
                }
            },
            _ => {
                if let Some((s, l, d)) = self.overlaps_device(region.addr, region.len) {
                    let v = self.violation(format!(
                        "node {nname}: {md} asked to register {:#x}+{} as host memory, but it \
                         reaches into simulated device memory {s:#x}+{l} of GPU {d}",
                        region.addr, region.len
                    ));
                    return Err(region.reg_error(md, RegErrorKind::BadAddress, v, ""));
                }
                None
            }
        };
        let ctl = self
            .nodes
            .get_mut(node)
            .and_then(|n| n.lanes.get_mut(&kind))
            .ok_or_else(|| Error::Internal(format!("{md} is not a lane of this fabric")))?;
        ctl.reg_attempts += 1;
        let nth = ctl.reg_attempts;
        if let Some(&(_, k)) = ctl.reg_fail.iter().find(|(n, _)| *n == nth) {
            self.stats.reg_faults += 1;
            self.log(format!(
                "registration {nth} of {md} on node {nname} fails ({k:?}): {:#x}+{} {}",
                region.addr, region.len, region.mem_type
            ));
            return Err(region.reg_error(
                md,
                k,
                format!("registration {nth} failed on purpose by the sim fabric"),
                "",
            ));
        }
        let charged = region.len as u64;
        if let Some(b) = ctl.budget
            && ctl.live + charged > b
        {
            let live = ctl.live;
            self.stats.reg_faults += 1;
            self.log(format!(
                "registration {nth} of {md} on node {nname} over budget ({live} + {charged} > {b})"
            ));
            return Err(region.reg_error(
                md,
                RegErrorKind::ApertureExhausted,
                format!("{live} bytes registered + {charged} exceeds the sim budget of {b}"),
                "",
            ));
        }
        ctl.live += charged;
        let id = self.next_reg;
        self.next_reg += 1;
        self.regs.insert(
            id,
            RegInfo {
                node,
                kind,
                region,
                alloc,
                shared,
                charged,
            },
        );
        Ok(id)
    }

    pub(crate) fn unregister(&mut self, id: u64) {
        if let Some(r) = self.regs.remove(&id)
            && let Some(c) = self.nodes[r.node].lanes.get_mut(&r.kind)
        {
            c.live = c.live.saturating_sub(r.charged);
        }
    }

    pub(crate) fn keep_shared(&mut self, b: Arc<SharedBacking>) {
        self.shared.push(b);
    }

    /// Whether `addr..addr + len` lies inside shared memory of the fabric (as posix finds the
    /// live shared allocation that holds a region it registers, so its key can be mapped).
    pub(crate) fn inside_shared(&self, addr: usize, len: usize) -> bool {
        self.shared.iter().any(|b| b.holds(addr, len))
    }

    pub(crate) fn is_shared(&self, id: u64) -> bool {
        self.regs.get(&id).is_some_and(|r| r.shared)
    }

    pub(crate) fn device_alloc_live(&self, alloc: u64) -> bool {
        self.devices.values().any(|r| r.alloc == alloc)
    }

    fn check_device(&mut self, r: &MemRegion, alloc: Option<u64>, who: &str) -> Result<()> {
        if let Some(a) = alloc
            && !self.device_alloc_live(a)
        {
            let v = self.violation(format!(
                "{who}: simulated device memory {:#x}+{} was freed while still registered and used",
                r.addr, r.len
            ));
            return Err(Error::InvalidParam(v));
        }
        Ok(())
    }

    /// Check a local iov for an operation of endpoint `ep`: every entry lies inside its handle,
    /// which is a live registration of this node's domain of the lane, of a memory type the
    /// lane may touch. Returns the spans.
    pub(crate) fn local_spans(
        &mut self,
        ep: usize,
        iov: &[Iov<'_>],
        max_iov: usize,
        what: &str,
    ) -> Result<Vec<Span>> {
        let iface = self.eps[ep].iface;
        let (node, kind) = (self.ifaces[iface].node, self.ifaces[iface].kind);
        let who = format!("node {} {kind} {what}", self.nodes[node].name);
        if let Err(e) = Iov::check_all(iov, max_iov) {
            return Err(Error::InvalidParam(self.violation(format!("{who}: {e}"))));
        }
        let mut spans = Vec::with_capacity(iov.len());
        for v in iov {
            let Some(reg) = v.memh.inner::<crate::md::SimReg>() else {
                let s = format!(
                    "{who}: a memory handle of {} is not a sim registration",
                    v.memh.domain()
                );
                return Err(Error::InvalidParam(self.violation(s)));
            };
            let Some(info) = self.regs.get(&reg.id) else {
                let s = format!("{who}: local registration {} was released", reg.id);
                return Err(Error::InvalidParam(self.violation(s)));
            };
            let (rnode, rkind, region, alloc) = (info.node, info.kind, info.region, info.alloc);
            if rnode != node || rkind != kind {
                let s = format!(
                    "{who}: local buffer registered with {rkind} of node {}, not with this lane",
                    self.nodes[rnode].name
                );
                return Err(Error::InvalidParam(self.violation(s)));
            }
            if !lane_touches(kind, region.mem_type) {
                let s = format!(
                    "{who}: local {} memory {:#x}+{} on a lane that must not touch it",
                    region.mem_type, v.addr, v.len
                );
                return Err(Error::InvalidParam(self.violation(s)));
            }
            if !region.contains(v.addr, v.len) {
                let s = format!(
                    "{who}: local {:#x}+{} is outside its registration {:#x}+{}",
                    v.addr, v.len, region.addr, region.len
                );
                return Err(Error::InvalidParam(self.violation(s)));
            }
            self.check_device(&region, alloc, &who)?;
            // SAFETY: the range lies inside a live registration of this process (checked just
            // above against the fabric's table), whose owner keeps it allocated and accessible
            // while registered (`mem_reg`'s contract); device memory was checked to be still
            // marked, i.e. not freed by the test.
            spans.push(unsafe { Span::checked(v.addr, v.len) });
        }
        Ok(spans)
    }

    /// Check a remote access of endpoint `ep` through `rkey`: the key is the sim's, of this
    /// lane's domain, names a live registration on the endpoint's target node (the own node for
    /// the copy lane), and `[addr, addr + len)` lies inside both the key and the registration.
    pub(crate) fn remote_span(
        &mut self,
        ep: usize,
        rkey: &RemoteKey,
        addr: u64,
        len: usize,
        what: &str,
    ) -> Result<Span> {
        let iface = self.eps[ep].iface;
        let (node, kind) = (self.ifaces[iface].node, self.ifaces[iface].kind);
        let target = self.ifaces[self.eps[ep].target].node;
        let who = format!("node {} {kind} {what}", self.nodes[node].name);
        let Some(k) = rkey.inner::<crate::md::SimRkey>() else {
            let s = format!(
                "{who}: remote key unpacked by {}, not a sim domain",
                rkey.domain()
            );
            return Err(Error::InvalidParam(self.violation(s)));
        };
        if k.kind != kind {
            let s = format!("{who}: remote key of {}, used on {kind}", k.kind);
            return Err(Error::InvalidParam(self.violation(s)));
        }
        if let Err(e) = rkey.check(addr, len as u64) {
            self.violation(format!("{who}: {e}"));
            return Err(e);
        }
        let Some(info) = self.regs.get(&k.reg) else {
            let s = format!("{who}: the remote registration {} was released", k.reg);
            return Err(Error::InvalidRkey {
                domain: kind.name().into(),
                reason: self.violation(s),
            });
        };
        let (rnode, region, alloc) = (info.node, info.region, info.alloc);
        if rnode != target {
            let s = format!(
                "{who}: remote key of node {}, used on an endpoint to node {}",
                self.nodes[rnode].name, self.nodes[target].name
            );
            return Err(Error::InvalidParam(self.violation(s)));
        }
        if !lane_touches(kind, region.mem_type) {
            let s = format!(
                "{who}: remote {} memory on a lane that must not touch it",
                region.mem_type
            );
            return Err(Error::InvalidParam(self.violation(s)));
        }
        if !region.contains(addr as usize, len) {
            let s = format!(
                "{who}: remote {addr:#x}+{len} is outside the registration {:#x}+{}",
                region.addr, region.len
            );
            self.violation(s);
            return Err(Error::OutOfBounds {
                addr,
                len: len as u64,
                base: region.addr as u64,
                region_len: region.len as u64,
            });
        }
        self.check_device(&region, alloc, &who)?;
        self.stats.rma += 1;
        self.stats.rma_bytes += len as u64;
        // SAFETY: as in `local_spans`: inside a live registration of this process (checked just
        // above), device memory still marked.
        Ok(unsafe { Span::checked(addr as usize, len) })
    }

    pub(crate) fn limits_violation(&mut self, ep: usize, msg: String) -> Error {
        let iface = self.eps[ep].iface;
        let (node, kind) = (self.ifaces[iface].node, self.ifaces[iface].kind);
        let s = format!("node {} {kind}: {msg}", self.nodes[node].name);
        Error::InvalidParam(self.violation(s))
    }
}

/// Whether a lane may touch memory of this type.
fn lane_touches(kind: LaneKind, mt: MemoryType) -> bool {
    match kind {
        LaneKind::Shm | LaneKind::Net => mt == MemoryType::Host,
        LaneKind::Ipc | LaneKind::Copy => matches!(mt, MemoryType::Host | MemoryType::Cuda),
    }
}

/// Limits of the interfaces of each lane kind.
pub(crate) fn limits(spec: &FabricSpec, kind: LaneKind) -> IfaceLimits {
    let host = |h: &HostLimits| IfaceLimits {
        am_max_short: h.am_max_short,
        am_max_bcopy: h.am_max_bcopy,
        am_max_zcopy: h.am_max_zcopy,
        am_max_hdr: h.am_max_hdr,
        put_max_short: h.put_max_short,
        put_max_zcopy: h.rma_max_zcopy,
        get_max_zcopy: h.rma_max_zcopy,
        max_iov: h.max_iov,
    };
    match kind {
        LaneKind::Shm => host(&spec.shm.unwrap_or_else(HostLimits::posix_like)),
        LaneKind::Net => host(&spec.net.unwrap_or_else(HostLimits::tcp_like)),
        LaneKind::Ipc => IfaceLimits {
            put_max_zcopy: usize::MAX >> 1,
            get_max_zcopy: usize::MAX >> 1,
            max_iov: 16,
            ..IfaceLimits::default()
        },
        LaneKind::Copy => IfaceLimits {
            put_max_short: 8 << 10,
            put_max_zcopy: usize::MAX >> 1,
            get_max_zcopy: usize::MAX >> 1,
            max_iov: 16,
            ..IfaceLimits::default()
        },
    }
}

/// For [`MemHandle`]s: the node a handle's registration belongs to (tests).
pub fn registration_node(memh: &MemHandle) -> Option<NodeId> {
    memh.inner::<crate::md::SimReg>().map(|r| NodeId(r.node))
}

pub(crate) fn kind_from_code(c: u8) -> Option<LaneKind> {
    LaneKind::from_code(c)
}

pub(crate) fn kind_code(k: LaneKind) -> u8 {
    k.code()
}
