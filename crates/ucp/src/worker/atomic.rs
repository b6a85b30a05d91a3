//! Atomic operations on a peer's mapped memory (32- and 64-bit add, and, or, xor, swap and
//! compare-and-swap, fetching or not), and the blocking fence and flush of puts, gets and
//! atomics.
//!
//! No transport of rucx has network atomics (uct's lanes move bytes: put, get, active
//! messages), so every atomic is carried out by the target's worker in its progress, as UCX's
//! software atomics are: the initiator sends an [`AM_ATOMIC_REQ`] on the peer's
//! active-message lane; the target checks that the word lies inside a host region mapped by
//! its context ([`MapRegistry`]) and is naturally aligned, applies the operation with the CPU's
//! atomic instruction (so that it is atomic against the target's own threads and against other
//! peers' atomics), and answers with [`AM_ATOMIC_REP`] carrying the old value or why it
//! refused. Every atomic (fetching or not) is answered, so that a flush covers them.
//!
//! Ordering (see docs/protocols.md, "Atomics"): operations to one peer are not ordered among
//! themselves (puts and gets go on the RMA lane, atomics on the active-message lane). A flush
//! of a peer ends once every put, get and atomic posted to it before ended at the target (the
//! atomics answered); [`Worker::fence`] makes everything posted to a peer before it complete
//! before it returns (a strong fence: it progresses the worker until then), so what is posted
//! after it is carried out after.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rucx_uct::rkey::Reader;

use crate::scope::{Request, Scope};
use crate::worker::owned::Queued;
use crate::worker::prelude::*;

/// Atomic request: src, initiator's request, remote address, value, compare, then the
/// operation code and the operand size (4 or 8).
pub const AM_ATOMIC_REQ: AmId = 24;
/// Atomic answer: src, initiator's request, old value, then the outcome code
/// ([`Refusal`]; 0 for done).
pub const AM_ATOMIC_REP: AmId = 25;

/// An atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AtomicOp {
    /// `*p += value`.
    Add,
    /// `*p &= value`.
    And,
    /// `*p |= value`.
    Or,
    /// `*p ^= value`.
    Xor,
    /// `*p = value` (fetching: the old value back).
    Swap,
    /// `if *p == compare { *p = value }`; the old value back (fetching only).
    Cswap,
}

impl AtomicOp {
    /// Every operation.
    pub const ALL: [AtomicOp; 6] = [
        AtomicOp::Add,
        AtomicOp::And,
        AtomicOp::Or,
        AtomicOp::Xor,
        AtomicOp::Swap,
        AtomicOp::Cswap,
    ];

    fn code(self) -> u8 {
        self as u8
    }

    fn of_code(c: u8) -> Option<AtomicOp> {
        AtomicOp::ALL.into_iter().find(|o| o.code() == c)
    }

    /// The operation's name.
    pub fn name(self) -> &'static str {
        match self {
            AtomicOp::Add => "add",
            AtomicOp::And => "and",
            AtomicOp::Or => "or",
            AtomicOp::Xor => "xor",
            AtomicOp::Swap => "swap",
            AtomicOp::Cswap => "compare-and-swap",
        }
    }

    /// The new value of a word holding `old` (`compare` for [`AtomicOp::Cswap`]), in `size`
    /// bytes: what the target writes (a reference for tests and emulations).
    pub fn apply_to(self, old: u64, value: u64, compare: u64, size: u8) -> u64 {
        let mask = if size == 4 { u32::MAX as u64 } else { u64::MAX };
        let (old, value, compare) = (old & mask, value & mask, compare & mask);
        (match self {
            AtomicOp::Add => old.wrapping_add(value),
            AtomicOp::And => old & value,
            AtomicOp::Or => old | value,
            AtomicOp::Xor => old ^ value,
            AtomicOp::Swap => value,
            AtomicOp::Cswap if old == compare => value,
            AtomicOp::Cswap => old,
        }) & mask
    }
}

/// A word an atomic works on: `u32` or `u64`.
pub trait AtomicWord: Copy + Send + sealed::Sealed + 'static {
    /// Its size in bytes.
    const SIZE: u8;
    /// Widened to 64 bits.
    fn to_u64(self) -> u64;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

impl AtomicWord for u32 {
    const SIZE: u8 = 4;
    fn to_u64(self) -> u64 {
        self as u64
    }
}

impl AtomicWord for u64 {
    const SIZE: u8 = 8;
    fn to_u64(self) -> u64 {
        self
    }
}

/// Why a target refused an atomic (the outcome code of [`AM_ATOMIC_REP`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Refusal {
    /// The word is not inside a region the target's context mapped (or it was unmapped).
    NotMapped = 1,
    /// The address is not a multiple of the operand size.
    Misaligned = 2,
    /// The region is GPU memory (the target's CPU cannot apply atomics to it).
    GpuMemory = 3,
    /// Unknown operation or operand size.
    BadRequest = 4,
}

impl Refusal {
    fn of_code(c: u8) -> Refusal {
        match c {
            1 => Refusal::NotMapped,
            2 => Refusal::Misaligned,
            3 => Refusal::GpuMemory,
            _ => Refusal::BadRequest,
        }
    }

    fn error(self, op: &str, addr: u64, size: u8, peer: &str) -> Error {
        let what = format!("a {size}-byte atomic {op} at {addr:#x} on {peer}");
        match self {
            Refusal::NotMapped => Error::InvalidParam(format!(
                "{what}: refused by the target, the word is not inside a region it mapped"
            )),
            Refusal::Misaligned => Error::InvalidParam(format!(
                "{what}: refused by the target, the address is not aligned to {size} bytes"
            )),
            Refusal::GpuMemory => Error::Unsupported {
                what,
                why: "the target region is GPU memory; rucx applies atomics with the target's \
                      CPU, to host memory only"
                    .into(),
            },
            Refusal::BadRequest => {
                Error::InvalidParam(format!("{what}: refused by the target as malformed"))
            }
        }
    }
}

/// The regions a context mapped for remote access ([`Worker::mem_map`]), which the target of
/// an atomic checks every word against. A region leaves when its [`MemMap`](crate::MemMap)
/// is dropped; the lock is held while an atomic is applied, so a region is never unmapped
/// (and its memory freed by its owner) under an atomic.
#[derive(Default)]
pub(crate) struct MapRegistry {
    regions: Mutex<(u64, Vec<MappedRegion>)>,
}

#[derive(Clone, Copy, Debug)]
struct MappedRegion {
    id: u64,
    addr: usize,
    len: usize,
    gpu: bool,
}

impl MapRegistry {
    /// Enter a mapped region; its id for [`remove`](Self::remove).
    pub(crate) fn add(&self, addr: usize, len: usize, mem: MemoryType) -> u64 {
        let mut g = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        let id = g.0;
        g.1.push(MappedRegion {
            id,
            addr,
            len,
            gpu: mem.is_gpu(),
        });
        id
    }

    /// The region `id` was unmapped.
    pub(crate) fn remove(&self, id: u64) {
        let mut g = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        g.1.retain(|r| r.id != id);
    }

    /// Apply `op` to the `size`-byte word at `addr` if it lies inside a mapped host region and
    /// is aligned; the old value, or why not.
    pub(crate) fn apply(
        &self,
        op: AtomicOp,
        size: u8,
        addr: u64,
        value: u64,
        compare: u64,
    ) -> std::result::Result<u64, Refusal> {
        if size != 4 && size != 8 {
            return Err(Refusal::BadRequest);
        }
        let g = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        let end = addr.checked_add(size as u64).ok_or(Refusal::NotMapped)?;
        let region =
            g.1.iter()
                .find(|r| addr >= r.addr as u64 && end <= r.addr as u64 + r.len as u64)
                .ok_or(Refusal::NotMapped)?;
        if region.gpu {
            return Err(Refusal::GpuMemory);
        }
        if !addr.is_multiple_of(size as u64) {
            return Err(Refusal::Misaligned);
        }
        let ptr = addr as usize;
        let old = if size == 4 {
            // SAFETY: the word lies inside a live host region this context mapped for remote
            // access (its owner lent it to the map, which is not dropped while the lock is
            // held) and is aligned to 4 bytes; every access by rucx to it is atomic.
            let a = unsafe { AtomicU32::from_ptr(ptr as *mut u32) };
            let (v, c) = (value as u32, compare as u32);
            (match op {
                AtomicOp::Add => a.fetch_add(v, Ordering::SeqCst),
                AtomicOp::And => a.fetch_and(v, Ordering::SeqCst),
                AtomicOp::Or => a.fetch_or(v, Ordering::SeqCst),
                AtomicOp::Xor => a.fetch_xor(v, Ordering::SeqCst),
                AtomicOp::Swap => a.swap(v, Ordering::SeqCst),
                AtomicOp::Cswap => a
                    .compare_exchange(c, v, Ordering::SeqCst, Ordering::SeqCst)
                    .unwrap_or_else(|x| x),
            }) as u64
        } else {
            // SAFETY: as above, aligned to 8 bytes.
            let a = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
            match op {
                AtomicOp::Add => a.fetch_add(value, Ordering::SeqCst),
                AtomicOp::And => a.fetch_and(value, Ordering::SeqCst),
                AtomicOp::Or => a.fetch_or(value, Ordering::SeqCst),
                AtomicOp::Xor => a.fetch_xor(value, Ordering::SeqCst),
                AtomicOp::Swap => a.swap(value, Ordering::SeqCst),
                AtomicOp::Cswap => a
                    .compare_exchange(compare, value, Ordering::SeqCst, Ordering::SeqCst)
                    .unwrap_or_else(|x| x),
            }
        };
        Ok(old)
    }
}

/// An atomic request waiting for its answer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AtomicRma {
    pub(crate) op: AtomicOp,
    pub(crate) size: u8,
    pub(crate) remote: u64,
    /// Where the old value goes (`size` bytes of the caller's host memory), when fetching.
    pub(crate) result: Option<usize>,
}

fn encode_req(src: u64, areq: u64, a: &AtomicRma, value: u64, compare: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(42);
    wire::put_u64s(&mut b, &[src, areq, a.remote, value, compare]);
    b.push(a.op.code());
    b.push(a.size);
    b
}

/// A parsed [`AM_ATOMIC_REQ`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct AtomicReq {
    pub(crate) src: u64,
    pub(crate) areq: u64,
    pub(crate) addr: u64,
    pub(crate) value: u64,
    pub(crate) compare: u64,
    pub(crate) op: u8,
    pub(crate) size: u8,
}

pub(crate) fn parse_req(data: &[u8]) -> Result<AtomicReq> {
    let mut r = Reader::new(data, "atomic request");
    let req = AtomicReq {
        src: r.u64()?,
        areq: r.u64()?,
        addr: r.u64()?,
        value: r.u64()?,
        compare: r.u64()?,
        op: r.u8()?,
        size: r.u8()?,
    };
    r.finish()?;
    Ok(req)
}

pub(crate) fn encode_rep(src: u64, areq: u64, old: u64, code: u8) -> Vec<u8> {
    let mut b = Vec::with_capacity(25);
    wire::put_u64s(&mut b, &[src, areq, old]);
    b.push(code);
    b
}

fn parse_rep(data: &[u8]) -> Result<(u64, u64, u64, u8)> {
    let mut r = Reader::new(data, "atomic answer");
    let v = (r.u64()?, r.u64()?, r.u64()?, r.u8()?);
    r.finish()?;
    Ok(v)
}

impl State {
    /// Send raw control message `id` to peer `p` behind its queued work (as
    /// [`send_msg`](Self::send_msg) does for [`Msg`]s), and post what is queued.
    pub(crate) fn send_raw(&mut self, p: usize, id: AmId, bytes: Vec<u8>) {
        self.queue_ctrl(p, id, bytes);
        self.pump(p);
    }

    /// An atomic message ([`AM_ATOMIC_REQ`] or [`AM_ATOMIC_REP`]); `None`: another message.
    pub(crate) fn on_atomic_am(&mut self, id: AmId, data: &[u8]) -> Option<Result<()>> {
        match id {
            AM_ATOMIC_REQ => Some(self.on_atomic_req(data)),
            AM_ATOMIC_REP => Some(self.on_atomic_rep(data)),
            _ => None,
        }
    }

    /// A peer asks for an atomic: applied when the word lies inside a region this context
    /// mapped and is aligned; answered either way.
    fn on_atomic_req(&mut self, data: &[u8]) -> Result<()> {
        let req = parse_req(data)?;
        let p = self.src_peer(req.src)?;
        let out = match AtomicOp::of_code(req.op) {
            Some(op) => self
                .ctx
                .maps()
                .apply(op, req.size, req.addr, req.value, req.compare),
            None => Err(Refusal::BadRequest),
        };
        let (old, code) = match out {
            Ok(old) => (old, 0),
            Err(r) => {
                tracing::debug!(
                    "refused an atomic of {} at {:#x} ({} bytes): {r:?}",
                    self.peers[p].remote.describe(),
                    req.addr,
                    req.size
                );
                self.count("atomic refused");
                (0, r as u8)
            }
        };
        if code == 0 {
            self.count("atomic applied for a peer");
        }
        let src = self.address.uuid;
        self.send_raw(p, AM_ATOMIC_REP, encode_rep(src, req.areq, old, code));
        Ok(())
    }

    /// The answer to one of our atomics: the old value goes to its result, the request ends.
    /// An answer naming a request that is not a pending atomic to that peer is refused.
    fn on_atomic_rep(&mut self, data: &[u8]) -> Result<()> {
        let (src, areq, old, code) = parse_rep(data)?;
        let p = self.src_peer(src)?;
        let (op, size, remote, result) = match self.reqs.get(&areq) {
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        peer,
                        path: RmaPath::Atomic(a),
                        ..
                    }),
                result: None,
                ..
            }) if *peer == p => (a.op, a.size, a.remote, a.result),
            // Ended already (its peer failed meanwhile): a late answer is dropped.
            Some(Req {
                kind:
                    ReqKind::Rma(RmaState {
                        peer,
                        path: RmaPath::Atomic(_),
                        ..
                    }),
                result: Some(_),
                ..
            }) if *peer == p => return Ok(()),
            None => return Ok(()),
            _ => {
                return Err(Error::InvalidParam(format!(
                    "an atomic answer from peer {p} names request {areq:#x}, which is not an \
                     atomic of ours to that peer"
                )));
            }
        };
        if code != 0 {
            let peer = self.peers[p].remote.describe();
            let e = Refusal::of_code(code).error(op.name(), remote, size, &peer);
            self.fail(areq, e);
            return Ok(());
        }
        if let Some(at) = result {
            if size == 4 {
                let v = (old as u32).to_ne_bytes();
                // SAFETY: the result word is the caller's host memory lent to the request (its
                // scope, or the queued form's contract) until it ends, which is now.
                unsafe { host_slice_mut(at, 4) }.copy_from_slice(&v);
            } else {
                // SAFETY: as above.
                unsafe { host_slice_mut(at, 8) }.copy_from_slice(&old.to_ne_bytes());
            }
        }
        self.finish_ok(areq, size as usize);
        Ok(())
    }
}

/// What an atomic post asks for (checked by [`Worker::post_atomic`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AtomicArgs {
    pub(crate) op: AtomicOp,
    pub(crate) size: u8,
    pub(crate) value: u64,
    pub(crate) compare: u64,
    /// Where the old value goes (fetching).
    pub(crate) result: Option<usize>,
}

impl Worker {
    /// Post an atomic to `ep` on the word at `remote` of `rkey`'s region.
    pub(crate) fn post_atomic(
        &self,
        ep: EpId,
        a: AtomicArgs,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Result<Posted> {
        let what = || {
            format!(
                "a {}-byte atomic {} at {remote:#x} on {ep}",
                a.size,
                a.op.name()
            )
        };
        if a.size != 4 && a.size != 8 {
            return Err(Error::InvalidParam(format!(
                "{}: operands are 4 or 8 bytes",
                what()
            )));
        }
        if a.op == AtomicOp::Cswap && a.result.is_none() {
            return Err(Error::InvalidParam(format!(
                "{}: a compare-and-swap fetches (it has no post form)",
                what()
            )));
        }
        if rkey.mem_type().is_gpu() {
            return Err(Error::Unsupported {
                what: what(),
                why: format!(
                    "the remote region is {} memory; rucx applies atomics with the target's \
                     CPU, to host memory only",
                    rkey.mem_type()
                ),
            });
        }
        rkey.check(remote, a.size as u64)?;
        if !remote.is_multiple_of(a.size as u64) {
            return Err(Error::InvalidParam(format!(
                "{}: the address is not aligned to {} bytes",
                what(),
                a.size
            )));
        }
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        self.ensure_plan(&mut st, p);
        let state = AtomicRma {
            op: a.op,
            size: a.size,
            remote,
            result: a.result,
        };
        let src = st.address.uuid;
        let id = st.reqs.insert_with(|| Req {
            kind: ReqKind::Rma(RmaState {
                peer: p,
                dir: RmaDir::Put,
                len: a.size as usize,
                path: RmaPath::Atomic(state),
            }),
            result: None,
            outstanding: 0,
            guards: Vec::new(),
        });
        let bytes = encode_req(src, id, &state, a.value, a.compare);
        st.count("atomic by active message");
        st.send_raw(p, AM_ATOMIC_REQ, bytes);
        Ok(Posted::Pending(id))
    }

    /// Post an atomic whose end is queued with `token` (the form the C ABI posts, as
    /// [`Worker::tag_send_queued`]): `op` on the `size`-byte (4 or 8) word at `remote` of
    /// `rkey`'s region, with `value` (and `compare` for [`AtomicOp::Cswap`]); with `result`,
    /// the old value is written there (`size` bytes, native order) before the end is
    /// reported. The result memory is the request's, under [`RawBuf::new`]'s contract, until
    /// its end was reported.
    ///
    /// [`RawBuf::new`]: rucx_ucs::RawBuf::new
    #[allow(clippy::too_many_arguments)]
    pub fn atomic_queued(
        &self,
        ep: EpId,
        op: AtomicOp,
        size: u8,
        value: u64,
        compare: u64,
        result: Option<rucx_ucs::RawBuf>,
        remote: u64,
        rkey: &RkeyBundle,
        token: u64,
    ) -> Queued {
        if let Some(r) = &result
            && (r.len() != size as usize || r.info().is_some_and(|i| i.mem_type.is_gpu()))
        {
            return Queued::Ended(Err(Error::InvalidParam(format!(
                "an atomic's result is {size} bytes of host memory ({} given)",
                r.len()
            ))));
        }
        let args = AtomicArgs {
            op,
            size,
            value,
            compare,
            result: result.map(|r| r.addr()),
        };
        let posted = self.post_atomic(ep, args, remote, rkey);
        self.adopt_queued(posted, token)
    }

    /// A put (`put`) or get of the memory of `buf` against `remote` of `rkey`'s region,
    /// its end queued with `token` (see [`Scope::put`]); the memory is the request's as for
    /// [`atomic_queued`](Self::atomic_queued).
    pub fn rma_queued(
        &self,
        ep: EpId,
        put: bool,
        buf: rucx_ucs::RawBuf,
        remote: u64,
        rkey: &RkeyBundle,
        token: u64,
    ) -> Queued {
        let b = RecvBuf::of_raw(&buf);
        let posted = self
            .post_rma(ep, put, (b.addr, b.len, b.mem), remote, rkey)
            .map(Posted::Pending);
        self.adopt_queued(posted, token)
    }

    /// Complete everything posted to `ep` (every usable endpoint: `None`) so far, remotely
    /// too: puts landed, gets read, atomics applied and answered. Progresses the worker until
    /// then; the first error of a flush is returned (the others still ran to their end).
    ///
    /// A flush also reports what was lost before it: it ends with the error of a put, get or
    /// atomic to its endpoint that failed after it was posted (refused by the target, a
    /// transport error, the peer failed) and that no flush reported yet, even when that
    /// request's own end was seen. With `None`, endpoints that failed are not flushed, but
    /// such an error of theirs is reported (once), so that a worker flush after the loss of
    /// implicit operations never says all is well.
    pub fn flush_wait(&self, ep: Option<EpId>) -> Result<()> {
        let mut first = None;
        let ids: Vec<Result<u64>> = {
            let mut st = self.st.borrow_mut();
            let peers: Vec<usize> = match ep {
                Some(e) => match st.check_ep(e) {
                    Ok(p) => vec![p],
                    Err(err) => {
                        if let Ok(p) = st.ep_index(e) {
                            st.take_rma_error(p);
                        }
                        return Err(err);
                    }
                },
                None => {
                    let mut usable = Vec::new();
                    for p in 0..st.peers.len() {
                        if st.check_peer(p).is_ok() {
                            usable.push(p);
                        } else if let Some(e) = st.take_rma_error(p) {
                            first.get_or_insert(e);
                        }
                    }
                    usable
                }
            };
            peers.into_iter().map(|p| st.post_flush(p)).collect()
        };
        for id in ids {
            let r = match id {
                Ok(id) => {
                    let r = self.wait_req(id, None);
                    self.st.borrow_mut().reqs.remove(&id);
                    r.map(|_| ())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Flush every endpoint of the worker without waiting, as [`flush_wait`](Self::flush_wait)
    /// with `None` does, each flush's end queued with `token` (the form the C ABI posts): the
    /// usable endpoints, and those still connecting (their flush waits for the connection,
    /// behind what was posted on them meanwhile). Returns how many ends will be queued, and
    /// the first error known now: a flush refused at once, or the unreported error of a put,
    /// get or atomic of an endpoint that failed (taken: reported once).
    pub fn flush_all_queued(&self, token: u64) -> (usize, Option<Error>) {
        let mut first = None;
        let eps: Vec<EpId> = {
            let mut st = self.st.borrow_mut();
            let mut eps = Vec::new();
            for p in 0..st.peers.len() {
                let peer = &st.peers[p];
                let connecting = peer.cm_pending && peer.failed.is_none() && peer.closed.is_none();
                if connecting || st.check_peer(p).is_ok() {
                    eps.push(st.ep_id(p));
                } else if let Some(e) = st.take_rma_error(p) {
                    first.get_or_insert(e);
                }
            }
            eps
        };
        let mut pending = 0;
        for ep in eps {
            match self.flush_queued(ep, token) {
                Queued::Pending(_) => pending += 1,
                Queued::Ended(Err(e)) => {
                    first.get_or_insert(e);
                }
                Queued::Ended(Ok(_)) => {}
            }
        }
        (pending, first)
    }

    /// A fence on `ep` (every usable endpoint: `None`): whatever is posted to it after the
    /// fence is carried out at the target after whatever was posted before. rucx's fence is
    /// strong: it returns once everything posted before completed ([`flush_wait`](Self::flush_wait)).
    pub fn fence(&self, ep: Option<EpId>) -> Result<()> {
        self.flush_wait(ep)
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Apply `op` with `value` to the word (`u32` or `u64`, by `T`) at `remote` of `rkey`'s
    /// region on `ep`, without fetching (UCX's `ucp_atomic_post`; [`AtomicOp::Cswap`] has no
    /// post form and is refused). The request ends once the target applied it (or refused it:
    /// the word is not inside a region it mapped, or not aligned: `InvalidParam`). The
    /// remote region must be host memory (GPU memory: `Unsupported`).
    pub fn atomic_post<T: AtomicWord>(
        &'scope self,
        ep: EpId,
        op: AtomicOp,
        value: T,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Request<'scope> {
        let a = AtomicArgs {
            op,
            size: T::SIZE,
            value: value.to_u64(),
            compare: 0,
            result: None,
        };
        self.track_posted(self.worker().post_atomic(ep, a, remote, rkey))
    }

    /// Apply `op` with `value` to the word at `remote` of `rkey`'s region on `ep` and fetch
    /// its old value into `result` (UCX's `ucp_atomic_fetch_nb`): `result` holds it once the
    /// request ended. For [`AtomicOp::Cswap`], see [`atomic_cswap`](Self::atomic_cswap).
    pub fn atomic_fetch<T: AtomicWord>(
        &'scope self,
        ep: EpId,
        op: AtomicOp,
        value: T,
        result: &'scope mut T,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Request<'scope> {
        let a = AtomicArgs {
            op,
            size: T::SIZE,
            value: value.to_u64(),
            compare: 0,
            result: Some(result as *mut T as usize),
        };
        self.track_posted(self.worker().post_atomic(ep, a, remote, rkey))
    }

    /// Compare-and-swap: if the word at `remote` equals `compare`, it becomes `swap`; its old
    /// value lands in `result` either way.
    pub fn atomic_cswap<T: AtomicWord>(
        &'scope self,
        ep: EpId,
        compare: T,
        swap: T,
        result: &'scope mut T,
        remote: u64,
        rkey: &RkeyBundle,
    ) -> Request<'scope> {
        let a = AtomicArgs {
            op: AtomicOp::Cswap,
            size: T::SIZE,
            value: swap.to_u64(),
            compare: compare.to_u64(),
            result: Some(result as *mut T as usize),
        };
        self.track_posted(self.worker().post_atomic(ep, a, remote, rkey))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_round_trip_and_short_ones_are_refused() {
        let a = AtomicRma {
            op: AtomicOp::Cswap,
            size: 4,
            remote: 0x1000,
            result: None,
        };
        let b = encode_req(7, 9, &a, 5, 6);
        assert_eq!(
            parse_req(&b).unwrap(),
            AtomicReq {
                src: 7,
                areq: 9,
                addr: 0x1000,
                value: 5,
                compare: 6,
                op: AtomicOp::Cswap.code(),
                size: 4
            }
        );
        for n in 0..b.len() {
            assert!(parse_req(&b[..n]).is_err(), "{n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(parse_req(&long).is_err());
        let r = encode_rep(1, 2, 3, 0);
        assert_eq!(parse_rep(&r).unwrap(), (1, 2, 3, 0));
        for n in 0..r.len() {
            assert!(parse_rep(&r[..n]).is_err(), "{n}");
        }
    }

    #[test]
    fn the_registry_applies_inside_aligned_host_regions_only() {
        let reg = MapRegistry::default();
        let mut buf = vec![0u64; 4];
        let addr = buf.as_mut_ptr() as usize;
        let id = reg.add(addr, 32, MemoryType::Host);
        let a = addr as u64;
        assert_eq!(reg.apply(AtomicOp::Add, 8, a + 8, 5, 0), Ok(0));
        assert_eq!(reg.apply(AtomicOp::Add, 8, a + 8, 5, 0), Ok(5));
        assert_eq!(reg.apply(AtomicOp::Cswap, 4, a, 9, 1), Ok(0), "no swap");
        assert_eq!(reg.apply(AtomicOp::Cswap, 4, a, 9, 0), Ok(0), "swapped");
        assert_eq!(reg.apply(AtomicOp::Swap, 4, a, 1, 0), Ok(9));
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, a + 32, 1, 0),
            Err(Refusal::NotMapped)
        );
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, a + 28, 1, 0),
            Err(Refusal::NotMapped),
            "straddles the end"
        );
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, a.wrapping_sub(8), 1, 0),
            Err(Refusal::NotMapped)
        );
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, u64::MAX - 3, 1, 0),
            Err(Refusal::NotMapped)
        );
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, a + 4, 1, 0),
            Err(Refusal::Misaligned)
        );
        assert_eq!(
            reg.apply(AtomicOp::Add, 2, a, 1, 0),
            Err(Refusal::BadRequest)
        );
        reg.remove(id);
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, a, 1, 0),
            Err(Refusal::NotMapped)
        );
        assert_eq!(buf, [1, 10, 0, 0]);
        let gpu = reg.add(0x10_0000, 4096, MemoryType::Cuda);
        assert_eq!(
            reg.apply(AtomicOp::Add, 8, 0x10_0000, 1, 0),
            Err(Refusal::GpuMemory)
        );
        reg.remove(gpu);
    }

    #[test]
    fn apply_to_matches_the_cpu_for_every_op_and_width() {
        let reg = MapRegistry::default();
        let mut w = [0u64; 1];
        let a = w.as_mut_ptr() as usize;
        let id = reg.add(a, 8, MemoryType::Host);
        for op in AtomicOp::ALL {
            for size in [4u8, 8] {
                for (old, value, compare) in [
                    (u64::MAX, 1, 0),
                    (0x1234_5678_9abc_def0, 0x0f0f_0f0f_f0f0_f0f0, 0x9abc_def0),
                    (7, 7, 7),
                ] {
                    let mask = if size == 4 { u32::MAX as u64 } else { u64::MAX };
                    w[0] = 0;
                    reg.apply(AtomicOp::Swap, size, a as u64, old, 0).unwrap();
                    let got = reg.apply(op, size, a as u64, value, compare).unwrap();
                    assert_eq!(got, old & mask, "{op:?} {size}");
                    let now = reg.apply(AtomicOp::Or, size, a as u64, 0, 0).unwrap();
                    assert_eq!(
                        now,
                        op.apply_to(old, value, compare, size),
                        "{op:?} {size} {old:#x} {value:#x} {compare:#x}"
                    );
                }
            }
        }
        reg.remove(id);
    }
}
