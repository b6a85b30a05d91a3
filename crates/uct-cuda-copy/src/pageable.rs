//! Copies between pageable host memory and the GPU, staged by helper threads.
//!
//! A plain copy from or to pageable memory is staged by the driver on the calling thread: one
//! core copies between the caller's pages and the driver's pinned buffers while the DMA runs,
//! so it goes at one core's copy rate (8.6 GB/s host-to-device on an H200 host against 55 GB/s
//! from pinned memory, 2026-12-01; 6-13 GB/s device-to-host). The [`Stager`] splits such a copy
//! into chunks and hands them round-robin to its threads, each with its own stream and two
//! pinned slots. Host to device: a thread copies a chunk into a slot and queues the DMA from it.
//! Device to host: a thread queues the DMA into a slot and, once it has finished (when the slot
//! is needed again, or nothing else is queued), copies the slot into the pageable destination,
//! while the DMA into its other slot runs. Several cores copy while the copy engines move the
//! other chunks (27 GB/s host-to-device with 4 threads in the same sitting). A [`Job`] counts
//! the chunks still running; the engine reports the operation once it reaches zero.
//!
//! Threads start on the first job and end when the stager is dropped (after finishing what
//! they hold).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rucx_cuda::{Event, PinnedHostBuffer, Stream, driver, memcpy_async};
use rucx_ucs::{Error, Result};

/// Largest chunk (and the size of each pinned slot).
pub const CHUNK_MAX: usize = 4 << 20;
/// Smallest chunk a copy is split into.
const CHUNK_MIN: usize = 256 << 10;
/// Copies shorter than this are left to the driver.
pub const STAGE_MIN: usize = 1 << 20;

/// Which way a staged copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Pageable host memory into device memory.
    ToDevice,
    /// Device memory into pageable host memory.
    ToHost,
}

/// The chunks of one staged copy still running, and the first error.
#[derive(Debug)]
pub struct Job {
    remaining: AtomicUsize,
    error: Mutex<Option<Error>>,
}

impl Job {
    fn chunk_done(&self, r: Result<()>) {
        if let Err(e) = r {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
        }
        self.remaining.fetch_sub(1, Ordering::AcqRel);
    }

    /// `None` while chunks run; then the result.
    pub fn result(&self) -> Option<Result<()>> {
        if self.remaining.load(Ordering::Acquire) > 0 {
            return None;
        }
        let e = self.error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Some(e.map_or(Ok(()), Err))
    }
}

struct Chunk {
    job: Arc<Job>,
    dir: Dir,
    device: u32,
    dst: u64,
    src: u64,
    len: usize,
}

// SAFETY: the addresses are plain numbers; the memory behind them is kept alive by the
// engine's pending operation until the job ends (the caller's contract of `submit`).
unsafe impl Send for Chunk {}

/// Helper threads staging pageable host-to-device copies; see the [module docs](self).
pub struct Stager {
    threads: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    senders: Vec<Sender<Chunk>>,
    handles: Vec<JoinHandle<()>>,
    next: usize,
}

impl std::fmt::Debug for Stager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Stager {
    /// A stager of `threads` helper threads (started on the first job).
    pub fn new(threads: usize) -> Stager {
        Stager {
            threads: threads.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Copy `len` bytes from `src` to `dst` through the helper threads: pageable host memory
    /// into device memory ([`Dir::ToDevice`]) or device memory into pageable host memory
    /// ([`Dir::ToHost`]), the device memory on GPU `device`'s side of the unified address space.
    ///
    /// # Safety
    /// `src..src+len` must stay readable and `dst..dst+len` writable, and neither touched by
    /// anyone else, until the returned job has ended ([`Job::result`] is `Some`).
    pub unsafe fn submit(
        &self,
        dir: Dir,
        device: u32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<Arc<Job>> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.senders.is_empty() {
            for k in 0..self.threads {
                let (tx, rx) = mpsc::channel::<Chunk>();
                let h = std::thread::Builder::new()
                    .name(format!("rucx-pageable-{k}"))
                    .spawn(move || run(rx))
                    .map_err(|e| Error::io("starting a pageable-copy thread", e))?;
                inner.senders.push(tx);
                inner.handles.push(h);
            }
        }
        let chunk = len
            .div_ceil(self.threads)
            .clamp(CHUNK_MIN, CHUNK_MAX)
            .min(len.max(1));
        let n = len.div_ceil(chunk);
        let job = Arc::new(Job {
            remaining: AtomicUsize::new(n),
            error: Mutex::new(None),
        });
        for k in 0..n {
            let off = k * chunk;
            let c = Chunk {
                job: job.clone(),
                dir,
                device,
                dst: dst + off as u64,
                src: src + off as u64,
                len: chunk.min(len - off),
            };
            let t = inner.next % inner.senders.len();
            inner.next = inner.next.wrapping_add(1);
            if let Err(mpsc::SendError(c)) = inner.senders[t].send(c) {
                // The thread is gone (it panicked): the chunk fails, the job still ends.
                c.job
                    .chunk_done(Err(Error::Internal("a pageable-copy thread ended".into())));
            }
        }
        Ok(job)
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        inner.senders.clear();
        for h in inner.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// A chunk whose copy uses a slot, and for a copy into the slot (device to host) the host
/// destination and length its bytes go to once it finished.
type InSlot = (Arc<Job>, Option<(u64, usize)>);

/// A thread's stream, pinned slots and their copies in flight on one device.
struct Slots {
    stream: Stream,
    bufs: [PinnedHostBuffer; 2],
    events: [Event; 2],
    /// The chunk each slot's copy belongs to, and for a copy into the slot (device to host)
    /// where its bytes go once it finished.
    pending: [Option<InSlot>; 2],
    next: usize,
}

impl Slots {
    fn new(device: u32) -> Result<Slots> {
        let ctx = driver()?.context(device)?;
        Ok(Slots {
            stream: Stream::new(ctx)?,
            bufs: [
                PinnedHostBuffer::new(ctx, CHUNK_MAX)?,
                PinnedHostBuffer::new(ctx, CHUNK_MAX)?,
            ],
            events: [Event::new(ctx)?, Event::new(ctx)?],
            pending: [None, None],
            next: 0,
        })
    }

    /// Wait for slot `b`'s copy, move its bytes on if it filled the slot, and end its chunk.
    fn settle(&mut self, b: usize) {
        if let Some((job, out)) = self.pending[b].take() {
            let r = self.events[b].synchronize();
            if let (Ok(()), Some((dst, len))) = (&r, out) {
                // SAFETY: the copy into the slot (`len <= CHUNK_MAX` bytes) was just waited
                // for; `dst..dst+len` is writable host memory no one else touches until the job
                // ends (`submit`'s contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.bufs[b].ptr() as *const u8,
                        dst as *mut u8,
                        len,
                    )
                };
            }
            job.chunk_done(r);
        }
    }

    fn settle_all(&mut self) {
        // The older slot first.
        let first = self.next;
        self.settle(first);
        self.settle(first ^ 1);
    }

    fn stage(&mut self, c: Chunk) {
        let b = self.next;
        self.next ^= 1;
        self.settle(b);
        let slot = self.bufs[b].ptr();
        let (queued, out) = match c.dir {
            Dir::ToDevice => {
                // SAFETY: `src..src+len` is readable host memory kept alive until the job ends
                // (`submit`'s contract); the slot holds `CHUNK_MAX >= len` bytes and no copy
                // reads it (its last one was waited for above).
                unsafe {
                    std::ptr::copy_nonoverlapping(c.src as *const u8, slot as *mut u8, c.len)
                };
                // SAFETY: the slot stays allocated and unwritten until its event is waited for;
                // the destination is writable device memory kept alive until the job ends.
                (
                    unsafe { memcpy_async(c.dst, slot, c.len, &self.stream) },
                    None,
                )
            }
            // SAFETY: the source is readable device memory kept alive until the job ends; the
            // slot holds `CHUNK_MAX >= len` bytes, no copy uses it (its last one was waited
            // for above) and it is read only once this copy's event was waited for.
            Dir::ToHost => (
                unsafe { memcpy_async(slot, c.src, c.len, &self.stream) },
                Some((c.dst, c.len)),
            ),
        };
        let r = queued.and_then(|()| self.events[b].record(&self.stream));
        match r {
            Ok(()) => self.pending[b] = Some((c.job, out)),
            Err(e) => {
                // Whatever was queued finishes before the slot is used again.
                let _ = self.stream.synchronize();
                c.job.chunk_done(Err(e));
            }
        }
    }
}

fn run(rx: Receiver<Chunk>) {
    let mut devs: HashMap<u32, Slots> = HashMap::new();
    loop {
        let c = match rx.try_recv() {
            Ok(c) => c,
            Err(TryRecvError::Empty) => {
                // Nothing queued: end what is in flight before sleeping on the channel.
                devs.values_mut().for_each(Slots::settle_all);
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            }
            Err(TryRecvError::Disconnected) => {
                devs.values_mut().for_each(Slots::settle_all);
                return;
            }
        };
        let slots = match devs.entry(c.device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => match Slots::new(c.device) {
                Ok(s) => v.insert(s),
                Err(e) => {
                    c.job.chunk_done(Err(e));
                    continue;
                }
            },
        };
        slots.stage(c);
    }
}
