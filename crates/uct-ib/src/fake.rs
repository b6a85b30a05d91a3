//! A software RDMA fabric implementing the [`Verbs`] traits in memory, for tests.
//!
//! It behaves like a strict NIC: keys, bounds and access rights are checked on every work
//! request, a send needs a posted receive at the peer (where real RC would retry on
//! receiver-not-ready, this fabric fails at once, so credit bugs show), QP pairs must be
//! connected to each other with matching PSNs and addresses, errors move queue pairs to the error
//! state and flush what was posted, and every outcome arrives as a work completion. Transfers
//! happen synchronously when posted. Bytes are copied between registered *host* regions; regions
//! registered from a dma-buf stand for device memory and are not touched (writes to them are
//! dropped, reads from them return zeros).
//!
//! Registration failures are injected with [`RegFault`] (e.g. `EFAULT` for a GPU address range:
//! the seed's failure), dma-buf support and the peer-memory module are switches.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::verbs::{
    Access, CompChannel, Cq, DeviceAttrs, DeviceReport, GidEntry, GidKind, LinkLayer, Mr, Mtu,
    PortAttrs, PortState, Qp, QpCaps, RcConnect, SendOp, SendWr, Sge, SysfsDevices, Verbs,
    VerbsDevice, VerbsError, Wc, WcOpcode, WcStatus,
};

/// A registration failure to inject.
#[derive(Clone, Debug)]
pub struct RegFault {
    /// Only on this device (`None`: every device).
    pub device: Option<String>,
    /// Only registrations overlapping this address range (iova for dma-bufs).
    pub range: Range<usize>,
    /// Only this call (`ibv_reg_mr` or `ibv_reg_dmabuf_mr`; `None`: both).
    pub call: Option<&'static str>,
    /// The errno to fail with.
    pub errno: i32,
}

#[derive(Debug)]
struct MrState {
    dev: String,
    addr: u64,
    len: u64,
    access: Access,
    host: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpSt {
    Reset,
    Init,
    Rts,
    Err,
}

#[derive(Debug)]
struct QpState {
    dev: String,
    cq: Arc<CqInner>,
    st: QpSt,
    port: u8,
    access: Access,
    conn: Option<RcConnect>,
    recvs: VecDeque<(u64, Vec<Sge>)>,
    caps: QpCaps,
}

#[derive(Debug, Default)]
struct CqInner {
    entries: Mutex<VecDeque<Wc>>,
    cap: usize,
    overruns: Mutex<usize>,
    /// The channel the CQ was created on.
    channel: Option<Arc<ChannelInner>>,
    /// Event bookkeeping (see [`CqEvents`]).
    ev: Mutex<CqEvents>,
}

fn plock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CqInner {
    fn push(&self, wc: Wc) {
        let mut e = plock(&self.entries);
        if e.len() >= self.cap {
            *plock(&self.overruns) += 1;
        } else {
            e.push_back(wc);
            drop(e);
            // As a NIC: an armed CQ raises one event at its next completion.
            self.raise_if_armed();
        }
    }

    /// An armed CQ puts one event on its channel and is disarmed.
    fn raise_if_armed(&self) {
        let mut ev = plock(&self.ev);
        if ev.armed
            && let Some(ch) = &self.channel
        {
            ev.armed = false;
            ev.raised += 1;
            ch.raise();
        }
    }
}

/// What happened to the completion events of the fabric's CQs (summed over them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqEvents {
    /// Whether a CQ is armed now (`req_notify` called, no event raised since).
    pub armed: bool,
    /// `req_notify` calls.
    pub notify_calls: usize,
    /// Events put on channels.
    pub raised: usize,
    /// Events acknowledged (`ack_events`).
    pub acked: usize,
}

/// A completion channel: its events and a non-blocking eventfd readable while one is pending.
#[derive(Debug)]
struct ChannelInner {
    pending: Mutex<usize>,
    taken: Mutex<usize>,
    fd: rucx_ucs::event::EventFd,
}

impl ChannelInner {
    fn raise(&self) {
        // Signalled under the lock that `get_event` drains under, so the descriptor is
        // readable exactly while an event is pending.
        let mut p = plock(&self.pending);
        *p += 1;
        self.fd.signal();
    }
}

#[derive(Debug)]
struct FakeChannel {
    inner: Arc<ChannelInner>,
}

impl CompChannel for FakeChannel {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn fd(&self) -> RawFd {
        self.inner.fd.fd()
    }

    fn get_event(&self) -> Result<bool, VerbsError> {
        let mut p = plock(&self.inner.pending);
        if *p == 0 {
            return Ok(false);
        }
        *p -= 1;
        *plock(&self.inner.taken) += 1;
        if *p == 0 {
            // Idle once every event was taken, as the kernel's channel file.
            self.inner.fd.drain();
        }
        Ok(true)
    }
}

#[derive(Debug)]
struct Fabric {
    devices: BTreeMap<String, DeviceReport>,
    library: Result<(), String>,
    peer_mem: Option<String>,
    memlock: Option<u64>,
    dmabuf: BTreeSet<String>,
    mrs: HashMap<u32, MrState>,
    next_key: u32,
    qps: HashMap<u32, QpState>,
    next_qpn: u32,
    faults: Vec<RegFault>,
    cqs: Vec<Arc<CqInner>>,
    reg_calls: usize,
    /// `ibv_create_comp_channel` fails (a device without completion events).
    no_channel: bool,
}

/// The fabric; clone it to share.
#[derive(Debug, Clone)]
pub struct FakeFabric {
    inner: Arc<Mutex<Fabric>>,
}

impl Default for FakeFabric {
    fn default() -> Self {
        Self::new()
    }
}

fn lock(f: &Mutex<Fabric>) -> MutexGuard<'_, Fabric> {
    f.lock().unwrap_or_else(|p| p.into_inner())
}

impl FakeFabric {
    /// An empty fabric with libibverbs "present".
    pub fn new() -> Self {
        FakeFabric {
            inner: Arc::new(Mutex::new(Fabric {
                devices: BTreeMap::new(),
                library: Ok(()),
                peer_mem: None,
                memlock: Some(64 << 10),
                dmabuf: BTreeSet::new(),
                mrs: HashMap::new(),
                next_key: 0x1000,
                qps: HashMap::new(),
                next_qpn: 0x100,
                faults: Vec::new(),
                cqs: Vec::new(),
                no_channel: false,
                reg_calls: 0,
            })),
        }
    }

    /// Add a device.
    pub fn add_device(&self, report: DeviceReport) {
        lock(&self.inner)
            .devices
            .insert(report.attrs.name.clone(), report);
    }

    /// The [`Verbs`] of this fabric.
    pub fn verbs(&self) -> Arc<dyn Verbs> {
        Arc::new(FakeVerbs {
            inner: self.inner.clone(),
        })
    }

    /// Pretend libibverbs is (not) loadable.
    pub fn set_library(&self, r: Result<(), String>) {
        lock(&self.inner).library = r;
    }

    /// Pretend a peer-memory module is loaded.
    pub fn set_peer_memory(&self, module: Option<&str>) {
        lock(&self.inner).peer_mem = module.map(str::to_string);
    }

    /// Switch dma-buf registration support of a device.
    pub fn set_dmabuf(&self, dev: &str, supported: bool) {
        let mut f = lock(&self.inner);
        if supported {
            f.dmabuf.insert(dev.to_string());
        } else {
            f.dmabuf.remove(dev);
        }
    }

    /// Inject a registration failure.
    pub fn fail_reg(&self, fault: RegFault) {
        lock(&self.inner).faults.push(fault);
    }

    /// Move a QP to the error state, as a broken link or a dead peer would: its posted receives
    /// are flushed, and its peer's next operation fails.
    pub fn break_qp(&self, qpn: u32) {
        let mut f = lock(&self.inner);
        to_error(&mut f, qpn);
    }

    /// QP numbers of a device, in creation order.
    pub fn qps_of(&self, dev: &str) -> Vec<u32> {
        let f = lock(&self.inner);
        let mut v: Vec<u32> = f
            .qps
            .iter()
            .filter(|(_, q)| q.dev == dev)
            .map(|(n, _)| *n)
            .collect();
        v.sort_unstable();
        v
    }

    /// Registered regions alive now.
    pub fn live_mrs(&self) -> usize {
        lock(&self.inner).mrs.len()
    }

    /// Queue pairs alive now.
    pub fn live_qps(&self) -> usize {
        lock(&self.inner).qps.len()
    }

    /// Registration calls so far (successful or not).
    pub fn reg_calls(&self) -> usize {
        lock(&self.inner).reg_calls
    }

    /// Make `ibv_create_comp_channel` fail (`ENOSYS`) from now on.
    pub fn fail_comp_channel(&self) {
        lock(&self.inner).no_channel = true;
    }

    /// Event bookkeeping of every CQ, summed (`armed`: any CQ is armed now).
    pub fn cq_events(&self) -> CqEvents {
        let f = lock(&self.inner);
        f.cqs.iter().fold(CqEvents::default(), |a, c| {
            let e = *plock(&c.ev);
            CqEvents {
                armed: a.armed || e.armed,
                notify_calls: a.notify_calls + e.notify_calls,
                raised: a.raised + e.raised,
                acked: a.acked + e.acked,
            }
        })
    }

    /// Events taken from channels (`get_event`) and not acknowledged: must be 0 before a CQ
    /// is destroyed (libibverbs would wait for them forever).
    pub fn unacked_events(&self) -> usize {
        let f = lock(&self.inner);
        let taken: usize = f
            .cqs
            .iter()
            .filter_map(|c| c.channel.as_ref())
            .map(|ch| *plock(&ch.taken))
            .sum();
        let acked: usize = f.cqs.iter().map(|c| plock(&c.ev).acked).sum();
        taken - acked
    }

    /// Complete nothing but raise an event on every armed CQ's channel, as a completion would
    /// (for tests of the wake-up path alone).
    pub fn raise_cq_events(&self) {
        let f = lock(&self.inner);
        for c in &f.cqs {
            c.raise_if_armed();
        }
    }

    /// Make every CQ fail its polls from now on, as one that overran (`EOVERFLOW`).
    pub fn overrun_cqs(&self) {
        let f = lock(&self.inner);
        for c in &f.cqs {
            *plock(&c.overruns) += 1;
        }
    }

    /// Completions lost to full completion queues (must stay 0).
    pub fn cq_overruns(&self) -> usize {
        let f = lock(&self.inner);
        f.cqs
            .iter()
            .map(|c| *c.overruns.lock().unwrap_or_else(|p| p.into_inner()))
            .sum()
    }
}

/// An InfiniBand port with this LID, ACTIVE, 4X EDR, MTU 4096, GID `fe80::<lid>`.
pub fn ib_port(num: u8, lid: u16) -> PortAttrs {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[14..].copy_from_slice(&lid.to_be_bytes());
    PortAttrs {
        port_num: num,
        state: PortState::Active,
        phys_state: 5,
        link_layer: LinkLayer::InfiniBand,
        lid,
        sm_lid: 1,
        lmc: 0,
        active_mtu: Mtu::M4096,
        max_mtu: Mtu::M4096,
        active_width: 2,
        active_speed: 32,
        max_msg_sz: 1 << 30,
        gid_tbl_len: 128,
        gids: vec![GidEntry {
            index: 0,
            gid,
            kind: GidKind::Ib,
        }],
    }
}

/// A RoCE port with a link-local RoCE v1 GID at index 0 and `::ffff:<ipv4>` RoCE v2 at index 3.
pub fn roce_port(num: u8, ipv4: [u8; 4]) -> PortAttrs {
    let mut ll = [0u8; 16];
    ll[0] = 0xfe;
    ll[1] = 0x80;
    ll[12..].copy_from_slice(&ipv4);
    let mut v4 = [0u8; 16];
    v4[10] = 0xff;
    v4[11] = 0xff;
    v4[12..].copy_from_slice(&ipv4);
    PortAttrs {
        link_layer: LinkLayer::Ethernet,
        lid: 0,
        active_mtu: Mtu::M1024,
        gids: vec![
            GidEntry {
                index: 0,
                gid: ll,
                kind: GidKind::RoceV1,
            },
            GidEntry {
                index: 3,
                gid: v4,
                kind: GidKind::RoceV2,
            },
        ],
        ..ib_port(num, 0)
    }
}

/// A device with these ports and ConnectX-like limits.
pub fn device(name: &str, ports: Vec<PortAttrs>) -> DeviceReport {
    DeviceReport {
        attrs: DeviceAttrs {
            name: name.to_string(),
            node_guid: 0x506b_4b03_00dd_fb2a,
            fw_ver: "16.32.1010".into(),
            vendor_id: 0x02c9,
            vendor_part_id: 4119,
            hw_ver: 0,
            phys_port_cnt: ports.len() as u8,
            max_mr_size: u64::MAX,
            max_qp: 1 << 18,
            max_qp_wr: 32768,
            max_sge: 30,
            max_cqe: 4_194_303,
            max_qp_rd_atom: 16,
            max_qp_init_rd_atom: 16,
            atomics: true,
            sys_device: Some("0000:3b:00.0".into()),
        },
        ports,
    }
}

#[derive(Debug)]
struct FakeVerbs {
    inner: Arc<Mutex<Fabric>>,
}

impl Verbs for FakeVerbs {
    fn library_status(&self) -> Result<(), String> {
        lock(&self.inner).library.clone()
    }

    fn sysfs_devices(&self) -> SysfsDevices {
        let f = lock(&self.inner);
        if f.devices.is_empty() {
            SysfsDevices::Empty
        } else {
            SysfsDevices::Present(f.devices.keys().cloned().collect())
        }
    }

    fn peer_memory_module(&self) -> Option<String> {
        lock(&self.inner).peer_mem.clone()
    }

    fn memlock_limit(&self) -> Option<u64> {
        lock(&self.inner).memlock
    }

    fn device_names(&self) -> Result<Vec<String>, VerbsError> {
        let f = lock(&self.inner);
        f.library
            .as_ref()
            .map_err(|_| VerbsError::new("ibv_get_device_list", libc::EOPNOTSUPP))?;
        Ok(f.devices.keys().cloned().collect())
    }

    fn query_device(&self, name: &str) -> Result<DeviceReport, VerbsError> {
        lock(&self.inner)
            .devices
            .get(name)
            .cloned()
            .ok_or(VerbsError::new("ibv_open_device", libc::ENODEV))
    }

    fn open_device(&self, name: &str) -> Result<Arc<dyn VerbsDevice>, VerbsError> {
        if !lock(&self.inner).devices.contains_key(name) {
            return Err(VerbsError::new("ibv_open_device", libc::ENODEV));
        }
        Ok(Arc::new(FakeDevice {
            name: name.to_string(),
            inner: self.inner.clone(),
        }))
    }
}

#[derive(Debug)]
struct FakeDevice {
    name: String,
    inner: Arc<Mutex<Fabric>>,
}

#[derive(Debug)]
struct FakeMr {
    key: u32,
    inner: Arc<Mutex<Fabric>>,
}

impl Mr for FakeMr {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for FakeMr {
    fn drop(&mut self) {
        lock(&self.inner).mrs.remove(&self.key);
    }
}

#[derive(Debug)]
struct FakeCq {
    inner: Arc<CqInner>,
}

impl Cq for FakeCq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize, VerbsError> {
        if *self
            .inner
            .overruns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            > 0
        {
            return Err(VerbsError::new("ibv_poll_cq", libc::EOVERFLOW));
        }
        let mut e = self.inner.entries.lock().unwrap_or_else(|p| p.into_inner());
        let n = max.min(e.len());
        out.extend(e.drain(..n));
        Ok(n)
    }

    fn req_notify(&self) -> Result<(), VerbsError> {
        if self.inner.channel.is_none() {
            return Err(VerbsError::new("ibv_req_notify_cq", libc::EINVAL));
        }
        // The next completion raises an event; those already queued do not (as the verbs
        // specification allows), so a caller must poll once more after arming.
        let mut ev = plock(&self.inner.ev);
        ev.armed = true;
        ev.notify_calls += 1;
        Ok(())
    }

    fn ack_events(&self, n: u32) {
        plock(&self.inner.ev).acked += n as usize;
    }
}

impl FakeDevice {
    fn register(
        &self,
        call: &'static str,
        addr: u64,
        len: usize,
        access: Access,
        host: bool,
    ) -> Result<Box<dyn Mr>, VerbsError> {
        let mut f = lock(&self.inner);
        f.reg_calls += 1;
        let (lo, hi) = (addr as usize, addr as usize + len);
        if let Some(fault) = f.faults.iter().find(|x| {
            x.device.as_deref().is_none_or(|d| d == self.name)
                && x.call.is_none_or(|c| c == call)
                && lo < x.range.end
                && x.range.start < hi
        }) {
            return Err(VerbsError::new(call, fault.errno));
        }
        if len == 0
            || (access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
                && !access.contains(Access::LOCAL_WRITE))
        {
            return Err(VerbsError::new(call, libc::EINVAL));
        }
        let key = f.next_key;
        f.next_key += 1;
        f.mrs.insert(
            key,
            MrState {
                dev: self.name.clone(),
                addr,
                len: len as u64,
                access,
                host,
            },
        );
        Ok(Box::new(FakeMr {
            key,
            inner: self.inner.clone(),
        }))
    }
}

impl VerbsDevice for FakeDevice {
    fn name(&self) -> &str {
        &self.name
    }

    unsafe fn reg_mr(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Mr>, VerbsError> {
        self.register("ibv_reg_mr", addr as u64, len, access, true)
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        _offset: u64,
        len: usize,
        iova: u64,
        fd: RawFd,
        access: Access,
    ) -> Result<Box<dyn Mr>, VerbsError> {
        const CALL: &str = "ibv_reg_dmabuf_mr";
        if !lock(&self.inner).dmabuf.contains(&self.name) {
            return Err(VerbsError::new(CALL, libc::EOPNOTSUPP));
        }
        if fd < 0 {
            return Err(VerbsError::new(CALL, libc::EBADF));
        }
        self.register(CALL, iova, len, access, false)
    }

    fn create_comp_channel(&self) -> Result<Arc<dyn CompChannel>, VerbsError> {
        if lock(&self.inner).no_channel {
            return Err(VerbsError::new("ibv_create_comp_channel", libc::ENOSYS));
        }
        let fd = rucx_ucs::event::EventFd::new()
            .map_err(|e| VerbsError::from_io("ibv_create_comp_channel", &e))?;
        Ok(Arc::new(FakeChannel {
            inner: Arc::new(ChannelInner {
                pending: Mutex::new(0),
                taken: Mutex::new(0),
                fd,
            }),
        }))
    }

    fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&Arc<dyn CompChannel>>,
    ) -> Result<Arc<dyn Cq>, VerbsError> {
        let channel = match channel {
            None => None,
            Some(ch) => Some(
                ch.as_any()
                    .downcast_ref::<FakeChannel>()
                    .ok_or(VerbsError::new("ibv_create_cq", libc::EINVAL))?
                    .inner
                    .clone(),
            ),
        };
        let inner = Arc::new(CqInner {
            cap: cqe as usize,
            channel,
            ..Default::default()
        });
        lock(&self.inner).cqs.push(inner.clone());
        Ok(Arc::new(FakeCq { inner }))
    }

    fn create_rc_qp(&self, cq: &Arc<dyn Cq>, caps: &QpCaps) -> Result<Box<dyn Qp>, VerbsError> {
        let cq = cq
            .as_any()
            .downcast_ref::<FakeCq>()
            .ok_or(VerbsError::new("ibv_create_qp", libc::EINVAL))?
            .inner
            .clone();
        let mut f = lock(&self.inner);
        let qpn = f.next_qpn;
        f.next_qpn += 1;
        f.qps.insert(
            qpn,
            QpState {
                dev: self.name.clone(),
                cq,
                st: QpSt::Reset,
                port: 0,
                access: Access::empty(),
                conn: None,
                recvs: VecDeque::new(),
                caps: *caps,
            },
        );
        Ok(Box::new(FakeQp {
            qpn,
            inner: self.inner.clone(),
        }))
    }
}

#[derive(Debug)]
struct FakeQp {
    qpn: u32,
    inner: Arc<Mutex<Fabric>>,
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        lock(&self.inner).qps.remove(&self.qpn);
    }
}

fn wc(wr_id: u64, status: WcStatus, opcode: WcOpcode, byte_len: u32, qp_num: u32) -> Wc {
    Wc {
        wr_id,
        status,
        opcode,
        byte_len,
        vendor_err: if status == WcStatus::Success { 0 } else { 0x81 },
        qp_num,
    }
}

/// Move a QP to the error state and flush its posted receives.
fn to_error(f: &mut Fabric, qpn: u32) {
    if let Some(q) = f.qps.get_mut(&qpn) {
        q.st = QpSt::Err;
        while let Some((id, _)) = q.recvs.pop_front() {
            q.cq.push(wc(id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, qpn));
        }
    }
}

/// Check that `sges` lie in host or device regions of `dev` with `need` rights; the failing
/// status otherwise.
fn check_local(f: &Fabric, dev: &str, sges: &[Sge], need: Access) -> Result<(), WcStatus> {
    for s in sges {
        let mr = f.mrs.get(&s.lkey).ok_or(WcStatus::LocProtErr)?;
        let end = s
            .addr
            .checked_add(u64::from(s.length))
            .ok_or(WcStatus::LocProtErr)?;
        if mr.dev != dev || s.addr < mr.addr || end > mr.addr + mr.len || !mr.access.contains(need)
        {
            return Err(WcStatus::LocProtErr);
        }
    }
    Ok(())
}

fn is_host(f: &Fabric, key: u32) -> bool {
    f.mrs.get(&key).is_some_and(|m| m.host)
}

/// Read the bytes of `sges` (zeros for device memory).
fn gather(f: &Fabric, sges: &[Sge]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in sges {
        if is_host(f, s.lkey) {
            // SAFETY: the range was checked to lie in a live host registration, whose owner
            // promised (reg_mr's contract) to keep it mapped while registered.
            let b = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
            out.extend_from_slice(b);
        } else {
            out.resize(out.len() + s.length as usize, 0);
        }
    }
    out
}

/// Write `data` across `sges` (dropped for device memory).
fn scatter(f: &Fabric, sges: &[Sge], mut data: &[u8]) {
    for s in sges {
        let n = (s.length as usize).min(data.len());
        if is_host(f, s.lkey) {
            // SAFETY: as in `gather`; the destination is writable memory the registration owner
            // gave the NIC (LOCAL_WRITE was checked).
            unsafe { std::ptr::copy(data.as_ptr(), s.addr as *mut u8, n) };
        }
        data = &data[n..];
    }
}

impl FakeQp {
    /// Whether the peer QP is wired back to us with matching PSNs and addresses.
    fn peer_ok(f: &Fabric, me: u32, c: &RcConnect) -> bool {
        let (Some(q), Some(peer)) = (f.qps.get(&me), f.qps.get(&c.dest_qpn)) else {
            return false;
        };
        let Some(pc) = peer.conn else {
            return false;
        };
        if peer.st != QpSt::Rts || pc.dest_qpn != me || pc.rq_psn != c.sq_psn {
            return false;
        }
        let Some(port) = f.devices.get(&peer.dev).and_then(|d| d.port(peer.port)) else {
            return false;
        };
        let addressed = match port.link_layer {
            LinkLayer::InfiniBand => c.dlid == port.lid,
            LinkLayer::Ethernet => c
                .grh
                .is_some_and(|g| port.gids.iter().any(|x| x.gid == g.dgid)),
        };
        let mine = f.devices.get(&q.dev).and_then(|d| d.port(q.port));
        addressed && mine.is_some_and(|m| m.link_layer == port.link_layer)
    }

    fn execute(f: &mut Fabric, me: u32, wr: &SendWr<'_>) -> Result<(), WcStatus> {
        let (dev, c) = {
            let q = &f.qps[&me];
            (q.dev.clone(), q.conn.ok_or(WcStatus::LocQpOpErr)?)
        };
        let need = match wr.op {
            SendOp::Read { .. } => Access::LOCAL_WRITE,
            _ => Access::empty(),
        };
        check_local(f, &dev, wr.sges, need)?;
        if !Self::peer_ok(f, me, &c) {
            return Err(WcStatus::RetryExcErr);
        }
        let peer = c.dest_qpn;
        let remote =
            |f: &Fabric, addr: u64, len: u64, rkey: u32, need: Access| -> Result<bool, WcStatus> {
                let mr = f.mrs.get(&rkey).ok_or(WcStatus::RemAccessErr)?;
                let end = addr.checked_add(len).ok_or(WcStatus::RemAccessErr)?;
                if mr.dev != f.qps[&peer].dev
                    || addr < mr.addr
                    || end > mr.addr + mr.len
                    || !mr.access.contains(need)
                {
                    return Err(WcStatus::RemAccessErr);
                }
                Ok(mr.host)
            };
        let total: u64 = wr.sges.iter().map(|s| u64::from(s.length)).sum();
        match wr.op {
            SendOp::Send => {
                let data = gather(f, wr.sges);
                let q = f.qps.get_mut(&peer).ok_or(WcStatus::RetryExcErr)?;
                let (rid, rsges) = q.recvs.pop_front().ok_or(WcStatus::RnrRetryExcErr)?;
                let cap: u64 = rsges.iter().map(|s| u64::from(s.length)).sum();
                let cq = q.cq.clone();
                if (data.len() as u64) > cap {
                    cq.push(wc(rid, WcStatus::LocLenErr, WcOpcode::Recv, 0, peer));
                    to_error(f, peer);
                    return Err(WcStatus::RemInvReqErr);
                }
                let peer_dev = f.qps[&peer].dev.clone();
                if check_local(f, &peer_dev, &rsges, Access::LOCAL_WRITE).is_err() {
                    cq.push(wc(rid, WcStatus::LocProtErr, WcOpcode::Recv, 0, peer));
                    to_error(f, peer);
                    return Err(WcStatus::RemOpErr);
                }
                scatter(f, &rsges, &data);
                cq.push(wc(
                    rid,
                    WcStatus::Success,
                    WcOpcode::Recv,
                    data.len() as u32,
                    peer,
                ));
            }
            SendOp::Write { remote_addr, rkey } => {
                let host = remote(f, remote_addr, total, rkey, Access::REMOTE_WRITE)?;
                let data = gather(f, wr.sges);
                if host {
                    // SAFETY: the remote range lies in a live host registration with remote
                    // write rights, mapped by its owner's promise.
                    unsafe { std::ptr::copy(data.as_ptr(), remote_addr as *mut u8, data.len()) };
                }
            }
            SendOp::Read { remote_addr, rkey } => {
                let host = remote(f, remote_addr, total, rkey, Access::REMOTE_READ)?;
                let data = if host {
                    // SAFETY: the remote range lies in a live host registration with remote
                    // read rights.
                    unsafe { std::slice::from_raw_parts(remote_addr as *const u8, total as usize) }
                        .to_vec()
                } else {
                    vec![0; total as usize]
                };
                scatter(f, wr.sges, &data);
            }
        }
        Ok(())
    }
}

impl Qp for FakeQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    fn init(&mut self, port: u8, access: Access) -> Result<(), VerbsError> {
        let mut f = lock(&self.inner);
        let q = f
            .qps
            .get_mut(&self.qpn)
            .ok_or(VerbsError::new("ibv_modify_qp(INIT)", libc::EINVAL))?;
        if q.st != QpSt::Reset || port == 0 {
            return Err(VerbsError::new("ibv_modify_qp(INIT)", libc::EINVAL));
        }
        q.st = QpSt::Init;
        q.port = port;
        q.access = access;
        Ok(())
    }

    fn connect(&mut self, c: &RcConnect) -> Result<(), VerbsError> {
        let mut f = lock(&self.inner);
        let q = f
            .qps
            .get_mut(&self.qpn)
            .ok_or(VerbsError::new("ibv_modify_qp(RTR)", libc::EINVAL))?;
        if q.st != QpSt::Init || c.port != q.port || c.dest_qpn > 0xff_ffff {
            return Err(VerbsError::new("ibv_modify_qp(RTR)", libc::EINVAL));
        }
        q.conn = Some(*c);
        q.st = QpSt::Rts;
        Ok(())
    }

    unsafe fn post_recv(&mut self, wr_id: u64, sges: &[Sge]) -> Result<(), VerbsError> {
        let mut f = lock(&self.inner);
        let q = f
            .qps
            .get_mut(&self.qpn)
            .ok_or(VerbsError::new("ibv_post_recv", libc::EINVAL))?;
        if sges.len() > q.caps.max_recv_sge as usize {
            return Err(VerbsError::new("ibv_post_recv", libc::EINVAL));
        }
        match q.st {
            QpSt::Reset => Err(VerbsError::new("ibv_post_recv", libc::EINVAL)),
            QpSt::Err => {
                q.cq.push(wc(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, self.qpn));
                Ok(())
            }
            _ if q.recvs.len() >= q.caps.max_recv_wr as usize => {
                Err(VerbsError::new("ibv_post_recv", libc::ENOMEM))
            }
            _ => {
                q.recvs.push_back((wr_id, sges.to_vec()));
                Ok(())
            }
        }
    }

    unsafe fn post_send(&mut self, wr: &SendWr<'_>) -> Result<(), VerbsError> {
        let mut f = lock(&self.inner);
        let me = self.qpn;
        let (st, cq, caps) = {
            let q = f
                .qps
                .get(&me)
                .ok_or(VerbsError::new("ibv_post_send", libc::EINVAL))?;
            (q.st, q.cq.clone(), q.caps)
        };
        if wr.sges.len() > caps.max_send_sge as usize {
            return Err(VerbsError::new("ibv_post_send", libc::EINVAL));
        }
        let opcode = match wr.op {
            SendOp::Send => WcOpcode::Send,
            SendOp::Write { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
        };
        match st {
            QpSt::Reset | QpSt::Init => Err(VerbsError::new("ibv_post_send", libc::EINVAL)),
            QpSt::Err => {
                cq.push(wc(wr.wr_id, WcStatus::WrFlushErr, opcode, 0, me));
                Ok(())
            }
            QpSt::Rts => {
                match Self::execute(&mut f, me, wr) {
                    Ok(()) => {
                        if wr.signaled {
                            cq.push(wc(wr.wr_id, WcStatus::Success, opcode, 0, me));
                        }
                    }
                    Err(status) => {
                        cq.push(wc(wr.wr_id, status, opcode, 0, me));
                        to_error(&mut f, me);
                        if matches!(status, WcStatus::RemAccessErr)
                            && let Some(peer) =
                                f.qps.get(&me).and_then(|q| q.conn).map(|c| c.dest_qpn)
                        {
                            to_error(&mut f, peer);
                        }
                    }
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_checks() {
        let fab = FakeFabric::new();
        fab.add_device(device("mlx5_0", vec![ib_port(1, 1)]));
        let v = fab.verbs();
        let d = v.open_device("mlx5_0").unwrap();
        let buf = [0u8; 64];
        // SAFETY: `buf` outlives the registration.
        let mr = unsafe { d.reg_mr(buf.as_ptr() as usize, 64, Access::LOCAL_WRITE) }.unwrap();
        assert_eq!(fab.live_mrs(), 1);
        // Remote write without local write is invalid, as in libibverbs.
        // SAFETY: nothing is accessed.
        let bad = unsafe { d.reg_mr(buf.as_ptr() as usize, 64, Access::REMOTE_WRITE) };
        assert_eq!(bad.unwrap_err().errno, libc::EINVAL);
        let cq = d.create_cq(16, None).unwrap();
        assert!(
            cq.req_notify().is_err(),
            "a CQ without a channel cannot be armed"
        );
        let caps = QpCaps {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut qp = d.create_rc_qp(&cq, &caps).unwrap();
        let sge = Sge {
            addr: buf.as_ptr() as u64,
            length: 64,
            lkey: mr.lkey(),
        };
        // SAFETY: the buffer is registered and alive.
        let early = unsafe { qp.post_recv(1, &[sge]) };
        assert!(early.is_err(), "RESET QP takes no receives");
        qp.init(1, Access::LOCAL_WRITE).unwrap();
        // SAFETY: as above.
        unsafe { qp.post_recv(1, &[sge]) }.unwrap();
        let wr = SendWr {
            wr_id: 9,
            op: SendOp::Send,
            sges: &[sge],
            signaled: true,
            fence: false,
        };
        // SAFETY: as above.
        assert!(unsafe { qp.post_send(&wr) }.is_err(), "INIT QP cannot send");
        fab.break_qp(qp.qp_num());
        let mut out = Vec::new();
        cq.poll(&mut out, 8).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].wr_id, out[0].status), (1, WcStatus::WrFlushErr));
        drop(qp);
        drop(mr);
        assert_eq!((fab.live_mrs(), fab.live_qps()), (0, 0));
    }

    #[test]
    fn injected_faults_and_dmabuf_switch() {
        let fab = FakeFabric::new();
        fab.add_device(device("mlx5_0", vec![ib_port(1, 1)]));
        fab.fail_reg(RegFault {
            device: None,
            range: 0x7f00_0000_0000..0x7f00_1000_0000,
            call: Some("ibv_reg_mr"),
            errno: libc::EFAULT,
        });
        let d = fab.verbs().open_device("mlx5_0").unwrap();
        // SAFETY: the fake does not touch memory on registration.
        let e = unsafe { d.reg_mr(0x7f00_0000_1000, 4096, Access::LOCAL_WRITE) }.unwrap_err();
        assert_eq!(e.errno, libc::EFAULT);
        // SAFETY: as above.
        let e = unsafe { d.reg_dmabuf_mr(0, 4096, 0, -1, Access::LOCAL_WRITE) }.unwrap_err();
        assert_eq!(e.errno, libc::EOPNOTSUPP);
        fab.set_dmabuf("mlx5_0", true);
        // SAFETY: as above.
        let e = unsafe { d.reg_dmabuf_mr(0, 4096, 0, -1, Access::LOCAL_WRITE) }.unwrap_err();
        assert_eq!(e.errno, libc::EBADF);
        assert_eq!(fab.reg_calls(), 1);
    }
}
