//! Request memory, UCX's way: the pointer a caller gets (or hands in with
//! `UCP_OP_ATTR_FIELD_REQUEST`) points at the caller's area of `ucp_params_t::request_size`
//! bytes, and this library's header lies in the [`HEADER_SIZE`] bytes right before it (the size
//! `ucp_context_query` reports as `request_size`, which Open MPI's blocking calls allocate on
//! the stack: `alloca(request_size) + request_size`).
//!
//! Requests this library allocates come from a per-context pool: `request_init` runs once when
//! a block is first made, never again when it is reused (Open MPI resets its fields itself), and
//! `request_cleanup` runs when the context is cleaned up. A request is the caller's until it
//! both completed and was freed (`ucp_request_free`), in either order; a request freed before
//! completing gets no callback and goes back to the pool when it completes.
//!
//! The header records completion (status and, for receives, the tag and length), read by
//! `ucp_request_check_status` and `ucp_request_test`. `COMPLETED` is set only when the callback
//! is delivered (or, without a callback, when the operation ends), so a request freed after it
//! reads as complete has no callback left to deliver.

use std::alloc::Layout;
use std::cell::RefCell;
use std::ffi::c_void;

use crate::status::ptr_is_ptr;
use crate::types::*;
use crate::worker::Callback;

/// Bytes of this library's header before every request's caller area.
pub const HEADER_SIZE: usize = 64;

const MAGIC: u32 = 0x7275_6378;
const MAGIC_FREED: u32 = 0x6672_6565;

const COMPLETED: u32 = 1 << 0;
/// Freed by the caller before completing: recycle on completion, no callback.
const RELEASED: u32 = 1 << 1;
/// Allocated from the pool (not the caller's memory).
const POOLED: u32 = 1 << 2;

#[repr(C)]
#[derive(Debug)]
struct Header {
    magic: u32,
    flags: u32,
    status: i32,
    /// The callback's kind ([`cb_words`]), with `cb`.
    cb_kind: u32,
    info: TagRecvInfo,
    pool: *const Pool,
    /// The operation's token in its worker's table, plus one (0: none), for cancel.
    token: u64,
    /// The callback (its function and user data), for receives that have no entry in the
    /// worker's table (`crate::worker`'s header receives).
    cb: [usize; 2],
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_SIZE);

/// The request pool of one context, with the caller's request area size and callbacks.
#[derive(Debug)]
pub struct Pool {
    user_size: usize,
    init: RequestInitCb,
    cleanup: RequestCleanupCb,
    free: RefCell<Vec<*mut u8>>,
    /// Every block ever made (for cleanup at the end).
    made: RefCell<Vec<*mut u8>>,
}

impl Pool {
    pub fn new(user_size: usize, init: RequestInitCb, cleanup: RequestCleanupCb) -> Pool {
        Pool {
            user_size,
            init,
            cleanup,
            free: RefCell::new(Vec::new()),
            made: RefCell::new(Vec::new()),
        }
    }

    fn layout(&self) -> Layout {
        let user = self.user_size.div_ceil(16) * 16;
        Layout::from_size_align(HEADER_SIZE + user.max(16), 16).expect("request layout")
    }

    /// A request from the pool: its caller area (after `request_init` on first use).
    #[cfg(test)]
    pub fn alloc(&self) -> *mut c_void {
        self.alloc_for(None, Callback::None)
    }

    /// A request from the pool for the operation of `token` (noted for `ucp_request_cancel`),
    /// if any, with callback `cb`: its caller area (after `request_init` on first use).
    pub fn alloc_for(&self, token: Option<u64>, cb: Callback) -> *mut c_void {
        let block = match self.free.borrow_mut().pop() {
            Some(b) => b,
            None => {
                // SAFETY: the layout has a non-zero size.
                let b = unsafe { std::alloc::alloc_zeroed(self.layout()) };
                if b.is_null() {
                    std::alloc::handle_alloc_error(self.layout());
                }
                self.made.borrow_mut().push(b);
                // SAFETY: `b` is a fresh block of at least HEADER_SIZE + 16 bytes.
                let user = unsafe { b.add(HEADER_SIZE) }.cast::<c_void>();
                if let Some(init) = self.init {
                    // SAFETY: the caller's area of `user_size` bytes, as UCX hands it over.
                    unsafe { init(user) };
                }
                b
            }
        };
        let header = block.cast::<Header>();
        let (cb_kind, cb) = cb_words(cb);
        // SAFETY: the block starts with room for a header, 16-aligned.
        unsafe {
            header.write(Header {
                magic: MAGIC,
                flags: POOLED,
                status: i32::from(UCS_INPROGRESS),
                cb_kind,
                info: TagRecvInfo::default(),
                pool: self,
                token: token_word(token),
                cb,
            })
        };
        // SAFETY: within the block.
        unsafe { block.add(HEADER_SIZE) }.cast()
    }

    fn give_back(&self, user: *mut c_void) {
        // SAFETY: a pooled request's caller area starts HEADER_SIZE into its block.
        let block = unsafe { user.cast::<u8>().sub(HEADER_SIZE) };
        // SAFETY: the header is ours.
        unsafe { (*block.cast::<Header>()).magic = MAGIC_FREED };
        self.free.borrow_mut().push(block);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let layout = self.layout();
        for b in self.made.borrow_mut().drain(..) {
            if let Some(cleanup) = self.cleanup {
                // SAFETY: the caller area `request_init` ran on.
                unsafe { cleanup(b.add(HEADER_SIZE).cast()) };
            }
            // SAFETY: allocated with this layout in `alloc`.
            unsafe { std::alloc::dealloc(b, layout) };
        }
    }
}

/// Prepare the caller's own request memory (`UCP_OP_ATTR_FIELD_REQUEST`) for the operation of
/// `token`, if any (noted for `ucp_request_cancel` as [`set_token`] notes it), with callback
/// `cb`: the header before `user` is written fresh. Returns false for a pointer that cannot be
/// one.
///
/// # Safety
/// `user` points `HEADER_SIZE` bytes past the start of writable memory of at least that size.
#[inline]
pub unsafe fn init_provided_for(user: *mut c_void, token: Option<u64>, cb: Callback) -> bool {
    // SAFETY: forwarded.
    unsafe { write_provided(user, token, cb, 0, UCS_INPROGRESS) }
}

/// The caller's own request memory, prepared as a request that already ended with `UCS_OK`
/// (a send that ended in place): what [`init_provided_for`] and [`complete`] write, in one go.
///
/// # Safety
/// As for [`init_provided_for`].
#[inline]
pub unsafe fn init_provided_done(user: *mut c_void) -> bool {
    // SAFETY: forwarded.
    unsafe { write_provided(user, None, Callback::None, COMPLETED, UCS_OK) }
}

/// Whether `user` can be the caller's own request memory (`UCP_OP_ATTR_FIELD_REQUEST`): a
/// pointer (not NULL, not a status), 8-aligned, with room for a header before it in the
/// address space. Checked once per call, where its `ucp_request_param_t` is read
/// ([`crate::nbx::Opts::read`]).
#[inline]
pub fn provided_ok(user: *mut c_void) -> bool {
    ptr_is_ptr(user) && (user as usize).is_multiple_of(8) && (user as usize) >= HEADER_SIZE
}

/// Write a fresh header before `user`, the caller's request memory.
///
/// # Safety
/// As for [`init_provided_for`].
#[inline]
unsafe fn write_provided(
    user: *mut c_void,
    token: Option<u64>,
    cb: Callback,
    flags: u32,
    status: Status,
) -> bool {
    if !provided_ok(user) {
        return false;
    }
    let (cb_kind, cb) = cb_words(cb);
    // SAFETY: the caller's promise: HEADER_SIZE writable bytes before `user`.
    unsafe {
        user.cast::<u8>()
            .sub(HEADER_SIZE)
            .cast::<Header>()
            .write(Header {
                magic: MAGIC,
                flags,
                status: i32::from(status),
                cb_kind,
                info: TagRecvInfo::default(),
                pool: std::ptr::null(),
                token: token_word(token),
                cb,
            })
    };
    true
}

/// The header of a request pointer handed back by a caller, if it is one of ours and live.
///
/// # Safety
/// `user` is a pointer this library returned (or was handed as request memory), or anything
/// whose preceding `HEADER_SIZE` bytes are readable.
#[inline]
unsafe fn header<'a>(user: *mut c_void) -> Option<&'a mut Header> {
    if !ptr_is_ptr(user) || !(user as usize).is_multiple_of(8) || (user as usize) < HEADER_SIZE {
        return None;
    }
    // SAFETY: the caller's promise; the magic tells ours from anything else.
    let h = unsafe { &mut *user.cast::<u8>().sub(HEADER_SIZE).cast::<Header>() };
    (h.magic == MAGIC).then_some(h)
}

/// The header's token word: the token plus one, 0 for none.
#[inline]
fn token_word(token: Option<u64>) -> u64 {
    token.map_or(0, |t| t + 1)
}

/// Note the token of the operation request `user` completes (for `ucp_request_cancel`).
///
/// # Safety
/// `user` is a live request of this library.
pub unsafe fn set_token(user: *mut c_void, token: u64) {
    // SAFETY: forwarded.
    if let Some(h) = unsafe { header(user) } {
        h.token = token + 1;
    }
}

/// The token noted by [`set_token`], if any.
///
/// # Safety
/// As for [`header`].
pub unsafe fn token(user: *mut c_void) -> Option<u64> {
    // SAFETY: forwarded.
    unsafe { header(user) }.and_then(|h| h.token.checked_sub(1))
}

/// A callback as the header keeps it: its kind, function (0: none) and user data.
#[inline(always)]
fn cb_words(cb: Callback) -> (u32, [usize; 2]) {
    let f = |p: Option<usize>| p.unwrap_or(0);
    match cb {
        Callback::None => (0, [0, 0]),
        Callback::Send(g) => (1, [f(g.map(|g| g as usize)), 0]),
        Callback::SendNbx(g, d) => (2, [f(g.map(|g| g as usize)), d as usize]),
        Callback::Recv(g) => (3, [f(g.map(|g| g as usize)), 0]),
        Callback::RecvNbx(g, d) => (4, [f(g.map(|g| g as usize)), d as usize]),
        Callback::Length(g, d) => (5, [f(g.map(|g| g as usize)), d as usize]),
        Callback::StreamRecv(g) => (6, [f(g.map(|g| g as usize)), 0]),
    }
}

/// The callback header `h` keeps.
#[inline(always)]
fn cb_of(h: &Header) -> Callback {
    let [f, d] = h.cb;
    let d = d as *mut c_void;
    // SAFETY: `f` is 0 or the address of a function of the type the kind names, written by
    // `cb_words` from that very type (an optional function pointer: 0 is `None`).
    unsafe {
        match h.cb_kind {
            1 => Callback::Send(std::mem::transmute::<usize, SendCb>(f)),
            2 => Callback::SendNbx(std::mem::transmute::<usize, SendNbxCb>(f), d),
            3 => Callback::Recv(std::mem::transmute::<usize, RecvCb>(f)),
            4 => Callback::RecvNbx(std::mem::transmute::<usize, RecvNbxCb>(f), d),
            5 => Callback::Length(std::mem::transmute::<usize, LengthCb>(f), d),
            6 => Callback::StreamRecv(std::mem::transmute::<usize, StreamRecvCb>(f)),
            _ => Callback::None,
        }
    }
}

/// Where a request stands: `UCS_INPROGRESS`, or its final status and receive information.
///
/// # Safety
/// As for [`header`].
#[inline]
pub unsafe fn state(user: *mut c_void) -> Result<(Status, TagRecvInfo), Status> {
    // SAFETY: forwarded.
    let h = unsafe { header(user) }.ok_or(UCS_ERR_INVALID_PARAM)?;
    if h.flags & COMPLETED == 0 {
        return Ok((UCS_INPROGRESS, TagRecvInfo::default()));
    }
    Ok((h.status as Status, h.info))
}

/// Record the end of a request. Returns true when the caller should get its callback (it has
/// not freed the request); a request freed earlier goes back to its pool here.
///
/// # Safety
/// `user` is a live request of this library.
#[inline]
pub unsafe fn complete(user: *mut c_void, status: Status, info: TagRecvInfo) -> bool {
    // SAFETY: forwarded.
    let Some(h) = (unsafe { header(user) }) else {
        return false;
    };
    h.status = i32::from(status);
    h.info = info;
    h.flags |= COMPLETED;
    if h.flags & RELEASED != 0 {
        let pool = h.pool;
        // SAFETY: RELEASED is set only on pooled requests, whose pool outlives them.
        unsafe { (*pool).give_back(user) };
        return false;
    }
    true
}

/// Record the end of a request and take the callback its header keeps: `None`
/// when there is none to run (the caller freed the request first; it went back to its pool).
///
/// # Safety
/// As for [`complete`].
#[inline]
pub unsafe fn complete_take_cb(
    user: *mut c_void,
    status: Status,
    info: TagRecvInfo,
) -> Option<Callback> {
    // SAFETY: forwarded.
    let h = unsafe { header(user) }?;
    let cb = cb_of(h);
    h.status = i32::from(status);
    h.info = info;
    h.flags |= COMPLETED;
    if h.flags & RELEASED != 0 {
        let pool = h.pool;
        // SAFETY: RELEASED is set only on pooled requests, whose pool outlives them.
        unsafe { (*pool).give_back(user) };
        return None;
    }
    Some(cb)
}

/// `ucp_request_free`: a completed pooled request goes back now, a pending one when it
/// completes (without a callback). Caller memory is never freed. Returns false for a pointer
/// that is not a live request.
///
/// # Safety
/// As for [`header`].
pub unsafe fn free(user: *mut c_void) -> bool {
    // SAFETY: forwarded.
    let Some(h) = (unsafe { header(user) }) else {
        return false;
    };
    if h.flags & POOLED == 0 {
        // The caller's own memory: nothing to give back.
        return true;
    }
    if h.flags & COMPLETED != 0 {
        let pool = h.pool;
        // SAFETY: a pooled request's pool outlives it.
        unsafe { (*pool).give_back(user) };
    } else {
        h.flags |= RELEASED;
    }
    true
}

/// True when the caller freed the request before it completed.
#[cfg(test)]
///
/// # Safety
/// As for [`header`].
pub unsafe fn released(user: *mut c_void) -> bool {
    // SAFETY: forwarded.
    unsafe { header(user) }.is_some_and(|h| h.flags & RELEASED != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static INITS: AtomicUsize = AtomicUsize::new(0);
    static CLEANUPS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn init(p: *mut c_void) {
        INITS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the caller area is 24 bytes here.
        unsafe { p.cast::<u64>().write(0xabcd) };
    }
    unsafe extern "C" fn cleanup(_: *mut c_void) {
        CLEANUPS.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn pool_inits_once_and_recycles() {
        let pool = Pool::new(24, Some(init), Some(cleanup));
        let a = pool.alloc();
        assert_eq!(INITS.load(Ordering::SeqCst), 1);
        // SAFETY: `a` is a live request of `pool`.
        unsafe {
            assert_eq!(*a.cast::<u64>(), 0xabcd);
            assert_eq!(state(a), Ok((UCS_INPROGRESS, TagRecvInfo::default())));
            // Freed before completion: completion recycles it, no callback.
            assert!(free(a));
            assert!(released(a));
            assert!(!complete(a, UCS_OK, TagRecvInfo::default()));
            assert_eq!(state(a), Err(UCS_ERR_INVALID_PARAM));
        }
        let b = pool.alloc();
        assert_eq!(a, b, "recycled");
        assert_eq!(
            INITS.load(Ordering::SeqCst),
            1,
            "request_init runs once per block"
        );
        let info = TagRecvInfo {
            sender_tag: 7,
            length: 3,
        };
        // SAFETY: `b` is live.
        unsafe {
            assert!(complete(b, UCS_ERR_CANCELED, info));
            assert_eq!(state(b), Ok((UCS_ERR_CANCELED, info)));
            assert!(free(b));
            assert!(!free(b), "a second free finds no live request");
        }
        drop(pool);
        assert_eq!(CLEANUPS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn provided_memory_and_bad_pointers() {
        let mut mem = [0u64; HEADER_SIZE / 8 + 4];
        // SAFETY: HEADER_SIZE bytes before the pointer are in `mem`.
        let user = unsafe { mem.as_mut_ptr().add(HEADER_SIZE / 8) }.cast::<c_void>();
        // SAFETY: as above.
        unsafe {
            assert!(init_provided_for(user, None, Callback::None));
            assert_eq!(state(user).unwrap().0, UCS_INPROGRESS);
            assert!(complete(user, UCS_OK, TagRecvInfo::default()));
            assert_eq!(state(user).unwrap().0, UCS_OK);
            // Prepared as ended in place: complete at once, and freeing it frees nothing.
            assert!(init_provided_done(user));
            assert_eq!(state(user), Ok((UCS_OK, TagRecvInfo::default())));
            assert_eq!(token(user), None);
            assert!(free(user));
            assert!(init_provided_for(user, Some(5), Callback::None));
            assert_eq!(state(user).unwrap().0, UCS_INPROGRESS);
            assert_eq!(token(user), Some(5));
            assert_eq!(state(std::ptr::null_mut()), Err(UCS_ERR_INVALID_PARAM));
            assert_eq!(
                state(crate::status::status_ptr(UCS_ERR_NO_MEMORY)),
                Err(UCS_ERR_INVALID_PARAM)
            );
        }
    }

    unsafe extern "C" fn on_recv(_: *mut c_void, _: Status, _: *const TagRecvInfo, _: *mut c_void) {
    }
    unsafe extern "C" fn on_send(_: *mut c_void, _: Status) {}

    #[test]
    fn the_header_keeps_the_callback_it_was_made_with() {
        let pool = Pool::new(8, None, None);
        let data = 0x5eed_usize as *mut c_void;
        let recv: RecvNbxCb = Some(on_recv);
        let send: SendCb = Some(on_send);
        for cb in [
            Callback::None,
            Callback::RecvNbx(recv, data),
            Callback::RecvNbx(None, data),
            Callback::Send(send),
            Callback::SendNbx(None, std::ptr::null_mut()),
            Callback::Recv(None),
        ] {
            let r = pool.alloc_for(Some(3), cb);
            // SAFETY: `r` is a live request of `pool`, completed once.
            let back = unsafe { complete_take_cb(r, UCS_OK, TagRecvInfo::default()) }
                .expect("not freed: its callback is due");
            let same = match (cb, back) {
                (Callback::None, Callback::None) => true,
                (Callback::RecvNbx(a, d), Callback::RecvNbx(b, e)) => {
                    a.map(|f| f as usize) == b.map(|f| f as usize) && d == e
                }
                (Callback::Send(a), Callback::Send(b)) => {
                    a.map(|f| f as usize) == b.map(|f| f as usize)
                }
                (Callback::SendNbx(a, d), Callback::SendNbx(b, e)) => {
                    a.map(|f| f as usize) == b.map(|f| f as usize) && d == e
                }
                (Callback::Recv(a), Callback::Recv(b)) => {
                    a.map(|f| f as usize) == b.map(|f| f as usize)
                }
                _ => false,
            };
            assert!(same, "{cb:?} came back as {back:?}");
            // SAFETY: live, freed once.
            unsafe { assert!(free(r)) };
        }
        // Freed before it ended: no callback is due, and it went back to the pool.
        let r = pool.alloc_for(None, Callback::RecvNbx(recv, data));
        // SAFETY: live until completed (freed first, by its caller).
        unsafe {
            assert!(free(r));
            assert!(complete_take_cb(r, UCS_OK, TagRecvInfo::default()).is_none());
            assert_eq!(state(r), Err(UCS_ERR_INVALID_PARAM));
        }
    }
}
