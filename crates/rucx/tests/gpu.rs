//! GPU buffers through the public API, with no `unsafe`: every `rucx::cuda` buffer type (and a
//! part of one) is sent and received between two ranks, every byte checked.
//!
//! Runs only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver and a GPU; elsewhere each
//! test prints why it skipped and passes. On the GPU machine:
//! `RUCX_GPU_TESTS=1 <this test binary> --test-threads=1 --nocapture` (`cargo xtask gpu-pack`
//! puts it at `.device/rucx-gpu`). The ranks are children of the test binary, which meet through
//! the launcher bootstrap like any rucx job; each uses GPU `rank % device_count`.

#![forbid(unsafe_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rucx::cuda::{DeviceBuffer, ManagedBuffer, PinnedHostBuffer, PoolBuffer, Stream};
use rucx::ucs::MemInfo;
use rucx::{Job, Memory, MemoryType, TAG_MASK_FULL};

const ROLE: &str = "RUCX_TEST_RANK_ROLE";

mod ranks;

/// Why GPU tests do not run here, or `None` when they do.
fn skip_reason() -> Option<String> {
    if std::env::var("RUCX_GPU_TESTS").as_deref() != Ok("1") {
        return Some("set RUCX_GPU_TESTS=1 to run GPU tests".into());
    }
    match rucx::cuda::driver() {
        Ok(_) => None,
        Err(e) => panic!("RUCX_GPU_TESTS=1 but the CUDA driver is unavailable: {e}"),
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| ((i % 251) as u8).wrapping_add(seed.wrapping_mul(37)))
        .collect()
}

/// Run this test's rank body in two child processes; panic with their output if one fails.
fn two_ranks(test: &str) {
    let port = rucx::bootstrap::local_port().unwrap();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, "1")
                .env("RUCX_RANK", rank.to_string())
                .env("RUCX_SIZE", "2")
                .env("RUCX_BOOTSTRAP", format!("127.0.0.1:{port}"))
                .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    for (rank, mut k) in kids.into_iter().enumerate() {
        while k.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(180) {
                let _ = k.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = k.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        println!("--- rank {rank}:\n{text}");
        assert!(o.status.success(), "rank {rank} failed:\n{text}");
    }
}

/// The buffer types a rank sends from or receives into.
enum Kind {
    Device,
    Pool,
    Managed,
    Pinned,
}

const KINDS: [(Kind, &str); 4] = [
    (Kind::Device, "device"),
    (Kind::Pool, "pool"),
    (Kind::Managed, "managed"),
    (Kind::Pinned, "pinned"),
];

/// One buffer of any kind, used only through `Memory` and the host copies.
enum AnyBuf {
    Device(DeviceBuffer),
    Pool(PoolBuffer),
    Managed(ManagedBuffer),
    Pinned(PinnedHostBuffer),
}

impl AnyBuf {
    fn new(kind: &Kind, job_gpu: &'static rucx::cuda::PrimaryContext, n: usize) -> AnyBuf {
        match kind {
            Kind::Device => AnyBuf::Device(DeviceBuffer::new(job_gpu, n).unwrap()),
            Kind::Pool => {
                let st = Stream::new(job_gpu).unwrap();
                AnyBuf::Pool(PoolBuffer::new(&st, n).unwrap())
            }
            Kind::Managed => AnyBuf::Managed(ManagedBuffer::new(job_gpu, n).unwrap()),
            Kind::Pinned => AnyBuf::Pinned(PinnedHostBuffer::new(job_gpu, n).unwrap()),
        }
    }

    fn info(&self) -> Option<MemInfo> {
        match self {
            AnyBuf::Device(b) => b.mem_info(),
            AnyBuf::Pool(b) => b.mem_info(),
            AnyBuf::Managed(b) => b.mem_info(),
            AnyBuf::Pinned(b) => b.mem_info(),
        }
    }

    fn write(&mut self, data: &[u8]) {
        match self {
            AnyBuf::Device(b) => b.copy_from_host(0, data).unwrap(),
            AnyBuf::Pool(b) => b.copy_from_host(0, data).unwrap(),
            AnyBuf::Managed(b) => b.copy_from_host(0, data).unwrap(),
            AnyBuf::Pinned(b) => b.as_mut_slice()[..data.len()].copy_from_slice(data),
        }
    }

    fn read(&self, n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n];
        match self {
            AnyBuf::Device(b) => b.copy_to_host(0, &mut out).unwrap(),
            AnyBuf::Pool(b) => b.copy_to_host(0, &mut out).unwrap(),
            AnyBuf::Managed(b) => b.copy_to_host(0, &mut out).unwrap(),
            AnyBuf::Pinned(b) => out.copy_from_slice(&b.as_slice()[..n]),
        }
        out
    }
}

/// Every kind of buffer to every kind of buffer, at an eager size and a rendezvous size, then
/// a part of a device buffer into a part of another.
fn every_kind_both_ways(job: &Job) {
    let (rank, size) = (job.rank(), job.size());
    let to = job.ep((rank + 1) % size);
    let from = (rank + size - 1) % size;
    let cuda = rucx::cuda::driver().unwrap();
    let gpu = cuda.context(rank as u32 % cuda.device_count()).unwrap();
    let w = job.worker();
    let mut tag = 0u64;
    for n in [100usize, (4 << 20) + 3] {
        for (sk, sname) in &KINDS {
            for (rk, rname) in &KINDS {
                tag += 1;
                let mut send = AnyBuf::new(sk, gpu, n);
                let mut recv = AnyBuf::new(rk, gpu, n);
                send.write(&pattern(n, rank as u8 ^ tag as u8));
                recv.write(&vec![0xee; n]);
                let known = send.info().expect("rucx::cuda buffers know their memory");
                assert_eq!(known.mem_type.is_gpu(), !matches!(sk, Kind::Pinned));
                let c = w
                    .scope(|s| {
                        let r = match &mut recv {
                            AnyBuf::Device(b) => s.tag_recv(b, tag, TAG_MASK_FULL),
                            AnyBuf::Pool(b) => s.tag_recv(b, tag, TAG_MASK_FULL),
                            AnyBuf::Managed(b) => s.tag_recv(b, tag, TAG_MASK_FULL),
                            AnyBuf::Pinned(b) => s.tag_recv(b, tag, TAG_MASK_FULL),
                        };
                        let sd = match &send {
                            AnyBuf::Device(b) => s.tag_send(to, b, tag),
                            AnyBuf::Pool(b) => s.tag_send(to, b, tag),
                            AnyBuf::Managed(b) => s.tag_send(to, b, tag),
                            AnyBuf::Pinned(b) => s.tag_send(to, b, tag),
                        };
                        sd.wait()?;
                        r.wait()
                    })
                    .unwrap_or_else(|e| panic!("rank {rank}: {sname} -> {rname}, {n} B: {e}"));
                assert_eq!(c.len, n);
                assert!(
                    recv.read(n) == pattern(n, from as u8 ^ tag as u8),
                    "rank {rank}: {sname} -> {rname}, {n} B: data differs"
                );
            }
        }
    }
    // Parts: bytes 1000..1000+m of a device buffer into bytes 64.. of another, the rest of the
    // receive buffer untouched.
    let m = (1 << 20) + 5;
    let mut send = DeviceBuffer::new(gpu, 2 << 20).unwrap();
    let mut recv = DeviceBuffer::new(gpu, 2 << 20).unwrap();
    send.copy_from_host(0, &pattern(2 << 20, rank as u8))
        .unwrap();
    recv.fill(0xee).unwrap();
    w.scope(|s| {
        let r = s.tag_recv(recv.slice_mut(64..64 + m), 999, TAG_MASK_FULL);
        s.tag_send(to, send.slice(1000..1000 + m), 999).wait()?;
        r.wait()
    })
    .unwrap_or_else(|e| panic!("rank {rank}: parts: {e}"));
    let mut got = vec![0u8; 2 << 20];
    recv.copy_to_host(0, &mut got).unwrap();
    assert!(
        got[..64].iter().all(|&b| b == 0xee),
        "written before the part"
    );
    assert!(
        got[64..64 + m] == pattern(2 << 20, from as u8)[1000..1000 + m],
        "rank {rank}: the part differs"
    );
    assert!(
        got[64 + m..].iter().all(|&b| b == 0xee),
        "written after the part"
    );
    let kind = send.mem_ref().info().map(|i| i.mem_type);
    assert_eq!(kind, Some(MemoryType::Cuda));
    println!("rank {rank}: counters {:?}", w.counters());
}

#[test]
fn gpu_buffers_every_kind_without_unsafe() {
    if std::env::var(ROLE).is_ok() {
        return every_kind_both_ways(&Job::from_env().unwrap());
    }
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    two_ranks("gpu_buffers_every_kind_without_unsafe");
}

/// Rank 1 sends device buffers; rank 0 receives them into pinned and pageable host memory and
/// never allocates GPU memory itself. Every rendezvous is read by rank 0 straight out of rank
/// 1's buffer through cuda_ipc (one device-to-host copy), unless `staged` (rank 1's cuda_ipc
/// refuses its device memory): then through staging. Every byte is checked.
fn host_only_receiver(job: &Job, staged: bool) {
    let rank = job.rank();
    let w = job.worker();
    let cuda = rucx::cuda::driver().unwrap();
    let gpu = cuda.context(rank as u32 % cuda.device_count()).unwrap();
    let sizes = [100usize, (4 << 20) + 3, (64 << 20) + 5];
    for (i, &n) in sizes.iter().enumerate() {
        for pinned in [true, false] {
            let tag = 100 + 2 * i as u64 + u64::from(pinned);
            let data = pattern(n, tag as u8);
            if rank == 1 {
                let mut send = DeviceBuffer::new(gpu, n).unwrap();
                send.copy_from_host(0, &data).unwrap();
                w.scope(|s| s.tag_send(job.ep(0), &send, tag).wait())
                    .unwrap_or_else(|e| panic!("rank 1: send {n} B: {e}"));
                continue;
            }
            let got = if pinned {
                let mut b = PinnedHostBuffer::new(gpu, n).unwrap();
                b.as_mut_slice().fill(0xee);
                let c = w
                    .scope(|s| s.tag_recv(&mut b, tag, TAG_MASK_FULL).wait())
                    .unwrap_or_else(|e| panic!("rank 0: pinned receive of {n} B: {e}"));
                assert_eq!(c.len, n);
                b.as_slice().to_vec()
            } else {
                let mut b = vec![0xeeu8; n];
                let c = w
                    .scope(|s| s.tag_recv(&mut b[..], tag, TAG_MASK_FULL).wait())
                    .unwrap_or_else(|e| panic!("rank 0: pageable receive of {n} B: {e}"));
                assert_eq!(c.len, n);
                b
            };
            assert!(got == data, "rank 0: {n} B (pinned {pinned}): data differs");
        }
    }
    let c = w.counters();
    println!("rank {rank}: counters {c:?}");
    if rank == 0 {
        let read = c
            .get("rendezvous receive by read (GPU zero-copy)")
            .copied()
            .unwrap_or(0);
        let pulled = c
            .get("rendezvous receive pipelined through host staging")
            .copied()
            .unwrap_or(0);
        // The two larger sizes are rendezvous for sure, into both kinds of host buffer.
        if staged {
            assert!(read == 0 && pulled >= 4, "{c:?}");
        } else {
            assert!(read >= 4 && pulled == 0, "{c:?}");
        }
    }
}

#[test]
fn a_host_only_receiver_reads_a_gpu_sender_through_cuda_ipc() {
    if std::env::var(ROLE).is_ok() {
        return host_only_receiver(&Job::from_env().unwrap(), false);
    }
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    two_ranks("a_host_only_receiver_reads_a_gpu_sender_through_cuda_ipc");
}

#[test]
fn a_host_only_receiver_of_a_sender_without_cuda_ipc_is_staged() {
    if std::env::var(ROLE).is_ok() {
        return host_only_receiver(&Job::from_env().unwrap(), true);
    }
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    let test = "a_host_only_receiver_of_a_sender_without_cuda_ipc_is_staged";
    let kids = ranks::spawn_with(test, |rank| {
        if rank == 1 {
            vec![(
                "RUCX_FAULT_INJECT".to_string(),
                "md=cuda_ipc,mem=cuda,after=0".to_string(),
            )]
        } else {
            Vec::new()
        }
    });
    for (rank, k) in kids.into_iter().enumerate() {
        let (ok, text) = ranks::finish(k, Duration::from_secs(180));
        println!("--- rank {rank}:\n{text}");
        assert!(ok, "rank {rank} failed:\n{text}");
    }
}
