//! The `cuda_cpy` component and memory domain.
//!
//! Registrations live in a process-wide table (id -> registration) so that a remote key, which
//! names a registration by id, is honored only while that registration is alive: an access
//! after the owner dropped its handle is an error, not a wild write.
//!
//! Remote key payload (little endian, inside the common [`rkey`] envelope): `pid: u32`,
//! `mem_type: u8` (0 host, 1 cuda, 2 cuda-managed), three zero bytes, `device: u32`
//! (`u32::MAX` for host memory), `id: u64`, `addr: u64`, `len: u64`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rucx_cuda::{
    DeviceBuffer, Driver, PinnedHostBuffer, PrimaryContext, PtrKind, classify, cuda_error, driver,
    reg_error_kind, sys,
};
use rucx_ucs::{Config, Error, MemoryType, RegErrorKind, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    Availability, Component, Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion,
    MemTypeFlags, MemoryDomain, RemoteKey, TlResource,
};

use crate::iface::CudaCopyIface;
use crate::staging::StagingPool;
use crate::{COMPONENT, DEVICE, MD_NAME, Settings, TL_NAME};

/// `device` value for host memory in packed keys.
const NO_DEVICE: u32 = u32::MAX;
/// Largest device ordinal accepted from a packed key.
const MAX_DEVICE: u32 = 1 << 16;

/// Page-locking of a host range done by this domain, undone on drop.
#[derive(Debug)]
pub(crate) struct HostPin {
    ptr: usize,
    ctx: &'static PrimaryContext,
}

impl Drop for HostPin {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: `ptr` was registered by `cuMemHostRegister` in `pin_host` and is unregistered
        // only here.
        let r = unsafe { rucx_cuda::cu!(cuMemHostUnregister(self.ptr as *mut c_void)) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(
                "{}",
                cuda_error(
                    r,
                    &format!("cuMemHostUnregister({:#x})", self.ptr),
                    Some(self.ctx.ordinal())
                )
            );
        }
    }
}

/// A live registration of the `cuda_cpy` domain (the inner part of its [`MemHandle`]s).
#[derive(Debug)]
pub struct Reg {
    id: u64,
    region: MemRegion,
    pinned_here: Option<HostPin>,
}

impl Reg {
    /// Registered region.
    pub fn region(&self) -> &MemRegion {
        &self.region
    }

    /// Whether this registration page-locked host memory itself (`false` for device memory and
    /// for host memory that was already pinned).
    pub fn pinned_here(&self) -> bool {
        self.pinned_here.is_some()
    }
}

type Table = Mutex<HashMap<u64, Weak<Reg>>>;

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Drop for Reg {
    fn drop(&mut self) {
        table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// Put a registration into the process-wide table and wrap it in a handle.
pub(crate) fn new_handle(region: MemRegion, pin: Option<HostPin>) -> MemHandle {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let reg = Arc::new(Reg {
        id,
        region,
        pinned_here: pin,
    });
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, Arc::downgrade(&reg));
    MemHandle::new(region, MD_NAME, reg)
}

/// The live registration `id`, if its owner still holds it.
pub(crate) fn lookup(id: u64) -> Option<Arc<Reg>> {
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .and_then(Weak::upgrade)
}

/// Handle for memory that is already pinned (the staging pool's own allocation).
pub(crate) fn pinned_handle(region: MemRegion) -> MemHandle {
    new_handle(region, None)
}

fn mem_type_code(m: MemoryType) -> Option<u8> {
    match m {
        MemoryType::Host => Some(0),
        MemoryType::Cuda => Some(1),
        MemoryType::CudaManaged => Some(2),
        MemoryType::Unknown => None,
    }
}

fn mem_type_of(code: u8) -> Option<MemoryType> {
    match code {
        0 => Some(MemoryType::Host),
        1 => Some(MemoryType::Cuda),
        2 => Some(MemoryType::CudaManaged),
        _ => None,
    }
}

/// The fields of a packed `cuda_cpy` remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RkeyFields {
    /// Process that made the key.
    pub pid: u32,
    /// Registration id in that process.
    pub id: u64,
    /// Memory type of the region.
    pub mem_type: MemoryType,
    /// Owning GPU for device and managed memory.
    pub device: Option<u32>,
    /// Region start.
    pub addr: u64,
    /// Region length.
    pub len: u64,
}

impl RkeyFields {
    /// Size of a packed key.
    pub fn packed_size() -> usize {
        rkey::pack(MD_NAME, &[0u8; 36]).len()
    }

    /// Pack into the common envelope. Fails for memory types a key cannot describe.
    pub fn pack(&self) -> Result<Vec<u8>> {
        let code = mem_type_code(self.mem_type).ok_or_else(|| {
            Error::InvalidParam(format!(
                "cuda_cpy cannot make a key for {} memory",
                self.mem_type
            ))
        })?;
        let mut p = Vec::with_capacity(36);
        p.extend_from_slice(&self.pid.to_le_bytes());
        p.push(code);
        p.extend_from_slice(&[0u8; 3]);
        p.extend_from_slice(&self.device.unwrap_or(NO_DEVICE).to_le_bytes());
        p.extend_from_slice(&self.id.to_le_bytes());
        p.extend_from_slice(&self.addr.to_le_bytes());
        p.extend_from_slice(&self.len.to_le_bytes());
        Ok(rkey::pack(MD_NAME, &p))
    }

    /// Unpack and validate every field (the process id is not checked here).
    pub fn unpack(blob: &[u8]) -> Result<RkeyFields> {
        let payload = rkey::unpack(MD_NAME, "cuda_cpy rkey", blob)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: MD_NAME.into(),
            reason,
        };
        let mut r = Reader::new(payload, "cuda_cpy rkey");
        let parsed = (|| {
            let pid = r.u32()?;
            let code = r.u8()?;
            let pad = r.bytes(3)?;
            let device = r.u32()?;
            let id = r.u64()?;
            let addr = r.u64()?;
            let len = r.u64()?;
            Ok::<_, Error>((pid, code, pad, device, id, addr, len))
        })();
        let (pid, code, pad, device, id, addr, len) = parsed.map_err(|e| bad(e.to_string()))?;
        r.finish().map_err(|e| bad(e.to_string()))?;
        if pad != [0, 0, 0] {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let mem_type = mem_type_of(code).ok_or_else(|| bad(format!("memory type code {code}")))?;
        let device = match (mem_type, device) {
            (MemoryType::Host, NO_DEVICE) => None,
            (MemoryType::Host, d) => return Err(bad(format!("host memory with device {d}"))),
            (_, d) if d < MAX_DEVICE => Some(d),
            (m, d) => return Err(bad(format!("{m} memory with device {d}"))),
        };
        if pid == 0 || id == 0 {
            return Err(bad("zero process or registration id".into()));
        }
        if addr.checked_add(len).is_none() {
            return Err(bad(format!("region {addr:#x}+{len} wraps around")));
        }
        Ok(RkeyFields {
            pid,
            id,
            mem_type,
            device,
            addr,
            len,
        })
    }
}

/// The unpacked form kept in a [`RemoteKey`].
#[derive(Debug)]
pub(crate) struct CopyRkey {
    pub(crate) id: u64,
}

/// Pack a remote key for a `cuda_cpy` handle.
pub(crate) fn pack_handle(memh: &MemHandle) -> Result<Vec<u8>> {
    let reg = memh.inner::<Reg>().ok_or_else(|| {
        Error::InvalidParam(format!("handle from {} given to {MD_NAME}", memh.domain()))
    })?;
    RkeyFields {
        pid: std::process::id(),
        id: reg.id,
        mem_type: reg.region.mem_type,
        device: if reg.region.mem_type.is_gpu() {
            Some(reg.region.device.unwrap_or(0))
        } else {
            None
        },
        addr: reg.region.addr as u64,
        len: reg.region.len as u64,
    }
    .pack()
}

/// Unpack a key made by [`pack_handle`] in this process.
pub(crate) fn unpack_key(packed: &[u8]) -> Result<RemoteKey> {
    let f = RkeyFields::unpack(packed)?;
    if f.pid != std::process::id() {
        return Err(Error::InvalidRkey {
            domain: MD_NAME.into(),
            reason: format!(
                "key of process {}; cuda_copy reaches only its own process ({})",
                f.pid,
                std::process::id()
            ),
        });
    }
    Ok(RemoteKey::new(
        MD_NAME,
        f.addr,
        f.len,
        Arc::new(CopyRkey { id: f.id }),
    ))
}

/// The memory-domain attributes of `cuda_cpy` (fixed; no driver needed to compute them).
pub fn md_attr() -> MdAttr {
    let mut a = MdAttr::new(COMPONENT)
        .with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS)
        .with(
            MemoryType::Cuda,
            MemTypeFlags::ACCESS | MemTypeFlags::DETECT | MemTypeFlags::ALLOC,
        )
        .with(
            MemoryType::CudaManaged,
            MemTypeFlags::ACCESS | MemTypeFlags::DETECT,
        );
    // cuMemHostRegister: a fixed driver call plus page pinning (about 10 GB/s).
    a.reg_cost = LinearCost {
        overhead_ns: 15_000.0,
        per_byte_ns: 0.1,
    };
    a.rkey_packed_size = RkeyFields::packed_size();
    a.need_memh_for_zcopy = true;
    a
}

/// What [`CudaCopyMd::alloc`] returns: the allocation, freed when dropped.
#[derive(Debug)]
pub enum Allocation {
    /// Device memory (`cuMemAlloc`).
    Device(DeviceBuffer),
    /// Pinned host memory (`cuMemHostAlloc`, portable).
    PinnedHost(PinnedHostBuffer),
}

impl Allocation {
    /// Start address.
    pub fn addr(&self) -> usize {
        match self {
            Allocation::Device(b) => b.ptr() as usize,
            Allocation::PinnedHost(b) => b.ptr() as usize,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Allocation::Device(b) => b.len(),
            Allocation::PinnedHost(b) => b.len(),
        }
    }

    /// Always false (zero-byte allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The region, ready for [`MemoryDomain::mem_reg`].
    pub fn region(&self) -> MemRegion {
        match self {
            Allocation::Device(b) => MemRegion {
                addr: b.ptr() as usize,
                len: b.len(),
                mem_type: MemoryType::Cuda,
                device: Some(b.device()),
            },
            Allocation::PinnedHost(b) => MemRegion::host(b.ptr() as usize, b.len()),
        }
    }
}

/// The `cuda_cpy` component.
#[derive(Debug, Default)]
pub struct CudaCopyComponent;

/// The availability of the component: the CUDA driver must load and show a device.
pub fn availability() -> Availability {
    match driver() {
        Ok(_) => Availability::Available(vec![MD_NAME.to_string()]),
        Err(Error::Unavailable { reason, .. }) => Availability::Unavailable(reason),
        Err(e) => Availability::Unavailable(e.to_string()),
    }
}

impl Component for CudaCopyComponent {
    fn name(&self) -> &'static str {
        COMPONENT
    }

    fn transports(&self) -> &'static [&'static str] {
        &[TL_NAME]
    }

    fn query(&self, _config: &Config) -> Availability {
        availability()
    }

    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        if md_name != MD_NAME {
            return Err(Error::InvalidParam(format!(
                "{COMPONENT} has no memory domain {md_name:?}"
            )));
        }
        Ok(Arc::new(CudaCopyMd::open(config)?))
    }
}

/// The `cuda_cpy` memory domain.
#[derive(Debug)]
pub struct CudaCopyMd {
    attr: MdAttr,
    settings: Settings,
    drv: &'static Driver,
    pool: Mutex<Option<Arc<StagingPool>>>,
}

impl CudaCopyMd {
    /// Open the domain (needs the CUDA driver; contexts are created on first use).
    pub fn open(config: &Config) -> Result<CudaCopyMd> {
        let settings = Settings::from_config(config)?;
        let drv = driver()?;
        Ok(CudaCopyMd {
            attr: md_attr(),
            settings,
            drv,
            pool: Mutex::new(None),
        })
    }

    /// Settings in effect.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Allocate `len` bytes: [`MemoryType::Cuda`] on `device` (GPU 0 when `None`) or pinned
    /// [`MemoryType::Host`] memory (portable to every context). Other types are unsupported.
    pub fn alloc(
        &self,
        mem_type: MemoryType,
        device: Option<u32>,
        len: usize,
    ) -> Result<Allocation> {
        let ctx = self.drv.context(device.unwrap_or(0))?;
        match mem_type {
            MemoryType::Cuda => Ok(Allocation::Device(DeviceBuffer::new(ctx, len)?)),
            MemoryType::Host => Ok(Allocation::PinnedHost(PinnedHostBuffer::new(ctx, len)?)),
            other => Err(Error::Unsupported {
                what: format!("allocating {other} memory with {MD_NAME}"),
                why: "cuda_cpy allocates device (cuda) and pinned host memory only".into(),
            }),
        }
    }

    /// The staging pool of pinned host fragments sized by `RUCX_CUDA_COPY_FRAG_SIZE` and
    /// `RUCX_CUDA_COPY_FRAG_COUNT`, allocated on the first call and shared afterwards.
    pub fn staging_pool(&self) -> Result<Arc<StagingPool>> {
        let mut slot = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = slot.as_ref() {
            return Ok(p.clone());
        }
        let p = StagingPool::new(&self.settings)?;
        *slot = Some(p.clone());
        Ok(p)
    }

    fn reg_error(region: &MemRegion, kind: RegErrorKind, detail: String) -> Error {
        region.reg_error(MD_NAME, kind, detail, "")
    }

    /// Page-lock a pageable host range. `Ok(None)` when someone else already did.
    fn pin_host(&self, region: &MemRegion) -> Result<Option<HostPin>> {
        let ctx = self.drv.any_context()?;
        ctx.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller of `mem_reg` promised the range stays mapped while registered;
        // the registration is undone in `HostPin::drop`, which the handle owns.
        let r = unsafe {
            rucx_cuda::cu!(cuMemHostRegister_v2(
                region.addr as *mut c_void,
                region.len,
                flags
            ))
        };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(Some(HostPin {
                ptr: region.addr,
                ctx,
            })),
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => Ok(None),
            r => {
                let e = cuda_error(
                    r,
                    &format!(
                        "cuMemHostRegister({} bytes at {:#x})",
                        region.len, region.addr
                    ),
                    Some(ctx.ordinal()),
                );
                Err(Self::reg_error(region, reg_error_kind(r), e.to_string()))
            }
        }
    }
}

impl MemoryDomain for CudaCopyMd {
    fn name(&self) -> &str {
        MD_NAME
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        vec![TlResource::new(TL_NAME, DEVICE)]
    }

    fn open_iface(&self, tl: &TlResource, _params: &IfaceParams) -> Result<Box<dyn Iface>> {
        tl.expect(MD_NAME, TL_NAME, DEVICE)?;
        Ok(Box::new(CudaCopyIface::new(&self.settings)))
    }

    /// Host memory is page-locked (unless already pinned); device and managed memory need no
    /// registration, the handle only describes them (and is checked against the driver's view
    /// of the pointer).
    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        if region.mem_type == MemoryType::Unknown {
            return Err(Self::reg_error(
                &region,
                RegErrorKind::UnsupportedMemoryType,
                "classify the buffer first (detect_mem_type)".into(),
            ));
        }
        if region.len == 0 {
            return Ok(new_handle(region, None));
        }
        let info = rucx_cuda::pointer::classify_expecting(region.addr, region.len, |i| {
            i.kind.memory_type() == region.mem_type
        })?;
        let actual = info.kind.memory_type();
        if actual != region.mem_type {
            return Err(Self::reg_error(
                &region,
                RegErrorKind::Other,
                format!(
                    "the CUDA driver says the buffer is {info}, not {}",
                    region.mem_type
                ),
            ));
        }
        let mut region = region;
        if region.mem_type.is_gpu() && region.device.is_none() {
            region.device = info.device;
        }
        let pin = match info.kind {
            PtrKind::HostPageable => self.pin_host(&region)?,
            _ => None,
        };
        Ok(new_handle(region, pin))
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        pack_handle(memh)
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        unpack_key(packed)
    }

    fn detect_mem_type(&self, addr: usize, len: usize) -> Result<Option<MemRegion>> {
        let info = classify(addr, len)?;
        Ok(match info.kind {
            PtrKind::Cuda | PtrKind::CudaManaged => Some(MemRegion {
                addr,
                len,
                mem_type: info.kind.memory_type(),
                device: info.device,
            }),
            PtrKind::HostPageable | PtrKind::HostPinned => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> RkeyFields {
        RkeyFields {
            pid: 4242,
            id: 9,
            mem_type: MemoryType::Cuda,
            device: Some(1),
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
        }
    }

    #[test]
    fn attributes() {
        let a = md_attr();
        assert_eq!(a.component, "cuda_cpy");
        assert_eq!(
            a.flags(MemoryType::Host),
            MemTypeFlags::REG | MemTypeFlags::ACCESS
        );
        assert_eq!(
            a.flags(MemoryType::Cuda),
            MemTypeFlags::ACCESS | MemTypeFlags::DETECT | MemTypeFlags::ALLOC
        );
        assert_eq!(
            a.flags(MemoryType::CudaManaged),
            MemTypeFlags::ACCESS | MemTypeFlags::DETECT
        );
        assert_eq!(a.reg_mem_types(), rucx_ucs::MemoryTypes::HOST);
        assert!(a.access_mem_types().has(MemoryType::Cuda));
        assert_eq!(a.rkey_packed_size, sample().pack().unwrap().len());
    }

    #[test]
    fn availability_follows_the_driver() {
        match (availability(), driver()) {
            (Availability::Available(mds), Ok(_)) => assert_eq!(mds, vec!["cuda_cpy"]),
            (Availability::Unavailable(reason), Err(e)) => {
                assert!(!reason.is_empty());
                assert!(e.to_string().contains(&reason), "{e} vs {reason}");
                let cfg = Config::new(&[crate::CONFIG]).unwrap();
                let err = CudaCopyComponent.open_md(MD_NAME, &cfg).unwrap_err();
                assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
            }
            (a, d) => panic!("availability {a:?} disagrees with the driver {d:?}"),
        }
        assert_eq!(CudaCopyComponent.transports(), &["cuda_copy"]);
    }

    #[test]
    fn rkey_round_trip() {
        for f in [
            sample(),
            RkeyFields {
                mem_type: MemoryType::Host,
                device: None,
                ..sample()
            },
            RkeyFields {
                mem_type: MemoryType::CudaManaged,
                device: Some(0),
                ..sample()
            },
        ] {
            assert_eq!(RkeyFields::unpack(&f.pack().unwrap()).unwrap(), f);
        }
        assert!(
            RkeyFields {
                mem_type: MemoryType::Unknown,
                ..sample()
            }
            .pack()
            .is_err()
        );
    }

    /// Re-envelope a modified payload so only the field check can reject it.
    fn repack(f: &RkeyFields, edit: impl Fn(&mut Vec<u8>)) -> Vec<u8> {
        let blob = f.pack().unwrap();
        let mut p = rkey::unpack(MD_NAME, "t", &blob).unwrap().to_vec();
        edit(&mut p);
        rkey::pack(MD_NAME, &p)
    }

    #[test]
    fn invalid_fields_are_rejected() {
        let s = sample();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("memory type", repack(&s, |p| p[4] = 7)),
            ("reserved", repack(&s, |p| p[5] = 1)),
            (
                "host memory with device",
                repack(&s, |p| {
                    p[4] = 0;
                }),
            ),
            (
                "cuda memory with device",
                repack(&s, |p| p[8..12].copy_from_slice(&u32::MAX.to_le_bytes())),
            ),
            (
                "wraps",
                repack(&s, |p| p[28..36].copy_from_slice(&u64::MAX.to_le_bytes())),
            ),
            ("zero", repack(&s, |p| p[0..4].copy_from_slice(&[0; 4]))),
            ("trailing", repack(&s, |p| p.push(0))),
            ("truncated", repack(&s, |p| p.truncate(30))),
        ];
        for (want, blob) in cases {
            let e = RkeyFields::unpack(&blob).unwrap_err();
            assert!(matches!(e, Error::InvalidRkey { .. }), "{want}: {e:?}");
            assert!(
                e.to_string().contains(want) || want == "trailing" || want == "truncated",
                "{want}: {e}"
            );
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = RkeyFields::unpack(&g);
        }

        #[test]
        fn enveloped_garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = RkeyFields::unpack(&rkey::pack(MD_NAME, &g));
        }

        #[test]
        fn valid_keys_round_trip(pid in 1u32.., id in 1u64.., addr in any::<u64>(), len in any::<u64>(),
                                 code in 0u8..3, dev in 0u32..MAX_DEVICE) {
            let mem_type = mem_type_of(code).unwrap();
            let f = RkeyFields {
                pid, id, mem_type,
                device: if mem_type == MemoryType::Host { None } else { Some(dev) },
                addr, len: len.min(u64::MAX - addr),
            };
            prop_assert_eq!(RkeyFields::unpack(&f.pack().unwrap()).unwrap(), f);
        }

        #[test]
        fn bit_flips_are_rejected(pos in any::<usize>(), bit in 0u8..8) {
            let mut b = sample().pack().unwrap();
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            prop_assert!(RkeyFields::unpack(&b).is_err());
        }
    }

    #[test]
    fn keys_of_other_processes_are_refused() {
        let h = new_handle(MemRegion::host(0x1000, 64), None);
        let k = unpack_key(&pack_handle(&h).unwrap()).unwrap();
        assert_eq!((k.base(), k.len(), k.domain()), (0x1000, 64, "cuda_cpy"));
        let foreign = RkeyFields {
            pid: std::process::id() + 1,
            ..RkeyFields::unpack(&pack_handle(&h).unwrap()).unwrap()
        };
        let e = unpack_key(&foreign.pack().unwrap()).unwrap_err();
        assert!(e.to_string().contains("only its own process"), "{e}");
        let other = MemHandle::new(MemRegion::host(1, 1), "posix", Arc::new(5u32));
        assert!(pack_handle(&other).is_err());
    }

    #[test]
    fn table_forgets_dropped_registrations() {
        let h = new_handle(MemRegion::host(0x1000, 64), None);
        let id = h.inner::<Reg>().unwrap().id;
        assert!(lookup(id).is_some());
        let h2 = h.clone();
        drop(h);
        assert!(lookup(id).is_some(), "a clone keeps it alive");
        drop(h2);
        assert!(lookup(id).is_none());
        assert!(
            !pinned_handle(MemRegion::host(0x2000, 8))
                .inner::<Reg>()
                .unwrap()
                .pinned_here()
        );
    }
}
