//! Rank 0's side of the rendezvous: every connection is a handshake in progress, served side by
//! side from one thread with non-blocking sockets and `poll(2)`, so no connection can hold up
//! another.
//!
//! Bounds: at most [`Limits::max_pending`] handshakes at once (a new connection beyond that
//! evicts the one furthest behind: one that has not said `Hello` before one that has, the oldest
//! first), each gets [`Limits::handshake`] to finish, and at most `max_pending` connections are
//! accepted per turn, so a flood can neither exhaust descriptors and memory nor starve the
//! handshakes already running. A real rank answers within a round trip, so it finishes long
//! before a flood can push it out; if it is pushed out anyway, it connects again (see `client`).
//!
//! Whatever a connection does wrong (garbage, a foreign protocol, a truncated message, silence,
//! the wrong key, a rank out of range, a size that is not the job's, a rank that already joined)
//! only that connection is dropped, and logged: the job goes on. A peer learns why it was turned
//! away only after it proved the key, so a stranger learns nothing.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use rucx_ucs::{Error, Result};

use super::Placement;
use super::wire::{self, Challenge, HELLO_LEN, Hello, Key, NONCE};

/// How many handshakes run at once and how long each may take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Handshakes in progress at once (and connections accepted per turn).
    pub max_pending: usize,
    /// Time for one handshake, from accept to the verdict.
    pub handshake: Duration,
}

/// The limits every job uses.
pub(crate) const LIMITS: Limits = Limits {
    max_pending: 128,
    handshake: Duration::from_secs(5),
};

/// A connection that has not joined yet.
struct Pending {
    s: TcpStream,
    peer: SocketAddr,
    since: Instant,
    stage: Stage,
    buf: Vec<u8>,
}

enum Stage {
    /// Waiting for `Hello`.
    Hello,
    /// Challenged; waiting for `Join`.
    Join { hello: Hello, nonce: [u8; NONCE] },
}

impl Pending {
    /// Bytes the message of this stage needs in all.
    fn need(&self) -> std::result::Result<usize, String> {
        match self.stage {
            Stage::Hello => Ok(HELLO_LEN),
            Stage::Join { .. } => wire::join_len(&self.buf),
        }
    }

    /// Eviction order: furthest behind first, then oldest.
    fn eviction_key(&self) -> (u8, Instant) {
        let stage = match self.stage {
            Stage::Hello if self.buf.is_empty() => 0,
            Stage::Hello => 1,
            Stage::Join { .. } => 2,
        };
        (stage, self.since)
    }
}

/// A complete, authenticated claim.
struct Claim {
    hello: Hello,
    nonce: [u8; NONCE],
    addr: Vec<u8>,
}

/// A rank that joined.
struct Member {
    s: TcpStream,
    peer: SocketAddr,
    hello: Hello,
    nonce: [u8; NONCE],
}

/// Dropped connections and refused claims: the first few of each are warnings, the rest debug
/// lines, all counted.
#[derive(Default)]
struct DropLog {
    count: usize,
    refused: usize,
    last: Option<String>,
}

impl DropLog {
    const WARN_FIRST: usize = 10;

    fn log(n: usize, msg: &str, what: &str) {
        if n <= Self::WARN_FIRST {
            tracing::warn!("{msg}");
        } else {
            if n == Self::WARN_FIRST + 1 {
                tracing::warn!("bootstrap: more {what}; the rest are logged at debug level");
            }
            tracing::debug!("{msg}");
        }
    }

    /// A connection dropped before it proved anything.
    fn note(&mut self, peer: SocketAddr, why: &str) {
        self.count += 1;
        let msg = format!("bootstrap: dropped a connection from {peer}: {why}");
        Self::log(self.count - self.refused, &msg, "connections dropped");
        self.last = Some(msg);
    }

    /// A claim refused after its handshake (a misconfigured rank, or anyone when there is no
    /// key).
    fn refuse(&mut self, peer: SocketAddr, why: &str) {
        self.count += 1;
        self.refused += 1;
        let msg = format!("bootstrap: refused a join from {peer}: {why}");
        Self::log(self.refused, &msg, "joins refused");
        self.last = Some(msg);
    }
}

/// Send a short message on a fresh non-blocking socket: it fits the socket buffer whole, or the
/// peer is not reading and is dropped.
fn send_now(s: &mut TcpStream, b: &[u8]) -> std::result::Result<(), String> {
    match s.write(b) {
        Ok(n) if n == b.len() => Ok(()),
        Ok(_) => Err("it does not read what it is sent".into()),
        Err(e) if e.kind() == ErrorKind::WouldBlock => {
            Err("it does not read what it is sent".into())
        }
        Err(e) => Err(format!("sending: {e}")),
    }
}

/// Read what has arrived and answer it; `Some` once the handshake is complete.
fn advance(pd: &mut Pending, key: Option<&Key>) -> std::result::Result<Option<Claim>, String> {
    loop {
        let need = pd.need()?;
        let have = pd.buf.len();
        if have < need {
            pd.buf.resize(need, 0);
            match pd.s.read(&mut pd.buf[have..]) {
                Ok(0) => {
                    pd.buf.truncate(have);
                    return Err(if have == 0 && matches!(pd.stage, Stage::Hello) {
                        "it closed the connection without a word".into()
                    } else {
                        format!(
                            "it closed the connection in the middle of a message ({have} bytes)"
                        )
                    });
                }
                Ok(n) => pd.buf.truncate(have + n),
                Err(e) if e.kind() == ErrorKind::Interrupted => pd.buf.truncate(have),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    pd.buf.truncate(have);
                    return Ok(None);
                }
                Err(e) => return Err(format!("receiving: {e}")),
            }
            continue;
        }
        match &pd.stage {
            Stage::Hello => {
                let bytes: &[u8; HELLO_LEN] = pd.buf[..].try_into().expect("a whole Hello");
                let hello = Hello::decode(bytes)?;
                let nonce = wire::nonce()?;
                let ch = Challenge {
                    keyed: key.is_some(),
                    nonce,
                    proof: wire::server_proof(key, &hello, &nonce),
                };
                send_now(&mut pd.s, &ch.encode())?;
                pd.stage = Stage::Join { hello, nonce };
                pd.buf.clear();
            }
            Stage::Join { hello, nonce } => {
                let (addr, proof) = wire::decode_join(&pd.buf);
                if let Some(k) = key
                    && !wire::check_client_proof(k, hello, nonce, addr, &proof)
                {
                    return Err(format!(
                        "it claims rank {} of {} without this job's key (RUCX_BOOTSTRAP_KEY)",
                        hello.rank, hello.size
                    ));
                }
                return Ok(Some(Claim {
                    hello: hello.clone(),
                    nonce: *nonce,
                    addr: addr.to_vec(),
                }));
            }
        }
    }
}

/// Why a claim cannot join this job, if it cannot.
fn refusal(p: &Placement, members: &[Option<Member>], h: &Hello) -> Option<String> {
    let (r, n) = (h.rank as usize, h.size as usize);
    if n != p.size {
        Some(format!(
            "rank 0 runs a job of {} ranks and this rank claims a job of {n}; launch every rank \
             with the same size",
            p.size
        ))
    } else if r == 0 || r >= p.size {
        Some(format!(
            "rank {r} is not a rank that joins a job of {} (1 to {})",
            p.size,
            p.size - 1
        ))
    } else {
        members[r].as_ref().map(|m| {
            format!(
                "rank {r} already joined (from {}; the first one stays); launch every rank \
                 with a distinct rank",
                m.peer
            )
        })
    }
}

/// Whether a member left or broke the protocol while waiting for the others.
fn departure(s: &TcpStream) -> Option<String> {
    let mut b = [0u8; 1];
    match (&*s).read(&mut b) {
        Ok(0) => Some("it closed its connection".into()),
        Ok(_) => Some("it sent data out of turn".into()),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Sleep until a socket has something or `wait` passed.
fn wait_ready(l: &TcpListener, pending: &[Pending], members: &[Option<Member>], wait: Duration) {
    let mut fds = Vec::with_capacity(1 + pending.len() + members.len());
    fds.push(PollFd::new(l.as_fd(), PollFlags::POLLIN));
    fds.extend(
        pending
            .iter()
            .map(|pd| PollFd::new(pd.s.as_fd(), PollFlags::POLLIN)),
    );
    fds.extend(
        members
            .iter()
            .flatten()
            .map(|m| PollFd::new(m.s.as_fd(), PollFlags::POLLIN)),
    );
    let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX);
    // An error (EINTR) just means another turn.
    let _ = poll(&mut fds, PollTimeout::from(ms));
}

/// Rank 0's listening socket on `at`, with the longest accept queue the system allows (std's
/// 128 fills up under a flood, and a real rank's connection request would then wait for the
/// kernel's retransmission, a second or more).
pub(crate) fn listen(at: SocketAddr) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket,
        sockopt,
    };
    use std::os::fd::AsRawFd;
    let family = if at.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(at))?;
    nix::sys::socket::listen(&fd, Backlog::MAXALLOWABLE)?;
    Ok(TcpListener::from(fd))
}

/// Rank 0's state while the ranks join.
struct Rendezvous<'a> {
    p: &'a Placement,
    key: Option<&'a Key>,
    limits: Limits,
    pending: Vec<Pending>,
    members: Vec<Option<Member>>,
    addrs: Vec<Vec<u8>>,
    joined: usize,
    log: DropLog,
}

impl Rendezvous<'_> {
    /// Accept what waits, at most a quarter of the handshakes' room per turn, so that every
    /// handshake is read at least a few times before the connections after it could push it
    /// out. Each new connection is read at once too: a real rank sends its `Hello` right after
    /// its connect, so it is usually past the first stage before anyone can evict it.
    fn accept(&mut self, l: &TcpListener, at: SocketAddr) {
        for _ in 0..(self.limits.max_pending / 4).max(1) {
            match l.accept() {
                Ok((s, peer)) => {
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    if self.pending.len() >= self.limits.max_pending {
                        let victim = (0..self.pending.len())
                            .min_by_key(|&i| self.pending[i].eviction_key())
                            .expect("pending is full, so not empty");
                        let v = self.pending.swap_remove(victim);
                        self.log.note(
                            v.peer,
                            &format!(
                                "{} handshakes were pending; this one was furthest behind",
                                self.limits.max_pending
                            ),
                        );
                    }
                    self.pending.push(Pending {
                        s,
                        peer,
                        since: Instant::now(),
                        stage: Stage::Hello,
                        buf: Vec::new(),
                    });
                    self.step(self.pending.len() - 1);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, most likely: let the handshakes in progress finish.
                    tracing::debug!("bootstrap: accept on {at}: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
    }

    /// Members that left before the job formed free their rank.
    fn departures(&mut self) {
        for slot in self.members.iter_mut().skip(1) {
            if let Some(m) = slot
                && let Some(why) = departure(&m.s)
            {
                tracing::warn!(
                    "bootstrap: rank {} (from {}) left before every rank joined: {why}",
                    m.hello.rank,
                    m.peer
                );
                *slot = None;
                self.joined -= 1;
            }
        }
    }

    /// Advance handshake `i`; true when it is still pending at `i`.
    fn step(&mut self, i: usize) -> bool {
        let outcome = advance(&mut self.pending[i], self.key);
        let claim = match outcome {
            Ok(None) if self.pending[i].since.elapsed() > self.limits.handshake => {
                let pd = self.pending.swap_remove(i);
                self.log.note(
                    pd.peer,
                    &format!(
                        "no complete handshake within {:?} ({} bytes received)",
                        self.limits.handshake,
                        pd.buf.len()
                    ),
                );
                return false;
            }
            Ok(None) => return true,
            Err(why) => {
                let pd = self.pending.swap_remove(i);
                self.log.note(pd.peer, &why);
                return false;
            }
            Ok(Some(claim)) => claim,
        };
        let mut pd = self.pending.swap_remove(i);
        let no = refusal(self.p, &self.members, &claim.hello);
        if let Err(why) = send_now(&mut pd.s, &wire::encode_verdict(no.as_deref())) {
            self.log.note(pd.peer, &why);
            return false;
        }
        if let Some(no) = no {
            self.log.refuse(pd.peer, &no);
            return false;
        }
        let r = claim.hello.rank as usize;
        tracing::debug!("bootstrap: rank {r} joined from {}", pd.peer);
        self.addrs[r] = claim.addr;
        self.members[r] = Some(Member {
            s: pd.s,
            peer: pd.peer,
            hello: claim.hello,
            nonce: claim.nonce,
        });
        self.joined += 1;
        false
    }

    /// Advance every handshake in progress.
    fn sweep(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.step(i) {
                i += 1;
            }
        }
    }
}

/// Serve the rendezvous on `l` until every rank joined; returns every rank's address and one
/// connection per other rank, in rank order.
pub(crate) fn serve(
    p: &Placement,
    l: &TcpListener,
    mine: &[u8],
    key: Option<&Key>,
    timeout: Duration,
    limits: Limits,
) -> Result<(Vec<Vec<u8>>, Vec<TcpStream>)> {
    let at = l.local_addr().map_err(|e| Error::io("bootstrap", e))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::io("bootstrap", e))?;
    let deadline = Instant::now().checked_add(timeout);
    let mut rv = Rendezvous {
        p,
        key,
        limits,
        pending: Vec::new(),
        members: (0..p.size).map(|_| None).collect(),
        addrs: vec![Vec::new(); p.size],
        joined: 1,
        log: DropLog::default(),
    };
    rv.addrs[0] = mine.to_vec();
    while rv.joined < p.size {
        let now = Instant::now();
        if deadline.is_some_and(|d| now > d) {
            let missing: Vec<usize> = (1..p.size).filter(|r| rv.members[*r].is_none()).collect();
            let dropped = match &rv.log.last {
                Some(last) => format!(
                    "; {} connections were dropped, the last: {last}",
                    rv.log.count
                ),
                None => String::new(),
            };
            return Err(Error::Timeout {
                after: timeout,
                what: format!(
                    "ranks {missing:?} to join at {at} (RUCX_BOOTSTRAP_TIMEOUT){dropped}"
                ),
            });
        }
        let next_expiry = rv
            .pending
            .iter()
            .map(|pd| (pd.since + limits.handshake).saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX);
        let to_deadline = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
        wait_ready(
            l,
            &rv.pending,
            &rv.members,
            next_expiry.min(to_deadline).min(Duration::from_millis(100)),
        );
        // Departures first: a rank that reconnects after losing its connection is not taken
        // for a duplicate of itself.
        rv.departures();
        rv.accept(l, at);
        rv.sweep();
    }
    let Rendezvous {
        members,
        addrs,
        log,
        ..
    } = rv;
    if log.count > 0 {
        let msg = format!(
            "bootstrap: every rank joined at {at}; {} other connections were dropped",
            log.count
        );
        if log.count > DropLog::WARN_FIRST {
            tracing::warn!("{msg}");
        } else {
            tracing::info!("{msg}");
        }
    }

    // Every rank joined: each gets the table, tagged for its own connection.
    let table = wire::encode_table(&addrs);
    let mut conns = Vec::with_capacity(p.size - 1);
    for m in members.into_iter().flatten() {
        let Member {
            mut s,
            hello,
            nonce,
            ..
        } = m;
        let io = |e| {
            Error::io(
                format!(
                    "bootstrap: sending the address table to rank {}",
                    hello.rank
                ),
                e,
            )
        };
        s.set_nonblocking(false).map_err(io)?;
        s.set_write_timeout(Some(
            timeout.clamp(Duration::from_secs(1), Duration::from_secs(3600)),
        ))
        .map_err(io)?;
        let tag = wire::table_tag(key, &hello, &nonce, &table);
        s.write_all(&table).map_err(io)?;
        s.write_all(&tag).map_err(io)?;
        s.set_write_timeout(None).map_err(io)?;
        conns.push(s);
    }
    Ok((addrs, conns))
}
