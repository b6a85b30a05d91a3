//! Sends that end in place without a request: for callers that hand over a bare pointer and
//! need no handle once the message left (the C ABI's `ucp_tag_send_*`, which otherwise pay an
//! owned request, its allocation and its locks, for every small message).

use crate::worker::prelude::*;

impl Worker {
    /// Send the host bytes `data` with `tag` to `ep` now if the eager-short protocol of the
    /// endpoint's plan takes a message of this size and its lane takes it at once: `Ok(true)`
    /// when it was sent (complete; `data` is free again), `Ok(false)` when nothing was sent
    /// (the size or the plan wants another protocol, messages wait before it, or the
    /// transport pushed back): post it as a request then, which keeps the endpoint's order.
    /// An error is the endpoint's (failed, closing) or the transport's.
    #[inline]
    pub fn tag_send_inline(&self, ep: EpId, data: &[u8], tag: Tag) -> Result<bool> {
        let mut st = self.st.borrow_mut();
        let p = st.check_ep(ep)?;
        self.ensure_plan(&mut st, p);
        let plan = &st.peers[p].plan;
        let short = match plan.short_tag_host {
            Some((from, to)) => (from..=to).contains(&data.len()),
            None => {
                let host = MemKey::new(MemoryType::Host, None);
                plan.select(Op::Tag, host, data.len()) == Some(Proto::EagerShort)
            }
        };
        if !short {
            return Ok(false);
        }
        if !st.try_eager_short(p, data.as_ptr() as usize, data.len(), tag)? {
            return Ok(false);
        }
        st.inline_short += 1;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn small_sends_leave_at_once_and_large_ones_are_left_to_a_request() {
        let w = super::super::tests::self_worker();
        let ep = w.connect(&w.address()).unwrap();
        // Wire-up first: until the lane is connected, nothing is sent in place.
        let mut sent = false;
        for _ in 0..100_000 {
            if w.tag_send_inline(ep, b"inline", 5).unwrap() {
                sent = true;
                break;
            }
            w.progress();
        }
        assert!(sent, "the lane never took the message");
        // Counted apart on this path, reported under the protocol's name.
        let sent_short = w.counters().get("eager short").copied().unwrap_or(0);
        assert_eq!(sent_short, 1, "{:?}", w.counters());
        let big = vec![1u8; 1 << 20];
        assert!(
            !w.tag_send_inline(ep, &big, 6).unwrap(),
            "1 MiB is no eager-short message"
        );
        let mut buf = [0u8; 16];
        let c = w.tag_recv_wait(&mut buf, 5, u64::MAX).unwrap();
        assert_eq!((c.len, c.tag, &buf[..6]), (6, 5, &b"inline"[..]));
    }

    /// Every size the plan gives eager short leaves in place, not only the first 248 bytes
    /// (self's `am_short` takes 8 KiB: a 4 KiB message is eager short).
    #[test]
    fn a_4k_eager_short_message_leaves_in_place() {
        let w = super::super::tests::self_worker();
        let ep = w.connect(&w.address()).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
        let mut sent = false;
        for _ in 0..100_000 {
            if w.tag_send_inline(ep, &data, 7).unwrap() {
                sent = true;
                break;
            }
            w.progress();
        }
        assert!(sent, "a 4 KiB eager-short message was left to a request");
        let mut buf = vec![0u8; 4096];
        let c = w.tag_recv_wait(&mut buf, 7, u64::MAX).unwrap();
        assert_eq!((c.len, c.tag), (4096, 7));
        assert_eq!(buf, data);
    }
}
