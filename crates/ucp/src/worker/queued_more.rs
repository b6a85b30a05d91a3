//! Queued stream and active-message requests (the forms the C ABI posts, as
//! [`Worker::tag_send_queued`] for tags): the caller's memory by address, the end queued with
//! the caller's token ([`Worker::take_completed`]) unless it ended while posted.

use rucx_ucs::RawBuf;

use super::connecting::Held;
use super::owned::Queued;
use super::{EpId, Posted, Worker};
use crate::{AmPayload, RecvBuf, SendBuf};

impl Worker {
    /// Append the memory of `buf` to the byte stream to `ep` (see
    /// [`Scope::stream_send`](crate::Scope::stream_send)), its end queued with `token`. The
    /// memory is the request's, under [`RawBuf::new`]'s contract, until its end was reported.
    pub fn stream_send_queued(&self, ep: EpId, buf: RawBuf, token: u64) -> Queued {
        if let Some(q) = self.hold_if_connecting(ep, token, || Held::Stream { buf: buf.clone() }) {
            return q;
        }
        let posted = self.post_stream_send(ep, SendBuf::of_raw(&buf));
        self.adopt_queued(posted, token)
    }

    /// Receive from the byte stream of `ep` into the memory of `buf`, its end queued with
    /// `token`: exactly `buf.len()` bytes (UCX's `UCP_STREAM_RECV_FLAG_WAITALL`), or, with
    /// `partial`, as soon as at least one byte landed in host memory (the completion's `len`
    /// says how many; a receive into GPU memory waits for all). Stream receives of one
    /// endpoint are filled in the order they were posted.
    pub fn stream_recv_queued(&self, ep: EpId, buf: RawBuf, partial: bool, token: u64) -> Queued {
        let posted = self
            .post_stream_recv_with(ep, RecvBuf::of_raw(&buf), partial)
            .map(Posted::Pending);
        self.adopt_queued(posted, token)
    }

    /// Take the bytes of the stream from `ep` that arrived and no receive took, in order,
    /// without posting a receive (UCX's `ucp_stream_recv_data_nb`); `None` when there are none.
    /// Bytes that arrived before the endpoint ended stay receivable this way too.
    pub fn stream_take(&self, ep: EpId) -> rucx_ucs::Result<Option<Vec<u8>>> {
        let mut st = self.st.borrow_mut();
        let p = st.ep_index(ep)?;
        Ok(st.peers[p].stream_rx.take_buffered())
    }

    /// The endpoints whose streams hold bytes no receive took yet (UCX's
    /// `ucp_stream_worker_poll`), in endpoint order.
    pub fn streams_ready(&self) -> Vec<EpId> {
        let st = self.st.borrow();
        (0..st.peers.len())
            .filter(|&p| st.peers[p].stream_rx.has_buffered())
            .map(|p| st.ep_id(p))
            .collect()
    }

    /// Send active message `id` with `header` and the memory of `buf` to `ep` (see
    /// [`Scope::am_send`](crate::Scope::am_send)), its end queued with `token`.
    pub fn am_send_queued(
        &self,
        ep: EpId,
        id: u16,
        header: &[u8],
        buf: RawBuf,
        token: u64,
    ) -> Queued {
        if let Some(q) = self.hold_if_connecting(ep, token, || Held::Am {
            id,
            header: header.to_vec(),
            buf: buf.clone(),
        }) {
            return q;
        }
        let posted = self.post_am(ep, id, header, SendBuf::of_raw(&buf));
        self.adopt_queued(posted, token)
    }

    /// Flush endpoint `ep` (see [`Scope::flush`](crate::Scope::flush)), its end queued with
    /// `token`: it ends once what was posted on `ep` before it is out.
    pub fn flush_queued(&self, ep: EpId, token: u64) -> Queued {
        if let Some(q) = self.hold_if_connecting(ep, token, || Held::Flush) {
            return q;
        }
        let posted = self.post_flush(ep).map(Posted::Pending);
        self.adopt_queued(posted, token)
    }

    /// Fetch an active message's payload into the memory of `buf` (see
    /// [`Scope::am_recv_data`](crate::Scope::am_recv_data)), its end queued with `token`.
    pub fn am_recv_queued(&self, payload: AmPayload, buf: RawBuf, token: u64) -> Queued {
        let posted = self.post_am_recv(payload, RecvBuf::of_raw(&buf));
        self.adopt_queued(posted, token)
    }
}
