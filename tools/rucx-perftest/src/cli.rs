//! The `rucx-perftest` program: server, client, or both sides as two local processes.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use rucx::Job;

use crate::args::{self, Cli, Format, Options, TestKind};
use crate::floors;
use crate::mem;
use crate::plot::{self, Panel, Series};
use crate::report;
use crate::run::{self, R};
use crate::stats::Figures;

/// Run `rucx-perftest` with `argv` (`argv[0]` is the program name). `self_cmd` starts this
/// program again (for the server half of `--local`): the executable and any leading
/// arguments.
pub fn main_with(argv: Vec<OsString>, self_cmd: Vec<OsString>) -> ExitCode {
    let cli = match Cli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    if let Some(path) = &cli.floors_child {
        return match floors::cacheline_child(path) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rucx-perftest --floors-child: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let port_given = argv.iter().skip(1).any(|a| {
        let a = a.to_string_lossy();
        a == "-p" || (a.starts_with("-p") && !a.starts_with("--"))
    });
    let opts = match args::validate(cli, port_given) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("rucx-perftest: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(effort) = opts.floors {
        return match floors::measure(&self_cmd, effort, opts.progress) {
            Ok(f) => {
                if opts.format == Format::Json {
                    println!("{}", report::to_json(&f));
                } else {
                    print!("{}", f.render());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("rucx-perftest --floors: {e}");
                ExitCode::FAILURE
            }
        };
    }
    rucx::ucs::log::init();
    mem::set_pin_host(opts.pin_host);
    let res = if opts.is_server() {
        server(&opts)
    } else {
        client(&opts, &self_cmd)
    };
    if std::env::var_os("RUCX_PERFTEST_PEAK_RSS").is_some() {
        // For the memory test: each side's peak resident memory, on stderr.
        let side = if opts.is_server() { "server" } else { "client" };
        match mem::peak_rss_kib() {
            Some(k) => eprintln!("rucx-perftest: {side} peak RSS {k} KiB"),
            None => eprintln!("rucx-perftest: {side} peak RSS unknown (no /proc/self/status)"),
        }
    }
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rucx-perftest: {e}");
            ExitCode::FAILURE
        }
    }
}

fn server(opts: &Options) -> R<()> {
    if !opts.local_server {
        eprintln!(
            "rucx-perftest: waiting for a client on {}:{} (RUCX_TLS={})",
            opts.bind,
            opts.port,
            std::env::var("RUCX_TLS").unwrap_or_else(|_| "all".into())
        );
    }
    let job = run::start_job(opts)?;
    run::serve(&job)
}

/// A free local port outside the kernel's ephemeral range ([`rucx::bootstrap::local_port`]).
fn free_port() -> R<u16> {
    rucx::bootstrap::local_port().map_err(|e| format!("finding a free local port: {e}"))
}

/// The server half of `--local` gets the job key through its environment (never its command
/// line, which other users can read).
fn spawn_local_server(opts: &Options, self_cmd: &[OsString], key: &str) -> R<Child> {
    let (exe, lead) = self_cmd
        .split_first()
        .ok_or("no command to start the server half")?;
    // The server's own buffers are made as the client's are (page-locked, or from the heap).
    let host_mem = [
        (opts.pin_host, "--pin-host"),
        (opts.heap_host, "--heap-host"),
    ]
    .into_iter()
    .filter_map(|(on, flag)| on.then_some(flag));
    Command::new(exe)
        .args(lead)
        .args([
            "--local-server",
            "-q",
            "--bind",
            "127.0.0.1",
            "-p",
            &opts.port.to_string(),
        ])
        .args(host_mem)
        .env("RUCX_BOOTSTRAP_KEY", key)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting the server half ({}): {e}", exe.to_string_lossy()))
}

fn reap(child: &mut Child, limit: Duration) -> R<()> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(format!("the server half exited with {st}")),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("the server half did not exit; killed it".into());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("waiting for the server half: {e}")),
        }
    }
}

fn client(opts: &Options, self_cmd: &[OsString]) -> R<()> {
    // Fail before starting anything when GPU memory is asked for and there is no GPU.
    mem::gpu_for(opts.mem, 1)?;
    let mut opts = opts.clone();
    let mut child = None;
    let mut key = None;
    if opts.local {
        if !opts.port_given {
            opts.port = free_port()?;
        }
        opts.server = Some("127.0.0.1".into());
        // Both halves share a fresh job key, unless one is set already.
        let k = match std::env::var("RUCX_BOOTSTRAP_KEY") {
            Ok(k) if !k.is_empty() => k,
            _ => rucx::bootstrap::generate_key().map_err(|e| e.to_string())?,
        };
        child = Some(spawn_local_server(&opts, self_cmd, &k)?);
        key = Some(k);
    }
    let res = (|| {
        let job = run::start_job_keyed(&opts, key.as_deref())?;
        let r = client_body(&job, &opts);
        if r.is_err()
            && let Some(c) = child.as_mut()
        {
            // Do not leave the server half waiting for specs that never come.
            let _ = c.kill();
        }
        r
    })();
    match (res, child.as_mut()) {
        (Ok(()), Some(c)) => reap(c, Duration::from_secs(30)),
        (Err(e), Some(c)) => {
            let _ = c.kill();
            let _ = c.wait();
            Err(e)
        }
        (r, None) => r,
    }
}

/// Where the host buffers of both sides come from, as the header says it.
fn host_buffers(job: &Job, opts: &Options) -> String {
    if opts.pin_host {
        return "heap, page-locked (--pin-host)".into();
    }
    if opts.heap_host {
        return "heap (--heap-host)".into();
    }
    // Ask the context what a buffer would be (one page, freed at once).
    match job.context().mem_alloc(4096) {
        Ok(a) => match a.shared_by() {
            Some(d) => format!(
                "Context::mem_alloc: shared memory of domain {d} (peers on this host copy \
                 with one plain copy through a mapping; --heap-host for heap buffers)"
            ),
            None => "Context::mem_alloc: heap (no domain shares host memory)".into(),
        },
        Err(e) => format!("Context::mem_alloc failed ({e})"),
    }
}

/// How the bandwidth tests' receiver (the getter of `ucp_get`) lends its buffers, as the
/// header says it.
fn recv_ring(opts: &Options) -> String {
    format!(
        "the window ({}) or {} bytes of distinct buffers, whichever is more, at most 1024 \
         (--recv-ring {}; ucx_perftest receives the window into one buffer)",
        opts.window,
        opts.recv_ring,
        rucx::ucs::units::format_bytes(opts.recv_ring as u64)
    )
}

fn meta(job: &Job, opts: &Options) -> Vec<(&'static str, String)> {
    let mut m = vec![
        ("Transports", job.worker().transports().join(", ")),
        (
            "RUCX_TLS",
            std::env::var("RUCX_TLS").unwrap_or_else(|_| "(all)".into()),
        ),
    ];
    let gpu = mem::gpu_for(opts.mem, 1).ok().flatten();
    for (k, v) in run::describe(job, &opts.sizes) {
        // The size table is host memory's; GPU buffers take the path below.
        let k = if gpu.is_some() && k == "Tag protocols" {
            "Host protocols"
        } else {
            k
        };
        m.push((k, v));
    }
    let host = if opts.pin_host {
        "host (page-locked)"
    } else {
        "host (pageable)"
    };
    let name = |m: rucx::MemoryType| match m {
        rucx::MemoryType::Host if gpu.is_some() => host.to_string(),
        m => m.to_string(),
    };
    if opts.mem.0 == rucx::MemoryType::Host || opts.mem.1 == rucx::MemoryType::Host {
        m.push(("Host buffers", host_buffers(job, opts)));
    }
    if opts.sweep
        || matches!(
            opts.test,
            TestKind::TagBw | TestKind::TagSyncBw | TestKind::StreamBw | TestKind::Get
        )
    {
        m.push(("Receive ring", recv_ring(opts)));
    }
    m.push(("Send memory", name(opts.mem.0)));
    m.push(("Recv memory", name(opts.mem.1)));
    if let Some(g) = gpu {
        m.push((
            "GPUs",
            format!(
                "rank r on GPU r % {}: server (rank 0) GPU 0, client (rank 1) {}",
                g.count,
                g.describe()
            ),
        ));
        if let Ok(paths) = job.worker().path_query(job.ep(0), Some(g.ordinal)) {
            let want = [opts.mem, (opts.mem.1, opts.mem.0)];
            // The test's operation: put moves client -> server, get server -> client.
            let op = match opts.test {
                TestKind::PutLat | TestKind::PutBw => rucx::ucp::plan::Op::Put,
                TestKind::Get => rucx::ucp::plan::Op::Get,
                _ => rucx::ucp::plan::Op::Tag,
            };
            let lines: Vec<String> = paths
                .iter()
                .filter(|p| p.op == op && want.contains(&(p.send_mem, p.recv_mem)))
                .map(|p| p.to_string())
                .collect();
            if !lines.is_empty() {
                m.push(("GPU path", lines.join("; ")));
            }
        }
    }
    m
}

/// With GPU memory: the protocols the client's requests took (counters of its worker), one
/// line, or `None` for host memory.
fn protocols_used(job: &Job, opts: &Options) -> Option<String> {
    if !mem::needs_gpu(opts.mem) {
        return None;
    }
    let c = job.worker().counters();
    Some(format!(
        "Protocols used by the client: {}",
        c.iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The bound lines of `--bounds`: the measured bandwidth (`f`, the largest size) against
/// GPU copies of the same size timed in this run. Returns (label, text) pairs.
pub fn bounds_lines(f: &Figures, b: &mem::Bounds) -> Vec<(String, String)> {
    let mbs = |bps: f64| bps / crate::stats::MB;
    let line = |bps: f64| {
        format!(
            "{:.1} MB/s ({:.2} GB/s); {} overall {:.1} MB/s is {:.3} of it",
            mbs(bps),
            bps / 1e9,
            f.test,
            f.bw_overall_mbs,
            f.bw_overall_mbs / mbs(bps)
        )
    };
    let mut v = vec![
        ("pinned host -> GPU 0 copy".to_string(), line(b.h2d)),
        ("GPU 1 -> pinned host copy".to_string(), line(b.d2h)),
        (
            "pageable host -> GPU 0 copy".to_string(),
            line(b.h2d_pageable),
        ),
        (
            "GPU 0 -> pageable host copy".to_string(),
            line(b.d2h_pageable),
        ),
    ];
    v.push((
        "peer copy GPU 0 -> GPU 1".to_string(),
        match &b.p2p {
            Ok(p) => line(*p),
            Err(why) => format!("not measured: {why}"),
        },
    ));
    v
}

/// The latency bound lines of `--bounds` for a ping-pong test: its one-way 50th percentile
/// (`f`, the smallest size) against one copy of that size, polled by an event, this run.
pub fn lat_bounds_lines(f: &Figures, b: &mem::LatBounds) -> Vec<(String, String)> {
    let line = |us: f64| {
        format!(
            "{us:.3} us; {} 50%ile {:.3} us is {:.2}x it",
            f.test,
            f.lat_p50_us,
            f.lat_p50_us / us
        )
    };
    vec![
        ("pinned host -> GPU 0 copy".to_string(), line(b.h2d_us)),
        ("GPU 1 -> pinned host copy".to_string(), line(b.d2h_us)),
        (
            "peer copy GPU 0 -> GPU 1".to_string(),
            match &b.p2p_us {
                Ok(us) => line(*us),
                Err(why) => format!("not measured: {why}"),
            },
        ),
    ]
}

/// Which bound line (0: host -> GPU, 1: GPU -> host, 2: peer copy) is the floor of `test` with
/// memory `mem`: the copy its data needs at best. The data flows from the first memory type to
/// the second, except for a get (the client reads the server's region: second to first).
pub fn matching_floor(test: TestKind, mem: (rucx::MemoryType, rucx::MemoryType)) -> Option<usize> {
    let (from, to) = if test == TestKind::Get {
        (mem.1, mem.0)
    } else {
        mem
    };
    match (from.is_gpu(), to.is_gpu()) {
        (false, true) => Some(0),
        (true, false) => Some(1),
        (true, true) => Some(2),
        (false, false) => None,
    }
}

/// Measure and print the bounds (stdout for the table, stderr for CSV; JSON gets them as
/// fields): for ping-pong tests one copy's latency at the smallest size of `figs`, else copy
/// bandwidth at the largest. Returns the JSON fields.
fn bounds_report(opts: &Options, figs: &[Figures]) -> R<Vec<(&'static str, String)>> {
    let lat = opts.test.is_pingpong() && !opts.sweep;
    let f = if lat {
        figs.iter().min_by_key(|f| f.size)
    } else {
        figs.iter().max_by_key(|f| f.size)
    };
    let Some(f) = f else {
        return Ok(Vec::new());
    };
    let iters = f.iterations.clamp(10, 1000);
    let (head, lines) = if lat {
        let b = mem::measure_copy_latency(f.size, iters)?;
        (
            format!(
                "Latency bounds at {} B (one copy, polled by an event until done; median of {}):",
                b.size, b.iters
            ),
            lat_bounds_lines(f, &b),
        )
    } else {
        let b = mem::measure_bounds(f.size, iters)?;
        (
            format!(
                "Bounds at {} B (copies of one message, {} in a row on one stream, this run):",
                b.size, b.iters
            ),
            bounds_lines(f, &b),
        )
    };
    // The copy the test's data path needs at best: mark it.
    let mut lines = lines;
    if let Some(i) = matching_floor(opts.test, opts.mem)
        && let Some(l) = lines.get_mut(i)
    {
        l.1.push_str(" [this test's floor]");
    }
    match opts.format {
        Format::Table => {
            println!("{head}");
            for (k, v) in &lines {
                println!("  {k:<28} {v}");
            }
        }
        Format::Csv => {
            eprintln!("{head}");
            for (k, v) in &lines {
                eprintln!("  {k:<28} {v}");
            }
        }
        Format::Json => {}
    }
    // One key per line, in the lines' order.
    let keys: &[&'static str] = if lat {
        &["lat_bound_h2d", "lat_bound_d2h", "lat_bound_p2p"]
    } else {
        &[
            "bound_h2d",
            "bound_d2h",
            "bound_h2d_pageable",
            "bound_d2h_pageable",
            "bound_p2p",
        ]
    };
    debug_assert_eq!(keys.len(), lines.len());
    Ok(keys
        .iter()
        .copied()
        .zip(lines.into_iter().map(|(_, v)| v))
        .collect())
}

fn client_body(job: &Job, opts: &Options) -> R<()> {
    if opts.sweep {
        return sweep(job, opts);
    }
    let test = opts.test;
    let mut info = vec![("Test", format!("{} - {}", test.name(), test.describe()))];
    info.extend(meta(job, opts));
    if !test.is_pingpong() {
        info.push(("Window", format!("{} outstanding (-O)", opts.window)));
    }
    if opts.format == Format::Table {
        println!("{}", report::info_box(&info));
        println!("{}", report::table_header());
    } else if opts.format == Format::Csv {
        println!("{}", report::CSV_HEADER);
    }
    let mut all = Vec::new();
    let mut driver_calls = Vec::new();
    for &size in &opts.sizes {
        let spec = run::spec_for(opts, test, size);
        let (f, calls) = run::client_run_counted(job, &spec, opts.progress)?;
        match opts.format {
            Format::Table => println!("{}", report::table_row(&f)),
            Format::Csv => println!("{}", report::csv_row(&f)),
            Format::Json => {}
        }
        // Only where the driver was used (GPU memory): host runs print what they always did.
        if calls.counts.total_calls() > 0 {
            driver_calls.push(format!(
                "CUDA driver calls per iteration, client, {} {} B: {}",
                test,
                size,
                calls.per_iteration()
            ));
        }
        all.push(f);
    }
    run::client_quit(job)?;
    if opts.format == Format::Table {
        println!("{}", report::table_footer());
        if let Some(l) = protocols_used(job, opts) {
            println!("{l}");
        }
    }
    match opts.format {
        Format::Table => driver_calls.iter().for_each(|l| println!("{l}")),
        Format::Csv => driver_calls.iter().for_each(|l| eprintln!("{l}")),
        Format::Json => {}
    }
    let bounds = if opts.bounds {
        bounds_report(opts, &all)?
    } else {
        Vec::new()
    };
    if opts.format == Format::Json {
        let mut m: Vec<(&str, String)> = vec![("test", test.name().into())];
        m.extend(info.iter().skip(1).cloned());
        m.extend(bounds);
        if !driver_calls.is_empty() {
            m.push(("driver_calls_client", driver_calls.join("; ")));
        }
        println!("{}", report::json_document(&m, &all));
    }
    Ok(())
}

/// The text table of a sweep.
pub fn sweep_table(lat: &[Figures], bw: &[Figures]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>9}  {:>12}  {:>12}  {:>12}  {:>14}  {:>12}",
        "size", "lat 50% (us)", "lat avg (us)", "bw (MB/s)", "rate (msg/s)", "lat iters"
    );
    let sizes: Vec<usize> = lat
        .iter()
        .map(|f| f.size)
        .chain(bw.iter().map(|f| f.size))
        .fold(Vec::new(), |mut v, x| {
            if !v.contains(&x) {
                v.push(x);
            }
            v
        });
    for size in sizes {
        let l = lat.iter().find(|f| f.size == size);
        let b = bw.iter().find(|f| f.size == size);
        let opt = |v: Option<f64>, p: usize| v.map_or("-".into(), |x| format!("{x:.p$}"));
        let _ = writeln!(
            s,
            "{:>9}  {:>12}  {:>12}  {:>12}  {:>14}  {:>12}",
            plot::size_label(size as f64),
            opt(l.map(|f| f.lat_p50_us), 3),
            opt(l.map(|f| f.lat_avg_us), 3),
            opt(b.map(|f| f.bw_overall_mbs), 2),
            opt(b.map(|f| f.mr_overall), 0),
            l.map_or("-".into(), |f| f.iterations.to_string())
        );
    }
    s
}

/// A named sweep: (name, latency figures, bandwidth figures).
pub type SweepSeries = (String, Vec<Figures>, Vec<Figures>);

/// The two panels of a sweep plot from named series of (latency, bandwidth) figures.
pub fn sweep_panels(series: &[SweepSeries]) -> Vec<Panel> {
    let mk = |title: &str, y: &str, pick: &dyn Fn(&SweepSeries) -> Vec<(f64, f64)>| Panel {
        title: title.into(),
        y_label: y.into(),
        log_y: true,
        series: series
            .iter()
            .enumerate()
            .map(|(i, s)| Series {
                name: s.0.clone(),
                color: plot::PALETTE[i % plot::PALETTE.len()].into(),
                points: pick(s),
                dashed: false,
            })
            .collect(),
    };
    vec![
        mk(
            "tag_lat: latency (50th percentile)",
            "one-way latency (usec, log scale)",
            &|s| s.1.iter().map(|f| (f.size as f64, f.lat_p50_us)).collect(),
        ),
        mk(
            "tag_bw: bandwidth (overall)",
            "bandwidth (MB/s, log scale)",
            &|s| {
                s.2.iter()
                    .map(|f| (f.size as f64, f.bw_overall_mbs))
                    .collect()
            },
        ),
    ]
}

fn sweep(job: &Job, opts: &Options) -> R<()> {
    let mut lat = Vec::new();
    let mut bw = Vec::new();
    for (test, out) in [(TestKind::TagLat, &mut lat), (TestKind::TagBw, &mut bw)] {
        for &size in &opts.sizes {
            let spec = run::spec_for(opts, test, size);
            if opts.progress {
                eprintln!(
                    "[rucx-perftest] sweep: {} {} B, {} iterations",
                    test.name(),
                    size,
                    spec.iters
                );
            }
            out.push(run::client_run(job, &spec, opts.progress)?);
        }
    }
    run::client_quit(job)?;
    let m = meta(job, opts);
    let tls = std::env::var("RUCX_TLS").unwrap_or_else(|_| "all".into());
    match opts.format {
        Format::Table => {
            let mut info = vec![(
                "Sweep",
                format!(
                    "tag_lat (half round trip) and tag_bw (window {}), {} sizes",
                    opts.window,
                    opts.sizes.len()
                ),
            )];
            info.extend(m.iter().filter(|(k, _)| *k != "Tag protocols").cloned());
            println!("{}", report::info_box(&info));
            print!("{}", sweep_table(&lat, &bw));
            if opts.bounds {
                bounds_report(opts, &bw)?;
            }
        }
        Format::Csv => {
            println!("{}", report::CSV_HEADER);
            for f in lat.iter().chain(&bw) {
                println!("{}", report::csv_row(f));
            }
            if opts.bounds {
                bounds_report(opts, &bw)?;
            }
        }
        Format::Json => {
            let mut all = lat.clone();
            all.extend(bw.iter().cloned());
            let mut mm: Vec<(&str, String)> = vec![("test", "sweep".into())];
            mm.extend(m.iter().filter(|(k, _)| *k != "Tag protocols").cloned());
            if opts.bounds {
                mm.extend(bounds_report(opts, &bw)?);
            }
            println!("{}", report::json_document(&mm, &all));
        }
    }
    let panels = sweep_panels(&[(format!("rucx (RUCX_TLS={tls})"), lat, bw)]);
    let caption = format!(
        "rucx-perftest --sweep, RUCX_TLS={tls}, transports: {}",
        job.worker().transports().join(", ")
    );
    plot::write(&opts.plot, &panels, &caption)
        .map_err(|e| format!("writing the plot to {}: {e}", opts.plot.display()))?;
    eprintln!("rucx-perftest: plot written to {}", opts.plot.display());
    Ok(())
}

/// Entry point of the `rucx-perftest` binary.
pub fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let exe = std::env::current_exe()
        .map(OsString::from)
        .unwrap_or_else(|_| argv[0].clone());
    main_with(argv, vec![exe])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_matching_floor_follows_the_data() {
        use rucx::MemoryType::{Cuda, Host};
        for t in [TestKind::TagBw, TestKind::PutBw, TestKind::PutLat] {
            assert_eq!(matching_floor(t, (Cuda, Cuda)), Some(2));
            assert_eq!(matching_floor(t, (Host, Cuda)), Some(0));
            assert_eq!(matching_floor(t, (Cuda, Host)), Some(1));
            assert_eq!(matching_floor(t, (Host, Host)), None);
        }
        // A get moves the server's region (second) into the client's buffer (first).
        assert_eq!(matching_floor(TestKind::Get, (Host, Cuda)), Some(1));
        assert_eq!(matching_floor(TestKind::Get, (Cuda, Host)), Some(0));
        assert_eq!(matching_floor(TestKind::Get, (Cuda, Cuda)), Some(2));
    }

    #[test]
    fn sweep_table_has_a_row_per_size() {
        let f = |t: &str, s: usize| {
            Figures::compute(
                t,
                s,
                &[Duration::from_micros(4)],
                Duration::from_micros(4),
                true,
            )
        };
        let t = sweep_table(&[f("tag_lat", 1), f("tag_lat", 1024)], &[f("tag_bw", 1024)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[1].trim_start().starts_with("1 ") && lines[1].contains(" - "));
        assert!(lines[2].trim_start().starts_with("1K"));
        let p = sweep_panels(&[("x".into(), vec![f("tag_lat", 8)], vec![])]);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].series[0].points, vec![(8.0, 2.0)]);
    }

    #[test]
    fn bound_lines_give_the_ratios() {
        // 1 MiB per 100 us: 10000 MB/s (of 2^20 bytes).
        let f = Figures::compute(
            "tag_bw",
            1 << 20,
            &[Duration::from_micros(100); 10],
            Duration::from_micros(1000),
            false,
        );
        let mb = crate::stats::MB;
        let b = mem::Bounds {
            size: 1 << 20,
            iters: 10,
            h2d: 20_000.0 * mb,
            d2h: 40_000.0 * mb,
            h2d_pageable: 5_000.0 * mb,
            d2h_pageable: 8_000.0 * mb,
            p2p: Err("needs two GPUs (1 visible)".into()),
        };
        let l = bounds_lines(&f, &b);
        assert_eq!(l.len(), 5);
        assert!(l[0].1.contains("20000.0 MB/s") && l[0].1.ends_with("is 0.500 of it"));
        assert!(l[1].1.ends_with("is 0.250 of it"), "{}", l[1].1);
        assert!(l[2].0.starts_with("pageable") && l[2].1.ends_with("is 2.000 of it"));
        assert!(l[3].0.ends_with("pageable host copy") && l[3].1.ends_with("is 1.250 of it"));
        assert_eq!(l[4].1, "not measured: needs two GPUs (1 visible)");
        let b = mem::Bounds {
            p2p: Ok(10_000.0 * mb),
            ..b
        };
        assert!(bounds_lines(&f, &b)[4].1.ends_with("is 1.000 of it"));
    }

    #[test]
    fn latency_bound_lines_give_the_ratios() {
        // A ping-pong of 20 us round trips: 10 us one way.
        let f = Figures::compute(
            "tag_lat",
            8,
            &[Duration::from_micros(20); 10],
            Duration::from_micros(200),
            true,
        );
        let b = mem::LatBounds {
            size: 8,
            iters: 10,
            h2d_us: 5.0,
            d2h_us: 8.0,
            p2p_us: Err("needs two GPUs (1 visible)".into()),
        };
        let l = lat_bounds_lines(&f, &b);
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].1, "5.000 us; tag_lat 50%ile 10.000 us is 2.00x it");
        assert!(l[1].1.ends_with("is 1.25x it"), "{}", l[1].1);
        assert_eq!(l[2].1, "not measured: needs two GPUs (1 visible)");
    }
}
