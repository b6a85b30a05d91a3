//! Socket set-up: non-blocking listen, connect and accept, and the per-connection options.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::{AsFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, connect, getsockopt,
    setsockopt, socket, sockopt,
};
use rucx_ucs::{Error, Result};

use crate::TcpOptions;

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
    use std::os::fd::AsRawFd;
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
    use std::os::fd::AsRawFd;
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

/// An epoll instance (level triggered) that the interface registers its listener and
/// connections with once, so a progress call asks the kernel for the ready ones only.
#[derive(Debug)]
pub(crate) struct Epoll {
    fd: OwnedFd,
    /// Room for the events one wait returns.
    buf: Vec<libc::epoll_event>,
}

/// Most events one [`Epoll::wait`] returns; the rest stay ready for the next call.
const EPOLL_BATCH: usize = 64;

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: plain system call with a valid flag; the result is checked before use.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor epoll_create1 just returned, owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Epoll {
            fd,
            buf: vec![libc::epoll_event { events: 0, u64: 0 }; EPOLL_BATCH],
        })
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut ev = libc::epoll_event { events, u64: key };
        // SAFETY: `self.fd` is our epoll descriptor, `ev` a valid event that lives across the
        // call (the kernel copies it); `fd` is a descriptor the caller keeps open.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watch `fd` for `events`, reported with `key`.
    pub(crate) fn add(&self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, key)
    }

    /// Change what `fd` is watched for.
    pub(crate) fn modify(&self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, key)
    }

    /// Stop watching `fd` (before it may be closed or handed on).
    pub(crate) fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    /// The ready descriptors now, without waiting: `(key, events)`. An error (EINTR) reads as
    /// nothing ready; the next call asks again.
    pub(crate) fn wait(&mut self) -> impl Iterator<Item = (u64, u32)> + '_ {
        use std::os::fd::AsRawFd;
        // SAFETY: `buf` holds EPOLL_BATCH initialized events and outlives the call; timeout 0.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr(),
                EPOLL_BATCH as i32,
                0,
            )
        };
        let n = usize::try_from(n).unwrap_or(0);
        self.buf[..n].iter().map(|e| {
            // Copies: the struct is packed on some targets.
            let (key, events) = (e.u64, e.events);
            (key, events)
        })
    }
}
