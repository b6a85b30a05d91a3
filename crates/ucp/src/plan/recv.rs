//! The receiver's side of a rendezvous: how the data of a matched request to send comes in.

use rucx_ucs::MemoryType;
use rucx_uct::IfaceCaps;

use super::{Lanes, MemKey, PlanInput, RecvPlan};

/// One way for a rendezvous receive to get its data, tried in the plan's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvStep {
    /// Read the sender's registered buffer straight into ours on `lane` (from GPU memory: a
    /// zero-copy GPU lane, into GPU memory or into host memory).
    Get {
        /// Lane.
        lane: usize,
    },
    /// Give the sender a key to write into our buffer on `lane` (when it asks for that; into GPU
    /// memory from a host buffer, when the sender says it can write through that lane's domain).
    Put {
        /// Lane.
        lane: usize,
    },
    /// On one physical GPU shared with the sender (its buffer's GPU UUID, carried by its
    /// request, is our buffer's), when the sender is the pair's copier
    /// ([`copies_on_shared_gpu`]): give it our key on `lane` and it writes into our buffer, so
    /// that one process issues the copies of both directions (the GPU switching between two
    /// processes' contexts costs ~143 us on an H200 without MPS, a copy in one context ~5 us).
    /// Taken only when the request carries the sender's offer; otherwise the next step (the
    /// read) runs.
    SharedGpuWrite {
        /// Lane.
        lane: usize,
    },
    /// Read the sender's host buffer in fragments on `lane` through staging into GPU memory.
    StagedRead {
        /// Lane.
        lane: usize,
    },
    /// Ask the sender to stage its buffer in host fragments and announce each; read them on
    /// `lane`.
    Pull {
        /// Lane.
        lane: usize,
    },
    /// Ask the sender to stream the data as active messages (host memory only).
    Stream,
}

impl RecvStep {
    /// Name used in tables and the query.
    pub fn name(self) -> &'static str {
        match self {
            RecvStep::Get { .. } => "read from the sender's buffer",
            RecvStep::Put { .. } => "sender writes into the receive buffer",
            RecvStep::SharedGpuWrite { .. } => {
                "sender writes into the receive buffer when it shares our GPU and has the lower worker id"
            }
            RecvStep::StagedRead { .. } => "read through host staging into the GPU",
            RecvStep::Pull { .. } => "sender stages host fragments, receiver reads each",
            RecvStep::Stream => "sender streams active messages",
        }
    }

    /// The lane moving the data (`None`: the active-message lane).
    pub fn lane(self) -> Option<usize> {
        match self {
            RecvStep::Get { lane }
            | RecvStep::Put { lane }
            | RecvStep::SharedGpuWrite { lane }
            | RecvStep::StagedRead { lane }
            | RecvStep::Pull { lane } => Some(lane),
            RecvStep::Stream => None,
        }
    }
}

/// Whether the worker with id `own` issues the copies of both directions between itself and
/// the worker `peer` when their GPU buffers sit on one physical GPU: the lower id does (each
/// side knows both ids, so they agree without asking). Equal ids (never two workers): neither,
/// and each receiver reads, as on different GPUs.
pub fn copies_on_shared_gpu(own: u64, peer: u64) -> bool {
    own < peer
}

/// The steps for a rendezvous from `send` memory into `recv` memory.
pub(super) fn plan(
    input: &PlanInput<'_>,
    lanes: &Lanes,
    send: MemoryType,
    recv: MemKey,
) -> RecvPlan {
    let has = |l: usize, c: IfaceCaps| input.lanes[l].attr.has(c);
    let mut steps = Vec::new();
    let mut notes = Vec::new();
    let rma_get = lanes.rma.filter(|&l| has(l, IfaceCaps::GET_ZCOPY));
    if !send.is_gpu() && !recv.mem.is_gpu() {
        if let Some(l) = rma_get {
            steps.push(RecvStep::Get { lane: l });
        }
        if let Some(l) = lanes.rma.filter(|&l| has(l, IfaceCaps::PUT_ZCOPY)) {
            steps.push(RecvStep::Put { lane: l });
        }
        if lanes.rma.is_none() {
            notes.push(no_rma_lane(input));
        }
        steps.push(RecvStep::Stream);
        return RecvPlan {
            send,
            recv,
            steps,
            notes,
        };
    }
    // 1. GPU to GPU, zero-copy through a lane whose domain registers the receive buffer; GPU
    // to host, through a zero-copy GPU lane whose transport also writes local host memory
    // (cuda_ipc: one device-to-host copy out of the mapped sender's buffer).
    if send.is_gpu() && recv.mem.is_gpu() {
        match lanes.gpu(recv) {
            Some(l) => {
                // On one GPU shared with the sender, the pair's copier issues every copy: when
                // that is the sender, it writes (a lane whose writes are copies the writing
                // process issues on the GPU: cuda_ipc).
                if has(l, IfaceCaps::PUT_ZCOPY | IfaceCaps::LOCAL_COPY) {
                    steps.push(RecvStep::SharedGpuWrite { lane: l });
                }
                steps.push(RecvStep::Get { lane: l });
            }
            None => notes.push(no_gpu_lane(input, recv)),
        }
    } else if send.is_gpu() {
        // A GPU lane of memory this worker met, else the lane that reads a peer's GPU memory
        // into host memory (a host-only receiver).
        let met = lanes.gpu.iter().filter_map(|(_, l)| *l).find(|&l| {
            input.lanes[l]
                .md_attr
                .access_mem_types()
                .has(MemoryType::Host)
        });
        match met.or(lanes.gpu_to_host) {
            Some(l) => steps.push(RecvStep::Get { lane: l }),
            None => notes.push(
                "no zero-copy GPU lane to this peer reads into host memory (cuda_ipc does)".into(),
            ),
        }
    } else {
        // Host to GPU: the sender writes our GPU buffer through the zero-copy GPU lane's mapping
        // of it (cuda_ipc: one host-to-device copy by the sender's copy engine, from pinned
        // memory at the copy bound), when its own lane of that domain reads its host buffer.
        match lanes
            .gpu(recv)
            .filter(|&l| has(l, IfaceCaps::PUT_ZCOPY))
            .filter(|&l| {
                input.lanes[l]
                    .md_attr
                    .access_mem_types()
                    .has(MemoryType::Host)
            }) {
            Some(l) => steps.push(RecvStep::Put { lane: l }),
            None => notes.push(if lanes.gpu(recv).is_some() {
                "the zero-copy GPU lane does not write from host memory".into()
            } else {
                no_gpu_lane(input, recv)
            }),
        }
    }
    // 2. Staged through host memory: needs a lane with remote reads, and a copy lane on the
    // side(s) holding GPU memory (ours is checked here; the sender checks its own).
    let copy_ok = !recv.mem.is_gpu() || lanes.copy.is_some();
    match (rma_get, copy_ok) {
        (Some(l), true) => {
            if !send.is_gpu() {
                steps.push(RecvStep::StagedRead { lane: l });
            }
            steps.push(RecvStep::Pull { lane: l });
        }
        (None, _) => notes.push(
            "GPU transfers without a zero-copy path are staged through host memory, which needs \
             a transport with remote memory access (posix or tcp) in RUCX_TLS"
                .into(),
        ),
        (_, false) => {
            notes.push("no copy transport (cuda_copy) to stage through host memory".into())
        }
    }
    RecvPlan {
        send,
        recv,
        steps,
        notes,
    }
}

/// Why no lane gives remote access to host memory.
fn no_rma_lane(input: &PlanInput<'_>) -> String {
    let demoted: Vec<String> = input
        .lanes
        .iter()
        .filter(|l| {
            !l.copy
                && l.remote_md.as_deref() == Some(l.md_name.as_str())
                && l.attr
                    .caps
                    .intersects(IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY)
                && l.md_attr.reg_mem_types().has(MemoryType::Host)
                && !input.reg.can_register(l.md, MemoryType::Host, None)
        })
        .map(|l| {
            format!(
                "{} cannot register host memory now (see demotions)",
                l.md_name
            )
        })
        .collect();
    if demoted.is_empty() {
        "no transport to this peer has remote memory access".into()
    } else {
        demoted.join("; ")
    }
}

/// Why no zero-copy GPU lane serves `key`.
fn no_gpu_lane(input: &PlanInput<'_>, key: MemKey) -> String {
    let regs: Vec<&super::LaneCand> = input
        .lanes
        .iter()
        .filter(|l| !l.copy && l.md_attr.reg_mem_types().has(key.mem))
        .collect();
    if regs.is_empty() {
        return "no open transport registers GPU memory (cuda_ipc unavailable or left out by \
                RUCX_TLS; see `rucx-info -d`)"
            .into();
    }
    let demoted: Vec<String> = regs
        .iter()
        .filter(|l| !input.reg.can_register(l.md, key.mem, key.dev))
        .map(|l| {
            let why = input.reg.why_not(l.md, key.mem, key.dev);
            if why.is_empty() {
                format!("{} is demoted for {key}", l.md_name)
            } else {
                why
            }
        })
        .collect();
    if !demoted.is_empty() {
        return demoted.join("; ");
    }
    let names: Vec<&str> = regs.iter().map(|l| l.attr.tl_name.as_str()).collect();
    format!(
        "{} does not reach this peer (another host?)",
        names.join(", ")
    )
}

/// The steps for a receive into `recv` from a sender whose memory is `send` (the plan's, or the
/// last resort when the plan has none for this pair).
pub fn recv_steps(plan: &super::EpPlan, send: MemoryType, recv: MemKey) -> &[RecvStep] {
    plan.recv_plan(send, recv).map_or(&[], |r| &r.steps)
}
