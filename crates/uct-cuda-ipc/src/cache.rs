//! The cache of opened peer allocations (`cuIpcOpenMemHandle` mappings).
//!
//! Entries are keyed by (owner pid, IPC handle bytes, local GPU): the handle names one
//! allocation of the owner, and the mapping is made in the local GPU's context. Every copy
//! holds an `Arc` of the [`Mapping`] it uses, so a mapping is closed (`cuIpcCloseMemHandle`)
//! only when it is out of the cache *and* no copy in flight uses it.
//!
//! When an entry goes (the invalidation policy):
//! - **the owner freed and reallocated**: a key arrives from the same owner for an allocation
//!   that overlaps a cached one but carries a different handle: the old mapping is stale and
//!   is dropped before the new one is opened;
//! - **the owner is gone**: an open that fails is followed by a liveness check of the owner
//!   (`/proc/<pid>`); when it has exited every entry of that pid is dropped, and the error says
//!   so. [`IpcCache::sweep_dead_owners`] does the same for all owners, for callers that want
//!   to reclaim mappings eagerly (e.g. when an endpoint reports its peer failed);
//! - **explicit invalidation**: the layer above may tell the cache that an owner released a
//!   range or disconnected ([`IpcCache::invalidate_range`], [`IpcCache::invalidate_pid`]), e.g.
//!   on an invalidation message from the peer;
//! - **capacity**: beyond `RUCX_CUDA_IPC_CACHE_SIZE` entries the least recently used goes;
//! - with `RUCX_CUDA_IPC_CACHE=n` nothing is kept: concurrent copies of one allocation share
//!   one mapping, which closes when the last of them completes.
//!
//! Note that an open mapping keeps the owner's memory from being returned to the driver even
//! after the owner frees it, which is why stale and dead-owner entries are dropped promptly.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use rucx_cuda::{PrimaryContext, cuda_error, sys};
use rucx_ucs::{Error, Result};

use crate::md::IpcKey;

/// How a mapping is released.
enum Release {
    /// `cuIpcCloseMemHandle` in this context.
    Ipc(&'static PrimaryContext),
    /// Counted instead (tests of the policy without a GPU).
    #[cfg(test)]
    Count(Arc<std::sync::atomic::AtomicUsize>),
}

/// A peer allocation mapped into this process.
pub struct Mapping {
    ptr: u64,
    size: u64,
    owner_pid: u32,
    owner_base: u64,
    release: Release,
}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("owner_pid", &self.owner_pid)
            .field("owner_base", &format_args!("{:#x}", self.owner_base))
            .finish()
    }
}

impl Mapping {
    /// Open `key`'s allocation in `ctx` (which must belong to this process's GPU that will run
    /// the copies); peer access to the owner's GPU is enabled lazily by the driver.
    pub fn open(key: &IpcKey, ctx: &'static PrimaryContext) -> Result<Mapping> {
        ctx.bind()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in handle.reserved.iter_mut().zip(key.handle.iter()) {
            *d = *s as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: the context is current, `ptr` is a valid out-pointer and the handle is passed
        // by value; a bad handle is reported as an error by the driver.
        let r = unsafe { rucx_cuda::cu!(cuIpcOpenMemHandle_v2(&mut ptr, handle, flags)) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(cuda_error(
                r,
                &format!(
                    "cuIpcOpenMemHandle(allocation {:#x}+{} of process {} on its GPU {})",
                    key.alloc_base, key.alloc_size, key.pid, key.device
                ),
                Some(ctx.ordinal()),
            ));
        }
        // What the driver mapped (not what the peer said it is) goes into the pointer cache:
        // the copy engine runs small copies as a kernel only inside ranges the cache knows as
        // device memory of the copying GPU.
        if let Ok(info) = rucx_cuda::pointer::classify_uncached(ptr as usize, 1)
            && let Ok(cache) = rucx_cuda::pointer::global_cache()
        {
            cache.insert(info);
        }
        Ok(Mapping {
            ptr,
            size: key.alloc_size,
            owner_pid: key.pid,
            owner_base: key.alloc_base,
            release: Release::Ipc(ctx),
        })
    }

    /// A mapping whose release is only counted (tests of the cache policy).
    #[cfg(test)]
    pub(crate) fn fake(
        key: &IpcKey,
        ptr: u64,
        closed: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        Mapping {
            ptr,
            size: key.alloc_size,
            owner_pid: key.pid,
            owner_base: key.alloc_base,
            release: Release::Count(closed),
        }
    }

    /// Local address of the owner's allocation base.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size of the mapped allocation.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The local address of the owner's address `remote` (which must lie inside the
    /// allocation).
    pub fn translate(&self, remote: u64) -> Option<u64> {
        let off = remote.checked_sub(self.owner_base)?;
        (off <= self.size).then(|| self.ptr + off)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        match &self.release {
            Release::Ipc(ctx) => {
                // Its addresses go back to the process: what the pointer cache knew of them
                // would describe whatever is mapped there next.
                rucx_cuda::pointer::forget(self.ptr as usize, self.size as usize);
                let _ = ctx.bind();
                // SAFETY: `ptr` came from cuIpcOpenMemHandle in `open` and is closed only here,
                // after the last copy using it has completed (copies hold an Arc).
                let r = unsafe { rucx_cuda::cu!(cuIpcCloseMemHandle(self.ptr)) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    tracing::warn!(
                        "{}",
                        cuda_error(r, "cuIpcCloseMemHandle", Some(ctx.ordinal()))
                    );
                }
            }
            #[cfg(test)]
            Release::Count(c) => {
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
}

/// Counters of an [`IpcCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served by a mapping already open.
    pub hits: u64,
    /// Handles opened.
    pub opens: u64,
    /// Entries dropped because the owner reallocated, exited, or the caller said so.
    pub invalidations: u64,
    /// Entries dropped for capacity.
    pub evictions: u64,
    /// Entries now.
    pub entries: usize,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    pid: u32,
    handle: [u8; 64],
    local_dev: u32,
}

struct Entry {
    strong: Option<Arc<Mapping>>,
    weak: Weak<Mapping>,
    base: u64,
    size: u64,
    last_use: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<Key, Entry>,
    tick: u64,
    stats: CacheStats,
}

impl State {
    fn remove_where(&mut self, f: impl Fn(&Key, &Entry) -> bool) -> usize {
        let before = self.entries.len();
        self.entries.retain(|k, e| !f(k, e));
        let n = before - self.entries.len();
        self.stats.invalidations += n as u64;
        n
    }
}

/// The cache of opened peer allocations; see the [module docs](self) for the policy.
pub struct IpcCache {
    keep: bool,
    max: usize,
    state: Mutex<State>,
}

impl fmt::Debug for IpcCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcCache")
            .field("keep", &self.keep)
            .field("max", &self.max)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Whether process `pid` of this host (and pid namespace) still exists.
pub fn pid_alive(pid: u32) -> bool {
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

impl IpcCache {
    /// A cache keeping up to `max` mappings open after use (`keep == false`: none).
    pub fn new(keep: bool, max: usize) -> IpcCache {
        IpcCache {
            keep,
            max: max.max(1),
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The mapping of `key`'s allocation in the context of local GPU `local_dev`: from the
    /// cache, else opened with `open`. Stale entries of the same owner (an overlapping
    /// allocation with another handle) are dropped first; a failed open of a dead owner drops
    /// all its entries and says the owner is gone.
    pub fn get_with(
        &self,
        key: &IpcKey,
        local_dev: u32,
        open: impl FnOnce() -> Result<Mapping>,
    ) -> Result<Arc<Mapping>> {
        let k = Key {
            pid: key.pid,
            handle: key.handle,
            local_dev,
        };
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        if let Some(e) = st.entries.get_mut(&k)
            && let Some(m) = e.weak.upgrade()
        {
            e.last_use = tick;
            st.stats.hits += 1;
            return Ok(m);
        }
        st.entries.remove(&k);
        let (lo, hi) = (
            key.alloc_base,
            key.alloc_base.saturating_add(key.alloc_size),
        );
        st.remove_where(|ek, e| {
            ek.pid == key.pid
                && ek.local_dev == local_dev
                && e.base < hi
                && lo < e.base.saturating_add(e.size)
        });
        let m = match open() {
            Ok(m) => Arc::new(m),
            Err(e) => {
                if !pid_alive(key.pid) {
                    st.remove_where(|ek, _| ek.pid == key.pid);
                    return Err(Error::EndpointFailure {
                        peer: format!("process {}", key.pid),
                        reason: format!("the owner of the GPU buffer has exited ({e})"),
                    });
                }
                return Err(e);
            }
        };
        st.stats.opens += 1;
        st.entries.insert(
            k.clone(),
            Entry {
                strong: self.keep.then(|| m.clone()),
                weak: Arc::downgrade(&m),
                base: key.alloc_base,
                size: key.alloc_size,
                last_use: tick,
            },
        );
        // Forget entries whose mappings are gone (uncached mode) and enforce the bound.
        st.entries
            .retain(|_, e| e.strong.is_some() || e.weak.strong_count() > 0);
        while st.entries.len() > self.max {
            let victim = st
                .entries
                .iter()
                .filter(|(ek, _)| **ek != k)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(ek, _)| ek.clone());
            match victim {
                Some(v) => {
                    st.entries.remove(&v);
                    st.stats.evictions += 1;
                }
                None => break,
            }
        }
        Ok(m)
    }

    /// Drop every entry of owner `pid` (it disconnected or exited). Returns how many.
    pub fn invalidate_pid(&self, pid: u32) -> usize {
        self.lock().remove_where(|k, _| k.pid == pid)
    }

    /// Drop the entries of owner `pid` overlapping its range `base..base+len` (it freed that
    /// memory). Returns how many.
    pub fn invalidate_range(&self, pid: u32, base: u64, len: u64) -> usize {
        let hi = base.saturating_add(len.max(1));
        self.lock().remove_where(|k, e| {
            k.pid == pid && e.base < hi && base < e.base.saturating_add(e.size)
        })
    }

    /// Drop the entries of every owner that has exited. Returns how many.
    pub fn sweep_dead_owners(&self) -> usize {
        self.sweep_with(pid_alive)
    }

    fn sweep_with(&self, alive: impl Fn(u32) -> bool) -> usize {
        let mut st = self.lock();
        let mut dead: Vec<u32> = st.entries.keys().map(|k| k.pid).collect();
        dead.sort_unstable();
        dead.dedup();
        dead.retain(|p| !alive(*p));
        st.remove_where(|k, _| dead.contains(&k.pid))
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        let st = self.lock();
        CacheStats {
            entries: st.entries.len(),
            ..st.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn key(pid: u32, tag: u8, base: u64, size: u64) -> IpcKey {
        IpcKey {
            handle: [tag; 64],
            alloc_base: base,
            alloc_size: size,
            addr: base,
            len: size,
            pid,
            device: 0,
            buffer_id: u64::from(tag),
            boot_id: [0; 16],
        }
    }

    struct Fake {
        closed: Arc<AtomicUsize>,
        opened: AtomicUsize,
    }

    impl Fake {
        fn new() -> Fake {
            Fake {
                closed: Arc::new(AtomicUsize::new(0)),
                opened: AtomicUsize::new(0),
            }
        }
        fn get(&self, c: &IpcCache, k: &IpcKey) -> Arc<Mapping> {
            c.get_with(k, 0, || {
                let n = self.opened.fetch_add(1, Ordering::SeqCst) as u64;
                Ok(Mapping::fake(
                    k,
                    0x1_0000_0000 * (n + 1),
                    self.closed.clone(),
                ))
            })
            .unwrap()
        }
        fn closed(&self) -> usize {
            self.closed.load(Ordering::SeqCst)
        }
    }

    #[test]
    fn hits_reuse_the_mapping() {
        let c = IpcCache::new(true, 8);
        let f = Fake::new();
        let me = std::process::id();
        let k = key(me, 1, 0x1000, 0x1000);
        let a = f.get(&c, &k);
        let b = f.get(&c, &k);
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(c.stats().opens, 1);
        assert_eq!(c.stats().hits, 1);
        assert_eq!(a.translate(0x1800), Some(a.ptr() + 0x800));
        assert_eq!(a.translate(0xfff), None);
        assert_eq!(a.translate(0x2001), None);
        // Another local GPU maps separately.
        c.get_with(&k, 1, || Ok(Mapping::fake(&k, 5, f.closed.clone())))
            .unwrap();
        assert_eq!(c.stats().entries, 2);
        drop((a, b));
        assert_eq!(f.closed(), 0, "cached mappings stay open");
    }

    #[test]
    fn reallocation_by_the_owner_replaces_the_stale_mapping() {
        let c = IpcCache::new(true, 8);
        let f = Fake::new();
        let me = std::process::id();
        let old = f.get(&c, &key(me, 1, 0x10_0000, 0x10_0000));
        // A different owner's overlapping range is not stale.
        f.get(&c, &key(me + 1, 9, 0x10_0000, 0x10_0000));
        // Same owner, overlapping range, new handle.
        let new = f.get(&c, &key(me, 2, 0x18_0000, 0x10_0000));
        assert!(!Arc::ptr_eq(&old, &new));
        let s = c.stats();
        assert_eq!((s.opens, s.invalidations, s.entries), (3, 1, 2));
        assert_eq!(f.closed(), 0, "still used by a copy");
        drop(old);
        assert_eq!(f.closed(), 1, "closed once the last user is done");
    }

    #[test]
    fn explicit_invalidation_and_dead_owners() {
        let c = IpcCache::new(true, 8);
        let f = Fake::new();
        let me = std::process::id();
        drop(f.get(&c, &key(me, 1, 0x1000, 0x1000)));
        drop(f.get(&c, &key(me, 2, 0x8000, 0x1000)));
        drop(f.get(&c, &key(77, 3, 0x1000, 0x1000)));
        assert_eq!(c.invalidate_range(me, 0x1800, 16), 1);
        assert_eq!(f.closed(), 1);
        assert_eq!(c.invalidate_range(me, 0x2000, 0x6000), 0, "touches neither");
        assert_eq!(c.sweep_with(|p| p != 77), 1);
        assert_eq!(c.invalidate_pid(me), 1);
        assert_eq!(f.closed(), 3);
        assert_eq!(c.stats().entries, 0);
        assert_eq!(c.stats().invalidations, 3);
    }

    #[test]
    fn failed_open_of_a_dead_owner_says_so() {
        let c = IpcCache::new(true, 8);
        let f = Fake::new();
        // A pid that cannot exist.
        let dead = u32::MAX - 1;
        assert!(!pid_alive(dead));
        assert!(pid_alive(std::process::id()));
        drop(f.get(&c, &key(dead, 1, 0x1000, 0x1000)));
        let e = c
            .get_with(&key(dead, 2, 0x9000, 0x10), 0, || {
                Err(Error::Device {
                    device: "GPU 0".into(),
                    reason: "cuIpcOpenMemHandle failed".into(),
                })
            })
            .unwrap_err();
        assert!(matches!(e, Error::EndpointFailure { .. }), "{e:?}");
        assert!(e.to_string().contains("exited"), "{e}");
        assert_eq!(
            c.stats().entries,
            0,
            "every entry of the dead owner dropped"
        );
        // A live owner's failure is passed through unchanged.
        let e = c
            .get_with(&key(std::process::id(), 2, 0x9000, 0x10), 0, || {
                Err(Error::Internal("x".into()))
            })
            .unwrap_err();
        assert!(matches!(e, Error::Internal(_)));
    }

    #[test]
    fn capacity_evicts_least_recently_used() {
        let c = IpcCache::new(true, 2);
        let f = Fake::new();
        let me = std::process::id();
        let k1 = key(me, 1, 0x1000, 0x100);
        let k2 = key(me, 2, 0x2000, 0x100);
        let k3 = key(me, 3, 0x3000, 0x100);
        drop(f.get(&c, &k1));
        drop(f.get(&c, &k2));
        drop(f.get(&c, &k1)); // k1 is now the most recent
        drop(f.get(&c, &k3)); // evicts k2
        let s = c.stats();
        assert_eq!((s.entries, s.evictions, s.hits), (2, 1, 1));
        assert_eq!(f.closed(), 1);
        drop(f.get(&c, &k1));
        assert_eq!(c.stats().hits, 2, "k1 survived");
    }

    #[test]
    fn uncached_mode_shares_while_in_use_then_closes() {
        let c = IpcCache::new(false, 8);
        let f = Fake::new();
        let k = key(std::process::id(), 1, 0x1000, 0x100);
        let a = f.get(&c, &k);
        let b = f.get(&c, &k);
        assert!(Arc::ptr_eq(&a, &b), "concurrent copies share one mapping");
        drop((a, b));
        assert_eq!(f.closed(), 1);
        drop(f.get(&c, &k));
        assert_eq!(c.stats().opens, 2);
        assert_eq!(f.closed(), 2);
        assert!(format!("{c:?}").contains("keep: false"));
    }
}
