//! rucx `gdr_copy` transport: the CPU reads and writes GPU memory through a BAR1 mapping made
//! by gdrcopy (`libgdrapi` + the `gdrdrv` kernel driver), for small host <-> device copies at
//! CPU latency.
//!
//! - Component, memory domain and transport `gdr_copy`, device `cuda`.
//! - `libgdrapi.so.2` (or `RUCX_GDR_COPY_LIB`) is loaded at run time with `libloading`
//!   ([`api`]); when it is missing, lacks an entry point, when `/dev/gdrdrv` does not exist,
//!   or when there is no CUDA driver, the component is
//!   [`Availability::Unavailable`](rucx_uct::Availability::Unavailable) with that reason.
//! - Registering device memory ([`GdrCopyMd`]) pins the GPU pages covering it
//!   (`gdr_pin_buffer`, 64 KiB granularity) and maps them into this process (`gdr_map`); the
//!   handle undoes both when its last clone drops. Remote keys name a live registration of
//!   this process (as `cuda_copy`: the "remote" side is local memory).
//! - The endpoint writes (`put_short`, `put_zcopy` from host memory: `gdr_copy_to_mapping`)
//!   and reads (`get_zcopy` into host memory: `gdr_copy_from_mapping`) synchronously.
//!
//! **Where it runs:** neither the build machine nor the project's GPU machine has gdrcopy, so
//! the pin/map/copy paths have not been executed anywhere; they are written against gdrcopy
//! 2.x's documented API for hosts where it is installed. What runs here: availability with its
//! reasons, key packing and validation, attribute derivation, alignment arithmetic.

pub mod api;
pub mod iface;
pub mod md;

pub use iface::{GdrCopyEp, GdrCopyIface};
pub use md::{GdrCopyComponent, GdrCopyMd, RkeyFields};

use rucx_ucs::{Config, OptKind, OptionSpec};

/// Component, memory domain and transport name.
pub const NAME: &str = "gdr_copy";
/// Device name of the single transport resource.
pub const DEVICE: &str = "cuda";

/// Options of this crate (names without the `RUCX_` prefix).
pub static CONFIG: &[OptionSpec] = &[OptionSpec {
    name: "GDR_COPY_LIB",
    kind: OptKind::Str,
    default: "libgdrapi.so.2",
    help: "The gdrcopy user library to load (a file name searched on the loader path, or a \
           path).",
}];

/// The library name configured in `config` (the default when the option is not declared).
pub fn lib_name(config: &Config) -> String {
    if config.has("GDR_COPY_LIB") {
        config.string("GDR_COPY_LIB").to_string()
    } else {
        CONFIG[0].default.to_string()
    }
}

/// Whether the component can run here, and why not: the library, then the driver's device
/// file, then the CUDA driver.
pub fn probe(lib: &str, device_file: &std::path::Path) -> std::result::Result<api::GdrApi, String> {
    let api = api::GdrApi::load(lib)?;
    api::check_device(device_file)?;
    rucx_cuda::driver().map_err(|e| match e {
        rucx_ucs::Error::Unavailable { reason, .. } => reason,
        other => other.to_string(),
    })?;
    Ok(api)
}

/// This host's boot id (zeros when unreadable), for address checks.
pub(crate) use rucx_uct::local::boot_id;

#[cfg(test)]
mod tests {
    use super::*;
    use rucx_uct::{Availability, Component};

    #[test]
    fn unavailable_with_the_exact_reason() {
        let cfg = Config::new(&[CONFIG]).unwrap();
        assert_eq!(lib_name(&cfg), "libgdrapi.so.2");
        let have_lib = api::GdrApi::load("libgdrapi.so.2").is_ok();
        let have_dev = std::path::Path::new(api::DEVICE_FILE).exists();
        match GdrCopyComponent.query(&cfg) {
            Availability::Unavailable(reason) if !have_lib => {
                assert!(
                    reason.starts_with("libgdrapi.so.2 could not be loaded"),
                    "{reason}"
                );
            }
            Availability::Unavailable(reason) if !have_dev => {
                assert!(reason.contains("/dev/gdrdrv does not exist"), "{reason}");
            }
            Availability::Unavailable(reason) => assert!(!reason.is_empty()),
            Availability::Available(mds) => {
                assert!(have_lib && have_dev);
                assert_eq!(mds, vec!["gdr_copy"]);
            }
        }
        // A configured library name is used, and opening the domain says the same thing.
        let mut cfg = Config::new(&[CONFIG]).unwrap();
        cfg.set("GDR_COPY_LIB", "/nonexistent/libgdrapi.so.2")
            .unwrap();
        match GdrCopyComponent.query(&cfg) {
            Availability::Unavailable(r) => {
                assert!(
                    r.starts_with("/nonexistent/libgdrapi.so.2 could not be loaded"),
                    "{r}"
                )
            }
            other => panic!("{other:?}"),
        }
        let e = GdrCopyComponent.open_md("gdr_copy", &cfg).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/libgdrapi.so.2"), "{e}");
        assert_eq!(GdrCopyComponent.transports(), &["gdr_copy"]);
    }

    #[test]
    fn probe_order_library_then_device() {
        // libc loads but is not gdrcopy.
        let e = probe("libc.so.6", std::path::Path::new("/")).err().unwrap();
        assert!(e.contains("lacks"), "{e}");
        let e = probe("no-such-lib.so", std::path::Path::new("/nope"))
            .err()
            .unwrap();
        assert!(e.contains("no-such-lib.so could not be loaded"), "{e}");
        assert_eq!(boot_id(), boot_id());
        for o in CONFIG {
            assert!(!o.name.starts_with("RUCX_"));
        }
    }
}
