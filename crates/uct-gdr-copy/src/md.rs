//! The `gdr_copy` component and memory domain.
//!
//! Remote key payload (little endian, inside the common [`rkey`] envelope): `pid: u32`,
//! `id: u64` (a live registration of that process), `addr: u64`, `len: u64`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rucx_cuda::{PtrKind, classify, driver, sys};
use rucx_ucs::{Config, Error, MemoryType, RegErrorKind, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    Availability, Component, Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion,
    MemTypeFlags, MemoryDomain, RemoteKey, TlResource,
};

use crate::api::{DEVICE_FILE, Gdr, GdrApi, GdrMh, page_span};
use crate::iface::GdrCopyIface;
use crate::{DEVICE, NAME, lib_name, probe};

/// A pinned and mapped device range; unmapped and unpinned on drop.
#[derive(Debug)]
pub struct Reg {
    id: u64,
    region: MemRegion,
    gdr: Arc<Gdr>,
    mh: GdrMh,
    /// Mapping of the pinned range (starting at GPU address `pinned_va`).
    map: usize,
    map_size: usize,
    pinned_va: u64,
}

// SAFETY: the mapping pointer is only an address into device memory mapped for this process;
// it is dereferenced only through gdrcopy's copy functions, which are thread-safe.
unsafe impl Send for Reg {}
// SAFETY: see `Send`.
unsafe impl Sync for Reg {}

impl Reg {
    /// The CPU address of GPU address `gpu_addr` (inside the registration).
    pub(crate) fn cpu_addr(&self, gpu_addr: u64) -> *mut c_void {
        (self.map as u64 + (gpu_addr - self.pinned_va)) as *mut c_void
    }

    /// The gdrcopy connection and handle.
    pub(crate) fn gdr(&self) -> (&Gdr, GdrMh) {
        (&self.gdr, self.mh)
    }

    /// Registered region.
    pub fn region(&self) -> &MemRegion {
        &self.region
    }
}

type Table = Mutex<HashMap<u64, Weak<Reg>>>;

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The live registration `id` of this process.
pub(crate) fn lookup(id: u64) -> Option<Arc<Reg>> {
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .and_then(Weak::upgrade)
}

impl Drop for Reg {
    fn drop(&mut self) {
        table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        // SAFETY: `map`/`map_size` is the mapping made in `mem_reg` for `mh`, unmapped once.
        let r = unsafe {
            self.gdr
                .unmap(self.mh, self.map as *mut c_void, self.map_size)
        };
        if r != 0 {
            tracing::warn!("gdr_unmap failed: {r}");
        }
        let r = self.gdr.unpin(self.mh);
        if r != 0 {
            tracing::warn!("gdr_unpin_buffer failed: {r}");
        }
    }
}

/// The fields of a packed `gdr_copy` remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RkeyFields {
    /// Process that made the key.
    pub pid: u32,
    /// Registration id there.
    pub id: u64,
    /// Region start (GPU address).
    pub addr: u64,
    /// Region length.
    pub len: u64,
}

impl RkeyFields {
    /// Size of a packed key.
    pub fn packed_size() -> usize {
        rkey::pack(NAME, &[0u8; 28]).len()
    }

    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(28);
        p.extend_from_slice(&self.pid.to_le_bytes());
        p.extend_from_slice(&self.id.to_le_bytes());
        p.extend_from_slice(&self.addr.to_le_bytes());
        p.extend_from_slice(&self.len.to_le_bytes());
        rkey::pack(NAME, &p)
    }

    /// Unpack and validate.
    pub fn unpack(blob: &[u8]) -> Result<RkeyFields> {
        let payload = rkey::unpack(NAME, "gdr_copy rkey", blob)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: NAME.into(),
            reason,
        };
        let mut r = Reader::new(payload, "gdr_copy rkey");
        let parsed = (|| Ok::<_, Error>((r.u32()?, r.u64()?, r.u64()?, r.u64()?)))();
        let (pid, id, addr, len) = parsed.map_err(|e| bad(e.to_string()))?;
        r.finish().map_err(|e| bad(e.to_string()))?;
        if pid == 0 || id == 0 {
            return Err(bad("zero process or registration id".into()));
        }
        if addr.checked_add(len).is_none() {
            return Err(bad(format!("region {addr:#x}+{len} wraps around")));
        }
        Ok(RkeyFields { pid, id, addr, len })
    }
}

/// The unpacked key kept in a [`RemoteKey`].
#[derive(Debug)]
pub(crate) struct GdrRkey {
    pub(crate) id: u64,
}

/// Unpack a key of this process.
pub(crate) fn unpack_key(packed: &[u8]) -> Result<RemoteKey> {
    let f = RkeyFields::unpack(packed)?;
    if f.pid != std::process::id() {
        return Err(Error::InvalidRkey {
            domain: NAME.into(),
            reason: format!(
                "key of process {}; gdr_copy reaches only its own process",
                f.pid
            ),
        });
    }
    Ok(RemoteKey::new(
        NAME,
        f.addr,
        f.len,
        Arc::new(GdrRkey { id: f.id }),
    ))
}

/// The memory-domain attributes of `gdr_copy` (no library needed).
pub fn md_attr() -> MdAttr {
    let mut a = MdAttr::new(NAME).with(MemoryType::Cuda, MemTypeFlags::REG | MemTypeFlags::ACCESS);
    // Pinning and mapping GPU pages: tens of microseconds, more for large ranges.
    a.reg_cost = LinearCost {
        overhead_ns: 30_000.0,
        per_byte_ns: 0.005,
    };
    a.rkey_packed_size = RkeyFields::packed_size();
    // Local (host) buffers are read or written by the CPU; any handle describing them works.
    a.need_memh_for_zcopy = false;
    a
}

/// The `gdr_copy` component.
#[derive(Debug, Default)]
pub struct GdrCopyComponent;

impl Component for GdrCopyComponent {
    fn name(&self) -> &'static str {
        NAME
    }

    fn transports(&self) -> &'static [&'static str] {
        &[NAME]
    }

    fn query(&self, config: &Config) -> Availability {
        match probe(&lib_name(config), Path::new(DEVICE_FILE)) {
            Ok(_) => Availability::Available(vec![NAME.into()]),
            Err(reason) => Availability::Unavailable(reason),
        }
    }

    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        if md_name != NAME {
            return Err(Error::InvalidParam(format!(
                "{NAME} has no memory domain {md_name:?}"
            )));
        }
        Ok(Arc::new(GdrCopyMd::open(config)?))
    }
}

/// The `gdr_copy` memory domain: one gdrdrv connection.
#[derive(Debug)]
pub struct GdrCopyMd {
    attr: MdAttr,
    gdr: Arc<Gdr>,
}

impl GdrCopyMd {
    /// Load the library, check the driver, open a connection.
    pub fn open(config: &Config) -> Result<GdrCopyMd> {
        let api: GdrApi = probe(&lib_name(config), Path::new(DEVICE_FILE)).map_err(|reason| {
            Error::Unavailable {
                component: NAME.into(),
                reason,
            }
        })?;
        Ok(GdrCopyMd {
            attr: md_attr(),
            gdr: Arc::new(Gdr::open(Arc::new(api))?),
        })
    }

    fn reg_error(region: &MemRegion, kind: RegErrorKind, detail: String) -> Error {
        let hint = if kind == RegErrorKind::ApertureExhausted {
            "BAR1 space is short; set RUCX_REG_SKIP=gdr_copy:cuda to skip gdrcopy"
        } else {
            ""
        };
        region.reg_error(NAME, kind, detail, hint)
    }
}

/// The registration-failure kind of a gdrcopy error code (an errno value, either sign).
pub fn reg_kind(code: i32) -> RegErrorKind {
    match code.unsigned_abs() {
        12 => RegErrorKind::ApertureExhausted, // ENOMEM: BAR1 or pinning resources
        14 | 22 => RegErrorKind::BadAddress,   // EFAULT, EINVAL: not pinnable device memory
        1 | 13 => RegErrorKind::Other,         // EPERM, EACCES
        _ => RegErrorKind::Other,
    }
}

/// Ask the driver to make every CUDA operation on the buffer synchronize with the CPU's
/// accesses through the mapping (gdrcopy's requirement for consistent reads).
fn set_sync_memops(addr: u64, device: u32) {
    let Ok(drv) = driver() else { return };
    if !drv.has_symbol("cuPointerSetAttribute") {
        return;
    }
    if let Ok(ctx) = drv.context(device) {
        let _ = ctx.bind();
    }
    let flag: u32 = 1;
    // SAFETY: the symbol exists (checked); the value pointer is a live u32 as the attribute
    // requires; `addr` is a device pointer (a bad one is an error result, ignored).
    let r = unsafe {
        rucx_cuda::cu!(cuPointerSetAttribute(
            &flag as *const u32 as *const c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            addr,
        ))
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        tracing::debug!("cuPointerSetAttribute(SYNC_MEMOPS, {addr:#x}): {r:?}");
    }
}

impl MemoryDomain for GdrCopyMd {
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
        Ok(Box::new(GdrCopyIface::new()))
    }

    /// Pin the GPU pages covering the buffer and map them into this process.
    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        if region.mem_type != MemoryType::Cuda {
            return Err(Self::reg_error(
                &region,
                RegErrorKind::UnsupportedMemoryType,
                format!(
                    "gdr_copy maps CUDA device memory only, not {} memory",
                    region.mem_type
                ),
            ));
        }
        let info = classify(region.addr, region.len.max(1))?;
        if info.kind != PtrKind::Cuda {
            return Err(Self::reg_error(
                &region,
                RegErrorKind::UnsupportedMemoryType,
                format!("the CUDA driver says the buffer is {info}"),
            ));
        }
        let mut region = region;
        if region.device.is_none() {
            region.device = info.device;
        }
        let (start, size) = page_span(region.addr as u64, region.len as u64).ok_or_else(|| {
            Error::InvalidParam(format!(
                "buffer {:#x}+{} wraps around",
                region.addr, region.len
            ))
        })?;
        set_sync_memops(region.addr as u64, info.device.unwrap_or(0));
        let size = size as usize;
        let mh = self.gdr.pin(start, size).map_err(|code| {
            Self::reg_error(
                &region,
                reg_kind(code),
                format!("gdr_pin_buffer({start:#x}, {size} bytes) failed with error {code}"),
            )
        })?;
        let undo_pin = |e: Error| {
            let _ = self.gdr.unpin(mh);
            e
        };
        let map = self.gdr.map(mh, size).map_err(|code| {
            undo_pin(Self::reg_error(
                &region,
                reg_kind(code),
                format!("gdr_map of {size} pinned bytes failed with error {code}"),
            ))
        })?;
        let pinned_va = match self.gdr.info(mh) {
            Ok(i) if i.va <= region.addr as u64 && i.va != 0 => i.va,
            Ok(_) => start,
            Err(code) => {
                // SAFETY: the mapping was just made for `mh` with this size.
                unsafe { self.gdr.unmap(mh, map, size) };
                return Err(undo_pin(Self::reg_error(
                    &region,
                    RegErrorKind::Other,
                    format!("gdr_get_info failed with error {code}"),
                )));
            }
        };
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let reg = Arc::new(Reg {
            id,
            region,
            gdr: self.gdr.clone(),
            mh,
            map: map as usize,
            map_size: size,
            pinned_va,
        });
        table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::downgrade(&reg));
        Ok(MemHandle::new(region, NAME, reg))
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let reg = memh.inner::<Reg>().ok_or_else(|| {
            Error::InvalidParam(format!("handle from {} given to {NAME}", memh.domain()))
        })?;
        Ok(RkeyFields {
            pid: std::process::id(),
            id: reg.id,
            addr: reg.region.addr as u64,
            len: reg.region.len as u64,
        }
        .pack())
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        unpack_key(packed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> RkeyFields {
        RkeyFields {
            pid: std::process::id(),
            id: 3,
            addr: 0x7f00_0001_0000,
            len: 4096,
        }
    }

    #[test]
    fn attributes() {
        let a = md_attr();
        assert_eq!(a.component, "gdr_copy");
        assert_eq!(
            a.flags(MemoryType::Cuda),
            MemTypeFlags::REG | MemTypeFlags::ACCESS
        );
        assert_eq!(a.flags(MemoryType::Host), MemTypeFlags::empty());
        assert_eq!(a.rkey_packed_size, sample().pack().len());
    }

    #[test]
    fn error_kinds() {
        assert_eq!(reg_kind(12), RegErrorKind::ApertureExhausted);
        assert_eq!(reg_kind(-12), RegErrorKind::ApertureExhausted);
        assert_eq!(reg_kind(22), RegErrorKind::BadAddress);
        assert_eq!(reg_kind(5), RegErrorKind::Other);
        let r = MemRegion {
            addr: 0x1000,
            len: 1,
            mem_type: MemoryType::Cuda,
            device: Some(0),
        };
        let e = GdrCopyMd::reg_error(&r, RegErrorKind::ApertureExhausted, "x".into());
        assert!(e.to_string().contains("RUCX_REG_SKIP=gdr_copy:cuda"), "{e}");
    }

    #[test]
    fn keys() {
        let k = sample();
        assert_eq!(RkeyFields::unpack(&k.pack()).unwrap(), k);
        let rk = unpack_key(&k.pack()).unwrap();
        assert_eq!((rk.base(), rk.len()), (k.addr, k.len));
        let other = RkeyFields {
            pid: std::process::id() + 1,
            ..k
        };
        assert!(
            unpack_key(&other.pack())
                .unwrap_err()
                .to_string()
                .contains("own process")
        );
        for bad in [
            RkeyFields { pid: 0, ..k },
            RkeyFields { id: 0, ..k },
            RkeyFields { len: u64::MAX, ..k },
        ] {
            assert!(matches!(
                RkeyFields::unpack(&bad.pack()),
                Err(Error::InvalidRkey { .. })
            ));
        }
        assert!(lookup(u64::MAX).is_none(), "no such registration");
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = RkeyFields::unpack(&g);
            let _ = RkeyFields::unpack(&rkey::pack(NAME, &g));
        }

        #[test]
        fn bit_flips_are_rejected(pos in any::<usize>(), bit in 0u8..8) {
            let mut b = sample().pack();
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            prop_assert!(RkeyFields::unpack(&b).is_err());
        }

        #[test]
        fn valid_keys_round_trip(pid in 1u32.., id in 1u64.., addr in any::<u64>(), len in any::<u64>()) {
            let f = RkeyFields { pid, id, addr, len: len.min(u64::MAX - addr) };
            prop_assert_eq!(RkeyFields::unpack(&f.pack()).unwrap(), f);
        }
    }
}
