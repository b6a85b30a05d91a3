//! rucx ib component: RDMA verbs.
//!
//! - Discovery ([`probe`]): devices, ports, state, link layer, GIDs, MTU, speed; one UCT device
//!   per ACTIVE port (`mlx5_0:1`), one memory domain per device (`mlx5_0`). Without libibverbs,
//!   without an RDMA driver or without an ACTIVE port the component is *unavailable* with the
//!   exact reason, and nothing else is affected: libibverbs is loaded at run time.
//! - Memory domain ([`md::IbMd`]): host registration; GPU memory through dma-buf or the
//!   peer-memory module as decided per GPU ([`gpudirect`], `RUCX_IB_GPU_DIRECT_RDMA`); driver
//!   failures become typed registration errors ([`regerr`]) the planner demotes on.
//! - Transport `rc_verbs` ([`rc`]): reliable-connected QPs wired endpoint to endpoint, active
//!   messages over send/receive with credit flow control, put/get zero-copy as RDMA write/read;
//!   a sleeping caller is woken through a completion channel (its descriptor is the event source).
//!
//! Every verbs call goes through the [`verbs::Verbs`] traits: the real implementation is
//! [`sys::SystemVerbs`]; the `fake` module (feature `fake-fabric`, always in this crate's tests)
//! is a software fabric with the same semantics, which is how the transport is tested on machines
//! without an RDMA NIC. See this crate's README for what has run on hardware.

pub mod attr;
pub mod component;
pub mod config;
#[cfg(any(test, feature = "fake-fabric"))]
pub mod fake;
pub mod gpudirect;
pub mod md;
pub mod probe;
pub mod rc;
pub mod regerr;
pub mod sys;
pub mod verbs;

pub use component::IbComponent;
pub use config::CONFIG;
pub use gpudirect::{DmaBuf, GpuFacts, GpuSupport};
pub use md::IbMd;
