//! The receiving half of a connection, owned by the interface and used without the
//! connection's lock: active messages go to the sink straight from the receive buffer while
//! endpoints (possibly on other threads) keep posting. Frames are handled in order: only
//! `Hello` (or `Fatal`) first, then requests, answers, active messages, `Detach`, `Joined`.
//! The body of a large `Put` or get answer is received straight into its destination once its
//! fixed fields arrived, so it is copied once, by the kernel.

use std::io;
use std::net::SocketAddrV4;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rucx_uct::{Event, MemHandle};

use super::conn::{Conn, Owned, Reply};
use super::lock;
use crate::md::RegTable;
use crate::stream::{Fill, OwnedSock, READ_CHUNK, RawRecv, RxBuf};
use crate::wire::{self, Kind};

/// Reads per connection per progress call, so one busy peer cannot starve the others.
pub(crate) const READS_PER_PROGRESS: usize = 4;

/// What the socket reported to a progress step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Ready {
    /// Readable, or in error / hung up.
    pub(crate) input: bool,
    /// Writable, or in error / hung up.
    pub(crate) output: bool,
}

/// What a progress step leaves for the interface.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Active messages delivered.
    pub(crate) delivered: usize,
    /// Failed and reported: let the connection go.
    pub(crate) gone: bool,
    /// Watch the socket for input / for room.
    pub(crate) read: bool,
    pub(crate) write: bool,
    /// A deadline runs (connecting or closing): check now and then without events.
    pub(crate) timed: bool,
    /// Complete frames wait in the receive buffer (held back by back-pressure or `Joined`):
    /// handle them in the next progress even without an event.
    pub(crate) again: bool,
}

/// A `Put` whose header and fixed fields arrived: the rest of its body goes from the socket
/// to the destination (validated against the registration table for every read). A
/// destination that is not (or no longer) a live registration is never written: the rest is
/// received into scratch space and the put refused.
#[derive(Debug)]
pub(crate) struct DirectPut {
    op: u64,
    md_id: u64,
    reg_id: u64,
    addr: u64,
    /// Data length, and how much of it arrived.
    pub(crate) len: usize,
    pub(crate) off: usize,
    /// Why the put is refused.
    denied: Option<String>,
}

/// A `GetRep` answering our oldest request, a get: its data goes from the socket to the
/// get's destination buffers (validated when the get was posted, kept registered by the
/// handles held here).
#[derive(Debug)]
pub(crate) struct DirectGet {
    op: u64,
    dst: Vec<(MemHandle, usize, usize)>,
    /// Data length, and how much of it arrived.
    len: usize,
    off: usize,
}

/// The receiving half of one connection.
#[derive(Debug)]
pub(crate) struct Receiver<S> {
    pub(crate) rx: RxBuf,
    /// The peer's `Hello` arrived.
    pub(crate) hello: bool,
    /// We opened it (else accepted it).
    pub(crate) dialed: bool,
    /// The peer's endpoint joined this connection from the one it had with this local
    /// address: frames after `Joined` wait until that one is resolved into `wait`.
    pub(crate) joined: Option<SocketAddrV4>,
    /// The connection the peer's endpoint left: frames here wait for its `Detach`.
    pub(crate) wait: Option<Arc<Mutex<Conn<S>>>>,
    /// A `Put` whose body is being received straight into its destination.
    pub(crate) direct: Option<DirectPut>,
    /// A get answer whose data is being received straight into the requester's buffers.
    direct_get: Option<DirectGet>,
    /// Where the body of a refused `Put` is received and dropped.
    scratch: Vec<u8>,
    /// The outcome of a read made before this progress step ([`read_ahead`](Self::read_ahead)),
    /// taken by the step as its first read.
    ahead: Option<io::Result<Fill>>,
}

/// Copy `data` to bytes `[off, off + data.len())` of the buffers `dst` laid end to end.
pub(crate) fn scatter(dst: &[(MemHandle, usize, usize)], off: usize, data: &[u8]) {
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

impl<S: OwnedSock> Receiver<S> {
    /// The receiving half of a connection we dialed (`dialed`) or accepted.
    pub(crate) fn new(dialed: bool) -> Receiver<S> {
        Receiver {
            rx: RxBuf::with_direct_bodies(),
            hello: false,
            dialed,
            joined: None,
            wait: None,
            direct: None,
            direct_get: None,
            scratch: Vec::new(),
            ahead: None,
        }
    }

    /// Read once from `sock` ahead of a progress step, without the connection's lock: into the
    /// receive buffer, or straight into the destination of the `Put` or get answer whose body
    /// is being received. Returns false when nothing arrived (the step has nothing to do and
    /// need not run); otherwise the step that follows ([`progress`](Self::progress)) takes the
    /// outcome as its first read. Only for a connection whose frames are not held back (no
    /// `Joined` pending), as the interface's lone-connection speculation reads it.
    pub(crate) fn read_ahead<R: RawRecv>(&mut self, sock: &mut R, table: &RegTable) -> bool {
        if self.ahead.is_some() || self.joined.is_some() || self.wait.is_some() {
            // The step decides whether to read at all.
            return true;
        }
        match self.read_once(sock, table) {
            Ok(Fill::WouldBlock) => false,
            r => {
                self.ahead = Some(r);
                true
            }
        }
    }

    /// One read: the direct body being received, or else the receive buffer.
    fn read_once<R: RawRecv>(&mut self, sock: &mut R, table: &RegTable) -> io::Result<Fill> {
        if self.direct.is_some() {
            self.recv_direct(sock, table)
        } else if self.direct_get.is_some() {
            self.recv_direct_get(sock)
        } else {
            self.rx.fill(sock)
        }
    }

    /// One progress step of the connection `conn` whose socket is read through `sock`: handle
    /// what the socket reported, read and handle frames, write what is queued, and report
    /// completions and errors into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn progress<R: RawRecv>(
        &mut self,
        conn: &Mutex<Conn<S>>,
        sock: &mut R,
        ready: Ready,
        now: &dyn Fn() -> Instant,
        table: &RegTable,
        sink: &mut dyn FnMut(Event<'_>),
        out: &mut Vec<Owned>,
    ) -> Progress {
        let mut ahead = self.ahead.take();
        let may_read = lock(conn).begin(ready.output, now);
        let mut delivered = 0;
        if may_read {
            // Frames already buffered first (they may have waited for back-pressure to end).
            let (n, mut go) = self.handle_frames(conn, table, sink);
            delivered += n;
            if ready.input || ahead.is_some() {
                for _ in 0..READS_PER_PROGRESS {
                    if !go {
                        break;
                    }
                    let read = match ahead.take() {
                        Some(r) => r,
                        None => self.read_once(sock, table),
                    };
                    let more = match read {
                        Ok(Fill::Data(_)) => true,
                        Ok(Fill::Drained(_)) => false,
                        Ok(Fill::WouldBlock) => break,
                        Ok(Fill::Eof) => {
                            delivered += self.handle_frames(conn, table, sink).0;
                            lock(conn).fail("the peer closed the connection");
                            break;
                        }
                        Err(e) => {
                            lock(conn).fail(&format!("receive: {e}"));
                            break;
                        }
                    };
                    if self.direct_get.as_ref().is_some_and(|g| g.off == g.len) {
                        let g = self.direct_get.take().expect("checked");
                        lock(conn).finish_get(g.op);
                    }
                    if self.direct.as_ref().is_some_and(|d| d.off == d.len) {
                        let d = self.direct.take().expect("checked");
                        let mut c = lock(conn);
                        c.answer_put(d.op, d.addr, d.len, d.denied.map_or(Ok(()), Err));
                        if c.overloaded() {
                            // Stop reading requests until the answers drain.
                            break;
                        }
                    }
                    let (n, g) = self.handle_frames(conn, table, sink);
                    delivered += n;
                    go = g && more;
                }
            }
        }
        if let Some(r @ (Ok(Fill::Eof) | Err(_))) = ahead {
            // Read ahead, but this step did not get to reading (its answers pile up since, or
            // frames are held back): the bytes are buffered, and the end of the stream or the
            // error waits for the step that reads next.
            self.ahead = Some(r);
        }
        let after = lock(conn).finish(now, out);
        Progress {
            delivered,
            gone: after.gone,
            read: after.read,
            write: after.write,
            timed: after.timed,
            again: after.read
                && (self.wait.is_some()
                    || self.ahead.is_some()
                    || !self.rx.is_empty() && matches!(self.rx.frame(), Ok(Some(_)))),
        }
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
        let (op, md_id, reg_id, addr) = wire::put_fields(body);
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
    fn start_direct_get(&mut self, conn: &Mutex<Conn<S>>) -> Result<(), String> {
        let Some((h, body)) = self.rx.partial() else {
            return Ok(());
        };
        if h.kind != Kind::GetRep || body.len() < 8 {
            return Ok(());
        }
        let op = wire::word(body, 0);
        let len = h.body_len - 8;
        let Some(dst) = lock(conn).ops.get_dst(op, len).map(<[_]>::to_vec) else {
            return Err(format!(
                "get reply of {len} bytes for request {op}, which is not the oldest \
                 outstanding request or not a get of that length"
            ));
        };
        let data = &body[8..];
        scatter(&dst, 0, data);
        let off = data.len();
        self.rx.consume_partial(8 + off);
        self.direct_get = Some(DirectGet { op, dst, len, off });
        Ok(())
    }

    /// Receive more of the direct get answer's data.
    fn recv_direct_get<R: RawRecv>(&mut self, sock: &mut R) -> io::Result<Fill> {
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
        let f = Fill::of_recv(unsafe { sock.recv_raw_vectored(&bufs[..cnt]) }, want)?;
        g.off += f.bytes();
        Ok(f)
    }

    /// Receive more of the direct `Put`'s body (into its destination, or into scratch space
    /// when refused).
    fn recv_direct<R: RawRecv>(&mut self, sock: &mut R, table: &RegTable) -> io::Result<Fill> {
        let d = self.direct.as_mut().expect("a direct put");
        let want = d.len - d.off;
        let (asked, r) = if d.denied.is_none() {
            let at = d.addr + d.off as u64;
            match table.write_with(d.md_id, d.reg_id, at, want, |p| {
                // SAFETY: `write_with` checked that [at, at+want) lies inside a live host
                // registration and holds the table's read lock while this runs, so the memory
                // stays allocated and writable (`mem_reg`'s contract); no Rust reference to it
                // exists here.
                unsafe { sock.recv_raw(p, want) }
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
                self.scratch = vec![0u8; READ_CHUNK];
            }
            let n = want.min(self.scratch.len());
            (n, sock.recv(&mut self.scratch[..n]))
        };
        let f = Fill::of_recv(r, asked)?;
        d.off += f.bytes();
        Ok(f)
    }

    /// Handle every complete buffered frame. Returns the active messages delivered and
    /// whether to keep reading. Nothing to look at when no byte is buffered and no frame is
    /// held back: the usual case after the read that took a whole message and its handling,
    /// once per message.
    #[inline]
    pub(crate) fn handle_frames(
        &mut self,
        conn: &Mutex<Conn<S>>,
        table: &RegTable,
        sink: &mut dyn FnMut(Event<'_>),
    ) -> (usize, bool) {
        if self.rx.is_empty() && self.joined.is_none() && self.wait.is_none() {
            return (0, true);
        }
        self.handle_buffered(conn, table, sink)
    }

    /// [`handle_frames`](Self::handle_frames) with bytes buffered or frames held back.
    fn handle_buffered(
        &mut self,
        conn: &Mutex<Conn<S>>,
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
                if !(w.peer_detached || w.is_failed()) {
                    return (delivered, false);
                }
                drop(w);
                self.wait = None;
            }
            let (h, body) = match self.rx.frame() {
                Ok(None) => {
                    // A direct body starts from a partly buffered frame: none when nothing is.
                    if self.hello
                        && self.direct.is_none()
                        && self.direct_get.is_none()
                        && !self.rx.is_empty()
                    {
                        self.start_direct(table);
                        if let Err(v) = self.start_direct_get(conn) {
                            lock(conn).violation(&v);
                            return (delivered, false);
                        }
                    }
                    return (delivered, true);
                }
                Ok(Some(f)) => f,
                Err(e) => {
                    lock(conn).violation(&e.0);
                    return (delivered, false);
                }
            };
            let res = if !self.hello {
                match h.kind {
                    Kind::Hello => wire::check_hello(body)
                        .map_err(|e| Reply::Violation(e.0))
                        .and_then(|announced| lock(conn).accept_hello(announced, self.dialed))
                        .map(|()| self.hello = true),
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
                        let mut c = lock(conn);
                        let r = c.serve(h, body, table);
                        if r.is_ok() && c.overloaded() {
                            // Stop reading requests until the answers drain.
                            drop(c);
                            self.rx.consume(&h);
                            return (delivered, false);
                        }
                        r
                    }
                    Kind::Ack | Kind::GetRep | Kind::OpError => lock(conn).handle_reply(h, body),
                    Kind::Detach => {
                        lock(conn).peer_detached = true;
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
                Err(r) => {
                    lock(conn).end(&r);
                    return (delivered, false);
                }
            }
        }
    }
}
