//! The end of a byte stream, over posix between two workers of one process: a stream receive
//! that its endpoint's end cuts short reports how many bytes it holds (intact, at the start of
//! its buffer), bytes that arrived before the end stay receivable, and a close does not wait
//! for bytes that may never come.

use std::time::{Duration, Instant};

use rucx_ucp::{CloseMode, Context, EpId, Request, Worker};
use rucx_ucs::{Config, Error};

fn context(vars: &[(&str, &str)]) -> Context {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let mut all = vec![("RUCX_TLS", "posix")];
    all.extend_from_slice(vars);
    let cfg = Config::from_vars(&tables, all).unwrap();
    Context::new(&rucx_transports::registry(), cfg).unwrap()
}

/// Two workers connected both ways: (a, b, a's endpoint to b, b's endpoint to a).
fn pair(a_vars: &[(&str, &str)], b_vars: &[(&str, &str)]) -> (Worker, Worker, EpId, EpId) {
    let (ca, cb) = (context(a_vars), context(b_vars));
    let (a, b) = (Worker::new(&ca).unwrap(), Worker::new(&cb).unwrap());
    let ab = a.connect(&b.address()).unwrap();
    let ba = b.connect(&a.address()).unwrap();
    (a, b, ab, ba)
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(5))
        .collect()
}

/// Progress `ws` until `done`, at most 20 s.
fn drive(ws: &[&Worker], mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        for w in ws {
            w.progress();
        }
        assert!(t.elapsed() < Duration::from_secs(20), "hangs");
    }
}

/// Progress `ws` a while (for bytes in flight to land).
fn settle(ws: &[&Worker]) {
    for _ in 0..2000 {
        for w in ws {
            w.progress();
        }
    }
}

fn stream_send_all(w: &Worker, peer: &Worker, ep: EpId, data: &[u8]) {
    w.scope(|s| {
        let r = s.stream_send(ep, data);
        drive(&[w, peer], || r.test().is_some());
        r.wait().unwrap();
    });
}

/// The partial count and cause of a stream receive that ended early.
fn incomplete(r: Option<rucx_ucs::Result<rucx_ucp::Completion>>) -> (usize, usize, Error) {
    match r {
        Some(Err(Error::StreamIncomplete {
            received,
            wanted,
            cause,
        })) => (received, wanted, *cause),
        other => panic!("not an incomplete stream receive: {other:?}"),
    }
}

fn wait_test(ws: &[&Worker], r: &Request<'_>) -> Option<rucx_ucs::Result<rucx_ucp::Completion>> {
    drive(ws, || r.test().is_some());
    r.test()
}

/// 700 of the 1000 bytes a receive wants arrive, then the sender closes its endpoint: the
/// receive ends reporting 700, which are the sender's first 700 bytes, and nothing was written
/// past them. (It used to end with the bare `EndpointClosed`: the count was lost.)
#[test]
fn a_receive_cut_short_by_the_peers_close_reports_what_it_holds() {
    let (a, b, ab, ba) = pair(&[], &[]);
    let data = pattern(700);
    let mut buf = vec![0xeeu8; 1000];
    b.scope(|s| {
        let r = s.stream_recv(ba, &mut buf);
        stream_send_all(&a, &b, ab, &data);
        settle(&[&a, &b]);
        assert!(r.test().is_none(), "300 bytes short: still waiting");
        let close = a.close(ab, CloseMode::Flush);
        let res = wait_test(&[&a, &b], &r);
        drive(&[&a, &b], || close.is_done());
        let (received, wanted, cause) = incomplete(res);
        assert_eq!((received, wanted), (700, 1000));
        assert!(
            matches!(cause, Error::EndpointClosed { .. }),
            "the peer closed it: {cause:?}"
        );
        let e = r.wait().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("stream receive ended after 700 of 1000 bytes"),
            "{e}"
        );
        assert!(matches!(e.cause(), Error::EndpointClosed { .. }));
    });
    assert!(buf[..700] == data[..], "the 700 bytes are intact");
    assert!(buf[700..].iter().all(|&x| x == 0xee), "nothing past them");
}

/// The sender streams 1000 bytes and closes before the receiver posted anything: the bytes
/// stay receivable (as whole tag messages do), the receive that wants more than is left ends
/// with what is left, and a later one ends at once with none. (They used to be dropped at the
/// close: the receives failed and the 1000 bytes were lost.)
#[test]
fn bytes_that_arrived_before_the_peers_close_stay_receivable() {
    let (a, b, ab, ba) = pair(&[], &[]);
    let data = pattern(1000);
    stream_send_all(&a, &b, ab, &data);
    let close = a.close(ab, CloseMode::Flush);
    drive(&[&a, &b], || close.is_done() && b.ep_error(ba).is_some());
    let (mut first, mut second, mut third) = (vec![0u8; 600], vec![0xeeu8; 600], vec![0u8; 10]);
    b.scope(|s| {
        assert_eq!(s.stream_recv(ba, &mut first).wait().unwrap().len, 600);
        let r = s.stream_recv(ba, &mut second);
        let (received, wanted, cause) = incomplete(r.test());
        assert_eq!((received, wanted), (400, 600));
        assert!(matches!(cause, Error::EndpointClosed { .. }), "{cause:?}");
        let r = s.stream_recv(ba, &mut third);
        assert_eq!(incomplete(r.test()).0, 0, "nothing left");
        // A zero-byte receive needs nothing: it completes.
        assert_eq!(s.stream_recv(ba, &mut [][..]).wait().unwrap().len, 0);
    });
    assert!(first[..] == data[..600]);
    assert!(second[..400] == data[600..]);
    assert!(second[400..].iter().all(|&x| x == 0xee));
}

/// The receiver's peer timeout fails a sender that stopped calling into rucx after 700 of
/// 1000 bytes: the receive ends reporting the 700, with the typed timeout (naming its knob)
/// as the cause; a request posted to the endpoint afterwards is refused with the same kind.
#[test]
fn a_receive_cut_short_by_a_peer_timeout_reports_what_it_holds() {
    let (a, b, ab, ba) = pair(&[], &[("RUCX_PEER_TIMEOUT", "100ms")]);
    let data = pattern(700);
    let mut buf = vec![0xeeu8; 1000];
    b.scope(|s| {
        let r = s.stream_recv(ba, &mut buf);
        stream_send_all(&a, &b, ab, &data);
        // From now on `a` is silent (never progressed).
        let t = Instant::now();
        let res = wait_test(&[&b], &r);
        assert!(
            t.elapsed() >= Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
        let (received, wanted, cause) = incomplete(res);
        assert_eq!((received, wanted), (700, 1000));
        match &cause {
            Error::PeerTimeout { knob, silent, .. } => {
                assert_eq!(knob, "RUCX_PEER_TIMEOUT=100ms");
                assert!(*silent >= Duration::from_millis(100), "{silent:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            cause.to_string().contains("RUCX_PEER_TIMEOUT=100ms"),
            "{cause}"
        );
        let later = s.tag_send(ba, &data, 1).wait();
        assert!(
            matches!(later, Err(Error::PeerTimeout { .. })),
            "typed for later requests too: {later:?}"
        );
    });
    assert!(buf[..700] == data[..]);
    assert!(buf[700..].iter().all(|&x| x == 0xee));
}

/// A flush close of an endpoint with a stream receive waiting for bytes the peer never sends
/// ends (it used to wait for that receive forever); the receive ends reporting the bytes it
/// held, closed by this worker.
#[test]
fn a_flush_close_does_not_wait_for_stream_bytes_that_never_come() {
    let (a, b, ab, ba) = pair(&[], &[]);
    let data = pattern(300);
    let mut buf = vec![0u8; 1000];
    b.scope(|s| {
        let r = s.stream_recv(ba, &mut buf);
        stream_send_all(&a, &b, ab, &data);
        settle(&[&a, &b]);
        let close = b.close(ba, CloseMode::Flush);
        drive(&[&a, &b], || close.is_done());
        close.try_take().unwrap().0.unwrap();
        let (received, _, cause) = incomplete(r.test());
        assert_eq!(received, 300);
        match &cause {
            Error::EndpointClosed { by, .. } => {
                assert_eq!(*by, rucx_ucs::ClosedBy::ThisWorker, "{by}")
            }
            other => panic!("{other:?}"),
        }
    });
    assert!(buf[..300] == data[..]);
}

/// A force close ends a part-filled stream receive at once: canceled, with the bytes it held.
#[test]
fn a_force_close_reports_what_a_stream_receive_held() {
    let (a, b, ab, ba) = pair(&[], &[]);
    let data = pattern(300);
    let mut buf = vec![0u8; 1000];
    b.scope(|s| {
        let r = s.stream_recv(ba, &mut buf);
        stream_send_all(&a, &b, ab, &data);
        settle(&[&a, &b]);
        let close = b.close(ba, CloseMode::Force);
        let (received, _, cause) = incomplete(r.test());
        assert_eq!((received, cause), (300, Error::Canceled));
        drive(&[&a, &b], || close.is_done());
    });
    assert!(buf[..300] == data[..]);
}
