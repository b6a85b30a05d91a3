//! Command line: the flags of `ucx_perftest`, parsed and validated into [`Options`].

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use clap::Parser;
use rucx::MemoryType;

/// Default TCP port of the rendezvous, as `ucx_perftest`'s.
pub const DEFAULT_PORT: u16 = 13337;

/// Sizes of an OSU-style sweep: 1 B to 4 MiB, powers of two.
pub fn sweep_sizes() -> Vec<usize> {
    (0..=22).map(|k| 1usize << k).collect()
}

/// The tests rucx-perftest runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TestKind {
    /// Tag-matched ping-pong; latency is half the round trip.
    TagLat,
    /// Tag-matched stream of messages from the client to the server.
    TagBw,
    /// Put ping-pong: each side writes into the other's mapped buffer and polls its own.
    PutLat,
    /// Stream of puts into the server's mapped buffer, flushed at the end.
    PutBw,
    /// Reads of the server's mapped buffer (latency with `-O 1`, bandwidth with a window).
    Get,
    /// Active-message ping-pong (handler replies); latency is half the round trip.
    AmLat,
    /// Stream of active messages with credit-based flow control.
    AmBw,
    /// Ping-pong of synchronous tag sends (complete once the peer matched them).
    TagSyncLat,
    /// Stream of synchronous tag sends.
    TagSyncBw,
    /// Ping-pong over the byte-stream API.
    StreamLat,
    /// One-way byte stream.
    StreamBw,
}

impl TestKind {
    /// Every test, in the order of `--help`.
    pub const ALL: [TestKind; 11] = [
        TestKind::TagLat,
        TestKind::TagBw,
        TestKind::TagSyncLat,
        TestKind::TagSyncBw,
        TestKind::PutLat,
        TestKind::PutBw,
        TestKind::Get,
        TestKind::AmLat,
        TestKind::AmBw,
        TestKind::StreamLat,
        TestKind::StreamBw,
    ];

    /// The name used by `-t` (the `ucx_perftest` name).
    pub fn name(self) -> &'static str {
        match self {
            TestKind::TagLat => "tag_lat",
            TestKind::TagBw => "tag_bw",
            TestKind::PutLat => "ucp_put_lat",
            TestKind::PutBw => "ucp_put_bw",
            TestKind::Get => "ucp_get",
            TestKind::AmLat => "am_lat",
            TestKind::AmBw => "am_bw",
            TestKind::TagSyncLat => "tag_sync_lat",
            TestKind::TagSyncBw => "tag_sync_bw",
            TestKind::StreamLat => "stream_lat",
            TestKind::StreamBw => "stream_bw",
        }
    }

    /// One line of description.
    pub fn describe(self) -> &'static str {
        match self {
            TestKind::TagLat => "UCP tag match latency (ping-pong, half round trip)",
            TestKind::TagBw => "UCP tag match bandwidth / message rate",
            TestKind::PutLat => "UCP put latency (ping-pong through remote memory)",
            TestKind::PutBw => "UCP put bandwidth / message rate",
            TestKind::Get => "UCP get latency / bandwidth / message rate",
            TestKind::AmLat => "UCP active message latency (ping-pong, half round trip)",
            TestKind::AmBw => "UCP active message bandwidth / message rate",
            TestKind::TagSyncLat => "UCP tag sync match latency (ping-pong, half round trip)",
            TestKind::TagSyncBw => "UCP tag sync match bandwidth / message rate",
            TestKind::StreamLat => "UCP stream latency (ping-pong, half round trip)",
            TestKind::StreamBw => "UCP stream bandwidth / message rate",
        }
    }

    /// True for ping-pong tests, whose per-iteration time is a round trip (reported halved).
    pub fn is_pingpong(self) -> bool {
        matches!(
            self,
            TestKind::TagLat
                | TestKind::TagSyncLat
                | TestKind::StreamLat
                | TestKind::PutLat
                | TestKind::AmLat
        )
    }

    /// True for tests that read and write the peer's memory (need a put/get lane).
    pub fn is_rma(self) -> bool {
        matches!(self, TestKind::PutLat | TestKind::PutBw | TestKind::Get)
    }

    /// Default iterations for a message size when `-n` is not given: 10000 for small
    /// messages, fewer for large ones (about 0.6 GiB per ping-pong run, 0.5 GiB per
    /// bandwidth run), never below 100.
    pub fn default_iters(self, size: usize) -> usize {
        let size = size.max(1);
        let budget: usize = if self.is_pingpong() {
            640 << 20
        } else {
            512 << 20
        };
        (budget / size).clamp(100, 10_000)
    }
}

impl fmt::Display for TestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TestKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        for k in TestKind::ALL {
            if k.name() == t {
                return Ok(k);
            }
        }
        match t.as_str() {
            "ucp_am_lat" => return Ok(TestKind::AmLat),
            "ucp_am_bw" => return Ok(TestKind::AmBw),
            "put_lat" => return Ok(TestKind::PutLat),
            "put_bw" => return Ok(TestKind::PutBw),
            "get" => return Ok(TestKind::Get),
            _ => {}
        }
        let known: Vec<&str> = TestKind::ALL.iter().map(|k| k.name()).collect();
        let why: String = match t.as_str() {
            "ucp_add" | "ucp_fadd" | "ucp_swap" | "ucp_cswap" | "add_lat" | "add_mr" | "fadd"
            | "swap" | "cswap" => "not available: rucx has no atomic operations".into(),
            "" => "empty test name".into(),
            _ => "unknown test".into(),
        };
        Err(format!("{s:?}: {why}; tests: {}", known.join(", ")))
    }
}

/// Bytes of distinct receive buffers of the bandwidth tests unless `--recv-ring` (at least a
/// buffer per request of the window): small enough for the caches to hold (with 64 KiB
/// messages it is the window's 16), large enough that a scope of small receives is not cut
/// short (a scope of 16 4 KiB receives ran at a third of the rate of 256: each scope ends
/// every receive before its buffers are lent again, and the messages that arrive meanwhile
/// wait as unexpected ones).
pub const DEFAULT_RECV_RING: usize = 1 << 20;

/// Parse one size with memory units (`8`, `4K`, `1M`, `4096b`).
pub fn parse_size(s: &str) -> Result<usize, String> {
    match rucx::ucs::units::parse_memunits(s) {
        Ok(rucx::ucs::MemUnits::Bytes(b)) => usize::try_from(b)
            .ok()
            .filter(|b| *b <= 1 << 40)
            .ok_or_else(|| format!("size {s:?} is too large (at most 1T)")),
        Ok(_) => Err(format!("size {s:?}: give a byte count, not inf or auto")),
        Err(e) => Err(format!("size {s:?}: {e} (e.g. 8, 4K, 1M)")),
    }
}

/// Parse a comma-separated size list: `8,4K,1M`.
pub fn parse_size_list(s: &str) -> Result<Vec<usize>, String> {
    if s.trim().is_empty() {
        return Err("empty size list (e.g. -s 8,4K,1M)".into());
    }
    s.split(',').map(parse_size).collect()
}

/// A parsed size list (a newtype, so clap takes it as one value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeList(pub Vec<usize>);

/// [`parse_size_list`] for clap.
pub fn size_list_arg(s: &str) -> Result<SizeList, String> {
    parse_size_list(s).map(SizeList)
}

/// Parse `-m send[,recv]`: memory types of the send and receive buffers.
pub fn parse_mem_types(s: &str) -> Result<(MemoryType, MemoryType), String> {
    let parts: Vec<&str> = s.split(',').collect();
    if parts.len() > 2 {
        return Err(format!(
            "-m {s:?}: give one memory type or two (send,recv), e.g. -m host or -m host,host"
        ));
    }
    let one = |p: &str| -> Result<MemoryType, String> {
        match p.trim().to_ascii_lowercase().as_str() {
            "host" => Ok(MemoryType::Host),
            "cuda" => Ok(MemoryType::Cuda),
            "cuda-managed" | "cuda_managed" => Ok(MemoryType::CudaManaged),
            other => Err(format!(
                "-m: unknown memory type {other:?}; accepted: host, cuda, cuda-managed"
            )),
        }
    };
    let send = one(parts[0])?;
    let recv = match parts.get(1) {
        Some(p) => one(p)?,
        None => send,
    };
    Ok((send, recv))
}

/// Output format.
/// How the sides wait between messages (`-E`, as `ucx_perftest -E`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WaitMode {
    /// Progress flat out.
    #[default]
    Poll,
    /// When a progress call finds nothing, sleep in `Worker::wait` until the worker's event
    /// descriptor is readable.
    Sleep,
}

impl WaitMode {
    /// The name on the command line and in control messages.
    pub fn name(self) -> &'static str {
        match self {
            WaitMode::Poll => "poll",
            WaitMode::Sleep => "sleep",
        }
    }
}

impl FromStr for WaitMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "poll" => Ok(WaitMode::Poll),
            "sleep" => Ok(WaitMode::Sleep),
            _ => Err(format!("unknown wait mode {s:?}; known: poll, sleep")),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The boxed table of `ucx_perftest`.
    Table,
    /// One header line and one line per size.
    Csv,
    /// One JSON document.
    Json,
}

/// The raw command line.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "rucx-perftest",
    about = "Measure rucx latency and bandwidth between two processes, like ucx_perftest.",
    after_help = "\
Server and client on two hosts:
  server:  rucx-perftest -p 13337
  client:  rucx-perftest SERVER-HOST -p 13337 -t tag_lat -s 8
Both sides as two local processes:
  rucx-perftest --local -t tag_bw -s 1M -O 16
OSU-style sweep with a plot:
  rucx-perftest --local --sweep --plot sweep.svg   (or sweep.png)
Transports are chosen like in any rucx program: RUCX_TLS=posix, RUCX_TLS=tcp, ...

Tests: tag_lat, tag_bw, tag_sync_lat, tag_sync_bw, stream_lat, stream_bw, ucp_put_lat,
ucp_put_bw, ucp_get, am_lat (alias ucp_am_lat), am_bw (alias ucp_am_bw). Not available:
atomics.
Unlike ucx_perftest, -s 8,4K,1M runs each size in turn (rucx has no scatter-gather sends).
Bandwidth is in MB/s of 2^20 bytes, as ucx_perftest prints it."
)]
pub struct Cli {
    /// Server host name (client mode); without it and without --local, run as the server.
    pub server: Option<String>,
    /// Test to run.
    #[arg(short = 't', default_value = "tag_lat", value_parser = TestKind::from_str)]
    pub test: TestKind,
    /// Message sizes, comma separated, with units: 8,4K,1M.
    #[arg(short = 's', value_parser = size_list_arg)]
    pub sizes: Option<SizeList>,
    /// Measured iterations per size (default: by size, 10000 for small messages).
    #[arg(short = 'n')]
    pub iters: Option<usize>,
    /// Warm-up iterations per size (default: a tenth of -n, at most 1000).
    #[arg(short = 'w')]
    pub warmup: Option<usize>,
    /// Outstanding window: requests in flight at once in bandwidth tests (default 16).
    #[arg(short = 'O')]
    pub window: Option<usize>,
    /// Wait mode: poll (progress flat out) or sleep (when progress finds nothing, sleep in
    /// Worker::wait until the worker's event descriptor is readable), as ucx_perftest -E.
    #[arg(short = 'E', default_value = "poll", value_parser = WaitMode::from_str)]
    pub wait: WaitMode,
    /// Memory type of the send buffer and optionally the receive buffer: host, cuda
    /// (each rank on GPU rank % device count: the server GPU 0, the client GPU 1). For
    /// ucp_put_*/ucp_get: the client's buffer, then the server's mapped region.
    #[arg(short = 'm', default_value = "host", value_parser = parse_mem_types)]
    pub mem: (MemoryType, MemoryType),
    /// With -m cuda: also time a pinned host->device copy, a device->pinned host copy and the
    /// GPU 0 -> GPU 1 peer copy at the largest size, and print the ratio of the measured
    /// bandwidth to each (latency tests: one copy at the smallest size, polled by an event,
    /// against the one-way latency).
    #[arg(long)]
    pub bounds: bool,
    /// Page-lock the host buffers of -m host,cuda / cuda,host (cuMemHostRegister), as an
    /// application with pinned host memory has them; without it they are pageable. Give it to
    /// both sides (--local does).
    #[arg(long)]
    pub pin_host: bool,
    /// Allocate host buffers from the heap. Without it they come from rucx
    /// (`Context::mem_alloc`: shared memory that a peer on this host copies with one plain
    /// copy), as ucx_perftest allocates its buffers through `ucp_mem_map`.
    #[arg(long)]
    pub heap_host: bool,
    /// Bandwidth tests (tag_bw, tag_sync_bw, stream_bw, ucp_get): receive into (get into) a
    /// ring of distinct buffers of at least SIZE bytes and at least one per request of the
    /// window (at most 1024 buffers, 256 MiB) [default: 1M]. ucx_perftest receives a window
    /// into one buffer, which stays in cache; a ring far larger than the caches (16M, the
    /// default before) measures how they hold the written data, not the transport.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub recv_ring: Option<usize>,
    /// TCP port of the rendezvous (the server listens there).
    #[arg(short = 'p', default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Run both sides on this machine as two processes (port: a free one unless -p is given).
    #[arg(long)]
    pub local: bool,
    /// Print CSV instead of the table.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// OSU-style sweep: tag_lat and tag_bw over 1 B..4 MiB (powers of two, or -s).
    #[arg(long)]
    pub sweep: bool,
    /// With --sweep: write the plot here (PNG when the name ends in .png, else SVG; default rucx-sweep.svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Server: address to listen on (default 0.0.0.0).
    #[arg(long, default_value = "0.0.0.0")]
    pub bind: String,
    /// Internal: this process is the server half of --local.
    #[arg(long, hide = true)]
    pub local_server: bool,
    /// Measure this machine's floors instead of rucx: a cache line bounced between two
    /// processes, single-core memcpy at 64K/1M/4M/64M, a loopback TCP stream (1 MiB writes)
    /// and a loopback TCP ping-pong at 8/256/4K/64K (a table, or --json).
    #[arg(long)]
    pub floors: bool,
    /// With --floors: fewer and shorter batches.
    #[arg(long, requires = "floors")]
    pub quick: bool,
    /// Internal: the second process of the cache-line floor, on this shared file.
    #[arg(long, hide = true)]
    pub floors_child: Option<PathBuf>,
}

/// What to run, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Server host (client mode).
    pub server: Option<String>,
    /// Port.
    pub port: u16,
    /// Whether -p was given.
    pub port_given: bool,
    /// Test.
    pub test: TestKind,
    /// Sizes.
    pub sizes: Vec<usize>,
    /// Iterations (None: per size default).
    pub iters: Option<usize>,
    /// Warm-up iterations (None: default).
    pub warmup: Option<usize>,
    /// Outstanding window.
    pub window: usize,
    /// How both sides wait between messages.
    pub wait: WaitMode,
    /// Send and receive memory types.
    pub mem: (MemoryType, MemoryType),
    /// Measure the GPU copy bounds (bandwidth at the largest size; latency tests: one copy's
    /// latency at the smallest).
    pub bounds: bool,
    /// Page-lock host buffers (`--pin-host`).
    pub pin_host: bool,
    /// Host buffers from the heap, not from `Context::mem_alloc` (`--heap-host`).
    pub heap_host: bool,
    /// Bytes of the bandwidth tests' receive ring, which holds at least a buffer per request
    /// of the window (`--recv-ring`, default [`DEFAULT_RECV_RING`]).
    pub recv_ring: usize,
    /// Run both sides locally.
    pub local: bool,
    /// Output format.
    pub format: Format,
    /// Sweep mode.
    pub sweep: bool,
    /// Plot path for sweeps.
    pub plot: PathBuf,
    /// Progress lines.
    pub progress: bool,
    /// Server listen address.
    pub bind: String,
    /// Internal server half of --local.
    pub local_server: bool,
    /// Measure the floors (`--floors`), quick or not, instead of a test.
    pub floors: Option<crate::floors::Effort>,
}

impl Options {
    /// Iterations for `size` (explicit `-n` or the per-size default).
    pub fn iters_for(&self, test: TestKind, size: usize) -> usize {
        self.iters.unwrap_or_else(|| test.default_iters(size))
    }

    /// Warm-up iterations for `size`.
    pub fn warmup_for(&self, test: TestKind, size: usize) -> usize {
        self.warmup
            .unwrap_or_else(|| (self.iters_for(test, size) / 10).min(1000))
    }

    /// True when this process is the server side.
    pub fn is_server(&self) -> bool {
        self.local_server || (self.server.is_none() && !self.local)
    }
}

/// Parse and validate a command line (`args[0]` is the program name).
pub fn parse<I, T>(args: I) -> Result<Options, String>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let port_given = args.iter().skip(1).any(|a| {
        let a = a.to_string_lossy();
        a == "-p" || (a.starts_with("-p") && a.len() > 2 && !a.starts_with("--"))
    });
    let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
    validate(cli, port_given)
}

/// Turn a parsed command line into options, rejecting combinations that cannot run.
pub fn validate(cli: Cli, port_given: bool) -> Result<Options, String> {
    let (send, recv) = cli.mem;
    for (side, m) in [("send", send), ("receive", recv)] {
        if m == MemoryType::CudaManaged {
            return Err(format!(
                "-m: {side} memory {m}: not supported by rucx-perftest (managed memory \
                 migrates on access, which would time the page migration; use -m cuda)"
            ));
        }
    }
    let gpu = send == MemoryType::Cuda || recv == MemoryType::Cuda;
    // A server learns the memory types from the client's spec: its --pin-host applies to the
    // host buffers of whatever the client asks for.
    let server_side = cli.local_server || (cli.server.is_none() && !cli.local);
    if cli.pin_host && !gpu && !server_side {
        return Err(
            "--pin-host page-locks host buffers through CUDA: give -m host,cuda or cuda,host"
                .into(),
        );
    }
    if cli.bounds && !gpu {
        return Err(
            "--bounds measures GPU copy bounds: give -m cuda (or host,cuda / cuda,host)".into(),
        );
    }
    if cli.floors && (cli.csv || cli.sweep || cli.server.is_some() || cli.local_server) {
        return Err(
            "--floors measures this machine alone: give it alone (with --json or --quick)".into(),
        );
    }
    if cli.local && cli.server.is_some() {
        return Err("--local runs both sides here; do not give a server host too".into());
    }
    if let Some(0) = cli.iters {
        return Err("-n: at least one iteration".into());
    }
    if let Some(0) = cli.window {
        return Err("-O: the window must be at least 1".into());
    }
    let window = cli.window.unwrap_or(16);
    if window > 4096 {
        return Err(format!("-O {window}: at most 4096 requests in flight"));
    }
    let sizes = match (&cli.sizes, cli.sweep) {
        (Some(s), _) => s.0.clone(),
        (None, true) => sweep_sizes(),
        (None, false) => vec![8],
    };
    if sizes.contains(&0) && cli.test.is_rma() && !cli.sweep {
        return Err(format!(
            "-s: {} needs messages of at least 1 byte",
            cli.test.name()
        ));
    }
    if cli.plot.is_some() && !cli.sweep {
        return Err("--plot draws a --sweep; add --sweep".into());
    }
    let format = if cli.csv {
        Format::Csv
    } else if cli.json {
        Format::Json
    } else {
        Format::Table
    };
    Ok(Options {
        server: cli.server,
        port: cli.port,
        port_given,
        test: cli.test,
        sizes,
        iters: cli.iters,
        warmup: cli.warmup,
        window,
        mem: cli.mem,
        bounds: cli.bounds,
        pin_host: cli.pin_host,
        heap_host: cli.heap_host,
        recv_ring: cli.recv_ring.unwrap_or(DEFAULT_RECV_RING),
        local: cli.local,
        format,
        sweep: cli.sweep,
        plot: cli.plot.unwrap_or_else(|| PathBuf::from("rucx-sweep.svg")),
        progress: !cli.quiet,
        bind: cli.bind,
        local_server: cli.local_server,
        wait: cli.wait,
        floors: cli.floors.then_some(if cli.quick {
            crate::floors::Effort::QUICK
        } else {
            crate::floors::Effort::FULL
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(args: &[&str]) -> Result<Options, String> {
        let mut v = vec!["rucx-perftest"];
        v.extend_from_slice(args);
        parse(v)
    }

    #[test]
    fn size_lists_with_units() {
        assert_eq!(parse_size_list("8,4K,1M").unwrap(), vec![8, 4096, 1 << 20]);
        assert_eq!(parse_size_list("0").unwrap(), vec![0]);
        assert_eq!(parse_size_list(" 16 , 2k").unwrap(), vec![16, 2048]);
        for bad in [
            "",
            "8,",
            "x",
            "4Q",
            "inf",
            "auto",
            "8,,16",
            "-1",
            "99999999T",
        ] {
            let e = parse_size_list(bad).unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
        let e = parse_size_list("8,4Q").unwrap_err();
        assert!(e.contains("4Q"), "{e}");
    }

    #[test]
    fn memory_types() {
        use MemoryType::*;
        assert_eq!(parse_mem_types("host").unwrap(), (Host, Host));
        assert_eq!(parse_mem_types("host,cuda").unwrap(), (Host, Cuda));
        assert_eq!(parse_mem_types("CUDA").unwrap(), (Cuda, Cuda));
        assert_eq!(parse_mem_types("cuda,host").unwrap(), (Cuda, Host));
        assert_eq!(parse_mem_types(" cuda , cuda ").unwrap(), (Cuda, Cuda));
        let e = parse_mem_types("rocm").unwrap_err();
        assert!(e.contains("rocm") && e.contains("host, cuda"), "{e}");
        assert!(parse_mem_types("host,host,host").is_err());
        assert!(parse_mem_types("").is_err());
        assert!(parse_mem_types("cuda,").is_err());
        assert_eq!(p(&["-m", "host,host"]).unwrap().mem, (Host, Host));
        // GPU memory: accepted for the tag tests (the driver is checked when the job starts).
        for (m, want) in [
            ("cuda", (Cuda, Cuda)),
            ("cuda,cuda", (Cuda, Cuda)),
            ("host,cuda", (Host, Cuda)),
            ("cuda,host", (Cuda, Host)),
        ] {
            for t in ["tag_lat", "tag_bw"] {
                let o = p(&["--local", "-m", m, "-t", t]).unwrap();
                assert_eq!(o.mem, want, "{m} {t}");
                assert!(!o.bounds);
            }
        }
        assert!(p(&["--local", "-m", "cuda", "--sweep"]).is_ok());
        let e = p(&["-m", "cuda-managed"]).unwrap_err();
        assert!(e.contains("managed") && e.contains("use -m cuda"), "{e}");
        // Put and get take GPU memory on either side (the client's buffer is the first type,
        // the server's mapped region the second).
        for m in ["cuda", "host,cuda", "cuda,host"] {
            for t in ["ucp_put_lat", "ucp_put_bw", "ucp_get"] {
                let o = p(&["--local", "-m", m, "-t", t, "--bounds"]).unwrap();
                assert!(o.bounds && o.test.is_rma(), "{m} {t}");
            }
        }
        // Host memory keeps every test.
        for t in TestKind::ALL {
            assert!(p(&["-m", "host", "-t", t.name()]).is_ok(), "{t}");
        }
    }

    #[test]
    fn bounds_need_gpu_memory() {
        let o = p(&["--local", "-m", "cuda", "-t", "tag_bw", "--bounds"]).unwrap();
        assert!(o.bounds);
        assert!(p(&["-m", "host,cuda", "--bounds"]).unwrap().bounds);
        let e = p(&["--local", "--bounds"]).unwrap_err();
        assert!(e.contains("--bounds") && e.contains("-m cuda"), "{e}");
        assert!(p(&["-m", "host,cuda", "--pin-host"]).unwrap().pin_host);
        assert!(!p(&["-m", "host,cuda"]).unwrap().pin_host);
        let e = p(&["--local", "--pin-host"]).unwrap_err();
        assert!(e.contains("--pin-host") && e.contains("host,cuda"), "{e}");
        // A server (the half --local starts, or one started by hand) learns the memory types
        // from the client: its --pin-host needs no -m.
        assert!(p(&["--local-server", "--pin-host"]).unwrap().pin_host);
        assert!(p(&["--pin-host"]).unwrap().pin_host);
    }

    #[test]
    fn tests_by_name_and_missing_ones_explained() {
        for k in TestKind::ALL {
            assert_eq!(k.name().parse::<TestKind>().unwrap(), k);
        }
        assert_eq!("ucp_am_lat".parse::<TestKind>().unwrap(), TestKind::AmLat);
        assert_eq!(
            "tag_sync_lat".parse::<TestKind>().unwrap(),
            TestKind::TagSyncLat
        );
        assert_eq!("stream_bw".parse::<TestKind>().unwrap(), TestKind::StreamBw);
        let e = "ucp_add".parse::<TestKind>().unwrap_err();
        assert!(e.contains("atomic"), "{e}");
        let e = "bogus".parse::<TestKind>().unwrap_err();
        assert!(e.contains("unknown test") && e.contains("tag_lat"), "{e}");
        // Streams and active messages take GPU memory.
        for t in ["stream_lat", "stream_bw", "am_lat", "am_bw"] {
            for m in ["cuda", "host,cuda", "cuda,host"] {
                assert!(p(&["-t", t, "-m", m]).is_ok(), "{t} -m {m}");
            }
        }
    }

    #[test]
    fn modes_and_defaults() {
        let o = p(&[]).unwrap();
        assert!(o.is_server() && o.port == DEFAULT_PORT && !o.port_given);
        assert_eq!(
            (o.test, o.sizes.clone(), o.window),
            (TestKind::TagLat, vec![8], 16)
        );
        let o = p(&[
            "host1", "-p", "2000", "-t", "tag_bw", "-s", "1M", "-n", "20", "-O", "4",
        ])
        .unwrap();
        assert!(!o.is_server() && o.port_given && o.port == 2000);
        assert_eq!(o.server.as_deref(), Some("host1"));
        assert_eq!((o.iters_for(o.test, 1 << 20), o.window), (20, 4));
        assert_eq!(o.warmup_for(o.test, 1 << 20), 2);
        let o = p(&["--local", "--sweep"]).unwrap();
        assert_eq!(o.sizes.len(), 23);
        assert_eq!(*o.sizes.last().unwrap(), 4 << 20);
        assert!(!o.is_server());
        assert_eq!(p(&["--local", "--csv"]).unwrap().format, Format::Csv);
        assert_eq!(p(&["--local", "--json"]).unwrap().format, Format::Json);
        assert!(p(&["--local", "--json", "--csv"]).is_err());
        assert!(p(&["--local", "h"]).unwrap_err().contains("--local"));
        assert!(p(&["-n", "0"]).unwrap_err().contains("-n"));
        assert!(p(&["-O", "0"]).unwrap_err().contains("-O"));
        assert!(p(&["-n", "x"]).is_err());
        assert!(p(&["-p", "70000"]).is_err());
        assert!(p(&["--plot", "a.svg"]).unwrap_err().contains("--sweep"));
        assert!(p(&["-t", "ucp_put_bw", "-s", "0"]).is_err());
        assert_eq!(
            p(&["--floors"]).unwrap().floors,
            Some(crate::floors::Effort::FULL)
        );
        let o = p(&["--floors", "--quick", "--json"]).unwrap();
        assert_eq!(
            (o.floors, o.format),
            (Some(crate::floors::Effort::QUICK), Format::Json)
        );
        assert!(p(&["--quick"]).is_err());
        assert!(p(&["--floors", "--csv"]).unwrap_err().contains("--floors"));
        assert!(p(&["--floors", "host1"]).unwrap_err().contains("--floors"));
        assert_eq!(p(&[]).unwrap().floors, None);
    }

    #[test]
    fn default_iterations_shrink_with_size() {
        assert_eq!(TestKind::TagLat.default_iters(8), 10_000);
        assert!(TestKind::TagBw.default_iters(4 << 20) < 200);
        assert_eq!(TestKind::TagBw.default_iters(1 << 40), 100);
        assert_eq!(TestKind::TagBw.default_iters(0), 10_000);
    }

    proptest! {
        #[test]
        fn size_lists_round_trip(v in proptest::collection::vec(0usize..(1 << 30), 1..8)) {
            let text: Vec<String> = v
                .iter()
                .map(|b| rucx::ucs::units::format_bytes(*b as u64))
                .collect();
            prop_assert_eq!(parse_size_list(&text.join(",")).unwrap(), v);
        }

        #[test]
        fn size_parser_never_panics(s in ".{0,12}") {
            let _ = parse_size_list(&s);
            let _ = parse_mem_types(&s);
            let _ = s.parse::<TestKind>();
        }
    }
}
