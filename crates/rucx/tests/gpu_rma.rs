//! Put and get with GPU memory between two processes (cuda_ipc works between processes only),
//! through the public API with no `unsafe`: each rank maps a device region and a host region,
//! and writes into and reads back from the peer's regions from device, pinned host and
//! pageable host buffers, at an eager-like size and a multi-fragment size; then each rank
//! checks every byte its peer wrote into its own regions.
//!
//! Runs only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver and a GPU (each rank on
//! GPU `rank % device_count`); elsewhere each test prints why it skipped and passes. On the GPU
//! machine: `RUCX_GPU_TESTS=1 <this test binary> --test-threads=1 --nocapture`
//! (`cargo xtask gpu-pack` puts it at `.device/rucx-gpu_rma`).

#![forbid(unsafe_code)]

mod ranks;

use std::time::Duration;

use rucx::cuda::{DeviceBuffer, PinnedHostBuffer};
use rucx::ucp::plan::Op;
use rucx::{EpId, Job, MemoryType, TAG_MASK_FULL, Worker};

/// Which rank has cuda_ipc refuse its device memory (`RUCX_FAULT_INJECT`), if any.
const FAULT_RANK: &str = "RUCX_TEST_FAULT_RANK";

/// Sizes: one small copy, and several 4 MiB fragments plus a tail.
const SIZES: [usize; 2] = [100, (9 << 20) + 3];

/// Slots of a region: one per local buffer kind.
const KINDS: [&str; 3] = ["device", "pinned host", "pageable host"];

/// Both ranks of `test`; `fault` names the rank whose cuda_ipc refuses device memory.
fn two_ranks(test: &str, fault: Option<usize>) {
    let kids = ranks::spawn_with(test, |rank| match fault {
        Some(f) => {
            let mut env = vec![(FAULT_RANK.to_string(), f.to_string())];
            if f == rank {
                env.push((
                    "RUCX_FAULT_INJECT".to_string(),
                    "md=cuda_ipc,mem=cuda,after=0".to_string(),
                ));
            }
            env
        }
        None => Vec::new(),
    });
    for (rank, k) in kids.into_iter().enumerate() {
        let (ok, text) = ranks::finish(k, Duration::from_secs(240));
        println!("--- rank {rank}:\n{text}");
        assert!(ok, "rank {rank} failed:\n{text}");
    }
}

fn send_bytes(w: &Worker, ep: EpId, data: &[u8], tag: u64) {
    w.scope(|s| s.tag_send(ep, data, tag).wait()).unwrap();
}

fn recv_bytes(w: &Worker, tag: u64) -> Vec<u8> {
    let mut b = vec![0u8; 64 << 10];
    let c = w
        .scope(|s| s.tag_recv(&mut b, tag, TAG_MASK_FULL).wait())
        .unwrap();
    b.truncate(c.len);
    b
}

/// Byte `i` of what rank `rank` writes from buffer kind `kind` at size `n`.
fn pattern(n: usize, rank: usize, kind: usize) -> Vec<u8> {
    ranks::pattern(n, 1 + rank * 7 + kind * 131 + n % 97)
}

/// A local buffer of kind `k` holding `data` (or cleared), read back as bytes.
enum Local {
    Device(DeviceBuffer),
    Pinned(PinnedHostBuffer),
    Host(Vec<u8>),
}

impl Local {
    fn new(k: usize, gpu: &'static rucx::cuda::PrimaryContext, data: &[u8]) -> Local {
        match k {
            0 => {
                let mut b = DeviceBuffer::new(gpu, data.len()).unwrap();
                b.copy_from_host(0, data).unwrap();
                Local::Device(b)
            }
            1 => {
                let mut b = PinnedHostBuffer::new(gpu, data.len()).unwrap();
                b.as_mut_slice().copy_from_slice(data);
                Local::Pinned(b)
            }
            _ => Local::Host(data.to_vec()),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Local::Device(b) => {
                let mut v = vec![0u8; b.len()];
                b.copy_to_host(0, &mut v).unwrap();
                v
            }
            Local::Pinned(b) => b.as_slice().to_vec(),
            Local::Host(v) => v.clone(),
        }
    }
}

/// One rank: map, swap keys, put and get against the peer's regions, then check its own.
fn rank_body(job: &Job) {
    let (rank, peer) = (job.rank(), 1 - job.rank());
    let ep = job.ep(peer);
    let w = job.worker();
    let cuda = rucx::cuda::driver().unwrap();
    let gpu = cuda.context(rank as u32 % cuda.device_count()).unwrap();
    let fault = std::env::var(FAULT_RANK)
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    for n in SIZES {
        let len = n * KINDS.len();
        let mut dev = DeviceBuffer::new(gpu, len).unwrap();
        dev.fill(0xee).unwrap();
        let mut host = vec![0xeeu8; len];
        // Shared host memory (posix on this host): the peer's staged device puts and gets
        // copy straight through its mapping of it.
        let mut shared = job.context().mem_alloc(len).unwrap();
        shared.fill(0xee);
        let mapped_dev;
        {
            // Device region: refused where this rank's cuda_ipc is faulty (no other domain
            // exports device memory between processes), with a clear error.
            let dmap = match w.mem_map(&mut dev) {
                Ok(m) => {
                    if fault == Some(rank) {
                        // Another domain may export it (a NIC with GPUDirect), never cuda_ipc.
                        assert!(!m.domains().contains(&"cuda_ipc"), "{m:?}");
                    }
                    assert_eq!(m.mem_type(), MemoryType::Cuda);
                    Some(m)
                }
                Err(e) => {
                    assert_eq!(fault, Some(rank), "rank {rank}: mapping device memory: {e}");
                    assert!(e.to_string().contains("cuda_ipc"), "{e}");
                    None
                }
            };
            mapped_dev = dmap.is_some();
            let hmap = w.mem_map(&mut host).unwrap();
            let smap = w.mem_map(&mut shared[..]).unwrap();
            send_bytes(
                w,
                ep,
                &dmap.as_ref().map(|m| m.pack_rkey()).unwrap_or_default(),
                1,
            );
            send_bytes(w, ep, &hmap.pack_rkey(), 2);
            send_bytes(w, ep, &smap.pack_rkey(), 4);
            let pdev = recv_bytes(w, 1);
            let phost = recv_bytes(w, 2);
            let pshared = recv_bytes(w, 4);
            let mut regions = vec![
                ("host", w.rkey_unpack(ep, &phost).unwrap()),
                ("shared host", w.rkey_unpack(ep, &pshared).unwrap()),
            ];
            if pdev.is_empty() {
                assert_eq!(fault, Some(peer), "the peer mapped no device region");
            } else {
                let k = w.rkey_unpack(ep, &pdev).unwrap();
                assert_eq!(k.mem_type(), MemoryType::Cuda);
                regions.push(("device", k));
            }
            for (rname, rkey) in &regions {
                for (k, kname) in KINDS.iter().enumerate() {
                    let at = rkey.base() + (k * n) as u64;
                    let data = pattern(n, rank, k);
                    let src = Local::new(k, gpu, &data);
                    let mut back = Local::new(k, gpu, &vec![0x11; n]);
                    let what = format!("rank {rank}: {n} B {kname} -> peer {rname}");
                    w.scope(|s| {
                        match &src {
                            Local::Device(b) => s.put(ep, b, at, rkey),
                            Local::Pinned(b) => s.put(ep, b, at, rkey),
                            Local::Host(b) => s.put(ep, b, at, rkey),
                        }
                        .wait()?;
                        s.flush(ep).wait()?;
                        match &mut back {
                            Local::Device(b) => s.get(ep, b, at, rkey),
                            Local::Pinned(b) => s.get(ep, b, at, rkey),
                            Local::Host(b) => s.get(ep, b, at, rkey),
                        }
                        .wait()
                    })
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(back.bytes() == data, "{what}: the get read other bytes");
                }
            }
            // Done writing; wait for the peer to be done with ours.
            send_bytes(w, ep, b"done", 3);
            assert_eq!(recv_bytes(w, 3), b"done");
            drop(dmap);
            drop(hmap);
            drop(smap);
        }
        let mut d = vec![0u8; len];
        dev.copy_to_host(0, &mut d).unwrap();
        for (k, kname) in KINDS.iter().enumerate() {
            let want = pattern(n, peer, k);
            assert!(
                host[k * n..(k + 1) * n] == want[..],
                "rank {rank}: {n} B the peer's {kname} put into my host region differs"
            );
            assert!(
                shared[k * n..(k + 1) * n] == want[..],
                "rank {rank}: {n} B the peer's {kname} put into my shared host region differs"
            );
            if mapped_dev {
                assert!(
                    d[k * n..(k + 1) * n] == want[..],
                    "rank {rank}: {n} B the peer's {kname} put into my device region differs"
                );
            }
        }
    }
    let c = w.counters();
    println!("rank {rank}: counters {c:?}");
    if let Ok(q) = w.path_query(ep, Some(rank as u32 % cuda.device_count())) {
        for p in q.iter().filter(|p| p.op != Op::Tag) {
            println!("rank {rank}: PATH {p}");
        }
    }
    let staged = c
        .get("put staged through pinned host memory")
        .copied()
        .unwrap_or(0);
    let zc = c.get("zero-copy put").copied().unwrap_or(0);
    // Device -> host regions are always staged; device -> device is zero-copy unless this
    // rank's cuda_ipc is faulty (then staged too).
    assert!(staged > 0, "rank {rank}: {c:?}");
    assert!(zc > 0, "rank {rank}: {c:?}");
    // Device -> the peer's shared host region: one copy through the mapping.
    let mapped = c
        .get("staged put/get copied straight to or from the peer's mapped memory")
        .copied()
        .unwrap_or(0);
    assert!(mapped > 0, "rank {rank}: {c:?}");
}

#[test]
fn gpu_put_get_every_pair() {
    if ranks::in_child() {
        return rank_body(&Job::from_env().unwrap());
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    two_ranks("gpu_put_get_every_pair", None);
}

/// Rank 0's cuda_ipc refuses device memory (demoted at its first registration, one warning):
/// its device region cannot be mapped (a clear error), its device puts and gets go through
/// staging, and every byte still arrives.
#[test]
fn gpu_put_get_with_a_cuda_ipc_registration_fault() {
    if ranks::in_child() {
        return rank_body(&Job::from_env().unwrap());
    }
    if let Some(why) = ranks::gpu_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    two_ranks("gpu_put_get_with_a_cuda_ipc_registration_fault", Some(0));
}
