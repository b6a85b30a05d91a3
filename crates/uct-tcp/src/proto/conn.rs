//! One connection's state, shared (behind a mutex) by the interface and the endpoint on it:
//! the socket it writes and the send queue, `Connecting`/`Open`/`Failed`, the peer's identity
//! (checked against its `Hello`), `Detach` and closing, and our endpoint's requests. Frames of
//! our endpoint go straight to the socket when nothing waits before them; the rest is queued
//! and written by the interface's progress. Completions and endpoint errors are gathered here
//! and handed out by the interface after it released the lock, so the user's sink may post on
//! any endpoint.

use std::io::{self, IoSlice};
use std::net::{IpAddr, Shutdown, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rucx_ucs::{Error, Result};
use rucx_uct::{MemHandle, OpStatus};

use super::ops::{PendKind, Requests};
use crate::md::RegTable;
use crate::ready::Kick;
use crate::stream::{OwnedSock, TxQueue};
use crate::wire::{self, Header, Kind, code};

/// An event owned until it is handed to the sink.
#[derive(Debug)]
pub(crate) enum Owned {
    Completion(u64, Result<()>),
    EpError(u64, Error),
}

/// Where a connection stands.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Our connect is in progress; what our endpoint posts is queued behind our `Hello`.
    Connecting,
    Open,
    /// Failed for this reason; every operation of our endpoint completed with the error.
    Failed(String),
}

/// Why handling a frame ended the connection.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The peer broke the protocol.
    Violation(String),
    /// The connection must fail for this reason.
    Fail(String),
}

/// A piece of a frame being posted.
pub(crate) enum Part<'a> {
    Bytes(&'a [u8]),
    /// `(handle, address, length)`: bytes in registered memory, validated against the handle.
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

/// What a new connection is given by its interface.
#[derive(Debug, Clone)]
pub(crate) struct Setup {
    /// The device name, for messages.
    pub(crate) dev: String,
    /// Our listening address, announced in `Hello`.
    pub(crate) listen: SocketAddrV4,
    /// Most bytes queued beyond what the socket took.
    pub(crate) tx_limit: usize,
    /// How long a connect, and then closing, may take.
    pub(crate) timeout: Duration,
    /// Where to ask for the interface's attention.
    pub(crate) kick: Arc<Kick>,
}

/// The half of a connection shared by the interface and the endpoint on it.
#[derive(Debug)]
pub(crate) struct Conn<S> {
    pub(crate) sock: S,
    pub(crate) tx: TxQueue,
    pub(crate) state: State,
    /// The peer's listening address: the address dialed, or the one its `Hello` announced.
    pub(crate) peer: Option<SocketAddrV4>,
    /// Where the socket is connected (for messages before the peer's `Hello`).
    pub(crate) remote: SocketAddr,
    dev: String,
    /// User id of our endpoint on this connection.
    pub(crate) ep: Option<u64>,
    pub(crate) detach_sent: bool,
    pub(crate) peer_detached: bool,
    /// Sending what is left, then half-closing (no endpoint on either side).
    pub(crate) closing: bool,
    shut: bool,
    pub(crate) ops: Requests,
    pub(crate) completions: Vec<Owned>,
    pub(crate) error_reported: bool,
    tx_limit: usize,
    /// Connect deadline, then the deadline for closing.
    deadline: Instant,
    linger: Duration,
    /// Where to ask for the interface's attention, and this connection's key there.
    kick: Arc<Kick>,
    pub(crate) key: usize,
    /// In the kick list and not handled yet.
    kicked: bool,
}

/// What the end of a progress step leaves for the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct After {
    /// Failed and reported: the interface lets it go.
    pub(crate) gone: bool,
    /// Watch the socket for input (open, and our answers do not pile up: buffered requests
    /// may be handled too).
    pub(crate) read: bool,
    /// Watch the socket for room (connecting, or output queued).
    pub(crate) write: bool,
    /// A deadline runs.
    pub(crate) timed: bool,
}

impl<S> Conn<S> {
    pub(crate) fn is_failed(&self) -> bool {
        matches!(self.state, State::Failed(_))
    }
}

impl<S: OwnedSock> Conn<S> {
    /// A connection on `sock` with our `Hello` queued, in `state`, with interface key `key`.
    pub(crate) fn new(
        sock: S,
        state: State,
        peer: Option<SocketAddrV4>,
        remote: SocketAddr,
        setup: &Setup,
        key: usize,
        now: Instant,
    ) -> Conn<S> {
        let mut tx = TxQueue::new();
        tx.push_owned(&wire::hello_frame(setup.listen), None);
        Conn {
            sock,
            tx,
            state,
            peer,
            remote,
            dev: setup.dev.clone(),
            ep: None,
            detach_sent: false,
            peer_detached: false,
            closing: false,
            shut: false,
            ops: Requests::default(),
            completions: Vec::new(),
            error_reported: false,
            tx_limit: setup.tx_limit,
            deadline: now + setup.timeout,
            linger: setup.timeout,
            kick: setup.kick.clone(),
            key,
            kicked: false,
        }
    }

    /// Trade everything that belongs to the socket (the socket, its send queue, its state and
    /// its interface key) with `other`; the endpoint's part (who is on it, its requests and
    /// counters) stays.
    pub(crate) fn trade_socket(&mut self, other: &mut Conn<S>) {
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
    pub(crate) fn kick(&mut self) {
        if !self.kicked {
            self.kicked = true;
            self.kick.push(self.key);
        }
    }

    pub(crate) fn peer_name(&self) -> String {
        match self.peer {
            Some(p) => format!("tcp {p} (device {})", self.dev),
            None => format!("tcp {} (device {})", self.remote, self.dev),
        }
    }

    pub(crate) fn failure(&self, reason: &str) -> Error {
        Error::EndpointFailure {
            peer: self.peer_name(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn usable(&self) -> Result<()> {
        match &self.state {
            State::Failed(r) => Err(self.failure(r)),
            _ => Ok(()),
        }
    }

    pub(crate) fn can_queue(&self, n: usize) -> Result<()> {
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

    /// Whether our endpoint to `peer` may take over this connection (the peer opened it and
    /// said hello, and our side of it is free).
    pub(crate) fn free_for(&self, peer: SocketAddrV4) -> bool {
        self.peer == Some(peer)
            && self.ep.is_none()
            && !self.detach_sent
            && !self.closing
            && self.state == State::Open
    }

    /// Queue a frame of our endpoint (writing it at once when nothing else waits). Returns
    /// true when the whole frame went to the socket now (then `token` is not reported later).
    pub(crate) fn post(&mut self, parts: &[Part<'_>], token: Option<u64>) -> Result<bool> {
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
        self.ops.count_posted();
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

    /// Post a request that the peer answers; `token` completes with the answer.
    pub(crate) fn request(
        &mut self,
        parts: &[Part<'_>],
        token: Option<u64>,
        kind: PendKind,
    ) -> Result<OpStatus> {
        self.post(parts, None)?;
        self.ops.push(token, kind);
        Ok(OpStatus::InProgress)
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
    pub(crate) fn fail(&mut self, reason: &str) {
        if self.is_failed() {
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
        tokens.extend(self.ops.drain_tokens());
        for t in tokens {
            let e = self.failure(reason);
            self.completions.push(Owned::Completion(t, Err(e)));
        }
    }

    /// Tell the peer why (best effort), then fail.
    pub(crate) fn violation(&mut self, reason: &str) {
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

    /// Fail the connection as `r` says.
    pub(crate) fn end(&mut self, r: &Reply) {
        match r {
            Reply::Violation(v) => self.violation(v),
            Reply::Fail(f) => self.fail(f),
        }
    }

    /// The peer's `Hello` announced `announced` as its listening address: on a connection we
    /// dialed it must be the address dialed; on one we accepted it must be on the host the
    /// connection comes from (a peer announces its own address, nobody else's).
    pub(crate) fn accept_hello(
        &mut self,
        announced: SocketAddrV4,
        dialed: bool,
    ) -> std::result::Result<(), Reply> {
        let ok = if dialed {
            self.peer == Some(announced)
        } else {
            self.remote.ip() == IpAddr::V4(*announced.ip())
        };
        if ok {
            self.peer = Some(announced);
            Ok(())
        } else {
            Err(Reply::Violation(format!(
                "hello announces {announced}, but the connection is with {}",
                self.peer_name()
            )))
        }
    }

    /// Handle an answer to one of our requests.
    pub(crate) fn handle_reply(
        &mut self,
        h: Header,
        body: &[u8],
    ) -> std::result::Result<(), Reply> {
        let op = wire::word(body, 0);
        let data = if h.kind == Kind::GetRep {
            &body[8..]
        } else {
            &[][..]
        };
        let front = self
            .ops
            .check_answer(h.kind, op, data.len())
            .map_err(Reply::Violation)?;
        if let (Kind::GetRep, PendKind::Get { dst, .. }) = (h.kind, &front.kind) {
            let mut off = 0;
            for (m, a, l) in dst {
                debug_assert!(m.region().contains(*a, *l));
                // SAFETY: [a, a+l) was validated against `m`, a live host registration of
                // the tcp domain (see `check_iov`); `mem_reg`'s contract makes it writable
                // while the handle lives, and the pending operation holds it. `data` is in
                // the receive buffer, which cannot overlap a user registration.
                unsafe { std::ptr::copy_nonoverlapping(data[off..].as_ptr(), *a as *mut u8, *l) };
                off += l;
            }
        }
        let p = self.ops.pop_answered().expect("checked");
        if h.kind == Kind::OpError {
            let reason = wire::reason_text(&body[9..]);
            let err = Error::InvalidRkey {
                domain: "tcp".into(),
                reason: format!(
                    "peer {} refused the {}: {reason}",
                    self.peer_name(),
                    p.kind.name()
                ),
            };
            match p.token {
                Some(t) => self.completions.push(Owned::Completion(t, Err(err))),
                // put_short has no completion: the endpoint is the only place to report it.
                None if !p.orphan => {
                    let why = format!("peer refused a put_short: {reason}");
                    // The connection fails: the flushes behind it with it.
                    for t in p.flushes {
                        let e = self.failure(&why);
                        self.completions.push(Owned::Completion(t, Err(e)));
                    }
                    return Err(Reply::Fail(why));
                }
                None => {}
            }
        } else if let Some(t) = p.token {
            self.completions.push(Owned::Completion(t, Ok(())));
        }
        // The peer processed everything up to this request: the flushes behind it are done
        // (whether or not it refused the request itself).
        self.complete_flushes(p.flushes);
        Ok(())
    }

    fn complete_flushes(&mut self, flushes: Vec<u64>) {
        self.completions
            .extend(flushes.into_iter().map(|t| Owned::Completion(t, Ok(()))));
    }

    /// Queue the answer to a `Put` of `len` bytes at `addr`.
    pub(crate) fn answer_put(
        &mut self,
        op: u64,
        addr: u64,
        len: usize,
        r: std::result::Result<(), String>,
    ) {
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
    pub(crate) fn finish_get(&mut self, op: u64) {
        if let Some(p) = self.ops.finish(op) {
            if let Some(t) = p.token {
                self.completions.push(Owned::Completion(t, Ok(())));
            }
            self.complete_flushes(p.flushes);
        }
    }

    /// Serve a request of the peer; the answer is queued.
    pub(crate) fn serve(
        &mut self,
        h: Header,
        body: &[u8],
        table: &RegTable,
    ) -> std::result::Result<(), Reply> {
        match h.kind {
            Kind::Put => {
                let (op, md_id, reg_id, addr) = wire::put_fields(body);
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

    /// Answers queued beyond the limit: stop reading requests until they drain.
    pub(crate) fn overloaded(&self) -> bool {
        self.tx.queued() > self.tx_limit
    }

    /// Start of a progress step: finish or time out a connect (`output`: the socket reported
    /// writable or an error), time out closing. Returns whether to read.
    pub(crate) fn begin(&mut self, output: bool, now: &dyn Fn() -> Instant) -> bool {
        self.kicked = false;
        if self.state == State::Connecting {
            if output {
                match self.sock.connect_result() {
                    Ok(()) => self.state = State::Open,
                    Err(e) => self.fail(&format!("connect: {e}")),
                }
            } else if now() > self.deadline {
                self.fail("connect timed out (RUCX_TCP_CONNECT_TIMEOUT)");
            }
        }
        if self.closing && now() > self.deadline {
            self.fail("closing timed out");
        }
        // Back-pressure: while our answers pile up, read no more requests.
        self.state == State::Open && !self.overloaded()
    }

    /// End of a progress step: write what is queued, start closing a connection nobody uses,
    /// half-close once everything went, and hand our endpoint's completions and error to
    /// `out`.
    pub(crate) fn finish(&mut self, now: &dyn Fn() -> Instant, out: &mut Vec<Owned>) -> After {
        if self.state == State::Open
            && !self.tx.is_empty()
            && let Err(e) = self.tx.write(&mut self.sock)
        {
            self.fail(&format!("send: {e}"));
        }
        if self.state == State::Open && self.ep.is_none() && self.peer_detached && !self.closing {
            // Nobody uses this connection any more: finish sending, then close.
            self.closing = true;
            self.deadline = now() + self.linger;
        }
        if self.closing && !self.shut && self.state == State::Open && self.tx.is_empty() {
            self.sock.shutdown(Shutdown::Write);
            self.shut = true;
        }
        match self.ep {
            Some(uid) => {
                out.extend(self.tx.drain_done().map(|t| Owned::Completion(t, Ok(()))));
                out.append(&mut self.completions);
                if let State::Failed(r) = &self.state
                    && !self.error_reported
                {
                    let e = self.failure(r);
                    self.error_reported = true;
                    out.push(Owned::EpError(uid, e));
                }
            }
            None => {
                self.tx.drain_done().for_each(drop);
                self.completions.clear();
            }
        }
        let unloaded = !self.overloaded();
        let open = self.state == State::Open;
        After {
            gone: self.is_failed() && (self.ep.is_none() || self.error_reported),
            read: open && unloaded,
            write: self.state == State::Connecting || open && !self.tx.is_empty(),
            timed: self.state == State::Connecting || (self.closing && open),
        }
    }

    /// Our endpoint on this connection is gone: what it posted is still sent, then `Detach`;
    /// nothing more is reported for it.
    pub(crate) fn endpoint_gone(&mut self) {
        self.ep = None;
        self.completions.clear();
        self.ops.orphan_all();
        if !self.is_failed() {
            self.tx.push_owned(&wire::detach_frame(), None);
            self.detach_sent = true;
            self.kick();
        }
    }

    /// The interface is closing: fail quietly (nobody is left to report to).
    pub(crate) fn interface_closed(&mut self) {
        self.error_reported = true;
        self.fail("the tcp interface was closed");
        self.completions.clear();
    }
}
