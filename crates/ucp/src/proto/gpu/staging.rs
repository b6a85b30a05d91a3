//! Pinned host staging fragments (shared memory on one host, so a peer maps them), the copy
//! lane's registrations (through the context's one register path) and mapped peer staging.

use crate::Context;
use crate::worker::prelude::*;

/// Pinned host staging fragments for GPU pipelines: one half for sends, one for receives, so
/// that a worker sending and receiving at once cannot starve itself.
pub(crate) struct Staging {
    /// Registrations first: they must go before the memory they describe.
    pub(crate) copy_memh: MemHandle,
    pub(crate) rma: FxHashMap<usize, (RegGuard, NamedKey)>,
    pub(crate) frag: usize,
    pub(crate) free_send: SendFrags,
    pub(crate) free_recv: FreeFrags,
    /// Receives that found every receive slot in use: posted again when one comes back.
    pub(crate) slot_waiters: Vec<u64>,
    /// Staged sends that found every send fragment in use: posted again when one comes back.
    pub(crate) send_waiters: Vec<u64>,
    pub(crate) base: usize,
    /// Shared-memory staging (peers on this host map it), and the domain that made it.
    pub(crate) shared: Option<(usize, rucx_uct::SharedAlloc)>,
    pub(crate) _mem: Vec<u8>,
}

impl Staging {
    pub(crate) fn addr(&self, f: usize) -> usize {
        self.base + f * self.frag
    }
}

/// Who holds a send staging fragment lent to a staged send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lent {
    /// The send request.
    sreq: u64,
    /// The peer it was announced to (`None`: being copied into).
    peer: Option<usize>,
}

/// The send half of the staging: free fragments, and which staged send holds each one lent to
/// the pipeline, and whether it was announced to a peer. A fragment comes back only from the
/// send that holds it (a stale or hostile acknowledgement frees nothing another send uses);
/// when a peer fails, the fragments announced to it come back (it will never acknowledge
/// them), those still being copied into when their copy completes. Fragments the worker uses
/// outside the pipeline (bounce copies) are taken and given back with `pop` and `push`.
pub(crate) struct SendFrags {
    free: FreeFrags,
    lent: Vec<Option<Lent>>,
    lo: usize,
    frag: usize,
}

impl SendFrags {
    /// Fragments `lo..lo + count` of `frag` bytes, all free.
    pub(crate) fn new(lo: usize, count: usize, frag: usize) -> SendFrags {
        SendFrags {
            free: FreeFrags::new(lo, count),
            lent: vec![None; count],
            lo,
            frag: frag.max(1),
        }
    }

    /// Take the oldest free fragment (not lent to a staged send).
    pub(crate) fn pop(&mut self) -> Option<usize> {
        self.free.pop()
    }

    /// Give back fragment `f` taken with [`Self::pop`].
    pub(crate) fn push(&mut self, f: usize) {
        self.free.push(f)
    }

    /// Free fragments now.
    pub(crate) fn len(&self) -> usize {
        self.free.len()
    }

    fn slot(&mut self, f: usize) -> Option<&mut Option<Lent>> {
        f.checked_sub(self.lo).and_then(|i| self.lent.get_mut(i))
    }

    /// The fragments of a run from `first` holding `len` bytes (one at least, never more than
    /// the half has).
    fn run(&self, first: usize, len: usize) -> std::ops::Range<usize> {
        let k = len.div_ceil(self.frag).clamp(1, self.lent.len().max(1));
        first..first.saturating_add(k)
    }

    /// Lend staged send `sreq` a run of up to `max` consecutive free fragments (one at least
    /// when any is free): the first and how many.
    pub(crate) fn take_run(&mut self, sreq: u64, max: usize) -> Option<(usize, usize)> {
        let (f, k) = self.free.take_run(max)?;
        for g in f..f + k {
            if let Some(l) = self.slot(g) {
                *l = Some(Lent { sreq, peer: None });
            }
        }
        Some((f, k))
    }

    /// The run from `first` holding `len` bytes, copied for send `sreq`, was announced to
    /// peer `p`.
    pub(crate) fn announced(&mut self, sreq: u64, p: usize, first: usize, len: usize) {
        for g in self.run(first, len) {
            if let Some(Some(l)) = self.slot(g)
                && l.sreq == sreq
            {
                l.peer = Some(p);
            }
        }
    }

    /// Send `sreq` gives back the run from `first` holding `len` bytes (a copy that failed or
    /// outlived its send, or fragments the receiver acknowledged). Fragments it does not hold
    /// are left alone. Returns how many came back.
    pub(crate) fn release(&mut self, sreq: u64, first: usize, len: usize) -> usize {
        let mut n = 0;
        for g in self.run(first, len) {
            match self.slot(g) {
                Some(l) if l.is_some_and(|l| l.sreq == sreq) => {
                    *l = None;
                    self.free.push(g);
                    n += 1;
                }
                _ => tracing::debug!(
                    "staging fragment {g} given back by request {sreq:#x}, which does not hold \
                     it; ignored"
                ),
            }
        }
        n
    }

    /// Peer `p` acknowledged the run from `first` holding `len` bytes of send `sreq`, which is
    /// no longer running: the fragments of it that were announced to `p` come back; others
    /// (held by a send to another peer, or not announced yet) are left alone.
    pub(crate) fn release_announced(
        &mut self,
        p: usize,
        sreq: u64,
        first: usize,
        len: usize,
    ) -> usize {
        let mut n = 0;
        for g in self.run(first, len) {
            if let Some(l) = self.slot(g)
                && l.is_some_and(|l| l.sreq == sreq && l.peer == Some(p))
            {
                *l = None;
                self.free.push(g);
                n += 1;
            }
        }
        n
    }

    /// Peer `p` is gone: the fragments announced to it come back (it will never acknowledge
    /// them). Returns how many.
    pub(crate) fn release_peer(&mut self, p: usize) -> usize {
        let mut back = Vec::new();
        for (i, l) in self.lent.iter_mut().enumerate() {
            if l.is_some_and(|l| l.peer == Some(p)) {
                *l = None;
                back.push(self.lo + i);
            }
        }
        for &g in &back {
            self.free.push(g);
        }
        back.len()
    }
}

/// Free staging fragments of one direction, handed out first in, first out: fragments come
/// back in the order their transfers end, so consecutive ones stay next to each other and a
/// sender copies a run of them with one copy (fragments batched per copy call and per event,
/// whatever the fragment size).
pub(crate) struct FreeFrags {
    q: VecDeque<usize>,
    /// Fragments of this direction are `lo..lo + is_free.len()`; which are in `q`.
    lo: usize,
    is_free: Vec<bool>,
}

impl FreeFrags {
    /// Fragments `lo..lo + count`, all free.
    pub(crate) fn new(lo: usize, count: usize) -> FreeFrags {
        FreeFrags {
            q: (lo..lo + count).collect(),
            lo,
            is_free: vec![true; count],
        }
    }

    /// Take the oldest free fragment.
    pub(crate) fn pop(&mut self) -> Option<usize> {
        let f = self.q.pop_front()?;
        self.is_free[f - self.lo] = false;
        Some(f)
    }

    /// Give fragment `f` back; one not of this direction, or free already, is ignored (and
    /// logged): it must never be handed out twice.
    pub(crate) fn push(&mut self, f: usize) {
        match f.checked_sub(self.lo).and_then(|i| self.is_free.get_mut(i)) {
            Some(free) if !*free => {
                *free = true;
                self.q.push_back(f);
            }
            _ => tracing::debug!("staging fragment {f} given back twice or not ours; ignored"),
        }
    }

    /// Take a run of up to `max` consecutive free fragments (at least one when any is free):
    /// the first and how many.
    pub(crate) fn take_run(&mut self, max: usize) -> Option<(usize, usize)> {
        let first = self.pop()?;
        let mut k = 1;
        while k < max && self.q.front() == Some(&(first + k)) {
            self.pop();
            k += 1;
        }
        Some((first, k))
    }

    /// Free fragments now.
    pub(crate) fn len(&self) -> usize {
        self.q.len()
    }
}

/// Staging fragments per direction for fragments of `frag` bytes when `RUCX_RNDV_FRAG_COUNT`
/// is left at its default (`configured`): that many, or more when fragments are small, so that at least `STAGING_DEPTH_BYTES` are in flight per
/// direction whatever the fragment size (8 fragments of 4 KiB would leave the copy engines
/// idle between round trips), and never more than `MAX_FRAGS`.
pub(crate) fn stage_count(configured: usize, frag: usize) -> usize {
    configured
        .max(STAGING_DEPTH_BYTES / frag.max(1))
        .clamp(1, MAX_FRAGS)
}

/// Bytes of staging per direction the pipeline keeps in flight at least (the default
/// `RUCX_RNDV_FRAG_COUNT` x `RUCX_RNDV_FRAG_SIZE`).
const STAGING_DEPTH_BYTES: usize = 32 << 20;

/// Most staging fragments per direction.
const MAX_FRAGS: usize = 8192;

/// Staging memory, allocated and registered with the copy lane's domain, not yet cut into
/// fragments.
pub(crate) struct StagingMem {
    /// Registration first: it must go before the memory it describes.
    copy_memh: MemHandle,
    base: usize,
    len: usize,
    shared: Option<(usize, rucx_uct::SharedAlloc)>,
    mem: Vec<u8>,
}

/// A [`StagingMem`] being made by a helper thread. Its shared allocation (when a domain
/// offers one) is made on the worker's thread, which touches no page of it (a few system
/// calls), so that peers are offered the staging at once, while the helper page-locks it:
/// a receiver then maps and registers it next to our page-locking, not during the first
/// transfer that needs it.
pub(crate) struct StagingAhead {
    shared: Option<(usize, rucx_uct::SharedAlloc)>,
    thread: std::thread::JoinHandle<Result<StagingMem>>,
    ended: std::sync::Arc<HelperEnded>,
}

/// Set once a staging helper thread has ended, whatever its result: a peer's offered staging
/// is registered only after our own (both page-lock host memory, and ours is the one every
/// staged transfer needs: where pinned memory is short, the peer's mapping is the one to go
/// without, its fragments are read instead).
#[derive(Default)]
pub(crate) struct HelperEnded {
    ended: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl HelperEnded {
    fn set(&self) {
        *self.ended.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Block until the helper thread has ended.
    pub(crate) fn wait(&self) {
        let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        while !*ended {
            ended = self.cv.wait(ended).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Sets its [`HelperEnded`] when dropped (the helper returned or unwound).
struct SetOnDrop(std::sync::Arc<HelperEnded>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}

impl StagingAhead {
    /// What tells when the helper thread has ended.
    pub(crate) fn ended(&self) -> std::sync::Arc<HelperEnded> {
        self.ended.clone()
    }

    /// The helper thread has ended (joining does not wait).
    pub(crate) fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Wait for the helper thread: the staging, or why it could not be made.
    pub(crate) fn join(self) -> std::thread::Result<Result<StagingMem>> {
        self.thread.join()
    }

    /// The shared allocation being page-locked (peers may map it already), and its domain.
    pub(crate) fn shared(&self) -> Option<&(usize, rucx_uct::SharedAlloc)> {
        self.shared.as_ref()
    }
}

impl StagingMem {
    /// Allocate `len` bytes (shared memory when a domain offers it: a receiver on this host
    /// then copies straight from our fragments to its GPU, two DMA copies in all, no CPU copy)
    /// and register them with domain `mi` (page-locking them: tens of milliseconds for the
    /// default 64 MiB).
    pub(crate) fn make(ctx: &Context, mi: usize, len: usize) -> Result<StagingMem> {
        Self::register(ctx, mi, len, Self::alloc_shared(ctx, len))
    }

    /// `len` bytes of shared memory from the first domain that offers it (no page touched).
    fn alloc_shared(ctx: &Context, len: usize) -> Option<(usize, rucx_uct::SharedAlloc)> {
        for d in 0..ctx.domain_count() {
            match ctx.domain(d).mem_alloc_shared(len) {
                Ok(Some(a)) => return Some((d, a)),
                Ok(None) => {}
                Err(e) => tracing::debug!("shared staging from {}: {e}", ctx.domain(d).name()),
            }
        }
        None
    }

    /// Register `len` bytes of staging with domain `mi`: the `shared` allocation, or else
    /// heap memory allocated here. The shared pages are faulted in first by several threads
    /// ([`prefault`]): page-locking fresh shared memory allocates and clears every page one
    /// by one inside the driver's call (36.6 ms for 64 MiB on an H200 host, where a peer's
    /// registration of the same pages, already there, takes 2-4 ms); faulted in first, the
    /// driver's call takes 4.7 ms (the faulting 27.3 ms: the kernel's allocation of shared
    /// pages barely scales with threads).
    fn register(
        ctx: &Context,
        mi: usize,
        len: usize,
        shared: Option<(usize, rucx_uct::SharedAlloc)>,
    ) -> Result<StagingMem> {
        let mem = if shared.is_some() {
            Vec::new()
        } else {
            // Fallible: a staging size the system cannot serve fails the transfer that asked.
            let mut m = Vec::new();
            m.try_reserve_exact(len).map_err(|e| {
                Error::NoMemory(format!(
                    "{len} bytes of GPU staging (RUCX_RNDV_FRAG_SIZE x 2 x RUCX_RNDV_FRAG_COUNT): {e}"
                ))
            })?;
            m.resize(len, 0);
            m
        };
        let base = shared
            .as_ref()
            .map_or(mem.as_ptr() as usize, |(_, a)| a.addr);
        let t = std::time::Instant::now();
        if let Some((_, a)) = &shared {
            prefault(a);
        }
        let faulted = t.elapsed();
        // Registered for the staging alone (not cached: the memory goes with the worker). `mem`
        // (or the shared allocation) is stored after this handle (fields drop in order), so
        // the memory outlives the registration; it is never resized.
        let copy_memh = ctx
            .register_uncached(mi, MemRegion::host(base, len))?
            .registration()
            .clone();
        tracing::debug!(
            "staging: {len} bytes registered with {} in {:.3} ms ({:.3} ms of it faulting in the shared pages)",
            ctx.domain(mi).name(),
            t.elapsed().as_secs_f64() * 1e3,
            faulted.as_secs_f64() * 1e3
        );
        Ok(StagingMem {
            copy_memh,
            base,
            len,
            shared,
            mem,
        })
    }

    /// Start making the staging of a worker with copy domain `mi` on a helper thread, so that
    /// the first transfer that needs it (typically the one that demotes a zero-copy GPU path)
    /// does not wait for it: the first demoting 1 GiB transfer on 2x H200 took 211 ms against
    /// 20 ms once staged. The shared allocation is made here (see [`StagingAhead`]). `None`
    /// when the thread cannot be started (made on first use then).
    pub(crate) fn ahead(ctx: &Context, mi: usize, len: usize) -> Option<StagingAhead> {
        let shared = Self::alloc_shared(ctx, len);
        let mine = shared.clone();
        let ctx = ctx.clone();
        // The caller's log subscriber sees what the helper thread reports (a failed
        // registration demotes and warns like any other).
        let log = tracing::dispatcher::get_default(|d| d.clone());
        let ended = std::sync::Arc::new(HelperEnded::default());
        let set = SetOnDrop(ended.clone());
        std::thread::Builder::new()
            .name("rucx-staging".into())
            .spawn(move || {
                let _set = set;
                tracing::dispatcher::with_default(&log, || {
                    StagingMem::register(&ctx, mi, len, mine)
                })
            })
            .map_err(|e| tracing::debug!("no helper thread for staging ({e}); made on first use"))
            .ok()
            .map(|thread| StagingAhead {
                shared,
                thread,
                ended,
            })
    }
}

/// Most threads that fault in a shared staging allocation.
const PREFAULT_THREADS: usize = 4;

/// Fault in every page of the fresh shared allocation `a`, a contiguous part per thread (up
/// to [`PREFAULT_THREADS`], the cores there are), so that the driver's page-locking finds
/// them allocated.
fn prefault(a: &rucx_uct::SharedAlloc) {
    const PAGE: usize = 4096;
    let pages = a.len.div_ceil(PAGE);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, PREFAULT_THREADS)
        .min(pages.max(1));
    let per = pages.div_ceil(threads);
    let touch = |first: usize| {
        for page in first..(first + per).min(pages) {
            // SAFETY: the allocation is ours, mapped read-write for `a.len` bytes while `a`
            // (its handle) lives, which outlives this scope; nothing was written to it yet
            // (it is not handed to any transfer before its registration, and peers only read
            // fragments announced to them), so writing a zero onto a fresh zeroed page
            // changes nothing but makes the kernel allocate it now.
            unsafe { std::ptr::write_volatile((a.addr + page * PAGE) as *mut u8, 0) };
        }
    };
    std::thread::scope(|s| {
        for k in 1..threads {
            let touch = &touch;
            if std::thread::Builder::new()
                .spawn_scoped(s, move || touch(k * per))
                .is_err()
            {
                // No thread: this one does that part too.
                touch(k * per);
            }
        }
        touch(0);
    });
}

impl State {
    pub(crate) fn copy_md(&self) -> Option<usize> {
        self.copy.as_ref().map(|(i, _)| self.slots[*i].md)
    }

    /// Register a user buffer with the copy lane's domain and make the key the copy lane's
    /// endpoint needs to reach it. The registration goes through the context (demotion,
    /// warning, GPU registration reuse) and is made for this request alone: the buffer belongs
    /// to a request of a scope, which keeps it allocated until the request finished, and the
    /// guard is dropped with the request.
    pub(crate) fn copy_key(
        &self,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(RegGuard, RemoteKey)> {
        let mi = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: format!("copying {mem} memory"),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(mi, mem, dev)?;
        let g = self.ctx.register_uncached(
            mi,
            MemRegion {
                addr,
                len: len.max(1),
                mem_type: mem,
                device: dev,
            },
        )?;
        let md = self.ctx.domain(mi);
        let key = md.rkey_unpack(&md.mkey_pack(g.registration())?)?;
        Ok((g, key))
    }

    /// The copy lane's domain `mi` may still register `mem` memory of `dev` for its copies:
    /// once demoted there, fail at once with the reason and the knob rather than asking the
    /// driver again.
    pub(crate) fn copy_not_demoted(
        &self,
        mi: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<()> {
        match self.ctx.demotion_of(mi, mem, dev) {
            None => Ok(()),
            Some(d) => Err(Error::Unsupported {
                what: format!(
                    "copying {mem} memory{} with {}",
                    dev.map(|d| format!(" of GPU {d}")).unwrap_or_default(),
                    d.md
                ),
                why: format!("{d}; {}", d.knob),
            }),
        }
    }

    /// The pinned staging fragments, made on first use.
    pub(crate) fn ensure_staging(&mut self) -> Result<()> {
        self.staging_from(true)
    }

    /// Take in the staging a helper thread made; when it failed, leave the making to the
    /// first transfer that needs it (never page-locks from the progress loop).
    pub(crate) fn staging_from_helper(&mut self) -> Result<()> {
        self.staging_from(false)
    }

    fn staging_from(&mut self, or_make: bool) -> Result<()> {
        if self.staging.is_some() {
            return Ok(());
        }
        let mi = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: "staging GPU memory".into(),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(mi, MemoryType::Host, None)?;
        let count = self.stage_count;
        let total = self.frag * count * 2;
        // Made ahead by a helper thread when the worker started (see `StagingMem::ahead`);
        // made here when that was not asked for or failed.
        let t = std::time::Instant::now();
        let (ahead_shared, ahead) = match self.staging_ahead.take() {
            Some(h) => (h.shared().cloned(), Some(h.join())),
            None => (None, None),
        };
        if ahead.is_some() {
            tracing::debug!(
                "staging: waited {:.3} ms for the helper thread",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        let ahead = match ahead {
            Some(Ok(Ok(m))) if m.len == total => Some(m),
            Some(Ok(Err(e))) => {
                tracing::debug!("staging made ahead failed ({e}); making it now");
                None
            }
            _ => None,
        };
        let StagingMem {
            copy_memh,
            base,
            shared,
            mem,
            ..
        } = match ahead {
            Some(m) => {
                self.count("staging made ahead");
                m
            }
            // The shared allocation peers may have been offered already is kept.
            None if or_make => match ahead_shared.filter(|(_, a)| a.len == total) {
                Some(sh) => StagingMem::register(&self.ctx, mi, total, Some(sh))?,
                None => StagingMem::make(&self.ctx, mi, total)?,
            },
            None => return Ok(()),
        };
        self.staging = Some(Staging {
            copy_memh,
            rma: FxHashMap::default(),
            frag: self.frag,
            free_send: SendFrags::new(0, count, self.frag),
            free_recv: FreeFrags::new(count, count),
            slot_waiters: Vec::new(),
            send_waiters: Vec::new(),
            base,
            shared,
            _mem: mem,
        });
        self.offer_staging_all();
        self.take_held_offers();
        Ok(())
    }

    /// The staging memory registered with domain `mi`, and its packed key.
    pub(crate) fn staging_reg(&mut self, mi: usize) -> Result<(MemHandle, NamedKey)> {
        self.ensure_staging()?;
        let stg = self.staging.as_ref().expect("staging");
        if let Some((g, k)) = stg.rma.get(&mi) {
            return Ok((g.registration().clone(), k.clone()));
        }
        let total = stg.frag * self.stage_count * 2;
        if let Some((d, a)) = &stg.shared
            && *d == mi
        {
            let md = self.ctx.domain(mi);
            let key = NamedKey {
                md: md.name().to_string(),
                key: md.mkey_pack(&a.memh)?,
            };
            let memh = a.memh.clone();
            self.staging
                .as_mut()
                .expect("staging")
                .rma
                .insert(mi, (RegGuard::Direct(memh.clone()), key.clone()));
            return Ok((memh, key));
        }
        let g = self.register_md(mi, MemRegion::host(stg.base, total))?;
        let md = self.ctx.domain(mi);
        let key = NamedKey {
            md: md.name().to_string(),
            key: md.mkey_pack(g.registration())?,
        };
        let memh = g.registration().clone();
        self.staging
            .as_mut()
            .expect("staging")
            .rma
            .insert(mi, (g, key.clone()));
        Ok((memh, key))
    }

    /// Map a peer's staging fragment into this process when its domain allows (shared memory on
    /// this host), registered with the copy lane once per mapping. `None`: read it instead.
    pub(crate) fn map_fragment(
        &mut self,
        mi: usize,
        rkey: &RemoteKey,
        addr: u64,
    ) -> Option<(usize, MemHandle)> {
        let base = match self.ctx.domain(mi).rkey_ptr(rkey) {
            Ok(Some(b)) => b,
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!("cannot map the peer's staging ({e}); reading it instead");
                return None;
            }
        };
        if !self.mapping_ahead.is_empty()
            && !self.mapped.contains_key(&base)
            && let Some(h) = self.mapping_made_ahead(base)
        {
            self.count("peer staging mapped ahead");
            self.mapped.insert(base, h);
        }
        let memh = match self.mapped.get(&base) {
            Some(h) => h.clone(),
            None => {
                let cmd = self.copy_md()?;
                self.copy_not_demoted(cmd, MemoryType::Host, None).ok()?;
                // Registered for this mapping alone (not cached): the domain keeps the peer's
                // segment mapped until it is dropped, which is after this worker (the context
                // outlives its workers), and the mapping covers the key's whole region.
                let t = std::time::Instant::now();
                let h = self
                    .ctx
                    .register_uncached(cmd, MemRegion::host(base, rkey.len() as usize))
                    .map(|g| g.registration().clone());
                match h {
                    Ok(h) => {
                        tracing::debug!(
                            "staging: the peer's {} bytes mapped and registered in {:.3} ms",
                            rkey.len(),
                            t.elapsed().as_secs_f64() * 1e3
                        );
                        self.mapped.insert(base, h.clone());
                        h
                    }
                    Err(e) => {
                        tracing::debug!("cannot register the mapped staging for copies ({e})");
                        return None;
                    }
                }
            }
        };
        Some((base + (addr - rkey.base()) as usize, memh))
    }
}

#[cfg(test)]
mod tests {
    use super::FreeFrags;

    #[test]
    fn runs_are_consecutive_and_fragments_never_handed_out_twice() {
        let mut f = FreeFrags::new(8, 8);
        assert_eq!(f.take_run(3), Some((8, 3)));
        assert_eq!(f.take_run(100), Some((11, 5)));
        assert_eq!(f.take_run(1), None);
        // Back in completion order: runs form again.
        for x in [9, 8, 10, 11] {
            f.push(x);
        }
        assert_eq!(f.take_run(4), Some((9, 1)));
        assert_eq!(f.take_run(4), Some((8, 1)));
        assert_eq!(f.take_run(4), Some((10, 2)));
        // Twice, and out of range: ignored.
        f.push(12);
        f.push(12);
        f.push(3);
        f.push(16);
        assert_eq!(f.len(), 1);
        assert_eq!(f.pop(), Some(12));
        assert_eq!(f.pop(), None);
    }

    /// An acknowledgement for an ended send frees only what was announced to the peer that
    /// acknowledges: another peer naming the send (a forged or stray acknowledgement) frees
    /// nothing, so a fragment still being read is never handed out again.
    #[test]
    fn an_acknowledgement_frees_only_what_was_announced_to_its_peer() {
        use super::SendFrags;
        let mut s = SendFrags::new(0, 4, 100);
        assert_eq!(s.take_run(7, 4), Some((0, 4)));
        s.announced(7, 1, 0, 200);
        assert_eq!(
            s.release_announced(2, 7, 0, 400),
            0,
            "peer 2 was told nothing"
        );
        assert_eq!(s.release_announced(1, 9, 0, 200), 0, "not send 9's");
        assert_eq!(
            s.release_announced(1, 7, 0, 400),
            2,
            "fragments 2 and 3 not announced"
        );
        assert_eq!(s.len(), 2);
        assert_eq!(s.release_announced(1, 7, 0, 200), 0, "twice");
    }

    /// A run comes back only from the send it was lent to; a failed peer gives back what was
    /// announced to it, not what is still being copied into.
    #[test]
    fn send_fragments_come_back_from_their_holder_only() {
        use super::SendFrags;
        let mut s = SendFrags::new(0, 6, 100);
        assert_eq!(s.take_run(7, 3), Some((0, 3)));
        assert_eq!(s.take_run(8, 3), Some((3, 3)));
        assert_eq!(s.release(8, 0, 300), 0, "not send 8's");
        assert_eq!(s.len(), 0);
        s.announced(7, 1, 0, 200);
        s.announced(8, 2, 3, 300);
        // Peer 1 fails: fragments 0 and 1 come back; 2 is still being copied into.
        assert_eq!(s.release_peer(1), 2);
        assert_eq!(s.len(), 2);
        assert_eq!(
            s.release(7, 0, 100),
            0,
            "a late acknowledgement frees nothing"
        );
        assert_eq!(s.release(7, 2, 100), 1, "the copy completed");
        assert_eq!(s.release(8, 3, 300), 3);
        assert_eq!(s.release(8, 3, 300), 0, "twice");
        assert_eq!(s.len(), 6);
        assert_eq!(s.release_peer(2), 0);
    }

    #[test]
    fn small_fragments_get_a_deeper_pipeline() {
        use super::stage_count;
        // The default: 8 fragments of 4 MiB.
        assert_eq!(stage_count(8, 4 << 20), 8);
        // 64 KiB: 32 MiB in flight per direction.
        assert_eq!(stage_count(8, 64 << 10), 512);
        assert_eq!(stage_count(8, 4 << 10), 8192);
        // Asked for more: given; large fragments: as configured.
        assert_eq!(stage_count(1000, 64 << 10), 1000);
        assert_eq!(stage_count(2, 1 << 30), 2);
    }
}
