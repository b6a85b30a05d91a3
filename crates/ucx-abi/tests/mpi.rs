//! Unmodified MPI programs (`tests/c/*.c`, built here with the system's `mpicc`) run under
//! Open MPI's `pml ucx` with rucx's `libucp.so.0` first on `LD_LIBRARY_PATH`. Every run asserts
//! that each rank really initialized rucx's library (the `RUCX_ABI_ANNOUNCE` line names the
//! file the library was loaded from), not another libucp.
//!
//! Needs Open MPI (`mpicc`, `mpirun`) and a C compiler: `ci/setup.sh` installs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

mod common;
use common::run_ok;

/// One MPI job at a time: the machine is small and the jobs are heavy.
static SERIAL: Mutex<()> = Mutex::new(());

struct Setup {
    /// Where the libraries and the built programs are.
    dir: PathBuf,
    /// rucx's libucp as the announcement line names it.
    lib: PathBuf,
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The libraries: `libucp.so.0` (this crate's cdylib, built with the test) and the thin
/// `libucs.so.0`, `libuct.so.0`, `libucm.so.0` Open MPI's components also list as needed.
fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        for (cmd, pkg) in [
            ("mpicc", "libopenmpi-dev"),
            ("mpirun", "openmpi-bin"),
            ("cc", "gcc"),
        ] {
            assert!(
                have(cmd),
                "`{cmd}` is missing: install the Debian package {pkg} (ci/setup.sh does)"
            );
        }
        // target/<profile>/deps/<this test>: cargo builds this crate's cdylib for the test
        // next to it (`cargo build` copies it up to target/<profile>, `cargo test` does not).
        let (dir, lib) = common::abi_lib_dir("ucx-abi-test");
        Setup { dir, lib }
    })
}

/// Build `tests/c/<name>.c` with `mpicc`.
fn build(name: &str) -> PathBuf {
    let s = setup();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = s.dir.join(name);
    run_ok(
        Command::new("mpicc")
            .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src),
        &format!("mpicc {name}.c"),
    );
    exe
}

struct Job {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Run `prog` on `np` ranks under `mpirun --mca pml ucx` with rucx's libraries (or with the
/// system's UCX when `rucx` is false), killed after `limit`.
fn mpirun(np: usize, prog: &Path, rucx: bool, env: &[(&str, &str)], limit: Duration) -> Job {
    let s = setup();
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &np.to_string(), "--oversubscribe"])
        .args(["--mca", "pml", "ucx"])
        // rucx's transports here are shared memory and TCP, which Open MPI's default transport
        // gate (InfiniBand devices, cuda_ipc) does not list.
        .args([
            "--mca",
            "pml_ucx_tls",
            "any",
            "--mca",
            "pml_ucx_devices",
            "any",
        ])
        .args(["--mca", "btl", "self"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    let mut vars: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if rucx {
        let path = match std::env::var("LD_LIBRARY_PATH") {
            Ok(p) if !p.is_empty() => format!("{}:{p}", s.dir.display()),
            _ => s.dir.display().to_string(),
        };
        vars.push(("LD_LIBRARY_PATH".into(), path));
        vars.push(("RUCX_ABI_ANNOUNCE".into(), "y".into()));
    }
    for (k, v) in &vars {
        cmd.args(["-x", &format!("{k}={v}")]);
    }
    cmd.arg(prog)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let start = Instant::now();
    let child = cmd.spawn().expect("mpirun starts");
    let pid = child.id() as i32;
    let waiter = std::thread::spawn(move || {
        // Kill the whole job if it outlives the limit (a hang fails the test, not CI).
        while start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(100));
            // SAFETY: kill with signal 0 only checks the group exists.
            if unsafe { libc::kill(-pid, 0) } != 0 {
                return false;
            }
        }
        // SAFETY: our own process group (made with process_group(0) above).
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        true
    });
    let out = child.wait_with_output().expect("mpirun output");
    let took = start.elapsed();
    // SAFETY: as above; the group may be gone already.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let timed_out = waiter.join().unwrap_or(false) && took >= limit;
    let job = Job {
        ok: out.status.success() && !timed_out,
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        took,
    };
    assert!(
        !timed_out,
        "{} hung: killed after {limit:?}\n{}\n{}",
        prog.display(),
        job.stdout,
        job.stderr
    );
    job
}

/// Assert every rank initialized rucx's library (from this build), `np` lines in all.
fn assert_rucx_loaded(job: &Job, np: usize) {
    let lib = setup().lib.display().to_string();
    let lines: Vec<&str> = job
        .stderr
        .lines()
        .filter(|l| l.starts_with("rucx libucp: ucp_init in pid"))
        .collect();
    assert_eq!(
        lines.len(),
        np,
        "expected {np} ranks to initialize rucx's libucp:\n{}\n{}",
        job.stdout,
        job.stderr
    );
    for l in lines {
        assert!(
            l.ends_with(&format!("from {lib}")),
            "a rank loaded another libucp: {l} (expected {lib})"
        );
    }
}

fn run_passing(name: &str, np: usize) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let prog = build(name);
    let job = mpirun(np, &prog, true, &[], Duration::from_secs(300));
    println!(
        "{name} on {np} ranks: exit {:?} in {:?}\n{}{}",
        job.code, job.took, job.stdout, job.stderr
    );
    assert!(job.ok, "{name} failed:\n{}\n{}", job.stdout, job.stderr);
    assert_rucx_loaded(&job, np);
    for r in 0..np {
        assert!(
            job.stdout.contains(&format!("rank {r}: {name} OK")),
            "rank {r} did not finish {name}:\n{}\n{}",
            job.stdout,
            job.stderr
        );
    }
}

#[test]
fn p2p_two_ranks() {
    run_passing("p2p", 2);
}

#[test]
fn p2p_three_ranks() {
    run_passing("p2p", 3);
}

#[test]
fn matching_two_ranks() {
    run_passing("match", 2);
}

#[test]
fn matching_four_ranks() {
    run_passing("match", 4);
}

/// A rank killed mid-transfer ends the job with an error, within the limit (no hang).
#[test]
fn killed_rank_ends_the_job() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let prog = build("kill");
    let job = mpirun(2, &prog, true, &[], Duration::from_secs(60));
    println!(
        "kill: exit {:?} after {:?}\n{}{}",
        job.code, job.took, job.stdout, job.stderr
    );
    assert!(!job.ok, "the job succeeded although rank 1 was killed");
    assert!(
        job.stderr.contains("killing myself mid-transfer"),
        "rank 1 never got to the transfer:\n{}",
        job.stderr
    );
    assert_rucx_loaded(&job, 2);
}

/// `tests/c/ucp_err.c`, the ucp API itself (no MPI), built with `cc` against rucx's
/// libraries: two processes exchange worker addresses over pipes and create endpoints with an
/// error handler; the child exits while the parent's 4 MiB send to it is in flight; the
/// parent's handler is called once (from progress, with its endpoint, its argument and
/// `UCS_ERR_CONNECTION_RESET`), closes the endpoint (forced) and the parent exits 0. Over TCP
/// (the connection closes) and over shared memory (the process check sees the child gone).
#[test]
fn ucp_error_handler_when_the_peer_exits() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = setup();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/ucp_err.c");
    let exe = s.dir.join("ucp_err");
    run_ok(
        Command::new("cc")
            .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .arg("-L")
            .arg(&s.dir)
            .args(["-l:libucp.so.0", "-l:libucs.so.0"]),
        "cc ucp_err.c",
    );
    for tls in ["tcp", "posix"] {
        let start = Instant::now();
        // The program ends itself (alarm) if the handler never comes.
        let out = Command::new(&exe)
            .env("LD_LIBRARY_PATH", &s.dir)
            .env("RUCX_ABI_ANNOUNCE", "y")
            .env("RUCX_TLS", tls)
            .stdin(Stdio::null())
            .output()
            .expect("ucp_err runs");
        let job = Job {
            ok: out.status.success(),
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            took: start.elapsed(),
        };
        println!(
            "ucp_err over {tls}: exit {:?} in {:?}\n{}{}",
            job.code, job.took, job.stdout, job.stderr
        );
        assert!(
            job.ok,
            "ucp_err over {tls} failed:\n{}\n{}",
            job.stdout, job.stderr
        );
        assert!(job.stdout.contains("ucp_err OK"), "{}", job.stdout);
        assert!(
            job.stdout
                .contains("handler called once with Connection reset by remote peer"),
            "{}",
            job.stdout
        );
        assert_rucx_loaded(&job, 2);
    }
}

/// `tests/c/rma.c` (MPI one-sided: windows allocated and created, puts and gets under fences
/// and passive-target locks with flushes, accumulates, fetch-and-op at 64 and 32 bits,
/// compare-and-swap; every byte and value checked) with `osc ucx` forced (`OMPI_MCA_osc=ucx`
/// in every rank: with no other one-sided component allowed, a window fails to be made if
/// osc/ucx cannot initialize over rucx), over shared memory and over TCP.
fn run_rma(np: usize) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let prog = build("rma");
    for tls in ["posix,self", "tcp,self"] {
        let env = [("OMPI_MCA_osc", "ucx"), ("RUCX_TLS", tls)];
        let job = mpirun(np, &prog, true, &env, Duration::from_secs(300));
        println!(
            "rma on {np} ranks over {tls}: exit {:?} in {:?}\n{}{}",
            job.code, job.took, job.stdout, job.stderr
        );
        assert!(
            job.ok,
            "rma over {tls} failed:\n{}\n{}",
            job.stdout, job.stderr
        );
        // Each rank initializes rucx's libucp twice: pml/ucx's context and osc/ucx's.
        let lib = setup().lib.display().to_string();
        let inits: Vec<&str> = job
            .stderr
            .lines()
            .filter(|l| l.starts_with("rucx libucp: ucp_init in pid"))
            .collect();
        assert_eq!(inits.len(), 2 * np, "{}", job.stderr);
        assert!(inits.iter().all(|l| l.ends_with(&format!("from {lib}"))));
        for r in 0..np {
            assert!(
                job.stdout.contains(&format!("rank {r}: rma OK")),
                "rank {r} did not finish rma over {tls}:\n{}\n{}",
                job.stdout,
                job.stderr
            );
        }
    }
}

#[test]
fn rma_two_ranks() {
    run_rma(2);
}

#[test]
fn rma_three_ranks() {
    run_rma(3);
}

/// The same program passes with the system's UCX (osc ucx forced too), where its pml/ucx can
/// be selected on this machine: the test program is right about MPI, so a failure over rucx
/// is rucx's.
#[test]
fn rma_with_the_system_ucx() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let prog = build("rma");
    let job = mpirun(
        2,
        &prog,
        false,
        &[("OMPI_MCA_osc", "ucx")],
        Duration::from_secs(300),
    );
    if !job.ok && job.stderr.contains("PML ucx cannot be selected") {
        println!(
            "the system's UCX cannot run pml/ucx here: skipped\n{}",
            job.stderr
        );
        return;
    }
    assert!(
        job.ok,
        "rma with the system UCX:\n{}\n{}",
        job.stdout, job.stderr
    );
    assert!(job.stdout.contains("rank 1: rma OK"), "{}", job.stdout);
}

/// `tests/c/shmem.c` (OpenSHMEM: the symmetric heap mapped by `sshmem ucx` with
/// `UCP_MEM_MAP_ALLOCATE | UCP_MEM_MAP_FIXED`, puts and gets, fetching and posted atomics at
/// 64 and 32 bits from every PE, compare-and-swap; every byte and value checked) under
/// `oshrun` with `spml ucx` and `atomic ucx` forced, on rucx's libraries, 2 and 3 PEs. Every
/// PE must print its success line. Open MPI 4.1's OpenSHMEM then crashes in
/// `shmem_finalize` on this machine (a memory-release hook of an unloaded component called
/// from an exiting thread), with the system's UCX as with rucx: a job that fails only so
/// (every PE done, signal 11 reported) is taken as passing.
#[test]
fn shmem_over_spml_ucx() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if !have("oshcc") || !have("oshrun") {
        println!(
            "oshcc/oshrun missing: skipped (Debian's openmpi-bin and libopenmpi-dev have them)"
        );
        return;
    }
    let s = setup();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/shmem.c");
    let exe = s.dir.join("shmem");
    run_ok(
        Command::new("oshcc")
            .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src),
        "oshcc shmem.c",
    );
    for np in [2, 3] {
        let mut cmd = Command::new("oshrun");
        cmd.args(["-np", &np.to_string(), "--oversubscribe"])
            .args(["--mca", "spml", "ucx", "--mca", "atomic", "ucx"])
            .args(["--mca", "pml", "ucx", "--mca", "btl", "self"])
            .args([
                "--mca",
                "pml_ucx_tls",
                "any",
                "--mca",
                "pml_ucx_devices",
                "any",
            ]);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            cmd.arg("--allow-run-as-root");
        }
        cmd.args(["-x", &format!("LD_LIBRARY_PATH={}", s.dir.display())])
            .args(["-x", "RUCX_ABI_ANNOUNCE=y"])
            .arg(&exe)
            .stdin(Stdio::null());
        let start = Instant::now();
        let out = cmd.output().expect("oshrun runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!(
            "shmem on {np} PEs: {:?} in {:?}\n{stdout}{stderr}",
            out.status,
            start.elapsed()
        );
        for pe in 0..np {
            assert!(
                stdout.contains(&format!("pe {pe}: shmem OK")),
                "PE {pe} did not finish:\n{stdout}\n{stderr}"
            );
        }
        assert!(
            out.status.success() || stderr.contains("Segmentation fault"),
            "shmem failed otherwise than the finalize crash:\n{stdout}\n{stderr}"
        );
        let lib = s.lib.display().to_string();
        let inits = stderr
            .lines()
            .filter(|l| l.starts_with("rucx libucp: ucp_init in pid") && l.ends_with(&lib))
            .count();
        assert!(
            inits >= np,
            "rucx's libucp was not loaded by every PE:\n{stderr}"
        );
    }
}
