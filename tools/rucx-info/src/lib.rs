//! Rendering for `rucx-info`: resources (`-d`), configuration (`-c`), version (`-v`).

use std::fmt::Write;

use rucx_ucs::units::format_bytes;
use rucx_ucs::{Config, OptKind};
use rucx_uct::{Discovery, IfaceCaps, IfaceParams, MemoryDomain};

fn limit(v: Option<u64>) -> String {
    match v {
        None => "unlimited".into(),
        Some(b) => format!("<= {}", format_bytes(b)),
    }
}

fn size(v: usize) -> String {
    if v >= (usize::MAX >> 2) {
        "unlimited".into()
    } else {
        format!("<= {}", format_bytes(v as u64))
    }
}

/// Describe one memory domain and its transports in the layout `ucx_info -d` users know.
pub fn render_domain(out: &mut String, md: &dyn MemoryDomain, config: &Config) {
    let a = md.attr();
    let _ = writeln!(out, "#");
    let _ = writeln!(out, "# Memory domain: {}", md.name());
    let _ = writeln!(out, "#     Component: {}", a.component);
    if !a.reg_mem_types().is_empty() {
        let _ = writeln!(
            out,
            "#             register: {}, cost: {:.0}{} nsec",
            limit(a.max_reg),
            a.reg_cost.overhead_ns,
            if a.reg_cost.per_byte_ns > 0.0 {
                format!(" + {:.4} * N", a.reg_cost.per_byte_ns)
            } else {
                String::new()
            }
        );
    }
    if !a.types_with(rucx_uct::MemTypeFlags::ALLOC).is_empty() {
        let _ = writeln!(out, "#             allocate: {}", limit(a.max_alloc));
    }
    let _ = writeln!(out, "#           remote key: {} bytes", a.rkey_packed_size);
    if a.need_memh_for_zcopy {
        let _ = writeln!(out, "#           local memory handle is required for zcopy");
    }
    let types: Vec<String> = a
        .mem_types
        .iter()
        .filter(|(_, f)| !f.is_empty())
        .map(|(m, f)| format!("{m} ({f})"))
        .collect();
    let _ = writeln!(
        out,
        "#         memory types: {}",
        if types.is_empty() {
            "-".into()
        } else {
            types.join(", ")
        }
    );
    for tl in md.tl_resources() {
        let _ = writeln!(out, "#");
        let _ = writeln!(out, "#      Transport: {}", tl.tl_name);
        let _ = writeln!(out, "#         Device: {}", tl.dev_name);
        match md.open_iface(&tl, &IfaceParams { config }) {
            Ok(iface) => render_iface(out, iface.attr()),
            Err(e) => {
                let _ = writeln!(out, "#   unavailable: {e}");
            }
        }
    }
}

fn render_iface(out: &mut String, a: &rucx_uct::IfaceAttr) {
    let _ = writeln!(out, "#           Type: {}", a.dev_type);
    let _ = writeln!(
        out,
        "#  System device: {}",
        a.sys_device.as_deref().unwrap_or("<unknown>")
    );
    let _ = writeln!(out, "#");
    let _ = writeln!(out, "#      capabilities:");
    let _ = writeln!(
        out,
        "#            bandwidth: {:.2} MB/sec",
        a.perf.bandwidth / 1e6
    );
    let _ = writeln!(out, "#              latency: {:.0} nsec", a.perf.latency_ns);
    let _ = writeln!(
        out,
        "#             overhead: {:.0} nsec",
        a.perf.overhead_ns
    );
    let l = &a.limits;
    let caps = [
        (
            IfaceCaps::PUT_SHORT,
            "put_short",
            size(l.put_max_short),
            false,
        ),
        (
            IfaceCaps::PUT_ZCOPY,
            "put_zcopy",
            size(l.put_max_zcopy),
            true,
        ),
        (
            IfaceCaps::GET_ZCOPY,
            "get_zcopy",
            size(l.get_max_zcopy),
            true,
        ),
        (IfaceCaps::AM_SHORT, "am_short", size(l.am_max_short), false),
        (IfaceCaps::AM_BCOPY, "am_bcopy", size(l.am_max_bcopy), false),
        (IfaceCaps::AM_ZCOPY, "am_zcopy", size(l.am_max_zcopy), true),
    ];
    for (cap, name, lim, iov) in caps {
        if a.has(cap) {
            let suffix = if iov {
                format!(", up to {} iov", l.max_iov)
            } else {
                String::new()
            };
            let _ = writeln!(out, "#            {name:>9}: {lim}{suffix}");
        }
    }
    if a.has(IfaceCaps::AM_ZCOPY) {
        let _ = writeln!(out, "#            am header: <= {}", l.am_max_hdr);
    }
    let mut conn = Vec::new();
    if a.has(IfaceCaps::CONNECT_TO_EP) {
        conn.push("to ep");
    }
    if a.has(IfaceCaps::CONNECT_TO_IFACE) {
        conn.push("to iface");
    }
    let _ = writeln!(out, "#           connection: {}", conn.join(", "));
    let _ = writeln!(out, "#      device priority: {}", a.priority);
    let _ = writeln!(
        out,
        "#              max eps: {}",
        a.max_eps.map_or("inf".to_string(), |n| n.to_string())
    );
    let _ = writeln!(out, "#       device address: {} bytes", a.device_addr_len);
    let _ = writeln!(out, "#        iface address: {} bytes", a.iface_addr_len);
    if a.ep_addr_len > 0 {
        let _ = writeln!(out, "#           ep address: {} bytes", a.ep_addr_len);
    }
    let _ = writeln!(
        out,
        "#       error handling: {}",
        if a.has(IfaceCaps::ERRHANDLE_PEER_FAILURE) {
            "peer failure"
        } else {
            "none"
        }
    );
}

/// `-d`: every available domain with its transports, then the unavailable components.
pub fn render_devices(d: &Discovery, config: &Config) -> String {
    let mut out = String::new();
    for md in &d.domains {
        render_domain(&mut out, md.as_ref(), config);
    }
    let _ = writeln!(out, "#");
    if !d.unavailable.is_empty() {
        let _ = writeln!(out, "# Unavailable components:");
        for (name, reason) in &d.unavailable {
            let _ = writeln!(out, "#   {name}: unavailable: {reason}");
        }
    }
    if !d.deselected.is_empty() {
        let _ = writeln!(
            out,
            "# Left out by RUCX_TLS={}: {}",
            config.raw("TLS").unwrap_or_default(),
            d.deselected.join(", ")
        );
    }
    out
}

/// `-c`: every option with its current value and help.
pub fn render_config(config: &Config) -> String {
    let mut out = String::new();
    for (spec, raw, from_env) in config.options() {
        let _ = writeln!(out, "#");
        for line in wrap(spec.help, 90) {
            let _ = writeln!(out, "# {line}");
        }
        let _ = writeln!(
            out,
            "# type: {}; accepted: {}",
            spec.kind,
            spec.kind.accepted()
        );
        let _ = writeln!(
            out,
            "# default: {:?}{}",
            spec.default,
            if from_env {
                " (set from the environment)"
            } else {
                ""
            }
        );
        if spec.kind == OptKind::Secret && !raw.is_empty() {
            // A secret is never printed, not even to its owner.
            let _ = writeln!(out, "# RUCX_{}=(set; not shown)", spec.name);
        } else {
            let _ = writeln!(out, "RUCX_{}={}", spec.name, raw);
        }
    }
    out
}

fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for w in text.split_whitespace() {
        let cur = lines.last_mut().expect("non-empty");
        if !cur.is_empty() && cur.len() + 1 + w.len() > width {
            lines.push(w.to_string());
        } else {
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(w);
        }
    }
    lines
}

/// `-e`: the protocol tables a worker would use, to itself and to another worker on this host
/// (as a peer process would be reached).
pub fn render_endpoints(config: Config) -> rucx_ucs::Result<String> {
    let ctx = rucx_ucp::Context::new(&rucx_transports::registry(), config)?;
    let a = rucx_ucp::Worker::new(&ctx)?;
    let b = rucx_ucp::Worker::new(&ctx)?;
    let mut out = String::new();
    for (what, addr) in [
        ("itself", a.address()),
        ("another worker on this host", b.address()),
    ] {
        let _ = writeln!(out, "# endpoint to {what}:");
        match a.connect(&addr) {
            Ok(ep) => {
                let (am, rma) = a.lanes(ep)?;
                let _ = writeln!(
                    out,
                    "#   lanes: active messages {am}, remote memory access {}",
                    rma.as_deref().unwrap_or("none")
                );
                let _ = writeln!(out, "{}", a.proto_info(ep)?);
                let _ = writeln!(out, "#   paths for large messages (GPU 0):");
                for p in a.path_query(ep, Some(0))? {
                    let _ = writeln!(out, "#     {p}");
                }
            }
            Err(e) => {
                let _ = writeln!(out, "#   unreachable: {e}");
            }
        }
    }
    let d = ctx.demotions();
    if !d.is_empty() {
        let _ = writeln!(out, "# demotions:");
        for x in d {
            let _ = writeln!(out, "#   {x} ({})", x.knob);
        }
    }
    Ok(out)
}

/// `-v`: version and what was built in.
pub fn render_version(d: &Discovery) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# rucx version {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        out,
        "# built for {}-{}, {} profile",
        std::env::consts::ARCH,
        std::env::consts::OS,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    let names: Vec<_> = rucx_transports::registry()
        .components()
        .iter()
        .map(|c| c.name())
        .collect();
    let _ = writeln!(out, "# components built in: {}", names.join(", "));
    let usable: Vec<_> = d.domains.iter().map(|m| m.name().to_string()).collect();
    let _ = writeln!(out, "# memory domains usable here: {}", usable.join(", "));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(vars: &[(&str, &str)]) -> (Config, Discovery) {
        let cfg =
            Config::from_vars(&rucx_transports::config_tables(), vars.iter().copied()).unwrap();
        let d = rucx_transports::registry()
            .discover(&cfg, Some("TLS"))
            .unwrap();
        (cfg, d)
    }

    #[test]
    fn devices_show_self_in_the_known_layout() {
        let (cfg, d) = setup(&[]);
        let s = render_devices(&d, &cfg);
        for want in [
            "# Memory domain: self",
            "#     Component: self",
            "memory types: host (reg|access)",
            "#      Transport: self",
            "#         Device: memory0",
            "#           Type: loopback",
            "am_short: <= 8K",
            "connection: to iface",
            "remote key:",
        ] {
            assert!(s.contains(want), "missing {want:?} in\n{s}");
        }
    }

    #[test]
    fn tls_filter_is_reported() {
        let (cfg, d) = setup(&[("RUCX_TLS", "^self")]);
        let s = render_devices(&d, &cfg);
        assert!(!s.contains("Memory domain: self"));
        assert!(s.contains("Left out by RUCX_TLS=^self: self"), "{s}");
    }

    #[test]
    fn endpoint_tables_for_self_and_a_second_worker() {
        let mut tables = rucx_transports::config_tables();
        tables.push(rucx_ucp::CONFIG);
        let cfg = Config::from_vars(&tables, [("RUCX_TLS", "self,posix")]).unwrap();
        let s = render_endpoints(cfg).unwrap();
        assert!(
            s.contains("endpoint to itself") && s.contains("self/memory0"),
            "{s}"
        );
        assert!(
            s.contains("another worker on this host") && s.contains("posix/memory"),
            "{s}"
        );
        assert!(s.contains("eager short") && s.contains("rendezvous"), "{s}");
        assert!(
            s.contains("host -> host: rendezvous zero-copy read from remote"),
            "{s}"
        );
        assert!(
            s.contains("cuda -> cuda: unsupported") && s.contains("no copy transport"),
            "{s}"
        );
    }

    #[test]
    fn config_lists_every_option() {
        let (cfg, _) = setup(&[("RUCX_TLS", "sm,self")]);
        let s = render_config(&cfg);
        for t in rucx_transports::config_tables() {
            for o in t {
                assert!(s.contains(&format!("RUCX_{}=", o.name)), "{}", o.name);
            }
        }
        assert!(s.contains("RUCX_TLS=sm,self"));
        assert!(s.contains("(set from the environment)"));
    }

    #[test]
    fn secrets_are_not_shown() {
        static SECRET: &[rucx_ucs::OptionSpec] = &[rucx_ucs::OptionSpec {
            name: "SOME_KEY",
            kind: OptKind::Secret,
            default: "",
            help: "a secret",
        }];
        let cfg =
            Config::from_vars(&[SECRET], [("RUCX_SOME_KEY", "0123456789abcdef-secret")]).unwrap();
        let s = render_config(&cfg);
        assert!(!s.contains("0123456789abcdef-secret"), "{s}");
        assert!(s.contains("RUCX_SOME_KEY=(set; not shown)"), "{s}");
    }
}
