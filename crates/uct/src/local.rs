//! Addresses of transports that reach only their own process (`cuda_copy`, `gdr_copy`): the
//! "remote" side of every operation is memory of this process named by a remote key.
//!
//! Both addresses are in the common envelope ([`rkey::pack`]) tagged with the transport name:
//! device address = `boot_id[16]`, `pid: u32`; interface address = `nonce: u64`. An interface
//! reaches a peer whose device address names this boot and this process, and whose interface
//! address parses.

use rucx_ucs::{Error, Result};

use crate::rkey::{self, Reader};

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`, 32 hex digits) as 16 bytes; all
/// zeros where it cannot be read or parsed.
pub fn boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let digits: Vec<u8> = s
            .bytes()
            .filter(u8::is_ascii_hexdigit)
            .map(|c| (c as char).to_digit(16).unwrap_or(0) as u8)
            .collect();
        if digits.len() == 32 {
            for (i, b) in id.iter_mut().enumerate() {
                *b = (digits[2 * i] << 4) | digits[2 * i + 1];
            }
        }
    }
    id
}

/// The address format of one process-local transport.
#[derive(Clone, Copy, Debug)]
pub struct ProcessAddr {
    /// Transport name: the envelope's tag.
    pub tl: &'static str,
    /// Names the device address in errors (`"cuda_copy device address"`).
    pub dev_what: &'static str,
    /// Names the interface address in errors (`"cuda_copy interface address"`).
    pub iface_what: &'static str,
}

impl ProcessAddr {
    /// Pack a device address.
    pub fn pack_dev_addr(&self, boot: &[u8; 16], pid: u32) -> Vec<u8> {
        let mut p = boot.to_vec();
        p.extend_from_slice(&pid.to_le_bytes());
        rkey::pack(self.tl, &p)
    }

    /// Unpack a device address into (boot id, pid).
    pub fn unpack_dev_addr(&self, blob: &[u8]) -> Result<([u8; 16], u32)> {
        let p = rkey::unpack(self.tl, self.dev_what, blob)
            .map_err(|e| Error::InvalidAddress(e.to_string()))?;
        let mut r = Reader::new(p, self.dev_what);
        let boot: [u8; 16] = r
            .bytes(16)?
            .try_into()
            .map_err(|_| Error::Internal("16 bytes".into()))?;
        let pid = r.u32()?;
        r.finish()?;
        Ok((boot, pid))
    }

    /// Pack an interface address.
    pub fn pack_iface_addr(&self, nonce: u64) -> Vec<u8> {
        rkey::pack(self.tl, &nonce.to_le_bytes())
    }

    /// Unpack an interface address into its nonce.
    pub fn unpack_iface_addr(&self, blob: &[u8]) -> Result<u64> {
        let p = rkey::unpack(self.tl, self.iface_what, blob)
            .map_err(|e| Error::InvalidAddress(e.to_string()))?;
        let mut r = Reader::new(p, self.iface_what);
        let n = r.u64()?;
        r.finish()?;
        Ok(n)
    }

    /// Whether the addresses name this process (of boot `boot`) and parse.
    pub fn is_reachable(&self, boot: &[u8; 16], dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        matches!(self.unpack_dev_addr(dev_addr), Ok((b, p)) if b == *boot && p == std::process::id())
            && self.unpack_iface_addr(iface_addr).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADDR: ProcessAddr = ProcessAddr {
        tl: "t",
        dev_what: "t device address",
        iface_what: "t interface address",
    };

    #[test]
    fn boot_id_is_stable() {
        assert_eq!(boot_id(), boot_id());
    }

    #[test]
    fn round_trip_and_reachability() {
        let boot = [7u8; 16];
        let pid = std::process::id();
        let dev = ADDR.pack_dev_addr(&boot, pid);
        let iface = ADDR.pack_iface_addr(42);
        assert_eq!(ADDR.unpack_dev_addr(&dev).unwrap(), (boot, pid));
        assert_eq!(ADDR.unpack_iface_addr(&iface).unwrap(), 42);
        assert!(ADDR.is_reachable(&boot, &dev, &iface));
        // Another process, another boot, a bad interface address, another transport's tag.
        let other = ADDR.pack_dev_addr(&boot, pid.wrapping_add(1));
        assert!(!ADDR.is_reachable(&boot, &other, &iface));
        assert!(!ADDR.is_reachable(&[8; 16], &dev, &iface));
        assert!(!ADDR.is_reachable(&boot, &dev, &iface[..iface.len() - 1]));
        let foreign = rkey::pack("u", &42u64.to_le_bytes());
        assert!(matches!(
            ADDR.unpack_iface_addr(&foreign),
            Err(Error::InvalidAddress(_))
        ));
        // Trailing bytes and truncation are errors, not panics.
        let mut long = boot.to_vec();
        long.extend_from_slice(&pid.to_le_bytes());
        long.push(0);
        assert!(ADDR.unpack_dev_addr(&rkey::pack("t", &long)).is_err());
        assert!(ADDR.unpack_dev_addr(&rkey::pack("t", &boot[..15])).is_err());
    }
}
