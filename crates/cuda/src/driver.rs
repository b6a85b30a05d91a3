//! The CUDA driver API, loaded at run time.
//!
//! [`driver()`] loads `libcuda`, checks that the driver is recent enough and has every entry
//! point rucx calls, runs `cuInit` once and caches the result. Every failure (no library, an old
//! driver, no device) becomes [`Error::Unavailable`] with the precise reason; nothing here panics
//! and nothing links against CUDA at build time.
//!
//! The raw bindings are re-exported as [`sys`] for transports that need calls this
//! module does not wrap; [`check`] turns any `CUresult` into a typed [`Error::Device`].

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::RawFd;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::sys::{CUresult, cudaError_enum as E};
use rucx_ucs::{Error, MemInfo, Memory, MemoryType, RegErrorKind, Result};

/// Oldest driver API version rucx accepts (11.3: stream-ordered pools and the pointer
/// attributes that say whether memory can be exported through legacy IPC handles).
pub const MIN_DRIVER_VERSION: i32 = 11030;

/// Entry points (exact exported names) that must exist in `libcuda` for rucx to use it.
///
/// Checked before the first call, because the bindings abort the process on a missing symbol.
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuCtxSynchronize",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxEnablePeerAccess",
    "cuPointerGetAttributes",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpy",
    "cuMemcpyAsync",
    "cuMemsetD8_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
];

/// Entry point needed to export device memory as a dma-buf file descriptor (driver 11.7+).
pub const DMABUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";

/// Component name used in [`Error::Unavailable`].
pub const COMPONENT: &str = "cuda";

/// The name of a CUDA result, e.g. `CUDA_ERROR_OUT_OF_MEMORY`. Needs no driver.
pub fn result_name(r: CUresult) -> String {
    format!("{r:?}")
}

/// The driver's one-line description of a result, when the driver is loaded.
fn result_description(r: CUresult) -> Option<String> {
    driver().ok()?;
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: the driver is loaded (checked above, so the symbol exists); `p` is a valid
    // out-pointer and the driver stores a pointer to a static NUL-terminated string in it.
    let rc = unsafe { crate::cu!(cuGetErrorString(r, &mut p)) };
    if rc != E::CUDA_SUCCESS || p.is_null() {
        return None;
    }
    // SAFETY: on success `p` points to a static NUL-terminated string owned by the driver.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// How to name a device in messages: `GPU 0 (0000:19:00.0)` when its bus id is known.
pub fn device_label(device: Option<u32>) -> String {
    match device {
        None => "CUDA driver".to_string(),
        Some(d) => match driver().ok().and_then(|drv| drv.devices.get(d as usize)) {
            Some(info) => format!("GPU {d} ({})", info.pci_bus_id),
            None => format!("GPU {d}"),
        },
    }
}

/// Turn a `CUresult` into `Ok(())` or an [`Error::Device`] naming the call, the device and the
/// CUDA error (name and description), e.g.
/// `GPU 0 (0000:19:00.0): cuMemAlloc(1048576 bytes) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
pub fn check(r: CUresult, call: &str, device: Option<u32>) -> Result<()> {
    if r == E::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(r, call, device))
    }
}

/// The [`Error::Device`] for a failed call (see [`check`]); `r` should not be success.
pub fn cuda_error(r: CUresult, call: &str, device: Option<u32>) -> Error {
    let mut reason = format!("{call} failed: {}", result_name(r));
    if let Some(desc) = result_description(r) {
        reason.push_str(&format!(" ({desc})"));
    }
    Error::Device {
        device: device_label(device),
        reason,
    }
}

/// The registration-failure kind closest to a CUDA result, for memory domains that map CUDA
/// failures into [`rucx_ucs::RegError`]s.
///
/// `CUDA_ERROR_INVALID_VALUE` and `CUDA_ERROR_NOT_SUPPORTED` from an export call mean the memory
/// cannot be exported (e.g. `cuIpcGetMemHandle` on stream-ordered pool memory).
pub fn reg_error_kind(r: CUresult) -> RegErrorKind {
    match r {
        E::CUDA_ERROR_OUT_OF_MEMORY => RegErrorKind::NoMemory,
        E::CUDA_ERROR_INVALID_VALUE | E::CUDA_ERROR_NOT_SUPPORTED => RegErrorKind::NotExportable,
        E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED | E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => {
            RegErrorKind::Other
        }
        E::CUDA_ERROR_INVALID_DEVICE | E::CUDA_ERROR_NOT_PERMITTED => {
            RegErrorKind::UnsupportedMemoryType
        }
        _ => RegErrorKind::Other,
    }
}

/// What the driver reports about one device, read once at initialization.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// CUDA ordinal (as numbered under the current `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// Driver handle.
    pub handle: sys::CUdevice,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// PCI bus id in the sysfs form `0000:19:00.0` (lower case).
    pub pci_bus_id: String,
    /// The driver's UUID of the physical GPU (`cuDeviceGetUuid_v2`, driver 11.4+; a MIG
    /// instance has its own): the same in every process on the host whatever each one's
    /// `CUDA_VISIBLE_DEVICES` numbering. `None` on a driver without the call.
    pub uuid: Option<[u8; 16]>,
    /// Device memory in bytes.
    pub total_mem: u64,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: bool,
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` (stream-ordered allocations).
    pub memory_pools: bool,
    /// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`.
    pub managed_memory: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`.
    pub host_register: bool,
    /// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
    pub unified_addressing: bool,
}

/// A device's primary context, retained for the life of the process.
#[derive(Debug)]
pub struct PrimaryContext {
    ordinal: u32,
    device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUDA context handle is an opaque driver object that the driver API allows any host
// thread to use (cuCtxSetCurrent binds it to the calling thread); rucx never frees it.
unsafe impl Send for PrimaryContext {}
// SAFETY: see `Send`: every operation on the handle goes through the thread-safe driver API.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// CUDA ordinal of the device.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Driver device handle.
    pub fn cu_device(&self) -> sys::CUdevice {
        self.device
    }

    /// Raw context handle, for calls through [`sys`].
    pub fn raw(&self) -> sys::CUcontext {
        self.raw
    }

    /// Make this context current on the calling thread (cheap; call before raw driver calls).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is a retained primary context that is never released.
        let r = unsafe { crate::cu!(cuCtxSetCurrent(self.raw)) };
        let res = check(r, "cuCtxSetCurrent", Some(self.ordinal));
        BOUND.set(if res.is_ok() { self.raw as usize } else { 0 });
        res
    }

    /// Wait for every copy and kernel queued in this context, on any stream, to finish (e.g.
    /// writes to a buffer made on another stream before handing it to rucx).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the context is current; cuCtxSynchronize takes no arguments.
        let r = unsafe { crate::cu!(cuCtxSynchronize()) };
        check(r, "cuCtxSynchronize", Some(self.ordinal))
    }

    /// Let kernels and copies in this context access memory of `peer`'s device directly.
    /// Already-enabled access is not an error.
    pub fn enable_peer_access(&self, peer: &PrimaryContext) -> Result<()> {
        if peer.ordinal == self.ordinal {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both contexts are retained primary contexts; flags must be 0.
        let r = unsafe { crate::cu!(cuCtxEnablePeerAccess(peer.raw, 0)) };
        if r == E::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(
            r,
            &format!("cuCtxEnablePeerAccess(to GPU {})", peer.ordinal),
            Some(self.ordinal),
        )
    }
}

thread_local! {
    /// The context [`PrimaryContext::bind`] last made current on this thread (0: none). Only
    /// [`memcpy_async`] trusts it, to skip binding per copy: every other call that needs a
    /// current context binds, since the application may change the thread's context between
    /// rucx calls (see there why a copy is safe either way).
    static BOUND: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Make a driver call that needs `ctx` current on this thread, without binding per call: when
/// rucx last bound `ctx` here it is trusted (no `cuCtxSetCurrent`), otherwise bound first; a
/// call the driver refuses for the context (the application changed or cleared the thread's
/// context since; a refused call did nothing) is made again after binding. Returns the
/// driver's result of the last attempt.
pub(crate) fn call_in_context(
    ctx: &PrimaryContext,
    mut call: impl FnMut() -> CUresult,
) -> Result<CUresult> {
    let trusted = BOUND.get() == ctx.raw as usize;
    if !trusted {
        ctx.bind()?;
    }
    let r = call();
    if trusted && refused_for_context(r) {
        ctx.bind()?;
        return Ok(call());
    }
    Ok(r)
}

/// The loaded and initialized CUDA driver.
#[derive(Debug)]
pub struct Driver {
    version: i32,
    devices: Vec<DeviceInfo>,
    contexts: Vec<OnceLock<std::result::Result<PrimaryContext, String>>>,
    dmabuf_symbol: bool,
}

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();

/// The CUDA driver, loaded and initialized on the first call (thread-safe, cached).
///
/// Returns [`Error::Unavailable`] (component `cuda`) when `libcuda` cannot be loaded, lacks an
/// entry point rucx calls, is older than [`MIN_DRIVER_VERSION`], `cuInit` fails, or there is
/// no device. Never panics.
pub fn driver() -> Result<&'static Driver> {
    match DRIVER.get_or_init(Driver::load) {
        Ok(d) => Ok(d),
        Err(reason) => Err(Error::Unavailable {
            component: COMPONENT.into(),
            reason: reason.clone(),
        }),
    }
}

/// True when a driver is loaded and has at least one device (never panics).
pub fn is_available() -> bool {
    driver().is_ok()
}

fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

impl Driver {
    fn load() -> std::result::Result<Driver, String> {
        crate::calls::timing_from_env();
        // SAFETY: only tries `dlopen` on the candidate names of libcuda; no driver call.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "no CUDA driver found: libcuda.so could not be loaded (is the NVIDIA \
                        driver installed and libcuda.so.1 on the loader path?)"
                    .into(),
            );
        }
        // SAFETY: `is_culib_present` just succeeded, so loading the library succeeds too.
        let lib = unsafe { sys::culib() };
        let missing: Vec<&str> = REQUIRED_SYMBOLS
            .iter()
            .copied()
            // SAFETY: looking up a symbol by name has no side effect; the pointer is not used.
            .filter(|s| unsafe { lib.get::<*const c_void>(s.as_bytes()) }.is_err())
            .collect();
        if !missing.is_empty() {
            let mut version = String::new();
            if !missing.contains(&"cuDriverGetVersion") {
                let mut v: c_int = 0;
                // SAFETY: the symbol exists (checked above); `v` is a valid out-pointer.
                if unsafe { crate::cu!(cuDriverGetVersion(&mut v)) } == E::CUDA_SUCCESS {
                    version = format!(" (driver API {})", version_string(v));
                }
            }
            return Err(format!(
                "the CUDA driver{version} is too old: libcuda lacks {}; rucx needs driver API {} \
                 or newer",
                missing.join(", "),
                version_string(MIN_DRIVER_VERSION)
            ));
        }
        // SAFETY: looking up a symbol has no side effect.
        let dmabuf_symbol = unsafe { lib.get::<*const c_void>(DMABUF_SYMBOL.as_bytes()) }.is_ok();

        let mut version: c_int = 0;
        // SAFETY: symbol present; `version` is a valid out-pointer.
        let r = unsafe { crate::cu!(cuDriverGetVersion(&mut version)) };
        if r != E::CUDA_SUCCESS {
            return Err(format!("cuDriverGetVersion failed: {}", result_name(r)));
        }
        if version < MIN_DRIVER_VERSION {
            return Err(format!(
                "the CUDA driver is too old: it supports driver API {}, rucx needs {} or newer",
                version_string(version),
                version_string(MIN_DRIVER_VERSION)
            ));
        }
        // SAFETY: symbol present; cuInit takes flags 0 and is safe to call more than once.
        let r = unsafe { crate::cu!(cuInit(0)) };
        match r {
            E::CUDA_SUCCESS => {}
            E::CUDA_ERROR_NO_DEVICE => {
                return Err(format!(
                    "no CUDA device: cuInit returned CUDA_ERROR_NO_DEVICE (driver API {}; check \
                     CUDA_VISIBLE_DEVICES and /dev/nvidia*)",
                    version_string(version)
                ));
            }
            E::CUDA_ERROR_STUB_LIBRARY => {
                return Err(
                    "no CUDA driver found: the libcuda.so that was loaded is the toolkit's \
                            stub library (cuInit: CUDA_ERROR_STUB_LIBRARY); install the NVIDIA \
                            driver or put its libcuda.so.1 first on the loader path"
                        .into(),
                );
            }
            E::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH | E::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => {
                return Err(format!(
                    "the CUDA user-mode driver does not match the kernel driver or this GPU: \
                     cuInit returned {} (driver API {})",
                    result_name(r),
                    version_string(version)
                ));
            }
            _ => {
                return Err(format!(
                    "cuInit failed: {} (driver API {})",
                    result_name(r),
                    version_string(version)
                ));
            }
        }
        let mut count: c_int = 0;
        // SAFETY: initialized; `count` is a valid out-pointer.
        let r = unsafe { crate::cu!(cuDeviceGetCount(&mut count)) };
        if r != E::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetCount failed: {}", result_name(r)));
        }
        if count <= 0 {
            return Err(
                "no CUDA device (cuDeviceGetCount returned 0; check CUDA_VISIBLE_DEVICES)".into(),
            );
        }
        let mut devices = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            devices.push(query_device(ordinal).map_err(|e| e.to_string())?);
        }
        let contexts = (0..count).map(|_| OnceLock::new()).collect();
        Ok(Driver {
            version,
            devices,
            contexts,
            dmabuf_symbol,
        })
    }

    /// Driver API version as `major * 1000 + minor * 10` (e.g. 13000 for 13.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Driver API version as `major.minor`.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }

    /// Number of visible devices (at least 1).
    pub fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    /// Every visible device.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// One device by ordinal.
    pub fn device(&self, ordinal: u32) -> Result<&DeviceInfo> {
        self.devices.get(ordinal as usize).ok_or_else(|| {
            Error::InvalidParam(format!(
                "GPU {ordinal} does not exist: {} CUDA device(s) are visible",
                self.devices.len()
            ))
        })
    }

    /// Whether the driver exports `cuMemGetHandleForAddressRange` (dma-buf export).
    pub fn has_dmabuf_export(&self) -> bool {
        self.dmabuf_symbol
    }

    /// Whether `libcuda` exports `name` (for optional entry points).
    pub fn has_symbol(&self, name: &str) -> bool {
        // SAFETY: the library is loaded (a `Driver` exists); looking up a symbol has no effect.
        unsafe { sys::culib().get::<*const c_void>(name.as_bytes()) }.is_ok()
    }

    /// The primary context of device `ordinal`, retained on first use and kept for the life of
    /// the process.
    pub fn context(&'static self, ordinal: u32) -> Result<&'static PrimaryContext> {
        let info = self.device(ordinal)?;
        let slot = &self.contexts[ordinal as usize];
        match slot.get_or_init(|| {
            let mut raw: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: initialized driver, valid device handle, valid out-pointer.
            let r = unsafe { crate::cu!(cuDevicePrimaryCtxRetain(&mut raw, info.handle)) };
            check(r, "cuDevicePrimaryCtxRetain", Some(ordinal))
                .map(|()| PrimaryContext {
                    ordinal,
                    device: info.handle,
                    raw,
                })
                .map_err(|e| e.to_string())
        }) {
            Ok(c) => Ok(c),
            Err(reason) => Err(Error::Device {
                device: device_label(Some(ordinal)),
                reason: reason.clone(),
            }),
        }
    }

    /// A context for work that any context can do (page-locking host memory portably,
    /// allocating pinned host memory): one this process already retained, so that no GPU's
    /// context is created only for that (creating one costs about 100 ms and device memory),
    /// else device 0's.
    pub fn any_context(&'static self) -> Result<&'static PrimaryContext> {
        match self
            .contexts
            .iter()
            .find_map(|slot| slot.get().and_then(|r| r.as_ref().ok()))
        {
            Some(c) => Ok(c),
            None => self.context(0),
        }
    }

    /// Whether device `a` can access memory of device `b` directly (`cuDeviceCanAccessPeer`).
    pub fn can_access_peer(&self, a: u32, b: u32) -> Result<bool> {
        let da = self.device(a)?.handle;
        let db = self.device(b)?.handle;
        if a == b {
            return Ok(true);
        }
        let mut can: c_int = 0;
        // SAFETY: initialized driver, valid device handles, valid out-pointer.
        let r = unsafe { crate::cu!(cuDeviceCanAccessPeer(&mut can, da, db)) };
        check(r, &format!("cuDeviceCanAccessPeer(to GPU {b})"), Some(a))?;
        Ok(can != 0)
    }
}

fn device_attr(dev: sys::CUdevice, ordinal: u32, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: initialized driver, valid device handle, valid out-pointer.
    let r = unsafe { crate::cu!(cuDeviceGetAttribute(&mut v, attr, dev)) };
    check(r, &format!("cuDeviceGetAttribute({attr:?})"), Some(ordinal))?;
    Ok(v)
}

fn query_device(ordinal: c_int) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute as A;
    let ord = ordinal as u32;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: initialized driver, ordinal below the device count, valid out-pointer.
    let r = unsafe { crate::cu!(cuDeviceGet(&mut dev, ordinal)) };
    check(r, "cuDeviceGet", Some(ord))?;

    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` holds `len` bytes; the driver writes a NUL-terminated name into it.
    let r = unsafe { crate::cu!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, dev)) };
    check(r, "cuDeviceGetName", Some(ord))?;
    // SAFETY: the driver NUL-terminated `buf` on success (and it is zero-filled anyway).
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();

    let mut buf = [0 as c_char; 64];
    // SAFETY: as above, for the PCI bus id string.
    let r = unsafe {
        crate::cu!(cuDeviceGetPCIBusId(
            buf.as_mut_ptr(),
            buf.len() as c_int,
            dev
        ))
    };
    check(r, "cuDeviceGetPCIBusId", Some(ord))?;
    // SAFETY: NUL-terminated by the driver, zero-filled before.
    let bus = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();

    // SAFETY: the library is loaded (the caller initialized the driver); looking up a symbol
    // has no effect.
    let has_uuid = unsafe { sys::culib().get::<*const c_void>(b"cuDeviceGetUuid_v2") }.is_ok();
    let uuid = has_uuid
        .then(|| {
            let mut u = sys::CUuuid_st { bytes: [0; 16] };
            // SAFETY: the symbol exists (checked above), valid device handle and out-pointer.
            let r = unsafe { crate::cu!(cuDeviceGetUuid_v2(&mut u, dev)) };
            (r == E::CUDA_SUCCESS).then(|| u.bytes.map(|b| b as u8))
        })
        .flatten();

    let mut total: usize = 0;
    // SAFETY: valid device handle and out-pointer.
    let r = unsafe { crate::cu!(cuDeviceTotalMem_v2(&mut total, dev)) };
    check(r, "cuDeviceTotalMem", Some(ord))?;

    // Attributes newer than the device's driver may be rejected: read those as "no".
    let opt = |a| device_attr(dev, ord, a).map(|v| v != 0).unwrap_or(false);
    Ok(DeviceInfo {
        ordinal: ord,
        handle: dev,
        name,
        pci_bus_id: crate::sysfs::normalize_bus_id(&bus).unwrap_or(bus),
        uuid,
        total_mem: total as u64,
        gpu_direct_rdma: opt(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
        dma_buf: opt(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
        memory_pools: opt(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED),
        managed_memory: opt(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY),
        host_register: opt(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED),
        unified_addressing: opt(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
    })
}

// ---------------------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct StreamInner {
    raw: sys::CUstream,
    ctx: &'static PrimaryContext,
}

// SAFETY: a CUstream handle may be used from any thread of the process (the driver serializes
// work submitted to one stream); we destroy it once, in `Drop`, when the last clone goes.
unsafe impl Send for StreamInner {}
// SAFETY: see `Send`.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: the stream was created by `Stream::new` and this is its only destruction.
        let r = unsafe { crate::cu!(cuStreamDestroy_v2(self.raw)) };
        if r != E::CUDA_SUCCESS {
            tracing::warn!(
                "{}",
                cuda_error(r, "cuStreamDestroy", Some(self.ctx.ordinal))
            );
        }
    }
}

/// A non-blocking CUDA stream (cheap to clone; destroyed when the last clone drops).
#[derive(Clone, Debug)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl Stream {
    /// Create a stream on `ctx`'s device that does not synchronize with the legacy default
    /// stream.
    pub fn new(ctx: &'static PrimaryContext) -> Result<Stream> {
        ctx.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: context current, valid out-pointer, valid flag.
        let r = unsafe {
            crate::cu!(cuStreamCreate(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
            ))
        };
        check(r, "cuStreamCreate", Some(ctx.ordinal))?;
        Ok(Stream {
            inner: Arc::new(StreamInner { raw, ctx }),
        })
    }

    /// Raw handle for calls through [`sys`].
    pub fn raw(&self) -> sys::CUstream {
        self.inner.raw
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &'static PrimaryContext {
        self.inner.ctx
    }

    /// Wait until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live stream handle.
        let r = unsafe { crate::cu!(cuStreamSynchronize(self.inner.raw)) };
        check(r, "cuStreamSynchronize", Some(self.inner.ctx.ordinal))
    }

    /// Once all work queued on the stream so far has finished, add one to the eventfd `fd`
    /// (a host function queued on the stream, run by the driver on a thread of its own, writes
    /// to it; it calls nothing of CUDA).
    ///
    /// The caller keeps `fd` open until the host function ran: until the stream was
    /// synchronized, or the signal was seen.
    pub fn signal_fd_when_done(&self, fd: RawFd) -> Result<()> {
        let fd = usize::try_from(fd)
            .map_err(|_| Error::InvalidParam(format!("bad descriptor {fd} to signal")))?;
        // SAFETY: live stream handle; the callback is a plain function that only writes to the
        // descriptor passed (as an integer) in `userData`, which the caller keeps open.
        let r = unsafe {
            crate::cu!(cuLaunchHostFunc(
                self.inner.raw,
                Some(signal_fd_host_fn),
                fd as *mut c_void
            ))
        };
        check(r, "cuLaunchHostFunc", Some(self.inner.ctx.ordinal))
    }
}

impl Stream {
    /// Queue a store of `value` into the 64-bit word at device address `addr` (for example a
    /// [`crate::kernel::CompletionWord`]) after everything queued on the stream so far has
    /// finished, with a memory barrier before it: whoever sees the value sees what that work
    /// wrote.
    ///
    /// # Safety
    /// `addr` must be a device-accessible, 8-byte aligned address of memory that stays
    /// allocated until the stream has run the store.
    pub unsafe fn write_value64(&self, addr: u64, value: u64) -> Result<()> {
        let ctx = self.inner.ctx;
        let r = call_in_context(ctx, || {
            // SAFETY: live stream; the address is the caller's contract; flags 0 = default
            // (with a memory barrier before the write).
            unsafe { crate::cu!(cuStreamWriteValue64_v2(self.inner.raw, addr, value, 0)) }
        })?;
        check(r, "cuStreamWriteValue64", Some(ctx.ordinal))
    }
}

/// The host function of [`Stream::signal_fd_when_done`]: `user` is the descriptor number.
unsafe extern "C" fn signal_fd_host_fn(user: *mut c_void) {
    rucx_ucs::event::signal_fd(user as usize as RawFd);
}

/// A CUDA event without timing, for polling completion of work on a stream.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    ctx: &'static PrimaryContext,
}

// SAFETY: CUevent handles may be recorded, queried and destroyed from any thread.
unsafe impl Send for Event {}
// SAFETY: see `Send`; `query` and `synchronize` are thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    /// Create an event on `ctx` (timing disabled, the cheapest kind to record and query).
    pub fn new(ctx: &'static PrimaryContext) -> Result<Event> {
        ctx.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current, valid out-pointer, valid flag.
        let r = unsafe {
            crate::cu!(cuEventCreate(
                &mut raw,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            ))
        };
        check(r, "cuEventCreate", Some(ctx.ordinal))?;
        Ok(Event { raw, ctx })
    }

    /// Raw handle.
    pub fn raw(&self) -> sys::CUevent {
        self.raw
    }

    /// Capture the work queued so far on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream handles.
        let mut r = unsafe { crate::cu!(cuEventRecord(self.raw, stream.raw())) };
        if refused_for_context(r) {
            // The thread's context was cleared or changed behind rucx's back after the copies
            // were queued without binding (`memcpy_async`): bind the event's and record again.
            self.ctx.bind()?;
            // SAFETY: as above.
            r = unsafe { crate::cu!(cuEventRecord(self.raw, stream.raw())) };
        }
        check(r, "cuEventRecord", Some(self.ctx.ordinal))
    }

    /// `true` once the recorded work has completed, `false` while it is pending.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: live event handle.
        let r = unsafe { crate::cu!(cuEventQuery(self.raw)) };
        match r {
            E::CUDA_SUCCESS => Ok(true),
            E::CUDA_ERROR_NOT_READY => Ok(false),
            _ => Err(cuda_error(r, "cuEventQuery", Some(self.ctx.ordinal))),
        }
    }

    /// Block until the recorded work has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live event handle.
        let r = unsafe { crate::cu!(cuEventSynchronize(self.raw)) };
        check(r, "cuEventSynchronize", Some(self.ctx.ordinal))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `Event::new`, destroyed only here.
        let r = unsafe { crate::cu!(cuEventDestroy_v2(self.raw)) };
        if r != E::CUDA_SUCCESS {
            tracing::warn!(
                "{}",
                cuda_error(r, "cuEventDestroy", Some(self.ctx.ordinal))
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

fn nonzero(len: usize, what: &str) -> Result<()> {
    if len == 0 {
        Err(Error::InvalidParam(format!(
            "cannot allocate 0 bytes of {what}"
        )))
    } else {
        Ok(())
    }
}

/// Allocate `len` bytes of `what` on `ctx`'s device through `alloc` (the driver call named
/// `call` in errors), which fills in the device pointer; `alloc` runs with the context current.
fn alloc_device(
    ctx: &PrimaryContext,
    len: usize,
    what: &str,
    call: &str,
    alloc: impl FnOnce(&mut sys::CUdeviceptr) -> CUresult,
) -> Result<u64> {
    nonzero(len, what)?;
    ctx.bind()?;
    let mut ptr: sys::CUdeviceptr = 0;
    let r = alloc(&mut ptr);
    check(r, &format!("{call}({len} bytes)"), Some(ctx.ordinal))?;
    Ok(ptr)
}

/// What every owned allocation or registration of `len` bytes at `addr` does when it drops:
/// forget the cached classification of its range, make `ctx` current and undo it with `free`
/// (the driver call named `call` in the warning logged when it fails).
fn release(
    addr: usize,
    len: usize,
    ctx: &PrimaryContext,
    call: &str,
    free: impl FnOnce() -> CUresult,
) {
    crate::pointer::invalidate_global(addr, len);
    let _ = ctx.bind();
    let r = free();
    if r != E::CUDA_SUCCESS {
        tracing::warn!("{}", cuda_error(r, call, Some(ctx.ordinal)));
    }
}

fn range_check(what: &str, ptr: u64, cap: usize, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > cap) {
        return Err(Error::InvalidParam(format!(
            "{len} bytes at offset {offset} do not fit in the {cap}-byte {what} at {ptr:#x}"
        )));
    }
    Ok(())
}

/// Wait for the work queued on the legacy default stream of `ctx` (which must be current): where
/// `cuMemcpy` and `cuMemsetD8` queue their work.
fn sync_default_stream(ctx: &PrimaryContext, call: &str) -> Result<()> {
    // SAFETY: a null handle names the current context's legacy default stream (rucx calls the
    // driver's plain, not per-thread, entry points); the caller made `ctx` current.
    let r = unsafe { crate::cu!(cuStreamSynchronize(std::ptr::null_mut())) };
    check(
        r,
        &format!("cuStreamSynchronize after {call}"),
        Some(ctx.ordinal),
    )
}

/// Whether the driver refused a call for the thread's current context (none, destroyed, or
/// not the one of the handles passed): the call did nothing, and binding the right context and
/// calling again is the remedy.
fn refused_for_context(r: CUresult) -> bool {
    matches!(
        r,
        E::CUDA_ERROR_INVALID_CONTEXT
            | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
            | E::CUDA_ERROR_INVALID_HANDLE
    )
}

/// Copy `len` bytes between any two addresses the driver knows (unified addressing decides the
/// direction), with `ctx` current, and return once the copy is complete: the destination holds
/// the data, for this thread, other streams and other processes alike.
///
/// `cuMemcpy` alone does not promise that: from pageable host memory it may return once the
/// data is staged, before the DMA to the device ends, and between two device buffers it does
/// not wait at all. So this waits for the legacy default stream the copy was queued on (which
/// also waits for earlier work there).
///
/// # Safety
/// `src..src+len` must be readable and `dst..dst+len` writable memory (host or device) that
/// stays allocated for the call, and the two ranges must not overlap.
pub unsafe fn memcpy(ctx: &PrimaryContext, dst: u64, src: u64, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    ctx.bind()?;
    // SAFETY: forwarded to the caller's contract.
    let r = unsafe { crate::cu!(cuMemcpy(dst, src, len)) };
    let call = format!("cuMemcpy({len} bytes, {src:#x} -> {dst:#x})");
    check(r, &call, Some(ctx.ordinal))?;
    sync_default_stream(ctx, &call)
}

/// Queue a copy of `len` bytes on `stream` (unified addressing decides the direction) and
/// return without waiting for it.
///
/// Pageable host memory does not make the copy synchronous: the driver may stage pageable data
/// and return before the DMA ends (or may block part of the way; neither is promised). Only the
/// stream says when the copy is done: synchronize it ([`Stream::synchronize`]), or record an
/// [`Event`] after the copy and wait for that, before reading the destination, reusing the
/// source, or handing the destination to rucx.
///
/// # Safety
/// As [`memcpy`], and both ranges must stay allocated (and the destination untouched) until the
/// stream has finished the copy, whatever kind of memory they are.
pub unsafe fn memcpy_async(dst: u64, src: u64, len: usize, stream: &Stream) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // The copy runs in the stream's context. A current context is needed, but a copy queued on
    // a stream of another context than the current one succeeds (CUDA programming guide,
    // multi-device streams: "a memory copy will succeed even if it is issued to a stream that
    // is not associated to the current device"), so once rucx bound the stream's context on
    // this thread it does not bind again per copy (one `cuCtxSetCurrent` per GPU message
    // less). Should the application have changed the thread's context meanwhile and the driver
    // refuse the copy for it, the context is bound and the copy queued again (a refused call
    // queued nothing).
    let r = call_in_context(stream.context(), || {
        // SAFETY: forwarded to the caller's contract; the stream handle is live.
        unsafe { crate::cu!(cuMemcpyAsync(dst, src, len, stream.raw())) }
    })?;
    // The message is made on failure only: this call is on every GPU message's path.
    if r == E::CUDA_SUCCESS {
        return Ok(());
    }
    Err(cuda_error(
        r,
        &format!("cuMemcpyAsync({len} bytes, {src:#x} -> {dst:#x})"),
        Some(stream.context().ordinal),
    ))
}

macro_rules! device_copy_methods {
    () => {
        /// Device address.
        pub fn ptr(&self) -> u64 {
            self.ptr
        }

        /// Size in bytes.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Always false (zero-byte allocations are refused).
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// CUDA ordinal of the owning device.
        pub fn device(&self) -> u32 {
            self.ctx.ordinal
        }

        /// Copy `data` into the allocation at `offset`, bounds-checked. Synchronous: returns
        /// once the device holds the data (see [`memcpy`]), so the buffer can be handed to rucx
        /// or read by any stream right away. Takes `&mut self`: no send may be reading the
        /// buffer meanwhile.
        pub fn copy_from_host(&mut self, offset: usize, data: &[u8]) -> Result<()> {
            range_check(Self::WHAT, self.ptr, self.len, offset, data.len())?;
            // SAFETY: the destination lies inside this live allocation (checked above) and the
            // source is a borrowed slice.
            unsafe {
                memcpy(
                    self.ctx,
                    self.ptr + offset as u64,
                    data.as_ptr() as u64,
                    data.len(),
                )
            }
        }

        /// Copy from the allocation at `offset` into `out` (synchronous, bounds-checked).
        pub fn copy_to_host(&self, offset: usize, out: &mut [u8]) -> Result<()> {
            range_check(Self::WHAT, self.ptr, self.len, offset, out.len())?;
            // SAFETY: the source lies inside this live allocation and the destination is a
            // mutably borrowed slice.
            unsafe {
                memcpy(
                    self.ctx,
                    out.as_mut_ptr() as u64,
                    self.ptr + offset as u64,
                    out.len(),
                )
            }
        }

        /// Set every byte to `value`. Synchronous: `cuMemsetD8` on device memory returns
        /// before the device wrote the bytes, so this then waits for the legacy default stream
        /// it was queued on; on return every byte is set, for any stream. Takes `&mut self`,
        /// like [`copy_from_host`](Self::copy_from_host).
        pub fn fill(&mut self, value: u8) -> Result<()> {
            self.ctx.bind()?;
            // SAFETY: the range is exactly this live allocation.
            let r = unsafe { crate::cu!(cuMemsetD8_v2(self.ptr, value, self.len)) };
            check(r, "cuMemsetD8", Some(self.ctx.ordinal))?;
            sync_default_stream(self.ctx, "cuMemsetD8")
        }
    };
}

/// Device memory from `cuMemAlloc`, freed on drop.
///
/// It implements [`Memory`]: `&buf` is a send buffer, `&mut buf` a receive buffer,
/// `buf.slice(range)` / `buf.slice_mut(range)` a part of either, with no `unsafe`; rucx gets
/// the memory type and device from the buffer instead of asking the driver. Writes from the
/// host ([`copy_from_host`](Self::copy_from_host), [`fill`](Self::fill)) are complete when they
/// return:
///
/// ```
/// # fn main() -> rucx_ucs::Result<()> {
/// use rucx_cuda::{DeviceBuffer, Stream, driver, memcpy_async};
/// use rucx_ucs::{Memory, MemoryType};
///
/// // Without a CUDA driver and a GPU (a build machine) there is nothing to show.
/// let Ok(drv) = driver() else { return Ok(()) };
/// let ctx = drv.context(0)?;
/// let n = 64 << 20;
/// let mut a = DeviceBuffer::new(ctx, n)?;
/// let mut b = DeviceBuffer::new(ctx, n)?;
/// a.fill(0xab)?; // every byte set on return
/// let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
/// b.copy_from_host(0, &data)?; // on the device on return, although `data` is pageable
///
/// // So a non-blocking stream, which does not wait for the default stream, sees both.
/// let stream = Stream::new(ctx)?;
/// let c = DeviceBuffer::new(ctx, 2 * n)?;
/// // SAFETY: all three allocations are live and distinct, and outlive the stream's copies
/// // (synchronized below).
/// unsafe {
///     memcpy_async(c.ptr(), a.ptr(), n, &stream)?;
///     memcpy_async(c.ptr() + n as u64, b.ptr(), n, &stream)?;
/// }
/// stream.synchronize()?;
/// let mut out = vec![0u8; 2 * n];
/// c.copy_to_host(0, &mut out)?;
/// assert!(out[..n].iter().all(|&x| x == 0xab));
/// assert!(out[n..] == data[..]);
///
/// // What rucx is told about the buffer, and a part of it.
/// let info = a.mem_ref().info().expect("known");
/// assert_eq!((info.mem_type, info.device), (MemoryType::Cuda, Some(0)));
/// assert_eq!(a.slice(16..32).addr(), a.ptr() as usize + 16);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    ctx: &'static PrimaryContext,
}

impl DeviceBuffer {
    const WHAT: &'static str = "device allocation";

    /// Allocate `len` bytes on `ctx`'s device.
    pub fn new(ctx: &'static PrimaryContext, len: usize) -> Result<DeviceBuffer> {
        let ptr = alloc_device(ctx, len, "device memory", "cuMemAlloc", |ptr| {
            // SAFETY: context current (`alloc_device`), valid out-pointer.
            unsafe { crate::cu!(cuMemAlloc_v2(ptr, len)) }
        })?;
        Ok(DeviceBuffer { ptr, len, ctx })
    }

    device_copy_methods!();
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        release(self.ptr as usize, self.len, self.ctx, "cuMemFree", || {
            // SAFETY: allocated by cuMemAlloc in `new`, freed only here.
            unsafe { crate::cu!(cuMemFree_v2(self.ptr)) }
        });
    }
}

/// Device memory from the device's default stream-ordered pool (`cuMemAllocAsync`).
///
/// Such memory cannot be exported through legacy IPC handles. Dropping it frees it on the same
/// stream and waits for the stream.
#[derive(Debug)]
pub struct PoolBuffer {
    ptr: u64,
    len: usize,
    ctx: &'static PrimaryContext,
    stream: Stream,
}

impl PoolBuffer {
    const WHAT: &'static str = "stream-ordered allocation";

    /// Allocate `len` bytes in stream order on `stream` and wait until it is usable.
    pub fn new(stream: &Stream, len: usize) -> Result<PoolBuffer> {
        nonzero(len, "stream-ordered device memory")?;
        let ctx = stream.context();
        if !driver()?.device(ctx.ordinal)?.memory_pools {
            return Err(Error::Unsupported {
                what: format!(
                    "stream-ordered allocation on {}",
                    device_label(Some(ctx.ordinal))
                ),
                why: "the device does not report CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED".into(),
            });
        }
        ctx.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: context current, live stream, valid out-pointer.
        let r = unsafe { crate::cu!(cuMemAllocAsync(&mut ptr, len, stream.raw())) };
        check(
            r,
            &format!("cuMemAllocAsync({len} bytes)"),
            Some(ctx.ordinal),
        )?;
        let buf = PoolBuffer {
            ptr,
            len,
            ctx,
            stream: stream.clone(),
        };
        stream.synchronize()?;
        Ok(buf)
    }

    /// The stream the memory was allocated on (and will be freed on).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    device_copy_methods!();
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        release(
            self.ptr as usize,
            self.len,
            self.ctx,
            "cuMemFreeAsync",
            || {
                // SAFETY: allocated by cuMemAllocAsync on this stream, freed only here; the stream
                // is kept alive by the clone we hold.
                unsafe { crate::cu!(cuMemFreeAsync(self.ptr, self.stream.raw())) }
            },
        );
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!("{e}");
        }
    }
}

/// Managed (unified) memory from `cuMemAllocManaged`, attached globally, freed on drop.
#[derive(Debug)]
pub struct ManagedBuffer {
    ptr: u64,
    len: usize,
    ctx: &'static PrimaryContext,
}

impl ManagedBuffer {
    const WHAT: &'static str = "managed allocation";

    /// Allocate `len` bytes of managed memory associated with `ctx`'s device.
    pub fn new(ctx: &'static PrimaryContext, len: usize) -> Result<ManagedBuffer> {
        let ptr = alloc_device(ctx, len, "managed memory", "cuMemAllocManaged", |ptr| {
            // SAFETY: context current (`alloc_device`), valid out-pointer, valid attach flag.
            unsafe {
                crate::cu!(cuMemAllocManaged(
                    ptr,
                    len,
                    sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32,
                ))
            }
        })?;
        Ok(ManagedBuffer { ptr, len, ctx })
    }

    device_copy_methods!();
}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        release(self.ptr as usize, self.len, self.ctx, "cuMemFree", || {
            // SAFETY: allocated by cuMemAllocManaged, freed only here.
            unsafe { crate::cu!(cuMemFree_v2(self.ptr)) }
        });
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable to every context), zero-filled,
/// freed on drop.
#[derive(Debug)]
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: &'static PrimaryContext,
}

// SAFETY: the buffer owns its memory exclusively (like a `Box<[u8]>`); access goes through
// `&self`/`&mut self` borrows.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// Allocate `len` bytes of pinned host memory, visible to every context
    /// (`CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`).
    pub fn new(ctx: &'static PrimaryContext, len: usize) -> Result<PinnedHostBuffer> {
        nonzero(len, "pinned host memory")?;
        ctx.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: context current, valid out-pointer, valid flags.
        let r = unsafe { crate::cu!(cuMemHostAlloc(&mut p, len, flags)) };
        check(
            r,
            &format!("cuMemHostAlloc({len} bytes)"),
            Some(ctx.ordinal),
        )?;
        // SAFETY: the driver returned `len` writable bytes at `p`.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        Ok(PinnedHostBuffer {
            ptr: p as *mut u8,
            len,
            ctx,
        })
    }

    /// Host address (also usable as a device address under unified addressing).
    pub fn ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-byte allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialized (zero-filled) bytes owned by
        // `self`; the borrow ties the slice to `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        release(
            self.ptr as usize,
            self.len,
            self.ctx,
            "cuMemFreeHost",
            || {
                // SAFETY: allocated by cuMemHostAlloc, freed only here.
                unsafe { crate::cu!(cuMemFreeHost(self.ptr as *mut c_void)) }
            },
        );
    }
}

/// [`Memory`] for a device-side buffer type whose memory type is fixed.
macro_rules! gpu_memory_impl {
    ($t:ty, $mem:expr) => {
        // SAFETY: the allocation is owned by the value and freed only when it drops, so it
        // stays at `ptr` for every borrow; the bytes are written only through `&mut self`
        // (`copy_from_host`, `fill`); the memory type is how the buffer was allocated and the
        // device is the context's.
        unsafe impl Memory for $t {
            fn mem_addr(&self) -> usize {
                self.ptr as usize
            }
            fn mem_addr_mut(&mut self) -> usize {
                self.ptr as usize
            }
            fn mem_len(&self) -> usize {
                self.len
            }
            fn mem_info(&self) -> Option<MemInfo> {
                Some(MemInfo::new($mem, Some(self.ctx.ordinal)))
            }
        }
    };
}

gpu_memory_impl!(DeviceBuffer, MemoryType::Cuda);
gpu_memory_impl!(PoolBuffer, MemoryType::Cuda);
gpu_memory_impl!(ManagedBuffer, MemoryType::CudaManaged);

/// [`OwnedBuf`](rucx_ucs::OwnedBuf) and [`OwnedBufMut`](rucx_ucs::OwnedBufMut) for a buffer type
/// whose `Memory` range is an allocation it owns: requests may then own the buffer.
macro_rules! owned_impl {
    ($t:ty) => {
        // SAFETY: the allocation is owned by the value (a pointer to it, not the bytes, moves
        // with the value) and freed only when it drops; the range `Memory` gives is the same
        // for both borrows; writes go only through `&mut self`, which the request holds.
        unsafe impl rucx_ucs::OwnedBuf for $t {
            fn owned_ref(&self) -> rucx_ucs::MemRef<'_> {
                self.mem_ref()
            }
        }
        // SAFETY: as above; the request owning the value is the only one that can reach it.
        unsafe impl rucx_ucs::OwnedBufMut for $t {
            fn owned_mut(&mut self) -> rucx_ucs::MemMut<'_> {
                self.mem_mut()
            }
        }
    };
}

owned_impl!(DeviceBuffer);
owned_impl!(PoolBuffer);
owned_impl!(ManagedBuffer);
owned_impl!(PinnedHostBuffer);

// SAFETY: the pinned allocation is owned by the value and freed only when it drops; shared
// borrows hand out only `&[u8]`, and writes take `&mut self` (`as_mut_slice`), whose pointer is
// the same `ptr` the allocation was made with (writable). Pinned memory is host memory to rucx.
unsafe impl Memory for PinnedHostBuffer {
    fn mem_addr(&self) -> usize {
        self.ptr as usize
    }
    fn mem_addr_mut(&mut self) -> usize {
        self.ptr as usize
    }
    fn mem_len(&self) -> usize {
        self.len
    }
    fn mem_info(&self) -> Option<MemInfo> {
        Some(MemInfo::HOST)
    }
}

/// Existing host memory page-locked with `cuMemHostRegister` (portable), unregistered on drop.
#[derive(Debug)]
pub struct HostRegistration {
    ptr: *mut u8,
    len: usize,
    ctx: &'static PrimaryContext,
}

// SAFETY: the registration is only a handle to a driver-side record; it does not alias data.
unsafe impl Send for HostRegistration {}
// SAFETY: see `Send`.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-lock `len` bytes at `ptr` for DMA by every context.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be mapped host memory that stays mapped until the registration is
    /// dropped.
    pub unsafe fn new(
        ctx: &'static PrimaryContext,
        ptr: *mut u8,
        len: usize,
    ) -> Result<HostRegistration> {
        if len == 0 {
            return Err(Error::InvalidParam(
                "cannot register 0 bytes of host memory".into(),
            ));
        }
        ctx.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range is mapped for the registration's lifetime.
        let r = unsafe { crate::cu!(cuMemHostRegister_v2(ptr as *mut c_void, len, flags)) };
        check(
            r,
            &format!("cuMemHostRegister({len} bytes at {:#x})", ptr as usize),
            Some(ctx.ordinal),
        )?;
        Ok(HostRegistration { ptr, len, ctx })
    }

    /// Registered address.
    pub fn ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Registered length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        release(
            self.ptr as usize,
            self.len,
            self.ctx,
            "cuMemHostUnregister",
            || {
                // SAFETY: registered in `new`, unregistered only here.
                unsafe { crate::cu!(cuMemHostUnregister(self.ptr as *mut c_void)) }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_names_need_no_driver() {
        assert_eq!(
            result_name(E::CUDA_ERROR_OUT_OF_MEMORY),
            "CUDA_ERROR_OUT_OF_MEMORY"
        );
        assert_eq!(
            result_name(E::CUDA_ERROR_INVALID_VALUE),
            "CUDA_ERROR_INVALID_VALUE"
        );
    }

    #[test]
    fn check_names_call_device_and_error() {
        assert!(check(E::CUDA_SUCCESS, "cuMemAlloc", Some(0)).is_ok());
        let e = check(E::CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(64 bytes)", Some(3)).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Error::Device { .. }), "{e:?}");
        for want in ["GPU 3", "cuMemAlloc(64 bytes)", "CUDA_ERROR_OUT_OF_MEMORY"] {
            assert!(s.contains(want), "{s:?} lacks {want:?}");
        }
        let e = cuda_error(E::CUDA_ERROR_NOT_INITIALIZED, "cuInit", None).to_string();
        assert!(
            e.starts_with("CUDA driver: cuInit failed: CUDA_ERROR_NOT_INITIALIZED"),
            "{e}"
        );
    }

    #[test]
    fn reg_error_kinds() {
        assert_eq!(
            reg_error_kind(E::CUDA_ERROR_OUT_OF_MEMORY),
            RegErrorKind::NoMemory
        );
        assert_eq!(
            reg_error_kind(E::CUDA_ERROR_INVALID_VALUE),
            RegErrorKind::NotExportable
        );
        assert_eq!(
            reg_error_kind(E::CUDA_ERROR_LAUNCH_FAILED),
            RegErrorKind::Other
        );
    }

    #[test]
    fn version_strings() {
        assert_eq!(version_string(13000), "13.0");
        assert_eq!(version_string(11030), "11.3");
        assert_eq!(version_string(12090), "12.9");
    }

    #[test]
    fn range_checks() {
        assert!(range_check("x", 0x1000, 16, 0, 16).is_ok());
        assert!(range_check("x", 0x1000, 16, 8, 8).is_ok());
        let e = range_check("device allocation", 0x1000, 16, 8, 9)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("9 bytes at offset 8") && e.contains("16-byte device allocation"),
            "{e}"
        );
        assert!(range_check("x", 0, 16, usize::MAX, 2).is_err());
    }

    /// On a host without libcuda the driver must be unavailable with a reason, never a panic;
    /// with libcuda it either works or explains why not.
    #[test]
    fn driver_is_loaded_or_explains_why() {
        // SAFETY: only probes dlopen.
        let present = unsafe { sys::is_culib_present() };
        match driver() {
            Ok(d) => {
                assert!(present);
                assert!(d.device_count() >= 1);
                assert!(d.version() >= MIN_DRIVER_VERSION);
            }
            Err(Error::Unavailable { component, reason }) => {
                assert_eq!(component, COMPONENT);
                if !present {
                    assert!(reason.starts_with("no CUDA driver found"), "{reason}");
                    assert!(reason.contains("libcuda"), "{reason}");
                }
                assert!(!is_available());
                // Cached: the same answer again.
                let again = driver().unwrap_err().to_string();
                assert!(again.contains(&reason), "{again}");
            }
            Err(e) => panic!("unexpected error kind: {e:?}"),
        }
    }
}
