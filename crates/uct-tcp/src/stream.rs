//! The byte stream under the frames: the socket operations the protocol uses (as traits, so
//! the protocol runs over an in-memory stream in tests), [`RxBuf`], which reassembles frames
//! from reads of any size, and [`TxQueue`], which keeps what a write did not take (owned
//! bytes or references into registered memory). Partial reads and writes are invisible above
//! this module. Nothing here touches a descriptor; the socket implementations are in `sock`.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddrV4};

use rucx_uct::MemHandle;

use crate::wire::{HDR_LEN, Header, Kind, PUT_FIXED, WireError, parse_header};

/// Byte-stream socket operations the buffers need; a trait so tests can cut every transfer
/// into 1-byte pieces.
pub trait Sock {
    /// Write as much of `bufs` as the socket takes now (`WouldBlock` when nothing).
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Read what is available (0 at end of stream, `WouldBlock` when nothing).
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize>;
}

/// The socket a connection owns and writes (behind the connection's lock): besides bytes, the
/// state of a connect in progress, shutting down, and its local address.
pub(crate) trait OwnedSock: Sock {
    /// Whether a connect in progress finished, asked without waiting: `None` while it is still
    /// in progress, else its outcome.
    fn connect_status(&mut self) -> Option<io::Result<()>>;
    /// The outcome of a connect whose socket was reported writable (or in error).
    fn connect_result(&mut self) -> io::Result<()>;
    /// Shut down one or both directions (best effort).
    fn shutdown(&mut self, how: Shutdown);
    /// The local address of the connection.
    fn local_addr(&self) -> io::Result<SocketAddrV4>;
}

/// The reading side of a connection's socket (used without the connection's lock), which can
/// also receive straight into registered memory.
pub(crate) trait RawRecv: Sock {
    /// Receive up to `len` bytes into memory at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes for the duration of the call, and no Rust
    /// reference to that memory may be live.
    unsafe fn recv_raw(&mut self, ptr: *mut u8, len: usize) -> io::Result<usize>;
    /// Receive into the buffers `(ptr, len)` in order.
    ///
    /// # Safety
    /// Every buffer must be valid for writes of its length for the duration of the call, and
    /// no Rust reference to that memory may be live.
    unsafe fn recv_raw_vectored(&mut self, bufs: &[(*mut u8, usize)]) -> io::Result<usize>;
}

/// Minimum free space offered to one read.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

/// Reassembles frames from a byte stream.
#[derive(Debug, Default)]
pub struct RxBuf {
    buf: Vec<u8>,
    head: usize,
    tail: usize,
    /// The owner takes `Put` and `GetRep` bodies straight from the socket
    /// ([`partial`](Self::partial)): room is made for their fixed fields only, never for the
    /// whole body.
    direct_bodies: bool,
}

/// Outcome of [`RxBuf::fill`].
#[derive(Debug, PartialEq, Eq)]
pub enum Fill {
    /// This many bytes arrived, filling the space offered: more may be waiting.
    Data(usize),
    /// This many bytes arrived, less than the space offered: the socket had no more.
    Drained(usize),
    /// Nothing to read now.
    WouldBlock,
    /// The peer closed its side.
    Eof,
}

impl Fill {
    /// What one `recv` offered `asked` bytes of room returned, for a reader.
    #[inline]
    pub fn of_recv(r: io::Result<usize>, asked: usize) -> io::Result<Fill> {
        match r {
            Ok(0) => Ok(Fill::Eof),
            Ok(n) if n < asked => Ok(Fill::Drained(n)),
            Ok(n) => Ok(Fill::Data(n)),
            // The polling reader's usual answer, told by its number (no kind look-up).
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(Fill::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Fill::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Fill::Data(0)),
            Err(e) => Err(e),
        }
    }

    /// Bytes that arrived.
    pub fn bytes(&self) -> usize {
        match self {
            Fill::Data(n) | Fill::Drained(n) => *n,
            Fill::WouldBlock | Fill::Eof => 0,
        }
    }
}

impl RxBuf {
    /// An empty buffer.
    #[cfg(test)]
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty buffer whose owner receives `Put` and `GetRep` bodies itself: it takes each
    /// such frame as soon as [`partial`](Self::partial) shows its fixed fields, and reads the
    /// rest of the body from the socket into the destination.
    pub fn with_direct_bodies() -> Self {
        RxBuf {
            direct_bodies: true,
            ..Self::default()
        }
    }

    /// Bytes of buffer space allocated (for tests).
    #[cfg(test)]
    pub(crate) fn allocated(&self) -> usize {
        self.buf.len()
    }

    /// Bytes received and not yet consumed.
    #[cfg(test)]
    pub fn buffered(&self) -> usize {
        self.tail - self.head
    }

    /// Read once from `sock`, making room for at least the frame being assembled.
    pub fn fill(&mut self, sock: &mut dyn Sock) -> io::Result<Fill> {
        let need = match self.peek_header() {
            Some(Ok(h)) if self.direct_bodies && h.kind == Kind::Put => HDR_LEN + PUT_FIXED,
            Some(Ok(h)) if self.direct_bodies && h.kind == Kind::GetRep => HDR_LEN + 8,
            Some(Ok(h)) => HDR_LEN + h.body_len,
            _ => HDR_LEN,
        };
        let want = need.max(READ_CHUNK);
        if self.buf.len() - self.head < want {
            // Not enough room after head: move the partial frame to the front, then grow.
            self.buf.copy_within(self.head..self.tail, 0);
            self.tail -= self.head;
            self.head = 0;
            if self.buf.len() < want {
                self.buf.resize(want, 0);
            }
        } else if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
        let room = self.buf.len() - self.tail;
        let f = Fill::of_recv(sock.recv(&mut self.buf[self.tail..]), room)?;
        self.tail += f.bytes();
        Ok(f)
    }

    /// Whether no received byte waits (no frame, not even part of one): the receiver then
    /// has nothing to look at before it reads.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    fn peek_header(&self) -> Option<Result<Header, WireError>> {
        let avail = &self.buf[self.head..self.tail];
        let h: &[u8; HDR_LEN] = avail.get(..HDR_LEN)?.try_into().ok()?;
        Some(parse_header(h))
    }

    /// The next complete frame, if one has arrived: its header and body. Call
    /// [`consume`](Self::consume) with the header when done with it.
    pub fn frame(&self) -> Result<Option<(Header, &[u8])>, WireError> {
        match self.peek_header() {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok(h)) => {
                let start = self.head + HDR_LEN;
                if self.tail - start < h.body_len {
                    Ok(None)
                } else {
                    Ok(Some((h, &self.buf[start..start + h.body_len])))
                }
            }
        }
    }

    /// The next frame when only part of it has arrived: its header and the body bytes so far.
    pub fn partial(&self) -> Option<(Header, &[u8])> {
        match self.peek_header() {
            Some(Ok(h)) => {
                let start = self.head + HDR_LEN;
                let avail = self.tail - start;
                (avail < h.body_len).then(|| (h, &self.buf[start..self.tail]))
            }
            _ => None,
        }
    }

    /// Drop the header and the first `n` body bytes of the frame [`partial`](Self::partial)
    /// returned (the caller takes the rest of its body from the socket).
    pub fn consume_partial(&mut self, n: usize) {
        self.head += HDR_LEN + n;
        debug_assert!(self.head <= self.tail);
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
    }

    /// Drop the frame returned last by [`frame`](Self::frame).
    pub fn consume(&mut self, h: &Header) {
        self.head += HDR_LEN + h.body_len;
        debug_assert!(self.head <= self.tail);
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
    }
}

/// A piece of queued output.
#[derive(Debug)]
enum Chunk {
    /// Bytes owned by the queue.
    Owned(Vec<u8>),
    /// Bytes in registered memory, kept registered by the handle until written.
    Zcopy {
        memh: MemHandle,
        addr: usize,
        len: usize,
    },
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Chunk::Owned(v) => v.len(),
            Chunk::Zcopy { len, .. } => *len,
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Owned(v) => v,
            Chunk::Zcopy { memh, addr, len } => {
                debug_assert!(memh.region().contains(*addr, *len));
                // SAFETY: the endpoint checked that [addr, addr+len) lies inside `memh`'s host
                // region (Iov::check_all) and that the handle belongs to the tcp domain; by
                // `MemoryDomain::mem_reg`'s contract the memory stays allocated and readable
                // while a clone of the handle lives, and this chunk holds one.
                unsafe { std::slice::from_raw_parts(*addr as *const u8, *len) }
            }
        }
    }
}

#[derive(Debug)]
struct Item {
    chunk: Chunk,
    /// Completion token reported when the last byte of this item was written.
    token: Option<u64>,
    seq: u64,
}

/// Owned chunks shorter than this are merged into the previous owned chunk.
const COALESCE_MAX: usize = 64 * 1024;
/// Most iov entries handed to one `sendmsg`.
const WRITE_IOV: usize = 64;

/// Output waiting for the socket.
#[derive(Debug, Default)]
pub struct TxQueue {
    items: VecDeque<Item>,
    /// Bytes of the first item already written.
    head_off: usize,
    queued: usize,
    next_seq: u64,
    /// Items written completely whose token is to be reported: `(item seq, token)`.
    done: Vec<(u64, u64)>,
    /// A large owned buffer written completely, kept for [`take_buf`](Self::take_buf).
    spare: Option<Vec<u8>>,
}

/// Owned buffers at least this large are kept for reuse once written.
const SPARE_MIN: usize = 64 * 1024;

impl TxQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Unwritten bytes.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Queue owned bytes; returns the item's sequence number.
    pub fn push_owned(&mut self, data: &[u8], token: Option<u64>) -> u64 {
        self.queued += data.len();
        if token.is_none() && data.len() < COALESCE_MAX {
            // Merge into the last owned item: fewer allocations and iov entries.
            if let Some(last) = self.items.back_mut()
                && last.token.is_none()
                && let Chunk::Owned(v) = &mut last.chunk
                && v.len() < COALESCE_MAX
            {
                v.extend_from_slice(data);
                return last.seq;
            }
        }
        self.push_item(Chunk::Owned(data.to_vec()), token)
    }

    /// Queue an owned buffer without copying it.
    pub fn push_vec(&mut self, data: Vec<u8>, token: Option<u64>) -> u64 {
        if data.len() < 4096 && token.is_none() {
            return self.push_owned(&data, None);
        }
        self.queued += data.len();
        self.push_item(Chunk::Owned(data), token)
    }

    /// Queue a reference to registered memory; the caller validated `[addr, addr+len)` against
    /// `memh`, which must be a host registration of the tcp domain.
    pub fn push_zcopy(
        &mut self,
        memh: &MemHandle,
        addr: usize,
        len: usize,
        token: Option<u64>,
    ) -> u64 {
        self.queued += len;
        self.push_item(
            Chunk::Zcopy {
                memh: memh.clone(),
                addr,
                len,
            },
            token,
        )
    }

    fn push_item(&mut self, chunk: Chunk, token: Option<u64>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.items.push_back(Item { chunk, token, seq });
        seq
    }

    /// Write as much as the socket takes. Returns the bytes written; `WouldBlock` is not an
    /// error (it returns what was written so far).
    pub fn write(&mut self, sock: &mut dyn Sock) -> io::Result<usize> {
        let mut total = 0;
        loop {
            self.pop_empty_front();
            if self.items.is_empty() {
                break;
            }
            let n = {
                let mut iov: [IoSlice<'_>; WRITE_IOV] = [IoSlice::new(&[]); WRITE_IOV];
                let mut cnt = 0;
                for (i, it) in self.items.iter().take(WRITE_IOV).enumerate() {
                    let b = it.chunk.bytes();
                    iov[i] = IoSlice::new(if i == 0 { &b[self.head_off..] } else { b });
                    cnt += 1;
                }
                match sock.send_vectored(&iov[..cnt]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            };
            if n == 0 {
                break;
            }
            total += n;
            self.advance(n);
        }
        Ok(total)
    }

    fn advance(&mut self, mut n: usize) {
        self.queued -= n;
        while n > 0 {
            let first = self
                .items
                .front()
                .expect("advance past the queue")
                .chunk
                .len();
            let left = first - self.head_off;
            if n < left {
                self.head_off += n;
                return;
            }
            n -= left;
            self.head_off = 0;
            let it = self.items.pop_front().expect("nonempty");
            if let Some(t) = it.token {
                self.done.push((it.seq, t));
            }
            if let Chunk::Owned(v) = it.chunk
                && v.capacity() >= SPARE_MIN
                && self
                    .spare
                    .as_ref()
                    .is_none_or(|s| s.capacity() < v.capacity())
            {
                self.spare = Some(v);
            }
        }
        self.pop_empty_front();
    }

    /// Items of length 0 at the front are complete as soon as they get there.
    fn pop_empty_front(&mut self) {
        while self.head_off == 0 && self.items.front().is_some_and(|it| it.chunk.len() == 0) {
            let it = self.items.pop_front().expect("nonempty");
            if let Some(t) = it.token {
                self.done.push((it.seq, t));
            }
        }
    }

    /// Remove and return the token of item `seq` if it completed since the last drain.
    #[cfg(test)]
    pub fn take_done(&mut self, seq: u64) -> Option<u64> {
        let pos = self.done.iter().rposition(|(s, _)| *s == seq)?;
        Some(self.done.remove(pos).1)
    }

    /// Items written completely whose tokens were not drained yet.
    pub fn has_done(&self) -> bool {
        !self.done.is_empty()
    }

    /// Tokens of items written completely since the last call.
    pub fn drain_done(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.done.drain(..).map(|(_, t)| t)
    }

    /// An empty buffer with room for `cap` bytes, to fill and hand to
    /// [`push_vec`](Self::push_vec): a large buffer written earlier when one is big enough (so
    /// a connection serving large gets does not allocate and fault in a fresh one each time).
    pub fn take_buf(&mut self, cap: usize) -> Vec<u8> {
        match self.spare.take() {
            Some(mut v) if v.capacity() >= cap => {
                v.clear();
                v
            }
            other => {
                self.spare = other;
                Vec::with_capacity(cap)
            }
        }
    }

    /// Drop everything queued; returns the tokens of items that never completed.
    pub fn clear(&mut self) -> Vec<u64> {
        let tokens = self.items.drain(..).filter_map(|it| it.token).collect();
        self.head_off = 0;
        self.queued = 0;
        tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recv_outcomes() {
        let e = |k| Err(io::Error::from(k));
        assert_eq!(Fill::of_recv(Ok(0), 8).unwrap(), Fill::Eof);
        assert_eq!(Fill::of_recv(Ok(3), 8).unwrap(), Fill::Drained(3));
        assert_eq!(Fill::of_recv(Ok(8), 8).unwrap(), Fill::Data(8));
        assert_eq!(
            Fill::of_recv(e(io::ErrorKind::WouldBlock), 8).unwrap(),
            Fill::WouldBlock
        );
        assert_eq!(
            Fill::of_recv(e(io::ErrorKind::Interrupted), 8).unwrap(),
            Fill::Data(0)
        );
        assert!(Fill::of_recv(e(io::ErrorKind::ConnectionReset), 8).is_err());
        assert_eq!(Fill::Drained(3).bytes() + Fill::Eof.bytes(), 3);
        // The number the polling read gets, told without the kind look-up.
        let again = Err(io::Error::from_raw_os_error(libc::EAGAIN));
        assert_eq!(Fill::of_recv(again, 8).unwrap(), Fill::WouldBlock);
    }

    /// Empty until bytes arrive, not empty while part of a frame or a whole one waits, empty
    /// again once the last frame is consumed (what the receiver's skip of its frame look-up
    /// relies on).
    #[test]
    fn empty_means_no_byte_waits() {
        let (mut w, mut r) = pair();
        let mut rx = RxBuf::new();
        assert!(rx.is_empty());
        let f = am_frame(3, b"hello");
        w.send_vectored(&[IoSlice::new(&f[..4])]).unwrap();
        assert!(matches!(rx.fill(&mut r).unwrap(), Fill::Drained(4)));
        assert!(!rx.is_empty());
        assert!(rx.frame().unwrap().is_none(), "a part of the header only");
        w.send_vectored(&[IoSlice::new(&f[4..])]).unwrap();
        rx.fill(&mut r).unwrap();
        let (h, body) = rx.frame().unwrap().expect("whole now");
        assert_eq!(body, b"hello");
        assert!(!rx.is_empty());
        rx.consume(&h);
        assert!(rx.is_empty());
        assert_eq!(rx.fill(&mut r).unwrap(), Fill::WouldBlock);
        assert!(rx.is_empty());
    }
    use crate::memsock::{self, MemSock};
    use crate::wire::{RMA_MAX_ZCOPY, header, word};

    /// A connected in-memory pair moving at most one byte per call.
    fn one_byte() -> (MemSock, MemSock) {
        memsock::pair(64 * 1024, 1)
    }

    /// A pair with socket-sized buffers, moving as much as fits.
    fn pair() -> (MemSock, MemSock) {
        memsock::pair(200 * 1024, usize::MAX)
    }

    fn am_frame(id: u8, data: &[u8]) -> Vec<u8> {
        let mut v = header(Kind::Am, id, data.len()).to_vec();
        v.extend_from_slice(data);
        v
    }

    /// Collect every frame until `want` have arrived, driving both sides.
    fn pump(
        tx: &mut TxQueue,
        w: &mut dyn Sock,
        rx: &mut RxBuf,
        r: &mut dyn Sock,
        want: usize,
    ) -> Vec<(Header, Vec<u8>)> {
        let mut got = Vec::new();
        let mut spins = 0u64;
        while got.len() < want {
            tx.write(w).unwrap();
            match rx.fill(r).unwrap() {
                Fill::Eof => panic!("unexpected eof"),
                Fill::Data(_) | Fill::Drained(_) | Fill::WouldBlock => {}
            }
            while let Some((h, body)) = rx.frame().unwrap() {
                got.push((h, body.to_vec()));
                rx.consume(&h);
            }
            spins += 1;
            assert!(spins < 50_000_000, "no progress");
        }
        got
    }

    #[test]
    fn one_byte_reads_and_writes_keep_frames_intact() {
        let (mut w, mut r) = one_byte();
        let mut tx = TxQueue::new();
        let mut rx = RxBuf::new();
        let msgs: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; usize::from(i) * 37]).collect();
        let mut seqs = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            // Alternate merged and separately tokened items.
            let tok = (i % 3 == 0).then_some(i as u64);
            seqs.push(tx.push_owned(&am_frame(i as u8, m), tok));
        }
        let got = pump(&mut tx, &mut w, &mut rx, &mut r, msgs.len());
        for (i, (h, body)) in got.iter().enumerate() {
            assert_eq!(h.kind, Kind::Am);
            assert_eq!(usize::from(h.id), i);
            assert_eq!(body, &msgs[i]);
        }
        assert!(tx.is_empty() && tx.queued() == 0);
        let done: Vec<u64> = tx.drain_done().collect();
        assert_eq!(done, vec![0, 3, 6, 9, 12, 15, 18]);
        assert_eq!(rx.buffered(), 0);
    }

    #[test]
    fn zcopy_chunks_are_sent_from_registered_memory() {
        use rucx_uct::MemRegion;
        use std::sync::Arc;
        let (mut w, mut r) = one_byte();
        let buf: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let memh = MemHandle::new(MemRegion::of_slice(&buf), "test", Arc::new(()));
        let mut tx = TxQueue::new();
        let hdr = header(Kind::Am, 5, 4 + 1000);
        tx.push_owned(&hdr, None);
        tx.push_owned(b"HDR!", None);
        let seq = tx.push_zcopy(&memh, buf.as_ptr() as usize + 100, 1000, Some(77));
        let mut rx = RxBuf::new();
        let got = pump(&mut tx, &mut w, &mut rx, &mut r, 1);
        assert_eq!(&got[0].1[..4], b"HDR!");
        assert_eq!(&got[0].1[4..], &buf[100..1100]);
        assert_eq!(tx.take_done(seq), Some(77));
        assert_eq!(tx.take_done(seq), None);
    }

    #[test]
    fn large_frames_with_partial_io() {
        // A full buffer forces partial writes; frames larger than one read chunk force the
        // receive buffer to grow.
        let (mut w, mut r) = pair();
        let mut tx = TxQueue::new();
        let mut rx = RxBuf::new();
        let big: Vec<u8> = (0..RMA_MAX_ZCOPY).map(|i| (i % 251) as u8).collect();
        let mut f = header(Kind::GetRep, 0, 8 + big.len()).to_vec();
        f.extend_from_slice(&9u64.to_le_bytes());
        f.extend_from_slice(&big);
        for _ in 0..3 {
            tx.push_vec(f.clone(), None);
        }
        let got = pump(&mut tx, &mut w, &mut rx, &mut r, 3);
        for (h, body) in got {
            assert_eq!(h.kind, Kind::GetRep);
            assert_eq!(word(&body, 0), 9);
            assert_eq!(&body[8..], &big[..]);
        }
    }

    #[test]
    fn eof_is_reported() {
        let (mut a, mut r) = pair();
        a.inject(&header(Kind::Detach, 0, 0));
        crate::stream::OwnedSock::shutdown(&mut a, std::net::Shutdown::Write);
        let mut rx = RxBuf::new();
        assert_eq!(rx.fill(&mut r).unwrap(), Fill::Drained(HDR_LEN));
        assert_eq!(rx.fill(&mut r).unwrap(), Fill::Eof);
        assert_eq!(rx.frame().unwrap().unwrap().0.kind, Kind::Detach);
    }

    #[test]
    fn large_buffers_are_reused_once_written() {
        let (mut w, mut r) = pair();
        let mut tx = TxQueue::new();
        let mut v = tx.take_buf(100_000);
        v.resize(100_000, 3);
        let first = v.as_ptr();
        tx.push_vec(v, None);
        let mut sink = vec![0u8; 200_000];
        let mut got = 0;
        while got < 100_000 {
            tx.write(&mut w).unwrap();
            if let Ok(n) = r.recv(&mut sink) {
                got += n;
            }
        }
        assert!(tx.is_empty());
        // A smaller request reuses it; a larger one gets a fresh buffer.
        let v = tx.take_buf(50_000);
        assert!(v.is_empty() && v.as_ptr() == first);
        tx.spare = Some(v);
        let big = tx.take_buf(200_000);
        assert!(big.capacity() >= 200_000 && big.as_ptr() != first);
        assert!(tx.spare.is_some(), "the spare stays for later");
    }

    #[test]
    fn clear_returns_unfinished_tokens() {
        let mut tx = TxQueue::new();
        tx.push_owned(b"abc", Some(1));
        tx.push_owned(b"def", None);
        tx.push_owned(b"ghi", Some(2));
        assert_eq!(tx.queued(), 9);
        assert_eq!(tx.clear(), vec![1, 2]);
        assert!(tx.is_empty());
        assert_eq!(tx.queued(), 0);
    }

    proptest::proptest! {
        #[test]
        fn frames_survive_any_split(sizes in proptest::collection::vec(0usize..3000, 1..12), cut in 1usize..700) {
            // Feed the concatenated stream to RxBuf in pieces of `cut` bytes.
            struct Feed { data: Vec<u8>, pos: usize, cut: usize }
            impl Sock for Feed {
                fn send_vectored(&mut self, _: &[IoSlice<'_>]) -> io::Result<usize> { unreachable!() }
                fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                    if self.pos == self.data.len() { return Err(io::ErrorKind::WouldBlock.into()); }
                    let n = buf.len().min(self.cut).min(self.data.len() - self.pos);
                    buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
                    self.pos += n;
                    Ok(n)
                }
            }
            let mut data = Vec::new();
            for (i, s) in sizes.iter().enumerate() {
                data.extend_from_slice(&am_frame(i as u8, &vec![i as u8; *s]));
            }
            let mut feed = Feed { data, pos: 0, cut };
            let mut rx = RxBuf::new();
            let mut got = Vec::new();
            while rx.fill(&mut feed).unwrap() != Fill::WouldBlock {
                while let Some((h, body)) = rx.frame().unwrap() {
                    got.push((h.id, body.len(), body.iter().all(|b| *b == h.id)));
                    rx.consume(&h);
                }
            }
            proptest::prop_assert_eq!(got.len(), sizes.len());
            for (i, (id, len, ok)) in got.into_iter().enumerate() {
                proptest::prop_assert_eq!(usize::from(id), i);
                proptest::prop_assert_eq!(len, sizes[i]);
                proptest::prop_assert!(ok);
            }
        }
    }
}
