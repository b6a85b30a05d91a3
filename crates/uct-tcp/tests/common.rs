//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rucx_ucs::Config;
use rucx_uct::conformance::Side;
use rucx_uct::{Component, Event, Iface, IfaceParams, MemoryDomain, TlResource};
use rucx_uct_tcp::{CONFIG, TcpComponent};

/// A configuration with the tcp options from the environment, `extra` applied on top.
pub fn config(extra: &[(&str, &str)]) -> Config {
    let mut c = Config::from_env(&[rucx_uct::CONFIG, CONFIG]).expect("option tables");
    for (k, v) in extra {
        c.set(k, v).expect("valid option");
    }
    c
}

/// Open the tcp domain and an interface on `dev`.
pub fn open_side_on(dev: &str, extra: &[(&str, &str)]) -> Result<Side, String> {
    let cfg = config(extra);
    let md: Arc<dyn MemoryDomain> = TcpComponent.open_md("tcp", &cfg).map_err(|e| e.to_string())?;
    let tl = TlResource {
        tl_name: "tcp".into(),
        dev_name: dev.into(),
    };
    let iface = md
        .open_iface(&tl, &IfaceParams { config: &cfg })
        .map_err(|e| e.to_string())?;
    Ok(Side { md, iface })
}

/// Open the tcp domain and an interface on `lo`.
pub fn open_lo() -> Result<Side, String> {
    open_side_on("lo", &[])
}

/// Progress `iface` until `f` (fed with every event) returns Some, or panic after a generous
/// hang guard (this is not a timing assertion: correct runs finish in milliseconds).
pub fn progress_until<T>(
    ifaces: &mut [&mut Box<dyn Iface>],
    what: &str,
    mut f: impl FnMut(usize, Event<'_>) -> Option<T>,
) -> T {
    let start = Instant::now();
    loop {
        let mut got = None;
        for (i, iface) in ifaces.iter_mut().enumerate() {
            iface.progress(&mut |ev| {
                if got.is_none() {
                    got = f(i, ev);
                }
            });
        }
        if let Some(v) = got {
            return v;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard: no {what} after 60s");
    }
}

/// In a spawned child, libtest has printed "test NAME ... " without a newline, and the
/// conformance harness looks for its address marker at the start of a line: end that line.
pub fn end_libtest_line() {
    if std::env::var(rucx_uct::conformance::ROLE_ENV).is_ok() {
        println!();
    }
}
