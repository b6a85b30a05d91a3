//! A pool of fixed-size pinned host fragments for staging protocols (device -> host -> wire,
//! wire -> host -> device).
//!
//! The fragments are carved out of one portable pinned allocation (`cuMemHostAlloc`) made when
//! the pool is created; the pool never hands out more than its configured count. A
//! [`Fragment`] returns to the pool when dropped. Every fragment can be used directly in
//! `cuda_copy` zero-copy operations through [`Fragment::memh`] (a `cuda_cpy` handle covering the
//! whole pool), and other domains (e.g. a NIC) can register [`StagingPool::region`] once.
//!
//! Keep a fragment until every operation that reads or writes it has completed: dropping it
//! makes it available to the next [`StagingPool::get`].

use std::fmt;
use std::sync::{Arc, Mutex};

use rucx_cuda::{PinnedHostBuffer, driver};
use rucx_ucs::Result;
use rucx_uct::{MemHandle, MemRegion};

use crate::Settings;
use crate::md::pinned_handle;

enum Backing {
    Pinned {
        _owner: PinnedHostBuffer,
    },
    /// Plain heap memory, for tests of the bookkeeping on hosts without CUDA.
    #[cfg(test)]
    Heap {
        _owner: Vec<u8>,
    },
}

/// Fixed-size pinned host fragments; see the [module docs](self).
pub struct StagingPool {
    // Dropped before the memory it describes.
    memh: MemHandle,
    backing: Backing,
    base: usize,
    frag_size: usize,
    count: usize,
    free: Mutex<Vec<u32>>,
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("base", &format_args!("{:#x}", self.base))
            .field("frag_size", &self.frag_size)
            .field("count", &self.count)
            .field("available", &self.available())
            .finish()
    }
}

impl StagingPool {
    /// Allocate `settings.frag_count` fragments of `settings.frag_size` bytes of pinned host
    /// memory (portable to every GPU context).
    pub fn new(settings: &Settings) -> Result<Arc<StagingPool>> {
        let total = settings
            .frag_size
            .checked_mul(settings.frag_count)
            .ok_or_else(|| {
                rucx_ucs::Error::InvalidParam(format!(
                    "{} staging fragments of {} bytes overflow",
                    settings.frag_count, settings.frag_size
                ))
            })?;
        let ctx = driver()?.any_context()?;
        let buf = PinnedHostBuffer::new(ctx, total)?;
        let base = buf.ptr() as usize;
        Ok(Self::with_backing(
            Backing::Pinned { _owner: buf },
            base,
            settings.frag_size,
            settings.frag_count,
        ))
    }

    fn with_backing(
        backing: Backing,
        base: usize,
        frag_size: usize,
        count: usize,
    ) -> Arc<StagingPool> {
        let memh = pinned_handle(MemRegion::host(base, frag_size * count));
        Arc::new(StagingPool {
            memh,
            backing,
            base,
            frag_size,
            count,
            // Hand out low fragments first.
            free: Mutex::new((0..count as u32).rev().collect()),
        })
    }

    /// A pool over ordinary heap memory (tests of the bookkeeping only).
    #[cfg(test)]
    pub(crate) fn for_test(frag_size: usize, count: usize) -> Arc<StagingPool> {
        let mut mem = vec![0u8; frag_size * count];
        // The heap block does not move when the vector is moved into the pool.
        let base = mem.as_mut_ptr() as usize;
        Self::with_backing(Backing::Heap { _owner: mem }, base, frag_size, count)
    }

    /// Take a free fragment, or `None` when all are in use (progress and retry).
    pub fn get(self: &Arc<Self>) -> Option<Fragment> {
        let index = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        Some(Fragment {
            pool: self.clone(),
            index,
        })
    }

    /// Fragments not in use.
    pub fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Total fragments.
    pub fn capacity(&self) -> usize {
        self.count
    }

    /// Bytes per fragment.
    pub fn frag_size(&self) -> usize {
        self.frag_size
    }

    /// The whole pool's memory, for registering it once with another domain.
    pub fn region(&self) -> MemRegion {
        *self.memh.region()
    }

    /// A `cuda_cpy` handle covering every fragment.
    pub fn memh(&self) -> &MemHandle {
        &self.memh
    }

    /// Whether the memory is pinned (always, except in this crate's own bookkeeping tests).
    pub fn is_pinned(&self) -> bool {
        matches!(self.backing, Backing::Pinned { .. })
    }

    fn put_back(&self, index: u32) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        debug_assert!(!free.contains(&index), "fragment {index} returned twice");
        free.push(index);
    }
}

/// One fragment of a [`StagingPool`], returned to it when dropped.
pub struct Fragment {
    pool: Arc<StagingPool>,
    index: u32,
}

impl fmt::Debug for Fragment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fragment")
            .field("index", &self.index)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl Fragment {
    /// Index in the pool.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.pool.base + self.index as usize * self.pool.frag_size
    }

    /// Length (the pool's fragment size).
    pub fn len(&self) -> usize {
        self.pool.frag_size
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.pool.frag_size == 0
    }

    /// This fragment as a host region.
    pub fn region(&self) -> MemRegion {
        MemRegion::host(self.addr(), self.len())
    }

    /// A `cuda_cpy` handle covering the fragment (it covers the whole pool).
    pub fn memh(&self) -> &MemHandle {
        &self.pool.memh
    }

    /// The bytes. Do not read while a copy into the fragment is in flight.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the fragment lies inside the pool's live allocation (index < count), no other
        // `Fragment` has this index while we exist, and the pool outlives us (we hold an Arc).
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len()) }
    }

    /// The bytes, mutably. Do not use while a copy from or into the fragment is in flight.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len()) }
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }
}

impl Drop for Fragment {
    fn drop(&mut self) {
        self.pool.put_back(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn never_more_than_configured() {
        let p = StagingPool::for_test(4096, 3);
        assert_eq!((p.capacity(), p.available(), p.frag_size()), (3, 3, 4096));
        assert!(!p.is_pinned());
        let a = p.get().unwrap();
        let b = p.get().unwrap();
        let c = p.get().unwrap();
        assert!(p.get().is_none(), "a fourth fragment out of three");
        assert_eq!(p.available(), 0);
        let mut addrs = vec![a.addr(), b.addr(), c.addr()];
        addrs.sort_unstable();
        assert_eq!(
            addrs,
            vec![
                p.region().addr,
                p.region().addr + 4096,
                p.region().addr + 8192
            ]
        );
        drop(b);
        assert_eq!(p.available(), 1);
        let b2 = p.get().unwrap();
        assert!(p.get().is_none());
        drop((a, b2, c));
        assert_eq!(p.available(), 3);
    }

    #[test]
    fn fragments_are_disjoint_writable_and_covered_by_the_handle() {
        let p = StagingPool::for_test(64, 4);
        let mut frags: Vec<Fragment> = (0..4).map(|_| p.get().unwrap()).collect();
        for (i, f) in frags.iter_mut().enumerate() {
            f.as_mut_slice().fill(i as u8 + 1);
            f.memh().check(f.addr(), f.len()).unwrap();
            assert_eq!(f.region().len, 64);
        }
        for (i, f) in frags.iter().enumerate() {
            assert!(f.as_slice().iter().all(|b| *b == i as u8 + 1));
        }
        assert_eq!(p.memh().domain(), "cuda_cpy");
        assert!(format!("{:?}", frags[0]).contains("index"));
    }

    #[test]
    fn fragment_keeps_pool_alive() {
        let p = StagingPool::for_test(128, 2);
        let mut f = p.get().unwrap();
        drop(p);
        f.as_mut_slice().fill(9);
        assert_eq!(f.pool().available(), 1);
    }

    #[test]
    fn pinned_pool_needs_the_driver() {
        if driver().is_ok() {
            return; // tests/gpu.rs
        }
        let s = Settings {
            frag_size: 4096,
            frag_count: 2,
            max_inflight: 1,
        };
        assert!(matches!(
            StagingPool::new(&s),
            Err(rucx_ucs::Error::Unavailable { .. })
        ));
    }

    proptest! {
        /// Any interleaving of gets and drops: never more out than the count, no fragment
        /// handed out twice at once.
        #[test]
        fn random_get_put(ops in proptest::collection::vec(any::<bool>(), 1..200), count in 1usize..8) {
            let p = StagingPool::for_test(64, count);
            let mut out: Vec<Fragment> = Vec::new();
            for get in ops {
                if get {
                    match p.get() {
                        Some(f) => {
                            prop_assert!(out.iter().all(|o| o.index() != f.index()));
                            out.push(f);
                        }
                        None => prop_assert_eq!(out.len(), count),
                    }
                } else if !out.is_empty() {
                    out.remove(0);
                }
                prop_assert_eq!(p.available() + out.len(), count);
            }
        }
    }
}
