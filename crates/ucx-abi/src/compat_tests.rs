//! The calls of [`crate::compat`] driven as a C caller would. The blocking RMA calls and
//! typed atomics run against a target worker that a thread of its own progresses (as the peer
//! process would: a blocking call progresses only its own worker, and rucx's atomics are
//! carried out by the target's worker).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::compat::*;
use crate::context::{AbiContext, ucp_cleanup, ucp_init_version};
use crate::endpoint::{AbiEp, ucp_ep_create, ucp_ep_destroy};
use crate::rma::*;
use crate::status::{ptr_is_err, ptr_is_ptr};
use crate::stream::*;
use crate::tag::{ucp_request_check_status, ucp_request_free};
use crate::types::*;
use crate::worker::*;

fn context(features: u64) -> *mut AbiContext {
    // SAFETY: all-zero is a valid ucp_params_t.
    let mut params: UcpParams = unsafe { std::mem::zeroed() };
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = features;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid params and out pointer; NULL config reads the environment.
    unsafe {
        assert_eq!(
            ucp_init_version(1, 13, &params, std::ptr::null(), &mut ctx),
            UCS_OK
        );
    }
    ctx
}

fn worker(ctx: *mut AbiContext) -> *mut AbiWorker {
    let mut w = std::ptr::null_mut();
    // SAFETY: a live context; all-zero params are valid.
    unsafe {
        let p: WorkerParams = std::mem::zeroed();
        assert_eq!(ucp_worker_create(ctx, &p, &mut w), UCS_OK);
    }
    w
}

/// The packed address of `w` (a copy, as a peer gets it).
fn address(w: *mut AbiWorker) -> Vec<u8> {
    let (mut addr, mut len) = (std::ptr::null_mut(), 0);
    // SAFETY: a live worker; the address is copied, then released once.
    unsafe {
        assert_eq!(ucp_worker_get_address(w, &mut addr, &mut len), UCS_OK);
        let v = std::slice::from_raw_parts(addr.cast::<u8>(), len).to_vec();
        ucp_worker_release_address(w, addr);
        v
    }
}

fn connect(w: *mut AbiWorker, addr: &[u8]) -> *mut AbiEp {
    let mut ep = std::ptr::null_mut();
    // SAFETY: a live worker, an address of this library.
    unsafe {
        let mut p: EpParams = std::mem::zeroed();
        p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        p.address = addr.as_ptr().cast();
        assert_eq!(ucp_ep_create(w, &p, &mut ep), UCS_OK);
    }
    ep
}

/// What the target thread hands the initiator: its worker's address, a packed key of the
/// region it mapped, and the region's address.
struct Offer {
    addr: Vec<u8>,
    rkey: Vec<u8>,
    base: u64,
}

/// A worker of a context of its own on a thread that progresses it until dropped.
struct Target {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Target {
    fn start(len: usize) -> (Target, Offer) {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let ctx = context(UCP_FEATURE_RMA | UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64);
            let w = worker(ctx);
            let p = MemMapParams {
                field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                address: std::ptr::null_mut(),
                length: len,
                flags: UCP_MEM_MAP_ALLOCATE,
                prot: 0,
                memory_type: 0,
                exported_memh_buffer: std::ptr::null(),
            };
            let mut memh = std::ptr::null_mut();
            // SAFETY: live objects, valid parameters; the key buffer is copied, then
            // released once; everything is destroyed once, in UCX's order.
            unsafe {
                assert_eq!(ucp_mem_map(ctx, &p, &mut memh), UCS_OK);
                let mut a = MemAttr {
                    field_mask: UCP_MEM_ATTR_FIELD_ADDRESS,
                    address: std::ptr::null_mut(),
                    length: 0,
                    mem_type: 0,
                };
                assert_eq!(ucp_mem_query(memh, &mut a), UCS_OK);
                let (mut kb, mut ks) = (std::ptr::null_mut(), 0);
                assert_eq!(ucp_rkey_pack(ctx, memh, &mut kb, &mut ks), UCS_OK);
                let rkey = std::slice::from_raw_parts(kb.cast::<u8>(), ks).to_vec();
                ucp_rkey_buffer_release(kb);
                tx.send(Offer {
                    addr: address(w),
                    rkey,
                    base: a.address as u64,
                })
                .unwrap();
                while !s.load(Ordering::Acquire) {
                    ucp_worker_progress(w);
                }
                assert_eq!(ucp_mem_unmap(ctx, memh), UCS_OK);
                ucp_worker_destroy(w);
                ucp_cleanup(ctx);
            }
        });
        let offer = rx.recv().expect("the target's offer");
        (
            Target {
                stop,
                thread: Some(thread),
            },
            offer,
        )
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.join().expect("target thread");
        }
    }
}

/// `ucp_put`, `ucp_get`, the flushes and every typed atomic, blocking, against a target that
/// progresses on its own: every byte lands, every old value comes back.
#[test]
fn blocking_rma_and_typed_atomics_end_with_their_results() {
    let (target, offer) = Target::start(4096);
    let ctx = context(UCP_FEATURE_RMA | UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64);
    let w = worker(ctx);
    let ep = connect(w, &offer.addr);
    let mut rk = std::ptr::null_mut();
    let base = offer.base;
    // SAFETY: live objects; every buffer handed in outlives its blocking call.
    unsafe {
        assert_eq!(
            ucp_ep_rkey_unpack(ep, offer.rkey.as_ptr().cast(), &mut rk),
            UCS_OK
        );
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(ucp_put(ep, data.as_ptr().cast(), 1000, base, rk), UCS_OK);
        let mut back = vec![0u8; 1000];
        assert_eq!(
            ucp_get(ep, back.as_mut_ptr().cast(), 1000, base, rk),
            UCS_OK
        );
        assert_eq!(back, data, "ucp_get reads what ucp_put wrote");

        // 64-bit words at 1024, 32-bit ones at 2048, zeroed first.
        let zero = [0u8; 64];
        assert_eq!(
            ucp_put(ep, zero.as_ptr().cast(), 64, base + 1024, rk),
            UCS_OK
        );
        assert_eq!(
            ucp_put(ep, zero.as_ptr().cast(), 64, base + 2048, rk),
            UCS_OK
        );
        let (w64, w32) = (base + 1024, base + 2048);
        assert_eq!(ucp_atomic_add64(ep, 5, w64, rk), UCS_OK);
        assert_eq!(ucp_ep_flush(ep), UCS_OK, "the flush completes the add");
        let mut r64 = 0u64;
        assert_eq!(ucp_atomic_fadd64(ep, 3, w64, rk, &mut r64), UCS_OK);
        assert_eq!(r64, 5);
        assert_eq!(ucp_atomic_swap64(ep, 100, w64, rk, &mut r64), UCS_OK);
        assert_eq!(r64, 8);
        assert_eq!(ucp_atomic_cswap64(ep, 7, 1, w64, rk, &mut r64), UCS_OK);
        assert_eq!(r64, 100, "a failed compare leaves the word");
        assert_eq!(
            ucp_atomic_cswap64(ep, 100, 1 << 40, w64, rk, &mut r64),
            UCS_OK
        );
        assert_eq!(r64, 100);
        let mut word = 0u64;
        assert_eq!(ucp_get(ep, (&raw mut word).cast(), 8, w64, rk), UCS_OK);
        assert_eq!(word, 1 << 40, "the compare matched: swapped");

        assert_eq!(ucp_atomic_add32(ep, 9, w32, rk), UCS_OK);
        assert_eq!(
            ucp_worker_flush(w),
            UCS_OK,
            "the worker's flush completes the add"
        );
        let mut r32 = 0u32;
        assert_eq!(ucp_atomic_fadd32(ep, u32::MAX, w32, rk, &mut r32), UCS_OK);
        assert_eq!(r32, 9);
        assert_eq!(ucp_atomic_swap32(ep, 77, w32, rk, &mut r32), UCS_OK);
        assert_eq!(r32, 8, "9 + u32::MAX wraps to 8");
        assert_eq!(ucp_atomic_cswap32(ep, 77, 78, w32, rk, &mut r32), UCS_OK);
        assert_eq!(r32, 77);
        let mut word32 = 0u32;
        assert_eq!(ucp_get(ep, (&raw mut word32).cast(), 4, w32, rk), UCS_OK);
        assert_eq!(word32, 78);
        let next = ucp_get(ep, (&raw mut word32).cast(), 4, w32 + 4, rk);
        assert_eq!(
            (next, word32),
            (UCS_OK, 0),
            "the next word was never touched"
        );

        // Refusals come back as statuses, nothing blocks.
        assert_eq!(
            ucp_atomic_fadd64(ep, 1, w64, rk, std::ptr::null_mut()),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_atomic_cswap32(ep, 1, 2, w32, rk, std::ptr::null_mut()),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_atomic_fadd64(ep, 1, w64 + 1, rk, &mut r64),
            UCS_ERR_INVALID_PARAM,
            "misaligned"
        );
        let far = base + (1 << 30);
        let s = ucp_get(ep, back.as_mut_ptr().cast(), 8, far, rk);
        assert!(s != UCS_OK && s < 0, "outside the region: {s}");
        assert_eq!(
            ucp_put(std::ptr::null(), data.as_ptr().cast(), 1, base, rk),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(ucp_ep_flush(std::ptr::null()), UCS_ERR_INVALID_PARAM);
        assert_eq!(ucp_worker_flush(std::ptr::null()), UCS_ERR_INVALID_PARAM);

        ucp_rkey_destroy(rk);
        ucp_ep_destroy(ep);
        ucp_worker_destroy(w);
        ucp_cleanup(ctx);
    }
    drop(target);
}

static SENT: AtomicUsize = AtomicUsize::new(0);
static RECEIVED: Mutex<Vec<(Status, usize)>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_sent(_: *mut c_void, status: Status) {
    assert_eq!(status, UCS_OK);
    SENT.fetch_add(1, Ordering::Relaxed);
}

unsafe extern "C" fn on_received(_: *mut c_void, status: Status, length: usize) {
    RECEIVED.lock().unwrap().push((status, length));
}

/// Progress both workers until `done`; the request, if one, is freed once ended.
fn drive(w: [*mut AbiWorker; 2], mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(60), "no completion");
        // SAFETY: live workers.
        unsafe {
            ucp_worker_progress(w[0]);
            ucp_worker_progress(w[1]);
        }
    }
}

/// `ucp_stream_send_nb` and `ucp_stream_recv_nb` (with and without `WAITALL`): every byte in
/// order, each callback once with the length received.
#[test]
fn stream_callback_forms_carry_every_byte_in_order() {
    let ctx = context(UCP_FEATURE_STREAM);
    let w = [worker(ctx), worker(ctx)];
    let ep = [connect(w[0], &address(w[1])), connect(w[1], &address(w[0]))];
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let dt = 1 << UCP_DATATYPE_SHIFT;
    // SAFETY: live objects; the buffers outlive the requests, which are freed once ended.
    unsafe {
        let s = ucp_stream_send_nb(
            ep[0],
            data.as_ptr().cast(),
            data.len(),
            dt,
            Some(on_sent),
            0,
        );
        assert!(!ptr_is_err(s), "posted");
        let mut got = vec![0u8; data.len()];
        let mut length = 0usize;
        // Without WAITALL: what is at hand, then the rest with WAITALL.
        let mut off = 0;
        while off < data.len() {
            let waitall = off >= data.len() / 2;
            let flags = if waitall {
                UCP_STREAM_RECV_FLAG_WAITALL
            } else {
                0
            };
            let want = data.len() - off;
            let r = ucp_stream_recv_nb(
                ep[1],
                got[off..].as_mut_ptr().cast(),
                want,
                dt,
                Some(on_received),
                &mut length,
                flags,
            );
            assert!(!ptr_is_err(r), "receive posted");
            let n = if r.is_null() {
                length
            } else {
                assert!(ptr_is_ptr(r));
                drive(w, || ucp_request_check_status(r) != UCS_INPROGRESS);
                assert_eq!(ucp_request_check_status(r), UCS_OK);
                ucp_request_free(r);
                let (status, len) = RECEIVED.lock().unwrap().pop().expect("its callback ran");
                assert_eq!(status, UCS_OK);
                len
            };
            assert!(n > 0 && n <= want, "{n} of {want}");
            if waitall {
                assert_eq!(n, want, "WAITALL fills the buffer");
            }
            off += n;
        }
        assert_eq!(got, data, "every byte, in order");
        if ptr_is_ptr(s) {
            drive(w, || ucp_request_check_status(s) != UCS_INPROGRESS);
            ucp_request_free(s);
            assert_eq!(
                SENT.load(Ordering::Relaxed),
                1,
                "the send's callback ran once"
            );
        }
        assert!(
            RECEIVED.lock().unwrap().is_empty(),
            "no callback for an in-place end"
        );
        let bad = ucp_stream_send_nb(ep[0], data.as_ptr().cast(), 1, dt, None, 1);
        assert_eq!(
            bad as isize as Status, UCS_ERR_INVALID_PARAM,
            "unknown flags"
        );
        let bad = ucp_stream_recv_nb(ep[1], got.as_mut_ptr().cast(), 1, dt, None, &mut length, 8);
        assert_eq!(
            bad as isize as Status, UCS_ERR_INVALID_PARAM,
            "unknown flags"
        );
        for e in ep {
            ucp_ep_destroy(e);
        }
        for x in w {
            ucp_worker_destroy(x);
        }
        ucp_cleanup(ctx);
    }
}

/// What `f` writes to a `FILE *`.
fn printed(f: impl FnOnce(*mut c_void)) -> String {
    // SAFETY: a fresh temporary file, read back from its start, closed once.
    unsafe {
        let file = libc::tmpfile();
        assert!(!file.is_null());
        f(file.cast());
        libc::fflush(file);
        libc::rewind(file);
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = libc::fread(buf.as_mut_ptr().cast(), 1, buf.len(), file);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        libc::fclose(file);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// The queries answer what they know, refuse what they do not, and the printing calls name
/// the endpoint's protocols and the context's domains.
#[test]
fn queries_and_printing_answer_or_refuse() {
    let ctx = context(UCP_FEATURE_TAG);
    let w = [worker(ctx), worker(ctx)];
    let (a0, a1) = (address(w[0]), address(w[1]));
    let ep = connect(w[0], &a1);
    // SAFETY: live objects and valid attribute structs throughout.
    unsafe {
        let mut lib = LibAttr {
            field_mask: UCP_LIB_ATTR_FIELD_MAX_THREAD_LEVEL,
            max_thread_level: -1,
        };
        assert_eq!(ucp_lib_query(&mut lib), UCS_OK);
        assert_eq!(lib.max_thread_level, UCS_THREAD_MODE_SINGLE);
        lib.field_mask = 2;
        assert_eq!(ucp_lib_query(&mut lib), UCS_ERR_INVALID_PARAM);
        assert_eq!(ucp_lib_query(std::ptr::null_mut()), UCS_ERR_INVALID_PARAM);

        let uid = |a: &[u8]| {
            let mut attr = WorkerAddressAttr {
                field_mask: UCP_WORKER_ADDRESS_ATTR_FIELD_UID,
                worker_uid: 0,
            };
            let s = ucp_worker_address_query(a.as_ptr().cast(), &mut attr);
            (s, attr.worker_uid)
        };
        let (s0, u0) = uid(&a0);
        let (s1, u1) = uid(&a1);
        assert_eq!((s0, s1), (UCS_OK, UCS_OK));
        assert_ne!(u0, u1, "two workers, two ids");
        assert_eq!(
            uid(&address(w[0])),
            (UCS_OK, u0),
            "the same worker, the same id"
        );
        let mut garbage = a0.clone();
        garbage[0] ^= 0xff;
        assert_eq!(uid(&garbage).0, UCS_ERR_INVALID_PARAM);
        let mut cut = a0.clone();
        let inner = cut.len() - 8;
        cut[4..8].copy_from_slice(&((inner / 2) as u32).to_le_bytes());
        assert_eq!(uid(&cut).0, UCS_ERR_INVALID_PARAM, "a truncated address");

        let mut ea: EpAttr = std::mem::zeroed();
        ea.field_mask = UCP_EP_ATTR_FIELD_NAME;
        assert_eq!(ucp_ep_query(ep, &mut ea), UCS_OK);
        let name = std::ffi::CStr::from_ptr(ea.name.as_ptr()).to_string_lossy();
        assert!(name.starts_with("rucx:"), "{name}");
        ea.field_mask = UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR;
        assert_eq!(ucp_ep_query(ep, &mut ea), UCS_ERR_UNSUPPORTED);
        ea.field_mask = 1 << 9;
        assert_eq!(ucp_ep_query(ep, &mut ea), UCS_ERR_INVALID_PARAM);

        // A pending receive, then the same request once it ended.
        let mut buf = [0u8; 8];
        let r = crate::tag::ucp_tag_recv_nb(
            w[1],
            buf.as_mut_ptr().cast(),
            8,
            1 << UCP_DATATYPE_SHIFT,
            5,
            u64::MAX,
            None,
        );
        assert!(ptr_is_ptr(r));
        let mut text = [0 as std::ffi::c_char; 200];
        let mut ra = RequestAttr {
            field_mask: UCP_REQUEST_ATTR_FIELD_STATUS
                | UCP_REQUEST_ATTR_FIELD_INFO_STRING
                | UCP_REQUEST_ATTR_FIELD_INFO_STRING_SIZE
                | UCP_REQUEST_ATTR_FIELD_MEM_TYPE,
            debug_string: text.as_mut_ptr(),
            debug_string_size: text.len(),
            status: 0,
            mem_type: 0,
        };
        assert_eq!(ucp_request_query(r, &mut ra), UCS_OK);
        assert_eq!(ra.status, UCS_INPROGRESS);
        let desc = std::ffi::CStr::from_ptr(text.as_ptr()).to_string_lossy();
        assert!(desc.contains("rucx request"), "{desc}");
        let msg = 42u64.to_le_bytes();
        let s = crate::tag::ucp_tag_send_nb(
            ep,
            msg.as_ptr().cast(),
            8,
            1 << UCP_DATATYPE_SHIFT,
            5,
            None,
        );
        drive([w[0], w[1]], || {
            ucp_request_check_status(r) != UCS_INPROGRESS
        });
        ra.field_mask = UCP_REQUEST_ATTR_FIELD_STATUS;
        assert_eq!(ucp_request_query(r, &mut ra), UCS_OK);
        assert_eq!((ra.status, buf), (UCS_OK, msg));
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            drive([w[0], w[1]], || {
                ucp_request_check_status(s) != UCS_INPROGRESS
            });
            ucp_request_free(s);
        }
        ra.field_mask = 1 << 7;
        assert_eq!(ucp_request_query(r, &mut ra), UCS_ERR_INVALID_PARAM);

        let empty = ucp_request_alloc(w[0]);
        assert!(ptr_is_ptr(empty));
        assert_eq!(ucp_request_check_status(empty), UCS_OK);
        ucp_request_free(empty);
        assert!(ucp_request_alloc(std::ptr::null()).is_null());

        let info = printed(|f| ucp_ep_print_info(ep, f));
        assert!(info.starts_with("# rucx "), "{info}");
        assert!(info.lines().count() > 2, "the plan's lines: {info}");
        let mem = printed(|f| ucp_mem_print_info(c"1m".as_ptr(), ctx, f));
        assert!(
            mem.contains("1048576 bytes") && mem.contains("domain:"),
            "{mem}"
        );
        let bad = printed(|f| ucp_mem_print_info(c"lots".as_ptr(), ctx, f));
        assert!(bad.contains("cannot read"), "{bad}");
        ucp_ep_print_info(std::ptr::null(), std::ptr::null_mut());
        ucp_worker_wait_mem(w[0], buf.as_mut_ptr().cast());

        let am = ucp_am_send_nb(
            ep,
            1,
            msg.as_ptr().cast(),
            8,
            1 << UCP_DATATYPE_SHIFT,
            None,
            0,
        );
        assert_eq!(am as isize as Status, UCS_ERR_UNSUPPORTED);
        assert_eq!(
            ucp_worker_set_am_handler(w[0], 1, std::ptr::null(), std::ptr::null_mut(), 0),
            UCS_ERR_UNSUPPORTED
        );
        let m = ucp_ep_modify_nb(ep, std::ptr::null());
        assert_eq!(m as isize as Status, UCS_ERR_UNSUPPORTED);

        ucp_ep_destroy(ep);
        for x in w {
            ucp_worker_destroy(x);
        }
        ucp_cleanup(ctx);
    }
}

/// `ucp_stream_worker_poll` names the endpoint (with its user data) whose stream holds bytes,
/// `ucp_stream_recv_data_nb` hands them out without a receive, all in order, and after the
/// release nothing is left; `ucp_stream_recv_request_test` reports a receive's length.
#[test]
fn stream_data_is_polled_taken_and_released_in_order() {
    let ctx = context(UCP_FEATURE_STREAM);
    let w = [worker(ctx), worker(ctx)];
    let ep0 = connect(w[0], &address(w[1]));
    let a0 = address(w[0]);
    let mut tag = 0x5eedu64;
    let ep1 = {
        let mut ep = std::ptr::null_mut();
        // SAFETY: a live worker, an address of this library.
        unsafe {
            let mut p: EpParams = std::mem::zeroed();
            p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_USER_DATA;
            p.address = a0.as_ptr().cast();
            p.user_data = (&raw mut tag).cast();
            assert_eq!(ucp_ep_create(w[1], &p, &mut ep), UCS_OK);
        }
        ep
    };
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    let dt = 1 << UCP_DATATYPE_SHIFT;
    // SAFETY: live objects; the buffers outlive the requests, which are freed once ended.
    unsafe {
        let mut polled = [const {
            StreamPollEp {
                ep: std::ptr::null_mut(),
                user_data: std::ptr::null_mut(),
                flags: 0,
                reserved: [0; 16],
            }
        }; 4];
        assert_eq!(
            ucp_stream_worker_poll(w[1], polled.as_mut_ptr(), 4, 0),
            0,
            "nothing yet"
        );
        let mut length = 0;
        assert!(
            ucp_stream_recv_data_nb(ep1, &mut length).is_null(),
            "nothing to take"
        );
        for part in data.chunks(30_000) {
            let s = ucp_stream_send_nb(ep0, part.as_ptr().cast(), part.len(), dt, None, 0);
            if ptr_is_ptr(s) {
                drive(w, || ucp_request_check_status(s) != UCS_INPROGRESS);
                ucp_request_free(s);
            }
        }
        let mut got = Vec::new();
        let t = Instant::now();
        while got.len() < data.len() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "only {} bytes",
                got.len()
            );
            ucp_worker_progress(w[0]);
            ucp_worker_progress(w[1]);
            let n = ucp_stream_worker_poll(w[1], polled.as_mut_ptr(), 4, 0);
            assert!((0..=1).contains(&n), "{n}");
            if n == 0 {
                continue;
            }
            assert_eq!(polled[0].ep, ep1);
            assert_eq!(polled[0].user_data, (&raw mut tag).cast());
            let d = ucp_stream_recv_data_nb(ep1, &mut length);
            assert!(ptr_is_ptr(d) && length > 0, "polled, so there are bytes");
            got.extend_from_slice(std::slice::from_raw_parts(d.cast::<u8>(), length));
            ucp_stream_data_release(ep1, d);
        }
        assert_eq!(got, data, "every byte, in order, once");
        assert_eq!(ucp_stream_worker_poll(w[1], polled.as_mut_ptr(), 4, 0), 0);
        assert!(ucp_stream_recv_data_nb(ep1, &mut length).is_null());
        ucp_stream_data_release(ep1, got.as_mut_ptr().cast()); // not ours: ignored
        assert_eq!(
            ucp_stream_worker_poll(w[1], polled.as_mut_ptr(), 4, 1),
            UCS_ERR_INVALID_PARAM as isize
        );
        assert_eq!(
            ucp_stream_recv_data_nb(ep1, std::ptr::null_mut()) as isize as Status,
            UCS_ERR_INVALID_PARAM
        );

        // A receive posted before its bytes: the test reports the length once it ended.
        let mut buf = [0u8; 16];
        let r = ucp_stream_recv_nb(
            ep1,
            buf.as_mut_ptr().cast(),
            16,
            dt,
            None,
            &mut length,
            UCP_STREAM_RECV_FLAG_WAITALL,
        );
        assert!(ptr_is_ptr(r));
        let mut len = 0;
        assert_eq!(ucp_stream_recv_request_test(r, &mut len), UCS_INPROGRESS);
        let s = ucp_stream_send_nb(ep0, data.as_ptr().cast(), 16, dt, None, 0);
        drive(w, || {
            ucp_stream_recv_request_test(r, &mut len) != UCS_INPROGRESS
        });
        assert_eq!(
            (ucp_stream_recv_request_test(r, &mut len), len),
            (UCS_OK, 16)
        );
        assert_eq!(&buf[..], &data[..16]);
        ucp_request_free(r);
        if ptr_is_ptr(s) {
            drive(w, || ucp_request_check_status(s) != UCS_INPROGRESS);
            ucp_request_free(s);
        }
        ucp_ep_destroy(ep0);
        ucp_ep_destroy(ep1);
        for x in w {
            ucp_worker_destroy(x);
        }
        ucp_cleanup(ctx);
    }
}

/// One event of the caller's epoll set `ep` within `ms`: its data.
fn epoll_event(ep: i32, ms: i32) -> Option<u64> {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: a valid event buffer of one entry.
    let n = unsafe { libc::epoll_wait(ep, &mut ev, 1, ms) };
    assert!(n >= 0, "epoll_wait: {}", std::io::Error::last_os_error());
    (n == 1).then_some(ev.u64)
}

/// A worker created with the caller's epoll set (`UCP_WORKER_PARAM_FIELD_EVENT_FD`): armed
/// and quiet the set reports nothing; an arrival is reported with the worker's user data. A
/// descriptor that is no epoll set is refused.
#[test]
fn the_callers_event_descriptor_reports_the_workers_events() {
    let ctx = context(UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP);
    // SAFETY: plain system call; closed below.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0);
    let mut w1 = std::ptr::null_mut();
    // SAFETY: live objects; all-zero params are valid and filled where the mask says.
    unsafe {
        let mut p: WorkerParams = std::mem::zeroed();
        p.field_mask = UCP_WORKER_PARAM_FIELD_EVENT_FD | UCP_WORKER_PARAM_FIELD_USER_DATA;
        p.event_fd = ep;
        p.user_data = 0xfeed as *mut c_void;
        assert_eq!(ucp_worker_create(ctx, &p, &mut w1), UCS_OK);
        let w0 = worker(ctx);
        let e0 = connect(w0, &address(w1));
        let t = Instant::now();
        while crate::wait::ucp_worker_arm(w1) == UCS_ERR_BUSY {
            assert!(t.elapsed() < Duration::from_secs(30), "never armed");
            ucp_worker_progress(w0);
            ucp_worker_progress(w1);
        }
        assert_eq!(epoll_event(ep, 50), None, "armed, nothing happened");
        let msg = 7u64.to_le_bytes();
        let s = crate::tag::ucp_tag_send_nb(
            e0,
            msg.as_ptr().cast(),
            8,
            1 << UCP_DATATYPE_SHIFT,
            3,
            None,
        );
        let mut got = None;
        let t = Instant::now();
        while got.is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the arrival was never reported"
            );
            ucp_worker_progress(w0);
            got = epoll_event(ep, 10);
        }
        assert_eq!(got, Some(0xfeed), "reported with the worker's user data");
        let mut buf = [0u8; 8];
        let r = crate::tag::ucp_tag_recv_nb(
            w1,
            buf.as_mut_ptr().cast(),
            8,
            1 << UCP_DATATYPE_SHIFT,
            3,
            u64::MAX,
            None,
        );
        drive([w0, w1], || {
            r.is_null() || ucp_request_check_status(r) != UCS_INPROGRESS
        });
        if ptr_is_ptr(r) {
            ucp_request_free(r);
        }
        assert_eq!(buf, msg);
        if ptr_is_ptr(s) {
            drive([w0, w1], || ucp_request_check_status(s) != UCS_INPROGRESS);
            ucp_request_free(s);
        }
        ucp_ep_destroy(e0);
        ucp_worker_destroy(w0);
        ucp_worker_destroy(w1);

        // Not an epoll set: refused, no worker made.
        let efd = libc::eventfd(0, libc::EFD_CLOEXEC);
        for bad in [efd, -1] {
            let mut p: WorkerParams = std::mem::zeroed();
            p.field_mask = UCP_WORKER_PARAM_FIELD_EVENT_FD;
            p.event_fd = bad;
            let mut w = std::ptr::null_mut();
            assert_eq!(
                ucp_worker_create(ctx, &p, &mut w),
                UCS_ERR_INVALID_PARAM,
                "fd {bad}"
            );
            assert!(w.is_null());
        }
        libc::close(efd);
        libc::close(ep);
        ucp_cleanup(ctx);
    }
}
