//! The client side of the connection manager without blocking
//! ([`Worker::connect_sockaddr_nb`]): the endpoint id is handed out at once, and worker progress
//! moves its connection along (a non-blocking TCP connect to the listener, our address out,
//! the server's address in, then the endpoint is wired up as [`Worker::connect`] wires one).
//! The sockets are in an epoll set of their own whose descriptor is in the worker's event set,
//! so a worker sleeping in [`Worker::wait`] (or a caller on [`Worker::event_fd`]) wakes when a
//! connection moves.
//!
//! Queued requests posted on the endpoint meanwhile (tag, stream and active-message sends,
//! flushes: the forms the C ABI posts) wait here in the order they were posted and are posted
//! once it is connected, before anything posted after. A stream receive needs no connection
//! and is posted at once. A server that turns the request away, a connection refused or
//! unreachable, a server that closes the socket or answers nothing within the timeout: the
//! endpoint fails ([`State::fail_peer_with`], so its error handler is told) and the waiting
//! requests end with the same error. [`Worker::close`] of an endpoint still connecting drops the
//! connection and ends them with [`Error::Canceled`] at once.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, getsockopt, socket, sockopt,
};
use rucx_ucs::RawBuf;
use rucx_ucs::event::EventSet;

use super::owned::Queued;
use crate::listener::{ConnectOpts, Step, addr_message, read_step};
use crate::worker::prelude::*;

/// A request posted on an endpoint still connecting, waiting to be posted.
#[derive(Debug)]
pub(crate) enum Held {
    Tag {
        buf: RawBuf,
        tag: Tag,
        sync: bool,
    },
    Stream {
        buf: RawBuf,
    },
    Am {
        id: u16,
        header: Vec<u8>,
        buf: RawBuf,
    },
    Flush,
}

/// The held requests of one endpoint, in the order they were posted, with their tokens.
type HeldList = VecDeque<(u64, Held)>;

#[derive(Debug)]
enum Phase {
    /// The TCP connect is under way (the socket becomes writable when it ends).
    Connecting,
    /// Sending our address message, `.0` bytes of it out.
    Sending(usize),
    /// Reading the server's answer, what came so far.
    Receiving(Vec<u8>),
}

#[derive(Debug)]
struct Client {
    p: usize,
    sock: TcpStream,
    target: SocketAddr,
    phase: Phase,
    msg: Vec<u8>,
    started: Instant,
    deadline: Instant,
    held: HeldList,
}

/// The connections under way of a worker.
#[derive(Debug, Default)]
pub(crate) struct Clients {
    list: Vec<Client>,
    /// Their sockets, made with the first.
    set: Option<EventSet>,
    /// Ended connections whose held requests wait to be posted or ended (by the worker, which
    /// the state's borrow does not allow inside the step).
    ended: Vec<(usize, Result<()>, HeldList)>,
}

impl Clients {
    fn find(&mut self, p: usize) -> Option<&mut Client> {
        self.list.iter_mut().find(|c| c.p == p)
    }
}

/// A non-blocking connect to `to` from `local` (when given): the socket, connected or on its
/// way (writable when done).
fn start_connect(to: SocketAddr, local: Option<SocketAddr>) -> Result<TcpStream> {
    let family = match to {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let io = |what: &str, e: nix::Error| Error::io(format!("connect to {to}: {what}"), e.into());
    let fd: OwnedFd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| io("socket()", e))?;
    if let Some(l) = local {
        bind(fd.as_raw_fd(), &SockaddrStorage::from(l))
            .map_err(|e| io(&format!("binding to {l}"), e))?;
    }
    match connect(fd.as_raw_fd(), &SockaddrStorage::from(to)) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) | Err(nix::errno::Errno::EINTR) => {}
        Err(e) => return Err(io("connect()", e)),
    }
    Ok(TcpStream::from(fd))
}

impl Client {
    /// Move the connection along as far as the socket allows: `Ok(Some(addr))` with the
    /// server's address once it came, `Ok(None)` to wait.
    fn step(&mut self, set: &EventSet) -> Result<Option<Vec<u8>>> {
        let to = self.target;
        loop {
            match &mut self.phase {
                Phase::Connecting => {
                    // Done once the socket is writable; its error says how.
                    let fd = self.sock.as_fd();
                    let mut pfd = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLOUT)];
                    let n = nix::poll::poll(&mut pfd, nix::poll::PollTimeout::ZERO)
                        .map_err(|e| Error::io(format!("connect to {to}: poll"), e.into()))?;
                    if n == 0 {
                        return Ok(None);
                    }
                    let err = getsockopt(&self.sock, sockopt::SocketError)
                        .map_err(|e| Error::io(format!("connect to {to}"), e.into()))?;
                    if err != 0 {
                        return Err(Error::io(
                            format!("connect to {to}"),
                            std::io::Error::from_raw_os_error(err),
                        ));
                    }
                    self.phase = Phase::Sending(0);
                }
                Phase::Sending(off) => match self.sock.write(&self.msg[*off..]) {
                    Ok(n) => {
                        *off += n;
                        if *off == self.msg.len() {
                            self.phase = Phase::Receiving(Vec::new());
                            // Readable from now on only (writable would wake sleepers always).
                            set.watch(self.sock.as_raw_fd(), self.p as u64, false, true)
                                .map_err(|e| Error::io("connection manager: its event set", e))?;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(Error::io(
                            format!("connection manager: sending our address to {to}"),
                            e,
                        ));
                    }
                },
                Phase::Receiving(got) => {
                    return match read_step(got, to, &mut self.sock) {
                        Ok(Step::More) => Ok(None),
                        Ok(Step::Done { addr, .. }) => Ok(Some(addr)),
                        Ok(Step::Rejected) => Err(Error::PeerAborted {
                            peer: format!("the server at {to}"),
                            reason: "connection request rejected by the server".into(),
                        }),
                        // The server closed or broke the connection before it answered.
                        Err(Error::InvalidAddress(why))
                            if why.contains("closed the connection") =>
                        {
                            Err(Error::EndpointFailure {
                                peer: format!("the server at {to}"),
                                reason: why,
                            })
                        }
                        Err(e @ Error::Io { .. }) => Err(Error::EndpointFailure {
                            peer: format!("the server at {to}"),
                            reason: e.to_string(),
                        }),
                        Err(e) => Err(e),
                    };
                }
            }
        }
    }
}

impl State {
    /// A new endpoint whose peer the connection manager has not named yet (no address, no
    /// lanes): only progress' connection step connects it.
    fn cm_peer(&mut self, to: SocketAddr) -> usize {
        let remote = WorkerAddress {
            uuid: 0,
            host: format!("the server at {to}"),
            pid: 0,
            proc: crate::address::ProcStamp {
                boot: 0,
                pidns: 0,
                start: 0,
            },
            ifaces: Vec::new(),
        };
        let p = self.peers.len();
        self.peers.push(Peer::new(remote));
        self.peers[p].cm_pending = true;
        p
    }

    /// The server answered with its address: endpoint `p` becomes the endpoint to it.
    fn cm_connected(&mut self, p: usize, addr: &[u8], ifaces: &mut [Box<dyn Iface>]) -> Result<()> {
        let remote = WorkerAddress::unpack(addr)?;
        self.refuse_while_closing(remote.uuid)?;
        // Messages from that worker reach this endpoint from now on (as a reconnect's).
        self.by_uuid.insert(remote.uuid, p);
        self.last_src.set(NO_LAST_SRC);
        self.peers[p].remote = remote;
        self.peers[p].cm_pending = false;
        self.connect_peer(p, ifaces)?;
        self.pump(p);
        Ok(())
    }
}

impl Worker {
    /// Connect to a peer listening on `addr` (a [`Listener`](crate::Listener)) without
    /// waiting: the endpoint is returned at once and progress connects it (see the module
    /// `connecting.rs`). Requests posted on it meanwhile through the queued forms
    /// ([`tag_send_queued`](Self::tag_send_queued), [`stream_send_queued`](Self::stream_send_queued),
    /// [`am_send_queued`](Self::am_send_queued), [`flush_queued`](Self::flush_queued)) wait and
    /// are posted in order once it is; the other forms refuse it with [`Error::NoResource`]
    /// until then ([`is_connecting`](Self::is_connecting) says when). A failure to connect
    /// fails the endpoint, as its error handler is told: a reject is [`Error::PeerAborted`],
    /// a refused or unreachable server [`Error::Io`] (with the system's error), a server that
    /// closed the connection [`Error::EndpointFailure`], none that answered within
    /// `opts.timeout` [`Error::PeerTimeout`].
    pub fn connect_sockaddr_nb(&self, addr: SocketAddr, opts: &ConnectOpts) -> Result<EpId> {
        let sock = start_connect(addr, opts.local)?;
        let mut cm = self.cm.borrow_mut();
        if cm.set.is_none() {
            let set = EventSet::new()
                .map_err(|e| Error::io("connection manager: its event set (epoll)", e))?;
            self.events.add_extra(&self.ifaces.borrow(), set.fd());
            cm.set = Some(set);
        }
        let p = {
            let mut st = self.st.borrow_mut();
            st.cm_peer(addr)
        };
        cm.set
            .as_ref()
            .expect("made above")
            .watch(sock.as_raw_fd(), p as u64, true, false)
            .map_err(|e| Error::io("connection manager: its event set", e))?;
        let now = Instant::now();
        cm.list.push(Client {
            p,
            sock,
            target: addr,
            phase: Phase::Connecting,
            msg: addr_message(&self.address(), opts.client_id),
            started: now,
            deadline: now + opts.timeout,
            held: VecDeque::new(),
        });
        self.cm_any.set(true);
        Ok(self.st.borrow().ep_id(p))
    }

    /// Whether endpoint `ep` is still being connected by the connection manager
    /// ([`connect_sockaddr_nb`](Self::connect_sockaddr_nb)).
    pub fn is_connecting(&self, ep: EpId) -> bool {
        let st = self.st.borrow();
        st.ep_index(ep)
            .ok()
            .and_then(|p| st.peers.get(p))
            .is_some_and(|p| p.cm_pending && p.failed.is_none())
    }

    /// Why endpoint `ep` failed, as its requests and error handler are told (`None` while it
    /// is usable or being connected).
    pub fn connect_error(&self, ep: EpId) -> Option<Error> {
        let st = self.st.borrow();
        let p = st.ep_index(ep).ok()?;
        st.peers[p].failed.as_ref()?;
        Some(st.failed_error(p))
    }

    /// Hold `op` (with `token`) when `ep` is still connecting: the [`Queued`] to return then.
    pub(super) fn hold_if_connecting(
        &self,
        ep: EpId,
        token: u64,
        op: impl FnOnce() -> Held,
    ) -> Option<Queued> {
        if !self.cm_any.get() {
            return None;
        }
        let p = self.st.borrow().ep_index(ep).ok()?;
        let mut cm = self.cm.borrow_mut();
        let c = cm.find(p)?;
        c.held.push_back((token, op()));
        Some(Queued::Pending(super::owned::QueuedReq::held(
            self.owned_uuid(),
        )))
    }

    /// Move the connections under way along; the events (connections that ended).
    #[inline(never)]
    pub(super) fn progress_cm(&self) -> usize {
        let mut n = 0;
        {
            let mut cm = self.cm.borrow_mut();
            let cm = &mut *cm;
            let now = Instant::now();
            let mut i = 0;
            while i < cm.list.len() {
                let set = cm.set.as_ref().expect("made with the first client");
                let c = &mut cm.list[i];
                let res = match c.step(set) {
                    Ok(None) if now >= c.deadline => Err(Error::PeerTimeout {
                        peer: format!("the server at {}", c.target),
                        silent: now - c.started,
                        knob: format!("(the connect timeout, {:?})", c.deadline - c.started),
                    }),
                    Ok(None) => {
                        i += 1;
                        continue;
                    }
                    Ok(Some(addr)) => {
                        let mut ifaces = self.ifaces.borrow_mut();
                        let mut st = self.st.borrow_mut();
                        st.cm_connected(c.p, &addr, &mut ifaces)
                    }
                    Err(e) => Err(e),
                };
                let c = cm.list.swap_remove(i);
                let _ = set.remove(c.sock.as_raw_fd());
                cm.ended.push((c.p, res, c.held));
                n += 1;
            }
        }
        self.end_cm();
        n
    }

    /// Post or end the held requests of connections that ended, in order.
    fn end_cm(&self) {
        loop {
            let next = {
                let mut cm = self.cm.borrow_mut();
                if cm.ended.is_empty() {
                    self.cm_any.set(!cm.list.is_empty());
                    return;
                }
                cm.ended.remove(0)
            };
            let (p, res, held) = next;
            match res {
                Ok(()) => {
                    let ep = self.st.borrow().ep_id(p);
                    for (token, op) in held {
                        self.post_held(ep, token, op);
                    }
                }
                Err(e) => {
                    let mut st = self.st.borrow_mut();
                    let reason = e.to_string();
                    st.peers[p].cm_pending = false;
                    st.fail_peer_with(p, &reason, e.clone());
                    for (token, _) in held {
                        st.owned.push_completed(token, Err(e.clone()));
                    }
                }
            }
        }
    }

    /// Post a held request now that its endpoint is connected; its end goes to `token`.
    fn post_held(&self, ep: EpId, token: u64, op: Held) {
        let q = match op {
            Held::Tag { buf, tag, sync } => self.tag_send_queued(ep, buf, tag, sync, token),
            Held::Stream { buf } => self.stream_send_queued(ep, buf, token),
            Held::Am { id, header, buf } => self.am_send_queued(ep, id, &header, buf, token),
            Held::Flush => self.flush_queued(ep, token),
        };
        if let Queued::Ended(res) = q {
            self.st.borrow_mut().owned.push_completed(token, res);
        }
    }

    /// Drop the connection of endpoint `ep` if it is still being made (its close): the held
    /// requests end with [`Error::Canceled`]. False when it is not being connected.
    pub(super) fn cm_abandon(&self, ep: EpId) -> bool {
        if !self.cm_any.get() {
            return false;
        }
        let Ok(p) = self.st.borrow().ep_index(ep) else {
            return false;
        };
        let c = {
            let mut cm = self.cm.borrow_mut();
            let Some(i) = cm.list.iter().position(|c| c.p == p) else {
                return false;
            };
            let c = cm.list.swap_remove(i);
            if let Some(set) = &cm.set {
                let _ = set.remove(c.sock.as_raw_fd());
            }
            self.cm_any.set(!cm.list.is_empty() || !cm.ended.is_empty());
            c
        };
        let mut st = self.st.borrow_mut();
        st.peers[p].cm_pending = false;
        for (token, _) in c.held {
            st.owned.push_completed(token, Err(Error::Canceled));
        }
        true
    }
}
