//! Registration failures, from errno to a typed [`RegError`] the planner acts on.
//!
//! The seed's failure, `ibv_reg_mr(...) failed: Bad address` on `mlx5_0` for GPU memory, becomes
//! `RegError { kind: BadAddress, detail: "device memory not registrable on mlx5_0 for GPU 0:
//! ...reasons...", hint: "set RUCX_IB_GPU_DIRECT_RDMA=no to skip the attempt" }`, which the
//! planner demotes on (the transfer then goes through host staging) instead of aborting.

use rucx_ucs::{RegError, RegErrorKind};
use rucx_uct::MemRegion;

use crate::gpudirect::{GpuDecision, OPTION};
use crate::verbs::VerbsError;

/// The hint that skips GPU registration attempts.
pub fn skip_hint() -> String {
    format!("set RUCX_{OPTION}=no to skip the attempt")
}

/// Context of a failed registration.
#[derive(Clone, Copy, Debug)]
pub struct RegAttempt<'a> {
    /// Memory domain (NIC) name.
    pub domain: &'a str,
    /// The buffer.
    pub region: &'a MemRegion,
    /// The decision for the buffer's GPU (GPU memory only).
    pub gpu: Option<&'a GpuDecision>,
    /// Bytes of this GPU's memory registered by this domain before the attempt.
    pub gpu_registered: u64,
    /// The process's locked-memory limit, when limited.
    pub memlock_limit: Option<u64>,
}

fn human(b: u64) -> String {
    const K: u64 = 1024;
    match b {
        b if b >= K * K * K && b % (K * K * K) == 0 => format!("{} GiB", b / (K * K * K)),
        b if b >= K * K && b % (K * K) == 0 => format!("{} MiB", b / (K * K)),
        b if b >= K && b % K == 0 => format!("{} KiB", b / K),
        b => format!("{b} bytes"),
    }
}

fn gpu_ordinal(a: &RegAttempt<'_>) -> String {
    a.region
        .device
        .map_or_else(|| "?".to_string(), |d| d.to_string())
}

/// Map a failed verbs registration to a typed error.
pub fn reg_error(a: &RegAttempt<'_>, err: &VerbsError) -> RegError {
    let gpu_mem = a.region.mem_type.is_gpu();
    let (kind, detail, hint) = match err.errno {
        libc::EFAULT if gpu_mem => {
            let mut reasons = vec![format!("{err}")];
            if let Some(d) = a.gpu {
                if let Some(p) = d.path {
                    reasons.push(format!("tried through {p}"));
                }
                reasons.extend(d.reasons.iter().cloned());
            }
            reasons.push(
                "the NIC cannot map this GPU's memory (no GPUDirect RDMA for it, or its BAR1 aperture is too small)"
                    .into(),
            );
            (
                RegErrorKind::BadAddress,
                format!(
                    "device memory not registrable on {} for GPU {}: {}",
                    a.domain,
                    gpu_ordinal(a),
                    reasons.join("; ")
                ),
                skip_hint(),
            )
        }
        libc::EFAULT => (
            RegErrorKind::BadAddress,
            format!(
                "{err}: the buffer is not (entirely) mapped in this process, or it is device memory classified as {}",
                a.region.mem_type
            ),
            "register only allocated memory; classify GPU buffers as cuda memory".into(),
        ),
        libc::ENOMEM | libc::ENOSPC if gpu_mem => {
            let budget = a
                .gpu
                .and_then(|d| d.aperture_budget)
                .map(|b| format!(", of a budget of {}", human(b)))
                .unwrap_or_default();
            (
                RegErrorKind::ApertureExhausted,
                format!(
                    "{err}: the BAR1 aperture of GPU {} is exhausted on {} ({} already registered by this domain{budget})",
                    gpu_ordinal(a),
                    a.domain,
                    human(a.gpu_registered)
                ),
                format!(
                    "release GPU registrations (cached ones are evicted and the registration retried once), or {}",
                    skip_hint()
                ),
            )
        }
        libc::ENOMEM => (
            RegErrorKind::NoMemory,
            format!(
                "{err}: cannot pin {} more bytes on {} (locked-memory limit {})",
                a.region.len,
                a.domain,
                a.memlock_limit
                    .map_or_else(|| "unlimited".to_string(), human)
            ),
            "raise the locked-memory limit (ulimit -l unlimited, or memlock in /etc/security/limits.conf)".into(),
        ),
        libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT => (
            RegErrorKind::UnsupportedMemoryType,
            format!(
                "{err}: {} does not support this registration ({} memory)",
                a.domain, a.region.mem_type
            ),
            if gpu_mem { skip_hint() } else { String::new() },
        ),
        libc::EACCES | libc::EPERM => (
            RegErrorKind::Other,
            format!("{err}: not permitted on {}", a.domain),
            "check access to /dev/infiniband/uverbs* and the locked-memory limit (ulimit -l)".into(),
        ),
        libc::EINVAL => (
            RegErrorKind::Other,
            format!(
                "{err}: {} rejected the range {:#x}+{} or its access rights",
                a.domain, a.region.addr, a.region.len
            ),
            String::new(),
        ),
        _ => (RegErrorKind::Other, format!("{err} on {}", a.domain), String::new()),
    };
    RegError {
        domain: a.domain.to_string(),
        mem_type: a.region.mem_type,
        device: a.region.device,
        addr: a.region.addr,
        len: a.region.len,
        kind,
        detail,
        hint,
    }
}

/// The refusal for GPU memory whose GPU has no route (decided before any attempt).
pub fn refused(a: &RegAttempt<'_>, d: &GpuDecision) -> RegError {
    let disabled = d.reasons.iter().any(|r| r.contains("=no"));
    RegError {
        domain: a.domain.to_string(),
        mem_type: a.region.mem_type,
        device: a.region.device,
        addr: a.region.addr,
        len: a.region.len,
        kind: RegErrorKind::UnsupportedMemoryType,
        detail: format!(
            "device memory not registrable on {} for GPU {}: {}",
            a.domain,
            gpu_ordinal(a),
            d.reasons_text()
        ),
        hint: if disabled { String::new() } else { skip_hint() },
    }
}

/// The refusal when registering more would overrun this domain's share of the GPU's BAR1.
pub fn over_budget(a: &RegAttempt<'_>, budget: u64) -> RegError {
    RegError {
        domain: a.domain.to_string(),
        mem_type: a.region.mem_type,
        device: a.region.device,
        addr: a.region.addr,
        len: a.region.len,
        kind: RegErrorKind::ApertureExhausted,
        detail: format!(
            "the BAR1 share of GPU {} on {} is {}; {} is registered and {} more does not fit",
            gpu_ordinal(a),
            a.domain,
            human(budget),
            human(a.gpu_registered),
            human(a.region.len as u64)
        ),
        hint: format!(
            "release GPU registrations (cached ones are evicted and the registration retried once), or {}",
            skip_hint()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpudirect::GdrPath;
    use rucx_ucs::{Error, MemoryType};

    fn gpu_region() -> MemRegion {
        MemRegion {
            addr: 0x7f72_4fa0_0000,
            len: 4096,
            mem_type: MemoryType::Cuda,
            device: Some(0),
        }
    }

    fn peermem_decision() -> GpuDecision {
        GpuDecision {
            path: Some(GdrPath::PeerMem),
            reasons: vec!["GPUDirect RDMA support of this GPU is unknown; trying".into()],
            aperture_budget: None,
            label: "GPU 0".into(),
        }
    }

    fn attempt<'a>(r: &'a MemRegion, d: Option<&'a GpuDecision>) -> RegAttempt<'a> {
        RegAttempt {
            domain: "mlx5_0",
            region: r,
            gpu: d,
            gpu_registered: 0,
            memlock_limit: Some(64 << 10),
        }
    }

    /// The seed's failure, turned into a typed error the planner demotes on.
    #[test]
    fn efault_on_device_memory_is_bad_address_with_reasons_and_hint() {
        let r = gpu_region();
        let d = peermem_decision();
        let e = reg_error(
            &attempt(&r, Some(&d)),
            &VerbsError::new("ibv_reg_mr", libc::EFAULT),
        );
        assert_eq!(e.kind, RegErrorKind::BadAddress);
        assert!(
            e.detail
                .starts_with("device memory not registrable on mlx5_0 for GPU 0: "),
            "{}",
            e.detail
        );
        for want in [
            "ibv_reg_mr failed: Bad address",
            "tried through peer memory",
            "unknown; trying",
        ] {
            assert!(e.detail.contains(want), "{} lacks {want}", e.detail);
        }
        assert_eq!(e.hint, "set RUCX_IB_GPU_DIRECT_RDMA=no to skip the attempt");
        assert_eq!(
            (e.addr, e.len, e.device, e.mem_type),
            (0x7f72_4fa0_0000, 4096, Some(0), MemoryType::Cuda)
        );
        let full = Error::registration(e).to_string();
        assert!(
            full.contains("mlx5_0") && full.contains("RUCX_IB_GPU_DIRECT_RDMA=no"),
            "{full}"
        );
    }

    #[test]
    fn enomem_is_aperture_on_device_and_memlock_on_host() {
        let r = gpu_region();
        let mut d = peermem_decision();
        d.aperture_budget = Some(218 << 20);
        let mut a = attempt(&r, Some(&d));
        a.gpu_registered = 200 << 20;
        let e = reg_error(&a, &VerbsError::new("ibv_reg_dmabuf_mr", libc::ENOMEM));
        assert_eq!(e.kind, RegErrorKind::ApertureExhausted);
        assert!(e.kind.may_recover_by_eviction());
        assert!(
            e.detail.contains("BAR1")
                && e.detail.contains("200 MiB")
                && e.detail.contains("218 MiB"),
            "{}",
            e.detail
        );

        let h = MemRegion::host(0x1000, 1 << 20);
        let e = reg_error(
            &attempt(&h, None),
            &VerbsError::new("ibv_reg_mr", libc::ENOMEM),
        );
        assert_eq!(e.kind, RegErrorKind::NoMemory);
        assert!(
            e.detail.contains("locked-memory limit 64 KiB"),
            "{}",
            e.detail
        );
        assert!(e.hint.contains("ulimit -l"), "{}", e.hint);
    }

    #[test]
    fn other_errnos() {
        let h = MemRegion::host(0x1000, 8);
        let a = attempt(&h, None);
        let k = |errno| reg_error(&a, &VerbsError::new("ibv_reg_mr", errno)).kind;
        assert_eq!(k(libc::EFAULT), RegErrorKind::BadAddress);
        assert_eq!(k(libc::EOPNOTSUPP), RegErrorKind::UnsupportedMemoryType);
        assert_eq!(k(libc::EACCES), RegErrorKind::Other);
        assert_eq!(k(libc::EINVAL), RegErrorKind::Other);
        assert_eq!(k(libc::EIO), RegErrorKind::Other);
        let e = reg_error(&a, &VerbsError::new("ibv_reg_mr", libc::EFAULT));
        assert!(e.detail.contains("not (entirely) mapped"), "{}", e.detail);
        let e = reg_error(&a, &VerbsError::new("ibv_reg_mr", libc::EPERM));
        assert!(e.hint.contains("/dev/infiniband"), "{}", e.hint);
    }

    #[test]
    fn refusals() {
        let r = gpu_region();
        let d = GpuDecision {
            path: None,
            reasons: vec!["the CUDA driver reports no GPUDirect RDMA support for it".into()],
            aperture_budget: None,
            label: "GPU 0".into(),
        };
        let e = refused(&attempt(&r, Some(&d)), &d);
        assert_eq!(e.kind, RegErrorKind::UnsupportedMemoryType);
        assert!(
            e.detail.contains("for GPU 0: the CUDA driver reports"),
            "{}",
            e.detail
        );
        assert!(e.hint.contains("=no"));
        let off = GpuDecision {
            reasons: vec!["disabled by RUCX_IB_GPU_DIRECT_RDMA=no".into()],
            ..d
        };
        assert!(refused(&attempt(&r, Some(&off)), &off).hint.is_empty());
        let mut a = attempt(&r, None);
        a.gpu_registered = 256 << 20;
        let e = over_budget(&a, 256 << 20);
        assert_eq!(e.kind, RegErrorKind::ApertureExhausted);
        assert!(
            e.detail.contains("256 MiB is registered and 4 KiB more"),
            "{}",
            e.detail
        );
    }
}
