//! The tcp memory domain: registrations, remote keys and the table of live registrations that
//! remote accesses are checked against.
//!
//! A remote key carries `md_id` (random per domain instance), `reg_id` (per registration),
//! `base` and `len`, inside the common [`rucx_uct::rkey`] envelope. A peer's put or get
//! names `md_id`, `reg_id` and a range; the receiving interface serves it only when that
//! registration is still live in this domain and covers the whole range, and it touches the
//! memory while holding the table's read lock, so a registration cannot be dropped (and its
//! memory freed) in the middle of a copy.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use rucx_ucs::{Error, MemoryType, RegError, RegErrorKind, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion, MemTypeFlags, MemoryDomain, RemoteKey,
    TlResource,
};

use crate::addr::{self, NetIf};
use crate::{COMPONENT, TcpOptions};

/// Packed remote key size: envelope around four `u64`s.
pub const RKEY_PACKED_SIZE: usize = 12 + COMPONENT.len() + 32;

/// The live registrations of one domain.
#[derive(Debug)]
pub(crate) struct RegTable {
    md_id: u64,
    next: AtomicU64,
    live: RwLock<HashMap<u64, (usize, usize)>>,
}

/// Why a remote access was refused.
pub(crate) type Denied = String;

impl RegTable {
    pub(crate) fn new() -> Self {
        RegTable {
            md_id: random_u64(),
            next: AtomicU64::new(1),
            live: RwLock::new(HashMap::new()),
        }
    }

    fn insert(&self, addr: usize, len: usize) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.live
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (addr, len));
        id
    }

    fn remove(&self, id: u64) {
        self.live
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }

    /// Number of live registrations.
    pub(crate) fn live_count(&self) -> usize {
        self.live.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Run `f` on the address of `[addr, addr+len)` if registration `reg_id` of this domain is
    /// live and covers it; the registration cannot go away while `f` runs.
    fn with_range<R>(
        &self,
        md_id: u64,
        reg_id: u64,
        addr: u64,
        len: u64,
        f: impl FnOnce(usize) -> R,
    ) -> Result<R, Denied> {
        if md_id != self.md_id {
            return Err(format!(
                "key of another memory domain instance (md id {md_id:#x}, this one is {:#x})",
                self.md_id
            ));
        }
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        let Some(&(base, rlen)) = live.get(&reg_id) else {
            return Err(format!(
                "registration {reg_id} is not live (deregistered, or never existed)"
            ));
        };
        let region = MemRegion::host(base, rlen);
        let (Ok(a), Ok(l)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(format!(
                "access {addr:#x}+{len} does not fit this host's address space"
            ));
        };
        if !region.contains(a, l) {
            return Err(format!(
                "access {addr:#x}+{len} is outside registration {reg_id} ({base:#x}+{rlen})"
            ));
        }
        Ok(f(a))
    }

    /// Copy `data` to `[addr, addr+data.len())` of a live registration.
    pub(crate) fn write(
        &self,
        md_id: u64,
        reg_id: u64,
        addr: u64,
        data: &[u8],
    ) -> Result<(), Denied> {
        self.with_range(md_id, reg_id, addr, data.len() as u64, |a| {
            // SAFETY: `with_range` checked that the range lies inside a live host registration
            // and holds the table's read lock, so the registration's MemHandle cannot be
            // dropped (which takes the write lock) until we are done; by `mem_reg`'s contract
            // the memory stays allocated and writable while the registration lives. `data`
            // is the receive buffer, which cannot overlap user registrations.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), a as *mut u8, data.len()) };
        })
    }

    /// Whether `[addr, addr+len)` lies inside live registration `reg_id` of this domain.
    pub(crate) fn check(&self, md_id: u64, reg_id: u64, addr: u64, len: u64) -> Result<(), Denied> {
        self.with_range(md_id, reg_id, addr, len, |_| ())
    }

    /// Run `f` with the address of `[addr, addr+len)` of a live registration, which `f` may
    /// write through (`len` bytes at most); the registration cannot go away while `f` runs.
    pub(crate) fn write_with<R>(
        &self,
        md_id: u64,
        reg_id: u64,
        addr: u64,
        len: usize,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Result<R, Denied> {
        self.with_range(md_id, reg_id, addr, len as u64, |a| f(a as *mut u8))
    }

    /// Copy `[addr, addr+len)` of a live registration into `out` (appended).
    pub(crate) fn read_into(
        &self,
        md_id: u64,
        reg_id: u64,
        addr: u64,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), Denied> {
        self.with_range(md_id, reg_id, addr, len as u64, |a| {
            // SAFETY: as in `write`: the range is inside a live registration whose memory stays
            // allocated and readable while we hold the read lock.
            let src = unsafe { std::slice::from_raw_parts(a as *const u8, len) };
            out.extend_from_slice(src);
        })
    }
}

/// A random 64-bit value (std's per-process random hash keys, mixed with pid and time).
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish()
}

/// The domain-specific part of a tcp [`MemHandle`]; removes the registration from the table
/// when the last handle clone goes.
#[derive(Debug)]
pub(crate) struct TcpReg {
    pub(crate) id: u64,
    pub(crate) table: Arc<RegTable>,
}

impl Drop for TcpReg {
    fn drop(&mut self) {
        self.table.remove(self.id);
    }
}

/// The domain-specific part of a tcp [`RemoteKey`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TcpRkey {
    pub(crate) md_id: u64,
    pub(crate) reg_id: u64,
}

/// The tcp memory domain.
#[derive(Debug)]
pub struct TcpMd {
    attr: MdAttr,
    table: Arc<RegTable>,
    devices: Vec<NetIf>,
    options: TcpOptions,
}

impl TcpMd {
    /// Open the domain over these devices.
    pub fn new(devices: Vec<NetIf>, options: TcpOptions) -> Self {
        let attr = MdAttr {
            reg_cost: LinearCost::fixed(100.0),
            rkey_packed_size: RKEY_PACKED_SIZE,
            need_memh_for_zcopy: true,
            ..MdAttr::new(COMPONENT)
        }
        .with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS);
        TcpMd {
            attr,
            table: Arc::new(RegTable::new()),
            devices,
            options,
        }
    }

    /// The table remote accesses are checked against (for the interface's tests).
    #[cfg(test)]
    pub(crate) fn table(&self) -> Arc<RegTable> {
        self.table.clone()
    }

    /// Live registrations (for tests and diagnostics).
    pub fn live_registrations(&self) -> usize {
        self.table.live_count()
    }

    /// The devices this domain offers.
    pub fn devices(&self) -> &[NetIf] {
        &self.devices
    }
}

impl MemoryDomain for TcpMd {
    fn name(&self) -> &str {
        COMPONENT
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        self.devices
            .iter()
            .map(|d| TlResource {
                tl_name: crate::TL_NAME.to_string(),
                dev_name: d.name.clone(),
            })
            .collect()
    }

    fn open_iface(
        &self,
        tl: &TlResource,
        params: &IfaceParams,
    ) -> Result<Box<dyn rucx_uct::Iface>> {
        if tl.tl_name != crate::TL_NAME {
            return Err(Error::InvalidParam(format!(
                "memory domain tcp has no transport {:?} (it offers \"tcp\")",
                tl.tl_name
            )));
        }
        let dev = self
            .devices
            .iter()
            .find(|d| d.name == tl.dev_name)
            .ok_or_else(|| {
                Error::InvalidParam(format!(
                    "tcp has no device {:?}; devices: {}",
                    tl.dev_name,
                    self.devices
                        .iter()
                        .map(|d| d.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        // Options may be overridden per interface through the parameters' configuration.
        let options = if params.config.has("TCP_PORT_RANGE") {
            TcpOptions::from_config(params.config)?
        } else {
            self.options.clone()
        };
        let iface = crate::iface::TcpIface::open(
            dev.clone(),
            addr::host_id(),
            self.table.clone(),
            options,
        )?;
        Ok(Box::new(iface))
    }

    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        let fail = |kind: RegErrorKind, detail: String| {
            Error::registration(RegError {
                domain: COMPONENT.into(),
                mem_type: region.mem_type,
                device: region.device,
                addr: region.addr,
                len: region.len,
                kind,
                detail,
                hint: String::new(),
            })
        };
        if region.mem_type != MemoryType::Host {
            return Err(fail(
                RegErrorKind::UnsupportedMemoryType,
                "tcp sends and receives with the CPU, so it registers host memory only".into(),
            ));
        }
        // An empty region is registered like any other (as posix does): its key packs and
        // unpacks, a zero-byte access at its base is served, and any byte is out of bounds.
        // An empty `Vec`'s pointer dangles just above 0, so only a nonempty region at 0 is
        // refused as null.
        if region.addr.checked_add(region.len).is_none() || (region.addr == 0 && region.len > 0) {
            return Err(Error::InvalidParam(format!(
                "cannot register {:#x}+{} with tcp: null or wrapping region",
                region.addr, region.len
            )));
        }
        let id = self.table.insert(region.addr, region.len);
        let inner = TcpReg {
            id,
            table: self.table.clone(),
        };
        Ok(MemHandle::new(region, COMPONENT, Arc::new(inner)))
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let reg = memh.inner::<TcpReg>().ok_or_else(|| {
            Error::InvalidParam(format!(
                "memory handle of domain {} cannot be packed by tcp",
                memh.domain()
            ))
        })?;
        if !Arc::ptr_eq(&reg.table, &self.table) {
            return Err(Error::InvalidParam(
                "memory handle was registered with another tcp domain instance".into(),
            ));
        }
        let r = memh.region();
        let mut payload = Vec::with_capacity(32);
        for w in [self.table.md_id, reg.id, r.addr as u64, r.len as u64] {
            payload.extend_from_slice(&w.to_le_bytes());
        }
        Ok(rkey::pack(COMPONENT, &payload))
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let payload = rkey::unpack(COMPONENT, "tcp rkey", packed)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: COMPONENT.into(),
            reason,
        };
        let mut r = Reader::new(payload, "tcp rkey");
        let parsed = (|| -> Result<[u64; 4]> {
            let v = [r.u64()?, r.u64()?, r.u64()?, r.u64()?];
            Ok(v)
        })()
        .map_err(|e| bad(e.to_string()))?;
        r.finish().map_err(|e| bad(e.to_string()))?;
        let [md_id, reg_id, base, len] = parsed;
        // Empty regions are keyed like any other (see `mem_reg`).
        if base.checked_add(len).is_none() || (base == 0 && len > 0) {
            return Err(bad(format!("region {base:#x}+{len} is null or wraps")));
        }
        if reg_id == 0 {
            return Err(bad("registration id 0 is never issued".into()));
        }
        Ok(RemoteKey::new(
            COMPONENT,
            base,
            len,
            Arc::new(TcpRkey { md_id, reg_id }),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn md() -> TcpMd {
        TcpMd::new(addr::interfaces().unwrap(), TcpOptions::default())
    }

    #[test]
    fn registration_table_follows_handles() {
        let md = md();
        let buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives every handle and key made here.
        let h = unsafe { md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
        let h2 = h.clone();
        assert_eq!(md.live_registrations(), 1);
        drop(h);
        assert_eq!(md.live_registrations(), 1, "a clone keeps it registered");
        drop(h2);
        assert_eq!(md.live_registrations(), 0);
    }

    #[test]
    fn rkey_round_trip_and_range_checks() {
        let md = md();
        let mut buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives every handle and key made here.
        let h = unsafe { md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
        let packed = md.mkey_pack(&h).unwrap();
        assert_eq!(packed.len(), RKEY_PACKED_SIZE);
        let rk = md.rkey_unpack(&packed).unwrap();
        assert_eq!(rk.base(), buf.as_ptr() as u64);
        assert_eq!(rk.len(), 4096);
        let k = *rk.inner::<TcpRkey>().unwrap();
        let base = rk.base();

        // In range: written.
        md.table
            .write(k.md_id, k.reg_id, base + 10, b"xyz")
            .unwrap();
        // Past the end, before the start, wrapping, wrong md, unknown registration: refused.
        assert!(
            md.table
                .write(k.md_id, k.reg_id, base + 4094, b"xyz")
                .is_err()
        );
        assert!(md.table.write(k.md_id, k.reg_id, base - 1, b"x").is_err());
        assert!(md.table.write(k.md_id, k.reg_id, u64::MAX, b"x").is_err());
        assert!(md.table.write(k.md_id ^ 1, k.reg_id, base, b"x").is_err());
        assert!(md.table.write(k.md_id, k.reg_id + 1, base, b"x").is_err());
        let mut out = Vec::new();
        md.table
            .read_into(k.md_id, k.reg_id, base + 9, 5, &mut out)
            .unwrap();
        assert_eq!(out, b"\0xyz\0");
        assert!(
            md.table
                .read_into(k.md_id, k.reg_id, base, 4097, &mut out)
                .is_err()
        );
        drop(h);
        // Deregistered: refused, memory untouched.
        let e = md.table.write(k.md_id, k.reg_id, base, b"Q").unwrap_err();
        assert!(e.contains("not live"), "{e}");
        buf[0] = 1;
        assert_eq!(buf[0], 1);
    }

    #[test]
    fn host_only() {
        let md = md();
        let r = MemRegion {
            mem_type: MemoryType::Cuda,
            device: Some(0),
            ..MemRegion::host(0x1000, 4096)
        };
        // SAFETY: the call fails before touching the (fake) region.
        let e = unsafe { md.mem_reg(r) }.unwrap_err();
        assert_eq!(
            e.as_registration().unwrap().kind,
            RegErrorKind::UnsupportedMemoryType
        );
        // SAFETY: rejected before use.
        assert!(unsafe { md.mem_reg(MemRegion::host(0, 64)) }.is_err());
        // SAFETY: rejected before use.
        assert!(unsafe { md.mem_reg(MemRegion::host(usize::MAX - 10, 64)) }.is_err());
    }

    /// An empty region (an empty `Vec`, whose pointer dangles just above 0) registers, its
    /// key packs and unpacks, a zero-byte access at its base is served, and any byte through
    /// it is refused as outside the registration, by the key and by the table.
    #[test]
    fn an_empty_region_registers_and_refuses_every_byte() {
        let md = md();
        let mut empty: Vec<u8> = Vec::new();
        let r = MemRegion::of_slice(&empty);
        assert_eq!(r.len, 0);
        // SAFETY: zero bytes; nothing is read or written through the handle.
        let h = unsafe { md.mem_reg(r) }.unwrap();
        assert_eq!(md.live_registrations(), 1);
        let packed = md.mkey_pack(&h).unwrap();
        assert_eq!(packed.len(), RKEY_PACKED_SIZE);
        let rk = md.rkey_unpack(&packed).unwrap();
        assert_eq!((rk.base(), rk.len()), (r.addr as u64, 0));
        let k = *rk.inner::<TcpRkey>().unwrap();
        let base = rk.base();
        rk.check(base, 0).unwrap();
        assert!(rk.check(base, 1).is_err());
        md.table.write(k.md_id, k.reg_id, base, b"").unwrap();
        let mut out = Vec::new();
        md.table
            .read_into(k.md_id, k.reg_id, base, 0, &mut out)
            .unwrap();
        assert!(out.is_empty());
        let e = md.table.write(k.md_id, k.reg_id, base, b"x").unwrap_err();
        assert!(e.contains("outside registration"), "{e}");
        assert!(
            md.table
                .read_into(k.md_id, k.reg_id, base, 1, &mut out)
                .is_err()
        );
        assert!(md.table.write(k.md_id, k.reg_id, base + 1, b"").is_err());
        assert!(out.is_empty());
        drop(h);
        assert_eq!(md.live_registrations(), 0);
        empty.push(1);
        assert_eq!(empty, [1]);
    }

    #[test]
    fn foreign_handles_are_refused() {
        let a = md();
        let b = md();
        let buf = vec![0u8; 64];
        // SAFETY: `buf` outlives the handle.
        let h = unsafe { a.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
        assert!(b.mkey_pack(&h).is_err());
        let other = MemHandle::new(MemRegion::of_slice(&buf), "self", Arc::new(()));
        assert!(a.mkey_pack(&other).is_err());
    }

    #[test]
    fn rkey_garbage() {
        let md = md();
        assert!(md.rkey_unpack(&[]).is_err());
        assert!(md.rkey_unpack(&rkey::pack("posix", &[0; 32])).is_err());
        assert!(md.rkey_unpack(&rkey::pack(COMPONENT, &[0; 31])).is_err());
        assert!(md.rkey_unpack(&rkey::pack(COMPONENT, &[0; 33])).is_err());
        let mut p = Vec::new();
        for w in [1u64, 1, u64::MAX - 10, 100] {
            p.extend_from_slice(&w.to_le_bytes());
        }
        assert!(
            md.rkey_unpack(&rkey::pack(COMPONENT, &p)).is_err(),
            "wrapping region"
        );
        let mut p = Vec::new();
        for w in [1u64, 1, 0, 100] {
            p.extend_from_slice(&w.to_le_bytes());
        }
        assert!(
            md.rkey_unpack(&rkey::pack(COMPONENT, &p)).is_err(),
            "null region"
        );
    }

    proptest! {
        #[test]
        fn rkey_garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..80)) {
            let md = md();
            let _ = md.rkey_unpack(&g);
            let _ = md.rkey_unpack(&rkey::pack(COMPONENT, &g));
        }
    }
}
