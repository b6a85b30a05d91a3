//! The worker's state: peers (their lanes, plan and queue of work), requests (a generational
//! slab), completion tokens, unexpected messages, and the request bookkeeping every protocol
//! shares (ending a request, failing it and telling the peer).

use std::collections::VecDeque;

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::{AmId, Endpoint, IfaceAttr, MemHandle, RemoteKey};
use rustc_hash::FxHashMap;

use super::direct::Waiter;
use crate::address::{IfaceEntry, WorkerAddress};
use crate::context::{Context, RegGuard};
use crate::matching::{Tag, TagMatcher};
use crate::plan::{EpPlan, MemKey, Op, PlanConfig};
use crate::proto::Proto;
use crate::proto::eager_multi::EagerFrags;
use crate::proto::gpu::{StageSend, Staging};
use crate::proto::rma::RmaState;
use crate::proto::rndv::{RndvRecv, RndvSend, SendHead};
use crate::proto::stream::{StreamRecvs, StreamRx};
use crate::slab::Slab;
use crate::spare::Pooled;
use crate::wire::NamedKey;

use super::{AmMessage, Completion, EpId, liveness};

/// Reconstruct a host slice from the address of a buffer the request API borrowed.
///
/// # Safety
/// `addr..addr+len` must be a live host buffer for the whole use of the slice: guaranteed by
/// [`Scope`](crate::Scope), which borrows every buffer until all its requests are finished.
pub(crate) unsafe fn host_slice<'a>(addr: usize, len: usize) -> &'a [u8] {
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
pub(crate) unsafe fn host_slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

pub(crate) struct Slot {
    pub(crate) md: usize,
    pub(crate) attr: IfaceAttr,
}

/// What a completion token stands for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tok {
    pub(crate) req: u64,
    pub(crate) what: TokWhat,
    /// Posted on a lane whose operations this process runs itself (a copy engine:
    /// [`rucx_uct::IfaceCaps::LOCAL_COPY`]): it reads or writes the request's buffer until
    /// its completion, which always comes. A request that ended early is handed back only
    /// once no such operation is left ([`State::copies_in_flight`]).
    pub(crate) local: bool,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum TokWhat {
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
pub(crate) struct FragAck {
    pub(crate) peer: usize,
    pub(crate) sreq: u64,
    pub(crate) frag: u64,
    pub(crate) staged: usize,
}

/// Queued work of a peer, in order.
pub(crate) enum Pending {
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
pub(crate) struct Lanes(pub(crate) Vec<(usize, Box<dyn Endpoint>)>);

impl Lanes {
    #[inline]
    pub(crate) fn get_mut(&mut self, iface: &usize) -> Option<&mut Box<dyn Endpoint>> {
        self.0
            .iter_mut()
            .find(|(i, _)| i == iface)
            .map(|(_, ep)| ep)
    }

    pub(crate) fn insert(&mut self, iface: usize, ep: Box<dyn Endpoint>) {
        match self.get_mut(&iface) {
            Some(old) => *old = ep,
            None => self.0.push((iface, ep)),
        }
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &usize> {
        self.0.iter().map(|(i, _)| i)
    }
}

pub(crate) struct Peer {
    pub(crate) remote: WorkerAddress,
    /// uct endpoints by local interface index.
    pub(crate) eps: Lanes,
    pub(crate) connected: bool,
    /// The active-message lane (the plan's; it never changes once connected).
    pub(crate) am: usize,
    /// The host remote-memory-access lane of the current plan.
    pub(crate) rma: Option<usize>,
    /// What this endpoint does, and the (context epoch, local generation) it was made at.
    pub(crate) plan: EpPlan,
    pub(crate) plan_at: (u64, u64),
    /// The plan wants lanes that are not connected yet (its `wanted` is not empty).
    pub(crate) needs_lanes: bool,
    /// The peer's interfaces this worker reaches, by local interface index.
    pub(crate) targets: Vec<(usize, IfaceEntry)>,
    /// Why it ended (failed or closed), once it did.
    pub(crate) failed: Option<String>,
    /// The error its requests ended with when it failed ([`State::fail_peer_with`]): a peer
    /// timeout stays one for requests posted later.
    pub(crate) failure: Option<Error>,
    pub(crate) queue: VecDeque<Pending>,
    pub(crate) next_msg: u64,
    /// The receive side of the byte stream from this peer.
    pub(crate) stream_rx: StreamRx,
    /// When it was last heard from (`RUCX_PEER_TIMEOUT`).
    pub(crate) live: liveness::PeerLive,
    /// Closed, or being closed, and by whom (`lifecycle.rs`).
    pub(crate) closed: Option<super::lifecycle::Closed>,
    /// The peer's endpoint id for us, from its wire-up (`lifecycle.rs`: reconnects).
    pub(crate) remote_ep: Option<u64>,
    /// The connection manager has not named the peer yet (`connecting.rs`): `remote` is a
    /// stand-in, and only the connection step connects the endpoint.
    pub(crate) cm_pending: bool,
    /// The first error of a put, get or atomic to this peer that ended with one after it was
    /// posted, not reported by a flush yet: the next flush of the peer ends with it
    /// ([`State::take_rma_error`]), so that the loss of an implicit (nbi) operation, whose
    /// own end nobody looks at, is seen.
    pub(crate) rma_error: Option<Error>,
}

impl Peer {
    /// A peer of `remote`, not connected yet.
    pub(crate) fn new(remote: WorkerAddress) -> Peer {
        Peer {
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
            failure: None,
            queue: VecDeque::new(),
            next_msg: 0,
            stream_rx: StreamRx::default(),
            live: liveness::PeerLive::default(),
            closed: None,
            remote_ep: None,
            cm_pending: false,
            rma_error: None,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) enum SendWait {
    /// Posting fragments.
    #[default]
    Posting,
    /// Waiting for the receiver (ATS or RTR).
    Receiver,
    /// Everything posted; waiting for completions.
    Completions,
}

/// A send request: what every send protocol has ([`SendHead`]), and the state of the protocol
/// moving it ([`SendProto`]).
pub(crate) struct SendState {
    /// Peer, buffer, tag, protocol, operation, memory type and device.
    pub(crate) head: SendHead,
    /// The protocol moving the message, and its own state.
    pub(crate) state: SendProto,
}

/// The send-side protocol of a request, each with the state only it needs. Short and copy-in
/// sends keep nothing (no allocation on their path); a rendezvous is boxed.
pub(crate) enum SendProto {
    /// Copied out when posted: eager short and copy-in (complete once copied), and stream
    /// sends (their pieces wait in the peer's queue, [`Pending::StreamPiece`]).
    Copied,
    /// The eager message of a synchronous send: out, waiting for the receiver's
    /// acknowledgement of the match.
    Sync,
    /// A multi-fragment eager message, copied in or zero-copy.
    Frags(EagerFrags),
    /// A rendezvous: announced, then read, written, streamed, split or staged.
    Rndv(Pooled<RndvSend>),
}

impl SendProto {
    /// The state a send of protocol `proto` starts with.
    #[inline(always)]
    pub(crate) fn of(proto: Proto) -> Self {
        match proto {
            Proto::EagerSync => SendProto::Sync,
            Proto::EagerBcopyMulti | Proto::EagerZcopy => SendProto::Frags(EagerFrags::default()),
            p if p.is_rndv() => SendProto::Rndv(Pooled::default()),
            _ => SendProto::Copied,
        }
    }
}

impl SendState {
    /// A send of `len` bytes at `addr` (`mem` memory of `dev`) to peer `peer`, by `proto`
    /// (selected from the plan's table of `op`), not started yet.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn new(
        peer: usize,
        addr: usize,
        len: usize,
        tag: Tag,
        proto: Proto,
        op: Op,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Self {
        SendState {
            head: SendHead {
                peer,
                addr,
                len,
                tag,
                proto,
                op,
                mem,
                dev,
            },
            state: SendProto::of(proto),
        }
    }

    /// Move the send to protocol `proto` (re-selected): its state starts afresh when the
    /// protocol is of another kind, and is kept when it is of the same kind (a rendezvous
    /// re-selected keeps what it has).
    pub(crate) fn set_proto(&mut self, proto: Proto) {
        self.head.proto = proto;
        let same = matches!(
            (&self.state, SendProto::of(proto)),
            (SendProto::Copied, SendProto::Copied)
                | (SendProto::Sync, SendProto::Sync)
                | (SendProto::Frags(_), SendProto::Frags(_))
                | (SendProto::Rndv(_), SendProto::Rndv(_))
        );
        if !same {
            self.state = SendProto::of(proto);
        }
    }

    /// Where the send stands.
    pub(crate) fn wait(&self) -> SendWait {
        match &self.state {
            SendProto::Copied => SendWait::Posting,
            SendProto::Sync => SendWait::Receiver,
            SendProto::Frags(f) if f.all_posted => SendWait::Completions,
            SendProto::Frags(_) => SendWait::Posting,
            SendProto::Rndv(rv) => rv.wait,
        }
    }

    /// Bytes of the message posted so far (fragments, streamed or written data).
    pub(crate) fn posted(&self) -> usize {
        match &self.state {
            SendProto::Frags(f) => f.posted,
            SendProto::Rndv(rv) => rv.posted,
            _ => 0,
        }
    }

    /// The rendezvous state.
    #[inline]
    pub(crate) fn rndv(&self) -> Option<&RndvSend> {
        match &self.state {
            SendProto::Rndv(rv) => Some(rv),
            _ => None,
        }
    }

    /// The staged pipeline of a GPU rendezvous send, once the receiver asked for it.
    #[inline]
    pub(crate) fn stage(&self) -> Option<&StageSend> {
        self.rndv().and_then(|rv| rv.stage.as_deref())
    }
}

/// A receive request: its buffer and what arrived, and the state of the protocol filling it
/// ([`RecvProto`]).
pub(crate) struct RecvState {
    pub(crate) addr: usize,
    pub(crate) cap: usize,
    pub(crate) total: usize,
    pub(crate) received: usize,
    pub(crate) tag: Tag,
    pub(crate) sender: Option<usize>,
    pub(crate) mem: MemoryType,
    pub(crate) dev: Option<u32>,
    /// The user buffer registered with the copy lane's domain (GPU memory only): a property of
    /// the buffer, used by every protocol that copies into it (eager bytes, staged chunks).
    pub(crate) dev_memh: Option<Box<(RegGuard, RemoteKey)>>,
    /// The protocol filling the buffer, and its own state.
    pub(crate) proto: RecvProto,
}

/// The receive-side protocol of a request, each with the state only it needs.
pub(crate) enum RecvProto {
    /// Not matched yet, or filled by eager messages (whole, or fragments through `rx`).
    Tag,
    /// Filled from the peer's byte stream, not matched by tag. Into GPU memory, the stream
    /// fills `bounce`, a host buffer of the receive's size, copied to the GPU buffer (by the
    /// copy lane, registered in `dev_memh`) once full.
    /// `partial`: complete with the bytes at hand as soon as there is one (host memory only).
    Stream {
        bounce: Option<Vec<u8>>,
        partial: bool,
    },
    /// A full stream receive into GPU memory whose host bytes are being copied on to the GPU
    /// through pinned staging slots (`proto/memcopy.rs`); completes when every copy finished.
    Landing(Box<crate::proto::memcopy::Landing>),
    /// A rendezvous: read, written, streamed or split, or (GPU memory) read in staged chunks.
    Rndv(Pooled<RndvRecv>),
}

impl RecvState {
    /// A tag receive into `addr..addr + cap` (`mem` memory of `dev`), not matched yet.
    #[inline(always)]
    pub(crate) fn tag(
        addr: usize,
        cap: usize,
        tag: Tag,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Self {
        RecvState {
            addr,
            cap,
            total: 0,
            received: 0,
            tag,
            sender: None,
            mem,
            dev,
            dev_memh: None,
            proto: RecvProto::Tag,
        }
    }

    /// The rendezvous state, once the receive matched a request to send.
    #[inline]
    pub(crate) fn rndv(&self) -> Option<&RndvRecv> {
        match &self.proto {
            RecvProto::Rndv(rv) => Some(rv),
            _ => None,
        }
    }

    /// Bytes this receive waits for: the rendezvous' (capacity-limited) size, else the
    /// message's.
    #[inline]
    pub(crate) fn want(&self) -> usize {
        self.rndv().map_or(self.total, |rv| rv.want)
    }
}

pub(crate) enum ReqKind {
    Send(SendState),
    Recv(RecvState),
    Rma(RmaState),
}

impl ReqKind {
    /// A host rendezvous that ended well keeps nothing of its protocol: the state goes back to
    /// its thread's spares now, not when the scope ends (a scope keeps its ended requests, a
    /// bandwidth loop's 1024 of them, and a window of rendezvous sends would otherwise take a
    /// fresh box each). Nothing reads a rendezvous state after the end: late messages for an
    /// ended request are dropped by its result. GPU sends and receives keep theirs (staged
    /// chunks are released by the request's end).
    #[inline]
    fn drop_done_rndv(&mut self) {
        match self {
            ReqKind::Send(s) => {
                if !s.head.mem.is_gpu()
                    && matches!(&s.state, SendProto::Rndv(rv) if rv.stage.is_none())
                {
                    s.state = SendProto::Copied;
                }
            }
            ReqKind::Recv(rs) => {
                if !rs.mem.is_gpu() && matches!(rs.proto, RecvProto::Rndv(_)) {
                    rs.proto = RecvProto::Tag;
                }
            }
            ReqKind::Rma(_) => {}
        }
    }
}

pub(crate) struct Req {
    pub(crate) kind: ReqKind,
    pub(crate) result: Option<Result<Completion>>,
    pub(crate) outstanding: usize,
    pub(crate) guards: Vec<RegGuard>,
}

pub(crate) enum Unexp {
    Eager {
        src: usize,
        msg_id: Option<u64>,
        total: usize,
        data: Vec<u8>,
        /// A synchronous send's request, acknowledged when the message is matched.
        sync: Option<u64>,
        /// No memory could be allocated to keep it (`data` stays empty): the receive that
        /// matches it fails with [`super::alloc::lost_message`].
        lost: bool,
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
pub(crate) enum RxDest {
    Req(u64),
    Unexpected,
    /// A message no memory could be kept for: `left` more bytes to drop.
    Discard {
        left: usize,
    },
    UserAm {
        id: u16,
        total: usize,
        data: Vec<u8>,
    },
    /// The sender gave the message up before its first fragment arrived (delivered out of
    /// order): the fragments still on their way are dropped.
    Aborted,
}

/// An empty [`State::last_src`]: no peer has this index, so no source, not even a forged 0,
/// is taken for a peer without a look-up (before, `(0, 0)` gave a message claiming source 0,
/// a uuid no worker has, to peer 0).
pub(crate) const NO_LAST_SRC: (u64, usize) = (0, usize::MAX);

pub(crate) struct State {
    /// The id of this worker's first endpoint (its serial in the process in the high half,
    /// index 0): ids are this or'ed with the index ([`EpId`]).
    pub(crate) ep_base: std::num::NonZeroU64,
    pub(crate) ctx: Context,
    pub(crate) slots: Vec<Slot>,
    pub(crate) address: WorkerAddress,
    pub(crate) peers: Vec<Peer>,
    pub(crate) by_uuid: FxHashMap<u64, usize>,
    /// The sender of the last message and its peer (a one-entry cache of `by_uuid`);
    /// [`NO_LAST_SRC`] when empty.
    pub(crate) last_src: std::cell::Cell<(u64, usize)>,
    /// Payload of eager-short sends (source and data) for transports that join them in a
    /// buffer, reused.
    pub(crate) short_buf: Vec<u8>,
    /// A control message's encoding when it goes to the transport at once (nothing queued
    /// before it), reused: no allocation per message (see `send_msg`).
    pub(crate) ctrl_buf: Vec<u8>,
    pub(crate) matcher: TagMatcher<Waiter, Unexp>,
    /// The key of the next direct receive (`direct.rs`).
    pub(crate) next_direct: u64,
    pub(crate) reqs: Slab<Req>,
    pub(crate) tokens: FxHashMap<u64, Tok>,
    pub(crate) next_token: u64,
    pub(crate) rx: FxHashMap<(u64, u64), RxDest>,
    pub(crate) am_inbox: Vec<AmMessage>,
    pub(crate) proto_info: bool,
    /// Entries of `rx` that are [`RxDest::Aborted`] (looked for only while there are some).
    pub(crate) rx_aborted: usize,
    pub(crate) frag: usize,
    /// The planner's configuration.
    pub(crate) plan_cfg: PlanConfig,
    /// GPU memory this worker has met (planned for besides host memory).
    pub(crate) gpu_keys: Vec<MemKey>,
    /// Bumped when something the plans read changes locally (GPU keys, connected lanes).
    pub(crate) plan_gen: u64,
    /// Protocol counters, by static name (a handful; a linear scan beats a map).
    pub(crate) counters: Vec<(&'static str, u64)>,
    /// Eager-short sends that left in place ([`Worker::tag_send_inline`](crate::Worker::tag_send_inline)): counted apart, one
    /// add on that path, and reported under the protocol's name by
    /// [`Worker::counters`](crate::Worker::counters).
    pub(crate) inline_short: u64,
    /// The owner is leaving (`Worker::set_closing`): a peer's end is not warned about.
    pub(crate) closing: bool,
    /// Endpoint of the memory-type copy lane (host <-> GPU copies in this process).
    pub(crate) copy: Option<(usize, Box<dyn Endpoint>)>,
    pub(crate) staging: Option<Staging>,
    /// Pinned windows of staged puts and gets and GPU stream receives (`proto/rma/window.rs`).
    pub(crate) rma_windows: crate::proto::rma::Windows,
    /// Flushes whose lanes are flushed, waiting for staged puts and gets to end.
    pub(crate) rma_flushes: Vec<u64>,
    /// The staging being made ahead by a helper thread (`RUCX_RNDV_STAGING_AHEAD`), taken by
    /// the first transfer that needs staging.
    pub(crate) staging_ahead: Option<crate::proto::gpu::staging::StagingAhead>,
    /// The staging to make ahead (copy domain, bytes) once the worker meets GPU memory
    /// (`RUCX_RNDV_STAGING_AHEAD`); taken when the helper thread starts.
    pub(crate) staging_ahead_wanted: Option<(usize, usize)>,
    pub(crate) stage_count: usize,
    /// Completions that happened at once, handled after the current step.
    pub(crate) done_q: VecDeque<(Tok, Result<()>)>,
    /// Requests their peer's end (a failure, a forced close) ended while copies this process
    /// runs still touch their buffers: the next progress waits for those copies ([`State::settle_failed_copies`]).
    pub(crate) failed_copies: Vec<u64>,
    /// Peers' shared staging mapped here, registered with the copy lane, by local base.
    pub(crate) mapped: FxHashMap<usize, MemHandle>,
    /// Peers' offered staging being registered by helper threads (`proto/gpu/offer.rs`).
    pub(crate) mapping_ahead: Vec<crate::proto::gpu::offer::MappingAhead>,
    /// Peers' staging offers received before this worker met GPU memory.
    pub(crate) offers_held: Vec<crate::wire::NamedKey>,
    /// Peers this worker's staging was offered to.
    pub(crate) staging_offered: rustc_hash::FxHashSet<usize>,
    /// The peer timeout (`RUCX_PEER_TIMEOUT`), unless it is inf.
    pub(crate) keepalive: Option<liveness::Keepalive>,
    /// How buffers sized by a message are allocated (fallibly).
    pub(crate) msg_alloc: super::alloc::MsgAlloc,
    /// Requests on owned buffers (`owned.rs`).
    pub(crate) owned: super::owned::Registry,
    /// Endpoint closes in progress, endpoint failures to report, error handlers
    /// (`lifecycle.rs`).
    pub(crate) life: super::lifecycle::Life,
    /// Liveness of same-host peers by their process (`procwatch.rs`).
    pub(crate) procs: super::procwatch::ProcWatch,
    /// Active-message rendezvous sends whose request to send is not out yet: the user id and
    /// header it carries (`proto/am.rs`).
    pub(crate) am_rts: FxHashMap<u64, (u16, Vec<u8>)>,
    /// Active-message payloads a handler dropped unfetched, to release (`proto/am.rs`).
    pub(crate) am_releases: std::sync::Arc<crate::proto::am::AmReleases>,
    /// Host copies of GPU buffers sent on a stream, by send request (`proto/memcopy.rs`).
    pub(crate) stream_host: FxHashMap<u64, Vec<u8>>,
    /// The interfaces progress polls on every call, and when it polls the others
    /// (`active.rs`).
    pub(crate) active: super::active::Active,
}

/// Stream receives of peer `peer` as the stream protocol fills them.
pub(crate) struct StreamReqs<'a> {
    pub(crate) reqs: &'a mut Slab<Req>,
    pub(crate) peer: EpId,
    /// GPU stream receives filled in their host buffer, to copy on and complete
    /// ([`State::land_gpu_streams`]).
    pub(crate) landed: Vec<u64>,
    /// Why the stream ended, for receives it ends early ([`StreamRecvs::end`]).
    pub(crate) cause: Option<Error>,
    /// Receives that ended (filled or canceled): their owners are told
    /// ([`State::note_stream_ends`]), so an owned or queued receive is handed back.
    pub(crate) ended: Vec<u64>,
}

impl<'a> StreamReqs<'a> {
    pub(crate) fn new(reqs: &'a mut Slab<Req>, peer: EpId) -> Self {
        StreamReqs {
            reqs,
            peer,
            landed: Vec::new(),
            cause: None,
            ended: Vec::new(),
        }
    }

    /// For a stream that ended (or ends now) because of `cause`.
    pub(crate) fn ended_by(mut self, cause: Error) -> Self {
        self.cause = Some(cause);
        self
    }
}

impl StreamRecvs for StreamReqs<'_> {
    fn room(&mut self, id: u64) -> Option<&mut [u8]> {
        match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto:
                            RecvProto::Stream {
                                bounce: Some(b), ..
                            },
                        received,
                        ..
                    }),
                result: None,
                ..
            }) => Some(&mut b[*received..]),
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

    fn filled(&mut self, id: u64, n: usize, full: bool) -> bool {
        if let Some(r) = self.reqs.get_mut(&id)
            && let ReqKind::Recv(rs) = &mut r.kind
        {
            rs.received += n;
            let partial = matches!(rs.proto, RecvProto::Stream { partial: true, .. });
            if full
                && matches!(
                    rs.proto,
                    RecvProto::Stream {
                        bounce: Some(_),
                        ..
                    }
                )
            {
                // Complete once the bytes are copied on to the GPU.
                self.landed.push(id);
            } else if (full || (partial && rs.received > 0)) && r.result.is_none() {
                r.result = Some(Ok(Completion::from_peer(rs.received, self.peer)));
                r.guards.clear();
                self.ended.push(id);
                return true;
            }
        }
        full
    }

    fn cancel(&mut self, id: u64) -> Vec<u8> {
        let Some(r) = self.reqs.get_mut(&id) else {
            return Vec::new();
        };
        let taken = match &r.kind {
            ReqKind::Recv(RecvState {
                proto: RecvProto::Stream {
                    bounce: Some(b), ..
                },
                received,
                ..
            }) if r.result.is_none() => b[..*received].to_vec(),
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
            self.ended.push(id);
        }
        taken
    }

    fn end(&mut self, id: u64) -> Vec<u8> {
        let Some(r) = self.reqs.get_mut(&id) else {
            return Vec::new();
        };
        let ReqKind::Recv(rs) = &mut r.kind else {
            return Vec::new();
        };
        if r.result.is_some() {
            return Vec::new();
        }
        // A GPU receive's bytes are in its host buffer, not yet in the caller's: they go back
        // to the stream (a later receive gets them) and the receive holds none.
        let back = match &rs.proto {
            RecvProto::Stream {
                bounce: Some(b), ..
            } => {
                let back = b[..rs.received].to_vec();
                rs.received = 0;
                back
            }
            _ => Vec::new(),
        };
        let cause = self.cause.clone().unwrap_or_else(|| {
            Error::Internal(format!("stream receive {id:#x} ended with no cause"))
        });
        r.result = Some(Err(Error::StreamIncomplete {
            received: rs.received,
            wanted: rs.cap,
            cause: Box::new(cause),
        }));
        r.guards.clear();
        self.ended.push(id);
        back
    }
}

impl State {
    #[inline(always)]
    pub(crate) fn new_req(&mut self, kind: ReqKind) -> u64 {
        self.reqs.insert(Req {
            kind,
            result: None,
            outstanding: 0,
            guards: Vec::new(),
        })
    }

    /// End request `id` successfully: `len` bytes moved (no tag, no sender).
    pub(crate) fn finish_ok(&mut self, id: u64, len: usize) {
        self.finish(id, Ok(Completion::done(len)));
    }

    /// Tell the owners of stream receives that ended in a [`StreamReqs`] pass.
    pub(crate) fn note_stream_ends(&mut self, ended: &[u64]) {
        for &id in ended {
            self.owned.note_done(id);
        }
    }

    pub(crate) fn finish(&mut self, id: u64, res: Result<Completion>) {
        if self.set_result(id, res) {
            self.release_chunks(id);
        }
    }

    /// End request `id` with `res` unless it ended already; true when it now ended with an
    /// error (its announced fragments are then to be released: [`Self::release_chunks`]).
    pub(crate) fn set_result(&mut self, id: u64, res: Result<Completion>) -> bool {
        if let Some(r) = self.reqs.get_mut(&id)
            && r.result.is_none()
        {
            let failed = res.is_err();
            rucx_ucs::profile::mark("req.end", id);
            r.result = Some(res);
            crate::spare::release_guards(&mut r.guards);
            if !failed {
                r.kind.drop_done_rndv();
            }
            if !self.stream_host.is_empty() {
                self.stream_host.remove(&id);
            }
            if !self.am_rts.is_empty() {
                self.am_rts.remove(&id);
            }
            self.owned.note_done(id);
            if failed {
                // Nothing in flight: a staged request's pinned window goes back now.
                self.reclaim_window(id);
                self.note_rma_failure(id);
            }
            return failed;
        }
        false
    }

    /// End request `id` with `e` and, when it is one side of a rendezvous, tell the peer, so
    /// that the other side's request ends too rather than waiting for messages that will never
    /// come. Every failure of a rendezvous in progress ends here.
    pub(crate) fn fail(&mut self, id: u64, e: Error) {
        // A multi-fragment eager send that ends after fragments went out (stopped part-way, or
        // a zero-copy fragment's completion failed after all were posted): the receiver drops
        // them, and a receive that matched them ends.
        let eager = match self.reqs.get(&id) {
            Some(Req {
                kind:
                    ReqKind::Send(SendState {
                        head: SendHead { peer, .. },
                        state: SendProto::Frags(f),
                        ..
                    }),
                result: None,
                ..
            }) if f.abort_needed() => Some((*peer, f.msg_id)),
            _ => None,
        };
        let notice = match self.reqs.get(&id) {
            Some(Req {
                kind:
                    ReqKind::Send(SendState {
                        head: SendHead { peer, .. },
                        state: SendProto::Rndv(rv),
                        ..
                    }),
                result: None,
                ..
            }) => Some((*peer, id, rv.peer_rreq(), true)),
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => rs.rndv().map(|rv| (rv.peer, rv.sreq, id, false)),
            Some(Req { result: None, .. }) => None,
            _ => return,
        };
        // A broken endpoint fails the peer's requests on its side by itself.
        let notify = !matches!(e, Error::EndpointFailure { .. });
        let reason = match &e {
            // What the peer's request will say: "<this worker> ended the transfer: ...".
            Error::Canceled => "it was canceled on that side (the request canceled, its endpoint \
                                force-closed, or its worker dropped)"
                .to_string(),
            e => e.to_string(),
        };
        self.set_result(id, Err(e));
        match notice {
            Some((p, _, _, true))
                if notify && self.peers.get(p).is_some_and(|x| x.failed.is_none()) =>
            {
                // The send's rendezvous state tells the receiver (which receive, why).
                tracing::debug!(
                    "rendezvous send {id:#x} to {} aborted on this side: {reason}",
                    self.peers[p].remote.describe()
                );
                self.with_rndv_send(id, |rv, head, st| rv.abort(st, head, id, &reason));
                self.pump(p);
            }
            Some((p, sreq, rreq, false)) if notify => {
                self.send_abort(p, sreq, rreq, false, &reason)
            }
            _ => {}
        }
        if notify && let Some((p, msg_id)) = eager {
            self.send_eager_abort(p, msg_id, &reason);
        }
        // Only after the abort: the acknowledgements of the fragments announced to a receive
        // carry their whole staged length, and ahead of it they would complete the send.
        self.release_chunks(id);
    }

    #[inline]
    pub(crate) fn check_peer(&self, p: usize) -> Result<()> {
        match self.peers.get(p) {
            Some(peer) if peer.closed.is_none() && peer.failed.is_none() && peer.connected => {
                Ok(())
            }
            _ => self.peer_unusable(p),
        }
    }

    /// The index of endpoint `ep` when it takes operations (this worker's, connected, neither
    /// closed nor failed); else why not, as [`check_peer`](Self::check_peer) says, or
    /// [`Error::ForeignEndpoint`] for an id another worker made. One compare more than the
    /// index check: every public call that names an endpoint comes through here.
    #[inline]
    pub(crate) fn check_ep(&self, ep: EpId) -> Result<usize> {
        // The index, for an id of this worker; past any table for another worker's.
        let p = (ep.0.get() ^ self.ep_base.get()) as usize;
        match self.peers.get(p) {
            Some(peer) if peer.closed.is_none() && peer.failed.is_none() && peer.connected => Ok(p),
            _ => self.ep_unusable(ep),
        }
    }

    /// This worker's serial in the process (the high half of its endpoint ids).
    pub(crate) fn serial(&self) -> u32 {
        (self.ep_base.get() >> 32) as u32
    }

    #[cold]
    fn ep_unusable(&self, ep: EpId) -> Result<usize> {
        let p = self.ep_index(ep)?;
        self.peer_unusable(p).map(|()| p)
    }

    /// The index of endpoint `ep` whatever its state (closed and failed ones too), refusing an
    /// id of another worker.
    pub(crate) fn ep_index(&self, ep: EpId) -> Result<usize> {
        if ep.worker() != self.serial() {
            return Err(foreign_ep(ep, self.serial()));
        }
        let p = ep.idx();
        if p >= self.peers.len() {
            return Err(no_such_ep(p));
        }
        Ok(p)
    }

    /// The id of this worker's peer `p`.
    #[inline]
    pub(crate) fn ep_id(&self, p: usize) -> EpId {
        EpId::new(p, self.ep_base)
    }

    /// Why endpoint `p` cannot take operations ([`check_peer`](Self::check_peer)'s errors).
    #[cold]
    fn peer_unusable(&self, p: usize) -> Result<()> {
        let peer = self.peers.get(p).ok_or_else(|| no_such_ep(p))?;
        if peer.closed.is_some() {
            return Err(self.failure_of(p));
        }
        match &peer.failed {
            Some(_) => Err(self.failure_of(p)),
            None if !peer.connected => Err(Error::NoResource(format!(
                "endpoint ep{p} to {} is still being wired up",
                peer.remote.describe()
            ))),
            None => Ok(()),
        }
    }

    /// The error a request on ended peer `p` gets: [`Error::EndpointClosed`] (by whom) for a
    /// closed endpoint, else the failure itself (typed: a peer timeout stays
    /// [`Error::PeerTimeout`]), else [`Error::EndpointFailure`] with the reason it ended.
    pub(crate) fn failure_of(&self, p: usize) -> Error {
        let peer = &self.peers[p];
        if let Some(c) = peer.closed {
            // Closed (by either side), not failed: say so, and by whom.
            return Error::EndpointClosed {
                ep: format!("ep{p}"),
                peer: peer.remote.describe(),
                by: c.by(),
            };
        }
        self.failed_error(p)
    }

    /// The error peer `p` failed with ([`State::fail_peer_with`]), else
    /// [`Error::EndpointFailure`] with the reason it ended.
    pub(crate) fn failed_error(&self, p: usize) -> Error {
        let peer = &self.peers[p];
        peer.failure
            .clone()
            .unwrap_or_else(|| Error::EndpointFailure {
                peer: peer.remote.describe(),
                reason: peer.failed.clone().unwrap_or_default(),
            })
    }

    pub(crate) fn next_msg(&mut self, p: usize) -> u64 {
        let peer = &mut self.peers[p];
        peer.next_msg += 1;
        peer.next_msg
    }

    #[inline]
    pub(crate) fn count(&mut self, what: &'static str) {
        // The same literal is (almost always) the same pointer: compared first, without
        // reading any text; equal text under another pointer is found next.
        if let Some((_, n)) = self
            .counters
            .iter_mut()
            .find(|(k, _)| std::ptr::eq(*k, what))
        {
            *n += 1;
            return;
        }
        self.count_slow(what);
    }

    #[cold]
    fn count_slow(&mut self, what: &'static str) {
        match self.counters.iter_mut().find(|(k, _)| *k == what) {
            Some((_, n)) => *n += 1,
            None => self.counters.push((what, 1)),
        }
    }

    /// Whether copies this process runs itself are still running for request `id`: those of
    /// the copy lane (between the request's buffer and staging) and the zero-copy operations
    /// of lanes whose transport is a copy engine (`cuda_ipc` reading or writing the buffer
    /// through a peer's mapping, host-to-GPU writes from pageable memory by helper threads).
    /// They always complete, whatever the peer does, and touch the buffer until then: a
    /// request that ended early is handed back only once none is left. (Operations of other
    /// transports end with their endpoint.)
    pub(crate) fn copies_in_flight(&self, id: u64) -> bool {
        self.tokens.values().any(|t| t.req == id && t.local)
    }

    /// Whether request `id` ended early (with an error) while operations still touch its
    /// buffer: copies this process runs ([`Self::copies_in_flight`]), or, canceled by a forced
    /// close, operations the transport still runs. Its end is reported, and its buffer handed
    /// back, only once they finished.
    pub(crate) fn draining(&self, id: u64) -> bool {
        match self.reqs.get(&id) {
            Some(Req {
                result: Some(Err(e)),
                outstanding,
                ..
            }) => (*outstanding > 0 && matches!(e, Error::Canceled)) || self.copies_in_flight(id),
            _ => false,
        }
    }

    /// Whether operations on `lane` are copies this process runs (see [`Tok::local`]).
    #[inline]
    pub(crate) fn lane_local(&self, lane: usize) -> bool {
        self.slots[lane]
            .attr
            .caps
            .contains(rucx_uct::IfaceCaps::LOCAL_COPY)
    }

    pub(crate) fn send_tag(&self, id: u64) -> Tag {
        match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.head.tag,
            _ => 0,
        }
    }
}

/// The error for an endpoint id of another worker used on worker `serial`.
#[cold]
pub(crate) fn foreign_ep(ep: EpId, serial: u32) -> Error {
    Error::ForeignEndpoint {
        ep: ep.to_string(),
        owner: ep.worker(),
        worker: serial,
    }
}

/// The error for an endpoint index this worker never made (an id of this worker cannot have
/// one; kept for ids of a worker whose serial came round again).
#[cold]
pub(crate) fn no_such_ep(p: usize) -> Error {
    Error::InvalidParam(format!(
        "endpoint ep{p} does not exist on this worker (an EpId is valid only on the worker whose \
         connect made it)"
    ))
}

/// The peer of a request.
pub(crate) fn p_of(r: &Req) -> usize {
    match &r.kind {
        ReqKind::Send(s) => s.head.peer,
        ReqKind::Recv(rs) => rs.rndv().map_or(0, |v| v.peer),
        ReqKind::Rma(rm) => rm.peer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rndv_send(mem: MemoryType) -> ReqKind {
        ReqKind::Send(SendState::new(
            0,
            0x1000,
            1 << 16,
            7,
            Proto::RndvGet,
            Op::Tag,
            mem,
            None,
        ))
    }

    fn rndv_recv(mem: MemoryType) -> ReqKind {
        let mut rs = RecvState::tag(0x2000, 1 << 16, 7, mem, None);
        rs.proto = RecvProto::Rndv(Pooled::new(RndvRecv::new(0, 3, 1 << 16)));
        ReqKind::Recv(rs)
    }

    #[test]
    fn a_host_rendezvous_that_ended_drops_its_state() {
        let mut s = rndv_send(MemoryType::Host);
        s.drop_done_rndv();
        assert!(matches!(
            s,
            ReqKind::Send(SendState {
                state: SendProto::Copied,
                ..
            })
        ));
        let mut r = rndv_recv(MemoryType::Host);
        r.drop_done_rndv();
        assert!(matches!(
            r,
            ReqKind::Recv(RecvState {
                proto: RecvProto::Tag,
                ..
            })
        ));
    }

    #[test]
    fn gpu_rendezvous_and_other_states_are_kept() {
        let mut s = rndv_send(MemoryType::Cuda);
        s.drop_done_rndv();
        assert!(matches!(
            s,
            ReqKind::Send(SendState {
                state: SendProto::Rndv(_),
                ..
            })
        ));
        let mut r = rndv_recv(MemoryType::Cuda);
        r.drop_done_rndv();
        assert!(matches!(
            r,
            ReqKind::Recv(RecvState {
                proto: RecvProto::Rndv(_),
                ..
            })
        ));
        let mut f = ReqKind::Send(SendState::new(
            0,
            0x1000,
            1 << 16,
            7,
            Proto::EagerBcopyMulti,
            Op::Tag,
            MemoryType::Host,
            None,
        ));
        f.drop_done_rndv();
        assert!(matches!(
            f,
            ReqKind::Send(SendState {
                state: SendProto::Frags(_),
                ..
            })
        ));
    }
}
