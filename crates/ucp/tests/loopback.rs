//! UCP over the `self` transport inside one process: every protocol, every size class.

use rucx_ucp::{Context, TAG_MASK_ANY, TAG_MASK_FULL, Worker};
use rucx_ucs::{Config, Error};

fn worker(vars: &[(&str, &str)]) -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let mut all: Vec<(String, String)> = vec![("RUCX_TLS".into(), "self".into())];
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

const SIZES: &[usize] = &[0, 1, 8191, 8192, 8193, 65536, (1 << 20) + 3, 16 << 20];

fn exchange_all_sizes(w: &Worker) {
    let ep = w.connect(&w.address()).unwrap();
    for (i, &n) in SIZES.iter().enumerate() {
        let send = pattern(n, i as u8);
        let mut recv = vec![0xeeu8; n];
        let (s, r) = w.scope(|sc| {
            let r = sc.tag_recv(&mut recv, 100 + i as u64, TAG_MASK_FULL);
            let s = sc.tag_send(ep, &send, 100 + i as u64);
            (s.wait(), r.wait())
        });
        s.unwrap();
        let c = r.unwrap();
        assert_eq!(c.len, n);
        assert_eq!(c.tag, 100 + i as u64);
        assert!(recv == send, "size {n}: data differs");
    }
}

#[test]
fn every_size_default_protocols() {
    let w = worker(&[]);
    exchange_all_sizes(&w);
    let c = w.counters();
    assert!(
        c.keys().any(|k| k.contains("split")),
        "large messages are split: {c:?}"
    );
    let table = w.proto_info(w.connect(&w.address()).unwrap()).unwrap();
    assert!(
        table.contains("eager short") && table.contains("rendezvous"),
        "{table}"
    );
}

#[test]
fn every_size_each_rendezvous_scheme() {
    for (scheme, recv_side) in [
        ("get_zcopy", "rendezvous receive by read"),
        ("put_zcopy", "rendezvous receive by remote write"),
        ("am", "rendezvous receive streamed"),
    ] {
        let w = worker(&[("RUCX_RNDV_SCHEME", scheme), ("RUCX_RNDV_THRESH", "16K")]);
        exchange_all_sizes(&w);
        let c = w.counters();
        // 65536, 1 MiB + 3 and 16 MiB are rendezvous sizes.
        assert_eq!(c.get(recv_side).copied(), Some(3), "{scheme}: {c:?}");
        assert!(c.get("eager short").copied().unwrap_or(0) >= 2, "{c:?}");
    }
}

#[test]
fn unexpected_messages_then_receive() {
    let w = worker(&[("RUCX_RNDV_THRESH", "32K")]);
    let ep = w.connect(&w.address()).unwrap();
    let a = pattern(100, 1);
    let b = pattern(20000, 2);
    let c = pattern(100_000, 3);
    let mut ra = vec![0u8; 100];
    let mut rb = vec![0u8; 20000];
    let mut rc = vec![0u8; 100_000];
    w.scope(|s| {
        let sa = s.tag_send(ep, &a, 1);
        let sb = s.tag_send(ep, &b, 2);
        let sc = s.tag_send(ep, &c, 3);
        for _ in 0..100 {
            w.progress();
        }
        // Probe sees the oldest first for a wildcard.
        let p = w.probe(0, TAG_MASK_ANY).unwrap();
        assert_eq!((p.tag, p.len), (1, 100));
        // Receive in another order than sent.
        let r3 = s.tag_recv(&mut rc, 3, TAG_MASK_FULL);
        let r1 = s.tag_recv(&mut ra, 1, TAG_MASK_FULL);
        let r2 = s.tag_recv(&mut rb, 0, TAG_MASK_ANY);
        assert_eq!(r3.wait().unwrap().len, 100_000);
        assert_eq!(r1.wait().unwrap().len, 100);
        assert_eq!(r2.wait().unwrap().tag, 2);
        sa.wait().unwrap();
        sb.wait().unwrap();
        sc.wait().unwrap();
    });
    assert!(ra == a && rb == b && rc == c);
}

/// A cut message says how long it was and whose it was: a wildcard receive learns the
/// sender's tag from the error (eager, fragmented and rendezvous sizes; a receive posted
/// before the message, and one after it arrived).
#[test]
fn truncation_is_reported_and_nothing_overruns() {
    let w = worker(&[("RUCX_RNDV_THRESH", "64K")]);
    let ep = w.connect(&w.address()).unwrap();
    for (k, n) in [100usize, 20_000, 200_000].into_iter().enumerate() {
        for late in [false, true] {
            let send = pattern(n, 9);
            let mut recv = vec![0x55u8; n / 2 + 16];
            let cap = n / 2;
            let tag = 0x5_0000 + k as u64 + if late { 0x100 } else { 0 };
            let (s, r) = w.scope(|sc| {
                if late {
                    let s = sc.tag_send(ep, &send, tag);
                    while w.probe(0, TAG_MASK_ANY).is_none() {
                        w.progress();
                    }
                    let r = sc.tag_recv(&mut recv[..cap], 0, TAG_MASK_ANY);
                    (s.wait(), r.wait())
                } else {
                    let r = sc.tag_recv(&mut recv[..cap], 0, TAG_MASK_ANY);
                    let s = sc.tag_send(ep, &send, tag);
                    (s.wait(), r.wait())
                }
            });
            s.unwrap();
            match r {
                Err(Error::Truncated {
                    incoming,
                    capacity,
                    tag: t,
                }) => {
                    assert_eq!((incoming, capacity, t), (n, cap, Some(tag)), "late {late}");
                }
                other => panic!("size {n}: expected truncation, got {other:?}"),
            }
            assert_eq!(
                &recv[..cap],
                &send[..cap],
                "size {n}: the part that fits is delivered"
            );
            assert!(
                recv[cap..].iter().all(|&b| b == 0x55),
                "size {n}: nothing past the buffer"
            );
        }
    }
}

#[test]
fn unmatched_receive_is_canceled_at_scope_end() {
    let w = worker(&[]);
    let mut buf = vec![0u8; 10];
    let r = w.scope(|s| {
        let r = s.tag_recv(&mut buf, 77, TAG_MASK_FULL);
        assert!(r.cancel());
        r.wait()
    });
    assert!(matches!(r, Err(Error::Canceled)), "{r:?}");
}

#[test]
fn active_messages_small_and_large() {
    use std::sync::{Arc, Mutex};
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    type Got = Vec<(Vec<u8>, Vec<u8>)>;
    let got: Arc<Mutex<Got>> = Arc::default();
    let g = got.clone();
    w.set_am_handler(7, move |_w, m| g.lock().unwrap().push((m.header, m.data)));
    let big = pattern(100_000, 4);
    w.am_send(ep, 7, b"hdr", b"small").unwrap();
    w.am_send(ep, 7, b"h2", &big).unwrap();
    for _ in 0..1000 {
        w.progress();
        if got.lock().unwrap().len() == 2 {
            break;
        }
    }
    let got = got.lock().unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], (b"hdr".to_vec(), b"small".to_vec()));
    assert_eq!(got[1].0, b"h2".to_vec());
    assert!(got[1].1 == big);
}

#[test]
fn put_get_and_flush() {
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    let mut target = vec![0u8; 1 << 20];
    let map = w.mem_map(&mut target).unwrap();
    let rkey = w.rkey_unpack(ep, &map.pack_rkey()).unwrap();
    let data = pattern(300_000, 6);
    let mut back = vec![0u8; 300_000];
    w.scope(|s| {
        s.put(ep, &data, rkey.base() + 1000, &rkey).wait().unwrap();
        s.flush(ep).wait().unwrap();
        s.get(ep, &mut back, rkey.base() + 1000, &rkey)
            .wait()
            .unwrap();
        // Out of bounds is refused before anything moves.
        let e = s
            .put(ep, &data, rkey.base() + rkey.len() - 10, &rkey)
            .wait();
        assert!(e.is_err());
    });
    assert!(back == data);
    assert_eq!(&map.as_slice()[1000..301_000], &data[..]);
}

/// Puts and gets stay inside the region the peer mapped, even where the memory domain
/// registered more (whole pages): an access that runs past either end is refused and nothing
/// around the region is touched.
#[test]
fn remote_access_is_bounded_by_the_mapped_region_not_its_pages() {
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    // A 1000-byte region in the middle of a larger buffer: the bytes around it share its pages.
    let mut all = vec![0u8; 3 * 4096];
    let (before, rest) = all.split_at_mut(2000);
    let (region, after) = rest.split_at_mut(1000);
    let map = w.mem_map(region).unwrap();
    let rkey = w.rkey_unpack(ep, &map.pack_rkey()).unwrap();
    assert_eq!(rkey.len(), 1000);
    let data = pattern(300, 3);
    let cases = [
        (rkey.base() + 1000 - 10, 300u64),
        (rkey.base() + 1000, 1),
        (rkey.base() - 10, 300),
    ];
    let mut backs = vec![vec![0xeeu8; 300]; cases.len()];
    w.scope(|s| {
        for (&(remote, len), back) in cases.iter().zip(backs.iter_mut()) {
            let want = Error::OutOfBounds {
                addr: remote,
                len,
                base: rkey.base(),
                region_len: 1000,
            };
            let r = s.put(ep, &data[..len as usize], remote, &rkey);
            assert_eq!(r.wait().unwrap_err(), want, "put");
            let r = s.get(ep, &mut back[..len as usize], remote, &rkey);
            assert_eq!(r.wait().unwrap_err(), want, "get");
        }
        // The last bytes of the region are fine.
        s.put(ep, &data[..10], rkey.base() + 990, &rkey)
            .wait()
            .unwrap();
        s.flush(ep).wait().unwrap();
    });
    assert!(
        backs.concat().iter().all(|&b| b == 0xee),
        "a refused get wrote"
    );
    assert_eq!(&map.as_slice()[990..], &data[..10]);
    assert!(map.as_slice()[..990].iter().all(|&b| b == 0));
    drop(map);
    assert!(before.iter().all(|&b| b == 0), "written before the region");
    assert!(after.iter().all(|&b| b == 0), "written past the region");
}

#[test]
fn garbage_addresses_and_keys_are_errors() {
    let w = worker(&[]);
    assert!(w.connect(b"garbage").is_err());
    let mut a = w.address();
    a.truncate(a.len() - 3);
    assert!(w.connect(&a).is_err());
    let ep = w.connect(&w.address()).unwrap();
    assert!(w.rkey_unpack(ep, b"nonsense").is_err());
}

#[test]
fn registration_failure_demotes_and_the_transfer_still_completes() {
    // The self domain fails every registration after the first 2: zero-copy and rendezvous
    // paths must fall back to copies, with every byte intact and the demotion recorded.
    let w = worker(&[
        ("RUCX_FAULT_INJECT", "md=self,mem=host,after=2"),
        ("RUCX_RNDV_THRESH", "16K"),
    ]);
    exchange_all_sizes(&w);
    let c = w.counters();
    assert_eq!(c.get("rendezvous receive by read"), None, "{c:?}");
    let d = w.context_demotions();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].md, "self");
    assert!(d[0].knob.contains("RUCX_REG_SKIP=self:host"), "{:?}", d[0]);
    // The table was re-planned without zero-copy.
    let t = w.proto_table(w.connect(&w.address()).unwrap()).unwrap();
    assert!(t.iter().all(|r| !r.proto.is_zcopy()), "{t:?}");
}

#[test]
fn a_buffer_refusal_keeps_the_domain_and_later_transfers_stay_zero_copy() {
    // One registration of the self domain is refused as "cannot be exported", a property of
    // that buffer: the buffer's transfer takes another path, the domain is not demoted, and the
    // later rendezvous still read zero-copy.
    let w = worker(&[
        (
            "RUCX_FAULT_INJECT",
            "md=self,mem=host,after=1,times=1,kind=not_exportable",
        ),
        ("RUCX_RNDV_SCHEME", "get_zcopy"),
        ("RUCX_RNDV_THRESH", "16K"),
        ("RUCX_ZCOPY_THRESH", "inf"),
    ]);
    exchange_all_sizes(&w);
    assert!(
        w.context_demotions().is_empty(),
        "{:?}",
        w.context_demotions()
    );
    let r = w.context_refusals();
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!((r[0].md.as_str(), r[0].count), ("self", 1));
    let c = w.counters();
    // 64 KiB, 1 MiB + 3 and 16 MiB are rendezvous sizes; one of them met the refusal.
    let reads = c.get("rendezvous receive by read").copied().unwrap_or(0);
    assert!(reads >= 2, "{c:?}");
    let t = w.proto_table(w.connect(&w.address()).unwrap()).unwrap();
    assert!(t.iter().any(|r| r.proto.is_zcopy()), "{t:?}");
    // And every later message reads zero-copy.
    let before = reads;
    exchange_all_sizes(&w);
    let after = w.counters()["rendezvous receive by read"];
    assert_eq!(after, before + 3);
}

#[test]
fn a_bad_address_demotes_the_domain_once() {
    let w = worker(&[
        ("RUCX_FAULT_INJECT", "md=self,mem=host,after=1,times=1"),
        ("RUCX_RNDV_SCHEME", "get_zcopy"),
        ("RUCX_RNDV_THRESH", "16K"),
        ("RUCX_ZCOPY_THRESH", "inf"),
    ]);
    exchange_all_sizes(&w);
    let d = w.context_demotions();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].md.as_str(), d[0].device), ("self", None));
    assert!(w.context_refusals().is_empty());
    // Demoted: no later read, although the domain would register again.
    let c = w.counters();
    exchange_all_sizes(&w);
    assert_eq!(
        w.counters().get("rendezvous receive by read"),
        c.get("rendezvous receive by read")
    );
}

#[test]
fn budget_exhaustion_evicts_then_demotes_and_completes() {
    let w = worker(&[
        ("RUCX_FAULT_INJECT", "md=self,mem=host,budget=1M"),
        ("RUCX_RNDV_THRESH", "16K"),
    ]);
    exchange_all_sizes(&w);
    assert!(w.context_demotions().iter().any(|d| d.md == "self"));
}

#[test]
fn reg_skip_disables_a_domain_up_front() {
    let w = worker(&[("RUCX_REG_SKIP", "self:host")]);
    let ep = w.connect(&w.address()).unwrap();
    let t = w.proto_table(ep).unwrap();
    assert!(t.iter().all(|r| !r.proto.is_zcopy()), "{t:?}");
    exchange_all_sizes(&w);
}

#[test]
fn path_query_explains_what_is_missing() {
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    let paths = w.path_query(ep, Some(0)).unwrap();
    let hh = &paths[0];
    assert!(hh.zero_copy && hh.why_not.is_empty(), "{hh}");
    let gg = paths
        .iter()
        .find(|p| p.send_mem.is_gpu() && p.recv_mem.is_gpu())
        .unwrap();
    assert!(!gg.zero_copy);
    assert!(
        gg.why_not
            .iter()
            .any(|w| w.contains("registers GPU memory")),
        "{gg}"
    );
    assert!(gg.why_not.iter().any(|w| w.contains("cuda_copy")), "{gg}");
    // A host demotion shows in the host path.
    let w = worker(&[("RUCX_REG_SKIP", "self:host")]);
    let ep = w.connect(&w.address()).unwrap();
    let hh = &w.path_query(ep, None).unwrap()[0];
    assert!(
        !hh.zero_copy && hh.why_not.iter().any(|x| x.contains("demotions")),
        "{hh}"
    );
}

#[test]
fn client_server_wire_up_through_a_listener() {
    use std::sync::mpsc;
    use std::time::Duration;
    let (tx, rx) = mpsc::channel();
    let server = std::thread::spawn(move || {
        let w = worker(&[("RUCX_TLS", "posix")]);
        let l = w.listen("127.0.0.1:0").unwrap();
        tx.send(l.local_addr()).unwrap();
        let ep = loop {
            if let Some(ep) = w.accept(&l).unwrap() {
                break ep;
            }
            w.progress();
        };
        let mut buf = vec![0u8; 100_000];
        let c = w.tag_recv_wait(&mut buf, 9, TAG_MASK_FULL).unwrap();
        assert_eq!(c.sender, Some(ep));
        assert!(buf == pattern(100_000, 3));
        w.tag_send_wait(ep, b"bye", 10).unwrap();
    });
    let w = worker(&[("RUCX_TLS", "posix")]);
    let addr = rx.recv().unwrap();
    let ep = w.connect_sockaddr(addr, Duration::from_secs(10)).unwrap();
    w.tag_send_wait(ep, &pattern(100_000, 3), 9).unwrap();
    let mut bye = [0u8; 3];
    w.tag_recv_wait(&mut bye, 10, TAG_MASK_FULL).unwrap();
    assert_eq!(&bye, b"bye");
    server.join().unwrap();
}

#[test]
fn requests_can_be_awaited() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context as Cx, Poll, Waker};
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    let data = pattern(50_000, 5);
    let mut got = vec![0u8; 50_000];
    w.scope(|s| {
        let mut r = pin!(s.tag_recv(&mut got, 4, TAG_MASK_FULL));
        let mut sd = pin!(s.tag_send(ep, &data, 4));
        let mut cx = Cx::from_waker(Waker::noop());
        let (mut a, mut b) = (None, None);
        for _ in 0..100_000 {
            if a.is_none()
                && let Poll::Ready(x) = sd.as_mut().poll(&mut cx)
            {
                a = Some(x);
            }
            if b.is_none()
                && let Poll::Ready(x) = r.as_mut().poll(&mut cx)
            {
                b = Some(x);
            }
            if a.is_some() && b.is_some() {
                break;
            }
        }
        a.expect("send finished").unwrap();
        assert_eq!(b.expect("receive finished").unwrap().len, 50_000);
    });
    assert!(got == data);
}

/// Requests leave the worker's table when their scope ends: finished, failed (truncated) and
/// canceled ones alike, and a request id of an ended scope finds nothing afterwards.
#[test]
fn scopes_release_every_request() {
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    assert_eq!(w.live_requests(), 0);
    for round in 0..50u64 {
        let n = [8usize, 9000, 300_000][round as usize % 3];
        let send = pattern(n, round as u8);
        let mut recv = vec![0u8; n];
        let mut short = vec![0u8; 4];
        let mut never = vec![0u8; 16];
        w.scope(|sc| {
            let r = sc.tag_recv(&mut recv, round, TAG_MASK_FULL);
            let t = sc.tag_recv(&mut short, 1 << 40, TAG_MASK_FULL);
            // Never sent: canceled when the scope ends.
            let _pending = sc.tag_recv(&mut never, 1 << 41, TAG_MASK_FULL);
            sc.tag_send(ep, &send, round).wait().unwrap();
            sc.tag_send(ep, &send[..n.min(16)], 1 << 40).wait().unwrap();
            assert_eq!(r.wait().unwrap().len, n);
            assert!(matches!(t.wait(), Err(Error::Truncated { .. })));
            assert!(
                w.live_requests() >= 1,
                "the pending receive is live in its scope"
            );
        });
        assert_eq!(w.live_requests(), 0, "round {round}: requests leaked");
        assert!(recv == send);
    }
}

/// A synchronous send completes only once a receive matched it, at every size class (one eager
/// message with an acknowledgement, multi-fragment sizes and rendezvous), whether the receive
/// comes late (the message waits as unexpected) or was posted first.
#[test]
fn synchronous_send_completes_after_the_match() {
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    for (i, &n) in [0usize, 8, 5000, 100_000, 1 << 20].iter().enumerate() {
        let send = pattern(n, i as u8);
        let mut recv = vec![0u8; n];
        let tag = 500 + i as u64;
        w.scope(|sc| {
            let s = sc.tag_send_sync(ep, &send, tag);
            for _ in 0..2000 {
                w.progress();
            }
            assert!(s.test().is_none(), "{n} B: completed before any receive");
            let r = sc.tag_recv(&mut recv, tag, TAG_MASK_FULL);
            assert_eq!(s.wait().unwrap().len, n);
            assert_eq!(r.wait().unwrap().len, n);
        });
        assert!(recv == send, "{n} B: data differs");
        // Receive posted first.
        let mut again = vec![0u8; n];
        w.scope(|sc| {
            let r = sc.tag_recv(&mut again, tag, TAG_MASK_FULL);
            sc.tag_send_sync(ep, &send, tag).wait().unwrap();
            assert_eq!(r.wait().unwrap().len, n);
        });
        assert!(again == send, "{n} B: data differs (receive first)");
    }
    assert_eq!(w.live_requests(), 0);
    let c = w.counters();
    // Small synchronous sends are one eager message whose match is acknowledged.
    let sync_eager = rucx_ucp::proto::Proto::EagerSync.name();
    assert!(c.get(sync_eager).copied().unwrap_or(0) >= 4, "{c:?}");
}

/// The stream API keeps the bytes and their order, not message boundaries: sends of assorted
/// sizes are read back through receives of other sizes, and a receive left waiting at the end
/// of its scope gives the bytes it took back to the stream.
#[test]
fn stream_bytes_in_order_any_split() {
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    let sizes = [0usize, 1, 100, 9000, 100_000, 3];
    let all: Vec<u8> = (0..sizes.iter().sum::<usize>())
        .map(|i| (i * 7 + i / 251) as u8)
        .collect();
    let mut off = 0;
    for &n in &sizes {
        let piece = all[off..off + n].to_vec();
        w.scope(|sc| assert_eq!(sc.stream_send(ep, &piece).wait().unwrap().len, n));
        off += n;
    }
    // The first 2000 bytes span the first four sends.
    let mut big = vec![0u8; 2000];
    w.scope(|sc| assert_eq!(sc.stream_recv(ep, &mut big).wait().unwrap().len, 2000));
    assert!(big[..] == all[..2000]);
    // ...the rest through receives of odd sizes, the last one left waiting for more.
    let mut got = big;
    let mut never = vec![0u8; 500];
    let rest = all.len() - 2000;
    let mut parts: Vec<Vec<u8>> = [7usize, 33, 4096, 65536]
        .iter()
        .map(|&n| vec![0u8; n])
        .collect();
    let tail = rest - parts.iter().map(Vec::len).sum::<usize>();
    parts.push(vec![0u8; tail - 100]);
    w.scope(|sc| {
        let rs: Vec<_> = parts.iter_mut().map(|b| sc.stream_recv(ep, b)).collect();
        // 100 bytes remain for this one, which wants 500: left waiting, canceled at the end.
        let _waiting = sc.stream_recv(ep, &mut never);
        for r in rs {
            r.wait().unwrap();
        }
    });
    for p in &parts {
        got.extend_from_slice(p);
    }
    // The 100 bytes the canceled receive took are back in the stream.
    let mut last = vec![0u8; 100];
    w.scope(|sc| assert_eq!(sc.stream_recv(ep, &mut last).wait().unwrap().len, 100));
    got.extend_from_slice(&last);
    assert!(got == all, "stream bytes differ");
    // Receives posted before the bytes come are filled straight from the arriving pieces; one
    // left half-filled gives its bytes back.
    let fresh: Vec<u8> = (0..20_600u32).map(|i| (i % 253) as u8).collect();
    let mut first = vec![0u8; 20_000];
    let mut partial = vec![0u8; 1000];
    w.scope(|sc| {
        let r1 = sc.stream_recv(ep, &mut first);
        let _r2 = sc.stream_recv(ep, &mut partial);
        sc.stream_send(ep, &fresh).wait().unwrap();
        assert_eq!(r1.wait().unwrap().len, 20_000);
    });
    assert!(first[..] == fresh[..20_000]);
    let mut rest = vec![0u8; 600];
    w.scope(|sc| assert_eq!(sc.stream_recv(ep, &mut rest).wait().unwrap().len, 600));
    assert!(
        rest[..] == fresh[20_000..],
        "bytes of the canceled receive lost"
    );
    // A zero-byte receive completes at once, even behind a waiting one.
    let mut one = [0u8; 1];
    let mut none = [0u8; 0];
    w.scope(|sc| {
        let _w = sc.stream_recv(ep, &mut one[..]);
        assert_eq!(sc.stream_recv(ep, &mut none[..]).wait().unwrap().len, 0);
    });
    // An explicit cancel of a waiting receive.
    w.scope(|sc| {
        let r = sc.stream_recv(ep, &mut one[..]);
        assert!(r.cancel());
        assert!(matches!(r.wait(), Err(Error::Canceled)));
    });
    assert_eq!(w.live_requests(), 0);
}

/// A demotion re-plans the endpoint and a lane that was not in use before can win: with `self`
/// refused for host registrations at run time, rendezvous reads move to `posix` (zero-copy
/// still) instead of falling back to copies, and the query says so.
#[test]
fn demotion_replans_onto_the_next_best_lane() {
    let w = worker(&[
        ("RUCX_TLS", "self,posix"),
        ("RUCX_FAULT_INJECT", "md=self,mem=host,after=0"),
        ("RUCX_RNDV_THRESH", "16K"),
    ]);
    let ep = w.connect(&w.address()).unwrap();
    let before = w.plan(ep).unwrap();
    assert!(
        before
            .lane_name(before.lanes.rma.unwrap())
            .starts_with("self/")
    );
    exchange_all_sizes(&w);
    let d = w.context_demotions();
    assert!(d.iter().any(|d| d.md == "self"), "{d:?}");
    let after = w.plan(ep).unwrap();
    assert_eq!(after.lanes.am, before.lanes.am, "the AM lane never moves");
    assert!(
        after
            .lane_name(after.lanes.rma.unwrap())
            .starts_with("posix/")
    );
    let c = w.counters();
    assert!(
        c.get("rendezvous receive by read").copied().unwrap_or(0)
            + c.get("rendezvous receive split: read head, remote writes tail")
                .copied()
                .unwrap_or(0)
            >= 1,
        "{c:?}"
    );
    // What the query reports is what the plan does.
    let hh = &w.path_query(ep, None).unwrap()[0];
    assert!(hh.zero_copy && hh.lane.starts_with("posix/"), "{hh}");
    let last = w.proto_table(ep).unwrap().last().unwrap().clone();
    assert_eq!(hh.protocol, last.proto.name());
}

/// A failed request reports one error however it is looked at: `test`, `wait` and `.await` give
/// the very error it had, whether it was refused when posted (an endpoint this worker does not
/// have, a put out of the remote region) or failed later (a truncated receive).
#[test]
fn a_failed_request_reports_the_same_error_to_test_wait_and_await() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context as Cx, Poll, Waker};

    let w = worker(&[]);
    // An endpoint id from another worker: `w` has no endpoint at all.
    let other = worker(&[]);
    let stranger = other.connect(&other.address()).unwrap();
    let data = pattern(300, 9);
    let mut into = vec![0u8; 300];
    w.scope(|s| {
        for r in [
            s.tag_send(stranger, &data, 1),
            s.tag_send_sync(stranger, &data, 1),
            s.stream_send(stranger, &data),
        ] {
            let tested = r
                .test()
                .expect("a refused request is finished")
                .unwrap_err();
            assert!(
                matches!(&tested, Error::ForeignEndpoint { ep, .. } if ep == "ep0"),
                "{tested:?}"
            );
            assert_eq!(r.test().unwrap().unwrap_err(), tested, "test twice");
            assert_eq!(r.wait().unwrap_err(), tested, "test vs wait");
        }
        let r = s.stream_recv(stranger, &mut into);
        let tested = r.test().expect("refused").unwrap_err();
        assert_eq!(r.wait().unwrap_err(), tested);
        // Awaited: the same error, on this poll and on any later one.
        let mut fut = pin!(s.tag_send(stranger, &data, 2));
        let tested = fut.test().expect("refused").unwrap_err();
        let mut cx = Cx::from_waker(Waker::noop());
        for _ in 0..2 {
            match fut.as_mut().poll(&mut cx) {
                Poll::Ready(Err(e)) => assert_eq!(e, tested),
                other => panic!("{other:?}"),
            }
        }
    });

    let ep = w.connect(&w.address()).unwrap();
    let mut target = vec![0u8; 4096];
    let map = w.mem_map(&mut target).unwrap();
    let rkey = w.rkey_unpack(ep, &map.pack_rkey()).unwrap();
    let mut short = vec![0u8; 10];
    w.scope(|s| {
        // Refused when posted: out of the remote region (and of the pages around it).
        let r = s.put(ep, &data, rkey.base() + rkey.len() + 8192, &rkey);
        let tested = r.test().expect("refused").unwrap_err();
        assert!(matches!(tested, Error::OutOfBounds { .. }), "{tested:?}");
        assert_eq!(r.wait().unwrap_err(), tested);
        // Failed in flight: 300 bytes for a 10-byte receive.
        let r = s.tag_recv(&mut short, 3, TAG_MASK_FULL);
        s.tag_send(ep, &data, 3).wait().unwrap();
        let tested = loop {
            match r.test() {
                Some(res) => break res.unwrap_err(),
                None => {
                    w.progress();
                }
            }
        };
        assert_eq!(
            tested,
            Error::Truncated {
                incoming: 300,
                capacity: 10,
                tag: Some(3),
            }
        );
        assert_eq!(r.wait().unwrap_err(), tested);
    });
    assert_eq!(w.live_requests(), 0);
}

/// Two workers of one process exchange through `wait_all`, which progresses both: a rendezvous
/// between them cannot finish when only the sender's worker is progressed. `wait_any` reports
/// the first to finish, and a bounded wait on a receive nothing matches times out, leaving it
/// cancelable.
#[test]
fn two_workers_in_one_process_through_wait_all() {
    use rucx_ucp::{wait_all, wait_any, wait_any_timeout};
    let a = worker(&[("RUCX_TLS", "posix"), ("RUCX_RNDV_THRESH", "16K")]);
    let b = worker(&[("RUCX_TLS", "posix"), ("RUCX_RNDV_THRESH", "16K")]);
    let ab = a.connect(&b.address()).unwrap();
    let n = 1 << 20;
    let send = pattern(n, 9);
    let mut recv = vec![0u8; n];
    let results = a.scope(|sa| {
        b.scope(|sb| {
            let r = sb.tag_recv(&mut recv, 3, TAG_MASK_FULL);
            let s = sa.tag_send(ab, &send, 3);
            wait_all(&[&s, &r])
        })
    });
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].as_ref().unwrap().len, n);
    assert_eq!(results[1].as_ref().unwrap().len, n);
    assert!(recv == send);
    let mut small = vec![0u8; 8];
    let mut never = vec![0u8; 8];
    a.scope(|sa| {
        b.scope(|sb| {
            let stuck = sb.tag_recv(&mut never, 77, TAG_MASK_FULL);
            let r = sb.tag_recv(&mut small, 4, TAG_MASK_FULL);
            let s = sa.tag_send(ab, &send[..8], 4);
            let (i, res) = wait_any(&[&stuck, &r]).unwrap();
            assert_eq!(i, 1, "the receive that matched finishes first");
            assert_eq!(res.unwrap().len, 8);
            s.wait().unwrap();
            match wait_any_timeout(&[&stuck], Some(std::time::Duration::from_millis(50))) {
                Err(Error::Timeout { .. }) => {}
                other => panic!("a receive nothing matches: {other:?}"),
            }
            assert!(stuck.cancel());
        })
    });
    assert_eq!(small, send[..8]);
    assert_eq!(a.live_requests() + b.live_requests(), 0);
}

/// A message that arrives before its receive and is larger than what can be allocated to keep
/// it (the allocation failure injected) fails that receive with `NoMemory`, not the process;
/// messages that fit, before and after it, are received whole, and the worker stays usable.
#[test]
fn an_unexpected_message_too_large_to_keep_fails_its_receive_cleanly() {
    // Multi-fragment eager messages, and single-packet synchronous ones (larger synchronous
    // sends take the rendezvous, which needs no buffer at the receiver).
    for (sync, limit, big_len, after_len) in [
        (false, 50_000, 200_000, 40_000),
        (true, 4_000, 8_000, 3_000),
    ] {
        let w = worker(&[("RUCX_RNDV_THRESH", "1M")]);
        let ep = w.connect(&w.address()).unwrap();
        w.inject_alloc_limit(Some(limit));
        let small = pattern(1000, 1);
        let big = pattern(big_len, 2);
        let after = pattern(after_len, 3);
        let (mut r1, mut r2, mut r3) = (vec![0u8; 1000], vec![0u8; big_len], vec![0u8; after_len]);
        w.scope(|s| {
            let send = |b, t| {
                if sync {
                    s.tag_send_sync(ep, b, t)
                } else {
                    s.tag_send(ep, b, t)
                }
            };
            let s1 = send(&small, 1);
            let s2 = send(&big, 2);
            let s3 = send(&after, 3);
            for _ in 0..1000 {
                w.progress();
            }
            // Every message arrived unexpected; the big one could not be kept.
            assert_eq!(w.probe(2, TAG_MASK_FULL).map(|c| c.len), Some(big_len));
            let g2 = s.tag_recv(&mut r2, 2, TAG_MASK_FULL);
            let g1 = s.tag_recv(&mut r1, 1, TAG_MASK_FULL);
            let g3 = s.tag_recv(&mut r3, 3, TAG_MASK_FULL);
            let e = g2.wait().unwrap_err();
            assert!(
                matches!(&e, Error::NoMemory(m) if m.contains(&format!("{big_len}-byte"))),
                "{e}"
            );
            assert_eq!(g1.wait().unwrap().len, 1000);
            assert_eq!(g3.wait().unwrap().len, after_len);
            // The sender's side is unaffected: its messages were sent (and matched).
            s1.wait().unwrap();
            s2.wait().unwrap();
            s3.wait().unwrap();
        });
        assert!(r1 == small && r3 == after, "sync {sync}");
        assert!(
            r2.iter().all(|&b| b == 0),
            "nothing of the dropped message was written"
        );
        // The worker goes on; a receive posted first needs no buffer of the library at all.
        let mut r = vec![0u8; big_len];
        w.scope(|s| {
            let g = s.tag_recv(&mut r, 9, TAG_MASK_FULL);
            s.tag_send(ep, &big, 9).wait().unwrap();
            assert_eq!(g.wait().unwrap().len, big_len);
        });
        assert!(r == big);
        assert_eq!(w.live_requests(), 0);
    }
}

/// A user active message larger than what can be allocated is dropped with a warning; the
/// next ones arrive.
#[test]
fn an_active_message_too_large_to_keep_is_dropped_and_the_next_arrive() {
    use std::sync::{Arc, Mutex};
    let w = worker(&[]);
    let ep = w.connect(&w.address()).unwrap();
    w.inject_alloc_limit(Some(50_000));
    let got: Arc<Mutex<Vec<usize>>> = Arc::default();
    let g = got.clone();
    w.set_am_handler(7, move |_w, m| g.lock().unwrap().push(m.data.len()));
    w.am_send(ep, 7, b"h", &pattern(200_000, 1)).unwrap();
    w.am_send(ep, 7, b"h", &pattern(30_000, 2)).unwrap();
    w.am_send(ep, 7, b"h", b"small").unwrap();
    for _ in 0..1000 {
        w.progress();
        if got.lock().unwrap().len() == 2 {
            break;
        }
    }
    assert_eq!(*got.lock().unwrap(), vec![30_000, 5]);
}
