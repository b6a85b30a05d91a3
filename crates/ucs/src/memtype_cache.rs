//! Memory-type cache: which address ranges hold which kind of memory.
//!
//! Classifying a pointer (host, CUDA device, CUDA managed) costs a driver call; this cache
//! remembers the answer per address range so the hot path asks the driver only once per
//! allocation. Whoever learns of a free (an allocator hook, a `cuMemFree` wrapper, the user)
//! must call [`MemtypeCache::invalidate`], since addresses are reused.
//!
//! Adjacent or overlapping ranges with the same [`MemInfo`] are merged on insert, so a lookup of a
//! range that spans several inserted pieces of one allocation still hits. A new insert that
//! overlaps older entries of another kind replaces them over the overlap (the newer answer wins).

use std::fmt;
use std::ops::Range;
use std::sync::{PoisonError, RwLock};

use crate::error::{Error, Result};
use crate::interval::IntervalMap;
use crate::memtype::MemoryType;

/// What the cache knows about an address range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemInfo {
    /// Kind of memory.
    pub mem_type: MemoryType,
    /// Owning GPU ordinal, for GPU memory.
    pub device: Option<u32>,
}

impl MemInfo {
    /// Host memory.
    pub const HOST: MemInfo = MemInfo {
        mem_type: MemoryType::Host,
        device: None,
    };

    /// Memory of `mem_type` owned by `device`.
    pub fn new(mem_type: MemoryType, device: Option<u32>) -> Self {
        MemInfo { mem_type, device }
    }
}

impl fmt::Display for MemInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.device {
            Some(d) => write!(f, "{} (GPU {d})", self.mem_type),
            None => write!(f, "{}", self.mem_type),
        }
    }
}

/// A thread-safe map from address ranges to [`MemInfo`].
#[derive(Default)]
pub struct MemtypeCache {
    map: RwLock<IntervalMap<usize, MemInfo>>,
}

impl fmt::Debug for MemtypeCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemtypeCache")
            .field("entries", &self.len())
            .finish()
    }
}

fn end_of(addr: usize, len: usize) -> Result<usize> {
    addr.checked_add(len).ok_or_else(|| {
        Error::InvalidParam(format!(
            "memory range {addr:#x}+{len} wraps around the end of the address space"
        ))
    })
}

impl MemtypeCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, IntervalMap<usize, MemInfo>> {
        // Every update below leaves the map consistent before anything can panic, so a
        // poisoned lock still guards valid data.
        self.map.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, IntervalMap<usize, MemInfo>> {
        self.map.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Record that `[addr, addr + len)` holds `info`. A zero length records nothing. A range
    /// that wraps around the address space is an [`Error::InvalidParam`].
    pub fn insert(&self, addr: usize, len: usize, info: MemInfo) -> Result<()> {
        let end = end_of(addr, len)?;
        if len == 0 {
            return Ok(());
        }
        let mut map = self.write();
        let mut new = addr..end;
        for (r, old) in map.remove_overlapping(addr..end) {
            if old == info {
                new.start = new.start.min(r.start);
                new.end = new.end.max(r.end);
                continue;
            }
            // Keep the parts of the older entry outside the new range.
            if r.start < addr {
                Self::put(&mut map, r.start..addr, old);
            }
            if r.end > end {
                Self::put(&mut map, end..r.end, old);
            }
        }
        // Absorb touching neighbours with the same info.
        if new.start > 0
            && let Some((r, &left)) = map.get(new.start - 1)
            && left == info
        {
            map.remove(r.start);
            new.start = r.start;
        }
        if let Some((r, &right)) = map.get_by_start(new.end)
            && right == info
        {
            map.remove(r.start);
            new.end = r.end;
        }
        Self::put(&mut map, new, info);
        Ok(())
    }

    fn put(map: &mut IntervalMap<usize, MemInfo>, r: Range<usize>, info: MemInfo) {
        // The caller removed everything overlapping `r` first, so this cannot be refused; if it
        // ever were, dropping the entry only costs a later driver query.
        let res = map.insert(r, info);
        debug_assert!(res.is_ok(), "memtype cache insert refused: {res:?}");
    }

    /// What `[addr, addr + len)` holds, if one entry covers the whole range. A zero length
    /// looks up the single address `addr`. Ranges that wrap or are only partly known give
    /// `None`.
    pub fn lookup(&self, addr: usize, len: usize) -> Option<MemInfo> {
        let end = addr.checked_add(len)?;
        let map = self.read();
        map.covering(addr..end).map(|(_, info)| *info)
    }

    /// The known range containing `addr` and what it holds.
    pub fn lookup_range(&self, addr: usize) -> Option<(Range<usize>, MemInfo)> {
        self.read().get(addr).map(|(r, i)| (r, *i))
    }

    /// Forget `[addr, addr + len)` (the memory was freed). Parts of entries outside the range
    /// stay. A range past the end of the address space is cut at the end.
    pub fn invalidate(&self, addr: usize, len: usize) {
        let end = addr.saturating_add(len);
        if addr >= end {
            return;
        }
        let mut map = self.write();
        for (r, info) in map.remove_overlapping(addr..end) {
            if r.start < addr {
                Self::put(&mut map, r.start..addr, info);
            }
            if r.end > end {
                Self::put(&mut map, end..r.end, info);
            }
        }
    }

    /// Forget everything.
    pub fn clear(&self) {
        self.write().clear();
    }

    /// Number of cached ranges.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// Every cached range, in address order.
    pub fn entries(&self) -> Vec<(Range<usize>, MemInfo)> {
        self.read().iter().map(|(r, i)| (r, *i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GPU0: MemInfo = MemInfo {
        mem_type: MemoryType::Cuda,
        device: Some(0),
    };
    const GPU1: MemInfo = MemInfo {
        mem_type: MemoryType::Cuda,
        device: Some(1),
    };

    #[test]
    fn insert_lookup_invalidate() {
        let c = MemtypeCache::new();
        assert!(c.is_empty());
        c.insert(0x1000, 0x1000, GPU0).unwrap();
        c.insert(0x3000, 0x1000, MemInfo::HOST).unwrap();
        assert_eq!(c.lookup(0x1000, 0x1000), Some(GPU0));
        assert_eq!(c.lookup(0x1800, 0), Some(GPU0));
        assert_eq!(c.lookup(0x1800, 0x900), None, "runs past the entry");
        assert_eq!(c.lookup(0x2000, 1), None);
        assert_eq!(c.lookup(0x3fff, 1), Some(MemInfo::HOST));
        assert_eq!(c.lookup(usize::MAX, 2), None, "wrapping range");
        assert_eq!(
            c.lookup_range(0x3004),
            Some((0x3000..0x4000, MemInfo::HOST))
        );

        c.invalidate(0x1400, 0x400);
        assert_eq!(c.lookup(0x1000, 0x400), Some(GPU0));
        assert_eq!(c.lookup(0x1400, 1), None);
        assert_eq!(c.lookup(0x1800, 0x800), Some(GPU0));
        assert_eq!(c.len(), 3);
        c.clear();
        assert!(c.is_empty());
    }

    #[test]
    fn same_kind_merges_other_kind_replaces() {
        let c = MemtypeCache::new();
        c.insert(0x1000, 0x1000, GPU0).unwrap();
        c.insert(0x2000, 0x1000, GPU0).unwrap();
        assert_eq!(c.len(), 1, "adjacent pieces of one kind merge");
        assert_eq!(c.lookup(0x1000, 0x2000), Some(GPU0));
        // Reallocated as another GPU's memory in the middle.
        c.insert(0x1800, 0x800, GPU1).unwrap();
        assert_eq!(
            c.entries(),
            vec![
                (0x1000..0x1800, GPU0),
                (0x1800..0x2000, GPU1),
                (0x2000..0x3000, GPU0)
            ]
        );
        assert_eq!(c.lookup(0x1000, 0x2000), None);
        assert!(format!("{c:?}").contains("3"));
        assert_eq!(GPU1.to_string(), "cuda (GPU 1)");
    }

    #[test]
    fn bad_ranges() {
        let c = MemtypeCache::new();
        let e = c.insert(usize::MAX - 1, 4, GPU0).unwrap_err();
        assert!(
            matches!(e, Error::InvalidParam(_)) && e.to_string().contains("wraps"),
            "{e}"
        );
        c.insert(5, 0, GPU0).unwrap();
        assert!(c.is_empty(), "zero length records nothing");
        c.insert(usize::MAX - 10, 10, GPU0).unwrap();
        c.invalidate(usize::MAX - 5, 100);
        assert_eq!(c.entries(), vec![(usize::MAX - 10..usize::MAX - 5, GPU0)]);
    }

    const SPACE: usize = 96;

    fn info(i: u8) -> MemInfo {
        match i % 4 {
            0 => MemInfo::HOST,
            1 => GPU0,
            2 => GPU1,
            _ => MemInfo::new(MemoryType::CudaManaged, Some(0)),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Against a per-address model: every address answers like the model, lookups of
        /// ranges hit exactly when the model has one kind over the whole range, and no two
        /// touching entries share a kind.
        #[test]
        fn matches_per_address_model(
            ops in prop::collection::vec((any::<bool>(), 0..SPACE, 0..24usize, any::<u8>()), 1..40),
            queries in prop::collection::vec((0..SPACE, 0..24usize), 8),
        ) {
            let c = MemtypeCache::new();
            let mut model: Vec<Option<MemInfo>> = vec![None; SPACE + 24];
            for (is_insert, a, l, k) in ops {
                if is_insert {
                    c.insert(a, l, info(k)).unwrap();
                    model[a..a + l].iter_mut().for_each(|m| *m = Some(info(k)));
                } else {
                    c.invalidate(a, l);
                    model[a..a + l].iter_mut().for_each(|m| *m = None);
                }
                for (addr, want) in model.iter().enumerate() {
                    prop_assert_eq!(c.lookup(addr, 0), *want, "address {}", addr);
                }
                let entries = c.entries();
                for w in entries.windows(2) {
                    prop_assert!(w[0].0.end <= w[1].0.start);
                    prop_assert!(!(w[0].0.end == w[1].0.start && w[0].1 == w[1].1),
                        "unmerged neighbours {:?}", w);
                }
                for &(a, l) in &queries {
                    let l = l.max(1);
                    let first = model[a];
                    let want = first.filter(|f| model[a..a + l].iter().all(|m| *m == Some(*f)));
                    prop_assert_eq!(c.lookup(a, l), want, "range {}+{}", a, l);
                }
            }
        }
    }
}
