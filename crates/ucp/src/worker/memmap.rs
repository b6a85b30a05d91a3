//! Memory mapped for peers' remote access ([`MemMap`]) and peers' unpacked keys
//! ([`RkeyBundle`]).

use crate::worker::prelude::*;

/// Remote keys of a peer's mapped region, as unpacked by [`Worker::rkey_unpack`].
#[derive(Debug, Clone)]
pub struct RkeyBundle {
    base: u64,
    len: u64,
    pub(crate) keys: Vec<(String, RemoteKey)>,
}

impl RkeyBundle {
    /// Remote base address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Remote length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Check that an access of `len` bytes at `addr` stays inside the mapped region.
    pub(crate) fn check(&self, addr: u64, len: u64) -> Result<()> {
        let end = self.base.saturating_add(self.len);
        if addr >= self.base && addr.checked_add(len).is_some_and(|e| e <= end) {
            Ok(())
        } else {
            Err(Error::OutOfBounds {
                addr,
                len,
                base: self.base,
                region_len: self.len,
            })
        }
    }
}

/// A local region registered for remote access; see [`Worker::mem_map`].
pub struct MemMap<'a> {
    addr: usize,
    len: usize,
    guards: Vec<(String, RegGuard)>,
    packed: Vec<NamedKey>,
    _buf: std::marker::PhantomData<&'a mut [u8]>,
}

impl fmt::Debug for MemMap<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemMap")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field(
                "domains",
                &self.guards.iter().map(|g| &g.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl MemMap<'_> {
    /// Pack the remote keys for a peer.
    pub fn pack_rkey(&self) -> Vec<u8> {
        let mut b = Vec::new();
        wire::put_u64s(&mut b, &[self.addr as u64, self.len as u64]);
        wire::put_keys(&mut b, &self.packed);
        rucx_uct::rkey::pack("ucp-rkey", &b)
    }

    /// Start address of the mapped buffer.
    pub fn address(&self) -> u64 {
        self.addr as u64
    }

    /// Read the mapped buffer (after the peers' writes were flushed).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the map borrows the buffer mutably for its whole life; remote writers are
        // the only other party, and callers read after those writes are flushed.
        unsafe { host_slice(self.addr, self.len) }
    }
}

impl Worker {
    /// Register `buf` for remote access by peers (put/get).
    pub fn mem_map<'a>(&self, buf: &'a mut [u8]) -> Result<MemMap<'a>> {
        let st = self.st.borrow();
        let region = MemRegion::of_slice(buf);
        let mut guards = Vec::new();
        let mut packed = Vec::new();
        let mut errors = Vec::new();
        for mi in 0..st.ctx.domain_count() {
            let rma = st.slots.iter().any(|s| {
                s.md == mi
                    && s.attr
                        .caps
                        .intersects(IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY)
            });
            if !rma || !st.ctx.can_register(mi, MemoryType::Host, None) {
                continue;
            }
            match st.ctx.register(mi, region) {
                Ok(g) => {
                    let md = st.ctx.domain(mi);
                    let key = md.mkey_pack(g.registration())?;
                    packed.push(NamedKey {
                        md: md.name().to_string(),
                        key,
                    });
                    guards.push((md.name().to_string(), g));
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        if guards.is_empty() {
            return Err(Error::Unsupported {
                what: format!("mapping {} bytes for remote access", buf.len()),
                why: if errors.is_empty() {
                    "no open transport supports put/get zero-copy (check RUCX_TLS)".into()
                } else {
                    errors.join("; ")
                },
            });
        }
        Ok(MemMap {
            addr: region.addr,
            len: region.len,
            guards,
            packed,
            _buf: std::marker::PhantomData,
        })
    }

    /// Unpack a peer's packed remote key for use on endpoint `ep`.
    pub fn rkey_unpack(&self, ep: EpId, packed: &[u8]) -> Result<RkeyBundle> {
        let st = self.st.borrow();
        st.check_peer(ep.0)?;
        let payload = rucx_uct::rkey::unpack("ucp-rkey", "remote key bundle", packed)?;
        let mut r = rucx_uct::rkey::Reader::new(payload, "remote key bundle");
        let base = r.u64()?;
        let len = r.u64()?;
        let n = r.u8()? as usize;
        let mut keys = Vec::new();
        for _ in 0..n {
            let md = String::from_utf8(r.lv()?.to_vec())
                .map_err(|_| Error::InvalidAddress("key name not UTF-8".into()))?;
            let key = r.lv()?;
            // A key this process cannot use (another domain's, or `self`'s key of another
            // process) is skipped: the bundle still serves the lanes it has keys for.
            if let Some(mi) = st.ctx.domain_index(&md) {
                match st.ctx.domain(mi).rkey_unpack(key) {
                    Ok(k) => keys.push((md, k)),
                    Err(e) => tracing::debug!("remote key for {md} not usable here: {e}"),
                }
            }
        }
        r.finish()?;
        Ok(RkeyBundle { base, len, keys })
    }
}
