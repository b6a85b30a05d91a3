//! Memory a value owns at a fixed address, and borrowed views of it.
//!
//! [`Memory`] is what a buffer type implements so that rucx can take it by reference, borrow
//! checked like a host slice: host bytes (`[u8]`, `[u8; N]`, `Vec<u8>`) implement it here, and
//! the GPU buffers of `rucx-cuda` (device, stream-ordered pool, managed, pinned host) implement it
//! there. The protocol layer turns a `&T` into a send buffer and a `&mut T` into a receive
//! buffer, and a sub-range into either through [`MemRef`] and [`MemMut`]:
//!
//! ```
//! use rucx_ucs::{MemInfo, Memory, MemoryType};
//!
//! let mut v = vec![0u8; 64];
//! let whole = v.mem_ref();
//! assert_eq!((whole.len(), whole.info()), (64, Some(MemInfo::HOST)));
//! let tail = v.slice_mut(48..);
//! assert_eq!(tail.len(), 16);
//! assert_eq!(tail.info().map(|i| i.mem_type), Some(MemoryType::Host));
//! assert!(v.try_slice(60..70).is_err());
//! ```
//!
//! The layering: this crate (the bottom of the stack) holds the trait and the views, `rucx-cuda`
//! implements it for its buffers (it already depends on this crate), and `rucx-ucp` converts the
//! views into its `SendBuf`/`RecvBuf`. Neither of the two upper crates depends on the other.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use crate::error::{Error, Result};
use crate::memtype_cache::MemInfo;

/// A contiguous range of memory (host or GPU) that a value owns, or borrows for its whole
/// lifetime, at a fixed address.
///
/// Implement it for a buffer type to hand that type to sends and receives without `unsafe`:
/// `&buf` becomes a send buffer, `&mut buf` a receive buffer, and
/// [`slice`](Memory::slice)/[`slice_mut`](Memory::slice_mut) give a sub-range.
///
/// # Safety
/// rucx reads and writes the range by address behind the borrow checker's back, relying on
/// these promises for every implementation:
/// - `mem_addr()..mem_addr()+mem_len()` is memory of this process (host, or a GPU's under
///   unified addressing) that stays allocated at that address as long as the value is borrowed;
/// - while a shared borrow of the value is alive, nothing writes the range through it (no
///   interior mutability of the bytes: writes take `&mut self`);
/// - while a mutable borrow is alive, nothing else reads or writes the range;
/// - [`mem_addr_mut`](Memory::mem_addr_mut) returns the same address as `mem_addr`, derived
///   from the mutable borrow (for host memory, a pointer that may be written through);
/// - [`mem_info`](Memory::mem_info), when `Some`, is the true memory type and owning device of
///   every byte of the range.
pub unsafe trait Memory {
    /// Start address (valid for reading while `self` is borrowed).
    fn mem_addr(&self) -> usize;

    /// Start address, valid for writing while `self` is mutably borrowed.
    fn mem_addr_mut(&mut self) -> usize;

    /// Length in bytes.
    fn mem_len(&self) -> usize;

    /// Memory type and owning device when the type knows them; `None` lets rucx classify the
    /// address (a driver call, cached).
    fn mem_info(&self) -> Option<MemInfo> {
        None
    }

    /// The whole range, borrowed shared (for sending).
    fn mem_ref(&self) -> MemRef<'_> {
        MemRef {
            addr: self.mem_addr(),
            len: self.mem_len(),
            info: self.mem_info(),
            _borrow: PhantomData,
        }
    }

    /// The whole range, borrowed mutably (for receiving).
    fn mem_mut(&mut self) -> MemMut<'_> {
        let (len, info) = (self.mem_len(), self.mem_info());
        MemMut {
            addr: self.mem_addr_mut(),
            len,
            info,
            _borrow: PhantomData,
        }
    }

    /// A sub-range, borrowed shared. Panics when the range does not fit, as slice indexing
    /// does; [`try_slice`](Memory::try_slice) returns an error instead.
    fn slice(&self, range: impl RangeBounds<usize>) -> MemRef<'_> {
        self.mem_ref().slice(range)
    }

    /// A sub-range, borrowed mutably. Panics when the range does not fit.
    fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> MemMut<'_> {
        self.mem_mut().slice(range)
    }

    /// A sub-range, borrowed shared, or [`Error::InvalidParam`] when it does not fit.
    fn try_slice(&self, range: impl RangeBounds<usize>) -> Result<MemRef<'_>> {
        self.mem_ref().try_slice(range)
    }

    /// A sub-range, borrowed mutably, or [`Error::InvalidParam`] when it does not fit.
    fn try_slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<MemMut<'_>> {
        self.mem_mut().try_slice(range)
    }
}

/// Resolve `range` against a length `len` into `(start, end)`.
fn resolve(range: &impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    // Wide enough that `x + 1` never overflows; the error names the range as a half-open one.
    let start: u128 = match range.start_bound() {
        Bound::Included(&s) => s as u128,
        Bound::Excluded(&s) => s as u128 + 1,
        Bound::Unbounded => 0,
    };
    let end: u128 = match range.end_bound() {
        Bound::Included(&e) => e as u128 + 1,
        Bound::Excluded(&e) => e as u128,
        Bound::Unbounded => len as u128,
    };
    if start <= end && end <= len as u128 {
        // Both fit in usize: they are at most `len`.
        Ok((start as usize, end as usize))
    } else {
        Err(Error::InvalidParam(format!(
            "range {start}..{end} does not fit in a buffer of {len} bytes"
        )))
    }
}

/// A shared borrow of a [`Memory`] range (or a sub-range of it) for `'a`: what a send reads.
#[derive(Clone, Copy)]
pub struct MemRef<'a> {
    addr: usize,
    len: usize,
    info: Option<MemInfo>,
    _borrow: PhantomData<&'a [u8]>,
}

/// A mutable borrow of a [`Memory`] range (or a sub-range of it) for `'a`: what a receive
/// writes.
pub struct MemMut<'a> {
    addr: usize,
    len: usize,
    info: Option<MemInfo>,
    _borrow: PhantomData<&'a mut [u8]>,
}

macro_rules! view_methods {
    () => {
        /// Start address.
        pub fn addr(&self) -> usize {
            self.addr
        }

        /// Length in bytes.
        pub fn len(&self) -> usize {
            self.len
        }

        /// True for an empty range.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// Memory type and owning device, when the buffer type knows them.
        pub fn info(&self) -> Option<MemInfo> {
            self.info
        }

        /// A sub-range of this view, or [`Error::InvalidParam`] when it does not fit.
        pub fn try_slice(self, range: impl RangeBounds<usize>) -> Result<Self> {
            let (s, e) = resolve(&range, self.len)?;
            Ok(Self {
                addr: self.addr + s,
                len: e - s,
                info: self.info,
                _borrow: PhantomData,
            })
        }

        /// A sub-range of this view; panics when it does not fit, as slice indexing does.
        pub fn slice(self, range: impl RangeBounds<usize>) -> Self {
            match self.try_slice(range) {
                Ok(v) => v,
                Err(e) => panic!("{e}"),
            }
        }

        /// Two views, of `..mid` and `mid..` (like `split_at_mut` for a mutable view: two
        /// disjoint borrows, e.g. two receives into one buffer), or [`Error::InvalidParam`]
        /// when `mid` is past the end.
        pub fn try_split_at(self, mid: usize) -> Result<(Self, Self)> {
            resolve(&(..mid), self.len)?;
            let head = Self {
                addr: self.addr,
                len: mid,
                info: self.info,
                _borrow: PhantomData,
            };
            let tail = Self {
                addr: self.addr + mid,
                len: self.len - mid,
                info: self.info,
                _borrow: PhantomData,
            };
            Ok((head, tail))
        }

        /// [`try_split_at`](Self::try_split_at) that panics when `mid` is past the end.
        pub fn split_at(self, mid: usize) -> (Self, Self) {
            match self.try_split_at(mid) {
                Ok(v) => v,
                Err(e) => panic!("{e}"),
            }
        }
    };
}

impl<'a> MemRef<'a> {
    view_methods!();
}

impl<'a> MemMut<'a> {
    view_methods!();

    /// A shorter mutable borrow of the same range, leaving `self` usable afterwards.
    pub fn reborrow(&mut self) -> MemMut<'_> {
        MemMut {
            addr: self.addr,
            len: self.len,
            info: self.info,
            _borrow: PhantomData,
        }
    }

    /// Give up write access: the same range, borrowed shared for the rest of `'a`.
    pub fn into_ref(self) -> MemRef<'a> {
        MemRef {
            addr: self.addr,
            len: self.len,
            info: self.info,
            _borrow: PhantomData,
        }
    }
}

impl fmt::Debug for MemRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemRef")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("info", &self.info)
            .finish()
    }
}

impl fmt::Debug for MemMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemMut")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("info", &self.info)
            .finish()
    }
}

// SAFETY: a slice is host memory that lives as long as the borrow; `&[u8]` forbids writes and
// `&mut [u8]` gives exclusive access; `as_mut_ptr` derives from the mutable borrow.
unsafe impl Memory for [u8] {
    fn mem_addr(&self) -> usize {
        self.as_ptr() as usize
    }
    fn mem_addr_mut(&mut self) -> usize {
        self.as_mut_ptr() as usize
    }
    fn mem_len(&self) -> usize {
        self.len()
    }
    fn mem_info(&self) -> Option<MemInfo> {
        Some(MemInfo::HOST)
    }
}

// SAFETY: as for `[u8]`; an array is stored inline and cannot move while borrowed.
unsafe impl<const N: usize> Memory for [u8; N] {
    fn mem_addr(&self) -> usize {
        self.as_ptr() as usize
    }
    fn mem_addr_mut(&mut self) -> usize {
        self.as_mut_ptr() as usize
    }
    fn mem_len(&self) -> usize {
        N
    }
    fn mem_info(&self) -> Option<MemInfo> {
        Some(MemInfo::HOST)
    }
}

// SAFETY: as for `[u8]`; a borrowed `Vec` cannot grow, shrink or reallocate, so its heap buffer
// stays put for the borrow.
unsafe impl Memory for Vec<u8> {
    fn mem_addr(&self) -> usize {
        self.as_ptr() as usize
    }
    fn mem_addr_mut(&mut self) -> usize {
        self.as_mut_ptr() as usize
    }
    fn mem_len(&self) -> usize {
        self.len()
    }
    fn mem_info(&self) -> Option<MemInfo> {
        Some(MemInfo::HOST)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memtype::MemoryType;

    /// A buffer type that does not know its memory type (like raw GPU memory would).
    struct Opaque(Vec<u8>);

    // SAFETY: delegates to the owned `Vec`, which satisfies the contract.
    unsafe impl Memory for Opaque {
        fn mem_addr(&self) -> usize {
            self.0.mem_addr()
        }
        fn mem_addr_mut(&mut self) -> usize {
            self.0.mem_addr_mut()
        }
        fn mem_len(&self) -> usize {
            self.0.len()
        }
    }

    #[test]
    fn host_buffers_describe_themselves() {
        let mut v = vec![7u8; 100];
        let base = v.as_ptr() as usize;
        let r = v.mem_ref();
        assert_eq!(
            (r.addr(), r.len(), r.info()),
            (base, 100, Some(MemInfo::HOST))
        );
        let m = v.mem_mut();
        assert_eq!((m.addr(), m.len()), (base, 100));
        let mut a = [0u8; 16];
        assert_eq!(a.mem_ref().len(), 16);
        assert_eq!(a.mem_mut().addr(), a.as_ptr() as usize);
        let s: &[u8] = &v[10..20];
        assert_eq!((s.mem_addr(), s.mem_len()), (base + 10, 10));
        let o = Opaque(vec![1; 8]);
        assert_eq!(o.mem_ref().info(), None);
        assert_eq!(o.slice(2..).len(), 6);
    }

    #[test]
    fn ranges_resolve_like_slice_indexing() {
        let v = vec![0u8; 10];
        let base = v.as_ptr() as usize;
        let cases: [(MemRef<'_>, usize, usize); 7] = [
            (v.slice(..), 0, 10),
            (v.slice(2..), 2, 8),
            (v.slice(..3), 0, 3),
            (v.slice(..=3), 0, 4),
            (v.slice(4..4), 4, 0),
            (v.slice(10..), 10, 0),
            (v.slice(1..=9), 1, 9),
        ];
        for (r, off, len) in cases {
            assert_eq!((r.addr() - base, r.len()), (off, len));
        }
        // Sub-ranges of sub-ranges add up.
        let r = v.slice(2..9).slice(1..3);
        assert_eq!((r.addr() - base, r.len()), (3, 2));
        let bounds = (Bound::Excluded(1), Bound::Included(4));
        assert_eq!(v.slice(bounds).addr() - base, 2);
        assert_eq!(v.slice(bounds).len(), 3);
    }

    #[test]
    fn ranges_that_do_not_fit_are_errors() {
        let mut v = vec![0u8; 10];
        for e in [
            v.try_slice(5..11).unwrap_err(),
            v.try_slice(11..).unwrap_err(),
            v.try_slice(..=10).unwrap_err(),
            v.try_slice(usize::MAX..).unwrap_err(),
            v.try_slice((Bound::Excluded(usize::MAX), Bound::Unbounded))
                .unwrap_err(),
            v.try_slice_mut(..=usize::MAX).unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidParam(_)), "{e:?}");
            assert!(e.to_string().contains("10 bytes"), "{e}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = v.try_slice(6..5).unwrap_err();
        assert!(backwards.to_string().contains("6..5"), "{backwards}");
    }

    #[test]
    #[should_panic(expected = "does not fit in a buffer of 4 bytes")]
    fn slice_panics_past_the_end() {
        let v = vec![0u8; 4];
        let _ = v.slice(2..5);
    }

    #[test]
    fn split_views_are_disjoint_and_cover_the_range() {
        let mut v = vec![0u8; 10];
        let base = v.as_ptr() as usize;
        let (a, b) = v.slice_mut(2..).split_at(3);
        assert_eq!((a.addr() - base, a.len()), (2, 3));
        assert_eq!((b.addr() - base, b.len()), (5, 5));
        let (a, b) = v.mem_ref().split_at(10);
        assert_eq!((a.len(), b.len(), b.addr() - base), (10, 0, 10));
        assert!(v.mem_mut().try_split_at(11).is_err());
        // Both halves of a mutable view are usable at once.
        let (x, y) = v.mem_mut().split_at(4);
        let all = [x, y];
        assert_eq!(all.iter().map(MemMut::len).sum::<usize>(), 10);
    }

    #[test]
    fn mutable_views_reborrow_and_downgrade() {
        let mut v = vec![0u8; 32];
        let base = v.as_ptr() as usize;
        let mut m = v.slice_mut(8..24);
        {
            let r = m.reborrow().slice(4..);
            assert_eq!((r.addr() - base, r.len()), (12, 12));
        }
        let shared = m.into_ref();
        assert_eq!((shared.addr() - base, shared.len()), (8, 16));
        assert_eq!(shared.info().map(|i| i.mem_type), Some(MemoryType::Host));
        assert!(format!("{shared:?}").contains("len: 16"));
    }
}
