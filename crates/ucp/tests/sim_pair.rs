//! Two workers over the sim fabric: every size class and memory type, demotion, truncation,
//! peer failure, and the known GPU-pipeline bugs reproduced without a GPU.

mod harness;

use harness::{Buf, Mem, Pair, is_truncation, pattern, with_fault};
use rucx_ucp::TAG_MASK_FULL;
use rucx_ucp::proto::Proto;
use rucx_ucs::{Error, RegErrorKind};
use rucx_uct_sim::{Delivery, FabricSpec, LaneKind};

/// Sizes that cover every protocol of the host table built from these variables: eager short
/// (..8112), copy-in multi-fragment (..16K), zero-copy (..64K, below the default
/// `RUCX_RNDV_SPLIT_THRESH`) and rendezvous (split reads from 64K).
const HOST_VARS: &[(&str, &str)] = &[
    ("RUCX_ZCOPY_THRESH", "16K"),
    ("RUCX_RNDV_FRAG_SIZE", "256K"),
];
const SIZES: &[usize] = &[
    0,
    1,
    200,
    8112,
    8113,
    12_000,
    16 << 10,
    100_000,
    (256 << 10) - 1,
    256 << 10,
    (1 << 20) + 3,
    2 << 20,
];

fn exchange_sizes(pair: &Pair, from: usize, mem: [Mem; 2], sync: bool) {
    for (i, &n) in SIZES.iter().enumerate() {
        let id = (from as u64) << 32 | i as u64;
        let send = Buf::filled(&pair.fabric, n, mem[0], id);
        let mut recv = Buf::new(&pair.fabric, n, mem[1]);
        let out = pair.transfer(from, &send, &mut recv, 100 + i as u64, sync);
        let (s, r) = out.expect_ok();
        assert_eq!((s.len, r.len, r.tag), (n, n, 100 + i as u64));
        assert!(
            recv.bytes() == pattern(id, n),
            "{n} B {mem:?}: data differs"
        );
        assert_eq!(recv.guard_damage(), None, "{n} B {mem:?}");
        assert_eq!(send.guard_damage(), None, "{n} B {mem:?}");
    }
}

#[test]
fn host_every_size_class_both_ways_in_order() {
    let pair = Pair::new(FabricSpec::host(), [HOST_VARS, HOST_VARS]);
    for from in [0, 1] {
        exchange_sizes(&pair, from, [Mem::Host, Mem::HostRaw], false);
        exchange_sizes(&pair, from, [Mem::HostRaw, Mem::Host], true);
    }
    let c = pair.w[0].counters();
    for proto in [
        "eager short",
        "multi-frag eager copy-in",
        "eager zero-copy",
        "rendezvous zero-copy read from remote",
    ] {
        assert!(c.contains_key(proto), "{proto} never ran: {c:?}");
    }
    assert!(
        c.keys().any(|k| k.contains("split")),
        "large rendezvous are split: {c:?}"
    );
    pair.check_clean();
    assert_eq!(pair.w[0].live_requests() + pair.w[1].live_requests(), 0);
}

#[test]
fn host_every_size_class_random_delivery_and_network_lane() {
    for seed in 0..3 {
        let spec = FabricSpec::host().with_net().delivery(Delivery::Random {
            seed,
            noresource_per_mille: 50,
        });
        let pair = Pair::new(spec, [HOST_VARS, HOST_VARS]);
        exchange_sizes(&pair, 0, [Mem::Host, Mem::Host], seed == 1);
        exchange_sizes(&pair, 1, [Mem::Host, Mem::Host], false);
        let st = pair.fabric.stats();
        assert!(st.reordered > 0 && st.noresource > 0, "{st:?}");
        pair.check_clean();
    }
    // Over the network lane alone: tcp-like limits and the put rendezvous.
    let pair = Pair::new(FabricSpec::host().with_net().without_shm(), [&[], &[]]);
    exchange_sizes(&pair, 0, [Mem::Host, Mem::Host], false);
    assert_eq!(pair.w[0].lanes(pair.ep[0]).unwrap().0, "sim_net/net0");
    pair.assert_ran(0, "rendezvous zero-copy write to remote");
    pair.check_clean();
}

#[test]
fn staging_made_ahead_on_a_helper_thread_carries_the_pipeline() {
    let ahead: &[(&str, &str)] = &[
        ("RUCX_ZCOPY_THRESH", "16K"),
        ("RUCX_RNDV_FRAG_SIZE", "256K"),
        ("RUCX_RNDV_STAGING_AHEAD", "y"),
    ];
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [ahead, ahead]);
    // Host memory alone starts nothing: no helper thread next to a host-only job's first
    // messages, no staging pinned for nothing.
    exchange_sizes(&pair, 0, [Mem::Host, Mem::Host], false);
    for w in &pair.w {
        assert!(
            !w.counters().contains_key("staging ahead started"),
            "{:?}",
            w.counters()
        );
    }
    exchange_sizes(&pair, 0, [Mem::Device(0), Mem::Device(1)], false);
    exchange_sizes(&pair, 1, [Mem::Device(1), Mem::Host], false);
    pair.assert_ran(1, "rendezvous receive pipelined through host staging");
    for w in &pair.w {
        for c in ["staging ahead started", "staging made ahead"] {
            assert!(w.counters().contains_key(c), "{c}: {:?}", w.counters());
        }
    }
    pair.check_clean();
}

#[test]
fn staging_offered_ahead_is_mapped_before_the_first_staged_transfer() {
    let ahead: &[(&str, &str)] = &[
        ("RUCX_ZCOPY_THRESH", "16K"),
        ("RUCX_RNDV_FRAG_SIZE", "256K"),
        ("RUCX_RNDV_STAGING_AHEAD", "y"),
    ];
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [ahead, ahead]);
    // A small device message each way: both workers meet GPU memory and make staging ahead.
    for from in [0, 1] {
        let sbuf = Buf::filled(&pair.fabric, 64, Mem::Device(from as u32), 7);
        let mut rbuf = Buf::new(&pair.fabric, 64, Mem::Device(1 - from as u32));
        pair.transfer(from, &sbuf, &mut rbuf, 5, false).expect_ok();
    }
    // Once a staging is ready, it is offered; the peer registers it on a helper thread.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        pair.step();
        let c: Vec<_> = pair.w.iter().map(|w| w.counters()).collect();
        if c.iter().all(|c| {
            c.contains_key("staging offered") && c.contains_key("peer staging registered ahead")
        }) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no offers: {c:?}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // The first staged transfer finds the mapping registered (every byte checked).
    let sbuf = Buf::filled(&pair.fabric, (4 << 20) + 3, Mem::Device(0), 9);
    let mut rbuf = Buf::new(&pair.fabric, (4 << 20) + 3, Mem::Device(1));
    pair.transfer(0, &sbuf, &mut rbuf, 6, false).expect_ok();
    pair.assert_ran(1, "rendezvous receive pipelined through host staging");
    pair.assert_ran(1, "peer staging mapped ahead");
    // Host-only peers are offered nothing.
    let host = Pair::new(FabricSpec::gpu().ipc(false), [ahead, ahead]);
    exchange_sizes(&host, 0, [Mem::Host, Mem::Host], false);
    for w in &host.w {
        assert!(
            !w.counters().contains_key("staging offered"),
            "{:?}",
            w.counters()
        );
    }
    pair.check_clean();
}

/// The staging is offered as soon as it is started, before its helper thread page-locked it
/// (its shared allocation is made at once): the offer leaves with the first post of GPU
/// memory, before any progress, and the peer maps it (once it meets GPU memory itself) while
/// both page-lock; the fragments staged later carry the key offered.
#[test]
fn staging_is_offered_when_it_is_started_not_when_it_is_ready() {
    let ahead: &[(&str, &str)] = &[
        ("RUCX_ZCOPY_THRESH", "16K"),
        ("RUCX_RNDV_FRAG_SIZE", "256K"),
        ("RUCX_RNDV_STAGING_AHEAD", "y"),
    ];
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [ahead, ahead]);
    let n = (1 << 20) + 3;
    let sbuf = Buf::filled(&pair.fabric, n, Mem::Device(0), 3);
    let mut rbuf = Buf::new(&pair.fabric, n, Mem::Device(1));
    pair.w[0].scope(|ss| {
        pair.w[1].scope(|sr| {
            // A staged rendezvous: its announcement needs no staging yet.
            let s = ss.tag_send(pair.ep[0], sbuf.send(), 4);
            let c = pair.w[0].counters();
            assert!(
                c.contains_key("staging ahead started")
                    && c.contains_key("staging offered")
                    && !c.contains_key("staging made ahead"),
                "offered at the post, before the staging is ready: {c:?}"
            );
            let r = sr.tag_recv(rbuf.recv(), 4, TAG_MASK_FULL);
            let (mut so, mut ro) = (None, None);
            pair.drive(|| {
                so = so.take().or_else(|| s.test());
                ro = ro.take().or_else(|| r.test());
                so.is_some() && ro.is_some()
            })
            .unwrap();
            assert!(so.unwrap().is_ok() && ro.unwrap().is_ok());
        })
    });
    assert!(rbuf.bytes() == pattern(3, n));
    pair.assert_ran(1, "rendezvous receive pipelined through host staging");
    // The receiver met GPU memory at the match and registered the offer ahead; the first
    // fragment found it.
    pair.assert_ran(1, "peer staging registered ahead");
    pair.assert_ran(1, "peer staging mapped ahead");
    pair.check_clean();
}

#[test]
fn gpu_memory_every_combination() {
    for delivery in [
        Delivery::InOrder,
        Delivery::Random {
            seed: 11,
            noresource_per_mille: 20,
        },
    ] {
        for (shared, ipc) in [(true, true), (false, true), (true, false), (false, false)] {
            let spec = FabricSpec::gpu()
                .shared_staging(shared)
                .ipc(ipc)
                .delivery(delivery);
            let pair = Pair::new(spec, [HOST_VARS, HOST_VARS]);
            for mem in [
                [Mem::Device(0), Mem::Device(1)],
                [Mem::Device(0), Mem::Host],
                [Mem::Host, Mem::Device(1)],
            ] {
                exchange_sizes(&pair, 0, mem, false);
            }
            let (c0, c1) = (pair.w[0].counters(), pair.w[1].counters());
            let bounced = c0.contains_key("eager through a pinned bounce buffer");
            if ipc {
                // A zero-copy GPU lane: every device send is a rendezvous (one copy beats the
                // bounce's two), read straight into device receives.
                assert!(
                    c1.contains_key("rendezvous receive by read (GPU zero-copy)"),
                    "{c1:?}"
                );
                assert!(!bounced, "{c0:?}");
            } else {
                // Only the staged pipeline is left: small device sends take the bounce.
                assert!(bounced, "{c0:?}");
            }
            pair.check_clean();
        }
    }
    // Without the GPU zero-copy lane, device to device goes through host staging.
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [HOST_VARS, HOST_VARS]);
    exchange_sizes(&pair, 1, [Mem::Device(1), Mem::Device(0)], false);
    pair.assert_ran(0, "rendezvous receive pipelined through host staging");
    pair.check_clean();
}

#[test]
fn truncation_is_reported_and_nothing_is_written_past_the_buffer() {
    for mem in [Mem::Host, Mem::Device(0)] {
        let pair = Pair::new(FabricSpec::gpu(), [HOST_VARS, HOST_VARS]);
        for (i, &n) in [100usize, 12_000, 100_000, 1 << 20].iter().enumerate() {
            let send = Buf::filled(&pair.fabric, n, Mem::Host, i as u64);
            let cap = n / 2 + 1;
            let mut recv = Buf::new(&pair.fabric, cap, mem);
            let out = pair.transfer(0, &send, &mut recv, 7, false);
            assert!(out.hang.is_none(), "{}", out.hang.unwrap());
            assert!(matches!(out.send, Some(Ok(_))), "{n} B: {:?}", out.send);
            let r = out.recv.unwrap();
            assert!(is_truncation(&r, n, cap), "{n} B into {cap}: {r:?}");
            assert!(
                recv.bytes() == &pattern(i as u64, n)[..cap],
                "{n} B: the part that fits"
            );
            assert_eq!(recv.guard_damage(), None, "{n} B into {cap} B of {mem:?}");
        }
        pair.check_clean();
    }
}

#[test]
fn demotion_is_warned_once_and_transfers_go_on() {
    // The shm domain of side b fails every host registration after the first 3: zero-copy
    // receives fall back to streaming, exactly one warning, every byte intact.
    let b_vars = with_fault(HOST_VARS, "md=sim_shm,mem=host,after=3");
    let pair = Pair::new(FabricSpec::host(), [HOST_VARS, &b_vars]);
    exchange_sizes(&pair, 0, [Mem::Host, Mem::Host], false);
    exchange_sizes(&pair, 1, [Mem::Host, Mem::Host], false);
    let d = pair.ctx[1].demotions();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].md, "sim_shm");
    assert!(pair.ctx[0].demotions().is_empty());
    pair.check_clean();
    // The fabric's own control does the same on side a, at the 2nd registration.
    let pair = Pair::new(FabricSpec::host(), [HOST_VARS, HOST_VARS]);
    pair.fail_shm_registration(0, 2, RegErrorKind::BadAddress);
    exchange_sizes(&pair, 0, [Mem::Host, Mem::Host], false);
    assert_eq!(pair.ctx[0].demotions().len(), 1);
    pair.check_clean();
}

#[test]
fn noresource_bursts_on_every_lane_are_retried() {
    let pair = Pair::new(FabricSpec::gpu(), [HOST_VARS, HOST_VARS]);
    for (i, mem) in [
        [Mem::Host, Mem::Host],
        [Mem::Device(0), Mem::Device(1)],
        [Mem::Device(0), Mem::Host],
    ]
    .iter()
    .enumerate()
    {
        for lane in [LaneKind::Shm, LaneKind::Ipc, LaneKind::Copy] {
            for node in pair.nodes {
                pair.fabric.fail_next_ops(node, lane, 3 + i as u64);
            }
            exchange_sizes(&pair, 0, *mem, false);
        }
    }
    assert!(pair.fabric.stats().noresource > 20);
    pair.check_clean();
}

/// After the peer fails, every request of the survivor that involves it ends with
/// `EndpointFailure`: sends of every size class (eager ones finished when posted), matched
/// receives mid-rendezvous. A receive that never matched is not the peer's: it stays
/// cancelable.
#[test]
fn peer_failure_ends_every_pending_request() {
    for delivery in [Delivery::InOrder, Delivery::Manual] {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [HOST_VARS, HOST_VARS]);
        let sizes = [100usize, 12_000, 100_000, 1 << 20];
        let sends: Vec<Buf> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Buf::filled(&pair.fabric, n, Mem::Host, i as u64))
            .collect();
        let dsend = Buf::filled(&pair.fabric, 1 << 20, Mem::Device(0), 99);
        let mut recvs: Vec<Buf> = (0..3)
            .map(|_| Buf::new(&pair.fabric, 1 << 20, Mem::Host))
            .collect();
        pair.w[0].scope(|sa| {
            let mut reqs: Vec<_> = sends
                .iter()
                .enumerate()
                .map(|(i, b)| (sizes[i], sa.tag_send(pair.ep[0], b.send(), i as u64)))
                .collect();
            reqs.push((1 << 20, sa.tag_send(pair.ep[0], dsend.send(), 50)));
            let mut it = recvs.iter_mut();
            // b sends a large message that a receives: matched, its rendezvous in flight.
            let r_matched = sa.tag_recv(it.next().unwrap().recv(), 77, TAG_MASK_FULL);
            let r_unmatched = sa.tag_recv(it.next().unwrap().recv(), 78, TAG_MASK_FULL);
            let big = Buf::filled(&pair.fabric, 1 << 20, Mem::Host, 7);
            pair.w[1].scope(|sb| {
                let _s = sb.tag_send(pair.ep[1], big.send(), 77);
                if delivery == Delivery::Manual {
                    // The request to send arrives and a starts reading; the read's completion
                    // stays held: the receive is mid-rendezvous when b dies.
                    pair.fabric.release_all();
                    pair.step();
                    assert!(pair.fabric.in_flight() > 0);
                }
                assert!(r_matched.test().is_none());
                pair.fabric.fail_node(pair.nodes[1], "killed by the test");
                pair.drive(|| {
                    reqs.iter().all(|(_, r)| r.test().is_some()) && r_matched.test().is_some()
                })
                .expect("every request of the survivor ends");
            });
            for (n, r) in &reqs {
                match r.test().unwrap() {
                    Err(Error::EndpointFailure { .. }) => {}
                    // Eager messages (below the 64K rendezvous threshold) may have
                    // completed before the failure.
                    Ok(c) if *n < 64 << 10 => assert_eq!(c.len, *n),
                    other => panic!("{n} B send after the peer failed: {other:?}"),
                }
            }
            let m = r_matched.test().unwrap();
            assert!(
                matches!(m, Err(Error::EndpointFailure { .. })),
                "matched receive: {m:?}"
            );
            assert!(r_unmatched.test().is_none());
            assert!(r_unmatched.cancel());
            assert!(matches!(r_unmatched.test(), Some(Err(Error::Canceled))));
            assert!(pair.w[0].ep_error(pair.ep[0]).is_some());
        });
        assert!(
            pair.fabric.violations().is_empty(),
            "{:?}",
            pair.fabric.violations()
        );
    }
}

/// Known bug (a), reproduced from the GPU machine: with the GPU zero-copy lane demoted for
/// device memory, a device send of 64 KiB + 1 into a 64 KiB device receive goes through the
/// host-staged pipeline; the receiver reports the truncation, and the sender must complete
/// (it did not: the acknowledgement of the fragment the receive cut short carried the cut
/// length). Also with several fragments, one cut and some wholly past the receive.
#[test]
fn staged_device_send_into_a_smaller_device_receive_completes() {
    for shared in [true, false] {
        let a_vars = with_fault(HOST_VARS, "md=sim_ipc,mem=cuda,after=0");
        let pair = Pair::new(
            FabricSpec::gpu().shared_staging(shared),
            [&a_vars, HOST_VARS],
        );
        for (i, (n, cap)) in [
            ((64 << 10) + 1, 64 << 10),
            (1 << 20, 300_000),
            (1 << 20, 256 << 10),
            ((1 << 20) + 5, (512 << 10) + 1),
        ]
        .into_iter()
        .enumerate()
        {
            let send = Buf::filled(&pair.fabric, n, Mem::Device(0), i as u64);
            let mut recv = Buf::new(&pair.fabric, cap, Mem::Device(1));
            let out = pair.transfer(0, &send, &mut recv, 3, false);
            assert!(out.hang.is_none(), "{}", out.hang.unwrap());
            let r = out.recv.unwrap();
            assert!(is_truncation(&r, n, cap), "{n} into {cap}: {r:?}");
            assert!(
                matches!(out.send, Some(Ok(_))),
                "{n} into {cap}: {:?}",
                out.send
            );
            assert!(recv.bytes() == &pattern(i as u64, n)[..cap]);
            assert_eq!(recv.guard_damage(), None);
        }
        assert_eq!(pair.ctx[0].demotions().len(), 1);
        pair.assert_ran(1, "rendezvous receive pipelined through host staging");
        pair.check_clean();
    }
}

/// Known bug (b), reproduced from the GPU machine: without the GPU zero-copy lane and with a
/// registration fault on the copy domain (`after=3`), a 1 MiB device-to-device send fails on
/// the sender with the registration error, and the receiver's request never completes: the
/// copy lane's registrations (`copy_key` in worker/gpu.rs) bypass `Context::register`, so
/// nothing is demoted or warned, and the sender's failure in `on_pull` never reaches the peer.
fn copy_domain_fault(faulty: usize) {
    let vars: &[(&str, &str)] = &[("RUCX_RNDV_FRAG_SIZE", "256K")];
    let bad: &[(&str, &str)] = &[
        ("RUCX_FAULT_INJECT", "md=sim_copy,after=3"),
        ("RUCX_RNDV_FRAG_SIZE", "256K"),
    ];
    let mut sides = [vars, vars];
    sides[faulty] = bad;
    let pair = Pair::new(FabricSpec::gpu().ipc(false), sides);
    // Each transfer registers the user buffer with the copy domain on both sides (and the
    // staging, the first time): one of the first four transfers meets the 4th registration.
    for i in 0..4u64 {
        let send = Buf::filled(&pair.fabric, 1 << 20, Mem::Device(0), 5 + i);
        let mut recv = Buf::new(&pair.fabric, 1 << 20, Mem::Device(1));
        let out = pair.transfer(0, &send, &mut recv, 9, false);
        assert!(out.hang.is_none(), "transfer {i}: {}", out.hang.unwrap());
        match (&out.send, &out.recv) {
            (Some(Ok(_)), Some(Ok(_))) => assert!(recv.bytes() == pattern(5 + i, 1 << 20)),
            (Some(Err(_)), Some(Err(_))) => {}
            other => panic!("transfer {i}: the two sides disagree: {other:?}"),
        }
        assert_eq!(recv.guard_damage(), None);
    }
    pair.check_clean();
    assert!(
        !pair.ctx[faulty].demotions().is_empty(),
        "the copy domain's failure is demoted and warned"
    );
}

#[test]
fn copy_domain_fault_on_the_sender_ends_both_requests() {
    copy_domain_fault(0);
}

/// The receiver's side of bug (b): its copy-domain registration fails in `rndv_recv_gpu`, the
/// receive ends with the error, and the sender is never told.
#[test]
fn copy_domain_fault_on_the_receiver_ends_both_requests() {
    copy_domain_fault(1);
}

/// A synchronous send of a size near the top of the eager-short range: it goes as one
/// `am_bcopy` carrying a 24-byte header, which must fit the lane's bcopy limit (or the send
/// must take another protocol). Found by this harness.
#[test]
fn sync_send_at_the_top_of_the_eager_range() {
    for spec in [
        FabricSpec::host(),
        FabricSpec::host().with_net().without_shm(),
    ] {
        let pair = Pair::new(spec, [&[], &[]]);
        let lim = pair.w[0].proto_table(pair.ep[0]).unwrap();
        let eager_end = lim
            .iter()
            .filter(|r| matches!(r.proto, Proto::EagerShort | Proto::EagerBcopy))
            .map(|r| r.to)
            .max()
            .unwrap();
        for n in [eager_end - 30, eager_end - 16, eager_end - 8, eager_end] {
            let send = Buf::filled(&pair.fabric, n, Mem::Host, n as u64);
            let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
            let out = pair.transfer(0, &send, &mut recv, 1, true);
            assert!(out.hang.is_none(), "{n} B: {}", out.hang.unwrap());
            out.expect_ok();
            assert!(recv.bytes() == pattern(n as u64, n));
        }
        pair.check_clean();
    }
}

/// A pair where side a's shared-memory domain fails host registrations: its first transfer (a
/// GPU send from b into a host receive on a) demotes `sim_shm` on a and still completes (a
/// reads b's fragments into its staging, which `sim_shm` shares without a registration; it
/// used to end on both sides),
/// whose RMA lane becomes the network lane while b's stays shared memory. Host sends from a
/// into GPU receives on b (no GPU zero-copy lane) then go through a's staging, whose fragments
/// a announces with keys of `sim_net`. Found by the protocol property (seed
/// 5979945682491386679).
fn pair_with_rma_lanes_apart() -> Pair {
    let vars: &[(&str, &str)] = &[
        ("RUCX_RNDV_THRESH", "32K"),
        ("RUCX_RNDV_SCHEME", "put_zcopy"),
    ];
    let bad = with_fault(vars, "md=sim_shm,mem=host,after=0");
    let pair = Pair::new(FabricSpec::gpu().ipc(false).with_net(), [&bad, vars]);
    let send = Buf::filled(&pair.fabric, 243_373, Mem::Device(1), 9);
    let mut recv = Buf::new(&pair.fabric, 243_373, Mem::Host);
    let out = pair.transfer(1, &send, &mut recv, 3, false);
    assert!(out.hang.is_none(), "{}", out.hang.unwrap());
    out.expect_ok();
    assert!(recv.bytes() == pattern(9, 243_373));
    assert_eq!(pair.ctx[0].demotions().len(), 1);
    pair
}

/// The sender's fragments carry keys of its RMA lane's domain (`sim_net` here): the receiver
/// reads them through a lane of that domain, not its own RMA lane (`sim_shm`, whose transport
/// refused the foreign key, and the receive failed). Found by the protocol property (seed
/// 5979945682491386679).
#[test]
fn staged_fragments_are_read_through_a_lane_of_their_key_s_domain() {
    let pair = pair_with_rma_lanes_apart();
    for (i, n) in [55_620usize, 251_857, 1 << 20].into_iter().enumerate() {
        for rmem in [Mem::Device(1), Mem::Host] {
            let send = Buf::filled(&pair.fabric, n, Mem::Device(0), i as u64);
            let mut recv = Buf::new(&pair.fabric, n, rmem);
            let out = pair.transfer(0, &send, &mut recv, 3, false);
            assert!(out.hang.is_none(), "{n} B: {}", out.hang.unwrap());
            out.expect_ok();
            assert!(recv.bytes() == pattern(i as u64, n), "{n} B into {rmem:?}");
            assert_eq!(recv.guard_damage(), None);
        }
        let send = Buf::filled(&pair.fabric, n, Mem::Host, i as u64);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Device(1));
        pair.transfer(0, &send, &mut recv, 3, false).expect_ok();
        assert!(recv.bytes() == pattern(i as u64, n), "{n} B host into GPU");
    }
    pair.check_clean();
}

/// A pipelined receive that fails after the sender announced its fragments ends both sides:
/// its abort goes out before the acknowledgements that release the fragments (which carry
/// their whole staged length: ahead of the abort, they completed the send, which reported
/// success for bytes nobody received). Found by the protocol property (seed
/// 5979945682491386679), where the receive failed reading fragments on a lane of another
/// domain than their key's.
#[test]
fn a_failed_staged_receive_aborts_before_releasing_the_fragments() {
    let pair = pair_with_rma_lanes_apart();
    for (i, n) in [55_620usize, 251_857, 1 << 20].into_iter().enumerate() {
        let send = Buf::filled(&pair.fabric, n, Mem::Host, i as u64);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Device(1));
        let out = pair.transfer(0, &send, &mut recv, 3, false);
        assert!(out.hang.is_none(), "{n} B: {}", out.hang.unwrap());
        match (&out.send, &out.recv) {
            (Some(Ok(_)), Some(Ok(_))) => assert!(recv.bytes() == pattern(i as u64, n)),
            (Some(Err(Error::PeerAborted { .. })), Some(Err(_))) => {}
            other => panic!("{n} B: the two sides disagree: {other:?}"),
        }
        assert_eq!(recv.guard_damage(), None);
    }
    pair.check_clean();
}

/// Two staged GPU sends share the sender's two staging fragments; the first one's receive
/// fails once fragments were announced (the receiver's staging does not fit its `sim_shm`
/// aperture) and aborts the send, whose fragments come back afterwards: the second send,
/// waiting for a free fragment, must go on (it was woken only by the acknowledgements of a
/// send still running, and hung). Found by the protocol property (seed 16864120431268166465).
#[test]
fn fragments_of_an_aborted_staged_send_free_the_sends_waiting_for_them() {
    let vars: &[(&str, &str)] = &[
        ("RUCX_RNDV_THRESH", "16K"),
        ("RUCX_RNDV_FRAG_SIZE", "64K"),
        ("RUCX_RNDV_FRAG_COUNT", "2"),
    ];
    let bad = with_fault(vars, "md=sim_shm,mem=host,budget=64K");
    let pair = Pair::new(
        FabricSpec::gpu().ipc(false).shared_staging(false),
        [vars, &bad],
    );
    let f = &pair.fabric;
    let big = Buf::filled(f, 154_295, Mem::Device(0), 1);
    let small = Buf::filled(f, 26_809, Mem::Device(0), 2);
    let mut rbig = Buf::new(f, 154_295, Mem::Device(1));
    let mut rsmall = Buf::new(f, 26_809, Mem::Host);
    pair.w[0].scope(|sa| {
        pair.w[1].scope(|sb| {
            let s_small = sa.tag_send(pair.ep[0], small.send(), 2);
            let s_big = sa.tag_send(pair.ep[0], big.send(), 1);
            for _ in 0..2 {
                pair.step();
            }
            let r_big = sb.tag_recv(rbig.recv(), 1, TAG_MASK_FULL);
            let r_small = sb.tag_recv(rsmall.recv(), 2, TAG_MASK_FULL);
            let reqs = [&s_small, &s_big, &r_big, &r_small];
            pair.drive_all(&reqs);
            assert!(
                matches!(
                    (s_big.test(), r_big.test()),
                    (
                        Some(Err(Error::PeerAborted { .. })),
                        Some(Err(Error::Registration(_)))
                    )
                ),
                "{:?} {:?}",
                s_big.test(),
                r_big.test()
            );
            assert!(
                matches!(s_small.test(), Some(Ok(_))),
                "{:?}",
                s_small.test()
            );
            assert!(
                matches!(r_small.test(), Some(Ok(_))),
                "{:?}",
                r_small.test()
            );
        })
    });
    assert!(rsmall.bytes() == pattern(2, 26_809));
    pair.check_clean();
}

/// A staged GPU send that fails on its own mid-pipeline (its RMA lane is gone: the sender's
/// only host RMA domain was demoted by another transfer) gives its staging fragments back:
/// the staged sends waiting for one must go on (nothing woke them, and they hung). Found by
/// the protocol property (seed 4339059713044262302).
#[test]
fn fragments_of_a_failed_staged_send_free_the_sends_waiting_for_them() {
    let vars: &[(&str, &str)] = &[
        ("RUCX_ZCOPY_THRESH", "4K"),
        ("RUCX_RNDV_THRESH", "512K"),
        ("RUCX_RNDV_FRAG_SIZE", "64K"),
        ("RUCX_RNDV_FRAG_COUNT", "2"),
    ];
    let bad = with_fault(vars, "md=sim_shm,mem=host,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [&bad, vars]);
    let f = &pair.fabric;
    let first = Buf::filled(f, 248_064, Mem::Device(0), 1);
    let host = Buf::filled(f, 20_581, Mem::Host, 2);
    let second = Buf::filled(f, 92_312, Mem::Device(0), 3);
    let mut r_first = Buf::new(f, 248_064, Mem::Host);
    let mut r_host = Buf::new(f, 20_581, Mem::Host);
    let mut r_second = Buf::new(f, 92_312, Mem::Host);
    pair.w[0].scope(|sa| {
        pair.w[1].scope(|sb| {
            let s1 = sa.tag_send(pair.ep[0], first.send(), 1);
            let q1 = sb.tag_recv(r_first.recv(), 1, TAG_MASK_FULL);
            // A zero-copy eager send: its registration fails and demotes a's only RMA domain.
            let s2 = sa.tag_send(pair.ep[0], host.send(), 2);
            let q2 = sb.tag_recv(r_host.recv(), 2, TAG_MASK_FULL);
            let s3 = sa.tag_send(pair.ep[0], second.send(), 3);
            let q3 = sb.tag_recv(r_second.recv(), 3, TAG_MASK_FULL);
            let reqs = [&s1, &q1, &s2, &q2, &s3, &q3];
            pair.drive_all(&reqs);
            assert!(matches!(s2.test(), Some(Ok(_))) && matches!(q2.test(), Some(Ok(_))));
            for (s, q) in [(&s1, &q1), (&s3, &q3)] {
                match (s.test(), q.test()) {
                    (Some(Ok(_)), Some(Ok(_))) => {}
                    (Some(Err(_)), Some(Err(Error::PeerAborted { .. }))) => {}
                    other => panic!("the two sides disagree: {other:?}"),
                }
            }
        })
    });
    assert!(r_host.bytes() == pattern(2, 20_581));
    assert_eq!(pair.ctx[0].demotions().len(), 1);
    pair.check_clean();
}

/// Reads of staged fragments through a lane being connected on demand (see
/// `staged_fragments_are_read_through_a_lane_of_their_key_s_domain`) wait for it before they
/// take a receive staging fragment (a fragment taken per wait leaked, and with two of them
/// the receive waited forever). Side b's `sim_shm` aperture is exhausted by its second send,
/// which demotes the domain: b stages that send, announcing fragments with `sim_net` keys, to
/// a receiver whose RMA lane is shared memory. Found by the protocol property (seed
/// 9851790444661303995).
#[test]
fn staged_reads_wait_for_their_lane_before_taking_a_staging_fragment() {
    let vars: &[(&str, &str)] = &[
        ("RUCX_ZCOPY_THRESH", "4K"),
        ("RUCX_RNDV_THRESH", "32K"),
        ("RUCX_RNDV_FRAG_SIZE", "64K"),
        ("RUCX_RNDV_FRAG_COUNT", "2"),
    ];
    let bad = with_fault(vars, "md=sim_shm,mem=host,budget=64K");
    let pair = Pair::new(
        FabricSpec::gpu().with_net().shared_staging(false),
        [vars, &bad],
    );
    let f = &pair.fabric;
    let sizes = [51_827usize, 47_339, 63_313];
    let sends: Vec<Buf> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            Buf::filled(
                f,
                n,
                if i == 2 { Mem::Device(1) } else { Mem::Host },
                i as u64,
            )
        })
        .collect();
    let mut recvs: Vec<Buf> = sizes
        .iter()
        .map(|&n| Buf::new(f, n, Mem::Device(0)))
        .collect();
    pair.w[0].scope(|sa| {
        pair.w[1].scope(|sb| {
            let mut reqs = Vec::new();
            for ((i, s), r) in sends.iter().enumerate().zip(recvs.iter_mut()) {
                let tag = i as u64;
                reqs.push(if i == 2 {
                    sb.tag_send_sync(pair.ep[1], s.send(), tag)
                } else {
                    sb.tag_send(pair.ep[1], s.send(), tag)
                });
                reqs.push(sa.tag_recv(r.recv(), tag, TAG_MASK_FULL));
            }
            pair.drive_all(&reqs.iter().collect::<Vec<_>>());
            for r in &reqs {
                assert!(matches!(r.test(), Some(Ok(_))), "{:?}", r.test());
            }
        })
    });
    for (i, r) in recvs.iter().enumerate() {
        assert!(r.bytes() == pattern(i as u64, sizes[i]), "message {i}");
    }
    assert_eq!(pair.ctx[1].demotions().len(), 1);
    pair.check_clean();
}

/// A large host rendezvous is split: the receiver reads the head and asks the sender (RTR
/// with its key) to write the tail. When the sender's RMA lane moved since its RTS (its
/// `sim_shm` domain was demoted by a receive whose registration exceeded the aperture), it
/// writes the tail through a lane of the key's domain, or streams the tail alone followed by
/// the finish message: it streamed the whole message instead, which the receiver counted, and
/// the receive completed with the tail never written. Found by the protocol property (seed
/// 9237354634576905407).
#[test]
fn the_tail_of_a_split_rendezvous_is_written_after_the_sender_s_lane_moved() {
    let vars: &[(&str, &str)] = &[
        ("RUCX_ZCOPY_THRESH", "16K"),
        ("RUCX_RNDV_THRESH", "512K"),
        ("RUCX_RNDV_FRAG_SIZE", "64K"),
        ("RUCX_RNDV_FRAG_COUNT", "2"),
    ];
    let bad = with_fault(vars, "md=sim_shm,mem=host,budget=3M");
    let spec = FabricSpec::gpu()
        .ipc(false)
        .with_net()
        .shared_staging(false)
        .delivery(Delivery::Random {
            seed: 9_237_354_634_576_905_407,
            noresource_per_mille: 0,
        });
    let pair = Pair::new(spec, [&bad, vars]);
    let f = &pair.fabric;
    let (n, m) = (2_029_419usize, 1_335_650usize);
    let big = Buf::filled(f, n, Mem::Host, 1);
    let other = Buf::filled(f, m, Mem::Device(1), 2);
    let mut r_big = Buf::new(f, n, Mem::Host);
    let mut r_other = Buf::new(f, m, Mem::Host);
    let small = Buf::filled(f, 115, Mem::Device(1), 3);
    let mut r_small = Buf::new(f, 115, Mem::Device(0));
    let mid = Buf::filled(f, 56_316, Mem::Device(1), 4);
    let mut r_mid = Buf::new(f, 59_684, Mem::HostRaw);
    pair.w[0].scope(|sa| {
        pair.w[1].scope(|sb| {
            let s_big = sa.tag_send(pair.ep[0], big.send(), 1);
            pair.step();
            let s_other = sb.tag_send(pair.ep[1], other.send(), 2);
            let s_small = sb.tag_send_sync(pair.ep[1], small.send(), 3);
            let s_mid = sb.tag_send(pair.ep[1], mid.send(), 4);
            let q_mid = sa.tag_recv(r_mid.recv(), 4, TAG_MASK_FULL);
            // Its registration exceeds a's aperture: a demotes sim_shm.
            let q_other = sa.tag_recv(r_other.recv(), 2, TAG_MASK_FULL);
            let q_small = sa.tag_recv(r_small.recv(), 3, TAG_MASK_FULL);
            let q_big = sb.tag_recv(r_big.recv(), 0, 0);
            let reqs = [
                &s_big, &q_big, &s_other, &q_other, &s_small, &q_small, &s_mid, &q_mid,
            ];
            pair.drive_all(&reqs);
            assert!(matches!(s_big.test(), Some(Ok(_))), "{:?}", s_big.test());
            assert!(matches!(q_big.test(), Some(Ok(_))), "{:?}", q_big.test());
        })
    });
    assert!(
        r_big.bytes() == pattern(1, n),
        "the big message's data differs"
    );
    assert_eq!(r_big.guard_damage(), None);
    pair.check_clean();
}

/// A multi-fragment eager send that fails part-way (a transport error after its first
/// fragment went out) ends with that error and tells the receiver: a receive that matched the
/// first fragment ends with `PeerAborted` instead of waiting forever for the rest, and a
/// partial message nobody matched yet is dropped, so a later receive gets the next message
/// whole. In order and delivered out of order (the abort may overtake the first fragment).
#[test]
fn a_multi_fragment_eager_send_failing_part_way_ends_the_receive() {
    let deliveries = [11, 12].map(|seed| Delivery::Random {
        seed,
        noresource_per_mille: 0,
    });
    // The second fragment's post fails.
    let fail = |pair: &Pair| {
        pair.fabric
            .fail_ops_after(pair.nodes[0], LaneKind::Shm, 1, 1)
    };
    a_failing_eager_send_ends_the_receive(12_000, Proto::EagerBcopyMulti, &deliveries, fail);
}

/// An eager zero-copy send whose last fragment's completion fails (the transport took every
/// fragment, then lost one) ends the receive on the peer too: the sender tells it with an
/// eager abort, as when posting fails part-way. Before, the receive waited for the lost bytes
/// forever, and an unexpected partial message stayed queued.
#[test]
fn an_eager_zero_copy_send_whose_completion_fails_ends_the_receive() {
    let n = 40_000;
    let deliveries = [Delivery::Random {
        seed: 21,
        noresource_per_mille: 0,
    }];
    // 5 fragments of 8000 bytes (the shm-like lane's am_zcopy limit): the last one's
    // completion fails.
    let last = (n as u64).div_ceil(8000) - 1;
    let fail = |pair: &Pair| {
        pair.fabric
            .fail_completions_after(pair.nodes[0], LaneKind::Shm, last, 1)
    };
    a_failing_eager_send_ends_the_receive(n, Proto::EagerZcopy, &deliveries, fail);
}

/// An eager send of `n` bytes by `proto` that `fail` makes fail part-way (in order and with
/// each of `deliveries`) ends both sides: the send with the transport's error, a matched
/// receive with the peer's abort; an unexpected partial message is dropped (not left queued),
/// and the endpoint carries the next message of that tag whole.
fn a_failing_eager_send_ends_the_receive(
    n: usize,
    proto: Proto,
    deliveries: &[Delivery],
    fail: impl Fn(&Pair),
) {
    for &delivery in std::iter::once(&Delivery::InOrder).chain(deliveries) {
        let pair = Pair::new(
            FabricSpec::host().delivery(delivery),
            [HOST_VARS, HOST_VARS],
        );
        let table = pair.w[0].proto_table(pair.ep[0]).unwrap();
        assert_eq!(
            rucx_ucp::proto::lookup(&table, n).map(|r| r.proto),
            Some(proto)
        );
        // Matched: the receive is posted first.
        fail(&pair);
        let send = Buf::filled(&pair.fabric, n, Mem::Host, 1);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        let out = pair.transfer(0, &send, &mut recv, 5, false);
        assert!(out.hang.is_none(), "{delivery:?}: {}", out.hang.unwrap());
        assert!(
            matches!(
                (&out.send, &out.recv),
                (
                    Some(Err(Error::Io { .. })),
                    Some(Err(Error::PeerAborted { .. }))
                )
            ),
            "{delivery:?}: {out:?}"
        );
        assert_eq!(recv.guard_damage(), None);
        // Unexpected: the partial message arrives before any receive.
        fail(&pair);
        let send = Buf::filled(&pair.fabric, n, Mem::Host, 2);
        pair.w[0].scope(|s| {
            let r = s.tag_send(pair.ep[0], send.send(), 6);
            pair.drive(|| r.test().is_some()).unwrap();
            assert!(
                matches!(r.test(), Some(Err(Error::Io { .. }))),
                "{delivery:?}: {:?}",
                r.test()
            );
        });
        pair.settle();
        assert_eq!(pair.w[1].probe(6, TAG_MASK_FULL), None, "{delivery:?}");
        // The endpoint stays usable: the next message of that tag arrives whole.
        let send = Buf::filled(&pair.fabric, n, Mem::Host, 3);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        pair.transfer(0, &send, &mut recv, 6, false).expect_ok();
        assert!(recv.bytes() == pattern(3, n), "{delivery:?}");
        assert_eq!(pair.w[0].live_requests() + pair.w[1].live_requests(), 0);
        pair.check_clean();
    }
}

/// A host rendezvous receive whose buffer registration fails does not end: a GPU sender stages
/// its fragments, and the receiver reads them into its receive staging and copies them on
/// (both for a failure of the domain, which demotes it, and one of the buffer alone). Before,
/// both sides ended with the registration error although a path was left.
#[test]
fn a_host_receive_whose_registration_fails_continues_through_staging() {
    for kind in [RegErrorKind::BadAddress, RegErrorKind::NotExportable] {
        // Without the GPU zero-copy lane (which reads into host memory directly), the GPU
        // sender stages.
        let pair = Pair::new(
            FabricSpec::gpu().ipc(false).with_net(),
            [HOST_VARS, HOST_VARS],
        );
        let n = 1 << 20;
        pair.fail_shm_registration(1, 1, kind);
        let send = Buf::filled(&pair.fabric, n, Mem::Device(0), 21);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        let out = pair.transfer(0, &send, &mut recv, 4, false);
        assert!(out.hang.is_none(), "{kind:?}: {}", out.hang.unwrap());
        out.expect_ok();
        assert!(recv.bytes() == pattern(21, n), "{kind:?}: data differs");
        assert_eq!(recv.guard_damage(), None);
        // A demoted domain is not asked again: the fragments go through staging. A buffer's
        // own refusal is not remembered for host memory here, so the first fragment may find
        // the buffer registered after all.
        if kind == RegErrorKind::BadAddress {
            assert_eq!(
                pair.w[1]
                    .counters()
                    .get("rendezvous receive staged into host memory"),
                Some(&1),
                "{:?}",
                pair.w[1].counters()
            );
        }
        let demoted = pair.ctx[1].demotions().len();
        assert_eq!(
            demoted,
            usize::from(kind == RegErrorKind::BadAddress),
            "{kind:?}"
        );
        // The next transfer goes on as the new plan says.
        let send = Buf::filled(&pair.fabric, n, Mem::Device(0), 22);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        pair.transfer(0, &send, &mut recv, 4, false).expect_ok();
        assert!(recv.bytes() == pattern(22, n), "{kind:?}: data differs");
        pair.check_clean();
    }
}

/// A rendezvous send whose registration fails is selected again from the plan made after the
/// demotion (the network lane's domain now carries host memory), rather than being sent
/// without a key for the receiver to stream; the sends after it start there.
#[test]
fn a_rendezvous_send_whose_registration_fails_is_reselected_from_the_new_plan() {
    let vars: &[(&str, &str)] = &[
        ("RUCX_RNDV_THRESH", "32K"),
        ("RUCX_RNDV_SCHEME", "get_zcopy"),
    ];
    let pair = Pair::new(FabricSpec::host().with_net(), [vars, vars]);
    let n = 1 << 20;
    pair.fail_shm_registration(0, 1, RegErrorKind::BadAddress);
    for i in 0..2u64 {
        let send = Buf::filled(&pair.fabric, n, Mem::Host, 40 + i);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        let out = pair.transfer(0, &send, &mut recv, 8, false);
        assert!(out.hang.is_none(), "{}", out.hang.unwrap());
        out.expect_ok();
        assert!(recv.bytes() == pattern(40 + i, n));
    }
    assert_eq!(pair.ctx[0].demotions().len(), 1);
    let counters = pair.w[1].counters();
    assert_eq!(
        counters.get("rendezvous receive streamed"),
        None,
        "{counters:?}"
    );
    assert_eq!(
        pair.fabric.live_registrations(pair.nodes[0], LaneKind::Shm),
        0
    );
    pair.check_clean();
}

/// A synchronous send whose rendezvous registration fails is re-selected from the synchronous
/// table of the plan made after the demotion: it still completes only once the receiver
/// matched it, and the data moves by the new plan's read lane (not streamed).
#[test]
fn a_synchronous_send_whose_registration_fails_still_waits_for_the_match() {
    let vars: &[(&str, &str)] = &[
        ("RUCX_RNDV_THRESH", "32K"),
        ("RUCX_RNDV_SCHEME", "get_zcopy"),
    ];
    let pair = Pair::new(FabricSpec::host().with_net(), [vars, vars]);
    // Eager for a plain tag send, a rendezvous for a synchronous one.
    let n = 20_000;
    let plan = pair.w[0].plan(pair.ep[0]).unwrap();
    let host = rucx_ucp::plan::MemKey::HOST;
    assert!(
        !plan
            .select(rucx_ucp::plan::Op::Tag, host, n)
            .unwrap()
            .is_rndv()
    );
    assert!(
        plan.select(rucx_ucp::plan::Op::TagSync, host, n)
            .unwrap()
            .is_rndv()
    );
    pair.fail_shm_registration(0, 1, RegErrorKind::BadAddress);
    let send = Buf::filled(&pair.fabric, n, Mem::Host, 50);
    let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
    pair.w[0].scope(|ss| {
        let s = ss.tag_send_sync(pair.ep[0], send.send(), 9);
        for _ in 0..200 {
            pair.step();
        }
        assert!(
            s.test().is_none(),
            "a synchronous send ended before any receive: {:?}",
            s.test()
        );
        pair.w[1].scope(|sr| {
            let r = sr.tag_recv(recv.recv(), 9, TAG_MASK_FULL);
            pair.drive(|| s.test().is_some() && r.test().is_some())
                .expect("both end");
            assert_eq!(s.test().unwrap().unwrap().len, n);
            assert_eq!(r.test().unwrap().unwrap().len, n);
        });
    });
    assert!(recv.bytes() == pattern(50, n));
    assert_eq!(pair.ctx[0].demotions().len(), 1);
    let counters = pair.w[1].counters();
    assert_eq!(
        counters.get("rendezvous receive streamed"),
        None,
        "{counters:?}"
    );
    assert!(
        counters.contains_key("rendezvous receive by read"),
        "{counters:?}"
    );
    pair.check_clean();
}

/// The simulated fabric cannot signal events (poll-only): a worker over it still arms and
/// waits, but wakes every `POLL_ONLY_TICK` to poll it, so a message is seen without a wake-up
/// and a blocking wait still completes.
#[test]
fn a_poll_only_worker_sleeps_in_short_ticks_and_still_receives() {
    let pair = Pair::new(FabricSpec::host(), [HOST_VARS, HOST_VARS]);
    let [a, b] = &pair.w;
    assert_eq!(a.wait_tick(), rucx_ucp::POLL_ONLY_TICK);
    while a.progress() + b.progress() > 0 {}
    a.arm().expect("arming a poll-only worker succeeds");
    let t = std::time::Instant::now();
    a.wait(None).unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(1),
        "a poll-only worker slept {:?}, not one tick",
        t.elapsed()
    );
    let data = pattern(8, 100);
    let mut got = vec![0u8; 100];
    a.scope(|s| {
        let r = s.tag_recv(&mut got, 5, rucx_ucp::TAG_MASK_FULL);
        b.scope(|t| {
            let sd = t.tag_send(pair.ep[1], &data, 5);
            assert!(b.progress_until(None, || sd.test().is_some()));
        });
        r.wait().unwrap();
    });
    assert!(got == data);
}

/// A peer that goes away after the worker announced its shutdown (`Worker::set_closing`, as a
/// job does after its final barrier) is the expected end: no warning. Before it, the same end
/// is a failure and warned about once.
#[test]
fn a_peer_leaving_a_closing_worker_is_not_warned_about() {
    for closing in [false, true] {
        let pair = Pair::new(FabricSpec::host(), [HOST_VARS, HOST_VARS]);
        if closing {
            pair.w[0].set_closing();
        }
        pair.fabric.fail_node(pair.nodes[1], "gone");
        pair.drive(|| pair.w[0].ep_error(pair.ep[0]).is_some())
            .expect("the survivor sees its peer end");
        let warned: Vec<String> = pair
            .warnings
            .all()
            .into_iter()
            // Side a's (its endpoint to node b); side b, not closing, warns either way.
            .filter(|w| w.contains("failed") && w.contains("sim node b"))
            .collect();
        assert_eq!(
            warned.len(),
            usize::from(!closing),
            "closing {closing}: {warned:?}"
        );
    }
}
