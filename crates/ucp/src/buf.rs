//! Buffers handed to requests: anything that implements [`Memory`] (host slices and vectors,
//! the GPU buffers of `rucx-cuda`, a sub-range of either), borrowed like a slice, or memory of
//! any type by address (`from_raw`, unsafe).

use std::marker::PhantomData;

use rucx_ucs::{MemInfo, MemMut, MemRef, Memory, MemoryType};

/// A buffer to send from: `&buf` for any [`Memory`] (`&[u8]`, `&Vec<u8>`, `&DeviceBuffer`, ...),
/// a sub-range (`buf.slice(a..b)`), or [`from_raw`](Self::from_raw). It borrows the buffer
/// shared for as long as it lives (the request's scope), so the buffer cannot be written
/// meanwhile:
///
/// ```compile_fail,E0502
/// let mut v = vec![0u8; 8];
/// let s = rucx_ucp::SendBuf::from(&v);
/// v[0] = 1; // a write while the send borrows `v`
/// drop(s);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct SendBuf<'a> {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    /// Memory type and device, or `None` to classify the pointer.
    pub(crate) mem: Option<(MemoryType, Option<u32>)>,
    _p: PhantomData<&'a [u8]>,
}

/// A buffer to receive into: `&mut buf` for any [`Memory`], a sub-range
/// (`buf.slice_mut(a..b)`), or [`from_raw`](Self::from_raw). It borrows the buffer mutably for
/// as long as it lives, so nothing else reads or writes it meanwhile:
///
/// ```compile_fail,E0502
/// let mut v = vec![0u8; 8];
/// let r = rucx_ucp::RecvBuf::from(&mut v);
/// let first = v[0]; // a read while the receive borrows `v`
/// drop(r);
/// ```
#[derive(Debug)]
pub struct RecvBuf<'a> {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) mem: Option<(MemoryType, Option<u32>)>,
    _p: PhantomData<&'a mut [u8]>,
}

fn mem_pair(info: Option<MemInfo>) -> Option<(MemoryType, Option<u32>)> {
    info.map(|i| (i.mem_type, i.device))
}

impl<'a> From<MemRef<'a>> for SendBuf<'a> {
    fn from(m: MemRef<'a>) -> Self {
        SendBuf {
            addr: m.addr(),
            len: m.len(),
            mem: mem_pair(m.info()),
            _p: PhantomData,
        }
    }
}

impl<'a> From<MemMut<'a>> for SendBuf<'a> {
    fn from(m: MemMut<'a>) -> Self {
        SendBuf::from(m.into_ref())
    }
}

/// Any [`Memory`] borrowed shared: host slices (`&[u8]`, `&[u8; N]`, `&Vec<u8>`) and the GPU
/// buffers of `rucx-cuda` (`&DeviceBuffer`, `&PoolBuffer`, `&ManagedBuffer`,
/// `&PinnedHostBuffer`); a sub-range with [`Memory::slice`].
impl<'a, T: Memory + ?Sized> From<&'a T> for SendBuf<'a> {
    fn from(m: &'a T) -> Self {
        SendBuf::from(m.mem_ref())
    }
}

impl<'a> From<MemMut<'a>> for RecvBuf<'a> {
    fn from(m: MemMut<'a>) -> Self {
        RecvBuf {
            addr: m.addr(),
            len: m.len(),
            mem: mem_pair(m.info()),
            _p: PhantomData,
        }
    }
}

/// Any [`Memory`] borrowed mutably: `&mut [u8]`, `&mut Vec<u8>`, `&mut DeviceBuffer`, ...; a
/// sub-range with [`Memory::slice_mut`].
impl<'a, T: Memory + ?Sized> From<&'a mut T> for RecvBuf<'a> {
    fn from(m: &'a mut T) -> Self {
        RecvBuf::from(m.mem_mut())
    }
}

impl SendBuf<'_> {
    /// The memory of `r` (queued requests: the caller of [`rucx_ucs::RawBuf::new`] vouched
    /// for it until the request ends).
    #[inline]
    pub(crate) fn of_raw(r: &rucx_ucs::RawBuf) -> Self {
        SendBuf {
            addr: r.addr(),
            len: r.len(),
            mem: mem_pair(r.info()),
            _p: PhantomData,
        }
    }

    /// A buffer of any memory type (host, CUDA device, managed) by address; its type and
    /// owning GPU are classified by the memory domains that can detect them. Buffer types that
    /// implement [`Memory`] need none of this: pass `&buf` or `buf.slice(range)`.
    ///
    /// # Safety
    /// `addr..addr+len` must be memory of this process (host or GPU) that stays allocated and
    /// is not written by anyone for the lifetime `'a` of the buffer (the scope of the request).
    pub unsafe fn from_raw(addr: u64, len: usize) -> Self {
        SendBuf {
            addr: addr as usize,
            len,
            mem: None,
            _p: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl RecvBuf<'_> {
    /// The memory of `r`, as [`SendBuf::of_raw`].
    #[inline]
    pub(crate) fn of_raw(r: &rucx_ucs::RawBuf) -> Self {
        RecvBuf {
            addr: r.addr(),
            len: r.len(),
            mem: mem_pair(r.info()),
            _p: PhantomData,
        }
    }

    /// A buffer of any memory type by address, classified like [`SendBuf::from_raw`].
    ///
    /// # Safety
    /// `addr..addr+len` must be memory of this process that stays allocated, and is neither
    /// read nor written by anyone else, for the lifetime `'a` of the buffer.
    pub unsafe fn from_raw(addr: u64, len: usize) -> Self {
        RecvBuf {
            addr: addr as usize,
            len,
            mem: None,
            _p: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory that says it is device memory of GPU 3 (only its description is looked at).
    struct FakeGpu(Vec<u8>);

    // SAFETY: the bytes are the owned `Vec`'s (which satisfies the contract); the memory type
    // is false, but nothing here moves data through these buffers.
    unsafe impl Memory for FakeGpu {
        fn mem_addr(&self) -> usize {
            self.0.as_ptr() as usize
        }
        fn mem_addr_mut(&mut self) -> usize {
            self.0.as_mut_ptr() as usize
        }
        fn mem_len(&self) -> usize {
            self.0.len()
        }
        fn mem_info(&self) -> Option<MemInfo> {
            Some(MemInfo::new(MemoryType::Cuda, Some(3)))
        }
    }

    fn send<'a>(b: impl Into<SendBuf<'a>>) -> SendBuf<'a> {
        b.into()
    }

    fn recv<'a>(b: impl Into<RecvBuf<'a>>) -> RecvBuf<'a> {
        b.into()
    }

    const HOST: Option<(MemoryType, Option<u32>)> = Some((MemoryType::Host, None));

    #[test]
    fn host_buffers_convert_as_before() {
        let mut v = vec![1u8; 64];
        let base = v.as_ptr() as usize;
        let arr = [0u8; 5];
        for (b, addr, len) in [
            (send(&v), base, 64),
            (send(v.as_slice()), base, 64),
            (send(&v[8..16]), base + 8, 8),
            (send(v.slice(60..)), base + 60, 4),
            (send(&arr), arr.as_ptr() as usize, 5),
        ] {
            assert_eq!((b.addr, b.len, b.mem), (addr, len, HOST));
        }
        let r = recv(&mut v);
        assert_eq!((r.addr, r.len, r.mem), (base, 64, HOST));
        let r = recv(&mut v[4..]);
        assert_eq!((r.addr, r.len()), (base + 4, 60));
        let r = recv(v.slice_mut(..=9));
        assert_eq!((r.addr, r.len(), r.is_empty()), (base, 10, false));
        let r = recv(v.as_mut_slice());
        assert_eq!(r.len, 64);
        // A mutable view can also be sent from.
        let s = send(v.slice_mut(1..2));
        assert_eq!((s.addr, s.len), (base + 1, 1));
    }

    #[test]
    fn known_memory_type_and_device_are_carried() {
        let mut g = FakeGpu(vec![0; 4096]);
        let base = g.0.as_ptr() as usize;
        let gpu3 = Some((MemoryType::Cuda, Some(3)));
        let s = send(&g);
        assert_eq!((s.addr, s.len, s.mem), (base, 4096, gpu3));
        let s = send(g.slice(1024..2048));
        assert_eq!((s.addr, s.len, s.mem), (base + 1024, 1024, gpu3));
        let r = recv(&mut g);
        assert_eq!((r.addr, r.len, r.mem), (base, 4096, gpu3));
        let r = recv(g.slice_mut(4000..));
        assert_eq!((r.addr, r.len, r.mem), (base + 4000, 96, gpu3));
        // Raw buffers leave the type to be classified.
        // SAFETY: the range is `g`'s live allocation, untouched while `s` exists.
        let s = unsafe { SendBuf::from_raw(base as u64, 8) };
        assert_eq!(s.mem, None);
    }

    #[test]
    fn empty_buffers() {
        let v: Vec<u8> = Vec::new();
        assert!(send(&v).is_empty());
        let mut w = vec![0u8; 3];
        assert!(recv(w.slice_mut(3..)).is_empty());
    }
}
