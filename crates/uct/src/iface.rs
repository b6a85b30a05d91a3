//! Interfaces and endpoints: the data path.
//!
//! Progress is pull-based: [`Iface::progress`] hands every event (an arrived active message, a
//! finished zero-copy operation, a failed endpoint) to a sink the caller passes in. Nothing runs
//! behind the caller's back, so the caller's state needs no locking.
//!
//! # Sleeping instead of polling
//!
//! An interface can also say when progress has something to do, so that an idle caller sleeps
//! in `poll(2)` instead of spinning: [`Iface::event_fd`] names a descriptor and
//! [`Iface::arm`] asks for it to become readable at the next event. The protocol, as in UCX's
//! `uct_iface_event_fd_get` / `uct_iface_event_arm`:
//!
//! 1. progress until a call delivers nothing;
//! 2. `arm()`: `Ok` means nothing is pending and the descriptor will become readable when
//!    something arrives or completes; [`Error::Busy`] means events are pending (progress again,
//!    go to 1);
//! 3. `poll(2)` the descriptor (several interfaces' descriptors together, e.g. in one epoll;
//!    a caller that sleeps on one interface alone does 2 and 3 in one
//!    [`Iface::arm_and_wait`], which an interface may do in one system call);
//! 4. when it is readable (or the caller's timeout passed), progress: that also consumes the
//!    notification (the descriptor stops being readable once its events were delivered).
//!
//! Arming is cheap but not free; callers arm only after polling found nothing for a while.
//! Polling callers never arm, and the transports keep their fast paths free of system calls
//! while nobody is armed.

use std::fmt;
use std::os::fd::RawFd;
use std::time::Duration;

use rucx_ucs::{Config, Error, Result};

use crate::attr::IfaceAttr;
use crate::md::{MemHandle, RemoteKey};

/// Active-message ids are small integers; each layer above UCT owns a range.
pub type AmId = u8;

/// How many distinct active-message ids an interface supports.
pub const AM_ID_MAX: usize = 64;

/// Parameters for opening an interface.
#[derive(Debug)]
pub struct IfaceParams<'a> {
    /// Configuration (transport options are read from here).
    pub config: &'a Config,
}

/// Parameters for creating an endpoint.
#[derive(Clone, Debug, Default)]
pub struct EpParams {
    /// Peer device address (from the peer's [`Iface::device_address`]).
    pub dev_addr: Vec<u8>,
    /// Peer interface address (connect-to-iface).
    pub iface_addr: Vec<u8>,
    /// Caller's identifier for this endpoint, echoed in [`Event::EpError`].
    pub user_id: u64,
}

/// A piece of a zero-copy operation: a registered local buffer.
#[derive(Clone, Copy, Debug)]
pub struct Iov<'a> {
    /// Start address; must lie inside `memh`.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Registration covering the buffer.
    pub memh: &'a MemHandle,
}

impl<'a> Iov<'a> {
    /// An iov covering the whole registered region.
    pub fn whole(memh: &'a MemHandle) -> Self {
        Iov {
            addr: memh.region().addr,
            len: memh.region().len,
            memh,
        }
    }

    /// Validate every entry against its handle and the interface limit; returns the total length.
    pub fn check_all(iov: &[Iov<'_>], max_iov: usize) -> Result<usize> {
        if iov.len() > max_iov {
            return Err(Error::InvalidParam(format!(
                "{} iov entries given, the transport takes at most {max_iov}",
                iov.len()
            )));
        }
        let mut total = 0usize;
        for v in iov {
            v.memh.check(v.addr, v.len)?;
            total += v.len;
        }
        Ok(total)
    }
}

/// Outcome of posting an operation that may complete later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpStatus {
    /// Completed now; no [`Event::Completion`] will follow.
    Done,
    /// Will complete later with an [`Event::Completion`] carrying the token.
    InProgress,
}

/// Something that happened on an interface, delivered by [`Iface::progress`].
#[derive(Debug)]
pub enum Event<'a> {
    /// An active message arrived; `data` is valid only during the callback.
    Am {
        /// Message id.
        id: AmId,
        /// Header and payload as the sender laid them out.
        data: &'a [u8],
    },
    /// A zero-copy operation or flush posted with `token` finished.
    Completion {
        /// The token given when posting.
        token: u64,
        /// Success or the reason for failure.
        result: Result<()>,
    },
    /// An endpoint can no longer be used (peer gone, connection broken).
    EpError {
        /// The endpoint's [`EpParams::user_id`].
        user_id: u64,
        /// What happened.
        error: Error,
    },
}

/// How an interface tells a sleeping caller that progress has something to do; see the
/// [module documentation](self#sleeping-instead-of-polling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSource {
    /// This descriptor becomes readable (`POLLIN`) after [`Iface::arm`] returned `Ok` and an
    /// event arrived. It belongs to the interface and lives as long as it.
    Fd(RawFd),
    /// Nothing ever happens later on this interface: every operation finishes when posted and
    /// nothing arrives from peers. A sleeper can ignore it.
    Silent,
    /// The interface cannot wake a sleeper: a caller that sleeps must still look at it now and
    /// then (short naps).
    PollOnly,
}

/// One transport on one device, owned by a worker and progressed by it.
pub trait Iface: Send + fmt::Debug {
    /// Attributes.
    fn attr(&self) -> &IfaceAttr;

    /// Packed device address (identifies the host or device).
    fn device_address(&self) -> Vec<u8>;

    /// Packed interface address (what connect-to-iface endpoints need).
    fn iface_address(&self) -> Vec<u8>;

    /// Whether a peer with these addresses can be reached from here.
    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool;

    /// Create an endpoint to a peer interface.
    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>>;

    /// Make progress: deliver arrived messages and completions to `sink`. Returns how many
    /// events were delivered.
    ///
    /// The sink may post operations on any endpoint (of this or another interface), e.g. to
    /// reply to a message: implementations must not hold internal locks while calling it.
    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize;

    /// How this interface wakes a sleeping caller (see [`EventSource`]); the same answer for
    /// the interface's whole life. The default: it cannot ([`EventSource::PollOnly`]).
    fn event_source(&self) -> EventSource {
        EventSource::PollOnly
    }

    /// The descriptor of [`EventSource::Fd`], if the interface has one.
    fn event_fd(&self) -> Option<RawFd> {
        match self.event_source() {
            EventSource::Fd(fd) => Some(fd),
            _ => None,
        }
    }

    /// Ask for the event descriptor to become readable at the next event. Returns
    /// [`Error::Busy`] when events are pending already (progress first; nothing was armed,
    /// or a wake-up may come anyway), [`Error::Unsupported`] for [`EventSource::PollOnly`].
    /// Arming twice is harmless. An interface that is [`EventSource::Silent`] arms at once.
    fn arm(&mut self) -> Result<()> {
        match self.event_source() {
            EventSource::Silent => Ok(()),
            _ => Err(Error::Unsupported {
                what: format!("arming the {} interface", self.attr().tl_name),
                why: "it has no event descriptor; poll it".into(),
            }),
        }
    }

    /// Arm and sleep: return once this interface has something for
    /// [`progress`](Self::progress), `timer` is readable, or `timeout` passed (`None`: no
    /// limit); at once when [`arm`](Self::arm) is busy. For a caller that sleeps on this
    /// interface alone (the only one with a descriptor); progress it afterwards, as after a
    /// wake-up of the descriptor (a return without an event is possible).
    ///
    /// `timer` is the caller's wake-up for its own timers: a descriptor that becomes readable
    /// when one is due (a [`TimerFd`](rucx_ucs::event::TimerFd) it sets once per period, so
    /// sleeps need no timeout of their own). The caller keeps it open while the interface
    /// lives and passes the same one every time; the interface may keep watching it (edge
    /// triggered: each expiry wakes one sleep) and never reads it.
    ///
    /// The default is `arm` followed by `poll(2)` on the descriptor and `timer`. An interface
    /// may do both in one system call and keep what the sleep reported for its next progress
    /// (tcp: one `epoll_wait` over its sockets, level triggered, so a socket ready before the
    /// sleep ends it at once). [`Error::Unsupported`] for an interface that is not
    /// [`EventSource::Fd`].
    fn arm_and_wait(&mut self, timeout: Option<Duration>, timer: Option<RawFd>) -> Result<()> {
        let EventSource::Fd(fd) = self.event_source() else {
            return Err(Error::Unsupported {
                what: format!("sleeping on the {} interface", self.attr().tl_name),
                why: format!("it has no event descriptor ({:?})", self.event_source()),
            });
        };
        match self.arm() {
            Ok(()) => {}
            Err(Error::Busy(_)) => return Ok(()),
            Err(e) => return Err(e),
        }
        let fds = [fd, timer.unwrap_or(fd)];
        let n = if timer.is_some() { 2 } else { 1 };
        rucx_ucs::event::wait_any_readable(&fds[..n], timeout).map_err(|e| {
            Error::io(
                format!(
                    "sleeping on the event descriptor of {}/{}",
                    self.attr().tl_name,
                    self.attr().dev_name
                ),
                e,
            )
        })?;
        Ok(())
    }
}

/// A connection to one peer interface.
///
/// Sends that return [`Error::NoResource`] did nothing: progress the interface and retry.
pub trait Endpoint: Send + fmt::Debug {
    /// Active message with an 8-byte header and a small payload; the receiver sees the header's
    /// little-endian bytes followed by the payload.
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()>;

    /// [`am_short`](Self::am_short) of a payload that starts with a second 8-byte word
    /// (a protocol's own header, e.g. the sender's id) followed by `rest` (the caller's bytes),
    /// received as one payload. The default joins them in `scratch` (the caller's reused
    /// buffer: nothing allocated once it has grown); a transport that writes messages in place
    /// writes both straight there.
    fn am_short_word(
        &mut self,
        id: AmId,
        header: u64,
        word: u64,
        rest: &[u8],
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        scratch.clear();
        scratch.extend_from_slice(&word.to_le_bytes());
        scratch.extend_from_slice(rest);
        self.am_short(id, header, scratch)
    }

    /// Active message packed by `pack` into a transport buffer of `am_max_bcopy` bytes; `pack`
    /// returns how many bytes it wrote. Returns that length.
    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize>;

    /// Active message whose payload is sent from registered memory; the receiver sees `header`
    /// followed by the iov contents.
    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        token: u64,
    ) -> Result<OpStatus>;

    /// Write a small buffer to remote memory.
    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()>;

    /// Write registered local memory to remote memory.
    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus>;

    /// Read remote memory into registered local memory.
    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus>;

    /// Complete every operation posted so far on this endpoint, remotely too.
    fn flush(&mut self, token: u64) -> Result<OpStatus>;

    /// Order: operations posted after the fence start after those before it.
    fn fence(&mut self) -> Result<()> {
        Ok(())
    }

    /// Packed address of this endpoint, for transports that connect endpoint to endpoint
    /// ([`IfaceCaps::CONNECT_TO_EP`](crate::IfaceCaps::CONNECT_TO_EP), e.g. `rc_verbs`).
    ///
    /// Wire-up for such transports: each side creates an endpoint with an empty
    /// [`EpParams::iface_addr`] (it is not connected yet), sends the peer its
    /// [`Iface::device_address`] and this address out of band, and calls
    /// [`connect_to_ep`](Self::connect_to_ep) with the peer's pair. Transports that connect to
    /// interfaces keep the default, which returns [`Error::Unsupported`].
    fn ep_address(&self) -> Result<Vec<u8>> {
        Err(Error::Unsupported {
            what: "ep_address".into(),
            why: "this transport connects to interface addresses, not endpoint addresses".into(),
        })
    }

    /// Connect an endpoint created without an interface address to the peer endpoint whose
    /// device address and [`ep_address`](Self::ep_address) are given. Every field is validated;
    /// garbage is an error, never a crash.
    fn connect_to_ep(&mut self, _dev_addr: &[u8], _ep_addr: &[u8]) -> Result<()> {
        Err(Error::Unsupported {
            what: "connect_to_ep".into(),
            why: "this transport connects to interface addresses, not endpoint addresses".into(),
        })
    }
}

/// Helper for `am_bcopy` callers that already have the bytes: copy `data` into the buffer.
///
/// Returns `data.len()` even when it does not fit (then nothing is copied), so the transport
/// sees a length larger than its buffer and fails the send with an error instead of truncating.
pub fn pack_bytes(data: &[u8]) -> impl FnMut(&mut [u8]) -> usize + '_ {
    move |buf: &mut [u8]| {
        if let Some(dst) = buf.get_mut(..data.len()) {
            dst.copy_from_slice(data);
        }
        data.len()
    }
}

/// Check the length a bcopy pack callback returned against the buffer it was given.
pub fn check_packed(written: usize, capacity: usize, tl: &str) -> Result<usize> {
    if written > capacity {
        Err(Error::InvalidParam(format!(
            "am_bcopy message of {written} bytes exceeds {tl}'s limit of {capacity} bytes"
        )))
    } else {
        Ok(written)
    }
}

/// Check a `put_short` payload of `len` bytes against the interface's `limit`.
pub fn check_put_short(len: usize, limit: usize, tl: &str) -> Result<()> {
    if len > limit {
        return Err(Error::InvalidParam(format!(
            "put_short of {len} bytes exceeds {tl}'s limit of {limit}"
        )));
    }
    Ok(())
}

/// The three active-message methods of an [`Endpoint`] impl for a transport that has none
/// (put/get only): each returns `Err($err)`, `$err` evaluated per call.
#[macro_export]
macro_rules! no_active_messages {
    ($err:expr) => {
        fn am_short(
            &mut self,
            _id: $crate::AmId,
            _header: u64,
            _payload: &[u8],
        ) -> $crate::iface::__Result<()> {
            Err($err)
        }

        fn am_bcopy(
            &mut self,
            _id: $crate::AmId,
            _pack: &mut dyn FnMut(&mut [u8]) -> usize,
        ) -> $crate::iface::__Result<usize> {
            Err($err)
        }

        fn am_zcopy(
            &mut self,
            _id: $crate::AmId,
            _header: &[u8],
            _iov: &[$crate::Iov<'_>],
            _token: u64,
        ) -> $crate::iface::__Result<$crate::OpStatus> {
            Err($err)
        }
    };
}

#[doc(hidden)]
pub use rucx_ucs::Result as __Result;

#[cfg(test)]
mod tests {
    use super::*;

    /// An endpoint that implements only the required methods (and keeps its short messages).
    #[derive(Debug, Default)]
    struct Minimal(Vec<(AmId, u64, Vec<u8>)>);

    impl Endpoint for Minimal {
        fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
            self.0.push((id, header, payload.to_vec()));
            Ok(())
        }
        fn am_bcopy(&mut self, _: AmId, _: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
            Ok(0)
        }
        fn am_zcopy(&mut self, _: AmId, _: &[u8], _: &[Iov<'_>], _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
        fn put_short(&mut self, _: &[u8], _: u64, _: &RemoteKey) -> Result<()> {
            Ok(())
        }
        fn put_zcopy(&mut self, _: &[Iov<'_>], _: u64, _: &RemoteKey, _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
        fn get_zcopy(&mut self, _: &[Iov<'_>], _: u64, _: &RemoteKey, _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
        fn flush(&mut self, _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
    }

    #[test]
    fn a_word_and_bytes_are_joined_in_the_scratch_buffer_by_default() {
        let mut ep = Minimal::default();
        let mut scratch = vec![0xEE; 3];
        ep.am_short_word(2, 10, 0x0102, b"xyz", &mut scratch)
            .unwrap();
        ep.am_short_word(2, 11, 3, &[], &mut scratch).unwrap();
        let mut first = 0x0102u64.to_le_bytes().to_vec();
        first.extend_from_slice(b"xyz");
        assert_eq!(
            ep.0,
            vec![(2, 10, first), (2, 11, 3u64.to_le_bytes().to_vec())]
        );
    }

    #[test]
    fn connect_to_ep_is_unsupported_by_default() {
        let mut ep = Minimal::default();
        assert!(matches!(ep.ep_address(), Err(Error::Unsupported { .. })));
        let e = ep.connect_to_ep(&[1, 2], &[3]).unwrap_err();
        assert!(e.to_string().contains("connect_to_ep"), "{e}");
    }

    /// A put/get-only endpoint whose active-message methods come from the macro.
    #[derive(Debug)]
    struct PutOnly;

    impl Endpoint for PutOnly {
        crate::no_active_messages!(Error::Unsupported {
            what: "am".into(),
            why: "put only".into(),
        });
        fn put_short(&mut self, data: &[u8], _: u64, _: &RemoteKey) -> Result<()> {
            check_put_short(data.len(), 4, "put_only")
        }
        fn put_zcopy(&mut self, _: &[Iov<'_>], _: u64, _: &RemoteKey, _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
        fn get_zcopy(&mut self, _: &[Iov<'_>], _: u64, _: &RemoteKey, _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
        fn flush(&mut self, _: u64) -> Result<OpStatus> {
            Ok(OpStatus::Done)
        }
    }

    #[test]
    fn no_active_messages_and_put_short_limit() {
        let mut ep = PutOnly;
        let unsupported =
            |r: Result<()>| matches!(r, Err(Error::Unsupported { why, .. }) if why == "put only");
        assert!(unsupported(ep.am_short(1, 2, &[3])));
        assert!(unsupported(ep.am_bcopy(1, &mut |_| 0).map(|_| ())));
        assert!(unsupported(ep.am_zcopy(1, &[], &[], 0).map(|_| ())));
        let rkey = RemoteKey::new("put_only", 0, 0, std::sync::Arc::new(()));
        assert!(ep.put_short(&[0; 4], 0, &rkey).is_ok());
        let e = ep.put_short(&[0; 5], 0, &rkey).unwrap_err();
        assert!(matches!(e, Error::InvalidParam(_)), "{e}");
        assert!(
            e.to_string()
                .contains("put_short of 5 bytes exceeds put_only's limit of 4"),
            "{e}"
        );
    }
}
