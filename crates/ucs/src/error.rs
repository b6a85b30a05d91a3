//! Typed errors shared by every layer.
//!
//! Every message says what failed, on which resource, and what the user can change.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::memtype::MemoryType;

/// Result alias used across rucx.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a memory domain refused to register a buffer.
///
/// The planner decides whether to demote a domain from this kind, so a transport must map its
/// native failure (errno, CUDA result) to the closest kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegErrorKind {
    /// The domain cannot translate the address (`EFAULT`, "Bad address"): typical for device
    /// memory on a NIC without GPU-direct support.
    BadAddress,
    /// A mapping aperture (BAR1, a registration budget) is full. Evicting cached registrations
    /// may help once.
    ApertureExhausted,
    /// The memory cannot be exported to other processes (e.g. a stream-ordered pool allocation
    /// through legacy CUDA IPC handles).
    NotExportable,
    /// The kernel or driver ran out of memory or locked-memory quota (`ENOMEM`).
    NoMemory,
    /// The domain does not handle this memory type at all.
    UnsupportedMemoryType,
    /// Anything else the driver reported.
    Other,
}

impl RegErrorKind {
    /// Short description used in messages.
    pub fn describe(self) -> &'static str {
        match self {
            RegErrorKind::BadAddress => "address not translatable by this domain (Bad address)",
            RegErrorKind::ApertureExhausted => "mapping aperture exhausted",
            RegErrorKind::NotExportable => "memory cannot be exported",
            RegErrorKind::NoMemory => "out of memory or locked-memory quota",
            RegErrorKind::UnsupportedMemoryType => "memory type not supported by this domain",
            RegErrorKind::Other => "driver error",
        }
    }

    /// Whether evicting unused cached registrations and retrying once can help.
    pub fn may_recover_by_eviction(self) -> bool {
        matches!(
            self,
            RegErrorKind::ApertureExhausted | RegErrorKind::NoMemory
        )
    }

    /// What a failure of this kind says something about: the one buffer (or its kind of
    /// allocation), or the domain for that memory type on that device. The planner steers a
    /// [`RegScope::Buffer`] failure's buffer to another path and keeps using the domain for
    /// everything else; it demotes the domain for a [`RegScope::Domain`] failure (after the
    /// eviction retry where [`may_recover_by_eviction`](Self::may_recover_by_eviction)).
    ///
    /// This is the only place that decides it.
    pub fn scope(self) -> RegScope {
        match self {
            // "Cannot export this allocation" is visible from the pointer's attributes (a
            // stream-ordered pool, a VMM allocation without an IPC handle type): another buffer
            // of the same GPU may export fine.
            RegErrorKind::NotExportable => RegScope::Buffer,
            // An address the domain cannot translate (device memory without GPU-direct), an
            // aperture still full after eviction, a spent locked-memory quota, a memory type
            // the domain does not handle, or an unclassified driver failure: every later buffer
            // of that type on that device would most likely fail the same way.
            RegErrorKind::BadAddress
            | RegErrorKind::ApertureExhausted
            | RegErrorKind::NoMemory
            | RegErrorKind::UnsupportedMemoryType
            | RegErrorKind::Other => RegScope::Domain,
        }
    }
}

/// What a registration failure is a property of; see [`RegErrorKind::scope`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegScope {
    /// The buffer (or its kind of allocation): only that buffer takes another path.
    Buffer,
    /// The domain, for that memory type on that device: the domain is demoted.
    Domain,
}

impl fmt::Display for RegScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegScope::Buffer => "buffer",
            RegScope::Domain => "domain",
        })
    }
}

/// A failed memory registration, with everything needed to act on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegError {
    /// The memory domain that refused (e.g. `posix`, `cuda_ipc`, `mlx5_0`).
    pub domain: String,
    /// Memory type of the buffer.
    pub mem_type: MemoryType,
    /// GPU ordinal owning the buffer, when it is GPU memory.
    pub device: Option<u32>,
    /// Start address of the buffer.
    pub addr: usize,
    /// Length of the buffer in bytes.
    pub len: usize,
    /// Classified cause.
    pub kind: RegErrorKind,
    /// What the driver or the fault injector said.
    pub detail: String,
    /// Which knob to turn to skip or fix this (may be empty).
    pub hint: String,
}

impl fmt::Display for RegError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot register {} bytes at {:#x} ({} memory",
            self.len, self.addr, self.mem_type
        )?;
        if let Some(d) = self.device {
            write!(f, " on GPU {d}")?;
        }
        write!(
            f,
            ") with memory domain {}: {}",
            self.domain,
            self.kind.describe()
        )?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        if !self.hint.is_empty() {
            write!(f, "; {}", self.hint)?;
        }
        Ok(())
    }
}

impl std::error::Error for RegError {}

/// An operating-system error that can be cloned and compared, as held by [`Error::Io`].
///
/// [`std::io::Error`] is neither `Clone` nor `PartialEq`; this shares one behind an [`Arc`], so
/// every clone of an [`Error`] reports the very same OS error (kind, code and message). It
/// displays as the `io::Error` inside and hands on that error's source, so the chain of
/// [`std::error::Error::source`] reads as it would with the `io::Error` itself;
/// [`get_ref`](Self::get_ref) gives the `io::Error`.
#[derive(Clone, Debug)]
pub struct IoError(Arc<std::io::Error>);

impl IoError {
    /// Wrap an OS error.
    pub fn new(e: std::io::Error) -> Self {
        IoError(Arc::new(e))
    }

    /// The `io::Error` inside.
    pub fn get_ref(&self) -> &std::io::Error {
        &self.0
    }

    /// Its kind.
    pub fn kind(&self) -> std::io::ErrorKind {
        self.0.kind()
    }

    /// The OS error code (`errno`), when it came from one.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.0.raw_os_error()
    }
}

impl From<std::io::Error> for IoError {
    fn from(e: std::io::Error) -> Self {
        IoError::new(e)
    }
}

impl AsRef<std::io::Error> for IoError {
    fn as_ref(&self) -> &std::io::Error {
        &self.0
    }
}

/// Equal when they are clones of one error, or have the same kind, OS code and message.
impl PartialEq for IoError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.kind() == other.kind()
                && self.raw_os_error() == other.raw_os_error()
                && self.0.to_string() == other.0.to_string())
    }
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for IoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Who closed an endpoint ([`Error::EndpointClosed`]): what its requests end with differs
/// (UCX fails an endpoint its peer closed with `UCS_ERR_CONNECTION_RESET`, and refuses a
/// second close of its own with `UCS_ERR_NOT_CONNECTED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClosedBy {
    /// `Worker::close` on this side.
    ThisWorker,
    /// The peer closed its side (its disconnect arrived).
    Peer,
}

impl fmt::Display for ClosedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClosedBy::ThisWorker => "closed by this worker",
            ClosedBy::Peer => "the peer closed it",
        })
    }
}

/// The one error type of rucx.
///
/// It is `Clone` and `PartialEq`, so every request that failed for one reason reports that very
/// error, and tests can compare errors whole.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller passed something unusable.
    #[error("invalid parameter: {0}")]
    InvalidParam(String),

    /// A configuration value (environment variable or in-code override) did not parse.
    #[error("invalid value {value:?} for {var}: {reason}; accepted: {accepted}")]
    Config {
        /// Full variable name, e.g. `RUCX_TLS`.
        var: String,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
        /// The forms that are accepted.
        accepted: String,
    },

    /// The operation or combination is not supported by this resource.
    #[error("{what} is not supported: {why}")]
    Unsupported {
        /// What was asked for.
        what: String,
        /// Why it cannot be done.
        why: String,
    },

    /// A component or device cannot be used on this host.
    #[error("{component} is unavailable: {reason}")]
    Unavailable {
        /// Component or device name.
        component: String,
        /// Why (missing library, no device, driver too old, ...).
        reason: String,
    },

    /// A transient shortage (send ring full, no credits); progress and retry.
    #[error("no resources right now ({0}); progress the worker and retry")]
    NoResource(String),

    /// A memory registration failed; the planner may demote the domain.
    #[error(transparent)]
    Registration(#[from] Box<RegError>),

    /// A packed remote key did not validate.
    #[error("invalid remote key for domain {domain}: {reason}")]
    InvalidRkey {
        /// Domain that tried to unpack it.
        domain: String,
        /// What is wrong.
        reason: String,
    },

    /// A remote access fell outside the remote region.
    #[error(
        "remote access {addr:#x}+{len} is outside the registered remote region {base:#x}+{region_len}"
    )]
    OutOfBounds {
        /// Requested remote address.
        addr: u64,
        /// Requested length.
        len: u64,
        /// Region base.
        base: u64,
        /// Region length.
        region_len: u64,
    },

    /// A packed worker, interface or endpoint address did not validate.
    #[error("invalid address: {0}")]
    InvalidAddress(String),

    /// A message was larger than the buffer posted for it; nothing was written past the buffer
    /// (the bytes that fit were).
    #[error(
        "message truncated: {incoming} bytes arrived for a {capacity}-byte receive buffer{}",
        tag.map_or(String::new(), |t| format!(" (sender tag {t:#x})"))
    )]
    Truncated {
        /// Bytes the sender sent.
        incoming: usize,
        /// Bytes the receiver offered.
        capacity: usize,
        /// The message's tag as its sender gave it, for a tag receive (`None` for an active
        /// message's payload, which has no tag): what a wildcard receive matched, so that it
        /// can say whose message it cut (MPI's `MPI_SOURCE` and `MPI_TAG` of the status).
        tag: Option<u64>,
    },

    /// The peer ended a transfer it could not carry out (a rendezvous whose registrations or
    /// copies failed on its side with no other path left); the endpoint stays usable.
    #[error("{peer} ended the transfer: {reason}")]
    PeerAborted {
        /// Peer description (address, rank).
        peer: String,
        /// The peer's error, as it reported it.
        reason: String,
    },

    /// The endpoint was closed (`Worker::close` on this side, or the peer closed its side): it
    /// takes no more requests. Connecting again to the peer's address gives a new endpoint.
    #[error(
        "endpoint {ep} to {peer} is closed ({by}); connect again to the peer's address for a new endpoint"
    )]
    EndpointClosed {
        /// The endpoint, as the worker names it (`ep3`).
        ep: String,
        /// Peer description (address, rank).
        peer: String,
        /// Who closed it (its text: "closed by this worker", "the peer closed it").
        by: ClosedBy,
    },

    /// An endpoint id was used on a worker that did not make it (an id is valid only on the
    /// worker whose connect or accept made it; its index may name another endpoint there, so
    /// nothing is done). UCX leaves this undefined; rucx refuses it.
    #[error(
        "endpoint {ep} belongs to worker #{owner}, not to worker #{worker} it was used on (an \
         EpId is valid only on the worker whose connect or accept made it)"
    )]
    ForeignEndpoint {
        /// The endpoint as its worker names it (`ep3`).
        ep: String,
        /// Serial of the worker that made it (`EpId::worker`).
        owner: u32,
        /// Serial of the worker it was used on (`Worker::serial`).
        worker: u32,
    },

    /// The connection to a peer broke.
    #[error("endpoint to {peer} failed: {reason}")]
    EndpointFailure {
        /// Peer description (address, rank).
        peer: String,
        /// What happened.
        reason: String,
    },

    /// A peer answered nothing (no message, no answer to keepalive probes) for the peer
    /// timeout while requests waited for it: its endpoint failed, and every request bound to it
    /// ends with this error (UCX's `UCS_ERR_ENDPOINT_TIMEOUT`). The endpoint cannot be used
    /// again; connecting again to the peer's address gives a new one.
    #[error(
        "endpoint to {peer} timed out: it answered nothing for {silent:?} (no message, no answer \
         to keepalive probes), past the peer timeout {knob}; the peer is frozen, stopped, \
         unreachable or not calling into rucx (raise the timeout if it may be busy that long)"
    )]
    PeerTimeout {
        /// Peer description (address, rank).
        peer: String,
        /// How long it was silent.
        silent: Duration,
        /// The setting that sets the timeout, with its value as given, e.g.
        /// `RUCX_PEER_TIMEOUT=2s`.
        knob: String,
    },

    /// A stream receive ended before its buffer was full, because its endpoint ended (`cause`:
    /// the peer closed it, it failed, or this worker closed it). The first `received` bytes of
    /// the buffer hold the stream's next bytes, intact and in order; the rest of the buffer was
    /// not written. (UCX reports the same length with the stream receive's completion.)
    #[error(
        "stream receive ended after {received} of {wanted} bytes (they are at the start of the \
         buffer): {cause}"
    )]
    StreamIncomplete {
        /// Bytes written at the start of the buffer.
        received: usize,
        /// Bytes the receive asked for (its buffer's length).
        wanted: usize,
        /// Why the stream ended.
        cause: Box<Error>,
    },

    /// An operation did not finish in time.
    #[error("timed out after {after:?}: {what}")]
    Timeout {
        /// How long we waited.
        after: Duration,
        /// What we waited for.
        what: String,
    },

    /// The request was canceled by the user.
    #[error("operation canceled")]
    Canceled,

    /// Events are pending, so the resource was not armed for a wake-up (UCX's
    /// `UCS_ERR_BUSY` from `ucp_worker_arm`): progress it and arm again.
    #[error("busy: {0}; progress and arm again")]
    Busy(String),

    /// Memory could not be allocated.
    #[error("out of memory: {0}")]
    NoMemory(String),

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The OS error (shared, so that the error can be cloned).
        #[source]
        source: IoError,
    },

    /// A device (GPU, NIC) reported an error.
    #[error("{device}: {reason}")]
    Device {
        /// Which device, e.g. `GPU 0 (0000:19:00.0)`.
        device: String,
        /// Driver message and code.
        reason: String,
    },

    /// A broken internal invariant; please report it.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// Build an [`Error::Io`] from the last OS error.
    pub fn last_os(context: impl Into<String>) -> Self {
        Error::io(context, std::io::Error::last_os_error())
    }

    /// Build an [`Error::Io`] with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: IoError::new(source),
        }
    }

    /// Build a registration error.
    pub fn registration(e: RegError) -> Self {
        Error::Registration(Box::new(e))
    }

    /// The registration failure inside, if this is one.
    pub fn as_registration(&self) -> Option<&RegError> {
        match self {
            Error::Registration(r) => Some(r),
            _ => None,
        }
    }

    /// The error behind a wrapper ([`Error::StreamIncomplete`]'s cause), else this one: what
    /// to match on to learn why an operation ended.
    pub fn cause(&self) -> &Error {
        match self {
            Error::StreamIncomplete { cause, .. } => cause.cause(),
            e => e,
        }
    }

    /// True for transient errors where progress-and-retry is the right reaction.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::NoResource(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_message_names_everything() {
        let e = Error::registration(RegError {
            domain: "mlx5_0".into(),
            mem_type: MemoryType::Cuda,
            device: Some(1),
            addr: 0x7f72_4fa0_0000,
            len: 4096,
            kind: RegErrorKind::BadAddress,
            detail: "ibv_reg_mr: EFAULT".into(),
            hint: "set RUCX_IB_GPU_DIRECT_RDMA=no to skip".into(),
        });
        let s = e.to_string();
        for want in [
            "4096 bytes",
            "0x7f724fa00000",
            "cuda memory on GPU 1",
            "mlx5_0",
            "Bad address",
            "RUCX_IB_GPU_DIRECT_RDMA=no",
        ] {
            assert!(s.contains(want), "{s:?} lacks {want:?}");
        }
        assert!(e.as_registration().is_some());
        assert!(!e.is_retryable());
    }

    #[test]
    fn failure_scope_is_decided_by_kind() {
        use RegErrorKind::*;
        assert_eq!(NotExportable.scope(), RegScope::Buffer);
        for k in [
            BadAddress,
            ApertureExhausted,
            NoMemory,
            UnsupportedMemoryType,
            Other,
        ] {
            assert_eq!(k.scope(), RegScope::Domain, "{k:?}");
        }
        // Kinds an eviction may cure are domain-scoped: when the retry fails too, the domain
        // is out of room on that device.
        for k in [BadAddress, ApertureExhausted, NotExportable, NoMemory] {
            if k.may_recover_by_eviction() {
                assert_eq!(k.scope(), RegScope::Domain, "{k:?}");
            }
        }
        assert_eq!(RegScope::Buffer.to_string(), "buffer");
    }

    #[test]
    fn peer_abort_message_carries_the_reason() {
        let e = Error::PeerAborted {
            peer: "rank 1".into(),
            reason: "cannot register 4096 bytes with memory domain cuda_cpy; set RUCX_REG_SKIP"
                .into(),
        };
        let s = e.to_string();
        assert!(s.contains("rank 1") && s.contains("cuda_cpy") && s.contains("RUCX_REG_SKIP"));
        assert!(!e.is_retryable());
    }

    #[test]
    fn eviction_policy() {
        assert!(RegErrorKind::ApertureExhausted.may_recover_by_eviction());
        assert!(!RegErrorKind::BadAddress.may_recover_by_eviction());
        assert!(!RegErrorKind::NotExportable.may_recover_by_eviction());
    }

    #[test]
    fn a_cloned_io_error_keeps_kind_code_message_and_source() {
        use std::error::Error as _;
        use std::io::{Error as IoErr, ErrorKind};

        // An OS error (errno 2, ENOENT on Linux) and one with a custom message.
        let os = Error::io("opening /dev/shm/x", IoErr::from_raw_os_error(2));
        let custom = Error::io(
            "reading the peer address",
            IoErr::new(ErrorKind::UnexpectedEof, "peer closed after 3 of 40 bytes"),
        );
        for e in [os, custom] {
            let c = e.clone();
            assert_eq!(c, e);
            assert_eq!(c.to_string(), e.to_string());
            let (Error::Io { source: a, .. }, Error::Io { source: b, .. }) = (&e, &c) else {
                panic!("not an io error: {c:?}");
            };
            assert_eq!(a.kind(), b.kind());
            assert_eq!(a.raw_os_error(), b.raw_os_error());
            assert_eq!(a.get_ref().to_string(), b.get_ref().to_string());
            // The source is the OS error, displayed as the io::Error would be.
            let src = c.source().expect("an io error has a source");
            assert_eq!(src.to_string(), a.get_ref().to_string());
            assert!(src.downcast_ref::<IoError>().is_some());
        }

        let e = Error::io("opening /dev/shm/x", IoErr::from_raw_os_error(2));
        let Error::Io { source, .. } = e.clone() else {
            unreachable!()
        };
        assert_eq!(source.kind(), ErrorKind::NotFound);
        assert_eq!(source.raw_os_error(), Some(2));
        // The message is unchanged: the context, then the OS error as std prints it.
        assert_eq!(
            e.to_string(),
            format!("opening /dev/shm/x: {}", IoErr::from_raw_os_error(2))
        );
        let e = Error::io(
            "reading the peer address",
            IoErr::new(ErrorKind::UnexpectedEof, "peer closed after 3 of 40 bytes"),
        );
        assert_eq!(
            e.clone().to_string(),
            "reading the peer address: peer closed after 3 of 40 bytes"
        );
    }

    #[test]
    fn errors_compare_by_content() {
        use std::io::Error as IoErr;

        let io = |msg: &str| Error::io("ctx", IoErr::other(msg.to_string()));
        // Equal content, separately built: equal.
        assert_eq!(io("a"), io("a"));
        assert_ne!(io("a"), io("b"));
        assert_ne!(
            Error::io("ctx", IoErr::from_raw_os_error(2)),
            Error::io("ctx", IoErr::from_raw_os_error(13))
        );
        assert_ne!(
            Error::io("one", IoErr::from_raw_os_error(2)),
            Error::io("two", IoErr::from_raw_os_error(2))
        );
        assert_ne!(io("a"), Error::Internal("ctx: a".into()));
        let t = Error::Truncated {
            incoming: 10,
            capacity: 4,
            tag: Some(0x2a),
        };
        assert_eq!(t.clone(), t);
        assert_ne!(
            t,
            Error::Truncated {
                incoming: 10,
                capacity: 5,
                tag: Some(0x2a),
            }
        );
        assert_ne!(
            t,
            Error::Truncated {
                incoming: 10,
                capacity: 4,
                tag: None,
            }
        );
        assert_eq!(
            t.to_string(),
            "message truncated: 10 bytes arrived for a 4-byte receive buffer (sender tag 0x2a)"
        );
        let r = Error::registration(RegError {
            domain: "posix".into(),
            mem_type: MemoryType::Host,
            device: None,
            addr: 0x1000,
            len: 64,
            kind: RegErrorKind::NoMemory,
            detail: "mmap: ENOMEM".into(),
            hint: String::new(),
        });
        assert_eq!(r.clone(), r);
        assert_eq!(r.clone().to_string(), r.to_string());
    }

    #[test]
    fn a_peer_timeout_names_its_knob_and_a_partial_stream_its_count() {
        let t = Error::PeerTimeout {
            peer: "rank 1".into(),
            silent: Duration::from_millis(2004),
            knob: "RUCX_PEER_TIMEOUT=2s".into(),
        };
        let s = t.to_string();
        for want in [
            "rank 1",
            "2.004s",
            "RUCX_PEER_TIMEOUT=2s",
            "raise the timeout",
        ] {
            assert!(s.contains(want), "{s:?} lacks {want:?}");
        }
        let closed = Error::EndpointClosed {
            ep: "ep0".into(),
            peer: "rank 1".into(),
            by: ClosedBy::Peer,
        };
        let partial = Error::StreamIncomplete {
            received: 700,
            wanted: 1000,
            cause: Box::new(closed.clone()),
        };
        assert!(
            partial
                .to_string()
                .starts_with("stream receive ended after 700 of 1000 bytes"),
            "{partial}"
        );
        assert!(partial.to_string().contains("the peer closed it"));
        assert_eq!(partial.cause(), &closed);
        assert_eq!(t.cause(), &t);
        assert!(!partial.is_retryable() && !t.is_retryable());
    }

    #[test]
    fn config_message() {
        let e = Error::Config {
            var: "RUCX_TLS".into(),
            value: "bogus".into(),
            reason: "unknown transport or alias \"bogus\"".into(),
            accepted: "all, sm, self, posix, tcp, cuda, ib, ^name".into(),
        };
        let s = e.to_string();
        assert!(s.contains("RUCX_TLS") && s.contains("bogus") && s.contains("accepted"));
    }
}
