//! The capability query, read off a plan: which path large messages of each pair of memory
//! types take, whether it is zero-copy, and why a faster path is not taken.

use rucx_ucs::MemoryType;

use super::{EpPlan, MemKey, Op, RecvStep, RmaStep};
use crate::proto::Proto;

/// Which path buffers of a given pair of memory types take on an endpoint, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathInfo {
    /// The operation: [`Op::Tag`] (large tagged messages), [`Op::Put`] or [`Op::Get`].
    pub op: Op,
    /// Where the data comes from: the sender's memory type (for a put the local buffer's, for
    /// a get the remote region's).
    pub send_mem: MemoryType,
    /// Where the data goes: the receiver's memory type (for a put the remote region's, for a
    /// get the local buffer's).
    pub recv_mem: MemoryType,
    /// Protocol for large messages.
    pub protocol: String,
    /// `transport/device` moving the data.
    pub lane: String,
    /// True when no intermediate copy is made.
    pub zero_copy: bool,
    /// Why a faster path is not taken (when zero-copy: only the buffers the lane's domain
    /// refused, which took another path, if any).
    pub why_not: Vec<String>,
}

impl std::fmt::Display for PathInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.op != Op::Tag {
            write!(f, "{} ", self.op.name())?;
        }
        write!(
            f,
            "{} -> {}: {} on {}{}",
            self.send_mem,
            self.recv_mem,
            self.protocol,
            self.lane,
            if self.zero_copy { " (zero-copy)" } else { "" }
        )?;
        for w in &self.why_not {
            write!(f, "; {w}")?;
        }
        Ok(())
    }
}

/// What the query adds to a path whose plan has [`RecvStep::SharedGpuWrite`].
pub const SHARED_GPU_NOTE: &str = " (buffers on one GPU shared with the peer: the lower-id \
     process issues every copy, writing into the receiver's buffer for its sends)";

/// The pairs the query answers for, in order.
pub const PAIRS: [(MemoryType, MemoryType); 4] = [
    (MemoryType::Host, MemoryType::Host),
    (MemoryType::Cuda, MemoryType::Cuda),
    (MemoryType::Cuda, MemoryType::Host),
    (MemoryType::Host, MemoryType::Cuda),
];

/// The protocol (and its lane) a large message from `send` into `recv` takes by `plan`: the
/// sender's row for the largest size, then, for a rendezvous involving GPU memory, the first
/// step of the receiver's plan.
pub fn large_path(plan: &EpPlan, send: MemKey, recv: MemKey) -> Option<(Proto, String)> {
    let t = plan.table(Op::Tag, send);
    let row = t.rows.last()?;
    if !send.mem.is_gpu() && !recv.mem.is_gpu() {
        return Some((row.proto, row.lane.clone()));
    }
    let rp = plan.recv_plan(
        if send.mem.is_gpu() {
            MemoryType::Cuda
        } else {
            MemoryType::Host
        },
        recv,
    )?;
    // The shared-GPU write is taken only for buffers on one GPU: the path is the step after.
    let step = *rp
        .steps
        .iter()
        .find(|s| !matches!(s, RecvStep::SharedGpuWrite { .. }))?;
    let proto = match step {
        RecvStep::Get { .. } if send.mem.is_gpu() && recv.mem.is_gpu() => Proto::RndvGet,
        RecvStep::Get { .. } => Proto::RndvGet,
        RecvStep::Put { .. } | RecvStep::SharedGpuWrite { .. } => Proto::RndvPut,
        RecvStep::StagedRead { .. } | RecvStep::Pull { .. } => Proto::RndvPipeline,
        RecvStep::Stream => Proto::RndvAm,
    };
    let lane = step
        .lane()
        .map_or_else(|| row.lane.clone(), |l| plan.lane_name(l).to_string());
    Some((proto, lane))
}

/// The query for every pair of [`PAIRS`], GPU memory of `device`: large tagged messages first
/// (in the order of `PAIRS`), then puts and gets.
pub fn paths(plan: &EpPlan, device: Option<u32>) -> Vec<PathInfo> {
    let mut out = Vec::new();
    for (s, r) in PAIRS {
        let (sk, rk) = (MemKey::new(s, device), MemKey::new(r, device));
        let t = plan.table(Op::Tag, sk);
        let mut why: Vec<String> = t.notes.clone();
        let rp = plan.recv_plan(
            if s.is_gpu() {
                MemoryType::Cuda
            } else {
                MemoryType::Host
            },
            rk,
        );
        let (mut protocol, lane, zero_copy) = match large_path(plan, sk, rk) {
            Some((p, l)) => (p.name().to_string(), l, p.is_zcopy()),
            None => ("unsupported".to_string(), "-".to_string(), false),
        };
        if let Some(rp) = rp
            && rp
                .steps
                .iter()
                .any(|s| matches!(s, RecvStep::SharedGpuWrite { .. }))
        {
            protocol.push_str(SHARED_GPU_NOTE);
        }
        if !zero_copy && let Some(rp) = rp {
            for n in &rp.notes {
                if !why.contains(n) {
                    why.push(n.clone());
                }
            }
        }
        if zero_copy {
            why.clear();
        }
        out.push(PathInfo {
            op: Op::Tag,
            send_mem: s,
            recv_mem: r,
            protocol,
            lane,
            zero_copy,
            why_not: why,
        });
    }
    for op in [Op::Put, Op::Get] {
        for (s, r) in PAIRS {
            // A put moves local (`s`) to remote (`r`); a get remote (`s`) to local (`r`).
            let (local, remote) = if op == Op::Put { (s, r) } else { (r, s) };
            let lk = MemKey::new(local, device);
            let (protocol, lane, zero_copy, why_not) = match plan.rma_plan(op, lk, remote) {
                Some(rp) => match rp.steps.first() {
                    Some(step) => {
                        let zc = matches!(step, RmaStep::Zcopy { .. });
                        (
                            step.proto(op).name().to_string(),
                            plan.lane_name(step.lane()).to_string(),
                            zc,
                            if zc { Vec::new() } else { rp.notes.clone() },
                        )
                    }
                    None => (
                        "unsupported".to_string(),
                        "-".to_string(),
                        false,
                        rp.notes.clone(),
                    ),
                },
                None => (
                    "unsupported".to_string(),
                    "-".to_string(),
                    false,
                    vec![format!("{local} memory was not planned for")],
                ),
            };
            out.push(PathInfo {
                op,
                send_mem: s,
                recv_mem: r,
                protocol,
                lane,
                zero_copy,
                why_not,
            });
        }
    }
    out
}
