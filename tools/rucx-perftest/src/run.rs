//! The measurements: a job of two ranks (0 = server, 1 = client), the client telling the server
//! which test to run next over rucx itself, and one loop per test on each side.
//!
//! Every iteration is timed with [`Instant`]; the client keeps the per-iteration times and
//! the whole run's time, from which [`Figures`] follow.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rucx::bootstrap::Placement;
use rucx::{
    Completion, EpId, Error, Job, MemoryType, RecvBuf, Request, Scope, SendBuf, TAG_MASK_FULL, Tag,
    Worker,
};

use crate::args::{Options, TestKind, WaitMode};
use crate::mem::{self, Buf, Gpu, Ring};
use crate::stats::{Figures, MB, percentile};
use rucx_cuda::calls::{self, Counts};

const TAG_CTRL: Tag = 0x7275_6378_0000_0001;
const TAG_DATA: Tag = 0x1000;
const TAG_ACK: Tag = 0x2000;
const TAG_RKEY: Tag = 0x3000;
const TAG_DONE: Tag = 0x4000;
const TAG_READY: Tag = 0x5000;
const AM_PING: u16 = 11;
const AM_PONG: u16 = 12;
const AM_DATA: u16 = 13;
const AM_CREDIT: u16 = 14;

/// Result type of this module: errors are printable strings with context.
pub type R<T> = std::result::Result<T, String>;

fn ctx(what: &str) -> impl FnOnce(Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// One test at one size, as the client asks the server to run it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    /// Test.
    pub test: TestKind,
    /// Message size.
    pub size: usize,
    /// Measured iterations.
    pub iters: usize,
    /// Warm-up iterations.
    pub warmup: usize,
    /// Outstanding window.
    pub window: usize,
    /// Memory types of the send and receive buffers (on both sides).
    pub mem: (MemoryType, MemoryType),
    /// How both sides wait between messages.
    pub wait: WaitMode,
    /// Host buffers from the heap on both sides (`--heap-host`), not from
    /// `Context::mem_alloc`.
    pub heap_host: bool,
    /// Bytes of distinct receive (and get) buffers a bandwidth test cycles through, at least
    /// one per request of the window (`--recv-ring`).
    pub recv_ring: usize,
}

impl Spec {
    /// The control message that announces this spec.
    pub fn encode(&self) -> String {
        format!(
            "run {} {} {} {} {} {} {} {} {} {}",
            self.test.name(),
            self.size,
            self.iters,
            self.warmup,
            self.window,
            self.mem.0,
            self.mem.1,
            self.wait.name(),
            if self.heap_host { "heap" } else { "alloc" },
            self.recv_ring
        )
    }

    /// Parse a control message (`None` for `quit`).
    pub fn decode(s: &str) -> R<Option<Spec>> {
        let w: Vec<&str> = s.split_whitespace().collect();
        match w.as_slice() {
            ["quit"] => Ok(None),
            ["run", t, size, iters, warm, window, rest @ ..] if rest.len() == 5 => {
                let num = |x: &str| {
                    x.parse::<usize>()
                        .map_err(|_| format!("bad control message {s:?}"))
                };
                let mt = |x: &str| match x.parse::<MemoryType>() {
                    Ok(m @ (MemoryType::Host | MemoryType::Cuda)) => Ok(m),
                    _ => Err(format!("bad memory type in control message {s:?}")),
                };
                Ok(Some(Spec {
                    test: t.parse()?,
                    size: num(size)?,
                    iters: num(iters)?,
                    warmup: num(warm)?,
                    window: num(window)?.max(1),
                    mem: (mt(rest[0])?, mt(rest[1])?),
                    wait: rest[2].parse()?,
                    heap_host: match rest[3] {
                        "heap" => true,
                        "alloc" => false,
                        _ => return Err(format!("bad host allocation in control message {s:?}")),
                    },
                    recv_ring: num(rest[4])?,
                }))
            }
            _ => Err(format!(
                "bad control message {s:?} (client and server of different versions?)"
            )),
        }
    }
}

/// Start the job of two: the server is rank 0 and listens on `bind:port`, the client is rank
/// 1 and connects to `server:port`. The job key is `RUCX_BOOTSTRAP_KEY`'s.
pub fn start_job(opts: &Options) -> R<Job> {
    start_job_keyed(opts, None)
}

/// [`start_job`] with this job key instead of `RUCX_BOOTSTRAP_KEY`'s, when given.
pub fn start_job_keyed(opts: &Options, key: Option<&str>) -> R<Job> {
    let mut cfg = rucx::config_from_env().map_err(|e| e.to_string())?;
    if let Some(k) = key {
        cfg.set("BOOTSTRAP_KEY", k).map_err(|e| e.to_string())?;
    }
    let server = opts.is_server();
    let boot = if server {
        format!("{}:{}", opts.bind, opts.port)
    } else {
        let host = opts.server.as_deref().unwrap_or("127.0.0.1");
        format!("{host}:{}", opts.port)
    };
    cfg.set("BOOTSTRAP", &boot).map_err(|e| e.to_string())?;
    if server && std::env::var_os("RUCX_BOOTSTRAP_TIMEOUT").is_none() && !opts.local_server {
        // A server waits for its client as long as it takes, like ucx_perftest's.
        cfg.set("BOOTSTRAP_TIMEOUT", "24h")
            .map_err(|e| e.to_string())?;
    }
    let placement = Placement {
        rank: if server { 0 } else { 1 },
        size: 2,
        source: "rucx-perftest",
        all_local: false,
        job_id: None,
    };
    let job = Job::start(cfg, placement).map_err(|e| format!("starting the job at {boot}: {e}"))?;
    mem::set_host_context(job.context());
    Ok(job)
}

/// Wait for a request, progressing the worker; fails when the peer's endpoint failed (so a
/// dead peer does not leave a receive waiting forever). Polls without a pause instruction, as
/// `ucx_perftest` does: a pause (tens of cycles on some CPUs) would add to every latency.
fn wait(w: &Worker, peer: EpId, r: Request<'_>) -> R<Completion> {
    let mut idle = 0u32;
    loop {
        if let Some(res) = r.test() {
            return res.map_err(|e| e.to_string());
        }
        if w.progress() == 0 {
            idle_step(w, peer, &mut idle)?;
        }
    }
}

/// Progress until `done()` holds, failing when the peer's endpoint failed.
fn progress_until(w: &Worker, peer: EpId, mut done: impl FnMut() -> bool) -> R<()> {
    let mut idle = 0u32;
    while !done() {
        if w.progress() == 0 {
            idle_step(w, peer, &mut idle)?;
        }
    }
    Ok(())
}

/// The wait mode of the spec being run (`-E`; both sides set it from the spec).
static SLEEP: AtomicBool = AtomicBool::new(false);

fn set_wait_mode(m: WaitMode) {
    SLEEP.store(m == WaitMode::Sleep, Relaxed);
}

/// A progress call found nothing: in sleep mode, sleep until the worker's events; look at
/// the peer's endpoint now and then (at every wake-up when sleeping).
#[inline]
fn idle_step(w: &Worker, peer: EpId, idle: &mut u32) -> R<()> {
    *idle = idle.wrapping_add(1);
    let sleep = SLEEP.load(Relaxed);
    if sleep {
        w.wait(None)
            .map_err(ctx("waiting for the worker's events"))?;
    }
    if (sleep || idle.is_multiple_of(4096))
        && let Some(why) = w.ep_error(peer)
    {
        return Err(format!("the peer failed: {why}"));
    }
    Ok(())
}

fn send(w: &Worker, peer: EpId, buf: &[u8], tag: Tag) -> R<()> {
    w.scope(|s| wait(w, peer, s.tag_send(peer, buf, tag)).map(|_| ()))
}

fn recv(w: &Worker, peer: EpId, buf: &mut [u8], tag: Tag) -> R<usize> {
    w.scope(|s| wait(w, peer, s.tag_recv(buf, tag, TAG_MASK_FULL)).map(|c| c.len))
}

/// A progress line on stderr every second of a long run.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    label: String,
    total: usize,
    factor: f64,
    size: usize,
    last: Instant,
    last_i: usize,
}

impl Progress {
    fn new(enabled: bool, spec: &Spec) -> Progress {
        Progress {
            enabled,
            label: format!("{} {} B", spec.test.name(), spec.size),
            total: spec.iters,
            factor: if spec.test.is_pingpong() { 0.5 } else { 1.0 },
            size: spec.size,
            last: Instant::now(),
            last_i: 0,
        }
    }

    #[inline]
    fn tick(&mut self, samples: &[u64], clock: &quanta::Clock) {
        // The wall clock is read every 1024 samples only.
        if !self.enabled || !samples.len().is_multiple_of(1024) {
            return;
        }
        let now = Instant::now();
        if now.duration_since(self.last) < Duration::from_secs(1) {
            return;
        }
        let n = samples.len();
        let mut us: Vec<f64> = samples[self.last_i..]
            .iter()
            .map(|&t| clock.delta(0, t).as_secs_f64() * 1e6 * self.factor)
            .collect();
        us.sort_by(f64::total_cmp);
        let avg = us.iter().sum::<f64>() / us.len().max(1) as f64;
        let p50 = percentile(&us, 50.0).unwrap_or(0.0);
        let secs = now.duration_since(self.last).as_secs_f64();
        let rate = (n - self.last_i) as f64 / secs;
        eprintln!(
            "[rucx-perftest] {}: {n}/{} iterations ({:.0}%); last {:.1} s: latency 50%ile {:.3} us, average {:.3} us; {:.2} MB/s; {:.0} msg/s",
            self.label,
            self.total,
            100.0 * n as f64 / self.total.max(1) as f64,
            secs,
            p50,
            avg,
            rate * self.size as f64 / MB,
            rate
        );
        self.last = now;
        self.last_i = n;
    }
}

/// Per-iteration timing on the measuring side. Iterations are timed with the CPU's time-stamp
/// counter where it is invariant (`quanta`; about 10 ns a read here, against 25 ns for the
/// system clock, which `ucx_perftest` avoids the same way), the run as a whole with `Instant`.
struct Timer {
    warm: usize,
    clock: quanta::Clock,
    /// Iteration times in clock ticks.
    samples: Vec<u64>,
    start: Instant,
    /// The measured run's time, once stopped before the end of the test's function (work
    /// after the run, such as checking what arrived, is not timed).
    stopped: Option<Duration>,
    prev: u64,
    progress: Progress,
    /// The CUDA driver's counters when the first measured iteration began.
    calls_start: Option<Counts>,
    /// What the driver was called for during the measured run, once it ended.
    calls: Option<Counts>,
}

/// The CUDA driver calls this process made during a run's measured iterations (warm-up left
/// out, so one-time costs such as opening an IPC mapping or creating a stream do not show).
#[derive(Clone, Debug)]
pub struct DriverCalls {
    /// Calls (and time, with `RUCX_CUDA_CALL_TIMING=y`) per entry point.
    pub counts: Counts,
    /// Measured iterations.
    pub iterations: usize,
}

impl DriverCalls {
    /// Calls per iteration by entry point, most called first (`none` when there were none).
    pub fn per_iteration(&self) -> String {
        self.counts.per_unit_line(self.iterations as u64)
    }
}

/// Where iterations begin and end (the [`Timer`]; a recorder in tests).
trait Marks {
    /// Iteration `i` starts.
    fn begin(&mut self, i: usize);
    /// Iteration `i` ended.
    fn end(&mut self, i: usize);
    /// The first measured iteration (the ones before it are the warm-up).
    fn first_measured(&self) -> usize;
}

impl Marks for Timer {
    fn begin(&mut self, i: usize) {
        Timer::begin(self, i)
    }

    fn end(&mut self, i: usize) {
        Timer::end(self, i)
    }

    fn first_measured(&self) -> usize {
        self.warm
    }
}

/// Iterations `range` of a bandwidth test: at most `window` requests in flight (the oldest is
/// waited for before the next is posted), and every request finished before the last
/// iteration ends. The drain belongs to the measured run: were it left out, the iterations of
/// a window that holds the whole run (a few 2 GiB messages) would time only the posts, and
/// the average bandwidth would read millions of MB/s.
///
/// The warm-up's requests are all finished before the first measured iteration begins (as
/// `ucx_perftest` ends its warm-up before it measures): with fewer warm-up iterations than the
/// window (64 MiB messages: 10 of them, window 16) they were only posted, so the measured run
/// timed their transfers and the first transfers' one-time costs too, without counting their
/// bytes (host-to-GPU `tag_bw` read 0.70-0.75 of the copy bound at `-O 16`, 0.96 at `-O 4`).
fn windowed<Q>(
    range: std::ops::Range<usize>,
    window: usize,
    t: &mut impl Marks,
    mut post: impl FnMut(usize) -> Q,
    mut wait: impl FnMut(Q) -> R<()>,
) -> R<()> {
    let mut q: VecDeque<Q> = VecDeque::with_capacity(window);
    let last = range.end.saturating_sub(1);
    let warm = t.first_measured();
    for j in range {
        if j == warm {
            while let Some(r) = q.pop_front() {
                wait(r)?;
            }
        }
        t.begin(j);
        if q.len() >= window.max(1) {
            let r = q.pop_front().expect("window not empty");
            wait(r)?;
        }
        q.push_back(post(j));
        if j == last {
            while let Some(r) = q.pop_front() {
                wait(r)?;
            }
        }
        t.end(j);
    }
    Ok(())
}

impl Timer {
    fn new(spec: &Spec, progress: bool) -> Timer {
        let clock = quanta::Clock::new();
        let prev = clock.raw();
        Timer {
            warm: spec.warmup,
            clock,
            samples: Vec::with_capacity(spec.iters),
            start: Instant::now(),
            stopped: None,
            prev,
            progress: Progress::new(progress, spec),
            calls_start: (spec.warmup == 0).then(calls::snapshot),
            calls: None,
        }
    }

    /// Call before iteration `i` starts.
    #[inline]
    fn begin(&mut self, i: usize) {
        if i == self.warm {
            self.calls_start = Some(calls::snapshot());
            self.start = Instant::now();
            self.prev = self.clock.raw();
            self.progress.last = self.start;
        }
    }

    /// Call when iteration `i` ended.
    #[inline]
    fn end(&mut self, i: usize) {
        let now = self.clock.raw();
        if i >= self.warm {
            self.samples.push(now.wrapping_sub(self.prev));
            self.progress.tick(&self.samples, &self.clock);
        }
        self.prev = now;
    }

    /// Stop the clock of the measured run (the last iteration ended; what follows is not
    /// timed).
    fn stop(&mut self) {
        self.stopped.get_or_insert_with(|| self.start.elapsed());
        self.stop_calls();
    }

    fn stop_calls(&mut self) {
        if self.calls.is_none()
            && let Some(start) = &self.calls_start
        {
            self.calls = Some(calls::snapshot().since(start));
        }
    }

    /// The samples, the measured run's time (ending when stopped, else now) and the driver
    /// calls made meanwhile.
    fn finish(mut self) -> (Vec<Duration>, Duration, DriverCalls) {
        self.stop_calls();
        let total = self.stopped.unwrap_or_else(|| self.start.elapsed());
        let calls = DriverCalls {
            counts: self.calls.take().unwrap_or_else(Counts::zero),
            iterations: self.samples.len(),
        };
        let samples = self
            .samples
            .iter()
            .map(|&t| self.clock.delta(0, t))
            .collect();
        (samples, total, calls)
    }
}

/// How many distinct buffers a side cycles through for receives and gets in one scope (a
/// buffer can be lent to one pending request at a time): `ring` bytes of them (`--recv-ring`,
/// 1 MiB by default), and at least one per request of the window, at most 1024. `ucx_perftest`
/// and OSU's bandwidth tests receive every message of a window into one buffer, which stays in
/// cache; rucx's buffers cannot alias, so the default keeps the ring small enough for the
/// caches (with 64 KiB messages it is the window's 16: a 16 MiB ring of 256 ran posix `tag_bw`
/// at two thirds of their speed on this 2-vCPU machine, measuring the caches, not the
/// transport) and large enough that a scope of small receives is not cut short (every scope
/// ends its receives before lending their buffers again). A ring far larger than the
/// last-level cache measures DRAM write bandwidth (64 MiB of 1 MiB slots ran at half the speed
/// of 16 on a 16-core Xeon).
///
/// The ring never takes more than [`RING_BYTES`] (one slot at least), so a side needs memory
/// for one message where one message fits: with messages too large for a window of slots,
/// fewer receives are posted at once than sends are in flight, and the rest wait at the
/// receiver as rendezvous announcements, which hold no payload.
fn ring_len(size: usize, window: usize, ring: usize) -> usize {
    let budget = (RING_BYTES / size.max(1)).max(1);
    window.max(ring / size.max(1)).clamp(1, 1024).min(budget)
}

/// The most memory a ring of receive (or get) buffers takes, unless one message is larger.
const RING_BYTES: usize = 256 << 20;

/// Iterations per scope of sends and puts (bounds the requests a scope keeps).
fn chunk_len(window: usize) -> usize {
    (window * 64).max(1024)
}

/// A receive buffer with every page already faulted in (a zeroed allocation maps its pages
/// lazily, and the first transfer into it would pay the page faults), its last byte 0.
pub(crate) fn touched(size: usize) -> Vec<u8> {
    let mut v = vec![0xeeu8; size];
    if let Some(b) = v.last_mut() {
        *b = 0;
    }
    v
}

/// The bytes every sent message carries.
#[cfg(test)]
pub(crate) fn pattern(size: usize) -> Vec<u8> {
    (0..size).map(mem::pattern_byte).collect()
}

// ---------------------------------------------------------------------------------------------
// Client side (measures).

/// Send and receive buffers of a ping-pong, of the spec's memory types.
fn pingpong_bufs(spec: &Spec, gpu: Option<&Gpu>) -> R<(Buf, Buf)> {
    Ok((
        Buf::pattern(spec.mem.0, gpu, spec.size)?,
        Buf::touched(spec.mem.1, gpu, spec.size)?,
    ))
}

/// Post a send of the test's kind: a tag send, synchronous for `tag_sync_*`, or bytes of the
/// stream for `stream_*`.
fn post_send<'s>(s: &'s Scope<'s, '_>, ep: EpId, buf: SendBuf<'s>, test: TestKind) -> Request<'s> {
    match test {
        TestKind::TagSyncLat | TestKind::TagSyncBw => s.tag_send_sync(ep, buf, TAG_DATA),
        TestKind::StreamLat | TestKind::StreamBw => s.stream_send(ep, buf),
        _ => s.tag_send(ep, buf, TAG_DATA),
    }
}

/// Post a receive of the test's kind (tag or stream).
fn post_recv<'s>(s: &'s Scope<'s, '_>, ep: EpId, buf: RecvBuf<'s>, test: TestKind) -> Request<'s> {
    match test {
        TestKind::StreamLat | TestKind::StreamBw => s.stream_recv(ep, buf),
        _ => s.tag_recv(buf, TAG_DATA, TAG_MASK_FULL),
    }
}

fn tag_lat_client(
    w: &Worker,
    ep: EpId,
    spec: &Spec,
    (sbuf, mut rbuf): (Buf, Buf),
    t: &mut Timer,
) -> R<Buf> {
    for i in 0..spec.warmup + spec.iters {
        t.begin(i);
        rucx::ucs::profile::mark("perftest.client.iter", i as u64);
        // Send first, then post the receive while the message is on its way (as
        // ucx_perftest's ping-pong does): posting is off the round trip's critical path, and the
        // answer cannot come back before the peer received the message.
        w.scope(|s| {
            let sent = post_send(s, ep, sbuf.send_buf(), spec.test);
            let r = post_recv(s, ep, rbuf.recv_buf(), spec.test);
            wait(w, ep, sent)?;
            wait(w, ep, r)
        })?;
        t.end(i);
    }
    Ok(rbuf)
}

fn tag_bw_client(w: &Worker, ep: EpId, spec: &Spec, sbuf: &Buf, t: &mut Timer) -> R<()> {
    let total = spec.warmup + spec.iters;
    let mut i = 0;
    while i < total {
        let end = (i + chunk_len(spec.window)).min(total);
        w.scope(|s| {
            windowed(
                i..end,
                spec.window,
                t,
                |_| post_send(s, ep, sbuf.send_buf(), spec.test),
                |r| wait(w, ep, r).map(|_| ()),
            )
        })?;
        i = end;
    }
    // The receiver acknowledges the last message: the run ends when everything arrived.
    recv(w, ep, &mut [], TAG_ACK)?;
    Ok(())
}

fn recv_rkey(w: &Worker, ep: EpId) -> R<rucx::RkeyBundle> {
    let mut b = vec![0u8; 64 << 10];
    let n = recv(w, ep, &mut b, TAG_RKEY)?;
    w.rkey_unpack(ep, &b[..n])
        .map_err(ctx("unpacking the peer's remote key"))
}

// Remote memory access tests: the client's (initiator's) buffers are of `spec.mem.0`, the
// server's mapped region of `spec.mem.1`, for put and get alike (as ucx_perftest's local and
// remote buffers). GPU buffers are on GPU `rank % count`, as for the tag tests.

fn put_bw_client(w: &Worker, ep: EpId, spec: &Spec, gpu: Option<&Gpu>, t: &mut Timer) -> R<()> {
    let sbuf = Buf::pattern(spec.mem.0, gpu, spec.size)?;
    let rkey = recv_rkey(w, ep)?;
    let remote = rkey.base();
    let total = spec.warmup + spec.iters;
    let mut i = 0;
    while i < total {
        let end = (i + chunk_len(spec.window)).min(total);
        w.scope(|s| {
            windowed(
                i..end,
                spec.window,
                t,
                |_| s.put(ep, sbuf.send_buf(), remote, &rkey),
                |r| wait(w, ep, r).map(|_| ()),
            )
        })?;
        i = end;
    }
    w.scope(|s| wait(w, ep, s.flush(ep)))?;
    // The server checks what arrived once told.
    send(w, ep, &[], TAG_DONE)
}

fn get_client(w: &Worker, ep: EpId, spec: &Spec, gpu: Option<&Gpu>, t: &mut Timer) -> R<()> {
    let mut ring = Ring::new(
        spec.mem.0,
        gpu,
        spec.size,
        ring_len(spec.size, spec.window, spec.recv_ring),
    )?;
    let rkey = recv_rkey(w, ep)?;
    let remote = rkey.base();
    let total = spec.warmup + spec.iters;
    let mut i = 0;
    while i < total {
        let n = ring.len().min(total - i);
        let slots = ring.slots(n);
        w.scope(|s| {
            let mut free = slots.into_iter();
            windowed(
                i..i + n,
                spec.window,
                t,
                |_| {
                    let b = free.next().expect("one buffer per iteration of the scope");
                    s.get(ep, b, remote, &rkey)
                },
                |r| wait(w, ep, r).map(|_| ()),
            )
        })?;
        i += n;
    }
    // What was read is checked below, after the clock stopped (two whole slots copied out of
    // the GPU and compared: at 64 MiB that took 30 times the gets themselves).
    t.stop();
    send(w, ep, &[], TAG_DONE)?;
    // The server's region holds the pattern: so must what was read.
    let last = (total - 1) % ring.len().max(1);
    for k in [0, last] {
        ring.verify(k, &format!("client, get into slot {k}"))?;
    }
    Ok(())
}

/// The last byte of `buf` (which the peer's puts write): a volatile read of host memory, a
/// one-byte copy out of GPU memory.
fn last_byte(buf: &Buf) -> R<u8> {
    match buf {
        Buf::Host(v) => {
            let p = v.as_ptr();
            // SAFETY: in bounds (sizes >= 1 are enforced) of a live vector; volatile because
            // the peer's transport writes the byte behind the compiler's back.
            Ok(unsafe { std::ptr::read_volatile(p.add(v.len() - 1)) })
        }
        Buf::Dev { mem, len } => {
            let mut b = [0u8];
            mem.copy_to_host(len - 1, &mut b)
                .map_err(|e| format!("polling the mapped GPU buffer: {e}"))?;
            Ok(b[0])
        }
    }
}

/// Set the last byte of the send buffer `buf` to `seq`.
fn set_last_byte(buf: &mut Buf, seq: u8) -> R<()> {
    match buf {
        Buf::Host(v) => {
            *v.last_mut().ok_or("empty buffer")? = seq;
            Ok(())
        }
        Buf::Dev { mem, len } => mem
            .copy_from_host(*len - 1, &[seq])
            .map_err(|e| format!("writing the send buffer's last byte: {e}")),
    }
}

/// Map `mine` (this side's buffer the peer writes into) and swap keys with the peer. The map
/// takes the buffer by address, so that this side can poll it meanwhile (the peer's writes
/// are the only other access, as for a host buffer read while a NIC writes it).
fn exchange_maps<'a>(
    w: &Worker,
    ep: EpId,
    mine: &'a Buf,
    server: bool,
) -> R<(rucx::MemMap<'a>, rucx::RkeyBundle)> {
    let (addr, len) = match mine {
        Buf::Host(v) => (v.as_ptr() as u64, v.len()),
        Buf::Dev { mem, len } => (mem.ptr(), *len),
    };
    // SAFETY: `mine` outlives the map ('a); this side only polls its last byte while the map
    // lives (the peer's puts are the writers), and drops the map before the buffer.
    let raw = unsafe { RecvBuf::from_raw(addr, len) };
    let map = w.mem_map(raw).map_err(ctx(
        "mapping the buffer for remote access (does RUCX_TLS have a transport with put/get, \
         and for GPU memory one that exports it: cuda_ipc?)",
    ))?;
    let packed = map.pack_rkey();
    let rkey = if server {
        send(w, ep, &packed, TAG_RKEY)?;
        recv_rkey(w, ep)?
    } else {
        let k = recv_rkey(w, ep)?;
        send(w, ep, &packed, TAG_RKEY)?;
        k
    };
    Ok((map, rkey))
}

fn put_lat_client(w: &Worker, ep: EpId, spec: &Spec, gpu: Option<&Gpu>, t: &mut Timer) -> R<()> {
    let mine = Buf::touched(spec.mem.0, gpu, spec.size)?;
    let mut sbuf = Buf::pattern(spec.mem.0, gpu, spec.size)?;
    let (map, rkey) = exchange_maps(w, ep, &mine, false)?;
    for i in 0..spec.warmup + spec.iters {
        let seq = (i + 1) as u8;
        // Outside the clock: a GPU buffer takes a copy to change.
        set_last_byte(&mut sbuf, seq)?;
        t.begin(i);
        w.scope(|s| wait(w, ep, s.put(ep, sbuf.send_buf(), rkey.base(), &rkey)))?;
        let mut polled = Ok(());
        progress_until(w, ep, || match last_byte(&mine) {
            Ok(b) => b == seq,
            Err(e) => {
                polled = Err(e);
                true
            }
        })?;
        polled?;
        t.end(i);
    }
    drop(map);
    send(w, ep, &[], TAG_DONE)
}

/// Active messages the handler of one id keeps for the test's loop, which fetches their
/// payloads (outside the handler: a rendezvous payload is fetched with a request).
type AmInbox = Arc<Mutex<VecDeque<rucx::AmPayload>>>;

fn am_inbox(w: &Worker, id: u16) -> AmInbox {
    let inbox: AmInbox = Arc::default();
    let keep = inbox.clone();
    w.set_am_handler(id, move |_, mut m| {
        keep.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(m.take_payload())
    });
    inbox
}

/// Wait for the next active message of `inbox` and fetch its payload into `rbuf` (copied
/// when it came with the message, else by its rendezvous).
fn am_fetch(w: &Worker, ep: EpId, inbox: &AmInbox, rbuf: &mut Buf) -> R<()> {
    let mut next = None;
    progress_until(w, ep, || {
        next = inbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        next.is_some()
    })?;
    let payload = next.expect("popped above");
    w.scope(|s| wait(w, ep, s.am_recv_data(payload, rbuf.recv_buf())))
        .map_err(|e| format!("fetching an active message's payload: {e}"))?;
    Ok(())
}

/// Send an active message of `sbuf` (host or GPU memory) and wait until the buffer may be
/// reused (for a rendezvous: until the peer fetched it).
fn am_send_wait(w: &Worker, ep: EpId, id: u16, sbuf: &Buf) -> R<()> {
    w.scope(|s| wait(w, ep, s.am_send(ep, id, &[], sbuf.send_buf())))
        .map_err(|e| format!("active message: {e}"))?;
    Ok(())
}

fn am_lat_client(
    w: &Worker,
    ep: EpId,
    spec: &Spec,
    (sbuf, mut rbuf): (Buf, Buf),
    t: &mut Timer,
) -> R<Buf> {
    let pongs = am_inbox(w, AM_PONG);
    for i in 0..spec.warmup + spec.iters {
        t.begin(i);
        am_send_wait(w, ep, AM_PING, &sbuf)?;
        am_fetch(w, ep, &pongs, &mut rbuf)?;
        t.end(i);
    }
    Ok(rbuf)
}

fn am_bw_client(w: &Worker, ep: EpId, spec: &Spec, sbuf: &Buf, t: &mut Timer) -> R<()> {
    let acked = Arc::new(AtomicUsize::new(0));
    let a = acked.clone();
    w.set_am_handler(AM_CREDIT, move |_, m| {
        if let Ok(b) = <[u8; 8]>::try_from(m.data.as_slice()) {
            a.fetch_max(u64::from_le_bytes(b) as usize, Relaxed);
        }
    });
    let total = spec.warmup + spec.iters;
    let mut i = 0;
    while i < total {
        let end = (i + chunk_len(spec.window)).min(total);
        w.scope(|s| -> R<()> {
            // Sends of one scope: copied in ones are done when posted, rendezvous ones once
            // the server fetched them; at most `window` in flight either way.
            let mut q: VecDeque<Request<'_>> = VecDeque::with_capacity(spec.window);
            while i < end {
                t.begin(i);
                // Credits: at most `window` messages the receiver has not counted yet.
                progress_until(w, ep, || i - acked.load(Relaxed) < spec.window)?;
                while q.len() >= spec.window {
                    wait(w, ep, q.pop_front().expect("non-empty"))?;
                }
                q.push_back(s.am_send(ep, AM_DATA, &[], sbuf.send_buf()));
                t.end(i);
                i += 1;
            }
            while let Some(r) = q.pop_front() {
                wait(w, ep, r).map_err(|e| format!("active message: {e}"))?;
            }
            Ok(())
        })?;
    }
    progress_until(w, ep, || acked.load(Relaxed) >= total)?;
    Ok(())
}

/// Run one spec on the client (the server must be told first); returns the figures.
pub fn client_run(job: &Job, spec: &Spec, progress: bool) -> R<Figures> {
    client_run_counted(job, spec, progress).map(|(f, _)| f)
}

/// [`client_run`], with the CUDA driver calls this process made in the measured iterations.
pub fn client_run_counted(job: &Job, spec: &Spec, progress: bool) -> R<(Figures, DriverCalls)> {
    let w = job.worker();
    set_wait_mode(spec.wait);
    mem::set_heap_host(spec.heap_host);
    let ep = job.ep(0);
    // The client's buffers (GPU ones on GPU 1 % count), set up before anything is timed.
    let gpu = mem::gpu_for(spec.mem, 1)?;
    let gpu = gpu.as_ref();
    let lat_bufs = match spec.test {
        TestKind::TagLat | TestKind::TagSyncLat | TestKind::StreamLat | TestKind::AmLat => {
            Some(pingpong_bufs(spec, gpu)?)
        }
        _ => None,
    };
    let bw_buf = match spec.test {
        TestKind::TagBw | TestKind::TagSyncBw | TestKind::StreamBw | TestKind::AmBw => {
            Some(Buf::pattern(spec.mem.0, gpu, spec.size)?)
        }
        _ => None,
    };
    send(w, ep, spec.encode().as_bytes(), TAG_CTRL)?;
    // The server set up (buffers, handlers) before anything is timed or sent; it answers
    // with why not when it could not.
    let mut why = vec![0u8; 4096];
    let n = recv(w, ep, &mut why, TAG_READY)?;
    if n > 0 {
        return Err(format!(
            "the server: {}",
            String::from_utf8_lossy(&why[..n])
        ));
    }
    let mut t = Timer::new(spec, progress);
    let mut check = None;
    match spec.test {
        TestKind::TagLat | TestKind::TagSyncLat | TestKind::StreamLat => {
            let bufs = lat_bufs.expect("set up above");
            check = Some(tag_lat_client(w, ep, spec, bufs, &mut t)?);
        }
        TestKind::TagBw | TestKind::TagSyncBw | TestKind::StreamBw => {
            let sbuf = bw_buf.as_ref().expect("set up above");
            tag_bw_client(w, ep, spec, sbuf, &mut t)?
        }
        TestKind::PutBw => put_bw_client(w, ep, spec, gpu, &mut t)?,
        TestKind::Get => get_client(w, ep, spec, gpu, &mut t)?,
        TestKind::PutLat => put_lat_client(w, ep, spec, gpu, &mut t)?,
        TestKind::AmLat => {
            let bufs = lat_bufs.expect("set up above");
            check = Some(am_lat_client(w, ep, spec, bufs, &mut t)?);
        }
        TestKind::AmBw => {
            let sbuf = bw_buf.as_ref().expect("set up above");
            am_bw_client(w, ep, spec, sbuf, &mut t)?
        }
    }
    let (samples, total, calls) = t.finish();
    if let Some(rbuf) = check {
        // The last message the server sent, checked after the clock stopped.
        rbuf.verify(&format!("{} {} B, client", spec.test, spec.size))?;
    }
    let f = Figures::compute(
        spec.test.name(),
        spec.size,
        &samples,
        total,
        spec.test.is_pingpong(),
    );
    Ok((f, calls))
}

/// Tell the server that the client is done.
pub fn client_quit(job: &Job) -> R<()> {
    send(job.worker(), job.ep(0), b"quit", TAG_CTRL)?;
    // The server leaves now: its going away is no failure.
    job.worker().set_closing();
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Server side (responds).

/// Tell the client whether the setup worked: an empty READY, or the reason (and fail).
fn ready<T>(w: &Worker, ep: EpId, setup: R<T>) -> R<T> {
    match setup {
        Ok(v) => {
            send(w, ep, &[], TAG_READY)?;
            Ok(v)
        }
        Err(e) => {
            let mut why = e.clone().into_bytes();
            why.truncate(4000);
            // Best effort: the error below is what this side reports either way.
            let _ = send(w, ep, &why, TAG_READY);
            Err(e)
        }
    }
}

fn tag_lat_server(w: &Worker, ep: EpId, spec: &Spec) -> R<()> {
    let setup = mem::gpu_for(spec.mem, 0).and_then(|g| pingpong_bufs(spec, g.as_ref()));
    let (sbuf, mut rbuf) = ready(w, ep, setup)?;
    let mut start = None;
    for i in 0..spec.warmup + spec.iters {
        if i == spec.warmup {
            start = Some(calls::snapshot());
        }
        rucx::ucs::profile::mark("perftest.server.iter", i as u64);
        w.scope(|s| {
            let r = post_recv(s, ep, rbuf.recv_buf(), spec.test);
            wait(w, ep, r)?;
            wait(w, ep, post_send(s, ep, sbuf.send_buf(), spec.test))
        })?;
    }
    if let Some(start) = start {
        let c = DriverCalls {
            counts: calls::snapshot().since(&start),
            iterations: spec.iters,
        };
        // Only where the driver was used (GPU memory): host runs print what they always did.
        if c.counts.total_calls() > 0 {
            println!(
                "CUDA driver calls per iteration, server, {} {} B: {}",
                spec.test,
                spec.size,
                c.per_iteration()
            );
        }
    }
    rbuf.verify("server")
}

fn tag_bw_server(w: &Worker, ep: EpId, spec: &Spec) -> R<()> {
    let setup = mem::gpu_for(spec.mem, 0).and_then(|g| {
        Ring::new(
            spec.mem.1,
            g.as_ref(),
            spec.size,
            ring_len(spec.size, spec.window, spec.recv_ring),
        )
    });
    let mut ring = ready(w, ep, setup)?;
    let total = spec.warmup + spec.iters;
    let mut i = 0;
    while i < total {
        let n = ring.len().min(total - i);
        let slots = ring.slots(n);
        w.scope(|s| -> R<()> {
            let mut q: VecDeque<Request<'_>> = VecDeque::with_capacity(spec.window);
            for b in slots {
                if q.len() >= spec.window {
                    let r = q.pop_front().expect("window not empty");
                    wait(w, ep, r)?;
                }
                q.push_back(post_recv(s, ep, b, spec.test));
            }
            while let Some(r) = q.pop_front() {
                wait(w, ep, r)?;
            }
            Ok(())
        })?;
        i += n;
    }
    send(w, ep, &[], TAG_ACK)?;
    // Checked after the client's clock stopped (at the acknowledgement).
    let last = (total - 1) % ring.len().max(1);
    for k in [0, last] {
        ring.verify(k, &format!("server, slot {k}"))?;
    }
    Ok(())
}

fn rma_target_server(w: &Worker, ep: EpId, spec: &Spec) -> R<()> {
    // Put: a cleared region the client's puts fill with the pattern; get: the pattern.
    let setup = mem::gpu_for(spec.mem, 0).and_then(|g| match spec.test {
        TestKind::Get => Buf::pattern(spec.mem.1, g.as_ref(), spec.size),
        _ => Buf::touched(spec.mem.1, g.as_ref(), spec.size),
    });
    let mut buf = ready(w, ep, setup)?;
    let map = w.mem_map(buf.recv_buf()).map_err(ctx(
        "mapping the buffer for remote access (does RUCX_TLS have a transport with put/get, \
         and for GPU memory one that exports it: cuda_ipc?)",
    ))?;
    send(w, ep, &map.pack_rkey(), TAG_RKEY)?;
    recv(w, ep, &mut [], TAG_DONE)?;
    drop(map);
    if spec.test == TestKind::PutBw {
        buf.verify("server, region written by puts")?;
    }
    Ok(())
}

fn put_lat_server(w: &Worker, ep: EpId, spec: &Spec) -> R<()> {
    let setup = mem::gpu_for(spec.mem, 0).and_then(|g| {
        Ok((
            Buf::touched(spec.mem.1, g.as_ref(), spec.size)?,
            Buf::pattern(spec.mem.1, g.as_ref(), spec.size)?,
        ))
    });
    let (mine, mut sbuf) = ready(w, ep, setup)?;
    let (map, rkey) = exchange_maps(w, ep, &mine, true)?;
    set_last_byte(&mut sbuf, 1)?;
    for i in 0..spec.warmup + spec.iters {
        let seq = (i + 1) as u8;
        let mut polled = Ok(());
        progress_until(w, ep, || match last_byte(&mine) {
            Ok(b) => b == seq,
            Err(e) => {
                polled = Err(e);
                true
            }
        })?;
        polled?;
        w.scope(|s| wait(w, ep, s.put(ep, sbuf.send_buf(), rkey.base(), &rkey)))?;
        // The next answer's byte, while the client takes this one in.
        set_last_byte(&mut sbuf, seq.wrapping_add(1))?;
    }
    recv(w, ep, &mut [], TAG_DONE)?;
    drop(map);
    Ok(())
}

fn am_lat_server(w: &Worker, ep: EpId, spec: &Spec) -> R<()> {
    let pings = am_inbox(w, AM_PING);
    let setup = mem::gpu_for(spec.mem, 0).and_then(|g| pingpong_bufs(spec, g.as_ref()));
    let (sbuf, mut rbuf) = ready(w, ep, setup)?;
    for _ in 0..spec.warmup + spec.iters {
        am_fetch(w, ep, &pings, &mut rbuf)?;
        am_send_wait(w, ep, AM_PONG, &sbuf)?;
    }
    rbuf.verify("server")
}

fn am_bw_server(w: &Worker, ep: EpId, spec: &Spec) -> R<()> {
    let total = spec.warmup + spec.iters;
    let batch = (spec.window / 2).max(1);
    let data = am_inbox(w, AM_DATA);
    let setup =
        mem::gpu_for(spec.mem, 0).and_then(|g| Buf::touched(spec.mem.1, g.as_ref(), spec.size));
    let mut rbuf = ready(w, ep, setup)?;
    for n in 1..=total {
        am_fetch(w, ep, &data, &mut rbuf)?;
        if n.is_multiple_of(batch) || n == total {
            w.am_send(ep, AM_CREDIT, &[], &(n as u64).to_le_bytes())
                .map_err(|e| format!("sending credits: {e}"))?;
        }
    }
    rbuf.verify("server")
}

/// Serve the client's specs until it says quit.
pub fn serve(job: &Job) -> R<()> {
    let w = job.worker();
    let ep = job.ep(1);
    let mut b = vec![0u8; 4096];
    loop {
        let n = recv(w, ep, &mut b, TAG_CTRL)?;
        let text = String::from_utf8_lossy(&b[..n]).into_owned();
        let Some(spec) = Spec::decode(&text)? else {
            return Ok(());
        };
        set_wait_mode(spec.wait);
        mem::set_heap_host(spec.heap_host);
        let res = match spec.test {
            TestKind::TagLat | TestKind::TagSyncLat | TestKind::StreamLat => {
                tag_lat_server(w, ep, &spec)
            }
            TestKind::TagBw | TestKind::TagSyncBw | TestKind::StreamBw => {
                tag_bw_server(w, ep, &spec)
            }
            TestKind::PutBw | TestKind::Get => rma_target_server(w, ep, &spec),
            TestKind::PutLat => put_lat_server(w, ep, &spec),
            TestKind::AmLat => am_lat_server(w, ep, &spec),
            TestKind::AmBw => am_bw_server(w, ep, &spec),
        };
        res.map_err(|e| format!("server, {} {} B: {e}", spec.test.name(), spec.size))?;
    }
}

/// The spec of `test` at `size` under the options.
pub fn spec_for(opts: &Options, test: TestKind, size: usize) -> Spec {
    Spec {
        test,
        size,
        iters: opts.iters_for(test, size),
        warmup: opts.warmup_for(test, size),
        window: if test.is_pingpong() { 1 } else { opts.window },
        mem: opts.mem,
        wait: opts.wait,
        heap_host: opts.heap_host,
        recv_ring: opts.recv_ring,
    }
}

/// Lines describing the client's endpoint: lanes and the protocol of each size.
pub fn describe(job: &Job, sizes: &[usize]) -> Vec<(&'static str, String)> {
    let w = job.worker();
    let ep = job.ep(0);
    let mut v = Vec::new();
    if let Ok((am, rma)) = w.lanes(ep) {
        v.push((
            "Lanes",
            format!(
                "active messages on {am}; remote memory access on {}",
                rma.as_deref().unwrap_or("(none)")
            ),
        ));
    }
    if let Ok(table) = w.proto_table(ep) {
        let mut seen: Vec<String> = Vec::new();
        for s in sizes {
            if let Some(r) = rucx::ucp::proto::lookup(&table, *s) {
                let line = format!("{} B: {} on {}", s, r.proto.name(), r.lane);
                seen.push(line);
            }
        }
        if !seen.is_empty() {
            v.push(("Tag protocols", seen.join(", ")));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_and_bad_ones_fail() {
        let s = Spec {
            test: TestKind::TagBw,
            size: 1 << 20,
            iters: 20,
            warmup: 2,
            window: 16,
            mem: (MemoryType::Host, MemoryType::Host),
            wait: WaitMode::Poll,
            heap_host: false,
            recv_ring: 0,
        };
        assert_eq!(Spec::decode(&s.encode()).unwrap(), Some(s));
        // The server's receive ring is the client's --recv-ring.
        let ring = Spec {
            recv_ring: 16 << 20,
            ..s
        };
        assert_eq!(Spec::decode(&ring.encode()).unwrap(), Some(ring));
        assert!(Spec::decode("run tag_bw 8 1 1 1 host host poll alloc x").is_err());
        // The server allocates as the client asks (`--heap-host` reaches both sides).
        let heap = Spec {
            heap_host: true,
            ..s
        };
        assert_eq!(Spec::decode(&heap.encode()).unwrap(), Some(heap));
        assert!(heap.encode().ends_with(" heap 0") && s.encode().ends_with(" alloc 0"));
        assert!(Spec::decode("run tag_bw 8 1 1 1 host host poll pool 0").is_err());
        // A spec of a build without the ring (client and server of different versions).
        assert!(Spec::decode("run tag_bw 8 1 1 1 host host poll alloc").is_err());
        let sleep = Spec {
            wait: WaitMode::Sleep,
            ..s
        };
        assert_eq!(Spec::decode(&sleep.encode()).unwrap(), Some(sleep));
        assert!(Spec::decode("run tag_bw 8 1 1 1 host host nap alloc 0").is_err());
        for mem in [
            (MemoryType::Cuda, MemoryType::Cuda),
            (MemoryType::Host, MemoryType::Cuda),
            (MemoryType::Cuda, MemoryType::Host),
        ] {
            let g = Spec { mem, ..s };
            assert_eq!(Spec::decode(&g.encode()).unwrap(), Some(g));
        }
        assert_eq!(Spec::decode("quit").unwrap(), None);
        assert!(Spec::decode("run tag_bw x 1 1 1 host host poll alloc 0").is_err());
        assert!(Spec::decode("run nope 1 1 1 1 host host poll alloc 0").is_err());
        assert!(Spec::decode("run tag_bw 8 1 1 1 host rocm poll alloc 0").is_err());
        assert!(Spec::decode("run tag_bw 8 1 1 1 host host poll").is_err());
        assert!(Spec::decode("hello").unwrap_err().contains("versions"));
    }

    /// Records the order of begins and ends, into the log the posts and waits write too; the
    /// second field is the first measured iteration.
    struct Log<'a>(&'a std::cell::RefCell<Vec<String>>, usize);

    impl Marks for Log<'_> {
        fn begin(&mut self, i: usize) {
            self.0.borrow_mut().push(format!("begin {i}"));
        }
        fn end(&mut self, i: usize) {
            self.0.borrow_mut().push(format!("end {i}"));
        }
        fn first_measured(&self) -> usize {
            self.1
        }
    }

    #[test]
    fn the_warm_up_ends_before_the_first_measured_iteration_begins() {
        for (n, window, warm) in [
            (30, 16, 10),
            (30, 4, 10),
            (30, 16, 0),
            (12, 1, 3),
            (5, 8, 5),
        ] {
            let log = std::cell::RefCell::new(Vec::new());
            let in_flight = std::cell::Cell::new(0usize);
            windowed(
                0..n,
                window,
                &mut Log(&log, warm),
                |j| {
                    in_flight.set(in_flight.get() + 1);
                    assert!(in_flight.get() <= window, "more than the window in flight");
                    log.borrow_mut().push(format!("post {j}"));
                    j
                },
                |j| {
                    in_flight.set(in_flight.get() - 1);
                    log.borrow_mut().push(format!("wait {j}"));
                    Ok(())
                },
            )
            .unwrap();
            let log = log.into_inner();
            let at = |e: String| log.iter().position(|x| *x == e);
            if let Some(begin) = at(format!("begin {warm}")) {
                for k in 0..warm {
                    let w = at(format!("wait {k}")).unwrap();
                    assert!(
                        w < begin,
                        "warm-up {k} waited after the measured run began: {log:?}"
                    );
                }
                // The measured run starts with nothing in flight.
                assert!(
                    log[..begin]
                        .iter()
                        .filter(|e| e.starts_with("post"))
                        .count()
                        == warm
                );
            }
            assert_eq!(log.iter().filter(|e| e.starts_with("wait")).count(), n);
        }
    }

    #[test]
    fn the_window_is_drained_inside_the_last_iteration() {
        for (n, window) in [(3, 16), (10, 4), (1, 1), (5, 1)] {
            let log = std::cell::RefCell::new(Vec::new());
            let in_flight = std::cell::Cell::new(0usize);
            windowed(
                0..n,
                window,
                &mut Log(&log, 0),
                |j| {
                    in_flight.set(in_flight.get() + 1);
                    assert!(in_flight.get() <= window, "more than the window in flight");
                    log.borrow_mut().push(format!("post {j}"));
                    j
                },
                |j| {
                    in_flight.set(in_flight.get() - 1);
                    log.borrow_mut().push(format!("wait {j}"));
                    Ok(())
                },
            )
            .unwrap();
            let log = log.into_inner();
            assert_eq!(in_flight.get(), 0);
            assert_eq!(log.iter().filter(|e| e.starts_with("wait")).count(), n);
            assert_eq!(log.iter().filter(|e| e.starts_with("end")).count(), n);
            // The last iteration ends after every wait: the time of a window that holds the
            // whole run is inside the measured iterations.
            let last_wait = log.iter().rposition(|e| e.starts_with("wait")).unwrap();
            assert_eq!(log.last().unwrap(), &format!("end {}", n - 1), "{log:?}");
            assert!(last_wait < log.len() - 1);
        }
        // A failed wait ends the loop with its error.
        let log = std::cell::RefCell::new(Vec::new());
        let e = windowed(
            0..4,
            2,
            &mut Log(&log, 0),
            |j| j,
            |_| Err("boom".to_string()),
        );
        assert_eq!(e.unwrap_err(), "boom");
    }

    #[test]
    fn rings_and_chunks_are_bounded() {
        // By default 1 MiB of slots and at least the window (ucx_perftest keeps its window of
        // receives in one buffer).
        let mib = crate::args::DEFAULT_RECV_RING;
        assert_eq!(ring_len(64 << 10, 16, mib), 16);
        assert_eq!(ring_len(4 << 10, 16, mib), 256);
        assert_eq!(ring_len(8, 16, mib), 1024);
        assert_eq!(ring_len(4 << 20, 1, mib), 1);
        assert_eq!(ring_len(8, 4096, 0), 1024);
        assert_eq!(ring_len(64 << 10, 16, 0), 16);
        // --recv-ring 16M (the default before): 16 MiB of slots or the window, at most 1024.
        let mib16 = 16 << 20;
        assert_eq!(ring_len(8, 16, mib16), 1024);
        assert_eq!(ring_len(64 << 10, 16, mib16), 256);
        assert_eq!(ring_len(4 << 20, 16, mib16), 16);
        assert_eq!(ring_len(4 << 20, 1, mib16), 4);
        assert_eq!(ring_len(1 << 20, 16, mib16), 16);
        assert_eq!(ring_len(1 << 30, 1, mib16), 1);
        // Memory bounded by the message: one slot of a huge message whatever the window.
        assert_eq!(ring_len(16 << 20, 16, 0), 16);
        assert_eq!(ring_len(32 << 20, 16, mib16), 8);
        assert_eq!(ring_len(256 << 20, 16, 0), 1);
        assert_eq!(ring_len((2 << 30) + 1, 16, 0), 1);
        assert_eq!(ring_len(4 << 30, 64, mib16), 1);
        for size in [1usize, 4096, 1 << 20, 100 << 20, 1 << 30] {
            for window in [1, 4, 16, 256] {
                for ring in [0, 1 << 20, 1 << 40] {
                    let n = ring_len(size, window, ring);
                    assert!(n >= 1 && n.saturating_mul(size) <= RING_BYTES.max(size));
                }
            }
        }
        assert!(chunk_len(1) >= 1024);
    }
}
