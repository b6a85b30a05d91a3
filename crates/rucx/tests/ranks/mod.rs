//! Two ranks of a test as child processes of the test binary (told apart by
//! `RUCX_TEST_RANK_ROLE`), meeting through the launcher bootstrap like any rucx job; shared by
//! the owned-request and endpoint-lifecycle tests. Also the in-process pieces those tests share:
//! two workers of one context, driving them, recording error-handler calls.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rucx::{EpId, Worker};

pub const ROLE: &str = "RUCX_TEST_RANK_ROLE";

/// True in a rank (a child), false in the test that spawns them.
pub fn in_child() -> bool {
    std::env::var(ROLE).is_ok()
}

/// A port for the rendezvous, outside the ephemeral range (a port-0 listener's port could be
/// handed to another test's connection before rank 0 binds it).
fn free_port() -> u16 {
    rucx::bootstrap::local_port().unwrap()
}

/// Spawn the two ranks of test `test` over transports `tls`, with extra environment.
pub fn spawn(test: &str, tls: &str, env: &[(&str, &str)]) -> Vec<Child> {
    spawn_with(test, |_| {
        std::iter::once(("RUCX_TLS".to_string(), tls.to_string()))
            .chain(env.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    })
}

/// Spawn the two ranks of test `test`, each with the environment `env_of(rank)` gives.
pub fn spawn_with(test: &str, env_of: impl Fn(usize) -> Vec<(String, String)>) -> Vec<Child> {
    let exe = std::env::current_exe().unwrap();
    let boot = format!("127.0.0.1:{}", free_port());
    (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, "1")
                .env("RUCX_RANK", rank.to_string())
                .env("RUCX_SIZE", "2")
                .env("RUCX_BOOTSTRAP", &boot)
                .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
                .envs(env_of(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Why GPU tests do not run here (`RUCX_GPU_TESTS=1` is not set), or `None` when they do;
/// with it set, a missing CUDA driver is a failure, not a skip.
pub fn gpu_skip_reason() -> Option<String> {
    if std::env::var("RUCX_GPU_TESTS").as_deref() != Ok("1") {
        return Some("set RUCX_GPU_TESTS=1 to run GPU tests".into());
    }
    match rucx::cuda::driver() {
        Ok(_) => None,
        Err(e) => panic!("RUCX_GPU_TESTS=1 but the CUDA driver is unavailable: {e}"),
    }
}

/// Wait up to `limit` for `k` to exit (killing it past that): its success and its output.
pub fn finish(mut k: Child, limit: Duration) -> (bool, String) {
    let t = Instant::now();
    while k.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = k.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = k.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

/// Run both ranks of `test` to the end and assert both succeeded; their outputs.
pub fn run_both(test: &str, tls: &str, env: &[(&str, &str)]) -> Vec<String> {
    let kids = spawn(test, tls, env);
    let outs: Vec<(bool, String)> = kids
        .into_iter()
        .map(|k| finish(k, Duration::from_secs(120)))
        .collect();
    // Both ranks' outputs when either failed: the other's often says why (it may have
    // exited first, and the one that failed only saw its peer go).
    if outs.iter().any(|(ok, _)| !ok) {
        let all: Vec<String> = outs
            .iter()
            .enumerate()
            .map(|(r, (ok, text))| {
                let how = if *ok { "succeeded" } else { "FAILED" };
                format!("--- rank {r} over {tls} {how}:\n{text}")
            })
            .collect();
        panic!("{}", all.join("\n"));
    }
    outs.into_iter().map(|o| o.1).collect()
}

/// A test pattern: byte `i` of message `salt`.
pub fn pattern(n: usize, salt: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(131) ^ salt.wrapping_mul(29)) as u8)
        .collect()
}

/// Two workers of one context over transports `tls`.
pub fn worker_pair(tls: &str) -> (Worker, Worker) {
    let cfg = rucx::ucs::Config::from_vars(&rucx::config_tables(), [("RUCX_TLS", tls)]).unwrap();
    let ctx = rucx::context(cfg).unwrap();
    (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap())
}

/// Progress the workers until `done`, at most 30 s.
pub fn drive(ws: &[&Worker], mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        for w in ws {
            w.progress();
        }
        assert!(t.elapsed() < Duration::from_secs(30), "hung");
    }
}

/// The calls of a worker's error handler: (endpoint, error text), in order.
pub type Calls = Arc<Mutex<Vec<(EpId, String)>>>;

/// A worker error handler that records its calls.
pub fn record_errors(w: &Worker) -> Calls {
    let calls: Calls = Arc::default();
    let c = calls.clone();
    w.set_error_handler(move |_, ep, e| c.lock().unwrap().push((ep, e.to_string())));
    calls
}

/// Kill the peer process `pid` (reached by endpoint `peer`) with SIGKILL once `calls`, the
/// record of the survivor's error handler, shows nothing was reported yet; progress the survivor
/// with `idle(until, limit)` until the handler is called (at most 20 s), then `after` more.
/// Returns how long the detection took and the one call, after checking that there was exactly
/// one and that it names `peer`.
pub fn kill_and_detect(
    pid: u32,
    peer: EpId,
    calls: &Calls,
    idle: impl Fn(&dyn Fn() -> bool, Duration),
    after: Duration,
) -> (Duration, (EpId, String)) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    assert!(
        calls.lock().unwrap().is_empty(),
        "{:?}",
        calls.lock().unwrap()
    );
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let t = Instant::now();
    idle(
        &|| !calls.lock().unwrap().is_empty(),
        Duration::from_secs(20),
    );
    let detected = t.elapsed();
    // More progress: no second call.
    idle(&|| false, after);
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "one call: {calls:?}");
    assert_eq!(calls[0].0, peer);
    (detected, calls[0].clone())
}
