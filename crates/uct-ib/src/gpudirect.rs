//! GPU-direct RDMA policy: whether this NIC registers a GPU's memory, and how.
//!
//! Two routes exist. *dma-buf*: the CUDA driver exports the allocation as a dma-buf file
//! descriptor and the NIC registers that (`ibv_reg_dmabuf_mr`); it needs dma-buf support in the
//! kernel, the NIC driver and libibverbs (probed without side effects by [`probe_dmabuf`]) and a
//! GPU/driver that exports. *peer memory*: a kernel module (`nvidia_peermem`) lets plain
//! `ibv_reg_mr` pin GPU pages. Either way the pages are mapped through the GPU's BAR1 aperture,
//! which on consumer cards is small (256 MiB on a GeForce RTX 3080, against 16-80 GiB on data-center
//! parts), and the CUDA driver reports whether the GPU supports GPUDirect RDMA at all.
//!
//! [`decide`] turns these facts, plain data supplied by the CUDA side, into one decision per GPU
//! before the first transfer, with the reasons spelled out; `RUCX_IB_GPU_DIRECT_RDMA=yes` with no
//! route is a configuration error, `no` skips every attempt, `try` uses what works.

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use rucx_ucs::{Error, Result, Ternary};
use rucx_uct::MemRegion;

use crate::verbs::{Access, VerbsDevice, VerbsError};

/// Name of the option (without the `RUCX_` prefix).
pub const OPTION: &str = "IB_GPU_DIRECT_RDMA";

/// What the CUDA side knows about one GPU. Every field but the ordinal may be unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuFacts {
    /// CUDA device ordinal.
    pub ordinal: u32,
    /// Marketing name, e.g. `NVIDIA GeForce RTX 3080`.
    pub name: String,
    /// PCI bus id.
    pub pci_bus_id: Option<String>,
    /// Device memory in bytes.
    pub memory_bytes: Option<u64>,
    /// Total BAR1 aperture in bytes (NVML).
    pub bar1_total: Option<u64>,
    /// Free BAR1 aperture in bytes when the facts were taken (NVML).
    pub bar1_free: Option<u64>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gdr_supported: Option<bool>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dmabuf_supported: Option<bool>,
}

impl GpuFacts {
    fn label(&self) -> String {
        if self.name.is_empty() {
            format!("GPU {}", self.ordinal)
        } else {
            format!("GPU {} ({})", self.ordinal, self.name)
        }
    }
}

/// A dma-buf holding a GPU buffer: the file descriptor and where the buffer starts inside it.
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf file descriptor (closed when dropped; a registration keeps its own reference
    /// to the buffer).
    pub fd: OwnedFd,
    /// Byte offset of the registered range within the dma-buf.
    pub offset: u64,
}

/// What the CUDA side offers this component: the facts per GPU and, when it can, a dma-buf
/// export of a GPU buffer (`cuMemGetHandleForAddressRange`). Implemented by the layer that
/// owns both the CUDA domain and this one.
pub trait GpuSupport: Send + Sync + fmt::Debug {
    /// Facts of every visible GPU.
    fn gpus(&self) -> Vec<GpuFacts>;

    /// Whether [`export_dmabuf`](Self::export_dmabuf) can work at all.
    fn can_export_dmabuf(&self) -> bool;

    /// Export the range of `region` (GPU memory) as a dma-buf.
    fn export_dmabuf(&self, region: &MemRegion) -> Result<DmaBuf>;
}

/// Result of probing dma-buf registration on a NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DmabufSupport {
    /// The kernel looked at the descriptor: the whole path exists.
    Supported,
    /// Not supported, and why.
    Unsupported(String),
}

/// Probe dma-buf registration without side effects: register from an invalid descriptor. A
/// stack that supports it fails with `EBADF` (it tried to look the descriptor up); one that
/// does not fails with `EOPNOTSUPP`/`ENOSYS`/`EPROTONOSUPPORT`.
pub fn probe_dmabuf(dev: &dyn VerbsDevice) -> DmabufSupport {
    // SAFETY: fd -1 is never a valid descriptor, so nothing is mapped or pinned; the call can
    // only fail (a success would hand back a region we drop at once).
    let r = unsafe { dev.reg_dmabuf_mr(0, 4096, 0, -1, Access::LOCAL_WRITE) };
    interpret_dmabuf_probe(dev.name(), r.map(drop))
}

/// The pure half of [`probe_dmabuf`].
pub fn interpret_dmabuf_probe(dev: &str, r: std::result::Result<(), VerbsError>) -> DmabufSupport {
    match r {
        Ok(()) => DmabufSupport::Supported,
        Err(e) if e.errno == libc::EBADF => DmabufSupport::Supported,
        Err(e)
            if matches!(
                e.errno,
                libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT | libc::ENOTTY
            ) =>
        {
            DmabufSupport::Unsupported(format!(
                "{dev} cannot register dma-buf memory ({}: the kernel, NIC driver or libibverbs is too old)",
                e.errno_name()
            ))
        }
        Err(e) => DmabufSupport::Unsupported(format!(
            "probing dma-buf registration on {dev} failed unexpectedly: {e}"
        )),
    }
}

/// How GPU memory is registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdrPath {
    /// `ibv_reg_dmabuf_mr` on a dma-buf exported by CUDA.
    DmaBuf,
    /// `ibv_reg_mr` on the device address, translated by the peer-memory module.
    PeerMem,
}

impl fmt::Display for GdrPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GdrPath::DmaBuf => "dma-buf",
            GdrPath::PeerMem => "peer memory",
        })
    }
}

/// The decision for one GPU (or for GPUs the facts do not cover).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDecision {
    /// The route, or `None` when this GPU's memory is not registered.
    pub path: Option<GdrPath>,
    /// Why (for `None`), or the caveats (for a route).
    pub reasons: Vec<String>,
    /// Bytes of this GPU's memory the domain keeps registered at most (a share of a small BAR1
    /// aperture); `None`: no limit of ours.
    pub aperture_budget: Option<u64>,
    /// Printable GPU label, e.g. `GPU 1 (NVIDIA GeForce RTX 3080)`.
    pub label: String,
}

impl GpuDecision {
    /// The reasons joined for a message.
    pub fn reasons_text(&self) -> String {
        if self.reasons.is_empty() {
            "no further detail".into()
        } else {
            self.reasons.join("; ")
        }
    }
}

/// Inputs of [`decide`] besides the GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicGdrFacts {
    /// NIC (memory domain) name.
    pub nic: String,
    /// dma-buf registration on this NIC.
    pub dmabuf: DmabufSupport,
    /// The peer-memory module, when loaded.
    pub peer_mem: Option<String>,
    /// The CUDA side can export dma-bufs.
    pub exporter: bool,
}

/// Decisions for every GPU of the facts, plus one for GPUs they do not cover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GdrPlan {
    /// The mode it was made under.
    pub mode: Ternary,
    /// The NIC.
    pub nic: String,
    /// For GPUs not in the facts (the route this host offers in general).
    pub default: GpuDecision,
    /// Per GPU ordinal.
    pub gpus: BTreeMap<u32, GpuDecision>,
}

impl GdrPlan {
    /// The decision for GPU `ordinal`.
    pub fn for_gpu(&self, ordinal: Option<u32>) -> &GpuDecision {
        ordinal
            .and_then(|o| self.gpus.get(&o))
            .unwrap_or(&self.default)
    }

    /// Whether some GPU's memory is registered at all (the domain then lists cuda memory as
    /// registrable; per-GPU refusals are typed registration errors the planner demotes on).
    pub fn any(&self) -> bool {
        self.default.path.is_some() || self.gpus.values().any(|d| d.path.is_some())
    }

    /// Whether the dma-buf route is in use for some GPU.
    pub fn uses_dmabuf(&self) -> bool {
        self.default.path == Some(GdrPath::DmaBuf)
            || self.gpus.values().any(|d| d.path == Some(GdrPath::DmaBuf))
    }
}

/// A BAR1 this small cannot hold useful registrations next to what the driver maps itself.
pub const MIN_USEFUL_BAR1: u64 = 64 << 20;

const MIB: u64 = 1 << 20;

fn mib(b: u64) -> String {
    if b >= (1 << 30) && b.is_multiple_of(1 << 30) {
        format!("{} GiB", b >> 30)
    } else {
        format!("{} MiB", b / MIB)
    }
}

/// The share of BAR1 registrations may take: what was free, less an eighth of the total (the
/// driver and other processes map through it too).
fn aperture_budget(g: &GpuFacts) -> Option<(u64, u64)> {
    let total = g.bar1_total?;
    let free = g.bar1_free.unwrap_or(total).min(total);
    Some((total, free.saturating_sub(total / 8)))
}

/// The route this host offers, before looking at a particular GPU.
fn host_route(
    nic: &NicGdrFacts,
    gpu_dmabuf: Option<bool>,
    reasons: &mut Vec<String>,
) -> Option<GdrPath> {
    let dmabuf_ok = match &nic.dmabuf {
        DmabufSupport::Supported if !nic.exporter => {
            reasons.push("the CUDA domain cannot export dma-bufs".into());
            false
        }
        DmabufSupport::Supported if gpu_dmabuf == Some(false) => {
            reasons.push("the GPU driver does not export this GPU's memory as dma-buf".into());
            false
        }
        DmabufSupport::Supported => true,
        DmabufSupport::Unsupported(why) => {
            reasons.push(why.clone());
            false
        }
    };
    if dmabuf_ok {
        return Some(GdrPath::DmaBuf);
    }
    if nic.peer_mem.is_some() {
        return Some(GdrPath::PeerMem);
    }
    reasons.push("no GPU peer-memory module is loaded (nvidia_peermem)".into());
    None
}

/// Decide per GPU. `mode` is `RUCX_IB_GPU_DIRECT_RDMA`: `yes` turns a GPU without a route (or a
/// host without any) into a configuration error.
pub fn decide(mode: Ternary, nic: &NicGdrFacts, gpus: &[GpuFacts]) -> Result<GdrPlan> {
    if mode == Ternary::No {
        let off = |label: String| GpuDecision {
            path: None,
            reasons: vec![format!("disabled by RUCX_{OPTION}=no")],
            aperture_budget: None,
            label,
        };
        return Ok(GdrPlan {
            mode,
            nic: nic.nic.clone(),
            default: off("GPUs".into()),
            gpus: gpus.iter().map(|g| (g.ordinal, off(g.label()))).collect(),
        });
    }
    let mut default_reasons = Vec::new();
    let default_path = host_route(nic, None, &mut default_reasons);
    let default = GpuDecision {
        path: default_path,
        reasons: default_reasons,
        aperture_budget: None,
        label: "GPUs".into(),
    };
    let mut plan = GdrPlan {
        mode,
        nic: nic.nic.clone(),
        default,
        gpus: BTreeMap::new(),
    };
    for g in gpus {
        let mut reasons = Vec::new();
        let mut path = None;
        if g.gdr_supported == Some(false) {
            reasons.push("the CUDA driver reports no GPUDirect RDMA support for it".into());
        } else {
            path = host_route(nic, g.dmabuf_supported, &mut reasons);
        }
        let mut budget = None;
        if let Some((total, share)) = aperture_budget(g) {
            let small = g.memory_bytes.is_none_or(|m| total < m);
            if small {
                reasons.push(format!(
                    "BAR1 aperture is {}{}",
                    mib(total),
                    g.memory_bytes
                        .map(|m| format!(" for {} of device memory", mib(m)))
                        .unwrap_or_default()
                ));
                if path.is_some() {
                    if share < MIN_USEFUL_BAR1 {
                        reasons.push(format!(
                            "only {} of it is free for registrations (need at least {})",
                            mib(share),
                            mib(MIN_USEFUL_BAR1)
                        ));
                        path = None;
                    } else {
                        budget = Some(share);
                    }
                }
            }
        }
        if path.is_some() && g.gdr_supported.is_none() {
            reasons.push("GPUDirect RDMA support of this GPU is unknown; trying".into());
        }
        plan.gpus.insert(
            g.ordinal,
            GpuDecision {
                path,
                reasons,
                aperture_budget: budget,
                label: g.label(),
            },
        );
    }
    if mode == Ternary::Yes {
        let refused: Vec<String> = if gpus.is_empty() {
            if plan.default.path.is_none() {
                vec![format!("on {}: {}", nic.nic, plan.default.reasons_text())]
            } else {
                vec![]
            }
        } else {
            plan.gpus
                .values()
                .filter(|d| d.path.is_none())
                .map(|d| format!("{} on {}: {}", d.label, nic.nic, d.reasons_text()))
                .collect()
        };
        if !refused.is_empty() {
            return Err(Error::Config {
                var: format!("RUCX_{OPTION}"),
                value: "yes".into(),
                reason: format!("GPU-direct RDMA is not possible for {}", refused.join("; ")),
                accepted: "yes (require it), no (never try), try (use it where possible)".into(),
            });
        }
    }
    Ok(plan)
}

/// A `GpuSupport` that knows no GPU and exports nothing (the default).
#[derive(Debug, Default)]
pub struct NoGpus;

impl GpuSupport for NoGpus {
    fn gpus(&self) -> Vec<GpuFacts> {
        Vec::new()
    }
    fn can_export_dmabuf(&self) -> bool {
        false
    }
    fn export_dmabuf(&self, region: &MemRegion) -> Result<DmaBuf> {
        Err(Error::Unsupported {
            what: format!("dma-buf export of {:#x}+{}", region.addr, region.len),
            why: "no CUDA domain is connected to the ib component".into(),
        })
    }
}

/// Shared handle to a [`GpuSupport`].
pub type SharedGpuSupport = Arc<dyn GpuSupport>;

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn nic(dmabuf: bool, peer: bool, exporter: bool) -> NicGdrFacts {
        NicGdrFacts {
            nic: "mlx5_0".into(),
            dmabuf: if dmabuf {
                DmabufSupport::Supported
            } else {
                DmabufSupport::Unsupported(
                    "mlx5_0 cannot register dma-buf memory (EOPNOTSUPP)".into(),
                )
            },
            peer_mem: peer.then(|| "nvidia_peermem".to_string()),
            exporter,
        }
    }

    /// The seed's GPU: GeForce RTX 3080, 10 GiB, 256 MiB BAR1, no GPUDirect RDMA.
    fn rtx3080(ordinal: u32) -> GpuFacts {
        GpuFacts {
            ordinal,
            name: "NVIDIA GeForce RTX 3080".into(),
            memory_bytes: Some(10 * GIB),
            bar1_total: Some(256 * MIB),
            bar1_free: Some(250 * MIB),
            gdr_supported: Some(false),
            dmabuf_supported: Some(true),
            ..Default::default()
        }
    }

    fn v100(ordinal: u32) -> GpuFacts {
        GpuFacts {
            ordinal,
            name: "Tesla V100-SXM2-32GB".into(),
            memory_bytes: Some(32 * GIB),
            bar1_total: Some(32 * GIB),
            bar1_free: Some(32 * GIB - 4 * MIB),
            gdr_supported: Some(true),
            dmabuf_supported: Some(false),
            ..Default::default()
        }
    }

    fn h200(ordinal: u32) -> GpuFacts {
        GpuFacts {
            ordinal,
            name: "NVIDIA H200".into(),
            memory_bytes: Some(141 * GIB),
            bar1_total: Some(256 * GIB),
            bar1_free: Some(255 * GIB),
            gdr_supported: Some(true),
            dmabuf_supported: Some(true),
            ..Default::default()
        }
    }

    #[test]
    fn seed_host_rtx3080_with_peermem_is_refused_with_reasons() {
        // The seed's node-rtx3080: nvidia-peermem loaded, MLNX_OFED without dma-buf.
        let plan = decide(Ternary::Try, &nic(false, true, true), &[rtx3080(0)]).unwrap();
        let d = plan.for_gpu(Some(0));
        assert_eq!(d.path, None);
        let r = d.reasons_text();
        assert!(r.contains("no GPUDirect RDMA support"), "{r}");
        assert!(r.contains("BAR1 aperture is 256 MiB for 10 GiB"), "{r}");
        // Other GPUs (not in the facts) still go through peer memory.
        assert_eq!(plan.default.path, Some(GdrPath::PeerMem));
        assert!(plan.any());
    }

    #[test]
    fn mixed_host_decides_per_gpu() {
        let plan = decide(
            Ternary::Try,
            &nic(true, true, true),
            &[v100(0), rtx3080(1), h200(2)],
        )
        .unwrap();
        // V100 does not export dma-buf: peer memory; no budget (BAR1 = memory).
        let v = plan.for_gpu(Some(0));
        assert_eq!(v.path, Some(GdrPath::PeerMem));
        assert_eq!(v.aperture_budget, None);
        assert!(
            v.reasons_text().contains("does not export"),
            "{}",
            v.reasons_text()
        );
        assert_eq!(plan.for_gpu(Some(1)).path, None);
        let h = plan.for_gpu(Some(2));
        assert_eq!(h.path, Some(GdrPath::DmaBuf));
        assert_eq!(h.aperture_budget, None);
        assert!(plan.uses_dmabuf());
        // Unknown ordinal: the host default.
        assert_eq!(plan.for_gpu(Some(9)).path, Some(GdrPath::DmaBuf));
        assert_eq!(plan.for_gpu(None).path, Some(GdrPath::DmaBuf));
    }

    #[test]
    fn small_bar1_that_supports_gdr_gets_a_budget() {
        let mut g = rtx3080(0);
        g.name = "NVIDIA RTX A4000".into();
        g.gdr_supported = Some(true);
        let plan = decide(Ternary::Try, &nic(true, false, true), &[g.clone()]).unwrap();
        let d = plan.for_gpu(Some(0));
        assert_eq!(d.path, Some(GdrPath::DmaBuf));
        // 250 MiB free minus 32 MiB (an eighth of 256) = 218 MiB.
        assert_eq!(d.aperture_budget, Some(218 * MIB));
        // Almost nothing free: refused.
        g.bar1_free = Some(40 * MIB);
        let plan = decide(Ternary::Try, &nic(true, false, true), &[g]).unwrap();
        let d = plan.for_gpu(Some(0));
        assert_eq!(d.path, None);
        assert!(
            d.reasons_text().contains("only 8 MiB of it is free"),
            "{}",
            d.reasons_text()
        );
    }

    #[test]
    fn no_route_at_all() {
        let plan = decide(Ternary::Try, &nic(false, false, true), &[h200(0)]).unwrap();
        let d = plan.for_gpu(Some(0));
        assert_eq!(d.path, None);
        let r = d.reasons_text();
        assert!(
            r.contains("EOPNOTSUPP") && r.contains("nvidia_peermem"),
            "{r}"
        );
        assert!(!plan.any());
        // dma-buf capable NIC but nobody to export: peer memory or nothing.
        let plan = decide(Ternary::Try, &nic(true, false, false), &[h200(0)]).unwrap();
        assert!(
            plan.for_gpu(Some(0))
                .reasons_text()
                .contains("cannot export")
        );
    }

    #[test]
    fn yes_without_support_is_a_configuration_error() {
        let e = decide(
            Ternary::Yes,
            &nic(false, true, true),
            &[h200(0), rtx3080(1)],
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(s.contains("RUCX_IB_GPU_DIRECT_RDMA"), "{s}");
        assert!(
            s.contains("GPU 1 (NVIDIA GeForce RTX 3080) on mlx5_0"),
            "{s}"
        );
        assert!(!s.contains("GPU 0"), "{s}");
        let e = decide(Ternary::Yes, &nic(false, false, true), &[]).unwrap_err();
        assert!(
            e.to_string()
                .contains("on mlx5_0: mlx5_0 cannot register dma-buf"),
            "{e}"
        );
        // Yes with support: fine.
        let plan = decide(Ternary::Yes, &nic(true, false, true), &[h200(0)]).unwrap();
        assert_eq!(plan.for_gpu(Some(0)).path, Some(GdrPath::DmaBuf));
    }

    #[test]
    fn no_skips_everything() {
        let plan = decide(Ternary::No, &nic(true, true, true), &[h200(0)]).unwrap();
        assert!(!plan.any());
        assert!(
            plan.for_gpu(Some(0))
                .reasons_text()
                .contains("RUCX_IB_GPU_DIRECT_RDMA=no")
        );
        assert!(plan.for_gpu(None).path.is_none());
    }

    #[test]
    fn unknown_facts_are_tried_with_a_note() {
        let g = GpuFacts {
            ordinal: 3,
            ..Default::default()
        };
        let plan = decide(Ternary::Try, &nic(false, true, false), &[g]).unwrap();
        let d = plan.for_gpu(Some(3));
        assert_eq!(d.path, Some(GdrPath::PeerMem));
        assert_eq!(d.label, "GPU 3");
        assert!(d.reasons_text().contains("unknown"));
    }

    #[test]
    fn dmabuf_probe_interpretation() {
        let p = |errno| {
            interpret_dmabuf_probe("mlx5_0", Err(VerbsError::new("ibv_reg_dmabuf_mr", errno)))
        };
        assert_eq!(p(libc::EBADF), DmabufSupport::Supported);
        for e in [libc::EOPNOTSUPP, libc::ENOSYS, libc::EPROTONOSUPPORT] {
            assert!(matches!(p(e), DmabufSupport::Unsupported(s) if s.contains("too old")));
        }
        assert!(
            matches!(p(libc::EINVAL), DmabufSupport::Unsupported(s) if s.contains("unexpectedly"))
        );
        assert_eq!(
            interpret_dmabuf_probe("x", Ok(())),
            DmabufSupport::Supported
        );
    }
}
