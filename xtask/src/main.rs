//! `cargo xtask <task>`: project chores in Rust, so they run the same everywhere.
//!
//! - `info [rucx-info args]`: build and run `rucx-info` (e.g. `cargo xtask info -d`).
//! - `demo [args]`: build and run the end-to-end two-process example.
//! - `gpu-pack`: build the release test binaries and tools and copy them into `.device/` for
//!   the GPU machine.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command) -> Result<(), String> {
    let st = c.status().map_err(|e| format!("running {c:?}: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{c:?} failed: {st}"))
    }
}

fn info(args: &[String]) -> Result<(), String> {
    let mut c = cargo();
    c.args(["run", "--quiet", "--release", "-p", "rucx-info", "--"])
        .args(args);
    run(c)
}

/// Build the exchange example and run it as two local processes (ranks 0 and 1) that meet on a
/// free loopback port.
fn demo(args: &[String]) -> Result<(), String> {
    // The build needs a few system packages (cmake and libclang for the verbs binding).
    let mut setup = Command::new("bash");
    setup.arg(root().join("ci/setup.sh"));
    run(setup)?;
    let mut c = cargo();
    c.args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "rucx",
        "--example",
        "exchange",
    ]);
    run(c)?;
    let exe = root().join("target/release/examples/exchange");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("finding a free port: {e}"))?
        .port();
    let boot = format!("127.0.0.1:{port}");
    println!(
        "xtask demo: two processes, RUCX_BOOTSTRAP={boot}, {}",
        exe.display()
    );
    let mut children = Vec::new();
    for rank in 0..2 {
        let child = Command::new(&exe)
            .args(args)
            .env("RUCX_RANK", rank.to_string())
            .env("RUCX_SIZE", "2")
            .env("RUCX_BOOTSTRAP", &boot)
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        let st = c
            .wait()
            .map_err(|e| format!("waiting for rank {rank}: {e}"))?;
        if !st.success() {
            failed.push(format!("rank {rank}: {st}"));
        }
    }
    if failed.is_empty() {
        println!("xtask demo: both ranks succeeded");
        Ok(())
    } else {
        Err(format!("demo failed: {}", failed.join(", ")))
    }
}

/// rucx-perftest against ucx_perftest (installed from Debian's ucx-utils when missing), shm and
/// tcp, latency and bandwidth, alternated in one sitting; prints each ratio next to the goals.
fn bench_compare(args: &[String]) -> Result<(), String> {
    let mut setup = Command::new("bash");
    setup.arg(root().join("ci/setup.sh"));
    run(setup)?;
    let mut c = cargo();
    c.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "rucx-perftest",
        "--bin",
        "rucx-bench-compare",
        "--",
    ])
    .args(args);
    run(c)
}

/// Build release test executables and tools, strip them, copy them into `.device/`.
fn gpu_pack(packages: &[String]) -> Result<(), String> {
    let dest = root().join(".device");
    std::fs::create_dir_all(&dest).map_err(|e| format!("creating {}: {e}", dest.display()))?;
    let mut c = cargo();
    c.args(["test", "--release", "--no-run", "--message-format=json"]);
    if packages.is_empty() {
        c.arg("--workspace");
    }
    for p in packages {
        c.args(["-p", p]);
    }
    let out = c
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building test executables failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut copied = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // Minimal extraction of "executable":"..." without a JSON dependency.
        let Some(pos) = line.find("\"executable\":\"") else {
            continue;
        };
        let rest = &line[pos + 14..];
        let Some(end) = rest.find('"') else { continue };
        let exe = PathBuf::from(&rest[..end]);
        let name = exe.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        // Drop the hash suffix so the names are stable: rucx_cuda-0123abcd -> rucx_cuda.
        let stable = name.rsplit_once('-').map_or(name, |(a, _)| a);
        let target = dest.join(stable);
        std::fs::copy(&exe, &target).map_err(|e| format!("copying {}: {e}", exe.display()))?;
        copied.push(target);
    }
    let mut c = cargo();
    c.args(["build", "--release", "-p", "rucx-info"]);
    run(c)?;
    let info = root().join("target/release/rucx-info");
    let target = dest.join("rucx-info");
    std::fs::copy(&info, &target).map_err(|e| format!("copying rucx-info: {e}"))?;
    copied.push(target);
    for f in &copied {
        let _ = Command::new("strip").arg(f).status();
        println!("{}", f.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprintln!("usage: cargo xtask <info|demo|gpu-pack|bench-compare> [args]");
        return ExitCode::from(2);
    };
    let res = match task.as_str() {
        "info" => info(rest),
        "demo" => demo(rest),
        "gpu-pack" => gpu_pack(rest),
        "bench-compare" => bench_compare(rest),
        other => Err(format!(
            "unknown task {other:?}; known: info, demo, gpu-pack, bench-compare"
        )),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
