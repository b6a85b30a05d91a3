//! The capability query: which path buffers of each pair of memory types take, and why; read
//! off the endpoint's plan ([`crate::plan::paths`]), so it tells what a send does.

use super::*;

impl Worker {
    /// The capability query: for large messages of each pair of memory types on `ep` (GPU
    /// memory of `device`), which protocol and lane carry them, whether that is zero-copy, and
    /// why a faster path is not taken (missing transports, unreachable peers, demotions so far).
    pub fn path_query(&self, ep: EpId, device: Option<u32>) -> Result<Vec<PathInfo>> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        st.note_gpu_key(MemKey::new(MemoryType::Cuda, device));
        self.ensure_plan(&mut st, ep.0);
        Ok(plan::paths(&st.peers[ep.0].plan, device))
    }
}
