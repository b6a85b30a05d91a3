//! The staged pipeline with small fragments over the sim fabric: with `RUCX_RNDV_FRAG_SIZE=4K`
//! a message is hundreds of fragments, staged in runs of consecutive fragments (one copy per
//! run) and announced and acknowledged one by one, over a deeper pipeline; every byte is
//! checked, with reordering and push-back, through mapped shared staging and through reads,
//! and with the copy domain failing part way.

mod harness;

use harness::{Buf, Mem, Pair, pattern};
use rucx_uct_sim::{Delivery, FabricSpec};

const FINE: &[(&str, &str)] = &[("RUCX_RNDV_FRAG_SIZE", "4K")];

/// Sizes: one fragment, one and a bit, a partial run, many runs with a ragged end.
const SIZES: &[usize] = &[4096, 4097, 100_000, (3 << 20) + 5];

fn exchange(pair: &Pair, mem: [Mem; 2], seed: u64) {
    for (i, &n) in SIZES.iter().enumerate() {
        let id = seed << 32 | i as u64;
        let send = Buf::filled(&pair.fabric, n, mem[0], id);
        let mut recv = Buf::new(&pair.fabric, n, mem[1]);
        let out = pair.transfer(0, &send, &mut recv, 60 + i as u64, false);
        let (s, r) = out.expect_ok();
        assert_eq!((s.len, r.len), (n, n), "{n} B {mem:?}");
        assert!(
            recv.bytes() == pattern(id, n),
            "{n} B {mem:?}: data differs"
        );
        assert_eq!(recv.guard_damage(), None, "{n} B {mem:?}");
    }
}

#[test]
fn four_kib_fragments_move_every_byte_in_any_order() {
    for shared in [true, false] {
        for delivery in [
            Delivery::InOrder,
            Delivery::Random {
                seed: 3,
                noresource_per_mille: 40,
            },
        ] {
            let spec = FabricSpec::gpu()
                .ipc(false)
                .shared_staging(shared)
                .delivery(delivery);
            let pair = Pair::new(spec, [FINE, FINE]);
            exchange(&pair, [Mem::Device(0), Mem::Device(1)], 1);
            exchange(&pair, [Mem::Device(0), Mem::Host], 2);
            let c = pair.w[1].counters();
            assert!(
                c.get("rendezvous receive pipelined through host staging")
                    .is_some_and(|&n| n >= 6),
                "{c:?}"
            );
            pair.assert_ran(0, "staging fragments copied in runs");
            if shared {
                assert!(
                    c.contains_key("staged fragment copied to the GPU from shared memory"),
                    "{c:?}"
                );
                assert!(
                    c.contains_key("staged fragments copied to the GPU in runs"),
                    "{c:?}"
                );
            }
            pair.check_clean();
        }
    }
}

#[test]
fn several_small_messages_share_the_fragments_in_flight() {
    // Three staged sends at once, each of many 4 KiB fragments: the runs of one never hold
    // the others up for good, and each lands intact.
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [FINE, FINE]);
    let n = (1 << 20) + 123;
    let sends: Vec<Buf> = (0..3)
        .map(|i| Buf::filled(&pair.fabric, n, Mem::Device(0), 70 + i))
        .collect();
    let mut recvs: Vec<Buf> = (0..3)
        .map(|_| Buf::new(&pair.fabric, n, Mem::Device(1)))
        .collect();
    pair.w[0].scope(|ss| {
        pair.w[1].scope(|sr| {
            let rs: Vec<_> = recvs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| sr.tag_recv(b.recv(), 80 + i as u64, rucx_ucp::TAG_MASK_FULL))
                .collect();
            let ss: Vec<_> = sends
                .iter()
                .enumerate()
                .map(|(i, b)| ss.tag_send(pair.ep[0], b.send(), 80 + i as u64))
                .collect();
            let mut done = vec![None; 6];
            pair.drive(|| {
                for (k, r) in rs.iter().chain(ss.iter()).enumerate() {
                    if done[k].is_none() {
                        done[k] = r.test().map(|x| x.map(|c| c.len));
                    }
                }
                done.iter().all(|d| d.is_some())
            })
            .expect("three staged transfers end");
            for d in &done {
                assert_eq!(d.as_ref().unwrap().as_ref().ok(), Some(&n), "{done:?}");
            }
        })
    });
    for (i, r) in recvs.iter().enumerate() {
        assert!(r.bytes() == pattern(70 + i as u64, n), "message {i}");
    }
    pair.check_clean();
}

#[test]
fn a_copy_domain_failing_part_way_ends_both_sides_with_small_fragments() {
    for faulty in [0, 1] {
        let bad: &[(&str, &str)] = &[
            ("RUCX_FAULT_INJECT", "md=sim_copy,after=3"),
            ("RUCX_RNDV_FRAG_SIZE", "4K"),
        ];
        let mut sides = [FINE, FINE];
        sides[faulty] = bad;
        let pair = Pair::new(FabricSpec::gpu().ipc(false), sides);
        for i in 0..4u64 {
            let n = (1 << 20) + 7;
            let send = Buf::filled(&pair.fabric, n, Mem::Device(0), 90 + i);
            let mut recv = Buf::new(&pair.fabric, n, Mem::Device(1));
            let out = pair.transfer(0, &send, &mut recv, 9, false);
            assert!(out.hang.is_none(), "transfer {i}: {}", out.hang.unwrap());
            match (&out.send, &out.recv) {
                (Some(Ok(_)), Some(Ok(_))) => assert!(recv.bytes() == pattern(90 + i, n)),
                (Some(Err(_)), Some(Err(_))) => {}
                other => panic!("transfer {i}: the two sides disagree: {other:?}"),
            }
            assert_eq!(recv.guard_damage(), None);
        }
        pair.check_clean();
        assert!(!pair.ctx[faulty].demotions().is_empty());
    }
}
