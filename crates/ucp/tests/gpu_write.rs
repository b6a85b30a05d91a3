//! Host to GPU by remote write over the sim fabric: the host sender writes into the GPU
//! receiver's buffer through its zero-copy GPU lane (sim_ipc standing in for cuda_ipc), and
//! every way out of that path (the receiver's registration failing at once or part way, a
//! sender without the lane, truncation) still delivers every byte or reports why.

mod harness;

use harness::{Buf, Mem, Pair, is_truncation, pattern, with_fault};
use rucx_uct_sim::{Delivery, FabricSpec, LaneKind};

const VARS: &[(&str, &str)] = &[
    ("RUCX_ZCOPY_THRESH", "16K"),
    ("RUCX_RNDV_FRAG_SIZE", "256K"),
];

/// Rendezvous sizes (and one small one): whole fragments, a fragment and a bit, many
/// fragments.
const SIZES: &[usize] = &[100, 100_000, 256 << 10, (256 << 10) + 1, (3 << 20) + 5];

const BY_WRITE: &str = "rendezvous receive by remote write into GPU memory";
const STAGED_READ: &str = "rendezvous receive by read, staged to the GPU";

/// Send every size host -> device from side 0 to side 1, each byte checked.
fn host_to_device(pair: &Pair, seed: u64) {
    for (i, &n) in SIZES.iter().enumerate() {
        let id = seed << 32 | i as u64;
        let send = Buf::filled(&pair.fabric, n, Mem::Host, id);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Device(1));
        let out = pair.transfer(0, &send, &mut recv, 40 + i as u64, false);
        let (s, r) = out.expect_ok();
        assert_eq!((s.len, r.len), (n, n));
        assert!(recv.bytes() == pattern(id, n), "{n} B: data differs");
        assert_eq!(recv.guard_damage(), None, "{n} B");
    }
}

fn count(pair: &Pair, side: usize, what: &str) -> u64 {
    pair.w[side].counters().get(what).copied().unwrap_or(0)
}

#[test]
fn host_sender_writes_into_the_gpu_receive_buffer() {
    for delivery in [
        Delivery::InOrder,
        Delivery::Random {
            seed: 5,
            noresource_per_mille: 30,
        },
    ] {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [VARS, VARS]);
        host_to_device(&pair, 1);
        // Every rendezvous (all but the 100-byte eager one) went by remote write.
        assert_eq!(count(&pair, 1, BY_WRITE), 4, "{:?}", pair.w[1].counters());
        assert_eq!(
            count(&pair, 1, STAGED_READ),
            0,
            "{:?}",
            pair.w[1].counters()
        );
        // The other direction is untouched: GPU to host is still read by the receiver.
        let send = Buf::filled(&pair.fabric, 1 << 20, Mem::Device(1), 9);
        let mut recv = Buf::new(&pair.fabric, 1 << 20, Mem::Host);
        pair.transfer(1, &send, &mut recv, 9, false).expect_ok();
        assert!(recv.bytes() == pattern(9, 1 << 20));
        pair.check_clean();
    }
}

#[test]
fn a_receiver_whose_gpu_registration_fails_reads_through_staging() {
    // The receiver's GPU lane cannot register device memory at all: staged reads, intact.
    let b = with_fault(VARS, "md=sim_ipc,mem=cuda,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [VARS, &b]);
    host_to_device(&pair, 2);
    assert_eq!(count(&pair, 1, BY_WRITE), 0);
    assert_eq!(
        count(&pair, 1, STAGED_READ),
        4,
        "{:?}",
        pair.w[1].counters()
    );
    pair.check_clean();

    // Part way: the 3rd device registration of the receiver's GPU lane fails (the domain is
    // demoted); the transfers before went by write, the rest by staged reads.
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    pair.fabric.fail_registration(
        pair.nodes[1],
        LaneKind::Ipc,
        pair.fabric.reg_attempts(pair.nodes[1], LaneKind::Ipc) + 3,
        rucx_ucs::RegErrorKind::BadAddress,
    );
    host_to_device(&pair, 3);
    let (w, s) = (count(&pair, 1, BY_WRITE), count(&pair, 1, STAGED_READ));
    assert!(w >= 1 && s >= 1 && w + s == 4, "write {w}, staged {s}");
    pair.check_clean();
}

#[test]
fn a_sender_that_cannot_describe_its_buffer_streams_it() {
    // The sender's GPU lane refuses its host buffers (demoted for host memory): the receiver
    // gave it a key, but the data comes as streamed fragments instead, every byte intact.
    let a = with_fault(VARS, "md=sim_ipc,mem=host,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [&a, VARS]);
    host_to_device(&pair, 4);
    let d = pair.ctx[0].demotions();
    assert!(d.len() == 1 && d[0].md == "sim_ipc", "{d:?}");
    // The receiver offered its key every time; the sender streamed instead.
    assert_eq!(count(&pair, 1, BY_WRITE), 4, "{:?}", pair.w[1].counters());
    pair.check_clean();
}

#[test]
fn a_remote_write_into_a_smaller_gpu_buffer_is_truncated() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    for (i, &n) in [100_000usize, 1 << 20, (3 << 20) + 5].iter().enumerate() {
        let send = Buf::filled(&pair.fabric, n, Mem::Host, 50 + i as u64);
        let cap = n / 2 + 1;
        let mut recv = Buf::new(&pair.fabric, cap, Mem::Device(1));
        let out = pair.transfer(0, &send, &mut recv, 7, false);
        assert!(out.hang.is_none(), "{}", out.hang.unwrap());
        assert!(matches!(out.send, Some(Ok(_))), "{n} B: {:?}", out.send);
        let r = out.recv.unwrap();
        assert!(is_truncation(&r, n, cap), "{n} B into {cap}: {r:?}");
        assert!(recv.bytes() == &pattern(50 + i as u64, n)[..cap]);
        assert_eq!(recv.guard_damage(), None, "{n} B into {cap}");
    }
    assert_eq!(count(&pair, 1, BY_WRITE), 3, "{:?}", pair.w[1].counters());
    pair.check_clean();
}

const BY_READ: &str = "rendezvous receive by read (GPU zero-copy)";
const PULLED: &str = "rendezvous receive pipelined through host staging";

/// Send every size device -> host from side 0 to side 1, each byte and the guards checked.
fn device_to_host(pair: &Pair, seed: u64) {
    for (i, &n) in SIZES.iter().enumerate() {
        let id = seed << 32 | i as u64;
        let send = Buf::filled(&pair.fabric, n, Mem::Device(0), id);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        let out = pair.transfer(0, &send, &mut recv, 70 + i as u64, false);
        let (s, r) = out.expect_ok();
        assert_eq!((s.len, r.len), (n, n));
        assert!(recv.bytes() == pattern(id, n), "{n} B: data differs");
        assert_eq!(recv.guard_damage(), None, "{n} B");
    }
}

#[test]
fn a_host_only_receiver_reads_a_gpu_sender_through_its_mapping() {
    // Side 1 never meets GPU memory: its receives of the GPU sender's rendezvous still read
    // the sender's buffer through the zero-copy GPU lane (one device-to-host copy into the
    // receive buffer, where the copy engine is fastest into pinned memory), not through the
    // sender's staging and a CPU copy.
    for delivery in [
        Delivery::InOrder,
        Delivery::Random {
            seed: 11,
            noresource_per_mille: 30,
        },
    ] {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [VARS, VARS]);
        device_to_host(&pair, 5);
        let c = pair.w[1].counters();
        // Every size is a rendezvous for GPU memory here (no bounce below 16K of eager).
        assert_eq!(count(&pair, 1, BY_READ), SIZES.len() as u64, "{c:?}");
        assert_eq!(count(&pair, 1, PULLED), 0, "{c:?}");
        pair.check_clean();
    }
}

#[test]
fn a_gpu_sender_whose_registration_fails_is_staged_to_a_host_only_receiver() {
    // The sender's GPU lane cannot export its device memory: no key in the request to send, so
    // the host-only receiver asks it to stage; every byte still arrives.
    let a = with_fault(VARS, "md=sim_ipc,mem=cuda,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [&a, VARS]);
    device_to_host(&pair, 6);
    let c = pair.w[1].counters();
    assert_eq!(count(&pair, 1, BY_READ), 0, "{c:?}");
    assert_eq!(count(&pair, 1, PULLED), SIZES.len() as u64, "{c:?}");
    pair.check_clean();
}

#[test]
fn a_failed_read_of_a_gpu_sender_into_host_memory_loses_no_byte() {
    // The host-only receiver's reads through the GPU lane fail: the receive falls back
    // (the sender streams or stages) and every byte arrives, or both sides end with an error:
    // never a hang, never wrong bytes.
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    pair.fabric.fail_next_ops(pair.nodes[1], LaneKind::Ipc, 2);
    for (i, &n) in SIZES.iter().enumerate() {
        let id = 7 << 32 | i as u64;
        let send = Buf::filled(&pair.fabric, n, Mem::Device(0), id);
        let mut recv = Buf::new(&pair.fabric, n, Mem::Host);
        let out = pair.transfer(0, &send, &mut recv, 90 + i as u64, false);
        assert!(out.hang.is_none(), "{}", out.hang.unwrap());
        match (&out.send, &out.recv) {
            (Some(Ok(_)), Some(Ok(r))) => {
                assert_eq!(r.len, n);
                assert!(recv.bytes() == pattern(id, n), "{n} B: data differs");
            }
            other => panic!("{n} B: {other:?}"),
        }
        assert_eq!(recv.guard_damage(), None, "{n} B");
    }
    pair.check_clean();
}

#[test]
fn a_gpu_read_into_a_smaller_host_buffer_is_truncated() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    for (i, &n) in [100_000usize, 1 << 20, (3 << 20) + 5].iter().enumerate() {
        let id = 60 + i as u64;
        let send = Buf::filled(&pair.fabric, n, Mem::Device(0), id);
        let cap = n / 2 + 1;
        let mut recv = Buf::new(&pair.fabric, cap, Mem::Host);
        let out = pair.transfer(0, &send, &mut recv, 8, false);
        assert!(out.hang.is_none(), "{}", out.hang.unwrap());
        assert!(matches!(out.send, Some(Ok(_))), "{n} B: {:?}", out.send);
        let r = out.recv.unwrap();
        assert!(is_truncation(&r, n, cap), "{n} B into {cap}: {r:?}");
        assert!(recv.bytes() == &pattern(id, n)[..cap]);
        assert_eq!(recv.guard_damage(), None, "{n} B into {cap}");
    }
    assert_eq!(count(&pair, 1, BY_READ), 3, "{:?}", pair.w[1].counters());
    pair.check_clean();
}

const SHARED_SEND: &str = "rendezvous send by remote write on a shared GPU";
const SHARED_RECV: &str = "rendezvous receive by remote write on a shared GPU";

/// Every size device -> device both ways (side 0 first), each byte and the guards checked;
/// then a receive smaller than the message each way (truncated, the bytes that fit intact).
fn device_both_ways(pair: &Pair, seed: u64) {
    for (i, &n) in SIZES.iter().enumerate() {
        for from in [0, 1] {
            let id = seed << 32 | (2 * i + from) as u64;
            let send = Buf::filled(&pair.fabric, n, Mem::Device(0), id);
            let mut recv = Buf::new(&pair.fabric, n, Mem::Device(0));
            let out = pair.transfer(from, &send, &mut recv, 90 + id, false);
            let (s, r) = out.expect_ok();
            assert_eq!((s.len, r.len), (n, n));
            assert!(
                recv.bytes() == pattern(id, n),
                "{n} B from {from}: data differs"
            );
            assert_eq!(recv.guard_damage(), None, "{n} B from {from}");
        }
    }
    for from in [0, 1] {
        let n = (1 << 20) + 3;
        let cap = n / 2;
        let send = Buf::filled(&pair.fabric, n, Mem::Device(0), seed + from as u64);
        let mut recv = Buf::new(&pair.fabric, cap, Mem::Device(0));
        let out = pair.transfer(from, &send, &mut recv, 77, false);
        assert!(out.hang.is_none(), "{}", out.hang.unwrap());
        assert!(matches!(out.send, Some(Ok(_))), "{:?}", out.send);
        let r = out.recv.unwrap();
        assert!(is_truncation(&r, n, cap), "{n} B into {cap}: {r:?}");
        assert!(recv.bytes() == &pattern(seed + from as u64, n)[..cap]);
        assert_eq!(recv.guard_damage(), None);
    }
}

#[test]
fn on_one_shared_gpu_the_lower_id_issues_every_copy() {
    for delivery in [
        Delivery::InOrder,
        Delivery::Random {
            seed: 21,
            noresource_per_mille: 30,
        },
    ] {
        let pair = Pair::new(
            FabricSpec::gpu().shared_gpus(true).delivery(delivery),
            [VARS, VARS],
        );
        device_both_ways(&pair, 8);
        // Every message is a rendezvous (GPU memory, below the bounce's eager size none is
        // copied twice); the copier wrote all its sends and read all its receives, the other
        // side copied nothing.
        let msgs = SIZES.len() as u64 + 1;
        let copier = if count(&pair, 0, SHARED_SEND) > 0 {
            0
        } else {
            1
        };
        let other = 1 - copier;
        let (c, o) = (pair.w[copier].counters(), pair.w[other].counters());
        assert_eq!(count(&pair, copier, SHARED_SEND), msgs, "{c:?}");
        assert_eq!(count(&pair, copier, BY_READ), msgs, "{c:?}");
        assert_eq!(count(&pair, copier, SHARED_RECV), 0, "{c:?}");
        assert_eq!(count(&pair, other, SHARED_RECV), msgs, "{o:?}");
        assert_eq!(count(&pair, other, SHARED_SEND), 0, "{o:?}");
        assert_eq!(count(&pair, other, BY_READ), 0, "{o:?}");
        pair.check_clean();
    }
    // GPUs of their own (as two processes on two GPUs): each receiver reads, nobody writes.
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    device_both_ways(&pair, 9);
    for side in [0, 1] {
        let c = pair.w[side].counters();
        assert_eq!(count(&pair, side, SHARED_SEND), 0, "{c:?}");
        assert_eq!(count(&pair, side, SHARED_RECV), 0, "{c:?}");
        assert_eq!(count(&pair, side, BY_READ), SIZES.len() as u64 + 1, "{c:?}");
    }
    pair.check_clean();
}

#[test]
fn on_a_shared_gpu_a_refused_registration_falls_back_to_read_or_staging() {
    // Either side's GPU lane refusing device memory: no shared write on that side, every byte
    // still lands (read by the copier or staged), one warning per demotion.
    for refusing in [0, 1] {
        let f = with_fault(VARS, "md=sim_ipc,mem=cuda,after=0");
        let vars = if refusing == 0 {
            [&f[..], VARS]
        } else {
            [VARS, &f[..]]
        };
        let pair = Pair::new(FabricSpec::gpu().shared_gpus(true), vars);
        device_both_ways(&pair, 10 + refusing as u64);
        for side in [0, 1] {
            let c = pair.w[side].counters();
            assert_eq!(count(&pair, side, SHARED_SEND), 0, "{c:?}");
            assert_eq!(count(&pair, side, SHARED_RECV), 0, "{c:?}");
        }
        pair.check_clean();
    }
}
