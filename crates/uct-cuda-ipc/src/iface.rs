//! The `cuda_ipc` interface and endpoints.
//!
//! Addresses (each in the common envelope, tag `cuda_ipc`): device address = `boot_id[16]`,
//! host name (u16-length-prefixed): peers on the same host are reachable; interface address =
//! `pid: u32`, `nonce: u64`.
//!
//! Copies run on the stream of the *local* buffer's GPU: lane 0 for put (local -> peer), lane 1
//! for get (peer -> local). The peer's allocation is mapped into this process by the
//! [`IpcCache`] (opened with lazy peer access, so the driver enables GPU-to-GPU access to the
//! owner's GPU), and the copy is a plain unified-address copy from or to that mapping.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rucx_cuda::{classify, driver};
use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::rkey::{self, Reader, put_lv};
use rucx_uct::{
    DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceLimits, Iov, OpStatus,
    PerfModel, RemoteKey,
};
use rucx_uct_cuda_copy::engine::{CopyEngine, CopyOp, KeepAlive, LaneKey};

use crate::cache::{IpcCache, Mapping};
use crate::md::IpcKey;
use crate::{DEVICE, HostId, NAME, Settings};

/// Lane of puts (local -> peer).
pub const LANE_PUT: u8 = 0;
/// Lane of gets (peer -> local).
pub const LANE_GET: u8 = 1;

const MAX_ZCOPY: usize = usize::MAX >> 1;
const MAX_IOV: usize = 16;

/// Pack a device address.
pub fn pack_dev_addr(host: &HostId) -> Vec<u8> {
    let mut p = host.boot_id.to_vec();
    put_lv(&mut p, host.hostname.as_bytes());
    rkey::pack(NAME, &p)
}

/// Unpack a device address.
pub fn unpack_dev_addr(blob: &[u8]) -> Result<HostId> {
    let p = rkey::unpack(NAME, "cuda_ipc device address", blob)
        .map_err(|e| Error::InvalidAddress(e.to_string()))?;
    let mut r = Reader::new(p, "cuda_ipc device address");
    let boot_id: [u8; 16] = r.bytes(16)?.try_into().expect("16 bytes");
    let hostname = String::from_utf8(r.lv()?.to_vec()).map_err(|_| {
        Error::InvalidAddress("cuda_ipc device address: host name is not UTF-8".into())
    })?;
    r.finish()?;
    Ok(HostId { boot_id, hostname })
}

fn pack_iface_addr(pid: u32, nonce: u64) -> Vec<u8> {
    let mut p = pid.to_le_bytes().to_vec();
    p.extend_from_slice(&nonce.to_le_bytes());
    rkey::pack(NAME, &p)
}

/// Unpack an interface address into (pid, nonce).
pub fn unpack_iface_addr(blob: &[u8]) -> Result<(u32, u64)> {
    let p = rkey::unpack(NAME, "cuda_ipc interface address", blob)
        .map_err(|e| Error::InvalidAddress(e.to_string()))?;
    let mut r = Reader::new(p, "cuda_ipc interface address");
    let pid = r.u32()?;
    let nonce = r.u64()?;
    r.finish()?;
    Ok((pid, nonce))
}

/// The interface attributes of `cuda_ipc` (no driver needed).
pub fn iface_attr(host: &HostId) -> IfaceAttr {
    IfaceAttr {
        tl_name: NAME.into(),
        dev_name: DEVICE.into(),
        dev_type: DeviceType::Accelerator,
        sys_device: None,
        // Copies by this process's engine: they complete whatever the peer does.
        caps: IfaceCaps::PUT_ZCOPY
            | IfaceCaps::GET_ZCOPY
            | IfaceCaps::CONNECT_TO_IFACE
            | IfaceCaps::LOCAL_COPY,
        limits: IfaceLimits {
            put_max_zcopy: MAX_ZCOPY,
            get_max_zcopy: MAX_ZCOPY,
            max_iov: MAX_IOV,
            ..IfaceLimits::default()
        },
        // GPU-to-GPU over NVLink on H200 pairs: 350-380 GB/s measured for plain peer copies
        // (PCIe peers reach about 25 GB/s); a copy costs a few microseconds to queue and about
        // 10 us end to end.
        perf: PerfModel {
            latency_ns: 10_000.0,
            overhead_ns: 3_000.0,
            bandwidth: 350e9,
        },
        priority: 0,
        device_addr_len: pack_dev_addr(host).len(),
        iface_addr_len: pack_iface_addr(0, 0).len(),
        ep_addr_len: 0,
        max_eps: None,
    }
}

static NONCE: AtomicU64 = AtomicU64::new(1);

/// Device pairs (local, peer) for which this process enabled peer access.
type PeerSet = Arc<Mutex<HashSet<(u32, u32)>>>;

/// A `cuda_ipc` interface.
#[derive(Debug)]
pub struct CudaIpcIface {
    attr: IfaceAttr,
    engine: Arc<CopyEngine>,
    cache: Arc<IpcCache>,
    host: HostId,
    nonce: u64,
    peers: PeerSet,
}

impl CudaIpcIface {
    /// A new interface sharing the domain's cache (no stream exists until the first copy).
    pub fn new(settings: &Settings, host: HostId, cache: Arc<IpcCache>) -> CudaIpcIface {
        CudaIpcIface {
            attr: iface_attr(&host),
            engine: Arc::new(
                CopyEngine::new(settings.max_inflight)
                    .with_pageable_threads(settings.pageable_threads),
            ),
            cache,
            host,
            nonce: NONCE.fetch_add(1, Ordering::Relaxed),
            peers: Arc::new(Mutex::new(HashSet::new())),
        }
    }

    /// The engine (shared with the endpoints).
    pub fn engine(&self) -> &Arc<CopyEngine> {
        &self.engine
    }
}

impl Iface for CudaIpcIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        pack_dev_addr(&self.host)
    }

    fn iface_address(&self) -> Vec<u8> {
        pack_iface_addr(std::process::id(), self.nonce)
    }

    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        unpack_dev_addr(dev_addr).is_ok_and(|h| h == self.host)
            && unpack_iface_addr(iface_addr).is_ok()
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        let peer_host = unpack_dev_addr(&params.dev_addr)?;
        let (pid, _) = unpack_iface_addr(&params.iface_addr)?;
        if peer_host != self.host {
            return Err(Error::InvalidAddress(format!(
                "cuda_ipc reaches processes of this host ({}) only; process {pid} runs on {:?}",
                self.host.hostname, peer_host.hostname
            )));
        }
        Ok(Box::new(CudaIpcEp {
            engine: self.engine.clone(),
            cache: self.cache.clone(),
            host: self.host.clone(),
            limits: self.attr.limits,
            peers: self.peers.clone(),
            peer_pid: pid,
        }))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        self.engine.progress(sink)
    }

    fn event_source(&self) -> rucx_uct::EventSource {
        // Copies only (no active messages arrive): the engine's completions are the events.
        match self.engine.event_fd() {
            Some(fd) => rucx_uct::EventSource::Fd(fd),
            None => rucx_uct::EventSource::PollOnly,
        }
    }

    fn arm(&mut self) -> Result<()> {
        self.engine.arm()
    }
}

/// Endpoint to a peer process of this host.
#[derive(Debug)]
pub struct CudaIpcEp {
    engine: Arc<CopyEngine>,
    cache: Arc<IpcCache>,
    host: HostId,
    limits: IfaceLimits,
    peers: PeerSet,
    peer_pid: u32,
}

fn no_am() -> Error {
    Error::Unsupported {
        what: "active messages on cuda_ipc".into(),
        why: "cuda_ipc only copies between GPU buffers of processes on this host (put/get)".into(),
    }
}

impl CudaIpcEp {
    /// The peer process this endpoint was created for.
    pub fn peer_pid(&self) -> u32 {
        self.peer_pid
    }

    /// Let `local`'s context reach `peer`'s memory directly (once per pair; failures leave the
    /// driver's staged path, which is slower but correct).
    fn ensure_peer_access(&self, local: u32, peer: u32) {
        if local == peer {
            return;
        }
        let mut set = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if !set.insert((local, peer)) {
            return;
        }
        let res = (|| {
            let drv = driver()?;
            if drv.can_access_peer(local, peer)? {
                drv.context(local)?.enable_peer_access(drv.context(peer)?)?;
            }
            Ok::<_, Error>(())
        })();
        if let Err(e) = res {
            tracing::debug!("peer access GPU {local} -> GPU {peer}: {e}");
        }
    }

    fn zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
        put: bool,
    ) -> Result<OpStatus> {
        let total = Iov::check_all(iov, self.limits.max_iov)?;
        if total == 0 {
            return Ok(OpStatus::Done);
        }
        rucx_ucs::profile::mark(if put { "ipc.put" } else { "ipc.get" }, total as u64);
        rkey.check(remote_addr, total as u64)?;
        let key = rkey.inner::<IpcKey>().ok_or_else(|| Error::InvalidRkey {
            domain: NAME.into(),
            reason: format!("key unpacked by {}", rkey.domain()),
        })?;
        let mut local_dev = None;
        for v in iov.iter().filter(|v| v.len > 0) {
            let r = v.memh.region();
            if r.mem_type == MemoryType::Host {
                // The local side of a device <-> host copy: any context may queue it.
                continue;
            }
            if r.mem_type != MemoryType::Cuda {
                return Err(Error::InvalidParam(format!(
                    "cuda_ipc copies between a peer's CUDA device buffer and a local device or \
                     host buffer; the local buffer {:#x}+{} is {} memory",
                    v.addr, v.len, r.mem_type
                )));
            }
            let d = match r.device {
                Some(d) => d,
                None => classify(v.addr, v.len)?.device.unwrap_or(0),
            };
            match local_dev {
                None => local_dev = Some(d),
                Some(prev) if prev != d => {
                    return Err(Error::InvalidParam(format!(
                        "cuda_ipc iov entries on GPU {prev} and GPU {d}; one operation uses one \
                         local GPU"
                    )));
                }
                Some(_) => {}
            }
        }
        // Host memory only: queue the copies in a context this process already has.
        let local_dev = match local_dev {
            Some(d) => d,
            None => driver()?.any_context()?.ordinal(),
        };
        let mut keep: Vec<KeepAlive> = Vec::with_capacity(iov.len() + 1);
        let same_process = key.pid == std::process::id() && key.boot_id == self.host.boot_id;
        let remote_local = if same_process {
            // Our own memory: no IPC mapping, just a (possibly cross-GPU) copy.
            self.ensure_peer_access(local_dev, key.device);
            remote_addr
        } else {
            let ctx = driver()?.context(local_dev)?;
            let m: Arc<Mapping> = self
                .cache
                .get_with(key, local_dev, || Mapping::open(key, ctx))?;
            let at = m.translate(remote_addr).ok_or_else(|| {
                Error::Internal(format!(
                    "remote address {remote_addr:#x} outside the mapped allocation"
                ))
            })?;
            keep.push(Box::new(m));
            at
        };
        let mut copies = Vec::with_capacity(iov.len());
        let mut off = remote_local;
        for v in iov.iter().filter(|v| v.len > 0) {
            let (dst, src) = if put {
                (off, v.addr as u64)
            } else {
                (v.addr as u64, off)
            };
            copies.push(CopyOp {
                dst,
                src,
                len: v.len,
            });
            keep.push(Box::new(v.memh.clone()));
            off += v.len as u64;
        }
        let lane = LaneKey {
            device: local_dev,
            lane: if put { LANE_PUT } else { LANE_GET },
        };
        // SAFETY: local ranges lie inside their handles (`check_all`), whose owners keep the
        // memory allocated while registered; the remote range lies inside the registered range
        // of the key (`rkey.check`), which lies inside the mapped allocation (validated at
        // unpack, translated above). The handles and the mapping are kept until the copies
        // finish.
        unsafe { self.engine.post(lane, &copies, token, keep) }
    }
}

impl Endpoint for CudaIpcEp {
    rucx_uct::no_active_messages!(no_am());

    fn put_short(&mut self, _data: &[u8], _remote_addr: u64, _rkey: &RemoteKey) -> Result<()> {
        Err(Error::Unsupported {
            what: "put_short on cuda_ipc".into(),
            why: "cuda_ipc moves registered device buffers only (put_zcopy/get_zcopy)".into(),
        })
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.zcopy(iov, remote_addr, rkey, token, true)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.zcopy(iov, remote_addr, rkey, token, false)
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        self.engine.flush(token)
    }

    fn fence(&mut self) -> Result<()> {
        self.engine.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rucx_uct::{MemHandle, MemRegion};

    fn iface() -> CudaIpcIface {
        CudaIpcIface::new(
            &Settings {
                cache: true,
                cache_size: 4,
                max_inflight: 4,
                pageable_threads: 0,
            },
            HostId::local(),
            Arc::new(IpcCache::new(true, 4)),
        )
    }

    #[test]
    fn attributes() {
        let i = iface();
        let a = i.attr();
        assert_eq!(
            (a.tl_name.as_str(), a.dev_name.as_str()),
            ("cuda_ipc", "cuda")
        );
        assert_eq!(
            a.caps,
            IfaceCaps::PUT_ZCOPY
                | IfaceCaps::GET_ZCOPY
                | IfaceCaps::CONNECT_TO_IFACE
                | IfaceCaps::LOCAL_COPY
        );
        assert_eq!(a.device_addr_len, i.device_address().len());
        assert_eq!(a.iface_addr_len, i.iface_address().len());
        assert!(a.perf.bandwidth > 100e9);
    }

    #[test]
    fn addresses_and_reachability() {
        let mut a = iface();
        let b = iface();
        assert_eq!(
            unpack_dev_addr(&b.device_address()).unwrap(),
            HostId::local()
        );
        assert_eq!(
            unpack_iface_addr(&b.iface_address()).unwrap().0,
            std::process::id()
        );
        assert!(a.is_reachable(&b.device_address(), &b.iface_address()));
        let other = HostId {
            hostname: "elsewhere".into(),
            ..HostId::local()
        };
        assert!(!a.is_reachable(&pack_dev_addr(&other), &b.iface_address()));
        assert!(!a.is_reachable(&[0; 30], &b.iface_address()));
        let e = a
            .create_ep(&EpParams {
                dev_addr: pack_dev_addr(&other),
                iface_addr: b.iface_address(),
                user_id: 1,
            })
            .unwrap_err();
        assert!(e.to_string().contains("elsewhere"), "{e}");
        assert!(
            a.create_ep(&EpParams {
                dev_addr: b.device_address(),
                iface_addr: vec![1, 2, 3],
                user_id: 1,
            })
            .is_err()
        );
        a.create_ep(&EpParams {
            dev_addr: b.device_address(),
            iface_addr: b.iface_address(),
            user_id: 1,
        })
        .unwrap();
    }

    #[test]
    fn checks_before_any_copy() {
        let mut i = iface();
        let mut ep = i
            .create_ep(&EpParams {
                dev_addr: i.device_address(),
                iface_addr: i.iface_address(),
                user_id: 0,
            })
            .unwrap();
        assert!(matches!(
            ep.am_short(1, 0, &[]),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            ep.put_short(&[1], 0, &RemoteKey::new(NAME, 0, 1, Arc::new(0u8))),
            Err(Error::Unsupported { .. })
        ));
        let k = IpcKey {
            handle: [1; 64],
            alloc_base: 0x10000,
            alloc_size: 0x1000,
            addr: 0x10000,
            len: 0x1000,
            pid: std::process::id(),
            device: 0,
            buffer_id: 1,
            boot_id: HostId::local().boot_id,
        };
        let rkey = crate::md::unpack_remote(&k.pack(), &HostId::local()).unwrap();
        // A managed buffer as the local side is refused (device and host memory are taken).
        let buf = [0u8; 64];
        let managed = MemHandle::new(
            MemRegion {
                mem_type: MemoryType::CudaManaged,
                ..MemRegion::of_slice(&buf)
            },
            "cuda_cpy",
            Arc::new(()),
        );
        let e = ep
            .put_zcopy(&[Iov::whole(&managed)], 0x10000, &rkey, 1)
            .unwrap_err();
        let managed_name = MemoryType::CudaManaged.to_string();
        assert!(e.to_string().contains(&managed_name), "{e}");
        let memh = MemHandle::new(MemRegion::of_slice(&buf), "cuda_cpy", Arc::new(()));
        let iov = [Iov::whole(&memh)];
        // Out of the remote range.
        let e = ep.get_zcopy(&iov, 0x10fc1, &rkey, 1).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e:?}");
        // A key from another domain.
        let foreign = RemoteKey::new("cuda_cpy", 0x10000, 0x1000, Arc::new(5u32));
        let dev = MemHandle::new(
            MemRegion {
                addr: 0x5000,
                len: 8,
                mem_type: MemoryType::Cuda,
                device: Some(0),
            },
            "cuda_cpy",
            Arc::new(()),
        );
        let e = ep
            .put_zcopy(&[Iov::whole(&dev)], 0x10000, &foreign, 1)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidRkey { .. }), "{e:?}");
        // Nothing to do.
        assert_eq!(
            ep.put_zcopy(&[], 0x10000, &rkey, 1).unwrap(),
            OpStatus::Done
        );
        assert_eq!(ep.flush(9).unwrap(), OpStatus::Done);
        let mut n = 0;
        i.progress(&mut |_| n += 1);
        assert_eq!(n, 0);
    }
}
