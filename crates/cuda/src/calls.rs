//! How often rucx called each CUDA driver entry point, and (when asked) how long it spent in
//! them: one relaxed atomic counter per entry point, process-wide.
//!
//! Every driver call rucx makes goes through [`cu!`](crate::cu), which counts it in its slot
//! here before the call returns; wall time inside the driver is added as well while
//! [`set_timing`] is on (off by default: reading the clock twice costs more than most of the
//! calls it would time). [`snapshot`] reads every counter, and [`Counts::since`] gives what
//! happened between two snapshots, e.g. per message of a benchmark:
//!
//! ```
//! use rucx_cuda::calls::{self, Call};
//!
//! let before = calls::snapshot();
//! // ... the work to look at ...
//! let d = calls::snapshot().since(&before);
//! for (call, n, nanos) in d.nonzero() {
//!     println!("{}: {n} calls, {nanos} ns", call.name());
//! }
//! assert!(d.calls(Call::cuMemcpyAsync) <= d.total_calls());
//! ```
//!
//! The counters are per process and shared by every thread: what one thread's work cost is
//! only its delta when no other thread calls the driver meanwhile.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

macro_rules! entry_points {
    ($($name:ident),* $(,)?) => {
        /// A CUDA driver entry point that rucx calls (the exact exported name).
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Call {
            $(
                #[doc = concat!("`", stringify!($name), "`")]
                $name,
            )*
        }

        impl Call {
            /// Every counted entry point, in the order of their slots.
            pub const ALL: &'static [Call] = &[$(Call::$name),*];

            /// The exported name, e.g. `cuMemcpyAsync`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Call::$name => stringify!($name),)*
                }
            }
        }
    };
}

entry_points!(
    cuInit,
    cuDriverGetVersion,
    cuGetErrorString,
    cuDeviceGetCount,
    cuDeviceGet,
    cuDeviceGetName,
    cuDeviceGetAttribute,
    cuDeviceGetPCIBusId,
    cuDeviceGetUuid_v2,
    cuDeviceTotalMem_v2,
    cuDeviceCanAccessPeer,
    cuDevicePrimaryCtxRetain,
    cuCtxSetCurrent,
    cuCtxGetCurrent,
    cuCtxSynchronize,
    cuCtxEnablePeerAccess,
    cuPointerGetAttributes,
    cuPointerSetAttribute,
    cuMemAlloc_v2,
    cuMemFree_v2,
    cuMemAllocManaged,
    cuMemAllocAsync,
    cuMemFreeAsync,
    cuMemHostAlloc,
    cuMemFreeHost,
    cuMemHostRegister_v2,
    cuMemHostUnregister,
    cuMemGetHandleForAddressRange,
    cuMemcpy,
    cuMemcpyAsync,
    cuMemsetD8_v2,
    cuStreamCreate,
    cuStreamDestroy_v2,
    cuStreamSynchronize,
    cuLaunchHostFunc,
    cuEventCreate,
    cuEventRecord,
    cuEventQuery,
    cuEventSynchronize,
    cuEventDestroy_v2,
    cuIpcGetMemHandle,
    cuIpcOpenMemHandle_v2,
    cuIpcCloseMemHandle,
    cuModuleLoadData,
    cuModuleGetFunction,
    cuLaunchKernel,
    cuStreamWriteValue64_v2,
    cuMemHostGetDevicePointer_v2,
);

/// One entry point's counters, on a cache line of its own (threads calling different entry
/// points do not share a line).
#[repr(align(64))]
struct Slot {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            calls: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }
}

static SLOTS: [Slot; Call::ALL.len()] = [const { Slot::new() }; Call::ALL.len()];
static TIMING: AtomicBool = AtomicBool::new(false);

/// Measure wall time inside the driver too (for every thread, from the next call on), or stop.
pub fn set_timing(on: bool) {
    TIMING.store(on, Ordering::Relaxed);
}

/// Turn timing on when `RUCX_CUDA_CALL_TIMING` says so (called once, when the driver loads).
pub(crate) fn timing_from_env() {
    let var = format!("{}CUDA_CALL_TIMING", rucx_ucs::config::ENV_PREFIX);
    let Ok(v) = std::env::var(&var) else {
        return;
    };
    match rucx_ucs::Config::new(&[crate::CONFIG]).and_then(|mut c| {
        c.set("CUDA_CALL_TIMING", &v)?;
        Ok(c.bool("CUDA_CALL_TIMING"))
    }) {
        Ok(on) => set_timing(on),
        Err(e) => tracing::warn!("{e}; CUDA driver calls are counted but not timed"),
    }
}

/// Whether wall time inside the driver is measured.
pub fn timing() -> bool {
    TIMING.load(Ordering::Relaxed)
}

/// Called by [`cu!`](crate::cu) before the driver call: the start time when timing is on.
#[doc(hidden)]
#[inline(always)]
pub fn enter() -> Option<Instant> {
    if TIMING.load(Ordering::Relaxed) {
        Some(Instant::now())
    } else {
        None
    }
}

/// Called by [`cu!`](crate::cu) after the driver call returned: count it (and its time).
#[doc(hidden)]
#[inline(always)]
pub fn leave(call: Call, start: Option<Instant>) {
    let slot = &SLOTS[call as usize];
    slot.calls.fetch_add(1, Ordering::Relaxed);
    if let Some(t) = start {
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        slot.nanos.fetch_add(ns, Ordering::Relaxed);
    }
}

/// Count one call of `call` around `f` (what [`cu!`](crate::cu) does around a driver call).
#[inline(always)]
pub fn counted<T>(call: Call, f: impl FnOnce() -> T) -> T {
    let t = enter();
    let r = f();
    leave(call, t);
    r
}

/// Call a CUDA driver entry point of [`sys`](crate::sys) and count it in [`calls`](crate::calls):
/// `cu!(cuEventQuery(ev))` is `sys::cuEventQuery(ev)`, counted. Unsafe as the call is: use it
/// inside an `unsafe` block with the call's `SAFETY` reasoning.
#[macro_export]
macro_rules! cu {
    ($f:ident ( $($a:expr),* $(,)? )) => {{
        let __rucx_t = $crate::calls::enter();
        let __rucx_r = $crate::sys::$f($($a),*);
        $crate::calls::leave($crate::calls::Call::$f, __rucx_t);
        __rucx_r
    }};
}

/// The counters at one moment (or the difference of two moments, [`Counts::since`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counts {
    calls: Vec<u64>,
    nanos: Vec<u64>,
}

/// Read every counter (each read on its own: calls on other threads meanwhile may show in some
/// and not in others).
pub fn snapshot() -> Counts {
    Counts {
        calls: SLOTS
            .iter()
            .map(|s| s.calls.load(Ordering::Relaxed))
            .collect(),
        nanos: SLOTS
            .iter()
            .map(|s| s.nanos.load(Ordering::Relaxed))
            .collect(),
    }
}

impl Counts {
    /// Nothing counted.
    pub fn zero() -> Counts {
        Counts {
            calls: vec![0; Call::ALL.len()],
            nanos: vec![0; Call::ALL.len()],
        }
    }

    /// What was counted after `earlier` (saturating: counters never go down).
    pub fn since(&self, earlier: &Counts) -> Counts {
        let sub =
            |a: &[u64], b: &[u64]| a.iter().zip(b).map(|(x, y)| x.saturating_sub(*y)).collect();
        Counts {
            calls: sub(&self.calls, &earlier.calls),
            nanos: sub(&self.nanos, &earlier.nanos),
        }
    }

    /// Calls of one entry point.
    pub fn calls(&self, call: Call) -> u64 {
        self.calls[call as usize]
    }

    /// Nanoseconds inside one entry point (0 unless timing was on).
    pub fn nanos(&self, call: Call) -> u64 {
        self.nanos[call as usize]
    }

    /// Calls of every entry point together.
    pub fn total_calls(&self) -> u64 {
        self.calls.iter().sum()
    }

    /// Nanoseconds inside the driver together.
    pub fn total_nanos(&self) -> u64 {
        self.nanos.iter().sum()
    }

    /// (entry point, calls, nanoseconds) of those called at least once, most called first
    /// (then by name).
    pub fn nonzero(&self) -> Vec<(Call, u64, u64)> {
        let mut v: Vec<(Call, u64, u64)> = Call::ALL
            .iter()
            .map(|&c| (c, self.calls(c), self.nanos(c)))
            .filter(|&(_, n, _)| n > 0)
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.name().cmp(b.0.name())));
        v
    }

    /// One line of the calls per unit of work (`per` units, e.g. messages): `cuEventQuery 3.20,
    /// cuMemcpyAsync 1.00, ...`, with the time inside each (`0.41 us`) when any was measured;
    /// `none` when nothing was called.
    pub fn per_unit_line(&self, per: u64) -> String {
        let per = per.max(1) as f64;
        let timed = self.total_nanos() > 0;
        let mut parts: Vec<String> = self
            .nonzero()
            .into_iter()
            .map(|(c, n, ns)| {
                if timed {
                    format!(
                        "{} {:.2} ({:.2} us)",
                        c.name(),
                        n as f64 / per,
                        ns as f64 / per / 1e3
                    )
                } else {
                    format!("{} {:.2}", c.name(), n as f64 / per)
                }
            })
            .collect();
        if parts.is_empty() {
            return "none".into();
        }
        let total = if timed {
            format!(
                "total {:.2} ({:.2} us)",
                self.total_calls() as f64 / per,
                self.total_nanos() as f64 / per / 1e3
            )
        } else {
            format!("total {:.2}", self.total_calls() as f64 / per)
        };
        parts.insert(0, total);
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_exported_ones_and_slots_follow_the_order() {
        assert_eq!(Call::cuMemcpyAsync.name(), "cuMemcpyAsync");
        assert_eq!(Call::cuIpcOpenMemHandle_v2.name(), "cuIpcOpenMemHandle_v2");
        for (i, c) in Call::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
            assert!(c.name().starts_with("cu"), "{c:?}");
        }
        // Every entry point the driver loader insists on is counted under its own name.
        for s in crate::driver::REQUIRED_SYMBOLS {
            if *s == "cuGetErrorName" {
                continue; // never called (names come from the enum's Debug)
            }
            assert!(
                Call::ALL.iter().any(|c| c.name() == *s),
                "{s} has no counter"
            );
        }
    }

    // One test touches the process-wide counters (tests run on parallel threads): it owns
    // cuCtxGetCurrent's slot, which nothing else in this crate's unit tests calls.
    #[test]
    fn counting_and_timing() {
        let c = Call::cuCtxGetCurrent;
        let a = snapshot();
        for i in 0..5u32 {
            assert_eq!(counted(c, || i * 2), i * 2);
        }
        let b = snapshot();
        let d = b.since(&a);
        assert_eq!(d.calls(c), 5);
        assert_eq!(d.nanos(c), 0, "timing is off by default");
        assert!(d.nonzero().iter().any(|&(x, n, _)| x == c && n == 5));
        assert!(
            d.per_unit_line(5).contains("cuCtxGetCurrent 1.00"),
            "{}",
            d.per_unit_line(5)
        );

        set_timing(true);
        assert!(timing());
        counted(c, || {
            std::thread::sleep(std::time::Duration::from_millis(2))
        });
        set_timing(false);
        let e = snapshot().since(&b);
        assert_eq!(e.calls(c), 1);
        assert!(e.nanos(c) >= 2_000_000, "{} ns", e.nanos(c));
        let line = e.per_unit_line(1);
        assert!(line.contains("cuCtxGetCurrent 1.00 ("), "{line}");
        assert!(line.starts_with("total "), "{line}");
        // An earlier snapshot is never larger: the difference saturates rather than wraps.
        assert_eq!(a.since(&b).calls(c), 0);
    }

    #[test]
    fn lines_and_orders() {
        let mut calls = vec![0; Call::ALL.len()];
        let nanos = vec![0; Call::ALL.len()];
        calls[Call::cuEventQuery as usize] = 30;
        calls[Call::cuMemcpyAsync as usize] = 10;
        calls[Call::cuEventRecord as usize] = 10;
        let d = Counts { calls, nanos };
        assert_eq!(d.total_calls(), 50);
        assert_eq!(
            d.per_unit_line(10),
            "total 5.00, cuEventQuery 3.00, cuEventRecord 1.00, cuMemcpyAsync 1.00"
        );
        assert_eq!(Counts::zero().per_unit_line(0), "none");
        assert_eq!(Counts::zero().total_calls(), 0);
    }
}
