//! A table of live entries addressed by generational ids: O(1) insert, lookup and removal
//! without hashing, and ids that stay unique while a slot is reused.
//!
//! Requests are looked up on every poll of every request and on every arriving message, and
//! their ids travel to peers and come back in replies. An id is `generation << 32 | index`:
//! a slot's generation changes each time it is freed, so a stale or forged id (an old request's
//! id echoed by a slow or misbehaving peer) finds nothing instead of a newer request that reuses
//! the slot. Generations start at 1, so no id is 0.

use std::ops::{Index, IndexMut};

enum Entry<T> {
    Live(T),
    /// Free, with the next free index (or `u32::MAX`).
    Free(u32),
}

struct Slot<T> {
    generation: u32,
    entry: Entry<T>,
}

/// The table.
pub(crate) struct Slab<T> {
    slots: Vec<Slot<T>>,
    free: u32,
    live: usize,
}

const NONE: u32 = u32::MAX;

fn split(id: u64) -> (u32, usize) {
    ((id >> 32) as u32, (id & 0xffff_ffff) as usize)
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: NONE,
            live: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Store `value`; returns its id.
    #[inline]
    pub(crate) fn insert(&mut self, value: T) -> u64 {
        self.insert_with(|| value)
    }

    /// Store the value `make` builds (built where it is stored when `make` is inlined, rather
    /// than moved there: requests are a few hundred bytes); returns its id.
    #[inline(always)]
    pub(crate) fn insert_with(&mut self, make: impl FnOnce() -> T) -> u64 {
        self.live += 1;
        if self.free != NONE {
            let i = self.free as usize;
            let slot = &mut self.slots[i];
            let Entry::Free(next) = slot.entry else {
                unreachable!("the free list holds free slots only")
            };
            self.free = next;
            slot.entry = Entry::Live(make());
            return (u64::from(slot.generation) << 32) | i as u64;
        }
        let i = self.slots.len();
        assert!(i < NONE as usize, "more than 2^32-1 live requests");
        self.slots.push(Slot {
            generation: 1,
            entry: Entry::Live(make()),
        });
        (1u64 << 32) | i as u64
    }

    /// The entry of `id`, if it is live.
    #[inline]
    pub(crate) fn get(&self, id: &u64) -> Option<&T> {
        let (generation, i) = split(*id);
        match self.slots.get(i) {
            Some(Slot {
                generation: g,
                entry: Entry::Live(v),
            }) if *g == generation => Some(v),
            _ => None,
        }
    }

    /// The entry of `id`, mutably, if it is live.
    #[inline]
    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut T> {
        let (generation, i) = split(*id);
        match self.slots.get_mut(i) {
            Some(Slot {
                generation: g,
                entry: Entry::Live(v),
            }) if *g == generation => Some(v),
            _ => None,
        }
    }

    /// Drop the entry of `id` in place (no move out of the table); returns whether it was live.
    /// Its id never finds anything again (until the slot's generation wraps around, after 2^32
    /// reuses).
    pub(crate) fn remove(&mut self, id: &u64) -> bool {
        let (generation, i) = split(*id);
        let Some(slot) = self.slots.get_mut(i) else {
            return false;
        };
        if slot.generation != generation || !matches!(slot.entry, Entry::Live(_)) {
            return false;
        }
        slot.entry = Entry::Free(self.free);
        // Never 0: ids stay nonzero.
        slot.generation = match slot.generation.wrapping_add(1) {
            0 => 1,
            g => g,
        };
        self.free = i as u32;
        self.live -= 1;
        true
    }

    /// Live entries with their ids, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.entry {
                Entry::Live(v) => Some(((u64::from(s.generation) << 32) | i as u64, v)),
                Entry::Free(_) => None,
            })
    }

    /// Number of live entries.
    pub(crate) fn len(&self) -> usize {
        self.live
    }
}

impl<T> Index<&u64> for Slab<T> {
    type Output = T;
    fn index(&self, id: &u64) -> &T {
        self.get(id)
            .unwrap_or_else(|| panic!("request {id:#x} is not live"))
    }
}

impl<T> IndexMut<&u64> for Slab<T> {
    fn index_mut(&mut self, id: &u64) -> &mut T {
        self.get_mut(id)
            .unwrap_or_else(|| panic!("request {id:#x} is not live"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn ids_are_nonzero_and_stale_ids_find_nothing() {
        let mut s = Slab::default();
        let a = s.insert("a");
        assert_ne!(a, 0);
        assert!(s.remove(&a));
        let b = s.insert("b");
        assert_ne!(a, b, "a reused slot gets a new id");
        assert_eq!(s.get(&a), None);
        assert!(!s.remove(&a));
        assert_eq!(s[&b], "b");
        assert_eq!(s.get(&0), None);
        assert_eq!(s.get(&u64::MAX), None);
        assert_eq!(s.len(), 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        Remove(usize),
        Lookup(usize),
        Mutate(usize, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u32>().prop_map(Op::Insert),
            any::<usize>().prop_map(Op::Remove),
            any::<usize>().prop_map(Op::Lookup),
            (any::<usize>(), any::<u32>()).prop_map(|(i, v)| Op::Mutate(i, v)),
        ]
    }

    proptest! {
        /// The slab behaves like a map from ids to values; ids of removed entries never find
        /// anything again.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec(op(), 1..300)) {
            let mut s = Slab::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut ids: Vec<u64> = Vec::new();
            for o in ops {
                match o {
                    Op::Insert(v) => {
                        let id = s.insert(v);
                        prop_assert!(!model.contains_key(&id));
                        prop_assert!(!ids.contains(&id), "ids are never reused");
                        model.insert(id, v);
                        ids.push(id);
                    }
                    Op::Remove(k) if !ids.is_empty() => {
                        let id = ids[k % ids.len()];
                        prop_assert_eq!(s.remove(&id), model.remove(&id).is_some());
                    }
                    Op::Lookup(k) if !ids.is_empty() => {
                        let id = ids[k % ids.len()];
                        prop_assert_eq!(s.get(&id), model.get(&id));
                    }
                    Op::Mutate(k, v) if !ids.is_empty() => {
                        let id = ids[k % ids.len()];
                        if let Some(x) = s.get_mut(&id) {
                            *x = v;
                            model.insert(id, v);
                        }
                        prop_assert_eq!(s.get(&id), model.get(&id));
                    }
                    _ => {}
                }
                prop_assert_eq!(s.len(), model.len());
                let mut live: Vec<(u64, u32)> = s.iter().map(|(i, v)| (i, *v)).collect();
                live.sort_unstable();
                let mut want: Vec<(u64, u32)> = model.iter().map(|(i, v)| (*i, *v)).collect();
                want.sort_unstable();
                prop_assert_eq!(live, want);
            }
        }
    }
}
