//! The `cuda_ipc` component and memory domain: export device memory, pack and unpack keys.
//!
//! Remote key payload (little endian, inside the common [`rkey`] envelope): `handle[64]`,
//! `alloc_base: u64`, `alloc_size: u64`, `addr: u64`, `len: u64` (the registered range, inside
//! the allocation), `pid: u32`, `device: u32` (the owner's ordinal, for messages), `buffer_id:
//! u64`, `boot_id[16]`.

use std::sync::Arc;

use rucx_cuda::{Driver, PtrKind, driver, reg_error_kind, result_name, sys};
use rucx_ucs::{Config, Error, MemoryType, RegErrorKind, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    AllocId, Availability, Component, Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion,
    MemTypeFlags, MemoryDomain, RemoteKey, TlResource,
};

use crate::cache::{CacheStats, IpcCache};
use crate::iface::CudaIpcIface;
use crate::{DEVICE, HostId, NAME, NOT_EXPORTABLE_HINT, Settings};

const PAYLOAD_LEN: usize = 64 + 8 * 4 + 4 + 4 + 8 + 16;
/// Largest device ordinal accepted from a packed key.
const MAX_DEVICE: u32 = 1 << 16;

/// Everything a peer needs to map and access a registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcKey {
    /// The legacy IPC handle of the allocation.
    pub handle: [u8; 64],
    /// Allocation start in the owner's address space.
    pub alloc_base: u64,
    /// Allocation size.
    pub alloc_size: u64,
    /// Registered range start (inside the allocation).
    pub addr: u64,
    /// Registered range length.
    pub len: u64,
    /// Owner process.
    pub pid: u32,
    /// Owner's GPU ordinal (in its own numbering).
    pub device: u32,
    /// The driver's id of the allocation.
    pub buffer_id: u64,
    /// Owner's host boot id.
    pub boot_id: [u8; 16],
}

impl IpcKey {
    /// Size of a packed key.
    pub fn packed_size() -> usize {
        rkey::pack(NAME, &[0u8; PAYLOAD_LEN]).len()
    }

    /// Pack into the common envelope.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(PAYLOAD_LEN);
        p.extend_from_slice(&self.handle);
        for v in [self.alloc_base, self.alloc_size, self.addr, self.len] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p.extend_from_slice(&self.pid.to_le_bytes());
        p.extend_from_slice(&self.device.to_le_bytes());
        p.extend_from_slice(&self.buffer_id.to_le_bytes());
        p.extend_from_slice(&self.boot_id);
        rkey::pack(NAME, &p)
    }

    /// Unpack and validate every field.
    pub fn unpack(blob: &[u8]) -> Result<IpcKey> {
        let payload = rkey::unpack(NAME, "cuda_ipc rkey", blob)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: NAME.into(),
            reason,
        };
        let mut r = Reader::new(payload, "cuda_ipc rkey");
        let parsed = (|| {
            let handle: [u8; 64] = r.bytes(64)?.try_into().expect("64 bytes");
            let alloc_base = r.u64()?;
            let alloc_size = r.u64()?;
            let addr = r.u64()?;
            let len = r.u64()?;
            let pid = r.u32()?;
            let device = r.u32()?;
            let buffer_id = r.u64()?;
            let boot_id: [u8; 16] = r.bytes(16)?.try_into().expect("16 bytes");
            Ok::<_, Error>(IpcKey {
                handle,
                alloc_base,
                alloc_size,
                addr,
                len,
                pid,
                device,
                buffer_id,
                boot_id,
            })
        })();
        let k = parsed.map_err(|e| bad(e.to_string()))?;
        r.finish().map_err(|e| bad(e.to_string()))?;
        let alloc_end = k
            .alloc_base
            .checked_add(k.alloc_size)
            .ok_or_else(|| bad("allocation wraps around".into()))?;
        if k.alloc_size == 0 {
            return Err(bad("empty allocation".into()));
        }
        let end = k
            .addr
            .checked_add(k.len)
            .ok_or_else(|| bad("registered range wraps around".into()))?;
        if k.addr < k.alloc_base || end > alloc_end {
            return Err(bad(format!(
                "registered range {:#x}+{} lies outside its allocation {:#x}+{}",
                k.addr, k.len, k.alloc_base, k.alloc_size
            )));
        }
        if k.pid == 0 {
            return Err(bad("process id 0".into()));
        }
        if k.device >= MAX_DEVICE {
            return Err(bad(format!("device {}", k.device)));
        }
        Ok(k)
    }
}

/// The inner part of a `cuda_ipc` memory handle: the exported allocation.
#[derive(Debug)]
pub struct IpcReg {
    /// Key fields for this registration (this process, this host).
    pub key: IpcKey,
}

/// The memory-domain attributes of `cuda_ipc` (no driver needed).
pub fn md_attr() -> MdAttr {
    // Device memory is exported (registered) and copied; host memory is only the local side of
    // a copy (a device-to-host read out of a peer's mapped buffer, or host-to-device write).
    let mut a = MdAttr::new(NAME)
        .with(MemoryType::Cuda, MemTypeFlags::REG | MemTypeFlags::ACCESS)
        .with(MemoryType::Host, MemTypeFlags::ACCESS);
    // cuIpcGetMemHandle: one driver call, independent of size.
    a.reg_cost = LinearCost::fixed(5_000.0);
    a.rkey_packed_size = IpcKey::packed_size();
    // Local buffers of put/get are described by any handle; only remote ones are exported.
    a.need_memh_for_zcopy = false;
    a
}

/// The availability of the component: the CUDA driver must load and show a device.
pub fn availability() -> Availability {
    match driver() {
        Ok(_) => Availability::Available(vec![NAME.to_string()]),
        Err(Error::Unavailable { reason, .. }) => Availability::Unavailable(reason),
        Err(e) => Availability::Unavailable(e.to_string()),
    }
}

/// The `cuda_ipc` component.
#[derive(Debug, Default)]
pub struct CudaIpcComponent;

impl Component for CudaIpcComponent {
    fn name(&self) -> &'static str {
        NAME
    }

    fn transports(&self) -> &'static [&'static str] {
        &[NAME]
    }

    fn query(&self, _config: &Config) -> Availability {
        availability()
    }

    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        if md_name != NAME {
            return Err(Error::InvalidParam(format!(
                "{NAME} has no memory domain {md_name:?}"
            )));
        }
        Ok(Arc::new(CudaIpcMd::open(config)?))
    }
}

/// The `cuda_ipc` memory domain. Its interfaces share its cache of opened peer allocations.
#[derive(Debug)]
pub struct CudaIpcMd {
    attr: MdAttr,
    settings: Settings,
    drv: &'static Driver,
    host: HostId,
    cache: Arc<IpcCache>,
}

impl CudaIpcMd {
    /// Open the domain (needs the CUDA driver).
    pub fn open(config: &Config) -> Result<CudaIpcMd> {
        let settings = Settings::from_config(config)?;
        let drv = driver()?;
        Ok(CudaIpcMd {
            attr: md_attr(),
            settings,
            drv,
            host: HostId::local(),
            cache: Arc::new(IpcCache::new(settings.cache, settings.cache_size)),
        })
    }

    /// The cache of opened peer allocations (for explicit invalidation and statistics).
    pub fn cache(&self) -> &Arc<IpcCache> {
        &self.cache
    }

    /// Cache counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Forget the mappings of peer process `pid` (it disconnected or exited).
    pub fn invalidate_peer(&self, pid: u32) -> usize {
        self.cache.invalidate_pid(pid)
    }

    /// Forget mappings of `pid`'s memory overlapping `base..base+len` (it freed it).
    pub fn invalidate_remote(&self, pid: u32, base: u64, len: u64) -> usize {
        self.cache.invalidate_range(pid, base, len)
    }

    fn reg_error(region: &MemRegion, kind: RegErrorKind, detail: String, hint: &str) -> Error {
        region.reg_error(NAME, kind, detail, hint)
    }
}

impl MemoryDomain for CudaIpcMd {
    fn name(&self) -> &str {
        NAME
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        vec![TlResource::new(NAME, DEVICE)]
    }

    fn open_iface(&self, tl: &TlResource, _params: &IfaceParams) -> Result<Box<dyn Iface>> {
        tl.expect(NAME, NAME, DEVICE)?;
        Ok(Box::new(CudaIpcIface::new(
            &self.settings,
            self.host.clone(),
            self.cache.clone(),
        )))
    }

    /// Export the allocation containing the buffer through a legacy IPC handle. Host memory
    /// gets a handle that only describes it, for the local side of a copy out of (or into) a
    /// peer's mapped buffer: nothing is page-locked (no registration outlives the request, so a
    /// freed and reused buffer can never meet a stale one) and nothing is exported.
    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        if region.mem_type == MemoryType::Host {
            return Ok(MemHandle::new(region, NAME, Arc::new(())));
        }
        if region.mem_type != MemoryType::Cuda {
            return Err(Self::reg_error(
                &region,
                RegErrorKind::UnsupportedMemoryType,
                format!(
                    "cuda_ipc exports CUDA device memory only, not {} memory",
                    region.mem_type
                ),
                "",
            ));
        }
        let info = rucx_cuda::pointer::classify_expecting(region.addr, region.len.max(1), |i| {
            i.kind == PtrKind::Cuda
        })?;
        let mut region = region;
        if region.device.is_none() {
            region.device = info.device;
        }
        if info.kind != PtrKind::Cuda {
            return Err(Self::reg_error(
                &region,
                RegErrorKind::UnsupportedMemoryType,
                format!("the CUDA driver says the buffer is {info}"),
                "",
            ));
        }
        let device = info.device.unwrap_or(0);
        let pool_why = "the buffer comes from a stream-ordered memory pool (cuMemAllocAsync), \
                        whose allocations legacy IPC handles cannot export";
        let ctx = self.drv.context(device)?;
        ctx.bind()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: the context is current, `h` is a valid out-pointer, and `info.base` is the
        // start of a live device allocation (the caller's contract for `region`).
        let r = unsafe { rucx_cuda::cu!(cuIpcGetMemHandle(&mut h, info.base as u64)) };
        if r != sys::CUresult::CUDA_SUCCESS {
            let mut detail = format!(
                "cuIpcGetMemHandle(allocation {:#x}+{} on GPU {device}) failed with {}",
                info.base,
                info.size,
                result_name(r)
            );
            let mut kind = reg_error_kind(r);
            if info.from_pool {
                detail.push_str(&format!(": {pool_why}"));
            } else if !info.ipc_exportable {
                detail.push_str(
                    ": the driver reports the allocation is not legacy-IPC capable (a VMM or \
                     otherwise non-exportable allocation)",
                );
            }
            if info.from_pool || !info.ipc_exportable {
                // The pointer's attributes say why: a property of this allocation, whatever
                // code the driver chose (other buffers of the GPU may export fine).
                kind = RegErrorKind::NotExportable;
            }
            let hint = if kind == RegErrorKind::NotExportable {
                NOT_EXPORTABLE_HINT
            } else {
                ""
            };
            return Err(Self::reg_error(&region, kind, detail, hint));
        }
        if info.from_pool {
            // Some drivers hand out a handle that no peer can open: refuse it here, where the
            // planner can still demote, rather than at the peer in the middle of a transfer.
            return Err(Self::reg_error(
                &region,
                RegErrorKind::NotExportable,
                format!(
                    "allocation {:#x}+{} on GPU {device}: {pool_why}",
                    info.base, info.size
                ),
                NOT_EXPORTABLE_HINT,
            ));
        }
        let mut handle = [0u8; 64];
        for (d, s) in handle.iter_mut().zip(h.reserved.iter()) {
            *d = *s as u8;
        }
        let key = IpcKey {
            handle,
            alloc_base: info.base as u64,
            alloc_size: info.size as u64,
            addr: region.addr as u64,
            len: region.len as u64,
            pid: std::process::id(),
            device,
            buffer_id: info.buffer_id,
            boot_id: self.host.boot_id,
        };
        Ok(MemHandle::new(region, NAME, Arc::new(IpcReg { key })))
    }

    fn mem_still_valid(&self, memh: &MemHandle) -> bool {
        // The same allocation still holds the registered range: the driver's id of the
        // allocation at the range's start now (uncached, one call asking one attribute) is the
        // one registered. Ids are unique for the life of the process, so an allocation freed
        // and replaced at the same address (or a range now unmapped, id none) never matches;
        // the same allocation has the same base and size, so the range still fits in it.
        let Some(reg) = memh.inner::<IpcReg>() else {
            return false;
        };
        reg.key.buffer_id != 0
            && matches!(
                rucx_cuda::pointer::buffer_id(memh.region().addr),
                Ok(Some(id)) if id == reg.key.buffer_id
            )
    }

    fn allocation_of(&self, region: &MemRegion) -> Option<AllocId> {
        // The driver's buffer id tells allocations at the same address apart (uncached: the
        // answer must be about the memory there now).
        if region.mem_type != MemoryType::Cuda {
            return None;
        }
        let info = rucx_cuda::pointer::classify_uncached(region.addr, region.len.max(1)).ok()?;
        (info.kind == PtrKind::Cuda && info.size > 0).then_some(AllocId {
            base: info.base,
            len: info.size,
            id: info.buffer_id,
        })
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let reg = memh.inner::<IpcReg>().ok_or_else(|| {
            Error::InvalidParam(format!("handle from {} given to {NAME}", memh.domain()))
        })?;
        Ok(reg.key.pack())
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        unpack_remote(packed, &self.host)
    }

    fn gpu_uuid(&self, device: u32) -> Option<[u8; 16]> {
        driver().ok()?.device(device).ok()?.uuid
    }
}

/// Unpack a key and check that it comes from this host.
pub(crate) fn unpack_remote(packed: &[u8], host: &HostId) -> Result<RemoteKey> {
    let k = IpcKey::unpack(packed)?;
    if k.boot_id != host.boot_id {
        return Err(Error::InvalidRkey {
            domain: NAME.into(),
            reason: format!(
                "key of process {} on another host (boot id differs); cuda_ipc reaches this \
                 host only",
                k.pid
            ),
        });
    }
    Ok(RemoteKey::new(NAME, k.addr, k.len, Arc::new(k)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> IpcKey {
        IpcKey {
            handle: std::array::from_fn(|i| i as u8),
            alloc_base: 0x7f00_0000_0000,
            alloc_size: 2 << 20,
            addr: 0x7f00_0000_1000,
            len: 4096,
            pid: 1234,
            device: 1,
            buffer_id: 99,
            boot_id: HostId::local().boot_id,
        }
    }

    #[test]
    fn attributes() {
        let a = md_attr();
        assert_eq!(a.component, "cuda_ipc");
        assert_eq!(
            a.flags(MemoryType::Cuda),
            MemTypeFlags::REG | MemTypeFlags::ACCESS
        );
        assert_eq!(a.flags(MemoryType::Host), MemTypeFlags::ACCESS);
        assert_eq!(a.flags(MemoryType::CudaManaged), MemTypeFlags::empty());
        assert!(!a.need_memh_for_zcopy);
        assert_eq!(a.rkey_packed_size, sample().pack().len());
    }

    #[test]
    fn availability_follows_the_driver() {
        match (availability(), driver()) {
            (Availability::Available(m), Ok(_)) => assert_eq!(m, vec!["cuda_ipc"]),
            (Availability::Unavailable(reason), Err(e)) => {
                assert!(!reason.is_empty());
                assert!(e.to_string().contains(&reason));
                let cfg = Config::new(&[crate::CONFIG]).unwrap();
                assert!(matches!(
                    CudaIpcComponent.open_md(NAME, &cfg),
                    Err(Error::Unavailable { .. })
                ));
            }
            (a, d) => panic!("{a:?} vs {d:?}"),
        }
        assert_eq!(CudaIpcComponent.transports(), &["cuda_ipc"]);
        let cfg = Config::new(&[crate::CONFIG]).unwrap();
        assert!(CudaIpcComponent.open_md("nope", &cfg).is_err());
    }

    #[test]
    fn round_trip_and_host_check() {
        let k = sample();
        assert_eq!(IpcKey::unpack(&k.pack()).unwrap(), k);
        let here = HostId::local();
        let rk = unpack_remote(&k.pack(), &here).unwrap();
        assert_eq!(
            (rk.base(), rk.len(), rk.domain()),
            (k.addr, k.len, "cuda_ipc")
        );
        assert_eq!(rk.inner::<IpcKey>(), Some(&k));
        let far = IpcKey {
            boot_id: [0xab; 16],
            ..k
        };
        let e = unpack_remote(&far.pack(), &here).unwrap_err();
        assert!(e.to_string().contains("another host"), "{e}");
    }

    #[test]
    fn invalid_fields() {
        let s = sample();
        for (want, k) in [
            (
                "outside its allocation",
                IpcKey {
                    addr: s.alloc_base - 1,
                    ..s
                },
            ),
            ("outside its allocation", IpcKey { len: 3 << 20, ..s }),
            ("empty allocation", IpcKey { alloc_size: 0, ..s }),
            (
                "allocation wraps",
                IpcKey {
                    alloc_base: u64::MAX,
                    ..s
                },
            ),
            ("range wraps", IpcKey { len: u64::MAX, ..s }),
            ("process id 0", IpcKey { pid: 0, ..s }),
            (
                "device",
                IpcKey {
                    device: MAX_DEVICE,
                    ..s
                },
            ),
        ] {
            let e = IpcKey::unpack(&k.pack()).unwrap_err();
            assert!(matches!(e, Error::InvalidRkey { .. }), "{want}: {e:?}");
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        let mut p = rkey::unpack(NAME, "t", &s.pack()).unwrap().to_vec();
        p.push(0);
        assert!(
            IpcKey::unpack(&rkey::pack(NAME, &p)).is_err(),
            "trailing byte"
        );
        p.truncate(PAYLOAD_LEN - 1);
        assert!(IpcKey::unpack(&rkey::pack(NAME, &p)).is_err(), "truncated");
        assert!(
            IpcKey::unpack(&rkey::pack("cuda_cpy", &p)).is_err(),
            "other component"
        );
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = IpcKey::unpack(&g);
            let _ = IpcKey::unpack(&rkey::pack(NAME, &g));
        }

        #[test]
        fn bit_flips_are_rejected(pos in any::<usize>(), bit in 0u8..8) {
            let mut b = sample().pack();
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            prop_assert!(IpcKey::unpack(&b).is_err());
        }

        #[test]
        fn valid_keys_round_trip(base in 0u64..(1 << 60), size in 1u64..(1 << 40), a in any::<u64>(),
                                 l in any::<u64>(), pid in 1u32.., dev in 0u32..MAX_DEVICE,
                                 h in any::<[u8; 32]>()) {
            let addr = base + a % size;
            let len = l % (base + size - addr + 1);
            let mut handle = [0u8; 64];
            handle[..32].copy_from_slice(&h);
            let k = IpcKey { handle, alloc_base: base, alloc_size: size, addr, len, pid,
                             device: dev, buffer_id: a, boot_id: [7; 16] };
            prop_assert_eq!(IpcKey::unpack(&k.pack()).unwrap(), k);
        }
    }
}
