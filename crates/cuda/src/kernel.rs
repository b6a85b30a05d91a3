//! Small device-to-device copies by a kernel, and completion words the GPU writes into pinned
//! host memory.
//!
//! On the GPUs measured (H200, driver 580, `tools/gpu-floor/floor.c kernel`), one 8-byte
//! `cuMemcpyDtoDAsync` polled through an event takes about 10 us, most of it in the driver:
//! the copy call itself (5 us) and the event queries (0.6 us each). A one-block copy kernel
//! launched on the same stream that writes a sequence number into pinned host memory when it
//! is done takes about 8 us, and the host sees the end with one load instead of a driver call.
//! Copies that a copy engine does well (anything touching host memory, large device copies)
//! keep `cuMemcpyAsync`; their end is announced by [`Stream::write_value64`] into the same
//! kind of word, which is cheaper to poll than an event too.
//!
//! The kernel is PTX, compiled by the driver the first time a device needs it (about 0.1 s;
//! the driver keeps the result in its compute cache for later processes). That happens on a
//! thread of its own ([`CopyKernel::get`] starts it and answers `None` until it is ready), so
//! no transfer waits for it: copies go through `cuMemcpyAsync` meanwhile. A device or driver
//! that cannot load it is remembered and never asked again.
//!
//! A kernel that touches an address outside live device memory does not fail like a copy call
//! does: it faults, and the context is lost. So callers launch it only on ranges they know are
//! inside device allocations of the stream's device ([`crate::pointer::PointerInfo::covers`]).

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use rucx_ucs::{Config, Error, Result};

use crate::driver::{PrimaryContext, Stream, check, driver};
use crate::sys;
use cudarc::driver::sys::cudaError_enum as E;

/// The copy kernel: one block; each thread moves 16, 8 or 1 bytes per step (the widest unit
/// that the two addresses and the length are all aligned to), then, when `flag` is not 0,
/// every thread fences its writes at system scope, the block meets at a barrier and thread 0
/// stores `seq` into `flag` (pinned host memory mapped for the device).
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry rucx_copy(
	.param .u64 p_dst,
	.param .u64 p_src,
	.param .u64 p_len,
	.param .u64 p_flag,
	.param .u64 p_seq
)
{
	.reg .pred %p<4>;
	.reg .b16 %h<2>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<16>;

	ld.param.u64 %rd1, [p_dst];
	ld.param.u64 %rd2, [p_src];
	ld.param.u64 %rd3, [p_len];
	ld.param.u64 %rd4, [p_flag];
	ld.param.u64 %rd5, [p_seq];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ntid.x;
	cvt.u64.u32 %rd6, %r1;
	cvt.u64.u32 %rd7, %r2;
	or.b64 %rd8, %rd1, %rd2;
	or.b64 %rd8, %rd8, %rd3;
	and.b64 %rd9, %rd8, 15;
	setp.eq.u64 %p1, %rd9, 0;
	@%p1 bra V16;
	and.b64 %rd9, %rd8, 7;
	setp.eq.u64 %p1, %rd9, 0;
	@%p1 bra V8;
B1:
	setp.ge.u64 %p2, %rd6, %rd3;
	@%p2 bra FIN;
	add.u64 %rd10, %rd2, %rd6;
	ld.global.u8 %h1, [%rd10];
	add.u64 %rd11, %rd1, %rd6;
	st.global.u8 [%rd11], %h1;
	add.u64 %rd6, %rd6, %rd7;
	bra B1;
V8:
	shl.b64 %rd6, %rd6, 3;
	shl.b64 %rd7, %rd7, 3;
L8:
	setp.ge.u64 %p2, %rd6, %rd3;
	@%p2 bra FIN;
	add.u64 %rd10, %rd2, %rd6;
	ld.global.u64 %rd12, [%rd10];
	add.u64 %rd11, %rd1, %rd6;
	st.global.u64 [%rd11], %rd12;
	add.u64 %rd6, %rd6, %rd7;
	bra L8;
V16:
	shl.b64 %rd6, %rd6, 4;
	shl.b64 %rd7, %rd7, 4;
L16:
	setp.ge.u64 %p2, %rd6, %rd3;
	@%p2 bra FIN;
	add.u64 %rd10, %rd2, %rd6;
	ld.global.v4.u32 {%r3, %r4, %r5, %r6}, [%rd10];
	add.u64 %rd11, %rd1, %rd6;
	st.global.v4.u32 [%rd11], {%r3, %r4, %r5, %r6};
	add.u64 %rd6, %rd6, %rd7;
	bra L16;
FIN:
	setp.eq.u64 %p3, %rd4, 0;
	@%p3 bra END;
	membar.sys;
	bar.sync 0;
	setp.ne.u32 %p3, %r1, 0;
	@%p3 bra END;
	st.volatile.global.u64 [%rd4], %rd5;
END:
	ret;
}
"#;

/// Threads per block at most (the block is the whole grid).
const MAX_THREADS: usize = 1024;

/// How small copies run and how their end is seen (`RUCX_CUDA_COPY_KERNEL_MAX`,
/// `RUCX_CUDA_COMPLETION_WORDS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmallCopies {
    /// Device-to-device copies of at most this many bytes run as a kernel (0: never).
    pub kernel_max: usize,
    /// Completion of stream work is seen through a word the GPU writes into pinned host memory
    /// instead of an event.
    pub completion_words: bool,
}

impl SmallCopies {
    /// Neither kernels nor completion words: every copy is `cuMemcpyAsync` and an event.
    pub const OFF: SmallCopies = SmallCopies {
        kernel_max: 0,
        completion_words: false,
    };

    /// The process's settings, from the environment (read once). An invalid value is an
    /// [`Error::Config`] naming the variable.
    pub fn from_env() -> Result<SmallCopies> {
        static SETTINGS: OnceLock<Result<SmallCopies>> = OnceLock::new();
        SETTINGS
            .get_or_init(|| {
                let read = || -> Result<SmallCopies> {
                    let mut cfg = Config::new(&[crate::CONFIG])?;
                    for name in ["CUDA_COPY_KERNEL_MAX", "CUDA_COMPLETION_WORDS"] {
                        let var = format!("{}{name}", rucx_ucs::config::ENV_PREFIX);
                        if let Ok(v) = std::env::var(&var) {
                            cfg.set(name, &v)?;
                        }
                    }
                    Ok(SmallCopies {
                        kernel_max: cfg.mem_units("CUDA_COPY_KERNEL_MAX").resolve(64 << 10)
                            as usize,
                        completion_words: cfg.bool("CUDA_COMPLETION_WORDS"),
                    })
                };
                read()
            })
            .clone()
    }
}

/// Load state of a device's kernel.
const NOT_STARTED: u8 = 0;
const LOADING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

/// Per-device kernel slots (devices beyond the table never get a kernel).
const MAX_DEVICES: usize = 64;

struct Slot {
    state: AtomicU8,
    kernel: OnceLock<CopyKernel>,
}

static SLOTS: [Slot; MAX_DEVICES] = [const {
    Slot {
        state: AtomicU8::new(NOT_STARTED),
        kernel: OnceLock::new(),
    }
}; MAX_DEVICES];

/// The copy kernel loaded into one device's primary context.
#[derive(Debug)]
pub struct CopyKernel {
    func: sys::CUfunction,
    ctx: &'static PrimaryContext,
}

// SAFETY: a CUfunction handle is an opaque driver object valid in its (never released) primary
// context; launching it from any thread is allowed by the driver API.
unsafe impl Send for CopyKernel {}
// SAFETY: see `Send`: launches are thread-safe driver calls that do not mutate the handle.
unsafe impl Sync for CopyKernel {}

impl CopyKernel {
    /// The kernel of `ctx`'s device if it is loaded; otherwise `None`, and its loading starts
    /// on a thread of its own (once per device).
    pub fn get(ctx: &'static PrimaryContext) -> Option<&'static CopyKernel> {
        let slot = SLOTS.get(ctx.ordinal() as usize)?;
        match slot.state.load(Ordering::Acquire) {
            READY => slot.kernel.get(),
            NOT_STARTED => {
                if slot
                    .state
                    .compare_exchange(NOT_STARTED, LOADING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let spawned = std::thread::Builder::new()
                        .name("rucx-cuda-kernel".into())
                        .spawn(move || {
                            let _ = Self::load_into(ctx, slot);
                        });
                    if spawned.is_err() {
                        let _ = Self::load_into(ctx, slot);
                    }
                }
                None
            }
            _ => None,
        }
    }

    /// The kernel of `ctx`'s device, loading it on this thread if needed (waits for a load
    /// another thread started).
    pub fn load(ctx: &'static PrimaryContext) -> Result<&'static CopyKernel> {
        let Some(slot) = SLOTS.get(ctx.ordinal() as usize) else {
            return Err(Error::Unsupported {
                what: format!("a copy kernel on GPU {}", ctx.ordinal()),
                why: format!("rucx keeps kernels for the first {MAX_DEVICES} devices only"),
            });
        };
        loop {
            match slot.state.compare_exchange(
                NOT_STARTED,
                LOADING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Self::load_into(ctx, slot),
                Err(READY) => return Ok(slot.kernel.get().expect("ready means set")),
                Err(FAILED) => {
                    return Err(Error::Unsupported {
                        what: format!("a copy kernel on GPU {}", ctx.ordinal()),
                        why: "loading it failed before (see the log)".into(),
                    });
                }
                Err(_) => std::thread::yield_now(),
            }
        }
    }

    fn load_into(ctx: &'static PrimaryContext, slot: &'static Slot) -> Result<&'static CopyKernel> {
        match Self::load_now(ctx) {
            Ok(k) => {
                let k = slot.kernel.get_or_init(|| k);
                slot.state.store(READY, Ordering::Release);
                tracing::debug!("GPU {}: copy kernel loaded", ctx.ordinal());
                Ok(k)
            }
            Err(e) => {
                slot.state.store(FAILED, Ordering::Release);
                tracing::info!(
                    "GPU {}: no copy kernel, small copies use cuMemcpyAsync: {e}",
                    ctx.ordinal()
                );
                Err(e)
            }
        }
    }

    fn load_now(ctx: &'static PrimaryContext) -> Result<CopyKernel> {
        let drv = driver()?;
        for s in ["cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel"] {
            if !drv.has_symbol(s) {
                return Err(Error::Unsupported {
                    what: "a copy kernel".into(),
                    why: format!("the CUDA driver lacks {s}"),
                });
            }
        }
        let ptx = std::ffi::CString::new(PTX).expect("no NUL in the PTX");
        ctx.bind()?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the context is current; `ptx` is a NUL-terminated PTX image that lives for
        // the call; `module` is a valid out-pointer.
        let r = unsafe { crate::cu!(cuModuleLoadData(&mut module, ptx.as_ptr() as *const c_void)) };
        check(r, "cuModuleLoadData(copy kernel PTX)", Some(ctx.ordinal()))?;
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` was just loaded (and is never unloaded: the kernel lives as long as
        // the primary context); the name is NUL-terminated.
        let r = unsafe {
            crate::cu!(cuModuleGetFunction(
                &mut func,
                module,
                c"rucx_copy".as_ptr()
            ))
        };
        check(r, "cuModuleGetFunction(rucx_copy)", Some(ctx.ordinal()))?;
        Ok(CopyKernel { func, ctx })
    }

    /// Queue a copy of `len` bytes from `src` to `dst` on `stream`; when `done` is given, the
    /// kernel stores `done.1` into the word at device address `done.0` once every byte is
    /// written (visible to the host and other devices).
    ///
    /// # Safety
    /// `src..src+len` and `dst..dst+len` must lie inside live device memory (or memory mapped
    /// into) the stream's context can access until the copy finished, must not overlap, and
    /// `done.0` must be a device-mapped address of pinned host memory live until then: an
    /// address outside such memory faults the kernel and loses the context.
    pub unsafe fn launch(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        stream: &Stream,
        done: Option<(u64, u64)>,
    ) -> Result<()> {
        if !std::ptr::eq(stream.context(), self.ctx) {
            return Err(Error::InvalidParam(format!(
                "copy kernel of GPU {} launched on a stream of GPU {}",
                self.ctx.ordinal(),
                stream.context().ordinal()
            )));
        }
        let unit = if (dst | src | len as u64) & 15 == 0 {
            16
        } else if (dst | src | len as u64) & 7 == 0 {
            8
        } else {
            1
        };
        let threads = len
            .div_ceil(unit)
            .clamp(32, MAX_THREADS)
            .next_multiple_of(32) as u32;
        let (mut d, mut s, mut n) = (dst, src, len as u64);
        let (mut flag, mut seq) = done.unwrap_or((0, 0));
        let mut params: [*mut c_void; 5] = [
            (&raw mut d).cast(),
            (&raw mut s).cast(),
            (&raw mut n).cast(),
            (&raw mut flag).cast(),
            (&raw mut seq).cast(),
        ];
        // A launch needs the kernel's context current (unlike a copy): bound once per thread
        // as `memcpy_async` does, and again when the driver refuses it for the context.
        let r = crate::driver::call_in_context(self.ctx, || {
            // SAFETY: `func` is live in its context; the grid is one block of at most 1024
            // threads, no shared memory; `params` points at five u64 locals, as the kernel's
            // five .u64 parameters (copied by the driver during the call); memory safety of
            // what the kernel touches is the caller's contract.
            unsafe {
                crate::cu!(cuLaunchKernel(
                    self.func,
                    1,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream.raw(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut()
                ))
            }
        })?;
        if r == E::CUDA_SUCCESS {
            return Ok(());
        }
        check(
            r,
            &format!("cuLaunchKernel(copy of {len} bytes, {src:#x} -> {dst:#x})"),
            Some(self.ctx.ordinal()),
        )
    }
}

/// A 64-bit word in pinned host memory that the GPU can write (device-mapped), for completion
/// sequence numbers: the host reads it with one load.
#[derive(Debug)]
pub struct CompletionWord {
    host: *mut u64,
    dev: u64,
    ctx: &'static PrimaryContext,
}

// SAFETY: the word is pinned host memory owned by this value; reads are volatile loads of an
// aligned u64 and the only writer is the GPU (through `dev`).
unsafe impl Send for CompletionWord {}
// SAFETY: see `Send`: `value` only reads.
unsafe impl Sync for CompletionWord {}

impl CompletionWord {
    /// A word for streams of `ctx`'s device, holding 0. Needs 64-bit stream memory operations
    /// (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`) and `cuStreamWriteValue64_v2`.
    pub fn new(ctx: &'static PrimaryContext) -> Result<CompletionWord> {
        let drv = driver()?;
        for s in ["cuStreamWriteValue64_v2", "cuMemHostGetDevicePointer_v2"] {
            if !drv.has_symbol(s) {
                return Err(Error::Unsupported {
                    what: "completion words".into(),
                    why: format!("the CUDA driver lacks {s}"),
                });
            }
        }
        let mut can: i32 = 0;
        // SAFETY: valid out-pointer, device handle of a retained context.
        let r = unsafe {
            crate::cu!(cuDeviceGetAttribute(
                &mut can,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                ctx.cu_device()
            ))
        };
        check(
            r,
            "cuDeviceGetAttribute(64-bit stream memory operations)",
            Some(ctx.ordinal()),
        )?;
        if can == 0 {
            return Err(Error::Unsupported {
                what: format!("completion words on GPU {}", ctx.ordinal()),
                why: "the device cannot use 64-bit stream memory operations".into(),
            });
        }
        ctx.bind()?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: context current; valid out-pointer; 64 bytes (a cache line of its own).
        let r = unsafe {
            crate::cu!(cuMemHostAlloc(
                &mut host,
                64,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE
            ))
        };
        check(
            r,
            "cuMemHostAlloc(64 bytes, completion word)",
            Some(ctx.ordinal()),
        )?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated device-mapped; flags must be 0.
        let r = unsafe { crate::cu!(cuMemHostGetDevicePointer_v2(&mut dev, host, 0)) };
        if let Err(e) = check(r, "cuMemHostGetDevicePointer", Some(ctx.ordinal())) {
            // SAFETY: allocated above, not shared with anyone.
            unsafe { crate::cu!(cuMemFreeHost(host)) };
            return Err(e);
        }
        // SAFETY: `host` is 64 writable, aligned bytes owned by this value.
        unsafe { std::ptr::write_volatile(host as *mut u64, 0) };
        Ok(CompletionWord {
            host: host as *mut u64,
            dev,
            ctx,
        })
    }

    /// The device address to write (for [`Stream::write_value64`] and [`CopyKernel::launch`]).
    pub fn device_addr(&self) -> u64 {
        self.dev
    }

    /// The value last written.
    pub fn value(&self) -> u64 {
        // SAFETY: `host` is an aligned u64 of pinned memory owned by this value; the GPU writes
        // it whole (a 64-bit store), so a volatile load sees an old or a new value.
        let v = unsafe { std::ptr::read_volatile(self.host) };
        // What the GPU wrote before the word (the copy's bytes) is read after it.
        std::sync::atomic::fence(Ordering::Acquire);
        v
    }
}

impl Drop for CompletionWord {
    fn drop(&mut self) {
        // The owner synchronizes the streams that write the word before dropping it.
        let _ = self.ctx.bind();
        // SAFETY: allocated by `cuMemHostAlloc` in `new`, freed only here.
        let r = unsafe { crate::cu!(cuMemFreeHost(self.host as *mut c_void)) };
        if r != E::CUDA_SUCCESS {
            tracing::warn!(
                "{}",
                crate::driver::cuda_error(
                    r,
                    "cuMemFreeHost(completion word)",
                    Some(self.ctx.ordinal())
                )
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_bounded_and_named() {
        let mut cfg = Config::new(&[crate::CONFIG]).unwrap();
        assert_eq!(
            cfg.mem_units("CUDA_COPY_KERNEL_MAX").resolve(0),
            64 << 10,
            "default"
        );
        assert!(cfg.bool("CUDA_COMPLETION_WORDS"));
        cfg.set("CUDA_COPY_KERNEL_MAX", "0").unwrap();
        assert_eq!(cfg.mem_units("CUDA_COPY_KERNEL_MAX").resolve(1), 0);
        let e = cfg.set("CUDA_COPY_KERNEL_MAX", "2M").unwrap_err();
        assert!(e.to_string().contains("CUDA_COPY_KERNEL_MAX"), "{e}");
        assert!(cfg.set("CUDA_COMPLETION_WORDS", "perhaps").is_err());
    }

    #[test]
    fn the_kernel_has_the_entry_and_parameters_launch_passes() {
        // `launch` passes five u64 values in this order; the PTX must declare exactly these.
        let params: Vec<&str> = PTX
            .lines()
            .filter_map(|l| l.trim().strip_prefix(".param .u64 "))
            .map(|p| p.trim_end_matches(','))
            .collect();
        assert_eq!(params, ["p_dst", "p_src", "p_len", "p_flag", "p_seq"]);
        assert!(PTX.contains(".visible .entry rucx_copy("));
        assert!(!PTX.contains('\0'));
    }
}
