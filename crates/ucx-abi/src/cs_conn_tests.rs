//! Client/server connection through the C calls with ONE thread progressing both the client
//! and the server (`ucp_ep_create` by socket address returns at once, as UCX's does):
//! operations posted while connecting go out in order, the client id reaches the server, a
//! reject, no server, a close while connecting, and hostile peers of the listener that must not
//! stall its progress.

use std::ffi::c_void;
use std::io::Write;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::cs_tests::{context, worker};
use crate::endpoint::{AbiEp, ucp_ep_close_nbx, ucp_ep_create, ucp_ep_flush_nbx};
use crate::listener::*;
use crate::status::ptr_is_ptr;
use crate::stream::*;
use crate::tag::*;
use crate::types::*;
use crate::worker::*;

/// One of these tests at a time (they share the records below).
static ONE: Mutex<()> = Mutex::new(());
static REQUESTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// (endpoint, status) of every error handler call.
static FAILED: Mutex<Vec<(usize, Status)>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_conn(req: *mut c_void, _: *mut c_void) {
    REQUESTS.lock().unwrap().push(req as usize);
}

unsafe extern "C" fn on_error(_: *mut c_void, ep: *mut c_void, status: Status) {
    FAILED.lock().unwrap().push((ep as usize, status));
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

fn nbx0() -> RequestParam {
    // SAFETY: all-zero is a valid RequestParam.
    unsafe { std::mem::zeroed() }
}

/// A listener of `w` on a port the system picks, with `on_conn`: it and its port.
///
/// # Safety
/// `w` live.
unsafe fn listen(w: *mut AbiWorker) -> (*mut AbiListener, u16) {
    let any = sockaddr_in(0);
    let p = ListenerParams {
        field_mask: UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        sockaddr: SockAddrParam {
            addr: (&any as *const libc::sockaddr_in).cast(),
            addrlen: std::mem::size_of::<libc::sockaddr_in>() as u32,
        },
        accept_handler: Handler {
            cb: None,
            arg: std::ptr::null_mut(),
        },
        conn_handler: Handler {
            cb: Some(on_conn),
            arg: std::ptr::null_mut(),
        },
    };
    let mut l = std::ptr::null_mut();
    // SAFETY: the caller's promise; `p` and `any` valid for the call.
    unsafe {
        assert_eq!(ucp_listener_create(w, &p, &mut l), UCS_OK);
        let mut attr: ListenerAttr = std::mem::zeroed();
        attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        assert_eq!(ucp_listener_query(l, &mut attr), UCS_OK);
        let sin = std::ptr::read(
            (&attr.sockaddr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>(),
        );
        (l, u16::from_be(sin.sin_port))
    }
}

/// A client endpoint of `w` to `port` with the error handler, created in well under a second
/// (it returns at once), sending the worker's client id and bound to 127.0.0.1 (port 0).
///
/// # Safety
/// `w` live.
unsafe fn client_ep(w: *mut AbiWorker, port: u16) -> *mut AbiEp {
    let to = sockaddr_in(port);
    let local = sockaddr_in(0);
    // SAFETY: all-zero is valid; the addresses outlive the call.
    unsafe {
        let mut p: EpParams = std::mem::zeroed();
        p.field_mask = UCP_EP_PARAM_FIELD_SOCK_ADDR
            | UCP_EP_PARAM_FIELD_FLAGS
            | UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR
            | UCP_EP_PARAM_FIELD_ERR_HANDLER
            | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        p.err_handler.cb = Some(on_error);
        p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER | UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID;
        p.sockaddr.addr = (&to as *const libc::sockaddr_in).cast();
        p.sockaddr.addrlen = std::mem::size_of::<libc::sockaddr_in>() as u32;
        p.local_sockaddr.addr = (&local as *const libc::sockaddr_in).cast();
        p.local_sockaddr.addrlen = std::mem::size_of::<libc::sockaddr_in>() as u32;
        let mut ep = std::ptr::null_mut();
        let t = Instant::now();
        assert_eq!(ucp_ep_create(w, &p, &mut ep), UCS_OK);
        assert!(t.elapsed() < Duration::from_secs(1), "ucp_ep_create waited");
        ep
    }
}

fn worker_with_id(ctx: *mut crate::context::AbiContext, id: u64) -> *mut AbiWorker {
    let mut w = std::ptr::null_mut();
    // SAFETY: a live context; all-zero params plus the client id are valid.
    unsafe {
        let mut p: WorkerParams = std::mem::zeroed();
        p.field_mask = UCP_WORKER_PARAM_FIELD_CLIENT_ID;
        p.client_id = id;
        assert_eq!(ucp_worker_create(ctx, &p, &mut w), UCS_OK);
    }
    w
}

/// Progress every worker of `ws` (this thread) until `done`, failing after 30 s.
#[track_caller]
fn drive(ws: &[*mut AbiWorker], mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(30), "stuck");
        for &w in ws {
            // SAFETY: live workers.
            unsafe { ucp_worker_progress(w) };
        }
    }
}

/// The status of request `r` once it ended (progressing `ws`), freed; NULL is `UCS_OK`.
#[track_caller]
fn status(ws: &[*mut AbiWorker], r: *mut c_void) -> Status {
    if r.is_null() {
        return UCS_OK;
    }
    assert!(ptr_is_ptr(r), "an error status: {}", r as isize);
    // SAFETY: a live request until freed here.
    unsafe {
        drive(ws, || ucp_request_check_status(r) != UCS_INPROGRESS);
        let s = ucp_request_check_status(r);
        ucp_request_free(r);
        s
    }
}

#[test]
fn one_thread_connects_a_client_and_server_and_what_was_posted_meanwhile_goes_in_order() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    REQUESTS.lock().unwrap().clear();
    FAILED.lock().unwrap().clear();
    let ctx = context(c"posix");
    let (sw, cw) = (worker(ctx), worker_with_id(ctx, 0x5EED));
    let ws = [sw, cw];
    // SAFETY: live handles; every buffer outlives its operation (waited for below).
    unsafe {
        let (l, port) = listen(sw);
        let ep = client_ep(cw, port);
        // Posted while connecting: requests, in order.
        let p = nbx0();
        let s1 = ucp_tag_send_nbx(ep, b"one".as_ptr().cast(), 3, 1, &p);
        let s2 = ucp_tag_send_nbx(ep, b"two!".as_ptr().cast(), 4, 2, &p);
        let s3 = ucp_stream_send_nbx(ep, b"stream".as_ptr().cast(), 6, &p);
        let f = ucp_ep_flush_nbx(ep, &p);
        // The flushes of every form return a request, which the same thread's progress of
        // both workers completes (they used to wait in place for the connection's timeout).
        let wf = crate::worker::ucp_worker_flush_nbx(cw, &p);
        let ef = crate::endpoint::ucp_ep_flush_nb(ep, 0, None);
        let wf2 = crate::worker::ucp_worker_flush_nb(cw, 0, None);
        for r in [s1, s2, s3, f, wf, ef, wf2] {
            assert!(ptr_is_ptr(r), "not done in place while connecting");
        }
        drive(&ws, || !REQUESTS.lock().unwrap().is_empty());
        let req = REQUESTS.lock().unwrap()[0] as *mut AbiConnRequest;
        let mut ra: ConnRequestAttr = std::mem::zeroed();
        ra.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
        assert_eq!(ucp_conn_request_query(req, &mut ra), UCS_OK);
        assert_eq!(ra.client_id, 0x5EED);
        let mut sp: EpParams = std::mem::zeroed();
        sp.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
        sp.conn_request = req.cast();
        let mut sep = std::ptr::null_mut();
        assert_eq!(ucp_ep_create(sw, &sp, &mut sep), UCS_OK);
        // Any tag: the receives take the messages in the order they were sent.
        let (mut a, mut b, mut s) = ([0u8; 8], [0u8; 8], [0u8; 6]);
        let r1 = ucp_tag_recv_nbx(sw, a.as_mut_ptr().cast(), 8, 0, 0, &p);
        let r2 = ucp_tag_recv_nbx(sw, b.as_mut_ptr().cast(), 8, 0, 0, &p);
        let mut wait_all = nbx0();
        wait_all.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        wait_all.flags = UCP_STREAM_RECV_FLAG_WAITALL;
        let mut len = 0;
        let r3 = ucp_stream_recv_nbx(sep, s.as_mut_ptr().cast(), 6, &mut len, &wait_all);
        for r in [s1, s2, s3, f, wf, ef, wf2, r1, r2, r3] {
            assert_eq!(status(&ws, r), UCS_OK);
        }
        assert_eq!(
            (&a[..3], &b[..4], &s),
            (&b"one"[..], &b"two!"[..], b"stream")
        );
        // Connected now: a flush is done in place.
        assert!(ucp_ep_flush_nbx(ep, &p).is_null());
        assert!(FAILED.lock().unwrap().is_empty());
        let force = nbx_force();
        assert!(ucp_ep_close_nbx(ep, &force).is_null());
        assert!(ucp_ep_close_nbx(sep, &force).is_null());
        ucp_listener_destroy(l);
        ucp_worker_destroy(cw);
        ucp_worker_destroy(sw);
        crate::context::ucp_cleanup(ctx);
    }
}

fn nbx_force() -> RequestParam {
    let mut p = nbx0();
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    p
}

#[test]
fn a_reject_no_server_and_a_close_while_connecting_end_promptly_with_ucx_statuses() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    REQUESTS.lock().unwrap().clear();
    FAILED.lock().unwrap().clear();
    let ctx = context(c"posix");
    let (sw, cw) = (worker(ctx), worker(ctx));
    let ws = [sw, cw];
    let p = nbx0();
    // SAFETY: live handles; every buffer outlives its operation.
    unsafe {
        let (l, port) = listen(sw);
        // Rejected: the error handler and the operation waiting say UCS_ERR_REJECTED.
        let ep = client_ep(cw, port);
        let s = ucp_tag_send_nbx(ep, b"x".as_ptr().cast(), 1, 1, &p);
        drive(&ws, || !REQUESTS.lock().unwrap().is_empty());
        let req = REQUESTS.lock().unwrap()[0] as *mut AbiConnRequest;
        assert_eq!(ucp_listener_reject(l, req), UCS_OK);
        assert_eq!(status(&ws, s), UCS_ERR_REJECTED);
        drive(&ws, || !FAILED.lock().unwrap().is_empty());
        assert_eq!(FAILED.lock().unwrap()[0], (ep as usize, UCS_ERR_REJECTED));
        assert!(ucp_ep_close_nbx(ep, &nbx_force()).is_null());

        // Nobody listens: UCS_ERR_NOT_CONNECTED, as UCX's tcp connection manager says.
        let dead = {
            let t = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            t.local_addr().unwrap().port()
        };
        FAILED.lock().unwrap().clear();
        let ep = client_ep(cw, dead);
        let s = ucp_stream_send_nbx(ep, b"x".as_ptr().cast(), 1, &p);
        assert_eq!(status(&ws, s), UCS_ERR_NOT_CONNECTED);
        drive(&ws, || !FAILED.lock().unwrap().is_empty());
        assert_eq!(
            FAILED.lock().unwrap()[0],
            (ep as usize, UCS_ERR_NOT_CONNECTED)
        );
        assert!(ucp_ep_close_nbx(ep, &nbx_force()).is_null());

        // Closed while connecting (a flushing close): at once, the waiting send canceled, and
        // the handler not called.
        FAILED.lock().unwrap().clear();
        let ep = client_ep(cw, port);
        let s = ucp_tag_send_nbx(ep, b"x".as_ptr().cast(), 1, 1, &p);
        let t = Instant::now();
        assert!(ucp_ep_close_nbx(ep, &p).is_null());
        assert!(t.elapsed() < Duration::from_secs(1), "the close waited");
        assert_eq!(status(&[cw], s), UCS_ERR_CANCELED);
        // The server sees a request whose client is gone: accepting it fails or makes an
        // endpoint that fails; either way progress goes on.
        for _ in 0..1000 {
            ucp_worker_progress(sw);
            ucp_worker_progress(cw);
        }
        assert!(FAILED.lock().unwrap().is_empty());
        for &r in REQUESTS.lock().unwrap()[1..].iter() {
            assert_eq!(ucp_listener_reject(l, r as *mut AbiConnRequest), UCS_OK);
        }
        ucp_listener_destroy(l);
        ucp_worker_destroy(cw);
        ucp_worker_destroy(sw);
        crate::context::ucp_cleanup(ctx);
    }
}

#[test]
fn hostile_peers_of_a_listener_never_stall_its_progress_or_its_real_clients() {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    REQUESTS.lock().unwrap().clear();
    FAILED.lock().unwrap().clear();
    let ctx = context(c"posix");
    let (sw, cw) = (worker(ctx), worker(ctx));
    let ws = [sw, cw];
    // SAFETY: live handles; every buffer outlives its operation.
    unsafe {
        let (l, port) = listen(sw);
        // Garbage, a handshake cut short and left silent, one closed mid-handshake, a flood.
        let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
        half.write_all(&rucx_ucp_magic()[..6]).unwrap();
        let mut gone = TcpStream::connect(("127.0.0.1", port)).unwrap();
        gone.write_all(&rucx_ucp_magic()).unwrap();
        drop(gone);
        let flood: Vec<TcpStream> = (0..50)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        // Every progress call of the server stays short meanwhile.
        let mut slowest = Duration::ZERO;
        for _ in 0..200 {
            let t = Instant::now();
            ucp_worker_progress(sw);
            slowest = slowest.max(t.elapsed());
        }
        assert!(
            slowest < Duration::from_millis(500),
            "a progress call took {slowest:?}"
        );
        // A real client, progressed by the same thread, is served.
        let ep = client_ep(cw, port);
        let s = ucp_tag_send_nbx(ep, b"real".as_ptr().cast(), 4, 9, &nbx0());
        drive(&ws, || !REQUESTS.lock().unwrap().is_empty());
        assert_eq!(
            REQUESTS.lock().unwrap().len(),
            1,
            "only the real client asked"
        );
        let req = REQUESTS.lock().unwrap()[0] as *mut AbiConnRequest;
        let mut sp: EpParams = std::mem::zeroed();
        sp.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
        sp.conn_request = req.cast();
        let mut sep = std::ptr::null_mut();
        assert_eq!(ucp_ep_create(sw, &sp, &mut sep), UCS_OK);
        let mut got = [0u8; 4];
        let r = ucp_tag_recv_nbx(sw, got.as_mut_ptr().cast(), 4, 9, u64::MAX, &nbx0());
        assert_eq!(status(&ws, s), UCS_OK);
        assert_eq!(status(&ws, r), UCS_OK);
        assert_eq!(&got, b"real");
        drop((garbage, half, flood));
        let force = nbx_force();
        assert!(ucp_ep_close_nbx(ep, &force).is_null());
        assert!(ucp_ep_close_nbx(sep, &force).is_null());
        ucp_listener_destroy(l);
        ucp_worker_destroy(cw);
        ucp_worker_destroy(sw);
        crate::context::ucp_cleanup(ctx);
    }
}

/// The magic that starts rucx's connection-manager handshake.
fn rucx_ucp_magic() -> [u8; 8] {
    *b"RUCXCM02"
}
