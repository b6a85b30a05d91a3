//! The tcp transport's wire format and the buffered socket I/O under it.
//!
//! Every frame is an 8-byte header followed by a body:
//!
//! | bytes | field                                                       |
//! |-------|-------------------------------------------------------------|
//! | 0..4  | `body_len: u32` (little endian), bytes after the header       |
//! | 4     | `kind: u8` (see [`Kind`])                                   |
//! | 5     | `id: u8`, the active-message id for [`Kind::Am`], else 0     |
//! | 6..8  | `mark: u16` = [`MARK`], catches a stream that lost framing  |
//!
//! Bodies, all integers little endian:
//!
//! - `Hello`: `magic: u32 = HELLO_MAGIC`, `version: u16`, `reserved: u16 = 0`, then the
//!   sender's listening address: `ip: [u8; 4]`, `port: u16`, `reserved: u16 = 0`. First frame
//!   in each direction of every connection.
//! - `Am`: the message bytes as the receiver sees them.
//! - `Put`: `op: u64`, `md_id: u64`, `reg_id: u64`, `addr: u64`, then the data.
//! - `GetReq`: `op: u64`, `md_id: u64`, `reg_id: u64`, `addr: u64`, `len: u64`.
//! - `Flush`: `op: u64`.
//! - `Ack`: `op: u64` (answers `Put` and `Flush`).
//! - `GetRep`: `op: u64`, then the data.
//! - `OpError`: `op: u64`, `code: u8`, then a UTF-8 reason (answers any request that was
//!   refused; the connection stays up).
//! - `Fatal`: `code: u8`, then a UTF-8 reason; the sender closes the connection after it.
//! - `Detach`: empty. The sender's endpoint on this connection is gone; it sends no more
//!   requests here. A side that has no endpoint on the connection and got the peer's `Detach`
//!   sends what it still has queued and closes.
//! - `Joined`: `ip: [u8; 4]`, `port: u16`, `reserved: u16 = 0`, the sender's local address of
//!   another connection between the same two interfaces. The sender's endpoint moved from that
//!   connection (which it left with `Detach`) to this one: the receiver handles that
//!   connection's frames up to its `Detach` before the frames after `Joined` here, so the
//!   endpoint's messages keep their order.
//!
//! A connection is full duplex: each side may have an endpoint on it that sends requests
//! (`Am`, `Put`, `GetReq`, `Flush`), and each side answers the requests it receives (`Ack`,
//! `GetRep`, `OpError`) on the same connection, in request order. Either side may send `Fatal`.
//!
//! [`RxBuf`] reassembles frames from reads of any size and [`TxQueue`] keeps what a write did
//! not take (owned bytes or references into registered memory), so partial reads and writes
//! are invisible above this module.

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, IoSlice};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::socket::{MsgFlags, recv, sendmsg};
use rucx_uct::MemHandle;

/// Frame header length.
pub const HDR_LEN: usize = 8;
/// Constant in every header; a mismatch means the stream is not (or no longer) ours.
pub const MARK: u16 = 0x7c5a;
/// First word of a `Hello` body ("RXTC").
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"RXTC");
/// Wire protocol version.
pub const VERSION: u16 = 2;

/// Largest `am_short` payload (after the 8-byte header).
pub const AM_MAX_SHORT: usize = 256;
/// Largest `am_bcopy` message.
pub const AM_MAX_BCOPY: usize = 8 * 1024;
/// Largest `am_zcopy` payload.
pub const AM_MAX_ZCOPY: usize = 64 * 1024;
/// Largest `am_zcopy` user header.
pub const AM_MAX_HDR: usize = 128;
/// Largest `put_short`.
pub const PUT_MAX_SHORT: usize = 256;
/// Largest `put_zcopy` / `get_zcopy`.
pub const RMA_MAX_ZCOPY: usize = 1024 * 1024;
/// Most iov entries in one zero-copy operation.
pub const MAX_IOV: usize = 16;

/// Largest `Am` body.
pub const AM_MAX_BODY: usize = AM_MAX_ZCOPY + AM_MAX_HDR;
/// Bytes before the data in a `Put` body.
pub const PUT_FIXED: usize = 32;
/// Exact `GetReq` body length.
pub const GET_REQ_LEN: usize = 40;
/// Largest reason text in `OpError` / `Fatal`.
pub const MAX_REASON: usize = 1024;
/// Largest body of any frame.
pub const MAX_BODY: usize = PUT_FIXED + RMA_MAX_ZCOPY;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Connection preamble.
    Hello = 1,
    /// Active message.
    Am = 2,
    /// Remote write.
    Put = 3,
    /// Remote read request.
    GetReq = 4,
    /// Flush request.
    Flush = 5,
    /// Acknowledgement of a `Put` or `Flush`.
    Ack = 6,
    /// Data answering a `GetReq`.
    GetRep = 7,
    /// A request was refused.
    OpError = 8,
    /// The connection is being closed because of an error.
    Fatal = 9,
    /// The sender's endpoint on this connection is gone.
    Detach = 10,
    /// The sender's endpoint moved here from another connection.
    Joined = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Am,
            3 => Kind::Put,
            4 => Kind::GetReq,
            5 => Kind::Flush,
            6 => Kind::Ack,
            7 => Kind::GetRep,
            8 => Kind::OpError,
            9 => Kind::Fatal,
            10 => Kind::Detach,
            11 => Kind::Joined,
            _ => return None,
        })
    }

    /// The body length bounds `(min, max)` for this kind.
    fn body_bounds(self) -> (usize, usize) {
        match self {
            Kind::Hello => (HELLO_LEN, HELLO_LEN),
            Kind::Detach => (0, 0),
            Kind::Joined => (JOINED_LEN, JOINED_LEN),
            Kind::Am => (0, AM_MAX_BODY),
            Kind::Put => (PUT_FIXED, PUT_FIXED + RMA_MAX_ZCOPY),
            Kind::GetReq => (GET_REQ_LEN, GET_REQ_LEN),
            Kind::Flush | Kind::Ack => (8, 8),
            Kind::GetRep => (8, 8 + RMA_MAX_ZCOPY),
            Kind::OpError => (9, 9 + MAX_REASON),
            Kind::Fatal => (1, 1 + MAX_REASON),
        }
    }
}

/// Codes carried by `OpError` and `Fatal`.
pub mod code {
    /// The access is outside every live registration (or names one that is gone).
    pub const ACCESS_DENIED: u8 = 1;
    /// The peer sent something that does not follow the protocol.
    pub const PROTOCOL: u8 = 2;
    /// The peer is shutting down.
    pub const SHUTDOWN: u8 = 3;
}

/// Why a byte stream is not a valid frame sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError(pub String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Active-message id (0 for other kinds).
    pub id: u8,
    /// Body length.
    pub body_len: usize,
}

/// Encode a header.
pub fn header(kind: Kind, id: u8, body_len: usize) -> [u8; HDR_LEN] {
    debug_assert!(body_len <= MAX_BODY);
    let mut h = [0u8; HDR_LEN];
    h[..4].copy_from_slice(&(body_len as u32).to_le_bytes());
    h[4] = kind as u8;
    h[5] = id;
    h[6..].copy_from_slice(&MARK.to_le_bytes());
    h
}

/// Parse and validate a header.
pub fn parse_header(b: &[u8; HDR_LEN]) -> Result<Header, WireError> {
    let body_len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let mark = u16::from_le_bytes([b[6], b[7]]);
    if mark != MARK {
        return Err(WireError(format!(
            "bad frame mark {mark:#06x} (expected {MARK:#06x}): not a rucx tcp stream or framing lost"
        )));
    }
    let kind =
        Kind::from_u8(b[4]).ok_or_else(|| WireError(format!("unknown frame kind {}", b[4])))?;
    let (min, max) = kind.body_bounds();
    if body_len < min || body_len > max {
        return Err(WireError(format!(
            "{kind:?} frame with a {body_len}-byte body (allowed {min}..={max})"
        )));
    }
    let id = b[5];
    if kind == Kind::Am {
        if usize::from(id) >= rucx_uct::iface::AM_ID_MAX {
            return Err(WireError(format!(
                "active message id {id} is out of range (at most {})",
                rucx_uct::iface::AM_ID_MAX - 1
            )));
        }
    } else if id != 0 {
        return Err(WireError(format!(
            "{kind:?} frame with nonzero id byte {id}"
        )));
    }
    Ok(Header { kind, id, body_len })
}

/// `Hello` body length.
pub const HELLO_LEN: usize = 16;

/// Encode a `Hello` frame announcing the sender's listening address.
pub fn hello_frame(listen: SocketAddrV4) -> Vec<u8> {
    let mut v = Vec::with_capacity(HDR_LEN + HELLO_LEN);
    v.extend_from_slice(&header(Kind::Hello, 0, HELLO_LEN));
    v.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&0u16.to_le_bytes());
    v.extend_from_slice(&listen.ip().octets());
    v.extend_from_slice(&listen.port().to_le_bytes());
    v.extend_from_slice(&0u16.to_le_bytes());
    v
}

/// Validate a `Hello` body; returns the sender's listening address.
pub fn check_hello(body: &[u8]) -> Result<SocketAddrV4, WireError> {
    let magic = u32::from_le_bytes(body[0..4].try_into().expect("hello body is 16 bytes"));
    let version = u16::from_le_bytes([body[4], body[5]]);
    if magic != HELLO_MAGIC {
        return Err(WireError(format!("bad hello magic {magic:#010x}")));
    }
    if version != VERSION {
        return Err(WireError(format!(
            "peer speaks tcp wire version {version}, this build speaks {VERSION}"
        )));
    }
    if body[6] != 0 || body[7] != 0 || body[14] != 0 || body[15] != 0 {
        return Err(WireError("nonzero reserved bytes in hello".into()));
    }
    let ip = Ipv4Addr::new(body[8], body[9], body[10], body[11]);
    let port = u16::from_le_bytes([body[12], body[13]]);
    if port == 0 || ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
        return Err(WireError(format!(
            "hello announces an invalid listening address {ip}:{port}"
        )));
    }
    Ok(SocketAddrV4::new(ip, port))
}

/// `Joined` body length.
pub const JOINED_LEN: usize = 8;

/// Encode a `Joined` frame naming the connection (by the sender's local address) the
/// sender's endpoint left.
pub fn joined_frame(left: SocketAddrV4) -> [u8; HDR_LEN + JOINED_LEN] {
    let mut f = [0u8; HDR_LEN + JOINED_LEN];
    f[..HDR_LEN].copy_from_slice(&header(Kind::Joined, 0, JOINED_LEN));
    f[HDR_LEN..HDR_LEN + 4].copy_from_slice(&left.ip().octets());
    f[HDR_LEN + 4..HDR_LEN + 6].copy_from_slice(&left.port().to_le_bytes());
    f
}

/// Validate a `Joined` body; returns the address it names.
pub fn check_joined(body: &[u8]) -> Result<SocketAddrV4, WireError> {
    if body[6] != 0 || body[7] != 0 {
        return Err(WireError("nonzero reserved bytes in joined".into()));
    }
    let ip = Ipv4Addr::new(body[0], body[1], body[2], body[3]);
    let port = u16::from_le_bytes([body[4], body[5]]);
    Ok(SocketAddrV4::new(ip, port))
}

/// Encode a `Detach` frame.
pub fn detach_frame() -> [u8; HDR_LEN] {
    header(Kind::Detach, 0, 0)
}

/// Encode a frame whose body is `u64` words followed by `tail`.
pub fn words_frame(kind: Kind, words: &[u64], tail: &[u8]) -> Vec<u8> {
    let body = words.len() * 8 + tail.len();
    let mut v = Vec::with_capacity(HDR_LEN + body);
    v.extend_from_slice(&header(kind, 0, body));
    for w in words {
        v.extend_from_slice(&w.to_le_bytes());
    }
    v.extend_from_slice(tail);
    v
}

/// Encode an `OpError` frame.
pub fn op_error_frame(op: u64, code: u8, reason: &str) -> Vec<u8> {
    let r = truncate_reason(reason);
    let mut v = Vec::with_capacity(HDR_LEN + 9 + r.len());
    v.extend_from_slice(&header(Kind::OpError, 0, 9 + r.len()));
    v.extend_from_slice(&op.to_le_bytes());
    v.push(code);
    v.extend_from_slice(r);
    v
}

/// Encode a `Fatal` frame.
pub fn fatal_frame(code: u8, reason: &str) -> Vec<u8> {
    let r = truncate_reason(reason);
    let mut v = Vec::with_capacity(HDR_LEN + 1 + r.len());
    v.extend_from_slice(&header(Kind::Fatal, 0, 1 + r.len()));
    v.push(code);
    v.extend_from_slice(r);
    v
}

fn truncate_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

/// Read the `i`-th little-endian `u64` of a body whose length was validated.
pub fn word(body: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

/// The reason text of an `OpError`/`Fatal` body, lossily decoded.
pub fn reason_text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Byte-stream socket operations the buffers need; a trait so tests can cut every transfer
/// into 1-byte pieces.
pub trait Sock {
    /// Write as much of `bufs` as the socket takes now (`WouldBlock` when nothing).
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Read what is available (0 at end of stream, `WouldBlock` when nothing).
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize>;
}

/// A non-blocking stream socket (TCP or, in tests, a Unix socketpair).
#[derive(Debug)]
pub struct FdSock(pub OwnedFd);

impl Sock for FdSock {
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        // MSG_NOSIGNAL: a reset peer yields EPIPE instead of killing the process with SIGPIPE.
        sendmsg::<()>(self.0.as_raw_fd(), bufs, &[], MsgFlags::MSG_NOSIGNAL, None)
            .map_err(io::Error::from)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        recv(self.0.as_raw_fd(), buf, MsgFlags::empty()).map_err(io::Error::from)
    }
}

/// A borrowed socket descriptor: lets the interface read a connection without taking the lock
/// that endpoints take to write it (the descriptor's owner keeps it open).
#[derive(Debug, Clone, Copy)]
pub struct RawSock(pub RawFd);

impl Sock for RawSock {
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        sendmsg::<()>(self.0, bufs, &[], MsgFlags::MSG_NOSIGNAL, None).map_err(io::Error::from)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        recv(self.0, buf, MsgFlags::empty()).map_err(io::Error::from)
    }
}

/// Receive up to `len` bytes from socket `fd` into memory at `ptr`.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes for the duration of the call, and no Rust
/// reference to that memory may be live.
pub(crate) unsafe fn recv_raw(fd: RawFd, ptr: *mut u8, len: usize) -> io::Result<usize> {
    // SAFETY: the caller guarantees `ptr` is writable for `len` bytes; the kernel writes at
    // most `len` bytes there.
    let n = unsafe { libc::recv(fd, ptr.cast(), len, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Minimum free space offered to one read.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

/// Reassembles frames from a byte stream.
#[derive(Debug, Default)]
pub struct RxBuf {
    buf: Vec<u8>,
    head: usize,
    tail: usize,
    /// The owner takes `Put` and `GetRep` bodies straight from the socket
    /// ([`partial`](Self::partial)): room is made for their fixed fields only, never for the
    /// whole body.
    direct_bodies: bool,
}

/// Outcome of [`RxBuf::fill`].
#[derive(Debug, PartialEq, Eq)]
pub enum Fill {
    /// This many bytes arrived, filling the space offered: more may be waiting.
    Data(usize),
    /// This many bytes arrived, less than the space offered: the socket had no more.
    Drained(usize),
    /// Nothing to read now.
    WouldBlock,
    /// The peer closed its side.
    Eof,
}

impl Fill {
    /// What one `recv` offered `asked` bytes of room returned, for a reader.
    pub fn of_recv(r: io::Result<usize>, asked: usize) -> io::Result<Fill> {
        match r {
            Ok(0) => Ok(Fill::Eof),
            Ok(n) if n < asked => Ok(Fill::Drained(n)),
            Ok(n) => Ok(Fill::Data(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Fill::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Fill::Data(0)),
            Err(e) => Err(e),
        }
    }

    /// Bytes that arrived.
    pub fn bytes(&self) -> usize {
        match self {
            Fill::Data(n) | Fill::Drained(n) => *n,
            Fill::WouldBlock | Fill::Eof => 0,
        }
    }
}

impl RxBuf {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty buffer whose owner receives `Put` and `GetRep` bodies itself: it takes each
    /// such frame as soon as [`partial`](Self::partial) shows its fixed fields, and reads the
    /// rest of the body from the socket into the destination.
    pub fn with_direct_bodies() -> Self {
        RxBuf {
            direct_bodies: true,
            ..Self::default()
        }
    }

    /// Bytes of buffer space allocated (for tests).
    #[cfg(test)]
    pub(crate) fn allocated(&self) -> usize {
        self.buf.len()
    }

    /// Bytes received and not yet consumed.
    pub fn buffered(&self) -> usize {
        self.tail - self.head
    }

    /// Read once from `sock`, making room for at least the frame being assembled.
    pub fn fill(&mut self, sock: &mut dyn Sock) -> io::Result<Fill> {
        let need = match self.peek_header() {
            Some(Ok(h)) if self.direct_bodies && h.kind == Kind::Put => HDR_LEN + PUT_FIXED,
            Some(Ok(h)) if self.direct_bodies && h.kind == Kind::GetRep => HDR_LEN + 8,
            Some(Ok(h)) => HDR_LEN + h.body_len,
            _ => HDR_LEN,
        };
        let want = need.max(READ_CHUNK);
        if self.buf.len() - self.head < want {
            // Not enough room after head: move the partial frame to the front, then grow.
            self.buf.copy_within(self.head..self.tail, 0);
            self.tail -= self.head;
            self.head = 0;
            if self.buf.len() < want {
                self.buf.resize(want, 0);
            }
        } else if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
        let room = self.buf.len() - self.tail;
        let f = Fill::of_recv(sock.recv(&mut self.buf[self.tail..]), room)?;
        self.tail += f.bytes();
        Ok(f)
    }

    fn peek_header(&self) -> Option<Result<Header, WireError>> {
        let avail = &self.buf[self.head..self.tail];
        let h: &[u8; HDR_LEN] = avail.get(..HDR_LEN)?.try_into().ok()?;
        Some(parse_header(h))
    }

    /// The next complete frame, if one has arrived: its header and body. Call
    /// [`consume`](Self::consume) with the header when done with it.
    pub fn frame(&self) -> Result<Option<(Header, &[u8])>, WireError> {
        match self.peek_header() {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok(h)) => {
                let start = self.head + HDR_LEN;
                if self.tail - start < h.body_len {
                    Ok(None)
                } else {
                    Ok(Some((h, &self.buf[start..start + h.body_len])))
                }
            }
        }
    }

    /// The next frame when only part of it has arrived: its header and the body bytes so far.
    pub fn partial(&self) -> Option<(Header, &[u8])> {
        match self.peek_header() {
            Some(Ok(h)) => {
                let start = self.head + HDR_LEN;
                let avail = self.tail - start;
                (avail < h.body_len).then(|| (h, &self.buf[start..self.tail]))
            }
            _ => None,
        }
    }

    /// Drop the header and the first `n` body bytes of the frame [`partial`](Self::partial)
    /// returned (the caller takes the rest of its body from the socket).
    pub fn consume_partial(&mut self, n: usize) {
        self.head += HDR_LEN + n;
        debug_assert!(self.head <= self.tail);
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
    }

    /// Drop the frame returned last by [`frame`](Self::frame).
    pub fn consume(&mut self, h: &Header) {
        self.head += HDR_LEN + h.body_len;
        debug_assert!(self.head <= self.tail);
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
    }
}

/// A piece of queued output.
#[derive(Debug)]
enum Chunk {
    /// Bytes owned by the queue.
    Owned(Vec<u8>),
    /// Bytes in registered memory, kept registered by the handle until written.
    Zcopy {
        memh: MemHandle,
        addr: usize,
        len: usize,
    },
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Chunk::Owned(v) => v.len(),
            Chunk::Zcopy { len, .. } => *len,
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Owned(v) => v,
            Chunk::Zcopy { memh, addr, len } => {
                debug_assert!(memh.region().contains(*addr, *len));
                // SAFETY: the endpoint checked that [addr, addr+len) lies inside `memh`'s host
                // region (Iov::check_all) and that the handle belongs to the tcp domain; by
                // `MemoryDomain::mem_reg`'s contract the memory stays allocated and readable
                // while a clone of the handle lives, and this chunk holds one.
                unsafe { std::slice::from_raw_parts(*addr as *const u8, *len) }
            }
        }
    }
}

#[derive(Debug)]
struct Item {
    chunk: Chunk,
    /// Completion token reported when the last byte of this item was written.
    token: Option<u64>,
    seq: u64,
}

/// Owned chunks shorter than this are merged into the previous owned chunk.
const COALESCE_MAX: usize = 64 * 1024;
/// Most iov entries handed to one `sendmsg`.
const WRITE_IOV: usize = 64;

/// Output waiting for the socket.
#[derive(Debug, Default)]
pub struct TxQueue {
    items: VecDeque<Item>,
    /// Bytes of the first item already written.
    head_off: usize,
    queued: usize,
    next_seq: u64,
    /// Items written completely whose token is to be reported: `(item seq, token)`.
    done: Vec<(u64, u64)>,
    /// A large owned buffer written completely, kept for [`take_buf`](Self::take_buf).
    spare: Option<Vec<u8>>,
}

/// Owned buffers at least this large are kept for reuse once written.
const SPARE_MIN: usize = 64 * 1024;

impl TxQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Unwritten bytes.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Queue owned bytes; returns the item's sequence number.
    pub fn push_owned(&mut self, data: &[u8], token: Option<u64>) -> u64 {
        self.queued += data.len();
        if token.is_none() && data.len() < COALESCE_MAX {
            // Merge into the last owned item: fewer allocations and iov entries.
            if let Some(last) = self.items.back_mut()
                && last.token.is_none()
                && let Chunk::Owned(v) = &mut last.chunk
                && v.len() < COALESCE_MAX
            {
                v.extend_from_slice(data);
                return last.seq;
            }
        }
        self.push_item(Chunk::Owned(data.to_vec()), token)
    }

    /// Queue an owned buffer without copying it.
    pub fn push_vec(&mut self, data: Vec<u8>, token: Option<u64>) -> u64 {
        if data.len() < 4096 && token.is_none() {
            return self.push_owned(&data, None);
        }
        self.queued += data.len();
        self.push_item(Chunk::Owned(data), token)
    }

    /// Queue a reference to registered memory; the caller validated `[addr, addr+len)` against
    /// `memh`, which must be a host registration of the tcp domain.
    pub fn push_zcopy(
        &mut self,
        memh: &MemHandle,
        addr: usize,
        len: usize,
        token: Option<u64>,
    ) -> u64 {
        self.queued += len;
        self.push_item(
            Chunk::Zcopy {
                memh: memh.clone(),
                addr,
                len,
            },
            token,
        )
    }

    fn push_item(&mut self, chunk: Chunk, token: Option<u64>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.items.push_back(Item { chunk, token, seq });
        seq
    }

    /// Write as much as the socket takes. Returns the bytes written; `WouldBlock` is not an
    /// error (it returns what was written so far).
    pub fn write(&mut self, sock: &mut dyn Sock) -> io::Result<usize> {
        let mut total = 0;
        loop {
            self.pop_empty_front();
            if self.items.is_empty() {
                break;
            }
            let n = {
                let mut iov: [IoSlice<'_>; WRITE_IOV] = [IoSlice::new(&[]); WRITE_IOV];
                let mut cnt = 0;
                for (i, it) in self.items.iter().take(WRITE_IOV).enumerate() {
                    let b = it.chunk.bytes();
                    iov[i] = IoSlice::new(if i == 0 { &b[self.head_off..] } else { b });
                    cnt += 1;
                }
                match sock.send_vectored(&iov[..cnt]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            };
            if n == 0 {
                break;
            }
            total += n;
            self.advance(n);
        }
        Ok(total)
    }

    fn advance(&mut self, mut n: usize) {
        self.queued -= n;
        while n > 0 {
            let first = self
                .items
                .front()
                .expect("advance past the queue")
                .chunk
                .len();
            let left = first - self.head_off;
            if n < left {
                self.head_off += n;
                return;
            }
            n -= left;
            self.head_off = 0;
            let it = self.items.pop_front().expect("nonempty");
            if let Some(t) = it.token {
                self.done.push((it.seq, t));
            }
            if let Chunk::Owned(v) = it.chunk
                && v.capacity() >= SPARE_MIN
                && self
                    .spare
                    .as_ref()
                    .is_none_or(|s| s.capacity() < v.capacity())
            {
                self.spare = Some(v);
            }
        }
        self.pop_empty_front();
    }

    /// Items of length 0 at the front are complete as soon as they get there.
    fn pop_empty_front(&mut self) {
        while self.head_off == 0 && self.items.front().is_some_and(|it| it.chunk.len() == 0) {
            let it = self.items.pop_front().expect("nonempty");
            if let Some(t) = it.token {
                self.done.push((it.seq, t));
            }
        }
    }

    /// Remove and return the token of item `seq` if it completed since the last drain.
    pub fn take_done(&mut self, seq: u64) -> Option<u64> {
        let pos = self.done.iter().rposition(|(s, _)| *s == seq)?;
        Some(self.done.remove(pos).1)
    }

    /// Items written completely whose tokens were not drained yet.
    pub fn has_done(&self) -> bool {
        !self.done.is_empty()
    }

    /// Tokens of items written completely since the last call.
    pub fn drain_done(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.done.drain(..).map(|(_, t)| t)
    }

    /// An empty buffer with room for `cap` bytes, to fill and hand to
    /// [`push_vec`](Self::push_vec): a large buffer written earlier when one is big enough (so
    /// a connection serving large gets does not allocate and fault in a fresh one each time).
    pub fn take_buf(&mut self, cap: usize) -> Vec<u8> {
        match self.spare.take() {
            Some(mut v) if v.capacity() >= cap => {
                v.clear();
                v
            }
            other => {
                self.spare = other;
                Vec::with_capacity(cap)
            }
        }
    }

    /// Drop everything queued; returns the tokens of items that never completed.
    pub fn clear(&mut self) -> Vec<u64> {
        let tokens = self.items.drain(..).filter_map(|it| it.token).collect();
        self.head_off = 0;
        self.queued = 0;
        tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recv_outcomes() {
        let e = |k| Err(io::Error::from(k));
        assert_eq!(Fill::of_recv(Ok(0), 8).unwrap(), Fill::Eof);
        assert_eq!(Fill::of_recv(Ok(3), 8).unwrap(), Fill::Drained(3));
        assert_eq!(Fill::of_recv(Ok(8), 8).unwrap(), Fill::Data(8));
        assert_eq!(
            Fill::of_recv(e(io::ErrorKind::WouldBlock), 8).unwrap(),
            Fill::WouldBlock
        );
        assert_eq!(
            Fill::of_recv(e(io::ErrorKind::Interrupted), 8).unwrap(),
            Fill::Data(0)
        );
        assert!(Fill::of_recv(e(io::ErrorKind::ConnectionReset), 8).is_err());
        assert_eq!(Fill::Drained(3).bytes() + Fill::Eof.bytes(), 3);
    }
    use std::os::unix::net::UnixStream;

    /// A socket that moves at most one byte per call.
    struct OneByte(FdSock);

    impl Sock for OneByte {
        fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            match bufs.iter().find(|b| !b.is_empty()) {
                Some(b) => self.0.send_vectored(&[IoSlice::new(&b[..1])]),
                None => Ok(0),
            }
        }
        fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(1);
            self.0.recv(&mut buf[..n])
        }
    }

    fn pair() -> (FdSock, FdSock) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (FdSock(a.into()), FdSock(b.into()))
    }

    fn am_frame(id: u8, data: &[u8]) -> Vec<u8> {
        let mut v = header(Kind::Am, id, data.len()).to_vec();
        v.extend_from_slice(data);
        v
    }

    /// Collect every frame until `want` have arrived, driving both sides.
    fn pump(
        tx: &mut TxQueue,
        w: &mut dyn Sock,
        rx: &mut RxBuf,
        r: &mut dyn Sock,
        want: usize,
    ) -> Vec<(Header, Vec<u8>)> {
        let mut got = Vec::new();
        let mut spins = 0u64;
        while got.len() < want {
            tx.write(w).unwrap();
            match rx.fill(r).unwrap() {
                Fill::Eof => panic!("unexpected eof"),
                Fill::Data(_) | Fill::Drained(_) | Fill::WouldBlock => {}
            }
            while let Some((h, body)) = rx.frame().unwrap() {
                got.push((h, body.to_vec()));
                rx.consume(&h);
            }
            spins += 1;
            assert!(spins < 50_000_000, "no progress");
        }
        got
    }

    #[test]
    fn one_byte_reads_and_writes_keep_frames_intact() {
        let (a, b) = pair();
        let (mut w, mut r) = (OneByte(a), OneByte(b));
        let mut tx = TxQueue::new();
        let mut rx = RxBuf::new();
        let msgs: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; usize::from(i) * 37]).collect();
        let mut seqs = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            // Alternate merged and separately tokened items.
            let tok = (i % 3 == 0).then_some(i as u64);
            seqs.push(tx.push_owned(&am_frame(i as u8, m), tok));
        }
        let got = pump(&mut tx, &mut w, &mut rx, &mut r, msgs.len());
        for (i, (h, body)) in got.iter().enumerate() {
            assert_eq!(h.kind, Kind::Am);
            assert_eq!(usize::from(h.id), i);
            assert_eq!(body, &msgs[i]);
        }
        assert!(tx.is_empty() && tx.queued() == 0);
        let done: Vec<u64> = tx.drain_done().collect();
        assert_eq!(done, vec![0, 3, 6, 9, 12, 15, 18]);
        assert_eq!(rx.buffered(), 0);
    }

    #[test]
    fn zcopy_chunks_are_sent_from_registered_memory() {
        use rucx_uct::MemRegion;
        use std::sync::Arc;
        let (a, b) = pair();
        let (mut w, mut r) = (OneByte(a), OneByte(b));
        let buf: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let memh = MemHandle::new(MemRegion::of_slice(&buf), "test", Arc::new(()));
        let mut tx = TxQueue::new();
        let hdr = header(Kind::Am, 5, 4 + 1000);
        tx.push_owned(&hdr, None);
        tx.push_owned(b"HDR!", None);
        let seq = tx.push_zcopy(&memh, buf.as_ptr() as usize + 100, 1000, Some(77));
        let mut rx = RxBuf::new();
        let got = pump(&mut tx, &mut w, &mut rx, &mut r, 1);
        assert_eq!(&got[0].1[..4], b"HDR!");
        assert_eq!(&got[0].1[4..], &buf[100..1100]);
        assert_eq!(tx.take_done(seq), Some(77));
        assert_eq!(tx.take_done(seq), None);
    }

    #[test]
    fn large_frames_with_real_partial_io() {
        // A full socket buffer forces real partial writes; frames larger than one read chunk
        // force the receive buffer to grow.
        let (mut w, mut r) = pair();
        let mut tx = TxQueue::new();
        let mut rx = RxBuf::new();
        let big: Vec<u8> = (0..RMA_MAX_ZCOPY).map(|i| (i % 251) as u8).collect();
        let mut f = header(Kind::GetRep, 0, 8 + big.len()).to_vec();
        f.extend_from_slice(&9u64.to_le_bytes());
        f.extend_from_slice(&big);
        for _ in 0..3 {
            tx.push_vec(f.clone(), None);
        }
        let got = pump(&mut tx, &mut w, &mut rx, &mut r, 3);
        for (h, body) in got {
            assert_eq!(h.kind, Kind::GetRep);
            assert_eq!(word(&body, 0), 9);
            assert_eq!(&body[8..], &big[..]);
        }
    }

    #[test]
    fn eof_is_reported() {
        let (a, mut r) = pair();
        drop(a);
        let mut rx = RxBuf::new();
        assert_eq!(rx.fill(&mut r).unwrap(), Fill::Eof);
    }

    #[test]
    fn joined_round_trip_and_validation() {
        let left = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), 40123);
        let f = joined_frame(left);
        let h = parse_header(f[..HDR_LEN].try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.body_len), (Kind::Joined, JOINED_LEN));
        assert_eq!(check_joined(&f[HDR_LEN..]).unwrap(), left);
        let mut body = f[HDR_LEN..].to_vec();
        body[7] = 1;
        assert!(check_joined(&body).unwrap_err().0.contains("reserved"));
        let mut h = header(Kind::Joined, 0, 0);
        h[..4].copy_from_slice(&9u32.to_le_bytes());
        assert!(parse_header(&h).is_err(), "long joined");
    }

    #[test]
    fn large_buffers_are_reused_once_written() {
        let (mut w, mut r) = pair();
        let mut tx = TxQueue::new();
        let mut v = tx.take_buf(100_000);
        v.resize(100_000, 3);
        let first = v.as_ptr();
        tx.push_vec(v, None);
        let mut sink = vec![0u8; 200_000];
        let mut got = 0;
        while got < 100_000 {
            tx.write(&mut w).unwrap();
            if let Ok(n) = r.recv(&mut sink) {
                got += n;
            }
        }
        assert!(tx.is_empty());
        // A smaller request reuses it; a larger one gets a fresh buffer.
        let v = tx.take_buf(50_000);
        assert!(v.is_empty() && v.as_ptr() == first);
        tx.spare = Some(v);
        let big = tx.take_buf(200_000);
        assert!(big.capacity() >= 200_000 && big.as_ptr() != first);
        assert!(tx.spare.is_some(), "the spare stays for later");
    }

    #[test]
    fn header_validation() {
        assert!(parse_header(&header(Kind::Am, 63, 10)).is_ok());
        assert!(
            parse_header(&header(Kind::Am, 64, 10)).is_err(),
            "am id out of range"
        );
        let mut h = header(Kind::Ack, 0, 8);
        h[5] = 1;
        assert!(parse_header(&h).is_err(), "id byte on a non-am frame");
        let mut h = header(Kind::Ack, 0, 8);
        h[4] = 0;
        assert!(
            parse_header(&h)
                .unwrap_err()
                .0
                .contains("unknown frame kind")
        );
        h[4] = 200;
        assert!(parse_header(&h).is_err());
        let mut h = header(Kind::Ack, 0, 8);
        h[6] = 0;
        assert!(parse_header(&h).unwrap_err().0.contains("mark"));
        let mut h = header(Kind::Am, 0, 0);
        h[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_header(&h).is_err(), "oversized body");
        let mut h = header(Kind::Ack, 0, 0);
        h[..4].copy_from_slice(&7u32.to_le_bytes());
        assert!(parse_header(&h).is_err(), "short ack");
        let mut h = header(Kind::GetReq, 0, 0);
        h[..4].copy_from_slice(&41u32.to_le_bytes());
        assert!(parse_header(&h).is_err(), "long get request");
    }

    #[test]
    fn hello_validation() {
        let me = SocketAddrV4::new(Ipv4Addr::new(10, 1, 2, 3), 4567);
        let f = hello_frame(me);
        let h = parse_header(f[..8].try_into().unwrap()).unwrap();
        assert_eq!(h.kind, Kind::Hello);
        assert_eq!(check_hello(&f[8..]).unwrap(), me);
        let mut bad = f[8..].to_vec();
        bad[12] = 0;
        bad[13] = 0;
        assert!(check_hello(&bad).is_err(), "port 0");
        let mut bad = f[8..].to_vec();
        bad[8..12].copy_from_slice(&[0, 0, 0, 0]);
        assert!(check_hello(&bad).is_err(), "unspecified address");
        let mut bad = f[8..].to_vec();
        bad[15] = 1;
        assert!(check_hello(&bad).is_err(), "reserved");
        let mut bad = f[8..].to_vec();
        bad[0] ^= 1;
        assert!(check_hello(&bad).is_err());
        let mut bad = f[8..].to_vec();
        bad[4] = 9;
        assert!(check_hello(&bad).unwrap_err().0.contains("version"));
    }

    #[test]
    fn reasons_are_truncated_on_char_boundaries() {
        let long = "é".repeat(MAX_REASON);
        let f = fatal_frame(code::PROTOCOL, &long);
        let h = parse_header(f[..8].try_into().unwrap()).unwrap();
        assert!(h.body_len <= 1 + MAX_REASON);
        assert!(std::str::from_utf8(&f[9..]).is_ok());
        let f = op_error_frame(3, code::ACCESS_DENIED, "no");
        assert_eq!(word(&f[8..], 0), 3);
        assert_eq!(f[16], code::ACCESS_DENIED);
    }

    #[test]
    fn clear_returns_unfinished_tokens() {
        let mut tx = TxQueue::new();
        tx.push_owned(b"abc", Some(1));
        tx.push_owned(b"def", None);
        tx.push_owned(b"ghi", Some(2));
        assert_eq!(tx.queued(), 9);
        assert_eq!(tx.clear(), vec![1, 2]);
        assert!(tx.is_empty());
        assert_eq!(tx.queued(), 0);
    }

    proptest::proptest! {
        #[test]
        fn garbage_headers_never_panic(b in proptest::array::uniform8(proptest::prelude::any::<u8>())) {
            let _ = parse_header(&b);
        }

        #[test]
        fn frames_survive_any_split(sizes in proptest::collection::vec(0usize..3000, 1..12), cut in 1usize..700) {
            // Feed the concatenated stream to RxBuf in pieces of `cut` bytes.
            struct Feed { data: Vec<u8>, pos: usize, cut: usize }
            impl Sock for Feed {
                fn send_vectored(&mut self, _: &[IoSlice<'_>]) -> io::Result<usize> { unreachable!() }
                fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                    if self.pos == self.data.len() { return Err(io::ErrorKind::WouldBlock.into()); }
                    let n = buf.len().min(self.cut).min(self.data.len() - self.pos);
                    buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
                    self.pos += n;
                    Ok(n)
                }
            }
            let mut data = Vec::new();
            for (i, s) in sizes.iter().enumerate() {
                data.extend_from_slice(&am_frame(i as u8, &vec![i as u8; *s]));
            }
            let mut feed = Feed { data, pos: 0, cut };
            let mut rx = RxBuf::new();
            let mut got = Vec::new();
            while rx.fill(&mut feed).unwrap() != Fill::WouldBlock {
                while let Some((h, body)) = rx.frame().unwrap() {
                    got.push((h.id, body.len(), body.iter().all(|b| *b == h.id)));
                    rx.consume(&h);
                }
            }
            proptest::prop_assert_eq!(got.len(), sizes.len());
            for (i, (id, len, ok)) in got.into_iter().enumerate() {
                proptest::prop_assert_eq!(usize::from(id), i);
                proptest::prop_assert_eq!(len, sizes[i]);
                proptest::prop_assert!(ok);
            }
        }
    }
}
