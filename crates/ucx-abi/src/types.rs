//! The C types of UCX's public API (ucp.h, ucp_def.h, ucs/type/status.h and what they
//! include, as of UCX 1.13 to 1.16, where these did not change), written from the published
//! numbers and layouts: every struct is `#[repr(C)]` and its size and field offsets are
//! asserted by the tests at the bottom. Only what Open MPI's UCX components touch is here.

use std::ffi::{c_char, c_int, c_uint, c_void};

pub use crate::types_more::*;

/// `ucs_status_t`: a packed (one-byte) signed enum.
pub type Status = i8;

pub const UCS_OK: Status = 0;
pub const UCS_INPROGRESS: Status = 1;
pub const UCS_ERR_NO_MESSAGE: Status = -1;
pub const UCS_ERR_NO_RESOURCE: Status = -2;
pub const UCS_ERR_IO_ERROR: Status = -3;
pub const UCS_ERR_NO_MEMORY: Status = -4;
pub const UCS_ERR_INVALID_PARAM: Status = -5;
pub const UCS_ERR_UNREACHABLE: Status = -6;
pub const UCS_ERR_INVALID_ADDR: Status = -7;
pub const UCS_ERR_NOT_IMPLEMENTED: Status = -8;
pub const UCS_ERR_MESSAGE_TRUNCATED: Status = -9;
pub const UCS_ERR_NO_PROGRESS: Status = -10;
pub const UCS_ERR_BUFFER_TOO_SMALL: Status = -11;
pub const UCS_ERR_NO_ELEM: Status = -12;
pub const UCS_ERR_SOME_CONNECTS_FAILED: Status = -13;
pub const UCS_ERR_NO_DEVICE: Status = -14;
pub const UCS_ERR_BUSY: Status = -15;
pub const UCS_ERR_CANCELED: Status = -16;
pub const UCS_ERR_SHMEM_SEGMENT: Status = -17;
pub const UCS_ERR_ALREADY_EXISTS: Status = -18;
pub const UCS_ERR_OUT_OF_RANGE: Status = -19;
pub const UCS_ERR_TIMED_OUT: Status = -20;
pub const UCS_ERR_EXCEEDS_LIMIT: Status = -21;
pub const UCS_ERR_UNSUPPORTED: Status = -22;
pub const UCS_ERR_REJECTED: Status = -23;
pub const UCS_ERR_NOT_CONNECTED: Status = -24;
pub const UCS_ERR_CONNECTION_RESET: Status = -25;
pub const UCS_ERR_FIRST_LINK_FAILURE: Status = -40;
pub const UCS_ERR_LAST_LINK_FAILURE: Status = -59;
pub const UCS_ERR_FIRST_ENDPOINT_FAILURE: Status = -60;
pub const UCS_ERR_ENDPOINT_TIMEOUT: Status = -80;
pub const UCS_ERR_LAST_ENDPOINT_FAILURE: Status = -89;
pub const UCS_ERR_LAST: Status = -100;

/// The API version this library implements (`ucp_get_version`, `UCP_API_*`).
pub const API_MAJOR: c_uint = 1;
pub const API_MINOR: c_uint = 16;
pub const API_RELEASE: c_uint = 0;

pub const UCP_ENTITY_NAME_MAX: usize = 32;

// ucp_params_t::field_mask
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_REQUEST_SIZE: u64 = 1 << 1;
pub const UCP_PARAM_FIELD_REQUEST_INIT: u64 = 1 << 2;
pub const UCP_PARAM_FIELD_REQUEST_CLEANUP: u64 = 1 << 3;
pub const UCP_PARAM_FIELD_TAG_SENDER_MASK: u64 = 1 << 4;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_PARAM_FIELD_ESTIMATED_NUM_EPS: u64 = 1 << 6;
pub const UCP_PARAM_FIELD_ESTIMATED_NUM_PPN: u64 = 1 << 7;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_PARAM_FIELDS_KNOWN: u64 = (1 << 9) - 1;

// ucp_feature
pub const UCP_FEATURE_TAG: u64 = 1 << 0;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_AMO32: u64 = 1 << 2;
pub const UCP_FEATURE_AMO64: u64 = 1 << 3;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_STREAM: u64 = 1 << 5;
pub const UCP_FEATURE_AM: u64 = 1 << 6;

// ucp_context_attr_t::field_mask
pub const UCP_ATTR_FIELD_REQUEST_SIZE: u64 = 1 << 0;
pub const UCP_ATTR_FIELD_THREAD_MODE: u64 = 1 << 1;
pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
pub const UCP_ATTR_FIELD_NAME: u64 = 1 << 3;
pub const UCP_ATTR_FIELDS_KNOWN: u64 = (1 << 4) - 1;

// ucp_worker_attr_t::field_mask
pub const UCP_WORKER_ATTR_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCP_WORKER_ATTR_FIELD_ADDRESS: u64 = 1 << 1;
pub const UCP_WORKER_ATTR_FIELD_ADDRESS_FLAGS: u64 = 1 << 2;
pub const UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER: u64 = 1 << 3;
pub const UCP_WORKER_ATTR_FIELD_NAME: u64 = 1 << 4;
pub const UCP_WORKER_ATTR_FIELD_MAX_INFO_STRING: u64 = 1 << 5;
pub const UCP_WORKER_ATTR_FIELDS_KNOWN: u64 = (1 << 6) - 1;
pub const UCP_WORKER_ADDRESS_FLAG_NET_ONLY: u32 = 1 << 0;

// ucp_worker_params_t::field_mask
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCP_WORKER_PARAM_FIELD_CPU_MASK: u64 = 1 << 1;
pub const UCP_WORKER_PARAM_FIELD_EVENTS: u64 = 1 << 2;
pub const UCP_WORKER_PARAM_FIELD_USER_DATA: u64 = 1 << 3;
pub const UCP_WORKER_PARAM_FIELD_EVENT_FD: u64 = 1 << 4;
pub const UCP_WORKER_PARAM_FIELD_FLAGS: u64 = 1 << 5;
pub const UCP_WORKER_PARAM_FIELD_NAME: u64 = 1 << 6;
pub const UCP_WORKER_PARAM_FIELD_AM_ALIGNMENT: u64 = 1 << 7;
pub const UCP_WORKER_PARAM_FIELD_CLIENT_ID: u64 = 1 << 8;
pub const UCP_WORKER_PARAM_FIELDS_KNOWN: u64 = (1 << 9) - 1;
pub const UCP_WORKER_FLAG_IGNORE_REQUEST_LEAK: u64 = 1 << 0;

// ucp_ep_params_t::field_mask
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_EP_PARAM_FIELD_USER_DATA: u64 = 1 << 3;
pub const UCP_EP_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 4;
pub const UCP_EP_PARAM_FIELD_FLAGS: u64 = 1 << 5;
pub const UCP_EP_PARAM_FIELD_CONN_REQUEST: u64 = 1 << 6;
pub const UCP_EP_PARAM_FIELD_NAME: u64 = 1 << 7;
pub const UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR: u64 = 1 << 8;
pub const UCP_EP_PARAM_FIELDS_KNOWN: u64 = (1 << 9) - 1;

// ucp_err_handling_mode_t
pub const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;

// ucp_request_param_t::op_attr_mask
pub const UCP_OP_ATTR_FIELD_REQUEST: u32 = 1 << 0;
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_REPLY_BUFFER: u32 = 1 << 5;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
pub const UCP_OP_ATTR_FIELD_RECV_INFO: u32 = 1 << 7;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;
pub const UCP_OP_ATTR_FLAG_NO_IMM_CMPL: u32 = 1 << 16;
pub const UCP_OP_ATTR_FLAG_FAST_CMPL: u32 = 1 << 17;
pub const UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: u32 = 1 << 18;
pub const UCP_OP_ATTR_FLAG_MULTI_SEND: u32 = 1 << 19;
/// Every `op_attr_mask` bit this library knows (fields and flags).
pub const UCP_OP_ATTR_KNOWN: u32 = ((1 << 9) - 1) | (0xf << 16);

// ucp_ep_close_mode / flags
pub const UCP_EP_CLOSE_MODE_FORCE: c_uint = 0;
pub const UCP_EP_CLOSE_MODE_FLUSH: c_uint = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// ucp_datatype_t encoding: the class in the low 3 bits, a contiguous type's element size above.
pub const UCP_DATATYPE_CONTIG: u64 = 0;
pub const UCP_DATATYPE_STRIDED: u64 = 1;
pub const UCP_DATATYPE_IOV: u64 = 2;
pub const UCP_DATATYPE_GENERIC: u64 = 7;
pub const UCP_DATATYPE_SHIFT: u32 = 3;
pub const UCP_DATATYPE_CLASS_MASK: u64 = 7;

// ucs_thread_mode_t
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
pub const UCS_THREAD_MODE_MULTI: c_int = 2;

// ucs_memory_type_t (the values UCX 1.13..1.16 share)
pub const UCS_MEMORY_TYPE_HOST: u32 = 0;
pub const UCS_MEMORY_TYPE_CUDA: u32 = 1;
pub const UCS_MEMORY_TYPE_CUDA_MANAGED: u32 = 2;

// ucm_event_type_t
pub const UCM_EVENT_VM_UNMAPPED: c_int = 1 << 17;

pub type RequestInitCb = Option<unsafe extern "C" fn(request: *mut c_void)>;
pub type RequestCleanupCb = Option<unsafe extern "C" fn(request: *mut c_void)>;
/// `ucp_send_callback_t` (also the flush and disconnect callbacks of the `nb` forms).
pub type SendCb = Option<unsafe extern "C" fn(request: *mut c_void, status: Status)>;
/// `ucp_tag_recv_callback_t`.
pub type RecvCb =
    Option<unsafe extern "C" fn(request: *mut c_void, status: Status, info: *mut TagRecvInfo)>;
/// `ucp_send_nbx_callback_t`.
pub type SendNbxCb =
    Option<unsafe extern "C" fn(request: *mut c_void, status: Status, user_data: *mut c_void)>;
/// `ucp_tag_recv_nbx_callback_t`.
pub type RecvNbxCb = Option<
    unsafe extern "C" fn(
        request: *mut c_void,
        status: Status,
        info: *const TagRecvInfo,
        user_data: *mut c_void,
    ),
>;

/// `ucp_params_t`.
#[repr(C)]
#[derive(Debug)]
pub struct UcpParams {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: RequestInitCb,
    pub request_cleanup: RequestCleanupCb,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_context_attr_t`.
#[repr(C)]
#[derive(Debug)]
pub struct ContextAttr {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: c_int,
    pub memory_types: u64,
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
}

/// `ucp_worker_attr_t`.
#[repr(C)]
#[derive(Debug)]
pub struct WorkerAttr {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub address_flags: u32,
    pub address: *mut c_void,
    pub address_length: usize,
    pub max_am_header: usize,
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
    pub max_debug_string: usize,
}

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CpuSet {
    pub bits: [u64; 16],
}

/// `ucp_worker_params_t`.
#[repr(C)]
#[derive(Debug)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: CpuSet,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucp_err_handler_cb_t`.
pub type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: *mut c_void, status: Status);

/// `ucp_err_handler_t`.
#[repr(C)]
#[derive(Debug)]
pub struct ErrHandler {
    pub cb: Option<ErrHandlerCb>,
    pub arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
#[derive(Debug)]
pub struct SockAddr {
    pub addr: *const c_void,
    pub addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
#[derive(Debug)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler: ErrHandler,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: SockAddr,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: SockAddr,
}

/// `ucp_tag_recv_info_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagRecvInfo {
    pub sender_tag: u64,
    pub length: usize,
}

/// The callback union of `ucp_request_param_t`; which member is meant follows from the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ParamCb {
    pub send: SendNbxCb,
    pub recv: RecvNbxCb,
    /// `recv_stream` and `recv_am` (the same type).
    pub length: LengthCb,
    pub raw: *mut c_void,
}

impl std::fmt::Debug for ParamCb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: every member is a pointer-sized value; reading it as a pointer is sound.
        write!(f, "ParamCb({:p})", unsafe { self.raw })
    }
}

/// The receive-information union of `ucp_request_param_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ParamRecvInfo {
    pub length: *mut usize,
    pub tag_info: *mut TagRecvInfo,
}

impl std::fmt::Debug for ParamRecvInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: both members are pointers.
        write!(f, "ParamRecvInfo({:p})", unsafe { self.length })
    }
}

/// `ucp_request_param_t`.
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ParamCb,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: u32,
    pub recv_info: ParamRecvInfo,
    pub memh: *mut c_void,
}

impl std::fmt::Debug for RequestParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestParam")
            .field("op_attr_mask", &format_args!("{:#x}", self.op_attr_mask))
            .field("request", &self.request)
            .field("datatype", &format_args!("{:#x}", self.datatype))
            .finish_non_exhaustive()
    }
}

/// `ucp_generic_dt_ops_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GenericDtOps {
    pub start_pack: Option<
        unsafe extern "C" fn(
            context: *mut c_void,
            buffer: *const c_void,
            count: usize,
        ) -> *mut c_void,
    >,
    pub start_unpack: Option<
        unsafe extern "C" fn(
            context: *mut c_void,
            buffer: *mut c_void,
            count: usize,
        ) -> *mut c_void,
    >,
    pub packed_size: Option<unsafe extern "C" fn(state: *mut c_void) -> usize>,
    pub pack: Option<
        unsafe extern "C" fn(
            state: *mut c_void,
            offset: usize,
            dest: *mut c_void,
            max_length: usize,
        ) -> usize,
    >,
    pub unpack: Option<
        unsafe extern "C" fn(
            state: *mut c_void,
            offset: usize,
            src: *const c_void,
            length: usize,
        ) -> Status,
    >,
    pub finish: Option<unsafe extern "C" fn(state: *mut c_void)>,
}

#[cfg(test)]
mod tests {
    //! Sizes and offsets as UCX 1.13..1.16 lay them out on x86-64 and aarch64 (LP64).
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn status_is_one_byte() {
        assert_eq!(size_of::<Status>(), 1);
    }

    #[test]
    fn ucp_params() {
        assert_eq!(size_of::<UcpParams>(), 80);
        assert_eq!(offset_of!(UcpParams, field_mask), 0);
        assert_eq!(offset_of!(UcpParams, features), 8);
        assert_eq!(offset_of!(UcpParams, request_size), 16);
        assert_eq!(offset_of!(UcpParams, request_init), 24);
        assert_eq!(offset_of!(UcpParams, request_cleanup), 32);
        assert_eq!(offset_of!(UcpParams, tag_sender_mask), 40);
        assert_eq!(offset_of!(UcpParams, mt_workers_shared), 48);
        assert_eq!(offset_of!(UcpParams, estimated_num_eps), 56);
        assert_eq!(offset_of!(UcpParams, estimated_num_ppn), 64);
        assert_eq!(offset_of!(UcpParams, name), 72);
    }

    #[test]
    fn context_attr() {
        assert_eq!(size_of::<ContextAttr>(), 64);
        assert_eq!(offset_of!(ContextAttr, field_mask), 0);
        assert_eq!(offset_of!(ContextAttr, request_size), 8);
        assert_eq!(offset_of!(ContextAttr, thread_mode), 16);
        assert_eq!(offset_of!(ContextAttr, memory_types), 24);
        assert_eq!(offset_of!(ContextAttr, name), 32);
    }

    #[test]
    fn worker_attr() {
        assert_eq!(size_of::<WorkerAttr>(), 80);
        assert_eq!(offset_of!(WorkerAttr, field_mask), 0);
        assert_eq!(offset_of!(WorkerAttr, thread_mode), 8);
        assert_eq!(offset_of!(WorkerAttr, address_flags), 12);
        assert_eq!(offset_of!(WorkerAttr, address), 16);
        assert_eq!(offset_of!(WorkerAttr, address_length), 24);
        assert_eq!(offset_of!(WorkerAttr, max_am_header), 32);
        assert_eq!(offset_of!(WorkerAttr, name), 40);
        assert_eq!(offset_of!(WorkerAttr, max_debug_string), 72);
    }

    #[test]
    fn worker_params() {
        assert_eq!(size_of::<CpuSet>(), 128);
        assert_eq!(size_of::<WorkerParams>(), 200);
        assert_eq!(offset_of!(WorkerParams, field_mask), 0);
        assert_eq!(offset_of!(WorkerParams, thread_mode), 8);
        assert_eq!(offset_of!(WorkerParams, cpu_mask), 16);
        assert_eq!(offset_of!(WorkerParams, events), 144);
        assert_eq!(offset_of!(WorkerParams, user_data), 152);
        assert_eq!(offset_of!(WorkerParams, event_fd), 160);
        assert_eq!(offset_of!(WorkerParams, flags), 168);
        assert_eq!(offset_of!(WorkerParams, name), 176);
        assert_eq!(offset_of!(WorkerParams, am_alignment), 184);
        assert_eq!(offset_of!(WorkerParams, client_id), 192);
    }

    #[test]
    fn ep_params() {
        assert_eq!(size_of::<ErrHandler>(), 16);
        assert_eq!(offset_of!(ErrHandler, cb), 0);
        assert_eq!(offset_of!(ErrHandler, arg), 8);
        assert_eq!(size_of::<SockAddr>(), 16);
        assert_eq!(offset_of!(SockAddr, addr), 0);
        assert_eq!(offset_of!(SockAddr, addrlen), 8);
        assert_eq!(size_of::<EpParams>(), 104);
        assert_eq!(offset_of!(EpParams, field_mask), 0);
        assert_eq!(offset_of!(EpParams, address), 8);
        assert_eq!(offset_of!(EpParams, err_mode), 16);
        assert_eq!(offset_of!(EpParams, err_handler), 24);
        assert_eq!(offset_of!(EpParams, user_data), 40);
        assert_eq!(offset_of!(EpParams, flags), 48);
        assert_eq!(offset_of!(EpParams, sockaddr), 56);
        assert_eq!(offset_of!(EpParams, conn_request), 72);
        assert_eq!(offset_of!(EpParams, name), 80);
        assert_eq!(offset_of!(EpParams, local_sockaddr), 88);
    }

    #[test]
    fn request_param() {
        assert_eq!(size_of::<ParamCb>(), 8);
        assert_eq!(size_of::<ParamRecvInfo>(), 8);
        assert_eq!(size_of::<RequestParam>(), 72);
        assert_eq!(offset_of!(RequestParam, op_attr_mask), 0);
        assert_eq!(offset_of!(RequestParam, flags), 4);
        assert_eq!(offset_of!(RequestParam, request), 8);
        assert_eq!(offset_of!(RequestParam, cb), 16);
        assert_eq!(offset_of!(RequestParam, datatype), 24);
        assert_eq!(offset_of!(RequestParam, user_data), 32);
        assert_eq!(offset_of!(RequestParam, reply_buffer), 40);
        assert_eq!(offset_of!(RequestParam, memory_type), 48);
        assert_eq!(offset_of!(RequestParam, recv_info), 56);
        assert_eq!(offset_of!(RequestParam, memh), 64);
    }

    #[test]
    fn tag_recv_info() {
        assert_eq!(size_of::<TagRecvInfo>(), 16);
        assert_eq!(offset_of!(TagRecvInfo, sender_tag), 0);
        assert_eq!(offset_of!(TagRecvInfo, length), 8);
    }

    #[test]
    fn generic_dt_ops() {
        assert_eq!(size_of::<GenericDtOps>(), 48);
        assert_eq!(offset_of!(GenericDtOps, start_pack), 0);
        assert_eq!(offset_of!(GenericDtOps, start_unpack), 8);
        assert_eq!(offset_of!(GenericDtOps, packed_size), 16);
        assert_eq!(offset_of!(GenericDtOps, pack), 24);
        assert_eq!(offset_of!(GenericDtOps, unpack), 32);
        assert_eq!(offset_of!(GenericDtOps, finish), 40);
    }

    #[test]
    fn flag_values() {
        assert_eq!(UCP_OP_ATTR_FLAG_NO_IMM_CMPL, 0x10000);
        assert_eq!(UCP_OP_ATTR_FLAG_MULTI_SEND, 0x80000);
        assert_eq!(UCP_PARAM_FIELD_NAME, 0x100);
        assert_eq!(UCP_WORKER_ATTR_FIELD_MAX_INFO_STRING, 0x20);
        assert_eq!(UCP_EP_PARAM_FIELD_LOCAL_SOCK_ADDR, 0x100);
        assert_eq!(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE, 0x2);
        assert_eq!(UCP_EP_PARAM_FIELD_ERR_HANDLER, 0x4);
        assert_eq!(UCP_EP_PARAM_FIELD_USER_DATA, 0x8);
        assert_eq!(
            (UCP_ERR_HANDLING_MODE_NONE, UCP_ERR_HANDLING_MODE_PEER),
            (0, 1)
        );
        assert_eq!(UCS_ERR_CONNECTION_RESET, -25);
        assert_eq!(UCS_ERR_ENDPOINT_TIMEOUT, -80);
        assert_eq!(UCM_EVENT_VM_UNMAPPED, 0x20000);
        // ucp_dt_make_contig(8)
        assert_eq!((8u64 << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG, 0x40);
    }
}
