//! Client/server connection establishment over rucx's connection manager
//! ([`rucx_ucp::Listener`]: a TCP socket on which the two sides exchange worker addresses):
//! `ucp_listener_create`, `_destroy`, `_query`, `_reject`, `ucp_conn_request_query`, and
//! `ucp_ep_create` by socket address (`UCP_EP_PARAM_FIELD_SOCK_ADDR`, the client) or by
//! connection request (`UCP_EP_PARAM_FIELD_CONN_REQUEST`, the server, on any worker).
//!
//! A listener is looked at by its worker's `ucp_worker_progress`: a peer whose address arrived
//! becomes a connection request handed to the listener's `conn_handler` (the application then
//! creates the endpoint on a worker of its choice, or rejects it), or, with an
//! `accept_handler`, an endpoint on the listener's worker handed to it.
//!
//! As in UCX, the client's `ucp_ep_create` returns `UCS_OK` at once and the connection is made
//! by the worker's progress ([`rucx_ucp::Worker::connect_sockaddr_nb`]): one thread may
//! progress a client and its server. Sends, stream and active-message sends and flushes posted
//! on the endpoint meanwhile wait and go out in order once it is connected. A connection that
//! fails fails the endpoint: its error handler is called, and its waiting operations end, with
//! `UCS_ERR_REJECTED` (the server rejected it), `UCS_ERR_NOT_CONNECTED` (refused: nobody
//! listens there), `UCS_ERR_UNREACHABLE` (no route), `UCS_ERR_CONNECTION_RESET` (the server
//! closed the connection mid-handshake) or `UCS_ERR_ENDPOINT_TIMEOUT` (no answer within
//! [`CONNECT_TIMEOUT`]), as UCX's tcp connection manager reports them. The worker's client id
//! (`UCP_WORKER_PARAM_FIELD_CLIENT_ID`) goes to the server with
//! `UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID` (`ucp_conn_request_query` reports it), and
//! `UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR` binds the client's socket.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use rucx_ucp::{ConnRequest, ConnectOpts, EpId, Listener};

use crate::endpoint::AbiEp;
use crate::status::status_of;
use crate::types::*;
use crate::worker::AbiWorker;

/// How long a client's connection waits for its server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// What a `ucp_listener_h` points to.
#[derive(Debug)]
pub struct AbiListener {
    worker: *const AbiWorker,
    l: Listener,
    conn: Handler<ConnCb>,
    accept: Handler<AcceptCb>,
}

/// What a `ucp_conn_request_h` points to: a peer waiting for its answer.
#[derive(Debug)]
pub struct AbiConnRequest {
    req: ConnRequest,
}

/// The listeners of one worker, looked at by its progress.
#[derive(Debug, Default)]
pub struct Listeners {
    open: std::cell::RefCell<Vec<*mut AbiListener>>,
    /// `open` is not empty (one load on every progress call, no borrow).
    any: std::cell::Cell<bool>,
    /// The worker's client id (`UCP_WORKER_PARAM_FIELD_CLIENT_ID`), sent by endpoints created
    /// with `UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID`.
    client_id: std::cell::Cell<u64>,
}

impl Listeners {
    #[inline(always)]
    pub fn any(&self) -> bool {
        self.any.get()
    }

    pub fn set_client_id(&self, id: u64) {
        self.client_id.set(id);
    }

    fn add(&self, l: *mut AbiListener) {
        self.open.borrow_mut().push(l);
        self.any.set(true);
    }

    fn remove(&self, l: *mut AbiListener) {
        let mut open = self.open.borrow_mut();
        open.retain(|&p| p != l);
        self.any.set(!open.is_empty());
    }

    pub fn fds(&self) -> Vec<RawFd> {
        self.open
            .borrow()
            .iter()
            // SAFETY: a listener is in the list while it is live (removed by its destroy).
            .map(|&l| unsafe { (*l).l.as_raw_fd() })
            .collect()
    }

    fn is_open(&self, l: *mut AbiListener) -> bool {
        self.open.borrow().contains(&l)
    }

    /// Hand the connection requests that are ready to their handlers; how many. A handler may
    /// destroy listeners, create endpoints or reject: nothing is borrowed during its call.
    pub fn progress(&self, w: &AbiWorker) -> usize {
        let mut n = 0;
        let list = self.open.borrow().clone();
        for lp in list {
            // Each listener a bounded number of times per call: a flood of peers does not
            // hold up the caller.
            for _ in 0..16 {
                if !self.is_open(lp) {
                    break;
                }
                // SAFETY: in the list, hence live.
                let l = unsafe { &*lp };
                match l.l.next_request() {
                    Ok(None) => break,
                    Ok(Some(req)) => {
                        n += 1;
                        hand_over(w, l, req);
                    }
                    Err(e) => {
                        // One peer's failure; the listener goes on.
                        tracing::warn!("rucx libucp: listener: {e}");
                    }
                }
            }
        }
        n
    }
}

/// A connection request to its listener's handler.
fn hand_over(w: &AbiWorker, l: &AbiListener, req: ConnRequest) {
    if let Some(cb) = l.conn.cb {
        let r = Box::into_raw(Box::new(AbiConnRequest { req }));
        // SAFETY: the caller's handler, with the request it owns from now on (answered by
        // `ucp_ep_create` or `ucp_listener_reject`).
        unsafe { cb(r.cast(), l.conn.arg) };
        return;
    }
    if let Some(cb) = l.accept.cb {
        match req.accept(&w.worker) {
            Ok(id) => {
                let ep = Box::into_raw(Box::new(AbiEp {
                    worker: l.worker,
                    id,
                }));
                // SAFETY: the caller's handler, with the endpoint it owns from now on.
                unsafe { cb(ep.cast(), l.accept.arg) };
            }
            Err(e) => tracing::warn!("rucx libucp: listener: accepting a client: {e}"),
        }
    }
}

/// A C socket address as Rust's (IPv4 and IPv6).
///
/// # Safety
/// `sa.addr` NULL or `sa.addrlen` readable bytes.
pub unsafe fn socket_addr(sa: &SockAddrParam) -> Result<SocketAddr, Status> {
    if sa.addr.is_null() {
        return Err(UCS_ERR_INVALID_PARAM);
    }
    let len = sa.addrlen as usize;
    let family = if len >= std::mem::size_of::<libc::sa_family_t>() {
        // SAFETY: at least the family field's bytes are readable (checked above).
        unsafe { std::ptr::read_unaligned(sa.addr.cast::<libc::sa_family_t>()) }
    } else {
        return Err(UCS_ERR_INVALID_PARAM);
    };
    match c_int_of(family) {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: as long as a sockaddr_in (checked); unaligned read of plain data.
            let a = unsafe { std::ptr::read_unaligned(sa.addr.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for a sockaddr_in6.
            let a = unsafe { std::ptr::read_unaligned(sa.addr.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        libc::AF_INET | libc::AF_INET6 => Err(UCS_ERR_INVALID_PARAM),
        _ => Err(UCS_ERR_UNSUPPORTED),
    }
}

fn c_int_of(f: libc::sa_family_t) -> libc::c_int {
    libc::c_int::from(f)
}

/// Write `a` as a C `sockaddr_storage`.
fn write_storage(a: SocketAddr, out: &mut libc::sockaddr_storage) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    *out = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v4) => {
            let s = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_storage has room and alignment for any sockaddr.
            unsafe { std::ptr::write((out as *mut libc::sockaddr_storage).cast(), s) };
        }
        SocketAddr::V6(v6) => {
            let s = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((out as *mut libc::sockaddr_storage).cast(), s) };
        }
    }
}

/// Connect `w` for `ucp_ep_create` by socket address or connection request (checked by the
/// caller to name one of them): the rucx endpoint, or the status to return.
///
/// # Safety
/// `p` valid; its socket address readable, its connection request one this library handed
/// out and not answered yet.
pub unsafe fn connect(w: &AbiWorker, p: &EpParams) -> Result<EpId, Status> {
    let m = p.field_mask;
    let by_addr = m & UCP_EP_PARAM_FIELD_SOCK_ADDR != 0;
    let by_req = m & UCP_EP_PARAM_FIELD_CONN_REQUEST != 0;
    if by_addr == by_req || m & UCP_EP_PARAM_FIELD_REMOTE_ADDRESS != 0 {
        // Exactly one way to name the peer.
        return Err(UCS_ERR_INVALID_PARAM);
    }
    if m & UCP_EP_PARAM_FIELD_FLAGS != 0 && p.flags & !UCP_EP_PARAMS_FLAGS_KNOWN != 0 {
        return Err(UCS_ERR_INVALID_PARAM);
    }
    if by_req && m & UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR != 0 {
        // The server's side of a connection is the listener's socket.
        return Err(UCS_ERR_INVALID_PARAM);
    }
    let res = if by_req {
        if p.conn_request.is_null() {
            return Err(UCS_ERR_INVALID_PARAM);
        }
        // SAFETY: made by `Box::into_raw` in `hand_over`, answered once (the caller's promise).
        let r = unsafe { Box::from_raw(p.conn_request.cast::<AbiConnRequest>()) };
        r.req.accept(&w.worker)
    } else {
        let sa = SockAddrParam {
            addr: p.sockaddr.addr.cast(),
            addrlen: p.sockaddr.addrlen,
        };
        // SAFETY: the caller's promise.
        let to = unsafe { socket_addr(&sa) }?;
        if to.port() == 0 || to.ip().is_unspecified() {
            return Err(UCS_ERR_INVALID_ADDR);
        }
        let local = if m & UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR != 0 {
            let la = SockAddrParam {
                addr: p.local_sockaddr.addr.cast(),
                addrlen: p.local_sockaddr.addrlen,
            };
            // SAFETY: the caller's promise.
            Some(unsafe { socket_addr(&la) }?)
        } else {
            None
        };
        let send_id =
            m & UCP_EP_PARAM_FIELD_FLAGS != 0 && p.flags & UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID != 0;
        let opts = ConnectOpts {
            timeout: CONNECT_TIMEOUT,
            client_id: if send_id {
                w.extra.listeners.client_id.get()
            } else {
                0
            },
            local,
        };
        // Returns at once: progress connects it.
        w.worker.connect_sockaddr_nb(to, &opts)
    };
    res.map_err(|e| {
        eprintln!("rucx libucp: ucp_ep_create: {e}");
        status_of(&e)
    })
}

/// `ucs_status_t ucp_listener_create(ucp_worker_h worker, const ucp_listener_params_t *params,
/// ucp_listener_h *listener_p)`: listen on `params->sockaddr` (port 0: one the system picks,
/// see `ucp_listener_query`), with a connection handler or an accept handler (one of them).
///
/// # Safety
/// `worker` NULL or live; `params` NULL or valid, its socket address readable; `listener_p`
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_listener_create(
    worker: *const AbiWorker,
    params: *const ListenerParams,
    listener_p: *mut *mut AbiListener,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(w), Some(p)) = (unsafe { worker.as_ref() }, unsafe { params.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    let m = p.field_mask;
    if listener_p.is_null()
        || m & !UCP_LISTENER_PARAM_FIELDS_KNOWN != 0
        || m & UCP_LISTENER_PARAM_FIELD_SOCK_ADDR == 0
    {
        return UCS_ERR_INVALID_PARAM;
    }
    let conn = if m & UCP_LISTENER_PARAM_FIELD_CONN_HANDLER != 0 {
        p.conn_handler
    } else {
        Handler {
            cb: None,
            arg: std::ptr::null_mut(),
        }
    };
    let accept = if m & UCP_LISTENER_PARAM_FIELD_ACCEPT_HANDLER != 0 {
        p.accept_handler
    } else {
        Handler {
            cb: None,
            arg: std::ptr::null_mut(),
        }
    };
    if conn.cb.is_some() == accept.cb.is_some() {
        // UCX's rule: exactly one handler says what becomes of a client.
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: the caller's promise.
    let at = match unsafe { socket_addr(&p.sockaddr) } {
        Ok(a) => a,
        Err(s) => return s,
    };
    match w.worker.listen(at) {
        Ok(l) => {
            let fd = l.as_raw_fd();
            let lp = Box::into_raw(Box::new(AbiListener {
                worker,
                l,
                conn,
                accept,
            }));
            w.extra.listeners.add(lp);
            w.extra.wake.watch(fd);
            // SAFETY: checked non-NULL, writable by the caller's promise.
            unsafe { *listener_p = lp };
            UCS_OK
        }
        Err(e) => {
            eprintln!("rucx libucp: ucp_listener_create on {at}: {e}");
            match &e {
                rucx_ucs::Error::Io { source, .. }
                    if source.kind() == std::io::ErrorKind::AddrInUse =>
                {
                    UCS_ERR_BUSY
                }
                _ => status_of(&e),
            }
        }
    }
}

/// `void ucp_listener_destroy(ucp_listener_h listener)`: stop listening (connection requests
/// handed out already stay valid).
///
/// # Safety
/// `listener` NULL or live, destroyed once, its worker live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_listener_destroy(listener: *mut AbiListener) {
    if listener.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in `ucp_listener_create`, destroyed once.
    let l = unsafe { Box::from_raw(listener) };
    // SAFETY: a worker outlives its listeners (UCX's rule).
    let w = unsafe { &*l.worker };
    w.extra.listeners.remove(listener);
    w.extra.wake.unwatch(l.l.as_raw_fd());
}

/// `ucs_status_t ucp_listener_query(ucp_listener_h listener, ucp_listener_attr_t *attr)`: the
/// address listened on (with the port the system picked for port 0).
///
/// # Safety
/// `listener` NULL or live; `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_listener_query(
    listener: *const AbiListener,
    attr: *mut ListenerAttr,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(l), Some(a)) = (unsafe { listener.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_LISTENER_ATTR_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & UCP_LISTENER_ATTR_FIELD_SOCKADDR != 0 {
        write_storage(l.l.local_addr(), &mut a.sockaddr);
    }
    UCS_OK
}

/// `ucs_status_t ucp_conn_request_query(ucp_conn_request_h conn_request,
/// ucp_conn_request_attr_t *attr)`: the client's address, and its client id (0 when the
/// client sent none, as in UCX).
///
/// # Safety
/// `conn_request` NULL or live (not answered yet); `attr` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_conn_request_query(
    conn_request: *const AbiConnRequest,
    attr: *mut ConnRequestAttr,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(r), Some(a)) = (unsafe { conn_request.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_CONN_REQUEST_ATTR_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID != 0 {
        a.client_id = r.req.client_id();
    }
    if a.field_mask & UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR != 0 {
        write_storage(r.req.client_addr(), &mut a.client_address);
    }
    UCS_OK
}

/// `ucs_status_t ucp_listener_reject(ucp_listener_h listener, ucp_conn_request_h
/// conn_request)`: turn the client away (its `ucp_ep_create` returns `UCS_ERR_REJECTED`).
///
/// # Safety
/// `conn_request` NULL or live (not answered yet), answered once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_listener_reject(
    listener: *const AbiListener,
    conn_request: *mut AbiConnRequest,
) -> Status {
    if listener.is_null() || conn_request.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: made by `Box::into_raw` in `hand_over`, answered once (the caller's promise).
    let r = unsafe { Box::from_raw(conn_request) };
    r.req.reject();
    UCS_OK
}

/// The loopback address of IPv4 or (`v6`) IPv6, for tests.
#[cfg(test)]
pub fn loopback(v6: bool) -> std::net::IpAddr {
    if v6 {
        std::net::IpAddr::V6(Ipv6Addr::LOCALHOST)
    } else {
        std::net::IpAddr::V4(Ipv4Addr::LOCALHOST)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c_addr(a: SocketAddr) -> (libc::sockaddr_storage, SockAddrParam) {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut s: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        write_storage(a, &mut s);
        let p = SockAddrParam {
            addr: std::ptr::null(),
            addrlen: std::mem::size_of::<libc::sockaddr_storage>() as u32,
        };
        (s, p)
    }

    #[test]
    fn socket_addresses_go_both_ways_and_bad_ones_are_refused() {
        for a in [
            SocketAddr::new(loopback(false), 13337),
            SocketAddr::new(loopback(true), 2),
            "10.1.2.3:65535".parse().unwrap(),
        ] {
            let (s, mut p) = c_addr(a);
            p.addr = (&s as *const libc::sockaddr_storage).cast();
            // SAFETY: `p` names `s`, alive here.
            assert_eq!(unsafe { socket_addr(&p) }, Ok(a));
            // Too short for its family.
            p.addrlen = 8;
            // SAFETY: as above.
            assert_eq!(unsafe { socket_addr(&p) }, Err(UCS_ERR_INVALID_PARAM));
        }
        let null = SockAddrParam {
            addr: std::ptr::null(),
            addrlen: 16,
        };
        // SAFETY: NULL is refused before any read.
        assert_eq!(unsafe { socket_addr(&null) }, Err(UCS_ERR_INVALID_PARAM));
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut unix: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        unix.ss_family = libc::AF_UNIX as libc::sa_family_t;
        let p = SockAddrParam {
            addr: (&unix as *const libc::sockaddr_storage).cast(),
            addrlen: 128,
        };
        // SAFETY: `p` names `unix`, alive here.
        assert_eq!(unsafe { socket_addr(&p) }, Err(UCS_ERR_UNSUPPORTED));
    }
}
