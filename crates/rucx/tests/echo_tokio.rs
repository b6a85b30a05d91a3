//! The tokio echo example (`examples/echo_tokio.rs`) as a service under load: 64 concurrent
//! clients, 4 more killed (SIGKILL) in the middle of 1 MiB requests; the server logs each dead
//! client once, serves the others to the end, and shuts down cleanly when told.
#![cfg(feature = "tokio")]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

const DOOMED: usize = 4;
const CLIENTS: usize = 64;

/// The example, built next to this test by `cargo test --features tokio`.
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    dir.join("examples").join("echo_tokio")
}

/// Spawn the example with `args`; its stdout and stderr lines arrive on the receivers.
fn spawn(args: &[&str]) -> (Child, Receiver<String>, Receiver<String>) {
    let mut c = Command::new(example())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", example().display()));
    let lines = |r: Box<dyn std::io::Read + Send>| {
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(r).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        rx
    };
    let out = lines(Box::new(c.stdout.take().unwrap()));
    let err = lines(Box::new(c.stderr.take().unwrap()));
    (c, out, err)
}

/// The first line of `rx` that `f` accepts, within `limit`.
fn line_where(rx: &Receiver<String>, limit: Duration, f: impl Fn(&str) -> bool) -> String {
    let t = Instant::now();
    loop {
        let left = limit.saturating_sub(t.elapsed());
        match rx.recv_timeout(left) {
            Ok(l) if f(&l) => return l,
            Ok(_) => {}
            Err(e) => panic!("no matching line within {limit:?}: {e}"),
        }
    }
}

/// Wait up to `limit` for `c` to exit; its success.
fn exit_ok(c: &mut Child, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Some(st) = c.try_wait().unwrap() {
            return st.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
    false
}

#[test]
#[ignore = "on main after the merges of 2026-12-01 the server accepts no second client while a \
            doomed client streams 1 MiB echoes (the second connect times out after 10 s); it \
            passed on the h-events branch; open in issue 13"]
fn echo_server_serves_64_clients_survives_killed_ones_and_shuts_down() {
    let (mut server, sout, serr) = spawn(&["server"]);
    let addr = line_where(&sout, Duration::from_secs(30), |l| {
        l.starts_with("listening on ")
    })
    .trim_start_matches("listening on ")
    .to_string();
    // Clients that stream 1 MiB requests until they are killed.
    let mut doomed: Vec<_> = (0..DOOMED)
        .map(|_| {
            let (c, out, _err) = spawn(&["doomed", &addr]);
            line_where(&out, Duration::from_secs(30), |l| {
                l == "doomed client started"
            });
            (c, out)
        })
        .collect();
    let (mut clients, cout, cerr) = spawn(&["client", &addr, &CLIENTS.to_string(), "30"]);
    for (c, _) in &mut doomed {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let ok = exit_ok(&mut clients, Duration::from_secs(120));
    let client_out: Vec<String> = cout.try_iter().chain(cerr.try_iter()).collect();
    assert!(ok, "the clients failed: {client_out:#?}");
    // Each killed client is logged once, and only those.
    let mut failed = Vec::new();
    let t = Instant::now();
    while failed.len() < DOOMED && t.elapsed() < Duration::from_secs(30) {
        if let Ok(l) = serr.recv_timeout(Duration::from_millis(100))
            && l.starts_with("server: client ")
            && l.contains(" failed: ")
        {
            failed.push(l);
        }
    }
    let (mut stop, _, _) = spawn(&["shutdown", &addr]);
    assert!(
        exit_ok(&mut stop, Duration::from_secs(30)),
        "shutdown failed"
    );
    assert!(
        exit_ok(&mut server, Duration::from_secs(30)),
        "the server did not exit cleanly"
    );
    failed.extend(
        serr.try_iter()
            .filter(|l| l.starts_with("server: client ") && l.contains(" failed: ")),
    );
    let eps: BTreeSet<&str> = failed
        .iter()
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    println!("{failed:#?}");
    assert_eq!(
        failed.len(),
        DOOMED,
        "one line per killed client: {failed:#?}"
    );
    assert_eq!(eps.len(), DOOMED, "each killed client once: {failed:#?}");
    let out: Vec<String> = sout.try_iter().collect();
    let disconnected = out.iter().filter(|l| l.ends_with(" disconnected")).count();
    // Every client closed its endpoint (the shutdown client's close may race the exit).
    assert!(
        disconnected >= CLIENTS,
        "{disconnected} clients disconnected, {CLIENTS} closed: {out:#?}"
    );
    assert!(
        out.iter()
            .any(|l| l.starts_with("server: shut down after ")),
        "{out:#?}"
    );
}
