//! Memory the worker allocates by the size a message declares: the copy of an eager message
//! that arrived before its receive (and of a user active message). These allocations are
//! fallible: one that cannot be served fails the receive the message is matched by (or drops the
//! active message, with a warning) instead of aborting the process. Nothing else is allocated
//! per byte of a message: rendezvous payloads go straight between the users' buffers (or
//! through the bounded staging fragments), never through a copy held by the library.

use rucx_ucs::{Error, Result};

/// The allocation policy of a worker: the system allocator, optionally with an injected limit
/// (tests: a message larger than what can be allocated, without exhausting the machine).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MsgAlloc {
    /// Requests above this many bytes fail as if the system had no memory for them.
    pub(crate) limit: Option<usize>,
}

impl MsgAlloc {
    /// Make room for `total` bytes in the empty `buf`, or say why not.
    pub(crate) fn reserve(&self, buf: &mut Vec<u8>, total: usize) -> Result<()> {
        if let Some(l) = self.limit
            && total > l
        {
            return Err(Error::NoMemory(format!(
                "{total} bytes for a message (allocation limit of {l} bytes injected)"
            )));
        }
        buf.try_reserve_exact(total.saturating_sub(buf.len()))
            .map_err(|e| Error::NoMemory(format!("{total} bytes for a message: {e}")))
    }
}

/// The error of a receive matched by a message the worker had no memory to keep.
pub(crate) fn lost_message(total: usize) -> Error {
    Error::NoMemory(format!(
        "a {total}-byte eager message arrived before this receive and no buffer of that size \
         could be allocated to keep it, so it was dropped (post the receive before the \
         message comes, or lower RUCX_RNDV_THRESH so that messages this large use the \
         rendezvous protocol, which needs no such buffer)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_real_failures_are_errors() {
        let mut v = Vec::new();
        MsgAlloc::default().reserve(&mut v, 1000).unwrap();
        assert!(v.capacity() >= 1000);
        let mut v = Vec::new();
        let e = MsgAlloc { limit: Some(10) }
            .reserve(&mut v, 11)
            .unwrap_err();
        assert!(
            matches!(e, Error::NoMemory(ref m) if m.contains("11 bytes")),
            "{e}"
        );
        // A size no system can serve fails, rather than aborting the process.
        let mut v = Vec::new();
        let e = MsgAlloc::default().reserve(&mut v, usize::MAX).unwrap_err();
        assert!(matches!(e, Error::NoMemory(_)), "{e}");
        assert!(lost_message(5).to_string().contains("5-byte"));
    }
}
