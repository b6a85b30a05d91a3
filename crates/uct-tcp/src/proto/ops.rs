//! Our endpoint's requests (`Put`, `GetReq`, `Flush`) waiting for the peer's answers. The peer
//! answers in request order, so an answer must name the oldest outstanding request and be of
//! a kind that answers it; anything else is a protocol violation. A flush posted right after a
//! request (nothing in between) waits for that request's answer instead of sending a `Flush`.

use std::collections::VecDeque;

use rucx_uct::MemHandle;

use crate::wire::Kind;

/// A request of our endpoint waiting for the peer's answer.
#[derive(Debug)]
pub(crate) struct PendingOp {
    pub(crate) op: u64,
    /// Requests and active messages posted up to and including this request.
    pub(crate) posted: u64,
    /// Completion token; `None` for `put_short` (no completion) and after the endpoint went.
    pub(crate) token: Option<u64>,
    /// The endpoint that posted it is gone: its answer is consumed silently.
    pub(crate) orphan: bool,
    pub(crate) kind: PendKind,
    /// Tokens of flushes posted right after this request (nothing between): the peer answers
    /// in order, so once this request is answered, everything posted before the flush was
    /// processed, and the flush completes without a `Flush` frame of its own.
    pub(crate) flushes: Vec<u64>,
}

/// What a request was.
#[derive(Debug)]
pub(crate) enum PendKind {
    Put,
    /// A get and where its data goes: `(handle, address, length)` pieces laid end to end,
    /// validated against their handles when posted and kept registered by them.
    Get {
        dst: Vec<(MemHandle, usize, usize)>,
        len: usize,
    },
    Flush,
}

impl PendKind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            PendKind::Put => "put",
            PendKind::Get { .. } => "get",
            PendKind::Flush => "flush",
        }
    }
}

/// The requests of one endpoint on one connection, and how far the peer has processed.
#[derive(Debug)]
pub(crate) struct Requests {
    next_op: u64,
    pending: VecDeque<PendingOp>,
    /// Requests and active messages our endpoint posted (`Hello`/`Detach` excluded).
    posted: u64,
    /// Of those, how many the peer has certainly processed (all up to the last one answered).
    acked: u64,
}

impl Default for Requests {
    fn default() -> Self {
        Requests {
            next_op: 1,
            pending: VecDeque::new(),
            posted: 0,
            acked: 0,
        }
    }
}

impl Requests {
    /// The id the next request gets.
    pub(crate) fn next_op(&self) -> u64 {
        self.next_op
    }

    /// Count one request or active message handed to the connection.
    pub(crate) fn count_posted(&mut self) {
        self.posted += 1;
    }

    /// The request just posted (and counted) waits for its answer; returns its id.
    pub(crate) fn push(&mut self, token: Option<u64>, kind: PendKind) -> u64 {
        let op = self.next_op;
        self.pending.push_back(PendingOp {
            op,
            posted: self.posted,
            token,
            orphan: false,
            kind,
            flushes: Vec::new(),
        });
        self.next_op += 1;
        op
    }

    /// No request waits for an answer.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Everything posted was processed by the peer (a flush has nothing to wait for).
    pub(crate) fn all_answered(&self) -> bool {
        self.posted == self.acked && self.pending.is_empty()
    }

    /// A flush with nothing posted after the last outstanding request: it waits for that
    /// request's answer (returns true) instead of a `Flush` of its own. False when something
    /// was posted since (an active message) or nothing is outstanding.
    pub(crate) fn flush_behind_last(&mut self, token: u64) -> bool {
        match self.pending.back_mut() {
            Some(p) if p.posted == self.posted => {
                p.flushes.push(token);
                true
            }
            _ => false,
        }
    }

    /// Check that an answer of `kind` naming `op` (with `data` bytes of get data) answers the
    /// oldest request; returns that request.
    pub(crate) fn check_answer(
        &self,
        kind: Kind,
        op: u64,
        data: usize,
    ) -> Result<&PendingOp, String> {
        let front = match self.pending.front() {
            Some(p) if p.op == op => p,
            Some(p) => {
                return Err(format!(
                    "{kind:?} for request {op}, but request {} is the oldest outstanding",
                    p.op
                ));
            }
            None => {
                return Err(format!(
                    "{kind:?} for request {op}, but none is outstanding"
                ));
            }
        };
        match (kind, &front.kind) {
            (Kind::Ack, PendKind::Put | PendKind::Flush) | (Kind::OpError, _) => Ok(front),
            (Kind::GetRep, PendKind::Get { len, .. }) if *len == data => Ok(front),
            (Kind::GetRep, PendKind::Get { len, .. }) => {
                Err(format!("get reply of {data} bytes for a {len}-byte get"))
            }
            (k, p) => Err(format!(
                "{k:?} answering request {op}, which is a {}",
                p.name()
            )),
        }
    }

    /// The destination of the oldest request when it is get `op` of `len` bytes.
    pub(crate) fn get_dst(&self, op: u64, len: usize) -> Option<&[(MemHandle, usize, usize)]> {
        match self.pending.front() {
            Some(PendingOp {
                op: o,
                kind: PendKind::Get { dst, len: l },
                ..
            }) if *o == op && *l == len => Some(dst),
            _ => None,
        }
    }

    /// The oldest request was answered: remove it.
    pub(crate) fn pop_answered(&mut self) -> Option<PendingOp> {
        let p = self.pending.pop_front()?;
        self.acked = p.posted;
        Some(p)
    }

    /// Remove the oldest request if it is `op` (a get whose data was received straight into
    /// its buffers; it is gone when the connection failed meanwhile).
    pub(crate) fn finish(&mut self, op: u64) -> Option<PendingOp> {
        if self.pending.front().is_some_and(|p| p.op == op) {
            self.pop_answered()
        } else {
            None
        }
    }

    /// The endpoint went: answers still arrive, but complete nothing.
    pub(crate) fn orphan_all(&mut self) {
        for p in self.pending.iter_mut() {
            p.token = None;
            p.flushes.clear();
            p.orphan = true;
        }
    }

    /// Remove every waiting request (the connection failed); returns their tokens.
    pub(crate) fn drain_tokens(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.pending
            .drain(..)
            .flat_map(|p| p.token.into_iter().chain(p.flushes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_must_name_the_oldest_request_and_fit_it() {
        let mut r = Requests::default();
        assert!(r.all_answered());
        assert!(
            r.check_answer(Kind::Ack, 1, 0)
                .unwrap_err()
                .contains("none is outstanding")
        );
        r.count_posted();
        assert_eq!(r.push(Some(10), PendKind::Put), 1);
        // An active message between the requests.
        r.count_posted();
        r.count_posted();
        assert_eq!(
            r.push(
                Some(11),
                PendKind::Get {
                    dst: Vec::new(),
                    len: 5
                }
            ),
            2
        );
        r.count_posted();
        assert_eq!(r.push(None, PendKind::Flush), 3);
        assert_eq!(r.next_op(), 4);
        assert!(!r.all_answered());
        // Out of order, wrong kind.
        assert!(
            r.check_answer(Kind::Ack, 2, 0)
                .unwrap_err()
                .contains("request 1 is the oldest")
        );
        assert!(
            r.check_answer(Kind::GetRep, 1, 0)
                .unwrap_err()
                .contains("which is a put")
        );
        assert_eq!(r.check_answer(Kind::Ack, 1, 0).unwrap().token, Some(10));
        assert_eq!(r.pop_answered().unwrap().op, 1);
        // The get: length must match; an error answers anything.
        assert!(r.check_answer(Kind::Ack, 2, 0).is_err());
        assert!(
            r.check_answer(Kind::GetRep, 2, 4)
                .unwrap_err()
                .contains("4 bytes for a 5-byte get")
        );
        assert!(r.check_answer(Kind::GetRep, 2, 5).is_ok());
        assert!(r.check_answer(Kind::OpError, 2, 0).is_ok());
        assert!(r.get_dst(2, 5).is_some() && r.get_dst(2, 4).is_none());
        assert!(r.finish(3).is_none(), "only the oldest finishes");
        assert_eq!(r.finish(2).unwrap().op, 2);
        // The flush is not answered yet: the active message before it may not be processed.
        assert!(!r.all_answered());
        r.orphan_all();
        let p = r.pop_answered().unwrap();
        assert!(p.orphan && p.token.is_none());
        assert!(r.all_answered());
    }

    #[test]
    fn failing_returns_every_waiting_token() {
        let mut r = Requests::default();
        for t in [Some(1), None, Some(3)] {
            r.count_posted();
            r.push(t, PendKind::Flush);
        }
        assert_eq!(r.drain_tokens().collect::<Vec<_>>(), vec![1, 3]);
        assert!(r.is_empty());
    }
}
