//! Which posted buffers are host memory, remembered per address range (UCX's memory-type
//! cache, `UCX_MEMTYPE_CACHE`, in this library's terms).
//!
//! Open MPI hands every buffer to `ucp_tag_send_*`/`ucp_tag_recv_*` as a bare pointer, so rucx
//! classifies each one through its memory domains. With a CUDA domain open that is a
//! `cuPointerGetAttributes` call per message, which on a GPU host often enters the driver's
//! kernel module (microseconds: most of an 8-byte round trip). A range the domains classified as
//! host memory stays host memory until it is unmapped, so this library remembers host ranges and
//! hands later posts inside one its type directly. GPU answers are not kept here (rucx's CUDA
//! pointer cache keeps device allocations). Each worker also remembers the last host range its
//! posts hit ([`LastHost`]), checked before the shared table and its lock; any forgetting
//! makes every such range stale (an epoch).
//!
//! What forgets a range: `ucm_vm_munmap` (Open MPI reports unmapped memory through it when its
//! own memory hooks are on, `--mca opal_common_ucx_opal_mem_hooks 1`), and a GPU answer for an
//! overlapping range. A host range that is unmapped without a report and then mapped again as
//! GPU memory at the same address would be taken for host memory, as UCX's cache takes memory its
//! hooks did not see; `RUCX_ABI_MEMTYPE_CACHE=n` classifies every buffer instead.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use rucx_ucp::Context;
use rucx_ucs::{MemInfo, MemoryType, MemtypeCache};

/// Cached ranges at most; past that the cache starts over (a program cycling through many
/// buffers pays a query per new range, never an unbounded table).
const MAX_RANGES: usize = 4096;

/// The process's host ranges (process-wide: `ucm_vm_munmap` names no context).
fn host_ranges() -> &'static MemtypeCache {
    static HOST: OnceLock<MemtypeCache> = OnceLock::new();
    HOST.get_or_init(MemtypeCache::new)
}

/// Bumped whenever host ranges are forgotten: a [`LastHost`] read before is stale.
static EPOCH: AtomicU64 = AtomicU64::new(1);

/// The last host range a worker's posts hit (start, end, and the [`EPOCH`] it was read at;
/// epoch 0: none). A worker is used by one thread at a time (UCX's single thread mode).
#[derive(Debug, Default)]
pub struct LastHost(Cell<(usize, usize, u64)>);

impl LastHost {
    fn hit(&self, addr: usize, len: usize) -> bool {
        let (start, end, epoch) = self.0.get();
        addr >= start
            && addr.checked_add(len).is_some_and(|e| e <= end)
            && epoch == EPOCH.load(Ordering::Acquire)
    }
}

/// The memory type of `len` bytes at `addr` for a post on `ctx` (whose memory type cache is
/// on) by the worker whose last hit is `last`: `Some` when known (from the cache, or from
/// classifying it now), `None` when classification failed (the post then classifies again and
/// reports the error) or for an empty buffer.
pub fn classify(ctx: &Context, last: &LastHost, addr: usize, len: usize) -> Option<MemInfo> {
    if len == 0 {
        return None;
    }
    if last.hit(addr, len) {
        return Some(MemInfo::HOST);
    }
    // Read before the table: a range forgotten after this read leaves the entry stale.
    let epoch = EPOCH.load(Ordering::Acquire);
    let ranges = host_ranges();
    if let Some((r, MemInfo::HOST)) = ranges.lookup_range(addr)
        && addr.checked_add(len).is_some_and(|e| e <= r.end)
    {
        last.0.set((r.start, r.end, epoch));
        return Some(MemInfo::HOST);
    }
    let (mem_type, device) = ctx.detect(addr, len).ok()?;
    if mem_type == MemoryType::Host {
        if ranges.len() >= MAX_RANGES {
            forget_all();
        }
        // A range that wraps is refused by the cache; nothing to remember then.
        if ranges.insert(addr, len, MemInfo::HOST).is_ok() {
            last.0.set((addr, addr + len, epoch));
        }
    } else {
        forget(addr, len);
    }
    Some(MemInfo::new(mem_type, device))
}

/// Forget `len` bytes at `addr` (unmapped).
pub fn forget(addr: usize, len: usize) {
    host_ranges().invalidate(addr, len);
    EPOCH.fetch_add(1, Ordering::AcqRel);
}

fn forget_all() {
    host_ranges().clear();
    EPOCH.fetch_add(1, Ordering::AcqRel);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(addr: usize, len: usize) -> bool {
        host_ranges().lookup(addr, len) == Some(MemInfo::HOST)
    }

    #[test]
    fn host_ranges_are_remembered_until_unmapped() {
        let mut cfg = rucx_ucs::Config::new(&crate::config_tables()).unwrap();
        cfg.set("TLS", "self").unwrap();
        let ctx = rucx::context(cfg).unwrap();
        let buf = vec![0u8; 4096];
        let addr = buf.as_ptr() as usize;
        let last = LastHost::default();
        assert!(!cached(addr, 4096));
        assert!(!last.hit(addr, 8));
        assert_eq!(classify(&ctx, &last, addr, 4096), Some(MemInfo::HOST));
        assert!(cached(addr, 4096));
        assert!(cached(addr + 100, 8), "a post inside the range hits");
        assert!(!cached(addr + 4000, 200), "one reaching past it does not");
        assert!(last.hit(addr + 100, 8), "the worker's last range too");
        assert!(!last.hit(addr + 4000, 200));
        assert_eq!(
            classify(&ctx, &last, addr, 0),
            None,
            "empty buffers are not classified"
        );
        // An unmap report of part of the range forgets that part only, and the worker's last
        // range altogether.
        crate::ucm::ucm_vm_munmap((addr + 2048) as *mut std::ffi::c_void, 2048);
        assert!(cached(addr, 2048));
        assert!(!cached(addr + 2048, 8));
        assert!(!last.hit(addr, 8), "stale after any forgetting");
        assert_eq!(classify(&ctx, &last, addr, 8), Some(MemInfo::HOST));
        assert!(last.hit(addr, 8), "found again in the shared table");
        assert!(!last.hit(addr + 2048, 8), "not the forgotten part");
        forget(addr, 4096);
        assert!(!cached(addr, 8));
        assert!(!last.hit(addr, 8));
    }
}
