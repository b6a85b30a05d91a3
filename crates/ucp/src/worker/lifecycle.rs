//! Endpoint lifecycle: closing an endpoint (flush or force), what its peer sees, reconnecting,
//! and the error handlers that report a failed endpoint once.
//!
//! The rules, public, are on [`CloseMode`].

use std::sync::Arc;

use crate::owned::{Deferred, Finish, OwnedRequest, run_deferred};
use crate::worker::prelude::*;

/// How [`Worker::close`] closes an endpoint, and the endpoint lifecycle:
///
/// # Close
/// [`Worker::close`] marks the endpoint closed at once (new requests on it are refused with
/// [`Error::EndpointClosed`]) and returns a request that ends when the close is done:
/// - [`CloseMode::Flush`]: every request in flight on the endpoint (sends, remote memory
///   access, receives matched to a message of this peer) ends first, the lanes are flushed,
///   then a disconnect message goes to the peer, then the lanes are released. A stream receive
///   is not waited for (its bytes may never come): it ends with
///   [`Error::StreamIncomplete`] (the bytes it holds; the cause `EndpointClosed`).
/// - [`CloseMode::Force`]: every request in flight on the endpoint ends at once with
///   [`Error::Canceled`] (the buffer of one the transport is still reading or writing is handed
///   back only once the transport finished with it), queued messages are dropped, the
///   disconnect message goes out, and the lanes are released once the transport has finished.
///
/// Closing an endpoint that failed only releases its lanes (and succeeds); closing one twice
/// is refused.
///
/// # What the peer sees
/// The disconnect message is the last one of the endpoint, after all its data. On receipt the
/// peer's endpoint is closed too: its requests bound to this side (sends to it, receives
/// matched to a message from it still arriving) end with [`Error::EndpointClosed`], announced
/// rendezvous messages from it are dropped, whole messages and stream bytes from it that
/// arrived before stay receivable (a stream receive they cannot fill ends with
/// [`Error::StreamIncomplete`], reporting what it holds), receives not matched yet are not
/// affected; new requests on the endpoint are
/// refused with `EndpointClosed`, and its error handler is called once with that error.
///
/// # Reconnect
/// Connecting again to the address of a worker whose endpoint failed or was closed gives a new
/// [`EpId`] (the old one keeps reporting its error); the peer sees a new endpoint too. While a
/// close of this worker is still in progress, connecting to that peer is refused with
/// [`Error::NoResource`] (retry once the close request ended).
///
/// # Error handlers
/// [`Worker::set_error_handler`] (every endpoint) and [`Worker::set_ep_error_handler`] (one
/// endpoint, taking precedence) are called from [`Worker::progress`], exactly once per endpoint
/// that fails (transport error, peer death: a broken connection, or on the same host its process
/// gone, `RUCX_PROC_CHECK_INTERVAL`; `RUCX_PEER_TIMEOUT`) or that its peer closes, with
/// the error its requests ended with. Not for an endpoint this worker closes. Failures while no
/// handler is set are not kept for a later one; [`Worker::ep_error`] still tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseMode {
    /// Let everything in flight on the endpoint end, flush, then tell the peer.
    Flush,
    /// Cancel everything in flight on the endpoint, then tell the peer.
    Force,
}

/// Who closed an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Closed {
    ByUs,
    ByPeer,
}

impl Closed {
    pub(super) fn describe(self) -> &'static str {
        match self {
            Closed::ByUs => "closed by this worker",
            Closed::ByPeer => "the peer closed it",
        }
    }
}

type ErrHandler = Box<dyn FnMut(&Worker, EpId, &Error) + Send>;

/// Where a close stands.
enum Phase {
    /// Waiting for the requests in flight on the endpoint to end.
    Draining,
    /// Waiting for this flush request.
    Flushing(u64),
    /// The disconnect message is queued: waiting for the transport to take it and finish the
    /// operations still running on the lanes.
    Disconnecting,
}

struct Close {
    p: usize,
    phase: Phase,
    done: Arc<dyn Finish>,
}

/// The worker's lifecycle state.
#[derive(Default)]
pub(crate) struct Life {
    closes: Vec<Close>,
    /// Failed endpoints to report, in order.
    events: VecDeque<(usize, Error)>,
    handler: Option<ErrHandler>,
    ep_handlers: FxHashMap<usize, ErrHandler>,
}

impl Life {
    /// Something for [`Worker::after_progress`].
    #[inline]
    pub(super) fn has_work(&self) -> bool {
        !self.closes.is_empty() || !self.events.is_empty()
    }
}

const DONE: Completion = Completion::done(0);

impl Worker {
    /// Close endpoint `ep` (see [`CloseMode`] for what happens to its
    /// requests and what the peer sees); the request ends when the close is done (`wait` it
    /// with this worker, await it while something progresses the worker, or give it a
    /// callback). From this call on, requests on `ep` are refused with
    /// [`Error::EndpointClosed`]; connecting again to the peer's address gives a new endpoint.
    ///
    /// ```
    /// # fn main() -> rucx_ucs::Result<()> {
    /// # let mut tables = rucx_transports::config_tables();
    /// # tables.push(rucx_ucp::CONFIG);
    /// # let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", "self")])?;
    /// # let ctx = rucx_ucp::Context::new(&rucx_transports::registry(), cfg)?;
    /// use rucx_ucp::{CloseMode, Worker};
    /// let worker = Worker::new(&ctx)?;
    /// let ep = worker.connect(&worker.address())?;
    /// worker.tag_send_owned(ep, vec![1u8; 64], 5).wait(&worker).0?;
    /// worker.close(ep, CloseMode::Flush).wait(&worker).0?;
    /// assert!(matches!(
    ///     worker.tag_send_owned(ep, vec![0u8; 8], 5).wait(&worker).0,
    ///     Err(rucx_ucs::Error::EndpointClosed { .. })
    /// ));
    /// let again = worker.connect(&worker.address())?; // a new endpoint
    /// assert_ne!(again, ep);
    /// # Ok(()) }
    /// ```
    pub fn close(&self, ep: EpId, mode: CloseMode) -> OwnedRequest<()> {
        let (req, shared) = OwnedRequest::new(self.owned_uuid(), ());
        let p = ep.0;
        // Still being connected: the connection is dropped, its held requests end.
        self.cm_abandon(ep);
        {
            let mut st = self.st.borrow_mut();
            let Some(peer) = st.peers.get(p) else {
                req.end_now(Err(no_such_ep(p)));
                return req;
            };
            if let Some(c) = peer.closed {
                req.end_now(Err(Error::EndpointClosed {
                    ep: ep.to_string(),
                    peer: peer.remote.describe(),
                    by: c.describe().into(),
                }));
                return req;
            }
            let failed = peer.failed.is_some();
            st.peers[p].closed = Some(Closed::ByUs);
            if failed || !st.peers[p].connected {
                // Nothing can be in flight: release the lanes.
                st.release(p, "closed by this worker", &Error::Canceled);
                req.end_now(Ok(DONE));
                return req;
            }
            let phase = match mode {
                CloseMode::Flush => Phase::Draining,
                CloseMode::Force => {
                    // Stream receives first: they end reporting the bytes they hold.
                    st.drop_stream(p, Error::Canceled);
                    for id in st.bound_to(p) {
                        st.finish(id, Err(Error::Canceled));
                    }
                    st.peers[p].queue.clear();
                    st.disconnect(p);
                    Phase::Disconnecting
                }
            };
            st.life.closes.push(Close {
                p,
                phase,
                done: shared,
            });
        }
        self.after_progress();
        req
    }

    /// Call `h` from progress, once, for every endpoint that fails or that its peer closes:
    /// the endpoint and the error its requests ended with (see [`CloseMode`]). Replaces
    /// the previous handler; endpoint handlers ([`set_ep_error_handler`](Self::set_ep_error_handler))
    /// take precedence. `h` may use the worker (post, close, connect again).
    ///
    /// ```
    /// # fn main() -> rucx_ucs::Result<()> {
    /// # let mut tables = rucx_transports::config_tables();
    /// # tables.push(rucx_ucp::CONFIG);
    /// # let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", "self")])?;
    /// # let ctx = rucx_ucp::Context::new(&rucx_transports::registry(), cfg)?;
    /// let worker = rucx_ucp::Worker::new(&ctx)?;
    /// let (tx, failed) = std::sync::mpsc::channel();
    /// worker.set_error_handler(move |w, ep, err| {
    ///     // Once per endpoint, from `progress`: forget the peer, release the endpoint.
    ///     let _ = tx.send((ep, err.to_string()));
    ///     let _ = w.close(ep, rucx_ucp::CloseMode::Force);
    /// });
    /// worker.progress();
    /// assert!(failed.try_recv().is_err(), "no endpoint failed");
    /// # Ok(()) }
    /// ```
    pub fn set_error_handler(&self, h: impl FnMut(&Worker, EpId, &Error) + Send + 'static) {
        self.st.borrow_mut().life.handler = Some(Box::new(h));
    }

    /// The error handler of endpoint `ep` alone, called instead of the worker's (see
    /// [`set_error_handler`](Self::set_error_handler)). Refused for an unknown endpoint.
    pub fn set_ep_error_handler(
        &self,
        ep: EpId,
        h: impl FnMut(&Worker, EpId, &Error) + Send + 'static,
    ) -> Result<()> {
        let mut st = self.st.borrow_mut();
        if ep.0 >= st.peers.len() {
            return Err(no_such_ep(ep.0));
        }
        st.life.ep_handlers.insert(ep.0, Box::new(h));
        Ok(())
    }

    /// After the interfaces were progressed: step the closes, hand owned requests back, report
    /// failed endpoints (all outside the worker's borrows).
    pub(super) fn after_progress(&self) -> usize {
        let acts = {
            let mut st = self.st.borrow_mut();
            if st.life.closes.is_empty() {
                Vec::new()
            } else {
                st.step_closes()
            }
        };
        let mut n = acts.len();
        run_deferred(acts);
        n += self.reap_owned();
        n + self.report_failures()
    }

    /// The worker's drop: closes still in progress end with [`Error::Canceled`] (their handles
    /// are told; the interfaces close with the worker).
    pub(super) fn cancel_closes(&mut self) {
        let closes = std::mem::take(&mut self.st.get_mut().life.closes);
        run_deferred(
            closes
                .into_iter()
                .filter_map(|c| c.done.finish(Err(Error::Canceled))),
        );
    }

    /// Run the error handlers of the endpoints that failed since the last call.
    fn report_failures(&self) -> usize {
        let mut n = 0;
        loop {
            let (p, err, mut h, own) = {
                let mut st = self.st.borrow_mut();
                let Some((p, err)) = st.life.events.pop_front() else {
                    return n;
                };
                match st.life.ep_handlers.remove(&p) {
                    Some(h) => (p, err, h, true),
                    None => match st.life.handler.take() {
                        Some(h) => (p, err, h, false),
                        None => continue,
                    },
                }
            };
            let res =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(self, EpId(p), &err)));
            n += 1;
            // The endpoint's own handler has done its one call; the worker's goes back unless
            // it was replaced meanwhile (also when it panicked: later failures are still
            // reported, from the next progress on, once the panic reached the caller).
            if !own {
                let mut st = self.st.borrow_mut();
                if st.life.handler.is_none() {
                    st.life.handler = Some(h);
                }
            }
            if let Err(panic) = res {
                std::panic::resume_unwind(panic);
            }
        }
    }
}

impl State {
    /// This side closes endpoint `p`: its waiting stream receives end with
    /// [`Error::StreamIncomplete`] for `cause`, and the stream bytes nobody received are
    /// dropped.
    fn drop_stream(&mut self, p: usize, cause: Error) {
        let (reqs, peer) = (&mut self.reqs, &mut self.peers[p]);
        let mut io = StreamReqs::new(reqs, p).ended_by(cause);
        peer.stream_rx.clear(&mut io);
        let ended = io.ended;
        self.note_stream_ends(&ended);
    }

    /// Pending requests bound to peer `p`: sends and remote memory access to it, receives
    /// matched to a message from it (a stream receive waiting for bytes is not: a flush does
    /// not wait for bytes the peer may never send; the close ends it).
    fn bound_to(&self, p: usize) -> Vec<u64> {
        self.reqs
            .iter()
            .filter(|(_, r)| r.result.is_none())
            .filter(|(_, r)| match &r.kind {
                ReqKind::Recv(RecvState {
                    proto: RecvProto::Stream { .. },
                    ..
                }) => false,
                ReqKind::Send(s) => s.head.peer == p,
                ReqKind::Recv(rs) => rs.sender == Some(p),
                ReqKind::Rma(rm) => rm.peer == p,
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Requests of peer `p` that ended but whose operations the transport still runs.
    fn ops_running(&self, p: usize) -> bool {
        self.reqs.iter().any(|(_, r)| {
            r.outstanding > 0
                && match &r.kind {
                    ReqKind::Send(s) => s.head.peer == p,
                    ReqKind::Recv(rs) => rs.sender == Some(p),
                    ReqKind::Rma(rm) => rm.peer == p,
                }
        })
    }

    /// Queue the disconnect message to peer `p` and hand it to the transport if it can.
    fn disconnect(&mut self, p: usize) {
        let src = self.address.uuid;
        self.send_msg(p, &Msg::Disconnect { src });
        self.pump(p);
    }

    /// The endpoint to `p` is done: requests still bound to it end with `err`, its lanes are
    /// released (a connection-oriented transport tells the peer), stream bytes nobody received
    /// are dropped (waiting stream receives end with what they hold).
    fn release(&mut self, p: usize, reason: &str, err: &Error) {
        let closed = Error::EndpointClosed {
            ep: format!("ep{p}"),
            peer: self.peers[p].remote.describe(),
            by: Closed::ByUs.describe().into(),
        };
        self.drop_stream(p, closed);
        if self.peers[p].failed.is_none() {
            self.end_peer(p, reason, err);
        }
        let peer = &mut self.peers[p];
        peer.eps = Lanes::default();
        peer.needs_lanes = false;
    }

    /// Advance every close in progress; what to run once the borrows are released.
    fn step_closes(&mut self) -> Vec<Deferred> {
        let mut acts = Vec::new();
        let mut closes = std::mem::take(&mut self.life.closes);
        closes.retain_mut(|c| {
            let p = c.p;
            let res = match self.close_step(c) {
                None => return true,
                Some(r) => r,
            };
            self.release(p, "closed by this worker", &Error::Canceled);
            acts.extend(c.done.finish(res));
            false
        });
        closes.append(&mut self.life.closes);
        self.life.closes = closes;
        acts
    }

    /// One look at close `c`: its result once done.
    fn close_step(&mut self, c: &mut Close) -> Option<Result<Completion>> {
        let p = c.p;
        if self.peers[p].failed.is_some() {
            // The disconnect went out already, or the peer closed its side too: closed as
            // asked. Otherwise the endpoint failed under the close.
            if matches!(c.phase, Phase::Disconnecting)
                || self.peers[p].closed == Some(Closed::ByPeer)
            {
                return Some(Ok(DONE));
            }
            return Some(Err(self.failed_error(p)));
        }
        loop {
            match c.phase {
                Phase::Draining => {
                    if !self.peers[p].queue.is_empty()
                        || !self.bound_to(p).is_empty()
                        || self.ops_running(p)
                    {
                        return None;
                    }
                    c.phase = Phase::Flushing(self.flush_req(p));
                }
                Phase::Flushing(id) => {
                    let res = self.reqs.get(&id).map(|r| r.result.clone())?;
                    let res = res?;
                    self.reqs.remove(&id);
                    if let Err(e) = res {
                        return Some(Err(e));
                    }
                    self.disconnect(p);
                    c.phase = Phase::Disconnecting;
                }
                Phase::Disconnecting => {
                    if !self.peers[p].queue.is_empty() || self.ops_running(p) {
                        return None;
                    }
                    return Some(Ok(DONE));
                }
            }
        }
    }

    /// The peer for a wire-up from the worker at `remote` whose endpoint for us is `ep`. A
    /// wire-up for an endpoint that failed or was closed is a reconnect (a new endpoint) when
    /// it comes from another endpoint of the peer than the one we knew; from the same one (or
    /// when we knew none: the peer's answer to our own wire-up, late) it is the old
    /// connection's.
    pub(super) fn peer_for_wireup(
        &mut self,
        remote: crate::address::WorkerAddress,
        ep: u64,
    ) -> Result<usize> {
        if let Some(&p) = self.by_uuid.get(&remote.uuid) {
            let peer = &mut self.peers[p];
            let known = *peer.remote_ep.get_or_insert(ep);
            let gone = peer.failed.is_some() || peer.closed.is_some();
            if !gone || known == ep {
                return Ok(p);
            }
        }
        let p = self.peer_for(remote)?;
        self.peers[p].remote_ep = Some(ep);
        Ok(p)
    }

    /// A reconnect waits for the close of the old endpoint to end (its messages still arrive
    /// for it).
    pub(crate) fn refuse_while_closing(&self, uuid: u64) -> Result<()> {
        match self.by_uuid.get(&uuid) {
            Some(&p)
                if self.peers[p].closed == Some(Closed::ByUs) && self.peers[p].failed.is_none() =>
            {
                Err(Error::NoResource(format!(
                    "endpoint ep{p} to {} is still closing; connect again once its close \
                     request ended",
                    self.peers[p].remote.describe()
                )))
            }
            _ => Ok(()),
        }
    }

    /// The peer closed its endpoint to us (its disconnect message arrived).
    pub(super) fn closed_by_peer(&mut self, p: usize) {
        if self.peers[p].failed.is_some() {
            return;
        }
        let by_us = self.peers[p].closed == Some(Closed::ByUs);
        self.peers[p].closed = Some(Closed::ByPeer);
        let err = Error::EndpointClosed {
            ep: format!("ep{p}"),
            peer: self.peers[p].remote.describe(),
            by: Closed::ByPeer.describe().into(),
        };
        tracing::debug!("endpoint ep{p}: {err}");
        self.end_peer(p, "the peer closed the endpoint", &err);
        if !by_us {
            let peer = &mut self.peers[p];
            peer.eps = Lanes::default();
            peer.needs_lanes = false;
            self.note_ep_failure(p, err);
        }
    }

    /// Endpoint `p` failed with `err`: report it to the error handler from progress, unless
    /// this worker is closing it.
    pub(super) fn note_ep_failure(&mut self, p: usize, err: Error) {
        if self.peers[p].closed == Some(Closed::ByUs) {
            return;
        }
        if self.life.handler.is_some() || self.life.ep_handlers.contains_key(&p) {
            self.life.events.push_back((p, err));
        }
    }
}
