//! Rendezvous by write (`put_zcopy`): the sender writes the receiver's registered buffer,
//! flushes, and sends the finish message.

use crate::worker::prelude::*;

impl State {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn stream_put(
        &mut self,
        id: u64,
        p: usize,
        lane: usize,
        addr: usize,
        len: usize,
        raddr: u64,
        rkey: &RemoteKey,
    ) -> Result<bool> {
        let max = self.slots[lane]
            .attr
            .limits
            .put_max_zcopy
            .min(self.frag)
            .max(1);
        // The registration of the lane's domain (a send may hold another domain's as well: the
        // one made for the receiver's reads when it offered them).
        let name = self.ctx.domain(self.slots[lane].md).name();
        let guards = &self.reqs[&id].guards;
        let memh = guards
            .iter()
            .find(|g| g.registration().domain() == name)
            .unwrap_or(&guards[0])
            .registration()
            .clone();
        let mut off = match &self.reqs[&id].kind {
            ReqKind::Send(s) => s.posted,
            _ => 0,
        };
        let f = Frags {
            put: true,
            local: addr,
            remote: raddr,
            key: rkey,
            memh: &memh,
            max,
            end: len,
        };
        let res = self.post_frags(id, p, lane, &f, &mut off);
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.posted = off;
        }
        if !res? {
            return Ok(false);
        }
        // Make the writes visible before telling the receiver.
        if !self.post(id, p, lane, |ep, t| ep.flush(t))? {
            return Ok(false);
        }
        if let Some(Req {
            kind: ReqKind::Send(s),
            ..
        }) = self.reqs.get_mut(&id)
        {
            s.wait = SendWait::Completions;
        }
        if self.reqs[&id].outstanding == 0 {
            self.put_done(id);
        }
        Ok(true)
    }

    /// All writes of a put rendezvous are complete: tell the receiver, finish the send.
    pub(crate) fn put_done(&mut self, id: u64) {
        let (p, len, tag, rreq) = match &self.reqs[&id].kind {
            ReqKind::Send(s) => (s.peer, s.len, s.tag, s.rndv.rreq.unwrap_or(0)),
            _ => return,
        };
        self.ctrl(
            p,
            &Msg::Fin {
                src: self.address.uuid,
                rreq,
            },
        );
        if !self.split_step(id) {
            return;
        }
        self.finish(
            id,
            Ok(Completion {
                len,
                tag,
                sender: None,
            }),
        );
    }
}
