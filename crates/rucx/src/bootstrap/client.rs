//! A rank's side of the rendezvous: connect to rank 0, check its proof of the key, prove the key
//! in turn with this rank's address, then wait for the table of every rank's address.
//!
//! A connection that fails before rank 0's verdict (rank 0 not listening yet, a connection
//! dropped while rank 0 is flooded, a handshake that takes too long) is tried again until
//! `RUCX_BOOTSTRAP_TIMEOUT`; what no retry can mend (another key, a different protocol version,
//! a refusal from rank 0) fails at once with the reason.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rucx_ucs::{Error, Result};

use super::Placement;
use super::server::Limits;
use super::wire::{self, CHALLENGE_LEN, Challenge, Hello, Key, MAX_ADDR, MAX_REASON, NONCE, TAG};

/// A connection rank 0 accepted.
struct Accepted {
    s: TcpStream,
    hello: Hello,
    nonce: [u8; NONCE],
}

/// Why one attempt failed.
enum Failure {
    /// Worth another connection.
    Retry(String),
    /// Final.
    Fatal(Error),
}

fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    })
}

fn retry(what: &str) -> impl FnOnce(std::io::Error) -> Failure + '_ {
    move |e| {
        Failure::Retry(match e.kind() {
            ErrorKind::UnexpectedEof => format!("rank 0 closed the connection while {what}"),
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!("no answer while {what}"),
            _ => format!("{what}: {e}"),
        })
    }
}

fn fatal(at: SocketAddr, why: impl std::fmt::Display) -> Failure {
    Failure::Fatal(Error::InvalidAddress(format!(
        "bootstrap: rank 0 at {at} (RUCX_BOOTSTRAP): {why}"
    )))
}

/// One connection and handshake, up to rank 0's verdict; a connect waits `connect_for` at most.
fn attempt(
    p: &Placement,
    at: SocketAddr,
    mine: &[u8],
    key: Option<&Key>,
    deadline: Option<Instant>,
    connect_for: Duration,
) -> std::result::Result<Accepted, Failure> {
    let connect_for = remaining(deadline).map_or(connect_for, |r| r.min(connect_for));
    let mut s = TcpStream::connect_timeout(&at, connect_for).map_err(retry("connecting"))?;
    let io = |e| Failure::Retry(format!("setting up the connection: {e}"));
    s.set_nodelay(true).map_err(io)?;
    s.set_read_timeout(remaining(deadline)).map_err(io)?;
    s.set_write_timeout(remaining(deadline)).map_err(io)?;
    let hello = Hello {
        rank: p.rank as u32,
        size: p.size as u32,
        nonce: wire::nonce().map_err(|e| fatal(at, e))?,
    };
    s.write_all(&hello.encode())
        .map_err(retry("saying hello"))?;
    let mut b = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut b)
        .map_err(retry("waiting for its challenge"))?;
    let ch = Challenge::decode(&b).map_err(|e| fatal(at, e))?;
    match (key, ch.keyed) {
        (None, true) => {
            return Err(fatal(
                at,
                "rank 0 requires a job key and this rank has none: set the same \
                 RUCX_BOOTSTRAP_KEY for every rank",
            ));
        }
        (Some(_), false) => {
            return Err(fatal(
                at,
                "this rank has a job key (RUCX_BOOTSTRAP_KEY) and rank 0 has none; refusing \
                 an unauthenticated rendezvous: set the same key for every rank",
            ));
        }
        (Some(k), true) if !wire::check_server_proof(k, &hello, &ch.nonce, &ch.proof) => {
            return Err(fatal(
                at,
                "it does not prove this job's key: RUCX_BOOTSTRAP_KEY differs between the ranks \
                 (or another program listens there)",
            ));
        }
        _ => {}
    }
    let proof = wire::client_proof(key, &hello, &ch.nonce, mine);
    s.write_all(&wire::encode_join(mine, &proof))
        .map_err(retry("joining"))?;
    let mut v = [0u8; 8];
    s.read_exact(&mut v)
        .map_err(retry("waiting for its verdict"))?;
    let status = u32::from_le_bytes(v[..4].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(v[4..].try_into().expect("4 bytes")) as usize;
    if len > MAX_REASON {
        return Err(fatal(at, format!("a verdict with a reason of {len} bytes")));
    }
    let mut reason = vec![0u8; len];
    s.read_exact(&mut reason)
        .map_err(retry("reading its verdict"))?;
    match status {
        0 => Ok(Accepted {
            s,
            hello,
            nonce: ch.nonce,
        }),
        1 => Err(fatal(
            at,
            format!(
                "rank {} was refused: {}",
                p.rank,
                String::from_utf8_lossy(&reason)
            ),
        )),
        other => Err(fatal(at, format!("an unknown verdict {other}"))),
    }
}

/// Read the table of every rank's address once every rank joined.
fn table(
    p: &Placement,
    at: SocketAddr,
    acc: &mut Accepted,
    key: Option<&Key>,
    deadline: Option<Instant>,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let Accepted { s, hello, nonce } = acc;
    s.set_read_timeout(remaining(deadline))
        .map_err(|e| Error::io("bootstrap", e))?;
    let mut raw = Vec::new();
    let read = |s: &mut TcpStream, n: usize, raw: &mut Vec<u8>| -> Result<()> {
        let from = raw.len();
        raw.resize(from + n, 0);
        s.read_exact(&mut raw[from..]).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::Timeout {
                after: timeout,
                what: format!(
                    "the other ranks to join at {at} (RUCX_BOOTSTRAP_TIMEOUT; rank {} joined)",
                    p.rank
                ),
            },
            ErrorKind::UnexpectedEof => Error::EndpointFailure {
                peer: format!("rank 0 at {at}"),
                reason: "it closed the bootstrap connection before the job formed".into(),
            },
            _ => Error::io("bootstrap: receiving the address table", e),
        })
    };
    let bad = |why: String| Error::InvalidAddress(format!("bootstrap: rank 0 at {at}: {why}"));
    read(s, 4, &mut raw)?;
    let count = u32::from_le_bytes(raw[..4].try_into().expect("4 bytes")) as usize;
    if count != p.size {
        return Err(bad(format!(
            "a table of {count} ranks for a job of {}",
            p.size
        )));
    }
    let mut addrs = Vec::with_capacity(p.size);
    for r in 0..p.size {
        let at_len = raw.len();
        read(s, 4, &mut raw)?;
        let len = u32::from_le_bytes(raw[at_len..].try_into().expect("4 bytes")) as usize;
        if len > MAX_ADDR {
            return Err(bad(format!("an address of {len} bytes for rank {r}")));
        }
        let from = raw.len();
        read(s, len, &mut raw)?;
        addrs.push(raw[from..].to_vec());
    }
    let mut tag = [0u8; TAG];
    s.read_exact(&mut tag)
        .map_err(|e| Error::io("bootstrap: receiving the address table", e))?;
    if let Some(k) = key
        && !wire::check_table_tag(k, hello, nonce, &raw, &tag)
    {
        return Err(bad("the address table does not carry this job's key".into()));
    }
    s.set_read_timeout(None)
        .and_then(|()| s.set_write_timeout(None))
        .map_err(|e| Error::io("bootstrap", e))?;
    Ok(addrs)
}

/// Join the job at `at`: every rank's address and the connection to rank 0.
pub(crate) fn join(
    p: &Placement,
    at: SocketAddr,
    mine: &[u8],
    key: Option<&Key>,
    timeout: Duration,
    limits: Limits,
) -> Result<(Vec<Vec<u8>>, TcpStream)> {
    let deadline = Instant::now().checked_add(timeout);
    let mut backoff = Duration::from_millis(10);
    // Short connect waits first: a connection request lost in a full accept queue is sent again
    // sooner by a new connect than by the kernel's retransmission (1 s); longer ones later, for
    // slow networks.
    let mut connect_for = Duration::from_millis(250);
    loop {
        let attempt_deadline = match (Instant::now().checked_add(limits.handshake), deadline) {
            (Some(a), Some(d)) => Some(a.min(d)),
            (a, None) => a,
            (None, d) => d,
        };
        let last = match attempt(p, at, mine, key, attempt_deadline, connect_for) {
            Ok(mut acc) => {
                let addrs = table(p, at, &mut acc, key, deadline, timeout)?;
                if addrs[p.rank] != mine {
                    return Err(Error::InvalidAddress(format!(
                        "bootstrap: rank 0 at {at} sent a table without this rank's address"
                    )));
                }
                return Ok((addrs, acc.s));
            }
            Err(Failure::Fatal(e)) => return Err(e),
            Err(Failure::Retry(why)) => {
                if why.contains("while connecting") {
                    connect_for = (connect_for * 2).min(Duration::from_secs(2));
                }
                why
            }
        };
        if deadline.is_some_and(|d| Instant::now() > d) {
            return Err(Error::Timeout {
                after: timeout,
                what: format!(
                    "rank {} to join rank 0 at {at} (RUCX_BOOTSTRAP, RUCX_BOOTSTRAP_TIMEOUT); \
                     the last attempt: {last}",
                    p.rank
                ),
            });
        }
        tracing::debug!("bootstrap: rank {} tries again: {last}", p.rank);
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}
