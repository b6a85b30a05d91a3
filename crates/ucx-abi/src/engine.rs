//! The rucx side of an operation posted through the C ABI: an owned-buffer request
//! ([`OwnedRequest`]), which outlives any scope and is polled from progress. Its memory is the C
//! caller's ([`RawBuf`], valid until the operation ends by UCX's contract) or a buffer of ours
//! (generic datatypes, probed messages).

use rucx_ucp::{Completion, EpId, OwnedRequest, RawBuf, Worker};
use rucx_ucs::{MemInfo, Result};

/// The memory of an operation: the caller's (by address, its type found by rucx's domains:
/// GPU memory takes rucx's GPU paths) or a buffer of ours.
#[derive(Debug)]
pub enum Buf {
    /// `info`: its memory type when known ([`crate::memtype`]), else rucx classifies it.
    Raw {
        addr: usize,
        len: usize,
        info: Option<MemInfo>,
    },
    Owned(Vec<u8>),
}

#[derive(Debug)]
enum Req {
    Raw(OwnedRequest<RawBuf>),
    Owned(OwnedRequest<Vec<u8>>),
}

/// An operation in flight.
#[derive(Debug)]
pub struct Op {
    req: Req,
    send: bool,
}

impl Op {
    /// Post a tag send (`sync`: it ends once a receive matched it).
    ///
    /// # Safety
    /// A `Raw` buffer is memory of this process that stays allocated and unwritten until the
    /// operation ends (UCX's contract with its caller).
    pub unsafe fn send(w: &Worker, ep: EpId, buf: Buf, tag: u64, sync: bool) -> Op {
        let req = match buf {
            Buf::Raw { addr, len, info } => {
                // SAFETY: the caller's promise, which is `RawBuf::new`'s contract; `info` is the
                // classification of the memory type cache (`crate::memtype`, UCX's contract).
                let raw = unsafe { RawBuf::new(addr, len, info) };
                Req::Raw(if sync {
                    w.tag_send_sync_owned(ep, raw, tag)
                } else {
                    w.tag_send_owned(ep, raw, tag)
                })
            }
            Buf::Owned(v) => Req::Owned(if sync {
                w.tag_send_sync_owned(ep, v, tag)
            } else {
                w.tag_send_owned(ep, v, tag)
            }),
        };
        Op { req, send: true }
    }

    /// Post a tag receive.
    ///
    /// # Safety
    /// A `Raw` buffer is memory of this process that stays allocated, and that nothing else
    /// reads or writes, until the operation ends (UCX's contract with its caller).
    pub unsafe fn recv(w: &Worker, buf: Buf, tag: u64, mask: u64) -> Op {
        let req = match buf {
            Buf::Raw { addr, len, info } => {
                // SAFETY: the caller's promise, which is `RawBuf::new`'s contract; `info` is the
                // classification of the memory type cache (`crate::memtype`, UCX's contract).
                let raw = unsafe { RawBuf::new(addr, len, info) };
                Req::Raw(w.tag_recv_owned(raw, tag, mask))
            }
            Buf::Owned(v) => Req::Owned(w.tag_recv_owned(v, tag, mask)),
        };
        Op { req, send: false }
    }

    /// True once the operation ended.
    pub fn poll(&mut self) -> bool {
        match &self.req {
            Req::Raw(r) => r.is_done(),
            Req::Owned(r) => r.is_done(),
        }
    }

    /// Cancel a receive that has not matched; true when it was canceled.
    pub fn cancel(&self, w: &Worker) -> bool {
        match &self.req {
            Req::Raw(r) => r.cancel(w),
            Req::Owned(r) => r.cancel(w),
        }
    }

    pub fn is_send(&self) -> bool {
        self.send
    }

    /// The result of an ended operation, and our buffer back.
    pub fn take(self) -> (Result<Completion>, Option<Vec<u8>>) {
        match self.req {
            Req::Raw(r) => match r.try_take() {
                Ok((res, _)) => (res, None),
                Err(_) => (
                    Err(rucx_ucs::Error::Internal(
                        "operation taken before it ended".into(),
                    )),
                    None,
                ),
            },
            Req::Owned(r) => match r.try_take() {
                Ok((res, v)) => (res, Some(v)),
                Err(_) => (
                    Err(rucx_ucs::Error::Internal(
                        "operation taken before it ended".into(),
                    )),
                    None,
                ),
            },
        }
    }
}
