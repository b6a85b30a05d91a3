//! The copy engine shared by the CUDA transports: asynchronous copies on per-device streams,
//! completion polled by progress.
//!
//! Work goes to *lanes*: one non-blocking stream per ([`LaneKey::device`], [`LaneKey::lane`])
//! pair, created on first use. Each posted operation queues its copies on one lane and then
//! says when they are done: the lane's completion word (pinned host memory the GPU writes,
//! [`rucx_cuda::CompletionWord`]) gets the operation's lane sequence number, by
//! `cuStreamWriteValue64` after the copies or by the copy kernel itself; where words are off
//! or unsupported, an event is recorded instead. [`CopyEngine::progress`] looks at the oldest
//! operation of every lane (work of one stream completes in order: one load of the word, or an
//! event query) and reports [`Event::Completion`] with the operation's token.
//!
//! A lone device-to-device copy of at most `RUCX_CUDA_COPY_KERNEL_MAX` bytes whose two ends the
//! pointer cache knows as device memory of the lane's GPU runs as a one-block kernel
//! ([`rucx_cuda::CopyKernel`]) instead of `cuMemcpyAsync` (about 2 us less per small GPU
//! message); everything else is `cuMemcpyAsync`.
//! Any number of operations (up to the configured bound) can be in flight at once, on one lane
//! or several.
//!
//! Sleeping callers: while the engine is armed ([`CopyEngine::arm`], until the next
//! [`progress`](CopyEngine::progress)), every posted operation also queues a host function after
//! its copies that signals the engine's eventfd ([`CopyEngine::event_fd`];
//! `Stream::signal_fd_when_done`), so a finished copy wakes a sleeping worker. A worker that
//! polls pays nothing of this (a host function on the stream costs tens of microseconds per
//! copy: small GPU messages went from 10 to 150 us with it on every copy). Arming reports busy
//! while a finished operation waits for progress or an operation posted unarmed (without a
//! signal) is pending, so the caller polls until those are done instead of sleeping past them.
//!
//! Whatever keeps the memory of an operation alive (memory handles, opened IPC mappings) is
//! handed to [`CopyEngine::post`] and dropped only once the copy has finished, so a buffer is
//! never released under a transfer. Dropping the engine waits for every stream.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::os::fd::RawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rucx_cuda::{
    CompletionWord, CopyKernel, Event as CuEvent, SmallCopies, Stream, driver, memcpy_async,
};
use rucx_ucs::event::EventFd;
use rucx_ucs::{Error, Result};
use rucx_uct::{Event, OpStatus};

use crate::pageable::{Dir, Job, STAGE_MIN, Stager};
use rucx_cuda::{PtrKind, classify};
use std::sync::Arc;

/// Which stream an operation runs on: a device and a lane number chosen by the transport
/// (for example one lane per copy direction).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaneKey {
    /// CUDA ordinal of the device whose context owns the stream.
    pub device: u32,
    /// Transport-defined lane number.
    pub lane: u8,
}

/// One copy of `len` bytes from `src` to `dst` (addresses in this process's unified address
/// space: host, device or mapped peer memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes.
    pub len: usize,
}

/// Something that must stay alive until an operation's copies have finished.
pub type KeepAlive = Box<dyn Any + Send>;

/// Events kept for reuse per device, at most.
const EVENT_POOL_MAX: usize = 128;

/// What says that a pending operation finished.
enum Waiter {
    /// An event recorded after its copies on the lane's stream.
    Event(CuEvent),
    /// The lane's completion word reaching this lane sequence number.
    Word(u64),
    /// A copy out of pageable memory staged by the helper threads ([`crate::pageable`]).
    Job(Arc<Job>),
}

impl Waiter {
    /// `Ok(false)` while running; `word` is the lane's completion word.
    fn query(&self, word: Option<&CompletionWord>) -> Result<bool> {
        match self {
            Waiter::Event(e) => e.query(),
            Waiter::Word(seq) => match word {
                Some(w) => Ok(w.value() >= *seq),
                None => Err(Error::Internal(
                    "a CUDA copy waits for a completion word its lane lacks".into(),
                )),
            },
            Waiter::Job(j) => j.result().transpose().map(|r| r.is_some()),
        }
    }
}

struct Pending {
    seq: u64,
    waiter: Waiter,
    /// Reported when it finished.
    token: u64,
    /// A host function queued after it signals the engine's eventfd.
    signals: bool,
    _keep: Vec<KeepAlive>,
}

struct LaneState {
    key: LaneKey,
    stream: Stream,
    pending: VecDeque<Pending>,
    /// Written by the GPU with each finished operation's lane sequence number (`None`: the
    /// lane records events).
    word: Option<CompletionWord>,
    /// The last lane sequence number handed out (the word's target values).
    issued: u64,
}

impl LaneState {
    /// Ask the stream to store the next lane sequence number into the completion word once
    /// what is queued has finished; the number to wait for.
    fn write_word(&mut self) -> Result<u64> {
        let w = self.word.as_ref().expect("called with a word");
        let seq = self.issued + 1;
        // SAFETY: the word is pinned, device-mapped host memory owned by this lane, which is
        // dropped only after its stream was synchronized (`State::drop`).
        unsafe { self.stream.write_value64(w.device_addr(), seq) }?;
        self.issued = seq;
        Ok(seq)
    }
}

struct State {
    lanes: Vec<LaneState>,
    free_events: HashMap<u32, Vec<CuEvent>>,
    max_inflight: usize,
    inflight: usize,
    next_seq: u64,
    /// Flushes waiting: (every operation with a smaller sequence number must finish, token).
    flushes: VecDeque<(u64, u64)>,
    /// Fault injection for tests: the next post fails to queue its copy of this index.
    fail_copy: Option<usize>,
    /// Kernels for small copies, completion words.
    small: SmallCopies,
}

impl State {
    fn lane(&mut self, key: LaneKey) -> Result<&mut LaneState> {
        let idx = self.lane_index(key)?;
        Ok(&mut self.lanes[idx])
    }

    /// The index of `key`'s lane in `lanes`, made on first use.
    fn lane_index(&mut self, key: LaneKey) -> Result<usize> {
        let idx = match self.lanes.iter().position(|l| l.key == key) {
            Some(i) => i,
            None => {
                let ctx = driver()?.context(key.device)?;
                let stream = Stream::new(ctx)?;
                let word = if self.small.completion_words {
                    CompletionWord::new(ctx)
                        .inspect_err(|e| {
                            tracing::info!(
                                "GPU {}: CUDA copies are tracked by events: {e}",
                                key.device
                            )
                        })
                        .ok()
                } else {
                    None
                };
                if self.small.kernel_max > 0 {
                    // Start loading the kernel now, off this thread.
                    let _ = CopyKernel::get(ctx);
                }
                self.lanes.push(LaneState {
                    key,
                    stream,
                    pending: VecDeque::new(),
                    word,
                    issued: 0,
                });
                self.lanes.len() - 1
            }
        };
        Ok(idx)
    }

    fn take_event(&mut self, device: u32) -> Result<CuEvent> {
        if let Some(e) = self.free_events.get_mut(&device).and_then(Vec::pop) {
            return Ok(e);
        }
        CuEvent::new(driver()?.context(device)?)
    }

    fn give_event(&mut self, device: u32, e: CuEvent) {
        let pool = self.free_events.entry(device).or_default();
        if pool.len() < EVENT_POOL_MAX {
            pool.push(e);
        }
    }

    fn min_pending_seq(&self) -> u64 {
        self.lanes
            .iter()
            .filter_map(|l| l.pending.front().map(|p| p.seq))
            .min()
            .unwrap_or(u64::MAX)
    }

    fn synchronize_all(&self) -> Result<()> {
        let mut first = Ok(());
        for l in &self.lanes {
            if let Err(e) = l.stream.synchronize()
                && first.is_ok()
            {
                first = Err(e);
            }
            // Copies the helper threads stage run on their own streams.
            for p in &l.pending {
                if let Waiter::Job(j) = &p.waiter {
                    while j.result().is_none() {
                        std::thread::yield_now();
                    }
                }
            }
        }
        first
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // Copies still running read or write memory that the pending entries keep alive:
        // wait for them before those entries (and the streams) go.
        if let Err(e) = self.synchronize_all() {
            tracing::warn!("waiting for CUDA copies at shutdown: {e}");
        }
    }
}

/// Asynchronous copies on CUDA streams with completion tokens. Thread-safe; an interface and
/// its endpoints share one engine through an `Arc`.
pub struct CopyEngine {
    // Declared (so dropped) before `wake`: dropping the state waits for the streams, whose
    // host functions write to `wake`'s descriptor.
    state: Mutex<State>,
    /// Signalled by host functions when operations finish (`None`: no eventfd, poll only).
    wake: Option<EventFd>,
    /// Armed at least once: posts queue a signalling host function.
    signal: AtomicBool,
    /// Operations and flushes waiting to be reported (`State::inflight` plus
    /// `State::flushes`, written under the lock): progress of an idle engine reads this and
    /// takes no lock (a worker progresses every interface in a tight loop, copies or not).
    queued: AtomicUsize,
    /// Helper threads for copies between pageable memory and the GPU (`None`: the driver
    /// stages them on the posting thread).
    stager: Option<Stager>,
}

impl fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("CopyEngine")
            .field("lanes", &s.lanes.iter().map(|l| l.key).collect::<Vec<_>>())
            .field("inflight", &s.inflight)
            .field("max_inflight", &s.max_inflight)
            .finish()
    }
}

impl CopyEngine {
    /// An engine that accepts at most `max_inflight` uncompleted operations (at least 1);
    /// beyond that posting returns [`Error::NoResource`]. No stream exists until the first post.
    pub fn new(max_inflight: usize) -> CopyEngine {
        CopyEngine {
            state: Mutex::new(State {
                lanes: Vec::new(),
                free_events: HashMap::new(),
                max_inflight: max_inflight.max(1),
                inflight: 0,
                next_seq: 0,
                flushes: VecDeque::new(),
                fail_copy: None,
                small: SmallCopies::from_env().unwrap_or_else(|e| {
                    tracing::warn!("{e}; small CUDA copies use cuMemcpyAsync and events");
                    SmallCopies::OFF
                }),
            }),
            wake: EventFd::new()
                .inspect_err(|e| {
                    tracing::info!("CUDA copy engine: no eventfd ({e}); it can only be polled")
                })
                .ok(),
            signal: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            stager: None,
        }
    }

    /// Stage copies of at least [`STAGE_MIN`] bytes between pageable host memory and the GPU
    /// through `threads` helper threads (0: leave them to the driver); see
    /// [`crate::pageable`].
    pub fn with_pageable_threads(mut self, threads: usize) -> CopyEngine {
        self.stager = (threads > 0).then(|| Stager::new(threads));
        self
    }

    /// Run small device copies as a kernel and track completion through completion words as
    /// `small` says (the default comes from `RUCX_CUDA_COPY_KERNEL_MAX` and
    /// `RUCX_CUDA_COMPLETION_WORDS`). Lanes made before keep what they have.
    pub fn with_small_copies(self, small: SmallCopies) -> CopyEngine {
        self.lock().small = small;
        self
    }

    /// Whether `copies` is one copy between pageable host memory and the GPU that the stager
    /// takes, and which way.
    fn stages(&self, copies: &[CopyOp]) -> Option<Dir> {
        let [c] = copies else {
            return None;
        };
        if self.stager.is_none() || c.len < STAGE_MIN {
            return None;
        }
        let kind = |a: u64| classify(a as usize, c.len).ok().map(|i| i.kind);
        match (kind(c.src)?, kind(c.dst)?) {
            (PtrKind::HostPageable, PtrKind::Cuda) => Some(Dir::ToDevice),
            (PtrKind::Cuda, PtrKind::HostPageable) => Some(Dir::ToHost),
            _ => None,
        }
    }

    /// Publish how much waits to be reported (called with the lock held, after a change).
    fn publish(&self, st: &State) {
        self.queued
            .store(st.inflight + st.flushes.len(), Ordering::Release);
    }

    /// The descriptor that becomes readable when an operation finishes, once the engine was
    /// armed; `None` when the engine can only be polled.
    pub fn event_fd(&self) -> Option<RawFd> {
        self.wake.as_ref().map(EventFd::fd)
    }

    /// Ask for the event descriptor to become readable when the next operation finishes:
    /// [`Error::Busy`] when an operation finished and waits for [`progress`](Self::progress),
    /// or one is pending that does not signal (posted before the first arm).
    pub fn arm(&self) -> Result<()> {
        let Some(wake) = &self.wake else {
            return Err(Error::Unsupported {
                what: "arming the CUDA copy engine".into(),
                why: "it has no eventfd".into(),
            });
        };
        self.signal.store(true, Ordering::Release);
        wake.drain();
        let st = self.lock();
        for lane in &st.lanes {
            if lane.pending.iter().any(|p| !p.signals) {
                return Err(Error::Busy(
                    "CUDA copies posted before the engine was armed are in flight".into(),
                ));
            }
            if let Some(front) = lane.pending.front()
                && !matches!(front.waiter.query(lane.word.as_ref()), Ok(false))
            {
                return Err(Error::Busy("a CUDA copy finished".into()));
            }
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Operations posted and not yet reported complete.
    pub fn inflight(&self) -> usize {
        self.lock().inflight
    }

    /// Queue `copies` on `key`'s stream, then an event; [`progress`](Self::progress) reports
    /// `token` once they have all finished. Returns [`OpStatus::Done`] when there was nothing to
    /// copy, [`Error::NoResource`] when `max_inflight` operations are pending (nothing was
    /// queued: progress and retry).
    ///
    /// If queuing fails part-way, the copies already queued are waited for before the error
    /// is returned (nothing is reported for `token`): the caller may end its request and hand
    /// its buffers back as soon as it sees the error.
    ///
    /// # Safety
    /// Every `src..src+len` must be readable and every `dst..dst+len` writable memory known to
    /// the CUDA driver's unified address space (or host memory), and must stay allocated until
    /// the completion is reported; `keep` holds whatever guarantees that (it is dropped after
    /// the copies finish). The destination must not be accessed by anyone else meanwhile.
    pub unsafe fn post(
        &self,
        key: LaneKey,
        copies: &[CopyOp],
        token: u64,
        keep: Vec<KeepAlive>,
    ) -> Result<OpStatus> {
        if copies.iter().all(|c| c.len == 0) {
            return Ok(OpStatus::Done);
        }
        rucx_ucs::profile::mark("copy.post", copies.iter().map(|c| c.len as u64).sum());
        let mut st = self.lock();
        if st.inflight >= st.max_inflight {
            return Err(Error::NoResource(format!(
                "{} CUDA copies in flight (the limit)",
                st.inflight
            )));
        }
        if let Some(dir) = self.stages(copies)
            && let Some(stager) = &self.stager
        {
            let c = copies[0];
            // SAFETY: forwarded to this function's contract; `keep` stays with the pending
            // entry until the job has ended.
            let job = unsafe { stager.submit(dir, key.device, c.dst, c.src, c.len) }?;
            let seq = st.next_seq;
            let lane = st.lane(key)?;
            lane.pending.push_back(Pending {
                seq,
                waiter: Waiter::Job(job),
                token,
                // Finishes on another stream: an armed caller polls instead of sleeping.
                signals: false,
                _keep: keep,
            });
            st.next_seq += 1;
            st.inflight += 1;
            self.publish(&st);
            return Ok(OpStatus::InProgress);
        }
        let seq = st.next_seq;
        let fail_copy = st.fail_copy.take();
        let kernel_max = st.small.kernel_max;
        let idx = st.lane_index(key)?;
        let event = if st.lanes[idx].word.is_some() {
            None
        } else {
            Some(st.take_event(key.device)?)
        };
        let lane = &mut st.lanes[idx];
        let mut queued = 0usize;
        let mut failure = None;
        // The lane sequence number the copy kernel stores into the word itself.
        let mut stored_by_kernel = None;
        if fail_copy.is_none()
            && let Some((kernel, c)) = kernel_copy(copies, kernel_max, lane.stream.context())
        {
            let done = lane
                .word
                .as_ref()
                .map(|w| (w.device_addr(), lane.issued + 1));
            // SAFETY: both ranges lie inside device allocations of the stream's GPU that the
            // pointer cache knows (`kernel_copy`), and the rest is this function's contract;
            // the word lives as long as the lane.
            match unsafe { kernel.launch(c.dst, c.src, c.len, &lane.stream, done) } {
                Ok(()) => {
                    queued = 1;
                    if let Some((_, s)) = done {
                        lane.issued = s;
                        stored_by_kernel = Some(s);
                    }
                }
                // A refused launch queued nothing: the copy call below does the work.
                Err(e) => tracing::debug!("copy kernel not launched ({e}); cuMemcpyAsync instead"),
            }
        }
        if queued == 0 {
            for (i, c) in copies.iter().filter(|c| c.len > 0).enumerate() {
                let queue = if fail_copy == Some(i) {
                    Err(Error::Internal(format!(
                        "copy {i} of an operation (injected)"
                    )))
                } else {
                    // SAFETY: forwarded to this function's contract.
                    unsafe { memcpy_async(c.dst, c.src, c.len, &lane.stream) }
                };
                match queue {
                    Ok(()) => queued += 1,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        if queued == 0 {
            let e = failure.unwrap_or_else(|| Error::Internal("no copy queued".into()));
            if let Some(ev) = event {
                st.give_event(key.device, ev);
            }
            return Err(e);
        }
        if let Some(f) = failure {
            // Some copies of the operation run: the caller is about to fail its request and
            // give its buffers back, so they end here first (an error path: waiting for the
            // stream costs what was queued on it before too).
            let waited = lane.stream.synchronize();
            if let Some(ev) = event {
                st.give_event(key.device, ev);
            }
            drop(keep);
            if let Err(e) = waited {
                tracing::warn!("waiting for the copies of a failed CUDA copy operation: {e}");
            }
            return Err(f);
        }
        let tracked = match (stored_by_kernel, event) {
            (Some(s), _) => Ok(Waiter::Word(s)),
            (None, Some(ev)) => ev.record(&lane.stream).map(|()| Waiter::Event(ev)),
            (None, None) => lane.write_word().map(Waiter::Word),
        };
        let waiter = match tracked {
            Ok(w) => w,
            Err(e) => {
                // Cannot track the copies (no event recorded, no word write queued): wait for
                // them here.
                lane.stream.synchronize()?;
                drop(keep);
                tracing::debug!("{e}; CUDA copy completed synchronously");
                return Ok(OpStatus::Done);
            }
        };
        let signals = match (&self.wake, self.signal.load(Ordering::Acquire)) {
            (Some(wake), true) => lane
                .stream
                .signal_fd_when_done(wake.fd())
                .inspect_err(|e| tracing::debug!("no completion signal for a CUDA copy: {e}"))
                .is_ok(),
            _ => false,
        };
        lane.pending.push_back(Pending {
            seq,
            waiter,
            token,
            signals,
            _keep: keep,
        });
        st.next_seq += 1;
        st.inflight += 1;
        self.publish(&st);
        rucx_ucs::profile::mark("copy.queued", seq);
        Ok(OpStatus::InProgress)
    }

    /// Fault injection for tests: the next [`post`](Self::post) fails to queue its copy of
    /// index `at` (of those with bytes), as the driver refusing it would.
    #[doc(hidden)]
    pub fn inject_copy_failure(&self, at: usize) {
        self.lock().fail_copy = Some(at);
    }

    /// Queue `copies` on `key`'s stream (after everything queued there before) and wait for
    /// them. For small synchronous operations such as `put_short`.
    ///
    /// # Safety
    /// As [`post`](Self::post), for the duration of the call.
    pub unsafe fn copy_sync(&self, key: LaneKey, copies: &[CopyOp]) -> Result<()> {
        if copies.iter().all(|c| c.len == 0) {
            return Ok(());
        }
        let mut st = self.lock();
        let lane = st.lane(key)?;
        for c in copies.iter().filter(|c| c.len > 0) {
            // SAFETY: forwarded to this function's contract.
            unsafe { memcpy_async(c.dst, c.src, c.len, &lane.stream) }?;
        }
        lane.stream.synchronize()
    }

    /// Report `token` once every operation posted before this call has finished:
    /// [`OpStatus::Done`] when none is pending.
    pub fn flush(&self, token: u64) -> Result<OpStatus> {
        let mut st = self.lock();
        if st.lanes.iter().all(|l| l.pending.is_empty()) {
            return Ok(OpStatus::Done);
        }
        let wm = st.next_seq;
        st.flushes.push_back((wm, token));
        self.publish(&st);
        Ok(OpStatus::InProgress)
    }

    /// Block until every queued copy has finished (completions are still reported by
    /// [`progress`](Self::progress)). Used as a fence across lanes.
    pub fn synchronize(&self) -> Result<()> {
        self.lock().synchronize_all()
    }

    /// Report finished operations and flushes to `sink` (no lock is held while it runs).
    /// Returns the number of events delivered.
    pub fn progress(&self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        // Progress means the caller is awake: operations posted from now on need no signal
        // until it arms again.
        self.signal.store(false, Ordering::Release);
        if self.queued.load(Ordering::Acquire) == 0 {
            // Nothing posted (a post on another thread after this load is seen by the next
            // progress call, as one that lands after the lock below would be).
            return 0;
        }
        let mut out: Vec<(u64, Result<()>)> = Vec::new();
        {
            let mut guard = self.lock();
            let st = &mut *guard;
            let mut recycled: Vec<(u32, CuEvent)> = Vec::new();
            for lane in &mut st.lanes {
                while let Some(front) = lane.pending.front() {
                    let res = match front.waiter.query(lane.word.as_ref()) {
                        Ok(false) => break,
                        Ok(true) => Ok(()),
                        Err(e) => Err(e),
                    };
                    let p = lane.pending.pop_front().expect("front exists");
                    st.inflight -= 1;
                    if res.is_ok()
                        && let Waiter::Event(e) = p.waiter
                    {
                        recycled.push((lane.key.device, e));
                    }
                    out.push((p.token, res));
                }
            }
            for (d, e) in recycled {
                st.give_event(d, e);
            }
            let min = st.min_pending_seq();
            while let Some(&(wm, tok)) = st.flushes.front() {
                if min < wm {
                    break;
                }
                st.flushes.pop_front();
                out.push((tok, Ok(())));
            }
            self.publish(st);
        }
        let n = out.len();
        if n > 0 {
            rucx_ucs::profile::mark("copy.done", n as u64);
        }
        for (token, result) in out {
            sink(Event::Completion { token, result });
        }
        n
    }
}

/// The copy of `copies` that may run as the copy kernel on `ctx`'s device, with the kernel: the
/// operation's only copy, at most `max` bytes, its two ends inside device allocations of that
/// GPU that the pointer cache knows (no driver call: an end it does not know, e.g. host memory,
/// means a copy call), not overlapping; and the kernel is loaded.
fn kernel_copy(
    copies: &[CopyOp],
    max: usize,
    ctx: &'static rucx_cuda::PrimaryContext,
) -> Option<(&'static CopyKernel, CopyOp)> {
    if max == 0 {
        return None;
    }
    let mut live = copies.iter().filter(|c| c.len > 0);
    let c = *live.next()?;
    if live.next().is_some() || c.len > max {
        return None;
    }
    let on_gpu = |a: u64| {
        rucx_cuda::pointer::lookup(a as usize, c.len)
            .is_some_and(|i| i.kind == PtrKind::Cuda && i.device == Some(ctx.ordinal()))
    };
    let len = c.len as u64;
    let overlap = c.src < c.dst.saturating_add(len) && c.dst < c.src.saturating_add(len);
    if overlap || !on_gpu(c.src) || !on_gpu(c.dst) {
        return None;
    }
    Some((CopyKernel::get(ctx)?, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_to_copy_is_done_without_a_driver() {
        let e = CopyEngine::new(0);
        let key = LaneKey { device: 0, lane: 0 };
        let copies = [CopyOp {
            dst: 0x1000,
            src: 0x2000,
            len: 0,
        }];
        // SAFETY: zero-length copies touch no memory.
        let st = unsafe { e.post(key, &copies, 7, vec![]) }.unwrap();
        assert_eq!(st, OpStatus::Done);
        // SAFETY: as above.
        unsafe { e.copy_sync(key, &copies) }.unwrap();
        assert_eq!(e.flush(1).unwrap(), OpStatus::Done);
        assert_eq!(e.inflight(), 0);
        assert_eq!(
            e.queued.load(Ordering::Acquire),
            0,
            "nothing waits: progress returns without the lock"
        );
        let mut n = 0;
        assert_eq!(e.progress(&mut |_| n += 1), 0);
        assert_eq!(n, 0);
        e.synchronize().unwrap();
        assert!(format!("{e:?}").contains("max_inflight: 1"));
    }

    #[test]
    fn posting_without_a_driver_is_an_error_not_a_crash() {
        if driver().is_ok() {
            return; // covered by tests/gpu.rs
        }
        let e = CopyEngine::new(4);
        let v = [0u8; 8];
        let mut w = [0u8; 8];
        let copies = [CopyOp {
            dst: w.as_mut_ptr() as u64,
            src: v.as_ptr() as u64,
            len: 8,
        }];
        let key = LaneKey { device: 0, lane: 1 };
        // SAFETY: both ranges are live local arrays; without a driver nothing is queued.
        let err = unsafe { e.post(key, &copies, 1, vec![]) }.unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
        assert_eq!(e.inflight(), 0);
    }
}
