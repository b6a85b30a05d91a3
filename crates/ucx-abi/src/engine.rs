//! The rucx side of an operation posted through the C ABI: a queued request of the rucx worker
//! ([`Worker::tag_send_queued`], [`Worker::tag_recv_queued`]), which allocates nothing and whose
//! end the worker queues with the ABI's token, so that progress looks only at what ended. Its
//! memory is the C caller's (by address, valid until the operation ends by UCX's contract) or a
//! buffer of ours (generic datatypes, probed messages), kept by the ABI with the operation.

use rucx_ucp::{EpId, Queued, RawBuf, Worker};
use rucx_ucs::MemInfo;

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

impl Buf {
    /// The memory as rucx takes it.
    ///
    /// # Safety
    /// A `Raw` buffer is memory of this process that stays allocated (and, sent from,
    /// unwritten; received into, untouched by anyone else) until the operation ends (UCX's
    /// contract with its caller); an `Owned` one is kept, unmoved and untouched, by the ABI
    /// until then (its bytes live in the vector's heap allocation, which moving the vector
    /// does not move).
    #[inline(always)]
    unsafe fn raw(&mut self) -> RawBuf {
        match self {
            // SAFETY: the caller's promise, which is `RawBuf::new`'s contract; `info` is the
            // classification of the memory type cache (`crate::memtype`, UCX's contract).
            Buf::Raw { addr, len, info } => unsafe { RawBuf::new(*addr, *len, *info) },
            // SAFETY: host memory of ours, kept as the contract above says.
            Buf::Owned(v) => unsafe {
                RawBuf::new(v.as_mut_ptr() as usize, v.len(), Some(MemInfo::HOST))
            },
        }
    }
}

/// Post a tag send (`sync`: it ends once a receive matched it) whose end is queued with
/// `token`.
///
/// # Safety
/// As for [`Buf::raw`].
#[inline(always)]
pub unsafe fn send(
    w: &Worker,
    ep: EpId,
    buf: &mut Buf,
    tag: u64,
    sync: bool,
    token: u64,
) -> Queued {
    // SAFETY: forwarded.
    let raw = unsafe { buf.raw() };
    w.tag_send_queued(ep, raw, tag, sync, token)
}

/// Post a tag receive whose end is queued with `token`.
///
/// # Safety
/// As for [`Buf::raw`].
#[inline(always)]
pub unsafe fn recv(w: &Worker, buf: &mut Buf, tag: u64, mask: u64, token: u64) -> Queued {
    // SAFETY: forwarded.
    let raw = unsafe { buf.raw() };
    w.tag_recv_queued(raw, tag, mask, token)
}
