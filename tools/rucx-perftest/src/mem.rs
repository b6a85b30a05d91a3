//! Buffers of the memory type `-m` asks for (host vectors, or GPU allocations from rucx-cuda),
//! and the GPU copy bounds of `--bounds`.
//!
//! Each rank uses GPU `rank % device_count` (the server, rank 0, GPU 0; the client, rank 1,
//! GPU 1 when two are visible). GPU buffers reach UCP through [`SendBuf::from_raw`] and
//! [`RecvBuf::from_raw`]; UCP classifies them and picks the GPU path (cuda_ipc zero-copy, a
//! staged pipeline through pinned host fragments, or eager through a bounce buffer).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rucx::ucp::{RecvBuf, SendBuf};
use rucx::{Memory, MemoryType};
use rucx_cuda::{DeviceBuffer, Driver, HostRegistration, PinnedHostBuffer, PrimaryContext, Stream};

use crate::run::R;

/// The error of `-m cuda` without a usable CUDA driver, with the driver's reason.
pub fn no_driver(e: &rucx::Error) -> String {
    let reason = match e {
        rucx::Error::Unavailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    };
    format!("-m cuda needs a CUDA driver: {reason}")
}

/// True when either memory type is GPU memory.
pub fn needs_gpu(mem: (MemoryType, MemoryType)) -> bool {
    mem.0 == MemoryType::Cuda || mem.1 == MemoryType::Cuda
}

/// The GPU of one rank.
#[derive(Debug, Clone, Copy)]
pub struct Gpu {
    /// Its primary context (bound to the calling thread by [`Gpu::open`]).
    pub ctx: &'static PrimaryContext,
    /// CUDA ordinal.
    pub ordinal: u32,
    /// Visible devices.
    pub count: u32,
    /// The loaded driver.
    pub driver: &'static Driver,
}

impl Gpu {
    /// The GPU of `rank` (`rank % device_count`), its context bound to this thread.
    pub fn open(rank: usize) -> R<Gpu> {
        Gpu::open_with(rucx_cuda::driver(), rank)
    }

    /// [`Gpu::open`] with the result of loading the driver given (for tests).
    pub fn open_with(driver: rucx::Result<&'static Driver>, rank: usize) -> R<Gpu> {
        let driver = driver.map_err(|e| no_driver(&e))?;
        let count = driver.device_count().max(1);
        let ordinal = (rank % count as usize) as u32;
        let ctx = driver
            .context(ordinal)
            .map_err(|e| format!("-m cuda: rank {rank} on GPU {ordinal}: {e}"))?;
        ctx.bind()
            .map_err(|e| format!("-m cuda: rank {rank} on GPU {ordinal}: {e}"))?;
        Ok(Gpu {
            ctx,
            ordinal,
            count,
            driver,
        })
    }

    /// `GPU 1 of 2 (NVIDIA H200)`.
    pub fn describe(&self) -> String {
        let name = self
            .driver
            .device(self.ordinal)
            .map(|d| d.name.clone())
            .unwrap_or_default();
        format!("GPU {} of {} ({name})", self.ordinal, self.count)
    }
}

/// Open the GPU when either memory type needs one.
pub fn gpu_for(mem: (MemoryType, MemoryType), rank: usize) -> R<Option<Gpu>> {
    if needs_gpu(mem) {
        Gpu::open(rank).map(Some)
    } else {
        Ok(None)
    }
}

/// Whether host buffers are page-locked (`--pin-host`), for the whole process.
static PIN_HOST: AtomicBool = AtomicBool::new(false);

/// Page-lock the host buffers made from now on (`--pin-host`).
pub fn set_pin_host(on: bool) {
    PIN_HOST.store(on, Ordering::Relaxed);
}

/// The context host buffers are allocated from (`Context::mem_alloc`), unless `--heap-host`
/// or `--pin-host`; set once the job has started.
static HOST_CTX: std::sync::OnceLock<rucx::Context> = std::sync::OnceLock::new();

/// Allocate the host buffers made from now on through `ctx` (ucx_perftest's `ucp_mem_map` with
/// `UCP_MEM_MAP_ALLOCATE`: shared memory when a transport offers it).
pub fn set_host_context(ctx: &rucx::Context) {
    let _ = HOST_CTX.set(ctx.clone());
}

/// A host buffer: from rucx's allocation (see [`set_host_context`]), or a heap vector,
/// page-locked with `cuMemHostRegister` under `--pin-host`.
#[derive(Debug)]
pub struct HostMem {
    /// First: the registration goes before the memory it covers.
    pin: Option<HostRegistration>,
    v: Vec<u8>,
    /// The memory instead of `v` when allocated through rucx.
    alloc: Option<rucx::HostAlloc>,
}

impl HostMem {
    /// A copy of `v`, page-locked when `--pin-host` asks (an empty vector is never
    /// registered).
    pub fn new(v: Vec<u8>) -> R<HostMem> {
        if HostMem::from_rucx(v.len()) {
            return HostMem::with(v.len(), |b| b.copy_from_slice(&v));
        }
        HostMem::heap(v)
    }

    /// Whether `len` bytes come from rucx's allocation.
    fn from_rucx(len: usize) -> bool {
        !PIN_HOST.load(Ordering::Relaxed) && len > 0 && HOST_CTX.get().is_some()
    }

    /// `len` bytes written by `fill` where they stay: the buffer is the only copy (a message
    /// of the size of the host's memory is never held twice).
    pub fn with(len: usize, fill: impl FnOnce(&mut [u8])) -> R<HostMem> {
        if HostMem::from_rucx(len)
            && let Some(ctx) = HOST_CTX.get()
        {
            let mut a = ctx
                .mem_alloc(len)
                .map_err(|e| format!("allocating {len} bytes of host memory: {e}"))?;
            fill(&mut a);
            return Ok(HostMem {
                pin: None,
                v: Vec::new(),
                alloc: Some(a),
            });
        }
        let mut v = vec![0u8; len];
        fill(&mut v);
        HostMem::heap(v)
    }

    /// `v` itself, page-locked when `--pin-host` asks.
    fn heap(mut v: Vec<u8>) -> R<HostMem> {
        let pin = if PIN_HOST.load(Ordering::Relaxed) && !v.is_empty() {
            let ctx = rucx_cuda::driver()
                .and_then(|d| d.any_context())
                .map_err(|e| format!("--pin-host: {e}"))?;
            // SAFETY: the vector's heap allocation stays where it is (it is never resized or
            // moved out: `HostMem` only lends it) and is freed after the registration, which
            // is declared first and so dropped first.
            let r = unsafe { HostRegistration::new(ctx, v.as_mut_ptr(), v.len()) }
                .map_err(|e| format!("--pin-host: page-locking {} bytes: {e}", v.len()))?;
            Some(r)
        } else {
            None
        };
        Ok(HostMem {
            pin,
            v,
            alloc: None,
        })
    }

    /// Whether the buffer is page-locked.
    pub fn pinned(&self) -> bool {
        self.pin.is_some()
    }
}

impl std::ops::Deref for HostMem {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.alloc {
            Some(a) => a,
            None => &self.v,
        }
    }
}

impl std::ops::DerefMut for HostMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.alloc {
            Some(a) => a,
            None => &mut self.v,
        }
    }
}

fn dev_alloc(gpu: Option<&Gpu>, len: usize, what: &str) -> R<DeviceBuffer> {
    let gpu = gpu.ok_or_else(|| format!("{what}: GPU memory asked for but no GPU opened"))?;
    DeviceBuffer::new(gpu.ctx, len.max(1)).map_err(|e| format!("{what}: {e}"))
}

/// One buffer of host or GPU memory of `len` bytes.
#[derive(Debug)]
pub enum Buf {
    /// A host vector (page-locked under `--pin-host`).
    Host(HostMem),
    /// A device allocation (at least one byte; `len` may be 0).
    Dev {
        /// The allocation.
        mem: DeviceBuffer,
        /// The message size.
        len: usize,
    },
}

impl Buf {
    /// A send buffer holding `data`, ready to send (device fills are waited for).
    pub fn filled(mt: MemoryType, gpu: Option<&Gpu>, data: &[u8]) -> R<Buf> {
        match mt {
            MemoryType::Host => Ok(Buf::Host(HostMem::new(data.to_vec())?)),
            _ => {
                let mut mem = dev_alloc(gpu, data.len(), "send buffer")?;
                // Complete on return: the buffer can be sent right away.
                mem.copy_from_host(0, data)
                    .map_err(|e| format!("filling the send buffer: {e}"))?;
                Ok(Buf::Dev {
                    mem,
                    len: data.len(),
                })
            }
        }
    }

    /// A send buffer of `len` bytes of [`pattern_byte`]s: the only copy of the message on this
    /// side (a device buffer is filled through bounded host chunks).
    pub fn pattern(mt: MemoryType, gpu: Option<&Gpu>, len: usize) -> R<Buf> {
        match mt {
            MemoryType::Host => Ok(Buf::Host(HostMem::with(len, |b| {
                b.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = pattern_byte(i))
            })?)),
            _ => {
                let mut mem = dev_alloc(gpu, len, "send buffer")?;
                let mut off = 0;
                while off < len {
                    let n = CHUNK.min(len - off);
                    let part: Vec<u8> = (off..off + n).map(pattern_byte).collect();
                    // Complete on return: the buffer can be sent right away.
                    mem.copy_from_host(off, &part)
                        .map_err(|e| format!("filling the send buffer: {e}"))?;
                    off += n;
                }
                Ok(Buf::Dev { mem, len })
            }
        }
    }

    /// Check that the buffer holds the [`pattern_byte`]s, without a copy of the message (a
    /// device buffer is read back in bounded chunks).
    pub fn verify(&self, what: &str) -> R<()> {
        match self {
            Buf::Host(v) => verify_pattern(what, v, 0, v.len()),
            Buf::Dev { mem, len } => verify_dev(what, mem, 0, *len),
        }
    }

    /// A receive buffer with every byte written (host pages faulted in), last byte 0.
    pub fn touched(mt: MemoryType, gpu: Option<&Gpu>, len: usize) -> R<Buf> {
        match mt {
            MemoryType::Host => Ok(Buf::Host(HostMem::with(len, touch)?)),
            _ => {
                let mut mem = dev_alloc(gpu, len, "receive buffer")?;
                mem.fill(0xee)
                    .map_err(|e| format!("clearing the receive buffer: {e}"))?;
                Ok(Buf::Dev { mem, len })
            }
        }
    }

    /// The message size.
    pub fn len(&self) -> usize {
        match self {
            Buf::Host(v) => v.len(),
            Buf::Dev { len, .. } => *len,
        }
    }

    /// True for a 0-byte message.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as a send buffer.
    pub fn send_buf(&self) -> SendBuf<'_> {
        match self {
            Buf::Host(v) => SendBuf::from(&v[..]),
            Buf::Dev { mem, len } => mem.slice(..*len).into(),
        }
    }

    /// The buffer as a receive buffer.
    pub fn recv_buf(&mut self) -> RecvBuf<'_> {
        match self {
            Buf::Host(v) => RecvBuf::from(&mut v[..]),
            Buf::Dev { mem, len } => mem.slice_mut(..*len).into(),
        }
    }

    /// The contents, copied to the host.
    pub fn read(&self) -> R<Vec<u8>> {
        match self {
            Buf::Host(v) => Ok(v.to_vec()),
            Buf::Dev { mem, len } => {
                let mut out = vec![0u8; *len];
                mem.copy_to_host(0, &mut out)
                    .map_err(|e| format!("reading the receive buffer back: {e}"))?;
                Ok(out)
            }
        }
    }
}

/// `count` receive buffers of `size` bytes: slices of one host or device allocation (one
/// allocation, so a peer maps it once, posix or cuda_ipc, as a real application's pool would
/// be).
#[derive(Debug)]
pub enum Ring {
    /// One host buffer of `count * size` bytes (page-locked under `--pin-host`).
    Host {
        /// The allocation.
        mem: HostMem,
        /// Bytes per slot.
        size: usize,
        /// Slots.
        count: usize,
    },
    /// One device allocation of `count * size` bytes.
    Dev {
        /// The allocation.
        mem: DeviceBuffer,
        /// Bytes per slot.
        size: usize,
        /// Slots.
        count: usize,
    },
}

impl Ring {
    /// A ring of `count` touched receive buffers of `size` bytes.
    pub fn new(mt: MemoryType, gpu: Option<&Gpu>, size: usize, count: usize) -> R<Ring> {
        match mt {
            MemoryType::Host => {
                let total = size.checked_mul(count).ok_or("receive ring too large")?;
                // Each slot as `Buf::touched` makes it.
                let mem = HostMem::with(total, |v| {
                    if size > 0 {
                        v.chunks_mut(size).for_each(touch);
                    }
                })?;
                Ok(Ring::Host { mem, size, count })
            }
            _ => {
                let total = size.checked_mul(count).ok_or("receive ring too large")?;
                let mut mem = dev_alloc(gpu, total, "receive ring")?;
                mem.fill(0xee)
                    .map_err(|e| format!("clearing the receive ring: {e}"))?;
                Ok(Ring::Dev { mem, size, count })
            }
        }
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        match self {
            Ring::Host { count, .. } | Ring::Dev { count, .. } => *count,
        }
    }

    /// True when there are no slots.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` slots as receive buffers (disjoint ranges).
    pub fn slots(&mut self, n: usize) -> Vec<RecvBuf<'_>> {
        match self {
            Ring::Host { mem, size, count } => {
                let n = n.min(*count);
                if *size == 0 {
                    return (0..n).map(|_| RecvBuf::from(&mut [][..])).collect();
                }
                mem[..*size * n]
                    .chunks_mut(*size)
                    .map(RecvBuf::from)
                    .collect()
            }
            Ring::Dev { mem, size, count } => {
                // Disjoint slots split off one mutable borrow of the allocation.
                let mut rest = mem.slice_mut(..*size * *count);
                let mut out = Vec::with_capacity(n.min(*count));
                for _ in 0..n.min(*count) {
                    let (slot, tail) = rest.split_at(*size);
                    out.push(RecvBuf::from(slot));
                    rest = tail;
                }
                out
            }
        }
    }

    /// Check that slot `k` holds the [`pattern_byte`]s (without a copy of the message).
    pub fn verify(&self, k: usize, what: &str) -> R<()> {
        if k >= self.len() {
            return Err(format!("no receive slot {k}"));
        }
        match self {
            Ring::Host { mem, size, .. } => {
                verify_pattern(what, &mem[k * *size..(k + 1) * *size], 0, *size)
            }
            Ring::Dev { mem, size, .. } => verify_dev(what, mem, k * *size, *size),
        }
    }

    /// Slot `k`'s contents, copied to the host.
    pub fn read(&self, k: usize) -> R<Vec<u8>> {
        match self {
            Ring::Host { mem, size, count } => {
                if k >= *count {
                    return Err(format!("no receive slot {k}"));
                }
                Ok(mem[k * *size..(k + 1) * *size].to_vec())
            }
            Ring::Dev { mem, size, count } => {
                if k >= *count {
                    return Err(format!("no receive slot {k}"));
                }
                let mut out = vec![0u8; *size];
                mem.copy_to_host(k * *size, &mut out)
                    .map_err(|e| format!("reading receive slot {k} back: {e}"))?;
                Ok(out)
            }
        }
    }
}

/// This process's peak resident memory (`VmHWM`) in KiB, where `/proc` tells it.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Bytes a device buffer is filled or checked through at a time.
const CHUNK: usize = 64 << 20;

/// A receive buffer before a message lands: 0xee, the last byte 0 (as `run::touched`).
fn touch(b: &mut [u8]) {
    b.fill(0xee);
    if let Some(l) = b.last_mut() {
        *l = 0;
    }
}

/// Byte `i` of every message sent (`run::pattern` is these bytes).
pub fn pattern_byte(i: usize) -> u8 {
    (i.wrapping_mul(7).wrapping_add(1)) as u8
}

/// Check that `got`, bytes `offset..offset + got.len()` of a message of `total` bytes, are the
/// [`pattern_byte`]s; the error names the first differing byte.
pub fn verify_pattern(what: &str, got: &[u8], offset: usize, total: usize) -> R<()> {
    match got
        .iter()
        .enumerate()
        .position(|(i, &b)| b != pattern_byte(offset + i))
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: data received wrong at byte {} of {total} (got {:#04x}, sent {:#04x})",
            offset + i,
            got[i],
            pattern_byte(offset + i)
        )),
    }
}

/// [`verify_pattern`] of `len` bytes of `mem` from `base`, read back in chunks.
fn verify_dev(what: &str, mem: &DeviceBuffer, base: usize, len: usize) -> R<()> {
    let mut part = vec![0u8; CHUNK.min(len)];
    let mut off = 0;
    while off < len {
        let n = CHUNK.min(len - off);
        mem.copy_to_host(base + off, &mut part[..n])
            .map_err(|e| format!("{what}: reading the receive buffer back: {e}"))?;
        verify_pattern(what, &part[..n], off, len)?;
        off += n;
    }
    Ok(())
}

/// Compare received bytes with what was sent; the error names the first differing byte.
pub fn verify(what: &str, got: &[u8], want: &[u8]) -> R<()> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: received {} bytes, expected {}",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: data received wrong at byte {i} of {} (got {:#04x}, sent {:#04x})",
            want.len(),
            got[i],
            want[i]
        )),
    }
}

/// Copy bandwidths measured on streams, in bytes per second.
#[derive(Debug, Clone, PartialEq)]
pub struct Bounds {
    /// Message size.
    pub size: usize,
    /// Copies timed per bound.
    pub iters: usize,
    /// Pinned host -> device of GPU 0 (the staged path's last copy).
    pub h2d: f64,
    /// Device of GPU `count - 1` -> pinned host (the staged path's first copy).
    pub d2h: f64,
    /// Pageable host -> device of GPU 0 (a plain `cuMemcpy` from ordinary host memory: the
    /// floor for host -> GPU transfers of pageable buffers).
    pub h2d_pageable: f64,
    /// Device of GPU 0 -> pageable host.
    pub d2h_pageable: f64,
    /// GPU 0 -> GPU 1 peer copy, or why there is none.
    pub p2p: Result<f64, String>,
}

/// Measure the copy bounds at `size` bytes: each copy queued `iters` times on one stream
/// after one untimed copy, timed until the stream is done.
pub fn measure_bounds(size: usize, iters: usize) -> R<Bounds> {
    let g0 = Gpu::open(0)?;
    let size = size.max(1);
    let iters = iters.max(1);
    let e = |what: &'static str| move |e: rucx::Error| format!("bounds, {what}: {e}");
    let host = PinnedHostBuffer::new(g0.ctx, size).map_err(e("pinned host buffer"))?;
    let dev0 = DeviceBuffer::new(g0.ctx, size).map_err(e("GPU 0 buffer"))?;
    let timed = |stream: &Stream, dst: u64, src: u64| -> R<f64> {
        let run = |k: usize| -> R<()> {
            for _ in 0..k {
                // SAFETY: `dst` and `src` are live allocations of at least `size` bytes
                // that outlive this closure, and the stream is synchronized before they can
                // be dropped.
                unsafe { rucx_cuda::memcpy_async(dst, src, size, stream) }.map_err(e("copy"))?;
            }
            stream.synchronize().map_err(e("stream"))
        };
        run(1)?;
        let t = Instant::now();
        run(iters)?;
        Ok((size * iters) as f64 / t.elapsed().as_secs_f64())
    };
    let s0 = Stream::new(g0.ctx).map_err(e("stream on GPU 0"))?;
    let h2d = timed(&s0, dev0.ptr(), host.ptr())?;
    // Pageable memory, every page touched first (as a receive buffer would be).
    let mut pageable = crate::run::touched(size);
    let h2d_pageable = timed(&s0, dev0.ptr(), pageable.as_ptr() as u64)?;
    let d2h_pageable = timed(&s0, pageable.as_mut_ptr() as u64, dev0.ptr())?;
    let last = g0.count - 1;
    let d2h = if last == 0 {
        timed(&s0, host.ptr(), dev0.ptr())?
    } else {
        let c = g0.driver.context(last).map_err(e("GPU context"))?;
        let dev = DeviceBuffer::new(c, size).map_err(e("GPU buffer"))?;
        let s = Stream::new(c).map_err(e("stream"))?;
        timed(&s, host.ptr(), dev.ptr())?
    };
    let p2p = if g0.count < 2 {
        Err(format!(
            "needs two GPUs ({} visible)",
            g0.driver.device_count()
        ))
    } else {
        let c1 = g0.driver.context(1).map_err(e("GPU 1 context"))?;
        let dev1 = DeviceBuffer::new(c1, size).map_err(e("GPU 1 buffer"))?;
        let direct = g0.driver.can_access_peer(0, 1).map_err(e("peer query"))?;
        if direct {
            g0.ctx.enable_peer_access(c1).map_err(e("peer access"))?;
        }
        let r = timed(&s0, dev1.ptr(), dev0.ptr());
        match (r, direct) {
            (Ok(v), true) => Ok(v),
            (Ok(_), false) => Err("GPU 0 cannot access GPU 1 directly (no peer path)".into()),
            (Err(err), _) => return Err(err),
        }
    };
    g0.ctx.bind().map_err(e("GPU 0 context"))?;
    Ok(Bounds {
        size,
        iters,
        h2d,
        d2h,
        h2d_pageable,
        d2h_pageable,
        p2p,
    })
}

/// One-copy latencies, microseconds (the median of single copies, each queued alone and polled
/// by an event until done, as a protocol waits for its copy).
#[derive(Debug, Clone, PartialEq)]
pub struct LatBounds {
    /// Message size.
    pub size: usize,
    /// Copies timed per bound.
    pub iters: usize,
    /// Pinned host -> device of GPU 0.
    pub h2d_us: f64,
    /// Device of GPU `count - 1` -> pinned host.
    pub d2h_us: f64,
    /// GPU 0 -> GPU 1 peer copy, or why there is none.
    pub p2p_us: Result<f64, String>,
}

/// Measure one copy of `size` bytes `iters` times per direction (after a few untimed ones):
/// queue it, record an event, poll the event until the copy is done. The median is the floor
/// a message that needs one such copy cannot beat.
pub fn measure_copy_latency(size: usize, iters: usize) -> R<LatBounds> {
    let g0 = Gpu::open(0)?;
    let size = size.max(1);
    let iters = iters.max(1);
    let e = |what: &'static str| move |e: rucx::Error| format!("latency bounds, {what}: {e}");
    let host = PinnedHostBuffer::new(g0.ctx, size).map_err(e("pinned host buffer"))?;
    let dev0 = DeviceBuffer::new(g0.ctx, size).map_err(e("GPU 0 buffer"))?;
    let timed = |ctx: &'static PrimaryContext, stream: &Stream, dst: u64, src: u64| -> R<f64> {
        let ev = rucx_cuda::Event::new(ctx).map_err(e("event"))?;
        let mut us = Vec::with_capacity(iters);
        for k in 0..iters + 10 {
            let t = Instant::now();
            // SAFETY: `dst` and `src` are live allocations of at least `size` bytes that
            // outlive this closure; the copy is done (event polled) before the next starts.
            unsafe { rucx_cuda::memcpy_async(dst, src, size, stream) }.map_err(e("copy"))?;
            ev.record(stream).map_err(e("event record"))?;
            while !ev.query().map_err(e("event query"))? {
                std::hint::spin_loop();
            }
            if k >= 10 {
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        us.sort_by(f64::total_cmp);
        Ok(us[us.len() / 2])
    };
    let s0 = Stream::new(g0.ctx).map_err(e("stream on GPU 0"))?;
    let h2d_us = timed(g0.ctx, &s0, dev0.ptr(), host.ptr())?;
    let last = g0.count - 1;
    let d2h_us = if last == 0 {
        timed(g0.ctx, &s0, host.ptr(), dev0.ptr())?
    } else {
        let c = g0.driver.context(last).map_err(e("GPU context"))?;
        let dev = DeviceBuffer::new(c, size).map_err(e("GPU buffer"))?;
        let s = Stream::new(c).map_err(e("stream"))?;
        timed(c, &s, host.ptr(), dev.ptr())?
    };
    let p2p_us = if g0.count < 2 {
        Err(format!(
            "needs two GPUs ({} visible)",
            g0.driver.device_count()
        ))
    } else {
        let c1 = g0.driver.context(1).map_err(e("GPU 1 context"))?;
        let dev1 = DeviceBuffer::new(c1, size).map_err(e("GPU 1 buffer"))?;
        if g0.driver.can_access_peer(0, 1).map_err(e("peer query"))? {
            // Already enabled (an earlier measurement) is fine.
            let _ = g0.ctx.enable_peer_access(c1);
            g0.ctx.bind().map_err(e("GPU 0 context"))?;
            Ok(timed(g0.ctx, &s0, dev1.ptr(), dev0.ptr())?)
        } else {
            Err("GPU 0 cannot access GPU 1 directly (no peer path)".into())
        }
    };
    g0.ctx.bind().map_err(e("GPU 0 context"))?;
    Ok(LatBounds {
        size,
        iters,
        h2d_us,
        d2h_us,
        p2p_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_names_the_reason() {
        let e = rucx::Error::Unavailable {
            component: "cuda".into(),
            reason: "no CUDA driver found: libcuda.so could not be loaded".into(),
        };
        assert_eq!(
            no_driver(&e),
            "-m cuda needs a CUDA driver: no CUDA driver found: libcuda.so could not be loaded"
        );
        let err = Gpu::open_with(Err(e), 1).unwrap_err();
        assert!(err.starts_with("-m cuda needs a CUDA driver: no CUDA driver found"));
    }

    #[test]
    fn this_machine_opens_a_gpu_or_says_why_not() {
        // Without a driver (this machine, CI) the real error carries the loader's reason;
        // with one (the GPU machine) rank 1 lands on GPU 1 % count.
        match rucx_cuda::driver() {
            Err(e) => {
                let reason = match &e {
                    rucx::Error::Unavailable { reason, .. } => reason.clone(),
                    o => o.to_string(),
                };
                let err = Gpu::open(1).unwrap_err();
                assert_eq!(err, format!("-m cuda needs a CUDA driver: {reason}"));
                let err = gpu_for((MemoryType::Host, MemoryType::Cuda), 0).unwrap_err();
                assert!(err.starts_with("-m cuda needs a CUDA driver: "), "{err}");
            }
            Ok(d) => {
                let g = Gpu::open(1).unwrap();
                assert_eq!(g.ordinal, 1 % d.device_count());
            }
        }
        assert!(
            gpu_for((MemoryType::Host, MemoryType::Host), 0)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn host_buffers_and_rings() {
        let b = Buf::filled(MemoryType::Host, None, &[1, 2, 3]).unwrap();
        assert_eq!(b.read().unwrap(), vec![1, 2, 3]);
        assert_eq!(b.send_buf().len(), 3);
        let mut r = Buf::touched(MemoryType::Host, None, 4).unwrap();
        assert_eq!(r.recv_buf().len(), 4);
        assert_eq!(r.read().unwrap(), vec![0xee, 0xee, 0xee, 0]);
        let mut ring = Ring::new(MemoryType::Host, None, 8, 3).unwrap();
        assert_eq!(ring.slots(2).len(), 2);
        assert_eq!(ring.slots(9).len(), 3);
        assert_eq!(ring.read(2).unwrap().len(), 8);
        assert!(ring.read(3).is_err());
        // Asking for GPU memory without a GPU is an error, not a panic.
        let e = Buf::touched(MemoryType::Cuda, None, 4).unwrap_err();
        assert!(e.contains("no GPU opened"), "{e}");
    }

    #[test]
    fn verify_names_the_first_bad_byte() {
        assert!(verify("x", &[1, 2], &[1, 2]).is_ok());
        let p = crate::run::pattern(1000);
        assert!(verify_pattern("x", &p, 0, 1000).is_ok());
        assert!(verify_pattern("x", &p[10..], 10, 1000).is_ok());
        let e = verify_pattern("x", &p[10..], 11, 1000).unwrap_err();
        assert!(e.contains("byte 11 of 1000"), "{e}");
        let b = Buf::pattern(MemoryType::Host, None, 300).unwrap();
        assert!(b.verify("b").is_ok());
        assert_eq!(b.read().unwrap(), crate::run::pattern(300));
        let mut r = Ring::new(MemoryType::Host, None, 5, 2).unwrap();
        assert!(r.verify(1, "r").unwrap_err().contains("byte 0 of 5"));
        if let Ring::Host { mem, .. } = &mut r {
            mem[5..10].copy_from_slice(&crate::run::pattern(5));
        }
        assert!(r.read(0).unwrap() == [0xee, 0xee, 0xee, 0xee, 0]);
        assert!(r.verify(1, "r").is_ok() && r.verify(2, "r").is_err());
        let e = verify("tag_bw", &[1, 9, 3], &[1, 2, 3]).unwrap_err();
        assert!(e.contains("at byte 1 of 3"), "{e}");
        assert!(verify("x", &[1], &[1, 2]).unwrap_err().contains("1 bytes"));
    }
}
