//! The C ABI driven as a C caller would, in one process: a context, two workers connected
//! both ways, and the request rules Open MPI relies on (callbacks from progress only, the
//! caller's request memory, free before completion, cancel, probe with remove, generic types,
//! refusals of bad input).

use std::ffi::c_void;
use std::sync::Mutex;

use crate::HEADER_SIZE;
use crate::config::{AbiConfig, ucp_config_modify, ucp_config_read, ucp_config_release};
use crate::context::{AbiContext, ucp_cleanup, ucp_init_version};
use crate::datatype::{ucp_dt_create_generic, ucp_dt_destroy};
use crate::endpoint::{AbiEp, ucp_disconnect_nb, ucp_ep_close_nb, ucp_ep_create};
use crate::status::{ptr_is_err, ptr_is_ptr, status_ptr};
use crate::tag::*;
use crate::types::*;
use crate::worker::*;

/// (request, status, tag, length) of every callback, in order.
static CALLS: Mutex<Vec<(usize, Status, u64, usize)>> = Mutex::new(Vec::new());
/// Only one of these tests at a time (they share CALLS).
static ONE: Mutex<()> = Mutex::new(());

unsafe extern "C" fn send_cb(req: *mut c_void, status: Status) {
    CALLS.lock().unwrap().push((req as usize, status, 0, 0));
}

unsafe extern "C" fn send_nbx_cb(req: *mut c_void, status: Status, data: *mut c_void) {
    CALLS
        .lock()
        .unwrap()
        .push((req as usize, status, data as u64, 0));
}

unsafe extern "C" fn recv_cb(req: *mut c_void, status: Status, info: *mut TagRecvInfo) {
    // SAFETY: the library passes valid information.
    let i = unsafe { *info };
    CALLS
        .lock()
        .unwrap()
        .push((req as usize, status, i.sender_tag, i.length));
}

unsafe extern "C" fn init(req: *mut c_void) {
    // SAFETY: the caller area is 16 bytes.
    unsafe { req.cast::<u64>().write(0x1217) };
}

struct Pair {
    ctx: *mut AbiContext,
    w: [*mut AbiWorker; 2],
    /// ep[0]: worker 0 to worker 1; ep[1]: worker 1 to worker 0.
    ep: [*mut AbiEp; 2],
}

/// A context with these settings, as Open MPI makes it (tag matching, 16-byte request area).
fn context(vars: &[(&std::ffi::CStr, &std::ffi::CStr)]) -> *mut AbiContext {
    let mut cfg: *mut AbiConfig = std::ptr::null_mut();
    let params = UcpParams {
        field_mask: UCP_PARAM_FIELD_FEATURES
            | UCP_PARAM_FIELD_REQUEST_SIZE
            | UCP_PARAM_FIELD_REQUEST_INIT,
        features: UCP_FEATURE_TAG,
        request_size: 16,
        request_init: Some(init),
        request_cleanup: None,
        tag_sender_mask: 0,
        mt_workers_shared: 0,
        estimated_num_eps: 0,
        estimated_num_ppn: 0,
        name: std::ptr::null(),
    };
    let mut ctx = std::ptr::null_mut();
    // SAFETY: every pointer handed in is valid for what the call does with it.
    unsafe {
        assert_eq!(
            ucp_config_read(std::ptr::null(), std::ptr::null(), &mut cfg),
            UCS_OK
        );
        for (k, v) in vars {
            assert_eq!(ucp_config_modify(cfg, k.as_ptr(), v.as_ptr()), UCS_OK);
        }
        assert_eq!(ucp_init_version(1, 16, &params, cfg, &mut ctx), UCS_OK);
        ucp_config_release(cfg);
    }
    ctx
}

impl Pair {
    fn new() -> Pair {
        let ctx = context(&[(c"TLS", c"posix")]);
        let mut w = [std::ptr::null_mut(); 2];
        // SAFETY: every pointer handed in is valid for what the call does with it.
        let ep = unsafe {
            let wp: WorkerParams = std::mem::zeroed();
            for wi in &mut w {
                assert_eq!(ucp_worker_create(ctx, &wp, wi), UCS_OK);
            }
            crate::test_util::connect_both(w)
        };
        CALLS.lock().unwrap().clear();
        Pair { ctx, w, ep }
    }

    /// Progress both workers until `done` or a bound of rounds.
    #[track_caller]
    fn drive(&self, mut done: impl FnMut() -> bool) {
        for _ in 0..2_000_000 {
            if done() {
                return;
            }
            // SAFETY: live workers.
            unsafe {
                ucp_worker_progress(self.w[0]);
                ucp_worker_progress(self.w[1]);
            }
        }
        panic!("no completion");
    }

    fn calls(&self) -> Vec<(usize, Status, u64, usize)> {
        CALLS.lock().unwrap().clone()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // SAFETY: live objects, closed once, endpoints before workers before the context.
        unsafe {
            for e in self.ep {
                assert!(ucp_disconnect_nb(e).is_null());
            }
            for w in self.w {
                ucp_worker_destroy(w);
            }
            ucp_cleanup(self.ctx);
        }
    }
}

fn nbx(mask: u32) -> RequestParam {
    // SAFETY: all-zero is a valid RequestParam (NULL pointers, no callback).
    let mut p: RequestParam = unsafe { std::mem::zeroed() };
    p.op_attr_mask = mask;
    p
}

#[test]
fn eager_send_and_receive_with_callbacks() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let data = *b"12345678";
    let mut got = [0u8; 8];
    // SAFETY: live handles; buffers outlive the operations (driven to the end below).
    unsafe {
        let s = ucp_tag_send_nb(
            pair.ep[0],
            data.as_ptr().cast(),
            8,
            1 << 3,
            0x77,
            Some(send_cb),
        );
        assert!(!ptr_is_err(s));
        let r = ucp_tag_recv_nb(
            pair.w[1],
            got.as_mut_ptr().cast(),
            8,
            1 << 3,
            0x77,
            u64::MAX,
            Some(recv_cb),
        );
        assert!(ptr_is_ptr(r), "a receive always returns a request");
        assert_eq!(
            *r.cast::<u64>(),
            0x1217,
            "request_init ran on the caller area"
        );
        assert!(
            pair.calls().iter().all(|c| c.0 != r as usize),
            "no callback inside the call"
        );
        pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
        let mut info = TagRecvInfo::default();
        assert_eq!(ucp_request_test(r, &mut info), UCS_OK);
        assert_eq!((info.sender_tag, info.length), (0x77, 8));
        assert_eq!(got, data);
        assert!(pair.calls().contains(&(r as usize, UCS_OK, 0x77, 8)));
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            pair.drive(|| ucp_request_check_status(s) != UCS_INPROGRESS);
            ucp_request_free(s);
        }
    }
}

#[test]
fn rendezvous_into_caller_request_memory() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let n = 3 << 20;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4096) as u8).collect();
    let mut dst = vec![0u8; n + 1];
    // The caller's request memory, Open MPI's way: request_size bytes, the pointer at its end.
    let mut mem = [0u64; crate::HEADER_SIZE / 8 + 2];
    // SAFETY: live handles; buffers and request memory outlive the operations.
    unsafe {
        let req = mem
            .as_mut_ptr()
            .add(crate::HEADER_SIZE / 8)
            .cast::<c_void>();
        let mut rp = nbx(UCP_OP_ATTR_FIELD_REQUEST);
        rp.request = req;
        let r = ucp_tag_recv_nbx(pair.w[1], dst.as_mut_ptr().cast(), n + 1, 5, u64::MAX, &rp);
        assert_eq!(r, req, "the caller's request comes back");
        let mut sp = nbx(UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA);
        sp.cb.send = Some(send_nbx_cb);
        sp.user_data = 0xbeef as *mut c_void;
        let s = ucp_tag_send_nbx(pair.ep[0], src.as_ptr().cast(), n, 5, &sp);
        assert!(ptr_is_ptr(s), "a rendezvous send is pending");
        pair.drive(|| {
            ucp_request_check_status(req) != UCS_INPROGRESS
                && ucp_request_check_status(s) != UCS_INPROGRESS
        });
        let mut info = TagRecvInfo::default();
        assert_eq!(ucp_request_test(req, &mut info), UCS_OK);
        assert_eq!(info.length, n);
        assert!(dst[..n] == src[..] && dst[n] == 0);
        assert!(pair.calls().contains(&(s as usize, UCS_OK, 0xbeef, 0)));
        ucp_request_free(s);
    }
}

/// Caller request memory that cannot be one (misaligned, or too near address 0 for a header
/// before it) is refused with `UCS_ERR_INVALID_PARAM` by the tag, stream and active-message
/// calls alike, before anything is posted (0x8 was taken by a tag receive, whose header would
/// have been written below address 0 when it ended; the check is made once, where the
/// parameters are read).
#[test]
fn caller_request_memory_that_cannot_be_one_is_refused() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let mut buf = [0u8; 8];
    for bad in [0x8usize, 0x1004, 0x1001] {
        let mut rp = nbx(UCP_OP_ATTR_FIELD_REQUEST);
        rp.request = bad as *mut c_void;
        // SAFETY: live handles; nothing is posted (refused), so `buf` outlives every operation.
        unsafe {
            let r = ucp_tag_recv_nbx(pair.w[1], buf.as_mut_ptr().cast(), 8, 5, u64::MAX, &rp);
            assert_eq!(r, status_ptr(UCS_ERR_INVALID_PARAM), "tag recv {bad:#x}");
            let s = ucp_tag_send_nbx(pair.ep[0], buf.as_ptr().cast(), 8, 5, &rp);
            assert_eq!(s, status_ptr(UCS_ERR_INVALID_PARAM), "tag send {bad:#x}");
            let s = crate::stream::ucp_stream_send_nbx(pair.ep[0], buf.as_ptr().cast(), 8, &rp);
            assert_eq!(s, status_ptr(UCS_ERR_INVALID_PARAM), "stream send {bad:#x}");
        }
    }
    // Nothing was posted: a probe finds no message.
    let mut info = TagRecvInfo::default();
    let mut n = 0;
    pair.drive(|| {
        n += 1;
        n > 1000
    });
    // SAFETY: live worker handle.
    let m = unsafe { ucp_tag_probe_nb(pair.w[1], 5, u64::MAX, 0, &mut info) };
    assert!(m.is_null(), "a refused send went out");
}

#[test]
fn probe_remove_then_message_receive() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let a = [1u8; 100];
    let b = [2u8; 50];
    let mut got = [0u8; 100];
    let mut second = [0u8; 100];
    // SAFETY: live handles; buffers outlive the operations.
    unsafe {
        for (buf, len) in [(a.as_ptr(), 100), (b.as_ptr(), 50)] {
            let s = ucp_tag_send_nbx(pair.ep[0], buf.cast(), len, 9, std::ptr::null());
            assert!(!ptr_is_err(s));
        }
        let mut info = TagRecvInfo::default();
        let mut msg = std::ptr::null_mut();
        pair.drive(|| {
            msg = ucp_tag_probe_nb(pair.w[1], 9, u64::MAX, 1, &mut info);
            !msg.is_null()
        });
        assert_eq!((info.sender_tag, info.length), (9, 100));
        // A receive posted now may not take the probed message.
        let r2 = ucp_tag_recv_nb(
            pair.w[1],
            second.as_mut_ptr().cast(),
            100,
            1 << 3,
            9,
            u64::MAX,
            Some(recv_cb),
        );
        let r1 = ucp_tag_msg_recv_nb(
            pair.w[1],
            got.as_mut_ptr().cast(),
            100,
            1 << 3,
            msg,
            Some(recv_cb),
        );
        assert!(ptr_is_ptr(r1) && ptr_is_ptr(r2));
        pair.drive(|| {
            ucp_request_check_status(r1) != UCS_INPROGRESS
                && ucp_request_check_status(r2) != UCS_INPROGRESS
        });
        assert_eq!(got, a);
        assert_eq!(&second[..50], &b[..]);
        let calls = pair.calls();
        assert!(calls.contains(&(r1 as usize, UCS_OK, 9, 100)));
        assert!(calls.contains(&(r2 as usize, UCS_OK, 9, 50)));
        ucp_request_free(r1);
        ucp_request_free(r2);
    }
}

/// A message longer than a wildcard receive's buffer: `UCS_ERR_MESSAGE_TRUNCATED`, with the
/// sender's tag and the message's whole length (UCX's information, from which Open MPI makes
/// the status's source and tag), in the callback and in `ucp_tag_recv_request_test` alike,
/// whatever way it went: posted before (eager, rendezvous), the message already here, asked
/// for in place (`UCP_OP_ATTR_FIELD_RECV_INFO`), a probed message received; the part that fits
/// is written, nothing past it.
#[test]
fn a_truncated_receive_names_its_sender_tag_and_length() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let big = 1 << 20;
    let src: Vec<u8> = (0..big).map(|i| (i * 13 + i / 251) as u8).collect();
    let cut = |got: &[u8]| {
        assert_eq!(&got[..10], &src[..10], "the part that fits");
        assert!(
            got[10..].iter().all(|&b| b == 0xee),
            "nothing past the buffer"
        );
    };
    let send = |len: usize, tag: u64| {
        // SAFETY: live handles; `src` outlives the send (driven to its end by the caller).
        let s = unsafe {
            ucp_tag_send_nbx(pair.ep[0], src.as_ptr().cast(), len, tag, std::ptr::null())
        };
        assert!(!ptr_is_err(s));
        s
    };
    let end = |s: *mut c_void| {
        if ptr_is_ptr(s) {
            // SAFETY: a live send request, freed once.
            unsafe {
                pair.drive(|| ucp_request_check_status(s) != UCS_INPROGRESS);
                assert_eq!(ucp_request_check_status(s), UCS_OK, "the send completes");
                ucp_request_free(s);
            }
        }
    };
    // SAFETY: live handles; buffers outlive the operations (each driven to its end).
    unsafe {
        // Posted before the message: eager, then rendezvous (into the caller's memory).
        for (len, tag) in [(100usize, 0xa1u64), (big, 0xa2)] {
            let mut got = [0xeeu8; 32];
            CALLS.lock().unwrap().clear();
            let r = ucp_tag_recv_nb(
                pair.w[1],
                got.as_mut_ptr().cast(),
                10,
                1 << 3,
                0,
                0,
                Some(recv_cb),
            );
            assert!(ptr_is_ptr(r));
            let s = send(len, tag);
            pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
            let mut info = TagRecvInfo::default();
            assert_eq!(
                ucp_tag_recv_request_test(r, &mut info),
                UCS_ERR_MESSAGE_TRUNCATED
            );
            assert_eq!((info.sender_tag, info.length), (tag, len), "{len} B");
            assert_eq!(
                pair.calls(),
                vec![(r as usize, UCS_ERR_MESSAGE_TRUNCATED, tag, len)]
            );
            ucp_request_free(r);
            end(s);
            cut(&got);
        }
        let mut mem = [0u64; crate::HEADER_SIZE / 8 + 2];
        let req = mem
            .as_mut_ptr()
            .add(crate::HEADER_SIZE / 8)
            .cast::<c_void>();
        let mut got = [0xeeu8; 32];
        let s = send(big, 0xa3);
        assert_eq!(
            ucp_tag_recv_nbr(pair.w[1], got.as_mut_ptr().cast(), 10, 1 << 3, 0, 0, req),
            UCS_OK
        );
        pair.drive(|| ucp_request_check_status(req) != UCS_INPROGRESS);
        let mut info = TagRecvInfo::default();
        assert_eq!(ucp_request_test(req, &mut info), UCS_ERR_MESSAGE_TRUNCATED);
        assert_eq!((info.sender_tag, info.length), (0xa3, big));
        end(s);
        cut(&got);

        // The message already here: the callback from the next progress.
        let s = send(100, 0xb1);
        let mut probed = TagRecvInfo::default();
        pair.drive(|| !ucp_tag_probe_nb(pair.w[1], 0, 0, 0, &mut probed).is_null());
        assert_eq!((probed.sender_tag, probed.length), (0xb1, 100));
        let mut got = [0xeeu8; 32];
        CALLS.lock().unwrap().clear();
        let r = ucp_tag_recv_nb(
            pair.w[1],
            got.as_mut_ptr().cast(),
            10,
            1 << 3,
            0,
            0,
            Some(recv_cb),
        );
        pair.drive(|| !pair.calls().is_empty());
        assert_eq!(
            pair.calls(),
            vec![(r as usize, UCS_ERR_MESSAGE_TRUNCATED, 0xb1, 100)]
        );
        ucp_request_free(r);
        end(s);
        cut(&got);

        // Asked for in place: the error, and the information written all the same.
        let s = send(100, 0xb2);
        pair.drive(|| !ucp_tag_probe_nb(pair.w[1], 0, 0, 0, std::ptr::null_mut()).is_null());
        let mut got = [0xeeu8; 32];
        let mut info = TagRecvInfo::default();
        let mut p = nbx(UCP_OP_ATTR_FIELD_RECV_INFO);
        p.recv_info.tag_info = &mut info;
        let r = ucp_tag_recv_nbx(pair.w[1], got.as_mut_ptr().cast(), 10, 0, 0, &p);
        assert_eq!(r as isize, isize::from(UCS_ERR_MESSAGE_TRUNCATED));
        assert_eq!((info.sender_tag, info.length), (0xb2, 100));
        end(s);
        cut(&got);

        // A probed message, received into a smaller buffer.
        let s = send(100, 0xc1);
        let mut msg = std::ptr::null_mut();
        pair.drive(|| {
            msg = ucp_tag_probe_nb(pair.w[1], 0, 0, 1, std::ptr::null_mut());
            !msg.is_null()
        });
        let mut got = [0xeeu8; 32];
        CALLS.lock().unwrap().clear();
        let r = ucp_tag_msg_recv_nb(
            pair.w[1],
            got.as_mut_ptr().cast(),
            10,
            1 << 3,
            msg,
            Some(recv_cb),
        );
        assert!(ptr_is_ptr(r));
        pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
        let mut info = TagRecvInfo::default();
        assert_eq!(ucp_request_test(r, &mut info), UCS_ERR_MESSAGE_TRUNCATED);
        assert_eq!((info.sender_tag, info.length), (0xc1, 100));
        assert_eq!(
            pair.calls(),
            vec![(r as usize, UCS_ERR_MESSAGE_TRUNCATED, 0xc1, 100)]
        );
        ucp_request_free(r);
        end(s);
        cut(&got);
    }
}

/// Empty messages with NULL buffers (MPI's zero-count calls pass them): sent, received (posted
/// before, and after a probe took the message), with the sender's tag and length 0; a probe
/// reports a rendezvous-size message's whole length before any of it is read; a request
/// freed after it completed is no request any more.
#[test]
fn empty_messages_null_buffers_and_probe_information() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let null = std::ptr::null_mut::<c_void>();
    // SAFETY: live handles; NULL buffers of no bytes; requests freed once.
    unsafe {
        CALLS.lock().unwrap().clear();
        let r = ucp_tag_recv_nb(pair.w[1], null, 0, 1 << 3, 0x10, u64::MAX, Some(recv_cb));
        assert!(ptr_is_ptr(r));
        let s = ucp_tag_send_nb(pair.ep[0], null, 0, 1 << 3, 0x10, None);
        assert!(!ptr_is_err(s));
        pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
        assert_eq!(pair.calls(), vec![(r as usize, UCS_OK, 0x10, 0)]);
        ucp_request_free(r);
        assert_eq!(
            ucp_request_check_status(r),
            UCS_ERR_INVALID_PARAM,
            "a freed request is no request"
        );
        if ptr_is_ptr(s) {
            pair.drive(|| ucp_request_check_status(s) != UCS_INPROGRESS);
            ucp_request_free(s);
        }
        // Taken by a probe, then received into NULL.
        let s = ucp_tag_send_nbx(pair.ep[0], null, 0, 0x11, std::ptr::null());
        assert!(!ptr_is_err(s));
        let mut info = TagRecvInfo {
            sender_tag: 1,
            length: 1,
        };
        let mut msg = null;
        pair.drive(|| {
            msg = ucp_tag_probe_nb(pair.w[1], 0, 0, 1, &mut info);
            !msg.is_null()
        });
        assert_eq!((info.sender_tag, info.length), (0x11, 0));
        let r = ucp_tag_msg_recv_nbx(pair.w[1], null, 0, msg, std::ptr::null());
        assert!(ptr_is_ptr(r));
        pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
        let mut got = TagRecvInfo::default();
        assert_eq!(ucp_tag_recv_request_test(r, &mut got), UCS_OK);
        assert_eq!((got.sender_tag, got.length), (0x11, 0));
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            pair.drive(|| ucp_request_check_status(s) != UCS_INPROGRESS);
            ucp_request_free(s);
        }
        // A rendezvous-size message: the probe names its whole length.
        let n = 2 << 20;
        let src = vec![5u8; n];
        let mut dst = vec![0u8; n];
        let s = ucp_tag_send_nbx(pair.ep[0], src.as_ptr().cast(), n, 0x12, std::ptr::null());
        assert!(!ptr_is_err(s));
        let mut info = TagRecvInfo::default();
        pair.drive(|| !ucp_tag_probe_nb(pair.w[1], 0x12, u64::MAX, 0, &mut info).is_null());
        assert_eq!((info.sender_tag, info.length), (0x12, n));
        let r = ucp_tag_recv_nbx(
            pair.w[1],
            dst.as_mut_ptr().cast(),
            n,
            0x12,
            u64::MAX,
            std::ptr::null(),
        );
        assert!(ptr_is_ptr(r));
        pair.drive(|| {
            ucp_request_check_status(r) != UCS_INPROGRESS
                && (!ptr_is_ptr(s) || ucp_request_check_status(s) != UCS_INPROGRESS)
        });
        assert_eq!(ucp_request_check_status(r), UCS_OK);
        assert!(dst == src);
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            ucp_request_free(s);
        }
    }
}

#[test]
fn cancel_and_free_before_completion() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let mut buf = [0u8; 16];
    let data = [3u8; 16];
    // SAFETY: live handles; buffers outlive the operations.
    unsafe {
        let r = ucp_tag_recv_nb(
            pair.w[1],
            buf.as_mut_ptr().cast(),
            16,
            1 << 3,
            1,
            u64::MAX,
            Some(recv_cb),
        );
        ucp_request_cancel(pair.w[1], r);
        pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
        assert_eq!(ucp_request_check_status(r), UCS_ERR_CANCELED);
        assert!(
            pair.calls()
                .iter()
                .any(|c| c.0 == r as usize && c.1 == UCS_ERR_CANCELED)
        );
        ucp_request_free(r);

        // Freed before it completes: no callback, and the block is reused afterwards.
        let r = ucp_tag_recv_nb(
            pair.w[1],
            buf.as_mut_ptr().cast(),
            16,
            1 << 3,
            2,
            u64::MAX,
            Some(recv_cb),
        );
        ucp_request_free(r);
        let s = ucp_tag_send_nb(
            pair.ep[0],
            data.as_ptr().cast(),
            16,
            1 << 3,
            2,
            Some(send_cb),
        );
        assert!(!ptr_is_err(s));
        // Written by the transport behind the compiler's back: read it as such.
        let bp = buf.as_ptr();
        pair.drive(|| (0..16).all(|i| std::ptr::read_volatile(bp.add(i)) == 3));
        for _ in 0..100 {
            ucp_worker_progress(pair.w[1]);
        }
        assert!(
            pair.calls()
                .iter()
                .all(|c| c.0 != r as usize || c.1 == UCS_ERR_CANCELED)
        );
        let again = ucp_tag_recv_nb(
            pair.w[1],
            buf.as_mut_ptr().cast(),
            16,
            1 << 3,
            3,
            u64::MAX,
            None,
        );
        assert_eq!(again, r, "the freed request went back to the pool");
        ucp_request_cancel(pair.w[1], again);
        pair.drive(|| ucp_request_check_status(again) != UCS_INPROGRESS);
        ucp_request_free(again);
        if ptr_is_ptr(s) {
            ucp_request_free(s);
        }
    }
}

#[test]
fn a_message_already_here_is_delivered_from_the_next_progress() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let data = *b"early!!!";
    let mut got = [0u8; 8];
    let mut got2 = [0u8; 8];
    // SAFETY: live handles; buffers outlive the operations.
    unsafe {
        for tag in [0x31, 0x32] {
            let s = ucp_tag_send_nbx(pair.ep[0], data.as_ptr().cast(), 8, tag, std::ptr::null());
            assert!(s.is_null(), "an 8-byte send ends in place");
        }
        let mut probed = TagRecvInfo::default();
        pair.drive(|| !ucp_tag_probe_nb(pair.w[1], 0x32, u64::MAX, 0, &mut probed).is_null());
        // With a callback: a request, and the callback from the next progress, not the post.
        let r = ucp_tag_recv_nb(
            pair.w[1],
            got.as_mut_ptr().cast(),
            8,
            1 << 3,
            0x31,
            u64::MAX,
            Some(recv_cb),
        );
        assert!(ptr_is_ptr(r));
        assert!(pair.calls().is_empty(), "no callback inside the post");
        ucp_worker_progress(pair.w[1]);
        assert_eq!(pair.calls(), vec![(r as usize, UCS_OK, 0x31, 8)]);
        assert_eq!(got, data);
        ucp_request_free(r);
        // Asking for the information instead: ended in place, NULL, the information written.
        let mut info = TagRecvInfo::default();
        let mut p = nbx(UCP_OP_ATTR_FIELD_RECV_INFO);
        p.recv_info.tag_info = &mut info;
        let r = ucp_tag_recv_nbx(pair.w[1], got2.as_mut_ptr().cast(), 8, 0x32, u64::MAX, &p);
        assert!(r.is_null(), "ended in place");
        assert_eq!((info.sender_tag, info.length), (0x32, 8));
        assert_eq!(got2, data);
    }
}

#[test]
fn progress_delivers_each_end_once_among_many_in_flight() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    const N: usize = 200;
    let mut bufs = vec![[0u8; 8]; N];
    // SAFETY: live handles; buffers outlive the operations, all ended below.
    unsafe {
        let reqs: Vec<*mut c_void> = bufs
            .iter_mut()
            .enumerate()
            .map(|(k, b)| {
                ucp_tag_recv_nb(
                    pair.w[1],
                    b.as_mut_ptr().cast(),
                    8,
                    1 << 3,
                    k as u64,
                    u64::MAX,
                    Some(recv_cb),
                )
            })
            .collect();
        assert!(reqs.iter().all(|&r| ptr_is_ptr(r)));
        // Cancel one in the middle: found by its request alone; its end comes from progress.
        ucp_request_cancel(pair.w[1], reqs[77]);
        pair.drive(|| ucp_request_check_status(reqs[77]) != UCS_INPROGRESS);
        assert_eq!(
            pair.calls(),
            vec![(reqs[77] as usize, UCS_ERR_CANCELED, 0, 0)]
        );
        // A second cancel changes nothing.
        ucp_request_cancel(pair.w[1], reqs[77]);
        for k in (0..N).rev().filter(|&k| k != 77) {
            let v = [k as u8; 8];
            let s = ucp_tag_send_nb(pair.ep[0], v.as_ptr().cast(), 8, 1 << 3, k as u64, None);
            assert!(!ptr_is_err(s));
            if ptr_is_ptr(s) {
                pair.drive(|| ucp_request_check_status(s) != UCS_INPROGRESS);
                ucp_request_free(s);
            }
        }
        pair.drive(|| {
            reqs.iter()
                .all(|&r| ucp_request_check_status(r) != UCS_INPROGRESS)
        });
        for _ in 0..100 {
            ucp_worker_progress(pair.w[1]);
        }
        let calls = pair.calls();
        assert_eq!(calls.len(), N, "one callback per receive");
        for (k, &r) in reqs.iter().enumerate() {
            let want = if k == 77 {
                (r as usize, UCS_ERR_CANCELED, 0, 0)
            } else {
                (r as usize, UCS_OK, k as u64, 8)
            };
            assert_eq!(calls.iter().filter(|c| c.0 == r as usize).count(), 1);
            assert!(calls.contains(&want), "receive {k}");
            let expect = if k == 77 { [0u8; 8] } else { [k as u8; 8] };
            assert_eq!(bufs[k], expect, "receive {k}");
            ucp_request_free(r);
        }
    }
}

#[test]
fn bad_input_is_refused() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let x = [0u8; 4];
    // SAFETY: live handles or NULL, which the calls refuse.
    unsafe {
        let p = nbx(1 << 12);
        let r = ucp_tag_send_nbx(pair.ep[0], x.as_ptr().cast(), 4, 1, &p);
        assert_eq!(r as isize, isize::from(UCS_ERR_INVALID_PARAM));
        let r = ucp_tag_send_nb(std::ptr::null(), x.as_ptr().cast(), 4, 1 << 3, 1, None);
        assert_eq!(r as isize, isize::from(UCS_ERR_INVALID_PARAM));
        let r = ucp_tag_recv_nb(pair.w[1], std::ptr::null_mut(), 4, 1 << 3, 1, 0, None);
        assert_eq!(r as isize, isize::from(UCS_ERR_INVALID_PARAM));
        let r = ucp_tag_send_nb(
            pair.ep[0],
            x.as_ptr().cast(),
            1,
            UCP_DATATYPE_STRIDED,
            1,
            None,
        );
        assert_eq!(r as isize, isize::from(UCS_ERR_UNSUPPORTED));
        assert_eq!(
            ucp_request_check_status(std::ptr::null_mut()),
            UCS_ERR_INVALID_PARAM
        );
        let bogus = [0u64; 16];
        assert_eq!(
            ucp_request_check_status(bogus.as_ptr().add(8).cast_mut().cast()),
            UCS_ERR_INVALID_PARAM
        );
        let mut ep = std::ptr::null_mut();
        let mut ep_params: EpParams = std::mem::zeroed();
        ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        ep_params.address = bogus.as_ptr().cast();
        assert_eq!(
            ucp_ep_create(pair.w[0], &ep_params, &mut ep),
            UCS_ERR_INVALID_ADDR
        );
        // By socket address, without one.
        ep_params.field_mask = UCP_EP_PARAM_FIELD_SOCK_ADDR;
        assert_eq!(
            ucp_ep_create(pair.w[0], &ep_params, &mut ep),
            UCS_ERR_INVALID_PARAM
        );
    }
}

// A generic type of "every other byte" (count bytes taken from 2 * count).
unsafe extern "C" fn start(_: *mut c_void, b: *const c_void, n: usize) -> *mut c_void {
    Box::into_raw(Box::new((b as usize, n))).cast()
}
unsafe extern "C" fn start_mut(_: *mut c_void, b: *mut c_void, n: usize) -> *mut c_void {
    Box::into_raw(Box::new((b as usize, n))).cast()
}
unsafe extern "C" fn size(s: *mut c_void) -> usize {
    // SAFETY: our state.
    unsafe { (*s.cast::<(usize, usize)>()).1 }
}
unsafe extern "C" fn pack(s: *mut c_void, off: usize, d: *mut c_void, max: usize) -> usize {
    // SAFETY: our state and buffers, in bounds.
    unsafe {
        let (b, n) = *s.cast::<(usize, usize)>();
        let k = max.min(n - off);
        for i in 0..k {
            *d.cast::<u8>().add(i) = *(b as *const u8).add(2 * (off + i));
        }
        k
    }
}
unsafe extern "C" fn unpack(s: *mut c_void, off: usize, src: *const c_void, len: usize) -> Status {
    // SAFETY: our state and buffers, in bounds.
    unsafe {
        let (b, _) = *s.cast::<(usize, usize)>();
        for i in 0..len {
            *(b as *mut u8).add(2 * (off + i)) = *src.cast::<u8>().add(i);
        }
    }
    UCS_OK
}
unsafe extern "C" fn finish(s: *mut c_void) {
    // SAFETY: made by the start functions.
    drop(unsafe { Box::from_raw(s.cast::<(usize, usize)>()) });
}

#[test]
fn generic_datatype_round_trip() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let ops = GenericDtOps {
        start_pack: Some(start),
        start_unpack: Some(start_mut),
        packed_size: Some(size),
        pack: Some(pack),
        unpack: Some(unpack),
        finish: Some(finish),
    };
    for count in [10usize, 200_000] {
        let src: Vec<u8> = (0..2 * count).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0xffu8; 2 * count];
        // SAFETY: live handles; buffers outlive the operations; the type lives until destroyed.
        unsafe {
            let mut dt = 0;
            assert_eq!(
                ucp_dt_create_generic(&ops, std::ptr::null_mut(), &mut dt),
                UCS_OK
            );
            let r = ucp_tag_recv_nb(
                pair.w[1],
                dst.as_mut_ptr().cast(),
                count,
                dt,
                4,
                u64::MAX,
                Some(recv_cb),
            );
            let s = ucp_tag_send_nb(pair.ep[0], src.as_ptr().cast(), count, dt, 4, Some(send_cb));
            assert!(ptr_is_ptr(r) && !ptr_is_err(s));
            pair.drive(|| {
                ucp_request_check_status(r) != UCS_INPROGRESS
                    && (!ptr_is_ptr(s) || ucp_request_check_status(s) != UCS_INPROGRESS)
            });
            assert_eq!(ucp_request_check_status(r), UCS_OK);
            for i in 0..2 * count {
                let want = if i % 2 == 0 { src[i] } else { 0xff };
                assert_eq!(dst[i], want, "byte {i} of {count} elements");
            }
            ucp_request_free(r);
            if ptr_is_ptr(s) {
                ucp_request_free(s);
            }
            ucp_dt_destroy(dt);
        }
    }
}

static BOGUS_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn counted_start(_: *mut c_void, b: *const c_void, n: usize) -> *mut c_void {
    BOGUS_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: as `start`.
    unsafe { start(std::ptr::null_mut(), b, n) }
}
unsafe extern "C" fn counted_start_mut(_: *mut c_void, b: *mut c_void, n: usize) -> *mut c_void {
    BOGUS_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: as `start_mut`.
    unsafe { start_mut(std::ptr::null_mut(), b, n) }
}

/// A generic datatype value that `ucp_dt_create_generic` did not make (here: the address of a
/// struct laid out as ours, with callbacks that count their calls), one destroyed already, and
/// a made-up one are refused with `UCS_ERR_INVALID_PARAM` by sends and receives, without a
/// call through them; destroying one twice is harmless. (They used to be dereferenced: the
/// made-up one's callbacks ran, a destroyed one was used after free.)
#[test]
fn a_generic_datatype_we_did_not_make_is_refused() {
    #[repr(C, align(8))]
    struct LookAlike {
        ops: GenericDtOps,
        context: *mut c_void,
    }
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let ops = GenericDtOps {
        start_pack: Some(counted_start),
        start_unpack: Some(counted_start_mut),
        packed_size: Some(size),
        pack: Some(pack),
        unpack: Some(unpack),
        finish: Some(finish),
    };
    let fake = LookAlike {
        ops,
        context: std::ptr::null_mut(),
    };
    let look_alike = &fake as *const LookAlike as u64 | UCP_DATATYPE_GENERIC;
    let mut destroyed = 0;
    // SAFETY: valid ops and out pointer.
    unsafe {
        assert_eq!(
            ucp_dt_create_generic(&ops, std::ptr::null_mut(), &mut destroyed),
            UCS_OK
        );
        ucp_dt_destroy(destroyed);
        ucp_dt_destroy(destroyed);
    }
    let made_up = 0xdead_bee8 | UCP_DATATYPE_GENERIC;
    let src = [7u8; 16];
    let mut dst = [0u8; 16];
    BOGUS_CALLS.store(0, std::sync::atomic::Ordering::Relaxed);
    for dt in [look_alike, destroyed, made_up] {
        // SAFETY: live handles and buffers; the datatypes are refused before any use.
        unsafe {
            let s = ucp_tag_send_nb(pair.ep[0], src.as_ptr().cast(), 8, dt, 3, Some(send_cb));
            assert_eq!(s as isize, isize::from(UCS_ERR_INVALID_PARAM), "{dt:#x}");
            let r = ucp_tag_recv_nb(
                pair.w[1],
                dst.as_mut_ptr().cast(),
                8,
                dt,
                3,
                u64::MAX,
                Some(recv_cb),
            );
            assert_eq!(r as isize, isize::from(UCS_ERR_INVALID_PARAM), "{dt:#x}");
            let p = RequestParam {
                datatype: dt,
                ..nbx(UCP_OP_ATTR_FIELD_DATATYPE)
            };
            let s = ucp_tag_send_nbx(pair.ep[0], src.as_ptr().cast(), 8, 3, &p);
            assert_eq!(s as isize, isize::from(UCS_ERR_INVALID_PARAM), "{dt:#x}");
        }
    }
    assert_eq!(
        BOGUS_CALLS.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no callback of a type we did not make ran"
    );
    // A contiguous type still goes.
    // SAFETY: live handles; the buffers outlive the operations (waited for).
    unsafe {
        let r = ucp_tag_recv_nb(
            pair.w[1],
            dst.as_mut_ptr().cast(),
            8,
            1 << 3,
            3,
            u64::MAX,
            Some(recv_cb),
        );
        let s = ucp_tag_send_nb(pair.ep[0], src.as_ptr().cast(), 8, 1 << 3, 3, Some(send_cb));
        assert!(ptr_is_ptr(r) && !ptr_is_err(s));
        pair.drive(|| {
            ucp_request_check_status(r) != UCS_INPROGRESS
                && (!ptr_is_ptr(s) || ucp_request_check_status(s) != UCS_INPROGRESS)
        });
        assert_eq!(ucp_request_check_status(r), UCS_OK);
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            ucp_request_free(s);
        }
    }
    assert_eq!(dst[..8], src[..8]);
}

/// CPU time of this thread (not wall time: a measurement that other jobs on the machine do
/// not distort much).
fn thread_cpu() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer for clock_gettime.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A measurement, not a check (run by hand, figures printed): the CPU cost of one idle
/// `ucp_worker_progress` and of one 8-byte message the way Open MPI's blocking calls move it
/// (`ucp_tag_recv_nbr` into caller request memory, `ucp_tag_send_nbr`, progress until
/// `ucp_tag_recv_request_test` says done), both workers in this thread over posix.
/// `cargo test -p rucx-ucx-abi --release --lib -- --ignored --nocapture per_message_cost`
#[test]
#[ignore = "a measurement: run by hand"]
fn per_message_cost() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let mut sbuf = [7u8; 8];
    let mut rbuf = [0u8; 8];
    let mut rreq = [0u64; (HEADER_SIZE + 64) / 8];
    let mut sreq = [0u64; (HEADER_SIZE + 64) / 8];
    // SAFETY: HEADER_SIZE bytes of each array lie before these pointers.
    let (rr, sr) = unsafe {
        (
            rreq.as_mut_ptr().add(HEADER_SIZE / 8).cast::<c_void>(),
            sreq.as_mut_ptr().add(HEADER_SIZE / 8).cast::<c_void>(),
        )
    };
    let mut one = |i: u64| {
        // SAFETY: live handles; the buffers and request memory outlive each round, which
        // ends before the next starts.
        unsafe {
            let st = ucp_tag_recv_nbr(
                pair.w[1],
                rbuf.as_mut_ptr().cast(),
                8,
                1 << UCP_DATATYPE_SHIFT,
                i,
                u64::MAX,
                rr,
            );
            assert_eq!(st, UCS_OK);
            let st = ucp_tag_send_nbr(
                pair.ep[0],
                sbuf.as_mut_ptr().cast(),
                8,
                1 << UCP_DATATYPE_SHIFT,
                i,
                sr,
            );
            assert!(st == UCS_OK || st == UCS_INPROGRESS, "{st}");
            let mut info = TagRecvInfo::default();
            let mut n = 0u64;
            while ucp_tag_recv_request_test(rr, &mut info) == UCS_INPROGRESS {
                ucp_worker_progress(pair.w[1]);
                ucp_worker_progress(pair.w[0]);
                n += 1;
                assert!(n < 10_000_000, "message {i} never arrived");
            }
            while st == UCS_INPROGRESS && ucp_request_check_status(sr) == UCS_INPROGRESS {
                ucp_worker_progress(pair.w[0]);
            }
        }
    };
    for i in 0..10_000 {
        one(i);
    }
    let n = 200_000u64;
    let t = thread_cpu();
    for i in 0..n {
        one(i);
    }
    let per_msg = (thread_cpu() - t).as_nanos() as f64 / n as f64;
    // A window of 64 receives posted, 64 sends, progress until all receives ended (Open MPI's
    // MPI_Irecv/MPI_Isend/MPI_Waitall).
    const WIN: usize = 64;
    let mut rreqs = vec![[0u64; (HEADER_SIZE + 64) / 8]; WIN];
    let mut window = |round: u64| {
        let mut left = WIN;
        // SAFETY: live handles; buffers and request memory outlive the round, which ends
        // (every receive completed, sends in place or progressed to the end) before the next.
        unsafe {
            let reqs: Vec<*mut c_void> = rreqs
                .iter_mut()
                .map(|r| r.as_mut_ptr().add(HEADER_SIZE / 8).cast::<c_void>())
                .collect();
            for (k, &r) in reqs.iter().enumerate() {
                let st = ucp_tag_recv_nbr(
                    pair.w[1],
                    rbuf.as_mut_ptr().cast(),
                    8,
                    1 << UCP_DATATYPE_SHIFT,
                    round * WIN as u64 + k as u64,
                    u64::MAX,
                    r,
                );
                assert_eq!(st, UCS_OK);
            }
            for k in 0..WIN {
                let p = ucp_tag_send_nb(
                    pair.ep[0],
                    sbuf.as_ptr().cast(),
                    8,
                    1 << UCP_DATATYPE_SHIFT,
                    round * WIN as u64 + k as u64,
                    None,
                );
                assert!(!ptr_is_err(p));
                if ptr_is_ptr(p) {
                    while ucp_request_check_status(p) == UCS_INPROGRESS {
                        ucp_worker_progress(pair.w[0]);
                    }
                    ucp_request_free(p);
                }
            }
            let mut spins = 0u64;
            while left > 0 {
                ucp_worker_progress(pair.w[1]);
                ucp_worker_progress(pair.w[0]);
                left = reqs
                    .iter()
                    .filter(|&&r| ucp_request_check_status(r) == UCS_INPROGRESS)
                    .count();
                spins += 1;
                assert!(spins < 10_000_000, "round {round} never ended");
            }
        }
    };
    for r in 0..200 {
        window(r);
    }
    let rounds = 3000u64;
    let t = thread_cpu();
    for r in 0..rounds {
        window(200 + r);
    }
    let per_win_msg = (thread_cpu() - t).as_nanos() as f64 / (rounds * WIN as u64) as f64;
    let calls = 2_000_000u64;
    let t = thread_cpu();
    for _ in 0..calls {
        // SAFETY: a live worker.
        unsafe { ucp_worker_progress(pair.w[0]) };
    }
    let per_progress = (thread_cpu() - t).as_nanos() as f64 / calls as f64;
    println!("per 8-byte message (post both, progress to the end): {per_msg:.0} ns CPU");
    println!("per 8-byte message in windows of {WIN}: {per_win_msg:.0} ns CPU");
    println!("per idle ucp_worker_progress: {per_progress:.1} ns CPU");
}

/// What the error handlers and send callbacks of the endpoint-failure test saw, in order:
/// ("send", request, status) and ("failed", arg, ep, status).
static FAILS: Mutex<Vec<(&'static str, usize, usize, Status)>> = Mutex::new(Vec::new());

/// Closes its endpoint (forced, UCX's usual answer) from inside the handler when `arg` is odd.
unsafe extern "C" fn on_failure(arg: *mut c_void, ep: *mut c_void, status: Status) {
    FAILS
        .lock()
        .unwrap()
        .push(("failed", arg as usize, ep as usize, status));
    if arg as usize & 1 == 1 {
        let mut p = nbx(UCP_OP_ATTR_FIELD_FLAGS);
        p.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: the endpoint being reported is live until this close.
        let r = unsafe { crate::endpoint::ucp_ep_close_nbx(ep.cast(), &p) };
        assert!(r.is_null(), "a forced close completes in place");
    }
}

unsafe extern "C" fn failed_send_cb(req: *mut c_void, status: Status, _: *mut c_void) {
    FAILS
        .lock()
        .unwrap()
        .push(("send", req as usize, 0, status));
}

/// Send `data` on `a` (an endpoint of `w[0]`) into `got` on `w[1]` with tag 1, progressing both
/// until the receive ended (and the send, when it did not end in place); the receive must end
/// `UCS_OK`. Both requests are freed.
///
/// # Safety
/// Live workers and endpoint; `got` at least as long as `data`.
unsafe fn one_message(w: [*mut AbiWorker; 2], a: *mut AbiEp, data: &[u8], got: &mut [u8]) {
    // SAFETY: the caller's promise; the buffers outlive the requests, which end here.
    unsafe {
        let n = data.len();
        let s = ucp_tag_send_nb(a, data.as_ptr().cast(), n, 1 << 3, 1, None);
        let r = ucp_tag_recv_nb(w[1], got.as_mut_ptr().cast(), n, 1 << 3, 1, u64::MAX, None);
        for _ in 0..2_000_000 {
            if ucp_request_check_status(r) != UCS_INPROGRESS
                && (!ptr_is_ptr(s) || ucp_request_check_status(s) != UCS_INPROGRESS)
            {
                break;
            }
            ucp_worker_progress(w[0]);
            ucp_worker_progress(w[1]);
        }
        assert_eq!(ucp_request_check_status(r), UCS_OK);
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            ucp_request_free(s);
        }
    }
}

/// An endpoint to `to`'s worker from `from`, with an error handler when `arg` is given (and
/// `user_data`, which then is the handler's argument).
///
/// # Safety
/// Live workers.
unsafe fn ep_to(
    from: *mut AbiWorker,
    to: *mut AbiWorker,
    arg: Option<usize>,
    user_data: Option<usize>,
) -> *mut AbiEp {
    let mut ep = std::ptr::null_mut();
    // SAFETY: the caller's promise; the address is released after use.
    unsafe {
        let mut addr = std::ptr::null_mut();
        let mut len = 0;
        assert_eq!(ucp_worker_get_address(to, &mut addr, &mut len), UCS_OK);
        let mut p: EpParams = std::mem::zeroed();
        p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        p.address = addr;
        if let Some(a) = arg {
            p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
            p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
            p.err_handler.cb = Some(on_failure);
            p.err_handler.arg = a as *mut c_void;
        }
        if let Some(u) = user_data {
            p.field_mask |= UCP_EP_PARAM_FIELD_USER_DATA;
            p.user_data = u as *mut c_void;
        }
        assert_eq!(ucp_ep_create(from, &p, &mut ep), UCS_OK);
        ucp_worker_release_address(to, addr);
    }
    ep
}

/// A peer whose worker is destroyed mid-transfer (TCP: its connections close): each open
/// endpoint to it with a handler is reported once, from `ucp_worker_progress` only (not from a
/// flush that progresses inside), after its pending send ended with the error, with
/// `UCS_ERR_CONNECTION_RESET`, its own `ucp_ep_h` and argument (`user_data` over
/// `err_handler.arg`); an endpoint closed before the failure, or after it but before its
/// report, is not reported; a handler that closes its endpoint works; operations on a failed
/// endpoint fail; an error mode UCX does not define is refused.
#[test]
fn a_failed_peer_calls_each_error_handler_once_from_progress() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    FAILS.lock().unwrap().clear();
    let ctx = context(&[(c"TLS", c"tcp")]);
    let mut w = [std::ptr::null_mut(); 2];
    // SAFETY: live handles throughout; buffers outlive the operations (ended below).
    unsafe {
        let wp: WorkerParams = std::mem::zeroed();
        for wi in &mut w {
            assert_eq!(ucp_worker_create(ctx, &wp, wi), UCS_OK);
        }
        // a: closes itself in its handler; b: closed before the failure; c: user_data wins.
        let a = ep_to(w[0], w[1], Some(0x11), None);
        let b = ep_to(w[0], w[1], Some(0x20), None);
        let c = ep_to(w[0], w[1], Some(0x40), Some(0x50));
        // d: failed, its report pending, then closed: never reported.
        let d = ep_to(w[0], w[1], Some(0x70), None);
        let back = ep_to(w[1], w[0], None, None);
        // An error mode UCX does not define is refused.
        let mut addr = std::ptr::null_mut();
        let mut len = 0;
        assert_eq!(ucp_worker_get_address(w[1], &mut addr, &mut len), UCS_OK);
        let mut bad: EpParams = std::mem::zeroed();
        bad.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        bad.address = addr;
        bad.err_mode = 2;
        let mut none = std::ptr::null_mut();
        assert_eq!(ucp_ep_create(w[0], &bad, &mut none), UCS_ERR_INVALID_PARAM);
        ucp_worker_release_address(w[1], addr);
        // Wire up with one message.
        let data = [7u8; 8];
        let mut got = [0u8; 8];
        one_message(w, a, &data, &mut got);
        assert_eq!(got, data);
        // A rendezvous send the peer never takes: pending when the peer goes.
        let big = vec![3u8; 4 << 20];
        let mut sp = nbx(UCP_OP_ATTR_FIELD_CALLBACK);
        sp.cb.send = Some(failed_send_cb);
        let pending = ucp_tag_send_nbx(c, big.as_ptr().cast(), big.len(), 9, &sp);
        assert!(
            ptr_is_ptr(pending),
            "the rendezvous send waits for its peer"
        );
        assert!(ucp_ep_close_nb(b, UCP_EP_CLOSE_MODE_FORCE).is_null());
        assert!(ucp_ep_close_nb(back, UCP_EP_CLOSE_MODE_FORCE).is_null());
        ucp_worker_destroy(w[1]);
        // A fence progresses inside until the send ended (with the error): no handler there.
        // (Its status is that of the flushes of the endpoints not known to be failed yet.)
        let _ = crate::worker::ucp_worker_fence(w[0]);
        {
            let f = FAILS.lock().unwrap();
            assert_eq!(f.len(), 1, "only the send ended inside the fence: {f:?}");
            assert_eq!(f[0].0, "send");
            assert_eq!(f[0].1, pending as usize);
            assert!(f[0].3 < 0, "the send failed: {}", f[0].3);
        }
        ucp_request_free(pending);
        assert!(ucp_ep_close_nb(d, UCP_EP_CLOSE_MODE_FORCE).is_null());
        // The next progress reports both open endpoints with a handler, once each.
        ucp_worker_progress(w[0]);
        for _ in 0..1000 {
            ucp_worker_progress(w[0]);
        }
        let mut reported: Vec<_> = FAILS.lock().unwrap()[1..].to_vec();
        reported.sort();
        assert_eq!(
            reported,
            vec![
                ("failed", 0x11, a as usize, UCS_ERR_CONNECTION_RESET),
                ("failed", 0x50, c as usize, UCS_ERR_CONNECTION_RESET),
            ]
        );
        // Operations on the failed endpoint fail cleanly; then it closes.
        let again = ucp_tag_send_nbx(c, data.as_ptr().cast(), 8, 2, &nbx(0));
        if ptr_is_ptr(again) {
            for _ in 0..1000 {
                ucp_worker_progress(w[0]);
            }
            assert!(ucp_request_check_status(again) < 0);
            ucp_request_free(again);
        } else {
            assert!(ptr_is_err(again), "a send on a failed endpoint fails");
        }
        let mut cp = nbx(UCP_OP_ATTR_FIELD_FLAGS);
        cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
        assert!(crate::endpoint::ucp_ep_close_nbx(c, &cp).is_null());
        assert_eq!(FAILS.lock().unwrap().len(), 3, "no second report");
        ucp_worker_destroy(w[0]);
        ucp_cleanup(ctx);
    }
}

/// A peer that stops calling into rucx (its worker lives on, unprogressed) while a send to it
/// is pending fails after `RUCX_PEER_TIMEOUT`: the handler gets `UCS_ERR_ENDPOINT_TIMEOUT`,
/// once, after the send ended with the error.
#[test]
fn a_silent_peer_is_reported_as_an_endpoint_timeout() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    FAILS.lock().unwrap().clear();
    let ctx = context(&[(c"TLS", c"posix"), (c"PEER_TIMEOUT", c"100ms")]);
    let mut w = [std::ptr::null_mut(); 2];
    // SAFETY: live handles throughout; buffers outlive the operations (ended below).
    unsafe {
        let wp: WorkerParams = std::mem::zeroed();
        for wi in &mut w {
            assert_eq!(ucp_worker_create(ctx, &wp, wi), UCS_OK);
        }
        let a = ep_to(w[0], w[1], Some(0x60), None);
        let back = ep_to(w[1], w[0], None, None);
        let data = [1u8; 8];
        let mut got = [0u8; 8];
        one_message(w, a, &data, &mut got);
        let big = vec![3u8; 4 << 20];
        let mut sp = nbx(UCP_OP_ATTR_FIELD_CALLBACK);
        sp.cb.send = Some(failed_send_cb);
        let pending = ucp_tag_send_nbx(a, big.as_ptr().cast(), big.len(), 9, &sp);
        assert!(
            ptr_is_ptr(pending),
            "the rendezvous send waits for its peer"
        );
        // Only worker 0 progresses from now on.
        let start = std::time::Instant::now();
        while FAILS.lock().unwrap().len() < 2 && start.elapsed().as_secs() < 20 {
            ucp_worker_progress(w[0]);
        }
        let f = FAILS.lock().unwrap().clone();
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(f[0].0, "send", "the send ends first: {f:?}");
        // The send ends with the timeout's status too (it used to be a connection reset).
        assert_eq!(f[0].3, UCS_ERR_ENDPOINT_TIMEOUT, "{f:?}");
        assert_eq!(f[1], ("failed", 0x60, a as usize, UCS_ERR_ENDPOINT_TIMEOUT));
        ucp_request_free(pending);
        assert!(ucp_ep_close_nb(a, UCP_EP_CLOSE_MODE_FORCE).is_null());
        assert!(ucp_ep_close_nb(back, UCP_EP_CLOSE_MODE_FORCE).is_null());
        for wi in w {
            ucp_worker_destroy(wi);
        }
        ucp_cleanup(ctx);
    }
}
