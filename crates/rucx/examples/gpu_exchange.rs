//! The seed program with GPU buffers: two ranks exchange device (or host) buffers through
//! rucx, verify every byte, and report which protocol carried them and how fast.
//!
//! Each rank uses GPU `rank % device_count`. Options:
//! `--send-mem cuda|cuda-pool|host` (cuda-pool: a stream-ordered pool allocation, which legacy
//! CUDA IPC cannot export, so the zero-copy path is demoted at run time), `--recv-mem cuda|host`,
//! `--sizes LIST` (default `1,4097,1M,64M+1,256M`), `--bw-size BYTES` (default 64M),
//! `--iters K` (default 10), `--bounds` (also measure a plain pinned host->device copy and a
//! plain peer copy in the same run, and print the ratios), `--min-ratio X` (with `--bounds`:
//! fail unless the bandwidth reaches X times the peer-copy bound, or the host->device bound on
//! one GPU).
//!
//! Failure scenarios: `--recv-cap BYTES` (receive buffers of the size list hold only this many
//! bytes: a larger message must end with a truncation error on the receiver, a completed send,
//! and the part that fits delivered), `--allow-error` (a transfer of the size list may end with
//! an error, e.g. injected registration failures with no path left: the rank reports it with
//! the time it took and stops there, successfully; no hang is the point), `--warmup-mem MEM`
//! (first move one 1 MiB message from a MEM buffer, e.g. `cuda-pool`, which `cuda_ipc` refuses,
//! then the size list as usual), `--bw-size 0` (no bandwidth part). The run ends by listing the
//! protocols used, the domain demotions and the buffers refused without a demotion.
//!
//! Launch like `exchange` (`RUCX_RANK`, `RUCX_SIZE`, `RUCX_BOOTSTRAP`, or mpirun).

use std::process::ExitCode;
use std::time::Instant;

use rucx::ucp::{RecvBuf, SendBuf};
use rucx::{Job, Memory, TAG_MASK_FULL};
use rucx_cuda::{DeviceBuffer, PinnedHostBuffer, PoolBuffer, PrimaryContext, Stream};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mem {
    Cuda,
    CudaPool,
    Host,
}

fn parse_mem(s: &str) -> Result<Mem, String> {
    match s {
        "cuda" => Ok(Mem::Cuda),
        "cuda-pool" => Ok(Mem::CudaPool),
        "host" => Ok(Mem::Host),
        o => Err(format!(
            "unknown memory {o:?}; accepted: cuda, cuda-pool, host"
        )),
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (base, plus) = match s.split_once('+') {
        Some((b, p)) => (b, p.parse::<usize>().map_err(|e| format!("{s}: {e}"))?),
        None => (s, 0),
    };
    match rucx::ucs::units::parse_memunits(base)? {
        rucx::ucs::MemUnits::Bytes(b) => Ok(b as usize + plus),
        _ => Err(format!("{s}: not a byte count")),
    }
}

/// A buffer in host or device memory.
enum Buf {
    Host(Vec<u8>),
    Dev(DeviceBuffer),
    Pool { buf: PoolBuffer, _stream: Stream },
}

impl Buf {
    fn new(mem: Mem, ctx: &'static PrimaryContext, n: usize) -> Result<Buf, String> {
        Ok(match mem {
            Mem::Host => Buf::Host(vec![0u8; n]),
            Mem::Cuda => Buf::Dev(DeviceBuffer::new(ctx, n.max(1)).map_err(|e| e.to_string())?),
            Mem::CudaPool => {
                let st = Stream::new(ctx).map_err(|e| e.to_string())?;
                let b = PoolBuffer::new(&st, n.max(1)).map_err(|e| e.to_string())?;
                st.synchronize().map_err(|e| e.to_string())?;
                Buf::Pool {
                    buf: b,
                    _stream: st,
                }
            }
        })
    }

    fn fill(&mut self, data: &[u8]) -> Result<(), String> {
        match self {
            Buf::Host(v) => v.copy_from_slice(data),
            Buf::Dev(d) => d.copy_from_host(0, data).map_err(|e| e.to_string())?,
            Buf::Pool { buf: p, .. } => p.copy_from_host(0, data).map_err(|e| e.to_string())?,
        }
        Ok(())
    }

    fn read(&self, n: usize) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; n];
        match self {
            Buf::Host(v) => out.copy_from_slice(&v[..n]),
            Buf::Dev(d) => d.copy_to_host(0, &mut out).map_err(|e| e.to_string())?,
            Buf::Pool { buf: p, .. } => p.copy_to_host(0, &mut out).map_err(|e| e.to_string())?,
        }
        Ok(out)
    }

    fn send_buf(&self, n: usize) -> SendBuf<'_> {
        match self {
            Buf::Host(v) => SendBuf::from(&v[..n]),
            Buf::Dev(d) => d.slice(..n).into(),
            Buf::Pool { buf: p, .. } => p.slice(..n).into(),
        }
    }

    fn recv_buf(&mut self, n: usize) -> RecvBuf<'_> {
        match self {
            Buf::Host(v) => RecvBuf::from(&mut v[..n]),
            Buf::Dev(d) => d.slice_mut(..n).into(),
            Buf::Pool { buf: p, .. } => p.slice_mut(..n).into(),
        }
    }
}

fn pattern(rank: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(131) ^ (rank * 17) ^ (i >> 13)) as u8)
        .collect()
}

struct Args {
    send: Mem,
    recv: Mem,
    sizes: Vec<usize>,
    bw: usize,
    iters: usize,
    bounds: bool,
    oneway: bool,
    recv_cap: Option<usize>,
    allow_error: bool,
    warmup: Option<Mem>,
    min_ratio: Option<f64>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        send: Mem::Cuda,
        recv: Mem::Cuda,
        sizes: ["1", "4097", "1M", "64M+1", "256M"]
            .iter()
            .map(|s| parse_size(s))
            .collect::<Result<_, _>>()?,
        bw: 64 << 20,
        iters: 10,
        bounds: false,
        oneway: false,
        recv_cap: None,
        allow_error: false,
        warmup: None,
        min_ratio: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--send-mem" => a.send = parse_mem(&v()?)?,
            "--recv-mem" => a.recv = parse_mem(&v()?)?,
            "--sizes" => a.sizes = v()?.split(',').map(parse_size).collect::<Result<_, _>>()?,
            "--bw-size" => a.bw = parse_size(&v()?)?,
            "--iters" => a.iters = v()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--bounds" => a.bounds = true,
            "--oneway" => a.oneway = true,
            "--recv-cap" => a.recv_cap = Some(parse_size(&v()?)?),
            "--allow-error" => a.allow_error = true,
            "--warmup-mem" => a.warmup = Some(parse_mem(&v()?)?),
            "--min-ratio" => {
                a.min_ratio = Some(v()?.parse().map_err(|e| format!("--min-ratio: {e}"))?)
            }
            o => return Err(format!("unknown argument {o:?}")),
        }
    }
    Ok(a)
}

/// GB/s of `iters` copies of `n` bytes.
fn gbs(n: usize, iters: usize, secs: f64) -> f64 {
    (n * iters) as f64 / secs / 1e9
}

fn bounds(
    ctx: &'static PrimaryContext,
    peer: Option<&'static PrimaryContext>,
    n: usize,
    iters: usize,
) -> Result<(f64, Option<f64>), String> {
    let e = |e: rucx::Error| e.to_string();
    let host = PinnedHostBuffer::new(ctx, n).map_err(e)?;
    let dev = DeviceBuffer::new(ctx, n).map_err(e)?;
    let stream = Stream::new(ctx).map_err(e)?;
    // Time `iters` copies queued on one stream, waiting for all of them.
    let timed = |dst: u64, src: u64| -> Result<f64, String> {
        // SAFETY: `dst` and `src` are live allocations of at least `n` bytes owned by the
        // caller for the whole measurement, and the stream is synchronized before returning.
        unsafe { rucx_cuda::memcpy_async(dst, src, n, &stream) }.map_err(e)?;
        stream.synchronize().map_err(e)?;
        let t = Instant::now();
        for _ in 0..iters {
            // SAFETY: as above.
            unsafe { rucx_cuda::memcpy_async(dst, src, n, &stream) }.map_err(e)?;
        }
        stream.synchronize().map_err(e)?;
        Ok(gbs(n, iters, t.elapsed().as_secs_f64()))
    };
    let h2d = timed(dev.ptr(), host.ptr())?;
    let p2p = match peer {
        Some(pctx) => {
            let other = DeviceBuffer::new(pctx, n).map_err(e)?;
            ctx.enable_peer_access(pctx).map_err(e)?;
            ctx.bind().map_err(e)?;
            Some(timed(other.ptr(), dev.ptr())?)
        }
        None => None,
    };
    Ok((h2d, p2p))
}

fn run() -> Result<(), String> {
    let a = args()?;
    let drv = rucx_cuda::driver().map_err(|e| e.to_string())?;
    let job = Job::from_env().map_err(|e| e.to_string())?;
    let (rank, size) = (job.rank(), job.size());
    let ndev = drv.device_count().max(1);
    let dev = (rank as u32) % ndev;
    let ctx = drv.context(dev).map_err(|e| e.to_string())?;
    ctx.bind().map_err(|e| e.to_string())?;
    let w = job.worker();
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    let to = job.ep(next);
    let from = job.ep(prev);
    let (am, rma) = w.lanes(to).map_err(|e| e.to_string())?;
    println!(
        "rank {rank}: GPU {dev} of {ndev}; {:?} -> {:?}; transports {}; lanes: am {am}, rma {}",
        a.send,
        a.recv,
        w.transports().join(", "),
        rma.unwrap_or_else(|| "-".into())
    );
    if let Some(m) = a.warmup {
        // One message from a buffer of another kind first (e.g. a pool buffer cuda_ipc
        // refuses): whatever happens to it must not change the path of the buffers after it.
        let n = 1 << 20;
        let mut sb = Buf::new(m, ctx, n)?;
        let mut rb = Buf::new(a.recv, ctx, n)?;
        sb.fill(&pattern(rank, n))?;
        ctx.synchronize().map_err(|e| e.to_string())?;
        let t = Instant::now();
        w.scope(|s| {
            let r = s.tag_recv(rb.recv_buf(n), 99, TAG_MASK_FULL);
            s.tag_send(to, sb.send_buf(n), 99).wait()?;
            r.wait()
        })
        .map_err(|e| format!("rank {rank}: warm-up from {m:?}: {e}"))?;
        if rb.read(n)? != pattern(prev, n) {
            return Err(format!(
                "rank {rank}: warm-up from {m:?}: data received wrong"
            ));
        }
        println!(
            "rank {rank}: warm-up {n} bytes from {m:?} verified ({:.3} ms); protocols so far: {:?}",
            t.elapsed().as_secs_f64() * 1e3,
            w.counters()
        );
        job.barrier().map_err(|e| e.to_string())?;
    }
    let mut ended = None;
    for (k, &n) in a.sizes.iter().enumerate() {
        let cap = a.recv_cap.map_or(n, |c| c.min(n));
        let mut sb = Buf::new(a.send, ctx, n)?;
        let mut rb = Buf::new(a.recv, ctx, cap)?;
        sb.fill(&pattern(rank, n))?;
        rb.fill(&vec![0xa5; cap])?;
        // Like any CUDA-aware MPI, rucx sends what is in the buffer now: writes queued on other
        // streams (a pageable cuMemcpy may still be in flight) must be finished first.
        ctx.synchronize().map_err(|e| e.to_string())?;
        let tag = 100 + k as u64;
        let t = Instant::now();
        let (sent, got) = w.scope(|s| {
            let r = s.tag_recv(rb.recv_buf(cap), tag, TAG_MASK_FULL);
            let sent = s.tag_send(to, sb.send_buf(n), tag).wait();
            (sent, recv_from(w, r, from))
        });
        let el = t.elapsed();
        let outcome = match (sent, got) {
            (Ok(_), Ok(_)) if cap == n => Ok(()),
            (
                Ok(_),
                Err(rucx::Error::Truncated {
                    incoming,
                    capacity,
                    tag: t,
                }),
            ) if cap < n && incoming == n && capacity == cap && t == Some(tag) => {
                println!(
                    "rank {rank}: {n} bytes into a {cap}-byte buffer: truncated as expected, send complete ({:.3} ms)",
                    el.as_secs_f64() * 1e3
                );
                Ok(())
            }
            (Ok(_), Ok(c)) => Err(format!(
                "{n} bytes into a {cap}-byte buffer: completed with {} bytes, expected a truncation error",
                c.len
            )),
            (s, r) => Err(format!(
                "{n} bytes: send: {}; receive: {}",
                s.map_or_else(|e| e.to_string(), |_| "ok".into()),
                r.map_or_else(|e| e.to_string(), |_| "ok".into())
            )),
        };
        if let Err(e) = outcome {
            if a.allow_error {
                println!(
                    "rank {rank}: ended with an error after {:.3} ms: {e}",
                    el.as_secs_f64() * 1e3
                );
                ended = Some(e);
                break;
            }
            return Err(format!("rank {rank}: {e}"));
        }
        let got = rb.read(cap)?;
        let want = pattern(prev, n);
        if got[..] != want[..cap] {
            let bad = got.iter().zip(&want).position(|(x, y)| x != y);
            let show = |v: &[u8]| format!("{:02x?}", &v[..v.len().min(16)]);
            return Err(format!(
                "rank {rank}: {n} bytes: data received wrong (first bad byte {bad:?}); got {} want {}",
                show(&got),
                show(&want)
            ));
        }
        println!(
            "rank {rank}: {n} bytes verified ({:.3} ms)",
            el.as_secs_f64() * 1e3
        );
        if let Err(e) = job.barrier() {
            if a.allow_error {
                // The peer stopped at an error of its own.
                println!("rank {rank}: ended with an error: barrier: {e}");
                ended = Some(e.to_string());
                break;
            }
            return Err(e.to_string());
        }
    }
    if ended.is_some() || a.bw == 0 {
        if ended.is_none() {
            println!("rank {rank}: all sizes verified");
        }
        report(rank, &job);
        return Ok(());
    }
    println!("rank {rank}: all sizes verified");
    // Bandwidth, the first transfer timed on its own (it may demote and re-plan).
    let mut sb = Buf::new(a.send, ctx, a.bw)?;
    let mut rb = Buf::new(a.recv, ctx, a.bw)?;
    sb.fill(&pattern(rank, a.bw))?;
    ctx.synchronize().map_err(|e| e.to_string())?;
    // The first transfer on its own (it may demote and re-plan), then the steady ones back to
    // back with no barrier between them (a barrier's skew would be timed too).
    let (do_send, do_recv) = if a.oneway {
        (rank == 0, rank == 1)
    } else {
        (true, true)
    };
    let mut one = |tag: u64| -> Result<(), String> {
        w.scope(|s| {
            let r = do_recv.then(|| s.tag_recv(rb.recv_buf(a.bw), tag, TAG_MASK_FULL));
            if do_send {
                s.tag_send(to, sb.send_buf(a.bw), tag).wait()?;
            }
            match r {
                Some(r) => recv_from(w, r, from).map(|_| ()),
                None => Ok(()),
            }
        })
        .map_err(|e| format!("rank {rank}: bandwidth tag {tag}: {e}"))
    };
    job.barrier().map_err(|e| e.to_string())?;
    let t = Instant::now();
    one(5000)?;
    let first = t.elapsed().as_secs_f64();
    job.barrier().map_err(|e| e.to_string())?;
    let t = Instant::now();
    for i in 1..=a.iters {
        one(5000 + i as u64)?;
    }
    let steady = t.elapsed().as_secs_f64();
    let times = [first];
    if (!a.oneway || rank == 1) && rb.read(a.bw)? != pattern(prev, a.bw) {
        return Err(format!("rank {rank}: bandwidth data received wrong"));
    }
    let bw = gbs(a.bw, a.iters, steady);
    println!(
        "rank {rank}: {} MiB x {}: {bw:.2} GB/s per direction ({}); first transfer {:.3} ms, steady {:.3} ms",
        a.bw >> 20,
        a.iters,
        if a.oneway {
            "rank 0 -> rank 1 only"
        } else {
            "both directions at once"
        },
        times[0] * 1e3,
        steady / a.iters as f64 * 1e3
    );
    if a.bounds && rank == 0 {
        job.barrier().map_err(|e| e.to_string())?;
        let peer = if ndev > 1 {
            Some(drv.context(1).map_err(|e| e.to_string())?)
        } else {
            None
        };
        let (h2d, p2p) = bounds(ctx, peer, a.bw, a.iters)?;
        println!(
            "rank 0: bound pinned host->device copy {h2d:.2} GB/s; ratio {:.3}",
            bw / h2d
        );
        if let Some(p) = p2p {
            println!(
                "rank 0: bound peer copy GPU0->GPU1 {p:.2} GB/s; ratio {:.3}",
                bw / p
            );
        }
        if let Some(min) = a.min_ratio {
            let (what, bound) = match p2p {
                Some(p) => ("peer copy", p),
                None => ("host->device copy", h2d),
            };
            if bw / bound < min {
                report(rank, &job);
                return Err(format!(
                    "rank 0: {bw:.2} GB/s is {:.3} of the {what} bound ({bound:.2} GB/s), below --min-ratio {min}",
                    bw / bound
                ));
            }
        }
    } else if a.bounds {
        job.barrier().map_err(|e| e.to_string())?;
    }
    report(rank, &job);
    Ok(())
}

/// The protocols that ran, the domain demotions and the buffers refused without one.
fn report(rank: usize, job: &Job) {
    let c = job.worker().counters();
    println!(
        "rank {rank}: protocols: {}",
        c.iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for d in job.context().demotions() {
        println!("rank {rank}: demotion: {d} ({})", d.knob);
    }
    for r in job.context().refusals() {
        println!("rank {rank}: refused buffer: {r} ({})", r.knob);
    }
}

/// Wait for a receive whose message only rank `from` sends. A tag receive, which any peer
/// could match, does not end when one peer fails; a peer that gave up (it ended with an error
/// of its own and exited) never sends, so give up too once its endpoint failed (what an MPI
/// job's launcher does by ending the job). A message that arrived before the failure is still
/// taken: the progress that reports the failure has delivered everything before it.
fn recv_from(
    w: &rucx::Worker,
    r: rucx::ucp::Request<'_>,
    from: rucx::EpId,
) -> rucx::Result<rucx::Completion> {
    loop {
        w.progress();
        if let Some(res) = r.test() {
            return res;
        }
        if let Some(reason) = w.ep_error(from) {
            return Err(rucx::Error::EndpointFailure {
                peer: format!("the sending rank ({from:?})"),
                reason: format!("{reason}; the receive cannot be matched any more"),
            });
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_exchange: {e}");
            ExitCode::FAILURE
        }
    }
}
