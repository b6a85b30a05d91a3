//! Attributes derived from device and port attributes: pure functions, tested with synthetic
//! reports.

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::{
    DeviceType, IfaceAttr, IfaceCaps, IfaceLimits, LinearCost, MdAttr, MemTypeFlags, PerfModel,
};

use crate::config::{GidChoice, RcConfig};
use crate::gpudirect::GdrPlan;
use crate::probe::port_name;
use crate::rc::addr::{DeviceAddr, EpAddr};
use crate::rc::flow::{Credits, grant_slots};
use crate::rc::wire::HDR_LEN;
use crate::verbs::{DeviceAttrs, GidEntry, GidKind, LinkLayer, Mtu, PortAttrs, link_gbps};

/// Component name.
pub const COMPONENT: &str = "ib";

/// Transport name.
pub const TL_NAME: &str = "rc_verbs";

/// Largest user header of `am_zcopy`.
pub const AM_MAX_HDR: usize = 128;

/// Largest `am_short` payload (after the 8-byte header): small messages go in one go.
pub const AM_MAX_SHORT: usize = 256 - HDR_LEN - 8;

/// Most scatter/gather entries used per operation.
pub const MAX_IOV: usize = 8;

/// Memory-domain attributes of a device under a GPU-direct plan.
pub fn md_attr(dev: &DeviceAttrs, gdr: &GdrPlan) -> MdAttr {
    let host = MemTypeFlags::REG | MemTypeFlags::ACCESS;
    let mut a = MdAttr::new(COMPONENT)
        .with(MemoryType::Host, host)
        .with(MemoryType::Unknown, host);
    if gdr.any() {
        let mut f = MemTypeFlags::REG | MemTypeFlags::ACCESS;
        if gdr.uses_dmabuf() {
            f |= MemTypeFlags::DMABUF;
        }
        a = a.with(MemoryType::Cuda, f);
    }
    // Pinning costs a fixed system-call and page-table part plus a per-page part (estimates for
    // ibv_reg_mr without a registration cache).
    a.reg_cost = LinearCost {
        overhead_ns: 10_000.0,
        per_byte_ns: 0.05,
    };
    a.max_reg = (dev.max_mr_size > 0 && dev.max_mr_size < u64::MAX).then_some(dev.max_mr_size);
    a.rkey_packed_size = crate::md::RKEY_PACKED_LEN;
    a.need_memh_for_zcopy = true;
    a
}

/// Link bandwidth in bytes per second after packet headers at `mtu`, from the port's width and
/// speed codes; `None` when a code is unknown.
pub fn port_bandwidth(p: &PortAttrs, mtu: Mtu) -> Option<f64> {
    let gbps = link_gbps(p.active_width, p.active_speed)?;
    // Per packet: LRH 8 + BTH 12 + ICRC 4 + VCRC 2 on InfiniBand; RoCE v2 adds Ethernet, IP
    // and UDP framing (about 78 bytes with preamble and gap).
    let overhead = match p.link_layer {
        LinkLayer::InfiniBand => 26.0,
        LinkLayer::Ethernet => 78.0,
    };
    let payload = mtu.bytes() as f64;
    Some(gbps * 1e9 / 8.0 * payload / (payload + overhead))
}

/// Bandwidth assumed when the port's codes are unknown (10 Gb/s).
pub const FALLBACK_BANDWIDTH: f64 = 10e9 / 8.0;

/// The GID a port sends from.
pub fn select_gid(p: &PortAttrs, choice: GidChoice) -> Result<GidEntry> {
    let name = format!("port {}", p.port_num);
    match choice {
        GidChoice::Index(i) => p
            .gids
            .iter()
            .find(|g| g.index == i)
            .copied()
            .ok_or_else(|| Error::Config {
                var: "RUCX_IB_GID_INDEX".into(),
                value: i.to_string(),
                reason: format!(
                    "{name} has no GID at index {i} (populated: {})",
                    p.gids
                        .iter()
                        .map(|g| g.index.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                accepted: "auto, or a populated GID index".into(),
            }),
        GidChoice::Auto => {
            let pick = match p.link_layer {
                LinkLayer::InfiniBand => p.gids.iter().min_by_key(|g| g.index),
                LinkLayer::Ethernet => p
                    .gids
                    .iter()
                    .filter(|g| g.kind == GidKind::RoceV2 && g.is_ipv4_mapped())
                    .chain(p.gids.iter().filter(|g| g.kind == GidKind::RoceV2))
                    .chain(p.gids.iter())
                    .next(),
            };
            pick.copied().ok_or_else(|| Error::Unavailable {
                component: COMPONENT.into(),
                reason: format!("{name} has no populated GID"),
            })
        }
    }
}

/// Path MTU of a connection: the smaller active MTU, lowered further by the option.
pub fn path_mtu(local: Mtu, remote: Mtu, cfg: Option<Mtu>) -> Mtu {
    let m = local.min(remote);
    cfg.map_or(m, |c| c.min(m))
}

/// Completion-queue entries one endpoint can have outstanding.
pub fn cqes_per_ep(cfg: &RcConfig) -> u32 {
    cfg.tx_depth + rx_slots(cfg)
}

/// Receive buffers posted per endpoint (data window plus grant slots).
pub fn rx_slots(cfg: &RcConfig) -> u32 {
    cfg.rx_window + grant_slots(cfg.rx_window, Credits::threshold_for(cfg.rx_window))
}

/// Attributes of an `rc_verbs` interface on a port.
pub fn rc_iface_attr(dev: &DeviceAttrs, p: &PortAttrs, cfg: &RcConfig) -> IfaceAttr {
    let seg = cfg.seg_size;
    let max_zcopy = (p.max_msg_sz as usize).clamp(1, 1 << 30);
    let max_iov = (dev.max_sge as usize).clamp(2, MAX_IOV) - 1;
    let mtu = cfg.path_mtu.map_or(p.active_mtu, |m| m.min(p.active_mtu));
    let bandwidth = port_bandwidth(p, mtu).unwrap_or(FALLBACK_BANDWIDTH);
    let latency_ns = match p.link_layer {
        LinkLayer::InfiniBand => 700.0,
        LinkLayer::Ethernet => 1000.0,
    };
    IfaceAttr {
        tl_name: TL_NAME.into(),
        dev_name: port_name(&dev.name, p.port_num),
        dev_type: DeviceType::Network,
        sys_device: dev.sys_device.clone(),
        caps: IfaceCaps::AM_SHORT
            | IfaceCaps::AM_BCOPY
            | IfaceCaps::AM_ZCOPY
            | IfaceCaps::PUT_SHORT
            | IfaceCaps::PUT_ZCOPY
            | IfaceCaps::GET_ZCOPY
            | IfaceCaps::CONNECT_TO_EP
            | IfaceCaps::ERRHANDLE_PEER_FAILURE,
        limits: IfaceLimits {
            am_max_short: AM_MAX_SHORT.min(seg - HDR_LEN - 8),
            am_max_bcopy: seg - HDR_LEN,
            am_max_zcopy: seg - HDR_LEN - AM_MAX_HDR,
            am_max_hdr: AM_MAX_HDR,
            put_max_short: seg,
            put_max_zcopy: max_zcopy,
            get_max_zcopy: max_zcopy,
            max_iov,
        },
        perf: PerfModel {
            latency_ns,
            overhead_ns: 75.0,
            bandwidth,
        },
        priority: 0,
        device_addr_len: DeviceAddr::PACKED_LEN,
        iface_addr_len: 0,
        ep_addr_len: EpAddr::PACKED_LEN,
        max_eps: Some((cfg.cq_len / cqes_per_ep(cfg)).max(1) as usize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpudirect::{DmabufSupport, GpuFacts, NicGdrFacts, decide};
    use crate::probe::tests::{port, report};
    use crate::verbs::PortState;
    use rucx_ucs::{Config, Ternary};

    fn rc_cfg() -> RcConfig {
        RcConfig::from_config(&Config::new(&[crate::CONFIG]).unwrap()).unwrap()
    }

    #[test]
    fn iface_attr_from_synthetic_edr_port() {
        let rep = report(
            "mlx5_0",
            vec![port(1, PortState::Active, LinkLayer::InfiniBand, 8)],
        );
        let a = rc_iface_attr(&rep.attrs, &rep.ports[0], &rc_cfg());
        assert_eq!(a.tl_name, "rc_verbs");
        assert_eq!(a.dev_name, "mlx5_0:1");
        assert_eq!(a.dev_type, DeviceType::Network);
        assert!(a.has(IfaceCaps::CONNECT_TO_EP | IfaceCaps::GET_ZCOPY));
        assert!(!a.has(IfaceCaps::CONNECT_TO_IFACE));
        assert_eq!(a.limits.am_max_bcopy, 8192 - 4);
        assert_eq!(a.limits.am_max_zcopy + a.limits.am_max_hdr + 4, 8192);
        assert_eq!(a.limits.put_max_zcopy, 1 << 30);
        assert_eq!(a.limits.max_iov, MAX_IOV - 1);
        // 4X EDR at MTU 4096: 12.5 GB/s * 4096/4122.
        let want = 100e9 / 8.0 * 4096.0 / 4122.0;
        assert!(
            (a.perf.bandwidth - want).abs() < 1.0,
            "{}",
            a.perf.bandwidth
        );
        assert_eq!(a.ep_addr_len, EpAddr::PACKED_LEN);
        assert_eq!(a.iface_addr_len, 0);
        // 4096 / (64 tx + 64 rx + 3 grant slots)
        assert_eq!(a.max_eps, Some(4096 / 131));
    }

    #[test]
    fn attrs_follow_the_device() {
        let mut rep = report(
            "mlx5_1",
            vec![port(1, PortState::Active, LinkLayer::Ethernet, 0)],
        );
        rep.attrs.max_sge = 3;
        rep.ports[0].active_width = 1; // 1X
        rep.ports[0].active_speed = 64; // HDR: 50 Gb/s
        rep.ports[0].max_msg_sz = 1 << 20;
        rep.ports[0].active_mtu = Mtu::M1024;
        let a = rc_iface_attr(&rep.attrs, &rep.ports[0], &rc_cfg());
        assert_eq!(a.limits.max_iov, 2);
        assert_eq!(a.limits.put_max_zcopy, 1 << 20);
        let want = 50e9 / 8.0 * 1024.0 / (1024.0 + 78.0);
        assert!((a.perf.bandwidth - want).abs() < 1.0);
        assert!(a.perf.latency_ns > 700.0);
        // Unknown speed code: fallback, no panic.
        rep.ports[0].active_speed = 12345;
        let a = rc_iface_attr(&rep.attrs, &rep.ports[0], &rc_cfg());
        assert_eq!(a.perf.bandwidth, FALLBACK_BANDWIDTH);
    }

    #[test]
    fn md_attr_follows_the_gpu_plan() {
        let rep = report(
            "mlx5_0",
            vec![port(1, PortState::Active, LinkLayer::InfiniBand, 8)],
        );
        let nic = |dmabuf: bool, peer: bool| NicGdrFacts {
            nic: "mlx5_0".into(),
            dmabuf: if dmabuf {
                DmabufSupport::Supported
            } else {
                DmabufSupport::Unsupported("no".into())
            },
            peer_mem: peer.then(|| "nvidia_peermem".into()),
            exporter: true,
        };
        let none = decide(Ternary::Try, &nic(false, false), &[]).unwrap();
        let a = md_attr(&rep.attrs, &none);
        assert!(a.reg_mem_types().has(MemoryType::Host));
        assert!(!a.reg_mem_types().has(MemoryType::Cuda));
        assert_eq!(a.max_reg, None);
        let dmabuf = decide(Ternary::Try, &nic(true, false), &[GpuFacts::default()]).unwrap();
        let a = md_attr(&rep.attrs, &dmabuf);
        assert!(
            a.flags(MemoryType::Cuda)
                .contains(MemTypeFlags::REG | MemTypeFlags::DMABUF)
        );
        let peer = decide(Ternary::Try, &nic(false, true), &[]).unwrap();
        let a = md_attr(&rep.attrs, &peer);
        assert_eq!(
            a.flags(MemoryType::Cuda),
            MemTypeFlags::REG | MemTypeFlags::ACCESS
        );
        assert!(!a.reg_mem_types().has(MemoryType::CudaManaged));
    }

    #[test]
    fn gid_selection() {
        let mut p = port(1, PortState::Active, LinkLayer::Ethernet, 0);
        let mk = |index, kind, v4: bool| {
            let mut gid = [0u8; 16];
            if v4 {
                gid[10] = 0xff;
                gid[11] = 0xff;
                gid[12] = 10;
            } else {
                gid[0] = 0xfe;
                gid[1] = 0x80;
            }
            GidEntry { index, gid, kind }
        };
        p.gids = vec![
            mk(0, GidKind::RoceV1, false),
            mk(1, GidKind::RoceV2, false),
            mk(2, GidKind::RoceV1, true),
            mk(3, GidKind::RoceV2, true),
        ];
        assert_eq!(select_gid(&p, GidChoice::Auto).unwrap().index, 3);
        p.gids.pop();
        assert_eq!(select_gid(&p, GidChoice::Auto).unwrap().index, 1);
        assert_eq!(select_gid(&p, GidChoice::Index(2)).unwrap().index, 2);
        let e = select_gid(&p, GidChoice::Index(9)).unwrap_err();
        assert!(
            e.to_string().contains("RUCX_IB_GID_INDEX") && e.to_string().contains("0, 1, 2"),
            "{e}"
        );
        p.gids.clear();
        assert!(select_gid(&p, GidChoice::Auto).is_err());
        let ib = port(1, PortState::Active, LinkLayer::InfiniBand, 4);
        assert_eq!(select_gid(&ib, GidChoice::Auto).unwrap().index, 0);
    }

    #[test]
    fn path_mtu_is_the_smallest() {
        assert_eq!(path_mtu(Mtu::M4096, Mtu::M2048, None), Mtu::M2048);
        assert_eq!(
            path_mtu(Mtu::M4096, Mtu::M4096, Some(Mtu::M1024)),
            Mtu::M1024
        );
        assert_eq!(path_mtu(Mtu::M512, Mtu::M4096, Some(Mtu::M1024)), Mtu::M512);
    }
}
