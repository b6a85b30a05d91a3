//! Canceling requests, and leaving a scope within a time limit.
//!
//! # The rule for sends
//!
//! A send can be canceled while no receive has seen any of it, and only then:
//!
//! - **not on the wire yet** (queued behind a transport's `NoResource`, or behind earlier
//!   messages to the same peer): it is taken out of the queue and ends with
//!   [`Error::Canceled`] at once;
//! - **announced but not matched**: a rendezvous send whose announcement (RTS) the receiver
//!   holds unmatched, or a synchronous eager message waiting for its match: the receiver is
//!   asked to drop it ([`wire::AM_CANCEL`]). It answers *dropped* when no receive had matched
//!   it (the send then ends with `Canceled`; no receive will ever see the message) or *too
//!   late* when one had (the send then completes as if not canceled). Until the answer, the
//!   send stays pending and its buffer lent: with the rendezvous `get` scheme the receiver
//!   may be reading it;
//! - anything else is too late: an eager message handed to the transport (complete when
//!   posted, or with fragments on the wire), a stream send, a rendezvous the receiver answered
//!   (its data moving).
//!
//! Receives are canceled while unmatched (a stream receive gives the bytes it took back).
//!
//! # Leaving a scope within a limit
//!
//! [`Worker::scope_timeout`] ends its scope by canceling every request it can, then waiting at
//! most the limit for the rest. A request still pending then is bound to a peer that did not
//! answer in time: that endpoint is failed (as `RUCX_PEER_TIMEOUT` would), which ends every
//! request bound to it with [`Error::EndpointFailure`], and the scope returns
//! [`Error::Timeout`] naming the requests that were still pending.

use crate::wire::CancelStep;
use crate::worker::prelude::*;

impl Worker {
    /// Cancel request `id` where the rule above allows; true when it was canceled or its
    /// peer is asked to drop it (the request then ends `Canceled`, or as usual when the peer
    /// had matched it already).
    pub(crate) fn cancel_req(&self, id: u64) -> bool {
        let is_send = matches!(
            self.st.borrow().reqs.get(&id),
            Some(Req {
                kind: ReqKind::Send(_),
                result: None,
                ..
            })
        );
        if is_send {
            self.st.borrow_mut().cancel_send(id)
        } else {
            self.cancel_recv(id)
        }
    }

    /// End a scope within `limit`: cancel what can be, wait for the rest at most `limit`, then
    /// fail the endpoints of what is still pending (see the module's documentation) and say
    /// what that was.
    pub(crate) fn finish_scope_within(&self, ids: Vec<u64>, limit: Duration) -> Result<()> {
        for &id in &ids {
            self.cancel_req(id);
        }
        let start = Instant::now();
        let mut backoff = liveness::Backoff::new();
        let mut outcome = Ok(());
        loop {
            let pending: Vec<u64> = {
                let st = self.st.borrow();
                ids.iter()
                    .copied()
                    .filter(|id| st.reqs.get(id).is_some_and(|r| r.result.is_none()))
                    .collect()
            };
            if pending.is_empty() {
                break;
            }
            if start.elapsed() > limit {
                let mut st = self.st.borrow_mut();
                let what: Vec<String> = pending.iter().map(|&id| st.describe_req(id)).collect();
                let reason =
                    format!("a scope was left after waiting {limit:?} for its requests to end");
                let mut peers: Vec<usize> = pending
                    .iter()
                    .filter_map(|id| st.reqs.get(id).map(p_of))
                    .filter(|&p| p < st.peers.len())
                    .collect();
                peers.sort_unstable();
                peers.dedup();
                for p in peers {
                    st.fail_peer(p, &reason);
                }
                outcome = Err(Error::Timeout {
                    after: limit,
                    what: format!(
                        "{} request(s) of the scope, whose endpoints are now failed: {}",
                        what.len(),
                        what.join("; ")
                    ),
                });
                break;
            }
            if self.progress() == 0 {
                backoff.idle(self);
            } else {
                backoff.busy();
            }
        }
        // Everything has a result now; this releases the requests (after any local copies
        // still running on their buffers, which always end).
        self.finish_scope(ids);
        outcome
    }
}

impl State {
    /// Cancel send `id` (pending) if the rule allows; see the module's documentation.
    pub(crate) fn cancel_send(&mut self, id: u64) -> bool {
        let Some(Req {
            kind: ReqKind::Send(s),
            result: None,
            ..
        }) = self.reqs.get(&id)
        else {
            return false;
        };
        let (p, proto, wait, posted) = (s.head.peer, s.head.proto, s.wait(), s.posted());
        let untouched = s.rndv().is_none_or(|rv| rv.untouched());
        let queue = &mut self.peers[p].queue;
        // A stream send: its bytes belong to the stream, whose order cannot skip them.
        if queue.iter().any(
            |q| matches!(q, Pending::StreamPiece { id: i, .. } | Pending::Finish { id: i, .. } if *i == id),
        ) {
            return false;
        }
        // Not on the wire: its fragments are queued and none was posted.
        if wait == SendWait::Posting
            && posted == 0
            && let Some(at) = queue
                .iter()
                .position(|q| matches!(q, Pending::Stream(i) if *i == id))
        {
            queue.remove(at);
            self.finish(id, Err(Error::Canceled));
            self.count("send canceled");
            return true;
        }
        // Its announcement is still queued.
        if let Some(at) = queue.iter().position(|q| match q {
            Pending::Ctrl { id: am, bytes }
                if *am == wire::AM_RNDV_RTS || *am == wire::AM_EAGER_SYNC =>
            {
                matches!(
                    wire::parse(*am, bytes),
                    Ok(Msg::Rts { sreq, .. } | Msg::EagerSync { sreq, .. }) if sreq == id
                )
            }
            _ => false,
        }) {
            queue.remove(at);
            self.finish(id, Err(Error::Canceled));
            self.count("send canceled");
            return true;
        }
        // Announced; the receiver has not answered: ask it.
        let announced = wait == SendWait::Receiver
            && posted == 0
            && untouched
            && (proto.is_rndv() || proto == Proto::EagerSync);
        if announced {
            let src = self.address.uuid;
            self.send_msg(
                p,
                &Msg::Cancel {
                    src,
                    sreq: id,
                    step: CancelStep::Ask,
                },
            );
            self.pump(p);
            self.count("send cancel asked");
            return true;
        }
        false
    }

    /// A cancellation step from peer `p` about its (`Ask`) or our (answers) send `sreq`.
    pub(crate) fn on_cancel(&mut self, p: usize, sreq: u64, step: CancelStep) {
        match step {
            CancelStep::Ask => {
                // The announcement came first on this endpoint's ordered lane: either it is
                // still unmatched here, or a receive took it.
                let dropped = self.matcher.drop_unexpected(|u| match u {
                    Unexp::Rts { src, sreq: s, .. } => *src == p && *s == sreq,
                    Unexp::Eager {
                        src, sync: Some(s), ..
                    } => *src == p && *s == sreq,
                    Unexp::Eager { .. } => false,
                });
                let step = if dropped.is_empty() {
                    CancelStep::TooLate
                } else {
                    CancelStep::Dropped
                };
                let src = self.address.uuid;
                self.send_msg(p, &Msg::Cancel { src, sreq, step });
                self.pump(p);
            }
            CancelStep::Dropped => {
                if matches!(
                    self.reqs.get(&sreq),
                    Some(Req { kind: ReqKind::Send(s), result: None, .. }) if s.head.peer == p
                ) {
                    self.finish(sreq, Err(Error::Canceled));
                    self.count("send canceled");
                }
            }
            // The send goes on (or finished already: its acknowledgement came first).
            CancelStep::TooLate => {}
        }
    }

    /// One line about request `id` for an error: what it is, with whom, where it stands.
    pub(crate) fn describe_req(&self, id: u64) -> String {
        let Some(r) = self.reqs.get(&id) else {
            return format!("request {id} (gone)");
        };
        let peer = |p: usize| {
            self.peers
                .get(p)
                .map_or_else(|| "no peer".to_string(), |x| x.remote.describe())
        };
        match &r.kind {
            ReqKind::Send(s) => format!(
                "a {} send of {} bytes (tag {:#x}) to {}, {}",
                s.head.proto.name(),
                s.head.len,
                s.head.tag,
                peer(s.head.peer),
                match s.wait() {
                    SendWait::Posting => "being posted",
                    SendWait::Receiver => "waiting for the receiver",
                    SendWait::Completions => "waiting for its transfers to complete",
                }
            ),
            ReqKind::Recv(rs) => match rs.sender {
                Some(p) => format!(
                    "a receive of {} bytes (tag {:#x}) from {}, {} of {} bytes in",
                    rs.cap,
                    rs.tag,
                    peer(p),
                    rs.received,
                    rs.total
                ),
                None => format!("a receive of {} bytes, unmatched", rs.cap),
            },
            ReqKind::Rma(m) => format!(
                "a remote memory access of {} bytes to {}",
                m.len,
                peer(m.peer)
            ),
        }
    }
}
