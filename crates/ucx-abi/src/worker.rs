//! `ucp_worker_h`: a rucx worker, the operations in flight on it and their completion.
//!
//! Progress (`ucp_worker_progress`) progresses the rucx worker, then delivers every operation
//! that ended: its request's header gets the status (and receive information), and the caller's
//! callback runs unless the request was freed first. Callbacks run only from progress, never
//! inside the call that posted the operation, and with nothing of the worker borrowed, so a
//! callback may post, free or cancel.

use std::cell::{Cell, RefCell};
use std::ffi::{c_uint, c_void};

use rucx_ucp::Worker;

use crate::context::{AbiContext, fill_name};
use crate::engine::Op;
use crate::request;
use crate::status::{status_of, status_ptr};
use crate::tag::Finish;
use crate::types::*;

/// What a `ucp_worker_h` points to.
#[derive(Debug)]
pub struct AbiWorker {
    pub ctx: *const AbiContext,
    pub worker: Worker,
    pub ops: RefCell<Vec<Pending>>,
    /// Something may have ended outside progress (a post, a cancel): look at every operation
    /// at the next progress even if it reports no event.
    pub dirty: Cell<bool>,
}

/// How a request's end is told to its caller.
#[derive(Debug, Clone, Copy)]
pub enum Callback {
    None,
    Send(SendCb),
    SendNbx(SendNbxCb, *mut c_void),
    Recv(RecvCb),
    RecvNbx(RecvNbxCb, *mut c_void),
}

/// An operation in flight: the request it completes, its callback, the rucx operation and
/// what to make of its result.
#[derive(Debug)]
pub struct Pending {
    pub user: *mut c_void,
    pub cb: Callback,
    pub op: Op,
    pub fin: Finish,
}

impl AbiWorker {
    pub fn context(&self) -> &AbiContext {
        // SAFETY: UCX's rule, which callers keep: a context outlives its workers.
        unsafe { &*self.ctx }
    }

    /// Queue an operation in flight.
    pub fn push(&self, p: Pending) {
        self.ops.borrow_mut().push(p);
        self.dirty.set(true);
    }

    /// A post or cancel may have ended operations (rucx makes progress inside some calls).
    pub fn touch(&self) {
        self.dirty.set(true);
    }

    /// Progress once and deliver what ended; the number of events.
    pub fn progress(&self) -> usize {
        let mut n = self.worker.progress();
        // Operations end only through events of the worker's progress, or inside calls that
        // set `dirty`: with neither, nothing to look at (polling every operation costs a lock
        // each, with a window of many in flight).
        if (n == 0 && !self.dirty.get()) || self.ops.borrow().is_empty() {
            return n;
        }
        self.dirty.set(false);
        let ended = self.take_ended();
        n += ended.len();
        for p in ended {
            let (status, info) = p.fin.run(p.op);
            deliver(p.user, p.cb, status, info);
        }
        n
    }

    /// Remove the operations that ended, in posting order, with their final status.
    fn take_ended(&self) -> Vec<Pending> {
        let mut ops = self.ops.borrow_mut();
        let mut ended = Vec::new();
        let mut i = 0;
        while i < ops.len() {
            let done = ops[i].op.poll();
            if !done {
                i += 1;
                continue;
            }
            ended.push(ops.remove(i));
        }
        ended
    }

    /// Cancel the receive whose request is `user`, if it has not matched. Its end (canceled)
    /// is delivered by progress.
    pub fn cancel(&self, user: *mut c_void) {
        let ops = self.ops.borrow();
        if let Some(p) = ops.iter().find(|p| p.user == user) {
            p.op.cancel(&self.worker);
        }
        drop(ops);
        self.touch();
    }

    /// True while any send is in flight (for flush).
    pub fn sends_in_flight(&self) -> bool {
        self.ops.borrow().iter().any(|p| p.op.is_send())
    }
}

/// Record a request's end and run its callback (unless it was freed before).
pub fn deliver(user: *mut c_void, cb: Callback, status: Status, mut info: TagRecvInfo) {
    // SAFETY: `user` is a live request of this library (made when the operation was posted).
    if !unsafe { request::complete(user, status, info) } {
        return;
    }
    // The callbacks are the caller's, called as UCX calls them: with the request, its status,
    // and for receives the information of the message.
    match cb {
        Callback::None => {}
        // SAFETY: see above.
        Callback::Send(Some(f)) => unsafe { f(user, status) },
        // SAFETY: see above.
        Callback::SendNbx(Some(f), data) => unsafe { f(user, status, data) },
        // SAFETY: see above.
        Callback::Recv(Some(f)) => unsafe { f(user, status, &mut info) },
        // SAFETY: see above.
        Callback::RecvNbx(Some(f), data) => unsafe { f(user, status, &info, data) },
        _ => {}
    }
}

/// `ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
/// ucp_worker_h *worker_p)`. Thread modes other than single are answered with single (see
/// `ucp_worker_query`); event file descriptors and CPU masks are refused.
///
/// # Safety
/// `context` NULL or live; `params` NULL or valid; `worker_p` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_create(
    context: *const AbiContext,
    params: *const WorkerParams,
    worker_p: *mut *mut AbiWorker,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(c), Some(p)) = (unsafe { context.as_ref() }, unsafe { params.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if worker_p.is_null() || p.field_mask & !UCP_WORKER_PARAM_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if p.field_mask & (UCP_WORKER_PARAM_FIELD_EVENTS | UCP_WORKER_PARAM_FIELD_EVENT_FD) != 0 {
        return UCS_ERR_UNSUPPORTED;
    }
    match Worker::new(&c.ctx) {
        Ok(worker) => {
            let w = AbiWorker {
                ctx: context,
                worker,
                ops: RefCell::new(Vec::new()),
                dirty: Cell::new(false),
            };
            // SAFETY: checked non-NULL, writable by the caller's promise.
            unsafe { *worker_p = Box::into_raw(Box::new(w)) };
            UCS_OK
        }
        Err(e) => {
            eprintln!("rucx libucp: ucp_worker_create failed: {e}");
            status_of(&e)
        }
    }
}

/// `void ucp_worker_destroy(ucp_worker_h worker)`: operations still in flight end without
/// callbacks (their buffers are released by rucx's worker as it closes).
///
/// # Safety
/// `worker` NULL or live, its endpoints closed or abandoned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_destroy(worker: *mut AbiWorker) {
    if worker.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in `ucp_worker_create`, destroyed once.
    let w = unsafe { Box::from_raw(worker) };
    let ops = std::mem::take(&mut *w.ops.borrow_mut());
    for p in &ops {
        p.op.cancel(&w.worker);
    }
    drop(ops);
    drop(w);
}

/// `unsigned ucp_worker_progress(ucp_worker_h worker)`.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_progress(worker: *const AbiWorker) -> c_uint {
    // SAFETY: the caller's promise.
    match unsafe { worker.as_ref() } {
        Some(w) => w.progress().min(c_uint::MAX as usize) as c_uint,
        None => 0,
    }
}

/// The packed worker address handed out: a length prefix (so that `ucp_ep_create`, which gets
/// only a pointer, knows how much to read) and rucx's own validated address.
pub(crate) const ADDR_MAGIC: u32 = 0x5255_4358;

fn packed_address(w: &AbiWorker) -> Vec<u8> {
    let inner = w.worker.address();
    let mut v = Vec::with_capacity(8 + inner.len());
    v.extend_from_slice(&ADDR_MAGIC.to_le_bytes());
    v.extend_from_slice(&(inner.len() as u32).to_le_bytes());
    v.extend_from_slice(&inner);
    v
}

/// Copy `bytes` into `malloc`ed memory (released by `ucp_worker_release_address`).
fn malloc_copy(bytes: &[u8]) -> *mut c_void {
    // SAFETY: plain allocation of at least one byte.
    let p = unsafe { libc::malloc(bytes.len().max(1)) };
    if !p.is_null() {
        // SAFETY: `p` has room for `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast(), bytes.len()) };
    }
    p
}

/// `ucs_status_t ucp_worker_query(ucp_worker_h worker, ucp_worker_attr_t *attr)`.
///
/// # Safety
/// `worker` NULL or live; `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_query(
    worker: *const AbiWorker,
    attr: *mut WorkerAttr,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(w), Some(a)) = (unsafe { worker.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_WORKER_ATTR_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_THREAD_MODE != 0 {
        a.thread_mode = UCS_THREAD_MODE_SINGLE;
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_ADDRESS != 0 {
        // ADDRESS_FLAGS (NET_ONLY) is an input: rucx's address lists every transport, and
        // each peer picks the ones that reach it.
        let bytes = packed_address(w);
        let p = malloc_copy(&bytes);
        if p.is_null() {
            return UCS_ERR_NO_MEMORY;
        }
        a.address = p;
        a.address_length = bytes.len();
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER != 0 {
        a.max_am_header = 0;
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_NAME != 0 {
        fill_name(&mut a.name, &format!("rucx:{}", std::process::id()));
    }
    if a.field_mask & UCP_WORKER_ATTR_FIELD_MAX_INFO_STRING != 0 {
        a.max_debug_string = 0;
    }
    UCS_OK
}

/// `ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
/// size_t *address_length_p)`.
///
/// # Safety
/// `worker` NULL or live; the out pointers NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_get_address(
    worker: *const AbiWorker,
    address_p: *mut *mut c_void,
    length_p: *mut usize,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if address_p.is_null() || length_p.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    let bytes = packed_address(w);
    let p = malloc_copy(&bytes);
    if p.is_null() {
        return UCS_ERR_NO_MEMORY;
    }
    // SAFETY: checked non-NULL, writable by the caller's promise.
    unsafe {
        *address_p = p;
        *length_p = bytes.len();
    }
    UCS_OK
}

/// `void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address)`.
///
/// # Safety
/// `address` NULL or from `ucp_worker_query`/`ucp_worker_get_address`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_release_address(
    _worker: *const AbiWorker,
    address: *mut c_void,
) {
    // SAFETY: `malloc`ed by this library (or NULL, which free ignores).
    unsafe { libc::free(address) };
}

/// `ucs_status_t ucp_worker_fence(ucp_worker_h worker)`: rucx keeps each endpoint's operations
/// in order already.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_worker_fence(worker: *const AbiWorker) -> Status {
    if worker.is_null() {
        UCS_ERR_INVALID_PARAM
    } else {
        UCS_OK
    }
}

/// Progress until no send of this worker is in flight.
pub(crate) fn flush(w: &AbiWorker) {
    while w.sends_in_flight() {
        w.progress();
    }
}

/// `ucs_status_ptr_t ucp_worker_flush_nb(ucp_worker_h worker, unsigned flags,
/// ucp_send_callback_t cb)`: completes in place (returns NULL) once the worker's sends ended.
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_flush_nb(
    worker: *const AbiWorker,
    _flags: c_uint,
    _cb: SendCb,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { worker.as_ref() } {
        Some(w) => {
            flush(w);
            std::ptr::null_mut()
        }
        None => status_ptr(UCS_ERR_INVALID_PARAM),
    }
}

/// `ucs_status_ptr_t ucp_worker_flush_nbx(ucp_worker_h worker, const ucp_request_param_t
/// *param)`: as [`ucp_worker_flush_nb`].
///
/// # Safety
/// `worker` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_flush_nbx(
    worker: *const AbiWorker,
    _param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { ucp_worker_flush_nb(worker, 0, None) }
}
