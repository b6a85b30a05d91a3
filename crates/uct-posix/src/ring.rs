//! The receive segment and its multi-producer single-consumer ring of fixed-size cells.
//!
//! # Layout (all integers little endian, native atomics)
//!
//! ```text
//! offset   0  magic      u64   "RUCXPSX1"
//!          8  version    u32   3
//!         12  cell_size  u32   bytes per cell, header included, multiple of 64
//!         16  cell_count u32   power of two
//!         20  owner_pid  u32
//!         24  seg_id     u64   random, also in the interface address
//!         32  token      u64   owner's process token, also in the interface address
//!         40  closed     u32   (atomic) 1 once the owner closed the interface
//!         44  armed      u32   (atomic) 1 while the owner sleeps and wants a wake-up
//!         48  wake_fd    u32   owner's descriptor number of its wake-up pipe (read end)
//!         64  head       u64   (atomic, own cache line) next position producers claim
//!        128  cells[cell_count]
//! cell:    0  seq        u64   (atomic) state of the cell, see below
//!          8  meta       u64   (atomic) 0 when free, else the claim and the message:
//!                              length (bits 0-20) | nop (21) | claimed (22, always set)
//!                              | am id (24-31) | pid of the producer (32-63)
//!         16  data       cell_size - 16 bytes
//! ```
//!
//! A cell's first cache line holds its header and the first 48 bytes of its data: a message
//! of up to 48 bytes (an eager tag message of 32 bytes: the tag, the source id and the
//! payload) is one line, which the producer writes and the consumer reads, and the line
//! itself says that it is ready (there is no shared counter for the consumer to read).
//! Version 2 had a 32-byte header (the producer's pid in a word of its own) and 32 bytes of
//! data in the first line; the version word makes either side refuse the other's segment.
//!
//! # Protocol
//!
//! Bounded-queue sequencing per cell, with the claim recorded in the cell. Cell `i` starts
//! with `seq = i` and `meta = 0`. A producer reads `pos = head`; the cell `pos % count` is free
//! for it when `seq == pos`. It claims the cell by a compare-and-swap of the cell's `meta`
//! from 0 to its claim word (its pid and the claimed bit), then checks `seq == pos` (else it
//! gives the claim back and retries, or reports a full ring), advances `head` to `pos + 1`
//! (a plain store: holding the claim of a cell whose `seq` is `pos`, no other producer can be
//! at `pos`, so `head` is `pos`), writes the data and the meta word (the claim plus length
//! and id), and publishes with `seq = pos + 1` (release). So a send is one atomic
//! read-modify-write, on the line it writes anyway. A cell with `seq < pos` still holds an
//! unconsumed message from the previous lap: the ring is full and the producer returns
//! `NoResource` (it never waits and never overwrites). The consumer keeps its own `tail`; the
//! cell at `tail` is ready when `seq == tail + 1` (acquire); once the data is handed out it
//! frees the cell for the next lap with `seq = tail + count` and then `meta = 0` (both
//! release). It frees the last cell of a [`Ring::receive`] call at the start of the next call
//! (or before sleeping), not at once: the free is a store to the line the producer wrote, and
//! while it waits for that line it would hold up the consumer's next atomic instruction (the
//! claim of its answer, in a ping-pong).
//!
//! Whatever a peer writes into the segment, the consumer reads only inside it: a position is
//! masked to a cell, and a length beyond the cell or an id out of range drops the message.
//!
//! Because the claim itself names the producer, a producer that dies between claiming and
//! publishing leaves its pid in the cell: the consumer notices a cell at `tail` claimed for over
//! [`STALL_LIMIT`] by a dead process, moves `head` past it if the producer did not, and frees it.
//! (Only a reused pid can hide such a death.)
//!
//! # Wake-ups
//!
//! An owner about to sleep arms the ring ([`Ring::arm`]): it sets `armed` and then reads the
//! `meta` word of the cell at its `tail`; if it is not 0 (a message is published or being
//! written there) it disarms and reports busy. A producer, after publishing, reads `armed`
//! ([`Ring::take_wakeup`]) and, when set, clears it and writes a byte to the owner's wake-up
//! pipe. The owner's store-then-load and the producer's claim (a compare-and-swap) followed
//! by its load of `armed` are sequentially consistent, so either the owner sees the claim or
//! the producer sees the flag: no message is left behind a sleeping owner. (A producer
//! claiming a later cell follows a claim of the cell at `tail`, which stays set until the
//! owner frees it.) A producer that finds the flag clear, the common case, pays one load.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;
use rucx_ucs::{Error, Result};
use rucx_uct::AmId;
use rucx_uct::iface::AM_ID_MAX;

use crate::sys;

/// Segment magic.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RUCXPSX1");
/// Layout version.
pub const VERSION: u32 = 3;
/// Bytes before the first cell.
pub const HEADER_SIZE: usize = 128;
/// Bytes of a cell before its data.
pub const CELL_HEADER: usize = 16;
/// Smallest cell.
pub const MIN_CELL_SIZE: u32 = 128;
/// Largest cell.
pub const MAX_CELL_SIZE: u32 = 1 << 20;
/// Fewest cells.
pub const MIN_CELLS: u32 = 2;
/// Most cells.
pub const MAX_CELLS: u32 = 1 << 16;
/// How long a claimed but unpublished cell may stall the ring before the consumer checks its
/// writer.
pub const STALL_LIMIT: Duration = Duration::from_millis(500);

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_CELL_SIZE: usize = 12;
const OFF_CELL_COUNT: usize = 16;
const OFF_OWNER: usize = 20;
const OFF_SEG_ID: usize = 24;
const OFF_TOKEN: usize = 32;
const OFF_CLOSED: usize = 40;
const OFF_ARMED: usize = 44;
const OFF_WAKE_FD: usize = 48;
const OFF_HEAD: usize = 64;

const C_SEQ: usize = 0;
const C_META: usize = 8;

/// Claim attempts before a contended send gives up with "no resources".
const CLAIM_ATTEMPTS: usize = 256;

/// Meta word: the message length (a cell's data is below 2^20 bytes).
const META_LEN_MASK: u64 = (1 << 21) - 1;
/// Meta word: the cell carries no message (its producer gave up).
const META_NOP: u64 = 1 << 21;
/// Meta word: claimed (set by every claim, so a claimed cell's meta is never 0).
const META_CLAIMED: u64 = 1 << 22;
/// Meta word: where the active message id starts (8 bits).
const META_ID_SHIFT: u32 = 24;
/// Meta word: where the producer's pid starts (32 bits).
const META_PID_SHIFT: u32 = 32;

/// Shape of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Cells in the ring (power of two).
    pub cell_count: u32,
    /// Bytes per cell including its header (multiple of 64).
    pub cell_size: u32,
}

impl Geometry {
    /// Check the bounds; `what` names the source in errors.
    pub fn validate(self, what: &str) -> Result<Geometry> {
        let Geometry {
            cell_count,
            cell_size,
        } = self;
        if !(MIN_CELLS..=MAX_CELLS).contains(&cell_count) || !cell_count.is_power_of_two() {
            return Err(Error::InvalidParam(format!(
                "{what}: {cell_count} cells; must be a power of two in {MIN_CELLS}..={MAX_CELLS}"
            )));
        }
        if !(MIN_CELL_SIZE..=MAX_CELL_SIZE).contains(&cell_size) || !cell_size.is_multiple_of(64) {
            return Err(Error::InvalidParam(format!(
                "{what}: cell size {cell_size}; must be a multiple of 64 in {MIN_CELL_SIZE}..={MAX_CELL_SIZE}"
            )));
        }
        Ok(self)
    }

    /// Total segment size in bytes.
    pub fn segment_size(self) -> usize {
        HEADER_SIZE + self.cell_count as usize * self.cell_size as usize
    }

    /// Data bytes per cell.
    pub fn capacity(self) -> usize {
        self.cell_size as usize - CELL_HEADER
    }
}

/// Identity written into a segment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegIdentity {
    /// Owner process.
    pub owner_pid: u32,
    /// Random segment id.
    pub seg_id: u64,
    /// Owner's process token.
    pub token: u64,
}

/// A mapped segment: the ring plus its header. Both the owner (consumer) and every sender
/// (producer) hold one; the roles are told apart by the methods they call.
#[derive(Debug)]
pub struct Ring {
    map: MmapRaw,
    geo: Geometry,
    mask: u64,
    // The mapping's base, cached (`MmapRaw` reads it through a field of its own).
    base: *mut u8,
    // Data bytes per cell, cached.
    cap: usize,
    // This process's claim word: its pid and the claimed bit, stored in every claim.
    claim: u64,
}

// SAFETY: `base` points into `map`, which the ring owns; every access through it is atomic or
// guarded by the ring's protocol (a claimed cell's data by its producer, a published one by the
// consumer), exactly as for `MmapRaw`, which is Send and Sync.
unsafe impl Send for Ring {}
// SAFETY: as for Send.
unsafe impl Sync for Ring {}

impl Ring {
    fn new(map: MmapRaw, geo: Geometry) -> Ring {
        Ring {
            base: map.as_mut_ptr(),
            map,
            geo,
            mask: u64::from(geo.cell_count) - 1,
            cap: geo.capacity(),
            claim: (u64::from(sys::my_pid()) << META_PID_SHIFT) | META_CLAIMED,
        }
    }

    /// Initialize a fresh mapping as an empty ring. The mapping must be exactly
    /// `geo.segment_size()` bytes, zero-filled, and not yet visible to anybody else.
    pub fn init(map: MmapRaw, geo: Geometry, id: SegIdentity, wake_fd: u32) -> Result<Ring> {
        let geo = geo.validate("posix ring")?;
        if map.len() != geo.segment_size() {
            return Err(Error::Internal(format!(
                "segment mapping is {} bytes, expected {}",
                map.len(),
                geo.segment_size()
            )));
        }
        let ring = Ring::new(map, geo);
        ring.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        ring.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        ring.u32_at(OFF_CELL_SIZE)
            .store(geo.cell_size, Ordering::Relaxed);
        ring.u32_at(OFF_CELL_COUNT)
            .store(geo.cell_count, Ordering::Relaxed);
        ring.u32_at(OFF_OWNER)
            .store(id.owner_pid, Ordering::Relaxed);
        ring.u64_at(OFF_SEG_ID).store(id.seg_id, Ordering::Relaxed);
        ring.u64_at(OFF_TOKEN).store(id.token, Ordering::Relaxed);
        ring.u32_at(OFF_CLOSED).store(0, Ordering::Relaxed);
        ring.u32_at(OFF_ARMED).store(0, Ordering::Relaxed);
        ring.u32_at(OFF_WAKE_FD).store(wake_fd, Ordering::Relaxed);
        ring.u64_at(OFF_HEAD).store(0, Ordering::Relaxed);
        for i in 0..geo.cell_count {
            let c = ring.cell_off(u64::from(i));
            ring.u64_at(c + C_SEQ)
                .store(u64::from(i), Ordering::Relaxed);
            ring.u64_at(c + C_META).store(0, Ordering::Relaxed);
        }
        // Publish the initialized header to whoever maps the segment later.
        std::sync::atomic::fence(Ordering::Release);
        Ok(ring)
    }

    /// Attach to a peer's segment, validating its header against what its address said.
    pub fn attach(map: MmapRaw, geo: Geometry, id: SegIdentity) -> Result<Ring> {
        let geo = geo.validate("posix peer segment")?;
        if map.len() != geo.segment_size() {
            return Err(Error::InvalidAddress(format!(
                "posix: peer segment of pid {} is {} bytes, its address says {}",
                id.owner_pid,
                map.len(),
                geo.segment_size()
            )));
        }
        let ring = Ring::new(map, geo);
        std::sync::atomic::fence(Ordering::Acquire);
        let found = (
            ring.u64_at(OFF_MAGIC).load(Ordering::Relaxed),
            ring.u32_at(OFF_VERSION).load(Ordering::Relaxed),
            ring.u32_at(OFF_CELL_SIZE).load(Ordering::Relaxed),
            ring.u32_at(OFF_CELL_COUNT).load(Ordering::Relaxed),
            ring.u32_at(OFF_OWNER).load(Ordering::Relaxed),
            ring.u64_at(OFF_SEG_ID).load(Ordering::Relaxed),
            ring.u64_at(OFF_TOKEN).load(Ordering::Relaxed),
        );
        let want = (
            MAGIC,
            VERSION,
            geo.cell_size,
            geo.cell_count,
            id.owner_pid,
            id.seg_id,
            id.token,
        );
        if found != want {
            return Err(Error::InvalidAddress(format!(
                "posix: the segment found at pid {} does not match its address (stale address, \
                 reused pid, or a different rucx version: layout {} here, {} there)",
                id.owner_pid, VERSION, found.1
            )));
        }
        Ok(ring)
    }

    /// Shape of the ring.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    #[inline(always)]
    fn cell_off(&self, pos: u64) -> usize {
        HEADER_SIZE + (pos & self.mask) as usize * self.geo.cell_size as usize
    }

    #[inline(always)]
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
        // SAFETY: every caller passes an 8-aligned offset inside the mapping (header fields and
        // cell words at fixed offsets; the mapping is page aligned and its size was checked
        // against the geometry). The mapping lives as long as `self`, and every access to these
        // words, in any process, is atomic.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    #[inline(always)]
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.map.len());
        // SAFETY: as in `u64_at`, for 4-aligned 32-bit words.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    /// True once the owner closed its interface.
    pub fn is_closed(&self) -> bool {
        self.u32_at(OFF_CLOSED).load(Ordering::Acquire) != 0
    }

    /// Mark the ring closed (owner side, when the interface goes away).
    pub fn close(&self) {
        self.u32_at(OFF_CLOSED).store(1, Ordering::Release);
    }

    /// The owner's wake-up pipe descriptor (in the owner's process), as it wrote it.
    pub fn wake_fd(&self) -> u32 {
        self.u32_at(OFF_WAKE_FD).load(Ordering::Relaxed)
    }

    /// Owner: ask producers for a wake-up at the next message, freeing the cells it delivered
    /// first. False (and not armed) when a message at the cursor's tail is published or being
    /// written: receive first.
    pub fn arm(&self, cur: &mut Cursor) -> bool {
        self.give_back(cur);
        let armed = self.u32_at(OFF_ARMED);
        armed.store(1, Ordering::SeqCst);
        if self
            .u64_at(self.cell_off(cur.tail) + C_META)
            .load(Ordering::SeqCst)
            != 0
        {
            armed.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Owner: no wake-up wanted any more (it is awake).
    pub fn disarm(&self) {
        self.u32_at(OFF_ARMED).store(0, Ordering::Relaxed);
    }

    /// Producer, after a send: whether the owner is armed, clearing the flag when it is (then
    /// this producer, and no other, must wake it).
    #[inline]
    pub fn take_wakeup(&self) -> bool {
        let armed = self.u32_at(OFF_ARMED);
        armed.load(Ordering::SeqCst) != 0 && armed.swap(0, Ordering::AcqRel) != 0
    }

    /// Producer: claim a cell, let `fill` write the message into its data area, and publish it.
    ///
    /// `fill` returns the message length and id, or an error; on error (or a panic in `fill`)
    /// the cell is published as empty so the ring keeps flowing. Returns `Ok(None)` when the
    /// ring is full or, for a moment, contended (nothing was written).
    #[inline]
    pub fn send<F>(&self, fill: F) -> Result<Option<usize>>
    where
        F: FnOnce(&mut [u8]) -> Result<(AmId, usize)>,
    {
        let head = self.u64_at(OFF_HEAD);
        for _ in 0..CLAIM_ATTEMPTS {
            let pos = head.load(Ordering::Acquire);
            let off = self.cell_off(pos);
            let seq = self.u64_at(off + C_SEQ);
            let meta = self.u64_at(off + C_META);
            // Claim first (one exclusive access to the cell's line), look afterwards.
            // Sequentially consistent for the wake-up handshake (module docs); the same
            // instruction as AcqRel on x86.
            if meta
                .compare_exchange(0, self.claim, Ordering::SeqCst, Ordering::Relaxed)
                .is_err()
            {
                // Held: an unconsumed message of the previous lap (full), or another producer
                // claiming it right now.
                if (seq.load(Ordering::Acquire).wrapping_sub(pos) as i64) < 0 {
                    return Ok(None);
                }
                std::hint::spin_loop();
                continue;
            }
            // Claimed. Free for `pos`? Then no other producer can be at `pos` (it would hold
            // the claim, or have published: `seq` would be `pos + 1`), so `head` is `pos`.
            let diff = seq.load(Ordering::Acquire).wrapping_sub(pos) as i64;
            if diff == 0 {
                head.store(pos.wrapping_add(1), Ordering::Release);
                return self.fill_claimed(pos, off, fill).map(Some);
            }
            // Free for a later lap (our `head` was stale) or not ours: give it back.
            meta.store(0, Ordering::Release);
            if diff < 0 {
                return Ok(None);
            }
        }
        Ok(None)
    }

    #[inline(always)]
    fn fill_claimed<F>(&self, pos: u64, off: usize, fill: F) -> Result<usize>
    where
        F: FnOnce(&mut [u8]) -> Result<(AmId, usize)>,
    {
        let mut guard = Publish {
            ring: self,
            pos,
            off,
            meta: self.claim | META_NOP,
        };
        let cap = self.cap;
        // SAFETY: the claim (our claim word swapped into the cell's `meta` while its sequence
        // equalled `pos`) gives this producer sole ownership of the cell's data area until it
        // publishes: the consumer does not read it before `seq == pos + 1`, and other producers
        // cannot claim a cell whose `meta` is set. The area lies inside the mapping, which
        // outlives this borrow.
        let data = unsafe { std::slice::from_raw_parts_mut(self.base.add(off + CELL_HEADER), cap) };
        let (id, len) = fill(data)?;
        if len > cap || usize::from(id) >= AM_ID_MAX {
            return Err(Error::Internal(format!(
                "posix: message of {len} bytes with id {id} does not fit a cell"
            )));
        }
        guard.meta = self.claim | len as u64 | (u64::from(id) << META_ID_SHIFT);
        drop(guard);
        Ok(len)
    }

    /// Consumer: deliver up to `max` ready messages to `f`, starting at `cur.tail()`. Returns
    /// how many messages were delivered. Only the segment's owner may call this, from one thread.
    ///
    /// The cell of the last message delivered stays with the consumer until the next call (or
    /// [`Ring::give_back`]): freeing a cell writes its line, which the producer last wrote, and a
    /// store still waiting for that line would hold up the consumer's next atomic instruction,
    /// typically the claim of its answer in the peer's ring. Freed at the start of the next call,
    /// while the consumer polls, the store is off the ping-pong's critical path.
    #[inline]
    pub fn receive<F: FnMut(AmId, &[u8])>(&self, cur: &mut Cursor, max: usize, f: &mut F) -> usize {
        let mut n = 0;
        let mut off = self.cell_off(cur.tail);
        while n < max
            && self.u64_at(off + C_SEQ).load(Ordering::Acquire) == cur.tail.wrapping_add(1)
        {
            // Free the cell delivered before this one (a batch frees as it goes).
            self.give_back(cur);
            let meta = self.u64_at(off + C_META).load(Ordering::Relaxed);
            let len = (meta & META_LEN_MASK) as usize;
            let id = (meta >> META_ID_SHIFT) as u8;
            if meta & META_NOP == 0 {
                if len <= self.cap && usize::from(id) < AM_ID_MAX {
                    // SAFETY: the acquire load saw the producer's release of `seq = tail + 1`,
                    // so the cell's data is fully written and no producer touches the cell again
                    // until we free it (at the earliest in the next iteration or call, after
                    // `f` returned); `len` was checked against the cell capacity.
                    let data = unsafe {
                        std::slice::from_raw_parts(self.base.add(off + CELL_HEADER), len)
                    };
                    f(id, data);
                    n += 1;
                } else {
                    dropped_malformed(meta);
                }
            }
            cur.tail = cur.tail.wrapping_add(1);
            off = self.cell_off(cur.tail);
        }
        if n == 0 {
            // Nothing ready: free the last delivered cell while the caller polls.
            self.give_back(cur);
        }
        n
    }

    /// Consumer: true when [`receive`](Self::receive) would do nothing now (no message ready
    /// at the tail, no delivered cell to free): the common answer of a poll, from one load of
    /// the cell at the tail.
    #[inline]
    pub fn is_idle(&self, cur: &Cursor) -> bool {
        cur.freed == cur.tail
            && self
                .u64_at(self.cell_off(cur.tail) + C_SEQ)
                .load(Ordering::Acquire)
                != cur.tail.wrapping_add(1)
    }

    /// Consumer: free every cell delivered so far for the producers' next lap. [`Ring::receive`]
    /// does it itself; an owner about to sleep calls it so that no producer finds the ring full
    /// because of a cell the owner no longer needs.
    #[inline]
    pub fn give_back(&self, cur: &mut Cursor) {
        while cur.freed != cur.tail {
            self.release(self.cell_off(cur.freed), cur.freed);
            cur.freed = cur.freed.wrapping_add(1);
        }
    }

    #[inline(always)]
    fn release(&self, off: usize, pos: u64) {
        self.u64_at(off + C_SEQ).store(
            pos.wrapping_add(u64::from(self.geo.cell_count)),
            Ordering::Release,
        );
        self.u64_at(off + C_META).store(0, Ordering::Release);
    }

    /// Consumer: if the cell at `tail` is claimed but unpublished, the pid that claimed it.
    pub fn stalled_writer(&self, tail: u64) -> Option<u32> {
        let off = self.cell_off(tail);
        let seq = self.u64_at(off + C_SEQ).load(Ordering::Acquire);
        let meta = self.u64_at(off + C_META).load(Ordering::Acquire);
        (seq == tail && meta != 0).then_some((meta >> META_PID_SHIFT) as u32)
    }

    /// Consumer: give up on the cell at the cursor's tail, whose writer died after claiming it, and move
    /// past it (moving `head` too when the writer died before doing so).
    pub fn skip_dead(&self, cur: &mut Cursor) {
        self.give_back(cur);
        let off = self.cell_off(cur.tail);
        let _ = self.u64_at(OFF_HEAD).compare_exchange(
            cur.tail,
            cur.tail.wrapping_add(1),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        self.release(off, cur.tail);
        cur.tail = cur.tail.wrapping_add(1);
        cur.freed = cur.tail;
    }
}

/// Log a published cell whose meta word no message can have (a hostile or broken peer); kept
/// out of line, off the receive loop.
#[cold]
#[inline(never)]
fn dropped_malformed(meta: u64) {
    tracing::warn!(
        "posix: dropped a malformed message (id {}, {} bytes) from pid {}",
        (meta >> META_ID_SHIFT) as u8,
        meta & META_LEN_MASK,
        meta >> META_PID_SHIFT
    );
}

/// The consumer's place in its ring: the next cell to read (`tail`) and the first cell read but
/// not yet freed for the producers (`freed`; at most the last cell delivered, between two
/// [`Ring::receive`] calls).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    tail: u64,
    freed: u64,
}

impl Cursor {
    /// The next position the consumer reads (messages delivered so far).
    pub fn tail(&self) -> u64 {
        self.tail
    }
}

/// Publishes a claimed cell when dropped, also on an early return or a panic.
struct Publish<'a> {
    ring: &'a Ring,
    pos: u64,
    off: usize,
    meta: u64,
}

impl Drop for Publish<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.ring
            .u64_at(self.off + C_META)
            .store(self.meta, Ordering::Relaxed);
        self.ring
            .u64_at(self.off + C_SEQ)
            .store(self.pos.wrapping_add(1), Ordering::Release);
    }
}

/// Tracks how long the consumer has been stuck behind one claimed cell.
#[derive(Debug, Default)]
pub struct StallWatch {
    since: Option<(u64, Instant)>,
}

impl StallWatch {
    /// Look at the cell at the cursor's tail and skip it when its writer died after claiming it
    /// more than [`STALL_LIMIT`] ago. Returns true when a cell was skipped.
    pub fn check(&mut self, ring: &Ring, cur: &mut Cursor) -> bool {
        let tail = cur.tail;
        match ring.stalled_writer(tail) {
            None => {
                self.since = None;
                false
            }
            Some(pid) => match self.since {
                Some((t, at)) if t == tail => {
                    if at.elapsed() >= STALL_LIMIT && !sys::pid_alive(pid) {
                        tracing::warn!(
                            "posix: skipping a message slot claimed by pid {pid}, which died \
                             before filling it"
                        );
                        ring.skip_dead(cur);
                        self.since = None;
                        true
                    } else {
                        false
                    }
                }
                _ => {
                    self.since = Some((tail, Instant::now()));
                    false
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(cells: u32, cell_size: u32) -> Ring {
        let geo = Geometry {
            cell_count: cells,
            cell_size,
        };
        let map = MmapRaw::map_raw(&anon(geo.segment_size())).unwrap();
        Ring::init(
            map,
            geo,
            SegIdentity {
                owner_pid: sys::my_pid(),
                seg_id: 7,
                token: 9,
            },
            0,
        )
        .unwrap()
    }

    fn anon(size: usize) -> std::fs::File {
        sys::create_shared_file(sys::SegmentBacking::Memfd, size as u64).unwrap()
    }

    /// Write a claim by `pid` into the cell of `pos`, as a producer's compare-and-swap does.
    fn claim_as(r: &Ring, pos: u64, pid: u32) {
        r.u64_at(r.cell_off(pos) + C_META).store(
            (u64::from(pid) << META_PID_SHIFT) | META_CLAIMED,
            Ordering::Relaxed,
        );
    }

    fn put(r: &Ring, id: AmId, data: &[u8]) -> Option<usize> {
        r.send(|buf| {
            buf[..data.len()].copy_from_slice(data);
            Ok((id, data.len()))
        })
        .unwrap()
    }

    #[test]
    fn full_ring_says_so_and_keeps_contents() {
        let r = ring(4, 128);
        for i in 0..4u8 {
            assert_eq!(put(&r, 1, &[i; 10]), Some(10));
        }
        assert_eq!(put(&r, 1, &[99; 10]), None, "a full ring must refuse");
        let mut tail = Cursor::default();
        let mut got = Vec::new();
        assert_eq!(
            r.receive(&mut tail, usize::MAX, &mut |id, d| got
                .push((id, d.to_vec()))),
            4
        );
        assert_eq!(got, (0..4u8).map(|i| (1, vec![i; 10])).collect::<Vec<_>>());
        assert_eq!(put(&r, 2, b"after"), Some(5));
    }

    #[test]
    fn last_delivered_cell_is_freed_by_the_next_call_or_before_sleeping() {
        let r = ring(4, 128);
        for i in 0..4u8 {
            assert_eq!(put(&r, 1, &[i]), Some(1));
        }
        let mut tail = Cursor::default();
        assert_eq!(r.receive(&mut tail, 2, &mut |_, _| {}), 2);
        assert_eq!(r.receive(&mut tail, 2, &mut |_, _| {}), 2);
        // Cells 0-2 are free, cell 3 (the last delivered) is still the consumer's.
        for i in 0..3u8 {
            assert_eq!(put(&r, 2, &[i]), Some(1), "freed cell {i}");
        }
        assert_eq!(
            put(&r, 2, b"x"),
            None,
            "the last delivered cell is not free yet"
        );
        // A call that finds the next message frees it first ...
        let mut got = Vec::new();
        assert_eq!(r.receive(&mut tail, 1, &mut |_, d| got.push(d[0])), 1);
        assert_eq!(got, [0]);
        assert_eq!(put(&r, 3, b"y"), Some(1), "freed by the next receive");
        // ... and so does one that finds nothing, or arming before a sleep.
        let mut got = Vec::new();
        assert_eq!(r.receive(&mut tail, 8, &mut |_, d| got.push(d.to_vec())), 3);
        assert_eq!(got, [vec![1], vec![2], b"y".to_vec()]);
        for _ in 0..3 {
            assert!(put(&r, 4, b"z").is_some());
        }
        assert_eq!(put(&r, 4, b"z"), None);
        assert_eq!(r.receive(&mut tail, 3, &mut |_, _| {}), 3);
        assert!(r.arm(&mut tail), "nothing waits");
        r.disarm();
        for _ in 0..4 {
            assert!(put(&r, 5, b"w").is_some(), "arm freed every delivered cell");
        }
        assert_eq!(put(&r, 5, b"w"), None);
    }

    #[test]
    fn wraps_around_many_times_in_order() {
        let r = ring(8, 128);
        let mut tail = Cursor::default();
        let mut next_send = 0u32;
        let mut next_recv = 0u32;
        while next_recv < 10_000 {
            while next_send < 10_000 && put(&r, 3, &next_send.to_le_bytes()).is_some() {
                next_send += 1;
            }
            r.receive(&mut tail, 3, &mut |id, d| {
                assert_eq!(id, 3);
                assert_eq!(u32::from_le_bytes(d.try_into().unwrap()), next_recv);
                next_recv += 1;
            });
        }
        assert_eq!(tail.tail(), 10_000);
    }

    #[test]
    fn failed_fill_leaves_no_message_and_no_hole() {
        let r = ring(4, 128);
        let e = r.send(|_| Err(Error::InvalidParam("too big".into())));
        assert!(e.is_err());
        let e = r.send(|_| Ok((1, 100_000)));
        assert!(e.is_err(), "length past the cell must be refused");
        assert_eq!(put(&r, 5, b"x"), Some(1));
        let mut tail = Cursor::default();
        let mut got = Vec::new();
        r.receive(&mut tail, usize::MAX, &mut |id, d| {
            got.push((id, d.to_vec()))
        });
        assert_eq!(got, vec![(5, b"x".to_vec())]);
        assert_eq!(tail.tail(), 3);
    }

    #[test]
    fn panicking_fill_does_not_wedge() {
        let r = ring(4, 128);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = r.send(|_| panic!("pack callback failed"));
        }));
        assert!(res.is_err());
        assert_eq!(put(&r, 1, b"ok"), Some(2));
        let mut tail = Cursor::default();
        assert_eq!(
            r.receive(&mut tail, usize::MAX, &mut |_, d| assert_eq!(d, b"ok")),
            1
        );
    }

    #[test]
    fn many_producers_each_in_order() {
        let r = std::sync::Arc::new(ring(16, 128));
        let per = 5_000u32;
        let threads: Vec<_> = (0..3u8)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..per {
                        let mut m = [0u8; 5];
                        m[0] = t;
                        m[1..].copy_from_slice(&i.to_le_bytes());
                        while put(&r, 1, &m).is_none() {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u32; 3];
        let mut tail = Cursor::default();
        while next.iter().any(|&n| n < per) {
            r.receive(&mut tail, 64, &mut |_, d| {
                let t = d[0] as usize;
                let i = u32::from_le_bytes(d[1..5].try_into().unwrap());
                assert_eq!(i, next[t], "producer {t} out of order");
                next[t] += 1;
            });
        }
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn attach_validates_identity() {
        let geo = Geometry {
            cell_count: 4,
            cell_size: 128,
        };
        let f = anon(geo.segment_size());
        let id = SegIdentity {
            owner_pid: sys::my_pid(),
            seg_id: 42,
            token: 43,
        };
        let _owner = Ring::init(MmapRaw::map_raw(&f).unwrap(), geo, id, 0).unwrap();
        assert!(Ring::attach(MmapRaw::map_raw(&f).unwrap(), geo, id).is_ok());
        let wrong = SegIdentity { seg_id: 41, ..id };
        assert!(Ring::attach(MmapRaw::map_raw(&f).unwrap(), geo, wrong).is_err());
        let other_geo = Geometry {
            cell_count: 2,
            cell_size: 256,
        };
        assert!(Ring::attach(MmapRaw::map_raw(&f).unwrap(), other_geo, id).is_err());
    }

    #[test]
    fn arm_is_refused_with_a_claim_or_message_and_a_send_takes_the_wakeup_once() {
        let r = ring(4, 128);
        let mut tail = Cursor::default();
        assert!(!r.take_wakeup(), "not armed: no wake-up");
        assert!(r.arm(&mut tail));
        assert_eq!(put(&r, 1, b"a"), Some(1));
        assert!(r.take_wakeup(), "armed: the sender wakes the owner");
        assert!(!r.take_wakeup(), "only one sender wakes it");
        // A published message (or a claimed cell: `head` moved) refuses arming.
        assert!(!r.arm(&mut tail));
        assert!(!r.take_wakeup(), "a refused arm leaves nothing armed");
        assert_eq!(r.receive(&mut tail, 8, &mut |_, _| {}), 1);
        assert!(r.arm(&mut tail));
        r.disarm();
        assert_eq!(put(&r, 1, b"b"), Some(1));
        assert!(!r.take_wakeup(), "disarmed: no wake-up");
    }

    #[test]
    fn geometry_bounds() {
        for (c, s) in [
            (3, 128),
            (1, 128),
            (4, 100),
            (4, 64),
            (1 << 17, 128),
            (4, 2 << 20),
        ] {
            assert!(
                Geometry {
                    cell_count: c,
                    cell_size: s
                }
                .validate("t")
                .is_err(),
                "{c} x {s}"
            );
        }
        assert!(
            Geometry {
                cell_count: 256,
                cell_size: 8192
            }
            .validate("t")
            .is_ok()
        );
    }

    #[test]
    fn dead_writer_slot_is_skipped() {
        for head_moved in [false, true] {
            let r = ring(4, 128);
            // A producer claimed position 0 and died, before or after moving `head`.
            claim_as(&r, 0, u32::MAX - 1);
            if head_moved {
                r.u64_at(OFF_HEAD).store(1, Ordering::Relaxed);
                assert_eq!(put(&r, 1, b"later"), Some(5));
            } else {
                assert_eq!(put(&r, 1, b"later"), None, "claimed cell must not be taken");
            }
            let mut tail = Cursor::default();
            assert_eq!(
                r.receive(&mut tail, 8, &mut |_, _| {}),
                0,
                "stuck behind the claim"
            );
            let mut w = StallWatch::default();
            assert!(!w.check(&r, &mut tail));
            w.since = Some((0, Instant::now() - STALL_LIMIT));
            assert!(w.check(&r, &mut tail));
            if !head_moved {
                assert_eq!(put(&r, 1, b"later"), Some(5));
            }
            let mut got = Vec::new();
            assert_eq!(r.receive(&mut tail, 8, &mut |_, d| got.push(d.to_vec())), 1);
            assert_eq!(got, vec![b"later".to_vec()]);
            // The skipped cell is usable again on the next lap (and the delivered one once the
            // consumer gives it back).
            r.give_back(&mut tail);
            for _ in 0..4 {
                assert!(put(&r, 1, b"n").is_some());
            }
        }
    }

    #[test]
    fn live_claim_is_not_skipped() {
        let r = ring(4, 128);
        claim_as(&r, 0, sys::my_pid());
        let mut tail = Cursor::default();
        let mut w = StallWatch {
            since: Some((0, Instant::now() - STALL_LIMIT)),
        };
        assert!(!w.check(&r, &mut tail));
        assert_eq!(tail.tail(), 0);
    }

    #[test]
    fn a_message_of_48_bytes_is_the_cells_first_cache_line() {
        let r = ring(4, 128);
        let msg: Vec<u8> = (1..=48).collect();
        assert_eq!(put(&r, 7, &msg), Some(48));
        let off = r.cell_off(0);
        assert_eq!(off % 64, 0, "cells start on a cache line");
        // Header (seq, meta) and all 48 bytes lie in the line at `off`.
        assert_eq!(r.u64_at(off + C_SEQ).load(Ordering::Relaxed), 1);
        let meta = r.u64_at(off + C_META).load(Ordering::Relaxed);
        assert_eq!(meta & META_LEN_MASK, 48);
        assert_eq!((meta >> META_ID_SHIFT) as u8, 7);
        assert_eq!((meta >> META_PID_SHIFT) as u32, sys::my_pid());
        assert_ne!(meta & META_CLAIMED, 0);
        for (i, b) in msg.iter().enumerate() {
            // SAFETY: inside the mapping (a 128-byte cell at `off`); nobody writes it now.
            let got = unsafe { *r.base.add(off + CELL_HEADER + i) };
            assert_eq!(got, *b, "byte {i}");
        }
        assert!(off + CELL_HEADER + 48 <= off + 64);
        let mut got = Vec::new();
        assert_eq!(
            r.receive(&mut Cursor::default(), 8, &mut |_, d| got.push(d.to_vec())),
            1
        );
        assert_eq!(got, vec![msg]);
    }

    #[test]
    fn garbage_in_a_cell_is_dropped_not_read_past_the_cell() {
        let r = ring(4, 128);
        let cap = r.geometry().capacity() as u64;
        // A hostile peer publishes cells with a length past the cell, an id out of range,
        // and every bit set; then a good message follows.
        let bad = [
            META_CLAIMED | (cap + 1),
            META_CLAIMED | (u64::from(AM_ID_MAX as u8) << META_ID_SHIFT) | 4,
            !META_NOP,
        ];
        for (pos, meta) in bad.iter().enumerate() {
            let off = r.cell_off(pos as u64);
            r.u64_at(off + C_META).store(*meta, Ordering::Relaxed);
            r.u64_at(off + C_SEQ)
                .store(pos as u64 + 1, Ordering::Release);
        }
        r.u64_at(OFF_HEAD).store(3, Ordering::Relaxed);
        assert_eq!(put(&r, 2, b"good"), Some(4));
        let mut tail = Cursor::default();
        let mut got = Vec::new();
        assert_eq!(
            r.receive(&mut tail, 8, &mut |id, d| got.push((id, d.to_vec()))),
            1
        );
        assert_eq!(got, vec![(2, b"good".to_vec())]);
        assert_eq!(tail.tail(), 4);
        // A garbage `head` only picks another cell of the ring.
        r.u64_at(OFF_HEAD).store(u64::MAX - 1, Ordering::Relaxed);
        r.give_back(&mut tail);
        let _ = put(&r, 1, b"x");
    }

    #[test]
    fn arm_is_refused_while_the_cell_at_the_tail_is_only_claimed() {
        let r = ring(4, 128);
        let mut tail = Cursor::default();
        claim_as(&r, 0, sys::my_pid());
        assert!(
            !r.arm(&mut tail),
            "a claimed cell is a message being written"
        );
        r.u64_at(r.cell_off(0) + C_META).store(0, Ordering::Relaxed);
        assert!(r.arm(&mut tail));
        r.disarm();
    }

    #[test]
    fn a_segment_of_another_layout_version_is_refused() {
        let geo = Geometry {
            cell_count: 4,
            cell_size: 128,
        };
        let f = anon(geo.segment_size());
        let id = SegIdentity {
            owner_pid: sys::my_pid(),
            seg_id: 5,
            token: 6,
        };
        let owner = Ring::init(MmapRaw::map_raw(&f).unwrap(), geo, id, 0).unwrap();
        owner.u32_at(OFF_VERSION).store(2, Ordering::Relaxed);
        let e = Ring::attach(MmapRaw::map_raw(&f).unwrap(), geo, id).unwrap_err();
        assert!(e.to_string().contains("layout 3 here, 2 there"), "{e}");
    }
}
