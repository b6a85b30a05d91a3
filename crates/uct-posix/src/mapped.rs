//! Peers' shared segments mapped into this process: the single-copy path of put/get.
//!
//! Memory a process allocated through [`PosixMd::mem_alloc_shared`](crate::PosixMd) (and any
//! region registered inside such an allocation) is a `memfd`/`shm` segment. Its remote key
//! names the segment (`/proc/<pid>/fd/<fd>` and a tag of the link), so a peer on this host maps
//! the segment once and then moves data with a plain `memcpy`: no system call, no page pinning
//! per transfer (cross-memory attach costs a system call plus about a quarter of a microsecond
//! per 4 KiB page). UCX's `rkey_ptr` of its shared-memory domains is the same idea.
//!
//! Mappings are cached for the life of the process, keyed by the owner (pid, process token),
//! the descriptor and the tag, so a descriptor number reused for another segment never finds
//! the old mapping. A mapping keeps the segment's pages alive: a copy through it never faults,
//! even when the owner exits or frees the allocation while the copy runs (the copy then reads
//! what the owner last wrote, and the owner's death is reported by the endpoint's checks).
//! Only a segment whose size is sealed (a memfd segment, [`sys::create_shared_file`]) is
//! mapped: the owner of one that can shrink (a shm segment, or a file a hostile peer made)
//! could truncate it under the mapping and make a copy fault (`SIGBUS`); such keys are served
//! by cross-memory attach, which reports a vanished page as an error.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use rucx_ucs::{Error, Result};

use crate::NAME;
use crate::addr::{RkeyData, ShmInfo};
use crate::sys;

/// A peer's segment mapped here.
#[derive(Debug)]
pub(crate) struct PeerSegment {
    map: memmap2::MmapRaw,
    /// The segment's address in its owner.
    seg_base: u64,
}

impl PeerSegment {
    /// The local address of `len` bytes at the owner's address `remote`, when they lie inside
    /// the segment.
    pub(crate) fn local(&self, remote: u64, len: usize) -> Option<usize> {
        let off = remote.checked_sub(self.seg_base)?;
        let end = off.checked_add(len as u64)?;
        if end > self.map.len() as u64 {
            return None;
        }
        Some(self.map.as_mut_ptr() as usize + off as usize)
    }
}

type SegKey = (u32, u64, u32, u64);

/// A mapped segment, or `None` for one that is not mapped (its size is not sealed).
pub(crate) type MaybeSegment = Option<Arc<PeerSegment>>;

static SEGMENTS: LazyLock<Mutex<HashMap<SegKey, MaybeSegment>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The segment of key `k` (with shared-segment part `shm`), mapped on first use; `None` when
/// its size is not sealed and the owner is another process (then use cross-memory attach).
pub(crate) fn segment(k: &RkeyData, shm: &ShmInfo) -> Result<MaybeSegment> {
    let key = (k.pid, k.token, shm.fd, shm.tag);
    let mut segs = SEGMENTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = segs.get(&key) {
        return Ok(s.clone());
    }
    let file = sys::open_peer_fd(k.pid, shm.fd).map_err(|e| Error::EndpointFailure {
        peer: format!("posix process {}", k.pid),
        reason: format!(
            "cannot open its shared segment (descriptor {}): {e}",
            shm.fd
        ),
    })?;
    // The descriptor must still be the segment the key was made for.
    if fd_link_tag(k.pid, shm.fd).unwrap_or(0) != shm.tag {
        return Err(Error::InvalidRkey {
            domain: NAME.into(),
            reason: format!(
                "descriptor {} of process {} is no longer the shared segment of this key",
                shm.fd, k.pid
            ),
        });
    }
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size < shm.seg_len || shm.seg_len == 0 || shm.seg_len > isize::MAX as u64 {
        return Err(Error::InvalidRkey {
            domain: NAME.into(),
            reason: format!(
                "segment of process {} has {size} bytes, the key says {}",
                k.pid, shm.seg_len
            ),
        });
    }
    if k.pid != sys::my_pid() && !sys::size_sealed(&file) {
        tracing::debug!(
            "posix: the shared segment of process {} (descriptor {}) can shrink; its keys use \
             cross-memory attach",
            k.pid,
            shm.fd
        );
        segs.insert(key, None);
        return Ok(None);
    }
    // Populated at once: the first copies through a fresh mapping would otherwise take a page
    // fault per 4 KiB page (a 4 MiB receive buffer: ~1000 faults inside the first transfer).
    let map = memmap2::MmapOptions::new()
        .len(shm.seg_len as usize)
        .populate()
        .map_raw(&file)
        .map_err(|e| {
            Error::io(
                format!("posix: mapping the segment of process {}", k.pid),
                e,
            )
        })?;
    let s = Arc::new(PeerSegment {
        map,
        seg_base: shm.seg_base,
    });
    segs.insert(key, Some(s.clone()));
    Ok(Some(s))
}

/// FNV-1a 64 of what `/proc/<pid>/fd/<fd>` points to (the segment's unique name).
pub(crate) fn fd_link_tag(pid: u32, fd: u32) -> std::io::Result<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in link.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    Ok(h)
}
