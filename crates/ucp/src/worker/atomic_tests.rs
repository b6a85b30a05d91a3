//! Atomics between workers of separate contexts (as separate processes have): every
//! operation and width with its result checked, concurrent adds of two peers, the flush and
//! fence covering them, and what is refused (out of the region, misaligned, unmapped, GPU).

use std::time::{Duration, Instant};

use crate::worker::atomic::AtomicOp;
use crate::{EpId, Request, Worker};

fn worker(tls: &str) -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(crate::CONFIG);
    let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", tls)]).unwrap();
    let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
    Worker::new(&ctx).unwrap()
}

/// `a` connected to `b` (and back): a's endpoint to b.
fn connect(a: &Worker, b: &Worker) -> EpId {
    let ab = a.connect(&b.address()).unwrap();
    b.connect(&a.address()).unwrap();
    ab
}

/// `n` bytes of `v` starting at an 8-byte-aligned address (`v` holds `n + 8`).
fn aligned(v: &mut [u8], n: usize) -> &mut [u8] {
    let off = (8 - v.as_ptr() as usize % 8) % 8;
    &mut v[off..off + n]
}

fn finish(ws: &[&Worker], r: Request<'_>) -> rucx_ucs::Result<()> {
    let t = Instant::now();
    while r.test().is_none() {
        assert!(t.elapsed() < Duration::from_secs(30), "request hangs");
        for w in ws {
            w.progress();
        }
    }
    r.wait().map(|_| ())
}

/// A fetching atomic (`op`; compare-and-swap with `compare`) on the word at `at`: the old
/// value it fetched.
#[allow(clippy::too_many_arguments)]
fn fetch<T: crate::AtomicWord + Default>(
    a: &Worker,
    b: &Worker,
    ab: EpId,
    key: &crate::RkeyBundle,
    op: AtomicOp,
    value: T,
    compare: T,
    at: u64,
) -> T {
    let mut got = T::default();
    a.scope(|s| {
        let r = if op == AtomicOp::Cswap {
            s.atomic_cswap(ab, compare, value, &mut got, at, key)
        } else {
            s.atomic_fetch(ab, op, value, &mut got, at, key)
        };
        finish(&[a, b], r).unwrap();
    });
    got
}

/// Every operation, fetching and posted, at both widths, on words of a mapped region: the
/// fetched value is the old one and the word holds what the CPU would make of it.
#[test]
fn every_op_and_width_fetches_the_old_value_and_applies() {
    for tls in ["posix", "tcp"] {
        let (a, b) = (worker(tls), worker(tls));
        let ab = connect(&a, &b);
        let mut region = vec![0u8; 40];
        let map = b.mem_map(aligned(&mut region, 32)).unwrap();
        let key = a.rkey_unpack(ab, &map.pack_rkey()).unwrap();
        let base = map.address();
        let cases: [(u64, u64, u64); 3] = [
            (
                0x1234_5678_9abc_def0,
                0x0f0f_0f0f_f0f0_f0f0,
                0x1234_5678_9abc_def0,
            ),
            (u64::MAX, 1, 3),
            (7, 0x8000_0000_0000_0001, 0x9abc_def0),
        ];
        for op in AtomicOp::ALL {
            for (old, value, compare) in cases {
                // 64-bit, fetching, at word 1.
                let at = base + 8;
                fetch(&a, &b, ab, &key, AtomicOp::Swap, old, 0, at);
                assert_eq!(
                    fetch(&a, &b, ab, &key, op, value, compare, at),
                    old,
                    "{tls} {op:?}"
                );
                let want = op.apply_to(old, value, compare, 8);
                assert_eq!(map.as_slice()[8..16], want.to_ne_bytes(), "{tls} {op:?} 64");
                // 32-bit, fetching, at the second half of word 2.
                let at32 = base + 20;
                let (o32, v32, c32) = (old as u32, value as u32, compare as u32);
                fetch(&a, &b, ab, &key, AtomicOp::Swap, o32, 0, at32);
                assert_eq!(
                    fetch(&a, &b, ab, &key, op, v32, c32, at32),
                    o32,
                    "{tls} {op:?} 32"
                );
                let want32 = op.apply_to(o32 as u64, v32 as u64, c32 as u64, 4) as u32;
                assert_eq!(
                    map.as_slice()[20..24],
                    want32.to_ne_bytes(),
                    "{tls} {op:?} 32"
                );
                // Posted forms (compare-and-swap has none), both widths.
                if op != AtomicOp::Cswap {
                    fetch(&a, &b, ab, &key, AtomicOp::Swap, old, 0, base);
                    fetch(&a, &b, ab, &key, AtomicOp::Swap, o32, 0, base + 28);
                    a.scope(|s| {
                        finish(&[&a, &b], s.atomic_post(ab, op, value, base, &key)).unwrap();
                        finish(&[&a, &b], s.atomic_post(ab, op, v32, base + 28, &key)).unwrap();
                    });
                    let p64 = op.apply_to(old, value, 0, 8);
                    assert_eq!(map.as_slice()[0..8], p64.to_ne_bytes(), "{tls} {op:?} post");
                    let p32 = op.apply_to(o32 as u64, v32 as u64, 0, 4) as u32;
                    assert_eq!(
                        map.as_slice()[28..32],
                        p32.to_ne_bytes(),
                        "{tls} {op:?} post 32"
                    );
                }
                // The neighbours of the 32-bit words are untouched.
                assert_eq!(map.as_slice()[16..20], [0; 4], "{tls} {op:?}");
                assert_eq!(map.as_slice()[24..28], [0; 4], "{tls} {op:?}");
            }
        }
        drop(map);
    }
}

/// Two peers add to one word concurrently, fetching: nothing is lost (the sum is whole) and
/// every fetched value is distinct (each add saw the word after the ones before it).
#[test]
fn concurrent_adds_of_two_peers_lose_nothing() {
    let (t, x, y) = (worker("posix"), worker("posix"), worker("posix"));
    let xt = connect(&x, &t);
    let yt = connect(&y, &t);
    let mut region = vec![0u8; 16];
    let map = t.mem_map(aligned(&mut region, 8)).unwrap();
    let packed = map.pack_rkey();
    let (kx, ky) = (
        x.rkey_unpack(xt, &packed).unwrap(),
        y.rkey_unpack(yt, &packed).unwrap(),
    );
    const N: usize = 200;
    let mut fx = vec![0u64; N];
    let mut fy = vec![0u64; N];
    let addr = map.address();
    x.scope(|sx| {
        y.scope(|sy| {
            let mut rx = Vec::new();
            let mut ry = Vec::new();
            for (a, b) in fx.iter_mut().zip(fy.iter_mut()) {
                rx.push(sx.atomic_fetch(xt, AtomicOp::Add, 1u64, a, addr, &kx));
                ry.push(sy.atomic_fetch(yt, AtomicOp::Add, 1u64, b, addr, &ky));
            }
            let start = Instant::now();
            while rx.iter().chain(ry.iter()).any(|r| r.test().is_none()) {
                assert!(start.elapsed() < Duration::from_secs(60), "adds hang");
                x.progress();
                y.progress();
                t.progress();
            }
            for r in rx.into_iter().chain(ry) {
                r.wait().unwrap();
            }
        })
    });
    assert_eq!(map.as_slice(), (2 * N as u64).to_ne_bytes());
    let mut all: Vec<u64> = fx.into_iter().chain(fy).collect();
    all.sort_unstable();
    assert_eq!(all, (0..2 * N as u64).collect::<Vec<_>>());
}

/// A flush of the endpoint ends after the atomics posted before it were applied (their
/// requests ended); the fence returns once they did.
#[test]
fn flush_and_fence_cover_posted_atomics() {
    let (a, b) = (worker("posix"), worker("posix"));
    let ab = connect(&a, &b);
    let mut region = vec![0u8; 16];
    let map = b.mem_map(aligned(&mut region, 8)).unwrap();
    let key = a.rkey_unpack(ab, &map.pack_rkey()).unwrap();
    let addr = map.address();
    a.scope(|s| {
        let posts: Vec<_> = (0..50)
            .map(|_| s.atomic_post(ab, AtomicOp::Add, 3u32, addr, &key))
            .collect();
        let f = s.flush(ab);
        finish(&[&a, &b], f).unwrap();
        assert!(
            posts.iter().all(|r| r.test().is_some()),
            "flush ended first"
        );
        for r in posts {
            r.wait().unwrap();
        }
    });
    assert_eq!(map.as_slice()[..4], 150u32.to_ne_bytes());
}

/// What is refused, and lands nowhere: words out of the key's region, misaligned ones, a
/// compare-and-swap without a result, a region unmapped since its key was packed (refused by
/// the target).
#[test]
fn bad_words_are_refused_and_write_nothing() {
    let (a, b) = (worker("posix"), worker("posix"));
    let ab = connect(&a, &b);
    let mut region = vec![0u8; 24];
    let map = b.mem_map(aligned(&mut region, 16)).unwrap();
    let key = a.rkey_unpack(ab, &map.pack_rkey()).unwrap();
    let base = map.address();
    let mut r64 = 0u64;
    a.scope(|s| {
        for (at, what) in [(base + 16, "past the end"), (base + 12, "straddling")] {
            let e =
                finish(&[&a, &b], s.atomic_post(ab, AtomicOp::Add, 1u64, at, &key)).unwrap_err();
            assert!(
                matches!(e, rucx_ucs::Error::OutOfBounds { .. }),
                "{what}: {e:?}"
            );
        }
        let e = finish(
            &[&a, &b],
            s.atomic_fetch(ab, AtomicOp::Add, 1u64, &mut r64, base - 8, &key),
        )
        .unwrap_err();
        assert!(matches!(e, rucx_ucs::Error::OutOfBounds { .. }), "{e:?}");
        let e = finish(
            &[&a, &b],
            s.atomic_post(ab, AtomicOp::Add, 1u64, base + 4, &key),
        )
        .unwrap_err();
        assert!(matches!(e, rucx_ucs::Error::InvalidParam(_)), "{e:?}");
        let e = finish(
            &[&a, &b],
            s.atomic_post(ab, AtomicOp::Add, 1u32, base + 2, &key),
        )
        .unwrap_err();
        assert!(matches!(e, rucx_ucs::Error::InvalidParam(_)), "{e:?}");
        let e = finish(
            &[&a, &b],
            s.atomic_post(ab, AtomicOp::Cswap, 1u64, base, &key),
        )
        .unwrap_err();
        assert!(matches!(e, rucx_ucs::Error::InvalidParam(_)), "{e:?}");
    });
    assert_eq!(map.as_slice(), [0u8; 16]);
    drop(map);
    // Unmapped: the key still unpacks on the initiator, the target refuses the word.
    let mut got = 5u64;
    a.scope(|s| {
        let e = finish(
            &[&a, &b],
            s.atomic_fetch(ab, AtomicOp::Add, 1u64, &mut got, base, &key),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("not inside a region it mapped"),
            "{e}"
        );
        assert!(matches!(e, rucx_ucs::Error::InvalidParam(_)), "{e:?}");
    });
    assert_eq!(got, 5, "a refused fetch writes no result");
    assert_eq!(region, [0u8; 24]);
    assert!(b.counters().get("atomic refused").copied().unwrap_or(0) >= 1);
}

/// Progress `ws` until the queued end of `token` comes out of `a`: that end.
fn queued_end(a: &Worker, ws: &[&Worker], token: u64) -> rucx_ucs::Result<crate::Completion> {
    let t = Instant::now();
    let mut ends = Vec::new();
    loop {
        assert!(t.elapsed() < Duration::from_secs(30), "no end queued");
        a.progress();
        for w in ws {
            w.progress();
        }
        a.take_completed(&mut ends);
        if let Some(i) = ends.iter().position(|(t, _)| *t == token) {
            return ends.swap_remove(i).1;
        }
    }
}

/// An atomic the target refuses after it was posted (its region unmapped since the key was
/// packed), posted in the queued form whose end nobody may look at (the C ABI's implicit
/// operations): the next flush of its endpoint ends with its error, and only that one (it is
/// reported once); the worker-wide flush reports it too.
#[test]
fn a_flush_reports_an_atomic_refused_after_its_post_once() {
    let (a, b) = (worker("posix"), worker("posix"));
    let ab = connect(&a, &b);
    let mut region = vec![0u8; 16];
    let map = b.mem_map(aligned(&mut region, 8)).unwrap();
    let key = a.rkey_unpack(ab, &map.pack_rkey()).unwrap();
    let base = map.address();
    drop(map);
    let post = |token| {
        let q = a.atomic_queued(ab, AtomicOp::Add, 8, 1, 0, None, base, &key, token);
        assert!(matches!(q, crate::Queued::Pending(_)), "posted");
    };
    post(1);
    a.scope(|s| {
        let e = finish(&[&a, &b], s.flush(ab)).unwrap_err();
        assert!(
            e.to_string().contains("not inside a region it mapped"),
            "{e}"
        );
        assert!(matches!(e, rucx_ucs::Error::InvalidParam(_)), "{e:?}");
        finish(&[&a, &b], s.flush(ab)).expect("reported once");
    });
    assert!(queued_end(&a, &[&b], 1).is_err(), "its own end says so too");
    // The worker's flush (every endpoint), once the refusal is in.
    post(2);
    assert!(queued_end(&a, &[&b], 2).is_err());
    let e = a.flush_wait(None).unwrap_err();
    assert!(matches!(e, rucx_ucs::Error::InvalidParam(_)), "{e:?}");
    a.flush_wait(None).expect("reported once");
    a.flush_wait(Some(ab)).expect("reported once");
    assert_eq!(region, [0u8; 16]);
}

/// An atomic posted to a peer that fails before answering it (its worker dropped, over tcp:
/// its connections close): a worker-wide flush, which skips the failed endpoint, still ends
/// with the error, once; a flush of that endpoint ends with the endpoint's error.
#[test]
fn a_worker_flush_reports_what_a_failed_peer_lost() {
    let (a, b) = (worker("tcp"), worker("tcp"));
    let ab = connect(&a, &b);
    let mut region = vec![0u8; 16];
    let map = b.mem_map(aligned(&mut region, 8)).unwrap();
    let key = a.rkey_unpack(ab, &map.pack_rkey()).unwrap();
    let addr = map.address();
    // Wired up and working: one atomic applied.
    assert_eq!(
        fetch(&a, &b, ab, &key, AtomicOp::Add, 2u64, 0, addr),
        0,
        "the old value"
    );
    // Posted; the target never progresses again, and goes.
    let q = a.atomic_queued(ab, AtomicOp::Add, 8, 1, 0, None, addr, &key, 7);
    assert!(matches!(q, crate::Queued::Pending(_)), "posted");
    drop(map);
    drop(b);
    assert!(
        queued_end(&a, &[], 7).is_err(),
        "the atomic failed with its peer"
    );
    assert!(
        a.flush_wait(None).is_err(),
        "the worker's flush sees the loss"
    );
    a.flush_wait(None)
        .expect("reported once; the failed endpoint is not flushed");
    assert!(a.flush_wait(Some(ab)).is_err(), "the failed endpoint");
    let off = (8 - region.as_ptr() as usize % 8) % 8;
    assert_eq!(
        &region[off..off + 8],
        &2u64.to_ne_bytes()[..],
        "only the first add landed"
    );
}
