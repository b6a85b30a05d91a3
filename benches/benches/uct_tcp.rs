//! tcp transport benchmarks over `lo`: two interfaces in one process, the peer progressed by
//! its own thread (so every message crosses the kernel's TCP stack and another core, as
//! between processes).
//!
//! - `tcp/am_short_pingpong/8`: round trip of an active message with its 8-byte header (one-way
//!   latency is half of it); `tcp/am_short_pingpong_1thread/8`: the same with both sides
//!   progressed by one thread (a steadier figure on a busy machine); `..._2conn...`: the same
//!   with the two endpoints created at once, so each direction has its own connection;
//! - `tcp/am_bcopy_bw/<size>` and `tcp/am_zcopy_bw/<size>`: streaming active messages, the
//!   receiver reading every cache line of each message;
//! - `tcp/put_zcopy_bw/<size>`: remote writes with up to 16 in flight, each complete when the
//!   peer acknowledged it, 8 B to 1 MiB.
//!
//! Run: `cargo bench -p rucx-benches --bench uct_tcp -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rucx_ucs::Config;
use rucx_uct::conformance::{Side, ep_params_from_hex};
use rucx_uct::iface::pack_bytes;
use rucx_uct::{
    Component, Endpoint, Event, IfaceParams, Iov, MemRegion, OpStatus, RemoteKey, TlResource,
};
use rucx_uct_tcp::TcpComponent;

const AM_PING: u8 = 1;
const AM_PONG: u8 = 2;
const AM_DATA: u8 = 3;
/// Size of the peer's buffer exposed for puts.
const TARGET: usize = 1 << 20;

fn open_side() -> Side {
    let cfg = Config::new(&[rucx_uct::CONFIG, rucx_uct_tcp::CONFIG]).expect("option tables");
    let md = TcpComponent.open_md("tcp", &cfg).expect("tcp domain");
    let tl = TlResource {
        tl_name: "tcp".into(),
        dev_name: "lo".into(),
    };
    let iface = md
        .open_iface(&tl, &IfaceParams { config: &cfg })
        .expect("tcp interface on lo");
    Side { md, iface }
}

/// Endpoints both ways between `a` and `b`. `shared`: wired up as UCP does when one side
/// starts (the second side creates its endpoint after the first side's message arrived), so
/// they share one connection; else both are created at once, as when both sides start
/// together, and each direction has its own connection.
fn connect_pair(
    a: &mut Side,
    b: &mut Side,
    shared: bool,
) -> (Box<dyn Endpoint>, Box<dyn Endpoint>) {
    let mut ab = a
        .iface
        .create_ep(&ep_params_from_hex(&b.address_hex(), 1).unwrap())
        .unwrap();
    let mut early = (!shared).then(|| {
        b.iface
            .create_ep(&ep_params_from_hex(&a.address_hex(), 2).unwrap())
            .unwrap()
    });
    ab.am_short(AM_DATA, 0, b"wire-up").unwrap();
    if let Some(ba) = early.as_mut() {
        ba.am_short(AM_DATA, 0, b"wire-up").unwrap();
    }
    let (mut at_a, mut at_b) = (shared, false);
    while !(at_a && at_b) {
        a.iface
            .progress(&mut |ev| at_a |= matches!(ev, Event::Am { id: AM_DATA, .. }));
        b.iface
            .progress(&mut |ev| at_b |= matches!(ev, Event::Am { id: AM_DATA, .. }));
    }
    let ba = early.unwrap_or_else(|| {
        b.iface
            .create_ep(&ep_params_from_hex(&a.address_hex(), 2).unwrap())
            .unwrap()
    });
    (ab, ba)
}

/// A peer interface progressed by its own thread; it answers pings, counts data messages and
/// exposes a registered buffer for puts.
struct Peer {
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
    rkey: RemoteKey,
    base: u64,
}

impl Peer {
    /// Start the peer; returns it and an endpoint from `local` to it (see [`connect_pair`] for
    /// `shared`).
    fn start(local: &mut Side, shared: bool) -> (Peer, Box<dyn Endpoint>) {
        let mut remote = open_side();
        let (to_remote, mut back) = connect_pair(local, &mut remote, shared);
        let target = vec![0u8; TARGET];
        // SAFETY: `target` moves into the peer thread together with the handle, and the thread
        // drops it explicitly after the handle (and after the interface serving puts into it).
        let memh = unsafe { remote.md.mem_reg(MemRegion::of_slice(&target)) }.unwrap();
        let rkey = local
            .md
            .rkey_unpack(&remote.md.mkey_pack(&memh).unwrap())
            .unwrap();
        let base = target.as_ptr() as u64;
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let (s, r) = (stop.clone(), received.clone());
        let thread = std::thread::spawn(move || {
            let mut pongs = 0u64;
            while !s.load(Ordering::Relaxed) {
                remote.iface.progress(&mut |ev| match ev {
                    Event::Am { id: AM_PING, .. } => pongs += 1,
                    Event::Am { id: AM_DATA, data } => {
                        black_box(data.iter().step_by(64).fold(0u8, |a, b| a ^ b));
                        r.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                });
                while pongs > 0 {
                    match back.am_short(AM_PONG, 0, &[]) {
                        Ok(()) => pongs -= 1,
                        Err(e) if e.is_retryable() => break,
                        Err(e) => panic!("pong: {e}"),
                    }
                }
            }
            drop(back);
            drop(memh);
            drop(remote);
            drop(target);
        });
        (
            Peer {
                stop,
                received,
                thread: Some(thread),
                rkey,
                base,
            },
            to_remote,
        )
    }

    /// Wait until the peer has received `n` data messages in total, progressing `local`.
    fn wait_received(&self, local: &mut Side, n: u64) {
        let t = Instant::now();
        while self.received.load(Ordering::Relaxed) < n {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "peer stopped receiving"
            );
            local.iface.progress(&mut |_| {});
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
    pingpong(c, "am_short_pingpong", true);
    pingpong(c, "am_short_pingpong_2conn", false);
}

fn pingpong(c: &mut Criterion, name: &str, shared: bool) {
    let mut local = open_side();
    let (peer, mut ep) = Peer::start(&mut local, shared);
    let mut g = c.benchmark_group("tcp");
    g.bench_function(BenchmarkId::new(name, 8), |b| {
        b.iter(|| {
            while let Err(e) = ep.am_short(AM_PING, black_box(0x1234), &[]) {
                assert!(e.is_retryable(), "{e}");
                local.iface.progress(&mut |_| {});
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

/// The same round trip with both interfaces progressed by one thread: no scheduler in the
/// way, so it is a steadier figure on a busy machine (the two sides' work adds up).
fn am_short_pingpong_one_thread(c: &mut Criterion) {
    pingpong_one_thread(c, "am_short_pingpong_1thread", true);
    pingpong_one_thread(c, "am_short_pingpong_2conn_1thread", false);
}

fn pingpong_one_thread(c: &mut Criterion, name: &str, shared: bool) {
    let mut a = open_side();
    let mut b = open_side();
    let (mut ab, mut ba) = connect_pair(&mut a, &mut b, shared);
    let mut g = c.benchmark_group("tcp");
    g.bench_function(BenchmarkId::new(name, 8), |bench| {
        bench.iter(|| {
            ab.am_short(AM_PING, black_box(0x1234), &[]).unwrap();
            let mut got = false;
            while !got {
                b.iface
                    .progress(&mut |ev| got |= matches!(ev, Event::Am { id: AM_PING, .. }));
            }
            ba.am_short(AM_PONG, 0, &[]).unwrap();
            let mut got = false;
            while !got {
                a.iface
                    .progress(&mut |ev| got |= matches!(ev, Event::Am { id: AM_PONG, .. }));
            }
        })
    });
    g.finish();
}

fn am_bw(c: &mut Criterion) {
    let mut local = open_side();
    let (peer, mut ep) = Peer::start(&mut local, true);
    let mut sent = 0u64;
    let mut g = c.benchmark_group("tcp");
    for size in [64usize, 1024, 8192] {
        let data = vec![0x5au8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("am_bcopy_bw", size), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    loop {
                        match ep.am_bcopy(AM_DATA, &mut pack_bytes(&data)) {
                            Ok(_) => break,
                            Err(e) if e.is_retryable() => local.iface.progress(&mut |_| {}),
                            Err(e) => panic!("{e}"),
                        };
                    }
                }
                sent += iters;
                peer.wait_received(&mut local, sent);
                start.elapsed()
            })
        });
    }
    let buf = vec![0xa5u8; 64 * 1024];
    // SAFETY: `buf` outlives the handle (both dropped at the end of this function, handle first).
    let memh = unsafe { local.md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
    for size in [1024usize, 8192, 65536] {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("am_zcopy_bw", size), |b| {
            b.iter_custom(|iters| {
                let iov = [Iov {
                    addr: buf.as_ptr() as usize,
                    len: size,
                    memh: &memh,
                }];
                let start = Instant::now();
                let mut outstanding = 0u64;
                for i in 0..iters {
                    loop {
                        match ep.am_zcopy(AM_DATA, &[], &iov, i) {
                            Ok(OpStatus::Done) => break,
                            Ok(OpStatus::InProgress) => {
                                outstanding += 1;
                                break;
                            }
                            Err(e) if e.is_retryable() => local.iface.progress(&mut |ev| {
                                if matches!(ev, Event::Completion { .. }) {
                                    outstanding -= 1
                                }
                            }),
                            Err(e) => panic!("{e}"),
                        };
                    }
                }
                while outstanding > 0 {
                    local.iface.progress(&mut |ev| {
                        if matches!(ev, Event::Completion { .. }) {
                            outstanding -= 1
                        }
                    });
                }
                sent += iters;
                peer.wait_received(&mut local, sent);
                start.elapsed()
            })
        });
    }
    g.finish();
    drop(memh);
    drop(peer);
}

fn put_zcopy_bw(c: &mut Criterion) {
    const WINDOW: u64 = 16;
    let mut local = open_side();
    let (peer, mut ep) = Peer::start(&mut local, true);
    let buf = vec![0x3cu8; TARGET];
    // SAFETY: `buf` outlives the handle (both dropped at the end of this function, handle first).
    let memh = unsafe { local.md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
    let mut g = c.benchmark_group("tcp");
    for size in [8usize, 4096, 65536, 1 << 20] {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("put_zcopy_bw", size), |b| {
            b.iter_custom(|iters| {
                let iov = [Iov {
                    addr: buf.as_ptr() as usize,
                    len: size,
                    memh: &memh,
                }];
                let mut in_flight = 0u64;
                let start = Instant::now();
                for i in 0..iters {
                    loop {
                        if in_flight < WINDOW {
                            match ep.put_zcopy(&iov, peer.base, &peer.rkey, i) {
                                Ok(OpStatus::Done) => break,
                                Ok(OpStatus::InProgress) => {
                                    in_flight += 1;
                                    break;
                                }
                                Err(e) if e.is_retryable() => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                        local.iface.progress(&mut |ev| match ev {
                            Event::Completion { result, .. } => {
                                result.unwrap();
                                in_flight -= 1;
                            }
                            other => panic!("{other:?}"),
                        });
                    }
                }
                while in_flight > 0 {
                    local.iface.progress(&mut |ev| {
                        if let Event::Completion { result, .. } = ev {
                            result.unwrap();
                            in_flight -= 1;
                        }
                    });
                }
                start.elapsed()
            })
        });
    }
    g.finish();
    drop(memh);
    drop(peer);
}

criterion_group!(
    benches,
    am_short_pingpong,
    am_short_pingpong_one_thread,
    am_bw,
    put_zcopy_bw
);
criterion_main!(benches);
