//! The verbs seam: every call this component makes into libibverbs goes through the traits of
//! this module ([`Verbs`], [`VerbsDevice`], [`Cq`], [`Qp`], [`Mr`]).
//!
//! The real implementation ([`crate::sys::SystemVerbs`]) sits on `sideway`/`rdma-mummy-sys`,
//! which load libibverbs at run time. Tests use a software fabric (`fake` module, feature
//! `fake-fabric`) that moves bytes between registered host buffers and produces the same work
//! completions a NIC would, including the error ones.
//!
//! The data types here are plain data with no pointers into the verbs library, so attribute
//! derivation, GPU-direct decisions and address handling are pure functions of them.

use std::any::Any;
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

/// A verbs call that failed, with the errno it reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsError {
    /// The libibverbs function, e.g. `ibv_reg_mr`.
    pub call: &'static str,
    /// The errno value (positive).
    pub errno: i32,
}

impl VerbsError {
    /// A failure of `call` with `errno`.
    pub fn new(call: &'static str, errno: i32) -> Self {
        VerbsError { call, errno }
    }

    /// From an `io::Error` (an error without an OS code counts as `EIO`).
    pub fn from_io(call: &'static str, e: &io::Error) -> Self {
        VerbsError {
            call,
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// The system's text for the errno, e.g. `Bad address (os error 14)`.
    pub fn strerror(&self) -> String {
        io::Error::from_raw_os_error(self.errno).to_string()
    }

    /// The symbolic errno name when it is one of those verbs reports, e.g. `EFAULT`.
    pub fn errno_name(&self) -> &'static str {
        errno_name(self.errno)
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed: {} ({})",
            self.call,
            self.strerror(),
            self.errno_name()
        )
    }
}

impl std::error::Error for VerbsError {}

/// Symbolic name of the errno values verbs calls report.
pub fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::EPROTONOSUPPORT => "EPROTONOSUPPORT",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EOVERFLOW => "EOVERFLOW",
        _ => "errno",
    }
}

/// Logical state of a port (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// `IBV_PORT_DOWN`: no physical link.
    Down,
    /// `IBV_PORT_INIT`: link up, not configured by the subnet manager yet.
    Init,
    /// `IBV_PORT_ARMED`: configured, not active yet.
    Armed,
    /// `IBV_PORT_ACTIVE`: usable.
    Active,
    /// `IBV_PORT_ACTIVE_DEFER`: was active, link is recovering.
    ActiveDefer,
    /// Any other value (`IBV_PORT_NOP` or one this build does not know).
    Other(u32),
}

impl PortState {
    /// From the raw `ibv_port_state` value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            o => PortState::Other(o),
        }
    }

    /// The raw value.
    pub fn raw(self) -> u32 {
        match self {
            PortState::Down => 1,
            PortState::Init => 2,
            PortState::Armed => 3,
            PortState::Active => 4,
            PortState::ActiveDefer => 5,
            PortState::Other(o) => o,
        }
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Down => f.write_str("DOWN"),
            PortState::Init => f.write_str("INIT"),
            PortState::Armed => f.write_str("ARMED"),
            PortState::Active => f.write_str("ACTIVE"),
            PortState::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            PortState::Other(0) => f.write_str("NOP"),
            PortState::Other(o) => write!(f, "state {o}"),
        }
    }
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand (also reported as "unspecified" by old drivers).
    InfiniBand,
    /// Ethernet: RoCE.
    Ethernet,
}

impl LinkLayer {
    /// From the raw `IBV_LINK_LAYER_*` value; unspecified (0) and unknown values mean InfiniBand,
    /// as libibverbs documents for old drivers.
    pub fn from_raw(v: u8) -> Self {
        if v == 2 {
            LinkLayer::Ethernet
        } else {
            LinkLayer::InfiniBand
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
        })
    }
}

/// An RDMA path MTU (`enum ibv_mtu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    M256,
    /// 512 bytes.
    M512,
    /// 1024 bytes.
    M1024,
    /// 2048 bytes.
    M2048,
    /// 4096 bytes.
    M4096,
}

impl Mtu {
    /// Every MTU, smallest first.
    pub const ALL: [Mtu; 5] = [Mtu::M256, Mtu::M512, Mtu::M1024, Mtu::M2048, Mtu::M4096];

    /// From the `ibv_mtu` code (1..=5).
    pub fn from_code(code: u32) -> Option<Mtu> {
        match code {
            1 => Some(Mtu::M256),
            2 => Some(Mtu::M512),
            3 => Some(Mtu::M1024),
            4 => Some(Mtu::M2048),
            5 => Some(Mtu::M4096),
            _ => None,
        }
    }

    /// From a size in bytes (exactly one of the five).
    pub fn from_bytes(n: usize) -> Option<Mtu> {
        Mtu::ALL.into_iter().find(|m| m.bytes() == n)
    }

    /// The `ibv_mtu` code.
    pub fn code(self) -> u32 {
        match self {
            Mtu::M256 => 1,
            Mtu::M512 => 2,
            Mtu::M1024 => 3,
            Mtu::M2048 => 4,
            Mtu::M4096 => 5,
        }
    }

    /// Payload bytes per packet.
    pub fn bytes(self) -> usize {
        128 << self.code()
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// Kind of a GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GidKind {
    /// InfiniBand GID.
    Ib,
    /// RoCE v1 (Ethernet frames, GRH).
    RoceV1,
    /// RoCE v2 (UDP/IP).
    RoceV2,
}

impl fmt::Display for GidKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidKind::Ib => "IB",
            GidKind::RoceV1 => "RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
        })
    }
}

/// One populated GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's GID table.
    pub index: u32,
    /// The GID, network byte order.
    pub gid: [u8; 16],
    /// Its kind.
    pub kind: GidKind,
}

impl GidEntry {
    /// True for `::ffff:a.b.c.d` (an IPv4 address mapped into the GID).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|b| *b == 0) && self.gid[10] == 0xff && self.gid[11] == 0xff
    }

    /// The GID as an IPv6 address (the usual way to print it).
    pub fn as_ipv6(&self) -> std::net::Ipv6Addr {
        std::net::Ipv6Addr::from(self.gid)
    }
}

/// Device-wide attributes (from `ibv_query_device` and sysfs).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DeviceAttrs {
    /// Device name, e.g. `mlx5_0`.
    pub name: String,
    /// Node GUID (host byte order).
    pub node_guid: u64,
    /// Firmware version.
    pub fw_ver: String,
    /// PCI vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Most queue pairs.
    pub max_qp: u32,
    /// Most outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most entries per completion queue.
    pub max_cqe: u32,
    /// Most outstanding RDMA reads/atomics this QP can be the target of.
    pub max_qp_rd_atom: u32,
    /// Most outstanding RDMA reads/atomics this QP can initiate.
    pub max_qp_init_rd_atom: u32,
    /// Atomic operations are supported.
    pub atomics: bool,
    /// PCI bus id of the device (from sysfs), when known.
    pub sys_device: Option<String>,
}

/// Attributes of one port (from `ibv_query_port` and the GID table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttrs {
    /// Port number, from 1.
    pub port_num: u8,
    /// Logical state.
    pub state: PortState,
    /// Physical state (raw; 5 = LinkUp).
    pub phys_state: u8,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Base LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// LID of the subnet manager.
    pub sm_lid: u16,
    /// LID mask control.
    pub lmc: u8,
    /// Active MTU.
    pub active_mtu: Mtu,
    /// Largest supported MTU.
    pub max_mtu: Mtu,
    /// Active width, raw `ibv_port_attr.active_width` code (1=1X, 2=4X, 4=8X, 8=12X, 16=2X).
    pub active_width: u8,
    /// Active speed, raw code (`active_speed_ex` when the driver reports it, else
    /// `active_speed`): 1=SDR, 2=DDR, 4=QDR, 8=FDR10, 16=FDR, 32=EDR, 64=HDR, 128=NDR, 256=XDR.
    pub active_speed: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    /// Size of the GID table.
    pub gid_tbl_len: u32,
    /// The populated GID entries.
    pub gids: Vec<GidEntry>,
}

/// A device and its ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceReport {
    /// Device-wide attributes.
    pub attrs: DeviceAttrs,
    /// Every port, in port order.
    pub ports: Vec<PortAttrs>,
}

impl DeviceReport {
    /// The port with this number.
    pub fn port(&self, num: u8) -> Option<&PortAttrs> {
        self.ports.iter().find(|p| p.port_num == num)
    }
}

bitflags::bitflags! {
    /// Access rights of a memory region or queue pair (`enum ibv_access_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        /// The local NIC may write (needed for receives, RDMA read targets, remote write).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA-write.
        const REMOTE_WRITE = 1 << 1;
        /// Peers may RDMA-read.
        const REMOTE_READ = 1 << 2;
        /// Peers may run atomics.
        const REMOTE_ATOMIC = 1 << 3;
        /// Relaxed PCIe ordering (an optional flag: ignored where unsupported).
        const RELAXED_ORDERING = 1 << 20;
    }
}

/// Sizes of a queue pair's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Inline data bytes (0: none).
    pub max_inline_data: u32,
}

/// Global routing header for a connection (RoCE, or InfiniBand across subnets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Local GID index to send from.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
}

/// Everything needed to move an RC queue pair from INIT through RTR to RTS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RcConnect {
    /// Local port.
    pub port: u8,
    /// Peer QP number.
    pub dest_qpn: u32,
    /// First PSN the peer sends with (our receive PSN).
    pub rq_psn: u32,
    /// First PSN we send with.
    pub sq_psn: u32,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Peer LID (InfiniBand).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Global routing, when needed.
    pub grh: Option<Grh>,
    /// Outstanding RDMA reads we may initiate.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads the peer may initiate on us.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Local ack timeout exponent (4.096 us * 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (7 = forever).
    pub rnr_retry: u8,
}

/// A scatter/gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Start address (host virtual address, or the iova of a dma-buf registration).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the memory region covering it.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send into the peer's next posted receive.
    Send,
    /// RDMA write into peer memory.
    Write {
        /// Peer address.
        remote_addr: u64,
        /// Peer memory key.
        rkey: u32,
    },
    /// RDMA read from peer memory into the local buffers.
    Read {
        /// Peer address.
        remote_addr: u64,
        /// Peer memory key.
        rkey: u32,
    },
}

/// A send work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Identifier echoed in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local buffers.
    pub sges: &'a [Sge],
    /// Produce a completion on success.
    pub signaled: bool,
    /// Wait for earlier RDMA reads before starting.
    pub fence: bool,
}

/// Status of a work completion (`enum ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Success.
    Success,
    /// Local length error (message larger than the receive buffer).
    LocLenErr,
    /// Local QP operation error.
    LocQpOpErr,
    /// Local protection error (bad lkey or access).
    LocProtErr,
    /// Flushed because the QP went to the error state.
    WrFlushErr,
    /// Local access error.
    LocAccessErr,
    /// Remote invalid request (e.g. message too long for the peer's buffer).
    RemInvReqErr,
    /// Remote access error (bad rkey, bounds or rights).
    RemAccessErr,
    /// Remote operation error.
    RemOpErr,
    /// Transport retries exceeded: peer unreachable or gone.
    RetryExcErr,
    /// Receiver-not-ready retries exceeded: the peer posted no receive.
    RnrRetryExcErr,
    /// Remote aborted.
    RemAbortErr,
    /// Fatal device error.
    FatalErr,
    /// Response timeout.
    RespTimeoutErr,
    /// General error.
    GeneralErr,
    /// Any other status value.
    Other(u32),
}

impl WcStatus {
    /// From the raw value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => WcStatus::Success,
            1 => WcStatus::LocLenErr,
            2 => WcStatus::LocQpOpErr,
            4 => WcStatus::LocProtErr,
            5 => WcStatus::WrFlushErr,
            8 => WcStatus::LocAccessErr,
            9 => WcStatus::RemInvReqErr,
            10 => WcStatus::RemAccessErr,
            11 => WcStatus::RemOpErr,
            12 => WcStatus::RetryExcErr,
            13 => WcStatus::RnrRetryExcErr,
            16 => WcStatus::RemAbortErr,
            19 => WcStatus::FatalErr,
            20 => WcStatus::RespTimeoutErr,
            21 => WcStatus::GeneralErr,
            o => WcStatus::Other(o),
        }
    }

    /// What the status means, for error messages.
    pub fn describe(self) -> String {
        match self {
            WcStatus::Success => "success".into(),
            WcStatus::LocLenErr => {
                "local length error (message longer than the receive buffer)".into()
            }
            WcStatus::LocQpOpErr => "local QP operation error".into(),
            WcStatus::LocProtErr => {
                "local protection error (buffer not covered by its memory key)".into()
            }
            WcStatus::WrFlushErr => "flushed: the connection had already failed".into(),
            WcStatus::LocAccessErr => "local access error".into(),
            WcStatus::RemInvReqErr => {
                "remote invalid request (message too long for the peer, or operation not allowed)"
                    .into()
            }
            WcStatus::RemAccessErr => {
                "remote access error (bad remote key, bounds or rights)".into()
            }
            WcStatus::RemOpErr => "remote operation error".into(),
            WcStatus::RetryExcErr => {
                "transport retry counter exceeded (peer unreachable or gone)".into()
            }
            WcStatus::RnrRetryExcErr => {
                "receiver-not-ready retries exceeded (peer posted no receive buffer)".into()
            }
            WcStatus::RemAbortErr => "remote aborted".into(),
            WcStatus::FatalErr => "fatal device error".into(),
            WcStatus::RespTimeoutErr => "response timeout".into(),
            WcStatus::GeneralErr => "general error".into(),
            WcStatus::Other(o) => format!("work completion status {o}"),
        }
    }
}

/// Operation of a work completion (valid only for successful completions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A send finished.
    Send,
    /// An RDMA write finished.
    RdmaWrite,
    /// An RDMA read finished.
    RdmaRead,
    /// A message arrived in a posted receive.
    Recv,
    /// Anything else.
    Other(u32),
}

impl WcOpcode {
    /// From the raw value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => WcOpcode::Send,
            1 => WcOpcode::RdmaWrite,
            2 => WcOpcode::RdmaRead,
            128 => WcOpcode::Recv,
            o => WcOpcode::Other(o),
        }
    }
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    /// The work request's identifier.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Operation (meaningful on success only).
    pub opcode: WcOpcode,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// Vendor error syndrome (errors).
    pub vendor_err: u32,
    /// Local QP number.
    pub qp_num: u32,
}

/// Entry point: the verbs library and the host facts around it.
pub trait Verbs: Send + Sync + fmt::Debug {
    /// Whether libibverbs could be loaded; the error is the loader's message.
    fn library_status(&self) -> Result<(), String>;

    /// What sysfs shows under `/sys/class/infiniband`.
    fn sysfs_devices(&self) -> SysfsDevices;

    /// The GPU peer-memory kernel module, when one is loaded (e.g. `nvidia_peermem`).
    fn peer_memory_module(&self) -> Option<String>;

    /// The locked-memory limit of this process in bytes (`None`: unlimited or unknown).
    fn memlock_limit(&self) -> Option<u64>;

    /// Names of the devices libibverbs lists.
    fn device_names(&self) -> Result<Vec<String>, VerbsError>;

    /// Query a device, its ports and their GID tables.
    fn query_device(&self, name: &str) -> Result<DeviceReport, VerbsError>;

    /// Open a device (context and one protection domain).
    fn open_device(&self, name: &str) -> Result<Arc<dyn VerbsDevice>, VerbsError>;
}

/// What `/sys/class/infiniband` holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SysfsDevices {
    /// The directory does not exist: no RDMA driver is loaded.
    Missing,
    /// It exists and is empty.
    Empty,
    /// These device names.
    Present(Vec<String>),
}

/// An open device with its protection domain.
pub trait VerbsDevice: Send + Sync + fmt::Debug {
    /// Device name.
    fn name(&self) -> &str;

    /// Register `[addr, addr+len)` (`ibv_reg_mr`). Device memory goes through here too when a
    /// peer-memory module translates it.
    ///
    /// # Safety
    /// The range must stay mapped in this process for as long as the returned region lives
    /// (and, with remote rights, as long as any peer may use its key).
    unsafe fn reg_mr(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Mr>, VerbsError>;

    /// Register `len` bytes at `offset` of a dma-buf (`ibv_reg_dmabuf_mr`), addressed on the
    /// wire as `iova`.
    ///
    /// # Safety
    /// `fd` must be a dma-buf (or an invalid descriptor, to probe support); the exported memory
    /// must stay allocated for as long as the returned region lives.
    unsafe fn reg_dmabuf_mr(
        &self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: RawFd,
        access: Access,
    ) -> Result<Box<dyn Mr>, VerbsError>;

    /// Create a completion channel (`ibv_create_comp_channel`), its descriptor non-blocking.
    fn create_comp_channel(&self) -> Result<Arc<dyn CompChannel>, VerbsError>;

    /// Create a completion queue with room for `cqe` entries (`ibv_create_cq`), on `channel`
    /// when given: once armed ([`Cq::req_notify`]), its next completion puts an event on the
    /// channel.
    fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&Arc<dyn CompChannel>>,
    ) -> Result<Arc<dyn Cq>, VerbsError>;

    /// Create a reliable-connected QP whose send and receive completions go to `cq`; it is
    /// returned in the RESET state.
    fn create_rc_qp(&self, cq: &Arc<dyn Cq>, caps: &QpCaps) -> Result<Box<dyn Qp>, VerbsError>;
}

/// A registered memory region; dropping it deregisters.
pub trait Mr: Send + Sync + fmt::Debug {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
}

/// A completion queue.
pub trait Cq: Send + Sync + fmt::Debug {
    /// For implementations to recover their own type.
    fn as_any(&self) -> &dyn Any;

    /// Append up to `max` completions to `out`; returns how many.
    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize, VerbsError>;

    /// Arm the CQ (`ibv_req_notify_cq`, every completion, not only solicited ones): its next
    /// completion puts one event on its channel. Completions already in the queue may raise
    /// none (poll once more after arming). Only for a CQ created on a channel.
    fn req_notify(&self) -> Result<(), VerbsError>;

    /// Acknowledge `n` events taken from the channel for this CQ (`ibv_ack_cq_events`); every
    /// event taken must be acknowledged once before the CQ is destroyed.
    fn ack_events(&self, n: u32);
}

/// A completion channel: a descriptor that becomes readable when an armed CQ created on it
/// gets a completion, and stays readable until the events are taken.
pub trait CompChannel: Send + Sync + fmt::Debug {
    /// For implementations to recover their own type.
    fn as_any(&self) -> &dyn Any;

    /// The channel's descriptor (non-blocking), to poll for `POLLIN`.
    fn fd(&self) -> RawFd;

    /// Take one event (`ibv_get_cq_event`) without blocking: `Ok(false)` when none is
    /// pending. The event belongs to the one CQ its owner created on this channel, which must
    /// [acknowledge](Cq::ack_events) it.
    fn get_event(&self) -> Result<bool, VerbsError>;
}

/// A reliable-connected queue pair.
pub trait Qp: Send + fmt::Debug {
    /// QP number.
    fn qp_num(&self) -> u32;

    /// RESET -> INIT on `port`, with the rights peers get on it.
    fn init(&mut self, port: u8, access: Access) -> Result<(), VerbsError>;

    /// INIT -> RTR -> RTS.
    fn connect(&mut self, c: &RcConnect) -> Result<(), VerbsError>;

    /// Post one receive.
    ///
    /// # Safety
    /// The buffers must stay valid and unused by anything else until the completion.
    unsafe fn post_recv(&mut self, wr_id: u64, sges: &[Sge]) -> Result<(), VerbsError>;

    /// Post one send work request.
    ///
    /// # Safety
    /// The local buffers must stay valid (and, for reads, unused) until the completion.
    unsafe fn post_send(&mut self, wr: &SendWr<'_>) -> Result<(), VerbsError>;
}

/// Lanes of a raw `active_width` code.
pub fn width_lanes(code: u8) -> Option<u32> {
    match code {
        1 => Some(1),
        2 => Some(4),
        4 => Some(8),
        8 => Some(12),
        16 => Some(2),
        _ => None,
    }
}

/// Printable name of a raw `active_width` code.
pub fn width_name(code: u8) -> String {
    width_lanes(code).map_or_else(|| format!("width {code}"), |l| format!("{l}X"))
}

/// Data rate of one lane in Gbit/s (after line encoding) and the generation's name, for a raw
/// speed code.
pub fn lane_rate(code: u32) -> Option<(f64, &'static str)> {
    Some(match code {
        1 => (2.0, "SDR"),
        2 => (4.0, "DDR"),
        4 => (8.0, "QDR"),
        8 => (10.0, "FDR10"),
        16 => (13.64, "FDR"),
        32 => (25.0, "EDR"),
        64 => (50.0, "HDR"),
        128 => (100.0, "NDR"),
        256 => (200.0, "XDR"),
        _ => return None,
    })
}

/// Link data rate in Gbit/s (lanes times lane rate), when both codes are known.
pub fn link_gbps(width: u8, speed: u32) -> Option<f64> {
    Some(f64::from(width_lanes(width)?) * lane_rate(speed)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_codes_round_trip_and_unknowns_do_not_panic() {
        for v in 0..8 {
            assert_eq!(PortState::from_raw(v).raw(), v);
        }
        assert_eq!(PortState::from_raw(4).to_string(), "ACTIVE");
        assert_eq!(PortState::from_raw(77).to_string(), "state 77");
        for m in Mtu::ALL {
            assert_eq!(Mtu::from_code(m.code()), Some(m));
            assert_eq!(Mtu::from_bytes(m.bytes()), Some(m));
        }
        assert_eq!(Mtu::M4096.bytes(), 4096);
        assert_eq!(Mtu::from_code(0), None);
        assert_eq!(Mtu::from_code(6), None);
        assert_eq!(LinkLayer::from_raw(0), LinkLayer::InfiniBand);
        assert_eq!(LinkLayer::from_raw(2), LinkLayer::Ethernet);
        assert_eq!(WcStatus::from_raw(12), WcStatus::RetryExcErr);
        assert_eq!(WcStatus::from_raw(99), WcStatus::Other(99));
        assert_eq!(WcOpcode::from_raw(128), WcOpcode::Recv);
    }

    #[test]
    fn link_rates() {
        // 4X EDR = 100 Gb/s, 4X HDR = 200, 1X NDR = 100, 2X NDR = 200.
        assert_eq!(link_gbps(2, 32), Some(100.0));
        assert_eq!(link_gbps(2, 64), Some(200.0));
        assert_eq!(link_gbps(1, 128), Some(100.0));
        assert_eq!(link_gbps(16, 128), Some(200.0));
        assert_eq!(link_gbps(3, 32), None);
        assert_eq!(link_gbps(2, 3), None);
        assert_eq!(width_name(2), "4X");
    }

    #[test]
    fn verbs_error_message_names_call_and_errno() {
        let e = VerbsError::new("ibv_reg_mr", libc::EFAULT);
        let s = e.to_string();
        assert!(
            s.contains("ibv_reg_mr") && s.contains("Bad address") && s.contains("EFAULT"),
            "{s}"
        );
    }

    #[test]
    fn ipv4_mapped_gid() {
        let mut g = GidEntry {
            index: 1,
            gid: [0; 16],
            kind: GidKind::RoceV2,
        };
        g.gid[10] = 0xff;
        g.gid[11] = 0xff;
        g.gid[12..].copy_from_slice(&[10, 0, 0, 1]);
        assert!(g.is_ipv4_mapped());
        assert_eq!(g.as_ipv6().to_string(), "::ffff:10.0.0.1");
        g.gid[0] = 0xfe;
        assert!(!g.is_ipv4_mapped());
    }
}
