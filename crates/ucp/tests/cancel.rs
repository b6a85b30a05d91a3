//! Send cancellation and scopes left within a limit, between two workers of one process over
//! shared memory (posix), each progressed by the test.

use std::time::Duration;

use rucx_ucp::{Context, TAG_MASK_FULL, Worker, wait_all};
use rucx_ucs::{Config, Error};

fn worker(vars: &[(&str, &str)]) -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let mut all: Vec<(String, String)> = vec![("RUCX_TLS".into(), "posix".into())];
    all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let cfg = Config::from_vars(&tables, all).unwrap();
    let ctx = Context::new(&rucx_transports::registry(), cfg).unwrap();
    Worker::new(&ctx).unwrap()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn progress_both(a: &Worker, b: &Worker, rounds: usize) {
    for _ in 0..rounds {
        a.progress();
        b.progress();
    }
}

/// A rendezvous send that no receive matched yet is canceled with the receiver's agreement:
/// it ends `Canceled`, the receiver drops the announcement (no receive ever sees it), and the
/// next message with the same tag is the one received.
#[test]
fn a_rendezvous_send_no_receive_matched_is_canceled() {
    let a = worker(&[("RUCX_RNDV_THRESH", "16K")]);
    let b = worker(&[("RUCX_RNDV_THRESH", "16K")]);
    let ab = a.connect(&b.address()).unwrap();
    let first = pattern(1 << 20, 1);
    let second = pattern(1 << 20, 2);
    let mut got = vec![0u8; 1 << 20];
    a.scope(|sa| {
        let s1 = sa.tag_send(ab, &first, 5);
        // The announcement reaches b, where nothing matches it.
        for _ in 0..1000 {
            progress_both(&a, &b, 1);
            if b.probe(5, TAG_MASK_FULL).is_some() {
                break;
            }
        }
        assert_eq!(b.probe(5, TAG_MASK_FULL).map(|c| c.len), Some(1 << 20));
        assert!(s1.cancel(), "announced, unmatched: the receiver is asked");
        // b drops the announcement and answers (a receive posted before b saw the request
        // would have matched the message, and the send would have completed instead).
        for _ in 0..100_000 {
            progress_both(&a, &b, 1);
            if s1.test().is_some() {
                break;
            }
        }
        let res = s1.test().expect("the receiver answered");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert!(
            b.probe(5, TAG_MASK_FULL).is_none(),
            "dropped by the receiver"
        );
        b.scope(|sb| {
            let r = sb.tag_recv(&mut got, 5, TAG_MASK_FULL);
            let s2 = sa.tag_send(ab, &second, 5);
            let res = wait_all(&[&r, &s2]);
            assert_eq!(res[0].as_ref().unwrap().len, 1 << 20);
            res[1].as_ref().unwrap();
        });
    });
    assert!(got == second, "the canceled message was never received");
    assert!(b.probe(5, TAG_MASK_FULL).is_none());
    assert_eq!(a.counters().get("send canceled").copied(), Some(1));
    assert_eq!(a.live_requests() + b.live_requests(), 0);
}

/// A synchronous send whose message a receive matched before the cancellation is asked is
/// not canceled: the request completes as usual and the data arrives whole.
#[test]
fn a_send_a_receive_matched_first_is_not_canceled() {
    let a = worker(&[]);
    let b = worker(&[]);
    let ab = a.connect(&b.address()).unwrap();
    let msg = pattern(100, 3);
    let mut got = vec![0u8; 100];
    a.scope(|sa| {
        b.scope(|sb| {
            let r = sb.tag_recv(&mut got, 6, TAG_MASK_FULL);
            let s = sa.tag_send_sync(ab, &msg, 6);
            // b matches it (and acknowledges); a has not seen the acknowledgement yet.
            for _ in 0..1000 {
                b.progress();
                if r.test().is_some() {
                    break;
                }
            }
            assert_eq!(r.test().unwrap().unwrap().len, 100);
            assert!(s.test().is_none());
            assert!(s.cancel(), "announced: the receiver is asked");
            let res = wait_all(&[&s]);
            assert_eq!(res[0].as_ref().unwrap().len, 100, "too late: it completed");
        })
    });
    assert!(got == msg);
    assert!(!a.counters().contains_key("send canceled"));
}

/// A send still queued behind another one (the transport's ring is full) is canceled before
/// any of it is on the wire; the send ahead of it, partly posted, cannot be. Only the sends
/// that were not canceled arrive.
#[test]
fn a_send_queued_behind_others_is_canceled_before_the_wire() {
    // Eager only, so that the first message fills the receiver's ring.
    let vars = [("RUCX_RNDV_THRESH", "inf")];
    let a = worker(&vars);
    let b = worker(&vars);
    let ab = a.connect(&b.address()).unwrap();
    let big = pattern(8 << 20, 4);
    let queued = pattern(64 << 10, 5);
    let last = pattern(64 << 10, 6);
    let (mut g1, mut g2) = (vec![0u8; 8 << 20], vec![0u8; 64 << 10]);
    a.scope(|sa| {
        let s1 = sa.tag_send(ab, &big, 7);
        let s2 = sa.tag_send(ab, &queued, 8);
        assert!(
            s1.test().is_none() && s2.test().is_none(),
            "the ring is full"
        );
        assert!(!s1.cancel(), "partly on the wire: too late");
        assert!(s2.cancel(), "nothing on the wire yet");
        assert!(matches!(s2.test(), Some(Err(Error::Canceled))));
        let s3 = sa.tag_send(ab, &last, 8);
        b.scope(|sb| {
            let r1 = sb.tag_recv(&mut g1, 7, TAG_MASK_FULL);
            let r2 = sb.tag_recv(&mut g2, 8, TAG_MASK_FULL);
            let res = wait_all(&[&s1, &s3, &r1, &r2]);
            for r in &res {
                r.as_ref().unwrap();
            }
        });
    });
    assert!(g1 == big);
    assert!(g2 == last, "the canceled send never arrived");
    assert_eq!(a.live_requests() + b.live_requests(), 0);
}

/// A scope left after a timed-out receive returns without hanging (the receive that never
/// matched is canceled at its end) and the worker stays usable.
#[test]
fn a_scope_left_after_a_timed_out_receive_returns_and_the_worker_stays_usable() {
    let a = worker(&[]);
    let b = worker(&[]);
    let ab = a.connect(&b.address()).unwrap();
    let mut never = vec![0u8; 64];
    let r = b
        .scope_timeout(Duration::from_secs(30), |s| {
            s.tag_recv(&mut never, 9, TAG_MASK_FULL)
                .wait_timeout(Duration::from_millis(5))
        })
        .unwrap();
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert_eq!(b.live_requests(), 0);
    let msg = pattern(1000, 7);
    let mut got = vec![0u8; 1000];
    a.scope(|sa| {
        b.scope(|sb| {
            let r = sb.tag_recv(&mut got, 9, TAG_MASK_FULL);
            let s = sa.tag_send(ab, &msg, 9);
            for res in wait_all(&[&s, &r]) {
                res.unwrap();
            }
        })
    });
    assert!(got == msg);
}

/// A scope whose rendezvous send the peer never answers (it does not progress) is left after
/// the limit: the cancellation it asked for gets no answer, so the endpoint is failed, the send
/// ends with `EndpointFailure`, and the scope returns `Timeout` naming the send. The worker
/// goes on with its other endpoints.
#[test]
fn a_scope_whose_peer_never_answers_is_left_with_an_error_naming_what_was_pending() {
    let a = worker(&[("RUCX_RNDV_THRESH", "16K")]);
    let b = worker(&[]);
    let c = worker(&[]);
    let ab = a.connect(&b.address()).unwrap();
    let big = pattern(1 << 20, 8);
    let mut res = None;
    let e = a
        .scope_timeout(Duration::from_millis(50), |s| {
            let r = s.tag_send(ab, &big, 10);
            res = Some(r.wait_timeout(Duration::from_millis(5)));
        })
        .unwrap_err();
    assert!(matches!(res, Some(Err(Error::Timeout { .. }))), "{res:?}");
    match &e {
        Error::Timeout { what, .. } => {
            assert!(what.contains("1 request(s)"), "{what}");
            assert!(what.contains("1048576 bytes"), "{what}");
            assert!(what.contains("waiting for the receiver"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        a.ep_error(ab).is_some(),
        "the endpoint of the pending send is failed"
    );
    assert_eq!(a.live_requests(), 0);
    // Another endpoint of the same worker works.
    let ac = a.connect(&c.address()).unwrap();
    let mut got = vec![0u8; 1 << 20];
    a.scope(|sa| {
        c.scope(|sc| {
            let r = sc.tag_recv(&mut got, 11, TAG_MASK_FULL);
            let s = sa.tag_send(ac, &big, 11);
            for res in wait_all(&[&s, &r]) {
                res.unwrap();
            }
        })
    });
    assert!(got == big);
}
