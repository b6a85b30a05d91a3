//! Put and get between every pair of local and remote memory (host, simulated GPU) over the sim
//! fabric: the path the plan picks (zero-copy through the GPU lane, staged through pinned host
//! memory), registration faults that demote a domain part-way (the request goes on by the next
//! path), and pairs with no path left (a clear error, no hang). Every byte is verified: the
//! written range, the untouched bytes around it, the guards around every buffer.

mod harness;

use harness::{Buf, Mem, Pair, Watchdog, pattern, with_fault};
use rucx_ucp::plan::Op;
use rucx_ucs::{Error, MemoryType, RegErrorKind};
use rucx_uct_sim::{Delivery, FabricSpec, HeldWhat, LaneKind};

/// 64 KiB fragments: a staged transfer of a few hundred KiB takes several waves of 4.
const VARS: &[(&str, &str)] = &[("RUCX_RNDV_FRAG_SIZE", "64K")];

const SIZES: &[usize] = &[0, 1, 4095, (64 << 10) + 3, 300_000, (1 << 20) + 17];

/// Bytes of the remote region before and after the accessed range (left untouched).
const PAD: usize = 100;

const ZCOPY_PUT: &str = "zero-copy put";
const ZCOPY_GET: &str = "zero-copy get";
const STAGED_PUT: &str = "put staged through pinned host memory";
const STAGED_GET: &str = "get staged through pinned host memory";

/// Put `len` bytes of `local` memory of side 0 into a region of `remote` memory mapped by side
/// 1, read them back with a get into a fresh `local` buffer, and check every byte (and that
/// nothing around the range moved). `Err`: the error of the put or the get.
fn put_get(pair: &Pair, local: Mem, remote: Mem, len: usize, id: u64) -> Result<(), Error> {
    let _dog = Watchdog::arm(60, format!("put/get {len} B {local:?} -> {remote:?}"));
    let mut target = Buf::filled(&pair.fabric, len + 2 * PAD, remote, id + 1_000_000);
    let src = Buf::filled(&pair.fabric, len, local, id);
    let mut back = Buf::new(&pair.fabric, len, local);
    let before = target.bytes().to_vec();
    {
        let map = pair.w[1].mem_map(target.recv())?;
        let want = match remote {
            Mem::Device(_) => MemoryType::Cuda,
            _ => MemoryType::Host,
        };
        assert_eq!(map.mem_type(), want);
        let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey())?;
        assert_eq!(rkey.mem_type(), want);
        let at = rkey.base() + PAD as u64;
        pair.w[0].scope(|s| -> Result<(), Error> {
            let r = s.put(pair.ep[0], src.send(), at, &rkey);
            pair.drive(|| r.test().is_some())
                .unwrap_or_else(|e| panic!("put hangs: {e}"));
            assert_eq!(r.wait()?.len, len);
            let r = s.get(pair.ep[0], back.recv(), at, &rkey);
            pair.drive(|| r.test().is_some())
                .unwrap_or_else(|e| panic!("get hangs: {e}"));
            assert_eq!(r.wait()?.len, len);
            Ok(())
        })?;
    }
    let t = target.bytes();
    assert!(
        t[PAD..PAD + len] == pattern(id, len)[..],
        "{len} B {local:?} -> {remote:?}: the remote range differs from what was put"
    );
    assert_eq!(&t[..PAD], &before[..PAD], "bytes before the range moved");
    assert_eq!(
        &t[PAD + len..],
        &before[PAD + len..],
        "bytes after the range moved"
    );
    assert!(
        back.bytes() == pattern(id, len),
        "{len} B {remote:?} -> {local:?}: the get read other bytes"
    );
    for b in [&target, &src, &back] {
        assert_eq!(b.guard_damage(), None, "{b:?}");
    }
    Ok(())
}

fn counter(pair: &Pair, name: &str) -> u64 {
    pair.w[0].counters().get(name).copied().unwrap_or(0)
}

/// Every pair of memory types, every size: the path each takes.
#[test]
fn every_pair_of_memory_types_at_every_size() {
    let cases = [
        (Mem::Host, Mem::Host, ZCOPY_PUT, ZCOPY_GET),
        (Mem::Host, Mem::Device(1), ZCOPY_PUT, ZCOPY_GET),
        (Mem::Device(0), Mem::Device(1), ZCOPY_PUT, ZCOPY_GET),
        (Mem::Device(0), Mem::Host, STAGED_PUT, STAGED_GET),
    ];
    let deliveries = [
        Delivery::InOrder,
        // Operations held and completed out of order, `NoResource` pushbacks on every lane.
        Delivery::Random {
            seed: 5,
            noresource_per_mille: 50,
        },
    ];
    for ((local, remote, put, get), delivery) in
        cases.into_iter().flat_map(|c| deliveries.map(|d| (c, d)))
    {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [VARS, VARS]);
        for (i, &len) in SIZES.iter().enumerate() {
            put_get(&pair, local, remote, len, i as u64 + 1)
                .unwrap_or_else(|e| panic!("{len} B {local:?} -> {remote:?}: {e}"));
        }
        // Zero-byte requests end at once, without a protocol.
        let n = SIZES.len() as u64 - 1;
        assert_eq!(
            counter(&pair, put),
            n,
            "{local:?} -> {remote:?}: {:?}",
            pair.w[0].counters()
        );
        assert_eq!(
            counter(&pair, get),
            n,
            "{local:?} -> {remote:?}: {:?}",
            pair.w[0].counters()
        );
        pair.check_clean();
    }
}

/// The planner's choice is what the query reports.
#[test]
fn path_query_shows_the_put_and_get_paths() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let paths = pair.w[0].path_query(pair.ep[0], Some(0)).unwrap();
    let find = |op: Op, s: MemoryType, r: MemoryType| {
        paths
            .iter()
            .find(|p| p.op == op && p.send_mem == s && p.recv_mem == r)
            .unwrap_or_else(|| panic!("no {op:?} {s} -> {r} in {paths:#?}"))
    };
    let (h, c) = (MemoryType::Host, MemoryType::Cuda);
    // A put moves local -> remote, a get remote -> local.
    for (op, s, r, zc, lane) in [
        (Op::Put, h, h, true, "sim_shm"),
        (Op::Put, c, c, true, "sim_ipc"),
        (Op::Put, h, c, true, "sim_ipc"),
        (Op::Put, c, h, false, "sim_shm"),
        (Op::Get, h, h, true, "sim_shm"),
        (Op::Get, c, c, true, "sim_ipc"),
        (Op::Get, c, h, true, "sim_ipc"),
        (Op::Get, h, c, false, "sim_shm"),
    ] {
        let p = find(op, s, r);
        assert_eq!(p.zero_copy, zc, "{p}");
        assert!(p.lane.starts_with(lane), "{p}");
        if !zc {
            assert!(p.protocol.contains("staged"), "{p}");
            assert!(p.why_not.iter().any(|w| w.contains("sim_shm")), "{p}");
        }
    }
    // The tag paths come first, as before.
    assert!(paths[..4].iter().all(|p| p.op == Op::Tag));
}

/// Side 0's GPU lane cannot register its device memory (`RUCX_FAULT_INJECT`, from the first
/// registration): device puts and gets go through staging from the first request on, one
/// warning; host memory still goes straight to the peer's GPU.
#[test]
fn injected_gpu_registration_fault_stages_instead() {
    let a = with_fault(VARS, "md=sim_ipc,mem=cuda,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [&a, VARS]);
    for (i, &len) in SIZES.iter().enumerate() {
        put_get(&pair, Mem::Device(0), Mem::Device(1), len, 40 + i as u64)
            .unwrap_or_else(|e| panic!("{len} B: {e}"));
        put_get(&pair, Mem::Host, Mem::Device(1), len, 80 + i as u64)
            .unwrap_or_else(|e| panic!("{len} B: {e}"));
    }
    assert!(counter(&pair, STAGED_PUT) >= SIZES.len() as u64 - 1);
    assert!(counter(&pair, STAGED_GET) >= SIZES.len() as u64 - 1);
    let d = pair.ctx[0].demotions();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(
        (d[0].md.as_str(), d[0].mem_type),
        ("sim_ipc", MemoryType::Cuda)
    );
    pair.check_clean();
    // The query tells why.
    let paths = pair.w[0].path_query(pair.ep[0], Some(0)).unwrap();
    let p = paths
        .iter()
        .find(|p| p.op == Op::Put && p.send_mem.is_gpu() && p.recv_mem.is_gpu())
        .unwrap();
    assert!(!p.zero_copy && p.protocol.contains("staged"), "{p}");
}

/// A registration that fails while a put is being posted (the plan still had the zero-copy
/// path): the domain is demoted, one warning, and that very put goes on through staging.
#[test]
fn a_registration_failing_at_post_time_continues_the_request_through_staging() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    put_get(&pair, Mem::Device(0), Mem::Device(1), 100_000, 1).unwrap();
    assert_eq!(counter(&pair, ZCOPY_PUT), 1);
    let next = pair.fabric.reg_attempts(pair.nodes[0], LaneKind::Ipc) + 1;
    pair.fabric
        .fail_registration(pair.nodes[0], LaneKind::Ipc, next, RegErrorKind::BadAddress);
    put_get(&pair, Mem::Device(0), Mem::Device(1), 300_000, 2).unwrap();
    assert_eq!(counter(&pair, STAGED_PUT), 1, "{:?}", pair.w[0].counters());
    assert_eq!(pair.ctx[0].demotions().len(), 1);
    pair.check_clean();
}

/// No path left: the peer cannot export GPU memory (mapping fails, naming why), or side 0
/// cannot stage (its copy lane refuses host memory): the request ends with `Unsupported`
/// naming the pair, at once.
#[test]
fn no_path_left_is_a_clear_error() {
    // No GPU lane: the peer's device memory cannot be mapped.
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [VARS, VARS]);
    let mut dev = Buf::new(&pair.fabric, 4096, Mem::Device(1));
    let e = pair.w[1].mem_map(dev.recv()).unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported { why, .. } if why.contains("exports GPU memory")),
        "{e}"
    );
    pair.check_clean();
    // Device memory to a host region needs staging; the copy domain refuses host memory.
    let a = with_fault(VARS, "md=sim_copy,mem=host,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [&a, VARS]);
    let e = put_get(&pair, Mem::Device(0), Mem::Host, 100_000, 3).unwrap_err();
    let Error::Unsupported { what, why } = &e else {
        panic!("{e}")
    };
    assert!(
        what.contains("put") && what.contains("cuda") && what.contains("host"),
        "{e}"
    );
    assert!(why.contains("sim_copy"), "{e}");
    // Host to host is unaffected.
    put_get(&pair, Mem::Host, Mem::Host, 100_000, 4).unwrap();
    pair.check_clean();
}

/// Out-of-bounds accesses are refused before anything moves, for GPU regions too.
#[test]
fn gpu_region_bounds_are_checked() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let mut dev = Buf::new(&pair.fabric, 8192, Mem::Device(1));
    let src = Buf::filled(&pair.fabric, 100, Mem::Device(0), 5);
    let map = pair.w[1].mem_map(dev.recv()).unwrap();
    let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
    pair.w[0].scope(|s| {
        let e = s
            .put(pair.ep[0], src.send(), rkey.base() + 8192 - 99, &rkey)
            .wait()
            .unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    });
    assert!(map.try_as_slice().is_err());
    drop(map);
    pair.check_clean();
}

/// A bundle is checked whole: a bad memory type code, or bytes cut anywhere, is an error, and
/// a bundle of another process's region still carries its memory type and GPU.
#[test]
fn bundles_carry_the_memory_type_and_bad_ones_are_errors() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let mut dev = Buf::new(&pair.fabric, 4096, Mem::Device(1));
    let map = pair.w[1].mem_map(dev.recv()).unwrap();
    assert_eq!(map.domains(), vec!["sim_ipc"]);
    let packed = map.pack_rkey();
    let k = pair.w[0].rkey_unpack(pair.ep[0], &packed).unwrap();
    assert_eq!(
        (k.mem_type(), k.device(), k.len()),
        (MemoryType::Cuda, Some(1), 4096)
    );
    for cut in 0..packed.len() {
        assert!(
            pair.w[0].rkey_unpack(pair.ep[0], &packed[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    // Base, length, then a memory type code no memory type has.
    let mut payload = Vec::new();
    payload.extend_from_slice(&0x1000u64.to_le_bytes());
    payload.extend_from_slice(&64u64.to_le_bytes());
    payload.push(77);
    payload.extend_from_slice(&u32::MAX.to_le_bytes());
    payload.push(0);
    let bad = rucx_uct::rkey::pack("ucp-rkey", &payload);
    let e = pair.w[0].rkey_unpack(pair.ep[0], &bad).unwrap_err();
    assert!(e.to_string().contains("memory type code 77"), "{e}");
    drop(map);
    pair.check_clean();
}

const WINDOW_MADE: &str = "staged put/get window made";
const WINDOW_WAIT: &str = "request waited for a pinned window";

/// Remote-lane operations of side 0 in flight (their completions held by the fabric).
fn remote_ops_held(pair: &Pair) -> Vec<u64> {
    pair.fabric
        .held()
        .into_iter()
        .filter(|h| {
            h.to == pair.nodes[0]
                && h.lane == LaneKind::Shm
                && matches!(h.what, HeldWhat::Completion { .. })
        })
        .map(|h| h.seq)
        .collect()
}

/// A staged put is a pipeline, not a sequence of waves: once one fragment's remote write
/// completes, its slot takes the next fragment (copied out of the GPU and written) while the
/// other fragments' writes are still in flight.
#[test]
fn staged_fragments_overlap_instead_of_waiting_for_a_whole_wave() {
    let pair = Pair::new(FabricSpec::gpu().delivery(Delivery::Manual), [VARS, VARS]);
    let len = (1 << 20) + 17;
    let mut target = Buf::filled(&pair.fabric, len, Mem::Host, 1);
    let src = Buf::filled(&pair.fabric, len, Mem::Device(0), 2);
    {
        let map = pair.w[1].mem_map(target.recv()).unwrap();
        let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
        pair.w[0].scope(|s| {
            let r = s.put(pair.ep[0], src.send(), rkey.base(), &rkey);
            for _ in 0..20 {
                pair.step();
            }
            // Four slots, each with its fragment's write in flight.
            let held = remote_ops_held(&pair);
            assert_eq!(held.len(), 4, "{:?}", pair.fabric.held());
            pair.fabric.release(held[0]).unwrap();
            for _ in 0..20 {
                pair.step();
            }
            // The freed slot carries the fifth fragment; the other three are still held.
            let now = remote_ops_held(&pair);
            assert_eq!(now.len(), 4, "{:?}", pair.fabric.held());
            assert!(held[1..].iter().all(|s| now.contains(s)), "{now:?}");
            pair.drive(|| r.test().is_some())
                .unwrap_or_else(|e| panic!("put hangs: {e}"));
            assert_eq!(r.wait().unwrap().len, len);
        });
    }
    assert!(
        target.bytes() == pattern(2, len),
        "the remote range differs"
    );
    assert_eq!(target.guard_damage(), None);
    assert_eq!(counter(&pair, STAGED_PUT), 1);
    pair.check_clean();
}

/// Staged requests reuse the worker's pinned windows: one window for any number of requests one
/// after another, one per request in flight at once, and none made again afterwards.
#[test]
fn staged_requests_reuse_the_workers_windows() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    for (i, &len) in SIZES.iter().enumerate() {
        put_get(&pair, Mem::Device(0), Mem::Host, len, 200 + i as u64).unwrap();
    }
    assert_eq!(counter(&pair, WINDOW_MADE), 1, "{:?}", pair.w[0].counters());
    // Three puts at once, into three parts of one region.
    let len = 300_000;
    let mut target = Buf::filled(&pair.fabric, 3 * len, Mem::Host, 9);
    let srcs: Vec<Buf> = (0..3)
        .map(|k| Buf::filled(&pair.fabric, len, Mem::Device(0), 300 + k))
        .collect();
    for round in 0..2 {
        let map = pair.w[1].mem_map(target.recv()).unwrap();
        let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
        pair.w[0].scope(|s| {
            let reqs: Vec<_> = srcs
                .iter()
                .enumerate()
                .map(|(k, b)| s.put(pair.ep[0], b.send(), rkey.base() + (k * len) as u64, &rkey))
                .collect();
            pair.drive(|| reqs.iter().all(|r| r.test().is_some()))
                .unwrap_or_else(|e| panic!("puts hang: {e}"));
            for r in reqs {
                assert_eq!(r.wait().unwrap().len, len);
            }
        });
        drop(map);
        for k in 0..3 {
            assert!(
                target.bytes()[k * len..(k + 1) * len] == pattern(300 + k as u64, len)[..],
                "round {round}, part {k} differs"
            );
        }
        assert_eq!(target.guard_damage(), None);
        assert_eq!(
            counter(&pair, WINDOW_MADE),
            3,
            "round {round}: {:?}",
            pair.w[0].counters()
        );
    }
    pair.check_clean();
}

/// A copy that fails part way through a staged put or get ends that request with the error
/// (no hang); the worker's next staged requests move every byte.
#[test]
fn a_copy_failing_part_way_ends_the_staged_request_and_the_next_ones_work() {
    for put in [true, false] {
        let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
        let len = (1 << 20) + 17;
        let mut target = Buf::filled(&pair.fabric, len, Mem::Host, 7);
        let mut local = Buf::filled(&pair.fabric, len, Mem::Device(0), 8);
        {
            let map = pair.w[1].mem_map(target.recv()).unwrap();
            let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
            pair.fabric
                .fail_ops_after(pair.nodes[0], LaneKind::Copy, 5, 1);
            pair.w[0].scope(|s| {
                let r = if put {
                    s.put(pair.ep[0], local.send(), rkey.base(), &rkey)
                } else {
                    s.get(pair.ep[0], local.recv(), rkey.base(), &rkey)
                };
                pair.drive(|| r.test().is_some())
                    .unwrap_or_else(|e| panic!("staged request hangs: {e}"));
                let e = r.wait().unwrap_err();
                assert!(matches!(e, Error::Io { .. }), "put {put}: {e}");
            });
        }
        for (i, &len) in SIZES.iter().enumerate() {
            put_get(&pair, Mem::Device(0), Mem::Host, len, 400 + i as u64)
                .unwrap_or_else(|e| panic!("put {put}, {len} B after the failure: {e}"));
        }
        pair.check_clean();
    }
}

/// More staged requests at once than the worker has windows (at most 4): the others wait for a
/// window to come back, and every one completes with every byte (also with completions
/// reordered and push-back), without more windows made.
#[test]
fn staged_requests_beyond_the_windows_wait_for_one() {
    for delivery in [
        Delivery::InOrder,
        Delivery::Random {
            seed: 9,
            noresource_per_mille: 40,
        },
    ] {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [VARS, VARS]);
        let (len, n) = (300_000, 7);
        let mut target = Buf::filled(&pair.fabric, n * len, Mem::Host, 9);
        let srcs: Vec<Buf> = (0..n)
            .map(|k| Buf::filled(&pair.fabric, len, Mem::Device(0), 500 + k as u64))
            .collect();
        let mut backs: Vec<Buf> = (0..n)
            .map(|_| Buf::new(&pair.fabric, len, Mem::Device(0)))
            .collect();
        {
            let map = pair.w[1].mem_map(target.recv()).unwrap();
            let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
            pair.w[0].scope(|s| {
                let at = |k: usize| rkey.base() + (k * len) as u64;
                let puts: Vec<_> = srcs
                    .iter()
                    .enumerate()
                    .map(|(k, b)| s.put(pair.ep[0], b.send(), at(k), &rkey))
                    .collect();
                pair.drive(|| puts.iter().all(|r| r.test().is_some()))
                    .unwrap_or_else(|e| panic!("puts hang: {e}"));
                for r in puts {
                    assert_eq!(r.wait().unwrap().len, len);
                }
                let gets: Vec<_> = backs
                    .iter_mut()
                    .enumerate()
                    .map(|(k, b)| s.get(pair.ep[0], b.recv(), at(k), &rkey))
                    .collect();
                pair.drive(|| gets.iter().all(|r| r.test().is_some()))
                    .unwrap_or_else(|e| panic!("gets hang: {e}"));
                for r in gets {
                    assert_eq!(r.wait().unwrap().len, len);
                }
            });
        }
        for (k, back) in backs.iter().enumerate() {
            let want = pattern(500 + k as u64, len);
            assert!(
                target.bytes()[k * len..(k + 1) * len] == want[..],
                "part {k} differs"
            );
            assert!(back.bytes() == want, "get {k} differs");
            assert_eq!(back.guard_damage(), None);
        }
        assert_eq!(target.guard_damage(), None);
        assert_eq!(counter(&pair, WINDOW_MADE), 4, "{:?}", pair.w[0].counters());
        assert!(
            counter(&pair, WINDOW_WAIT) >= 6,
            "3 puts and 3 gets waited: {:?}",
            pair.w[0].counters()
        );
        pair.check_clean();
    }
}

/// Staged requests that fail while others wait for a window (after the first 16 copies of the
/// copy lane, 4 fail: 4 requests end with the error, with operations still in flight): their windows go back to the worker although
/// their caller still holds the failed requests (else the waiting ones would wait forever),
/// and every other request completes with every byte; no window beyond the 4 is made, and the
/// requests after work.
#[test]
fn a_staged_request_failing_while_others_wait_hands_its_window_on() {
    for (put, delivery) in [
        (true, Delivery::InOrder),
        (
            false,
            Delivery::Random {
                seed: 3,
                noresource_per_mille: 40,
            },
        ),
    ] {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [VARS, VARS]);
        let (len, n) = (300_000, 7);
        let mut target = Buf::filled(&pair.fabric, n * len, Mem::Host, 11);
        let mut bufs: Vec<Buf> = (0..n)
            .map(|k| Buf::filled(&pair.fabric, len, Mem::Device(0), 700 + k as u64))
            .collect();
        if !put {
            // The region holds what each get must read.
            let mut all = Vec::with_capacity(n * len);
            for k in 0..n {
                all.extend_from_slice(&pattern(700 + k as u64, len));
            }
            target.bytes_mut().copy_from_slice(&all);
            for b in &mut bufs {
                b.bytes_mut().fill(0);
            }
        }
        let results: Vec<Result<usize, Error>> = {
            let map = pair.w[1].mem_map(target.recv()).unwrap();
            let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
            // 4 requests take windows (5 fragments each: 4 in flight at once), 3 wait; after
            // 16 copies (a put's first wave, posted with the requests), 4 fail.
            pair.fabric
                .fail_ops_after(pair.nodes[0], LaneKind::Copy, 16, 4);
            pair.w[0].scope(|s| {
                let at = |k: usize| rkey.base() + (k * len) as u64;
                let reqs: Vec<_> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(k, b)| {
                        if put {
                            s.put(pair.ep[0], b.send(), at(k), &rkey)
                        } else {
                            s.get(pair.ep[0], b.recv(), at(k), &rkey)
                        }
                    })
                    .collect();
                // Every request ends while the failed one is still held.
                pair.drive(|| reqs.iter().all(|r| r.test().is_some()))
                    .unwrap_or_else(|e| panic!("put {put}: requests hang: {e}"));
                reqs.into_iter().map(|r| r.wait().map(|c| c.len)).collect()
            })
        };
        let failed: Vec<usize> = (0..n).filter(|&k| results[k].is_err()).collect();
        assert_eq!(failed.len(), 4, "put {put}: {results:?}");
        for &k in &failed {
            assert!(
                matches!(results[k], Err(Error::Io { .. })),
                "put {put}: {results:?}"
            );
        }
        for k in (0..n).filter(|k| !failed.contains(k)) {
            assert_eq!(results[k], Ok(len));
            let want = pattern(700 + k as u64, len);
            let got = if put {
                &target.bytes()[k * len..(k + 1) * len]
            } else {
                bufs[k].bytes()
            };
            assert!(got == want, "put {put}: request {k} moved other bytes");
        }
        for b in bufs.iter().chain([&target]) {
            assert_eq!(b.guard_damage(), None, "{b:?}");
        }
        let c = pair.w[0].counters();
        assert_eq!(counter(&pair, WINDOW_MADE), 4, "put {put}: {c:?}");
        // (Some operations of the random delivery finish at once: a request may end, and
        // hand its window on, before the last ones are posted.)
        assert!(
            counter(&pair, WINDOW_WAIT) >= 1,
            "put {put}: requests beyond 4 waited: {c:?}"
        );
        for (i, &len) in SIZES.iter().enumerate() {
            put_get(&pair, Mem::Device(0), Mem::Host, len, 800 + i as u64)
                .unwrap_or_else(|e| panic!("put {put}, {len} B after the failure: {e}"));
        }
        assert_eq!(counter(&pair, WINDOW_MADE), 4, "put {put}: {c:?}");
        pair.check_clean();
    }
}

/// A staged put or get whose remote region is the peer's shared memory (`Context::mem_alloc`
/// on this host) needs no window: the copy lane copies straight between the GPU buffer and the
/// peer's region mapped here, one copy per request; every byte arrives, nothing around the range
/// moves, and a region of the heap still goes through a window.
#[test]
fn staged_requests_into_a_peers_shared_memory_copy_through_its_mapping() {
    const MAPPED: &str = "staged put/get copied straight to or from the peer's mapped memory";
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    for (i, &len) in SIZES.iter().enumerate().filter(|(_, l)| **l > 0) {
        let id = 900 + i as u64;
        let mut region = pair.ctx[1].mem_alloc(len + 2 * PAD).unwrap();
        assert!(region.shared_by().is_some(), "the sim shares host memory");
        region.copy_from_slice(&pattern(id + 1_000_000, len + 2 * PAD));
        let before = region.to_vec();
        let src = Buf::filled(&pair.fabric, len, Mem::Device(0), id);
        let mut back = Buf::new(&pair.fabric, len, Mem::Device(0));
        {
            let map = pair.w[1].mem_map(&mut region[..]).unwrap();
            let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
            let at = rkey.base() + PAD as u64;
            pair.w[0].scope(|s| {
                let r = s.put(pair.ep[0], src.send(), at, &rkey);
                pair.drive(|| r.test().is_some())
                    .unwrap_or_else(|e| panic!("put hangs: {e}"));
                assert_eq!(r.wait().unwrap().len, len);
                let r = s.get(pair.ep[0], back.recv(), at, &rkey);
                pair.drive(|| r.test().is_some())
                    .unwrap_or_else(|e| panic!("get hangs: {e}"));
                assert_eq!(r.wait().unwrap().len, len);
            });
        }
        assert!(
            region[PAD..PAD + len] == pattern(id, len)[..],
            "{len} B put"
        );
        assert_eq!(
            &region[..PAD],
            &before[..PAD],
            "{len} B: bytes before moved"
        );
        assert_eq!(
            &region[PAD + len..],
            &before[PAD + len..],
            "{len} B: bytes after"
        );
        assert!(back.bytes() == pattern(id, len), "{len} B get");
        for b in [&src, &back] {
            assert_eq!(b.guard_damage(), None, "{b:?}");
        }
    }
    let n = SIZES.iter().filter(|l| **l > 0).count() as u64;
    assert_eq!(counter(&pair, MAPPED), 2 * n, "{:?}", pair.w[0].counters());
    assert_eq!(counter(&pair, STAGED_PUT), n);
    assert_eq!(counter(&pair, WINDOW_MADE), 0, "{:?}", pair.w[0].counters());
    // A region of the heap cannot be mapped: it is staged through a window.
    put_get(&pair, Mem::Device(0), Mem::Host, 300_000, 999).unwrap();
    assert_eq!(counter(&pair, MAPPED), 2 * n);
    assert_eq!(counter(&pair, WINDOW_MADE), 1);
    pair.check_clean();
}

/// A flush ends after the staged puts posted before it, also those still waiting for a window
/// (their operations not posted yet, so flushing the lanes does not cover them): when the
/// flush completes, every put did and every byte is in place.
#[test]
fn a_flush_waits_for_the_staged_puts_before_it() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let (len, n) = (300_000, 7);
    let mut target = Buf::filled(&pair.fabric, n * len, Mem::Host, 13);
    let srcs: Vec<Buf> = (0..n)
        .map(|k| Buf::filled(&pair.fabric, len, Mem::Device(0), 1_100 + k as u64))
        .collect();
    {
        let map = pair.w[1].mem_map(target.recv()).unwrap();
        let rkey = pair.w[0].rkey_unpack(pair.ep[0], &map.pack_rkey()).unwrap();
        pair.w[0].scope(|s| {
            let puts: Vec<_> = srcs
                .iter()
                .enumerate()
                .map(|(k, b)| s.put(pair.ep[0], b.send(), rkey.base() + (k * len) as u64, &rkey))
                .collect();
            let flush = s.flush(pair.ep[0]);
            pair.drive(|| flush.test().is_some())
                .unwrap_or_else(|e| panic!("flush hangs: {e}"));
            let ended: Vec<bool> = puts.iter().map(|r| r.test().is_some()).collect();
            assert!(ended.iter().all(|&e| e), "the flush ended first: {ended:?}");
            flush.wait().unwrap();
            for r in puts {
                assert_eq!(r.wait().unwrap().len, len);
            }
        });
    }
    for k in 0..n {
        assert!(
            target.bytes()[k * len..(k + 1) * len] == pattern(1_100 + k as u64, len)[..],
            "part {k} differs"
        );
    }
    assert!(
        counter(&pair, WINDOW_WAIT) >= 3,
        "{:?}",
        pair.w[0].counters()
    );
    pair.check_clean();
}
