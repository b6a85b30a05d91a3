//! Active messages and streams with GPU buffers between two processes, through the public API
//! (no `unsafe`): payloads in device memory on both sides, device <-> host both ways, copied in
//! (small) and by rendezvous fetched by the receiver (large), a dropped descriptor, and the
//! byte stream from and into device memory in uneven pieces; every byte checked. With
//! `RUCX_FAULT_INJECT` in the environment (e.g. `md=cuda_ipc,mem=cuda,after=0`), the same runs
//! demoted through the staged pipeline.
//!
//! Runs only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver and a GPU; elsewhere each
//! test prints why it skipped and passes. On the GPU machine:
//! `RUCX_GPU_TESTS=1 <this test binary> --test-threads=1 --nocapture` (`cargo xtask gpu-pack`
//! names it `rucx-gpu_am_stream`). Each rank uses GPU `rank % device_count`.

#![forbid(unsafe_code)]

mod ranks;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rucx::cuda::DeviceBuffer;
use rucx::{EpId, Error, Job, Memory, MemoryType, Worker};

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// Run this test's rank body in two child processes (with `extra` environment); panic with
/// their output if one fails.
fn two_ranks(test: &str, extra: &[(&str, &str)]) {
    let outs = ranks::run_both(test, "all", extra);
    for (rank, text) in outs.iter().enumerate() {
        println!("--- rank {rank}:\n{text}");
    }
}

/// A buffer on the GPU or the host, filled and read through host copies.
enum Buf {
    Dev(DeviceBuffer),
    Host(Vec<u8>),
}

impl Buf {
    fn new(gpu: bool, ctx: &'static rucx::cuda::PrimaryContext, n: usize) -> Buf {
        if gpu {
            let mut d = DeviceBuffer::new(ctx, n.max(1)).unwrap();
            d.fill(0xee).unwrap();
            Buf::Dev(d)
        } else {
            Buf::Host(vec![0xee; n])
        }
    }

    fn write(&mut self, data: &[u8]) {
        match self {
            Buf::Dev(d) => d.copy_from_host(0, data).unwrap(),
            Buf::Host(v) => v[..data.len()].copy_from_slice(data),
        }
    }

    fn read(&self, n: usize) -> Vec<u8> {
        match self {
            Buf::Dev(d) => {
                let mut out = vec![0u8; n];
                d.copy_to_host(0, &mut out).unwrap();
                out
            }
            Buf::Host(v) => v[..n].to_vec(),
        }
    }

    fn send(&self, n: usize) -> rucx::SendBuf<'_> {
        match self {
            Buf::Dev(d) => d.slice(..n).into(),
            Buf::Host(v) => (&v[..n]).into(),
        }
    }

    fn recv(&mut self, n: usize) -> rucx::RecvBuf<'_> {
        match self {
            Buf::Dev(d) => d.slice_mut(..n).into(),
            Buf::Host(v) => (&mut v[..n]).into(),
        }
    }
}

type Inbox = Arc<Mutex<VecDeque<rucx::AmMessage>>>;

fn inbox(w: &Worker, id: u16) -> Inbox {
    let inbox: Inbox = Arc::default();
    let keep = inbox.clone();
    w.set_am_handler(id, move |_, m| keep.lock().unwrap().push_back(m));
    inbox
}

fn next(w: &Worker, inbox: &Inbox) -> rucx::AmMessage {
    let start = Instant::now();
    loop {
        if let Some(m) = inbox.lock().unwrap().pop_front() {
            return m;
        }
        w.progress();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no active message came"
        );
    }
}

fn am_and_streams(job: &Job) {
    let (rank, size) = (job.rank(), job.size());
    let to: EpId = job.ep((rank + 1) % size);
    let from = (rank + size - 1) % size;
    let cuda = rucx::cuda::driver().unwrap();
    let ctx = cuda.context(rank as u32 % cuda.device_count()).unwrap();
    let w = job.worker();
    let data = inbox(w, 1);
    let mut case = 0u64;
    // Active messages: every pair of memories, small (copied in) and large (rendezvous).
    for n in [100usize, 60_000, (4 << 20) + 3, 64 << 20] {
        for (sg, rg) in [(true, true), (true, false), (false, true), (false, false)] {
            case += 1;
            let mut send = Buf::new(sg, ctx, n);
            send.write(&pattern(n, case * 10 + rank as u64));
            let mut recv = Buf::new(rg, ctx, n);
            let what = format!("rank {rank}: am {n} B gpu {sg} -> gpu {rg}");
            w.scope(|s| {
                let sent = s.am_send(to, 1, &case.to_le_bytes(), send.send(n));
                let mut m = next(w, &data);
                assert_eq!(m.header, case.to_le_bytes(), "{what}");
                assert_eq!(m.len(), n, "{what}");
                if let Some(r) = &m.remote {
                    let want = if sg {
                        MemoryType::Cuda
                    } else {
                        MemoryType::Host
                    };
                    assert_eq!(r.mem_type(), want, "{what}");
                }
                let got = s.am_recv_data(m.take_payload(), recv.recv(n));
                let r = rucx::wait_all(&[&sent, &got]);
                for x in r {
                    x.unwrap_or_else(|e| panic!("{what}: {e}"));
                }
            });
            assert!(
                recv.read(n) == pattern(n, case * 10 + from as u64),
                "{what}: data differs"
            );
        }
    }
    // A descriptor dropped unfetched releases its sender.
    let dropped = inbox(w, 2);
    let send = Buf::new(true, ctx, 8 << 20);
    let r = w.scope(|s| {
        let sent = s.am_send(to, 2, b"", send.send(8 << 20));
        let m = next(w, &dropped);
        assert!(m.is_remote());
        drop(m);
        sent.wait()
    });
    match r {
        Err(Error::PeerAborted { reason, .. }) => assert!(reason.contains("dropped"), "{reason}"),
        other => panic!("rank {rank}: dropped descriptor: {other:?}"),
    }
    // Streams: device -> device and host <-> device, pieces of uneven sizes.
    for (sg, rg) in [(true, true), (true, false), (false, true)] {
        case += 1;
        let total = (16 << 20) + 7;
        let all = pattern(total, case * 10 + rank as u64);
        let cuts = [0, 3, 70_000, (1 << 20) + 1, total];
        let mut sends: Vec<Buf> = cuts
            .windows(2)
            .map(|c| {
                let mut b = Buf::new(sg, ctx, c[1] - c[0]);
                b.write(&all[c[0]..c[1]]);
                b
            })
            .collect();
        let rcuts = [0, 1, 9_000, 5 << 20, total];
        let mut recvs: Vec<Buf> = rcuts
            .windows(2)
            .map(|c| Buf::new(rg, ctx, c[1] - c[0]))
            .collect();
        let what = format!("rank {rank}: stream gpu {sg} -> gpu {rg}");
        w.scope(|s| {
            let mut reqs = Vec::new();
            for (b, c) in recvs.iter_mut().zip(rcuts.windows(2)) {
                reqs.push(s.stream_recv(to, b.recv(c[1] - c[0])));
            }
            for (b, c) in sends.iter_mut().zip(cuts.windows(2)) {
                reqs.push(s.stream_send(to, b.send(c[1] - c[0])));
            }
            let refs: Vec<_> = reqs.iter().collect();
            for x in rucx::wait_all(&refs) {
                x.unwrap_or_else(|e| panic!("{what}: {e}"));
            }
        });
        let want = pattern(total, case * 10 + from as u64);
        let mut got = Vec::new();
        for (b, c) in recvs.iter().zip(rcuts.windows(2)) {
            got.extend_from_slice(&b.read(c[1] - c[0]));
        }
        assert!(got == want, "{what}: data differs");
    }
    println!("rank {rank}: counters {:?}", w.counters());
    println!("rank {rank}: demotions {:?}", w.context_demotions());
}

#[test]
fn gpu_active_messages_and_streams() {
    if ranks::in_child() {
        return am_and_streams(&Job::from_env().unwrap());
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    two_ranks("gpu_active_messages_and_streams", &[]);
}

/// The same with the GPU zero-copy lane refusing every registration of device memory: the
/// rendezvous payloads go through the staged pipeline after the demotion.
#[test]
fn gpu_active_messages_and_streams_demoted() {
    if ranks::in_child() {
        return am_and_streams(&Job::from_env().unwrap());
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    two_ranks(
        "gpu_active_messages_and_streams_demoted",
        &[("RUCX_FAULT_INJECT", "md=cuda_ipc,mem=cuda,after=0")],
    );
}
