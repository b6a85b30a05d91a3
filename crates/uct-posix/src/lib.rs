//! rucx posix transport: shared memory between processes on one host.
//!
//! One component (`posix`), one memory domain (`posix`), one transport resource (`posix` on
//! device `memory`).
//!
//! # Active messages
//!
//! Every interface owns a *receive segment*: an anonymous shared file (`memfd_create`, sealed
//! against resizing, or `shm_open` unlinked at once when memfd is not available or
//! `RUCX_POSIX_SEGMENT=shm`; its size cannot be sealed, so other processes refuse to map it),
//! mode 0600, mapped with memmap2. It holds a lock-free multi-producer single-consumer ring of
//! fixed-size cells (default 256 cells of 8 KiB, 16 bytes of each are the cell header; see
//! [`ring`] for the layout and the ordering protocol). Senders map the peer's segment by opening
//! `/proc/<pid>/fd/<fd>` (both numbers come from the interface address) and copy each message
//! into one cell: `am_short` (8-byte header + payload), `am_bcopy` (packed in place) and
//! `am_zcopy` (header + iov, *copied* into the cell: there is no zero-copy active message over
//! shared memory, so the limit is a cell and the operation completes at once). A full ring makes
//! a send return [`rucx_ucs::Error::NoResource`]; nothing blocks and nothing
//! is overwritten. The receiver polls its ring in [`Iface::progress`](rucx_uct::Iface::progress).
//!
//! Segments never have a name in `/dev/shm` (memfd), or only for the instant between
//! `shm_open` and `shm_unlink` (shm): they go away with the last descriptor and mapping, also
//! when the owner crashes.
//!
//! # Remote memory access
//!
//! `put_short`, `put_zcopy` and `get_zcopy` use cross-memory attach (`process_vm_writev` /
//! `process_vm_readv`): one copy, done by the kernel, synchronously, so every operation returns
//! [`OpStatus::Done`](rucx_uct::OpStatus::Done) and `flush` has nothing to wait for. A remote key
//! carries the owner's pid, its process token and the region; registration is a cheap handle
//! (nothing is pinned). Memory from the domain's
//! [`mem_alloc_shared`](rucx_uct::MemoryDomain::mem_alloc_shared) (a sealed memfd segment;
//! `rucx::Context::mem_alloc` hands it to applications) and any region registered inside it get
//! a key that names the segment: the peer maps the segment once (`/proc/<pid>/fd/<fd>`, the
//! link's tag checked, the mapping kept for the process's life) and every later put/get on it is
//! a plain copy through the mapping, with no system call and no page pinning (cross-memory
//! attach costs a system call plus about 0.25 us per 4 KiB page on the 2-vCPU build machine,
//! which capped it at ~12 GB/s per core). A copy through a mapping never faults: the mapping
//! keeps the pages even after the owner frees them or dies; the endpoint checks the peer as
//! often as its sends do, so a dead owner's operations fail as they do with cross-memory
//! attach. Cross-memory attach needs ptrace permission on the peer: with Yama
//! `ptrace_scope` 1 each process allows any same-user peer (`PR_SET_PTRACER_ANY`, see
//! `RUCX_POSIX_ALLOW_PTRACER`); with scope 2 only `CAP_SYS_PTRACE` helps and with scope 3
//! nothing does. Without permission the domain publishes no remote keys and the interface no
//! put/get capabilities.
//!
//! # Peer failure
//!
//! Each endpoint watches its peer process through a pidfd (pid polling where pidfds are not
//! available) and the segment's `closed` flag: at most once per `RUCX_POSIX_PEER_CHECK` when the
//! ring is full, every 1024 sends, and from the interface's progress. A dead peer makes the
//! interface report [`Event::EpError`](rucx_uct::Event::EpError) once and every later operation on
//! the endpoint fail with [`rucx_ucs::Error::EndpointFailure`].
//!
//! # Performance model
//!
//! Latency 150 ns one way, 30 ns sender overhead, 6 GB/s bandwidth. These are rough figures
//! from `benches/benches/uct_posix.rs` on the 2-core build machine when it was quiet: an 8-byte
//! `am_short` ping-pong took 170-320 ns per round trip, streaming `am_bcopy` of 4-8 KiB ran at
//! 10-25 GB/s with the ring cache-resident, and `put_zcopy` reached 8-12 GB/s from 256 KiB up
//! (about 1.2 us per call below 4 KiB: a system call that pins the pages). 6 GB/s is the
//! conservative middle, the figure UCX's shared memory reaches at 1 MiB on the same machine.

mod addr;
mod iface;
mod mapped;
mod md;
pub mod ring;
mod sys;

use std::sync::Arc;
use std::time::Duration;

use rucx_ucs::{Bounds, Config, Error, MemUnits, OptKind, OptionSpec, Result};
use rucx_uct::{Availability, Component, MemoryDomain};

pub use addr::{DeviceAddr, IfaceAddr, RkeyData, ShmInfo};
pub use iface::{PosixEndpoint, PosixIface};
pub use md::{PosixMd, PosixMemh};
pub use sys::SegmentBacking;

/// Component, domain and transport name.
pub const NAME: &str = "posix";
/// Device name of the only transport resource.
pub const DEVICE: &str = "memory";

/// Options of the posix transport.
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "POSIX_FIFO_SIZE",
        kind: OptKind::UintIn(
            Bounds::new(ring::MIN_CELLS as u64, ring::MAX_CELLS as u64).power_of_two(),
        ),
        default: "256",
        help: "Cells in each interface's receive ring (a power of two, 2 to 65536); a sender gets \
               'no resources' while all of them hold unread messages.",
    },
    OptionSpec {
        name: "POSIX_CELL_SIZE",
        kind: OptKind::MemIn(
            Bounds::new(ring::MIN_CELL_SIZE as u64, ring::MAX_CELL_SIZE as u64).multiple_of(64),
        ),
        default: "8K",
        help: "Bytes per ring cell, 32-byte cell header included (a multiple of 64, 128 to 1M); \
               the largest active message is this minus 32.",
    },
    OptionSpec {
        name: "POSIX_SEGMENT",
        kind: OptKind::Enum(&["auto", "memfd", "shm"]),
        default: "auto",
        help: "How receive segments are created: memfd (never named, size sealed), shm \
               (shm_open, unlinked at once; its size cannot be sealed, so other processes refuse \
               to map it and reach this interface by another transport), or auto (memfd, else \
               shm).",
    },
    OptionSpec {
        name: "POSIX_PEER_CHECK",
        kind: OptKind::Time,
        default: "100ms",
        help: "How often, at most, an endpoint checks whether its peer process is still alive.",
    },
    OptionSpec {
        name: "POSIX_ALLOW_PTRACER",
        kind: OptKind::Bool,
        default: "y",
        help: "Under Yama ptrace_scope=1, let any process of the same user attach to this one \
               (PR_SET_PTRACER_ANY) so that peers can put/get with cross-memory attach; with n, \
               put/get are offered only when CAP_SYS_PTRACE allows them.",
    },
];

/// Settings read from a [`Config`]; options missing from it take their defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Cells per ring.
    pub fifo_size: u32,
    /// Bytes per cell.
    pub cell_size: u32,
    /// Segment backing choice (`None` = auto).
    pub segment: Option<SegmentBacking>,
    /// Peer liveness check interval.
    pub peer_check: Duration,
    /// Whether to call `PR_SET_PTRACER_ANY` under Yama scope 1.
    pub allow_ptracer: bool,
}

fn cfg_err(name: &str, value: String, reason: &str, accepted: &str) -> Error {
    Error::Config {
        var: format!("RUCX_{name}"),
        value,
        reason: reason.to_string(),
        accepted: accepted.to_string(),
    }
}

impl Settings {
    /// Read and validate.
    pub fn from_config(config: &Config) -> Result<Settings> {
        let defaults = Config::new(&[CONFIG])?;
        let cfg = |name: &str| if config.has(name) { config } else { &defaults };
        let fifo = cfg("POSIX_FIFO_SIZE").uint("POSIX_FIFO_SIZE");
        let fifo_size = u32::try_from(fifo)
            .ok()
            .filter(|f| (ring::MIN_CELLS..=ring::MAX_CELLS).contains(f) && f.is_power_of_two())
            .ok_or_else(|| {
                cfg_err(
                    "POSIX_FIFO_SIZE",
                    fifo.to_string(),
                    "not a power of two in range",
                    "2, 4, 8, ... 65536",
                )
            })?;
        let cell = cfg("POSIX_CELL_SIZE").mem_units("POSIX_CELL_SIZE");
        let cell_size = match cell {
            MemUnits::Bytes(b) => u32::try_from(b).ok().filter(|c| {
                (ring::MIN_CELL_SIZE..=ring::MAX_CELL_SIZE).contains(c) && c.is_multiple_of(64)
            }),
            _ => None,
        }
        .ok_or_else(|| {
            cfg_err(
                "POSIX_CELL_SIZE",
                cell.to_string(),
                "not a multiple of 64 between 128 and 1M",
                "128, 192, ..., 8K, ..., 1M",
            )
        })?;
        let segment = match cfg("POSIX_SEGMENT").string("POSIX_SEGMENT") {
            "memfd" => Some(SegmentBacking::Memfd),
            "shm" => Some(SegmentBacking::Shm),
            _ => None,
        };
        Ok(Settings {
            fifo_size,
            cell_size,
            segment,
            peer_check: cfg("POSIX_PEER_CHECK").time("POSIX_PEER_CHECK"),
            allow_ptracer: cfg("POSIX_ALLOW_PTRACER").bool("POSIX_ALLOW_PTRACER"),
        })
    }

    /// Ring shape.
    pub fn geometry(&self) -> ring::Geometry {
        ring::Geometry {
            cell_count: self.fifo_size,
            cell_size: self.cell_size,
        }
    }
}

/// Find a segment backing that works here: create a small segment and reopen it through
/// `/proc/self/fd` the way a peer would.
pub fn probe_backing(
    choice: Option<SegmentBacking>,
) -> std::result::Result<SegmentBacking, String> {
    let candidates: &[SegmentBacking] = match choice {
        Some(SegmentBacking::Memfd) => &[SegmentBacking::Memfd],
        Some(SegmentBacking::Shm) => &[SegmentBacking::Shm],
        None => &[SegmentBacking::Memfd, SegmentBacking::Shm],
    };
    let mut why = Vec::new();
    for &b in candidates {
        let r = sys::create_shared_file(b, 4096).and_then(|f| {
            sys::open_peer_fd(sys::my_pid(), sys::raw_fd(&f) as u32)
                .map(|_| ())
                .map_err(|e| Error::io("reopening it through /proc/self/fd", e))
        });
        match r {
            Ok(()) => return Ok(b),
            Err(e) => why.push(format!("{}: {e}", b.name())),
        }
    }
    Err(format!(
        "no shared-memory segment can be created and reopened ({}); /proc must be mounted and \
         memfd_create or /dev/shm usable (RUCX_POSIX_SEGMENT chooses)",
        why.join("; ")
    ))
}

/// The posix component.
#[derive(Debug, Default, Clone, Copy)]
pub struct PosixComponent;

impl Component for PosixComponent {
    fn name(&self) -> &'static str {
        NAME
    }

    fn transports(&self) -> &'static [&'static str] {
        &[NAME]
    }

    fn query(&self, config: &Config) -> Availability {
        let settings = match Settings::from_config(config) {
            Ok(s) => s,
            Err(e) => return Availability::Unavailable(e.to_string()),
        };
        match probe_backing(settings.segment) {
            Ok(_) => Availability::Available(vec![NAME.to_string()]),
            Err(reason) => Availability::Unavailable(reason),
        }
    }

    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        if md_name != NAME {
            return Err(Error::InvalidParam(format!(
                "component posix has one memory domain, \"posix\", not {md_name:?}"
            )));
        }
        Ok(Arc::new(PosixMd::open(config)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_defaults_and_validation() {
        let empty = Config::new(&[]).unwrap();
        let s = Settings::from_config(&empty).unwrap();
        assert_eq!((s.fifo_size, s.cell_size, s.segment), (256, 8192, None));
        // Out-of-range values are refused where they are read, naming the variable and the
        // range, so posix is never silently unavailable because of them.
        let mut c = Config::new(&[CONFIG]).unwrap();
        for (name, value, range) in [
            ("POSIX_FIFO_SIZE", "100", "a power of two from 2 to 65536"),
            ("POSIX_FIFO_SIZE", "3", "a power of two from 2 to 65536"),
            ("POSIX_FIFO_SIZE", "1", "a power of two from 2 to 65536"),
            ("POSIX_CELL_SIZE", "1000", "a multiple of 64 from 128 to 1M"),
            ("POSIX_CELL_SIZE", "100", "a multiple of 64 from 128 to 1M"),
            ("POSIX_CELL_SIZE", "2M", "a multiple of 64 from 128 to 1M"),
        ] {
            let e = c.set(name, value).unwrap_err().to_string();
            assert!(
                e.contains(&format!("RUCX_{name}")) && e.contains(range),
                "{e}"
            );
            let e = Config::from_vars(&[CONFIG], [(format!("RUCX_{name}"), value)]).unwrap_err();
            assert!(e.to_string().contains(&format!("RUCX_{name}")), "{e}");
        }
        assert_eq!(Settings::from_config(&c).unwrap().fifo_size, 256);
        c.set("POSIX_CELL_SIZE", "4K").unwrap();
        c.set("POSIX_SEGMENT", "shm").unwrap();
        let s = Settings::from_config(&c).unwrap();
        assert_eq!((s.cell_size, s.segment), (4096, Some(SegmentBacking::Shm)));
    }

    #[test]
    fn available_here() {
        let c = Config::new(&[CONFIG]).unwrap();
        assert_eq!(
            PosixComponent.query(&c),
            Availability::Available(vec!["posix".to_string()])
        );
        assert!(PosixComponent.open_md("tcp", &c).is_err());
        assert!(probe_backing(Some(SegmentBacking::Shm)).is_ok());
    }
}
