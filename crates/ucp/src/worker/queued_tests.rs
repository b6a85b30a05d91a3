//! Tests of queued requests (`owned.rs`, `direct.rs`): each end reported once with its token,
//! only the requests that ended queued, a receive of a message already here, and the
//! worker's drop.

use std::time::Duration;

use rucx_ucs::RawBuf;

use super::owned::{Queued, QueuedReq};
use super::prelude::*;
use super::tests::self_worker;
use crate::TAG_MASK_FULL;

/// A `RawBuf` over a vector's bytes (the vector outlives the request in these tests).
fn raw(v: &mut [u8]) -> RawBuf {
    // SAFETY: the tests keep the vector alive and untouched until the request's end was
    // reported (or the worker dropped).
    unsafe { RawBuf::new(v.as_mut_ptr() as usize, v.len(), None) }
}

/// Progress until `want` queued ends were taken (at most ten seconds of tries).
fn take_ends(w: &Worker, want: usize) -> Vec<(u64, Result<Completion>)> {
    let mut got = Vec::new();
    let t = std::time::Instant::now();
    while got.len() < want && t.elapsed() < Duration::from_secs(10) {
        w.progress();
        w.take_completed(&mut got);
    }
    got
}

#[test]
fn queued_sends_and_receives_report_each_token_once() {
    let w = self_worker();
    let ep = w.connect(&w.address()).unwrap();
    let sizes = [0usize, 8, 300, 9000, 200_000];
    let mut rbufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xEE; n + 2]).collect();
    let mut sbufs: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| (0..n).map(|i| (i * 13 + n) as u8).collect())
        .collect();
    let mut ended = Vec::new();
    for (k, b) in rbufs.iter_mut().enumerate() {
        match w.tag_recv_queued(raw(b), k as u64, TAG_MASK_FULL, 100 + k as u64) {
            Queued::Pending(_) => {}
            Queued::Ended(r) => panic!("receive {k} ended with nothing sent: {r:?}"),
        }
    }
    for (k, b) in sbufs.iter_mut().enumerate() {
        match w.tag_send_queued(ep, raw(b), k as u64, false, 200 + k as u64) {
            Queued::Pending(_) => {}
            Queued::Ended(r) => ended.push((200 + k as u64, r)),
        }
    }
    let left = 2 * sizes.len() - ended.len();
    ended.extend(take_ends(&w, left));
    assert_eq!(
        ended.len(),
        2 * sizes.len(),
        "every request ended: {ended:?}"
    );
    ended.sort_by_key(|(t, _)| *t);
    for (k, &n) in sizes.iter().enumerate() {
        let (t, r) = &ended[k];
        assert_eq!(*t, 100 + k as u64, "one end per token");
        let c = r.as_ref().unwrap();
        assert_eq!((c.len, c.tag, c.sender), (n, k as u64, Some(ep)));
        assert_eq!(&rbufs[k][..n], &sbufs[k][..], "{n} bytes");
        assert_eq!(&rbufs[k][n..], &[0xEE; 2], "nothing past the message");
        let (t, r) = &ended[sizes.len() + k];
        assert_eq!(*t, 200 + k as u64);
        assert_eq!(r.as_ref().unwrap().len, n);
    }
    let mut more = Vec::new();
    w.take_completed(&mut more);
    assert!(more.is_empty(), "each end is reported once: {more:?}");
    assert_eq!(w.live_requests(), 0);
    assert_eq!(w.st.borrow().owned_len(), 0);
}

#[test]
fn only_the_requests_that_ended_are_queued() {
    let w = self_worker();
    let ep = w.connect(&w.address()).unwrap();
    const N: usize = 500;
    let mut bufs = vec![[0u8; 8]; N];
    let handles: Vec<QueuedReq> = bufs
        .iter_mut()
        .enumerate()
        .map(
            |(k, b)| match w.tag_recv_queued(raw(b), k as u64, TAG_MASK_FULL, k as u64) {
                Queued::Pending(h) => h,
                Queued::Ended(r) => panic!("{r:?}"),
            },
        )
        .collect();
    let mut msg = *b"12345678";
    if let Queued::Ended(r) = w.tag_send_queued(ep, raw(&mut msg), 321, false, 9999) {
        r.unwrap();
    }
    let got = take_ends(&w, 1);
    let recvs: Vec<u64> = got.iter().map(|(t, _)| *t).filter(|&t| t != 9999).collect();
    assert_eq!(recvs, vec![321], "the one receive that matched, alone");
    assert_eq!(&bufs[321], b"12345678");
    // The others cancel, once each, and their ends are queued by the cancel itself.
    for (k, h) in handles.iter().enumerate() {
        assert_eq!(w.cancel_queued(*h), k != 321, "receive {k}");
        assert!(!w.cancel_queued(*h), "once");
    }
    let mut canceled = 0;
    let mut ends = Vec::new();
    w.take_completed(&mut ends);
    for (t, r) in ends {
        if t == 9999 {
            continue;
        }
        assert!(matches!(r, Err(Error::Canceled)), "{t}: {r:?}");
        canceled += 1;
    }
    assert_eq!(canceled, N - 1);
    assert!(
        bufs.iter()
            .enumerate()
            .all(|(k, b)| k == 321 || b == &[0u8; 8])
    );
    assert_eq!(w.live_requests(), 0);
}

#[test]
fn a_receive_of_a_message_already_here_ends_while_posted() {
    let w = self_worker();
    let ep = w.connect(&w.address()).unwrap();
    let mut msg = *b"early";
    let send = w.tag_send_queued(ep, raw(&mut msg), 4, false, 1);
    if let Queued::Pending(_) = send {
        assert_eq!(take_ends(&w, 1).len(), 1);
    }
    for _ in 0..100 {
        w.progress();
    }
    let mut b = [0u8; 5];
    match w.tag_recv_queued(raw(&mut b), 4, TAG_MASK_FULL, 2) {
        Queued::Ended(r) => assert_eq!(r.unwrap().len, 5),
        Queued::Pending(_) => panic!("the message was here"),
    }
    assert_eq!(&b, b"early");
    let mut ends = Vec::new();
    w.take_completed(&mut ends);
    assert!(ends.is_empty(), "nothing queued for it");
    assert_eq!(w.live_requests(), 0);
}

#[test]
fn queued_requests_are_this_workers_and_end_with_its_drop() {
    let w = self_worker();
    let other = self_worker();
    let ep = w.connect(&w.address()).unwrap();
    let mut b = [3u8; 16];
    let Queued::Pending(h) = w.tag_recv_queued(raw(&mut b), 1, TAG_MASK_FULL, 1) else {
        panic!("nothing was sent")
    };
    assert!(!other.cancel_queued(h), "another worker's request");
    // A rendezvous send to itself that no receive matches, and the receive: the drop ends
    // both, and nothing touches the memory afterwards.
    let mut big = vec![4u8; 1 << 20];
    let send = w.tag_send_queued(ep, raw(&mut big), 99, false, 2);
    assert!(matches!(send, Queued::Pending(_)), "{send:?}");
    drop(w);
    assert_eq!(b, [3u8; 16]);
    assert!(big.iter().all(|&x| x == 4));
}
