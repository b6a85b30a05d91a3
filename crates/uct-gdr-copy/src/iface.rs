//! The `gdr_copy` interface and endpoints: synchronous CPU copies through the mapping.
//!
//! Addresses (common envelope, tag `gdr_copy`): device address = `boot_id[16]`, `pid: u32`;
//! interface address = `nonce: u64`. Only this process is reachable.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::iface::check_put_short;
use rucx_uct::local::ProcessAddr;
use rucx_uct::{
    DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceLimits, Iov, OpStatus,
    PerfModel, RemoteKey,
};

use crate::md::{GdrRkey, Reg, lookup};
use crate::{DEVICE, NAME, boot_id};

/// Largest `put_short`.
pub const MAX_SHORT: usize = 4096;
const MAX_ZCOPY: usize = usize::MAX >> 1;
const MAX_IOV: usize = 16;

/// The address format (this process only).
const ADDR: ProcessAddr = ProcessAddr {
    tl: NAME,
    dev_what: "gdr_copy device address",
    iface_what: "gdr_copy interface address",
};

/// The interface attributes of `gdr_copy` (no library needed).
pub fn iface_attr() -> IfaceAttr {
    IfaceAttr {
        tl_name: NAME.into(),
        dev_name: DEVICE.into(),
        dev_type: DeviceType::Accelerator,
        sys_device: None,
        caps: IfaceCaps::PUT_SHORT
            | IfaceCaps::PUT_ZCOPY
            | IfaceCaps::GET_ZCOPY
            | IfaceCaps::CONNECT_TO_IFACE,
        limits: IfaceLimits {
            put_max_short: MAX_SHORT,
            put_max_zcopy: MAX_ZCOPY,
            get_max_zcopy: MAX_ZCOPY,
            max_iov: MAX_IOV,
            ..IfaceLimits::default()
        },
        // CPU stores through write-combined BAR1: about 1 us and several GB/s for writes
        // (reads through the BAR are much slower; the planner uses it for small sizes).
        perf: PerfModel {
            latency_ns: 1_000.0,
            overhead_ns: 100.0,
            bandwidth: 6.9e9,
        },
        priority: 0,
        device_addr_len: ADDR.pack_dev_addr(&[0; 16], 0).len(),
        iface_addr_len: ADDR.pack_iface_addr(0).len(),
        ep_addr_len: 0,
        max_eps: None,
    }
}

static NONCE: AtomicU64 = AtomicU64::new(1);

/// A `gdr_copy` interface.
#[derive(Debug)]
pub struct GdrCopyIface {
    attr: IfaceAttr,
    nonce: u64,
    boot: [u8; 16],
}

impl GdrCopyIface {
    /// A new interface.
    pub fn new() -> GdrCopyIface {
        GdrCopyIface {
            attr: iface_attr(),
            nonce: NONCE.fetch_add(1, Ordering::Relaxed),
            boot: boot_id(),
        }
    }
}

impl Default for GdrCopyIface {
    fn default() -> Self {
        Self::new()
    }
}

impl Iface for GdrCopyIface {
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
        if !self.is_reachable(&params.dev_addr, &params.iface_addr) {
            return Err(Error::InvalidAddress(
                "gdr_copy reaches only its own process; the address names another".into(),
            ));
        }
        Ok(Box::new(GdrCopyEp {
            limits: self.attr.limits,
        }))
    }

    fn progress(&mut self, _sink: &mut dyn FnMut(Event<'_>)) -> usize {
        // Every operation completes when posted.
        0
    }

    fn event_source(&self) -> rucx_uct::EventSource {
        // Nothing completes later and nothing arrives: a sleeper need not look at it.
        rucx_uct::EventSource::Silent
    }
}

/// Endpoint of a `gdr_copy` interface (to this process).
#[derive(Debug)]
pub struct GdrCopyEp {
    limits: IfaceLimits,
}

fn no_am() -> Error {
    Error::Unsupported {
        what: "active messages on gdr_copy".into(),
        why: "gdr_copy only copies between host memory and mapped GPU memory (put/get)".into(),
    }
}

/// Resolve the remote (GPU) side to a live registration covering the range.
fn target(rkey: &RemoteKey, addr: u64, len: usize) -> Result<Arc<Reg>> {
    rkey.check(addr, len as u64)?;
    let k = rkey.inner::<GdrRkey>().ok_or_else(|| Error::InvalidRkey {
        domain: NAME.into(),
        reason: format!("key unpacked by {}", rkey.domain()),
    })?;
    let reg = lookup(k.id).ok_or_else(|| Error::InvalidRkey {
        domain: NAME.into(),
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

fn host_iov(iov: &[Iov<'_>], max: usize) -> Result<usize> {
    let total = Iov::check_all(iov, max)?;
    for v in iov {
        if v.memh.region().mem_type != MemoryType::Host {
            return Err(Error::InvalidParam(format!(
                "gdr_copy copies with the CPU: the local buffer {:#x}+{} must be host memory, \
                 not {}",
                v.addr,
                v.len,
                v.memh.region().mem_type
            )));
        }
    }
    Ok(total)
}

fn copy_failed(what: &str, code: i32) -> Error {
    Error::Device {
        device: "gdrcopy".into(),
        reason: format!("{what} failed with error {code}"),
    }
}

impl Endpoint for GdrCopyEp {
    rucx_uct::no_active_messages!(no_am());

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        check_put_short(data.len(), self.limits.put_max_short, NAME)?;
        if data.is_empty() {
            return Ok(());
        }
        let reg = target(rkey, remote_addr, data.len())?;
        let (gdr, mh) = reg.gdr();
        // SAFETY: the destination lies inside the live registration's mapping (`target`), held
        // by `reg` during the copy; the source is a borrowed slice.
        let r = unsafe {
            gdr.copy_to(
                mh,
                reg.cpu_addr(remote_addr),
                data.as_ptr() as *const c_void,
                data.len(),
            )
        };
        if r != 0 {
            return Err(copy_failed("gdr_copy_to_mapping", r));
        }
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        _token: u64,
    ) -> Result<OpStatus> {
        let total = host_iov(iov, self.limits.max_iov)?;
        if total == 0 {
            return Ok(OpStatus::Done);
        }
        let reg = target(rkey, remote_addr, total)?;
        let (gdr, mh) = reg.gdr();
        let mut at = remote_addr;
        for v in iov.iter().filter(|v| v.len > 0) {
            // SAFETY: the source lies inside its registered host handle (`check_all`), whose
            // owner keeps it valid; the destination inside the live mapping (`target`).
            let r = unsafe { gdr.copy_to(mh, reg.cpu_addr(at), v.addr as *const c_void, v.len) };
            if r != 0 {
                return Err(copy_failed("gdr_copy_to_mapping", r));
            }
            at += v.len as u64;
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
        let total = host_iov(iov, self.limits.max_iov)?;
        if total == 0 {
            return Ok(OpStatus::Done);
        }
        let reg = target(rkey, remote_addr, total)?;
        let (gdr, mh) = reg.gdr();
        let mut at = remote_addr;
        for v in iov.iter().filter(|v| v.len > 0) {
            // SAFETY: the destination lies inside its registered host handle (`check_all`),
            // whose owner keeps it valid and writable; the source inside the live mapping.
            let r = unsafe {
                gdr.copy_from(
                    mh,
                    v.addr as *mut c_void,
                    reg.cpu_addr(at) as *const c_void,
                    v.len,
                )
            };
            if r != 0 {
                return Err(copy_failed("gdr_copy_from_mapping", r));
            }
            at += v.len as u64;
        }
        Ok(OpStatus::Done)
    }

    fn flush(&mut self, _token: u64) -> Result<OpStatus> {
        // Copies through the mapping are complete when the call returns (gdrcopy fences its
        // write-combined stores).
        Ok(OpStatus::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rucx_uct::{MemHandle, MemRegion};

    #[test]
    fn attributes_and_reachability() {
        let a = iface_attr();
        assert_eq!(
            (a.tl_name.as_str(), a.dev_name.as_str()),
            ("gdr_copy", "cuda")
        );
        assert!(a.has(IfaceCaps::PUT_SHORT | IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY));
        assert!(
            !a.caps
                .intersects(IfaceCaps::AM_SHORT | IfaceCaps::AM_BCOPY | IfaceCaps::AM_ZCOPY)
        );
        let mut i = GdrCopyIface::new();
        assert_eq!(a.device_addr_len, i.device_address().len());
        assert_eq!(a.iface_addr_len, i.iface_address().len());
        let dev = i.device_address();
        let ifa = i.iface_address();
        assert!(i.is_reachable(&dev, &ifa));
        let other = ADDR.pack_dev_addr(&boot_id(), std::process::id() + 1);
        assert!(!i.is_reachable(&other, &ifa));
        assert!(
            i.create_ep(&EpParams {
                dev_addr: other,
                iface_addr: ifa.clone(),
                user_id: 0
            })
            .is_err()
        );
        let mut ep = i
            .create_ep(&EpParams {
                dev_addr: dev,
                iface_addr: ifa,
                user_id: 0,
            })
            .unwrap();
        assert!(matches!(
            ep.am_short(0, 0, &[]),
            Err(Error::Unsupported { .. })
        ));
        assert_eq!(ep.flush(1).unwrap(), OpStatus::Done);
        assert_eq!(i.progress(&mut |_| {}), 0);
    }

    #[test]
    fn checks_without_a_mapping() {
        let mut ep = GdrCopyEp {
            limits: iface_attr().limits,
        };
        let k = crate::md::RkeyFields {
            pid: std::process::id(),
            id: u64::MAX,
            addr: 0x10000,
            len: 64,
        };
        let rkey = crate::md::unpack_key(&k.pack()).unwrap();
        let e = ep
            .put_short(&[0; MAX_SHORT + 1], 0x10000, &rkey)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidParam(_)));
        let e = ep.put_short(&[1; 8], 0x10000, &rkey).unwrap_err();
        assert!(e.to_string().contains("released"), "{e}");
        let e = ep.put_short(&[1; 8], 0x1003c, &rkey).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e:?}");
        // The local side must be host memory.
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
            .put_zcopy(&[Iov::whole(&dev)], 0x10000, &rkey, 1)
            .unwrap_err();
        assert!(e.to_string().contains("must be host memory"), "{e}");
        assert_eq!(
            ep.get_zcopy(&[], 0x10000, &rkey, 1).unwrap(),
            OpStatus::Done
        );
    }
}
