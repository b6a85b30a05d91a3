//! Endpoint ids carry the identity of the worker that made them: an id used on another worker
//! (even where an endpoint of the same index exists there) and the id of an endpoint that was
//! closed are refused by every public call that takes one, with a typed error naming the id,
//! and nothing is sent to the endpoint the index would name. Two workers of one process
//! over posix, as a user mixing up two workers would have them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rucx_ucp::{AmMessage, AmPayload, CloseMode, Context, EpId, RkeyBundle, Worker};
use rucx_ucs::{Config, Error, RawBuf};

fn context() -> Context {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let cfg = Config::from_vars(&tables, [("RUCX_TLS", "posix")]).unwrap();
    Context::new(&rucx_transports::registry(), cfg).unwrap()
}

/// Two workers connected both ways: each one's first endpoint (index 0) is to the other.
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

/// Every public call of a worker that names an endpoint, run with `ep` on `w`; `rkey` is a
/// valid key of the peer (for put and get), unpacked on the worker that made it. The name
/// of the call and what it reported.
fn every_call(w: &Worker, ep: EpId, rkey: &RkeyBundle) -> Vec<(&'static str, Result<(), Error>)> {
    let mut out: Vec<(&'static str, Result<(), Error>)> = Vec::new();
    let (mut got, mut back) = ([0u8; 16], [0u8; 16]);
    let data = [7u8; 16];
    w.scope(|s| {
        out.push(("tag_send", s.tag_send(ep, &data[..], 1).wait().map(drop)));
        out.push((
            "tag_send_sync",
            s.tag_send_sync(ep, &data[..], 1).wait().map(drop),
        ));
        out.push(("stream_send", s.stream_send(ep, &data[..]).wait().map(drop)));
        out.push((
            "stream_recv",
            s.stream_recv(ep, &mut got[..]).wait().map(drop),
        ));
        out.push((
            "am_send",
            s.am_send(ep, 3, b"h", &data[..]).wait().map(drop),
        ));
        out.push((
            "put",
            s.put(ep, &data[..], rkey.base(), rkey).wait().map(drop),
        ));
        out.push((
            "get",
            s.get(ep, &mut back[..], rkey.base(), rkey).wait().map(drop),
        ));
        out.push(("flush", s.flush(ep).wait().map(drop)));
    });
    out.push(("worker.am_send", w.am_send(ep, 3, b"h", &data)));
    out.push(("tag_send_wait", w.tag_send_wait(ep, &data, 1).map(drop)));
    out.push(("tag_send_inline", w.tag_send_inline(ep, &data, 1).map(drop)));
    let owned = w.tag_send_owned(ep, data.to_vec(), 1);
    out.push((
        "tag_send_owned",
        owned.try_take().expect("refused at once").0.map(drop),
    ));
    let owned = w.tag_send_sync_owned(ep, data.to_vec(), 1);
    out.push((
        "tag_send_sync_owned",
        owned.try_take().expect("refused at once").0.map(drop),
    ));
    let mut mem = [0u8; 16];
    // SAFETY: `mem` outlives every queued request below, each refused when posted.
    let (addr, len) = (mem.as_mut_ptr() as usize, mem.len());
    // SAFETY: as above.
    let raw = || unsafe { RawBuf::new(addr, len, None) };
    let queued = |q: rucx_ucp::Queued| match q {
        rucx_ucp::Queued::Ended(r) => r.map(drop),
        other => panic!("a queued request on a bad endpoint was taken: {other:?}"),
    };
    out.push((
        "tag_send_queued",
        queued(w.tag_send_queued(ep, raw(), 1, false, 9)),
    ));
    out.push((
        "stream_send_queued",
        queued(w.stream_send_queued(ep, raw(), 9)),
    ));
    out.push((
        "stream_recv_queued",
        queued(w.stream_recv_queued(ep, raw(), true, 9)),
    ));
    out.push((
        "am_send_queued",
        queued(w.am_send_queued(ep, 3, b"h", raw(), 9)),
    ));
    out.push(("rkey_unpack", w.rkey_unpack(ep, b"x").map(drop)));
    out.push(("proto_table", w.proto_table(ep).map(drop)));
    out.push(("plan", w.plan(ep).map(drop)));
    out.push(("proto_info", w.proto_info(ep).map(drop)));
    out.push(("lanes", w.lanes(ep).map(drop)));
    out.push(("path_query", w.path_query(ep, None).map(drop)));
    out
}

/// The peer's key for put and get, unpacked on `w` (with its own endpoint `ep`).
fn key_of(w: &Worker, ep: EpId, peer: &Worker, target: &mut [u8]) -> RkeyBundle {
    let map = peer.mem_map(target).unwrap();
    let packed = map.pack_rkey();
    drop(map);
    w.rkey_unpack(ep, &packed).unwrap()
}

/// Before: `b` took `a`'s id `ep0` as its own `ep0` (to `a`) and sent on it; every call now
/// refuses it with `ForeignEndpoint` naming the id and both workers, and nothing arrives.
#[test]
fn an_id_of_another_worker_whose_index_exists_here_is_refused_by_every_call() {
    let (a, b, ab, ba) = pair();
    let inbox: Arc<Mutex<Vec<AmMessage>>> = Arc::default();
    let to = inbox.clone();
    a.set_am_handler(3, move |_, m| to.lock().unwrap().push(m));
    assert_eq!(
        ab.to_string(),
        ba.to_string(),
        "both are ep0: the case that went wrong"
    );
    assert_ne!(a.serial(), b.serial());
    assert_eq!((ab.worker(), ba.worker()), (a.serial(), b.serial()));
    let mut target = vec![0u8; 4096];
    let rkey = key_of(&b, ba, &a, &mut target);
    let calls = every_call(&b, ab, &rkey);
    assert!(calls.len() >= 23, "{}", calls.len());
    for (name, res) in calls {
        match res {
            Err(Error::ForeignEndpoint { ep, owner, worker }) => {
                assert_eq!(
                    (ep.as_str(), owner, worker),
                    ("ep0", a.serial(), b.serial()),
                    "{name}"
                );
                let text = Error::ForeignEndpoint { ep, owner, worker }.to_string();
                assert!(
                    text.contains("ep0") && text.contains("valid only on"),
                    "{text}"
                );
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    // Close and the handler of the endpoint refuse it too, and the real ep0 of `b` is intact.
    let close = b.close(ab, CloseMode::Force);
    assert!(matches!(
        close.test().expect("refused at once"),
        Err(Error::ForeignEndpoint { .. })
    ));
    assert!(matches!(
        b.set_ep_error_handler(ab, |_, _, _| {}),
        Err(Error::ForeignEndpoint { .. })
    ));
    assert!(b.ep_error(ab).unwrap().contains("valid only on"));
    assert_eq!(b.ep_error(ba), None);
    // Nothing of the refused calls reached `a`: the first message it gets is this one.
    b.tag_send_wait(ba, b"real", 5).unwrap();
    let mut got = [0u8; 4];
    a.scope(|s| {
        let r = s.tag_recv(&mut got[..], 0, 0);
        drive(&[&a, &b], || r.test().is_some());
        assert_eq!(r.test().unwrap().unwrap().tag, 5);
    });
    assert_eq!(&got, b"real");
    a.progress();
    assert!(
        inbox.lock().unwrap().is_empty(),
        "a refused active message arrived"
    );
}

/// The id of an endpoint closed here keeps being refused with `EndpointClosed` naming it
/// (never the endpoint a reconnect made, which gets a new id), and closing twice says so.
#[test]
fn a_closed_endpoint_id_is_refused_by_every_call_after_a_reconnect_too() {
    let (a, b, ab, ba) = pair();
    let close = a.close(ab, CloseMode::Flush);
    drive(&[&a, &b], || close.is_done());
    close.test().unwrap().unwrap();
    let again = a.connect(&b.address()).unwrap();
    assert_ne!(again, ab);
    let mut target = vec![0u8; 4096];
    let rkey = key_of(&a, again, &b, &mut target);
    for (name, res) in every_call(&a, ab, &rkey) {
        // A stream receive still takes the bytes that arrived before the close (none here):
        // it ends with `StreamIncomplete` whose cause is the close.
        match res.as_ref().map_err(Error::cause) {
            Err(Error::EndpointClosed { ep, by, .. }) => {
                assert_eq!(*ep, ab.to_string(), "{name}");
                assert_eq!(*by, rucx_ucs::ClosedBy::ThisWorker, "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    let twice = a.close(ab, CloseMode::Force);
    assert!(
        matches!(twice.test(), Some(Err(Error::EndpointClosed { .. }))),
        "{:?}",
        twice.test()
    );
    // The new endpoint works.
    a.tag_send_wait(again, b"new", 1).unwrap();
    let _ = ba;
}

/// A dropped worker's ids are refused by a worker made after it (whose serial differs even
/// when it reuses the memory).
#[test]
fn an_id_of_a_dropped_worker_is_refused_by_a_later_one() {
    let (a, b, ab, _ba) = pair();
    let old = a.serial();
    drop(a);
    let c = Worker::new(&context()).unwrap();
    let cb = c.connect(&b.address()).unwrap();
    assert_eq!(cb.to_string(), ab.to_string());
    match c.tag_send_wait(ab, b"x", 1) {
        Err(Error::ForeignEndpoint { owner, worker, .. }) => {
            assert_eq!((owner, worker), (old, c.serial()))
        }
        other => panic!("{other:?}"),
    }
}

/// An active message's reply endpoint and a receive's sender are ids of the receiving worker.
#[test]
fn ids_handed_out_by_receives_and_active_messages_are_the_receivers() {
    let (a, b, ab, ba) = pair();
    let inbox: Arc<Mutex<Vec<AmMessage>>> = Arc::default();
    let to = inbox.clone();
    b.set_am_handler(4, move |_, m| to.lock().unwrap().push(m));
    a.am_send(ab, 4, b"hdr", b"body").unwrap();
    drive(&[&a, &b], || !inbox.lock().unwrap().is_empty());
    let mut msg = inbox.lock().unwrap().pop().unwrap();
    assert_eq!(msg.reply_ep, ba);
    assert!(matches!(msg.take_payload(), AmPayload::Here(_)));
    let mut got = [0u8; 2];
    b.scope(|s| {
        let r = s.tag_recv(&mut got[..], 0, 0);
        a.tag_send_wait(ab, b"hi", 2).unwrap();
        drive(&[&a, &b], || r.test().is_some());
        assert_eq!(r.test().unwrap().unwrap().sender, Some(ba));
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Workers connected at random: an id is accepted exactly by the worker that made it,
    /// and refused with `ForeignEndpoint` naming both serials by every other.
    #[test]
    fn an_id_works_on_its_worker_alone(
        links in proptest::collection::vec((0usize..3, 0usize..3), 1..6),
        uses in proptest::collection::vec((0usize..6, 0usize..3), 1..10),
    ) {
        let ws: Vec<Worker> = (0..3).map(|_| Worker::new(&context()).unwrap()).collect();
        let ids: Vec<(usize, EpId)> = links
            .iter()
            .map(|&(from, to)| (from, ws[from].connect(&ws[to].address()).unwrap()))
            .collect();
        for (i, on) in uses {
            let (made_by, id) = ids[i % ids.len()];
            let res = ws[on].lanes(id);
            if made_by == on {
                prop_assert!(res.is_ok(), "{res:?}");
            } else {
                match res {
                    Err(Error::ForeignEndpoint { owner, worker, .. }) => {
                        prop_assert_eq!(owner, ws[made_by].serial());
                        prop_assert_eq!(worker, ws[on].serial());
                    }
                    other => prop_assert!(false, "{:?}", other),
                }
            }
        }
    }
}
