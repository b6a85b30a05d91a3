//! Pointer classification: is a buffer pageable host memory, pinned host memory, CUDA device
//! memory or CUDA managed memory; which device owns it; the allocation it belongs to; whether it
//! can be exported to other processes (legacy IPC handle) or to a NIC (dma-buf).
//!
//! Answers for device and managed memory are cached by allocation range ([`PointerCache`]), so
//! a buffer inside a known allocation is classified without a driver call. rucx's own
//! allocation wrappers invalidate the cache when they free; memory freed behind rucx's back can
//! be reported stale, which `RUCX_CUDA_POINTER_CACHE=n` avoids.
//!
//! Without a CUDA driver every pointer is pageable host memory, at no cost.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::fmt;
use std::sync::{OnceLock, RwLock};

use cudarc::driver::sys;
use cudarc::driver::sys::{CUpointer_attribute as PA, cudaError_enum as E};
use rucx_ucs::{Config, Error, MemoryType, Result};

use crate::driver::{check, driver};

/// What kind of memory a buffer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PtrKind {
    /// Ordinary host memory the CUDA driver does not know.
    HostPageable,
    /// Page-locked host memory (`cuMemHostAlloc` or `cuMemHostRegister`).
    HostPinned,
    /// CUDA device memory (`cuMemAlloc`, stream-ordered pools, VMM mappings).
    Cuda,
    /// CUDA managed (unified) memory.
    CudaManaged,
}

impl PtrKind {
    /// Short lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            PtrKind::HostPageable => "host-pageable",
            PtrKind::HostPinned => "host-pinned",
            PtrKind::Cuda => "cuda",
            PtrKind::CudaManaged => "cuda-managed",
        }
    }

    /// The rucx memory type of this kind (pinned and pageable host memory are both `host`).
    pub fn memory_type(self) -> MemoryType {
        match self {
            PtrKind::HostPageable | PtrKind::HostPinned => MemoryType::Host,
            PtrKind::Cuda => MemoryType::Cuda,
            PtrKind::CudaManaged => MemoryType::CudaManaged,
        }
    }
}

impl fmt::Display for PtrKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything rucx needs to know about a buffer's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    /// Memory kind.
    pub kind: PtrKind,
    /// Owning device ordinal (device and managed memory only).
    pub device: Option<u32>,
    /// Start of the allocation the buffer belongs to (the buffer itself for pageable memory).
    pub base: usize,
    /// Size of that allocation.
    pub size: usize,
    /// Allocated from a stream-ordered memory pool (`cuMemAllocAsync` and friends).
    pub from_pool: bool,
    /// Can be exported through a legacy IPC handle (`cuIpcGetMemHandle`); never for pool or
    /// managed memory.
    pub ipc_exportable: bool,
    /// Can be exported as a dma-buf file descriptor (`cuMemGetHandleForAddressRange`): device
    /// memory on a GPU reporting `DMA_BUF_SUPPORTED`, with a driver that has the entry point.
    pub dmabuf_exportable: bool,
    /// The driver says a NIC may access it through GPU-direct RDMA
    /// (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`).
    pub gpu_direct_rdma_capable: bool,
    /// The driver's unique id of the allocation (0 when none).
    pub buffer_id: u64,
}

impl PointerInfo {
    /// Pageable host memory covering exactly `addr..addr+len`.
    pub fn host_pageable(addr: usize, len: usize) -> PointerInfo {
        PointerInfo {
            kind: PtrKind::HostPageable,
            device: None,
            base: addr,
            size: len,
            from_pool: false,
            ipc_exportable: false,
            dmabuf_exportable: false,
            gpu_direct_rdma_capable: false,
            buffer_id: 0,
        }
    }

    /// The rucx memory type.
    pub fn memory_type(&self) -> MemoryType {
        self.kind.memory_type()
    }

    /// One past the last byte of the allocation.
    pub fn end(&self) -> usize {
        self.base.saturating_add(self.size)
    }

    /// Whether `addr..addr+len` lies inside the allocation.
    pub fn covers(&self, addr: usize, len: usize) -> bool {
        addr >= self.base && addr.checked_add(len).is_some_and(|e| e <= self.end())
    }
}

impl fmt::Display for PointerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(d) = self.device {
            write!(f, " on GPU {d}")?;
        }
        write!(f, ", allocation {:#x}+{}", self.base, self.size)?;
        if self.from_pool {
            f.write_str(", stream-ordered pool")?;
        }
        write!(
            f,
            ", ipc {}, dma-buf {}",
            if self.ipc_exportable { "yes" } else { "no" },
            if self.dmabuf_exportable { "yes" } else { "no" }
        )
    }
}

/// Attribute values as the driver returned them (defaults where it returned nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawAttrs {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (0: not CUDA memory; 1 host, 2 device, 4 unified).
    pub memory_type: u32,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    pub is_managed: bool,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (negative when unknown).
    pub device_ordinal: i32,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`.
    pub range_start: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`.
    pub range_size: u64,
    /// `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE` is not null.
    pub has_mempool: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`.
    pub legacy_ipc_capable: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`.
    pub gpu_direct_rdma_capable: bool,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`.
    pub buffer_id: u64,
}

const MEMTYPE_HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
const MEMTYPE_DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
const MEMTYPE_UNIFIED: u32 = sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;

/// Turn raw attributes into a classification of `addr..addr+len` (pure; no driver call).
///
/// `dmabuf_device` says whether a device ordinal can export dma-bufs. Fails when the buffer
/// runs past the end of its device allocation, or the driver reported a memory type rucx does
/// not handle (CUDA arrays).
pub fn interpret(
    raw: &RawAttrs,
    addr: usize,
    len: usize,
    dmabuf_device: impl Fn(u32) -> bool,
) -> Result<PointerInfo> {
    let kind = if raw.is_managed {
        PtrKind::CudaManaged
    } else {
        match raw.memory_type {
            0 => return Ok(PointerInfo::host_pageable(addr, len)),
            MEMTYPE_HOST => PtrKind::HostPinned,
            MEMTYPE_DEVICE => PtrKind::Cuda,
            MEMTYPE_UNIFIED => PtrKind::CudaManaged,
            other => {
                return Err(Error::Unsupported {
                    what: format!("buffer {addr:#x}+{len}"),
                    why: format!("the CUDA driver reports memory type {other} (a CUDA array?)"),
                });
            }
        }
    };
    let device = match kind {
        PtrKind::Cuda | PtrKind::CudaManaged => u32::try_from(raw.device_ordinal).ok(),
        _ => None,
    };
    let (base, size) = if raw.range_size > 0 {
        (raw.range_start as usize, raw.range_size as usize)
    } else {
        (addr, len)
    };
    let info = PointerInfo {
        kind,
        device,
        base,
        size,
        from_pool: raw.has_mempool,
        ipc_exportable: kind == PtrKind::Cuda && raw.legacy_ipc_capable && !raw.has_mempool,
        dmabuf_exportable: kind == PtrKind::Cuda && device.is_some_and(&dmabuf_device),
        gpu_direct_rdma_capable: raw.gpu_direct_rdma_capable,
        buffer_id: raw.buffer_id,
    };
    if matches!(kind, PtrKind::Cuda | PtrKind::CudaManaged) && !info.covers(addr, len.max(1)) {
        return Err(Error::InvalidParam(format!(
            "buffer {addr:#x}+{len} runs past the end of its {} allocation {:#x}+{}{}",
            kind,
            info.base,
            info.size,
            device.map(|d| format!(" on GPU {d}")).unwrap_or_default()
        )));
    }
    Ok(info)
}

/// Ask the driver for one pointer attribute into `out`; `Err` carries the CUDA result.
///
/// # Safety
/// `out` must point to writable storage at least as large as the attribute's value type, and
/// zero-initialized (the driver writes booleans as one byte into wider slots).
unsafe fn get_attrs(
    attrs: &mut [PA],
    data: &mut [*mut c_void],
    ptr: u64,
) -> std::result::Result<(), sys::CUresult> {
    debug_assert_eq!(attrs.len(), data.len());
    // SAFETY: the caller guarantees every data slot fits its attribute; counts match.
    let r = unsafe {
        crate::cu!(cuPointerGetAttributes(
            attrs.len() as u32,
            attrs.as_mut_ptr(),
            data.as_mut_ptr(),
            ptr,
        ))
    };
    if r == E::CUDA_SUCCESS { Ok(()) } else { Err(r) }
}

/// Query the driver about `addr` (needs a loaded driver). Two calls for CUDA memory, one for
/// pageable memory; attributes an old driver rejects are left at their defaults.
pub fn query(addr: usize) -> Result<RawAttrs> {
    let drv = driver()?;
    let ptr = addr as u64;
    let mut raw = RawAttrs {
        device_ordinal: -1,
        ..RawAttrs::default()
    };
    let mut mem_type: u32 = 0;
    let mut managed: u32 = 0;
    let mut first = [
        PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        PA::CU_POINTER_ATTRIBUTE_IS_MANAGED,
    ];
    let mut first_data = [
        &mut mem_type as *mut u32 as *mut c_void,
        &mut managed as *mut u32 as *mut c_void,
    ];
    // SAFETY: MEMORY_TYPE is a 32-bit enum and IS_MANAGED a bool; both slots are zeroed u32.
    let mut res = unsafe { get_attrs(&mut first, &mut first_data, ptr) };
    if res == Err(E::CUDA_ERROR_INVALID_CONTEXT) {
        // Some drivers want a current context even for this query.
        drv.any_context()?.bind()?;
        // SAFETY: as above.
        res = unsafe { get_attrs(&mut first, &mut first_data, ptr) };
    }
    if let Err(r) = res {
        check(r, &format!("cuPointerGetAttributes({addr:#x})"), None)?;
    }
    raw.memory_type = mem_type;
    raw.is_managed = managed != 0;
    if mem_type == 0 && !raw.is_managed {
        return Ok(raw);
    }

    let mut ordinal: i32 = -1;
    let mut start: u64 = 0;
    let mut size: usize = 0;
    let mut pool: *mut c_void = std::ptr::null_mut();
    let mut ipc: u32 = 0;
    let mut gdr: u32 = 0;
    let mut buffer_id: u64 = 0;
    let mut attrs = [
        PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        PA::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
        PA::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        PA::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
        PA::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    ];
    let mut data = [
        &mut ordinal as *mut i32 as *mut c_void,
        &mut start as *mut u64 as *mut c_void,
        &mut size as *mut usize as *mut c_void,
        &mut pool as *mut *mut c_void as *mut c_void,
        &mut ipc as *mut u32 as *mut c_void,
        &mut gdr as *mut u32 as *mut c_void,
        &mut buffer_id as *mut u64 as *mut c_void,
    ];
    // SAFETY: each slot matches its attribute's type (int, CUdeviceptr, size_t, pool handle,
    // bool in a zeroed u32, bool in a zeroed u32, unsigned long long).
    if unsafe { get_attrs(&mut attrs, &mut data, ptr) }.is_err() {
        // An old driver may reject one attribute and fail the whole call: ask one at a time.
        for i in 0..attrs.len() {
            // SAFETY: the same slot for the same attribute, one pair at a time.
            let _ = unsafe { get_attrs(&mut attrs[i..=i], &mut data[i..=i], ptr) };
        }
    }
    raw.device_ordinal = ordinal;
    raw.range_start = start;
    raw.range_size = size as u64;
    raw.has_mempool = !pool.is_null();
    raw.legacy_ipc_capable = ipc != 0;
    raw.gpu_direct_rdma_capable = gdr != 0;
    raw.buffer_id = buffer_id;
    Ok(raw)
}

/// The driver's id of the allocation holding `addr` (`CU_POINTER_ATTRIBUTE_BUFFER_ID`, unique
/// within the process for its whole life: an allocation freed and another made at the same
/// address get different ids), or `None` where the driver knows no allocation there or there is
/// no driver. One driver call asking one attribute, uncached: the answer is about the memory
/// there now, which is what a registration cache needs to tell whether an entry is stale.
pub fn buffer_id(addr: usize) -> Result<Option<u64>> {
    let Ok(drv) = driver() else {
        return Ok(None);
    };
    let mut id: u64 = 0;
    let mut attrs = [PA::CU_POINTER_ATTRIBUTE_BUFFER_ID];
    let mut data = [&mut id as *mut u64 as *mut c_void];
    // SAFETY: BUFFER_ID is an unsigned long long; its slot is a zeroed u64.
    let mut res = unsafe { get_attrs(&mut attrs, &mut data, addr as u64) };
    if res == Err(E::CUDA_ERROR_INVALID_CONTEXT) {
        drv.any_context()?.bind()?;
        // SAFETY: as above.
        res = unsafe { get_attrs(&mut attrs, &mut data, addr as u64) };
    }
    if let Err(r) = res {
        check(
            r,
            &format!("cuPointerGetAttributes(buffer id of {addr:#x})"),
            None,
        )?;
    }
    Ok((id != 0).then_some(id))
}

/// Classify `addr..addr+len` with the driver, without a cache. Pageable host memory when no
/// driver is loaded.
pub fn classify_uncached(addr: usize, len: usize) -> Result<PointerInfo> {
    let Ok(drv) = driver() else {
        return Ok(PointerInfo::host_pageable(addr, len));
    };
    let raw = query(addr)?;
    interpret(&raw, addr, len, |d| {
        drv.has_dmabuf_export() && drv.devices().get(d as usize).is_some_and(|i| i.dma_buf)
    })
}

/// A cache of classifications of device and managed allocations, keyed by allocation range.
///
/// Host memory (pageable or pinned) is not cached: it can be registered, unregistered and
/// remapped at any time without the driver telling us.
#[derive(Debug)]
pub struct PointerCache {
    enabled: bool,
    max_entries: usize,
    map: RwLock<BTreeMap<usize, PointerInfo>>,
}

impl PointerCache {
    /// Default bound on cached allocations; beyond it the cache starts over.
    pub const DEFAULT_MAX_ENTRIES: usize = 65536;

    /// A cache; `enabled == false` makes every lookup ask the driver.
    pub fn new(enabled: bool) -> PointerCache {
        PointerCache {
            enabled,
            max_entries: Self::DEFAULT_MAX_ENTRIES,
            map: RwLock::new(BTreeMap::new()),
        }
    }

    /// A cache configured by `RUCX_CUDA_POINTER_CACHE` in `cfg` (a config built with
    /// [`CONFIG`](crate::CONFIG)).
    pub fn from_config(cfg: &Config) -> PointerCache {
        PointerCache::new(cfg.bool("CUDA_POINTER_CACHE"))
    }

    /// Whether caching is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Classify `addr..addr+len`, from the cache when an entry covers it.
    pub fn classify(&self, addr: usize, len: usize) -> Result<PointerInfo> {
        if let Some(hit) = self.lookup(addr, len) {
            return Ok(hit);
        }
        let info = classify_uncached(addr, len)?;
        self.insert(info);
        Ok(info)
    }

    /// The cached entry covering `addr..addr+len`, if any.
    pub fn lookup(&self, addr: usize, len: usize) -> Option<PointerInfo> {
        if !self.enabled {
            return None;
        }
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        let (_, info) = map.range(..=addr).next_back()?;
        info.covers(addr, len.max(1)).then_some(*info)
    }

    /// Remember a classification. Only device and managed allocations are kept; an entry that
    /// overlaps existing ones replaces them (the old allocations must be gone).
    pub fn insert(&self, info: PointerInfo) {
        if !self.enabled
            || !matches!(info.kind, PtrKind::Cuda | PtrKind::CudaManaged)
            || info.size == 0
        {
            return;
        }
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        remove_overlapping(&mut map, info.base, info.size);
        if map.len() >= self.max_entries {
            map.clear();
        }
        map.insert(info.base, info);
    }

    /// Forget every entry overlapping `addr..addr+len` (call when that memory is freed).
    pub fn invalidate(&self, addr: usize, len: usize) {
        if !self.enabled {
            return;
        }
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        remove_overlapping(&mut map, addr, len.max(1));
    }

    /// Number of cached allocations.
    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget everything.
    pub fn clear(&self) {
        self.map.write().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

fn remove_overlapping(map: &mut BTreeMap<usize, PointerInfo>, addr: usize, len: usize) {
    let end = addr.saturating_add(len);
    let doomed: Vec<usize> = map
        .range(..end)
        .rev()
        // Entries never overlap, so their ends grow with their bases.
        .take_while(|(_, i)| i.end() > addr)
        .map(|(b, _)| *b)
        .collect();
    for b in doomed {
        map.remove(&b);
    }
}

static GLOBAL: OnceLock<PointerCache> = OnceLock::new();

/// The process-wide cache, configured from `RUCX_CUDA_POINTER_CACHE` on first use. An invalid
/// value is an [`Error::Config`] naming the variable.
pub fn global_cache() -> Result<&'static PointerCache> {
    if let Some(c) = GLOBAL.get() {
        return Ok(c);
    }
    let mut cfg = Config::new(&[crate::CONFIG])?;
    let var = format!("{}CUDA_POINTER_CACHE", rucx_ucs::config::ENV_PREFIX);
    if let Ok(v) = std::env::var(&var) {
        cfg.set("CUDA_POINTER_CACHE", &v)?;
    }
    Ok(GLOBAL.get_or_init(|| PointerCache::from_config(&cfg)))
}

/// The process-wide cache's entry covering `addr..addr+len`, without asking the driver (`None`
/// when nothing cached covers it, or the cache is off or not made yet).
pub fn lookup(addr: usize, len: usize) -> Option<PointerInfo> {
    GLOBAL.get()?.lookup(addr, len)
}

/// Classify `addr..addr+len` through the process-wide cache.
pub fn classify(addr: usize, len: usize) -> Result<PointerInfo> {
    global_cache()?.classify(addr, len)
}

/// [`classify`], asked again of the driver when a cached answer does not satisfy `want`: a
/// cached allocation can be gone with its addresses reused (memory freed or unmapped where this
/// crate did not see it, such as another library's allocation), and a caller that expected
/// something else gets the driver's present view, the stale entry dropped.
pub fn classify_expecting(
    addr: usize,
    len: usize,
    want: impl Fn(&PointerInfo) -> bool,
) -> Result<PointerInfo> {
    let cache = global_cache()?;
    let info = cache.classify(addr, len)?;
    if want(&info) || cache.lookup(addr, len).is_none() {
        return Ok(info);
    }
    cache.invalidate(info.base, info.size);
    cache.classify(addr, len)
}

/// Forget what the process-wide cache knows of `addr..addr+len`: call it when memory this
/// crate did not allocate is unmapped (an IPC mapping closed), before its addresses can be
/// reused.
pub fn forget(addr: usize, len: usize) {
    invalidate_global(addr, len);
}

/// Drop global-cache entries for freed memory (called by this crate's allocation wrappers).
pub(crate) fn invalidate_global(addr: usize, len: usize) {
    if let Some(c) = GLOBAL.get() {
        c.invalidate(addr, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dev_raw(start: u64, size: u64, ordinal: i32) -> RawAttrs {
        RawAttrs {
            memory_type: MEMTYPE_DEVICE,
            device_ordinal: ordinal,
            range_start: start,
            range_size: size,
            legacy_ipc_capable: true,
            buffer_id: 7,
            ..RawAttrs::default()
        }
    }

    #[test]
    fn pageable_when_driver_knows_nothing() {
        let i = interpret(&RawAttrs::default(), 0x1000, 64, |_| true).unwrap();
        assert_eq!(i, PointerInfo::host_pageable(0x1000, 64));
        assert_eq!(i.memory_type(), MemoryType::Host);
        assert!(!i.ipc_exportable && !i.dmabuf_exportable);
    }

    #[test]
    fn pinned_host() {
        let raw = RawAttrs {
            memory_type: MEMTYPE_HOST,
            device_ordinal: 0,
            range_start: 0x10_0000,
            range_size: 0x1000,
            ..RawAttrs::default()
        };
        let i = interpret(&raw, 0x10_0010, 16, |_| true).unwrap();
        assert_eq!(i.kind, PtrKind::HostPinned);
        assert_eq!(i.device, None);
        assert_eq!((i.base, i.size), (0x10_0000, 0x1000));
        assert_eq!(i.memory_type(), MemoryType::Host);
        assert!(!i.ipc_exportable && !i.dmabuf_exportable);
        // No range reported: the buffer itself.
        let raw = RawAttrs {
            memory_type: MEMTYPE_HOST,
            ..RawAttrs::default()
        };
        let i = interpret(&raw, 0x5000, 10, |_| true).unwrap();
        assert_eq!((i.base, i.size), (0x5000, 10));
    }

    #[test]
    fn device_memory() {
        let i = interpret(
            &dev_raw(0x7f00_0000_0000, 1 << 20, 1),
            0x7f00_0000_1000,
            4096,
            |d| d == 1,
        )
        .unwrap();
        assert_eq!(i.kind, PtrKind::Cuda);
        assert_eq!(i.device, Some(1));
        assert_eq!(i.memory_type(), MemoryType::Cuda);
        assert!(i.ipc_exportable && i.dmabuf_exportable && !i.from_pool);
        assert_eq!(i.buffer_id, 7);
        let s = i.to_string();
        assert!(s.contains("cuda on GPU 1") && s.contains("ipc yes"), "{s}");
        // dma-buf depends on the device.
        let i = interpret(&dev_raw(0x1000, 4096, 0), 0x1000, 1, |d| d == 1).unwrap();
        assert!(!i.dmabuf_exportable);
    }

    #[test]
    fn pool_memory_is_not_ipc_exportable() {
        let mut raw = dev_raw(0x2000, 8192, 0);
        raw.has_mempool = true;
        let i = interpret(&raw, 0x2000, 8192, |_| true).unwrap();
        assert!(i.from_pool && !i.ipc_exportable);
        assert!(i.to_string().contains("stream-ordered pool"));
        // Even if an old driver left the IPC attribute set.
        raw.legacy_ipc_capable = true;
        assert!(!interpret(&raw, 0x2000, 1, |_| true).unwrap().ipc_exportable);
        // And a driver that says "not legacy-IPC capable" is believed.
        let mut vmm = dev_raw(0x2000, 8192, 0);
        vmm.legacy_ipc_capable = false;
        assert!(!interpret(&vmm, 0x2000, 1, |_| true).unwrap().ipc_exportable);
    }

    #[test]
    fn managed_memory() {
        let raw = RawAttrs {
            memory_type: MEMTYPE_DEVICE,
            is_managed: true,
            device_ordinal: 0,
            range_start: 0x9000,
            range_size: 0x1000,
            legacy_ipc_capable: true,
            ..RawAttrs::default()
        };
        let i = interpret(&raw, 0x9000, 0x1000, |_| true).unwrap();
        assert_eq!(i.kind, PtrKind::CudaManaged);
        assert_eq!(i.memory_type(), MemoryType::CudaManaged);
        assert!(!i.ipc_exportable && !i.dmabuf_exportable);
        let unified = RawAttrs {
            memory_type: MEMTYPE_UNIFIED,
            ..raw
        };
        assert_eq!(
            interpret(
                &RawAttrs {
                    is_managed: false,
                    ..unified
                },
                0x9000,
                1,
                |_| true
            )
            .unwrap()
            .kind,
            PtrKind::CudaManaged
        );
    }

    #[test]
    fn buffer_past_allocation_end_is_an_error() {
        let e = interpret(&dev_raw(0x1000, 0x1000, 2), 0x1800, 0x1000, |_| true).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Error::InvalidParam(_)));
        assert!(
            s.contains("0x1800+4096") && s.contains("0x1000+4096") && s.contains("GPU 2"),
            "{s}"
        );
        // Zero-length buffers at the base are fine.
        assert!(interpret(&dev_raw(0x1000, 0x1000, 2), 0x1000, 0, |_| true).is_ok());
    }

    #[test]
    fn arrays_are_unsupported() {
        let raw = RawAttrs {
            memory_type: sys::CUmemorytype::CU_MEMORYTYPE_ARRAY as u32,
            ..RawAttrs::default()
        };
        assert!(matches!(
            interpret(&raw, 1, 1, |_| true),
            Err(Error::Unsupported { .. })
        ));
    }

    fn dev_info(base: usize, size: usize) -> PointerInfo {
        interpret(&dev_raw(base as u64, size as u64, 0), base, size, |_| false).unwrap()
    }

    #[test]
    fn cache_hits_misses_and_invalidation() {
        let c = PointerCache::new(true);
        c.insert(dev_info(0x10000, 0x1000));
        c.insert(dev_info(0x20000, 0x1000));
        assert_eq!(c.len(), 2);
        assert_eq!(c.lookup(0x10000, 0x1000).unwrap().base, 0x10000);
        assert_eq!(c.lookup(0x10800, 0x800).unwrap().base, 0x10000);
        assert!(c.lookup(0x10800, 0x801).is_none(), "runs past the end");
        assert!(c.lookup(0x11000, 1).is_none(), "one past the end");
        assert!(c.lookup(0xffff, 1).is_none(), "before the start");
        // Host memory is never cached.
        c.insert(PointerInfo::host_pageable(0x30000, 16));
        assert_eq!(c.len(), 2);
        // Freeing part of a range drops the entry.
        c.invalidate(0x10fff, 1);
        assert!(c.lookup(0x10000, 1).is_none());
        assert_eq!(c.len(), 1);
        // A new allocation overlapping an old one replaces it.
        c.insert(dev_info(0x1f800, 0x1000));
        assert_eq!(c.len(), 1);
        assert_eq!(c.lookup(0x1f800, 1).unwrap().size, 0x1000);
        c.clear();
        assert!(c.is_empty());
    }

    #[test]
    fn disabled_cache_never_hits() {
        let c = PointerCache::new(false);
        c.insert(dev_info(0x10000, 0x1000));
        assert!(c.lookup(0x10000, 1).is_none());
        assert!(c.is_empty());
        assert!(!c.enabled());
    }

    /// A cached device allocation whose addresses now hold host memory (freed or unmapped
    /// where the crate did not see it) is asked of the driver again when it surprises a
    /// caller, and dropped; `forget` drops one too.
    #[test]
    fn a_stale_cached_allocation_is_asked_again_when_it_surprises() {
        let v = vec![0u8; 1 << 16];
        let addr = v.as_ptr() as usize;
        let c = global_cache().unwrap();
        c.insert(dev_info(addr & !0xfff, 1 << 20));
        assert_eq!(
            classify(addr, 64).unwrap().kind,
            PtrKind::Cuda,
            "the stale entry"
        );
        let got = classify_expecting(addr, 64, |i| i.kind == PtrKind::HostPageable).unwrap();
        assert_eq!(got.kind, PtrKind::HostPageable);
        assert!(c.lookup(addr, 64).is_none(), "the stale entry is gone");
        // An answer that satisfies the caller is kept as it is.
        c.insert(dev_info(addr & !0xfff, 1 << 20));
        let kept = classify_expecting(addr, 64, |i| i.kind == PtrKind::Cuda).unwrap();
        assert_eq!(kept.kind, PtrKind::Cuda);
        forget(addr, 1);
        assert!(c.lookup(addr, 64).is_none());
    }

    #[test]
    fn cache_from_config() {
        let mut cfg = Config::new(&[crate::CONFIG]).unwrap();
        assert!(PointerCache::from_config(&cfg).enabled());
        cfg.set("CUDA_POINTER_CACHE", "n").unwrap();
        assert!(!PointerCache::from_config(&cfg).enabled());
        let e = cfg
            .set("RUCX_CUDA_POINTER_CACHE", "maybe")
            .unwrap_err()
            .to_string();
        assert!(e.contains("RUCX_CUDA_POINTER_CACHE"), "{e}");
    }

    #[test]
    fn without_a_driver_everything_is_pageable_host() {
        if driver().is_ok() {
            return; // a GPU host: covered by tests/gpu.rs
        }
        let v = [1u8; 32];
        let i = classify(v.as_ptr() as usize, v.len()).unwrap();
        assert_eq!(i, PointerInfo::host_pageable(v.as_ptr() as usize, 32));
        let i = classify_uncached(0xdead_0000, 1 << 30).unwrap();
        assert_eq!(i.kind, PtrKind::HostPageable);
        assert!(matches!(query(0x1000), Err(Error::Unavailable { .. })));
    }

    proptest! {
        /// Whatever the entries, a hit always covers the asked range, and a range inside an
        /// inserted, non-invalidated allocation always hits.
        #[test]
        fn cache_lookup_is_sound(
            allocs in proptest::collection::vec((0usize..64, 1usize..8), 1..16),
            probes in proptest::collection::vec((0usize..0x50000, 0usize..0x3000), 1..64),
            kill in proptest::collection::vec(0usize..0x50000, 0..4),
        ) {
            let c = PointerCache::new(true);
            let mut live: Vec<PointerInfo> = Vec::new();
            for (slot, pages) in allocs {
                let info = dev_info(slot * 0x1000, pages * 0x1000);
                live.retain(|l| l.end() <= info.base || l.base >= info.end());
                live.push(info);
                c.insert(info);
            }
            for k in kill {
                c.invalidate(k, 1);
                live.retain(|l| !(l.base <= k && k < l.end()));
            }
            prop_assert_eq!(c.len(), live.len());
            for (a, l) in probes {
                let hit = c.lookup(a, l);
                if let Some(h) = hit {
                    prop_assert!(h.covers(a, l.max(1)));
                    prop_assert!(live.contains(&h));
                }
                let expect = live.iter().any(|i| i.covers(a, l.max(1)));
                prop_assert_eq!(hit.is_some(), expect);
            }
        }
    }
}
