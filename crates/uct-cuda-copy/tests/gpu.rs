//! GPU tests of `cuda_copy`: run only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver
//! and a GPU; elsewhere each test prints why it skipped and passes.
//!
//! On a GPU machine: `RUCX_GPU_TESTS=1 <this test binary> --test-threads=1 --nocapture`
//! (`cargo xtask gpu-pack` puts it at `.device/rucx-uct-cuda-copy-gpu`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rucx_cuda::{ManagedBuffer, PtrKind, classify, driver};
use rucx_ucs::{Config, Error, MemoryType, RegErrorKind};
use rucx_uct::{
    Component, Endpoint, EpParams, Event, Iface, IfaceParams, Iov, MemHandle, MemRegion,
    MemoryDomain, OpStatus, RemoteKey,
};
use rucx_uct_cuda_copy::{Allocation, CudaCopyComponent, CudaCopyMd, StagingPool};

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

fn config(extra: &[(&str, &str)]) -> Config {
    let mut c = Config::new(&[rucx_uct::CONFIG, rucx_uct_cuda_copy::CONFIG]).unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    c
}

struct Setup {
    md: Arc<CudaCopyMd>,
    iface: Box<dyn Iface>,
    ep: Box<dyn Endpoint>,
    done: BTreeMap<u64, rucx_ucs::Result<()>>,
    next: u64,
}

impl Setup {
    fn new(cfg: &Config) -> Setup {
        let md = Arc::new(CudaCopyMd::open(cfg).unwrap());
        let tl = md.tl_resources().remove(0);
        let mut iface = md.open_iface(&tl, &IfaceParams { config: cfg }).unwrap();
        let ep = iface
            .create_ep(&EpParams {
                dev_addr: iface.device_address(),
                iface_addr: iface.iface_address(),
                user_id: 0,
            })
            .unwrap();
        Setup {
            md,
            iface,
            ep,
            done: BTreeMap::new(),
            next: 0,
        }
    }

    fn token(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn progress(&mut self) {
        let done = &mut self.done;
        self.iface.progress(&mut |ev| match ev {
            Event::Completion { token, result } => {
                assert!(
                    done.insert(token, result).is_none(),
                    "token {token} completed twice"
                );
            }
            other => panic!("unexpected event {other:?}"),
        });
    }

    fn wait(&mut self, token: u64, st: OpStatus) {
        if st == OpStatus::Done {
            return;
        }
        let t = Instant::now();
        loop {
            if let Some(r) = self.done.remove(&token) {
                r.unwrap();
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "token {token} never completed"
            );
            self.progress();
        }
    }

    fn reg(&self, r: MemRegion) -> (MemHandle, RemoteKey) {
        // SAFETY: every caller keeps the memory alive longer than the handle and the key.
        let memh = unsafe { self.md.mem_reg(r) }.unwrap();
        let rkey = self
            .md
            .rkey_unpack(&self.md.mkey_pack(&memh).unwrap())
            .unwrap();
        (memh, rkey)
    }

    fn put(&mut self, local: &MemHandle, addr: usize, len: usize, remote: u64, rkey: &RemoteKey) {
        let t = self.token();
        let iov = [Iov {
            addr,
            len,
            memh: local,
        }];
        let st = self.ep.put_zcopy(&iov, remote, rkey, t).unwrap();
        self.wait(t, st);
    }

    fn get(&mut self, local: &MemHandle, addr: usize, len: usize, remote: u64, rkey: &RemoteKey) {
        let t = self.token();
        let iov = [Iov {
            addr,
            len,
            memh: local,
        }];
        let st = self.ep.get_zcopy(&iov, remote, rkey, t).unwrap();
        self.wait(t, st);
    }
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

fn device_bytes(a: &Allocation, off: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    match a {
        Allocation::Device(b) => b.copy_to_host(off, &mut out).unwrap(),
        Allocation::PinnedHost(b) => out.copy_from_slice(&b.as_slice()[off..off + len]),
    }
    out
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[track_caller]
fn same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(
        got == want,
        "{what}: first wrong byte at {:?}",
        first_diff(got, want)
    );
}

/// put/get zero-copy at 1 B, 4 KiB + 1, 1 MiB and 64 MiB, host <-> device in both directions,
/// with the local side and the remote side each host and device; every byte checked.
#[test]
fn put_get_host_device_both_directions() {
    let Some(_) = gpus() else { return };
    let mut s = Setup::new(&config(&[]));
    for (i, n) in [1usize, 4097, 1 << 20, 64 << 20].into_iter().enumerate() {
        let off = 3usize;
        let mut dev = s.md.alloc(MemoryType::Cuda, Some(0), n + 64).unwrap();
        let (dev_h, dev_k) = s.reg(dev.region());
        let base = dev.addr() as u64;

        // Pageable host memory, page-locked by the registration.
        let src = pattern(n, i as u64 + 1);
        let (src_h, src_k) = s.reg(MemRegion::of_slice(&src));
        // Small heap blocks may share pages with other registrations; large ones are mmaps.
        let own_pages = n >= 1 << 20;
        if own_pages {
            assert_eq!(
                classify(src.as_ptr() as usize, n).unwrap().kind,
                PtrKind::HostPinned
            );
        }

        // host -> device, put (local host, remote device).
        s.put(&src_h, src.as_ptr() as usize, n, base + off as u64, &dev_k);
        same(
            &format!("put host->device {n} B"),
            &device_bytes(&dev, off, n),
            &src,
        );

        // device -> host, get (local host, remote device).
        let dst = vec![0u8; n];
        let (dst_h, dst_k) = s.reg(MemRegion::of_slice(&dst));
        s.get(&dst_h, dst.as_ptr() as usize, n, base + off as u64, &dev_k);
        same(&format!("get device->host {n} B"), &dst, &src);

        // device -> host, put (local device, remote host).
        let dst2 = vec![0u8; n + 8];
        let (_dst2_h, dst2_k) = s.reg(MemRegion::of_slice(&dst2));
        s.put(
            &dev_h,
            dev.addr() + off,
            n,
            dst2.as_ptr() as u64 + 5,
            &dst2_k,
        );
        same(&format!("put device->host {n} B"), &dst2[5..5 + n], &src);
        assert!(
            dst2[..5].iter().chain(&dst2[5 + n..]).all(|b| *b == 0),
            "wrote outside"
        );

        // host -> device, get (local device, remote host), into a cleared device buffer.
        if let Allocation::Device(b) = &mut dev {
            b.fill(0).unwrap();
        }
        s.get(&dev_h, dev.addr() + off, n, src.as_ptr() as u64, &src_k);
        same(
            &format!("get host->device {n} B"),
            &device_bytes(&dev, off, n),
            &src,
        );
        assert!(
            device_bytes(&dev, 0, off).iter().all(|b| *b == 0),
            "wrote before"
        );

        drop((dst_h, dst_k, src_h, src_k));
        if own_pages {
            assert_eq!(
                classify(src.as_ptr() as usize, n).unwrap().kind,
                PtrKind::HostPageable,
                "dropping the handle unpins"
            );
        }
        println!("cuda_copy put/get {n} B host<->device: ok");
    }
}

/// Pinned host memory allocated by the domain, put_short, and host memory registered twice.
#[test]
fn pinned_alloc_put_short_and_double_registration() {
    let Some(_) = gpus() else { return };
    let mut s = Setup::new(&config(&[]));
    let host = s.md.alloc(MemoryType::Host, None, 1 << 16).unwrap();
    assert!(matches!(host, Allocation::PinnedHost(_)));
    assert_eq!(
        classify(host.addr(), host.len()).unwrap().kind,
        PtrKind::HostPinned
    );
    let dev = s.md.alloc(MemoryType::Cuda, Some(0), 1 << 16).unwrap();
    let (_dh, dk) = s.reg(dev.region());
    let data = pattern(8192, 77);
    s.ep.put_short(&data, dev.addr() as u64 + 100, &dk).unwrap();
    same("put_short", &device_bytes(&dev, 100, data.len()), &data);
    let e =
        s.ep.put_short(&vec![0; 8193], dev.addr() as u64, &dk)
            .unwrap_err();
    assert!(matches!(e, Error::InvalidParam(_)), "{e:?}");

    // Already pinned memory: the handle leaves the pinning alone.
    let (hh, hk) = s.reg(host.region());
    s.get(&hh, host.addr(), 8192, dev.addr() as u64 + 100, &dk);
    same("get into pinned", &device_bytes(&host, 0, 8192), &data);
    drop((hh, hk));
    assert_eq!(classify(host.addr(), 1).unwrap().kind, PtrKind::HostPinned);

    // The same pageable buffer registered twice, then released in either order.
    let v = vec![1u8; 10_000];
    let (a, _ak) = s.reg(MemRegion::of_slice(&v));
    let (b, _bk) = s.reg(MemRegion::of_slice(&v));
    drop(a);
    s.put(&b, v.as_ptr() as usize, v.len(), dev.addr() as u64, &dk);
    same(
        "after double registration",
        &device_bytes(&dev, 0, v.len()),
        &v,
    );

    // A region whose declared type is wrong is refused with a typed error.
    let wrong = MemRegion {
        mem_type: MemoryType::Host,
        ..dev.region()
    };
    // SAFETY: refused before use.
    let e = unsafe { s.md.mem_reg(wrong) }.unwrap_err();
    assert!(e.as_registration().is_some(), "{e:?}");
    let unknown = MemRegion {
        mem_type: MemoryType::Unknown,
        ..dev.region()
    };
    // SAFETY: refused before use.
    let e = unsafe { s.md.mem_reg(unknown) }.unwrap_err();
    assert_eq!(
        e.as_registration().unwrap().kind,
        RegErrorKind::UnsupportedMemoryType
    );
    println!("pinned alloc, put_short, double registration: ok");
}

/// Many operations in flight at once, each completing exactly once, and a flush after them;
/// the in-flight bound answers "no resources".
#[test]
fn many_in_flight_flush_and_bound() {
    let Some(_) = gpus() else { return };
    let mut s = Setup::new(&config(&[]));
    let chunk = 256 << 10;
    let count = 32;
    let dev =
        s.md.alloc(MemoryType::Cuda, Some(0), chunk * count)
            .unwrap();
    let (_dh, dk) = s.reg(dev.region());
    let src = pattern(chunk * count, 5);
    let (sh, _sk) = s.reg(MemRegion::of_slice(&src));
    let mut tokens = Vec::new();
    for i in 0..count {
        let t = s.token();
        let iov = [Iov {
            addr: src.as_ptr() as usize + i * chunk,
            len: chunk,
            memh: &sh,
        }];
        let st =
            s.ep.put_zcopy(&iov, dev.addr() as u64 + (i * chunk) as u64, &dk, t)
                .unwrap();
        assert_eq!(st, OpStatus::InProgress);
        tokens.push(t);
    }
    let ft = s.token();
    let st = s.ep.flush(ft).unwrap();
    s.wait(ft, st);
    // The flush completed after every earlier operation.
    for t in &tokens {
        assert!(
            s.done.remove(t).is_some_and(|r| r.is_ok()),
            "token {t} missing after flush"
        );
    }
    same("32 puts in flight", &device_bytes(&dev, 0, src.len()), &src);
    assert_eq!(s.ep.flush(s.next + 1).unwrap(), OpStatus::Done);

    let mut s = Setup::new(&config(&[("CUDA_COPY_MAX_INFLIGHT", "2")]));
    let (sh, _) = s.reg(MemRegion::of_slice(&src));
    let (_dh2, dk2) = s.reg(dev.region());
    let iov = [Iov::whole(&sh)];
    let a = s.ep.put_zcopy(&iov, dev.addr() as u64, &dk2, 1).unwrap();
    let b = s.ep.put_zcopy(&iov, dev.addr() as u64, &dk2, 2).unwrap();
    let third = s.ep.put_zcopy(&iov, dev.addr() as u64, &dk2, 3);
    assert!(matches!(third, Err(ref e) if e.is_retryable()), "{third:?}");
    s.wait(1, a);
    s.wait(2, b);
    println!("32 copies in flight, flush, in-flight bound: ok");
}

/// The staging pool: configured size and count, never more, fragments usable in copies.
#[test]
fn staging_pool() {
    let Some(_) = gpus() else { return };
    let cfg = config(&[
        ("CUDA_COPY_FRAG_SIZE", "64K"),
        ("CUDA_COPY_FRAG_COUNT", "4"),
    ]);
    let mut s = Setup::new(&cfg);
    let pool: Arc<StagingPool> = s.md.staging_pool().unwrap();
    assert!(
        Arc::ptr_eq(&pool, &s.md.staging_pool().unwrap()),
        "one pool per domain"
    );
    assert!(pool.is_pinned());
    assert_eq!((pool.capacity(), pool.frag_size()), (4, 64 << 10));
    assert_eq!(
        classify(pool.region().addr, 1).unwrap().kind,
        PtrKind::HostPinned
    );
    let mut frags: Vec<_> = (0..4).map(|_| pool.get().unwrap()).collect();
    assert!(pool.get().is_none());

    let dev = s.md.alloc(MemoryType::Cuda, Some(0), 64 << 10).unwrap();
    let (dh, dk) = s.reg(dev.region());
    let data = pattern(64 << 10, 9);
    frags[1].as_mut_slice().copy_from_slice(&data);
    let f = &frags[1];
    s.put(f.memh(), f.addr(), f.len(), dev.addr() as u64, &dk);
    // Device -> another fragment (the device buffer is the "remote" side of a get).
    let f3 = &frags[3];
    s.get(f3.memh(), f3.addr(), f3.len(), dev.addr() as u64, &dk);
    same("fragment round trip", frags[3].as_slice(), &data);
    // And the other way round: device is local, the fragment remote.
    let fk =
        s.md.rkey_unpack(&s.md.mkey_pack(frags[0].memh()).unwrap())
            .unwrap();
    s.put(&dh, dev.addr(), 4096, frags[0].addr() as u64, &fk);
    same(
        "device into fragment",
        &frags[0].as_slice()[..4096],
        &data[..4096],
    );
    frags.pop();
    assert_eq!(pool.available(), 1);
    assert!(pool.get().is_some());
    println!("staging pool of 4 x 64 KiB: ok");
}

/// Pointer detection through the domain.
#[test]
fn detect_mem_type() {
    let Some(_) = gpus() else { return };
    let s = Setup::new(&config(&[]));
    let dev = s.md.alloc(MemoryType::Cuda, Some(0), 4096).unwrap();
    let r = s.md.detect_mem_type(dev.addr() + 16, 32).unwrap().unwrap();
    assert_eq!((r.mem_type, r.device), (MemoryType::Cuda, Some(0)));
    let ctx = driver().unwrap().context(0).unwrap();
    let mut m = ManagedBuffer::new(ctx, 4096).unwrap();
    let r =
        s.md.detect_mem_type(m.ptr() as usize, 4096)
            .unwrap()
            .unwrap();
    assert_eq!(r.mem_type, MemoryType::CudaManaged);
    let v = [0u8; 64];
    assert_eq!(s.md.detect_mem_type(v.as_ptr() as usize, 64).unwrap(), None);
    let pinned = s.md.alloc(MemoryType::Host, None, 4096).unwrap();
    assert_eq!(s.md.detect_mem_type(pinned.addr(), 64).unwrap(), None);
    assert!(matches!(
        s.md.alloc(MemoryType::CudaManaged, None, 64),
        Err(Error::Unsupported { .. })
    ));
    // Managed memory can be a copy source.
    m.copy_from_host(0, &pattern(4096, 3)).unwrap();
    let mut s = s;
    let (mh, _) = s.reg(r);
    let (_dh, dk) = s.reg(dev.region());
    s.put(&mh, m.ptr() as usize, 4096, dev.addr() as u64, &dk);
    same(
        "managed -> device",
        &device_bytes(&dev, 0, 4096),
        &pattern(4096, 3),
    );
    println!("detection of device, managed, pageable and pinned memory: ok");
}

/// Device -> device between two GPUs of this process (when there are two).
#[test]
fn device_to_device_across_gpus() {
    let Some(n) = gpus() else { return };
    if n < 2 {
        eprintln!("skipped: needs 2 GPUs, {n} visible");
        return;
    }
    let mut s = Setup::new(&config(&[]));
    let mut a = s.md.alloc(MemoryType::Cuda, Some(0), 1 << 20).unwrap();
    let b = s.md.alloc(MemoryType::Cuda, Some(1), 1 << 20).unwrap();
    let data = pattern(1 << 20, 11);
    if let Allocation::Device(d) = &mut a {
        d.copy_from_host(0, &data).unwrap();
    }
    let (ah, _) = s.reg(a.region());
    let (_bh, bk) = s.reg(b.region());
    s.put(&ah, a.addr(), 1 << 20, b.addr() as u64, &bk);
    same("GPU 0 -> GPU 1", &device_bytes(&b, 0, 1 << 20), &data);
    println!("device -> device across GPUs: ok");
}

/// The component as discovery sees it.
#[test]
fn component_is_available_with_a_gpu() {
    let Some(_) = gpus() else { return };
    let cfg = config(&[]);
    match CudaCopyComponent.query(&cfg) {
        rucx_uct::Availability::Available(mds) => assert_eq!(mds, vec!["cuda_cpy"]),
        other => panic!("{other:?}"),
    }
    let md = CudaCopyComponent.open_md("cuda_cpy", &cfg).unwrap();
    assert_eq!(md.name(), "cuda_cpy");
}

/// Post each of `copies` alone to `engine` on lane `key` (its token: its index), then a flush
/// (token 99); wait (at most 20 s) for every one of them that was in progress, each to succeed,
/// and check that the flush reported last.
///
/// # Safety
/// Every copy's source and destination stay valid, and nothing else writes them, until this
/// returns.
unsafe fn post_each_then_flush(
    engine: &rucx_uct_cuda_copy::engine::CopyEngine,
    key: rucx_uct_cuda_copy::engine::LaneKey,
    copies: &[rucx_uct_cuda_copy::engine::CopyOp],
) {
    let mut pending = Vec::new();
    for (t, c) in copies.iter().enumerate() {
        // SAFETY: the caller keeps both ranges valid until this returns, which waits for the
        // copies below.
        let st = unsafe { engine.post(key, std::slice::from_ref(c), t as u64, vec![]) }.unwrap();
        if st == OpStatus::InProgress {
            pending.push(t as u64);
        }
    }
    let ft = 99;
    if engine.flush(ft).unwrap() == OpStatus::InProgress {
        pending.push(ft);
    }
    let mut order = Vec::new();
    let t0 = Instant::now();
    while order.len() < pending.len() {
        engine.progress(&mut |ev| {
            if let Event::Completion { token, result } = ev {
                result.unwrap();
                order.push(token);
            }
        });
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "copies hang: {order:?}"
        );
    }
    assert_eq!(
        order.last(),
        Some(&ft),
        "the flush after every copy: {order:?}"
    );
}

/// Copies out of pageable host memory into the GPU through the engine's helper threads: a
/// 9 MiB + 13 B copy in chunks across 3 threads, a second one behind it, and a flush that
/// reports after both; every byte checked, also for a copy under the staging size (left to
/// the driver) and with the helper threads off.
#[test]
fn pageable_host_to_device_through_helper_threads() {
    use rucx_cuda::{DeviceBuffer, Stream, memcpy_async};
    use rucx_uct_cuda_copy::engine::{CopyEngine, CopyOp, LaneKey};
    let Some(_) = gpus() else { return };
    let ctx = driver().unwrap().context(0).unwrap();
    for threads in [3, 0] {
        let engine = CopyEngine::new(16).with_pageable_threads(threads);
        let len = (9 << 20) + 13;
        let a = pattern(len, 41);
        let b = pattern(len, 42);
        let small = pattern(100_000, 43);
        let dev = DeviceBuffer::new(ctx, 2 * len + small.len()).unwrap();
        let key = LaneKey { device: 0, lane: 0 };
        let ops = [
            (dev.ptr(), &a),
            (dev.ptr() + len as u64, &b),
            (dev.ptr() + 2 * len as u64, &small),
        ];
        let copies: Vec<CopyOp> = ops
            .iter()
            .map(|(dst, src)| CopyOp {
                dst: *dst,
                src: src.as_ptr() as u64,
                len: src.len(),
            })
            .collect();
        // SAFETY: the source vectors and the device buffer outlive the copies (waited for
        // inside).
        unsafe { post_each_then_flush(&engine, key, &copies) };
        let mut back = vec![0u8; 2 * len + small.len()];
        let s = Stream::new(ctx).unwrap();
        // SAFETY: both buffers live, synchronized below.
        unsafe { memcpy_async(back.as_mut_ptr() as u64, dev.ptr(), back.len(), &s) }.unwrap();
        s.synchronize().unwrap();
        same(&format!("first, {threads} threads"), &back[..len], &a);
        same(
            &format!("second, {threads} threads"),
            &back[len..2 * len],
            &b,
        );
        same(
            &format!("small, {threads} threads"),
            &back[2 * len..],
            &small,
        );
        drop(engine);
    }
    println!("pageable host -> device through helper threads: ok");
}

/// Copies out of the GPU into pageable host memory through the engine's helper threads: a
/// 9 MiB + 13 B copy in chunks across 3 threads, a second one behind it into the same host
/// buffer's next bytes, one under the staging size (left to the driver), and a flush that
/// reports after all; every byte and the guard bytes around them checked, also with the
/// helper threads off.
#[test]
fn device_to_pageable_host_through_helper_threads() {
    use rucx_cuda::{DeviceBuffer, Stream, memcpy_async};
    use rucx_uct_cuda_copy::engine::{CopyEngine, CopyOp, LaneKey};
    let Some(_) = gpus() else { return };
    let ctx = driver().unwrap().context(0).unwrap();
    for threads in [3, 0] {
        let engine = CopyEngine::new(16).with_pageable_threads(threads);
        let len = (9 << 20) + 13;
        let small = 100_000;
        let total = 2 * len + small;
        let src = pattern(total, 51);
        let dev = DeviceBuffer::new(ctx, total).unwrap();
        let s = Stream::new(ctx).unwrap();
        // SAFETY: both buffers live, synchronized below.
        unsafe { memcpy_async(dev.ptr(), src.as_ptr() as u64, total, &s) }.unwrap();
        s.synchronize().unwrap();
        let guard = 4096;
        let mut host = vec![0xA5u8; total + 2 * guard];
        let at = host.as_mut_ptr() as u64 + guard as u64;
        let key = LaneKey { device: 0, lane: 0 };
        let ops = [(0usize, len), (len, len), (2 * len, small)];
        let copies: Vec<CopyOp> = ops
            .iter()
            .map(|(off, n)| CopyOp {
                dst: at + *off as u64,
                src: dev.ptr() + *off as u64,
                len: *n,
            })
            .collect();
        // SAFETY: the host vector and the device buffer outlive the copies (waited for inside);
        // nothing touches the host bytes meanwhile.
        unsafe { post_each_then_flush(&engine, key, &copies) };
        same(
            &format!("device -> pageable, {threads} threads"),
            &host[guard..guard + total],
            &src,
        );
        assert!(
            host[..guard]
                .iter()
                .chain(&host[guard + total..])
                .all(|&b| b == 0xA5),
            "bytes around the destination written ({threads} threads)"
        );
        drop(engine);
    }
    println!("device -> pageable host through helper threads: ok");
}

/// An operation whose second copy cannot be queued: the post returns the error only after its
/// first copy (256 MiB from the GPU into pinned host memory, some milliseconds) finished, so a
/// caller that fails its request and hands the buffers back at once hands back memory nothing
/// touches any more. Nothing is reported for its token.
#[test]
fn a_post_failing_part_way_returns_after_its_queued_copies() {
    use rucx_cuda::{DeviceBuffer, PinnedHostBuffer, Stream, memcpy_async};
    use rucx_uct_cuda_copy::engine::{CopyEngine, CopyOp, LaneKey};
    let Some(_) = gpus() else { return };
    let ctx = driver().unwrap().context(0).unwrap();
    let len = 256 << 20;
    let want = pattern(len, 61);
    let dev = DeviceBuffer::new(ctx, len).unwrap();
    let s = Stream::new(ctx).unwrap();
    // SAFETY: both buffers live, synchronized below.
    unsafe { memcpy_async(dev.ptr(), want.as_ptr() as u64, len, &s) }.unwrap();
    s.synchronize().unwrap();
    let mut host = PinnedHostBuffer::new(ctx, len).unwrap();
    let mut spare = PinnedHostBuffer::new(ctx, 4096).unwrap();
    host.as_mut_slice().fill(0);
    spare.as_mut_slice().fill(0);
    let engine = CopyEngine::new(16);
    let key = LaneKey { device: 0, lane: 1 };
    let copies = [
        CopyOp {
            dst: host.ptr(),
            src: dev.ptr(),
            len,
        },
        CopyOp {
            dst: spare.ptr(),
            src: dev.ptr(),
            len: 4096,
        },
    ];
    engine.inject_copy_failure(1);
    // SAFETY: the buffers outlive the call, and the post returns after its copies.
    let r = unsafe { engine.post(key, &copies, 7, vec![]) };
    assert!(r.is_err(), "{r:?}");
    // Read at once: the first copy has finished.
    same(
        "the first copy, when the post returned",
        host.as_slice(),
        &want,
    );
    assert!(spare.as_slice().iter().all(|b| *b == 0));
    assert_eq!(engine.inflight(), 0);
    let mut seen = Vec::new();
    engine.progress(&mut |ev| seen.push(format!("{ev:?}")));
    assert!(seen.is_empty(), "{seen:?}");
    println!("a post failing part-way returns after its queued copies: ok");
}

/// Small device-to-device copies run as the copy kernel and end through the lane's completion
/// word: every size around the kernel's units (1, 8 and 16 bytes) and its limit, at aligned and
/// odd offsets, lands exactly (the bytes around the destination untouched), with one kernel
/// launch and no copy call each, no event recorded or queried; one byte over the limit is a
/// copy call; a copy with a host end is a copy call with a completion word; 200 kernel copies
/// in flight at once end in order; with both off, copies and events as before.
#[test]
fn small_device_copies_run_as_a_kernel_and_end_through_completion_words() {
    use rucx_cuda::calls::{self, Call};
    use rucx_cuda::{CopyKernel, DeviceBuffer, PinnedHostBuffer, SmallCopies};
    use rucx_uct_cuda_copy::engine::{CopyEngine, CopyOp, LaneKey};
    let Some(_) = gpus() else { return };
    let ctx = driver().unwrap().context(0).unwrap();
    CopyKernel::load(ctx).expect("the copy kernel loads on this GPU");
    let max = 64 << 10;
    let cap = 256 << 10;
    let src_bytes = pattern(cap, 71);
    let src = DeviceBuffer::new(ctx, cap).unwrap();
    let mut dst = DeviceBuffer::new(ctx, cap).unwrap();
    // SAFETY: live buffers of `cap` bytes; synchronous copy.
    unsafe { rucx_cuda::memcpy(ctx, src.ptr(), src_bytes.as_ptr() as u64, cap) }.unwrap();
    // The engine takes a kernel only for ranges the pointer cache knows (as registration does).
    classify(src.ptr() as usize, cap).unwrap();
    classify(dst.ptr() as usize, cap).unwrap();
    let device_bytes_of = |b: &DeviceBuffer, off: usize, len: usize| {
        let mut out = vec![0u8; len];
        b.copy_to_host(off, &mut out).unwrap();
        out
    };
    let wait = |engine: &CopyEngine, want: &[u64]| {
        let mut got = Vec::new();
        let t0 = Instant::now();
        while got.len() < want.len() {
            engine.progress(&mut |ev| {
                if let Event::Completion { token, result } = ev {
                    result.unwrap();
                    got.push(token);
                }
            });
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "copies hang: {got:?}"
            );
        }
        assert_eq!(got, want, "completions in order");
    };
    let words = SmallCopies {
        kernel_max: max,
        completion_words: true,
    };
    for small in [words, SmallCopies::OFF] {
        let engine = CopyEngine::new(256).with_small_copies(small);
        let key = LaneKey { device: 0, lane: 3 };
        for len in [
            1usize,
            7,
            8,
            9,
            15,
            16,
            17,
            4095,
            4096,
            max - 1,
            max,
            max + 1,
        ] {
            for (so, doff) in [(0usize, 0usize), (1, 3), (8, 16), (16, 8), (5, 5)] {
                let guard = 64;
                dst.fill(0xA5).unwrap();
                let c = CopyOp {
                    dst: dst.ptr() + (guard + doff) as u64,
                    src: src.ptr() + so as u64,
                    len,
                };
                let before = calls::snapshot();
                // SAFETY: both ranges lie inside the live buffers; waited for below.
                let st = unsafe { engine.post(key, &[c], 1, vec![]) }.unwrap();
                assert_eq!(st, OpStatus::InProgress);
                wait(&engine, &[1]);
                let d = calls::snapshot().since(&before);
                let kernel = small.kernel_max >= len;
                let what = format!("{len} B at +{so} -> +{doff}, {small:?}");
                assert_eq!(d.calls(Call::cuLaunchKernel), kernel as u64, "{what}");
                assert_eq!(d.calls(Call::cuMemcpyAsync), !kernel as u64, "{what}");
                if small.completion_words {
                    assert_eq!(d.calls(Call::cuEventRecord), 0, "{what}");
                    assert_eq!(d.calls(Call::cuEventQuery), 0, "{what}");
                    assert_eq!(
                        d.calls(Call::cuStreamWriteValue64_v2),
                        !kernel as u64,
                        "{what}"
                    );
                } else {
                    assert_eq!(d.calls(Call::cuEventRecord), 1, "{what}");
                    assert_eq!(d.calls(Call::cuStreamWriteValue64_v2), 0, "{what}");
                }
                let got = device_bytes_of(&dst, 0, guard + doff + len + guard);
                same(
                    &what,
                    &got[guard + doff..guard + doff + len],
                    &src_bytes[so..so + len],
                );
                assert!(
                    got[..guard + doff]
                        .iter()
                        .chain(&got[guard + doff + len..])
                        .all(|&b| b == 0xA5),
                    "bytes around the destination written: {what}"
                );
            }
        }
        // A host end: a copy call, never the kernel.
        let mut host = PinnedHostBuffer::new(ctx, 4096).unwrap();
        host.as_mut_slice().fill(0);
        let before = calls::snapshot();
        let c = CopyOp {
            dst: host.ptr(),
            src: src.ptr(),
            len: 4096,
        };
        // SAFETY: both live; waited for below.
        unsafe { engine.post(key, &[c], 2, vec![]) }.unwrap();
        wait(&engine, &[2]);
        let d = calls::snapshot().since(&before);
        assert_eq!(d.calls(Call::cuLaunchKernel), 0);
        assert_eq!(d.calls(Call::cuMemcpyAsync), 1);
        same("device -> pinned host", host.as_slice(), &src_bytes[..4096]);
        // Many in flight at once, each its own 1 KiB slice.
        let n = 200usize;
        dst.fill(0).unwrap();
        let tokens: Vec<u64> = (0..n as u64).map(|t| 100 + t).collect();
        for (i, t) in tokens.iter().enumerate() {
            let c = CopyOp {
                dst: dst.ptr() + (i * 1024) as u64,
                src: src.ptr() + ((n - 1 - i) * 1024) as u64,
                len: 1024,
            };
            // SAFETY: distinct live slices; waited for below.
            unsafe { engine.post(key, &[c], *t, vec![]) }.unwrap();
        }
        wait(&engine, &tokens);
        let got = device_bytes_of(&dst, 0, n * 1024);
        for i in 0..n {
            let j = n - 1 - i;
            same(
                &format!("slice {i} of {n} in flight ({small:?})"),
                &got[i * 1024..(i + 1) * 1024],
                &src_bytes[j * 1024..(j + 1) * 1024],
            );
        }
        drop(engine);
    }
    println!("small device copies as a kernel, completion words: ok");
}
