//! The rucx side of an operation posted through the C ABI: a request that outlives any scope
//! (the memory is the C caller's, valid until the operation ends by UCX's contract), polled
//! from progress.
//!
//! Placeholder until rucx's owned-buffer requests land: every operation ends at once with
//! `Unsupported`.

use rucx_ucp::{Completion, EpId, Worker};
use rucx_ucs::{Error, Result};

/// The memory of an operation: the caller's (by address) or a buffer of ours.
#[derive(Debug)]
pub enum Buf {
    #[allow(dead_code)] // until the owned-buffer requests land
    Raw {
        addr: usize,
        len: usize,
    },
    Owned(Vec<u8>),
}

/// An operation in flight.
#[derive(Debug)]
pub struct Op {
    send: bool,
    res: Result<Completion>,
    buf: Option<Vec<u8>>,
}

fn refused() -> Result<Completion> {
    Err(Error::Unsupported {
        what: "tag operations through the C ABI".into(),
        why: "rucx's owned-buffer requests are not merged yet".into(),
    })
}

impl Op {
    /// Post a tag send.
    ///
    /// # Safety
    /// A `Raw` buffer stays valid (and unwritten) until the operation ends.
    pub unsafe fn send(_w: &Worker, _ep: EpId, buf: Buf, _tag: u64, _sync: bool) -> Op {
        Op {
            send: true,
            res: refused(),
            buf: match buf {
                Buf::Owned(v) => Some(v),
                Buf::Raw { .. } => None,
            },
        }
    }

    /// Post a tag receive.
    ///
    /// # Safety
    /// A `Raw` buffer stays valid (and untouched by others) until the operation ends.
    pub unsafe fn recv(_w: &Worker, buf: Buf, _tag: u64, _mask: u64) -> Op {
        Op {
            send: false,
            res: refused(),
            buf: match buf {
                Buf::Owned(v) => Some(v),
                Buf::Raw { .. } => None,
            },
        }
    }

    /// True once the operation ended.
    pub fn poll(&mut self) -> bool {
        true
    }

    /// Cancel a receive that has not matched; true when it was canceled.
    pub fn cancel(&self, _w: &Worker) -> bool {
        false
    }

    pub fn is_send(&self) -> bool {
        self.send
    }

    /// The result of an ended operation, and our buffer back.
    pub fn take(self) -> (Result<Completion>, Option<Vec<u8>>) {
        (self.res, self.buf)
    }
}
