//! The `rc_verbs` transport: reliable-connected queue pairs through the [`crate::verbs::Verbs`] seam.
//!
//! - Connection: endpoint to endpoint. Each side creates an endpoint with an empty interface
//!   address (its QP is created and moved to INIT, receive buffers are posted), exchanges
//!   [`Iface::device_address`] and [`Endpoint::ep_address`] out of band, and calls
//!   [`Endpoint::connect_to_ep`], which moves the QP through RTR to RTS.
//! - Active messages: sends into the peer's pre-posted receive buffers, paced by credits
//!   ([`flow::Credits`]); the receiver re-posts each buffer after handing the message to the
//!   sink and returns credits on its own messages or in grant messages.
//! - Put/get zero-copy: RDMA write/read from the caller's registered buffers; `put_short` copies
//!   into a registered bounce buffer first.
//! - Every work request is signaled; [`Iface::progress`] polls the completion queue, frees
//!   buffers and send slots, completes tokens and flushes, and turns error completions into one
//!   [`Event::EpError`] per endpoint plus failed completions for its pending tokens.
//! - Sleeping: the CQ is created on a completion channel whose descriptor is the interface's
//!   [`EventSource::Fd`]. [`Iface::arm`] takes the channel's events and acknowledges them in one
//!   call (busy if there were any), arms the CQ and polls it once more, since a completion that
//!   arrived before the CQ was armed raises no event; what that poll finds is kept and handed
//!   out first by the next progress (the arm is busy). A device without completion channels
//!   leaves the interface [`EventSource::PollOnly`], with one warning per device.
//!
//! All state of an interface and its endpoints sits behind one mutex that is never held while
//! the progress sink or a bcopy pack callback runs.

pub mod addr;
#[cfg(test)]
mod fabric_tests;
pub mod flow;
pub mod wire;

use std::alloc::Layout;
use std::collections::VecDeque;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use rucx_ucs::{Error, Result};
use rucx_uct::iface::{AM_ID_MAX, check_packed};
use rucx_uct::{
    AmId, Endpoint, EpParams, Event, EventSource, Iface, IfaceAttr, Iov, MemHandle, OpStatus,
    RemoteKey,
};

use crate::attr::{MAX_IOV, path_mtu, rc_iface_attr, rx_slots, select_gid};
use crate::config::{IbConfig, RcConfig};
use crate::md::{IbMemh, IbRkey};
use crate::probe::port_name;
use crate::verbs::{
    Access, CompChannel, Cq, DeviceAttrs, Grh, LinkLayer, Mr, PortAttrs, Qp, QpCaps, RcConnect,
    SendOp, SendWr, Sge, VerbsDevice, VerbsError, Wc, WcStatus,
};
use addr::{DeviceAddr, EpAddr, MAX_24};
use flow::{Credits, SendSlots};
use wire::{HDR_LEN, Header};

/// Completions taken per poll.
const POLL_BATCH: usize = 32;
/// RNR NAK timer code 12: 0.64 ms.
const MIN_RNR_TIMER: u8 = 12;
/// Hop limit of routed packets.
const HOP_LIMIT: u8 = 64;
/// Sequence numbers of send work requests are 31 bits.
const SEQ_MASK: u32 = 0x7fff_ffff;
const RECV_BIT: u64 = 1 << 31;

/// Page-aligned host memory the NIC reads and writes (bounce and receive buffers).
struct DmaMem {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: DmaMem is a plain heap allocation; which parts are read or written when is decided by
// the slot protocol under the interface mutex (a slot is touched by the CPU only while the NIC
// does not own it), so sharing the pointer across threads is sound.
unsafe impl Send for DmaMem {}
// SAFETY: see Send; shared references only hand out slices of slots the caller owns.
unsafe impl Sync for DmaMem {}

impl DmaMem {
    fn new(len: usize) -> Result<DmaMem> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::InvalidParam(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::NoMemory(format!(
                "{len} bytes of rc_verbs receive and bounce buffers"
            ))
        })?;
        Ok(DmaMem { ptr, layout })
    }

    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    /// # Safety
    /// `[off, off+len)` must be inside the allocation and not written by the NIC or anyone
    /// else while the slice lives.
    unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        debug_assert!(off + len <= self.len());
        // SAFETY: in bounds and not concurrently written, by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// # Safety
    /// `[off, off+len)` must be inside the allocation and used by nobody else (CPU or NIC)
    /// while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        debug_assert!(off + len <= self.len());
        // SAFETY: in bounds and exclusively ours, by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for DmaMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl fmt::Debug for DmaMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DmaMem({:#x}+{})", self.addr(), self.len())
    }
}

/// A work request id: endpoint index, generation, receive flag, sequence or slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WrId {
    ep: u16,
    epoch: u16,
    recv: bool,
    n: u32,
}

impl WrId {
    fn encode(self) -> u64 {
        (u64::from(self.ep) << 48)
            | (u64::from(self.epoch) << 32)
            | if self.recv { RECV_BIT } else { 0 }
            | u64::from(self.n & SEQ_MASK)
    }

    fn decode(v: u64) -> WrId {
        WrId {
            ep: (v >> 48) as u16,
            epoch: (v >> 32) as u16,
            recv: v & RECV_BIT != 0,
            n: (v as u32) & SEQ_MASK,
        }
    }
}

/// `a` is at or after `b` in the 31-bit sequence space.
fn seq_reached(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) & SEQ_MASK) < (1 << 30)
}

#[derive(Debug)]
enum OpKind {
    /// A bounce buffer (short, bcopy, put_short, grant) to free on completion.
    Tx(u32),
    /// An operation with a completion token; holds the caller's registrations until then.
    Token {
        token: u64,
        tx: Option<u32>,
        _hold: Vec<MemHandle>,
    },
}

#[derive(Debug)]
struct Op {
    seq: u32,
    kind: OpKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum EpState {
    Created,
    Connected,
    Failed(String),
}

#[derive(Debug)]
struct EpSlot {
    // Field order is drop order: the QP goes before the region its buffers are registered in.
    qp: Box<dyn Qp>,
    mr: Box<dyn Mr>,
    mem: Arc<DmaMem>,
    epoch: u16,
    user_id: u64,
    psn: u32,
    state: EpState,
    error_reported: bool,
    peer: String,
    tx_free: Vec<u32>,
    credits: Option<Credits>,
    peer_seg: usize,
    sq: SendSlots,
    ops: VecDeque<Op>,
    next_seq: u32,
    flushes: VecDeque<(u32, u64)>,
    fence_next: bool,
}

impl EpSlot {
    fn failure(&self) -> Error {
        let reason = match &self.state {
            EpState::Failed(r) => r.clone(),
            _ => "not failed".into(),
        };
        Error::EndpointFailure {
            peer: self.peer.clone(),
            reason,
        }
    }
}

/// Something to hand to the sink once the lock is released.
enum Out {
    Am {
        ep: u16,
        epoch: u16,
        id: AmId,
        mem: Arc<DmaMem>,
        off: usize,
        len: usize,
        slot: u32,
    },
    Completion {
        token: u64,
        result: Result<()>,
    },
    EpError {
        user_id: u64,
        error: Error,
    },
}

#[derive(Debug)]
struct RcCore {
    dev: Arc<dyn VerbsDevice>,
    cq: Arc<dyn Cq>,
    dev_name: String,
    port: PortAttrs,
    dev_attrs: DeviceAttrs,
    local: DeviceAddr,
    gid_index: u8,
    ib: IbConfig,
    cfg: RcConfig,
    rx_n: u32,
    eps: Vec<Option<EpSlot>>,
    epochs: Vec<u16>,
    live: usize,
    max_eps: usize,
    wc: Vec<Wc>,
    /// Completions `arm` polled (after arming the CQ): handled first by the next progress.
    stash: Vec<Wc>,
}

fn device_err(dev: &str, e: &VerbsError) -> Error {
    Error::Device {
        device: dev.to_string(),
        reason: e.to_string(),
    }
}

fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() as u32) & MAX_24
}

impl RcCore {
    fn slot(&mut self, ep: u16, epoch: u16) -> Option<&mut EpSlot> {
        self.eps
            .get_mut(usize::from(ep))?
            .as_mut()
            .filter(|s| s.epoch == epoch)
    }

    /// The slot of a connected, healthy endpoint, or the error to return.
    fn live_slot(&mut self, ep: u16, epoch: u16) -> Result<&mut EpSlot> {
        let s = self.slot(ep, epoch).ok_or_else(|| {
            Error::Internal("rc_verbs endpoint slot vanished while the endpoint exists".into())
        })?;
        match &s.state {
            EpState::Connected => Ok(s),
            EpState::Created => Err(Error::InvalidParam(
                "rc_verbs endpoint is not connected yet: pass the peer's device and endpoint \
                 addresses to connect_to_ep first"
                    .into(),
            )),
            EpState::Failed(_) => Err(s.failure()),
        }
    }

    fn seg(&self) -> usize {
        self.cfg.seg_size
    }

    fn tx_off(&self, slot: u32) -> usize {
        (self.rx_n + slot) as usize * self.seg()
    }

    fn rx_off(&self, slot: u32) -> usize {
        slot as usize * self.seg()
    }

    fn post_recv(&mut self, ep: u16, epoch: u16, slot: u32) -> std::result::Result<(), VerbsError> {
        let (off, seg) = (self.rx_off(slot), self.seg());
        let Some(s) = self.slot(ep, epoch) else {
            return Ok(());
        };
        let sge = Sge {
            addr: (s.mem.addr() + off) as u64,
            length: seg as u32,
            lkey: s.mr.lkey(),
        };
        let id = WrId {
            ep,
            epoch,
            recv: true,
            n: slot,
        };
        // SAFETY: the slot lies in `s.mem`, which is registered (`s.mr`) and outlives the QP
        // (field order of EpSlot); the slot is owned by the NIC until its completion.
        unsafe { s.qp.post_recv(id.encode(), &[sge]) }
    }

    /// Post one send work request for endpoint `(ep, epoch)`. On failure the bounce buffer of
    /// `kind` is freed and the send slot returned.
    fn post(&mut self, ep: u16, epoch: u16, op: SendOp, sges: &[Sge], kind: OpKind) -> Result<()> {
        let dev_name = self.dev_name.clone();
        let s = self.live_slot(ep, epoch)?;
        let free_tx = |s: &mut EpSlot, kind: &OpKind| match kind {
            OpKind::Tx(t) | OpKind::Token { tx: Some(t), .. } => s.tx_free.push(*t),
            OpKind::Token { tx: None, .. } => {}
        };
        if !s.sq.take() {
            free_tx(s, &kind);
            return Err(Error::NoResource(format!(
                "send queue of {} endpoint full",
                dev_name
            )));
        }
        let seq = s.next_seq;
        let fence = std::mem::take(&mut s.fence_next);
        let wr = SendWr {
            wr_id: WrId {
                ep,
                epoch,
                recv: false,
                n: seq,
            }
            .encode(),
            op,
            sges,
            signaled: true,
            fence,
        };
        // SAFETY: every SGE lies in memory registered with this device (our bounce buffers in
        // `s.mem`, or the caller's registrations, whose handles `kind` holds until the
        // completion) and stays valid until the completion is polled.
        match unsafe { s.qp.post_send(&wr) } {
            Ok(()) => {
                s.next_seq = (seq + 1) & SEQ_MASK;
                s.ops.push_back(Op { seq, kind });
                Ok(())
            }
            Err(e) => {
                s.sq.give();
                s.fence_next = fence;
                free_tx(s, &kind);
                Err(match e.errno {
                    libc::ENOMEM => Error::NoResource(format!("{dev_name}: {e}")),
                    libc::EINVAL => Error::InvalidParam(format!("{dev_name}: {e}")),
                    _ => Error::EndpointFailure {
                        peer: s.peer.clone(),
                        reason: e.to_string(),
                    },
                })
            }
        }
    }

    fn fail(s: &mut EpSlot, reason: String, out: &mut Vec<Out>) {
        if !matches!(s.state, EpState::Failed(_)) {
            s.state = EpState::Failed(reason);
        }
        if !s.error_reported {
            s.error_reported = true;
            out.push(Out::EpError {
                user_id: s.user_id,
                error: s.failure(),
            });
        }
    }

    /// Complete the flushes that the completion of `seq` satisfies.
    fn complete_flushes(s: &mut EpSlot, seq: Option<u32>, out: &mut Vec<Out>) {
        while let Some(&(last, token)) = s.flushes.front() {
            let done = match (seq, s.ops.front()) {
                (_, None) => true,
                (Some(c), Some(_)) => seq_reached(c, last),
                (None, Some(_)) => false,
            };
            if !done {
                break;
            }
            s.flushes.pop_front();
            let result = match s.state {
                EpState::Failed(_) => Err(s.failure()),
                _ => Ok(()),
            };
            out.push(Out::Completion { token, result });
        }
    }

    fn on_send_wc(&mut self, id: WrId, wc: &Wc, out: &mut Vec<Out>) {
        let Some(s) = self.slot(id.ep, id.epoch) else {
            return;
        };
        // Completions of one send queue arrive in posting order; tolerate anything else.
        let pos = s.ops.iter().position(|o| o.seq == id.n);
        let op = match pos {
            Some(0) => s.ops.pop_front(),
            Some(i) => s.ops.remove(i),
            None => None,
        };
        s.sq.give();
        if wc.status != WcStatus::Success {
            let reason = if wc.status == WcStatus::WrFlushErr {
                wc.status.describe()
            } else {
                format!(
                    "{} (vendor error {:#x})",
                    wc.status.describe(),
                    wc.vendor_err
                )
            };
            Self::fail(s, reason, out);
        }
        if let Some(op) = op {
            match op.kind {
                OpKind::Tx(t) => s.tx_free.push(t),
                OpKind::Token { token, tx, .. } => {
                    if let Some(t) = tx {
                        s.tx_free.push(t);
                    }
                    let result = if wc.status == WcStatus::Success {
                        Ok(())
                    } else {
                        Err(s.failure())
                    };
                    out.push(Out::Completion { token, result });
                }
            }
        }
        Self::complete_flushes(s, Some(id.n), out);
    }

    fn on_recv_wc(&mut self, id: WrId, wc: &Wc, out: &mut Vec<Out>) {
        let (seg, off) = (self.seg(), self.rx_off(id.n));
        let Some(s) = self.slot(id.ep, id.epoch) else {
            return;
        };
        if wc.status != WcStatus::Success {
            if wc.status != WcStatus::WrFlushErr {
                let reason = format!("receive failed: {}", wc.status.describe());
                Self::fail(s, reason, out);
            }
            return;
        }
        let len = (wc.byte_len as usize).min(seg);
        // SAFETY: the NIC completed this receive, so the slot is ours until re-posted, and its
        // first `byte_len` bytes hold the message.
        let msg = unsafe { s.mem.slice(off, len) };
        match Header::decode(msg) {
            None => {
                let reason = format!("malformed message of {len} bytes from the peer");
                Self::fail(s, reason, out);
            }
            Some(Header::Grant { credits }) => {
                if let Some(c) = s.credits.as_mut() {
                    c.credits_received(credits);
                }
                if let Err(e) = self.post_recv(id.ep, id.epoch, id.n)
                    && let Some(s) = self.slot(id.ep, id.epoch)
                {
                    Self::fail(s, format!("re-posting a receive buffer: {e}"), out);
                }
            }
            Some(Header::Am { id: am, credits }) => {
                if let Some(c) = s.credits.as_mut() {
                    c.credits_received(credits);
                }
                if matches!(s.state, EpState::Failed(_)) {
                    return;
                }
                out.push(Out::Am {
                    ep: id.ep,
                    epoch: id.epoch,
                    id: am,
                    mem: s.mem.clone(),
                    off: off + HDR_LEN,
                    len: len - HDR_LEN,
                    slot: id.n,
                });
            }
        }
    }

    /// Re-post a delivered message's buffer and count the credit it frees.
    fn repost_delivered(&mut self, ep: u16, epoch: u16, slot: u32, out: &mut Vec<Out>) {
        match self.post_recv(ep, epoch, slot) {
            Ok(()) => {
                if let Some(c) = self.slot(ep, epoch).and_then(|s| s.credits.as_mut()) {
                    c.buffer_reposted();
                }
            }
            Err(e) => {
                if let Some(s) = self.slot(ep, epoch) {
                    Self::fail(s, format!("re-posting a receive buffer: {e}"), out);
                }
            }
        }
    }

    /// Send grants where credits are due and a send slot and bounce buffer are free.
    fn send_grants(&mut self) {
        for i in 0..self.eps.len() {
            let (tx, epoch, credits) = {
                let Some(s) = self.eps[i].as_mut() else {
                    continue;
                };
                if s.state != EpState::Connected || s.sq.free() == 0 {
                    continue;
                }
                let Some(c) = s.credits.as_mut() else {
                    continue;
                };
                if !c.grant_due() {
                    continue;
                }
                let Some(tx) = s.tx_free.pop() else {
                    continue;
                };
                (tx, s.epoch, c.take_grant())
            };
            let off = self.tx_off(tx);
            let ep = i as u16;
            let Some(s) = self.slot(ep, epoch) else {
                continue;
            };
            // SAFETY: the bounce buffer `tx` was just taken from the free list.
            unsafe { s.mem.slice_mut(off, HDR_LEN) }
                .copy_from_slice(&Header::Grant { credits }.encode());
            let sge = Sge {
                addr: (s.mem.addr() + off) as u64,
                length: HDR_LEN as u32,
                lkey: s.mr.lkey(),
            };
            if self
                .post(ep, epoch, SendOp::Send, &[sge], OpKind::Tx(tx))
                .is_err()
                && let Some(c) = self.slot(ep, epoch).and_then(|s| s.credits.as_mut())
            {
                c.ungrant(credits);
            }
        }
    }
}

/// State shared by an interface and its endpoints.
#[derive(Debug)]
struct Shared {
    core: Mutex<RcCore>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, RcCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An `rc_verbs` interface on one port.
#[derive(Debug)]
pub struct RcIface {
    shared: Arc<Shared>,
    attr: IfaceAttr,
    local: DeviceAddr,
    /// The completion channel the CQ was created on (`None`: none could be made; the
    /// interface is then poll-only).
    channel: Option<Arc<dyn CompChannel>>,
}

/// Whether this is the first time (in this process) that `device` gave no completion
/// channel: the warning is given once per device, not once per interface opened on it.
fn first_poll_only_warning(device: &str) -> bool {
    static WARNED: Mutex<std::collections::BTreeSet<String>> =
        Mutex::new(std::collections::BTreeSet::new());
    WARNED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(device.to_string())
}

impl RcIface {
    /// Open on `port` of an open device.
    pub fn open(
        dev: Arc<dyn VerbsDevice>,
        dev_attrs: &DeviceAttrs,
        port: &PortAttrs,
        ib: &IbConfig,
        cfg: RcConfig,
    ) -> Result<RcIface> {
        let dev_name = port_name(&dev_attrs.name, port.port_num);
        let gid = select_gid(port, ib.gid)?;
        let local = DeviceAddr {
            link: port.link_layer,
            lid: port.lid,
            gid: gid.gid,
            mtu: port.active_mtu,
        };
        // Wake-ups: the CQ on a completion channel whose descriptor is the event source. A
        // device that cannot make one leaves the interface poll-only (a sleeping worker looks
        // at it every millisecond), which costs CPU but loses nothing.
        let channel = match dev.create_comp_channel() {
            Ok(ch) => Some(ch),
            Err(e) => {
                if first_poll_only_warning(&dev_attrs.name) {
                    tracing::warn!(
                        "{}: no completion channel ({e}); rc_verbs interfaces on it cannot \
                         wake a sleeping worker and are polled instead (warned once per device)",
                        dev_attrs.name
                    );
                }
                None
            }
        };
        let cq = dev
            .create_cq(cfg.cq_len.min(dev_attrs.max_cqe.max(64)), channel.as_ref())
            .map_err(|e| device_err(&dev_name, &e))?;
        let attr = rc_iface_attr(dev_attrs, port, &cfg);
        let core = RcCore {
            dev,
            cq,
            dev_name,
            port: port.clone(),
            dev_attrs: dev_attrs.clone(),
            local,
            gid_index: u8::try_from(gid.index).unwrap_or(0),
            ib: ib.clone(),
            rx_n: rx_slots(&cfg),
            max_eps: attr
                .max_eps
                .unwrap_or(usize::MAX)
                .min(usize::from(u16::MAX)),
            cfg,
            eps: Vec::new(),
            epochs: Vec::new(),
            live: 0,
            wc: Vec::with_capacity(POLL_BATCH),
            stash: Vec::new(),
        };
        Ok(RcIface {
            shared: Arc::new(Shared {
                core: Mutex::new(core),
            }),
            attr,
            local,
            channel,
        })
    }
}

impl Iface for RcIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        self.local.pack()
    }

    fn iface_address(&self) -> Vec<u8> {
        Vec::new()
    }

    fn is_reachable(&self, dev_addr: &[u8], _iface_addr: &[u8]) -> bool {
        DeviceAddr::unpack(dev_addr).is_ok_and(|p| self.local.reaches(&p))
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        if !params.iface_addr.is_empty() {
            return Err(Error::Unsupported {
                what: "rc_verbs connect-to-interface".into(),
                why: "rc_verbs connects endpoint to endpoint: create the endpoint with an empty \
                      iface_addr, exchange ep_address(), then call connect_to_ep()"
                    .into(),
            });
        }
        if !params.dev_addr.is_empty() {
            let peer = DeviceAddr::unpack(&params.dev_addr)?;
            if !self.local.reaches(&peer) {
                return Err(Error::InvalidAddress(format!(
                    "rc_verbs peer ({} link) is not reachable from {} ({} link, other subnet or link layer)",
                    peer.link, self.attr.dev_name, self.local.link
                )));
            }
        }
        let mut core = self.shared.lock();
        if core.live >= core.max_eps {
            return Err(Error::NoResource(format!(
                "{} has {} endpoints, the most its completion queue serves (raise RUCX_RC_CQ_LEN)",
                core.dev_name, core.live
            )));
        }
        let cfg = core.cfg.clone();
        let dev_name = core.dev_name.clone();
        let rx_n = core.rx_n;
        let caps = QpCaps {
            max_send_wr: cfg.tx_depth,
            max_recv_wr: rx_n,
            max_send_sge: (core.dev_attrs.max_sge as usize).clamp(2, MAX_IOV) as u32,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut qp = core
            .dev
            .create_rc_qp(&core.cq, &caps)
            .map_err(|e| device_err(&dev_name, &e))?;
        let mut access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        if core.dev_attrs.atomics {
            access |= Access::REMOTE_ATOMIC;
        }
        qp.init(core.port.port_num, access)
            .map_err(|e| device_err(&dev_name, &e))?;
        let mem = Arc::new(DmaMem::new((rx_n + cfg.tx_depth) as usize * cfg.seg_size)?);
        // SAFETY: `mem` is our allocation; the slot keeps it alive at least as long as the region
        // (and the QP, which is dropped first).
        let mr = unsafe { core.dev.reg_mr(mem.addr(), mem.len(), Access::LOCAL_WRITE) }
            .map_err(|e| device_err(&dev_name, &e))?;
        let idx = match core.eps.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                core.eps.push(None);
                core.epochs.push(0);
                core.eps.len() - 1
            }
        };
        let epoch = core.epochs[idx].wrapping_add(1);
        core.epochs[idx] = epoch;
        core.eps[idx] = Some(EpSlot {
            qp,
            mr,
            mem,
            epoch,
            user_id: params.user_id,
            psn: random_psn(),
            state: EpState::Created,
            error_reported: false,
            peer: "unconnected peer".into(),

            tx_free: (0..cfg.tx_depth).rev().collect(),
            credits: None,
            peer_seg: cfg.seg_size,
            sq: SendSlots::new(cfg.tx_depth),
            ops: VecDeque::new(),
            next_seq: 0,
            flushes: VecDeque::new(),
            fence_next: false,
        });
        core.live += 1;
        let ep = idx as u16;
        for slot in 0..rx_n {
            if let Err(e) = core.post_recv(ep, epoch, slot) {
                core.eps[idx] = None;
                core.live -= 1;
                return Err(device_err(&dev_name, &e));
            }
        }
        drop(core);
        Ok(Box::new(RcEp {
            shared: self.shared.clone(),
            ep,
            epoch,
            max_iov: self.attr.limits.max_iov,
            am_max_short: self.attr.limits.am_max_short,
            am_max_zcopy: self.attr.limits.am_max_zcopy,
            put_max_zcopy: self.attr.limits.put_max_zcopy,
        }))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        let mut out = Vec::new();
        {
            let mut core = self.shared.lock();
            let mut wcs = std::mem::take(&mut core.wc);
            wcs.clear();
            // What `arm` polled first, in order, then the queue.
            wcs.append(&mut core.stash);
            match core.cq.poll(&mut wcs, POLL_BATCH) {
                Ok(_) => {}
                Err(e) => {
                    let reason = format!("completion queue failed: {e}");
                    for s in core.eps.iter_mut().flatten() {
                        RcCore::fail(s, reason.clone(), &mut out);
                    }
                }
            }
            for wc in &wcs {
                let id = WrId::decode(wc.wr_id);
                if id.recv {
                    core.on_recv_wc(id, wc, &mut out);
                } else {
                    core.on_send_wc(id, wc, &mut out);
                }
            }
            core.wc = wcs;
        }
        let mut n = 0;
        let mut late = Vec::new();
        for o in out {
            n += 1;
            match o {
                Out::Am {
                    ep,
                    epoch,
                    id,
                    mem,
                    off,
                    len,
                    slot,
                } => {
                    // SAFETY: the receive slot is ours until we re-post it below, and `mem`
                    // (an Arc) outlives the call even if the sink drops the endpoint.
                    let data = unsafe { mem.slice(off, len) };
                    sink(Event::Am { id, data });
                    self.shared
                        .lock()
                        .repost_delivered(ep, epoch, slot, &mut late);
                }
                Out::Completion { token, result } => sink(Event::Completion { token, result }),
                Out::EpError { user_id, error } => sink(Event::EpError { user_id, error }),
            }
        }
        for o in late {
            if let Out::EpError { user_id, error } = o {
                n += 1;
                sink(Event::EpError { user_id, error });
            }
        }
        self.shared.lock().send_grants();
        n
    }

    fn event_source(&self) -> EventSource {
        match &self.channel {
            Some(ch) => EventSource::Fd(ch.fd()),
            None => EventSource::PollOnly,
        }
    }

    fn arm(&mut self) -> Result<()> {
        // As UCX's ib interfaces arm: take the channel's events (acknowledged in one call),
        // busy if there were any; then arm the CQ for its next completion. A completion that
        // landed after the last progress polled the CQ and before it was armed raises no
        // event, so the CQ is polled once more after arming: what it finds is kept for the
        // next progress, and the arm is busy.
        let Some(ch) = &self.channel else {
            return Err(Error::Unsupported {
                what: format!("arming the rc_verbs interface on {}", self.attr.dev_name),
                why: "its device gave no completion channel; poll it".into(),
            });
        };
        let mut core = self.shared.lock();
        let mut events = 0u32;
        let taken = loop {
            match ch.get_event() {
                Ok(true) => events += 1,
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        core.cq.ack_events(events);
        if let Err(e) = taken {
            return Err(device_err(&core.dev_name, &e));
        }
        if events > 0 || !core.stash.is_empty() {
            return Err(Error::Busy(format!(
                "the rc_verbs interface on {} has completions to handle",
                core.dev_name
            )));
        }
        core.cq
            .req_notify()
            .map_err(|e| device_err(&core.dev_name, &e))?;
        let mut stash = std::mem::take(&mut core.stash);
        let polled = core.cq.poll(&mut stash, POLL_BATCH);
        core.stash = stash;
        match polled {
            Ok(0) => Ok(()),
            // A failed poll is busy too: the next progress meets the failure and reports it.
            Ok(_) | Err(_) => Err(Error::Busy(format!(
                "the rc_verbs interface on {} got completions while arming",
                core.dev_name
            ))),
        }
    }
}

/// An `rc_verbs` endpoint.
#[derive(Debug)]
pub struct RcEp {
    shared: Arc<Shared>,
    ep: u16,
    epoch: u16,
    max_iov: usize,
    am_max_short: usize,
    am_max_zcopy: usize,
    put_max_zcopy: usize,
}

fn check_am_id(id: AmId) -> Result<()> {
    if (id as usize) < AM_ID_MAX {
        Ok(())
    } else {
        Err(Error::InvalidParam(format!(
            "active message id {id} is not below {AM_ID_MAX}"
        )))
    }
}

impl RcEp {
    /// Scatter/gather entries for an iov, checked against this device's registrations.
    fn iov_sges(
        core: &RcCore,
        iov: &[Iov<'_>],
        max_iov: usize,
    ) -> Result<(Vec<Sge>, usize, Vec<MemHandle>)> {
        let total = Iov::check_all(iov, max_iov)?;
        let mut sges = Vec::with_capacity(iov.len());
        let mut hold = Vec::with_capacity(iov.len());
        for v in iov {
            let m = v.memh.inner::<IbMemh>().ok_or_else(|| {
                Error::InvalidParam(format!(
                    "buffer {:#x}+{} is registered with domain {}, not with an ib domain",
                    v.addr,
                    v.len,
                    v.memh.domain()
                ))
            })?;
            if m.device() != core.dev_attrs.name {
                return Err(Error::InvalidParam(format!(
                    "buffer {:#x}+{} is registered with {}, not with {}",
                    v.addr,
                    v.len,
                    m.device(),
                    core.dev_attrs.name
                )));
            }
            let length = u32::try_from(v.len).map_err(|_| {
                Error::InvalidParam(format!("iov entry of {} bytes exceeds 4 GiB", v.len))
            })?;
            // A zero-length entry means 2 GiB to some NICs: leave it out.
            if length > 0 {
                sges.push(Sge {
                    addr: v.addr as u64,
                    length,
                    lkey: m.lkey(),
                });
            }
            hold.push(v.memh.clone());
        }
        Ok((sges, total, hold))
    }

    fn rkey_of(rkey: &RemoteKey) -> Result<u32> {
        rkey.inner::<IbRkey>().map(|k| k.rkey).ok_or_else(|| {
            Error::InvalidParam(format!(
                "remote key was unpacked by domain {}, not by an ib domain",
                rkey.domain()
            ))
        })
    }

    /// Take a bounce buffer and check credits/slots for a message of `len` bytes (header
    /// included); returns the buffer and its offset.
    fn take_tx(
        core: &mut RcCore,
        ep: u16,
        epoch: u16,
        len: usize,
        needs_credit: bool,
    ) -> Result<(u32, usize)> {
        let seg = core.seg();
        let dev = core.dev_name.clone();
        let s = core.live_slot(ep, epoch)?;
        let limit = if needs_credit {
            seg.min(s.peer_seg)
        } else {
            seg
        };
        if len > limit {
            return Err(Error::InvalidParam(format!(
                "message of {len} bytes exceeds rc_verbs' buffer of {limit} bytes on {dev}"
            )));
        }
        if needs_credit && !s.credits.as_ref().is_some_and(Credits::can_send) {
            return Err(Error::NoResource(format!(
                "no credits for {} (the peer has not re-posted receive buffers yet)",
                s.peer
            )));
        }
        if s.sq.free() == 0 {
            return Err(Error::NoResource(format!(
                "send queue of {dev} endpoint full"
            )));
        }
        let t = s
            .tx_free
            .pop()
            .ok_or_else(|| Error::NoResource(format!("bounce buffers of {dev} endpoint in use")))?;
        Ok((t, core.tx_off(t)))
    }

    /// Post a message already in bounce buffer `tx = (slot, offset)` (header space included,
    /// `len` bytes), followed by the `extra` buffers.
    fn send_msg(
        &self,
        core: &mut RcCore,
        id: AmId,
        tx: (u32, usize),
        len: usize,
        extra: &[Sge],
        kind: OpKind,
    ) -> Result<()> {
        let (ep, epoch) = (self.ep, self.epoch);
        let (t, off) = tx;
        let s = match core.live_slot(ep, epoch) {
            Ok(s) => s,
            Err(e) => {
                if let Some(s) = core.slot(ep, epoch) {
                    s.tx_free.push(t);
                }
                return Err(e);
            }
        };
        let Some(piggy) = s.credits.as_mut().and_then(Credits::send) else {
            s.tx_free.push(t);
            return Err(Error::NoResource(format!("no credits for {}", s.peer)));
        };
        // SAFETY: bounce buffer `t` is ours (taken from the free list, not posted).
        unsafe { s.mem.slice_mut(off, HDR_LEN) }
            .copy_from_slice(&Header::Am { id, credits: piggy }.encode());
        let mut sges = Vec::with_capacity(1 + extra.len());
        sges.push(Sge {
            addr: (s.mem.addr() + off) as u64,
            length: len as u32,
            lkey: s.mr.lkey(),
        });
        sges.extend_from_slice(extra);
        let r = core.post(ep, epoch, SendOp::Send, &sges, kind);
        if r.is_err()
            && let Some(c) = core.slot(ep, epoch).and_then(|s| s.credits.as_mut())
        {
            c.unsend(piggy);
        }
        r
    }
}

impl Endpoint for RcEp {
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
        check_am_id(id)?;
        if payload.len() > self.am_max_short {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {} bytes exceeds rc_verbs' limit of {}",
                payload.len(),
                self.am_max_short
            )));
        }
        let len = HDR_LEN + 8 + payload.len();
        let mut core = self.shared.lock();
        let (t, off) = RcEp::take_tx(&mut core, self.ep, self.epoch, len, true)?;
        {
            let s = core.live_slot(self.ep, self.epoch)?;
            // SAFETY: bounce buffer `t` is ours.
            let b = unsafe { s.mem.slice_mut(off + HDR_LEN, 8 + payload.len()) };
            b[..8].copy_from_slice(&header.to_le_bytes());
            b[8..].copy_from_slice(payload);
        }
        self.send_msg(&mut core, id, (t, off), len, &[], OpKind::Tx(t))
    }

    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        check_am_id(id)?;
        let (t, off, cap, mem) = {
            let mut core = self.shared.lock();
            let (t, off) = RcEp::take_tx(&mut core, self.ep, self.epoch, HDR_LEN, true)?;
            let seg = core.seg();
            let s = core.live_slot(self.ep, self.epoch)?;
            (t, off, seg.min(s.peer_seg) - HDR_LEN, s.mem.clone())
        };
        // The pack callback runs without the lock, on a bounce buffer nobody else touches.
        // SAFETY: buffer `t` was taken from the free list and is neither posted nor shared.
        let n = pack(unsafe { mem.slice_mut(off + HDR_LEN, cap) });
        let mut core = self.shared.lock();
        if let Err(e) = check_packed(n, cap, "rc_verbs") {
            if let Some(s) = core.slot(self.ep, self.epoch) {
                s.tx_free.push(t);
            }
            return Err(e);
        }
        self.send_msg(&mut core, id, (t, off), HDR_LEN + n, &[], OpKind::Tx(t))?;
        Ok(n)
    }

    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        token: u64,
    ) -> Result<OpStatus> {
        check_am_id(id)?;
        if header.len() > crate::attr::AM_MAX_HDR {
            return Err(Error::InvalidParam(format!(
                "am_zcopy header of {} bytes exceeds rc_verbs' limit of {}",
                header.len(),
                crate::attr::AM_MAX_HDR
            )));
        }
        let mut core = self.shared.lock();
        let (sges, total, hold) = RcEp::iov_sges(&core, iov, self.max_iov)?;
        if total > self.am_max_zcopy {
            return Err(Error::InvalidParam(format!(
                "am_zcopy payload of {total} bytes exceeds rc_verbs' limit of {}",
                self.am_max_zcopy
            )));
        }
        let head = HDR_LEN + header.len();
        let (t, off) = RcEp::take_tx(&mut core, self.ep, self.epoch, head + total, true)?;
        {
            let s = core.live_slot(self.ep, self.epoch)?;
            // SAFETY: bounce buffer `t` is ours.
            unsafe { s.mem.slice_mut(off + HDR_LEN, header.len()) }.copy_from_slice(header);
        }
        let kind = OpKind::Token {
            token,
            tx: Some(t),
            _hold: hold,
        };
        self.send_msg(&mut core, id, (t, off), head, &sges, kind)?;
        Ok(OpStatus::InProgress)
    }

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        rkey.check(remote_addr, data.len() as u64)?;
        let key = RcEp::rkey_of(rkey)?;
        let mut core = self.shared.lock();
        let (t, off) = RcEp::take_tx(&mut core, self.ep, self.epoch, data.len(), false)?;
        let s = core.live_slot(self.ep, self.epoch)?;
        // SAFETY: bounce buffer `t` is ours.
        unsafe { s.mem.slice_mut(off, data.len()) }.copy_from_slice(data);
        let sge = Sge {
            addr: (s.mem.addr() + off) as u64,
            length: data.len() as u32,
            lkey: s.mr.lkey(),
        };
        let sges: &[Sge] = if data.is_empty() { &[] } else { &[sge] };
        core.post(
            self.ep,
            self.epoch,
            SendOp::Write {
                remote_addr,
                rkey: key,
            },
            sges,
            OpKind::Tx(t),
        )
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rdma(iov, remote_addr, rkey, token, true)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rdma(iov, remote_addr, rkey, token, false)
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        let mut core = self.shared.lock();
        let s = core.live_slot(self.ep, self.epoch)?;
        match s.ops.back() {
            None => Ok(OpStatus::Done),
            Some(last) => {
                let seq = last.seq;
                s.flushes.push_back((seq, token));
                Ok(OpStatus::InProgress)
            }
        }
    }

    fn fence(&mut self) -> Result<()> {
        let mut core = self.shared.lock();
        core.live_slot(self.ep, self.epoch)?.fence_next = true;
        Ok(())
    }

    fn ep_address(&self) -> Result<Vec<u8>> {
        let mut core = self.shared.lock();
        let (window, seg) = (core.cfg.rx_window, core.cfg.seg_size);
        let s = core
            .slot(self.ep, self.epoch)
            .ok_or_else(|| Error::Internal("rc_verbs endpoint slot vanished".into()))?;
        Ok(EpAddr {
            qpn: s.qp.qp_num(),
            psn: s.psn,
            rx_window: u16::try_from(window).unwrap_or(u16::MAX),
            seg_size: seg as u32,
        }
        .pack())
    }

    fn connect_to_ep(&mut self, dev_addr: &[u8], ep_addr: &[u8]) -> Result<()> {
        let peer_dev = DeviceAddr::unpack(dev_addr)?;
        let peer_ep = EpAddr::unpack(ep_addr)?;
        let mut core = self.shared.lock();
        if !core.local.reaches(&peer_dev) {
            return Err(Error::InvalidAddress(format!(
                "rc_verbs peer ({} link) is not reachable from {} ({} link, other subnet or link layer)",
                peer_dev.link, core.dev_name, core.local.link
            )));
        }
        let grh = match peer_dev.link {
            LinkLayer::Ethernet => Some(Grh {
                dgid: peer_dev.gid,
                sgid_index: core.gid_index,
                hop_limit: HOP_LIMIT,
                traffic_class: core.ib.traffic_class,
                flow_label: 0,
            }),
            LinkLayer::InfiniBand => None,
        };
        let c = RcConnect {
            port: core.port.port_num,
            dest_qpn: peer_ep.qpn,
            rq_psn: peer_ep.psn,
            sq_psn: 0,
            path_mtu: path_mtu(core.local.mtu, peer_dev.mtu, core.cfg.path_mtu),
            dlid: if peer_dev.link == LinkLayer::InfiniBand {
                peer_dev.lid
            } else {
                0
            },
            sl: core.ib.sl,
            grh,
            max_rd_atomic: core.dev_attrs.max_qp_init_rd_atom.clamp(1, 16) as u8,
            max_dest_rd_atomic: core.dev_attrs.max_qp_rd_atom.clamp(1, 16) as u8,
            min_rnr_timer: MIN_RNR_TIMER,
            timeout: core.cfg.timeout,
            retry_cnt: core.cfg.retry_cnt,
            rnr_retry: core.cfg.rnr_retry,
        };
        let window = core.cfg.rx_window;
        let dev_name = core.dev_name.clone();
        let s = core
            .slot(self.ep, self.epoch)
            .ok_or_else(|| Error::Internal("rc_verbs endpoint slot vanished".into()))?;
        if s.state != EpState::Created {
            return Err(Error::InvalidParam(format!(
                "rc_verbs endpoint is already {}",
                if s.state == EpState::Connected {
                    "connected"
                } else {
                    "failed"
                }
            )));
        }
        let c = RcConnect { sq_psn: s.psn, ..c };
        let peer = match peer_dev.link {
            LinkLayer::InfiniBand => format!("QP {:#x} at LID {}", peer_ep.qpn, peer_dev.lid),
            LinkLayer::Ethernet => format!(
                "QP {:#x} at {}",
                peer_ep.qpn,
                std::net::Ipv6Addr::from(peer_dev.gid)
            ),
        };
        if let Err(e) = s.qp.connect(&c) {
            s.state = EpState::Failed(format!("connecting to {peer}: {e}"));
            return Err(device_err(&dev_name, &e));
        }
        s.peer = peer;
        s.peer_seg = peer_ep.seg_size as usize;
        s.credits = Some(Credits::new(u32::from(peer_ep.rx_window), window));
        s.state = EpState::Connected;
        Ok(())
    }
}

impl RcEp {
    fn rdma(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
        write: bool,
    ) -> Result<OpStatus> {
        let key = RcEp::rkey_of(rkey)?;
        let mut core = self.shared.lock();
        let (sges, total, hold) = RcEp::iov_sges(&core, iov, self.max_iov)?;
        if total > self.put_max_zcopy {
            return Err(Error::InvalidParam(format!(
                "{} of {total} bytes exceeds rc_verbs' limit of {}",
                if write { "put_zcopy" } else { "get_zcopy" },
                self.put_max_zcopy
            )));
        }
        rkey.check(remote_addr, total as u64)?;
        core.live_slot(self.ep, self.epoch)?;
        if total == 0 {
            return Ok(OpStatus::Done);
        }
        let op = if write {
            SendOp::Write {
                remote_addr,
                rkey: key,
            }
        } else {
            SendOp::Read {
                remote_addr,
                rkey: key,
            }
        };
        let kind = OpKind::Token {
            token,
            tx: None,
            _hold: hold,
        };
        core.post(self.ep, self.epoch, op, &sges, kind)?;
        Ok(OpStatus::InProgress)
    }
}

impl Drop for RcEp {
    fn drop(&mut self) {
        let mut core = self.shared.lock();
        let idx = usize::from(self.ep);
        if core
            .eps
            .get(idx)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.epoch == self.epoch)
        {
            core.eps[idx] = None;
            core.live -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_id_round_trip() {
        for id in [
            WrId {
                ep: 0,
                epoch: 1,
                recv: false,
                n: 0,
            },
            WrId {
                ep: 65535,
                epoch: 65535,
                recv: true,
                n: SEQ_MASK,
            },
            WrId {
                ep: 7,
                epoch: 3,
                recv: false,
                n: 12345,
            },
        ] {
            assert_eq!(WrId::decode(id.encode()), id);
        }
    }

    #[test]
    fn sequence_wraps() {
        assert!(seq_reached(5, 5));
        assert!(seq_reached(6, 5));
        assert!(!seq_reached(4, 5));
        assert!(seq_reached(1, SEQ_MASK));
        assert!(!seq_reached(SEQ_MASK, 1));
    }

    #[test]
    fn poll_only_warning_once_per_device() {
        // Names no other test uses (the set is process-wide).
        assert!(first_poll_only_warning("warn_once_dev_a"));
        assert!(!first_poll_only_warning("warn_once_dev_a"));
        assert!(first_poll_only_warning("warn_once_dev_b"));
        assert!(!first_poll_only_warning("warn_once_dev_b"));
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= MAX_24);
        }
    }
}
