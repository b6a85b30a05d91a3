//! GPU bounce eager: a small GPU message copied to a pinned bounce fragment by the copy lane
//! and sent eagerly; eager bytes that land in GPU memory copied on with the copy lane.

use crate::proto::memcopy::copy_io::{BounceIo, CopyLane};
use crate::proto::memcopy::state::{bounce_out, eager_to_gpu};
use crate::worker::prelude::*;

impl State {
    /// Copy arrived eager bytes into GPU memory through the copy lane (small messages): the
    /// bytes at `offset` that fit the receive's buffer; the buffer is registered with the copy
    /// lane on the first bytes and kept with the receive.
    pub(crate) fn copy_to_gpu(&mut self, rid: u64, offset: usize, data: &[u8]) -> Result<()> {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        else {
            return Ok(());
        };
        let buf = MemRegion {
            addr: rs.addr,
            len: rs.cap,
            mem_type: rs.mem,
            device: rs.dev,
        };
        let mut reg = rs.dev_memh.take();
        let r = eager_to_gpu(self, &mut reg, buf, offset, data);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.dev_memh = reg;
        }
        r
    }
}

/// What became of a small GPU send the plan gave to the bounce protocol.
pub(crate) enum Bounced {
    /// Copied out and sent eagerly.
    Sent(Posted),
    /// No bounce fragment now (or the copy failed): the table's rendezvous protocol carries it
    /// instead.
    Instead(Proto),
}

/// What the bounce send asks of the worker besides [`BounceIo`]: the plan's protocols, and
/// starting the eager send of the bounced bytes.
pub(crate) trait BounceSendIo: BounceIo {
    /// The protocol of operation `op` for `len` bytes of host memory to peer `p`.
    fn host_proto(&self, p: usize, op: Op, len: usize) -> Option<Proto>;

    /// The rendezvous protocol of the table of `op` for `key` memory to peer `p` (its last
    /// row), if that row is one.
    fn rndv_row(&self, p: usize, op: Op, key: MemKey) -> Option<Proto>;

    /// Start send `send` (host memory) of its protocol: its request. An eager protocol copies
    /// the bytes out before this returns.
    fn start_host_send(&mut self, send: SendState) -> u64;
}

/// Send GPU buffer `from` to peer `p` (operation `op`, `tag`) through a pinned bounce fragment:
/// copied out ([`bounce_out`]) and sent eagerly by the host table's protocol of the same
/// operation (a synchronous send stays one), the fragment given back at once; else (no
/// fragment free, or the registration or the copy failed) the table's rendezvous protocol.
pub(crate) fn send_bounce(
    io: &mut impl BounceSendIo,
    p: usize,
    from: MemRegion,
    tag: Tag,
    op: Op,
) -> Result<Bounced> {
    let len = from.len;
    match bounce_out(io, from) {
        Ok((frag, host)) => {
            let hproto = io.host_proto(p, op, len).unwrap_or(Proto::EagerBcopy);
            let send = SendState::new(p, host, len, tag, hproto, op, MemoryType::Host, None);
            io.count(Proto::EagerBounce.name());
            // Eager protocols copy the bytes out before returning.
            let id = io.start_host_send(send);
            io.release_bounce(frag);
            return Ok(Bounced::Sent(Posted::Pending(id)));
        }
        Err(e) => tracing::debug!("no bounce buffer for a small GPU message ({e}); rendezvous"),
    }
    // Not bounced: the large-message protocol of the same table.
    io.rndv_row(p, op, MemKey::new(from.mem_type, from.device))
        .map(Bounced::Instead)
        .ok_or_else(|| Error::Internal("a GPU table without a rendezvous row".into()))
}

impl BounceSendIo for CopyLane<'_> {
    fn host_proto(&self, p: usize, op: Op, len: usize) -> Option<Proto> {
        self.st.peers[p].plan.select(op, MemKey::HOST, len)
    }

    fn rndv_row(&self, p: usize, op: Op, key: MemKey) -> Option<Proto> {
        self.st.peers[p]
            .plan
            .table(op, key)
            .rows
            .last()
            .map(|r| r.proto)
            .filter(|p| p.is_rndv())
    }

    fn start_host_send(&mut self, send: SendState) -> u64 {
        let id = self.st.new_req(ReqKind::Send(send));
        self.st.start_send(id);
        id
    }
}

impl Worker {
    /// Send `len` bytes of GPU memory at `addr` to peer `p` through a pinned bounce fragment
    /// (the plan's protocol for small GPU messages of operation `op`), or say which protocol
    /// carries it instead ([`send_bounce`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_bounce(
        &self,
        st: &mut State,
        p: usize,
        addr: usize,
        len: usize,
        tag: Tag,
        (mem, dev): (MemoryType, Option<u32>),
        op: Op,
    ) -> Result<Bounced> {
        let from = MemRegion {
            addr,
            len,
            mem_type: mem,
            device: dev,
        };
        send_bounce(&mut self.copy_lane(st), p, from, tag, op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::memcopy::fake::{CopyFake, FRAG_BASE, gpu};

    const G: usize = 0x1000_0000;

    fn fake() -> CopyFake {
        let mut io = CopyFake::new(64, 4096, 1);
        io.host_proto = Some(Proto::EagerBcopy);
        io.rndv_row = Some(Proto::RndvGet);
        io
    }

    fn sent_id(b: Bounced) -> u64 {
        match b {
            Bounced::Sent(Posted::Pending(id)) => id,
            Bounced::Sent(_) => panic!("a bounce send is a request"),
            Bounced::Instead(p) => panic!("not bounced: {p:?}"),
        }
    }

    fn instead(b: Result<Bounced>) -> Proto {
        match b {
            Ok(Bounced::Instead(p)) => p,
            Ok(Bounced::Sent(_)) => panic!("bounced"),
            Err(e) => panic!("{e}"),
        }
    }

    /// A small GPU message is copied into the bounce fragment and sent from there by the host
    /// protocol; the fragment comes back at once, so the next message bounces through it too.
    #[test]
    fn a_small_gpu_message_bounces_and_the_fragment_is_reused() {
        let mut io = fake();
        for (i, len) in [100usize, 4096, 1].into_iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|k| (k * 7 + i) as u8).collect();
            let at = G + i * 0x10_000;
            io.fill(at, &data);
            let id = sent_id(send_bounce(&mut io, 2, gpu(at, len), 7, Op::Tag).unwrap());
            let (send, bytes) = io.sent.last().expect("sent");
            let head = &send.head;
            assert_eq!(id, 100 + io.sent.len() as u64);
            assert_eq!((head.peer, head.addr, head.len), (2, FRAG_BASE, len));
            assert_eq!(
                (head.tag, head.proto, head.op),
                (7, Proto::EagerBcopy, Op::Tag)
            );
            assert_eq!(head.mem, MemoryType::Host);
            assert_eq!(bytes, &data);
            assert_eq!((io.free.len(), io.live_regs()), (1, 0));
        }
        assert_eq!(io.sent.len(), 3);
        assert_eq!(
            io.counted
                .iter()
                .filter(|c| **c == Proto::EagerBounce.name())
                .count(),
            3
        );
    }

    /// The host table of the same operation carries it: a synchronous send stays one; a plan
    /// without a host row sends it by copy-in.
    #[test]
    fn the_host_protocol_of_the_same_operation_sends_it() {
        let mut io = fake();
        io.host_proto = Some(Proto::EagerSync);
        sent_id(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::TagSync).unwrap());
        assert_eq!(
            (io.sent[0].0.head.proto, io.sent[0].0.head.op),
            (Proto::EagerSync, Op::TagSync)
        );
        io.host_proto = None;
        sent_id(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag).unwrap());
        assert_eq!(io.sent[1].0.head.proto, Proto::EagerBcopy);
    }

    /// A copy pushed back is posted again after progress, and the message still bounces.
    #[test]
    fn a_pushed_back_bounce_copy_is_posted_again() {
        let mut io = fake();
        io.push_back = vec![0, 1];
        io.poll_delay = 3;
        io.fill(G, &[9; 50]);
        sent_id(send_bounce(&mut io, 0, gpu(G, 50), 1, Op::Tag).unwrap());
        assert_eq!(io.sent[0].1, vec![9; 50]);
        assert_eq!(io.moves.len(), 1);
        assert_eq!((io.free.len(), io.live_regs()), (1, 0));
    }

    /// No fragment free, the copy lane's domain refusing the buffer (demoted), the staging not
    /// made, a message larger than a fragment, a copy that fails: the table's rendezvous
    /// carries it; nothing is sent and nothing stays held.
    #[test]
    fn what_cannot_bounce_goes_by_rendezvous() {
        let mut io = fake();
        let held = io.take_bounce().unwrap();
        assert_eq!(
            instead(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag)),
            Proto::RndvGet
        );
        io.release_bounce(held.0);

        let mut io = fake();
        io.refuse_reg = true;
        assert_eq!(
            instead(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag)),
            Proto::RndvGet
        );

        let mut io = fake();
        io.staging_fails = true;
        assert_eq!(
            instead(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag)),
            Proto::RndvGet
        );

        let mut io = fake();
        assert_eq!(
            instead(send_bounce(&mut io, 0, gpu(G, 4097), 1, Op::Tag)),
            Proto::RndvGet
        );
        assert_eq!(io.free.len(), 1);

        let mut io = fake();
        io.fail_copy = vec![0];
        io.rndv_row = Some(Proto::RndvPipeline);
        assert_eq!(
            instead(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag)),
            Proto::RndvPipeline
        );
        assert_eq!((io.moves.len(), io.free.len(), io.live_regs()), (1, 1, 0));
        assert!(io.sent.is_empty());
        // The fragment came back: the next one bounces.
        sent_id(send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag).unwrap());
    }

    /// A GPU table whose last row is not a rendezvous cannot carry what did not bounce.
    #[test]
    fn no_rendezvous_row_is_an_internal_error() {
        let mut io = fake();
        io.free.clear();
        io.rndv_row = None;
        let r = send_bounce(&mut io, 0, gpu(G, 10), 1, Op::Tag);
        assert!(matches!(r, Err(Error::Internal(_))));
    }
}
