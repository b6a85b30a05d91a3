//! Behavior at the edges, in one process over `lo`: malformed frames close only the offending
//! connection, refused remote accesses, back-pressure, connection failures, endpoint teardown.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::progress_until;
use rucx_uct::conformance::{Side, ep_params_from_hex, pattern};
use rucx_uct::iface::pack_bytes;
use rucx_uct::{EpParams, Event, Iov, MemRegion, OpStatus};
use rucx_uct_tcp::addr::{DevAddr, unpack_iface_addr};
use rucx_uct_tcp::wire::{self, Kind};

fn listen_addr(side: &Side) -> SocketAddr {
    let ip = DevAddr::unpack(&side.iface.device_address()).unwrap().ip;
    SocketAddr::from((ip, unpack_iface_addr(&side.iface.iface_address()).unwrap()))
}

fn params(to: &Side, user_id: u64) -> EpParams {
    ep_params_from_hex(&to.address_hex(), user_id).unwrap()
}

/// Send AMs from `a` to `b` and check they arrive intact: the interface still works.
fn check_am_path(a: &mut Side, b: &mut Side, tag: u64) {
    let mut ep = a.iface.create_ep(&params(b, 1)).unwrap();
    for i in 0..10u64 {
        ep.am_short(5, tag + i, b"still fine").unwrap();
    }
    let mut seen = 0u64;
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "AMs on the healthy connection",
        |_, ev| {
            match ev {
                Event::Am { id: 5, data } => {
                    assert_eq!(
                        u64::from_le_bytes(data[..8].try_into().unwrap()),
                        tag + seen
                    );
                    assert_eq!(&data[8..], b"still fine");
                    seen += 1;
                }
                other => panic!("unexpected {other:?}"),
            }
            (seen == 10).then_some(())
        },
    );
}

/// Drive `side` until the raw peer sees the connection closed; returns what it read.
fn read_until_closed(side: &mut Side, s: &mut TcpStream) -> Vec<u8> {
    s.set_nonblocking(true).unwrap();
    let mut got = Vec::new();
    let start = Instant::now();
    loop {
        side.iface
            .progress(&mut |ev| panic!("no event expected from a malformed connection: {ev:?}"));
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("{e}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "hang guard: connection never closed"
        );
    }
}

#[test]
fn malformed_frames_close_only_that_connection() {
    let mut a = common::open_lo().unwrap();
    let mut b = common::open_lo().unwrap();
    // A healthy endpoint b -> a, connected before the attacks, must survive them.
    let mut healthy = b.iface.create_ep(&params(&a, 9)).unwrap();
    healthy.am_short(6, 1, b"before").unwrap();
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "first AM",
        |_, ev| match ev {
            Event::Am { id: 6, .. } => Some(()),
            other => panic!("unexpected {other:?}"),
        },
    );

    // A raw client announcing a listening address on its own IP (as a real peer would).
    let hello = wire::hello_frame(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1));
    let mut bad_mark = wire::header(Kind::Am, 1, 0).to_vec();
    bad_mark[6] ^= 0xff;
    let mut huge = wire::header(Kind::Am, 1, 0).to_vec();
    huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut unknown = wire::header(Kind::Ack, 0, 8).to_vec();
    unknown[4] = 0x77;
    unknown.extend_from_slice(&[0; 8]);
    let mut bad_am_id = wire::header(Kind::Am, 0, 0).to_vec();
    bad_am_id[5] = 64;
    let mut bad_hello = hello.clone();
    bad_hello[8] ^= 1;
    let reply_kind = wire::words_frame(Kind::Ack, &[1], &[]);
    let spoofed = wire::hello_frame(SocketAddrV4::new(Ipv4Addr::new(10, 9, 8, 7), 1));
    let big_get = wire::words_frame(Kind::GetReq, &[1, 2, 3, 4, u64::MAX], &[]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("bad mark", [hello.clone(), bad_mark].concat()),
        ("length past the limit", [hello.clone(), huge].concat()),
        ("unknown kind", [hello.clone(), unknown].concat()),
        ("am id out of range", [hello.clone(), bad_am_id].concat()),
        ("bad hello", bad_hello),
        (
            "frame before hello",
            wire::words_frame(Kind::Flush, &[1], &[]),
        ),
        (
            "ack with no request outstanding",
            [hello.clone(), reply_kind].concat(),
        ),
        ("hello announcing another host", spoofed),
        ("second hello", [hello.clone(), hello.clone()].concat()),
        ("oversized get", [hello.clone(), big_get].concat()),
        ("text", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
    ];
    for (name, bytes) in cases {
        let mut s = TcpStream::connect(listen_addr(&a)).unwrap();
        s.write_all(&bytes).unwrap();
        let got = read_until_closed(&mut a, &mut s);
        // The interface said hello, then why it closes: a Fatal frame.
        let h = wire::parse_header(got[..8].try_into().unwrap()).unwrap();
        assert_eq!(h.kind, Kind::Hello, "{name}");
        let rest = &got[8 + h.body_len..];
        assert!(rest.len() > wire::HDR_LEN, "{name}: no fatal frame");
        let h = wire::parse_header(rest[..8].try_into().unwrap()).unwrap();
        assert_eq!(h.kind, Kind::Fatal, "{name}");
        println!(
            "{name}: {}",
            String::from_utf8_lossy(&rest[9..8 + h.body_len])
        );
    }
    // A connection that says nothing is left alone (until the hello timeout), a truncated frame
    // just waits for more bytes: neither disturbs anyone.
    let _quiet = TcpStream::connect(listen_addr(&a)).unwrap();
    let mut partial = TcpStream::connect(listen_addr(&a)).unwrap();
    partial
        .write_all(&[hello.clone(), wire::header(Kind::Am, 1, 100).to_vec()].concat())
        .unwrap();

    // The healthy endpoint and new ones still work.
    healthy.am_short(6, 2, b"after").unwrap();
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "AM after the attacks",
        |_, ev| match ev {
            Event::Am { id: 6, data } => {
                assert_eq!(&data[8..], b"after");
                Some(())
            }
            other => panic!("unexpected {other:?}"),
        },
    );
    check_am_path(&mut b, &mut a, 100);
}

/// A fake server that accepts an endpoint's connection and answers with `reply`.
fn fake_server_case(name: &str, reply: Vec<u8>) {
    let mut a = common::open_lo().unwrap();
    let mut good_peer = common::open_lo().unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut fake = params(&a, 3);
    fake.iface_addr = rucx_uct_tcp::addr::pack_iface_addr(port);
    let mut ep = a.iface.create_ep(&fake).unwrap();
    let token = 41;
    assert_eq!(
        ep.flush(token).unwrap(),
        OpStatus::Done,
        "nothing posted yet"
    );
    ep.am_short(1, 0, b"x").unwrap();
    assert_eq!(ep.flush(token).unwrap(), OpStatus::InProgress);
    let (mut s, _) = l.accept().unwrap();
    let hello = wire::hello_frame(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    s.write_all(&[hello, reply].concat()).unwrap();
    let mut got_completion = false;
    let err = progress_until(&mut [&mut a.iface], "endpoint error", |_, ev| match ev {
        Event::Completion { token: 41, result } => {
            assert!(result.is_err(), "{name}: flush must fail");
            got_completion = true;
            None
        }
        Event::EpError { user_id: 3, error } => Some(error.to_string()),
        other => panic!("unexpected {other:?}"),
    });
    assert!(
        got_completion,
        "{name}: the pending flush completes (with an error) before or with the endpoint error"
    );
    println!("{name}: {err}");
    assert!(
        err.contains("protocol") || err.contains("peer"),
        "{name}: {err}"
    );
    assert!(
        ep.am_short(1, 0, b"x").is_err(),
        "a failed endpoint refuses new work"
    );
    // The same interface still reaches a healthy peer.
    check_am_path(&mut a, &mut good_peer, 7);
}

#[test]
fn malformed_replies_fail_only_that_endpoint() {
    fake_server_case(
        "ack for an unknown request",
        wire::words_frame(Kind::Ack, &[12345], &[]),
    );
    fake_server_case(
        "second hello",
        wire::hello_frame(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1)),
    );
    fake_server_case("garbage", b"\xff\xff\xff\xff\xff\xff\xff\xff".to_vec());
    fake_server_case(
        "get reply for a flush",
        wire::words_frame(Kind::GetRep, &[1], &[]),
    );
    fake_server_case("fatal", wire::fatal_frame(wire::code::PROTOCOL, "go away"));
}

#[test]
fn access_to_a_dropped_registration_is_refused_and_the_connection_lives() {
    let mut a = common::open_lo().unwrap();
    let mut b = common::open_lo().unwrap();
    let target = vec![0u8; 4096];
    // SAFETY: `target` outlives the handle.
    let th = unsafe { b.md.mem_reg(MemRegion::of_slice(&target)) }.unwrap();
    let rkey = a.md.rkey_unpack(&b.md.mkey_pack(&th).unwrap()).unwrap();
    drop(th); // deregistered: the key is stale now
    let src = pattern(3, 64);
    // SAFETY: `src` outlives the handle.
    let sh = unsafe { a.md.mem_reg(MemRegion::of_slice(&src)) }.unwrap();
    let mut ep = a.iface.create_ep(&params(&b, 1)).unwrap();
    let base = target.as_ptr() as u64;
    assert_eq!(
        ep.put_zcopy(&[Iov::whole(&sh)], base, &rkey, 1).unwrap(),
        OpStatus::InProgress
    );
    let dst = vec![0u8; 64];
    // SAFETY: `dst` outlives the handle.
    let dh = unsafe { a.md.mem_reg(MemRegion::of_slice(&dst)) }.unwrap();
    assert_eq!(
        ep.get_zcopy(&[Iov::whole(&dh)], base, &rkey, 2).unwrap(),
        OpStatus::InProgress
    );
    let mut errs = Vec::new();
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "refusals",
        |_, ev| match ev {
            Event::Completion { token, result } => {
                errs.push((
                    token,
                    result.expect_err("a stale key is refused").to_string(),
                ));
                (errs.len() == 2).then_some(())
            }
            other => panic!("unexpected {other:?}"),
        },
    );
    for (t, e) in &errs {
        println!("token {t}: {e}");
        assert!(e.contains("not live"), "{e}");
    }
    assert!(
        target.iter().all(|b| *b == 0),
        "refused put never touched memory"
    );
    assert!(dst.iter().all(|b| *b == 0));
    // The connection is still usable.
    ep.am_bcopy(2, &mut pack_bytes(b"ok")).unwrap();
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "AM after refusals",
        |_, ev| match ev {
            Event::Am { id: 2, data } => {
                assert_eq!(data, b"ok");
                Some(())
            }
            other => panic!("unexpected {other:?}"),
        },
    );
    // A refused put_short has no completion to carry the error, so it fails the endpoint.
    ep.put_short(b"abc", base, &rkey).unwrap();
    let e = progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "endpoint error",
        |_, ev| match ev {
            Event::EpError { user_id: 1, error } => Some(error.to_string()),
            other => panic!("unexpected {other:?}"),
        },
    );
    assert!(e.contains("put_short"), "{e}");
}

#[test]
fn back_pressure_then_everything_arrives_in_order() {
    let mut a =
        common::open_side_on("lo", &[("TCP_TX_QUEUE", "256K"), ("TCP_SNDBUF", "64K")]).unwrap();
    let mut b = common::open_side_on("lo", &[("TCP_RCVBUF", "64K")]).unwrap();
    let mut ep = a.iface.create_ep(&params(&b, 1)).unwrap();
    // Let the connection come up, then stop progressing the receiver.
    ep.am_short(1, u64::MAX, &[]).unwrap();
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "first AM",
        |_, ev| match ev {
            Event::Am { .. } => Some(()),
            other => panic!("unexpected {other:?}"),
        },
    );
    let msg = vec![7u8; 8192];
    let mut posted = 0u64;
    loop {
        let mut m = msg.clone();
        m[..8].copy_from_slice(&posted.to_le_bytes());
        match ep.am_bcopy(1, &mut pack_bytes(&m)) {
            Ok(_) => posted += 1,
            Err(e) if e.is_retryable() => {
                assert!(e.to_string().contains("RUCX_TCP_TX_QUEUE"), "{e}");
                break;
            }
            Err(e) => panic!("{e}"),
        }
        a.iface.progress(&mut |ev| panic!("{ev:?}"));
        assert!(posted < 100_000, "the queue never filled");
    }
    println!("{posted} messages of 8 KiB posted before back-pressure");
    let mut next = 0u64;
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "all queued AMs",
        |_, ev| match ev {
            Event::Am { id: 1, data } => {
                assert_eq!(
                    u64::from_le_bytes(data[..8].try_into().unwrap()),
                    next,
                    "in order"
                );
                next += 1;
                (next == posted).then_some(())
            }
            other => panic!("unexpected {other:?}"),
        },
    );
}

#[test]
fn dropped_endpoint_still_delivers_what_it_posted() {
    let mut a = common::open_lo().unwrap();
    let mut b = common::open_lo().unwrap();
    let mut ep = a.iface.create_ep(&params(&b, 1)).unwrap();
    for i in 0..100u64 {
        ep.am_short(1, i, &[1; 100]).unwrap();
    }
    drop(ep);
    let mut next = 0;
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "AMs of the dropped endpoint",
        |_, ev| match ev {
            Event::Am { id: 1, data } => {
                assert_eq!(u64::from_le_bytes(data[..8].try_into().unwrap()), next);
                next += 1;
                (next == 100).then_some(())
            }
            other => panic!("no event for a dropped endpoint: {other:?}"),
        },
    );
}

#[test]
fn connection_refused_fails_the_endpoint_and_its_operations() {
    let mut a = common::open_lo().unwrap();
    // A port nobody listens on any more.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut p = params(&a, 5);
    p.iface_addr = rucx_uct_tcp::addr::pack_iface_addr(port);
    let mut ep = a.iface.create_ep(&p).unwrap();
    // Posting either queues (the connect is still in progress) or already sees the refusal.
    let mut flush_pending = false;
    match ep.am_short(1, 0, b"queued while connecting") {
        Ok(()) => match ep.flush(8) {
            Ok(st) => {
                assert_eq!(st, OpStatus::InProgress);
                flush_pending = true;
            }
            Err(e) => assert!(e.to_string().contains("refused"), "{e}"),
        },
        Err(e) => assert!(e.to_string().contains("refused"), "{e}"),
    }
    let e = progress_until(&mut [&mut a.iface], "endpoint error", |_, ev| match ev {
        Event::Completion { token: 8, result } => {
            assert!(flush_pending && result.is_err());
            flush_pending = false;
            None
        }
        Event::EpError { user_id: 5, error } => Some(error.to_string()),
        other => panic!("unexpected {other:?}"),
    });
    assert!(
        !flush_pending,
        "the pending flush completed (with an error) before the endpoint error"
    );
    assert!(e.contains("refused"), "{e}");
    assert!(ep.flush(9).is_err(), "a failed endpoint refuses new work");
}

#[test]
fn garbage_addresses_are_rejected() {
    let mut a = common::open_lo().unwrap();
    let good = params(&a, 1);
    assert!(a.iface.is_reachable(&good.dev_addr, &good.iface_addr));
    for (dev, iface) in [
        (vec![], good.iface_addr.clone()),
        (good.dev_addr.clone(), vec![]),
        (vec![7; 5], good.iface_addr.clone()),
        (good.dev_addr.clone(), vec![0x54, 1, 0, 0]),
        (good.dev_addr[..5].to_vec(), good.iface_addr.clone()),
    ] {
        assert!(!a.iface.is_reachable(&dev, &iface));
        let p = EpParams {
            dev_addr: dev,
            iface_addr: iface,
            user_id: 0,
        };
        assert!(a.iface.create_ep(&p).is_err());
    }
    // Loopback of another host (or network namespace) is not reachable.
    let mut other = good.dev_addr.clone();
    other[5] ^= 1;
    assert!(!a.iface.is_reachable(&other, &good.iface_addr));
    // A network address is not reachable from lo.
    let net = DevAddr {
        ip: [10, 0, 0, 1].into(),
        loopback_host: None,
    }
    .pack();
    assert!(!a.iface.is_reachable(&net, &good.iface_addr));
}

#[test]
fn closed_interface_fails_its_endpoints() {
    let mut a = common::open_lo().unwrap();
    let b = common::open_lo().unwrap();
    let mut ep = a.iface.create_ep(&params(&b, 1)).unwrap();
    drop(a);
    let e = ep.am_short(1, 0, b"x").unwrap_err();
    assert!(e.to_string().contains("interface was closed"), "{e}");
}

#[test]
fn flush_waits_for_the_peer() {
    let mut a = common::open_lo().unwrap();
    let mut b = common::open_lo().unwrap();
    let target = vec![0u8; 256];
    // SAFETY: `target` outlives the handle.
    let th = unsafe { b.md.mem_reg(MemRegion::of_slice(&target)) }.unwrap();
    let rkey = a.md.rkey_unpack(&b.md.mkey_pack(&th).unwrap()).unwrap();
    let mut ep = a.iface.create_ep(&params(&b, 1)).unwrap();
    assert_eq!(ep.flush(1).unwrap(), OpStatus::Done);
    ep.put_short(b"0123456789", target.as_ptr() as u64 + 3, &rkey)
        .unwrap();
    assert_eq!(ep.flush(2).unwrap(), OpStatus::InProgress);
    // Without the receiver's progress the flush cannot complete.
    for _ in 0..1000 {
        a.iface
            .progress(&mut |ev| panic!("flush completed without the peer: {ev:?}"));
    }
    progress_until(
        &mut [&mut a.iface, &mut b.iface],
        "flush",
        |_, ev| match ev {
            Event::Completion { token: 2, result } => result.map(|()| Some(())).unwrap(),
            other => panic!("unexpected {other:?}"),
        },
    );
    assert_eq!(&target[3..13], b"0123456789");
    assert_eq!(
        ep.flush(3).unwrap(),
        OpStatus::Done,
        "nothing new since the last flush"
    );
    drop(th);
}

#[test]
fn random_garbage_streams_never_hurt_the_interface() {
    let mut a = common::open_lo().unwrap();
    let mut b = common::open_lo().unwrap();
    let hello = wire::hello_frame(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1));
    // Registered memory that garbage must never reach.
    let guarded = vec![0u8; 4096];
    // SAFETY: `guarded` outlives the handle.
    let gh = unsafe { a.md.mem_reg(MemRegion::of_slice(&guarded)) }.unwrap();
    for seed in 1..=150u64 {
        let noise = pattern(seed, 8 + (seed as usize * 37) % 300);
        let mut bytes = hello.clone();
        if seed % 2 == 0 {
            // A well-formed header of a random kind with a random body: parsed deeper.
            let kind = [
                Kind::Am,
                Kind::Put,
                Kind::GetReq,
                Kind::Flush,
                Kind::Ack,
                Kind::GetRep,
                Kind::OpError,
                Kind::Detach,
            ][(seed as usize / 2) % 8];
            let (len, id) = match kind {
                Kind::Put => (32 + noise.len() % 64, 0),
                Kind::GetReq => (40, 0),
                Kind::Flush | Kind::Ack => (8, 0),
                Kind::GetRep => (8 + noise.len() % 16, 0),
                Kind::OpError => (9 + noise.len() % 16, 0),
                Kind::Detach => (0, 0),
                _ => (noise.len() % 64, (seed % 64) as u8),
            };
            bytes.extend_from_slice(&wire::header(kind, id, len));
        }
        bytes.extend_from_slice(&noise);
        let mut s = TcpStream::connect(listen_addr(&a)).unwrap();
        s.write_all(&bytes).unwrap();
        for _ in 0..50 {
            a.iface.progress(&mut |ev| match ev {
                // Garbage may happen to form a valid active message; that is delivered.
                Event::Am { .. } => {}
                other => panic!("garbage caused {other:?}"),
            });
        }
        drop(s);
    }
    for _ in 0..100 {
        a.iface.progress(&mut |_| {});
    }
    assert!(
        guarded.iter().all(|b| *b == 0),
        "garbage wrote into registered memory"
    );
    drop(gh);
    check_am_path(&mut b, &mut a, 1000);
    check_am_path(&mut a, &mut b, 2000);
}
