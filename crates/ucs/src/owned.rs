//! Buffers a request may own: handed to rucx by value, kept past any scope, and handed back
//! when the request ends.
//!
//! [`Memory`] describes memory *borrowed* for a scope; [`OwnedBuf`] (send) and [`OwnedBufMut`]
//! (receive) describe a buffer *value* whose bytes stay where they are when the value moves,
//! so a request can keep the value (in the worker, in a future, in a callback) and write or read
//! the bytes by address until it gives the value back. Implemented here for `Vec<u8>`,
//! `Box<[u8]>`, [`bytes::Bytes`] (send only: it is shared and immutable), [`bytes::BytesMut`]
//! and [`RawBuf`] (memory by address, for FFI callers); `rucx-cuda` implements them for its
//! GPU buffers.
//!
//! ```
//! use rucx_ucs::{MemInfo, OwnedBuf, OwnedBufMut};
//!
//! let mut v = vec![0u8; 64];
//! let addr = v.owned_mut().addr();
//! let moved = v; // the value moves, its bytes do not
//! assert_eq!(moved.owned_ref().addr(), addr);
//! assert_eq!(moved.owned_ref().info(), Some(MemInfo::HOST));
//! ```

use crate::memory::{MemMut, MemRef, Memory};
use crate::memtype_cache::MemInfo;

/// A buffer value a send request can own (it may outlive any scope).
///
/// # Safety
/// rucx reads the range by address while it holds the value, relying on these promises:
/// - `owned_ref()` describes memory of this process (host, or a GPU's under unified
///   addressing) that the value owns, or shares read-only, in an allocation of its own: moving
///   the value does not move the bytes, and they stay allocated until the value is dropped;
/// - every call returns the same range while nobody has `&mut` access to the value;
/// - nothing writes the range while rucx holds the value (clones of a shared buffer included);
/// - the [`MemInfo`] of the view, when `Some`, is the true memory type and owning device.
pub unsafe trait OwnedBuf: Send + 'static {
    /// The bytes to send.
    fn owned_ref(&self) -> MemRef<'_>;
}

/// A buffer value a receive request can own: [`OwnedBuf`] that rucx may also write.
///
/// # Safety
/// As [`OwnedBuf`], and: `owned_mut()` returns the same range as `owned_ref()`, writable
/// through the address it carries, and nothing else reads or writes the range while rucx holds
/// the value.
pub unsafe trait OwnedBufMut: OwnedBuf {
    /// The bytes to receive into.
    fn owned_mut(&mut self) -> MemMut<'_>;
}

// SAFETY: a vector's bytes live in its heap allocation, which moving the vector does not move;
// rucx holds the vector by value, so nobody else can reach (or grow) it meanwhile.
unsafe impl OwnedBuf for Vec<u8> {
    fn owned_ref(&self) -> MemRef<'_> {
        self.mem_ref()
    }
}

// SAFETY: as for `OwnedBuf`; `mem_mut` derives the address from the mutable borrow.
unsafe impl OwnedBufMut for Vec<u8> {
    fn owned_mut(&mut self) -> MemMut<'_> {
        self.mem_mut()
    }
}

// SAFETY: as for `Vec<u8>`: the boxed slice is a heap allocation of its own.
unsafe impl OwnedBuf for Box<[u8]> {
    fn owned_ref(&self) -> MemRef<'_> {
        (**self).mem_ref()
    }
}

// SAFETY: as for `Vec<u8>`.
unsafe impl OwnedBufMut for Box<[u8]> {
    fn owned_mut(&mut self) -> MemMut<'_> {
        (**self).mem_mut()
    }
}

// SAFETY: `Bytes` points at an immutable allocation (heap, or static) that every clone shares
// read-only and that lives as long as any clone; moving the handle does not move the bytes.
// No `OwnedBufMut`: the bytes may be shared.
unsafe impl OwnedBuf for bytes::Bytes {
    fn owned_ref(&self) -> MemRef<'_> {
        (**self).mem_ref()
    }
}

// SAFETY: `BytesMut` uniquely owns the view of its heap allocation (other `BytesMut` split off
// it cover disjoint ranges); rucx holds it by value, so it cannot be grown (reallocated)
// meanwhile, and moving the handle does not move the bytes.
unsafe impl OwnedBuf for bytes::BytesMut {
    fn owned_ref(&self) -> MemRef<'_> {
        (**self).mem_ref()
    }
}

// SAFETY: as for `OwnedBuf`; `DerefMut` gives the unique mutable view.
unsafe impl OwnedBufMut for bytes::BytesMut {
    fn owned_mut(&mut self) -> MemMut<'_> {
        (**self).mem_mut()
    }
}

/// Memory of any type described by address, length and, when known, its memory type and
/// device: for callers that hold a pointer rather than a Rust buffer (the C ABI, memory from
/// another allocator). The value does not own the memory; dropping it frees nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawBuf {
    addr: usize,
    len: usize,
    info: Option<MemInfo>,
}

impl RawBuf {
    /// Describe `len` bytes at `addr`; `info` gives their memory type and device (`None`:
    /// rucx classifies the address through the memory domains that can detect it).
    ///
    /// # Safety
    /// From this call until a request that took the value hands it back (it completes,
    /// fails, is canceled, or its worker is dropped; the value comes back through `wait`, the
    /// future or the completion callback), or until the value is dropped unused:
    /// - `addr..addr+len` is memory of this process (host, or a GPU's under unified
    ///   addressing) that stays allocated;
    /// - sent from, nothing writes it; received into, nothing else reads or writes it;
    /// - `info`, when `Some`, is the true memory type and owning device of every byte.
    ///
    /// A request that was handed back has stopped touching the memory for good: the caller
    /// may then free or reuse it.
    pub unsafe fn new(addr: usize, len: usize, info: Option<MemInfo>) -> RawBuf {
        RawBuf { addr, len, info }
    }

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

    /// Memory type and device, when the caller gave them.
    pub fn info(&self) -> Option<MemInfo> {
        self.info
    }
}

// SAFETY: the range is valid, unwritten by others (sends) or unaliased (receives), and of the
// stated type, for as long as the value is alive or held by a request: the contract of
// `RawBuf::new`, which the caller accepted; the address is the same for both borrows.
unsafe impl Memory for RawBuf {
    fn mem_addr(&self) -> usize {
        self.addr
    }
    fn mem_addr_mut(&mut self) -> usize {
        self.addr
    }
    fn mem_len(&self) -> usize {
        self.len
    }
    fn mem_info(&self) -> Option<MemInfo> {
        self.info
    }
}

// SAFETY: the contract of `RawBuf::new`: the memory stays where it is, untouched by others,
// until the value is handed back; the value itself is three plain numbers.
unsafe impl OwnedBuf for RawBuf {
    fn owned_ref(&self) -> MemRef<'_> {
        self.mem_ref()
    }
}

// SAFETY: as for `OwnedBuf`, with the receive half of `RawBuf::new`'s contract.
unsafe impl OwnedBufMut for RawBuf {
    fn owned_mut(&mut self) -> MemMut<'_> {
        self.mem_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memtype::MemoryType;

    fn moved<T>(v: T) -> T {
        v
    }

    #[test]
    fn the_bytes_stay_put_when_the_value_moves() {
        let v = vec![5u8; 100];
        let (a, l) = (v.owned_ref().addr(), v.owned_ref().len());
        let v = moved(Box::new(v));
        assert_eq!((v.owned_ref().addr(), v.owned_ref().len()), (a, l));

        let mut b: Box<[u8]> = vec![1u8; 10].into_boxed_slice();
        let a = b.owned_mut().addr();
        let b = moved(b);
        assert_eq!(b.owned_ref().addr(), a);

        let by = bytes::Bytes::from(vec![3u8; 32]);
        let a = by.owned_ref().addr();
        let by = moved(by);
        assert_eq!((by.owned_ref().addr(), by.owned_ref().len()), (a, 32));

        let mut bm = bytes::BytesMut::zeroed(48);
        let a = bm.owned_mut().addr();
        let bm = moved(bm);
        assert_eq!((bm.owned_ref().addr(), bm.owned_ref().len()), (a, 48));
        assert_eq!(bm.owned_ref().info(), Some(MemInfo::HOST));
    }

    #[test]
    fn a_raw_buffer_carries_what_it_was_given() {
        let mut host = vec![0u8; 16];
        // SAFETY: `host` outlives `r` and is not touched while `r` exists.
        let mut r = unsafe { RawBuf::new(host.as_mut_ptr() as usize, 16, None) };
        assert_eq!(
            (r.addr(), r.len(), r.info()),
            (host.as_ptr() as usize, 16, None)
        );
        assert_eq!(r.owned_mut().addr(), r.owned_ref().addr());
        let gpu = Some(MemInfo::new(MemoryType::Cuda, Some(1)));
        // SAFETY: only described, never read or written.
        let g = unsafe { RawBuf::new(0x7000_0000, 4096, gpu) };
        assert_eq!(g.owned_ref().info(), gpu);
        assert!(!g.is_empty());
    }
}
