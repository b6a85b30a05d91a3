//! Packed addresses of `rc_verbs`: the device address (which port: link layer, LID, GID, MTU)
//! and the endpoint address (which QP: number, first PSN, receive window, buffer size).
//!
//! Both travel in the common envelope of [`rucx_uct::rkey`] (magic, version, component name,
//! length, checksum) and every field is range-checked on unpacking: garbage is an error, never a
//! panic, and never a connection to a wrong QP.

use rucx_ucs::{Error, Result};
use rucx_uct::rkey::{self, Reader};

use crate::verbs::{LinkLayer, Mtu};

const DEV_TAG: &str = "rc_verbs.dev";
const EP_TAG: &str = "rc_verbs.ep";

/// Largest QP number and PSN (24 bits).
pub const MAX_24: u32 = 0x00ff_ffff;

/// Where a port is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAddr {
    /// Link layer.
    pub link: LinkLayer,
    /// LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The GID the port sends from (subnet prefix + GUID on InfiniBand; the IP on RoCE).
    pub gid: [u8; 16],
    /// Active MTU of the port.
    pub mtu: Mtu,
}

/// Which QP, and how to talk to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpAddr {
    /// QP number.
    pub qpn: u32,
    /// First PSN this QP sends with.
    pub psn: u32,
    /// Receive buffers posted for data (the sender's initial credits).
    pub rx_window: u16,
    /// Size of each receive buffer (the largest message it accepts).
    pub seg_size: u32,
}

fn bad(what: &str, why: String) -> Error {
    Error::InvalidAddress(format!("rc_verbs {what}: {why}"))
}

fn envelope(tag: &str, what: &str, blob: &[u8]) -> Result<Vec<u8>> {
    rkey::unpack(tag, what, blob)
        .map(<[u8]>::to_vec)
        .map_err(|e| bad(what, e.to_string()))
}

impl DeviceAddr {
    /// Packed size.
    pub const PACKED_LEN: usize = 12 + DEV_TAG.len() + 20;

    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(20);
        p.push(match self.link {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        });
        p.push(self.mtu.code() as u8);
        p.extend_from_slice(&self.lid.to_le_bytes());
        p.extend_from_slice(&self.gid);
        rkey::pack(DEV_TAG, &p)
    }

    /// Unpack and validate.
    pub fn unpack(blob: &[u8]) -> Result<DeviceAddr> {
        const WHAT: &str = "device address";
        let payload = envelope(DEV_TAG, WHAT, blob)?;
        let mut r = Reader::new(&payload, "rc_verbs device address");
        let link = match r.u8()? {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            o => return Err(bad(WHAT, format!("unknown link layer {o}"))),
        };
        let mtu_code = r.u8()?;
        let mtu = Mtu::from_code(u32::from(mtu_code))
            .ok_or_else(|| bad(WHAT, format!("MTU code {mtu_code} is not 1..=5")))?;
        let lid = r.u16()?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(r.bytes(16)?);
        r.finish()?;
        match link {
            LinkLayer::InfiniBand if lid == 0 || lid >= 0xc000 => {
                return Err(bad(WHAT, format!("LID {lid:#x} is not a unicast LID")));
            }
            LinkLayer::Ethernet if gid.iter().all(|b| *b == 0) => {
                return Err(bad(WHAT, "RoCE address without a GID".into()));
            }
            _ => {}
        }
        Ok(DeviceAddr {
            link,
            lid,
            gid,
            mtu,
        })
    }

    /// The 64-bit subnet prefix of the GID.
    pub fn subnet_prefix(&self) -> [u8; 8] {
        let mut p = [0u8; 8];
        p.copy_from_slice(&self.gid[..8]);
        p
    }

    /// Whether a port at `self` can reach one at `peer`: same link layer, and on InfiniBand the
    /// same subnet (routing between subnets is not configured here).
    pub fn reaches(&self, peer: &DeviceAddr) -> bool {
        self.link == peer.link
            && (self.link == LinkLayer::Ethernet || self.subnet_prefix() == peer.subnet_prefix())
    }
}

impl EpAddr {
    /// Packed size.
    pub const PACKED_LEN: usize = 12 + EP_TAG.len() + 14;

    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(14);
        p.extend_from_slice(&self.qpn.to_le_bytes());
        p.extend_from_slice(&self.psn.to_le_bytes());
        p.extend_from_slice(&self.rx_window.to_le_bytes());
        p.extend_from_slice(&self.seg_size.to_le_bytes());
        rkey::pack(EP_TAG, &p)
    }

    /// Unpack and validate.
    pub fn unpack(blob: &[u8]) -> Result<EpAddr> {
        const WHAT: &str = "endpoint address";
        let payload = envelope(EP_TAG, WHAT, blob)?;
        let mut r = Reader::new(&payload, "rc_verbs endpoint address");
        let a = EpAddr {
            qpn: r.u32()?,
            psn: r.u32()?,
            rx_window: r.u16()?,
            seg_size: r.u32()?,
        };
        r.finish()?;
        if a.qpn < 2 || a.qpn > MAX_24 {
            return Err(bad(
                WHAT,
                format!("QP number {:#x} is not 2..=0xffffff", a.qpn),
            ));
        }
        if a.psn > MAX_24 {
            return Err(bad(WHAT, format!("PSN {:#x} exceeds 24 bits", a.psn)));
        }
        if a.rx_window < 2 {
            return Err(bad(
                WHAT,
                format!("receive window {} is below 2", a.rx_window),
            ));
        }
        let (lo, hi) = crate::config::SEG_SIZE_RANGE;
        if (a.seg_size as usize) < lo || (a.seg_size as usize) > hi {
            return Err(bad(
                WHAT,
                format!("buffer size {} is not {lo}..={hi}", a.seg_size),
            ));
        }
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ib_addr(lid: u16) -> DeviceAddr {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[15] = 7;
        DeviceAddr {
            link: LinkLayer::InfiniBand,
            lid,
            gid,
            mtu: Mtu::M4096,
        }
    }

    #[test]
    fn round_trip_and_lengths() {
        let d = ib_addr(8);
        let p = d.pack();
        assert_eq!(p.len(), DeviceAddr::PACKED_LEN);
        assert_eq!(DeviceAddr::unpack(&p).unwrap(), d);
        let e = EpAddr {
            qpn: 0x1234,
            psn: 0xabcdef,
            rx_window: 64,
            seg_size: 8192,
        };
        let p = e.pack();
        assert_eq!(p.len(), EpAddr::PACKED_LEN);
        assert_eq!(EpAddr::unpack(&p).unwrap(), e);
        // A device address is not an endpoint address and vice versa.
        assert!(EpAddr::unpack(&d.pack()).is_err());
        assert!(DeviceAddr::unpack(&e.pack()).is_err());
    }

    #[test]
    fn semantic_checks() {
        assert!(DeviceAddr::unpack(&ib_addr(0).pack()).is_err());
        assert!(DeviceAddr::unpack(&ib_addr(0xc001).pack()).is_err());
        let roce = DeviceAddr {
            link: LinkLayer::Ethernet,
            lid: 0,
            gid: [0; 16],
            mtu: Mtu::M1024,
        };
        let e = DeviceAddr::unpack(&roce.pack()).unwrap_err();
        assert!(matches!(e, Error::InvalidAddress(_)), "{e}");
        let ep = |qpn, psn, w, s| EpAddr {
            qpn,
            psn,
            rx_window: w,
            seg_size: s,
        };
        assert!(EpAddr::unpack(&ep(1, 0, 64, 8192).pack()).is_err());
        assert!(EpAddr::unpack(&ep(0x100_0000, 0, 64, 8192).pack()).is_err());
        assert!(EpAddr::unpack(&ep(5, 0x100_0000, 64, 8192).pack()).is_err());
        assert!(EpAddr::unpack(&ep(5, 0, 1, 8192).pack()).is_err());
        assert!(EpAddr::unpack(&ep(5, 0, 64, 16).pack()).is_err());
        assert!(EpAddr::unpack(&ep(5, 0, 64, 8192).pack()).is_ok());
    }

    #[test]
    fn reachability() {
        let a = ib_addr(1);
        let mut b = ib_addr(2);
        assert!(a.reaches(&b));
        b.gid[7] = 1; // other subnet
        assert!(!a.reaches(&b));
        let mut roce = a;
        roce.link = LinkLayer::Ethernet;
        assert!(!a.reaches(&roce));
        assert!(roce.reaches(&roce));
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = DeviceAddr::unpack(&g);
            let _ = EpAddr::unpack(&g);
        }

        #[test]
        fn valid_payload_garbage_is_checked(payload in proptest::collection::vec(any::<u8>(), 0..24)) {
            // Well-formed envelopes around arbitrary payloads: only semantically valid ones pass.
            if let Ok(d) = DeviceAddr::unpack(&rkey::pack(DEV_TAG, &payload)) {
                prop_assert_eq!(payload.len(), 20);
                prop_assert_eq!(DeviceAddr::unpack(&d.pack()).unwrap(), d);
            }
            if let Ok(e) = EpAddr::unpack(&rkey::pack(EP_TAG, &payload)) {
                prop_assert!(e.qpn >= 2 && e.qpn <= MAX_24 && e.psn <= MAX_24 && e.rx_window >= 2);
                prop_assert_eq!(EpAddr::unpack(&e.pack()).unwrap(), e);
            }
        }

        #[test]
        fn round_trips(qpn in 2u32..=MAX_24, psn in 0u32..=MAX_24, w in 2u16.., s in 256u32..=(1 << 20),
                       lid in 1u16..0xc000, gid in any::<[u8; 16]>(), mtu in 1u32..=5) {
            let e = EpAddr { qpn, psn, rx_window: w, seg_size: s };
            prop_assert_eq!(EpAddr::unpack(&e.pack()).unwrap(), e);
            let d = DeviceAddr { link: LinkLayer::InfiniBand, lid, gid, mtu: Mtu::from_code(mtu).unwrap() };
            prop_assert_eq!(DeviceAddr::unpack(&d.pack()).unwrap(), d);
        }

        #[test]
        fn bit_flips_are_rejected(pos in any::<usize>(), bit in 0u8..8) {
            let mut p = EpAddr { qpn: 77, psn: 5, rx_window: 64, seg_size: 8192 }.pack();
            let i = pos % p.len();
            p[i] ^= 1 << bit;
            prop_assert!(EpAddr::unpack(&p).is_err());
        }
    }
}
