//! A user's misuse of the Rust API between two workers of one process over posix: empty
//! buffers everywhere, a worker dropped with requests in flight, sending to and progressing
//! after a peer that is gone. Each call ends (no hang, no panic) with a result or a typed
//! error; buffers lent to owned requests come back.

use std::time::{Duration, Instant};

use rucx_ucp::{CloseMode, Context, EpId, TAG_MASK_FULL, Worker};
use rucx_ucs::{Config, Error};

fn context() -> Context {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let cfg = Config::from_vars(
        &tables,
        [
            ("RUCX_TLS", "posix"),
            ("RUCX_RNDV_THRESH", "8K"),
            ("RUCX_PEER_TIMEOUT", "300ms"),
        ],
    )
    .unwrap();
    Context::new(&rucx_transports::registry(), cfg).unwrap()
}

fn pair() -> (Worker, Worker, EpId, EpId) {
    let (a, b) = (
        Worker::new(&context()).unwrap(),
        Worker::new(&context()).unwrap(),
    );
    let ab = a.connect(&b.address()).unwrap();
    let ba = b.connect(&a.address()).unwrap();
    (a, b, ab, ba)
}

fn drive(ws: &[&Worker], mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        for w in ws {
            w.progress();
        }
        assert!(t.elapsed() < Duration::from_secs(20), "hangs");
    }
}

/// Zero-length tag, stream, active-message, put and get operations complete with length 0.
#[test]
fn empty_buffers_complete_with_length_zero() {
    let (a, b, ab, ba) = pair();
    let mut target = vec![0u8; 64];
    let map = b.mem_map(&mut target).unwrap();
    let rkey = a.rkey_unpack(ab, &map.pack_rkey()).unwrap();
    let empty: [u8; 0] = [];
    let mut none: [u8; 0] = [];
    let mut none2: [u8; 0] = [];
    let mut none3: [u8; 0] = [];
    b.scope(|sb| {
        let r = sb.tag_recv(&mut none[..], 4, TAG_MASK_FULL);
        let sr = sb.stream_recv(ba, &mut none2[..]);
        a.scope(|sa| {
            let s = sa.tag_send(ab, &empty[..], 4);
            let ss = sa.stream_send(ab, &empty[..]);
            let am = sa.am_send(ab, 7, b"", &empty[..]);
            let p = sa.put(ab, &empty[..], rkey.base(), &rkey);
            let g = sa.get(ab, &mut none3[..], rkey.base(), &rkey);
            drive(&[&a, &b], || {
                [&r, &sr, &s, &ss, &am, &p, &g]
                    .iter()
                    .all(|q| q.test().is_some())
            });
            for (name, q) in [
                ("tag recv", &r),
                ("stream recv", &sr),
                ("tag send", &s),
                ("stream send", &ss),
                ("am send", &am),
                ("put", &p),
                ("get", &g),
            ] {
                match q.test().unwrap() {
                    Ok(c) => assert_eq!(c.len, 0, "{name}"),
                    Err(e) => panic!("{name}: {e}"),
                }
            }
            sa.flush(ab).wait().unwrap();
        });
    });
    drop(map);
}

/// A worker dropped with owned requests in flight (a rendezvous send no one receives, a
/// receive nothing matches) ends them and hands their buffers back, intact.
#[test]
fn a_worker_dropped_with_owned_requests_in_flight_hands_them_back() {
    let (a, b, ab, _ba) = pair();
    let big = vec![3u8; 1 << 20];
    let send = a.tag_send_owned(ab, big, 1);
    let recv = a.tag_recv_owned(vec![0u8; 16], 99, TAG_MASK_FULL);
    for _ in 0..100 {
        a.progress();
        b.progress();
    }
    assert!(
        !send.is_done() && !recv.is_done(),
        "nothing could end them yet"
    );
    drop(a);
    let (res, buf) = send.try_take().expect("ended by the drop");
    assert!(res.is_err(), "{res:?}");
    assert!(buf.len() == 1 << 20 && buf.iter().all(|&x| x == 3));
    let (res, buf) = recv.try_take().expect("ended by the drop");
    assert!(res.is_err(), "{res:?}");
    assert_eq!(buf, vec![0u8; 16]);
    // The peer lives on: its progress with the other side gone neither hangs nor panics.
    for _ in 0..1000 {
        b.progress();
    }
}

/// After the peer worker was dropped, a send to it ends with the endpoint's failure, a close
/// of its endpoint ends, progress neither hangs nor panics, and a second close says the
/// endpoint is closed.
#[test]
fn sending_to_closing_and_progressing_after_the_peer_is_gone() {
    let (a, b, ab, _ba) = pair();
    drop(b);
    let data = vec![1u8; 64 << 10];
    let t = Instant::now();
    let res = a.scope(|s| {
        let r = s.tag_send(ab, &data, 1);
        drive(&[&a], || {
            r.test().is_some() || t.elapsed() > Duration::from_secs(3)
        });
        r.test()
    });
    // The peer's interface is gone: the send ends with the endpoint's failure.
    match &res {
        Some(Err(Error::EndpointFailure { .. })) => {}
        other => panic!("{other:?}"),
    }
    let close = a.close(ab, CloseMode::Force);
    drive(&[&a], || close.is_done());
    let twice = a.close(ab, CloseMode::Force);
    assert!(
        matches!(twice.test(), Some(Err(Error::EndpointClosed { .. }))),
        "{:?}",
        twice.test()
    );
    for _ in 0..1000 {
        a.progress();
    }
}
