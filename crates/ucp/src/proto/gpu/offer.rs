//! Staging offered ahead: as soon as a worker starts making its GPU staging (its shared
//! allocation exists before the helper thread page-locks it) it offers it to the peers that
//! could map it (same host, shared memory), and a receiver that moves GPU memory maps it and
//! registers it with its copy lane on a helper thread. The first staged transfer from that peer
//! then finds the mapping registered instead of page-locking 64 MiB on its critical path
//! (6-9 ms on an H200 host, a quarter of a 1 GiB transfer's 22 ms).

use crate::worker::prelude::*;

/// Offers kept while this worker has met no GPU memory, at most.
const MAX_HELD_OFFERS: usize = 1024;

/// A peer's staging being registered by a helper thread: its local base, and the thread.
pub(crate) type MappingAhead = (usize, std::thread::JoinHandle<Option<MemHandle>>);

impl State {
    /// Take in the staging a helper thread made, once it is ready (taking it in offers it to
    /// the peers). Called by the progress loop when the thread has finished.
    pub(crate) fn take_staging_ahead(&mut self) {
        if let Err(e) = self.staging_from_helper() {
            tracing::debug!("staging made ahead not taken in: {e}");
        }
    }

    /// Offer this worker's staging to every peer that can map it and was not offered it yet.
    pub(crate) fn offer_staging_all(&mut self) {
        for p in 0..self.peers.len() {
            self.offer_staging(p);
        }
    }

    /// Offer this worker's staging to peer `p` once, when the peer's host memory lane is the
    /// shared-memory domain the staging lives in (only then can the peer map it). A staging
    /// still being page-locked by the helper thread is offered too: its shared allocation
    /// exists from the start, and the key names only that (the same key its fragments carry
    /// later).
    pub(crate) fn offer_staging(&mut self, p: usize) {
        let shared_md = match (self.staging.as_ref(), self.staging_ahead.as_ref()) {
            (Some(stg), _) => stg.shared.as_ref().map(|(d, _)| *d),
            (None, Some(ahead)) => ahead.shared().map(|(d, _)| *d),
            (None, None) => None,
        };
        let Some(shared_md) = shared_md else {
            return;
        };
        let peer = &self.peers[p];
        if !peer.connected || peer.failed.is_some() || self.staging_offered.contains(&p) {
            return;
        }
        let Some(lane) = peer.rma else {
            return;
        };
        if self.slots[lane].md != shared_md {
            return;
        }
        self.staging_offered.insert(p);
        let key = match self.staging_ahead.as_ref().and_then(|a| a.shared()) {
            // Not taken in yet: the key of the shared allocation itself, as `staging_reg`
            // packs it once the staging is ready.
            Some((d, a)) if self.staging.is_none() => {
                let md = self.ctx.domain(*d);
                md.mkey_pack(&a.memh).map(|key| NamedKey {
                    md: md.name().to_string(),
                    key,
                })
            }
            _ => self.staging_reg(shared_md).map(|(_, k)| k),
        };
        match key {
            Ok(key) => {
                let src = self.address.uuid;
                self.ctrl(p, &Msg::StagingOffer { src, key });
                self.count("staging offered");
            }
            Err(e) => tracing::debug!("staging not offered: {e}"),
        }
    }

    /// A peer offers its staging: map it and register it with the copy lane on a helper
    /// thread, if this worker moves GPU memory (it made or is making staging of its own) and
    /// can map the key here. Anything else: ignored (the fragments are mapped or read when
    /// they come, as without the offer).
    pub(crate) fn on_staging_offer(&mut self, key: NamedKey) {
        if self.staging.is_none() && self.staging_ahead.is_none() {
            // No GPU memory met yet: kept until it is (one offer per peer, so few).
            if self.offers_held.len() < MAX_HELD_OFFERS {
                self.offers_held.push(key);
            }
            return;
        }
        let Some(cmd) = self.copy_md() else {
            return;
        };
        let Some(mi) = (0..self.ctx.domain_count()).find(|&d| self.ctx.domain(d).name() == key.md)
        else {
            return;
        };
        let md = self.ctx.domain(mi);
        let rkey = match md.rkey_unpack(&key.key) {
            Ok(k) => k,
            Err(e) => {
                tracing::debug!("staging offer with a bad key ignored: {e}");
                return;
            }
        };
        let base = match md.rkey_ptr(&rkey) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!("cannot map a peer's offered staging ({e})");
                return;
            }
        };
        if self.mapped.contains_key(&base)
            || self.mapping_ahead.iter().any(|(b, _)| *b == base)
            || self.copy_not_demoted(cmd, MemoryType::Host, None).is_err()
        {
            return;
        }
        let ctx = self.ctx.clone();
        let len = rkey.len() as usize;
        let log = tracing::dispatcher::get_default(|d| d.clone());
        // After our own staging's helper, when it is still at work (see `HelperEnded`).
        let after = self.staging_ahead.as_ref().map(|a| a.ended());
        let spawned = std::thread::Builder::new()
            .name("rucx-staging-map".into())
            .spawn(move || {
                if let Some(a) = after {
                    a.wait();
                }
                tracing::dispatcher::with_default(&log, || {
                    let t = std::time::Instant::now();
                    // Registered for this mapping alone, as `map_fragment` does.
                    match ctx.register_uncached(cmd, MemRegion::host(base, len)) {
                        Ok(g) => {
                            tracing::debug!(
                                "staging: a peer's {len} bytes registered ahead in {:.3} ms",
                                t.elapsed().as_secs_f64() * 1e3
                            );
                            Some(g.registration().clone())
                        }
                        Err(e) => {
                            tracing::debug!("cannot register a peer's offered staging ({e})");
                            None
                        }
                    }
                })
            });
        match spawned {
            Ok(h) => {
                self.mapping_ahead.push((base, h));
                self.count("peer staging registered ahead");
            }
            Err(e) => tracing::debug!("no helper thread for a peer's staging ({e})"),
        }
    }

    /// This worker met GPU memory: map the staging peers offered before.
    pub(crate) fn take_held_offers(&mut self) {
        for key in std::mem::take(&mut self.offers_held) {
            self.on_staging_offer(key);
        }
    }

    /// The registration of the peer staging mapped at `base` a helper thread made (waiting
    /// for it if it is still at work), if one was started.
    pub(crate) fn mapping_made_ahead(&mut self, base: usize) -> Option<MemHandle> {
        let i = self.mapping_ahead.iter().position(|(b, _)| *b == base)?;
        let (_, h) = self.mapping_ahead.swap_remove(i);
        h.join().ok().flatten()
    }
}
