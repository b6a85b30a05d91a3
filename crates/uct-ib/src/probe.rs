//! Device discovery and availability: one UCT device per ACTIVE port (`mlx5_0:1`), and a precise
//! reason when there is none.
//!
//! [`probe`] gathers facts through the [`Verbs`] seam; [`availability`] and [`usable_ports`] are
//! pure functions of those facts, so every branch is tested with synthetic reports.

use std::fmt::Write as _;

use rucx_ucs::{Error, Result};
use rucx_uct::Availability;

use crate::verbs::{
    DeviceReport, LinkLayer, PortAttrs, PortState, SysfsDevices, Verbs, VerbsError, lane_rate,
    link_gbps, width_name,
};

/// The UCT device name of a port: `mlx5_0:1`.
pub fn port_name(dev: &str, port: u8) -> String {
    format!("{dev}:{port}")
}

/// Split `mlx5_0:1` into device and port.
pub fn parse_port_name(name: &str) -> Option<(&str, u8)> {
    let (d, p) = name.rsplit_once(':')?;
    if d.is_empty() {
        return None;
    }
    Some((d, p.parse().ok()?))
}

/// Which devices and ports the user allows (`RUCX_IB_DEVICES`): empty means all; each entry is
/// a device (`mlx5_0`) or a port (`mlx5_0:1`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceFilter {
    entries: Vec<(String, Option<u8>)>,
    text: String,
}

impl DeviceFilter {
    /// Every device and port.
    pub fn all() -> Self {
        Self::default()
    }

    /// Parse the list; a malformed entry is a configuration error naming the variable.
    pub fn parse(list: &[String]) -> Result<Self> {
        let mut entries = Vec::new();
        for w in list {
            let w = w.trim();
            if w.is_empty() {
                continue;
            }
            if w.contains(':') {
                let (d, p) = parse_port_name(w).ok_or_else(|| Error::Config {
                    var: "RUCX_IB_DEVICES".into(),
                    value: list.join(","),
                    reason: format!("{w:?} is not DEVICE or DEVICE:PORT"),
                    accepted:
                        "comma-separated device names (mlx5_0) or ports (mlx5_0:1); empty for all"
                            .into(),
                })?;
                entries.push((d.to_string(), Some(p)));
            } else {
                entries.push((w.to_string(), None));
            }
        }
        Ok(DeviceFilter {
            entries,
            text: list.join(","),
        })
    }

    /// Whether a port passes.
    pub fn allows(&self, dev: &str, port: u8) -> bool {
        self.entries.is_empty()
            || self
                .entries
                .iter()
                .any(|(d, p)| d == dev && p.is_none_or(|p| p == port))
    }

    /// True when every port passes.
    pub fn is_all(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The ports of a device this component uses (ACTIVE and allowed), and why each other port is
/// left out.
pub fn usable_ports<'a>(
    report: &'a DeviceReport,
    filter: &DeviceFilter,
) -> (Vec<&'a PortAttrs>, Vec<String>) {
    let mut ok = Vec::new();
    let mut skipped = Vec::new();
    for p in &report.ports {
        let name = port_name(&report.attrs.name, p.port_num);
        if !filter.allows(&report.attrs.name, p.port_num) {
            skipped.push(format!("{name} is not in RUCX_IB_DEVICES"));
        } else if p.state != PortState::Active {
            skipped.push(format!("{name} is {}", p.state));
        } else if p.link_layer == LinkLayer::InfiniBand && (p.lid == 0 || p.lid >= 0xc000) {
            skipped.push(format!(
                "{name} is ACTIVE but has no unicast LID ({:#x}; is a subnet manager running?)",
                p.lid
            ));
        } else if p.link_layer == LinkLayer::Ethernet && p.gids.is_empty() {
            skipped.push(format!(
                "{name} is ACTIVE but has no GID (no IP address on its network interface)"
            ));
        } else {
            ok.push(p);
        }
    }
    (ok, skipped)
}

/// Everything discovery learned about this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostProbe {
    /// Loading libibverbs: the loader's error when it failed.
    pub library: std::result::Result<(), String>,
    /// What sysfs shows.
    pub sysfs: SysfsDevices,
    /// The devices libibverbs lists with their query results; `None` when the library or the
    /// kernel side is missing, so nothing was asked.
    pub devices: Option<std::result::Result<Vec<DeviceQuery>, VerbsError>>,
}

/// One listed device: its report or why the query failed.
pub type DeviceQuery = (String, std::result::Result<DeviceReport, VerbsError>);

/// Gather the facts (no side effects beyond opening and closing each device once).
pub fn probe(verbs: &dyn Verbs) -> HostProbe {
    let library = verbs.library_status();
    let sysfs = verbs.sysfs_devices();
    let devices = if library.is_ok() && sysfs != SysfsDevices::Missing {
        Some(verbs.device_names().map(|names| {
            names
                .into_iter()
                .map(|n| {
                    let r = verbs.query_device(&n);
                    (n, r)
                })
                .collect()
        }))
    } else {
        None
    };
    HostProbe {
        library,
        sysfs,
        devices,
    }
}

const NO_KERNEL: &str = "no RDMA devices: /sys/class/infiniband does not exist (no RDMA driver is \
                         loaded: ib_core, ib_uverbs and a NIC driver such as mlx5_ib)";

/// Whether the component can run, from the facts; when it can, the memory domains (one per
/// device with at least one usable port, named after the device).
pub fn availability(p: &HostProbe, filter: &DeviceFilter) -> Availability {
    if let Err(msg) = &p.library {
        let mut reason =
            format!("libibverbs.so.1 not found (install rdma-core/libibverbs1): {msg}");
        match &p.sysfs {
            SysfsDevices::Missing => reason.push_str(
                "; there are no RDMA devices either: /sys/class/infiniband does not exist",
            ),
            SysfsDevices::Empty => reason
                .push_str("; there are no RDMA devices either: /sys/class/infiniband is empty"),
            SysfsDevices::Present(d) => {
                let _ = write!(reason, "; sysfs lists RDMA devices {}", d.join(", "));
            }
        }
        return Availability::Unavailable(reason);
    }
    match &p.sysfs {
        SysfsDevices::Missing => return Availability::Unavailable(NO_KERNEL.into()),
        SysfsDevices::Empty => {
            return Availability::Unavailable(
                "no RDMA devices: /sys/class/infiniband is empty".into(),
            );
        }
        SysfsDevices::Present(_) => {}
    }
    let devices = match &p.devices {
        None => return Availability::Unavailable("RDMA devices were not queried".into()),
        Some(Err(e)) => {
            return Availability::Unavailable(format!(
                "cannot list RDMA devices: {e} (is ib_uverbs loaded and /dev/infiniband accessible?)"
            ));
        }
        Some(Ok(d)) => d,
    };
    if devices.is_empty() {
        let sys = match &p.sysfs {
            SysfsDevices::Present(d) => d.join(", "),
            _ => String::new(),
        };
        return Availability::Unavailable(format!(
            "no RDMA devices: libibverbs lists none although sysfs shows {sys} (is the \
             user-space provider for the NIC installed, e.g. ibverbs-providers/libmlx5?)"
        ));
    }
    let mut mds = Vec::new();
    let mut why = Vec::new();
    for (name, r) in devices {
        match r {
            Err(e) => why.push(format!("{name}: {e}")),
            Ok(rep) => {
                let (ok, skipped) = usable_ports(rep, filter);
                if ok.is_empty() {
                    why.extend(skipped);
                } else {
                    mds.push(name.clone());
                }
            }
        }
    }
    if mds.is_empty() {
        let head = if filter.is_all() {
            "no ACTIVE RDMA port".to_string()
        } else {
            format!(
                "no usable RDMA port matches RUCX_IB_DEVICES={}",
                filter.text
            )
        };
        Availability::Unavailable(format!("{head}: {}", why.join("; ")))
    } else {
        Availability::Available(mds)
    }
}

/// One line per port in the style of `ucx_info -d` / `ibv_devinfo`, for `rucx-info`.
pub fn describe_port(dev: &DeviceReport, p: &PortAttrs) -> String {
    let mut s = format!(
        "{}: {} {}, link {}",
        port_name(&dev.attrs.name, p.port_num),
        p.state,
        if p.phys_state == 5 { "(LinkUp)" } else { "" },
        p.link_layer
    );
    if p.link_layer == LinkLayer::InfiniBand {
        let _ = write!(s, ", lid {}", p.lid);
    }
    let _ = write!(s, ", mtu {} (max {})", p.active_mtu, p.max_mtu);
    match (
        link_gbps(p.active_width, p.active_speed),
        lane_rate(p.active_speed),
    ) {
        (Some(g), Some((_, generation))) => {
            let _ = write!(
                s,
                ", {} {generation} ({g} Gb/s)",
                width_name(p.active_width)
            );
        }
        _ => {
            let _ = write!(
                s,
                ", width code {} speed code {} (rate unknown)",
                p.active_width, p.active_speed
            );
        }
    }
    for g in p.gids.iter().take(4) {
        let _ = write!(s, ", gid[{}] {} ({})", g.index, g.as_ipv6(), g.kind);
    }
    if p.gids.len() > 4 {
        let _ = write!(s, ", {} more gids", p.gids.len() - 4);
    }
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::verbs::{DeviceAttrs, GidEntry, GidKind, Mtu};

    pub(crate) fn port(num: u8, state: PortState, link: LinkLayer, lid: u16) -> PortAttrs {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[15] = num;
        PortAttrs {
            port_num: num,
            state,
            phys_state: 5,
            link_layer: link,
            lid,
            sm_lid: 1,
            lmc: 0,
            active_mtu: Mtu::M4096,
            max_mtu: Mtu::M4096,
            active_width: 2,
            active_speed: 32,
            max_msg_sz: 1 << 30,
            gid_tbl_len: 128,
            gids: vec![GidEntry {
                index: 0,
                gid,
                kind: if link == LinkLayer::InfiniBand {
                    GidKind::Ib
                } else {
                    GidKind::RoceV2
                },
            }],
        }
    }

    pub(crate) fn report(name: &str, ports: Vec<PortAttrs>) -> DeviceReport {
        DeviceReport {
            attrs: DeviceAttrs {
                name: name.into(),
                phys_port_cnt: ports.len() as u8,
                max_mr_size: u64::MAX,
                max_qp_wr: 32768,
                max_sge: 30,
                max_cqe: 4_194_303,
                max_qp_rd_atom: 16,
                max_qp_init_rd_atom: 16,
                ..Default::default()
            },
            ports,
        }
    }

    fn host(devices: Vec<DeviceQuery>) -> HostProbe {
        let names = devices.iter().map(|(n, _)| n.clone()).collect();
        HostProbe {
            library: Ok(()),
            sysfs: SysfsDevices::Present(names),
            devices: Some(Ok(devices)),
        }
    }

    fn reason(a: Availability) -> String {
        match a {
            Availability::Unavailable(r) => r,
            Availability::Available(m) => panic!("expected unavailable, got {m:?}"),
        }
    }

    #[test]
    fn port_names() {
        assert_eq!(port_name("mlx5_0", 1), "mlx5_0:1");
        assert_eq!(parse_port_name("mlx5_0:1"), Some(("mlx5_0", 1)));
        assert_eq!(parse_port_name("a:b:2"), Some(("a:b", 2)));
        assert_eq!(parse_port_name(":1"), None);
        assert_eq!(parse_port_name("mlx5_0"), None);
        assert_eq!(parse_port_name("mlx5_0:999"), None);
    }

    #[test]
    fn this_machine_shape_no_library_no_sysfs() {
        let p = HostProbe {
            library: Err(
                "libibverbs.so.1: cannot open shared object file: No such file or directory".into(),
            ),
            sysfs: SysfsDevices::Missing,
            devices: None,
        };
        let r = reason(availability(&p, &DeviceFilter::all()));
        assert!(
            r.starts_with("libibverbs.so.1 not found (install rdma-core/libibverbs1)"),
            "{r}"
        );
        assert!(r.contains("/sys/class/infiniband does not exist"), "{r}");
    }

    #[test]
    fn library_present_kernel_side_missing_or_empty() {
        let mut p = HostProbe {
            library: Ok(()),
            sysfs: SysfsDevices::Missing,
            devices: None,
        };
        assert!(reason(availability(&p, &DeviceFilter::all())).contains("does not exist"));
        p.sysfs = SysfsDevices::Empty;
        assert_eq!(
            reason(availability(&p, &DeviceFilter::all())),
            "no RDMA devices: /sys/class/infiniband is empty"
        );
        p.sysfs = SysfsDevices::Present(vec!["mlx5_0".into()]);
        p.devices = Some(Ok(vec![]));
        let r = reason(availability(&p, &DeviceFilter::all()));
        assert!(
            r.contains("libibverbs lists none") && r.contains("mlx5_0"),
            "{r}"
        );
        p.devices = Some(Err(VerbsError::new("ibv_get_device_list", libc::ENOSYS)));
        assert!(reason(availability(&p, &DeviceFilter::all())).contains("ibv_get_device_list"));
    }

    #[test]
    fn one_md_per_device_with_an_active_port() {
        let p = host(vec![
            (
                "mlx5_0".into(),
                Ok(report(
                    "mlx5_0",
                    vec![port(1, PortState::Active, LinkLayer::InfiniBand, 8)],
                )),
            ),
            (
                "mlx5_1".into(),
                Ok(report(
                    "mlx5_1",
                    vec![port(1, PortState::Down, LinkLayer::InfiniBand, 0)],
                )),
            ),
            (
                "mlx5_2".into(),
                Err(VerbsError::new("ibv_open_device", libc::EACCES)),
            ),
        ]);
        assert_eq!(
            availability(&p, &DeviceFilter::all()),
            Availability::Available(vec!["mlx5_0".into()])
        );
    }

    #[test]
    fn no_active_port_lists_every_port_state() {
        let p = host(vec![(
            "mlx5_0".into(),
            Ok(report(
                "mlx5_0",
                vec![
                    port(1, PortState::Down, LinkLayer::InfiniBand, 0),
                    port(2, PortState::Init, LinkLayer::InfiniBand, 0),
                    port(3, PortState::Active, LinkLayer::InfiniBand, 0),
                ],
            )),
        )]);
        let r = reason(availability(&p, &DeviceFilter::all()));
        assert!(r.starts_with("no ACTIVE RDMA port"), "{r}");
        for want in [
            "mlx5_0:1 is DOWN",
            "mlx5_0:2 is INIT",
            "mlx5_0:3 is ACTIVE but has no unicast LID",
        ] {
            assert!(r.contains(want), "{r} lacks {want}");
        }
    }

    #[test]
    fn filter_selects_devices_and_ports() {
        let rep = report(
            "mlx5_0",
            vec![
                port(1, PortState::Active, LinkLayer::InfiniBand, 3),
                port(2, PortState::Active, LinkLayer::Ethernet, 0),
            ],
        );
        let f = DeviceFilter::parse(&["mlx5_0:2".into()]).unwrap();
        let (ok, skipped) = usable_ports(&rep, &f);
        assert_eq!(ok.iter().map(|p| p.port_num).collect::<Vec<_>>(), vec![2]);
        assert_eq!(
            skipped,
            vec!["mlx5_0:1 is not in RUCX_IB_DEVICES".to_string()]
        );
        let f = DeviceFilter::parse(&["mlx5_0".into()]).unwrap();
        assert_eq!(usable_ports(&rep, &f).0.len(), 2);
        let f = DeviceFilter::parse(&["mlx5_9".into()]).unwrap();
        let p = host(vec![("mlx5_0".into(), Ok(rep))]);
        let r = reason(availability(&p, &f));
        assert!(r.contains("RUCX_IB_DEVICES=mlx5_9"), "{r}");
        assert!(DeviceFilter::parse(&["mlx5_0:x".into()]).is_err());
    }

    #[test]
    fn roce_port_without_gid_is_skipped() {
        let mut p = port(1, PortState::Active, LinkLayer::Ethernet, 0);
        p.gids.clear();
        let rep = report("rxe0", vec![p]);
        let (ok, skipped) = usable_ports(&rep, &DeviceFilter::all());
        assert!(ok.is_empty());
        assert!(skipped[0].contains("no GID"), "{skipped:?}");
    }

    #[test]
    fn port_description() {
        let rep = report(
            "mlx5_0",
            vec![port(1, PortState::Active, LinkLayer::InfiniBand, 8)],
        );
        let s = describe_port(&rep, &rep.ports[0]);
        for want in [
            "mlx5_0:1",
            "ACTIVE",
            "InfiniBand",
            "lid 8",
            "mtu 4096",
            "4X EDR (100 Gb/s)",
            "gid[0] fe80::1",
        ] {
            assert!(s.contains(want), "{s} lacks {want}");
        }
        let mut odd = rep.ports[0].clone();
        odd.active_speed = 3;
        assert!(describe_port(&rep, &odd).contains("rate unknown"));
    }
}
