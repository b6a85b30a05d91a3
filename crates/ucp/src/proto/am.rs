//! User active messages: one copy-in message, or the multi-fragment form reassembled by the
//! receiver and handed to the handler; and the rendezvous form, whose payload (host or GPU
//! memory) stays with the sender until the handler fetches it into a buffer it chooses.
//!
//! The rendezvous form is the tag rendezvous with another request to send ([`Msg::AmRts`],
//! carrying the user id and header): the receiver hands the handler a descriptor
//! ([`AmRemoteData`]); [`Scope::am_recv_data`](crate::Scope::am_recv_data) makes a receive
//! request of it that runs the tag rendezvous's receive (host reads, GPU reads through
//! cuda_ipc, the staged pipeline, demotion on a registration failure); a descriptor dropped
//! unfetched releases the sender, whose request ends with `PeerAborted`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::proto::gpu::bounce::BounceSendIo;
use crate::proto::memcopy::copy_io::CopyIo;
use crate::proto::memcopy::state::{gpu_to_host, host_to_gpu};
use crate::worker::prelude::*;

/// A payload a handler dropped without fetching it.
#[derive(Debug)]
pub(crate) struct Release {
    worker: u64,
    peer: u64,
    sreq: u64,
    id: u16,
    len: usize,
}

/// Payloads dropped unfetched, shared by a worker and the descriptors it handed out (which may
/// be dropped on any thread); released by the worker's next progress.
#[derive(Debug, Default)]
pub(crate) struct AmReleases {
    pending: AtomicBool,
    list: Mutex<Vec<Release>>,
}

impl AmReleases {
    fn push(&self, r: Release) {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).push(r);
        self.pending.store(true, Ordering::Release);
    }

    /// Whether some wait to be released (one load: checked on every progress).
    #[inline(always)]
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    fn take(&self) -> Vec<Release> {
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut *self.list.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The payload of an active message that stayed with its sender (a rendezvous): its length
/// and memory type, fetched with [`Scope::am_recv_data`](crate::Scope::am_recv_data) into a
/// host or GPU buffer of the receiver's choice (UCX's `ucp_am_recv_data_nbx`).
///
/// The sender's request completes once the payload was fetched. Dropped without being
/// fetched, the descriptor releases the sender at the receiving worker's next progress: its
/// request then ends with [`Error::PeerAborted`] saying that the handler dropped the payload.
/// It is `Send`: a handler may pass it to another thread, which fetches it through the same
/// worker.
pub struct AmRemoteData {
    len: usize,
    smem: u8,
    sender: EpId,
    id: u16,
    /// The receiving worker, and the sending one.
    worker: u64,
    peer: u64,
    sreq: u64,
    addr: u64,
    keys: Vec<NamedKey>,
    /// Where a drop releases the sender; `None` once fetched.
    releases: Option<Arc<AmReleases>>,
}

impl fmt::Debug for AmRemoteData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmRemoteData")
            .field("len", &self.len)
            .field("mem_type", &self.mem_type())
            .field("sender", &self.sender)
            .field("id", &self.id)
            .finish()
    }
}

impl AmRemoteData {
    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Memory type of the sender's buffer.
    pub fn mem_type(&self) -> MemoryType {
        wire::mem_type_of(self.smem)
    }

    /// The endpoint the message came from.
    pub fn sender(&self) -> EpId {
        self.sender
    }
}

impl Drop for AmRemoteData {
    fn drop(&mut self) {
        if let Some(r) = self.releases.take() {
            r.push(Release {
                worker: self.worker,
                peer: self.peer,
                sreq: self.sreq,
                id: self.id,
                len: self.len,
            });
        }
    }
}

/// An active message's payload, wherever it is (see [`AmMessage::take_payload`]).
#[derive(Debug)]
pub enum AmPayload {
    /// It came with the message (copied in): the bytes.
    Here(Vec<u8>),
    /// It stayed with the sender (rendezvous): fetch it.
    Remote(AmRemoteData),
}

impl AmPayload {
    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        match self {
            AmPayload::Here(v) => v.len(),
            AmPayload::Remote(r) => r.len(),
        }
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl AmMessage {
    /// Payload length in bytes, wherever the payload is.
    pub fn len(&self) -> usize {
        self.remote.as_ref().map_or(self.data.len(), |r| r.len())
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the payload stayed with the sender (fetch it, or drop it to release the
    /// sender).
    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Take the payload out of the message, to fetch it into a buffer of the handler's choice
    /// with [`Scope::am_recv_data`](crate::Scope::am_recv_data) (which takes either kind).
    pub fn take_payload(&mut self) -> AmPayload {
        match self.remote.take() {
            Some(r) => AmPayload::Remote(r),
            None => AmPayload::Here(std::mem::take(&mut self.data)),
        }
    }
}

/// The receive request an abort of an unfetched payload names: none was ever made (the wire
/// wants a non-zero id from the receiving side; the sender does not look at it).
const NO_RECV: u64 = u64::MAX;

/// Largest user header of an active message sent by rendezvous: its request to send is one
/// control message, which also carries the sender's keys.
const RTS_ROOM: usize = 1024;

impl State {
    /// A request to send of a user active message arrived: hand the handler its descriptor.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_am_rts(
        &mut self,
        p: usize,
        sreq: u64,
        size: usize,
        addr: u64,
        smem: u8,
        id: u16,
        header: &[u8],
        keys: Vec<NamedKey>,
    ) {
        let remote = AmRemoteData {
            len: size,
            smem,
            sender: self.ep_id(p),
            id,
            worker: self.address.uuid,
            peer: self.peers[p].remote.uuid,
            sreq,
            addr,
            keys,
            releases: Some(self.am_releases.clone()),
        };
        self.count("active message rendezvous received");
        self.am_inbox.push(AmMessage {
            id,
            header: header.to_vec(),
            data: Vec::new(),
            reply_ep: self.ep_id(p),
            remote: Some(remote),
        });
    }

    /// Release the senders of payloads dropped unfetched: each send ends with `PeerAborted`.
    pub(crate) fn release_dropped_am(&mut self) {
        for r in self.am_releases.take() {
            r.release(self);
        }
    }
}

/// What a payload descriptor's fetch or release asks of the worker.
pub(crate) trait AmIo {
    /// This worker's id.
    fn uuid(&self) -> u64;

    /// Our endpoint to the worker of id `uuid` (`None`: no longer one).
    fn peer_of(&self, uuid: u64) -> Option<usize>;

    /// The memory type of buffer `addr..addr + len` (named by the caller when it knows).
    fn detect(&self, addr: usize, len: usize) -> Result<(MemoryType, Option<u32>)>;

    /// End peer `p`'s send `sreq` (a rendezvous no receive was made for) with `PeerAborted`
    /// for `reason` (nothing to a failed peer).
    fn abort_send(&mut self, p: usize, sreq: u64, reason: &str);

    /// A receive into `buf` that takes rendezvous `rts` of user active message `id`: its
    /// request (the tag rendezvous's receive runs it).
    fn fetch_into(&mut self, buf: MemRegion, id: u16, rts: Unexp) -> u64;

    /// Count one run of `what`.
    fn count(&mut self, what: &'static str);
}

impl Release {
    /// The handler dropped this payload unfetched: its sender's request ends with
    /// `PeerAborted` saying so (a release for another worker, or a sender no longer an
    /// endpoint, is dropped).
    pub(crate) fn release(self, io: &mut impl AmIo) {
        if self.worker != io.uuid() {
            return;
        }
        let Some(p) = io.peer_of(self.peer) else {
            return;
        };
        let reason = format!(
            "the receiver's handler of active message {} dropped its {}-byte payload without \
             fetching it",
            self.id, self.len
        );
        io.count("active message payload dropped unfetched");
        io.abort_send(p, self.sreq, &reason);
    }
}

impl AmRemoteData {
    /// Fetch the payload into `buf` (`addr`, capacity, memory type when the caller named it):
    /// the receive request, which completes with the payload's length (`Truncated` when the
    /// buffer is smaller, its bytes filled). Refused, and left to release its sender when
    /// dropped: a descriptor of another worker, or of a sender no longer an endpoint; refused:
    /// a descriptor already fetched. From here on the rendezvous ends the send either way: a
    /// buffer whose memory type cannot be told aborts it.
    pub(crate) fn fetch(
        &mut self,
        io: &mut impl AmIo,
        (addr, cap, mem): (usize, usize, Option<(MemoryType, Option<u32>)>),
    ) -> Result<u64> {
        if self.releases.is_none() {
            return Err(Error::InvalidParam(format!(
                "active message {}: its payload was already fetched",
                self.id
            )));
        }
        if self.worker != io.uuid() {
            // Not ours: dropping it releases its sender through its own worker.
            return Err(Error::InvalidParam(format!(
                "active message {}: its payload descriptor belongs to another worker",
                self.id
            )));
        }
        let Some(p) = io.peer_of(self.peer) else {
            return Err(Error::InvalidParam(format!(
                "active message {}: its sender is no longer an endpoint of this worker",
                self.id
            )));
        };
        // Fetched from here on: the rendezvous ends the send either way.
        self.releases = None;
        let (mem, dev) = match mem {
            Some(m) => m,
            None => match io.detect(addr, cap) {
                Ok(m) => m,
                Err(e) => {
                    let reason = format!("the receiver's buffer was refused: {e}");
                    io.abort_send(p, self.sreq, &reason);
                    return Err(e);
                }
            },
        };
        io.count("active message payload fetched");
        let rts = Unexp::Rts {
            src: p,
            sreq: self.sreq,
            size: self.len,
            addr: self.addr,
            smem: self.smem,
            keys: std::mem::take(&mut self.keys),
        };
        let buf = MemRegion {
            addr,
            len: cap,
            mem_type: mem,
            device: dev,
        };
        Ok(io.fetch_into(buf, self.id, rts))
    }
}

/// What became of a GPU payload the plan copies in.
pub(crate) enum CopiedOut {
    /// Copied to host memory: these bytes go copied in.
    Host(Vec<u8>),
    /// Not copied (no staging fragment, the copy lane's registration or a copy failed): the
    /// table's rendezvous protocol carries it.
    Instead(Proto),
}

/// Copy GPU payload `from` of active message `id` to peer `p` out to host memory
/// ([`gpu_to_host`]); when that fails, the rendezvous row of the active-message table carries
/// it, or, when the table has none, the request ends with the copy's error.
pub(crate) fn gpu_copy_out(
    io: &mut impl BounceSendIo,
    p: usize,
    id: u16,
    from: MemRegion,
) -> Result<CopiedOut> {
    match gpu_to_host(io, from) {
        Ok(host) => Ok(CopiedOut::Host(host)),
        Err(e) => match io.rndv_row(p, Op::Am, MemKey::new(from.mem_type, from.device)) {
            Some(r) => {
                tracing::debug!("active message {id}: copy out of GPU failed ({e}); rendezvous");
                Ok(CopiedOut::Instead(r))
            }
            None => Err(e),
        },
    }
}

/// Copy an inline payload `data` into buffer `to` (into GPU memory by the copy lane): the
/// payload's length; longer than the buffer, the bytes that fit are written and it ends with
/// `Truncated`.
pub(crate) fn copy_here(io: &mut impl CopyIo, data: &[u8], to: MemRegion) -> Result<usize> {
    let n = data.len().min(to.len);
    if to.mem_type.is_gpu() {
        host_to_gpu(io, MemRegion { len: n, ..to }, &data[..n])?;
    } else {
        io.write_host(to.addr, &data[..n]);
    }
    if data.len() > to.len {
        return Err(Error::Truncated {
            incoming: data.len(),
            capacity: to.len,
            tag: None,
        });
    }
    Ok(data.len())
}

impl AmIo for State {
    fn uuid(&self) -> u64 {
        self.address.uuid
    }

    fn peer_of(&self, uuid: u64) -> Option<usize> {
        self.by_uuid.get(&uuid).copied()
    }

    fn detect(&self, addr: usize, len: usize) -> Result<(MemoryType, Option<u32>)> {
        self.ctx.detect(addr, len)
    }

    fn abort_send(&mut self, p: usize, sreq: u64, reason: &str) {
        self.send_abort(p, sreq, NO_RECV, false, reason);
    }

    fn fetch_into(&mut self, buf: MemRegion, id: u16, rts: Unexp) -> u64 {
        if buf.mem_type.is_gpu() {
            self.note_gpu_key(MemKey::new(buf.mem_type, buf.device));
        }
        let rid = self.new_req(ReqKind::Recv(RecvState::tag(
            buf.addr,
            buf.len,
            0,
            buf.mem_type,
            buf.device,
        )));
        self.matched(rid, u64::from(id), rts);
        rid
    }

    fn count(&mut self, what: &'static str) {
        State::count(self, what);
    }
}

impl Worker {
    /// Post an active message of `buf` (host or GPU memory) to `ep`: copied in (a GPU payload
    /// copied out through the copy lane first) where the plan's active-message table says so,
    /// done on return; else a rendezvous whose request completes once the receiver fetched the
    /// payload.
    pub(crate) fn post_am(
        &self,
        ep: EpId,
        id: u16,
        header: &[u8],
        buf: SendBuf<'_>,
    ) -> Result<Posted> {
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        if header.len() > u16::MAX as usize {
            return Err(Error::InvalidParam(format!(
                "active message {id}: header of {} bytes is longer than 64 KiB",
                header.len()
            )));
        }
        let (addr, len) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(addr, len)?,
        };
        let key = MemKey::new(mem, dev);
        if mem.is_gpu() {
            st.note_gpu_key(key);
        }
        self.ensure_plan(&mut st, p);
        let table = st.peers[p].plan.table(Op::Am, key);
        let mut proto = match table.lookup(len) {
            Some(r) => r.proto,
            None => return Err(table.refusal(&st.peers[p].remote.describe())),
        };
        let done = Completion {
            len,
            tag: u64::from(id),
            sender: None,
        };
        if proto == Proto::AmCopy {
            if !mem.is_gpu() {
                // SAFETY: `buf` is borrowed for the request's scope, which outlives this call.
                st.am_send(ep, id, header, unsafe { host_slice(addr, len) })?;
                return Ok(Posted::Done(done));
            }
            let from = MemRegion {
                addr,
                len,
                mem_type: mem,
                device: dev,
            };
            match gpu_copy_out(&mut self.copy_lane(&mut st), p, id, from)? {
                CopiedOut::Host(host) => {
                    st.am_send(ep, id, header, &host)?;
                    return Ok(Posted::Done(done));
                }
                CopiedOut::Instead(r) => proto = r,
            }
        }
        let am = st.peers[p].am;
        let room = st.slots[am].attr.limits.am_max_bcopy;
        if header.len() + RTS_ROOM > room {
            return Err(Error::InvalidParam(format!(
                "active message {id}: a header of {} bytes does not fit the rendezvous request to \
                 send on {} (at most {} bytes; send a shorter header, or put it in the payload)",
                header.len(),
                st.slots[am].attr.tl_name,
                room.saturating_sub(RTS_ROOM)
            )));
        }
        let rid = st.new_req(ReqKind::Send(SendState::new(
            p,
            addr,
            len,
            u64::from(id),
            proto,
            Op::Am,
            mem,
            dev,
        )));
        st.am_rts.insert(rid, (id, header.to_vec()));
        st.count("active message rendezvous");
        st.start_send(rid);
        Ok(Posted::Pending(rid))
    }

    /// Fetch an active message's payload into `buf`: copied at once when it came with the
    /// message, else the receive side of its rendezvous ([`AmRemoteData::fetch`]).
    pub(crate) fn post_am_recv(&self, payload: AmPayload, buf: RecvBuf<'_>) -> Result<Posted> {
        let mut r = match payload {
            AmPayload::Here(data) => return self.am_copy_here(&data, buf),
            AmPayload::Remote(r) => r,
        };
        let mut st = self.st.borrow_mut();
        let rid = r.fetch(&mut *st, (buf.addr, buf.len, buf.mem))?;
        Ok(Posted::Pending(rid))
    }

    /// An inline payload into `buf` ([`copy_here`]).
    fn am_copy_here(&self, data: &[u8], buf: RecvBuf<'_>) -> Result<Posted> {
        let mut st = self.st.borrow_mut();
        let (addr, cap) = (buf.addr, buf.len);
        let (mem, dev) = match buf.mem {
            Some(m) => m,
            None => st.ctx.detect(addr, cap)?,
        };
        let to = MemRegion {
            addr,
            len: cap,
            mem_type: mem,
            device: dev,
        };
        let len = copy_here(&mut *st, data, to)?;
        Ok(Posted::Done(Completion::done(len)))
    }
}

impl State {
    pub(crate) fn maybe_finish_user_am(&mut self, src: u64, msg_id: u64, p: usize) {
        let key = (src, msg_id);
        let done = matches!(self.rx.get(&key), Some(RxDest::UserAm { total, data, .. }) if data.len() >= *total);
        if done && let Some(RxDest::UserAm { id, data, .. }) = self.rx.remove(&key) {
            let mut r = rucx_uct::rkey::Reader::new(&data, "active message");
            match r.lv() {
                Ok(h) => {
                    let header = h.to_vec();
                    // The body moves down in place: no second copy of a large message.
                    let mut data = data;
                    data.drain(..2 + header.len());
                    self.am_inbox.push(AmMessage {
                        id,
                        header,
                        data,
                        reply_ep: self.ep_id(p),
                        remote: None,
                    });
                }
                Err(e) => tracing::warn!("malformed active message dropped: {e}"),
            }
        }
    }
}

/// Queue user active message `id` (`header`, `data`) to peer `p`, copied in: one message when
/// it fits the active-message lane's `max_bcopy`, else the multi-fragment eager form (the
/// payload prefixed with the header, cut to what each fragment's header leaves room for),
/// reassembled by the receiver. A header longer than 64 KiB is refused.
pub(crate) fn send_copied(
    io: &mut impl ProtoIo,
    p: usize,
    id: u16,
    header: &[u8],
    data: &[u8],
    max_bcopy: usize,
) -> Result<()> {
    if header.len() > u16::MAX as usize {
        return Err(Error::InvalidParam(
            "active message header longer than 64 KiB".into(),
        ));
    }
    let src = io.uuid();
    if 12 + header.len() + data.len() <= max_bcopy {
        io.ctrl(
            p,
            &Msg::User {
                src,
                id,
                header,
                data,
            },
        );
        return Ok(());
    }
    if max_bcopy <= proto::FIRST_OVERHEAD.max(proto::MIDDLE_OVERHEAD) {
        return Err(Error::Internal(format!(
            "am_bcopy of {max_bcopy} bytes leaves no room for an active message's fragments"
        )));
    }
    // Large: the prefixed payload [header lv][data] goes as a multi-fragment message.
    let mut payload = Vec::with_capacity(2 + header.len() + data.len());
    rucx_uct::rkey::put_lv(&mut payload, header);
    payload.extend_from_slice(data);
    let msg_id = io.next_msg(p);
    let total = payload.len();
    let mut off = 0;
    loop {
        let room = max_bcopy
            - if off == 0 {
                proto::FIRST_OVERHEAD
            } else {
                proto::MIDDLE_OVERHEAD
            };
        let n = room.min(total - off);
        let data = &payload[off..off + n];
        let m = if off == 0 {
            Msg::EagerFirst {
                src,
                kind: MsgKind::Am,
                tag: u64::from(id),
                msg_id,
                total: total as u64,
                data,
            }
        } else {
            Msg::EagerMiddle {
                src,
                msg_id,
                offset: off as u64,
                data,
            }
        };
        io.ctrl(p, &m);
        off += n;
        if off >= total {
            return Ok(());
        }
    }
}

impl State {
    /// Send a user active message to `ep`, copied in before this returns.
    pub(crate) fn am_send(&mut self, ep: EpId, id: u16, header: &[u8], data: &[u8]) -> Result<()> {
        let p = self.check_ep(ep)?;
        self.refresh_plan(p);
        let am = self.peers[p].am;
        let max_bcopy = self.slots[am].attr.limits.am_max_bcopy;
        send_copied(self, p, id, header, data, max_bcopy)?;
        self.pump(p);
        Ok(())
    }
}

#[cfg(test)]
mod desc_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::fake_io::{FAKE_UUID, FakeIo};

    const PEER: usize = 3;

    /// Every message queued to the peer, reassembled: one copied-in message's (id, header,
    /// data), or a multi-fragment one's; each checked to fit `max_bcopy`.
    fn received(io: &FakeIo, max_bcopy: usize) -> (u16, Vec<u8>, Vec<u8>, usize) {
        for (_, _, bytes) in &io.ctrls {
            assert!(
                bytes.len() <= max_bcopy,
                "{} bytes > {max_bcopy}",
                bytes.len()
            );
        }
        let msgs = io.ctrl_msgs(PEER);
        match msgs.as_slice() {
            [
                Msg::User {
                    src,
                    id,
                    header,
                    data,
                },
            ] => {
                assert_eq!(*src, FAKE_UUID);
                (*id, header.to_vec(), data.to_vec(), 1)
            }
            [first, rest @ ..] => {
                let Msg::EagerFirst {
                    src,
                    kind: MsgKind::Am,
                    tag,
                    msg_id,
                    total,
                    data,
                } = first
                else {
                    panic!("{first:?}")
                };
                assert_eq!(*src, FAKE_UUID);
                let mut payload = data.to_vec();
                for m in rest {
                    let Msg::EagerMiddle {
                        msg_id: mid,
                        offset,
                        data,
                        ..
                    } = m
                    else {
                        panic!("{m:?}")
                    };
                    assert_eq!(mid, msg_id);
                    assert_eq!(*offset as usize, payload.len(), "in order, no gap");
                    assert!(!data.is_empty());
                    payload.extend_from_slice(data);
                }
                assert_eq!(payload.len() as u64, *total);
                let mut r = rucx_uct::rkey::Reader::new(&payload, "active message");
                let header = r.lv().expect("the header's length").to_vec();
                let data = payload[2 + header.len()..].to_vec();
                (*tag as u16, header, data, msgs.len())
            }
            [] => panic!("nothing sent"),
        }
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// A message that fits the lane goes as one; one byte more goes in fragments, each within
    /// the lane's size, and arrives whole.
    #[test]
    fn one_message_when_it_fits_else_fragments() {
        let (h, max) = (bytes(20, 1), 256);
        let fits = bytes(max - 12 - h.len(), 2);
        let mut io = FakeIo::default();
        send_copied(&mut io, PEER, 7, &h, &fits, max).unwrap();
        assert_eq!(received(&io, max), (7, h.clone(), fits, 1));

        let over = bytes(max - 12 - h.len() + 1, 3);
        let mut io = FakeIo::default();
        send_copied(&mut io, PEER, 7, &h, &over, max).unwrap();
        let (id, hh, d, n) = received(&io, max);
        assert_eq!((id, hh, d), (7, h, over));
        assert!(n >= 2);
    }

    /// A header longer than 64 KiB is refused, and a lane too small for any fragment is an
    /// error rather than a loop; nothing is queued.
    #[test]
    fn refusals_queue_nothing() {
        let mut io = FakeIo::default();
        let big = vec![0u8; 70_000];
        assert!(matches!(
            send_copied(&mut io, PEER, 1, &big, b"x", 1 << 20),
            Err(Error::InvalidParam(_))
        ));
        assert!(matches!(
            send_copied(&mut io, PEER, 1, b"h", &[0u8; 100], proto::FIRST_OVERHEAD),
            Err(Error::Internal(_))
        ));
        assert!(io.ctrls.is_empty());
    }

    proptest::proptest! {
        /// Whatever the header, payload and lane size: the message arrives whole, every piece
        /// fits the lane, and a multi-fragment one has its own id.
        #[test]
        fn copied_in_messages_arrive_whole(
            hlen in 0usize..600,
            dlen in 0usize..5000,
            max in (proto::FIRST_OVERHEAD + 1)..2048,
            id in proptest::num::u16::ANY,
        ) {
            let (h, d) = (bytes(hlen, 5), bytes(dlen, 9));
            let mut io = FakeIo::default();
            send_copied(&mut io, PEER, id, &h, &d, max).unwrap();
            let (gid, gh, gd, n) = received(&io, max);
            proptest::prop_assert_eq!((gid, gh, gd), (id, h, d));
            proptest::prop_assert_eq!(n == 1, 12 + hlen + dlen <= max);
            proptest::prop_assert_eq!(io.msgs, u64::from(n > 1));
        }
    }
}
