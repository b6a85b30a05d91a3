//! UCX's own example programs, `ucp_hello_world` and `ucp_client_server`, as Debian ships
//! them in `libucx-dev` (`/usr/share/doc/libucx-dev/examples`), built here from the installed
//! package with the system's UCX headers and run unmodified, client and server as two
//! processes, with rucx's `libucp.so.0` first on `LD_LIBRARY_PATH` (every process asserts,
//! through `RUCX_ABI_ANNOUNCE`, that it loaded rucx's library; `ldd` is checked too).
//!
//! - `ucp_hello_world` in each wait mode (`-b` busy polling, `-w` `ucp_worker_wait`, `-f` the
//!   worker's event descriptor under `epoll`), the pair wired over its own out-of-band socket,
//!   and in its three failure modes (`-e send|recv|keepalive`: a side kills itself, the other
//!   must see the failure and not hang; with `recv` the server's one small send to the dead
//!   client may also complete locally, as in UCX, which the example accepts);
//! - `ucp_client_server` over rucx's listener and connection requests, with `-c tag`, `-c
//!   stream`, `-c am` and the default (stream), at the default size and at 2 MB over several
//!   iterations (rendezvous and multi-fragment paths), two clients in turn, over IPv6 too.
//!
//! Needs `libucx-dev` and a C compiler (`ci/setup.sh` installs them); without the package the
//! tests say so and pass, except under CI (`CI` set), where they fail.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

mod common;
use common::run_ok;

const EXAMPLES: &str = "/usr/share/doc/libucx-dev/examples";
/// The string both examples send (their generator's first 15 letters).
const TEST_STRING: &str = "ABCDEFGHIJKLMNO";
/// Longest any one program may run.
const LIMIT: Duration = Duration::from_secs(90);

/// One pair of programs at a time: the machine is small.
static SERIAL: Mutex<()> = Mutex::new(());

struct Setup {
    /// The libraries and the built programs.
    dir: PathBuf,
    /// rucx's libucp as the announcement line names it.
    lib: PathBuf,
}

/// The libraries and the two programs, built once; `None` (with a message) when `libucx-dev`
/// is not installed outside CI.
fn setup() -> Option<&'static Setup> {
    static SETUP: OnceLock<Option<Setup>> = OnceLock::new();
    SETUP
        .get_or_init(|| {
            let have = ["ucp_hello_world.c", "ucp_client_server.c"]
                .iter()
                .all(|f| Path::new(EXAMPLES).join(f).exists())
                && Path::new("/usr/include/ucp/api/ucp.h").exists();
            if !have {
                let msg = format!(
                    "UCX's examples are not installed ({EXAMPLES}, /usr/include/ucp): install \
                     the Debian package libucx-dev (ci/setup.sh does)"
                );
                assert!(std::env::var_os("CI").is_none(), "{msg}");
                eprintln!("skipped: {msg}");
                return None;
            }
            let (dir, lib) = common::abi_lib_dir("ucx-abi-examples");
            for name in ["ucp_hello_world", "ucp_client_server"] {
                // Linked against the system's UCX (its development links), run on rucx's.
                let prog = dir.join(name);
                run_ok(
                    Command::new("cc")
                        .args(["-O1", "-o"])
                        .arg(&prog)
                        .arg(Path::new(EXAMPLES).join(format!("{name}.c")))
                        .args(["-I/usr/include", "-lucp", "-lucs"]),
                    &format!("cc {name}.c"),
                );
                let ldd = run_ok(
                    Command::new("ldd").arg(&prog).env("LD_LIBRARY_PATH", &dir),
                    "ldd",
                );
                for l in ["libucp.so.0", "libucs.so.0"] {
                    let want = format!("{l} => {}", dir.join(l).display());
                    assert!(ldd.contains(&want), "{name} does not load {want}:\n{ldd}");
                }
            }
            Some(Setup { dir, lib })
        })
        .as_ref()
}

/// What a program printed so far (stdout and stderr interleaved by line), with a signal for
/// every new line.
type Output = Arc<(Mutex<String>, Condvar)>;

/// One example program running, its output collected as it comes.
struct Proc {
    name: String,
    child: Child,
    out: Output,
    readers: Vec<std::thread::JoinHandle<()>>,
    start: Instant,
}

impl Proc {
    /// Start `prog args` on rucx's libraries, its stdout line-buffered (`stdbuf`: the
    /// programs print to a pipe, which the C library would otherwise buffer until exit).
    fn spawn(s: &Setup, prog: &str, args: &[&str]) -> Proc {
        let mut cmd = Command::new("stdbuf");
        cmd.arg("-oL")
            .arg(s.dir.join(prog))
            .args(args)
            .env("LD_LIBRARY_PATH", &s.dir)
            .env("RUCX_ABI_ANNOUNCE", "y")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("the example starts");
        let out: Output = Arc::new((Mutex::new(String::new()), Condvar::new()));
        let mut readers = Vec::new();
        let pipes: [Box<dyn Read + Send>; 2] = [
            Box::new(child.stdout.take().expect("stdout")),
            Box::new(child.stderr.take().expect("stderr")),
        ];
        for pipe in pipes {
            let out = out.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    let (m, c) = &*out;
                    let mut s = m.lock().unwrap();
                    s.push_str(&line);
                    s.push('\n');
                    c.notify_all();
                }
            }));
        }
        Proc {
            name: format!("{prog} {}", args.join(" ")),
            child,
            out,
            readers,
            start: Instant::now(),
        }
    }

    fn output(&self) -> String {
        self.out.0.lock().unwrap().clone()
    }

    /// Wait until the program printed `needle` (`count` times); false after `limit`.
    fn wait_for(&self, needle: &str, count: usize, limit: Duration) -> bool {
        let (m, c) = &*self.out;
        let deadline = Instant::now() + limit;
        let mut s = m.lock().unwrap();
        loop {
            if s.matches(needle).count() >= count {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = c
                .wait_timeout(s, (deadline - now).min(Duration::from_millis(200)))
                .unwrap()
                .0;
        }
    }

    /// Wait for the program to exit (killed after [`LIMIT`] from its start): its status
    /// (`None`: it hung) and everything it printed.
    fn finish(mut self) -> (Option<ExitStatus>, String) {
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break Some(st);
            }
            if self.start.elapsed() > LIMIT {
                eprintln!("{} hung: killed after {LIMIT:?}", self.name);
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        (status, self.output())
    }

    /// Stop a program that serves forever (`ucp_client_server`'s server): what it printed.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        self.output()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Assert the program initialized rucx's libucp (this build's), once.
fn assert_rucx(s: &Setup, name: &str, out: &str) {
    let lib = s.lib.display().to_string();
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("rucx libucp: ucp_init in pid"))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "{name}: expected one rucx libucp initialization:\n{out}"
    );
    assert!(
        lines[0].ends_with(&format!("from {lib}")),
        "{name} loaded another libucp: {} (expected {lib})",
        lines[0]
    );
}

fn port() -> String {
    rucx::bootstrap::local_port()
        .expect("a free port")
        .to_string()
}

/// `ucp_hello_world` in wait mode `mode` (`-b`, `-w`, `-f`): both sides exit 0, the client
/// prints the success banner and the string, the server flushed.
fn hello(mode: &str) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = setup() else { return };
    let port = port();
    let server = Proc::spawn(s, "ucp_hello_world", &[mode, "-p", &port]);
    // Its out-of-band socket listens before it says so.
    assert!(
        server.wait_for("Waiting for connection...", 1, LIMIT),
        "server did not start:\n{}",
        server.output()
    );
    let client = Proc::spawn(
        s,
        "ucp_hello_world",
        &[mode, "-n", "127.0.0.1", "-p", &port],
    );
    let (cst, cout) = client.finish();
    let (sst, sout) = server.finish();
    let both = format!("--- client\n{cout}\n--- server\n{sout}");
    println!("{both}");
    assert!(
        cst.is_some_and(|s| s.success()),
        "client failed: {cst:?}\n{both}"
    );
    assert!(
        sst.is_some_and(|s| s.success()),
        "server failed: {sst:?}\n{both}"
    );
    assert!(cout.contains("----- UCP TEST SUCCESS ----"), "{both}");
    assert!(cout.contains(TEST_STRING), "{both}");
    assert!(
        cout.contains("finish to send UCX address message"),
        "{both}"
    );
    assert!(
        cout.contains("finish to receive UCX data message"),
        "{both}"
    );
    assert!(
        sout.contains("finish to receive UCX address message"),
        "{both}"
    );
    assert!(sout.contains("finish to send UCX data message"), "{both}");
    assert!(
        sout.contains("flush_ep completed with status 0 (Success)"),
        "{both}"
    );
    assert_rucx(s, "client", &cout);
    assert_rucx(s, "server", &sout);
}

#[test]
fn hello_world_busy_polling() {
    hello("-b");
}

#[test]
fn hello_world_worker_wait() {
    hello("-w");
}

#[test]
fn hello_world_event_fd() {
    hello("-f");
}

/// `ucp_hello_world -e how`: the side that kills itself dies by SIGKILL; the other sees its
/// failure (its failure handler called, or its send ended with an error) and ends in time.
fn hello_failure(how: &str) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = setup() else { return };
    let port = port();
    let server = Proc::spawn(s, "ucp_hello_world", &["-e", how, "-p", &port]);
    assert!(
        server.wait_for("Waiting for connection...", 1, LIMIT),
        "server did not start:\n{}",
        server.output()
    );
    let client = Proc::spawn(
        s,
        "ucp_hello_world",
        &["-e", how, "-n", "127.0.0.1", "-p", &port],
    );
    let (cst, cout) = client.finish();
    let (sst, sout) = server.finish();
    let both = format!("--- client\n{cout}\n--- server\n{sout}");
    println!("{both}");
    use std::os::unix::process::ExitStatusExt;
    let killed = |st: Option<ExitStatus>| st.is_some_and(|s| s.signal() == Some(libc::SIGKILL));
    let (victim, survivor, sst_survivor, sout_survivor) = match how {
        "send" => ("server", "client", cst, &cout),
        _ => ("client", "server", sst, &sout),
    };
    let victim_st = if victim == "server" { sst } else { cst };
    assert!(
        killed(victim_st),
        "the {victim} should have killed itself: {victim_st:?}\n{both}"
    );
    assert!(sst_survivor.is_some(), "the {survivor} hung\n{both}");
    // Seen as the failure handler's call, the send's error, or (a client already gone when
    // the server connects back, which the example counts as the failure seen) the endpoint
    // refused with its reason.
    let saw = sout_survivor.contains("failure handler called with status -25")
        || sout_survivor.contains("unable to send UCX data message (Connection reset")
        || (how == "recv"
            && sout_survivor.contains("ucp_ep_create failed")
            && sout_survivor.contains("Failed to ucp_ep_create"));
    // `recv`: the server sends one small message 5 s after the client killed itself; the send
    // (into the dead client's shared-memory ring) and the flush may complete locally before
    // any check ran, as in UCX, and the example then ends with 0 without having seen it.
    let unseen_ok = how == "recv"
        && sout.contains("finish to send UCX data message")
        && sout.contains("flush_ep completed with status 0");
    assert!(
        saw || unseen_ok,
        "the {survivor} did not see the failure\n{both}"
    );
    match how {
        // The example's own verdicts: the client gives up the receive (-1), the server that
        // waited for the failure goes on and flushes (0).
        "send" => {
            assert!(cout.contains("receive data: EP disconnected"), "{both}");
            assert_eq!(cst.and_then(|s| s.code()), Some(255), "{both}");
        }
        "recv" => {
            // The example's verdict: 0 when its endpoint could not be made, -1 when its send
            // failed.
            let code = sst.and_then(|s| s.code());
            assert!(matches!(code, Some(0 | 255)), "{both}");
        }
        "keepalive" => {
            assert!(sst.is_some_and(|s| s.success()), "{both}");
            assert!(sout.contains("flush_ep completed"), "{both}");
        }
        _ => {}
    }
    assert_rucx(s, survivor, sout_survivor);
}

#[test]
fn hello_world_server_dies_before_sending() {
    hello_failure("send");
}

#[test]
fn hello_world_client_dies_before_receiving() {
    hello_failure("recv");
}

#[test]
fn hello_world_client_dies_after_receiving() {
    hello_failure("keepalive");
}

/// `ucp_client_server` with these arguments (`-c ...`, `-s`, `-i`), `clients` clients in
/// turn, over IPv6 with `v6`: every client exits 0 having sent the string; the server (which
/// serves forever) received every iteration and waits for the next client. What the server
/// printed (`None`: skipped, see [`setup`]).
fn client_server(args: &[&str], iterations: usize, clients: usize, v6: bool) -> Option<String> {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // The test string's letters as printed (fewer for a size below 16: `-s`).
    let size = args
        .iter()
        .position(|a| *a == "-s")
        .map_or(16, |i| args[i + 1].parse::<usize>().expect("-s size"));
    let test_string = &TEST_STRING[..TEST_STRING.len().min(size.saturating_sub(1))];
    let s = setup()?;
    let port = port();
    let mut sargs: Vec<&str> = args.to_vec();
    sargs.extend(["-p", &port]);
    if v6 {
        sargs.push("-6");
    }
    let server = Proc::spawn(s, "ucp_client_server", &sargs);
    assert!(
        server.wait_for("server is listening on IP", 1, LIMIT),
        "server did not start:\n{}",
        server.output()
    );
    let mut cargs = sargs.clone();
    cargs.extend(["-a", if v6 { "::1" } else { "127.0.0.1" }]);
    let mut outs = String::new();
    for k in 1..=clients {
        let client = Proc::spawn(s, "ucp_client_server", &cargs);
        let (st, out) = client.finish();
        let what = format!("client {k} of {}", cargs.join(" "));
        assert!(
            st.is_some_and(|s| s.success()),
            "{what} failed: {st:?}\n{out}\n--- server\n{}",
            server.output()
        );
        assert!(
            out.contains(&format!("Client: iteration #{iterations}")),
            "{what}:\n{out}"
        );
        assert!(out.contains(test_string), "{what}:\n{out}");
        assert_rucx(s, &what, &out);
        // Served: each client's iterations, then back to waiting.
        assert!(
            server.wait_for("Waiting for connection...", 1 + k, LIMIT),
            "the server did not finish with client {k}:\n{}",
            server.output()
        );
        outs.push_str(&out);
    }
    let sout = server.stop();
    println!("--- clients\n{outs}\n--- server\n{sout}");
    let banners = sout.matches("----- UCP TEST SUCCESS -------").count();
    // The server prints the first and the last iteration of each client.
    let want = clients * if iterations > 1 { 2 } else { 1 };
    assert_eq!(banners, want, "server:\n{sout}");
    assert_eq!(
        sout.matches("Server received a connection request from client at address")
            .count(),
        clients,
        "server:\n{sout}"
    );
    assert!(sout.contains("UCX data message was received"), "{sout}");
    assert!(sout.contains(test_string), "{sout}");
    for bad in [
        "unable to",
        "failed to",
        "failed on iteration",
        "received wrong data",
    ] {
        assert!(!sout.contains(bad), "server:\n{sout}");
    }
    assert_rucx(s, "server", &sout);
    Some(sout)
}

/// `ucp_client_server -c api -v entries [-s size]`: the message is an IOV of `entries`
/// buffers of `size` bytes on both sides (UCP_DATATYPE_IOV, `count` = entries: the example's
/// own datatype for `-v` > 1), each holding the example's test string (`size - 1` letters and
/// a NUL). The server prints each entry it received: every one must be the whole string (a
/// byte misplaced by the scatter shows as a shorter, longer or shifted line).
fn client_server_iov(api: &str, entries: usize, size: Option<usize>) {
    let v = entries.to_string();
    let sz = size.map(|n| n.to_string());
    let mut args = vec!["-c", api, "-v", &v];
    if let Some(n) = &sz {
        args.extend(["-s", n.as_str()]);
    }
    let Some(sout) = client_server(&args, 1, 1, false) else {
        return;
    };
    let len = size.unwrap_or(16);
    let want: String = (0..len - 1)
        .map(|i| char::from(b'A' + (i % 26) as u8))
        .chain(['.'])
        .collect();
    let whole = sout.lines().filter(|l| *l == want).count();
    assert_eq!(
        whole, entries,
        "{api}: one whole test string ({len} bytes) per entry received:\n{sout}"
    );
    let entry_lines = sout
        .lines()
        .filter(|l| l.starts_with('A') && l.ends_with('.'))
        .count();
    assert_eq!(entry_lines, entries, "{api}: no other entry lines:\n{sout}");
}

#[test]
fn client_server_iov_four_entries() {
    for api in ["tag", "stream", "am"] {
        client_server_iov(api, 4, None);
    }
}

#[test]
fn client_server_iov_three_large_entries() {
    // 3 x 300 kB: rendezvous sizes (the active message's payload is fetched by
    // `ucp_am_recv_data_nbx` into the IOV).
    for api in ["tag", "stream", "am"] {
        client_server_iov(api, 3, Some(300_000));
    }
}

#[test]
fn client_server_iov_seven_small_entries() {
    for api in ["tag", "stream", "am"] {
        client_server_iov(api, 7, Some(5));
    }
}

#[test]
fn client_server_tag() {
    client_server(&["-c", "tag"], 1, 1, false);
}

#[test]
fn client_server_stream() {
    client_server(&["-c", "stream"], 1, 1, false);
}

#[test]
fn client_server_am() {
    client_server(&["-c", "am"], 1, 1, false);
}

#[test]
fn client_server_default_is_stream() {
    client_server(&[], 1, 1, false);
}

#[test]
fn client_server_large_messages_several_iterations_two_clients() {
    for api in ["tag", "stream", "am"] {
        client_server(&["-c", api, "-s", "2000000", "-i", "3"], 3, 2, false);
    }
}

#[test]
fn client_server_over_ipv6() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: no IPv6 loopback on this host");
        return;
    }
    client_server(&["-c", "am"], 1, 1, true);
}

/// Build our `tests/c/NAME.c` against the system's UCX headers and libraries (rucx's are put
/// first on the library path when it runs): the program's path.
fn build_c(s: &Setup, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = s.dir.join(name);
    run_ok(
        Command::new("cc")
            .args(["-O1", "-Wall", "-o"])
            .arg(&exe)
            .arg(&src)
            .args(["-I/usr/include", "-lucp", "-lucs"]),
        &format!("cc {name}.c"),
    );
    exe
}

/// `tests/c/cs_one_thread.c` (ours, the public ucp API only): a client and its server in one
/// thread, connected by `ucp_ep_create` by socket address that returns at once and progress of
/// both workers; operations posted while connecting in order, the client id, a reject, a port
/// nobody listens on. Built against the system's UCX and run on it first (the program states
/// UCX's semantics), then on rucx's library (which must match them).
#[test]
fn one_thread_client_and_server_on_the_system_ucx_and_on_rucx() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = setup() else { return };
    let exe = build_c(s, "cs_one_thread");
    // The system's UCX: its own libraries (none of ours on the path).
    let out = run_ok(
        Command::new("timeout")
            .arg("120")
            .arg(&exe)
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("RUCX_ABI_ANNOUNCE"),
        "cs_one_thread on the system's UCX",
    );
    assert!(out.contains("cs_one_thread OK"), "{out}");
    // rucx's.
    let p = Proc::spawn(s, "cs_one_thread", &[]);
    let (status, out) = p.finish();
    assert!(
        status.is_some_and(|st| st.success()),
        "cs_one_thread on rucx: {status:?}\n{out}"
    );
    assert!(out.contains("cs_one_thread OK"), "{out}");
    assert_rucx(s, "cs_one_thread", &out);
}

/// `tests/c/nbi_error.c` (ours, the public ucp API only; rucx's contract, run on rucx only: see
/// the program): an implicit atomic the target refuses after its post makes the next
/// `ucp_ep_flush_nbx` / `ucp_worker_flush_nbx` end with an error, once.
#[test]
fn an_nbi_error_after_its_post_ends_the_next_flush() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = setup() else { return };
    build_c(s, "nbi_error");
    let p = Proc::spawn(s, "nbi_error", &[]);
    let (status, out) = p.finish();
    assert!(
        status.is_some_and(|st| st.success()),
        "nbi_error on rucx: {status:?}\n{out}"
    );
    assert!(out.contains("nbi_error OK"), "{out}");
    // Its two contexts, both on this build's libucp.
    let lib = format!("from {}", s.lib.display());
    let inits: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("rucx libucp: ucp_init in pid"))
        .collect();
    assert_eq!(
        inits.len(),
        2,
        "two contexts on rucx's libucp:
{out}"
    );
    assert!(inits.iter().all(|l| l.ends_with(&lib)), "{out}");
}
