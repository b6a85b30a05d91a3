//! What a request says when an endpoint's close or its peer's end cuts it short, over posix
//! between two workers of one process: the error names what happened (closed, by whom;
//! canceled on the other side, and how that comes about), so the user knows what to do.

use std::time::{Duration, Instant};

use rucx_ucp::{CloseMode, Context, EpId, TAG_MASK_FULL, Worker};
use rucx_ucs::{Config, Error};

fn context() -> Context {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let cfg =
        Config::from_vars(&tables, [("RUCX_TLS", "posix"), ("RUCX_RNDV_THRESH", "8K")]).unwrap();
    Context::new(&rucx_transports::registry(), cfg).unwrap()
}

fn pair() -> (Worker, Worker, EpId, EpId) {
    let (ca, cb) = (context(), context());
    let (a, b) = (Worker::new(&ca).unwrap(), Worker::new(&cb).unwrap());
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

/// The receiver closes its endpoint to the sender just as a rendezvous message from it is on
/// its way: the receive that matches the message ends with `EndpointClosed`, closed by this
/// worker (it said `EndpointFailure` with the reason "closed by this worker": nothing had
/// failed). The sender's send ends too, and nothing hangs.
#[test]
fn a_receive_matching_a_message_of_an_endpoint_closed_here_says_closed() {
    for mode in [CloseMode::Flush, CloseMode::Force] {
        let (a, b, ab, ba) = pair();
        let data = vec![5u8; 1 << 20];
        let mut got = vec![0u8; 1 << 20];
        a.scope(|sa| {
            b.scope(|sb| {
                let r = sb.tag_recv(&mut got, 2, TAG_MASK_FULL);
                let s = sa.tag_send(ab, &data, 2);
                let close = b.close(ba, mode);
                drive(&[&a, &b], || {
                    r.test().is_some() && s.test().is_some() && close.is_done()
                });
                match r.test().unwrap() {
                    Err(Error::EndpointClosed { by, .. }) => {
                        assert_eq!(by, rucx_ucs::ClosedBy::ThisWorker, "{mode:?}")
                    }
                    other => panic!("{mode:?}: {other:?}"),
                }
                assert!(s.test().unwrap().is_err(), "{mode:?}");
            })
        });
    }
}

/// A sender's worker dropped with a rendezvous send pending: the receive that matches the
/// message later ends with `PeerAborted`, saying the send was canceled on the sender's side and
/// how that happens (it said only "operation canceled"). The eager message sent before still
/// arrives whole.
#[test]
fn a_transfer_ended_by_the_senders_worker_drop_says_how() {
    let (a, b, ab, _ba) = pair();
    let small = vec![1u8; 100];
    let big = vec![2u8; 100_000];
    let s1 = a.tag_send_owned(ab, small.clone(), 1);
    let s2 = a.tag_send_owned(ab, big, 2);
    drive(&[&a, &b], || s1.is_done());
    assert!(!s2.is_done(), "the rendezvous waits for a receive");
    drop((s1, s2));
    drop(a);
    let (mut g1, mut g2) = (vec![0u8; 100], vec![0u8; 100_000]);
    b.scope(|s| {
        let r1 = s.tag_recv(&mut g1, 1, TAG_MASK_FULL);
        let r2 = s.tag_recv(&mut g2, 2, TAG_MASK_FULL);
        drive(&[&b], || r1.test().is_some() && r2.test().is_some());
        assert_eq!(r1.test().unwrap().unwrap().len, 100);
        match r2.test().unwrap() {
            Err(e @ Error::PeerAborted { .. }) => {
                let m = e.to_string();
                assert!(
                    m.contains("canceled on that side") && m.contains("worker dropped"),
                    "{m}"
                );
            }
            other => panic!("{other:?}"),
        }
    });
    assert!(g1 == small);
}

/// An `EpId` of another worker (a user's mix-up) whose index does not exist here is refused
/// by every call, saying whose it is (see `tests/ep_identity.rs` for one whose index does).
#[test]
fn an_endpoint_of_another_worker_is_refused_saying_whose_it_is() {
    let (a, b, _ab, _ba) = pair();
    let extra = [
        Worker::new(&context()).unwrap(),
        Worker::new(&context()).unwrap(),
    ];
    let mut last = None;
    for w in &extra {
        last = Some(a.connect(&w.address()).unwrap());
    }
    let foreign = last.unwrap();
    let says = |e: Error| match e {
        Error::ForeignEndpoint { ep, owner, worker } => {
            assert_eq!(
                (ep.as_str(), owner, worker),
                ("ep2", a.serial(), b.serial())
            );
            let m = Error::ForeignEndpoint { ep, owner, worker }.to_string();
            assert!(
                m.contains("valid only on the worker whose connect or accept made it"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    };
    let mut g = [0u8; 4];
    b.scope(|s| {
        says(s.tag_send(foreign, &[1u8][..], 1).wait().unwrap_err());
        says(s.stream_recv(foreign, &mut g[..]).wait().unwrap_err());
    });
    says(
        b.close(foreign, CloseMode::Force)
            .test()
            .unwrap()
            .unwrap_err(),
    );
    says(b.set_ep_error_handler(foreign, |_, _, _| {}).unwrap_err());
}
