//! The posix memory domain.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rucx_ucs::{Config, Error, MemoryType, RegError, RegErrorKind, Result};
use rucx_uct::{
    Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion, MemTypeFlags, MemoryDomain,
    RemoteKey, SharedAlloc, TlResource,
};

use crate::addr::{RkeyData, ShmInfo};
use crate::iface::PosixIface;
use crate::mapped::{self, fd_link_tag};
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

/// A registration inside a shared allocation (and the allocation's own handle): the segment,
/// kept mapped while the handle lives, and the handle's key, packed on its first use. The
/// region, the segment and this process's id and token stay as they are for the handle's
/// life, so the key does too; a rendezvous packs the key of the same cached registration
/// for every message.
#[derive(Debug)]
struct SharedReg {
    seg: Arc<PosixShared>,
    packed: OnceLock<Vec<u8>>,
}

impl SharedReg {
    fn new(seg: Arc<PosixShared>) -> Arc<Self> {
        Arc::new(SharedReg {
            seg,
            packed: OnceLock::new(),
        })
    }
}

/// The posix memory domain.
#[derive(Debug)]
pub struct PosixMd {
    attr: MdAttr,
    backing: SegmentBacking,
    cma: Result<(), String>,
    /// Peers' shared segments mapped here, by (pid, process token, descriptor).
    /// Live shared allocations of this domain by start address: a region registered inside
    /// one gets a key that peers map (see [`crate::mapped`]).
    shared: Mutex<BTreeMap<usize, Weak<PosixShared>>>,
    /// This process's id (packed into every key; `getpid` is a system call).
    pid: u32,
    /// Keys unpacked lately, with what they unpacked to, in [`UNPACKED_SLOTS`] slots (sets of
    /// [`UNPACKED_WAYS`] chosen by a hash of the bytes). Unpacking is a pure function of the bytes (no mapping is made until
    /// an access), and a peer that sends from one buffer, or receives into a few, sends the
    /// same keys with every rendezvous: an equal key is answered from its slot, without parsing
    /// it again or the four allocations of a fresh [`RemoteKey`] (about a tenth of either
    /// side's own work per 64 KiB message).
    unpacked: Mutex<KeyCache>,
}

/// A key's bytes, what they unpacked to, the bytes' hash and the tick of its last use.
type Unpacked = (Vec<u8>, RemoteKey, u64, u64);

/// [`PosixMd`]'s remembered remote keys.
#[derive(Debug)]
struct KeyCache {
    /// [`UNPACKED_SETS`] sets of [`UNPACKED_WAYS`] slots, a set chosen by the bytes' hash.
    slots: Vec<Option<Unpacked>>,
    /// Counts lookups: the least recently used way of a set is replaced.
    tick: u64,
}

/// Sets of remembered keys. With one slot per hash, two of the perftest's 16 receive buffers'
/// keys (which differ in an address byte and a checksum) shared a slot and were unpacked
/// afresh every time round: 387 of 402 fresh unpacks in a 64 KiB `tag_bw` run of 3100
/// messages, about 700 instructions each.
const UNPACKED_SETS: usize = 64;
/// Ways per set: a set overflows only when five of the keys in use hash to it.
const UNPACKED_WAYS: usize = 4;
/// Keys remembered at most.
const UNPACKED_SLOTS: usize = UNPACKED_SETS * UNPACKED_WAYS;

/// A hash of a packed key: a multiplicative hash of its words (keys of one process differ in
/// the region's address and length, and the checksum), then a finalizer that spreads every
/// bit over the top ones.
fn key_hash(packed: &[u8]) -> u64 {
    let mut h = packed.len() as u64;
    for w in packed.chunks(8) {
        let mut b = [0u8; 8];
        b[..w.len()].copy_from_slice(w);
        h = (h ^ u64::from_le_bytes(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The first slot of the set of a key of hash `h`.
fn key_set(h: u64) -> usize {
    const _: () = assert!(UNPACKED_SETS == 64);
    (h >> 58) as usize * UNPACKED_WAYS
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
            shared: Mutex::new(BTreeMap::new()),
            pid: sys::my_pid(),
            unpacked: Mutex::new(KeyCache {
                slots: vec![None; UNPACKED_SLOTS],
                tick: 0,
            }),
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
        if let Some(sh) = self.shared_holding(region.addr, region.len) {
            // Inside one of our shared allocations: the handle keeps the segment mapped while
            // it lives, and its key lets peers map the segment (a plain copy, no system call).
            return Ok(MemHandle::new(region, NAME, SharedReg::new(sh)));
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
        if let Some(reg) = memh.inner::<SharedReg>() {
            let packed = reg.packed.get_or_init(|| {
                let (r, sh) = (memh.region(), &reg.seg);
                RkeyData {
                    pid: self.pid,
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
                })
            });
            return Ok(packed.clone());
        }
        if memh.inner::<PosixMemh>().is_none() {
            return Err(Error::InvalidParam(format!(
                "memory handle of domain {} given to domain posix",
                memh.domain()
            )));
        }
        let r = memh.region();
        Ok(RkeyData {
            pid: self.pid,
            token: sys::process_token(),
            base: r.addr as u64,
            len: r.len as u64,
            shm: None,
        }
        .pack())
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let hash = key_hash(packed);
        let set = key_set(hash);
        let mut seen = self.unpacked.lock().unwrap_or_else(|p| p.into_inner());
        seen.tick += 1;
        let tick = seen.tick;
        let ways = &mut seen.slots[set..set + UNPACKED_WAYS];
        for (bytes, key, h, used) in ways.iter_mut().flatten() {
            if *h == hash && bytes.as_slice() == packed {
                *used = tick;
                return Ok(key.clone());
            }
        }
        // The envelope's name tells the two kinds apart (no failed parse, and its formatted
        // error, per key of a shared segment).
        let k = if RkeyData::is_shared_key(packed) {
            RkeyData::unpack_shared(packed)?
        } else {
            RkeyData::unpack(packed)?
        };
        let key = RemoteKey::new(NAME, k.base, k.len, Arc::new(k));
        // An empty way, else the least recently used one.
        let way = ways.iter().position(Option::is_none).unwrap_or_else(|| {
            (0..UNPACKED_WAYS)
                .min_by_key(|&w| ways[w].as_ref().map_or(0, |e| e.3))
                .unwrap_or(0)
        });
        match &mut ways[way] {
            // The slot's buffer is reused, not reallocated, when the new key is no longer.
            Some((bytes, k, h, used)) => {
                bytes.clear();
                bytes.extend_from_slice(packed);
                *k = key.clone();
                *h = hash;
                *used = tick;
            }
            empty => *empty = Some((packed.to_vec(), key.clone(), hash, tick)),
        }
        Ok(key)
    }

    fn mem_alloc_shared(&self, len: usize) -> Result<Option<SharedAlloc>> {
        /// Shared segments are whole pages of this size (the registration cache's default
        /// alignment).
        const SEGMENT_ALIGN: usize = 4096;
        if self.cma.is_err() || len == 0 {
            return Ok(None);
        }
        // Whole pages: a registration of a buffer in it is aligned out to pages (the
        // registration cache), and must still lie inside the segment for its key to carry the
        // segment (so peers can map it).
        let size = len.next_multiple_of(SEGMENT_ALIGN);
        let file = sys::create_shared_file(self.backing, size as u64)?;
        // SAFETY: the file was just created by us with exactly `size` bytes and its size is
        // sealed (memfd) or owned by us alone (shm, unlinked), so the mapping cannot be
        // truncated under us.
        let map = unsafe { memmap2::MmapOptions::new().len(size).map_mut(&file) }
            .map_err(|e| Error::io(format!("posix: mapping a {size}-byte shared segment"), e))?;
        let addr = map.as_ptr() as usize;
        let tag = fd_link_tag(sys::my_pid(), sys::raw_fd(&file) as u32)
            .map_err(|e| Error::io("posix: naming a shared segment", e))?;
        let sh = Arc::new(PosixShared { map, file, tag });
        {
            let mut live = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            live.retain(|_, w| w.strong_count() > 0);
            live.insert(addr, Arc::downgrade(&sh));
        }
        let memh = MemHandle::new(MemRegion::host(addr, len), NAME, SharedReg::new(sh));
        Ok(Some(SharedAlloc { addr, len, memh }))
    }

    fn rkey_ptr(&self, rkey: &RemoteKey) -> Result<Option<usize>> {
        let Some(k) = rkey.inner::<RkeyData>() else {
            return Ok(None);
        };
        let Some(shm) = k.shm else {
            return Ok(None);
        };
        if k.pid == self.pid && k.token == sys::process_token() {
            return Ok(Some(k.base as usize));
        }
        let Some(seg) = mapped::segment(k, &shm)? else {
            return Ok(None);
        };
        seg.local(k.base, k.len as usize)
            .map(Some)
            .ok_or_else(|| Error::InvalidRkey {
                domain: NAME.into(),
                reason: format!(
                    "region {:#x}+{} is not inside its segment of process {}",
                    k.base, k.len, k.pid
                ),
            })
    }
}

impl PosixMd {
    /// The live shared allocation of this domain that holds `addr..addr + len`, if any.
    fn shared_holding(&self, addr: usize, len: usize) -> Option<Arc<PosixShared>> {
        let live = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        let (_, w) = live.range(..=addr).next_back()?;
        let sh = w.upgrade()?;
        let (base, n) = (sh.map.as_ptr() as usize, sh.map.len());
        (addr >= base && addr.checked_add(len)? <= base + n).then_some(sh)
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

    /// The last key unpacked is remembered: the same bytes give the same key again, other
    /// bytes their own (never the remembered one), and a cut or corrupted copy of the
    /// remembered key is still refused.
    #[test]
    fn unpacking_remembers_only_equal_keys() {
        let m = md();
        let (a, b) = (vec![0u8; 100], vec![0u8; 300]);
        // SAFETY: `a` and `b` outlive their handles.
        let ha = unsafe { m.mem_reg(MemRegion::of_slice(&a)) }.unwrap();
        // SAFETY: as above.
        let hb = unsafe { m.mem_reg(MemRegion::of_slice(&b)) }.unwrap();
        let (pa, pb) = (m.mkey_pack(&ha).unwrap(), m.mkey_pack(&hb).unwrap());
        let span = |k: &RemoteKey| (k.base(), k.len());
        let want_a = (a.as_ptr() as u64, 100);
        let want_b = (b.as_ptr() as u64, 300);
        for (packed, want) in [(&pa, want_a), (&pa, want_a), (&pb, want_b), (&pa, want_a)] {
            assert_eq!(span(&m.rkey_unpack(packed).unwrap()), want);
        }
        assert!(m.rkey_unpack(&pa[..pa.len() - 1]).is_err());
        let mut bad = pa.clone();
        bad[4] ^= 0xff;
        assert!(m.rkey_unpack(&bad).is_err());
        assert_eq!(span(&m.rkey_unpack(&pa).unwrap()), want_a);
        // More keys than slots, in turn (a sender unpacking a receiver's ring of buffers):
        // each gives its own region every time round.
        let bufs: Vec<Vec<u8>> = (0..(2 * UNPACKED_SLOTS))
            .map(|i| vec![0u8; 64 + i])
            .collect();
        let keys = packed_keys(&m, &bufs);
        for _ in 0..3 {
            for (b, k) in bufs.iter().zip(&keys) {
                assert_eq!(
                    span(&m.rkey_unpack(k).unwrap()),
                    (b.as_ptr() as u64, b.len() as u64)
                );
            }
        }
        // Keys of different lengths (a shared segment's key after a plain one).
        if let Some(sh) = m.mem_alloc_shared(8192).unwrap() {
            let ps = m.mkey_pack(&sh.memh).unwrap();
            assert_ne!(ps.len(), pa.len());
            assert_eq!(span(&m.rkey_unpack(&ps).unwrap()), (sh.addr as u64, 8192));
            assert_eq!(span(&m.rkey_unpack(&pa).unwrap()), want_a);
            assert_eq!(span(&m.rkey_unpack(&ps).unwrap()), (sh.addr as u64, 8192));
        }
    }

    /// Each buffer registered (the handle dropped at once) and its key packed.
    fn packed_keys(m: &PosixMd, bufs: &[Vec<u8>]) -> Vec<Vec<u8>> {
        bufs.iter()
            .map(|b| {
                // SAFETY: `bufs` outlives the handle, which is dropped at once.
                let h = unsafe { m.mem_reg(MemRegion::of_slice(b)) }.unwrap();
                m.mkey_pack(&h).unwrap()
            })
            .collect()
    }

    /// Sixteen keys in turn (a sender unpacking a receiver's window of buffers) are all
    /// answered from the cache after the first round: each gives the very key it gave before.
    #[test]
    fn a_window_of_keys_in_turn_is_unpacked_once() {
        let m = md();
        let bufs: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; 65536]).collect();
        let keys = packed_keys(&m, &bufs);
        let first: Vec<RemoteKey> = keys.iter().map(|k| m.rkey_unpack(k).unwrap()).collect();
        for round in 0..3 {
            for (k, f) in keys.iter().zip(&first) {
                let again = m.rkey_unpack(k).unwrap();
                assert!(
                    std::ptr::eq(
                        again.inner::<RkeyData>().unwrap(),
                        f.inner::<RkeyData>().unwrap()
                    ),
                    "round {round}: unpacked afresh"
                );
            }
        }
    }

    /// A shared registration's key is packed once and handed out as packed; registrations of
    /// other regions of the segment get their own keys.
    #[test]
    fn a_shared_registration_packs_its_key_once() {
        let m = md();
        if !m.cma_enabled() {
            return;
        }
        let a = m
            .mem_alloc_shared(3 * 4096)
            .unwrap()
            .expect("posix shares memory");
        // SAFETY: the allocation outlives the handles.
        let (h1, h2) = unsafe {
            (
                m.mem_reg(MemRegion::host(a.addr, 4096)).unwrap(),
                m.mem_reg(MemRegion::host(a.addr + 4096, 8192)).unwrap(),
            )
        };
        let k1 = m.mkey_pack(&h1).unwrap();
        assert_eq!(m.mkey_pack(&h1).unwrap(), k1);
        assert_eq!(m.mkey_pack(&h1.clone()).unwrap(), k1);
        let k2 = m.mkey_pack(&h2).unwrap();
        assert_ne!(k1, k2);
        let (u1, u2) = (m.rkey_unpack(&k1).unwrap(), m.rkey_unpack(&k2).unwrap());
        assert_eq!((u1.base(), u1.len()), (a.addr as u64, 4096));
        assert_eq!((u2.base(), u2.len()), (a.addr as u64 + 4096, 8192));
        assert_eq!(m.rkey_ptr(&u2).unwrap(), Some(a.addr + 4096));
        // The allocation's own handle packs the whole allocation.
        let whole = m.rkey_unpack(&m.mkey_pack(&a.memh).unwrap()).unwrap();
        assert_eq!((whole.base(), whole.len()), (a.addr as u64, 3 * 4096));
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

    /// A shared allocation of a size that is not whole pages: a registration of it aligned out
    /// to its page (as the registration cache does) still lies in the segment, so its key can
    /// be mapped.
    #[test]
    fn a_page_aligned_registration_of_an_odd_shared_allocation_maps() {
        let m = md();
        if !m.cma_enabled() {
            return;
        }
        for len in [300, (9 << 20) + 3] {
            let a = m
                .mem_alloc_shared(len)
                .unwrap()
                .expect("posix shares memory");
            let region = MemRegion::host(a.addr, len.next_multiple_of(4096));
            // SAFETY: the allocation (whole pages) outlives the handle.
            let h = unsafe { m.mem_reg(region) }.unwrap();
            let k = m.rkey_unpack(&m.mkey_pack(&h).unwrap()).unwrap();
            assert_eq!(m.rkey_ptr(&k).unwrap(), Some(a.addr), "{len} B");
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
