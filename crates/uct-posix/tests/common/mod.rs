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

/// Hex-encode bytes.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Decode [`hex`].
pub fn unhex(s: &str) -> Vec<u8> {
    let s = s.trim();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Descriptors of this process that refer to posix segments.
pub fn own_segment_fds() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|p| p.to_string_lossy().into_owned())
                .filter(|p| p.contains("rucx-posix-"))
                .collect()
        })
        .unwrap_or_default()
}
