//! Host to GPU by remote write: a host sender whose zero-copy GPU lane (cuda_ipc) also reads
//! local host memory says so in its request to send; a GPU receiver whose plan has that step
//! registers its buffer with the lane's domain and answers with the key (RTR), and the sender
//! writes straight into the mapped receive buffer (one host-to-device copy by the sender's copy
//! engine; from pinned memory at the copy bound), then sends the finish message. Any
//! registration failure on the receiver's side leaves the staged read, as before.
//!
//! GPU to GPU on one physical GPU shared by the two processes: the process with the lower
//! worker id issues the copies of both directions (`plan::copies_on_shared_gpu`). As a
//! sender it offers to write (`GPU_SHARED_HINT`: the domain and its buffer's GPU UUID, next to
//! the key for a read); a receiver whose buffer sits on that same GPU registers it and answers
//! with the key (the step `RecvStep::SharedGpuWrite`), and the sender writes into it through
//! the same rendezvous write as above, then sends the finish message. As a receiver it reads,
//! as on different GPUs. So the other process never copies, and the GPU never switches between
//! the two processes' contexts for their messages. Any failure on the receiver's side
//! (another GPU, no offer, a registration refused or demoted) leaves the read.

use crate::worker::prelude::*;

/// Marker key of a request to send: "I can write into your GPU memory from this host buffer
/// through the domain named by the key bytes". Receivers that do not know it ignore it (no
/// domain has this name).
pub(crate) const GPU_WRITE_HINT: &str = "*gput";

/// Marker key of a GPU request to send: "we share a GPU if yours is this one, and I am the
/// pair's copier: let me write into your buffer". Key bytes: the GPU's 16-byte UUID, then the
/// name of the domain to write through.
pub(crate) const GPU_SHARED_HINT: &str = "*gpus";

/// The shared-GPU marker for a buffer on the GPU with `uuid`, written through domain `md`.
pub(crate) fn shared_gpu_marker(md: &str, uuid: [u8; 16]) -> NamedKey {
    let mut key = uuid.to_vec();
    key.extend_from_slice(md.as_bytes());
    NamedKey {
        md: GPU_SHARED_HINT.into(),
        key,
    }
}

/// The GPU UUID a shared-GPU marker among `keys` offers for domain `md` (`None`: no such
/// marker, or a malformed one).
pub(crate) fn shared_gpu_offer(keys: &[NamedKey], md: &str) -> Option<[u8; 16]> {
    keys.iter()
        .filter(|k| k.md == GPU_SHARED_HINT && k.key.len() > 16)
        .find(|k| &k.key[16..] == md.as_bytes())
        .map(|k| k.key[..16].try_into().expect("16 bytes"))
}

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

    /// The marker a GPU send (device `dev`, keyed for reads on `lane`) to peer `p` carries
    /// when this worker is the pair's copier on a shared GPU and `lane` writes GPU memory: its
    /// buffer's GPU UUID and the lane's domain.
    pub(crate) fn shared_gpu_hint(
        &self,
        p: usize,
        dev: Option<u32>,
        lane: usize,
    ) -> Option<NamedKey> {
        if !plan::copies_on_shared_gpu(self.address.uuid, self.peers[p].remote.uuid)
            || !self.slots[lane].attr.has(IfaceCaps::PUT_ZCOPY)
        {
            return None;
        }
        let d = self.ctx.domain(self.slots[lane].md);
        Some(shared_gpu_marker(d.name(), d.gpu_uuid(dev?)?))
    }

    /// Receive `rid` (GPU memory, `region`) of peer `p`, whose plan's step is a remote write on
    /// `lane`: when the sender offered that lane's domain (`keys` holds its marker: a host
    /// sender's, or, `shared`, a GPU sender's on the GPU of our buffer that is the pair's
    /// copier), register the buffer there (kept with the request): the key to hand the sender
    /// (the receive's state answers with it, `recv.rs`). `None` when this path is not taken (no
    /// offer, another GPU, or the registration failed: demoted, the next step follows).
    pub(crate) fn gpu_write_key(
        &mut self,
        rid: u64,
        p: usize,
        region: MemRegion,
        lane: usize,
        keys: &[NamedKey],
        shared: bool,
    ) -> Option<NamedKey> {
        let md = self.slots[lane].md;
        let name = self.ctx.domain(md).name().to_string();
        let offered = if shared {
            plan::copies_on_shared_gpu(self.peers[p].remote.uuid, self.address.uuid)
                && shared_gpu_offer(keys, &name).is_some_and(|u| {
                    region.device.and_then(|d| self.ctx.domain(md).gpu_uuid(d)) == Some(u)
                })
        } else {
            keys.iter()
                .any(|k| k.md == GPU_WRITE_HINT && k.key == name.as_bytes())
        };
        if !offered || !self.may_register(md, region.mem_type, region.device) {
            return None;
        }
        rucx_ucs::profile::mark("gpu_write_key.reg", 0);
        let packed = self.register_md(md, region).and_then(|g| {
            self.ctx
                .domain(md)
                .mkey_pack(g.registration())
                .map(|k| (g, k))
        });
        match packed {
            Ok((g, key)) => {
                rucx_ucs::profile::mark("gpu_write_key.packed", 0);
                let key = NamedKey { md: name, key };
                self.reqs.get_mut(&rid).expect("req").guards.insert(0, g);
                self.count(if shared {
                    "rendezvous receive by remote write on a shared GPU"
                } else {
                    "rendezvous receive by remote write into GPU memory"
                });
                Some(key)
            }
            Err(e) => {
                tracing::debug!(
                    "GPU receive registration with {} failed ({e}); trying the next step",
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A marker names its GPU for its domain only; malformed or foreign markers offer
        /// nothing.
        #[test]
        fn the_shared_gpu_marker_names_its_gpu_for_its_domain(
            uuid in any::<[u8; 16]>(),
            md in "[a-z_]{1,12}",
            other in "[a-z_]{1,12}",
            junk in prop::collection::vec(any::<u8>(), 0..17),
        ) {
            let m = shared_gpu_marker(&md, uuid);
            prop_assert_eq!(shared_gpu_offer(std::slice::from_ref(&m), &md), Some(uuid));
            if other != md {
                prop_assert_eq!(shared_gpu_offer(std::slice::from_ref(&m), &other), None);
            }
            let short = NamedKey { md: GPU_SHARED_HINT.into(), key: junk };
            prop_assert_eq!(shared_gpu_offer(&[short], ""), None);
            let host = NamedKey { md: GPU_WRITE_HINT.into(), key: m.key.clone() };
            prop_assert_eq!(shared_gpu_offer(&[host], &md), None);
        }
    }
}
