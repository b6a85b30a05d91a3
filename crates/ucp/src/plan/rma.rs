//! Remote memory access plans: for a put or get between a local buffer of one memory type and a
//! peer's mapped region of another, the ways to move the data, in order of preference.

use rucx_ucs::MemoryType;
use rucx_uct::IfaceCaps;

use super::{LaneCand, Lanes, MemKey, Op, PlanInput};
use crate::proto::Proto;

/// The remote memory types a plan covers (a mapped region is host or device memory).
pub const RMA_REMOTE: [MemoryType; 2] = [MemoryType::Host, MemoryType::Cuda];

/// One way for a put or get to move its data, tried in the plan's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmaStep {
    /// Straight between the local buffer and the remote region on `lane` (host RMA, or the
    /// copy engine through the peer's mapped GPU buffer: cuda_ipc).
    Zcopy {
        /// Lane.
        lane: usize,
    },
    /// Through pinned host staging: the copy lane copies between the local GPU buffer and a
    /// staging fragment, `lane` moves the fragment to or from the remote region.
    Staged {
        /// Lane.
        lane: usize,
    },
}

impl RmaStep {
    /// The lane that reaches the remote region.
    pub fn lane(self) -> usize {
        match self {
            RmaStep::Zcopy { lane } | RmaStep::Staged { lane } => lane,
        }
    }

    /// The protocol of this step for `op` (put or get).
    pub fn proto(self, op: Op) -> Proto {
        match (self, op == Op::Put) {
            (RmaStep::Zcopy { .. }, true) => Proto::PutZcopy,
            (RmaStep::Zcopy { .. }, false) => Proto::GetZcopy,
            (RmaStep::Staged { .. }, true) => Proto::PutStaged,
            (RmaStep::Staged { .. }, false) => Proto::GetStaged,
        }
    }
}

/// How a put or get between local `local` memory and remote `remote` memory moves its data.
#[derive(Clone, Debug, PartialEq)]
pub struct RmaPlan {
    /// [`Op::Put`] or [`Op::Get`].
    pub op: Op,
    /// The initiator's buffer.
    pub local: MemKey,
    /// The mapped remote region's memory type.
    pub remote: MemoryType,
    /// Steps to try in order; the first whose registrations and keys work carries the data.
    pub steps: Vec<RmaStep>,
    /// Why faster steps are missing (or why there is none).
    pub notes: Vec<String>,
}

/// Whether `l`'s domain can hand `k` memory of this process to its transport now: registered
/// (not demoted), or only described (cuda_ipc's local host side of a copy).
pub(crate) fn local_ok(input: &PlanInput<'_>, l: &LaneCand, k: MemKey) -> bool {
    if l.md_attr.reg_mem_types().has(k.mem) {
        input.reg.can_register(l.md, k.mem, k.dev)
    } else {
        !k.mem.is_gpu() && !l.md_attr.need_memh_for_zcopy && l.md_attr.access_mem_types().has(k.mem)
    }
}

/// The plan of `op` from local `local` memory to a remote region of `remote` memory.
pub(super) fn plan(
    input: &PlanInput<'_>,
    lanes: &Lanes,
    op: Op,
    local: MemKey,
    remote: MemoryType,
) -> RmaPlan {
    let cap = if op == Op::Put {
        IfaceCaps::PUT_ZCOPY
    } else {
        IfaceCaps::GET_ZCOPY
    };
    let mut steps = Vec::new();
    let mut notes = Vec::new();
    let lane = if remote.is_gpu() {
        lanes.rma_gpu
    } else {
        lanes.rma
    };
    match lane {
        None if remote.is_gpu() => notes.push(
            "no transport to this peer exports GPU memory (cuda_ipc: same host, in RUCX_TLS, not \
             demoted; see `rucx-info -d`)"
                .into(),
        ),
        None => notes.push(
            "no transport to this peer supports remote memory access to host memory now (check \
             RUCX_TLS and the demotions)"
                .into(),
        ),
        Some(l) if !input.lanes[l].attr.has(cap) => notes.push(format!(
            "{} lacks {}",
            input.lanes[l].attr.tl_name,
            if op == Op::Put { "put" } else { "get" }
        )),
        Some(l) => {
            let cand = &input.lanes[l];
            if local_ok(input, cand, local) {
                steps.push(RmaStep::Zcopy { lane: l });
            } else {
                let why = if cand.md_attr.reg_mem_types().has(local.mem) {
                    let w = input.reg.why_not(cand.md, local.mem, local.dev);
                    if w.is_empty() {
                        format!("{} is demoted for {local}", cand.md_name)
                    } else {
                        w
                    }
                } else {
                    format!("{} does not register {local} memory", cand.md_name)
                };
                notes.push(why);
            }
            if local.mem.is_gpu() {
                match lanes.copy {
                    None => notes.push(
                        "no copy transport (cuda_copy) is open to stage through host memory; \
                         check RUCX_TLS"
                            .into(),
                    ),
                    Some(_) if !local_ok(input, cand, MemKey::HOST) => notes.push(format!(
                        "{} cannot take host staging memory now",
                        cand.md_name
                    )),
                    Some(_) => steps.push(RmaStep::Staged { lane: l }),
                }
            }
        }
    }
    RmaPlan {
        op,
        local,
        remote,
        steps,
        notes,
    }
}
