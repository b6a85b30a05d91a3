//! Small sets of named event counters, in the spirit of UCX's statistics classes.
//!
//! A component declares its counter names once (a `&'static [&'static str]`, indexed by
//! position), bumps them with relaxed atomics from any thread, and prints a [`Snapshot`] as
//! `name: value` lines.
//!
//! ```
//! use rucx_ucs::stats::Counters;
//! const SENT: usize = 0;
//! const RETRIES: usize = 1;
//! let c = Counters::new("tcp_ep", &["sent", "retries"]);
//! c.inc(SENT);
//! c.add(RETRIES, 3);
//! assert_eq!(c.snapshot().to_string(), "sent: 1\nretries: 3\n");
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fixed set of named `u64` counters.
pub struct Counters {
    class: String,
    names: &'static [&'static str],
    values: Box<[AtomicU64]>,
}

impl fmt::Debug for Counters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counters")
            .field("class", &self.class)
            .field("values", &self.snapshot().values)
            .finish()
    }
}

impl Counters {
    /// Counters called `names`, all at zero. `class` names the owner in [`Snapshot`]s (e.g.
    /// `rcache:posix`).
    pub fn new(class: impl Into<String>, names: &'static [&'static str]) -> Self {
        Counters {
            class: class.into(),
            names,
            values: names.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The owner's name.
    pub fn class(&self) -> &str {
        &self.class
    }

    /// The counter names, in index order.
    pub fn names(&self) -> &'static [&'static str] {
        self.names
    }

    /// Add `n` to counter `idx` (wrapping at `u64::MAX`). An index past the declared names is a
    /// bug in the caller; it is ignored in release builds and asserted in debug builds.
    pub fn add(&self, idx: usize, n: u64) {
        debug_assert!(idx < self.values.len(), "counter index {idx} out of range");
        if let Some(v) = self.values.get(idx) {
            v.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Add one to counter `idx`.
    pub fn inc(&self, idx: usize) {
        self.add(idx, 1);
    }

    /// Current value of counter `idx` (0 for an index past the declared names).
    pub fn get(&self, idx: usize) -> u64 {
        self.values
            .get(idx)
            .map_or(0, |v| v.load(Ordering::Relaxed))
    }

    /// Current value of the counter called `name`.
    pub fn by_name(&self, name: &str) -> Option<u64> {
        let idx = self.names.iter().position(|n| *n == name)?;
        Some(self.get(idx))
    }

    /// Set every counter back to zero.
    pub fn reset(&self) {
        for v in self.values.iter() {
            v.store(0, Ordering::Relaxed);
        }
    }

    /// The current values. Each counter is read atomically; the set as a whole is not a single
    /// atomic picture when other threads keep counting.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            class: self.class.clone(),
            values: self
                .names
                .iter()
                .zip(self.values.iter())
                .map(|(n, v)| (*n, v.load(Ordering::Relaxed)))
                .collect(),
        }
    }
}

/// Values of a [`Counters`] set at one moment. `Display` prints one `name: value` line per
/// counter, in declaration order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The owner's name.
    pub class: String,
    /// `(name, value)` in declaration order.
    pub values: Vec<(&'static str, u64)>,
}

impl Snapshot {
    /// The value of counter `name`.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, v) in &self.values {
            writeln!(f, "{n}: {v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn counts_and_prints() {
        let c = Counters::new("test", &["hits", "misses", "bytes"]);
        c.inc(0);
        c.inc(0);
        c.add(2, 4096);
        assert_eq!(c.get(0), 2);
        assert_eq!(c.get(1), 0);
        assert_eq!(c.by_name("bytes"), Some(4096));
        assert_eq!(c.by_name("nope"), None);
        let s = c.snapshot();
        assert_eq!(s.class, "test");
        assert_eq!(s.get("hits"), Some(2));
        assert_eq!(s.to_string(), "hits: 2\nmisses: 0\nbytes: 4096\n");
        c.reset();
        assert_eq!(c.snapshot().to_string(), "hits: 0\nmisses: 0\nbytes: 0\n");
        assert!(format!("{c:?}").contains("test"));
    }

    #[test]
    fn concurrent_increments_are_not_lost() {
        let c = Arc::new(Counters::new("mt", &["n"]));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.inc(0);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(c.get(0), 4000);
    }
}
