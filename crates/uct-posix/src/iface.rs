//! The posix interface (owner of a receive ring) and its endpoints (senders into a peer's ring).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;
use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::iface::{AM_ID_MAX, check_packed};
use rucx_uct::{
    AmId, DeviceType, Endpoint, EpParams, Event, EventSource, Iface, IfaceAttr, IfaceCaps,
    IfaceLimits, Iov, OpStatus, PerfModel, RemoteKey,
};

use crate::addr::{DeviceAddr, IfaceAddr, RkeyData, ShmInfo};
use crate::mapped::{self, MaybeSegment};
use crate::ring::{Cursor, Geometry, Ring, SegIdentity, StallWatch};
use crate::sys::{self, CmaDir, ProcWatch, SegmentBacking, WakePipe};
use crate::{DEVICE, NAME, Settings};

/// Largest user header of `am_zcopy` (bounded by half a cell for tiny cells).
const AM_MAX_HDR: usize = 128;
/// Largest `put_short`.
const PUT_MAX_SHORT: usize = 4096;
/// Most iov entries per zero-copy operation.
const MAX_IOV: usize = 64;
/// Messages delivered per progress call at most.
const PROGRESS_BUDGET: usize = 64;
/// Progress calls between liveness-check opportunities.
const PROGRESS_CHECK_EVERY: u32 = 32;
/// Sends between liveness-check opportunities.
const SEND_CHECK_EVERY: u32 = 1024;
/// A sender facing a full ring checks its peer on every this many refused sends.
const FULL_CHECK_EVERY: u32 = 64;

/// State an endpoint shares with the interface that created it, so that the interface can
/// report the endpoint's failure from `progress`.
#[derive(Debug)]
struct EpShared {
    user_id: u64,
    peer: IfaceAddr,
    ring: Ring,
    /// The peer's wake-up pipe, written when the peer is armed (see `ring`'s wake-ups).
    wake: File,
    watch: ProcWatch,
    failure: OnceLock<String>,
    reported: AtomicBool,
}

impl EpShared {
    fn peer_name(&self) -> String {
        format!("posix interface of pid {}", self.peer.pid)
    }

    fn error(&self) -> Option<Error> {
        self.failure.get().map(|reason| Error::EndpointFailure {
            peer: self.peer_name(),
            reason: reason.clone(),
        })
    }

    /// Record a failure (the first reason wins) and return the endpoint error.
    fn fail(&self, reason: String) -> Error {
        let _ = self.failure.set(reason);
        self.error()
            .unwrap_or_else(|| Error::Internal("failure not recorded".into()))
    }

    /// Look at the peer now; records and returns the failure when it is gone.
    fn check_peer(&self) -> Option<Error> {
        if let Some(e) = self.error() {
            return Some(e);
        }
        if self.watch.exited() {
            return Some(self.fail(format!("process {} exited", self.peer.pid)));
        }
        if self.ring.is_closed() {
            return Some(self.fail("the peer closed its interface".into()));
        }
        None
    }
}

fn perf_model() -> PerfModel {
    PerfModel {
        latency_ns: 150.0,
        overhead_ns: 30.0,
        bandwidth: 6.0e9,
    }
}

fn iface_attr(geo: Geometry, cma: bool) -> IfaceAttr {
    let cap = geo.capacity();
    let am_max_hdr = AM_MAX_HDR.min(cap / 2);
    let mut caps = IfaceCaps::AM_SHORT
        | IfaceCaps::AM_BCOPY
        | IfaceCaps::AM_ZCOPY
        | IfaceCaps::CONNECT_TO_IFACE
        | IfaceCaps::ERRHANDLE_PEER_FAILURE;
    if cma {
        caps |= IfaceCaps::PUT_SHORT | IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY;
    }
    let rma = |n: usize| if cma { n } else { 0 };
    let example_dev = DeviceAddr {
        boot_id: [0; 16],
        pid_ns: 0,
    };
    let example_iface = IfaceAddr {
        pid: 1,
        fd: 0,
        seg_id: 0,
        token: 0,
        geo,
    };
    IfaceAttr {
        tl_name: NAME.into(),
        dev_name: DEVICE.into(),
        dev_type: DeviceType::IntraNode,
        sys_device: None,
        caps,
        limits: IfaceLimits {
            am_max_short: cap - 8,
            am_max_bcopy: cap,
            am_max_zcopy: cap - am_max_hdr,
            am_max_hdr,
            put_max_short: rma(PUT_MAX_SHORT),
            put_max_zcopy: rma(isize::MAX as usize),
            get_max_zcopy: rma(isize::MAX as usize),
            max_iov: MAX_IOV,
        },
        perf: perf_model(),
        priority: 0,
        device_addr_len: example_dev.pack().len(),
        iface_addr_len: example_iface.pack().len(),
        ep_addr_len: 0,
        max_eps: None,
    }
}

/// A posix interface: owns a receive segment and delivers what arrives in it.
#[derive(Debug)]
pub struct PosixIface {
    attr: IfaceAttr,
    // Keeps the segment's descriptor (whose number is in the address) open.
    _file: File,
    ring: Ring,
    tail: Cursor,
    /// Senders write a byte here when they find the ring armed.
    wake: WakePipe,
    /// The ring is (or may still be) armed: the next progress disarms it and drains `wake`.
    armed: bool,
    addr: IfaceAddr,
    dev: DeviceAddr,
    backing: SegmentBacking,
    cma: bool,
    eps: Vec<Weak<EpShared>>,
    stall: StallWatch,
    calls: u32,
    last_check: Instant,
    peer_check: Duration,
}

impl PosixIface {
    /// Wake up if armed, and hand what arrived in the ring to `sink`; how many messages.
    #[inline(never)]
    fn receive_ready(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        if self.armed {
            // Awake: senders need not write the pipe any more; empty it, so the descriptor
            // reads as idle until the next arm.
            self.armed = false;
            self.ring.disarm();
            self.wake.drain();
        }
        self.ring
            .receive(&mut self.tail, PROGRESS_BUDGET, &mut |id, data| {
                sink(Event::Am { id, data })
            })
    }

    /// Create the receive segment and the interface.
    pub fn open(settings: &Settings, backing: SegmentBacking, cma: bool) -> Result<PosixIface> {
        let geo = settings.geometry().validate("posix interface")?;
        let file = sys::create_shared_file(backing, geo.segment_size() as u64)?;
        let map = MmapRaw::map_raw(&file).map_err(|e| {
            Error::io(
                format!(
                    "posix: mapping a {}-byte receive segment",
                    geo.segment_size()
                ),
                e,
            )
        })?;
        let fd =
            u32::try_from(sys::raw_fd(&file)).map_err(|_| Error::Internal("negative fd".into()))?;
        let id = SegIdentity {
            owner_pid: sys::my_pid(),
            seg_id: sys::random_u64(),
            token: sys::process_token(),
        };
        let wake = WakePipe::new()
            .map_err(|e| Error::io("posix: creating the interface's wake-up pipe", e))?;
        let wake_fd =
            u32::try_from(wake.fd()).map_err(|_| Error::Internal("negative fd".into()))?;
        let ring = Ring::init(map, geo, id, wake_fd)?;
        let (boot_id, pid_ns) = sys::host_identity();
        Ok(PosixIface {
            attr: iface_attr(geo, cma),
            _file: file,
            ring,
            tail: Cursor::default(),
            wake,
            armed: false,
            addr: IfaceAddr {
                pid: id.owner_pid,
                fd,
                seg_id: id.seg_id,
                token: id.token,
                geo,
            },
            dev: DeviceAddr { boot_id, pid_ns },
            backing,
            cma,
            eps: Vec::new(),
            stall: StallWatch::default(),
            calls: 0,
            last_check: Instant::now(),
            peer_check: settings.peer_check,
        })
    }

    /// How the receive segment was created.
    pub fn backing(&self) -> SegmentBacking {
        self.backing
    }

    /// The unpacked interface address.
    pub fn address(&self) -> IfaceAddr {
        self.addr
    }

    fn maintenance(&mut self, idle: bool, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        if idle {
            self.stall.check(&self.ring, &mut self.tail);
        }
        let mut n = 0;
        self.eps.retain(|w| {
            let Some(ep) = w.upgrade() else { return false };
            let err = ep.check_peer();
            if let Some(error) = err
                && !ep.reported.swap(true, Ordering::AcqRel)
            {
                sink(Event::EpError {
                    user_id: ep.user_id,
                    error,
                });
                n += 1;
            }
            true
        });
        n
    }
}

impl Drop for PosixIface {
    fn drop(&mut self) {
        // Senders that still map the segment see this and fail instead of filling a ring that
        // nobody reads.
        self.ring.close();
    }
}

fn connect_error(a: &IfaceAddr, e: io::Error) -> Error {
    let path = format!("/proc/{}/fd/{}", a.pid, a.fd);
    match e.kind() {
        io::ErrorKind::NotFound => Error::EndpointFailure {
            peer: format!("posix interface of pid {}", a.pid),
            reason: format!("cannot open its segment at {path}: the process or interface is gone"),
        },
        io::ErrorKind::PermissionDenied => Error::io(
            format!(
                "posix: opening the peer segment {path} (the peer must run as the same user and \
                 allow ptrace-read access)"
            ),
            e,
        ),
        _ => Error::io(format!("posix: opening the peer segment {path}"), e),
    }
}

impl Iface for PosixIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        self.dev.pack()
    }

    fn iface_address(&self) -> Vec<u8> {
        self.addr.pack()
    }

    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        let same_host = DeviceAddr::unpack(dev_addr).is_ok_and(|d| d == self.dev);
        same_host
            && IfaceAddr::unpack(iface_addr)
                .is_ok_and(|a| std::path::Path::new(&format!("/proc/{}", a.pid)).exists())
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        let dev = DeviceAddr::unpack(&params.dev_addr)?;
        if dev != self.dev {
            return Err(Error::Unsupported {
                what: "a posix endpoint to this peer".into(),
                why: "the peer runs on another host or in another pid namespace".into(),
            });
        }
        let a = IfaceAddr::unpack(&params.iface_addr)?;
        // Watch the process first: if the segment below opens and matches, the watched process
        // is the owner (a reused pid would not have the segment).
        let watch = ProcWatch::new(a.pid);
        let file = sys::open_peer_fd(a.pid, a.fd).map_err(|e| connect_error(&a, e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(format!("posix: inspecting the segment of pid {}", a.pid), e))?;
        if !meta.is_file() || meta.len() != a.geo.segment_size() as u64 {
            return Err(Error::InvalidAddress(format!(
                "posix: descriptor {} of pid {} is not a segment of {} bytes (stale address?)",
                a.fd,
                a.pid,
                a.geo.segment_size()
            )));
        }
        if a.pid != sys::my_pid() && !sys::size_sealed(&file) {
            // Mapped, a segment that can shrink would make our sends fault (SIGBUS) once its
            // owner truncated it; rucx seals every memfd segment, a shm one cannot be sealed.
            return Err(Error::Unsupported {
                what: format!("a posix endpoint to pid {}", a.pid),
                why: "its receive segment's size is not sealed (POSIX_SEGMENT=shm there, or not \
                      a rucx segment): it could shrink under our mapping"
                    .into(),
            });
        }
        let map = MmapRaw::map_raw(&file)
            .map_err(|e| Error::io(format!("posix: mapping the segment of pid {}", a.pid), e))?;
        let ring = Ring::attach(
            map,
            a.geo,
            SegIdentity {
                owner_pid: a.pid,
                seg_id: a.seg_id,
                token: a.token,
            },
        )?;
        let wake = sys::open_peer_wake(a.pid, ring.wake_fd()).map_err(|e| {
            Error::io(
                format!(
                    "posix: opening the wake-up pipe (descriptor {}) of pid {}",
                    ring.wake_fd(),
                    a.pid
                ),
                e,
            )
        })?;
        let shared = Arc::new(EpShared {
            user_id: params.user_id,
            peer: a,
            ring,
            wake,
            watch,
            failure: OnceLock::new(),
            reported: AtomicBool::new(false),
        });
        if let Some(e) = shared.check_peer() {
            return Err(e);
        }
        self.eps.push(Arc::downgrade(&shared));
        let full_msg = format!(
            "receive ring of the posix interface of pid {} is full ({} cells)",
            a.pid, a.geo.cell_count
        );
        Ok(Box::new(PosixEndpoint {
            shared,
            limits: self.attr.limits,
            cma: self.cma,
            sends: 0,
            full: 0,
            full_msg,
            last_check: Instant::now(),
            peer_check: self.peer_check,
            segs: HashMap::new(),
            last_seg: None,
        }))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        // An idle poll (the usual answer) reads one word of the ring and nothing else.
        let mut n = if self.armed || !self.ring.is_idle(&self.tail) {
            self.receive_ready(sink)
        } else {
            0
        };
        self.calls = self.calls.wrapping_add(1);
        if self.calls.is_multiple_of(PROGRESS_CHECK_EVERY)
            && self.last_check.elapsed() >= self.peer_check
        {
            self.last_check = Instant::now();
            n += self.maintenance(n == 0, sink);
        }
        n
    }

    fn event_source(&self) -> EventSource {
        EventSource::Fd(self.wake.fd())
    }

    fn arm(&mut self) -> Result<()> {
        // A wake-up byte of an earlier arm would make the descriptor read as ready at once.
        self.wake.drain();
        if self.ring.arm(&mut self.tail) {
            self.armed = true;
            return Ok(());
        }
        Err(Error::Busy(format!(
            "messages wait in the receive ring of the posix interface of pid {}",
            self.addr.pid
        )))
    }
}

/// Copy `src` to the start of `dst` (which is at least as long). A short message's bytes, a
/// few words at most, go by two overlapping moves of a word or half a word instead of a call
/// of `memcpy`, which costs more than the copy at this size.
#[inline(always)]
fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    let dst = &mut dst[..n];
    if (8..=16).contains(&n) {
        dst[..8].copy_from_slice(&src[..8]);
        dst[n - 8..].copy_from_slice(&src[n - 8..]);
    } else if (4..8).contains(&n) {
        dst[..4].copy_from_slice(&src[..4]);
        dst[n - 4..].copy_from_slice(&src[n - 4..]);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Pieces of an iov kept inline; more spill into a vector.
const PIECES_INLINE: usize = 4;

/// The `(address, length)` pieces of an iov: a send or an RMA operation of a few pieces
/// allocates nothing, and returning them moves a few words (an inline array of every
/// `MAX_IOV` pieces was a kilobyte zeroed and copied per put or get).
#[derive(Debug, Default)]
struct Pieces {
    inline: [(usize, usize); PIECES_INLINE],
    len: usize,
    more: Vec<(usize, usize)>,
}

impl Pieces {
    fn push(&mut self, piece: (usize, usize)) {
        if self.more.is_empty() && self.len < PIECES_INLINE {
            self.inline[self.len] = piece;
            self.len += 1;
        } else {
            if self.more.is_empty() {
                self.more.extend_from_slice(&self.inline[..self.len]);
            }
            self.more.push(piece);
        }
    }
}

impl std::ops::Deref for Pieces {
    type Target = [(usize, usize)];

    fn deref(&self) -> &[(usize, usize)] {
        if self.more.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.more
        }
    }
}

/// A posix endpoint: sends into one peer interface's ring and reaches its memory through
/// cross-memory attach.
#[derive(Debug)]
pub struct PosixEndpoint {
    shared: Arc<EpShared>,
    limits: IfaceLimits,
    cma: bool,
    sends: u32,
    /// Sends refused in a row because the peer's ring was full.
    full: u32,
    /// The message of those refusals.
    full_msg: String,
    last_check: Instant,
    peer_check: Duration,
    /// The peer's segments mapped put/get used, by (descriptor, tag): found without the
    /// process-wide map's lock.
    segs: HashMap<(u32, u64), MaybeSegment>,
    /// The segment of the last put/get, found without hashing (a transfer in pieces, or a
    /// peer's buffer used again, names the same one).
    last_seg: Option<((u32, u64), MaybeSegment)>,
}

impl PosixEndpoint {
    fn ensure_ok(&self) -> Result<()> {
        match self.shared.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Check the peer if the last check is older than the interval.
    fn check_peer_bounded(&mut self) -> Result<()> {
        if self.last_check.elapsed() >= self.peer_check {
            self.last_check = Instant::now();
            if let Some(e) = self.shared.check_peer() {
                return Err(e);
            }
        }
        Ok(())
    }

    fn send<F>(&mut self, fill: F) -> Result<usize>
    where
        F: FnOnce(&mut [u8]) -> Result<(AmId, usize)>,
    {
        self.ensure_ok()?;
        self.sends = self.sends.wrapping_add(1);
        if self.sends.is_multiple_of(SEND_CHECK_EVERY) {
            self.check_peer_bounded()?;
        }
        match self.shared.ring.send(fill)? {
            Some(n) => {
                if self.shared.ring.take_wakeup() {
                    sys::poke(&self.shared.wake);
                }
                self.full = 0;
                Ok(n)
            }
            None => {
                // A sender retries a full ring from every progress call: check the peer (a
                // clock read) on the first failure and then every so often, and hand out the
                // message formatted once.
                if self.full.is_multiple_of(FULL_CHECK_EVERY) {
                    self.check_peer_bounded()?;
                }
                self.full = self.full.wrapping_add(1);
                Err(Error::NoResource(self.full_msg.clone()))
            }
        }
    }

    fn check_id(id: AmId) -> Result<()> {
        if usize::from(id) >= AM_ID_MAX {
            return Err(Error::InvalidParam(format!(
                "active message id {id} is out of range (0..{AM_ID_MAX})"
            )));
        }
        Ok(())
    }

    fn rkey_of<'a>(&self, rkey: &'a RemoteKey) -> Result<&'a RkeyData> {
        if !self.cma {
            return Err(Error::Unsupported {
                what: "posix put/get".into(),
                why: "cross-memory attach is not permitted here (see RUCX_POSIX_ALLOW_PTRACER and \
                      /proc/sys/kernel/yama/ptrace_scope)"
                    .into(),
            });
        }
        let k = rkey.inner::<RkeyData>().ok_or_else(|| {
            Error::InvalidParam(format!(
                "remote key of domain {} used on a posix endpoint",
                rkey.domain()
            ))
        })?;
        let peer = &self.shared.peer;
        if k.pid != peer.pid || k.token != peer.token {
            return Err(Error::InvalidParam(format!(
                "remote key of pid {} used on the endpoint to pid {}",
                k.pid, peer.pid
            )));
        }
        Ok(k)
    }

    fn cma(
        &mut self,
        dir: CmaDir,
        pieces: &[(usize, usize)],
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<()> {
        let k = self.rkey_of(rkey)?;
        let total: usize = pieces.iter().map(|p| p.1).sum();
        rkey.check(remote_addr, total as u64)?;
        if total == 0 {
            return Ok(());
        }
        if let Some(shm) = k.shm
            && self.mapped_copy(dir, pieces, remote_addr, total, k, &shm)?
        {
            return Ok(());
        }
        let pid = k.pid;
        // SAFETY: every local piece is either a borrowed slice (put_short) or lies inside a
        // memory handle of host memory (checked by `iov_pieces`), which `mem_reg`'s contract
        // keeps valid for reads and writes while the handle lives; the caller's borrow covers
        // this synchronous call.
        let r = unsafe { sys::cma(pid, dir, pieces, remote_addr) };
        r.map_err(|e| {
            let op = match dir {
                CmaDir::Write => "process_vm_writev",
                CmaDir::Read => "process_vm_readv",
            };
            match e.raw_os_error() {
                Some(libc::ESRCH) => self.shared.fail(format!("process {pid} exited ({op}: {e})")),
                Some(libc::EPERM) => Error::io(
                    format!(
                        "posix: {op} to pid {pid} not permitted (check \
                         /proc/sys/kernel/yama/ptrace_scope and RUCX_POSIX_ALLOW_PTRACER in the peer)"
                    ),
                    e,
                ),
                Some(libc::EFAULT) => Error::io(
                    format!(
                        "posix: {op} of {total} bytes at {remote_addr:#x} in pid {pid}: the remote \
                         region is not mapped any more"
                    ),
                    e,
                ),
                _ => Error::io(format!("posix: {op} of {total} bytes with pid {pid}"), e),
            }
        })
    }

    /// Put/get on a region of a peer's shared segment: a plain copy through our mapping of it
    /// (mapped on first use, then kept; see [`crate::mapped`]). `Ok(false)`: the segment is
    /// not mapped (its size is not sealed), nothing was copied; use cross-memory attach.
    fn mapped_copy(
        &mut self,
        dir: CmaDir,
        pieces: &[(usize, usize)],
        remote_addr: u64,
        total: usize,
        k: &RkeyData,
        shm: &ShmInfo,
    ) -> Result<bool> {
        // The copy itself cannot notice a dead owner (our mapping keeps its pages): look at the
        // peer as often as the sends do, so a dead peer's operations fail as they do with
        // cross-memory attach.
        self.check_peer_bounded()?;
        let key = (shm.fd, shm.tag);
        if self.last_seg.as_ref().is_none_or(|(k, _)| *k != key) {
            let s = match self.segs.get(&key) {
                Some(s) => s.clone(),
                None => {
                    let s = mapped::segment(k, shm)?;
                    self.segs.insert(key, s.clone());
                    s
                }
            };
            self.last_seg = Some((key, s));
        }
        let Some((_, seg)) = &self.last_seg else {
            return Err(Error::Internal("posix: segment lookup".into()));
        };
        let Some(seg) = seg else {
            return Ok(false);
        };
        let Some(mut remote) = seg.local(remote_addr, total) else {
            return Err(Error::InvalidRkey {
                domain: crate::NAME.into(),
                reason: format!(
                    "{total} bytes at {remote_addr:#x} are not inside the shared segment of \
                     process {}",
                    k.pid
                ),
            });
        };
        for &(local, len) in pieces {
            // SAFETY: `local..local + len` is a borrowed slice (put_short) or lies inside a
            // memory handle of host memory (`iov_pieces`), valid for reads and writes for this
            // synchronous call; `remote..remote + len` lies inside our mapping of the peer's
            // segment (`local` above checked the whole transfer against it), which stays mapped
            // while `seg` lives, and the segment's size is sealed (`mapped::segment` maps no
            // other segment of another process; ours cannot shrink but by us), so no access
            // faults. The two ranges may only overlap if the caller passed overlapping buffers
            // of one segment to itself, which `copy` (memmove) tolerates. A peer writing the region meanwhile
            // races only on plain bytes, as any shared-memory transport does.
            unsafe {
                match dir {
                    CmaDir::Read => std::ptr::copy(remote as *const u8, local as *mut u8, len),
                    CmaDir::Write => std::ptr::copy(local as *const u8, remote as *mut u8, len),
                }
            }
            remote += len;
        }
        Ok(true)
    }

    fn iov_pieces(&self, iov: &[Iov<'_>]) -> Result<Pieces> {
        Iov::check_all(iov, self.limits.max_iov.min(MAX_IOV))?;
        let mut p = Pieces::default();
        for v in iov {
            if v.memh.region().mem_type != MemoryType::Host {
                return Err(Error::Unsupported {
                    what: format!("posix transfer of {} memory", v.memh.region().mem_type),
                    why: "posix moves host memory only".into(),
                });
            }
            p.push((v.addr, v.len));
        }
        Ok(p)
    }
}

impl Endpoint for PosixEndpoint {
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
        Self::check_id(id)?;
        if payload.len() > self.limits.am_max_short {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {} bytes exceeds posix's limit of {} bytes",
                payload.len(),
                self.limits.am_max_short
            )));
        }
        self.send(|buf| {
            buf[..8].copy_from_slice(&header.to_le_bytes());
            copy_short(&mut buf[8..], payload);
            Ok((id, 8 + payload.len()))
        })?;
        Ok(())
    }

    fn am_short_word(
        &mut self,
        id: AmId,
        header: u64,
        word: u64,
        rest: &[u8],
        _scratch: &mut Vec<u8>,
    ) -> Result<()> {
        Self::check_id(id)?;
        let len = 8 + rest.len();
        if len > self.limits.am_max_short {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {len} bytes exceeds posix's limit of {} bytes",
                self.limits.am_max_short
            )));
        }
        // Both words and the bytes straight into the cell.
        self.send(|buf| {
            buf[..8].copy_from_slice(&header.to_le_bytes());
            buf[8..16].copy_from_slice(&word.to_le_bytes());
            copy_short(&mut buf[16..], rest);
            Ok((id, 8 + len))
        })?;
        Ok(())
    }

    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        Self::check_id(id)?;
        let cap = self.limits.am_max_bcopy;
        self.send(|buf| {
            let n = check_packed(pack(&mut buf[..cap]), cap, NAME)?;
            Ok((id, n))
        })
    }

    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        _token: u64,
    ) -> Result<OpStatus> {
        Self::check_id(id)?;
        if header.len() > self.limits.am_max_hdr {
            return Err(Error::InvalidParam(format!(
                "am_zcopy header of {} bytes exceeds posix's limit of {} bytes",
                header.len(),
                self.limits.am_max_hdr
            )));
        }
        let pieces = self.iov_pieces(iov)?;
        let total: usize = pieces.iter().map(|p| p.1).sum();
        if total > self.limits.am_max_zcopy {
            return Err(Error::InvalidParam(format!(
                "am_zcopy payload of {total} bytes exceeds posix's limit of {} bytes",
                self.limits.am_max_zcopy
            )));
        }
        self.send(|buf| {
            buf[..header.len()].copy_from_slice(header);
            let mut at = header.len();
            for &(addr, len) in pieces.iter() {
                // SAFETY: `addr..addr+len` lies inside a memory handle of host memory (checked by
                // `iov_pieces`), which `mem_reg`'s contract keeps valid for reads while the handle
                // lives; the iov borrows the handle for this call. The destination is the claimed
                // cell, which does not overlap user memory.
                let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                buf[at..at + len].copy_from_slice(src);
                at += len;
            }
            Ok((id, at))
        })?;
        Ok(OpStatus::Done)
    }

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        self.ensure_ok()?;
        if data.len() > self.limits.put_max_short {
            return Err(Error::InvalidParam(format!(
                "put_short of {} bytes exceeds posix's limit of {} bytes",
                data.len(),
                self.limits.put_max_short
            )));
        }
        self.cma(
            CmaDir::Write,
            &[(data.as_ptr() as usize, data.len())],
            remote_addr,
            rkey,
        )
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        _token: u64,
    ) -> Result<OpStatus> {
        self.ensure_ok()?;
        let pieces = self.iov_pieces(iov)?;
        self.cma(CmaDir::Write, &pieces, remote_addr, rkey)?;
        Ok(OpStatus::Done)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        _token: u64,
    ) -> Result<OpStatus> {
        self.ensure_ok()?;
        let pieces = self.iov_pieces(iov)?;
        self.cma(CmaDir::Read, &pieces, remote_addr, rkey)?;
        Ok(OpStatus::Done)
    }

    fn flush(&mut self, _token: u64) -> Result<OpStatus> {
        // Messages are in the peer's ring and transfers finished when they returned.
        self.ensure_ok()?;
        Ok(OpStatus::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rucx_uct::{MemRegion, MemoryDomain};

    fn iface(fifo: u32) -> PosixIface {
        let settings = Settings {
            fifo_size: fifo,
            cell_size: 256,
            segment: None,
            peer_check: Duration::from_millis(100),
            allow_ptracer: true,
        };
        PosixIface::open(&settings, SegmentBacking::Memfd, true).unwrap()
    }

    fn params(i: &PosixIface, user_id: u64) -> EpParams {
        EpParams {
            dev_addr: i.device_address(),
            iface_addr: i.iface_address(),
            user_id,
        }
    }

    #[test]
    fn full_ring_is_no_resource_then_flows_in_order() {
        let mut rx = iface(4);
        let mut tx = iface(4);
        let mut ep = tx.create_ep(&params(&rx, 1)).unwrap();
        for i in 0..4u64 {
            ep.am_short(3, i, b"abc").unwrap();
        }
        let e = ep.am_short(3, 99, b"abc").unwrap_err();
        assert!(matches!(e, Error::NoResource(_)), "{e}");
        let e = ep
            .am_bcopy(3, &mut rucx_uct::iface::pack_bytes(b"x"))
            .unwrap_err();
        assert!(e.is_retryable(), "{e}");
        let mut got = Vec::new();
        rx.progress(&mut |ev| {
            if let Event::Am { id, data } = ev {
                got.push((
                    id,
                    u64::from_le_bytes(data[..8].try_into().unwrap()),
                    data[8..].to_vec(),
                ));
            }
        });
        let want: Vec<_> = (0..4u64).map(|i| (3, i, b"abc".to_vec())).collect();
        assert_eq!(got, want);
        ep.am_short(3, 4, &[]).unwrap();
        assert_eq!(rx.progress(&mut |_| {}), 1);
    }

    #[test]
    fn limits_and_bad_ids_are_errors_not_retries() {
        let mut rx = iface(4);
        let mut tx = iface(4);
        let lim = tx.attr().limits;
        assert_eq!(lim.am_max_bcopy, 256 - 16);
        let mut ep = tx.create_ep(&params(&rx, 1)).unwrap();
        for e in [
            ep.am_short(1, 0, &vec![0; lim.am_max_short + 1])
                .unwrap_err(),
            ep.am_short(AM_ID_MAX as u8, 0, &[]).unwrap_err(),
            ep.am_bcopy(
                1,
                &mut rucx_uct::iface::pack_bytes(&vec![0; lim.am_max_bcopy + 1]),
            )
            .unwrap_err(),
            ep.am_zcopy(1, &vec![0; lim.am_max_hdr + 1], &[], 0)
                .unwrap_err(),
        ] {
            assert!(!e.is_retryable(), "{e}");
        }
        // The failed bcopy left no message and no hole.
        ep.am_short(1, 7, &[]).unwrap();
        let mut got = Vec::new();
        rx.progress(&mut |ev| {
            if let Event::Am { data, .. } = ev {
                got.push(data.to_vec());
            }
        });
        assert_eq!(got, vec![7u64.to_le_bytes().to_vec()]);
    }

    /// A message sent as a word and bytes arrives as `am_short` of their join would, with
    /// the same size limit (counted with the word).
    #[test]
    fn pieces_keep_every_entry_in_order_inline_and_spilled() {
        for n in 0..=(3 * PIECES_INLINE) {
            let mut p = Pieces::default();
            for i in 0..n {
                p.push((i, 10 * i));
            }
            let want: Vec<(usize, usize)> = (0..n).map(|i| (i, 10 * i)).collect();
            assert_eq!(&p[..], &want[..], "{n} pieces");
        }
    }

    #[test]
    fn copy_short_copies_every_length_exactly() {
        for n in 0..=40usize {
            let src: Vec<u8> = (0..n as u8)
                .map(|i| i.wrapping_mul(37).wrapping_add(1))
                .collect();
            let mut dst = vec![0xeeu8; 48];
            copy_short(&mut dst, &src);
            assert_eq!(&dst[..n], &src[..], "length {n}");
            assert!(
                dst[n..].iter().all(|&b| b == 0xee),
                "length {n}: wrote past the end"
            );
        }
    }

    #[test]
    fn a_short_message_of_a_word_and_bytes_arrives_joined() {
        let mut rx = iface(4);
        let mut tx = iface(4);
        let lim = tx.attr().limits;
        let mut ep = tx.create_ep(&params(&rx, 1)).unwrap();
        let mut scratch = Vec::new();
        ep.am_short_word(5, 0x1122, 0xabcd, b"payload", &mut scratch)
            .unwrap();
        ep.am_short_word(5, 7, 9, &[], &mut scratch).unwrap();
        let too_long = vec![0; lim.am_max_short - 8 + 1];
        let e = ep
            .am_short_word(5, 0, 0, &too_long, &mut scratch)
            .unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        ep.am_short_word(5, 0, 0, &too_long[1..], &mut scratch)
            .unwrap();
        assert!(
            scratch.is_empty(),
            "written in place, not joined in the scratch buffer"
        );
        let mut got = Vec::new();
        rx.progress(&mut |ev| {
            if let Event::Am { id, data } = ev {
                got.push((id, data.to_vec()));
            }
        });
        let joined = |h: u64, w: u64, rest: &[u8]| {
            let mut v = h.to_le_bytes().to_vec();
            v.extend_from_slice(&w.to_le_bytes());
            v.extend_from_slice(rest);
            (5, v)
        };
        assert_eq!(
            got,
            vec![
                joined(0x1122, 0xabcd, b"payload"),
                joined(7, 9, &[]),
                joined(0, 0, &too_long[1..]),
            ]
        );
    }

    fn md() -> crate::PosixMd {
        crate::PosixMd::open(&rucx_ucs::Config::new(&[crate::CONFIG]).unwrap()).unwrap()
    }

    /// A region registered inside a shared allocation gets a key peers map: get and put copy
    /// through the mapping (the same bytes cross-memory attach would move), within bounds.
    #[test]
    fn get_and_put_on_a_shared_region_copy_through_the_mapping() {
        let m = md();
        if !m.cma_enabled() {
            return;
        }
        let a = m
            .mem_alloc_shared(65536)
            .unwrap()
            .expect("posix shares memory");
        // SAFETY: the allocation is ours, alive while `a` lives; nothing else touches it now.
        let shared = unsafe { std::slice::from_raw_parts_mut(a.addr as *mut u8, a.len) };
        for (i, b) in shared.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // A registration of part of it (as the registration cache makes) is a shared key.
        // SAFETY: the region lies inside the live allocation.
        let sub = unsafe { m.mem_reg(MemRegion::host(a.addr + 4096, 32768)) }.unwrap();
        let key = m.rkey_unpack(&m.mkey_pack(&sub).unwrap()).unwrap();
        assert!(key.inner::<RkeyData>().unwrap().shm.is_some());
        let rx = iface(4);
        let mut tx = iface(4);
        let mut ep = tx.create_ep(&params(&rx, 1)).unwrap();
        let mut local = vec![0u8; 32768];
        // SAFETY: `local` outlives the handle.
        let lh = unsafe { m.mem_reg(MemRegion::of_slice(&local)) }.unwrap();
        let iov = [Iov {
            addr: local.as_mut_ptr() as usize,
            len: 32768,
            memh: &lh,
        }];
        let at = (a.addr + 4096) as u64;
        assert_eq!(ep.get_zcopy(&iov, at, &key, 0).unwrap(), OpStatus::Done);
        assert_eq!(&local[..], &shared[4096..4096 + 32768]);
        local.fill(0x5a);
        assert_eq!(ep.put_zcopy(&iov, at, &key, 0).unwrap(), OpStatus::Done);
        assert!(shared[4096..4096 + 32768].iter().all(|b| *b == 0x5a));
        assert_eq!(
            shared[4095],
            (4095 % 251) as u8,
            "nothing written before the region"
        );
        assert_eq!(
            shared[4096 + 32768],
            ((4096 + 32768) % 251) as u8,
            "nor after it"
        );
        // Past the key's region: refused, nothing moved.
        assert!(ep.get_zcopy(&iov, at + 1, &key, 0).is_err());
        // Two segments in turn on one endpoint: each copy goes through its own mapping.
        let b = m
            .mem_alloc_shared(65536)
            .unwrap()
            .expect("posix shares memory");
        // SAFETY: as for `shared`.
        let other = unsafe { std::slice::from_raw_parts_mut(b.addr as *mut u8, b.len) };
        other.fill(0xb7);
        // SAFETY: the region lies inside the live allocation.
        let sub_b = unsafe { m.mem_reg(MemRegion::host(b.addr, 32768)) }.unwrap();
        let key_b = m.rkey_unpack(&m.mkey_pack(&sub_b).unwrap()).unwrap();
        for round in 0..3u8 {
            assert_eq!(
                ep.get_zcopy(&iov, b.addr as u64, &key_b, 0).unwrap(),
                OpStatus::Done
            );
            assert!(local.iter().all(|x| *x == 0xb7), "round {round}: from b");
            local.fill(round);
            assert_eq!(ep.put_zcopy(&iov, at, &key, 0).unwrap(), OpStatus::Done);
            assert!(
                shared[4096..4096 + 32768].iter().all(|x| *x == round),
                "round {round}: into a"
            );
            assert!(
                other[..32768].iter().all(|x| *x == 0xb7),
                "round {round}: b untouched"
            );
        }
    }

    /// The owner frees its allocation after the key was used: the mapping keeps the pages, so
    /// later copies through it neither fault nor read someone else's memory; a key whose
    /// segment is gone before it was ever mapped is refused with an error.
    #[test]
    fn a_freed_shared_allocation_never_faults_a_copy() {
        let m = md();
        if !m.cma_enabled() {
            return;
        }
        let rx = iface(4);
        let mut tx = iface(4);
        let mut ep = tx.create_ep(&params(&rx, 1)).unwrap();
        let mut local = vec![0u8; 8192];
        // SAFETY: `local` outlives the handle.
        let lh = unsafe { m.mem_reg(MemRegion::of_slice(&local)) }.unwrap();
        let iov = [Iov {
            addr: local.as_mut_ptr() as usize,
            len: 8192,
            memh: &lh,
        }];
        let a = m
            .mem_alloc_shared(8192)
            .unwrap()
            .expect("posix shares memory");
        // SAFETY: the allocation is ours and alive here.
        unsafe { std::ptr::write_bytes(a.addr as *mut u8, 0x33, 8192) };
        let key = m.rkey_unpack(&m.mkey_pack(&a.memh).unwrap()).unwrap();
        let at = a.addr as u64;
        ep.get_zcopy(&iov, at, &key, 0).unwrap();
        drop(a);
        local.fill(0);
        ep.get_zcopy(&iov, at, &key, 0).unwrap();
        assert!(
            local.iter().all(|b| *b == 0x33),
            "the mapped pages outlive the owner's"
        );
        // Never mapped here before its segment went away: an error, not a fault.
        let b = m
            .mem_alloc_shared(8192)
            .unwrap()
            .expect("posix shares memory");
        let key = m.rkey_unpack(&m.mkey_pack(&b.memh).unwrap()).unwrap();
        let at = b.addr as u64;
        drop(b);
        let e = ep.get_zcopy(&iov, at, &key, 0).unwrap_err();
        assert!(
            matches!(e, Error::EndpointFailure { .. } | Error::InvalidRkey { .. }),
            "{e}"
        );
    }
}
