//! A request that ends early (its peer fails) while a copy this process runs on its buffer is
//! still in flight (a `cuda_ipc`-like lane: the copy engine reads or writes the buffer through
//! the peer's mapping until the copy completes, whatever the peer does) is not reported, and
//! its buffer not handed back, until that copy completed. The sim fabric holds the copy's
//! completion (manual delivery) across the peer's failure, so the test sees the request wait
//! for it.

mod harness;

use harness::{Buf, Mem, Pair, Watchdog, pattern};
use rucx_ucp::{Completion, Queued, RawBuf, TAG_MASK_FULL};
use rucx_ucs::{Error, Result};
use rucx_uct_sim::{Delivery, FabricSpec, HeldWhat, LaneKind};

const VARS: &[(&str, &str)] = &[("RUCX_RNDV_FRAG_SIZE", "64K")];

/// Held completions of side 0's operations on the GPU zero-copy lane.
fn ipc_ops_held(pair: &Pair) -> Vec<u64> {
    pair.fabric
        .held()
        .into_iter()
        .filter(|h| {
            h.to == pair.nodes[0]
                && h.lane == LaneKind::Ipc
                && matches!(h.what, HeldWhat::Completion { .. })
        })
        .map(|h| h.seq)
        .collect()
}

/// Release everything the fabric holds except side 0's GPU zero-copy completions, and step,
/// until one of those is held (side 0's copy is in flight).
fn run_until_ipc_copy_in_flight(pair: &Pair) -> Vec<u64> {
    for _ in 0..2_000 {
        let held = ipc_ops_held(pair);
        if !held.is_empty() {
            return held;
        }
        for h in pair.fabric.held() {
            if !held.contains(&h.seq) {
                let _ = pair.fabric.release(h.seq);
            }
        }
        pair.step();
    }
    panic!(
        "side 0 never had a GPU copy in flight: {:?}",
        pair.fabric.held()
    );
}

/// Held completions of side 0's copies on its copy lane (host staging <-> GPU).
fn copies_held(pair: &Pair) -> usize {
    pair.fabric
        .held()
        .into_iter()
        .filter(|h| {
            h.to == pair.nodes[0]
                && h.lane == LaneKind::Copy
                && matches!(h.what, HeldWhat::Completion { .. })
        })
        .count()
}

/// A device receive of a host sender's message, read into receive staging over the shared
/// memory lane and copied on to the GPU by the copy lane (the staged pipeline): the sender
/// fails while copies from staging to the GPU are in flight (random delivery holds their
/// completions). Such copies always complete: the progress that handles the failure waits for
/// them, and the receive is reported ended by that very progress. (It used to wait for a later
/// progress to bring the last copy's completion: found by the peer-failure property.) Many
/// delivery seeds, each run until at least two copies are in flight (one progress releases
/// some of them, and before the fix seed 171 left one held).
#[test]
fn a_staged_device_receive_ends_in_the_progress_that_handles_its_peers_failure() {
    let _dog = Watchdog::arm(120, "staged receive, peer fails mid-copy".into());
    let vars: &[(&str, &str)] = &[
        ("RUCX_RNDV_THRESH", "32K"),
        ("RUCX_RNDV_SCHEME", "get_zcopy"),
        ("RUCX_RNDV_FRAG_SIZE", "64K"),
        ("RUCX_RNDV_FRAG_COUNT", "8"),
    ];
    let len = 130_823;
    let mut caught = 0;
    for seed in 0..256u64 {
        let spec = FabricSpec::gpu()
            .ipc(false)
            .with_net()
            .shared_staging(true)
            .delivery(Delivery::Random {
                seed,
                noresource_per_mille: 0,
            });
        let pair = Pair::new(spec, [vars, vars]);
        let src = Buf::filled(&pair.fabric, len, Mem::Host, 3);
        let dst = Buf::new(&pair.fabric, len, Mem::Device(0));
        // SAFETY: `src` and `dst` outlive the requests (their ends are taken below, before the
        // buffers drop, or the fabric is failed and the workers dropped first), and nothing
        // else touches them meanwhile.
        let sbuf = unsafe { RawBuf::new(src.addr(), len, None) };
        let send = pair.w[1].tag_send_queued(pair.ep[1], sbuf, 4, false, 8);
        assert!(matches!(send, Queued::Pending(_)), "{send:?}");
        // The request to send arrives unexpected: the receive reads the sender's buffer.
        for _ in 0..50 {
            pair.step();
        }
        // SAFETY: as above.
        let rbuf = unsafe { RawBuf::new(dst.addr(), len, None) };
        let recv = pair.w[0].tag_recv_queued(rbuf, 4, TAG_MASK_FULL, 7);
        assert!(matches!(recv, Queued::Pending(_)), "{recv:?}");
        let mut ends: Vec<(u64, Result<Completion>)> = Vec::new();
        let mut in_flight = false;
        for _ in 0..2_000 {
            pair.step();
            pair.w[0].take_completed(&mut ends);
            if !ends.is_empty() {
                break;
            }
            if copies_held(&pair) >= 2 {
                in_flight = true;
                break;
            }
        }
        if !in_flight {
            // The receive completed before any copy was held: nothing to check with this seed.
            assert!(matches!(ends[..], [(7, Ok(_))]), "seed {seed}: {ends:?}");
            continue;
        }
        caught += 1;
        pair.fabric.fail_node(pair.nodes[1], "killed by the test");
        pair.w[0].progress();
        pair.w[0].take_completed(&mut ends);
        assert_eq!(
            ends.len(),
            1,
            "seed {seed}: the receive did not end in the progress that handled its peer's \
             failure ({} copies still held)",
            copies_held(&pair)
        );
        match &ends[0] {
            (7, Err(Error::EndpointFailure { .. })) => {}
            (7, Ok(c)) if c.len == len => assert!(dst.bytes() == pattern(3, len), "seed {seed}"),
            other => panic!("seed {seed}: {other:?}"),
        }
        assert_eq!(copies_held(&pair), 0, "seed {seed}");
        assert!(
            pair.fabric.violations().is_empty(),
            "seed {seed}: {:?}",
            pair.fabric.violations()
        );
    }
    assert!(
        caught > 0,
        "no seed had a copy in flight when the peer failed"
    );
}

/// Progress side 0 alone (side 1 failed) `n` times.
fn spin(pair: &Pair, n: usize) {
    for _ in 0..n {
        pair.w[0].progress();
    }
}

/// A device receive reading the sender's device buffer through the GPU lane (a queued
/// request, as the C ABI posts them): the sender fails with the read in flight; the receive's
/// end is queued only after the read completed.
#[test]
fn a_queued_receive_reading_through_the_gpu_lane_waits_for_its_read_after_the_peer_fails() {
    let _dog = Watchdog::arm(60, "queued receive, peer fails mid-read".into());
    let pair = Pair::new(FabricSpec::gpu().delivery(Delivery::Manual), [VARS, VARS]);
    let len = 1 << 20;
    let src = Buf::filled(&pair.fabric, len, Mem::Device(0), 5);
    let dst = Buf::new(&pair.fabric, len, Mem::Device(0));
    // SAFETY: `dst` outlives the request (checked below: its end is taken before the end of
    // the test), and nothing else touches it meanwhile.
    let rbuf = unsafe { RawBuf::new(dst.addr(), len, None) };
    let recv = pair.w[0].tag_recv_queued(rbuf, 9, TAG_MASK_FULL, 77);
    assert!(matches!(recv, Queued::Pending(_)), "{recv:?}");
    // SAFETY: as above, for `src`.
    let sbuf = unsafe { RawBuf::new(src.addr(), len, None) };
    let send = pair.w[1].tag_send_queued(pair.ep[1], sbuf, 9, false, 78);
    assert!(matches!(send, Queued::Pending(_)), "{send:?}");
    let held = run_until_ipc_copy_in_flight(&pair);
    pair.fabric.fail_node(pair.nodes[1], "killed by the test");
    let mut ends: Vec<(u64, Result<Completion>)> = Vec::new();
    spin(&pair, 200);
    pair.w[0].take_completed(&mut ends);
    assert!(
        ends.is_empty(),
        "the receive was handed back while its read was in flight: {ends:?}"
    );
    for s in held {
        pair.fabric.release(s).unwrap();
    }
    spin(&pair, 200);
    pair.w[0].take_completed(&mut ends);
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert_eq!(ends[0].0, 77);
    assert!(
        matches!(ends[0].1, Err(Error::EndpointFailure { .. })),
        "{:?}",
        ends[0].1
    );
    // Side 1 failed: its own send ends too (its buffer is ours again).
    let mut b_ends = Vec::new();
    for _ in 0..200 {
        pair.w[1].progress();
        pair.w[1].take_completed(&mut b_ends);
        if !b_ends.is_empty() {
            break;
        }
    }
    assert_eq!(b_ends.len(), 1, "{b_ends:?}");
    assert!(
        pair.fabric.violations().is_empty(),
        "{:?}",
        pair.fabric.violations()
    );
}

/// A put of device memory into the peer's mapped device memory through the GPU lane (in a
/// scope): the peer fails with the write in flight; `test` reports nothing until the write
/// completed, then the failure.
#[test]
fn a_put_through_the_gpu_lane_waits_for_its_write_after_the_peer_fails() {
    let _dog = Watchdog::arm(60, "put, peer fails mid-write".into());
    let pair = Pair::new(FabricSpec::gpu().delivery(Delivery::Manual), [VARS, VARS]);
    let len = (1 << 20) + 17;
    let mut target = Buf::filled(&pair.fabric, len, Mem::Device(0), 1);
    let src = Buf::filled(&pair.fabric, len, Mem::Device(0), 2);
    let map = pair.w[1].mem_map(target.recv()).unwrap();
    let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
    pair.w[0].scope(|s| {
        let r = s.put(pair.ep[0], src.send(), rkey.base(), &rkey);
        let held = run_until_ipc_copy_in_flight(&pair);
        assert!(r.test().is_none());
        pair.fabric.fail_node(pair.nodes[1], "killed by the test");
        spin(&pair, 200);
        assert!(
            r.test().is_none(),
            "the put ended while its write was in flight: {:?}",
            r.test()
        );
        for s in held {
            pair.fabric.release(s).unwrap();
        }
        spin(&pair, 200);
        let res = r.test().expect("the put ends once its write completed");
        assert!(matches!(res, Err(Error::EndpointFailure { .. })), "{res:?}");
    });
    drop(map);
    // The sim copies when the operation is posted: the write did land.
    assert!(target.bytes() == pattern(2, len));
    assert!(
        pair.fabric.violations().is_empty(),
        "{:?}",
        pair.fabric.violations()
    );
}
