//! The worker's side of requests on owned buffers ([`crate::owned`]) and of queued requests
//! (below): posting them, handing their results back from progress, cancel, and what the
//! worker's drop does with those still outstanding.
//!
//! An owned or queued request is an ordinary request of the table whose id is also in
//! [`Registry::slots`] (a vector indexed like the request table, whose ids are dense); the
//! places that end a request ([`State::set_result`] and the eager fast path of a receive)
//! note its id in [`Registry::done`] (one indexed look-up, only while such requests exist),
//! and [`Worker::reap_owned`], run after each progress call, removes it from the table and
//! hands the result to its owner: an [`OwnedRequest`]'s handle (with the buffer), or the
//! worker's completion queue. So what progress does for these requests is proportional to
//! how many ended, never to how many are outstanding.
//!
//! # Queued requests
//! [`Worker::tag_send_queued`] and [`Worker::tag_recv_queued`] post on memory given by address
//! ([`RawBuf`]) with a caller's token instead of a handle: no allocation, no lock. Their ends
//! are queued in the order they happen, with the token, and taken with
//! [`Worker::take_completed`] (the C ABI's progress delivers exactly those). A request that
//! ended while being posted is reported by the post itself and never queued. The worker's drop
//! ends outstanding queued requests as it ends owned ones (see [`crate::owned`]): once it
//! returned, nothing of rucx touches their memory.

use std::sync::Arc;

use crate::worker::prelude::*;

use rucx_ucs::{OwnedBuf, OwnedBufMut, RawBuf};

use crate::owned::{Deferred, Finish, OwnedRequest, run_deferred};

/// Who gets the result of an owned request.
enum Owner {
    /// The handle side of an [`OwnedRequest`].
    Handle(Arc<dyn Finish>),
    /// The worker's completion queue, with the caller's token.
    Queue(u64),
}

/// Owned and queued requests of a worker.
#[derive(Default)]
pub(crate) struct Registry {
    /// The owner of each outstanding request, at the index part of its id (with the whole id,
    /// which tells a reused index's new request from the old one).
    slots: Vec<Option<(u64, Owner)>>,
    /// Entries of `slots` that are `Some`.
    live: usize,
    /// Ended since the last reap.
    done: Vec<u64>,
    /// Ended with an error while copies of this process (the copy lane, a copy engine's lane)
    /// or, canceled, operations of the transport still run on the buffer
    /// ([`State::draining`]): handed back once those finished.
    draining: Vec<u64>,
    /// Ends of queued requests not taken yet: token and result.
    completed: Vec<(u64, Result<Completion>)>,
}

/// The index part of a request id (see `crate::slab`).
#[inline(always)]
fn index(id: u64) -> usize {
    (id & 0xffff_ffff) as usize
}

impl Registry {
    /// Request `id` just ended.
    #[inline]
    pub(crate) fn note_done(&mut self, id: u64) {
        if self.live != 0
            && let Some(Some((sid, _))) = self.slots.get(index(id))
            && *sid == id
        {
            self.done.push(id);
        }
    }

    /// Ends of queued requests wait to be taken.
    #[inline]
    pub(super) fn has_completed(&self) -> bool {
        !self.completed.is_empty()
    }

    /// Something to hand back.
    #[inline]
    pub(super) fn has_work(&self) -> bool {
        !self.done.is_empty() || !self.draining.is_empty()
    }

    /// Owned requests outstanding.
    pub(super) fn len(&self) -> usize {
        self.live
    }

    #[inline]
    fn insert(&mut self, id: u64, owner: Owner) {
        let i = index(id);
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        if self.slots[i].replace((id, owner)).is_none() {
            self.live += 1;
        }
    }

    fn get(&self, id: u64) -> Option<&Owner> {
        match self.slots.get(index(id)) {
            Some(Some((sid, o))) if *sid == id => Some(o),
            _ => None,
        }
    }

    fn remove(&mut self, id: u64) -> Option<Owner> {
        let slot = self.slots.get_mut(index(id))?;
        if !matches!(slot, Some((sid, _)) if *sid == id) {
            return None;
        }
        self.live -= 1;
        slot.take().map(|(_, o)| o)
    }

    /// Register request `id` (a direct receive made a request) for the completion queue.
    pub(super) fn insert_queued(&mut self, id: u64, token: u64) {
        self.insert(id, Owner::Queue(token));
    }

    /// No end waits for a reap: an end queued now keeps the order in which they happened.
    #[inline]
    pub(crate) fn ends_in_order(&self) -> bool {
        self.done.is_empty() && self.draining.is_empty()
    }

    /// Queue the end of a queued request that has no request in the table.
    #[inline]
    pub(super) fn push_completed(&mut self, token: u64, res: Result<Completion>) {
        self.completed.push((token, res));
    }

    /// The outstanding queued request of `token` (the first, if the caller gave it to several).
    pub(super) fn find_queued(&self, token: u64) -> Option<u64> {
        self.slots.iter().flatten().find_map(|(id, o)| match o {
            Owner::Queue(t) if *t == token => Some(*id),
            _ => None,
        })
    }

    /// Ids of the outstanding requests.
    fn ids(&self) -> Vec<u64> {
        self.slots.iter().flatten().map(|(id, _)| *id).collect()
    }
}

/// What posting a queued request gave.
#[derive(Debug)]
pub enum Queued {
    /// It ended while being posted (a small send the transport took, a receive that matched a
    /// message already here, or a refusal): nothing is queued for it, and the memory is free.
    Ended(Result<Completion>),
    /// Outstanding: its end will be queued with the token ([`Worker::take_completed`]).
    Pending(QueuedReq),
}

/// An outstanding queued request, to cancel it with ([`Worker::cancel_queued`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuedReq {
    id: u64,
    worker: u64,
    /// `id` names a direct receive (`direct.rs`), not a request of the table.
    direct: bool,
}

impl QueuedReq {
    /// A request held by an endpoint still connecting (`connecting.rs`): no request of the
    /// table yet (an id the table never hands out), so it cannot be canceled.
    pub(super) fn held(worker: u64) -> QueuedReq {
        QueuedReq {
            id: u64::MAX,
            worker,
            direct: false,
        }
    }

    pub(super) fn direct(key: u64, worker: u64) -> QueuedReq {
        QueuedReq {
            id: key,
            worker,
            direct: true,
        }
    }
}

impl Worker {
    /// Identifies this worker to its owned requests (which hold no reference to it).
    pub(crate) fn owned_uuid(&self) -> u64 {
        self.st.borrow().address.uuid
    }

    /// Send `buf` with `tag` to `ep`, the request owning the buffer: it may outlive any
    /// scope, and hands the buffer back when it ends ([`OwnedRequest`]). `buf` is any
    /// [`OwnedBuf`]: `Vec<u8>`, `Box<[u8]>`, `bytes::Bytes`, `bytes::BytesMut`, a GPU buffer
    /// of `rucx-cuda`, or a [`RawBuf`](rucx_ucs::RawBuf). A send refused when posted (a failed
    /// endpoint, no path for the memory) ends at once with the error, and hands the buffer back.
    pub fn tag_send_owned<B: OwnedBuf>(&self, ep: EpId, buf: B, tag: Tag) -> OwnedRequest<B> {
        self.send_owned(ep, buf, tag, false)
    }

    /// The synchronous form of [`tag_send_owned`](Self::tag_send_owned): it ends once a
    /// receive of the peer matched the message (see
    /// [`Scope::tag_send_sync`](crate::Scope::tag_send_sync)).
    pub fn tag_send_sync_owned<B: OwnedBuf>(&self, ep: EpId, buf: B, tag: Tag) -> OwnedRequest<B> {
        self.send_owned(ep, buf, tag, true)
    }

    fn send_owned<B: OwnedBuf>(&self, ep: EpId, buf: B, tag: Tag, sync: bool) -> OwnedRequest<B> {
        let (mut req, shared) = OwnedRequest::new(self.owned_uuid(), buf);
        // The buffer stays in the shared slot, where it does not move, until handed back.
        let posted = req.with_buf(|b| self.post_send(ep, SendBuf::from(b.owned_ref()), tag, sync));
        self.adopt(&mut req, shared, posted);
        req
    }

    /// Receive a message whose tag matches `tag` under `mask` into `buf`, the request owning
    /// the buffer ([`OwnedRequest`]; see [`Scope::tag_recv`](crate::Scope::tag_recv) for
    /// matching and truncation). `buf` is any [`OwnedBufMut`]: `Vec<u8>`, `Box<[u8]>`,
    /// `bytes::BytesMut`, a GPU buffer of `rucx-cuda`, or a [`RawBuf`](rucx_ucs::RawBuf).
    /// The whole buffer is the capacity; the completion's `len` says how much arrived.
    pub fn tag_recv_owned<B: OwnedBufMut>(&self, buf: B, tag: Tag, mask: Tag) -> OwnedRequest<B> {
        let (mut req, shared) = OwnedRequest::new(self.owned_uuid(), buf);
        let id = req.with_buf(|b| self.post_recv(RecvBuf::from(b.owned_mut()), tag, mask));
        self.adopt(&mut req, shared, Ok(Posted::Pending(id)));
        req
    }

    /// Register a just-posted owned request, or end it at once.
    fn adopt<B: Send + 'static>(
        &self,
        req: &mut OwnedRequest<B>,
        shared: Arc<crate::owned::Shared<B>>,
        posted: Result<Posted>,
    ) {
        match posted {
            Err(e) => req.end_now(Err(e)),
            Ok(Posted::Done(c)) => req.end_now(Ok(c)),
            Ok(Posted::Pending(id)) => {
                req.set_id(id);
                let mut st = self.st.borrow_mut();
                st.owned.insert(id, Owner::Handle(shared));
                // It may have ended while posted (a receive matching an arrived message).
                if st.reqs.get(&id).is_some_and(|r| r.result.is_some()) {
                    st.owned.done.push(id);
                }
                drop(st);
                self.reap_owned();
            }
        }
    }

    /// Send the memory of `buf` with `tag` to `ep` (`sync`: ending once a receive of the peer
    /// matched it, see [`Scope::tag_send_sync`](crate::Scope::tag_send_sync)), its end queued
    /// with `token` ([`take_completed`](Self::take_completed)) unless it ended while posted
    /// ([`Queued::Ended`]: sent at once, or refused). The memory is the request's, under
    /// [`RawBuf::new`]'s contract, until its end was reported (by the post or the queue) or the
    /// worker was dropped.
    pub fn tag_send_queued(
        &self,
        ep: EpId,
        buf: RawBuf,
        tag: Tag,
        sync: bool,
        token: u64,
    ) -> Queued {
        if let Some(q) = self.hold_if_connecting(ep, token, || super::connecting::Held::Tag {
            buf: buf.clone(),
            tag,
            sync,
        }) {
            return q;
        }
        let posted = self.post_send(ep, SendBuf::of_raw(&buf), tag, sync);
        self.adopt_queued(posted, token)
    }

    /// Receive a message whose tag matches `tag` under `mask` into the memory of `buf` (see
    /// [`Scope::tag_recv`](crate::Scope::tag_recv) for matching and truncation), its end queued
    /// with `token` unless it matched a message already here and ended while posted
    /// ([`Queued::Ended`]). The memory is the request's as for
    /// [`tag_send_queued`](Self::tag_send_queued).
    #[inline]
    pub fn tag_recv_queued(&self, buf: RawBuf, tag: Tag, mask: Tag, token: u64) -> Queued {
        // Host memory and nothing waiting (a pre-posted receive, the common case): an entry of
        // the expected queue only (`direct.rs`).
        let mut rb = RecvBuf::of_raw(&buf);
        if let Some(q) = self.recv_direct(&mut rb, tag, mask, token) {
            return q;
        }
        let id = self.post_recv(rb, tag, mask);
        {
            // Waiting for its message (a pre-posted receive, the common case): registered.
            let mut st = self.st.borrow_mut();
            if st.reqs.get(&id).is_some_and(|r| r.result.is_none()) {
                st.owned.insert(id, Owner::Queue(token));
                let worker = st.address.uuid;
                return Queued::Pending(QueuedReq {
                    id,
                    worker,
                    direct: false,
                });
            }
        }
        self.adopt_queued(Ok(Posted::Pending(id)), token)
    }

    /// Report a just-posted queued request that ended, or register it.
    pub(super) fn adopt_queued(&self, posted: Result<Posted>, token: u64) -> Queued {
        let id = match posted {
            Err(e) => return Queued::Ended(Err(e)),
            Ok(Posted::Done(c)) => return Queued::Ended(Ok(c)),
            Ok(Posted::Pending(id)) => id,
        };
        let mut st = self.st.borrow_mut();
        match st.owned_end(id) {
            End::Ended(res) => {
                st.reqs.remove(&id);
                return Queued::Ended(res);
            }
            End::Drain => st.owned.draining.push(id),
            End::Pending => {}
        }
        st.owned.insert(id, Owner::Queue(token));
        let worker = st.address.uuid;
        Queued::Pending(QueuedReq {
            id,
            worker,
            direct: false,
        })
    }

    /// Whether ends of queued requests wait to be taken ([`take_completed`](Self::take_completed)).
    #[inline]
    pub fn has_completed(&self) -> bool {
        self.st.borrow().owned.has_completed()
    }

    /// Move the ends of queued requests not taken yet, in the order they ended (token and
    /// result), to the end of `into`. Ends are queued by the progress call (or cancel, or the
    /// worker's drop) that saw them; each is reported once. When `into` is empty the two lists
    /// trade places (no copy): keep handing in the same emptied vector, and neither side
    /// allocates once both have grown.
    #[inline]
    pub fn take_completed(&self, into: &mut Vec<(u64, Result<Completion>)>) {
        let mut st = self.st.borrow_mut();
        let q = &mut st.owned.completed;
        if q.is_empty() {
            return;
        }
        Self::move_completed(q, into);
    }

    #[inline(always)]
    fn move_completed(
        q: &mut Vec<(u64, Result<Completion>)>,
        into: &mut Vec<(u64, Result<Completion>)>,
    ) {
        if into.is_empty() {
            std::mem::swap(q, into);
        } else {
            into.append(q);
        }
    }

    /// Cancel queued receive `r` if it has not matched a message yet: true when it was
    /// canceled (its end, [`Error::Canceled`], is queued now). False for another worker's
    /// request, a send, or one that ended or matched already.
    pub fn cancel_queued(&self, r: QueuedReq) -> bool {
        if r.direct {
            return self.owned_uuid() == r.worker && self.cancel_direct(r.id);
        }
        let mine = {
            let st = self.st.borrow();
            st.address.uuid == r.worker && matches!(st.owned.get(r.id), Some(Owner::Queue(_)))
        };
        mine && self.owned_cancel(r.id)
    }

    /// Cancel owned receive `id` if it has not matched.
    pub(crate) fn owned_cancel(&self, id: u64) -> bool {
        let is_recv = {
            let st = self.st.borrow();
            st.owned.get(id).is_some()
                && matches!(
                    st.reqs.get(&id),
                    Some(Req {
                        kind: ReqKind::Recv(_),
                        result: None,
                        ..
                    })
                )
        };
        let canceled = is_recv && self.cancel_recv(id);
        if canceled {
            self.reap_owned();
        }
        canceled
    }

    /// Hand the results of ended owned requests to their handles, and those of queued ones to
    /// the completion queue; returns how many were handed back.
    pub(super) fn reap_owned(&self) -> usize {
        let mut actions: Vec<Deferred> = Vec::new();
        let mut n = 0;
        {
            let mut st = self.st.borrow_mut();
            if !st.owned.has_work() {
                return 0;
            }
            let st = &mut *st;
            let mut ids = std::mem::take(&mut st.owned.done);
            if !st.owned.draining.is_empty() {
                let draining = std::mem::take(&mut st.owned.draining);
                ids.extend(draining);
            }
            for &id in &ids {
                let res = match st.owned_end(id) {
                    End::Pending => continue,
                    End::Drain => {
                        st.owned.draining.push(id);
                        continue;
                    }
                    End::Ended(res) => res,
                };
                st.reqs.remove(&id);
                n += 1;
                match st.owned.remove(id) {
                    Some(Owner::Handle(f)) => actions.extend(f.finish(res)),
                    Some(Owner::Queue(token)) => st.owned.completed.push((token, res)),
                    None => {}
                }
            }
            // Keep the list's memory for the next reap (nothing was noted meanwhile: the
            // state stayed borrowed).
            ids.clear();
            if st.owned.done.is_empty() {
                st.owned.done = ids;
            }
        }
        run_deferred(actions);
        n
    }

    /// The worker's drop with owned requests outstanding (the rule of [`crate::owned`]): end
    /// them all, waiting only for receives a peer may be writing into, close the interfaces,
    /// then hand every buffer back.
    pub(super) fn shutdown_owned(&mut self) {
        self.st.get_mut().cancel_all_direct();
        if self.st.get_mut().owned.len() == 0 {
            return;
        }
        {
            let st = self.st.get_mut();
            let ids = st.owned.ids();
            for id in ids {
                let cancel = match st.reqs.get(&id) {
                    Some(Req {
                        kind: ReqKind::Recv(rs),
                        result: None,
                        ..
                    }) => {
                        if st
                            .matcher
                            .cancel_expected(|e| *e == Waiter::Req(id))
                            .is_some()
                        {
                            st.finish(id, Err(Error::Canceled));
                            false
                        } else {
                            !peer_writes(rs)
                        }
                    }
                    Some(Req {
                        kind: ReqKind::Send(_),
                        result: None,
                        ..
                    }) => true,
                    _ => false,
                };
                if cancel {
                    // A rendezvous peer is told (its side ends with `PeerAborted`).
                    st.fail(id, Error::Canceled);
                }
            }
        }
        let mut backoff = liveness::Backoff::new();
        loop {
            self.reap_owned();
            let st = self.st.get_mut();
            let waiting = st
                .owned
                .slots
                .iter()
                .flatten()
                .any(|(id, _)| st.reqs.get(id).is_some_and(|r| r.result.is_none()));
            if !waiting {
                break;
            }
            if self.progress() == 0 {
                backoff.idle(self);
            } else {
                backoff.busy();
            }
        }
        // Nothing of this process touches the buffers once the interfaces are closed (copies
        // and operations still running on ended requests included).
        drop(std::mem::take(self.ifaces.get_mut()));
        let st = self.st.get_mut();
        let slots: Vec<(u64, Owner)> = st.owned.slots.drain(..).flatten().collect();
        st.owned.live = 0;
        let mut actions = Vec::new();
        for (id, owner) in slots {
            let res = st
                .reqs
                .get_mut(&id)
                .and_then(|r| r.result.take())
                .unwrap_or(Err(Error::Canceled));
            st.reqs.remove(&id);
            match owner {
                Owner::Handle(f) => actions.extend(f.finish(res)),
                Owner::Queue(token) => st.owned.completed.push((token, res)),
            }
        }
        st.owned.done.clear();
        st.owned.draining.clear();
        run_deferred(actions);
    }
}

/// Where an owned or queued request stands, for handing it back.
enum End {
    /// Still running.
    Pending,
    /// Ended with an error while operations still run on its memory: handed back later.
    Drain,
    /// Ended: its result (taken out of the request, which is then to be removed).
    Ended(Result<Completion>),
}

impl State {
    /// Receive `rid` ended whole, in place, with `res` (an eager message copied into host
    /// memory: nothing else runs on its memory). A queued request's end goes to the completion
    /// queue at once, and the request leaves the table (no reap), when no earlier end waits
    /// for a reap, which keeps the ends in the order they happened; any other request keeps
    /// its result for its owner or scope, noted for the reap as usual.
    #[inline]
    pub(crate) fn end_in_place(&mut self, rid: u64, res: Result<Completion>) {
        let reg = &mut self.owned;
        let i = index(rid);
        if reg.live != 0
            && reg.done.is_empty()
            && reg.draining.is_empty()
            && matches!(reg.slots.get(i), Some(Some((sid, Owner::Queue(_)))) if *sid == rid)
            && let Some(Some((_, Owner::Queue(token)))) = reg.slots.get_mut(i).map(Option::take)
        {
            reg.live -= 1;
            reg.completed.push((token, res));
            self.reqs.remove(&rid);
            return;
        }
        if let Some(r) = self.reqs.get_mut(&rid) {
            r.result = Some(res);
        }
        self.owned.note_done(rid);
    }

    /// Whether owned request `id` can be handed back, and its result if so.
    fn owned_end(&mut self, id: u64) -> End {
        let Some(r) = self.reqs.get_mut(&id) else {
            return End::Ended(Err(Error::Internal(format!(
                "owned request {id} is unknown"
            ))));
        };
        match &r.result {
            None => End::Pending,
            Some(Ok(_)) => End::Ended(r.result.take().expect("matched")),
            Some(Err(_)) => {
                if self.draining(id) {
                    return End::Drain;
                }
                match self.reqs.get_mut(&id).and_then(|r| r.result.take()) {
                    Some(res) => End::Ended(res),
                    None => End::Pending,
                }
            }
        }
    }
}

/// A matched receive whose buffer the peer may be writing (a rendezvous by the peer's writes
/// or streamed, not our own reads): the worker's drop waits for it to end.
fn peer_writes(rs: &RecvState) -> bool {
    rs.rndv().is_some_and(|rv| !rv.via_get && !rv.staged.pull)
}

impl State {
    /// Owned requests outstanding (for tests and the endpoint close).
    #[cfg(test)]
    pub(super) fn owned_len(&self) -> usize {
        self.owned.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::TAG_MASK_FULL;
    use crate::worker::tests::self_worker;

    #[test]
    fn owned_send_and_receive_hand_the_buffers_back() {
        let w = self_worker();
        let ep = w.connect(&w.address()).unwrap();
        for len in [0usize, 5, 300, 9000, 200_000] {
            let msg: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let r = w.tag_recv_owned(vec![0xEEu8; len + 3], 11, TAG_MASK_FULL);
            let s = w.tag_send_owned(ep, bytes::Bytes::from(msg.clone()), 11);
            let (res, sent) = s.wait(&w);
            assert_eq!(res.unwrap().len, len);
            assert_eq!(&sent[..], &msg[..], "the send buffer comes back as it was");
            let (res, got) = r.wait(&w);
            let c = res.unwrap();
            assert_eq!((c.len, c.sender), (len, Some(ep)));
            assert_eq!(&got[..len], &msg[..]);
            assert_eq!(&got[len..], &[0xEE; 3], "nothing written past the message");
        }
        assert_eq!(w.live_requests(), 0);
        assert_eq!(w.st.borrow().owned_len(), 0);
    }

    #[test]
    fn cancel_hands_an_unmatched_receive_back_untouched() {
        let w = self_worker();
        let r = w.tag_recv_owned(bytes::BytesMut::from(&[9u8; 64][..]), 1, TAG_MASK_FULL);
        assert!(r.test().is_none());
        assert!(r.cancel(&w));
        assert!(!r.cancel(&w), "once");
        let (res, buf) = r.try_take().expect("ended by the cancel");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert_eq!(&buf[..], &[9u8; 64]);
        assert_eq!(w.live_requests(), 0);
    }

    #[test]
    fn a_send_refused_when_posted_ends_at_once_with_its_buffer() {
        let w = self_worker();
        let r = w.tag_send_owned(EpId(42), vec![1u8; 8], 0);
        let (res, b) = r.try_take().expect("refused when posted");
        assert!(res.is_err());
        assert_eq!(b, vec![1u8; 8]);
    }

    #[test]
    fn callbacks_run_from_progress_with_the_buffer() {
        let w = self_worker();
        let ep = w.connect(&w.address()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        let h = w
            .tag_recv_owned(vec![0u8; 16], 5, TAG_MASK_FULL)
            .on_complete(move |res, buf| tx.send((res.map(|c| c.len), buf)).unwrap());
        assert!(rx.try_recv().is_err(), "not before the message");
        w.tag_send_owned(ep, vec![4u8; 16], 5)
            .on_complete(move |res, buf| tx2.send((res.map(|c| c.len), buf)).unwrap());
        let mut got = Vec::new();
        let t = std::time::Instant::now();
        while got.len() < 2 && t.elapsed() < Duration::from_secs(10) {
            w.progress();
            got.extend(rx.try_iter());
        }
        assert_eq!(got.len(), 2, "both callbacks ran");
        for (res, buf) in got {
            assert_eq!(res.unwrap(), 16);
            assert_eq!(buf, vec![4u8; 16]);
        }
        assert!(!h.cancel(&w), "ended");
    }

    #[test]
    fn a_future_is_woken_by_the_progress_that_ends_it() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::{Context, Poll, Wake, Waker};
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let w = self_worker();
        let ep = w.connect(&w.address()).unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut r = w.tag_recv_owned(vec![0u8; 4], 2, TAG_MASK_FULL);
        assert!(std::pin::Pin::new(&mut r).poll(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        let (res, _) = w.tag_send_owned(ep, vec![3u8; 4], 2).wait(&w);
        res.unwrap();
        let t = std::time::Instant::now();
        while count.0.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(10) {
            w.progress();
        }
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken once");
        match std::pin::Pin::new(&mut r).poll(&mut cx) {
            Poll::Ready((res, buf)) => {
                assert_eq!(res.unwrap().len, 4);
                assert_eq!(buf, vec![3u8; 4]);
            }
            Poll::Pending => panic!("woken but not ready"),
        }
    }

    #[test]
    fn dropping_the_worker_cancels_outstanding_receives_and_hands_them_back() {
        let w = self_worker();
        let ep = w.connect(&w.address()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let a = w.tag_recv_owned(vec![1u8; 32], 1, TAG_MASK_FULL);
        let b = w.tag_recv_owned(bytes::BytesMut::from(&[2u8; 32][..]), 2, TAG_MASK_FULL);
        w.tag_recv_owned(vec![3u8; 32], 3, TAG_MASK_FULL)
            .on_complete(move |res, buf| tx.send((res, buf)).unwrap());
        // A large send to itself waits for a receive that never comes: aborted too.
        let big = w.tag_send_owned(ep, vec![4u8; 1 << 20], 99);
        // A dropped handle: its buffer is dropped with the request.
        drop(w.tag_recv_owned(vec![5u8; 8], 5, TAG_MASK_FULL));
        drop(w);
        let (res, buf) = a.try_take().expect("ended by the drop");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert_eq!(buf, vec![1u8; 32]);
        let (res, buf) = b.try_take().expect("ended by the drop");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert_eq!(&buf[..], &[2u8; 32]);
        let (res, buf) = rx.try_recv().expect("the callback ran from the drop");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert_eq!(buf, vec![3u8; 32]);
        let (res, buf) = big.try_take().expect("ended by the drop");
        assert!(res.is_err(), "{res:?}");
        assert_eq!(buf, vec![4u8; 1 << 20]);
    }

    #[test]
    fn requests_are_static_and_send() {
        fn is_static_send<T: 'static + Send>(_: &T) {}
        let w = self_worker();
        let r = w.tag_recv_owned(vec![0u8; 1], 0, TAG_MASK_FULL);
        is_static_send(&r);
        let moved = std::thread::spawn(move || r).join().unwrap();
        assert!(moved.cancel(&w));
    }
}
