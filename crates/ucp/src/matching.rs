//! Tag matching with MPI semantics.
//!
//! A receive matches a message when `(msg_tag & mask) == (recv_tag & mask)`. Posted receives are
//! tried in the order they were posted, unexpected messages in the order they arrived, so two
//! messages from one sender that both match a receive are received in the order they were sent.

use std::collections::VecDeque;

/// A 64-bit tag.
pub type Tag = u64;

/// True when a message tag satisfies a receive's tag and mask.
pub fn tag_matches(msg_tag: Tag, recv_tag: Tag, mask: Tag) -> bool {
    (msg_tag & mask) == (recv_tag & mask)
}

/// Remove the entry at `pos` of `q`: the front (the usual match, in order) without the general
/// removal's shifting.
#[inline]
fn take_at<T>(q: &mut VecDeque<T>, pos: usize) -> Option<T> {
    if pos == 0 {
        q.pop_front()
    } else {
        q.remove(pos)
    }
}

#[derive(Debug)]
struct Expected<E> {
    tag: Tag,
    mask: Tag,
    item: E,
}

#[derive(Debug)]
struct Unexpected<U> {
    tag: Tag,
    item: U,
}

/// Expected (posted receives, `E`) and unexpected (arrived messages, `U`) queues.
#[derive(Debug)]
pub struct TagMatcher<E, U> {
    expected: VecDeque<Expected<E>>,
    unexpected: VecDeque<Unexpected<U>>,
}

impl<E, U> Default for TagMatcher<E, U> {
    fn default() -> Self {
        TagMatcher {
            expected: VecDeque::new(),
            unexpected: VecDeque::new(),
        }
    }
}

impl<E, U> TagMatcher<E, U> {
    /// Empty queues.
    pub fn new() -> Self {
        Self::default()
    }

    /// Post a receive: returns the first unexpected message it matches (removed from the
    /// queue) with the receive's item, or queues the receive and returns `None`.
    #[inline]
    pub fn post_recv(&mut self, tag: Tag, mask: Tag, item: E) -> Option<(Tag, U, E)> {
        // Nothing waiting (a pre-posted receive, the usual case): queued without a search.
        if self.unexpected.is_empty() {
            self.expected.push_back(Expected { tag, mask, item });
            return None;
        }
        if let Some(pos) = self
            .unexpected
            .iter()
            .position(|u| tag_matches(u.tag, tag, mask))
        {
            let u = take_at(&mut self.unexpected, pos).expect("position is in range");
            return Some((u.tag, u.item, item));
        }
        self.expected.push_back(Expected { tag, mask, item });
        None
    }

    /// Queue a receive when no message waits ([`unexpected_len`](Self::unexpected_len) is 0,
    /// which the caller checked): what [`post_recv`](Self::post_recv) does then, without its
    /// answer (which would be `None`).
    #[inline(always)]
    pub fn push_expected(&mut self, tag: Tag, mask: Tag, item: E) {
        debug_assert!(self.unexpected.is_empty(), "a message waits: post_recv it");
        self.expected.push_back(Expected { tag, mask, item });
    }

    /// A message arrived: returns the first posted receive it matches (removed), or queues the
    /// message as unexpected and returns `None`.
    pub fn arrive(&mut self, tag: Tag, item: U) -> Option<(E, U)> {
        if let Some(pos) = self
            .expected
            .iter()
            .position(|e| tag_matches(tag, e.tag, e.mask))
        {
            let e = take_at(&mut self.expected, pos).expect("position is in range");
            return Some((e.item, item));
        }
        self.unexpected.push_back(Unexpected { tag, item });
        None
    }

    /// [`arrive`](Self::arrive) for a message whose queued form is built only when no posted
    /// receive takes it (the common case of a pre-posted receive builds nothing): returns the
    /// receive's item, or queues `make()` and returns `None`.
    #[inline]
    pub fn arrive_with(&mut self, tag: Tag, make: impl FnOnce() -> U) -> Option<E> {
        // The oldest receive matches (messages in the order their receives were posted, the
        // usual case): taken without a search.
        if self
            .expected
            .front()
            .is_some_and(|e| tag_matches(tag, e.tag, e.mask))
        {
            return self.expected.pop_front().map(|e| e.item);
        }
        if let Some(pos) = self
            .expected
            .iter()
            .position(|e| tag_matches(tag, e.tag, e.mask))
        {
            return take_at(&mut self.expected, pos).map(|e| e.item);
        }
        self.unexpected.push_back(Unexpected { tag, item: make() });
        None
    }

    /// Look for an unexpected message matching `tag`/`mask` without receiving it.
    pub fn probe(&self, tag: Tag, mask: Tag) -> Option<(Tag, &U)> {
        self.unexpected
            .iter()
            .find(|u| tag_matches(u.tag, tag, mask))
            .map(|u| (u.tag, &u.item))
    }

    /// Remove and return the first unexpected message matching `tag`/`mask` (probe with remove).
    pub fn take_unexpected(&mut self, tag: Tag, mask: Tag) -> Option<(Tag, U)> {
        let pos = self
            .unexpected
            .iter()
            .position(|u| tag_matches(u.tag, tag, mask))?;
        take_at(&mut self.unexpected, pos).map(|u| (u.tag, u.item))
    }

    /// Remove the first posted receive for which `pred` holds (cancellation).
    pub fn cancel_expected(&mut self, mut pred: impl FnMut(&E) -> bool) -> Option<E> {
        let pos = self.expected.iter().position(|e| pred(&e.item))?;
        take_at(&mut self.expected, pos).map(|e| e.item)
    }

    /// Remove every unexpected message for which `pred` holds (e.g. from a failed peer).
    pub fn drop_unexpected(&mut self, mut pred: impl FnMut(&U) -> bool) -> Vec<U> {
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(self.unexpected.len());
        for u in self.unexpected.drain(..) {
            if pred(&u.item) {
                out.push(u.item);
            } else {
                keep.push_back(u);
            }
        }
        self.unexpected = keep;
        out
    }

    /// Mutable access to unexpected messages (to append fragments to a buffered message).
    pub fn unexpected_mut(&mut self) -> impl Iterator<Item = &mut U> {
        self.unexpected.iter_mut().map(|u| &mut u.item)
    }

    /// Number of posted receives.
    pub fn expected_len(&self) -> usize {
        self.expected.len()
    }

    /// Number of unexpected messages.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wildcard_and_order() {
        let mut m: TagMatcher<u32, u32> = TagMatcher::new();
        assert!(m.arrive(5, 100).is_none());
        assert!(m.arrive(5, 101).is_none());
        assert!(m.arrive(7, 102).is_none());
        assert_eq!(m.probe(7, u64::MAX).map(|(t, u)| (t, *u)), Some((7, 102)));
        assert_eq!(m.post_recv(0, 0, 1).unwrap().1, 100); // wildcard takes the oldest
        assert_eq!(m.post_recv(5, u64::MAX, 2).unwrap().1, 101);
        assert!(m.post_recv(5, u64::MAX, 3).is_none());
        assert_eq!(m.arrive(5, 103), Some((3, 103)));
        assert_eq!(m.take_unexpected(0, 0), Some((7, 102)));
        assert_eq!(m.unexpected_len(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Send { src: u8, tag: u8 },
        Recv { tag: u8, wild: bool },
        Probe { tag: u8, wild: bool },
        Cancel,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3, 0u8..4).prop_map(|(src, tag)| Op::Send { src, tag }),
            (0u8..4, any::<bool>()).prop_map(|(tag, wild)| Op::Recv { tag, wild }),
            (0u8..4, any::<bool>()).prop_map(|(tag, wild)| Op::Probe { tag, wild }),
            Just(Op::Cancel),
        ]
    }

    /// Naive model: lists scanned front to back.
    #[derive(Default)]
    struct Model {
        posted: Vec<(u64, u64, usize)>,
        arrived: Vec<(u64, (u8, usize))>,
    }

    proptest! {
        #[test]
        fn matches_reference_model(ops in proptest::collection::vec(op(), 1..200)) {
            let mut m: TagMatcher<usize, (u8, usize)> = TagMatcher::new();
            let mut model = Model::default();
            let mut seq_per_src = [0usize; 3];
            let mut got: Vec<(usize, (u8, usize))> = Vec::new();
            let mut model_got: Vec<(usize, (u8, usize))> = Vec::new();
            let mut next_recv = 0usize;
            for o in ops {
                match o {
                    Op::Send { src, tag } => {
                        let item = (src, seq_per_src[src as usize]);
                        seq_per_src[src as usize] += 1;
                        let t = u64::from(tag);
                        // Both arrival entry points, checked against the same model.
                        if src % 2 == 0 {
                            if let Some((e, u)) = m.arrive(t, item) { got.push((e, u)); }
                        } else if let Some(e) = m.arrive_with(t, || item) {
                            got.push((e, item));
                        }
                        match model.posted.iter().position(|(rt, mask, _)| t & mask == rt & mask) {
                            Some(p) => { let (_, _, r) = model.posted.remove(p); model_got.push((r, item)); }
                            None => model.arrived.push((t, item)),
                        }
                    }
                    Op::Recv { tag, wild } => {
                        let mask = if wild { 0 } else { u64::MAX };
                        let t = u64::from(tag);
                        let r = next_recv; next_recv += 1;
                        if let Some((_, u, e)) = m.post_recv(t, mask, r) { got.push((e, u)); }
                        match model.arrived.iter().position(|(mt, _)| mt & mask == t & mask) {
                            Some(p) => { let (_, u) = model.arrived.remove(p); model_got.push((r, u)); }
                            None => model.posted.push((t, mask, r)),
                        }
                    }
                    Op::Probe { tag, wild } => {
                        let mask = if wild { 0 } else { u64::MAX };
                        let t = u64::from(tag);
                        let a = m.probe(t, mask).map(|(tt, u)| (tt, *u));
                        let b = model.arrived.iter().find(|(mt, _)| mt & mask == t & mask).copied();
                        prop_assert_eq!(a, b);
                    }
                    Op::Cancel => {
                        let a = m.cancel_expected(|_| true);
                        let b = if model.posted.is_empty() { None } else { Some(model.posted.remove(0).2) };
                        prop_assert_eq!(a, b);
                    }
                }
            }
            prop_assert_eq!(&got, &model_got);
            prop_assert_eq!(m.expected_len(), model.posted.len());
            prop_assert_eq!(m.unexpected_len(), model.arrived.len());
        }
    }
}
