//! A timeline of named points, for finding where the time of a critical path goes (as UCX's
//! `UCX_PROFILE_MODE=log`).
//!
//! Off unless `RUCX_PROFILE` names a file prefix: then every [`mark`] keeps the time (the
//! system's monotonic clock, the same in every process of a host, so two processes' timelines
//! merge), the thread, a point name and an argument in memory, and [`flush`] appends them to
//! `PREFIX.PID` as tab-separated text (`ns thread point arg`), which workers do when they end.
//! At most `RUCX_PROFILE_RECORDS` records (default 1,048,576, 32 bytes each) are kept between
//! flushes; later marks are counted as dropped and the count is written with the next flush.
//! Off, a mark costs one relaxed load and a branch.
//!
//! `tools/profile/timeline.py` merges the files of a ping-pong's two processes and prints the
//! median time between consecutive points of its iterations.

use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static LOG: Mutex<Option<Log>> = Mutex::new(None);

/// Default bound on the records kept between two flushes.
pub const DEFAULT_RECORDS: usize = 1 << 20;

struct Log {
    prefix: String,
    cap: usize,
    recs: Vec<Rec>,
}

#[derive(Clone, Copy)]
struct Rec {
    ns: u64,
    tid: u32,
    arg: u64,
    point: &'static str,
}

/// Whether marks are kept (`RUCX_PROFILE` set and not empty), read from the environment once.
#[inline]
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => init(),
    }
}

#[cold]
fn init() -> bool {
    let mut log = lock();
    if log.is_none() {
        let prefix = std::env::var("RUCX_PROFILE").unwrap_or_default();
        let cap = match std::env::var("RUCX_PROFILE_RECORDS") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    tracing::warn!(
                        "RUCX_PROFILE_RECORDS={v:?} is not a positive number of records; \
                         keeping at most {DEFAULT_RECORDS}"
                    );
                    DEFAULT_RECORDS
                }
            },
            Err(_) => DEFAULT_RECORDS,
        };
        if !prefix.is_empty() {
            *log = Some(Log {
                prefix,
                cap,
                recs: Vec::new(),
            });
        }
        let state = if log.is_some() { ON } else { OFF };
        STATE.store(state, Ordering::Relaxed);
    }
    log.is_some()
}

fn lock() -> std::sync::MutexGuard<'static, Option<Log>> {
    // A thread that panicked while holding the log left whole records behind.
    LOG.lock().unwrap_or_else(|p| p.into_inner())
}

/// The monotonic clock in nanoseconds (`CLOCK_MONOTONIC`, shared by the host's processes).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn thread_id() -> u32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as u32 }
}

/// Keep point `point` with argument `arg` (a message id, a length, a sequence number) at the
/// current time, when profiling is on.
#[inline]
pub fn mark(point: &'static str, arg: u64) {
    if enabled() {
        mark_slow(point, arg);
    }
}

#[cold]
#[inline(never)]
fn mark_slow(point: &'static str, arg: u64) {
    let rec = Rec {
        ns: now_ns(),
        tid: thread_id(),
        arg,
        point,
    };
    let mut log = lock();
    let Some(log) = log.as_mut() else {
        return;
    };
    if log.recs.len() >= log.cap {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if log.recs.capacity() == 0 {
        log.recs.reserve(log.cap.min(DEFAULT_RECORDS));
    }
    log.recs.push(rec);
}

/// Append the records kept so far to `PREFIX.PID` and forget them; nothing when profiling is
/// off or nothing was kept. A file that cannot be written is reported once as a warning
/// naming it, and its records are lost.
pub fn flush() {
    if !enabled() {
        return;
    }
    let (path, recs) = {
        let mut log = lock();
        let Some(log) = log.as_mut() else {
            return;
        };
        (
            format!("{}.{}", log.prefix, std::process::id()),
            std::mem::take(&mut log.recs),
        )
    };
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if recs.is_empty() && dropped == 0 {
        return;
    }
    if let Err(e) = write_out(&path, &recs, dropped) {
        tracing::warn!(
            "RUCX_PROFILE: could not write {} records to {path}: {e}",
            recs.len()
        );
    }
}

fn write_out(path: &str, recs: &[Rec], dropped: u64) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut w = std::io::BufWriter::new(f);
    for r in recs {
        writeln!(w, "{}\t{}\t{}\t{}", r.ns, r.tid, r.point, r.arg)?;
    }
    if dropped > 0 {
        writeln!(
            w,
            "# {dropped} records dropped: raise RUCX_PROFILE_RECORDS or flush more often"
        )?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_moves_forward() {
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
        assert!(a > 0);
    }

    #[test]
    fn records_are_written_in_order_and_forgotten() {
        // The state is process-wide: set it up directly rather than through the environment.
        let dir = std::env::temp_dir().join(format!("rucx-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prefix = dir.join("t").to_string_lossy().into_owned();
        *lock() = Some(Log {
            prefix: prefix.clone(),
            cap: 3,
            recs: Vec::new(),
        });
        STATE.store(ON, Ordering::Relaxed);
        mark("a", 1);
        mark("b", 2);
        mark("c", 3);
        mark("d", 4); // over the bound: dropped
        flush();
        flush(); // nothing new: nothing written
        let path = format!("{prefix}.{}", std::process::id());
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        let fields: Vec<Vec<&str>> = lines[..3].iter().map(|l| l.split('\t').collect()).collect();
        assert_eq!(
            fields.iter().map(|f| (f[2], f[3])).collect::<Vec<_>>(),
            [("a", "1"), ("b", "2"), ("c", "3")]
        );
        let ns: Vec<u64> = fields.iter().map(|f| f[0].parse().unwrap()).collect();
        assert!(ns.windows(2).all(|w| w[0] <= w[1]));
        assert!(lines[3].starts_with("# 1 records dropped"), "{text}");
        *lock() = None;
        STATE.store(OFF, Ordering::Relaxed);
        mark("e", 5); // off: nothing kept
        assert!(lock().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
