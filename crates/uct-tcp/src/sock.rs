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

/// The interface's set of watched sockets: registered with epoll, and mirrored in a `poll(2)`
/// array used while the set is small. With a handful of sockets, `poll` reads each socket's
/// state where it is; `epoll_wait` shares its ready list (and its lock) with the softirq that
/// delivers every packet, which costs a spinning reader more than scanning a few sockets.
#[derive(Debug)]
pub(crate) struct Watch {
    epoll: Epoll,
    pollfds: Vec<libc::pollfd>,
    /// Key of each `pollfds` entry.
    keys: Vec<u64>,
    /// Index in `pollfds` by key, for keys below `u32::MAX` (slot indices).
    pos: Vec<usize>,
}

/// At most this many sockets are polled with `poll(2)`; more go through `epoll_wait`.
pub(crate) const POLL_MAX: usize = 8;

fn to_poll(events: u32) -> i16 {
    let mut p = 0;
    for (e, q) in [
        (libc::EPOLLIN, libc::POLLIN),
        (libc::EPOLLOUT, libc::POLLOUT),
    ] {
        if events & e as u32 != 0 {
            p |= q;
        }
    }
    p
}

fn from_poll(revents: i16) -> u32 {
    let mut e = 0;
    for (q, x) in [
        (libc::POLLIN, libc::EPOLLIN),
        (libc::POLLOUT, libc::EPOLLOUT),
        (libc::POLLERR, libc::EPOLLERR),
        (libc::POLLHUP, libc::EPOLLHUP),
        (libc::POLLNVAL, libc::EPOLLERR),
    ] {
        if revents & q != 0 {
            e |= x as u32;
        }
    }
    e
}

impl Watch {
    pub(crate) fn new() -> io::Result<Watch> {
        Ok(Watch {
            epoll: Epoll::new()?,
            pollfds: Vec::new(),
            keys: Vec::new(),
            pos: Vec::new(),
        })
    }

    /// Watch `fd` for `events` (epoll flags), reported with `key`.
    pub(crate) fn add(&mut self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.epoll.add(fd, events, key)?;
        if let Ok(k) = usize::try_from(key)
            && key < u64::from(u32::MAX)
        {
            if self.pos.len() <= k {
                self.pos.resize(k + 1, usize::MAX);
            }
            self.pos[k] = self.pollfds.len();
        }
        self.pollfds.push(libc::pollfd {
            fd,
            events: to_poll(events),
            revents: 0,
        });
        self.keys.push(key);
        Ok(())
    }

    fn index(&self, key: u64) -> Option<usize> {
        let i = *self.pos.get(usize::try_from(key).ok()?)?;
        (i != usize::MAX).then_some(i)
    }

    /// Change what `fd` (watched with `key`) is watched for.
    pub(crate) fn modify(&mut self, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        self.epoll.modify(fd, events, key)?;
        if let Some(i) = self.index(key) {
            self.pollfds[i].events = to_poll(events);
        }
        Ok(())
    }

    /// Stop watching `fd` (watched with `key`), before it may be closed.
    pub(crate) fn delete(&mut self, fd: RawFd, key: u64) {
        let _ = self.epoll.delete(fd);
        if let Some(i) = self.index(key) {
            self.pos[key as usize] = usize::MAX;
            self.pollfds.swap_remove(i);
            self.keys.swap_remove(i);
            if let Some(&moved) = self.keys.get(i)
                && let Some(p) = self.pos.get_mut(moved as usize)
            {
                *p = i;
            }
        }
    }

    /// Report every ready socket now, without waiting: `f(key, epoll events)`. An error
    /// (EINTR) reads as nothing ready; the next call asks again.
    pub(crate) fn wait(&mut self, mut f: impl FnMut(u64, u32)) {
        if self.pollfds.len() > POLL_MAX {
            for (key, ev) in self.epoll.wait() {
                f(key, ev);
            }
            return;
        }
        // SAFETY: `pollfds` is an initialized array of `len` pollfd structures that lives
        // across the call; every descriptor in it is kept open by its owner until `delete`.
        let rc = unsafe {
            libc::poll(
                self.pollfds.as_mut_ptr(),
                self.pollfds.len() as libc::nfds_t,
                0,
            )
        };
        if rc <= 0 {
            return;
        }
        for (p, &key) in self.pollfds.iter().zip(&self.keys) {
            if p.revents != 0 {
                f(key, from_poll(p.revents));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn ready(w: &mut Watch) -> Vec<(u64, u32)> {
        let mut v = Vec::new();
        w.wait(|k, e| v.push((k, e)));
        v.sort_unstable();
        v
    }

    /// Readiness is reported the same way through `poll` (few sockets) and epoll (many), and
    /// deleting sockets from the middle keeps the others' keys.
    #[test]
    fn watch_reports_ready_sockets_by_key_in_both_modes() {
        const IN: u32 = libc::EPOLLIN as u32;
        const OUT: u32 = libc::EPOLLOUT as u32;
        let mut w = Watch::new().unwrap();
        let pairs: Vec<(UnixStream, UnixStream)> = (0..POLL_MAX + 4)
            .map(|_| UnixStream::pair().unwrap())
            .collect();
        let watched = |n: usize| (0..n).map(|k| k as u64);
        // Few sockets: poll.
        for k in watched(3) {
            w.add(pairs[k as usize].0.as_raw_fd(), IN, k).unwrap();
        }
        assert!(ready(&mut w).is_empty());
        (&pairs[1].1).write_all(b"x").unwrap();
        assert_eq!(ready(&mut w), vec![(1, IN)]);
        w.modify(pairs[2].0.as_raw_fd(), IN | OUT, 2).unwrap();
        assert_eq!(ready(&mut w), vec![(1, IN), (2, OUT)]);
        // Many: epoll, same answers.
        for k in 3..pairs.len() as u64 {
            w.add(pairs[k as usize].0.as_raw_fd(), IN, k).unwrap();
        }
        (&pairs[9].1).write_all(b"x").unwrap();
        assert_eq!(ready(&mut w), vec![(1, IN), (2, OUT), (9, IN)]);
        // Delete from the middle until poll is used again; the moved entries keep their keys.
        for k in [0u64, 1, 4, 5, 6] {
            w.delete(pairs[k as usize].0.as_raw_fd(), k);
        }
        assert!(w.pollfds.len() <= POLL_MAX);
        assert_eq!(ready(&mut w), vec![(2, OUT), (9, IN)]);
        w.modify(pairs[2].0.as_raw_fd(), IN, 2).unwrap();
        (&pairs[pairs.len() - 1].1).write_all(b"x").unwrap();
        assert_eq!(ready(&mut w), vec![(9, IN), ((pairs.len() - 1) as u64, IN)]);
    }
}
