//! Atomics between real processes (over posix and over tcp): rank 0 maps a region and hands
//! its key to every other rank; they fetch-add on a 64-bit and a 32-bit word at once, post
//! xors, and elect one of them by compare-and-swap. Rank 0 checks that nothing was lost (the
//! counters whole, every fetched value distinct), that the word between the counters was never
//! touched, and that exactly one rank won.
//!
//! Each test spawns its ranks as children of this test binary (told apart by `RANK_ROLE`),
//! which meet through the launcher bootstrap like any rucx job.

use std::process::{Command, Stdio};
use std::time::Duration;

use rucx::{AtomicOp, Job, TAG_MASK_FULL};

const ROLE: &str = "RUCX_TEST_RANK_ROLE";
/// Fetch-adds per rank and word.
const ADDS: usize = 100;

fn spawn(test: &str, size: usize, tls: &str) {
    let exe = std::env::current_exe().unwrap();
    let boot = format!("127.0.0.1:{}", rucx::bootstrap::local_port().unwrap());
    let kids: Vec<_> = (0..size)
        .map(|rank| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, "1")
                .env("RUCX_RANK", rank.to_string())
                .env("RUCX_SIZE", size.to_string())
                .env("RUCX_BOOTSTRAP", &boot)
                .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
                .env("RUCX_TLS", tls)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "rank {rank} over {tls} failed:\n{text}"
        );
        assert!(
            text.contains("atomics OK"),
            "rank {rank} over {tls}:\n{text}"
        );
    }
}

fn rank_main() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let limit = Duration::from_secs(60);
    if job.rank() == 0 {
        // u64 counter, u32 counter, u32 untouched, u64 xor word, u64 owner.
        let mut region = [0u8; 32 + 8];
        let off = (8 - region.as_ptr() as usize % 8) % 8;
        let words = &mut region[off..off + 32];
        words[24..32].copy_from_slice(&u64::MAX.to_ne_bytes());
        let map = w.mem_map(words).unwrap();
        let key = map.pack_rkey();
        for r in 1..job.size() {
            w.tag_send_wait(job.ep(r), &key, 1).unwrap();
        }
        let mut fetched64 = Vec::new();
        let mut fetched32 = Vec::new();
        let mut olds = Vec::new();
        for _ in 1..job.size() {
            let mut b = vec![0u8; ADDS * 12 + 8];
            let c = w.tag_recv_wait(&mut b, 2, TAG_MASK_FULL).unwrap();
            assert_eq!(c.len, b.len());
            for i in 0..ADDS {
                fetched64.push(u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap()));
                let at = ADDS * 8 + i * 4;
                fetched32.push(u32::from_ne_bytes(b[at..at + 4].try_into().unwrap()) as u64);
            }
            olds.push(u64::from_ne_bytes(b[ADDS * 12..].try_into().unwrap()));
        }
        job.barrier_timeout(limit).unwrap();
        let n = (job.size() - 1) * ADDS;
        let s = map.as_slice();
        assert_eq!(s[0..8], (n as u64).to_ne_bytes(), "64-bit counter");
        assert_eq!(s[8..12], (n as u32).to_ne_bytes(), "32-bit counter");
        assert_eq!(s[12..16], [0; 4], "the word after the 32-bit counter");
        // Each rank r xored (1 << r) in twice: back to zero bits but for none.
        assert_eq!(s[16..24], 0u64.to_ne_bytes(), "xor word");
        let owner = u64::from_ne_bytes(s[24..32].try_into().unwrap());
        assert!((1..job.size() as u64).contains(&owner), "owner {owner}");
        for f in [&mut fetched64, &mut fetched32] {
            f.sort_unstable();
            assert_eq!(*f, (0..n as u64).collect::<Vec<_>>(), "fetched values");
        }
        assert_eq!(
            olds.iter().filter(|&&o| o == u64::MAX).count(),
            1,
            "{olds:?}"
        );
        assert!(
            olds.iter().all(|&o| o == u64::MAX || o == owner),
            "{olds:?}"
        );
    } else {
        let mut packed = vec![0u8; 4096];
        let got = w.tag_recv_wait(&mut packed, 1, TAG_MASK_FULL).unwrap();
        let zero = job.ep(0);
        let key = w.rkey_unpack(zero, &packed[..got.len]).unwrap();
        let base = key.base();
        let mut f64s = vec![0u64; ADDS];
        let mut f32s = vec![0u32; ADDS];
        let mut old = 0u64;
        let me = job.rank() as u64;
        w.scope(|s| {
            let mut reqs = Vec::new();
            for (a, b) in f64s.iter_mut().zip(f32s.iter_mut()) {
                reqs.push(s.atomic_fetch(zero, AtomicOp::Add, 1u64, a, base, &key));
                reqs.push(s.atomic_fetch(zero, AtomicOp::Add, 1u32, b, base + 8, &key));
            }
            for _ in 0..2 {
                reqs.push(s.atomic_post(zero, AtomicOp::Xor, 1u64 << me, base + 16, &key));
            }
            reqs.push(s.atomic_cswap(zero, u64::MAX, me, &mut old, base + 24, &key));
            s.flush(zero).wait().unwrap();
            for r in reqs {
                assert!(r.test().is_some(), "the flush ended before an atomic");
                r.wait().unwrap();
            }
        });
        let mut b = Vec::new();
        for v in &f64s {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        for v in &f32s {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        b.extend_from_slice(&old.to_ne_bytes());
        w.tag_send_wait(zero, &b, 2).unwrap();
        job.barrier_timeout(limit).unwrap();
    }
    println!("rank {}: atomics OK", job.rank());
}

#[test]
fn atomics_of_three_processes_over_posix() {
    if std::env::var_os(ROLE).is_some() {
        return rank_main();
    }
    spawn("atomics_of_three_processes_over_posix", 3, "posix,self");
}

#[test]
fn atomics_of_three_processes_over_tcp() {
    if std::env::var_os(ROLE).is_some() {
        return rank_main();
    }
    spawn("atomics_of_three_processes_over_tcp", 3, "tcp,self");
}
