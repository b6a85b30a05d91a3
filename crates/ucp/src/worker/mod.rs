//! Workers: the public API, the progress loop, peers and requests. The protocols that move the
//! data are in [`crate::proto`]; the worker reads an endpoint's plan ([`crate::plan`]) and hands
//! each request to the protocol it names.
//!
//! - `state.rs`: the state (peers, requests, tokens) and the bookkeeping every protocol shares;
//! - `post.rs`: posting requests for [`Scope`](crate::Scope), waiting, ending scopes;
//! - `peers.rs`: wire-up, lanes, (re-)planning, peer failure;
//! - `queue.rs`: a peer's queue of work, transport operations and their completions;
//! - `dispatch.rs`: incoming messages handed to their protocol;
//! - `recv.rs`: receive requests (matching, copying, completing), stream receives;
//! - `memmap.rs`: memory mapped for remote access and unpacked remote keys;
//! - `liveness.rs`: the peer timeout and keepalive; how waits ease off;
//! - `query.rs`: the capability query, read off the plan.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::Instant;

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::{EpParams, Iface, IfaceAttr, IfaceParams};

use crate::address::{IfaceEntry, WorkerAddress};
use crate::context::Context;
use crate::matching::{Tag, TagMatcher};
use crate::plan::{self, EpPlan, MemKey, Op, PlanConfig};
use crate::proto::Range;
use crate::slab::Slab;
use rustc_hash::FxHashMap;

mod active;
pub(crate) mod alloc;
pub(crate) mod atomic;
#[cfg(test)]
mod atomic_tests;
mod cancel;
mod connecting;
#[cfg(test)]
mod connecting_tests;
mod direct;
mod dispatch;
mod events;
#[cfg(test)]
mod hostile_tests;
mod inline;
pub(crate) mod lifecycle;
pub(crate) mod liveness;
mod memmap;
pub(crate) mod owned;
#[cfg(test)]
mod panic_tests;
mod peers;
mod post;
pub(crate) mod prelude;
pub(crate) mod procwatch;
mod query;
mod queue;
mod queued_more;
#[cfg(test)]
mod queued_tests;
mod recv;
pub(crate) mod state;

pub use crate::plan::PathInfo;
pub use crate::proto::am::{AmPayload, AmRemoteData};
pub use atomic::{AtomicOp, AtomicWord};
pub use events::{POLL_ONLY_TICK, WAIT_TICK};
pub use lifecycle::CloseMode;
pub(crate) use liveness::Backoff;
pub use memmap::{MemMap, RkeyBundle};
pub use owned::{Queued, QueuedReq};
use state::{Slot, State, Unexp};

/// First capacity of the eager-short payload buffer (source and data) of transports that
/// join the two in it (`Endpoint::am_short_word`'s default); it grows to the largest message
/// the plan gives eager short.
pub(crate) const SHORT_MAX: usize = 256;

/// Identifies a peer (a UCP endpoint) of a worker.
///
/// It is valid only on the worker that made it (by `connect` or `accept`): it carries that
/// worker's serial (one per worker of the process), so an id used on another worker is refused
/// with [`Error::ForeignEndpoint`] naming both, whatever its index. A worker never reuses an
/// endpoint's index: the id of a closed or failed endpoint keeps reporting why it ended.
///
/// One word: the worker's serial (never 0) in the high half, the index in the low half, so
/// that `Option<EpId>` is a word too, and checking an id costs one exclusive-or with the
/// worker's `ep_base` (a foreign id gives an index past any table).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EpId(std::num::NonZeroU64);

impl EpId {
    /// The id of peer `p` of the worker whose ids start at `base` (the worker's `ep_base`).
    #[inline]
    pub(crate) fn new(p: usize, base: std::num::NonZeroU64) -> EpId {
        debug_assert!(p <= u32::MAX as usize);
        EpId(base | p as u64)
    }

    /// The id of peer `p` of the worker with serial `worker` (not 0).
    #[cfg(test)]
    pub(crate) fn from_parts(p: usize, worker: u32) -> EpId {
        EpId::new(p, ep_base(worker))
    }

    /// The peer's index in its worker's table (meaningful only on that worker).
    #[inline]
    pub(crate) const fn idx(self) -> usize {
        self.0.get() as u32 as usize
    }

    /// Serial of the worker that made this id (see [`Worker::serial`]).
    pub const fn worker(self) -> u32 {
        (self.0.get() >> 32) as u32
    }
}

impl fmt::Display for EpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ep{}", self.idx())
    }
}

impl fmt::Debug for EpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ep{}@worker#{}", self.idx(), self.worker())
    }
}

/// The next worker serial of this process (see [`EpId`]).
static WORKER_SERIAL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

/// A serial for a new worker: never 0 (after 2^32 workers the count comes round again).
fn next_serial() -> u32 {
    loop {
        let s = WORKER_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if s != 0 {
            return s;
        }
    }
}

/// The first endpoint id of the worker with serial `serial` (not 0).
fn ep_base(serial: u32) -> std::num::NonZeroU64 {
    std::num::NonZeroU64::new(u64::from(serial) << 32).unwrap_or(std::num::NonZeroU64::MIN)
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

impl Completion {
    /// `len` bytes moved by a request with no tag and no sender (a put, get, flush, stream
    /// send or close).
    pub(crate) const fn done(len: usize) -> Completion {
        Completion {
            len,
            tag: 0,
            sender: None,
        }
    }

    /// `len` bytes received from peer `ep` without a tag (a stream receive).
    pub(crate) const fn from_peer(len: usize, ep: EpId) -> Completion {
        Completion {
            len,
            tag: 0,
            sender: Some(ep),
        }
    }
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
///
/// Its payload either came with it (`data`; `remote` is `None`) or stayed with the sender
/// (`remote`: a rendezvous, for large payloads and those in GPU memory sent with
/// [`Scope::am_send`](crate::Scope::am_send); `data` is empty). Fetch either kind into a
/// buffer of the handler's choice, host or GPU memory, with
/// [`Scope::am_recv_data`](crate::Scope::am_recv_data) after
/// [`take_payload`](Self::take_payload); a remote payload dropped unfetched releases its
/// sender (see [`AmRemoteData`]).
#[derive(Debug)]
pub struct AmMessage {
    /// User active-message id.
    pub id: u16,
    /// User header.
    pub header: Vec<u8>,
    /// Payload, when it came with the message.
    pub data: Vec<u8>,
    /// Endpoint to reply on.
    pub reply_ep: EpId,
    /// The payload's descriptor, when it stayed with the sender.
    pub remote: Option<AmRemoteData>,
}

pub(crate) type AmHandler = Box<dyn FnMut(&Worker, AmMessage) + Send>;

/// A worker: owns interfaces and drives progress.
///
/// A worker is `Send` but not `Sync`: it may move to another thread (or live in a `Mutex`),
/// and one thread at a time uses it. Requests borrow it, so it cannot move while a scope is
/// open. Active-message handlers are `Send` for that reason. It can sleep instead of polling:
/// [`Worker::event_fd`], [`Worker::arm`], [`Worker::wait`] (`events.rs`).
pub struct Worker {
    pub(crate) ifaces: RefCell<Vec<Box<dyn Iface>>>,
    pub(crate) st: RefCell<State>,
    handlers: RefCell<HashMap<u16, AmHandler>>,
    /// Emptied request-id lists of ended scopes, reused by the next ones (a scope per message
    /// is the common pattern; this spares an allocation each).
    id_lists: RefCell<Vec<Vec<u64>>>,
    /// The event set for sleeping and the wakers of awaited requests (`events.rs`).
    events: events::Events,
    /// Connections the connection manager is making (`connecting.rs`), and whether there are
    /// any (one load per progress call).
    cm: RefCell<connecting::Clients>,
    cm_any: std::cell::Cell<bool>,
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

pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

pub(crate) fn new_uuid() -> u64 {
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
                    cfg.raw("TLS").unwrap_or_default(),
                    ctx.unavailable()
                ),
            });
        }
        let address = WorkerAddress {
            uuid: new_uuid(),
            host: host_name(),
            pid: std::process::id(),
            proc: procwatch::own_stamp(),
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
        // As set (from the environment or by the program); left at its default, deeper for
        // small fragments.
        let stage_count = {
            let n = (cfg.uint("RNDV_FRAG_COUNT") as usize).clamp(1, 1024);
            let set = cfg.options().any(|(o, raw, from_env)| {
                o.name == "RNDV_FRAG_COUNT" && (from_env || raw != o.default)
            });
            if set {
                n
            } else {
                crate::proto::gpu::staging::stage_count(n, frag)
            }
        };
        // With a copy lane, the staging is made on a helper thread once the worker meets GPU
        // memory (`State::note_gpu_key`): the transfer that first needs it (one that demotes a
        // zero-copy GPU path) then does not wait for it, and a worker that only ever moves host
        // memory pins nothing and runs no helper next to its first messages.
        let staging_ahead_wanted = match &copy {
            Some((i, _)) if cfg.bool("RNDV_STAGING_AHEAD") => {
                Some((slots[*i].md, frag * stage_count * 2))
            }
            _ => None,
        };
        // The copy lane and local copy engines run copies of this process's protocols: polled
        // on every call from the start; the rest once a lane or an event makes them so.
        let mut active = active::Active::new(ifaces.len());
        for (i, slot) in slots.iter().enumerate() {
            if copy.as_ref().is_some_and(|(c, _)| *c == i)
                || slot.attr.caps.contains(rucx_uct::IfaceCaps::LOCAL_COPY)
            {
                active.mark(i);
            }
        }
        Ok(Worker {
            ifaces: RefCell::new(ifaces),
            st: RefCell::new(State {
                ep_base: ep_base(next_serial()),
                ctx: ctx.clone(),
                slots,
                address,
                peers: Vec::new(),
                by_uuid: FxHashMap::default(),
                last_src: std::cell::Cell::new(state::NO_LAST_SRC),
                short_buf: Vec::with_capacity(SHORT_MAX),
                ctrl_buf: Vec::with_capacity(256),
                matcher: TagMatcher::new(),
                next_direct: 0,
                reqs: Slab::default(),
                tokens: FxHashMap::default(),
                next_token: 1,
                rx: FxHashMap::default(),
                am_inbox: Vec::new(),
                proto_info: cfg.bool("PROTO_INFO"),
                rx_aborted: 0,
                frag,
                counters: Vec::new(),
                inline_short: 0,
                plan_cfg: PlanConfig::from_config(cfg),
                gpu_keys,
                plan_gen: 0,
                closing: false,
                copy,
                staging: None,
                rma_windows: Default::default(),
                rma_flushes: Vec::new(),
                staging_ahead: None,
                staging_ahead_wanted,
                stage_count,
                done_q: VecDeque::new(),
                failed_copies: Vec::new(),
                mapped: FxHashMap::default(),
                mapping_ahead: Vec::new(),
                offers_held: Vec::new(),
                staging_offered: Default::default(),
                keepalive: liveness::Keepalive::from_config(cfg),
                msg_alloc: alloc::MsgAlloc::default(),
                owned: owned::Registry::default(),
                life: lifecycle::Life::default(),
                procs: procwatch::ProcWatch::from_config(cfg),
                am_rts: FxHashMap::default(),
                am_releases: Default::default(),
                stream_host: FxHashMap::default(),
                active,
            }),
            handlers: RefCell::new(HashMap::new()),
            id_lists: RefCell::new(Vec::new()),
            events: events::Events::default(),
            cm: RefCell::default(),
            cm_any: std::cell::Cell::new(false),
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
        st.refuse_while_closing(remote.uuid)?;
        let p = st.peer_for(remote)?;
        st.connect_peer(p, &mut ifaces)?;
        st.pump(p);
        Ok(st.ep_id(p))
    }

    /// Send a user active message from a host slice (copied before this returns, whatever its
    /// size; completion is local). [`Scope::am_send`](crate::Scope::am_send) takes GPU memory
    /// too and sends large payloads by rendezvous.
    pub fn am_send(&self, ep: EpId, id: u16, header: &[u8], data: &[u8]) -> Result<()> {
        self.st.borrow_mut().am_send(ep, id, header, data)
    }

    /// One progress pass (`progress` in `events.rs` adds waking awaited requests): the
    /// events handled, and whether ends of queued requests wait to be taken
    /// ([`take_completed`](Self::take_completed)).
    #[inline(always)]
    fn progress_once(&self) -> (usize, bool) {
        // Connections being made by socket address: out of line (one load on the usual pass).
        if self.cm_any.get() {
            return self.progress_with_cm();
        }
        self.progress_pass()
    }

    /// [`progress_once`](Self::progress_once) while the connection manager makes connections.
    #[inline(never)]
    fn progress_with_cm(&self) -> (usize, bool) {
        let cm = self.progress_cm();
        let (n, completed) = self.progress_pass();
        (n + cm, completed)
    }

    #[inline(always)]
    fn progress_pass(&self) -> (usize, bool) {
        let (n, quiet) = self.progress_events();
        if let Some(completed) = quiet {
            return (n, completed);
        }
        // Owned requests that ended are handed back, closes stepped and endpoint failures
        // reported after the borrows are released (callbacks and handlers may post).
        let more = {
            let st = self.st.borrow();
            st.owned.has_work() || st.life.has_work()
        };
        let n = if more { n + self.after_progress() } else { n };
        (n, self.has_completed())
    }

    /// The interfaces' events and the worker's own due work. The usual pass (nothing queued,
    /// every peer settled) stays in this small function; the rest is out of line, so that the
    /// idle poll pays no frame for it. With the events, read under the same borrow of the
    /// state: `Some(whether ends of queued requests wait)` when nothing is left for after the
    /// pass, `None` when something is (owned requests, closes, active-message handlers that
    /// ran: all is read again then).
    fn progress_events(&self) -> (usize, Option<bool>) {
        let mut n = 0;
        {
            let mut ifaces = self.ifaces.borrow_mut();
            let mut st = self.st.borrow_mut();
            if st.active.begin() {
                n += st.progress_all(&mut ifaces);
            } else {
                // The hot interfaces (those in use, `active.rs`), in index order.
                let mut hot = st.active.hot();
                while hot != 0 {
                    let i = hot.trailing_zeros() as usize;
                    hot &= hot - 1;
                    let st = &mut *st;
                    n += ifaces[i].progress(&mut |ev| st.on_event(i, ev));
                }
            }
            // A peer failed with copies still running for requests it ended: they finish now.
            if !st.failed_copies.is_empty() {
                n += st.settle_failed_copies(&mut ifaces);
            }
            // Cheap checks inline: this loop runs on every poll of every request. A peer
            // connected, with its lanes and nothing queued (the usual state) costs one look.
            for p in 0..st.peers.len() {
                let peer = &st.peers[p];
                if !(peer.connected && !peer.needs_lanes && peer.queue.is_empty()) {
                    st.settle_peer(p, &mut ifaces);
                }
            }
            if !st.done_q.is_empty() {
                n += st.run_done_q();
            }
            // Staged requests waiting for a pinned window, when one is free.
            if st.rma_windows.has_waiters() {
                n += st.wake_window_waiters();
            }
            // Flushes waiting for staged puts and gets.
            if !st.rma_flushes.is_empty() {
                n += st.end_waiting_flushes();
            }
            // Active-message payloads dropped unfetched: release their senders.
            if st.am_releases.pending() {
                st.release_dropped_am();
            }
            // Same-host peers' processes: a counter per call, the clock once in a while.
            if st.procs.tick() {
                st.check_procs(Instant::now());
            }
            // Staging a helper thread made: taken in (and offered to peers) once ready.
            if st.staging_ahead.as_ref().is_some_and(|h| h.is_finished()) {
                st.take_staging_ahead();
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
                let after = st.owned.has_work() || st.life.has_work();
                return (n, (!after).then(|| st.owned.has_completed()));
            }
        }
        // The handlers may post, end and close anything: everything is read again after them.
        (n + self.run_am_handlers(), None)
    }

    /// Hand the active messages that arrived to their handlers; 1 when there were any.
    #[inline(never)]
    fn run_am_handlers(&self) -> usize {
        let inbox = std::mem::take(&mut self.st.borrow_mut().am_inbox);
        if inbox.is_empty() {
            return 0;
        }
        // A handler that waits for a request progresses the worker again: the messages that
        // arrive meanwhile wait for the handlers to be free.
        let Ok(mut handlers) = self.handlers.try_borrow_mut() else {
            let mut st = self.st.borrow_mut();
            let later = std::mem::take(&mut st.am_inbox);
            st.am_inbox = inbox;
            st.am_inbox.extend(later);
            return 0;
        };
        let mut rest = inbox.into_iter();
        while let Some(m) = rest.next() {
            match handlers.get_mut(&m.id) {
                Some(h) => {
                    if let Err(panic) =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(self, m)))
                    {
                        // The messages after it stay for the next progress, ahead of those
                        // that arrived meanwhile (none is lost to the panic); then the panic
                        // goes on to the caller.
                        drop(handlers);
                        let mut st = self.st.borrow_mut();
                        let later = std::mem::take(&mut st.am_inbox);
                        st.am_inbox.extend(rest);
                        st.am_inbox.extend(later);
                        drop(st);
                        std::panic::resume_unwind(panic);
                    }
                }
                None => tracing::warn!(
                    "active message {} from {} dropped: no handler set",
                    m.id,
                    m.reply_ep
                ),
            }
        }
        1
    }

    /// Set the handler of user active messages with id `id`.
    pub fn set_am_handler(&self, id: u16, h: impl FnMut(&Worker, AmMessage) + Send + 'static) {
        self.handlers.borrow_mut().insert(id, Box::new(h));
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
                sender: Some(st.ep_id(*src)),
            },
            Unexp::Rts { src, size, .. } => Completion {
                len: *size,
                tag: t,
                sender: Some(st.ep_id(*src)),
            },
        })
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
        let p = st.check_ep(ep)?;
        self.ensure_plan(&mut st, p);
        Ok(st.peers[p].plan.table(Op::Tag, MemKey::HOST).rows.clone())
    }

    /// The plan of `ep` (what [`proto_info`](Self::proto_info) prints).
    pub fn plan(&self, ep: EpId) -> Result<EpPlan> {
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        self.ensure_plan(&mut st, p);
        Ok(st.peers[p].plan.clone())
    }

    /// The plan of `ep` as text: lanes, a table per operation and memory type, and the
    /// rendezvous receive steps.
    pub fn proto_info(&self, ep: EpId) -> Result<String> {
        let plan = self.plan(ep)?;
        let st = self.st.borrow();
        Ok(format!(
            "rucx {} -> {}\n{plan}",
            ep,
            st.peers[ep.idx()].remote.describe()
        ))
    }

    /// Re-plan endpoint `p` if its plan is stale, connecting lanes a new plan wants (when the
    /// interfaces are free to borrow; otherwise the next progress does it).
    #[inline]
    pub(crate) fn ensure_plan(&self, st: &mut State, p: usize) {
        // The usual answer, inline: the plan is current and wants no lane.
        let peer = &st.peers[p];
        if !peer.needs_lanes && peer.plan_at == (st.ctx.epoch(), st.plan_gen) {
            return;
        }
        self.ensure_plan_slow(st, p);
    }

    #[inline(never)]
    fn ensure_plan_slow(&self, st: &mut State, p: usize) {
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
        let st = self.st.borrow();
        let mut c: std::collections::BTreeMap<String, u64> = st
            .counters
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect();
        if st.inline_short > 0 {
            *c.entry(crate::proto::Proto::EagerShort.name().to_string())
                .or_default() += st.inline_short;
        }
        c
    }

    /// The lanes of `ep`: the active-message lane and the remote-memory-access lane (as
    /// `transport/device`).
    pub fn lanes(&self, ep: EpId) -> Result<(String, Option<String>)> {
        let st = self.st.borrow();
        let p = st.check_ep(ep)?;
        let name = |i: usize| format!("{}/{}", st.slots[i].attr.tl_name, st.slots[i].attr.dev_name);
        let p = &st.peers[p];
        Ok((name(p.am), p.rma.map(name)))
    }

    /// Announce an orderly shutdown: peers that disconnect from now on are not reported as
    /// failures (their pending requests still end with an error).
    pub fn set_closing(&self) {
        self.st.borrow_mut().closing = true;
    }

    /// Whether the endpoint failed, and why.
    ///
    /// An id of another worker is answered with why it cannot be used here (see [`EpId`]).
    pub fn ep_error(&self, ep: EpId) -> Option<String> {
        let st = self.st.borrow();
        match st.ep_index(ep) {
            Ok(p) => st.peers[p].failed.clone(),
            Err(e) => Some(e.to_string()),
        }
    }

    /// This worker's serial in the process: what the ids of its endpoints carry
    /// ([`EpId::worker`]).
    pub fn serial(&self) -> u32 {
        self.st.borrow().serial()
    }
}

impl Drop for Worker {
    /// Owned requests still outstanding are ended and handed back first (`owned.rs`), closes
    /// in progress end canceled (`lifecycle.rs`), then the interfaces close.
    fn drop(&mut self) {
        self.shutdown_owned();
        self.cancel_closes();
        rucx_ucs::profile::flush();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::worker::prelude::{Duration, ReqKind, RmaState};

    pub(crate) fn self_worker() -> Worker {
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
                let id = st.new_req(ReqKind::Rma(RmaState::flush(0, Vec::new(), Vec::new())));
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
