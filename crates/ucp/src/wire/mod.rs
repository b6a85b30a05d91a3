//! Protocol messages on the wire (active-message ids 1..=25 belong to UCP; 24 and 25, the
//! atomics, are written and read by `worker/atomic.rs`).
//!
//! Every message starts with the sender worker's uuid, so the receiver knows which peer it came
//! from without trusting transport-level sources.

use rucx_ucs::{Error, Result};
use rucx_uct::AmId;
use rucx_uct::rkey::{Reader, put_lv};

/// Wire-up: the sender's endpoint id for the receiver (tells a reconnect from the old
/// connection's messages), then its packed worker address.
pub const AM_WIREUP: AmId = 1;
/// Eager, whole message in an `am_short`: header = tag, payload = src + data.
pub const AM_EAGER_SHORT: AmId = 2;
/// Eager, whole message: src, tag, data.
pub const AM_EAGER_ONE: AmId = 3;
/// Eager, first fragment: src, kind, tag, msg id, total length, data.
pub const AM_EAGER_FIRST: AmId = 4;
/// Eager, later fragment: src, msg id, offset, data.
pub const AM_EAGER_MIDDLE: AmId = 5;
/// Rendezvous request to send.
pub const AM_RNDV_RTS: AmId = 6;
/// Rendezvous: receiver finished reading (get) — the sender may complete.
pub const AM_RNDV_ATS: AmId = 7;
/// Rendezvous: receiver ready; with a key the sender writes (put), without it streams AMs.
pub const AM_RNDV_RTR: AmId = 8;
/// Rendezvous data streamed as active messages: src, receive id, offset, data.
pub const AM_RNDV_DATA: AmId = 9;
/// Rendezvous: sender finished writing (put).
pub const AM_RNDV_FIN: AmId = 10;
/// User active message in one piece: src, user id, header, data.
pub const AM_USER: AmId = 11;
/// Rendezvous: receiver asks the sender to stage its (device) buffer in host fragments and
/// announce each one; src, sender request, receiver request.
pub const AM_RNDV_PULL: AmId = 12;
/// Rendezvous: a staged fragment is ready to be read: src, receiver request, sender request,
/// offset, length, staging address, fragment index, named key of the staging buffer.
pub const AM_RNDV_FRAG: AmId = 13;
/// Rendezvous: the receiver has read a staged fragment; the sender may reuse it: src, sender
/// request, fragment index, length.
pub const AM_RNDV_FRAG_ACK: AmId = 14;
/// Eager, whole message of a synchronous send: src, tag, sender request, data. The receiver
/// answers with [`AM_RNDV_ATS`] once a receive matched it.
pub const AM_EAGER_SYNC: AmId = 15;
/// Bytes of an endpoint's stream, in order: src, data.
pub const AM_STREAM_DATA: AmId = 16;
/// Rendezvous abort: one side cannot carry the transfer out (a registration or copy failed and
/// no other path is left), so the other side's request ends too instead of waiting: src, sender
/// request, receiver request (0 while the sender does not know it), who aborts (1: the sending
/// side, which ends the receive; 0: the receiving side, which ends the send), and the reason
/// (length-prefixed UTF-8, at most [`MAX_ABORT_REASON`] bytes).
pub const AM_RNDV_ABORT: AmId = 17;
/// Keepalive: src, then 0 for a probe (the peer answers it from its progress) or 1 for the
/// answer. Sent to a peer that has requests bound to it and has been silent for a while
/// (`RUCX_PEER_TIMEOUT`); any message from a peer, this one included, shows it is alive.
pub const AM_KEEPALIVE: AmId = 18;
/// Send cancellation: src, sender request, then the step: 0, the sender asks the receiver to
/// drop its message (a rendezvous announcement or a synchronous eager message) that no receive
/// matched yet; 1, the receiver dropped it (the send ends canceled); 2, too late, a receive
/// matched it (the send goes on).
pub const AM_CANCEL: AmId = 19;

/// A step of a send's cancellation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelStep {
    /// Sender to receiver: drop the message of this send if no receive matched it yet.
    Ask = 0,
    /// Receiver to sender: dropped; no receive will see it.
    Dropped = 1,
    /// Receiver to sender: a receive matched it already.
    TooLate = 2,
}
/// The sender closed its endpoint to the receiver (`Worker::close`): src. The last message of
/// the endpoint; the receiver's endpoint to the sender is closed on receipt.
pub const AM_DISCONNECT: AmId = 20;
/// Multi-fragment eager abort: the sender could not post the rest of a message whose first
/// fragments may have gone out (a transport error part-way), so the receiver drops what it
/// reassembled and a receive that matched it ends with `PeerAborted`: src, message id, and the
/// reason (as in [`AM_RNDV_ABORT`]).
pub const AM_EAGER_ABORT: AmId = 21;

/// Rendezvous request to send of a user active message whose payload stays with the sender
/// until the receiver's handler fetches it: src, sender request, size, address, the sender's
/// memory type code, the user id, the user header (length-prefixed), then the named keys (as in
/// [`AM_RNDV_RTS`]). The rest of the rendezvous is the tag rendezvous's (RTR, PULL, ATS, ...);
/// a payload the handler dropped unfetched is released by an [`AM_RNDV_ABORT`] from the
/// receiving side.
pub const AM_USER_RTS: AmId = 22;

/// A sender's GPU staging is ready: src, then its named key (one). A receiver on the same host
/// that moves GPU memory maps and registers the staging with its copy lane ahead, off the
/// path of the first staged transfer (registering 64 MiB took 6-9 ms on an H200 host). A
/// receiver that cannot map it, or has no GPU traffic, ignores it.
pub const AM_STAGING_OFFER: AmId = 23;

/// Longest reason an abort message carries (longer ones are cut at a character boundary).
pub const MAX_ABORT_REASON: usize = 1024;

/// What a multi-fragment eager message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MsgKind {
    /// A tagged message.
    Tag = 0,
    /// A user active message (the "tag" is the user id; the data starts with its header).
    Am = 1,
}

/// A named remote key inside a rendezvous message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedKey {
    /// Memory domain name.
    pub md: String,
    /// Packed key.
    pub key: Vec<u8>,
}

/// A message, as parsed by [`parse`] and written by [`Msg::encode`].
#[derive(Debug, Clone, PartialEq)]
pub enum Msg<'a> {
    /// Wire-up.
    Wireup { ep: u64, addr: &'a [u8] },
    /// Whole eager message.
    EagerOne { src: u64, tag: u64, data: &'a [u8] },
    /// Stream bytes.
    StreamData { src: u64, data: &'a [u8] },
    /// Whole eager message of a synchronous send (acknowledge the match to `sreq`).
    EagerSync {
        src: u64,
        tag: u64,
        sreq: u64,
        data: &'a [u8],
    },
    /// First fragment.
    EagerFirst {
        src: u64,
        kind: MsgKind,
        tag: u64,
        msg_id: u64,
        total: u64,
        data: &'a [u8],
    },
    /// Later fragment.
    EagerMiddle {
        src: u64,
        msg_id: u64,
        offset: u64,
        data: &'a [u8],
    },
    /// Request to send (`smem`: the sender's memory type code, see [`mem_code`]).
    Rts {
        src: u64,
        tag: u64,
        sreq: u64,
        size: u64,
        addr: u64,
        smem: u8,
        keys: Vec<NamedKey>,
    },
    /// Stage and announce fragments.
    Pull { src: u64, sreq: u64, rreq: u64 },
    /// A staged fragment.
    Frag {
        src: u64,
        rreq: u64,
        sreq: u64,
        offset: u64,
        len: u64,
        addr: u64,
        frag: u64,
        key: NamedKey,
    },
    /// A staged fragment was read.
    FragAck {
        src: u64,
        sreq: u64,
        frag: u64,
        len: u64,
    },
    /// Receiver done reading.
    Ats { src: u64, sreq: u64, ok: bool },
    /// Receiver ready.
    Rtr {
        src: u64,
        sreq: u64,
        rreq: u64,
        addr: u64,
        size: u64,
        /// With a key: the sender writes bytes `offset..size` (the receiver reads the rest).
        offset: u64,
        keys: Vec<NamedKey>,
    },
    /// Streamed rendezvous data.
    RndvData {
        src: u64,
        rreq: u64,
        offset: u64,
        data: &'a [u8],
    },
    /// Sender done writing.
    Fin { src: u64, rreq: u64 },
    /// One side gave the rendezvous up.
    Abort {
        src: u64,
        sreq: u64,
        /// 0 when the sender did not know the receive request yet.
        rreq: u64,
        /// The sending side aborts (the receive ends); else the receiving side (the send ends).
        by_sender: bool,
        reason: &'a str,
    },
    /// The sender gave a multi-fragment eager message up part-way.
    EagerAbort {
        src: u64,
        msg_id: u64,
        reason: &'a str,
    },
    /// Keepalive probe (`reply` false), or the answer to one (`reply` true).
    Keepalive { src: u64, reply: bool },
    /// A step of a send's cancellation ([`AM_CANCEL`]).
    Cancel {
        src: u64,
        sreq: u64,
        step: CancelStep,
    },
    /// The sender closed its endpoint.
    Disconnect { src: u64 },
    /// User active message.
    User {
        src: u64,
        id: u16,
        header: &'a [u8],
        data: &'a [u8],
    },
    /// A sender's GPU staging, offered for mapping ahead.
    StagingOffer { src: u64, key: NamedKey },
    /// Request to send of a user active message (its payload fetched by the handler).
    AmRts {
        src: u64,
        sreq: u64,
        size: u64,
        addr: u64,
        smem: u8,
        id: u16,
        header: &'a [u8],
        keys: Vec<NamedKey>,
    },
}

impl Msg<'_> {
    /// The active-message id this message travels with ([`AM_EAGER_ONE`] for a whole eager
    /// message: the `am_short` form, [`AM_EAGER_SHORT`], puts the tag in the transport's header
    /// and is written by the fast path itself).
    pub fn am_id(&self) -> AmId {
        match self {
            Msg::Wireup { .. } => AM_WIREUP,
            Msg::EagerOne { .. } => AM_EAGER_ONE,
            Msg::StreamData { .. } => AM_STREAM_DATA,
            Msg::EagerSync { .. } => AM_EAGER_SYNC,
            Msg::EagerFirst { .. } => AM_EAGER_FIRST,
            Msg::EagerMiddle { .. } => AM_EAGER_MIDDLE,
            Msg::Rts { .. } => AM_RNDV_RTS,
            Msg::Pull { .. } => AM_RNDV_PULL,
            Msg::Frag { .. } => AM_RNDV_FRAG,
            Msg::FragAck { .. } => AM_RNDV_FRAG_ACK,
            Msg::Ats { .. } => AM_RNDV_ATS,
            Msg::Rtr { .. } => AM_RNDV_RTR,
            Msg::RndvData { .. } => AM_RNDV_DATA,
            Msg::Fin { .. } => AM_RNDV_FIN,
            Msg::Abort { .. } => AM_RNDV_ABORT,
            Msg::EagerAbort { .. } => AM_EAGER_ABORT,
            Msg::Keepalive { .. } => AM_KEEPALIVE,
            Msg::Cancel { .. } => AM_CANCEL,
            Msg::Disconnect { .. } => AM_DISCONNECT,
            Msg::User { .. } => AM_USER,
            Msg::AmRts { .. } => AM_USER_RTS,
            Msg::StagingOffer { .. } => AM_STAGING_OFFER,
        }
    }

    /// At least the length of the message's encoding ([`encode_into`](Self::encode_into)):
    /// the largest fixed part of any message plus this one's variable parts.
    pub fn encoded_len_bound(&self) -> usize {
        /// Seven words and a byte or two of the largest fixed part, rounded up.
        const FIXED: usize = 64;
        let keys = |ks: &[NamedKey]| -> usize {
            1 + ks
                .iter()
                .map(|k| 4 + k.md.len() + k.key.len())
                .sum::<usize>()
        };
        FIXED
            + match self {
                Msg::Wireup { addr, .. } => addr.len(),
                Msg::EagerOne { data, .. }
                | Msg::StreamData { data, .. }
                | Msg::EagerSync { data, .. }
                | Msg::EagerFirst { data, .. }
                | Msg::EagerMiddle { data, .. }
                | Msg::RndvData { data, .. } => data.len(),
                Msg::Rts { keys: k, .. } | Msg::Rtr { keys: k, .. } => keys(k),
                Msg::Frag { key, .. } | Msg::StagingOffer { key, .. } => {
                    keys(std::slice::from_ref(key))
                }
                Msg::Abort { reason, .. } | Msg::EagerAbort { reason, .. } => {
                    2 + reason.len().min(MAX_ABORT_REASON)
                }
                Msg::User { header, data, .. } => 2 + header.len() + data.len(),
                Msg::AmRts {
                    header, keys: k, ..
                } => 2 + header.len() + keys(k),
                Msg::Pull { .. }
                | Msg::FragAck { .. }
                | Msg::Ats { .. }
                | Msg::Fin { .. }
                | Msg::Keepalive { .. }
                | Msg::Cancel { .. }
                | Msg::Disconnect { .. } => 0,
            }
    }

    /// Append the message's bytes to `out` (what [`parse`] reads back); returns its
    /// active-message id. Messages that end with data write it last, so a header alone is the
    /// encoding of the message with empty data.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> AmId {
        match self {
            Msg::Wireup { ep, addr } => {
                put_u64s(out, &[*ep]);
                out.extend_from_slice(addr)
            }
            Msg::EagerOne { src, tag, data } => {
                put_u64s(out, &[*src, *tag]);
                out.extend_from_slice(data);
            }
            Msg::StreamData { src, data } => {
                put_u64s(out, &[*src]);
                out.extend_from_slice(data);
            }
            Msg::EagerSync {
                src,
                tag,
                sreq,
                data,
            } => {
                put_u64s(out, &[*src, *tag, *sreq]);
                out.extend_from_slice(data);
            }
            Msg::EagerFirst {
                src,
                kind,
                tag,
                msg_id,
                total,
                data,
            } => {
                put_u64s(out, &[*src]);
                out.push(*kind as u8);
                put_u64s(out, &[*tag, *msg_id, *total]);
                out.extend_from_slice(data);
            }
            Msg::EagerMiddle {
                src,
                msg_id,
                offset,
                data,
            } => {
                put_u64s(out, &[*src, *msg_id, *offset]);
                out.extend_from_slice(data);
            }
            Msg::Rts {
                src,
                tag,
                sreq,
                size,
                addr,
                smem,
                keys,
            } => {
                put_u64s(out, &[*src, *tag, *sreq, *size, *addr]);
                out.push(*smem);
                put_keys(out, keys);
            }
            Msg::Pull { src, sreq, rreq } => put_u64s(out, &[*src, *sreq, *rreq]),
            Msg::Frag {
                src,
                rreq,
                sreq,
                offset,
                len,
                addr,
                frag,
                key,
            } => {
                put_u64s(out, &[*src, *rreq, *sreq, *offset, *len, *addr, *frag]);
                put_keys(out, std::slice::from_ref(key));
            }
            Msg::FragAck {
                src,
                sreq,
                frag,
                len,
            } => put_u64s(out, &[*src, *sreq, *frag, *len]),
            Msg::StagingOffer { src, key } => {
                put_u64s(out, &[*src]);
                put_keys(out, std::slice::from_ref(key));
            }
            Msg::Ats { src, sreq, ok } => {
                put_u64s(out, &[*src, *sreq]);
                out.push(u8::from(*ok));
            }
            Msg::Rtr {
                src,
                sreq,
                rreq,
                addr,
                size,
                offset,
                keys,
            } => {
                put_u64s(out, &[*src, *sreq, *rreq, *addr, *size, *offset]);
                put_keys(out, keys);
            }
            Msg::RndvData {
                src,
                rreq,
                offset,
                data,
            } => {
                put_u64s(out, &[*src, *rreq, *offset]);
                out.extend_from_slice(data);
            }
            Msg::Fin { src, rreq } => put_u64s(out, &[*src, *rreq]),
            Msg::Abort {
                src,
                sreq,
                rreq,
                by_sender,
                reason,
            } => {
                put_u64s(out, &[*src, *sreq, *rreq]);
                out.push(u8::from(*by_sender));
                put_reason(out, reason);
            }
            Msg::EagerAbort {
                src,
                msg_id,
                reason,
            } => {
                put_u64s(out, &[*src, *msg_id]);
                put_reason(out, reason);
            }
            Msg::Keepalive { src, reply } => {
                put_u64s(out, &[*src]);
                out.push(u8::from(*reply));
            }
            Msg::Cancel { src, sreq, step } => {
                put_u64s(out, &[*src, *sreq]);
                out.push(*step as u8);
            }
            Msg::Disconnect { src } => put_u64s(out, &[*src]),
            Msg::User {
                src,
                id,
                header,
                data,
            } => {
                put_u64s(out, &[*src]);
                out.extend_from_slice(&id.to_le_bytes());
                put_lv(out, header);
                out.extend_from_slice(data);
            }
            Msg::AmRts {
                src,
                sreq,
                size,
                addr,
                smem,
                id,
                header,
                keys,
            } => {
                put_u64s(out, &[*src, *sreq, *size, *addr]);
                out.push(*smem);
                out.extend_from_slice(&id.to_le_bytes());
                put_lv(out, header);
                put_keys(out, keys);
            }
        }
        self.am_id()
    }

    /// The message's bytes and its active-message id.
    pub fn encode(&self) -> (AmId, Vec<u8>) {
        // One allocation of the right size: grown from empty, a rendezvous request with its
        // key took four reallocations, about a tenth of the sender's work per 64 KiB message.
        let mut out = Vec::with_capacity(self.encoded_len_bound());
        let id = self.encode_into(&mut out);
        (id, out)
    }
}

/// Memory type of a buffer on the wire.
pub fn mem_code(m: rucx_ucs::MemoryType) -> u8 {
    match m {
        rucx_ucs::MemoryType::Host => 0,
        rucx_ucs::MemoryType::Cuda => 1,
        rucx_ucs::MemoryType::CudaManaged => 2,
        rucx_ucs::MemoryType::Unknown => 3,
    }
}

/// The memory type a [`mem_code`] stands for (an unknown code reads as `Unknown`).
pub fn mem_type_of(code: u8) -> rucx_ucs::MemoryType {
    match code {
        0 => rucx_ucs::MemoryType::Host,
        1 => rucx_ucs::MemoryType::Cuda,
        2 => rucx_ucs::MemoryType::CudaManaged,
        _ => rucx_ucs::MemoryType::Unknown,
    }
}

fn bad(id: AmId, e: Error) -> Error {
    Error::InvalidAddress(format!("malformed protocol message {id}: {e}"))
}

fn keys(r: &mut Reader<'_>) -> Result<Vec<NamedKey>> {
    let n = r.u8()? as usize;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let md = String::from_utf8(r.lv()?.to_vec())
            .map_err(|_| Error::InvalidAddress("key name is not UTF-8".into()))?;
        v.push(NamedKey {
            md,
            key: r.lv()?.to_vec(),
        });
    }
    Ok(v)
}

/// Append named keys.
pub fn put_keys(out: &mut Vec<u8>, keys: &[NamedKey]) {
    out.push(keys.len() as u8);
    for k in keys {
        put_lv(out, k.md.as_bytes());
        put_lv(out, &k.key);
    }
}

/// Append an abort's reason, cut to [`MAX_ABORT_REASON`] bytes at a character boundary.
pub fn put_reason(out: &mut Vec<u8>, reason: &str) {
    let mut end = reason.len().min(MAX_ABORT_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    put_lv(out, &reason.as_bytes()[..end]);
}

/// Append little-endian u64s.
pub fn put_u64s(out: &mut Vec<u8>, vals: &[u64]) {
    for v in vals {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Parse a message received with active-message id `id`.
pub fn parse(id: AmId, data: &[u8]) -> Result<Msg<'_>> {
    let mut r = Reader::new(data, "protocol message");
    let m = (|| -> Result<Msg<'_>> {
        Ok(match id {
            AM_WIREUP => {
                let ep = r.u64()?;
                Msg::Wireup {
                    ep,
                    addr: &data[8..],
                }
            }
            AM_EAGER_SHORT => {
                let tag = r.u64()?;
                let src = r.u64()?;
                Msg::EagerOne {
                    src,
                    tag,
                    data: &data[16..],
                }
            }
            AM_EAGER_ONE => {
                let src = r.u64()?;
                let tag = r.u64()?;
                Msg::EagerOne {
                    src,
                    tag,
                    data: &data[16..],
                }
            }
            AM_STREAM_DATA => {
                let src = r.u64()?;
                Msg::StreamData {
                    src,
                    data: &data[8..],
                }
            }
            AM_EAGER_SYNC => {
                let src = r.u64()?;
                let tag = r.u64()?;
                let sreq = r.u64()?;
                Msg::EagerSync {
                    src,
                    tag,
                    sreq,
                    data: &data[24..],
                }
            }
            AM_EAGER_FIRST => {
                let src = r.u64()?;
                let kind = match r.u8()? {
                    0 => MsgKind::Tag,
                    1 => MsgKind::Am,
                    k => return Err(Error::InvalidAddress(format!("unknown message kind {k}"))),
                };
                let tag = r.u64()?;
                let msg_id = r.u64()?;
                let total = r.u64()?;
                Msg::EagerFirst {
                    src,
                    kind,
                    tag,
                    msg_id,
                    total,
                    data: &data[33..],
                }
            }
            AM_EAGER_MIDDLE => {
                let src = r.u64()?;
                let msg_id = r.u64()?;
                let offset = r.u64()?;
                Msg::EagerMiddle {
                    src,
                    msg_id,
                    offset,
                    data: &data[24..],
                }
            }
            AM_RNDV_RTS => {
                let src = r.u64()?;
                let tag = r.u64()?;
                let sreq = r.u64()?;
                let size = r.u64()?;
                let addr = r.u64()?;
                let smem = r.u8()?;
                let keys = keys(&mut r)?;
                r.finish()?;
                Msg::Rts {
                    smem,
                    src,
                    tag,
                    sreq,
                    size,
                    addr,
                    keys,
                }
            }
            AM_RNDV_ATS => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let ok = r.u8()? != 0;
                r.finish()?;
                Msg::Ats { src, sreq, ok }
            }
            AM_RNDV_RTR => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let rreq = r.u64()?;
                let addr = r.u64()?;
                let size = r.u64()?;
                let offset = r.u64()?;
                let keys = keys(&mut r)?;
                r.finish()?;
                if offset > size {
                    return Err(Error::InvalidAddress(format!(
                        "offset {offset} past size {size}"
                    )));
                }
                Msg::Rtr {
                    src,
                    sreq,
                    rreq,
                    addr,
                    size,
                    offset,
                    keys,
                }
            }
            AM_RNDV_DATA => {
                let src = r.u64()?;
                let rreq = r.u64()?;
                let offset = r.u64()?;
                Msg::RndvData {
                    src,
                    rreq,
                    offset,
                    data: &data[24..],
                }
            }
            AM_RNDV_FIN => {
                let src = r.u64()?;
                let rreq = r.u64()?;
                r.finish()?;
                Msg::Fin { src, rreq }
            }
            AM_RNDV_ABORT => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let rreq = r.u64()?;
                let by_sender = match r.u8()? {
                    0 => false,
                    1 => true,
                    b => return Err(Error::InvalidAddress(format!("abort side {b}"))),
                };
                let reason = r.lv()?;
                r.finish()?;
                if sreq == 0 || (rreq == 0 && !by_sender) {
                    return Err(Error::InvalidAddress(
                        "an abort names no request (request ids are never 0)".into(),
                    ));
                }
                if reason.len() > MAX_ABORT_REASON {
                    return Err(Error::InvalidAddress(format!(
                        "abort reason of {} bytes (at most {MAX_ABORT_REASON})",
                        reason.len()
                    )));
                }
                let reason = std::str::from_utf8(reason)
                    .map_err(|_| Error::InvalidAddress("abort reason is not UTF-8".into()))?;
                Msg::Abort {
                    src,
                    sreq,
                    rreq,
                    by_sender,
                    reason,
                }
            }
            AM_EAGER_ABORT => {
                let src = r.u64()?;
                let msg_id = r.u64()?;
                let reason = r.lv()?;
                r.finish()?;
                if reason.len() > MAX_ABORT_REASON {
                    return Err(Error::InvalidAddress(format!(
                        "abort reason of {} bytes (at most {MAX_ABORT_REASON})",
                        reason.len()
                    )));
                }
                let reason = std::str::from_utf8(reason)
                    .map_err(|_| Error::InvalidAddress("abort reason is not UTF-8".into()))?;
                Msg::EagerAbort {
                    src,
                    msg_id,
                    reason,
                }
            }
            AM_RNDV_PULL => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let rreq = r.u64()?;
                r.finish()?;
                Msg::Pull { src, sreq, rreq }
            }
            AM_RNDV_FRAG => {
                let src = r.u64()?;
                let rreq = r.u64()?;
                let sreq = r.u64()?;
                let offset = r.u64()?;
                let len = r.u64()?;
                let addr = r.u64()?;
                let frag = r.u64()?;
                let mut k = keys(&mut r)?;
                r.finish()?;
                if k.len() != 1 {
                    return Err(Error::InvalidAddress(
                        "a fragment carries exactly one key".into(),
                    ));
                }
                let key = k.remove(0);
                Msg::Frag {
                    src,
                    rreq,
                    sreq,
                    offset,
                    len,
                    addr,
                    frag,
                    key,
                }
            }
            AM_STAGING_OFFER => {
                let src = r.u64()?;
                let mut k = keys(&mut r)?;
                r.finish()?;
                if k.len() != 1 {
                    return Err(Error::InvalidAddress(
                        "a staging offer carries exactly one key".into(),
                    ));
                }
                Msg::StagingOffer {
                    src,
                    key: k.remove(0),
                }
            }
            AM_RNDV_FRAG_ACK => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let frag = r.u64()?;
                let len = r.u64()?;
                r.finish()?;
                Msg::FragAck {
                    src,
                    sreq,
                    frag,
                    len,
                }
            }
            AM_KEEPALIVE => {
                let src = r.u64()?;
                let reply = match r.u8()? {
                    0 => false,
                    1 => true,
                    b => return Err(Error::InvalidAddress(format!("keepalive kind {b}"))),
                };
                r.finish()?;
                Msg::Keepalive { src, reply }
            }
            AM_CANCEL => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let step = match r.u8()? {
                    0 => CancelStep::Ask,
                    1 => CancelStep::Dropped,
                    2 => CancelStep::TooLate,
                    b => return Err(Error::InvalidAddress(format!("cancel step {b}"))),
                };
                r.finish()?;
                Msg::Cancel { src, sreq, step }
            }
            AM_DISCONNECT => {
                let src = r.u64()?;
                r.finish()?;
                Msg::Disconnect { src }
            }
            AM_USER => {
                let src = r.u64()?;
                let id = r.u16()?;
                let header = r.lv()?;
                let hl = header.len();
                Msg::User {
                    src,
                    id,
                    header,
                    data: &data[12 + hl..],
                }
            }
            AM_USER_RTS => {
                let src = r.u64()?;
                let sreq = r.u64()?;
                let size = r.u64()?;
                let addr = r.u64()?;
                let smem = r.u8()?;
                let id = r.u16()?;
                let header = r.lv()?;
                let keys = keys(&mut r)?;
                r.finish()?;
                Msg::AmRts {
                    src,
                    sreq,
                    size,
                    addr,
                    smem,
                    id,
                    header,
                    keys,
                }
            }
            other => {
                return Err(Error::InvalidAddress(format!(
                    "unknown protocol message id {other}"
                )));
            }
        })
    })();
    m.map_err(|e| bad(id, e))
}

#[cfg(test)]
mod tests;
