//! Tests of the connection manager's client without blocking (`connecting.rs`): one thread
//! progresses both the client and the server; requests held while connecting keep their
//! order; a reject, no server, a server that dies or stays silent mid-handshake, a close while
//! connecting; the event descriptor wakes a sleeper when the connection moves.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

use rucx_ucs::RawBuf;

use super::owned::Queued;
use super::prelude::*;
use crate::listener::{ConnectOpts, MAGIC};
use crate::{ConnRequest, Listener, TAG_MASK_FULL};

fn worker() -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(crate::CONFIG);
    let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", "posix")]).unwrap();
    let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
    Worker::new(&ctx).unwrap()
}

/// A `RawBuf` over a slice (kept alive and untouched by the tests until its end is taken).
fn raw(v: &mut [u8]) -> RawBuf {
    // SAFETY: the tests keep the memory alive and untouched until the end was taken.
    unsafe { RawBuf::new(v.as_mut_ptr() as usize, v.len(), None) }
}

/// Progress every worker of `ws` (one thread) until `done`, failing after 30 s.
fn pump(ws: &[&Worker], mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(30), "stuck");
        for w in ws {
            w.progress();
        }
    }
}

/// The next connection request of `l`, progressing `ws` meanwhile.
fn request(ws: &[&Worker], l: &Listener) -> ConnRequest {
    let mut r = None;
    pump(ws, || {
        r = r.take().or_else(|| l.next_request().unwrap());
        r.is_some()
    });
    r.unwrap()
}

/// Record the error the endpoint's handler is told.
fn watch(w: &Worker, ep: EpId) -> Arc<Mutex<Option<Error>>> {
    let seen = Arc::new(Mutex::new(None));
    let s = seen.clone();
    w.set_ep_error_handler(ep, move |_, _, e| *s.lock().unwrap() = Some(e.clone()))
        .unwrap();
    seen
}

fn ends(w: &Worker, got: &mut Vec<(u64, Result<Completion>)>) -> usize {
    w.take_completed(got);
    got.len()
}

fn opts(timeout: Duration) -> ConnectOpts {
    ConnectOpts {
        timeout,
        client_id: 0,
        local: None,
    }
}

fn pending(q: Queued) {
    assert!(matches!(q, Queued::Pending(_)), "held, not ended: {q:?}");
}

#[test]
fn one_thread_connects_a_client_and_its_server_and_held_requests_go_in_order() {
    let (cw, sw) = (worker(), worker());
    let l = sw.listen("127.0.0.1:0").unwrap();
    let o = ConnectOpts {
        client_id: 0xC0FFEE,
        ..opts(Duration::from_secs(30))
    };
    let t0 = Instant::now();
    let ep = cw.connect_sockaddr_nb(l.local_addr(), &o).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(1), "returned at once");
    assert!(cw.is_connecting(ep));
    // Posted before the server even saw the connection: held, in order.
    let mut msgs: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 10 + i as usize]).collect();
    let mut big = vec![7u8; 100_000];
    let mut sbytes = b"stream bytes".to_vec();
    let mut am = b"am payload".to_vec();
    for (i, m) in msgs.iter_mut().enumerate() {
        pending(cw.tag_send_queued(ep, raw(m), 10 + i as u64, false, i as u64));
    }
    pending(cw.tag_send_queued(ep, raw(&mut big), 20, false, 3));
    pending(cw.stream_send_queued(ep, raw(&mut sbytes), 4));
    pending(cw.am_send_queued(ep, 5, b"hdr", raw(&mut am), 5));
    pending(cw.flush_queued(ep, 6));
    // Other forms refuse it while it connects.
    assert!(matches!(
        cw.tag_send_wait(ep, b"x", 1),
        Err(Error::NoResource(_))
    ));
    let got_am = Arc::new(Mutex::new(Vec::new()));
    let g = got_am.clone();
    sw.set_am_handler(5, move |_, m| g.lock().unwrap().push((m.header, m.data)));

    let r = request(&[&cw, &sw], &l);
    assert_eq!(r.client_id(), 0xC0FFEE);
    let sep = r.accept(&sw).unwrap();
    // Receives matching any tag: they match the messages in the order they came.
    let mut rbufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 100_000]).collect();
    for (i, b) in rbufs.iter_mut().enumerate() {
        let q = sw.tag_recv_queued(raw(b), 0, 0, 100 + i as u64);
        assert!(matches!(q, Queued::Pending(_)));
    }
    let mut srecv = vec![0u8; sbytes.len()];
    pending(sw.stream_recv_queued(sep, raw(&mut srecv), false, 200));
    let (mut cend, mut send) = (Vec::new(), Vec::new());
    pump(&[&cw, &sw], || {
        ends(&cw, &mut cend) == 7 && ends(&sw, &mut send) == 5 && !got_am.lock().unwrap().is_empty()
    });
    assert!(!cw.is_connecting(ep));
    cend.sort_by_key(|(t, _)| *t);
    for (t, r) in &cend {
        assert!(r.is_ok(), "client token {t}: {r:?}");
    }
    assert_eq!(
        cend.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        (0..7).collect::<Vec<_>>()
    );
    let mut tags = Vec::new();
    for (t, r) in &send {
        let c = r.as_ref().unwrap();
        if *t == 200 {
            assert_eq!(c.len, sbytes.len());
        } else {
            tags.push((*t, c.tag, c.len));
        }
    }
    tags.sort();
    assert_eq!(
        tags,
        vec![
            (100, 10, 10),
            (101, 11, 11),
            (102, 12, 12),
            (103, 20, 100_000)
        ]
    );
    for i in 0..3 {
        assert_eq!(&rbufs[i][..10 + i], &msgs[i][..]);
    }
    assert_eq!(&rbufs[3][..], &big[..]);
    assert_eq!(srecv, sbytes);
    assert_eq!(
        got_am.lock().unwrap()[0],
        (b"hdr".to_vec(), b"am payload".to_vec())
    );
    // And back, on the connected endpoints.
    let mut back = *b"back";
    let mut into = [0u8; 4];
    pending(sw.tag_send_queued(sep, raw(&mut back), 9, true, 300));
    let q = cw.tag_recv_queued(raw(&mut into), 9, TAG_MASK_FULL, 301);
    if let Queued::Ended(r) = q {
        r.unwrap();
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    pump(&[&cw, &sw], || {
        ends(&sw, &mut b) == 1 && (ends(&cw, &mut a) == 1 || into == back)
    });
    assert_eq!(&into, b"back");
}

#[test]
fn a_reject_fails_the_endpoint_and_its_held_requests_with_the_reason() {
    let (cw, sw) = (worker(), worker());
    let l = sw.listen("127.0.0.1:0").unwrap();
    let ep = cw
        .connect_sockaddr_nb(l.local_addr(), &opts(Duration::from_secs(30)))
        .unwrap();
    let seen = watch(&cw, ep);
    let mut m = *b"held";
    pending(cw.tag_send_queued(ep, raw(&mut m), 1, false, 1));
    request(&[&cw, &sw], &l).reject();
    let mut got = Vec::new();
    pump(&[&cw, &sw], || {
        ends(&cw, &mut got) == 1 && seen.lock().unwrap().is_some()
    });
    let e = seen.lock().unwrap().clone().unwrap();
    assert!(
        matches!(&e, Error::PeerAborted { reason, .. } if reason.contains("rejected")),
        "{e}"
    );
    assert!(
        matches!(&got[0], (1, Err(Error::PeerAborted { .. }))),
        "{got:?}"
    );
    assert!(!cw.is_connecting(ep));
    // Later requests are refused with the same error.
    let q = cw.tag_send_queued(ep, raw(&mut m), 1, false, 2);
    assert!(
        matches!(q, Queued::Ended(Err(Error::PeerAborted { .. }))),
        "{q:?}"
    );
}

/// A port nobody listens on (bound, then closed).
fn dead_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[test]
fn no_server_listening_fails_the_endpoint_as_refused() {
    let cw = worker();
    let ep = cw
        .connect_sockaddr_nb(dead_port(), &opts(Duration::from_secs(30)))
        .unwrap();
    let seen = watch(&cw, ep);
    let mut m = *b"held";
    pending(cw.stream_send_queued(ep, raw(&mut m), 7));
    let mut got = Vec::new();
    pump(&[&cw], || {
        ends(&cw, &mut got) == 1 && seen.lock().unwrap().is_some()
    });
    let e = seen.lock().unwrap().clone().unwrap();
    assert!(
        matches!(e.cause(), Error::Io { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused),
        "{e}"
    );
    assert!(matches!(&got[0], (7, Err(Error::Io { .. }))), "{got:?}");
    // The blocking form retries a refused server until its timeout, then says so.
    let t = Instant::now();
    let e = cw
        .connect_sockaddr(dead_port(), Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_server_that_dies_or_stays_silent_mid_handshake_ends_the_connect() {
    let cw = worker();
    // Dies: reads the client's address, then closes without an answer.
    let raw_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = cw
        .connect_sockaddr_nb(raw_l.local_addr().unwrap(), &opts(Duration::from_secs(30)))
        .unwrap();
    let seen = watch(&cw, ep);
    let (mut s, _) = raw_l.accept().unwrap();
    let mut head = [0u8; 8];
    pump(&[&cw], || {
        use std::io::Read;
        s.set_nonblocking(true).unwrap();
        matches!(s.read(&mut head), Ok(8))
    });
    assert_eq!(&head, MAGIC);
    // Half an answer, then gone.
    std::io::Write::write_all(&mut s, &MAGIC[..4]).unwrap();
    drop(s);
    pump(&[&cw], || seen.lock().unwrap().is_some());
    let e = seen.lock().unwrap().clone().unwrap();
    assert!(
        matches!(&e, Error::EndpointFailure { reason, .. }
            if reason.contains("closed the connection") || reason.contains("reset")),
        "{e}"
    );
    // Silent: accepted by the kernel, never answered; the timeout ends it.
    let ep = cw
        .connect_sockaddr_nb(
            raw_l.local_addr().unwrap(),
            &opts(Duration::from_millis(300)),
        )
        .unwrap();
    let seen = watch(&cw, ep);
    let mut f = Vec::new();
    pending(cw.flush_queued(ep, 9));
    let t = Instant::now();
    pump(&[&cw], || {
        ends(&cw, &mut f) == 1 && seen.lock().unwrap().is_some()
    });
    assert!(t.elapsed() >= Duration::from_millis(300));
    let e = seen.lock().unwrap().clone().unwrap();
    assert!(matches!(e, Error::PeerTimeout { .. }), "{e}");
    assert!(
        matches!(&f[0], (9, Err(Error::PeerTimeout { .. }))),
        "{f:?}"
    );
}

#[test]
fn closing_an_endpoint_still_connecting_ends_its_held_requests_at_once() {
    let (cw, sw) = (worker(), worker());
    let l = sw.listen("127.0.0.1:0").unwrap();
    let ep = cw
        .connect_sockaddr_nb(l.local_addr(), &opts(Duration::from_secs(30)))
        .unwrap();
    let mut m = *b"held";
    pending(cw.tag_send_queued(ep, raw(&mut m), 1, false, 1));
    pending(cw.flush_queued(ep, 2));
    let c = cw.close(ep, crate::CloseMode::Flush);
    let mut got = Vec::new();
    pump(&[&cw], || ends(&cw, &mut got) == 2 && c.is_done());
    assert!(
        got.iter().all(|(_, r)| matches!(r, Err(Error::Canceled))),
        "{got:?}"
    );
    assert!(!cw.is_connecting(ep));
    // The server, progressed afterwards, finds a client that went away: no endpoint, no
    // stall; the listener serves the next client.
    for _ in 0..100 {
        let _ = l.next_request();
        sw.progress();
    }
    let ep2 = cw
        .connect_sockaddr_nb(l.local_addr(), &opts(Duration::from_secs(30)))
        .unwrap();
    request(&[&cw, &sw], &l).accept(&sw).unwrap();
    pump(&[&cw, &sw], || !cw.is_connecting(ep2));
    assert!(cw.connect_error(ep2).is_none());
}

#[test]
fn the_event_descriptor_wakes_a_sleeper_when_the_connection_moves() {
    let (cw, sw) = (worker(), worker());
    let l = sw.listen("127.0.0.1:0").unwrap();
    let ep = cw
        .connect_sockaddr_nb(l.local_addr(), &opts(Duration::from_secs(30)))
        .unwrap();
    let fd = cw.event_fd().unwrap();
    // Armed while connecting (nothing to poll for): the socket will wake it.
    let arm = |w: &Worker| {
        let t = Instant::now();
        loop {
            match w.arm() {
                Ok(()) => return,
                Err(Error::Busy(_)) => {
                    w.progress();
                }
                Err(e) => panic!("{e}"),
            }
            assert!(t.elapsed() < Duration::from_secs(30));
        }
    };
    let readable = |t| rucx_ucs::event::wait_readable(fd, Some(t)).unwrap();
    // The TCP connect ends (or ended): readable, and progress sends our address.
    arm(&cw);
    assert!(cw.is_connecting(ep));
    let r = {
        let t = Instant::now();
        loop {
            if let Some(r) = l.next_request().unwrap() {
                break r;
            }
            // Only the client's own progress sends its address: wake for it, as a sleeper.
            if readable(Duration::from_millis(10)) {
                cw.progress();
                arm(&cw);
            }
            assert!(t.elapsed() < Duration::from_secs(30));
        }
    };
    // Nothing for the client until the server answers: it sleeps...
    arm(&cw);
    assert!(
        !readable(Duration::from_millis(50)),
        "woken with nothing to do"
    );
    // ... and the answer wakes it.
    r.accept(&sw).unwrap();
    assert!(
        readable(Duration::from_secs(30)),
        "the server's answer did not wake it"
    );
    pump(&[&cw, &sw], || !cw.is_connecting(ep));
    assert!(cw.connect_error(ep).is_none());
}

#[test]
fn a_flood_of_silent_peers_is_capped_and_served_again_after_their_deadline() {
    let (cw, sw) = (worker(), worker());
    let mut l = sw.listen("127.0.0.1:0").unwrap();
    l.set_max_handshakes(4);
    l.set_handshake_timeout(Duration::from_millis(300));
    let flood: Vec<_> = (0..10)
        .map(|_| std::net::TcpStream::connect(l.local_addr()).unwrap())
        .collect();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(100) {
        assert!(l.next_request().unwrap().is_none());
    }
    assert_eq!(l.handshakes(), 4, "at most the cap held");
    // Those beyond it were closed.
    let mut closed = 0;
    let mut flood = flood;
    for s in &mut flood {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        if matches!(s.read(&mut [0u8; 1]), Ok(0)) {
            closed += 1;
        }
    }
    assert_eq!(closed, 6);
    // The held ones end at their deadline (the listener goes on meanwhile).
    let t = Instant::now();
    while l.handshakes() > 0 {
        match l.next_request() {
            Ok(None) => {}
            Ok(Some(_)) => panic!("a silent peer made a request"),
            Err(e) => assert!(matches!(e, Error::Timeout { .. }), "{e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(30));
    }
    drop(flood);
    // After their deadline, a real client is served.
    let ep = cw
        .connect_sockaddr_nb(l.local_addr(), &opts(Duration::from_secs(30)))
        .unwrap();
    let mut r = None;
    pump(&[&cw, &sw], || {
        match l.next_request() {
            Ok(Some(x)) => r = Some(x),
            Ok(None) => {}
            Err(e) => assert!(
                matches!(e, Error::Timeout { .. } | Error::InvalidAddress(_)),
                "{e}"
            ),
        }
        r.is_some()
    });
    r.unwrap().accept(&sw).unwrap();
    pump(&[&cw, &sw], || !cw.is_connecting(ep));
    assert!(cw.connect_error(ep).is_none());
}
