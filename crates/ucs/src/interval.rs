//! An ordered map of non-overlapping half-open intervals `[start, end)` to values.
//!
//! This is the data structure under the registration cache ([`crate::rcache`]) and the
//! memory-type cache ([`crate::memtype_cache`]). Entries are kept in a `BTreeMap` keyed by their
//! start; because entries never overlap, their ends are ordered the same way as their starts, so
//! the one entry that can contain a point is the one with the greatest start not above it.
//!
//! Empty intervals (`start >= end`) are never stored, and an empty query range overlaps nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound::Excluded;
use std::ops::Range;

/// Why [`IntervalMap::insert`] refused an entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InsertError<K, V> {
    /// The range is empty (`start >= end`); the value is handed back.
    Empty {
        /// The rejected range.
        range: Range<K>,
        /// The value that was not inserted.
        value: V,
    },
    /// The range overlaps an existing entry; the value is handed back.
    Overlaps {
        /// The rejected range.
        range: Range<K>,
        /// The first existing entry it overlaps.
        existing: Range<K>,
        /// The value that was not inserted.
        value: V,
    },
}

impl<K, V> InsertError<K, V> {
    /// The value that was not inserted.
    pub fn into_value(self) -> V {
        match self {
            InsertError::Empty { value, .. } | InsertError::Overlaps { value, .. } => value,
        }
    }
}

impl<K: fmt::Debug, V> fmt::Display for InsertError<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InsertError::Empty { range, .. } => {
                write!(f, "cannot insert the empty interval {range:?}")
            }
            InsertError::Overlaps {
                range, existing, ..
            } => write!(
                f,
                "interval {range:?} overlaps the existing interval {existing:?}"
            ),
        }
    }
}

impl<K: fmt::Debug, V: fmt::Debug> std::error::Error for InsertError<K, V> {}

/// Ordered map from non-overlapping half-open intervals to values.
#[derive(Clone, PartialEq, Eq)]
pub struct IntervalMap<K, V> {
    /// start -> (end, value)
    map: BTreeMap<K, (K, V)>,
}

impl<K: Ord + Copy, V> Default for IntervalMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Copy + fmt::Debug, V: fmt::Debug> fmt::Debug for IntervalMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: Ord + Copy, V> IntervalMap<K, V> {
    /// An empty map.
    pub fn new() -> Self {
        IntervalMap {
            map: BTreeMap::new(),
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when the map has no entry.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Remove every entry.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Insert `value` for `range`. The range must be non-empty and overlap no existing entry
    /// (touching is fine: `[0, 4)` and `[4, 8)` do not overlap); otherwise the map is unchanged
    /// and the value is handed back in the error.
    pub fn insert(&mut self, range: Range<K>, value: V) -> Result<(), InsertError<K, V>> {
        if range.start >= range.end {
            return Err(InsertError::Empty { range, value });
        }
        if let Some((existing, _)) = self.overlapping(range.clone()).next() {
            return Err(InsertError::Overlaps {
                range,
                existing,
                value,
            });
        }
        self.map.insert(range.start, (range.end, value));
        Ok(())
    }

    /// The entry containing `point`, if any.
    pub fn get(&self, point: K) -> Option<(Range<K>, &V)> {
        let (&start, (end, v)) = self.map.range(..=point).next_back()?;
        (point < *end).then_some((start..*end, v))
    }

    /// The entry that covers all of `range` (`entry.start <= range.start && range.end <=
    /// entry.end`), if any. An empty `range` is covered by the entry containing its start.
    pub fn covering(&self, range: Range<K>) -> Option<(Range<K>, &V)> {
        let (&start, (end, v)) = self.map.range(..=range.start).next_back()?;
        (range.start < *end && range.end <= *end).then_some((start..*end, v))
    }

    /// The entry that starts exactly at `start`.
    pub fn get_by_start(&self, start: K) -> Option<(Range<K>, &V)> {
        self.map.get(&start).map(|(end, v)| (start..*end, v))
    }

    /// Mutable access to the value of the entry that starts exactly at `start`.
    pub fn get_mut_by_start(&mut self, start: K) -> Option<&mut V> {
        self.map.get_mut(&start).map(|(_, v)| v)
    }

    /// Every entry that overlaps `range`, in address order. An empty `range` overlaps nothing.
    pub fn overlapping(&self, range: Range<K>) -> impl Iterator<Item = (Range<K>, &V)> + '_ {
        let nonempty = range.start < range.end;
        // The entry starting at or before range.start, if it reaches into the range.
        let first = if nonempty {
            self.map
                .range(..=range.start)
                .next_back()
                .filter(|(_, (end, _))| *end > range.start)
        } else {
            None
        };
        // Entries starting strictly inside the range.
        let rest = if nonempty {
            Some(self.map.range((Excluded(range.start), Excluded(range.end))))
        } else {
            None
        };
        first
            .into_iter()
            .chain(rest.into_iter().flatten())
            .map(|(&s, (e, v))| (s..*e, v))
    }

    /// Remove the entry starting exactly at `start`.
    pub fn remove(&mut self, start: K) -> Option<(Range<K>, V)> {
        self.map.remove(&start).map(|(end, v)| (start..end, v))
    }

    /// Remove every entry that overlaps `range` (whole entries, not just the overlapping part)
    /// and return them in address order.
    pub fn remove_overlapping(&mut self, range: Range<K>) -> Vec<(Range<K>, V)> {
        let starts: Vec<K> = self.overlapping(range).map(|(r, _)| r.start).collect();
        starts.into_iter().filter_map(|s| self.remove(s)).collect()
    }

    /// Every entry, in address order.
    pub fn iter(&self) -> impl Iterator<Item = (Range<K>, &V)> + '_ {
        self.map.iter().map(|(&s, (e, v))| (s..*e, v))
    }

    /// Every entry with mutable values, in address order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (Range<K>, &mut V)> + '_ {
        self.map.iter_mut().map(|(&s, (e, v))| (s..*e, v))
    }

    /// The entry with the greatest start, if any.
    pub fn last(&self) -> Option<(Range<K>, &V)> {
        self.map.iter().next_back().map(|(&s, (e, v))| (s..*e, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn basic_queries() {
        let mut m = IntervalMap::new();
        m.insert(10u64..20, "a").unwrap();
        m.insert(20..30, "b").unwrap();
        m.insert(40..50, "c").unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m.get(9), None);
        assert_eq!(m.get(10), Some((10..20, &"a")));
        assert_eq!(m.get(19), Some((10..20, &"a")));
        assert_eq!(m.get(20), Some((20..30, &"b")));
        assert_eq!(m.get(35), None);
        assert_eq!(m.covering(12..18), Some((10..20, &"a")));
        assert_eq!(m.covering(12..20), Some((10..20, &"a")));
        assert_eq!(m.covering(12..21), None, "spans two entries");
        assert_eq!(m.covering(30..31), None);
        let o: Vec<_> = m.overlapping(15..45).map(|(r, v)| (r, *v)).collect();
        assert_eq!(o, vec![(10..20, "a"), (20..30, "b"), (40..50, "c")]);
        assert_eq!(
            m.overlapping(30..40).count(),
            0,
            "touching is not overlapping"
        );
        assert_eq!(m.overlapping(15..15).count(), 0, "empty query");
        assert_eq!(m.last(), Some((40..50, &"c")));
    }

    #[test]
    fn insert_rejects_overlap_and_empty() {
        let mut m = IntervalMap::new();
        m.insert(10usize..20, 1).unwrap();
        let e = m.insert(15..25, 2).unwrap_err();
        assert!(
            e.to_string().contains("15..25") && e.to_string().contains("10..20"),
            "{e}"
        );
        assert_eq!(e.into_value(), 2);
        let e = m.insert(5..5, 3).unwrap_err();
        assert!(matches!(e, InsertError::Empty { .. }));
        assert!(m.insert(0..11, 4).is_err());
        assert!(m.insert(19..21, 4).is_err());
        assert!(
            m.insert(0..100, 4).is_err(),
            "a range containing an entry overlaps it"
        );
        m.insert(0..10, 5).unwrap();
        assert_eq!(m.len(), 2);
        for (_, v) in m.iter_mut() {
            *v += 100;
        }
        assert_eq!(m.get(3), Some((0..10, &105)));
        *m.get_mut_by_start(10).unwrap() = 7;
        assert_eq!(m.get_by_start(10), Some((10..20, &7)));
        assert_eq!(m.remove_overlapping(9..11).len(), 2);
        assert!(m.is_empty());
    }

    /// The model: a plain list of (start, end, value), searched linearly.
    #[derive(Default)]
    struct Model(Vec<(u64, u64, u32)>);

    impl Model {
        fn overlaps(&self, s: u64, e: u64) -> Vec<(u64, u64, u32)> {
            let mut v: Vec<_> = self
                .0
                .iter()
                .copied()
                .filter(|&(a, b, _)| s < e && a < e && s < b)
                .collect();
            v.sort();
            v
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u64, u32),
        Remove(u64),
        RemoveOverlapping(u64, u64),
        Query(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..200, 0u64..30, any::<u32>()).prop_map(|(s, l, v)| Op::Insert(s, s + l, v)),
            1 => (0u64..200).prop_map(Op::Remove),
            1 => (0u64..200, 0u64..40).prop_map(|(s, l)| Op::RemoveOverlapping(s, s + l)),
            3 => (0u64..230, 0u64..40).prop_map(|(s, l)| Op::Query(s, s + l)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn matches_vec_model(ops in prop::collection::vec(op(), 1..80)) {
            let mut m = IntervalMap::new();
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Insert(s, e, v) => {
                        let ok = s < e && model.overlaps(s, e).is_empty();
                        prop_assert_eq!(m.insert(s..e, v).is_ok(), ok);
                        if ok {
                            model.0.push((s, e, v));
                        }
                    }
                    Op::Remove(s) => {
                        let want = model.0.iter().position(|&(a, _, _)| a == s)
                            .map(|i| model.0.remove(i));
                        let got = m.remove(s).map(|(r, v)| (r.start, r.end, v));
                        prop_assert_eq!(got, want);
                    }
                    Op::RemoveOverlapping(s, e) => {
                        let want = model.overlaps(s, e);
                        model.0.retain(|x| !want.contains(x));
                        let got: Vec<_> = m.remove_overlapping(s..e).into_iter()
                            .map(|(r, v)| (r.start, r.end, v)).collect();
                        prop_assert_eq!(got, want);
                    }
                    Op::Query(s, e) => {
                        let got: Vec<_> = m.overlapping(s..e).map(|(r, v)| (r.start, r.end, *v)).collect();
                        prop_assert_eq!(got, model.overlaps(s, e));
                        let want_cov = model.0.iter().copied()
                            .find(|&(a, b, _)| a <= s && s < b && e <= b);
                        let got_cov = m.covering(s..e).map(|(r, v)| (r.start, r.end, *v));
                        prop_assert_eq!(got_cov, want_cov);
                        let want_pt = model.0.iter().copied().find(|&(a, b, _)| a <= s && s < b);
                        let got_pt = m.get(s).map(|(r, v)| (r.start, r.end, *v));
                        prop_assert_eq!(got_pt, want_pt);
                    }
                }
                // Invariant: sorted, non-empty, non-overlapping, same contents as the model.
                let all: Vec<_> = m.iter().map(|(r, v)| (r.start, r.end, *v)).collect();
                for w in all.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                prop_assert!(all.iter().all(|&(a, b, _)| a < b));
                let mut want = model.0.clone();
                want.sort();
                prop_assert_eq!(all, want);
                prop_assert_eq!(m.len(), model.0.len());
            }
        }
    }
}
