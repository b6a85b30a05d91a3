//! Rendezvous by read (`get_zcopy`): the receiver reads the sender's registered buffer in
//! fragments and acknowledges; a read that cannot start or fails asks the sender to stream.

use crate::worker::prelude::*;

impl State {
    /// Post the reads of a rendezvous receive.
    pub(crate) fn stream_get(&mut self, rid: u64) -> Result<bool> {
        if matches!(&self.reqs[&rid].kind, ReqKind::Recv(rs) if rs.staged().is_some_and(|sr| sr.active()))
        {
            return self.stream_chunks(rid);
        }
        let r = &self.reqs[&rid];
        let ReqKind::Recv(RecvState {
            proto: RecvProto::Rndv(rv),
            ..
        }) = &r.kind
        else {
            return Ok(true);
        };
        let Some((lane, raddr, rkey, laddr)) = rv.get.clone() else {
            return Ok(true);
        };
        if !rv.via_get {
            return Ok(true);
        }
        let (p, want) = (rv.peer, rv.get_end);
        if self.peers[p].eps.get_mut(&lane).is_none() {
            if self.peers[p].targets.iter().any(|(l, _)| *l == lane) {
                // Being connected (see `read_lane`; asked again: a re-plan meanwhile makes a
                // new list of wanted lanes): the reads wait for it.
                self.want_lane(p, lane);
                return Ok(false);
            }
            // It could not be connected: the sender streams instead.
            self.restart_as_stream(rid);
            return Ok(true);
        }
        let mut off = rv.posted;
        // GPU zero-copy lanes move the whole buffer in one operation (into GPU memory, or out
        // of a GPU sender's buffer into host memory through an accelerator lane); host lanes in
        // fragments.
        let accel = self.slots[lane].attr.dev_type == rucx_uct::DeviceType::Accelerator;
        let frag = if accel || matches!(&r.kind, ReqKind::Recv(rs) if rs.mem.is_gpu()) {
            usize::MAX
        } else {
            self.frag
        };
        let max = self.slots[lane].attr.limits.get_max_zcopy.min(frag).max(1);
        let memh = r.guards[0].registration().clone();
        let f = Frags {
            put: false,
            local: laddr,
            remote: raddr,
            key: &rkey,
            memh: &memh,
            max,
            end: want,
        };
        let res = self.post_frags(rid, p, lane, &f, &mut off);
        if let Some(Req {
            kind:
                ReqKind::Recv(RecvState {
                    proto: RecvProto::Rndv(rv),
                    received,
                    ..
                }),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rv.posted = off;
            *received = off;
        }
        match res {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(e @ Error::EndpointFailure { .. }) => return Err(e),
            Err(e) => {
                // Could not read: steer the sender to stream instead (no byte lost).
                tracing::warn!(
                    "rendezvous read failed to start ({e}); asking the sender to stream"
                );
                self.restart_as_stream(rid);
                return Ok(true);
            }
        }
        if self.reqs[&rid].outstanding == 0 {
            self.gets_finished(rid);
        }
        Ok(true)
    }

    /// The reads of a rendezvous receive are complete: tell the sender; finish unless the
    /// sender still writes the tail (split).
    pub(crate) fn gets_finished(&mut self, rid: u64) {
        self.rndv_recv_step(rid, |rv, io| rv.reads_done(io));
    }

    /// A read-based receive could not proceed: drop its registration and ask the sender to
    /// stream the whole message through active messages.
    pub(crate) fn restart_as_stream(&mut self, rid: u64) {
        let Some(r) = self.reqs.get_mut(&rid) else {
            return;
        };
        r.guards.clear();
        if let ReqKind::Recv(rs) = &mut r.kind {
            rs.received = 0;
        }
        self.rndv_recv_step(rid, |rv, io| rv.restart_as_stream(io, rid));
    }

    /// Run one step of rendezvous receive `rid`'s state machine (taken out of the request
    /// while it runs, so that it acts on the worker through [`ProtoIo`]) and do what it says
    /// (what it queued goes out with the peer's queue).
    pub(crate) fn rndv_recv_step(
        &mut self,
        rid: u64,
        step: impl FnOnce(&mut RndvRecv, &mut Self) -> RecvNext,
    ) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        else {
            return;
        };
        let RecvProto::Rndv(mut rv) = std::mem::replace(&mut rs.proto, RecvProto::Tag) else {
            return;
        };
        let next = step(&mut rv, self);
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.proto = RecvProto::Rndv(rv);
            if next == RecvNext::Complete {
                rs.received = rs.total.min(rs.cap);
            }
        }
        match next {
            RecvNext::Wait => {}
            RecvNext::Complete => self.complete_recv(rid),
            RecvNext::Fail(e) => self.fail(rid, e),
        }
    }

    /// The lane a rendezvous receive from peer `p` reads on, and which of the sender's `keys` it
    /// uses: the plan's read lane (`planned`; none: the plan does not read) when the sender
    /// keyed its domain, else a lane of ours of a keyed domain that reads, connected now or by
    /// the next progress (the sender's plan moved after a demotion on its side).
    pub(crate) fn read_lane(
        &mut self,
        p: usize,
        planned: Option<usize>,
        keys: &[NamedKey],
    ) -> Option<(usize, usize)> {
        let planned = planned?;
        let named = |st: &Self, l: usize, md: &str| st.ctx.domain(st.slots[l].md).name() == md;
        if let Some(i) = keys.iter().position(|k| named(self, planned, &k.md)) {
            return Some((planned, i));
        }
        let found = keys.iter().enumerate().find_map(|(i, k)| {
            let reads =
                |l: &usize| named(self, *l, &k.md) && self.slots[*l].attr.has(IfaceCaps::GET_ZCOPY);
            let peer = &self.peers[p];
            peer.eps
                .keys()
                .copied()
                .find(reads)
                .or_else(|| peer.targets.iter().map(|(l, _)| *l).find(reads))
                .map(|l| (l, i))
        })?;
        self.want_lane(p, found.0);
        Some(found)
    }
}
