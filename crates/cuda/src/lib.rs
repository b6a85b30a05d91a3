//! rucx CUDA services: the one place that loads the CUDA driver API and NVML at run time.
//!
//! - [`driver()`]: `libcuda` loaded and initialized once; a missing or too-old driver, or no
//!   device, is [`Error::Unavailable`](rucx_ucs::Error::Unavailable) with the reason, never a
//!   panic or a link error. Safe wrappers for what transports need: primary contexts
//!   ([`PrimaryContext`]), [`Stream`]s and [`Event`]s, device / stream-ordered-pool / managed /
//!   pinned-host allocations, host registration, copies. [`sys`] re-exports the raw bindings
//!   for everything else, and [`check`] turns a `CUresult` into a typed error.
//! - [`calls`](mod@calls): how often rucx called each driver entry point (every call goes through
//!   [`cu!`]), and how long it spent inside them when asked.
//! - [`pointer`](mod@pointer): what kind of memory a buffer is, which device owns it, its allocation, whether
//!   it can be exported (legacy IPC, dma-buf), with a cache.
//! - [`report`](mod@report): the per-GPU GPU-direct report (BAR1, GPUDirect RDMA, dma-buf, peer memory,
//!   gdrcopy, NICs and PCI paths, NVLink/P2P) with a verdict and reasons per path.
//!
//! Building and starting need no CUDA installation.

pub mod calls;
pub mod driver;
pub mod kernel;
pub mod nvml;
pub mod pointer;
pub mod report;
pub mod sysfs;

/// The raw CUDA driver API bindings (loaded at run time). Call [`driver()`] first: it makes sure
/// the library is present and initialized; calling into `sys` without that aborts the process.
pub use cudarc::driver::sys;

pub use driver::{
    DeviceBuffer, DeviceInfo, Driver, Event, HostRegistration, ManagedBuffer, PinnedHostBuffer,
    PoolBuffer, PrimaryContext, Stream, check, cuda_error, device_label, driver, is_available,
    memcpy, memcpy_async, reg_error_kind, result_name,
};
pub use kernel::{CompletionWord, CopyKernel, SmallCopies};
pub use pointer::{PointerCache, PointerInfo, PtrKind, classify};
pub use report::{
    GpuFacts, HostFacts, NicFacts, NvlinkPath, PathVerdict, PeerFacts, Report, Verdict, report,
};

use rucx_ucs::{Bounds, OptKind, OptionSpec};

/// Options of this crate (names without the `RUCX_` prefix).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "CUDA_POINTER_CACHE",
        kind: OptKind::Bool,
        default: "y",
        help: "Cache CUDA pointer classifications by allocation range. rucx invalidates entries \
               when it frees its own allocations; set to n if the application frees and \
               reallocates CUDA memory itself and buffers are misclassified.",
    },
    OptionSpec {
        name: "CUDA_CALL_TIMING",
        kind: OptKind::Bool,
        default: "n",
        help: "Measure the wall time of every CUDA driver call next to counting it (rucx_cuda::\
               calls; rucx-perftest prints both per iteration). Costs two clock reads per call.",
    },
    OptionSpec {
        name: "CUDA_COPY_KERNEL_MAX",
        kind: OptKind::MemIn(Bounds::new(0, 1 << 20)),
        default: "64K",
        help: "Device-to-device copies of at most this many bytes (both ends in memory of the \
               stream's GPU) run as a one-block copy kernel instead of cuMemcpyAsync: about 2 us \
               less per small GPU message on an H200. 0 turns it off.",
    },
    OptionSpec {
        name: "CUDA_COMPLETION_WORDS",
        kind: OptKind::Bool,
        default: "y",
        help: "See the end of CUDA copies through a word the GPU writes into pinned host memory \
               (one load per poll) instead of recording and querying an event (a driver call \
               per poll). n: events.",
    },
];
