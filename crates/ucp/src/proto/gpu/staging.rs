//! Pinned host staging fragments (shared memory on one host, so a peer maps them), the copy
//! lane's registrations (through the context's one register path) and mapped peer staging.

use crate::Context;
use crate::worker::prelude::*;

/// Pinned host staging fragments for GPU pipelines: one half for sends, one for receives, so
/// that a worker sending and receiving at once cannot starve itself.
pub(crate) struct Staging {
    /// Registrations first: they must go before the memory they describe.
    pub(crate) copy_memh: MemHandle,
    pub(crate) rma: FxHashMap<usize, (RegGuard, NamedKey)>,
    pub(crate) frag: usize,
    pub(crate) free_send: Vec<usize>,
    pub(crate) free_recv: Vec<usize>,
    pub(crate) base: usize,
    /// Shared-memory staging (peers on this host map it), and the domain that made it.
    pub(crate) shared: Option<(usize, rucx_uct::SharedAlloc)>,
    pub(crate) _mem: Vec<u8>,
}

impl Staging {
    pub(crate) fn addr(&self, f: usize) -> usize {
        self.base + f * self.frag
    }
}

/// Staging memory, allocated and registered with the copy lane's domain, not yet cut into
/// fragments.
pub(crate) struct StagingMem {
    /// Registration first: it must go before the memory it describes.
    copy_memh: MemHandle,
    base: usize,
    len: usize,
    shared: Option<(usize, rucx_uct::SharedAlloc)>,
    mem: Vec<u8>,
}

/// A [`StagingMem`] being made by a helper thread.
pub(crate) type StagingAhead = std::thread::JoinHandle<Result<StagingMem>>;

impl StagingMem {
    /// Allocate `len` bytes (shared memory when a domain offers it: a receiver on this host
    /// then copies straight from our fragments to its GPU, two DMA copies in all, no CPU copy)
    /// and register them with domain `mi` (page-locking them: tens of milliseconds for the
    /// default 64 MiB).
    pub(crate) fn make(ctx: &Context, mi: usize, len: usize) -> Result<StagingMem> {
        let mut shared = None;
        for d in 0..ctx.domain_count() {
            match ctx.domain(d).mem_alloc_shared(len) {
                Ok(Some(a)) => {
                    shared = Some((d, a));
                    break;
                }
                Ok(None) => {}
                Err(e) => tracing::debug!("shared staging from {}: {e}", ctx.domain(d).name()),
            }
        }
        let mem = if shared.is_some() {
            Vec::new()
        } else {
            // Fallible: a staging size the system cannot serve fails the transfer that asked.
            let mut m = Vec::new();
            m.try_reserve_exact(len).map_err(|e| {
                Error::NoMemory(format!(
                    "{len} bytes of GPU staging (RUCX_RNDV_FRAG_SIZE x 2 x RUCX_RNDV_FRAG_COUNT): {e}"
                ))
            })?;
            m.resize(len, 0);
            m
        };
        let base = shared
            .as_ref()
            .map_or(mem.as_ptr() as usize, |(_, a)| a.addr);
        // Registered for the staging alone (not cached: the memory goes with the worker). `mem`
        // (or the shared allocation) is stored after this handle (fields drop in order), so
        // the memory outlives the registration; it is never resized.
        let copy_memh = ctx
            .register_uncached(mi, MemRegion::host(base, len))?
            .registration()
            .clone();
        Ok(StagingMem {
            copy_memh,
            base,
            len,
            shared,
            mem,
        })
    }

    /// Start making the staging of a worker with copy domain `mi` on a helper thread, so that
    /// the first transfer that needs it (typically the one that demotes a zero-copy GPU path)
    /// does not wait for it: the first demoting 1 GiB transfer on 2x H200 took 211 ms against
    /// 20 ms once staged. `None` when the thread cannot be started (made on first use then).
    pub(crate) fn ahead(ctx: &Context, mi: usize, len: usize) -> Option<StagingAhead> {
        let ctx = ctx.clone();
        // The caller's log subscriber sees what the helper thread reports (a failed
        // registration demotes and warns like any other).
        let log = tracing::dispatcher::get_default(|d| d.clone());
        std::thread::Builder::new()
            .name("rucx-staging".into())
            .spawn(move || {
                tracing::dispatcher::with_default(&log, || StagingMem::make(&ctx, mi, len))
            })
            .map_err(|e| tracing::debug!("no helper thread for staging ({e}); made on first use"))
            .ok()
    }
}

impl State {
    pub(crate) fn copy_md(&self) -> Option<usize> {
        self.copy.as_ref().map(|(i, _)| self.slots[*i].md)
    }

    /// Register a user buffer with the copy lane's domain and make the key the copy lane's
    /// endpoint needs to reach it. The registration goes through the context (demotion,
    /// warning, GPU registration reuse) and is made for this request alone: the buffer belongs
    /// to a request of a scope, which keeps it allocated until the request finished, and the
    /// guard is dropped with the request.
    pub(crate) fn copy_key(
        &self,
        addr: usize,
        len: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<(RegGuard, RemoteKey)> {
        let mi = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: format!("copying {mem} memory"),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(mi, mem, dev)?;
        let g = self.ctx.register_uncached(
            mi,
            MemRegion {
                addr,
                len: len.max(1),
                mem_type: mem,
                device: dev,
            },
        )?;
        let md = self.ctx.domain(mi);
        let key = md.rkey_unpack(&md.mkey_pack(g.registration())?)?;
        Ok((g, key))
    }

    /// The copy lane's domain `mi` may still register `mem` memory of `dev` for its copies:
    /// once demoted there, fail at once with the reason and the knob rather than asking the
    /// driver again.
    pub(crate) fn copy_not_demoted(
        &self,
        mi: usize,
        mem: MemoryType,
        dev: Option<u32>,
    ) -> Result<()> {
        match self.ctx.demotion_of(mi, mem, dev) {
            None => Ok(()),
            Some(d) => Err(Error::Unsupported {
                what: format!(
                    "copying {mem} memory{} with {}",
                    dev.map(|d| format!(" of GPU {d}")).unwrap_or_default(),
                    d.md
                ),
                why: format!("{d}; {}", d.knob),
            }),
        }
    }

    /// The pinned staging fragments, made on first use.
    pub(crate) fn ensure_staging(&mut self) -> Result<()> {
        if self.staging.is_some() {
            return Ok(());
        }
        let mi = self.copy_md().ok_or_else(|| Error::Unsupported {
            what: "staging GPU memory".into(),
            why: "no copy transport (cuda_copy) is open".into(),
        })?;
        self.copy_not_demoted(mi, MemoryType::Host, None)?;
        let count = self.stage_count;
        let total = self.frag * count * 2;
        // Made ahead by a helper thread when the worker started (see `StagingMem::ahead`);
        // made here when that was not asked for or failed.
        let ahead = match self.staging_ahead.take().map(|h| h.join()) {
            Some(Ok(Ok(m))) if m.len == total => Some(m),
            Some(Ok(Err(e))) => {
                tracing::debug!("staging made ahead failed ({e}); making it now");
                None
            }
            _ => None,
        };
        let StagingMem {
            copy_memh,
            base,
            shared,
            mem,
            ..
        } = match ahead {
            Some(m) => {
                self.count("staging made ahead");
                m
            }
            None => StagingMem::make(&self.ctx, mi, total)?,
        };
        self.staging = Some(Staging {
            copy_memh,
            rma: FxHashMap::default(),
            frag: self.frag,
            free_send: (0..count).rev().collect(),
            free_recv: (count..2 * count).rev().collect(),
            base,
            shared,
            _mem: mem,
        });
        Ok(())
    }

    /// The staging memory registered with domain `mi`, and its packed key.
    pub(crate) fn staging_reg(&mut self, mi: usize) -> Result<(MemHandle, NamedKey)> {
        self.ensure_staging()?;
        let stg = self.staging.as_ref().expect("staging");
        if let Some((g, k)) = stg.rma.get(&mi) {
            return Ok((g.registration().clone(), k.clone()));
        }
        let total = stg.frag * self.stage_count * 2;
        if let Some((d, a)) = &stg.shared
            && *d == mi
        {
            let md = self.ctx.domain(mi);
            let key = NamedKey {
                md: md.name().to_string(),
                key: md.mkey_pack(&a.memh)?,
            };
            let memh = a.memh.clone();
            self.staging
                .as_mut()
                .expect("staging")
                .rma
                .insert(mi, (RegGuard::Direct(memh.clone()), key.clone()));
            return Ok((memh, key));
        }
        let g = self.register_md(mi, MemRegion::host(stg.base, total))?;
        let md = self.ctx.domain(mi);
        let key = NamedKey {
            md: md.name().to_string(),
            key: md.mkey_pack(g.registration())?,
        };
        let memh = g.registration().clone();
        self.staging
            .as_mut()
            .expect("staging")
            .rma
            .insert(mi, (g, key.clone()));
        Ok((memh, key))
    }

    /// Map a peer's staging fragment into this process when its domain allows (shared memory on
    /// this host), registered with the copy lane once per mapping. `None`: read it instead.
    pub(crate) fn map_fragment(
        &mut self,
        mi: usize,
        rkey: &RemoteKey,
        addr: u64,
    ) -> Option<(usize, MemHandle)> {
        let base = match self.ctx.domain(mi).rkey_ptr(rkey) {
            Ok(Some(b)) => b,
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!("cannot map the peer's staging ({e}); reading it instead");
                return None;
            }
        };
        let memh = match self.mapped.get(&base) {
            Some(h) => h.clone(),
            None => {
                let cmd = self.copy_md()?;
                self.copy_not_demoted(cmd, MemoryType::Host, None).ok()?;
                // Registered for this mapping alone (not cached): the domain keeps the peer's
                // segment mapped until it is dropped, which is after this worker (the context
                // outlives its workers), and the mapping covers the key's whole region.
                let h = self
                    .ctx
                    .register_uncached(cmd, MemRegion::host(base, rkey.len() as usize))
                    .map(|g| g.registration().clone());
                match h {
                    Ok(h) => {
                        self.mapped.insert(base, h.clone());
                        h
                    }
                    Err(e) => {
                        tracing::debug!("cannot register the mapped staging for copies ({e})");
                        return None;
                    }
                }
            }
        };
        Some((base + (addr - rkey.base()) as usize, memh))
    }
}
