//! Simultaneous connects. Endpoints created at the same moment on both sides first get one
//! connection each (each dialed its own). Once the connection the peer dialed said hello, the
//! side with the larger listening address moves its endpoint onto it, so both directions
//! share one connection (acknowledgements then ride on the answers instead of costing packets
//! of their own); the side with the smaller address keeps its endpoint where it is, so both
//! pick the same connection.
//!
//! The move happens between two requests: when no request of the endpoint is outstanding and
//! nothing is queued on the connection it leaves. The two connection objects trade sockets:
//! the endpoint's object takes the accepted socket and sends `Joined` (naming the connection
//! left by our local address) there first; the other takes the dialed socket, sends `Detach`
//! and closes it like any connection nobody uses. The peer handles the connection left up to
//! that `Detach` before what follows `Joined`, so the endpoint's messages keep their order.

use std::net::{SocketAddr, SocketAddrV4};

use super::conn::{Conn, State};
use crate::stream::OwnedSock;
use crate::wire;

/// Outcome of one [`move_endpoint`] step.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Merge {
    /// Moved.
    Done,
    /// Not now (requests outstanding, output queued, still connecting): try again later.
    Wait,
    /// Not any more (a connection failed, closed, or got taken).
    Abort,
}

/// Whether the side listening on `me` moves its endpoint to `peer` onto the connection the
/// peer dialed (it has the larger address).
pub(crate) fn we_move(me: SocketAddrV4, peer: SocketAddrV4) -> bool {
    let order = |a: SocketAddrV4| (u32::from(*a.ip()), a.port());
    order(me) > order(peer)
}

/// Whether dialed connection `c` carries an endpoint to `peer` that may move.
pub(crate) fn movable<S>(c: &Conn<S>, peer: SocketAddrV4) -> bool {
    c.peer == Some(peer) && c.ep.is_some() && !c.detach_sent
}

/// One step of moving our endpoint from dialed connection `cd` onto accepted connection `ca`
/// (which said hello). On [`Merge::Done`] the objects traded sockets: `cd` (which the
/// endpoint holds) is now on the accepted socket, `ca` on the dialed one; the interface swaps
/// the two objects between its slots so each slot's socket stays with its object.
pub(crate) fn move_endpoint<S: OwnedSock>(cd: &mut Conn<S>, ca: &mut Conn<S>) -> Merge {
    let d_ok = cd.ep.is_some() && !cd.is_failed() && !cd.closing && !cd.detach_sent;
    let a_ok = ca.ep.is_none()
        && ca.state == State::Open
        && !ca.closing
        && !ca.detach_sent
        && !ca.peer_detached
        && ca.ops.is_empty()
        && ca.peer == cd.peer;
    if !(d_ok && a_ok) {
        return Merge::Abort;
    }
    if cd.state != State::Open
        || !cd.tx.is_empty()
        || !cd.ops.is_empty()
        || !cd.completions.is_empty()
        || cd.tx.has_done()
    {
        return Merge::Wait;
    }
    let Ok(left) = cd.sock.local_addr() else {
        return Merge::Abort;
    };
    tracing::debug!(
        "tcp: endpoint to {} moves to the connection the peer opened",
        cd.peer_name()
    );
    cd.trade_socket(ca);
    cd.tx.push_owned(&wire::joined_frame(left), None);
    // `ca` now has the dialed socket and no endpoint on it.
    ca.tx.push_owned(&wire::detach_frame(), None);
    ca.detach_sent = true;
    // Written now, so the endpoint's next message goes straight to the socket as before.
    for c in [cd, ca] {
        if let Err(e) = c.tx.write(&mut c.sock) {
            c.fail(&format!("send: {e}"));
        }
        c.kick();
    }
    Merge::Done
}

/// Whether connection `c`, which the peer dialed, is the one the peer's endpoint left (it
/// named `left`, the peer's local address of it, in `Joined`) and its `Detach` is still to
/// come: frames after `Joined` wait for it.
pub(crate) fn left_and_pending<S>(c: &Conn<S>, left: SocketAddrV4) -> bool {
    c.remote == SocketAddr::V4(left) && !c.peer_detached && !c.is_failed()
}
