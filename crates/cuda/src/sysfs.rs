//! PCI topology from sysfs: device paths, NUMA nodes, RDMA NICs, and the path class between two
//! PCI devices.
//!
//! Every function takes the sysfs root (normally `/sys`) so tests can run on a synthetic tree.

use std::fmt;
use std::path::{Path, PathBuf};

/// Normalize a PCI bus id to the sysfs form `dddd:bb:dd.f` in lower case.
///
/// Accepts the CUDA form (`0000:19:00.0`), the NVML form (`00000000:19:00.0`) and a form
/// without domain (`19:00.0`, domain 0). Returns `None` for anything else.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().trim_end_matches('\0');
    let parts: Vec<&str> = id.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (u32::from_str_radix(d, 16).ok()?, *b, *df),
        [b, df] => (0, *b, *df),
        _ => return None,
    };
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let (dev, func) = devfn.split_once('.')?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if domain > 0xffff || dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// Whether a path component looks like a PCI function (`0000:19:00.0`).
fn is_bdf(s: &str) -> bool {
    normalize_bus_id(s).is_some_and(|n| n == s.to_ascii_lowercase()) && s.matches(':').count() == 2
}

/// A PCI device's position in the hierarchy: the host bridge (`pci0000:00`) and the chain of
/// functions from the root port down to the device itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciPath {
    /// Host bridge / root complex, e.g. `pci0000:00`.
    pub root: String,
    /// Bus ids from the root port down to the device (last element: the device).
    pub chain: Vec<String>,
}

impl PciPath {
    /// Parse a resolved sysfs device path such as
    /// `/sys/devices/pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:00.0`.
    /// Returns `None` when the path holds no `pciDDDD:BB` root (a virtual device).
    pub fn parse(path: &str) -> Option<PciPath> {
        let mut comps = path.split('/').filter(|c| !c.is_empty());
        let root = comps.find(|c| c.starts_with("pci") && c.len() > 3 && c[3..].contains(':'))?;
        let chain: Vec<String> = comps
            .take_while(|c| is_bdf(c))
            .map(|c| c.to_ascii_lowercase())
            .collect();
        if chain.is_empty() {
            return None;
        }
        Some(PciPath {
            root: root.to_string(),
            chain,
        })
    }

    /// The device's own bus id.
    pub fn bus_id(&self) -> &str {
        self.chain.last().map(String::as_str).unwrap_or("")
    }
}

impl fmt::Display for PciPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.root, self.chain.join("/"))
    }
}

/// How two PCI devices are connected, from closest to farthest (the classes NCCL calls PIX/PXB,
/// PHB and SYS).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PciPathClass {
    /// Behind a common PCIe switch (or root port): peer-to-peer traffic stays below the CPU.
    /// `bridges` counts the bridges between the devices.
    SameSwitch {
        /// Bridges traversed from one device to the other.
        bridges: u32,
    },
    /// Under the same root complex but different root ports: traffic crosses the CPU's host
    /// bridge.
    SameRootComplex,
    /// Different root complexes on the same NUMA node.
    CrossRootComplex,
    /// Different NUMA nodes: traffic crosses the inter-socket link.
    CrossSocket,
    /// Unknown (no sysfs path for one of the devices, e.g. in a VM or container).
    Unknown,
}

impl PciPathClass {
    /// Short name for tables.
    pub fn short(&self) -> &'static str {
        match self {
            PciPathClass::SameSwitch { .. } => "same-switch",
            PciPathClass::SameRootComplex => "same-root-complex",
            PciPathClass::CrossRootComplex => "cross-root-complex",
            PciPathClass::CrossSocket => "cross-socket",
            PciPathClass::Unknown => "unknown",
        }
    }

    /// Whether GPU-direct peer-to-peer DMA over this path usually performs well (kept below the
    /// CPU).
    pub fn is_p2p_friendly(&self) -> bool {
        matches!(self, PciPathClass::SameSwitch { .. })
    }
}

impl fmt::Display for PciPathClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PciPathClass::SameSwitch { bridges } => {
                write!(f, "same PCIe switch ({bridges} bridge(s) apart)")
            }
            PciPathClass::SameRootComplex => f.write_str("same root complex, different root ports"),
            PciPathClass::CrossRootComplex => {
                f.write_str("different root complexes, same NUMA node")
            }
            PciPathClass::CrossSocket => f.write_str("across sockets (different NUMA nodes)"),
            PciPathClass::Unknown => f.write_str("unknown (no PCI path in sysfs)"),
        }
    }
}

/// Classify the connection between two devices from their PCI paths and NUMA nodes.
pub fn classify_path(
    a: Option<&PciPath>,
    a_numa: Option<u32>,
    b: Option<&PciPath>,
    b_numa: Option<u32>,
) -> PciPathClass {
    let (Some(a), Some(b)) = (a, b) else {
        return PciPathClass::Unknown;
    };
    if a.root != b.root {
        return match (a_numa, b_numa) {
            (Some(x), Some(y)) if x != y => PciPathClass::CrossSocket,
            (Some(_), Some(_)) => PciPathClass::CrossRootComplex,
            // Without NUMA information, two root complexes are most often two sockets.
            _ => PciPathClass::CrossSocket,
        };
    }
    let common = a
        .chain
        .iter()
        .zip(&b.chain)
        .take_while(|(x, y)| x == y)
        .count();
    if common == 0 {
        return PciPathClass::SameRootComplex;
    }
    // Bridges between the two: each side's hops below the common ancestor, minus the devices
    // themselves, plus the shared ancestor.
    let below_a = (a.chain.len() - common).saturating_sub(1);
    let below_b = (b.chain.len() - common).saturating_sub(1);
    PciPathClass::SameSwitch {
        bridges: (below_a + below_b + 1) as u32,
    }
}

/// Resolve `link` (a sysfs symlink to a device) into a parsed PCI path.
fn resolve_pci(link: &Path) -> Option<PciPath> {
    let real = std::fs::canonicalize(link).ok()?;
    PciPath::parse(&real.to_string_lossy())
}

/// Read a NUMA node file; `-1` (no affinity) and errors give `None`.
fn read_numa(dev_dir: &Path) -> Option<u32> {
    let s = std::fs::read_to_string(dev_dir.join("numa_node")).ok()?;
    let n: i64 = s.trim().parse().ok()?;
    u32::try_from(n).ok()
}

/// PCI path and NUMA node of the PCI function `bus_id`, from `<root>/bus/pci/devices/<bus_id>`.
pub fn pci_device(root: &Path, bus_id: &str) -> (Option<PciPath>, Option<u32>) {
    let Some(id) = normalize_bus_id(bus_id) else {
        return (None, None);
    };
    let dir = root.join("bus/pci/devices").join(&id);
    (resolve_pci(&dir), read_numa(&dir))
}

/// One RDMA device found under `<root>/class/infiniband`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Verbs device name, e.g. `mlx5_0`.
    pub name: String,
    /// Resolved PCI path (none for software devices such as `rxe0` or `siw0`).
    pub pci: Option<PciPath>,
    /// NUMA node of the PCI function.
    pub numa_node: Option<u32>,
}

/// List RDMA devices, sorted by name. A missing class directory means none.
pub fn rdma_devices(root: &Path) -> Vec<RdmaDevice> {
    let dir = root.join("class/infiniband");
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<RdmaDevice> = rd
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let dev = e.path().join("device");
            let pci = resolve_pci(&dev);
            let numa_node = if pci.is_some() { read_numa(&dev) } else { None };
            RdmaDevice {
                name,
                pci,
                numa_node,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Where a kernel-side piece lives: path and whether it exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathProbe {
    /// Absolute path probed.
    pub path: PathBuf,
    /// Whether it exists.
    pub exists: bool,
}

/// Probe each of `rel` (relative to `root`; absolute `/dev` paths are taken as given).
pub fn probe(root: &Path, rel: &[&str]) -> Vec<PathProbe> {
    rel.iter()
        .map(|r| {
            let path = if r.starts_with("/dev/") {
                PathBuf::from(r)
            } else {
                root.join(r)
            };
            let exists = path.exists();
            PathProbe { path, exists }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::fs;

    /// A scratch directory removed on drop.
    pub(crate) struct Scratch(pub PathBuf);

    impl Scratch {
        pub(crate) fn new(tag: &str) -> Scratch {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p =
                std::env::temp_dir().join(format!("rucx-cuda-{tag}-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Create a PCI function directory under `devices/<path>` with a NUMA node, and the
    /// `bus/pci/devices/<bdf>` symlink to it.
    pub(crate) fn add_pci(root: &Path, path: &str, numa: i32) -> PathBuf {
        let dir = root.join("devices").join(path);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        let bdf = path.rsplit('/').next().unwrap();
        let links = root.join("bus/pci/devices");
        fs::create_dir_all(&links).unwrap();
        let _ = std::os::unix::fs::symlink(&dir, links.join(bdf));
        dir
    }

    pub(crate) fn add_nic(root: &Path, name: &str, pci_dir: Option<&Path>) {
        let d = root.join("class/infiniband").join(name);
        fs::create_dir_all(&d).unwrap();
        if let Some(p) = pci_dir {
            std::os::unix::fs::symlink(p, d.join("device")).unwrap();
        }
    }

    #[test]
    fn bus_ids() {
        assert_eq!(
            normalize_bus_id("0000:19:00.0").as_deref(),
            Some("0000:19:00.0")
        );
        assert_eq!(
            normalize_bus_id("00000000:19:00.0").as_deref(),
            Some("0000:19:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:AB:1F.7").as_deref(),
            Some("0000:ab:1f.7")
        );
        assert_eq!(normalize_bus_id("19:00.0").as_deref(), Some("0000:19:00.0"));
        assert_eq!(
            normalize_bus_id("0000:19:00.0\0\0").as_deref(),
            Some("0000:19:00.0")
        );
        for bad in [
            "",
            "pci0000:00",
            "0000:19:00",
            "0000:19:20.0",
            "0000:19:00.8",
            "zz:00.0",
            "1:2:3:4",
        ] {
            assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
        }
    }

    fn p(s: &str) -> PciPath {
        PciPath::parse(s).unwrap()
    }

    #[test]
    fn path_parsing() {
        let x = p("/sys/devices/pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:00.0");
        assert_eq!(x.root, "pci0000:00");
        assert_eq!(x.chain, ["0000:00:01.0", "0000:02:00.0", "0000:03:00.0"]);
        assert_eq!(x.bus_id(), "0000:03:00.0");
        // Trailing non-PCI components (e.g. a class dir) are cut.
        let y = p("/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0/infiniband/mlx5_0");
        assert_eq!(y.chain, ["0000:17:00.0", "0000:18:00.0"]);
        assert!(PciPath::parse("/sys/devices/virtual/net/lo").is_none());
        assert!(PciPath::parse("/sys/devices/pci0000:00").is_none());
        assert_eq!(
            x.to_string(),
            "pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:00.0"
        );
    }

    #[test]
    fn path_classes() {
        let gpu = p("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0");
        let nic_same_sw =
            p("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0");
        let nic_other_port = p("/sys/devices/pci0000:00/0000:00:03.0/0000:09:00.0");
        let nic_other_rc = p("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0");
        let c = |b: &PciPath, an, bn| classify_path(Some(&gpu), an, Some(b), bn);
        assert_eq!(
            c(&nic_same_sw, Some(0), Some(0)),
            PciPathClass::SameSwitch { bridges: 3 }
        );
        assert!(c(&nic_same_sw, None, None).is_p2p_friendly());
        assert_eq!(
            c(&nic_other_port, Some(0), Some(0)),
            PciPathClass::SameRootComplex
        );
        assert_eq!(
            c(&nic_other_rc, Some(0), Some(1)),
            PciPathClass::CrossSocket
        );
        assert_eq!(
            c(&nic_other_rc, Some(0), Some(0)),
            PciPathClass::CrossRootComplex
        );
        assert_eq!(c(&nic_other_rc, None, None), PciPathClass::CrossSocket);
        assert_eq!(
            classify_path(None, None, Some(&gpu), None),
            PciPathClass::Unknown
        );
        // Two functions directly under one root port's switch port.
        let a = p("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        let b = p("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.1");
        assert_eq!(
            classify_path(Some(&a), None, Some(&b), None),
            PciPathClass::SameSwitch { bridges: 1 }
        );
        assert!(PciPathClass::SameSwitch { bridges: 1 } < PciPathClass::CrossSocket);
    }

    #[test]
    fn synthetic_sysfs_tree() {
        let s = Scratch::new("sysfs");
        let root = &s.0;
        let gpu = add_pci(
            root,
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0",
            0,
        );
        let nic = add_pci(
            root,
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0",
            -1,
        );
        add_nic(root, "mlx5_0", Some(&nic));
        add_nic(root, "rxe0", None);
        let (gp, gn) = pci_device(root, "00000000:05:00.0");
        assert_eq!(gp.as_ref().unwrap().bus_id(), "0000:05:00.0");
        assert_eq!(gn, Some(0));
        let nics = rdma_devices(root);
        assert_eq!(nics.len(), 2);
        assert_eq!(nics[0].name, "mlx5_0");
        assert_eq!(nics[0].numa_node, None);
        assert_eq!(nics[0].pci.as_ref().unwrap().bus_id(), "0000:06:00.0");
        assert_eq!(nics[1].name, "rxe0");
        assert!(nics[1].pci.is_none());
        assert_eq!(
            classify_path(gp.as_ref(), gn, nics[0].pci.as_ref(), nics[0].numa_node),
            PciPathClass::SameSwitch { bridges: 3 }
        );
        assert!(gpu.exists());
        let (none, _) = pci_device(root, "0000:99:00.0");
        assert!(none.is_none());
        assert!(rdma_devices(&root.join("nope")).is_empty());
        let pr = probe(root, &["class/infiniband", "module/gdrdrv"]);
        assert!(pr[0].exists && !pr[1].exists);
    }
}
