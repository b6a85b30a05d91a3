//! Boxed protocol states kept for reuse: a rendezvous boxes its state (`RndvSend`, `RndvRecv`)
//! so that small messages keep a small request, and with a window of rendezvous messages in
//! flight the allocator saw bursts of frees and allocations of a few hundred bytes each, past
//! its per-thread cache. A [`Pooled`] box goes back, blanked, to a small per-thread list when
//! dropped and is taken from it when made; the registration guard lists of ended requests are
//! kept the same way (with both, 400-530 fewer instructions a 64 KiB message and side:
//! docs/performance.md, "Issue 17, seventh sitting").

use std::cell::RefCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

use crate::context::RegGuard;

/// Boxes kept per thread and type: at least a window of requests.
pub(crate) const SPARE_MAX: usize = 64;

/// A state that can be pooled: a cheap blank value (its resources dropped) and its thread's list.
pub(crate) trait Spare: Sized + 'static {
    /// The value a box is reset to when it goes back (dropping what the old one held).
    fn blank() -> Self;
    /// This thread's boxes of this type.
    fn spares() -> &'static LocalKey<RefCell<Vec<Box<Self>>>>;
}

/// A box of `T` taken from, and given back to, this thread's spares of `T`.
pub(crate) struct Pooled<T: Spare>(Option<Box<T>>);

impl<T: Spare> Pooled<T> {
    /// `v` in a spare box (a new one when the thread has none).
    #[inline]
    pub(crate) fn new(v: T) -> Self {
        let spare = T::spares()
            .try_with(|s| s.borrow_mut().pop())
            .ok()
            .flatten();
        Pooled(Some(match spare {
            Some(mut b) => {
                *b = v;
                b
            }
            None => Box::new(v),
        }))
    }
}

impl<T: Spare + Default> Default for Pooled<T> {
    #[inline]
    fn default() -> Self {
        Pooled::new(T::default())
    }
}

impl<T: Spare> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(mut b) = self.0.take() {
            // What the state held (keys, registrations) is dropped now, as with a plain box.
            *b = T::blank();
            // During thread teardown the list may be gone: the box is then simply freed.
            let _ = T::spares().try_with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < SPARE_MAX {
                    s.push(b);
                }
            });
        }
    }
}

impl<T: Spare> Deref for Pooled<T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        self.0
            .as_deref()
            .expect("a pooled box is only empty while dropped")
    }
}

impl<T: Spare> DerefMut for Pooled<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        self.0
            .as_deref_mut()
            .expect("a pooled box is only empty while dropped")
    }
}

impl<T: Spare + fmt::Debug> fmt::Debug for Pooled<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

thread_local! {
    /// Emptied guard lists of ended requests, their capacity kept.
    static GUARD_LISTS: RefCell<Vec<Vec<RegGuard>>> = const { RefCell::new(Vec::new()) };
}

/// Add `g` to a request's guards, in a spare list when the request has none yet (a host
/// rendezvous registers its buffer once per message: the list's allocation is reused).
#[inline]
pub(crate) fn push_guard(guards: &mut Vec<RegGuard>, g: RegGuard) {
    if guards.capacity() == 0
        && let Some(v) = GUARD_LISTS
            .try_with(|s| s.borrow_mut().pop())
            .ok()
            .flatten()
    {
        *guards = v;
    }
    guards.push(g);
}

/// Drop a request's guards now (its registrations are released), keeping the list's
/// allocation for the next request that registers.
#[inline]
pub(crate) fn release_guards(guards: &mut Vec<RegGuard>) {
    guards.clear();
    if guards.capacity() == 0 || guards.capacity() > 8 {
        return;
    }
    let v = std::mem::take(guards);
    let _ = GUARD_LISTS.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < SPARE_MAX {
            s.push(v);
        }
    });
}

/// Implement [`Spare`] for a type with a blank value, with its own per-thread list.
macro_rules! spare_type {
    ($t:ty, $blank:expr) => {
        impl $crate::spare::Spare for $t {
            #[inline]
            fn blank() -> Self {
                $blank
            }
            fn spares() -> &'static ::std::thread::LocalKey<
                ::std::cell::RefCell<::std::vec::Vec<::std::boxed::Box<Self>>>,
            > {
                ::std::thread_local! {
                    static SPARES: ::std::cell::RefCell<::std::vec::Vec<::std::boxed::Box<$t>>> =
                        const { ::std::cell::RefCell::new(::std::vec::Vec::new()) };
                }
                &SPARES
            }
        }
    };
}
pub(crate) use spare_type;

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    #[derive(Default)]
    struct Held {
        rc: Option<Rc<()>>,
        n: u64,
    }
    spare_type!(Held, Held { rc: None, n: 0 });

    fn spare_count() -> usize {
        Held::spares().with(|s| s.borrow().len())
    }

    #[test]
    fn dropped_boxes_are_blanked_and_reused() {
        let rc = Rc::new(());
        let a = Pooled::new(Held {
            rc: Some(rc.clone()),
            n: 7,
        });
        assert_eq!(a.n, 7);
        assert_eq!(Rc::strong_count(&rc), 2);
        let addr = &*a as *const Held as usize;
        drop(a);
        // What it held is released at the drop, not when the box is reused.
        assert_eq!(Rc::strong_count(&rc), 1);
        assert_eq!(spare_count(), 1);
        let mut b = Pooled::new(Held { rc: None, n: 9 });
        assert_eq!(&*b as *const Held as usize, addr, "the spare box is reused");
        assert_eq!((b.rc.is_none(), b.n), (true, 9));
        b.n = 10;
        assert_eq!(b.n, 10);
        assert_eq!(spare_count(), 0);
        drop(b);
    }

    #[test]
    fn at_most_spare_max_are_kept() {
        let many: Vec<_> = (0..SPARE_MAX + 5)
            .map(|i| {
                Pooled::new(Held {
                    rc: Some(Rc::new(())),
                    n: i as u64,
                })
            })
            .collect();
        drop(many);
        assert_eq!(spare_count(), SPARE_MAX);
        let again: Vec<_> = (0..SPARE_MAX + 5)
            .map(|_| Pooled::<Held>::default())
            .collect();
        assert!(again.iter().all(|h| h.n == 0 && h.rc.is_none()));
        assert_eq!(spare_count(), 0);
    }
}
