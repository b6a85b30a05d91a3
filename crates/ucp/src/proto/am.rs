//! User active messages: one copy-in message, or the multi-fragment form reassembled by the
//! receiver and handed to the handler.

use crate::worker::prelude::*;

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
                        reply_ep: EpId(p),
                    });
                }
                Err(e) => tracing::warn!("malformed active message dropped: {e}"),
            }
        }
    }
}

impl State {
    /// Send a user active message to `ep`, copied in before this returns.
    pub(crate) fn am_send(&mut self, ep: EpId, id: u16, header: &[u8], data: &[u8]) -> Result<()> {
        let st = self;
        st.check_peer(ep.0)?;
        st.refresh_plan(ep.0);
        if header.len() > u16::MAX as usize {
            return Err(Error::InvalidParam(
                "active message header longer than 64 KiB".into(),
            ));
        }
        let src = st.address.uuid;
        let am = st.peers[ep.0].am;
        let one = 12 + header.len() + data.len();
        if one <= st.slots[am].attr.limits.am_max_bcopy {
            st.send_msg(
                ep.0,
                &Msg::User {
                    src,
                    id,
                    header,
                    data,
                },
            );
            st.pump(ep.0);
            return Ok(());
        }
        // Large: the prefixed payload [header lv][data] goes as a multi-fragment message.
        let mut payload = Vec::with_capacity(2 + header.len() + data.len());
        rucx_uct::rkey::put_lv(&mut payload, header);
        payload.extend_from_slice(data);
        let msg_id = st.next_msg(ep.0);
        let total = payload.len();
        let mut off = 0;
        let bcopy = st.slots[am].attr.limits.am_max_bcopy;
        while off < total || off == 0 {
            let room = bcopy
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
            st.send_msg(ep.0, &m);
            off += n;
            if total == 0 {
                break;
            }
        }
        st.pump(ep.0);
        Ok(())
    }
}
