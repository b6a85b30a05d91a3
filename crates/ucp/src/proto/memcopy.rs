//! Whole-buffer copies between GPU memory and host memory by the copy lane, for the protocols
//! that carry GPU payloads through host memory: streams (the byte stream is host bytes in
//! order; a GPU send is copied out before its pieces go, a GPU receive fills a host buffer that
//! is copied on when full) and active messages copied in (a small GPU payload copied out, an
//! inline payload fetched into GPU memory).

use crate::proto::rma::{RmaWindow, STAGED_FRAGS};
use crate::worker::prelude::*;

/// Host memory for `len` bytes, or a typed error naming what it was for.
fn host_buf(len: usize, what: &str) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::NoMemory(format!("{len} bytes of host memory for {what}")))?;
    Ok(v)
}

impl Worker {
    /// Copy `len` bytes of GPU memory at `addr` into a new host buffer, fragment by fragment
    /// through the send staging (each copy waited for).
    pub(crate) fn gpu_to_host(
        &self,
        st: &mut State,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<Vec<u8>> {
        let mut out = host_buf(len, "a copy of a GPU buffer")?;
        if len == 0 {
            return Ok(out);
        }
        st.ensure_staging()?;
        let frag = st.staging.as_ref().map_or(len, |s| s.frag).max(1);
        let mut off = 0;
        while off < len {
            let n = frag.min(len - off);
            let (host, f) = self.bounce(st, addr + off, n, mem, dev)?;
            // SAFETY: `host..host + n` is staging fragment `f`, owned by the worker and written
            // by the copy just waited for; nothing else uses it until it is handed back below.
            out.extend_from_slice(unsafe { host_slice(host, n) });
            if let Some(stg) = st.staging.as_mut() {
                stg.free_send.push(f);
            }
            off += n;
        }
        st.count("GPU buffer copied to host");
        Ok(out)
    }
}

impl State {
    /// Copy host bytes `data` to GPU memory at `addr` (`mem` of device `dev`) through the copy
    /// lane, registered for the copy with `key`.
    fn put_to_gpu(&mut self, addr: usize, data: &[u8], key: &RemoteKey) -> Result<()> {
        let (ci, ep) = self.copy.as_mut().ok_or_else(|| Error::Unsupported {
            what: "copying into GPU memory".into(),
            why: "no copy transport (cuda_copy) is open; add cuda_copy to RUCX_TLS".into(),
        })?;
        let max = self.slots[*ci].attr.limits.put_max_short.max(1);
        let mut done = 0;
        while done < data.len() {
            let n = max.min(data.len() - done);
            loop {
                match ep.put_short(&data[done..done + n], (addr + done) as u64, key) {
                    Err(e) if e.is_retryable() => std::hint::spin_loop(),
                    other => break other?,
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Copy host bytes `data` into GPU memory at `addr` (a buffer of `mem` on device `dev`).
    pub(crate) fn host_to_gpu(
        &mut self,
        addr: usize,
        mem: MemoryType,
        dev: Option<u32>,
        data: &[u8],
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let (g, key) = self.copy_key(addr, data.len(), mem, dev)?;
        let r = self.put_to_gpu(addr, data, &key);
        drop(g);
        r
    }

    /// The host buffer a stream receive of `cap` bytes into GPU memory at `addr` fills, and the
    /// copy lane's registration of the GPU buffer.
    pub(crate) fn gpu_stream_bounce(
        &mut self,
        addr: usize,
        cap: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(Vec<u8>, (RegGuard, RemoteKey))> {
        let key = self.copy_key(addr, cap, mem, dev)?;
        let mut b = host_buf(cap, "a stream receive into GPU memory")?;
        b.resize(cap, 0);
        Ok((b, key))
    }

    /// GPU stream receives of peer `p` whose host buffer is full: copy each on to its GPU
    /// buffer through pinned staging slots (several copies in flight, each fragment copied into
    /// a slot by the CPU while the copy lane moves others to the GPU); each completes once its
    /// last copy finished (or fails with the first error).
    pub(crate) fn land_gpu_streams(&mut self, p: usize, ids: Vec<u64>) {
        for id in ids {
            let Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) = self.reqs.get_mut(&id)
            else {
                continue;
            };
            let bounce = match &mut rs.proto {
                RecvProto::Stream { bounce } => bounce.take(),
                _ => None,
            };
            let Some(host) = bounce else {
                continue;
            };
            let cap = rs.cap;
            let frag = self.frag.max(1);
            let nslots = cap.div_ceil(frag).clamp(1, STAGED_FRAGS);
            rs.proto = RecvProto::Landing(Box::new(Landing {
                peer: p,
                host,
                frag,
                slots: vec![None; nslots],
                next: 0,
                done: 0,
                inflight: 0,
                win: None,
            }));
            self.count("stream receive copied to GPU");
            self.peers[p].queue.push_back(Pending::Stream(id));
        }
        self.pump(p);
    }

    /// Copy what fits into free slots and post their copies to the GPU; `Ok(false)`: the copy
    /// lane pushed back (call again after progress).
    pub(crate) fn pump_landing(&mut self, id: u64) -> Result<bool> {
        loop {
            let Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(l),
                        addr,
                        cap,
                        dev_memh,
                        ..
                    }),
                ..
            }) = self.reqs.get_mut(&id)
            else {
                return Ok(true);
            };
            let (addr, cap) = (*addr, *cap);
            if l.win.is_none() {
                // A window of the worker's, or a new one while fewer than the most exist; else
                // the receive waits for one (its bytes wait in its host buffer).
                let p = l.peer;
                let cmd = self.copy_md().ok_or_else(|| Error::Unsupported {
                    what: "copying a stream receive into GPU memory".into(),
                    why: "no copy transport (cuda_copy) is open; add cuda_copy to RUCX_TLS".into(),
                })?;
                let Some(w) = self.take_rma_window(cmd, false)? else {
                    self.wait_for_window(p, id);
                    return Ok(true);
                };
                if let Some(l) = self.landing_mut(id) {
                    l.win = Some(w);
                }
                continue;
            }
            if l.done >= cap {
                self.finish_landing(id);
                return Ok(true);
            }
            let Some(k) = l.slots.iter().position(Option::is_none) else {
                return Ok(true);
            };
            if l.next >= cap {
                return Ok(true);
            }
            let (off, n) = (l.next, l.frag.min(cap - l.next));
            let win = l.win.as_ref().expect("window of a landing receive");
            let at = win.base() + k * l.frag;
            // SAFETY: slot `k` of the window (`frag` bytes from `at`, inside the window the
            // request owns) is free: no copy in flight reads it.
            unsafe { host_slice_mut(at, n) }.copy_from_slice(&l.host[off..off + n]);
            let memh = win.copy_memh.clone();
            let key = dev_memh
                .as_ref()
                .map(|d| d.1.clone())
                .ok_or_else(|| Error::Internal("a GPU stream receive without its key".into()))?;
            let token = self.next_token;
            let iov = [Iov {
                addr: at,
                len: n,
                memh: &memh,
            }];
            let gpu_at = (addr + off) as u64;
            let (_, ep) = self.copy.as_mut().ok_or_else(|| Error::Unsupported {
                what: "copying a stream receive into GPU memory".into(),
                why: "no copy transport (cuda_copy) is open".into(),
            })?;
            match ep.put_zcopy(&iov, gpu_at, &key, token) {
                Ok(st) => {
                    self.next_token += 1;
                    self.account(id, token, st, true);
                }
                Err(e) if e.is_retryable() => return Ok(false),
                Err(e) => return Err(e),
            }
            let in_flight = self.tokens.contains_key(&token);
            let outstanding = self.reqs.get(&id).map_or(0, |r| r.outstanding);
            if let Some(l) = self.landing_mut(id) {
                l.next = off + n;
                l.inflight = outstanding;
                if in_flight {
                    l.slots[k] = Some((token, n));
                } else {
                    l.done += n;
                }
            }
        }
    }

    /// A copy of landing receive `id` completed: free the slots whose copy finished and go on.
    pub(crate) fn on_landing_op(&mut self, id: u64) {
        let tokens = &self.tokens;
        let p = match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(l),
                        ..
                    }),
                result: None,
                ..
            }) => {
                for s in l.slots.iter_mut() {
                    if let Some((t, n)) = *s
                        && !tokens.contains_key(&t)
                    {
                        l.done += n;
                        *s = None;
                    }
                }
                l.peer
            }
            _ => return,
        };
        self.peers[p].queue.push_back(Pending::Stream(id));
        self.pump(p);
    }

    /// Every byte of landing receive `id` reached the GPU: hand the window back, complete.
    fn finish_landing(&mut self, id: u64) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            outstanding: 0,
            result: None,
            ..
        }) = self.reqs.get_mut(&id)
        else {
            return;
        };
        let cap = rs.cap;
        let (win, p) = match &mut rs.proto {
            RecvProto::Landing(l) => (l.win.take(), l.peer),
            _ => return,
        };
        rs.dev_memh = None;
        if let Some(w) = win {
            self.keep_rma_window(w);
        }
        self.finish(
            id,
            Ok(Completion {
                len: cap,
                tag: 0,
                sender: Some(EpId(p)),
            }),
        );
    }

    fn landing_mut(&mut self, id: u64) -> Option<&mut Landing> {
        match self.reqs.get_mut(&id) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Landing(l),
                        ..
                    }),
                ..
            }) => Some(l),
            _ => None,
        }
    }
}

/// A full stream receive into GPU memory on its way from its host buffer to the GPU, through
/// the slots of a pinned window ([`RmaWindow`], from the worker's pool).
pub(crate) struct Landing {
    peer: usize,
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
    /// Copies in flight (mirrors the request's count): the window is kept, not freed, if the
    /// receive ends with copies still running.
    pub(crate) inflight: usize,
    /// Last: the window (`None` while waiting for one).
    win: Option<RmaWindow>,
}

impl Landing {
    /// The window, once nothing of the receive is in flight (see [`State::reclaim_window`]).
    pub(crate) fn take_window(&mut self) -> Option<RmaWindow> {
        self.win.take()
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if self.inflight > 0
            && let Some(w) = self.win.take()
        {
            // Ended (its endpoint failed) with copies still reading the window: never freed.
            w.leak();
        }
    }
}
