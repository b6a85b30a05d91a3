//! Client/server wire-up: a worker listens on `host:port`; a peer that knows only that address
//! connects, the two exchange worker addresses over the socket, and each gets an endpoint.
//!
//! The server's side never blocks: [`Worker::accept`] takes the connections the kernel holds,
//! reads each peer's address as it arrives (several handshakes may be in progress at once, each
//! with a deadline), and returns an endpoint when one is complete. A peer that connects and
//! says nothing, or too little, costs the server nothing but a socket until its deadline. The
//! [`Listener`]'s descriptor ([`AsRawFd`]) is readable while a peer waits to be accepted or a
//! handshake has bytes to read, so an event loop sleeps on it (with [`Listener::next_deadline`]
//! as its timeout) instead of polling.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rucx_ucs::event::EventSet;
use rucx_ucs::{Error, Result};

use crate::worker::{EpId, Worker};

/// The message both sides send: this magic, the address's length (`u32`, little-endian), the
/// sender's client id (`u64`, little-endian; 0 from the server and from clients that send
/// none), then the packed worker address.
pub(crate) const MAGIC: &[u8; 8] = b"RUCXCM02";
const HEADER: usize = 20;
const MAX_ADDR: u32 = 1 << 20;
/// Most bytes a handshake's buffer grows by ahead of what arrived: what a peer announces is not
/// allocated before it is sent, so a flood of peers announcing [`MAX_ADDR`]-byte addresses and
/// sending a header each costs the listener their headers, not a MiB each.
const READ_AHEAD: usize = 16 * 1024;
/// How long a connected peer has to send its whole address (see
/// [`Listener::set_handshake_timeout`]).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections taken from the kernel per [`Worker::accept`] call (the rest stay queued there).
const ACCEPT_BATCH: usize = 64;
/// Handshakes in progress at most: a flood of peers that connect and say nothing costs the
/// listener this many sockets, not more (those beyond are closed at once, with a warning).
pub const MAX_HANDSHAKES: usize = 1024;

/// A listening socket of a worker and the handshakes in progress on it; see [`Worker::listen`]
/// and [`Worker::accept`].
#[derive(Debug)]
pub struct Listener {
    sock: TcpListener,
    addr: SocketAddr,
    /// The listening socket and every handshake's socket: readable when one of them is.
    set: EventSet,
    pending: Mutex<Vec<Handshake>>,
    timeout: Duration,
    max_handshakes: usize,
}

/// A peer connected whose address is not complete yet.
#[derive(Debug)]
struct Handshake {
    sock: TcpStream,
    from: SocketAddr,
    /// The header and the address read so far.
    got: Vec<u8>,
    deadline: Instant,
}

/// What reading a handshake's socket gave.
#[derive(Debug)]
pub(crate) enum Step {
    /// Not complete yet: wait for more bytes.
    More,
    /// The peer's whole packed address and the client id it sent.
    Done { addr: Vec<u8>, client_id: u64 },
    /// The server turned the request away (only a server sends this).
    Rejected,
}

impl Handshake {
    /// Read what the socket has (never blocks).
    fn step(&mut self) -> Result<Step> {
        match read_step(&mut self.got, self.from, &mut self.sock)? {
            Step::Rejected => Err(Error::InvalidAddress(format!(
                "connection manager: the peer at {} sent a server's reject",
                self.from
            ))),
            s => Ok(s),
        }
    }
}

/// Bytes of the address message still expected, given `got`: the header, then the address it
/// announced.
fn wanted(got: &[u8], from: SocketAddr) -> Result<usize> {
    // The length is judged as soon as it is in (before the client id behind it).
    if got.len() < 12 {
        return Ok(HEADER);
    }
    let n = u32::from_le_bytes([got[8], got[9], got[10], got[11]]);
    if n == REJECTED {
        return Ok(HEADER);
    }
    if n > MAX_ADDR {
        return Err(Error::InvalidAddress(format!(
            "connection manager: the peer at {from} announced a {n}-byte worker address (at \
             most {MAX_ADDR})"
        )));
    }
    Ok(HEADER + n as usize)
}

/// Read from `r` (non-blocking) what it has of a peer's address message into `got`, never past
/// the message's end: `Done` with the address once whole, `Rejected` for a reject.
pub(crate) fn read_step(got: &mut Vec<u8>, from: SocketAddr, r: &mut impl Read) -> Result<Step> {
    loop {
        let want = wanted(got, from)?;
        if got.len() == want {
            if u32::from_le_bytes([got[8], got[9], got[10], got[11]]) == REJECTED {
                return Ok(Step::Rejected);
            }
            let client_id = u64::from_le_bytes(got[12..20].try_into().expect("8 bytes"));
            let addr = got.split_off(HEADER);
            return Ok(Step::Done { addr, client_id });
        }
        let have = got.len();
        got.resize(want.min(have + READ_AHEAD), 0);
        let n = match r.read(&mut got[have..]) {
            Ok(n) => n,
            Err(e) => {
                got.truncate(have);
                match e.kind() {
                    std::io::ErrorKind::WouldBlock => return Ok(Step::More),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => {
                        return Err(Error::io(
                            format!(
                                "connection manager: receiving the worker address of the peer \
                                 at {from}"
                            ),
                            e,
                        ));
                    }
                }
            }
        };
        got.truncate(have + n);
        if n == 0 {
            return Err(Error::InvalidAddress(format!(
                "connection manager: the peer at {from} closed the connection after {have} of \
                 the {want} bytes of its worker address message"
            )));
        }
        // A stranger is turned away as soon as its first bytes show it.
        let m = got.len().min(MAGIC.len());
        if got[..m] != MAGIC[..m] {
            return Err(Error::InvalidAddress(format!(
                "connection manager: the peer at {from} is not a rucx worker (bad magic)"
            )));
        }
    }
}

impl Listener {
    /// The next peer whose handshake is complete, if any, not answered yet: never blocks.
    /// [`ConnRequest::accept`] makes its endpoint on any worker (UCX's connection request,
    /// which a server accepts on a worker of its choice), [`ConnRequest::reject`] turns it
    /// away. Errors as for [`Worker::accept`].
    pub fn next_request(&self) -> Result<Option<ConnRequest>> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for _ in 0..ACCEPT_BATCH {
            match self.sock.accept() {
                Ok((s, from)) if pending.len() >= self.max_handshakes => {
                    // A flood: this one is turned away (closed) rather than held.
                    tracing::warn!(
                        "listener on {}: {} handshakes in progress (the most it holds); the \
                         connection from {from} is closed",
                        self.addr,
                        self.max_handshakes
                    );
                    drop(s);
                }
                Ok((s, from)) => {
                    s.set_nonblocking(true)
                        .and_then(|()| self.set.add(s.as_raw_fd(), 0))
                        .map_err(|e| {
                            Error::io(
                                format!("listener on {}: the connection from {from}", self.addr),
                                e,
                            )
                        })?;
                    pending.push(Handshake {
                        sock: s,
                        from,
                        got: Vec::new(),
                        deadline: Instant::now() + self.timeout,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("listener on {}: accepting a connection", self.addr),
                        e,
                    ));
                }
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < pending.len() {
            match pending[i].step() {
                Ok(Step::More) if now >= pending[i].deadline => {
                    let h = pending.swap_remove(i);
                    return Err(Error::Timeout {
                        after: self.timeout,
                        what: format!(
                            "connection manager: the worker address of the peer at {} ({} bytes \
                             of it so far; Listener::set_handshake_timeout)",
                            h.from,
                            h.got.len()
                        ),
                    });
                }
                Ok(Step::More) => i += 1,
                Ok(Step::Rejected) => unreachable!("a handshake step reports a reject as an error"),
                Ok(Step::Done {
                    addr: peer,
                    client_id,
                }) => {
                    let h = pending.swap_remove(i);
                    // Its socket leaves the set: the request is answered on it, not read.
                    let _ = self.set.remove(h.sock.as_raw_fd());
                    crate::address::WorkerAddress::unpack(&peer).map_err(|e| {
                        Error::InvalidAddress(format!(
                            "connection manager: the worker address of the peer at {}: {e}",
                            h.from
                        ))
                    })?;
                    return Ok(Some(ConnRequest {
                        sock: h.sock,
                        from: h.from,
                        peer,
                        client_id,
                    }));
                }
                Err(e) => {
                    pending.swap_remove(i);
                    return Err(e);
                }
            }
        }
        Ok(None)
    }

    /// The bound address (with the port chosen by the system when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How long a connected peer has to send its address before [`Worker::accept`] drops it
    /// with a timeout error ([`HANDSHAKE_TIMEOUT`] unless set; applies to peers that connect
    /// from now on).
    pub fn set_handshake_timeout(&mut self, t: Duration) {
        self.timeout = t;
    }

    /// How many handshakes may be in progress at once ([`MAX_HANDSHAKES`] unless set): a peer
    /// that connects while that many are is disconnected at once (its connect fails), so a
    /// flood of silent peers costs at most this many sockets until their deadlines.
    pub fn set_max_handshakes(&mut self, n: usize) {
        self.max_handshakes = n.max(1);
    }

    /// Handshakes in progress (peers connected whose address is not complete).
    pub fn handshakes(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The earliest deadline of a handshake in progress: an event loop that sleeps on this
    /// listener's descriptor wakes by then and calls [`Worker::accept`], which drops the late
    /// peer. `None` without handshakes in progress.
    pub fn next_deadline(&self) -> Option<Instant> {
        let p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        p.iter().map(|h| h.deadline).min()
    }
}

/// Readable while a peer waits to be accepted or a handshake in progress has bytes to read:
/// call [`Worker::accept`] then. Owned by the listener.
impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        self.set.fd()
    }
}

/// The announced length that says "rejected" instead of an address.
const REJECTED: u32 = u32::MAX;

/// A peer that connected to a [`Listener`] and sent its whole worker address, waiting for an
/// answer ([`Listener::next_request`]): [`accept`](Self::accept) it on a worker, or
/// [`reject`](Self::reject) it. Dropped unanswered, it is rejected.
#[derive(Debug)]
pub struct ConnRequest {
    sock: TcpStream,
    from: SocketAddr,
    peer: Vec<u8>,
    client_id: u64,
}

impl ConnRequest {
    /// The client id the peer sent ([`ConnectOpts::client_id`]; 0 when it sent none).
    pub fn client_id(&self) -> u64 {
        self.client_id
    }

    /// The peer's socket address (as the listener saw the connection come from).
    pub fn client_addr(&self) -> SocketAddr {
        self.from
    }

    /// The peer's packed worker address.
    pub fn peer_address(&self) -> &[u8] {
        &self.peer
    }

    /// Connect `w` to the peer and answer it with `w`'s address: the endpoint. The endpoint
    /// comes first: the peer, once it has our address, may send, close and exit at once, and
    /// its transports (a posix segment) may be gone by the time we would open them.
    pub fn accept(mut self, w: &Worker) -> Result<EpId> {
        let from = self.from;
        let ep = w.connect(&self.peer)?;
        // Our address is far smaller than a fresh socket's send buffer: it goes at once or the
        // peer is gone.
        let msg = addr_message(&w.address(), 0);
        let e = match write_all_now(&mut self.sock, &msg) {
            Ok(()) => return Ok(ep),
            Err(e) => Error::io(
                format!("connection manager: sending this worker's address to {from}"),
                e,
            ),
        };
        // The peer will not know us: the endpoint goes (the close runs on in progress).
        drop(w.close(ep, crate::CloseMode::Force));
        Err(e)
    }

    /// Turn the peer away: its [`Worker::connect_sockaddr`] fails with
    /// [`Error::PeerAborted`] saying it was rejected.
    pub fn reject(mut self) {
        self.send_reject();
    }

    fn send_reject(&mut self) {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&REJECTED.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        // The peer may be gone already: then there is nobody to tell.
        let _ = write_all_now(&mut self.sock, &b);
        self.peer.clear();
    }
}

impl Drop for ConnRequest {
    fn drop(&mut self) {
        if !self.peer.is_empty() {
            self.send_reject();
        }
    }
}

/// Write `b` whole on a non-blocking socket whose send buffer has room for it (a fresh
/// connection's does): a short write is an error.
fn write_all_now(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    let sent = loop {
        match s.write(b) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    if sent == b.len() {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            format!("the peer took {sent} of {} bytes", b.len()),
        ))
    }
}

pub(crate) fn addr_message(addr: &[u8], client_id: u64) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&(addr.len() as u32).to_le_bytes());
    b.extend_from_slice(&client_id.to_le_bytes());
    b.extend_from_slice(addr);
    b
}

impl Worker {
    /// Listen for peers on `addr` (`"0.0.0.0:13337"`, `"127.0.0.1:0"`, ...).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener> {
        let sock = TcpListener::bind(addr).map_err(|e| Error::io("listen", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("listen: non-blocking", e))?;
        let addr = sock.local_addr().map_err(|e| Error::io("listen", e))?;
        let set = EventSet::new()
            .and_then(|s| s.add(sock.as_raw_fd(), 0).map(|()| s))
            .map_err(|e| Error::io(format!("listen on {addr}: its event set (epoll)"), e))?;
        Ok(Listener {
            sock,
            addr,
            set,
            pending: Mutex::new(Vec::new()),
            timeout: HANDSHAKE_TIMEOUT,
            max_handshakes: MAX_HANDSHAKES,
        })
    }

    /// Accept one peer whose handshake is complete, if any: never blocks. Takes the
    /// connections waiting in the kernel, reads what the peers in handshake sent so far, and,
    /// for a peer whose whole address arrived, sends this worker's address and returns the
    /// endpoint to it. `Ok(None)`: nobody is ready (sleep on the listener's descriptor, see
    /// [`Listener`]). [`Listener::next_request`] is the same in two steps: the endpoint may
    /// then be made on another worker, or the peer turned away.
    ///
    /// An error concerns one connecting peer, which was dropped (not a rucx worker, an address
    /// too long or malformed, the connection closed or broken, no whole address within the
    /// handshake timeout), or, rarely, the listening socket (`accept(2)` failed, e.g. out of
    /// descriptors). Either way the listener stays usable: log the error and call again.
    pub fn accept(&self, l: &Listener) -> Result<Option<EpId>> {
        match l.next_request()? {
            Some(r) => r.accept(self).map(Some),
            None => Ok(None),
        }
    }

    /// Connect to a peer listening on `addr`, waiting at most `timeout` for it to answer
    /// (progressing this worker meanwhile; a refused connection is tried again until then, for
    /// a server that is still starting). [`Worker::connect_sockaddr_nb`] is the form that
    /// returns at once.
    pub fn connect_sockaddr(&self, addr: impl ToSocketAddrs, timeout: Duration) -> Result<EpId> {
        let target = resolve(addr)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let opts = ConnectOpts {
                timeout: left.max(Duration::from_millis(1)),
                ..ConnectOpts::default()
            };
            let ep = self.connect_sockaddr_nb(target, &opts)?;
            self.progress_until(None, || !self.is_connecting(ep));
            let Some(err) = self.connect_error(ep) else {
                return Ok(ep);
            };
            // The endpoint never reached the caller: it goes quietly.
            drop(self.close(ep, crate::CloseMode::Force));
            let refused = matches!(err.cause(), Error::Io { source, .. }
                if source.kind() == std::io::ErrorKind::ConnectionRefused);
            if !refused || Instant::now() >= deadline {
                return Err(err);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The first socket address `addr` resolves to.
pub(crate) fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::io("connect: resolving the address", e))?
        .next()
        .ok_or_else(|| Error::InvalidParam("connect: the address resolves to nothing".into()))
}

/// How [`Worker::connect_sockaddr_nb`] connects.
#[derive(Clone, Debug)]
pub struct ConnectOpts {
    /// How long the server has to answer (connection, address exchange) before the endpoint
    /// fails with [`Error::PeerTimeout`].
    pub timeout: Duration,
    /// Sent to the server, which reads it with [`ConnRequest::client_id`] (UCX's
    /// `UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID`); 0 sends none.
    pub client_id: u64,
    /// The local address to connect from (UCX's `UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR`); `None`:
    /// the system picks.
    pub local: Option<SocketAddr>,
}

impl Default for ConnectOpts {
    fn default() -> Self {
        ConnectOpts {
            timeout: Duration::from_secs(30),
            client_id: 0,
            local: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::io::ErrorKind;

    use proptest::prelude::*;

    #[test]
    fn garbage_on_the_socket_is_an_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = TcpStream::connect(a).unwrap();
            c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        });
        let (mut s, from) = l.accept().unwrap();
        let e = read_step(&mut Vec::new(), from, &mut s).unwrap_err();
        assert!(e.to_string().contains("not a rucx worker"), "{e}");
        t.join().unwrap();
    }

    fn worker() -> Worker {
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", "posix")]).unwrap();
        let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
        Worker::new(&ctx).unwrap()
    }

    /// `accept` until it returns something other than `Ok(None)` (progressing the worker),
    /// failing the test after 30 s of nothing.
    fn accept_next(w: &Worker, l: &Listener) -> Result<EpId> {
        let t = Instant::now();
        loop {
            match w.accept(l) {
                Ok(None) => {
                    assert!(t.elapsed() < Duration::from_secs(30), "nobody accepted");
                    w.progress();
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok(Some(ep)) => return Ok(ep),
                Err(e) => return Err(e),
            }
        }
    }

    /// A client worker on its own thread connects to `at` and exchanges a message both ways.
    fn client(at: SocketAddr) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let w = worker();
            let ep = w.connect_sockaddr(at, Duration::from_secs(30)).unwrap();
            w.tag_send_wait(ep, b"hello", 1).unwrap();
            let mut b = [0u8; 3];
            w.tag_recv_wait(&mut b, 2, crate::TAG_MASK_FULL).unwrap();
            assert_eq!(&b, b"bye");
        })
    }

    fn serve_one(w: &Worker, ep: EpId) {
        let mut b = [0u8; 5];
        let c = w.tag_recv_wait(&mut b, 1, crate::TAG_MASK_FULL).unwrap();
        assert_eq!((c.sender, &b), (Some(ep), b"hello"));
        w.tag_send_wait(ep, b"bye", 2).unwrap();
    }

    /// `next_request` until a request comes (progressing nothing: the server's side of the
    /// handshake needs no worker), failing the test after 30 s.
    fn next_request(l: &Listener) -> ConnRequest {
        let t = Instant::now();
        loop {
            if let Some(r) = l.next_request().unwrap() {
                return r;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "no request");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_request_is_accepted_on_another_worker_or_rejected_and_the_client_told() {
        let (lw, dw) = (worker(), worker());
        let l = lw.listen("127.0.0.1:0").unwrap();
        let at = l.local_addr();
        let t = client(at);
        let r = next_request(&l);
        assert_eq!(r.client_addr().ip(), at.ip());
        assert!(crate::address::WorkerAddress::unpack(r.peer_address()).is_ok());
        // Accepted on the data worker: the client's messages arrive there.
        let ep = r.accept(&dw).unwrap();
        serve_one(&dw, ep);
        t.join().unwrap();
        // Rejected, explicitly or by dropping the request: the client's connect says so.
        for explicit in [true, false] {
            let c = std::thread::spawn(move || {
                worker()
                    .connect_sockaddr(at, Duration::from_secs(30))
                    .unwrap_err()
            });
            let r = next_request(&l);
            if explicit {
                r.reject();
            } else {
                drop(r);
            }
            let e = c.join().unwrap();
            assert!(
                matches!(&e, Error::PeerAborted { reason, .. } if reason.contains("rejected")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_silent_peer_holds_up_nobody_and_is_dropped_at_its_deadline() {
        let w = worker();
        let mut l = w.listen("127.0.0.1:0").unwrap();
        l.set_handshake_timeout(Duration::from_millis(300));
        // Connects and says nothing (or half of a header).
        let mut silent = TcpStream::connect(l.local_addr()).unwrap();
        silent.write_all(&MAGIC[..5]).unwrap();
        while l.handshakes() == 0 {
            assert_eq!(w.accept(&l).unwrap(), None);
        }
        // The real peer gets all the time it needs, however loaded the machine.
        l.set_handshake_timeout(HANDSHAKE_TIMEOUT);
        let t = client(l.local_addr());
        let ep = accept_next(&w, &l).unwrap();
        assert_eq!(l.handshakes(), 1, "the silent peer is still in handshake");
        assert!(l.next_deadline().is_some());
        serve_one(&w, ep);
        t.join().unwrap();
        let e = accept_next(&w, &l).unwrap_err();
        let msg = e.to_string();
        let me = silent.local_addr().unwrap().to_string();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(msg.contains(&me) && msg.contains("5 bytes"), "{msg}");
        assert_eq!((l.handshakes(), l.next_deadline()), (0, None));
        // The silent peer's connection was closed.
        let mut rest = Vec::new();
        silent
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        assert_eq!(silent.read_to_end(&mut rest).unwrap(), 0);
    }

    #[test]
    fn strangers_are_turned_away_and_the_listener_keeps_serving() {
        let w = worker();
        let l = w.listen("127.0.0.1:0").unwrap();
        let cases: [(&[u8], &str); 5] = [
            (b"GET / HTTP/1.0\r\n\r\n", "not a rucx worker"),
            // The first version of the handshake is refused, not misread.
            (b"RUCXCM01\x04\x00\x00\x00abcd", "not a rucx worker"),
            (b"RUCXCM02\xfe\xff\xff\xff", "announced a 4294967294-byte"),
            (
                b"RUCXCM02\xff\xff\xff\xff\x00\x00\x00\x00\x00\x00\x00\x00",
                "sent a server's reject",
            ),
            (
                b"RUCXCM02\x04\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00abcd",
                "the worker address of the peer at",
            ),
        ];
        for (bytes, want) in cases {
            let mut s = TcpStream::connect(l.local_addr()).unwrap();
            s.write_all(bytes).unwrap();
            let e = accept_next(&w, &l).unwrap_err().to_string();
            let me = s.local_addr().unwrap().to_string();
            assert!(e.contains(want) && e.contains(&me), "{e}");
        }
        // A peer that hangs up part-way.
        let mut s = TcpStream::connect(l.local_addr()).unwrap();
        s.write_all(b"RUCXCM02\x10\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00ab")
            .unwrap();
        drop(s);
        let e = accept_next(&w, &l).unwrap_err().to_string();
        assert!(
            e.contains("closed the connection after 22 of the 36 bytes"),
            "{e}"
        );
        assert_eq!(l.handshakes(), 0);
        let t = client(l.local_addr());
        let ep = accept_next(&w, &l).unwrap();
        serve_one(&w, ep);
        t.join().unwrap();
    }

    #[test]
    fn an_address_in_pieces_is_put_together_across_calls_and_answered() {
        let w = worker();
        let l = w.listen("127.0.0.1:0").unwrap();
        // Nobody: the listener's descriptor is not readable.
        assert!(!rucx_ucs::event::wait_readable(l.as_raw_fd(), Some(Duration::ZERO)).unwrap());
        let other = worker();
        let msg = addr_message(&other.address(), 0xC11E_4715);
        let mut s = TcpStream::connect(l.local_addr()).unwrap();
        // A peer connected: readable.
        assert!(
            rucx_ucs::event::wait_readable(l.as_raw_fd(), Some(Duration::from_secs(30))).unwrap()
        );
        for piece in msg[..msg.len() - 1].chunks(7) {
            s.write_all(piece).unwrap();
            assert!(
                rucx_ucs::event::wait_readable(l.as_raw_fd(), Some(Duration::from_secs(30)))
                    .unwrap()
            );
            assert_eq!(w.accept(&l).unwrap(), None);
        }
        assert_eq!(l.handshakes(), 1);
        s.write_all(&msg[msg.len() - 1..]).unwrap();
        let r = next_request(&l);
        assert_eq!(r.client_id(), 0xC11E_4715);
        r.accept(&w).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let from = l.local_addr();
        match read_step(&mut Vec::new(), from, &mut s).unwrap() {
            Step::Done { addr, client_id } => assert_eq!((addr, client_id), (w.address(), 0)),
            other => panic!("{other:?}"),
        }
        assert!(!rucx_ucs::event::wait_readable(l.as_raw_fd(), Some(Duration::ZERO)).unwrap());
    }

    /// Hands out its chunks one per readiness: a read past the end of a chunk would block.
    struct Chunks {
        chunks: VecDeque<Vec<u8>>,
        blocked: bool,
        eof: bool,
    }

    impl Read for Chunks {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.blocked {
                return Err(ErrorKind::WouldBlock.into());
            }
            let Some(c) = self.chunks.front_mut() else {
                return if self.eof {
                    Ok(0)
                } else {
                    Err(ErrorKind::WouldBlock.into())
                };
            };
            let n = buf.len().min(c.len());
            buf[..n].copy_from_slice(&c[..n]);
            c.drain(..n);
            if c.is_empty() {
                self.chunks.pop_front();
                self.blocked = true;
            }
            Ok(n)
        }
    }

    /// Feed `bytes` cut at `cuts` to a handshake until it ends (or, without `eof`, waits for
    /// bytes that never come: `Canceled`): the bytes left unread and the outcome.
    fn feed(bytes: &[u8], cuts: &[usize], eof: bool) -> (usize, Result<Vec<u8>>) {
        let mut pieces = VecDeque::new();
        let mut at = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        for c in cuts.into_iter().chain([bytes.len()]) {
            if c > at {
                pieces.push_back(bytes[at..c].to_vec());
                at = c;
            }
        }
        let mut r = Chunks {
            chunks: pieces,
            blocked: false,
            eof,
        };
        let from: SocketAddr = "192.0.2.1:7".parse().unwrap();
        let mut got = Vec::new();
        loop {
            let unread = |r: &Chunks| r.chunks.iter().map(Vec::len).sum();
            match read_step(&mut got, from, &mut r) {
                Ok(Step::More) if r.chunks.is_empty() && !eof => {
                    return (0, Err(Error::Canceled));
                }
                Ok(Step::More) => r.blocked = false,
                Ok(Step::Done { addr, .. }) => return (unread(&r), Ok(addr)),
                Ok(Step::Rejected) => {
                    let e = Error::PeerAborted {
                        peer: from.to_string(),
                        reason: "rejected".into(),
                    };
                    return (unread(&r), Err(e));
                }
                Err(e) => return (unread(&r), Err(e)),
            }
        }
    }

    /// A peer that announces the largest address and sends only its header holds a buffer of
    /// what it sent (plus the read-ahead), not of what it announced (before: 1 MiB a peer, a
    /// GiB for a full house of handshakes); a large address in many pieces still comes whole.
    #[test]
    fn an_announced_length_is_not_allocated_before_it_arrives() {
        let from: SocketAddr = "192.0.2.1:7".parse().unwrap();
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&MAX_ADDR.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes());
        head.extend_from_slice(&[5; 100]);
        let mut r = Chunks {
            chunks: VecDeque::from([head]),
            blocked: false,
            eof: false,
        };
        let mut got = Vec::new();
        assert!(matches!(read_step(&mut got, from, &mut r), Ok(Step::More)));
        assert_eq!(got.len(), HEADER + 100);
        assert!(
            got.capacity() <= 2 * (HEADER + 100 + READ_AHEAD),
            "{} bytes held for a peer that sent {}",
            got.capacity(),
            got.len()
        );
        let addr: Vec<u8> = (0..MAX_ADDR).map(|i| i as u8).collect();
        let cuts: Vec<usize> = (1..40).map(|i| i * 27_001).collect();
        let (unread, back) = feed(&addr_message(&addr, 9), &cuts, false);
        assert_eq!((unread, back.unwrap()), (0, addr));
    }

    proptest! {
        #[test]
        fn any_cut_of_a_message_gives_its_address_and_reads_no_further(
            addr in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(any::<usize>(), 0..20),
            trailing in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            let mut bytes = addr_message(&addr, 0);
            let len = bytes.len();
            bytes.extend_from_slice(&trailing);
            let (unread, r) = feed(&bytes, &cuts, false);
            prop_assert_eq!(r.unwrap(), addr);
            // The reads asked for the rest of the message only.
            prop_assert_eq!(unread, bytes.len() - len);
        }

        #[test]
        fn a_truncated_message_waits_then_fails_when_the_peer_hangs_up(
            addr in proptest::collection::vec(any::<u8>(), 1..300),
            keep in any::<usize>(),
            cuts in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let bytes = addr_message(&addr, 0);
            let short = &bytes[..keep % bytes.len()];
            let (_, r) = feed(short, &cuts, false);
            prop_assert!(matches!(r, Err(Error::Canceled)), "still waiting: {:?}", r);
            let (_, r) = feed(short, &cuts, true);
            let e = r.unwrap_err().to_string();
            prop_assert!(e.contains("closed the connection after"), "{}", e);
        }

        #[test]
        fn garbage_fails_or_waits_and_never_reads_past_an_announced_length(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            cuts in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let (_, r) = feed(&bytes, &cuts, true);
            match r {
                Ok(a) => {
                    // Only a well-formed message gives an address.
                    prop_assert!(bytes.starts_with(MAGIC));
                    prop_assert_eq!(&bytes[HEADER..HEADER + a.len()], &a[..]);
                }
                Err(e) => {
                    let e = e.to_string();
                    prop_assert!(
                        e.contains("bad magic")
                            || e.contains("closed the connection")
                            || e.contains("announced a")
                            || (e.contains("rejected") && bytes.starts_with(MAGIC)),
                        "{}", e
                    );
                }
            }
        }
    }
}
