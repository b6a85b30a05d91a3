//! Tests across two network namespaces joined by a veth pair: the conformance suite with the
//! initiator and the responder in different namespaces (as on two hosts), and a peer that
//! becomes unreachable without closing anything, detected by the user timeout (busy
//! connection) and keepalive (idle connection).
//!
//! The namespaces, the veth pair and its addresses (10.213.N.1 and .2) exist only inside the
//! namespaces this test creates; they are deleted when the test ends, passed or failed (and
//! leftovers of killed runs are removed at the next run). Without the right to create
//! namespaces (not root, no `ip`), the tests print why and skip.

mod common;

use std::process::Command;

use common::{ChildProc, ROLE, unhex};
use rucx_uct::Event;
use rucx_uct::conformance::{self, ProcessPlan, ep_params_from_hex};

const PREFIX: &str = "rucx-tcp-";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces `a` and `b`, joined by a veth pair (`dev[0]` in `a`, `dev[1]` in `b`).
struct NetnsPair {
    ns: [String; 2],
    dev: [String; 2],
    created: Vec<String>,
}

impl NetnsPair {
    fn create(tag: u8) -> Result<NetnsPair, String> {
        remove_stale();
        let pid = std::process::id();
        let mut p = NetnsPair {
            ns: [
                format!("{PREFIX}{pid}-{tag}-a"),
                format!("{PREFIX}{pid}-{tag}-b"),
            ],
            dev: [
                format!("rxt{tag}a{}", pid % 100_000),
                format!("rxt{tag}b{}", pid % 100_000),
            ],
            created: Vec::new(),
        };
        for ns in p.ns.clone() {
            ip(&["netns", "add", &ns])?;
            p.created.push(ns);
        }
        let (a, b) = (p.ns[0].clone(), p.ns[1].clone());
        let (da, db) = (p.dev[0].clone(), p.dev[1].clone());
        ip(&[
            "link", "add", &da, "netns", &a, "type", "veth", "peer", "name", &db, "netns", &b,
        ])?;
        for (ns, dev, host) in [(&a, &da, 1), (&b, &db, 2)] {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("10.213.{tag}.{host}/24"),
                "dev",
                dev,
            ])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        // The kernel reports the carrier (IFF_RUNNING) a moment after the link is set up.
        for (ns, dev) in [(&a, &da), (&b, &db)] {
            let start = std::time::Instant::now();
            loop {
                let out = Command::new("ip")
                    .args(["-n", ns, "-o", "link", "show", "dev", dev])
                    .output()
                    .map_err(|e| e.to_string())?;
                if String::from_utf8_lossy(&out.stdout).contains("state UP") {
                    break;
                }
                if start.elapsed() > std::time::Duration::from_secs(20) {
                    return Err(format!("{dev} in {ns} did not come up"));
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        Ok(p)
    }

    fn launcher(&self, i: usize) -> Vec<String> {
        ["ip", "netns", "exec", &self.ns[i]]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    /// `RUCX_TCP_IFACES` naming both veth ends (each namespace sees only its own).
    fn env(&self) -> Vec<(String, String)> {
        vec![(
            "RUCX_TCP_IFACES".into(),
            format!("{},{}", self.dev[0], self.dev[1]),
        )]
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in &self.created {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

/// Remove namespaces left by test processes that no longer exist (killed runs).
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

fn create_or_skip(tag: u8) -> Option<NetnsPair> {
    match NetnsPair::create(tag) {
        Ok(p) => Some(p),
        Err(e) => {
            println!(
                "skipped: cannot create network namespaces here ({e}); run as root with iproute2"
            );
            None
        }
    }
}

#[test]
fn conformance_across_network_namespaces() {
    common::end_libtest_line();
    if std::env::var(conformance::ROLE_ENV).is_ok() {
        conformance::two_process(
            "conformance_across_network_namespaces",
            common::open_first_dev,
            &ProcessPlan::default(),
        )
        .unwrap();
        return;
    }
    let Some(pair) = create_or_skip(0) else {
        return;
    };
    let plan = ProcessPlan {
        responder_launcher: pair.launcher(1),
        initiator_launcher: Some(pair.launcher(0)),
        env: pair.env(),
    };
    let report = conformance::two_process(
        "conformance_across_network_namespaces",
        common::open_first_dev,
        &plan,
    )
    .unwrap();
    report.print();
}

/// Streamer role: connect to the victim (an idle endpoint and a busy one), stream until the
/// parent cuts the link, and check that both endpoints fail with the right cause.
fn streamer_main() {
    println!();
    let mut line = String::new();
    let mut read = || {
        line.clear();
        std::io::stdin().read_line(&mut line).unwrap();
        line.trim().to_string()
    };
    let (addr, rkey, base) = (read(), unhex(&read()), read().parse::<u64>().unwrap());
    let mut side = common::open_first_dev().unwrap();
    println!("streaming over {}", side.iface.attr().dev_name);
    // An idle endpoint: used once, then left alone, so only keepalive can notice the loss.
    let mut idle = side
        .iface
        .create_ep(&ep_params_from_hex(&addr, 1).unwrap())
        .unwrap();
    idle.am_short(1, 0, b"hello").unwrap();
    assert_eq!(idle.flush(1).unwrap(), rucx_uct::OpStatus::InProgress);
    common::progress_until(
        &mut [&mut side.iface],
        "idle endpoint flush",
        |_, ev| match ev {
            Event::Completion { token: 1, result } => result.map(|()| Some(())).unwrap(),
            other => panic!("unexpected {other:?}"),
        },
    );
    let mut announced = false;
    let mut out = common::stream_until_failure(&mut side, &addr, &rkey, base, &mut |ok| {
        if ok >= 200 && !announced {
            println!("RXSTREAMING {ok}");
            announced = true;
        }
        announced
    });
    while out.other_ep_errors.is_empty() {
        side.iface.progress(&mut |ev| {
            if let Event::EpError { user_id, error } = ev {
                out.other_ep_errors.push((user_id, error.to_string()));
            }
        });
    }
    println!("{out:?}");
    let busy = out.ep_error.as_deref().unwrap();
    // The user timeout fires; the kernel reports it as ETIMEDOUT or, when neighbor resolution
    // failed meanwhile, as the pending EHOSTUNREACH.
    assert!(
        busy.contains("timed out") || busy.contains("No route to host"),
        "busy endpoint: {busy}"
    );
    assert!(
        out.failed + out.refused >= 1,
        "operations in flight fail: {out:?}"
    );
    let (uid, idle_err) = &out.other_ep_errors[0];
    assert_eq!(*uid, 1);
    assert!(idle_err.contains("timed out"), "idle endpoint: {idle_err}");
    println!(
        "busy endpoint failed {:?} after the cut was announced; idle one too",
        out.detect
    );
    drop(idle);
}

#[test]
fn unreachable_peer_is_detected_by_timeouts() {
    match std::env::var(ROLE).as_deref() {
        Ok("victim") => return common::victim_main(None),
        Ok("streamer") => return streamer_main(),
        _ => {}
    }
    let Some(pair) = create_or_skip(1) else {
        return;
    };
    let name = "unreachable_peer_is_detected_by_timeouts";
    let mut victim = ChildProc::spawn(name, "victim", &pair.launcher(1), &pair.env());
    let info = [
        victim.expect_line("RXADDR"),
        victim.expect_line("RXRKEY"),
        victim.expect_line("RXBASE"),
    ];
    let mut streamer = ChildProc::spawn(name, "streamer", &pair.launcher(0), &pair.env());
    for l in &info {
        streamer.send_line(l);
    }
    streamer.expect_line("RXSTREAMING");
    // The victim stays alive but its link goes down: no FIN, no RST, just silence.
    ip(&["-n", &pair.ns[1], "link", "set", &pair.dev[1], "down"]).unwrap();
    streamer.wait_ok("streamer");
    drop(victim);
    drop(pair);
}
