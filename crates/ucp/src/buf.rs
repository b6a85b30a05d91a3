//! Buffers handed to requests: host slices, or memory of any type (GPU included) by address.

use std::marker::PhantomData;

use rucx_ucs::MemoryType;

/// A buffer to send from.
#[derive(Clone, Copy, Debug)]
pub struct SendBuf<'a> {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    /// Memory type and device, or `None` to classify the pointer.
    pub(crate) mem: Option<(MemoryType, Option<u32>)>,
    _p: PhantomData<&'a [u8]>,
}

/// A buffer to receive into.
#[derive(Debug)]
pub struct RecvBuf<'a> {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) mem: Option<(MemoryType, Option<u32>)>,
    _p: PhantomData<&'a mut [u8]>,
}

impl<'a> From<&'a [u8]> for SendBuf<'a> {
    fn from(s: &'a [u8]) -> Self {
        SendBuf {
            addr: s.as_ptr() as usize,
            len: s.len(),
            mem: Some((MemoryType::Host, None)),
            _p: PhantomData,
        }
    }
}

impl<'a> From<&'a Vec<u8>> for SendBuf<'a> {
    fn from(s: &'a Vec<u8>) -> Self {
        SendBuf::from(s.as_slice())
    }
}

impl<'a> From<&'a mut [u8]> for RecvBuf<'a> {
    fn from(s: &'a mut [u8]) -> Self {
        RecvBuf {
            addr: s.as_mut_ptr() as usize,
            len: s.len(),
            mem: Some((MemoryType::Host, None)),
            _p: PhantomData,
        }
    }
}

impl<'a> From<&'a mut Vec<u8>> for RecvBuf<'a> {
    fn from(s: &'a mut Vec<u8>) -> Self {
        RecvBuf::from(s.as_mut_slice())
    }
}

impl SendBuf<'_> {
    /// A buffer of any memory type (host, CUDA device, managed) by address; its type and
    /// owning GPU are classified by the memory domains that can detect them.
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
