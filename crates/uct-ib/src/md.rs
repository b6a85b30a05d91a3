//! The verbs memory domain: one per RDMA device (`mlx5_0`).
//!
//! Host memory is registered with local write, remote read and remote write rights (plus remote
//! atomics where the device has them). GPU memory follows the per-GPU [`GdrPlan`]: through a
//! dma-buf exported by the CUDA side, through the peer-memory module, or not at all, in which case
//! registration fails with a typed error *before* the driver is asked. Every driver failure is
//! mapped to a [`rucx_ucs::RegError`] by [`crate::regerr`].

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use rucx_ucs::{Config, Error, MemoryType, RegError, RegErrorKind, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    Iface, IfaceParams, MdAttr, MemHandle, MemRegion, MemoryDomain, RemoteKey, TlResource,
};

use crate::attr::{COMPONENT, TL_NAME, md_attr};
use crate::config::{IbConfig, RcConfig};
use crate::gpudirect::{
    DmaBuf, DmabufSupport, GdrPath, GdrPlan, GpuDecision, GpuSupport, NicGdrFacts, decide,
    probe_dmabuf,
};
use crate::probe::{parse_port_name, port_name, usable_ports};
use crate::regerr::{RegAttempt, over_budget, refused, reg_error};
use crate::verbs::{Access, DeviceReport, Mr, PortAttrs, Verbs, VerbsDevice};

/// Envelope name of packed remote keys.
const RKEY_TAG: &str = "ib";

/// Size of a packed remote key.
pub const RKEY_PACKED_LEN: usize = 12 + RKEY_TAG.len() + 20;

/// Bytes of GPU memory registered per GPU by one domain.
#[derive(Debug, Default)]
struct ApertureBook {
    used: Mutex<BTreeMap<u32, u64>>,
}

impl ApertureBook {
    fn used(&self, gpu: u32) -> u64 {
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&gpu)
            .copied()
            .unwrap_or(0)
    }
}

/// A share of a GPU's aperture held by one registration; released when dropped.
#[derive(Debug)]
struct ApertureCharge {
    book: Arc<ApertureBook>,
    gpu: u32,
    bytes: u64,
}

impl Drop for ApertureCharge {
    fn drop(&mut self) {
        let mut m = self.book.used.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = m.get_mut(&self.gpu) {
            *u = u.saturating_sub(self.bytes);
        }
    }
}

/// The domain-specific part of a [`MemHandle`] made by [`IbMd`].
#[derive(Debug)]
pub struct IbMemh {
    device: String,
    lkey: u32,
    rkey: u32,
    // Dropped before the charge: deregister, then release the aperture share.
    _mr: Option<Box<dyn Mr>>,
    _charge: Option<ApertureCharge>,
}

impl IbMemh {
    /// Device the region is registered with.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

/// The domain-specific part of an unpacked [`RemoteKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IbRkey {
    /// The peer's remote key.
    pub rkey: u32,
}

/// A verbs memory domain.
#[derive(Debug)]
pub struct IbMd {
    name: String,
    dev: Arc<dyn VerbsDevice>,
    report: DeviceReport,
    ports: Vec<PortAttrs>,
    attr: MdAttr,
    host_access: Access,
    gdr: GdrPlan,
    gpu: Arc<dyn GpuSupport>,
    book: Arc<ApertureBook>,
    memlock: Option<u64>,
    ib_cfg: IbConfig,
}

impl IbMd {
    /// Open the domain of device `name`.
    pub fn open(
        verbs: &dyn Verbs,
        name: &str,
        config: &Config,
        gpu: Arc<dyn GpuSupport>,
    ) -> Result<IbMd> {
        let ib_cfg = IbConfig::from_config(config)?;
        let unavailable = |reason: String| Error::Unavailable {
            component: format!("{COMPONENT}/{name}"),
            reason,
        };
        let report = verbs
            .query_device(name)
            .map_err(|e| unavailable(e.to_string()))?;
        let (ok, skipped) = usable_ports(&report, &ib_cfg.devices);
        if ok.is_empty() {
            return Err(unavailable(format!(
                "no usable port: {}",
                skipped.join("; ")
            )));
        }
        let ports: Vec<PortAttrs> = ok.into_iter().cloned().collect();
        let dev = verbs
            .open_device(name)
            .map_err(|e| unavailable(e.to_string()))?;
        let dmabuf = if ib_cfg.gpu_direct == rucx_ucs::Ternary::No {
            DmabufSupport::Unsupported(format!("not probed: RUCX_{}=no", crate::gpudirect::OPTION))
        } else {
            probe_dmabuf(&*dev)
        };
        let nic = NicGdrFacts {
            nic: name.to_string(),
            dmabuf,
            peer_mem: verbs.peer_memory_module(),
            exporter: gpu.can_export_dmabuf(),
        };
        let gdr = decide(ib_cfg.gpu_direct, &nic, &gpu.gpus())?;
        for (o, d) in &gdr.gpus {
            match d.path {
                Some(p) => tracing::debug!("{name}: GPU {o} memory registered through {p}"),
                None => tracing::info!(
                    "{name}: {} memory is not registrable: {}",
                    d.label,
                    d.reasons_text()
                ),
            }
        }
        let mut host_access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        if report.attrs.atomics {
            host_access |= Access::REMOTE_ATOMIC;
        }
        Ok(IbMd {
            name: name.to_string(),
            attr: md_attr(&report.attrs, &gdr),
            dev,
            report,
            ports,
            host_access,
            gdr,
            gpu,
            book: Arc::default(),
            memlock: verbs.memlock_limit(),
            ib_cfg,
        })
    }

    /// The device's report (attributes, ports, GIDs).
    pub fn report(&self) -> &DeviceReport {
        &self.report
    }

    /// The ports this domain offers.
    pub fn ports(&self) -> &[PortAttrs] {
        &self.ports
    }

    /// The GPU-direct decisions.
    pub fn gdr_plan(&self) -> &GdrPlan {
        &self.gdr
    }

    /// The open device.
    pub fn device(&self) -> &Arc<dyn VerbsDevice> {
        &self.dev
    }

    /// Bytes of GPU `gpu`'s memory registered by this domain now.
    pub fn gpu_registered(&self, gpu: u32) -> u64 {
        self.book.used(gpu)
    }

    fn gpu_access(&self) -> Access {
        self.host_access | Access::RELAXED_ORDERING
    }

    fn attempt<'a>(&'a self, region: &'a MemRegion, d: Option<&'a GpuDecision>) -> RegAttempt<'a> {
        RegAttempt {
            domain: &self.name,
            region,
            gpu: d,
            gpu_registered: region.device.map_or(0, |g| self.book.used(g)),
            memlock_limit: self.memlock,
        }
    }

    /// Reserve aperture for a GPU registration, or refuse when the budget is spent.
    fn charge(
        &self,
        region: &MemRegion,
        d: &GpuDecision,
    ) -> std::result::Result<Option<ApertureCharge>, RegError> {
        let (Some(budget), Some(gpu)) = (d.aperture_budget, region.device) else {
            return Ok(None);
        };
        let used_now = {
            let mut m = self.book.used.lock().unwrap_or_else(|p| p.into_inner());
            let used = m.entry(gpu).or_insert(0);
            if used.saturating_add(region.len as u64) <= budget {
                *used += region.len as u64;
                return Ok(Some(ApertureCharge {
                    book: self.book.clone(),
                    gpu,
                    bytes: region.len as u64,
                }));
            }
            *used
        };
        // The book's lock is released: `attempt` reads it again.
        let mut a = self.attempt(region, Some(d));
        a.gpu_registered = used_now;
        Err(over_budget(&a, budget))
    }

    fn handle(
        &self,
        region: MemRegion,
        mr: Option<Box<dyn Mr>>,
        charge: Option<ApertureCharge>,
    ) -> MemHandle {
        let (lkey, rkey) = mr.as_ref().map_or((0, 0), |m| (m.lkey(), m.rkey()));
        MemHandle::new(
            region,
            &self.name,
            Arc::new(IbMemh {
                device: self.name.clone(),
                lkey,
                rkey,
                _mr: mr,
                _charge: charge,
            }),
        )
    }

    /// Register GPU memory given as a dma-buf (for callers that export it themselves).
    ///
    /// # Safety
    /// `region` must describe GPU memory that stays allocated while the handle (or a key made
    /// from it) lives, and `buf` must be a dma-buf of that memory with the range at `buf.offset`.
    pub unsafe fn reg_dmabuf(&self, region: MemRegion, buf: &DmaBuf) -> Result<MemHandle> {
        let d = self.gdr.for_gpu(region.device);
        if d.path.is_none() {
            return Err(Error::registration(refused(
                &self.attempt(&region, Some(d)),
                d,
            )));
        }
        let charge = self.charge(&region, d).map_err(Error::registration)?;
        // SAFETY: forwarded contract: the caller keeps the exported memory allocated.
        let r = unsafe {
            self.dev.reg_dmabuf_mr(
                buf.offset,
                region.len,
                region.addr as u64,
                buf.fd.as_raw_fd(),
                self.gpu_access(),
            )
        };
        match r {
            Ok(mr) => Ok(self.handle(region, Some(mr), charge)),
            Err(e) => {
                drop(charge);
                Err(Error::registration(reg_error(
                    &self.attempt(&region, Some(d)),
                    &e,
                )))
            }
        }
    }

    /// # Safety
    /// As [`MemoryDomain::mem_reg`].
    unsafe fn reg_gpu(&self, region: MemRegion) -> Result<MemHandle> {
        let d = self.gdr.for_gpu(region.device);
        let Some(path) = d.path else {
            return Err(Error::registration(refused(
                &self.attempt(&region, Some(d)),
                d,
            )));
        };
        match path {
            GdrPath::DmaBuf => {
                let buf = self.gpu.export_dmabuf(&region).map_err(|e| match e {
                    Error::Registration(r) => Error::Registration(r),
                    other => Error::registration(RegError {
                        domain: self.name.clone(),
                        mem_type: region.mem_type,
                        device: region.device,
                        addr: region.addr,
                        len: region.len,
                        kind: RegErrorKind::NotExportable,
                        detail: format!("exporting the buffer as dma-buf failed: {other}"),
                        hint: crate::regerr::skip_hint(),
                    }),
                })?;
                // SAFETY: forwarded contract of mem_reg; `buf` was exported for this region.
                unsafe { self.reg_dmabuf(region, &buf) }
            }
            GdrPath::PeerMem => {
                let charge = self.charge(&region, d).map_err(Error::registration)?;
                // SAFETY: forwarded contract of mem_reg: the GPU memory stays allocated.
                let r = unsafe { self.dev.reg_mr(region.addr, region.len, self.gpu_access()) };
                match r {
                    Ok(mr) => Ok(self.handle(region, Some(mr), charge)),
                    Err(e) => {
                        drop(charge);
                        Err(Error::registration(reg_error(
                            &self.attempt(&region, Some(d)),
                            &e,
                        )))
                    }
                }
            }
        }
    }

    /// Open an `rc_verbs` interface on `port` (`mlx5_0:1` or just the port number's device).
    pub fn open_rc_iface(&self, dev_name: &str, config: &Config) -> Result<crate::rc::RcIface> {
        let port = parse_port_name(dev_name)
            .filter(|(d, _)| *d == self.name)
            .and_then(|(_, p)| self.ports.iter().find(|x| x.port_num == p))
            .ok_or_else(|| {
                Error::InvalidParam(format!(
                    "{dev_name} is not a port of memory domain {} (it offers {})",
                    self.name,
                    self.ports
                        .iter()
                        .map(|p| port_name(&self.name, p.port_num))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        let rc = RcConfig::from_config(config)?;
        crate::rc::RcIface::open(self.dev.clone(), &self.report.attrs, port, &self.ib_cfg, rc)
    }
}

impl MemoryDomain for IbMd {
    fn name(&self) -> &str {
        &self.name
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        self.ports
            .iter()
            .map(|p| TlResource {
                tl_name: TL_NAME.into(),
                dev_name: port_name(&self.name, p.port_num),
            })
            .collect()
    }

    fn open_iface(&self, tl: &TlResource, params: &IfaceParams) -> Result<Box<dyn Iface>> {
        if tl.tl_name != TL_NAME {
            return Err(Error::InvalidParam(format!(
                "memory domain {} offers transport {TL_NAME}, not {}",
                self.name, tl.tl_name
            )));
        }
        Ok(Box::new(self.open_rc_iface(&tl.dev_name, params.config)?))
    }

    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        if region.addr.checked_add(region.len).is_none() {
            return Err(Error::InvalidParam(format!(
                "region {:#x}+{} wraps around the address space",
                region.addr, region.len
            )));
        }
        if region.len == 0 {
            return Ok(self.handle(region, None, None));
        }
        if let Some(max) = self.attr.max_reg
            && region.len as u64 > max
        {
            return Err(Error::registration(RegError {
                domain: self.name.clone(),
                mem_type: region.mem_type,
                device: region.device,
                addr: region.addr,
                len: region.len,
                kind: RegErrorKind::Other,
                detail: format!(
                    "{} bytes exceed the device's largest region of {max}",
                    region.len
                ),
                hint: String::new(),
            }));
        }
        match region.mem_type {
            MemoryType::Host | MemoryType::Unknown => {
                // SAFETY: forwarded contract of mem_reg: the memory stays mapped.
                let r = unsafe { self.dev.reg_mr(region.addr, region.len, self.host_access) };
                match r {
                    Ok(mr) => Ok(self.handle(region, Some(mr), None)),
                    Err(e) => Err(Error::registration(reg_error(
                        &self.attempt(&region, None),
                        &e,
                    ))),
                }
            }
            // SAFETY: forwarded contract of mem_reg.
            MemoryType::Cuda => unsafe { self.reg_gpu(region) },
            MemoryType::CudaManaged => Err(Error::registration(RegError {
                domain: self.name.clone(),
                mem_type: region.mem_type,
                device: region.device,
                addr: region.addr,
                len: region.len,
                kind: RegErrorKind::UnsupportedMemoryType,
                detail: format!(
                    "cuda-managed memory is not registrable on {} (it would need on-demand paging)",
                    self.name
                ),
                hint: String::new(),
            })),
        }
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let m = memh.inner::<IbMemh>().ok_or_else(|| {
            Error::InvalidParam(format!(
                "memory handle of domain {} is not an ib registration",
                memh.domain()
            ))
        })?;
        let r = memh.region();
        let mut p = Vec::with_capacity(20);
        p.extend_from_slice(&(r.addr as u64).to_le_bytes());
        p.extend_from_slice(&(r.len as u64).to_le_bytes());
        p.extend_from_slice(&m.rkey.to_le_bytes());
        Ok(rkey::pack(RKEY_TAG, &p))
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let payload = rkey::unpack(RKEY_TAG, "remote key", packed)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: self.name.clone(),
            reason,
        };
        let mut r = Reader::new(payload, "ib remote key");
        let (addr, len, key) = (
            r.u64().map_err(|e| bad(e.to_string()))?,
            r.u64().map_err(|e| bad(e.to_string()))?,
            r.u32().map_err(|e| bad(e.to_string()))?,
        );
        r.finish().map_err(|e| bad(e.to_string()))?;
        if addr.checked_add(len).is_none() {
            return Err(bad(format!("region {addr:#x}+{len} wraps around")));
        }
        Ok(RemoteKey::new(
            &self.name,
            addr,
            len,
            Arc::new(IbRkey { rkey: key }),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeFabric, RegFault, device, ib_port};
    use crate::gpudirect::GpuFacts;
    use proptest::prelude::*;
    use rucx_uct::MemTypeFlags;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    /// Device addresses of the pretend GPU (never dereferenced: the fabric does not touch
    /// memory it registers).
    const GPU_VA: usize = 0x7f72_4fa0_0000;

    #[derive(Debug)]
    struct FakeGpus {
        gpus: Vec<GpuFacts>,
        export: bool,
    }

    impl GpuSupport for FakeGpus {
        fn gpus(&self) -> Vec<GpuFacts> {
            self.gpus.clone()
        }
        fn can_export_dmabuf(&self) -> bool {
            self.export
        }
        fn export_dmabuf(&self, region: &MemRegion) -> Result<DmaBuf> {
            if region.addr == GPU_VA + 0x100_0000 {
                return Err(Error::Device {
                    device: "GPU 0".into(),
                    reason: "cuMemGetHandleForAddressRange: CUDA_ERROR_INVALID_VALUE".into(),
                });
            }
            let f = std::fs::File::open("/dev/null").map_err(|e| Error::io("/dev/null", e))?;
            Ok(DmaBuf {
                fd: f.into(),
                offset: (region.addr - GPU_VA) as u64,
            })
        }
    }

    fn gpu(ordinal: u32, name: &str, mem: u64, bar1: u64, gdr: Option<bool>) -> GpuFacts {
        GpuFacts {
            ordinal,
            name: name.into(),
            memory_bytes: Some(mem),
            bar1_total: Some(bar1),
            bar1_free: Some(bar1),
            gdr_supported: gdr,
            dmabuf_supported: Some(true),
            ..Default::default()
        }
    }

    fn fabric() -> FakeFabric {
        let fab = FakeFabric::new();
        fab.add_device(device("mlx5_0", vec![ib_port(1, 8)]));
        fab
    }

    fn open(
        fab: &FakeFabric,
        vars: &[(&str, &str)],
        gpus: Vec<GpuFacts>,
        export: bool,
    ) -> Result<IbMd> {
        let cfg = Config::from_vars(&[crate::CONFIG], vars.iter().copied()).unwrap();
        IbMd::open(
            &*fab.verbs(),
            "mlx5_0",
            &cfg,
            Arc::new(FakeGpus { gpus, export }),
        )
    }

    fn cuda(addr: usize, len: usize, dev: u32) -> MemRegion {
        MemRegion {
            addr,
            len,
            mem_type: MemoryType::Cuda,
            device: Some(dev),
        }
    }

    fn reg(md: &IbMd, r: MemRegion) -> Result<MemHandle> {
        // SAFETY: the fabric never touches registered memory at registration; host buffers in
        // these tests outlive their handles.
        unsafe { md.mem_reg(r) }
    }

    fn reg_err(r: Result<MemHandle>) -> RegError {
        match r {
            Err(Error::Registration(e)) => *e,
            other => panic!("expected a registration error, got {other:?}"),
        }
    }

    #[test]
    fn host_registration_and_keys() {
        let fab = fabric();
        let md = open(&fab, &[], vec![], false).unwrap();
        assert_eq!(
            md.attr().flags(MemoryType::Host),
            MemTypeFlags::REG | MemTypeFlags::ACCESS
        );
        assert!(
            !md.attr().reg_mem_types().has(MemoryType::Cuda),
            "no GPU route on this host"
        );
        let buf = vec![0u8; 4096];
        let h = reg(&md, MemRegion::of_slice(&buf)).unwrap();
        let m = h.inner::<IbMemh>().unwrap();
        assert_eq!(m.device(), "mlx5_0");
        assert_ne!(m.lkey(), 0);
        let packed = md.mkey_pack(&h).unwrap();
        assert_eq!(packed.len(), RKEY_PACKED_LEN);
        assert_eq!(md.attr().rkey_packed_size, RKEY_PACKED_LEN);
        let rk = md.rkey_unpack(&packed).unwrap();
        assert_eq!((rk.base(), rk.len()), (buf.as_ptr() as u64, 4096));
        assert_eq!(rk.inner::<IbRkey>().unwrap().rkey, m.rkey());
        assert!(md.rkey_unpack(&packed[..packed.len() - 1]).is_err());
        assert_eq!(fab.live_mrs(), 1);
        drop(h);
        assert_eq!(fab.live_mrs(), 0);
        // Zero bytes: a handle without a driver registration.
        let z = reg(&md, MemRegion::host(buf.as_ptr() as usize, 0)).unwrap();
        assert_eq!(z.inner::<IbMemh>().unwrap().lkey(), 0);
        assert_eq!(fab.live_mrs(), 0);
        assert!(reg(&md, MemRegion::host(usize::MAX - 1, 16)).is_err());
    }

    #[test]
    fn host_enomem_names_the_memlock_limit() {
        let fab = fabric();
        fab.fail_reg(RegFault {
            device: None,
            range: 0..usize::MAX,
            call: Some("ibv_reg_mr"),
            errno: libc::ENOMEM,
        });
        let md = open(&fab, &[], vec![], false).unwrap();
        let buf = vec![0u8; 1 << 20];
        let e = reg_err(reg(&md, MemRegion::of_slice(&buf)));
        assert_eq!(e.kind, RegErrorKind::NoMemory);
        assert!(
            e.detail.contains("locked-memory limit 64 KiB") && e.hint.contains("ulimit -l"),
            "{e}"
        );
    }

    /// The seed: a GPU whose GPUDirect support the facts do not rule out, a peer-memory module,
    /// and the driver answering EFAULT. A typed, demotable error with the reasons and the knob.
    #[test]
    fn seed_efault_on_gpu_memory_is_a_typed_bad_address() {
        let fab = fabric();
        fab.set_peer_memory(Some("nvidia_peermem"));
        fab.fail_reg(RegFault {
            device: Some("mlx5_0".into()),
            range: GPU_VA..GPU_VA + (1 << 30),
            call: Some("ibv_reg_mr"),
            errno: libc::EFAULT,
        });
        let g = gpu(0, "NVIDIA GeForce RTX 3080", 10 * GIB, 256 * MIB, None);
        let md = open(&fab, &[], vec![g], false).unwrap();
        assert!(md.attr().reg_mem_types().has(MemoryType::Cuda));
        assert_eq!(md.gdr_plan().for_gpu(Some(0)).path, Some(GdrPath::PeerMem));
        let e = reg_err(reg(&md, cuda(GPU_VA, 4096, 0)));
        assert_eq!(e.kind, RegErrorKind::BadAddress);
        assert_eq!(
            (e.domain.as_str(), e.device, e.len),
            ("mlx5_0", Some(0), 4096)
        );
        assert!(
            e.detail.starts_with(
                "device memory not registrable on mlx5_0 for GPU 0: ibv_reg_mr failed: Bad address"
            ),
            "{}",
            e.detail
        );
        assert!(
            e.detail.contains("peer memory") && e.detail.contains("BAR1 aperture is 256 MiB"),
            "{}",
            e.detail
        );
        assert_eq!(e.hint, "set RUCX_IB_GPU_DIRECT_RDMA=no to skip the attempt");
        assert_eq!(
            md.gpu_registered(0),
            0,
            "the failed attempt holds no aperture"
        );
    }

    #[test]
    fn gpu_without_gdr_is_refused_before_any_attempt() {
        let fab = fabric();
        fab.set_peer_memory(Some("nvidia_peermem"));
        let g = gpu(
            1,
            "NVIDIA GeForce RTX 3080",
            10 * GIB,
            256 * MIB,
            Some(false),
        );
        let md = open(&fab, &[], vec![g], false).unwrap();
        let before = fab.reg_calls();
        let e = reg_err(reg(&md, cuda(GPU_VA, 4096, 1)));
        assert_eq!(e.kind, RegErrorKind::UnsupportedMemoryType);
        assert!(
            e.detail
                .contains("for GPU 1: the CUDA driver reports no GPUDirect RDMA support"),
            "{}",
            e.detail
        );
        assert_eq!(fab.reg_calls(), before, "the driver was not asked");
    }

    #[test]
    fn gpu_direct_no_and_yes() {
        let fab = fabric();
        fab.set_peer_memory(Some("nvidia_peermem"));
        let g = gpu(0, "NVIDIA H200", 141 * GIB, 256 * GIB, Some(true));
        let md = open(
            &fab,
            &[("RUCX_IB_GPU_DIRECT_RDMA", "no")],
            vec![g.clone()],
            true,
        )
        .unwrap();
        assert!(!md.attr().reg_mem_types().has(MemoryType::Cuda));
        let e = reg_err(reg(&md, cuda(GPU_VA, 4096, 0)));
        assert!(
            e.detail.contains("disabled by RUCX_IB_GPU_DIRECT_RDMA=no"),
            "{}",
            e.detail
        );
        assert_eq!(fab.reg_calls(), 0, "not even the dma-buf probe registers");
        // yes: fine with a route; a configuration error without one.
        assert!(
            open(
                &fab,
                &[("RUCX_IB_GPU_DIRECT_RDMA", "yes")],
                vec![g.clone()],
                false
            )
            .is_ok()
        );
        fab.set_peer_memory(None);
        let e = open(&fab, &[("RUCX_IB_GPU_DIRECT_RDMA", "yes")], vec![g], false).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
        assert!(
            e.to_string().contains("GPU 0 (NVIDIA H200) on mlx5_0"),
            "{e}"
        );
    }

    #[test]
    fn dmabuf_route() {
        let fab = fabric();
        fab.set_dmabuf("mlx5_0", true);
        let g = gpu(0, "NVIDIA H200", 141 * GIB, 256 * GIB, Some(true));
        let md = open(&fab, &[], vec![g], true).unwrap();
        assert_eq!(md.gdr_plan().for_gpu(Some(0)).path, Some(GdrPath::DmaBuf));
        assert!(
            md.attr()
                .flags(MemoryType::Cuda)
                .contains(MemTypeFlags::REG | MemTypeFlags::DMABUF)
        );
        let h = reg(&md, cuda(GPU_VA + 8192, 1 << 20, 0)).unwrap();
        assert_ne!(h.inner::<IbMemh>().unwrap().rkey(), 0);
        assert_eq!(fab.live_mrs(), 1);
        // An allocation CUDA cannot export: a typed not-exportable error.
        let e = reg_err(reg(&md, cuda(GPU_VA + 0x100_0000, 4096, 0)));
        assert_eq!(e.kind, RegErrorKind::NotExportable);
        assert!(
            e.detail.contains("CUDA_ERROR_INVALID_VALUE"),
            "{}",
            e.detail
        );
        // Managed memory is not registrable.
        let m = MemRegion {
            mem_type: MemoryType::CudaManaged,
            ..cuda(GPU_VA, 4096, 0)
        };
        assert_eq!(
            reg_err(reg(&md, m)).kind,
            RegErrorKind::UnsupportedMemoryType
        );
    }

    #[test]
    fn small_bar1_budget_is_enforced_and_released() {
        let fab = fabric();
        fab.set_peer_memory(Some("nvidia_peermem"));
        // A workstation GPU with GPUDirect and a 256 MiB BAR1: 224 MiB for registrations.
        let g = gpu(0, "NVIDIA RTX A4000", 16 * GIB, 256 * MIB, Some(true));
        let md = open(&fab, &[], vec![g], false).unwrap();
        assert_eq!(
            md.gdr_plan().for_gpu(Some(0)).aperture_budget,
            Some(224 * MIB)
        );
        let a = reg(&md, cuda(GPU_VA, 200 << 20, 0)).unwrap();
        assert_eq!(md.gpu_registered(0), 200 * MIB);
        let calls = fab.reg_calls();
        let e = reg_err(reg(&md, cuda(GPU_VA + (256 << 20), 32 << 20, 0)));
        assert_eq!(e.kind, RegErrorKind::ApertureExhausted);
        assert!(e.kind.may_recover_by_eviction());
        assert!(
            e.detail.contains("224 MiB") && e.detail.contains("200 MiB is registered"),
            "{}",
            e.detail
        );
        assert_eq!(fab.reg_calls(), calls, "refused before the driver");
        drop(a);
        assert_eq!(md.gpu_registered(0), 0);
        let _b = reg(&md, cuda(GPU_VA + (256 << 20), 32 << 20, 0)).unwrap();
        // The driver running out of BAR1 first is the same kind.
        fab.fail_reg(RegFault {
            device: None,
            range: GPU_VA + (1 << 30)..GPU_VA + (2 << 30),
            call: None,
            errno: libc::ENOMEM,
        });
        let e = reg_err(reg(&md, cuda(GPU_VA + (1 << 30), 4096, 0)));
        assert_eq!(e.kind, RegErrorKind::ApertureExhausted);
        assert_eq!(
            md.gpu_registered(0),
            32 * MIB,
            "the failed attempt released its share"
        );
    }

    #[test]
    fn open_errors_are_unavailable_with_reason() {
        let fab = FakeFabric::new();
        let mut p = ib_port(1, 8);
        p.state = crate::verbs::PortState::Init;
        fab.add_device(device("mlx5_0", vec![p]));
        let e = open(&fab, &[], vec![], false).unwrap_err();
        assert!(e.to_string().contains("mlx5_0:1 is INIT"), "{e}");
        let cfg = Config::new(&[crate::CONFIG]).unwrap();
        let e = IbMd::open(
            &*fab.verbs(),
            "mlx5_9",
            &cfg,
            Arc::new(crate::gpudirect::NoGpus),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    }

    proptest! {
        #[test]
        fn rkey_garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..64)) {
            let fab = fabric();
            let md = open(&fab, &[], vec![], false).unwrap();
            let _ = md.rkey_unpack(&g);
            let _ = md.rkey_unpack(&rucx_uct::rkey::pack(RKEY_TAG, &g));
        }
    }
}
