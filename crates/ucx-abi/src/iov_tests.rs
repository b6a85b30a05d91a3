//! IOV datatypes driven as a C caller would, in one process (two workers over posix): every
//! call that takes a datatype (tag send nb/nbr/nbx/sync, receive nb/nbr/nbx, in-place receive
//! information, probe + matched-message receive; stream send/receive; active-message payloads
//! and `ucp_am_recv_data_nbx`), over random splits of the same message on either side (IOV
//! on both, IOV on one and contiguous on the other), empty entries with NULL buffers, eager and
//! rendezvous sizes and truncation, every byte checked, and nothing written past an entry.

use std::ffi::c_void;
use std::sync::Mutex;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::am::*;
use crate::cs_tests::{context, worker};
use crate::endpoint::{AbiEp, ucp_ep_close_nbx};
use crate::iov::DtIov;
use crate::status::{ptr_is_err, ptr_is_ptr};
use crate::stream::*;
use crate::tag::*;
use crate::types::*;
use crate::worker::*;

/// One of these tests at a time (they share the handler's record).
static ONE: Mutex<()> = Mutex::new(());

/// What the receive side's memory holds where nothing was written.
const FILL: u8 = 0xa5;
/// Bytes after each piece, that no write may touch.
const GUARD: usize = 3;

struct Pair {
    ctx: *mut crate::context::AbiContext,
    w: [*mut AbiWorker; 2],
    ep: [*mut AbiEp; 2],
}

impl Pair {
    fn new() -> Pair {
        let ctx = context(c"posix");
        let w = [worker(ctx), worker(ctx)];
        // SAFETY: live workers.
        let ep = unsafe { crate::test_util::connect_both(w) };
        Pair { ctx, w, ep }
    }

    #[track_caller]
    fn drive(&self, mut done: impl FnMut() -> bool) {
        let t = std::time::Instant::now();
        while !done() {
            assert!(t.elapsed().as_secs() < 60, "no completion");
            // SAFETY: live workers.
            unsafe {
                ucp_worker_progress(self.w[0]);
                ucp_worker_progress(self.w[1]);
            }
        }
    }

    /// Progress until request `r` (NULL: ended in place) ends: its status and receive
    /// information (freed unless it is the caller's memory, `provided`).
    #[track_caller]
    fn wait(&self, r: *mut c_void, provided: bool) -> (Status, TagRecvInfo) {
        let mut info = TagRecvInfo::default();
        if r.is_null() {
            return (UCS_OK, info);
        }
        assert!(ptr_is_ptr(r), "an error: {}", r as isize);
        // SAFETY: a live request of this library until freed below.
        unsafe {
            self.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
            let s = ucp_tag_recv_request_test(r, &mut info);
            if !provided {
                ucp_request_free(r);
            }
            (s, info)
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let mut force: RequestParam =
            // SAFETY: all-zero is a valid RequestParam.
            unsafe { std::mem::zeroed() };
        force.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        force.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: live objects, closed once, endpoints before workers before the context.
        unsafe {
            for e in self.ep {
                assert!(ucp_ep_close_nbx(e, &force).is_null());
            }
            for w in self.w {
                ucp_worker_destroy(w);
            }
            crate::context::ucp_cleanup(self.ctx);
        }
    }
}

fn param(mask: u32) -> RequestParam {
    // SAFETY: all-zero is a valid RequestParam (NULL pointers, no callback).
    let mut p: RequestParam = unsafe { std::mem::zeroed() };
    p.op_attr_mask = mask;
    p
}

/// `param` with a datatype.
fn typed(mask: u32, dt: u64) -> RequestParam {
    let mut p = param(mask | UCP_OP_ATTR_FIELD_DATATYPE);
    p.datatype = dt;
    p
}

/// Request memory of the caller's (`UCP_OP_ATTR_FIELD_REQUEST`, `_nbr`): a header's room
/// before the pointer.
struct ReqMem(Box<[u64; crate::HEADER_SIZE / 8 + 2]>);

impl ReqMem {
    fn new() -> ReqMem {
        ReqMem(Box::new([0; crate::HEADER_SIZE / 8 + 2]))
    }
    fn ptr(&mut self) -> *mut c_void {
        // SAFETY: inside the array.
        unsafe { self.0.as_mut_ptr().add(crate::HEADER_SIZE / 8).cast() }
    }
}

/// One side's memory: contiguous, or IOV entries over pieces (an empty piece: an entry of
/// length 0 with a NULL buffer). Each piece has `GUARD` bytes after it.
struct Side {
    pieces: Vec<Vec<u8>>,
    lens: Vec<usize>,
    iov: Vec<DtIov>,
    contig: bool,
}

impl Side {
    /// `bytes` (a receive: `FILL`s of that length) cut at `cuts` (sorted, within it), or
    /// contiguous (`None`).
    fn new(bytes: &[u8], cuts: Option<&[usize]>) -> Side {
        let bounds: Vec<usize> = match cuts {
            None => vec![0, bytes.len()],
            Some(c) => std::iter::once(0)
                .chain(c.iter().map(|&c| c.min(bytes.len())))
                .chain([bytes.len()])
                .collect(),
        };
        let mut pieces = Vec::new();
        let mut lens = Vec::new();
        for w in bounds.windows(2) {
            let (a, b) = (w[0], w[1].max(w[0]));
            let mut p = bytes[a..b].to_vec();
            p.extend_from_slice(&[FILL; GUARD]);
            pieces.push(p);
            lens.push(b - a);
        }
        let iov = pieces
            .iter_mut()
            .zip(&lens)
            .map(|(p, &l)| DtIov {
                buffer: if l == 0 {
                    std::ptr::null_mut()
                } else {
                    p.as_mut_ptr().cast()
                },
                length: l,
            })
            .collect();
        Side {
            pieces,
            lens,
            iov,
            contig: cuts.is_none(),
        }
    }

    fn recv(cap: usize, cuts: Option<&[usize]>) -> Side {
        Side::new(&vec![FILL; cap], cuts)
    }

    fn ptr(&mut self) -> *mut c_void {
        if self.contig {
            self.pieces[0].as_mut_ptr().cast()
        } else {
            self.iov.as_mut_ptr().cast()
        }
    }

    fn count(&self) -> usize {
        if self.contig {
            self.lens[0]
        } else {
            self.iov.len()
        }
    }

    fn dt(&self) -> u64 {
        if self.contig {
            (1 << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG
        } else {
            UCP_DATATYPE_IOV
        }
    }

    fn total(&self) -> usize {
        self.lens.iter().sum()
    }

    /// The first bytes hold `expect`, the rest and every guard were not written.
    #[track_caller]
    fn check(&self, expect: &[u8]) {
        let mut got = Vec::new();
        for (p, &l) in self.pieces.iter().zip(&self.lens) {
            assert_eq!(&p[l..], &[FILL; GUARD], "written past an entry");
            got.extend_from_slice(&p[..l]);
        }
        assert_eq!(&got[..expect.len()], expect, "the bytes that arrived");
        assert!(
            got[expect.len()..].iter().all(|&b| b == FILL),
            "written past the message"
        );
    }
}

fn message(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Sorted cuts within `len` (repeats make empty entries).
fn cuts(raw: &[usize], len: usize) -> Vec<usize> {
    let mut c: Vec<usize> = raw.iter().map(|&c| c % (len + 1)).collect();
    c.sort_unstable();
    c
}

/// A send in flight: its request (NULL: done in place) and the caller's memory it may use.
struct Sent(*mut c_void, Option<ReqMem>);

/// Post a tag send of `s` in `form`: 0 nb, 1 nbr, 2 nbx, 3 sync nb, 4 sync nbx.
fn tag_send(p: &Pair, form: u8, s: &mut Side, tag: u64) -> Sent {
    let (buf, count, dt) = (s.ptr(), s.count(), s.dt());
    // SAFETY: live handles; `s` outlives the send (waited for by the caller).
    unsafe {
        match form {
            0 => Sent(ucp_tag_send_nb(p.ep[0], buf, count, dt, tag, None), None),
            1 => {
                let mut m = ReqMem::new();
                let st = ucp_tag_send_nbr(p.ep[0], buf, count, dt, tag, m.ptr());
                assert!(st == UCS_OK || st == UCS_INPROGRESS, "{st}");
                let r = if st == UCS_OK {
                    std::ptr::null_mut()
                } else {
                    m.ptr()
                };
                Sent(r, Some(m))
            }
            2 => Sent(
                ucp_tag_send_nbx(p.ep[0], buf, count, tag, &typed(0, dt)),
                None,
            ),
            3 => Sent(
                ucp_tag_send_sync_nb(p.ep[0], buf, count, dt, tag, None),
                None,
            ),
            _ => Sent(
                ucp_tag_send_sync_nbx(p.ep[0], buf, count, tag, &typed(0, dt)),
                None,
            ),
        }
    }
}

/// One tag message: `s` sent in `send_form`, received into `r` in `recv_form` (0 nb, 1 nbr,
/// 2 nbx, all posted before the send; 3 nbx with the information in place, 4 probe +
/// `msg_recv_nb`, 5 probe + `msg_recv_nbx`, after it arrived); every byte checked.
fn tag_case(p: &Pair, send_form: u8, recv_form: u8, msg: &[u8], s: &mut Side, r: &mut Side) {
    let tag = 0x1000 + u64::from(send_form) * 16 + u64::from(recv_form);
    let (buf, count, dt) = (r.ptr(), r.count(), r.dt());
    let mut mem = ReqMem::new();
    // SAFETY: live handles; the sides and request memory outlive the operations (waited for).
    let (status, info, sent) = unsafe {
        let early = |mem: &mut ReqMem| match recv_form {
            0 => (
                ucp_tag_recv_nb(p.w[1], buf, count, dt, tag, u64::MAX, None),
                false,
            ),
            1 => {
                let st = ucp_tag_recv_nbr(p.w[1], buf, count, dt, tag, u64::MAX, mem.ptr());
                assert_eq!(st, UCS_OK);
                (mem.ptr(), true)
            }
            _ => (
                ucp_tag_recv_nbx(p.w[1], buf, count, tag, u64::MAX, &typed(0, dt)),
                false,
            ),
        };
        if recv_form <= 2 {
            let (rr, provided) = early(&mut mem);
            assert!(ptr_is_ptr(rr), "a receive posted first is pending");
            let sent = tag_send(p, send_form, s, tag);
            let (st, info) = p.wait(rr, provided);
            (st, info, sent)
        } else {
            let sent = tag_send(p, send_form, s, tag);
            assert!(!ptr_is_err(sent.0), "send refused: {}", sent.0 as isize);
            if recv_form == 3 {
                let mut probed = TagRecvInfo::default();
                p.drive(|| !ucp_tag_probe_nb(p.w[1], tag, u64::MAX, 0, &mut probed).is_null());
                assert_eq!((probed.sender_tag, probed.length), (tag, msg.len()));
                let mut info = TagRecvInfo::default();
                let mut rp = typed(UCP_OP_ATTR_FIELD_RECV_INFO, dt);
                rp.recv_info.tag_info = &mut info;
                let rr = ucp_tag_recv_nbx(p.w[1], buf, count, tag, u64::MAX, &rp);
                if rr.is_null() || ptr_is_err(rr) {
                    let st = if rr.is_null() {
                        UCS_OK
                    } else {
                        rr as isize as Status
                    };
                    (st, info, sent)
                } else {
                    let (st, info) = p.wait(rr, false);
                    (st, info, sent)
                }
            } else {
                let mut m = std::ptr::null_mut();
                p.drive(|| {
                    m = ucp_tag_probe_nb(p.w[1], tag, u64::MAX, 1, std::ptr::null_mut());
                    !m.is_null()
                });
                let rr = if recv_form == 4 {
                    ucp_tag_msg_recv_nb(p.w[1], buf, count, dt, m, None)
                } else {
                    ucp_tag_msg_recv_nbx(p.w[1], buf, count, m, &typed(0, dt))
                };
                let (st, info) = p.wait(rr, false);
                (st, info, sent)
            }
        }
    };
    let (sst, _) = p.wait(sent.0, sent.1.is_some());
    assert_eq!(sst, UCS_OK, "the send ends well, truncated receive or not");
    let cap = r.total();
    let want = if msg.len() > cap {
        UCS_ERR_MESSAGE_TRUNCATED
    } else {
        UCS_OK
    };
    assert_eq!(status, want, "{} B into {cap} B", msg.len());
    assert_eq!(
        (info.sender_tag, info.length),
        (tag, msg.len()),
        "the sender's tag and the message's whole length, in bytes"
    );
    r.check(&msg[..msg.len().min(cap)]);
}

/// Where a side's memory is cut into entries (None: contiguous).
type Cuts = Option<Vec<usize>>;

/// A shape of one transfer: the message's length, the sender's and the receiver's cuts (None:
/// contiguous), and how much smaller (truncation) or larger the receive is.
fn shape(max: usize) -> impl Strategy<Value = (usize, Cuts, Cuts, i32)> {
    let cuts = proptest::option::weighted(0.8, proptest::collection::vec(0usize..100_000, 0..7));
    (0..max, cuts.clone(), cuts, -20i32..40)
}

#[test]
fn tag_messages_in_any_split_every_call_form() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let p = Pair::new();
    let mut runner = TestRunner::new(Config {
        cases: 160,
        failure_persistence: None,
        ..Config::default()
    });
    let strat = (shape(3000), 0u8..5, 0u8..6);
    runner
        .run(&strat, |((len, sc, rc, delta), sf, rf)| {
            if sc.is_none() && rc.is_none() {
                return Ok(()); // contiguous on both sides: other tests' business
            }
            let msg = message(len, sf ^ rf);
            let cap = (len as i64 + i64::from(delta)).max(0) as usize;
            let mut s = Side::new(&msg, sc.map(|c| cuts(&c, len)).as_deref());
            let mut r = Side::recv(cap, rc.map(|c| cuts(&c, cap)).as_deref());
            tag_case(&p, sf, rf, &msg, &mut s, &mut r);
            Ok(())
        })
        .unwrap();
}

/// Rendezvous sizes (the receive lands in our buffer and is scattered; the send is
/// gathered), truncated or not, and a single-entry IOV among empty ones (taken in place).
#[test]
fn large_tag_messages_gathered_and_scattered() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let p = Pair::new();
    let n = 3 << 20;
    let msg = message(n, 7);
    let c = |v: &[usize]| Some(v.to_vec());
    let cases: [(Cuts, usize, Cuts); 5] = [
        (
            c(&[1, 4096, 1 << 20, 1 << 20]),
            n,
            c(&[5, 777_777, 2 << 20]),
        ),
        (c(&[0, 0, n / 2]), n, None),
        (None, n, c(&[3, n - 3])),
        (c(&[100, 200_000]), n - 12345, c(&[50, 1 << 20, n - 20_000])),
        (c(&[0, n, n]), n + 10, c(&[0, 0, n + 10, n + 10])),
    ];
    for (sf, rf) in [(2u8, 2u8), (4, 0), (1, 1), (0, 4), (3, 5)] {
        for (sc, cap, rc) in &cases {
            let mut s = Side::new(&msg, sc.as_deref());
            let mut r = Side::recv(*cap, rc.as_deref());
            tag_case(&p, sf, rf, &msg, &mut s, &mut r);
        }
    }
}

#[test]
fn bad_iov_arrays_are_refused_by_every_call() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let p = Pair::new();
    let bad = [DtIov {
        buffer: std::ptr::null_mut(),
        length: 4,
    }];
    let dt = UCP_DATATYPE_IOV;
    let refused = |r: *mut c_void| r as isize == isize::from(UCS_ERR_INVALID_PARAM);
    let mut len = 0usize;
    // SAFETY: live handles; the calls refuse before they touch anything.
    unsafe {
        for (buf, count) in [(std::ptr::null(), 2usize), (bad.as_ptr(), 1)] {
            let b = buf.cast::<c_void>();
            let bm = b.cast_mut();
            assert!(refused(ucp_tag_send_nb(p.ep[0], b, count, dt, 1, None)));
            assert!(refused(ucp_tag_send_nbx(
                p.ep[0],
                b,
                count,
                1,
                &typed(0, dt)
            )));
            assert!(refused(ucp_tag_send_sync_nbx(
                p.ep[0],
                b,
                count,
                1,
                &typed(0, dt)
            )));
            assert!(refused(ucp_tag_recv_nb(p.w[1], bm, count, dt, 1, 0, None)));
            assert!(refused(ucp_tag_recv_nbx(
                p.w[1],
                bm,
                count,
                1,
                0,
                &typed(0, dt)
            )));
            assert!(refused(ucp_stream_send_nbx(
                p.ep[0],
                b,
                count,
                &typed(0, dt)
            )));
            let rp = typed(0, dt);
            assert!(refused(ucp_stream_recv_nbx(
                p.ep[1], bm, count, &mut len, &rp
            )));
            let sp = typed(0, dt);
            assert!(refused(ucp_am_send_nbx(
                p.ep[0],
                3,
                std::ptr::null(),
                0,
                b,
                count,
                &sp
            )));
        }
        // An empty IOV (no entries, NULL array) is an empty message.
        let r = ucp_tag_recv_nbx(p.w[1], std::ptr::null_mut(), 0, 2, u64::MAX, &typed(0, dt));
        let s = ucp_tag_send_nbx(p.ep[0], std::ptr::null(), 0, 2, &typed(0, dt));
        assert_eq!(p.wait(s, false).0, UCS_OK);
        let (st, info) = p.wait(r, false);
        assert_eq!((st, info.sender_tag, info.length), (UCS_OK, 2, 0));
    }
}

/// Stream bytes over random splits: sent as an IOV (or contiguous), received with WAITALL
/// into another split in two receives (the first smaller than the message: the rest stays
/// for the second), then a receive without WAITALL that takes what is there.
#[test]
fn stream_bytes_in_any_split() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let p = Pair::new();
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(
            &(shape(4000), 0usize..100_000),
            |((len, sc, rc, _), first)| {
                let msg = message(len, (first % 251) as u8);
                let k = first % (len + 1);
                let mut s = Side::new(&msg, sc.as_ref().map(|c| cuts(c, len)).as_deref());
                let mut r1 = Side::recv(k, rc.as_ref().map(|c| cuts(c, k)).as_deref());
                let mut r2 = Side::recv(len - k, rc.map(|c| cuts(&c, len - k)).as_deref());
                let wa = typed(UCP_OP_ATTR_FIELD_FLAGS, r1.dt());
                let mut wa = wa;
                wa.flags = UCP_STREAM_RECV_FLAG_WAITALL;
                let mut wa2 = typed(UCP_OP_ATTR_FIELD_FLAGS, r2.dt());
                wa2.flags = UCP_STREAM_RECV_FLAG_WAITALL;
                let (mut l1, mut l2) = (usize::MAX, usize::MAX);
                // SAFETY: live handles; the sides outlive the operations (waited for).
                unsafe {
                    let a = ucp_stream_recv_nbx(p.ep[1], r1.ptr(), r1.count(), &mut l1, &wa);
                    let st = ucp_stream_send_nbx(p.ep[0], s.ptr(), s.count(), &typed(0, s.dt()));
                    assert!(!ptr_is_err(st));
                    let b = ucp_stream_recv_nbx(p.ep[1], r2.ptr(), r2.count(), &mut l2, &wa2);
                    for (rq, l) in [(a, &mut l1), (b, &mut l2)] {
                        assert!(!ptr_is_err(rq), "{}", rq as isize);
                        if !rq.is_null() {
                            // The length comes with the callback (none here) and the request.
                            assert_eq!(p.wait(rq, false).0, UCS_OK);
                            *l = usize::MAX;
                        }
                    }
                    assert_eq!(p.wait(st, false).0, UCS_OK);
                }
                prop_assert!(l1 == usize::MAX || l1 == k, "bytes, not entries: {l1}");
                prop_assert!(l2 == usize::MAX || l2 == len - k);
                r1.check(&msg[..k]);
                r2.check(&msg[k..]);
                Ok(())
            },
        )
        .unwrap();

    // Without WAITALL an IOV receive takes what is there (a prefix, ending inside an entry
    // if so), its length in bytes; the rest follows.
    let msg = message(5000, 3);
    let mut s = Side::new(&msg, Some(&[10, 10, 2500]));
    let mut r1 = Side::recv(6000, Some(&[7, 7, 1000, 4999]));
    LENGTHS.lock().unwrap().clear();
    let mut part = typed(
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        r1.dt(),
    );
    part.cb.length = Some(on_length);
    let mut len = usize::MAX;
    // SAFETY: as above.
    unsafe {
        let st = ucp_stream_send_nbx(p.ep[0], s.ptr(), s.count(), &typed(0, s.dt()));
        assert_eq!(p.wait(st, false).0, UCS_OK);
        let a = ucp_stream_recv_nbx(p.ep[1], r1.ptr(), r1.count(), &mut len, &part);
        let got = if a.is_null() {
            len
        } else {
            assert_eq!(p.wait(a, false).0, UCS_OK);
            LENGTHS.lock().unwrap()[0].1
        };
        assert!((1..=5000).contains(&got), "{got}");
        r1.check(&msg[..got]);
        let rest = 5000 - got;
        let mut r2b = Side::recv(rest, Some(&[1.min(rest)]));
        let mut wa = typed(UCP_OP_ATTR_FIELD_FLAGS, r2b.dt());
        wa.flags = UCP_STREAM_RECV_FLAG_WAITALL;
        if rest > 0 {
            let b = ucp_stream_recv_nbx(p.ep[1], r2b.ptr(), r2b.count(), &mut len, &wa);
            assert_eq!(p.wait(b, false).0, UCS_OK);
        }
        r2b.check(&msg[got..]);
    }
}

static LENGTHS: Mutex<Vec<(Status, usize)>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_length(_: *mut c_void, status: Status, length: usize, _: *mut c_void) {
    LENGTHS.lock().unwrap().push((status, length));
}

/// (descriptor, length, attributes) of each active message; the handler keeps each.
static AMS: Mutex<Vec<(usize, usize, u64)>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_am(
    _: *mut c_void,
    _: *const c_void,
    _: usize,
    data: *mut c_void,
    length: usize,
    param: *const AmRecvParam,
) -> Status {
    // SAFETY: the library hands valid pointers for the call.
    let attr = unsafe { (*param).recv_attr };
    AMS.lock().unwrap().push((data as usize, length, attr));
    UCS_INPROGRESS
}

/// Active messages whose payload is an IOV (or contiguous), fetched with
/// `ucp_am_recv_data_nbx` into an IOV (or contiguous) of any split, eager and rendezvous,
/// truncated when the receive is smaller.
#[test]
fn active_message_payloads_in_any_split() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let p = Pair::new();
    let hp = AmHandlerParam {
        field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB,
        id: 9,
        flags: 0,
        cb: Some(on_am),
        arg: std::ptr::null_mut(),
    };
    // SAFETY: a live worker, valid params.
    let set = unsafe { ucp_worker_set_am_recv_handler(p.w[1], &hp) };
    assert_eq!(set, UCS_OK);
    let one = |len: usize, sc: Cuts, cap: usize, rc: Cuts, seed| {
        let msg = message(len, seed);
        let mut s = Side::new(&msg, sc.map(|c| cuts(&c, len)).as_deref());
        let mut r = Side::recv(cap, rc.map(|c| cuts(&c, cap)).as_deref());
        AMS.lock().unwrap().clear();
        LENGTHS.lock().unwrap().clear();
        // SAFETY: live handles; the sides outlive the operations (waited for).
        unsafe {
            let sp = typed(0, s.dt());
            let st = ucp_am_send_nbx(p.ep[0], 9, b"h".as_ptr().cast(), 1, s.ptr(), s.count(), &sp);
            assert!(!ptr_is_err(st));
            p.drive(|| !AMS.lock().unwrap().is_empty());
            let (desc, alen, attr) = AMS.lock().unwrap()[0];
            assert_eq!(alen, len, "the payload's length in bytes");
            assert!(attr & (UCP_AM_RECV_ATTR_FLAG_DATA | UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
            let mut rp = typed(
                UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                r.dt(),
            );
            rp.cb.length = Some(on_length);
            let rd = ucp_am_recv_data_nbx(p.w[1], desc as *mut c_void, r.ptr(), r.count(), &rp);
            let (rst, _) = p.wait(rd, false);
            assert_eq!(p.wait(st, false).0, UCS_OK);
            let want = if len > cap {
                UCS_ERR_MESSAGE_TRUNCATED
            } else {
                UCS_OK
            };
            assert_eq!(rst, want, "{len} B into {cap} B");
            let l = LENGTHS.lock().unwrap().clone();
            assert_eq!(l.len(), 1, "one callback");
            assert_eq!(l[0].0, want);
            if want == UCS_OK {
                assert_eq!(l[0].1, len, "bytes received");
            }
        }
        r.check(&msg[..len.min(cap)]);
    };
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&shape(5000), |(len, sc, rc, delta)| {
            let cap = (len as i64 + i64::from(delta)).max(0) as usize;
            one(len, sc, cap, rc, delta as u8);
            Ok(())
        })
        .unwrap();
    let n = 3 << 20;
    let c = |v: &[usize]| Some(v.to_vec());
    one(n, c(&[1, 1 << 20, 1 << 20]), n, c(&[0, 9, 2 << 20]), 1);
    one(n, None, n, c(&[4096]), 2);
    one(n, c(&[77]), n, None, 3);
    one(n, c(&[77, 88]), n - 1000, c(&[5, 1 << 21]), 4);
}
