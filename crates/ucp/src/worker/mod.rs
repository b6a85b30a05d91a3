//! Workers: progress, endpoints (peers), requests and the protocols that move data.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::{
    AmId, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceParams, Iov, MemHandle,
    MemRegion, OpStatus, RemoteKey,
};

use crate::address::{IfaceEntry, WorkerAddress};
use crate::buf::{RecvBuf, SendBuf};
use crate::context::{Context, RegGuard};
use crate::matching::{Tag, TagMatcher};
use crate::plan::{self, EpPlan, LaneCand, MemKey, Op, PlanConfig, RecvStep};
use crate::proto::stream::{StreamRecvs, StreamRx};
use crate::proto::{self, Proto, Range};
use crate::slab::Slab;
use crate::wire::{self, Msg, MsgKind, NamedKey};
use rustc_hash::FxHashMap;

mod events;
mod gpu;
mod liveness;
mod query;

pub use crate::plan::PathInfo;
pub use events::{POLL_ONLY_TICK, WAIT_TICK};

/// Largest payload (source and data) of the eager-short fast path.
const SHORT_MAX: usize = 256;

/// Identifies a peer (a UCP endpoint) of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EpId(pub(crate) usize);

impl fmt::Display for EpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ep{}", self.0)
    }
}

/// What a finished request reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Bytes moved.
    pub len: usize,
    /// Tag of the received message (receives), or the tag sent.
    pub tag: Tag,
    /// The peer a message came from (receives).
    pub sender: Option<EpId>,
}

/// Outcome of posting a request.
#[derive(Debug)]
pub(crate) enum Posted {
    /// Finished on the spot (the bytes are already out of the caller's buffer).
    Done(Completion),
    /// In the request table under this id.
    Pending(u64),
}

/// A user active message delivered to a handler.
#[derive(Debug)]
pub struct AmMessage {
    /// User active-message id.
    pub id: u16,
    /// User header.
    pub header: Vec<u8>,
    /// Payload.
    pub data: Vec<u8>,
    /// Endpoint to reply on.
    pub reply_ep: EpId,
}

type AmHandler = Box<dyn FnMut(&Worker, AmMessage) + Send>;

/// Reconstruct a host slice from the address of a buffer the request API borrowed.
///
/// # Safety
/// `addr..addr+len` must be a live host buffer for the whole use of the slice: guaranteed by
/// [`Scope`](crate::Scope), which borrows every buffer until all its requests are finished.
unsafe fn host_slice<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// Mutable variant of [`host_slice`].
///
/// # Safety
/// As [`host_slice`], and the buffer was lent mutably (receives), so nothing else reads or
/// writes it meanwhile.
unsafe fn host_slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

struct Slot {
    md: usize,
    attr: IfaceAttr,
}

/// What a completion token stands for.
#[derive(Clone, Copy, Debug)]
struct Tok {
    req: u64,
    what: TokWhat,
}

#[derive(Clone, Copy, Debug)]
enum TokWhat {
    /// Counted in the request's outstanding operations.
    Plain,
    /// Device -> host staging copy of a sender fragment.
    StageD2H { frag: usize, off: usize, len: usize },
    /// Read of a chunk, into the user buffer or a receive staging fragment.
    PullGet {
        off: usize,
        len: usize,
        /// The sender's staging fragment to acknowledge.
        sfrag: Option<FragAck>,
        rfrag: Option<usize>,
    },
    /// Host staging -> device copy of a received chunk.
    H2D { rfrag: usize, len: usize },
    /// Copy of a peer's mapped staging fragment straight to the device.
    DirectH2D { len: usize, sfrag: Option<FragAck> },
}

/// A sender's staging fragment to hand back once read (or no longer needed): the peer, its
/// send request, the fragment, and the bytes it staged there. Kept with the operation that reads
/// it, so the acknowledgement goes out even if the receive is gone by then.
#[derive(Clone, Copy, Debug)]
struct FragAck {
    peer: usize,
    sreq: u64,
    frag: u64,
    staged: usize,
}

/// Pinned host staging fragments for GPU pipelines: one half for sends, one for receives, so
/// that a worker sending and receiving at once cannot starve itself.
struct Staging {
    /// Registrations first: they must go before the memory they describe.
    copy_memh: MemHandle,
    rma: FxHashMap<usize, (RegGuard, NamedKey)>,
    frag: usize,
    free_send: Vec<usize>,
    free_recv: Vec<usize>,
    base: usize,
    /// Shared-memory staging (peers on this host map it), and the domain that made it.
    shared: Option<(usize, rucx_uct::SharedAlloc)>,
    _mem: Vec<u8>,
}

impl Staging {
    fn addr(&self, f: usize) -> usize {
        self.base + f * self.frag
    }
}

/// Queued work of a peer, in order.
enum Pending {
    /// One control message.
    Ctrl { id: AmId, bytes: Vec<u8> },
    /// Continue posting the fragments of a request.
    Stream(u64),
    /// Bytes `off..off + len` of stream send `id`, packed straight from the caller's buffer
    /// (lent to the request's scope until the request finishes, after its last piece).
    StreamPiece { id: u64, off: usize, len: usize },
    /// Everything queued before this was handed to the transport: finish request `id` (a
    /// stream send, `len` bytes).
    Finish { id: u64, len: usize },
}

/// A peer's uct endpoints by local interface index: a handful at most, found by a linear scan
/// (cheaper than hashing on every send).
#[derive(Default)]
struct Lanes(Vec<(usize, Box<dyn Endpoint>)>);

impl Lanes {
    fn get_mut(&mut self, iface: &usize) -> Option<&mut Box<dyn Endpoint>> {
        self.0
            .iter_mut()
            .find(|(i, _)| i == iface)
            .map(|(_, ep)| ep)
    }

    fn insert(&mut self, iface: usize, ep: Box<dyn Endpoint>) {
        match self.get_mut(&iface) {
            Some(old) => *old = ep,
            None => self.0.push((iface, ep)),
        }
    }

    fn keys(&self) -> impl Iterator<Item = &usize> {
        self.0.iter().map(|(i, _)| i)
    }
}

struct Peer {
    remote: WorkerAddress,
    /// uct endpoints by local interface index.
    eps: Lanes,
    connected: bool,
    /// The active-message lane (the plan's; it never changes once connected).
    am: usize,
    /// The host remote-memory-access lane of the current plan.
    rma: Option<usize>,
    /// What this endpoint does, and the (context epoch, local generation) it was made at.
    plan: EpPlan,
    plan_at: (u64, u64),
    /// The plan wants lanes that are not connected yet (its `wanted` is not empty).
    needs_lanes: bool,
    /// The peer's interfaces this worker reaches, by local interface index.
    targets: Vec<(usize, IfaceEntry)>,
    failed: Option<String>,
    queue: VecDeque<Pending>,
    next_msg: u64,
    /// The receive side of the byte stream from this peer.
    stream_rx: StreamRx,
    /// When it was last heard from (`RUCX_PEER_TIMEOUT`).
    live: liveness::PeerLive,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SendWait {
    /// Posting fragments.
    Posting,
    /// Waiting for the receiver (ATS or RTR).
    Receiver,
    /// Everything posted; waiting for completions.
    Completions,
}

struct SendState {
    peer: usize,
    addr: usize,
    len: usize,
    tag: Tag,
    proto: Proto,
    msg_id: u64,
    /// Bytes of the (prefixed) message posted so far.
    posted: usize,
    /// Streaming rendezvous data to this receive request.
    rndv_to: Option<u64>,
    /// Remote buffer of a put rendezvous, and the lane writing it.
    put: Option<(u64, RemoteKey, usize)>,
    wait: SendWait,
    /// Memory type and device of the buffer.
    mem: MemoryType,
    dev: Option<u32>,
    /// Staging pipeline (GPU memory sent through host fragments).
    stage: Option<Box<StageSend>>,
    /// Split rendezvous: the send finishes after both its writes and the receiver's reads.
    split_left: u8,
}

/// Sender side of a staged pipeline.
struct StageSend {
    rreq: u64,
    next_off: usize,
    acked: usize,
    /// The user buffer, registered with the copy lane's domain, and its key.
    _dev_memh: RegGuard,
    dev_key: RemoteKey,
}

/// A piece of a rendezvous receive to read.
struct Chunk {
    raddr: u64,
    len: usize,
    off: usize,
    rkey: RemoteKey,
    /// Staging fragment of the sender to acknowledge once read, and the length it staged there
    /// (more than `len` when the receive buffer is smaller: the sender counts acknowledged
    /// bytes against its whole message).
    sfrag: Option<(u64, usize)>,
    /// The remote fragment mapped into this process (shared memory), with its registration
    /// on the copy lane: copied straight to the GPU, without a read into local staging.
    local: Option<(usize, MemHandle)>,
}

struct RndvRecv {
    peer: usize,
    sreq: u64,
    /// Bytes wanted (capacity-limited).
    want: usize,
    via_get: bool,
    /// The reads to post: lane, remote address, remote key, local address.
    get: Option<(usize, u64, RemoteKey, usize)>,
    /// Bytes of reads posted.
    posted: usize,
    /// Reads cover `0..get_end` (`want` unless split with the sender's writes).
    get_end: usize,
    /// Split rendezvous: the sender writes `get_end..want`; set until its finish message.
    fin_pending: bool,
    /// The reads are complete (split rendezvous waiting for the finish message).
    gets_done: bool,
    /// Bytes of a split's tail the sender streamed (it could not write them).
    tail_got: usize,
}

impl RndvRecv {
    /// A rendezvous receive of `want` bytes from peer `p`'s send request `sreq`.
    fn new(peer: usize, sreq: u64, want: usize) -> Self {
        RndvRecv {
            peer,
            sreq,
            want,
            via_get: false,
            get: None,
            posted: 0,
            get_end: want,
            fin_pending: false,
            gets_done: false,
            tail_got: 0,
        }
    }
}

struct RecvState {
    addr: usize,
    cap: usize,
    total: usize,
    received: usize,
    tag: Tag,
    sender: Option<usize>,
    rndv: Option<Box<RndvRecv>>,
    mem: MemoryType,
    dev: Option<u32>,
    /// Reads still to post (host keyed pull into GPU memory, or staged fragments).
    chunks: VecDeque<Chunk>,
    /// Bytes that reached the user buffer through chunks.
    landed: usize,
    /// Fragments are announced by the sender (staged pipeline).
    pull: bool,
    /// Lane the chunks are read on.
    chunk_lane: usize,
    /// The user buffer registered with the copy lane's domain (GPU memory only).
    dev_memh: Option<Box<(RegGuard, RemoteKey)>>,
    /// A stream receive (filled from the peer's byte stream, not matched by tag).
    stream: bool,
}

/// A fragmented zero-copy transfer between a registered local range and a remote one.
struct Frags<'a> {
    /// Write (`put_zcopy`) or read (`get_zcopy`).
    put: bool,
    /// Local start address (offset 0 of the transfer).
    local: usize,
    /// Remote start address.
    remote: u64,
    key: &'a RemoteKey,
    memh: &'a MemHandle,
    /// Largest fragment.
    max: usize,
    /// End offset.
    end: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RmaDir {
    Put,
    Get,
    Flush,
}

struct RmaState {
    peer: usize,
    dir: RmaDir,
    len: usize,
    lane: usize,
    addr: usize,
    remote: u64,
    key: Option<RemoteKey>,
    posted: usize,
    /// Lanes still to flush (flush requests).
    flush_lanes: Vec<usize>,
}

enum ReqKind {
    Send(SendState),
    Recv(RecvState),
    Rma(RmaState),
}

struct Req {
    kind: ReqKind,
    result: Option<Result<Completion>>,
    outstanding: usize,
    guards: Vec<RegGuard>,
}

enum Unexp {
    Eager {
        src: usize,
        msg_id: Option<u64>,
        total: usize,
        data: Vec<u8>,
        /// A synchronous send's request, acknowledged when the message is matched.
        sync: Option<u64>,
    },
    Rts {
        src: usize,
        sreq: u64,
        size: usize,
        addr: u64,
        smem: u8,
        keys: Vec<NamedKey>,
    },
}

/// Where the fragments of a multi-fragment eager message go.
enum RxDest {
    Req(u64),
    Unexpected,
    UserAm {
        id: u16,
        total: usize,
        data: Vec<u8>,
    },
}

/// Remote keys of a peer's mapped region, as unpacked by [`Worker::rkey_unpack`].
#[derive(Debug, Clone)]
pub struct RkeyBundle {
    base: u64,
    len: u64,
    keys: Vec<(String, RemoteKey)>,
}

impl RkeyBundle {
    /// Remote base address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Remote length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Check that an access of `len` bytes at `addr` stays inside the mapped region.
    fn check(&self, addr: u64, len: u64) -> Result<()> {
        let end = self.base.saturating_add(self.len);
        if addr >= self.base && addr.checked_add(len).is_some_and(|e| e <= end) {
            Ok(())
        } else {
            Err(Error::OutOfBounds {
                addr,
                len,
                base: self.base,
                region_len: self.len,
            })
        }
    }
}

/// A local region registered for remote access; see [`Worker::mem_map`].
pub struct MemMap<'a> {
    addr: usize,
    len: usize,
    guards: Vec<(String, RegGuard)>,
    packed: Vec<NamedKey>,
    _buf: std::marker::PhantomData<&'a mut [u8]>,
}

impl fmt::Debug for MemMap<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemMap")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field(
                "domains",
                &self.guards.iter().map(|g| &g.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl MemMap<'_> {
    /// Pack the remote keys for a peer.
    pub fn pack_rkey(&self) -> Vec<u8> {
        let mut b = Vec::new();
        wire::put_u64s(&mut b, &[self.addr as u64, self.len as u64]);
        wire::put_keys(&mut b, &self.packed);
        rucx_uct::rkey::pack("ucp-rkey", &b)
    }

    /// Start address of the mapped buffer.
    pub fn address(&self) -> u64 {
        self.addr as u64
    }

    /// Read the mapped buffer (after the peers' writes were flushed).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the map borrows the buffer mutably for its whole life; remote writers are
        // the only other party, and callers read after those writes are flushed.
        unsafe { host_slice(self.addr, self.len) }
    }
}

pub(crate) struct State {
    ctx: Context,
    slots: Vec<Slot>,
    address: WorkerAddress,
    peers: Vec<Peer>,
    by_uuid: FxHashMap<u64, usize>,
    /// The sender of the last message and its peer (a one-entry cache of `by_uuid`).
    last_src: std::cell::Cell<(u64, usize)>,
    /// Payload of the eager-short fast path (source and data), reused.
    short_buf: Vec<u8>,
    matcher: TagMatcher<u64, Unexp>,
    reqs: Slab<Req>,
    tokens: FxHashMap<u64, Tok>,
    next_token: u64,
    rx: FxHashMap<(u64, u64), RxDest>,
    am_inbox: Vec<AmMessage>,
    proto_info: bool,
    frag: usize,
    /// The planner's configuration.
    plan_cfg: PlanConfig,
    /// GPU memory this worker has met (planned for besides host memory).
    gpu_keys: Vec<MemKey>,
    /// Bumped when something the plans read changes locally (GPU keys, connected lanes).
    plan_gen: u64,
    /// Protocol counters, by static name (a handful; a linear scan beats a map).
    counters: Vec<(&'static str, u64)>,
    closing: bool,
    /// Endpoint of the memory-type copy lane (host <-> GPU copies in this process).
    copy: Option<(usize, Box<dyn Endpoint>)>,
    staging: Option<Staging>,
    stage_count: usize,
    /// Completions that happened at once, handled after the current step.
    done_q: VecDeque<(Tok, Result<()>)>,
    /// Peers' shared staging mapped here, registered with the copy lane, by local base.
    mapped: FxHashMap<usize, MemHandle>,
    /// The peer timeout (`RUCX_PEER_TIMEOUT`), unless it is inf.
    keepalive: Option<liveness::Keepalive>,
}

/// A worker: owns interfaces and drives progress.
///
/// A worker is `Send` but not `Sync`: it may move to another thread (or live in a `Mutex`),
/// and one thread at a time uses it. Requests borrow it, so it cannot move while a scope is
/// open. Active-message handlers are `Send` for that reason. It can sleep instead of polling:
/// [`Worker::event_fd`], [`Worker::arm`], [`Worker::wait`] (`events.rs`).
pub struct Worker {
    ifaces: RefCell<Vec<Box<dyn Iface>>>,
    st: RefCell<State>,
    handlers: RefCell<HashMap<u16, AmHandler>>,
    /// Emptied request-id lists of ended scopes, reused by the next ones (a scope per message
    /// is the common pattern; this spares an allocation each).
    id_lists: RefCell<Vec<Vec<u64>>>,
    /// The event set for sleeping (`events.rs`).
    events: events::Events,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.st.borrow();
        f.debug_struct("Worker")
            .field("uuid", &st.address.uuid)
            .field("peers", &st.peers.len())
            .finish()
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

fn new_uuid() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish() | 1
}

impl Worker {
    /// Open a worker with an interface for every transport resource of the context.
    pub fn new(ctx: &Context) -> Result<Worker> {
        let cfg = ctx.config();
        let mut ifaces: Vec<Box<dyn Iface>> = Vec::new();
        let mut slots = Vec::new();
        let mut entries = Vec::new();
        for mi in 0..ctx.domain_count() {
            let md = ctx.domain(mi);
            for tl in md.tl_resources() {
                if !cfg.tls("TLS").allows(&tl.tl_name) {
                    continue;
                }
                match md.open_iface(&tl, &IfaceParams { config: cfg }) {
                    Ok(iface) => {
                        entries.push(IfaceEntry {
                            tl_name: tl.tl_name.clone(),
                            dev_name: tl.dev_name.clone(),
                            md_name: md.name().to_string(),
                            dev_addr: iface.device_address(),
                            iface_addr: iface.iface_address(),
                        });
                        slots.push(Slot {
                            md: mi,
                            attr: iface.attr().clone(),
                        });
                        ifaces.push(iface);
                    }
                    Err(e) => tracing::info!("{}/{}: not used: {e}", tl.tl_name, tl.dev_name),
                }
            }
        }
        if ifaces.is_empty() {
            return Err(Error::Unavailable {
                component: "worker".into(),
                reason: format!(
                    "no transport could be opened (RUCX_TLS={}; unavailable: {:?})",
                    cfg.raw("TLS"),
                    ctx.unavailable()
                ),
            });
        }
        let address = WorkerAddress {
            uuid: new_uuid(),
            host: host_name(),
            pid: std::process::id(),
            ifaces: entries,
        };
        let frag = cfg
            .mem_units("RNDV_FRAG_SIZE")
            .resolve(4 << 20)
            .clamp(4096, 1 << 30) as usize;
        // The memory-type copy lane: an accelerator transport that reaches this process.
        let mut copy = None;
        for (i, slot) in slots.iter().enumerate() {
            let a: &IfaceAttr = &slot.attr;
            if plan::is_copy_lane(a, ctx.domain(slot.md).attr()) {
                let iface = &mut ifaces[i];
                let params = EpParams {
                    dev_addr: iface.device_address(),
                    iface_addr: iface.iface_address(),
                    user_id: u64::MAX,
                };
                match iface.create_ep(&params) {
                    Ok(ep) => {
                        copy = Some((i, ep));
                        break;
                    }
                    Err(e) => tracing::info!("{}: no copy lane: {e}", a.tl_name),
                }
            }
        }
        // A process that can touch GPU memory plans for it from the start (GPU memory of any
        // device), so the zero-copy GPU lane is connected with the endpoint.
        let gpu_keys = if (0..ctx.domain_count()).any(|m| {
            let a = ctx.domain(m).attr();
            a.reg_mem_types().has(MemoryType::Cuda) || a.access_mem_types().has(MemoryType::Cuda)
        }) {
            vec![MemKey::new(MemoryType::Cuda, None)]
        } else {
            Vec::new()
        };
        Ok(Worker {
            ifaces: RefCell::new(ifaces),
            st: RefCell::new(State {
                ctx: ctx.clone(),
                slots,
                address,
                peers: Vec::new(),
                by_uuid: FxHashMap::default(),
                last_src: std::cell::Cell::new((0, 0)),
                short_buf: Vec::with_capacity(SHORT_MAX),
                matcher: TagMatcher::new(),
                reqs: Slab::default(),
                tokens: FxHashMap::default(),
                next_token: 1,
                rx: FxHashMap::default(),
                am_inbox: Vec::new(),
                proto_info: cfg.bool("PROTO_INFO"),
                frag,
                counters: Vec::new(),
                plan_cfg: PlanConfig::from_config(cfg),
                gpu_keys,
                plan_gen: 0,
                closing: false,
                copy,
                staging: None,
                stage_count: (cfg.uint("RNDV_FRAG_COUNT") as usize).clamp(1, 1024),
                done_q: VecDeque::new(),
                mapped: FxHashMap::default(),
                keepalive: liveness::Keepalive::from_config(cfg),
            }),
            handlers: RefCell::new(HashMap::new()),
            id_lists: RefCell::new(Vec::new()),
            events: events::Events::default(),
        })
    }

    /// The packed address peers connect to.
    pub fn address(&self) -> Vec<u8> {
        self.st.borrow().address.pack()
    }

    /// Transports this worker opened, as `transport/device`.
    pub fn transports(&self) -> Vec<String> {
        self.st
            .borrow()
            .slots
            .iter()
            .map(|s| format!("{}/{}", s.attr.tl_name, s.attr.dev_name))
            .collect()
    }

    /// Create (or find) the endpoint to the worker with this packed address.
    pub fn connect(&self, packed: &[u8]) -> Result<EpId> {
        let remote = WorkerAddress::unpack(packed)?;
        let mut ifaces = self.ifaces.borrow_mut();
        let mut st = self.st.borrow_mut();
        let p = st.peer_for(remote)?;
        st.connect_peer(p, &mut ifaces)?;
        st.pump(p);
        Ok(EpId(p))
    }

    /// One progress pass (`progress` in `events.rs` adds waking awaited requests).
    #[inline(always)]
    fn progress_once(&self) -> usize {
        let mut n = 0;
        let inbox = {
            let mut ifaces = self.ifaces.borrow_mut();
            let mut st = self.st.borrow_mut();
            for i in 0..ifaces.len() {
                let st = &mut *st;
                n += ifaces[i].progress(&mut |ev| st.on_event(i, ev));
            }
            // Cheap checks inline: this loop runs on every poll of every request.
            for p in 0..st.peers.len() {
                if !st.peers[p].connected
                    && st.peers[p].failed.is_none()
                    && let Err(e) = st.connect_peer(p, &mut ifaces)
                {
                    st.fail_peer(p, &e.to_string());
                }
                if st.peers[p].needs_lanes {
                    st.connect_wanted(p, &mut ifaces);
                }
                if !st.peers[p].queue.is_empty() {
                    st.pump(p);
                }
            }
            // Pipeline steps that finished at once.
            while let Some((tok, res)) = st.done_q.pop_front() {
                st.on_tok(tok, res);
                n += 1;
            }
            // Peer liveness: a counter per call, the clock once in a while.
            if let Some(ka) = &mut st.keepalive {
                ka.polls += 1;
                if ka.polls >= liveness::CHECK_POLLS {
                    ka.polls = 0;
                    st.check_peers(Instant::now());
                }
            }
            if st.am_inbox.is_empty() {
                return n;
            }
            std::mem::take(&mut st.am_inbox)
        };
        {
            let mut handlers = self.handlers.borrow_mut();
            for m in inbox {
                match handlers.get_mut(&m.id) {
                    Some(h) => h(self, m),
                    None => tracing::warn!(
                        "active message {} from {} dropped: no handler set",
                        m.id,
                        m.reply_ep
                    ),
                }
            }
            n += 1;
        }
        n
    }

    /// Set the handler of user active messages with id `id`.
    pub fn set_am_handler(&self, id: u16, h: impl FnMut(&Worker, AmMessage) + Send + 'static) {
        self.handlers.borrow_mut().insert(id, Box::new(h));
    }

    /// Send a user active message (copied before this returns; completion is local).
    pub fn am_send(&self, ep: EpId, id: u16, header: &[u8], data: &[u8]) -> Result<()> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        st.refresh_plan(ep.0);
        if header.len() > u16::MAX as usize {
            return Err(Error::InvalidParam(
                "active message header longer than 64 KiB".into(),
            ));
        }
        let src = st.address.uuid;
        let am = st.peers[ep.0].am;
        let one = 12 + header.len() + data.len();
        if one <= st.slots[am].attr.limits.am_max_bcopy {
            st.send_msg(
                ep.0,
                &Msg::User {
                    src,
                    id,
                    header,
                    data,
                },
            );
            st.pump(ep.0);
            return Ok(());
        }
        // Large: the prefixed payload [header lv][data] goes as a multi-fragment message.
        let mut payload = Vec::with_capacity(2 + header.len() + data.len());
        rucx_uct::rkey::put_lv(&mut payload, header);
        payload.extend_from_slice(data);
        let msg_id = st.next_msg(ep.0);
        let total = payload.len();
        let mut off = 0;
        let bcopy = st.slots[am].attr.limits.am_max_bcopy;
        while off < total || off == 0 {
            let room = bcopy
                - if off == 0 {
                    proto::FIRST_OVERHEAD
                } else {
                    proto::MIDDLE_OVERHEAD
                };
            let n = room.min(total - off);
            let data = &payload[off..off + n];
            let m = if off == 0 {
                Msg::EagerFirst {
                    src,
                    kind: MsgKind::Am,
                    tag: u64::from(id),
                    msg_id,
                    total: total as u64,
                    data,
                }
            } else {
                Msg::EagerMiddle {
                    src,
                    msg_id,
                    offset: off as u64,
                    data,
                }
            };
            st.send_msg(ep.0, &m);
            off += n;
            if total == 0 {
                break;
            }
        }
        st.pump(ep.0);
        Ok(())
    }

    /// Open a scope for non-blocking requests on borrowed buffers: every request made in it is
    /// finished (or, for unmatched receives, canceled) before `scope` returns.
    pub fn scope<'w, F, T>(&'w self, f: F) -> T
    where
        F: for<'scope> FnOnce(&'scope crate::Scope<'scope, 'w>) -> T,
    {
        let scope = crate::Scope::new(self);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&scope)));
        scope.finish();
        match res {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    }

    /// Send and wait (convenience over [`scope`](Self::scope)).
    pub fn tag_send_wait(&self, ep: EpId, buf: &[u8], tag: Tag) -> Result<Completion> {
        self.scope(|s| s.tag_send(ep, buf, tag).wait())
    }

    /// Receive and wait (convenience over [`scope`](Self::scope)).
    pub fn tag_recv_wait(&self, buf: &mut [u8], tag: Tag, mask: Tag) -> Result<Completion> {
        self.scope(|s| s.tag_recv(buf, tag, mask).wait())
    }

    /// Look for an arrived message matching `tag`/`mask` without receiving it: its tag, size
    /// and sender.
    pub fn probe(&self, tag: Tag, mask: Tag) -> Option<Completion> {
        self.progress();
        let st = self.st.borrow();
        st.matcher.probe(tag, mask).map(|(t, u)| match u {
            Unexp::Eager { src, total, .. } => Completion {
                len: *total,
                tag: t,
                sender: Some(EpId(*src)),
            },
            Unexp::Rts { src, size, .. } => Completion {
                len: *size,
                tag: t,
                sender: Some(EpId(*src)),
            },
        })
    }

    /// Register `buf` for remote access by peers (put/get).
    pub fn mem_map<'a>(&self, buf: &'a mut [u8]) -> Result<MemMap<'a>> {
        let st = self.st.borrow();
        let region = MemRegion::of_slice(buf);
        let mut guards = Vec::new();
        let mut packed = Vec::new();
        let mut errors = Vec::new();
        for mi in 0..st.ctx.domain_count() {
            let rma = st.slots.iter().any(|s| {
                s.md == mi
                    && s.attr
                        .caps
                        .intersects(IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY)
            });
            if !rma || !st.ctx.can_register(mi, MemoryType::Host, None) {
                continue;
            }
            match st.ctx.register(mi, region) {
                Ok(g) => {
                    let md = st.ctx.domain(mi);
                    let key = md.mkey_pack(g.registration())?;
                    packed.push(NamedKey {
                        md: md.name().to_string(),
                        key,
                    });
                    guards.push((md.name().to_string(), g));
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        if guards.is_empty() {
            return Err(Error::Unsupported {
                what: format!("mapping {} bytes for remote access", buf.len()),
                why: if errors.is_empty() {
                    "no open transport supports put/get zero-copy (check RUCX_TLS)".into()
                } else {
                    errors.join("; ")
                },
            });
        }
        Ok(MemMap {
            addr: region.addr,
            len: region.len,
            guards,
            packed,
            _buf: std::marker::PhantomData,
        })
    }

    /// Unpack a peer's packed remote key for use on endpoint `ep`.
    pub fn rkey_unpack(&self, ep: EpId, packed: &[u8]) -> Result<RkeyBundle> {
        let st = self.st.borrow();
        st.check_peer(ep.0)?;
        let payload = rucx_uct::rkey::unpack("ucp-rkey", "remote key bundle", packed)?;
        let mut r = rucx_uct::rkey::Reader::new(payload, "remote key bundle");
        let base = r.u64()?;
        let len = r.u64()?;
        let n = r.u8()? as usize;
        let mut keys = Vec::new();
        for _ in 0..n {
            let md = String::from_utf8(r.lv()?.to_vec())
                .map_err(|_| Error::InvalidAddress("key name not UTF-8".into()))?;
            let key = r.lv()?;
            // A key this process cannot use (another domain's, or `self`'s key of another
            // process) is skipped: the bundle still serves the lanes it has keys for.
            if let Some(mi) = st.ctx.domain_index(&md) {
                match st.ctx.domain(mi).rkey_unpack(key) {
                    Ok(k) => keys.push((md, k)),
                    Err(e) => tracing::debug!("remote key for {md} not usable here: {e}"),
                }
            }
        }
        r.finish()?;
        Ok(RkeyBundle { base, len, keys })
    }

    /// Demotions so far (see [`Context::demotions`]).
    pub fn context_demotions(&self) -> Vec<crate::context::Demotion> {
        self.st.borrow().ctx.demotions()
    }

    /// Buffers refused so far without a demotion (see [`Context::refusals`]).
    pub fn context_refusals(&self) -> Vec<crate::context::Refusal> {
        self.st.borrow().ctx.refusals()
    }

    /// The protocol table endpoint `ep` uses for tag sends of host memory.
    pub fn proto_table(&self, ep: EpId) -> Result<Vec<Range>> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        self.ensure_plan(&mut st, ep.0);
        Ok(st.peers[ep.0]
            .plan
            .table(Op::Tag, MemKey::HOST)
            .rows
            .clone())
    }

    /// The plan of `ep` (what [`proto_info`](Self::proto_info) prints).
    pub fn plan(&self, ep: EpId) -> Result<EpPlan> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        self.ensure_plan(&mut st, ep.0);
        Ok(st.peers[ep.0].plan.clone())
    }

    /// The plan of `ep` as text: lanes, a table per operation and memory type, and the
    /// rendezvous receive steps.
    pub fn proto_info(&self, ep: EpId) -> Result<String> {
        let plan = self.plan(ep)?;
        let st = self.st.borrow();
        Ok(format!(
            "rucx {} -> {}\n{plan}",
            ep,
            st.peers[ep.0].remote.describe()
        ))
    }

    /// Re-plan endpoint `p` if its plan is stale, connecting lanes a new plan wants (when the
    /// interfaces are free to borrow; otherwise the next progress does it).
    fn ensure_plan(&self, st: &mut State, p: usize) {
        st.refresh_plan(p);
        if !st.peers[p].needs_lanes {
            return;
        }
        if let Ok(mut ifaces) = self.ifaces.try_borrow_mut() {
            st.connect_wanted(p, &mut ifaces);
            st.refresh_plan(p);
        }
    }

    /// How often each protocol ran (sends by protocol name, rendezvous receives by how the data
    /// came), for tests, tools and tuning.
    pub fn counters(&self) -> std::collections::BTreeMap<String, u64> {
        self.st
            .borrow()
            .counters
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect()
    }

    /// The lanes of `ep`: the active-message lane and the remote-memory-access lane (as
    /// `transport/device`).
    pub fn lanes(&self, ep: EpId) -> Result<(String, Option<String>)> {
        let st = self.st.borrow();
        st.check_peer(ep.0)?;
        let name = |i: usize| format!("{}/{}", st.slots[i].attr.tl_name, st.slots[i].attr.dev_name);
        let p = &st.peers[ep.0];
        Ok((name(p.am), p.rma.map(name)))
    }

    /// Announce an orderly shutdown: peers that disconnect from now on are not reported as
    /// failures (their pending requests still end with an error).
    pub fn set_closing(&self) {
        self.st.borrow_mut().closing = true;
    }

    /// Whether the endpoint failed, and why.
    pub fn ep_error(&self, ep: EpId) -> Option<String> {
        self.st
            .borrow()
            .peers
            .get(ep.0)
            .and_then(|p| p.failed.clone())
    }

    // ----- request plumbing used by Scope -----

    /// Post a tag send; with `sync`, it completes only once the receiver matched it (small
    /// messages carry a request for an acknowledgement, larger ones use the rendezvous, which
    /// completes after the match anyway).
    pub(crate) fn post_send(
        &self,
        ep: EpId,
        buf: SendBuf<'_>,
        tag: Tag,
        sync: bool,
    ) -> Result<Posted> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        let (addr, len) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(addr, len)?,
        };
        let key = MemKey::new(mem, dev);
        if mem.is_gpu() {
            st.note_gpu_key(key);
        }
        self.ensure_plan(&mut st, ep.0);
        let op = if sync { Op::TagSync } else { Op::Tag };
        let table = st.peers[ep.0].plan.table(op, key);
        let proto = match table.lookup(len) {
            Some(r) => r.proto,
            None => return Err(table.refusal(&st.peers[ep.0].remote.describe())),
        };
        // Small GPU messages: copy them to a pinned bounce buffer and send eagerly, rather than
        // paying a rendezvous round trip.
        if proto == Proto::EagerBounce {
            match self.bounce(&mut st, addr, len, mem, dev) {
                Ok((host, frag)) => {
                    let hproto = st.peers[ep.0]
                        .plan
                        .table(Op::Tag, MemKey::HOST)
                        .lookup(len)
                        .map(|r| r.proto)
                        .unwrap_or(Proto::EagerBcopy);
                    let id = st.new_req(ReqKind::Send(SendState {
                        peer: ep.0,
                        addr: host,
                        len,
                        tag,
                        proto: hproto,
                        msg_id: 0,
                        posted: 0,
                        rndv_to: None,
                        put: None,
                        wait: SendWait::Posting,
                        mem: MemoryType::Host,
                        dev: None,
                        stage: None,
                        split_left: 0,
                    }));
                    st.count(Proto::EagerBounce.name());
                    // Eager protocols copy the bytes out before returning.
                    st.start_send(id);
                    if let Some(stg) = st.staging.as_mut() {
                        stg.free_send.push(frag);
                    }
                    return Ok(Posted::Pending(id));
                }
                Err(e) => {
                    tracing::debug!("no bounce buffer for a small GPU message ({e}); rendezvous")
                }
            }
        }
        let proto = if proto == Proto::EagerBounce {
            // The large-message protocol of the same table.
            st.peers[ep.0]
                .plan
                .table(op, key)
                .rows
                .last()
                .map(|r| r.proto)
                .filter(|p| p.is_rndv())
                .ok_or_else(|| Error::Internal("a GPU table without a rendezvous row".into()))?
        } else {
            proto
        };
        // Fast path: a small host message that fits one `am_short` and finds the lane idle is
        // sent at once, without a request in the table.
        if !sync
            && proto == Proto::EagerShort
            && !mem.is_gpu()
            && st.try_eager_short(ep.0, addr, len, tag)?
        {
            st.count(proto.name());
            return Ok(Posted::Done(Completion {
                len,
                tag,
                sender: None,
            }));
        }
        let id = st.new_req(ReqKind::Send(SendState {
            peer: ep.0,
            addr,
            len,
            tag,
            proto,
            msg_id: 0,
            posted: 0,
            rndv_to: None,
            put: None,
            wait: SendWait::Posting,
            mem,
            dev,
            stage: None,
            split_left: 0,
        }));
        st.start_send(id);
        Ok(Posted::Pending(id))
    }

    /// Copy a small GPU buffer into a send staging fragment and wait for the copy (it takes a
    /// few microseconds); returns the fragment's address and index.
    fn bounce(
        &self,
        st: &mut State,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(usize, usize)> {
        st.ensure_staging()?;
        let (memh, key) = st.copy_key(addr, len, mem, dev)?;
        let stg = st.staging.as_mut().expect("staging");
        let f = stg
            .free_send
            .pop()
            .ok_or_else(|| Error::NoResource("every send staging fragment is in use".into()))?;
        if len > stg.frag {
            stg.free_send.push(f);
            return Err(Error::InvalidParam("bounce larger than a fragment".into()));
        }
        let host = stg.addr(f);
        let smemh = stg.copy_memh.clone();
        let iov = [Iov {
            addr: host,
            len,
            memh: &smemh,
        }];
        let token = st.next_token;
        st.next_token += 1;
        let (ci, ep) = st.copy.as_mut().expect("copy lane");
        let ci = *ci;
        let res = match ep.get_zcopy(&iov, addr as u64, &key, token) {
            Ok(OpStatus::Done) => Ok(()),
            Ok(OpStatus::InProgress) => {
                // Wait on the copy interface alone; other completions are kept for later.
                let mut mine = None;
                while mine.is_none() {
                    let mut others = Vec::new();
                    self.ifaces.borrow_mut()[ci].progress(&mut |ev| {
                        if let Event::Completion { token: t, result } = ev {
                            if t == token {
                                mine = Some(result);
                            } else {
                                others.push((t, result));
                            }
                        }
                    });
                    for (t, r) in others {
                        if let Some(tok) = st.tokens.remove(&t) {
                            st.done_q.push_back((tok, r));
                        }
                    }
                }
                mine.expect("loop ends with a result")
            }
            Err(e) => Err(e),
        };
        drop(memh);
        match res {
            Ok(()) => Ok((host, f)),
            Err(e) => {
                if let Some(stg) = st.staging.as_mut() {
                    stg.free_send.push(f);
                }
                Err(e)
            }
        }
    }

    pub(crate) fn post_recv(&self, buf: RecvBuf<'_>, tag: Tag, mask: Tag) -> u64 {
        let mut st = self.st.borrow_mut();
        let (addr, cap) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => match st.ctx.detect(addr, cap) {
                Ok(m) => m,
                Err(e) => {
                    let id = st.new_req(ReqKind::Rma(RmaState {
                        peer: usize::MAX,
                        dir: RmaDir::Flush,
                        len: 0,
                        lane: 0,
                        addr: 0,
                        remote: 0,
                        key: None,
                        posted: 0,
                        flush_lanes: Vec::new(),
                    }));
                    st.finish(id, Err(e));
                    return id;
                }
            },
        };
        // Built in its slot (the request is a few hundred bytes; a move costs a memcpy call).
        let id = st.reqs.insert_with(|| Req {
            kind: ReqKind::Recv(RecvState {
                addr,
                cap,
                total: 0,
                received: 0,
                tag,
                sender: None,
                rndv: None,
                mem,
                dev,
                chunks: VecDeque::new(),
                landed: 0,
                pull: false,
                chunk_lane: usize::MAX,
                dev_memh: None,
                stream: false,
            }),
            result: None,
            outstanding: 0,
            guards: Vec::new(),
        });
        if let Some((mtag, u, id)) = st.matcher.post_recv(tag, mask, id) {
            st.matched(id, mtag, u);
        }
        id
    }

    /// Append `buf` to the byte stream to `ep` in pieces packed straight from `buf`; the request
    /// finishes once every piece was handed to the transport (the sender's flow control).
    pub(crate) fn post_stream_send(&self, ep: EpId, buf: SendBuf<'_>) -> Result<Posted> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        let p = ep.0;
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(buf.addr, buf.len)?,
        };
        let key = MemKey::new(mem, dev);
        if mem.is_gpu() {
            st.note_gpu_key(key);
        }
        st.refresh_plan(p);
        let t = st.peers[p].plan.table(Op::Stream, key);
        if t.rows.is_empty() {
            return Err(t.refusal(&st.peers[p].remote.describe()));
        }
        // The pieces are packed from `buf` as the transport takes them: the buffer stays lent
        // to the request's scope until the request finishes, after the last piece.
        let id = st.new_req(ReqKind::Send(SendState {
            peer: p,
            addr: buf.addr,
            len: buf.len,
            tag: 0,
            proto: Proto::EagerBcopy,
            msg_id: 0,
            posted: 0,
            rndv_to: None,
            put: None,
            wait: SendWait::Posting,
            mem: MemoryType::Host,
            dev: None,
            stage: None,
            split_left: 0,
        }));
        let am = st.peers[p].am;
        let piece = st.slots[am]
            .attr
            .limits
            .am_max_bcopy
            .saturating_sub(8)
            .max(1);
        let len = buf.len;
        let mut off = 0;
        while off < len {
            let n = piece.min(len - off);
            st.peers[p]
                .queue
                .push_back(Pending::StreamPiece { id, off, len: n });
            off += n;
        }
        st.peers[p].queue.push_back(Pending::Finish { id, len });
        st.pump(p);
        st.count("stream send");
        Ok(Posted::Pending(id))
    }

    /// Receive exactly `buf.len` bytes into `buf` (host memory) from the byte stream of `ep`.
    pub(crate) fn post_stream_recv(&self, ep: EpId, buf: RecvBuf<'_>) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        let p = ep.0;
        if p >= st.peers.len() {
            return Err(Error::InvalidParam(format!(
                "endpoint ep{p} does not exist"
            )));
        }
        let (addr, cap) = (buf.addr, buf.len);
        let (mem, _) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(addr, cap)?,
        };
        if mem.is_gpu() {
            return Err(Error::Unsupported {
                what: format!("a stream receive into {mem} memory"),
                why: "streams move host memory only; use tag_recv for GPU buffers".into(),
            });
        }
        let id = st.new_req(ReqKind::Recv(RecvState {
            addr,
            cap,
            total: cap,
            received: 0,
            tag: 0,
            sender: Some(p),
            rndv: None,
            mem: MemoryType::Host,
            dev: None,
            chunks: VecDeque::new(),
            landed: 0,
            pull: false,
            chunk_lane: usize::MAX,
            dev_memh: None,
            stream: true,
        }));
        if let Some(reason) = st.peers[p].failed.clone() {
            let peer = st.peers[p].remote.describe();
            st.finish(id, Err(Error::EndpointFailure { peer, reason }));
            return Ok(id);
        }
        if cap == 0 {
            // Needs no bytes: complete now rather than wait in line.
            st.finish(
                id,
                Ok(Completion {
                    len: 0,
                    tag: 0,
                    sender: Some(ep),
                }),
            );
            return Ok(id);
        }
        let st = &mut *st;
        let (reqs, peer) = (&mut st.reqs, &mut st.peers[p]);
        peer.stream_rx.post(&mut StreamReqs { reqs, peer: p }, id);
        Ok(id)
    }

    pub(crate) fn post_rma(
        &self,
        ep: EpId,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        st.post_rma(ep.0, put, addr, len, remote, rkey)
    }

    pub(crate) fn post_flush(&self, ep: EpId) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        st.post_flush(ep.0)
    }

    pub(crate) fn req_result(&self, id: u64) -> Option<Result<Completion>> {
        let st = self.st.borrow();
        match st.reqs.get(&id) {
            // Every look (test, wait, await) reports the error the request really had.
            Some(r) => r.result.clone(),
            None => Some(Err(Error::Internal(format!("request {id} is unknown")))),
        }
    }

    /// An empty list for a new scope's request ids.
    pub(crate) fn take_id_list(&self) -> Vec<u64> {
        self.id_lists.borrow_mut().pop().unwrap_or_default()
    }

    /// End of a scope: cancel its receives that never matched, wait for everything else, and
    /// release the requests.
    pub(crate) fn finish_scope(&self, mut ids: Vec<u64>) {
        {
            let mut st = self.st.borrow_mut();
            for id in &ids {
                if st.reqs.get(id).is_some_and(|r| r.result.is_none()) {
                    if st.matcher.cancel_expected(|e| e == id).is_some() {
                        st.finish(*id, Err(Error::Canceled));
                    } else {
                        st.stream_cancel(*id);
                    }
                }
            }
        }
        let mut backoff = liveness::Backoff::new();
        for id in &ids {
            loop {
                let mut st = self.st.borrow_mut();
                match st.reqs.get(id) {
                    Some(r) if r.result.is_none() => {}
                    // Ended early (an abort) with copies of the copy lane still running on its
                    // buffer: they finish first, so the buffer is the caller's again only once
                    // nothing of ours touches it.
                    // (Only a request that ended with an error can; the check scans the
                    // tokens, so successful requests skip it.)
                    Some(r)
                        if r.result.as_ref().is_some_and(|x| x.is_err())
                            && st.copies_in_flight(*id) => {}
                    _ => {
                        st.reqs.remove(id);
                        break;
                    }
                }
                drop(st);
                if self.progress() == 0 {
                    backoff.idle(self);
                } else {
                    backoff.busy();
                }
            }
        }
        ids.clear();
        let mut lists = self.id_lists.borrow_mut();
        if lists.len() < 8 {
            lists.push(ids);
        }
    }

    /// Requests in the worker's table: those of open scopes (a leak check for tests).
    pub fn live_requests(&self) -> usize {
        self.st.borrow().reqs.len()
    }

    /// Cancel a receive that has not matched yet. Returns true when it was canceled.
    pub(crate) fn cancel_recv(&self, id: u64) -> bool {
        let canceled = {
            let mut st = self.st.borrow_mut();
            if st.matcher.cancel_expected(|e| *e == id).is_some() {
                st.finish(id, Err(Error::Canceled));
                true
            } else {
                st.stream_cancel(id)
            }
        };
        if canceled {
            self.wake_finished();
        }
        canceled
    }

    /// Progress until request `id` finished or `limit` passed.
    pub(crate) fn wait_req(&self, id: u64, limit: Option<Duration>) -> Result<Completion> {
        // The clock is read only when there is a limit: it is not free on the hot path.
        let start = limit.map(|_| Instant::now());
        let mut backoff = liveness::Backoff::until(start.zip(limit).map(|(s, l)| s + l));
        loop {
            if let Some(r) = self.req_result(id) {
                return r;
            }
            if let (Some(l), Some(t)) = (limit, start)
                && t.elapsed() > l
            {
                return Err(Error::Timeout {
                    after: l,
                    what: format!("request {id}"),
                });
            }
            if self.progress() == 0 {
                // Poll flat out first (a pause instruction costs tens of cycles on some CPUs,
                // straight onto the latency), and ease off only when nothing comes for a while:
                // after a millisecond, yield, then arm and sleep on the worker's events
                // (`events.rs`) until a message or completion comes.
                backoff.idle(self);
            } else {
                backoff.busy();
            }
        }
    }
}

impl State {
    #[inline(always)]
    fn new_req(&mut self, kind: ReqKind) -> u64 {
        self.reqs.insert(Req {
            kind,
            result: None,
            outstanding: 0,
            guards: Vec::new(),
        })
    }

    fn finish(&mut self, id: u64, res: Result<Completion>) {
        if self.set_result(id, res) {
            self.release_chunks(id);
        }
    }

    /// End request `id` with `res` unless it ended already; true when it now ended with an
    /// error (its announced fragments are then to be released: [`Self::release_chunks`]).
    fn set_result(&mut self, id: u64, res: Result<Completion>) -> bool {
        if let Some(r) = self.reqs.get_mut(&id)
            && r.result.is_none()
        {
            let failed = res.is_err();
            r.result = Some(res);
            r.guards.clear();
            return failed;
        }
        false
    }

    /// A pipelined receive ended early: hand the sender back the staging fragments it announced
    /// and we will not read (it reuses them for other transfers).
    fn release_chunks(&mut self, id: u64) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return;
        };
        let Some((peer, sreq)) = rs.rndv.as_ref().map(|rv| (rv.peer, rv.sreq)) else {
            return;
        };
        let acks: Vec<FragAck> = rs
            .chunks
            .drain(..)
            .filter_map(|c| c.sfrag)
            .map(|(frag, staged)| FragAck {
                peer,
                sreq,
                frag,
                staged,
            })
            .collect();
        for a in acks {
            self.ack_fragment(a);
        }
    }

    /// End request `id` with `e` and, when it is one side of a rendezvous, tell the peer, so
    /// that the other side's request ends too rather than waiting for messages that will never
    /// come. Every failure of a rendezvous in progress ends here.
    fn fail(&mut self, id: u64, e: Error) {
        let notice = match self.reqs.get(&id) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: None,
                ..
            }) if s.proto.is_rndv() => {
                let rreq = s.stage.as_ref().map(|st| st.rreq).or(s.rndv_to);
                Some((s.peer, id, rreq.unwrap_or(0), true))
            }
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => rs.rndv.as_ref().map(|rv| (rv.peer, rv.sreq, id, false)),
            Some(Req { result: None, .. }) => None,
            _ => return,
        };
        // A broken endpoint fails the peer's requests on its side by itself.
        let notify = !matches!(e, Error::EndpointFailure { .. });
        let reason = e.to_string();
        self.set_result(id, Err(e));
        if notify && let Some((p, sreq, rreq, by_sender)) = notice {
            self.send_abort(p, sreq, rreq, by_sender, &reason);
        }
        // Only after the abort: the acknowledgements of the fragments announced to a receive
        // carry their whole staged length, and ahead of it they would complete the send.
        self.release_chunks(id);
    }

    /// Tell peer `p` that rendezvous `sreq` -> `rreq` is given up on this side, and why.
    fn send_abort(&mut self, p: usize, sreq: u64, rreq: u64, by_sender: bool, reason: &str) {
        if self.peers.get(p).is_none_or(|x| x.failed.is_some()) {
            return;
        }
        tracing::debug!(
            "rendezvous {sreq:#x} -> {rreq:#x} with {} aborted on this side: {reason}",
            self.peers[p].remote.describe()
        );
        self.send_msg(
            p,
            &Msg::Abort {
                src: self.address.uuid,
                sreq,
                rreq,
                by_sender,
                reason,
            },
        );
        self.pump(p);
    }

    /// The peer gave a rendezvous up: end our side of it with its reason.
    fn on_abort(&mut self, p: usize, sreq: u64, rreq: u64, by_sender: bool, reason: &str) {
        let target = if by_sender {
            let ours = |r: &Req| {
                r.result.is_none()
                    && matches!(&r.kind, ReqKind::Recv(RecvState { rndv: Some(rv), .. })
                        if rv.peer == p && rv.sreq == sreq)
            };
            if rreq != 0 && self.reqs.get(&rreq).is_some_and(ours) {
                Some(rreq)
            } else {
                // The sender did not know our request yet.
                self.reqs.iter().find(|(_, r)| ours(r)).map(|(id, _)| id)
            }
        } else {
            match self.reqs.get(&sreq) {
                Some(Req {
                    kind: ReqKind::Send(s),
                    result: None,
                    ..
                }) if s.peer == p => Some(sreq),
                _ => None,
            }
        };
        // Not found: finished already, or (sender side) not matched yet; a receive that
        // matches it later asks the sender, which answers with another abort.
        let Some(id) = target else {
            return;
        };
        tracing::debug!(
            "{} aborted the rendezvous {sreq:#x} -> {rreq:#x}: {reason}",
            self.peers[p].remote.describe()
        );
        let peer = self.peers[p].remote.describe();
        self.finish(
            id,
            Err(Error::PeerAborted {
                peer,
                reason: reason.to_string(),
            }),
        );
    }

    /// A reply (PULL, RTR) came for send `sreq` that is no longer waiting for it: unless it
    /// finished well, tell the receiver, whose request would otherwise wait forever.
    fn answer_for_gone_send(&mut self, p: usize, sreq: u64, rreq: u64) {
        let reason = match self.reqs.get(&sreq) {
            Some(Req {
                kind: ReqKind::Send(s),
                result: Some(res),
                ..
            }) if s.peer == p => match res {
                Ok(_) => return,
                Err(e) => e.to_string(),
            },
            _ => "the send request is gone (it failed or was canceled)".to_string(),
        };
        self.send_abort(p, sreq, rreq, true, &reason);
    }

    /// Whether copy-lane operations (local copies between a request's buffer and staging,
    /// which always complete) are still running for request `id`.
    fn copies_in_flight(&self, id: u64) -> bool {
        self.tokens.values().any(|t| {
            t.req == id
                && matches!(
                    t.what,
                    TokWhat::StageD2H { .. } | TokWhat::H2D { .. } | TokWhat::DirectH2D { .. }
                )
        })
    }

    fn check_peer(&self, p: usize) -> Result<()> {
        let peer = self
            .peers
            .get(p)
            .ok_or_else(|| Error::InvalidParam(format!("endpoint ep{p} does not exist")))?;
        match &peer.failed {
            Some(reason) => Err(Error::EndpointFailure {
                peer: peer.remote.describe(),
                reason: reason.clone(),
            }),
            None if !peer.connected => Err(Error::NoResource(format!(
                "endpoint ep{p} to {} is still being wired up",
                peer.remote.describe()
            ))),
            None => Ok(()),
        }
    }

    fn next_msg(&mut self, p: usize) -> u64 {
        let peer = &mut self.peers[p];
        peer.next_msg += 1;
        peer.next_msg
    }

    /// Find or create the peer for a remote worker (no uct endpoints yet; lanes are chosen
    /// when it is connected, where the interfaces can judge reachability).
    fn peer_for(&mut self, remote: WorkerAddress) -> Result<usize> {
        if let Some(&p) = self.by_uuid.get(&remote.uuid) {
            return Ok(p);
        }
        let p = self.peers.len();
        self.by_uuid.insert(remote.uuid, p);
        self.peers.push(Peer {
            remote,
            eps: Lanes::default(),
            connected: false,
            am: usize::MAX,
            rma: None,
            plan: EpPlan::default(),
            plan_at: (u64::MAX, u64::MAX),
            needs_lanes: false,
            targets: Vec::new(),
            failed: None,
            queue: VecDeque::new(),
            next_msg: 0,
            stream_rx: StreamRx::default(),
            live: liveness::PeerLive::default(),
        });
        Ok(p)
    }

    /// Find the peer's reachable interfaces, plan the endpoint (a deterministic function of
    /// both addresses, the transports' attributes and the registration view) and create the uct
    /// endpoints of the lanes the plan uses.
    fn connect_peer(&mut self, p: usize, ifaces: &mut [Box<dyn Iface>]) -> Result<()> {
        if self.peers[p].connected {
            return Ok(());
        }
        let remote = self.peers[p].remote.clone();
        let mut targets = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            // The copy engine works inside this process only; it is not a lane to peers.
            if self.copy.as_ref().is_some_and(|(c, _)| *c == i) {
                continue;
            }
            if let Some(entry) = remote.ifaces.iter().find(|e| {
                e.tl_name == slot.attr.tl_name && ifaces[i].is_reachable(&e.dev_addr, &e.iface_addr)
            }) {
                targets.push((i, entry.clone()));
            }
        }
        self.peers[p].targets = targets;
        let plan = self.make_plan(p).map_err(|u| Error::Unsupported {
            what: format!("connecting to {}", remote.describe()),
            why: format!(
                "no transport reaches it (local: {:?}; remote: {:?}); check RUCX_TLS and the network",
                u.local,
                remote
                    .ifaces
                    .iter()
                    .map(|e| format!("{}/{}", e.tl_name, e.dev_name))
                    .collect::<Vec<_>>()
            ),
        })?;
        for i in plan.wanted.clone() {
            self.connect_lane(p, i, ifaces)?;
        }
        let peer = &mut self.peers[p];
        peer.am = plan.lanes.am;
        peer.connected = true;
        peer.plan_at = (u64::MAX, u64::MAX);
        // Introduce ourselves first on the AM lane, so replies can find us.
        let addr = self.address.pack();
        self.peers[p].queue.push_front(Pending::Ctrl {
            id: wire::AM_WIREUP,
            bytes: addr,
        });
        self.refresh_plan(p);
        Ok(())
    }

    /// Create the uct endpoint of local interface `i` to peer `p`.
    fn connect_lane(&mut self, p: usize, i: usize, ifaces: &mut [Box<dyn Iface>]) -> Result<()> {
        if self.peers[p].eps.get_mut(&i).is_some() {
            return Ok(());
        }
        let Some((_, entry)) = self.peers[p].targets.iter().find(|(l, _)| *l == i) else {
            return Err(Error::Internal(format!("lane {i} does not reach ep{p}")));
        };
        let ep = ifaces[i].create_ep(&EpParams {
            dev_addr: entry.dev_addr.clone(),
            iface_addr: entry.iface_addr.clone(),
            user_id: p as u64,
        })?;
        self.peers[p].eps.insert(i, ep);
        self.plan_gen += 1;
        Ok(())
    }

    /// Connect the lanes peer `p`'s plan wants (a demotion made a lane that was not in use the
    /// best one); a lane that cannot be connected is logged and left out.
    fn connect_wanted(&mut self, p: usize, ifaces: &mut [Box<dyn Iface>]) {
        self.peers[p].needs_lanes = false;
        for i in std::mem::take(&mut self.peers[p].plan.wanted) {
            if let Err(e) = self.connect_lane(p, i, ifaces) {
                tracing::info!(
                    "ep{p}: lane {}/{} not connected: {e}",
                    self.slots[i].attr.tl_name,
                    self.slots[i].attr.dev_name
                );
                self.peers[p].targets.retain(|(l, _)| *l != i);
                self.plan_gen += 1;
            }
        }
    }

    /// Plan for GPU memory `key` too (from now on, for every endpoint).
    fn note_gpu_key(&mut self, key: MemKey) {
        if !self.gpu_keys.contains(&key) {
            self.gpu_keys.push(key);
            self.plan_gen += 1;
        }
    }

    /// The plan of peer `p` as the planner makes it from the current state.
    fn make_plan(&self, p: usize) -> std::result::Result<EpPlan, plan::Unreachable> {
        let peer = &self.peers[p];
        let copy = self.copy.as_ref().map(|(c, _)| *c);
        let lanes: Vec<LaneCand> = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let md = self.ctx.domain(slot.md);
                LaneCand {
                    attr: slot.attr.clone(),
                    md: slot.md,
                    md_name: md.name().to_string(),
                    md_attr: md.attr().clone(),
                    remote_md: peer
                        .targets
                        .iter()
                        .find(|(l, _)| *l == i)
                        .map(|(_, e)| e.md_name.clone()),
                    connected: peer.eps.0.iter().any(|(l, _)| *l == i),
                    copy: copy == Some(i),
                }
            })
            .collect();
        plan::plan(plan::PlanInput {
            lanes: &lanes,
            reg: &self.ctx,
            cfg: &self.plan_cfg,
            gpu_keys: &self.gpu_keys,
            peer: &peer.remote.describe(),
        })
    }

    /// Re-plan peer `p` if the registration view (a demotion) or the local state changed.
    #[inline]
    fn refresh_plan(&mut self, p: usize) {
        let at = (self.ctx.epoch(), self.plan_gen);
        if self.peers[p].plan_at == at || !self.peers[p].connected {
            return;
        }
        self.replan(p, at);
    }

    #[cold]
    fn replan(&mut self, p: usize, at: (u64, u64)) {
        let plan = match self.make_plan(p) {
            Ok(plan) => plan,
            Err(u) => {
                self.fail_peer(
                    p,
                    &format!("no lane reaches the peer any more (local: {:?})", u.local),
                );
                return;
            }
        };
        let first = self.peers[p].plan_at.0 == u64::MAX;
        let changed = !first && self.peers[p].plan.tables != plan.tables;
        let demoted = !first && self.peers[p].plan_at.0 != at.0;
        self.peers[p].rma = plan.lanes.rma;
        self.peers[p].needs_lanes = !plan.wanted.is_empty();
        self.peers[p].plan = plan;
        self.peers[p].plan_at = at;
        if self.proto_info && (first || changed) || demoted && changed {
            let text = format!(
                "rucx ep{p} -> {}{}\n{}",
                self.peers[p].remote.describe(),
                if demoted {
                    " (re-planned after a demotion)"
                } else {
                    ""
                },
                self.peers[p].plan
            );
            if self.proto_info {
                eprintln!("{text}");
            } else {
                tracing::info!("\n{text}");
            }
        }
    }

    /// Queue a control message to peer `p` (sent in order by [`pump`](Self::pump)).
    fn send_msg(&mut self, p: usize, m: &Msg<'_>) {
        let (id, bytes) = m.encode();
        self.queue_ctrl(p, id, bytes);
    }

    fn queue_ctrl(&mut self, p: usize, id: AmId, bytes: Vec<u8>) {
        self.peers[p].queue.push_back(Pending::Ctrl { id, bytes });
    }

    /// Post queued work of peer `p` in order until the transport pushes back.
    fn pump(&mut self, p: usize) {
        if !self.peers[p].connected || self.peers[p].failed.is_some() {
            return;
        }
        while let Some(front) = self.peers[p].queue.pop_front() {
            match front {
                Pending::Ctrl { id, bytes } => {
                    let am = self.peers[p].am;
                    let ep = self.peers[p].eps.get_mut(&am).expect("am lane connected");
                    let res = ep.am_bcopy(id, &mut rucx_uct::iface::pack_bytes(&bytes));
                    match res {
                        Ok(_) => {}
                        Err(e) if e.is_retryable() => {
                            self.peers[p].queue.push_front(Pending::Ctrl { id, bytes });
                            return;
                        }
                        Err(e) => {
                            self.fail_peer(p, &format!("sending a control message: {e}"));
                            return;
                        }
                    }
                }
                Pending::StreamPiece { id, off, len } => {
                    let addr = match self.reqs.get(&id) {
                        Some(Req {
                            kind: ReqKind::Send(s),
                            result: None,
                            ..
                        }) => s.addr,
                        // Finished otherwise (endpoint failure): nothing more to send.
                        _ => continue,
                    };
                    let src = self.address.uuid.to_le_bytes();
                    // SAFETY: the stream send's buffer is lent to its scope until the request
                    // finishes, which is after its last piece (the `Finish` behind it).
                    let data = unsafe { host_slice(addr + off, len) };
                    let am = self.peers[p].am;
                    let ep = self.peers[p].eps.get_mut(&am).expect("am lane connected");
                    let res = ep.am_bcopy(wire::AM_STREAM_DATA, &mut |buf: &mut [u8]| {
                        buf[..8].copy_from_slice(&src);
                        buf[8..8 + len].copy_from_slice(data);
                        8 + len
                    });
                    match res {
                        Ok(_) => {}
                        Err(e) if e.is_retryable() => {
                            self.peers[p]
                                .queue
                                .push_front(Pending::StreamPiece { id, off, len });
                            return;
                        }
                        Err(e) => {
                            self.fail_peer(p, &format!("sending stream bytes: {e}"));
                            return;
                        }
                    }
                }
                Pending::Finish { id, len } => self.finish(
                    id,
                    Ok(Completion {
                        len,
                        tag: 0,
                        sender: None,
                    }),
                ),
                Pending::Stream(req) => match self.stream(req) {
                    Ok(true) => {}
                    Ok(false) => {
                        self.peers[p].queue.push_front(Pending::Stream(req));
                        return;
                    }
                    Err(e) => self.fail(req, e),
                },
            }
        }
    }

    /// Cancel a stream receive that is still waiting; the bytes it took so far go back to the
    /// front of the stream (nothing is lost). True when it was canceled.
    fn stream_cancel(&mut self, rid: u64) -> bool {
        let p = match self.reqs.get(&rid) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        stream: true,
                        sender: Some(p),
                        ..
                    }),
                result: None,
                ..
            }) => *p,
            _ => return false,
        };
        let (reqs, peer) = (&mut self.reqs, &mut self.peers[p]);
        peer.stream_rx
            .cancel(&mut StreamReqs { reqs, peer: p }, rid)
    }

    fn count(&mut self, what: &'static str) {
        match self
            .counters
            .iter_mut()
            .find(|(k, _)| std::ptr::eq(*k, what) || *k == what)
        {
            Some((_, n)) => *n += 1,
            None => self.counters.push((what, 1)),
        }
    }

    /// Send a small host message with one `am_short` if the AM lane is idle. `Ok(false)`: not
    /// sent (queue busy, lane not connected, or the transport pushed back).
    fn try_eager_short(&mut self, p: usize, addr: usize, len: usize, tag: Tag) -> Result<bool> {
        let peer = &mut self.peers[p];
        if !peer.queue.is_empty() || !peer.connected {
            return Ok(false);
        }
        if 8 + len > SHORT_MAX {
            return Ok(false);
        }
        // SAFETY: the caller's buffer is borrowed for the call (and the scope).
        let data = unsafe { host_slice(addr, len) };
        // The source and the data, contiguous (a reused buffer: nothing to zero or allocate).
        let small = &mut self.short_buf;
        small.clear();
        small.extend_from_slice(&self.address.uuid.to_le_bytes());
        small.extend_from_slice(data);
        let ep = peer.eps.get_mut(&peer.am).expect("am lane");
        match ep.am_short(wire::AM_EAGER_SHORT, tag, small) {
            Ok(()) => Ok(true),
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn start_send(&mut self, id: u64) {
        let (p, proto, len, addr) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.peer, s.proto, s.len, s.addr),
            _ => unreachable!("start_send on a send request"),
        };
        self.count(proto.name());
        let src = self.address.uuid;
        match proto {
            Proto::EagerSync => {
                // Copied now; complete when the receiver's acknowledgement of the match comes.
                // SAFETY: the scope keeps the send buffer alive while this runs.
                let data = unsafe { host_slice(addr, len) };
                let tag = self.send_tag(id);
                if let Some(Req {
                    kind: ReqKind::Send(s),
                    ..
                }) = self.reqs.get_mut(&id)
                {
                    s.wait = SendWait::Receiver;
                }
                self.send_msg(
                    p,
                    &Msg::EagerSync {
                        src,
                        tag,
                        sreq: id,
                        data,
                    },
                );
                self.pump(p);
            }
            Proto::EagerShort | Proto::EagerBcopy => {
                // Copy now: the request is complete once the bytes are in our queue or ring.
                // SAFETY: the scope keeps the send buffer alive while this runs.
                let data = unsafe { host_slice(addr, len) };
                let tag = self.send_tag(id);
                if proto == Proto::EagerShort
                    && self.peers[p].queue.is_empty()
                    && self.peers[p].connected
                {
                    let am = self.peers[p].am;
                    // Small payloads are laid out on the stack; no allocation on the fast path.
                    let mut small = [0u8; 256];
                    let mut big = Vec::new();
                    let payload: &[u8] = if 8 + len <= small.len() {
                        small[..8].copy_from_slice(&src.to_le_bytes());
                        small[8..8 + len].copy_from_slice(data);
                        &small[..8 + len]
                    } else {
                        big.reserve(8 + len);
                        big.extend_from_slice(&src.to_le_bytes());
                        big.extend_from_slice(data);
                        &big
                    };
                    let ep = self.peers[p].eps.get_mut(&am).expect("am lane");
                    match ep.am_short(wire::AM_EAGER_SHORT, tag, payload) {
                        Ok(()) => {
                            self.finish(
                                id,
                                Ok(Completion {
                                    len,
                                    tag,
                                    sender: None,
                                }),
                            );
                            return;
                        }
                        Err(e) if e.is_retryable() => {}
                        Err(e) => {
                            self.finish(id, Err(e));
                            return;
                        }
                    }
                }
                self.send_msg(p, &Msg::EagerOne { src, tag, data });
                self.finish(
                    id,
                    Ok(Completion {
                        len,
                        tag,
                        sender: None,
                    }),
                );
                self.pump(p);
            }
            Proto::EagerBcopyMulti
            | Proto::EagerZcopy
            | Proto::RndvAm
            | Proto::RndvGet
            | Proto::RndvPut
            | Proto::RndvPipeline => {
                if proto.is_rndv() {
                    self.send_rts(id);
                } else {
                    let msg_id = self.next_msg(p);
                    if let Some(Req {
                        kind: ReqKind::Send(s),
                        ..
                    }) = self.reqs.get_mut(&id)
                    {
                        s.msg_id = msg_id;
                    }
                    let am = self.peers[p].am;
                    if proto == Proto::EagerZcopy
                        && let Err(e) = self.register_send(id, am)
                    {
                        tracing::debug!("zero-copy send falls back to copy-in: {e}");
                        self.refresh_plan(p);
                        if let Some(Req {
                            kind: ReqKind::Send(s),
                            ..
                        }) = self.reqs.get_mut(&id)
                        {
                            s.proto = Proto::EagerBcopyMulti;
                        }
                    }
                    self.peers[p].queue.push_back(Pending::Stream(id));
                }
                self.pump(p);
            }
            Proto::EagerBounce
            | Proto::StreamCopy
            | Proto::AmCopy
            | Proto::PutZcopy
            | Proto::GetZcopy => {
                // Not tag-send protocols: the plan never puts them in a send request.
                self.finish(
                    id,
                    Err(Error::Internal(format!(
                        "{} is not a tag-send protocol",
                        proto.name()
                    ))),
                );
            }
        }
    }

    fn send_tag(&self, id: u64) -> Tag {
        match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.tag,
            _ => 0,
        }
    }

    /// Register the send buffer with the domain of `lane`; on failure the context demotes the
    /// domain and the error is returned for re-planning.
    fn register_send(&mut self, id: u64, lane: usize) -> Result<()> {
        let (addr, len, mem, dev) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.addr, s.len, s.mem, s.dev),
            _ => return Ok(()),
        };
        let md = self.slots[lane].md;
        if !self.ctx.can_register(md, mem, dev) {
            return Err(Error::Unsupported {
                what: "registration".into(),
                why: format!("{} is demoted for {mem} memory", self.ctx.domain(md).name()),
            });
        }
        let g = self.ctx.register(
            md,
            MemRegion {
                addr,
                len,
                mem_type: mem,
                device: dev,
            },
        )?;
        if let Some(r) = self.reqs.get_mut(&id) {
            r.guards.push(g);
        }
        Ok(())
    }

    fn send_rts(&mut self, id: u64) {
        let (p, addr, len, tag, proto, mem) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.peer, s.addr, s.len, s.tag, s.proto, s.mem),
            _ => return,
        };
        let mut keys = Vec::new();
        let lane = if mem.is_gpu() {
            let dev = match &self.reqs[&id].kind {
                ReqKind::Send(s) => s.dev,
                _ => None,
            };
            self.peers[p].plan.lanes.gpu(MemKey::new(mem, dev))
        } else {
            self.peers[p].rma
        };
        match (proto, lane) {
            (Proto::RndvGet, Some(lane)) => match self.register_send(id, lane) {
                Ok(()) => {
                    let g = self.reqs[&id].guards.last().expect("just registered");
                    let md = self.ctx.domain(self.slots[lane].md);
                    match md.mkey_pack(g.registration()) {
                        Ok(k) => keys.push(NamedKey {
                            md: md.name().to_string(),
                            key: k,
                        }),
                        Err(e) => tracing::debug!("packing a key failed, streaming instead: {e}"),
                    }
                }
                Err(e) => {
                    tracing::debug!(
                        "rendezvous send registration failed; the receiver will pull through active messages: {e}"
                    );
                    self.refresh_plan(p);
                }
            },
            (Proto::RndvPut, Some(_)) => keys.push(NamedKey {
                md: PUT_HINT.into(),
                key: Vec::new(),
            }),
            _ => {}
        }
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.wait = SendWait::Receiver;
        }
        self.send_msg(
            p,
            &Msg::Rts {
                src: self.address.uuid,
                tag,
                sreq: id,
                size: len as u64,
                addr: addr as u64,
                smem: wire::mem_code(mem),
                keys,
            },
        );
    }

    /// Post the next operations of a request. Ok(true): all posted; Ok(false): the transport
    /// pushed back, call again after progress.
    fn stream(&mut self, id: u64) -> Result<bool> {
        match self.reqs.get(&id) {
            None => Ok(true),
            Some(r) if r.result.is_some() => Ok(true),
            Some(Req {
                kind: ReqKind::Send(_),
                ..
            }) => self.stream_send(id),
            Some(Req {
                kind: ReqKind::Recv(_),
                ..
            }) => self.stream_get(id),
            Some(Req {
                kind: ReqKind::Rma(_),
                ..
            }) => self.stream_rma(id),
        }
    }

    /// Post one operation on `lane` of peer `p` with a fresh token and count it in request `id`.
    /// `Ok(false)`: the transport pushed back; progress and call again.
    fn post_counted(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool> {
        let token = self.next_token;
        let ep = self.peers[p]
            .eps
            .get_mut(&lane)
            .ok_or_else(|| Error::Internal(format!("lane {lane} of ep{p} is not connected")))?;
        match op(ep.as_mut(), token) {
            Ok(st) => {
                self.next_token += 1;
                self.account(id, token, st);
                Ok(true)
            }
            Err(e) if e.is_retryable() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Count an in-progress operation of request `id` posted with `token`, or forget the token
    /// when the operation completed at once.
    fn account(&mut self, id: u64, token: u64, st: OpStatus) {
        match st {
            OpStatus::Done => {}
            OpStatus::InProgress => {
                self.tokens.insert(
                    token,
                    Tok {
                        req: id,
                        what: TokWhat::Plain,
                    },
                );
                if let Some(r) = self.reqs.get_mut(&id) {
                    r.outstanding += 1;
                }
            }
        }
    }

    fn stream_send(&mut self, id: u64) -> Result<bool> {
        if matches!(&self.reqs[&id].kind, ReqKind::Send(s) if s.stage.is_some()) {
            return self.stream_stage(id);
        }
        let ReqKind::Send(s) = &self.reqs[&id].kind else {
            return Ok(true);
        };
        let (p, addr, len, proto, posted, msg_id, tag) =
            (s.peer, s.addr, s.len, s.proto, s.posted, s.msg_id, s.tag);
        let rndv_to = s.rndv_to;
        let put = s.put.clone();
        let src = self.address.uuid;
        if let Some((raddr, rkey, lane)) = put {
            return self.stream_put(id, p, lane, addr, len, raddr, &rkey);
        }
        let am = self.peers[p].am;
        let limits = self.slots[am].attr.limits;
        // Zero-copy from a registration of the AM lane's domain; a streamed split tail is
        // copied in (its registrations serve the receiver's reads of the head).
        let split_tail = s.split_left > 0;
        let am_name = self.ctx.domain(self.slots[am].md).name();
        let zcopy = !split_tail
            && self.reqs[&id]
                .guards
                .first()
                .is_some_and(|g| g.registration().domain() == am_name)
            && (proto == Proto::EagerZcopy || rndv_to.is_some());
        let total = len;
        let mut off = posted;
        loop {
            // Header for this fragment: the message without its data.
            let (head, room) = match rndv_to {
                Some(rreq) => (
                    Msg::RndvData {
                        src,
                        rreq,
                        offset: off as u64,
                        data: &[],
                    },
                    proto::MIDDLE_OVERHEAD,
                ),
                None if off == 0 => (
                    Msg::EagerFirst {
                        src,
                        kind: MsgKind::Tag,
                        tag,
                        msg_id,
                        total: total as u64,
                        data: &[],
                    },
                    proto::FIRST_OVERHEAD,
                ),
                None => (
                    Msg::EagerMiddle {
                        src,
                        msg_id,
                        offset: off as u64,
                        data: &[],
                    },
                    proto::MIDDLE_OVERHEAD,
                ),
            };
            let mut h = Vec::with_capacity(40);
            let am_id = head.encode_into(&mut h);
            let n;
            if zcopy {
                n = limits.am_max_zcopy.min(self.frag).min(total - off);
                let memh = self.reqs[&id].guards[0].registration().clone();
                let iov = [Iov {
                    addr: addr + off,
                    len: n,
                    memh: &memh,
                }];
                let iov: &[Iov<'_>] = if n == 0 { &[] } else { &iov };
                if !self.post_counted(id, p, am, |ep, t| ep.am_zcopy(am_id, &h, iov, t))? {
                    return Ok(false);
                }
            } else {
                n = (limits.am_max_bcopy - room).min(total - off);
                // SAFETY: the scope keeps the send buffer alive while the request exists.
                let data = unsafe { host_slice(addr + off, n) };
                let ep = self.peers[p].eps.get_mut(&am).expect("am lane");
                let res = ep.am_bcopy(am_id, &mut |buf: &mut [u8]| {
                    let need = h.len() + n;
                    if let Some(dst) = buf.get_mut(..need) {
                        dst[..h.len()].copy_from_slice(&h);
                        dst[h.len()..].copy_from_slice(data);
                    }
                    need
                });
                match res {
                    Ok(_) => {}
                    Err(e) if e.is_retryable() => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            off += n;
            if let Some(Req {
                kind: ReqKind::Send(s),
                ..
            }) = self.reqs.get_mut(&id)
            {
                s.posted = off;
            }
            if off >= total {
                break;
            }
        }
        let r = self.reqs.get_mut(&id).expect("request");
        if let ReqKind::Send(s) = &mut r.kind {
            s.wait = SendWait::Completions;
        }
        if r.outstanding == 0 && self.split_step(id) {
            self.finish(
                id,
                Ok(Completion {
                    len,
                    tag,
                    sender: None,
                }),
            );
        }
        Ok(true)
    }

    /// Post the reads of a rendezvous receive.
    fn stream_get(&mut self, rid: u64) -> Result<bool> {
        if matches!(&self.reqs[&rid].kind, ReqKind::Recv(rs) if rs.chunk_lane != usize::MAX) {
            return self.stream_chunks(rid);
        }
        let r = &self.reqs[&rid];
        let ReqKind::Recv(RecvState { rndv: Some(rv), .. }) = &r.kind else {
            return Ok(true);
        };
        let Some((lane, raddr, rkey, laddr)) = rv.get.clone() else {
            return Ok(true);
        };
        if !rv.via_get {
            return Ok(true);
        }
        let (p, want, sreq) = (rv.peer, rv.get_end, rv.sreq);
        let mut off = rv.posted;
        // GPU zero-copy lanes move the whole buffer in one operation; host lanes in fragments.
        let frag = if matches!(&r.kind, ReqKind::Recv(rs) if rs.mem.is_gpu()) {
            usize::MAX
        } else {
            self.frag
        };
        let max = self.slots[lane].attr.limits.get_max_zcopy.min(frag).max(1);
        let memh = r.guards[0].registration().clone();
        let f = Frags {
            put: false,
            local: laddr,
            remote: raddr,
            key: &rkey,
            memh: &memh,
            max,
            end: want,
        };
        let res = self.post_frags(rid, p, lane, &f, &mut off);
        if let Some(Req {
            kind:
                ReqKind::Recv(RecvState {
                    rndv: Some(rv),
                    received,
                    ..
                }),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rv.posted = off;
            *received = off;
        }
        match res {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(e @ Error::EndpointFailure { .. }) => return Err(e),
            Err(e) => {
                // Could not read: steer the sender to stream instead (no byte lost).
                tracing::warn!(
                    "rendezvous read failed to start ({e}); asking the sender to stream"
                );
                self.restart_as_stream(rid);
                return Ok(true);
            }
        }
        if self.reqs[&rid].outstanding == 0 {
            self.gets_finished(rid, p, sreq);
        }
        Ok(true)
    }

    /// The reads of a rendezvous receive are complete: tell the sender; finish unless the
    /// sender still writes the tail (split).
    fn gets_finished(&mut self, rid: u64, p: usize, sreq: u64) {
        self.send_ats(p, sreq);
        if let Some(Req {
            kind: ReqKind::Recv(RecvState { rndv: Some(rv), .. }),
            ..
        }) = self.reqs.get_mut(&rid)
            && rv.fin_pending
        {
            rv.gets_done = true;
            return;
        }
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.received = rs.total.min(rs.cap);
        }
        self.complete_recv(rid);
    }

    /// Streamed bytes of the tail of a split receive (the sender could not write it): copied in
    /// place, counted apart from the reads of the head; once the whole tail came it counts as
    /// the sender's finish. False when `rreq` is not a split receive (ordinary streaming).
    fn split_tail_data(&mut self, rreq: u64, offset: usize, data: &[u8]) -> bool {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get_mut(&rreq)
        else {
            return false;
        };
        let Some(rv) = rs.rndv.as_mut() else {
            return false;
        };
        if rv.get_end >= rv.want || !rv.fin_pending || rs.mem.is_gpu() {
            return false;
        }
        // Only the tail `get_end..want` is the sender's to stream; never past the buffer.
        let (lo, hi) = (rv.get_end, rv.want.min(rs.cap));
        let from = offset.max(lo);
        let to = offset.saturating_add(data.len()).min(hi);
        if from < to {
            // SAFETY: the receive buffer was lent mutably to the scope, which keeps it alive and
            // unaliased until the request is finished; `lo <= from < to <= cap`, and the reads
            // of the head write only below `get_end`.
            let dst = unsafe { host_slice_mut(rs.addr + from, to - from) };
            dst.copy_from_slice(&data[from - offset..to - offset]);
            rv.tail_got += to - from;
        }
        if rv.tail_got >= hi - lo {
            // The whole tail is here: as the finish message of a written tail.
            self.tail_landed(rreq);
        }
        true
    }

    /// The sender's part of a rendezvous receive has landed (its finish message, or the whole
    /// streamed tail of a split): complete the receive, or, for a split whose reads of the head
    /// are still running, let those complete it.
    fn tail_landed(&mut self, rreq: u64) {
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rreq)
        {
            if let Some(rv) = &mut rs.rndv
                && rv.fin_pending
            {
                rv.fin_pending = false;
                if !rv.gets_done {
                    return;
                }
            }
            rs.received = rs.total.min(rs.cap);
        }
        self.complete_recv(rreq);
    }

    /// One of the two halves of a split send is done; true when the send may finish.
    fn split_step(&mut self, id: u64) -> bool {
        match self.reqs.get_mut(&id) {
            Some(Req {
                kind: ReqKind::Send(s),
                ..
            }) if s.split_left > 0 => {
                s.split_left -= 1;
                s.split_left == 0
            }
            _ => true,
        }
    }

    fn send_ats(&mut self, p: usize, sreq: u64) {
        self.send_msg(
            p,
            &Msg::Ats {
                src: self.address.uuid,
                sreq,
                ok: true,
            },
        );
    }

    /// A read-based receive could not proceed: drop its registration and ask the sender to
    /// stream the whole message through active messages.
    fn restart_as_stream(&mut self, rid: u64) {
        let Some(r) = self.reqs.get_mut(&rid) else {
            return;
        };
        r.guards.clear();
        let ReqKind::Recv(rs) = &mut r.kind else {
            return;
        };
        rs.received = 0;
        let Some(rv) = &mut rs.rndv else { return };
        if rv.fin_pending || rv.gets_done {
            // The sender is writing the tail into our buffer: streaming the whole message now
            // could race with those writes. Fail rather than risk a mixed buffer.
            self.fail(
                rid,
                Error::Internal(
                    "the read half of a split rendezvous failed; the message is lost".into(),
                ),
            );
            return;
        }
        rv.via_get = false;
        rv.get = None;
        let (p, sreq) = (rv.peer, rv.sreq);
        self.send_rtr(p, sreq, rid, None);
    }

    /// Post the operations of a put, get or flush request.
    fn stream_rma(&mut self, id: u64) -> Result<bool> {
        let ReqKind::Rma(rm) = &self.reqs[&id].kind else {
            return Ok(true);
        };
        let (p, dir, len, lane, addr, remote, posted) = (
            rm.peer, rm.dir, rm.len, rm.lane, rm.addr, rm.remote, rm.posted,
        );
        if dir == RmaDir::Flush {
            while let Some(&l) = match &self.reqs[&id].kind {
                ReqKind::Rma(rm) => rm.flush_lanes.last(),
                _ => None,
            } {
                if !self.post_counted(id, p, l, |ep, t| ep.flush(t))? {
                    return Ok(false);
                }
                if let Some(Req {
                    kind: ReqKind::Rma(rm),
                    ..
                }) = self.reqs.get_mut(&id)
                {
                    rm.flush_lanes.pop();
                }
            }
        } else {
            let key = match &self.reqs[&id].kind {
                ReqKind::Rma(rm) => rm.key.clone().expect("rma key"),
                _ => unreachable!("rma request"),
            };
            let memh = self.reqs[&id].guards[0].registration().clone();
            let lim = &self.slots[lane].attr.limits;
            let max = if dir == RmaDir::Put {
                lim.put_max_zcopy
            } else {
                lim.get_max_zcopy
            }
            .min(self.frag)
            .max(1);
            let mut off = posted;
            let f = Frags {
                put: dir == RmaDir::Put,
                local: addr,
                remote,
                key: &key,
                memh: &memh,
                max,
                end: len,
            };
            let res = self.post_frags(id, p, lane, &f, &mut off);
            if let Some(Req {
                kind: ReqKind::Rma(rm),
                ..
            }) = self.reqs.get_mut(&id)
            {
                rm.posted = off;
            }
            if !res? {
                return Ok(false);
            }
        }
        if let Some(Req {
            kind: ReqKind::Rma(rm),
            ..
        }) = self.reqs.get_mut(&id)
        {
            rm.posted = usize::MAX;
        }
        if self.reqs[&id].outstanding == 0 {
            self.finish(
                id,
                Ok(Completion {
                    len,
                    tag: 0,
                    sender: None,
                }),
            );
        }
        Ok(true)
    }

    /// Post the zero-copy fragments of `f` from `*off` to `f.end` on `lane`, at most `f.max`
    /// bytes each, advancing `*off` past every posted one; `Ok(false)`: the transport pushed
    /// back (resume from `*off`).
    fn post_frags(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        f: &Frags<'_>,
        off: &mut usize,
    ) -> Result<bool> {
        while *off < f.end {
            let n = f.max.min(f.end - *off);
            let iov = [Iov {
                addr: f.local + *off,
                len: n,
                memh: f.memh,
            }];
            let at = f.remote + *off as u64;
            let posted = self.post_counted(id, p, lane, |ep, t| {
                if f.put {
                    ep.put_zcopy(&iov, at, f.key, t)
                } else {
                    ep.get_zcopy(&iov, at, f.key, t)
                }
            })?;
            if !posted {
                return Ok(false);
            }
            *off += n;
        }
        Ok(true)
    }

    #[allow(clippy::too_many_arguments)]
    fn stream_put(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        addr: usize,
        len: usize,
        raddr: u64,
        rkey: &RemoteKey,
    ) -> Result<bool> {
        let max = self.slots[lane]
            .attr
            .limits
            .put_max_zcopy
            .min(self.frag)
            .max(1);
        let memh = self.reqs[&id].guards[0].registration().clone();
        let mut off = match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.posted,
            _ => 0,
        };
        let f = Frags {
            put: true,
            local: addr,
            remote: raddr,
            key: rkey,
            memh: &memh,
            max,
            end: len,
        };
        let res = self.post_frags(id, p, lane, &f, &mut off);
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.posted = off;
        }
        if !res? {
            return Ok(false);
        }
        // Make the writes visible before telling the receiver.
        if !self.post_counted(id, p, lane, |ep, t| ep.flush(t))? {
            return Ok(false);
        }
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.wait = SendWait::Completions;
        }
        if self.reqs[&id].outstanding == 0 {
            self.put_done(id);
        }
        Ok(true)
    }

    /// All writes of a put rendezvous are complete: tell the receiver, finish the send.
    fn put_done(&mut self, id: u64) {
        let (p, len, tag, rreq) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.peer, s.len, s.tag, s.rndv_to.unwrap_or(0)),
            _ => return,
        };
        self.send_msg(
            p,
            &Msg::Fin {
                src: self.address.uuid,
                rreq,
            },
        );
        if !self.split_step(id) {
            return;
        }
        self.finish(
            id,
            Ok(Completion {
                len,
                tag,
                sender: None,
            }),
        );
    }

    // ----- receive side -----

    fn on_event(&mut self, _iface: usize, ev: Event<'_>) {
        match ev {
            Event::Am { id, data } => {
                if let Err(e) = self.on_am(id, data) {
                    tracing::warn!("dropped a malformed or unexpected protocol message: {e}");
                }
            }
            Event::Completion { token, result } => {
                let Some(tok) = self.tokens.remove(&token) else {
                    return;
                };
                self.on_tok(tok, result);
            }
            Event::EpError { user_id, error } => {
                self.fail_peer(user_id as usize, &error.to_string());
            }
        }
    }

    fn on_completion(&mut self, id: u64, result: Result<()>) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        r.outstanding = r.outstanding.saturating_sub(1);
        if let Err(e) = result {
            // A failed read: fall back to streaming (not one byte lost).
            if let ReqKind::Recv(RecvState { rndv: Some(rv), .. }) = &r.kind
                && rv.via_get
                && !matches!(e, Error::EndpointFailure { .. })
            {
                tracing::warn!("rendezvous read failed ({e}); asking the sender to stream instead");
                self.restart_as_stream(id);
                return;
            }
            self.fail(id, e);
            return;
        }
        if r.outstanding > 0 || r.result.is_some() {
            return;
        }
        match &r.kind {
            ReqKind::Send(s) if s.wait == SendWait::Completions => {
                let (len, tag) = (s.len, s.tag);
                if s.put.is_some() {
                    self.put_done(id);
                } else if self.split_step(id) {
                    self.finish(
                        id,
                        Ok(Completion {
                            len,
                            tag,
                            sender: None,
                        }),
                    );
                }
            }
            ReqKind::Recv(RecvState { rndv: Some(rv), .. })
                if rv.via_get && rv.posted >= rv.get_end && !rv.gets_done =>
            {
                let (peer, sreq) = (rv.peer, rv.sreq);
                self.gets_finished(id, peer, sreq);
            }
            ReqKind::Rma(rm) if rm.posted == usize::MAX => {
                let len = rm.len;
                self.finish(
                    id,
                    Ok(Completion {
                        len,
                        tag: 0,
                        sender: None,
                    }),
                );
            }
            _ => {}
        }
    }

    fn src_peer(&self, src: u64) -> Result<usize> {
        // Messages come in runs from one peer: remember the last one (uuids are never 0).
        let (last, p) = self.last_src.get();
        if last == src
            && let Some(peer) = self.peers.get(p)
        {
            peer.live.heard.set(true);
            return Ok(p);
        }
        let p = self.by_uuid.get(&src).copied().ok_or_else(|| {
            Error::InvalidAddress(format!(
                "message from unknown worker {src:#x} (no wire-up yet)"
            ))
        })?;
        self.last_src.set((src, p));
        self.peers[p].live.heard.set(true);
        Ok(p)
    }

    /// A whole tagged message in one packet (eager short or single-fragment copy-in).
    fn on_eager_one(&mut self, src: u64, tag: Tag, data: &[u8], sync: Option<u64>) -> Result<()> {
        let p = self.src_peer(src)?;
        let queued = || Unexp::Eager {
            src: p,
            msg_id: None,
            total: data.len(),
            data: Vec::new(),
            sync,
        };
        match self.matcher.arrive_with(tag, queued) {
            Some(rid) => {
                self.deliver_whole(rid, p, tag, data);
                if let Some(sreq) = sync {
                    self.send_ats(p, sreq);
                    self.pump(p);
                }
            }
            None => {
                // Store the data in the queued entry.
                if let Some(Unexp::Eager { data: d, .. }) = self.matcher.unexpected_mut().last() {
                    d.extend_from_slice(data);
                }
            }
        }
        Ok(())
    }

    fn on_am(&mut self, id: AmId, data: &[u8]) -> Result<()> {
        // The most frequent message, decoded in place (`wire::parse` reads the same layout).
        if id == wire::AM_EAGER_SHORT
            && let Some((tag, rest)) = data.split_first_chunk::<8>()
            && let Some((src, payload)) = rest.split_first_chunk::<8>()
        {
            return self.on_eager_one(
                u64::from_le_bytes(*src),
                u64::from_le_bytes(*tag),
                payload,
                None,
            );
        }
        match wire::parse(id, data)? {
            Msg::Wireup { addr } => {
                let remote = WorkerAddress::unpack(addr)?;
                let p = self.peer_for(remote)?;
                self.peers[p].live.heard.set(true);
            }
            Msg::EagerOne { src, tag, data } => self.on_eager_one(src, tag, data, None)?,
            Msg::StreamData { src, data } => {
                let p = self.src_peer(src)?;
                let (reqs, peer) = (&mut self.reqs, &mut self.peers[p]);
                peer.stream_rx
                    .arrive(&mut StreamReqs { reqs, peer: p }, data);
            }
            Msg::EagerSync {
                src,
                tag,
                sreq,
                data,
            } => self.on_eager_one(src, tag, data, Some(sreq))?,
            Msg::EagerFirst {
                src,
                kind,
                tag,
                msg_id,
                total,
                data,
            } => {
                let p = self.src_peer(src)?;
                let total = total as usize;
                if kind == MsgKind::Am {
                    let mut d = Vec::with_capacity(total);
                    d.extend_from_slice(data);
                    let dest = RxDest::UserAm {
                        id: tag as u16,
                        total,
                        data: d,
                    };
                    self.rx.insert((src, msg_id), dest);
                    self.maybe_finish_user_am(src, msg_id, p);
                    return Ok(());
                }
                let u = Unexp::Eager {
                    src: p,
                    msg_id: Some(msg_id),
                    total,
                    data: Vec::new(),
                    sync: None,
                };
                match self.matcher.arrive(tag, u) {
                    Some((rid, _)) => {
                        self.rx.insert((src, msg_id), RxDest::Req(rid));
                        self.recv_begin(rid, p, tag, total);
                        self.recv_data(rid, 0, data);
                        if self.recv_complete(rid) {
                            self.rx.remove(&(src, msg_id));
                        }
                    }
                    None => {
                        if let Some(Unexp::Eager { data: d, .. }) =
                            self.matcher.unexpected_mut().last()
                        {
                            d.reserve(total);
                            d.extend_from_slice(data);
                        }
                        self.rx.insert((src, msg_id), RxDest::Unexpected);
                    }
                }
            }
            Msg::EagerMiddle {
                src,
                msg_id,
                offset,
                data,
            } => {
                let p = self.src_peer(src)?;
                let key = (src, msg_id);
                match self.rx.get_mut(&key) {
                    Some(RxDest::Req(rid)) => {
                        let rid = *rid;
                        self.recv_data(rid, offset as usize, data);
                        if self.recv_complete(rid) {
                            self.rx.remove(&key);
                        }
                    }
                    Some(RxDest::Unexpected) => {
                        let mut done = false;
                        for u in self.matcher.unexpected_mut() {
                            if let Unexp::Eager {
                                src: s,
                                msg_id: Some(m),
                                total,
                                data: d,
                                ..
                            } = u
                                && *s == p
                                && *m == msg_id
                            {
                                if d.len() == offset as usize {
                                    d.extend_from_slice(data);
                                }
                                done = d.len() >= *total;
                                break;
                            }
                        }
                        if done {
                            self.rx.remove(&key);
                        }
                    }
                    Some(RxDest::UserAm { data: d, .. }) => {
                        if d.len() == offset as usize {
                            d.extend_from_slice(data);
                        }
                        self.maybe_finish_user_am(src, msg_id, p);
                    }
                    None => {
                        return Err(Error::InvalidAddress(format!(
                            "fragment of unknown message {msg_id}"
                        )));
                    }
                }
            }
            Msg::Rts {
                src,
                tag,
                sreq,
                size,
                addr,
                smem,
                keys,
            } => {
                let p = self.src_peer(src)?;
                let u = Unexp::Rts {
                    src: p,
                    sreq,
                    size: size as usize,
                    addr,
                    smem,
                    keys,
                };
                if let Some((rid, u)) = self.matcher.arrive(tag, u) {
                    self.matched(rid, tag, u);
                }
            }
            Msg::Ats { src, sreq, ok } => {
                let p = self.src_peer(src)?;
                if let Some(Req {
                    kind: ReqKind::Send(s),
                    ..
                }) = self.reqs.get(&sreq)
                {
                    let (len, tag) = (s.len, s.tag);
                    if ok && !self.split_step(sreq) {
                        return Ok(());
                    }
                    let res = if ok {
                        Ok(Completion {
                            len,
                            tag,
                            sender: None,
                        })
                    } else {
                        Err(Error::PeerAborted {
                            peer: self.peers[p].remote.describe(),
                            reason: "the receiver gave the rendezvous up".into(),
                        })
                    };
                    self.finish(sreq, res);
                }
            }
            Msg::Rtr {
                src,
                sreq,
                rreq,
                addr,
                size,
                offset,
                keys,
            } => {
                let p = self.src_peer(src)?;
                self.on_rtr(p, sreq, rreq, addr, size as usize, offset as usize, keys);
            }
            Msg::RndvData {
                src,
                rreq,
                offset,
                data,
            } => {
                let _ = self.src_peer(src)?;
                if !self.split_tail_data(rreq, offset as usize, data) {
                    self.recv_data(rreq, offset as usize, data);
                    self.recv_complete(rreq);
                }
            }
            Msg::Fin { src, rreq } => {
                let _ = self.src_peer(src)?;
                self.tail_landed(rreq);
            }
            Msg::Abort {
                src,
                sreq,
                rreq,
                by_sender,
                reason,
            } => {
                let p = self.src_peer(src)?;
                self.on_abort(p, sreq, rreq, by_sender, reason);
            }
            Msg::Pull { src, sreq, rreq } => {
                let p = self.src_peer(src)?;
                self.on_pull(p, sreq, rreq);
            }
            Msg::Frag {
                src,
                rreq,
                sreq,
                offset,
                len,
                addr,
                frag,
                key,
            } => {
                let p = self.src_peer(src)?;
                self.on_frag(
                    p,
                    rreq,
                    sreq,
                    offset as usize,
                    len as usize,
                    addr,
                    frag,
                    key,
                );
            }
            Msg::FragAck {
                src,
                sreq,
                frag,
                len,
            } => {
                let _ = self.src_peer(src)?;
                self.on_frag_ack(sreq, frag as usize, len as usize);
            }
            Msg::Keepalive { src, reply } => {
                // Any message shows the peer alive; a probe is answered.
                let p = self.src_peer(src)?;
                if !reply {
                    self.send_keepalive(p, true);
                }
            }
            Msg::User {
                src,
                id,
                header,
                data,
            } => {
                let p = self.src_peer(src)?;
                self.am_inbox.push(AmMessage {
                    id,
                    header: header.to_vec(),
                    data: data.to_vec(),
                    reply_ep: EpId(p),
                });
            }
        }
        Ok(())
    }

    fn maybe_finish_user_am(&mut self, src: u64, msg_id: u64, p: usize) {
        let key = (src, msg_id);
        let done = matches!(self.rx.get(&key), Some(RxDest::UserAm { total, data, .. }) if data.len() >= *total);
        if done && let Some(RxDest::UserAm { id, data, .. }) = self.rx.remove(&key) {
            let mut r = rucx_uct::rkey::Reader::new(&data, "active message");
            match r.lv() {
                Ok(h) => {
                    let hl = h.len();
                    self.am_inbox.push(AmMessage {
                        id,
                        header: h.to_vec(),
                        data: data[2 + hl..].to_vec(),
                        reply_ep: EpId(p),
                    });
                }
                Err(e) => tracing::warn!("malformed active message dropped: {e}"),
            }
        }
    }

    /// A receive matched a message (posted late, or arrived late).
    fn matched(&mut self, rid: u64, tag: Tag, u: Unexp) {
        match u {
            Unexp::Eager {
                src,
                msg_id,
                total,
                data,
                sync,
            } => {
                self.recv_begin(rid, src, tag, total);
                self.recv_data(rid, 0, &data);
                let complete = self.recv_complete(rid);
                if let Some(sreq) = sync {
                    // A synchronous send completes now that it is matched.
                    self.send_ats(src, sreq);
                    self.pump(src);
                }
                if let Some(m) = msg_id {
                    let key = (self.peers[src].remote.uuid, m);
                    if complete {
                        self.rx.remove(&key);
                    } else {
                        self.rx.insert(key, RxDest::Req(rid));
                    }
                }
            }
            Unexp::Rts {
                src,
                sreq,
                size,
                addr,
                smem,
                keys,
            } => {
                self.recv_begin(rid, src, tag, size);
                let smem_gpu = smem == wire::mem_code(MemoryType::Cuda)
                    || smem == wire::mem_code(MemoryType::CudaManaged);
                let rgpu = matches!(&self.reqs[&rid].kind, ReqKind::Recv(rs) if rs.mem.is_gpu());
                if smem_gpu || rgpu {
                    self.rndv_recv_gpu(rid, src, sreq, size, addr, smem_gpu, keys);
                } else {
                    self.rndv_recv(rid, src, sreq, size, addr, keys);
                }
            }
        }
    }

    /// A whole eager message matched a posted receive: copy it and finish the receive with one
    /// lookup of the request (the common small-message path).
    fn deliver_whole(&mut self, rid: u64, src: usize, tag: Tag, data: &[u8]) {
        let gpu = match self.reqs.get_mut(&rid) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result,
                ..
            }) if result.is_none() => {
                rs.sender = Some(src);
                rs.tag = tag;
                rs.total = data.len();
                if rs.mem.is_gpu() {
                    true
                } else {
                    let n = data.len().min(rs.cap);
                    // SAFETY: the receive buffer was lent mutably to the scope, which keeps it
                    // alive and unaliased until the request is finished; `n <= cap`.
                    let dst = unsafe { host_slice_mut(rs.addr, n) };
                    dst.copy_from_slice(&data[..n]);
                    rs.received = data.len();
                    *result = Some(if data.len() > rs.cap {
                        Err(Error::Truncated {
                            incoming: data.len(),
                            capacity: rs.cap,
                        })
                    } else {
                        Ok(Completion {
                            len: data.len(),
                            tag,
                            sender: Some(EpId(src)),
                        })
                    });
                    false
                }
            }
            _ => return,
        };
        if gpu {
            self.recv_data(rid, 0, data);
            self.recv_complete(rid);
        }
    }

    fn recv_begin(&mut self, rid: u64, src: usize, tag: Tag, total: usize) {
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.sender = Some(src);
            rs.tag = tag;
            rs.total = total;
        }
    }

    /// Copy arrived bytes into a receive buffer, never past its capacity.
    fn recv_data(&mut self, rid: u64, offset: usize, data: &[u8]) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        else {
            return;
        };
        if offset < rs.cap {
            let n = data.len().min(rs.cap - offset);
            if rs.mem.is_gpu() {
                rs.received += data.len();
                if let Err(e) = self.copy_to_gpu(rid, offset, &data[..n]) {
                    self.fail(rid, e);
                }
                return;
            }
            // SAFETY: the receive buffer was lent mutably to the scope, which keeps it alive
            // and unaliased until the request is finished; `offset + n <= cap`.
            let dst = unsafe { host_slice_mut(rs.addr + offset, n) };
            dst.copy_from_slice(&data[..n]);
        }
        rs.received += data.len();
    }

    /// Finish the receive if every byte arrived. Returns true when finished.
    fn recv_complete(&mut self, rid: u64) -> bool {
        let done = match self.reqs.get(&rid) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => {
                let want = rs.rndv.as_ref().map_or(rs.total, |r| r.want);
                rs.received >= want
            }
            _ => false,
        };
        if done {
            self.complete_recv(rid);
        }
        done
    }

    fn complete_recv(&mut self, rid: u64) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get(&rid)
        else {
            return;
        };
        let res = if rs.total > rs.cap {
            Err(Error::Truncated {
                incoming: rs.total,
                capacity: rs.cap,
            })
        } else {
            Ok(Completion {
                len: rs.total,
                tag: rs.tag,
                sender: rs.sender.map(EpId),
            })
        };
        self.finish(rid, res);
    }

    /// Start the data phase of a matched rendezvous.
    fn rndv_recv(
        &mut self,
        rid: u64,
        p: usize,
        sreq: u64,
        size: usize,
        addr: u64,
        keys: Vec<NamedKey>,
    ) {
        let (raddr, cap) = match &self.reqs[&rid].kind {
            ReqKind::Recv(rs) => (rs.addr, rs.cap),
            _ => return,
        };
        let want = size.min(cap);
        let wants_put = keys.iter().any(|k| k.md == PUT_HINT);
        let keys: Vec<NamedKey> = keys.into_iter().filter(|k| k.md != PUT_HINT).collect();
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.rndv = Some(Box::new(RndvRecv::new(p, sreq, want)));
        }
        if self.peers[p].failed.is_some() {
            let reason = self.peers[p].failed.clone().unwrap_or_default();
            self.finish(
                rid,
                Err(Error::EndpointFailure {
                    peer: self.peers[p].remote.describe(),
                    reason,
                }),
            );
            return;
        }
        if want == 0 {
            self.send_ats(p, sreq);
            self.complete_recv(rid);
            self.pump(p);
            return;
        }
        self.refresh_plan(p);
        let steps = plan::recv_steps(&self.peers[p].plan, MemoryType::Host, MemKey::HOST);
        let get_lane = steps.iter().find_map(|s| match s {
            RecvStep::Get { lane } => Some(*lane),
            _ => None,
        });
        let put_lane = steps.iter().find_map(|s| match s {
            RecvStep::Put { lane } => Some(*lane),
            _ => None,
        });
        let split_thresh = self.peers[p].plan.split_thresh;
        let region = MemRegion::host(raddr, want);
        // Get: the sender offered a key of the lane's domain (both sides share it), and we can
        // register.
        if !wants_put
            && let Some(lane) = get_lane
            && let Some(k) = keys
                .iter()
                .find(|k| k.md == self.ctx.domain(self.slots[lane].md).name())
        {
            let md = self.slots[lane].md;
            if self.ctx.can_register(md, MemoryType::Host, None) {
                match self.ctx.register(md, region) {
                    Ok(g) => match self.ctx.domain(md).rkey_unpack(&k.key) {
                        Ok(rkey) => {
                            // Large messages: read the head while the sender writes the tail,
                            // so both sides' cores copy.
                            let split_at = (want / 2) & !4095;
                            let split_key = if want >= split_thresh
                                && split_at > 0
                                && self.slots[lane].attr.has(IfaceCaps::PUT_ZCOPY)
                            {
                                self.ctx.domain(md).mkey_pack(g.registration()).ok()
                            } else {
                                None
                            };
                            let r = self.reqs.get_mut(&rid).expect("req");
                            r.guards.push(g);
                            if let ReqKind::Recv(RecvState { rndv: Some(rv), .. }) = &mut r.kind {
                                rv.via_get = true;
                                rv.get = Some((lane, addr, rkey, raddr));
                                if split_key.is_some() {
                                    rv.get_end = split_at;
                                    rv.fin_pending = true;
                                }
                            }
                            if let Some(k) = split_key {
                                let key = NamedKey {
                                    md: self.ctx.domain(md).name().to_string(),
                                    key: k,
                                };
                                self.send_rtr(p, sreq, rid, Some((raddr as u64, split_at, key)));
                                self.count(
                                    "rendezvous receive split: read head, remote writes tail",
                                );
                            } else {
                                self.count("rendezvous receive by read");
                            }
                            self.peers[p].queue.push_back(Pending::Stream(rid));
                            self.pump(p);
                            return;
                        }
                        Err(e) => {
                            tracing::warn!("sender's key did not unpack ({e}); streaming instead")
                        }
                    },
                    Err(e) => tracing::debug!(
                        "receive registration failed ({e}); steering the sender to stream"
                    ),
                }
            }
        }
        // Put: register our buffer and hand the sender a key.
        if wants_put && let Some(lane) = put_lane {
            let md = self.slots[lane].md;
            if self.ctx.can_register(md, MemoryType::Host, None) {
                match self.ctx.register(md, region) {
                    Ok(g) => match self.ctx.domain(md).mkey_pack(g.registration()) {
                        Ok(k) => {
                            self.reqs.get_mut(&rid).expect("req").guards.push(g);
                            let key = NamedKey {
                                md: self.ctx.domain(md).name().to_string(),
                                key: k,
                            };
                            self.count("rendezvous receive by remote write");
                            self.send_rtr(p, sreq, rid, Some((raddr as u64, 0, key)));
                            self.pump(p);
                            return;
                        }
                        Err(e) => tracing::warn!("packing our key failed ({e}); streaming instead"),
                    },
                    Err(e) => tracing::debug!(
                        "receive registration failed ({e}); steering the sender to stream"
                    ),
                }
            }
        }
        self.send_rtr(p, sreq, rid, None);
        self.pump(p);
    }

    fn send_rtr(&mut self, p: usize, sreq: u64, rreq: u64, put: Option<(u64, usize, NamedKey)>) {
        if put.is_none() {
            self.count("rendezvous receive streamed");
        }
        let want = match &self.reqs.get(&rreq).map(|r| &r.kind) {
            Some(ReqKind::Recv(RecvState { rndv: Some(rv), .. })) => rv.want,
            _ => 0,
        };
        let (addr, offset, keys) = match put {
            Some((a, off, k)) => (a, off as u64, vec![k]),
            None => (0, 0, Vec::new()),
        };
        self.send_msg(
            p,
            &Msg::Rtr {
                src: self.address.uuid,
                sreq,
                rreq,
                addr,
                size: want as u64,
                offset,
                keys,
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn on_rtr(
        &mut self,
        p: usize,
        sreq: u64,
        rreq: u64,
        addr: u64,
        size: usize,
        offset: usize,
        keys: Vec<NamedKey>,
    ) {
        let Some(Req {
            kind: ReqKind::Send(s),
            result: None,
            ..
        }) = self.reqs.get_mut(&sreq)
        else {
            self.answer_for_gone_send(p, sreq, rreq);
            return;
        };
        if s.mem.is_gpu() {
            s.rndv_to = Some(rreq);
            let e = Error::Unsupported {
                what: "streaming GPU memory through active messages".into(),
                why: "the receiver asked for a streamed rendezvous; GPU buffers need the staged \
                      pipeline, which needs a transport with remote memory access (posix or tcp) \
                      and cuda_copy in RUCX_TLS on both sides"
                    .into(),
            };
            self.fail(sreq, e);
            return;
        }
        s.rndv_to = Some(rreq);
        s.len = s.len.min(size);
        s.posted = 0;
        s.wait = SendWait::Posting;
        // Split: the receiver reads the head itself; we write the tail.
        let split = !keys.is_empty() && offset > 0 && offset < s.len;
        // Put: the receiver gave us its key; write with our own registration, through a lane
        // of the key's domain (our RMA lane may have moved to another since the RTS: a
        // demotion).
        let key_lane = |st: &Self, md: &str| {
            st.peers[p]
                .rma
                .into_iter()
                .chain(st.peers[p].eps.keys().copied())
                .find(|&l| {
                    st.ctx.domain(st.slots[l].md).name() == md
                        && st.slots[l].attr.has(IfaceCaps::PUT_ZCOPY)
                })
        };
        if let Some(k) = keys.first()
            && let Some(lane) = key_lane(self, &k.md)
        {
            let md = self.slots[lane].md;
            let unpacked = self.ctx.domain(md).rkey_unpack(&k.key);
            let have_reg = self.reqs[&sreq]
                .guards
                .iter()
                .any(|g| g.registration().domain() == self.ctx.domain(md).name());
            let reg_ok = have_reg || self.register_send(sreq, lane).is_ok();
            match (unpacked, reg_ok) {
                (Ok(rkey), true) => {
                    if let Some(Req {
                        kind: ReqKind::Send(s),
                        ..
                    }) = self.reqs.get_mut(&sreq)
                    {
                        s.put = Some((addr, rkey, lane));
                        if split {
                            s.posted = offset;
                            s.split_left = 2;
                        }
                    }
                }
                (Err(e), _) => {
                    tracing::warn!("receiver's key did not unpack ({e}); streaming instead")
                }
                (_, false) => {
                    self.refresh_plan(p);
                    tracing::debug!("send registration failed; streaming the rendezvous instead");
                }
            }
        }
        // Streaming through active messages: zero-copy from a registration when we have one on
        // the AM lane's domain, copy-in otherwise.
        let am_md = self.slots[self.peers[p].am].md;
        let put = matches!(&self.reqs[&sreq].kind, ReqKind::Send(s) if s.put.is_some());
        if !put && split {
            // The receiver reads the head from our registration while we could not write the
            // tail: stream the tail (copied in), keep every registration until its reads are
            // done, and finish after both (the receiver counts the tail's bytes).
            if let Some(Req {
                kind: ReqKind::Send(s),
                ..
            }) = self.reqs.get_mut(&sreq)
            {
                s.posted = offset;
                s.split_left = 2;
            }
            self.count("rendezvous split: tail streamed (no remote write)");
        } else if !put {
            let am = self.peers[p].am;
            let zc = self.slots[am].attr.has(IfaceCaps::AM_ZCOPY)
                && self.slots[am].attr.limits.am_max_hdr >= proto::FIRST_OVERHEAD;
            let am_name = self.ctx.domain(am_md).name().to_string();
            let r = self.reqs.get_mut(&sreq).expect("req");
            r.guards.retain(|g| g.registration().domain() == am_name);
            if zc && r.guards.is_empty() && self.ctx.can_register(am_md, MemoryType::Host, None) {
                if let Err(e) = self.register_send(sreq, am) {
                    tracing::debug!("streaming with copies: {e}");
                }
            } else if !zc {
                r.guards.clear();
            }
        }
        self.peers[p].queue.push_back(Pending::Stream(sreq));
        self.pump(p);
    }

    // ----- RMA -----

    fn post_rma(
        &mut self,
        p: usize,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Result<u64> {
        self.check_peer(p)?;
        self.refresh_plan(p);
        let t = self.peers[p]
            .plan
            .table(if put { Op::Put } else { Op::Get }, MemKey::HOST);
        if t.rows.is_empty() {
            return Err(t.refusal(&self.peers[p].remote.describe()));
        }
        let lane = self.peers[p]
            .rma
            .ok_or_else(|| t.refusal(&self.peers[p].remote.describe()))?;
        let md = self.slots[lane].md;
        let mdname = self.ctx.domain(md).name().to_string();
        let key = rkey
            .keys
            .iter()
            .find(|(n, _)| *n == mdname)
            .map(|(_, k)| k.clone())
            .ok_or_else(|| Error::InvalidRkey {
                domain: mdname.clone(),
                reason: "the remote key bundle has no key for the transport to this peer".into(),
            })?;
        // The region the peer mapped, not only the domain's key: a registration is aligned out
        // to whole pages (and the registration cache may merge it with its neighbours), so the
        // key alone lets an access run past the mapped buffer.
        rkey.check(remote, len as u64)?;
        key.check(remote, len as u64)?;
        let g = if len > 0 {
            Some(self.ctx.register(md, MemRegion::host(addr, len))?)
        } else {
            None
        };
        let id = self.new_req(ReqKind::Rma(RmaState {
            peer: p,
            dir: if put { RmaDir::Put } else { RmaDir::Get },
            len,
            lane,
            addr,
            remote,
            key: Some(key),
            posted: 0,
            flush_lanes: Vec::new(),
        }));
        if let Some(g) = g {
            self.reqs.get_mut(&id).expect("req").guards.push(g);
        } else {
            self.finish(
                id,
                Ok(Completion {
                    len: 0,
                    tag: 0,
                    sender: None,
                }),
            );
            return Ok(id);
        }
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
        Ok(id)
    }

    fn post_flush(&mut self, p: usize) -> Result<u64> {
        self.check_peer(p)?;
        let lanes: Vec<usize> = self.peers[p].eps.keys().copied().collect();
        let id = self.new_req(ReqKind::Rma(RmaState {
            peer: p,
            dir: RmaDir::Flush,
            len: 0,
            lane: 0,
            addr: 0,
            remote: 0,
            key: None,
            posted: 0,
            flush_lanes: lanes,
        }));
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
        Ok(id)
    }

    // ----- failures -----

    fn fail_peer(&mut self, p: usize, reason: &str) {
        let Some(peer) = self.peers.get_mut(p) else {
            return;
        };
        if peer.failed.is_some() {
            return;
        }
        tracing::warn!(
            "endpoint ep{p} to {} failed: {reason}",
            peer.remote.describe()
        );
        peer.failed = Some(reason.to_string());
        peer.queue.clear();
        peer.stream_rx.clear();
        let desc = peer.remote.describe();
        let uuid = peer.remote.uuid;
        let err = || Error::EndpointFailure {
            peer: desc.clone(),
            reason: reason.to_string(),
        };
        let ids: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.result.is_none())
            .filter(|(_, r)| match &r.kind {
                ReqKind::Send(s) => s.peer == p,
                ReqKind::Recv(rs) => rs.sender == Some(p),
                ReqKind::Rma(rm) => rm.peer == p,
            })
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            self.finish(id, Err(err()));
        }
        // Partial unexpected messages from it can never complete.
        self.matcher.drop_unexpected(|u| match u {
            Unexp::Eager {
                src, total, data, ..
            } => *src == p && data.len() < *total,
            Unexp::Rts { src, .. } => *src == p,
        });
        self.rx.retain(|(s, _), _| *s != uuid);
    }
}

/// Stream receives of peer `peer` as the stream protocol fills them.
struct StreamReqs<'a> {
    reqs: &'a mut Slab<Req>,
    peer: usize,
}

impl StreamRecvs for StreamReqs<'_> {
    fn room(&mut self, id: u64) -> Option<&mut [u8]> {
        match self.reqs.get(&id) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => {
                // SAFETY: the receive buffer was lent mutably to the scope, which keeps it alive
                // and unaliased until the request is finished; `received <= cap`, and the slice
                // lives only while the stream protocol copies into it.
                Some(unsafe { host_slice_mut(rs.addr + rs.received, rs.cap - rs.received) })
            }
            _ => None,
        }
    }

    fn filled(&mut self, id: u64, n: usize, full: bool) {
        if let Some(r) = self.reqs.get_mut(&id)
            && let ReqKind::Recv(rs) = &mut r.kind
        {
            rs.received += n;
            if full && r.result.is_none() {
                r.result = Some(Ok(Completion {
                    len: rs.cap,
                    tag: 0,
                    sender: Some(EpId(self.peer)),
                }));
                r.guards.clear();
            }
        }
    }

    fn cancel(&mut self, id: u64) -> Vec<u8> {
        let Some(r) = self.reqs.get_mut(&id) else {
            return Vec::new();
        };
        let taken = match &r.kind {
            ReqKind::Recv(rs) if r.result.is_none() => {
                // SAFETY: the receive buffer is still lent to the scope (the request is not
                // finished); its first `received <= cap` bytes were written by the stream
                // protocol.
                unsafe { host_slice(rs.addr, rs.received) }.to_vec()
            }
            _ => Vec::new(),
        };
        if r.result.is_none() {
            r.result = Some(Err(Error::Canceled));
            r.guards.clear();
        }
        taken
    }
}

/// Marker key name that asks the receiver to hand out its key (put rendezvous).
const PUT_HINT: &str = "*put";

/// The peer of a send request.
fn p_of(r: &Req) -> usize {
    match &r.kind {
        ReqKind::Send(s) => s.peer,
        ReqKind::Recv(rs) => rs.rndv.as_ref().map_or(0, |v| v.peer),
        ReqKind::Rma(rm) => rm.peer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn self_worker() -> Worker {
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", "self")]).unwrap();
        let ctx = Context::new(&rucx_transports::registry(), cfg).unwrap();
        Worker::new(&ctx).unwrap()
    }

    /// A request that failed after it was posted reports the very error it finished with, of
    /// any kind, every time it is looked at (errors used to be rebuilt by hand, and the kinds
    /// not listed came back as `Internal`).
    #[test]
    fn a_failed_request_reports_its_own_error() {
        let w = self_worker();
        let errors = [
            Error::io("writing to the peer", std::io::Error::from_raw_os_error(32)),
            Error::Device {
                device: "GPU 0 (0000:19:00.0)".into(),
                reason: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            },
            Error::OutOfBounds {
                addr: 0x2000,
                len: 64,
                base: 0x1000,
                region_len: 4096,
            },
            Error::NoMemory("staging buffer of 4 MiB".into()),
            Error::Timeout {
                after: Duration::from_millis(5),
                what: "the receiver's answer".into(),
            },
        ];
        for e in errors {
            let id = {
                let mut st = w.st.borrow_mut();
                let id = st.new_req(ReqKind::Rma(RmaState {
                    peer: 0,
                    dir: RmaDir::Flush,
                    len: 0,
                    lane: 0,
                    addr: 0,
                    remote: 0,
                    key: None,
                    posted: 0,
                    flush_lanes: Vec::new(),
                }));
                st.finish(id, Err(e.clone()));
                id
            };
            assert_eq!(w.req_result(id), Some(Err(e.clone())));
            assert_eq!(w.req_result(id), Some(Err(e.clone())), "looked at twice");
            assert_eq!(w.wait_req(id, None), Err(e.clone()));
            assert_eq!(w.wait_req(id, None).unwrap_err().to_string(), e.to_string());
            w.st.borrow_mut().reqs.remove(&id);
        }
        assert_eq!(w.live_requests(), 0);
    }
}
