//! The sockaddr connection manager: how a client reaches a server by `host:port` and the two
//! exchange private data (UCP puts its worker address there) before any transport endpoint
//! exists.
//!
//! ```text
//! client                                   server
//!   connect(addr, blob) ---- Request(blob) ---> Listener::accept() -> ServerConn (blob)
//!   ClientConn::progress() <-- Accept(blob) --- ServerConn::accept(reply blob)
//!                          <-- Reject(why) ---- ServerConn::reject(why)
//! ```
//!
//! Every message is `magic: u32 = "RXCM"`, `version: u8`, `kind: u8`, `reserved: u16 = 0`,
//! `len: u32`, then `len` bytes (at most [`MAX_PRIVATE_DATA`]), all little endian. Everything is
//! non-blocking: [`Listener::accept`] and the `progress` methods return at once. A peer that
//! sends garbage, too much, or nothing within the handshake timeout is dropped (the listener
//! keeps serving everyone else). After the handshake the connection stays open so that each
//! side can notice the other going away ([`ClientConn::poll_disconnect`],
//! [`ServerConn::poll_disconnect`]).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use rucx_ucs::{Error, Result};

use crate::{TcpOptions, sock};

/// Largest private data blob either side may send.
pub const MAX_PRIVATE_DATA: usize = 64 * 1024;
const MAGIC: u32 = u32::from_le_bytes(*b"RXCM");
const VERSION: u8 = 1;
const HDR: usize = 12;
const KIND_REQUEST: u8 = 1;
const KIND_ACCEPT: u8 = 2;
const KIND_REJECT: u8 = 3;

/// Connection manager settings.
#[derive(Clone, Debug)]
pub struct CmOptions {
    /// How long a handshake may take (each side).
    pub timeout: Duration,
    /// Most connections in the middle of their handshake on one listener; more are refused.
    pub max_pending: usize,
    /// Socket options (keepalive, user timeout, nodelay).
    pub tcp: TcpOptions,
}

impl Default for CmOptions {
    fn default() -> Self {
        let tcp = TcpOptions::default();
        CmOptions {
            timeout: tcp.connect_timeout,
            max_pending: 128,
            tcp,
        }
    }
}

impl CmOptions {
    /// Settings from a configuration (`TCP_CONNECT_TIMEOUT` and the socket options).
    pub fn from_config(config: &rucx_ucs::Config) -> Result<CmOptions> {
        let tcp = TcpOptions::from_config(config)?;
        Ok(CmOptions {
            timeout: tcp.connect_timeout,
            max_pending: 128,
            tcp,
        })
    }
}

fn encode(kind: u8, blob: &[u8]) -> Vec<u8> {
    debug_assert!(blob.len() <= MAX_PRIVATE_DATA);
    let mut v = Vec::with_capacity(HDR + blob.len());
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.push(VERSION);
    v.push(kind);
    v.extend_from_slice(&0u16.to_le_bytes());
    v.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    v.extend_from_slice(blob);
    v
}

/// Validate a message header; returns `(kind, body length)`.
fn parse_header(h: &[u8; HDR], allowed: &[u8]) -> std::result::Result<(u8, usize), String> {
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        return Err(format!(
            "bad magic {magic:#010x}: not a rucx connection manager peer"
        ));
    }
    if h[4] != VERSION {
        return Err(format!(
            "peer speaks connection manager version {}, this build {VERSION}",
            h[4]
        ));
    }
    let kind = h[5];
    if !allowed.contains(&kind) {
        return Err(format!("unexpected message kind {kind}"));
    }
    if h[6] != 0 || h[7] != 0 {
        return Err("nonzero reserved bytes".into());
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > MAX_PRIVATE_DATA {
        return Err(format!(
            "private data of {len} bytes exceeds the limit of {MAX_PRIVATE_DATA}"
        ));
    }
    Ok((kind, len))
}

fn check_blob(blob: &[u8], what: &str) -> Result<()> {
    if blob.len() > MAX_PRIVATE_DATA {
        return Err(Error::InvalidParam(format!(
            "{what} of {} bytes exceeds the connection manager's limit of {MAX_PRIVATE_DATA} bytes",
            blob.len()
        )));
    }
    Ok(())
}

/// Reads exactly one message, in as many pieces as it arrives.
#[derive(Debug, Default)]
struct MsgReader {
    buf: Vec<u8>,
    have: usize,
    kind: Option<u8>,
}

impl MsgReader {
    /// Progress the read; `Ok(Some((kind, body)))` once complete.
    fn read(
        &mut self,
        s: &mut TcpStream,
        allowed: &[u8],
    ) -> std::result::Result<Option<(u8, &[u8])>, String> {
        loop {
            let need = match self.kind {
                None => HDR,
                Some(_) => self.buf.len(),
            };
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
            if self.have == need {
                if self.kind.is_none() {
                    let h: [u8; HDR] = self.buf[..HDR].try_into().expect("header");
                    let (kind, len) = parse_header(&h, allowed)?;
                    self.kind = Some(kind);
                    self.buf.resize(HDR + len, 0);
                    continue;
                }
                return Ok(Some((self.kind.expect("set"), &self.buf[HDR..])));
            }
            match s.read(&mut self.buf[self.have..need]) {
                Ok(0) => return Err("connection closed during the handshake".into()),
                Ok(n) => self.have += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("receive: {e}")),
            }
        }
    }
}

/// Write as much of `out[*sent..]` as the socket takes.
fn flush_out(s: &mut TcpStream, out: &[u8], sent: &mut usize) -> std::result::Result<bool, String> {
    while *sent < out.len() {
        match s.write(&out[*sent..]) {
            Ok(0) => return Err("send: connection closed".into()),
            Ok(n) => *sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("send: {e}")),
        }
    }
    Ok(true)
}

/// After the handshake: `Some(reason)` once the peer has gone (or broke the protocol).
fn check_closed(s: &mut TcpStream) -> Option<String> {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => Some("the peer closed the connection".into()),
        Ok(_) => Some("the peer sent data after the handshake".into()),
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            None
        }
        Err(e) => Some(format!("connection error: {e}")),
    }
}

/// Wait up to `timeout` for `flags` on `fd`.
fn wait_for<F: AsFd>(fd: &F, flags: PollFlags, timeout: Duration) {
    let ms = timeout.as_millis().min(1000) as u16;
    let mut p = [PollFd::new(fd.as_fd(), flags)];
    let _ = poll(&mut p, PollTimeout::from(ms));
}

/// A listening socket of the connection manager.
#[derive(Debug)]
pub struct Listener {
    listener: TcpListener,
    addr: SocketAddr,
    pending: Vec<Handshake>,
    opts: CmOptions,
}

#[derive(Debug)]
struct Handshake {
    stream: TcpStream,
    peer: SocketAddr,
    rx: MsgReader,
    deadline: Instant,
}

impl Listener {
    /// Listen on `host:port` (port 0: ephemeral; see [`local_addr`](Self::local_addr)).
    pub fn bind(addr: &str) -> Result<Listener> {
        Self::bind_with(addr, CmOptions::default())
    }

    /// [`bind`](Self::bind) with explicit settings.
    pub fn bind_with(addr: &str, opts: CmOptions) -> Result<Listener> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| {
                Error::InvalidAddress(format!("connection manager listen address {addr:?}: {e}"))
            })?
            .collect();
        let mut last = None;
        for a in addrs {
            match Self::bind_addr(a, opts.clone()) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .unwrap_or_else(|| Error::InvalidAddress(format!("{addr:?} resolves to no address"))))
    }

    /// Listen on a socket address.
    pub fn bind_addr(addr: SocketAddr, opts: CmOptions) -> Result<Listener> {
        let range = if addr.port() == 0 {
            (0, 0)
        } else {
            (addr.port(), addr.port())
        };
        let (listener, port) = sock::listen(addr.ip(), range, "connection manager")?;
        Ok(Listener {
            listener,
            addr: SocketAddr::new(addr.ip(), port),
            pending: Vec::new(),
            opts,
        })
    }

    /// The bound address (with the actual port).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections in the middle of their handshake.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Accept a client whose request (with its private data) has fully arrived, if any.
    /// Never blocks. Clients that misbehave or time out are dropped here, with a log line.
    pub fn accept(&mut self) -> Result<Option<ServerConn>> {
        let now = Instant::now();
        loop {
            match sock::accept_nb(&self.listener, &self.opts.tcp) {
                Ok(Some((fd, peer))) => {
                    if self.pending.len() >= self.opts.max_pending {
                        tracing::warn!(
                            "connection manager on {}: {} handshakes in progress, refusing {peer}",
                            self.addr,
                            self.pending.len()
                        );
                        continue;
                    }
                    self.pending.push(Handshake {
                        stream: TcpStream::from(fd),
                        peer,
                        rx: MsgReader::default(),
                        deadline: now + self.opts.timeout,
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(Error::io(
                        format!("connection manager on {}: accept", self.addr),
                        e,
                    ));
                }
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let h = &mut self.pending[i];
            let res =
                h.rx.read(&mut h.stream, &[KIND_REQUEST])
                    .map(|m| m.map(|(_, b)| b.to_vec()));
            match res {
                Ok(Some(data)) => {
                    let h = self.pending.swap_remove(i);
                    return Ok(Some(ServerConn {
                        stream: h.stream,
                        peer: h.peer,
                        client_data: data,
                        out: Vec::new(),
                        sent: 0,
                        deadline: now + self.opts.timeout,
                    }));
                }
                Ok(None) if now > h.deadline => {
                    tracing::warn!(
                        "connection manager on {}: {} sent no complete request in {:?}; dropped",
                        self.addr,
                        h.peer,
                        self.opts.timeout
                    );
                    self.pending.swap_remove(i);
                }
                Ok(None) => i += 1,
                Err(why) => {
                    tracing::warn!(
                        "connection manager on {}: dropping {}: {why}",
                        self.addr,
                        h.peer
                    );
                    self.pending.swap_remove(i);
                }
            }
        }
        Ok(None)
    }
}

/// The server's side of one client connection, from the moment its request arrived.
#[derive(Debug)]
pub struct ServerConn {
    stream: TcpStream,
    peer: SocketAddr,
    client_data: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
    deadline: Instant,
}

impl ServerConn {
    /// The client's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The client's private data.
    pub fn private_data(&self) -> &[u8] {
        &self.client_data
    }

    /// Accept the client, answering with our private data (sent by
    /// [`progress`](Self::progress); this call starts it).
    pub fn accept(&mut self, reply: &[u8]) -> Result<()> {
        check_blob(reply, "reply private data")?;
        if !self.out.is_empty() {
            return Err(Error::InvalidParam(format!(
                "the client {} was already answered",
                self.peer
            )));
        }
        self.out = encode(KIND_ACCEPT, reply);
        self.progress().map(|_| ())
    }

    /// Refuse the client with a reason (best effort) and close the connection.
    pub fn reject(mut self, reason: &str) {
        let r = &reason.as_bytes()[..reason.len().min(1024)];
        let msg = encode(KIND_REJECT, r);
        let mut sent = 0;
        let _ = flush_out(&mut self.stream, &msg, &mut sent);
    }

    /// Send what is left of the answer; true once all of it is out.
    pub fn progress(&mut self) -> Result<bool> {
        if self.out.is_empty() {
            return Ok(false);
        }
        let done =
            flush_out(&mut self.stream, &self.out, &mut self.sent).map_err(|r| self.err(&r))?;
        if !done && Instant::now() > self.deadline {
            return Err(Error::Timeout {
                after: Duration::ZERO,
                what: format!("sending the connection manager reply to {}", self.peer),
            });
        }
        Ok(done)
    }

    /// `Some(error)` once the client has gone.
    pub fn poll_disconnect(&mut self) -> Option<Error> {
        check_closed(&mut self.stream).map(|r| self.err(&r))
    }

    fn err(&self, reason: &str) -> Error {
        Error::EndpointFailure {
            peer: format!("connection manager client {}", self.peer),
            reason: reason.to_string(),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum ClientState {
    Connecting,
    Sending,
    Waiting,
    Accepted,
    Failed(String),
}

/// The client's side of a connection manager connection.
#[derive(Debug)]
pub struct ClientConn {
    stream: TcpStream,
    peer: SocketAddr,
    out: Vec<u8>,
    sent: usize,
    rx: MsgReader,
    state: ClientState,
    reply: Vec<u8>,
    deadline: Instant,
    timeout: Duration,
}

/// Connect to a server's listener, sending `private_data` (at most [`MAX_PRIVATE_DATA`]).
/// Returns at once; drive it with [`ClientConn::progress`] or [`ClientConn::wait`].
pub fn connect(addr: SocketAddr, private_data: &[u8]) -> Result<ClientConn> {
    connect_with(addr, private_data, &CmOptions::default())
}

/// [`connect`] with explicit settings.
pub fn connect_with(addr: SocketAddr, private_data: &[u8], opts: &CmOptions) -> Result<ClientConn> {
    check_blob(private_data, "private data")?;
    if addr.port() == 0 || addr.ip().is_unspecified() || addr.ip().is_multicast() {
        return Err(Error::InvalidAddress(format!(
            "cannot connect to {addr}: not a unicast address with a port"
        )));
    }
    let fd = sock::connect_nb(None, addr, &opts.tcp)?;
    Ok(ClientConn {
        stream: TcpStream::from(fd),
        peer: addr,
        out: encode(KIND_REQUEST, private_data),
        sent: 0,
        rx: MsgReader::default(),
        state: ClientState::Connecting,
        reply: Vec::new(),
        deadline: Instant::now() + opts.timeout,
        timeout: opts.timeout,
    })
}

impl ClientConn {
    /// The server's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn fail(&mut self, reason: String) -> Error {
        self.state = ClientState::Failed(reason.clone());
        self.err(&reason)
    }

    fn err(&self, reason: &str) -> Error {
        Error::EndpointFailure {
            peer: format!("connection manager server {}", self.peer),
            reason: reason.to_string(),
        }
    }

    /// Drive the handshake. `Ok(Some(server's private data))` once accepted; `Ok(None)` while
    /// in progress; an error when refused, timed out or broken.
    pub fn progress(&mut self) -> Result<Option<&[u8]>> {
        loop {
            match &self.state {
                ClientState::Failed(r) => return Err(self.err(r)),
                ClientState::Accepted => return Ok(Some(&self.reply)),
                ClientState::Connecting => {
                    let mut p = [PollFd::new(self.stream.as_fd(), PollFlags::POLLOUT)];
                    if poll(&mut p, PollTimeout::ZERO).unwrap_or(0) == 0 {
                        break;
                    }
                    match sock::connect_result(&self.stream) {
                        Ok(()) => self.state = ClientState::Sending,
                        Err(e) => return Err(self.fail(format!("connect: {e}"))),
                    }
                }
                ClientState::Sending => {
                    match flush_out(&mut self.stream, &self.out, &mut self.sent) {
                        Ok(true) => self.state = ClientState::Waiting,
                        Ok(false) => break,
                        Err(r) => return Err(self.fail(r)),
                    }
                }
                ClientState::Waiting => {
                    match self.rx.read(&mut self.stream, &[KIND_ACCEPT, KIND_REJECT]) {
                        Ok(None) => break,
                        Ok(Some((KIND_ACCEPT, body))) => {
                            self.reply = body.to_vec();
                            self.state = ClientState::Accepted;
                        }
                        Ok(Some((_, body))) => {
                            let why = format!(
                                "the server rejected the connection: {}",
                                String::from_utf8_lossy(body)
                            );
                            return Err(self.fail(why));
                        }
                        Err(r) => return Err(self.fail(r)),
                    }
                }
            }
        }
        if Instant::now() > self.deadline {
            let t = self.timeout;
            self.state = ClientState::Failed(format!("no answer within {t:?}"));
            return Err(Error::Timeout {
                after: t,
                what: format!("connection manager handshake with {}", self.peer),
            });
        }
        Ok(None)
    }

    /// Block until the handshake finishes (or fails, or its own timeout passes); returns the
    /// server's private data.
    pub fn wait(&mut self) -> Result<Vec<u8>> {
        loop {
            if let Some(r) = self.progress()? {
                return Ok(r.to_vec());
            }
            let flags = match self.state {
                ClientState::Connecting | ClientState::Sending => PollFlags::POLLOUT,
                _ => PollFlags::POLLIN,
            };
            wait_for(&self.stream, flags, Duration::from_millis(50));
        }
    }

    /// `Some(error)` once the server has gone (only meaningful after acceptance).
    pub fn poll_disconnect(&mut self) -> Option<Error> {
        if self.state != ClientState::Accepted {
            return None;
        }
        check_closed(&mut self.stream).map(|r| self.err(&r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn quick() -> CmOptions {
        CmOptions {
            timeout: Duration::from_millis(300),
            ..CmOptions::default()
        }
    }

    /// Drive both sides until the client has its answer.
    fn handshake(l: &mut Listener, c: &mut ClientConn, reply: &[u8]) -> (ServerConn, Vec<u8>) {
        let mut server = None;
        loop {
            if server.is_none() {
                server = l.accept().unwrap();
                if let Some(s) = server.as_mut() {
                    s.accept(reply).unwrap();
                }
            }
            if let Some(s) = server.as_mut() {
                s.progress().unwrap();
            }
            if let Some(r) = c.progress().unwrap() {
                let r = r.to_vec();
                let mut s = server.expect("accepted");
                while !s.progress().unwrap() {}
                return (s, r);
            }
        }
    }

    #[test]
    fn round_trip_with_ephemeral_port() {
        let mut l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr();
        assert_ne!(addr.port(), 0);
        let mut c = connect(addr, b"client worker address").unwrap();
        let (mut s, reply) = handshake(&mut l, &mut c, b"server worker address");
        assert_eq!(s.private_data(), b"client worker address");
        assert_eq!(reply, b"server worker address");
        assert!(s.peer_addr().ip().is_loopback());
        assert!(s.poll_disconnect().is_none());
        assert!(c.poll_disconnect().is_none());
        drop(c);
        let e = loop {
            if let Some(e) = s.poll_disconnect() {
                break e;
            }
        };
        assert!(e.to_string().contains("closed"), "{e}");
    }

    #[test]
    fn empty_and_maximal_blobs() {
        let mut l = Listener::bind("127.0.0.1:0").unwrap();
        let big: Vec<u8> = (0..MAX_PRIVATE_DATA).map(|i| (i * 13) as u8).collect();
        let mut c = connect(l.local_addr(), &big).unwrap();
        let (s, reply) = handshake(&mut l, &mut c, &[]);
        assert_eq!(s.private_data(), &big[..]);
        assert!(reply.is_empty());
        let mut c = connect(l.local_addr(), &[]).unwrap();
        let (s, reply) = handshake(&mut l, &mut c, &big);
        assert!(s.private_data().is_empty());
        assert_eq!(reply, big);
    }

    #[test]
    fn oversized_blob_is_refused_locally() {
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let e = connect(l.local_addr(), &vec![0; MAX_PRIVATE_DATA + 1]).unwrap_err();
        assert!(e.to_string().contains("limit"), "{e}");
        let e = connect("0.0.0.0:1".parse().unwrap(), b"").unwrap_err();
        assert!(matches!(e, Error::InvalidAddress(_)));
    }

    #[test]
    fn reject_reaches_the_client() {
        let mut l = Listener::bind("127.0.0.1:0").unwrap();
        let mut c = connect(l.local_addr(), b"hi").unwrap();
        let s = loop {
            c.progress().unwrap();
            if let Some(s) = l.accept().unwrap() {
                break s;
            }
        };
        s.reject("no room");
        let e = c.wait().unwrap_err();
        assert!(
            e.to_string().contains("rejected") && e.to_string().contains("no room"),
            "{e}"
        );
    }

    #[test]
    fn garbage_and_silent_clients_are_dropped_and_others_served() {
        let mut l = Listener::bind_with("127.0.0.1:0", quick()).unwrap();
        let addr = l.local_addr();
        // Wrong magic.
        let mut g1 = TcpStream::connect(addr).unwrap();
        g1.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        // Valid header announcing too much data.
        let mut g2 = TcpStream::connect(addr).unwrap();
        let mut h = encode(KIND_REQUEST, b"");
        h[8..12].copy_from_slice(&(MAX_PRIVATE_DATA as u32 + 1).to_le_bytes());
        g2.write_all(&h).unwrap();
        // A server message kind from a client.
        let mut g3 = TcpStream::connect(addr).unwrap();
        g3.write_all(&encode(KIND_ACCEPT, b"x")).unwrap();
        // Says nothing at all.
        let _silent = TcpStream::connect(addr).unwrap();
        // Truncated request, then gone.
        let mut g4 = TcpStream::connect(addr).unwrap();
        g4.write_all(&encode(KIND_REQUEST, b"abcdef")[..15])
            .unwrap();
        drop(g4);
        // A good client among them.
        let mut c = connect_with(addr, b"good", &quick()).unwrap();
        let (s, reply) = handshake(&mut l, &mut c, b"welcome");
        assert_eq!(s.private_data(), b"good");
        assert_eq!(reply, b"welcome");
        // Every bad one goes away (the silent one at its timeout); none is ever accepted.
        loop {
            assert!(l.accept().unwrap().is_none());
            if l.pending() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut b = [0u8; 1];
        assert_eq!(
            g1.read(&mut b).unwrap_or(0),
            0,
            "garbage client was disconnected"
        );
    }

    #[test]
    fn connect_to_nothing_fails() {
        // Bind, learn a free port, close it: nobody listens there now.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut c = connect(SocketAddr::from(([127, 0, 0, 1], port)), b"x").unwrap();
        let e = c.wait().unwrap_err();
        assert!(e.to_string().contains("connect"), "{e}");
    }

    #[test]
    fn silent_server_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = connect_with(l.local_addr().unwrap(), b"x", &quick()).unwrap();
        let e = c.wait().unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
    }

    #[test]
    fn ipv6_loopback_when_available() {
        let Ok(mut l) = Listener::bind("[::1]:0") else {
            eprintln!("skipped: no IPv6 loopback here");
            return;
        };
        let mut c = connect(l.local_addr(), b"six").unwrap();
        let (s, reply) = handshake(&mut l, &mut c, b"ok");
        assert_eq!(s.private_data(), b"six");
        assert_eq!(reply, b"ok");
    }

    proptest! {
        #[test]
        fn garbage_headers_never_panic(h in proptest::array::uniform12(any::<u8>())) {
            let _ = parse_header(&h, &[KIND_REQUEST, KIND_ACCEPT, KIND_REJECT]);
        }

        #[test]
        fn headers_round_trip(len in 0usize..=MAX_PRIVATE_DATA, kind in 1u8..=3) {
            let m = encode(kind, &vec![0; len]);
            let h: [u8; HDR] = m[..HDR].try_into().unwrap();
            prop_assert_eq!(parse_header(&h, &[kind]).unwrap(), (kind, len));
            prop_assert!(parse_header(&h, &[]).is_err());
        }
    }
}
