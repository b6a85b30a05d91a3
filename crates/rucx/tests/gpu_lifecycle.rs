//! Endpoint close and peer failure with GPU buffers in flight, across real processes on the
//! GPU lanes (cuda_ipc zero-copy, the cuda_copy staging pipeline): close with flush delivers
//! every device buffer, close with force cancels device sends and hands the buffers back
//! intact, and a peer killed while idle (or in the middle of a large device transfer) is
//! reported once, within seconds, with no request left hanging.
//!
//! Runs only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver and a GPU; elsewhere each
//! test prints why it skipped and passes. On the GPU machine:
//! `RUCX_GPU_TESTS=1 <this test binary> --test-threads=1 --nocapture` (`cargo xtask gpu-pack`
//! puts it at `.device/rucx-gpu_lifecycle`). Each rank uses GPU `rank % device_count`.

#![forbid(unsafe_code)]

mod ranks;

use ranks::record_errors;

use std::time::{Duration, Instant};

use rucx::cuda::{DeviceBuffer, PrimaryContext};
use rucx::{CloseMode, Error, Job, TAG_MASK_FULL};

/// Sizes through every GPU protocol: small (bounce or zero-copy read), a rendezvous, and
/// large enough for several pipeline fragments when staged.
const SIZES: [usize; 4] = [1, 4097, 1 << 20, (16 << 20) + 3];

fn gpu(job: &Job) -> &'static PrimaryContext {
    let cuda = rucx::cuda::driver().unwrap();
    cuda.context(job.rank() as u32 % cuda.device_count())
        .unwrap()
}

fn dev_with(ctx: &'static PrimaryContext, data: &[u8]) -> DeviceBuffer {
    let mut d = DeviceBuffer::new(ctx, data.len().max(1)).unwrap();
    d.copy_from_host(0, data).unwrap();
    d
}

fn dev_read(d: &DeviceBuffer, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    d.copy_to_host(0, &mut out).unwrap();
    out
}

/// The body of every test here: in a rank, `job`; in the test, unless GPU tests are off, both
/// ranks run by `parent`.
fn gpu_test(job: impl FnOnce(), parent: impl FnOnce()) {
    if ranks::in_child() {
        return job();
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        return println!("skipped: {why}");
    }
    parent();
}

/// Both ranks of `test` over the transports `tls` (each with `env`); their outputs.
fn run(test: &str, tls: &str, env: &[(&str, &str)]) -> Vec<String> {
    let outs = ranks::run_both(test, tls, env);
    for (r, o) in outs.iter().enumerate() {
        println!("--- rank {r} over {tls} {env:?}:\n{o}");
    }
    outs
}

// ----- close with flush -----

/// Rank 0 sends every size from device buffers and closes with flush at once: the close ends
/// after every send, rank 1 receives every byte into device buffers, then sees its endpoint
/// closed by the peer (reported once).
fn close_flush_job() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let ctx = gpu(&job);
    let peer = job.ep(1 - job.rank());
    if job.rank() == 1 {
        let calls = record_errors(w);
        let recvs: Vec<_> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let d = DeviceBuffer::new(ctx, n).unwrap();
                w.tag_recv_owned(d, i as u64, TAG_MASK_FULL)
            })
            .collect();
        for (i, r) in recvs.into_iter().enumerate() {
            let (res, d) = r.wait(w);
            assert_eq!(res.unwrap().len, SIZES[i]);
            assert!(
                dev_read(&d, SIZES[i]) == ranks::pattern(SIZES[i], i),
                "message {i} ({} bytes) differs",
                SIZES[i]
            );
        }
        let t = Instant::now();
        while calls.lock().unwrap().is_empty() {
            w.progress();
            assert!(t.elapsed() < Duration::from_secs(30), "no close seen");
        }
        for _ in 0..10_000 {
            w.progress();
        }
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0].0, peer);
        assert!(calls[0].1.contains("the peer closed it"), "{}", calls[0].1);
        job.barrier().unwrap();
        println!("rank 1: every device buffer received, close reported once");
        return;
    }
    let sends: Vec<_> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| w.tag_send_owned(peer, dev_with(ctx, &ranks::pattern(n, i)), i as u64))
        .collect();
    let t = Instant::now();
    w.close(peer, CloseMode::Flush).wait(w).0.unwrap();
    println!("rank 0: close with flush took {:.2?}", t.elapsed());
    for (i, s) in sends.into_iter().enumerate() {
        let (res, d) = s.try_take().expect("ended before the close");
        res.unwrap();
        assert!(
            dev_read(&d, SIZES[i]) == ranks::pattern(SIZES[i], i),
            "send buffer {i}"
        );
    }
    job.barrier().unwrap();
    println!("rank 0: closed with flush");
}

#[test]
fn gpu_close_with_flush_delivers_every_device_buffer_over_cuda_ipc() {
    gpu_test(close_flush_job, || {
        let out = run(
            "gpu_close_with_flush_delivers_every_device_buffer_over_cuda_ipc",
            "all",
            &[],
        );
        assert!(out[1].contains("close reported once"), "{}", out[1]);
    });
}

#[test]
fn gpu_close_with_flush_delivers_every_device_buffer_through_staging() {
    gpu_test(close_flush_job, || {
        let out = run(
            "gpu_close_with_flush_delivers_every_device_buffer_through_staging",
            "^cuda_ipc",
            &[],
        );
        assert!(out[1].contains("close reported once"), "{}", out[1]);
    });
}

// ----- close with force -----

/// Rank 0 announces large device sends rank 1 never receives and closes with force: they end
/// canceled, their device buffers intact; rank 1 is told once and the announcements are gone.
fn close_force_job() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let ctx = gpu(&job);
    let peer = job.ep(1 - job.rank());
    if job.rank() == 1 {
        let calls = record_errors(w);
        let t = Instant::now();
        while calls.lock().unwrap().is_empty() {
            w.progress();
            assert!(t.elapsed() < Duration::from_secs(30), "no close seen");
        }
        for _ in 0..10_000 {
            w.progress();
        }
        assert_eq!(calls.lock().unwrap().len(), 1);
        assert_eq!(w.probe(7, TAG_MASK_FULL), None, "announcements dropped");
        job.barrier().unwrap();
        println!("rank 1: forced close reported once");
        return;
    }
    let n = 8 << 20;
    let big: Vec<_> = (0..3)
        .map(|i| w.tag_send_owned(peer, dev_with(ctx, &ranks::pattern(n, i)), 7))
        .collect();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(300) {
        w.progress();
    }
    w.close(peer, CloseMode::Force).wait(w).0.unwrap();
    for (i, r) in big.into_iter().enumerate() {
        let (res, d) = r.try_take().expect("ended by the close");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert!(
            dev_read(&d, n) == ranks::pattern(n, i),
            "device buffer {i} intact"
        );
    }
    job.barrier().unwrap();
    println!("rank 0: forced close canceled its device sends");
}

#[test]
fn gpu_close_with_force_cancels_device_sends_over_cuda_ipc() {
    gpu_test(close_force_job, || {
        let out = run(
            "gpu_close_with_force_cancels_device_sends_over_cuda_ipc",
            "all",
            &[],
        );
        assert!(out[0].contains("canceled its device sends"), "{}", out[0]);
        assert!(out[1].contains("reported once"), "{}", out[1]);
    });
}

// ----- a peer killed -----

/// Rank 1 tells rank 0 its pid, then either idles (`busy` false) or posts a large device
/// receive rank 0 feeds slowly; rank 0 kills it with SIGKILL and measures how long until its
/// error handler is called (exactly once); its device send in flight ends with an error.
fn killed_peer_job(busy: bool) {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let ctx = gpu(&job);
    let peer = job.ep(1 - job.rank());
    let n = 256 << 20;
    if job.rank() == 1 {
        let pid = std::process::id().to_le_bytes().to_vec();
        w.tag_send_owned(peer, pid, 1).wait(w).0.unwrap();
        let _recv = busy.then(|| {
            let d = DeviceBuffer::new(ctx, n).unwrap();
            w.tag_recv_owned(d, 2, TAG_MASK_FULL)
        });
        println!("rank 1: waiting to be killed");
        loop {
            w.progress();
            if !busy {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    let calls = record_errors(w);
    let (res, pid) = w.tag_recv_owned(vec![0u8; 4], 1, TAG_MASK_FULL).wait(w);
    res.unwrap();
    let pid = u32::from_le_bytes(pid.try_into().unwrap());
    let spin = |until: &dyn Fn() -> bool, limit: Duration| {
        let t = Instant::now();
        while !until() && t.elapsed() < limit {
            w.progress();
            if !busy {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    let send = busy.then(|| w.tag_send_owned(peer, dev_with(ctx, &vec![5u8; n]), 2));
    spin(
        &|| false,
        Duration::from_millis(if busy { 2 } else { 1500 }),
    );
    let (detected, call) =
        ranks::kill_and_detect(pid, peer, &calls, spin, Duration::from_millis(500));
    println!(
        "rank 0: KILLED {} PEER detected after {detected:.2?}: {}",
        if busy { "BUSY" } else { "IDLE" },
        call.1
    );
    assert!(detected < Duration::from_secs(10), "{detected:?}");
    if let Some(s) = send {
        let t = Instant::now();
        while s.test().is_none() {
            w.progress();
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "device send left hanging"
            );
        }
        let (res, _) = s.try_take().unwrap();
        // The transfer may have finished before the kill (a fast NVLink read); otherwise it
        // ends with the endpoint's failure.
        match res {
            Ok(_) => println!("rank 0: the device send had finished before the kill"),
            Err(e) => println!("rank 0: the device send ended with: {e}"),
        }
    }
    let (res, _) = w
        .tag_send_owned(peer, dev_with(ctx, &[1u8; 4096]), 3)
        .wait(w);
    assert!(matches!(res, Err(Error::EndpointFailure { .. })), "{res:?}");
}

fn run_killed(test: &str, tls: &str) -> String {
    let mut kids = ranks::spawn(test, tls, &[]);
    let rank1 = kids.pop().unwrap();
    let (ok, text) = ranks::finish(kids.pop().unwrap(), Duration::from_secs(90));
    let (_, text1) = ranks::finish(rank1, Duration::from_secs(5));
    println!("--- rank 0 over {tls}:\n{text}\n--- rank 1:\n{text1}");
    assert!(ok, "rank 0 failed:\n{text}\nrank 1:\n{text1}");
    assert!(text1.contains("waiting to be killed"), "{text1}");
    text
}

#[test]
fn gpu_killed_idle_peer_is_reported_once_with_cuda_lanes() {
    gpu_test(
        || killed_peer_job(false),
        || {
            run_killed(
                "gpu_killed_idle_peer_is_reported_once_with_cuda_lanes",
                "all",
            );
        },
    );
}

#[test]
fn gpu_peer_killed_during_a_device_transfer_is_reported_once_over_cuda_ipc() {
    gpu_test(
        || killed_peer_job(true),
        || {
            run_killed(
                "gpu_peer_killed_during_a_device_transfer_is_reported_once_over_cuda_ipc",
                "all",
            );
        },
    );
}

#[test]
fn gpu_peer_killed_during_a_staged_device_transfer_is_reported_once() {
    gpu_test(
        || killed_peer_job(true),
        || {
            run_killed(
                "gpu_peer_killed_during_a_staged_device_transfer_is_reported_once",
                "^cuda_ipc",
            );
        },
    );
}
