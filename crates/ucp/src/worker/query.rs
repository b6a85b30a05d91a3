//! The capability query: which path buffers of each pair of memory types take, and why.

use super::*;

/// Which path buffers of a given pair of memory types take on an endpoint, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathInfo {
    /// Sender's memory type.
    pub send_mem: MemoryType,
    /// Receiver's memory type.
    pub recv_mem: MemoryType,
    /// Protocol for large messages.
    pub protocol: String,
    /// `transport/device` moving the data.
    pub lane: String,
    /// True when no intermediate copy is made.
    pub zero_copy: bool,
    /// Why a faster path is not taken (when zero-copy: only the buffers the lane's domain
    /// refused, which took another path, if any).
    pub why_not: Vec<String>,
}

impl std::fmt::Display for PathInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} -> {}: {} on {}{}",
            self.send_mem,
            self.recv_mem,
            self.protocol,
            self.lane,
            if self.zero_copy { " (zero-copy)" } else { "" }
        )?;
        for w in &self.why_not {
            write!(f, "; {w}")?;
        }
        Ok(())
    }
}

impl Worker {
    /// The capability query: for large messages of each pair of memory types on `ep` (GPU
    /// memory of `device`), which protocol and lane carry them, whether that is zero-copy, and
    /// why a faster path is not taken (missing transports, unreachable peers, demotions so far).
    pub fn path_query(&self, ep: EpId, device: Option<u32>) -> Result<Vec<PathInfo>> {
        let mut st = self.st.borrow_mut();
        st.check_peer(ep.0)?;
        st.refresh_table(ep.0);
        let st = &*st;
        let p = &st.peers[ep.0];
        let name = |i: usize| format!("{}/{}", st.slots[i].attr.tl_name, st.slots[i].attr.dev_name);
        let mut out = Vec::new();
        // Host to host: the last row of the table.
        if let Some(r) = p.table.last() {
            let mut why = Vec::new();
            if !r.proto.is_zcopy() {
                why.push(match p.rma {
                    None => "no transport to this peer has remote memory access".to_string(),
                    Some(l) => format!(
                        "{} cannot register host memory now (see demotions)",
                        st.ctx.domain(st.slots[l].md).name()
                    ),
                });
            }
            out.push(PathInfo {
                send_mem: MemoryType::Host,
                recv_mem: MemoryType::Host,
                protocol: r.proto.name().to_string(),
                lane: r.lane.clone(),
                zero_copy: r.proto.is_zcopy(),
                why_not: why,
            });
        }
        let demoted: Vec<String> = st
            .ctx
            .demotions()
            .into_iter()
            .filter(|d| d.mem_type.is_gpu() && (d.device.is_none() || d.device == device))
            .map(|d| format!("demoted: {d}"))
            .collect();
        // Buffer-scoped refusals: the domain stays in use, those buffers were staged.
        let refused: Vec<String> = st
            .ctx
            .refusals()
            .into_iter()
            .filter(|r| r.mem_type.is_gpu() && (r.device.is_none() || r.device == device))
            .map(|r| format!("buffer refused (not a demotion): {r}"))
            .collect();
        for (s, r) in [
            (MemoryType::Cuda, MemoryType::Cuda),
            (MemoryType::Cuda, MemoryType::Host),
            (MemoryType::Host, MemoryType::Cuda),
        ] {
            let mut why = Vec::new();
            let gpu_lane = p.rma_cuda.filter(|l| {
                st.ctx
                    .can_register(st.slots[*l].md, MemoryType::Cuda, device)
            });
            if s.is_gpu()
                && r.is_gpu()
                && let Some(l) = gpu_lane
            {
                out.push(PathInfo {
                    send_mem: s,
                    recv_mem: r,
                    protocol: Proto::RndvGet.name().to_string(),
                    lane: name(l),
                    zero_copy: true,
                    why_not: refused.clone(),
                });
                continue;
            }
            if !(s.is_gpu() && r.is_gpu()) {
                why.push("zero-copy GPU lanes (cuda_ipc) read only between GPU buffers".into());
            } else if p.rma_cuda.is_none() {
                let open: Vec<&str> = st
                    .slots
                    .iter()
                    .filter(|sl| {
                        st.ctx
                            .domain(sl.md)
                            .attr()
                            .reg_mem_types()
                            .has(MemoryType::Cuda)
                    })
                    .map(|sl| sl.attr.tl_name.as_str())
                    .collect();
                why.push(if open.is_empty() {
                    "no open transport registers GPU memory (cuda_ipc unavailable or left out by RUCX_TLS; see `rucx-info -d`)".into()
                } else {
                    format!("{} does not reach this peer (another host?)", open.join(", "))
                });
            }
            why.extend(demoted.iter().cloned());
            why.extend(refused.iter().cloned());
            let (protocol, lane) = match (st.copy.as_ref(), p.rma) {
                (Some(_), Some(l)) => (Proto::RndvPipeline.name().to_string(), name(l)),
                (None, _) => {
                    why.push("no copy transport (cuda_copy) to stage through host memory".into());
                    ("unsupported".to_string(), "-".to_string())
                }
                (_, None) => {
                    why.push(
                        "no transport with remote memory access to carry staged fragments".into(),
                    );
                    ("unsupported".to_string(), "-".to_string())
                }
            };
            out.push(PathInfo {
                send_mem: s,
                recv_mem: r,
                protocol,
                lane,
                zero_copy: false,
                why_not: why,
            });
        }
        Ok(out)
    }
}
