//! A libucp-compatible C ABI over rucx: built as `libucp.so.0` (with thin `libucs.so.0`,
//! `libuct.so.0` and `libucm.so.0` next to it, see `build-libs.sh`), it lets unmodified Open
//! MPI programs (`--mca pml ucx`) run over rucx. What is implemented and what is refused, and
//! how: `docs/c-abi.md`.
//!
//! - [`types`]: UCX's public structs, enums and flags, `#[repr(C)]`, with layout tests;
//! - [`status`]: `ucs_status_t`, its strings and the status-in-pointer convention;
//! - `config`, `context`, `worker`, `endpoint`: the objects (`ucp_config_t`, `ucp_context_h`,
//!   `ucp_worker_h`, `ucp_ep_h`) as boxed Rust values behind opaque pointers;
//! - `request`: request memory (UCX's layout: the pointer handed out is the caller's
//!   `request_size` area, this library's header sits right before it), completion and callbacks;
//! - `tag`, `datatype`: tag send/receive/probe in their nb, nbr and nbx forms, contiguous and
//!   generic datatypes; `iov`: IOV datatypes, in every call that takes a datatype;
//! - `listener`, `stream`, `am`, `wait` (with `nbx`, `extra`, `types_more`): client/server
//!   connection establishment, streams, active messages and wake-up, what UCX's own examples
//!   (`ucp_hello_world`, `ucp_client_server`) call;
//! - [`rma`]: memory mapping, remote keys, puts, gets and atomics (what Open MPI's osc/ucx,
//!   spml/ucx, atomic/ucx and sshmem/ucx call);
//! - `ucm`: the memory-event hooks Open MPI's common/ucx calls.
//! - `compat`: the rest of UCX's public ucp calls (the blocking and callback forms old programs
//!   use, queries, printing), so that every symbol a program linked against UCX names is here.
//!
//! Every function taking pointers from C checks them for NULL and unknown `field_mask` bits and
//! returns `UCS_ERR_INVALID_PARAM` instead of guessing. Objects are single-threaded like the
//! rucx worker behind them (`UCS_THREAD_MODE_SINGLE`); Open MPI then refuses
//! `MPI_THREAD_MULTIPLE` itself.

mod am;
mod compat;
#[cfg(test)]
mod compat_tests;
mod config;
mod context;
mod datatype;
mod endpoint;
mod engine;
mod extra;
mod flush;
mod info;
mod iov;
mod listener;
mod memtype;
mod nbx;
mod request;
pub mod rma;
#[cfg(test)]
mod rma_tests;
pub mod status;
mod stream;
mod tag;
pub mod types;
mod types_more;
mod ucm;
mod wait;

#[cfg(test)]
mod abi_tests;
#[cfg(test)]
mod cs_conn_tests;
#[cfg(test)]
mod cs_tests;
#[cfg(test)]
mod iov_tests;
#[cfg(test)]
mod test_util;
mod worker;

pub use request::HEADER_SIZE;

use rucx_ucs::{OptKind, OptionSpec};

/// Options of this library (declared so that `RUCX_ABI_*` variables are not warned about as
/// typos).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "ABI_ANNOUNCE",
        kind: OptKind::Bool,
        default: "n",
        help: "Print one line to stderr when a program initializes rucx's libucp (the test \
               harness asserts that Open MPI loaded it and not another libucp).",
    },
    OptionSpec {
        name: "ABI_MEMTYPE_CACHE",
        kind: OptKind::Bool,
        default: "y",
        help: "Remember which posted buffers' address ranges are host memory, so that a GPU \
               domain is asked once per range instead of once per message (UCX's \
               UCX_MEMTYPE_CACHE). n: classify every buffer (memory unmapped without \
               ucm_vm_munmap and remapped as GPU memory at the same address is then never \
               mistaken for host memory).",
    },
];

/// Every option table: rucx's and this library's.
pub fn config_tables() -> Vec<&'static [OptionSpec]> {
    let mut t = rucx::config_tables();
    t.push(CONFIG);
    t
}
