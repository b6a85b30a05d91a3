//! GPU tests of `cuda_ipc`: run only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver;
//! elsewhere each test prints why it skipped and passes.
//!
//! On a GPU machine: `RUCX_GPU_TESTS=1 <this test binary> --test-threads=1 --nocapture`
//! (`cargo xtask gpu-pack` puts it at `.device/rucx-uct-cuda-ipc-gpu`).
//! The two-process test spawns a child of this binary (told apart by `RUCX_IPC_TEST_ROLE`);
//! the parent uses GPU 0, the child GPU 1, and they exchange addresses and keys over the
//! child's stdin/stdout.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use rucx_cuda::{DeviceBuffer, ManagedBuffer, PoolBuffer, Stream, driver};
use rucx_ucs::{Config, Error, MemoryType, RegErrorKind};
use rucx_uct::rkey::{Reader, put_lv};
use rucx_uct::{
    Component, Endpoint, EpParams, Event, Iface, IfaceParams, Iov, MemHandle, MemRegion,
    MemoryDomain, OpStatus, RemoteKey,
};
use rucx_uct_cuda_ipc::{CudaIpcComponent, CudaIpcMd, NOT_EXPORTABLE_HINT};

const ROLE_ENV: &str = "RUCX_IPC_TEST_ROLE";
/// Marks protocol lines on the child's stdout (the test harness may print before them on the
/// same line, e.g. `test name ... `).
const TAG: &str = "@@rucx-ipc@@ ";
const SIZES: [usize; 4] = [1, 4097, 1 << 20, 64 << 20];
const BUF: usize = (64 << 20) + 4096;
const DEADLINE: Duration = Duration::from_secs(120);

fn gpus() -> Option<u32> {
    if std::env::var("RUCX_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set RUCX_GPU_TESTS=1 to run GPU tests");
        return None;
    }
    match driver() {
        Ok(d) => Some(d.device_count()),
        Err(e) => panic!("RUCX_GPU_TESTS=1 but the CUDA driver is unavailable: {e}"),
    }
}

fn config() -> Config {
    Config::new(&[
        rucx_uct::CONFIG,
        rucx_uct_cuda_ipc::CONFIG,
        rucx_uct_cuda_copy::CONFIG,
    ])
    .unwrap()
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[track_caller]
fn same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(bad.is_none(), "{what}: first wrong byte at {bad:?}");
}

fn read_dev(b: &DeviceBuffer, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    b.copy_to_host(off, &mut v).unwrap();
    v
}

/// One process's cuda_ipc domain, interface and (once connected) endpoint.
struct Side {
    md: Arc<CudaIpcMd>,
    iface: Box<dyn Iface>,
    ep: Option<Box<dyn Endpoint>>,
    done: BTreeMap<u64, rucx_ucs::Result<()>>,
    next: u64,
}

impl Side {
    fn open() -> Side {
        let cfg = config();
        let md = Arc::new(CudaIpcMd::open(&cfg).unwrap());
        let tl = md.tl_resources().remove(0);
        let iface = md.open_iface(&tl, &IfaceParams { config: &cfg }).unwrap();
        Side {
            md,
            iface,
            ep: None,
            done: BTreeMap::new(),
            next: 0,
        }
    }

    fn address(&self) -> String {
        let mut b = Vec::new();
        put_lv(&mut b, &self.iface.device_address());
        put_lv(&mut b, &self.iface.iface_address());
        hex(&b)
    }

    fn connect(&mut self, addr_hex: &str) {
        let b = unhex(addr_hex);
        let mut r = Reader::new(&b, "address");
        let dev = r.lv().unwrap().to_vec();
        let ifa = r.lv().unwrap().to_vec();
        assert!(self.iface.is_reachable(&dev, &ifa));
        self.ep = Some(
            self.iface
                .create_ep(&EpParams {
                    dev_addr: dev,
                    iface_addr: ifa,
                    user_id: 1,
                })
                .unwrap(),
        );
    }

    fn reg(&self, b: &DeviceBuffer) -> (MemHandle, String) {
        let r = MemRegion {
            addr: b.ptr() as usize,
            len: b.len(),
            mem_type: MemoryType::Cuda,
            device: Some(b.device()),
        };
        // SAFETY: every caller keeps the buffer alive longer than the handle.
        let h = unsafe { self.md.mem_reg(r) }.unwrap();
        let k = hex(&self.md.mkey_pack(&h).unwrap());
        (h, k)
    }

    fn rkey(&self, hex_key: &str) -> RemoteKey {
        self.md.rkey_unpack(&unhex(hex_key)).unwrap()
    }

    fn wait(&mut self, token: u64, st: OpStatus) -> rucx_ucs::Result<()> {
        if st == OpStatus::Done {
            return Ok(());
        }
        let t = Instant::now();
        loop {
            if let Some(r) = self.done.remove(&token) {
                return r;
            }
            assert!(t.elapsed() < DEADLINE, "token {token} never completed");
            let done = &mut self.done;
            self.iface.progress(&mut |ev| match ev {
                Event::Completion { token, result } => {
                    assert!(done.insert(token, result).is_none(), "twice: {token}");
                }
                other => panic!("unexpected {other:?}"),
            });
        }
    }

    fn op(
        &mut self,
        put: bool,
        local: &MemHandle,
        addr: usize,
        len: usize,
        remote: u64,
        rkey: &RemoteKey,
    ) -> rucx_ucs::Result<()> {
        self.next += 1;
        let t = self.next;
        let iov = [Iov {
            addr,
            len,
            memh: local,
        }];
        let ep = self.ep.as_mut().expect("connected");
        let st = if put {
            ep.put_zcopy(&iov, remote, rkey, t)?
        } else {
            ep.get_zcopy(&iov, remote, rkey, t)?
        };
        self.wait(t, st)?;
        if put {
            self.next += 1;
            let f = self.next;
            let st = self.ep.as_mut().unwrap().flush(f)?;
            self.wait(f, st)?;
        }
        Ok(())
    }
}

/// Lines from a reader thread, with a deadline.
fn next_line(rx: &Receiver<String>) -> String {
    rx.recv_timeout(DEADLINE)
        .expect("the peer process sent nothing in time (see its output above)")
}

/// Parse `KEY <addr> <rkey> <base> <len>`.
fn parse_key(line: &str) -> (String, String, u64, usize) {
    let w: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(w[0], "KEY", "{line}");
    (
        w[1].to_string(),
        w[2].to_string(),
        w[3].parse().unwrap(),
        w[4].parse().unwrap(),
    )
}

/// Serve `PUT <off> <len> <seed>` checks against `buf` until `end` arrives; after each check
/// the range gets its `original` content back, so the peer's later gets see known data.
fn serve_checks(
    buf: &mut DeviceBuffer,
    original: &[u8],
    rx: &Receiver<String>,
    reply: &mut dyn FnMut(&str),
    end: &str,
) {
    loop {
        let l = next_line(rx);
        let w: Vec<&str> = l.split_whitespace().collect();
        match w.first().copied() {
            Some("PUT") => {
                let off: usize = w[1].parse().unwrap();
                let len: usize = w[2].parse().unwrap();
                let seed: u64 = w[3].parse().unwrap();
                same(
                    &format!("peer's put of {len} B at offset {off}"),
                    &read_dev(buf, off, len),
                    &pattern(len, seed),
                );
                buf.copy_from_host(off, &original[off..off + len]).unwrap();
                reply("OK");
            }
            Some(x) if x == end => return,
            _ => panic!("unexpected line {l:?}"),
        }
    }
}

fn stdin_lines() -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

fn say(s: &str) {
    println!("{TAG}{s}");
    std::io::stdout().flush().unwrap();
}

/// The child: GPU 1.
fn child_main() {
    let drv = driver().unwrap();
    let ctx = drv.context(1).unwrap();
    let rx = stdin_lines();
    let mut side = Side::open();
    let (paddr, pkey, pbase, plen) = parse_key(&next_line(&rx));
    assert_eq!(plen, BUF);
    side.connect(&paddr);
    let pk = side.rkey(&pkey);
    let parent_data = pattern(BUF, 1);

    // Phase 1: get from and put into the parent's GPU 0 buffer.
    let mut c = DeviceBuffer::new(ctx, BUF).unwrap();
    let (ch, _) = side.reg(&c);
    for (i, n) in SIZES.into_iter().enumerate() {
        let off = 5 + i * 1000;
        side.op(false, &ch, c.ptr() as usize, n, pbase + off as u64, &pk)
            .unwrap();
        same(
            &format!("child get {n} B"),
            &read_dev(&c, 0, n),
            &parent_data[off..off + n],
        );
        let seed = 200 + i as u64;
        c.copy_from_host(64, &pattern(n, seed)).unwrap();
        side.op(true, &ch, c.ptr() as usize + 64, n, pbase + 13, &pk)
            .unwrap();
        say(&format!("PUT 13 {n} {seed}"));
        assert_eq!(next_line(&rx), "OK");
        eprintln!("[child] get and put of {n} B with the parent: ok");
    }
    // A stream-ordered pool buffer cannot be exported, but it can be the local side of a copy
    // (described by a cuda_cpy handle; cuda_ipc needs no local registration).
    let stream = Stream::new(ctx).unwrap();
    let mut pool = PoolBuffer::new(&stream, 1 << 20).unwrap();
    pool.copy_from_host(0, &pattern(1 << 20, 300)).unwrap();
    let copy_md = rucx_uct_cuda_copy::CudaCopyMd::open(&config()).unwrap();
    let pool_region = MemRegion {
        addr: pool.ptr() as usize,
        len: pool.len(),
        mem_type: MemoryType::Cuda,
        device: Some(1),
    };
    // SAFETY: `pool` outlives the handle.
    let poolh = unsafe { copy_md.mem_reg(pool_region) }.unwrap();
    side.op(true, &poolh, pool.ptr() as usize, 1 << 20, pbase + 13, &pk)
        .unwrap();
    say(&format!("PUT 13 {} 300", 1 << 20));
    assert_eq!(next_line(&rx), "OK");
    let s = side.md.cache_stats();
    assert_eq!(
        s.opens, 1,
        "one mapping for every copy to the same buffer: {s:?}"
    );
    assert!(s.hits >= 8, "{s:?}");
    eprintln!("[child] cache after phase 1: {s:?}");
    say("PHASE1");

    // Phase 2: the parent gets from and puts into our GPU 1 buffer.
    let mut q = DeviceBuffer::new(ctx, BUF).unwrap();
    q.copy_from_host(0, &pattern(BUF, 2)).unwrap();
    let (_qh, qk) = side.reg(&q);
    say(&format!(
        "KEY {} {qk} {} {}",
        side.address(),
        q.ptr(),
        q.len()
    ));
    serve_checks(&mut q, &pattern(BUF, 2), &rx, &mut |s| say(s), "PHASE2");

    // Phase 3: the parent freed its buffer and exported a new one.
    let (_, nkey, nbase, _) = parse_key(&next_line(&rx));
    let nk = side.rkey(&nkey);
    side.op(false, &ch, c.ptr() as usize, 1 << 20, nbase + 100, &nk)
        .unwrap();
    same(
        "get from the parent's new buffer",
        &read_dev(&c, 0, 1 << 20),
        &pattern(BUF, 3)[100..100 + (1 << 20)],
    );
    let s = side.md.cache_stats();
    assert_eq!(s.opens, 2, "{s:?}");
    let overlaps = nbase < pbase + BUF as u64 && pbase < nbase + BUF as u64;
    if overlaps {
        assert!(s.invalidations >= 1, "stale mapping kept: {s:?}");
    }
    say(&format!(
        "REKEYED opens={} invalidations={} overlapping={overlaps}",
        s.opens, s.invalidations
    ));
    assert_eq!(next_line(&rx), "BYE");
    let parent = std::os::unix::process::parent_id();
    let dropped = side.md.invalidate_peer(parent);
    assert!(dropped >= 1, "explicit invalidation dropped {dropped}");
    assert_eq!(side.md.cache_stats().entries, 0);
    eprintln!("[child] done");
}

fn spawn_child(test: &str) -> (Child, ChildStdin, Receiver<String>) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "child")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            match l.find(TAG) {
                Some(i) => {
                    if tx.send(l[i + TAG.len()..].to_string()).is_err() {
                        break;
                    }
                }
                None => println!("[child] {l}"),
            }
        }
    });
    (child, stdin, rx)
}

/// cuda_ipc between two processes, GPU 0 (this one) and GPU 1 (a child): get and put in both
/// directions at 1 B, 4 KiB + 1, 1 MiB and 64 MiB, every byte checked on the owner's side;
/// a pool buffer as the local side; the cache reusing one mapping; a new buffer of the parent
/// replacing a stale mapping; a dead owner detected.
#[test]
fn two_processes_gpu0_gpu1() {
    if std::env::var(ROLE_ENV).as_deref() == Ok("child") {
        child_main();
        return;
    }
    let Some(n) = gpus() else { return };
    if n < 2 {
        eprintln!("skipped: needs 2 GPUs, {n} visible");
        return;
    }
    let ctx = driver().unwrap().context(0).unwrap();
    let (mut child, mut stdin, rx) = spawn_child("two_processes_gpu0_gpu1");
    let mut tell = |s: &str| {
        writeln!(stdin, "{s}").unwrap();
        stdin.flush().unwrap();
    };
    let mut side = Side::open();
    let mut p = DeviceBuffer::new(ctx, BUF).unwrap();
    p.copy_from_host(0, &pattern(BUF, 1)).unwrap();
    let (ph, pk) = side.reg(&p);
    tell(&format!(
        "KEY {} {pk} {} {}",
        side.address(),
        p.ptr(),
        p.len()
    ));

    // Phase 1: the child gets and puts; we check what it put.
    serve_checks(&mut p, &pattern(BUF, 1), &rx, &mut tell, "PHASE1");
    println!("phase 1 (child on GPU 1 gets from / puts to GPU 0 of this process): ok");

    // Phase 2: we get from and put into the child's buffer.
    let (caddr, ckey, cbase, clen) = parse_key(&next_line(&rx));
    assert_eq!(clen, BUF);
    side.connect(&caddr);
    let ck = side.rkey(&ckey);
    let child_data = pattern(BUF, 2);
    let mut local = DeviceBuffer::new(ctx, BUF).unwrap();
    let (lh, _) = side.reg(&local);
    for (i, n) in SIZES.into_iter().enumerate() {
        let off = 3 + i * 777;
        side.op(false, &lh, local.ptr() as usize, n, cbase + off as u64, &ck)
            .unwrap();
        same(
            &format!("parent get {n} B"),
            &read_dev(&local, 0, n),
            &child_data[off..off + n],
        );
        let seed = 400 + i as u64;
        local.copy_from_host(128, &pattern(n, seed)).unwrap();
        side.op(true, &lh, local.ptr() as usize + 128, n, cbase + 11, &ck)
            .unwrap();
        tell(&format!("PUT 11 {n} {seed}"));
        assert_eq!(next_line(&rx), "OK");
        println!("parent (GPU 0) get and put of {n} B with the child (GPU 1): ok");
    }
    tell("PHASE2");

    // Phase 3: free our buffer, export a new one; the child must not use the stale mapping.
    drop(ph);
    drop(p);
    let mut p2 = DeviceBuffer::new(ctx, BUF).unwrap();
    p2.copy_from_host(0, &pattern(BUF, 3)).unwrap();
    let (_p2h, p2k) = side.reg(&p2);
    tell(&format!(
        "KEY {} {p2k} {} {}",
        side.address(),
        p2.ptr(),
        p2.len()
    ));
    let l = next_line(&rx);
    assert!(l.starts_with("REKEYED"), "{l}");
    println!("phase 3: child re-keyed: {l}");
    tell("BYE");
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < DEADLINE, "child did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "child failed: {status}");

    // The owner is gone: sweeping drops its mappings, and a new access is an error, not a
    // crash or a hang.
    let swept = side.md.cache().sweep_dead_owners();
    assert!(swept >= 1, "sweep dropped {swept}");
    match side.op(false, &lh, local.ptr() as usize, 4096, cbase, &ck) {
        Err(e) => println!("access to the exited child's buffer: {e}"),
        Ok(()) => println!("note: the driver still opened the exited child's allocation"),
    }
    println!("cuda_ipc two processes GPU 0 <-> GPU 1: ok");
}

/// Stream-ordered pool memory is refused with the typed error the planner demotes on.
#[test]
fn pool_memory_is_not_exportable() {
    let Some(_) = gpus() else { return };
    let ctx = driver().unwrap().context(0).unwrap();
    let side = Side::open();
    let stream = Stream::new(ctx).unwrap();
    let pool = PoolBuffer::new(&stream, 1 << 20).unwrap();
    let region = MemRegion {
        addr: pool.ptr() as usize + 4096,
        len: 8192,
        mem_type: MemoryType::Cuda,
        device: Some(0),
    };
    // SAFETY: `pool` outlives the attempt.
    let e = unsafe { side.md.mem_reg(region) }.unwrap_err();
    println!("pool registration refused: {e}");
    let Error::Registration(r) = &e else {
        panic!("not a registration error: {e:?}")
    };
    assert_eq!(r.kind, RegErrorKind::NotExportable);
    assert_eq!(r.domain, "cuda_ipc");
    assert_eq!(r.mem_type, MemoryType::Cuda);
    assert_eq!(r.device, Some(0));
    assert_eq!((r.addr, r.len), (region.addr, region.len));
    assert!(r.detail.contains("pool"), "{}", r.detail);
    assert_eq!(r.hint, NOT_EXPORTABLE_HINT);
    assert!(e.to_string().contains("RUCX_REG_SKIP=cuda_ipc:cuda"), "{e}");

    // Managed memory is not this domain's; host memory is only described (the local side of a
    // copy out of a peer's device buffer), never exported.
    let m = ManagedBuffer::new(ctx, 4096).unwrap();
    let mr = MemRegion {
        addr: m.ptr() as usize,
        len: 4096,
        mem_type: MemoryType::CudaManaged,
        device: Some(0),
    };
    // SAFETY: refused before use.
    let e = unsafe { side.md.mem_reg(mr) }.unwrap_err();
    assert_eq!(
        e.as_registration().unwrap().kind,
        RegErrorKind::UnsupportedMemoryType
    );
    let v = [0u8; 64];
    // SAFETY: `v` outlives the handle.
    let h = unsafe { side.md.mem_reg(MemRegion::of_slice(&v)) }.unwrap();
    assert_eq!(h.region().mem_type, MemoryType::Host);
    assert!(
        side.md.mkey_pack(&h).is_err(),
        "host memory is never exported"
    );
    // A plain device buffer in the middle of its allocation exports the whole allocation.
    let d = DeviceBuffer::new(ctx, 1 << 20).unwrap();
    let inner = MemRegion {
        addr: d.ptr() as usize + 4096,
        len: 100,
        mem_type: MemoryType::Cuda,
        device: None,
    };
    // SAFETY: `d` outlives the handle.
    let h = unsafe { side.md.mem_reg(inner) }.unwrap();
    let k = rucx_uct_cuda_ipc::IpcKey::unpack(&side.md.mkey_pack(&h).unwrap()).unwrap();
    assert_eq!(k.alloc_base, d.ptr());
    assert!(k.alloc_size >= 1 << 20, "{k:?}");
    assert_eq!((k.addr, k.len), (d.ptr() + 4096, 100));
    assert_eq!(h.region().device, Some(0));
    println!(
        "cuda_ipc registration: pool refused (NotExportable), managed/host refused, cuMemAlloc exported"
    );
}

/// Keys of this very process skip the IPC mapping; GPU 1 -> GPU 0 and back.
#[test]
fn same_process_across_gpus() {
    let Some(n) = gpus() else { return };
    if n < 2 {
        eprintln!("skipped: needs 2 GPUs, {n} visible");
        return;
    }
    let drv = driver().unwrap();
    let mut side = Side::open();
    side.connect(&side.address());
    let mut a = DeviceBuffer::new(drv.context(0).unwrap(), 1 << 20).unwrap();
    let mut b = DeviceBuffer::new(drv.context(1).unwrap(), 1 << 20).unwrap();
    a.copy_from_host(0, &pattern(1 << 20, 8)).unwrap();
    let (_ah, ak) = side.reg(&a);
    let (bh, _) = side.reg(&b);
    let ak = side.rkey(&ak);
    side.op(false, &bh, b.ptr() as usize, 1 << 20, a.ptr(), &ak)
        .unwrap();
    same(
        "get GPU 0 -> GPU 1",
        &read_dev(&b, 0, 1 << 20),
        &pattern(1 << 20, 8),
    );
    b.copy_from_host(0, &pattern(1 << 20, 9)).unwrap();
    side.op(true, &bh, b.ptr() as usize, 1 << 20, a.ptr(), &ak)
        .unwrap();
    same(
        "put GPU 1 -> GPU 0",
        &read_dev(&a, 0, 1 << 20),
        &pattern(1 << 20, 9),
    );
    assert_eq!(
        side.md.cache_stats().opens,
        0,
        "no IPC mapping for our own memory"
    );
    println!("cuda_ipc within one process, GPU 0 <-> GPU 1: ok");
}

/// The component as discovery sees it.
#[test]
fn component_is_available_with_a_gpu() {
    let Some(_) = gpus() else { return };
    match CudaIpcComponent.query(&config()) {
        rucx_uct::Availability::Available(m) => assert_eq!(m, vec!["cuda_ipc"]),
        other => panic!("{other:?}"),
    }
}

/// The check that makes a kept GPU registration reusable (`mem_still_valid`) asks the driver
/// one attribute in one call, and says no once the allocation was freed, whatever now lies at
/// the same address (a new allocation there has another buffer id).
#[test]
fn still_valid_is_one_driver_call_and_sees_a_reallocation() {
    use rucx_cuda::calls::{self, Call};
    let Some(_) = gpus() else { return };
    let ctx = driver().unwrap().context(0).unwrap();
    let side = Side::open();
    let d = DeviceBuffer::new(ctx, 1 << 20).unwrap();
    let region = MemRegion {
        addr: d.ptr() as usize + 64,
        len: 8,
        mem_type: MemoryType::Cuda,
        device: Some(0),
    };
    // SAFETY: `d` outlives the handle's use (it is only checked after `d` is freed).
    let h = unsafe { side.md.mem_reg(region) }.unwrap();
    let before = calls::snapshot();
    for _ in 0..100 {
        assert!(side.md.mem_still_valid(&h));
    }
    let c = calls::snapshot().since(&before);
    println!("100 validity checks: {}", c.per_unit_line(100));
    assert_eq!(c.calls(Call::cuPointerGetAttributes), 100);
    assert_eq!(c.total_calls(), 100, "{}", c.per_unit_line(1));
    let addr = d.ptr();
    drop(d);
    assert!(!side.md.mem_still_valid(&h), "freed allocation still valid");
    // The driver often hands the same address out again: a new allocation there is another.
    let again: Vec<DeviceBuffer> = (0..4)
        .map(|_| DeviceBuffer::new(ctx, 1 << 20).unwrap())
        .collect();
    let reused = again.iter().any(|b| b.ptr() == addr);
    assert!(
        !side.md.mem_still_valid(&h),
        "reallocated (address reused: {reused})"
    );
    println!("stale registration refused (address reused: {reused})");
}
