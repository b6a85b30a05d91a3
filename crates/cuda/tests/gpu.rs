//! GPU tests: run only with `RUCX_GPU_TESTS=1` on a machine with a CUDA driver and a GPU.
//!
//! Elsewhere each test prints why it skipped and passes. On a GPU machine run with
//! `RUCX_GPU_TESTS=1 <test binary> --test-threads=1 --nocapture` (`cargo xtask gpu-pack` puts
//! it at `.device/rucx-cuda-gpu`).

use std::ffi::c_void;

use rucx_cuda::pointer::{classify_uncached, global_cache};
use rucx_cuda::{
    DeviceBuffer, Event, HostRegistration, ManagedBuffer, PinnedHostBuffer, PoolBuffer,
    PrimaryContext, PtrKind, Stream, classify, driver, memcpy_async, reg_error_kind, sys,
};
use rucx_ucs::{Error, RegErrorKind};

/// The context of GPU `n`, or `None` (with a printed reason) when GPU tests are off.
fn gpu(n: u32) -> Option<&'static PrimaryContext> {
    if std::env::var("RUCX_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set RUCX_GPU_TESTS=1 to run GPU tests");
        return None;
    }
    let drv = match driver() {
        Ok(d) => d,
        Err(e) => panic!("RUCX_GPU_TESTS=1 but the CUDA driver is unavailable: {e}"),
    };
    if n >= drv.device_count() {
        eprintln!("skipped: needs GPU {n}, {} visible", drv.device_count());
        return None;
    }
    Some(drv.context(n).expect("primary context"))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// Try to export `ptr` through a legacy IPC handle.
fn ipc_export(ctx: &PrimaryContext, ptr: u64) -> sys::CUresult {
    ctx.bind().unwrap();
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: valid out-pointer; `ptr` is a live allocation of the test.
    unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) }
}

/// Try to export `ptr..ptr+len` as a dma-buf; closes the fd. `Ok(())` or the CUDA result.
fn dmabuf_export(ctx: &PrimaryContext, ptr: u64, len: usize) -> Result<(), sys::CUresult> {
    let drv = driver().unwrap();
    if !drv.has_dmabuf_export() {
        return Err(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    ctx.bind().unwrap();
    // The range must be a whole number of host pages.
    let len = (len & !4095).max(4096);
    let mut fd: i32 = -1;
    // SAFETY: `fd` is a valid out-pointer for an int file descriptor; the range is a live
    // allocation; flags 0.
    let r = unsafe {
        sys::cuMemGetHandleForAddressRange(
            &mut fd as *mut i32 as *mut c_void,
            ptr,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the driver handed us this descriptor; we own and close it once.
        unsafe { libc::close(fd) };
        Ok(())
    } else {
        Err(r)
    }
}

#[test]
fn driver_and_devices() {
    let Some(ctx) = gpu(0) else { return };
    let drv = driver().unwrap();
    println!(
        "driver API {} ({} device(s))",
        drv.version_string(),
        drv.device_count()
    );
    for d in drv.devices() {
        println!("  {d:?}");
        assert!(!d.name.is_empty());
        assert!(d.total_mem > 0);
        assert_eq!(d.pci_bus_id.len(), 12, "{}", d.pci_bus_id);
    }
    ctx.bind().unwrap();
    let e = drv.device(drv.device_count()).unwrap_err();
    assert!(matches!(e, Error::InvalidParam(_)), "{e}");
    // A failing call is a typed error naming call, device and CUDA error.
    let e = DeviceBuffer::new(ctx, usize::MAX / 2)
        .unwrap_err()
        .to_string();
    println!("huge alloc: {e}");
    assert!(
        e.contains("GPU 0 (") && e.contains("cuMemAlloc(") && e.contains("CUDA_ERROR_"),
        "{e}"
    );
}

#[test]
fn classify_cumemalloc() {
    let Some(ctx) = gpu(0) else { return };
    let len = 1 << 20;
    let mut buf = DeviceBuffer::new(ctx, len).unwrap();
    let i = classify(buf.ptr() as usize + 4096, 100).unwrap();
    println!("cuMemAlloc: {i}");
    assert_eq!(i.kind, PtrKind::Cuda);
    assert_eq!(i.device, Some(0));
    assert_eq!(i.base, buf.ptr() as usize);
    assert!(i.size >= len);
    assert!(!i.from_pool);
    assert!(i.ipc_exportable);
    assert_ne!(i.buffer_id, 0);
    assert_eq!(ipc_export(ctx, buf.ptr()), sys::CUresult::CUDA_SUCCESS);
    let dm = dmabuf_export(ctx, buf.ptr(), len);
    println!(
        "  dma-buf export: {dm:?} (classified exportable: {})",
        i.dmabuf_exportable
    );
    // Second time from the cache; a range past the end is refused.
    assert_eq!(
        global_cache().unwrap().lookup(buf.ptr() as usize, len),
        Some(i)
    );
    let e = classify_uncached(buf.ptr() as usize + len - 8, 4096).unwrap_err();
    println!("  past the end: {e}");
    assert!(e.to_string().contains("runs past the end"));
    // Data through the synchronous helpers.
    let data = pattern(len, 1);
    buf.copy_from_host(0, &data).unwrap();
    let mut back = vec![0u8; len];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
    buf.fill(0xab).unwrap();
    buf.copy_to_host(len - 3, &mut back[..3]).unwrap();
    assert_eq!(&back[..3], &[0xab; 3]);
    assert!(buf.copy_to_host(len - 2, &mut back[..3]).is_err());
    // Freed: the cache entry goes.
    let base = buf.ptr() as usize;
    drop(buf);
    assert_eq!(global_cache().unwrap().lookup(base, 1), None);
}

#[test]
fn classify_stream_ordered_pool() {
    let Some(ctx) = gpu(0) else { return };
    let stream = Stream::new(ctx).unwrap();
    let len = (1 << 20) + 1;
    let mut buf = PoolBuffer::new(&stream, len).unwrap();
    let i = classify(buf.ptr() as usize, len).unwrap();
    println!("cuMemAllocAsync: {i}");
    assert_eq!(i.kind, PtrKind::Cuda);
    assert_eq!(i.device, Some(0));
    assert!(i.from_pool, "pool memory must be recognized");
    assert!(
        !i.ipc_exportable,
        "pool memory must not be legacy-IPC exportable"
    );
    let r = ipc_export(ctx, buf.ptr());
    println!("  cuIpcGetMemHandle on pool memory: {r:?}");
    assert_ne!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(reg_error_kind(r), RegErrorKind::NotExportable);
    println!("  dma-buf export: {:?}", dmabuf_export(ctx, buf.ptr(), len));
    let data = pattern(len, 2);
    buf.copy_from_host(0, &data).unwrap();
    let mut back = vec![0u8; len];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn classify_managed() {
    let Some(ctx) = gpu(0) else { return };
    let len = 64 << 10;
    let mut buf = ManagedBuffer::new(ctx, len).unwrap();
    let i = classify(buf.ptr() as usize, len).unwrap();
    println!("cuMemAllocManaged: {i}");
    assert_eq!(i.kind, PtrKind::CudaManaged);
    assert_eq!(i.memory_type(), rucx_ucs::MemoryType::CudaManaged);
    assert!(!i.ipc_exportable && !i.dmabuf_exportable);
    let data = pattern(len, 3);
    buf.copy_from_host(0, &data).unwrap();
    let mut back = vec![0u8; len];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn classify_pinned_registered_and_pageable() {
    let Some(ctx) = gpu(0) else { return };
    let pinned = PinnedHostBuffer::new(ctx, 1 << 16).unwrap();
    let i = classify(pinned.ptr() as usize + 10, 10).unwrap();
    println!("cuMemHostAlloc: {i}");
    assert_eq!(i.kind, PtrKind::HostPinned);
    assert_eq!(i.memory_type(), rucx_ucs::MemoryType::Host);
    assert!(!i.ipc_exportable);

    let mut v = vec![7u8; 1 << 20];
    let i = classify(v.as_ptr() as usize, v.len()).unwrap();
    println!("pageable: {i}");
    assert_eq!(i.kind, PtrKind::HostPageable);
    assert_eq!(i.device, None);
    {
        // SAFETY: `v` outlives the registration (dropped at the end of this block).
        let reg = unsafe { HostRegistration::new(ctx, v.as_mut_ptr(), v.len()) }.unwrap();
        let i = classify(v.as_ptr() as usize + 4096, 4096).unwrap();
        println!("cuMemHostRegister: {i}");
        assert_eq!(i.kind, PtrKind::HostPinned);
        assert_eq!(reg.len(), v.len());
    }
    assert_eq!(
        classify(v.as_ptr() as usize, 1).unwrap().kind,
        PtrKind::HostPageable
    );
}

#[test]
fn async_copies_with_events() {
    let Some(ctx) = gpu(0) else { return };
    let stream = Stream::new(ctx).unwrap();
    let ev = Event::new(ctx).unwrap();
    for len in [1usize, 4097, 1 << 20, 64 << 20] {
        let mut src = PinnedHostBuffer::new(ctx, len).unwrap();
        let dst = PinnedHostBuffer::new(ctx, len).unwrap();
        let dev = DeviceBuffer::new(ctx, len).unwrap();
        let data = pattern(len, len as u8);
        src.as_mut_slice().copy_from_slice(&data);
        // SAFETY: all three buffers stay alive until the event says the copies are done.
        unsafe {
            memcpy_async(dev.ptr(), src.ptr(), len, &stream).unwrap();
            memcpy_async(dst.ptr(), dev.ptr(), len, &stream).unwrap();
        }
        ev.record(&stream).unwrap();
        let mut polls = 0u64;
        while !ev.query().unwrap() {
            polls += 1;
            std::hint::spin_loop();
        }
        ev.synchronize().unwrap();
        assert_eq!(dst.as_slice(), &data[..], "len {len}");
        println!("async round trip {len} bytes ok ({polls} polls)");
    }
}

#[test]
fn second_gpu_and_peer_copy() {
    let Some(c0) = gpu(0) else { return };
    let Some(c1) = gpu(1) else { return };
    let drv = driver().unwrap();
    let len = 4 << 20;
    let b1 = DeviceBuffer::new(c1, len).unwrap();
    let i = classify(b1.ptr() as usize, len).unwrap();
    println!("GPU 1 cuMemAlloc: {i}");
    assert_eq!(i.device, Some(1));
    let can = drv.can_access_peer(0, 1).unwrap();
    println!("GPU 0 -> GPU 1 peer access: {can}");
    if can {
        c0.enable_peer_access(c1).unwrap();
        c0.enable_peer_access(c1).unwrap(); // already enabled is fine
    }
    let mut b0 = DeviceBuffer::new(c0, len).unwrap();
    let data = pattern(len, 9);
    b0.copy_from_host(0, &data).unwrap();
    let stream = Stream::new(c0).unwrap();
    // SAFETY: both buffers outlive the synchronize below.
    unsafe { memcpy_async(b1.ptr(), b0.ptr(), len, &stream).unwrap() };
    stream.synchronize().unwrap();
    let mut back = vec![0u8; len];
    b1.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn print_report() {
    let Some(_) = gpu(0) else { return };
    let r = rucx_cuda::report();
    let s = r.render();
    println!("{s}");
    let drv = driver().unwrap();
    assert_eq!(r.gpus.len() as u32, drv.device_count());
    assert!(s.contains("# GPU 0: ") && s.contains("NVLink active links: "));
    for g in &r.gpus {
        match &g.bar1 {
            Ok(b) => {
                assert!(
                    b.total > 0 && b.used + b.free <= b.total + (1 << 20),
                    "{b:?}"
                );
            }
            Err(why) => println!("BAR1 unknown on GPU {}: {why}", g.ordinal),
        }
        assert_eq!(g.peers.len() as u32, drv.device_count() - 1);
        // Every GPU gets at least an RDMA, a gdrcopy and a cuda_ipc verdict.
        assert!(r.verdicts(g.ordinal).len() >= 3);
    }
}

/// Every buffer type describes itself through `Memory` as the driver classifies it, and its
/// slices are the parts they name.
#[test]
fn memory_trait_on_every_buffer_type() {
    use rucx_ucs::{MemInfo, Memory, MemoryType};
    let Some(ctx) = gpu(0) else { return };
    let len = (1 << 20) + 7;
    let stream = Stream::new(ctx).unwrap();
    let mut dev = DeviceBuffer::new(ctx, len).unwrap();
    let mut pool = PoolBuffer::new(&stream, len).unwrap();
    let managed = ManagedBuffer::new(ctx, len).unwrap();
    let mut pinned = PinnedHostBuffer::new(ctx, len).unwrap();
    let cuda0 = Some(MemInfo::new(MemoryType::Cuda, Some(0)));
    let check = |name: &str, addr: usize, n: usize, info: Option<MemInfo>, ptr: u64| {
        assert_eq!((addr, n), (ptr as usize, len), "{name}");
        let c = classify(addr, n).unwrap();
        println!("{name}: told {info:?}, classified {c}");
        let info = info.expect("GPU buffers know their memory");
        assert_eq!(info.mem_type, c.memory_type(), "{name}");
        if info.mem_type.is_gpu() {
            assert_eq!(info.device, c.device, "{name}");
        }
    };
    check(
        "device",
        dev.mem_addr(),
        dev.mem_len(),
        dev.mem_info(),
        dev.ptr(),
    );
    check(
        "pool",
        pool.mem_addr(),
        pool.mem_len(),
        pool.mem_info(),
        pool.ptr(),
    );
    check(
        "managed",
        managed.mem_addr(),
        managed.mem_len(),
        managed.mem_info(),
        managed.ptr(),
    );
    check(
        "pinned",
        pinned.mem_addr(),
        pinned.mem_len(),
        pinned.mem_info(),
        pinned.ptr(),
    );
    assert_eq!(dev.mem_info(), cuda0);
    assert_eq!(pool.mem_info(), cuda0);
    assert_eq!(
        managed.mem_info(),
        Some(MemInfo::new(MemoryType::CudaManaged, Some(0)))
    );
    assert_eq!(pinned.mem_info(), Some(MemInfo::HOST));
    // Slices: shared and mutable, and errors past the end.
    let s = dev.slice(4096..8192);
    assert_eq!(
        (s.addr(), s.len(), s.info()),
        (dev.ptr() as usize + 4096, 4096, cuda0)
    );
    let m = pool.slice_mut(len - 7..);
    assert_eq!((m.addr(), m.len()), (pool.ptr() as usize + len - 7, 7));
    assert!(managed.try_slice(..=len).is_err());
    assert!(pinned.try_slice_mut(len + 1..).is_err());
    // The mutable address is the same one.
    let p = pinned.ptr() as usize;
    assert_eq!(pinned.mem_mut().addr(), p);
    assert_eq!(dev.mem_mut().addr(), dev.ptr() as usize);
}

/// `fill` and `copy_from_host` (from pageable memory) are complete when they return: a copy on
/// a non-blocking stream, which does not wait for the legacy default stream, sees their bytes.
#[test]
fn host_writes_are_complete_on_return() {
    let Some(ctx) = gpu(0) else { return };
    let n = 256 << 20;
    let stream = Stream::new(ctx).unwrap();
    let mut a = DeviceBuffer::new(ctx, n).unwrap();
    let mut b = ManagedBuffer::new(ctx, n).unwrap();
    let c = DeviceBuffer::new(ctx, 2 * n).unwrap();
    let data = pattern(n, 77);
    for round in 0..4u8 {
        a.fill(0x10 + round).unwrap();
        b.copy_from_host(0, &data).unwrap();
        // SAFETY: all three allocations are live, distinct, and outlive the synchronize.
        unsafe {
            memcpy_async(c.ptr(), a.ptr(), n, &stream).unwrap();
            memcpy_async(c.ptr() + n as u64, b.ptr(), n, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        let mut out = vec![0u8; 2 * n];
        c.copy_to_host(0, &mut out).unwrap();
        let bad = out[..n].iter().position(|&x| x != 0x10 + round);
        assert_eq!(bad, None, "round {round}: fill not complete");
        assert!(
            out[n..] == data[..],
            "round {round}: copy_from_host not complete"
        );
    }
}

/// Every driver call is counted under its name; `memcpy_async` binds the stream's context once
/// per thread (not per copy), and still queues its copy when the application changed or cleared
/// the thread's context behind rucx's back.
#[test]
fn driver_calls_are_counted_and_copies_bind_once_per_thread() {
    use rucx_cuda::calls::{self, Call};
    let Some(ctx) = gpu(0) else { return };
    // A thread of its own: the counters are process-wide, so this thread's calls are the
    // test's only while the other tests of this binary run one at a time (--test-threads=1).
    std::thread::spawn(move || {
        let stream = Stream::new(ctx).unwrap();
        let ev = Event::new(ctx).unwrap();
        let mut host = PinnedHostBuffer::new(ctx, 8).unwrap();
        let dev = DeviceBuffer::new(ctx, 8).unwrap();
        let copy = |i: u8, host: &mut PinnedHostBuffer| {
            host.as_mut_slice().copy_from_slice(&[i; 8]);
            // SAFETY: both buffers outlive the copy, which is waited for below.
            unsafe { memcpy_async(dev.ptr(), host.ptr(), 8, &stream) }.unwrap();
            ev.record(&stream).unwrap();
            ev.synchronize().unwrap();
        };
        copy(0, &mut host);
        let before = calls::snapshot();
        for i in 1..=100u8 {
            copy(i, &mut host);
        }
        let d = calls::snapshot().since(&before);
        println!("100 copies: {}", d.per_unit_line(100));
        assert_eq!(d.calls(Call::cuMemcpyAsync), 100);
        assert_eq!(d.calls(Call::cuEventRecord), 100);
        assert_eq!(d.calls(Call::cuEventSynchronize), 100);
        assert_eq!(d.calls(Call::cuCtxSetCurrent), 0, "{}", d.per_unit_line(1));
        assert_eq!(
            d.calls(Call::cuStreamCreate) + d.calls(Call::cuEventCreate),
            0
        );

        // The application clears the thread's context: the copy is refused for it, rucx binds
        // and queues it again.
        // SAFETY: a null context is allowed (no context current on this thread).
        let r = unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        let before = calls::snapshot();
        copy(0xab, &mut host);
        let d = calls::snapshot().since(&before);
        println!("after the context was cleared: {}", d.per_unit_line(1));
        assert!(d.calls(Call::cuMemcpyAsync) <= 2, "{}", d.per_unit_line(1));
        let mut out = [0u8; 8];
        dev.copy_to_host(0, &mut out).unwrap();
        assert_eq!(out, [0xab; 8]);
        // Bound again: the next copies bind no more.
        let before = calls::snapshot();
        copy(0xcd, &mut host);
        assert_eq!(
            calls::snapshot()
                .since(&before)
                .calls(Call::cuCtxSetCurrent),
            0
        );
        dev.copy_to_host(0, &mut out).unwrap();
        assert_eq!(out, [0xcd; 8]);
    })
    .join()
    .unwrap();
}
