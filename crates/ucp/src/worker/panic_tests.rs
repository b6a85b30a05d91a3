//! A panic in user code run from progress (a request's callback, an active-message handler)
//! reaches the caller of `progress`, and takes nothing else with it: the other callbacks of
//! the same progress still run, the other messages are handed out by the next progress.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::tests::self_worker;
use crate::TAG_MASK_FULL;

/// Progress `w` until `done`, counting the panics that came out of it.
fn progress_until(w: &super::Worker, mut done: impl FnMut() -> bool) -> usize {
    let mut panics = 0;
    let t = Instant::now();
    while !done() && t.elapsed() < Duration::from_secs(10) {
        if catch_unwind(AssertUnwindSafe(|| w.progress())).is_err() {
            panics += 1;
        }
    }
    panics
}

#[test]
fn a_panicking_callback_leaves_the_other_callbacks_of_its_progress_to_run() {
    let w = self_worker();
    let ep = w.connect(&w.address()).unwrap();
    let (tx, rx) = mpsc::channel();
    // Four receives whose messages all arrive before the next progress: the second's callback
    // panics; the others must still get their buffers.
    for i in 0..4u64 {
        let tx = tx.clone();
        let _ = w
            .tag_recv_owned(vec![0u8; 32], i, TAG_MASK_FULL)
            .on_complete(move |res, buf| {
                if i == 1 {
                    panic!("callback {i} panics");
                }
                tx.send((i, res.map(|c| c.len), buf)).unwrap();
            });
    }
    for i in 0..4u64 {
        w.tag_send_wait(ep, &[i as u8 + 1; 32], i).unwrap();
    }
    let mut got = Vec::new();
    let panics = progress_until(&w, || {
        got.extend(rx.try_iter());
        got.len() == 3
    });
    assert_eq!(panics, 1, "the callback's panic reached progress once");
    got.sort_by_key(|g| g.0);
    let ids: Vec<u64> = got.iter().map(|g| g.0).collect();
    assert_eq!(ids, [0, 2, 3], "every other callback ran");
    for (i, res, buf) in got {
        assert_eq!(res.unwrap(), 32);
        assert_eq!(buf, vec![i as u8 + 1; 32]);
    }
    assert_eq!(w.live_requests(), 0);
}

#[test]
fn a_panicking_handler_leaves_the_messages_after_it_to_the_next_progress() {
    let w = self_worker();
    let ep = w.connect(&w.address()).unwrap();
    let (tx, rx) = mpsc::channel();
    w.set_am_handler(9, move |_, m| {
        let d = m.data;
        if d == b"boom" {
            panic!("handler panics");
        }
        tx.send(d).unwrap();
    });
    for d in [&b"a"[..], b"boom", b"b", b"c"] {
        w.am_send(ep, 9, b"h", d).unwrap();
    }
    let mut got = Vec::new();
    let panics = progress_until(&w, || {
        got.extend(rx.try_iter());
        got.len() == 3
    });
    assert_eq!(panics, 1);
    assert_eq!(
        got,
        [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()],
        "in order, none lost"
    );
}
