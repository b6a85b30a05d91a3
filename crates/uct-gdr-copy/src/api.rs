//! `libgdrapi` (gdrcopy's user library), loaded at run time.
//!
//! The entry points used (gdrcopy 2.x, `gdrapi.h`):
//!
//! ```text
//! gdr_t gdr_open(void);
//! int   gdr_close(gdr_t g);
//! int   gdr_pin_buffer(gdr_t g, unsigned long addr, size_t size, uint64_t p2p_token,
//!                      uint32_t va_space, gdr_mh_t *handle);
//! int   gdr_unpin_buffer(gdr_t g, gdr_mh_t handle);
//! int   gdr_get_info_v2(gdr_t g, gdr_mh_t handle, gdr_info_v2_t *info);   (2.3+; else
//!       gdr_get_info with the older layout, whose first three fields are the same)
//! int   gdr_map(gdr_t g, gdr_mh_t handle, void **va, size_t size);
//! int   gdr_unmap(gdr_t g, gdr_mh_t handle, void *va, size_t size);
//! int   gdr_copy_to_mapping(gdr_mh_t handle, void *map_d_ptr, const void *h_ptr, size_t size);
//! int   gdr_copy_from_mapping(gdr_mh_t handle, void *h_ptr, const void *map_d_ptr, size_t size);
//! ```
//!
//! Nothing here runs on the build machine or on the GPU machine of this project (neither has
//! gdrcopy): these paths are written for hosts where it is installed, and every failure is an
//! error value, never a panic.

use std::ffi::{c_int, c_ulong, c_void};
use std::path::Path;

use rucx_ucs::{Error, Result};

/// GPU page size that gdrcopy pins and maps in (64 KiB).
pub const GPU_PAGE_SIZE: u64 = 1 << 16;

/// The character device of the gdrdrv kernel driver.
pub const DEVICE_FILE: &str = "/dev/gdrdrv";

/// `gdr_mh_t`: an opaque handle passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GdrMh {
    /// Library-private value.
    pub h: c_ulong,
}

/// `gdr_info_t` / `gdr_info_v2_t`: only the leading fields, common to both layouts, are read;
/// the tail is room for whatever a newer library writes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GdrInfo {
    /// GPU virtual address of the pinned range's start.
    pub va: u64,
    /// Bytes mapped.
    pub mapped_size: u64,
    /// GPU page size.
    pub page_size: u32,
    tail: [u64; 16],
}

type GdrT = *mut c_void;
type OpenFn = unsafe extern "C" fn() -> GdrT;
type CloseFn = unsafe extern "C" fn(GdrT) -> c_int;
type PinFn = unsafe extern "C" fn(GdrT, c_ulong, usize, u64, u32, *mut GdrMh) -> c_int;
type UnpinFn = unsafe extern "C" fn(GdrT, GdrMh) -> c_int;
type InfoFn = unsafe extern "C" fn(GdrT, GdrMh, *mut GdrInfo) -> c_int;
type MapFn = unsafe extern "C" fn(GdrT, GdrMh, *mut *mut c_void, usize) -> c_int;
type UnmapFn = unsafe extern "C" fn(GdrT, GdrMh, *mut c_void, usize) -> c_int;
type CopyToFn = unsafe extern "C" fn(GdrMh, *mut c_void, *const c_void, usize) -> c_int;
type CopyFromFn = unsafe extern "C" fn(GdrMh, *mut c_void, *const c_void, usize) -> c_int;

/// The loaded library and its entry points.
#[derive(Debug)]
pub struct GdrApi {
    name: String,
    open: OpenFn,
    close: CloseFn,
    pin: PinFn,
    unpin: UnpinFn,
    info: InfoFn,
    map: MapFn,
    unmap: UnmapFn,
    copy_to: CopyToFn,
    copy_from: CopyFromFn,
    // Keeps the code behind the pointers above mapped; dropped last.
    _lib: libloading::Library,
}

/// Entry points that must be present.
pub const REQUIRED: &[&str] = &[
    "gdr_open",
    "gdr_close",
    "gdr_pin_buffer",
    "gdr_unpin_buffer",
    "gdr_map",
    "gdr_unmap",
    "gdr_copy_to_mapping",
    "gdr_copy_from_mapping",
];

impl GdrApi {
    /// Load `name` (e.g. `libgdrapi.so.2`) and resolve every entry point. The error string is
    /// the reason the component is unavailable.
    pub fn load(name: &str) -> std::result::Result<GdrApi, String> {
        // SAFETY: loading a shared library runs its initializers; libgdrapi's only open a log
        // configuration. The name is the configured gdrcopy library.
        let lib = unsafe { libloading::Library::new(name) }
            .map_err(|e| format!("{name} could not be loaded: {e} (install gdrcopy, or set RUCX_GDR_COPY_LIB to its path)"))?;
        let has = |s: &str| {
            // SAFETY: looking a symbol up has no side effect; the pointer is not used.
            unsafe { lib.get::<*const c_void>(s.as_bytes()) }.is_ok()
        };
        let missing: Vec<&str> = REQUIRED.iter().copied().filter(|s| !has(s)).collect();
        let info_name = if has("gdr_get_info_v2") {
            "gdr_get_info_v2"
        } else if has("gdr_get_info") {
            "gdr_get_info"
        } else {
            ""
        };
        if !missing.is_empty() || info_name.is_empty() {
            let mut all = missing.join(", ");
            if info_name.is_empty() {
                if !all.is_empty() {
                    all.push_str(", ");
                }
                all.push_str("gdr_get_info");
            }
            return Err(format!(
                "{name} is not a usable gdrcopy library: it lacks {all} (gdrcopy 2.0 or newer is \
                 needed)"
            ));
        }
        /// Copy a function pointer out of the library.
        ///
        /// # Safety
        /// `T` must be the symbol's real signature.
        unsafe fn sym<T: Copy>(lib: &libloading::Library, s: &str) -> T {
            // SAFETY: presence was checked above; the caller names the right type.
            unsafe { *lib.get::<T>(s.as_bytes()).expect("checked present") }
        }
        // SAFETY: each type alias matches the prototype in gdrapi.h quoted in the module docs.
        unsafe {
            Ok(GdrApi {
                name: name.to_string(),
                open: sym(&lib, "gdr_open"),
                close: sym(&lib, "gdr_close"),
                pin: sym(&lib, "gdr_pin_buffer"),
                unpin: sym(&lib, "gdr_unpin_buffer"),
                info: sym(&lib, info_name),
                map: sym(&lib, "gdr_map"),
                unmap: sym(&lib, "gdr_unmap"),
                copy_to: sym(&lib, "gdr_copy_to_mapping"),
                copy_from: sym(&lib, "gdr_copy_from_mapping"),
                _lib: lib,
            })
        }
    }

    /// Library name as loaded.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Why the gdrdrv driver cannot be used, if it cannot (the device file is missing).
pub fn check_device(path: &Path) -> std::result::Result<(), String> {
    if path.exists() {
        Ok(())
    } else {
        Err(format!(
            "the gdrdrv kernel driver is not loaded: {} does not exist (load it with gdrcopy's \
             insmod.sh or `modprobe gdrdrv`)",
            path.display()
        ))
    }
}

/// An open connection to gdrdrv (`gdr_t`), closed on drop.
#[derive(Debug)]
pub struct Gdr {
    api: std::sync::Arc<GdrApi>,
    g: GdrT,
}

// SAFETY: a gdr_t is a file descriptor plus library bookkeeping; gdrcopy's calls on it are
// thread-safe (the library locks internally) and we close it once, in Drop.
unsafe impl Send for Gdr {}
// SAFETY: see `Send`.
unsafe impl Sync for Gdr {}

impl Gdr {
    /// `gdr_open`.
    pub fn open(api: std::sync::Arc<GdrApi>) -> Result<Gdr> {
        // SAFETY: the entry point is resolved; it takes no argument.
        let g = unsafe { (api.open)() };
        if g.is_null() {
            return Err(Error::Unavailable {
                component: crate::NAME.into(),
                reason: format!(
                    "gdr_open failed: {DEVICE_FILE} could not be opened (is gdrdrv loaded and \
                     the device readable by this user?)"
                ),
            });
        }
        Ok(Gdr { api, g })
    }

    /// Pin `size` bytes of device memory at `addr` (both GPU-page aligned).
    pub fn pin(&self, addr: u64, size: usize) -> std::result::Result<GdrMh, c_int> {
        let mut mh = GdrMh::default();
        // SAFETY: `g` is open; `mh` is a valid out-pointer; a bad range is reported as an error.
        let r = unsafe { (self.api.pin)(self.g, addr as c_ulong, size, 0, 0, &mut mh) };
        if r == 0 { Ok(mh) } else { Err(r) }
    }

    /// Unpin.
    pub fn unpin(&self, mh: GdrMh) -> c_int {
        // SAFETY: `mh` came from `pin` on this connection and is unpinned once by its owner.
        unsafe { (self.api.unpin)(self.g, mh) }
    }

    /// Information about a pinned range.
    pub fn info(&self, mh: GdrMh) -> std::result::Result<GdrInfo, c_int> {
        let mut info = GdrInfo::default();
        // SAFETY: `info` is larger than any layout the library writes.
        let r = unsafe { (self.api.info)(self.g, mh, &mut info) };
        if r == 0 { Ok(info) } else { Err(r) }
    }

    /// Map a pinned range into this process.
    pub fn map(&self, mh: GdrMh, size: usize) -> std::result::Result<*mut c_void, c_int> {
        let mut va: *mut c_void = std::ptr::null_mut();
        // SAFETY: `mh` is pinned on this connection; `va` is a valid out-pointer.
        let r = unsafe { (self.api.map)(self.g, mh, &mut va, size) };
        if r == 0 { Ok(va) } else { Err(r) }
    }

    /// Unmap.
    ///
    /// # Safety
    /// `va`/`size` must be a live mapping of `mh` made by [`map`](Self::map), unmapped once.
    pub unsafe fn unmap(&self, mh: GdrMh, va: *mut c_void, size: usize) -> c_int {
        // SAFETY: forwarded to the caller's contract.
        unsafe { (self.api.unmap)(self.g, mh, va, size) }
    }

    /// Copy host memory into a mapping.
    ///
    /// # Safety
    /// `dst..dst+len` must lie inside a live mapping of `mh`, and `src` must be readable.
    pub unsafe fn copy_to(
        &self,
        mh: GdrMh,
        dst: *mut c_void,
        src: *const c_void,
        len: usize,
    ) -> c_int {
        // SAFETY: forwarded to the caller's contract.
        unsafe { (self.api.copy_to)(mh, dst, src, len) }
    }

    /// Copy from a mapping into host memory.
    ///
    /// # Safety
    /// `src..src+len` must lie inside a live mapping of `mh`, and `dst` must be writable.
    pub unsafe fn copy_from(
        &self,
        mh: GdrMh,
        dst: *mut c_void,
        src: *const c_void,
        len: usize,
    ) -> c_int {
        // SAFETY: forwarded to the caller's contract.
        unsafe { (self.api.copy_from)(mh, dst, src, len) }
    }
}

impl Drop for Gdr {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed only here; registrations hold an Arc<Gdr>, so none
        // is left.
        let r = unsafe { (self.api.close)(self.g) };
        if r != 0 {
            tracing::warn!("gdr_close failed: {r}");
        }
    }
}

/// The GPU-page-aligned range `[start, start+size)` covering `addr..addr+len`.
pub fn page_span(addr: u64, len: u64) -> Option<(u64, u64)> {
    let start = addr & !(GPU_PAGE_SIZE - 1);
    let end = addr
        .checked_add(len.max(1))?
        .checked_add(GPU_PAGE_SIZE - 1)?
        & !(GPU_PAGE_SIZE - 1);
    Some((start, end - start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn missing_library_names_itself() {
        let e = GdrApi::load("libgdrapi-does-not-exist.so.2").unwrap_err();
        assert!(
            e.starts_with("libgdrapi-does-not-exist.so.2 could not be loaded"),
            "{e}"
        );
        assert!(e.contains("RUCX_GDR_COPY_LIB"), "{e}");
    }

    #[test]
    fn a_library_without_the_entry_points_is_refused() {
        // The C library loads everywhere and has none of gdrcopy's symbols.
        let e = GdrApi::load("libc.so.6").unwrap_err();
        assert!(e.contains("lacks gdr_open"), "{e}");
        assert!(e.contains("gdr_get_info"), "{e}");
    }

    #[test]
    fn device_file_check() {
        assert!(check_device(Path::new("/")).is_ok());
        let e = check_device(Path::new("/dev/gdrdrv-not-here")).unwrap_err();
        assert!(e.contains("gdrdrv kernel driver is not loaded"), "{e}");
        assert!(e.contains("/dev/gdrdrv-not-here does not exist"), "{e}");
    }

    #[test]
    fn page_spans() {
        assert_eq!(page_span(0x10000, 1), Some((0x10000, 0x10000)));
        assert_eq!(page_span(0x1ffff, 2), Some((0x10000, 0x20000)));
        assert_eq!(page_span(0x12345, 0), Some((0x10000, 0x10000)));
        assert_eq!(page_span(u64::MAX - 5, 10), None);
        assert!(
            std::mem::size_of::<GdrInfo>() >= 48,
            "room for gdr_info_v2_t"
        );
    }

    proptest! {
        #[test]
        fn span_covers_and_is_aligned(addr in 0u64..(1 << 50), len in 0u64..(1 << 30)) {
            let (s, n) = page_span(addr, len).unwrap();
            prop_assert_eq!(s % GPU_PAGE_SIZE, 0);
            prop_assert_eq!(n % GPU_PAGE_SIZE, 0);
            prop_assert!(s <= addr && addr + len.max(1) <= s + n);
            prop_assert!(n <= len.max(1) + 2 * GPU_PAGE_SIZE);
        }
    }
}
