//! Worker addresses: what a peer needs to reach every interface of a worker.
//!
//! Packed inside the common envelope of `rucx_uct::rkey` (magic, version, length, checksum), so a
//! garbage or truncated address is an error, never a panic.

use rucx_ucs::{Error, Result};
use rucx_uct::rkey::{self, Reader, put_lv};

const ENVELOPE: &str = "ucp-worker-address";

/// One interface of a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfaceEntry {
    /// Transport name.
    pub tl_name: String,
    /// Device name.
    pub dev_name: String,
    /// Memory domain name (remote keys are matched by it).
    pub md_name: String,
    /// Packed device address.
    pub dev_addr: Vec<u8>,
    /// Packed interface address.
    pub iface_addr: Vec<u8>,
}

/// A process as the kernel knows it: a peer whose stamp has the same boot and pid namespace
/// as ours can be looked up by pid in `/proc`, and its start time tells it from a later process
/// that reused the pid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcStamp {
    /// FNV-1a hash of the kernel's boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot: u64,
    /// Inode of the pid namespace (`/proc/self/ns/pid`).
    pub pidns: u64,
    /// Start time of the process in clock ticks since boot (`/proc/<pid>/stat`, field 22).
    pub start: u64,
}

impl ProcStamp {
    /// True when both stamps are known and their pids live in one pid space of one kernel.
    pub fn same_pid_space(&self, other: &ProcStamp) -> bool {
        self.boot != 0 && self.pidns != 0 && self.boot == other.boot && self.pidns == other.pidns
    }
}

/// A worker's address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerAddress {
    /// Random identifier of the worker, carried in every message it sends.
    pub uuid: u64,
    /// Host name, for messages.
    pub host: String,
    /// Process id, for messages and the liveness check of same-host peers.
    pub pid: u32,
    /// Who the process is to the kernel, for the liveness check of same-host peers; all zero
    /// where unknown.
    pub proc: ProcStamp,
    /// Interfaces.
    pub ifaces: Vec<IfaceEntry>,
}

impl WorkerAddress {
    /// Pack into bytes.
    pub fn pack(&self) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&self.uuid.to_le_bytes());
        p.extend_from_slice(&self.pid.to_le_bytes());
        for v in [self.proc.boot, self.proc.pidns, self.proc.start] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        put_lv(&mut p, self.host.as_bytes());
        p.extend_from_slice(&(self.ifaces.len() as u16).to_le_bytes());
        for e in &self.ifaces {
            put_lv(&mut p, e.tl_name.as_bytes());
            put_lv(&mut p, e.dev_name.as_bytes());
            put_lv(&mut p, e.md_name.as_bytes());
            put_lv(&mut p, &e.dev_addr);
            put_lv(&mut p, &e.iface_addr);
        }
        rkey::pack(ENVELOPE, &p)
    }

    /// Unpack and validate.
    pub fn unpack(bytes: &[u8]) -> Result<WorkerAddress> {
        let payload = rkey::unpack(ENVELOPE, "worker address", bytes)
            .map_err(|e| Error::InvalidAddress(format!("not a rucx worker address: {e}")))?;
        let mut r = Reader::new(payload, "worker address");
        let uuid = r.u64()?;
        let pid = r.u32()?;
        let proc = ProcStamp {
            boot: r.u64()?,
            pidns: r.u64()?,
            start: r.u64()?,
        };
        let host = text(r.lv()?)?;
        let n = r.u16()? as usize;
        let mut ifaces = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            ifaces.push(IfaceEntry {
                tl_name: text(r.lv()?)?,
                dev_name: text(r.lv()?)?,
                md_name: text(r.lv()?)?,
                dev_addr: r.lv()?.to_vec(),
                iface_addr: r.lv()?.to_vec(),
            });
        }
        r.finish()?;
        Ok(WorkerAddress {
            uuid,
            host,
            pid,
            proc,
            ifaces,
        })
    }

    /// `host:pid` for messages.
    pub fn describe(&self) -> String {
        format!("{}:{}", self.host, self.pid)
    }
}

fn text(b: &[u8]) -> Result<String> {
    String::from_utf8(b.to_vec())
        .map_err(|_| Error::InvalidAddress("worker address holds a name that is not UTF-8".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> WorkerAddress {
        WorkerAddress {
            uuid: 42,
            host: "node1".into(),
            pid: 7,
            proc: ProcStamp {
                boot: 1,
                pidns: 2,
                start: 3,
            },
            ifaces: vec![IfaceEntry {
                tl_name: "posix".into(),
                dev_name: "memory".into(),
                md_name: "posix".into(),
                dev_addr: vec![1, 2, 3],
                iface_addr: vec![9; 12],
            }],
        }
    }

    #[test]
    fn round_trip() {
        let a = sample();
        assert_eq!(WorkerAddress::unpack(&a.pack()).unwrap(), a);
    }

    /// Bytes an address holds on the heap.
    fn held(a: &WorkerAddress) -> usize {
        a.host.len()
            + a.ifaces
                .iter()
                .map(|e| {
                    e.tl_name.len()
                        + e.dev_name.len()
                        + e.md_name.len()
                        + e.dev_addr.len()
                        + e.iface_addr.len()
                })
                .sum::<usize>()
    }

    proptest! {
        /// The envelope's checksum is no secret: a hostile peer wraps whatever it likes in a
        /// valid one. Payloads of a real address with bits flipped, cut, a length or count set
        /// to the largest value, or bytes added, each in a valid envelope: an error, or an
        /// address that holds no more than the bytes it came from.
        #[test]
        fn lies_inside_a_valid_envelope_are_errors_or_bounded(
            edits in proptest::collection::vec((0u8..4, any::<usize>(), any::<u8>()), 1..4),
        ) {
            let mut two = sample();
            two.ifaces.push(two.ifaces[0].clone());
            let mut p = rkey::unpack(ENVELOPE, "t", &two.pack()).unwrap().to_vec();
            for (kind, pos, v) in edits {
                match kind {
                    0 => { let i = pos % p.len(); p[i] ^= 1 << (v % 8); }
                    1 => p.truncate(pos % (p.len() + 1)),
                    2 if p.len() >= 2 => {
                        let i = pos % (p.len() - 1);
                        p[i..i + 2].copy_from_slice(&u16::MAX.to_le_bytes());
                    }
                    _ => p.push(v),
                }
                if p.is_empty() {
                    p.push(v);
                }
            }
            let blob = rkey::pack(ENVELOPE, &p);
            match WorkerAddress::unpack(&blob) {
                Ok(a) => prop_assert!(held(&a) <= p.len()),
                Err(e) => prop_assert!(matches!(e, Error::InvalidAddress(_)), "{e:?}"),
            }
        }

        #[test]
        fn garbage_and_truncation_are_errors(g in proptest::collection::vec(any::<u8>(), 0..200), cut in 1usize..40) {
            let _ = WorkerAddress::unpack(&g);
            let p = sample().pack();
            let n = p.len().saturating_sub(cut);
            prop_assert!(WorkerAddress::unpack(&p[..n]).is_err());
        }
    }
}
