//! The worker's side of requests on owned buffers ([`crate::owned`]): posting them, handing
//! their results back from progress, cancel, and what the worker's drop does with those still
//! outstanding.
//!
//! An owned request is an ordinary request of the table whose id is also in
//! [`Registry::slots`]; the places that end a request ([`State::set_result`] and the eager
//! fast path of a receive) note its id in [`Registry::done`] (a lookup only while owned
//! requests exist), and [`Worker::reap_owned`], run after each progress call, removes it from
//! the table and hands the result and the buffer to the handle.

use std::sync::Arc;

use crate::worker::prelude::*;

use rucx_ucs::{OwnedBuf, OwnedBufMut};

use crate::owned::{Deferred, Finish, OwnedRequest};

/// Owned requests of a worker.
#[derive(Default)]
pub(crate) struct Registry {
    /// The handle side of each outstanding owned request, by request id.
    slots: FxHashMap<u64, Arc<dyn Finish>>,
    /// Ended since the last reap.
    done: Vec<u64>,
    /// Ended with an error while copies of the copy lane (or, canceled, operations of the
    /// transport) still run on the buffer: handed back once those finished.
    draining: Vec<u64>,
}

impl Registry {
    /// Request `id` just ended.
    #[inline]
    pub(crate) fn note_done(&mut self, id: u64) {
        if !self.slots.is_empty() && self.slots.contains_key(&id) {
            self.done.push(id);
        }
    }

    /// Something to hand back.
    #[inline]
    pub(super) fn has_work(&self) -> bool {
        !self.done.is_empty() || !self.draining.is_empty()
    }

    /// Owned requests outstanding.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
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
                st.owned.slots.insert(id, shared);
                // It may have ended while posted (a receive matching an arrived message).
                if st.reqs.get(&id).is_some_and(|r| r.result.is_some()) {
                    st.owned.done.push(id);
                }
                drop(st);
                self.reap_owned();
            }
        }
    }

    /// Cancel owned receive `id` if it has not matched.
    pub(crate) fn owned_cancel(&self, id: u64) -> bool {
        let is_recv = {
            let st = self.st.borrow();
            st.owned.slots.contains_key(&id)
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

    /// Hand the results of ended owned requests to their handles; returns how many.
    pub(super) fn reap_owned(&self) -> usize {
        let actions: Vec<Deferred> = {
            let mut st = self.st.borrow_mut();
            if !st.owned.has_work() {
                return 0;
            }
            let mut ids = std::mem::take(&mut st.owned.done);
            ids.append(&mut st.owned.draining);
            let mut actions = Vec::new();
            for id in ids {
                let res = match st.reqs.get(&id) {
                    Some(r) if r.result.is_none() => continue,
                    Some(r)
                        if r.result.as_ref().is_some_and(|x| x.is_err())
                            && (st.copies_in_flight(id)
                                || (r.outstanding > 0
                                    && matches!(r.result, Some(Err(Error::Canceled))))) =>
                    {
                        st.owned.draining.push(id);
                        continue;
                    }
                    Some(r) => r.result.clone().expect("checked"),
                    None => Err(Error::Internal(format!("owned request {id} is unknown"))),
                };
                st.reqs.remove(&id);
                if let Some(f) = st.owned.slots.remove(&id)
                    && let Some(a) = f.finish(res)
                {
                    actions.push(a);
                }
            }
            actions
        };
        let n = actions.len();
        for a in actions {
            a();
        }
        n
    }

    /// The worker's drop with owned requests outstanding (the rule of [`crate::owned`]): end
    /// them all, waiting only for receives a peer may be writing into, close the interfaces,
    /// then hand every buffer back.
    pub(super) fn shutdown_owned(&mut self) {
        if self.st.get_mut().owned.len() == 0 {
            return;
        }
        {
            let st = self.st.get_mut();
            let ids: Vec<u64> = st.owned.slots.keys().copied().collect();
            for id in ids {
                let cancel = match st.reqs.get(&id) {
                    Some(Req {
                        kind: ReqKind::Recv(rs),
                        result: None,
                        ..
                    }) => {
                        if st.matcher.cancel_expected(|e| *e == id).is_some() {
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
                .keys()
                .any(|id| st.reqs.get(id).is_some_and(|r| r.result.is_none()));
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
        let slots: Vec<(u64, Arc<dyn Finish>)> = st.owned.slots.drain().collect();
        let mut actions = Vec::new();
        for (id, f) in slots {
            let res = st
                .reqs
                .get(&id)
                .and_then(|r| r.result.clone())
                .unwrap_or(Err(Error::Canceled));
            st.reqs.remove(&id);
            actions.extend(f.finish(res));
        }
        st.owned.done.clear();
        st.owned.draining.clear();
        for a in actions {
            a();
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
