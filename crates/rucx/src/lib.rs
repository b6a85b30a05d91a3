//! rucx: a communication framework in the tradition of UCX, for clusters where GPUs differ.
//!
//! Most programs need three things:
//!
//! ```no_run
//! # fn main() -> rucx::Result<()> {
//! let job = rucx::Job::from_env()?;          // rank, size, peers, from the launcher
//! let w = job.worker();
//! let peer = job.ep((job.rank() + 1) % job.size());
//! let data = vec![1u8; 4096];
//! let mut got = vec![0u8; 4096];
//! w.scope(|s| {
//!     let r = s.tag_recv(&mut got, 7, rucx::TAG_MASK_FULL);
//!     s.tag_send(peer, &data, 7).wait()?;
//!     r.wait()
//! })?;
//! # Ok(()) }
//! ```
//!
//! GPU buffers ([`cuda::DeviceBuffer`], [`cuda::PoolBuffer`], [`cuda::ManagedBuffer`],
//! [`cuda::PinnedHostBuffer`]) go the same way, without `unsafe`: they implement [`Memory`], so `&buf`
//! sends, `&mut buf` receives, and `buf.slice(a..b)` / `buf.slice_mut(a..b)` name a part (the
//! `gpu_hello` example, and the README).
//!
//! Requests that must outlive a scope (a service keeping receives posted, a future handed to
//! another task, a C caller's pointer) own their buffer instead: [`Worker::tag_send_owned`] and
//! [`Worker::tag_recv_owned`] take a `Vec<u8>`, `bytes::Bytes`/`BytesMut`, a GPU buffer or a
//! [`RawBuf`], and the [`OwnedRequest`] hands it back with the result ([`ucp::owned`]).
//!
//! Lower layers are re-exported: [`ucs`] (errors, configuration), [`uct`] (transports),
//! [`ucp`] (protocols), [`cuda`] (the CUDA driver, GPU buffers, pointer classification).

pub mod bootstrap;
pub mod drive;
#[cfg(feature = "tokio")]
pub mod tokio;

/// The README's Rust snippets, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeSnippets;

pub use bootstrap::Job;
pub use drive::block_on;
pub use rucx_cuda as cuda;
pub use rucx_ucp as ucp;
pub use rucx_ucp::{
    AmMessage, AmPayload, AmRemoteData, AtomicOp, AtomicWord, CloseMode, Completion, Context,
    Demotion, EpId, HostAlloc, MemMap, OwnedHandle, OwnedRequest, Progressing, RecvBuf, Request,
    RkeyBundle, Scope, SendBuf, TAG_MASK_ANY, TAG_MASK_FULL, Tag, Worker, wait_all,
    wait_all_timeout, wait_any, wait_any_timeout,
};
pub use rucx_ucs as ucs;
pub use rucx_ucs::{
    Error, MemInfo, MemMut, MemRef, Memory, MemoryType, OwnedBuf, OwnedBufMut, RawBuf, Result,
};
pub use rucx_uct as uct;

use rucx_ucs::{Config, OptionSpec};

/// Every option table: services, transports, components, protocols, launcher.
pub fn config_tables() -> Vec<&'static [OptionSpec]> {
    let mut t = rucx_transports::config_tables();
    t.push(rucx_ucp::CONFIG);
    t.push(bootstrap::CONFIG);
    t
}

/// The configuration from `RUCX_*` environment variables, validated.
pub fn config_from_env() -> Result<Config> {
    Config::from_env(&config_tables())
}

/// A context over every compiled-in transport, configured from the environment.
pub fn context_from_env() -> Result<Context> {
    Context::new(&rucx_transports::registry(), config_from_env()?)
}

/// A context over every compiled-in transport with an explicit configuration (build it with
/// `Config::new(&rucx::config_tables())` and `set`).
pub fn context(config: Config) -> Result<Context> {
    Context::new(&rucx_transports::registry(), config)
}
