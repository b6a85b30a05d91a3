//! The context: discovered resources, configuration, and the live registration table
//! (`reg_domains[mem_type]`) that demotion edits.

mod alloc;

pub use alloc::HostAlloc;

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rucx_ucs::rcache::{Rcache, RcacheConfig, RcacheGuard};
use rucx_ucs::{Config, Error, MemoryType, OptionSpec, RegError, RegErrorKind, RegScope, Result};
use rucx_uct::{AllocId, MemHandle, MemRegion, MemoryDomain, Registry};

/// Most refused allocations remembered per context (oldest forgotten first).
const MAX_REMEMBERED_REFUSALS: usize = 256;

/// A domain taken out of `reg_domains[mem_type]` for a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Demotion {
    /// Memory domain name.
    pub md: String,
    /// Memory type it no longer registers.
    pub mem_type: MemoryType,
    /// GPU ordinal it applies to (`None`: every device / host memory).
    pub device: Option<u32>,
    /// Why, in words.
    pub reason: String,
    /// What to set to skip the attempt next time.
    pub knob: String,
}

impl fmt::Display for Demotion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} no longer registers {} memory",
            self.md, self.mem_type
        )?;
        if let Some(d) = self.device {
            write!(f, " of GPU {d}")?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// Buffers a domain refused for a reason that belongs to the buffer (or its kind of allocation,
/// [`RegScope::Buffer`]), e.g. stream-ordered pool memory that `cuda_ipc` cannot export: those
/// buffers took another path, and the domain stays in use for every other buffer. One entry per
/// (domain, memory type, device, kind).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Memory domain name.
    pub md: String,
    /// Memory type of the refused buffers.
    pub mem_type: MemoryType,
    /// GPU ordinal of the refused buffers (`None`: host memory).
    pub device: Option<u32>,
    /// Why, as classified.
    pub kind: RegErrorKind,
    /// Why, in words (the first refusal's).
    pub reason: String,
    /// What to change to avoid it.
    pub knob: String,
    /// Buffers (allocations, where the domain can tell them apart) refused so far.
    pub count: u64,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} refused {} buffer(s) of {} memory",
            self.md, self.count, self.mem_type
        )?;
        if let Some(d) = self.device {
            write!(f, " of GPU {d}")?;
        }
        write!(
            f,
            ": {}; only those buffers took another path, {} stays in use for others",
            self.reason, self.md
        )
    }
}

/// Refusals so far, and the refused allocations remembered (domain index, allocation, error),
/// so that their later registrations fail at once without asking the driver again.
#[derive(Default)]
struct Refusals {
    by_kind: Vec<Refusal>,
    allocs: VecDeque<(usize, AllocId, RegError)>,
}

struct DomainSlot {
    md: Arc<dyn MemoryDomain>,
    rcache: Rcache<MemHandle>,
}

/// A registration made for a request: cached (host memory), or made for this request alone
/// (GPU memory: without notice of frees, a cached GPU registration could outlive its
/// allocation and be handed out for a new one at the same address).
#[derive(Debug, Clone)]
pub enum RegGuard {
    /// From the domain's registration cache.
    Cached(RcacheGuard<MemHandle>),
    /// Registered for one request.
    Direct(MemHandle),
}

impl RegGuard {
    /// The memory handle.
    pub fn registration(&self) -> &MemHandle {
        match self {
            RegGuard::Cached(g) => g.registration(),
            RegGuard::Direct(h) => h,
        }
    }
}

pub(crate) struct CtxInner {
    pub(crate) config: Config,
    domains: Vec<DomainSlot>,
    pub(crate) unavailable: Vec<(String, String)>,
    demotions: Mutex<Vec<Demotion>>,
    refusals: Mutex<Refusals>,
    /// GPU registrations by (domain, address, length), reused only while the domain confirms
    /// the allocation is unchanged (`MemoryDomain::mem_still_valid`).
    gpu_regs: Mutex<std::collections::HashMap<(usize, usize, usize), MemHandle>>,
    warned: Mutex<HashSet<(String, MemoryType, Option<u32>)>>,
    epoch: AtomicU64,
    /// Regions mapped for remote access, which atomics are checked against.
    maps: crate::worker::atomic::MapRegistry,
}

/// A rucx context: resources and configuration shared by its workers.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("domains", &self.domain_names())
            .field("demotions", &self.demotions())
            .finish()
    }
}

impl Context {
    /// Discover the components of `registry` under `config` (which must declare the tables of
    /// `rucx::config_tables()` plus the components').
    pub fn new(registry: &Registry, config: Config) -> Result<Context> {
        rucx_ucs::log::init();
        let d = registry.discover(&config, Some("TLS"))?;
        let mut domains = Vec::new();
        for md in d.domains {
            let rc = RcacheConfig::from_config(format!("{} rcache", md.name()), &config)
                .unwrap_or_else(|_| RcacheConfig::new(md.name()));
            domains.push(DomainSlot {
                md,
                rcache: Rcache::new(rc)?,
            });
        }
        let ctx = Context {
            inner: Arc::new(CtxInner {
                config,
                domains,
                unavailable: d.unavailable,
                demotions: Mutex::new(Vec::new()),
                refusals: Mutex::new(Refusals::default()),
                gpu_regs: Mutex::new(std::collections::HashMap::new()),
                warned: Mutex::new(HashSet::new()),
                epoch: AtomicU64::new(0),
                maps: Default::default(),
            }),
        };
        for pair in ctx.inner.config.list("REG_SKIP").to_vec() {
            let (md, mt) = pair.split_once(':').ok_or_else(|| Error::Config {
                var: "RUCX_REG_SKIP".into(),
                value: pair.clone(),
                reason: "not an md:memtype pair".into(),
                accepted: "comma-separated md:memtype pairs, e.g. posix:host,cuda_ipc:cuda".into(),
            })?;
            let mem_type: MemoryType = mt.parse().map_err(|e: Error| Error::Config {
                var: "RUCX_REG_SKIP".into(),
                value: pair.clone(),
                reason: e.to_string(),
                accepted: "md:host, md:cuda, md:cuda-managed".into(),
            })?;
            ctx.lock_demotions().push(Demotion {
                md: md.to_string(),
                mem_type,
                device: None,
                reason: "disabled by RUCX_REG_SKIP".into(),
                knob: "RUCX_REG_SKIP".into(),
            });
        }
        Ok(ctx)
    }

    /// A context from the environment, with every compiled-in component of `registry`.
    pub fn from_env(registry: &Registry, tables: &[&'static [OptionSpec]]) -> Result<Context> {
        let mut all: Vec<&'static [OptionSpec]> = tables.to_vec();
        all.push(crate::config::CONFIG);
        Self::new(registry, Config::from_env(&all)?)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Names of the open memory domains.
    pub fn domain_names(&self) -> Vec<String> {
        self.inner
            .domains
            .iter()
            .map(|d| d.md.name().to_string())
            .collect()
    }

    /// Components or domains that cannot run here, with the reason.
    pub fn unavailable(&self) -> &[(String, String)] {
        &self.inner.unavailable
    }

    /// The regions mapped for remote access (`worker/atomic.rs`).
    pub(crate) fn maps(&self) -> &crate::worker::atomic::MapRegistry {
        &self.inner.maps
    }

    pub(crate) fn domain(&self, i: usize) -> &Arc<dyn MemoryDomain> {
        &self.inner.domains[i].md
    }

    /// Forget every cached registration overlapping `addr..addr + len` (memory about to be
    /// released).
    pub(crate) fn forget_registrations(&self, addr: usize, len: usize) {
        for d in &self.inner.domains {
            d.rcache.invalidate(addr, len);
        }
    }

    pub(crate) fn domain_count(&self) -> usize {
        self.inner.domains.len()
    }

    pub(crate) fn domain_index(&self, name: &str) -> Option<usize> {
        self.inner.domains.iter().position(|d| d.md.name() == name)
    }

    fn lock_demotions(&self) -> std::sync::MutexGuard<'_, Vec<Demotion>> {
        self.inner
            .demotions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Every demotion so far (including those configured with `RUCX_REG_SKIP`): failures that
    /// belong to a domain on a device ([`RegScope::Domain`]).
    pub fn demotions(&self) -> Vec<Demotion> {
        self.lock_demotions().clone()
    }

    fn lock_refusals(&self) -> std::sync::MutexGuard<'_, Refusals> {
        self.inner
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Buffers refused so far for reasons that belong to the buffer ([`RegScope::Buffer`]):
    /// they took another path, and the domain was not demoted.
    pub fn refusals(&self) -> Vec<Refusal> {
        self.lock_refusals().by_kind.clone()
    }

    /// The demotion that takes domain `i` out for `mem_type` memory of `device`, if any. Unlike
    /// [`can_register`](Self::can_register) this ignores what the domain registers for peers: a
    /// copy domain (`cuda_cpy`) registers GPU memory only for its own copies, and is demoted
    /// when that fails.
    pub fn demotion_of(
        &self,
        i: usize,
        mem_type: MemoryType,
        device: Option<u32>,
    ) -> Option<Demotion> {
        let name = self.inner.domains[i].md.name();
        self.lock_demotions()
            .iter()
            .find(|d| {
                d.md == name && d.mem_type == mem_type && (d.device.is_none() || d.device == device)
            })
            .cloned()
    }

    /// Changes whenever the registration table changes; protocol tables built at an older
    /// epoch are stale.
    #[inline]
    pub fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::Acquire)
    }

    /// Whether domain `i` may register `mem_type` memory of `device` now.
    pub fn can_register(&self, i: usize, mem_type: MemoryType, device: Option<u32>) -> bool {
        self.inner.domains[i]
            .md
            .attr()
            .reg_mem_types()
            .has(mem_type)
            && self.demotion_of(i, mem_type, device).is_none()
    }

    /// The live `reg_domains[mem_type]`: names of the domains that register this memory type
    /// (of `device`) now.
    pub fn reg_domains(&self, mem_type: MemoryType, device: Option<u32>) -> Vec<String> {
        (0..self.domain_count())
            .filter(|i| self.can_register(*i, mem_type, device))
            .map(|i| self.domain(i).name().to_string())
            .collect()
    }

    /// Register (through the domain's cache) a region with domain `i`. A registration failure
    /// first evicts unused cached registrations and retries once when the cause may be an
    /// exhausted aperture; if it still fails, what happens depends on what the failure is a
    /// property of ([`RegErrorKind::scope`]): the domain is demoted for that memory type and
    /// device ([`RegScope::Domain`], one warning), or only this buffer is refused and the domain
    /// stays in use for others ([`RegScope::Buffer`], remembered per allocation where the domain
    /// can identify it). Either way the error is returned for the caller to re-plan.
    ///
    /// Every registration a protocol makes goes through here or
    /// [`register_uncached`](Self::register_uncached).
    pub(crate) fn register(&self, i: usize, region: MemRegion) -> Result<RegGuard> {
        self.register_as(i, region, true)
    }

    /// [`register`](Self::register), except that host memory is registered for the caller alone
    /// rather than through the domain's cache: for memory whose lifetime the cache cannot follow
    /// (the worker's own staging, a peer's mapped segment, a user buffer pinned for one copy).
    /// GPU memory is handled exactly as by `register`.
    pub(crate) fn register_uncached(&self, i: usize, region: MemRegion) -> Result<RegGuard> {
        self.register_as(i, region, false)
    }

    fn register_as(&self, i: usize, region: MemRegion, cached: bool) -> Result<RegGuard> {
        let slot = &self.inner.domains[i];
        let gpu = region.mem_type.is_gpu();
        if region.len == 0 {
            // Zero bytes: registered as they are, never through the cache, which widens a
            // range to the pages around it; for an empty `Vec`, whose pointer dangles just
            // above 0, that is the null page, which a domain refuses as a bad address, a
            // failure that demoted the domain for all host memory. Whether a domain registers
            // nothing or refuses to, that says nothing about the domain or the allocation:
            // a refusal is returned as it is, and demotes and records nothing.
            // SAFETY: a region of zero bytes; the domain reads and writes none of it.
            return unsafe { slot.md.mem_reg(region) }.map(RegGuard::Direct);
        }
        if let Some(e) = self.remembered_refusal(i, &region) {
            return Err(e);
        }
        let reg = |r: MemRegion| -> Result<RegGuard> {
            if gpu {
                let key = (i, r.addr, r.len);
                let mut regs = self
                    .inner
                    .gpu_regs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if let Some(h) = regs.get(&key) {
                    if slot.md.mem_still_valid(h) {
                        return Ok(RegGuard::Direct(h.clone()));
                    }
                    regs.remove(&key);
                }
                // SAFETY: callers register only buffers that the request API keeps alive until
                // the request is finished; a kept handle is reused only after the domain has
                // confirmed the allocation is still the same.
                let h = unsafe { slot.md.mem_reg(r) }?;
                if slot.md.mem_still_valid(&h) {
                    if regs.len() >= 256 {
                        regs.clear();
                    }
                    regs.insert(key, h.clone());
                }
                return Ok(RegGuard::Direct(h));
            }
            if !cached {
                // SAFETY: callers of `register_uncached` keep the memory allocated for as long
                // as the returned guard (and every clone of its handle) lives.
                return unsafe { slot.md.mem_reg(r) }.map(RegGuard::Direct);
            }
            slot.rcache
                .get(r.addr, r.len.max(1), |start, len| {
                    let whole = MemRegion {
                        addr: start,
                        len,
                        mem_type: r.mem_type,
                        device: r.device,
                    };
                    // SAFETY: callers register only buffers that the request API keeps alive
                    // (the worker's scope waits for every request before its borrows end); the
                    // cache widens the range to whole pages of the same allocation.
                    unsafe { slot.md.mem_reg(whole) }
                })
                .map(RegGuard::Cached)
        };
        match reg(region) {
            Ok(g) => Ok(g),
            Err(e) => {
                let retry = e
                    .as_registration()
                    .is_some_and(|r| r.kind.may_recover_by_eviction());
                let e = if retry {
                    let (n, bytes) = slot.rcache.evict_unused(None);
                    tracing::debug!(
                        "registration on {} failed ({e}); evicted {n} cached regions ({bytes} bytes), retrying",
                        slot.md.name()
                    );
                    match reg(region) {
                        Ok(g) => return Ok(g),
                        Err(e2) => e2,
                    }
                } else {
                    e
                };
                if let Some(r) = e.as_registration() {
                    match r.kind.scope() {
                        RegScope::Domain => self.demote(r),
                        RegScope::Buffer => self.refuse(i, &region, r),
                    }
                }
                Err(e)
            }
        }
    }

    /// The error of an earlier refusal of the allocation holding `region` by domain `i`, while
    /// that allocation is still the one there.
    fn remembered_refusal(&self, i: usize, region: &MemRegion) -> Option<Error> {
        if !self.lock_refusals().allocs.iter().any(|(d, ..)| *d == i) {
            return None;
        }
        // Asked outside the lock: it may be a driver call.
        let now = self.inner.domains[i].md.allocation_of(region)?;
        let mut r = self.lock_refusals();
        let pos = r
            .allocs
            .iter()
            .position(|(d, a, _)| *d == i && a.base == now.base)?;
        if r.allocs[pos].1 != now {
            // Freed, and the range now belongs to another allocation: forget the refusal.
            r.allocs.remove(pos);
            return None;
        }
        let mut e = r.allocs[pos].2.clone();
        e.addr = region.addr;
        e.len = region.len;
        Some(Error::registration(e))
    }

    /// Domain `i` refused this buffer for a reason of the buffer's own: record it (and the
    /// allocation, when the domain can identify it) and say so once per allocation, without
    /// demoting the domain.
    fn refuse(&self, i: usize, region: &MemRegion, r: &RegError) {
        let md = &self.inner.domains[i].md;
        let alloc = md.allocation_of(region);
        let device = if r.mem_type.is_gpu() { r.device } else { None };
        let knob = knob_for(r);
        let first_of_kind = {
            let mut g = self.lock_refusals();
            if let Some(a) = alloc {
                if g.allocs.iter().any(|(d, x, _)| *d == i && *x == a) {
                    // Already said (a registration racing the first refusal).
                    return;
                }
                g.allocs.retain(|(d, x, _)| !(*d == i && x.base == a.base));
                if g.allocs.len() >= MAX_REMEMBERED_REFUSALS {
                    g.allocs.pop_front();
                }
                g.allocs.push_back((i, a, r.clone()));
            }
            match g.by_kind.iter_mut().find(|x| {
                x.md == r.domain
                    && x.mem_type == r.mem_type
                    && x.device == device
                    && x.kind == r.kind
            }) {
                Some(x) => {
                    x.count += 1;
                    false
                }
                None => {
                    g.by_kind.push(Refusal {
                        md: r.domain.clone(),
                        mem_type: r.mem_type,
                        device,
                        kind: r.kind,
                        reason: format!("{}: {}", r.kind.describe(), r.detail),
                        knob: knob.clone(),
                        count: 1,
                    });
                    true
                }
            }
        };
        let what = format!(
            "memory domain {} refused {} bytes at {:#x} ({} memory{}{}): {} ({}); a property of \
             this buffer, not of the domain: this buffer takes another path and {} stays in use \
             for other buffers; {}",
            r.domain,
            r.len,
            r.addr,
            r.mem_type,
            device.map(|d| format!(" of GPU {d}")).unwrap_or_default(),
            alloc
                .map(|a| format!(", allocation {:#x}+{}", a.base, a.len))
                .unwrap_or_default(),
            r.kind.describe(),
            r.detail,
            r.domain,
            knob
        );
        if first_of_kind {
            tracing::warn!("{what}");
        } else {
            tracing::info!("{what}");
        }
    }

    /// Classify a buffer: the first domain that detects it names its memory type and device;
    /// memory no domain claims is host memory.
    ///
    /// A domain that fails to classify the buffer fails the request: guessing "host" for GPU
    /// memory would hand a device address to a CPU copy.
    pub fn detect(&self, addr: usize, len: usize) -> Result<(MemoryType, Option<u32>)> {
        for slot in &self.inner.domains {
            if slot
                .md
                .attr()
                .types_with(rucx_uct::MemTypeFlags::DETECT)
                .is_empty()
            {
                continue;
            }
            if let Some(r) = slot.md.detect_mem_type(addr, len)? {
                return Ok((r.mem_type, r.device));
            }
        }
        Ok((MemoryType::Host, None))
    }

    /// Whether any domain classifies memory by address (a GPU domain): without one, every
    /// address is host memory (what [`detect`](Self::detect) answers for any).
    pub fn detects_memory(&self) -> bool {
        self.inner.domains.iter().any(|slot| {
            !slot
                .md
                .attr()
                .types_with(rucx_uct::MemTypeFlags::DETECT)
                .is_empty()
        })
    }

    /// Take a domain out of `reg_domains` for the failed memory type and device (a failure
    /// that belongs to the domain there, [`RegScope::Domain`]); one warning per demotion.
    pub fn demote(&self, r: &RegError) {
        let device = if r.mem_type.is_gpu() { r.device } else { None };
        let knob = knob_for(r);
        // The list stays locked until the warning is out: whoever reads the demotions (another
        // thread: staging helpers register and demote off the caller's thread) sees each one
        // already announced.
        let mut d = self.lock_demotions();
        if d.iter()
            .any(|x| x.md == r.domain && x.mem_type == r.mem_type && x.device == device)
        {
            return;
        }
        d.push(Demotion {
            md: r.domain.clone(),
            mem_type: r.mem_type,
            device,
            reason: format!("{}: {}", r.kind.describe(), r.detail),
            knob: knob.clone(),
        });
        self.inner.epoch.fetch_add(1, Ordering::AcqRel);
        let first = self
            .inner
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((r.domain.clone(), r.mem_type, device));
        if first {
            let on = device.map(|d| format!(" of GPU {d}")).unwrap_or_default();
            tracing::warn!(
                "memory domain {} cannot register {} memory{on}: {} ({}); a property of the \
                 domain, not of one buffer: demoted for all {} memory{on}, transfers continue on \
                 other paths; {}",
                r.domain,
                r.mem_type,
                r.kind.describe(),
                r.detail,
                r.mem_type,
                knob
            );
        }
        drop(d);
    }
}

impl crate::plan::RegView for Context {
    fn can_register(&self, md: usize, mem: MemoryType, dev: Option<u32>) -> bool {
        Context::can_register(self, md, mem, dev)
    }

    fn why_not(&self, md: usize, mem: MemoryType, dev: Option<u32>) -> String {
        self.demotion_of(md, mem, dev)
            .map(|d| format!("demoted: {d}"))
            .unwrap_or_default()
    }
}

/// The knob to name for a failed registration: the domain's own hint, or the generic skip.
fn knob_for(r: &RegError) -> String {
    if r.hint.is_empty() || r.hint.contains("RUCX_FAULT_INJECT") {
        format!(
            "set RUCX_REG_SKIP={}:{} to skip the attempt",
            r.domain, r.mem_type
        )
    } else {
        r.hint.clone()
    }
}

#[cfg(test)]
mod tests;
