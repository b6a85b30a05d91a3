//! The GPU staged pipeline and its failure paths, on a machine without a GPU: a stand-in copy
//! transport (named like the real one, `cuda_copy` on domain `cuda_cpy`, so `RUCX_TLS` and
//! `RUCX_FAULT_INJECT` name it the same way) that classifies chosen host buffers as "GPU 0"
//! memory and copies with `memcpy`, completing each copy on the next progress call like a copy
//! engine. Everything above it (bounce buffers, RTS/PULL/FRAG/FRAG_ACK, demotion, aborts) is
//! the real protocol code.
//!
//! Every exchange runs under a deadline: a hang is a test failure, not a stuck test binary.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rucx_ucp::{Context, EpId, RecvBuf, SendBuf, TAG_MASK_FULL, Worker};
use rucx_ucs::{Config, Error, MemoryType, Result};
use rucx_uct::{
    Availability, Component, DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps,
    IfaceLimits, IfaceParams, Iov, MdAttr, MemHandle, MemRegion, MemTypeFlags, MemoryDomain,
    OpStatus, PerfModel, Registry, RemoteKey, TlResource,
};

// ----- the stand-in copy transport -----

/// Host ranges that pass for device memory of GPU 0.
static DEVICE: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// "Device" memory: a host allocation the stand-in classifies as GPU memory while it lives.
struct DevBuf(Vec<u8>);

impl DevBuf {
    fn new(data: &[u8]) -> DevBuf {
        let b = DevBuf(data.to_vec());
        DEVICE
            .lock()
            .unwrap()
            .push((b.0.as_ptr() as usize, b.0.len()));
        b
    }

    fn zeroed(len: usize) -> DevBuf {
        DevBuf::new(&vec![0xa5; len])
    }

    fn send(&self) -> SendBuf<'_> {
        // SAFETY: the vector outlives the scope the buffer is used in (it is borrowed from
        // `self`), and nothing writes it meanwhile.
        unsafe { SendBuf::from_raw(self.0.as_ptr() as u64, self.0.len()) }
    }

    fn recv(&mut self) -> RecvBuf<'_> {
        // SAFETY: the vector is borrowed mutably from `self` for the scope; nothing else
        // touches it meanwhile.
        unsafe { RecvBuf::from_raw(self.0.as_mut_ptr() as u64, self.0.len()) }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let a = self.0.as_ptr() as usize;
        DEVICE.lock().unwrap().retain(|(b, _)| *b != a);
    }
}

fn is_device(addr: usize, len: usize) -> bool {
    DEVICE
        .lock()
        .unwrap()
        .iter()
        .any(|(b, l)| addr >= *b && addr + len.max(1) <= b + l)
}

/// Per-process (per-context) behaviour of the stand-in: copies that complete with an error,
/// copies pushed back.
#[derive(Debug, Default)]
struct CopyCtl {
    copies: AtomicUsize,
    /// The copy with this number (1 = the first) completes with an error.
    fail_copy: Mutex<Option<usize>>,
    /// Every this many copies asked for, one is pushed back (`NoResource`; 0: none).
    push_back_every: AtomicUsize,
    /// Copies asked for, and how many were pushed back.
    asked: AtomicUsize,
    pushed_back: AtomicUsize,
}

#[derive(Debug)]
struct CopyComponent(Arc<CopyCtl>);

impl Component for CopyComponent {
    fn name(&self) -> &'static str {
        "cuda_copy"
    }
    fn transports(&self) -> &'static [&'static str] {
        &["cuda_copy"]
    }
    fn query(&self, _: &Config) -> Availability {
        Availability::Available(vec!["cuda_cpy".into()])
    }
    fn open_md(&self, _: &str, _: &Config) -> Result<Arc<dyn MemoryDomain>> {
        let attr = MdAttr::new("cuda_copy")
            .with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS)
            .with(
                MemoryType::Cuda,
                MemTypeFlags::ACCESS | MemTypeFlags::DETECT,
            );
        Ok(Arc::new(CopyMd {
            attr,
            ctl: self.0.clone(),
        }))
    }
}

#[derive(Debug)]
struct CopyMd {
    attr: MdAttr,
    ctl: Arc<CopyCtl>,
}

impl MemoryDomain for CopyMd {
    fn name(&self) -> &str {
        "cuda_cpy"
    }
    fn attr(&self) -> &MdAttr {
        &self.attr
    }
    fn tl_resources(&self) -> Vec<TlResource> {
        vec![TlResource {
            tl_name: "cuda_copy".into(),
            dev_name: "cuda".into(),
        }]
    }
    fn open_iface(&self, _: &TlResource, _: &IfaceParams) -> Result<Box<dyn Iface>> {
        Ok(Box::new(CopyIface {
            attr: IfaceAttr {
                tl_name: "cuda_copy".into(),
                dev_name: "cuda".into(),
                dev_type: DeviceType::Accelerator,
                sys_device: None,
                caps: IfaceCaps::PUT_SHORT | IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY,
                limits: IfaceLimits {
                    put_max_short: 4096,
                    put_max_zcopy: usize::MAX,
                    get_max_zcopy: usize::MAX,
                    max_iov: 1,
                    ..IfaceLimits::default()
                },
                perf: PerfModel {
                    latency_ns: 1000.0,
                    overhead_ns: 100.0,
                    bandwidth: 50e9,
                },
                priority: 0,
                device_addr_len: 0,
                iface_addr_len: 0,
                ep_addr_len: 0,
                max_eps: None,
            },
            done: Arc::default(),
            ctl: self.ctl.clone(),
        }))
    }
    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        Ok(MemHandle::new(region, "cuda_cpy", Arc::new(())))
    }
    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        let r = memh.region();
        let mut k = (r.addr as u64).to_le_bytes().to_vec();
        k.extend_from_slice(&(r.len as u64).to_le_bytes());
        Ok(k)
    }
    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        let f = |i: usize| -> Result<u64> {
            Ok(u64::from_le_bytes(
                packed
                    .get(i..i + 8)
                    .and_then(|b| b.try_into().ok())
                    .ok_or_else(|| Error::InvalidParam("short key".into()))?,
            ))
        };
        Ok(RemoteKey::new("cuda_cpy", f(0)?, f(8)?, Arc::new(())))
    }
    fn detect_mem_type(&self, addr: usize, len: usize) -> Result<Option<MemRegion>> {
        Ok(is_device(addr, len).then_some(MemRegion {
            addr,
            len,
            mem_type: MemoryType::Cuda,
            device: Some(0),
        }))
    }
}

type Done = Arc<Mutex<VecDeque<(u64, Result<()>)>>>;

#[derive(Debug)]
struct CopyIface {
    attr: IfaceAttr,
    done: Done,
    ctl: Arc<CopyCtl>,
}

impl Iface for CopyIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }
    fn device_address(&self) -> Vec<u8> {
        b"stand-in copy engine".to_vec()
    }
    fn iface_address(&self) -> Vec<u8> {
        vec![0]
    }
    fn is_reachable(&self, _: &[u8], _: &[u8]) -> bool {
        false
    }
    fn create_ep(&mut self, _: &EpParams) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(CopyEp {
            done: self.done.clone(),
            ctl: self.ctl.clone(),
        }))
    }
    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        let ready: Vec<_> = self.done.lock().unwrap().drain(..).collect();
        let n = ready.len();
        for (token, result) in ready {
            sink(Event::Completion { token, result });
        }
        n
    }
}

#[derive(Debug)]
struct CopyEp {
    done: Done,
    ctl: Arc<CopyCtl>,
}

impl CopyEp {
    /// Copy `len` bytes and queue the completion; the chosen copy completes with an error.
    fn copy(&mut self, dst: usize, src: usize, len: usize, token: u64) -> Result<OpStatus> {
        let every = self.ctl.push_back_every.load(Ordering::SeqCst);
        let asked = self.ctl.asked.fetch_add(1, Ordering::SeqCst) + 1;
        if every > 0 && asked.is_multiple_of(every) {
            self.ctl.pushed_back.fetch_add(1, Ordering::SeqCst);
            return Err(Error::NoResource("stand-in copy engine busy".into()));
        }
        let n = self.ctl.copies.fetch_add(1, Ordering::SeqCst) + 1;
        let result = if *self.ctl.fail_copy.lock().unwrap() == Some(n) {
            Err(Error::Device {
                device: "stand-in GPU 0".into(),
                reason: format!("copy {n} failed on purpose"),
            })
        } else {
            // SAFETY: both ranges were checked against their registration or remote key, which
            // describe live buffers of this process (the protocol keeps them registered while
            // the copy is outstanding); source and destination never overlap (staging against
            // a user buffer).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
            Ok(())
        };
        self.done.lock().unwrap().push_back((token, result));
        Ok(OpStatus::InProgress)
    }
}

impl Endpoint for CopyEp {
    fn am_short(&mut self, _: u8, _: u64, _: &[u8]) -> Result<()> {
        Err(Error::InvalidParam("no active messages".into()))
    }
    fn am_bcopy(&mut self, _: u8, _: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        Err(Error::InvalidParam("no active messages".into()))
    }
    fn am_zcopy(&mut self, _: u8, _: &[u8], _: &[Iov<'_>], _: u64) -> Result<OpStatus> {
        Err(Error::InvalidParam("no active messages".into()))
    }
    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        rkey.check(remote_addr, data.len() as u64)?;
        // SAFETY: the destination lies inside the key's live region (checked above).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), remote_addr as *mut u8, data.len()) };
        Ok(())
    }
    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        let len = Iov::check_all(iov, 1)?;
        rkey.check(remote_addr, len as u64)?;
        self.copy(remote_addr as usize, iov[0].addr, len, token)
    }
    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        let len = Iov::check_all(iov, 1)?;
        rkey.check(remote_addr, len as u64)?;
        self.copy(iov[0].addr, remote_addr as usize, len, token)
    }
    fn flush(&mut self, _: u64) -> Result<OpStatus> {
        Ok(OpStatus::Done)
    }
}

// ----- harness -----

fn worker(vars: &[(&str, &str)], ctl: Arc<CopyCtl>) -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let cfg = Config::from_vars(&tables, vars.iter().copied()).unwrap();
    // The real CUDA components are left out (they are unavailable here anyway); the stand-in
    // takes the copy transport's place.
    let mut reg = Registry::new();
    for c in rucx_transports::registry().components() {
        if !c
            .transports()
            .iter()
            .any(|t| t.starts_with("cuda") || *t == "gdr_copy")
        {
            reg.register(c.clone());
        }
    }
    reg.register(Arc::new(CopyComponent(ctl)));
    let ctx = Context::new(&reg, cfg).unwrap();
    let w = Worker::new(&ctx).unwrap();
    assert!(
        w.transports().iter().any(|t| t == "cuda_copy/cuda"),
        "{:?}",
        w.transports()
    );
    w
}

const LIMIT: Duration = Duration::from_secs(20);

/// Run `f` on a thread of its own; a test failure if it does not return within `LIMIT`.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(LIMIT)
        .unwrap_or_else(|_| panic!("{what}: still running after {LIMIT:?} (a hang)"))
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

/// One worker sending device memory to itself.
fn self_exchange(
    w: &Worker,
    ep: EpId,
    n: usize,
    cap: usize,
    tag: u64,
) -> (Result<usize>, Result<usize>, Vec<u8>) {
    let src = DevBuf::new(&pattern(n, tag as u8));
    let mut dst = DevBuf::zeroed(cap);
    let (s, r) = w.scope(|sc| {
        let r = sc.tag_recv(dst.recv(), tag, TAG_MASK_FULL);
        let s = sc.tag_send(ep, src.send(), tag);
        (s.wait().map(|c| c.len), r.wait().map(|c| c.len))
    });
    (s, r, dst.0.clone())
}

/// Two workers (two contexts, each with its own environment) on two threads, connected over
/// posix; `f0` and `f1` run on them and their outcomes come back.
fn pair<A: Send + 'static, B: Send + 'static>(
    env0: Vec<(&'static str, &'static str)>,
    env1: Vec<(&'static str, &'static str)>,
    ctl0: Arc<CopyCtl>,
    ctl1: Arc<CopyCtl>,
    f0: impl FnOnce(&Worker, EpId) -> A + Send + 'static,
    f1: impl FnOnce(&Worker, EpId) -> B + Send + 'static,
) -> (A, B) {
    let (a_tx, a_rx) = mpsc::channel::<Vec<u8>>();
    let (b_tx, b_rx) = mpsc::channel::<Vec<u8>>();
    let finished = Arc::new(AtomicUsize::new(0));
    let side = move |env: Vec<(&'static str, &'static str)>,
                     ctl: Arc<CopyCtl>,
                     tx: mpsc::Sender<Vec<u8>>,
                     rx: mpsc::Receiver<Vec<u8>>| {
        let w = worker(&env, ctl);
        tx.send(w.address()).unwrap();
        let peer = rx.recv().unwrap();
        let ep = w.connect(&peer).unwrap();
        (w, ep)
    };
    // Each side keeps progressing after its own part until the other is done too (it may still
    // need our messages), then both close.
    let linger = |w: &Worker, finished: &AtomicUsize| {
        finished.fetch_add(1, Ordering::SeqCst);
        while finished.load(Ordering::SeqCst) < 2 {
            w.progress();
        }
    };
    let t0 = std::thread::spawn({
        let finished = finished.clone();
        move || {
            let (w, ep) = side(env0, ctl0, a_tx, b_rx);
            let out = f0(&w, ep);
            linger(&w, &finished);
            out
        }
    });
    let t1 = std::thread::spawn(move || {
        let (w, ep) = side(env1, ctl1, b_tx, a_rx);
        let out = f1(&w, ep);
        linger(&w, &finished);
        out
    });
    (
        bounded("rank 0", move || t0.join().unwrap()),
        bounded("rank 1", move || t1.join().unwrap()),
    )
}

// ----- hang A: truncation through the staged pipeline -----

#[test]
fn staged_send_into_a_smaller_receive_ends_both_sides() {
    for (n, cap, frag) in [
        (65537usize, 65536usize, "4M"),
        (100_000, 40_000, "16K"),
        (100_000, 1, "16K"),
    ] {
        let (s, r, got) = bounded("staged truncation", move || {
            let w = worker(
                &[
                    ("RUCX_TLS", "self,cuda_copy"),
                    ("RUCX_RNDV_FRAG_SIZE", frag),
                ],
                Arc::default(),
            );
            let ep = w.connect(&w.address()).unwrap();
            let out = self_exchange(&w, ep, n, cap, 7);
            let c = w.counters();
            assert!(
                c.contains_key("rendezvous receive pipelined through host staging"),
                "{c:?}"
            );
            assert_eq!(w.live_requests(), 0);
            out
        });
        assert_eq!(s.unwrap(), n, "the sender completes: {n} into {cap}");
        match r {
            Err(Error::Truncated {
                incoming,
                capacity,
                tag,
            }) => {
                assert_eq!((incoming, capacity, tag), (n, cap, Some(7)))
            }
            other => panic!("{n} into {cap}: {other:?}"),
        }
        assert_eq!(
            got,
            pattern(n, 7)[..cap],
            "{n} into {cap}: the part that fits"
        );
    }
}

#[test]
fn staged_pipeline_moves_every_size_intact() {
    let out = bounded("staged sizes", || {
        let w = worker(
            &[
                ("RUCX_TLS", "self,cuda_copy"),
                ("RUCX_RNDV_FRAG_SIZE", "64K"),
            ],
            Arc::default(),
        );
        let ep = w.connect(&w.address()).unwrap();
        let mut bad = Vec::new();
        for (k, n) in [1usize, 4097, 65536, (1 << 20) + 3].into_iter().enumerate() {
            let (s, r, got) = self_exchange(&w, ep, n, n, k as u64);
            if s.is_err() || r.is_err() || got != pattern(n, k as u8) {
                bad.push((
                    n,
                    s.err().map(|e| e.to_string()),
                    r.err().map(|e| e.to_string()),
                ));
            }
        }
        (bad, w.context_demotions())
    });
    assert!(out.0.is_empty(), "{:?}", out.0);
    assert!(out.1.is_empty(), "{:?}", out.1);
}

/// Copies (and pushed-back copies) of one `n`-byte GPU-to-GPU transfer through the staged
/// pipeline with 64 KiB fragments, over the self transport (fragments read into receive staging
/// and copied on) or between two workers over posix (fragments mapped and copied straight to
/// the GPU), the copy lane pushing back every `every`th copy (0: never): the copies of the
/// first worker and of the second (none over self), and how many were pushed back. The
/// transfer must be intact on both sides.
fn copies_of(n: usize, posix: bool, every: usize) -> (usize, usize, usize) {
    let env = [
        if posix {
            POSIX
        } else {
            ("RUCX_TLS", "self,cuda_copy")
        },
        ("RUCX_RNDV_FRAG_SIZE", "64K"),
    ];
    let ctl = |c: &Arc<CopyCtl>| {
        c.push_back_every.store(every, Ordering::SeqCst);
        c.clone()
    };
    let (c0, c1): (Arc<CopyCtl>, Arc<CopyCtl>) = (Arc::default(), Arc::default());
    if posix {
        let sizes: &'static [usize] = Box::leak(vec![n].into_boxed_slice());
        let (s, r) = two_sided(env.to_vec(), env.to_vec(), ctl(&c0), ctl(&c1), sizes);
        assert!(s[0].is_ok() && r[0].is_ok(), "{every}: {s:?} {r:?}");
    } else {
        let c = ctl(&c0);
        let (s, r, got) = bounded("copy push-back", move || {
            let w = worker(&env, c);
            let ep = w.connect(&w.address()).unwrap();
            let out = self_exchange(&w, ep, n, n, 5);
            assert_eq!(w.live_requests(), 0);
            out
        });
        assert_eq!((s, r), (Ok(n), Ok(n)), "{every}");
        assert!(got == pattern(n, 5), "{every}: bytes arrived wrong");
    }
    let load = |c: &CopyCtl| {
        (
            c.copies.load(Ordering::SeqCst),
            c.pushed_back.load(Ordering::SeqCst),
        )
    };
    let ((copies0, pushed0), (copies1, pushed1)) = (load(&c0), load(&c1));
    eprintln!(
        "posix {posix}, every {every}: copies {copies0} + {copies1}, pushed back {pushed0} + {pushed1}"
    );
    (copies0, copies1, pushed0 + pushed1)
}

#[test]
fn a_copy_lane_that_pushes_back_costs_no_extra_copy() {
    // A pushed-back copy (device -> staging on the sender, staging or a mapped fragment ->
    // device on the receiver) is posted again after progress: nothing spins and every byte
    // arrives. In one worker (fragments read into receive staging, one copy each) the transfer
    // takes exactly the copies it takes without push-back; between two workers over posix the
    // receiver copies runs of mapped fragments, which depend on how many were announced when
    // a copy is posted (push-back moves that), but never copies a fragment twice.
    let n: usize = (1 << 20) + 3;
    let frags = n.div_ceil(64 << 10);
    let (base, _, none) = copies_of(n, false, 0);
    assert_eq!(none, 0);
    assert_eq!(
        base,
        2 + frags,
        "two staging copies of the sender, one per fragment"
    );
    for every in [2, 3, 7] {
        let (copies, _, pushed) = copies_of(n, false, every);
        assert!(pushed > 0, "every {every}: nothing pushed back");
        assert_eq!(copies, base, "every {every}: {pushed} pushed back");
    }
    // Over posix each side asks for two or three copies: every other one is pushed back.
    let (_, received, _) = copies_of(n, true, 0);
    assert!((1..=frags).contains(&received), "posix: {received} copies");
    let (_, received, pushed) = copies_of(n, true, 2);
    assert!(pushed > 0, "posix: nothing pushed back");
    assert!(
        (1..=frags).contains(&received),
        "posix: {received} copies of {frags} fragments"
    );
}

// ----- hang B: the copy lane's registrations fail -----

#[test]
fn copy_lane_registration_failures_end_both_sides_in_one_process() {
    // As `RUCX_TLS=^cuda_ipc RUCX_FAULT_INJECT=md=cuda_cpy,after=3` on a GPU: the first three
    // registrations of the copy domain succeed (staging, two small messages), every later one
    // fails; no other path moves device memory, so each transfer must end on both sides.
    let outcomes = bounded("copy faults", || {
        let w = worker(
            &[
                ("RUCX_TLS", "self,cuda_copy"),
                ("RUCX_FAULT_INJECT", "md=cuda_cpy,after=3"),
            ],
            Arc::default(),
        );
        let ep = w.connect(&w.address()).unwrap();
        let mut out = Vec::new();
        for (k, n) in [1usize, 4097, 1 << 20, 1 << 20].into_iter().enumerate() {
            let (s, r, got) = self_exchange(&w, ep, n, n, 10 + k as u64);
            out.push((n, s, r, got == pattern(n, 10 + k as u8)));
        }
        (out, w.context_demotions(), w.live_requests())
    });
    let (out, demotions, live) = outcomes;
    assert_eq!(live, 0);
    // The first message fits the three allowed registrations and arrives.
    assert!(
        out[0].1.is_ok() && out[0].2.is_ok() && out[0].3,
        "{:?}",
        out[0]
    );
    for (n, s, r, _) in &out[1..] {
        let (Err(se), Err(re)) = (s, r) else {
            panic!("{n} bytes: both sides end with an error: {s:?} / {r:?}");
        };
        for e in [se, re] {
            let t = e.to_string();
            assert!(t.contains("cuda_cpy"), "{n}: names the domain: {t}");
            assert!(t.contains("RUCX_"), "{n}: names a knob: {t}");
        }
    }
    // One demotion of the copy domain for device memory of GPU 0 (the later failures are
    // refused at once, without asking the driver again).
    let d: Vec<_> = demotions.iter().filter(|d| d.md == "cuda_cpy").collect();
    assert_eq!(d.len(), 1, "{demotions:?}");
    assert_eq!((d[0].mem_type, d[0].device), (MemoryType::Cuda, Some(0)));
}

fn two_sided(
    env0: Vec<(&'static str, &'static str)>,
    env1: Vec<(&'static str, &'static str)>,
    ctl0: Arc<CopyCtl>,
    ctl1: Arc<CopyCtl>,
    sizes: &'static [usize],
) -> (Vec<Result<usize>>, Vec<Result<usize>>) {
    pair(
        env0,
        env1,
        ctl0,
        ctl1,
        move |w, ep| {
            sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    let src = DevBuf::new(&pattern(n, k as u8));
                    w.scope(|s| s.tag_send(ep, src.send(), k as u64).wait().map(|c| c.len))
                })
                .collect::<Vec<_>>()
        },
        move |w, _| {
            sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    let mut dst = DevBuf::zeroed(n);
                    let r = w.scope(|s| s.tag_recv(dst.recv(), k as u64, TAG_MASK_FULL).wait());
                    r.and_then(|c| {
                        if dst.0 == pattern(n, k as u8) {
                            Ok(c.len)
                        } else {
                            Err(Error::Internal(format!("{n} bytes arrived wrong")))
                        }
                    })
                })
                .collect::<Vec<_>>()
        },
    )
}

const POSIX: (&str, &str) = ("RUCX_TLS", "posix,cuda_copy");

#[test]
fn a_sender_that_cannot_stage_ends_the_receive_too() {
    // Only the sender's copy domain fails on device memory: the receiver asked it to stage and
    // waits for fragments; it must end with the sender's reason.
    let (s, r) = two_sided(
        vec![POSIX, ("RUCX_FAULT_INJECT", "md=cuda_cpy,mem=cuda,after=0")],
        vec![POSIX],
        Arc::default(),
        Arc::default(),
        &[1 << 20, 1 << 20],
    );
    for (k, (s, r)) in s.iter().zip(&r).enumerate() {
        let se = s.as_ref().expect_err("the sender cannot stage");
        match r {
            Err(Error::PeerAborted { reason, .. }) => {
                assert!(reason.contains("cuda_cpy"), "{k}: {reason}");
                assert!(reason.contains("RUCX_"), "{k}: {reason}");
            }
            other => panic!(
                "message {k}: the receive must end with the sender's abort: {other:?} (sender: {se})"
            ),
        }
    }
}

#[test]
fn a_receiver_that_cannot_register_ends_the_send_too() {
    let (s, r) = two_sided(
        vec![POSIX],
        vec![POSIX, ("RUCX_FAULT_INJECT", "md=cuda_cpy,mem=cuda,after=0")],
        Arc::default(),
        Arc::default(),
        &[1 << 20, 4097],
    );
    for (k, (s, r)) in s.iter().zip(&r).enumerate() {
        let re = r.as_ref().expect_err("the receiver cannot register");
        assert!(re.to_string().contains("cuda_cpy"), "{re}");
        match s {
            Err(Error::PeerAborted { reason, .. }) => {
                assert!(reason.contains("cuda_cpy"), "{k}: {reason}")
            }
            // A small message goes eagerly and is complete once sent.
            Ok(n) if *n < 65536 => {}
            other => panic!("message {k}: the send must end with the receiver's abort: {other:?}"),
        }
    }
}

#[test]
fn a_receiver_whose_mapped_fragments_cannot_be_registered_reads_them_instead() {
    // The receiver's copy domain refuses host registrations after its staging: mapping the
    // sender's shared fragments fails, the domain is demoted for host memory, and the receive
    // goes on by reading the fragments (another path), intact.
    let (s, r) = two_sided(
        vec![POSIX, ("RUCX_RNDV_FRAG_SIZE", "64K")],
        vec![
            POSIX,
            ("RUCX_RNDV_FRAG_SIZE", "64K"),
            ("RUCX_FAULT_INJECT", "md=cuda_cpy,mem=host,after=1"),
        ],
        Arc::default(),
        Arc::default(),
        &[1 << 20, 300_000],
    );
    assert!(s.iter().all(|x| x.is_ok()), "{s:?}");
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
}

#[test]
fn a_copy_failing_mid_pipeline_ends_both_sides_and_frees_every_fragment() {
    // Small fragments, two per direction: a failed device->host copy on the sender in the
    // middle of a message must end the receive too, and the fragments in flight must come back
    // (the next messages need them).
    let frag = [
        POSIX,
        ("RUCX_RNDV_FRAG_SIZE", "16K"),
        ("RUCX_RNDV_FRAG_COUNT", "2"),
    ];
    for failing_side in [0, 1] {
        let ctl: Arc<CopyCtl> = Arc::default();
        *ctl.fail_copy.lock().unwrap() = Some(4);
        let (c0, c1) = if failing_side == 0 {
            (ctl, Arc::default())
        } else {
            (Arc::default(), ctl)
        };
        let (s, r) = two_sided(
            frag.to_vec(),
            frag.to_vec(),
            c0,
            c1,
            &[200_000, 200_000, 1 << 20],
        );
        let (mine, theirs) = if failing_side == 0 {
            (&s[0], &r[0])
        } else {
            (&r[0], &s[0])
        };
        assert!(
            matches!(mine, Err(Error::Device { .. })),
            "side {failing_side}: {mine:?}"
        );
        assert!(
            matches!(theirs, Err(Error::PeerAborted { reason, .. }) if reason.contains("failed on purpose")),
            "side {failing_side}: {theirs:?}"
        );
        assert!(
            s[1..].iter().chain(&r[1..]).all(|x| x.is_ok()),
            "side {failing_side}: later messages go through: {s:?} {r:?}"
        );
    }
}

#[test]
fn the_reported_sequence_ends_on_both_sides_with_the_fault_on_either_or_both() {
    // `RUCX_TLS=^cuda_ipc RUCX_FAULT_INJECT=md=cuda_cpy,after=3` on both ranks or on one:
    // whatever a message meets, its send and its receive both end, together (both complete,
    // or both fail; a small eager message may complete on the sender alone).
    const F: (&str, &str) = ("RUCX_FAULT_INJECT", "md=cuda_cpy,after=3");
    for (env0, env1) in [
        (vec![POSIX, F], vec![POSIX, F]),
        (vec![POSIX, F], vec![POSIX]),
        (vec![POSIX], vec![POSIX, F]),
    ] {
        let what = format!("{env0:?} / {env1:?}");
        let (s, r) = two_sided(
            env0,
            env1,
            Arc::default(),
            Arc::default(),
            &[1, 4097, 1 << 20, 1 << 20, 1 << 20],
        );
        let mut failed = 0;
        for (k, (s, r)) in s.iter().zip(&r).enumerate() {
            match (s, r) {
                (Ok(_), Ok(_)) => {}
                (Err(_), Err(e)) | (Ok(_), Err(e)) => {
                    assert!(
                        s.is_err() || k < 2,
                        "{what}: message {k}: a rendezvous receive failed alone: {e}"
                    );
                    let t = e.to_string();
                    assert!(t.contains("cuda_cpy") && t.contains("RUCX_"), "{what}: {t}");
                    failed += 1;
                }
                (Err(e), Ok(_)) => panic!("{what}: message {k}: the send failed alone: {e}"),
            }
        }
        assert!(failed > 0, "{what}: the fault was never met: {s:?} {r:?}");
    }
}

// ----- fragments held by a peer that goes away -----

/// A receiver that stops reading (its copies to the GPU are always pushed back) holds the
/// sender's staging fragments, announced and never acknowledged; both sides then give up on
/// each other (`scope_timeout` fails the endpoints). The sender takes the fragments the peer
/// held back at once: its next staged transfer (to itself) still finds fragments. Before, they
/// were lost for good, and that transfer waited forever for one.
#[test]
fn fragments_held_by_a_failed_peer_come_back() {
    let env = || {
        vec![
            ("RUCX_TLS", "posix,self,cuda_copy"),
            ("RUCX_RNDV_FRAG_SIZE", "16K"),
            ("RUCX_RNDV_FRAG_COUNT", "2"),
        ]
    };
    let stuck = Arc::new(CopyCtl::default());
    stuck.push_back_every.store(1, Ordering::SeqCst);
    let n = 256 << 10;
    let give_up = Duration::from_millis(300);
    let (a, b) = pair(
        env(),
        env(),
        Arc::default(),
        stuck,
        move |w, ep| {
            let src = DevBuf::new(&pattern(n, 3));
            let first = w.scope_timeout(give_up, |sc| {
                let s = sc.tag_send(ep, src.send(), 1);
                let t = std::time::Instant::now();
                while t.elapsed() < give_up {
                    w.progress();
                }
                s.test().is_some()
            });
            let me = w.connect(&w.address()).unwrap();
            let (s, r, got) = self_exchange(w, me, n, n, 9);
            (first, s, r, got == pattern(n, 9), w.counters())
        },
        move |w, _| {
            let mut dst = DevBuf::zeroed(n);
            w.scope_timeout(give_up, |sc| {
                let _r = sc.tag_recv(dst.recv(), 1, TAG_MASK_FULL);
                let t = std::time::Instant::now();
                while t.elapsed() < give_up {
                    w.progress();
                }
            })
        },
    );
    let (first, s, r, intact, counters) = a;
    assert!(
        matches!(first, Err(Error::Timeout { .. })),
        "the send to the stuck peer ends with the timeout: {first:?}"
    );
    assert!(b.is_err(), "{b:?}");
    assert!(
        counters.contains_key("staging fragments taken back from a failed peer"),
        "{counters:?}"
    );
    assert_eq!((s.unwrap(), r.unwrap()), (n, n));
    assert!(intact, "the transfer to itself arrived intact");
}
