//! Planner tests on synthetic machines built from attributes: the expected plan of each machine
//! is kept as text (`expected/*.txt`; regenerate with `RUCX_BLESS=1` and review the diff), plus
//! targeted assertions and invariants checked over random machines.

use std::collections::HashSet;

use proptest::prelude::*;
use rucx_ucs::{MemUnits, MemoryType};
use rucx_uct::{
    DeviceType, IfaceAttr, IfaceCaps, IfaceLimits, LinearCost, MdAttr, MemTypeFlags, PerfModel,
};

use super::*;

const RW: MemTypeFlags = MemTypeFlags::REG.union(MemTypeFlags::ACCESS);

fn iface(tl: &str, dev: &str, ty: DeviceType, caps: IfaceCaps, perf: (f64, f64, f64)) -> IfaceAttr {
    IfaceAttr {
        tl_name: tl.into(),
        dev_name: dev.into(),
        dev_type: ty,
        sys_device: None,
        caps,
        limits: IfaceLimits {
            am_max_short: 0,
            am_max_bcopy: 0,
            am_max_zcopy: 0,
            am_max_hdr: 0,
            put_max_short: 0,
            put_max_zcopy: 1 << 30,
            get_max_zcopy: 1 << 30,
            max_iov: 4,
        },
        perf: PerfModel {
            latency_ns: perf.0,
            overhead_ns: perf.1,
            bandwidth: perf.2,
        },
        priority: 0,
        device_addr_len: 0,
        iface_addr_len: 0,
        ep_addr_len: 0,
        max_eps: None,
    }
}

fn am_caps() -> IfaceCaps {
    IfaceCaps::AM_SHORT
        | IfaceCaps::AM_BCOPY
        | IfaceCaps::AM_ZCOPY
        | IfaceCaps::PUT_ZCOPY
        | IfaceCaps::GET_ZCOPY
}

fn with_am(mut a: IfaceAttr, short: usize, bcopy: usize, hdr: usize) -> IfaceAttr {
    a.limits.am_max_short = short;
    a.limits.am_max_bcopy = bcopy;
    a.limits.am_max_zcopy = bcopy;
    a.limits.am_max_hdr = hdr;
    a
}

fn md(name: &str, types: &[(MemoryType, MemTypeFlags)], reg_ns: f64) -> MdAttr {
    let mut m = MdAttr::new(name);
    for (t, f) in types {
        m = m.with(*t, *f);
    }
    m.reg_cost = LinearCost::fixed(reg_ns);
    m
}

/// A lane of a synthetic machine: the peer offers it and it is connected.
fn lane(md_name: &str, attr: IfaceAttr, md_attr: MdAttr) -> LaneCand {
    LaneCand {
        attr,
        md: 0,
        md_name: md_name.into(),
        md_attr,
        remote_md: Some(md_name.into()),
        connected: true,
        copy: false,
    }
}

fn posix() -> LaneCand {
    let a = with_am(
        iface(
            "posix",
            "memory",
            DeviceType::IntraNode,
            am_caps(),
            (150.0, 30.0, 6e9),
        ),
        8184,
        8192,
        128,
    );
    lane("posix", a, md("posix", &[(MemoryType::Host, RW)], 20.0))
}

fn tcp(dev: &str) -> LaneCand {
    let a = with_am(
        iface(
            "tcp",
            dev,
            DeviceType::Network,
            am_caps(),
            (10_000.0, 1_000.0, 1.2e9),
        ),
        4096,
        65536,
        128,
    );
    lane("tcp", a, md("tcp", &[(MemoryType::Host, RW)], 100.0))
}

fn cuda_copy() -> LaneCand {
    let a = iface(
        "cuda_copy",
        "cuda",
        DeviceType::Accelerator,
        IfaceCaps::PUT_SHORT | IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY,
        (8_000.0, 2_000.0, 50e9),
    );
    let m = md(
        "cuda_cpy",
        &[
            (MemoryType::Host, RW),
            (
                MemoryType::Cuda,
                MemTypeFlags::ACCESS | MemTypeFlags::DETECT | MemTypeFlags::ALLOC,
            ),
        ],
        15_000.0,
    );
    let mut l = lane("cuda_cpy", a, m);
    l.remote_md = None;
    l.copy = true;
    l
}

fn cuda_ipc() -> LaneCand {
    let a = iface(
        "cuda_ipc",
        "cuda",
        DeviceType::Accelerator,
        // As the real transport: its operations are copies this process issues.
        IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY | IfaceCaps::LOCAL_COPY,
        (10_000.0, 3_000.0, 350e9),
    );
    let mut m = md(
        "cuda_ipc",
        &[
            (MemoryType::Cuda, RW),
            (MemoryType::Host, MemTypeFlags::ACCESS),
        ],
        5_000.0,
    );
    // As the real domain: local buffers of a copy are described, not registered.
    m.need_memh_for_zcopy = false;
    lane("cuda_ipc", a, m)
}

/// An RC lane on a NIC; `gpu`: its domain registers GPU memory (peer memory or dma-buf).
fn rc(gpu: Option<MemTypeFlags>) -> LaneCand {
    let a = with_am(
        iface(
            "rc_verbs",
            "mlx5_0:1",
            DeviceType::Network,
            am_caps() | IfaceCaps::PUT_SHORT,
            (700.0, 75.0, 12e9),
        ),
        124,
        8192,
        64,
    );
    let mut types = vec![(MemoryType::Host, RW)];
    if let Some(f) = gpu {
        types.push((MemoryType::Cuda, f));
    }
    lane("mlx5_0", a, md("mlx5_0", &types, 20_000.0))
}

fn gdr_copy() -> LaneCand {
    let a = iface(
        "gdr_copy",
        "cuda",
        DeviceType::Accelerator,
        IfaceCaps::PUT_SHORT | IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY,
        (1_000.0, 500.0, 10e9),
    );
    let mut l = lane(
        "gdr_copy",
        a,
        md("gdr_copy", &[(MemoryType::Cuda, RW)], 2_000.0),
    );
    // Reaches this process's GPU memory only.
    l.remote_md = None;
    l
}

/// Demotions of a synthetic machine: (domain index, memory type, device).
#[derive(Default)]
struct Demoted(Vec<(usize, MemoryType, Option<u32>)>);

impl RegView for Demoted {
    fn can_register(&self, md: usize, mem: MemoryType, dev: Option<u32>) -> bool {
        !self
            .0
            .iter()
            .any(|(m, t, d)| *m == md && *t == mem && (d.is_none() || *d == dev))
    }
}

/// Number the lanes' domains by name (the index `RegView` is asked about).
fn machine(mut lanes: Vec<LaneCand>) -> Vec<LaneCand> {
    let mut names: Vec<String> = Vec::new();
    for l in &mut lanes {
        l.md = match names.iter().position(|n| *n == l.md_name) {
            Some(i) => i,
            None => {
                names.push(l.md_name.clone());
                names.len() - 1
            }
        };
    }
    lanes
}

fn md_of(lanes: &[LaneCand], name: &str) -> usize {
    lanes.iter().find(|l| l.md_name == name).unwrap().md
}

fn plan_of(lanes: &[LaneCand], reg: &Demoted, cfg: &PlanConfig, gpus: &[MemKey]) -> EpPlan {
    plan(PlanInput {
        lanes,
        reg,
        cfg,
        gpu_keys: gpus,
        peer: "peer",
    })
    .unwrap()
}

const GPU0: MemKey = MemKey {
    mem: MemoryType::Cuda,
    dev: Some(0),
};
const GPU1: MemKey = MemKey {
    mem: MemoryType::Cuda,
    dev: Some(1),
};

/// Compare with `expected/NAME.txt` (written instead with `RUCX_BLESS=1`).
fn expect(name: &str, plan: &EpPlan) {
    let text = format!("{plan}");
    let path = format!(
        "{}/src/plan/expected/{name}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    if std::env::var_os("RUCX_BLESS").is_some() {
        std::fs::create_dir_all(format!("{}/src/plan/expected", env!("CARGO_MANIFEST_DIR")))
            .unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e} (run with RUCX_BLESS=1 to create it)"));
    assert!(
        want == text,
        "plan of {name} changed; review and re-bless with RUCX_BLESS=1\n--- expected\n{want}\n--- got\n{text}"
    );
}

fn proto_at(p: &EpPlan, op: Op, mem: MemKey, size: usize) -> (Proto, String) {
    let r = p.table(op, mem).lookup(size).unwrap();
    (r.proto, r.lane.clone())
}

#[test]
fn host_only_machine() {
    let m = machine(vec![posix()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[]);
    expect("host_only", &p);
    assert_eq!(proto_at(&p, Op::Tag, MemKey::HOST, 8).0, Proto::EagerShort);
    assert_eq!(
        proto_at(&p, Op::Tag, MemKey::HOST, 64 << 20),
        (Proto::RndvGet, "posix/memory".into())
    );
    assert_eq!(
        proto_at(&p, Op::TagSync, MemKey::HOST, 8).0,
        Proto::EagerSync
    );
}

#[test]
fn tcp_only_between_hosts() {
    let m = machine(vec![tcp("eth0")]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[]);
    expect("tcp_only", &p);
    // Over a network the sender writes.
    assert_eq!(
        proto_at(&p, Op::Tag, MemKey::HOST, 64 << 20).0,
        Proto::RndvPut
    );
}

#[test]
fn two_h200_over_nvlink() {
    let m = machine(vec![posix(), cuda_copy(), cuda_ipc()]);
    let p = plan_of(
        &m,
        &Demoted::default(),
        &PlanConfig::defaults(),
        &[GPU0, GPU1],
    );
    expect("h200_nvlink", &p);
    for g in [GPU0, GPU1] {
        assert_eq!(
            proto_at(&p, Op::Tag, g, 64 << 20),
            (Proto::RndvGet, "cuda_ipc/cuda".into())
        );
        // One copy through the IPC mapping beats two copies by the copy engine around an
        // eager message, from the first byte.
        assert_eq!(proto_at(&p, Op::Tag, g, 8).0, Proto::RndvGet);
        assert_eq!(proto_at(&p, Op::TagSync, g, 8).0, Proto::RndvGet);
    }
    let q = paths(&p, Some(0));
    assert!(q[1].zero_copy && q[1].lane == "cuda_ipc/cuda", "{}", q[1]);
    // GPU into host memory: the receiver reads through the IPC mapping (one device-to-host
    // copy); host into GPU memory: the sender writes through its mapping of the receive
    // buffer (one host-to-device copy).
    assert!(q[2].zero_copy && q[2].lane == "cuda_ipc/cuda", "{}", q[2]);
    assert!(q[3].zero_copy && q[3].lane == "cuda_ipc/cuda", "{}", q[3]);
    assert_eq!(q[3].protocol, Proto::RndvPut.name(), "{}", q[3]);
    // The copy engine is never a lane to the peer.
    assert_ne!(p.lanes.rma, Some(1));
}

#[test]
fn cuda_ipc_demoted_on_one_gpu() {
    let m = machine(vec![posix(), cuda_copy(), cuda_ipc()]);
    let ipc = md_of(&m, "cuda_ipc");
    let reg = Demoted(vec![(ipc, MemoryType::Cuda, Some(0))]);
    let p = plan_of(&m, &reg, &PlanConfig::defaults(), &[GPU0, GPU1]);
    expect("h200_ipc_demoted_gpu0", &p);
    assert_eq!(
        proto_at(&p, Op::Tag, GPU0, 64 << 20),
        (Proto::RndvPipeline, "posix/memory".into())
    );
    // The other GPU keeps its zero-copy lane.
    assert_eq!(proto_at(&p, Op::Tag, GPU1, 64 << 20).0, Proto::RndvGet);
    let q = paths(&p, Some(0));
    assert!(!q[1].zero_copy);
    assert!(
        q[1].why_not
            .iter()
            .any(|w| w.contains("cuda_ipc is demoted")),
        "{}",
        q[1]
    );
}

#[test]
fn seed_rtx3080_small_bar1_next_to_a_nic() {
    // With peer memory the NIC registers GPU memory: zero-copy over rc until the small BAR1
    // fills and the domain is demoted for that GPU.
    let m = machine(vec![rc(Some(RW)), cuda_copy()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
    expect("seed_nic_peermem", &p);
    assert_eq!(
        proto_at(&p, Op::Tag, GPU0, 64 << 20),
        (Proto::RndvGet, "rc_verbs/mlx5_0:1".into())
    );
    let nic = md_of(&m, "mlx5_0");
    let p = plan_of(
        &m,
        &Demoted(vec![(nic, MemoryType::Cuda, Some(0))]),
        &PlanConfig::defaults(),
        &[GPU0],
    );
    expect("seed_nic_peermem_bar1_demoted", &p);
    assert_eq!(
        proto_at(&p, Op::Tag, GPU0, 64 << 20),
        (Proto::RndvPipeline, "rc_verbs/mlx5_0:1".into())
    );
    // Host memory still goes zero-copy on the NIC.
    assert!(proto_at(&p, Op::Tag, MemKey::HOST, 64 << 20).0.is_zcopy());
    // Without peer memory or dma-buf: staged from the start.
    let m = machine(vec![rc(None), cuda_copy()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
    expect("seed_nic_no_gpudirect", &p);
    assert_eq!(proto_at(&p, Op::Tag, GPU0, 64 << 20).0, Proto::RndvPipeline);
    let q = paths(&p, Some(0));
    assert!(
        q[1].why_not
            .iter()
            .any(|w| w.contains("no open transport registers GPU memory")),
        "{}",
        q[1]
    );
}

#[test]
fn nic_with_dmabuf_only() {
    let m = machine(vec![rc(Some(RW | MemTypeFlags::DMABUF)), cuda_copy()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
    expect("nic_dmabuf", &p);
    assert_eq!(proto_at(&p, Op::Tag, GPU0, 1 << 30).0, Proto::RndvGet);
}

#[test]
fn gdr_copy_present_is_no_peer_lane() {
    let m = machine(vec![posix(), cuda_copy(), cuda_ipc(), gdr_copy()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
    expect("gdr_copy_present", &p);
    assert_eq!(
        proto_at(&p, Op::Tag, GPU0, 64 << 20).1,
        "cuda_ipc/cuda".to_string()
    );
}

#[test]
fn demoted_host_domain_replaced_by_the_next_best_lane() {
    // posix demoted for host memory: tcp, which was not chosen before, now carries rendezvous.
    let m = machine(vec![posix(), tcp("lo")]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[]);
    assert_eq!(p.lanes.rma, Some(0));
    let reg = Demoted(vec![(md_of(&m, "posix"), MemoryType::Host, None)]);
    let p = plan_of(&m, &reg, &PlanConfig::defaults(), &[]);
    expect("posix_demoted_tcp_takes_over", &p);
    assert_eq!(p.lanes.am, 0, "the active-message lane never moves");
    assert_eq!(p.lanes.rma, Some(1));
    // Large messages stay a rendezvous (the threshold never rises with a demotion), streamed
    // over posix's active messages: two copies through shared memory beat tcp's zero-copy.
    let before = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[]);
    let start = |p: &EpPlan| {
        let t = p.table(Op::Tag, MemKey::HOST);
        t.rows.iter().find(|r| r.proto.is_rndv()).map(|r| r.from)
    };
    assert!(start(&p).unwrap() <= start(&before).unwrap());
    assert_eq!(
        proto_at(&p, Op::Tag, MemKey::HOST, 64 << 20),
        (Proto::RndvAm, "posix/memory".into())
    );
    // With a posix as slow as tcp, tcp's zero-copy write carries them.
    let mut slow = posix();
    slow.attr.perf.bandwidth = 1e9;
    let m = machine(vec![slow, tcp("lo")]);
    let reg = Demoted(vec![(md_of(&m, "posix"), MemoryType::Host, None)]);
    let p = plan_of(&m, &reg, &PlanConfig::defaults(), &[]);
    assert_eq!(
        proto_at(&p, Op::Tag, MemKey::HOST, 64 << 20),
        (Proto::RndvPut, "tcp/lo".into())
    );
}

/// A send re-selected after a demotion reads the table of its own operation: a synchronous
/// send of a size the tag table sends eagerly stays on a protocol that waits for the match
/// (the rendezvous of the new plan's lane), where the plain table would send it without
/// waiting or keep the stale lane.
#[test]
fn a_synchronous_send_is_reselected_from_the_synchronous_table() {
    let m = machine(vec![posix(), tcp("lo")]);
    let reg = Demoted(vec![(md_of(&m, "posix"), MemoryType::Host, None)]);
    let p = plan_of(&m, &reg, &PlanConfig::defaults(), &[]);
    let sync = p.table(Op::TagSync, MemKey::HOST);
    // A size the tag table sends eagerly, and the synchronous table by rendezvous.
    let mid = (1..=64 << 10)
        .find(|&n| {
            p.select(Op::Tag, MemKey::HOST, n)
                .is_some_and(|x| !x.is_rndv())
                && p.select(Op::TagSync, MemKey::HOST, n)
                    .is_some_and(|x| x.is_rndv())
        })
        .expect("a size that is eager for tag sends and a rendezvous for synchronous ones");
    let row = sync.lookup(mid).unwrap();
    assert_eq!(
        p.select(Op::TagSync, MemKey::HOST, mid),
        Some(row.proto),
        "the synchronous table's row"
    );
    let before = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[]);
    let stale = before.table(Op::TagSync, MemKey::HOST).lookup(mid).unwrap();
    assert!(
        (row.proto, &row.lane) != (stale.proto, &stale.lane),
        "the new plan's rendezvous, not the one through the demoted domain: {row:?}"
    );
    assert_eq!(
        row.proto,
        Proto::RndvAm,
        "streamed: posix no longer registers"
    );
    // Every size of a synchronous send waits for the match.
    for r in &sync.rows {
        assert!(
            r.proto == Proto::EagerSync || r.proto.is_rndv(),
            "{} is not a synchronous protocol",
            r.proto.name()
        );
    }
}

#[test]
fn unconnected_lanes_are_wanted_not_used() {
    let mut m = machine(vec![posix(), tcp("lo")]);
    m[0].connected = false;
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[]);
    assert_eq!(p.wanted, vec![0]);
    assert_eq!(p.lanes.rma, Some(1));
}

#[test]
fn no_lane_is_unreachable() {
    let mut m = machine(vec![posix()]);
    m[0].remote_md = None;
    let r = plan(PlanInput {
        lanes: &m,
        reg: &Demoted::default(),
        cfg: &PlanConfig::defaults(),
        gpu_keys: &[],
        peer: "peer",
    });
    assert!(r.is_err());
}

#[test]
fn explicit_thresholds_are_honoured() {
    let m = machine(vec![posix()]);
    let cfg = PlanConfig {
        rndv_thresh: MemUnits::Bytes(64 << 10),
        zcopy_thresh: MemUnits::Bytes(16 << 10),
        ..PlanConfig::defaults()
    };
    let p = plan_of(&m, &Demoted::default(), &cfg, &[]);
    let at = |n| proto_at(&p, Op::Tag, MemKey::HOST, n).0;
    assert_eq!(at(0), Proto::EagerShort);
    assert_eq!(at(8176), Proto::EagerShort);
    assert_eq!(at(8177), Proto::EagerBcopyMulti);
    assert_eq!(at(16 << 10), Proto::EagerZcopy);
    assert_eq!(at((64 << 10) - 1), Proto::EagerZcopy);
    assert_eq!(at(64 << 10), Proto::RndvGet);
    let cfg = PlanConfig {
        scheme: Scheme::Put,
        ..PlanConfig::defaults()
    };
    let p = plan_of(&m, &Demoted::default(), &cfg, &[]);
    assert_eq!(
        p.table(Op::Tag, MemKey::HOST).rows.last().unwrap().proto,
        Proto::RndvPut
    );
}

#[test]
fn gpu_am_stream_put_and_get_tables() {
    let m = machine(vec![posix(), cuda_copy(), cuda_ipc()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
    // Active messages: small payloads copied in, large ones by the tag's rendezvous; streams
    // through host memory by the copy lane.
    let eager_end = p
        .table(Op::Tag, MemKey::HOST)
        .rows
        .iter()
        .filter(|r| !r.proto.is_rndv())
        .map(|r| r.to)
        .max()
        .unwrap();
    let am = &p.table(Op::Am, GPU0).rows;
    assert_eq!((am.len(), am[0].proto, am[0].from), (2, Proto::AmCopy, 0));
    assert!(am[0].to >= 4096, "{am:?}");
    assert_eq!((am[1].proto, am[1].to), (Proto::RndvGet, usize::MAX));
    assert_eq!(
        proto_at(&p, Op::Am, MemKey::HOST, eager_end).0,
        Proto::AmCopy
    );
    assert_eq!(
        proto_at(&p, Op::Am, MemKey::HOST, eager_end + 1).0,
        p.table(Op::Tag, MemKey::HOST).rows.last().unwrap().proto
    );
    assert_eq!(proto_at(&p, Op::Stream, GPU0, 1 << 30).0, Proto::StreamCopy);
    // Without the copy lane, a GPU stream is refused naming it; active messages all go by
    // rendezvous.
    {
        let m = machine(vec![posix(), cuda_ipc()]);
        let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
        assert!(
            p.table(Op::Stream, GPU0)
                .refusal("peer")
                .to_string()
                .contains("cuda_copy")
        );
        assert_eq!(proto_at(&p, Op::Am, GPU0, 0).0, Proto::RndvGet);
    }
    // Put and get of GPU memory: zero-copy by cuda_ipc (to a peer's GPU), staged to host.
    for op in [Op::Put, Op::Get] {
        let t = p.table(op, GPU0);
        assert_eq!(t.rows.len(), 1, "{op:?}");
        assert!(t.rows[0].proto.is_zcopy() && t.rows[0].lane.starts_with("cuda_ipc"));
        let to_host = p.rma_plan(op, GPU0, MemoryType::Host).unwrap();
        assert!(
            matches!(to_host.steps[..], [RmaStep::Staged { .. }]),
            "{to_host:?}"
        );
        assert!(
            to_host.notes.iter().any(|n| n.contains("posix")),
            "{to_host:?}"
        );
        let from_host = p.rma_plan(op, MemKey::HOST, MemoryType::Cuda).unwrap();
        assert!(
            matches!(from_host.steps[..], [RmaStep::Zcopy { .. }]),
            "{from_host:?}"
        );
    }
    // cuda_ipc demoted for GPU 0: staged through host memory, and the table says why.
    let reg = Demoted(vec![(md_of(&m, "cuda_ipc"), MemoryType::Cuda, Some(0))]);
    let p = plan_of(&m, &reg, &PlanConfig::defaults(), &[GPU0]);
    let t = p.table(Op::Put, GPU0);
    assert_eq!(t.rows[0].proto, Proto::PutStaged, "{t:?}");
    assert!(t.notes.iter().any(|n| n.contains("demoted")), "{t:?}");
    // Without a copy lane, GPU memory cannot be staged: refused, naming cuda_copy.
    let m = machine(vec![posix(), cuda_ipc()]);
    let reg = Demoted(vec![(md_of(&m, "cuda_ipc"), MemoryType::Cuda, Some(0))]);
    let p = plan_of(&m, &reg, &PlanConfig::defaults(), &[GPU0]);
    let t = p.table(Op::Get, GPU0);
    assert!(t.rows.is_empty(), "{t:?}");
    assert!(t.refusal("peer").to_string().contains("cuda_copy"), "{t:?}");
    // Without a copy lane and a GPU lane, GPU tag sends are refused too.
    let m = machine(vec![posix()]);
    let p = plan_of(&m, &Demoted::default(), &PlanConfig::defaults(), &[GPU0]);
    assert!(p.table(Op::Tag, GPU0).rows.is_empty());
    assert!(
        p.table(Op::Tag, GPU0)
            .refusal("peer")
            .to_string()
            .contains("cuda_copy")
    );
}

// ----- invariants over random machines -----

fn arb_lane() -> impl Strategy<Value = LaneCand> {
    (
        0usize..6,
        any::<bool>(),
        any::<bool>(),
        0usize..4096,
        64usize..65536,
        1e8f64..4e11,
    )
        .prop_map(|(kind, reach, conn, short, bcopy, bw)| {
            let mut l = match kind {
                0 => posix(),
                1 => tcp("eth0"),
                2 => cuda_ipc(),
                3 => rc(Some(RW)),
                4 => rc(None),
                _ => gdr_copy(),
            };
            if l.attr.has(IfaceCaps::AM_BCOPY) {
                l.attr.limits.am_max_short = short;
                l.attr.limits.am_max_bcopy = bcopy.max(16);
            }
            l.attr.perf.bandwidth = bw;
            if !reach {
                l.remote_md = None;
            }
            l.connected = conn;
            l
        })
}

fn arb_cfg() -> impl Strategy<Value = PlanConfig> {
    let units = prop_oneof![
        Just(MemUnits::Auto),
        Just(MemUnits::Infinite),
        (0u64..(8 << 20)).prop_map(MemUnits::Bytes)
    ];
    let scheme = prop_oneof![
        Just(Scheme::Auto),
        Just(Scheme::Get),
        Just(Scheme::Put),
        Just(Scheme::Am)
    ];
    (units.clone(), units, scheme).prop_map(|(r, z, s)| PlanConfig {
        rndv_thresh: r,
        zcopy_thresh: z,
        scheme: s,
        ..PlanConfig::defaults()
    })
}

fn zcopy_lanes(p: &EpPlan) -> HashSet<(Op, MemKey, String)> {
    let mut s = HashSet::new();
    for t in &p.tables {
        for r in &t.rows {
            if r.proto.is_zcopy() {
                s.insert((t.op, t.mem, r.lane.clone()));
            }
        }
    }
    s
}

proptest! {
    /// Of two workers on one GPU exactly one issues the copies, each deciding alone.
    #[test]
    fn one_copier_per_pair_on_a_shared_gpu(a in any::<u64>(), b in any::<u64>()) {
        let (ab, ba) = (copies_on_shared_gpu(a, b), copies_on_shared_gpu(b, a));
        if a == b {
            prop_assert!(!ab && !ba);
        } else {
            prop_assert!(ab != ba);
            prop_assert_eq!(ab, a < b);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_table_covers_every_size_exactly_once(
        lanes in prop::collection::vec(arb_lane(), 1..5),
        copy in any::<bool>(),
        cfg in arb_cfg(),
        demote in prop::collection::vec((0usize..6, any::<bool>(), prop::option::of(0u32..2)), 0..4),
    ) {
        let mut lanes = lanes;
        if copy { lanes.push(cuda_copy()); }
        let lanes = machine(lanes);
        let reg = Demoted(demote.into_iter().map(|(m, gpu, d)| {
            (m, if gpu { MemoryType::Cuda } else { MemoryType::Host }, if gpu { d } else { None })
        }).collect());
        let Ok(p) = plan(PlanInput { lanes: &lanes, reg: &reg, cfg: &cfg, gpu_keys: &[GPU0, GPU1], peer: "peer" }) else {
            // Unreachable only when no lane carries active messages.
            prop_assert!(!lanes.iter().any(|l| !l.copy && l.remote_md.is_some() && l.attr.has(IfaceCaps::AM_BCOPY)));
            return Ok(());
        };
        for t in &p.tables {
            if t.rows.is_empty() {
                prop_assert!(!t.notes.is_empty(), "refused without a reason: {:?}", t);
                continue;
            }
            prop_assert_eq!(t.rows[0].from, 0);
            for w in t.rows.windows(2) {
                prop_assert_eq!(w[0].to + 1, w[1].from, "{:?}", t);
            }
            prop_assert_eq!(t.rows.last().unwrap().to, usize::MAX);
            for r in &t.rows {
                prop_assert!(r.from <= r.to);
                let am = &lanes[p.lanes.am].attr;
                if r.proto == Proto::EagerShort && t.mem == MemKey::HOST {
                    prop_assert!(r.to + crate::proto::SHORT_OVERHEAD <= am.limits.am_max_short);
                }
                if r.proto == Proto::EagerBcopy {
                    prop_assert!(r.to + crate::proto::ONE_OVERHEAD <= am.limits.am_max_bcopy);
                }
                if r.proto == Proto::EagerSync {
                    prop_assert!(r.to + crate::proto::SYNC_OVERHEAD <= am.limits.am_max_bcopy, "{:?}", t);
                }
            }
        }
        // The shared-GPU write: only GPU -> GPU, on the pair's zero-copy GPU lane when it writes
        // with copies this process issues, always right before the read on that lane (taken
        // only on one GPU; the read serves every other case).
        for r in &p.recv {
            for (i, s) in r.steps.iter().enumerate() {
                if let RecvStep::SharedGpuWrite { lane } = *s {
                    prop_assert!(r.send.is_gpu() && r.recv.mem.is_gpu(), "{:?}", r);
                    prop_assert_eq!(p.lanes.gpu(r.recv), Some(lane));
                    prop_assert!(lanes[lane].attr.has(IfaceCaps::PUT_ZCOPY | IfaceCaps::LOCAL_COPY));
                    prop_assert_eq!(r.steps.get(i + 1), Some(&RecvStep::Get { lane }));
                }
            }
            if r.send.is_gpu() && r.recv.mem.is_gpu()
                && let Some(l) = p.lanes.gpu(r.recv)
                && lanes[l].attr.has(IfaceCaps::PUT_ZCOPY | IfaceCaps::LOCAL_COPY)
            {
                prop_assert_eq!(r.steps.first(), Some(&RecvStep::SharedGpuWrite { lane: l }));
            }
        }
        // Chosen lanes are connected, reachable and never the copy lane.
        let mut chosen = vec![p.lanes.am];
        chosen.extend(p.lanes.rma);
        chosen.extend(p.lanes.gpu.iter().filter_map(|g| g.1));
        chosen.extend(p.lanes.rma_gpu);
        for c in chosen {
            prop_assert!(!lanes[c].copy && lanes[c].remote_md.is_some());
            prop_assert!(lanes[c].connected || c == p.lanes.am);
        }
        // A zero-copy row never uses a domain that is demoted for its memory.
        for t in &p.tables {
            for r in &t.rows {
                if r.proto.is_zcopy() {
                    let l = lanes.iter().find(|l| l.name() == r.lane).unwrap();
                    prop_assert!(reg.can_register(l.md, t.mem.mem, t.mem.dev), "{:?} uses demoted {}", t, r.lane);
                }
            }
        }
        // Put/get steps: a connected lane with the operation; zero-copy only where the lane's
        // domain takes the local memory now; staging only for GPU memory, with a copy lane.
        for r in &p.rma {
            for st in &r.steps {
                let l = &lanes[st.lane()];
                prop_assert!(l.connected && !l.copy, "{:?}", r);
                let cap = if r.op == Op::Put { IfaceCaps::PUT_ZCOPY } else { IfaceCaps::GET_ZCOPY };
                prop_assert!(l.attr.has(cap), "{:?}", r);
                match st {
                    RmaStep::Zcopy { .. } => {
                        if l.md_attr.reg_mem_types().has(r.local.mem) {
                            prop_assert!(reg.can_register(l.md, r.local.mem, r.local.dev), "{:?}", r);
                        } else {
                            prop_assert!(!r.local.mem.is_gpu(), "{:?}", r);
                        }
                    }
                    RmaStep::Staged { .. } => {
                        prop_assert!(r.local.mem.is_gpu() && p.lanes.copy.is_some(), "{:?}", r);
                    }
                }
            }
            if r.steps.is_empty() {
                prop_assert!(!r.notes.is_empty(), "a refusal says why: {:?}", r);
            }
        }
        // The query reads the same plan as the selection.
        for dev in [Some(0), Some(1)] {
            for q in paths(&p, dev) {
                if q.op != Op::Tag {
                    let (local, remote) = if q.op == Op::Put {
                        (q.send_mem, q.recv_mem)
                    } else {
                        (q.recv_mem, q.send_mem)
                    };
                    let step = p
                        .rma_plan(q.op, MemKey::new(local, dev), remote)
                        .and_then(|r| r.steps.first().copied());
                    match step {
                        Some(st) => {
                            prop_assert_eq!(&q.protocol, st.proto(q.op).name());
                            prop_assert_eq!(q.lane.as_str(), p.lane_name(st.lane()));
                            prop_assert_eq!(q.zero_copy, matches!(st, RmaStep::Zcopy { .. }));
                        }
                        None => prop_assert_eq!(q.protocol.as_str(), "unsupported"),
                    }
                    continue;
                }
                let want = large_path(&p, MemKey::new(q.send_mem, dev), MemKey::new(q.recv_mem, dev));
                let shared = p
                    .recv_plan(q.send_mem, MemKey::new(q.recv_mem, dev))
                    .is_some_and(|r| r.steps.iter().any(|s| matches!(s, RecvStep::SharedGpuWrite { .. })));
                match want {
                    Some((proto, lane)) => {
                        let named = if shared {
                            format!("{}{SHARED_GPU_NOTE}", proto.name())
                        } else {
                            proto.name().to_string()
                        };
                        prop_assert_eq!(&q.protocol, &named);
                        prop_assert_eq!(&q.lane, &lane);
                        prop_assert_eq!(q.zero_copy, proto.is_zcopy());
                    }
                    None => prop_assert_eq!(q.protocol.as_str(), "unsupported"),
                }
            }
        }
    }

    #[test]
    fn a_demotion_never_adds_a_zero_copy_path_through_the_demoted_domain(
        lanes in prop::collection::vec(arb_lane(), 1..5),
        cfg in arb_cfg(),
        which in 0usize..6,
        gpu in any::<bool>(),
    ) {
        let mut lanes = lanes;
        lanes.push(cuda_copy());
        let lanes: Vec<LaneCand> = machine(lanes).into_iter().map(|mut l| { l.connected = true; l }).collect();
        let keys = [GPU0];
        let before = plan(PlanInput { lanes: &lanes, reg: &Demoted::default(), cfg: &cfg, gpu_keys: &keys, peer: "p" });
        let mem = if gpu { MemoryType::Cuda } else { MemoryType::Host };
        let reg = Demoted(vec![(which, mem, None)]);
        let after = plan(PlanInput { lanes: &lanes, reg: &reg, cfg: &cfg, gpu_keys: &keys, peer: "p" });
        let (Ok(before), Ok(after)) = (before, after) else { return Ok(()); };
        let b = zcopy_lanes(&before);
        for (op, k, lane) in zcopy_lanes(&after) {
            let l = lanes.iter().find(|l| l.name() == lane).unwrap();
            if l.md == which && k.mem == mem {
                prop_assert!(false, "demoted domain still zero-copy: {:?} {} {}", op, k, lane);
            }
            // Every zero-copy lane after the demotion was a zero-copy lane for that operation
            // and memory before it too (demotions only take paths away).
            let was = b.iter().any(|(o, kk, _)| *o == op && *kk == k);
            prop_assert!(was, "{:?} {} gained zero-copy on {}", op, k, lane);
        }
        // Sizes that were a rendezvous stay one (the receiver can refuse what it has no path
        // for; an eager message would leave its sender believing it was delivered).
        for op in [Op::Tag, Op::Am] {
            let start = |p: &EpPlan| {
                p.table(op, MemKey::HOST).rows.iter().find(|r| r.proto.is_rndv()).map(|r| r.from)
            };
            if let Some(b) = start(&before) {
                let a = start(&after);
                prop_assert!(a.is_some_and(|a| a <= b), "{:?}: rendezvous from {} before, {:?} after", op, b, a);
            }
        }
        // Roles only lose lanes.
        if after.lanes.rma.is_some() { prop_assert!(before.lanes.rma.is_some()); }
        for (k, g) in &after.lanes.gpu {
            if g.is_some() { prop_assert!(before.lanes.gpu(*k).is_some()); }
        }
    }
}
