use std::sync::Arc;

use rucx_ucs::{Config, Error, MemoryType, RegErrorKind};
use rucx_uct::conformance::{self, Side};
use rucx_uct::{
    Component, EpParams, Event, Iface, IfaceParams, Iov, MemHandle, MemRegion, MemoryDomain,
    OpStatus,
};

use super::*;

fn cfg() -> Config {
    Config::new(&[rucx_uct::CONFIG]).unwrap()
}

fn open(f: &Fabric, node: NodeId, kind: LaneKind) -> Side {
    let md = SimComponent::new(f.clone(), node)
        .open_md(kind.name(), &cfg())
        .unwrap();
    let tl = md.tl_resources().remove(0);
    let c = cfg();
    let iface = md.open_iface(&tl, &IfaceParams { config: &c }).unwrap();
    Side { md, iface }
}

fn params(to: &dyn Iface, user_id: u64) -> EpParams {
    EpParams {
        dev_addr: to.device_address(),
        iface_addr: to.iface_address(),
        user_id,
    }
}

/// Collect every event of one progress call.
fn events(i: &mut dyn Iface) -> Vec<String> {
    let mut v = Vec::new();
    i.progress(&mut |ev| {
        v.push(match ev {
            Event::Am { id, data } => format!("am {id} {:?}", &data[..data.len().min(12)]),
            Event::Completion { token, result } => format!("done {token} {}", result.is_ok()),
            Event::EpError { user_id, .. } => format!("eperror {user_id}"),
        })
    });
    v
}

fn reg(md: &Arc<dyn MemoryDomain>, buf: &[u8]) -> MemHandle {
    // SAFETY: every test keeps its buffers alive longer than the handles and operations.
    unsafe { md.mem_reg(MemRegion::of_slice(buf)) }.unwrap()
}

fn conformance_between(spec: FabricSpec, kind: LaneKind) {
    let f = Fabric::new(spec);
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let report = conformance::run_in_process(open(&f, a, kind), open(&f, b, kind)).unwrap();
    report.print();
    assert!(report.passed.len() > 20, "{report:?}");
    // The simulated fabric gives no event source (a worker over it sleeps in short ticks): the
    // arm/wait checks are the only ones it skips.
    assert!(
        report.skipped.iter().all(|s| s.starts_with("arm/wait")),
        "{report:?}"
    );
}

#[test]
fn conformance_shm_in_order() {
    conformance_between(FabricSpec::host(), LaneKind::Shm);
}

#[test]
fn conformance_shm_random_delivery_and_noresource() {
    conformance_between(
        FabricSpec::host().delivery(Delivery::Random {
            seed: 7,
            noresource_per_mille: 100,
        }),
        LaneKind::Shm,
    );
}

#[test]
fn conformance_net() {
    conformance_between(FabricSpec::host().with_net(), LaneKind::Net);
}

#[test]
fn component_offers_the_lanes_of_the_spec() {
    let f = Fabric::new(FabricSpec::gpu().with_net().ipc(false));
    let n = f.add_node("a");
    let c = SimComponent::new(f.clone(), n);
    assert_eq!(
        c.query(&cfg()),
        rucx_uct::Availability::Available(vec![
            "sim_shm".into(),
            "sim_net".into(),
            "sim_copy".into()
        ])
    );
    assert!(c.open_md("sim_ipc", &cfg()).is_err());
    let copy = open(&f, n, LaneKind::Copy);
    assert_eq!(
        copy.iface.attr().dev_type,
        rucx_uct::DeviceType::Accelerator
    );
    assert!(copy.md.attr().access_mem_types().has(MemoryType::Cuda));
    let unknown = SimComponent::new(f.clone(), NodeId(9));
    assert!(matches!(
        unknown.query(&cfg()),
        rucx_uct::Availability::Unavailable(_)
    ));
}

#[test]
fn device_memory_is_classified_and_kept_off_host_lanes() {
    let f = Fabric::new(FabricSpec::gpu());
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let dev = vec![0u8; 8192];
    let host = vec![0u8; 64];
    let d = dev.as_ptr() as usize;
    f.mark_device(d + 4096, 4096, 1);
    let copy = open(&f, a, LaneKind::Copy);
    let r = copy.md.detect_mem_type(d + 4100, 10).unwrap().unwrap();
    assert_eq!((r.mem_type, r.device), (MemoryType::Cuda, Some(1)));
    assert_eq!(copy.md.detect_mem_type(d, 10).unwrap(), None);
    assert!(
        copy.md.detect_mem_type(d + 8000, 1000).is_err(),
        "runs past the end"
    );
    // Only the shm domain's host registrations that reach into device memory are refused.
    let shm = open(&f, a, LaneKind::Shm);
    // SAFETY: refused before anything touches it.
    let e = unsafe { shm.md.mem_reg(MemRegion::host(d + 4000, 200)) }.unwrap_err();
    assert!(e.as_registration().is_some(), "{e}");
    assert_eq!(f.violations().len(), 1, "{:?}", f.violations());
    // A device registration of unmarked memory is a violation too.
    let ipc = open(&f, a, LaneKind::Ipc);
    let bogus = MemRegion {
        addr: host.as_ptr() as usize,
        len: 64,
        mem_type: MemoryType::Cuda,
        device: Some(0),
    };
    // SAFETY: refused before anything touches it.
    assert!(unsafe { ipc.md.mem_reg(bogus) }.is_err());
    assert_eq!(f.violations().len(), 2);
    // Host memory on ipc is described (the local side of a copy out of a peer's device
    // buffer), as cuda_ipc does; managed memory is a typed, ordinary refusal.
    // SAFETY: as above.
    let h = unsafe { ipc.md.mem_reg(MemRegion::of_slice(&host)) }.unwrap();
    assert_eq!(h.region().mem_type, MemoryType::Host);
    let managed = MemRegion {
        mem_type: MemoryType::CudaManaged,
        ..MemRegion::of_slice(&host)
    };
    // SAFETY: as above.
    let e = unsafe { ipc.md.mem_reg(managed) }.unwrap_err();
    assert_eq!(
        e.as_registration().unwrap().kind,
        RegErrorKind::UnsupportedMemoryType
    );
    // Copy from the device range of node a to the one of node b through ipc.
    let dev_b = vec![0u8; 4096];
    f.mark_device(dev_b.as_ptr() as usize, 4096, 0);
    let ipc_b = open(&f, b, LaneKind::Ipc);
    let region = |addr: usize, device| MemRegion {
        addr,
        len: 4096,
        mem_type: MemoryType::Cuda,
        device: Some(device),
    };
    // SAFETY: both buffers outlive the handles.
    let ha = unsafe { ipc.md.mem_reg(region(d + 4096, 1)) }.unwrap();
    // SAFETY: as above.
    let hb = unsafe { ipc_b.md.mem_reg(region(dev_b.as_ptr() as usize, 0)) }.unwrap();
    assert!(ipc.md.mem_still_valid(&ha));
    let key_a = ipc_b
        .md
        .rkey_unpack(&ipc.md.mkey_pack(&ha).unwrap())
        .unwrap();
    let mut ib = ipc_b.iface;
    let mut ep = ib.create_ep(&params(ipc.iface.as_ref(), 3)).unwrap();
    // Write a pattern into "device" memory of a (as a kernel would), read it from b.
    let pattern = conformance::pattern(5, 4096);
    // SAFETY: the test owns `dev`; nothing else accesses it now.
    unsafe {
        std::ptr::copy_nonoverlapping(pattern.as_ptr(), (d + 4096) as *mut u8, 4096);
    }
    let st = ep
        .get_zcopy(&[Iov::whole(&hb)], (d + 4096) as u64, &key_a, 1)
        .unwrap();
    assert_eq!(st, OpStatus::InProgress);
    assert_eq!(events(ib.as_mut()), vec!["done 1 true".to_string()]);
    assert!(dev_b == pattern);
    // The test frees a's device memory: the next access is refused and recorded.
    f.unmark_device(d + 4096);
    assert!(!ipc.md.mem_still_valid(&ha));
    let e = ep
        .get_zcopy(&[Iov::whole(&hb)], (d + 4096) as u64, &key_a, 2)
        .unwrap_err();
    assert!(e.to_string().contains("freed"), "{e}");
    assert_eq!(f.violations().len(), 3, "{:?}", f.violations());
}

#[test]
fn nth_registration_and_budget_faults() {
    let f = Fabric::new(FabricSpec::host());
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    f.fail_registration(a, LaneKind::Shm, 3, RegErrorKind::NotExportable);
    f.set_reg_budget(b, LaneKind::Shm, Some(100));
    let sa = open(&f, a, LaneKind::Shm);
    let sb = open(&f, b, LaneKind::Shm);
    let buf = vec![0u8; 60];
    let _h1 = reg(&sa.md, &buf);
    let _h2 = reg(&sa.md, &buf);
    // SAFETY: `buf` outlives the handles.
    let e = unsafe { sa.md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap_err();
    assert_eq!(
        e.as_registration().unwrap().kind,
        RegErrorKind::NotExportable
    );
    let _h4 = reg(&sa.md, &buf);
    assert_eq!(f.reg_attempts(a, LaneKind::Shm), 4);
    assert_eq!(f.live_registrations(a, LaneKind::Shm), 3);
    // Budget: 60 + 60 > 100; released bytes count again.
    let hb = reg(&sb.md, &buf);
    // SAFETY: as above.
    let e = unsafe { sb.md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap_err();
    assert_eq!(
        e.as_registration().unwrap().kind,
        RegErrorKind::ApertureExhausted
    );
    drop(hb);
    let _hb = reg(&sb.md, &buf);
    assert_eq!(f.stats().reg_faults, 2);
    assert!(f.violations().is_empty());
    // The configuration syntax of every domain applies to sim domains too.
    let rules = rucx_uct::fault::FaultRules::parse("md=sim_shm,after=1").unwrap();
    let md = rules.wrap(sa.md.clone());
    let _ok = reg(&md, &buf);
    // SAFETY: as above.
    assert!(unsafe { md.mem_reg(MemRegion::of_slice(&buf)) }.is_err());
}

#[test]
fn noresource_then_success_and_am_fifo() {
    let f = Fabric::new(FabricSpec::host());
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let sa = open(&f, a, LaneKind::Shm);
    let mut sb = open(&f, b, LaneKind::Shm);
    let mut ep = { sa }
        .iface
        .create_ep(&params(sb.iface.as_ref(), 1))
        .unwrap();
    f.fail_next_ops(a, LaneKind::Shm, 2);
    for _ in 0..2 {
        assert!(ep.am_short(5, 1, b"x").unwrap_err().is_retryable());
    }
    ep.am_short(5, 1, b"one").unwrap();
    ep.am_bcopy(6, &mut rucx_uct::iface::pack_bytes(b"two"))
        .unwrap();
    let ev = events(sb.iface.as_mut());
    assert_eq!(ev.len(), 2);
    assert!(
        ev[0].starts_with("am 5") && ev[1].starts_with("am 6"),
        "{ev:?}"
    );
    assert_eq!(f.stats().noresource, 2);
    // Past the limit: an error that is not retryable, and a recorded violation.
    let big = vec![0u8; 9000];
    assert!(!ep.am_short(5, 0, &big).unwrap_err().is_retryable());
    assert_eq!(f.violations().len(), 1);
}

#[test]
fn random_delivery_reorders_across_endpoints_but_keeps_each_in_order() {
    let mut reordered_runs = 0;
    for seed in 0..20 {
        let f = Fabric::new(FabricSpec::host().delivery(Delivery::Random {
            seed,
            noresource_per_mille: 0,
        }));
        let (a, b, c) = (f.add_node("a"), f.add_node("b"), f.add_node("c"));
        let mut sa = open(&f, a, LaneKind::Shm);
        let mut sb = open(&f, b, LaneKind::Shm);
        let mut sc = open(&f, c, LaneKind::Shm);
        let mut eb = sb.iface.create_ep(&params(sa.iface.as_ref(), 1)).unwrap();
        let mut ec = sc.iface.create_ep(&params(sa.iface.as_ref(), 2)).unwrap();
        for i in 0..20u8 {
            eb.am_short(1, u64::from(i), &[]).unwrap();
            ec.am_short(2, u64::from(i), &[]).unwrap();
        }
        let mut got = Vec::new();
        for _ in 0..200 {
            sa.iface.progress(&mut |ev| {
                if let Event::Am { id, data } = ev {
                    got.push((id, data[0]));
                }
            });
        }
        assert_eq!(got.len(), 40, "seed {seed}: everything arrives");
        for id in [1u8, 2] {
            let seq: Vec<u8> = got.iter().filter(|g| g.0 == id).map(|g| g.1).collect();
            assert_eq!(
                seq,
                (0..20).collect::<Vec<u8>>(),
                "seed {seed}: FIFO per endpoint"
            );
        }
        let interleaved: Vec<u8> = got.iter().map(|g| g.0).collect();
        let posted: Vec<u8> = (0..40).map(|i| if i % 2 == 0 { 1 } else { 2 }).collect();
        if interleaved != posted {
            reordered_runs += 1;
        }
        let _ = (
            sb.iface.progress(&mut |_| {}),
            sc.iface.progress(&mut |_| {}),
        );
    }
    assert!(
        reordered_runs > 10,
        "only {reordered_runs} of 20 seeds reordered"
    );
}

#[test]
fn manual_release_respects_fifo_and_flush_order() {
    let f = Fabric::new(FabricSpec::host().delivery(Delivery::Manual));
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let side_a = open(&f, a, LaneKind::Shm);
    let mut sa_iface = side_a.iface;
    let mut sb = open(&f, b, LaneKind::Shm);
    let mut ep = sa_iface.create_ep(&params(sb.iface.as_ref(), 1)).unwrap();
    let target = vec![0u8; 64];
    let src = conformance::pattern(3, 64);
    let hb = reg(&sb.md, &target);
    let ha = reg(&side_a.md, &src);
    let key = side_a
        .md
        .rkey_unpack(&sb.md.mkey_pack(&hb).unwrap())
        .unwrap();
    ep.am_short(1, 10, &[]).unwrap();
    ep.am_short(1, 11, &[]).unwrap();
    let st = ep
        .put_zcopy(&[Iov::whole(&ha)], target.as_ptr() as u64, &key, 7)
        .unwrap();
    assert_eq!(st, OpStatus::InProgress);
    // The data is there at once; only the completion is held.
    assert!(target == src);
    assert_eq!(ep.flush(8).unwrap(), OpStatus::InProgress);
    let held = f.held();
    assert_eq!(held.len(), 4, "{held:?}");
    assert_eq!(
        held.iter().map(|h| h.releasable).collect::<Vec<_>>(),
        vec![true, false, true, false]
    );
    assert!(events(sb.iface.as_mut()).is_empty());
    // The second message cannot overtake the first; the put's completion can overtake both.
    assert!(f.release(held[1].seq).is_err());
    f.release(held[2].seq).unwrap();
    assert!(f.release(held[3].seq).is_err(), "flush before older items");
    assert_eq!(events(sa_iface.as_mut()), vec!["done 7 true".to_string()]);
    f.release(held[0].seq).unwrap();
    f.release(held[1].seq).unwrap();
    f.release(held[3].seq).unwrap();
    assert_eq!(events(sb.iface.as_mut()).len(), 2);
    assert_eq!(events(sa_iface.as_mut()), vec!["done 8 true".to_string()]);
    assert_eq!(f.in_flight(), 0);
    assert!(f.stats().reordered >= 1);
}

#[test]
fn out_of_bounds_and_foreign_handles_are_refused_and_recorded() {
    let f = Fabric::new(FabricSpec::host().with_net());
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let sa = open(&f, a, LaneKind::Shm);
    let sb = open(&f, b, LaneKind::Shm);
    let na = open(&f, a, LaneKind::Net);
    let mut ia = sa.iface;
    let mut ep = ia.create_ep(&params(sb.iface.as_ref(), 1)).unwrap();
    let target = [0u8; 100];
    let src = [1u8; 100];
    let hb = reg(&sb.md, &target[..50]);
    let ha = reg(&sa.md, &src);
    let key = sa.md.rkey_unpack(&sb.md.mkey_pack(&hb).unwrap()).unwrap();
    // One byte past the receiver's registration.
    let iov = [Iov {
        addr: src.as_ptr() as usize,
        len: 51,
        memh: &ha,
    }];
    let e = ep
        .put_zcopy(&iov, target.as_ptr() as u64, &key, 1)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    assert!(target.iter().all(|x| *x == 0), "nothing was written");
    // A handle of another domain (net) on the shm lane.
    let hn = reg(&na.md, &src);
    let iov = [Iov::whole(&hn)];
    assert!(ep.put_zcopy(&iov, target.as_ptr() as u64, &key, 2).is_err());
    // A key whose registration was released.
    drop(hb);
    let e = ep
        .put_short(&src[..10], target.as_ptr() as u64, &key)
        .unwrap_err();
    assert!(e.to_string().contains("released"), "{e}");
    assert_eq!(f.violations().len(), 3, "{:?}", f.violations());
    assert!(target.iter().all(|x| *x == 0));
}

#[test]
fn failed_node_reports_every_endpoint_once_and_fails_operations() {
    let f = Fabric::new(FabricSpec::host().delivery(Delivery::Manual));
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let sa = open(&f, a, LaneKind::Shm);
    let mut sb = open(&f, b, LaneKind::Shm);
    let mut ia = sa.iface;
    let mut ea = ia.create_ep(&params(sb.iface.as_ref(), 41)).unwrap();
    let mut eb = sb.iface.create_ep(&params(ia.as_ref(), 42)).unwrap();
    ea.am_short(1, 0, &[]).unwrap();
    assert_eq!(ea.flush(9).unwrap(), OpStatus::InProgress);
    eb.am_short(1, 0, &[]).unwrap();
    f.fail_node(b, "killed by the test");
    // a: the endpoint error; the held flush reports the failure; b's message is lost.
    f.release_all();
    let ev = events(ia.as_mut());
    assert_eq!(
        ev,
        vec!["eperror 41".to_string(), "done 9 false".to_string()]
    );
    assert!(events(ia.as_mut()).is_empty(), "reported once");
    assert!(matches!(
        ea.am_short(1, 0, &[]),
        Err(Error::EndpointFailure { .. })
    ));
    assert!(matches!(eb.flush(1), Err(Error::EndpointFailure { .. })));
    // An endpoint created afterwards learns at once.
    let _late = ia.create_ep(&params(sb.iface.as_ref(), 43)).unwrap();
    assert_eq!(events(ia.as_mut()), vec!["eperror 43".to_string()]);
    assert!(f.node_failed(b) && !f.node_failed(a));
}

#[test]
fn copy_lane_reaches_its_own_node_only_and_shared_staging_maps() {
    let f = Fabric::new(FabricSpec::gpu());
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let ca = open(&f, a, LaneKind::Copy);
    let mut cb = open(&f, b, LaneKind::Copy);
    assert!(
        !cb.iface
            .is_reachable(&ca.iface.device_address(), &ca.iface.iface_address())
    );
    assert!(
        cb.iface
            .is_reachable(&cb.iface.device_address(), &cb.iface.iface_address())
    );
    assert!(cb.iface.create_ep(&params(ca.iface.as_ref(), 0)).is_err());
    let sa = open(&f, a, LaneKind::Shm);
    let sb = open(&f, b, LaneKind::Shm);
    let shared = sa.md.mem_alloc_shared(4096).unwrap().unwrap();
    let key = sb
        .md
        .rkey_unpack(&sa.md.mkey_pack(&shared.memh).unwrap())
        .unwrap();
    assert_eq!(sb.md.rkey_ptr(&key).unwrap(), Some(shared.addr));
    let plain = vec![0u8; 10];
    let h = reg(&sa.md, &plain);
    let k2 = sb.md.rkey_unpack(&sa.md.mkey_pack(&h).unwrap()).unwrap();
    assert_eq!(sb.md.rkey_ptr(&k2).unwrap(), None);
    // Garbage and keys of other lanes are refused at unpack.
    assert!(sb.md.rkey_unpack(&[1, 2, 3]).is_err());
    assert!(cb.md.rkey_unpack(&sa.md.mkey_pack(&h).unwrap()).is_err());
    let f2 = Fabric::new(FabricSpec::host());
    let n2 = f2.add_node("x");
    let other = open(&f2, n2, LaneKind::Shm);
    assert!(other.md.rkey_unpack(&sa.md.mkey_pack(&h).unwrap()).is_err());
    assert!(
        !other
            .iface
            .is_reachable(&sb.iface.device_address(), &sb.iface.iface_address())
    );
    let _ = &mut cb;
}

/// `fail_completions_after`: the first zero-copy operations go through; the next one is taken
/// (in progress), delivers nothing and writes nothing, and its completion reports an error;
/// operations after it go through again.
#[test]
fn a_failed_completion_loses_the_operation_after_a_successful_post() {
    let f = Fabric::new(FabricSpec::host());
    let (a, b) = (f.add_node("a"), f.add_node("b"));
    let mut sa = open(&f, a, LaneKind::Shm);
    let mut sb = open(&f, b, LaneKind::Shm);
    let mut ep = sa.iface.create_ep(&params(sb.iface.as_ref(), 1)).unwrap();
    let src = [7u8; 64];
    let target = [0u8; 64];
    let ha = reg(&sa.md, &src);
    let hb = reg(&sb.md, &target);
    let key = sa.md.rkey_unpack(&sb.md.mkey_pack(&hb).unwrap()).unwrap();
    let iov = [Iov {
        addr: src.as_ptr() as usize,
        len: 16,
        memh: &ha,
    }];
    f.fail_completions_after(a, LaneKind::Shm, 1, 2);
    // Through: delivered.
    ep.am_zcopy(5, b"h", &iov, 1).unwrap();
    // Lost: an am_zcopy and a put_zcopy, both taken.
    assert_eq!(ep.am_zcopy(5, b"h", &iov, 2).unwrap(), OpStatus::InProgress);
    assert_eq!(
        ep.put_zcopy(&iov, target.as_ptr() as u64, &key, 3).unwrap(),
        OpStatus::InProgress
    );
    // Through again.
    ep.am_zcopy(6, b"h", &iov, 4).unwrap();
    let ev = events(sb.iface.as_mut());
    assert_eq!(
        ev.iter().filter(|e| e.starts_with("am ")).count(),
        2,
        "the lost message is not delivered: {ev:?}"
    );
    assert!(target.iter().all(|x| *x == 0), "the lost put wrote nothing");
    let done = events(sa.iface.as_mut());
    for t in [2, 3] {
        assert!(done.contains(&format!("done {t} false")), "{t}: {done:?}");
    }
    assert!(
        !done
            .iter()
            .any(|d| d.starts_with("done 1 false") || d.starts_with("done 4 false"))
    );
    assert!(
        f.log()
            .iter()
            .any(|l| l.contains("injected completion failure"))
    );
}
