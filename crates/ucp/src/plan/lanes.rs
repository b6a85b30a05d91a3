//! Lanes by role, chosen from the candidates' attributes and the live registration view.

use rucx_ucs::MemoryType;
use rucx_uct::{DeviceType, IfaceAttr, IfaceCaps, MdAttr};

use super::{LaneCand, Lanes, MemKey, PlanInput, Unreachable};

/// Whether an interface can serve as the process's memory-type copy lane: an accelerator
/// transport with zero-copy put and get whose domain reaches GPU memory.
pub fn is_copy_lane(attr: &IfaceAttr, md: &MdAttr) -> bool {
    attr.dev_type == DeviceType::Accelerator
        && attr.has(IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY)
        && md.access_mem_types().has(MemoryType::Cuda)
}

/// Lower is better: the active-message lane is the one with the least latency and overhead
/// (priority breaks ties).
fn am_cost(a: &IfaceAttr) -> f64 {
    a.perf.latency_ns + a.perf.overhead_ns - f64::from(a.priority) * 1e-3
}

/// Higher is better: data lanes by bandwidth (priority breaks ties).
fn bw_score(a: &IfaceAttr) -> f64 {
    a.perf.bandwidth + f64::from(a.priority)
}

/// The best candidate by `score` (higher wins; the first of equals), among all and among the
/// connected ones.
fn best(
    lanes: &[LaneCand],
    ok: impl Fn(&LaneCand) -> bool,
    score: impl Fn(&LaneCand) -> f64,
) -> (Option<usize>, Option<usize>) {
    let mut all: Option<(f64, usize)> = None;
    let mut conn: Option<(f64, usize)> = None;
    for (i, l) in lanes.iter().enumerate() {
        if l.copy || l.remote_md.is_none() || !ok(l) {
            continue;
        }
        let s = score(l);
        if all.is_none_or(|(b, _)| s > b) {
            all = Some((s, i));
        }
        if l.connected && conn.is_none_or(|(b, _)| s > b) {
            conn = Some((s, i));
        }
    }
    (all.map(|x| x.1), conn.map(|x| x.1))
}

/// Choose the lanes; also the lanes that would be chosen once connected.
pub(super) fn select(
    input: &PlanInput<'_>,
    keys: &[MemKey],
) -> Result<(Lanes, Vec<usize>), Unreachable> {
    let lanes = input.lanes;
    let mut wanted: Vec<usize> = Vec::new();
    fn want(wanted: &mut Vec<usize>, all: Option<usize>, conn: Option<usize>) -> Option<usize> {
        if let Some(a) = all
            && Some(a) != conn
            && !wanted.contains(&a)
        {
            wanted.push(a);
        }
        conn
    }
    // Active messages carry every control message in order: the lane depends on the
    // transports alone (never on registrations), so it stays the same for the endpoint's life.
    let (am_all, _) = best(
        lanes,
        |l| l.attr.has(IfaceCaps::AM_BCOPY),
        |l| -am_cost(&l.attr),
    );
    let Some(am) = am_all else {
        return Err(Unreachable {
            local: lanes.iter().map(|l| l.name()).collect(),
        });
    };
    if !lanes[am].connected {
        wanted.push(am);
    }
    let reg = |l: &LaneCand, k: MemKey| {
        l.md_attr.reg_mem_types().has(k.mem) && input.reg.can_register(l.md, k.mem, k.dev)
    };
    let (a, c) = best(
        lanes,
        |l| {
            l.attr
                .caps
                .intersects(IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY)
                && l.same_domain()
                && reg(l, MemKey::HOST)
        },
        |l| bw_score(&l.attr),
    );
    let rma = want(&mut wanted, a, c);
    let mut gpu = Vec::new();
    for &k in keys.iter().filter(|k| k.mem.is_gpu()) {
        let (a, c) = best(
            lanes,
            |l| l.attr.has(IfaceCaps::GET_ZCOPY) && l.same_domain() && reg(l, k),
            |l| bw_score(&l.attr),
        );
        gpu.push((k, want(&mut wanted, a, c)));
    }
    // Remote access to the peer's GPU memory: a lane whose domain exports it (the peer's key
    // comes from the same domain). Wanted only once this worker met GPU memory.
    let (a, c) = best(
        lanes,
        |l| {
            l.attr
                .caps
                .intersects(IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY)
                && l.same_domain()
                && l.md_attr.reg_mem_types().has(MemoryType::Cuda)
        },
        |l| bw_score(&l.attr),
    );
    let rma_gpu = if keys.iter().any(|k| k.mem.is_gpu()) {
        want(&mut wanted, a, c)
    } else {
        None
    };
    // Reading a peer's GPU buffer into host memory: the peer's key comes from a domain that
    // exports GPU memory; ours only has to reach host memory. Not in `wanted`: a host-only
    // job connects it when a GPU sender's first message asks for it.
    let (a, c) = best(
        lanes,
        |l| {
            l.attr.has(IfaceCaps::GET_ZCOPY)
                && l.same_domain()
                && l.md_attr.reg_mem_types().has(MemoryType::Cuda)
                && l.md_attr.access_mem_types().has(MemoryType::Host)
        },
        |l| bw_score(&l.attr),
    );
    let gpu_to_host = c.or(a);
    let copy = lanes.iter().position(|l| l.copy);
    Ok((
        Lanes {
            am,
            rma,
            gpu,
            copy,
            rma_gpu,
            gpu_to_host,
        },
        wanted,
    ))
}
