//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use rucx_ucs::Config;
use rucx_uct::conformance::Side;
use rucx_uct::{Component, IfaceParams, MemoryDomain, TlResource};
use rucx_uct_posix::{CONFIG, PosixComponent};

/// A configuration with the posix options, `extra` applied on top.
pub fn config(extra: &[(&str, &str)]) -> Config {
    let mut c = Config::new(&[rucx_uct::CONFIG, CONFIG]).expect("option tables");
    for (k, v) in extra {
        c.set(k, v).expect("valid option");
    }
    c
}

/// Open the posix domain and one interface.
pub fn open_side(extra: &[(&str, &str)]) -> Result<Side, String> {
    let cfg = config(extra);
    let md: Arc<dyn MemoryDomain> = PosixComponent
        .open_md("posix", &cfg)
        .map_err(|e| e.to_string())?;
    let tl = TlResource {
        tl_name: "posix".into(),
        dev_name: "memory".into(),
    };
    let iface = md
        .open_iface(&tl, &IfaceParams { config: &cfg })
        .map_err(|e| e.to_string())?;
    Ok(Side { md, iface })
}

/// Names in /dev/shm made by the posix transport.
pub fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("rucx-posix-"))
                .collect()
        })
        .unwrap_or_default()
}
