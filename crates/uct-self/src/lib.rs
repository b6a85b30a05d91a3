//! The `self` transport: loopback inside one process.
//!
//! Active messages are copied into a queue of the same interface and delivered on progress;
//! put/get copy between registered regions of this process. A remote key names a live
//! registration by id (and the process id), so an access after the owner dropped the
//! registration, or with a key from another process, is an error instead of a wild write.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rucx_ucs::event::EventFd;
use rucx_ucs::{Config, Error, MemoryType, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    Availability, Component, DeviceType, Endpoint, EpParams, Event, EventSource, Iface, IfaceAttr,
    IfaceCaps, IfaceLimits, IfaceParams, Iov, LinearCost, MdAttr, MemHandle, MemRegion,
    MemTypeFlags, MemoryDomain, OpStatus, PerfModel, RemoteKey, TlResource,
};

/// Component, domain and transport name.
pub const NAME: &str = "self";
const DEVICE: &str = "memory0";
const MAX_SHORT: usize = 8 << 10;
const MAX_BCOPY: usize = 8 << 10;
const MAX_ZCOPY: usize = usize::MAX >> 1;

/// The `self` component.
#[derive(Debug, Default)]
pub struct SelfComponent;

impl Component for SelfComponent {
    fn name(&self) -> &'static str {
        NAME
    }

    fn transports(&self) -> &'static [&'static str] {
        &["self"]
    }

    fn query(&self, _config: &Config) -> Availability {
        Availability::Available(vec![NAME.to_string()])
    }

    fn open_md(&self, md_name: &str, _config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        if md_name != NAME {
            return Err(Error::InvalidParam(format!(
                "self has no memory domain {md_name:?}"
            )));
        }
        Ok(Arc::new(SelfMd::new()))
    }
}

/// A live registration.
#[derive(Debug)]
struct Reg {
    id: u64,
    region: MemRegion,
    table: Weak<Mutex<HashMap<u64, Weak<Reg>>>>,
}

impl Drop for Reg {
    fn drop(&mut self) {
        if let Some(t) = self.table.upgrade() {
            t.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        }
    }
}

/// Unpacked remote key.
#[derive(Debug)]
struct SelfRkey {
    id: u64,
}

/// The `self` memory domain.
#[derive(Debug)]
pub struct SelfMd {
    attr: MdAttr,
    regs: Arc<Mutex<HashMap<u64, Weak<Reg>>>>,
    next_id: AtomicU64,
}

impl SelfMd {
    /// A new domain.
    pub fn new() -> Self {
        let mut attr =
            MdAttr::new(NAME).with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS);
        attr.reg_cost = LinearCost::fixed(20.0);
        attr.rkey_packed_size = rkey::pack(NAME, &[0u8; 32]).len();
        SelfMd {
            attr,
            regs: Arc::new(Mutex::new(HashMap::new())),
            next_id: AtomicU64::new(1),
        }
    }
}

impl Default for SelfMd {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryDomain for SelfMd {
    fn name(&self) -> &str {
        NAME
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        vec![TlResource::new(NAME, DEVICE)]
    }

    fn open_iface(&self, tl: &TlResource, _params: &IfaceParams) -> Result<Box<dyn Iface>> {
        tl.expect(NAME, NAME, DEVICE)?;
        Ok(Box::new(SelfIface::new(self.regs.clone())?))
    }

    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        if region.mem_type != MemoryType::Host {
            return Err(region.reg_error(
                NAME,
                rucx_ucs::RegErrorKind::UnsupportedMemoryType,
                "self copies with the CPU and handles host memory only",
                "",
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let reg = Arc::new(Reg {
            id,
            region,
            table: Arc::downgrade(&self.regs),
        });
        self.regs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::downgrade(&reg));
        Ok(MemHandle::new(region, NAME, reg))
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let reg = memh.inner::<Reg>().ok_or_else(|| {
            Error::InvalidParam(format!("handle from {} given to self", memh.domain()))
        })?;
        let mut p = Vec::with_capacity(32);
        p.extend_from_slice(&std::process::id().to_le_bytes());
        p.extend_from_slice(&[0u8; 4]);
        p.extend_from_slice(&reg.id.to_le_bytes());
        p.extend_from_slice(&(reg.region.addr as u64).to_le_bytes());
        p.extend_from_slice(&(reg.region.len as u64).to_le_bytes());
        Ok(rkey::pack(NAME, &p))
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let payload = rkey::unpack(NAME, "self rkey", packed)?;
        let bad = |e: Error| Error::InvalidRkey {
            domain: NAME.into(),
            reason: e.to_string(),
        };
        let mut r = Reader::new(payload, "self rkey");
        let pid = r.u32().map_err(bad)?;
        let _pad = r.u32().map_err(bad)?;
        let id = r.u64().map_err(bad)?;
        let addr = r.u64().map_err(bad)?;
        let len = r.u64().map_err(bad)?;
        r.finish().map_err(bad)?;
        if pid != std::process::id() {
            return Err(Error::InvalidRkey {
                domain: NAME.into(),
                reason: format!("key of process {pid}; self reaches only its own process"),
            });
        }
        Ok(RemoteKey::new(NAME, addr, len, Arc::new(SelfRkey { id })))
    }
}

#[derive(Debug)]
struct Msg {
    id: u8,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
struct Queue {
    msgs: VecDeque<Msg>,
    done: VecDeque<u64>,
    /// The interface sleeps and wants the event descriptor signalled at the next item.
    armed: bool,
}

/// A queue with the interface's event descriptor, shared by the interface and its endpoints
/// (which may be used from another thread).
#[derive(Debug)]
struct Shared {
    queue: Mutex<Queue>,
    wake: EventFd,
    /// Items queued: progress looks here first and takes no lock while it is zero (the common
    /// case in a job whose messages go to other processes).
    queued: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue an item; wake the interface if it is armed.
    fn push(&self, f: impl FnOnce(&mut Queue)) {
        let mut q = self.lock();
        f(&mut q);
        self.queued.fetch_add(1, Ordering::Release);
        if std::mem::take(&mut q.armed) {
            self.wake.signal();
        }
    }
}

/// The `self` interface.
#[derive(Debug)]
pub struct SelfIface {
    attr: IfaceAttr,
    queue: Arc<Shared>,
    regs: Arc<Mutex<HashMap<u64, Weak<Reg>>>>,
    nonce: u64,
    /// Armed since the last progress: the next progress disarms and drains the eventfd.
    armed: bool,
}

static NONCE: AtomicU64 = AtomicU64::new(1);

impl SelfIface {
    fn new(regs: Arc<Mutex<HashMap<u64, Weak<Reg>>>>) -> Result<Self> {
        let attr = IfaceAttr {
            tl_name: NAME.into(),
            dev_name: DEVICE.into(),
            dev_type: DeviceType::Loopback,
            sys_device: None,
            caps: IfaceCaps::AM_SHORT
                | IfaceCaps::AM_BCOPY
                | IfaceCaps::AM_ZCOPY
                | IfaceCaps::PUT_SHORT
                | IfaceCaps::PUT_ZCOPY
                | IfaceCaps::GET_ZCOPY
                | IfaceCaps::CONNECT_TO_IFACE
                | IfaceCaps::LOOPBACK,
            limits: IfaceLimits {
                am_max_short: MAX_SHORT,
                am_max_bcopy: MAX_BCOPY,
                am_max_zcopy: MAX_ZCOPY,
                am_max_hdr: 128,
                put_max_short: MAX_SHORT,
                put_max_zcopy: MAX_ZCOPY,
                get_max_zcopy: MAX_ZCOPY,
                max_iov: 16,
            },
            perf: PerfModel {
                latency_ns: 0.0,
                overhead_ns: 10.0,
                bandwidth: 6.9e9,
            },
            priority: 0,
            device_addr_len: 8,
            iface_addr_len: 8,
            ep_addr_len: 0,
            max_eps: None,
        };
        let wake =
            EventFd::new().map_err(|e| Error::io("self: creating the interface's eventfd", e))?;
        Ok(SelfIface {
            attr,
            queue: Arc::new(Shared {
                queue: Mutex::new(Queue::default()),
                wake,
                queued: AtomicUsize::new(0),
            }),
            armed: false,
            regs,
            nonce: NONCE.fetch_add(1, Ordering::Relaxed),
        })
    }
}

fn pid_bytes() -> Vec<u8> {
    u64::from(std::process::id()).to_le_bytes().to_vec()
}

impl Iface for SelfIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        pid_bytes()
    }

    fn iface_address(&self) -> Vec<u8> {
        self.nonce.to_le_bytes().to_vec()
    }

    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        dev_addr == pid_bytes().as_slice() && iface_addr == self.nonce.to_le_bytes().as_slice()
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        if !self.is_reachable(&params.dev_addr, &params.iface_addr) {
            return Err(Error::InvalidAddress(
                "self reaches only its own interface; the address names another".into(),
            ));
        }
        Ok(Box::new(SelfEp {
            queue: self.queue.clone(),
            regs: self.regs.clone(),
            limits: self.attr.limits,
        }))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        if self.armed {
            self.armed = false;
            self.queue.lock().armed = false;
            self.queue.wake.drain();
        }
        let mut n = 0;
        loop {
            if self.queue.queued.load(Ordering::Acquire) == 0 {
                return n;
            }
            // Take one item at a time and release the lock before calling the sink, which may
            // send on an endpoint of this interface.
            let (msg, token) = {
                let mut q = self.queue.lock();
                let item = match q.done.pop_front() {
                    Some(t) => (None, Some(t)),
                    None => (q.msgs.pop_front(), None),
                };
                if item.0.is_some() || item.1.is_some() {
                    self.queue.queued.fetch_sub(1, Ordering::Release);
                }
                item
            };
            match (msg, token) {
                (_, Some(token)) => sink(Event::Completion {
                    token,
                    result: Ok(()),
                }),
                (Some(m), None) => sink(Event::Am {
                    id: m.id,
                    data: &m.data,
                }),
                (None, None) => return n,
            }
            n += 1;
        }
    }

    fn event_source(&self) -> EventSource {
        EventSource::Fd(self.queue.wake.fd())
    }

    fn arm(&mut self) -> Result<()> {
        let mut q = self.queue.lock();
        self.queue.wake.drain();
        if !q.msgs.is_empty() || !q.done.is_empty() {
            return Err(Error::Busy(format!(
                "{} messages and {} completions wait in the self interface",
                q.msgs.len(),
                q.done.len()
            )));
        }
        q.armed = true;
        self.armed = true;
        Ok(())
    }
}

/// Endpoint of the `self` interface to itself.
#[derive(Debug)]
pub struct SelfEp {
    queue: Arc<Shared>,
    regs: Arc<Mutex<HashMap<u64, Weak<Reg>>>>,
    limits: IfaceLimits,
}

impl SelfEp {
    fn push(&self, id: u8, data: Vec<u8>) -> Result<()> {
        if usize::from(id) >= rucx_uct::iface::AM_ID_MAX {
            return Err(Error::InvalidParam(format!(
                "active message id {id} is out of range"
            )));
        }
        self.queue.push(|q| q.msgs.push_back(Msg { id, data }));
        Ok(())
    }

    /// Resolve a remote access to a live registration of this process.
    fn target(&self, rkey: &RemoteKey, addr: u64, len: usize) -> Result<Arc<Reg>> {
        rkey.check(addr, len as u64)?;
        let k = rkey.inner::<SelfRkey>().ok_or_else(|| Error::InvalidRkey {
            domain: NAME.into(),
            reason: format!("key unpacked by {}", rkey.domain()),
        })?;
        let reg = self
            .regs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&k.id)
            .and_then(Weak::upgrade)
            .ok_or_else(|| Error::InvalidRkey {
                domain: NAME.into(),
                reason: "the remote registration was released".into(),
            })?;
        if !reg.region.contains(addr as usize, len) {
            return Err(Error::OutOfBounds {
                addr,
                len: len as u64,
                base: reg.region.addr as u64,
                region_len: reg.region.len as u64,
            });
        }
        Ok(reg)
    }
}

/// Copy `len` bytes between two registered host regions.
///
/// # Safety
/// Both ranges must lie inside live host registrations (checked by the callers against their
/// handles / registration table), whose owners promised the memory stays valid while registered.
unsafe fn copy_bytes(src: usize, dst: usize, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: guaranteed by this function's contract; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
}

/// Read a registered host iov into a vector.
fn gather(iov: &[Iov<'_>], out: &mut Vec<u8>) {
    for v in iov {
        let start = out.len();
        out.resize(start + v.len, 0);
        // SAFETY: `Iov::check_all` verified the range lies inside its registered host handle.
        unsafe { copy_bytes(v.addr, out[start..].as_mut_ptr() as usize, v.len) };
    }
}

impl Endpoint for SelfEp {
    fn am_short(&mut self, id: u8, header: u64, payload: &[u8]) -> Result<()> {
        if payload.len() > self.limits.am_max_short {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {} bytes exceeds self's limit of {}",
                payload.len(),
                self.limits.am_max_short
            )));
        }
        let mut data = Vec::with_capacity(8 + payload.len());
        data.extend_from_slice(&header.to_le_bytes());
        data.extend_from_slice(payload);
        self.push(id, data)
    }

    fn am_bcopy(&mut self, id: u8, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        let mut buf = vec![0u8; self.limits.am_max_bcopy];
        let n = rucx_uct::iface::check_packed(pack(&mut buf), buf.len(), NAME)?;
        buf.truncate(n);
        self.push(id, buf)?;
        Ok(n)
    }

    fn am_zcopy(&mut self, id: u8, header: &[u8], iov: &[Iov<'_>], token: u64) -> Result<OpStatus> {
        let _ = token;
        if header.len() > self.limits.am_max_hdr {
            return Err(Error::InvalidParam(format!(
                "am_zcopy header of {} bytes exceeds self's limit of {}",
                header.len(),
                self.limits.am_max_hdr
            )));
        }
        let total = Iov::check_all(iov, self.limits.max_iov)?;
        let mut data = Vec::with_capacity(header.len() + total);
        data.extend_from_slice(header);
        gather(iov, &mut data);
        self.push(id, data)?;
        Ok(OpStatus::Done)
    }

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        rucx_uct::iface::check_put_short(data.len(), self.limits.put_max_short, NAME)?;
        let _reg = self.target(rkey, remote_addr, data.len())?;
        // SAFETY: `target` checked the destination lies inside a live registration (held by
        // `_reg` during the copy); `data` is a valid slice.
        unsafe { copy_bytes(data.as_ptr() as usize, remote_addr as usize, data.len()) };
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        _token: u64,
    ) -> Result<OpStatus> {
        let total = Iov::check_all(iov, self.limits.max_iov)?;
        let _reg = self.target(rkey, remote_addr, total)?;
        let mut dst = remote_addr as usize;
        for v in iov {
            // SAFETY: source checked against its handle by `check_all`, destination against a
            // live registration by `target`.
            unsafe { copy_bytes(v.addr, dst, v.len) };
            dst += v.len;
        }
        Ok(OpStatus::Done)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        _token: u64,
    ) -> Result<OpStatus> {
        let total = Iov::check_all(iov, self.limits.max_iov)?;
        let _reg = self.target(rkey, remote_addr, total)?;
        let mut src = remote_addr as usize;
        for v in iov {
            // SAFETY: destination checked against its handle by `check_all`, source against a
            // live registration by `target`.
            unsafe { copy_bytes(src, v.addr, v.len) };
            src += v.len;
        }
        Ok(OpStatus::Done)
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        // Every operation completes when posted, but report through the event path so callers
        // exercise their completion handling.
        self.queue.push(|q| q.done.push_back(token));
        Ok(OpStatus::InProgress)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rucx_uct::conformance::{self, Side};

    fn side() -> Side {
        let cfg = Config::new(&[rucx_uct::CONFIG]).unwrap();
        let md = SelfComponent.open_md(NAME, &cfg).unwrap();
        let tl = md.tl_resources().remove(0);
        let iface = md.open_iface(&tl, &IfaceParams { config: &cfg }).unwrap();
        Side { md, iface }
    }

    #[test]
    fn conformance_loopback() {
        let report = conformance::run_loopback(side()).unwrap();
        report.print();
        assert!(report.passed.len() > 20, "{report:?}");
        assert!(report.skipped.is_empty(), "{report:?}");
    }

    #[test]
    fn released_registration_cannot_be_written() {
        let s = side();
        let buf = vec![0u8; 64];
        // SAFETY: `buf` outlives the handle.
        let memh = unsafe { s.md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
        let packed = s.md.mkey_pack(&memh).unwrap();
        let rkey = s.md.rkey_unpack(&packed).unwrap();
        drop(memh);
        let other = side();
        let mut iface = s.iface;
        let addr = conformance::ep_params_from_hex(&other.address_hex(), 0).unwrap();
        // An endpoint to another interface of this process is refused (self is per-interface).
        assert!(iface.create_ep(&addr).is_err());
        let own = EpParams {
            dev_addr: iface.device_address(),
            iface_addr: iface.iface_address(),
            user_id: 0,
        };
        let mut ep = iface.create_ep(&own).unwrap();
        let e = ep
            .put_short(&[1, 2, 3], buf.as_ptr() as u64, &rkey)
            .unwrap_err();
        assert!(e.to_string().contains("released"), "{e}");
        assert!(buf.iter().all(|b| *b == 0));
    }

    #[test]
    fn device_memory_is_refused_with_a_typed_error() {
        let md = SelfMd::new();
        let region = MemRegion {
            addr: 0x1000,
            len: 10,
            mem_type: MemoryType::Cuda,
            device: Some(0),
        };
        // SAFETY: the region is refused before anything touches it.
        let e = unsafe { md.mem_reg(region) }.unwrap_err();
        let r = e.as_registration().expect("a registration error");
        assert_eq!(r.kind, rucx_ucs::RegErrorKind::UnsupportedMemoryType);
    }

    #[test]
    fn fault_injection_produces_the_typed_error_and_releases_budget() {
        let rules = rucx_uct::fault::FaultRules::parse("md=self,mem=host,budget=100").unwrap();
        let md = rules.wrap(Arc::new(SelfMd::new()));
        let a = vec![0u8; 60];
        let b = vec![0u8; 60];
        // SAFETY: buffers outlive the handles.
        let ha = unsafe { md.mem_reg(MemRegion::of_slice(&a)) }.unwrap();
        // SAFETY: as above.
        let e = unsafe { md.mem_reg(MemRegion::of_slice(&b)) }.unwrap_err();
        let r = e.as_registration().unwrap();
        assert_eq!(r.kind, rucx_ucs::RegErrorKind::ApertureExhausted);
        assert_eq!(r.domain, "self");
        assert!(e.to_string().contains("RUCX_FAULT_INJECT"), "{e}");
        drop(ha);
        // SAFETY: as above.
        let hb = unsafe { md.mem_reg(MemRegion::of_slice(&b)) }.unwrap();
        // The wrapped handle still works with the inner domain.
        md.mkey_pack(&hb).unwrap();

        let rules = rucx_uct::fault::FaultRules::parse("md=self,after=2").unwrap();
        let md = rules.wrap(Arc::new(SelfMd::new()));
        for _ in 0..2 {
            // SAFETY: as above.
            unsafe { md.mem_reg(MemRegion::of_slice(&a)) }.unwrap();
        }
        // SAFETY: as above.
        let e = unsafe { md.mem_reg(MemRegion::of_slice(&a)) }.unwrap_err();
        assert_eq!(
            e.as_registration().unwrap().kind,
            rucx_ucs::RegErrorKind::BadAddress
        );
        // A rule for another domain leaves this one alone.
        let rules = rucx_uct::fault::FaultRules::parse("md=posix,after=0").unwrap();
        let md = rules.wrap(Arc::new(SelfMd::new()));
        // SAFETY: as above.
        unsafe { md.mem_reg(MemRegion::of_slice(&a)) }.unwrap();
    }
}
