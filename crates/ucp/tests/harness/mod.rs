//! A deterministic two-worker harness (in the spirit of quinn-proto's `Pair`): two contexts and
//! workers of this process joined by the `sim` fabric, progressed by the test in a loop it
//! controls, with guarded buffers (host or simulated GPU memory) and the WARN logs of the test's
//! thread captured.
//!
//! ```ignore
//! let pair = Pair::new(FabricSpec::gpu(), [&[], &[]]);
//! let send = Buf::filled(&pair.fabric, 1 << 20, Mem::Device(0), 7);
//! let mut recv = Buf::new(&pair.fabric, 1 << 20, Mem::Host);
//! let out = pair.transfer(0, &send, &mut recv, 5, false);
//! out.expect_ok();
//! ```

#![allow(dead_code)]

use std::alloc::Layout;
use std::fmt;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use rucx_ucp::{Completion, Context, EpId, RecvBuf, Request, SendBuf, TAG_MASK_FULL, Tag, Worker};
use rucx_ucs::{Config, Error, RegErrorKind, Result};
use rucx_uct_sim::{Delivery, Fabric, FabricSpec, LaneKind, NodeId};
use tracing_subscriber::layer::SubscriberExt;

/// Bytes of guard around every buffer (the rest of its pages are guards too).
pub const GUARD: usize = 64;
/// What guards and untouched receive bytes hold.
pub const GUARD_BYTE: u8 = 0xa5;
const PAGE: usize = 4096;

/// `vars` and `RUCX_FAULT_INJECT=fault`: the variables of a side whose domain is made to fail.
pub fn with_fault<'a>(vars: &[(&'a str, &'a str)], fault: &'a str) -> Vec<(&'a str, &'a str)> {
    vars.iter()
        .copied()
        .chain([("RUCX_FAULT_INJECT", fault)])
        .collect()
}

/// The configuration of one side: the option tables of the layers the harness uses, and the
/// given `RUCX_*` variables on top of the defaults.
pub fn config(vars: &[(&str, &str)]) -> Config {
    let tables = vec![
        rucx_ucs::log::CONFIG,
        rucx_ucs::rcache::CONFIG,
        rucx_uct::CONFIG,
        rucx_ucp::CONFIG,
    ];
    // Staging is made on first use unless a test asks for it ahead: a helper thread's
    // registration would race the protocol's for the Nth-registration faults, and the property
    // tests must replay.
    let ahead = vars.iter().any(|(k, _)| *k == "RUCX_RNDV_STAGING_AHEAD");
    let default = (!ahead).then_some(("RUCX_RNDV_STAGING_AHEAD", "n"));
    Config::from_vars(
        &tables,
        vars.iter()
            .copied()
            .chain(default)
            .map(|(k, v)| (k.to_string(), v.to_string())),
    )
    .unwrap_or_else(|e| panic!("bad test configuration {vars:?}: {e}"))
}

/// Message `id`'s unique bytes: its id in the first 8 (when it has 8), then a stream seeded by it.
pub fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&id.to_le_bytes()[..len.min(8)]);
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push((x >> 32) as u8);
    }
    v
}

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    /// Host memory, passed as a slice (typed host by the caller).
    Host,
    /// Host memory passed by address, classified by the domains (as `from_raw` users do).
    HostRaw,
    /// Simulated device memory of GPU `n`.
    Device(u32),
}

/// Simulated device memory comes from an address range of its own that host allocations never
/// use, as real device memory does: the registration cache keeps registrations of freed host
/// memory and merges a new request with any it overlaps, so a device buffer placed where a
/// host buffer was freed would otherwise be swallowed by a host registration.
mod arena {
    use std::collections::BTreeMap;
    use std::sync::{Mutex, OnceLock};

    const SIZE: usize = 16 << 30;

    struct Arena {
        base: usize,
        /// Free ranges by start.
        free: Mutex<BTreeMap<usize, usize>>,
    }

    fn arena() -> &'static Arena {
        static A: OnceLock<Arena> = OnceLock::new();
        A.get_or_init(|| {
            // SAFETY: a fresh anonymous private mapping (address space only, thanks to
            // MAP_NORESERVE); nothing else refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            assert!(p != libc::MAP_FAILED, "reserving the device arena");
            let base = p as usize;
            Arena {
                base,
                free: Mutex::new(BTreeMap::from([(base, SIZE)])),
            }
        })
    }

    /// `len` bytes (a multiple of the page size), page aligned.
    pub fn alloc(len: usize) -> *mut u8 {
        let a = arena();
        let mut free = a.free.lock().unwrap_or_else(|p| p.into_inner());
        let (&start, &flen) = free
            .iter()
            .find(|(_, l)| **l >= len)
            .expect("device arena exhausted");
        free.remove(&start);
        if flen > len {
            free.insert(start + len, flen - len);
        }
        start as *mut u8
    }

    /// Give back what `alloc` returned.
    pub fn free(p: *mut u8, len: usize) {
        let a = arena();
        let start = p as usize;
        assert!(start >= a.base && start + len <= a.base + SIZE);
        // SAFETY: the range is ours (from `alloc`) and nobody uses it any more; the pages read
        // as zeros afterwards.
        unsafe { libc::madvise(p.cast(), len, libc::MADV_DONTNEED) };
        let mut free = a.free.lock().unwrap_or_else(|p| p.into_inner());
        let (mut s, mut l) = (start, len);
        if let Some((&ps, &pl)) = free.range(..s).next_back()
            && ps + pl == s
        {
            free.remove(&ps);
            s = ps;
            l += pl;
        }
        if let Some(&nl) = free.get(&(start + len)) {
            free.remove(&(start + len));
            l += nl;
        }
        free.insert(s, l);
    }
}

/// A buffer with guard bytes before and after it, in pages of its own (see
/// `Fabric::mark_device`), freed (and, for device memory, unmarked) on drop.
pub struct Buf {
    base: *mut u8,
    layout: Layout,
    len: usize,
    mem: Mem,
    fabric: Fabric,
}

impl fmt::Debug for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buf({} B, {:?} at {:#x})",
            self.len,
            self.mem,
            self.addr()
        )
    }
}

impl Buf {
    /// A buffer of `len` bytes, all [`GUARD_BYTE`].
    pub fn new(fabric: &Fabric, len: usize, mem: Mem) -> Buf {
        let total = (GUARD + len + GUARD).div_ceil(PAGE) * PAGE;
        let layout = Layout::from_size_align(total, PAGE).expect("layout");
        let base = match mem {
            Mem::Device(_) => arena::alloc(total),
            // SAFETY: `layout` has a non-zero size.
            _ => unsafe { std::alloc::alloc(layout) },
        };
        assert!(!base.is_null(), "out of memory");
        // SAFETY: `base` points to `total` freshly allocated bytes.
        unsafe { std::ptr::write_bytes(base, GUARD_BYTE, total) };
        let b = Buf {
            base,
            layout,
            len,
            mem,
            fabric: fabric.clone(),
        };
        if let Mem::Device(d) = mem {
            // A zero-byte device buffer is still device memory.
            fabric.mark_device(b.addr(), len.max(1), d);
        }
        b
    }

    /// A buffer holding `pattern(id, len)`.
    pub fn filled(fabric: &Fabric, len: usize, mem: Mem, id: u64) -> Buf {
        let mut b = Buf::new(fabric, len, mem);
        b.bytes_mut().copy_from_slice(&pattern(id, len));
        b
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.base as usize + GUARD
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where it lives.
    pub fn mem(&self) -> Mem {
        self.mem
    }

    /// The bytes (device memory too: it is simulated).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds `GUARD + len` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len) }
    }

    /// The bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len) }
    }

    fn whole(&self) -> &[u8] {
        // SAFETY: the whole allocation, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base, self.layout.size()) }
    }

    /// Where a guard byte changed, if one did.
    pub fn guard_damage(&self) -> Option<String> {
        let w = self.whole();
        let end = GUARD + self.len;
        if let Some(i) = w[..GUARD].iter().rposition(|b| *b != GUARD_BYTE) {
            return Some(format!("{} bytes before the buffer", GUARD - i));
        }
        if let Some(i) = w[end..].iter().position(|b| *b != GUARD_BYTE) {
            return Some(format!("{} bytes past the end of the buffer", i));
        }
        None
    }

    /// The buffer to send from.
    pub fn send(&self) -> SendBuf<'_> {
        match self.mem {
            Mem::Host => SendBuf::from(self.bytes()),
            // SAFETY: the memory is ours and stays allocated and unwritten while `self` is
            // borrowed, which the returned buffer's lifetime ties it to.
            _ => unsafe { SendBuf::from_raw(self.addr() as u64, self.len) },
        }
    }

    /// The buffer to receive into.
    pub fn recv(&mut self) -> RecvBuf<'_> {
        match self.mem {
            Mem::Host => RecvBuf::from(self.bytes_mut()),
            // SAFETY: the memory is ours and stays allocated, and nobody else touches it, while
            // `self` is borrowed mutably, which the returned buffer's lifetime ties it to.
            _ => unsafe { RecvBuf::from_raw(self.addr() as u64, self.len) },
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Mem::Device(_) = self.mem {
            self.fabric.unmark_device(self.addr());
            arena::free(self.base, self.layout.size());
        } else {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.base, self.layout) };
        }
    }
}

/// WARN events of this thread, while the capture lives.
#[derive(Clone, Default)]
pub struct Warnings(Arc<Mutex<Vec<String>>>);

impl Warnings {
    /// Every captured warning.
    pub fn all(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Warnings announcing a demotion.
    pub fn demoted(&self) -> Vec<String> {
        self.all()
            .into_iter()
            .filter(|w| w.contains("demoted"))
            .collect()
    }
}

struct Capture(Warnings);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if *event.metadata().level() == tracing::Level::WARN {
            let mut m = Message(String::new());
            event.record(&mut m);
            (self.0)
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(m.0);
        }
    }
}

/// Aborts the process with a report if not dropped within its time: a test that hangs inside
/// the library (where the harness cannot step in) fails CI instead of stalling it.
pub struct Watchdog {
    _tx: mpsc::Sender<()>,
}

impl Watchdog {
    /// Arm for `secs` seconds; `what` is printed if it fires.
    pub fn arm(secs: u64, what: String) -> Watchdog {
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(secs))
            {
                eprintln!("WATCHDOG: no result after {secs} s, aborting: {what}");
                std::process::abort();
            }
        });
        Watchdog { _tx: tx }
    }
}

/// How a transfer ended.
#[derive(Debug)]
pub struct Outcome {
    /// The send's result (`None`: never finished).
    pub send: Option<Result<Completion>>,
    /// The receive's result.
    pub recv: Option<Result<Completion>>,
    /// Steps taken.
    pub steps: usize,
    /// Set when it hung; the report says what was pending (both nodes were then failed so
    /// the scopes could end).
    pub hang: Option<String>,
}

impl Outcome {
    /// Panic unless both ended well.
    pub fn expect_ok(&self) -> (Completion, Completion) {
        assert!(
            self.hang.is_none(),
            "{}",
            self.hang.as_deref().unwrap_or("")
        );
        match (&self.send, &self.recv) {
            (Some(Ok(s)), Some(Ok(r))) => (*s, *r),
            other => panic!("transfer failed: {other:?}"),
        }
    }
}

/// Two workers joined by a sim fabric, and each one's endpoint to the other.
pub struct Pair {
    /// The fabric.
    pub fabric: Fabric,
    /// Node of each side.
    pub nodes: [NodeId; 2],
    /// Contexts.
    pub ctx: [Context; 2],
    /// Workers.
    pub w: [Worker; 2],
    /// `ep[i]`: worker `i`'s endpoint to the other.
    pub ep: [EpId; 2],
    /// Warnings of this thread since the pair was made.
    pub warnings: Warnings,
    /// Progress calls without an event after which a pending request counts as hung.
    pub quiet_limit: usize,
    /// Steps after which a transfer counts as hung even with activity (a livelock).
    pub step_limit: usize,
    _log: tracing::subscriber::DefaultGuard,
}

impl fmt::Debug for Pair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pair")
            .field("fabric", &self.fabric)
            .finish()
    }
}

impl Pair {
    /// Two sides on a fabric of `spec`, each configured with its variables, connected both
    /// ways and wired up.
    pub fn new(spec: FabricSpec, vars: [&[(&str, &str)]; 2]) -> Pair {
        let warnings = Warnings::default();
        let sub = tracing_subscriber::registry().with(tracing_subscriber::Layer::with_filter(
            Capture(warnings.clone()),
            tracing_subscriber::filter::LevelFilter::WARN,
        ));
        let guard = tracing::subscriber::set_default(sub);
        let fabric = Fabric::new(spec);
        let nodes = [fabric.add_node("a"), fabric.add_node("b")];
        let ctx = [0, 1].map(|i| {
            Context::new(&fabric.registry(nodes[i]), config(vars[i]))
                .unwrap_or_else(|e| panic!("context {i}: {e}"))
        });
        let w = [0, 1].map(|i| Worker::new(&ctx[i]).unwrap_or_else(|e| panic!("worker {i}: {e}")));
        let ep = [
            w[0].connect(&w[1].address()).expect("connect a -> b"),
            w[1].connect(&w[0].address()).expect("connect b -> a"),
        ];
        let pair = Pair {
            fabric,
            nodes,
            ctx,
            w,
            ep,
            warnings,
            quiet_limit: 200,
            step_limit: 200_000,
            _log: guard,
        };
        pair.settle();
        pair
    }

    /// Progress side a, then side b, once. Returns the events handled.
    pub fn step(&self) -> usize {
        self.w[0].progress() + self.w[1].progress()
    }

    /// In manual delivery, what the loops of the harness release before each step (tests
    /// that steer by hand do so between them).
    fn release_if_manual(&self) {
        if self.fabric.spec().delivery == Delivery::Manual {
            self.fabric.release_all();
        }
    }

    /// Step until nothing is in flight and a step finds nothing to do.
    pub fn settle(&self) {
        for _ in 0..self.step_limit {
            self.release_if_manual();
            if self.step() == 0 && self.fabric.in_flight() == 0 {
                return;
            }
        }
        panic!("the pair never settled");
    }

    /// Step until `done()` says so; `Err` with a description when nothing happens for
    /// `quiet_limit` steps (or `step_limit` steps pass) first.
    pub fn drive(&self, mut done: impl FnMut() -> bool) -> std::result::Result<usize, String> {
        let mut quiet = 0;
        for steps in 0..self.step_limit {
            if done() {
                return Ok(steps);
            }
            self.release_if_manual();
            if self.step() == 0 && self.fabric.in_flight() == 0 {
                quiet += 1;
                if quiet > self.quiet_limit {
                    return Err(format!(
                        "nothing happened for {quiet} steps (after {steps})"
                    ));
                }
            } else {
                quiet = 0;
            }
        }
        Err(format!(
            "still busy after {} steps (livelock?)",
            self.step_limit
        ))
    }

    /// Drive until every one of `reqs` ended; on a hang, break the fabric (so that the scopes
    /// can finish) and panic with the description and each request's state.
    pub fn drive_all(&self, reqs: &[&Request<'_>]) {
        if let Err(e) = self.drive(|| reqs.iter().all(|r| r.test().is_some())) {
            self.break_fabric("hang");
            panic!(
                "{e}: {:?}",
                reqs.iter().map(|r| r.test()).collect::<Vec<_>>()
            );
        }
    }

    /// Make the `nth` host registration from now on side `side`'s `sim_shm` domain fail with
    /// `kind` (1: the next one).
    pub fn fail_shm_registration(&self, side: usize, nth: u64, kind: RegErrorKind) {
        let node = self.nodes[side];
        let at = self.fabric.reg_attempts(node, LaneKind::Shm) + nth;
        self.fabric.fail_registration(node, LaneKind::Shm, at, kind);
    }

    /// Fail both nodes so that every pending request ends and the scopes can finish: what the
    /// harness does after detecting a hang.
    pub fn break_fabric(&self, why: &str) {
        for n in self.nodes {
            self.fabric.fail_node(n, why);
        }
    }

    /// Send `sbuf` from side `from` to the other side's receive of `rbuf` with `tag`.
    pub fn transfer(
        &self,
        from: usize,
        sbuf: &Buf,
        rbuf: &mut Buf,
        tag: Tag,
        sync: bool,
    ) -> Outcome {
        let to = 1 - from;
        let ep = self.ep[from];
        let (rlen, rmem) = (rbuf.len(), rbuf.mem());
        let _dog = Watchdog::arm(
            120,
            format!(
                "transfer of {} B ({:?}) from side {from} into {rlen} B ({rmem:?}), tag {tag}",
                sbuf.len(),
                sbuf.mem()
            ),
        );
        self.w[from].scope(|ss| {
            self.w[to].scope(|sr| {
                let r = sr.tag_recv(rbuf.recv(), tag, TAG_MASK_FULL);
                let s = if sync {
                    ss.tag_send_sync(ep, sbuf.send(), tag)
                } else {
                    ss.tag_send(ep, sbuf.send(), tag)
                };
                let (mut so, mut ro) = (None, None);
                let driven = self.drive(|| {
                    if so.is_none() {
                        so = s.test();
                    }
                    if ro.is_none() {
                        ro = r.test();
                    }
                    so.is_some() && ro.is_some()
                });
                let (steps, hang) = match driven {
                    Ok(n) => (n, None),
                    Err(why) => {
                        let report = format!(
                            "HANG: {why}: send {} B ({:?}) from side {from} -> receive {} B ({:?}), \
                             tag {tag}, sync {sync}: send {}, receive {}\nfabric log:\n  {}",
                            sbuf.len(),
                            sbuf.mem(),
                            rlen,
                            rmem,
                            so.as_ref().map_or("PENDING".into(), |r| format!("{r:?}")),
                            ro.as_ref().map_or("PENDING".into(), |r| format!("{r:?}")),
                            self.fabric.log().join("\n  ")
                        );
                        self.break_fabric("the harness detected a hang");
                        (0, Some(report))
                    }
                };
                Outcome {
                    send: so,
                    recv: ro,
                    steps,
                    hang,
                }
            })
        })
    }

    /// Panic unless worker `w`'s protocol counter `name` counted at least once (the counters
    /// are printed otherwise).
    pub fn assert_ran(&self, w: usize, name: &str) {
        let c = self.w[w].counters();
        assert!(
            c.contains_key(name),
            "{name} never ran on worker {w}: {c:?}"
        );
    }

    /// Panic unless the fabric saw no violation, and every demotion of either context was
    /// announced by exactly one warning (none for those configured with `RUCX_REG_SKIP`).
    pub fn check_clean(&self) {
        let v = self.fabric.violations();
        assert!(v.is_empty(), "fabric violations: {v:#?}");
        self.check_warnings();
    }

    /// Exactly one "demoted" warning per demotion entry of both contexts.
    pub fn check_warnings(&self) {
        // Our own traffic is never refused as malformed or as naming someone else's request.
        let dropped: Vec<_> = self
            .warnings
            .all()
            .into_iter()
            .filter(|w| w.contains("dropped a malformed"))
            .collect();
        assert!(dropped.is_empty(), "{dropped:#?}");
        let demotions: Vec<_> = self
            .ctx
            .iter()
            .flat_map(|c| c.demotions())
            .filter(|d| d.knob != "RUCX_REG_SKIP")
            .collect();
        let warned = self.warnings.demoted();
        assert_eq!(
            warned.len(),
            demotions.len(),
            "demotions {demotions:#?}\nwarnings {warned:#?}"
        );
        // Warnings do not say which context demoted: count per domain and memory type.
        for d in &demotions {
            let key =
                |md: &str, mt: &str| format!("memory domain {md} cannot register {mt} memory");
            let k = key(&d.md, d.mem_type.name());
            let want = demotions
                .iter()
                .filter(|x| key(&x.md, x.mem_type.name()) == k)
                .count();
            let n = warned.iter().filter(|w| w.starts_with(&k)).count();
            assert_eq!(n, want, "demotion {d:?} announced {n} times: {warned:#?}");
        }
    }
}

/// `Error::Truncated` with these lengths (whatever tag it names)?
pub fn is_truncation(r: &Result<Completion>, incoming: usize, capacity: usize) -> bool {
    matches!(r, Err(Error::Truncated { incoming: i, capacity: c, .. }) if *i == incoming && *c == capacity)
}

/// How a request that ended with an error gave its transfer up, when that is a correct outcome
/// with registration faults and no path left (see [`abort_kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abort {
    /// This side failed on its own (a registration, or no path left: `Error::Registration`, or
    /// `Error::Unsupported` naming the domain or the knob) and told the peer, if the transfer
    /// had one yet.
    Own,
    /// The peer gave the transfer up (`Error::PeerAborted`).
    Peer,
}

/// Whether `e` is a correct way for a send or a receive to end when registrations fail and no
/// path is left: this side's own failure, or the peer's abort. Anything else (a truncation, a
/// cancel, an endpoint failure, an internal error) is not an abort.
pub fn abort_kind(e: &Error) -> Option<Abort> {
    match e {
        Error::PeerAborted { .. } => Some(Abort::Peer),
        Error::Registration(_) => Some(Abort::Own),
        Error::Unsupported { .. } => {
            // Naming what is missing: a domain of the fabric, a knob, a transport, or that no
            // path is left.
            let s = e.to_string();
            ["sim_", "RUCX_", "transport", "no path"]
                .iter()
                .any(|w| s.contains(w))
                .then_some(Abort::Own)
        }
        _ => None,
    }
}
