//! Posting the stream and active-message operations (`stream.rs`, `am.rs`): their
//! `ucp_request_param_t`, their request (the caller's memory or one of the pool), and their
//! entry in the worker's table, so that progress, `ucp_request_check_status`, `_free` and
//! `_cancel` treat them as they treat tag operations ([`crate::worker`]).

use std::ffi::c_void;

use rucx_ucp::{Completion, Queued, RawBuf, Worker};
use rucx_ucs::{MemInfo, Result};

use crate::iov::Plan;

use crate::request;
use crate::status::{ptr_is_ptr, status_of, status_ptr};
use crate::tag::Finish;
use crate::types::*;
use crate::worker::{AbiWorker, Callback, Pending};

/// Which member of the callback union an operation reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CbKind {
    /// `cb.send` (`ucp_send_nbx_callback_t`).
    Send,
    /// `cb.recv_stream` / `cb.recv_am` (a length).
    Length,
    /// `cb.recv` (`ucp_tag_recv_nbx_callback_t`: tag receives).
    Recv,
}

/// The options of one call, from its `ucp_request_param_t`.
#[derive(Debug, Clone, Copy)]
pub struct Opts {
    pub cb: Callback,
    pub dt: u64,
    pub flags: u32,
    /// The caller's own request memory (`UCP_OP_ATTR_FIELD_REQUEST`).
    pub req: Option<*mut c_void>,
    pub no_imm: bool,
}

impl Opts {
    /// Read a `ucp_request_param_t` (NULL: defaults): unknown bits and request memory that
    /// cannot be one are refused.
    ///
    /// # Safety
    /// `param` NULL or valid.
    pub unsafe fn read(
        param: *const RequestParam,
        kind: CbKind,
    ) -> std::result::Result<Opts, Status> {
        // SAFETY: the caller's promise.
        let Some(p) = (unsafe { param.as_ref() }) else {
            return Ok(Opts {
                cb: Callback::None,
                dt: 1 << UCP_DATATYPE_SHIFT,
                flags: 0,
                req: None,
                no_imm: false,
            });
        };
        let m = p.op_attr_mask;
        if m & !UCP_OP_ATTR_KNOWN != 0 {
            return Err(UCS_ERR_INVALID_PARAM);
        }
        let data = if m & UCP_OP_ATTR_FIELD_USER_DATA != 0 {
            p.user_data
        } else {
            std::ptr::null_mut()
        };
        let cb = if m & UCP_OP_ATTR_FIELD_CALLBACK == 0 {
            Callback::None
        } else {
            match kind {
                // SAFETY: every member of the union is an optional function pointer of the
                // same size; the call's kind names the one the caller wrote.
                CbKind::Send => Callback::SendNbx(unsafe { p.cb.send }, data),
                // SAFETY: as above.
                CbKind::Length => Callback::Length(unsafe { p.cb.length }, data),
                // SAFETY: as above.
                CbKind::Recv => Callback::RecvNbx(unsafe { p.cb.recv }, data),
            }
        };
        let req = (m & UCP_OP_ATTR_FIELD_REQUEST != 0).then_some(p.request);
        if req.is_some_and(|r| !ptr_is_ptr(r) || !(r as usize).is_multiple_of(8)) {
            return Err(UCS_ERR_INVALID_PARAM);
        }
        Ok(Opts {
            cb,
            dt: if m & UCP_OP_ATTR_FIELD_DATATYPE != 0 {
                p.datatype
            } else {
                1 << UCP_DATATYPE_SHIFT
            },
            flags: if m & UCP_OP_ATTR_FIELD_FLAGS != 0 {
                p.flags
            } else {
                0
            },
            req,
            no_imm: m & UCP_OP_ATTR_FLAG_NO_IMM_CMPL != 0,
        })
    }

    /// An IOV datatype ([`crate::iov`], read by [`iov_buf`]).
    #[inline]
    pub fn is_iov(&self) -> bool {
        self.dt & UCP_DATATYPE_CLASS_MASK == UCP_DATATYPE_IOV
    }

    /// The byte length of `count` elements of a contiguous datatype; other classes are
    /// refused (`UCS_ERR_UNSUPPORTED`: strided and generic types are served by the tag calls
    /// only; IOV ones through [`iov_buf`]), an element size of 0 or an overflow are invalid.
    pub fn contig_len(&self, count: usize) -> std::result::Result<usize, Status> {
        if self.dt & UCP_DATATYPE_CLASS_MASK != UCP_DATATYPE_CONTIG {
            return Err(UCS_ERR_UNSUPPORTED);
        }
        let elem = (self.dt >> UCP_DATATYPE_SHIFT) as usize;
        if elem == 0 {
            return Err(UCS_ERR_INVALID_PARAM);
        }
        elem.checked_mul(count).ok_or(UCS_ERR_INVALID_PARAM)
    }
}

impl Opts {
    /// The caller's `count` elements at `addr` as one contiguous buffer: [`Opts::contig_len`]
    /// and [`raw`] in one step, as every contiguous-only call reads its buffer.
    ///
    /// # Safety
    /// As [`raw`].
    pub unsafe fn contig_buf(
        &self,
        addr: *const c_void,
        count: usize,
    ) -> std::result::Result<RawBuf, Status> {
        let len = self.contig_len(count)?;
        // SAFETY: the caller's promise, passed on.
        unsafe { raw(addr, len) }
    }
}

/// An IOV buffer of a stream or active-message call ([`crate::iov`]) as rucx takes it, with
/// what its operation keeps: its end (a receive of several entries scatters) and our buffer.
///
/// # Safety
/// As [`crate::iov::plan`].
#[cold]
pub unsafe fn iov_buf(
    w: &AbiWorker,
    entries: *const c_void,
    count: usize,
    send: bool,
) -> std::result::Result<(RawBuf, Finish, Option<Vec<u8>>), Status> {
    let plain = if send { Finish::Send } else { Finish::Recv };
    // SAFETY: the caller's promise, passed on.
    match unsafe { crate::iov::plan(w, entries, count, send) }? {
        // SAFETY: the caller's promise on the entry's memory.
        Plan::Direct(addr, len) => Ok((unsafe { raw(addr as *const c_void, len) }?, plain, None)),
        Plan::Bounce(iov, mut v) => {
            // SAFETY: host memory of ours, kept with the operation (moving the vector does not
            // move its bytes) until it ends.
            let r = unsafe { RawBuf::new(v.as_mut_ptr() as usize, v.len(), Some(MemInfo::HOST)) };
            let fin = if send {
                Finish::Send
            } else {
                Finish::RecvUnpack(Box::new(crate::tag::Unpacked::Iov(iov)))
            };
            Ok((r, fin, Some(v)))
        }
    }
}

/// The object a call is made on (its worker or endpoint: NULL is invalid) and its request
/// parameters, read as [`Opts::read`] does: the first lines of every nbx call but the tag ones.
///
/// # Safety
/// `obj` NULL or live for `'a`; `param` NULL or valid.
pub unsafe fn target_and_opts<'a, T>(
    obj: *const T,
    param: *const RequestParam,
    kind: CbKind,
) -> std::result::Result<(&'a T, Opts), Status> {
    // SAFETY: the caller's promise.
    let t = unsafe { obj.as_ref() }.ok_or(UCS_ERR_INVALID_PARAM)?;
    // SAFETY: the caller's promise.
    let opts = unsafe { Opts::read(param, kind) }?;
    Ok((t, opts))
}

/// The caller's memory of `len` bytes at `addr` (NULL only when empty), classified by rucx.
///
/// # Safety
/// The memory stays valid (and unwritten by others) until the operation ends, UCX's contract.
pub unsafe fn raw(addr: *const c_void, len: usize) -> std::result::Result<RawBuf, Status> {
    if len > 0 && addr.is_null() {
        return Err(UCS_ERR_INVALID_PARAM);
    }
    // SAFETY: the caller's promise; an empty buffer is never touched.
    Ok(unsafe { RawBuf::new(addr as usize, len, None) })
}

/// Post an operation with `post(worker, token)` and hand out what UCX's calls return: NULL
/// when it ended in place (after `in_place` saw its end), an error status pointer when it was
/// refused, else its request, completed by progress. `send`: counted as a send in flight (for
/// flush).
#[inline]
pub fn post(
    w: &AbiWorker,
    opts: &Opts,
    send: bool,
    post: impl FnOnce(&Worker, u64) -> Queued,
    in_place: impl FnOnce(&Completion),
) -> *mut c_void {
    let fin = if send { Finish::Send } else { Finish::Recv };
    post_with(w, opts, send, fin, None, post, in_place)
}

/// [`post`] of an operation with its own end (`fin`, an IOV receive's scatter) and a buffer
/// of ours (`data`: what `post` hands rucx, kept with the operation until it ends).
pub fn post_with(
    w: &AbiWorker,
    opts: &Opts,
    send: bool,
    fin: Finish,
    data: Option<Vec<u8>>,
    post: impl FnOnce(&Worker, u64) -> Queued,
    in_place: impl FnOnce(&Completion),
) -> *mut c_void {
    let mut ops = w.ops.borrow_mut();
    let token = ops.vacant();
    let (req, ended): (_, Option<Result<Completion>>) = match post(&w.worker, token) {
        Queued::Pending(r) => (Some(r), None),
        Queued::Ended(res) if !opts.no_imm => {
            drop(ops);
            // An IOV receive's bytes go to their entries now (nothing to do for the others).
            let (status, _) = fin.run(&res, data);
            return match res {
                Ok(_) if status != UCS_OK => status_ptr(status),
                Ok(c) => {
                    in_place(&c);
                    if let Some(r) = opts.req {
                        // SAFETY: checked by `Opts::read`; room for a header before it is the
                        // caller's promise (`UCP_OP_ATTR_FIELD_REQUEST`).
                        unsafe { request::init_provided_done(r) };
                    }
                    std::ptr::null_mut()
                }
                Err(e) => status_ptr(status_of(&e)),
            };
        }
        Queued::Ended(res) => (None, Some(res)),
    };
    let user = match opts.req {
        Some(r) => {
            // SAFETY: as above.
            unsafe { request::init_provided_for(r, Some(token), opts.cb) };
            r
        }
        None => w.context().pool.alloc_for(Some(token), opts.cb),
    };
    ops.fill(
        token,
        Pending {
            user,
            cb: opts.cb,
            fin,
            data,
            req,
            send,
            ended: None,
        },
    );
    drop(ops);
    if let Some(res) = ended {
        // Ended while posted, asked to complete through the request: at the next progress.
        w.ready.borrow_mut().push((token, res));
    }
    user
}
