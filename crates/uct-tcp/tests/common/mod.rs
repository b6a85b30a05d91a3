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
    let md: Arc<dyn MemoryDomain> = TcpComponent
        .open_md("tcp", &cfg)
        .map_err(|e| e.to_string())?;
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
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "hang guard: no {what} after 60s"
        );
    }
}

/// In a spawned child, libtest has printed "test NAME ... " without a newline, and the
/// conformance harness looks for its address marker at the start of a line: end that line.
pub fn end_libtest_line() {
    if std::env::var(rucx_uct::conformance::ROLE_ENV).is_ok() {
        println!();
    }
}

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};

use rucx_uct::conformance::{ep_params_from_hex, pattern};
use rucx_uct::{Endpoint, Iov, MemHandle, MemRegion, OpStatus, RemoteKey};

/// Environment variable naming the role a spawned child of a test binary plays.
pub const ROLE: &str = "RUCX_TCP_TEST_ROLE";

/// A child process running one test function of this binary in a role.
#[derive(Debug)]
pub struct ChildProc {
    pub child: Child,
    lines: Receiver<String>,
}

impl ChildProc {
    /// Spawn this test binary, running only `test_name`, with `ROLE=role`, under `launcher`.
    pub fn spawn(
        test_name: &str,
        role: &str,
        launcher: &[String],
        env: &[(String, String)],
    ) -> ChildProc {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = match launcher.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning the {role} child: {e}"));
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = channel();
        let name = role.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("[{name}] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildProc { child, lines: rx }
    }

    /// The value of the next line `KEY value` the child prints.
    pub fn expect_line(&mut self, key: &str) -> String {
        let start = Instant::now();
        loop {
            let left = Duration::from_secs(60).saturating_sub(start.elapsed());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("child printed no {key} line (see its output above)"));
            if let Some(rest) = line.split_once(key).map(|(_, r)| r) {
                return rest.trim().to_string();
            }
        }
    }

    /// Write one line to the child's stdin.
    pub fn send_line(&mut self, s: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{s}").expect("write to child");
        stdin.flush().expect("flush to child");
    }

    /// Wait for the child to exit successfully.
    pub fn wait_ok(mut self, what: &str) {
        let start = Instant::now();
        loop {
            match self.child.try_wait().expect("try_wait") {
                Some(st) => {
                    assert!(st.success(), "{what} child exited with {st}");
                    return;
                }
                None if start.elapsed() > Duration::from_secs(120) => panic!("{what} child hangs"),
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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

/// Size of the buffer a victim exposes.
pub const VICTIM_BUF: usize = 4 << 20;

/// Child role: open an interface (on `dev`, or the first device), expose a registered buffer,
/// print `RXADDR <hex>`, `RXRKEY <hex>`, `RXBASE <addr>`, then progress until killed (or two
/// minutes pass, so an orphan never lingers).
pub fn victim_main(dev: Option<&str>) {
    println!();
    let mut side = match dev {
        Some(d) => open_side_on(d, &[]),
        None => open_first_dev(),
    }
    .expect("victim opens its interface");
    let buf = vec![0u8; VICTIM_BUF];
    // SAFETY: `buf` lives until the process exits, after the handle.
    let memh = unsafe { side.md.mem_reg(MemRegion::of_slice(&buf)) }.expect("register");
    let rkey = side.md.mkey_pack(&memh).expect("pack");
    println!("RXADDR {}", side.address_hex());
    println!("RXRKEY {}", hex(&rkey));
    println!("RXBASE {}", buf.as_ptr() as usize);
    std::io::stdout().flush().unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(120) {
        side.iface.progress(&mut |_| {});
    }
}

/// Open the domain and an interface on the first device it offers (in a namespace made by
/// the tests, with `RUCX_TCP_IFACES` naming the veth ends, that is the veth).
pub fn open_first_dev() -> Result<Side, String> {
    let cfg = config(&[]);
    let md: Arc<dyn MemoryDomain> = TcpComponent
        .open_md("tcp", &cfg)
        .map_err(|e| e.to_string())?;
    let tl = md
        .tl_resources()
        .into_iter()
        .next()
        .ok_or("no tcp device")?;
    let iface = md
        .open_iface(&tl, &IfaceParams { config: &cfg })
        .map_err(|e| e.to_string())?;
    Ok(Side { md, iface })
}

/// What [`stream_until_failure`] saw.
#[derive(Debug, Default)]
pub struct StreamOutcome {
    /// Operations that completed successfully.
    pub ok: usize,
    /// Operations that completed with an error.
    pub failed: usize,
    /// Operations refused at posting because the endpoint had failed.
    pub refused: usize,
    /// The endpoint error.
    pub ep_error: Option<String>,
    /// One of the operation errors.
    pub op_error: Option<String>,
    /// From the trigger to the last failure.
    pub detect: Duration,
    /// Endpoint errors of other endpoints of the interface: `(user id, error)`.
    pub other_ep_errors: Vec<(u64, String)>,
}

/// Keep a window of put/get/am zero-copy operations in flight to a victim; call `trigger`
/// after every progress with the number of successes so far (it returns true once it has cut
/// the peer off); after the trigger, run until the endpoint error has arrived and every
/// operation posted has completed. Panics on a double completion.
pub fn stream_until_failure(
    side: &mut Side,
    victim_hex: &str,
    rkey: &[u8],
    base: u64,
    trigger: &mut dyn FnMut(usize) -> bool,
) -> StreamOutcome {
    const WINDOW: usize = 16;
    const CHUNK: usize = 64 * 1024;
    let mut ep: Box<dyn Endpoint> = side
        .iface
        .create_ep(&ep_params_from_hex(victim_hex, 7).unwrap())
        .unwrap();
    let rkey: RemoteKey = side.md.rkey_unpack(rkey).unwrap();
    let local = pattern(5, 16 * CHUNK);
    let sink_buf = vec![0u8; 16 * CHUNK];
    // SAFETY: both buffers outlive the handles and every operation (waited for below).
    let lh: MemHandle = unsafe { side.md.mem_reg(MemRegion::of_slice(&local)) }.unwrap();
    // SAFETY: as above.
    let sh: MemHandle = unsafe { side.md.mem_reg(MemRegion::of_slice(&sink_buf)) }.unwrap();
    let mut out = StreamOutcome::default();
    let mut in_flight: HashSet<u64> = HashSet::new();
    let mut token = 0u64;
    let mut triggered: Option<Instant> = None;
    let mut ep_failed = false;
    let start = Instant::now();
    loop {
        // Post until the window is full.
        while !ep_failed && in_flight.len() < WINDOW {
            token += 1;
            let slot = (token as usize) % 16;
            let src = Iov {
                addr: local.as_ptr() as usize + slot * CHUNK,
                len: CHUNK,
                memh: &lh,
            };
            let dst = Iov {
                addr: sink_buf.as_ptr() as usize + slot * CHUNK,
                len: CHUNK,
                memh: &sh,
            };
            let raddr = base + (slot * CHUNK) as u64;
            let r = match token % 3 {
                0 => ep.put_zcopy(&[src], raddr, &rkey, token),
                1 => ep.get_zcopy(&[dst], raddr, &rkey, token),
                _ => ep.am_zcopy(3, b"hdr", &[src], token),
            };
            match r {
                Ok(OpStatus::InProgress) => {
                    in_flight.insert(token);
                }
                Ok(OpStatus::Done) => out.ok += 1,
                Err(e) if e.is_retryable() => break,
                Err(e) => {
                    out.refused += 1;
                    ep_failed = true;
                    if out.op_error.is_none() {
                        out.op_error = Some(e.to_string());
                    }
                }
            }
        }
        side.iface.progress(&mut |ev| match ev {
            Event::Completion { token, result } => {
                assert!(
                    in_flight.remove(&token),
                    "token {token} completed twice or was never posted"
                );
                match result {
                    Ok(()) => out.ok += 1,
                    Err(e) => {
                        out.failed += 1;
                        out.op_error.get_or_insert(e.to_string());
                    }
                }
            }
            Event::EpError { user_id, error } if user_id != 7 => {
                out.other_ep_errors.push((user_id, error.to_string()))
            }
            Event::EpError { error, .. } => {
                assert!(out.ep_error.is_none(), "second endpoint error: {error}");
                out.ep_error = Some(error.to_string());
                ep_failed = true;
            }
            Event::Am { .. } => {}
        });
        if triggered.is_none() && trigger(out.ok) {
            triggered = Some(Instant::now());
        }
        if let Some(t) = triggered
            && out.ep_error.is_some()
            && in_flight.is_empty()
        {
            out.detect = t.elapsed();
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "hang guard: after 90s, {} operations still in flight, endpoint error: {:?}",
            in_flight.len(),
            out.ep_error
        );
    }
    // The failed endpoint refuses new work with an error, never a hang.
    let e = ep.flush(999).unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    drop(ep);
    out
}
