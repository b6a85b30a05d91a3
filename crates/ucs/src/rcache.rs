//! Registration cache: reuse memory registrations across operations on the same buffers.
//!
//! Registering memory with a NIC or mapping it through a GPU aperture is expensive, and
//! applications send from the same buffers again and again. A [`Rcache`] keeps registrations of
//! address ranges in an [interval map](crate::interval), generic over the registration object `R`
//! a memory domain produces (a memory handle, a mapped pointer, ...), so every domain can reuse
//! it without this crate knowing about domains.
//!
//! - [`Rcache::get`] returns a [`RcacheGuard`] for a cached region covering the requested range.
//!   A hit bumps the region's use count and its last-use tick (eviction orders regions by
//!   it; a hit leaves the LRU tree, which holds regions by insertion, alone). A miss merges
//!   the request (aligned outward to [`RcacheConfig::alignment`]) with every cached region it
//!   overlaps, registers the merged range once through the caller's closure, and retires the
//!   overlapped regions.
//! - A *retired* region is out of the map, so no new guard can reach it; its registration is
//!   dropped when its last guard goes. Retiring happens on merge, on [`Rcache::invalidate`]
//!   (the memory was freed) and on eviction.
//! - [`Rcache::evict_unused`] drops unused regions (no live guard), least recently used first.
//!   The planner calls it before demoting a domain for an exhausted aperture; the cache also
//!   calls it itself when [`RcacheConfig::max_regions`] or [`RcacheConfig::max_bytes`] is
//!   exceeded after an insert.
//!
//! The cache does not watch the address space: whoever frees memory that may be cached must
//! call [`Rcache::invalidate`] first, or a later `get` may return a registration of the old
//! pages.
//!
//! ```
//! use rucx_ucs::rcache::{Rcache, RcacheConfig};
//! let cache: Rcache<String> = Rcache::new(RcacheConfig::new("doc")).unwrap();
//! let g = cache.get(0x10010, 100, |start, len| Ok(format!("reg {start:#x}+{len}"))).unwrap();
//! assert_eq!((g.start(), g.len()), (0x10000, 4096));
//! assert_eq!(g.registration(), "reg 0x10000+4096");
//! // A second request inside the same region is a hit; the closure is not called.
//! let g2 = cache.get(0x10200, 8, |_, _| unreachable!()).unwrap();
//! assert_eq!(cache.stats().hits, 1);
//! drop((g, g2));
//! assert_eq!(cache.evict_unused(None), (1, 4096));
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Deref, Range};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::config::{Bounds, Config, ENV_PREFIX, OptKind, OptionSpec};
use crate::error::{Error, Result};
use crate::interval::IntervalMap;
use crate::stats::{Counters, Snapshot};
use crate::units::MemUnits;

/// Option name: alignment of cached regions.
pub const OPT_ALIGNMENT: &str = "RCACHE_ALIGNMENT";
/// Option name: most cached regions.
pub const OPT_MAX_REGIONS: &str = "RCACHE_MAX_REGIONS";
/// Option name: most cached bytes.
pub const OPT_MAX_SIZE: &str = "RCACHE_MAX_SIZE";

/// Options of the registration cache. Include this table in [`Config::new`] to use
/// [`RcacheConfig::from_config`].
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: OPT_ALIGNMENT,
        kind: OptKind::MemIn(Bounds::new(1, 1 << 40).power_of_two().or_auto()),
        default: "4K",
        help: "Cached registrations start and end on multiples of this size (a power of two; \
               auto means the 4K page size). Larger values merge more neighbouring buffers \
               into one registration.",
    },
    OptionSpec {
        name: OPT_MAX_REGIONS,
        kind: OptKind::MemUnits,
        default: "inf",
        help: "Most registrations a cache keeps (a count, or inf); beyond it unused ones are \
               dropped, least recently used first.",
    },
    OptionSpec {
        name: OPT_MAX_SIZE,
        kind: OptKind::MemUnits,
        default: "inf",
        help: "Most bytes a cache keeps registered (e.g. 2G, or inf); beyond it unused \
               registrations are dropped, least recently used first. Lower it when a small GPU \
               BAR1 aperture fills up.",
    },
];

/// Default region alignment: the usual page size.
pub const DEFAULT_ALIGNMENT: usize = 4096;

/// Settings of one [`Rcache`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RcacheConfig {
    /// Name for messages and statistics, usually the memory domain's (`posix`, `mlx5_0`).
    pub name: String,
    /// Regions are aligned outward to this many bytes; a power of two.
    pub alignment: usize,
    /// Most regions kept cached; `None` for no limit.
    pub max_regions: Option<usize>,
    /// Most bytes kept cached; `None` for no limit.
    pub max_bytes: Option<u64>,
}

impl RcacheConfig {
    /// Defaults: 4 KiB alignment, no limits.
    pub fn new(name: impl Into<String>) -> Self {
        RcacheConfig {
            name: name.into(),
            alignment: DEFAULT_ALIGNMENT,
            max_regions: None,
            max_bytes: None,
        }
    }

    /// Settings from the `RUCX_RCACHE_*` options of `cfg`, which must include [`CONFIG`].
    pub fn from_config(name: impl Into<String>, cfg: &Config) -> Result<Self> {
        for opt in [OPT_ALIGNMENT, OPT_MAX_REGIONS, OPT_MAX_SIZE] {
            if !cfg.has(opt) {
                return Err(Error::Internal(format!(
                    "option {ENV_PREFIX}{opt} is not declared: build the Config with \
                     rucx_ucs::rcache::CONFIG"
                )));
            }
        }
        let limit = |m: MemUnits| match m {
            MemUnits::Bytes(b) => Some(b),
            MemUnits::Infinite | MemUnits::Auto => None,
        };
        let align_raw = cfg
            .mem_units(OPT_ALIGNMENT)
            .resolve(DEFAULT_ALIGNMENT as u64);
        let alignment = usize::try_from(align_raw)
            .ok()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| Error::Config {
                var: format!("{ENV_PREFIX}{OPT_ALIGNMENT}"),
                value: cfg.raw(OPT_ALIGNMENT).unwrap_or_default().to_string(),
                reason: "the alignment must be a power of two that fits the address space".into(),
                accepted: "a power of two such as 4K, 64K, 2M, or auto".into(),
            })?;
        Ok(RcacheConfig {
            name: name.into(),
            alignment,
            max_regions: limit(cfg.mem_units(OPT_MAX_REGIONS))
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            max_bytes: limit(cfg.mem_units(OPT_MAX_SIZE)),
        })
    }

    /// Set the alignment.
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// Set the region limit.
    pub fn max_regions(mut self, max: Option<usize>) -> Self {
        self.max_regions = max;
        self
    }

    /// Set the byte limit.
    pub fn max_bytes(mut self, max: Option<u64>) -> Self {
        self.max_bytes = max;
        self
    }
}

/// Names of the counters in [`Rcache::counters`], in index order.
pub const COUNTER_NAMES: &[&str] = &["hits", "misses", "merges", "evictions", "invalidations"];
const HITS: usize = 0;
const MISSES: usize = 1;
const MERGES: usize = 2;
const EVICTIONS: usize = 3;
const INVALIDATIONS: usize = 4;

/// Counters and occupancy of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RcacheStats {
    /// Requests served by a cached region.
    pub hits: u64,
    /// Requests that registered a new region.
    pub misses: u64,
    /// Cached regions retired because a new region was merged over them.
    pub merges: u64,
    /// Unused regions dropped by eviction (explicit or over a limit).
    pub evictions: u64,
    /// Regions retired by [`Rcache::invalidate`] or [`Rcache::clear`].
    pub invalidations: u64,
    /// Regions cached now.
    pub regions: usize,
    /// Bytes cached now.
    pub bytes: u64,
}

/// A cached region as seen by [`Rcache::regions`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    /// Start address (aligned).
    pub start: usize,
    /// End address, exclusive (aligned).
    pub end: usize,
    /// Live guards on the region.
    pub users: usize,
}

struct Region<R> {
    start: usize,
    end: usize,
    reg: R,
}

struct Slot<R> {
    region: Arc<Region<R>>,
    /// When the region was last used (the LRU order: eviction sorts by it).
    tick: u64,
    /// The key of this region in `Inner::lru`: its tick when it was inserted. A hit only
    /// moves `tick` (two tree updates per hit were most of a hit's cost with a handful of
    /// buffers in rotation).
    lru_key: u64,
}

impl<R> Slot<R> {
    /// No guard holds the region: the map's reference is the only one. Guards are only
    /// created under the cache lock from this reference (or cloned from another guard, which
    /// needs a count of at least two), so while the lock is held a count of one stays one.
    fn unused(&self) -> bool {
        Arc::strong_count(&self.region) == 1
    }
}

struct Inner<R> {
    map: IntervalMap<usize, Slot<R>>,
    /// Every region by the tick it was inserted at (`Slot::lru_key`) -> its start.
    lru: BTreeMap<u64, usize>,
    next_tick: u64,
    bytes: u64,
}

impl<R> Inner<R> {
    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    fn touch(&mut self, start: usize) {
        let tick = self.tick();
        if let Some(slot) = self.map.get_mut_by_start(start) {
            slot.tick = tick;
        }
    }

    /// Take the region starting at `start` out of the map and the LRU list.
    fn retire(&mut self, start: usize) -> Option<Arc<Region<R>>> {
        let (r, slot) = self.map.remove(start)?;
        self.lru.remove(&slot.lru_key);
        self.bytes -= (r.end - r.start) as u64;
        Some(slot.region)
    }

    /// Retire unused regions, oldest first, while `more(regions_now, bytes_now, freed_bytes)`
    /// says so. Retired regions go to `out`, to be dropped after the lock is released.
    fn evict(
        &mut self,
        out: &mut Vec<Arc<Region<R>>>,
        more: impl Fn(usize, u64, u64) -> bool,
    ) -> (usize, u64) {
        let (mut regions, mut bytes) = (0usize, 0u64);
        // Least recently used first (a hit moves a region's tick, not its place in `lru`).
        let mut candidates: Vec<(u64, usize)> = self
            .lru
            .values()
            .filter_map(|&start| self.map.get_by_start(start).map(|(_, s)| (s.tick, start)))
            .collect();
        candidates.sort_unstable();
        for (_, start) in candidates {
            if !more(self.map.len(), self.bytes, bytes) {
                break;
            }
            let unused = self
                .map
                .get_by_start(start)
                .is_some_and(|(_, slot)| slot.unused());
            if !unused {
                continue;
            }
            if let Some(region) = self.retire(start) {
                regions += 1;
                bytes += (region.end - region.start) as u64;
                out.push(region);
            }
        }
        (regions, bytes)
    }
}

/// A registration cache; see the [module documentation](self).
pub struct Rcache<R> {
    config: RcacheConfig,
    inner: Mutex<Inner<R>>,
    counters: Counters,
}

impl<R> fmt::Debug for Rcache<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("Rcache")
            .field("config", &self.config)
            .field("regions", &inner.map.len())
            .field("bytes", &inner.bytes)
            .finish()
    }
}

/// A use of a cached registration. The registration stays alive while any guard on it exists,
/// even if the region is retired from the cache meanwhile. Cloning a guard adds a use.
pub struct RcacheGuard<R> {
    region: Arc<Region<R>>,
}

impl<R> Clone for RcacheGuard<R> {
    fn clone(&self) -> Self {
        RcacheGuard {
            region: Arc::clone(&self.region),
        }
    }
}

impl<R> RcacheGuard<R> {
    /// Start of the registered region (aligned, at or below the requested address).
    pub fn start(&self) -> usize {
        self.region.start
    }

    /// End of the registered region, exclusive (at or above the requested end).
    pub fn end(&self) -> usize {
        self.region.end
    }

    /// Length of the registered region.
    pub fn len(&self) -> usize {
        self.region.end - self.region.start
    }

    /// Always false: cached regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The registered range.
    pub fn range(&self) -> Range<usize> {
        self.region.start..self.region.end
    }

    /// The registration object the closure of [`Rcache::get`] returned.
    pub fn registration(&self) -> &R {
        &self.region.reg
    }

    /// True when both guards use the same registration.
    pub fn same_registration(&self, other: &RcacheGuard<R>) -> bool {
        Arc::ptr_eq(&self.region, &other.region)
    }
}

impl<R> Deref for RcacheGuard<R> {
    type Target = R;
    fn deref(&self) -> &R {
        &self.region.reg
    }
}

impl<R> fmt::Debug for RcacheGuard<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RcacheGuard({:#x}..{:#x})", self.start(), self.end())
    }
}

impl<R> Rcache<R> {
    /// An empty cache. Fails when the alignment is not a power of two.
    pub fn new(config: RcacheConfig) -> Result<Self> {
        if !config.alignment.is_power_of_two() {
            return Err(Error::InvalidParam(format!(
                "registration cache {}: alignment {} is not a power of two",
                config.name, config.alignment
            )));
        }
        let counters = Counters::new(format!("rcache:{}", config.name), COUNTER_NAMES);
        Ok(Rcache {
            config,
            inner: Mutex::new(Inner {
                map: IntervalMap::new(),
                lru: BTreeMap::new(),
                next_tick: 0,
                bytes: 0,
            }),
            counters,
        })
    }
}

impl<R> Rcache<R> {
    fn lock(&self) -> MutexGuard<'_, Inner<R>> {
        // The state is only changed after the registration closure returned and nothing in
        // the update panics, so a lock poisoned by a panicking closure guards valid data.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The settings.
    pub fn config(&self) -> &RcacheConfig {
        &self.config
    }

    /// A registration covering `[addr, addr + len)`.
    ///
    /// On a hit the cached region is returned and `register` is not called. On a miss,
    /// `register(start, len)` is called once for the request aligned outward and merged with
    /// every cached region it overlaps; when it succeeds the new region replaces those regions
    /// (their registrations live on until their last guard goes), and unused regions are
    /// evicted if a limit is now exceeded. When it fails, the cache is unchanged and its error
    /// is returned as is (a [`Error::Registration`] stays one, so the caller can evict and
    /// retry, or demote the domain).
    ///
    /// `register` runs under the cache lock: it must not call back into this cache.
    /// A zero `len` or a range that wraps the address space is an [`Error::InvalidParam`].
    pub fn get<F>(&self, addr: usize, len: usize, register: F) -> Result<RcacheGuard<R>>
    where
        F: FnOnce(usize, usize) -> Result<R>,
    {
        let bad = |why: &str| {
            Error::InvalidParam(format!(
                "registration cache {}: cannot register {len} bytes at {addr:#x}: {why}",
                self.config.name
            ))
        };
        if len == 0 {
            return Err(bad("the length is zero"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| bad("the range wraps around the address space"))?;
        let align = self.config.alignment;
        let aligned_end = end.checked_next_multiple_of(align).ok_or_else(|| {
            bad(&format!(
                "the range cannot be aligned to {align} bytes within the address space"
            ))
        })?;
        let aligned_start = addr & !(align - 1);

        let mut dropped = Vec::new();
        let mut inner = self.lock();
        if let Some((r, slot)) = inner.map.covering(addr..end) {
            let guard = RcacheGuard {
                region: Arc::clone(&slot.region),
            };
            // The region used last is the newest already (a sender from one buffer hits the
            // same region every message).
            if slot.tick != inner.next_tick {
                inner.touch(r.start);
            }
            self.counters.inc(HITS);
            return Ok(guard);
        }
        self.counters.inc(MISSES);

        let mut merged = aligned_start..aligned_end;
        for (r, _) in inner.map.overlapping(aligned_start..aligned_end) {
            merged.start = merged.start.min(r.start);
            merged.end = merged.end.max(r.end);
        }
        let reg = register(merged.start, merged.end - merged.start)?;

        let overlapped: Vec<usize> = inner
            .map
            .overlapping(merged.clone())
            .map(|(r, _)| r.start)
            .collect();
        for start in overlapped {
            if let Some(region) = inner.retire(start) {
                self.counters.inc(MERGES);
                dropped.push(region);
            }
        }
        let region = Arc::new(Region {
            start: merged.start,
            end: merged.end,
            reg,
        });
        let guard = RcacheGuard {
            region: Arc::clone(&region),
        };
        let tick = inner.tick();
        // Everything overlapping `merged` was retired just above, so the insert succeeds.
        let slot = Slot {
            region,
            tick,
            lru_key: tick,
        };
        let inserted = inner.map.insert(merged.clone(), slot);
        debug_assert!(inserted.is_ok(), "rcache insert refused for {merged:?}");
        if inserted.is_ok() {
            inner.lru.insert(tick, merged.start);
            inner.bytes += (merged.end - merged.start) as u64;
        }
        tracing::trace!(
            cache = %self.config.name,
            "registered {:#x}..{:#x} for {addr:#x}+{len}",
            merged.start,
            merged.end
        );

        let (max_regions, max_bytes) = (self.config.max_regions, self.config.max_bytes);
        if max_regions.is_some() || max_bytes.is_some() {
            let over = |regions: usize, bytes: u64, _freed: u64| {
                max_regions.is_some_and(|m| regions > m) || max_bytes.is_some_and(|m| bytes > m)
            };
            let (n, _) = inner.evict(&mut dropped, over);
            self.counters.add(EVICTIONS, n as u64);
        }
        drop(inner);
        // Registrations of retired, unused regions are released here, outside the lock.
        drop(dropped);
        Ok(guard)
    }

    /// Drop unused cached regions, least recently used first, until at least `target_bytes`
    /// were freed (`None`: every unused region). Regions in use are never dropped. Returns the
    /// number of regions and bytes evicted.
    pub fn evict_unused(&self, target_bytes: Option<u64>) -> (usize, u64) {
        let mut dropped = Vec::new();
        let mut inner = self.lock();
        let (n, bytes) = inner.evict(&mut dropped, |_, _, freed| {
            target_bytes.is_none_or(|t| freed < t)
        });
        drop(inner);
        self.counters.add(EVICTIONS, n as u64);
        if n > 0 {
            tracing::debug!(
                cache = %self.config.name,
                "evicted {n} unused registrations ({bytes} bytes)"
            );
        }
        drop(dropped);
        (n, bytes)
    }

    /// The memory `[addr, addr + len)` was freed: retire every region overlapping it. Their
    /// registrations are dropped once their last guard goes. Returns how many regions were
    /// retired. A range past the end of the address space is cut at the end.
    pub fn invalidate(&self, addr: usize, len: usize) -> usize {
        let end = addr.saturating_add(len);
        let mut inner = self.lock();
        let starts: Vec<usize> = inner
            .map
            .overlapping(addr..end)
            .map(|(r, _)| r.start)
            .collect();
        let dropped: Vec<_> = starts.into_iter().filter_map(|s| inner.retire(s)).collect();
        drop(inner);
        self.counters.add(INVALIDATIONS, dropped.len() as u64);
        dropped.len()
    }

    /// Retire every region. Returns how many there were.
    pub fn clear(&self) -> usize {
        self.invalidate(0, usize::MAX)
    }

    /// Number of cached regions.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes covered by cached regions.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Every cached region with its number of live guards, in address order.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.lock()
            .map
            .iter()
            .map(|(r, slot)| RegionInfo {
                start: r.start,
                end: r.end,
                users: Arc::strong_count(&slot.region) - 1,
            })
            .collect()
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> RcacheStats {
        let (regions, bytes) = {
            let inner = self.lock();
            (inner.map.len(), inner.bytes)
        };
        RcacheStats {
            hits: self.counters.get(HITS),
            misses: self.counters.get(MISSES),
            merges: self.counters.get(MERGES),
            evictions: self.counters.get(EVICTIONS),
            invalidations: self.counters.get(INVALIDATIONS),
            regions,
            bytes,
        }
    }

    /// The raw counters (class `rcache:<name>`), e.g. to print a [`Snapshot`].
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> Snapshot {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{RegError, RegErrorKind};
    use crate::memtype::MemoryType;
    use proptest::prelude::*;
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Records every registration created and dropped.
    #[derive(Default, Debug)]
    struct Log {
        created: AtomicU64,
        dropped: Mutex<Vec<u64>>,
    }

    impl Log {
        fn created(&self) -> u64 {
            self.created.load(Ordering::SeqCst)
        }
        fn dropped(&self) -> Vec<u64> {
            self.dropped.lock().unwrap().clone()
        }
    }

    #[derive(Debug)]
    struct RegInner {
        id: u64,
        start: usize,
        len: usize,
        log: Arc<Log>,
    }

    impl Drop for RegInner {
        fn drop(&mut self) {
            self.log.dropped.lock().unwrap().push(self.id);
        }
    }

    /// A registration object that counts its creation and drop (clones share one drop).
    #[derive(Clone, Debug)]
    struct Reg(Arc<RegInner>);

    fn registrar(log: &Arc<Log>) -> impl Fn(usize, usize) -> Result<Reg> + '_ {
        move |start, len| {
            let id = log.created.fetch_add(1, Ordering::SeqCst);
            Ok(Reg(Arc::new(RegInner {
                id,
                start,
                len,
                log: Arc::clone(log),
            })))
        }
    }

    fn aperture_error(start: usize, len: usize) -> Error {
        Error::registration(RegError {
            domain: "test".into(),
            mem_type: MemoryType::Cuda,
            device: Some(0),
            addr: start,
            len,
            kind: RegErrorKind::ApertureExhausted,
            detail: "BAR1 full".into(),
            hint: String::new(),
        })
    }

    fn cache(align: usize) -> Rcache<Reg> {
        Rcache::new(RcacheConfig::new("test").alignment(align)).unwrap()
    }

    #[test]
    fn hit_miss_merge_and_retire() {
        let log = Arc::new(Log::default());
        let c = cache(4096);
        let a = c.get(0x1000, 10, registrar(&log)).unwrap();
        assert_eq!(a.range(), 0x1000..0x2000);
        assert_eq!((a.0.start, a.0.len), (0x1000, 0x1000));
        let b = c.get(0x1ff0, 0x10, registrar(&log)).unwrap();
        assert!(a.same_registration(&b), "hit");
        // Overlaps [0x1000, 0x2000) and reaches into the next page: merged into one region.
        let m = c.get(0x1800, 0x1000, registrar(&log)).unwrap();
        assert_eq!(m.range(), 0x1000..0x3000);
        assert!(!m.same_registration(&a));
        let s = c.stats();
        assert_eq!(
            (s.hits, s.misses, s.merges, s.regions, s.bytes),
            (1, 2, 1, 1, 0x2000)
        );
        // The retired region lives while its guards do.
        assert!(log.dropped().is_empty());
        drop(a);
        assert!(log.dropped().is_empty());
        drop(b);
        assert_eq!(log.dropped(), vec![0]);
        // A used region is not evicted; an unused one is.
        assert_eq!(c.evict_unused(None), (0, 0));
        drop(m);
        assert_eq!(c.regions()[0].users, 0);
        assert_eq!(c.evict_unused(None), (1, 0x2000));
        assert_eq!(log.dropped(), vec![0, 1]);
        assert!(c.is_empty());
        assert_eq!(c.stats().evictions, 1);
        let text = c.snapshot().to_string();
        assert!(
            text.contains("hits: 1\n") && text.contains("evictions: 1\n"),
            "{text}"
        );
    }

    #[test]
    fn invalidate_retires_overlapping_regions() {
        let log = Arc::new(Log::default());
        let c = cache(16);
        let g = c.get(0, 16, registrar(&log)).unwrap();
        drop(c.get(32, 16, registrar(&log)).unwrap());
        drop(c.get(64, 16, registrar(&log)).unwrap());
        assert_eq!(c.invalidate(8, 30), 2, "[0,16) and [32,48)");
        assert_eq!(log.dropped(), vec![1], "the used one lives on");
        assert_eq!(g.registration().0.id, 0);
        assert_eq!(c.invalidate(16, 0), 0);
        assert_eq!(c.len(), 1);
        assert_eq!(c.clear(), 1);
        assert_eq!(c.stats().invalidations, 3);
        drop(g);
        assert_eq!(log.created(), log.dropped().len() as u64);
    }

    #[test]
    fn failed_registration_leaves_cache_unchanged() {
        let log = Arc::new(Log::default());
        let c = cache(16);
        let g = c.get(0, 16, registrar(&log)).unwrap();
        let before = c.regions();
        let e = c.get(8, 32, |s, l| Err(aperture_error(s, l))).unwrap_err();
        let r = e
            .as_registration()
            .expect("the registration error is passed through");
        assert_eq!(
            (r.addr, r.len, r.kind),
            (0, 48, RegErrorKind::ApertureExhausted)
        );
        assert_eq!(c.regions(), before);
        assert!(log.dropped().is_empty());
        // A panicking closure leaves it usable too.
        let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = c.get(100, 1, |_, _| panic!("driver exploded"));
        }));
        assert!(p.is_err());
        assert_eq!(c.regions(), before);
        assert!(c.get(4, 4, registrar(&log)).unwrap().same_registration(&g));
    }

    #[test]
    fn bad_requests_are_errors() {
        let c = cache(4096);
        let e = c.get(0x1000, 0, |_, _| unreachable!()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidParam(_)) && e.to_string().contains("zero"),
            "{e}"
        );
        let e = c.get(usize::MAX, 2, |_, _| unreachable!()).unwrap_err();
        assert!(e.to_string().contains("wraps"), "{e}");
        let e = c
            .get(usize::MAX - 10, 2, |_, _| unreachable!())
            .unwrap_err();
        assert!(e.to_string().contains("aligned"), "{e}");
        let e = Rcache::<Reg>::new(RcacheConfig::new("x").alignment(3)).unwrap_err();
        assert!(e.to_string().contains("power of two"), "{e}");
        assert!(c.is_empty());
    }

    #[test]
    fn limits_evict_unused_oldest_first() {
        let log = Arc::new(Log::default());
        let c: Rcache<Reg> = Rcache::new(
            RcacheConfig::new("lim")
                .alignment(16)
                .max_regions(Some(2))
                .max_bytes(Some(64)),
        )
        .unwrap();
        let keep = c.get(0, 16, registrar(&log)).unwrap(); // id 0, used
        drop(c.get(32, 16, registrar(&log)).unwrap()); // id 1
        drop(c.get(64, 16, registrar(&log)).unwrap()); // id 2: over 2 regions, 1 goes
        assert_eq!(log.dropped(), vec![1]);
        assert_eq!(c.len(), 2);
        // 64 bytes on top of 32: over the byte limit; id 2 goes, the new and the used stay.
        let big = c.get(128, 64, registrar(&log)).unwrap(); // id 3
        assert_eq!(log.dropped(), vec![1, 2]);
        assert_eq!(
            c.bytes(),
            80,
            "over the limit, but everything left is in use"
        );
        assert_eq!(c.stats().evictions, 2);
        drop((keep, big));
        assert_eq!(
            c.evict_unused(Some(1)),
            (1, 16),
            "oldest first, stop at the target"
        );
        assert_eq!(log.dropped(), vec![1, 2, 0]);
    }

    #[test]
    fn from_config_reads_options() {
        let cfg = Config::from_vars(
            &[CONFIG],
            [
                ("RUCX_RCACHE_MAX_SIZE", "1M"),
                ("RUCX_RCACHE_ALIGNMENT", "64K"),
            ],
        )
        .unwrap();
        let rc = RcacheConfig::from_config("posix", &cfg).unwrap();
        assert_eq!(rc.alignment, 65536);
        assert_eq!(rc.max_bytes, Some(1 << 20));
        assert_eq!(rc.max_regions, None);
        let dflt = RcacheConfig::from_config("p", &Config::new(&[CONFIG]).unwrap()).unwrap();
        assert_eq!(dflt, RcacheConfig::new("p"));

        // Checked where it is read: the configuration itself refuses it.
        let e = Config::from_vars(&[CONFIG], [("RUCX_RCACHE_ALIGNMENT", "3000")]).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        assert!(
            s.contains("RUCX_RCACHE_ALIGNMENT") && s.contains("3000") && s.contains("power of two"),
            "{s}"
        );
        let e = RcacheConfig::from_config("p", &Config::new(&[]).unwrap()).unwrap_err();
        assert!(e.to_string().contains("rcache::CONFIG"), "{e}");
    }

    #[test]
    fn threads_share_a_cache() {
        fn is_send<T: Send>() {}
        is_send::<RcacheGuard<Reg>>();
        let log = Arc::new(Log::default());
        let c = Arc::new(cache(64));
        let threads: Vec<_> = (0..4usize)
            .map(|t| {
                let (c, log) = (Arc::clone(&c), Arc::clone(&log));
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    let mut x = t as u64 + 1;
                    for _ in 0..300 {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let addr = ((x >> 33) % 4096) as usize;
                        let len = ((x >> 20) % 200) as usize + 1;
                        match (x >> 8) % 5 {
                            0 => {
                                c.invalidate(addr, len);
                            }
                            1 => {
                                c.evict_unused(Some(len as u64));
                            }
                            _ => {
                                let g = c.get(addr, len, registrar(&log)).unwrap();
                                assert!(g.start() <= addr && g.end() >= addr + len);
                                assert_eq!((g.0.start, g.0.len), (g.start(), g.len()));
                                held.push(g);
                                if held.len() > 4 {
                                    held.remove(0);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let regions = c.regions();
        assert!(regions.iter().all(|r| r.users == 0));
        assert!(regions.windows(2).all(|w| w[0].end <= w[1].start));
        assert_eq!(
            log.created() - log.dropped().len() as u64,
            regions.len() as u64
        );
        c.evict_unused(None);
        assert_eq!(log.created(), log.dropped().len() as u64);
    }

    // ---- model-based property test ----

    #[derive(Clone, Debug)]
    enum Op {
        Get { addr: usize, len: usize, fail: bool },
        DropGuard(usize),
        CloneGuard(usize),
        Invalidate { addr: usize, len: usize },
        Evict(Option<u64>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0usize..1024, 1usize..200, prop::bool::weighted(0.1))
                .prop_map(|(addr, len, fail)| Op::Get { addr, len, fail }),
            3 => any::<usize>().prop_map(Op::DropGuard),
            1 => any::<usize>().prop_map(Op::CloneGuard),
            1 => (0usize..1100, 0usize..200).prop_map(|(addr, len)| Op::Invalidate { addr, len }),
            1 => prop::option::of(0u64..400).prop_map(Op::Evict),
        ]
    }

    #[derive(Clone, Debug, PartialEq)]
    struct MRegion {
        start: usize,
        end: usize,
        id: u64,
        tick: u64,
    }

    #[derive(Default, Debug, PartialEq)]
    struct MStats {
        hits: u64,
        misses: u64,
        merges: u64,
        evictions: u64,
        invalidations: u64,
    }

    struct Live {
        guard: RcacheGuard<Reg>,
        id: u64,
        addr: usize,
        end: usize,
    }

    /// Drop unused model regions oldest first while `more(regions, bytes, freed)`.
    fn model_evict(
        regions: &mut Vec<MRegion>,
        live: &[Live],
        more: impl Fn(usize, u64, u64) -> bool,
    ) -> (usize, u64) {
        let mut order = regions.clone();
        order.sort_by_key(|r| r.tick);
        let (mut n, mut freed) = (0, 0u64);
        for r in order {
            let bytes: u64 = regions.iter().map(|r| (r.end - r.start) as u64).sum();
            if !more(regions.len(), bytes, freed) {
                break;
            }
            if live.iter().any(|l| l.id == r.id) {
                continue;
            }
            regions.retain(|x| x.id != r.id);
            n += 1;
            freed += (r.end - r.start) as u64;
        }
        (n, freed)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn behaves_like_the_model(
            align in prop::sample::select(vec![1usize, 16, 64]),
            max_regions in prop::option::of(1usize..5),
            max_bytes in prop::option::of(64u64..1024),
            ops in prop::collection::vec(op(), 1..60),
        ) {
            let log = Arc::new(Log::default());
            let c: Rcache<Reg> = Rcache::new(
                RcacheConfig::new("prop").alignment(align).max_regions(max_regions).max_bytes(max_bytes),
            ).unwrap();
            let mut regions: Vec<MRegion> = Vec::new();
            let mut live: Vec<Live> = Vec::new();
            let mut st = MStats::default();
            let mut tick = 0u64;
            let mut next_id = 0u64;

            for op in ops {
                match op {
                    Op::Get { addr, len, fail } => {
                        let end = addr + len;
                        if let Some(r) = regions.iter_mut().find(|r| r.start <= addr && end <= r.end) {
                            tick += 1;
                            r.tick = tick;
                            st.hits += 1;
                            let g = c.get(addr, len, |_, _| panic!("hit must not register")).unwrap();
                            prop_assert_eq!(g.registration().0.id, r.id);
                            live.push(Live { guard: g, id: r.id, addr, end });
                            continue;
                        }
                        st.misses += 1;
                        let (mut ms, mut me) = (addr / align * align, end.div_ceil(align) * align);
                        let (a0, a1) = (ms, me);
                        for r in regions.iter().filter(|r| r.start < a1 && a0 < r.end) {
                            ms = ms.min(r.start);
                            me = me.max(r.end);
                        }
                        let mut called = None;
                        let res = c.get(addr, len, |s, l| {
                            called = Some((s, l));
                            if fail { Err(aperture_error(s, l)) } else { registrar(&log)(s, l) }
                        });
                        prop_assert_eq!(called, Some((ms, me - ms)));
                        if fail {
                            let e = res.unwrap_err();
                            prop_assert!(e.as_registration().is_some());
                        } else {
                            let g = res.unwrap();
                            prop_assert_eq!(g.registration().0.id, next_id);
                            let before = regions.len();
                            regions.retain(|r| !(r.start < me && ms < r.end));
                            st.merges += (before - regions.len()) as u64;
                            tick += 1;
                            regions.push(MRegion { start: ms, end: me, id: next_id, tick });
                            live.push(Live { guard: g, id: next_id, addr, end });
                            next_id += 1;
                            if max_regions.is_some() || max_bytes.is_some() {
                                let (n, _) = model_evict(&mut regions, &live, |n, b, _| {
                                    max_regions.is_some_and(|m| n > m) || max_bytes.is_some_and(|m| b > m)
                                });
                                st.evictions += n as u64;
                            }
                        }
                    }
                    Op::DropGuard(i) => {
                        if !live.is_empty() {
                            live.remove(i % live.len());
                        }
                    }
                    Op::CloneGuard(i) => {
                        if !live.is_empty() {
                            let l = &live[i % live.len()];
                            let copy = Live { guard: l.guard.clone(), id: l.id, addr: l.addr, end: l.end };
                            live.push(copy);
                        }
                    }
                    Op::Invalidate { addr, len } => {
                        let end = addr + len;
                        let before = regions.len();
                        regions.retain(|r| !(addr < end && r.start < end && addr < r.end));
                        let n = before - regions.len();
                        st.invalidations += n as u64;
                        prop_assert_eq!(c.invalidate(addr, len), n);
                    }
                    Op::Evict(target) => {
                        let want = model_evict(&mut regions, &live, |_, _, freed| {
                            target.is_none_or(|t| freed < t)
                        });
                        st.evictions += want.0 as u64;
                        prop_assert_eq!(c.evict_unused(target), want);
                    }
                }

                // The cache holds exactly the model's regions, aligned and non-overlapping,
                // with the right number of users each.
                regions.sort_by_key(|r| r.start);
                let got = c.regions();
                let want: Vec<RegionInfo> = regions.iter().map(|r| RegionInfo {
                    start: r.start,
                    end: r.end,
                    users: live.iter().filter(|l| l.id == r.id).count(),
                }).collect();
                prop_assert_eq!(&got, &want);
                for w in got.windows(2) {
                    prop_assert!(w[0].end <= w[1].start, "overlap {:?}", w);
                }
                prop_assert!(got.iter().all(|r| r.start % align == 0 && r.end % align == 0 && r.start < r.end));
                prop_assert_eq!(c.bytes(), regions.iter().map(|r| (r.end - r.start) as u64).sum::<u64>());

                // Every live guard still covers what was asked, with its own registration.
                let dropped: BTreeSet<u64> = log.dropped().into_iter().collect();
                for l in &live {
                    let g = &l.guard;
                    prop_assert!(g.start() <= l.addr && l.end <= g.end());
                    prop_assert_eq!((g.0.id, g.0.start, g.0.len), (l.id, g.start(), g.len()));
                    prop_assert!(!dropped.contains(&l.id), "registration {} of a live guard dropped", l.id);
                }
                // Exactly the registrations still reachable (cached or guarded) are alive: none
                // leaked, none dropped early.
                let reachable: BTreeSet<u64> =
                    regions.iter().map(|r| r.id).chain(live.iter().map(|l| l.id)).collect();
                prop_assert_eq!(log.created(), next_id);
                let alive: BTreeSet<u64> = (0..next_id).filter(|i| !dropped.contains(i)).collect();
                prop_assert_eq!(alive, reachable);
                prop_assert_eq!(dropped.len(), log.dropped().len(), "a registration dropped twice");

                let s = c.stats();
                prop_assert_eq!(
                    &MStats { hits: s.hits, misses: s.misses, merges: s.merges, evictions: s.evictions, invalidations: s.invalidations },
                    &st
                );
            }
        }
    }
}
