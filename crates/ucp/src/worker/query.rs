//! The capability query: which path buffers of each pair of memory types take, and why; read
//! off the endpoint's plan ([`crate::plan::paths`]), so it tells what a send does.

use super::*;

impl Worker {
    /// The capability query: for large messages of each pair of memory types on `ep` (GPU
    /// memory of `device`), which protocol and lane carry them, whether that is zero-copy, and
    /// why a faster path is not taken (missing transports, unreachable peers, demotions so far).
    /// Buffers a domain refused on their own (a buffer-scoped failure, not a demotion) are
    /// listed on the GPU pairs too: those buffers took another path while the domain stays in
    /// use.
    pub fn path_query(&self, ep: EpId, device: Option<u32>) -> Result<Vec<PathInfo>> {
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        st.note_gpu_key(MemKey::new(MemoryType::Cuda, device));
        self.ensure_plan(&mut st, p);
        let mut out = plan::paths(&st.peers[p].plan, device);
        let refused: Vec<String> = st
            .ctx
            .refusals()
            .into_iter()
            .filter(|r| r.mem_type.is_gpu() && (r.device.is_none() || r.device == device))
            .map(|r| format!("buffer refused (not a demotion): {r}"))
            .collect();
        for p in out
            .iter_mut()
            .filter(|p| p.send_mem.is_gpu() || p.recv_mem.is_gpu())
        {
            p.why_not.extend(refused.iter().cloned());
        }
        Ok(out)
    }
}
