//! The tcp interface (listener, connections, progress) and its endpoints.
//!
//! # Connections
//! A connection is full duplex and may carry one endpoint of each side. An endpoint to peer P
//! takes over a connection that P opened to us (and announced with its listening address in
//! `Hello`) when our side of it has no endpoint yet; otherwise it opens a new connection to P.
//! So two processes that create endpoints to each other usually share one connection (the
//! second endpoint finds the first one's connection). When both create them at the same
//! moment they hold two, one used by each side, until the side with the larger listening
//! address moves its endpoint onto the peer's connection (`TcpIface::try_merge`; the peer
//! keeps the order with `Joined`) and closes its own. Requests received on a connection are
//! answered on it, in order, whichever side opened it.
//!
//! Sockets are registered once (`sock::Watch`: epoll, mirrored in a `poll(2)` array used
//! while there are a few); a progress call handles the ready ones, those whose endpoint asked
//! for attention (`Kick`: output queued, failure, endpoint
//! gone), those with frames held back, and now and then those with a deadline running.
//!
//! Each connection has two halves with different owners: the interface owns the receive
//! buffer and reads without a lock, so active messages are handed to the sink straight from
//! the buffer while endpoints (possibly on other threads) keep posting; the send queue, the
//! table of requests waiting for answers and the state sit behind a mutex shared with the
//! endpoint. Completions and endpoint errors are gathered under the lock and delivered after
//! it is released, so the sink may post on any endpoint.
//!
//! When our endpoint goes, we send `Detach` after everything it posted; a side that has no
//! endpoint on the connection and has seen the peer's `Detach` sends what it still has
//! queued, half-closes, and closes at end of stream.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::{IpAddr, Shutdown, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::iface::{AM_ID_MAX, check_packed};
use rucx_uct::{
    AmId, DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceLimits, Iov,
    MemHandle, OpStatus, PerfModel, RemoteKey,
};

use crate::addr::{self, DevAddr, NetIf};
use crate::md::{RegTable, TcpReg, TcpRkey};
use crate::ready::{ERR_HUP, IN, Kick, OUT, Watch};
use crate::sock::{FdSock, RawSock};
use crate::stream::{Fill, OwnedSock, RawRecv, RxBuf, Sock, TxQueue};
use crate::wire::{self, Header, Kind, code};
use crate::{TL_NAME, TcpOptions, sock};

/// Reads per connection per progress call, so one busy peer cannot starve the others.
const READS_PER_PROGRESS: usize = 4;
/// Connections accepted per progress call.
const ACCEPTS_PER_PROGRESS: usize = 16;
/// Accepted connections whose peer has not said hello yet, at most. There is no hello timeout
/// (a peer process may be busy for a long time before it progresses and sends its hello, and
/// keepalive finds dead peers), so this bounds what idle strangers can hold; beyond it the
/// oldest such connection is closed.
const MAX_UNIDENTIFIED: usize = 256;

fn lock(c: &Mutex<Conn>) -> MutexGuard<'_, Conn> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An event owned until it is handed to the sink.
#[derive(Debug)]
enum Owned {
    Completion(u64, Result<()>),
    EpError(u64, Error),
}

/// A request of our endpoint waiting for the peer's answer.
#[derive(Debug)]
struct PendingOp {
    op: u64,
    /// Value of `Conn::posted` right after this request was posted.
    posted: u64,
    /// Completion token; `None` for `put_short` (no completion) and after the endpoint went.
    token: Option<u64>,
    /// The endpoint that posted it is gone: its answer is consumed silently.
    orphan: bool,
    kind: PendKind,
}

#[derive(Debug)]
enum PendKind {
    Put,
    Get {
        dst: Vec<(MemHandle, usize, usize)>,
        len: usize,
    },
    Flush,
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    Connecting,
    Open,
    Failed(String),
}

/// The half of a connection shared by the interface and the endpoint on it.
#[derive(Debug)]
pub(crate) struct Conn {
    sock: FdSock,
    tx: TxQueue,
    state: State,
    /// The peer's listening address: the address dialed, or the one its `Hello` announced.
    peer: Option<SocketAddrV4>,
    /// Where the socket is connected (for messages before the peer's `Hello`).
    remote: SocketAddr,
    dev: String,
    /// User id of our endpoint on this connection.
    ep: Option<u64>,
    detach_sent: bool,
    peer_detached: bool,
    /// Sending what is left, then half-closing (no endpoint on either side).
    closing: bool,
    shut: bool,
    next_op: u64,
    pending: VecDeque<PendingOp>,
    /// Requests and active messages our endpoint posted (`Hello`/`Detach` excluded).
    posted: u64,
    /// Of those, how many the peer has certainly processed (all up to the last one answered).
    acked: u64,
    completions: Vec<Owned>,
    error_reported: bool,
    tx_limit: usize,
    /// Connect deadline, then the deadline for closing.
    deadline: Instant,
    linger: Duration,
    /// Where to ask for the interface's attention, and this connection's key there.
    kick: Arc<Kick>,
    key: usize,
    /// In the kick list and not handled yet.
    kicked: bool,
}

/// A piece of a frame being posted.
enum Part<'a> {
    Bytes(&'a [u8]),
    Mem(&'a MemHandle, usize, usize),
}

impl Part<'_> {
    fn len(&self) -> usize {
        match self {
            Part::Bytes(b) => b.len(),
            Part::Mem(_, _, l) => *l,
        }
    }

    fn slice(&self) -> &[u8] {
        match self {
            Part::Bytes(b) => b,
            Part::Mem(m, a, l) => {
                debug_assert!(m.region().contains(*a, *l));
                // SAFETY: the endpoint validated [a, a+l) against `m` (a live host registration
                // of the tcp domain, see `check_iov`); by `mem_reg`'s contract it is readable
                // while `m` lives, and `m` is borrowed for the duration of this slice.
                unsafe { std::slice::from_raw_parts(*a as *const u8, *l) }
            }
        }
    }
}

/// Why handling a frame ended the connection.
enum Reply {
    /// The peer broke the protocol.
    Violation(String),
    /// The connection must fail for this reason.
    Fail(String),
}

impl Conn {
    /// Trade everything that belongs to the socket (the socket, its send queue, its state and
    /// its interface key) with `other`; the endpoint's part (who is on it, its requests and
    /// counters) stays.
    fn trade_socket(&mut self, other: &mut Conn) {
        use std::mem::swap;
        swap(&mut self.sock, &mut other.sock);
        swap(&mut self.tx, &mut other.tx);
        swap(&mut self.state, &mut other.state);
        swap(&mut self.peer, &mut other.peer);
        swap(&mut self.remote, &mut other.remote);
        swap(&mut self.detach_sent, &mut other.detach_sent);
        swap(&mut self.peer_detached, &mut other.peer_detached);
        swap(&mut self.closing, &mut other.closing);
        swap(&mut self.shut, &mut other.shut);
        swap(&mut self.deadline, &mut other.deadline);
        swap(&mut self.key, &mut other.key);
        swap(&mut self.kicked, &mut other.kicked);
    }

    /// Ask the interface to handle this connection in its next progress, events or not.
    fn kick(&mut self) {
        if !self.kicked {
            self.kicked = true;
            self.kick.push(self.key);
        }
    }

    fn peer_name(&self) -> String {
        match self.peer {
            Some(p) => format!("tcp {p} (device {})", self.dev),
            None => format!("tcp {} (device {})", self.remote, self.dev),
        }
    }

    fn failure(&self, reason: &str) -> Error {
        Error::EndpointFailure {
            peer: self.peer_name(),
            reason: reason.to_string(),
        }
    }

    fn usable(&self) -> Result<()> {
        match &self.state {
            State::Failed(r) => Err(self.failure(r)),
            _ => Ok(()),
        }
    }

    fn can_queue(&self, n: usize) -> Result<()> {
        self.usable()?;
        if !self.tx.is_empty() && self.tx.queued().saturating_add(n) > self.tx_limit {
            return Err(Error::NoResource(format!(
                "tcp send queue to {} holds {} bytes, the limit is RUCX_TCP_TX_QUEUE={}",
                self.peer_name(),
                self.tx.queued(),
                self.tx_limit
            )));
        }
        Ok(())
    }

    /// Queue a frame of our endpoint (writing it at once when nothing else waits). Returns
    /// true when the whole frame went to the socket now (then `token` is not reported later).
    fn post(&mut self, parts: &[Part<'_>], token: Option<u64>) -> Result<bool> {
        let total: usize = parts.iter().map(Part::len).sum();
        self.can_queue(total)?;
        if self.state == State::Connecting {
            self.check_connected();
            self.usable()?;
        }
        let mut sent = 0;
        if self.state == State::Open && self.tx.is_empty() {
            let mut slices = [IoSlice::new(&[]); 2 + wire::MAX_IOV];
            let n = parts.len().min(slices.len());
            for (s, p) in slices.iter_mut().zip(parts) {
                *s = IoSlice::new(p.slice());
            }
            loop {
                match self.sock.send_vectored(&slices[..n]) {
                    Ok(k) => sent = k,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        let reason = format!("send: {e}");
                        self.fail(&reason);
                        return Err(self.failure(&reason));
                    }
                }
                break;
            }
        }
        self.posted += 1;
        if sent == total {
            return Ok(true);
        }
        // Queue what the socket did not take; the token goes on the last piece.
        let mut skip = sent;
        let mut rest = Vec::with_capacity(parts.len());
        for p in parts {
            let len = p.len();
            if skip >= len {
                skip -= len;
                continue;
            }
            rest.push((p, skip));
            skip = 0;
        }
        let n = rest.len();
        for (j, (p, off)) in rest.into_iter().enumerate() {
            let tok = if j + 1 == n { token } else { None };
            match p {
                Part::Bytes(b) => {
                    self.tx.push_owned(&b[off..], tok);
                }
                Part::Mem(m, a, l) => {
                    self.tx.push_zcopy(m, a + off, l - off, tok);
                }
            }
        }
        // The interface writes the rest when the socket takes it.
        self.kick();
        Ok(false)
    }

    /// A connect in progress: finish it if the socket is ready (without waiting), and send the
    /// hello and whatever was queued behind it.
    fn check_connected(&mut self) {
        match self.sock.connect_status() {
            None => {}
            Some(Ok(())) => {
                self.state = State::Open;
                if let Err(e) = self.tx.write(&mut self.sock) {
                    self.fail(&format!("send: {e}"));
                }
                // Watch it for input now.
                self.kick();
            }
            Some(Err(e)) => self.fail(&format!("connect: {e}")),
        }
    }

    /// Fail the connection: every operation of our endpoint in flight completes with the
    /// error; the endpoint error is reported by the next progress.
    fn fail(&mut self, reason: &str) {
        if matches!(self.state, State::Failed(_)) {
            return;
        }
        if self.ep.is_some() {
            tracing::debug!("tcp endpoint to {} failed: {reason}", self.peer_name());
        }
        self.state = State::Failed(reason.to_string());
        self.sock.shutdown(Shutdown::Both);
        // The interface reports it and lets the connection go.
        self.kick();
        // Items written completely before the failure did complete.
        self.completions
            .extend(self.tx.drain_done().map(|t| Owned::Completion(t, Ok(()))));
        let mut tokens = self.tx.clear();
        let pend: Vec<PendingOp> = self.pending.drain(..).collect();
        tokens.extend(pend.into_iter().filter_map(|p| p.token));
        for t in tokens {
            let e = self.failure(reason);
            self.completions.push(Owned::Completion(t, Err(e)));
        }
    }

    /// Tell the peer why (best effort), then fail.
    fn violation(&mut self, reason: &str) {
        tracing::warn!(
            "tcp connection with {}: protocol violation: {reason}; closing it",
            self.peer_name()
        );
        if self.state == State::Open {
            // Only on a frame boundary: after everything queued went out.
            let _ = self.tx.write(&mut self.sock);
            if self.tx.is_empty() {
                let f = wire::fatal_frame(code::PROTOCOL, reason);
                let _ = self.sock.send_vectored(&[IoSlice::new(&f)]);
            }
        }
        self.fail(&format!("protocol violation by the peer: {reason}"));
    }

    /// Handle an answer to one of our requests.
    fn handle_reply(&mut self, h: Header, body: &[u8]) -> std::result::Result<(), Reply> {
        let op = wire::word(body, 0);
        match self.pending.front() {
            Some(p) if p.op == op => {}
            Some(p) => {
                return Err(Reply::Violation(format!(
                    "{:?} for request {op}, but request {} is the oldest outstanding",
                    h.kind, p.op
                )));
            }
            None => {
                return Err(Reply::Violation(format!(
                    "{:?} for request {op}, but none is outstanding",
                    h.kind
                )));
            }
        }
        let front = self.pending.front().expect("checked");
        match (h.kind, &front.kind) {
            (Kind::Ack, PendKind::Put | PendKind::Flush) | (Kind::OpError, _) => {}
            (Kind::GetRep, PendKind::Get { dst, len }) => {
                let data = &body[8..];
                if *len != data.len() {
                    return Err(Reply::Violation(format!(
                        "get reply of {} bytes for a {len}-byte get",
                        data.len()
                    )));
                }
                let mut off = 0;
                for (m, a, l) in dst {
                    debug_assert!(m.region().contains(*a, *l));
                    // SAFETY: [a, a+l) was validated against `m`, a live host registration of
                    // the tcp domain (see `check_iov`); `mem_reg`'s contract makes it writable
                    // while the handle lives, and the pending operation holds it. `data` is in
                    // the receive buffer, which cannot overlap a user registration.
                    unsafe {
                        std::ptr::copy_nonoverlapping(data[off..].as_ptr(), *a as *mut u8, *l)
                    };
                    off += l;
                }
            }
            (k, p) => {
                return Err(Reply::Violation(format!(
                    "{k:?} answering request {op}, which is a {}",
                    match p {
                        PendKind::Put => "put",
                        PendKind::Get { .. } => "get",
                        PendKind::Flush => "flush",
                    }
                )));
            }
        }
        let p = self.pending.pop_front().expect("checked");
        self.acked = p.posted;
        if h.kind == Kind::OpError {
            let reason = wire::reason_text(&body[9..]);
            let what = match p.kind {
                PendKind::Put => "put",
                PendKind::Get { .. } => "get",
                PendKind::Flush => "flush",
            };
            let err = Error::InvalidRkey {
                domain: "tcp".into(),
                reason: format!("peer {} refused the {what}: {reason}", self.peer_name()),
            };
            match p.token {
                Some(t) => self.completions.push(Owned::Completion(t, Err(err))),
                // put_short has no completion: the endpoint is the only place to report it.
                None if !p.orphan => {
                    return Err(Reply::Fail(format!("peer refused a put_short: {reason}")));
                }
                None => {}
            }
        } else if let Some(t) = p.token {
            self.completions.push(Owned::Completion(t, Ok(())));
        }
        Ok(())
    }

    /// Queue the answer to a `Put` of `len` bytes at `addr`.
    fn answer_put(&mut self, op: u64, addr: u64, len: usize, r: std::result::Result<(), String>) {
        match r {
            Ok(()) => {
                self.tx
                    .push_owned(&wire::words_frame(Kind::Ack, &[op], &[]), None);
            }
            Err(reason) => {
                tracing::debug!("tcp: refused put {addr:#x}+{len}: {reason}");
                self.tx.push_owned(
                    &wire::op_error_frame(op, code::ACCESS_DENIED, &reason),
                    None,
                );
            }
        }
    }

    /// A get answer was received straight into the get's buffers: complete the get (unless
    /// the connection failed meanwhile and completed it with the error).
    fn finish_get(&mut self, op: u64) {
        if self.pending.front().is_some_and(|p| p.op == op) {
            let p = self.pending.pop_front().expect("checked");
            self.acked = p.posted;
            if let Some(t) = p.token {
                self.completions.push(Owned::Completion(t, Ok(())));
            }
        }
    }

    /// Serve a request of the peer; the answer is queued.
    fn serve(
        &mut self,
        h: Header,
        body: &[u8],
        table: &RegTable,
    ) -> std::result::Result<(), Reply> {
        match h.kind {
            Kind::Put => {
                let (op, md_id, reg_id, addr) = (
                    wire::word(body, 0),
                    wire::word(body, 1),
                    wire::word(body, 2),
                    wire::word(body, 3),
                );
                let data = &body[wire::PUT_FIXED..];
                let r = table.write(md_id, reg_id, addr, data);
                self.answer_put(op, addr, data.len(), r);
            }
            Kind::GetReq => {
                let (op, md_id, reg_id, addr, len) = (
                    wire::word(body, 0),
                    wire::word(body, 1),
                    wire::word(body, 2),
                    wire::word(body, 3),
                    wire::word(body, 4),
                );
                if len > wire::RMA_MAX_ZCOPY as u64 {
                    return Err(Reply::Violation(format!(
                        "get of {len} bytes exceeds the limit of {}",
                        wire::RMA_MAX_ZCOPY
                    )));
                }
                let len = len as usize;
                let mut rep = self.tx.take_buf(wire::HDR_LEN + 8 + len);
                rep.extend_from_slice(&wire::header(Kind::GetRep, 0, 8 + len));
                rep.extend_from_slice(&op.to_le_bytes());
                match table.read_into(md_id, reg_id, addr, len, &mut rep) {
                    Ok(()) => {
                        self.tx.push_vec(rep, None);
                    }
                    Err(reason) => {
                        tracing::debug!("tcp: refused get {addr:#x}+{len}: {reason}");
                        self.tx.push_owned(
                            &wire::op_error_frame(op, code::ACCESS_DENIED, &reason),
                            None,
                        );
                    }
                }
            }
            Kind::Flush => {
                let op = wire::word(body, 0);
                self.tx
                    .push_owned(&wire::words_frame(Kind::Ack, &[op], &[]), None);
            }
            k => return Err(Reply::Violation(format!("{k:?} is not a request"))),
        }
        Ok(())
    }
}

/// The interface's view of one connection.
#[derive(Debug)]
struct Slot {
    conn: Arc<Mutex<Conn>>,
    /// The socket, read without the lock (the `Conn` owns and keeps it open).
    fd: RawFd,
    rx: RxBuf,
    /// The peer's `Hello` arrived.
    hello: bool,
    /// We opened it (else accepted it).
    dialed: bool,
    /// Remove at the end of this progress.
    gone: bool,
    /// Epoll events the socket is registered for.
    interest: u32,
    /// Epoll events it should be registered for (set by `progress`).
    want: u32,
    /// A deadline runs (connecting or closing): checked now and then without events.
    timed: bool,
    /// Complete frames wait in the receive buffer (held back by back-pressure): handle them
    /// in the next progress even without an event.
    again: bool,
    /// Creation order.
    seq: u64,
    /// The peer's endpoint joined this connection from the one it had with this local
    /// address: frames after `Joined` wait until that one is resolved into `wait`.
    joined: Option<SocketAddrV4>,
    /// The connection the peer's endpoint left: frames here wait for its `Detach`.
    wait: Option<Arc<Mutex<Conn>>>,
    /// A `Put` whose body is being received straight into its destination.
    direct: Option<DirectPut>,
    /// A get answer whose data is being received straight into the requester's buffers.
    direct_get: Option<DirectGet>,
    /// Where the body of a refused `Put` is received and dropped.
    scratch: Vec<u8>,
}

/// A `Put` whose header and fixed fields arrived: the rest of its body goes from the socket
/// to the destination (validated against the registration table for every read), so it is
/// copied once, by the kernel. A destination that is not (or no longer) a live registration
/// is never written: the rest is received into scratch space and the put refused.
#[derive(Debug)]
struct DirectPut {
    op: u64,
    md_id: u64,
    reg_id: u64,
    addr: u64,
    /// Data length, and how much of it arrived.
    len: usize,
    off: usize,
    /// Why the put is refused.
    denied: Option<String>,
}

/// A `GetRep` answering our oldest request, a get: its data goes from the socket to the
/// get's destination buffers (validated when the get was posted, kept registered by the
/// handles held here).
#[derive(Debug)]
struct DirectGet {
    op: u64,
    dst: Vec<(MemHandle, usize, usize)>,
    /// Data length, and how much of it arrived.
    len: usize,
    off: usize,
}

/// Copy `data` to bytes `[off, off + data.len())` of the buffers `dst` laid end to end.
fn scatter(dst: &[(MemHandle, usize, usize)], off: usize, data: &[u8]) {
    let (mut end, mut done) = (0, 0);
    for (m, a, l) in dst {
        let start = end;
        end += l;
        let at = off + done;
        if done == data.len() {
            break;
        }
        if end <= at {
            continue;
        }
        // Every earlier buffer ends at or before `at`.
        let skip = at - start;
        let n = (l - skip).min(data.len() - done);
        debug_assert!(m.region().contains(a + skip, n));
        // SAFETY: [a, a+l) was validated against `m`, a live host registration of the tcp
        // domain, when the get was posted (`check_iov`); `mem_reg`'s contract makes it writable
        // while the handle lives, and the caller holds it. `data` is in the receive buffer,
        // which cannot overlap a user registration.
        unsafe { std::ptr::copy_nonoverlapping(data[done..].as_ptr(), (a + skip) as *mut u8, n) };
        done += n;
    }
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
        let readable = rev & (IN | ERR_HUP) != 0;
        let may_read = {
            let mut c = lock(&self.conn);
            c.kicked = false;
            if c.state == State::Connecting {
                if rev & (OUT | ERR_HUP) != 0 {
                    match c.sock.connect_result() {
                        Ok(()) => c.state = State::Open,
                        Err(e) => c.fail(&format!("connect: {e}")),
                    }
                } else if Instant::now() > c.deadline {
                    c.fail("connect timed out (RUCX_TCP_CONNECT_TIMEOUT)");
                }
            }
            if c.closing && Instant::now() > c.deadline {
                c.fail("closing timed out");
            }
            // Back-pressure: while our answers pile up, read no more requests.
            c.state == State::Open && c.tx.queued() <= c.tx_limit
        };
        let mut delivered = 0;
        if may_read {
            // Frames already buffered first (they may have waited for back-pressure to end).
            let (n, mut go) = self.handle_frames(table, sink);
            delivered += n;
            if readable {
                for _ in 0..READS_PER_PROGRESS {
                    if !go {
                        break;
                    }
                    let read = if self.direct.is_some() {
                        self.recv_direct(table)
                    } else if self.direct_get.is_some() {
                        self.recv_direct_get()
                    } else {
                        self.rx.fill(&mut RawSock(self.fd))
                    };
                    let more = match read {
                        Ok(Fill::Data(_)) => true,
                        Ok(Fill::Drained(_)) => false,
                        Ok(Fill::WouldBlock) => break,
                        Ok(Fill::Eof) => {
                            delivered += self.handle_frames(table, sink).0;
                            let mut c = lock(&self.conn);
                            c.fail("the peer closed the connection");
                            break;
                        }
                        Err(e) => {
                            lock(&self.conn).fail(&format!("receive: {e}"));
                            break;
                        }
                    };
                    if self.direct_get.as_ref().is_some_and(|g| g.off == g.len) {
                        let g = self.direct_get.take().expect("checked");
                        lock(&self.conn).finish_get(g.op);
                    }
                    if self.direct.as_ref().is_some_and(|d| d.off == d.len) {
                        let d = self.direct.take().expect("checked");
                        let mut c = lock(&self.conn);
                        c.answer_put(d.op, d.addr, d.len, d.denied.map_or(Ok(()), Err));
                        if c.tx.queued() > c.tx_limit {
                            // Stop reading requests until the answers drain.
                            break;
                        }
                    }
                    let (n, g) = self.handle_frames(table, sink);
                    delivered += n;
                    go = g && more;
                }
            }
        }
        let mut guard = lock(&self.conn);
        let c = &mut *guard;
        if c.state == State::Open
            && !c.tx.is_empty()
            && let Err(e) = c.tx.write(&mut c.sock)
        {
            c.fail(&format!("send: {e}"));
        }
        if c.state == State::Open && c.ep.is_none() && c.peer_detached && !c.closing {
            // Nobody uses this connection any more: finish sending, then close.
            c.closing = true;
            c.deadline = Instant::now() + c.linger;
        }
        if c.closing && !c.shut && c.state == State::Open && c.tx.is_empty() {
            c.sock.shutdown(Shutdown::Write);
            c.shut = true;
        }
        match c.ep {
            Some(uid) => {
                out.extend(c.tx.drain_done().map(|t| Owned::Completion(t, Ok(()))));
                out.append(&mut c.completions);
                if let State::Failed(r) = &c.state
                    && !c.error_reported
                {
                    let e = c.failure(r);
                    c.error_reported = true;
                    out.push(Owned::EpError(uid, e));
                }
            }
            None => {
                c.tx.drain_done().for_each(drop);
                c.completions.clear();
            }
        }
        self.gone = matches!(c.state, State::Failed(_)) && (c.ep.is_none() || c.error_reported);
        let unloaded = c.tx.queued() <= c.tx_limit;
        self.want = match c.state {
            State::Connecting => OUT,
            State::Open => {
                (if unloaded { IN } else { 0 }) | (if c.tx.is_empty() { 0 } else { OUT })
            }
            State::Failed(_) => 0,
        };
        self.timed = c.state == State::Connecting || (c.closing && c.state == State::Open);
        self.again = c.state == State::Open
            && unloaded
            && (self.wait.is_some() || matches!(self.rx.frame(), Ok(Some(_))));
        delivered
    }

    /// A `Put` of which only the start is buffered: write what arrived to its destination and
    /// receive the rest straight there (`recv_direct`).
    fn start_direct(&mut self, table: &RegTable) {
        let Some((h, body)) = self.rx.partial() else {
            return;
        };
        if h.kind != Kind::Put || body.len() < wire::PUT_FIXED {
            return;
        }
        let (op, md_id, reg_id, addr) = (
            wire::word(body, 0),
            wire::word(body, 1),
            wire::word(body, 2),
            wire::word(body, 3),
        );
        let len = h.body_len - wire::PUT_FIXED;
        let data = &body[wire::PUT_FIXED..];
        let denied = table
            .check(md_id, reg_id, addr, len as u64)
            .and_then(|()| table.write(md_id, reg_id, addr, data))
            .err();
        let off = data.len();
        self.rx.consume_partial(wire::PUT_FIXED + off);
        self.direct = Some(DirectPut {
            op,
            md_id,
            reg_id,
            addr,
            len,
            off,
            denied,
        });
    }

    /// A get answer of which only the start is buffered: it must answer our oldest request,
    /// a get of that length; what arrived goes to the get's buffers, and the rest is received
    /// straight there (`recv_direct_get`).
    fn start_direct_get(&mut self) -> std::result::Result<(), String> {
        let Some((h, body)) = self.rx.partial() else {
            return Ok(());
        };
        if h.kind != Kind::GetRep || body.len() < 8 {
            return Ok(());
        }
        let op = wire::word(body, 0);
        let len = h.body_len - 8;
        let dst = match lock(&self.conn).pending.front() {
            Some(PendingOp {
                op: o,
                kind: PendKind::Get { dst, len: l },
                ..
            }) if *o == op && *l == len => dst.clone(),
            _ => {
                return Err(format!(
                    "get reply of {len} bytes for request {op}, which is not the oldest \
                     outstanding request or not a get of that length"
                ));
            }
        };
        let data = &body[8..];
        scatter(&dst, 0, data);
        let off = data.len();
        self.rx.consume_partial(8 + off);
        self.direct_get = Some(DirectGet { op, dst, len, off });
        Ok(())
    }

    /// Receive more of the direct get answer's data.
    fn recv_direct_get(&mut self) -> io::Result<Fill> {
        let g = self.direct_get.as_mut().expect("a direct get");
        let mut bufs = [(std::ptr::null_mut(), 0); wire::MAX_IOV];
        let (mut cnt, mut skip) = (0, g.off);
        for (m, a, l) in &g.dst {
            if skip >= *l {
                skip -= l;
                continue;
            }
            debug_assert!(m.region().contains(a + skip, l - skip));
            bufs[cnt] = ((a + skip) as *mut u8, l - skip);
            skip = 0;
            cnt += 1;
        }
        let want = g.len - g.off;
        // SAFETY: every buffer lies inside a range validated against a live host registration
        // of the tcp domain when the get was posted (`check_iov`), kept registered (and so, by
        // `mem_reg`'s contract, writable) by the handle clones in `g.dst`; no Rust reference
        // to that memory exists.
        let r = unsafe { RawSock(self.fd).recv_raw_vectored(&bufs[..cnt]) };
        let f = Fill::of_recv(r, want)?;
        g.off += f.bytes();
        Ok(f)
    }

    /// Receive more of the direct `Put`'s body (into its destination, or into scratch space
    /// when refused).
    fn recv_direct(&mut self, table: &RegTable) -> io::Result<Fill> {
        let d = self.direct.as_mut().expect("a direct put");
        let want = d.len - d.off;
        let fd = self.fd;
        let (asked, r) = if d.denied.is_none() {
            let at = d.addr + d.off as u64;
            match table.write_with(d.md_id, d.reg_id, at, want, |p| {
                // SAFETY: `write_with` checked that [at, at+want) lies inside a live host
                // registration and holds the table's read lock while this runs, so the memory
                // stays allocated and writable (`mem_reg`'s contract); no Rust reference to it
                // exists here, and the kernel writes at most `want` bytes.
                unsafe { RawSock(fd).recv_raw(p, want) }
            }) {
                Ok(r) => (want, r),
                Err(reason) => {
                    // Deregistered in the middle: drop the rest and refuse the put.
                    d.denied = Some(reason);
                    return Ok(Fill::Data(0));
                }
            }
        } else {
            if self.scratch.is_empty() {
                self.scratch = vec![0u8; crate::stream::READ_CHUNK];
            }
            let n = want.min(self.scratch.len());
            (n, RawSock(fd).recv(&mut self.scratch[..n]))
        };
        let f = Fill::of_recv(r, asked)?;
        d.off += f.bytes();
        Ok(f)
    }

    /// Handle every complete buffered frame. Returns the active messages delivered and
    /// whether to keep reading.
    fn handle_frames(
        &mut self,
        table: &RegTable,
        sink: &mut dyn FnMut(Event<'_>),
    ) -> (usize, bool) {
        let mut delivered = 0;
        loop {
            if self.joined.is_some() {
                return (delivered, false);
            }
            if let Some(w) = &self.wait {
                let w = lock(w);
                if !(w.peer_detached || matches!(w.state, State::Failed(_))) {
                    return (delivered, false);
                }
                drop(w);
                self.wait = None;
            }
            let (h, body) = match self.rx.frame() {
                Ok(None) => {
                    if self.hello && self.direct.is_none() && self.direct_get.is_none() {
                        self.start_direct(table);
                        if let Err(v) = self.start_direct_get() {
                            lock(&self.conn).violation(&v);
                            return (delivered, false);
                        }
                    }
                    return (delivered, true);
                }
                Ok(Some(f)) => f,
                Err(e) => {
                    lock(&self.conn).violation(&e.0);
                    return (delivered, false);
                }
            };
            let res = if !self.hello {
                match h.kind {
                    Kind::Hello => match wire::check_hello(body) {
                        Err(e) => Err(Reply::Violation(e.0)),
                        Ok(announced) => {
                            let mut c = lock(&self.conn);
                            let ok = if self.dialed {
                                c.peer == Some(announced)
                            } else {
                                // A peer announces its own address, nobody else's.
                                c.remote.ip() == IpAddr::V4(*announced.ip())
                            };
                            if ok {
                                c.peer = Some(announced);
                                self.hello = true;
                                Ok(())
                            } else {
                                Err(Reply::Violation(format!(
                                    "hello announces {announced}, but the connection is with {}",
                                    c.peer_name()
                                )))
                            }
                        }
                    },
                    Kind::Fatal => Err(Reply::Fail(format!(
                        "the peer refused the connection: {}",
                        wire::reason_text(&body[1..])
                    ))),
                    k => Err(Reply::Violation(format!("{k:?} frame before hello"))),
                }
            } else {
                match h.kind {
                    Kind::Am => {
                        sink(Event::Am {
                            id: h.id,
                            data: body,
                        });
                        delivered += 1;
                        Ok(())
                    }
                    Kind::Put | Kind::GetReq | Kind::Flush => {
                        let mut c = lock(&self.conn);
                        let r = c.serve(h, body, table);
                        if r.is_ok() && c.tx.queued() > c.tx_limit {
                            // Stop reading requests until the answers drain.
                            drop(c);
                            self.rx.consume(&h);
                            return (delivered, false);
                        }
                        r
                    }
                    Kind::Ack | Kind::GetRep | Kind::OpError => {
                        lock(&self.conn).handle_reply(h, body)
                    }
                    Kind::Detach => {
                        lock(&self.conn).peer_detached = true;
                        Ok(())
                    }
                    Kind::Joined => match wire::check_joined(body) {
                        Ok(left) if self.dialed && self.wait.is_none() => {
                            self.joined = Some(left);
                            Ok(())
                        }
                        Ok(_) => Err(Reply::Violation(
                            "joined on a connection the peer opened, or twice".into(),
                        )),
                        Err(e) => Err(Reply::Violation(e.0)),
                    },
                    Kind::Fatal => Err(Reply::Fail(format!(
                        "the peer closed the connection: {}",
                        wire::reason_text(&body[1..])
                    ))),
                    Kind::Hello => Err(Reply::Violation("second hello".into())),
                }
            };
            match res {
                Ok(()) => self.rx.consume(&h),
                Err(Reply::Violation(v)) => {
                    lock(&self.conn).violation(&v);
                    return (delivered, false);
                }
                Err(Reply::Fail(r)) => {
                    lock(&self.conn).fail(&r);
                    return (delivered, false);
                }
            }
        }
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
    /// Slots to handle in the next progress without an event.
    again: Vec<usize>,
    /// This progress's work: `(key, epoll events)`.
    work: Vec<(usize, u32)>,
    kicked: Vec<usize>,
    /// Connection pairs to merge: `(dialed key, accepted key)`, see `try_merge`.
    merges: Vec<(usize, usize)>,
    /// Accepted connections whose hello arrived in this progress.
    greeted: Vec<usize>,
    /// Connections that got `Joined` in this progress.
    joining: Vec<usize>,
    /// Endpoints moved onto the peer's connection so far.
    merged: u64,
    events: Vec<Owned>,
}

/// Epoll key of the listener (connections use their slot index).
const LISTENER_KEY: u64 = u64::MAX;
/// Progress calls between deadline checks of connections with no event.
const TIMER_EVERY: u32 = 64;

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
            again: Vec::new(),
            work: Vec::new(),
            kicked: Vec::new(),
            merges: Vec::new(),
            greeted: Vec::new(),
            joining: Vec::new(),
            merged: 0,
            events: Vec::new(),
        })
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

    /// The key the next slot gets.
    fn next_key(&self) -> usize {
        self.free.last().copied().unwrap_or(self.slots.len())
    }

    /// Register a connection made by `new_conn` (with key `next_key()`) and add its slot.
    fn add_slot(&mut self, conn: Conn, dialed: bool) -> io::Result<Arc<Mutex<Conn>>> {
        let key = self.next_key();
        debug_assert_eq!(conn.key, key);
        let fd = conn.sock.0.as_raw_fd();
        let timed = conn.state == State::Connecting;
        let want = match conn.state {
            State::Connecting => OUT,
            // The hello is queued.
            _ => IN | OUT,
        };
        self.watch.add(fd, want, key as u64)?;
        let conn = Arc::new(Mutex::new(conn));
        let slot = Slot {
            conn: conn.clone(),
            fd,
            rx: RxBuf::with_direct_bodies(),
            hello: false,
            dialed,
            gone: false,
            interest: want,
            want,
            timed,
            again: false,
            seq: self.created,
            joined: None,
            wait: None,
            direct: None,
            direct_get: None,
            scratch: Vec::new(),
        };
        self.created += 1;
        self.timed += usize::from(timed);
        match self.free.pop() {
            Some(k) => self.slots[k] = Some(slot),
            None => self.slots.push(Some(slot)),
        }
        Ok(conn)
    }

    fn new_conn(
        &self,
        fd: OwnedFd,
        state: State,
        peer: Option<SocketAddrV4>,
        remote: SocketAddr,
        now: Instant,
    ) -> Conn {
        let mut tx = TxQueue::new();
        tx.push_owned(&wire::hello_frame(self.listen_addr()), None);
        Conn {
            sock: FdSock(fd),
            tx,
            state,
            peer,
            remote,
            dev: self.dev.name.clone(),
            ep: None,
            detach_sent: false,
            peer_detached: false,
            closing: false,
            shut: false,
            next_op: 1,
            pending: VecDeque::new(),
            posted: 0,
            acked: 0,
            completions: Vec::new(),
            error_reported: false,
            tx_limit: self.opts.tx_queue,
            deadline: now + self.opts.connect_timeout,
            linger: self.opts.connect_timeout,
            kick: self.kick.clone(),
            key: self.next_key(),
            kicked: false,
        }
    }

    fn endpoint(&self, conn: Arc<Mutex<Conn>>) -> Box<dyn Endpoint> {
        Box::new(TcpEndpoint {
            conn,
            scratch: vec![0u8; wire::AM_MAX_BCOPY],
        })
    }

    /// Accept up to `max` waiting connections.
    fn accept_some(&mut self, max: usize) {
        {
            for _ in 0..max {
                match sock::accept_nb(&self.listener, &self.opts) {
                    Ok(Some((fd, remote))) => {
                        let unidentified = || self.live().filter(|s| !s.dialed && !s.hello);
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
                        let conn = self.new_conn(fd, State::Open, None, remote, Instant::now());
                        if let Err(e) = self.add_slot(conn, false) {
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
    }

    /// The peer's endpoint moved to connection `key` from the one whose peer-side address
    /// `Joined` named: frames on `key` wait for that connection's `Detach` (none to wait for
    /// when it is gone, failed or already detached).
    fn resolve_joined(&mut self, key: usize) {
        let Some(left) = self
            .slots
            .get_mut(key)
            .and_then(Option::as_mut)
            .and_then(|s| s.joined.take())
        else {
            return;
        };
        let wait = self.live().find_map(|s| {
            let c = lock(&s.conn);
            let pending = !s.dialed
                && c.remote == SocketAddr::V4(left)
                && !c.peer_detached
                && !matches!(c.state, State::Failed(_));
            pending.then(|| s.conn.clone())
        });
        if let Some(s) = self.slots.get_mut(key).and_then(Option::as_mut) {
            s.wait = wait;
            // Handle what is buffered (or keep checking the wait) in the next progress.
            self.again.push(key);
        }
    }

    /// Accepted connections just identified by their hello: when our endpoint to that peer
    /// dialed a connection of its own (both sides created their endpoints at once) and our
    /// listening address is the larger one, plan to move our endpoint onto the accepted
    /// connection, so both directions share one (acknowledgements then ride on the answers
    /// instead of costing packets of their own). The peer, with the smaller address, keeps its
    /// endpoint on the connection it dialed: both pick the same one.
    fn find_merges(&mut self) {
        let me = self.listen_addr();
        let order = |a: SocketAddrV4| (u32::from(*a.ip()), a.port());
        for a in std::mem::take(&mut self.greeted) {
            let Some(sa) = self.slots.get(a).and_then(Option::as_ref) else {
                continue;
            };
            let Some(peer) = lock(&sa.conn).peer else {
                continue;
            };
            if order(me) <= order(peer) || self.merges.iter().any(|&(_, x)| x == a) {
                continue;
            }
            let d = self.slots.iter().enumerate().find_map(|(k, s)| {
                let s = s.as_ref()?;
                let c = lock(&s.conn);
                let free = s.dialed
                    && c.peer == Some(peer)
                    && c.ep.is_some()
                    && !c.detach_sent
                    && !self.merges.iter().any(|&(x, _)| x == k);
                free.then_some(k)
            });
            if let Some(d) = d {
                self.merges.push((d, a));
            }
        }
    }

    /// One step of moving our endpoint from dialed connection `d` to accepted connection `a`
    /// (see `find_merges`), taken when no request of the endpoint is outstanding and nothing
    /// is queued on `d`: the two connection objects trade sockets. The endpoint's object
    /// takes `a`'s socket (with what is queued on it and its state) and sends `Joined` there
    /// first; the other takes `d`'s, sends `Detach` and closes it like any connection nobody
    /// uses. The peer handles `d` up to that `Detach` before what follows `Joined` on `a`, so
    /// the endpoint's messages keep their order. The endpoint holds the same object
    /// throughout, locked during the trade.
    fn try_merge(&mut self, d: usize, a: usize) -> Merge {
        let (Some(sd), Some(sa)) = (
            self.slots.get(d).and_then(Option::as_ref),
            self.slots.get(a).and_then(Option::as_ref),
        ) else {
            return Merge::Abort;
        };
        if !sd.dialed || sa.dialed || !sa.hello || sd.gone || sa.gone {
            return Merge::Abort;
        }
        let (cd_arc, ca_arc) = (sd.conn.clone(), sa.conn.clone());
        let mut cd = lock(&cd_arc);
        let mut ca = lock(&ca_arc);
        let d_ok = cd.ep.is_some()
            && !matches!(cd.state, State::Failed(_))
            && !cd.closing
            && !cd.detach_sent;
        let a_ok = ca.ep.is_none()
            && ca.state == State::Open
            && !ca.closing
            && !ca.detach_sent
            && !ca.peer_detached
            && ca.pending.is_empty()
            && ca.peer == cd.peer;
        if !(d_ok && a_ok) {
            return Merge::Abort;
        }
        if cd.state != State::Open
            || !cd.tx.is_empty()
            || !cd.pending.is_empty()
            || !cd.completions.is_empty()
            || cd.tx.has_done()
        {
            return Merge::Wait;
        }
        let Ok(left) = cd.sock.local_addr() else {
            return Merge::Abort;
        };
        tracing::debug!(
            "tcp interface on {}: endpoint to {} moves to the connection the peer opened",
            self.dev.name,
            cd.peer_name()
        );
        cd.trade_socket(&mut ca);
        cd.tx.push_owned(&wire::joined_frame(left), None);
        // `ca` now has `d`'s socket and no endpoint on it.
        ca.tx.push_owned(&wire::detach_frame(), None);
        ca.detach_sent = true;
        // Written now, so the endpoint's next message goes straight to the socket as before.
        for c in [&mut *cd, &mut *ca] {
            if let Err(e) = c.tx.write(&mut c.sock) {
                c.fail(&format!("send: {e}"));
            }
            c.kick();
        }
        drop(ca);
        drop(cd);
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
        Merge::Done
    }
}

/// Outcome of one `try_merge` step.
#[derive(Debug, PartialEq, Eq)]
enum Merge {
    Done,
    Wait,
    Abort,
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
            if s.hello
                && c.peer == Some(peer)
                && c.ep.is_none()
                && !c.detach_sent
                && !c.closing
                && c.state == State::Open
            {
                c.ep = Some(params.user_id);
                drop(c);
                return Ok(self.endpoint(s.conn.clone()));
            }
        }
        let fd = sock::connect_nb(
            Some(IpAddr::V4(self.dev.addr)),
            SocketAddr::V4(peer),
            &self.opts,
        )?;
        let now = Instant::now();
        let mut conn = self.new_conn(fd, State::Connecting, Some(peer), SocketAddr::V4(peer), now);
        conn.ep = Some(params.user_id);
        let conn = self.add_slot(conn, true).map_err(|e| {
            Error::io(
                format!(
                    "tcp interface on {}: watching a new connection",
                    self.dev.name
                ),
                e,
            )
        })?;
        Ok(self.endpoint(conn))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        // The ready sockets (one epoll_wait), then connections kicked by their endpoints, those
        // with frames held back, and now and then those with a deadline running.
        let mut work = std::mem::take(&mut self.work);
        let mut accept = false;
        self.watch.wait(|key, ev| {
            if key == LISTENER_KEY {
                accept = true;
            } else {
                work.push((key as usize, ev));
            }
        });
        self.kick.take(&mut self.kicked);
        work.extend(self.kicked.drain(..).map(|k| (k, 0)));
        work.extend(self.again.drain(..).map(|k| (k, 0)));
        self.calls = self.calls.wrapping_add(1);
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
            let (timed, hello) = (s.timed, s.hello);
            delivered += s.progress(rev, &self.table, sink, &mut events);
            if !hello && s.hello && !s.dialed {
                self.greeted.push(key);
            }
            if s.joined.is_some() {
                self.joining.push(key);
            }
            self.timed = self.timed + usize::from(s.timed) - usize::from(timed);
            if s.gone {
                // Unwatched before the descriptor can close (when the connection drops).
                self.watch.delete(s.fd, key as u64);
                removed = true;
                continue;
            }
            if s.want != s.interest {
                match self.watch.modify(s.fd, s.want, key as u64) {
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
}

impl Drop for TcpIface {
    fn drop(&mut self) {
        for s in self.live() {
            let mut c = lock(&s.conn);
            c.error_reported = true;
            c.fail("the tcp interface was closed");
            c.completions.clear();
        }
    }
}

/// An endpoint: our side of a connection to a peer interface.
#[derive(Debug)]
pub struct TcpEndpoint {
    conn: Arc<Mutex<Conn>>,
    scratch: Vec<u8>,
}

fn check_am_id(id: AmId) -> Result<()> {
    if usize::from(id) >= AM_ID_MAX {
        return Err(Error::InvalidParam(format!(
            "active message id {id} is out of range (0..{AM_ID_MAX})"
        )));
    }
    Ok(())
}

/// Validate a zero-copy iov: every entry a host registration of the tcp domain that covers
/// it, at most `max_len` bytes in all.
fn check_iov(iov: &[Iov<'_>], max_len: usize, what: &str) -> Result<usize> {
    let total = Iov::check_all(iov, wire::MAX_IOV)?;
    for v in iov {
        if v.memh.inner::<TcpReg>().is_none() || v.memh.region().mem_type != MemoryType::Host {
            return Err(Error::InvalidParam(format!(
                "{what}: buffer {:#x}+{} is registered with {} ({} memory); tcp needs a host \
                 registration of the tcp domain",
                v.addr,
                v.len,
                v.memh.domain(),
                v.memh.region().mem_type
            )));
        }
    }
    if total > max_len {
        return Err(Error::InvalidParam(format!(
            "{what} of {total} bytes exceeds tcp's limit of {max_len} bytes"
        )));
    }
    Ok(total)
}

fn tcp_rkey(rkey: &RemoteKey) -> Result<TcpRkey> {
    rkey.inner::<TcpRkey>()
        .copied()
        .ok_or_else(|| Error::InvalidRkey {
            domain: "tcp".into(),
            reason: format!(
                "remote key was unpacked by domain {}, not tcp",
                rkey.domain()
            ),
        })
}

impl TcpEndpoint {
    fn conn(&self) -> MutexGuard<'_, Conn> {
        lock(&self.conn)
    }

    /// The peer's listening address.
    pub fn peer(&self) -> Option<SocketAddrV4> {
        self.conn().peer
    }

    /// Post a request that the peer answers; `token` completes with the answer.
    fn request(&self, parts: &[Part<'_>], token: Option<u64>, kind: PendKind) -> Result<OpStatus> {
        let mut c = self.conn();
        c.post(parts, None)?;
        let (op, posted) = (c.next_op, c.posted);
        c.pending.push_back(PendingOp {
            op,
            posted,
            token,
            orphan: false,
            kind,
        });
        c.next_op += 1;
        Ok(OpStatus::InProgress)
    }

    fn rma(
        &mut self,
        kind: Kind,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        let what = if kind == Kind::Put {
            "put_zcopy"
        } else {
            "get_zcopy"
        };
        let total = check_iov(iov, wire::RMA_MAX_ZCOPY, what)?;
        let k = tcp_rkey(rkey)?;
        rkey.check(remote_addr, total as u64)?;
        let op = self.conn().next_op;
        if kind == Kind::Put {
            let head = put_head(op, &k, remote_addr, total);
            let mut parts = Vec::with_capacity(1 + iov.len());
            parts.push(Part::Bytes(&head));
            parts.extend(iov.iter().map(|v| Part::Mem(v.memh, v.addr, v.len)));
            self.request(&parts, Some(token), PendKind::Put)
        } else {
            let f = wire::words_frame(
                Kind::GetReq,
                &[op, k.md_id, k.reg_id, remote_addr, total as u64],
                &[],
            );
            let dst = iov
                .iter()
                .map(|v| (v.memh.clone(), v.addr, v.len))
                .collect();
            self.request(
                &[Part::Bytes(&f)],
                Some(token),
                PendKind::Get { dst, len: total },
            )
        }
    }
}

/// Header and fixed fields of a `Put` frame with `len` bytes of data.
fn put_head(
    op: u64,
    k: &TcpRkey,
    remote_addr: u64,
    len: usize,
) -> [u8; wire::HDR_LEN + wire::PUT_FIXED] {
    let mut head = [0u8; wire::HDR_LEN + wire::PUT_FIXED];
    head[..wire::HDR_LEN].copy_from_slice(&wire::header(Kind::Put, 0, wire::PUT_FIXED + len));
    for (i, w) in [op, k.md_id, k.reg_id, remote_addr].into_iter().enumerate() {
        head[wire::HDR_LEN + i * 8..wire::HDR_LEN + i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    head
}

impl Endpoint for TcpEndpoint {
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
        check_am_id(id)?;
        if payload.len() > wire::AM_MAX_SHORT {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {} bytes exceeds tcp's limit of {} bytes",
                payload.len(),
                wire::AM_MAX_SHORT
            )));
        }
        let mut head = [0u8; wire::HDR_LEN + 8];
        head[..wire::HDR_LEN].copy_from_slice(&wire::header(Kind::Am, id, 8 + payload.len()));
        head[wire::HDR_LEN..].copy_from_slice(&header.to_le_bytes());
        self.conn()
            .post(&[Part::Bytes(&head), Part::Bytes(payload)], None)?;
        Ok(())
    }

    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        check_am_id(id)?;
        self.conn().can_queue(wire::HDR_LEN + wire::AM_MAX_BCOPY)?;
        let n = check_packed(pack(&mut self.scratch), wire::AM_MAX_BCOPY, "tcp")?;
        let h = wire::header(Kind::Am, id, n);
        let data = &self.scratch[..n];
        lock(&self.conn).post(&[Part::Bytes(&h), Part::Bytes(data)], None)?;
        Ok(n)
    }

    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        token: u64,
    ) -> Result<OpStatus> {
        check_am_id(id)?;
        if header.len() > wire::AM_MAX_HDR {
            return Err(Error::InvalidParam(format!(
                "am_zcopy header of {} bytes exceeds tcp's limit of {} bytes",
                header.len(),
                wire::AM_MAX_HDR
            )));
        }
        let total = check_iov(iov, wire::AM_MAX_ZCOPY, "am_zcopy")?;
        let h = wire::header(Kind::Am, id, header.len() + total);
        let mut parts = Vec::with_capacity(2 + iov.len());
        parts.push(Part::Bytes(&h));
        parts.push(Part::Bytes(header));
        parts.extend(iov.iter().map(|v| Part::Mem(v.memh, v.addr, v.len)));
        if self.conn().post(&parts, Some(token))? {
            Ok(OpStatus::Done)
        } else {
            Ok(OpStatus::InProgress)
        }
    }

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        if data.len() > wire::PUT_MAX_SHORT {
            return Err(Error::InvalidParam(format!(
                "put_short of {} bytes exceeds tcp's limit of {} bytes",
                data.len(),
                wire::PUT_MAX_SHORT
            )));
        }
        let k = tcp_rkey(rkey)?;
        rkey.check(remote_addr, data.len() as u64)?;
        let op = self.conn().next_op;
        let head = put_head(op, &k, remote_addr, data.len());
        self.request(
            &[Part::Bytes(&head), Part::Bytes(data)],
            None,
            PendKind::Put,
        )?;
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(Kind::Put, iov, remote_addr, rkey, token)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(Kind::GetReq, iov, remote_addr, rkey, token)
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        {
            let c = self.conn();
            c.usable()?;
            if c.posted == c.acked && c.pending.is_empty() {
                return Ok(OpStatus::Done);
            }
        }
        let op = self.conn().next_op;
        let f = wire::words_frame(Kind::Flush, &[op], &[]);
        self.request(&[Part::Bytes(&f)], Some(token), PendKind::Flush)
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        // What was posted is still sent (the interface drains the queue); nothing more is
        // reported for this endpoint, and the peer learns that our side is done.
        let mut c = self.conn();
        c.ep = None;
        c.completions.clear();
        for p in c.pending.iter_mut() {
            p.token = None;
            p.orphan = true;
        }
        if !matches!(c.state, State::Failed(_)) {
            c.tx.push_owned(&wire::detach_frame(), None);
            c.detach_sent = true;
            c.kick();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::md::RegTable;

    fn open() -> TcpIface {
        open_with(TcpOptions::default())
    }

    fn open_with(opts: TcpOptions) -> TcpIface {
        let lo = addr::interfaces()
            .unwrap()
            .into_iter()
            .find(|d| d.loopback)
            .expect("lo");
        TcpIface::open(lo, addr::host_id(), Arc::new(RegTable::new()), opts).unwrap()
    }

    /// Small socket buffers, so a few messages fill them.
    fn tiny() -> TcpOptions {
        TcpOptions {
            sndbuf: Some(4096),
            rcvbuf: Some(4096),
            ..TcpOptions::default()
        }
    }

    fn only_slot(i: &TcpIface) -> &Slot {
        let mut it = i.live();
        let s = it.next().expect("a connection");
        assert!(it.next().is_none(), "one connection");
        s
    }

    const IN: u32 = libc::EPOLLIN as u32;
    const OUT: u32 = libc::EPOLLOUT as u32;

    fn params(to: &TcpIface, user_id: u64) -> EpParams {
        EpParams {
            dev_addr: to.device_address(),
            iface_addr: to.iface_address(),
            user_id,
        }
    }

    /// Progress both until `b` delivers an active message with this id; no other event may
    /// happen on either.
    fn deliver(a: &mut TcpIface, b: &mut TcpIface, id: AmId) {
        let start = Instant::now();
        let mut got = false;
        while !got {
            a.progress(&mut |ev| panic!("unexpected {ev:?}"));
            b.progress(&mut |ev| match ev {
                Event::Am { id: i, .. } if i == id => got = true,
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
    }

    fn settle(a: &mut TcpIface, b: &mut TcpIface, until: impl Fn(&TcpIface, &TcpIface) -> bool) {
        let start = Instant::now();
        while !until(a, b) {
            a.progress(&mut |ev| panic!("unexpected {ev:?}"));
            b.progress(&mut |ev| panic!("unexpected {ev:?}"));
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
    }

    #[test]
    fn the_second_endpoint_shares_the_first_ones_connection() {
        let (mut a, mut b) = (open(), open());
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        ab.am_short(1, 0, b"wire-up").unwrap();
        deliver(&mut a, &mut b, 1);
        // b answers through the connection a opened.
        let mut ba = b.create_ep(&params(&a, 2)).unwrap();
        assert_eq!((a.connections(), b.connections()), (1, 1));
        ba.am_short(2, 0, b"reply").unwrap();
        deliver(&mut b, &mut a, 2);
        // Either side leaving keeps the connection for the other.
        drop(ab);
        settle(&mut a, &mut b, |_, b| {
            lock(&b.live().next().unwrap().conn).peer_detached
        });
        ba.am_short(3, 0, b"still here").unwrap();
        deliver(&mut b, &mut a, 3);
        assert_eq!((a.connections(), b.connections()), (1, 1));
        // Both gone: the connection closes on both sides, quietly.
        drop(ba);
        settle(&mut a, &mut b, |a, b| {
            a.connections() == 0 && b.connections() == 0
        });
    }

    #[test]
    fn simultaneous_endpoints_converge_on_one_connection_and_both_close() {
        let (mut a, mut b) = (open(), open());
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        let mut ba = b.create_ep(&params(&a, 2)).unwrap();
        // Both dialed; the side with the larger address moves its endpoint onto the other's
        // connection while messages flow both ways, and every message arrives, in order.
        let n = 2000u64;
        let (mut sent_a, mut sent_b, mut got_a, mut got_b) = (0u64, 0u64, 0u64, 0u64);
        let start = Instant::now();
        let mut merged_at = None;
        while got_a < n || got_b < n {
            if merged_at.is_none() && a.merged + b.merged > 0 {
                merged_at = Some((sent_a, sent_b));
            }
            if sent_a < n && ab.am_short(1, sent_a, b"x").is_ok() {
                sent_a += 1;
            }
            if sent_b < n && ba.am_short(2, sent_b, b"y").is_ok() {
                sent_b += 1;
            }
            a.progress(&mut |ev| match ev {
                Event::Am { id: 2, data } => {
                    assert_eq!(wire::word(data, 0), got_a, "in order");
                    got_a += 1;
                }
                other => panic!("unexpected {other:?}"),
            });
            b.progress(&mut |ev| match ev {
                Event::Am { id: 1, data } => {
                    assert_eq!(wire::word(data, 0), got_b, "in order");
                    got_b += 1;
                }
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        // One side moved, while messages were still being sent both ways.
        assert_eq!(a.merged + b.merged, 1);
        let (sa, sb) = merged_at.expect("merged during the stream");
        assert!(sa < n && sb < n, "merged at {sa}/{sb} of {n}");
        settle(&mut a, &mut b, |a, b| {
            a.connections() == 1 && b.connections() == 1
        });
        ab.am_short(3, 0, b"after").unwrap();
        deliver(&mut a, &mut b, 3);
        ba.am_short(4, 0, b"after").unwrap();
        deliver(&mut b, &mut a, 4);
        drop(ab);
        drop(ba);
        settle(&mut a, &mut b, |a, b| {
            a.connections() == 0 && b.connections() == 0
        });
    }

    #[test]
    fn silent_strangers_are_bounded() {
        use std::io::Read;
        let mut a = open();
        let addr = a.listen_addr();
        let extra = 20;
        let mut raw = Vec::new();
        for _ in 0..MAX_UNIDENTIFIED + extra {
            raw.push(std::net::TcpStream::connect(addr).unwrap());
            a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        }
        let start = Instant::now();
        while a.connections() < MAX_UNIDENTIFIED || start.elapsed() < Duration::from_millis(200) {
            a.progress(&mut |ev| panic!("unexpected {ev:?}"));
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        assert_eq!(a.connections(), MAX_UNIDENTIFIED);
        // The oldest ones were closed (after our hello), the newest are still open.
        let mut closed = 0;
        for s in raw.iter_mut() {
            s.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 256];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => {
                        closed += 1;
                        break;
                    }
                    Ok(_) => continue,
                    Err(_) => break,
                }
            }
        }
        assert_eq!(closed, extra);
    }

    #[test]
    fn a_connection_left_by_its_endpoint_is_not_reused() {
        let (mut a, mut b) = (open(), open());
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        ab.am_short(1, 0, b"x").unwrap();
        deliver(&mut a, &mut b, 1);
        drop(ab);
        // a's new endpoint to b must not pick the connection it already detached from.
        let mut ab2 = a.create_ep(&params(&b, 3)).unwrap();
        ab2.am_short(4, 0, b"again").unwrap();
        deliver(&mut a, &mut b, 4);
        settle(&mut a, &mut b, |a, b| {
            a.connections() == 1 && b.connections() == 1
        });
    }

    #[test]
    fn output_interest_follows_the_send_queue() {
        let (mut a, mut b) = (open_with(tiny()), open_with(tiny()));
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        ab.am_short(1, 0, b"wire-up").unwrap();
        deliver(&mut a, &mut b, 1);
        settle(&mut a, &mut b, |a, _| only_slot(a).interest == IN);
        // b does not read: the socket buffers fill and a queues the rest, watching for room.
        let mut sent = 0;
        while lock(&only_slot(&a).conn).tx.is_empty() {
            let n = ab
                .am_bcopy(2, &mut |buf| {
                    buf.fill(7);
                    buf.len()
                })
                .unwrap();
            assert_eq!(n, wire::AM_MAX_BCOPY);
            sent += 1;
            assert!(sent < 10_000, "the socket never filled");
        }
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        assert_eq!(only_slot(&a).interest, IN | OUT);
        // b reads everything; a stops watching for room once its queue is empty.
        let mut got = 0;
        let start = Instant::now();
        while got < sent {
            a.progress(&mut |ev| panic!("unexpected {ev:?}"));
            b.progress(&mut |ev| match ev {
                Event::Am { id: 2, data } => {
                    assert!(data.len() == wire::AM_MAX_BCOPY && data.iter().all(|&x| x == 7));
                    got += 1;
                }
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        assert!(lock(&only_slot(&a).conn).tx.is_empty());
        assert_eq!(only_slot(&a).interest, IN);
    }

    #[test]
    fn a_connection_failed_by_its_endpoint_is_reported_and_unwatched() {
        let (mut a, mut b) = (open(), open());
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        ab.am_short(1, 0, b"wire-up").unwrap();
        deliver(&mut a, &mut b, 1);
        settle(&mut a, &mut b, |a, _| only_slot(a).interest == IN);
        // A failure from the endpoint's side, with no socket event of its own: the kick makes
        // the next progress report it and drop the connection.
        lock(&only_slot(&a).conn).fail("test failure");
        let mut errors = 0;
        a.progress(&mut |ev| match ev {
            Event::EpError { user_id: 1, .. } => errors += 1,
            other => panic!("unexpected {other:?}"),
        });
        assert_eq!((errors, a.connections()), (1, 0));
        assert!(ab.am_short(1, 0, b"x").is_err());
        // Its key is reused by the next connection, which works.
        let mut ab2 = a.create_ep(&params(&b, 2)).unwrap();
        assert_eq!(a.slots.len(), 1);
        ab2.am_short(3, 0, b"again").unwrap();
        deliver(&mut a, &mut b, 3);
    }

    /// A raw peer speaking the wire protocol (with the larger address, so it is the side that
    /// moves): its messages on the connection it dialed to `b`, then `Joined` and more
    /// messages on the connection `b` dialed to it. `b` must deliver nothing after `Joined`
    /// until the first connection's `Detach`.
    #[test]
    fn frames_after_joined_wait_for_the_detach_of_the_connection_left() {
        use std::io::{Read, Write};
        let mut b = open();
        let ip2 = std::net::Ipv4Addr::new(127, 0, 0, 2);
        assert!(*b.listen_addr().ip() < ip2);
        let lst = std::net::TcpListener::bind((ip2, 0)).unwrap();
        let me = match lst.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        let raw_params = EpParams {
            dev_addr: DevAddr {
                ip: *me.ip(),
                loopback_host: Some(addr::host_id()),
            }
            .pack(),
            iface_addr: addr::pack_iface_addr(me.port()),
            user_id: 1,
        };
        // b's endpoint dials us (connection A); we dial b (connection D).
        let mut ep = b.create_ep(&raw_params).unwrap();
        ep.am_short(9, 0, b"hi").unwrap();
        b.progress(&mut |ev| panic!("unexpected {ev:?}"));
        let (mut conn_a, _) = lst.accept().unwrap();
        let fd = sock::connect_nb(
            Some(IpAddr::V4(ip2)),
            SocketAddr::V4(b.listen_addr()),
            &TcpOptions::default(),
        )
        .unwrap();
        let mut conn_d = std::net::TcpStream::from(fd);
        conn_d.set_nonblocking(false).unwrap();
        let left = match conn_d.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        let am = |id: u8, v: u64| {
            let mut f = wire::header(Kind::Am, id, 8).to_vec();
            f.extend_from_slice(&v.to_le_bytes());
            f
        };
        let mut d_bytes = wire::hello_frame(me);
        d_bytes.extend(am(1, 1));
        conn_d.write_all(&d_bytes).unwrap();
        let mut a_bytes = wire::hello_frame(me);
        a_bytes.extend(wire::joined_frame(left));
        a_bytes.extend(am(2, 2));
        conn_a.write_all(&a_bytes).unwrap();
        // b's hello and am on A, so A is open on both sides.
        let mut buf = [0u8; 256];
        let _ = conn_a.read(&mut buf).unwrap();
        let mut got = Vec::new();
        let start = Instant::now();
        while got.is_empty() || start.elapsed() < Duration::from_millis(100) {
            b.progress(&mut |ev| match ev {
                Event::Am { id, data } => got.push((id, wire::word(data, 0))),
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        assert_eq!(got, vec![(1, 1)], "the message after joined waits");
        conn_d.write_all(&wire::detach_frame()).unwrap();
        let start = Instant::now();
        while got.len() < 2 {
            b.progress(&mut |ev| match ev {
                Event::Am { id, data } => got.push((id, wire::word(data, 0))),
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        assert_eq!(got, vec![(1, 1), (2, 2)]);
        drop(ep);
    }

    /// Two interfaces with small socket buffers (so a large put arrives over many reads), `b`
    /// exposing `target` for puts; returns the endpoint a to b and the remote key.
    fn rma_pair(
        target: &mut [u8],
    ) -> (
        TcpIface,
        TcpIface,
        crate::md::TcpMd,
        crate::md::TcpMd,
        MemHandle,
        RemoteKey,
    ) {
        use rucx_uct::{MemRegion, MemoryDomain};
        let lo = addr::interfaces()
            .unwrap()
            .into_iter()
            .find(|d| d.loopback)
            .unwrap();
        let small = TcpOptions {
            sndbuf: Some(64 * 1024),
            rcvbuf: Some(64 * 1024),
            ..TcpOptions::default()
        };
        let (ma, mb) = (
            crate::md::TcpMd::new(vec![lo.clone()], small.clone()),
            crate::md::TcpMd::new(vec![lo.clone()], small.clone()),
        );
        let a = TcpIface::open(lo.clone(), addr::host_id(), ma.table(), small.clone()).unwrap();
        let b = TcpIface::open(lo, addr::host_id(), mb.table(), small).unwrap();
        // SAFETY: the caller keeps `target` alive and unmoved until after the handle is dropped.
        let th = unsafe { mb.mem_reg(MemRegion::of_slice(target)) }.unwrap();
        let rkey = ma.rkey_unpack(&mb.mkey_pack(&th).unwrap()).unwrap();
        (a, b, ma, mb, th, rkey)
    }

    /// Progress both until the completion of `token` on `a`; returns its result.
    fn complete(a: &mut TcpIface, b: &mut TcpIface, token: u64) -> Result<()> {
        let start = Instant::now();
        let mut res = None;
        while res.is_none() {
            a.progress(&mut |ev| match ev {
                Event::Completion { token: t, result } if t == token => res = Some(result),
                other => panic!("unexpected {other:?}"),
            });
            b.progress(&mut |ev| panic!("unexpected {ev:?}"));
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        res.unwrap()
    }

    #[test]
    fn large_puts_are_received_straight_into_the_destination() {
        use rucx_uct::{MemRegion, MemoryDomain};
        const LEN: usize = wire::RMA_MAX_ZCOPY;
        let mut target = vec![0xeeu8; LEN + 2 * 4096];
        let (mut a, mut b, ma, _mb, th, rkey) = rma_pair(&mut target);
        let src: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
        // SAFETY: `src` outlives the handle.
        let sh = unsafe { ma.mem_reg(MemRegion::of_slice(&src)) }.unwrap();
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        let base = target.as_ptr() as u64 + 4096;
        for round in 0..3u64 {
            let iov = [Iov {
                addr: src.as_ptr() as usize,
                len: LEN,
                memh: &sh,
            }];
            ab.put_zcopy(&iov, base, &rkey, round).unwrap();
            complete(&mut a, &mut b, round).unwrap();
        }
        // b never buffered a whole put body: it went from the socket to the target.
        assert!(only_slot(&b).rx.allocated() <= crate::stream::READ_CHUNK);
        assert!(target[4096..4096 + LEN] == src[..], "data intact");
        assert!(target[..4096].iter().all(|&x| x == 0xee), "nothing before");
        assert!(
            target[4096 + LEN..].iter().all(|&x| x == 0xee),
            "nothing after"
        );
        drop((ab, sh, th));
    }

    #[test]
    fn a_put_to_a_destination_that_goes_away_is_drained_and_refused() {
        use rucx_uct::{MemRegion, MemoryDomain};
        const LEN: usize = wire::RMA_MAX_ZCOPY;
        let mut target = vec![0u8; LEN];
        let (mut a, mut b, ma, _mb, th, rkey) = rma_pair(&mut target);
        let src = vec![0x42u8; LEN];
        // SAFETY: `src` outlives the handle.
        let sh = unsafe { ma.mem_reg(MemRegion::of_slice(&src)) }.unwrap();
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        let iov = [Iov {
            addr: src.as_ptr() as usize,
            len: LEN,
            memh: &sh,
        }];
        let base = target.as_ptr() as u64;
        ab.put_zcopy(&iov, base, &rkey, 1).unwrap();
        // Deregister once part of the body landed.
        let start = Instant::now();
        while !b.live().any(|s| {
            s.direct
                .as_ref()
                .is_some_and(|d| d.off > 0 && d.off < d.len)
        }) {
            a.progress(&mut |ev| panic!("unexpected {ev:?}"));
            b.progress(&mut |ev| panic!("unexpected {ev:?}"));
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        drop(th);
        let err = complete(&mut a, &mut b, 1).unwrap_err();
        assert!(matches!(err, Error::InvalidRkey { .. }), "{err}");
        // A put to a range that was never registered: refused without a byte written.
        ab.put_zcopy(&iov, base, &rkey, 2).unwrap();
        let err = complete(&mut a, &mut b, 2).unwrap_err();
        assert!(err.to_string().contains("not live"), "{err}");
        // The stream is still in step.
        ab.am_short(5, 0, b"after").unwrap();
        deliver(&mut a, &mut b, 5);
        drop((ab, sh));
    }

    #[test]
    fn large_gets_are_received_straight_into_the_requesters_buffers() {
        use rucx_uct::{MemRegion, MemoryDomain};
        const LEN: usize = wire::RMA_MAX_ZCOPY;
        let mut target: Vec<u8> = (0..LEN).map(|i| (i * 13 % 251) as u8).collect();
        let (mut a, mut b, ma, _mb, th, rkey) = rma_pair(&mut target);
        // Three destination pieces with guard bytes around each.
        let sizes = [100_000usize, 1, LEN - 100_001];
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xeeu8; n + 64]).collect();
        let handles: Vec<MemHandle> = bufs
            .iter()
            .map(|v| {
                // SAFETY: `bufs` outlives the handles (dropped first below).
                unsafe { ma.mem_reg(MemRegion::of_slice(v)) }.unwrap()
            })
            .collect();
        let mut ab = a.create_ep(&params(&b, 1)).unwrap();
        for round in 0..2u64 {
            let iov: Vec<Iov<'_>> = bufs
                .iter_mut()
                .zip(&handles)
                .zip(sizes)
                .map(|((v, h), n)| Iov {
                    addr: v.as_mut_ptr() as usize + 32,
                    len: n,
                    memh: h,
                })
                .collect();
            ab.get_zcopy(&iov, target.as_ptr() as u64, &rkey, round)
                .unwrap();
            complete(&mut a, &mut b, round).unwrap();
        }
        assert!(only_slot(&a).rx.allocated() <= crate::stream::READ_CHUNK);
        let got: Vec<u8> = bufs
            .iter()
            .zip(sizes)
            .flat_map(|(v, n)| v[32..32 + n].to_vec())
            .collect();
        assert!(got == target, "data intact");
        for (v, n) in bufs.iter().zip(sizes) {
            assert!(
                v[..32].iter().chain(&v[32 + n..]).all(|&x| x == 0xee),
                "guards"
            );
        }
        drop((ab, handles, th));
    }

    #[test]
    fn scatter_fills_pieces_from_any_offset() {
        use rucx_uct::{MemRegion, MemoryDomain};
        let md = crate::md::TcpMd::new(Vec::new(), TcpOptions::default());
        let mut bufs = [vec![0u8; 3], vec![0u8; 1], vec![0u8; 5]];
        let dst: Vec<(MemHandle, usize, usize)> = bufs
            .iter_mut()
            .map(|v| {
                // SAFETY: `bufs` outlives the handles.
                let h = unsafe { md.mem_reg(MemRegion::of_slice(v)) }.unwrap();
                (h, v.as_mut_ptr() as usize, v.len())
            })
            .collect();
        scatter(&dst, 0, &[1, 2]);
        scatter(&dst, 2, &[3, 4, 5]);
        scatter(&dst, 5, &[6, 7, 8, 9]);
        drop(dst);
        assert_eq!(bufs, [vec![1, 2, 3], vec![4], vec![5, 6, 7, 8, 9]]);
    }

    /// The start of a large get answer that answers nothing outstanding is refused as soon as
    /// its fixed fields arrive (the rest is never buffered).
    #[test]
    fn a_partial_get_answer_for_no_get_fails_the_endpoint() {
        use std::io::Write;
        let mut b = open();
        let lst = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let me = match lst.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        let p = EpParams {
            dev_addr: DevAddr {
                ip: *me.ip(),
                loopback_host: Some(addr::host_id()),
            }
            .pack(),
            iface_addr: addr::pack_iface_addr(me.port()),
            user_id: 7,
        };
        let ep = b.create_ep(&p).unwrap();
        b.progress(&mut |ev| panic!("unexpected {ev:?}"));
        let (mut raw, _) = lst.accept().unwrap();
        let mut bytes = wire::hello_frame(me);
        bytes.extend(wire::header(Kind::GetRep, 0, 8 + 500_000));
        bytes.extend(77u64.to_le_bytes());
        bytes.extend([0u8; 1000]);
        raw.write_all(&bytes).unwrap();
        let mut failed = None;
        let start = Instant::now();
        while failed.is_none() {
            b.progress(&mut |ev| match ev {
                Event::EpError { user_id: 7, error } => failed = Some(error.to_string()),
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        assert!(failed.unwrap().contains("not the oldest outstanding"));
        drop(ep);
    }
}
