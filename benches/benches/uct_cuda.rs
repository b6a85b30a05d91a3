//! CUDA transport bandwidth at 64 MiB, each next to its bound measured in the same run:
//!
//! - `cuda_copy` host -> device (`put_zcopy` from pinned host memory to a device buffer) and
//!   device -> host (`get_zcopy` into pinned host memory), against a plain synchronous
//!   `cuMemcpy` between the same two buffers;
//! - `cuda_ipc` GPU 0 -> GPU 1 (`put_zcopy` into a buffer that another process owns on GPU 1)
//!   and GPU 1 -> GPU 0 (`get_zcopy`), against a plain peer copy (`cuMemcpyAsync` between two
//!   `cuMemAlloc` buffers of this process on GPU 0 and GPU 1 with peer access enabled, then a
//!   stream synchronize).
//!
//! Each case alternates bound and transport, one 64 MiB copy at a time (post, then progress
//! until its completion), and reports the median of the timed repetitions (after warm-up) in
//! GB/s and the ratio transport / bound (goal: at least 0.95).
//!
//! This is a plain measurement program (`harness = false`), not a criterion benchmark, because
//! the result is a ratio between two copies measured side by side. Without a CUDA driver it
//! prints why it skipped and exits successfully.
//!
//! Build here: `cargo bench -p rucx-benches --bench uct_cuda --no-run`; run on a GPU machine:
//! `<bench binary> [--iters N]` (default 30 timed repetitions after 5 warm-up ones).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rucx_cuda::{DeviceBuffer, Stream, driver, memcpy, memcpy_async};
use rucx_ucs::{Config, MemoryType};
use rucx_uct::rkey::{Reader, put_lv};
use rucx_uct::{
    Endpoint, EpParams, Event, Iface, IfaceParams, Iov, MemHandle, MemRegion, MemoryDomain,
    OpStatus, RemoteKey,
};
use rucx_uct_cuda_copy::{Allocation, CudaCopyMd};
use rucx_uct_cuda_ipc::CudaIpcMd;

const SIZE: usize = 64 << 20;
const WARMUP: usize = 5;
const ROLE_ENV: &str = "RUCX_BENCH_CUDA_ROLE";

fn config() -> Config {
    Config::new(&[
        rucx_uct::CONFIG,
        rucx_uct_cuda_copy::CONFIG,
        rucx_uct_cuda_ipc::CONFIG,
    ])
    .expect("option tables")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn gbps(d: Duration) -> f64 {
    SIZE as f64 / d.as_secs_f64() / 1e9
}

/// Post one operation and progress until it completes.
fn run_op(
    iface: &mut dyn Iface,
    ep: &mut dyn Endpoint,
    put: bool,
    iov: &[Iov<'_>],
    remote: u64,
    rkey: &RemoteKey,
) {
    let token = 1;
    let st = if put {
        ep.put_zcopy(iov, remote, rkey, token)
    } else {
        ep.get_zcopy(iov, remote, rkey, token)
    }
    .expect("post");
    if st == OpStatus::Done {
        return;
    }
    let mut done = false;
    while !done {
        iface.progress(&mut |ev| match ev {
            Event::Completion { token: 1, result } => {
                result.expect("copy failed");
                done = true;
            }
            other => panic!("unexpected {other:?}"),
        });
    }
}

struct Row {
    name: &'static str,
    bound_name: &'static str,
    bound: Duration,
    tl: Duration,
}

/// Alternate `bound` and `tl` and return their medians.
fn measure(iters: usize, mut bound: impl FnMut(), mut tl: impl FnMut()) -> (Duration, Duration) {
    let mut b = Vec::with_capacity(iters);
    let mut t = Vec::with_capacity(iters);
    for i in 0..WARMUP + iters {
        let s = Instant::now();
        bound();
        let db = s.elapsed();
        let s = Instant::now();
        tl();
        let dt = s.elapsed();
        if i >= WARMUP {
            b.push(db);
            t.push(dt);
        }
    }
    (median(&mut b), median(&mut t))
}

fn open_iface(md: &dyn MemoryDomain, cfg: &Config) -> (Box<dyn Iface>, Box<dyn Endpoint>) {
    let tl = md.tl_resources().remove(0);
    let mut iface = md
        .open_iface(&tl, &IfaceParams { config: cfg })
        .expect("iface");
    let ep = iface
        .create_ep(&EpParams {
            dev_addr: iface.device_address(),
            iface_addr: iface.iface_address(),
            user_id: 0,
        })
        .expect("ep");
    (iface, ep)
}

fn reg(md: &dyn MemoryDomain, r: MemRegion) -> (MemHandle, RemoteKey) {
    // SAFETY: every buffer registered here outlives its handle and key (dropped at the end
    // of the function that made them, before the buffers).
    let h = unsafe { md.mem_reg(r) }.expect("mem_reg");
    let k = md
        .rkey_unpack(&md.mkey_pack(&h).expect("pack"))
        .expect("unpack");
    (h, k)
}

fn cuda_copy_rows(iters: usize, rows: &mut Vec<Row>) {
    let cfg = config();
    let md = CudaCopyMd::open(&cfg).expect("cuda_cpy");
    let ctx = driver().unwrap().context(0).unwrap();
    let host = md.alloc(MemoryType::Host, Some(0), SIZE).expect("pinned");
    let mut dev = md.alloc(MemoryType::Cuda, Some(0), SIZE).expect("device");
    if let Allocation::Device(d) = &mut dev {
        d.fill(7).unwrap();
    }
    let (iface, ep) = open_iface(&md, &cfg);
    let (mut iface, mut ep) = (iface, ep);
    let (hh, _hk) = reg(&md, host.region());
    let (_dh, dk) = reg(&md, dev.region());
    let iov = [Iov::whole(&hh)];
    let (h, d) = (host.addr() as u64, dev.addr() as u64);

    let (b, t) = measure(
        iters,
        // SAFETY: both are live allocations of SIZE bytes that do not overlap.
        || unsafe { memcpy(ctx, d, h, SIZE) }.expect("cuMemcpy"),
        || run_op(iface.as_mut(), ep.as_mut(), true, &iov, d, &dk),
    );
    rows.push(Row {
        name: "cuda_copy put_zcopy host->device",
        bound_name: "cuMemcpy pinned host->device",
        bound: b,
        tl: t,
    });
    let (b, t) = measure(
        iters,
        // SAFETY: as above.
        || unsafe { memcpy(ctx, h, d, SIZE) }.expect("cuMemcpy"),
        || run_op(iface.as_mut(), ep.as_mut(), false, &iov, d, &dk),
    );
    rows.push(Row {
        name: "cuda_copy get_zcopy device->host",
        bound_name: "cuMemcpy device->pinned host",
        bound: b,
        tl: t,
    });
}

/// The owner process of the cuda_ipc case: a 64 MiB buffer on GPU 1, exported; waits for EOF.
fn ipc_owner() {
    let cfg = config();
    let md = CudaIpcMd::open(&cfg).expect("cuda_ipc");
    let ctx = driver().unwrap().context(1).unwrap();
    let mut buf = DeviceBuffer::new(ctx, SIZE).expect("GPU 1 buffer");
    buf.fill(3).unwrap();
    let r = MemRegion {
        addr: buf.ptr() as usize,
        len: SIZE,
        mem_type: MemoryType::Cuda,
        device: Some(1),
    };
    // SAFETY: `buf` outlives the handle (both live until the end of this function).
    let h = unsafe { md.mem_reg(r) }.expect("export");
    let tl = md.tl_resources().remove(0);
    let iface = md.open_iface(&tl, &IfaceParams { config: &cfg }).unwrap();
    let mut a = Vec::new();
    put_lv(&mut a, &iface.device_address());
    put_lv(&mut a, &iface.iface_address());
    println!(
        "KEY {} {} {}",
        hex(&a),
        hex(&md.mkey_pack(&h).unwrap()),
        buf.ptr()
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn cuda_ipc_rows(iters: usize, rows: &mut Vec<Row>) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .env(ROLE_ENV, "ipc-owner")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the owner process");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).expect("owner's key");
    let w: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(w.first(), Some(&"KEY"), "owner said {line:?}");
    let addr = unhex(w[1]);
    let mut r = Reader::new(&addr, "addr");
    let dev_addr = r.lv().unwrap().to_vec();
    let iface_addr = r.lv().unwrap().to_vec();
    let remote: u64 = w[3].parse().unwrap();

    let cfg = config();
    let md = Arc::new(CudaIpcMd::open(&cfg).expect("cuda_ipc"));
    let rkey = md.rkey_unpack(&unhex(w[2])).expect("owner's key");
    let tl = md.tl_resources().remove(0);
    let mut iface = md.open_iface(&tl, &IfaceParams { config: &cfg }).unwrap();
    let mut ep = iface
        .create_ep(&EpParams {
            dev_addr,
            iface_addr,
            user_id: 0,
        })
        .unwrap();
    let drv = driver().unwrap();
    let (c0, c1) = (drv.context(0).unwrap(), drv.context(1).unwrap());
    let mut local = DeviceBuffer::new(c0, SIZE).unwrap();
    local.fill(5).unwrap();
    let (lh, _lk) = reg(md.as_ref(), {
        MemRegion {
            addr: local.ptr() as usize,
            len: SIZE,
            mem_type: MemoryType::Cuda,
            device: Some(0),
        }
    });
    let iov = [Iov::whole(&lh)];

    // The bound: a plain peer copy between two buffers of this process.
    c0.enable_peer_access(c1).unwrap();
    c1.enable_peer_access(c0).unwrap();
    let peer = DeviceBuffer::new(c1, SIZE).unwrap();
    let stream = Stream::new(c0).unwrap();
    let peer_copy = |dst: u64, src: u64| {
        // SAFETY: both are live SIZE-byte device allocations that do not overlap; we wait for
        // the stream before they can go.
        unsafe { memcpy_async(dst, src, SIZE, &stream) }.expect("peer copy");
        stream.synchronize().expect("sync");
    };
    let (b, t) = measure(
        iters,
        || peer_copy(peer.ptr(), local.ptr()),
        || run_op(iface.as_mut(), ep.as_mut(), true, &iov, remote, &rkey),
    );
    rows.push(Row {
        name: "cuda_ipc put_zcopy GPU0->GPU1 (other process)",
        bound_name: "cuMemcpyAsync peer GPU0->GPU1",
        bound: b,
        tl: t,
    });
    let (b, t) = measure(
        iters,
        || peer_copy(local.ptr(), peer.ptr()),
        || run_op(iface.as_mut(), ep.as_mut(), false, &iov, remote, &rkey),
    );
    rows.push(Row {
        name: "cuda_ipc get_zcopy GPU1->GPU0 (other process)",
        bound_name: "cuMemcpyAsync peer GPU1->GPU0",
        bound: b,
        tl: t,
    });
    println!("cuda_ipc cache: {:?}", md.cache_stats());
    drop(child.stdin.take());
    let _ = child.wait();
}

fn main() {
    if std::env::var(ROLE_ENV).as_deref() == Ok("ipc-owner") {
        ipc_owner();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(30usize)
        .max(1);
    let drv = match driver() {
        Ok(d) => d,
        Err(e) => {
            println!("uct_cuda: skipped: {e}");
            return;
        }
    };
    println!(
        "uct_cuda: {} GPU(s), driver API {}, {} MiB per copy, median of {iters} after {WARMUP} warm-up",
        drv.device_count(),
        drv.version_string(),
        SIZE >> 20
    );
    for d in drv.devices() {
        println!("  GPU {}: {} ({})", d.ordinal, d.name, d.pci_bus_id);
    }
    let mut rows = Vec::new();
    cuda_copy_rows(iters, &mut rows);
    if drv.device_count() >= 2 {
        cuda_ipc_rows(iters, &mut rows);
    } else {
        println!("cuda_ipc: skipped (needs 2 GPUs)");
    }
    println!(
        "{:<48} {:>10} | {:<32} {:>10} | {:>6}",
        "transport", "GB/s", "bound", "GB/s", "ratio"
    );
    for r in &rows {
        let ratio = gbps(r.tl) / gbps(r.bound);
        println!(
            "{:<48} {:>10.1} | {:<32} {:>10.1} | {:>6.3}{}",
            r.name,
            gbps(r.tl),
            r.bound_name,
            gbps(r.bound),
            ratio,
            if ratio >= 0.95 { "" } else { "  (below 0.95)" }
        );
    }
}
