//! `rucx-perftest --floors`: what this machine allows, measured by plain code with no rucx in
//! the way, so that every rucx figure can be read as a ratio to its floor.
//!
//! - **cache line**: one 64-byte line bounced between two processes through shared memory
//!   (the parent writes an odd count, the child answers with the next even one); one way is
//!   half a round trip. The floor of a small shared-memory message.
//! - **memcpy**: one core copying a buffer of each benchmark size into another
//!   (`copy_from_slice`, the C library's `memcpy`), repeated; the floor of a shared-memory
//!   bandwidth test, where every byte is copied at least once.
//! - **tcp stream**: one loopback TCP connection, a sender thread writing 1 MiB at a time with
//!   blocking writes, a receiver thread reading into a 1 MiB buffer.
//! - **tcp ping-pong**: one loopback connection, `TCP_NODELAY`, both threads polling their
//!   non-blocking socket; one way is half a round trip.
//!
//! Each figure is the median of several batches (a batch: many repetitions timed together),
//! so one disturbed batch on a shared machine does not move it; the best batch is printed too.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::stats::{MB, median};

/// Result type: printable errors.
pub type R<T> = std::result::Result<T, String>;

/// Sizes of the memcpy floor: the shared-memory bandwidth sizes of `rucx-bench-compare` and
/// one far past the last-level cache.
pub const MEMCPY_SIZES: [usize; 4] = [64 << 10, 1 << 20, 4 << 20, 64 << 20];

/// Sizes of the tcp ping-pong floor: the latency sizes of `rucx-bench-compare`.
pub const TCP_LAT_SIZES: [usize; 4] = [8, 256, 4 << 10, 64 << 10];

/// Write size of the tcp stream floor.
pub const TCP_STREAM_WRITE: usize = 1 << 20;

/// A figure measured in batches: the median batch and the best one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Batches {
    /// Median over the batches.
    pub median: f64,
    /// Best batch (lowest latency, highest bandwidth).
    pub best: f64,
    /// How many batches.
    pub batches: usize,
}

impl Batches {
    /// From per-batch values; `lower_is_better` for latencies.
    pub fn of(values: &[f64], lower_is_better: bool) -> R<Batches> {
        let m = median(values).ok_or("no batch measured")?;
        let finite = values.iter().copied().filter(|x| x.is_finite());
        let best = if lower_is_better {
            finite.fold(f64::INFINITY, f64::min)
        } else {
            finite.fold(0.0, f64::max)
        };
        Ok(Batches {
            median: m,
            best,
            batches: values.len(),
        })
    }
}

/// A floor at one message size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AtSize {
    /// Message (or copy) size in bytes.
    pub size: usize,
    /// The figure: MB/s (2^20 bytes) for bandwidth, microseconds one way for latency.
    pub value: Batches,
}

/// Every floor of this machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Floors {
    /// CPU model and count.
    pub machine: String,
    /// One cache line bounced between two processes: one-way latency, microseconds.
    pub cacheline_us: Batches,
    /// Single-core memcpy, MB/s (2^20 bytes), by size.
    pub memcpy_mbs: Vec<AtSize>,
    /// One loopback TCP stream with 1 MiB writes, MB/s.
    pub tcp_stream_mbs: Batches,
    /// Loopback TCP ping-pong, one-way microseconds, by size.
    pub tcp_lat_us: Vec<AtSize>,
}

/// The entry of `v` whose size is nearest to `size` (on a log scale); `None` if `v` is empty.
pub fn nearest(v: &[AtSize], size: usize) -> Option<&AtSize> {
    let d = |a: usize| ((a.max(1) as f64).ln() - (size.max(1) as f64).ln()).abs();
    v.iter().min_by(|a, b| d(a.size).total_cmp(&d(b.size)))
}

impl Floors {
    /// The floor of a rucx figure, and what it is: shared-memory latency is the cache line
    /// plus one copy of the message at the memcpy rate of its size; shared-memory bandwidth
    /// the memcpy rate; tcp latency the ping-pong of the nearest size; tcp bandwidth the
    /// stream. `transport` is `shm` or `tcp`, `test` `tag_lat` (microseconds) or `tag_bw`
    /// (MB/s).
    pub fn floor_for(&self, transport: &str, test: &str, size: usize) -> Option<f64> {
        match (transport, test) {
            ("shm", "tag_lat") => {
                let copy = nearest(&self.memcpy_mbs, size)?.value.median;
                Some(self.cacheline_us.median + size as f64 / (copy * MB) * 1e6)
            }
            ("shm", "tag_bw") => Some(nearest(&self.memcpy_mbs, size)?.value.median),
            ("tcp", "tag_lat") => Some(nearest(&self.tcp_lat_us, size)?.value.median),
            ("tcp", "tag_bw") => Some(self.tcp_stream_mbs.median),
            _ => None,
        }
    }

    /// The human-readable table.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Floors of this machine ({}): plain code, no rucx; median of the batches (best in brackets)",
            self.machine
        );
        let _ = writeln!(s, "  {:<44} {:>6}  {:>22}", "floor", "size", "figure");
        let _ = writeln!(
            s,
            "  {:<44} {:>6}  {:>10.3} us ({:.3})",
            "cache line ping-pong, 2 processes, one way",
            64,
            self.cacheline_us.median,
            self.cacheline_us.best
        );
        for m in &self.memcpy_mbs {
            let _ = writeln!(
                s,
                "  {:<44} {:>6}  {:>10.0} MB/s ({:.0}) = {:.2} GB/s",
                "memcpy, one core",
                crate::plot::size_label(m.size as f64),
                m.value.median,
                m.value.best,
                m.value.median * MB / 1e9
            );
        }
        let _ = writeln!(
            s,
            "  {:<44} {:>6}  {:>10.0} MB/s ({:.0}) = {:.2} GB/s",
            "tcp loopback stream, 1 MiB writes",
            crate::plot::size_label(TCP_STREAM_WRITE as f64),
            self.tcp_stream_mbs.median,
            self.tcp_stream_mbs.best,
            self.tcp_stream_mbs.median * MB / 1e9
        );
        for l in &self.tcp_lat_us {
            let _ = writeln!(
                s,
                "  {:<44} {:>6}  {:>10.3} us ({:.3})",
                "tcp loopback ping-pong, polling, one way",
                crate::plot::size_label(l.size as f64),
                l.value.median,
                l.value.best
            );
        }
        s
    }
}

/// How long to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Effort {
    /// Batches per figure.
    pub batches: usize,
    /// Round trips per cache-line batch.
    pub line_round_trips: u64,
    /// Bytes per memcpy batch (at least two copies).
    pub memcpy_bytes: usize,
    /// Bytes per tcp stream batch.
    pub stream_bytes: usize,
    /// Round trips per tcp ping-pong batch of small messages (fewer for 64 KiB).
    pub tcp_round_trips: usize,
}

impl Effort {
    /// The default: a few seconds in all.
    pub const FULL: Effort = Effort {
        batches: 7,
        line_round_trips: 100_000,
        memcpy_bytes: 256 << 20,
        stream_bytes: 256 << 20,
        tcp_round_trips: 4_000,
    };
    /// For tests and `--quick`: a fraction of a second each.
    pub const QUICK: Effort = Effort {
        batches: 3,
        line_round_trips: 10_000,
        memcpy_bytes: 32 << 20,
        stream_bytes: 32 << 20,
        tcp_round_trips: 500,
    };
}

/// Measure every floor. `self_cmd` starts this program again (the cache line's second process
/// runs it with `--floors-child FILE`).
pub fn measure(self_cmd: &[OsString], effort: Effort, progress: bool) -> R<Floors> {
    let say = |what: &str| {
        if progress {
            eprintln!("[rucx-perftest] floors: {what}");
        }
    };
    say("cache line ping-pong");
    let cacheline_us = cacheline(self_cmd, effort)?;
    say("memcpy");
    let memcpy_mbs = MEMCPY_SIZES
        .iter()
        .map(|&size| {
            Ok(AtSize {
                size,
                value: memcpy(size, effort)?,
            })
        })
        .collect::<R<Vec<_>>>()?;
    say("tcp stream");
    let tcp_stream_mbs = tcp_stream(effort)?;
    say("tcp ping-pong");
    let tcp_lat_us = TCP_LAT_SIZES
        .iter()
        .map(|&size| {
            Ok(AtSize {
                size,
                value: tcp_pingpong(size, effort)?,
            })
        })
        .collect::<R<Vec<_>>>()?;
    Ok(Floors {
        machine: machine(),
        cacheline_us,
        memcpy_mbs,
        tcp_stream_mbs,
        tcp_lat_us,
    })
}

/// CPU model and count, from /proc/cpuinfo.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let n = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {n} CPUs")
}

// ---- cache line -------------------------------------------------------------------------

/// Offsets in the shared page: the bounced counter, and (a line of its own) the child's
/// ready flag.
const COUNTER: usize = 0;
const READY: usize = 128;
/// Written by the parent to tell the child to exit.
const STOP: u64 = u64::MAX;
/// Round trips per timed batch of the cache-line floor.
const LINE_BATCH: u64 = 100;
/// A child that sees no change for this long exits (it never waits forever).
const CHILD_PATIENCE: Duration = Duration::from_secs(10);

/// A page of shared memory backed by a file in /dev/shm (or the temp directory).
struct SharedPage {
    map: memmap2::MmapMut,
}

impl SharedPage {
    fn open(path: &Path, create: bool) -> R<SharedPage> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(create)
            .open(path)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        if create {
            f.set_len(4096)
                .map_err(|e| format!("sizing {}: {e}", path.display()))?;
        }
        // SAFETY: the file is ours (created with a unique name by the parent, opened by its
        // child); both processes access the page only through the atomics of `word`, so
        // concurrent changes through the other mapping are not undefined behavior here.
        let map = unsafe { memmap2::MmapMut::map_mut(&f) }
            .map_err(|e| format!("mapping {}: {e}", path.display()))?;
        if map.len() < 4096 {
            return Err(format!("{}: shorter than a page", path.display()));
        }
        Ok(SharedPage { map })
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(64) && off + 8 <= self.map.len());
        // SAFETY: the mapping is page-aligned and at least a page long, so `off` (a multiple
        // of 64 inside it) is aligned for and holds a u64; it lives as long as `self`; every
        // access from either process is atomic.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }
}

fn shared_path() -> PathBuf {
    let dir = Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    dir.join(format!("rucx-floors-{}-{nanos}", std::process::id()))
}

/// The child's side of the cache-line ping-pong (`rucx-perftest --floors-child FILE`):
/// answer every odd count with the next even one until told to stop.
pub fn cacheline_child(path: &Path) -> R<()> {
    let page = SharedPage::open(path, false)?;
    let (counter, ready) = (page.word(COUNTER), page.word(READY));
    ready.store(1, Ordering::Release);
    let mut seen = 0;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let v = counter.load(Ordering::Acquire);
        if v == STOP {
            return Ok(());
        }
        if !v.is_multiple_of(2) {
            counter.store(v + 1, Ordering::Release);
            continue;
        }
        // Check the clock now and then only: the loop is the measurement.
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(65536) {
            if v != seen {
                seen = v;
                idle_since = Instant::now();
            } else if idle_since.elapsed() > CHILD_PATIENCE {
                return Err("the parent stopped bouncing the line".into());
            }
        }
    }
}

fn cacheline(self_cmd: &[OsString], effort: Effort) -> R<Batches> {
    let path = shared_path();
    let page = SharedPage::open(&path, true)?;
    let (exe, lead) = self_cmd
        .split_first()
        .ok_or("no command to start the second process")?;
    let child = Command::new(exe)
        .args(lead)
        .arg("--floors-child")
        .arg(&path)
        .stdin(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(format!("starting the second process: {e}"));
        }
    };
    let res = (|| {
        let (counter, ready) = (page.word(COUNTER), page.word(READY));
        let start = Instant::now();
        while ready.load(Ordering::Acquire) == 0 {
            if start.elapsed() > Duration::from_secs(20) {
                return Err("the second process did not map the line".to_string());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut v = 0u64;
        let mut bounce = |n: u64| -> R<Duration> {
            let t = Instant::now();
            for _ in 0..n {
                counter.store(v + 1, Ordering::Release);
                let want = v + 2;
                let mut spins = 0u32;
                while counter.load(Ordering::Acquire) != want {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(65536) && t.elapsed() > Duration::from_secs(60) {
                        return Err("the second process stopped answering".to_string());
                    }
                }
                v = want;
            }
            Ok(t.elapsed())
        };
        bounce(effort.line_round_trips / 10 + 1)?;
        // Many short batches: a batch the scheduler disturbed is one of many, and the median
        // is the undisturbed figure.
        let per_batch = LINE_BATCH.min(effort.line_round_trips);
        let batches = (effort.line_round_trips / per_batch) as usize * effort.batches;
        let mut per = Vec::with_capacity(batches);
        for _ in 0..batches {
            let d = bounce(per_batch)?;
            per.push(d.as_secs_f64() * 1e6 / (2.0 * per_batch as f64));
        }
        counter.store(STOP, Ordering::Release);
        Batches::of(&per, true)
    })();
    if res.is_err() {
        page.word(COUNTER).store(STOP, Ordering::Release);
    }
    let _ = std::fs::remove_file(&path);
    let st = child.wait().map_err(|e| format!("second process: {e}"))?;
    let b = res?;
    if !st.success() {
        return Err(format!("the second process exited with {st}"));
    }
    Ok(b)
}

// ---- memcpy -----------------------------------------------------------------------------

fn memcpy(size: usize, effort: Effort) -> R<Batches> {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    let copies = (effort.memcpy_bytes / size.max(1)).max(2);
    dst.copy_from_slice(&src);
    let mut per = Vec::new();
    for _ in 0..effort.batches {
        let t = Instant::now();
        for _ in 0..copies {
            std::hint::black_box(&mut dst).copy_from_slice(std::hint::black_box(&src));
        }
        let d = t.elapsed().as_secs_f64();
        per.push((copies * size) as f64 / d / MB);
    }
    std::hint::black_box(&dst);
    Batches::of(&per, false)
}

// ---- tcp --------------------------------------------------------------------------------

fn tcp_pair() -> R<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("tcp listen: {e}"))?;
    let addr = l.local_addr().map_err(|e| format!("tcp listen: {e}"))?;
    let a = TcpStream::connect(addr).map_err(|e| format!("tcp connect: {e}"))?;
    let (b, _) = l.accept().map_err(|e| format!("tcp accept: {e}"))?;
    for s in [&a, &b] {
        s.set_nodelay(true)
            .map_err(|e| format!("TCP_NODELAY: {e}"))?;
    }
    Ok((a, b))
}

fn tcp_stream(effort: Effort) -> R<Batches> {
    let (mut tx, mut rx) = tcp_pair()?;
    let batch = effort.stream_bytes.max(TCP_STREAM_WRITE);
    let batches = effort.batches;
    let receiver = std::thread::spawn(move || -> R<()> {
        let mut buf = vec![0u8; TCP_STREAM_WRITE];
        for _ in 0..=batches {
            let mut got = 0;
            while got < batch {
                match rx.read(&mut buf) {
                    Ok(0) => return Err("tcp stream: the sender closed early".into()),
                    Ok(n) => got += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(format!("tcp stream read: {e}")),
                }
            }
            // The batch is in: tell the sender.
            rx.write_all(&[1])
                .map_err(|e| format!("tcp stream ack: {e}"))?;
        }
        Ok(())
    });
    let buf = vec![0x5au8; TCP_STREAM_WRITE];
    let mut per = Vec::new();
    let res = (|| {
        // One batch of warm-up, then the measured ones.
        for i in 0..=batches {
            let t = Instant::now();
            let mut sent = 0;
            while sent < batch {
                let n = TCP_STREAM_WRITE.min(batch - sent);
                tx.write_all(&buf[..n])
                    .map_err(|e| format!("tcp stream write: {e}"))?;
                sent += n;
            }
            let mut ack = [0u8; 1];
            tx.read_exact(&mut ack)
                .map_err(|e| format!("tcp stream ack: {e}"))?;
            if i > 0 {
                per.push(batch as f64 / t.elapsed().as_secs_f64() / MB);
            }
        }
        Ok::<(), String>(())
    })();
    drop(tx);
    let r = receiver
        .join()
        .map_err(|_| "tcp stream: the receiver panicked".to_string())?;
    res?;
    r?;
    Batches::of(&per, false)
}

/// Write all of `buf` to a non-blocking socket, polling.
fn spin_write(s: &mut TcpStream, mut buf: &[u8]) -> R<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err("tcp ping-pong: connection closed".into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(format!("tcp ping-pong write: {e}")),
        }
    }
    Ok(())
}

/// True when `s` has bytes to read (`poll(2)` without waiting: unlike a `recv` that finds
/// nothing, it does not take the socket's lock, which would send the arriving segments to the
/// backlog for the reader to process).
fn readable(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call; the descriptor is open (borrowed
    // from `s`).
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0
}

/// Fill all of `buf` from a non-blocking socket, polling.
fn spin_read(s: &mut TcpStream, buf: &mut [u8]) -> R<()> {
    let mut got = 0;
    while got < buf.len() {
        if !readable(s) {
            continue;
        }
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err("tcp ping-pong: connection closed".into()),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(format!("tcp ping-pong read: {e}")),
        }
    }
    Ok(())
}

fn tcp_pingpong(size: usize, effort: Effort) -> R<Batches> {
    let (mut a, mut b) = tcp_pair()?;
    for s in [&a, &b] {
        s.set_nonblocking(true)
            .map_err(|e| format!("non-blocking socket: {e}"))?;
    }
    let n = if size > 16 << 10 {
        (effort.tcp_round_trips / 8).max(50)
    } else {
        effort.tcp_round_trips
    };
    let total = (effort.batches + 1) * n;
    let echo = std::thread::spawn(move || -> R<()> {
        let mut buf = vec![0u8; size.max(1)];
        for _ in 0..total {
            spin_read(&mut b, &mut buf)?;
            spin_write(&mut b, &buf)?;
        }
        Ok(())
    });
    let mut buf = vec![0x5au8; size.max(1)];
    let mut per = Vec::with_capacity(effort.batches * n);
    let res = (|| {
        for i in 0..=effort.batches {
            for _ in 0..n {
                let t = Instant::now();
                spin_write(&mut a, &buf)?;
                spin_read(&mut a, &mut buf)?;
                if i > 0 {
                    per.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
        }
        Ok::<(), String>(())
    })();
    drop(a);
    let r = echo
        .join()
        .map_err(|_| "tcp ping-pong: the echo thread panicked".to_string())?;
    res?;
    r?;
    Batches::of(&per, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(x: f64) -> Batches {
        Batches {
            median: x,
            best: x,
            batches: 1,
        }
    }

    fn sample() -> Floors {
        Floors {
            machine: "m".into(),
            cacheline_us: b(0.1),
            memcpy_mbs: MEMCPY_SIZES
                .iter()
                .map(|&size| AtSize {
                    size,
                    value: b(10_000.0),
                })
                .collect(),
            tcp_stream_mbs: b(5000.0),
            tcp_lat_us: TCP_LAT_SIZES
                .iter()
                .map(|&size| AtSize {
                    size,
                    value: b(size as f64),
                })
                .collect(),
        }
    }

    #[test]
    fn batches_take_median_and_best() {
        let l = Batches::of(&[3.0, 1.0, 2.0, f64::NAN], true).unwrap();
        assert_eq!((l.median, l.best, l.batches), (2.0, 1.0, 4));
        let h = Batches::of(&[3.0, 1.0, 2.0], false).unwrap();
        assert_eq!((h.median, h.best), (2.0, 3.0));
        assert!(Batches::of(&[], true).is_err());
    }

    #[test]
    fn floors_of_each_case() {
        let f = sample();
        assert_eq!(nearest(&f.memcpy_mbs, 100).unwrap().size, 64 << 10);
        assert_eq!(nearest(&f.memcpy_mbs, 2 << 20).unwrap().size, 1 << 20);
        assert_eq!(nearest(&f.memcpy_mbs, 1 << 30).unwrap().size, 64 << 20);
        assert_eq!(nearest(&f.tcp_lat_us, 300).unwrap().size, 256);
        assert_eq!(f.floor_for("shm", "tag_bw", 1 << 20), Some(10_000.0));
        assert_eq!(f.floor_for("tcp", "tag_bw", 64 << 10), Some(5000.0));
        assert_eq!(f.floor_for("tcp", "tag_lat", 4096), Some(4096.0));
        // A line plus one copy of 1 MiB at 10000 MB/s (100 us).
        let l = f.floor_for("shm", "tag_lat", 1 << 20).unwrap();
        assert!((l - 100.1).abs() < 1e-9, "{l}");
        assert_eq!(f.floor_for("ib", "tag_lat", 8), None);
        assert!(nearest(&[], 8).is_none());
    }

    #[test]
    fn json_round_trip_and_table() {
        let f = sample();
        let j = serde_json::to_string(&f).unwrap();
        let back: Floors = serde_json::from_str(&j).unwrap();
        assert_eq!(back, f);
        let t = f.render();
        assert!(
            t.contains("cache line") && t.contains("64M") && t.contains("4K"),
            "{t}"
        );
        assert_eq!(t.lines().count(), 2 + 1 + 4 + 1 + 4, "{t}");
    }

    #[test]
    fn memcpy_and_tcp_floors_are_positive() {
        let e = Effort {
            batches: 2,
            line_round_trips: 100,
            memcpy_bytes: 1 << 20,
            stream_bytes: 2 << 20,
            tcp_round_trips: 20,
        };
        let m = memcpy(64 << 10, e).unwrap();
        assert!(
            m.median > 0.0 && m.best >= m.median && m.batches == 2,
            "{m:?}"
        );
        let s = tcp_stream(e).unwrap();
        assert!(s.median > 0.0 && s.median.is_finite(), "{s:?}");
        for size in [8, 64 << 10] {
            let l = tcp_pingpong(size, e).unwrap();
            assert!(l.median > 0.0 && l.best <= l.median, "{size}: {l:?}");
        }
    }
}
