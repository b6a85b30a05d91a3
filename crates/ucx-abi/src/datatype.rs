//! `ucp_datatype_t`: contiguous types (the element size in the upper bits) and generic ones
//! (the caller's pack/unpack callbacks; the pointer to them in the upper bits). A generic send
//! is packed whole into a buffer of ours before it is posted; a generic receive lands in a
//! buffer of ours and is unpacked when it completes. IOV types are served by [`crate::iov`]
//! (told apart by [`is_iov`] off the contiguous path); strided ones are refused with
//! `UCS_ERR_UNSUPPORTED`.
//!
//! A generic type is a pointer in the caller's hands: every one `ucp_dt_create_generic` made is
//! kept in a registry until `ucp_dt_destroy`, and a generic value not in it (made up, corrupted,
//! destroyed already) is refused with `UCS_ERR_INVALID_PARAM`, never dereferenced. Contiguous
//! types, a number in the value, never look at the registry.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::{Mutex, PoisonError};

use crate::types::*;

/// A generic datatype: the caller's callbacks and context.
#[derive(Debug)]
#[repr(C, align(8))]
pub struct GenericDt {
    ops: GenericDtOps,
    context: *mut c_void,
}

/// A datatype, decoded.
#[derive(Debug, Clone, Copy)]
pub enum Dt {
    /// Elements of this many bytes.
    Contig(usize),
    Generic(*const GenericDt),
}

/// The generic types made and not destroyed, by address.
static LIVE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// Run `f` on the registry of live generic types (a panic elsewhere leaves it consistent: every
/// change is one insert or remove).
fn live<T>(f: impl FnOnce(&mut HashSet<usize>) -> T) -> T {
    let mut g = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    f(g.get_or_insert_with(HashSet::new))
}

/// An IOV datatype. [`classify`] leaves these to its callers' error path (`Err`, checked
/// there with this), so that the contiguous path is not one instruction longer for them:
/// [`crate::iov`] serves them.
#[inline]
pub fn is_iov(dt: u64) -> bool {
    dt & UCP_DATATYPE_CLASS_MASK == UCP_DATATYPE_IOV
}

/// Decode a `ucp_datatype_t` (IOV types: `Err`, see [`is_iov`]). A generic value that `ucp_dt_create_generic` did not make (or
/// that was destroyed) is `UCS_ERR_INVALID_PARAM`.
#[inline]
pub fn classify(dt: u64) -> Result<Dt, Status> {
    match dt & UCP_DATATYPE_CLASS_MASK {
        UCP_DATATYPE_CONTIG => Ok(Dt::Contig((dt >> UCP_DATATYPE_SHIFT) as usize)),
        UCP_DATATYPE_GENERIC => generic(dt),
        _ => Err(UCS_ERR_UNSUPPORTED),
    }
}

/// The generic type of value `dt`, if it is a live one.
#[cold]
fn generic(dt: u64) -> Result<Dt, Status> {
    let g = (dt & !UCP_DATATYPE_CLASS_MASK) as usize;
    if live(|l| l.contains(&g)) {
        Ok(Dt::Generic(g as *const GenericDt))
    } else {
        Err(UCS_ERR_INVALID_PARAM)
    }
}

/// Bytes of `count` contiguous elements of `elem` bytes.
#[inline]
pub fn contig_len(elem: usize, count: usize) -> Result<usize, Status> {
    elem.checked_mul(count)
        .filter(|n| *n <= isize::MAX as usize)
        .ok_or(UCS_ERR_INVALID_PARAM)
}

/// `ucs_status_t ucp_dt_create_generic(const ucp_generic_dt_ops_t *ops, void *context,
/// ucp_datatype_t *datatype_p)`: every callback must be set.
///
/// # Safety
/// `ops` NULL or valid; `datatype_p` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_dt_create_generic(
    ops: *const GenericDtOps,
    context: *mut c_void,
    datatype_p: *mut u64,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(ops) = (unsafe { ops.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if datatype_p.is_null()
        || ops.start_pack.is_none()
        || ops.start_unpack.is_none()
        || ops.packed_size.is_none()
        || ops.pack.is_none()
        || ops.unpack.is_none()
        || ops.finish.is_none()
    {
        return UCS_ERR_INVALID_PARAM;
    }
    let g = Box::into_raw(Box::new(GenericDt { ops: *ops, context }));
    live(|l| l.insert(g as usize));
    // SAFETY: checked non-NULL, writable by the caller's promise; the box is 8-aligned, so the
    // class bits are free.
    unsafe { *datatype_p = g as usize as u64 | UCP_DATATYPE_GENERIC };
    UCS_OK
}

/// `void ucp_dt_destroy(ucp_datatype_t datatype)`: frees a generic type (contiguous ones are
/// plain numbers). A generic value that is not a live type of ours (destroyed already, made
/// up) is left alone, with a warning.
///
/// # Safety
/// `datatype`, when a live generic type, is used by no operation in flight.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_dt_destroy(datatype: u64) {
    if datatype & UCP_DATATYPE_CLASS_MASK != UCP_DATATYPE_GENERIC {
        return;
    }
    let g = (datatype & !UCP_DATATYPE_CLASS_MASK) as usize;
    if live(|l| l.remove(&g)) {
        // SAFETY: made by `Box::into_raw` in `ucp_dt_create_generic` and live until now; just
        // taken out of the registry, so freed once.
        drop(unsafe { Box::from_raw(g as *mut GenericDt) });
    } else {
        tracing::warn!(
            "ucp_dt_destroy({datatype:#x}): not a generic datatype of ucp_dt_create_generic \
             (destroyed already?); ignored"
        );
    }
}

/// Pack `count` elements at `buf` whole, through the type's callbacks.
///
/// # Safety
/// `g` is a live generic type; `buf`/`count` what its callbacks accept.
pub unsafe fn pack_all(g: *const GenericDt, buf: *const c_void, count: usize) -> Vec<u8> {
    // SAFETY: the caller's promise; the callbacks were checked set at creation.
    unsafe {
        let g = &*g;
        let state = (g.ops.start_pack.expect("checked"))(g.context, buf, count);
        let size = (g.ops.packed_size.expect("checked"))(state);
        let mut out = vec![0u8; size];
        let mut off = 0;
        while off < size {
            let n = (g.ops.pack.expect("checked"))(
                state,
                off,
                out.as_mut_ptr().add(off).cast(),
                size - off,
            );
            if n == 0 {
                break;
            }
            off += n.min(size - off);
        }
        out.truncate(off);
        (g.ops.finish.expect("checked"))(state);
        out
    }
}

/// A generic receive's unpacking state (finished when dropped).
#[derive(Debug)]
pub struct Unpack {
    g: *const GenericDt,
    state: *mut c_void,
}

impl Unpack {
    /// Start unpacking into `buf`; also the packed size to receive.
    ///
    /// # Safety
    /// `g` is a live generic type; `buf`/`count` what its callbacks accept, until the receive
    /// completes.
    pub unsafe fn start(g: *const GenericDt, buf: *mut c_void, count: usize) -> (Unpack, usize) {
        // SAFETY: the caller's promise; callbacks checked set at creation.
        unsafe {
            let gr = &*g;
            let state = (gr.ops.start_unpack.expect("checked"))(gr.context, buf, count);
            let size = (gr.ops.packed_size.expect("checked"))(state);
            (Unpack { g, state }, size)
        }
    }

    /// Unpack the received bytes.
    pub fn unpack(&self, data: &[u8]) -> Status {
        if data.is_empty() {
            return UCS_OK;
        }
        // SAFETY: `self.g` outlives the receive (the caller's promise at `start`).
        unsafe {
            let g = &*self.g;
            (g.ops.unpack.expect("checked"))(self.state, 0, data.as_ptr().cast(), data.len())
        }
    }
}

impl Drop for Unpack {
    fn drop(&mut self) {
        // SAFETY: as in `unpack`; finish runs once.
        unsafe { ((*self.g).ops.finish.expect("checked"))(self.state) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_types() {
        assert!(matches!(classify(8 << 3), Ok(Dt::Contig(8))));
        assert!(matches!(classify(1 << 3), Ok(Dt::Contig(1))));
        assert_eq!(classify(UCP_DATATYPE_IOV).unwrap_err(), UCS_ERR_UNSUPPORTED);
        assert!(is_iov(UCP_DATATYPE_IOV) && !is_iov(8 << 3) && !is_iov(UCP_DATATYPE_GENERIC));
        assert_eq!(
            classify(UCP_DATATYPE_STRIDED).unwrap_err(),
            UCS_ERR_UNSUPPORTED
        );
        assert_eq!(
            classify(UCP_DATATYPE_GENERIC).unwrap_err(),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(contig_len(usize::MAX, 2), Err(UCS_ERR_INVALID_PARAM));
    }

    // A "every other byte" type: packs buf[0], buf[2], ... (count bytes).
    unsafe extern "C" fn sp(_: *mut c_void, b: *const c_void, n: usize) -> *mut c_void {
        Box::into_raw(Box::new((b as usize, n))).cast()
    }
    unsafe extern "C" fn su(_: *mut c_void, b: *mut c_void, n: usize) -> *mut c_void {
        Box::into_raw(Box::new((b as usize, n))).cast()
    }
    unsafe extern "C" fn size(s: *mut c_void) -> usize {
        // SAFETY: our state.
        unsafe { (*s.cast::<(usize, usize)>()).1 }
    }
    unsafe extern "C" fn pack(s: *mut c_void, off: usize, d: *mut c_void, max: usize) -> usize {
        // SAFETY: our state and buffers, within bounds.
        unsafe {
            let (b, n) = *s.cast::<(usize, usize)>();
            let k = max.min(n - off).min(3); // in pieces, to exercise the loop
            for i in 0..k {
                *d.cast::<u8>().add(i) = *(b as *const u8).add(2 * (off + i));
            }
            k
        }
    }
    unsafe extern "C" fn unpack(s: *mut c_void, off: usize, src: *const c_void, len: usize) -> i8 {
        // SAFETY: our state and buffers, within bounds.
        unsafe {
            let (b, _) = *s.cast::<(usize, usize)>();
            for i in 0..len {
                *(b as *mut u8).add(2 * (off + i)) = *src.cast::<u8>().add(i);
            }
        }
        UCS_OK
    }
    unsafe extern "C" fn finish(s: *mut c_void) {
        // SAFETY: made by Box::into_raw in start_*.
        drop(unsafe { Box::from_raw(s.cast::<(usize, usize)>()) });
    }

    #[test]
    fn generic_pack_unpack_round_trip() {
        let ops = GenericDtOps {
            start_pack: Some(sp),
            start_unpack: Some(su),
            packed_size: Some(size),
            pack: Some(pack),
            unpack: Some(unpack),
            finish: Some(finish),
        };
        let mut dt = 0u64;
        // SAFETY: valid ops and out pointer.
        let got = unsafe { ucp_dt_create_generic(&ops, std::ptr::null_mut(), &mut dt) };
        assert_eq!(got, 0);
        let Ok(Dt::Generic(g)) = classify(dt) else {
            panic!("not generic");
        };
        let src: Vec<u8> = (0..20).collect();
        // SAFETY: 10 elements of the type fit in `src`.
        let packed = unsafe { pack_all(g, src.as_ptr().cast(), 10) };
        assert_eq!(packed, (0..20).step_by(2).collect::<Vec<u8>>());
        let mut dst = vec![0xffu8; 20];
        // SAFETY: as above.
        let (u, n) = unsafe { Unpack::start(g, dst.as_mut_ptr().cast(), 10) };
        assert_eq!(n, 10);
        assert_eq!(u.unpack(&packed), UCS_OK);
        drop(u);
        assert!(
            dst.iter()
                .step_by(2)
                .zip(src.iter().step_by(2))
                .all(|(a, b)| a == b)
        );
        assert!(dst.iter().skip(1).step_by(2).all(|b| *b == 0xff));
        // SAFETY: made above, destroyed once.
        unsafe { ucp_dt_destroy(dt) };
        let mut missing = ops;
        missing.pack = None;
        // SAFETY: valid pointers.
        let got = unsafe { ucp_dt_create_generic(&missing, std::ptr::null_mut(), &mut dt) };
        assert_eq!(got, UCS_ERR_INVALID_PARAM);
    }
}
