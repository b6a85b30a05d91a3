//! Size-range tables: for an operation on a sender memory type, which protocol each size takes.

use rucx_ucs::MemUnits;
use rucx_uct::{DeviceType, IfaceAttr, IfaceCaps, LinearCost};

use super::{Lanes, MemKey, Op, OpTable, PlanConfig, PlanInput, RmaPlan, Scheme, lane_row};
use crate::proto::{FIRST_OVERHEAD, ONE_OVERHEAD, Proto, Range, SHORT_OVERHEAD, SYNC_OVERHEAD};

/// Copy bandwidth assumed for the CPU copies of copy-in protocols, bytes per second.
const MEMCPY_BW: f64 = 10e9;

/// Fixed cost of a rendezvous the lanes' models leave out: the request and the answer are
/// handled by the receiver's and the sender's progress, the read pins pages. Measured about
/// 3.5-8 us on posix (cross-memory attach) and loopback tcp.
const RNDV_FIXED_NS: f64 = 8_000.0;

/// What the host tag table is built from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostLanes<'a> {
    /// Active-message lane and its index.
    pub am: (&'a IfaceAttr, usize),
    /// Whether the AM lane's domain registers host memory now.
    pub am_can_reg: bool,
    /// Registration cost on the AM lane's domain.
    pub am_reg_cost: LinearCost,
    /// Lane for rendezvous data (its domain registers host memory now).
    pub rma: Option<(&'a IfaceAttr, usize)>,
    /// The automatic rendezvous threshold of the same lanes with nothing demoted
    /// (`usize::MAX`: none). A demotion never moves the threshold above it: sizes that were a
    /// rendezvous stay one (the receiver can still refuse a message it has no path for, and the
    /// send then ends with the error; an eager message would leave its sender believing it
    /// delivered, and the receiver holding it unexpected), streamed when no lane can register.
    pub eager_cap: usize,
}

fn rndv_threshold(l: &HostLanes<'_>, cfg: &PlanConfig) -> usize {
    match cfg.rndv_thresh {
        MemUnits::Bytes(b) => return b.min(usize::MAX as u64) as usize,
        MemUnits::Infinite => return usize::MAX,
        MemUnits::Auto => {}
    }
    // Eager: copy in, move, copy out. Rendezvous: a round trip of control messages plus the
    // data moved once by the fastest lane.
    let am = l.am.0.perf;
    let data = l.rma.map_or(am, |r| r.0.perf);
    let ctrl =
        2.0 * (am.latency_ns + am.overhead_ns) + data.latency_ns + data.overhead_ns + RNDV_FIXED_NS;
    let mut n = 1024usize;
    while n < (64 << 20) {
        let eager = am.time_ns(n) + 2.0 * n as f64 * 1e9 / MEMCPY_BW;
        let move_ns = if data.bandwidth > 0.0 {
            n as f64 * 1e9 / data.bandwidth
        } else {
            f64::INFINITY
        };
        let copies = if l.rma.is_none() {
            2.0 * n as f64 * 1e9 / MEMCPY_BW
        } else {
            0.0
        };
        if ctrl + move_ns + copies < eager {
            break;
        }
        n *= 2;
    }
    n.max(split_floor(l, cfg)).min(l.eager_cap)
}

/// Smallest rendezvous worth it on a lane whose rendezvous is a split read (shared memory, the
/// `auto` scheme): below `RNDV_SPLIT_THRESH` the read is one core copying after a round trip,
/// which the pipelined eager copy beats (posix, measured: 128 KiB eager 7.8 GB/s and 6.6 us one
/// way, rendezvous 4.8 GB/s and 13.7 us); from it the split read, both cores copying once, beats
/// eager's two copies (see `DEFAULT_SPLIT_THRESH`).
fn split_floor(l: &HostLanes<'_>, cfg: &PlanConfig) -> usize {
    match l.rma {
        Some((r, _))
            if cfg.scheme == Scheme::Auto
                && r.dev_type != DeviceType::Network
                && r.has(IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY) =>
        {
            cfg.split_thresh
        }
        _ => 0,
    }
}

fn zcopy_threshold(l: &HostLanes<'_>, cfg: &PlanConfig) -> usize {
    match cfg.zcopy_thresh {
        MemUnits::Bytes(b) => return b.min(usize::MAX as u64) as usize,
        MemUnits::Infinite => return usize::MAX,
        MemUnits::Auto => {}
    }
    // Worth it once one copy costs more than a (cached) registration.
    let mut n = 256usize;
    while n < (64 << 20) {
        if l.am_reg_cost.at(n) < n as f64 * 1e9 / MEMCPY_BW {
            return n;
        }
        n *= 2;
    }
    n
}

/// Whether streaming a rendezvous over the active-message lane (copied in and out) moves bytes
/// faster than the data lane `data` moves them by zero-copy: e.g. shared memory demoted for
/// host memory, where the next lane that registers is a network one.
fn am_streams_faster(am: &IfaceAttr, data: &IfaceAttr, am_lane: usize, data_lane: usize) -> bool {
    let per_byte = |bw: f64| if bw > 0.0 { 1e9 / bw } else { f64::INFINITY };
    am_lane != data_lane
        && per_byte(am.perf.bandwidth) + 2.0 * per_byte(MEMCPY_BW) < per_byte(data.perf.bandwidth)
}

/// The rendezvous protocol and its lane for host memory.
fn rndv_proto(l: &HostLanes<'_>, cfg: &PlanConfig) -> (Proto, usize) {
    let am = l.am.1;
    match (l.rma, cfg.scheme) {
        (_, Scheme::Am) | (None, _) => (Proto::RndvAm, am),
        (Some((r, i)), Scheme::Auto) if am_streams_faster(l.am.0, r, am, i) => (Proto::RndvAm, am),
        (Some((r, i)), Scheme::Put) if r.has(IfaceCaps::PUT_ZCOPY) => (Proto::RndvPut, i),
        // Over a network the sender pushes: a read costs a request round trip per fragment
        // and the serving side's copy (measured on loopback tcp: 5.3 GB/s put vs 1.2 get).
        (Some((r, i)), Scheme::Auto)
            if r.dev_type == DeviceType::Network && r.has(IfaceCaps::PUT_ZCOPY) =>
        {
            (Proto::RndvPut, i)
        }
        (Some((r, i)), _) if r.has(IfaceCaps::GET_ZCOPY) => (Proto::RndvGet, i),
        (Some((r, i)), _) if r.has(IfaceCaps::PUT_ZCOPY) => (Proto::RndvPut, i),
        _ => (Proto::RndvAm, am),
    }
}

/// The tag-send table for host memory: eager short, copy-in, multi-fragment copy-in,
/// zero-copy, then rendezvous, each range as the lanes' limits and the cost model allow.
pub(crate) fn host_tag(l: &HostLanes<'_>, cfg: &PlanConfig, input: &PlanInput<'_>) -> Vec<Range> {
    let (am, ami) = l.am;
    let mut rows: Vec<Range> = Vec::new();
    let mut push = |from: usize, to: usize, proto: Proto, lane: usize| {
        if from <= to {
            rows.push(lane_row(from, to, proto, lane, input));
        }
    };
    let rndv = rndv_threshold(l, cfg);
    // Sizes below `rndv` are eager; `rndv == usize::MAX` means "never rendezvous".
    let eager_end = if rndv == usize::MAX {
        Some(usize::MAX)
    } else {
        rndv.checked_sub(1)
    };
    let mut next = 0usize;
    if let Some(eager_end) = eager_end {
        let mut done = false;
        if am.has(IfaceCaps::AM_SHORT) && am.limits.am_max_short >= SHORT_OVERHEAD {
            let end = (am.limits.am_max_short - SHORT_OVERHEAD).min(eager_end);
            push(0, end, Proto::EagerShort, ami);
            done = end == usize::MAX;
            next = end.saturating_add(1);
        }
        let one_end = am
            .limits
            .am_max_bcopy
            .saturating_sub(ONE_OVERHEAD)
            .min(eager_end);
        if !done && next <= one_end && am.limits.am_max_bcopy >= ONE_OVERHEAD {
            push(next, one_end, Proto::EagerBcopy, ami);
            done = one_end == usize::MAX;
            next = one_end.saturating_add(1);
        }
        let zc_ok =
            am.has(IfaceCaps::AM_ZCOPY) && l.am_can_reg && am.limits.am_max_hdr >= FIRST_OVERHEAD;
        let zthresh = if zc_ok {
            zcopy_threshold(l, cfg).max(next)
        } else {
            usize::MAX
        };
        if !done && next <= eager_end {
            let bend = if zthresh == usize::MAX {
                eager_end
            } else {
                (zthresh - 1).min(eager_end)
            };
            if next <= bend && (zthresh > next || !zc_ok) {
                push(next, bend, Proto::EagerBcopyMulti, ami);
                done = bend == usize::MAX;
                next = bend.saturating_add(1);
            }
            if !done && next <= eager_end {
                push(next, eager_end, Proto::EagerZcopy, ami);
                done = eager_end == usize::MAX;
                next = eager_end.saturating_add(1);
            }
        }
        if done {
            return rows;
        }
    }
    let (proto, lane) = rndv_proto(l, cfg);
    push(next, usize::MAX, proto, lane);
    rows
}

/// Synchronous sends: one eager message (with its 24-byte header, in one `am_bcopy`) asks for
/// an acknowledgement of its match; anything larger takes the rendezvous (which completes after
/// the match anyway).
fn sync_of(
    tag: &[Range],
    l: &HostLanes<'_>,
    cfg: &PlanConfig,
    input: &PlanInput<'_>,
) -> Vec<Range> {
    let (rndv, rlane) = rndv_proto(l, cfg);
    let rndv_lane = lane_row(0, 0, rndv, rlane, input).lane;
    // Sizes below `fits_below` fit one synchronous eager message.
    let fits_below =
        l.am.0
            .limits
            .am_max_bcopy
            .checked_sub(SYNC_OVERHEAD)
            .map_or(0, |m| m.saturating_add(1));
    let mut rows: Vec<Range> = Vec::new();
    let mut push = |from: usize, to: usize, proto: Proto, lane: &str| match rows.last_mut() {
        Some(last) if last.proto == proto && last.lane == lane => last.to = to,
        _ => rows.push(Range {
            from,
            to,
            proto,
            lane: lane.to_string(),
        }),
    };
    for r in tag {
        match r.proto {
            Proto::EagerShort | Proto::EagerBcopy => {
                let split = fits_below.clamp(r.from, r.to.saturating_add(1));
                if r.from < split {
                    push(r.from, split - 1, Proto::EagerSync, &r.lane);
                }
                if split <= r.to {
                    push(split, r.to, rndv, &rndv_lane);
                }
            }
            p if p.is_rndv() => push(r.from, r.to, p, &r.lane),
            _ => push(r.from, r.to, rndv, &rndv_lane),
        }
    }
    rows
}

fn one_row(op: Op, mem: MemKey, proto: Proto, lane: usize, input: &PlanInput<'_>) -> OpTable {
    OpTable {
        op,
        mem,
        rows: vec![lane_row(0, usize::MAX, proto, lane, input)],
        notes: Vec::new(),
    }
}

fn refused(op: Op, mem: MemKey, why: impl Into<String>) -> OpTable {
    OpTable {
        op,
        mem,
        rows: Vec::new(),
        notes: vec![why.into()],
    }
}

/// A registration view with nothing demoted.
struct NothingDemoted;

impl super::RegView for NothingDemoted {
    fn can_register(&self, _md: usize, _mem: rucx_ucs::MemoryType, _dev: Option<u32>) -> bool {
        true
    }
}

/// The automatic rendezvous threshold of `input`'s lanes with nothing demoted.
fn undemoted_threshold(input: &PlanInput<'_>) -> usize {
    let base = PlanInput {
        reg: &NothingDemoted,
        ..*input
    };
    match super::lanes::select(&base, &[MemKey::HOST]) {
        Ok((lanes, _)) => rndv_threshold(&host_lanes_with(&base, &lanes, usize::MAX), input.cfg),
        Err(_) => usize::MAX,
    }
}

/// Host lanes as the host table reads them.
pub(crate) fn host_lanes<'a>(input: &PlanInput<'a>, lanes: &Lanes) -> HostLanes<'a> {
    let cap = match input.cfg.rndv_thresh {
        MemUnits::Auto => undemoted_threshold(input),
        _ => usize::MAX,
    };
    host_lanes_with(input, lanes, cap)
}

fn host_lanes_with<'a>(input: &PlanInput<'a>, lanes: &Lanes, eager_cap: usize) -> HostLanes<'a> {
    let am = &input.lanes[lanes.am];
    HostLanes {
        eager_cap,
        am: (&am.attr, lanes.am),
        am_can_reg: am.md_attr.reg_mem_types().has(rucx_ucs::MemoryType::Host)
            && input
                .reg
                .can_register(am.md, rucx_ucs::MemoryType::Host, None),
        am_reg_cost: am.md_attr.reg_cost,
        rma: lanes.rma.map(|i| (&input.lanes[i].attr, i)),
    }
}

/// The largest GPU message (at most `eager_end`) that goes faster through a pinned bounce buffer
/// than by the large-message protocol `large` (0: none). The bounce costs two copies by the copy
/// lane (out of the sender's GPU, into the receiver's) around one eager message; a rendezvous
/// through a zero-copy GPU lane costs a control round trip and one transfer by that lane, so
/// next to NVLink/IPC or GPUDirect it wins from the first byte; the staged pipeline pays both
/// copies and the round trip, so the bounce wins below the eager limit.
fn bounce_end(
    input: &PlanInput<'_>,
    am: usize,
    copy: usize,
    large: (Proto, usize),
    eager_end: usize,
) -> usize {
    let am = input.lanes[am].attr.perf;
    let cp = input.lanes[copy].attr.perf;
    let data = input.lanes[large.1].attr.perf;
    let bounce = |n: usize| 2.0 * cp.time_ns(n) + am.time_ns(n);
    let large_ns = |n: usize| {
        let ctrl = 2.0 * (am.latency_ns + am.overhead_ns);
        match large.0 {
            Proto::RndvPipeline => ctrl + data.time_ns(n) + 2.0 * cp.time_ns(n),
            _ => ctrl + data.time_ns(n),
        }
    };
    let wins = |n: usize| bounce(n) < large_ns(n);
    if !wins(1) {
        return 0;
    }
    if wins(eager_end) {
        return eager_end;
    }
    // Both costs are linear in the size: the bounce wins up to one crossing.
    let (mut lo, mut hi) = (1usize, eager_end);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if wins(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The active-message table of host memory from its tag table: the eager rows become one
/// copy-in row on the active-message lane (the handler gets the bytes), the rendezvous rows
/// stay (the handler fetches the payload by that rendezvous).
fn am_rows(tag: &[Range], am: usize, input: &PlanInput<'_>) -> Vec<Range> {
    let mut rows: Vec<Range> = Vec::new();
    for r in tag {
        if r.proto.is_rndv() {
            rows.push(r.clone());
            continue;
        }
        match rows.last_mut() {
            Some(l) if l.proto == Proto::AmCopy && l.to.checked_add(1) == Some(r.from) => {
                l.to = r.to
            }
            _ => rows.push(lane_row(r.from, r.to, Proto::AmCopy, am, input)),
        }
    }
    rows
}

/// Every table for sender memory `mem`.
pub(super) fn for_mem(
    input: &PlanInput<'_>,
    lanes: &Lanes,
    mem: MemKey,
    rma: &[RmaPlan],
) -> Vec<OpTable> {
    let hl = host_lanes(input, lanes);
    let host_tag = host_tag(&hl, input.cfg, input);
    let rma_of = |cap: IfaceCaps, op: Op| match lanes.rma {
        None => refused(
            op,
            mem,
            "no transport to this peer supports remote memory access now (check RUCX_TLS and \
             the demotions)",
        ),
        Some(l) if !input.lanes[l].attr.has(cap) => refused(
            op,
            mem,
            format!("{} lacks this operation", input.lanes[l].attr.tl_name),
        ),
        Some(l) => one_row(
            op,
            mem,
            if op == Op::Put {
                Proto::PutZcopy
            } else {
                Proto::GetZcopy
            },
            l,
            input,
        ),
    };
    if !mem.mem.is_gpu() {
        let sync = sync_of(&host_tag, &hl, input.cfg, input);
        let am = am_rows(&host_tag, lanes.am, input);
        return vec![
            OpTable {
                op: Op::Tag,
                mem,
                rows: host_tag,
                notes: Vec::new(),
            },
            OpTable {
                op: Op::TagSync,
                mem,
                rows: sync,
                notes: Vec::new(),
            },
            one_row(Op::Stream, mem, Proto::StreamCopy, lanes.am, input),
            OpTable {
                op: Op::Am,
                mem,
                rows: am,
                notes: Vec::new(),
            },
            rma_of(IfaceCaps::PUT_ZCOPY, Op::Put),
            rma_of(IfaceCaps::GET_ZCOPY, Op::Get),
        ];
    }
    // GPU memory: large messages by a zero-copy GPU lane, else staged through host memory;
    // small ones copied to a pinned bounce buffer and sent eagerly.
    let mut notes = Vec::new();
    let large = match (lanes.gpu(mem), lanes.copy, lanes.rma) {
        (Some(g), _, _) => Some((Proto::RndvGet, g)),
        (None, Some(_), Some(r)) => Some((Proto::RndvPipeline, r)),
        (None, None, _) => {
            notes.push(format!(
                "no zero-copy path reaches {} and no copy transport (cuda_copy) is open to \
                 stage through host memory; check RUCX_TLS and `rucx-info -d`",
                input.peer
            ));
            None
        }
        (None, Some(_), None) => {
            notes.push(
                "no zero-copy path reaches the peer, and staging through host memory needs a \
                 transport with remote memory access (posix or tcp) in RUCX_TLS"
                    .into(),
            );
            None
        }
    };
    let eager_end = host_tag
        .iter()
        .filter(|r| matches!(r.proto, Proto::EagerShort | Proto::EagerBcopy))
        .map(|r| r.to)
        .max()
        .unwrap_or(0);
    let mut tag = Vec::new();
    let mut sync = Vec::new();
    if let Some((p, l)) = large {
        sync.push(lane_row(0, usize::MAX, p, l, input));
        let bounce_end = match lanes.copy {
            Some(c) if eager_end >= 1 => bounce_end(input, lanes.am, c, (p, l), eager_end),
            _ => 0,
        };
        if bounce_end >= 1 {
            tag.push(lane_row(0, 0, p, l, input));
            tag.push(lane_row(1, bounce_end, Proto::EagerBounce, lanes.am, input));
            if bounce_end < usize::MAX {
                tag.push(lane_row(bounce_end + 1, usize::MAX, p, l, input));
            }
        } else {
            tag.push(lane_row(0, usize::MAX, p, l, input));
        }
    }
    // Active messages: small payloads copied out through the copy lane and sent in (the
    // handler gets the bytes), larger ones by the tag rendezvous (the handler fetches them).
    let mut am = Vec::new();
    let am_copy_end = if lanes.copy.is_some() { eager_end } else { 0 };
    if am_copy_end >= 1 {
        am.push(lane_row(0, am_copy_end, Proto::AmCopy, lanes.am, input));
    }
    match large {
        Some((p, l)) if am_copy_end < usize::MAX => {
            let from = if am.is_empty() { 0 } else { am_copy_end + 1 };
            am.push(lane_row(from, usize::MAX, p, l, input));
        }
        // No large path: copied in (in fragments) whatever the size.
        None => {
            if let Some(last) = am.last_mut() {
                last.to = usize::MAX;
            }
        }
        _ => {}
    }
    let mut am_notes = notes.clone();
    if lanes.copy.is_none() {
        am_notes.push(
            "small payloads are copied out of GPU memory by the copy transport (cuda_copy), \
             which is not open: every size goes by rendezvous"
                .into(),
        );
    }
    // Streams: GPU bytes go through host memory, copied by the copy lane.
    let stream = if lanes.copy.is_some() {
        one_row(Op::Stream, mem, Proto::StreamCopy, lanes.am, input)
    } else {
        refused(
            Op::Stream,
            mem,
            "a stream carries GPU memory through host memory, copied by the copy transport \
             (cuda_copy), which is not open; check RUCX_TLS and `rucx-info -d`",
        )
    };
    vec![
        OpTable {
            op: Op::Tag,
            mem,
            rows: tag,
            notes: notes.clone(),
        },
        OpTable {
            op: Op::TagSync,
            mem,
            rows: sync,
            notes,
        },
        stream,
        OpTable {
            op: Op::Am,
            mem,
            rows: am,
            notes: am_notes,
        },
        gpu_rma(Op::Put, mem, rma, input),
        gpu_rma(Op::Get, mem, rma, input),
    ]
}

/// The put or get table of GPU memory `mem`: the first step of its plan against a remote
/// region of GPU memory (the usual case; `RmaPlan`s cover host regions too).
fn gpu_rma(op: Op, mem: MemKey, rma: &[RmaPlan], input: &PlanInput<'_>) -> OpTable {
    let plan = rma
        .iter()
        .find(|r| r.op == op && r.local == mem && r.remote.is_gpu());
    match plan.and_then(|p| p.steps.first().map(|s| (p, *s))) {
        Some((p, step)) => OpTable {
            op,
            mem,
            rows: vec![lane_row(0, usize::MAX, step.proto(op), step.lane(), input)],
            notes: p.notes.clone(),
        },
        None => refused(
            op,
            mem,
            plan.map_or_else(
                || "no plan for this memory".to_string(),
                |p| p.notes.join("; "),
            ),
        ),
    }
}
