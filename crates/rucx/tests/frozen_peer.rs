//! A frozen peer (SIGSTOP) under `RUCX_PEER_TIMEOUT`: the survivor's requests bound to it fail
//! with the timeout error and it exits cleanly; a peer that is merely slow to post its receive
//! but keeps calling into rucx answers the keepalive probes and is not failed. Both print the
//! survivor's wait and the CPU it used meanwhile (`--nocapture` to see them).
//!
//! Each test spawns its two ranks as children of this test binary (told apart by
//! `RUCX_TEST_RANK_ROLE`), which meet through the launcher bootstrap like any rucx job.

mod ranks;

use std::process::Child;
use std::time::{Duration, Instant};

use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::signal::{Signal, kill, raise};
use nix::unistd::Pid;
use ranks::{finish, in_child, spawn};
use rucx::{Error, Job, TAG_MASK_FULL};

const BIG: usize = 16 << 20;

/// CPU time (user and system) this process used so far.
fn cpu_time() -> Duration {
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let tv =
        |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, (t.tv_usec() * 1000) as u32);
    tv(u.user_time()) + tv(u.system_time())
}

/// One small message each way, so both ranks are wired up and have heard from each other.
fn handshake(job: &Job) {
    let peer = 1 - job.rank();
    let mut got = [0u8; 1];
    let mine = [job.rank() as u8];
    job.worker()
        .scope(|s| {
            let r = s.tag_recv(&mut got[..], 1, TAG_MASK_FULL);
            s.tag_send(job.ep(peer), &mine[..], 1).wait()?;
            r.wait()
        })
        .unwrap();
    assert_eq!(got[0] as usize, peer);
}

/// The two ranks over posix with a 2 s peer timeout, and extra environment.
fn spawn_ranks(test: &str, env: &[(&str, &str)]) -> Vec<Child> {
    let mut all = vec![("RUCX_PEER_TIMEOUT", "2s")];
    all.extend_from_slice(env);
    spawn(test, "posix", &all)
}

#[test]
fn frozen_peer_fails_the_survivors_requests_after_the_peer_timeout() {
    if in_child() {
        let job = Job::from_env().unwrap();
        let w = job.worker();
        handshake(&job);
        if job.rank() == 1 {
            // Offer rank 0 a rendezvous it will match, then freeze at once: posting put the
            // request to send in the (empty) shared-memory ring already, and no progress here
            // may answer rank 0's reply (with it, rank 1 could write its part of the message
            // before it froze and the receive would complete).
            let msg = vec![1u8; BIG];
            w.scope(|s| {
                let _send = s.tag_send(job.ep(0), &msg, 7);
                println!("rank 1: freezing");
                raise(Signal::SIGSTOP).unwrap();
                // Resumed after the survivor gave up on us: nothing more to do.
                std::process::exit(0);
            });
            return;
        }
        let out = vec![0u8; BIG];
        let mut from1 = vec![0u8; BIG];
        let (cpu0, t) = (cpu_time(), Instant::now());
        let (sent, received) = w.scope(|s| {
            // Matched to rank 1's rendezvous (split: rank 1 must write the tail) ...
            let r = s.tag_recv(&mut from1, 7, TAG_MASK_FULL);
            // ... and a rendezvous rank 1 never answers.
            let sd = s.tag_send(job.ep(1), &out, 8);
            (sd.wait(), r.wait())
        });
        let (el, cpu) = (t.elapsed(), cpu_time() - cpu0);
        println!(
            "rank 0: FROZEN PEER detected after {el:.2?}, CPU {cpu:.2?} ({:.1}% of one core)",
            100.0 * cpu.as_secs_f64() / el.as_secs_f64()
        );
        for (what, res) in [("send", &sent), ("receive", &received)] {
            match res {
                Err(e @ Error::PeerTimeout { knob, .. }) => {
                    assert_eq!(knob, "RUCX_PEER_TIMEOUT=2s", "{what}: {e}");
                    assert!(
                        e.to_string().contains("RUCX_PEER_TIMEOUT=2s"),
                        "{what}: {e}"
                    )
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        assert!(
            el >= Duration::from_secs(2),
            "failed before the timeout: {el:?}"
        );
        assert!(el < Duration::from_secs(20), "took {el:?}");
        println!("rank 0: {}", sent.unwrap_err());
        return;
    }
    let mut kids = spawn_ranks(
        "frozen_peer_fails_the_survivors_requests_after_the_peer_timeout",
        &[],
    );
    let rank1 = kids.pop().unwrap();
    let pid1 = Pid::from_raw(rank1.id() as i32);
    let t = Instant::now();
    let rank0 = finish(kids.pop().unwrap(), Duration::from_secs(90));
    // The whole survivor, start-up and exit included (a frozen peer used to hold its final
    // barrier for the bootstrap timeout, 30 s here).
    let survivor = t.elapsed();
    // The survivor is done: wake the frozen rank (it exits by itself) or end it.
    let _ = kill(pid1, Signal::SIGCONT);
    let rank1 = finish(rank1, Duration::from_secs(5));
    let (ok, text) = &rank0;
    println!("{text}");
    assert!(ok, "rank 0 failed:\n{text}\nrank 1:\n{}", rank1.1);
    println!("survivor process ran {survivor:.2?}");
    assert!(survivor < Duration::from_secs(25), "{survivor:?}");
    assert!(text.contains("FROZEN PEER detected"), "{text}");
    assert!(rank1.1.contains("rank 1: freezing"), "{}", rank1.1);
    let warnings = text
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("failed: it answered nothing"))
        .count();
    assert_eq!(warnings, 1, "one warning for the peer:\n{text}");
}

#[test]
fn slow_peer_that_keeps_progressing_is_not_failed() {
    if in_child() {
        let job = Job::from_env().unwrap();
        let w = job.worker();
        handshake(&job);
        if job.rank() == 1 {
            // Busy waiting for something else for three timeouts, then receive.
            let mut other = [0u8; 8];
            let mut got = vec![0u8; BIG];
            w.scope(|s| {
                let r = s.tag_recv(&mut other[..], 99, TAG_MASK_FULL);
                let res = r.wait_timeout(Duration::from_secs(6));
                assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
                s.tag_recv(&mut got, 9, TAG_MASK_FULL).wait().unwrap();
            });
            assert!(got.iter().all(|&b| b == 3));
            println!("rank 1: received");
            return;
        }
        let msg = vec![3u8; BIG];
        let (cpu0, t) = (cpu_time(), Instant::now());
        let res = w.scope(|s| s.tag_send(job.ep(1), &msg, 9).wait());
        let (el, cpu) = (t.elapsed(), cpu_time() - cpu0);
        println!(
            "rank 0: SLOW PEER send done after {el:.2?}, CPU {cpu:.2?} ({:.1}% of one core): \
             {res:?} {:?}",
            100.0 * cpu.as_secs_f64() / el.as_secs_f64(),
            w.counters().get("keepalive probe")
        );
        res.unwrap();
        assert!(el > Duration::from_secs(2), "the receive came late: {el:?}");
        return;
    }
    let mut kids = spawn_ranks("slow_peer_that_keeps_progressing_is_not_failed", &[]);
    let rank1 = finish(kids.pop().unwrap(), Duration::from_secs(90));
    let rank0 = finish(kids.pop().unwrap(), Duration::from_secs(5));
    println!("{}", rank0.1);
    for (rank, (ok, text)) in [rank0, rank1].iter().enumerate() {
        assert!(ok, "rank {rank} failed:\n{text}");
        assert!(!text.contains("RUCX_PEER_TIMEOUT"), "rank {rank}:\n{text}");
    }
}
