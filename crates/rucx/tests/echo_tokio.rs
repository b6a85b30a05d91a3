//! The tokio echo example (`examples/echo_tokio.rs`) as a service under load: 64 concurrent
//! clients, 4 more killed (SIGKILL) in the middle of 1 MiB requests, and a stranger that
//! connects and says nothing; the server logs each dead client once, serves the others to the
//! end (none waits for the stranger or the streaming clients to be accepted), drops the stranger
//! when it hangs up, and shuts down cleanly when told.
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

/// Spawn the example with `args` over transports `tls` (`None`: the defaults); its stdout and
/// stderr lines arrive on the receivers.
fn spawn(tls: Option<&str>, args: &[&str]) -> (Child, Receiver<String>, Receiver<String>) {
    let mut cmd = Command::new(example());
    match tls {
        Some(t) => cmd.env("RUCX_TLS", t),
        None => cmd.env_remove("RUCX_TLS"),
    };
    let mut c = cmd
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

/// Every line still to come from `rx`, until the child closed its output.
fn rest(rx: &Receiver<String>) -> Vec<String> {
    rx.iter().collect()
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
fn echo_server_serves_64_clients_survives_killed_ones_and_shuts_down() {
    serve(None);
}

#[test]
fn echo_server_over_tcp_serves_64_clients_survives_killed_ones_and_shuts_down() {
    serve(Some("tcp"));
}

fn serve(tls: Option<&str>) {
    let spawn = |args: &[&str]| spawn(tls, args);
    let (mut server, sout, serr) = spawn(&["server"]);
    let addr = line_where(&sout, Duration::from_secs(30), |l| {
        l.starts_with("listening on ")
    })
    .trim_start_matches("listening on ")
    .to_string();
    // Connects and never sends its address.
    let stranger = std::net::TcpStream::connect(&addr).unwrap();
    let stranger_at = stranger.local_addr().unwrap();
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
    let client_out: Vec<String> = rest(&cout).into_iter().chain(rest(&cerr)).collect();
    assert!(ok, "the clients failed: {client_out:#?}");
    drop(stranger);
    let (mut stop, _, stop_err) = spawn(&["shutdown", &addr]);
    let stopped = exit_ok(&mut stop, Duration::from_secs(30));
    let server_ok = exit_ok(&mut server, Duration::from_secs(30));
    let out = rest(&sout);
    let err = rest(&serr);
    assert!(stopped, "shutdown failed: {:#?}", rest(&stop_err));
    assert!(server_ok, "the server did not exit cleanly: {err:#?}");
    // Each killed client is logged once, and only those.
    let failed: Vec<&String> = err
        .iter()
        .filter(|l| l.starts_with("server: client ") && l.contains(" failed: "))
        .collect();
    let eps: BTreeSet<&str> = failed
        .iter()
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    println!("{failed:#?}");
    assert_eq!(failed.len(), DOOMED, "one line per killed client: {err:#?}");
    assert_eq!(eps.len(), DOOMED, "each killed client once: {err:#?}");
    // The stranger, once, when it hung up.
    let refused: Vec<&String> = err
        .iter()
        .filter(|l| l.starts_with("server: a client could not connect: "))
        .collect();
    assert_eq!(refused.len(), 1, "{err:#?}");
    // Dropped when it hung up (or, on a machine so loaded that the clients took longer than
    // the handshake timeout, at its deadline).
    assert!(
        refused[0].contains(&format!("the peer at {stranger_at}")),
        "{err:#?}"
    );
    let connected = out.iter().filter(|l| l.ends_with(" connected")).count();
    assert_eq!(connected, DOOMED + CLIENTS + 1, "{out:#?}");
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
