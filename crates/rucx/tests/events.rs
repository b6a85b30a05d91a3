//! Event-driven progress across real processes (posix and tcp): one rank sleeps, waiting for a
//! message the other sends a second later, and is woken by it; the sleeper's CPU time over the
//! wait (getrusage) must stay far below the wall time. Four ways to wait, one phase each: a
//! request's `wait()`, an explicit `progress`/`Worker::wait` loop, `rucx::block_on` on the
//! request as a future, and (feature `tokio`) `.await` under `rucx::tokio::drive`. Run with
//! `--nocapture` to see the figures.
//!
//! Each test spawns its two ranks as children of this test binary (told apart by
//! `RUCX_TEST_RANK_ROLE`), which meet through the launcher bootstrap like any rucx job.

use std::time::{Duration, Instant};

use nix::sys::resource::{UsageWho, getrusage};
use rucx::{Completion, Job, Result, TAG_MASK_FULL, Worker};

mod ranks;
use ranks::{finish, in_child};

/// How long the sender lets the sleeper wait.
const NAP: Duration = Duration::from_secs(1);
/// CPU time allowed per second of waiting (a generous bound: polling would use a whole one).
const CPU_PER_WALL: f64 = 0.2;
const TAG_GO: u64 = 100;

/// CPU time (user and system) this process used so far.
fn cpu_time() -> Duration {
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let tv =
        |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, (t.tv_usec() * 1000) as u32);
    tv(u.user_time()) + tv(u.system_time())
}

/// The ways rank 0 waits for its receive, one phase each.
#[derive(Clone, Copy, Debug)]
enum Way {
    RequestWait,
    WorkerWaitLoop,
    BlockOn,
    #[cfg(feature = "tokio")]
    Tokio,
}

const WAYS: &[Way] = &[
    Way::RequestWait,
    Way::WorkerWaitLoop,
    Way::BlockOn,
    #[cfg(feature = "tokio")]
    Way::Tokio,
];

/// Receive tag `tag` into `buf` by `way`; returns its completion.
fn receive(w: &Worker, way: Way, buf: &mut [u8], tag: u64) -> Result<Completion> {
    w.scope(|s| {
        let r = s.tag_recv(&mut *buf, tag, TAG_MASK_FULL);
        match way {
            Way::RequestWait => r.wait(),
            Way::WorkerWaitLoop => loop {
                if let Some(res) = r.test() {
                    break res;
                }
                if w.progress() == 0 {
                    w.wait(None)?;
                }
            },
            Way::BlockOn => rucx::block_on(w, r)?,
            #[cfg(feature = "tokio")]
            Way::Tokio => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(rucx::tokio::drive(w, r))?
            }
        }
    })
}

/// Rank 0 sleeps in each way in turn, rank 1 wakes it a second later; both check the data.
fn sleeper_and_waker(tls: &str) {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let peer = job.ep(1 - job.rank());
    for (i, &way) in WAYS.iter().enumerate() {
        let tag = i as u64 + 1;
        let payload = vec![tag as u8; 100];
        if job.rank() == 1 {
            // Rank 0 says it is about to wait (rank 1 sleeps in its own wait meanwhile) ...
            let mut go = [0u8; 1];
            receive(w, Way::RequestWait, &mut go, TAG_GO).unwrap();
            std::thread::sleep(NAP);
            // ... and is woken by this.
            w.scope(|s| s.tag_send(peer, &payload, tag).wait()).unwrap();
            continue;
        }
        w.scope(|s| s.tag_send(peer, &[1u8][..], TAG_GO).wait())
            .unwrap();
        let mut got = vec![0u8; 100];
        let (cpu0, t) = (cpu_time(), Instant::now());
        let c = receive(w, way, &mut got, tag).unwrap();
        let (wall, cpu) = (t.elapsed(), cpu_time() - cpu0);
        println!(
            "rank 0 [{tls}] {way:?}: woken after {wall:.2?} of waiting, CPU {cpu:.3?} ({:.1}% \
             of one core)",
            100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
        );
        assert_eq!(c.len, 100);
        assert!(got == payload, "{way:?}: wrong data");
        assert!(
            wall >= NAP / 2,
            "{way:?}: the receive completed after {wall:?}, before the peer sent"
        );
        assert!(
            cpu.as_secs_f64() < CPU_PER_WALL * wall.as_secs_f64(),
            "{way:?}: {cpu:?} of CPU over {wall:?} of waiting: the wait polls"
        );
    }
}

fn run(test: &str, tls: &str) {
    let kids = ranks::spawn(test, tls, &[]);
    let mut ok = true;
    for (rank, k) in kids.into_iter().enumerate() {
        let (success, out) = finish(k, Duration::from_secs(60));
        println!("--- rank {rank} ---\n{out}");
        ok &= success;
    }
    assert!(ok, "a rank failed (output above)");
}

#[test]
fn a_sleeping_rank_is_woken_by_its_peer_and_uses_no_cpu_posix() {
    if in_child() {
        return sleeper_and_waker("posix");
    }
    run(
        "a_sleeping_rank_is_woken_by_its_peer_and_uses_no_cpu_posix",
        "posix",
    );
}

#[test]
fn a_sleeping_rank_is_woken_by_its_peer_and_uses_no_cpu_tcp() {
    if in_child() {
        return sleeper_and_waker("tcp");
    }
    run(
        "a_sleeping_rank_is_woken_by_its_peer_and_uses_no_cpu_tcp",
        "tcp",
    );
}
