//! NVML, loaded at run time: BAR1 usage and NVLink state for the GPU-direct report.
//!
//! NVML is optional: where it cannot be loaded (no driver, a container without the library),
//! the report says "unknown" for what only NVML knows.

use std::ffi::OsStr;
use std::sync::OnceLock;

use nvml_wrapper::Nvml;
use rucx_ucs::{Error, Result};

use crate::sysfs::normalize_bus_id;

/// Component name used in [`Error::Unavailable`].
pub const COMPONENT: &str = "nvml";

/// Library names tried, in order (the versioned name exists without the development package).
const LIB_NAMES: &[&str] = &["libnvidia-ml.so.1", "libnvidia-ml.so"];

static NVML: OnceLock<std::result::Result<Nvml, String>> = OnceLock::new();

/// NVML, initialized on first use and kept for the life of the process.
pub fn nvml() -> Result<&'static Nvml> {
    let r = NVML.get_or_init(|| {
        let mut errs = Vec::new();
        for name in LIB_NAMES {
            match Nvml::builder().lib_path(OsStr::new(name)).init() {
                Ok(n) => return Ok(n),
                Err(e) => errs.push(format!("{name}: {e}")),
            }
        }
        Err(format!(
            "NVML could not be initialized ({})",
            errs.join("; ")
        ))
    });
    match r {
        Ok(n) => Ok(n),
        Err(reason) => Err(Error::Unavailable {
            component: COMPONENT.into(),
            reason: reason.clone(),
        }),
    }
}

/// BAR1 (the PCIe aperture through which NICs and the CPU reach GPU memory) in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bar1 {
    /// Aperture size.
    pub total: u64,
    /// Mapped now.
    pub used: u64,
    /// Still mappable.
    pub free: u64,
}

fn device(bus_id: &str) -> std::result::Result<nvml_wrapper::Device<'static>, String> {
    let n = nvml().map_err(|e| e.to_string())?;
    // NVML wants the 8-digit domain form.
    let id = normalize_bus_id(bus_id).ok_or_else(|| format!("bad PCI bus id {bus_id:?}"))?;
    let nvml_id = format!("0000{id}");
    n.device_by_pci_bus_id(nvml_id.as_str())
        .map_err(|e| format!("NVML does not know the GPU at {id}: {e}"))
}

/// BAR1 figures of the GPU at `bus_id`, or why they are unknown.
pub fn bar1(bus_id: &str) -> std::result::Result<Bar1, String> {
    let d = device(bus_id)?;
    let b = d
        .bar1_memory_info()
        .map_err(|e| format!("nvmlDeviceGetBAR1MemoryInfo failed: {e}"))?;
    Ok(Bar1 {
        total: b.total,
        used: b.used,
        free: b.free,
    })
}

/// NVML's maximum number of NVLink links per GPU.
const MAX_LINKS: u32 = 18;

/// NVLink state of one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvlinkState {
    /// Active links.
    pub active: u32,
    /// Active links grouped by the remote end's PCI bus id (normalized). With an NVSwitch in
    /// between, the remote end is the switch, or unknown inside a VM.
    pub remotes: Vec<(String, u32)>,
}

/// NVLink state of the GPU at `bus_id`, or why unknown.
pub fn nvlinks(bus_id: &str) -> std::result::Result<NvlinkState, String> {
    let d = device(bus_id)?;
    let mut out = NvlinkState::default();
    for link in 0..MAX_LINKS {
        let l = d.link_wrapper_for(link);
        // Links past the GPU's count answer InvalidArg; a GPU without NVLink NotSupported.
        if let Ok(true) = l.is_active() {
            out.active += 1;
            let remote = l
                .remote_pci_info()
                .ok()
                .and_then(|p| normalize_bus_id(&p.bus_id))
                .unwrap_or_else(|| "unknown".into());
            match out.remotes.iter_mut().find(|(b, _)| *b == remote) {
                Some((_, n)) => *n += 1,
                None => out.remotes.push((remote, 1)),
            }
        }
    }
    Ok(out)
}

/// Whether NVML says the GPUs at `a` and `b` can do peer-to-peer over NVLink (directly or
/// through NVSwitches), or why unknown.
pub fn nvlink_p2p(a: &str, b: &str) -> std::result::Result<bool, String> {
    use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
    let da = device(a)?;
    let db = device(b)?;
    da.p2p_status(&db, P2pCapabilitiesIndex::NvLink)
        .map(|s| s == P2pStatus::Ok)
        .map_err(|e| format!("nvmlDeviceGetP2PStatus failed: {e}"))
}

/// The kernel driver version NVML reports (e.g. `580.159.04`).
pub fn driver_version() -> std::result::Result<String, String> {
    let n = nvml().map_err(|e| e.to_string())?;
    n.sys_driver_version().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_nvml_is_unavailable_not_a_panic() {
        match nvml() {
            Ok(_) => {} // a GPU host
            Err(Error::Unavailable { component, reason }) => {
                assert_eq!(component, COMPONENT);
                assert!(reason.contains("libnvidia-ml"), "{reason}");
                let e = bar1("0000:19:00.0").unwrap_err();
                assert!(e.contains("NVML"), "{e}");
                assert!(nvlinks("0000:19:00.0").is_err());
                assert!(nvlink_p2p("0000:19:00.0", "0000:1a:00.0").is_err());
                assert!(driver_version().is_err());
            }
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
}
