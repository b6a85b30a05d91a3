//! Two processes whose device buffers sit on one GPU (both ranks on GPU 0): the process with
//! the lower worker id issues every copy of both directions (its sends write into the peer's
//! buffer through the peer's cuda_ipc key, its receives read), the other none. Every byte of
//! every size (1 B to several MiB) is checked both ways, a truncated receive reports it and
//! the next message still lands, and with cuda_ipc's registration refused
//! (`RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,after=0`) everything is staged instead.
//!
//! Runs only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver and a GPU; elsewhere each
//! test prints why it skipped and passes.

#![forbid(unsafe_code)]

use rucx::cuda::DeviceBuffer;
use rucx::{Job, TAG_MASK_FULL};

mod ranks;

const SIZES: &[usize] = &[1, 8, 4096, 65_537, 1 << 20, (4 << 20) + 3, (9 << 20) + 5];

const SEND_WRITE: &str = "rendezvous send by remote write on a shared GPU";
const RECV_WRITE: &str = "rendezvous receive by remote write on a shared GPU";
const RECV_READ: &str = "rendezvous receive by read (GPU zero-copy)";

fn dev_with(ctx: &'static rucx::cuda::PrimaryContext, data: &[u8]) -> DeviceBuffer {
    let mut d = DeviceBuffer::new(ctx, data.len().max(1)).unwrap();
    d.copy_from_host(0, data).unwrap();
    d
}

fn dev_read(d: &DeviceBuffer, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    d.copy_to_host(0, &mut v).unwrap();
    v
}

/// Both ranks on GPU 0: every size each way (rank 0 first, then rank 1), every byte checked,
/// the receive buffer's bytes past the message untouched; then a truncated receive each way
/// and a message behind it. Prints the counters and whether this rank copied.
fn both_ways_job(staged: bool) {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let ctx = rucx::cuda::driver().unwrap().context(0).unwrap();
    let rank = job.rank();
    let peer = job.ep(1 - rank);
    let mut tag = 0u64;
    for &n in SIZES {
        for sender in [0, 1] {
            tag += 1;
            let data = ranks::pattern(n, tag as usize);
            if rank == sender {
                let s = dev_with(ctx, &data);
                w.scope(|sc| sc.tag_send(peer, &s, tag).wait())
                    .unwrap_or_else(|e| panic!("rank {rank}: send {n} B: {e}"));
            } else {
                let mut r = dev_with(ctx, &vec![0xee; n + 64]);
                let c = w
                    .scope(|sc| sc.tag_recv(&mut r, tag, TAG_MASK_FULL).wait())
                    .unwrap_or_else(|e| panic!("rank {rank}: receive {n} B: {e}"));
                assert_eq!(c.len, n);
                let got = dev_read(&r, n + 64);
                assert!(
                    got[..n] == data[..],
                    "rank {rank}: {n} B from {sender} differ"
                );
                assert!(
                    got[n..].iter().all(|&b| b == 0xee),
                    "rank {rank}: {n} B from {sender}: written past the message"
                );
            }
        }
    }
    // Truncation: 1 MiB + 7 into 1 MiB, each way; the receiver says so, the sender completes
    // or fails, never hangs, and a message behind it lands whole.
    for sender in [0, 1] {
        let n = (1 << 20) + 7;
        tag += 1;
        if rank == sender {
            let s = dev_with(ctx, &ranks::pattern(n, 7));
            let _ = w.scope(|sc| sc.tag_send(peer, &s, tag).wait());
        } else {
            let mut r = DeviceBuffer::new(ctx, 1 << 20).unwrap();
            let res = w.scope(|sc| sc.tag_recv(&mut r, tag, TAG_MASK_FULL).wait());
            assert!(
                matches!(res, Err(rucx::Error::Truncated { .. })),
                "rank {rank}: {res:?}"
            );
        }
        tag += 1;
        let data = ranks::pattern(4096, 9);
        if rank == sender {
            let s = dev_with(ctx, &data);
            w.scope(|sc| sc.tag_send(peer, &s, tag).wait()).unwrap();
        } else {
            let mut r = DeviceBuffer::new(ctx, 4096).unwrap();
            w.scope(|sc| sc.tag_recv(&mut r, tag, TAG_MASK_FULL).wait())
                .unwrap();
            assert!(dev_read(&r, 4096) == data, "rank {rank}: after truncation");
        }
    }
    let c = w.counters();
    let get = |k: &str| c.get(k).copied().unwrap_or(0);
    let msgs = (SIZES.len() + 2) as u64;
    let copier = get(SEND_WRITE) > 0;
    if staged {
        assert_eq!(
            get(SEND_WRITE) + get(RECV_WRITE) + get(RECV_READ),
            0,
            "rank {rank}: cuda_ipc refused, yet {c:?}"
        );
    } else if copier {
        // Every send written, every receive read by this rank (the truncated one included).
        assert_eq!(get(SEND_WRITE), msgs, "rank {rank}: {c:?}");
        assert_eq!(get(RECV_READ), msgs, "rank {rank}: {c:?}");
        assert_eq!(get(RECV_WRITE), 0, "rank {rank}: {c:?}");
    } else {
        // The peer copies everything: our receives are its writes, our sends its reads.
        assert_eq!(get(RECV_WRITE), msgs, "rank {rank}: {c:?}");
        assert_eq!(get(RECV_READ), 0, "rank {rank}: {c:?}");
    }
    // Exactly one of the two copies.
    let mut flag = [copier as u8];
    let mine = [copier as u8];
    w.scope(|sc| {
        let r = if rank == 0 {
            None
        } else {
            Some(sc.tag_recv(&mut flag[..], 1 << 40, TAG_MASK_FULL))
        };
        if rank == 0 {
            sc.tag_send(peer, &mine[..], 1 << 40).wait()?;
        }
        r.map(|r| r.wait()).transpose()
    })
    .unwrap();
    if rank == 1 && !staged {
        assert_ne!(flag[0] != 0, copier, "both or neither copied: {c:?}");
    }
    job.barrier().unwrap();
    println!("rank {rank}: every byte both ways; copier {copier}; counters {c:?}");
}

fn run(test: &str, env: &[(&str, &str)]) {
    for (r, o) in ranks::run_both(test, "all", env).iter().enumerate() {
        println!("--- rank {r} {env:?}:\n{o}");
    }
}

#[test]
fn gpu_shared_gpu_one_process_copies_every_byte_both_ways() {
    if ranks::in_child() {
        return both_ways_job(false);
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        return println!("skipped: {why}");
    }
    run(
        "gpu_shared_gpu_one_process_copies_every_byte_both_ways",
        &[],
    );
}

#[test]
fn gpu_shared_gpu_with_cuda_ipc_refused_is_staged() {
    if ranks::in_child() {
        return both_ways_job(true);
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        return println!("skipped: {why}");
    }
    run(
        "gpu_shared_gpu_with_cuda_ipc_refused_is_staged",
        &[("RUCX_FAULT_INJECT", "md=cuda_ipc,mem=cuda,after=0")],
    );
}

/// Steady state of small messages on a shared GPU, the CUDA driver calls of each rank counted
/// (`rucx::cuda::calls`) over messages 101-300 of a ping-pong of one pair of buffers (as
/// `rucx-perftest -t tag_lat` runs it): no export, mapping, stream, event or context switch per
/// message, at most one pointer query per registration (one per message sent or received), and
/// the copies all in the copier's process (two per iteration there, none in the other).
fn steady_state_job() {
    use rucx::cuda::calls::{self, Call};
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let ctx = rucx::cuda::driver().unwrap().context(0).unwrap();
    let rank = job.rank();
    let peer = job.ep(1 - rank);
    for n in [8usize, 4096] {
        let s = dev_with(ctx, &ranks::pattern(n, rank + 1));
        let mut r = dev_with(ctx, &vec![0; n]);
        let (warm, iters) = (100, 200);
        let mut before = None;
        let copies_before = w.counters().get(SEND_WRITE).copied().unwrap_or(0);
        for i in 0..warm + iters {
            if i == warm {
                before = Some(calls::snapshot());
            }
            w.scope(|sc| {
                if rank == 0 {
                    sc.tag_send(peer, &s, 7).wait()?;
                    sc.tag_recv(&mut r, 7, TAG_MASK_FULL).wait().map(|_| ())
                } else {
                    sc.tag_recv(&mut r, 7, TAG_MASK_FULL).wait()?;
                    sc.tag_send(peer, &s, 7).wait().map(|_| ())
                }
            })
            .unwrap_or_else(|e| panic!("rank {rank}: {n} B, iteration {i}: {e}"));
        }
        let d = calls::snapshot().since(&before.unwrap());
        let copier = w.counters().get(SEND_WRITE).copied().unwrap_or(0) > copies_before;
        println!(
            "rank {rank} (copier {copier}), {n} B: CUDA driver calls per iteration: {}",
            d.per_unit_line(iters as u64)
        );
        assert!(
            dev_read(&r, n) == ranks::pattern(n, 2 - rank),
            "rank {rank}: {n} B"
        );
        let line = d.per_unit_line(iters as u64);
        for c in [
            Call::cuIpcGetMemHandle,
            Call::cuIpcOpenMemHandle_v2,
            Call::cuIpcCloseMemHandle,
            Call::cuStreamCreate,
            Call::cuEventCreate,
            Call::cuEventDestroy_v2,
            Call::cuCtxSetCurrent,
        ] {
            assert_eq!(d.calls(c), 0, "rank {rank}, {n} B, {}: {line}", c.name());
        }
        assert!(
            d.calls(Call::cuPointerGetAttributes) <= 2 * iters as u64,
            "rank {rank}, {n} B: {line}"
        );
        // Each copy is a copy call, or the copy kernel once it is loaded (on a thread of its
        // own, after the first GPU copy): either way one per message, all in the copier.
        let copies = if copier { 2 * iters as u64 } else { 0 };
        assert_eq!(
            d.calls(Call::cuMemcpyAsync) + d.calls(Call::cuLaunchKernel),
            copies,
            "rank {rank}, {n} B: {line}"
        );
        // Their end is seen through the lanes' completion words: no event is recorded or
        // queried.
        assert_eq!(
            d.calls(Call::cuEventRecord) + d.calls(Call::cuEventQuery),
            0,
            "rank {rank}, {n} B: {line}"
        );
        assert!(
            d.calls(Call::cuStreamWriteValue64_v2) <= d.calls(Call::cuMemcpyAsync),
            "rank {rank}, {n} B: {line}"
        );
        job.barrier().unwrap();
    }
}

#[test]
fn gpu_shared_gpu_small_messages_steady_state_driver_calls() {
    if ranks::in_child() {
        return steady_state_job();
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        return println!("skipped: {why}");
    }
    // No staging made ahead: its helper thread's driver calls would land in the counts.
    run(
        "gpu_shared_gpu_small_messages_steady_state_driver_calls",
        &[("RUCX_RNDV_STAGING_AHEAD", "n")],
    );
}
