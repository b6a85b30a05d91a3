//! Receive requests: matching an arrived message, copying bytes into the buffer (never past
//! it), completing (or truncating), and the stream receives of a peer.

use crate::worker::prelude::*;

impl State {
    /// A receive matched a message (posted late, or arrived late).
    pub(crate) fn matched(&mut self, rid: u64, tag: Tag, u: Unexp) {
        match u {
            Unexp::Eager {
                src,
                msg_id,
                total,
                data,
                sync,
                lost,
            } => {
                self.recv_begin(rid, src, tag, total);
                if lost {
                    // Matched (a synchronous sender learns so), but there is nothing to
                    // deliver: the receive fails; the rest of the message is dropped as it comes.
                    self.finish(rid, Err(super::alloc::lost_message(total)));
                    if let Some(sreq) = sync {
                        self.send_ats(src, sreq);
                        self.pump(src);
                    }
                    return;
                }
                self.recv_data(rid, 0, &data);
                let complete = self.recv_complete(rid);
                if let Some(sreq) = sync {
                    // A synchronous send completes now that it is matched.
                    self.send_ats(src, sreq);
                    self.pump(src);
                }
                if let Some(m) = msg_id {
                    let key = (self.peers[src].remote.uuid, m);
                    if complete {
                        self.rx.remove(&key);
                    } else {
                        self.rx.insert(key, RxDest::Req(rid));
                    }
                }
            }
            Unexp::Rts {
                src,
                sreq,
                size,
                addr,
                smem,
                keys,
            } => {
                self.recv_begin(rid, src, tag, size);
                let smem_gpu = smem == wire::mem_code(MemoryType::Cuda)
                    || smem == wire::mem_code(MemoryType::CudaManaged);
                let rgpu = matches!(&self.reqs[&rid].kind, ReqKind::Recv(rs) if rs.mem.is_gpu());
                if smem_gpu || rgpu {
                    self.rndv_recv_gpu(rid, src, sreq, size, addr, smem_gpu, keys);
                } else {
                    self.rndv_recv(rid, src, sreq, size, addr, keys);
                }
            }
        }
    }

    pub(crate) fn recv_begin(&mut self, rid: u64, src: usize, tag: Tag, total: usize) {
        if let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        {
            rs.sender = Some(src);
            rs.tag = tag;
            rs.total = total;
        }
    }

    /// Copy arrived bytes into a receive buffer, never past its capacity.
    pub(crate) fn recv_data(&mut self, rid: u64, offset: usize, data: &[u8]) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            ..
        }) = self.reqs.get_mut(&rid)
        else {
            return;
        };
        if offset < rs.cap {
            let n = data.len().min(rs.cap - offset);
            if rs.mem.is_gpu() {
                rs.received += data.len();
                if let Err(e) = self.copy_to_gpu(rid, offset, &data[..n]) {
                    self.fail(rid, e);
                }
                return;
            }
            // SAFETY: the receive buffer was lent mutably to the scope, which keeps it alive
            // and unaliased until the request is finished; `offset + n <= cap`.
            let dst = unsafe { host_slice_mut(rs.addr + offset, n) };
            dst.copy_from_slice(&data[..n]);
        }
        rs.received += data.len();
    }

    /// Finish the receive if every byte arrived. Returns true when finished.
    pub(crate) fn recv_complete(&mut self, rid: u64) -> bool {
        let done = match self.reqs.get(&rid) {
            Some(Req {
                kind: ReqKind::Recv(rs),
                result: None,
                ..
            }) => rs.received >= rs.want(),
            _ => false,
        };
        if done {
            self.complete_recv(rid);
        }
        done
    }

    pub(crate) fn complete_recv(&mut self, rid: u64) {
        let Some(Req {
            kind: ReqKind::Recv(rs),
            result: None,
            ..
        }) = self.reqs.get(&rid)
        else {
            return;
        };
        let res = if rs.total > rs.cap {
            Err(Error::Truncated {
                incoming: rs.total,
                capacity: rs.cap,
                tag: Some(rs.tag),
            })
        } else {
            Ok(Completion {
                len: rs.total,
                tag: rs.tag,
                sender: rs.sender.map(|p| EpId::new(p, self.ep_base)),
            })
        };
        self.finish(rid, res);
    }

    /// Cancel a stream receive that is still waiting; the bytes it took so far go back to the
    /// front of the stream (nothing is lost). True when it was canceled.
    pub(crate) fn stream_cancel(&mut self, rid: u64) -> bool {
        let p = match self.reqs.get(&rid) {
            Some(Req {
                kind:
                    ReqKind::Recv(RecvState {
                        proto: RecvProto::Stream { .. },
                        sender: Some(p),
                        ..
                    }),
                result: None,
                ..
            }) => *p,
            _ => return false,
        };
        let (reqs, peer) = (&mut self.reqs, &mut self.peers[p]);
        let mut io = StreamReqs::new(reqs, EpId::new(p, self.ep_base));
        let canceled = peer.stream_rx.cancel(&mut io, rid);
        // The canceled receive, and those behind it that its bytes filled.
        let StreamReqs { ended, landed, .. } = io;
        self.note_stream_ends(&ended);
        if !landed.is_empty() {
            self.land_gpu_streams(p, landed);
        }
        canceled
    }
}
