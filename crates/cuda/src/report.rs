//! The per-GPU GPU-direct report: what each GPU, the host and its NICs offer, and a verdict with
//! reasons for every GPU path rucx may use (GPU-direct RDMA to each NIC, gdrcopy, cuda_ipc to
//! each other GPU).
//!
//! Facts are gathered into plain structs ([`HostFacts`], [`GpuFacts`], [`NicFacts`]); the
//! verdicts are pure functions of them ([`rdma_verdict`], [`gdrcopy_verdict`],
//! [`cuda_ipc_verdict`], [`verdicts`]), so they can be tested on synthetic machines.

use std::fmt;
use std::path::Path;

pub use crate::nvml::Bar1;
use crate::sysfs::{self, PathProbe, PciPath, PciPathClass};

/// Paths whose existence shows a peer-memory module (GPU-direct RDMA through `ibv_reg_mr`).
pub const PEER_MEMORY_PATHS: &[&str] = &[
    "kernel/mm/memory_peers/nv_mem/version",
    "module/nvidia_peermem",
    "module/nv_peer_mem",
];

/// Paths whose existence shows the gdrcopy kernel driver.
pub const GDRDRV_PATHS: &[&str] = &["/dev/gdrdrv", "module/gdrdrv"];

/// Library names of the gdrcopy user library.
pub const GDRAPI_LIBS: &[&str] = &["libgdrapi.so.2", "libgdrapi.so"];

/// BAR1 free space under which a path is called limited (fraction of the total).
pub const BAR1_LOW_FREE_FRACTION: f64 = 0.10;

/// One RDMA NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicFacts {
    /// Verbs device name, e.g. `mlx5_0`.
    pub name: String,
    /// PCI path (none for software devices such as `rxe0`).
    pub pci_path: Option<PciPath>,
    /// NUMA node.
    pub numa_node: Option<u32>,
}

/// How NVLink connects two GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvlinkPath {
    /// No NVLink between them.
    None,
    /// Links that end at the peer itself.
    Direct {
        /// Links between the two GPUs.
        links: u32,
    },
    /// Through NVSwitches (NVML reports NVLink peer-to-peer, but no link ends at the peer).
    Switched {
        /// Active links of this GPU.
        links: u32,
    },
}

impl fmt::Display for NvlinkPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NvlinkPath::None => f.write_str("none"),
            NvlinkPath::Direct { links } => write!(f, "{links} direct link(s)"),
            NvlinkPath::Switched { links } => {
                write!(f, "through NVSwitch ({links} active link(s) on this GPU)")
            }
        }
    }
}

/// Another GPU as seen from one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerFacts {
    /// CUDA ordinal of the peer.
    pub ordinal: u32,
    /// Peer's PCI bus id.
    pub pci_bus_id: String,
    /// `cuDeviceCanAccessPeer` (None: the query failed).
    pub can_access_peer: Option<bool>,
    /// NVLink between the two (None: unknown, NVML not available).
    pub nvlink: Option<NvlinkPath>,
}

/// The NVLink path to `peer_bus` from a GPU whose links are `state`, given whether NVML
/// reports NVLink peer-to-peer between the two (`p2p`).
pub fn nvlink_path(
    state: &crate::nvml::NvlinkState,
    peer_bus: &str,
    p2p: Option<bool>,
) -> NvlinkPath {
    let direct: u32 = state
        .remotes
        .iter()
        .filter(|(b, _)| b == peer_bus)
        .map(|(_, n)| *n)
        .sum();
    if direct > 0 {
        NvlinkPath::Direct { links: direct }
    } else if p2p == Some(true) && state.active > 0 {
        NvlinkPath::Switched {
            links: state.active,
        }
    } else {
        NvlinkPath::None
    }
}

/// Everything the report knows about one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFacts {
    /// CUDA ordinal.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// PCI bus id (`0000:19:00.0`).
    pub pci_bus_id: String,
    /// PCI path in sysfs.
    pub pci_path: Option<PciPath>,
    /// NUMA node from sysfs.
    pub numa_node: Option<u32>,
    /// Device memory in bytes.
    pub total_mem: u64,
    /// BAR1 figures, or why they are unknown.
    pub bar1: Result<Bar1, String>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: bool,
    /// The driver exports `cuMemGetHandleForAddressRange`.
    pub dmabuf_export_entry: bool,
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`.
    pub memory_pools: bool,
    /// Active NVLink links (None: unknown).
    pub nvlink_active: Option<u32>,
    /// Every other GPU.
    pub peers: Vec<PeerFacts>,
}

impl GpuFacts {
    /// Whether dma-buf export of device memory is possible (attribute and entry point).
    pub fn dmabuf_export(&self) -> bool {
        self.dma_buf && self.dmabuf_export_entry
    }
}

/// Host-wide facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    /// CUDA driver API version (`13.0`) or why there is no usable driver.
    pub driver: Result<String, String>,
    /// Kernel driver version from NVML, or why NVML is unavailable.
    pub nvml: Result<String, String>,
    /// The peer-memory paths probed.
    pub peer_memory: Vec<PathProbe>,
    /// The gdrcopy driver paths probed.
    pub gdrdrv: Vec<PathProbe>,
    /// The gdrcopy library that could be loaded, if any.
    pub gdrapi: Option<String>,
    /// RDMA NICs.
    pub nics: Vec<NicFacts>,
}

impl HostFacts {
    /// Whether a peer-memory module is loaded.
    pub fn peer_memory_loaded(&self) -> bool {
        self.peer_memory.iter().any(|p| p.exists)
    }

    /// Whether the gdrcopy kernel driver is present.
    pub fn gdrdrv_present(&self) -> bool {
        self.gdrdrv.iter().any(|p| p.exists)
    }
}

/// How usable a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    /// Works and should perform well.
    Supported,
    /// Works within limits (aperture, topology); rucx falls back to staging where needed.
    Limited,
    /// Cannot work; rucx uses another path.
    Unsupported,
}

impl Verdict {
    /// Lower-case word.
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Supported => "supported",
            Verdict::Limited => "limited",
            Verdict::Unsupported => "unsupported",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

/// Which path a verdict is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathKind {
    /// GPU-direct RDMA to a NIC (`None`: the host has no NIC).
    GpuDirectRdma(Option<String>),
    /// CPU-mapped GPU memory through gdrcopy.
    GdrCopy,
    /// cuda_ipc to another GPU (`None`: no other GPU, same-GPU IPC only).
    CudaIpc(Option<u32>),
}

impl fmt::Display for PathKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathKind::GpuDirectRdma(Some(n)) => write!(f, "GPU-direct RDMA to {n}"),
            PathKind::GpuDirectRdma(None) => f.write_str("GPU-direct RDMA"),
            PathKind::GdrCopy => f.write_str("gdrcopy"),
            PathKind::CudaIpc(Some(p)) => write!(f, "cuda_ipc to GPU {p}"),
            PathKind::CudaIpc(None) => f.write_str("cuda_ipc"),
        }
    }
}

/// A verdict on one path, with the reasons (facts for and against).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathVerdict {
    /// The path.
    pub path: PathKind,
    /// The verdict.
    pub verdict: Verdict,
    /// Why, one fact per entry, the deciding ones first.
    pub reasons: Vec<String>,
}

struct Builder {
    verdict: Verdict,
    against: Vec<String>,
    notes: Vec<String>,
}

impl Builder {
    fn new() -> Self {
        Builder {
            verdict: Verdict::Supported,
            against: Vec::new(),
            notes: Vec::new(),
        }
    }
    fn worsen(&mut self, v: Verdict, why: String) {
        self.verdict = self.verdict.max(v);
        self.against.push(why);
    }
    fn note(&mut self, why: String) {
        self.notes.push(why);
    }
    fn done(mut self, path: PathKind) -> PathVerdict {
        self.against.append(&mut self.notes);
        PathVerdict {
            path,
            verdict: self.verdict,
            reasons: self.against,
        }
    }
}

/// Human-readable binary size (`256 MiB`, `141 GiB`, `1.5 GiB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: &[&str] = &["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else if (v - v.round()).abs() < 0.05 {
        format!("{:.0} {}", v.round(), UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// BAR1 checks shared by GPU-direct RDMA and gdrcopy. `what` names the path's use of BAR1.
fn bar1_check(gpu: &GpuFacts, b: &mut Builder, consequence: &str) {
    match &gpu.bar1 {
        Ok(bar) => {
            if bar.total < gpu.total_mem {
                b.worsen(
                    Verdict::Limited,
                    format!(
                        "BAR1 is {} for {} of device memory: {consequence}",
                        human_bytes(bar.total),
                        human_bytes(gpu.total_mem)
                    ),
                );
            } else {
                b.note(format!(
                    "BAR1 is {} and covers all {} of device memory",
                    human_bytes(bar.total),
                    human_bytes(gpu.total_mem)
                ));
            }
            if bar.total > 0 && (bar.free as f64) < BAR1_LOW_FREE_FRACTION * bar.total as f64 {
                b.worsen(
                    Verdict::Limited,
                    format!(
                        "BAR1 is nearly full ({} free of {}): new mappings may fail until \
                         registrations are released",
                        human_bytes(bar.free),
                        human_bytes(bar.total)
                    ),
                );
            }
        }
        Err(why) => b.note(format!("BAR1 size unknown ({why})")),
    }
}

const SMALL_BAR1_RDMA: &str = "GPU-direct RDMA registrations beyond it fail with Bad address; \
                               staging through host memory will be used for what does not fit";

/// Verdict for GPU-direct RDMA between `gpu` and `nic` (`None`: the host has no RDMA NIC).
pub fn rdma_verdict(gpu: &GpuFacts, nic: Option<&NicFacts>, host: &HostFacts) -> PathVerdict {
    let mut b = Builder::new();
    let path = PathKind::GpuDirectRdma(nic.map(|n| n.name.clone()));
    let Some(nic) = nic else {
        b.worsen(
            Verdict::Unsupported,
            "no RDMA NIC on this host (nothing under /sys/class/infiniband)".into(),
        );
        if gpu.gpu_direct_rdma {
            b.note(
                "the GPU reports GPU_DIRECT_RDMA_SUPPORTED, but there is no NIC to use it".into(),
            );
        }
        return b.done(path);
    };
    if !gpu.gpu_direct_rdma {
        b.worsen(
            Verdict::Unsupported,
            "the GPU does not report CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED".into(),
        );
    } else {
        b.note("the GPU reports GPU_DIRECT_RDMA_SUPPORTED".into());
    }
    if nic.pci_path.is_none() {
        b.worsen(
            Verdict::Unsupported,
            format!(
                "{} has no PCI function (a software RDMA device such as rxe/siw, or hidden by a \
                 container): it cannot DMA to GPU memory",
                nic.name
            ),
        );
    }
    let peer_mem: Vec<String> = host
        .peer_memory
        .iter()
        .filter(|p| p.exists)
        .map(|p| p.path.display().to_string())
        .collect();
    if !peer_mem.is_empty() {
        b.note(format!(
            "peer memory module present ({})",
            peer_mem.join(", ")
        ));
    } else if gpu.dmabuf_export() {
        b.note(
            "no peer memory module, but the GPU exports dma-buf (DMA_BUF_SUPPORTED): \
             registration goes through ibv_reg_dmabuf_mr, which the NIC driver must support"
                .into(),
        );
    } else {
        let probed: Vec<String> = host
            .peer_memory
            .iter()
            .map(|p| p.path.display().to_string())
            .collect();
        let dmabuf_why = if gpu.dma_buf {
            "the driver lacks cuMemGetHandleForAddressRange"
        } else {
            "the GPU does not report DMA_BUF_SUPPORTED"
        };
        b.worsen(
            Verdict::Unsupported,
            format!(
                "neither a peer memory module (none of {} exists) nor dma-buf ({dmabuf_why}): \
                 {} cannot translate GPU addresses, so ibv_reg_mr on GPU memory fails with Bad \
                 address; staging through host memory will be used",
                probed.join(", "),
                nic.name
            ),
        );
    }
    bar1_check(gpu, &mut b, SMALL_BAR1_RDMA);
    let class = sysfs::classify_path(
        gpu.pci_path.as_ref(),
        gpu.numa_node,
        nic.pci_path.as_ref(),
        nic.numa_node,
    );
    match class {
        PciPathClass::SameSwitch { .. } => b.note(format!("{} and the GPU: {class}", nic.name)),
        PciPathClass::SameRootComplex | PciPathClass::CrossRootComplex => b.worsen(
            Verdict::Limited,
            format!(
                "{} and the GPU: {class}: peer-to-peer DMA crosses the CPU and often runs slower \
                 than staging through host memory",
                nic.name
            ),
        ),
        PciPathClass::CrossSocket => b.worsen(
            Verdict::Limited,
            format!(
                "{} and the GPU: {class}: peer-to-peer DMA over the inter-socket link is slow or \
                 unsupported; a NIC on the GPU's socket is better",
                nic.name
            ),
        ),
        PciPathClass::Unknown if nic.pci_path.is_some() => b.note(format!(
            "PCI path between {} and the GPU: {class}",
            nic.name
        )),
        PciPathClass::Unknown => {}
    }
    b.done(path)
}

/// Verdict for gdrcopy (CPU-mapped GPU memory) on `gpu`.
pub fn gdrcopy_verdict(gpu: &GpuFacts, host: &HostFacts) -> PathVerdict {
    let mut b = Builder::new();
    if !host.gdrdrv_present() {
        let probed: Vec<String> = host
            .gdrdrv
            .iter()
            .map(|p| p.path.display().to_string())
            .collect();
        b.worsen(
            Verdict::Unsupported,
            format!(
                "the gdrdrv kernel driver is not loaded (none of {} exists)",
                probed.join(", ")
            ),
        );
    } else {
        b.note("gdrdrv kernel driver present".into());
    }
    match &host.gdrapi {
        Some(lib) => b.note(format!("{lib} loadable")),
        None => b.worsen(
            Verdict::Unsupported,
            format!(
                "the gdrcopy library is not installed (none of {} loads)",
                GDRAPI_LIBS.join(", ")
            ),
        ),
    }
    if !gpu.gpu_direct_rdma {
        b.worsen(
            Verdict::Unsupported,
            "the GPU does not report GPU_DIRECT_RDMA_SUPPORTED, which gdrcopy's BAR1 mappings need"
                .into(),
        );
    }
    bar1_check(
        gpu,
        &mut b,
        "gdrcopy can map at most that much GPU memory at once; larger buffers use cuda_copy",
    );
    b.done(PathKind::GdrCopy)
}

/// Verdict for cuda_ipc from `gpu` to `peer`.
pub fn cuda_ipc_verdict(gpu: &GpuFacts, peer: &PeerFacts) -> PathVerdict {
    let mut b = Builder::new();
    match peer.can_access_peer {
        Some(true) => match peer.nvlink {
            Some(NvlinkPath::None) => {
                b.note("peer access over PCIe (no NVLink to this GPU)".into())
            }
            Some(p) => b.note(format!("peer access over NVLink, {p}")),
            None => b.note("peer access (link type unknown: NVML not available)".into()),
        },
        Some(false) => b.worsen(
            Verdict::Limited,
            format!(
                "GPU {} cannot access GPU {} directly (cuDeviceCanAccessPeer = 0): copies between \
                 them are staged by the driver through host memory",
                gpu.ordinal, peer.ordinal
            ),
        ),
        None => b.worsen(
            Verdict::Limited,
            format!(
                "peer access from GPU {} to GPU {} is unknown (query failed)",
                gpu.ordinal, peer.ordinal
            ),
        ),
    }
    if gpu.memory_pools {
        b.note(
            "memory from stream-ordered pools cannot be exported through legacy IPC handles".into(),
        );
    }
    b.done(PathKind::CudaIpc(Some(peer.ordinal)))
}

/// Every verdict for `gpu`: GPU-direct RDMA per NIC (or one saying there is none), gdrcopy,
/// cuda_ipc per peer (or one for same-GPU IPC only).
pub fn verdicts(gpu: &GpuFacts, host: &HostFacts) -> Vec<PathVerdict> {
    let mut out = Vec::new();
    if host.nics.is_empty() {
        out.push(rdma_verdict(gpu, None, host));
    } else {
        out.extend(host.nics.iter().map(|n| rdma_verdict(gpu, Some(n), host)));
    }
    out.push(gdrcopy_verdict(gpu, host));
    if gpu.peers.is_empty() {
        let mut b = Builder::new();
        b.note(format!(
            "no other GPU visible: cuda_ipc only connects processes sharing GPU {}",
            gpu.ordinal
        ));
        out.push(b.done(PathKind::CudaIpc(None)));
    } else {
        out.extend(gpu.peers.iter().map(|p| cuda_ipc_verdict(gpu, p)));
    }
    out
}

/// The whole report: host facts and every GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Host-wide facts.
    pub host: HostFacts,
    /// One entry per visible GPU (empty without a driver).
    pub gpus: Vec<GpuFacts>,
}

impl Report {
    /// Verdicts for GPU `ordinal` (empty if there is no such GPU).
    pub fn verdicts(&self, ordinal: u32) -> Vec<PathVerdict> {
        self.gpus
            .iter()
            .find(|g| g.ordinal == ordinal)
            .map(|g| verdicts(g, &self.host))
            .unwrap_or_default()
    }

    /// The report as text (same as `Display`).
    pub fn render(&self) -> String {
        self.to_string()
    }
}

fn probe_line(probes: &[PathProbe]) -> String {
    probes
        .iter()
        .map(|p| {
            format!(
                "{} {}",
                p.path.display(),
                if p.exists { "present" } else { "absent" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn opt<T: fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|x| x.to_string())
        .unwrap_or_else(|| "unknown".into())
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.host;
        writeln!(f, "# GPU-direct report")?;
        match &h.driver {
            Ok(v) => writeln!(f, "# CUDA driver API: {v}")?,
            Err(why) => writeln!(f, "# {why}")?,
        }
        match &h.nvml {
            Ok(v) => writeln!(f, "# NVML: driver {v}")?,
            Err(why) => writeln!(f, "# NVML: unavailable ({why})")?,
        }
        writeln!(f, "# peer memory: {}", probe_line(&h.peer_memory))?;
        writeln!(
            f,
            "# gdrcopy: {}; library {}",
            probe_line(&h.gdrdrv),
            h.gdrapi.as_deref().unwrap_or("not found")
        )?;
        if h.nics.is_empty() {
            writeln!(f, "# RDMA NICs: none")?;
        }
        for n in &h.nics {
            writeln!(
                f,
                "# RDMA NIC {}: PCI {}, NUMA node {}",
                n.name,
                opt(&n.pci_path),
                opt(&n.numa_node)
            )?;
        }
        if self.gpus.is_empty() {
            let why = h
                .driver
                .as_ref()
                .err()
                .map(String::as_str)
                .unwrap_or("no GPU");
            writeln!(f, "#\n# no GPU: {why}")?;
            return Ok(());
        }
        for g in &self.gpus {
            writeln!(f, "#\n# GPU {}: {}", g.ordinal, g.name)?;
            writeln!(f, "#   PCI bus id: {}", g.pci_bus_id)?;
            writeln!(f, "#   PCI path: {}", opt(&g.pci_path))?;
            writeln!(f, "#   NUMA node: {}", opt(&g.numa_node))?;
            writeln!(f, "#   memory: {}", human_bytes(g.total_mem))?;
            match &g.bar1 {
                Ok(b) => writeln!(
                    f,
                    "#   BAR1: total {}, used {}, free {}",
                    human_bytes(b.total),
                    human_bytes(b.used),
                    human_bytes(b.free)
                )?,
                Err(why) => writeln!(f, "#   BAR1: unknown ({why})")?,
            }
            let yn = |b: bool| if b { "yes" } else { "no" };
            writeln!(
                f,
                "#   GPU_DIRECT_RDMA_SUPPORTED: {}",
                yn(g.gpu_direct_rdma)
            )?;
            writeln!(
                f,
                "#   DMA_BUF_SUPPORTED: {} (cuMemGetHandleForAddressRange {})",
                yn(g.dma_buf),
                if g.dmabuf_export_entry {
                    "present"
                } else {
                    "absent"
                }
            )?;
            writeln!(f, "#   MEMORY_POOLS_SUPPORTED: {}", yn(g.memory_pools))?;
            writeln!(f, "#   NVLink active links: {}", opt(&g.nvlink_active))?;
            for n in &h.nics {
                let class = sysfs::classify_path(
                    g.pci_path.as_ref(),
                    g.numa_node,
                    n.pci_path.as_ref(),
                    n.numa_node,
                );
                writeln!(f, "#   path to {}: {class}", n.name)?;
            }
            for p in &g.peers {
                let access = match p.can_access_peer {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "unknown",
                };
                writeln!(
                    f,
                    "#   peer GPU {} ({}): peer access {access}, NVLink {}",
                    p.ordinal,
                    p.pci_bus_id,
                    opt(&p.nvlink)
                )?;
            }
            for v in verdicts(g, h) {
                writeln!(f, "#   {}: {}", v.path, v.verdict)?;
                for r in &v.reasons {
                    writeln!(f, "#     - {r}")?;
                }
            }
        }
        Ok(())
    }
}

fn gdrapi_library() -> Option<String> {
    GDRAPI_LIBS.iter().find_map(|name| {
        // SAFETY: loading libgdrapi runs its initializers, which only set up library state;
        // the handle is dropped (unloaded) right away and no symbol is called.
        unsafe { libloading::Library::new(name) }
            .ok()
            .map(|_| (*name).to_string())
    })
}

/// Gather host facts from the sysfs tree at `sys_root` (normally `/sys`).
pub fn host_facts(sys_root: &Path) -> HostFacts {
    let driver = match crate::driver::driver() {
        Ok(d) => Ok(d.version_string()),
        Err(rucx_ucs::Error::Unavailable { reason, .. }) => Err(reason),
        Err(e) => Err(e.to_string()),
    };
    HostFacts {
        driver,
        nvml: crate::nvml::driver_version(),
        peer_memory: sysfs::probe(sys_root, PEER_MEMORY_PATHS),
        gdrdrv: sysfs::probe(sys_root, GDRDRV_PATHS),
        gdrapi: gdrapi_library(),
        nics: sysfs::rdma_devices(sys_root)
            .into_iter()
            .map(|d| NicFacts {
                name: d.name,
                pci_path: d.pci,
                numa_node: d.numa_node,
            })
            .collect(),
    }
}

/// Gather facts about every GPU (empty without a driver), using sysfs at `sys_root`.
pub fn gpu_facts(sys_root: &Path) -> Vec<GpuFacts> {
    let Ok(drv) = crate::driver::driver() else {
        return Vec::new();
    };
    let devs = drv.devices();
    devs.iter()
        .map(|d| {
            let (pci_path, numa_node) = sysfs::pci_device(sys_root, &d.pci_bus_id);
            let links = crate::nvml::nvlinks(&d.pci_bus_id).ok();
            let peers = devs
                .iter()
                .filter(|p| p.ordinal != d.ordinal)
                .map(|p| PeerFacts {
                    ordinal: p.ordinal,
                    pci_bus_id: p.pci_bus_id.clone(),
                    can_access_peer: drv.can_access_peer(d.ordinal, p.ordinal).ok(),
                    nvlink: links.as_ref().map(|l| {
                        let p2p = crate::nvml::nvlink_p2p(&d.pci_bus_id, &p.pci_bus_id).ok();
                        nvlink_path(l, &p.pci_bus_id, p2p)
                    }),
                })
                .collect();
            GpuFacts {
                ordinal: d.ordinal,
                name: d.name.clone(),
                pci_bus_id: d.pci_bus_id.clone(),
                pci_path,
                numa_node,
                total_mem: d.total_mem,
                bar1: crate::nvml::bar1(&d.pci_bus_id),
                gpu_direct_rdma: d.gpu_direct_rdma,
                dma_buf: d.dma_buf,
                dmabuf_export_entry: drv.has_dmabuf_export(),
                memory_pools: d.memory_pools,
                nvlink_active: links.as_ref().map(|l| l.active),
                peers,
            }
        })
        .collect()
}

/// The report for this machine (reads `/sys`, the CUDA driver and NVML). Works, and says so,
/// on a machine without GPU or driver.
pub fn report() -> Report {
    report_from(Path::new("/sys"))
}

/// The report with sysfs read from `sys_root`.
pub fn report_from(sys_root: &Path) -> Report {
    Report {
        host: host_facts(sys_root),
        gpus: gpu_facts(sys_root),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn path(s: &str) -> Option<PciPath> {
        PciPath::parse(s)
    }

    fn probes(paths: &[&str], present: &[&str]) -> Vec<PathProbe> {
        paths
            .iter()
            .map(|p| PathProbe {
                path: if p.starts_with('/') {
                    PathBuf::from(p)
                } else {
                    PathBuf::from("/sys").join(p)
                },
                exists: present.contains(p),
            })
            .collect()
    }

    /// An H200-like GPU under switch 0000:01 on socket 0.
    fn h200() -> GpuFacts {
        GpuFacts {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            pci_bus_id: "0000:05:00.0".into(),
            pci_path: path(
                "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0",
            ),
            numa_node: Some(0),
            total_mem: 141 * GIB,
            bar1: Ok(Bar1 {
                total: 256 * GIB,
                used: 100 * MIB,
                free: 256 * GIB - 100 * MIB,
            }),
            gpu_direct_rdma: true,
            dma_buf: true,
            dmabuf_export_entry: true,
            memory_pools: true,
            nvlink_active: Some(0),
            peers: vec![],
        }
    }

    /// An RTX 3080-like GPU: 10 GiB of memory behind a 256 MiB BAR1.
    fn rtx3080() -> GpuFacts {
        GpuFacts {
            name: "NVIDIA GeForce RTX 3080".into(),
            total_mem: 10 * GIB,
            bar1: Ok(Bar1 {
                total: 256 * MIB,
                used: 5 * MIB,
                free: 251 * MIB,
            }),
            ..h200()
        }
    }

    fn nic_same_switch() -> NicFacts {
        NicFacts {
            name: "mlx5_0".into(),
            pci_path: path(
                "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0",
            ),
            numa_node: Some(0),
        }
    }

    fn nic_other_socket() -> NicFacts {
        NicFacts {
            name: "mlx5_1".into(),
            pci_path: path("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"),
            numa_node: Some(1),
        }
    }

    fn nic_other_root_port() -> NicFacts {
        NicFacts {
            name: "mlx5_2".into(),
            pci_path: path("/sys/devices/pci0000:00/0000:00:03.0/0000:09:00.0"),
            numa_node: Some(0),
        }
    }

    fn soft_nic() -> NicFacts {
        NicFacts {
            name: "rxe0".into(),
            pci_path: None,
            numa_node: None,
        }
    }

    fn host(peer_mem: &[&str], gdr: &[&str], gdrapi: bool, nics: Vec<NicFacts>) -> HostFacts {
        HostFacts {
            driver: Ok("13.0".into()),
            nvml: Ok("580.159.04".into()),
            peer_memory: probes(PEER_MEMORY_PATHS, peer_mem),
            gdrdrv: probes(GDRDRV_PATHS, gdr),
            gdrapi: gdrapi.then(|| "libgdrapi.so.2".to_string()),
            nics,
        }
    }

    fn has(v: &PathVerdict, needle: &str) -> bool {
        v.reasons.iter().any(|r| r.contains(needle))
    }

    struct Case {
        name: &'static str,
        gpu: GpuFacts,
        host: HostFacts,
        /// Which NIC (index into host.nics), None for "no NIC" verdict.
        nic: Option<usize>,
        want: Verdict,
        reason: &'static str,
    }

    #[test]
    fn rdma_verdict_table() {
        let no_gdr = GpuFacts {
            gpu_direct_rdma: false,
            ..h200()
        };
        let no_dmabuf = GpuFacts {
            dma_buf: false,
            ..h200()
        };
        let no_dmabuf_entry = GpuFacts {
            dmabuf_export_entry: false,
            ..h200()
        };
        let bar1_unknown = GpuFacts {
            bar1: Err("NVML not available".into()),
            ..h200()
        };
        let bar1_full = GpuFacts {
            bar1: Ok(Bar1 {
                total: 256 * GIB,
                used: 250 * GIB,
                free: 6 * GIB,
            }),
            ..h200()
        };
        let no_path = GpuFacts {
            pci_path: None,
            ..h200()
        };
        let pm = &["module/nvidia_peermem"][..];
        let legacy_pm = &["kernel/mm/memory_peers/nv_mem/version"][..];
        let cases = vec![
            Case {
                name: "GPUDirect-capable GPU but no NIC",
                gpu: h200(),
                host: host(pm, &[], false, vec![]),
                nic: None,
                want: Verdict::Unsupported,
                reason: "no RDMA NIC",
            },
            Case {
                name: "H200-like full BAR1, no NIC",
                gpu: h200(),
                host: host(&[], &[], false, vec![]),
                nic: None,
                want: Verdict::Unsupported,
                reason: "but there is no NIC to use it",
            },
            Case {
                name: "peer memory + NIC on the same switch",
                gpu: h200(),
                host: host(pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Supported,
                reason: "/sys/module/nvidia_peermem",
            },
            Case {
                name: "legacy nv_peer_mem version file counts as peer memory",
                gpu: h200(),
                host: host(legacy_pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Supported,
                reason: "memory_peers/nv_mem/version",
            },
            Case {
                name: "NIC without peer memory, GPU without dma-buf",
                gpu: no_dmabuf.clone(),
                host: host(&[], &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Unsupported,
                reason: "fails with Bad address",
            },
            Case {
                name: "dma-buf attribute but driver lacks the export entry point",
                gpu: no_dmabuf_entry,
                host: host(&[], &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Unsupported,
                reason: "lacks cuMemGetHandleForAddressRange",
            },
            Case {
                name: "no peer memory but dma-buf",
                gpu: h200(),
                host: host(&[], &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Supported,
                reason: "ibv_reg_dmabuf_mr",
            },
            Case {
                name: "RTX 3080-like 256 MiB BAR1",
                gpu: rtx3080(),
                host: host(pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Limited,
                reason: "BAR1 is 256 MiB for 10 GiB of device memory: GPU-direct RDMA registrations beyond it fail with Bad address; staging through host memory will be used",
            },
            Case {
                name: "GPU without GPUDirect RDMA",
                gpu: no_gdr,
                host: host(pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Unsupported,
                reason: "does not report CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED",
            },
            Case {
                name: "NIC on the other socket",
                gpu: h200(),
                host: host(pm, &[], false, vec![nic_other_socket()]),
                nic: Some(0),
                want: Verdict::Limited,
                reason: "across sockets",
            },
            Case {
                name: "NIC on another root port",
                gpu: h200(),
                host: host(pm, &[], false, vec![nic_other_root_port()]),
                nic: Some(0),
                want: Verdict::Limited,
                reason: "crosses the CPU",
            },
            Case {
                name: "software RDMA device",
                gpu: h200(),
                host: host(pm, &[], false, vec![soft_nic()]),
                nic: Some(0),
                want: Verdict::Unsupported,
                reason: "rxe0 has no PCI function",
            },
            Case {
                name: "BAR1 unknown does not change the verdict",
                gpu: bar1_unknown,
                host: host(pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Supported,
                reason: "BAR1 size unknown (NVML not available)",
            },
            Case {
                name: "BAR1 nearly full",
                gpu: bar1_full,
                host: host(pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Limited,
                reason: "BAR1 is nearly full (6 GiB free of 256 GiB)",
            },
            Case {
                name: "GPU path unknown (container): only a note",
                gpu: no_path,
                host: host(pm, &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Supported,
                reason: "unknown (no PCI path in sysfs)",
            },
            Case {
                name: "small BAR1 and no peer memory: unsupported wins",
                gpu: GpuFacts {
                    dma_buf: false,
                    ..rtx3080()
                },
                host: host(&[], &[], false, vec![nic_same_switch()]),
                nic: Some(0),
                want: Verdict::Unsupported,
                reason: "BAR1 is 256 MiB",
            },
        ];
        for c in cases {
            let nic = c.nic.map(|i| &c.host.nics[i]);
            let v = rdma_verdict(&c.gpu, nic, &c.host);
            assert_eq!(v.verdict, c.want, "{}: {:#?}", c.name, v.reasons);
            assert!(
                has(&v, c.reason),
                "{}: no reason containing {:?} in {:#?}",
                c.name,
                c.reason,
                v.reasons
            );
            assert_eq!(
                v.path,
                PathKind::GpuDirectRdma(nic.map(|n| n.name.clone())),
                "{}",
                c.name
            );
            // Deciding reasons come first.
            if v.verdict != Verdict::Supported {
                assert!(!v.reasons.is_empty());
            }
        }
    }

    #[test]
    fn gdrcopy_verdict_table() {
        let both = &["/dev/gdrdrv", "module/gdrdrv"][..];
        let cases: Vec<(&str, GpuFacts, HostFacts, Verdict, &str)> = vec![
            (
                "no gdrdrv",
                h200(),
                host(&[], &[], true, vec![]),
                Verdict::Unsupported,
                "gdrdrv kernel driver is not loaded",
            ),
            (
                "gdrdrv but no library",
                h200(),
                host(&[], both, false, vec![]),
                Verdict::Unsupported,
                "library is not installed",
            ),
            (
                "module only counts",
                h200(),
                host(&[], &["module/gdrdrv"], true, vec![]),
                Verdict::Supported,
                "libgdrapi.so.2 loadable",
            ),
            (
                "full BAR1",
                h200(),
                host(&[], both, true, vec![]),
                Verdict::Supported,
                "covers all 141 GiB",
            ),
            (
                "small BAR1",
                rtx3080(),
                host(&[], both, true, vec![]),
                Verdict::Limited,
                "BAR1 is 256 MiB",
            ),
            (
                "GPU without GPUDirect",
                GpuFacts {
                    gpu_direct_rdma: false,
                    ..h200()
                },
                host(&[], both, true, vec![]),
                Verdict::Unsupported,
                "gdrcopy's BAR1 mappings need",
            ),
        ];
        for (name, gpu, h, want, reason) in cases {
            let v = gdrcopy_verdict(&gpu, &h);
            assert_eq!(v.verdict, want, "{name}: {:#?}", v.reasons);
            assert!(
                has(&v, reason),
                "{name}: {reason:?} not in {:#?}",
                v.reasons
            );
            assert_eq!(v.path, PathKind::GdrCopy);
        }
    }

    #[test]
    fn cuda_ipc_verdict_table() {
        let peer = |can, nvl| PeerFacts {
            ordinal: 1,
            pci_bus_id: "0000:06:00.0".into(),
            can_access_peer: can,
            nvlink: nvl,
        };
        let direct = Some(NvlinkPath::Direct { links: 4 });
        let switched = Some(NvlinkPath::Switched { links: 18 });
        let pcie = Some(NvlinkPath::None);
        let cases = [
            (
                peer(Some(true), direct),
                Verdict::Supported,
                "over NVLink, 4 direct link(s)",
            ),
            (
                peer(Some(true), switched),
                Verdict::Supported,
                "NVLink, through NVSwitch (18 active",
            ),
            (peer(Some(true), pcie), Verdict::Supported, "over PCIe"),
            (
                peer(Some(true), None),
                Verdict::Supported,
                "link type unknown",
            ),
            (
                peer(Some(false), pcie),
                Verdict::Limited,
                "staged by the driver through host memory",
            ),
            (peer(None, None), Verdict::Limited, "unknown (query failed)"),
        ];
        for (p, want, reason) in cases {
            let v = cuda_ipc_verdict(&h200(), &p);
            assert_eq!(v.verdict, want, "{p:?}: {:#?}", v.reasons);
            assert!(has(&v, reason), "{reason:?} not in {:#?}", v.reasons);
            assert!(has(&v, "stream-ordered pools"));
            assert_eq!(v.path, PathKind::CudaIpc(Some(1)));
        }
    }

    #[test]
    fn verdict_list_per_gpu() {
        let mut gpu = h200();
        let h = host(&[], &[], false, vec![]);
        let v = verdicts(&gpu, &h);
        assert_eq!(
            v.iter().map(|v| v.path.clone()).collect::<Vec<_>>(),
            vec![
                PathKind::GpuDirectRdma(None),
                PathKind::GdrCopy,
                PathKind::CudaIpc(None)
            ]
        );
        assert_eq!(v[2].verdict, Verdict::Supported);
        gpu.peers = vec![PeerFacts {
            ordinal: 1,
            pci_bus_id: "0000:06:00.0".into(),
            can_access_peer: Some(true),
            nvlink: Some(NvlinkPath::Switched { links: 18 }),
        }];
        let h = host(
            &["module/nvidia_peermem"],
            &[],
            false,
            vec![nic_same_switch(), nic_other_socket()],
        );
        let v = verdicts(&gpu, &h);
        let paths: Vec<String> = v.iter().map(|v| v.path.to_string()).collect();
        assert_eq!(
            paths,
            [
                "GPU-direct RDMA to mlx5_0",
                "GPU-direct RDMA to mlx5_1",
                "gdrcopy",
                "cuda_ipc to GPU 1"
            ]
        );
        assert_eq!(
            v.iter().map(|v| v.verdict).collect::<Vec<_>>(),
            [
                Verdict::Supported,
                Verdict::Limited,
                Verdict::Unsupported,
                Verdict::Supported
            ]
        );
    }

    #[test]
    fn nvlink_paths() {
        use crate::nvml::NvlinkState;
        let direct = NvlinkState {
            active: 12,
            remotes: vec![("0000:06:00.0".into(), 8), ("0000:07:00.0".into(), 4)],
        };
        assert_eq!(
            nvlink_path(&direct, "0000:06:00.0", None),
            NvlinkPath::Direct { links: 8 }
        );
        assert_eq!(
            nvlink_path(&direct, "0000:07:00.0", Some(true)),
            NvlinkPath::Direct { links: 4 }
        );
        assert_eq!(
            nvlink_path(&direct, "0000:08:00.0", Some(false)),
            NvlinkPath::None
        );
        // HGX: every link ends at an NVSwitch (or is unknown inside a VM).
        let switched = NvlinkState {
            active: 18,
            remotes: vec![("unknown".into(), 18)],
        };
        assert_eq!(
            nvlink_path(&switched, "0000:07:00.0", Some(true)),
            NvlinkPath::Switched { links: 18 }
        );
        assert_eq!(
            nvlink_path(&switched, "0000:07:00.0", None),
            NvlinkPath::None
        );
        assert_eq!(
            nvlink_path(&NvlinkState::default(), "0000:07:00.0", Some(true)),
            NvlinkPath::None
        );
        assert_eq!(
            NvlinkPath::Switched { links: 18 }.to_string(),
            "through NVSwitch (18 active link(s) on this GPU)"
        );
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(256 * MIB), "256 MiB");
        assert_eq!(human_bytes(141 * GIB), "141 GiB");
        assert_eq!(human_bytes(3 * GIB / 2), "1.5 GiB");
        assert_eq!(human_bytes(1 << 40), "1 TiB");
    }

    #[test]
    fn rendering_a_synthetic_machine() {
        let mut g0 = rtx3080();
        g0.peers = vec![PeerFacts {
            ordinal: 1,
            pci_bus_id: "0000:85:00.0".into(),
            can_access_peer: Some(false),
            nvlink: Some(NvlinkPath::None),
        }];
        let r = Report {
            host: host(
                &["module/nvidia_peermem"],
                &[],
                false,
                vec![nic_same_switch()],
            ),
            gpus: vec![g0],
        };
        let s = r.render();
        for want in [
            "# CUDA driver API: 13.0",
            "# GPU 0: NVIDIA GeForce RTX 3080",
            "PCI bus id: 0000:05:00.0",
            "NUMA node: 0",
            "BAR1: total 256 MiB, used 5 MiB, free 251 MiB",
            "GPU_DIRECT_RDMA_SUPPORTED: yes",
            "/sys/module/nvidia_peermem present",
            "/sys/module/nv_peer_mem absent",
            "# RDMA NIC mlx5_0: PCI pci0000:00/",
            "path to mlx5_0: same PCIe switch",
            "peer GPU 1 (0000:85:00.0): peer access no, NVLink none",
            "NVLink active links: 0",
            "GPU-direct RDMA to mlx5_0: limited",
            "staging through host memory will be used",
            "gdrcopy: unsupported",
            "cuda_ipc to GPU 1: limited",
        ] {
            assert!(s.contains(want), "{want:?} missing from:\n{s}");
        }
        assert_eq!(r.verdicts(0).len(), 3);
        assert!(r.verdicts(7).is_empty());
    }

    #[test]
    fn rendering_without_a_driver() {
        let mut h = host(&[], &[], false, vec![]);
        h.driver = Err("no CUDA driver found: libcuda.so could not be loaded".into());
        h.nvml = Err("NVML could not be initialized".into());
        let s = Report {
            host: h,
            gpus: vec![],
        }
        .render();
        assert!(
            s.contains("# no CUDA driver found: libcuda.so could not be loaded"),
            "{s}"
        );
        assert!(s.contains("# no GPU: no CUDA driver found"), "{s}");
        assert!(s.contains("NVML: unavailable"), "{s}");
        assert!(s.contains("RDMA NICs: none"), "{s}");
    }

    #[test]
    fn live_report_works_here() {
        // On the build machine (no driver) this says "no GPU"; on a GPU host it lists GPUs.
        let r = report();
        let s = r.render();
        match &r.host.driver {
            Err(why) => {
                assert!(r.gpus.is_empty());
                assert!(s.contains("# no GPU: "), "{s}");
                assert!(s.contains(why.as_str()));
            }
            Ok(_) => assert!(!r.gpus.is_empty() && s.contains("# GPU 0: "), "{s}"),
        }
        assert_eq!(r.host.peer_memory.len(), PEER_MEMORY_PATHS.len());
    }

    #[test]
    fn host_facts_from_a_synthetic_sysfs() {
        use crate::sysfs::tests::{Scratch, add_nic, add_pci};
        let s = Scratch::new("hostfacts");
        let root = &s.0;
        let nic = add_pci(
            root,
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0",
            0,
        );
        add_nic(root, "mlx5_0", Some(&nic));
        std::fs::create_dir_all(root.join("module/nvidia_peermem")).unwrap();
        let h = host_facts(root);
        assert!(h.peer_memory_loaded());
        assert_eq!(h.nics.len(), 1);
        assert_eq!(
            h.nics[0].pci_path.as_ref().unwrap().bus_id(),
            "0000:06:00.0"
        );
        let v = rdma_verdict(&h200(), Some(&h.nics[0]), &h);
        assert_eq!(v.verdict, Verdict::Supported, "{:#?}", v.reasons);
    }
}
