//! Host memory allocated by the context (UCX's `ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`, which
//! `ucx_perftest` uses for its buffers): shared memory when a domain offers it, so that a peer
//! process on this host moves a rendezvous message with one plain copy through a mapping of
//! it instead of a system call that pins pages (posix: `RUCX_POSIX_*`, see the transport's
//! `mapped` module); ordinary heap memory otherwise.

use std::fmt;
use std::ops::{Deref, DerefMut};

use rucx_ucs::{Error, Result};
use rucx_uct::SharedAlloc;

use super::Context;

/// Host memory from [`Context::mem_alloc`]: zero-filled, usable as any `&[u8]`/`&mut [u8]`
/// (send and receive buffers, `mem_map`). Dropping it forgets the context's cached
/// registrations of its range, so the memory is released once no request uses it.
pub struct HostAlloc {
    ctx: Context,
    addr: usize,
    len: usize,
    /// The shared segment (its handle keeps the mapping), or `None` for heap memory.
    shared: Option<SharedAlloc>,
    heap: Vec<u8>,
}

impl fmt::Debug for HostAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostAlloc")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("shared", &self.shared.as_ref().map(|s| s.memh.domain()))
            .finish()
    }
}

impl Context {
    /// Allocate `len` zeroed bytes of host memory, from the first domain that can share it
    /// with peers on this host (posix: a sealed memfd segment), else from the heap.
    pub fn mem_alloc(&self, len: usize) -> Result<HostAlloc> {
        if len > 0 {
            for d in 0..self.domain_count() {
                match self.domain(d).mem_alloc_shared(len) {
                    Ok(Some(a)) => {
                        return Ok(HostAlloc {
                            ctx: self.clone(),
                            addr: a.addr,
                            len,
                            shared: Some(a),
                            heap: Vec::new(),
                        });
                    }
                    Ok(None) => {}
                    Err(e) => tracing::debug!(
                        "shared allocation of {len} bytes from {}: {e}; trying the next domain",
                        self.domain(d).name()
                    ),
                }
            }
        }
        let mut heap = Vec::new();
        heap.try_reserve_exact(len)
            .map_err(|e| Error::NoMemory(format!("{len} bytes of host memory: {e}")))?;
        heap.resize(len, 0);
        Ok(HostAlloc {
            ctx: self.clone(),
            addr: heap.as_ptr() as usize,
            len,
            shared: None,
            heap,
        })
    }
}

impl HostAlloc {
    /// The domain whose shared segment holds the memory (`None`: heap memory).
    pub fn shared_by(&self) -> Option<&str> {
        self.shared.as_ref().map(|s| s.memh.domain())
    }
}

impl Deref for HostAlloc {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.shared.is_none() {
            return &self.heap;
        }
        // SAFETY: `addr..addr + len` is the shared segment's mapping, which `self.shared`'s
        // handle keeps mapped while `self` lives; the borrow of `self` bounds the slice's.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl DerefMut for HostAlloc {
    fn deref_mut(&mut self) -> &mut [u8] {
        if self.shared.is_none() {
            return &mut self.heap;
        }
        // SAFETY: as in `deref`; the mutable borrow of `self` makes this the only slice of it
        // in this process (a peer may still write through its own mapping, as with any memory
        // lent to a transfer).
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        if self.shared.is_some() {
            // Cached registrations inside the segment hold it mapped: forget them (those of a
            // request still running live on in its guards until it ends).
            self.ctx.forget_registrations(self.addr, self.len);
        }
    }
}
