//! Tag matching: send (nb, nbr, nbx, sync nb, sync nbx), receive (nb, nbr, nbx), probe and
//! matched-message receive (`ucp_tag_probe_nb` with `remove`, `ucp_tag_msg_recv_nb(x)`), and
//! the request calls (test, check_status, cancel, free).
//!
//! The returned pointer follows UCX's convention: NULL when the operation ended in place
//! (sends without `UCP_OP_ATTR_FLAG_NO_IMM_CMPL`, and receives that asked for it with
//! `UCP_OP_ATTR_FIELD_RECV_INFO`), an error status (`UCS_PTR_IS_ERR`) when it was refused, or a
//! request. Receives otherwise always return a request.
//!
//! A probed message taken out of matching (`remove`) is received at once into a buffer of
//! ours (by its exact tag, which only it can match first), and copied to the caller's buffer by
//! `ucp_tag_msg_recv_nb(x)`; that copy is a CPU copy, so matched receives into GPU memory are
//! refused with `UCS_ERR_UNSUPPORTED`.

use std::ffi::c_void;

use rucx_ucp::Completion;
use rucx_ucs::{MemInfo, Result};

use crate::datatype::{Dt, Unpack, classify, contig_len, is_iov, pack_all};
use crate::endpoint::AbiEp;
use crate::engine::{self, Buf};
use crate::iov::{Iov, Plan};
use crate::nbx::CbKind;
use crate::request;
use crate::status::{status_of, status_ptr};
use crate::types::*;
use crate::worker::{AbiWorker, Callback, Pending};
use rucx_ucp::Queued;

/// What to make of an operation's result when it ends.
#[derive(Debug)]
pub enum Finish {
    Send,
    Recv,
    /// A generic-type receive (unpack what landed in our buffer) or an IOV one of several
    /// entries (scatter it over them). One boxed variant for both: the contiguous ends (and
    /// the drop of a `Finish`) stay as they were.
    RecvUnpack(Box<Unpacked>),
    /// A matched-message receive: copy what landed in our buffer to the caller's.
    MsgCopy(Box<(Dest, TagRecvInfo)>),
}

/// Where a receive that landed in our buffer goes when it ends.
#[derive(Debug)]
pub enum Unpacked {
    Generic(Unpack),
    Iov(Iov),
}

/// Where a matched message goes.
#[derive(Debug)]
pub enum Dest {
    Contig(*mut u8, usize),
    Generic(Unpack),
    Iov(Iov),
}

fn info_of(c: &Completion) -> TagRecvInfo {
    TagRecvInfo {
        sender_tag: c.tag,
        length: c.len,
    }
}

/// The status and receive information of an end. A truncated message reports, as UCX does,
/// its sender's tag and its whole length (what the sender sent, not what fit): Open MPI makes
/// the status's source and tag of it.
#[inline]
fn result_status(res: &Result<Completion>) -> (Status, TagRecvInfo) {
    match res {
        Ok(c) => (UCS_OK, info_of(c)),
        Err(rucx_ucs::Error::Truncated { incoming, tag, .. }) => (
            UCS_ERR_MESSAGE_TRUNCATED,
            TagRecvInfo {
                sender_tag: tag.unwrap_or(0),
                length: *incoming,
            },
        ),
        // A stream receive its endpoint's end cut short: the bytes it holds go with the status
        // (UCX passes the received length to the stream callback with the error).
        Err(e @ rucx_ucs::Error::StreamIncomplete { received, .. }) => (
            status_of(e),
            TagRecvInfo {
                sender_tag: 0,
                length: *received,
            },
        ),
        Err(e) => (status_of(e), TagRecvInfo::default()),
    }
}

#[cfg(test)]
mod result_tests {
    use super::*;

    /// The received length of a stream receive cut short reaches the C caller with the status.
    #[test]
    fn a_cut_short_stream_receive_reports_its_length_with_the_status() {
        let e = rucx_ucs::Error::StreamIncomplete {
            received: 700,
            wanted: 1000,
            cause: Box::new(rucx_ucs::Error::Canceled),
        };
        let (status, info) = result_status(&Err(e));
        assert_eq!((status, info.length), (UCS_ERR_CANCELED, 700));
    }
}

impl Finish {
    /// The final status and receive information of an operation that ended with `res`
    /// (`data`: our buffer, when it had one).
    #[inline(always)]
    pub fn run(self, res: &Result<Completion>, data: Option<Vec<u8>>) -> (Status, TagRecvInfo) {
        let (status, info) = result_status(res);
        match self {
            Finish::Send => (status, TagRecvInfo::default()),
            Finish::Recv => (status, info),
            other => other.run_ours(status, info, data),
        }
    }

    /// [`Finish::run`] of the ends with a buffer of ours (generic types, IOVs of several
    /// entries, matched messages): out of line, off the contiguous path.
    #[cold]
    #[inline(never)]
    fn run_ours(
        self,
        status: Status,
        info: TagRecvInfo,
        data: Option<Vec<u8>>,
    ) -> (Status, TagRecvInfo) {
        match self {
            Finish::Send => (status, TagRecvInfo::default()),
            Finish::Recv => (status, info),
            Finish::RecvUnpack(u) => {
                let u = match *u {
                    Unpacked::Generic(u) => u,
                    Unpacked::Iov(iov) => return scatter_end(&iov, status, info, data),
                };
                if status != UCS_OK {
                    return (status, info);
                }
                let data = data.unwrap_or_default();
                let n = info.length.min(data.len());
                (u.unpack(&data[..n]), info)
            }
            Finish::MsgCopy(m) => {
                let (dest, probed) = *m;
                if status != UCS_OK {
                    return (status, probed);
                }
                let data = data.unwrap_or_default();
                let n = probed.length.min(data.len());
                match dest {
                    Dest::Contig(p, cap) => {
                        let k = n.min(cap);
                        // Nothing to copy for an empty message (whose buffer may be NULL,
                        // which even a copy of no bytes may not be handed).
                        if k > 0 {
                            // SAFETY: the caller's buffer holds `cap` bytes (its promise at
                            // `ucp_tag_msg_recv_nb`), and host memory (checked there).
                            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, k) };
                        }
                        if n > cap {
                            // As for any truncation: the sender's tag and whole length.
                            return (UCS_ERR_MESSAGE_TRUNCATED, probed);
                        }
                        (UCS_OK, probed)
                    }
                    Dest::Generic(u) => (u.unpack(&data[..n]), probed),
                    Dest::Iov(iov) => {
                        // SAFETY: the caller's entries, writable host memory (its promise at
                        // `ucp_tag_msg_recv_nb`; checked host there), apart from our buffer.
                        unsafe { iov.scatter(&data[..n]) };
                        if n > iov.total() {
                            return (UCS_ERR_MESSAGE_TRUNCATED, probed);
                        }
                        (UCS_OK, probed)
                    }
                }
            }
        }
    }
}

/// The end of an IOV receive of several entries: what arrived (all of it, the part that fit a
/// truncated message, or what a stream receive cut short holds) is at the start of our
/// buffer, and goes to the entries. Out of line: the contiguous ends stay as they were.
#[cold]
#[inline(never)]
fn scatter_end(
    iov: &Iov,
    status: Status,
    info: TagRecvInfo,
    data: Option<Vec<u8>>,
) -> (Status, TagRecvInfo) {
    let data = data.unwrap_or_default();
    let n = info.length.min(data.len());
    // SAFETY: the caller's entries, writable host memory until the receive ends (its promise;
    // checked host when posted), apart from our buffer.
    unsafe { iov.scatter(&data[..n]) };
    (status, info)
}

/// The memory of an IOV send ([`crate::iov`]): the one entry's, or the entries gathered.
///
/// # Safety
/// As [`crate::iov::plan`].
#[cold]
#[inline(never)]
unsafe fn iov_send_buf(
    w: &AbiWorker,
    buf: *const c_void,
    count: usize,
) -> std::result::Result<Buf, Status> {
    // SAFETY: forwarded.
    Ok(match unsafe { crate::iov::plan(w, buf, count, true) }? {
        Plan::Direct(addr, len) => Buf::Raw {
            addr,
            len,
            info: host_hint(w, addr, len),
        },
        Plan::Bounce(_, v) => Buf::Owned(v),
    })
}

/// The memory and end of an IOV receive ([`crate::iov`]): the one entry's, or a buffer of
/// ours scattered at the end.
///
/// # Safety
/// As [`crate::iov::plan`].
#[cold]
#[inline(never)]
unsafe fn iov_recv_buf(
    w: &AbiWorker,
    buf: *const c_void,
    count: usize,
) -> std::result::Result<(Buf, Finish), Status> {
    // SAFETY: forwarded.
    Ok(match unsafe { crate::iov::plan(w, buf, count, false) }? {
        Plan::Direct(addr, len) => (
            Buf::Raw {
                addr,
                len,
                info: host_hint(w, addr, len),
            },
            Finish::Recv,
        ),
        Plan::Bounce(iov, v) => (
            Buf::Owned(v),
            Finish::RecvUnpack(Box::new(Unpacked::Iov(iov))),
        ),
    })
}

/// The options of one call, from its arguments or its `ucp_request_param_t`.
#[derive(Debug, Clone, Copy)]
struct Opts {
    cb: Callback,
    dt: u64,
    /// The caller's own request memory (`UCP_OP_ATTR_FIELD_REQUEST`).
    req: Option<*mut c_void>,
    no_imm: bool,
    recv_info: Option<*mut TagRecvInfo>,
}

impl Opts {
    fn nb(cb: Callback, dt: u64) -> Opts {
        Opts {
            cb,
            dt,
            req: None,
            no_imm: false,
            recv_info: None,
        }
    }

    /// Read a `ucp_request_param_t` (NULL: defaults) as every nbx call does
    /// ([`crate::nbx::Opts::read`]), plus the tag receive's `recv_info`.
    ///
    /// # Safety
    /// `param` NULL or valid.
    unsafe fn nbx(param: *const RequestParam, recv: bool) -> std::result::Result<Opts, Status> {
        let kind = if recv { CbKind::Recv } else { CbKind::Send };
        // SAFETY: the caller's promise.
        let o = unsafe { crate::nbx::Opts::read(param, kind) }?;
        // SAFETY: the caller's promise.
        let recv_info = match unsafe { param.as_ref() } {
            Some(p) if p.op_attr_mask & UCP_OP_ATTR_FIELD_RECV_INFO != 0 => {
                // SAFETY: the union member of tag receives.
                Some(unsafe { p.recv_info.tag_info }).filter(|p| !p.is_null())
            }
            _ => None,
        };
        Ok(Opts {
            cb: o.cb,
            dt: o.dt,
            req: o.req,
            no_imm: o.no_imm,
            recv_info,
        })
    }
}

/// The request to hand out: the caller's own memory (its header prepared) or one of the pool.
///
/// # Safety
/// A provided request has `HEADER_SIZE` writable bytes before it.
unsafe fn request_for(w: &AbiWorker, opts: &Opts, token: Option<u64>) -> *mut c_void {
    match opts.req {
        Some(r) => {
            // SAFETY: checked by `check_provided` before the operation was posted; room for a
            // header before it is the caller's promise.
            unsafe { request::init_provided_for(r, token, opts.cb) };
            r
        }
        None => w.context().pool.alloc_for(token, opts.cb),
    }
}

/// The request of a header receive ([`crate::worker`]): the caller's memory or one of the
/// pool, its callback in its header, and its token (its address under
/// [`HEADER_TOKEN`](crate::worker::HEADER_TOKEN)), noted there for cancel.
///
/// # Safety
/// As for [`request_for`].
#[inline(always)]
unsafe fn header_request(w: &AbiWorker, opts: &Opts) -> (*mut c_void, u64) {
    match opts.req {
        Some(r) => {
            let token = crate::worker::header_token(r);
            // SAFETY: as for `request_for`.
            unsafe { request::init_provided_for(r, Some(token), opts.cb) };
            (r, token)
        }
        None => {
            let user = w.context().pool.alloc_for(None, opts.cb);
            let token = crate::worker::header_token(user);
            // SAFETY: a live request, just made.
            unsafe { request::set_token(user, token) };
            (user, token)
        }
    }
}

fn check_provided(opts: &Opts) -> bool {
    opts.req
        .is_none_or(|r| crate::status::ptr_is_ptr(r) && (r as usize).is_multiple_of(8))
}

/// The memory type of a caller's buffer, through the host-range cache ([`crate::memtype`])
/// where it is on; `None` for an empty buffer or when classification failed (the post then
/// reports the error).
#[inline]
pub(crate) fn host_hint(w: &AbiWorker, addr: usize, len: usize) -> Option<MemInfo> {
    let c = w.context();
    if len == 0 {
        return None;
    }
    if c.host_only {
        return Some(MemInfo::HOST);
    }
    if c.memtype_cache {
        return crate::memtype::classify(&c.ctx, &w.last_host, addr, len);
    }
    let (t, d) = c.ctx.detect(addr, len).ok()?;
    Some(MemInfo::new(t, d))
}

/// The request memory a caller handed in, marked complete (a send that ended in place).
fn complete_provided(opts: &Opts) {
    if let Some(r) = opts.req {
        // SAFETY: checked pointer with a header's room before it (caller's promise).
        unsafe { request::init_provided_done(r) };
    }
}

/// Post a tag send.
///
/// # Safety
/// `ep` NULL or live; `buf`/`count` describe memory of the datatype that stays valid until
/// the send ends.
#[inline(always)]
unsafe fn send(
    ep: *const AbiEp,
    buf: *const c_void,
    count: usize,
    tag: u64,
    sync: bool,
    opts: Opts,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(ep) = (unsafe { ep.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if !check_provided(&opts) {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let w = ep.worker();
    let data = match classify(opts.dt) {
        Ok(Dt::Contig(elem)) => match contig_len(elem, count) {
            Ok(len) if len == 0 || !buf.is_null() => Buf::Raw {
                addr: buf as usize,
                len,
                info: host_hint(w, buf as usize, len),
            },
            Ok(_) => return status_ptr(UCS_ERR_INVALID_PARAM),
            Err(s) => return status_ptr(s),
        },
        // SAFETY: the caller's promise on the type and buffer.
        Ok(Dt::Generic(g)) => Buf::Owned(unsafe { pack_all(g, buf, count) }),
        // Out of line, so that the contiguous path stays as it was.
        // SAFETY: the caller's promise on the entries and their memory.
        // Its options go field by field: `opts` itself, never in memory, stays in registers.
        Err(_) if is_iov(opts.dt) => {
            let o = (opts.cb, opts.dt, opts.req, opts.no_imm, opts.recv_info);
            // SAFETY: the caller's promise, passed on.
            return unsafe { send_iov(ep, buf, count, tag, sync, o) };
        }
        Err(s) => return status_ptr(s),
    };
    // SAFETY: the caller's promise, passed on.
    unsafe { send_posted(ep, w, data, tag, sync, opts) }
}

/// An IOV send ([`crate::iov`]), [`send`] off its contiguous path.
///
/// # Safety
/// As for [`send`].
#[cold]
#[inline(never)]
unsafe fn send_iov(
    ep: &AbiEp,
    buf: *const c_void,
    count: usize,
    tag: u64,
    sync: bool,
    o: (
        Callback,
        u64,
        Option<*mut c_void>,
        bool,
        Option<*mut TagRecvInfo>,
    ),
) -> *mut c_void {
    let opts = Opts {
        cb: o.0,
        dt: o.1,
        req: o.2,
        no_imm: o.3,
        recv_info: o.4,
    };
    let w = ep.worker();
    // SAFETY: the caller's promise on the entries and their memory.
    match unsafe { iov_send_buf(w, buf, count) } {
        // SAFETY: as above.
        Ok(data) => unsafe { send_posted(ep, w, data, tag, sync, opts) },
        Err(s) => status_ptr(s),
    }
}

/// The rest of [`send`], once its memory is known: sent in place when it can be, else
/// posted.
///
/// # Safety
/// As for [`send`]; `data` its memory.
#[inline(always)]
unsafe fn send_posted(
    ep: &AbiEp,
    w: &AbiWorker,
    data: Buf,
    tag: u64,
    sync: bool,
    opts: Opts,
) -> *mut c_void {
    // A small host message the lane takes now ends here, without an operation.
    if !sync
        && !opts.no_imm
        && let Buf::Raw { addr, len, info } = &data
        && (*len == 0 || *info == Some(MemInfo::HOST))
    {
        let bytes: &[u8] = if *len == 0 {
            &[]
        } else {
            // SAFETY: host memory (classified above) of the caller, readable for the call
            // (UCX's contract with its caller).
            unsafe { std::slice::from_raw_parts(*addr as *const u8, *len) }
        };
        // Not sent (or refused): the posted operation below takes it, and reports an error.
        if let Ok(true) = w.worker.tag_send_inline(ep.id, bytes, tag) {
            complete_provided(&opts);
            return std::ptr::null_mut();
        }
    }
    let mut data = data;
    let mut ops = w.ops.borrow_mut();
    let token = ops.vacant();
    // SAFETY: the caller's promise: the memory stays valid until the send ends; our buffer is
    // kept with the operation.
    let posted = unsafe { engine::send(&w.worker, ep.id, &mut data, tag, sync, token) };
    let (req, ended) = match posted {
        Queued::Pending(r) => (Some(r), None),
        Queued::Ended(res) if !opts.no_imm => {
            return match res {
                Ok(_) => {
                    complete_provided(&opts);
                    std::ptr::null_mut()
                }
                Err(e) => status_ptr(status_of(&e)),
            };
        }
        Queued::Ended(res) => (None, Some(res)),
    };
    // SAFETY: as for `request_for`.
    let user = unsafe { request_for(w, &opts, Some(token)) };
    ops.fill(
        token,
        Pending {
            user,
            cb: opts.cb,
            fin: Finish::Send,
            data: owned_data(data),
            req,
            send: true,
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

/// Our buffer of an operation, kept with it until it ends.
fn owned_data(b: Buf) -> Option<Vec<u8>> {
    match b {
        Buf::Owned(v) => Some(v),
        Buf::Raw { .. } => None,
    }
}

/// Post a tag receive.
///
/// # Safety
/// `worker` NULL or live; `buf`/`count` describe writable memory of the datatype that stays
/// valid until the receive ends.
#[inline(always)]
unsafe fn recv(
    worker: *const AbiWorker,
    buf: *mut c_void,
    count: usize,
    tag: u64,
    mask: u64,
    opts: Opts,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if !check_provided(&opts) {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let (data, fin) = match classify(opts.dt) {
        Ok(Dt::Contig(elem)) => match contig_len(elem, count) {
            Ok(len) if len == 0 || !buf.is_null() => (
                Buf::Raw {
                    addr: buf as usize,
                    len,
                    info: host_hint(w, buf as usize, len),
                },
                Finish::Recv,
            ),
            Ok(_) => return status_ptr(UCS_ERR_INVALID_PARAM),
            Err(s) => return status_ptr(s),
        },
        Ok(Dt::Generic(g)) => {
            // SAFETY: the caller's promise on the type and buffer.
            let (u, size) = unsafe { Unpack::start(g, buf, count) };
            let fin = Finish::RecvUnpack(Box::new(Unpacked::Generic(u)));
            (Buf::Owned(vec![0u8; size]), fin)
        }
        // Out of line, so that the contiguous path stays as it was.
        // SAFETY: the caller's promise on the entries and their memory.
        Err(_) if is_iov(opts.dt) => return unsafe { recv_iov(w, buf, count, tag, mask, opts) },
        Err(s) => return status_ptr(s),
    };
    // SAFETY: the caller's promise, passed on.
    unsafe { recv_posted(w, data, fin, tag, mask, opts) }
}

/// An IOV receive ([`crate::iov`]), [`recv`] off its contiguous path.
///
/// # Safety
/// As for [`recv`].
#[cold]
#[inline(never)]
unsafe fn recv_iov(
    w: &AbiWorker,
    buf: *mut c_void,
    count: usize,
    tag: u64,
    mask: u64,
    opts: Opts,
) -> *mut c_void {
    // SAFETY: the caller's promise on the entries and their memory.
    match unsafe { iov_recv_buf(w, buf, count) } {
        // SAFETY: as above.
        Ok((data, fin)) => unsafe { recv_posted(w, data, fin, tag, mask, opts) },
        Err(s) => status_ptr(s),
    }
}

/// The rest of [`recv`], once its memory and end are known: posted.
///
/// # Safety
/// As for [`recv`]; `data` its memory.
#[inline(always)]
unsafe fn recv_posted(
    w: &AbiWorker,
    data: Buf,
    fin: Finish,
    tag: u64,
    mask: u64,
    opts: Opts,
) -> *mut c_void {
    let mut data = data;
    // The caller's memory, and a request made whether or not it ends while posted: a header
    // receive, with no entry in the table.
    if matches!(fin, Finish::Recv)
        && (opts.req.is_some() || opts.no_imm || opts.recv_info.is_none())
    {
        // SAFETY: as for `request_for`.
        let (user, token) = unsafe { header_request(w, &opts) };
        // SAFETY: the caller's promise: the memory stays valid until the receive ends.
        match unsafe { engine::recv(&w.worker, &mut data, tag, mask, token) } {
            Queued::Pending(_) => {}
            Queued::Ended(res) if matches!(opts.cb, Callback::None) => {
                let (status, info) = fin.run(&res, None);
                // SAFETY: `user` is a live request.
                unsafe { request::complete(user, status, info) };
            }
            // The callback runs from the next progress.
            Queued::Ended(res) => w.ready.borrow_mut().push((token, res)),
        }
        return user;
    }
    let mut ops = w.ops.borrow_mut();
    let token = ops.vacant();
    // SAFETY: the caller's promise: the memory stays valid until the receive ends; our buffer
    // is kept with the operation.
    let posted = unsafe { engine::recv(&w.worker, &mut data, tag, mask, token) };
    let (req, ended) = match posted {
        Queued::Pending(r) => (Some(r), None),
        Queued::Ended(res) => (None, Some(res)),
    };
    if let Some(res) = ended {
        drop(ops);
        if !opts.no_imm
            && opts.req.is_none()
            && let Some(ri) = opts.recv_info
        {
            let (status, info) = fin.run(&res, owned_data(data));
            // SAFETY: the caller's receive-information pointer, writable by its promise.
            unsafe { *ri = info };
            if status != UCS_OK {
                return status_ptr(status);
            }
            return std::ptr::null_mut();
        }
        // SAFETY: as for `request_for`.
        let user = unsafe { request_for(w, &opts, None) };
        if matches!(opts.cb, Callback::None) {
            let (status, info) = fin.run(&res, owned_data(data));
            // SAFETY: `user` is a live request.
            unsafe { request::complete(user, status, info) };
            return user;
        }
        // The callback runs from the next progress.
        // SAFETY: a live request, just made.
        unsafe { request::set_token(user, token) };
        w.ops.borrow_mut().fill(
            token,
            Pending {
                user,
                cb: opts.cb,
                fin,
                data: owned_data(data),
                req: None,
                send: false,
                ended: None,
            },
        );
        w.ready.borrow_mut().push((token, res));
        return user;
    }
    // SAFETY: as for `request_for`.
    let user = unsafe { request_for(w, &opts, Some(token)) };
    ops.fill(
        token,
        Pending {
            user,
            cb: opts.cb,
            fin,
            data: owned_data(data),
            req,
            send: false,
            ended: None,
        },
    );
    user
}

/// `ucs_status_ptr_t ucp_tag_send_nb(ucp_ep_h ep, const void *buffer, size_t count,
/// ucp_datatype_t datatype, ucp_tag_t tag, ucp_send_callback_t cb)`.
///
/// # Safety
/// UCX's contract: `ep` live, the buffer valid until the send ends.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_send_nb(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    datatype: u64,
    tag: u64,
    cb: SendCb,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe {
        send(
            ep,
            buffer,
            count,
            tag,
            false,
            Opts::nb(Callback::Send(cb), datatype),
        )
    }
}

/// `ucs_status_ptr_t ucp_tag_send_sync_nb(...)`: completes once a receive matched it.
///
/// # Safety
/// As for [`ucp_tag_send_nb`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_send_sync_nb(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    datatype: u64,
    tag: u64,
    cb: SendCb,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe {
        send(
            ep,
            buffer,
            count,
            tag,
            true,
            Opts::nb(Callback::Send(cb), datatype),
        )
    }
}

/// `ucs_status_t ucp_tag_send_nbr(ucp_ep_h ep, const void *buffer, size_t count,
/// ucp_datatype_t datatype, ucp_tag_t tag, void *req)`: the caller's request memory.
///
/// # Safety
/// As for [`ucp_tag_send_nb`]; `req` has `request_size` bytes before it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_send_nbr(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    datatype: u64,
    tag: u64,
    req: *mut c_void,
) -> Status {
    let mut opts = Opts::nb(Callback::None, datatype);
    opts.req = Some(req);
    // SAFETY: forwarded.
    let r = unsafe { send(ep, buffer, count, tag, false, opts) };
    if r.is_null() {
        UCS_OK
    } else if crate::status::ptr_is_err(r) {
        r as isize as Status
    } else {
        UCS_INPROGRESS
    }
}

/// `ucs_status_ptr_t ucp_tag_send_nbx(ucp_ep_h ep, const void *buffer, size_t count,
/// ucp_tag_t tag, const ucp_request_param_t *param)`.
///
/// # Safety
/// As for [`ucp_tag_send_nb`]; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_send_nbx(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    tag: u64,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { Opts::nbx(param, false) } {
        // SAFETY: forwarded.
        Ok(o) => unsafe { send(ep, buffer, count, tag, false, o) },
        Err(s) => status_ptr(s),
    }
}

/// `ucs_status_ptr_t ucp_tag_send_sync_nbx(...)`.
///
/// # Safety
/// As for [`ucp_tag_send_nbx`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_send_sync_nbx(
    ep: *const AbiEp,
    buffer: *const c_void,
    count: usize,
    tag: u64,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { Opts::nbx(param, false) } {
        // SAFETY: forwarded.
        Ok(o) => unsafe { send(ep, buffer, count, tag, true, o) },
        Err(s) => status_ptr(s),
    }
}

/// `ucs_status_ptr_t ucp_tag_recv_nb(ucp_worker_h worker, void *buffer, size_t count,
/// ucp_datatype_t datatype, ucp_tag_t tag, ucp_tag_t tag_mask, ucp_tag_recv_callback_t cb)`.
///
/// # Safety
/// UCX's contract: `worker` live, the buffer valid until the receive ends.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_recv_nb(
    worker: *const AbiWorker,
    buffer: *mut c_void,
    count: usize,
    datatype: u64,
    tag: u64,
    tag_mask: u64,
    cb: RecvCb,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe {
        recv(
            worker,
            buffer,
            count,
            tag,
            tag_mask,
            Opts::nb(Callback::Recv(cb), datatype),
        )
    }
}

/// `ucs_status_t ucp_tag_recv_nbr(..., void *req)`: the caller's request memory.
///
/// # Safety
/// As for [`ucp_tag_recv_nb`]; `req` has `request_size` bytes before it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_recv_nbr(
    worker: *const AbiWorker,
    buffer: *mut c_void,
    count: usize,
    datatype: u64,
    tag: u64,
    tag_mask: u64,
    req: *mut c_void,
) -> Status {
    let mut opts = Opts::nb(Callback::None, datatype);
    opts.req = Some(req);
    // SAFETY: forwarded.
    let r = unsafe { recv(worker, buffer, count, tag, tag_mask, opts) };
    if crate::status::ptr_is_err(r) {
        r as isize as Status
    } else {
        UCS_OK
    }
}

/// `ucs_status_ptr_t ucp_tag_recv_nbx(ucp_worker_h worker, void *buffer, size_t count,
/// ucp_tag_t tag, ucp_tag_t tag_mask, const ucp_request_param_t *param)`.
///
/// # Safety
/// As for [`ucp_tag_recv_nb`]; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_recv_nbx(
    worker: *const AbiWorker,
    buffer: *mut c_void,
    count: usize,
    tag: u64,
    tag_mask: u64,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { Opts::nbx(param, true) } {
        // SAFETY: forwarded.
        Ok(o) => unsafe { recv(worker, buffer, count, tag, tag_mask, o) },
        Err(s) => status_ptr(s),
    }
}

/// A message taken out of matching by `ucp_tag_probe_nb(.., remove = 1, ..)`: the token of
/// the receive of it into our buffer (an entry of the worker's table without a request until
/// `ucp_tag_msg_recv_nb(x)` gives one), and what the probe reported.
#[derive(Debug)]
pub struct Message {
    token: u64,
    info: TagRecvInfo,
}

/// What `ucp_tag_probe_nb` returns for a message found but left in place (only its being
/// non-NULL means anything).
static FOUND: u8 = 0;

/// `ucp_tag_message_h ucp_tag_probe_nb(ucp_worker_h worker, ucp_tag_t tag, ucp_tag_t
/// tag_mask, int remove, ucp_tag_recv_info_t *info)`.
///
/// # Safety
/// `worker` NULL or live; `info` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_probe_nb(
    worker: *const AbiWorker,
    tag: u64,
    tag_mask: u64,
    remove: std::ffi::c_int,
    info: *mut TagRecvInfo,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return std::ptr::null_mut();
    };
    // The probe progresses the worker itself: what it ended is queued for the next progress.
    let found = w.worker.probe(tag, tag_mask);
    let Some(c) = found else {
        return std::ptr::null_mut();
    };
    let found = info_of(&c);
    if !info.is_null() {
        // SAFETY: non-NULL, writable by the caller's promise.
        unsafe { *info = found };
    }
    if remove == 0 {
        return (&raw const FOUND).cast_mut().cast();
    }
    let mut data = Buf::Owned(vec![0u8; c.len]);
    let mut ops = w.ops.borrow_mut();
    let token = ops.vacant();
    // SAFETY: our own buffer, kept with the operation.
    let (req, ended) = match unsafe { engine::recv(&w.worker, &mut data, c.tag, u64::MAX, token) } {
        Queued::Pending(r) => (Some(r), None),
        Queued::Ended(res) => (None, Some(res)),
    };
    ops.fill(
        token,
        Pending {
            user: std::ptr::null_mut(),
            cb: Callback::None,
            fin: Finish::Recv,
            data: owned_data(data),
            req,
            send: false,
            ended: ended.map(Box::new),
        },
    );
    Box::into_raw(Box::new(Message { token, info: found })).cast()
}

/// Receive a message taken by a probe.
///
/// # Safety
/// `worker` live; `message` from `ucp_tag_probe_nb` with `remove`, received once; the buffer
/// valid until the receive ends.
unsafe fn msg_recv(
    worker: *const AbiWorker,
    buf: *mut c_void,
    count: usize,
    message: *mut c_void,
    opts: Opts,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Some(w) = (unsafe { worker.as_ref() }) else {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    };
    if message.is_null() || message == (&raw const FOUND).cast_mut().cast() {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    if !check_provided(&opts) {
        return status_ptr(UCS_ERR_INVALID_PARAM);
    }
    let dest = match classify(opts.dt) {
        Ok(Dt::Contig(elem)) => match contig_len(elem, count) {
            Ok(len) => {
                if len > 0 {
                    match w.context().ctx.detect(buf as usize, len) {
                        Ok((t, _)) if !t.is_gpu() => {}
                        _ => return status_ptr(UCS_ERR_UNSUPPORTED),
                    }
                }
                Dest::Contig(buf.cast(), len)
            }
            Err(s) => return status_ptr(s),
        },
        // SAFETY: the caller's promise on the type and buffer.
        Ok(Dt::Generic(g)) => Dest::Generic(unsafe { Unpack::start(g, buf, count) }.0),
        Err(_) if is_iov(opts.dt) => {
            // SAFETY: the caller's promise on the entries (read for the call).
            let iov = match unsafe { Iov::read(buf.cast(), count) } {
                Ok(iov) => iov,
                Err(s) => return status_ptr(s),
            };
            // The copy out is a CPU copy: every entry must be host memory.
            if let Err(s) = iov.check_host(w) {
                return status_ptr(s);
            }
            Dest::Iov(iov)
        }
        Err(s) => return status_ptr(s),
    };
    // SAFETY: made by `Box::into_raw` in `ucp_tag_probe_nb`, received once.
    let msg = unsafe { Box::from_raw(message.cast::<Message>()) };
    // SAFETY: as for `request_for`.
    let user = unsafe { request_for(w, &opts, Some(msg.token)) };
    let mut ops = w.ops.borrow_mut();
    let Some(p) = ops.get_mut(msg.token) else {
        drop(ops);
        // SAFETY: a live request, just made.
        unsafe { request::complete(user, UCS_ERR_INVALID_PARAM, TagRecvInfo::default()) };
        return user;
    };
    p.user = user;
    p.cb = opts.cb;
    p.fin = Finish::MsgCopy(Box::new((dest, msg.info)));
    let ended = p.ended.take();
    drop(ops);
    if let Some(res) = ended {
        // The message's receive ended before this call: delivered by the next progress.
        w.ready.borrow_mut().push((msg.token, *res));
    }
    user
}

/// `ucs_status_ptr_t ucp_tag_msg_recv_nb(ucp_worker_h worker, void *buffer, size_t count,
/// ucp_datatype_t datatype, ucp_tag_message_h message, ucp_tag_recv_callback_t cb)`.
///
/// # Safety
/// As for [`msg_recv`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_msg_recv_nb(
    worker: *const AbiWorker,
    buffer: *mut c_void,
    count: usize,
    datatype: u64,
    message: *mut c_void,
    cb: RecvCb,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe {
        msg_recv(
            worker,
            buffer,
            count,
            message,
            Opts::nb(Callback::Recv(cb), datatype),
        )
    }
}

/// `ucs_status_ptr_t ucp_tag_msg_recv_nbx(ucp_worker_h worker, void *buffer, size_t count,
/// ucp_tag_message_h message, const ucp_request_param_t *param)`.
///
/// # Safety
/// As for [`msg_recv`]; `param` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_msg_recv_nbx(
    worker: *const AbiWorker,
    buffer: *mut c_void,
    count: usize,
    message: *mut c_void,
    param: *const RequestParam,
) -> *mut c_void {
    // SAFETY: the caller's promise.
    match unsafe { Opts::nbx(param, true) } {
        // SAFETY: forwarded.
        Ok(o) => unsafe { msg_recv(worker, buffer, count, message, o) },
        Err(s) => status_ptr(s),
    }
}

/// `ucs_status_t ucp_request_check_status(void *request)`.
///
/// # Safety
/// `request` one this library returned (or was handed as request memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_check_status(request: *mut c_void) -> Status {
    // SAFETY: forwarded.
    match unsafe { request::state(request) } {
        Ok((s, _)) => s,
        Err(s) => s,
    }
}

/// `ucs_status_t ucp_tag_recv_request_test(void *request, ucp_tag_recv_info_t *info)`:
/// the status, and the message's information once complete.
///
/// # Safety
/// As for [`ucp_request_check_status`]; `info` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_tag_recv_request_test(
    request: *mut c_void,
    info: *mut TagRecvInfo,
) -> Status {
    // SAFETY: forwarded.
    match unsafe { request::state(request) } {
        Ok((s, i)) => {
            if s != UCS_INPROGRESS && !info.is_null() {
                // SAFETY: non-NULL, writable by the caller's promise.
                unsafe { *info = i };
            }
            s
        }
        Err(s) => s,
    }
}

/// `ucs_status_t ucp_request_test(void *request, ucp_tag_recv_info_t *info)` (the deprecated
/// name Open MPI calls).
///
/// # Safety
/// As for [`ucp_tag_recv_request_test`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_test(request: *mut c_void, info: *mut TagRecvInfo) -> Status {
    // SAFETY: forwarded.
    unsafe { ucp_tag_recv_request_test(request, info) }
}

/// `int ucp_request_is_completed(void *request)`.
///
/// # Safety
/// As for [`ucp_request_check_status`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_is_completed(request: *mut c_void) -> std::ffi::c_int {
    // SAFETY: forwarded.
    std::ffi::c_int::from(unsafe { ucp_request_check_status(request) } != UCS_INPROGRESS)
}

/// `void ucp_request_cancel(ucp_worker_h worker, void *request)`: a receive that has not
/// matched ends with `UCS_ERR_CANCELED` (its callback runs from progress); anything else goes
/// on.
///
/// # Safety
/// `worker` NULL or live; `request` NULL or one of its requests.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_cancel(worker: *const AbiWorker, request: *mut c_void) {
    // SAFETY: the caller's promise.
    if let Some(w) = unsafe { worker.as_ref() } {
        w.cancel(request);
    }
}

/// `void ucp_request_free(void *request)`.
///
/// # Safety
/// `request` NULL or one this library returned, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_free(request: *mut c_void) {
    // SAFETY: forwarded.
    unsafe { request::free(request) };
}

/// `void ucp_request_release(void *request)` (deprecated name of `ucp_request_free`).
///
/// # Safety
/// As for [`ucp_request_free`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_request_release(request: *mut c_void) {
    // SAFETY: forwarded.
    unsafe { request::free(request) };
}
