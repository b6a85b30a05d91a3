//! rucx-perftest end to end: both sides as two local processes over real transports.

use std::process::{Command, Output};

fn perftest(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
        .args(args)
        .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
        .output()
        .expect("rucx-perftest runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The data row of `size` in the table (first column), split into its cells.
fn row(out: &str, size: usize) -> Vec<String> {
    out.lines()
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .find(|c| c.len() == 9 && c[0] == size.to_string())
        .unwrap_or_else(|| panic!("no row for {size} in:\n{out}"))
}

#[test]
fn tag_lat_8_bytes_prints_the_columns() {
    let o = perftest(&["--local", "-t", "tag_lat", "-s", "8", "-n", "100"]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    for col in [
        "latency (usec)",
        "bandwidth (MB/s)",
        "message rate (msg/s)",
        "# iterations",
        "50.0%ile",
        "average",
        "overall",
    ] {
        assert!(stdout.contains(col), "missing {col:?}:\n{stdout}");
    }
    let r = row(&stdout, 8);
    assert_eq!(r[1], "100");
    for cell in &r[2..] {
        let v: f64 = cell.parse().unwrap_or_else(|_| panic!("{cell:?} in {r:?}"));
        assert!(v.is_finite() && v >= 0.0, "{r:?}");
    }
    // A ping-pong moved data: its latency is positive.
    assert!(r[2].parse::<f64>().unwrap() > 0.0, "{r:?}");
    // Both halves shared a generated job key: no warning about an unauthenticated bootstrap.
    assert!(!out.contains("unauthenticated"), "{out}");
}

#[test]
fn tag_bw_1m_prints_the_columns() {
    let o = perftest(&["--local", "-t", "tag_bw", "-s", "1M", "-n", "20"]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let r = row(&String::from_utf8_lossy(&o.stdout), 1 << 20);
    assert_eq!(r[1], "20");
    assert!(
        r[6].parse::<f64>().unwrap() > 0.0,
        "overall bandwidth {r:?}"
    );
    assert!(out.contains("Window:"), "{out}");
}

#[test]
fn csv_and_json_shapes() {
    let o = perftest(&[
        "--local", "-q", "--csv", "-t", "tag_lat", "-s", "8,2K", "-n", "50",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(lines[0].starts_with("test,size,iterations,50.0_percentile_lat"));
    assert!(lines[1].starts_with("tag_lat,8,50,"));
    assert!(lines[2].starts_with("tag_lat,2048,50,"));
    assert_eq!(lines[1].split(',').count(), lines[0].split(',').count());

    let o = perftest(&[
        "--local", "-q", "--json", "-t", "am_lat", "-s", "64", "-n", "50",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("rucx-perftest --json prints one document");
    assert_eq!(v["test"], "am_lat");
    assert_eq!(v["results"][0]["size"], 64);
    assert_eq!(v["results"][0]["iterations"], 50);
    assert!(v["results"][0]["latency_us"]["p50"].as_f64().unwrap() > 0.0);
}

#[test]
fn sweep_writes_a_plot() {
    let dir = std::env::temp_dir().join(format!("rucx-perftest-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("sweep.svg");
    let o = perftest(&[
        "--local",
        "-q",
        "--sweep",
        "-s",
        "1,4K",
        "-n",
        "30",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("lat 50% (us)") && stdout.contains("4K"),
        "{stdout}"
    );
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.contains("tag_bw"), "{s}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_is_a_clear_error() {
    let o = perftest(&["--local", "-m", "cuda-managed", "-t", "am_bw"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("managed"), "{}", text(&o));
    let o = perftest(&["--local", "--bounds"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("-m cuda"), "{}", text(&o));
    let o = perftest(&["--local", "-s", "8,4Q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("4Q"), "{}", text(&o));
    let o = perftest(&["--local", "-t", "ucp_fadd"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("no atomic operations"), "{}", text(&o));
}

/// GPU memory: without a CUDA driver (this machine, CI) a clear error naming the driver's
/// reason; with one (the GPU machine), the tests run and every message is verified.
#[test]
fn gpu_memory_runs_or_names_the_missing_driver() {
    // Tag ping-pong, put/get between GPU buffers and between host and GPU (the client's
    // buffer first, the server's region second), active messages (copied in at 8 B,
    // rendezvous at 1 MiB) and streams with GPU memory on both sides and on one.
    for (m, t) in [
        ("cuda,cuda", "am_lat"),
        ("cuda,host", "am_bw"),
        ("host,cuda", "am_bw"),
        ("cuda,cuda", "stream_lat"),
        ("host,cuda", "stream_bw"),
        ("cuda,cuda", "tag_lat"),
        ("cuda,cuda", "ucp_put_bw"),
        ("cuda,cuda", "ucp_get"),
        ("cuda,cuda", "ucp_put_lat"),
        ("host,cuda", "ucp_put_bw"),
        ("cuda,host", "ucp_get"),
    ] {
        let args = ["--local", "-q", "-m", m, "-t", t, "-s", "8,1M", "-n", "20"];
        let o = perftest(&args);
        let out = text(&o);
        match rucx_cuda::driver() {
            Err(e) => {
                assert_eq!(o.status.code(), Some(1), "{m} {t}: {out}");
                let reason = match e {
                    rucx::Error::Unavailable { reason, .. } => reason,
                    other => other.to_string(),
                };
                assert!(
                    out.contains(&format!("-m cuda needs a CUDA driver: {reason}")),
                    "{m} {t}: {out}"
                );
            }
            Ok(_) => {
                assert!(o.status.success(), "{m} {t}: {out}");
                assert_eq!(
                    row(&String::from_utf8_lossy(&o.stdout), 8)[1],
                    "20",
                    "{m} {t}"
                );
            }
        }
    }
}

/// The two-host form, on one host: a server started alone waits for its client (with the
/// default bootstrap timeout, as a user would run it), the client runs the test and tells the
/// server to quit, and both exit cleanly.
#[test]
fn server_and_client_as_separate_commands() {
    let port = rucx::bootstrap::local_port().unwrap().to_string();
    let mut server = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
        .args(["-p", &port, "-q"])
        .env_remove("RUCX_BOOTSTRAP_TIMEOUT")
        .env("RUCX_TLS", "posix")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("server starts");
    let client = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
        .args([
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "tag_lat",
            "-s",
            "8",
            "-n",
            "2000",
        ])
        .args(["-q", "--csv"])
        .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
        .env("RUCX_TLS", "posix")
        .output()
        .expect("client runs");
    let out = text(&client);
    if !client.status.success() {
        let _ = server.kill();
    }
    let srv = server.wait_with_output().expect("server ends");
    assert!(
        client.status.success(),
        "client: {out}\nserver: {}",
        text(&srv)
    );
    assert!(srv.status.success(), "server: {}", text(&srv));
    let line = out
        .lines()
        .find(|l| l.starts_with("tag_lat,8,2000,"))
        .unwrap_or_else(|| panic!("no csv row in:\n{out}"));
    let p50: f64 = line.split(',').nth(3).unwrap().parse().unwrap();
    assert!(p50 > 0.0, "{line}");
}

/// A server waiting for its client (`-p PORT`, with a job key) is not ended or held up by what
/// a stranger sends to its port: the 28-byte packet of a forged join claiming rank 5 of 2,
/// random bytes, a truncated header, idle connections. Its client (with the key) still runs.
#[test]
fn a_waiting_server_survives_strangers_and_serves_its_client() {
    use std::io::Write;
    use std::net::TcpStream;
    let port = rucx::bootstrap::local_port().unwrap();
    let key = "perftest-test-key-0123456789abcdef";
    let mut server = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
        .args(["-p", &port.to_string(), "-q", "--bind", "127.0.0.1"])
        .env("RUCX_BOOTSTRAP_TIMEOUT", "60s")
        .env("RUCX_BOOTSTRAP_KEY", key)
        .env("RUCX_TLS", "posix")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("server starts");
    let at = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let start = std::time::Instant::now();
    let mut strangers = Vec::new();
    while strangers.is_empty() {
        match TcpStream::connect(at) {
            Ok(s) => strangers.push(s),
            Err(_) if start.elapsed() < std::time::Duration::from_secs(30) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => panic!("the server never listened: {e}"),
        }
    }
    let mut forged = b"RUCXBOOT".to_vec();
    for v in [1u32, 5, 2, 4] {
        forged.extend_from_slice(&v.to_le_bytes());
    }
    forged.extend_from_slice(b"addr");
    assert_eq!(forged.len(), 28);
    for bytes in [&forged[..], &[0xa5; 100][..], &forged[..10]] {
        let mut s = TcpStream::connect(at).unwrap();
        s.write_all(bytes).unwrap();
        strangers.push(s);
    }
    for _ in 0..50 {
        strangers.push(TcpStream::connect(at).unwrap());
    }
    let client = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
        .args([
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            "tag_lat",
            "-s",
            "8",
        ])
        .args(["-n", "200", "-q", "--csv"])
        .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
        .env("RUCX_BOOTSTRAP_KEY", key)
        .env("RUCX_TLS", "posix")
        .output()
        .expect("client runs");
    let out = text(&client);
    if !client.status.success() {
        let _ = server.kill();
    }
    let srv = server.wait_with_output().expect("server ends");
    drop(strangers);
    assert!(
        client.status.success(),
        "client: {out}\nserver: {}",
        text(&srv)
    );
    assert!(srv.status.success(), "server: {}", text(&srv));
    assert!(out.contains("tag_lat,8,200,"), "{out}");
    assert!(
        text(&srv).contains("dropped a connection"),
        "{}",
        text(&srv)
    );
}

/// The synchronous, stream and active-message tests run at a small and a large size (eager and
/// rendezvous for the tag and active-message tests, one and many pieces for the stream), with the data checked by the tool (it
/// fails on a wrong byte), and print one row per size.
#[test]
fn tag_sync_and_stream_tests_run() {
    for test in [
        "tag_sync_lat",
        "tag_sync_bw",
        "stream_lat",
        "stream_bw",
        "am_lat",
        "am_bw",
    ] {
        let o = perftest(&[
            "--local", "-t", test, "-s", "8,300K", "-n", "200", "-q", "--csv",
        ]);
        let out = text(&o);
        assert!(o.status.success(), "{test}: {out}");
        for size in ["8", "307200"] {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("{test},{size},200,")))
                .unwrap_or_else(|| panic!("{test}: no row for {size} in:\n{out}"));
            let p50: f64 = line.split(',').nth(3).unwrap().parse().unwrap();
            assert!(p50 > 0.0, "{line}");
        }
    }
}

/// The byte stream over tcp (many 8 KiB pieces per message, one connection per pair after the
/// endpoints converge): the data is checked by the tool.
#[test]
fn stream_over_tcp() {
    let o = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
        .args([
            "--local",
            "-t",
            "stream_bw",
            "-s",
            "1M",
            "-n",
            "40",
            "-q",
            "--csv",
        ])
        .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
        .env("RUCX_TLS", "tcp")
        .env("RUCX_TCP_IFACES", "lo")
        .output()
        .expect("rucx-perftest runs");
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("stream_bw,1048576,40,"), "{out}");
}

/// The peak resident memory each side printed (`RUCX_PERFTEST_PEAK_RSS`), in bytes.
fn peak_rss(out: &str, side: &str) -> u64 {
    let pre = format!("rucx-perftest: {side} peak RSS ");
    let line = out
        .lines()
        .find(|l| l.starts_with(&pre))
        .unwrap_or_else(|| panic!("no {side} peak RSS in:\n{out}"));
    let kib: u64 = line[pre.len()..]
        .trim_end_matches(" KiB")
        .parse()
        .unwrap_or_else(|_| panic!("{line}"));
    kib << 10
}

/// Memory bounded by the message: receiving (and sending) 1 GiB messages, with one and with
/// four in flight, costs each side the message plus at most 96 MiB (perftest's ring of
/// receive buffers holds one slot of a message this large; the library holds no copy of a
/// rendezvous payload). Before, the receiver held a slot per outstanding message plus two
/// copies for checking (4.7 GB for 256 MiB at -O 16; OOM-killed at 2 GiB). Buffers from the
/// heap (`--heap-host`), as an application's own: with shared allocations (the default) each
/// side also maps the peer's buffer, and the peak RSS counts those shared pages twice over.
#[test]
fn peak_memory_is_bounded_by_the_message() {
    const GIB: u64 = 1 << 30;
    for window in ["1", "4"] {
        let o = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
            .args(["--local", "-t", "tag_bw", "-s", "1G", "-n", "2", "-w", "0"])
            .args(["-O", window, "-q", "--heap-host"])
            .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
            .env("RUCX_PERFTEST_PEAK_RSS", "1")
            .output()
            .expect("rucx-perftest runs");
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        for side in ["server", "client"] {
            let rss = peak_rss(&out, side);
            assert!(
                (GIB..=GIB + (96 << 20)).contains(&rss),
                "-O {window}: the {side} peaked at {} MiB for 1 GiB messages\n{out}",
                rss >> 20
            );
        }
    }
}

/// The bandwidth receiver lends 1 MiB of buffers, at least one per request of the window,
/// unless `--recv-ring` asks for more (ucx_perftest receives its window into one buffer):
/// with 1 MiB messages and `-O 1` the server holds 1 MiB of receive buffers by default (it
/// held 16 before, a 16 MiB ring), 64 with `--recv-ring 64M`, and the header says which.
/// Heap buffers, so the peak RSS counts each once.
#[test]
fn the_receive_ring_is_the_window_unless_asked() {
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_rucx-perftest"))
            .args(["--local", "-t", "tag_bw", "-s", "1M", "-n", "80", "-w", "0"])
            .args(["-O", "1", "--heap-host"])
            .args(extra)
            .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
            .env("RUCX_PERFTEST_PEAK_RSS", "1")
            .output()
            .expect("rucx-perftest runs");
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        (peak_rss(&out, "server"), out)
    };
    let (small, out) = run(&[]);
    assert!(
        out.contains("Receive ring: the window (1) or 1048576 bytes of distinct buffers"),
        "{out}"
    );
    assert!(
        small < 16 << 20,
        "the server peaked at {} MiB with a ring of one 1 MiB buffer\n{out}",
        small >> 20
    );
    let (large, out) = run(&["--recv-ring", "64M"]);
    assert!(
        out.contains("Receive ring: the window (1) or 67108864 bytes of distinct buffers"),
        "{out}"
    );
    assert!(
        large >= small + (56 << 20),
        "the server peaked at {} MiB with a 64 MiB ring (default: {} MiB)\n{out}",
        large >> 20,
        small >> 20
    );
}

/// `--floors`: every floor measured, positive and finite, as JSON and as a table.
#[test]
fn floors_are_measured_and_sane() {
    let o = perftest(&["--floors", "--quick", "--json", "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("--floors --json prints one document");
    let positive = |x: &serde_json::Value, what: &str| {
        let m = x["median"]
            .as_f64()
            .unwrap_or_else(|| panic!("{what}: {x}"));
        let b = x["best"].as_f64().unwrap();
        assert!(m > 0.0 && m.is_finite() && b > 0.0, "{what}: {x}");
    };
    positive(&v["cacheline_us"], "cache line");
    positive(&v["tcp_stream_mbs"], "tcp stream");
    let sizes = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|e| {
                positive(&e["value"], k);
                e["size"].as_u64().unwrap()
            })
            .collect()
    };
    assert_eq!(sizes("memcpy_mbs"), [64 << 10, 1 << 20, 4 << 20, 64 << 20]);
    assert_eq!(sizes("tcp_lat_us"), [8, 256, 4 << 10, 64 << 10]);
    // A cache line crosses in less than a millisecond, and a copy moves more than 100 MB/s.
    assert!(
        v["cacheline_us"]["median"].as_f64().unwrap() < 1000.0,
        "{v}"
    );
    assert!(v["memcpy_mbs"][0]["value"]["median"].as_f64().unwrap() > 100.0);

    let o = perftest(&["--floors", "--quick", "-q"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    for want in [
        "cache line ping-pong",
        "memcpy, one core",
        "tcp loopback stream",
        "64M",
    ] {
        assert!(out.contains(want), "missing {want:?}:\n{out}");
    }
}

/// `rucx-bench-compare` end to end, unattended, against a stand-in `ucx_perftest` (a script
/// printing a fixed CSV line): floors, rucx runs, ratios to UCX and to the floors, JSON.
#[test]
fn bench_compare_runs_end_to_end_with_floors() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("rucx-compare-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("ucx_perftest");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\n# a stand-in: the client prints one result line (and its environment), \
             the server nothing\n\
             case \"$1\" in 127.0.0.1) echo \"$UCX_TLS $UCX_ALLOC_PRIO $MALLOC_PERTURB_\" >> {}; \
             echo '2000,0.500,0.600,0.700,100.0,1000.0,10,10';; esac\n",
            dir.join("env.log").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let json = dir.join("c.json");
    let o = Command::new(env!("CARGO_BIN_EXE_rucx-bench-compare"))
        .args([
            "--reps",
            "1",
            "--quick",
            "--no-install",
            "--transports",
            "shm",
        ])
        .args(["--lat-sizes", "8", "--bw-sizes", "64K", "--ucx-perftest"])
        .arg(&fake)
        .arg("--json")
        .arg(&json)
        .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
        .output()
        .expect("rucx-bench-compare runs");
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("floors: cache line"), "{out}");
    assert!(
        out.contains("/floor") && out.contains("floor >= 0.6x"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // 8 B, 64 KiB, and 64 KiB again with heap buffers on both sides.
    assert_eq!(rows.len(), 3, "{v}");
    assert_eq!(rows[1]["buffers"], "alloc");
    assert_eq!(rows[2]["buffers"], "heap");
    assert!(out.contains("64K heap"), "{out}");
    let env = std::fs::read_to_string(dir.join("env.log")).unwrap();
    assert_eq!(env, "posix  \nposix  \nposix,cma heap 165\n", "{env}");
    for r in rows {
        assert!(r["floor"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["floor_ratio"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["rucx"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(rows[0]["ucx"], 0.5);
    assert_eq!(rows[1]["ucx"], 1000);
    assert_eq!(rows[2]["ucx"], 1000);
    assert!(v["floors"].as_str().unwrap().contains("memcpy 64K"), "{v}");
    std::fs::remove_dir_all(&dir).unwrap();
}
