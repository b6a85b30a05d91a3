//! Client/server wire-up: a worker listens on `host:port`; a peer that knows only that address
//! connects, the two exchange worker addresses over the socket, and each gets an endpoint.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use rucx_ucs::{Error, Result};

use crate::worker::{EpId, Worker};

const MAGIC: &[u8; 8] = b"RUCXCM01";
const MAX_ADDR: u32 = 1 << 20;

/// A listening socket of a worker; see [`Worker::listen`].
#[derive(Debug)]
pub struct Listener {
    sock: TcpListener,
    addr: SocketAddr,
}

impl Listener {
    /// The bound address (with the port chosen by the system when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

fn send_addr(s: &mut TcpStream, addr: &[u8]) -> Result<()> {
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&(addr.len() as u32).to_le_bytes());
    b.extend_from_slice(addr);
    s.write_all(&b)
        .map_err(|e| Error::io("connection manager: sending the worker address", e))
}

fn recv_addr(s: &mut TcpStream) -> Result<Vec<u8>> {
    let io = |e| Error::io("connection manager: receiving the peer's worker address", e);
    let mut m = [0u8; 12];
    s.read_exact(&mut m).map_err(io)?;
    if &m[..8] != MAGIC {
        return Err(Error::InvalidAddress(
            "connection manager: the peer is not a rucx worker (bad magic)".into(),
        ));
    }
    let n = u32::from_le_bytes([m[8], m[9], m[10], m[11]]);
    if n > MAX_ADDR {
        return Err(Error::InvalidAddress(format!(
            "connection manager: a {n}-byte worker address"
        )));
    }
    let mut a = vec![0u8; n as usize];
    s.read_exact(&mut a).map_err(io)?;
    Ok(a)
}

impl Worker {
    /// Listen for peers on `addr` (`"0.0.0.0:13337"`, `"127.0.0.1:0"`, ...).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener> {
        let sock = TcpListener::bind(addr).map_err(|e| Error::io("listen", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("listen: non-blocking", e))?;
        let addr = sock.local_addr().map_err(|e| Error::io("listen", e))?;
        Ok(Listener { sock, addr })
    }

    /// Accept one waiting peer, if any (never blocks for a peer to arrive): exchange worker
    /// addresses and return the endpoint to it.
    pub fn accept(&self, l: &Listener) -> Result<Option<EpId>> {
        match l.sock.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false)
                    .and_then(|_| s.set_read_timeout(Some(Duration::from_secs(10))))
                    .map_err(|e| Error::io("accept", e))?;
                let peer = recv_addr(&mut s).map_err(|e| match e {
                    Error::InvalidAddress(m) => Error::InvalidAddress(format!("{m} (from {from})")),
                    other => other,
                })?;
                send_addr(&mut s, &self.address())?;
                self.connect(&peer).map(Some)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(Error::io("accept", e)),
        }
    }

    /// Connect to a peer listening on `addr`, waiting at most `timeout` for it to answer.
    pub fn connect_sockaddr(&self, addr: impl ToSocketAddrs, timeout: Duration) -> Result<EpId> {
        let target = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("connect: resolving the address", e))?
            .next()
            .ok_or_else(|| {
                Error::InvalidParam("connect: the address resolves to nothing".into())
            })?;
        let deadline = Instant::now() + timeout;
        let mut s = loop {
            match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::io(format!("connect to {target}"), e));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        s.set_read_timeout(Some(timeout.max(Duration::from_millis(100))))
            .map_err(|e| Error::io("connect", e))?;
        send_addr(&mut s, &self.address())?;
        let peer = recv_addr(&mut s)?;
        self.connect(&peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_on_the_socket_is_an_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = TcpStream::connect(a).unwrap();
            c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        });
        let (mut s, _) = l.accept().unwrap();
        let e = recv_addr(&mut s).unwrap_err();
        assert!(e.to_string().contains("not a rucx worker"), "{e}");
        t.join().unwrap();
    }
}
