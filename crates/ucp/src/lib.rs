//! rucx-ucp: the protocol layer users program against.
//!
//! - [`Context`]: discovered resources (filtered by `RUCX_TLS`) and the live registration table
//!   (`reg_domains[mem_type]`) that runtime demotion edits;
//! - [`Worker`]: interfaces and progress, its packed [`address`](Worker::address), endpoints
//!   ([`EpId`]) created from a peer's address;
//! - [`Scope`] and [`Request`]: non-blocking tag send/receive, put/get and flush on borrowed
//!   buffers, polled, waited on, or `.await`ed;
//! - [`OwnedRequest`]: tag send/receive on owned buffers (`Vec<u8>`, `bytes`, GPU buffers,
//!   [`RawBuf`]) that may outlive any scope, with a future, a completion callback and cancel
//!   ([`owned`]);
//! - tag matching with MPI semantics ([`matching`]), active messages
//!   ([`Worker::am_send`], [`Worker::set_am_handler`]), remote memory access
//!   ([`Worker::mem_map`], [`Worker::rkey_unpack`]);
//! - protocols selected per size from the transports' attributes ([`proto`]): eager short,
//!   copy-in single and multi-fragment, zero-copy, and rendezvous by read, by write or streamed.
//!
//! This crate sees only the `rucx-uct` traits and attributes; the list of components comes from
//! the caller (`rucx-transports`).

pub mod address;
mod buf;
pub mod config;
pub mod context;
mod listener;
pub mod matching;
pub mod owned;
pub mod plan;
pub mod proto;
mod scope;
mod slab;
mod spare;
pub mod wire;
mod worker;

pub use buf::{RecvBuf, SendBuf};
pub use config::CONFIG;
pub use context::{Context, Demotion, HostAlloc, Refusal, RegGuard};
pub use listener::{ConnRequest, ConnectOpts, HANDSHAKE_TIMEOUT, Listener, MAX_HANDSHAKES};
pub use matching::Tag;
pub use owned::{OwnedHandle, OwnedRequest, Progressing};
pub use plan::{EpPlan, PathInfo};
pub use rucx_ucs::{OwnedBuf, OwnedBufMut, RawBuf};
pub use scope::{Request, Scope, wait_all, wait_all_timeout, wait_any, wait_any_timeout};
pub use worker::{
    AmMessage, AmPayload, AmRemoteData, AtomicOp, AtomicWord, CloseMode, Completion, EpId, MemMap,
    POLL_ONLY_TICK, Queued, QueuedReq, RkeyBundle, WAIT_TICK, Worker,
};

/// What `docs/architecture.md` says of [`Context`]'s registration: `can_register`,
/// `reg_domains`, `demote`, `demotions` and `refusals` are public, `register` is crate-private
/// (requests register their buffers themselves), so an application cannot call it:
///
/// ```compile_fail,E0624
/// fn register_by_hand(ctx: &rucx_ucp::Context, region: rucx_uct::MemRegion) {
///     let _ = ctx.register(0, region);
/// }
/// ```
///
/// ```
/// fn ask(ctx: &rucx_ucp::Context) {
///     let _ = ctx.can_register(0, rucx_ucs::MemoryType::Host, None);
///     let _ = ctx.reg_domains(rucx_ucs::MemoryType::Cuda, Some(0));
///     let _ = (ctx.demotions(), ctx.refusals());
/// }
/// ```
#[cfg(doctest)]
pub struct ArchitectureClaims;

/// Mask that matches only the exact tag.
pub const TAG_MASK_FULL: Tag = u64::MAX;
/// Mask that matches any tag.
pub const TAG_MASK_ANY: Tag = 0;
