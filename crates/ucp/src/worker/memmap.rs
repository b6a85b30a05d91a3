//! Memory mapped for peers' remote access ([`MemMap`]) and peers' unpacked keys
//! ([`RkeyBundle`]).

use crate::worker::prelude::*;

/// Remote keys of a peer's mapped region, as unpacked by [`Worker::rkey_unpack`], with the
/// region's memory type (which decides how a put or get reaches it).
#[derive(Debug, Clone)]
pub struct RkeyBundle {
    base: u64,
    len: u64,
    mem: MemoryType,
    dev: Option<u32>,
    pub(crate) keys: Vec<(String, RemoteKey)>,
}

/// Memory type codes in a packed bundle (as `wire::mem_code`).
fn mem_of_code(c: u8) -> Result<MemoryType> {
    MemoryType::ALL
        .into_iter()
        .find(|m| wire::mem_code(*m) == c)
        .ok_or_else(|| Error::InvalidAddress(format!("remote key bundle: memory type code {c}")))
}

/// No GPU ordinal in a packed bundle.
const NO_DEVICE: u32 = u32::MAX;

impl RkeyBundle {
    /// Memory type of the remote region (host or GPU memory of the peer).
    pub fn mem_type(&self) -> MemoryType {
        self.mem
    }

    /// The peer's GPU ordinal of a region of GPU memory (as the peer numbers its GPUs).
    pub fn device(&self) -> Option<u32> {
        self.dev
    }

    /// Names of the memory domains whose keys this process could use.
    pub fn domains(&self) -> Vec<&str> {
        self.keys.iter().map(|(n, _)| n.as_str()).collect()
    }

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
    mem: MemoryType,
    dev: Option<u32>,
    guards: Vec<(String, RegGuard)>,
    packed: Vec<NamedKey>,
    /// The context whose registry of mapped regions lists it (atomics are checked against
    /// it), and its entry there.
    ctx: crate::Context,
    map_id: u64,
    _buf: std::marker::PhantomData<&'a mut [u8]>,
}

impl Drop for MemMap<'_> {
    fn drop(&mut self) {
        // Out of the registry first: no atomic of a peer touches the region from now on.
        self.ctx.maps().remove(self.map_id);
    }
}

impl fmt::Debug for MemMap<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemMap")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("mem", &self.mem)
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
        b.push(wire::mem_code(self.mem));
        b.extend_from_slice(&self.dev.unwrap_or(NO_DEVICE).to_le_bytes());
        wire::put_keys(&mut b, &self.packed);
        rucx_uct::rkey::pack("ucp-rkey", &b)
    }

    /// Start address of the mapped buffer.
    pub fn address(&self) -> u64 {
        self.addr as u64
    }

    /// Length of the mapped buffer in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Memory type of the mapped buffer.
    pub fn mem_type(&self) -> MemoryType {
        self.mem
    }

    /// Names of the memory domains that registered the buffer (whose keys the packed bundle
    /// carries).
    pub fn domains(&self) -> Vec<&str> {
        self.guards.iter().map(|g| g.0.as_str()).collect()
    }

    /// Read the mapped host buffer (after the peers' writes were flushed).
    ///
    /// # Panics
    /// When the mapped buffer is GPU memory, which the CPU cannot read: copy it out with a
    /// GPU copy (or [`try_as_slice`](Self::try_as_slice) to get an error instead).
    pub fn as_slice(&self) -> &[u8] {
        match self.try_as_slice() {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    /// Read the mapped host buffer; [`Error::Unsupported`] for GPU memory.
    pub fn try_as_slice(&self) -> Result<&[u8]> {
        if self.mem.is_gpu() {
            return Err(Error::Unsupported {
                what: format!(
                    "reading mapped {} memory at {:#x}+{} as a host slice",
                    self.mem, self.addr, self.len
                ),
                why: "the CPU cannot read GPU memory; copy it to the host first".into(),
            });
        }
        // SAFETY: host memory; the map borrows the buffer mutably for its whole life; remote
        // writers are the only other party, and callers read after those writes are flushed.
        Ok(unsafe { host_slice(self.addr, self.len) })
    }
}

impl Worker {
    /// Register `buf` for remote access by peers (put/get). `buf` is any
    /// [`Memory`](rucx_ucs::Memory) borrowed mutably, as a receive takes it: a host slice
    /// (`&mut [u8]`, `&mut Vec<u8>`), a GPU buffer of `rucx-cuda` (`&mut DeviceBuffer`, ...), a
    /// part of either (`buf.slice_mut(a..b)`), or [`RecvBuf::from_raw`].
    ///
    /// Every domain with a put/get lane that registers memory of the buffer's type packs a key
    /// (host memory: posix, tcp, ib...; GPU memory: cuda_ipc for processes of this host, ib
    /// with GPUDirect); the packed bundle says the memory type, so a peer's put or get picks
    /// its path (zero-copy, or staged through its own pinned host memory). A domain whose
    /// registration fails is left out (and demoted when the failure is the domain's: one
    /// warning); with none left the error names every failure.
    pub fn mem_map<'a>(&self, buf: impl Into<RecvBuf<'a>>) -> Result<MemMap<'a>> {
        let buf = buf.into();
        let mut st = self.st.borrow_mut();
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(buf.addr, buf.len)?,
        };
        if mem.is_gpu() {
            st.note_gpu_key(MemKey::new(mem, dev));
        }
        let region = MemRegion {
            addr: buf.addr,
            len: buf.len,
            mem_type: mem,
            device: if mem.is_gpu() { dev } else { None },
        };
        let mut guards = Vec::new();
        let mut packed = Vec::new();
        let mut errors = Vec::new();
        for mi in 0..st.ctx.domain_count() {
            let rma = st.slots.iter().any(|s| {
                s.md == mi
                    && s.attr
                        .caps
                        .intersects(IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY)
                    && Some(s.md) != st.copy_md()
            });
            if !rma || !st.ctx.domain(mi).attr().reg_mem_types().has(mem) {
                continue;
            }
            let md = st.ctx.domain(mi);
            if let Some(d) = st.ctx.demotion_of(mi, mem, region.device) {
                errors.push(format!("{}: {d}", md.name()));
                continue;
            }
            match st.ctx.register(mi, region) {
                Ok(g) => {
                    let key = md.mkey_pack(g.registration())?;
                    packed.push(NamedKey {
                        md: md.name().to_string(),
                        key,
                    });
                    guards.push((md.name().to_string(), g));
                }
                Err(e) => errors.push(format!("{}: {e}", md.name())),
            }
        }
        if guards.is_empty() {
            return Err(Error::Unsupported {
                what: format!(
                    "mapping {} bytes of {}{} memory for remote access",
                    buf.len,
                    mem,
                    region
                        .device
                        .map(|d| format!(" (GPU {d})"))
                        .unwrap_or_default()
                ),
                why: if !errors.is_empty() {
                    errors.join("; ")
                } else if mem.is_gpu() {
                    "no open transport with put/get exports GPU memory (cuda_ipc, or ib with \
                     GPUDirect; check RUCX_TLS and `rucx-info -d`)"
                        .into()
                } else {
                    "no open transport supports put/get zero-copy (check RUCX_TLS)".into()
                },
            });
        }
        let map_id = st.ctx.maps().add(region.addr, region.len, mem);
        Ok(MemMap {
            addr: region.addr,
            len: region.len,
            mem,
            dev: region.device,
            guards,
            packed,
            ctx: st.ctx.clone(),
            map_id,
            _buf: std::marker::PhantomData,
        })
    }

    /// Unpack a peer's packed remote key for use on endpoint `ep`.
    pub fn rkey_unpack(&self, ep: EpId, packed: &[u8]) -> Result<RkeyBundle> {
        let st = self.st.borrow();
        st.check_ep(ep)?;
        let payload = rucx_uct::rkey::unpack("ucp-rkey", "remote key bundle", packed)?;
        let mut r = rucx_uct::rkey::Reader::new(payload, "remote key bundle");
        let base = r.u64()?;
        let len = r.u64()?;
        let mem = mem_of_code(r.u8()?)?;
        let dev = match r.u32()? {
            NO_DEVICE => None,
            d => Some(d),
        };
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
        Ok(RkeyBundle {
            base,
            len,
            mem,
            dev: if mem.is_gpu() { dev } else { None },
            keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::Worker;

    fn posix_pair() -> (Worker, Worker, crate::EpId) {
        pair("posix")
    }

    fn pair(tls: &str) -> (Worker, Worker, crate::EpId) {
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", tls)]).unwrap();
        let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
        let (a, b) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
        let ab = a.connect(&b.address()).unwrap();
        b.connect(&a.address()).unwrap();
        (a, b, ab)
    }

    /// Mapping an empty `Vec` (its pointer dangles just above 0) used to register the null
    /// page through the registration cache, which posix refused as a bad address: posix was
    /// demoted for all host memory of the context, with a warning, and the map failed. It maps
    /// now, a zero-byte put through its key completes, nothing is demoted, and a real region
    /// still maps and takes a put by posix.
    #[test]
    fn mapping_an_empty_buffer_demotes_nothing() {
        let (a, b, ab) = posix_pair();
        let mut empty: Vec<u8> = Vec::new();
        let m = b.mem_map(&mut empty[..]).unwrap();
        assert_eq!(m.domains(), ["posix"]);
        let key = a.rkey_unpack(ab, &m.pack_rkey()).unwrap();
        let mut region = vec![0u8; 4096];
        let full = b.mem_map(&mut region[..]).unwrap();
        let full_key = a.rkey_unpack(ab, &full.pack_rkey()).unwrap();
        let src = vec![9u8; 4096];
        a.scope(|s| {
            let empty_put = s.put(ab, &[][..], m.address(), &key);
            let put = s.put(ab, &src[..], full.address(), &full_key);
            for r in [empty_put, put] {
                let t = std::time::Instant::now();
                while r.test().is_none() {
                    assert!(t.elapsed().as_secs() < 30, "put hangs");
                    a.progress();
                    b.progress();
                }
                r.wait().unwrap();
            }
        });
        assert!(
            a.context_demotions().is_empty(),
            "{:?}",
            a.context_demotions()
        );
        drop((m, full));
        assert_eq!(region, src);
    }

    fn finish(a: &Worker, b: &Worker, r: crate::Request<'_>) -> rucx_ucs::Result<()> {
        let t = std::time::Instant::now();
        while r.test().is_none() {
            assert!(t.elapsed().as_secs() < 30, "request hangs");
            a.progress();
            b.progress();
        }
        r.wait().map(|_| ())
    }

    /// tcp maps an empty buffer as posix does (it refused it with `Unsupported`): the map has
    /// tcp's key, the key packs and unpacks, a zero-byte put and get through it complete,
    /// one byte through it is refused as out of bounds and lands nowhere, and a real region
    /// still takes a put and a get by tcp.
    #[test]
    fn tcp_maps_an_empty_buffer() {
        let (a, b, ab) = pair("tcp");
        let mut empty: Vec<u8> = Vec::new();
        let m = b.mem_map(&mut empty[..]).unwrap();
        assert_eq!(m.domains(), ["tcp"]);
        let key = a.rkey_unpack(ab, &m.pack_rkey()).unwrap();
        let mut region = vec![0u8; 4096];
        let full = b.mem_map(&mut region[..]).unwrap();
        let full_key = a.rkey_unpack(ab, &full.pack_rkey()).unwrap();
        let src = vec![9u8; 4096];
        let mut back = vec![0u8; 4096];
        let mut nothing: [u8; 0] = [];
        let mut one = [5u8; 1];
        a.scope(|s| {
            finish(&a, &b, s.put(ab, &[][..], m.address(), &key)).unwrap();
            finish(&a, &b, s.get(ab, &mut nothing[..], m.address(), &key)).unwrap();
            let e = finish(&a, &b, s.put(ab, &[7u8][..], m.address(), &key)).unwrap_err();
            assert!(!e.is_retryable(), "{e:?}");
            let e = finish(&a, &b, s.get(ab, &mut one[..], m.address(), &key)).unwrap_err();
            assert!(!e.is_retryable(), "{e:?}");
            finish(&a, &b, s.put(ab, &src[..], full.address(), &full_key)).unwrap();
            finish(&a, &b, s.get(ab, &mut back[..], full.address(), &full_key)).unwrap();
        });
        assert_eq!(one, [5], "a refused get wrote nothing");
        assert!(
            a.context_demotions().is_empty(),
            "{:?}",
            a.context_demotions()
        );
        drop((m, full));
        assert!(empty.is_empty());
        assert_eq!(region, src);
        assert_eq!(back, src);
    }
}
