//! Network interfaces and the packed device and interface addresses.
//!
//! Device address (identifies the host side of a device):
//!
//! | bytes | field                                                                      |
//! |-------|----------------------------------------------------------------------------|
//! | 0     | kind: 1 = IPv4 on a network device, 2 = IPv4 on a loopback device          |
//! | 1..5  | IPv4 address, network byte order                                           |
//! | 5..13 | loopback only: host id (`u64` LE), so `127.0.0.1` on another host or in    |
//! |       | another network namespace is not mistaken for ours                         |
//!
//! Interface address: `0x54 ('T')`, version `1`, then the listening port (`u16` LE, nonzero).

use std::net::Ipv4Addr;

use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;
use rucx_ucs::{Error, Result};

const DEV_KIND_NET: u8 = 1;
const DEV_KIND_LOOPBACK: u8 = 2;
const IFACE_TAG: u8 = 0x54;
const IFACE_VERSION: u8 = 1;

/// Packed interface address length.
pub const IFACE_ADDR_LEN: usize = 4;
/// Packed device address length of a network device.
pub const DEV_ADDR_LEN_NET: usize = 5;
/// Packed device address length of a loopback device.
pub const DEV_ADDR_LEN_LOOPBACK: usize = 13;

/// A usable network interface: up, running, with an IPv4 address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetIf {
    /// Interface name (`lo`, `eth0`).
    pub name: String,
    /// Its (first) IPv4 address.
    pub addr: Ipv4Addr,
    /// Loopback device.
    pub loopback: bool,
    /// Link speed in Mb/s, when the kernel reports one.
    pub speed_mbps: Option<u64>,
}

/// The interfaces that are up and running and have an IPv4 address, in kernel order, one entry
/// per interface (its first IPv4 address).
pub fn interfaces() -> Result<Vec<NetIf>> {
    let addrs =
        getifaddrs().map_err(|e| Error::io("getifaddrs (listing network interfaces)", e.into()))?;
    let mut out: Vec<NetIf> = Vec::new();
    for ifa in addrs {
        let usable = ifa.flags.contains(InterfaceFlags::IFF_UP)
            && ifa.flags.contains(InterfaceFlags::IFF_RUNNING);
        if !usable || out.iter().any(|n| n.name == ifa.interface_name) {
            continue;
        }
        let Some(sin) = ifa.address.as_ref().and_then(|a| a.as_sockaddr_in()) else {
            continue;
        };
        let addr = sin.ip();
        if addr.is_unspecified() {
            continue;
        }
        let loopback = ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK) || addr.is_loopback();
        out.push(NetIf {
            speed_mbps: link_speed(&ifa.interface_name),
            name: ifa.interface_name,
            addr,
            loopback,
        });
    }
    Ok(out)
}

fn link_speed(name: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/sys/class/net/{name}/speed")).ok()?;
    s.trim()
        .parse::<i64>()
        .ok()
        .filter(|v| *v > 0)
        .map(|v| v as u64)
}

/// An identifier of this host and network namespace: loopback addresses are reachable only
/// between interfaces with the same host id.
pub fn host_id() -> u64 {
    let mut seed = Vec::new();
    for f in [
        "/proc/sys/kernel/random/boot_id",
        "/proc/sys/kernel/hostname",
    ] {
        if let Ok(s) = std::fs::read(f) {
            seed.extend_from_slice(&s);
        }
    }
    {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata("/proc/self/ns/net") {
            seed.extend_from_slice(&m.ino().to_le_bytes());
            seed.extend_from_slice(&m.dev().to_le_bytes());
        }
    }
    fnv1a64(&seed)
}

fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A device address, unpacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevAddr {
    /// IPv4 address of the device.
    pub ip: Ipv4Addr,
    /// `Some(host id)` for a loopback device.
    pub loopback_host: Option<u64>,
}

impl DevAddr {
    /// Pack.
    pub fn pack(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(DEV_ADDR_LEN_LOOPBACK);
        match self.loopback_host {
            None => {
                v.push(DEV_KIND_NET);
                v.extend_from_slice(&self.ip.octets());
            }
            Some(h) => {
                v.push(DEV_KIND_LOOPBACK);
                v.extend_from_slice(&self.ip.octets());
                v.extend_from_slice(&h.to_le_bytes());
            }
        }
        v
    }

    /// Unpack and validate.
    pub fn unpack(b: &[u8]) -> Result<DevAddr> {
        let bad = |why: String| {
            Error::InvalidAddress(format!("tcp device address ({} bytes): {why}", b.len()))
        };
        let Some(&kind) = b.first() else {
            return Err(bad("empty".into()));
        };
        let want = match kind {
            DEV_KIND_NET => DEV_ADDR_LEN_NET,
            DEV_KIND_LOOPBACK => DEV_ADDR_LEN_LOOPBACK,
            k => return Err(bad(format!("unknown kind {k}"))),
        };
        if b.len() != want {
            return Err(bad(format!("kind {kind} needs exactly {want} bytes")));
        }
        let ip = Ipv4Addr::new(b[1], b[2], b[3], b[4]);
        if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
            return Err(bad(format!("{ip} cannot be a peer address")));
        }
        let loopback_host = if kind == DEV_KIND_LOOPBACK {
            if !ip.is_loopback() {
                return Err(bad(format!("loopback kind with non-loopback address {ip}")));
            }
            Some(u64::from_le_bytes(b[5..13].try_into().expect("8 bytes")))
        } else {
            if ip.is_loopback() {
                return Err(bad(format!("network kind with loopback address {ip}")));
            }
            None
        };
        Ok(DevAddr { ip, loopback_host })
    }
}

/// Pack an interface address (the listening port).
pub fn pack_iface_addr(port: u16) -> Vec<u8> {
    let p = port.to_le_bytes();
    vec![IFACE_TAG, IFACE_VERSION, p[0], p[1]]
}

/// Unpack and validate an interface address; returns the port.
pub fn unpack_iface_addr(b: &[u8]) -> Result<u16> {
    let bad = |why: &str| {
        Error::InvalidAddress(format!("tcp interface address ({} bytes): {why}", b.len()))
    };
    if b.len() != IFACE_ADDR_LEN {
        return Err(bad("wrong length (expected 4)"));
    }
    if b[0] != IFACE_TAG {
        return Err(bad("not a tcp interface address (bad tag)"));
    }
    if b[1] != IFACE_VERSION {
        return Err(bad("unsupported version"));
    }
    let port = u16::from_le_bytes([b[2], b[3]]);
    if port == 0 {
        return Err(bad("port 0"));
    }
    Ok(port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn interfaces_include_loopback() {
        let ifs = interfaces().unwrap();
        let lo = ifs
            .iter()
            .find(|i| i.loopback)
            .expect("lo is up on every test machine");
        assert!(lo.addr.is_loopback());
        let mut names: Vec<&str> = ifs.iter().map(|i| i.name.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), ifs.len(), "one entry per interface");
    }

    #[test]
    fn device_address_round_trip() {
        let net = DevAddr {
            ip: Ipv4Addr::new(10, 1, 2, 3),
            loopback_host: None,
        };
        assert_eq!(net.pack().len(), DEV_ADDR_LEN_NET);
        assert_eq!(DevAddr::unpack(&net.pack()).unwrap(), net);
        let lo = DevAddr {
            ip: Ipv4Addr::LOCALHOST,
            loopback_host: Some(host_id()),
        };
        assert_eq!(lo.pack().len(), DEV_ADDR_LEN_LOOPBACK);
        assert_eq!(DevAddr::unpack(&lo.pack()).unwrap(), lo);
    }

    #[test]
    fn device_address_garbage() {
        assert!(DevAddr::unpack(&[]).is_err());
        assert!(DevAddr::unpack(&[9, 10, 0, 0, 1]).is_err());
        assert!(DevAddr::unpack(&[1, 10, 0, 0]).is_err(), "truncated");
        assert!(
            DevAddr::unpack(&[1, 10, 0, 0, 1, 0]).is_err(),
            "trailing byte"
        );
        assert!(DevAddr::unpack(&[1, 0, 0, 0, 0]).is_err(), "unspecified");
        assert!(DevAddr::unpack(&[1, 224, 0, 0, 1]).is_err(), "multicast");
        assert!(
            DevAddr::unpack(&[1, 255, 255, 255, 255]).is_err(),
            "broadcast"
        );
        assert!(
            DevAddr::unpack(&[1, 127, 0, 0, 1]).is_err(),
            "loopback as network"
        );
        let mut lo = vec![2, 10, 0, 0, 1];
        lo.extend_from_slice(&[0; 8]);
        assert!(DevAddr::unpack(&lo).is_err(), "network address as loopback");
    }

    #[test]
    fn iface_address() {
        assert_eq!(unpack_iface_addr(&pack_iface_addr(4242)).unwrap(), 4242);
        assert!(unpack_iface_addr(&pack_iface_addr(0)).is_err());
        assert!(unpack_iface_addr(&[0x54, 1, 1]).is_err());
        assert!(unpack_iface_addr(&[0x55, 1, 1, 1]).is_err());
        assert!(unpack_iface_addr(&[0x54, 2, 1, 1]).is_err());
    }

    #[test]
    fn host_id_is_stable() {
        assert_eq!(host_id(), host_id());
    }

    proptest! {
        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..20)) {
            let _ = DevAddr::unpack(&b);
            let _ = unpack_iface_addr(&b);
        }

        #[test]
        fn valid_addresses_round_trip(o in any::<[u8; 4]>(), port in 1u16..) {
            let ip = Ipv4Addr::from(o);
            let d = DevAddr { ip, loopback_host: None };
            let ok = !(ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() || ip.is_loopback());
            prop_assert_eq!(DevAddr::unpack(&d.pack()).is_ok(), ok);
            prop_assert_eq!(unpack_iface_addr(&pack_iface_addr(port)).unwrap(), port);
        }
    }
}
