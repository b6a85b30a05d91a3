//! The C types of the client/server, stream, active-message and wake-up calls (ucp.h and
//! ucp_def.h of UCX 1.13 to 1.16, where these did not change), written from the published
//! numbers and layouts, with their layout tests at the bottom. Re-exported by
//! [`crate::types`].

use std::ffi::{c_uint, c_void};

use crate::types::Status;

// ucp_ep_params_t::flags
pub const UCP_EP_PARAMS_FLAGS_CLIENT_SERVER: c_uint = 1 << 0;
pub const UCP_EP_PARAMS_FLAGS_NO_LOOPBACK: c_uint = 1 << 1;
pub const UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID: c_uint = 1 << 2;
pub const UCP_EP_PARAMS_FLAGS_KNOWN: c_uint = (1 << 3) - 1;

// ucp_listener_params_t::field_mask
pub const UCP_LISTENER_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 0;
pub const UCP_LISTENER_PARAM_FIELD_ACCEPT_HANDLER: u64 = 1 << 1;
pub const UCP_LISTENER_PARAM_FIELD_CONN_HANDLER: u64 = 1 << 2;
pub const UCP_LISTENER_PARAM_FIELDS_KNOWN: u64 = (1 << 3) - 1;

// ucp_listener_attr_t::field_mask
pub const UCP_LISTENER_ATTR_FIELD_SOCKADDR: u64 = 1 << 0;
pub const UCP_LISTENER_ATTR_FIELDS_KNOWN: u64 = 1;

// ucp_conn_request_attr_t::field_mask
pub const UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR: u64 = 1 << 0;
pub const UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID: u64 = 1 << 1;
pub const UCP_CONN_REQUEST_ATTR_FIELDS_KNOWN: u64 = (1 << 2) - 1;

// ucp_stream_recv_flags_t
pub const UCP_STREAM_RECV_FLAG_WAITALL: u32 = 1 << 0;

// ucp_am_handler_param_t::field_mask
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
pub const UCP_AM_HANDLER_PARAM_FIELDS_KNOWN: u64 = (1 << 4) - 1;

// ucp_am_cb_flags
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
pub const UCP_AM_FLAG_PERSISTENT_DATA: u32 = 1 << 1;
pub const UCP_AM_FLAGS_KNOWN: u32 = (1 << 2) - 1;

// ucp_send_am_flags
pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1 << 0;
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
pub const UCP_AM_SEND_FLAG_RNDV: u32 = 1 << 2;
pub const UCP_AM_SEND_FLAG_COPY_HEADER: u32 = 1 << 3;
pub const UCP_AM_SEND_FLAGS_KNOWN: u32 = (1 << 4) - 1;

// ucp_am_recv_attr_t
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
pub const UCP_AM_RECV_ATTR_FLAG_DATA: u64 = 1 << 16;
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

/// `ucp_stream_recv_nbx_callback_t` and `ucp_am_recv_data_nbx_callback_t` (the same type).
/// `ucp_stream_recv_callback_t`: `(request, status, length)`.
pub type StreamRecvCb =
    Option<unsafe extern "C" fn(request: *mut c_void, status: Status, length: usize)>;

pub type LengthCb = Option<
    unsafe extern "C" fn(
        request: *mut c_void,
        status: Status,
        length: usize,
        user_data: *mut c_void,
    ),
>;

/// `ucp_listener_conn_callback_t`.
pub type ConnCb = Option<unsafe extern "C" fn(conn_request: *mut c_void, arg: *mut c_void)>;
/// `ucp_listener_accept_callback_t`.
pub type AcceptCb = Option<unsafe extern "C" fn(ep: *mut c_void, arg: *mut c_void)>;

/// `ucp_am_recv_callback_t`.
pub type AmRecvCb = Option<
    unsafe extern "C" fn(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        data: *mut c_void,
        length: usize,
        param: *const AmRecvParam,
    ) -> Status,
>;

/// `ucs_sock_addr_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SockAddrParam {
    pub addr: *const libc::sockaddr,
    pub addrlen: libc::socklen_t,
}

/// `ucp_listener_conn_handler_t` / `ucp_listener_accept_handler_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Handler<F> {
    pub cb: F,
    pub arg: *mut c_void,
}

/// `ucp_listener_params_t`.
#[repr(C)]
#[derive(Debug)]
pub struct ListenerParams {
    pub field_mask: u64,
    pub sockaddr: SockAddrParam,
    pub accept_handler: Handler<AcceptCb>,
    pub conn_handler: Handler<ConnCb>,
}

/// `ucp_listener_attr_t`.
#[repr(C)]
pub struct ListenerAttr {
    pub field_mask: u64,
    pub sockaddr: libc::sockaddr_storage,
}

impl std::fmt::Debug for ListenerAttr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerAttr")
            .field("field_mask", &self.field_mask)
            .finish_non_exhaustive()
    }
}

/// `ucp_conn_request_attr_t`.
#[repr(C)]
pub struct ConnRequestAttr {
    pub field_mask: u64,
    pub client_address: libc::sockaddr_storage,
    pub client_id: u64,
}

impl std::fmt::Debug for ConnRequestAttr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnRequestAttr")
            .field("field_mask", &self.field_mask)
            .field("client_id", &self.client_id)
            .finish_non_exhaustive()
    }
}

/// `ucp_am_handler_param_t`.
#[repr(C)]
#[derive(Debug)]
pub struct AmHandlerParam {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: AmRecvCb,
    pub arg: *mut c_void,
}

/// `ucp_am_recv_param_t`.
#[repr(C)]
#[derive(Debug)]
pub struct AmRecvParam {
    pub recv_attr: u64,
    pub reply_ep: *mut c_void,
}

#[cfg(test)]
mod tests {
    //! Sizes and offsets as UCX 1.13..1.16 lay them out on x86-64 and aarch64 (LP64).
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn sock_addr() {
        assert_eq!(size_of::<SockAddrParam>(), 16);
        assert_eq!(offset_of!(SockAddrParam, addr), 0);
        assert_eq!(offset_of!(SockAddrParam, addrlen), 8);
    }

    #[test]
    fn listener_params() {
        assert_eq!(size_of::<ListenerParams>(), 56);
        assert_eq!(offset_of!(ListenerParams, field_mask), 0);
        assert_eq!(offset_of!(ListenerParams, sockaddr), 8);
        assert_eq!(offset_of!(ListenerParams, accept_handler), 24);
        assert_eq!(offset_of!(ListenerParams, conn_handler), 40);
        assert_eq!(size_of::<Handler<ConnCb>>(), 16);
        assert_eq!(offset_of!(Handler<ConnCb>, arg), 8);
    }

    #[test]
    fn listener_attr() {
        assert_eq!(size_of::<libc::sockaddr_storage>(), 128);
        assert_eq!(size_of::<ListenerAttr>(), 136);
        assert_eq!(offset_of!(ListenerAttr, field_mask), 0);
        assert_eq!(offset_of!(ListenerAttr, sockaddr), 8);
    }

    #[test]
    fn conn_request_attr() {
        assert_eq!(size_of::<ConnRequestAttr>(), 144);
        assert_eq!(offset_of!(ConnRequestAttr, field_mask), 0);
        assert_eq!(offset_of!(ConnRequestAttr, client_address), 8);
        assert_eq!(offset_of!(ConnRequestAttr, client_id), 136);
    }

    #[test]
    fn am_handler_param() {
        assert_eq!(size_of::<AmHandlerParam>(), 32);
        assert_eq!(offset_of!(AmHandlerParam, field_mask), 0);
        assert_eq!(offset_of!(AmHandlerParam, id), 8);
        assert_eq!(offset_of!(AmHandlerParam, flags), 12);
        assert_eq!(offset_of!(AmHandlerParam, cb), 16);
        assert_eq!(offset_of!(AmHandlerParam, arg), 24);
    }

    #[test]
    fn am_recv_param() {
        assert_eq!(size_of::<AmRecvParam>(), 16);
        assert_eq!(offset_of!(AmRecvParam, recv_attr), 0);
        assert_eq!(offset_of!(AmRecvParam, reply_ep), 8);
    }
}
