//! IOV datatypes (`ucp_dt_make_iov()`, `UCP_DATATYPE_IOV`): the buffer is an array of `count`
//! `ucp_dt_iov_t {void *buffer; size_t length;}` entries, the message their bytes in order.
//!
//! Served off the contiguous path, in every call that takes a datatype (tag, stream, active
//! messages):
//! - an IOV with at most one non-empty entry is that entry's memory, taken as a contiguous
//!   buffer (no copy; GPU memory too, through rucx's paths, except for a matched-message
//!   receive, whose copy out of the probed message is a CPU copy for every datatype);
//! - with several non-empty entries, a send gathers them into a buffer of ours (one copy) and
//!   a receive lands in a buffer of ours that is scattered over the entries when it ends,
//!   in order, never past an entry: a message longer than the entries' total fills them and
//!   ends with `UCS_ERR_MESSAGE_TRUNCATED`. Those copies are CPU copies, so every entry must
//!   be host memory: an entry in GPU memory is refused with `UCS_ERR_UNSUPPORTED` (and a
//!   warning naming it).
//!
//! Entries of length 0 are skipped (their buffer may be NULL); a NULL array with `count > 0`,
//! or a NULL buffer with a length, is `UCS_ERR_INVALID_PARAM`. Lengths reported (receive
//! information, stream and active-message lengths) are bytes, as UCX reports them.

use std::ffi::c_void;

use crate::types::*;
use crate::worker::AbiWorker;

/// One entry of an IOV buffer (`ucp_dt_iov_t`).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct DtIov {
    pub buffer: *mut c_void,
    pub length: usize,
}

/// An IOV buffer, read: its non-empty entries (address, length) in order and their total.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iov {
    parts: Vec<(usize, usize)>,
    total: usize,
}

impl Iov {
    /// Read `count` entries at `entries`.
    ///
    /// # Safety
    /// `entries` NULL or `count` readable `ucp_dt_iov_t` (for the call: the entries are copied).
    pub unsafe fn read(entries: *const DtIov, count: usize) -> Result<Iov, Status> {
        if count == 0 {
            return Ok(Iov {
                parts: Vec::new(),
                total: 0,
            });
        }
        if entries.is_null()
            || count
                .checked_mul(size_of::<DtIov>())
                .is_none_or(|n| n > isize::MAX as usize)
        {
            return Err(UCS_ERR_INVALID_PARAM);
        }
        // SAFETY: the caller's promise: `count` readable entries (non-NULL, checked).
        let all = unsafe { std::slice::from_raw_parts(entries, count) };
        let mut parts = Vec::with_capacity(count.min(64));
        let mut total = 0usize;
        for e in all.iter().filter(|e| e.length > 0) {
            if e.buffer.is_null() {
                return Err(UCS_ERR_INVALID_PARAM);
            }
            total = total
                .checked_add(e.length)
                .filter(|t| *t <= isize::MAX as usize)
                .ok_or(UCS_ERR_INVALID_PARAM)?;
            parts.push((e.buffer as usize, e.length));
        }
        Ok(Iov { parts, total })
    }

    /// The bytes of all entries.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The one piece of memory this IOV is, when it has at most one non-empty entry (an empty
    /// one: address 0, length 0).
    pub fn single(&self) -> Option<(usize, usize)> {
        match self.parts.as_slice() {
            [] => Some((0, 0)),
            [p] => Some(*p),
            _ => None,
        }
    }

    /// Every entry is host memory (the copies of [`Iov::gather`] and [`Iov::scatter`] are
    /// CPU copies): else `UCS_ERR_UNSUPPORTED`, with a warning.
    pub fn check_host(&self, w: &AbiWorker) -> Result<(), Status> {
        self.check_host_by(|addr, len| crate::tag::host_hint(w, addr, len))
    }

    /// [`Iov::check_host`] with the entries' memory types told by `class` (`None`: not
    /// classified, refused too).
    fn check_host_by(
        &self,
        class: impl Fn(usize, usize) -> Option<rucx_ucs::MemInfo>,
    ) -> Result<(), Status> {
        for (i, &(addr, len)) in self.parts.iter().enumerate() {
            match class(addr, len) {
                Some(m) if m.mem_type == rucx_ucs::MemoryType::Host => {}
                m => {
                    tracing::warn!(
                        "IOV datatype: entry {i} ({addr:#x}, {len} bytes) is not host memory \
                         ({m:?}); IOV entries in GPU memory are served only as the one \
                         non-empty entry: UCS_ERR_UNSUPPORTED"
                    );
                    return Err(UCS_ERR_UNSUPPORTED);
                }
            }
        }
        Ok(())
    }

    /// The entries' bytes in one buffer of ours.
    ///
    /// # Safety
    /// Every entry is readable host memory (the caller's promise, [`Iov::check_host`]).
    pub unsafe fn gather(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.total);
        for &(addr, len) in &self.parts {
            // SAFETY: the caller's promise: `len` readable bytes of host memory at `addr`.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
        }
        out
    }

    /// Write `data` over the entries in order (what does not fit is dropped); the bytes
    /// written.
    ///
    /// # Safety
    /// Every entry is writable host memory, not overlapping `data`.
    pub unsafe fn scatter(&self, data: &[u8]) -> usize {
        let mut off = 0;
        for &(addr, len) in &self.parts {
            if off == data.len() {
                break;
            }
            let k = len.min(data.len() - off);
            // SAFETY: the caller's promise: `len >= k` writable bytes at `addr`, apart from
            // `data`, which holds `k` bytes from `off`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(off), addr as *mut u8, k) };
            off += k;
        }
        off
    }
}

/// How an IOV buffer is taken by an operation.
#[derive(Debug)]
pub enum Plan {
    /// As one contiguous piece of the caller's memory (at most one non-empty entry).
    Direct(usize, usize),
    /// Through a buffer of ours (gathered for a send; for a receive, zeroed, to scatter).
    Bounce(Iov, Vec<u8>),
}

/// Read an IOV buffer and plan it for a send (`send`) or a receive.
///
/// # Safety
/// `entries` NULL or `count` readable entries, whose memory stays valid (UCX's contract) until
/// the operation ends.
#[cold]
pub unsafe fn plan(
    w: &AbiWorker,
    entries: *const c_void,
    count: usize,
    send: bool,
) -> Result<Plan, Status> {
    // SAFETY: the caller's promise.
    let iov = unsafe { Iov::read(entries.cast(), count) }?;
    if let Some((addr, len)) = iov.single() {
        return Ok(Plan::Direct(addr, len));
    }
    iov.check_host(w)?;
    let buf = if send {
        // SAFETY: host memory (checked), readable by the caller's promise.
        unsafe { iov.gather() }
    } else {
        vec![0u8; iov.total]
    };
    Ok(Plan::Bounce(iov, buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entries(v: &mut [Vec<u8>]) -> Vec<DtIov> {
        v.iter_mut()
            .map(|b| DtIov {
                buffer: if b.is_empty() {
                    std::ptr::null_mut()
                } else {
                    b.as_mut_ptr().cast()
                },
                length: b.len(),
            })
            .collect()
    }

    #[test]
    fn the_layout_is_ucx_s() {
        assert_eq!(size_of::<DtIov>(), 16);
        assert_eq!(std::mem::offset_of!(DtIov, length), 8);
    }

    #[test]
    fn bad_arrays_are_refused() {
        // SAFETY: NULL arrays and entries, never dereferenced when refused.
        unsafe {
            assert_eq!(
                Iov::read(std::ptr::null(), 2).unwrap_err(),
                UCS_ERR_INVALID_PARAM
            );
            assert_eq!(
                Iov::read(std::ptr::null(), 0).unwrap().single(),
                Some((0, 0))
            );
            let e = [DtIov {
                buffer: std::ptr::null_mut(),
                length: 3,
            }];
            assert_eq!(Iov::read(e.as_ptr(), 1).unwrap_err(), UCS_ERR_INVALID_PARAM);
            let e = [
                DtIov {
                    buffer: 8 as *mut c_void,
                    length: usize::MAX,
                },
                DtIov {
                    buffer: 8 as *mut c_void,
                    length: 2,
                },
            ];
            assert_eq!(Iov::read(e.as_ptr(), 2).unwrap_err(), UCS_ERR_INVALID_PARAM);
        }
    }

    /// Several entries are copied by the CPU: one in GPU memory (or not classified) refuses
    /// the IOV; all in host memory pass. (No GPU here: the memory types are told.)
    #[test]
    fn an_entry_not_in_host_memory_is_refused() {
        use rucx_ucs::{MemInfo, MemoryType};
        let mut bufs = vec![vec![1u8; 8], vec![], vec![2u8; 8], vec![3u8; 8]];
        let e = entries(&mut bufs);
        // SAFETY: live entries.
        let iov = unsafe { Iov::read(e.as_ptr(), e.len()) }.unwrap();
        assert_eq!(iov.single(), None);
        let gpu_at = bufs[2].as_ptr() as usize;
        let gpu = MemInfo {
            mem_type: MemoryType::Cuda,
            device: Some(0),
        };
        assert_eq!(iov.check_host_by(|_, _| Some(MemInfo::HOST)), Ok(()));
        for (tell, what) in [
            (Some(gpu), "GPU"),
            (
                Some(MemInfo {
                    mem_type: MemoryType::CudaManaged,
                    device: Some(0),
                }),
                "managed",
            ),
            (None, "not classified"),
        ] {
            let got = iov.check_host_by(|a, _| {
                if a == gpu_at {
                    tell
                } else {
                    Some(MemInfo::HOST)
                }
            });
            assert_eq!(got, Err(UCS_ERR_UNSUPPORTED), "{what}");
        }
    }

    #[test]
    fn zero_length_entries_are_skipped_and_one_piece_is_direct() {
        let mut bufs = vec![vec![], vec![7u8; 5], vec![]];
        let e = entries(&mut bufs);
        // SAFETY: live entries.
        let iov = unsafe { Iov::read(e.as_ptr(), e.len()) }.unwrap();
        assert_eq!(iov.single(), Some((bufs[1].as_ptr() as usize, 5)));
        assert_eq!(iov.total(), 5);
    }

    proptest! {
        /// Gathering any split of a message gives the message; scattering it (or a prefix, or
        /// a longer one) over any split writes it in order and nothing past the entries.
        #[test]
        fn gather_and_scatter_any_split(
            msg in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(0usize..300, 0..8),
            extra in 0usize..40,
            short in 0usize..40,
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(msg.len())).collect();
            cuts.sort_unstable();
            let mut bufs = Vec::new();
            let mut prev = 0;
            for c in cuts.iter().copied().chain([msg.len()]) {
                bufs.push(msg[prev..c].to_vec());
                prev = c;
            }
            let e = entries(&mut bufs);
            // SAFETY: live entries over host memory.
            let iov = unsafe { Iov::read(e.as_ptr(), e.len()) }.unwrap();
            prop_assert_eq!(iov.total(), msg.len());
            // SAFETY: as above.
            prop_assert_eq!(unsafe { iov.gather() }, msg.clone());

            // Receive: the same split, guarded so that a write past any entry shows.
            let mut dst: Vec<Vec<u8>> = bufs.iter().map(|b| vec![0xa5; b.len() + 2]).collect();
            let de: Vec<DtIov> = dst
                .iter_mut()
                .zip(&bufs)
                .map(|(d, b)| DtIov { buffer: d.as_mut_ptr().cast(), length: b.len() })
                .collect();
            // SAFETY: live entries.
            let rx = unsafe { Iov::read(de.as_ptr(), de.len()) }.unwrap();
            let mut incoming = msg.clone();
            incoming.extend(std::iter::repeat_n(0x5a, extra));
            let n = short.min(incoming.len());
            let incoming = if short % 2 == 0 { &incoming[..] } else { &incoming[..n] };
            // SAFETY: live host entries, apart from `incoming`.
            let wrote = unsafe { rx.scatter(incoming) };
            prop_assert_eq!(wrote, incoming.len().min(msg.len()));
            let mut got = Vec::new();
            for (d, b) in dst.iter().zip(&bufs) {
                prop_assert_eq!(&d[b.len()..], &[0xa5, 0xa5][..], "nothing past an entry");
                got.extend_from_slice(&d[..b.len()]);
            }
            prop_assert_eq!(&got[..wrote], &msg[..wrote]);
            prop_assert!(got[wrote..].iter().all(|b| *b == 0xa5));
        }
    }
}
