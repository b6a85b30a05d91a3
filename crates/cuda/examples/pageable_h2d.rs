//! How fast can pageable host memory reach GPU 0? Side by side in one run, for one size
//! (default 64 MiB, `--size MiB`), each way repeated `--iters` times after one untimed round:
//!
//! - `one copy`: one `cuMemcpyAsync` of the whole buffer, stream synchronized (the pageable
//!   bound of `rucx-perftest --bounds`);
//! - `frags F`: the buffer as copies of F bytes queued on one stream (what a fragmented
//!   zero-copy write does);
//! - `threads T`: T threads each copying a 1/T slice with one `cuMemcpyAsync` on its own stream;
//! - `memcpy T`: T threads copying the pageable buffer into a pinned one (no GPU);
//! - `staged T`: T threads copying 4 MiB chunks into pinned slots (two per thread) and queuing
//!   each chunk's host-to-device copy from its slot on the thread's stream;
//! - `registered heap`: one copy from (and one to) heap memory page-locked afterwards
//!   (`cuMemHostRegister`, as `rucx-perftest --pin-host` pins its buffers);
//! - `pinned`: one copy to and one from a buffer allocated pinned (the pinned bound).
//!
//! Prints GB/s (10^9 bytes/s). Needs a CUDA driver and one GPU.

use std::time::Instant;

use rucx_cuda::{DeviceBuffer, Event, PinnedHostBuffer, Stream, driver, memcpy_async};

type R<T> = std::result::Result<T, String>;

fn main() -> R<()> {
    let mut size = 64usize << 20;
    let mut iters = 10usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().ok_or(format!("{a} needs a value"))?;
        let n: usize = v.parse().map_err(|e| format!("{a} {v}: {e}"))?;
        match a.as_str() {
            "--size" => size = n << 20,
            "--iters" => iters = n.max(1),
            _ => return Err(format!("unknown option {a}")),
        }
    }
    let e = |w: &'static str| move |e: rucx_ucs::Error| format!("{w}: {e}");
    let drv = driver().map_err(e("driver"))?;
    let ctx = drv.context(0).map_err(e("context"))?;
    let dev = DeviceBuffer::new(ctx, size).map_err(e("device buffer"))?;
    let mut pinned = PinnedHostBuffer::new(ctx, size).map_err(e("pinned buffer"))?;
    // Pageable, every page touched.
    let src: Vec<u8> = (0..size).map(|i| (i * 7 + 1) as u8).collect();
    let (d, s) = (dev.ptr(), src.as_ptr() as u64);
    let rate = |name: String, f: &mut dyn FnMut() -> R<()>| -> R<()> {
        f()?;
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        let gbs = (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!("{name:<24} {gbs:8.2} GB/s");
        Ok(())
    };
    let st = Stream::new(ctx).map_err(e("stream"))?;
    rate("one copy (pageable)".into(), &mut || {
        // SAFETY: both buffers are live allocations of `size` bytes, synchronized before they
        // can be dropped.
        unsafe { memcpy_async(d, s, size, &st) }.map_err(e("copy"))?;
        st.synchronize().map_err(e("sync"))
    })?;
    for frag in [4usize << 20, 1 << 20] {
        rate(format!("frags {} KiB", frag >> 10), &mut || {
            let mut off = 0;
            while off < size {
                let n = frag.min(size - off);
                // SAFETY: in bounds of both live buffers; synchronized below.
                unsafe { memcpy_async(d + off as u64, s + off as u64, n, &st) }
                    .map_err(e("copy"))?;
                off += n;
            }
            st.synchronize().map_err(e("sync"))
        })?;
    }
    for t in [2usize, 4, 8] {
        let streams: Vec<Stream> = (0..t)
            .map(|_| Stream::new(ctx).map_err(e("stream")))
            .collect::<R<_>>()?;
        rate(format!("threads {t} (pageable)"), &mut || {
            let part = size.div_ceil(t);
            std::thread::scope(|sc| {
                let hs: Vec<_> = streams
                    .iter()
                    .enumerate()
                    .map(|(k, stream)| {
                        sc.spawn(move || -> R<()> {
                            let off = (k * part).min(size);
                            let n = part.min(size - off);
                            // SAFETY: a disjoint slice of both live buffers; synchronized
                            // before the scope ends.
                            unsafe { memcpy_async(d + off as u64, s + off as u64, n, stream) }
                                .map_err(e("copy"))?;
                            stream.synchronize().map_err(e("sync"))
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().map_err(|_| "thread panicked".to_string())?)
                    .collect::<R<Vec<()>>>()
            })?;
            Ok(())
        })?;
    }
    for t in [1usize, 2, 4, 8] {
        let dst = pinned.as_mut_slice();
        let part = size.div_ceil(t);
        let mut f = || -> R<()> {
            std::thread::scope(|sc| {
                for (a, b) in dst.chunks_mut(part).zip(src.chunks(part)) {
                    sc.spawn(move || a.copy_from_slice(b));
                }
            });
            Ok(())
        };
        rate(format!("memcpy {t} (to pinned)"), &mut f)?;
    }
    let chunk = 4usize << 20;
    for t in [1usize, 2, 4, 8] {
        let streams: Vec<Stream> = (0..t)
            .map(|_| Stream::new(ctx).map_err(e("stream")))
            .collect::<R<_>>()?;
        let slots: Vec<[PinnedHostBuffer; 2]> = (0..t)
            .map(|_| {
                Ok([
                    PinnedHostBuffer::new(ctx, chunk).map_err(e("slot"))?,
                    PinnedHostBuffer::new(ctx, chunk).map_err(e("slot"))?,
                ])
            })
            .collect::<R<_>>()?;
        let events: Vec<[Event; 2]> = (0..t)
            .map(|_| {
                Ok([
                    Event::new(ctx).map_err(e("event"))?,
                    Event::new(ctx).map_err(e("event"))?,
                ])
            })
            .collect::<R<_>>()?;
        let mut slots = slots;
        rate(format!("staged {t} x 2 x 4 MiB"), &mut || {
            let nchunks = size.div_ceil(chunk);
            std::thread::scope(|sc| {
                let hs: Vec<_> = slots
                    .iter_mut()
                    .zip(&streams)
                    .zip(&events)
                    .enumerate()
                    .map(|(k, ((sl, stream), ev))| {
                        let src = &src;
                        sc.spawn(move || -> R<()> {
                            ctx.bind().map_err(e("bind"))?;
                            let mut used = [false, false];
                            for (j, c) in (k..nchunks).step_by(t).enumerate() {
                                let b = j % 2;
                                if used[b] {
                                    ev[b].synchronize().map_err(e("event"))?;
                                }
                                let off = c * chunk;
                                let n = chunk.min(size - off);
                                sl[b].as_mut_slice()[..n].copy_from_slice(&src[off..off + n]);
                                let from = sl[b].ptr();
                                // SAFETY: the slot and the device range are live and in
                                // bounds; the slot is not written again before its event.
                                unsafe { memcpy_async(d + off as u64, from, n, stream) }
                                    .map_err(e("copy"))?;
                                ev[b].record(stream).map_err(e("record"))?;
                                used[b] = true;
                            }
                            stream.synchronize().map_err(e("sync"))
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().map_err(|_| "thread panicked".to_string())?)
                    .collect::<R<Vec<()>>>()
            })?;
            Ok(())
        })?;
    }
    {
        // Heap memory page-locked afterwards (`cuMemHostRegister`, as `rucx-perftest
        // --pin-host` does), against memory allocated pinned (`cuMemHostAlloc`, the bound).
        let mut heap: Vec<u8> = (0..size).map(|i| (i * 3 + 1) as u8).collect();
        // SAFETY: the vector is neither resized nor freed before the registration is dropped
        // (at the end of this block, before `heap`).
        let reg = unsafe { rucx_cuda::HostRegistration::new(ctx, heap.as_mut_ptr(), size) }
            .map_err(e("registering heap memory"))?;
        let h = heap.as_ptr() as u64;
        rate("registered heap H2D".into(), &mut || {
            // SAFETY: live buffers of `size` bytes, synchronized.
            unsafe { memcpy_async(d, h, size, &st) }.map_err(e("copy"))?;
            st.synchronize().map_err(e("sync"))
        })?;
        let hm = heap.as_mut_ptr() as u64;
        rate("registered heap D2H".into(), &mut || {
            // SAFETY: live buffers of `size` bytes, synchronized.
            unsafe { memcpy_async(hm, d, size, &st) }.map_err(e("copy"))?;
            st.synchronize().map_err(e("sync"))
        })?;
        drop(reg);
    }
    let p = pinned.ptr();
    rate("pinned one copy D2H".into(), &mut || {
        // SAFETY: live buffers of `size` bytes, synchronized.
        unsafe { memcpy_async(p, d, size, &st) }.map_err(e("copy"))?;
        st.synchronize().map_err(e("sync"))
    })?;
    rate("pinned one copy".into(), &mut || {
        // SAFETY: live buffers of `size` bytes, synchronized.
        unsafe { memcpy_async(d, p, size, &st) }.map_err(e("copy"))?;
        st.synchronize().map_err(e("sync"))
    })?;
    // What arrived is what was sent (the last way wrote the pinned buffer's bytes).
    let mut back = vec![0u8; size];
    // SAFETY: live buffers, synchronized.
    unsafe { memcpy_async(back.as_mut_ptr() as u64, d, size, &st) }.map_err(e("copy"))?;
    st.synchronize().map_err(e("sync"))?;
    if back != pinned.as_slice() {
        return Err("the device buffer differs from what was copied".into());
    }
    Ok(())
}
