//! Remote memory access and atomics (`UCP_FEATURE_RMA`, `UCP_FEATURE_AMO32`,
//! `UCP_FEATURE_AMO64`): memory mapping and remote keys, puts and gets, atomics, over rucx's
//! [`MemMap`], [`RkeyBundle`], [`Worker::rma_queued`] and [`Worker::atomic_queued`] (what Open
//! MPI's osc/ucx, spml/ucx, atomic/ucx and sshmem/ucx import).
//!
//! - `ucp_mem_map` maps the caller's memory (`address`, `length`) or, with
//!   `UCP_MEM_MAP_ALLOCATE`, memory it allocates (anonymous host pages, zeroed; unmapped by
//!   `ucp_mem_unmap`), at `address` exactly with `UCP_MEM_MAP_FIXED` (OpenSHMEM's symmetric
//!   heap: refused with `UCS_ERR_NO_MEMORY` when something is mapped there already, never
//!   replaced). Exported memory handles are refused (`UCS_ERR_UNSUPPORTED`); `prot` is
//!   accepted and not enforced (mapped memory is readable and writable by every peer given
//!   its key); `UCP_MEM_MAP_NONBLOCK` and
//!   `UCP_MEM_MAP_SYMMETRIC_RKEY` change nothing (registration is done at once).
//!   Memory is registered by a worker of the context's own, made by the first map (the
//!   context-level call has no worker of the caller's).
//! - A packed key (`ucp_rkey_pack`) is rucx's bundle behind an 8-byte prefix (a magic and the
//!   length), so that `ucp_ep_rkey_unpack`, which gets no length, reads no further than the
//!   bundle.
//! - Atomics are carried out by the target's worker in its progress (rucx has no network
//!   atomics: `crates/ucp/src/worker/atomic.rs`), on words of regions the target mapped; other
//!   words are refused and the operation ends with `UCS_ERR_INVALID_PARAM`.
//! - `ucp_worker_fence` is strong: it returns once everything posted before it completed.
//!   The flushes (`ucp_worker_flush_nb(x)`, `ucp_ep_flush_nb(x)`, `crate::flush`) return a
//!   request that progress completes once the worker's operations posted before them ended
//!   and the lanes were flushed; a put, get or atomic that failed after it was posted (an
//!   implicit one's too) makes the next flush of its endpoint, or of the worker, end with its
//!   error (the fence's too, which then reports it instead).
//! - `ucp_rkey_ptr` says `UCS_ERR_UNREACHABLE` (no peer memory is mapped into this process).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;

use rucx_ucp::{AtomicOp, MemMap, RecvBuf, RkeyBundle, Worker};
use rucx_ucs::RawBuf;

use crate::context::AbiContext;
use crate::endpoint::AbiEp;
use crate::nbx::{CbKind, Opts, post, raw};
use crate::status::{ptr_is_ptr, status_of, status_ptr};
use crate::types::*;
use crate::worker::Callback;

// ucp_mem_map_params_t::field_mask
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub const UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER: u64 = 1 << 5;
// ucp_mem_map_params_t::flags
pub const UCP_MEM_MAP_NONBLOCK: c_uint = 1 << 0;
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
pub const UCP_MEM_MAP_FIXED: c_uint = 1 << 2;
pub const UCP_MEM_MAP_SYMMETRIC_RKEY: c_uint = 1 << 3;
// ucp_mem_attr_t::field_mask
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_ATTR_FIELD_MEM_TYPE: u64 = 1 << 2;
/// `UCS_MEMORY_TYPE_UNKNOWN` of UCX 1.14 to 1.16 (after `UCS_MEMORY_TYPE_RDMA`).
pub const UCS_MEMORY_TYPE_UNKNOWN: u32 = 6;
/// `UCS_MEMORY_TYPE_UNKNOWN` of UCX 1.13 (callers built against its headers, Debian's Open
/// MPI among them, pass it), `UCS_MEMORY_TYPE_RDMA` from 1.14: both read as unknown here.
pub const UCS_MEMORY_TYPE_UNKNOWN_1_13: u32 = 5;
// ucp_atomic_op_t (nbx)
pub const UCP_ATOMIC_OP_ADD: c_int = 0;
pub const UCP_ATOMIC_OP_SWAP: c_int = 1;
pub const UCP_ATOMIC_OP_CSWAP: c_int = 2;
pub const UCP_ATOMIC_OP_AND: c_int = 3;
pub const UCP_ATOMIC_OP_OR: c_int = 4;
pub const UCP_ATOMIC_OP_XOR: c_int = 5;
// ucp_atomic_post_op_t
pub const UCP_ATOMIC_POST_OP_ADD: c_int = 0;
pub const UCP_ATOMIC_POST_OP_AND: c_int = 1;
pub const UCP_ATOMIC_POST_OP_OR: c_int = 2;
pub const UCP_ATOMIC_POST_OP_XOR: c_int = 3;
// ucp_atomic_fetch_op_t
pub const UCP_ATOMIC_FETCH_OP_FADD: c_int = 0;
pub const UCP_ATOMIC_FETCH_OP_SWAP: c_int = 1;
pub const UCP_ATOMIC_FETCH_OP_CSWAP: c_int = 2;
pub const UCP_ATOMIC_FETCH_OP_FAND: c_int = 3;
pub const UCP_ATOMIC_FETCH_OP_FOR: c_int = 4;
pub const UCP_ATOMIC_FETCH_OP_FXOR: c_int = 5;

/// `ucp_mem_map_params_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: u32,
    pub exported_memh_buffer: *const c_void,
}

/// `ucp_mem_attr_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemAttr {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: u32,
}

/// What a context keeps for remote memory access: the worker that registers mapped memory.
#[derive(Default)]
pub struct CtxRma {
    mapper: Mutex<Option<Worker>>,
}

impl std::fmt::Debug for CtxRma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtxRma").finish_non_exhaustive()
    }
}

/// What a `ucp_mem_h` points to.
#[derive(Debug)]
pub struct AbiMem {
    map: MemMap<'static>,
    /// Pages this library mapped for the map (address, length; unmapped after the map is
    /// dropped).
    alloc: Option<(usize, usize)>,
}

/// What a `ucp_rkey_h` points to.
#[derive(Debug)]
pub struct AbiRkey {
    pub bundle: RkeyBundle,
}

/// The prefix of a packed key.
const RKEY_MAGIC: u32 = 0x7275_6b31;
/// Longest packed key accepted (a sanity bound on the prefix).
const RKEY_MAX: usize = 1 << 16;

/// `ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params,
/// ucp_mem_h *memh_p)`.
///
/// # Safety
/// `context` NULL or live; `params` NULL or valid; `memh_p` NULL or writable; a given address
/// is `length` bytes of this process, mapped until `ucp_mem_unmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_mem_map(
    context: *const AbiContext,
    params: *const MemMapParams,
    memh_p: *mut *mut AbiMem,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(ctx), Some(p)) = (unsafe { context.as_ref() }, unsafe { read_params(params) }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if memh_p.is_null() || p.field_mask & !((1 << 6) - 1) != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    let m = p.field_mask;
    let flags = if m & UCP_MEM_MAP_PARAM_FIELD_FLAGS != 0 {
        p.flags
    } else {
        0
    };
    if m & UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER != 0 {
        return UCS_ERR_UNSUPPORTED;
    }
    let known = UCP_MEM_MAP_NONBLOCK
        | UCP_MEM_MAP_ALLOCATE
        | UCP_MEM_MAP_FIXED
        | UCP_MEM_MAP_SYMMETRIC_RKEY;
    if flags & !known != 0 || m & UCP_MEM_MAP_PARAM_FIELD_LENGTH == 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    let len = p.length;
    let mem_type = if m & UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE != 0 {
        p.memory_type
    } else {
        UCS_MEMORY_TYPE_UNKNOWN
    };
    let address = if m & UCP_MEM_MAP_PARAM_FIELD_ADDRESS != 0 {
        p.address
    } else {
        std::ptr::null_mut()
    };
    let (addr, alloc) = if flags & UCP_MEM_MAP_ALLOCATE != 0 {
        // Host memory only (an address given without FIXED is a hint, not taken).
        if ![
            UCS_MEMORY_TYPE_HOST,
            UCS_MEMORY_TYPE_UNKNOWN,
            UCS_MEMORY_TYPE_UNKNOWN_1_13,
        ]
        .contains(&mem_type)
        {
            return UCS_ERR_UNSUPPORTED;
        }
        let fixed = flags & UCP_MEM_MAP_FIXED != 0;
        if fixed && (address.is_null() || !(address as usize).is_multiple_of(page_size())) {
            return UCS_ERR_INVALID_PARAM;
        }
        match map_pages(if fixed { address as usize } else { 0 }, len) {
            Ok(p) => (p, Some((p, len.max(1)))),
            Err(s) => return s,
        }
    } else {
        if address.is_null() && len > 0 {
            return UCS_ERR_INVALID_PARAM;
        }
        (address as usize, None)
    };
    let free = |alloc: Option<(usize, usize)>| {
        if let Some((p, l)) = alloc {
            unmap_pages(p, l);
        }
    };
    let mut mapper = ctx.rma.mapper.lock().unwrap_or_else(|e| e.into_inner());
    if mapper.is_none() {
        match Worker::new(&ctx.ctx) {
            Ok(w) => *mapper = Some(w),
            Err(e) => {
                free(alloc);
                tracing::warn!("ucp_mem_map: no worker to register memory: {e}");
                return status_of(&e);
            }
        }
    }
    let w = mapper.as_ref().expect("made above");
    // SAFETY: the caller's memory (mapped until `ucp_mem_unmap`, UCX's contract), or ours
    // (freed after the map is dropped).
    let buf = unsafe { RecvBuf::from_raw(addr as u64, len) };
    match w.mem_map(buf) {
        Ok(map) => {
            let mem = Box::new(AbiMem { map, alloc });
            // SAFETY: checked non-NULL; writable by the caller's promise.
            unsafe { *memh_p = Box::into_raw(mem) };
            UCS_OK
        }
        Err(e) => {
            free(alloc);
            tracing::info!("ucp_mem_map of {len} bytes at {addr:#x}: {e}");
            status_of(&e)
        }
    }
}

/// The caller's `ucp_mem_map_params_t`: UCX 1.13's is 40 bytes (no `exported_memh_buffer`),
/// so the last field is read only when its bit says it is there.
///
/// # Safety
/// `p` NULL or a valid `ucp_mem_map_params_t` of UCX 1.13 or later.
unsafe fn read_params(p: *const MemMapParams) -> Option<MemMapParams> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's promise: the fields up to `memory_type` are in every version; the
    // last one only when the caller set its bit (1.14 and later).
    unsafe {
        let field_mask = (&raw const (*p).field_mask).read();
        Some(MemMapParams {
            field_mask,
            address: (&raw const (*p).address).read(),
            length: (&raw const (*p).length).read(),
            flags: (&raw const (*p).flags).read(),
            prot: (&raw const (*p).prot).read(),
            memory_type: (&raw const (*p).memory_type).read(),
            exported_memh_buffer: if field_mask & UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER != 0
            {
                (&raw const (*p).exported_memh_buffer).read()
            } else {
                std::ptr::null()
            },
        })
    }
}

/// `ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh)`.
///
/// # Safety
/// `memh` NULL or from `ucp_mem_map` of `context`, unmapped once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_mem_unmap(context: *const AbiContext, memh: *mut AbiMem) -> Status {
    if context.is_null() || memh.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: made by `Box::into_raw` in `ucp_mem_map`, unmapped once.
    let AbiMem { map, alloc } = *unsafe { Box::from_raw(memh) };
    // The map goes first (out of the registry of mapped regions and the domains), then the
    // memory this library allocated for it.
    drop(map);
    if let Some((p, l)) = alloc {
        unmap_pages(p, l);
    }
    UCS_OK
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// Map `len` bytes (at least one page) of anonymous, zeroed host memory: anywhere
/// (`at` 0), or exactly at `at` when nothing is mapped there (`UCS_ERR_NO_MEMORY` else: an
/// existing mapping is never replaced).
fn map_pages(at: usize, len: usize) -> std::result::Result<usize, Status> {
    let fixed = if at != 0 {
        libc::MAP_FIXED_NOREPLACE
    } else {
        0
    };
    // SAFETY: an anonymous private mapping; with a fixed address the kernel refuses rather
    // than replace what is there.
    let p = unsafe {
        libc::mmap(
            at as *mut c_void,
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        tracing::info!("ucp_mem_map: mapping {len} bytes at {at:#x}: {e}");
        return Err(UCS_ERR_NO_MEMORY);
    }
    if at != 0 && p as usize != at {
        // An old kernel that takes the flag for a hint.
        unmap_pages(p as usize, len.max(1));
        return Err(UCS_ERR_NO_MEMORY);
    }
    Ok(p as usize)
}

/// Unmap pages [`map_pages`] mapped.
fn unmap_pages(p: usize, len: usize) {
    // SAFETY: a mapping of ours of this length, unmapped once, no map left that lends it.
    unsafe { libc::munmap(p as *mut c_void, len) };
}

/// `ucs_status_t ucp_mem_query(const ucp_mem_h memh, ucp_mem_attr_t *attr)`.
///
/// # Safety
/// `memh` NULL or live; `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_mem_query(memh: *const AbiMem, attr: *mut MemAttr) -> Status {
    // SAFETY: the caller's promises.
    let (Some(mem), Some(a)) = (unsafe { memh.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & UCP_MEM_ATTR_FIELD_ADDRESS != 0 {
        a.address = mem.map.address() as *mut c_void;
    }
    if a.field_mask & UCP_MEM_ATTR_FIELD_LENGTH != 0 {
        a.length = mem.map.len();
    }
    if a.field_mask & UCP_MEM_ATTR_FIELD_MEM_TYPE != 0 {
        a.mem_type = match mem.map.mem_type() {
            rucx_ucs::MemoryType::Host => UCS_MEMORY_TYPE_HOST,
            rucx_ucs::MemoryType::Cuda => UCS_MEMORY_TYPE_CUDA,
            rucx_ucs::MemoryType::CudaManaged => UCS_MEMORY_TYPE_CUDA_MANAGED,
            rucx_ucs::MemoryType::Unknown => UCS_MEMORY_TYPE_UNKNOWN,
        };
    }
    UCS_OK
}

/// `ucs_status_t ucp_mem_advise(ucp_context_h, ucp_mem_h, ucp_mem_advise_params_t *)`: advice
/// is a hint, taken and ignored (mapped memory is registered at once).
///
/// # Safety
/// Pointers NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_mem_advise(
    context: *const AbiContext,
    memh: *const AbiMem,
    params: *const c_void,
) -> Status {
    if context.is_null() || memh.is_null() || params.is_null() {
        UCS_ERR_INVALID_PARAM
    } else {
        UCS_OK
    }
}

/// `ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p,
/// size_t *size_p)`: released with `ucp_rkey_buffer_release`.
///
/// # Safety
/// `memh` NULL or live; the out pointers NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_rkey_pack(
    context: *const AbiContext,
    memh: *const AbiMem,
    rkey_buffer_p: *mut *mut c_void,
    size_p: *mut usize,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(mem) = (unsafe { memh.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if context.is_null() || rkey_buffer_p.is_null() || size_p.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    let bundle = mem.map.pack_rkey();
    if bundle.len() > RKEY_MAX {
        return UCS_ERR_INVALID_PARAM;
    }
    let mut b = Vec::with_capacity(8 + bundle.len());
    b.extend_from_slice(&RKEY_MAGIC.to_le_bytes());
    b.extend_from_slice(&(bundle.len() as u32).to_le_bytes());
    b.extend_from_slice(&bundle);
    let size = b.len();
    let p = Box::into_raw(b.into_boxed_slice()) as *mut u8;
    // SAFETY: checked non-NULL; writable by the caller's promise.
    unsafe {
        *rkey_buffer_p = p.cast();
        *size_p = size;
    }
    UCS_OK
}

/// `void ucp_rkey_buffer_release(void *rkey_buffer)`.
///
/// # Safety
/// `rkey_buffer` NULL or from `ucp_rkey_pack`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_rkey_buffer_release(rkey_buffer: *mut c_void) {
    if rkey_buffer.is_null() {
        return;
    }
    // SAFETY: ours: its prefix says its length (8 bytes more with the prefix).
    unsafe {
        let len = packed_len(rkey_buffer).unwrap_or(0);
        let s = std::ptr::slice_from_raw_parts_mut(rkey_buffer.cast::<u8>(), 8 + len);
        drop(Box::from_raw(s));
    }
}

/// The bundle length a packed key's prefix says.
///
/// # Safety
/// `p` points at least at the 8 prefix bytes.
unsafe fn packed_len(p: *const c_void) -> Option<usize> {
    let mut head = [0u8; 8];
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), head.as_mut_ptr(), 8) };
    let magic = u32::from_le_bytes(head[..4].try_into().ok()?);
    let len = u32::from_le_bytes(head[4..].try_into().ok()?) as usize;
    (magic == RKEY_MAGIC && len <= RKEY_MAX).then_some(len)
}

/// `ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h
/// *rkey_p)`.
///
/// # Safety
/// `ep` NULL or live; `rkey_buffer` NULL or a packed key (of any process); `rkey_p` NULL or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_ep_rkey_unpack(
    ep: *const AbiEp,
    rkey_buffer: *const c_void,
    rkey_p: *mut *mut AbiRkey,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(ep) = (unsafe { ep.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if rkey_buffer.is_null() || rkey_p.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: a packed key starts with its prefix.
    let Some(len) = (unsafe { packed_len(rkey_buffer) }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    // SAFETY: the prefix said how many bytes follow it.
    let bytes = unsafe { std::slice::from_raw_parts(rkey_buffer.cast::<u8>().add(8), len) };
    match ep.worker().worker.rkey_unpack(ep.id, bytes) {
        Ok(bundle) => {
            // SAFETY: checked non-NULL; writable by the caller's promise.
            unsafe { *rkey_p = Box::into_raw(Box::new(AbiRkey { bundle })) };
            UCS_OK
        }
        Err(e) => status_of(&e),
    }
}

/// `void ucp_rkey_destroy(ucp_rkey_h rkey)`.
///
/// # Safety
/// `rkey` NULL or from `ucp_ep_rkey_unpack`, destroyed once, no operation using it in flight.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_rkey_destroy(rkey: *mut AbiRkey) {
    if !rkey.is_null() {
        // SAFETY: made by `Box::into_raw` in `ucp_ep_rkey_unpack`.
        drop(unsafe { Box::from_raw(rkey) });
    }
}

/// `ucs_status_t ucp_rkey_ptr(ucp_rkey_h rkey, uint64_t raddr, void **addr_p)`: no peer's
/// memory is mapped into this process (`UCS_ERR_UNREACHABLE`, as UCX says for a key of a
/// transport without shared memory).
///
/// # Safety
/// Pointers NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_rkey_ptr(
    rkey: *const AbiRkey,
    _raddr: u64,
    addr_p: *mut *mut c_void,
) -> Status {
    if rkey.is_null() || addr_p.is_null() {
        UCS_ERR_INVALID_PARAM
    } else {
        UCS_ERR_UNREACHABLE
    }
}

/// Options of the calls without a `ucp_request_param_t`: the callback only.
pub(crate) fn plain(cb: Callback) -> Opts {
    Opts {
        cb,
        dt: 1 << UCP_DATATYPE_SHIFT,
        flags: 0,
        req: None,
        no_imm: false,
    }
}

/// A put or get of `len` bytes at `buffer` to `remote` of `rkey`, posted with `opts`.
///
/// # Safety
/// `ep` NULL or live, `rkey` NULL or live; the buffer as UCX's contract says.
unsafe fn rma(
    ep: *const AbiEp,
    put: bool,
    buffer: *const c_void,
    len: usize,
    remote: u64,
    rkey: *const AbiRkey,
    opts: &Opts,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    let (Some(ep), Some(rkey)) = (unsafe { ep.as_ref() }, unsafe { rkey.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    // SAFETY: the caller's promise on the buffer.
    let buf = match unsafe { raw(buffer, len) } {
        Ok(b) => b,
        Err(s) => return status_ptr(s),
    };
    let id = ep.id;
    let bundle = &rkey.bundle;
    post(
        ep.worker(),
        opts,
        true,
        |w, token| w.rma_queued(id, put, buf, remote, bundle, token),
        |_| {},
    )
}

/// An implicit (nbi) form: the request, if any, is released at once (it ends by itself; a
/// flush waits for it): `UCS_OK` when it ended in place, `UCS_INPROGRESS` else, or the error.
fn implicit(r: *mut c_void) -> Status {
    if r.is_null() {
        UCS_OK
    } else if ptr_is_ptr(r) {
        // SAFETY: a request this library just returned, released once.
        unsafe { crate::request::free(r) };
        UCS_INPROGRESS
    } else {
        r as isize as Status
    }
}

/// `ucs_status_t ucp_put_nbi(ucp_ep_h ep, const void *buffer, size_t length, uint64_t
/// remote_addr, ucp_rkey_h rkey)`.
///
/// # Safety
/// `ep`, `rkey` NULL or live; `buffer` `length` bytes readable until the put ended.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_put_nbi(
    ep: *const AbiEp,
    buffer: *const c_void,
    length: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
) -> Status {
    // SAFETY: forwarded.
    implicit(unsafe {
        rma(
            ep,
            true,
            buffer,
            length,
            remote_addr,
            rkey,
            &plain(Callback::None),
        )
    })
}

/// `ucs_status_t ucp_get_nbi(ucp_ep_h ep, void *buffer, size_t length, uint64_t remote_addr,
/// ucp_rkey_h rkey)`.
///
/// # Safety
/// As [`ucp_put_nbi`], `buffer` writable and untouched until the get ended.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_get_nbi(
    ep: *const AbiEp,
    buffer: *mut c_void,
    length: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
) -> Status {
    // SAFETY: forwarded.
    implicit(unsafe {
        rma(
            ep,
            false,
            buffer,
            length,
            remote_addr,
            rkey,
            &plain(Callback::None),
        )
    })
}

/// `ucs_status_ptr_t ucp_put_nb(ucp_ep_h ep, const void *buffer, size_t length, uint64_t
/// remote_addr, ucp_rkey_h rkey, ucp_send_callback_t cb)`.
///
/// # Safety
/// As [`ucp_put_nbi`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_put_nb(
    ep: *const AbiEp,
    buffer: *const c_void,
    length: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    cb: SendCb,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe {
        rma(
            ep,
            true,
            buffer,
            length,
            remote_addr,
            rkey,
            &plain(Callback::Send(cb)),
        )
    }
}

/// `ucs_status_ptr_t ucp_get_nb(ucp_ep_h ep, void *buffer, size_t length, uint64_t
/// remote_addr, ucp_rkey_h rkey, ucp_send_callback_t cb)`.
///
/// # Safety
/// As [`ucp_get_nbi`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_get_nb(
    ep: *const AbiEp,
    buffer: *mut c_void,
    length: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    cb: SendCb,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe {
        rma(
            ep,
            false,
            buffer,
            length,
            remote_addr,
            rkey,
            &plain(Callback::Send(cb)),
        )
    }
}

/// The nbx forms' options: contiguous datatypes; a memory handle is accepted and not needed.
///
/// # Safety
/// `param` NULL or valid.
unsafe fn nbx_opts(param: *const RequestParam) -> std::result::Result<Opts, Status> {
    // SAFETY: forwarded.
    unsafe { Opts::read(param, CbKind::Send) }
}

/// `ucp_put_nbx` (`put`) or `ucp_get_nbx`: the request parameters read, the length taken
/// from `count` contiguous bytes, then [`rma`].
///
/// # Safety
/// As [`rma`]; `param` NULL or valid.
unsafe fn rma_nbx(
    ep: *const AbiEp,
    put: bool,
    buffer: *const c_void,
    count: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let opts = match unsafe { nbx_opts(param) } {
        Ok(o) => o,
        Err(s) => return status_ptr(s),
    };
    let len = match opts.contig_len(count) {
        Ok(l) => l,
        Err(s) => return status_ptr(s),
    };
    // SAFETY: forwarded.
    unsafe { rma(ep, put, buffer, len, remote_addr, rkey, &opts) }
}

/// `ucs_status_ptr_t ucp_put_nbx(ucp_ep_h ep, const void *buffer, size_t count, uint64_t
/// remote_addr, ucp_rkey_h rkey, const ucp_request_param_t *param)`.
///
/// # Safety
/// As [`ucp_put_nbi`]; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_put_nbx(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { rma_nbx(ep, true, buffer, count, remote_addr, rkey, param) }
}

/// `ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count, uint64_t
/// remote_addr, ucp_rkey_h rkey, const ucp_request_param_t *param)`.
///
/// # Safety
/// As [`ucp_get_nbi`]; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_get_nbx(
    ep: *const AbiEp,
    buffer: *mut c_void,
    count: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { rma_nbx(ep, false, buffer, count, remote_addr, rkey, param) }
}

/// An atomic: `op` on the `size`-byte word at `remote` of `rkey`, with `value` (`compare` for
/// compare-and-swap), the old value to `result` when fetching.
///
/// # Safety
/// `ep`, `rkey` NULL or live; `result` NULL or `size` writable bytes until the atomic ended.
#[allow(clippy::too_many_arguments)]
unsafe fn atomic(
    ep: *const AbiEp,
    op: AtomicOp,
    size: usize,
    value: u64,
    compare: u64,
    result: *mut c_void,
    remote: u64,
    rkey: *const AbiRkey,
    opts: &Opts,
) -> *mut c_void {
    // SAFETY: the caller's promises.
    let (Some(ep), Some(rkey)) = (unsafe { ep.as_ref() }, unsafe { rkey.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if size != 4 && size != 8 {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let res = if result.is_null() {
        None
    } else {
        // SAFETY: the caller's promise: host memory of `size` bytes until the end.
        Some(unsafe { RawBuf::new(result as usize, size, Some(rucx_ucs::MemInfo::HOST)) })
    };
    let id = ep.id;
    let bundle = &rkey.bundle;
    post(
        ep.worker(),
        opts,
        true,
        |w, token| {
            w.atomic_queued(
                id, op, size as u8, value, compare, res, remote, bundle, token,
            )
        },
        |_| {},
    )
}

/// `ucs_status_t ucp_atomic_post(ucp_ep_h ep, ucp_atomic_post_op_t opcode, uint64_t value,
/// size_t op_size, uint64_t remote_addr, ucp_rkey_h rkey)`: `UCS_OK` once posted (a flush
/// completes it), or the error that refused it.
///
/// # Safety
/// `ep`, `rkey` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_atomic_post(
    ep: *const AbiEp,
    opcode: c_int,
    value: u64,
    op_size: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
) -> Status {
    let op = match opcode {
        UCP_ATOMIC_POST_OP_ADD => AtomicOp::Add,
        UCP_ATOMIC_POST_OP_AND => AtomicOp::And,
        UCP_ATOMIC_POST_OP_OR => AtomicOp::Or,
        UCP_ATOMIC_POST_OP_XOR => AtomicOp::Xor,
        _ => return UCS_ERR_INVALID_PARAM,
    };
    let opts = plain(Callback::None);
    let n = std::ptr::null_mut();
    // SAFETY: forwarded.
    match implicit(unsafe { atomic(ep, op, op_size, value, 0, n, remote_addr, rkey, &opts) }) {
        // UCX's post says `UCS_OK` once the operation is posted (callers, Open MPI's osc/ucx
        // among them, take anything else for a failure); a flush completes it.
        UCS_INPROGRESS => UCS_OK,
        s => s,
    }
}

/// `ucs_status_ptr_t ucp_atomic_fetch_nb(ucp_ep_h ep, ucp_atomic_fetch_op_t opcode, uint64_t
/// value, void *result, size_t op_size, uint64_t remote_addr, ucp_rkey_h rkey,
/// ucp_send_callback_t cb)`: for compare-and-swap, `value` is compared and `*result` swapped
/// in.
///
/// # Safety
/// `ep`, `rkey` NULL or live; `result` `op_size` bytes, readable and writable until the end.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ucp_atomic_fetch_nb(
    ep: *const AbiEp,
    opcode: c_int,
    value: u64,
    result: *mut c_void,
    op_size: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    cb: SendCb,
) -> *mut c_void {
    let op = match opcode {
        UCP_ATOMIC_FETCH_OP_FADD => AtomicOp::Add,
        UCP_ATOMIC_FETCH_OP_SWAP => AtomicOp::Swap,
        UCP_ATOMIC_FETCH_OP_CSWAP => AtomicOp::Cswap,
        UCP_ATOMIC_FETCH_OP_FAND => AtomicOp::And,
        UCP_ATOMIC_FETCH_OP_FOR => AtomicOp::Or,
        UCP_ATOMIC_FETCH_OP_FXOR => AtomicOp::Xor,
        _ => return status_ptr(UCS_ERR_INVALID_PARAM),
    };
    if result.is_null() || (op_size != 4 && op_size != 8) {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let (value, compare) = if op == AtomicOp::Cswap {
        // SAFETY: the caller's promise: `op_size` readable bytes.
        (unsafe { read_word(result, op_size) }, value)
    } else {
        (value, 0)
    };
    // SAFETY: forwarded.
    unsafe {
        atomic(
            ep,
            op,
            op_size,
            value,
            compare,
            result,
            remote_addr,
            rkey,
            &plain(Callback::Send(cb)),
        )
    }
}

/// The `size`-byte word at `p`.
///
/// # Safety
/// `p` `size` (4 or 8) readable bytes.
unsafe fn read_word(p: *const c_void, size: usize) -> u64 {
    // SAFETY: the caller's promise; unaligned reads allowed.
    unsafe {
        if size == 4 {
            std::ptr::read_unaligned(p.cast::<u32>()) as u64
        } else {
            std::ptr::read_unaligned(p.cast::<u64>())
        }
    }
}

/// `ucs_status_ptr_t ucp_atomic_op_nbx(ucp_ep_h ep, ucp_atomic_op_t opcode, const void
/// *buffer, size_t count, uint64_t remote_addr, ucp_rkey_h rkey, const ucp_request_param_t
/// *param)`: the datatype is `ucp_dt_make_contig(4)` or `(8)` and `count` 1; with
/// `reply_buffer` it fetches (compare-and-swap: `*buffer` is compared, `*reply_buffer` swapped
/// in); swap and compare-and-swap need one.
///
/// # Safety
/// `ep`, `rkey` NULL or live; `buffer` one readable element; `param` NULL or valid, its reply
/// buffer one element, readable and writable until the end.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_atomic_op_nbx(
    ep: *const AbiEp,
    opcode: c_int,
    buffer: *const c_void,
    count: usize,
    remote_addr: u64,
    rkey: *const AbiRkey,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let opts = match unsafe { nbx_opts(param) } {
        Ok(o) => o,
        Err(s) => return status_ptr(s),
    };
    let op = match opcode {
        UCP_ATOMIC_OP_ADD => AtomicOp::Add,
        UCP_ATOMIC_OP_SWAP => AtomicOp::Swap,
        UCP_ATOMIC_OP_CSWAP => AtomicOp::Cswap,
        UCP_ATOMIC_OP_AND => AtomicOp::And,
        UCP_ATOMIC_OP_OR => AtomicOp::Or,
        UCP_ATOMIC_OP_XOR => AtomicOp::Xor,
        _ => return status_ptr(UCS_ERR_INVALID_PARAM),
    };
    let size = match opts.contig_len(1) {
        Ok(s @ (4 | 8)) if count == 1 => s,
        Err(s) => return status_ptr(s),
        _ => return status_ptr(UCS_ERR_INVALID_PARAM),
    };
    // SAFETY: the caller's promise.
    let p = unsafe { param.as_ref() };
    let reply = match p {
        Some(p) if p.op_attr_mask & UCP_OP_ATTR_FIELD_REPLY_BUFFER != 0 => p.reply_buffer,
        _ => std::ptr::null_mut(),
    };
    if buffer.is_null() || (reply.is_null() && matches!(op, AtomicOp::Swap | AtomicOp::Cswap)) {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    // SAFETY: the caller's promise: one readable element.
    let x = unsafe { read_word(buffer, size) };
    let (value, compare) = if op == AtomicOp::Cswap {
        // SAFETY: as above, for the reply buffer.
        (unsafe { read_word(reply, size) }, x)
    } else {
        (x, 0)
    };
    // SAFETY: forwarded.
    unsafe {
        atomic(
            ep,
            op,
            size,
            value,
            compare,
            reply,
            remote_addr,
            rkey,
            &opts,
        )
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// The layouts of UCX 1.16's `ucp_mem_map_params_t` and `ucp_mem_attr_t` on LP64 (1.13's
    /// params end before `exported_memh_buffer`: 40 bytes, checked with `offsetof` against
    /// Debian's libucx-dev 1.13.1).
    #[test]
    fn struct_layouts_match_ucx_1_16() {
        assert_eq!(offset_of!(MemMapParams, field_mask), 0);
        assert_eq!(offset_of!(MemMapParams, address), 8);
        assert_eq!(offset_of!(MemMapParams, length), 16);
        assert_eq!(offset_of!(MemMapParams, flags), 24);
        assert_eq!(offset_of!(MemMapParams, prot), 28);
        assert_eq!(offset_of!(MemMapParams, memory_type), 32);
        assert_eq!(offset_of!(MemMapParams, exported_memh_buffer), 40);
        assert_eq!(size_of::<MemMapParams>(), 48);
        assert_eq!(align_of::<MemMapParams>(), 8);
        assert_eq!(offset_of!(MemAttr, field_mask), 0);
        assert_eq!(offset_of!(MemAttr, address), 8);
        assert_eq!(offset_of!(MemAttr, length), 16);
        assert_eq!(offset_of!(MemAttr, mem_type), 24);
        assert_eq!(size_of::<MemAttr>(), 32);
    }
}
