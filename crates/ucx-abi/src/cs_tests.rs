//! The client/server, stream, active-message and wake-up calls driven as a C caller would,
//! in one process: two workers connected by worker address (posix), or a client worker on a
//! thread of its own connecting to a listener by socket address (tcp); their edge cases and
//! the refusals of bad input (UCX's error status, never a crash).

use std::ffi::c_void;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::am::*;
use crate::config::{AbiConfig, ucp_config_modify, ucp_config_read, ucp_config_release};
use crate::context::{AbiContext, ucp_cleanup, ucp_init_version};
use crate::endpoint::{AbiEp, ucp_ep_close_nbx, ucp_ep_create};
use crate::listener::*;
use crate::status::{ptr_is_err, ptr_is_ptr};
use crate::stream::*;
use crate::tag::*;
use crate::types::*;
use crate::wait::*;
use crate::worker::*;

/// One of these tests at a time (they share the callback record).
static ONE: Mutex<()> = Mutex::new(());
/// (status, length, user data) of every length callback; (status, user data) of sends.
static LENGTHS: Mutex<Vec<(Status, usize, usize)>> = Mutex::new(Vec::new());
static SENDS: Mutex<Vec<(Status, usize)>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_length(_: *mut c_void, status: Status, length: usize, data: *mut c_void) {
    LENGTHS
        .lock()
        .unwrap()
        .push((status, length, data as usize));
}

unsafe extern "C" fn on_send(_: *mut c_void, status: Status, data: *mut c_void) {
    SENDS.lock().unwrap().push((status, data as usize));
}

pub fn context(tls: &std::ffi::CStr) -> *mut AbiContext {
    let mut cfg: *mut AbiConfig = std::ptr::null_mut();
    // SAFETY: all-zero is a valid ucp_params_t.
    let mut params: UcpParams = unsafe { std::mem::zeroed() };
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_STREAM | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | UCP_FEATURE_TAG;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: every pointer handed in is valid for what the call does with it.
    unsafe {
        assert_eq!(
            ucp_config_read(std::ptr::null(), std::ptr::null(), &mut cfg),
            UCS_OK
        );
        assert_eq!(
            ucp_config_modify(cfg, c"TLS".as_ptr(), tls.as_ptr()),
            UCS_OK
        );
        assert_eq!(ucp_init_version(1, 16, &params, cfg, &mut ctx), UCS_OK);
        ucp_config_release(cfg);
    }
    ctx
}

pub fn worker(ctx: *mut AbiContext) -> *mut AbiWorker {
    let mut w = std::ptr::null_mut();
    // SAFETY: a live context; all-zero params are valid.
    unsafe {
        let p: WorkerParams = std::mem::zeroed();
        assert_eq!(ucp_worker_create(ctx, &p, &mut w), UCS_OK);
    }
    w
}

/// Two workers of one context, an endpoint each way (by worker address).
struct Pair {
    ctx: *mut AbiContext,
    w: [*mut AbiWorker; 2],
    ep: [*mut AbiEp; 2],
}

impl Pair {
    fn new() -> Pair {
        let ctx = context(c"posix");
        let w = [worker(ctx), worker(ctx)];
        // SAFETY: live workers.
        let ep = unsafe { crate::test_util::connect_both(w) };
        LENGTHS.lock().unwrap().clear();
        SENDS.lock().unwrap().clear();
        Pair { ctx, w, ep }
    }

    #[track_caller]
    fn drive(&self, mut done: impl FnMut() -> bool) {
        let t = Instant::now();
        while !done() {
            assert!(t.elapsed() < Duration::from_secs(60), "no completion");
            // SAFETY: live workers.
            unsafe {
                ucp_worker_progress(self.w[0]);
                ucp_worker_progress(self.w[1]);
            }
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let force = nbx(UCP_OP_ATTR_FIELD_FLAGS, UCP_EP_CLOSE_FLAG_FORCE);
        // SAFETY: live objects, closed once, endpoints before workers before the context.
        unsafe {
            for e in self.ep {
                assert!(ucp_ep_close_nbx(e, &force).is_null());
            }
            for w in self.w {
                ucp_worker_destroy(w);
            }
            ucp_cleanup(self.ctx);
        }
    }
}

fn nbx(mask: u32, flags: u32) -> RequestParam {
    // SAFETY: all-zero is a valid RequestParam (NULL pointers, no callback).
    let mut p: RequestParam = unsafe { std::mem::zeroed() };
    p.op_attr_mask = mask;
    p.flags = flags;
    p
}

fn with_length_cb(mut p: RequestParam, data: usize) -> RequestParam {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.length = Some(on_length);
    p.user_data = data as *mut c_void;
    p
}

fn with_send_cb(mut p: RequestParam, data: usize) -> RequestParam {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = Some(on_send);
    p.user_data = data as *mut c_void;
    p
}

fn is_status(p: *mut c_void, s: Status) -> bool {
    p as isize == isize::from(s)
}

/// Progress until request `r` (or NULL: done in place) completed; its status, freed.
#[track_caller]
fn wait(pair: &Pair, r: *mut c_void) -> Status {
    if r.is_null() {
        return UCS_OK;
    }
    assert!(ptr_is_ptr(r), "an error: {}", r as isize);
    // SAFETY: a live request of this library until freed below.
    unsafe {
        pair.drive(|| ucp_request_check_status(r) != UCS_INPROGRESS);
        let s = ucp_request_check_status(r);
        ucp_request_free(r);
        s
    }
}

#[test]
fn stream_bytes_arrive_in_order_in_any_split_and_a_partial_receive_takes_what_is_there() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let data: Vec<u8> = (0..100u8).collect();
    let waitall = with_length_cb(
        nbx(UCP_OP_ATTR_FIELD_FLAGS, UCP_STREAM_RECV_FLAG_WAITALL),
        7,
    );
    let partial = with_length_cb(nbx(0, 0), 8);
    let send = with_send_cb(nbx(0, 0), 9);
    let mut a = [0u8; 30];
    let mut b = [0u8; 200];
    // SAFETY: live handles; every buffer outlives its operation (waited for below).
    unsafe {
        let mut len = usize::MAX;
        // Posted first: filled in posting order, whatever the sends' split.
        let ra = ucp_stream_recv_nbx(pair.ep[1], a.as_mut_ptr().cast(), 30, &mut len, &waitall);
        assert!(ptr_is_ptr(ra), "nothing arrived yet: a request");
        let s1 = ucp_stream_send_nbx(pair.ep[0], data.as_ptr().cast(), 20, &send);
        let s2 = ucp_stream_send_nbx(pair.ep[0], data[20..].as_ptr().cast(), 80, &send);
        assert_eq!(wait(&pair, ra), UCS_OK);
        assert_eq!(a[..], data[..30]);
        let rb = ucp_stream_recv_nbx(pair.ep[1], b.as_mut_ptr().cast(), 200, &mut len, &partial);
        let got = if rb.is_null() {
            len
        } else {
            assert_eq!(wait(&pair, rb), UCS_OK);
            LENGTHS.lock().unwrap().last().expect("its callback").1
        };
        assert!((1..=70).contains(&got), "a partial receive: {got} bytes");
        assert_eq!(b[..got], data[30..30 + got]);
        assert_eq!(wait(&pair, s1), UCS_OK);
        assert_eq!(wait(&pair, s2), UCS_OK);
        // The rest, exactly, with the sender's callbacks' user data.
        let rest = 70 - got;
        let mut c = vec![0u8; rest];
        let rc = ucp_stream_recv_nbx(pair.ep[1], c.as_mut_ptr().cast(), rest, &mut len, &waitall);
        if rc.is_null() {
            assert_eq!(len, rest);
        } else {
            assert_eq!(wait(&pair, rc), UCS_OK);
        }
        assert_eq!(c[..], data[30 + got..]);
        let l = LENGTHS.lock().unwrap().clone();
        assert_eq!(l[0], (UCS_OK, 30, 7), "{l:?}");
        for s in SENDS.lock().unwrap().iter() {
            assert_eq!(*s, (UCS_OK, 9));
        }
    }
}

#[test]
fn stream_calls_refuse_bad_input() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let mut buf = [0u8; 8];
    let mut len = 0usize;
    let p = nbx(0, 0);
    // SAFETY: live handles or NULL, which the calls refuse before touching anything.
    unsafe {
        let b = buf.as_mut_ptr().cast::<c_void>();
        let bad = |r: *mut c_void, s: Status| assert!(is_status(r, s), "{}", r as isize);
        bad(
            ucp_stream_send_nbx(std::ptr::null(), b, 8, &p),
            UCS_ERR_INVALID_PARAM,
        );
        bad(
            ucp_stream_recv_nbx(pair.ep[1], b, 8, std::ptr::null_mut(), &p),
            UCS_ERR_INVALID_PARAM,
        );
        bad(
            ucp_stream_recv_nbx(pair.ep[1], b, 8, &mut len, &nbx(UCP_OP_ATTR_FIELD_FLAGS, 2)),
            UCS_ERR_INVALID_PARAM,
        );
        bad(
            ucp_stream_send_nbx(pair.ep[0], b, 8, &nbx(1 << 12, 0)),
            UCS_ERR_INVALID_PARAM,
        );
        let mut strided = nbx(UCP_OP_ATTR_FIELD_DATATYPE, 0);
        strided.datatype = UCP_DATATYPE_STRIDED;
        bad(
            ucp_stream_send_nbx(pair.ep[0], b, 1, &strided),
            UCS_ERR_UNSUPPORTED,
        );
        bad(
            ucp_stream_send_nbx(pair.ep[0], std::ptr::null(), 8, &p),
            UCS_ERR_INVALID_PARAM,
        );
        // A waiting receive canceled: it ends canceled, from progress.
        let r = ucp_stream_recv_nbx(pair.ep[1], b, 8, &mut len, &nbx(0, 0));
        assert!(ptr_is_ptr(r));
        ucp_request_cancel(pair.w[1], r);
        assert_eq!(wait(&pair, r), UCS_ERR_CANCELED);
        // Empty: done in place, nothing to send or wait for.
        assert!(ucp_stream_send_nbx(pair.ep[0], std::ptr::null(), 0, &p).is_null());
        let r = ucp_stream_recv_nbx(pair.ep[1], std::ptr::null_mut(), 0, &mut len, &p);
        assert!(r.is_null() && len == 0);
    }
}

/// What the handler of id 7 saw: header, data (when it came), length, attributes, reply ep.
type Seen = (Vec<u8>, Vec<u8>, usize, u64, usize);
static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());
/// The descriptor the handler kept (it returns `UCS_INPROGRESS` when `arg` is non-NULL).
static KEPT: Mutex<usize> = Mutex::new(0);

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const AmRecvParam,
) -> Status {
    // SAFETY: the library hands valid pointers for the call.
    unsafe {
        let h = std::slice::from_raw_parts(header.cast::<u8>(), header_length).to_vec();
        let p = &*param;
        let d = if p.recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA != 0 {
            std::slice::from_raw_parts(data.cast::<u8>(), length).to_vec()
        } else {
            Vec::new()
        };
        SEEN.lock()
            .unwrap()
            .push((h, d, length, p.recv_attr, p.reply_ep as usize));
    }
    if arg.is_null() {
        UCS_OK
    } else {
        *KEPT.lock().unwrap() = data as usize;
        UCS_INPROGRESS
    }
}

fn set_handler(w: *mut AbiWorker, keep: bool) {
    let p = AmHandlerParam {
        field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID
            | UCP_AM_HANDLER_PARAM_FIELD_CB
            | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        id: 7,
        flags: 0,
        cb: Some(on_am),
        arg: if keep {
            std::ptr::dangling_mut::<c_void>()
        } else {
            std::ptr::null_mut()
        },
    };
    // SAFETY: a live worker and valid params.
    assert_eq!(unsafe { ucp_worker_set_am_recv_handler(w, &p) }, UCS_OK);
}

#[test]
fn active_messages_eager_and_rendezvous_kept_and_fetched() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    SEEN.lock().unwrap().clear();
    set_handler(pair.w[1], false);
    let send = with_send_cb(nbx(0, 0), 3);
    // SAFETY: live handles; buffers outlive their operations (waited for below).
    unsafe {
        // Eager: the bytes come with the message; the handler returns UCS_OK.
        let r = ucp_am_send_nbx(
            pair.ep[0],
            7,
            b"hd".as_ptr().cast(),
            2,
            b"payload".as_ptr().cast(),
            7,
            &send,
        );
        assert_eq!(wait(&pair, r), UCS_OK);
        pair.drive(|| !SEEN.lock().unwrap().is_empty());
        let (h, d, len, attr, reply) = SEEN.lock().unwrap()[0].clone();
        assert_eq!((&h[..], &d[..], len), (&b"hd"[..], &b"payload"[..], 7));
        assert_eq!(
            attr,
            UCP_AM_RECV_ATTR_FIELD_REPLY_EP | UCP_AM_RECV_ATTR_FLAG_DATA
        );
        // The reply endpoint reaches the sender: a tag message back over it.
        let back = *b"back";
        let mut got = [0u8; 4];
        let rr = ucp_tag_recv_nbx(
            pair.w[0],
            got.as_mut_ptr().cast(),
            4,
            5,
            u64::MAX,
            &nbx(0, 0),
        );
        let rs = ucp_tag_send_nbx(
            reply as *const AbiEp,
            back.as_ptr().cast(),
            4,
            5,
            &nbx(0, 0),
        );
        assert_eq!(wait(&pair, rs), UCS_OK);
        assert_eq!(wait(&pair, rr), UCS_OK);
        assert_eq!(got, back);

        // Large: a descriptor (rendezvous), kept by the handler and fetched into our buffer.
        SEEN.lock().unwrap().clear();
        set_handler(pair.w[1], true);
        let big: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
        let r = ucp_am_send_nbx(
            pair.ep[0],
            7,
            std::ptr::null(),
            0,
            big.as_ptr().cast(),
            big.len(),
            &send,
        );
        pair.drive(|| !SEEN.lock().unwrap().is_empty());
        let (_, _, len, attr, _) = SEEN.lock().unwrap()[0].clone();
        assert_eq!(len, big.len());
        assert!(attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0, "{attr:#x}");
        let desc = *KEPT.lock().unwrap() as *mut c_void;
        let mut into = vec![0u8; big.len()];
        let p = with_length_cb(nbx(UCP_OP_ATTR_FLAG_NO_IMM_CMPL, 0), 11);
        let rd = ucp_am_recv_data_nbx(pair.w[1], desc, into.as_mut_ptr().cast(), into.len(), &p);
        assert_eq!(wait(&pair, rd), UCS_OK);
        assert!(into == big, "the payload arrived whole");
        assert_eq!(
            wait(&pair, r),
            UCS_OK,
            "the sender's request ends once fetched"
        );
        assert_eq!(
            LENGTHS.lock().unwrap().last(),
            Some(&(UCS_OK, big.len(), 11))
        );
        // The descriptor was used: a second fetch is refused, a release ignored.
        let again = ucp_am_recv_data_nbx(pair.w[1], desc, into.as_mut_ptr().cast(), 1, &p);
        assert!(is_status(again, UCS_ERR_INVALID_PARAM));
        ucp_am_data_release(pair.w[1], desc);

        // Eager data kept, then released.
        SEEN.lock().unwrap().clear();
        let r = ucp_am_send_nbx(
            pair.ep[0],
            7,
            std::ptr::null(),
            0,
            b"keep".as_ptr().cast(),
            4,
            &send,
        );
        assert_eq!(wait(&pair, r), UCS_OK);
        pair.drive(|| !SEEN.lock().unwrap().is_empty());
        let kept = *KEPT.lock().unwrap() as *mut c_void;
        // SAFETY: kept by the library until released.
        assert_eq!(std::slice::from_raw_parts(kept.cast::<u8>(), 4), b"keep");
        ucp_am_data_release(pair.w[1], kept);
        let again = ucp_am_recv_data_nbx(pair.w[1], kept, into.as_mut_ptr().cast(), 4, &p);
        assert!(is_status(again, UCS_ERR_INVALID_PARAM));
    }
}

#[test]
fn active_message_calls_refuse_bad_input() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let ok = AmHandlerParam {
        field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB,
        id: 1,
        flags: 0,
        cb: Some(on_am),
        arg: std::ptr::null_mut(),
    };
    // SAFETY: live handles or NULL, which the calls refuse.
    unsafe {
        let w = pair.w[1];
        assert_eq!(
            ucp_worker_set_am_recv_handler(std::ptr::null(), &ok),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_worker_set_am_recv_handler(w, std::ptr::null()),
            UCS_ERR_INVALID_PARAM
        );
        let no_id = AmHandlerParam {
            field_mask: UCP_AM_HANDLER_PARAM_FIELD_CB,
            ..ok
        };
        assert_eq!(
            ucp_worker_set_am_recv_handler(w, &no_id),
            UCS_ERR_INVALID_PARAM
        );
        let big_id = AmHandlerParam { id: 1 << 16, ..ok };
        assert_eq!(
            ucp_worker_set_am_recv_handler(w, &big_id),
            UCS_ERR_INVALID_PARAM
        );
        let bad_flags = AmHandlerParam {
            field_mask: ok.field_mask | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
            flags: 1 << 5,
            ..ok
        };
        assert_eq!(
            ucp_worker_set_am_recv_handler(w, &bad_flags),
            UCS_ERR_INVALID_PARAM
        );
        let unknown = AmHandlerParam {
            field_mask: ok.field_mask | 1 << 9,
            ..ok
        };
        assert_eq!(
            ucp_worker_set_am_recv_handler(w, &unknown),
            UCS_ERR_INVALID_PARAM
        );
        // Removing a handler (NULL callback) is allowed.
        let remove = AmHandlerParam { cb: None, ..ok };
        assert_eq!(ucp_worker_set_am_recv_handler(w, &remove), UCS_OK);
        let p = nbx(0, 0);
        let x = [0u8; 4];
        let e = pair.ep[0];
        assert!(is_status(
            ucp_am_send_nbx(e, 1 << 16, std::ptr::null(), 0, x.as_ptr().cast(), 4, &p),
            UCS_ERR_INVALID_PARAM
        ));
        assert!(is_status(
            ucp_am_send_nbx(e, 1, std::ptr::null(), 3, x.as_ptr().cast(), 4, &p),
            UCS_ERR_INVALID_PARAM
        ));
        assert!(is_status(
            ucp_am_send_nbx(
                e,
                1,
                std::ptr::null(),
                0,
                x.as_ptr().cast(),
                4,
                &nbx(UCP_OP_ATTR_FIELD_FLAGS, 1 << 9)
            ),
            UCS_ERR_INVALID_PARAM
        ));
        assert!(is_status(
            ucp_am_send_nbx(
                std::ptr::null(),
                1,
                std::ptr::null(),
                0,
                x.as_ptr().cast(),
                4,
                &p
            ),
            UCS_ERR_INVALID_PARAM
        ));
        let bogus = [0u64; 4];
        let mut into = [0u8; 4];
        assert!(is_status(
            ucp_am_recv_data_nbx(
                w,
                bogus.as_ptr().cast_mut().cast(),
                into.as_mut_ptr().cast(),
                4,
                &p
            ),
            UCS_ERR_INVALID_PARAM
        ));
        ucp_am_data_release(w, bogus.as_ptr().cast_mut().cast());
        ucp_am_data_release(std::ptr::null(), std::ptr::null_mut());
    }
}

/// Whether `fd` is readable within `t`.
fn readable(fd: i32, t: Duration) -> bool {
    rucx_ucs::event::wait_readable(fd, Some(t)).unwrap()
}

#[test]
fn the_event_descriptor_wakes_on_an_arrival_and_on_a_signal() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let pair = Pair::new();
    let w = pair.w[1];
    let mut fd = -1;
    // SAFETY: live handles; buffers outlive their operations.
    unsafe {
        assert_eq!(ucp_worker_get_efd(w, &mut fd), UCS_OK);
        let mut again = -1;
        assert_eq!(ucp_worker_get_efd(w, &mut again), UCS_OK);
        assert_eq!(fd, again, "one descriptor per worker");
        // Drain whatever the wire-up left, until armed.
        let t = Instant::now();
        while ucp_worker_arm(w) == UCS_ERR_BUSY {
            assert!(t.elapsed() < Duration::from_secs(30), "never armed");
            ucp_worker_progress(pair.w[0]);
            ucp_worker_progress(w);
        }
        assert!(
            !readable(fd, Duration::from_millis(50)),
            "armed, nothing happened"
        );
        let msg = *b"wake";
        let mut got = [0u8; 4];
        let rs = ucp_tag_send_nbx(pair.ep[0], msg.as_ptr().cast(), 4, 9, &nbx(0, 0));
        assert!(
            readable(fd, Duration::from_secs(30)),
            "an arrival wakes the descriptor"
        );
        let rr = ucp_tag_recv_nbx(w, got.as_mut_ptr().cast(), 4, 9, u64::MAX, &nbx(0, 0));
        assert_eq!(wait(&pair, rr), UCS_OK);
        assert_eq!(wait(&pair, rs), UCS_OK);
        assert_eq!(got, msg);
        // A signal from another thread makes the armed, quiet descriptor readable (nothing
        // else can: no message is on its way) and the next arm busy.
        let t = Instant::now();
        while ucp_worker_arm(w) == UCS_ERR_BUSY {
            assert!(t.elapsed() < Duration::from_secs(30), "never armed");
            ucp_worker_progress(w);
        }
        assert!(!readable(fd, Duration::from_millis(50)), "armed and quiet");
        struct Handle(*mut AbiWorker);
        // SAFETY: only ucp_worker_signal is called on it from the other thread, which may be.
        unsafe impl Send for Handle {}
        let h = Handle(w);
        let t = std::thread::spawn(move || {
            let h = h;
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: the worker outlives the thread (joined below).
            assert_eq!(ucp_worker_signal(h.0), UCS_OK);
        });
        assert!(readable(fd, Duration::from_secs(30)), "woken by the signal");
        t.join().unwrap();
        assert_eq!(ucp_worker_arm(w), UCS_ERR_BUSY, "a signal is an event");
        // ucp_worker_wait returns at once on a pending signal, and sleeps (at most the
        // worker's tick) otherwise.
        assert_eq!(ucp_worker_signal(w), UCS_OK);
        let slept = Instant::now();
        assert_eq!(ucp_worker_wait(w), UCS_OK);
        assert!(slept.elapsed() < Duration::from_secs(5));
        assert_eq!(ucp_worker_wait(w), UCS_OK);
        // Bad input.
        assert_eq!(
            ucp_worker_get_efd(std::ptr::null(), &mut fd),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_worker_get_efd(w, std::ptr::null_mut()),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(ucp_worker_arm(std::ptr::null()), UCS_ERR_INVALID_PARAM);
        assert_eq!(ucp_worker_wait(std::ptr::null()), UCS_ERR_INVALID_PARAM);
        assert_eq!(ucp_worker_signal(std::ptr::null()), UCS_ERR_INVALID_PARAM);
    }
}

/// Connection requests the server's handler got.
static REQUESTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_conn(req: *mut c_void, arg: *mut c_void) {
    assert_eq!(arg as usize, 0x11);
    REQUESTS.lock().unwrap().push(req as usize);
}

fn listener_params(addr: &libc::sockaddr_in) -> ListenerParams {
    ListenerParams {
        field_mask: UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        sockaddr: SockAddrParam {
            addr: (addr as *const libc::sockaddr_in).cast(),
            addrlen: std::mem::size_of::<libc::sockaddr_in>() as u32,
        },
        accept_handler: Handler {
            cb: None,
            arg: std::ptr::null_mut(),
        },
        conn_handler: Handler {
            cb: Some(on_conn),
            arg: 0x11 as *mut c_void,
        },
    }
}

fn sockaddr_in(port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// A client on a thread of its own: a context and worker of its own (client id 0x1D), an
/// endpoint by socket address to `port` sending that id; then it sends "hi" (tag 1) and waits
/// for its send. The status of `ucp_ep_create`, else of the send (which waits for the
/// connection: a reject ends it).
fn client(port: u16) -> std::thread::JoinHandle<Status> {
    std::thread::spawn(move || {
        let ctx = context(c"tcp");
        let mut w = std::ptr::null_mut();
        // SAFETY: a live context; all-zero params plus the client id are valid.
        unsafe {
            let mut p: WorkerParams = std::mem::zeroed();
            p.field_mask = UCP_WORKER_PARAM_FIELD_CLIENT_ID;
            p.client_id = 0x1D;
            assert_eq!(ucp_worker_create(ctx, &p, &mut w), UCS_OK);
        }
        let to = sockaddr_in(port);
        // SAFETY: live handles of this thread; `to` outlives the call.
        unsafe {
            let mut p: EpParams = std::mem::zeroed();
            p.field_mask = UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_FLAGS;
            p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER | UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID;
            p.sockaddr.addr = (&to as *const libc::sockaddr_in).cast();
            p.sockaddr.addrlen = std::mem::size_of::<libc::sockaddr_in>() as u32;
            let mut ep = std::ptr::null_mut();
            let mut st = ucp_ep_create(w, &p, &mut ep);
            if st == UCS_OK {
                let r = ucp_tag_send_nbx(ep, b"hi".as_ptr().cast(), 2, 1, &nbx(0, 0));
                if ptr_is_ptr(r) {
                    while ucp_request_check_status(r) == UCS_INPROGRESS {
                        ucp_worker_progress(w);
                    }
                    st = ucp_request_check_status(r);
                    ucp_request_free(r);
                } else {
                    assert!(!ptr_is_err(r));
                }
                // The server receives before we go: give it time to (the message is out).
                let t = Instant::now();
                while t.elapsed() < Duration::from_millis(300) {
                    ucp_worker_progress(w);
                }
                let force = nbx(UCP_OP_ATTR_FIELD_FLAGS, UCP_EP_CLOSE_FLAG_FORCE);
                assert!(ucp_ep_close_nbx(ep, &force).is_null());
            }
            ucp_worker_destroy(w);
            ucp_cleanup(ctx);
            st
        }
    })
}

#[test]
fn a_listener_hands_requests_to_its_handler_accepted_on_another_worker_or_rejected() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    REQUESTS.lock().unwrap().clear();
    let ctx = context(c"tcp");
    let (lw, dw) = (worker(ctx), worker(ctx));
    let any = sockaddr_in(0);
    // SAFETY: live handles; every pointer valid for its call.
    unsafe {
        let mut l = std::ptr::null_mut();
        assert_eq!(
            ucp_listener_create(lw, &listener_params(&any), &mut l),
            UCS_OK
        );
        let mut attr: ListenerAttr = std::mem::zeroed();
        attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        assert_eq!(ucp_listener_query(l, &mut attr), UCS_OK);
        let sin = std::ptr::read(
            (&attr.sockaddr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>(),
        );
        assert_eq!(i32::from(sin.sin_family), libc::AF_INET);
        let port = u16::from_be(sin.sin_port);
        assert_ne!(port, 0, "the port the system picked");
        // The port is taken now.
        let mut l2 = std::ptr::null_mut();
        let taken = sockaddr_in(port);
        assert_eq!(
            ucp_listener_create(lw, &listener_params(&taken), &mut l2),
            UCS_ERR_BUSY
        );

        // A client, accepted on the data worker.
        let c = client(port);
        let t = Instant::now();
        while REQUESTS.lock().unwrap().is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no connection request"
            );
            ucp_worker_progress(lw);
        }
        let req = REQUESTS.lock().unwrap()[0] as *mut AbiConnRequest;
        let mut ra: ConnRequestAttr = std::mem::zeroed();
        ra.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
        assert_eq!(ucp_conn_request_query(req, &mut ra), UCS_OK);
        let from = std::ptr::read(
            (&ra.client_address as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>(),
        );
        assert_eq!(
            u32::from_be(from.sin_addr.s_addr),
            u32::from(std::net::Ipv4Addr::LOCALHOST)
        );
        ra.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
        assert_eq!(ucp_conn_request_query(req, &mut ra), UCS_OK);
        assert_eq!(ra.client_id, 0x1D);
        ra.field_mask = 1 << 7;
        assert_eq!(ucp_conn_request_query(req, &mut ra), UCS_ERR_INVALID_PARAM);
        let mut p: EpParams = std::mem::zeroed();
        p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
        p.conn_request = req.cast();
        let mut ep = std::ptr::null_mut();
        assert_eq!(ucp_ep_create(dw, &p, &mut ep), UCS_OK);
        let mut got = [0u8; 2];
        let r = ucp_tag_recv_nbx(dw, got.as_mut_ptr().cast(), 2, 1, u64::MAX, &nbx(0, 0));
        if ptr_is_ptr(r) {
            let t = Instant::now();
            while ucp_request_check_status(r) == UCS_INPROGRESS {
                assert!(t.elapsed() < Duration::from_secs(60), "no message");
                ucp_worker_progress(dw);
            }
            assert_eq!(ucp_request_check_status(r), UCS_OK);
            ucp_request_free(r);
        }
        assert_eq!(&got, b"hi");
        assert_eq!(c.join().unwrap(), UCS_OK);
        let force = nbx(UCP_OP_ATTR_FIELD_FLAGS, UCP_EP_CLOSE_FLAG_FORCE);
        assert!(ucp_ep_close_nbx(ep, &force).is_null());

        // A second client, rejected: its send says so (its ucp_ep_create returned at once).
        let c = client(port);
        let t = Instant::now();
        while REQUESTS.lock().unwrap().len() < 2 {
            assert!(t.elapsed() < Duration::from_secs(60), "no second request");
            ucp_worker_progress(lw);
        }
        let req = REQUESTS.lock().unwrap()[1] as *mut AbiConnRequest;
        assert_eq!(ucp_listener_reject(l, req), UCS_OK);
        assert_eq!(c.join().unwrap(), UCS_ERR_REJECTED);

        // Bad input.
        assert_eq!(
            ucp_listener_reject(l, std::ptr::null_mut()),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_listener_query(std::ptr::null(), &mut attr),
            UCS_ERR_INVALID_PARAM
        );
        attr.field_mask = 1 << 3;
        assert_eq!(ucp_listener_query(l, &mut attr), UCS_ERR_INVALID_PARAM);
        let mut none = listener_params(&any);
        none.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR;
        assert_eq!(
            ucp_listener_create(lw, &none, &mut l2),
            UCS_ERR_INVALID_PARAM,
            "no handler"
        );
        let mut both = listener_params(&any);
        both.field_mask |= UCP_LISTENER_PARAM_FIELD_ACCEPT_HANDLER;
        both.accept_handler.cb = Some(on_accept);
        assert_eq!(
            ucp_listener_create(lw, &both, &mut l2),
            UCS_ERR_INVALID_PARAM,
            "two handlers"
        );
        let mut no_addr = listener_params(&any);
        no_addr.sockaddr.addr = std::ptr::null();
        assert_eq!(
            ucp_listener_create(lw, &no_addr, &mut l2),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_listener_create(lw, &listener_params(&any), std::ptr::null_mut()),
            UCS_ERR_INVALID_PARAM
        );
        // An endpoint by socket address and by worker address at once, by a port of 0.
        let mut p: EpParams = std::mem::zeroed();
        p.field_mask = UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        p.sockaddr.addr = (&any as *const libc::sockaddr_in).cast();
        p.sockaddr.addrlen = std::mem::size_of::<libc::sockaddr_in>() as u32;
        assert_eq!(ucp_ep_create(dw, &p, &mut ep), UCS_ERR_INVALID_PARAM);
        p.field_mask = UCP_EP_PARAM_FIELD_SOCK_ADDR;
        assert_eq!(ucp_ep_create(dw, &p, &mut ep), UCS_ERR_INVALID_ADDR);
        p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
        assert_eq!(
            ucp_ep_create(dw, &p, &mut ep),
            UCS_ERR_INVALID_PARAM,
            "NULL request"
        );
        p.field_mask = UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR | UCP_EP_PARAM_FIELD_CONN_REQUEST;
        assert_eq!(
            ucp_ep_create(dw, &p, &mut ep),
            UCS_ERR_INVALID_PARAM,
            "a local address for the server's side"
        );

        ucp_listener_destroy(l);
        ucp_listener_destroy(std::ptr::null_mut());
        ucp_worker_destroy(lw);
        ucp_worker_destroy(dw);
        ucp_cleanup(ctx);
    }
}

unsafe extern "C" fn on_accept(_: *mut c_void, _: *mut c_void) {}
