//! Requests on owned buffers over real transports: two workers of one process over posix, and
//! two processes over posix and tcp (every protocol size class, buffers moved from a receive
//! into the echo's send, callbacks); a worker dropped with owned requests outstanding hands
//! every buffer back intact and tells its peer.

mod ranks;

use ranks::{drive, worker_pair};

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rucx::{Error, Job, OwnedRequest, TAG_MASK_FULL};

const SIZES: &[usize] = &[0, 1, 200, 8193, 65536, (1 << 20) + 3, 8 << 20];

/// Take a finished request's result and buffer.
fn take<B: Send + 'static>(r: OwnedRequest<B>) -> (rucx::Result<rucx::Completion>, B) {
    r.try_take()
        .unwrap_or_else(|r| panic!("{r:?} not finished"))
}

#[test]
fn owned_sends_and_receives_between_two_workers_over_posix() {
    let (w0, w1) = worker_pair("posix");
    let ep01 = w0.connect(&w1.address()).unwrap();
    let recvs: Vec<_> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| w1.tag_recv_owned(BytesMut::zeroed(n + 16), i as u64, TAG_MASK_FULL))
        .collect();
    // Every kind of send buffer, each moved into its request.
    let sends: Vec<OwnedRequest<Box<[u8]>>> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let b: Box<[u8]> = ranks::pattern(n, i).into_boxed_slice();
            w0.tag_send_owned(ep01, b, i as u64)
        })
        .collect();
    drive(&[&w0, &w1], || {
        sends.iter().all(|r| r.is_done()) && recvs.iter().all(|r| r.is_done())
    });
    for (i, (s, r)) in sends.into_iter().zip(recvs).enumerate() {
        let n = SIZES[i];
        let (res, sent) = take(s);
        assert_eq!(res.unwrap().len, n);
        assert_eq!(
            &sent[..],
            &ranks::pattern(n, i)[..],
            "the send buffer is intact"
        );
        let (res, got) = take(r);
        assert_eq!(res.unwrap().len, n);
        assert!(got[..n] == ranks::pattern(n, i)[..], "size {n}");
        assert!(got[n..].iter().all(|&b| b == 0), "nothing past the message");
    }
    assert_eq!((w0.live_requests(), w1.live_requests()), (0, 0));
}

/// Rank 1 echoes every message back in the very buffer it was received into (the receive's
/// buffer moves into the send); rank 0 sends `Bytes` and `Vec`s and receives into `BytesMut`,
/// counting its sends by callback.
fn echo_job() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let peer = job.ep(1 - job.rank());
    if job.rank() == 1 {
        let recvs: Vec<_> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| w.tag_recv_owned(vec![0u8; n], i as u64, TAG_MASK_FULL))
            .collect();
        let mut echoes = Vec::new();
        for (i, r) in recvs.into_iter().enumerate() {
            let (res, buf) = r.wait(w);
            assert_eq!(res.unwrap().len, SIZES[i]);
            echoes.push(w.tag_send_owned(peer, buf, 100 + i as u64));
        }
        for e in echoes {
            e.wait(w).0.unwrap();
        }
        job.barrier().unwrap();
        return;
    }
    let recvs: Vec<_> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| w.tag_recv_owned(BytesMut::zeroed(n), 100 + i as u64, TAG_MASK_FULL))
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, &n) in SIZES.iter().enumerate() {
        let tx = tx.clone();
        if i % 2 == 0 {
            w.tag_send_owned(peer, Bytes::from(ranks::pattern(n, i)), i as u64)
                .on_complete(move |res, b| tx.send((i, res, b.to_vec())).unwrap());
        } else {
            w.tag_send_owned(peer, ranks::pattern(n, i), i as u64)
                .on_complete(move |res, b| tx.send((i, res, b)).unwrap());
        }
    }
    for (i, r) in recvs.into_iter().enumerate() {
        let (res, got) = r.wait(w);
        assert_eq!(res.unwrap().len, SIZES[i]);
        assert!(got[..] == ranks::pattern(SIZES[i], i)[..], "echo {i}");
    }
    // Every send's callback ran (from the progress of the waits above), with its buffer.
    let done: Vec<_> = rx.try_iter().collect();
    assert_eq!(done.len(), SIZES.len());
    for (i, res, b) in done {
        assert_eq!(res.unwrap().len, SIZES[i]);
        assert_eq!(b, ranks::pattern(SIZES[i], i));
    }
    job.barrier().unwrap();
    println!("rank 0: {} echoes checked", SIZES.len());
}

#[test]
fn owned_echo_between_two_processes_over_posix() {
    if ranks::in_child() {
        return echo_job();
    }
    let out = ranks::run_both("owned_echo_between_two_processes_over_posix", "posix", &[]);
    assert!(out[0].contains("echoes checked"), "{}", out[0]);
}

#[test]
fn owned_echo_between_two_processes_over_tcp() {
    if ranks::in_child() {
        return echo_job();
    }
    let out = ranks::run_both("owned_echo_between_two_processes_over_tcp", "tcp", &[]);
    assert!(out[0].contains("echoes checked"), "{}", out[0]);
}

#[test]
fn a_dropped_worker_hands_back_every_owned_buffer_and_tells_its_peer() {
    let (w0, w1) = worker_pair("posix");
    let ep10 = w1.connect(&w0.address()).unwrap();
    let ep01 = w0.connect(&w1.address()).unwrap();
    // One receive that completes, three that never match (one by callback, one awaited in
    // another thread's future, one by handle).
    let done = w1.tag_recv_owned(vec![0u8; 64], 1, TAG_MASK_FULL);
    let (res, _) = w0.tag_send_owned(ep01, vec![7u8; 64], 1).wait(&w0);
    res.unwrap();
    drive(&[&w0, &w1], || done.is_done());
    let unmatched = w1.tag_recv_owned(vec![0xA5u8; 4096], 2, TAG_MASK_FULL);
    let (tx, rx) = std::sync::mpsc::channel();
    w1.tag_recv_owned(BytesMut::from(&[0x5Au8; 100][..]), 3, TAG_MASK_FULL)
        .on_complete(move |res, b| tx.send((res, b)).unwrap());
    let awaited = w1.tag_recv_owned(vec![0x3Cu8; 10], 4, TAG_MASK_FULL);
    let waiter = std::thread::spawn(move || poll_to_end(awaited));
    // A rendezvous send w0 never receives: aborted, and w0 is told.
    let big = w1.tag_send_owned(ep10, ranks::pattern(4 << 20, 9), 5);
    drive(&[&w0, &w1], || w0.probe(5, TAG_MASK_FULL).is_some());
    drop(w1);

    let (res, b) = take(done);
    assert_eq!(res.unwrap().len, 64);
    assert_eq!(b, vec![7u8; 64]);
    let (res, b) = take(unmatched);
    assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
    assert!(b == vec![0xA5u8; 4096], "intact");
    let (res, b) = rx
        .try_recv()
        .expect("the callback ran when the worker was dropped");
    assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
    assert_eq!(&b[..], &[0x5Au8; 100][..]);
    let (res, b) = waiter.join().unwrap();
    assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
    assert_eq!(b, vec![0x3Cu8; 10]);
    let (res, b) = take(big);
    assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
    assert!(b == ranks::pattern(4 << 20, 9), "intact");
    // The peer was told: the announced message is gone from its unexpected queue.
    drive(&[&w0], || w0.probe(5, TAG_MASK_FULL).is_none());
    let mut late = vec![0u8; 16];
    let r = w0.scope(|s| {
        s.tag_recv(&mut late, 5, TAG_MASK_FULL)
            .wait_timeout(Duration::from_millis(200))
    });
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
}

/// Block on an owned request's future in this thread with a waker that unparks it: the worker
/// (in another thread) wakes it.
fn poll_to_end<B: Send + 'static>(mut r: OwnedRequest<B>) -> (rucx::Result<rucx::Completion>, B) {
    use std::future::Future;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = std::pin::Pin::new(&mut r).poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}
