//! `ucs_status_t`: its strings, the status-in-pointer convention (`UCS_PTR_IS_ERR` and
//! friends: a returned pointer is either NULL for done, a small negative status, or a request),
//! and the mapping from rucx's errors.

use std::ffi::{CStr, c_char, c_void};

use rucx_ucs::Error;

use crate::types::*;

/// The C string of a status (what `ucs_status_string` returns; never freed).
pub fn status_cstr(status: Status) -> &'static CStr {
    match status {
        UCS_OK => c"Success",
        UCS_INPROGRESS => c"Operation in progress",
        UCS_ERR_NO_MESSAGE => c"No pending message",
        UCS_ERR_NO_RESOURCE => c"No resources are available to initiate the operation",
        UCS_ERR_IO_ERROR => c"Input/output error",
        UCS_ERR_NO_MEMORY => c"Out of memory",
        UCS_ERR_INVALID_PARAM => c"Invalid parameter",
        UCS_ERR_UNREACHABLE => c"Destination is unreachable",
        UCS_ERR_INVALID_ADDR => c"Address not valid",
        UCS_ERR_NOT_IMPLEMENTED => c"Function not implemented",
        UCS_ERR_MESSAGE_TRUNCATED => c"Message truncated",
        UCS_ERR_NO_PROGRESS => c"No progress",
        UCS_ERR_BUFFER_TOO_SMALL => c"Provided buffer is too small",
        UCS_ERR_NO_ELEM => c"No such element",
        UCS_ERR_SOME_CONNECTS_FAILED => c"Failed to connect some of the requested endpoints",
        UCS_ERR_NO_DEVICE => c"No such device",
        UCS_ERR_BUSY => c"Device is busy",
        UCS_ERR_CANCELED => c"Request canceled",
        UCS_ERR_SHMEM_SEGMENT => c"Shared memory error",
        UCS_ERR_ALREADY_EXISTS => c"Element already exists",
        UCS_ERR_OUT_OF_RANGE => c"Index out of range",
        UCS_ERR_TIMED_OUT => c"Operation timed out",
        UCS_ERR_EXCEEDS_LIMIT => c"User-defined limit was reached",
        UCS_ERR_UNSUPPORTED => c"Unsupported operation",
        UCS_ERR_REJECTED => c"Operation rejected by remote peer",
        UCS_ERR_NOT_CONNECTED => c"Endpoint is not connected",
        UCS_ERR_CONNECTION_RESET => c"Connection reset by remote peer",
        UCS_ERR_ENDPOINT_TIMEOUT => c"Endpoint timeout",
        s if (UCS_ERR_LAST_LINK_FAILURE..=UCS_ERR_FIRST_LINK_FAILURE).contains(&s) => {
            c"Link failure"
        }
        s if (UCS_ERR_LAST_ENDPOINT_FAILURE..=UCS_ERR_FIRST_ENDPOINT_FAILURE).contains(&s) => {
            c"Endpoint failure"
        }
        _ => c"Unknown error",
    }
}

/// The status of a rucx error, as close as UCX's codes allow.
pub fn status_of(e: &Error) -> Status {
    match e {
        Error::InvalidParam(_) | Error::Config { .. } => UCS_ERR_INVALID_PARAM,
        Error::Unsupported { .. } => UCS_ERR_UNSUPPORTED,
        Error::Unavailable { .. } => UCS_ERR_NO_DEVICE,
        Error::NoResource(_) => UCS_ERR_NO_RESOURCE,
        Error::Registration(_) => UCS_ERR_IO_ERROR,
        Error::InvalidRkey { .. } | Error::InvalidAddress(_) => UCS_ERR_INVALID_ADDR,
        Error::OutOfBounds { .. } => UCS_ERR_OUT_OF_RANGE,
        Error::Truncated { .. } => UCS_ERR_MESSAGE_TRUNCATED,
        Error::PeerAborted { .. } => UCS_ERR_REJECTED,
        Error::EndpointFailure { .. } => UCS_ERR_CONNECTION_RESET,
        // A peer silent past `RUCX_PEER_TIMEOUT`, by its kind (UCX fails the endpoint's
        // requests with this status too); a wait of ours that ran out is a plain time-out.
        Error::PeerTimeout { .. } => UCS_ERR_ENDPOINT_TIMEOUT,
        Error::Timeout { .. } => UCS_ERR_TIMED_OUT,
        // Why the stream ended (the received length goes with the completion).
        Error::StreamIncomplete { cause, .. } => status_of(cause),
        Error::Canceled => UCS_ERR_CANCELED,
        // A connection refused (nobody listens there) or without a route, as UCX's tcp
        // connection manager reports them.
        Error::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::ConnectionRefused => UCS_ERR_NOT_CONNECTED,
            std::io::ErrorKind::HostUnreachable
            | std::io::ErrorKind::NetworkUnreachable
            | std::io::ErrorKind::TimedOut => UCS_ERR_UNREACHABLE,
            _ => UCS_ERR_IO_ERROR,
        },
        Error::NoMemory(_) => UCS_ERR_NO_MEMORY,
        Error::Device { .. } | Error::Internal(_) => UCS_ERR_IO_ERROR,
        _ => UCS_ERR_IO_ERROR,
    }
}

/// `UCS_STATUS_PTR(status)`.
pub fn status_ptr(status: Status) -> *mut c_void {
    status as isize as *mut c_void
}

/// `UCS_PTR_IS_ERR(ptr)`.
pub fn ptr_is_err(p: *const c_void) -> bool {
    (p as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// True for a pointer that is a request (neither NULL nor an error status).
#[inline]
pub fn ptr_is_ptr(p: *const c_void) -> bool {
    (p as usize).wrapping_sub(1) < (UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `const char *ucs_status_string(ucs_status_t status)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucs_status_string(status: Status) -> *const c_char {
    status_cstr(status).as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_convention() {
        assert!(!ptr_is_err(std::ptr::null()));
        assert!(!ptr_is_ptr(std::ptr::null()));
        let e = status_ptr(UCS_ERR_CANCELED);
        assert!(ptr_is_err(e) && !ptr_is_ptr(e));
        assert_eq!(e as isize, -16);
        let last = status_ptr(UCS_ERR_LAST);
        assert!(ptr_is_err(last));
        let x = 0x1000usize as *const c_void;
        assert!(ptr_is_ptr(x) && !ptr_is_err(x));
    }

    #[test]
    fn every_code_has_a_string() {
        for s in -100i8..=1 {
            assert!(!status_cstr(s).to_bytes().is_empty());
        }
        assert_eq!(status_cstr(UCS_OK).to_str().unwrap(), "Success");
        assert_eq!(status_cstr(-50).to_str().unwrap(), "Link failure");
        assert_eq!(status_cstr(-120).to_str().unwrap(), "Unknown error");
    }

    #[test]
    fn errors_map() {
        assert_eq!(status_of(&Error::Canceled), UCS_ERR_CANCELED);
        let timeout = Error::PeerTimeout {
            peer: "rank 1".into(),
            silent: std::time::Duration::from_millis(120),
            knob: "RUCX_PEER_TIMEOUT=100ms".into(),
        };
        assert_eq!(status_of(&timeout), UCS_ERR_ENDPOINT_TIMEOUT);
        // By kind, not by text: a failure whose reason names the knob is still a reset.
        let reset = Error::EndpointFailure {
            peer: "rank 1".into(),
            reason: "after RUCX_PEER_TIMEOUT was changed, the connection broke".into(),
        };
        assert_eq!(status_of(&reset), UCS_ERR_CONNECTION_RESET);
        assert_eq!(
            status_of(&Error::Timeout {
                after: std::time::Duration::from_millis(5),
                what: "request 3".into(),
            }),
            UCS_ERR_TIMED_OUT
        );
        let cut = |cause: Error| Error::StreamIncomplete {
            received: 700,
            wanted: 1000,
            cause: Box::new(cause),
        };
        assert_eq!(status_of(&cut(timeout)), UCS_ERR_ENDPOINT_TIMEOUT);
        assert_eq!(status_of(&cut(Error::Canceled)), UCS_ERR_CANCELED);
        assert_eq!(
            status_of(&Error::Truncated {
                incoming: 2,
                capacity: 1,
                tag: Some(9),
            }),
            UCS_ERR_MESSAGE_TRUNCATED
        );
    }
}
