//! posix transport benchmarks: two interfaces in one process, the peer progressed by its own
//! thread (so every message crosses cores through the shared ring, as between processes).
//!
//! - `posix/am_short_pingpong/8`: round trip of an 8-byte active message (one-way latency is
//!   half of it);
//! - `posix/am_bcopy_bw/<size>` and `posix/am_zcopy_bw/<size>`: streaming active messages up to
//!   one ring cell (8 KiB cells: 8160 bytes), the receiver thread counting messages without
//!   reading their payload (as `ucx_perftest -t am_bw` does, so the figures compare);
//! - `posix/put_zcopy_bw/<size>`: cross-memory-attach writes, 8 B to 1 MiB.
//!
//! Run: `cargo bench -p rucx-benches --bench uct_posix -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rucx_ucs::Config;
use rucx_uct::conformance::{Side, ep_params_from_hex};
use rucx_uct::iface::pack_bytes;
use rucx_uct::{Component, Endpoint, Event, IfaceParams, Iov, MemRegion, TlResource};
use rucx_uct_posix::PosixComponent;

const AM_PING: u8 = 1;
const AM_PONG: u8 = 2;
const AM_DATA: u8 = 3;
/// Empty polls before a spinning thread yields its core: on this 2-core machine the two
/// benchmark threads may share a core with other work, and a spinner would hold it for a whole
/// time slice. Far above the fast path, so quiet runs never yield.
const SPINS_BEFORE_YIELD: u32 = 10_000;

fn open_side() -> Side {
    let cfg = Config::new(&[rucx_uct::CONFIG, rucx_uct_posix::CONFIG]).expect("option tables");
    let md = PosixComponent.open_md("posix", &cfg).expect("posix domain");
    let tl = TlResource {
        tl_name: "posix".into(),
        dev_name: "memory".into(),
    };
    let iface = md
        .open_iface(&tl, &IfaceParams { config: &cfg })
        .expect("posix interface");
    Side { md, iface }
}

/// A peer interface progressed by its own thread; it answers pings and counts data messages.
struct Peer {
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    /// Start the peer; returns it and an endpoint from `local` to it.
    fn start(local: &mut Side) -> (Peer, Box<dyn Endpoint>) {
        let mut remote = open_side();
        let to_remote = local
            .iface
            .create_ep(&ep_params_from_hex(&remote.address_hex(), 1).unwrap())
            .unwrap();
        let mut back = remote
            .iface
            .create_ep(&ep_params_from_hex(&local.address_hex(), 2).unwrap())
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let (s, r) = (stop.clone(), received.clone());
        let thread = std::thread::spawn(move || {
            let mut pongs = 0u64;
            let mut idle = 0u32;
            while !s.load(Ordering::Relaxed) {
                let n = remote.iface.progress(&mut |ev| match ev {
                    Event::Am { id: AM_PING, .. } => pongs += 1,
                    Event::Am { id: AM_DATA, .. } => {
                        r.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                });
                idle = if n == 0 { idle + 1 } else { 0 };
                if idle > SPINS_BEFORE_YIELD {
                    std::thread::yield_now();
                }
                while pongs > 0 {
                    match back.am_short(AM_PONG, 0, &[]) {
                        Ok(()) => pongs -= 1,
                        Err(e) if e.is_retryable() => break,
                        Err(e) => panic!("pong: {e}"),
                    }
                }
            }
        });
        (
            Peer {
                stop,
                received,
                thread: Some(thread),
            },
            to_remote,
        )
    }

    /// Wait until the peer has received `n` data messages in total.
    fn wait_received(&self, n: u64) {
        let t = Instant::now();
        while self.received.load(Ordering::Relaxed) < n {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "peer stopped receiving"
            );
            std::hint::spin_loop();
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn am_short_pingpong(c: &mut Criterion) {
    let mut local = open_side();
    let (peer, mut ep) = Peer::start(&mut local);
    let mut g = c.benchmark_group("posix");
    g.bench_function(BenchmarkId::new("am_short_pingpong", 8), |b| {
        b.iter(|| {
            while let Err(e) = ep.am_short(AM_PING, black_box(0x1234), &[]) {
                assert!(e.is_retryable(), "{e}");
            }
            let mut got = false;
            while !got {
                local
                    .iface
                    .progress(&mut |ev| got |= matches!(ev, Event::Am { id: AM_PONG, .. }));
            }
        })
    });
    g.finish();
    drop(peer);
}

fn send_stream(
    local: &mut Side,
    ep: &mut dyn Endpoint,
    peer: &Peer,
    sent: &mut u64,
    iters: u64,
    mut one: impl FnMut(&mut dyn Endpoint) -> bool,
) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        let mut spins = 0u32;
        while !one(ep) {
            local.iface.progress(&mut |_| {});
            spins += 1;
            if spins > SPINS_BEFORE_YIELD {
                std::thread::yield_now();
            }
        }
    }
    *sent += iters;
    peer.wait_received(*sent);
    start.elapsed()
}

fn am_bw(c: &mut Criterion) {
    let mut local = open_side();
    let (peer, mut ep) = Peer::start(&mut local);
    let lim = local.iface.attr().limits;
    let mut sent = 0u64;
    let mut g = c.benchmark_group("posix");
    for size in [8usize, 64, 512, 4096, lim.am_max_bcopy] {
        let data = vec![0x5au8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("am_bcopy_bw", size), &size, |b, _| {
            b.iter_custom(|iters| {
                send_stream(
                    &mut local,
                    ep.as_mut(),
                    &peer,
                    &mut sent,
                    iters,
                    |ep| match ep.am_bcopy(AM_DATA, &mut pack_bytes(&data)) {
                        Ok(_) => true,
                        Err(e) if e.is_retryable() => false,
                        Err(e) => panic!("am_bcopy: {e}"),
                    },
                )
            })
        });
    }
    for size in [8usize, 512, 4096, lim.am_max_zcopy] {
        let data = vec![0x5au8; size];
        // SAFETY: `data` outlives the handle (both dropped at the end of this iteration).
        let memh = unsafe { local.md.mem_reg(MemRegion::of_slice(&data)) }.unwrap();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("am_zcopy_bw", size), &size, |b, _| {
            b.iter_custom(|iters| {
                let iov = [Iov::whole(&memh)];
                send_stream(
                    &mut local,
                    ep.as_mut(),
                    &peer,
                    &mut sent,
                    iters,
                    |ep| match ep.am_zcopy(AM_DATA, &[], &iov, 0) {
                        Ok(_) => true,
                        Err(e) if e.is_retryable() => false,
                        Err(e) => panic!("am_zcopy: {e}"),
                    },
                )
            })
        });
    }
    g.finish();
    drop(peer);
}

fn put_zcopy_bw(c: &mut Criterion) {
    let mut local = open_side();
    let (peer, mut ep) = Peer::start(&mut local);
    const MAX: usize = 1 << 20;
    let target = vec![0u8; MAX];
    // SAFETY: `target` outlives the handle and the key (all dropped at the end of the function).
    let tmemh = unsafe { local.md.mem_reg(MemRegion::of_slice(&target)) }.unwrap();
    let rkey = local
        .md
        .rkey_unpack(&local.md.mkey_pack(&tmemh).unwrap())
        .unwrap();
    // The endpoint reaches the peer interface, so the key must be the peer process's: both
    // interfaces live in this process, which is what the key names.
    let source = vec![0xa5u8; MAX];
    // SAFETY: `source` outlives the handle.
    let smemh = unsafe { local.md.mem_reg(MemRegion::of_slice(&source)) }.unwrap();
    let mut g = c.benchmark_group("posix");
    for size in [8usize, 64, 512, 4096, 32 << 10, 256 << 10, MAX] {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("put_zcopy_bw", size), &size, |b, &size| {
            let iov = [Iov {
                addr: source.as_ptr() as usize,
                len: size,
                memh: &smemh,
            }];
            b.iter(|| {
                ep.put_zcopy(&iov, target.as_ptr() as u64, &rkey, 0)
                    .unwrap();
            })
        });
    }
    g.finish();
    drop(peer);
}

criterion_group!(benches, am_short_pingpong, am_bw, put_zcopy_bw);
criterion_main!(benches);
