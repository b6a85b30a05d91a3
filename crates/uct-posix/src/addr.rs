//! Packed device addresses, interface addresses and remote keys of the posix transport.
//!
//! All three are wrapped in the common envelope ([`rucx_uct::rkey`]: magic, version, component
//! name, length, checksum), so truncated or corrupted bytes are rejected before any field is
//! used. Payloads (little endian):
//!
//! - device address: `boot_id[16]`, `pid_namespace_inode: u64` (same host and same pid
//!   namespace are required to reach a peer);
//! - interface address: `pid: u32`, `fd: u32` (the segment's descriptor in the owner, opened by
//!   peers through `/proc/<pid>/fd/<fd>`), `seg_id: u64`, `token: u64`, `cell_count: u32`,
//!   `cell_size: u32`;
//! - remote key: `pid: u32`, `token: u64`, `base: u64`, `len: u64`.

use rucx_ucs::{Error, Result};
use rucx_uct::rkey::{self, Reader};

use crate::ring::Geometry;

/// Component (and domain) name, also the envelope tag.
pub const NAME: &str = "posix";

fn unpack_envelope<'a>(what: &str, blob: &'a [u8]) -> Result<&'a [u8]> {
    rkey::unpack(NAME, what, blob).map_err(|e| match e {
        Error::InvalidRkey { reason, .. } => Error::InvalidAddress(format!("posix {reason}")),
        other => other,
    })
}

/// Where the sending process runs: host boot and pid namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAddr {
    /// Kernel boot id.
    pub boot_id: [u8; 16],
    /// Inode of the pid namespace.
    pub pid_ns: u64,
}

impl DeviceAddr {
    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(24);
        p.extend_from_slice(&self.boot_id);
        p.extend_from_slice(&self.pid_ns.to_le_bytes());
        rkey::pack(NAME, &p)
    }

    /// Unpack and validate.
    pub fn unpack(blob: &[u8]) -> Result<DeviceAddr> {
        let p = unpack_envelope("device address", blob)?;
        let mut r = Reader::new(p, "posix device address");
        let boot_id: [u8; 16] = r
            .bytes(16)?
            .try_into()
            .map_err(|_| Error::Internal("16 bytes".into()))?;
        let pid_ns = r.u64()?;
        r.finish()?;
        Ok(DeviceAddr { boot_id, pid_ns })
    }
}

/// How to reach an interface's receive ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IfaceAddr {
    /// Owner process.
    pub pid: u32,
    /// Descriptor of the segment in the owner.
    pub fd: u32,
    /// Random segment id (checked against the segment header).
    pub seg_id: u64,
    /// Owner's process token (checked against the header and remote keys).
    pub token: u64,
    /// Shape of the ring.
    pub geo: Geometry,
}

impl IfaceAddr {
    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(32);
        p.extend_from_slice(&self.pid.to_le_bytes());
        p.extend_from_slice(&self.fd.to_le_bytes());
        p.extend_from_slice(&self.seg_id.to_le_bytes());
        p.extend_from_slice(&self.token.to_le_bytes());
        p.extend_from_slice(&self.geo.cell_count.to_le_bytes());
        p.extend_from_slice(&self.geo.cell_size.to_le_bytes());
        rkey::pack(NAME, &p)
    }

    /// Unpack and validate every field.
    pub fn unpack(blob: &[u8]) -> Result<IfaceAddr> {
        let p = unpack_envelope("interface address", blob)?;
        let mut r = Reader::new(p, "posix interface address");
        let pid = r.u32()?;
        let fd = r.u32()?;
        let seg_id = r.u64()?;
        let token = r.u64()?;
        let cell_count = r.u32()?;
        let cell_size = r.u32()?;
        r.finish()?;
        if pid == 0 || pid > i32::MAX as u32 {
            return Err(Error::InvalidAddress(format!(
                "posix interface address: bad pid {pid}"
            )));
        }
        if fd > i32::MAX as u32 {
            return Err(Error::InvalidAddress(format!(
                "posix interface address: bad descriptor {fd}"
            )));
        }
        let geo = Geometry {
            cell_count,
            cell_size,
        }
        .validate("posix interface address")
        .map_err(|e| Error::InvalidAddress(e.to_string()))?;
        Ok(IfaceAddr {
            pid,
            fd,
            seg_id,
            token,
            geo,
        })
    }
}

/// A remote key: a region of a process's memory, reached through cross-memory attach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RkeyData {
    /// Owner process.
    pub pid: u32,
    /// Owner's process token.
    pub token: u64,
    /// Region start in the owner.
    pub base: u64,
    /// Region length.
    pub len: u64,
    /// Set when the region lies in a shared segment peers can map ([`RkeyData::pack_shared`]).
    pub shm: Option<ShmInfo>,
}

/// Where a shared segment lives in its owner: peers open it as `/proc/<pid>/fd/<fd>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmInfo {
    /// Descriptor number of the segment in the owner.
    pub fd: u32,
    /// Address of the segment's mapping in the owner.
    pub seg_base: u64,
    /// Segment length.
    pub seg_len: u64,
    /// FNV-1a of the segment's `/proc/<pid>/fd/<fd>` link: checked before mapping, so a reused
    /// descriptor number never maps another file.
    pub tag: u64,
}

/// Envelope name of keys of shared segments.
pub const SHM_KEY: &str = "posix-shm";

impl RkeyData {
    /// Packed size of every posix remote key.
    pub const PACKED_SIZE: usize = 2 + 1 + 1 + NAME.len() + 4 + 28 + 4;

    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        // The payload on the stack: one allocation per key, the envelope's.
        let mut p = [0u8; 28];
        p[..4].copy_from_slice(&self.pid.to_le_bytes());
        p[4..12].copy_from_slice(&self.token.to_le_bytes());
        p[12..20].copy_from_slice(&self.base.to_le_bytes());
        p[20..].copy_from_slice(&self.len.to_le_bytes());
        rkey::pack(NAME, &p)
    }

    /// Whether `blob`'s envelope is that of a shared-segment key ([`pack_shared`](Self::pack_shared)).
    pub fn is_shared_key(blob: &[u8]) -> bool {
        let name = SHM_KEY.as_bytes();
        blob.len() > 4 + name.len()
            && usize::from(blob[3]) == name.len()
            && &blob[4..4 + name.len()] == name
    }

    /// Pack a key of a region inside a shared segment (a peer may map it, or use cross-memory
    /// attach like any key).
    pub fn pack_shared(&self, shm: ShmInfo) -> Vec<u8> {
        // Eight words on the stack: one allocation per key, the envelope's (a vector of them
        // was grown once and then copied into the envelope, on every rendezvous).
        let mut p = [0u8; 64];
        let words = [
            u64::from(self.pid),
            self.token,
            self.base,
            self.len,
            u64::from(shm.fd),
            shm.seg_base,
            shm.seg_len,
            shm.tag,
        ];
        for (dst, v) in p.chunks_exact_mut(8).zip(words) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        rkey::pack(SHM_KEY, &p)
    }

    /// Unpack a key made by [`pack_shared`](Self::pack_shared), validating that the region lies
    /// inside the segment.
    pub fn unpack_shared(blob: &[u8]) -> Result<RkeyData> {
        let p = rkey::unpack(SHM_KEY, "remote key", blob)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: NAME.into(),
            reason,
        };
        let mut r = Reader::new(p, "posix shared-segment key");
        let mut v = [0u64; 8];
        for x in &mut v {
            *x = r.u64().map_err(|e| bad(e.to_string()))?;
        }
        r.finish().map_err(|e| bad(e.to_string()))?;
        let [pid, token, base, len, fd, seg_base, seg_len, tag] = v;
        if pid == 0 || pid > i32::MAX as u64 || fd > i32::MAX as u64 {
            return Err(bad(format!("bad pid {pid} or descriptor {fd}")));
        }
        let inside = base >= seg_base
            && base
                .checked_add(len)
                .is_some_and(|e| seg_base.checked_add(seg_len).is_some_and(|se| e <= se));
        if !inside {
            return Err(bad(format!(
                "region {base:#x}+{len} is not inside its segment {seg_base:#x}+{seg_len}"
            )));
        }
        Ok(RkeyData {
            pid: pid as u32,
            token,
            base,
            len,
            shm: Some(ShmInfo {
                fd: fd as u32,
                seg_base,
                seg_len,
                tag,
            }),
        })
    }

    /// Unpack and validate.
    pub fn unpack(blob: &[u8]) -> Result<RkeyData> {
        let p = rkey::unpack(NAME, "remote key", blob)?;
        let bad = |reason: String| Error::InvalidRkey {
            domain: NAME.into(),
            reason,
        };
        let mut r = Reader::new(p, "posix remote key");
        let parsed = (|| Ok::<_, Error>((r.u32()?, r.u64()?, r.u64()?, r.u64()?)))();
        let (pid, token, base, len) = parsed.map_err(|e| bad(e.to_string()))?;
        r.finish().map_err(|e| bad(e.to_string()))?;
        if pid == 0 || pid > i32::MAX as u32 {
            return Err(bad(format!("bad pid {pid}")));
        }
        if base.checked_add(len).is_none() {
            return Err(bad(format!("region {base:#x}+{len} wraps around")));
        }
        Ok(RkeyData {
            pid,
            token,
            base,
            len,
            shm: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn iface() -> IfaceAddr {
        IfaceAddr {
            pid: 1234,
            fd: 7,
            seg_id: 0xdead_beef,
            token: 99,
            geo: Geometry {
                cell_count: 256,
                cell_size: 8192,
            },
        }
    }

    #[test]
    fn round_trips() {
        let a = iface();
        assert_eq!(IfaceAddr::unpack(&a.pack()).unwrap(), a);
        let d = DeviceAddr {
            boot_id: [3; 16],
            pid_ns: 4026531836,
        };
        assert_eq!(DeviceAddr::unpack(&d.pack()).unwrap(), d);
        let k = RkeyData {
            pid: 77,
            token: 5,
            base: 0x7f00_0000_0000,
            len: 1 << 20,
            shm: None,
        };
        let packed = k.pack();
        assert_eq!(packed.len(), RkeyData::PACKED_SIZE);
        assert_eq!(RkeyData::unpack(&packed).unwrap(), k);
    }

    #[test]
    fn invalid_fields_are_rejected() {
        let mut a = iface();
        a.pid = 0;
        assert!(IfaceAddr::unpack(&a.pack()).is_err());
        let mut a = iface();
        a.geo.cell_count = 3;
        assert!(IfaceAddr::unpack(&a.pack()).is_err());
        let mut a = iface();
        a.fd = u32::MAX;
        assert!(IfaceAddr::unpack(&a.pack()).is_err());
        let k = RkeyData {
            pid: 1,
            token: 1,
            base: u64::MAX - 4,
            len: 10,
            shm: None,
        };
        assert!(RkeyData::unpack(&k.pack()).is_err());
        // An interface address is not a remote key and vice versa.
        assert!(RkeyData::unpack(&iface().pack()).is_err());
        let good = RkeyData {
            pid: 1,
            token: 1,
            base: 0,
            len: 1,
            shm: None,
        };
        assert!(IfaceAddr::unpack(&good.pack()).is_err());
        // Another component's blob.
        assert!(IfaceAddr::unpack(&rkey::pack("tcp", &[0; 32])).is_err());
        // Garbage errors are InvalidAddress for addresses, InvalidRkey for keys.
        assert!(matches!(
            IfaceAddr::unpack(b"junk"),
            Err(Error::InvalidAddress(_))
        ));
        assert!(matches!(
            RkeyData::unpack(b"junk"),
            Err(Error::InvalidRkey { .. })
        ));
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = IfaceAddr::unpack(&g);
            let _ = DeviceAddr::unpack(&g);
            let _ = RkeyData::unpack(&g);
            let _ = RkeyData::unpack_shared(&g);
            let _ = RkeyData::is_shared_key(&g);
        }

        /// The envelope test picks the parser: a shared key is recognized whole or cut (the
        /// shared parser then refuses the cut), a plain key never is.
        #[test]
        fn shared_keys_are_told_from_plain_ones(base in 0u64..1 << 40, len in 0u64..1 << 20, cut in any::<usize>()) {
            let k = RkeyData { pid: 7, token: 3, base: base + 4096, len, shm: None };
            let shm = ShmInfo { fd: 9, seg_base: base, seg_len: len + 8192, tag: 5 };
            let b = k.pack_shared(shm);
            prop_assert!(RkeyData::is_shared_key(&b));
            prop_assert_eq!(RkeyData::unpack_shared(&b).unwrap().shm, Some(shm));
            prop_assert!(!RkeyData::is_shared_key(&k.pack()));
            let c = cut % b.len();
            prop_assert!(RkeyData::unpack_shared(&b[..c]).is_err());
        }

        /// The envelope's check is no secret: any payload wrapped in a valid envelope (of the
        /// right length or not) is refused or gives fields that hold their invariants.
        #[test]
        fn lies_in_a_valid_envelope_are_refused_or_valid(
            p in proptest::collection::vec(any::<u8>(), 0..80),
            exact in 0u8..4,
        ) {
            let mut p = p;
            let want = [32usize, 28, 64, 24][exact as usize];
            if p.len() > want {
                p.truncate(want);
            }
            if let Ok(a) = IfaceAddr::unpack(&rkey::pack(NAME, &p)) {
                prop_assert!(a.pid > 0 && a.pid <= i32::MAX as u32 && a.fd <= i32::MAX as u32);
                prop_assert!(a.geo.validate("t").is_ok());
            }
            if let Ok(k) = RkeyData::unpack(&rkey::pack(NAME, &p)) {
                prop_assert!(k.pid > 0 && k.base.checked_add(k.len).is_some());
            }
            if let Ok(k) = RkeyData::unpack_shared(&rkey::pack(SHM_KEY, &p)) {
                let s = k.shm.unwrap();
                prop_assert!(k.base >= s.seg_base);
                prop_assert!(k.base + k.len <= s.seg_base + s.seg_len);
            }
            let _ = DeviceAddr::unpack(&rkey::pack(NAME, &p));
        }

        #[test]
        fn corrupted_iface_address_rejected(pos in any::<usize>(), bit in 0u8..8) {
            let mut b = iface().pack();
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            prop_assert!(IfaceAddr::unpack(&b).is_err());
        }

        #[test]
        fn corrupted_rkey_rejected(pid in 1u32..100_000, base in any::<u32>(), len in any::<u32>(), pos in any::<usize>(), bit in 0u8..8) {
            let k = RkeyData { pid, token: 3, base: u64::from(base), len: u64::from(len), shm: None };
            let mut b = k.pack();
            prop_assert_eq!(RkeyData::unpack(&b).unwrap(), k);
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            prop_assert!(RkeyData::unpack(&b).is_err());
            let cut = pos % b.len();
            prop_assert!(RkeyData::unpack(&k.pack()[..cut]).is_err());
        }
    }
}
