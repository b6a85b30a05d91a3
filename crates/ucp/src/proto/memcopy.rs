//! Whole-buffer copies between GPU memory and host memory by the copy lane, for the protocols
//! that carry GPU payloads through host memory: streams (the byte stream is host bytes in
//! order; a GPU send is copied out before its pieces go, a GPU receive fills a host buffer that
//! is copied on when full) and active messages copied in (a small GPU payload copied out, an
//! inline payload fetched into GPU memory).

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
    /// buffer and complete it (or fail it with the copy's error).
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
            let (Some(host), Some(dm)) = (bounce, rs.dev_memh.take()) else {
                continue;
            };
            let (addr, cap) = (rs.addr, rs.cap);
            let res = self.put_to_gpu(addr, &host[..cap], &dm.1);
            drop(dm);
            self.count("stream receive copied to GPU");
            let res = res.map(|()| Completion {
                len: cap,
                tag: 0,
                sender: Some(EpId(p)),
            });
            self.finish(id, res);
        }
    }
}
