//! Attributes that memory domains and interfaces publish; the planner decides from these alone.

use std::collections::BTreeMap;
use std::fmt;

use rucx_ucs::{MemoryType, MemoryTypes};

bitflags::bitflags! {
    /// What a memory domain can do with one memory type.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct MemTypeFlags: u8 {
        /// Register existing buffers of this type (for zero-copy and remote access).
        const REG = 1 << 0;
        /// Allocate buffers of this type.
        const ALLOC = 1 << 1;
        /// The domain's transports can read/write buffers of this type.
        const ACCESS = 1 << 2;
        /// The domain can tell from a pointer that it is of this type.
        const DETECT = 1 << 3;
        /// Registrations of this type may be cached (the domain is told when memory is freed).
        const CACHE = 1 << 4;
        /// Registration through dma-buf is supported for this type.
        const DMABUF = 1 << 5;
    }
}

impl fmt::Display for MemTypeFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut words = Vec::new();
        for (flag, name) in [
            (MemTypeFlags::REG, "reg"),
            (MemTypeFlags::ALLOC, "alloc"),
            (MemTypeFlags::ACCESS, "access"),
            (MemTypeFlags::DETECT, "detect"),
            (MemTypeFlags::CACHE, "cache"),
            (MemTypeFlags::DMABUF, "dmabuf"),
        ] {
            if self.contains(flag) {
                words.push(name);
            }
        }
        if words.is_empty() {
            f.write_str("-")
        } else {
            f.write_str(&words.join("|"))
        }
    }
}

/// A cost that grows linearly with size: `overhead + per_byte * n` nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct LinearCost {
    /// Fixed part, nanoseconds.
    pub overhead_ns: f64,
    /// Per-byte part, nanoseconds.
    pub per_byte_ns: f64,
}

impl LinearCost {
    /// A cost with no size dependence.
    pub const fn fixed(ns: f64) -> Self {
        LinearCost {
            overhead_ns: ns,
            per_byte_ns: 0.0,
        }
    }

    /// Cost of `n` bytes, nanoseconds.
    pub fn at(&self, n: usize) -> f64 {
        self.overhead_ns + self.per_byte_ns * n as f64
    }
}

/// Attributes of a memory domain.
#[derive(Clone, Debug, PartialEq)]
pub struct MdAttr {
    /// Component that opened the domain.
    pub component: String,
    /// Per memory type capabilities; a type missing from the map has no capabilities.
    pub mem_types: BTreeMap<MemoryType, MemTypeFlags>,
    /// Cost of registering a buffer.
    pub reg_cost: LinearCost,
    /// Largest single registration, `None` for unlimited.
    pub max_reg: Option<u64>,
    /// Largest single allocation, `None` for unlimited (only meaningful with `ALLOC`).
    pub max_alloc: Option<u64>,
    /// Size of a packed remote key, bytes (0 when remote access is not supported).
    pub rkey_packed_size: usize,
    /// Zero-copy operations need a local memory handle.
    pub need_memh_for_zcopy: bool,
}

impl MdAttr {
    /// A domain description with no memory-type capabilities yet.
    pub fn new(component: &str) -> Self {
        MdAttr {
            component: component.to_string(),
            mem_types: BTreeMap::new(),
            reg_cost: LinearCost::default(),
            max_reg: None,
            max_alloc: None,
            rkey_packed_size: 0,
            need_memh_for_zcopy: true,
        }
    }

    /// Builder: set the flags for a memory type.
    pub fn with(mut self, mt: MemoryType, flags: MemTypeFlags) -> Self {
        self.mem_types.insert(mt, flags);
        self
    }

    /// Flags for one memory type.
    pub fn flags(&self, mt: MemoryType) -> MemTypeFlags {
        self.mem_types.get(&mt).copied().unwrap_or_default()
    }

    /// The memory types having all of `flags`.
    pub fn types_with(&self, flags: MemTypeFlags) -> MemoryTypes {
        self.mem_types
            .iter()
            .filter(|(_, f)| f.contains(flags))
            .fold(MemoryTypes::empty(), |acc, (m, _)| acc | m.bit())
    }

    /// Memory types this domain registers (`reg_mem_types`).
    pub fn reg_mem_types(&self) -> MemoryTypes {
        self.types_with(MemTypeFlags::REG)
    }

    /// Memory types this domain's transports access.
    pub fn access_mem_types(&self) -> MemoryTypes {
        self.types_with(MemTypeFlags::ACCESS)
    }
}

bitflags::bitflags! {
    /// Operations and properties of an interface.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct IfaceCaps: u32 {
        /// Active message from a small inline buffer.
        const AM_SHORT = 1 << 0;
        /// Active message copied into a transport buffer.
        const AM_BCOPY = 1 << 1;
        /// Active message sent from registered memory without a copy.
        const AM_ZCOPY = 1 << 2;
        /// Remote write from a small inline buffer.
        const PUT_SHORT = 1 << 3;
        /// Remote write from registered memory.
        const PUT_ZCOPY = 1 << 4;
        /// Remote read into registered memory.
        const GET_ZCOPY = 1 << 5;
        /// Endpoints connect to an interface address.
        const CONNECT_TO_IFACE = 1 << 8;
        /// Endpoints connect to an endpoint address (pairwise wire-up).
        const CONNECT_TO_EP = 1 << 9;
        /// Peer failures are detected and reported as endpoint errors.
        const ERRHANDLE_PEER_FAILURE = 1 << 12;
        /// The transport reaches only its own process.
        const LOOPBACK = 1 << 13;
        /// Zero-copy operations are copies this process runs itself (a copy engine): each one
        /// reads or writes the local buffer until its completion is reported, and that
        /// completion always comes, whatever happens to the peer or the endpoint (an operation
        /// towards a failed peer still completes, perhaps with an error). A request that ends
        /// early waits for such operations before it lets go of its buffer.
        const LOCAL_COPY = 1 << 14;
    }
}

/// Kind of device behind an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceType {
    /// A network (reaches other hosts).
    Network,
    /// Shared memory between processes of one host.
    IntraNode,
    /// An accelerator copy engine.
    Accelerator,
    /// Inside one process.
    Loopback,
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceType::Network => "network",
            DeviceType::IntraNode => "intra-node",
            DeviceType::Accelerator => "accelerator",
            DeviceType::Loopback => "loopback",
        })
    }
}

/// Size limits of an interface's operations (bytes; 0 where the operation is absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IfaceLimits {
    /// Largest `am_short` payload (after the 8-byte header).
    pub am_max_short: usize,
    /// Largest `am_bcopy` message.
    pub am_max_bcopy: usize,
    /// Largest `am_zcopy` payload.
    pub am_max_zcopy: usize,
    /// Largest `am_zcopy` user header.
    pub am_max_hdr: usize,
    /// Largest `put_short`.
    pub put_max_short: usize,
    /// Largest `put_zcopy`.
    pub put_max_zcopy: usize,
    /// Largest `get_zcopy`.
    pub get_max_zcopy: usize,
    /// Most iov entries in one zero-copy operation.
    pub max_iov: usize,
}

/// Performance model of an interface, used by protocol selection.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct PerfModel {
    /// One-way latency, nanoseconds.
    pub latency_ns: f64,
    /// Sender CPU overhead per operation, nanoseconds.
    pub overhead_ns: f64,
    /// Bandwidth in bytes per second.
    pub bandwidth: f64,
}

impl PerfModel {
    /// Estimated time to move `n` bytes in one operation, nanoseconds.
    pub fn time_ns(&self, n: usize) -> f64 {
        let bw = if self.bandwidth > 0.0 {
            n as f64 * 1e9 / self.bandwidth
        } else {
            f64::INFINITY
        };
        self.overhead_ns + self.latency_ns + bw
    }
}

/// Attributes of an interface (one transport on one device).
#[derive(Clone, Debug, PartialEq)]
pub struct IfaceAttr {
    /// Transport name (`self`, `posix`, `tcp`, `cuda_copy`, ...).
    pub tl_name: String,
    /// Device name (`memory`, `lo`, `eth0`, `cuda`, `mlx5_0:1`).
    pub dev_name: String,
    /// Device kind.
    pub dev_type: DeviceType,
    /// System device (PCI bus id) when known.
    pub sys_device: Option<String>,
    /// Operations and properties.
    pub caps: IfaceCaps,
    /// Size limits.
    pub limits: IfaceLimits,
    /// Performance model.
    pub perf: PerfModel,
    /// Preference among devices of the same transport (higher first).
    pub priority: u8,
    /// Packed device address length.
    pub device_addr_len: usize,
    /// Packed interface address length.
    pub iface_addr_len: usize,
    /// Packed endpoint address length (connect-to-ep transports).
    pub ep_addr_len: usize,
    /// Most endpoints, `None` for unlimited.
    pub max_eps: Option<usize>,
}

impl IfaceAttr {
    /// True when every capability in `c` is present.
    pub fn has(&self, c: IfaceCaps) -> bool {
        self.caps.contains(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reg_mem_types_follow_flags() {
        let a = MdAttr::new("x")
            .with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS)
            .with(MemoryType::Cuda, MemTypeFlags::DETECT);
        assert_eq!(a.reg_mem_types(), MemoryTypes::HOST);
        assert_eq!(a.types_with(MemTypeFlags::DETECT), MemoryTypes::CUDA);
        assert_eq!(a.flags(MemoryType::CudaManaged), MemTypeFlags::empty());
        assert_eq!(
            (MemTypeFlags::REG | MemTypeFlags::CACHE).to_string(),
            "reg|cache"
        );
    }

    #[test]
    fn perf_model_grows_with_size() {
        let p = PerfModel {
            latency_ns: 1000.0,
            overhead_ns: 10.0,
            bandwidth: 1e9,
        };
        assert!(p.time_ns(1 << 20) > p.time_ns(8));
        assert!((p.time_ns(0) - 1010.0).abs() < 1e-9);
        assert!(
            (LinearCost {
                overhead_ns: 5.0,
                per_byte_ns: 0.5
            }
            .at(10)
                - 10.0)
                .abs()
                < 1e-9
        );
    }
}
