//! The tcp transport's wire format: frame headers and bodies, encoded and validated. Pure
//! functions over bytes; the byte stream under them is in `stream`, what a connection does
//! with them in `proto`.
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

use std::fmt;
use std::net::{Ipv4Addr, SocketAddrV4};

/// Frame header length.
pub const HDR_LEN: usize = 8;
/// Constant in every header; a mismatch means the stream is not (or no longer) ours.
pub const MARK: u16 = 0x7c5a;
/// First word of a `Hello` body ("RXTC").
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"RXTC");
/// Wire protocol version.
pub const VERSION: u16 = 2;

/// Largest `am_short` payload (after the 8-byte header). A short message goes to the socket
/// from the caller's bytes in one `sendmsg` (header and payload as two pieces, nothing packed
/// first), so it is as large as a copy-in one: up to [`AM_MAX_BCOPY`], where a bigger limit
/// took a copy and a heavier send path off every message from 256 B on (polling `tag_lat`
/// 256 B 3.14-3.17 -> 3.00-3.11 us, 4 KiB 4.06-4.07 -> 3.94-3.98 us, UCX 3.11-3.22 and
/// 3.90-3.99 on the same loopback).
pub const AM_MAX_SHORT: usize = AM_MAX_BCOPY;
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
// A short message (its 8-byte header word and payload) is an `Am` body the receiver accepts.
const _: () = assert!(8 + AM_MAX_SHORT <= AM_MAX_BODY);
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

/// Header and fixed fields of a `Put` frame of `len` data bytes to `addr` in registration
/// `reg_id` of memory domain instance `md_id` (the data follows).
pub fn put_head(
    op: u64,
    md_id: u64,
    reg_id: u64,
    addr: u64,
    len: usize,
) -> [u8; HDR_LEN + PUT_FIXED] {
    let mut head = [0u8; HDR_LEN + PUT_FIXED];
    head[..HDR_LEN].copy_from_slice(&header(Kind::Put, 0, PUT_FIXED + len));
    for (i, w) in [op, md_id, reg_id, addr].into_iter().enumerate() {
        head[HDR_LEN + i * 8..HDR_LEN + i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    head
}

/// The fixed fields of a `Put` body: `(op, md_id, reg_id, addr)`.
pub fn put_fields(body: &[u8]) -> (u64, u64, u64, u64) {
    (word(body, 0), word(body, 1), word(body, 2), word(body, 3))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    proptest::proptest! {
        #[test]
        fn garbage_headers_never_panic(b in proptest::array::uniform8(proptest::prelude::any::<u8>())) {
            let _ = parse_header(&b);
        }

    }
}
