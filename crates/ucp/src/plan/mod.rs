//! The planner: a pure function from what an endpoint can use to what it does.
//!
//! Input ([`PlanInput`]): the local interfaces as lane candidates (attributes of the interface
//! and its memory domain, whether the peer's address offers the same transport and it is
//! reachable, whether an endpoint exists yet), the live registration view ([`RegView`]:
//! demotions so far), the GPU memory keys the worker has met, and the configuration.
//!
//! Output ([`EpPlan`]): lanes per role (active messages, host remote memory access, zero-copy
//! GPU access per memory type and device, the in-process copy lane), and for every operation and
//! sender memory type a table of size ranges with the protocol for each; for every pair of
//! sender and receiver memory types the receiver's rendezvous steps, in order of preference.
//! Sends, rendezvous receives, the capability query, `RUCX_PROTO_INFO` and `rucx-info -e` all
//! read the same plan, so what is reported is what is done.
//!
//! No I/O and no interior mutability here: a demotion changes the registration view, the worker
//! plans again, and a better lane may win.

use std::fmt;

use rucx_ucs::{Config, MemUnits, MemoryType};
use rucx_uct::{IfaceAttr, MdAttr};

use crate::proto::{Proto, Range};

mod display;
mod lanes;
mod query;
mod recv;
mod rma;
mod tables;
#[cfg(test)]
mod tests;

pub use lanes::is_copy_lane;
pub use query::{PAIRS, PathInfo, SHARED_GPU_NOTE, large_path, paths};
pub use recv::{RecvStep, copies_on_shared_gpu, recv_steps};
pub use rma::{RMA_REMOTE, RmaPlan, RmaStep};

/// Memory of one type on one device (`None` for host memory, or GPU memory of an unknown
/// device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemKey {
    /// Memory type.
    pub mem: MemoryType,
    /// GPU ordinal.
    pub dev: Option<u32>,
}

impl MemKey {
    /// Host memory.
    pub const HOST: MemKey = MemKey {
        mem: MemoryType::Host,
        dev: None,
    };

    /// Memory of type `mem` on device `dev`.
    pub fn new(mem: MemoryType, dev: Option<u32>) -> Self {
        MemKey {
            mem,
            dev: if mem.is_gpu() { dev } else { None },
        }
    }
}

impl fmt::Display for MemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dev {
            Some(d) => write!(f, "{} (GPU {d})", self.mem),
            None => write!(f, "{}", self.mem),
        }
    }
}

/// An operation the plan has a table for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Tagged send.
    Tag,
    /// Synchronous tagged send (completes once the receiver matched it).
    TagSync,
    /// Byte-stream send.
    Stream,
    /// User active message.
    Am,
    /// Remote write.
    Put,
    /// Remote read.
    Get,
}

impl Op {
    /// Every operation, in display order.
    pub const ALL: [Op; 6] = [Op::Tag, Op::TagSync, Op::Stream, Op::Am, Op::Put, Op::Get];

    /// Name used in tables.
    pub fn name(self) -> &'static str {
        match self {
            Op::Tag => "tag send",
            Op::TagSync => "synchronous tag send",
            Op::Stream => "stream send",
            Op::Am => "active message",
            Op::Put => "put",
            Op::Get => "get",
        }
    }
}

/// The rendezvous scheme asked for (`RUCX_RNDV_SCHEME`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Chosen from the lanes.
    Auto,
    /// The receiver reads.
    Get,
    /// The sender writes.
    Put,
    /// The sender streams active messages.
    Am,
}

/// `RUCX_RNDV_SPLIT_THRESH`'s default: 64 KiB. On shared memory between two cores that do not
/// share their caches, an eager message moves every line dirty from the sender's cache to the
/// receiver's (twice copied, both copies waiting on the other core), while the split read copies
/// once, half on each side, through the kernel; measured on the 2-vCPU build machine
/// (`tag_bw` / `tag_lat`): 64 KiB eager 2.0-2.3 GB/s / 27-30 us, split 4.8-6.4 GB/s / 8.0-8.2 us;
/// 128 KiB eager 1.8-2.3 GB/s / 52-59 us, split 6.4-11.2 GB/s / 10.4-10.6 us. (When the two vCPUs
/// share a core's caches, eager wins at 64 KiB: 10-20 GB/s against 6.2-6.6.)
pub const DEFAULT_SPLIT_THRESH: usize = 64 << 10;

/// The configuration the planner reads, parsed once.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    /// `RUCX_RNDV_THRESH`.
    pub rndv_thresh: MemUnits,
    /// `RUCX_ZCOPY_THRESH`.
    pub zcopy_thresh: MemUnits,
    /// `RUCX_RNDV_SCHEME`.
    pub scheme: Scheme,
    /// `RUCX_RNDV_SPLIT_THRESH`, resolved (`usize::MAX`: never split).
    pub split_thresh: usize,
}

impl PlanConfig {
    /// Read the protocol layer's options.
    pub fn from_config(cfg: &Config) -> Self {
        let scheme = match cfg.string("RNDV_SCHEME") {
            "get_zcopy" => Scheme::Get,
            "put_zcopy" => Scheme::Put,
            "am" => Scheme::Am,
            _ => Scheme::Auto,
        };
        PlanConfig {
            rndv_thresh: cfg.mem_units("RNDV_THRESH"),
            zcopy_thresh: cfg.mem_units("ZCOPY_THRESH"),
            scheme,
            split_thresh: cfg
                .mem_units("RNDV_SPLIT_THRESH")
                .resolve(DEFAULT_SPLIT_THRESH as u64)
                .min(usize::MAX as u64) as usize,
        }
    }

    /// The defaults (every option `auto`).
    pub fn defaults() -> Self {
        PlanConfig {
            rndv_thresh: MemUnits::Auto,
            zcopy_thresh: MemUnits::Auto,
            scheme: Scheme::Auto,
            split_thresh: DEFAULT_SPLIT_THRESH,
        }
    }
}

/// One local interface as the planner sees it.
#[derive(Clone, Debug)]
pub struct LaneCand {
    /// The interface's attributes.
    pub attr: IfaceAttr,
    /// Index of its memory domain in the context (what [`RegView`] is asked about).
    pub md: usize,
    /// Name of its memory domain.
    pub md_name: String,
    /// Its memory domain's attributes.
    pub md_attr: MdAttr,
    /// The peer offers this transport and it is reachable: the name of the peer's domain behind
    /// it. `None`: not a lane to this peer.
    pub remote_md: Option<String>,
    /// An endpoint to the peer exists on it (the planner chooses only connected lanes, and lists
    /// the others it would choose in [`EpPlan::wanted`]).
    pub connected: bool,
    /// The process's memory-type copy lane (host <-> GPU copies in this process, never a lane to
    /// a peer).
    pub copy: bool,
}

impl LaneCand {
    /// `transport/device`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.attr.tl_name, self.attr.dev_name)
    }

    /// Whether the peer shares this lane's domain (remote keys of one side unpack on the other).
    fn same_domain(&self) -> bool {
        self.remote_md.as_deref() == Some(self.md_name.as_str())
    }
}

/// The live registration view: which domains may register which memory now.
pub trait RegView {
    /// Whether domain `md` may register `mem` memory of device `dev` now (not demoted).
    fn can_register(&self, md: usize, mem: MemoryType, dev: Option<u32>) -> bool;

    /// Why not, for the query (e.g. the demotion's reason); empty when unknown.
    fn why_not(&self, _md: usize, _mem: MemoryType, _dev: Option<u32>) -> String {
        String::new()
    }
}

/// Everything the planner reads.
#[derive(Clone, Copy)]
pub struct PlanInput<'a> {
    /// Local interfaces, by index (the plan's lane numbers index this slice).
    pub lanes: &'a [LaneCand],
    /// Live registration view.
    pub reg: &'a dyn RegView,
    /// Configuration.
    pub cfg: &'a PlanConfig,
    /// GPU memory keys to plan for besides host memory (those the worker has met).
    pub gpu_keys: &'a [MemKey],
    /// Describes the peer, for messages.
    pub peer: &'a str,
}

impl fmt::Debug for PlanInput<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanInput")
            .field(
                "lanes",
                &self.lanes.iter().map(|l| l.name()).collect::<Vec<_>>(),
            )
            .field("gpu_keys", &self.gpu_keys)
            .field("peer", &self.peer)
            .finish()
    }
}

/// A table for one operation on one sender memory type.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTable {
    /// Operation.
    pub op: Op,
    /// Sender's memory.
    pub mem: MemKey,
    /// Size ranges, covering `0..=usize::MAX` exactly once; empty when refused.
    pub rows: Vec<Range>,
    /// Why the operation is refused for this memory (empty rows), or why a faster path is not
    /// taken.
    pub notes: Vec<String>,
}

impl OpTable {
    /// The row for `size`.
    #[inline]
    pub fn lookup(&self, size: usize) -> Option<&Range> {
        self.rows.iter().find(|r| r.from <= size && size <= r.to)
    }

    /// The refusal to report when no row covers a size.
    pub fn refusal(&self, peer: &str) -> rucx_ucs::Error {
        rucx_ucs::Error::Unsupported {
            what: format!("a {} from {} memory to {peer}", self.op.name(), self.mem),
            why: if self.notes.is_empty() {
                "no protocol covers it".into()
            } else {
                self.notes.join("; ")
            },
        }
    }
}

/// The receiver's plan for a rendezvous from `send` memory into `recv` memory.
#[derive(Clone, Debug, PartialEq)]
pub struct RecvPlan {
    /// Sender's memory type (as the rendezvous request says: GPU or not).
    pub send: MemoryType,
    /// Receiver's memory.
    pub recv: MemKey,
    /// Steps to try in order; the first that works carries the data.
    pub steps: Vec<RecvStep>,
    /// Why faster steps are missing.
    pub notes: Vec<String>,
}

/// The lanes of an endpoint by role.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Lanes {
    /// Active messages (control and eager data).
    pub am: usize,
    /// Remote memory access on host memory (rendezvous, put/get, staged fragments).
    pub rma: Option<usize>,
    /// Zero-copy access to GPU memory, per memory key.
    pub gpu: Vec<(MemKey, Option<usize>)>,
    /// The in-process copy lane (host <-> GPU).
    pub copy: Option<usize>,
    /// Remote memory access to the peer's GPU memory: a lane whose domain exports GPU memory
    /// (cuda_ipc). Chosen once this worker met GPU memory (its own, or a peer's mapped region).
    pub rma_gpu: Option<usize>,
    /// Reads a peer's GPU buffer into local host memory: a lane with zero-copy get whose domain
    /// (the peer's too) exports GPU memory and reaches local host memory (cuda_ipc: one
    /// device-to-host copy out of the mapped sender's buffer, into pinned memory at the copy
    /// engine's bound). Chosen whether or not this worker met GPU memory: a host-only receiver
    /// of a GPU sender reads through it. May be a lane not connected yet (the read waits for
    /// its connection).
    pub gpu_to_host: Option<usize>,
}

impl Lanes {
    /// The zero-copy GPU lane for `key`.
    pub fn gpu(&self, key: MemKey) -> Option<usize> {
        self.gpu
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, l)| *l)
    }
}

/// An endpoint's plan.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct EpPlan {
    /// The peer, as described in messages.
    pub peer: String,
    /// Names of the local lanes (`transport/device`), by index.
    pub lane_names: Vec<String>,
    /// Lanes by role.
    pub lanes: Lanes,
    /// Tables per operation and sender memory.
    pub tables: Vec<OpTable>,
    /// Refusals for GPU memory the plan was not made for (one per operation).
    unplanned: Vec<OpTable>,
    /// Receiver plans per pair of memory types.
    pub recv: Vec<RecvPlan>,
    /// Put and get plans per pair of local and remote memory types.
    pub rma: Vec<RmaPlan>,
    /// Lanes the plan would use once connected (empty when every chosen lane is connected).
    pub wanted: Vec<usize>,
    /// Below this size a rendezvous read is not split with the sender's writes.
    pub split_thresh: usize,
    /// The sizes (`from..=to`) a tag send of host memory takes eager-short by, when one row of
    /// its table says so (what [`select`](Self::select) answers, without the look-ups: the
    /// in-place send asks it for every small message).
    pub short_tag_host: Option<(usize, usize)>,
}

impl EpPlan {
    /// The table of `op` for sender memory `mem`: the one planned for that memory type and
    /// device, else for that memory type on any device; GPU memory the plan was not made for
    /// is refused (the worker plans for every GPU it meets before it looks).
    #[inline]
    pub fn table(&self, op: Op, mem: MemKey) -> &OpTable {
        self.tables
            .iter()
            .find(|t| t.op == op && t.mem == mem)
            .or_else(|| {
                self.tables
                    .iter()
                    .find(|t| t.op == op && t.mem.mem == mem.mem && t.mem.dev.is_none())
            })
            .or_else(|| self.unplanned.iter().find(|t| t.op == op))
            .expect("every plan has a refusal per operation")
    }

    /// The protocol of a send of `op` (tag, synchronous tag), `len` bytes of memory `mem`: what
    /// a new send takes, and what a send whose registration failed is re-selected for from the
    /// plan made after the failure (a synchronous send reads the synchronous table, whose rows
    /// all wait for the receiver's match).
    #[inline]
    pub fn select(&self, op: Op, mem: MemKey, len: usize) -> Option<Proto> {
        self.table(op, mem).lookup(len).map(|r| r.proto)
    }

    /// Whether the plan has tables for `mem`.
    pub fn has_mem(&self, mem: MemKey) -> bool {
        self.tables.iter().any(|t| t.mem == mem)
    }

    /// The receiver's plan for a rendezvous from `send` memory into `recv`.
    pub fn recv_plan(&self, send: MemoryType, recv: MemKey) -> Option<&RecvPlan> {
        self.recv
            .iter()
            .find(|r| r.send == send && r.recv == recv)
            .or_else(|| {
                self.recv
                    .iter()
                    .find(|r| r.send == send && r.recv.mem == recv.mem)
            })
    }

    /// The plan of a put or get (`op`) between local `local` memory and a remote region of
    /// `remote` memory: the one made for that device, else for that memory type on any device.
    pub fn rma_plan(&self, op: Op, local: MemKey, remote: MemoryType) -> Option<&RmaPlan> {
        let remote = if remote.is_gpu() {
            MemoryType::Cuda
        } else {
            MemoryType::Host
        };
        self.rma
            .iter()
            .find(|r| r.op == op && r.local == local && r.remote == remote)
            .or_else(|| {
                self.rma.iter().find(|r| {
                    r.op == op
                        && r.local.mem == local.mem
                        && r.local.dev.is_none()
                        && r.remote == remote
                })
            })
            .or_else(|| {
                self.rma
                    .iter()
                    .find(|r| r.op == op && r.local.mem == local.mem && r.remote == remote)
            })
    }

    /// `transport/device` of lane `i`.
    pub fn lane_name(&self, i: usize) -> &str {
        self.lane_names.get(i).map_or("-", |s| s.as_str())
    }
}

/// Why no endpoint can be planned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreachable {
    /// Local lanes.
    pub local: Vec<String>,
}

/// Plan an endpoint. `Err`: no lane carries active messages to the peer.
pub fn plan(input: PlanInput<'_>) -> Result<EpPlan, Unreachable> {
    let mut keys = vec![MemKey::HOST];
    for k in input.gpu_keys {
        if k.mem.is_gpu() && !keys.contains(k) {
            keys.push(*k);
        }
    }
    let (lanes, wanted) = lanes::select(&input, &keys)?;
    let mut rma = Vec::new();
    for op in [Op::Put, Op::Get] {
        for &k in &keys {
            for r in RMA_REMOTE {
                rma.push(rma::plan(&input, &lanes, op, k, r));
            }
        }
    }
    let mut tables = Vec::new();
    for &k in &keys {
        tables.extend(tables::for_mem(&input, &lanes, k, &rma));
    }
    let mut recv = Vec::new();
    for send in [MemoryType::Host, MemoryType::Cuda] {
        for &r in &keys {
            recv.push(recv::plan(&input, &lanes, send, r));
        }
    }
    let unplanned = Op::ALL
        .iter()
        .map(|&op| OpTable {
            op,
            mem: MemKey::new(MemoryType::Unknown, None),
            rows: Vec::new(),
            notes: vec!["this memory was not planned for (no domain detects it)".into()],
        })
        .collect();
    let mut plan = EpPlan {
        peer: input.peer.to_string(),
        lane_names: input.lanes.iter().map(|l| l.name()).collect(),
        lanes,
        tables,
        unplanned,
        recv,
        rma,
        wanted,
        split_thresh: if input.cfg.scheme == Scheme::Auto {
            input.cfg.split_thresh
        } else {
            usize::MAX
        },
        short_tag_host: None,
    };
    let host = plan.table(Op::Tag, MemKey::new(MemoryType::Host, None));
    let mut short = host.rows.iter().filter(|r| r.proto == Proto::EagerShort);
    plan.short_tag_host = match (short.next(), short.next()) {
        (Some(r), None) => Some((r.from, r.to)),
        _ => None,
    };
    Ok(plan)
}

/// Planning helpers shared by the sub-modules.
fn lane_row(from: usize, to: usize, proto: Proto, lane: usize, input: &PlanInput<'_>) -> Range {
    Range {
        from,
        to,
        proto,
        lane: input
            .lanes
            .get(lane)
            .map_or_else(|| "-".into(), |l| l.name()),
    }
}
