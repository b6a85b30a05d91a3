//! rucx `cuda_copy` transport: copies between host and CUDA device memory of one process, on
//! CUDA streams, with a pool of pinned host fragments for staging protocols.
//!
//! - Component and memory domain `cuda_cpy`, transport `cuda_copy` on device `cuda`.
//! - The domain ([`CudaCopyMd`]) page-locks host buffers for DMA (`cuMemHostRegister`, undone
//!   when the last clone of the handle drops; already pinned memory is left alone), accepts
//!   device and managed buffers as they are (nothing to register, the handle only describes
//!   them), allocates device and pinned host memory ([`CudaCopyMd::alloc`]), tells CUDA
//!   memory from host memory ([`detect_mem_type`](rucx_uct::MemoryDomain::detect_mem_type)),
//!   and owns the staging pool ([`CudaCopyMd::staging_pool`]).
//! - The interface ([`CudaCopyIface`]) does `put_zcopy` / `get_zcopy` between a local buffer
//!   and a "remote" buffer that is in this same process (as UCX's cuda_copy: the remote key is
//!   a validated envelope naming this process and one live registration), and `put_short`
//!   through a synchronous copy. Copies run on one stream per direction and device
//!   ([`engine`]); several can be in flight; completions come out of
//!   [`progress`](rucx_uct::Iface::progress). No active messages: it is a copy engine, not a
//!   messaging transport.
//!
//! Without a CUDA driver the component reports
//! [`Availability::Unavailable`](rucx_uct::Availability::Unavailable) with the reason from
//! [`rucx_cuda::driver()`].
//!
//! # How a protocol layer stages through host memory
//!
//! ```ignore
//! // `md`: the domain named "cuda_cpy" from discovery (any `Arc<dyn MemoryDomain>`).
//! let pool = StagingPool::new(&Settings::from_config(&cfg)?)?;     // pinned host fragments
//! let mut iface = md.open_iface(&md.tl_resources()[0], &params)?;
//! let mut ep = iface.create_ep(&EpParams { dev_addr: iface.device_address(),
//!                                          iface_addr: iface.iface_address(), user_id: 0 })?;
//! let frag = pool.get().ok_or(...)?;                               // None: all in use, retry
//! let dev_memh = unsafe { md.mem_reg(device_region)? };            // no-op for device memory
//! let rkey = md.rkey_unpack(&md.mkey_pack(&dev_memh)?)?;
//! // device -> host fragment: read the device buffer into the fragment
//! ep.get_zcopy(&[Iov { addr: frag.addr(), len: n, memh: frag.memh() }], dev_addr, &rkey, tok)?;
//! // ... progress the iface until Completion { token: tok }, then send the fragment, drop it.
//! ```

pub mod engine;
pub mod iface;
pub mod md;
pub mod pageable;
pub mod staging;

pub use engine::{CopyEngine, CopyOp, KeepAlive, LaneKey};
pub use iface::{CudaCopyEp, CudaCopyIface};
pub use md::{Allocation, CudaCopyComponent, CudaCopyMd, RkeyFields};
pub use staging::{Fragment, StagingPool};

use rucx_ucs::{Bounds, Config, Error, MemUnits, OptKind, OptionSpec, Result};

/// Component name.
pub const COMPONENT: &str = "cuda_cpy";
/// Memory domain name.
pub const MD_NAME: &str = "cuda_cpy";
/// Transport name.
pub const TL_NAME: &str = "cuda_copy";
/// Device name of the single transport resource.
pub const DEVICE: &str = "cuda";

/// Options of this crate (names without the `RUCX_` prefix).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "CUDA_COPY_FRAG_SIZE",
        kind: OptKind::MemIn(Bounds::new(Settings::MIN_FRAG, Settings::MAX_FRAG)),
        default: "1M",
        help: "Size of each pinned host staging fragment (4K to 1G).",
    },
    OptionSpec {
        name: "CUDA_COPY_FRAG_COUNT",
        kind: OptKind::UintIn(Bounds::new(1, Settings::MAX_FRAGS)),
        default: "64",
        help: "Number of pinned host staging fragments (1 to 65536); they are allocated together \
               on first use, and no more are ever handed out.",
    },
    OptionSpec {
        name: "CUDA_COPY_MAX_INFLIGHT",
        kind: OptKind::UintIn(Bounds::new(1, 65536)),
        default: "256",
        help: "Most cuda_copy operations in flight per interface (1 to 65536); beyond it posting \
               returns 'no resources' until progress completes some.",
    },
];

/// Settings read from a [`Config`]; options missing from it take their defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Bytes per staging fragment.
    pub frag_size: usize,
    /// Staging fragments.
    pub frag_count: usize,
    /// Most operations in flight per interface.
    pub max_inflight: usize,
}

fn cfg_err(name: &str, value: String, reason: &str, accepted: &str) -> Error {
    Error::Config {
        var: format!("{}{name}", rucx_ucs::config::ENV_PREFIX),
        value,
        reason: reason.into(),
        accepted: accepted.into(),
    }
}

impl Settings {
    /// Smallest fragment.
    pub const MIN_FRAG: u64 = 4 << 10;
    /// Largest fragment.
    pub const MAX_FRAG: u64 = 1 << 30;
    /// Most fragments.
    pub const MAX_FRAGS: u64 = 65536;
    /// Largest total staging memory (fragments times size).
    pub const MAX_POOL: u64 = 64 << 30;

    /// Read and validate.
    pub fn from_config(config: &Config) -> Result<Settings> {
        let defaults = Config::new(&[CONFIG])?;
        let cfg = |name: &str| if config.has(name) { config } else { &defaults };
        let fs = cfg("CUDA_COPY_FRAG_SIZE").mem_units("CUDA_COPY_FRAG_SIZE");
        let frag_size = match fs {
            MemUnits::Bytes(b) if (Self::MIN_FRAG..=Self::MAX_FRAG).contains(&b) => b,
            _ => {
                return Err(cfg_err(
                    "CUDA_COPY_FRAG_SIZE",
                    fs.to_string(),
                    "not a size between 4K and 1G",
                    "4K .. 1G, e.g. 512K, 1M, 4M",
                ));
            }
        };
        let frag_count = cfg("CUDA_COPY_FRAG_COUNT").uint("CUDA_COPY_FRAG_COUNT");
        if !(1..=Self::MAX_FRAGS).contains(&frag_count) {
            return Err(cfg_err(
                "CUDA_COPY_FRAG_COUNT",
                frag_count.to_string(),
                "out of range",
                "1 .. 65536",
            ));
        }
        if frag_size.saturating_mul(frag_count) > Self::MAX_POOL {
            return Err(cfg_err(
                "CUDA_COPY_FRAG_COUNT",
                frag_count.to_string(),
                &format!(
                    "{frag_count} fragments of {} exceed the 64G staging limit",
                    rucx_ucs::units::format_bytes(frag_size)
                ),
                "a count whose product with RUCX_CUDA_COPY_FRAG_SIZE is at most 64G",
            ));
        }
        let max_inflight = cfg("CUDA_COPY_MAX_INFLIGHT").uint("CUDA_COPY_MAX_INFLIGHT");
        if !(1..=65536).contains(&max_inflight) {
            return Err(cfg_err(
                "CUDA_COPY_MAX_INFLIGHT",
                max_inflight.to_string(),
                "out of range",
                "1 .. 65536",
            ));
        }
        Ok(Settings {
            frag_size: frag_size as usize,
            frag_count: frag_count as usize,
            max_inflight: max_inflight as usize,
        })
    }
}

/// This host's identity for address checks: the kernel boot id (zeros when unreadable).
pub use rucx_uct::local::boot_id;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_defaults_and_validation() {
        let cfg = Config::new(&[rucx_uct::CONFIG]).unwrap();
        let s = Settings::from_config(&cfg).unwrap();
        assert_eq!(
            s,
            Settings {
                frag_size: 1 << 20,
                frag_count: 64,
                max_inflight: 256
            }
        );
        let mut cfg = Config::new(&[rucx_uct::CONFIG, CONFIG]).unwrap();
        cfg.set("CUDA_COPY_FRAG_SIZE", "512K").unwrap();
        cfg.set("RUCX_CUDA_COPY_FRAG_COUNT", "8").unwrap();
        let s = Settings::from_config(&cfg).unwrap();
        assert_eq!((s.frag_size, s.frag_count), (512 << 10, 8));

        for (name, value, want) in [
            ("CUDA_COPY_FRAG_SIZE", "1K", "RUCX_CUDA_COPY_FRAG_SIZE"),
            ("CUDA_COPY_FRAG_SIZE", "inf", "RUCX_CUDA_COPY_FRAG_SIZE"),
            ("CUDA_COPY_FRAG_COUNT", "0", "RUCX_CUDA_COPY_FRAG_COUNT"),
            ("CUDA_COPY_FRAG_COUNT", "65537", "RUCX_CUDA_COPY_FRAG_COUNT"),
            ("CUDA_COPY_MAX_INFLIGHT", "0", "RUCX_CUDA_COPY_MAX_INFLIGHT"),
        ] {
            let mut cfg = Config::new(&[CONFIG]).unwrap();
            let e = cfg.set(name, value).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{e:?}");
            assert!(e.to_string().contains(want), "{e}");
        }
        // The product is bounded too.
        let mut cfg = Config::new(&[CONFIG]).unwrap();
        cfg.set("CUDA_COPY_FRAG_SIZE", "1G").unwrap();
        cfg.set("CUDA_COPY_FRAG_COUNT", "65").unwrap();
        let e = Settings::from_config(&cfg).unwrap_err().to_string();
        assert!(e.contains("64G"), "{e}");
    }

    #[test]
    fn option_names_carry_no_prefix_and_defaults_parse() {
        for o in CONFIG {
            assert!(!o.name.starts_with("RUCX_"), "{}", o.name);
        }
        Config::new(&[CONFIG]).unwrap();
    }

    #[test]
    fn boot_id_is_stable() {
        assert_eq!(boot_id(), boot_id());
    }
}
