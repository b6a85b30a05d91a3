//! The copy protocols' decisions and sequencing, over [`CopyIo`] / [`BounceIo`]: a GPU buffer
//! copied to host memory fragment by fragment through a send staging fragment (each copy
//! waited for), host bytes copied into GPU memory in `put_short` pieces (an arrived eager
//! message, an inline active-message payload), and a full stream receive landing in GPU memory
//! through the slots of a pinned window (several copies in flight).

use rucx_ucs::{Error, Result};
use rucx_uct::{Iov, MemHandle, MemRegion, OpStatus, RemoteKey};

use super::copy_io::{BounceIo, CopyIo, CopyPost};
use crate::context::RegGuard;
use crate::proto::rma::STAGED_FRAGS;

/// Host memory for `len` bytes, or a typed error naming what it was for.
pub(crate) fn host_buf(len: usize, what: &str) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::NoMemory(format!("{len} bytes of host memory for {what}")))?;
    Ok(v)
}

/// Host bytes on their way into GPU memory at `to` by the copy lane's `put_short`, in pieces
/// of at most the lane's size, in order.
pub(crate) struct ShortCopy<'a> {
    data: &'a [u8],
    to: u64,
    /// Bytes copied.
    done: usize,
}

impl<'a> ShortCopy<'a> {
    pub(crate) fn new(data: &'a [u8], to: usize) -> Self {
        ShortCopy {
            data,
            to: to as u64,
            done: 0,
        }
    }

    /// Post the pieces left. `Ok(false)`: the lane pushed back (call again); a failure ends
    /// the copy.
    pub(crate) fn post(&mut self, io: &mut impl CopyIo, key: &RemoteKey) -> Result<bool> {
        let max = io.copy_short_max()?.max(1);
        while self.done < self.data.len() {
            let n = max.min(self.data.len() - self.done);
            let piece = &self.data[self.done..self.done + n];
            let at = self.to + self.done as u64;
            let posted = io.copy_post(None, |ep, _| {
                ep.put_short(piece, at, key).map(|()| OpStatus::Done)
            })?;
            if posted == CopyPost::PushedBack {
                return Ok(false);
            }
            self.done += n;
        }
        Ok(true)
    }

    /// Post every piece, trying again while the lane pushes back (its short copies free
    /// themselves).
    pub(crate) fn run(mut self, io: &mut impl CopyIo, key: &RemoteKey) -> Result<()> {
        while !self.post(io, key)? {
            std::hint::spin_loop();
        }
        Ok(())
    }
}

/// Copy host bytes `data` into GPU buffer `to` (`to.len` is `data.len()`), registered with the
/// copy lane for this copy alone.
pub(crate) fn host_to_gpu(io: &mut impl CopyIo, to: MemRegion, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let (g, key) = io.copy_key(MemRegion {
        len: data.len(),
        ..to
    })?;
    let r = ShortCopy::new(data, to.addr).run(io, &key);
    drop(g);
    r
}

/// Arrived eager bytes `data` at `offset` of a receive into GPU buffer `buf` (its whole
/// capacity): the buffer is registered with the copy lane on the first bytes (kept in `reg`
/// for the next ones), and the bytes that fit are copied.
pub(crate) fn eager_to_gpu(
    io: &mut impl CopyIo,
    reg: &mut Option<Box<(RegGuard, RemoteKey)>>,
    buf: MemRegion,
    offset: usize,
    data: &[u8],
) -> Result<()> {
    let key = match reg {
        Some(k) => k.1.clone(),
        None => {
            let k = io.copy_key(buf)?;
            let key = k.1.clone();
            *reg = Some(Box::new(k));
            key
        }
    };
    let n = data.len().min(buf.len.saturating_sub(offset));
    ShortCopy::new(&data[..n], buf.addr + offset).run(io, &key)
}

/// The host buffer a stream receive into GPU buffer `to` fills (`to.len` bytes), and the copy
/// lane's registration of the GPU buffer (made first: a refusal is told when posted).
pub(crate) fn stream_bounce(
    io: &mut impl CopyIo,
    to: MemRegion,
) -> Result<(Vec<u8>, (RegGuard, RemoteKey))> {
    let key = io.copy_key(to)?;
    let mut b = host_buf(to.len, "a stream receive into GPU memory")?;
    b.resize(to.len, 0);
    Ok((b, key))
}

/// Copy GPU memory `from` (at most a staging fragment) into a send staging fragment by the copy
/// lane, and wait for the copy: the fragment's index and address, which the caller gives back
/// with [`BounceIo::release_bounce`]. A failure gives the fragment back.
pub(crate) fn bounce_out(io: &mut impl BounceIo, from: MemRegion) -> Result<(usize, usize)> {
    let (frag, memh) = io.bounce_staging()?;
    let (g, key) = io.copy_key(from)?;
    let (f, host) = io
        .take_bounce()
        .ok_or_else(|| Error::NoResource("every send staging fragment is in use".into()))?;
    if from.len > frag {
        io.release_bounce(f);
        return Err(Error::InvalidParam("bounce larger than a fragment".into()));
    }
    let res = copy_waited(io, host, &memh, from, &key);
    drop(g);
    match res {
        Ok(()) => Ok((f, host)),
        Err(e) => {
            io.release_bounce(f);
            Err(e)
        }
    }
}

/// One copy of `from` into host `host` (the copy lane's handle `memh`), posted (progressing
/// the lane while it pushes back: its copies in flight finish by themselves) and waited for.
fn copy_waited(
    io: &mut impl BounceIo,
    host: usize,
    memh: &MemHandle,
    from: MemRegion,
    key: &RemoteKey,
) -> Result<()> {
    let iov = [Iov {
        addr: host,
        len: from.len,
        memh,
    }];
    let token = loop {
        match io.copy_post(None, |ep, t| ep.get_zcopy(&iov, from.addr as u64, key, t))? {
            CopyPost::PushedBack => {
                io.copy_poll(None);
            }
            CopyPost::Done => return Ok(()),
            CopyPost::InProgress(t) => break t,
        }
    };
    loop {
        if let Some(r) = io.copy_poll(Some(token)) {
            return r;
        }
    }
}

/// Copy GPU buffer `from` into a new host buffer, fragment by fragment through one send
/// staging fragment at a time ([`bounce_out`]).
pub(crate) fn gpu_to_host(io: &mut impl BounceIo, from: MemRegion) -> Result<Vec<u8>> {
    let len = from.len;
    let mut out = host_buf(len, "a copy of a GPU buffer")?;
    if len == 0 {
        return Ok(out);
    }
    let frag = io.bounce_staging()?.0.max(1);
    let mut off = 0;
    while off < len {
        let n = frag.min(len - off);
        let (f, host) = bounce_out(
            io,
            MemRegion {
                addr: from.addr + off,
                len: n,
                ..from
            },
        )?;
        io.read_host(host, n, &mut out);
        io.release_bounce(f);
        off += n;
    }
    io.count("GPU buffer copied to host");
    Ok(out)
}

/// A pinned window's slots, as a landing receive sees them: where they start, and the copy
/// lane's handle on them.
pub(crate) struct Slots<'a> {
    pub(crate) base: usize,
    pub(crate) memh: &'a MemHandle,
}

/// What a landing receive wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LandNext {
    /// Copies in flight fill every slot (or every byte is posted): wait for their completions.
    Wait,
    /// The copy lane pushed back: pump again after progress.
    Later,
    /// Every byte is in GPU memory.
    Complete,
}

/// A full stream receive into GPU memory on its way from its host buffer to the GPU: each
/// fragment copied by the CPU into a free slot of a pinned window, then by the copy lane to
/// the GPU (several in flight).
pub(crate) struct LandState {
    pub(crate) peer: usize,
    /// The stream's bytes for this receive (the whole receive).
    host: Vec<u8>,
    /// Slot size.
    frag: usize,
    /// Per slot: the copy in flight (token, bytes).
    slots: Vec<Option<(u64, usize)>>,
    /// Next offset to copy.
    next: usize,
    /// Bytes on the GPU.
    done: usize,
}

impl LandState {
    /// Receive `host` (every byte of it) of peer `peer`, through slots of `frag` bytes.
    pub(crate) fn new(peer: usize, host: Vec<u8>, frag: usize) -> Self {
        let frag = frag.max(1);
        let nslots = host.len().div_ceil(frag).clamp(1, STAGED_FRAGS);
        LandState {
            peer,
            host,
            frag,
            slots: vec![None; nslots],
            next: 0,
            done: 0,
        }
    }

    /// Bytes in GPU memory.
    #[cfg(test)]
    pub(crate) fn landed(&self) -> usize {
        self.done
    }

    /// Copy what fits into free slots of `win` and post their copies to GPU memory at `to`
    /// (key `key`) for request `req`.
    pub(crate) fn pump(
        &mut self,
        io: &mut impl CopyIo,
        req: u64,
        (to, key): (usize, &RemoteKey),
        win: &Slots<'_>,
    ) -> Result<LandNext> {
        let cap = self.host.len();
        loop {
            if self.done >= cap {
                return Ok(LandNext::Complete);
            }
            let Some(k) = self.slots.iter().position(Option::is_none) else {
                return Ok(LandNext::Wait);
            };
            if self.next >= cap {
                return Ok(LandNext::Wait);
            }
            let (off, n) = (self.next, self.frag.min(cap - self.next));
            let at = win.base + k * self.frag;
            io.write_host(at, &self.host[off..off + n]);
            let iov = [Iov {
                addr: at,
                len: n,
                memh: win.memh,
            }];
            let gpu_at = (to + off) as u64;
            match io.copy_post(Some(req), |ep, t| ep.put_zcopy(&iov, gpu_at, key, t))? {
                CopyPost::PushedBack => return Ok(LandNext::Later),
                CopyPost::Done => self.done += n,
                CopyPost::InProgress(t) => self.slots[k] = Some((t, n)),
            }
            self.next = off + n;
        }
    }

    /// Copies completed: free the slots of those no longer `in_flight`.
    pub(crate) fn on_copies_done(&mut self, in_flight: impl Fn(u64) -> bool) {
        for s in self.slots.iter_mut() {
            if let Some((t, n)) = *s
                && !in_flight(t)
            {
                self.done += n;
                *s = None;
            }
        }
    }
}
