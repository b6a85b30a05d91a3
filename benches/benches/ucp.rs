//! UCP-level benchmarks: tag-matched latency and bandwidth through the whole protocol stack
//! (matching, protocol selection, requests), per transport.
//!
//! - `ucp_self/...`: one worker and an endpoint to itself (self transport);
//! - `ucp_posix/...`, `ucp_tcp/...`: two workers, each owned by its own thread (a worker is
//!   not `Sync`), that exchanged addresses through a channel; the peer thread echoes or sinks
//!   what the measuring thread sends. tcp runs over loopback.
//!
//! Benchmarks, per transport:
//! - `tag_lat_roundtrip/<size>`: post a receive, send, wait for the reply (one-way latency is
//!   half of it), 8 B and 4 KiB;
//! - `tag_bw/<size>`: a stream of sends with 16 in flight, acknowledged at the end, 64 KiB
//!   and 1 MiB (throughput in bytes).
//!
//! Run: `cargo bench -p rucx-benches --bench ucp -- --warm-up-time 1 --measurement-time 3`
//! (a filter such as `ucp_posix` selects one transport). `rucx-perftest` measures the same
//! between two processes.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rucx::ucs::Config;
use rucx::{EpId, Request, TAG_MASK_FULL, Worker};

const TAG_PING: u64 = 1;
const TAG_DATA: u64 = 2;
const TAG_ACK: u64 = 3;
const WINDOW: usize = 16;
const LAT_SIZES: [usize; 2] = [8, 4096];
const BW_SIZES: [usize; 2] = [64 << 10, 1 << 20];

/// A worker over one transport (`RUCX_TLS`-style name), or None when it cannot be opened here.
fn worker(tls: &str) -> Option<Worker> {
    let mut cfg = Config::new(&rucx::config_tables()).expect("option tables");
    cfg.set("TLS", tls).expect("a valid RUCX_TLS");
    if tls == "tcp" {
        cfg.set("TCP_IFACES", "lo").expect("a valid interface list");
    }
    let ctx = match rucx::context(cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ucp bench: no context over {tls}: {e}");
            return None;
        }
    };
    match Worker::new(&ctx) {
        Ok(w) => Some(w),
        Err(e) => {
            eprintln!("ucp bench: no worker over {tls}: {e}");
            None
        }
    }
}

/// Idle polls before a waiting thread yields its core (the machine may have fewer free cores
/// than spinning threads; without yielding, a round trip can wait a whole scheduler tick).
const SPINS_BEFORE_YIELD: u32 = 2000;

fn wait(w: &Worker, r: Request<'_>) {
    let t = Instant::now();
    let mut idle = 0u32;
    loop {
        if let Some(res) = r.test() {
            res.expect("request");
            return;
        }
        if w.progress() == 0 {
            idle += 1;
            if idle > SPINS_BEFORE_YIELD {
                assert!(t.elapsed() < Duration::from_secs(60), "request stuck");
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        } else {
            idle = 0;
        }
    }
}

/// What the peer thread does next.
enum Cmd {
    /// Answer `n` pings of `size` bytes.
    Echo {
        n: u64,
        size: usize,
    },
    /// Receive `n` messages of `size` bytes (16 receives posted), then acknowledge.
    Sink {
        n: u64,
        size: usize,
    },
    Stop,
}

/// The peer: a thread owning the other worker.
struct Peer {
    cmd: Sender<Cmd>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    /// Start the peer over `tls`; returns it with the measuring worker and its endpoint.
    fn start(tls: &'static str) -> Option<(Peer, Worker, EpId)> {
        let w = worker(tls)?;
        let (to_peer, peer_in): (Sender<Vec<u8>>, Receiver<Vec<u8>>) = channel();
        let (peer_out, from_peer) = channel::<Option<Vec<u8>>>();
        let (cmd, cmds) = channel::<Cmd>();
        let thread = std::thread::spawn(move || {
            let Some(pw) = worker(tls) else {
                let _ = peer_out.send(None);
                return;
            };
            peer_out.send(Some(pw.address())).expect("bench thread");
            let theirs = peer_in.recv().expect("bench thread address");
            let ep = pw.connect(&theirs).expect("peer connects");
            serve(&pw, ep, &cmds);
        });
        let theirs = from_peer.recv().ok().flatten()?;
        to_peer.send(w.address()).ok()?;
        let ep = w.connect(&theirs).ok()?;
        Some((
            Peer {
                cmd,
                thread: Some(thread),
            },
            w,
            ep,
        ))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.cmd.send(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The peer's loop: progress, and carry out commands.
fn serve(w: &Worker, ep: EpId, cmds: &Receiver<Cmd>) {
    let max = BW_SIZES
        .iter()
        .chain(&LAT_SIZES)
        .copied()
        .max()
        .unwrap_or(8);
    let sbuf = vec![0x5au8; max];
    let mut ring: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0xa5u8; max]).collect();
    loop {
        match cmds.try_recv() {
            Ok(Cmd::Echo { n, size }) => {
                let mut rbuf = vec![0u8; size];
                for _ in 0..n {
                    w.scope(|s| {
                        wait(w, s.tag_recv(&mut rbuf, TAG_PING, TAG_MASK_FULL));
                        wait(w, s.tag_send(ep, &sbuf[..size], TAG_PING));
                    });
                }
            }
            Ok(Cmd::Sink { n, size }) => {
                let mut left = n;
                while left > 0 {
                    let k = (left as usize).min(WINDOW);
                    w.scope(|s| {
                        let reqs: Vec<Request<'_>> = ring
                            .iter_mut()
                            .take(k)
                            .map(|b| s.tag_recv(&mut b[..size], TAG_DATA, TAG_MASK_FULL))
                            .collect();
                        for r in reqs {
                            wait(w, r);
                        }
                    });
                    left -= k as u64;
                }
                w.scope(|s| wait(w, s.tag_send(ep, &[][..], TAG_ACK)));
            }
            Ok(Cmd::Stop) => return,
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                if w.progress() == 0 {
                    std::thread::yield_now();
                }
            }
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
        }
    }
}

/// Ping-pong round trips: `iters` of them, timed.
fn roundtrips(w: &Worker, ep: EpId, size: usize, iters: u64) -> Duration {
    let sbuf = vec![0x11u8; size];
    let mut rbuf = vec![0u8; size];
    let t = Instant::now();
    for _ in 0..iters {
        w.scope(|s| {
            let r = s.tag_recv(&mut rbuf, TAG_PING, TAG_MASK_FULL);
            wait(w, s.tag_send(ep, black_box(&sbuf), TAG_PING));
            wait(w, r);
        });
    }
    t.elapsed()
}

/// A stream of `iters` sends with a window of 16, then the peer's acknowledgement.
fn stream(w: &Worker, ep: EpId, size: usize, iters: u64) -> Duration {
    let sbuf = vec![0x22u8; size];
    let mut ack: Vec<u8> = Vec::new();
    let t = Instant::now();
    let mut left = iters;
    while left > 0 {
        let k = left.min(1024);
        w.scope(|s| {
            let mut q: VecDeque<Request<'_>> = VecDeque::with_capacity(WINDOW);
            for _ in 0..k {
                if q.len() >= WINDOW {
                    wait(w, q.pop_front().expect("window"));
                }
                q.push_back(s.tag_send(ep, &sbuf, TAG_DATA));
            }
            for r in q {
                wait(w, r);
            }
        });
        left -= k;
    }
    w.scope(|s| wait(w, s.tag_recv(&mut ack, TAG_ACK, TAG_MASK_FULL)));
    t.elapsed()
}

fn two_workers(c: &mut Criterion, tls: &'static str) {
    let Some((peer, w, ep)) = Peer::start(tls) else {
        eprintln!("ucp bench: skipping ucp_{tls} (transport unavailable here)");
        return;
    };
    let mut g = c.benchmark_group(format!("ucp_{tls}"));
    for size in LAT_SIZES {
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("tag_lat_roundtrip", size), |b| {
            b.iter_custom(|iters| {
                peer.cmd
                    .send(Cmd::Echo { n: iters, size })
                    .expect("peer alive");
                roundtrips(&w, ep, size, iters)
            })
        });
    }
    for size in BW_SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("tag_bw", size), |b| {
            b.iter_custom(|iters| {
                peer.cmd
                    .send(Cmd::Sink { n: iters, size })
                    .expect("peer alive");
                stream(&w, ep, size, iters)
            })
        });
    }
    g.finish();
    drop(peer);
}

fn ucp_self(c: &mut Criterion) {
    let Some(w) = worker("self") else {
        return;
    };
    let ep = w.connect(&w.address()).expect("endpoint to itself");
    let mut g = c.benchmark_group("ucp_self");
    for size in LAT_SIZES {
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("tag_lat_roundtrip", size), |b| {
            let sbuf = vec![0x33u8; size];
            let mut rbuf = vec![0u8; size];
            b.iter(|| {
                w.scope(|s| {
                    let r = s.tag_recv(&mut rbuf, TAG_PING, TAG_MASK_FULL);
                    wait(&w, s.tag_send(ep, black_box(&sbuf), TAG_PING));
                    wait(&w, r);
                })
            })
        });
    }
    for size in BW_SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("tag_bw", size), |b| {
            let sbuf = vec![0x44u8; size];
            let mut rbuf = vec![0u8; size];
            b.iter(|| {
                w.scope(|s| {
                    let r = s.tag_recv(&mut rbuf, TAG_DATA, TAG_MASK_FULL);
                    wait(&w, s.tag_send(ep, black_box(&sbuf), TAG_DATA));
                    wait(&w, r);
                })
            })
        });
    }
    g.finish();
}

fn ucp_posix(c: &mut Criterion) {
    two_workers(c, "posix");
}

fn ucp_tcp(c: &mut Criterion) {
    two_workers(c, "tcp");
}

criterion_group!(benches, ucp_self, ucp_posix, ucp_tcp);
criterion_main!(benches);
