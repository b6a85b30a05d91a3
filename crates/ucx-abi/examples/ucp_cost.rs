//! CPU per small message through a libucp, any libucp: the system's UCX or rucx's, loaded at
//! run time (`dlopen`), driven the way Open MPI's blocking calls drive it, both workers in one
//! thread, and measured in this thread's CPU time, which other jobs on a shared machine barely
//! disturb (unlike ping-pong latency between two processes, which the scheduler sets there).
//!
//! ```text
//! cargo run --release -p rucx-ucx-abi --example ucp_cost -- LIB [MESSAGES]
//! ```
//! `LIB`: a path to a `libucp.so.0`, or `system` for the one the loader finds (the system's
//! UCX, with `LD_LIBRARY_PATH` unset). Transports come from the environment: `UCX_TLS` for UCX
//! (e.g. `posix,self`), `RUCX_TLS` for rucx (e.g. `posix`). `crates/ucx-abi/cost-compare.sh`
//! runs both, alternating.
//!
//! Figures printed, in nanoseconds of CPU: one 8-byte message the way `MPI_Recv`/`MPI_Send`
//! move it (`ucp_tag_recv_nbr` into request memory of the caller, `ucp_tag_send_nbr`, progress
//! until `ucp_tag_recv_request_test` says done); per message in windows of 64 (64
//! `ucp_tag_recv_nbr`, 64 `ucp_tag_send_nb`, progress until all ended: `MPI_Irecv`/`MPI_Isend`/
//! `MPI_Waitall`); one idle `ucp_worker_progress`.

use std::ffi::{CString, c_int, c_uint, c_void};
use std::time::Duration;

use ucp::types::*;

type Ptr = *mut c_void;

/// The functions used, resolved from the library.
struct Ucp {
    init_version: unsafe extern "C" fn(c_uint, c_uint, *const UcpParams, Ptr, *mut Ptr) -> Status,
    context_query: unsafe extern "C" fn(Ptr, *mut ContextAttr) -> Status,
    worker_create: unsafe extern "C" fn(Ptr, *const WorkerParams, *mut Ptr) -> Status,
    worker_get_address: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> Status,
    worker_release_address: unsafe extern "C" fn(Ptr, Ptr),
    ep_create: unsafe extern "C" fn(Ptr, *const EpParams, *mut Ptr) -> Status,
    tag_recv_nbr: unsafe extern "C" fn(Ptr, Ptr, usize, u64, u64, u64, Ptr) -> Status,
    tag_send_nbr: unsafe extern "C" fn(Ptr, *const c_void, usize, u64, u64, Ptr) -> Status,
    tag_send_nb: unsafe extern "C" fn(Ptr, *const c_void, usize, u64, u64, SendCb) -> Ptr,
    worker_progress: unsafe extern "C" fn(Ptr) -> c_uint,
    recv_request_test: unsafe extern "C" fn(Ptr, *mut TagRecvInfo) -> Status,
    request_check_status: unsafe extern "C" fn(Ptr) -> Status,
    request_free: unsafe extern "C" fn(Ptr),
}

/// A function pointer of type `F` from a symbol's address.
///
/// # Safety
/// `p` is the address of a function whose C signature `F` spells.
unsafe fn fn_ptr<F: Copy>(p: Ptr) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<Ptr>());
    // SAFETY: the caller's promise; a function pointer has a data pointer's size here.
    unsafe { std::mem::transmute_copy(&p) }
}

fn load(lib: &str) -> Ucp {
    let name = if lib == "system" { "libucp.so.0" } else { lib };
    let c = CString::new(name).expect("a path without NUL");
    // SAFETY: a plain dlopen of a shared library by name.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "cannot load {name}");
    let sym = |s: &str| -> *mut c_void {
        let c = CString::new(s).expect("a name without NUL");
        // SAFETY: a symbol look-up in a library just loaded.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        assert!(!p.is_null(), "{name} has no {s}");
        p
    };
    // SAFETY: each symbol is the libucp function of that name, whose C signature the field's
    // type spells (UCX's public API).
    unsafe {
        Ucp {
            init_version: fn_ptr(sym("ucp_init_version")),
            context_query: fn_ptr(sym("ucp_context_query")),
            worker_create: fn_ptr(sym("ucp_worker_create")),
            worker_get_address: fn_ptr(sym("ucp_worker_get_address")),
            worker_release_address: fn_ptr(sym("ucp_worker_release_address")),
            ep_create: fn_ptr(sym("ucp_ep_create")),
            tag_recv_nbr: fn_ptr(sym("ucp_tag_recv_nbr")),
            tag_send_nbr: fn_ptr(sym("ucp_tag_send_nbr")),
            tag_send_nb: fn_ptr(sym("ucp_tag_send_nb")),
            worker_progress: fn_ptr(sym("ucp_worker_progress")),
            recv_request_test: fn_ptr(sym("ucp_tag_recv_request_test")),
            request_check_status: fn_ptr(sym("ucp_request_check_status")),
            request_free: fn_ptr(sym("ucp_request_free")),
        }
    }
}

/// CPU time of this thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer for clock_gettime.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

const CONTIG: u64 = 1 << UCP_DATATYPE_SHIFT;
const WIN: usize = 64;

/// Request memory of the caller: `size` bytes before the pointer handed to the library (as
/// Open MPI's `alloca(request_size) + request_size`), 16-aligned.
struct ReqMem {
    mem: Vec<u128>,
}

impl ReqMem {
    fn new(size: usize) -> ReqMem {
        ReqMem {
            mem: vec![0; size.div_ceil(16) + 1],
        }
    }

    fn ptr(&mut self) -> Ptr {
        let n = self.mem.len() - 1;
        // SAFETY: one past the caller area, inside the vector.
        unsafe { self.mem.as_mut_ptr().add(n) }.cast()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let lib = args.get(1).map_or("system", String::as_str);
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let u = load(lib);
    let params = UcpParams {
        field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE,
        features: UCP_FEATURE_TAG,
        request_size: 16,
        request_init: None,
        request_cleanup: None,
        tag_sender_mask: 0,
        mt_workers_shared: 0 as c_int,
        estimated_num_eps: 0,
        estimated_num_ppn: 0,
        name: std::ptr::null(),
    };
    let mut ctx: Ptr = std::ptr::null_mut();
    let mut w: [Ptr; 2] = [std::ptr::null_mut(); 2];
    let mut ep: [Ptr; 2] = [std::ptr::null_mut(); 2];
    // SAFETY: UCX's API used as documented: every pointer handed in is valid for the call.
    let req_size = unsafe {
        assert_eq!(
            (u.init_version)(1, 12, &params, std::ptr::null_mut(), &mut ctx),
            UCS_OK,
            "ucp_init"
        );
        let mut attr: ContextAttr = std::mem::zeroed();
        attr.field_mask = UCP_ATTR_FIELD_REQUEST_SIZE;
        assert_eq!((u.context_query)(ctx, &mut attr), UCS_OK);
        let wp: WorkerParams = std::mem::zeroed();
        for wi in &mut w {
            assert_eq!((u.worker_create)(ctx, &wp, wi), UCS_OK, "worker");
        }
        for i in 0..2 {
            let mut addr = std::ptr::null_mut();
            let mut len = 0;
            assert_eq!(
                (u.worker_get_address)(w[1 - i], &mut addr, &mut len),
                UCS_OK
            );
            let mut p: EpParams = std::mem::zeroed();
            p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
            p.address = addr;
            assert_eq!((u.ep_create)(w[i], &p, &mut ep[i]), UCS_OK, "endpoint");
            (u.worker_release_address)(w[1 - i], addr);
        }
        attr.request_size
    };
    let mut sbuf = [7u8; 8];
    let mut rbuf = [0u8; 8];
    let mut rreq = ReqMem::new(req_size + 16);
    let mut sreq = ReqMem::new(req_size + 16);
    let (rr, sr) = (rreq.ptr(), sreq.ptr());
    let mut one = |i: u64| {
        // SAFETY: live handles; buffers and request memory outlive each round, which ends
        // before the next starts.
        unsafe {
            let st = (u.tag_recv_nbr)(w[1], rbuf.as_mut_ptr().cast(), 8, CONTIG, i, u64::MAX, rr);
            assert_eq!(st, UCS_OK, "receive posted");
            let st = (u.tag_send_nbr)(ep[0], sbuf.as_mut_ptr().cast(), 8, CONTIG, i, sr);
            assert!(st == UCS_OK || st == UCS_INPROGRESS, "send: {st}");
            let mut info = TagRecvInfo::default();
            let mut spins = 0u64;
            while (u.recv_request_test)(rr, &mut info) == UCS_INPROGRESS {
                (u.worker_progress)(w[1]);
                (u.worker_progress)(w[0]);
                spins += 1;
                assert!(spins < 100_000_000, "message {i} never arrived");
            }
            assert_eq!(info.length, 8);
            while st == UCS_INPROGRESS && (u.request_check_status)(sr) == UCS_INPROGRESS {
                (u.worker_progress)(w[0]);
            }
        }
    };
    for i in 0..n / 10 {
        one(i);
    }
    let t = thread_cpu();
    for i in 0..n {
        one(i);
    }
    let per_msg = (thread_cpu() - t).as_nanos() as f64 / n as f64;
    let mut rreqs: Vec<ReqMem> = (0..WIN).map(|_| ReqMem::new(req_size + 16)).collect();
    let mut window = |round: u64| {
        let reqs: Vec<Ptr> = rreqs.iter_mut().map(ReqMem::ptr).collect();
        // SAFETY: live handles; buffers and request memory outlive the round, which ends
        // (every receive completed, every send ended) before the next.
        unsafe {
            for (k, &r) in reqs.iter().enumerate() {
                let tag = round * WIN as u64 + k as u64;
                let st = (u.tag_recv_nbr)(w[1], rbuf.as_mut_ptr().cast(), 8, CONTIG, tag, !0, r);
                assert_eq!(st, UCS_OK);
            }
            for k in 0..WIN {
                let tag = round * WIN as u64 + k as u64;
                let p = (u.tag_send_nb)(ep[0], sbuf.as_ptr().cast(), 8, CONTIG, tag, None);
                assert!((p as usize) < (-100isize) as usize, "send refused");
                if !p.is_null() {
                    while (u.request_check_status)(p) == UCS_INPROGRESS {
                        (u.worker_progress)(w[0]);
                    }
                    (u.request_free)(p);
                }
            }
            let mut left = WIN;
            let mut spins = 0u64;
            while left > 0 {
                (u.worker_progress)(w[1]);
                (u.worker_progress)(w[0]);
                left = reqs
                    .iter()
                    .filter(|&&r| (u.request_check_status)(r) == UCS_INPROGRESS)
                    .count();
                spins += 1;
                assert!(spins < 100_000_000, "round {round} never ended");
            }
        }
    };
    let rounds = (n / WIN as u64).max(1);
    for r in 0..rounds / 10 {
        window(r);
    }
    let t = thread_cpu();
    for r in 0..rounds {
        window(rounds + r);
    }
    let per_win = (thread_cpu() - t).as_nanos() as f64 / (rounds * WIN as u64) as f64;
    let calls = 2_000_000u64;
    let t = thread_cpu();
    for _ in 0..calls {
        // SAFETY: a live worker.
        unsafe { (u.worker_progress)(w[0]) };
    }
    let per_progress = (thread_cpu() - t).as_nanos() as f64 / calls as f64;
    println!(
        "{lib}: 8 B message {per_msg:.0} ns, in windows of {WIN} {per_win:.0} ns, idle progress {per_progress:.1} ns (CPU)"
    );
    // Exit without tearing down: the figures are printed, and teardown is not measured.
    std::process::exit(0);
}
