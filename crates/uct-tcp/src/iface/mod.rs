//! The tcp interface: the listener, the table of connections, and progress. The protocol of
//! each connection is in `proto` (pure code); this layer owns the sockets, registers them with
//! the readiness set (`ready::Watch`), accepts, and decides which connections a progress call
//! handles: the ready ones, those whose endpoint asked for attention (`ready::Kick`), those
//! with frames held back, and now and then those with a deadline running. While it has no
//! connection at all it looks at the listener only every 32nd progress (and at the next one
//! after an `arm` found it ready), and after each look that found nothing it adjusts that
//! count so that looks come about every 100 us (at most every 2048th call, at least every
//! call for a caller that progresses rarely), so a worker whose peers are reached through other
//! transports pays almost no system call per progress for it (a `poll` costs a spinning
//! receiver more than the rest of its progress call: on a 16-core host, an MPI ping-pong over
//! shared memory took 0.51-0.63 us one way with the tcp interfaces open and looking every 32nd
//! call, 0.30-0.37 us without them). A caller that sleeps on this interface alone
//! (`arm_and_wait`) sleeps in the `epoll_wait` that names the ready sockets, and the next
//! progress handles those without asking again; while it keeps sleeping between messages,
//! progress asks epoll rather than `poll(2)` over every socket. With a single established
//! connection that only waits for input, progress reads it without asking which sockets are
//! ready (`speculative`), and when that read finds nothing and no endpoint asked for
//! attention, the call ends there: one `recvfrom` and no lock (`Receiver::read_ahead`), the
//! whole of what a polling caller spins on between messages.
//!
//! Each connection has two halves with different owners: the interface owns the receiving
//! half (`proto::Receiver`) and reads without a lock; the connection object
//! (`proto::Conn`: socket, send queue, state, requests) sits behind a mutex shared with the
//! endpoint. Completions and endpoint errors are gathered under the lock and delivered after
//! it is released, so the sink may post on any endpoint.

use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rucx_ucs::{Error, Result};
use rucx_uct::{
    DeviceType, Endpoint, EpParams, Event, EventSource, Iface, IfaceAttr, IfaceCaps, IfaceLimits,
    PerfModel,
};

use crate::addr::{self, DevAddr, NetIf};
use crate::ep::TcpEndpoint;
use crate::md::RegTable;
use crate::proto::merge::{self, Merge};
use crate::proto::{Conn, Owned, Ready, Receiver, Setup, State, lock};
use crate::ready::{ERR_HUP, IN, Kick, OUT, Watch};
use crate::sock::{self, FdSock, RawSock};
use crate::{TL_NAME, TcpOptions, wire};

#[cfg(test)]
mod tests;

/// Connections accepted per progress call.
const ACCEPTS_PER_PROGRESS: usize = 16;
/// Accepted connections whose peer has not said hello yet, at most. There is no hello timeout
/// (a peer process may be busy for a long time before it progresses and sends its hello, and
/// keepalive finds dead peers), so this bounds what idle strangers can hold; beyond it the
/// oldest such connection is closed.
const MAX_UNIDENTIFIED: usize = 256;
/// Epoll key of the listener (connections use their slot index).
const LISTENER_KEY: u64 = u64::MAX;
/// Progress calls between deadline checks of connections with no event.
const TIMER_EVERY: u32 = 64;
/// While the interface has a single connection that only waits for input, progress reads it
/// without asking which sockets are ready, and asks (the listener, errors, room to write)
/// once in this many calls.
const SPECULATE_POLL_EVERY: u32 = 16;
/// Progress calls between looks at the listener while the interface has no connection, at
/// first: a worker that talks to its peers through other transports (shared memory) then pays
/// no system call on most of its progress calls, and a new connection waits a few calls
/// longer. After each look the count is set so that looks come every [`IDLE_POLL_GAP`].
const IDLE_POLL_EVERY: u32 = 32;
/// The most progress calls between looks at an idle interface's listener.
const IDLE_POLL_MAX: u32 = 2048;
/// The time between looks at an idle interface's listener that the count of calls aims at:
/// what a peer's first connection may wait before it is accepted (a caller that sleeps is
/// woken by the listener's readiness at once).
const IDLE_POLL_GAP: Duration = Duration::from_micros(100);
/// A caller that slept in `arm_and_wait` within this many progress calls is taken to sleep
/// between messages (`readiness_by_epoll`).
const SLEPT_RECENTLY: u32 = 256;

/// The progress calls until the next look at an idle interface's listener, after `every` calls
/// since the look at `last` (now updated): see [`idle_scale`].
fn idle_count(every: u32, last: &mut Option<Instant>) -> u32 {
    let now = Instant::now();
    idle_scale(every, last.replace(now).map(|at| now.duration_since(at)))
}

/// The count of progress calls between looks at an idle listener, after `every` calls took
/// `took` (`None`: the first look): scaled so that looks come about every [`IDLE_POLL_GAP`],
/// at most doubling at once, between every call and [`IDLE_POLL_MAX`].
fn idle_scale(every: u32, took: Option<Duration>) -> u32 {
    let next = match took {
        None => every,
        Some(t) => {
            let scaled = u128::from(every) * IDLE_POLL_GAP.as_nanos() / t.as_nanos().max(1);
            u32::try_from(scaled)
                .unwrap_or(u32::MAX)
                .min(every.saturating_mul(2))
        }
    };
    next.clamp(1, IDLE_POLL_MAX)
}

/// A connection as the interface keeps it.
pub(crate) type SharedConn = Arc<Mutex<Conn<FdSock>>>;

/// The interface's view of one connection.
#[derive(Debug)]
struct Slot {
    conn: SharedConn,
    /// The socket, read without the lock (the `Conn` owns and keeps it open).
    sock: RawSock,
    rx: Receiver<FdSock>,
    /// Remove at the end of this progress.
    gone: bool,
    /// Epoll events the socket is registered for.
    interest: u32,
    /// Epoll events it should be registered for (set by `progress`).
    want: u32,
    /// A deadline runs (connecting or closing): checked now and then without events.
    timed: bool,
    /// Frames wait: handle them in the next progress even without an event.
    again: bool,
    /// Creation order.
    seq: u64,
}

impl Slot {
    /// Handle what the socket reported (`rev`, epoll events; 0 when there was none), then
    /// report completions and errors into `out`.
    fn progress(
        &mut self,
        rev: u32,
        table: &RegTable,
        sink: &mut dyn FnMut(Event<'_>),
        out: &mut Vec<Owned>,
    ) -> usize {
        let ready = Ready {
            input: rev & (IN | ERR_HUP) != 0,
            output: rev & (OUT | ERR_HUP) != 0,
        };
        let p = self.rx.progress(
            &self.conn,
            &mut self.sock,
            ready,
            &Instant::now,
            table,
            sink,
            out,
        );
        self.gone = p.gone;
        self.want = (if p.read { IN } else { 0 }) | (if p.write { OUT } else { 0 });
        self.timed = p.timed;
        self.again = p.again;
        p.delivered
    }
}

/// The tcp interface on one network device.
#[derive(Debug)]
pub struct TcpIface {
    attr: IfaceAttr,
    dev: NetIf,
    dev_addr: DevAddr,
    table: Arc<RegTable>,
    opts: TcpOptions,
    listener: TcpListener,
    port: u16,
    /// Connections by key (the index); `None` marks a free key (listed in `free`).
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Slots created so far: orders connections by age.
    created: u64,
    watch: Watch,
    kick: Arc<Kick>,
    /// Slots with a deadline running.
    timed: usize,
    /// Progress calls, for checking deadlines now and then.
    calls: u32,
    /// While the interface has no connection: progress calls left before the next look at
    /// the listener, the count between looks (see [`IDLE_POLL_GAP`]), and when the last
    /// look was.
    idle_left: u32,
    idle_every: u32,
    idle_look: Option<Instant>,
    /// Look at the sockets in the next progress even with no connection (set by `arm`: the
    /// descriptor said something is ready).
    poll_next: bool,
    /// Slots to handle in the next progress without an event.
    again: Vec<usize>,
    /// This progress's work: `(key, epoll events)`. Between calls it holds what the sleep of
    /// `arm_and_wait` reported (`woke`).
    work: Vec<(usize, u32)>,
    /// `arm_and_wait` slept and left the ready sockets in `work` (and `woke_listener`): the
    /// next progress handles those without asking the kernel again.
    woke: bool,
    /// The listener was among the sockets the sleep reported.
    woke_listener: bool,
    /// `calls` at the last sleep of `arm_and_wait`: while the caller sleeps between messages,
    /// progress asks epoll which sockets are ready (see `readiness_by_epoll`).
    slept_at: Option<u32>,
    kicked: Vec<usize>,
    /// Connection pairs to merge: `(dialed key, accepted key)`, see `find_merges`.
    merges: Vec<(usize, usize)>,
    /// Accepted connections whose hello arrived in this progress.
    greeted: Vec<usize>,
    /// Connections that got `Joined` in this progress.
    joining: Vec<usize>,
    /// Endpoints moved onto the peer's connection so far.
    merged: u64,
    events: Vec<Owned>,
    /// The connection that last had input: the one read speculatively when it is the only one
    /// (`speculative`).
    last_input: usize,
}

impl TcpIface {
    pub(crate) fn open(
        dev: NetIf,
        host_id: u64,
        table: Arc<RegTable>,
        opts: TcpOptions,
    ) -> Result<TcpIface> {
        let (listener, port) = sock::listen(
            IpAddr::V4(dev.addr),
            opts.port_range,
            &format!("tcp interface on {}", dev.name),
        )?;
        let dev_addr = DevAddr {
            ip: dev.addr,
            loopback_host: dev.loopback.then_some(host_id),
        };
        let bandwidth = match (dev.loopback, dev.speed_mbps) {
            (true, _) => 2.0e9,
            (false, Some(mbps)) => mbps as f64 * 1e6 / 8.0 * 0.9,
            (false, None) => 1.1e9,
        };
        let attr = IfaceAttr {
            tl_name: TL_NAME.into(),
            dev_name: dev.name.clone(),
            dev_type: DeviceType::Network,
            sys_device: pci_bus_id(&dev.name),
            caps: IfaceCaps::AM_SHORT
                | IfaceCaps::AM_BCOPY
                | IfaceCaps::AM_ZCOPY
                | IfaceCaps::PUT_SHORT
                | IfaceCaps::PUT_ZCOPY
                | IfaceCaps::GET_ZCOPY
                | IfaceCaps::CONNECT_TO_IFACE
                | IfaceCaps::ERRHANDLE_PEER_FAILURE,
            limits: IfaceLimits {
                am_max_short: wire::AM_MAX_SHORT,
                am_max_bcopy: wire::AM_MAX_BCOPY,
                am_max_zcopy: wire::AM_MAX_ZCOPY,
                am_max_hdr: wire::AM_MAX_HDR,
                put_max_short: wire::PUT_MAX_SHORT,
                put_max_zcopy: wire::RMA_MAX_ZCOPY,
                get_max_zcopy: wire::RMA_MAX_ZCOPY,
                max_iov: wire::MAX_IOV,
            },
            perf: PerfModel {
                latency_ns: if dev.loopback { 5_000.0 } else { 10_000.0 },
                overhead_ns: 1_000.0,
                bandwidth,
            },
            priority: 0,
            device_addr_len: dev_addr.pack().len(),
            iface_addr_len: addr::IFACE_ADDR_LEN,
            ep_addr_len: 0,
            max_eps: None,
        };
        let watch = Watch::new()
            .and_then(|mut w| {
                w.add(listener.as_raw_fd(), IN, LISTENER_KEY)?;
                Ok(w)
            })
            .map_err(|e| Error::io(format!("tcp interface on {}: epoll", dev.name), e))?;
        tracing::debug!(
            "tcp interface on {} listening on {}:{port}",
            dev.name,
            dev.addr
        );
        Ok(TcpIface {
            attr,
            dev,
            dev_addr,
            table,
            opts,
            listener,
            port,
            slots: Vec::new(),
            free: Vec::new(),
            created: 0,
            watch,
            kick: Arc::new(Kick::default()),
            timed: 0,
            calls: 0,
            idle_left: IDLE_POLL_EVERY,
            idle_every: IDLE_POLL_EVERY,
            idle_look: None,
            poll_next: false,
            again: Vec::new(),
            work: Vec::new(),
            woke: false,
            woke_listener: false,
            slept_at: None,
            kicked: Vec::new(),
            merges: Vec::new(),
            greeted: Vec::new(),
            joining: Vec::new(),
            merged: 0,
            events: Vec::new(),
            last_input: 0,
        })
    }

    /// The connection to read without a readiness check in this progress call, if any: the
    /// only one there is, established, waiting for input alone (nothing queued to write, no
    /// deadline), and not on the calls that check readiness anyway (every
    /// [`SPECULATE_POLL_EVERY`]th: new connections, errors; and the first after a refused
    /// `arm`).
    fn speculative(&self) -> Option<usize> {
        if self.slots.len() - self.free.len() != 1
            || self.timed != 0
            || self.poll_next
            || self.woke
            || self.calls.is_multiple_of(SPECULATE_POLL_EVERY)
        {
            return None;
        }
        let s = self.slot(self.last_input)?;
        (s.rx.hello && s.interest == IN && s.want == IN && !s.gone && !s.again)
            .then_some(self.last_input)
    }

    /// Whether this progress asks epoll which sockets are ready rather than `poll(2)` over
    /// all of them (`Watch::wait`): while the caller sleeps between messages (it slept within
    /// the last [`SLEPT_RECENTLY`] progress calls). A sleeping caller's check finds nothing
    /// most of the time, and epoll answers that from its ready list without looking at each
    /// socket; a spinning caller is better served by `poll` (see `Watch`).
    fn readiness_by_epoll(&self) -> bool {
        self.slept_at
            .is_some_and(|at| self.calls.wrapping_sub(at) < SLEPT_RECENTLY)
    }

    /// Work that the next progress does without asking the kernel: kicks from endpoints,
    /// connections with frames held back, sockets a sleep or an `arm` found ready.
    fn has_pending(&self) -> bool {
        self.kick.pending() || !self.again.is_empty() || self.woke
    }

    /// Ask epoll for the ready sockets, waiting up to `timeout` (`None`: no limit), and keep
    /// them for the next progress (`woke`).
    fn collect_ready(&mut self, timeout: Option<Duration>) {
        let (work, listener) = (&mut self.work, &mut self.woke_listener);
        self.watch.sleep(timeout, |key, ev| {
            if key == LISTENER_KEY {
                *listener = true;
            } else {
                work.push((key as usize, ev));
            }
        });
        self.woke = !self.work.is_empty() || self.woke_listener;
    }

    /// The listening socket address.
    pub fn listen_addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.dev.addr, self.port)
    }

    /// Open connections (for tests and diagnostics).
    pub fn connections(&self) -> usize {
        self.live().count()
    }

    fn live(&self) -> impl Iterator<Item = &Slot> + Clone {
        self.slots.iter().flatten()
    }

    fn slot(&self, key: usize) -> Option<&Slot> {
        self.slots.get(key).and_then(Option::as_ref)
    }

    /// Make a connection on `fd` and add its slot; returns the connection.
    fn add_conn(
        &mut self,
        fd: OwnedFd,
        state: State,
        peer: Option<SocketAddrV4>,
        remote: SocketAddr,
        ep: Option<u64>,
    ) -> io::Result<SharedConn> {
        let key = self.free.last().copied().unwrap_or(self.slots.len());
        let setup = Setup {
            dev: self.dev.name.clone(),
            listen: self.listen_addr(),
            tx_limit: self.opts.tx_queue,
            timeout: self.opts.connect_timeout,
            kick: self.kick.clone(),
        };
        let raw = RawSock(fd.as_raw_fd());
        let dialed = state == State::Connecting;
        let mut conn = Conn::new(FdSock(fd), state, peer, remote, &setup, key, Instant::now());
        conn.ep = ep;
        let timed = dialed;
        let want = if dialed {
            OUT
        } else {
            // The hello is queued.
            IN | OUT
        };
        self.watch.add(raw.0, want, key as u64)?;
        let conn = Arc::new(Mutex::new(conn));
        let slot = Slot {
            conn: conn.clone(),
            sock: raw,
            rx: Receiver::new(dialed),
            gone: false,
            interest: want,
            want,
            timed,
            again: false,
            seq: self.created,
        };
        self.created += 1;
        self.timed += usize::from(timed);
        match self.free.pop() {
            Some(k) => self.slots[k] = Some(slot),
            None => self.slots.push(Some(slot)),
        }
        Ok(conn)
    }

    /// Accept up to `max` waiting connections.
    fn accept_some(&mut self, max: usize) {
        for _ in 0..max {
            match sock::accept_nb(&self.listener, &self.opts) {
                Ok(Some((fd, remote))) => {
                    let unidentified = || self.live().filter(|s| !s.rx.dialed && !s.rx.hello);
                    if unidentified().count() >= MAX_UNIDENTIFIED
                        && let Some(oldest) = unidentified().min_by_key(|s| s.seq)
                    {
                        tracing::warn!(
                            "tcp interface on {}: {MAX_UNIDENTIFIED} connections without hello; \
                             closing the oldest",
                            self.dev.name
                        );
                        lock(&oldest.conn).fail("no hello");
                    }
                    tracing::debug!(
                        "tcp interface on {}: accepted a connection from {remote}",
                        self.dev.name
                    );
                    if let Err(e) = self.add_conn(fd, State::Open, None, remote, None) {
                        tracing::warn!(
                            "tcp interface on {}: cannot watch an accepted connection: {e}",
                            self.dev.name
                        );
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("tcp interface on {}: accept failed: {e}", self.dev.name);
                    break;
                }
            }
        }
    }

    /// The peer's endpoint moved to connection `key` from the one whose peer-side address
    /// `Joined` named: frames on `key` wait for that connection's `Detach` (none to wait for
    /// when it is gone, failed or already detached).
    fn resolve_joined(&mut self, key: usize) {
        let Some(left) = self
            .slots
            .get_mut(key)
            .and_then(Option::as_mut)
            .and_then(|s| s.rx.joined.take())
        else {
            return;
        };
        let wait = self.live().find_map(|s| {
            let pending = !s.rx.dialed && merge::left_and_pending(&lock(&s.conn), left);
            pending.then(|| s.conn.clone())
        });
        if let Some(s) = self.slots.get_mut(key).and_then(Option::as_mut) {
            s.rx.wait = wait;
            // Handle what is buffered (or keep checking the wait) in the next progress.
            self.again.push(key);
        }
    }

    /// Accepted connections just identified by their hello: when our endpoint to that peer
    /// dialed a connection of its own (both sides created their endpoints at once) and we are
    /// the side that moves (`merge::we_move`), plan to move our endpoint onto the accepted
    /// connection.
    fn find_merges(&mut self) {
        let me = self.listen_addr();
        for a in std::mem::take(&mut self.greeted) {
            let Some(peer) = self.slot(a).and_then(|s| lock(&s.conn).peer) else {
                continue;
            };
            if !merge::we_move(me, peer) || self.merges.iter().any(|&(_, x)| x == a) {
                continue;
            }
            let d = self.slots.iter().enumerate().find_map(|(k, s)| {
                let s = s.as_ref()?;
                let free = s.rx.dialed
                    && merge::movable(&lock(&s.conn), peer)
                    && !self.merges.iter().any(|&(x, _)| x == k);
                free.then_some(k)
            });
            if let Some(d) = d {
                self.merges.push((d, a));
            }
        }
    }

    /// One step of moving our endpoint from dialed connection `d` to accepted connection `a`
    /// (`merge::move_endpoint`); once moved, the two slots swap connection objects so each
    /// slot's socket stays with its object. The endpoint holds the same object throughout,
    /// locked during the trade.
    fn try_merge(&mut self, d: usize, a: usize) -> Merge {
        let (Some(sd), Some(sa)) = (self.slot(d), self.slot(a)) else {
            return Merge::Abort;
        };
        if !sd.rx.dialed || sa.rx.dialed || !sa.rx.hello || sd.gone || sa.gone {
            return Merge::Abort;
        }
        let m = merge::move_endpoint(&mut lock(&sd.conn), &mut lock(&sa.conn));
        if m == Merge::Done {
            let (x, y) = if d < a {
                let (l, r) = self.slots.split_at_mut(a);
                (&mut l[d], &mut r[0])
            } else {
                let (l, r) = self.slots.split_at_mut(d);
                (&mut r[0], &mut l[a])
            };
            let (x, y) = (x.as_mut().expect("checked"), y.as_mut().expect("checked"));
            std::mem::swap(&mut x.conn, &mut y.conn);
            self.merged += 1;
        }
        m
    }
}

fn pci_bus_id(dev: &str) -> Option<String> {
    let target = std::fs::read_link(format!("/sys/class/net/{dev}/device")).ok()?;
    let name = target.file_name()?.to_str()?.to_string();
    // A PCI address looks like 0000:3b:00.0.
    (name.len() == 12 && name.as_bytes()[4] == b':' && name.as_bytes()[7] == b':').then_some(name)
}

impl Iface for TcpIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        self.dev_addr.pack()
    }

    fn iface_address(&self) -> Vec<u8> {
        addr::pack_iface_addr(self.port)
    }

    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        let (Ok(peer), Ok(_)) = (
            DevAddr::unpack(dev_addr),
            addr::unpack_iface_addr(iface_addr),
        ) else {
            return false;
        };
        match (self.dev_addr.loopback_host, peer.loopback_host) {
            // Loopback reaches loopback of the same host and network namespace only.
            (Some(mine), Some(theirs)) => mine == theirs,
            (None, None) => true,
            _ => false,
        }
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        let peer_dev = DevAddr::unpack(&params.dev_addr)?;
        let port = addr::unpack_iface_addr(&params.iface_addr)?;
        if !self.is_reachable(&params.dev_addr, &params.iface_addr) {
            return Err(Error::InvalidAddress(format!(
                "tcp peer {}:{port} is not reachable from device {} ({})",
                peer_dev.ip, self.dev.name, self.dev.addr
            )));
        }
        let peer = SocketAddrV4::new(peer_dev.ip, port);
        // Take over a connection the peer opened to us, if our side of it is free.
        for s in self.live() {
            let mut c = lock(&s.conn);
            if s.rx.hello && c.free_for(peer) {
                c.ep = Some(params.user_id);
                drop(c);
                return Ok(Box::new(TcpEndpoint::new(s.conn.clone())));
            }
        }
        let fd = sock::connect_nb(
            Some(IpAddr::V4(self.dev.addr)),
            SocketAddr::V4(peer),
            &self.opts,
        )?;
        let remote = SocketAddr::V4(peer);
        let conn = self
            .add_conn(
                fd,
                State::Connecting,
                Some(peer),
                remote,
                Some(params.user_id),
            )
            .map_err(|e| {
                Error::io(
                    format!(
                        "tcp interface on {}: watching a new connection",
                        self.dev.name
                    ),
                    e,
                )
            })?;
        Ok(Box::new(TcpEndpoint::new(conn)))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        // The ready sockets (one epoll_wait), then connections kicked by their endpoints, those
        // with frames held back, and now and then those with a deadline running.
        self.calls = self.calls.wrapping_add(1);
        if self.slots.len() == self.free.len() && !self.poll_next && !self.woke {
            // No connection, so nothing but the listener can have news (no endpoint to kick,
            // no frame held back, no deadline, no merge).
            if self.idle_left > 0 {
                self.idle_left -= 1;
                return 0;
            }
            // Look now, and set the count to the next look from how long the last count took.
            self.idle_every = idle_count(self.idle_every, &mut self.idle_look);
            self.idle_left = self.idle_every;
        } else if self.idle_look.is_some() {
            self.idle_left = IDLE_POLL_EVERY;
            self.idle_every = IDLE_POLL_EVERY;
            self.idle_look = None;
        }
        let speculate = self.speculative();
        if let Some(key) = speculate
            && !self.kick.pending()
            && self.again.is_empty()
            && self.work.is_empty()
            && let Some(s) = self.slots.get_mut(key).and_then(Option::as_mut)
            && !s.rx.read_ahead(&mut s.sock, &self.table)
        {
            // The lone connection had nothing, and nothing else waits (no endpoint asked for
            // attention, no frames are held back, no deadline runs): done, without the
            // connection's lock. This is the call a polling caller spins on between messages.
            return 0;
        }
        let mut work = std::mem::take(&mut self.work);
        let mut accept = false;
        let by_epoll = self.readiness_by_epoll();
        self.poll_next = false;
        match speculate {
            // The sleep of `arm_and_wait` named the ready sockets (in `work` already).
            _ if self.woke => {
                self.woke = false;
                accept = std::mem::take(&mut self.woke_listener);
            }
            // One system call per message instead of two: a read that finds nothing costs what
            // the readiness check would have, and one that finds data saves that check on the
            // message's way.
            Some(key) => work.push((key, IN)),
            None => self.watch.wait(by_epoll, |key, ev| {
                if key == LISTENER_KEY {
                    accept = true;
                } else {
                    work.push((key as usize, ev));
                }
            }),
        }
        self.kick.take(&mut self.kicked);
        work.extend(self.kicked.drain(..).map(|k| (k, 0)));
        work.extend(self.again.drain(..).map(|k| (k, 0)));
        if self.timed > 0 && self.calls.is_multiple_of(TIMER_EVERY) {
            work.extend(
                self.slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.as_ref().is_some_and(|s| s.timed))
                    .map(|(k, _)| (k, 0)),
            );
        }

        let mut delivered = 0;
        let mut events = std::mem::take(&mut self.events);
        let mut removed = false;
        for (key, rev) in work.drain(..) {
            let Some(s) = self.slots.get_mut(key).and_then(Option::as_mut) else {
                // A key kicked by a connection that is gone.
                continue;
            };
            if s.gone {
                continue;
            }
            let (timed, hello) = (s.timed, s.rx.hello);
            if rev & IN != 0 {
                self.last_input = key;
            }
            delivered += s.progress(rev, &self.table, sink, &mut events);
            if !hello && s.rx.hello && !s.rx.dialed {
                self.greeted.push(key);
            }
            if s.rx.joined.is_some() {
                self.joining.push(key);
            }
            self.timed = self.timed + usize::from(s.timed) - usize::from(timed);
            if s.gone {
                // Unwatched before the descriptor can close (when the connection drops).
                self.watch.delete(s.sock.0, key as u64);
                removed = true;
                continue;
            }
            if s.want != s.interest {
                match self.watch.modify(s.sock.0, s.want, key as u64) {
                    Ok(()) => s.interest = s.want,
                    Err(e) => {
                        lock(&s.conn).fail(&format!("epoll: {e}"));
                    }
                }
            }
            if s.again {
                self.again.push(key);
            }
        }
        self.work = work;
        if !self.greeted.is_empty() {
            self.find_merges();
        }
        if !self.merges.is_empty() {
            let mut merges = std::mem::take(&mut self.merges);
            merges.retain(|&(d, a)| self.try_merge(d, a) == Merge::Wait);
            self.merges = merges;
        }
        if removed {
            for (k, s) in self.slots.iter_mut().enumerate() {
                if s.as_ref().is_some_and(|s| s.gone) {
                    let s = s.take().expect("checked");
                    self.timed -= usize::from(s.timed);
                    self.free.push(k);
                }
            }
        }

        // New connections.
        if accept {
            self.idle_every = IDLE_POLL_EVERY;
            self.accept_some(ACCEPTS_PER_PROGRESS);
        }
        if !self.joining.is_empty() {
            // The connection a peer's endpoint left may still wait to be accepted (the peer
            // connected it before it moved): take them all first.
            self.accept_some(usize::MAX);
            for key in std::mem::take(&mut self.joining) {
                self.resolve_joined(key);
            }
        }

        for ev in events.drain(..) {
            delivered += 1;
            match ev {
                Owned::Completion(token, result) => sink(Event::Completion { token, result }),
                Owned::EpError(user_id, error) => sink(Event::EpError { user_id, error }),
            }
        }
        self.events = events;
        delivered
    }

    fn event_source(&self) -> EventSource {
        EventSource::Fd(self.watch.fd())
    }

    fn arm(&mut self) -> Result<()> {
        // Level triggered: the epoll descriptor is readable exactly while a socket is ready.
        // What it cannot show is work without a socket event: kicks from endpoints and
        // connections with frames held back. The readiness check is an `epoll_wait` that
        // keeps what it found for the next progress.
        if !self.has_pending() {
            self.collect_ready(Some(Duration::ZERO));
        }
        if self.has_pending() {
            self.poll_next = true;
            return Err(Error::Busy(format!(
                "the tcp interface on {} has sockets or connections to handle",
                self.dev.name
            )));
        }
        Ok(())
    }

    fn arm_and_wait(&mut self, timeout: Option<Duration>, timer: Option<RawFd>) -> Result<()> {
        // `arm`'s checks, then one `epoll_wait` that sleeps and names the ready sockets at
        // once: level triggered, a socket ready now ends the sleep at once, so a readiness
        // check first would only cost a system call per sleep. The next progress handles the
        // sockets reported here without asking again.
        if self.has_pending() {
            self.poll_next = true;
            return Ok(());
        }
        if let Some(t) = timer {
            self.watch.watch_timer(t).map_err(|e| {
                Error::io(
                    format!(
                        "tcp interface on {}: watching the caller's timer",
                        self.dev.name
                    ),
                    e,
                )
            })?;
        }
        self.slept_at = Some(self.calls);
        self.collect_ready(timeout);
        Ok(())
    }
}

impl Drop for TcpIface {
    fn drop(&mut self) {
        for s in self.live() {
            lock(&s.conn).interface_closed();
        }
    }
}
