//! Launching: a job of N processes finds its peers.
//!
//! Rank and size come from the launcher's environment, in this order: `RUCX_RANK`/`RUCX_SIZE`,
//! Open MPI (`OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`), PMI (`PMI_RANK`/`PMI_SIZE`),
//! Slurm (`SLURM_PROCID`/`SLURM_NTASKS`); none of them means a job of one.
//!
//! The processes meet at a rendezvous address, `RUCX_BOOTSTRAP=host:port` (in the spirit of
//! `MASTER_ADDR`): rank 0 listens there (on that address only), the others connect, every rank
//! sends its worker address and receives everybody's. When every rank of an Open MPI or PMIx job
//! runs on one host and `RUCX_BOOTSTRAP` is unset, a loopback port derived from the job id is
//! used, so `mpirun -np 2 ./app` works as is.
//!
//! # Who may join
//! With a job key (`RUCX_BOOTSTRAP_KEY`, the same secret for every rank; [`generate_key`] makes
//! one) rank 0 and each joining rank prove the key to each other by challenge-response
//! (HMAC-SHA256 over fresh nonces, the claimed rank and size, and the joining rank's address)
//! before any address is given out, and the table of addresses is tagged for each connection.
//! Without a key anything that reaches the port can join in a rank's place; a warning says so
//! once. No launcher gives rucx a secret to derive a key from: Open MPI and PMIx job ids
//! (`OMPI_MCA_ess_base_jobid`, `PMIX_NAMESPACE`) and `SLURM_JOB_ID` are visible to other users
//! and guessable, so they only choose the derived port, never a key. Export a key yourself, e.g.
//! `export RUCX_BOOTSTRAP_KEY=$(openssl rand -hex 32)` before `mpirun -x RUCX_BOOTSTRAP_KEY` or
//! `srun` (pass it by name, never on a command line, which every user can read). The threat
//! model is in `docs/security.md`.
//!
//! # Robustness
//! Rank 0 serves the handshakes side by side (`server`): a bounded number at once, each with a
//! deadline; a malformed, foreign, unauthenticated, out-of-range or duplicate join is logged and
//! dropped and never ends the job (for a duplicate rank, the first authenticated one stays). A
//! joining rank whose connection is dropped before rank 0's verdict connects again until
//! `RUCX_BOOTSTRAP_TIMEOUT` (`client`), so a flood of connections cannot keep it out. The wire
//! format is in `wire`.
//!
//! The bootstrap connection stays open for [`Job::barrier`].

mod client;
mod server;
mod wire;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Once;
use std::time::{Duration, Instant};

pub use wire::Key;

use rucx_ucp::{Context, EpId, Worker};
use rucx_ucs::{Bounds, Config, Error, OptKind, OptionSpec, Result, Syntax};

/// Launcher options.
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "BOOTSTRAP",
        kind: OptKind::Str,
        default: "",
        help: "host:port where rank 0 listens and the other ranks connect to exchange worker \
               addresses (like MASTER_ADDR:MASTER_PORT). Empty: derived for single-host MPI jobs.",
    },
    OptionSpec {
        name: "BOOTSTRAP_TIMEOUT",
        kind: OptKind::TimeIn(Bounds::new(1_000_000, u64::MAX).or_inf()),
        default: "60s",
        help: "How long ranks wait for each other at start-up and in barriers.",
    },
    OptionSpec {
        name: "BOOTSTRAP_KEY",
        kind: OptKind::Secret,
        default: "",
        help: "A secret shared by the ranks of one job (at least 16 characters; e.g. 32 random \
               bytes in hex). Rank 0 and each joining rank prove it to each other \
               (HMAC-SHA256 challenge-response) before any worker address is given out. Empty: \
               the rendezvous is unauthenticated (a warning says so). See docs/security.md.",
    },
    OptionSpec {
        name: "RANK",
        kind: OptKind::Text(Syntax {
            check: check_rank,
            accepted: "empty, or a rank from 0 to 1048575",
        }),
        default: "",
        help: "This process's rank, when no launcher sets one (with RUCX_SIZE).",
    },
    OptionSpec {
        name: "SIZE",
        kind: OptKind::Text(Syntax {
            check: check_size,
            accepted: "empty, or a job size from 1 to 1048576",
        }),
        default: "",
        help: "Number of processes in the job, when no launcher sets it (with RUCX_RANK).",
    },
];

/// Largest job the bootstrap serves: rank 0 holds one connection per rank, and every rank a
/// table of every rank's address, so a size is bounded before anything is allocated for it.
pub const MAX_JOB_SIZE: usize = 1 << 20;

fn parse_count(s: &str) -> std::result::Result<Option<u64>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    s.parse::<u64>()
        .map(Some)
        .map_err(|_| format!("{s:?} is not a non-negative integer"))
}

fn check_rank(s: &str) -> std::result::Result<(), String> {
    match parse_count(s)? {
        Some(r) if r >= MAX_JOB_SIZE as u64 => Err(format!("rank {r} is out of range")),
        _ => Ok(()),
    }
}

fn check_size(s: &str) -> std::result::Result<(), String> {
    match parse_count(s)? {
        Some(n) if n == 0 || n > MAX_JOB_SIZE as u64 => {
            Err(format!("a job of {n} ranks is out of range"))
        }
        _ => Ok(()),
    }
}

/// Where rank and size came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
    /// Which launcher variables set them.
    pub source: &'static str,
    /// True when every rank is known to run on this host.
    pub all_local: bool,
    /// A job identifier shared by all ranks, when the launcher gives one.
    pub job_id: Option<String>,
}

fn num(vars: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match vars(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| Error::Config {
                var: name.into(),
                value: v,
                reason: "not a non-negative integer".into(),
                accepted: "a number".into(),
            }),
    }
}

/// Read rank and size from launcher variables (`vars` looks one up).
pub fn placement(vars: &dyn Fn(&str) -> Option<String>) -> Result<Placement> {
    const SOURCES: [(&str, &str, &str); 4] = [
        ("RUCX_RANK", "RUCX_SIZE", "RUCX_RANK/RUCX_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
        ("PMI_RANK", "PMI_SIZE", "PMI"),
        ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
    ];
    for (r, s, source) in SOURCES {
        match (num(vars, r)?, num(vars, s)?) {
            (Some(rank), Some(size)) => {
                if size == 0 || size > MAX_JOB_SIZE {
                    return Err(Error::Config {
                        var: s.into(),
                        value: size.to_string(),
                        reason: format!("a job of {size} ranks is out of range"),
                        accepted: format!("1 to {MAX_JOB_SIZE}"),
                    });
                }
                if rank >= size {
                    return Err(Error::Config {
                        var: r.into(),
                        value: rank.to_string(),
                        reason: format!("rank {rank} is not below the job size {size} ({s})"),
                        accepted: format!("0..{size}"),
                    });
                }
                let local = num(vars, "OMPI_COMM_WORLD_LOCAL_SIZE")?
                    .or(num(vars, "SLURM_NTASKS_PER_NODE")?)
                    .or(num(vars, "MPI_LOCALNRANKS")?);
                let job_id = ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID"]
                    .iter()
                    .find_map(|v| vars(v));
                return Ok(Placement {
                    rank,
                    size,
                    source,
                    all_local: local == Some(size),
                    job_id,
                });
            }
            (None, None) => continue,
            (Some(_), None) | (None, Some(_)) => {
                return Err(Error::Config {
                    var: format!("{r}/{s}"),
                    value: String::new(),
                    reason: "only one of the pair is set".into(),
                    accepted: "both or neither".into(),
                });
            }
        }
    }
    Ok(Placement {
        rank: 0,
        size: 1,
        source: "no launcher (a job of one)",
        all_local: true,
        job_id: None,
    })
}

/// The rendezvous address for a placement.
pub fn rendezvous(p: &Placement, configured: &str) -> Result<Option<SocketAddr>> {
    if p.size == 1 {
        return Ok(None);
    }
    if !configured.trim().is_empty() {
        let addr = configured
            .trim()
            .to_socket_addrs()
            .map_err(|e| Error::Config {
                var: "RUCX_BOOTSTRAP".into(),
                value: configured.into(),
                reason: e.to_string(),
                accepted: "host:port, e.g. 10.0.0.1:29500 or node001:29500".into(),
            })?
            .next()
            .ok_or_else(|| Error::Config {
                var: "RUCX_BOOTSTRAP".into(),
                value: configured.into(),
                reason: "resolves to no address".into(),
                accepted: "host:port".into(),
            })?;
        return Ok(Some(addr));
    }
    match (&p.job_id, p.all_local) {
        (Some(id), true) => {
            let h = rucx_uct::rkey::fnv1a32(id.as_bytes());
            let (lo, hi) = quiet_ports(ephemeral_ports());
            let port = lo + (h % u32::from(hi - lo)) as u16;
            Ok(Some(SocketAddr::from(([127, 0, 0, 1], port))))
        }
        _ => Err(Error::Config {
            var: "RUCX_BOOTSTRAP".into(),
            value: String::new(),
            reason: format!(
                "a job of {} ranks ({}) needs a rendezvous address where rank 0 listens",
                p.size, p.source
            ),
            accepted: "host:port reachable from every rank, e.g. RUCX_BOOTSTRAP=node001:29500"
                .into(),
        }),
    }
}

/// The kernel's range of ephemeral ports (`/proc/sys/net/ipv4/ip_local_port_range`), from
/// which it picks the local port of every outgoing connection and of every listener bound to
/// port 0; Linux's default when the file cannot be read.
fn ephemeral_ports() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| parse_port_range(&s))
        .unwrap_or((32768, 60999))
}

fn parse_port_range(s: &str) -> Option<(u16, u16)> {
    let mut it = s.split_whitespace().map(|w| w.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi).then_some((lo, hi))
}

/// Ports a rendezvous of this host can take that the kernel never hands out on its own: a
/// range of at least 1000 ports outside the ephemeral range `eph`, from 20000 below it when
/// there is room, else above it (`[lo, hi)`). A port chosen in the ephemeral range can be given
/// to some other program's connection between the choice and rank 0's bind (a busy host, a
/// parallel test suite): rank 0 then cannot listen and the job fails.
fn quiet_ports(eph: (u16, u16)) -> (u16, u16) {
    const FROM: u16 = 20000;
    if eph.0 >= FROM + 1000 {
        (FROM, eph.0)
    } else if eph.1 <= 64535 {
        (eph.1.max(FROM) + 1, 65535)
    } else {
        // Everything is ephemeral: nothing is quiet; the old range, and rank 0's error says so.
        (FROM, FROM + 20000)
    }
}

/// A free port on `127.0.0.1` for the rendezvous (`RUCX_BOOTSTRAP=127.0.0.1:PORT`) of a job
/// whose ranks a program starts on this host itself (tests, `rucx-perftest --local`, a
/// launcher of one's own). Chosen at random outside the kernel's ephemeral range, so that no
/// outgoing connection or port-0 listener is handed it before rank 0 binds it (a port found by
/// binding port 0 is free only until the listener is dropped), and checked free now.
pub fn local_port() -> Result<u16> {
    let (lo, hi) = quiet_ports(ephemeral_ports());
    let mut last = None;
    for _ in 0..64 {
        let mut b = [0u8; 2];
        getrandom::fill(&mut b)
            .map_err(|e| Error::Internal(format!("no random numbers for a port: {e}")))?;
        let port = lo + (u16::from_le_bytes(b) % (hi - lo));
        match std::net::TcpListener::bind(("127.0.0.1", port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(Error::io(
        format!("bootstrap: no free port on 127.0.0.1 in {lo}..{hi} after 64 tries"),
        last.unwrap_or_else(|| std::io::Error::other("no port tried")),
    ))
}

fn io(ctx: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(ctx.to_string(), e)
}

/// Exchange worker addresses; returns every rank's address and the open connections (rank 0:
/// one per other rank; others: one to rank 0).
fn exchange(
    p: &Placement,
    at: SocketAddr,
    mine: &[u8],
    key: Option<&Key>,
    timeout: Duration,
) -> Result<(Vec<Vec<u8>>, Vec<TcpStream>)> {
    if key.is_none() {
        static UNAUTHENTICATED: Once = Once::new();
        UNAUTHENTICATED.call_once(|| {
            tracing::warn!(
                "bootstrap at {at} is unauthenticated (no RUCX_BOOTSTRAP_KEY): any process that \
                 can reach it can join in a rank's place and learn the ranks' addresses; set the \
                 same random key for every rank (see docs/security.md)"
            )
        });
    }
    if p.rank == 0 {
        let l = server::listen(at).map_err(|e| {
            Error::io(
                format!(
                    "bootstrap: rank 0 cannot listen on {at} (RUCX_BOOTSTRAP); is the port free?"
                ),
                e,
            )
        })?;
        server::serve(p, &l, mine, key, timeout, server::LIMITS)
    } else {
        let (table, s) = client::join(p, at, mine, key, timeout, server::LIMITS)?;
        Ok((table, vec![s]))
    }
}

/// A fresh job key for `RUCX_BOOTSTRAP_KEY`: 32 random bytes as 64 hexadecimal digits.
pub fn generate_key() -> Result<String> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b)
        .map_err(|e| Error::Internal(format!("no random numbers for a job key: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// A running job: this rank's worker and an endpoint to every rank.
#[derive(Debug)]
pub struct Job {
    placement: Placement,
    ctx: Context,
    worker: Worker,
    /// Endpoints to the other ranks by rank (`None` at this rank's own place: see `self_ep`).
    eps: Vec<Option<EpId>>,
    /// The endpoint to this rank itself, made when first asked for: over a transport without
    /// a loopback of its own (`RUCX_TLS=tcp`: a loopback connection, two more sockets that
    /// every progress call looks at) a job that never sends to itself pays nothing for it.
    self_ep: std::cell::OnceCell<EpId>,
    /// This worker's address, for `self_ep`.
    self_addr: Vec<u8>,
    conns: Vec<TcpStream>,
    timeout: Duration,
    /// A barrier that timed out part-way: which ranks' arrivals rank 0 has seen, and whether
    /// this rank announced its own, so the next attempt neither waits for nor sends them again.
    barrier_state: std::cell::RefCell<(Vec<bool>, bool)>,
}

/// Connect `worker` to the worker at `addr`, rank `rank` of the job.
fn connect_rank(worker: &Worker, addr: &[u8], rank: usize) -> Result<EpId> {
    worker.connect(addr).map_err(|e| match e {
        Error::Unsupported { what, why } => Error::Unsupported {
            what: format!("{what} (rank {rank})"),
            why,
        },
        other => other,
    })
}

impl Job {
    /// Start from the environment: configuration, context, worker, bootstrap, endpoints.
    pub fn from_env() -> Result<Job> {
        let cfg = crate::config_from_env()?;
        let vars = |n: &str| std::env::var(n).ok();
        let p = placement(&vars)?;
        Self::start(cfg, p)
    }

    /// Start with an explicit configuration and placement.
    pub fn start(cfg: Config, p: Placement) -> Result<Job> {
        let at = rendezvous(&p, cfg.string("BOOTSTRAP"))?;
        let timeout = cfg.time("BOOTSTRAP_TIMEOUT");
        let key = Key::from_text(cfg.string("BOOTSTRAP_KEY"));
        let ctx = crate::context(cfg)?;
        let worker = Worker::new(&ctx)?;
        let (table, conns) = match at {
            Some(at) => exchange(&p, at, &worker.address(), key.as_ref(), timeout)?,
            None => (vec![worker.address()], Vec::new()),
        };
        let mut eps = Vec::with_capacity(p.size);
        for (r, a) in table.iter().enumerate() {
            if r == p.rank {
                eps.push(None);
                continue;
            }
            eps.push(Some(connect_rank(&worker, a, r)?));
        }
        let self_addr = worker.address();
        let job = Job {
            placement: p,
            ctx,
            worker,
            eps,
            self_ep: std::cell::OnceCell::new(),
            self_addr,
            conns,
            timeout,
            barrier_state: std::cell::RefCell::new((Vec::new(), false)),
        };
        // Make sure every rank's endpoints exist before anyone sends.
        job.barrier()?;
        Ok(job)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.placement.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.placement.size
    }

    /// Where rank and size came from.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The worker.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Endpoint to `rank` (to itself for this rank: made at the first call, see
    /// [`try_ep`](Self::try_ep)).
    ///
    /// # Panics
    /// When `rank` is not below [`size`](Self::size), or this rank's endpoint to itself is
    /// asked for the first time and cannot be made (no transport reaches this process itself);
    /// [`try_ep`](Self::try_ep) returns that error instead.
    pub fn ep(&self, rank: usize) -> EpId {
        self.try_ep(rank)
            .unwrap_or_else(|e| panic!("endpoint of rank {} to rank {rank}: {e}", self.rank()))
    }

    /// Endpoint to `rank`. The endpoints to the other ranks are made by [`start`](Self::start);
    /// the one to this rank itself when first asked for (a job whose ranks never send to
    /// themselves has none), which fails when no transport reaches this process itself.
    pub fn try_ep(&self, rank: usize) -> Result<EpId> {
        match self.eps.get(rank) {
            Some(Some(ep)) => Ok(*ep),
            Some(None) => {
                if let Some(ep) = self.self_ep.get() {
                    return Ok(*ep);
                }
                let ep = connect_rank(&self.worker, &self.self_addr, rank)?;
                Ok(*self.self_ep.get_or_init(|| ep))
            }
            None => Err(Error::InvalidParam(format!(
                "rank {rank} of a job of {} ranks",
                self.eps.len()
            ))),
        }
    }

    /// The rank behind an endpoint of this job's worker (e.g. a receive's
    /// [`Completion::sender`](rucx_ucp::Completion::sender)); `None` for an endpoint that is not
    /// one of the job's (a peer connected otherwise).
    pub fn rank_of(&self, ep: EpId) -> Option<usize> {
        // The only `None` is this rank's own place.
        self.eps
            .iter()
            .position(|e| e.or_else(|| self.self_ep.get().copied()) == Some(ep))
    }

    /// Wait until every rank reached the barrier, progressing the worker meanwhile; fails with
    /// [`Error::Timeout`] after `RUCX_BOOTSTRAP_TIMEOUT` (see
    /// [`barrier_timeout`](Self::barrier_timeout) for a limit of its own).
    pub fn barrier(&self) -> Result<()> {
        self.barrier_timeout(self.timeout)
    }

    /// [`barrier`](Self::barrier) with its own limit (`Duration::MAX`: none), for a rank that
    /// knows the others may take longer than the bootstrap timeout (long work alone) or that
    /// wants to give up sooner. After a barrier timed out, the next one continues it (the ranks
    /// that arrived are still waiting in theirs): nothing is counted or announced twice.
    pub fn barrier_timeout(&self, limit: Duration) -> Result<()> {
        if self.placement.size == 1 {
            return Ok(());
        }
        let deadline = Instant::now().checked_add(limit);
        let poll = |s: &TcpStream| -> Result<bool> {
            s.set_nonblocking(true).map_err(io("barrier"))?;
            let mut b = [0u8; 1];
            let r = (&*s).read(&mut b);
            s.set_nonblocking(false).map_err(io("barrier"))?;
            match r {
                Ok(1) => Ok(true),
                Ok(_) => Err(Error::EndpointFailure {
                    peer: "bootstrap".into(),
                    reason: "a rank left the job during a barrier".into(),
                }),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
                Err(e) => Err(Error::io("barrier", e)),
            }
        };
        let wait = |s: &TcpStream| -> Result<()> {
            loop {
                if poll(s)? {
                    return Ok(());
                }
                if deadline.is_some_and(|d| Instant::now() > d) {
                    return Err(Error::Timeout {
                        after: limit,
                        what: "the other ranks to reach a barrier".into(),
                    });
                }
                self.worker.progress();
            }
        };
        let mut state = self.barrier_state.borrow_mut();
        let (arrived, announced) = &mut *state;
        if self.placement.rank == 0 {
            arrived.resize(self.conns.len(), false);
            for (c, seen) in self.conns.iter().zip(arrived.iter_mut()) {
                if !*seen {
                    wait(c)?;
                    *seen = true;
                }
            }
            for c in &self.conns {
                (&*c).write_all(&[1]).map_err(io("barrier"))?;
            }
            arrived.clear();
        } else {
            if !*announced {
                (&self.conns[0]).write_all(&[1]).map_err(io("barrier"))?;
                *announced = true;
            }
            wait(&self.conns[0])?;
            *announced = false;
        }
        Ok(())
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Leave together: no rank closes its connections while another still runs.
        self.worker.set_closing();
        // Unless a peer failed (died, or stopped answering within RUCX_PEER_TIMEOUT): it would
        // never reach the barrier, and a frozen one would hold it for the whole bootstrap
        // timeout. The others see this rank's connection close and leave the barrier too.
        if let Some(r) = (0..self.eps.len())
            .find(|&r| self.eps[r].is_some_and(|ep| self.worker.ep_error(ep).is_some()))
        {
            tracing::debug!("final barrier skipped: the endpoint to rank {r} failed");
            return;
        }
        if let Err(e) = self.barrier() {
            tracing::debug!("final barrier: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(v: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = v
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        move |n| m.get(n).cloned()
    }

    #[test]
    fn launchers_are_recognized_in_order() {
        let p = placement(&vars(&[])).unwrap();
        assert_eq!((p.rank, p.size), (0, 1));
        let p = placement(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "job7"),
        ]))
        .unwrap();
        assert_eq!(
            (p.rank, p.size, p.source, p.all_local),
            (1, 2, "Open MPI", true)
        );
        let p = placement(&vars(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")])).unwrap();
        assert_eq!((p.rank, p.size, p.source), (3, 4, "Slurm"));
        let p = placement(&vars(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "8"),
            ("RUCX_RANK", "2"),
            ("RUCX_SIZE", "3"),
        ]))
        .unwrap();
        assert_eq!((p.rank, p.size), (2, 3));
    }

    #[test]
    fn bad_placements_are_clear_errors() {
        let e = placement(&vars(&[("RUCX_RANK", "2"), ("RUCX_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("not below the job size"), "{e}");
        let e = placement(&vars(&[("RUCX_RANK", "x"), ("RUCX_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RUCX_RANK"), "{e}");
        let e = placement(&vars(&[("RUCX_RANK", "1")])).unwrap_err();
        assert!(e.to_string().contains("only one"), "{e}");
        // A huge size is a clear error, before anything is allocated for it.
        for (r, s) in [("RUCX_RANK", "RUCX_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")] {
            let e = placement(&vars(&[(r, "0"), (s, "4000000000")])).unwrap_err();
            assert!(
                e.to_string().contains(s) && e.to_string().contains("1 to 1048576"),
                "{e}"
            );
            let e = placement(&vars(&[(r, "0"), (s, "0")])).unwrap_err();
            assert!(e.to_string().contains(s), "{e}");
        }
    }

    #[test]
    fn rendezvous_needs_an_address_unless_single_host_mpi() {
        let p = placement(&vars(&[("RUCX_RANK", "0"), ("RUCX_SIZE", "2")])).unwrap();
        let e = rendezvous(&p, "").unwrap_err();
        assert!(e.to_string().contains("RUCX_BOOTSTRAP"), "{e}");
        assert_eq!(
            rendezvous(&p, "127.0.0.1:1234").unwrap().unwrap().port(),
            1234
        );
        assert!(rendezvous(&p, "nonsense").is_err());
        let p = placement(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "j"),
        ]))
        .unwrap();
        let a = rendezvous(&p, "").unwrap().unwrap();
        let (lo, hi) = quiet_ports(ephemeral_ports());
        assert!(a.ip().is_loopback() && (lo..hi).contains(&a.port()));
        let eph = ephemeral_ports();
        assert!(
            a.port() < eph.0 || a.port() > eph.1,
            "{a} is ephemeral: {eph:?}"
        );
    }

    #[test]
    fn quiet_ports_stay_out_of_the_ephemeral_range() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_port_range("1024 65535"), Some((1024, 65535)));
        assert_eq!(parse_port_range("60999 32768"), None);
        assert_eq!(parse_port_range("x"), None);
        // Linux's default: below it; a range starting low: above it.
        assert_eq!(quiet_ports((32768, 60999)), (20000, 32768));
        assert_eq!(quiet_ports((10000, 30000)), (30001, 65535));
        assert_eq!(quiet_ports((1024, 65535)), (20000, 40000));
        for eph in [(32768, 60999), (10000, 30000), (21000, 64535)] {
            let (lo, hi) = quiet_ports(eph);
            assert!(hi - lo >= 1000, "{eph:?}: {lo}..{hi}");
            assert!(hi <= eph.0 || lo > eph.1, "{eph:?}: {lo}..{hi} overlaps");
        }
        let eph = ephemeral_ports();
        for _ in 0..20 {
            let p = local_port().unwrap();
            assert!(p < eph.0 || p > eph.1, "{p} is ephemeral: {eph:?}");
            // Free when chosen: rank 0 can bind it.
            drop(std::net::TcpListener::bind(("127.0.0.1", p)).unwrap());
        }
    }
}

#[cfg(test)]
mod exchange_tests;
