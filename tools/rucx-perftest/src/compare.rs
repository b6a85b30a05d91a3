//! `rucx-bench-compare`: rucx-perftest and UCX's `ucx_perftest` on this machine in one
//! sitting, alternating, several repetitions, medians, ratios to UCX and to this machine's
//! floors ([`crate::floors`]) next to the goals of issue 17.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;

use crate::args::{SizeList, size_list_arg};
use crate::plot::{self, Panel, Series};
use serde::Serialize;

use crate::floors::Floors;
use crate::report::{self, Num};
use crate::stats::median;

/// Result type: printable errors.
pub type R<T> = std::result::Result<T, String>;

/// Command line of `rucx-bench-compare`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "rucx-bench-compare",
    about = "Run rucx-perftest and ucx_perftest side by side on this machine (shm and tcp over \
             loopback), alternating, with this machine's floors (rucx-perftest --floors) measured \
             at the start of each repetition; print each rucx figure as a ratio to UCX and to \
             its floor, next to the goals of issue 17."
)]
pub struct CompareCli {
    /// Repetitions of every measurement (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Fewer repetitions and iterations (about a fifth of the time).
    #[arg(long)]
    pub quick: bool,
    /// Transports to compare: shm, tcp.
    #[arg(long, default_value = "shm,tcp", value_delimiter = ',')]
    pub transports: Vec<String>,
    /// Sizes of the latency test (tag_lat).
    #[arg(long, default_value = "8,256,4K,64K", value_parser = size_list_arg)]
    pub lat_sizes: SizeList,
    /// Sizes of the bandwidth test (tag_bw).
    #[arg(long, default_value = "64K,1M,4M", value_parser = size_list_arg)]
    pub bw_sizes: SizeList,
    /// Outstanding window of the bandwidth test, for both tools (-O).
    #[arg(long, default_value_t = 16)]
    pub window: usize,
    /// Wait mode of both tools (`-E`): poll (progress flat out) or sleep (sleep on the
    /// worker's event descriptor when progress finds nothing). The goals judged are issue
    /// 17's in poll mode and issue 13's in sleep mode.
    #[arg(short = 'E', long = "wait", default_value = "poll", value_parser = ["poll", "sleep"])]
    pub wait: String,
    /// ucx_perftest to run (default: from PATH, installing Debian's ucx-utils when missing).
    #[arg(long)]
    pub ucx_perftest: Option<PathBuf>,
    /// Do not try to install ucx-utils when ucx_perftest is missing.
    #[arg(long)]
    pub no_install: bool,
    /// rucx-perftest to run instead of this program's own (e.g. an older build, to compare
    /// two builds in one sitting; the floors are still measured by this program).
    #[arg(long)]
    pub rucx_perftest: Option<PathBuf>,
    /// Do not measure the floors (`rucx-perftest --floors`, run at the start of every
    /// repetition; each rucx figure is printed as a ratio to its floor).
    #[arg(long)]
    pub no_floors: bool,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw the medians as a plot here (PNG when the name ends in .png, else SVG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Shared-memory cases of at least this size run a second time with heap buffers
    /// (rucx-perftest --heap-host; ucx_perftest with UCX_ALLOC_PRIO=heap over posix and cma,
    /// its buffers filled by glibc's MALLOC_PERTURB_):
    /// an application's own malloc'd buffers, next to the library's shared allocation.
    #[arg(long, default_value = "64K", value_parser = crate::args::parse_size)]
    pub heap_from: usize,
    /// No heap-buffer rows.
    #[arg(long)]
    pub no_heap: bool,
    /// rucx-perftest's bandwidth receiver cycles through at least SIZE of distinct buffers
    /// (its --recv-ring, e.g. 16M, the default before) instead of its default (1 MiB, at least
    /// the window); ucx_perftest receives every message into one buffer either way.
    #[arg(long, value_name = "SIZE", value_parser = crate::args::parse_size)]
    pub recv_ring: Option<usize>,
}

/// A transport as both tools name it.
#[derive(Clone, Debug, PartialEq)]
pub struct Transport {
    /// Short name: shm, tcp.
    pub name: &'static str,
    /// Environment of rucx-perftest.
    pub rucx_env: Vec<(&'static str, &'static str)>,
    /// Environment of ucx_perftest.
    pub ucx_env: Vec<(&'static str, &'static str)>,
    /// What ucx_perftest's environment adds (and overrides) for heap buffers; empty where
    /// the transport has no heap-buffer cases.
    pub ucx_heap_env: Vec<(&'static str, &'static str)>,
}

/// The transport called `name`.
pub fn transport(name: &str) -> R<Transport> {
    match name.trim() {
        "shm" | "posix" => Ok(Transport {
            name: "shm",
            rucx_env: vec![("RUCX_TLS", "posix")],
            ucx_env: vec![("UCX_TLS", "posix")],
            // Heap buffers: UCX allocates them with malloc, and reaches the peer's heap by
            // its cma transport (rucx's posix transport does cross-memory attach itself).
            // ucx_perftest never writes its host buffers: fresh heap pages read as the shared
            // zero page, one 4 KiB page that stays in the first-level cache, and a 1 MiB
            // transfer ran at 35 GB/s, above a single core's memcpy (19-22 GB/s once the
            // pages hold data). glibc's MALLOC_PERTURB_ fills every allocation, so both
            // tools move bytes that are really there (rucx-perftest writes a pattern).
            ucx_heap_env: vec![
                ("UCX_TLS", "posix,cma"),
                ("UCX_ALLOC_PRIO", "heap"),
                ("MALLOC_PERTURB_", "165"),
            ],
        }),
        "tcp" => Ok(Transport {
            name: "tcp",
            rucx_env: vec![("RUCX_TLS", "tcp"), ("RUCX_TCP_IFACES", "lo")],
            ucx_env: vec![("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
            ucx_heap_env: Vec::new(),
        }),
        other => Err(format!(
            "--transports: unknown transport {other:?}; accepted: shm, tcp"
        )),
    }
}

/// One measured case.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Transport name.
    pub transport: &'static str,
    /// tag_lat or tag_bw.
    pub test: &'static str,
    /// Message size.
    pub size: usize,
    /// Iterations.
    pub iters: usize,
    /// Warm-up iterations.
    pub warmup: usize,
    /// Both tools run in wait mode (`-E sleep`) instead of polling.
    pub sleep: bool,
    /// Heap buffers on both sides (else each tool's own allocation: rucx's
    /// `Context::mem_alloc`, ucx_perftest's `ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`,
    /// shared memory over posix for both).
    pub heap: bool,
}

impl Case {
    /// True for the latency test.
    pub fn is_lat(&self) -> bool {
        self.test == "tag_lat"
    }

    /// The buffers' column: `heap` or `alloc`.
    pub fn buffers(&self) -> &'static str {
        if self.heap { "heap" } else { "alloc" }
    }
}

/// What one run of either tool reported (the columns both print).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Latency, 50th percentile, usec.
    pub lat_p50: f64,
    /// Latency, overall, usec.
    pub lat_overall: f64,
    /// Bandwidth, overall, MB/s.
    pub bw_overall: f64,
}

impl Sample {
    /// The figure compared for a case: 50th-percentile latency, or overall bandwidth.
    pub fn key(&self, lat: bool) -> f64 {
        if lat { self.lat_p50 } else { self.bw_overall }
    }
}

/// What a goal's ratio is taken against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Against {
    /// rucx/ucx, paired by repetition.
    Ucx,
    /// rucx/floor, paired by repetition (the floors of `rucx-perftest --floors`, measured at
    /// the start of each repetition).
    Floor,
}

/// A goal of issue 17 (polling) or issue 13 (wait mode).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Goal {
    /// Transport.
    pub transport: &'static str,
    /// Test.
    pub test: &'static str,
    /// Size.
    pub size: usize,
    /// What the ratio is taken against.
    pub against: Against,
    /// The ratio must be at most this (latency) or at least this (bandwidth).
    pub ratio: f64,
}

const fn goal(
    transport: &'static str,
    test: &'static str,
    size: usize,
    against: Against,
    ratio: f64,
) -> Goal {
    Goal {
        transport,
        test,
        size,
        against,
        ratio,
    }
}

/// The goals of issue 17 (host paths against measured floors).
pub const GOALS: [Goal; 7] = [
    goal("shm", "tag_lat", 8, Against::Floor, 1.5),
    goal("shm", "tag_lat", 8, Against::Ucx, 0.75),
    goal("shm", "tag_bw", 64 << 10, Against::Floor, 0.6),
    goal("tcp", "tag_lat", 256, Against::Ucx, 0.95),
    goal("tcp", "tag_lat", 4 << 10, Against::Ucx, 0.95),
    goal("tcp", "tag_bw", 1 << 20, Against::Ucx, 1.0),
    goal("tcp", "tag_lat", 8, Against::Ucx, 1.0),
];

/// The goals of issue 13 in wait mode (`-E sleep`): at most UCX's latency in the same mode.
pub const SLEEP_GOALS: [Goal; 2] = [
    goal("shm", "tag_lat", 8, Against::Ucx, 1.0),
    goal("tcp", "tag_lat", 8, Against::Ucx, 1.0),
];

/// The goals of a case (none, one or several).
pub fn goals_for(c: &Case) -> Vec<Goal> {
    let goals: &[Goal] = if c.sleep { &SLEEP_GOALS } else { &GOALS };
    goals
        .iter()
        .copied()
        .filter(|g| g.transport == c.transport && g.test == c.test && g.size == c.size)
        .collect()
}

/// Text of a goal and whether `ratio` meets it.
pub fn judge(g: &Goal, lat: bool, ratio: f64) -> (String, bool) {
    let what = match g.against {
        Against::Ucx => "ucx",
        Against::Floor => "floor",
    };
    if lat {
        (format!("{what} <= {}x", g.ratio), ratio <= g.ratio)
    } else {
        (format!("{what} >= {}x", g.ratio), ratio >= g.ratio)
    }
}

/// The goals of a row judged on its paired ratios: the goals' text (joined by `, `) and
/// whether all are met; `None` without goals. A floor goal without floors is not met.
pub fn verdict(r: &Row) -> Option<(String, bool)> {
    let gs = goals_for(&r.case);
    if gs.is_empty() {
        return None;
    }
    let lat = r.case.is_lat();
    let mut text = Vec::new();
    let mut all = true;
    for g in &gs {
        let ratio = match g.against {
            Against::Ucx => r.paired_ratio(),
            Against::Floor => r.floor_ratio(),
        };
        let (t, ok) = judge(g, lat, ratio);
        text.push(t);
        all &= ok;
    }
    Some((text.join(", "), all))
}

/// Parse the CSV line of `ucx_perftest -v -f`:
/// `iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr`.
pub fn parse_ucx_csv(out: &str) -> R<Sample> {
    for line in out.lines() {
        let cols: Vec<&str> = line.trim().split(',').collect();
        if cols.len() != 8 {
            continue;
        }
        let v: Option<Vec<f64>> = cols.iter().map(|c| c.trim().parse().ok()).collect();
        if let Some(v) = v {
            return Ok(Sample {
                lat_p50: v[1],
                lat_overall: v[3],
                bw_overall: v[5],
            });
        }
    }
    Err(format!(
        "no result line in ucx_perftest's output:\n{}",
        tail(out, 20)
    ))
}

/// Parse the CSV of `rucx-perftest --csv` (the first result line of `test`).
pub fn parse_rucx_csv(out: &str, test: &str) -> R<Sample> {
    for line in out.lines() {
        let cols: Vec<&str> = line.trim().split(',').collect();
        if cols.len() != 10 || cols[0] != test {
            continue;
        }
        let v: Option<Vec<f64>> = cols[1..].iter().map(|c| c.parse().ok()).collect();
        if let Some(v) = v {
            return Ok(Sample {
                lat_p50: v[2],
                lat_overall: v[4],
                bw_overall: v[6],
            });
        }
    }
    Err(format!(
        "no result line in rucx-perftest's output:\n{}",
        tail(out, 20)
    ))
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A free local port outside the kernel's ephemeral range ([`rucx::bootstrap::local_port`]).
fn free_port() -> R<u16> {
    rucx::bootstrap::local_port().map_err(|e| format!("finding a free port: {e}"))
}

/// Run a command with a time limit; returns (success, stdout, stderr).
fn run_limited(mut c: Command, limit: Duration) -> R<(bool, String, String)> {
    use std::io::Read;
    let prog = format!("{:?}", c.get_program());
    let mut child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {prog}: {e}"))?;
    let reader = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = p {
                let mut b = Vec::new();
                let _ = p.read_to_end(&mut b);
                s = String::from_utf8_lossy(&b).into_owned();
            }
            s
        })
    };
    let so = reader(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let se = reader(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let mut killed = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if start.elapsed() > limit && !killed => {
                let _ = child.kill();
                killed = true;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for {prog}: {e}")),
        }
    };
    let so = so.join().unwrap_or_default();
    let se = se.join().unwrap_or_default();
    if killed {
        return Err(format!(
            "{prog} ran past {limit:?} and was killed:\n{}",
            tail(&format!("{so}{se}"), 20)
        ));
    }
    Ok((status.success(), so, se))
}

fn run_rucx(
    self_cmd: &[OsString],
    t: &Transport,
    c: &Case,
    window: usize,
    recv_ring: Option<usize>,
) -> R<Sample> {
    let (exe, lead) = self_cmd.split_first().ok_or("no rucx-perftest command")?;
    let mut cmd = Command::new(exe);
    cmd.args(lead).args([
        "--local",
        "-q",
        "--csv",
        "-t",
        c.test,
        "-s",
        &c.size.to_string(),
        "-n",
        &c.iters.to_string(),
        "-w",
        &c.warmup.to_string(),
        "-O",
        &window.to_string(),
    ]);
    if c.sleep {
        cmd.args(["-E", "sleep"]);
    }
    if c.heap {
        cmd.arg("--heap-host");
    }
    // Only when asked: a build from before the option (--rucx-perftest) runs without it.
    if let Some(r) = recv_ring
        && c.test == "tag_bw"
    {
        cmd.args(["--recv-ring", &r.to_string()]);
    }
    cmd.envs(t.rucx_env.iter().copied());
    let (ok, so, se) = run_limited(cmd, Duration::from_secs(300))?;
    if !ok {
        return Err(format!(
            "rucx-perftest {} {} B over {} failed:\n{}",
            c.test,
            c.size,
            t.name,
            tail(&format!("{so}{se}"), 20)
        ));
    }
    parse_rucx_csv(&so, c.test)
}

fn run_ucx(ucx: &Path, t: &Transport, c: &Case, window: usize) -> R<Sample> {
    let mut last = String::new();
    let env = ucx_env(t, c);
    let lib_env: Vec<(String, OsString)> = ucx_lib_dir(ucx)
        .map(|d| {
            let mut v = OsString::from(d.as_os_str());
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                v.push(":");
                v.push(old);
            }
            ("LD_LIBRARY_PATH".to_string(), v)
        })
        .into_iter()
        .collect();
    for _attempt in 0..3 {
        let port = free_port()?.to_string();
        let mut params: Vec<String> = vec![
            "-p".into(),
            port.clone(),
            "-t".into(),
            c.test.into(),
            "-s".into(),
            c.size.to_string(),
            "-n".into(),
            c.iters.to_string(),
            "-w".into(),
            c.warmup.to_string(),
        ];
        if !c.is_lat() {
            params.extend(["-O".into(), window.to_string()]);
        }
        if c.sleep {
            params.extend(["-E".into(), "sleep".into()]);
        }
        let mut server = Command::new(ucx)
            .args(&params)
            .envs(env.iter().copied())
            .envs(lib_env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", ucx.display()))?;
        std::thread::sleep(Duration::from_millis(300));
        let mut client = Command::new(ucx);
        client
            .arg("127.0.0.1")
            .args(&params)
            .args(["-v", "-f"])
            .envs(env.iter().copied())
            .envs(lib_env.iter().cloned());
        let res = run_limited(client, Duration::from_secs(300));
        let srv_done = Instant::now();
        loop {
            match server.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if srv_done.elapsed() > Duration::from_secs(10) => {
                    let _ = server.kill();
                    let _ = server.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => break,
            }
        }
        match res {
            Ok((true, so, _)) => return parse_ucx_csv(&so),
            Ok((false, so, se)) => last = format!("{so}{se}"),
            Err(e) => last = e,
        }
    }
    Err(format!(
        "ucx_perftest {} {} B over {} failed three times:\n{}",
        c.test,
        c.size,
        t.name,
        tail(&last, 20)
    ))
}

/// ucx_perftest's environment for a case: the transport's, with the heap variables over it
/// for heap buffers (a later entry of the same name wins).
pub fn ucx_env(t: &Transport, c: &Case) -> Vec<(&'static str, &'static str)> {
    let mut env = t.ucx_env.clone();
    if c.heap {
        for &(k, v) in &t.ucx_heap_env {
            env.retain(|&(k0, _)| k0 != k);
            env.push((k, v));
        }
    }
    env
}

/// Measure the floors with `rucx-perftest --floors --json` (this program again).
fn run_floors(self_cmd: &[OsString], quick: bool) -> R<Floors> {
    let (exe, lead) = self_cmd.split_first().ok_or("no rucx-perftest command")?;
    let mut cmd = Command::new(exe);
    cmd.args(lead).args(["--floors", "--json", "-q"]);
    if quick {
        cmd.arg("--quick");
    }
    let (ok, so, se) = run_limited(cmd, Duration::from_secs(300))?;
    if !ok {
        return Err(format!(
            "rucx-perftest --floors failed:\n{}",
            tail(&format!("{so}{se}"), 20)
        ));
    }
    serde_json::from_str(so.trim()).map_err(|e| {
        format!(
            "rucx-perftest --floors printed no floors ({e}):\n{}",
            tail(&so, 20)
        )
    })
}

/// The floors of all repetitions in one line: medians of each figure over the repetitions.
pub fn floors_summary(all: &[Floors]) -> String {
    let med = |f: &dyn Fn(&Floors) -> f64| {
        median(&all.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    };
    let mut parts = vec![format!(
        "cache line {:.3} us one way",
        med(&|f| f.cacheline_us.median)
    )];
    let first = &all[0];
    for (i, m) in first.memcpy_mbs.iter().enumerate() {
        parts.push(format!(
            "memcpy {} {:.0} MB/s",
            plot::size_label(m.size as f64),
            med(&|f| f.memcpy_mbs.get(i).map_or(f64::NAN, |x| x.value.median))
        ));
    }
    parts.push(format!(
        "tcp stream {:.0} MB/s",
        med(&|f| f.tcp_stream_mbs.median)
    ));
    for (i, l) in first.tcp_lat_us.iter().enumerate() {
        parts.push(format!(
            "tcp ping-pong {} {:.3} us",
            plot::size_label(l.size as f64),
            med(&|f| f.tcp_lat_us.get(i).map_or(f64::NAN, |x| x.value.median))
        ));
    }
    format!(
        "{} (medians of {} repetitions; rucx-perftest --floors)",
        parts.join(", "),
        all.len()
    )
}

/// The library folder of a UCX tree unpacked beside `ucx_perftest` (`dpkg -x` of the Debian
/// packages: `usr/bin/ucx_perftest` and `usr/lib/<triplet>/libucp.so.0`), to be put on
/// `LD_LIBRARY_PATH` for its runs; `None` when there is none.
pub fn ucx_lib_dir(ucx: &Path) -> Option<PathBuf> {
    let lib = ucx.parent()?.parent()?.join("lib");
    if lib.join("libucp.so.0").is_file() {
        return Some(lib);
    }
    std::fs::read_dir(&lib)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|d| d.join("libucp.so.0").is_file())
}

/// Find `ucx_perftest`, installing Debian's `ucx-utils` when missing (as root, unless told
/// not to). The error says precisely what is missing.
pub fn find_ucx(explicit: Option<&Path>, install: bool) -> R<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("--ucx-perftest {}: no such file", p.display()))
        };
    }
    let in_path = || {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("ucx_perftest"))
                .find(|p| p.is_file())
        })
    };
    if let Some(p) = in_path() {
        return Ok(p);
    }
    if !install {
        return Err(
            "ucx_perftest is not in PATH: install the Debian package ucx-utils \
                    (apt-get install -y ucx-utils), or pass --ucx-perftest PATH"
                .into(),
        );
    }
    eprintln!("bench-compare: ucx_perftest missing; installing ucx-utils with apt-get");
    let st = Command::new("apt-get")
        .args(["install", "-y", "ucx-utils"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status();
    let st = match st {
        Ok(s) if s.success() => s,
        _ => {
            // The package lists may be missing on a fresh machine.
            let _ = Command::new("apt-get").arg("update").status();
            Command::new("apt-get")
                .args(["install", "-y", "ucx-utils"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .map_err(|e| {
                    format!("ucx_perftest is missing and apt-get could not run ({e}); install the Debian package ucx-utils")
                })?
        }
    };
    match in_path() {
        Some(p) if st.success() => Ok(p),
        _ => Err(format!(
            "ucx_perftest is missing: `apt-get install -y ucx-utils` ended with {st} and no \
             ucx_perftest appeared in PATH (needs root and the Debian archive)"
        )),
    }
}

/// The version `ucx_info -v` prints: the `ucx_info` beside `ucx` when there is one (with its
/// libraries), else the one in PATH.
fn ucx_version(ucx: &Path) -> String {
    let beside = ucx.with_file_name("ucx_info");
    let mut c = Command::new(if beside.is_file() {
        beside.as_os_str()
    } else {
        std::ffi::OsStr::new("ucx_info")
    });
    if let Some(d) = ucx_lib_dir(ucx) {
        c.env("LD_LIBRARY_PATH", d);
    }
    c.arg("-v")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| l.contains("Version"))
                .map(|l| l.trim_start_matches('#').trim().to_string())
        })
        .unwrap_or_else(|| "version unknown".into())
}

/// The rucx source this was built from, when run inside its git checkout.
fn source_version() -> String {
    Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown commit".into())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let n = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {n} CPUs")
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Medians of one case.
#[derive(Clone, Debug)]
pub struct Row {
    /// The case.
    pub case: Case,
    /// rucx runs.
    pub rucx: Vec<Sample>,
    /// ucx runs.
    pub ucx: Vec<Sample>,
    /// The case's floor in each repetition (same unit as the compared figure; empty with
    /// `--no-floors`).
    pub floors: Vec<f64>,
}

impl Row {
    /// Median of the floors of the repetitions (NaN without floors).
    pub fn floor(&self) -> f64 {
        median(&self.floors).unwrap_or(f64::NAN)
    }

    /// Median of the per-repetition ratios rucx/floor (each repetition measured its floors
    /// right before its runs). Latency: 1.0 or more, lower is better; bandwidth: at most
    /// about 1.0, higher is better. NaN without floors.
    pub fn floor_ratio(&self) -> f64 {
        let lat = self.case.is_lat();
        let r: Vec<f64> = self
            .rucx
            .iter()
            .zip(&self.floors)
            .map(|(a, f)| a.key(lat) / f)
            .collect();
        median(&r).unwrap_or(f64::NAN)
    }

    /// Median of the compared figure: (rucx, ucx).
    pub fn medians(&self) -> (f64, f64) {
        let lat = self.case.is_lat();
        let m = |v: &[Sample]| {
            median(&v.iter().map(|s| s.key(lat)).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        };
        (m(&self.rucx), m(&self.ucx))
    }

    /// Median of the per-repetition ratios rucx/ucx: the two runs of one repetition ran
    /// back to back, so they share the machine's load; this is what the verdict uses.
    pub fn paired_ratio(&self) -> f64 {
        let lat = self.case.is_lat();
        let r: Vec<f64> = self
            .rucx
            .iter()
            .zip(&self.ucx)
            .map(|(a, b)| a.key(lat) / b.key(lat))
            .collect();
        median(&r).unwrap_or(f64::NAN)
    }

    /// Best run against best run (lowest latency, highest bandwidth): each tool's figure on
    /// its least disturbed run.
    pub fn best_ratio(&self) -> f64 {
        let lat = self.case.is_lat();
        let best = |v: &[Sample]| {
            let it = v.iter().map(|s| s.key(lat)).filter(|x| x.is_finite());
            if lat {
                it.fold(f64::INFINITY, f64::min)
            } else {
                it.fold(0.0, f64::max)
            }
        };
        best(&self.rucx) / best(&self.ucx)
    }

    /// True when either tool's runs spread by more than 1.5x (a busy machine).
    pub fn noisy(&self) -> bool {
        let lat = self.case.is_lat();
        [&self.rucx, &self.ucx].iter().any(|v| {
            let xs: Vec<f64> = v.iter().map(|s| s.key(lat)).filter(|x| *x > 0.0).collect();
            let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = xs.iter().copied().fold(0.0, f64::max);
            xs.len() > 1 && hi / lo > 1.5
        })
    }

    /// Median of the overall latency (latency cases): (rucx, ucx).
    pub fn overall_lat(&self) -> (f64, f64) {
        let m = |v: &[Sample]| {
            median(&v.iter().map(|s| s.lat_overall).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        };
        (m(&self.rucx), m(&self.ucx))
    }
}

/// The comparison table.
pub fn render(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<4} {:<7} {:>4} {:<5}  {:<20} {:>9} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7}  {:<7} goal",
        "tl",
        "test",
        "size",
        "bufs",
        "figure",
        "rucx",
        "ucx",
        "ratio",
        "paired",
        "best",
        "floor",
        "/floor",
        "verdict"
    );
    for r in rows {
        let (a, b) = r.medians();
        let lat = r.case.is_lat();
        let (goal, mut verdict) = match verdict(r) {
            Some((t, ok)) => (t, if ok { "met" } else { "MISSED" }.to_string()),
            None => (String::new(), String::new()),
        };
        if r.noisy() {
            verdict.push_str(if verdict.is_empty() {
                "(noisy)"
            } else {
                " (noisy)"
            });
        }
        let num = |x: f64| {
            if !x.is_finite() {
                "-".to_string()
            } else if lat {
                format!("{x:.3}")
            } else {
                format!("{x:.0}")
            }
        };
        let ratio = |x: f64| {
            if x.is_finite() {
                format!("{x:.2}x")
            } else {
                "-".to_string()
            }
        };
        let _ = writeln!(
            s,
            "{:<4} {:<7} {:>4} {:<5}  {:<20} {:>9} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7}  {:<7} {}",
            r.case.transport,
            r.case.test,
            plot::size_label(r.case.size as f64),
            r.case.buffers(),
            if lat {
                "latency 50%ile (us)"
            } else {
                "bandwidth (MB/s)"
            },
            num(a),
            num(b),
            ratio(a / b),
            ratio(r.paired_ratio()),
            ratio(r.best_ratio()),
            num(r.floor()),
            ratio(r.floor_ratio()),
            verdict,
            goal
        );
        if lat {
            let (oa, ob) = r.overall_lat();
            let _ = writeln!(
                s,
                "{:<4} {:<7} {:>4} {:<5}  {:<20} {:>9.3} {:>9.3} {:>6.2}x",
                "",
                "",
                "",
                "",
                "latency overall (us)",
                oa,
                ob,
                oa / ob
            );
        }
    }
    // No trailing blanks where a case has no goal.
    let mut s: String = s.lines().map(|l| format!("{}\n", l.trim_end())).collect();
    s.push_str(
        "bufs: alloc = each tool's own allocation (rucx Context::mem_alloc, ucx_perftest \
         ucp_mem_map with UCP_MEM_MAP_ALLOCATE: shared memory over posix), heap = heap buffers \
         on both sides (rucx-perftest --heap-host; ucx_perftest with UCX_ALLOC_PRIO=heap over \
         posix,cma and MALLOC_PERTURB_, which fills its never-written buffers), as an \
         application's own buffers are.\n",
    );
    s.push_str(
        "rucx, ucx: medians of the runs; ratio: rucx/ucx of the medians; paired: median of the \
         per-repetition ratios (the verdict); best: best run against best run; floor: median of \
         the floors measured at the start of each repetition (shm latency: a cache line between \
         two processes plus one memcpy of the message; shm bandwidth: single-core memcpy of the \
         size; tcp: a plain loopback ping-pong of the size, or stream of 1 MiB writes); /floor: \
         median of the per-repetition ratios rucx/floor; goals (issue 17; issue 13 with -E \
         sleep) are judged on the paired ratios; (noisy): a tool's runs spread by more than \
         1.5x.\n",
    );
    s
}

/// Every run's compared figure, for the record.
pub fn render_raw(rows: &[Row]) -> String {
    let mut s = String::new();
    for r in rows {
        let lat = r.case.is_lat();
        let fmt = |v: &[Sample]| {
            v.iter()
                .map(|x| {
                    if lat {
                        format!("{:.3}", x.key(lat))
                    } else {
                        format!("{:.0}", x.key(lat))
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        let _ = writeln!(
            s,
            "{} {} {} {}: rucx [{}]  ucx [{}]",
            r.case.transport,
            r.case.test,
            plot::size_label(r.case.size as f64),
            r.case.buffers(),
            fmt(&r.rucx),
            fmt(&r.ucx)
        );
    }
    s
}

/// One row of the JSON document.
#[derive(Serialize)]
struct JsonRow<'a> {
    transport: &'a str,
    test: &'a str,
    size: usize,
    buffers: &'a str,
    figure: &'a str,
    rucx: Num,
    ucx: Num,
    ratio: Num,
    paired_ratio: Num,
    best_ratio: Num,
    noisy: bool,
    goal: Option<String>,
    met: Option<bool>,
    rucx_runs: Vec<Num>,
    ucx_runs: Vec<Num>,
    floor: Num,
    floor_ratio: Num,
    floor_runs: Vec<Num>,
}

fn json(rows: &[Row], header: &[(&str, String)]) -> String {
    let items: Vec<JsonRow<'_>> = rows
        .iter()
        .map(|r| {
            let (a, b) = r.medians();
            let lat = r.case.is_lat();
            let goal = verdict(r);
            let runs = |v: &[Sample]| v.iter().map(|x| Num(x.key(lat))).collect();
            JsonRow {
                transport: r.case.transport,
                test: r.case.test,
                size: r.case.size,
                buffers: r.case.buffers(),
                figure: if lat {
                    "latency_p50_us"
                } else {
                    "bandwidth_overall_mbs"
                },
                rucx: Num(a),
                ucx: Num(b),
                ratio: Num(a / b),
                paired_ratio: Num(r.paired_ratio()),
                best_ratio: Num(r.best_ratio()),
                noisy: r.noisy(),
                met: goal.as_ref().map(|g| g.1),
                goal: goal.map(|g| g.0),
                rucx_runs: runs(&r.rucx),
                ucx_runs: runs(&r.ucx),
                floor: Num(r.floor()),
                floor_ratio: Num(r.floor_ratio()),
                floor_runs: r.floors.iter().map(|&f| Num(f)).collect(),
            }
        })
        .collect();
    let mut s = report::to_json(&report::Document {
        tool: "rucx-bench-compare",
        meta: header,
        key: "rows",
        items: &items,
    });
    s.push('\n');
    s
}

fn panels(rows: &[Row]) -> Vec<Panel> {
    let mut out = Vec::new();
    for (lat, title, y) in [
        (
            true,
            "tag_lat: latency, 50th percentile",
            "usec (log scale)",
        ),
        (false, "tag_bw: bandwidth, overall", "MB/s (log scale)"),
    ] {
        let mut series = Vec::new();
        let mut tls: Vec<(&str, bool)> = rows
            .iter()
            .map(|r| (r.case.transport, r.case.heap))
            .collect();
        tls.sort_unstable();
        tls.dedup();
        for (ti, (t, heap)) in tls.into_iter().enumerate() {
            for (k, tool) in ["rucx", "ucx"].iter().enumerate() {
                let pts: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.case.transport == t && r.case.heap == heap)
                    .filter(|r| r.case.is_lat() == lat)
                    .map(|r| {
                        let (a, b) = r.medians();
                        (r.case.size as f64, if k == 0 { a } else { b })
                    })
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                series.push(Series {
                    name: if heap {
                        format!("{tool} {t} heap")
                    } else {
                        format!("{tool} {t}")
                    },
                    color: plot::PALETTE[ti % plot::PALETTE.len()].into(),
                    points: pts,
                    dashed: k == 1,
                });
            }
        }
        out.push(Panel {
            title: title.into(),
            y_label: y.into(),
            log_y: true,
            series,
        });
    }
    out
}

/// The cases of a comparison.
pub fn cases(cli: &CompareCli) -> R<Vec<(Transport, Case)>> {
    let scale = if cli.quick { 5 } else { 1 };
    let sleep = cli.wait == "sleep";
    let mut v = Vec::new();
    for t in &cli.transports {
        let t = transport(t)?;
        for &size in &cli.lat_sizes.0 {
            let iters = if size <= 4096 { 50_000 } else { 10_000 } / scale;
            v.push((
                t.clone(),
                Case {
                    transport: t.name,
                    test: "tag_lat",
                    size,
                    iters,
                    warmup: iters / 10,
                    sleep,
                    heap: false,
                },
            ));
        }
        for &size in &cli.bw_sizes.0 {
            let iters = ((1usize << 30) / size.max(1)).clamp(200, 100_000) / scale;
            v.push((
                t.clone(),
                Case {
                    transport: t.name,
                    test: "tag_bw",
                    size,
                    iters,
                    warmup: (iters / 10).max(10),
                    sleep,
                    heap: false,
                },
            ));
        }
    }
    if !cli.no_heap {
        // Each heap case right after its twin, so both run close in time.
        v = v
            .into_iter()
            .flat_map(|(t, c)| {
                let heap = (!t.ucx_heap_env.is_empty() && c.size >= cli.heap_from).then(|| {
                    (
                        t.clone(),
                        Case {
                            heap: true,
                            ..c.clone()
                        },
                    )
                });
                std::iter::once((t, c)).chain(heap)
            })
            .collect();
    }
    Ok(v)
}

fn compare(cli: &CompareCli, self_cmd: &[OsString]) -> R<()> {
    if cli.reps == 0 {
        return Err("--reps: at least one repetition".into());
    }
    let reps = if cli.quick { cli.reps.min(3) } else { cli.reps };
    let ucx = find_ucx(cli.ucx_perftest.as_deref(), !cli.no_install)?;
    let cases = cases(cli)?;
    let rucx_cmd: Vec<OsString> = match &cli.rucx_perftest {
        Some(p) if p.is_file() => vec![p.clone().into_os_string()],
        Some(p) => return Err(format!("--rucx-perftest {}: no such file", p.display())),
        None => self_cmd.to_vec(),
    };
    let header = vec![
        ("machine", machine()),
        ("ucx", format!("{} ({})", ucx_version(&ucx), ucx.display())),
        (
            "rucx",
            format!(
                "rucx-perftest {} ({}){}",
                env!("CARGO_PKG_VERSION"),
                source_version(),
                cli.rucx_perftest
                    .as_ref()
                    .map_or(String::new(), |p| format!("; runs {}", p.display()))
            ),
        ),
        ("load_before", load()),
        ("repetitions", reps.to_string()),
        ("window", cli.window.to_string()),
        (
            "recv_ring",
            match cli.recv_ring {
                None => format!(
                    "rucx: the window ({}) or 1 MiB of buffers, whichever is more (its \
                     default); ucx_perftest: one buffer",
                    cli.window
                ),
                Some(r) => format!(
                    "rucx: at least {r} bytes of distinct buffers (--recv-ring); ucx_perftest: \
                     one buffer"
                ),
            },
        ),
        ("wait", cli.wait.clone()),
    ];
    println!(
        "bench-compare: rucx-perftest vs ucx_perftest, this machine, one sitting; {reps} repetitions alternating the tools; medians"
    );
    for (k, v) in &header {
        println!("  {k}: {v}");
    }
    println!(
        "  shm: RUCX_TLS=posix vs UCX_TLS=posix; tcp: RUCX_TLS=tcp RUCX_TCP_IFACES=lo vs UCX_TLS=tcp UCX_NET_DEVICES=lo (loopback)"
    );
    println!(
        "  latency: tag_lat one-way (half round trip), 50th percentile; bandwidth: tag_bw overall, -O {} for both; MB = 2^20 bytes",
        cli.window
    );
    println!(
        "  wait mode: -E {} for both{}",
        cli.wait,
        if cli.wait == "sleep" {
            " (goals: issue 13's)"
        } else {
            " (goals: issue 17's)"
        }
    );
    let mut rows: Vec<Row> = cases
        .iter()
        .map(|(_, c)| Row {
            case: c.clone(),
            rucx: Vec::new(),
            ucx: Vec::new(),
            floors: Vec::new(),
        })
        .collect();
    let started = Instant::now();
    let mut all_floors = Vec::new();
    for rep in 0..reps {
        if !cli.no_floors {
            let f = run_floors(self_cmd, cli.quick)?;
            eprintln!(
                "[bench-compare] rep {}/{reps}: floors: cache line {:.3} us, memcpy 64K {:.0} MB/s, tcp stream {:.0} MB/s ({:.0} s)",
                rep + 1,
                f.cacheline_us.median,
                f.floor_for("shm", "tag_bw", 64 << 10).unwrap_or(f64::NAN),
                f.tcp_stream_mbs.median,
                started.elapsed().as_secs_f64()
            );
            for (row, (_, c)) in rows.iter_mut().zip(&cases) {
                row.floors
                    .push(f.floor_for(c.transport, c.test, c.size).unwrap_or(f64::NAN));
            }
            all_floors.push(f);
        }
        for (i, (t, c)) in cases.iter().enumerate() {
            let rucx_first = (rep + i) % 2 == 0;
            for k in 0..2 {
                let rucx_turn = (k == 0) == rucx_first;
                if rucx_turn {
                    let s = run_rucx(&rucx_cmd, t, c, cli.window, cli.recv_ring)?;
                    rows[i].rucx.push(s);
                } else {
                    let s = run_ucx(&ucx, t, c, cli.window)?;
                    rows[i].ucx.push(s);
                }
            }
            eprintln!(
                "[bench-compare] rep {}/{reps}: {} {} {} B {}: rucx {:.3} ucx {:.3} ({:.0} s)",
                rep + 1,
                c.transport,
                c.test,
                c.size,
                c.buffers(),
                rows[i].rucx.last().map_or(f64::NAN, |s| s.key(c.is_lat())),
                rows[i].ucx.last().map_or(f64::NAN, |s| s.key(c.is_lat())),
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!("  load_after: {}", load());
    let mut header = header;
    if !all_floors.is_empty() {
        let summary = floors_summary(&all_floors);
        println!("  floors: {summary}");
        header.push(("floors", summary));
    }
    println!();
    print!("{}", render(&rows));
    println!();
    println!("runs (compared figure, in order):");
    print!("{}", render_raw(&rows));
    if let Some(p) = &cli.json {
        std::fs::write(p, json(&rows, &header))
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
        eprintln!("bench-compare: JSON written to {}", p.display());
    }
    if let Some(p) = &cli.plot {
        plot::write(
            p,
            &panels(&rows),
            &format!("rucx-bench-compare: medians of {reps} runs, {}", machine()),
        )?;
        eprintln!("bench-compare: plot written to {}", p.display());
    }
    Ok(())
}

/// Entry point of the `rucx-bench-compare` binary. Run with `--as-perftest` first, it is
/// rucx-perftest (so one binary carries both tools).
pub fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let exe = std::env::current_exe()
        .map(OsString::from)
        .unwrap_or_else(|_| argv[0].clone());
    if argv.get(1).is_some_and(|a| a == "--as-perftest") {
        let mut pargs = vec![OsString::from("rucx-perftest")];
        pargs.extend(argv[2..].iter().cloned());
        return crate::cli::main_with(pargs, vec![exe, "--as-perftest".into()]);
    }
    let cli = match CompareCli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    match compare(&cli, &[exe, "--as-perftest".into()]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rucx-bench-compare: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ucx_perftest_csv() {
        let out = "+----+\n| Message size: 8 |\niterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n2000,0.160,862.632,630.871,1159.24,1585.11,1159,1585\n";
        let s = parse_ucx_csv(out).unwrap();
        assert_eq!(s.lat_p50, 0.160);
        assert_eq!(s.lat_overall, 630.871);
        assert_eq!(s.bw_overall, 1585.11);
        assert!(
            parse_ucx_csv("nothing here")
                .unwrap_err()
                .contains("nothing here")
        );
    }

    #[test]
    fn parses_rucx_perftest_csv() {
        let out = format!(
            "{}\ntag_lat,8,100,0.612,0.700,0.750,12.00,11.00,1400000,1300000\n",
            crate::report::CSV_HEADER
        );
        let s = parse_rucx_csv(&out, "tag_lat").unwrap();
        assert_eq!(
            (s.lat_p50, s.lat_overall, s.bw_overall),
            (0.612, 0.75, 11.0)
        );
        assert!(parse_rucx_csv(&out, "tag_bw").is_err());
    }

    #[test]
    fn goals_and_verdicts() {
        let c = Case {
            transport: "shm",
            test: "tag_lat",
            size: 8,
            iters: 1,
            warmup: 0,
            sleep: false,
            heap: false,
        };
        let g = goals_for(&c);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].against, Against::Floor);
        assert_eq!(judge(&g[0], true, 1.4), ("floor <= 1.5x".to_string(), true));
        assert_eq!(judge(&g[1], true, 0.7), ("ucx <= 0.75x".to_string(), true));
        assert!(!judge(&g[1], true, 0.8).1);
        let c = Case {
            transport: "tcp",
            test: "tag_bw",
            size: 1 << 20,
            ..c
        };
        let g = goals_for(&c);
        assert_eq!(g.len(), 1);
        assert!(judge(&g[0], false, 1.1).1 && !judge(&g[0], false, 0.9).1);
        assert!(
            goals_for(&Case {
                size: 4096,
                ..c.clone()
            })
            .is_empty()
        );
        assert!(transport("ib").is_err());
        // Wait mode: issue 13's goal (8 B latency at most UCX's) instead of issue 17's.
        let sleep = |transport, size| Case {
            transport,
            test: "tag_lat",
            size,
            iters: 1,
            warmup: 0,
            sleep: true,
            heap: false,
        };
        for tl in ["shm", "tcp"] {
            let g = goals_for(&sleep(tl, 8));
            assert_eq!(g.len(), 1, "{tl}");
            assert_eq!(g[0].against, Against::Ucx);
            assert_eq!(judge(&g[0], true, 1.0), ("ucx <= 1x".to_string(), true));
            assert!(!judge(&g[0], true, 1.01).1);
            assert!(goals_for(&sleep(tl, 256)).is_empty(), "{tl}");
        }
        // A row judged on both ratios: rucx 0.3 us, ucx 0.5 us, floor 0.25 us.
        let s = |l: f64| Sample {
            lat_p50: l,
            lat_overall: l,
            bw_overall: 1.0,
        };
        let mut r = Row {
            case: Case {
                transport: "shm",
                test: "tag_lat",
                size: 8,
                iters: 1,
                warmup: 0,
                sleep: false,
                heap: false,
            },
            rucx: vec![s(0.3)],
            ucx: vec![s(0.5)],
            floors: vec![0.25],
        };
        assert_eq!(
            verdict(&r),
            Some(("floor <= 1.5x, ucx <= 0.75x".to_string(), true))
        );
        // Without floors a floor goal is not met.
        r.floors.clear();
        assert!(!verdict(&r).unwrap().1);
        assert!(r.floor().is_nan() && r.floor_ratio().is_nan());
    }

    /// Shared-memory cases from `--heap-from` on get a heap twin right after them (tcp none),
    /// which both tools run with heap buffers; `--no-heap` leaves them out.
    #[test]
    fn heap_twins_of_shm_cases() {
        let cli = CompareCli::try_parse_from([
            "rucx-bench-compare",
            "--lat-sizes",
            "8,64K",
            "--bw-sizes",
            "4K,1M",
        ])
        .unwrap();
        let v = cases(&cli).unwrap();
        let names: Vec<String> = v
            .iter()
            .map(|(_, c)| format!("{} {} {} {}", c.transport, c.test, c.size, c.buffers()))
            .collect();
        assert_eq!(
            names,
            [
                "shm tag_lat 8 alloc",
                "shm tag_lat 65536 alloc",
                "shm tag_lat 65536 heap",
                "shm tag_bw 4096 alloc",
                "shm tag_bw 1048576 alloc",
                "shm tag_bw 1048576 heap",
                "tcp tag_lat 8 alloc",
                "tcp tag_lat 65536 alloc",
                "tcp tag_bw 4096 alloc",
                "tcp tag_bw 1048576 alloc",
            ]
        );
        // The twin is the same measurement but for its buffers.
        assert_eq!(
            Case {
                heap: false,
                ..v[2].1.clone()
            },
            v[1].1
        );
        let (t, heap) = &v[5];
        assert_eq!(
            ucx_env(t, heap),
            [
                ("UCX_TLS", "posix,cma"),
                ("UCX_ALLOC_PRIO", "heap"),
                ("MALLOC_PERTURB_", "165")
            ]
        );
        assert_eq!(ucx_env(t, &v[4].1), [("UCX_TLS", "posix")]);
        let mut no = cli.clone();
        no.no_heap = true;
        assert!(cases(&no).unwrap().iter().all(|(_, c)| !c.heap));
        let mut from = cli;
        from.heap_from = 1;
        assert_eq!(
            cases(&from).unwrap().iter().filter(|(_, c)| c.heap).count(),
            4
        );
    }

    #[test]
    fn ucx_libraries_beside_an_unpacked_tree() {
        let root = std::env::temp_dir().join(format!("rucx-compare-ucx-{}", std::process::id()));
        let bin = root.join("usr/bin");
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&lib).unwrap();
        let exe = bin.join("ucx_perftest");
        std::fs::write(&exe, "").unwrap();
        assert_eq!(ucx_lib_dir(&exe), None);
        std::fs::write(lib.join("libucp.so.0"), "").unwrap();
        assert_eq!(ucx_lib_dir(&exe), Some(lib));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn table_and_json_of_rows() {
        let s = |l: f64, b: f64| Sample {
            lat_p50: l,
            lat_overall: l * 2.0,
            bw_overall: b,
        };
        let rows = vec![
            Row {
                case: Case {
                    transport: "shm",
                    test: "tag_lat",
                    size: 8,
                    iters: 1,
                    warmup: 0,
                    sleep: false,
                    heap: false,
                },
                rucx: vec![s(0.5, 1.0), s(0.6, 1.0), s(0.7, 1.0)],
                ucx: vec![s(0.6, 1.0), s(0.7, 1.0), s(0.8, 1.0)],
                floors: vec![0.4, 0.4, 0.4],
            },
            Row {
                case: Case {
                    transport: "shm",
                    test: "tag_bw",
                    size: 1 << 20,
                    iters: 1,
                    warmup: 0,
                    sleep: false,
                    heap: false,
                },
                rucx: vec![s(1.0, 3000.0)],
                ucx: vec![s(1.0, 1500.0)],
                floors: vec![6000.0],
            },
        ];
        let t = render(&rows);
        assert!(t.contains("0.86x") && t.contains("MISSED"), "{t}");
        assert!(t.contains("floor <= 1.5x, ucx <= 0.75x"), "{t}");
        assert!(
            t.contains("1.50x") && t.contains("0.50x") && t.contains("6000"),
            "{t}"
        );
        assert!((rows[0].floor_ratio() - 1.5).abs() < 1e-9);
        assert!((rows[0].paired_ratio() - 0.857).abs() < 0.01);
        assert!((rows[0].best_ratio() - 0.5 / 0.6).abs() < 1e-9);
        assert!(!rows[0].noisy() && !rows[1].noisy());
        assert!(t.contains("2.00x"), "{t}");
        let v: serde_json::Value =
            serde_json::from_str(&json(&rows, &[("k", "v".into())])).unwrap();
        assert_eq!(v["rows"][0]["met"], false);
        assert_eq!(v["rows"][1]["ratio"], 2.0);
        assert_eq!(v["rows"][1]["floor_ratio"], 0.5);
        assert_eq!(v["rows"][1]["met"], serde_json::Value::Null);
        assert_eq!(v["rows"][0]["rucx_runs"].as_array().unwrap().len(), 3);
        let svg = plot::svg(&panels(&rows), "c").unwrap();
        assert!(svg.contains("rucx shm") && svg.contains("ucx shm"));
        assert!(render_raw(&rows).contains("rucx [0.500 0.600 0.700]"));
    }

    /// The JSON of fixed rows (a NaN run, a zero median, goals met and absent, floors present,
    /// absent and NaN) is `tests/golden/compare.json` (`RUCX_BLESS_GOLDEN=1` rewrites it).
    #[test]
    fn json_unchanged_for_fixed_rows() {
        let s = |l: f64, b: f64| Sample {
            lat_p50: l,
            lat_overall: l * 2.0,
            bw_overall: b,
        };
        let case = |transport, test, size| Case {
            transport,
            test,
            size,
            iters: 1,
            warmup: 0,
            sleep: false,
            heap: false,
        };
        let rows = vec![
            Row {
                case: case("shm", "tag_lat", 8),
                rucx: vec![s(0.5, 1.0), s(0.6, 1.0), s(0.7, 1.0)],
                ucx: vec![s(0.6, 1.0), s(0.7, 1.0), s(0.8, 1.0)],
                floors: vec![0.4, 0.5, 0.35],
            },
            Row {
                case: case("shm", "tag_bw", 1 << 20),
                rucx: vec![s(1.0, 3000.0)],
                ucx: vec![s(1.0, 1500.0)],
                floors: vec![],
            },
            Row {
                case: Case {
                    heap: true,
                    ..case("shm", "tag_bw", 1 << 20)
                },
                rucx: vec![s(1.0, 2000.0)],
                ucx: vec![s(1.0, 2500.0)],
                floors: vec![6000.0],
            },
            Row {
                case: case("tcp", "tag_bw", 4096),
                rucx: vec![s(1.0, 12.25), s(1.0, f64::NAN)],
                ucx: vec![s(1.0, 0.0)],
                floors: vec![5000.0, f64::NAN],
            },
        ];
        let doc = json(&rows, &[("host", "h \"1\"".into()), ("ucx", "1.19".into())]);
        if std::env::var_os("RUCX_BLESS_GOLDEN").is_some() {
            std::fs::write(
                concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/compare.json"),
                &doc,
            )
            .unwrap();
        }
        let golden = include_str!("../tests/golden/compare.json");
        assert_eq!(doc, golden);
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_str(&doc).unwrap(),
            serde_json::from_str(golden).unwrap(),
        );
        assert!(crate::report::tests::same_content(&a, &b));
    }
}
