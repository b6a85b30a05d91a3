//! The posix memory domain.

use std::sync::Arc;

use rucx_ucs::{Config, Error, MemoryType, RegError, RegErrorKind, Result};
use rucx_uct::{
    Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion, MemTypeFlags, MemoryDomain,
    RemoteKey, TlResource,
};

use crate::addr::RkeyData;
use crate::iface::PosixIface;
use crate::sys::{self, SegmentBacking};
use crate::{DEVICE, NAME, Settings, probe_backing};

/// A posix registration: nothing is pinned or mapped, the handle only records the region
/// (cross-memory attach resolves pages at transfer time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosixMemh;

/// The posix memory domain.
#[derive(Debug)]
pub struct PosixMd {
    attr: MdAttr,
    backing: SegmentBacking,
    cma: Result<(), String>,
}

/// Decide whether cross-memory attach can work from and into this process.
fn cma_permission(allow_ptracer: bool) -> Result<(), String> {
    match sys::ptrace_scope() {
        None | Some(0) => Ok(()),
        Some(1) => {
            if allow_ptracer {
                sys::allow_any_ptracer()
                    .map_err(|e| format!("Yama ptrace_scope=1 and PR_SET_PTRACER_ANY failed: {e}"))
            } else if sys::has_cap_sys_ptrace() {
                Ok(())
            } else {
                Err("Yama ptrace_scope=1 and RUCX_POSIX_ALLOW_PTRACER=n".into())
            }
        }
        Some(2) if sys::has_cap_sys_ptrace() => Ok(()),
        Some(s) => Err(format!(
            "Yama ptrace_scope={s} forbids attaching to peers (needs CAP_SYS_PTRACE for 2, \
             impossible for 3)"
        )),
    }
}

impl PosixMd {
    /// Open the domain.
    pub fn open(config: &Config) -> Result<PosixMd> {
        let settings = Settings::from_config(config)?;
        let backing = probe_backing(settings.segment).map_err(|reason| Error::Unavailable {
            component: NAME.into(),
            reason,
        })?;
        let cma = cma_permission(settings.allow_ptracer);
        if let Err(why) = &cma {
            tracing::info!("posix: put/get through cross-memory attach disabled: {why}");
        }
        let mut attr =
            MdAttr::new(NAME).with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS);
        // Registration only records the region.
        attr.reg_cost = LinearCost::fixed(20.0);
        attr.max_reg = None;
        attr.rkey_packed_size = if cma.is_ok() {
            RkeyData::PACKED_SIZE
        } else {
            0
        };
        attr.need_memh_for_zcopy = true;
        Ok(PosixMd { attr, backing, cma })
    }

    /// How receive segments are created.
    pub fn backing(&self) -> SegmentBacking {
        self.backing
    }

    /// Whether put/get through cross-memory attach are offered.
    pub fn cma_enabled(&self) -> bool {
        self.cma.is_ok()
    }
}

impl MemoryDomain for PosixMd {
    fn name(&self) -> &str {
        NAME
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        vec![TlResource {
            tl_name: NAME.into(),
            dev_name: DEVICE.into(),
        }]
    }

    fn open_iface(&self, tl: &TlResource, params: &IfaceParams) -> Result<Box<dyn Iface>> {
        if tl.tl_name != NAME || tl.dev_name != DEVICE {
            return Err(Error::InvalidParam(format!(
                "memory domain posix offers transport posix on device memory, not {} on {}",
                tl.tl_name, tl.dev_name
            )));
        }
        let settings = Settings::from_config(params.config)?;
        Ok(Box::new(PosixIface::open(
            &settings,
            self.backing,
            self.cma.is_ok(),
        )?))
    }

    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        let fail = |kind: RegErrorKind, detail: String, hint: &str| {
            Error::registration(RegError {
                domain: NAME.into(),
                mem_type: region.mem_type,
                device: region.device,
                addr: region.addr,
                len: region.len,
                kind,
                detail,
                hint: hint.into(),
            })
        };
        if region.mem_type != MemoryType::Host {
            return Err(fail(
                RegErrorKind::UnsupportedMemoryType,
                "posix registers host memory only".into(),
                "stage GPU buffers through host memory or use a cuda transport",
            ));
        }
        if region.addr.checked_add(region.len).is_none() || (region.addr == 0 && region.len > 0) {
            return Err(fail(
                RegErrorKind::BadAddress,
                "the region is not a valid address range".into(),
                "",
            ));
        }
        Ok(MemHandle::new(region, NAME, Arc::new(PosixMemh)))
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        if let Err(why) = &self.cma {
            return Err(Error::Unsupported {
                what: "posix remote keys (put/get through cross-memory attach)".into(),
                why: why.clone(),
            });
        }
        if memh.inner::<PosixMemh>().is_none() {
            return Err(Error::InvalidParam(format!(
                "memory handle of domain {} given to domain posix",
                memh.domain()
            )));
        }
        let r = memh.region();
        Ok(RkeyData {
            pid: sys::my_pid(),
            token: sys::process_token(),
            base: r.addr as u64,
            len: r.len as u64,
        }
        .pack())
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let k = RkeyData::unpack(packed)?;
        Ok(RemoteKey::new(NAME, k.base, k.len, Arc::new(k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md() -> PosixMd {
        PosixMd::open(&Config::new(&[crate::CONFIG]).unwrap()).unwrap()
    }

    #[test]
    fn attributes() {
        let m = md();
        let a = m.attr();
        assert_eq!(
            a.flags(MemoryType::Host),
            MemTypeFlags::REG | MemTypeFlags::ACCESS
        );
        assert_eq!(a.flags(MemoryType::Cuda), MemTypeFlags::empty());
        assert_eq!(m.tl_resources().len(), 1);
        if m.cma_enabled() {
            assert_eq!(a.rkey_packed_size, RkeyData::PACKED_SIZE);
        }
    }

    #[test]
    fn register_pack_unpack() {
        let m = md();
        let buf = vec![0u8; 100];
        // SAFETY: `buf` outlives the handle.
        let h = unsafe { m.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
        let packed = m.mkey_pack(&h).unwrap();
        assert_eq!(packed.len(), m.attr().rkey_packed_size);
        let k = m.rkey_unpack(&packed).unwrap();
        assert_eq!((k.base(), k.len()), (buf.as_ptr() as u64, 100));
        assert!(k.check(k.base() + 99, 1).is_ok());
        assert!(k.check(k.base() + 99, 2).is_err());
        let d = k.inner::<RkeyData>().unwrap();
        assert_eq!((d.pid, d.token), (sys::my_pid(), sys::process_token()));
        for bad in [&packed[..packed.len() - 1], &[][..], &[0xffu8; 45][..]] {
            assert!(m.rkey_unpack(bad).is_err());
        }
    }

    #[test]
    fn gpu_memory_is_refused_with_a_kind() {
        let m = md();
        let mut r = MemRegion::host(0x1000, 64);
        r.mem_type = MemoryType::Cuda;
        r.device = Some(0);
        // SAFETY: refused before the memory would be used.
        let e = unsafe { m.mem_reg(r) }.unwrap_err();
        let reg = e.as_registration().expect("a registration error");
        assert_eq!(reg.kind, RegErrorKind::UnsupportedMemoryType);
        assert_eq!(reg.domain, "posix");
    }
}
