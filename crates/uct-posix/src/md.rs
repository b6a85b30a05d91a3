//! The posix memory domain.

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use rucx_ucs::{Config, Error, MemoryType, RegError, RegErrorKind, Result};
use rucx_uct::{
    Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion, MemTypeFlags, MemoryDomain,
    RemoteKey, SharedAlloc, TlResource,
};

use crate::addr::{RkeyData, ShmInfo};
use crate::iface::PosixIface;
use crate::sys::{self, SegmentBacking};
use crate::{DEVICE, NAME, Settings, probe_backing};

/// A posix registration: nothing is pinned or mapped, the handle only records the region
/// (cross-memory attach resolves pages at transfer time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosixMemh;

/// Memory from [`PosixMd::mem_alloc_shared`]: a shared segment mapped here, which peers on this
/// host map through `/proc/<pid>/fd/<fd>`.
#[derive(Debug)]
pub struct PosixShared {
    map: memmap2::MmapMut,
    file: File,
    tag: u64,
}

/// FNV-1a 64 of what `/proc/<pid>/fd/<fd>` points to (the segment's unique name).
fn fd_link_tag(pid: u32, fd: u32) -> std::io::Result<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in link.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    Ok(h)
}

/// The posix memory domain.
#[derive(Debug)]
pub struct PosixMd {
    attr: MdAttr,
    backing: SegmentBacking,
    cma: Result<(), String>,
    /// Peers' shared segments mapped here, by (pid, process token, descriptor).
    peer_maps: Mutex<HashMap<(u32, u64, u32), memmap2::MmapMut>>,
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
        Ok(PosixMd {
            attr,
            backing,
            cma,
            peer_maps: Mutex::new(HashMap::new()),
        })
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
        if let Some(sh) = memh.inner::<PosixShared>() {
            let r = memh.region();
            return Ok(RkeyData {
                pid: sys::my_pid(),
                token: sys::process_token(),
                base: r.addr as u64,
                len: r.len as u64,
                shm: None,
            }
            .pack_shared(ShmInfo {
                fd: sys::raw_fd(&sh.file) as u32,
                seg_base: sh.map.as_ptr() as u64,
                seg_len: sh.map.len() as u64,
                tag: sh.tag,
            }));
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
            shm: None,
        }
        .pack())
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let k = match RkeyData::unpack(packed) {
            Ok(k) => k,
            Err(plain) => RkeyData::unpack_shared(packed).map_err(|_| plain)?,
        };
        Ok(RemoteKey::new(NAME, k.base, k.len, Arc::new(k)))
    }

    fn mem_alloc_shared(&self, len: usize) -> Result<Option<SharedAlloc>> {
        if self.cma.is_err() || len == 0 {
            return Ok(None);
        }
        let file = sys::create_shared_file(self.backing, len as u64)?;
        // SAFETY: the file was just created by us with exactly `len` bytes and its size is sealed
        // (memfd) or owned by us alone (shm, unlinked), so the mapping cannot be truncated under us.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file) }
            .map_err(|e| Error::io(format!("posix: mapping a {len}-byte shared segment"), e))?;
        let addr = map.as_ptr() as usize;
        let tag = fd_link_tag(sys::my_pid(), sys::raw_fd(&file) as u32)
            .map_err(|e| Error::io("posix: naming a shared segment", e))?;
        let memh = MemHandle::new(
            MemRegion::host(addr, len),
            NAME,
            Arc::new(PosixShared { map, file, tag }),
        );
        Ok(Some(SharedAlloc { addr, len, memh }))
    }

    fn rkey_ptr(&self, rkey: &RemoteKey) -> Result<Option<usize>> {
        let Some(k) = rkey.inner::<RkeyData>() else {
            return Ok(None);
        };
        let Some(shm) = k.shm else {
            return Ok(None);
        };
        if k.pid == sys::my_pid() && k.token == sys::process_token() {
            return Ok(Some(k.base as usize));
        }
        let mut maps = self.peer_maps.lock().unwrap_or_else(|p| p.into_inner());
        let key = (k.pid, k.token, shm.fd);
        if let std::collections::hash_map::Entry::Vacant(e) = maps.entry(key) {
            let file = sys::open_peer_fd(k.pid, shm.fd).map_err(|e| Error::EndpointFailure {
                peer: format!("posix process {}", k.pid),
                reason: format!(
                    "cannot open its shared segment (descriptor {}): {e}",
                    shm.fd
                ),
            })?;
            // The descriptor must still be the segment the key was made for.
            if fd_link_tag(k.pid, shm.fd).unwrap_or(0) != shm.tag {
                return Err(Error::InvalidRkey {
                    domain: NAME.into(),
                    reason: format!(
                        "descriptor {} of process {} is no longer the shared segment of this key",
                        shm.fd, k.pid
                    ),
                });
            }
            let size = file.metadata().map(|m| m.len()).unwrap_or(0);
            if size < shm.seg_len {
                return Err(Error::InvalidRkey {
                    domain: NAME.into(),
                    reason: format!(
                        "segment of process {} has {size} bytes, the key says {}",
                        k.pid, shm.seg_len
                    ),
                });
            }
            // SAFETY: the peer's segment is at least `seg_len` bytes (checked above) and its
            // size is sealed (memfd) so it cannot shrink under the mapping; we only read and
            // write it through addresses validated against the key.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .len(shm.seg_len as usize)
                    .map_mut(&file)
            }
            .map_err(|e| {
                Error::io(
                    format!("posix: mapping the segment of process {}", k.pid),
                    e,
                )
            })?;
            e.insert(map);
        }
        let map = &maps[&key];
        Ok(Some(
            map.as_ptr() as usize + (k.base - shm.seg_base) as usize,
        ))
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
    fn shared_allocation_maps_through_its_key() {
        let m = md();
        if !m.cma_enabled() {
            return;
        }
        let a = m
            .mem_alloc_shared(8192)
            .unwrap()
            .expect("posix shares memory");
        let packed = m.mkey_pack(&a.memh).unwrap();
        let k = m.rkey_unpack(&packed).unwrap();
        assert_eq!((k.base(), k.len()), (a.addr as u64, 8192));
        // Our own key maps to our own address.
        assert_eq!(m.rkey_ptr(&k).unwrap(), Some(a.addr));
        // A key of ordinary memory cannot be mapped.
        let buf = vec![0u8; 64];
        // SAFETY: `buf` outlives the handle.
        let h = unsafe { m.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
        let plain = m.rkey_unpack(&m.mkey_pack(&h).unwrap()).unwrap();
        assert_eq!(m.rkey_ptr(&plain).unwrap(), None);
        // Truncated or corrupted shared keys are refused.
        assert!(m.rkey_unpack(&packed[..packed.len() - 2]).is_err());
        let mut bad = packed.clone();
        let n = bad.len();
        bad[n / 2] ^= 1;
        assert!(m.rkey_unpack(&bad).is_err());
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
