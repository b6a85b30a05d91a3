//! The `cuda_copy` interface and endpoints.
//!
//! Addresses (each in the common envelope, tag `cuda_copy`): device address = `boot_id[16]`,
//! `pid: u32` (only this process is reachable); interface address = `nonce: u64`. Any
//! `cuda_copy` interface of this process can reach any other, since the "remote" side of every
//! operation is memory of this process named by a remote key.
//!
//! Lanes (streams, created on first use): host -> device on the device's stream 0, device ->
//! host on its stream 1, device -> device on the source device's stream 2, host -> host on GPU
//! 0's stream 3.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rucx_cuda::classify;
use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::iface::check_put_short;
use rucx_uct::local::ProcessAddr;
use rucx_uct::{
    DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceLimits, Iov,
    MemRegion, OpStatus, PerfModel, RemoteKey,
};

use crate::engine::{CopyEngine, CopyOp, KeepAlive, LaneKey};
use crate::md::{CopyRkey, Reg, lookup};
use crate::{DEVICE, Settings, TL_NAME, boot_id};

/// Lane of host -> device copies.
pub const LANE_H2D: u8 = 0;
/// Lane of device -> host copies.
pub const LANE_D2H: u8 = 1;
/// Lane of device -> device copies.
pub const LANE_D2D: u8 = 2;
/// Lane of host -> host copies.
pub const LANE_H2H: u8 = 3;

/// Largest `put_short`.
pub const MAX_SHORT: usize = 8 << 10;
const MAX_ZCOPY: usize = usize::MAX >> 1;
const MAX_IOV: usize = 16;

/// The interface attributes of `cuda_copy` (no driver needed to compute them).
pub fn iface_attr() -> IfaceAttr {
    IfaceAttr {
        tl_name: TL_NAME.into(),
        dev_name: DEVICE.into(),
        dev_type: DeviceType::Accelerator,
        sys_device: None,
        caps: IfaceCaps::PUT_SHORT
            | IfaceCaps::PUT_ZCOPY
            | IfaceCaps::GET_ZCOPY
            | IfaceCaps::CONNECT_TO_IFACE
            | IfaceCaps::LOCAL_COPY,
        limits: IfaceLimits {
            put_max_short: MAX_SHORT,
            put_max_zcopy: MAX_ZCOPY,
            get_max_zcopy: MAX_ZCOPY,
            max_iov: MAX_IOV,
            ..IfaceLimits::default()
        },
        // Pinned host <-> device over PCIe Gen5 x16 measured 52-55 GB/s on H200 hosts; a copy
        // costs a few microseconds to queue and about 8 us end to end.
        perf: PerfModel {
            latency_ns: 8_000.0,
            overhead_ns: 2_000.0,
            bandwidth: 50e9,
        },
        priority: 0,
        device_addr_len: ADDR.pack_dev_addr(&[0; 16], 0).len(),
        iface_addr_len: ADDR.pack_iface_addr(0).len(),
        ep_addr_len: 0,
        max_eps: None,
    }
}

/// The address format (this process only).
const ADDR: ProcessAddr = ProcessAddr {
    tl: TL_NAME,
    dev_what: "cuda_copy device address",
    iface_what: "cuda_copy interface address",
};

/// Unpack a `cuda_copy` device address into (boot id, pid).
pub fn unpack_dev_addr(blob: &[u8]) -> Result<([u8; 16], u32)> {
    ADDR.unpack_dev_addr(blob)
}

static NONCE: AtomicU64 = AtomicU64::new(1);

/// A `cuda_copy` interface: owns the copy engine its endpoints post to.
#[derive(Debug)]
pub struct CudaCopyIface {
    attr: IfaceAttr,
    engine: Arc<CopyEngine>,
    nonce: u64,
    boot: [u8; 16],
}

impl CudaCopyIface {
    /// A new interface (no stream exists until the first copy).
    pub fn new(settings: &Settings) -> CudaCopyIface {
        CudaCopyIface {
            attr: iface_attr(),
            engine: Arc::new(CopyEngine::new(settings.max_inflight)),
            nonce: NONCE.fetch_add(1, Ordering::Relaxed),
            boot: boot_id(),
        }
    }

    /// The engine (shared with the endpoints).
    pub fn engine(&self) -> &Arc<CopyEngine> {
        &self.engine
    }

    /// A connected endpoint of the concrete type (same as [`Iface::create_ep`] to this
    /// interface, without the trait object).
    pub fn ep(&self) -> CudaCopyEp {
        CudaCopyEp {
            engine: self.engine.clone(),
            limits: self.attr.limits,
        }
    }
}

impl Iface for CudaCopyIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        ADDR.pack_dev_addr(&self.boot, std::process::id())
    }

    fn iface_address(&self) -> Vec<u8> {
        ADDR.pack_iface_addr(self.nonce)
    }

    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        ADDR.is_reachable(&self.boot, dev_addr, iface_addr)
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        let (boot, pid) = unpack_dev_addr(&params.dev_addr)?;
        ADDR.unpack_iface_addr(&params.iface_addr)?;
        if boot != self.boot || pid != std::process::id() {
            return Err(Error::InvalidAddress(format!(
                "cuda_copy reaches only its own process ({}); the address names process {pid}{}",
                std::process::id(),
                if boot != self.boot {
                    " on another host"
                } else {
                    ""
                }
            )));
        }
        Ok(Box::new(self.ep()))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        self.engine.progress(sink)
    }

    fn event_source(&self) -> rucx_uct::EventSource {
        match self.engine.event_fd() {
            Some(fd) => rucx_uct::EventSource::Fd(fd),
            None => rucx_uct::EventSource::PollOnly,
        }
    }

    fn arm(&mut self) -> Result<()> {
        self.engine.arm()
    }
}

/// Endpoint of a `cuda_copy` interface (to this process).
#[derive(Debug)]
pub struct CudaCopyEp {
    engine: Arc<CopyEngine>,
    limits: IfaceLimits,
}

/// Whether a region is GPU memory, and the device whose stream should copy it.
fn side(region: &MemRegion) -> (bool, u32) {
    if !region.mem_type.is_gpu() {
        return (false, 0);
    }
    let dev = region
        .device
        .or_else(|| {
            classify(region.addr, region.len)
                .ok()
                .and_then(|i| i.device)
        })
        .unwrap_or(0);
    (true, dev)
}

/// The lane for a copy from `src` to `dst`.
pub fn lane_for(src: (bool, u32), dst: (bool, u32)) -> LaneKey {
    match (src, dst) {
        ((false, _), (true, d)) => LaneKey {
            device: d,
            lane: LANE_H2D,
        },
        ((true, s), (false, _)) => LaneKey {
            device: s,
            lane: LANE_D2H,
        },
        ((true, s), (true, _)) => LaneKey {
            device: s,
            lane: LANE_D2D,
        },
        ((false, _), (false, _)) => LaneKey {
            device: 0,
            lane: LANE_H2H,
        },
    }
}

fn no_am() -> Error {
    Error::Unsupported {
        what: "active messages on cuda_copy".into(),
        why: "cuda_copy only copies between host and device memory of this process (put/get)"
            .into(),
    }
}

impl CudaCopyEp {
    /// Resolve the "remote" side: a live registration of this process covering the range.
    fn target(&self, rkey: &RemoteKey, addr: u64, len: usize) -> Result<Arc<Reg>> {
        rkey.check(addr, len as u64)?;
        let k = rkey.inner::<CopyRkey>().ok_or_else(|| Error::InvalidRkey {
            domain: crate::MD_NAME.into(),
            reason: format!("key unpacked by {}", rkey.domain()),
        })?;
        let reg = lookup(k.id).ok_or_else(|| Error::InvalidRkey {
            domain: crate::MD_NAME.into(),
            reason: "the remote registration was released".into(),
        })?;
        let r = reg.region();
        if !r.contains(addr as usize, len) {
            return Err(Error::OutOfBounds {
                addr,
                len: len as u64,
                base: r.addr as u64,
                region_len: r.len as u64,
            });
        }
        Ok(reg)
    }

    /// Post a zero-copy operation: `to_remote` for put, else get.
    fn zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
        to_remote: bool,
    ) -> Result<OpStatus> {
        let total = Iov::check_all(iov, self.limits.max_iov)?;
        if total == 0 {
            return Ok(OpStatus::Done);
        }
        let reg = self.target(rkey, remote_addr, total)?;
        let remote_side = side(reg.region());
        let local = iov.iter().find(|v| v.len > 0).expect("total > 0");
        let local_side = side(local.memh.region());
        let key = if to_remote {
            lane_for(local_side, remote_side)
        } else {
            lane_for(remote_side, local_side)
        };
        let mut copies = Vec::with_capacity(iov.len());
        let mut keep: Vec<KeepAlive> = Vec::with_capacity(iov.len() + 1);
        let mut off = remote_addr;
        for v in iov.iter().filter(|v| v.len > 0) {
            let (dst, src) = if to_remote {
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
        keep.push(Box::new(reg));
        // SAFETY: every local range lies inside its registered handle (`check_all`) and the
        // remote range inside a live registration of this process (`target`); the handles and
        // the registration are kept alive until the copies finish, and their owners promised
        // (mem_reg's contract) that the memory stays allocated while registered.
        unsafe { self.engine.post(key, &copies, token, keep) }
    }
}

impl Endpoint for CudaCopyEp {
    rucx_uct::no_active_messages!(no_am());

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        check_put_short(data.len(), self.limits.put_max_short, TL_NAME)?;
        if data.is_empty() {
            return Ok(());
        }
        let reg = self.target(rkey, remote_addr, data.len())?;
        let key = lane_for((false, 0), side(reg.region()));
        let copy = CopyOp {
            dst: remote_addr,
            src: data.as_ptr() as u64,
            len: data.len(),
        };
        // SAFETY: the source is a borrowed slice and the destination lies inside a live
        // registration held by `reg` for the whole (synchronous) copy.
        unsafe { self.engine.copy_sync(key, &[copy]) }
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
        // Operations on different lanes are not ordered; wait for everything queued so far.
        self.engine.synchronize()
    }
}

/// Whether a memory type is one `cuda_copy` can move.
pub fn accessible(m: MemoryType) -> bool {
    matches!(
        m,
        MemoryType::Host | MemoryType::Cuda | MemoryType::CudaManaged
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::md::{new_handle, pack_handle, unpack_key};

    fn iface() -> CudaCopyIface {
        CudaCopyIface::new(&Settings {
            frag_size: 4096,
            frag_count: 1,
            max_inflight: 4,
        })
    }

    #[test]
    fn attributes() {
        let a = iface_attr();
        assert_eq!(
            (a.tl_name.as_str(), a.dev_name.as_str()),
            ("cuda_copy", "cuda")
        );
        assert_eq!(a.dev_type, DeviceType::Accelerator);
        assert!(a.has(
            IfaceCaps::PUT_ZCOPY
                | IfaceCaps::GET_ZCOPY
                | IfaceCaps::CONNECT_TO_IFACE
                | IfaceCaps::LOCAL_COPY
        ));
        assert!(a.has(IfaceCaps::PUT_SHORT));
        assert!(
            !a.caps
                .intersects(IfaceCaps::AM_SHORT | IfaceCaps::AM_BCOPY | IfaceCaps::AM_ZCOPY)
        );
        assert!(a.perf.bandwidth >= 40e9 && a.perf.latency_ns > 1000.0);
        let i = iface();
        assert_eq!(a.device_addr_len, i.device_address().len());
        assert_eq!(a.iface_addr_len, i.iface_address().len());
        assert!(accessible(MemoryType::CudaManaged) && !accessible(MemoryType::Unknown));
    }

    #[test]
    fn lanes() {
        assert_eq!(
            lane_for((false, 0), (true, 1)),
            LaneKey {
                device: 1,
                lane: LANE_H2D
            }
        );
        assert_eq!(
            lane_for((true, 2), (false, 0)),
            LaneKey {
                device: 2,
                lane: LANE_D2H
            }
        );
        assert_eq!(
            lane_for((true, 2), (true, 1)),
            LaneKey {
                device: 2,
                lane: LANE_D2D
            }
        );
        assert_eq!(
            lane_for((false, 5), (false, 6)),
            LaneKey {
                device: 0,
                lane: LANE_H2H
            }
        );
        assert_eq!(side(&MemRegion::host(1, 1)), (false, 0));
        let r = MemRegion {
            addr: 1,
            len: 1,
            mem_type: MemoryType::Cuda,
            device: Some(3),
        };
        assert_eq!(side(&r), (true, 3));
    }

    #[test]
    fn reachability_is_this_process_only() {
        let mut a = iface();
        let b = iface();
        assert!(a.is_reachable(&b.device_address(), &b.iface_address()));
        let other = ADDR.pack_dev_addr(&boot_id(), std::process::id().wrapping_add(1));
        assert!(!a.is_reachable(&other, &b.iface_address()));
        let far = ADDR.pack_dev_addr(&[0xee; 16], std::process::id());
        assert!(!a.is_reachable(&far, &b.iface_address()));
        assert!(!a.is_reachable(&[1, 2, 3], &b.iface_address()));
        assert!(!a.is_reachable(&b.device_address(), &[]));
        let e = a
            .create_ep(&EpParams {
                dev_addr: other,
                iface_addr: b.iface_address(),
                user_id: 0,
            })
            .unwrap_err();
        assert!(e.to_string().contains("only its own process"), "{e}");
        a.create_ep(&EpParams {
            dev_addr: b.device_address(),
            iface_addr: b.iface_address(),
            user_id: 0,
        })
        .unwrap();
    }

    #[test]
    fn no_active_messages_and_checked_remote_access() {
        let i = iface();
        let mut ep = i.ep();
        assert!(matches!(
            ep.am_short(1, 0, &[]),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            ep.am_bcopy(1, &mut rucx_uct::iface::pack_bytes(&[1])),
            Err(Error::Unsupported { .. })
        ));

        // A host buffer registered in the table (no driver needed to describe it).
        let remote = vec![0u8; 64];
        let memh = new_handle(MemRegion::of_slice(&remote), None);
        let rkey = unpack_key(&pack_handle(&memh).unwrap()).unwrap();
        let base = remote.as_ptr() as u64;
        // Out of bounds of the key.
        let e = ep.put_short(&[1; 8], base + 60, &rkey).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e:?}");
        let e = ep.put_short(&[0; MAX_SHORT + 1], base, &rkey).unwrap_err();
        assert!(matches!(e, Error::InvalidParam(_)), "{e:?}");
        // Released registration.
        drop(memh);
        let e = ep.put_short(&[1; 8], base, &rkey).unwrap_err();
        assert!(e.to_string().contains("released"), "{e}");
        assert!(remote.iter().all(|b| *b == 0));
        // Empty operations are done at once.
        assert_eq!(ep.put_zcopy(&[], base, &rkey, 1).unwrap(), OpStatus::Done);
        assert_eq!(ep.flush(2).unwrap(), OpStatus::Done);
        ep.put_short(&[], base, &rkey).unwrap();
    }
}
