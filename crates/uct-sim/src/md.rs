//! Sim memory domains: registrations are entries of the fabric's table; remote keys name them.

use std::sync::{Arc, Mutex, Weak};

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    Iface, IfaceParams, LinearCost, MdAttr, MemHandle, MemRegion, MemTypeFlags, MemoryDomain,
    RemoteKey, SharedAlloc, TlResource,
};

use crate::fabric::{Fabric, LaneKind, SharedBacking, State, kind_code, kind_from_code};
use crate::{COMPONENT, NodeId};

/// A live registration; dropping the last clone of its handle removes it from the fabric.
#[derive(Debug)]
pub(crate) struct SimReg {
    pub(crate) id: u64,
    pub(crate) node: usize,
    pub(crate) kind: LaneKind,
    fabric: Weak<Mutex<State>>,
}

impl Drop for SimReg {
    fn drop(&mut self) {
        if let Some(st) = self.fabric.upgrade() {
            st.lock()
                .unwrap_or_else(|p| p.into_inner())
                .unregister(self.id);
        }
    }
}

/// An unpacked sim remote key.
#[derive(Debug)]
pub(crate) struct SimRkey {
    pub(crate) reg: u64,
    pub(crate) kind: LaneKind,
}

/// A sim memory domain: one lane kind on one node.
#[derive(Debug)]
pub struct SimMd {
    fabric: Fabric,
    node: usize,
    kind: LaneKind,
    attr: MdAttr,
}

/// Attributes of each domain, close to the real domain each kind stands for.
pub(crate) fn md_attr(kind: LaneKind) -> MdAttr {
    let host = MemTypeFlags::REG | MemTypeFlags::ACCESS;
    let mut a = MdAttr::new(COMPONENT);
    match kind {
        LaneKind::Shm => {
            a = a.with(MemoryType::Host, host);
            a.reg_cost = LinearCost::fixed(20.0);
        }
        LaneKind::Net => {
            a = a.with(MemoryType::Host, host);
            a.reg_cost = LinearCost::fixed(100.0);
        }
        LaneKind::Ipc => {
            // As cuda_ipc: registers (exports) device memory; peers read it, into their device
            // or host memory.
            a = a
                .with(MemoryType::Cuda, host)
                .with(MemoryType::Host, MemTypeFlags::ACCESS);
            a.reg_cost = LinearCost::fixed(5_000.0);
            a.need_memh_for_zcopy = false;
        }
        LaneKind::Copy => {
            // As cuda_cpy: pins host memory, takes device memory as it is, tells them apart.
            a = a.with(MemoryType::Host, host).with(
                MemoryType::Cuda,
                MemTypeFlags::ACCESS | MemTypeFlags::DETECT | MemTypeFlags::ALLOC,
            );
            a.reg_cost = LinearCost {
                overhead_ns: 1_000.0,
                per_byte_ns: 0.0001,
            };
        }
    }
    a.rkey_packed_size = rkey::pack(COMPONENT, &[0u8; 34]).len();
    a
}

impl SimMd {
    pub(crate) fn new(fabric: Fabric, node: NodeId, kind: LaneKind) -> SimMd {
        SimMd {
            fabric,
            node: node.0,
            kind,
            attr: md_attr(kind),
        }
    }

    fn handle(&self, region: MemRegion, id: u64) -> MemHandle {
        MemHandle::new(
            region,
            self.kind.name(),
            Arc::new(SimReg {
                id,
                node: self.node,
                kind: self.kind,
                fabric: self.fabric.weak(),
            }),
        )
    }
}

impl MemoryDomain for SimMd {
    fn name(&self) -> &str {
        self.kind.name()
    }

    fn attr(&self) -> &MdAttr {
        &self.attr
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        vec![TlResource {
            tl_name: self.kind.name().into(),
            dev_name: self.kind.device().into(),
        }]
    }

    fn open_iface(&self, tl: &TlResource, _params: &IfaceParams) -> Result<Box<dyn Iface>> {
        if tl.tl_name != self.kind.name() || tl.dev_name != self.kind.device() {
            return Err(Error::InvalidParam(format!(
                "{} has no transport {}/{}",
                self.kind, tl.tl_name, tl.dev_name
            )));
        }
        Ok(Box::new(crate::iface::SimIface::new(
            self.fabric.clone(),
            self.node,
            self.kind,
        )))
    }

    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        let mut st = self.fabric.lock();
        // A region inside shared memory gets a key peers can map (as posix's).
        let shared = self.kind == LaneKind::Shm
            && region.mem_type == MemoryType::Host
            && st.inside_shared(region.addr, region.len);
        let id = st.register(self.node, self.kind, region, shared)?;
        drop(st);
        Ok(self.handle(region, id))
    }

    fn gpu_uuid(&self, device: u32) -> Option<[u8; 16]> {
        // GPU `device` of this node, or of every node when the fabric shares its GPUs.
        let st = self.fabric.lock();
        if self.kind != LaneKind::Ipc {
            return None;
        }
        let node = if st.spec.shared_gpus {
            u32::MAX
        } else {
            self.node as u32
        };
        let mut u = [0u8; 16];
        u[..8].copy_from_slice(&st.id.to_le_bytes());
        u[8..12].copy_from_slice(&node.to_le_bytes());
        u[12..].copy_from_slice(&device.to_le_bytes());
        Some(u)
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let reg = memh
            .inner::<SimReg>()
            .filter(|r| r.kind == self.kind && r.node == self.node)
            .ok_or_else(|| {
                Error::InvalidParam(format!(
                    "handle of {} given to {} of this node",
                    memh.domain(),
                    self.kind
                ))
            })?;
        let st = self.fabric.lock();
        let r = st
            .regs
            .get(&reg.id)
            .ok_or_else(|| Error::InvalidParam(format!("registration {} was released", reg.id)))?;
        let mut p = Vec::with_capacity(34);
        p.extend_from_slice(&st.id.to_le_bytes());
        p.extend_from_slice(&reg.id.to_le_bytes());
        p.extend_from_slice(&(r.region.addr as u64).to_le_bytes());
        p.extend_from_slice(&(r.region.len as u64).to_le_bytes());
        p.push(kind_code(self.kind));
        p.push(u8::from(r.region.mem_type == MemoryType::Cuda));
        Ok(rkey::pack(COMPONENT, &p))
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let bad = |reason: String| Error::InvalidRkey {
            domain: self.kind.name().into(),
            reason,
        };
        let payload = rkey::unpack(COMPONENT, "sim rkey", packed)?;
        let mut r = Reader::new(payload, "sim rkey");
        let fid = r.u64().map_err(|e| bad(e.to_string()))?;
        let reg = r.u64().map_err(|e| bad(e.to_string()))?;
        let base = r.u64().map_err(|e| bad(e.to_string()))?;
        let len = r.u64().map_err(|e| bad(e.to_string()))?;
        let kind = r.u8().map_err(|e| bad(e.to_string()))?;
        let gpu = r.u8().map_err(|e| bad(e.to_string()))?;
        r.finish().map_err(|e| bad(e.to_string()))?;
        if fid != self.fabric.lock().id {
            return Err(bad(format!("key of sim fabric {fid}, not of this one")));
        }
        let kind = kind_from_code(kind).ok_or_else(|| bad(format!("unknown lane code {kind}")))?;
        if kind != self.kind {
            return Err(bad(format!("key of {kind}, unpacked by {}", self.kind)));
        }
        if gpu > 1 || base.checked_add(len).is_none() {
            return Err(bad("malformed fields".into()));
        }
        Ok(RemoteKey::new(
            self.kind.name(),
            base,
            len,
            Arc::new(SimRkey { reg, kind }),
        ))
    }

    fn mem_still_valid(&self, memh: &MemHandle) -> bool {
        let Some(reg) = memh.inner::<SimReg>() else {
            return false;
        };
        let st = self.fabric.lock();
        st.regs
            .get(&reg.id)
            .and_then(|r| r.alloc)
            .is_some_and(|a| st.device_alloc_live(a))
    }

    fn mem_alloc_shared(&self, len: usize) -> Result<Option<SharedAlloc>> {
        if self.kind != LaneKind::Shm || len == 0 || !self.fabric.lock().spec.shared_staging {
            return Ok(None);
        }
        // Page-aligned with a page to spare on both sides, as a real segment is whole pages:
        // a registration of a buffer in it, aligned out to pages, stays inside the memory.
        const PAGE: usize = 4096;
        let mut mem = vec![0u8; len + 2 * PAGE];
        // Only ever accessed through this address from now on (the vector is never resized).
        let addr = (mem.as_mut_ptr() as usize).next_multiple_of(PAGE);
        let region = MemRegion::host(addr, len);
        let backing = Arc::new(SharedBacking::new(mem));
        let id = {
            let mut st = self.fabric.lock();
            st.keep_shared(backing);
            st.register(self.node, self.kind, region, true)?
        };
        Ok(Some(SharedAlloc {
            addr,
            len,
            memh: self.handle(region, id),
        }))
    }

    fn rkey_ptr(&self, rkey: &RemoteKey) -> Result<Option<usize>> {
        let Some(k) = rkey.inner::<SimRkey>() else {
            return Ok(None);
        };
        // Shared staging of any node of this fabric is kept alive by the fabric itself, so a
        // mapping stays valid as long as the domain.
        Ok(self
            .fabric
            .lock()
            .is_shared(k.reg)
            .then_some(rkey.base() as usize))
    }

    fn detect_mem_type(&self, addr: usize, len: usize) -> Result<Option<MemRegion>> {
        if self.kind != LaneKind::Copy {
            return Ok(None);
        }
        self.fabric.lock().detect(addr, len)
    }
}
