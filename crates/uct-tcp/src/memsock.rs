//! An in-memory stream socket pair for tests: what one end sends the other receives, through a
//! bounded buffer (a full buffer refuses with `WouldBlock`, like a full socket) and in pieces
//! of at most `max_io` bytes per call (so every partial read and write path runs). No
//! descriptor is involved; the protocol above cannot tell it from a TCP socket.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddrV4};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::stream::{OwnedSock, RawRecv, Sock};

/// One direction of the pair.
#[derive(Debug, Default)]
struct Pipe {
    data: VecDeque<u8>,
    /// The writer shut its side down: the reader sees end of stream once `data` is drained.
    closed: bool,
    /// The reader shut its side down: it reads end of stream at once.
    read_shut: bool,
}

/// One end of an in-memory connection.
#[derive(Debug)]
pub(crate) struct MemSock {
    rx: Arc<Mutex<Pipe>>,
    tx: Arc<Mutex<Pipe>>,
    /// Bytes each direction holds at most.
    cap: usize,
    /// Bytes one call moves at most.
    pub(crate) max_io: usize,
    /// What `local_addr` reports.
    pub(crate) local: SocketAddrV4,
    /// What a finished connect reports (`None`: still connecting).
    pub(crate) connect: Option<io::ErrorKind>,
    pub(crate) connecting: bool,
}

fn lock(p: &Mutex<Pipe>) -> MutexGuard<'_, Pipe> {
    p.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A connected pair; each direction holds `cap` bytes, each call moves at most `max_io`.
pub(crate) fn pair(cap: usize, max_io: usize) -> (MemSock, MemSock) {
    let (ab, ba) = (Arc::default(), Arc::default());
    let end = |rx: &Arc<Mutex<Pipe>>, tx: &Arc<Mutex<Pipe>>, port| MemSock {
        rx: rx.clone(),
        tx: tx.clone(),
        cap,
        max_io,
        local: SocketAddrV4::new([127, 0, 0, 1].into(), port),
        connect: None,
        connecting: false,
    };
    (end(&ba, &ab, 50001), end(&ab, &ba, 50002))
}

impl MemSock {
    /// Another handle on the same end (what the interface's lock-free reader is to the socket
    /// a connection owns).
    pub(crate) fn reader(&self) -> MemSock {
        MemSock {
            rx: self.rx.clone(),
            tx: self.tx.clone(),
            cap: self.cap,
            max_io: self.max_io,
            local: self.local,
            connect: self.connect,
            connecting: self.connecting,
        }
    }

    /// Bytes sent to this end and not read yet.
    pub(crate) fn pending_in(&self) -> usize {
        lock(&self.rx).data.len()
    }

    /// Whether the peer shut down its sending side.
    pub(crate) fn peer_closed(&self) -> bool {
        lock(&self.rx).closed
    }

    /// Everything sent to this end so far, taken.
    pub(crate) fn take_all(&mut self) -> Vec<u8> {
        lock(&self.rx).data.drain(..).collect()
    }

    /// Send raw bytes to the peer, ignoring the capacity (a test writing garbage).
    pub(crate) fn inject(&mut self, bytes: &[u8]) {
        lock(&self.tx).data.extend(bytes);
    }

    fn take_into(&mut self, mut put: impl FnMut(usize, &[u8]), want: usize) -> io::Result<usize> {
        let mut p = lock(&self.rx);
        if p.read_shut {
            return Ok(0);
        }
        if p.data.is_empty() {
            return if p.closed {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let n = want.min(self.max_io).min(p.data.len());
        let bytes: Vec<u8> = p.data.drain(..n).collect();
        put(0, &bytes);
        Ok(n)
    }
}

impl Sock for MemSock {
    fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut p = lock(&self.tx);
        if p.closed {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let room = self.cap - p.data.len();
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut left = room.min(self.max_io);
        let mut n = 0;
        for b in bufs {
            let k = b.len().min(left);
            p.data.extend(&b[..k]);
            n += k;
            left -= k;
            if left == 0 {
                break;
            }
        }
        Ok(n)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf.len();
        self.take_into(|at, b| buf[at..at + b.len()].copy_from_slice(b), want)
    }
}

impl OwnedSock for MemSock {
    fn connect_status(&mut self) -> Option<io::Result<()>> {
        if self.connecting {
            return None;
        }
        Some(self.connect_result())
    }

    fn connect_result(&mut self) -> io::Result<()> {
        match self.connect {
            None => Ok(()),
            Some(k) => Err(k.into()),
        }
    }

    fn shutdown(&mut self, how: Shutdown) {
        lock(&self.tx).closed = true;
        if how == Shutdown::Both {
            lock(&self.rx).read_shut = true;
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddrV4> {
        Ok(self.local)
    }
}

impl RawRecv for MemSock {
    unsafe fn recv_raw(&mut self, ptr: *mut u8, len: usize) -> io::Result<usize> {
        self.take_into(
            |at, b| {
                // SAFETY: the caller guarantees `ptr` is writable for `len` bytes; `take_into`
                // hands over at most `len` bytes starting at offset 0.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), ptr.add(at), b.len()) }
            },
            len,
        )
    }

    unsafe fn recv_raw_vectored(&mut self, bufs: &[(*mut u8, usize)]) -> io::Result<usize> {
        let want = bufs.iter().map(|b| b.1).sum();
        self.take_into(
            |_, mut b| {
                for &(p, l) in bufs {
                    let k = l.min(b.len());
                    // SAFETY: the caller guarantees every `(p, l)` is writable for `l` bytes;
                    // at most `k <= l` bytes are written there.
                    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p, k) };
                    b = &b[k..];
                    if b.is_empty() {
                        break;
                    }
                }
            },
            want,
        )
    }
}
