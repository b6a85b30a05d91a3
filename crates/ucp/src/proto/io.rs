//! The narrow I/O the protocols act through: post a transport operation (counted in its request,
//! with a completion token), register a buffer through the context's one register path (which
//! demotes the domain or refuses the buffer, and warns once), and queue a control message behind
//! a peer's other messages. The worker's state implements it over real interfaces; the harness
//! (`crates/ucp/tests/harness`) drives it over the simulated fabric.

use rucx_ucs::{MemoryType, Result};
use rucx_uct::{Endpoint, MemHandle, MemRegion, OpStatus, RemoteKey};

use crate::context::RegGuard;
use crate::proto::rndv::{RndvPick, SendHead};
use crate::wire::{Msg, NamedKey};

/// What a protocol asks of the worker.
pub(crate) trait ProtoIo {
    /// Post one operation on `lane` to peer `p` for request `req`; an operation in progress is
    /// counted in the request until its completion comes. `Ok(false)`: the transport pushed
    /// back (nothing happened; call again after progress).
    fn post(
        &mut self,
        req: u64,
        p: usize,
        lane: usize,
        op: impl FnOnce(&mut dyn Endpoint, u64) -> Result<OpStatus>,
    ) -> Result<bool>;

    /// Register `region` with the domain of `lane` for request `req` (the registration is
    /// released with the request). A failure demotes the domain (or refuses the buffer) and
    /// warns, through the context; the plan made after it no longer offers what failed.
    fn register(&mut self, req: u64, lane: usize, region: MemRegion) -> Result<()>;

    /// Register `region` with domain `md` (kept by the caller).
    fn register_md(&mut self, md: usize, region: MemRegion) -> Result<RegGuard>;

    /// Whether domain `md` may register `mem` memory of `dev` now (not demoted).
    fn may_register(&self, md: usize, mem: MemoryType, dev: Option<u32>) -> bool;

    /// Unpack a key the peer packed with domain `md`'s counterpart.
    fn unpack_key(&self, md: usize, key: &[u8]) -> Result<RemoteKey>;

    /// Pack our registration `g` with domain `md` for the peer (named by the domain).
    fn pack_key(&self, md: usize, g: &RegGuard) -> Result<NamedKey>;

    /// Send control message `m` to peer `p`, behind its other messages (at once when nothing
    /// is queued before it, queued otherwise).
    fn ctrl(&mut self, p: usize, m: &Msg<'_>);

    /// This worker's id: the source of every message it sends.
    fn uuid(&self) -> u64;

    /// Count one run of `what` (a protocol, or how a rendezvous receive moved its data).
    fn count(&mut self, what: &'static str);

    /// The domain of `lane`.
    fn lane_md(&self, lane: usize) -> usize;

    /// Keep only request `req`'s registrations with domain `md` (none: drop them all).
    fn keep_regs(&mut self, req: u64, md: Option<usize>);

    /// Operations of request `req` posted with [`Self::post`] and still in progress.
    fn outstanding(&self, req: u64) -> usize;

    /// A new id for a multi-fragment message to peer `p`.
    fn next_msg(&mut self, p: usize) -> u64;
}

/// What the send side of a rendezvous asks of the worker besides [`ProtoIo`]: the plan's
/// choice for a send (re-made after a demotion), and the registrations a send holds.
pub(crate) trait SendIo: ProtoIo {
    /// The protocol and lane the plan gives rendezvous send `req` (`head`) now; with `replan`,
    /// the plan is made again first when the registration view changed (a registration failed
    /// and demoted, or the send waited for a lane), and the protocol is selected again from
    /// the table of the send's operation (a rendezvous stays one: its receiver may already have
    /// matched it).
    fn rndv_pick(&mut self, req: u64, head: &SendHead, replan: bool) -> RndvPick;

    /// Pack request `req`'s registration with domain `md` for the peer.
    fn req_key(&self, req: u64, md: usize) -> Result<NamedKey>;

    /// Request `req`'s registration with domain `md`, if it holds one.
    fn reg(&self, req: u64, md: usize) -> Option<MemHandle>;

    /// Register send `req`'s buffer as the source of writes on `lane` (with the lane's domain,
    /// or, where the domain reaches that memory without registering it, described for this
    /// request alone).
    fn register_write_source(&mut self, req: u64, lane: usize) -> Result<()>;

    /// Make peer `p`'s plan again if the registration view changed.
    fn replan_peer(&mut self, p: usize);

    /// The marker a host send to peer `p` carries when we can write into its GPU memory.
    fn write_hint(&self, p: usize) -> Option<NamedKey>;

    /// The marker a GPU send (device `dev`, keyed for reads on `lane`) to peer `p` carries when
    /// this worker is the pair's copier on a shared GPU (`gpu/write.rs`).
    fn shared_gpu_hint(&self, p: usize, dev: Option<u32>, lane: usize) -> Option<NamedKey>;
}
