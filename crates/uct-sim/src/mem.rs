//! The only place where the sim touches memory through raw addresses.
//!
//! Every copy the sim makes goes through a [`Span`], and a span can only be made by the checks
//! in [`crate::fabric`]: a local span lies inside the registered region of the memory handle it
//! came with, a remote span inside the live registration a remote key names (and, for simulated
//! GPU memory, inside a range the test still marks as device memory). That check is the
//! tripwire for "nothing written past a receive buffer": a protocol that asks for one byte more
//! than it registered gets an error and a recorded violation instead of a silent overrun.

/// A checked range of this process's memory: `[addr, addr + len)`.
///
/// Made only by the fabric's checks (see the module docs); the fields are private to this
/// crate so no other code can forge one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    addr: usize,
    len: usize,
}

impl Span {
    /// A span over `[addr, addr + len)`.
    ///
    /// # Safety
    /// The range must be valid for reads and writes for as long as the span is used: it lies
    /// inside a live registration of this process (registrations are made through
    /// `MemoryDomain::mem_reg`, whose contract obliges the owner to keep the memory allocated
    /// and accessible while any clone of the handle, or a key made from it, lives), or inside
    /// a slice the caller holds mutably.
    pub(crate) unsafe fn checked(addr: usize, len: usize) -> Span {
        Span { addr, len }
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The part `[off, off + len)` of this span (panics when it is not inside: a sim bug).
    pub(crate) fn sub(&self, off: usize, len: usize) -> Span {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "sim: sub-span {off}+{len} of a {}-byte span",
            self.len
        );
        Span {
            addr: self.addr + off,
            len,
        }
    }
}

/// Copy `src` to `dst` (same length; the ranges may overlap).
pub(crate) fn copy(src: Span, dst: Span) {
    assert_eq!(
        src.len, dst.len,
        "sim copy between spans of different lengths"
    );
    if src.len == 0 {
        return;
    }
    // SAFETY: a span can only be made through `Span::checked`, whose contract is that the range
    // is valid for reads and writes while the span is used (the fabric makes them only after
    // checking the range against a live registration); `ptr::copy` tolerates overlap.
    unsafe { std::ptr::copy(src.addr as *const u8, dst.addr as *mut u8, src.len) }
}

/// Append the bytes of `src` to `out`.
pub(crate) fn read_into(src: Span, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + src.len, 0);
    // SAFETY: `out[start..]` is a slice of exactly `src.len` bytes that we hold mutably.
    let dst = unsafe { Span::checked(out[start..].as_mut_ptr() as usize, src.len) };
    copy(src, dst);
}

/// Write `data` to `dst` (same length).
pub(crate) fn write_from(data: &[u8], dst: Span) {
    // SAFETY: `data` is a live slice; `copy` only reads through the source span.
    let src = unsafe { Span::checked(data.as_ptr() as usize, data.len()) };
    copy(src, dst);
}
