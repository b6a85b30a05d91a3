//! The tcp interface (listener, accepted connections, progress) and its endpoints.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::{IpAddr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use nix::sys::socket::{Shutdown, shutdown};
use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::iface::{AM_ID_MAX, check_packed};
use rucx_uct::{
    AmId, DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceLimits, Iov,
    MemHandle, OpStatus, PerfModel, RemoteKey,
};

use crate::addr::{self, DevAddr, NetIf};
use crate::md::{RegTable, TcpReg, TcpRkey};
use crate::wire::{self, FdSock, Fill, Header, Kind, RxBuf, Sock, TxQueue, code};
use crate::{TL_NAME, TcpOptions, sock};

/// Reads per connection per progress call, so one busy peer cannot starve the others.
const READS_PER_PROGRESS: usize = 4;
/// Connections accepted per progress call.
const ACCEPTS_PER_PROGRESS: usize = 16;

fn lock(c: &Mutex<OutConn>) -> MutexGuard<'_, OutConn> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An event owned until it is handed to the sink (completions and endpoint errors are gathered
/// under a connection's lock and delivered after it is released, so the sink may post on the
/// same endpoint).
#[derive(Debug)]
enum Owned {
    Completion(u64, Result<()>),
    EpError(u64, Error),
}

/// A request waiting for the peer's answer.
#[derive(Debug)]
struct PendingOp {
    op: u64,
    /// Value of `OutConn::posted` right after this request was posted.
    posted: u64,
    /// Completion token; `None` for `put_short`, which has no completion.
    token: Option<u64>,
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
enum OutState {
    Connecting,
    Open,
    Failed(String),
}

/// One endpoint's connection, shared by the endpoint (posting) and the interface (progress).
#[derive(Debug)]
pub(crate) struct OutConn {
    sock: FdSock,
    rx: RxBuf,
    tx: TxQueue,
    state: OutState,
    peer: SocketAddrV4,
    dev: String,
    user_id: u64,
    next_op: u64,
    pending: VecDeque<PendingOp>,
    /// Frames posted (Hello excluded).
    posted: u64,
    /// Frames the peer has certainly processed (all up to the last answered request).
    acked: u64,
    completions: Vec<Owned>,
    /// The endpoint was dropped: send what is queued, half-close, wait for the peer's close.
    ep_dropped: bool,
    /// Half-closed after the endpoint was dropped.
    shut: bool,
    error_reported: bool,
    tx_limit: usize,
    /// Connect deadline, then (once dropped) the deadline for closing.
    deadline: Instant,
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

impl OutConn {
    fn failure(&self, reason: &str) -> Error {
        Error::EndpointFailure {
            peer: format!("tcp {} (device {})", self.peer, self.dev),
            reason: reason.to_string(),
        }
    }

    fn usable(&self) -> Result<()> {
        match &self.state {
            OutState::Failed(r) => Err(self.failure(r)),
            _ => Ok(()),
        }
    }

    fn can_queue(&self, n: usize) -> Result<()> {
        self.usable()?;
        if !self.tx.is_empty() && self.tx.queued().saturating_add(n) > self.tx_limit {
            return Err(Error::NoResource(format!(
                "tcp send queue to {} holds {} bytes, the limit is RUCX_TCP_TX_QUEUE={}",
                self.peer,
                self.tx.queued(),
                self.tx_limit
            )));
        }
        Ok(())
    }

    /// Queue a frame (trying to write it at once when nothing else waits). Returns true when
    /// the whole frame went to the socket now (then `token` is not reported later).
    fn post(&mut self, parts: &[Part<'_>], token: Option<u64>) -> Result<bool> {
        let total: usize = parts.iter().map(Part::len).sum();
        self.can_queue(total)?;
        let mut sent = 0;
        if self.state == OutState::Open && self.tx.is_empty() {
            let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p.slice())).collect();
            loop {
                match self.sock.send_vectored(&slices) {
                    Ok(n) => sent = n,
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
        Ok(false)
    }

    /// Fail the connection: every operation in flight completes with the error; the endpoint
    /// error is reported by the next progress.
    fn fail(&mut self, reason: &str) {
        if matches!(self.state, OutState::Failed(_)) {
            return;
        }
        if !self.ep_dropped {
            tracing::debug!("tcp endpoint to {} failed: {reason}", self.peer);
        }
        self.state = OutState::Failed(reason.to_string());
        let _ = shutdown(self.sock.0.as_raw_fd(), Shutdown::Both);
        // Items written completely before the failure did complete.
        for t in self.tx.drain_done().collect::<Vec<_>>() {
            self.completions.push(Owned::Completion(t, Ok(())));
        }
        let mut tokens = self.tx.clear();
        let pend: Vec<PendingOp> = self.pending.drain(..).collect();
        tokens.extend(pend.into_iter().filter_map(|p| p.token));
        for t in tokens {
            let e = self.failure(reason);
            self.completions.push(Owned::Completion(t, Err(e)));
        }
    }

    /// Send a best-effort `Fatal` frame, then fail.
    fn violation(&mut self, reason: &str) {
        tracing::warn!(
            "tcp endpoint to {}: protocol violation: {reason}; closing the connection",
            self.peer
        );
        let f = wire::fatal_frame(code::PROTOCOL, reason);
        let _ = self.sock.send_vectored(&[IoSlice::new(&f)]);
        self.fail(&format!("protocol violation by the peer: {reason}"));
    }

    /// Progress this connection; `revents` from poll (0 when not polled).
    fn progress(&mut self, revents: i16, now: Instant, out: &mut Vec<Owned>) {
        let readable = revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
        match self.state {
            OutState::Connecting => {
                if revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0 {
                    match sock::connect_result(&self.sock.0) {
                        Ok(()) => self.state = OutState::Open,
                        Err(e) => self.fail(&format!("connect: {e}")),
                    }
                } else if now > self.deadline {
                    self.fail("connect timed out (RUCX_TCP_CONNECT_TIMEOUT)");
                }
            }
            OutState::Open if self.ep_dropped && now > self.deadline => {
                self.fail("closing timed out")
            }
            _ => {}
        }
        if self.state == OutState::Open && readable {
            self.read();
        }
        if self.state == OutState::Open
            && !self.tx.is_empty()
            && let Err(e) = self.tx.write(&mut self.sock)
        {
            self.fail(&format!("send: {e}"));
        }
        if self.ep_dropped && !self.shut && self.state == OutState::Open && self.tx.is_empty() {
            // Everything is out: half-close, then wait for the peer to close its side.
            let _ = shutdown(self.sock.0.as_raw_fd(), Shutdown::Write);
            self.shut = true;
        }
        for t in self.tx.drain_done() {
            self.completions.push(Owned::Completion(t, Ok(())));
        }
        if self.ep_dropped {
            self.completions.clear();
            return;
        }
        out.append(&mut self.completions);
        if let OutState::Failed(r) = &self.state
            && !self.error_reported
        {
            self.error_reported = true;
            out.push(Owned::EpError(self.user_id, self.failure(r)));
        }
    }

    fn read(&mut self) {
        for _ in 0..READS_PER_PROGRESS {
            match self.rx.fill(&mut self.sock) {
                Ok(Fill::Data(_)) => {}
                Ok(Fill::WouldBlock) => break,
                Ok(Fill::Eof) => {
                    self.handle_frames();
                    self.fail("the peer closed the connection");
                    return;
                }
                Err(e) => {
                    self.fail(&format!("receive: {e}"));
                    return;
                }
            }
            if !self.handle_frames() {
                return;
            }
        }
    }

    /// Handle every complete frame; false when the connection failed.
    fn handle_frames(&mut self) -> bool {
        loop {
            let outcome = match self.rx.frame() {
                Ok(None) => return true,
                Err(e) => Err(Reply::Violation(e.0)),
                Ok(Some((h, body))) => {
                    let r = handle_reply(
                        &mut self.pending,
                        &mut self.acked,
                        &mut self.completions,
                        h,
                        body,
                        self.peer,
                    );
                    Ok((h, r))
                }
            };
            match outcome {
                Ok((h, Ok(()))) => self.rx.consume(&h),
                Ok((_, Err(r))) | Err(r) => {
                    match r {
                        Reply::Violation(v) => self.violation(&v),
                        Reply::Fail(reason) => self.fail(&reason),
                    }
                    return false;
                }
            }
        }
    }
}

enum Reply {
    /// The peer broke the protocol.
    Violation(String),
    /// The connection must fail for this reason.
    Fail(String),
}

fn handle_reply(
    pending: &mut VecDeque<PendingOp>,
    acked: &mut u64,
    completions: &mut Vec<Owned>,
    h: Header,
    body: &[u8],
    peer: SocketAddrV4,
) -> std::result::Result<(), Reply> {
    let front_op =
        |pending: &VecDeque<PendingOp>, op: u64, what: &str| -> std::result::Result<(), Reply> {
            match pending.front() {
                Some(p) if p.op == op => Ok(()),
                Some(p) => Err(Reply::Violation(format!(
                    "{what} for request {op}, but request {} is the oldest outstanding",
                    p.op
                ))),
                None => Err(Reply::Violation(format!(
                    "{what} for request {op}, but none is outstanding"
                ))),
            }
        };
    match h.kind {
        Kind::Ack => {
            let op = wire::word(body, 0);
            front_op(pending, op, "ack")?;
            if matches!(pending.front().map(|p| &p.kind), Some(PendKind::Get { .. })) {
                return Err(Reply::Violation(format!("ack for get request {op}")));
            }
            let p = pending.pop_front().expect("checked");
            *acked = p.posted;
            if let Some(t) = p.token {
                completions.push(Owned::Completion(t, Ok(())));
            }
        }
        Kind::GetRep => {
            let op = wire::word(body, 0);
            front_op(pending, op, "get reply")?;
            let data = &body[8..];
            let Some(PendKind::Get { dst, len }) = pending.front().map(|p| &p.kind) else {
                return Err(Reply::Violation(format!(
                    "get reply for request {op}, which is not a get"
                )));
            };
            if *len != data.len() {
                return Err(Reply::Violation(format!(
                    "get reply of {} bytes for a {len}-byte get",
                    data.len()
                )));
            }
            let mut off = 0;
            for (m, a, l) in dst {
                debug_assert!(m.region().contains(*a, *l));
                // SAFETY: [a, a+l) was validated against `m`, a live host registration of the
                // tcp domain (see `check_iov`); `mem_reg`'s contract makes it writable while the
                // handle lives, and the pending operation holds it. `data` is in the receive
                // buffer, which cannot overlap a user registration.
                unsafe { std::ptr::copy_nonoverlapping(data[off..].as_ptr(), *a as *mut u8, *l) };
                off += l;
            }
            let p = pending.pop_front().expect("checked");
            *acked = p.posted;
            if let Some(t) = p.token {
                completions.push(Owned::Completion(t, Ok(())));
            }
        }
        Kind::OpError => {
            let op = wire::word(body, 0);
            front_op(pending, op, "refusal")?;
            let reason = wire::reason_text(&body[9..]);
            let p = pending.pop_front().expect("checked");
            *acked = p.posted;
            let what = match p.kind {
                PendKind::Put => "put",
                PendKind::Get { .. } => "get",
                PendKind::Flush => "flush",
            };
            let err = Error::InvalidRkey {
                domain: "tcp".into(),
                reason: format!("peer {peer} refused the {what}: {reason}"),
            };
            match p.token {
                Some(t) => completions.push(Owned::Completion(t, Err(err))),
                // put_short has no completion: the endpoint is the only place to report it.
                None => return Err(Reply::Fail(format!("peer refused a put_short: {reason}"))),
            }
        }
        Kind::Fatal => {
            let reason = wire::reason_text(&body[1..]);
            return Err(Reply::Fail(format!(
                "the peer closed the connection: {reason}"
            )));
        }
        k => {
            return Err(Reply::Violation(format!(
                "unexpected {k:?} frame on an endpoint's connection"
            )));
        }
    }
    Ok(())
}

/// A connection accepted by the interface; requests arrive here and are answered here.
#[derive(Debug)]
struct InConn {
    sock: FdSock,
    rx: RxBuf,
    tx: TxQueue,
    peer: SocketAddr,
    hello: bool,
    deadline: Instant,
    closed: bool,
}

impl InConn {
    fn close(&mut self, why: &str) {
        tracing::debug!("tcp: closing accepted connection from {}: {why}", self.peer);
        let _ = shutdown(self.sock.0.as_raw_fd(), Shutdown::Both);
        self.tx.clear();
        self.closed = true;
    }

    fn violation(&mut self, reason: &str) {
        tracing::warn!(
            "tcp: protocol violation on the connection from {}: {reason}; closing it",
            self.peer
        );
        let f = wire::fatal_frame(code::PROTOCOL, reason);
        let _ = self.tx.write(&mut self.sock);
        let _ = self.sock.send_vectored(&[IoSlice::new(&f)]);
        self.close(reason);
    }

    fn progress(
        &mut self,
        revents: i16,
        now: Instant,
        table: &RegTable,
        tx_limit: usize,
        sink: &mut dyn FnMut(Event<'_>),
    ) -> usize {
        let mut delivered = 0;
        if !self.hello && now > self.deadline {
            self.close("no hello in time");
            return 0;
        }
        let readable = revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
        // Back-pressure: while our answers pile up, stop reading requests.
        if readable && self.tx.queued() <= tx_limit {
            for _ in 0..READS_PER_PROGRESS {
                match self.rx.fill(&mut self.sock) {
                    Ok(Fill::Data(_)) => {}
                    Ok(Fill::WouldBlock) => break,
                    Ok(Fill::Eof) => {
                        delivered += self.handle_frames(table, sink);
                        self.close("peer closed");
                        return delivered;
                    }
                    Err(e) => {
                        self.close(&format!("receive: {e}"));
                        return delivered;
                    }
                }
                delivered += self.handle_frames(table, sink);
                if self.closed || self.tx.queued() > tx_limit {
                    break;
                }
            }
        }
        if !self.closed
            && !self.tx.is_empty()
            && let Err(e) = self.tx.write(&mut self.sock)
        {
            self.close(&format!("send: {e}"));
        }
        delivered
    }

    fn handle_frames(&mut self, table: &RegTable, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        let mut delivered = 0;
        while !self.closed {
            let (h, body) = match self.rx.frame() {
                Ok(None) => break,
                Ok(Some(f)) => f,
                Err(e) => {
                    let r = e.0;
                    self.violation(&r);
                    break;
                }
            };
            let res = serve(
                &mut self.hello,
                &mut self.tx,
                table,
                h,
                body,
                sink,
                &mut delivered,
            );
            if let Err(r) = res {
                self.violation(&r);
                break;
            }
            self.rx.consume(&h);
        }
        delivered
    }
}

/// Serve one request frame on an accepted connection.
fn serve(
    hello: &mut bool,
    tx: &mut TxQueue,
    table: &RegTable,
    h: Header,
    body: &[u8],
    sink: &mut dyn FnMut(Event<'_>),
    delivered: &mut usize,
) -> std::result::Result<(), String> {
    if !*hello {
        if h.kind != Kind::Hello {
            return Err(format!("{:?} frame before hello", h.kind));
        }
        wire::check_hello(body).map_err(|e| e.0)?;
        *hello = true;
        return Ok(());
    }
    match h.kind {
        Kind::Am => {
            sink(Event::Am {
                id: h.id,
                data: body,
            });
            *delivered += 1;
        }
        Kind::Put => {
            let (op, md_id, reg_id, addr) = (
                wire::word(body, 0),
                wire::word(body, 1),
                wire::word(body, 2),
                wire::word(body, 3),
            );
            let data = &body[wire::PUT_FIXED..];
            match table.write(md_id, reg_id, addr, data) {
                Ok(()) => {
                    tx.push_owned(&wire::words_frame(Kind::Ack, &[op], &[]), None);
                }
                Err(reason) => {
                    tracing::debug!("tcp: refused put {addr:#x}+{}: {reason}", data.len());
                    tx.push_owned(
                        &wire::op_error_frame(op, code::ACCESS_DENIED, &reason),
                        None,
                    );
                }
            }
        }
        Kind::GetReq => {
            let w: Vec<u64> = (0..5).map(|i| wire::word(body, i)).collect();
            let (op, md_id, reg_id, addr, len) = (w[0], w[1], w[2], w[3], w[4]);
            if len > wire::RMA_MAX_ZCOPY as u64 {
                return Err(format!(
                    "get of {len} bytes exceeds the limit of {}",
                    wire::RMA_MAX_ZCOPY
                ));
            }
            let len = len as usize;
            let mut rep = Vec::with_capacity(wire::HDR_LEN + 8 + len);
            rep.extend_from_slice(&wire::header(Kind::GetRep, 0, 8 + len));
            rep.extend_from_slice(&op.to_le_bytes());
            match table.read_into(md_id, reg_id, addr, len, &mut rep) {
                Ok(()) => {
                    tx.push_vec(rep, None);
                }
                Err(reason) => {
                    tracing::debug!("tcp: refused get {addr:#x}+{len}: {reason}");
                    tx.push_owned(
                        &wire::op_error_frame(op, code::ACCESS_DENIED, &reason),
                        None,
                    );
                }
            }
        }
        Kind::Flush => {
            let op = wire::word(body, 0);
            tx.push_owned(&wire::words_frame(Kind::Ack, &[op], &[]), None);
        }
        Kind::Fatal => {
            return Err(format!("peer reported: {}", wire::reason_text(&body[1..])));
        }
        k => return Err(format!("unexpected {k:?} frame on an accepted connection")),
    }
    Ok(())
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
    incoming: Vec<InConn>,
    outgoing: Vec<Arc<Mutex<OutConn>>>,
    pollfds: Vec<libc::pollfd>,
    events: Vec<Owned>,
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
            incoming: Vec::new(),
            outgoing: Vec::new(),
            pollfds: Vec::new(),
            events: Vec::new(),
        })
    }

    /// The listening socket address.
    pub fn listen_addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.dev.addr, self.port)
    }

    /// Accepted connections currently open (for tests and diagnostics).
    pub fn accepted_connections(&self) -> usize {
        self.incoming.len()
    }

    /// Endpoint connections currently tracked (for tests and diagnostics).
    pub fn endpoint_connections(&self) -> usize {
        self.outgoing.len()
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
        let fd: OwnedFd = sock::connect_nb(
            Some(IpAddr::V4(self.dev.addr)),
            SocketAddr::V4(peer),
            &self.opts,
        )?;
        let mut tx = TxQueue::new();
        tx.push_owned(&wire::hello_frame(), None);
        let conn = Arc::new(Mutex::new(OutConn {
            sock: FdSock(fd),
            rx: RxBuf::new(),
            tx,
            state: OutState::Connecting,
            peer,
            dev: self.dev.name.clone(),
            user_id: params.user_id,
            next_op: 1,
            pending: VecDeque::new(),
            posted: 0,
            acked: 0,
            completions: Vec::new(),
            ep_dropped: false,
            shut: false,
            error_reported: false,
            tx_limit: self.opts.tx_queue,
            deadline: Instant::now() + self.opts.connect_timeout,
        }));
        self.outgoing.push(conn.clone());
        Ok(Box::new(TcpEndpoint {
            conn,
            scratch: vec![0u8; wire::AM_MAX_BCOPY],
            linger: self.opts.connect_timeout,
        }))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        let now = Instant::now();
        // One poll(2) over the listener, the accepted connections and the endpoints'.
        self.pollfds.clear();
        self.pollfds.push(libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for c in &self.incoming {
            let mut ev = libc::POLLIN;
            if !c.tx.is_empty() {
                ev |= libc::POLLOUT;
            }
            self.pollfds.push(libc::pollfd {
                fd: c.sock.0.as_raw_fd(),
                events: ev,
                revents: 0,
            });
        }
        for c in &self.outgoing {
            let c = lock(c);
            let ev = match c.state {
                OutState::Connecting => libc::POLLOUT,
                OutState::Open => libc::POLLIN | if c.tx.is_empty() { 0 } else { libc::POLLOUT },
                OutState::Failed(_) => 0,
            };
            self.pollfds.push(libc::pollfd {
                fd: if ev == 0 { -1 } else { c.sock.0.as_raw_fd() },
                events: ev,
                revents: 0,
            });
        }
        // SAFETY: `pollfds` is a valid, initialized array of `len` pollfd structures that lives
        // across the call; every fd in it is owned by this interface (or -1) and stays open.
        let rc = unsafe {
            libc::poll(
                self.pollfds.as_mut_ptr(),
                self.pollfds.len() as libc::nfds_t,
                0,
            )
        };
        if rc < 0 {
            // EINTR or ENOMEM: treat as "nothing ready"; the next progress retries.
            for p in &mut self.pollfds {
                p.revents = 0;
            }
        }

        let mut delivered = 0;
        // Accepted connections first: they carry the active messages.
        let n_in = self.incoming.len();
        for (i, c) in self.incoming.iter_mut().enumerate() {
            let rev = self.pollfds[1 + i].revents;
            delivered += c.progress(rev, now, &self.table, self.opts.tx_queue, sink);
        }
        self.incoming.retain(|c| !c.closed);

        // Endpoint connections: gather events under each lock, deliver after.
        let mut events = std::mem::take(&mut self.events);
        for (i, c) in self.outgoing.iter().enumerate() {
            let rev = self.pollfds[1 + n_in + i].revents;
            lock(c).progress(rev, now, &mut events);
        }
        self.outgoing.retain(|c| {
            let c = lock(c);
            let done = match c.state {
                OutState::Failed(_) => c.error_reported || c.ep_dropped,
                _ => false,
            };
            !done
        });

        // New connections.
        if self.pollfds[0].revents & libc::POLLIN != 0 {
            for _ in 0..ACCEPTS_PER_PROGRESS {
                match sock::accept_nb(&self.listener, &self.opts) {
                    Ok(Some((fd, peer))) => {
                        tracing::debug!(
                            "tcp interface on {}: accepted a connection from {peer}",
                            self.dev.name
                        );
                        self.incoming.push(InConn {
                            sock: FdSock(fd),
                            rx: RxBuf::new(),
                            tx: TxQueue::new(),
                            peer,
                            hello: false,
                            deadline: now + self.opts.connect_timeout,
                            closed: false,
                        });
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("tcp interface on {}: accept failed: {e}", self.dev.name);
                        break;
                    }
                }
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
        for c in &self.outgoing {
            let mut c = lock(c);
            c.error_reported = true;
            c.fail("the tcp interface was closed");
            c.completions.clear();
        }
    }
}

/// An endpoint: one connection to a peer interface.
#[derive(Debug)]
pub struct TcpEndpoint {
    conn: Arc<Mutex<OutConn>>,
    scratch: Vec<u8>,
    linger: std::time::Duration,
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
    fn conn(&self) -> MutexGuard<'_, OutConn> {
        lock(&self.conn)
    }

    /// The peer's listening address.
    pub fn peer(&self) -> SocketAddrV4 {
        self.conn().peer
    }

    fn rma(
        &mut self,
        kind: Kind,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: Option<u64>,
    ) -> Result<OpStatus> {
        let what = if kind == Kind::Put {
            "put_zcopy"
        } else {
            "get_zcopy"
        };
        let total = check_iov(iov, wire::RMA_MAX_ZCOPY, what)?;
        let k = tcp_rkey(rkey)?;
        rkey.check(remote_addr, total as u64)?;
        let mut c = self.conn();
        c.usable()?;
        let op = c.next_op;
        if kind == Kind::Put {
            let mut head = Vec::with_capacity(wire::HDR_LEN + wire::PUT_FIXED);
            head.extend_from_slice(&wire::header(Kind::Put, 0, wire::PUT_FIXED + total));
            for w in [op, k.md_id, k.reg_id, remote_addr] {
                head.extend_from_slice(&w.to_le_bytes());
            }
            let mut parts = vec![Part::Bytes(&head)];
            parts.extend(iov.iter().map(|v| Part::Mem(v.memh, v.addr, v.len)));
            c.post(&parts, None)?;
            let posted = c.posted;
            c.pending.push_back(PendingOp {
                op,
                posted,
                token,
                kind: PendKind::Put,
            });
        } else {
            let f = wire::words_frame(
                Kind::GetReq,
                &[op, k.md_id, k.reg_id, remote_addr, total as u64],
                &[],
            );
            c.post(&[Part::Bytes(&f)], None)?;
            let posted = c.posted;
            c.pending.push_back(PendingOp {
                op,
                posted,
                token,
                kind: PendKind::Get {
                    dst: iov
                        .iter()
                        .map(|v| (v.memh.clone(), v.addr, v.len))
                        .collect(),
                    len: total,
                },
            });
        }
        c.next_op += 1;
        Ok(OpStatus::InProgress)
    }
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
        let h = wire::header(Kind::Am, id, 8 + payload.len());
        let hdr = header.to_le_bytes();
        self.conn().post(
            &[Part::Bytes(&h), Part::Bytes(&hdr), Part::Bytes(payload)],
            None,
        )?;
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
        let mut parts = vec![Part::Bytes(&h), Part::Bytes(header)];
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
        let mut c = self.conn();
        let op = c.next_op;
        let mut head = Vec::with_capacity(wire::HDR_LEN + wire::PUT_FIXED);
        head.extend_from_slice(&wire::header(Kind::Put, 0, wire::PUT_FIXED + data.len()));
        for w in [op, k.md_id, k.reg_id, remote_addr] {
            head.extend_from_slice(&w.to_le_bytes());
        }
        c.post(&[Part::Bytes(&head), Part::Bytes(data)], None)?;
        let posted = c.posted;
        c.pending.push_back(PendingOp {
            op,
            posted,
            token: None,
            kind: PendKind::Put,
        });
        c.next_op += 1;
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(Kind::Put, iov, remote_addr, rkey, Some(token))
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(Kind::GetReq, iov, remote_addr, rkey, Some(token))
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        let mut c = self.conn();
        c.usable()?;
        if c.posted == c.acked && c.pending.is_empty() {
            return Ok(OpStatus::Done);
        }
        let op = c.next_op;
        let f = wire::words_frame(Kind::Flush, &[op], &[]);
        c.post(&[Part::Bytes(&f)], None)?;
        let posted = c.posted;
        c.pending.push_back(PendingOp {
            op,
            posted,
            token: Some(token),
            kind: PendKind::Flush,
        });
        c.next_op += 1;
        Ok(OpStatus::InProgress)
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        let mut c = self.conn();
        // What was posted is still sent (the interface drains the queue, then closes);
        // nothing more is reported for this endpoint.
        c.ep_dropped = true;
        c.completions.clear();
        c.deadline = Instant::now() + self.linger;
    }
}
