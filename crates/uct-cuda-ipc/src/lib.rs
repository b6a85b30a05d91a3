//! rucx `cuda_ipc` transport: copies between CUDA device memory of different processes on one
//! host, through legacy CUDA IPC handles.
//!
//! - Component, memory domain and transport `cuda_ipc`, device `cuda`.
//! - Registering device memory ([`CudaIpcMd`]) exports a legacy IPC handle
//!   (`cuIpcGetMemHandle`) for the whole *allocation* that contains the buffer. Memory that
//!   cannot be exported that way (stream-ordered pool allocations from `cuMemAllocAsync`, VMM
//!   mappings) fails with [`rucx_ucs::Error::Registration`] of kind
//!   [`NotExportable`](rucx_ucs::RegErrorKind::NotExportable), so the planner can demote the
//!   domain for that memory and pick another path.
//! - A remote key carries the handle, the allocation's base and size, the registered range,
//!   the owner's process id, GPU and host ([`IpcKey`]).
//! - The importing side opens handles (`cuIpcOpenMemHandle`) through a cache ([`IpcCache`]);
//!   see there for when mappings are closed.
//! - `put_zcopy` / `get_zcopy` are device-to-device copies between a local device buffer and
//!   the mapped peer allocation, on one stream per direction and local GPU, with completions
//!   from [`progress`](rucx_uct::Iface::progress) (the engine of
//!   [`rucx_uct_cuda_copy::engine`]). Keys of this very process skip the IPC mapping.
//! - Reachability: the same host only (boot id and host name in the device address). No active
//!   messages: it is an RMA-only transport.
//!
//! Local buffers of put/get need no `cuda_ipc` registration (`need_memh_for_zcopy` is false):
//! the endpoint only reads the region of whatever handle the iov carries (a `cuda_cpy` handle,
//! for example), so a local buffer from a stream-ordered pool can still be copied to or from a
//! peer's exportable buffer.

pub mod cache;
pub mod iface;
pub mod md;

pub use cache::{CacheStats, IpcCache, Mapping};
pub use iface::{CudaIpcEp, CudaIpcIface};
pub use md::{CudaIpcComponent, CudaIpcMd, IpcKey, IpcReg};

use rucx_ucs::{Bounds, Config, Error, OptKind, OptionSpec, Result};

/// Component, memory domain and transport name.
pub const NAME: &str = "cuda_ipc";
/// Device name of the single transport resource.
pub const DEVICE: &str = "cuda";
/// The hint every "cannot export" registration error carries.
pub const NOT_EXPORTABLE_HINT: &str =
    "set RUCX_REG_SKIP=cuda_ipc:cuda to skip the attempt, or allocate with cuMemAlloc";

/// Options of this crate (names without the `RUCX_` prefix).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "CUDA_IPC_CACHE",
        kind: OptKind::Bool,
        default: "y",
        help: "Keep peer allocations mapped (cuIpcOpenMemHandle) after use, for reuse by later \
               copies. With n, a mapping is closed as soon as no copy uses it.",
    },
    OptionSpec {
        name: "CUDA_IPC_CACHE_SIZE",
        kind: OptKind::UintIn(Bounds::new(1, 1 << 20)),
        default: "1024",
        help: "Most peer allocations kept mapped per process (1 to 1048576); beyond it the least \
               recently used mapping is closed.",
    },
    OptionSpec {
        name: "CUDA_IPC_MAX_INFLIGHT",
        kind: OptKind::UintIn(Bounds::new(1, 65536)),
        default: "256",
        help: "Most cuda_ipc operations in flight per interface (1 to 65536).",
    },
    OptionSpec {
        name: "CUDA_IPC_PAGEABLE_THREADS",
        kind: OptKind::UintIn(Bounds::new(0, 64)),
        default: "4",
        help: "Helper threads that stage cuda_ipc copies of at least 1 MiB between pageable \
               host memory and GPU memory through pinned chunks (writes into the GPU and reads \
               out of it), copying one chunk while the copy engines move others (0 to 64; each \
               thread pins two 4 MiB slots per GPU on first use; 0: the driver stages them on \
               the posting thread, at one core's copy rate).",
    },
];

/// Settings read from a [`Config`]; options missing from it take their defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Keep mappings open after use.
    pub cache: bool,
    /// Most mappings kept.
    pub cache_size: usize,
    /// Most operations in flight per interface.
    pub max_inflight: usize,
    /// Helper threads staging writes out of pageable host memory (0: none).
    pub pageable_threads: usize,
}

impl Settings {
    /// Read and validate.
    pub fn from_config(config: &Config) -> Result<Settings> {
        let defaults = Config::new(&[CONFIG])?;
        let cfg = |name: &str| if config.has(name) { config } else { &defaults };
        let range = |name: &str, lo: u64, hi: u64| -> Result<usize> {
            let v = cfg(name).uint(name);
            if (lo..=hi).contains(&v) {
                Ok(v as usize)
            } else {
                Err(Error::Config {
                    var: format!("{}{name}", rucx_ucs::config::ENV_PREFIX),
                    value: v.to_string(),
                    reason: "out of range".into(),
                    accepted: format!("{lo} .. {hi}"),
                })
            }
        };
        Ok(Settings {
            cache: cfg("CUDA_IPC_CACHE").bool("CUDA_IPC_CACHE"),
            cache_size: range("CUDA_IPC_CACHE_SIZE", 1, 1 << 20)?,
            max_inflight: range("CUDA_IPC_MAX_INFLIGHT", 1, 65536)?,
            pageable_threads: range("CUDA_IPC_PAGEABLE_THREADS", 0, 64)?,
        })
    }
}

/// This host's identity: kernel boot id and host name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostId {
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: [u8; 16],
    /// `/proc/sys/kernel/hostname`.
    pub hostname: String,
}

impl HostId {
    /// Read it (empty or zero fields where the files are unreadable).
    pub fn local() -> HostId {
        HostId {
            boot_id: rucx_uct::local::boot_id(),
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().chars().take(255).collect())
                .unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings() {
        let s = Settings::from_config(&Config::new(&[rucx_uct::CONFIG]).unwrap()).unwrap();
        assert_eq!(
            s,
            Settings {
                cache: true,
                cache_size: 1024,
                max_inflight: 256,
                pageable_threads: 4
            }
        );
        let mut c = Config::new(&[CONFIG]).unwrap();
        c.set("CUDA_IPC_CACHE", "n").unwrap();
        c.set("CUDA_IPC_CACHE_SIZE", "3").unwrap();
        let s = Settings::from_config(&c).unwrap();
        assert!(!s.cache && s.cache_size == 3);
        for (k, v) in [
            ("CUDA_IPC_CACHE_SIZE", "0"),
            ("CUDA_IPC_MAX_INFLIGHT", "0"),
            ("CUDA_IPC_MAX_INFLIGHT", "70000"),
            ("CUDA_IPC_PAGEABLE_THREADS", "65"),
        ] {
            let mut c = Config::new(&[CONFIG]).unwrap();
            let e = c.set(k, v).unwrap_err().to_string();
            assert!(e.contains(&format!("RUCX_{k}")), "{e}");
        }
        for o in CONFIG {
            assert!(!o.name.starts_with("RUCX_"));
        }
    }

    #[test]
    fn host_id_is_stable() {
        assert_eq!(HostId::local(), HostId::local());
        assert!(NOT_EXPORTABLE_HINT.contains("RUCX_REG_SKIP=cuda_ipc:cuda"));
    }
}
