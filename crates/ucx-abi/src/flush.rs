//! The flushes (`ucp_worker_flush_nb(x)`, `ucp_ep_flush_nb(x)`) without blocking: a flush is
//! posted, returns a request (or completes in place when nothing is outstanding), and ends from
//! `ucp_worker_progress`, as UCX's does; so a thread that progresses several workers (a client
//! and its server, a program and its peers' workers) can wait for it.
//!
//! A flush has two steps:
//!
//! 1. the worker's sends posted before it end (every send, put, get and atomic of this library
//!    in flight on the worker when the flush was posted: [`Ops::sends_before`]; a rendezvous
//!    send ends once its receiver took the data, which no lane flush covers);
//! 2. then the rucx flush of the endpoint ([`Worker::flush_queued`]), or of every endpoint of
//!    the worker ([`Worker::flush_all_queued`]): the lanes flushed, every staged put and get and
//!    every atomic (its answer in) ended. An endpoint still connecting (a client by socket
//!    address) is flushed once it is connected, behind what was posted on it meanwhile.
//!
//! The flush ends with the first error of the rucx flushes: a flush of an endpoint that failed
//! ends with its error, and a flush ends with the error of a put, get or atomic of its endpoint
//! (a worker flush: of any endpoint, failed ones included) that failed after it was posted and
//! that no flush reported yet (`crates/ucp`: `Peer::rma_error`): the loss of an implicit
//! (`nbi`) operation, whose request is released at once, is seen by the flush that follows.
//!
//! The rucx flushes' ends are queued with the token [`FLUSH_TOKEN`] | the flush's own token (the
//! table entry of its request, [`Pending`]), never a table token: the worker's delivery hands
//! them here ([`AbiWorker::flush_part_ended`]).
//!
//! [`Ops::sends_before`]: crate::worker::Ops::sends_before

use std::ffi::c_void;

use rucx_ucp::{Completion, EpId, Queued};
use rucx_ucs::{Error, Result};

use crate::nbx::Opts;
use crate::request;
use crate::status::{status_of, status_ptr};
use crate::tag::Finish;
use crate::worker::{AbiWorker, Pending, finish};

/// The bit of the tokens of the rucx flushes a flush of this library waits for (table tokens
/// are small indices; header tokens have bit 63).
pub const FLUSH_TOKEN: u64 = 1 << 62;

/// A flush in flight.
#[derive(Debug)]
pub struct FlushOp {
    /// The table token of its request.
    token: u64,
    /// The endpoint flushed (`None`: every endpoint of the worker).
    ep: Option<EpId>,
    /// Sends numbered below it were posted before it: they end first (step 1).
    seq: u64,
    /// The rucx flushes whose ends are still to come; `None` while in step 1.
    outstanding: Option<usize>,
    /// The first error of its rucx flushes.
    err: Option<Error>,
}

impl FlushOp {
    /// Take the next step if it can; its end once it ended.
    fn step(&mut self, w: &AbiWorker) -> Option<Result<()>> {
        if self.outstanding.is_none() {
            if w.ops.borrow().sends_before(self.seq) {
                return None;
            }
            let tok = FLUSH_TOKEN | self.token;
            let (n, err) = match self.ep {
                Some(ep) => match w.worker.flush_queued(ep, tok) {
                    Queued::Pending(_) => (1, None),
                    Queued::Ended(Ok(_)) => (0, None),
                    Queued::Ended(Err(e)) => (0, Some(e)),
                },
                None => w.worker.flush_all_queued(tok),
            };
            self.outstanding = Some(n);
            if let Some(e) = err {
                self.err.get_or_insert(e);
            }
        }
        (self.outstanding == Some(0)).then(|| self.err.take().map_or(Ok(()), Err))
    }
}

/// The end of a flush that ended well (nothing moved, no tag, no sender).
fn done() -> Completion {
    Completion {
        len: 0,
        tag: 0,
        sender: None,
    }
}

/// Post a flush of `ep` (every endpoint: `None`) of `w`: NULL when it ended in place (nothing
/// was outstanding), an error status pointer when it ended in place with an error, else its
/// request, which progress completes.
pub fn post(w: &AbiWorker, ep: Option<EpId>, opts: &Opts) -> *mut c_void {
    let (token, seq) = {
        let ops = w.ops.borrow();
        (ops.vacant(), ops.next_seq())
    };
    let mut f = FlushOp {
        token,
        ep,
        seq,
        outstanding: None,
        err: None,
    };
    // Nothing below fills the table (the rucx flushes only queue their ends): the token stays
    // vacant until it is filled here.
    let ended = f.step(w);
    match ended {
        Some(Ok(())) if !opts.no_imm => {
            if let Some(r) = opts.req {
                // SAFETY: checked by `Opts::read`; room for a header before it is the caller's
                // promise (`UCP_OP_ATTR_FIELD_REQUEST`).
                unsafe { request::init_provided_done(r) };
            }
            return std::ptr::null_mut();
        }
        Some(Err(e)) if !opts.no_imm => return status_ptr(status_of(&e)),
        _ => {}
    }
    let user = match opts.req {
        Some(r) => {
            // SAFETY: as above.
            unsafe { request::init_provided_for(r, Some(token), opts.cb) };
            r
        }
        None => w.context().pool.alloc_for(Some(token), opts.cb),
    };
    w.ops.borrow_mut().fill(
        token,
        Pending {
            user,
            cb: opts.cb,
            fin: Finish::Send,
            data: None,
            req: None,
            send: false,
            ended: None,
        },
    );
    match ended {
        // Ended in place, asked to complete through the request: at the next progress.
        Some(res) => w.ready.borrow_mut().push((token, res.map(|()| done()))),
        None => w.flushes.borrow_mut().push(f),
    }
    user
}

impl AbiWorker {
    /// A rucx flush of the flush of table token `token` ended with `res`.
    pub(crate) fn flush_part_ended(&self, token: u64, res: &Result<Completion>) {
        let mut fl = self.flushes.borrow_mut();
        let Some(f) = fl.iter_mut().find(|f| f.token == token) else {
            return;
        };
        if let Some(n) = f.outstanding.as_mut() {
            *n = n.saturating_sub(1);
        }
        if let Err(e) = res {
            f.err.get_or_insert_with(|| e.clone());
        }
    }

    /// Move the flushes in flight along and deliver those that ended; how many ended.
    #[inline(never)]
    pub(crate) fn advance_flushes(&self) -> usize {
        let mut list = std::mem::take(&mut *self.flushes.borrow_mut());
        let mut ended = Vec::new();
        list.retain_mut(|f| match f.step(self) {
            Some(res) => {
                ended.push((f.token, res));
                false
            }
            None => true,
        });
        {
            let mut fl = self.flushes.borrow_mut();
            list.append(&mut fl);
            *fl = list;
        }
        let mut n = 0;
        // With nothing of the worker borrowed: a callback may post (another flush too).
        for (token, res) in ended {
            let p = self.ops.borrow_mut().remove(token);
            if let Some(p) = p {
                finish(p, &res.map(|()| done()));
                n += 1;
            }
        }
        n
    }
}
