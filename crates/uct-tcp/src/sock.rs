//! The sockets: non-blocking listen, connect and accept, the per-connection options, and the
//! socket types the protocol reads and writes through ([`FdSock`], owned by a connection, and
//! [`RawSock`], the interface's lock-free reader of the same descriptor). Every system call on
//! a connection's socket is here; readiness (`poll(2)`, epoll) is in `ready`.

use std::io::{self, IoSlice};
use std::net::{IpAddr, Shutdown, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, Backlog, MsgFlags, SockFlag, SockType, SockaddrIn, SockaddrStorage, bind,
    connect, getsockname, getsockopt, recv, sendmsg, setsockopt, socket, sockopt,
};
use rucx_ucs::{Error, Result};

use crate::TcpOptions;
use crate::stream::{OwnedSock, RawRecv, Sock};
use crate::wire::MAX_IOV;

/// Listen on `ip` at a port from `range` (`(0, 0)`: ephemeral). Returns the listener
/// (non-blocking) and its port.
pub(crate) fn listen(ip: IpAddr, range: (u16, u16), what: &str) -> Result<(TcpListener, u16)> {
    let ports: Box<dyn Iterator<Item = u16>> = if range == (0, 0) {
        Box::new(std::iter::once(0))
    } else {
        Box::new(range.0..=range.1)
    };
    let mut last = None;
    for port in ports {
        match listen_one(SocketAddr::new(ip, port)) {
            Ok(l) => {
                let port = l
                    .local_addr()
                    .map_err(|e| Error::io(format!("{what}: reading the listening address"), e))?
                    .port();
                return Ok((l, port));
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => {
                return Err(Error::io(
                    format!("{what}: cannot listen on {ip} port {port}"),
                    e,
                ));
            }
        }
    }
    Err(Error::io(
        format!(
            "{what}: every port of {}-{} on {ip} is in use (widen RUCX_TCP_PORT_RANGE)",
            range.0, range.1
        ),
        last.unwrap_or_else(|| io::ErrorKind::AddrInUse.into()),
    ))
}

/// A non-blocking listener with the largest backlog the system allows (std's is 128, which
/// drops connections when many peers wire up at once).
fn listen_one(addr: SocketAddr) -> io::Result<TcpListener> {
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    nix::sys::socket::listen(&fd, Backlog::MAXALLOWABLE)?;
    Ok(TcpListener::from(fd))
}

/// Start a non-blocking connect to `peer`, from `local` when given. Returns the socket; the
/// connect finishes when it becomes writable ([`connect_result`]).
pub(crate) fn connect_nb(
    local: Option<IpAddr>,
    peer: SocketAddr,
    opts: &TcpOptions,
) -> Result<OwnedFd> {
    let family = match peer {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Error::io(format!("socket() for a connection to {peer}"), e.into()))?;
    apply_options(&fd, opts)
        .map_err(|e| Error::io(format!("setting socket options for {peer}"), e))?;
    if let Some(ip) = local {
        let a = SockaddrStorage::from(SocketAddr::new(ip, 0));
        bind(fd.as_raw_fd(), &a)
            .map_err(|e| Error::io(format!("binding to {ip} to connect to {peer}"), e.into()))?;
    }
    match connect(fd.as_raw_fd(), &SockaddrStorage::from(peer)) {
        Ok(()) | Err(Errno::EINPROGRESS) | Err(Errno::EINTR) => Ok(fd),
        Err(e) => Err(Error::EndpointFailure {
            peer: peer.to_string(),
            reason: format!("connect: {e}"),
        }),
    }
}

/// Whether a non-blocking connect finished: `Ok(())` connected, `Err` failed.
pub(crate) fn connect_result<F: AsFd>(fd: &F) -> io::Result<()> {
    let err = getsockopt(fd, sockopt::SocketError).map_err(io::Error::from)?;
    if err == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(err))
    }
}

/// Accept one connection if one is waiting; the socket is non-blocking with `opts` applied.
pub(crate) fn accept_nb(
    l: &TcpListener,
    opts: &TcpOptions,
) -> io::Result<Option<(OwnedFd, SocketAddr)>> {
    match l.accept() {
        Ok((s, peer)) => {
            s.set_nonblocking(true)?;
            let fd = OwnedFd::from(s);
            apply_options(&fd, opts)?;
            Ok(Some((fd, peer)))
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(None),
        // The peer gave up before we accepted: nothing to do.
        Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => Ok(None),
        Err(e) => Err(e),
    }
}

/// Socket options for every transport connection.
pub(crate) fn apply_options<F: AsFd>(fd: &F, o: &TcpOptions) -> io::Result<()> {
    let set = |r: nix::Result<()>| r.map_err(io::Error::from);
    if o.nodelay {
        set(setsockopt(fd, sockopt::TcpNoDelay, &true))?;
    }
    if o.keepalive {
        set(setsockopt(fd, sockopt::KeepAlive, &true))?;
        set(setsockopt(
            fd,
            sockopt::TcpKeepIdle,
            &(o.keepidle.as_secs() as u32),
        ))?;
        set(setsockopt(
            fd,
            sockopt::TcpKeepInterval,
            &(o.keepintvl.as_secs() as u32),
        ))?;
        set(setsockopt(fd, sockopt::TcpKeepCount, &o.keepcnt))?;
    }
    if !o.user_timeout.is_zero() {
        set(setsockopt(
            fd,
            sockopt::TcpUserTimeout,
            &(o.user_timeout.as_millis() as u32),
        ))?;
    }
    if let Some(b) = o.sndbuf {
        set(setsockopt(fd, sockopt::SndBuf, &b))?;
    }
    if let Some(b) = o.rcvbuf {
        set(setsockopt(fd, sockopt::RcvBuf, &b))?;
    }
    Ok(())
}

/// A non-blocking stream socket owned by a connection (TCP, or a Unix socketpair in tests).
#[derive(Debug)]
pub(crate) struct FdSock(pub(crate) OwnedFd);

fn send_nosignal(fd: RawFd, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // MSG_NOSIGNAL: a reset peer yields EPIPE instead of killing the process with SIGPIPE.
    sendmsg::<()>(fd, bufs, &[], MsgFlags::MSG_NOSIGNAL, None).map_err(io::Error::from)
}

impl Sock for FdSock {
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_nosignal(self.0.as_raw_fd(), bufs)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        recv(self.0.as_raw_fd(), buf, MsgFlags::empty()).map_err(io::Error::from)
    }
}

impl OwnedSock for FdSock {
    fn connect_status(&mut self) -> Option<io::Result<()>> {
        let mut p = [libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        }];
        // SAFETY: one valid pollfd for a descriptor this socket owns; timeout 0.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), 1, 0) };
        if rc <= 0 {
            return None;
        }
        Some(connect_result(&self.0))
    }

    fn connect_result(&mut self) -> io::Result<()> {
        connect_result(&self.0)
    }

    fn shutdown(&mut self, how: Shutdown) {
        let how = match how {
            Shutdown::Read => nix::sys::socket::Shutdown::Read,
            Shutdown::Write => nix::sys::socket::Shutdown::Write,
            Shutdown::Both => nix::sys::socket::Shutdown::Both,
        };
        let _ = nix::sys::socket::shutdown(self.0.as_raw_fd(), how);
    }

    fn local_addr(&self) -> io::Result<SocketAddrV4> {
        getsockname::<SockaddrIn>(self.0.as_raw_fd())
            .map(SocketAddrV4::from)
            .map_err(io::Error::from)
    }
}

/// A borrowed socket descriptor: lets the interface read a connection without taking the lock
/// that endpoints take to write it (the descriptor's owner, an [`FdSock`], keeps it open).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawSock(pub(crate) RawFd);

impl Sock for RawSock {
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_nosignal(self.0, bufs)
    }

    /// One `recv(2)`, called directly: the polling receiver's read that finds nothing (the
    /// usual one) is this call's whole cost, so no wrapper's errno conversion rides on it.
    #[inline]
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is writable for its length and the kernel writes at most that much.
        unsafe { self.recv_raw(buf.as_mut_ptr(), buf.len()) }
    }
}

impl RawRecv for RawSock {
    #[inline]
    unsafe fn recv_raw(&mut self, ptr: *mut u8, len: usize) -> io::Result<usize> {
        // SAFETY: the caller guarantees `ptr` is writable for `len` bytes; the kernel writes at
        // most `len` bytes there.
        let n = unsafe { libc::recv(self.0, ptr.cast(), len, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    unsafe fn recv_raw_vectored(&mut self, bufs: &[(*mut u8, usize)]) -> io::Result<usize> {
        debug_assert!(bufs.len() <= MAX_IOV);
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_IOV];
        let mut cnt: libc::c_int = 0;
        for (v, &(p, l)) in iov.iter_mut().zip(bufs) {
            *v = libc::iovec {
                iov_base: p.cast(),
                iov_len: l,
            };
            cnt += 1;
        }
        // SAFETY: the caller guarantees every buffer is writable for its length and that no
        // Rust reference to that memory is live; the kernel writes at most the iovecs' lengths,
        // and `iov` outlives the call.
        let n = unsafe { libc::readv(self.0, iov.as_ptr(), cnt) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair() -> (FdSock, FdSock) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (FdSock(a.into()), FdSock(b.into()))
    }

    /// The descriptor-backed sockets move bytes, receive into raw memory and report the end of
    /// the stream like the in-memory one the protocol tests use.
    #[test]
    fn fd_sockets_move_bytes_and_report_eof() {
        let (mut a, b) = pair();
        let mut r = RawSock(b.0.as_raw_fd());
        let mut buf = [0u8; 16];
        assert_eq!(
            r.recv(&mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        assert_eq!(
            a.send_vectored(&[IoSlice::new(b"abc"), IoSlice::new(b"defgh")])
                .unwrap(),
            8
        );
        assert_eq!(r.recv(&mut buf[..2]).unwrap(), 2);
        assert_eq!(&buf[..2], b"ab");
        // SAFETY: `buf` is writable for 16 bytes and not otherwise borrowed during the call.
        let n = unsafe { r.recv_raw(buf.as_mut_ptr(), 1) }.unwrap();
        assert_eq!((n, buf[0]), (1, b'c'));
        let (mut x, mut y) = ([0u8; 2], [0u8; 8]);
        // SAFETY: both buffers are writable for their lengths and not borrowed during the call.
        let n =
            unsafe { r.recv_raw_vectored(&[(x.as_mut_ptr(), 2), (y.as_mut_ptr(), 8)]) }.unwrap();
        assert_eq!((n, &x, &y[..3]), (5, b"de", &b"fgh"[..]));
        assert!(a.connect_status().unwrap().is_ok());
        a.shutdown(Shutdown::Write);
        assert_eq!(r.recv(&mut buf).unwrap(), 0, "end of stream");
        drop(b);
    }

    #[test]
    fn tcp_connect_and_local_address() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = l.local_addr().unwrap();
        let fd = connect_nb(None, peer, &TcpOptions::default()).unwrap();
        let mut s = FdSock(fd);
        let (acc, from) = l.accept().unwrap();
        let start = std::time::Instant::now();
        while s.connect_status().is_none() {
            assert!(start.elapsed().as_secs() < 10, "connect hangs");
        }
        assert!(s.connect_result().is_ok());
        assert_eq!(SocketAddr::V4(s.local_addr().unwrap()), from);
        drop(acc);
    }
}
