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
