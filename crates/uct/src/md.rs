//! Memory domains, memory handles and remote keys.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rucx_ucs::{Error, MemoryType, RegError, RegErrorKind, Result};

use crate::attr::MdAttr;
use crate::iface::{Iface, IfaceParams};

/// A buffer in this process's address space. Device memory is described by address too; it is
/// never dereferenced by the CPU unless the owning domain says it can (`ACCESS` on host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemRegion {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Memory type, as classified by the caller.
    pub mem_type: MemoryType,
    /// Owning GPU ordinal for GPU memory.
    pub device: Option<u32>,
}

impl MemRegion {
    /// A host buffer.
    pub fn host(addr: usize, len: usize) -> Self {
        MemRegion {
            addr,
            len,
            mem_type: MemoryType::Host,
            device: None,
        }
    }

    /// A host region covering a slice.
    pub fn of_slice(s: &[u8]) -> Self {
        Self::host(s.as_ptr() as usize, s.len())
    }

    /// One past the last byte.
    pub fn end(&self) -> usize {
        self.addr + self.len
    }

    /// The typed error a domain returns when it cannot register this region: every domain
    /// builds it here, so the message names buffer, memory type, device and knob the same way.
    pub fn reg_error(
        &self,
        domain: &str,
        kind: RegErrorKind,
        detail: impl Into<String>,
        hint: impl Into<String>,
    ) -> Error {
        Error::registration(RegError {
            domain: domain.to_string(),
            mem_type: self.mem_type,
            device: self.device,
            addr: self.addr,
            len: self.len,
            kind,
            detail: detail.into(),
            hint: hint.into(),
        })
    }

    /// True when `[addr, addr+len)` lies inside this region.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|e| e <= self.end())
    }
}

/// A registration of a [`MemRegion`] with one memory domain.
///
/// Cloning is cheap; the registration is released when the last clone is dropped (the
/// domain-specific part implements `Drop`). Operations in flight hold a clone, so a buffer is
/// never unregistered under a transfer.
#[derive(Clone)]
pub struct MemHandle {
    region: MemRegion,
    domain: Arc<str>,
    inner: Arc<dyn Any + Send + Sync>,
    guard: Option<Arc<dyn Any + Send + Sync>>,
}

impl MemHandle {
    /// Wrap a domain-specific registration object.
    pub fn new(region: MemRegion, domain: &str, inner: Arc<dyn Any + Send + Sync>) -> Self {
        MemHandle {
            region,
            domain: domain.into(),
            inner,
            guard: None,
        }
    }

    /// Attach an object that is dropped with the last clone of this handle (used by wrappers
    /// such as the fault injector to account for live registrations).
    pub fn with_guard(mut self, guard: Arc<dyn Any + Send + Sync>) -> Self {
        self.guard = Some(guard);
        self
    }

    /// The registered region.
    pub fn region(&self) -> &MemRegion {
        &self.region
    }

    /// Name of the domain that made this handle.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The domain-specific part, if it is a `T`.
    pub fn inner<T: Any>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }

    /// Check that `[addr, addr+len)` is inside the handle; the error names the domain.
    pub fn check(&self, addr: usize, len: usize) -> Result<()> {
        if self.region.contains(addr, len) {
            Ok(())
        } else {
            Err(Error::InvalidParam(format!(
                "buffer {addr:#x}+{len} is not inside the region {:#x}+{} registered with {}",
                self.region.addr, self.region.len, self.domain
            )))
        }
    }
}

impl fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemHandle")
            .field("domain", &self.domain)
            .field("region", &self.region)
            .finish()
    }
}

/// An unpacked remote key: permission to access a peer's registered region.
#[derive(Clone)]
pub struct RemoteKey {
    domain: Arc<str>,
    base: u64,
    len: u64,
    inner: Arc<dyn Any + Send + Sync>,
}

impl RemoteKey {
    /// Wrap a domain-specific remote key covering `[base, base+len)` in the peer.
    pub fn new(domain: &str, base: u64, len: u64, inner: Arc<dyn Any + Send + Sync>) -> Self {
        RemoteKey {
            domain: domain.into(),
            base,
            len,
            inner,
        }
    }

    /// Domain that unpacked it.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// Remote region start.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Remote region length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty remote region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The domain-specific part, if it is a `T`.
    pub fn inner<T: Any>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }

    /// Check that a remote access stays inside the region.
    pub fn check(&self, addr: u64, len: u64) -> Result<()> {
        let ok = addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.base.saturating_add(self.len));
        if ok {
            Ok(())
        } else {
            Err(Error::OutOfBounds {
                addr,
                len,
                base: self.base,
                region_len: self.len,
            })
        }
    }
}

impl fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteKey")
            .field("domain", &self.domain)
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

/// The allocation a buffer belongs to, as a domain's driver identifies it: where it starts, how
/// long it is, and an id the driver never gives to another allocation (e.g. CUDA's buffer id),
/// so that a remembered fact about it is dropped once the memory is freed and the range reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocId {
    /// Start address of the allocation.
    pub base: usize,
    /// Length of the allocation in bytes.
    pub len: usize,
    /// The driver's identity of the allocation.
    pub id: u64,
}

/// Host memory allocated by a domain so that peers on the same host can map it
/// ([`MemoryDomain::mem_alloc_shared`] / [`MemoryDomain::rkey_ptr`]).
#[derive(Debug, Clone)]
pub struct SharedAlloc {
    /// Start address in this process.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Registration of the whole allocation with the domain that made it; the memory stays
    /// mapped while any clone of it lives. Remote keys packed from it let peers map it.
    pub memh: MemHandle,
}

/// A transport resource of a domain: one transport on one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlResource {
    /// Transport name.
    pub tl_name: String,
    /// Device name.
    pub dev_name: String,
}

impl TlResource {
    /// Transport `tl_name` on device `dev_name`.
    pub fn new(tl_name: &str, dev_name: &str) -> TlResource {
        TlResource {
            tl_name: tl_name.into(),
            dev_name: dev_name.into(),
        }
    }

    /// For [`MemoryDomain::open_iface`] of domain `md`, whose one resource is `tl_name` on
    /// `dev_name`: an [`Error::InvalidParam`] unless this is that resource.
    pub fn expect(&self, md: &str, tl_name: &str, dev_name: &str) -> Result<()> {
        if self.tl_name != tl_name || self.dev_name != dev_name {
            return Err(Error::InvalidParam(format!(
                "{md} has no transport {}/{}",
                self.tl_name, self.dev_name
            )));
        }
        Ok(())
    }
}

/// A memory domain: registers memory and opens interfaces for its transports.
pub trait MemoryDomain: Send + Sync + fmt::Debug {
    /// Domain name, unique within the process (`self`, `posix`, `tcp`, `cuda_cpy`, `mlx5_0`).
    fn name(&self) -> &str;

    /// Attributes, fixed once the domain is open.
    fn attr(&self) -> &MdAttr;

    /// Transports and devices this domain offers.
    fn tl_resources(&self) -> Vec<TlResource>;

    /// Open an interface for one of [`tl_resources`](Self::tl_resources).
    fn open_iface(&self, tl: &TlResource, params: &IfaceParams) -> Result<Box<dyn Iface>>;

    /// Register a buffer for zero-copy operations and remote access.
    ///
    /// A failure is an [`Error::Registration`] whose kind classifies the cause.
    ///
    /// # Safety
    /// `region` must describe memory that stays allocated (and, for host memory, valid for reads
    /// and writes by this domain's transports) for as long as any clone of the returned handle,
    /// or any remote key made from it, is alive.
    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle>;

    /// Pack a remote key for `memh` so a peer can access it. Errors when the domain has no
    /// remote access.
    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>>;

    /// Unpack a peer's remote key, validating every field; garbage is an error, never a crash.
    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey>;

    /// Whether an earlier registration still describes the same memory (its allocation was not
    /// freed and replaced at the same address). `false` means "cannot tell", and callers do not
    /// reuse the handle; domains that can check cheaply (a GPU allocation's identity) say `true`
    /// for handles that are still good.
    fn mem_still_valid(&self, _memh: &MemHandle) -> bool {
        false
    }

    /// The allocation holding `region` and its identity, when the domain can tell cheaply
    /// (GPU allocations). The planner uses it to remember that the domain refused an allocation
    /// (and to forget that once the range belongs to another allocation). `None`: cannot tell,
    /// and nothing is remembered.
    fn allocation_of(&self, _region: &MemRegion) -> Option<AllocId> {
        None
    }

    /// Allocate `len` bytes of host memory that peers on this host can map through
    /// [`rkey_ptr`](Self::rkey_ptr) (e.g. a shared-memory segment), registered with this
    /// domain. `Ok(None)`: the domain cannot.
    fn mem_alloc_shared(&self, _len: usize) -> Result<Option<SharedAlloc>> {
        Ok(None)
    }

    /// Map the peer memory a remote key describes into this process: the local address of
    /// `rkey.base()`. `Ok(None)`: this key cannot be mapped (only keys of
    /// [`mem_alloc_shared`](Self::mem_alloc_shared) memory can). Mappings stay until the domain
    /// is dropped.
    fn rkey_ptr(&self, _rkey: &RemoteKey) -> Result<Option<usize>> {
        Ok(None)
    }

    /// The physical identity (the driver's UUID) of the GPU this process numbers `device`,
    /// when the domain can tell: the same in every process on the host whatever its own
    /// numbering, so two processes can tell that their buffers sit on one GPU. `None`: cannot
    /// tell (not a GPU domain, or the driver has no such call).
    fn gpu_uuid(&self, _device: u32) -> Option<[u8; 16]> {
        None
    }

    /// Classify a pointer, when the domain has `DETECT` for some type. `Ok(None)` means "not
    /// mine".
    fn detect_mem_type(&self, _addr: usize, _len: usize) -> Result<Option<MemRegion>> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_resource_domain_opens_only_its_own() {
        let r = TlResource::new("cuda_copy", "cuda");
        assert_eq!(
            (r.tl_name.as_str(), r.dev_name.as_str()),
            ("cuda_copy", "cuda")
        );
        assert!(r.expect("cuda_cpy", "cuda_copy", "cuda").is_ok());
        for (tl, dev) in [("cuda_ipc", "cuda"), ("cuda_copy", "memory0")] {
            let e = r.expect("cuda_cpy", tl, dev).unwrap_err();
            assert!(matches!(e, Error::InvalidParam(_)), "{e}");
            assert!(
                e.to_string()
                    .contains("cuda_cpy has no transport cuda_copy/cuda"),
                "{e}"
            );
        }
    }
}
