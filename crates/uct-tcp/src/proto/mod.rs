//! The connection protocol, as pure code: what a connection sends and expects, in which state,
//! and what it does with each frame. Nothing here owns a descriptor or makes a system call;
//! bytes go through the socket traits of `stream` (a TCP socket in the interface, an in-memory
//! pair in the tests here), memory through the registration table and the handles of the
//! operations.
//!
//! - [`conn`]: one connection's state shared by the interface and the endpoint on it: the send
//!   queue, `Connecting`/`Open`/`Failed`, `Hello` checks, `Detach` and closing, serving the
//!   peer's requests and taking its answers.
//! - [`ops`]: our endpoint's requests waiting for answers, matched in order.
//! - [`rx`]: the receiving half: frames reassembled and handled in order (what is allowed before
//!   `Hello`, `Joined` holding frames back), large put and get bodies received straight into
//!   their destination.
//! - [`merge`]: simultaneous connects: which side moves its endpoint, and the move itself.
//!
//! # Connections
//! A connection is full duplex and may carry one endpoint of each side. Both sides send `Hello`
//! first (the sender's listening address); then each side's endpoint sends requests and active
//! messages, and each side answers the requests it receives on the same connection, in order.
//! An endpoint to peer P takes over a connection that P opened to us when our side of it has no
//! endpoint yet; otherwise it opens a new one. When both sides create endpoints at once they
//! hold two connections, one used by each side, until the side with the larger listening
//! address moves its endpoint onto the peer's connection ([`merge::move_endpoint`]; the peer
//! keeps the order with `Joined`) and closes its own.
//!
//! When our endpoint goes, we send `Detach` after everything it posted; a side that has no
//! endpoint on the connection and has seen the peer's `Detach` sends what it still has queued,
//! half-closes, and closes at end of stream.

pub(crate) mod conn;
pub(crate) mod merge;
pub(crate) mod ops;
pub(crate) mod rx;
#[cfg(test)]
mod tests;

use std::sync::{Mutex, MutexGuard, PoisonError};

pub(crate) use conn::{Conn, Owned, Part, Setup, State};
pub(crate) use ops::PendKind;
pub(crate) use rx::{Ready, Receiver};

/// Lock a connection (a panic elsewhere does not make it unusable here).
pub(crate) fn lock<T>(c: &Mutex<T>) -> MutexGuard<'_, T> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}
