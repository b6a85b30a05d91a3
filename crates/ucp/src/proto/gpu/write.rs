//! Host to GPU by remote write: a host sender whose zero-copy GPU lane (cuda_ipc) also reads
//! local host memory says so in its request to send; a GPU receiver whose plan has that step
//! registers its buffer with the lane's domain and answers with the key (RTR), and the sender
//! writes straight into the mapped receive buffer (one host-to-device copy by the sender's copy
//! engine; from pinned memory at the copy bound), then sends the finish message. Any
//! registration failure on the receiver's side leaves the staged read, as before.

use crate::worker::prelude::*;

/// Marker key of a request to send: "I can write into your GPU memory from this host buffer
/// through the domain named by the key bytes". Receivers that do not know it ignore it (no
/// domain has this name).
pub(crate) const GPU_WRITE_HINT: &str = "*gput";

impl State {
    /// The marker a host send to peer `p` carries when a connected zero-copy GPU lane of the
    /// plan writes remote GPU memory from local host memory.
    pub(crate) fn gpu_write_hint(&self, p: usize) -> Option<NamedKey> {
        let peer = &self.peers[p];
        let lane = peer
            .plan
            .lanes
            .gpu
            .iter()
            .filter_map(|(_, l)| *l)
            .find(|&l| {
                self.slots[l].attr.has(IfaceCaps::PUT_ZCOPY)
                    && peer.eps.0.iter().any(|(c, _)| *c == l)
                    && self
                        .ctx
                        .domain(self.slots[l].md)
                        .attr()
                        .access_mem_types()
                        .has(MemoryType::Host)
            })?;
        Some(NamedKey {
            md: GPU_WRITE_HINT.into(),
            key: self
                .ctx
                .domain(self.slots[lane].md)
                .name()
                .as_bytes()
                .to_vec(),
        })
    }

    /// Receive `rid` (GPU memory, `region`) of a host send of peer `p`, whose plan's step is a
    /// remote write on `lane`: when the sender offered that lane's domain (`keys` holds its
    /// marker), register the buffer there (kept with the request): the key to hand the sender
    /// (the receive's state answers with it, `recv.rs`). `None` when this path is not taken (no
    /// offer, or the registration failed: demoted, the staged read follows).
    pub(crate) fn gpu_write_key(
        &mut self,
        rid: u64,
        p: usize,
        region: MemRegion,
        lane: usize,
        keys: &[NamedKey],
    ) -> Option<NamedKey> {
        let md = self.slots[lane].md;
        let name = self.ctx.domain(md).name().to_string();
        if !keys
            .iter()
            .any(|k| k.md == GPU_WRITE_HINT && k.key == name.as_bytes())
        {
            return None;
        }
        if !self.may_register(md, region.mem_type, region.device) {
            return None;
        }
        let packed = self.register_md(md, region).and_then(|g| {
            self.ctx
                .domain(md)
                .mkey_pack(g.registration())
                .map(|k| (g, k))
        });
        match packed {
            Ok((g, key)) => {
                let key = NamedKey { md: name, key };
                self.reqs.get_mut(&rid).expect("req").guards.insert(0, g);
                self.count("rendezvous receive by remote write into GPU memory");
                Some(key)
            }
            Err(e) => {
                tracing::debug!(
                    "GPU receive registration with {} failed ({e}); reading through staging",
                    self.ctx.domain(md).name()
                );
                self.refresh_plan(p);
                None
            }
        }
    }

    /// Register send `id`'s buffer for writes on `lane`: with the lane's domain when it registers
    /// that memory type, else described for the local side of a copy when the domain reaches it
    /// that way (cuda_ipc and host memory: registered for this request alone, never cached).
    pub(crate) fn register_put_source(&mut self, id: u64, lane: usize) -> Result<()> {
        let from = match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.head.region(),
            _ => return Ok(()),
        };
        let (md, mem) = (self.slots[lane].md, from.mem_type);
        let attr = self.ctx.domain(md).attr();
        if attr.reg_mem_types().has(mem) || !attr.access_mem_types().has(mem) {
            return self.register_send(id, lane);
        }
        let g = self.ctx.register_uncached(
            md,
            MemRegion {
                len: from.len.max(1),
                ..from
            },
        )?;
        if let Some(r) = self.reqs.get_mut(&id) {
            r.guards.push(g);
        }
        Ok(())
    }
}
