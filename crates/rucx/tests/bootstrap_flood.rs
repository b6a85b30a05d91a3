//! The bootstrap under attack, with real ranks (processes of this test binary, told apart by
//! `ROLE`) meeting through `Job::from_env` on loopback: random bytes, truncated headers, forged
//! ranks (out of range, of another size, without the key), idle connections, and a flood of 500
//! connections at once, after which (and during which) a real job still forms in seconds.
//!
//! Every connection goes to 127.0.0.1 only; loops are bounded in count and time.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rucx::TAG_MASK_FULL;

const ROLE: &str = "RUCX_TEST_FLOOD_ROLE";
/// Generous bound on a real rank joining under attack (it takes well under a second here).
const JOIN_BOUND: Duration = Duration::from_secs(20);

/// The tests of this file run one at a time: a port [`free_port`] found free is bound by rank 0
/// only after its process starts, and a parallel test's processes (their transports listen on
/// ephemeral ports) could take it in between; the fuzz would then land on their listener.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A port for the rendezvous, outside the ephemeral range (a port-0 listener's port could be
/// handed to another test's connection before rank 0 binds it).
fn free_port() -> u16 {
    rucx::bootstrap::local_port().unwrap()
}

/// A small deterministic generator (xorshift64*), so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A version-2 `Hello` claiming `rank` of `size` (layout in `bootstrap/wire.rs`).
fn hello(rank: u32, size: u32, nonce: &[u8]) -> Vec<u8> {
    let mut b = b"RUCXBOOT".to_vec();
    for v in [2u32, rank, size] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&nonce[..32]);
    b
}

/// The packet of the original report: a version-1 join claiming rank 5 of 2, with a 4-byte
/// address (28 bytes).
fn v1_rank5_of_2() -> Vec<u8> {
    let mut b = b"RUCXBOOT".to_vec();
    for v in [1u32, 5, 2, 4] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(b"addr");
    assert_eq!(b.len(), 28);
    b
}

fn connect(at: SocketAddr) -> Option<TcpStream> {
    TcpStream::connect_timeout(&at, Duration::from_secs(1)).ok()
}

/// A forged join: `Hello`, read the challenge, then a `Join` with a made-up proof. Returns
/// whether rank 0 accepted it (it must not, when it has a key).
fn forged_join(at: SocketAddr, rank: u32, size: u32, rng: &mut Rng) -> bool {
    let Some(mut s) = connect(at) else {
        return false;
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    if s.write_all(&hello(rank, size, &rng.bytes(32))).is_err() {
        return false;
    }
    let mut ch = [0u8; 80];
    if s.read_exact(&mut ch).is_err() {
        return false;
    }
    let mut join = 6u32.to_le_bytes().to_vec();
    join.extend_from_slice(b"forged");
    join.extend_from_slice(&rng.bytes(32));
    if s.write_all(&join).is_err() {
        return false;
    }
    let mut verdict = [0u8; 8];
    s.read_exact(&mut verdict).is_ok() && verdict[..4] == [0, 0, 0, 0]
}

/// Everything but a flood: returns connections to keep open (idle and truncated ones).
fn fuzz(at: SocketAddr, rng: &mut Rng, keyed: bool) -> Vec<TcpStream> {
    let mut keep = Vec::new();
    // Random bytes of random lengths, some closed at once, some left open.
    for i in 0..60 {
        if let Some(mut s) = connect(at) {
            let n = rng.below(300) as usize;
            let _ = s.write_all(&rng.bytes(n));
            if i % 2 == 0 {
                keep.push(s);
            }
        }
    }
    // Truncated headers: a valid Hello cut anywhere.
    for _ in 0..30 {
        if let Some(mut s) = connect(at) {
            let h = hello(1, 2, &rng.bytes(32));
            let cut = rng.below(h.len() as u64) as usize;
            let _ = s.write_all(&h[..cut]);
            keep.push(s);
        }
    }
    // The original report's packet, and forged ranks: out of range, rank 0, another size, the
    // real rank 1 without the key.
    for _ in 0..3 {
        if let Some(mut s) = connect(at) {
            let _ = s.write_all(&v1_rank5_of_2());
            keep.push(s);
        }
    }
    for (r, n) in [(5, 2), (2, 2), (0, 2), (1, 3), (u32::MAX, 2), (1, 0)] {
        assert!(
            !forged_join(at, r, n, rng),
            "rank 0 accepted rank {r} of {n}"
        );
    }
    if keyed {
        for _ in 0..5 {
            assert!(
                !forged_join(at, 1, 2, rng),
                "rank 0 accepted rank 1 without the key"
            );
        }
    }
    // Idle connections.
    for _ in 0..200 {
        if let Some(s) = connect(at) {
            keep.push(s);
        }
    }
    keep
}

/// Keep `n` connections open at once, closing the oldest for each new one, until `stop`.
fn flood(at: SocketAddr, n: usize, stop: Arc<AtomicBool>, made: Arc<AtomicUsize>) {
    let start = Instant::now();
    let mut open = VecDeque::with_capacity(n);
    let mut rng = Rng(0x5eed_f100d);
    while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(60) {
        if open.len() >= n {
            open.pop_front();
        }
        match TcpStream::connect_timeout(&at, Duration::from_millis(500)) {
            Ok(mut s) => {
                // A third say something half-valid, the rest nothing.
                if rng.below(3) == 0 {
                    let _ = s.write_all(&hello(1, 2, &rng.bytes(32))[..rng.below(52) as usize]);
                }
                open.push_back(s);
                made.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

fn spawn_rank(rank: usize, port: u16, key: Option<&str>) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["child_rank", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "1")
        .env("RUCX_RANK", rank.to_string())
        .env("RUCX_SIZE", "2")
        .env("RUCX_BOOTSTRAP", format!("127.0.0.1:{port}"))
        .env("RUCX_BOOTSTRAP_TIMEOUT", "60s")
        .env_remove("RUCX_BOOTSTRAP_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(k) = key {
        c.env("RUCX_BOOTSTRAP_KEY", k);
    }
    c.spawn().unwrap()
}

fn finish(c: Child, limit: Duration) -> (bool, String) {
    let start = Instant::now();
    let mut c = c;
    while c.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = c.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = c.wait_with_output().unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// Wait until rank 0 listens.
fn wait_listening(at: SocketAddr) {
    let start = Instant::now();
    while TcpStream::connect_timeout(&at, Duration::from_millis(200)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "rank 0 never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The time a child rank reported for `Job::from_env`.
fn joined_in(out: &str) -> Duration {
    let ms: f64 = out
        .lines()
        .find_map(|l| l.split_once("JOINED ms="))
        .and_then(|(_, v)| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("no JOINED line in:\n{out}"))
        .parse()
        .unwrap();
    Duration::from_secs_f64(ms / 1000.0)
}

/// In a child: join the job, exchange one message each way with the other rank.
#[test]
fn child_rank() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let start = Instant::now();
    let job = rucx::Job::from_env().unwrap_or_else(|e| panic!("joining: {e}"));
    println!("JOINED ms={:.3}", start.elapsed().as_secs_f64() * 1e3);
    let other = 1 - job.rank();
    let send = vec![job.rank() as u8 + 1; 4096];
    let mut got = vec![0u8; 4096];
    job.worker()
        .scope(|s| {
            let r = s.tag_recv(&mut got, 9, TAG_MASK_FULL);
            s.tag_send(job.ep(other), &send, 9).wait()?;
            r.wait()
        })
        .unwrap();
    assert!(got.iter().all(|b| *b == other as u8 + 1));
    println!("DONE");
}

#[test]
fn a_keyed_job_forms_through_fuzz_and_a_500_connection_flood() {
    let _one_at_a_time = serial();
    let key = rucx::bootstrap::generate_key().unwrap();
    let port = free_port();
    let at = SocketAddr::from(([127, 0, 0, 1], port));
    let r0 = spawn_rank(0, port, Some(&key));
    wait_listening(at);
    let mut rng = Rng(0x00b0_075e_ed00);
    let keep = fuzz(at, &mut rng, true);

    let stop = Arc::new(AtomicBool::new(false));
    let made = Arc::new(AtomicUsize::new(0));
    let flooder = {
        let (stop, made) = (stop.clone(), made.clone());
        std::thread::spawn(move || flood(at, 500, stop, made))
    };
    // Let the flood reach 500 open connections and churn a while before the real rank comes.
    let start = Instant::now();
    while made.load(Ordering::Relaxed) < 2000 && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let rate = made.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    let before = made.load(Ordering::Relaxed);
    let spawned = Instant::now();
    let r1 = spawn_rank(1, port, Some(&key));
    let (ok1, out1) = finish(r1, Duration::from_secs(90));
    let wall = spawned.elapsed();
    let during = made.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap();
    let (ok0, out0) = finish(r0, Duration::from_secs(30));
    drop(keep);
    assert!(ok1, "rank 1 failed:\n{out1}");
    assert!(ok0, "rank 0 failed:\n{out0}");
    assert!(out0.contains("DONE") && out1.contains("DONE"));
    let join = joined_in(&out1);
    println!(
        "bootstrap flood: a real rank joined in {:.1} ms (Job::from_env; {:.1} ms from spawn to \
         exit) while 500 connections were held open ({before} made before it at {rate:.0}/s, \
         {during} more while it joined)",
        join.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3
    );
    assert!(join < JOIN_BOUND, "a real rank took {join:?} to join");
    // Rank 0 said what it dropped, and nothing ended the job.
    assert!(out0.contains("dropped a connection"), "{out0}");
    assert!(out0.contains("other connections were dropped"), "{out0}");
}

#[test]
fn an_unkeyed_job_survives_the_original_packet_and_forged_ranks() {
    let _one_at_a_time = serial();
    let port = free_port();
    let at = SocketAddr::from(([127, 0, 0, 1], port));
    let r0 = spawn_rank(0, port, None);
    wait_listening(at);
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let keep = fuzz(at, &mut rng, false);
    let start = Instant::now();
    let (ok1, out1) = finish(spawn_rank(1, port, None), Duration::from_secs(60));
    let took = start.elapsed();
    let (ok0, out0) = finish(r0, Duration::from_secs(30));
    drop(keep);
    assert!(ok1, "rank 1 failed:\n{out1}");
    assert!(ok0, "rank 0 failed:\n{out0}");
    let join = joined_in(&out1);
    println!(
        "bootstrap fuzz: a real rank joined in {:.1} ms after ~300 bad connections",
        join.as_secs_f64() * 1e3
    );
    assert!(join < JOIN_BOUND, "{join:?}");
    assert!(took < JOIN_BOUND + Duration::from_secs(5), "{took:?}");
    // Without a key, both ranks say once that the rendezvous is unauthenticated.
    for out in [&out0, &out1] {
        assert_eq!(out.matches("is unauthenticated").count(), 1, "{out}");
    }
    assert!(out0.contains("rank 5 is not a rank"), "{out0}");
}

#[test]
fn a_rank_with_the_wrong_key_is_told_and_the_job_still_forms() {
    let _one_at_a_time = serial();
    let key = rucx::bootstrap::generate_key().unwrap();
    let wrong = rucx::bootstrap::generate_key().unwrap();
    let port = free_port();
    let r0 = spawn_rank(0, port, Some(&key));
    let (ok, out) = finish(spawn_rank(1, port, Some(&wrong)), Duration::from_secs(60));
    assert!(!ok, "a rank with the wrong key joined:\n{out}");
    assert!(out.contains("RUCX_BOOTSTRAP_KEY differs"), "{out}");
    let (ok1, out1) = finish(spawn_rank(1, port, Some(&key)), Duration::from_secs(60));
    let (ok0, out0) = finish(r0, Duration::from_secs(30));
    assert!(ok1, "rank 1 failed:\n{out1}");
    assert!(ok0, "rank 0 failed:\n{out0}");
    for out in [&out0, &out1] {
        assert!(!out.contains("unauthenticated"), "{out}");
    }
}
