//! The interface over real sockets on `lo`: connection sharing and merging between two
//! interfaces, readiness bookkeeping, direct receives, strangers and raw peers.

use std::time::{Duration, Instant};

use rucx_uct::{AmId, Iov, MemHandle, RemoteKey};

use super::*;
use crate::md::RegTable;
use crate::wire::Kind;

fn open() -> TcpIface {
    open_with(TcpOptions::default())
}

fn open_with(opts: TcpOptions) -> TcpIface {
    let lo = addr::interfaces()
        .unwrap()
        .into_iter()
        .find(|d| d.loopback)
        .expect("lo");
    TcpIface::open(lo, addr::host_id(), Arc::new(RegTable::new()), opts).unwrap()
}

/// Small socket buffers, so a few messages fill them.
fn tiny() -> TcpOptions {
    TcpOptions {
        sndbuf: Some(4096),
        rcvbuf: Some(4096),
        ..TcpOptions::default()
    }
}

fn only_slot(i: &TcpIface) -> &Slot {
    let mut it = i.live();
    let s = it.next().expect("a connection");
    assert!(it.next().is_none(), "one connection");
    s
}

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;

fn params(to: &TcpIface, user_id: u64) -> EpParams {
    EpParams {
        dev_addr: to.device_address(),
        iface_addr: to.iface_address(),
        user_id,
    }
}

/// Progress both until `b` delivers an active message with this id; no other event may
/// happen on either.
fn deliver(a: &mut TcpIface, b: &mut TcpIface, id: AmId) {
    let start = Instant::now();
    let mut got = false;
    while !got {
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        b.progress(&mut |ev| match ev {
            Event::Am { id: i, .. } if i == id => got = true,
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
}

fn settle(a: &mut TcpIface, b: &mut TcpIface, until: impl Fn(&TcpIface, &TcpIface) -> bool) {
    let start = Instant::now();
    while !until(a, b) {
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        b.progress(&mut |ev| panic!("unexpected {ev:?}"));
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
}

#[test]
fn the_second_endpoint_shares_the_first_ones_connection() {
    let (mut a, mut b) = (open(), open());
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    ab.am_short(1, 0, b"wire-up").unwrap();
    deliver(&mut a, &mut b, 1);
    // b answers through the connection a opened.
    let mut ba = b.create_ep(&params(&a, 2)).unwrap();
    assert_eq!((a.connections(), b.connections()), (1, 1));
    ba.am_short(2, 0, b"reply").unwrap();
    deliver(&mut b, &mut a, 2);
    // Either side leaving keeps the connection for the other.
    drop(ab);
    settle(&mut a, &mut b, |_, b| {
        lock(&b.live().next().unwrap().conn).peer_detached
    });
    ba.am_short(3, 0, b"still here").unwrap();
    deliver(&mut b, &mut a, 3);
    assert_eq!((a.connections(), b.connections()), (1, 1));
    // Both gone: the connection closes on both sides, quietly.
    drop(ba);
    settle(&mut a, &mut b, |a, b| {
        a.connections() == 0 && b.connections() == 0
    });
}

#[test]
fn simultaneous_endpoints_converge_on_one_connection_and_both_close() {
    let (mut a, mut b) = (open(), open());
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    let mut ba = b.create_ep(&params(&a, 2)).unwrap();
    // Both dialed; the side with the larger address moves its endpoint onto the other's
    // connection while messages flow both ways, and every message arrives, in order.
    let n = 2000u64;
    let (mut sent_a, mut sent_b, mut got_a, mut got_b) = (0u64, 0u64, 0u64, 0u64);
    let start = Instant::now();
    let mut merged_at = None;
    while got_a < n || got_b < n {
        if merged_at.is_none() && a.merged + b.merged > 0 {
            merged_at = Some((sent_a, sent_b));
        }
        if sent_a < n && ab.am_short(1, sent_a, b"x").is_ok() {
            sent_a += 1;
        }
        if sent_b < n && ba.am_short(2, sent_b, b"y").is_ok() {
            sent_b += 1;
        }
        a.progress(&mut |ev| match ev {
            Event::Am { id: 2, data } => {
                assert_eq!(wire::word(data, 0), got_a, "in order");
                got_a += 1;
            }
            other => panic!("unexpected {other:?}"),
        });
        b.progress(&mut |ev| match ev {
            Event::Am { id: 1, data } => {
                assert_eq!(wire::word(data, 0), got_b, "in order");
                got_b += 1;
            }
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    // One side moved, while messages were still being sent both ways.
    assert_eq!(a.merged + b.merged, 1);
    let (sa, sb) = merged_at.expect("merged during the stream");
    assert!(sa < n && sb < n, "merged at {sa}/{sb} of {n}");
    settle(&mut a, &mut b, |a, b| {
        a.connections() == 1 && b.connections() == 1
    });
    ab.am_short(3, 0, b"after").unwrap();
    deliver(&mut a, &mut b, 3);
    ba.am_short(4, 0, b"after").unwrap();
    deliver(&mut b, &mut a, 4);
    drop(ab);
    drop(ba);
    settle(&mut a, &mut b, |a, b| {
        a.connections() == 0 && b.connections() == 0
    });
}

#[test]
fn silent_strangers_are_bounded() {
    use std::io::Read;
    let mut a = open();
    let addr = a.listen_addr();
    let extra = 20;
    let mut raw = Vec::new();
    for _ in 0..MAX_UNIDENTIFIED + extra {
        raw.push(std::net::TcpStream::connect(addr).unwrap());
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
    }
    let start = Instant::now();
    while a.connections() < MAX_UNIDENTIFIED || start.elapsed() < Duration::from_millis(200) {
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    assert_eq!(a.connections(), MAX_UNIDENTIFIED);
    // The oldest ones were closed (after our hello), the newest are still open.
    let mut closed = 0;
    for s in raw.iter_mut() {
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => {
                    closed += 1;
                    break;
                }
                Ok(_) => continue,
                Err(_) => break,
            }
        }
    }
    assert_eq!(closed, extra);
}

#[test]
fn a_connection_left_by_its_endpoint_is_not_reused() {
    let (mut a, mut b) = (open(), open());
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    ab.am_short(1, 0, b"x").unwrap();
    deliver(&mut a, &mut b, 1);
    drop(ab);
    // a's new endpoint to b must not pick the connection it already detached from.
    let mut ab2 = a.create_ep(&params(&b, 3)).unwrap();
    ab2.am_short(4, 0, b"again").unwrap();
    deliver(&mut a, &mut b, 4);
    settle(&mut a, &mut b, |a, b| {
        a.connections() == 1 && b.connections() == 1
    });
}

#[test]
fn output_interest_follows_the_send_queue() {
    let (mut a, mut b) = (open_with(tiny()), open_with(tiny()));
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    ab.am_short(1, 0, b"wire-up").unwrap();
    deliver(&mut a, &mut b, 1);
    settle(&mut a, &mut b, |a, _| only_slot(a).interest == IN);
    // b does not read: the socket buffers fill and a queues the rest, watching for room.
    let mut sent = 0;
    while lock(&only_slot(&a).conn).tx.is_empty() {
        let n = ab
            .am_bcopy(2, &mut |buf| {
                buf.fill(7);
                buf.len()
            })
            .unwrap();
        assert_eq!(n, wire::AM_MAX_BCOPY);
        sent += 1;
        assert!(sent < 10_000, "the socket never filled");
    }
    a.progress(&mut |ev| panic!("unexpected {ev:?}"));
    assert_eq!(only_slot(&a).interest, IN | OUT);
    // b reads everything; a stops watching for room once its queue is empty.
    let mut got = 0;
    let start = Instant::now();
    while got < sent {
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        b.progress(&mut |ev| match ev {
            Event::Am { id: 2, data } => {
                assert!(data.len() == wire::AM_MAX_BCOPY && data.iter().all(|&x| x == 7));
                got += 1;
            }
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    a.progress(&mut |ev| panic!("unexpected {ev:?}"));
    assert!(lock(&only_slot(&a).conn).tx.is_empty());
    assert_eq!(only_slot(&a).interest, IN);
}

#[test]
fn a_connection_failed_by_its_endpoint_is_reported_and_unwatched() {
    let (mut a, mut b) = (open(), open());
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    ab.am_short(1, 0, b"wire-up").unwrap();
    deliver(&mut a, &mut b, 1);
    settle(&mut a, &mut b, |a, _| only_slot(a).interest == IN);
    // A failure from the endpoint's side, with no socket event of its own: the kick makes
    // the next progress report it and drop the connection.
    lock(&only_slot(&a).conn).fail("test failure");
    let mut errors = 0;
    a.progress(&mut |ev| match ev {
        Event::EpError { user_id: 1, .. } => errors += 1,
        other => panic!("unexpected {other:?}"),
    });
    assert_eq!((errors, a.connections()), (1, 0));
    assert!(ab.am_short(1, 0, b"x").is_err());
    // Its key is reused by the next connection, which works.
    let mut ab2 = a.create_ep(&params(&b, 2)).unwrap();
    assert_eq!(a.slots.len(), 1);
    ab2.am_short(3, 0, b"again").unwrap();
    deliver(&mut a, &mut b, 3);
}

/// A raw peer speaking the wire protocol (with the larger address, so it is the side that
/// moves): its messages on the connection it dialed to `b`, then `Joined` and more
/// messages on the connection `b` dialed to it. `b` must deliver nothing after `Joined`
/// until the first connection's `Detach`.
#[test]
fn frames_after_joined_wait_for_the_detach_of_the_connection_left() {
    use std::io::{Read, Write};
    let mut b = open();
    let ip2 = std::net::Ipv4Addr::new(127, 0, 0, 2);
    assert!(*b.listen_addr().ip() < ip2);
    let lst = std::net::TcpListener::bind((ip2, 0)).unwrap();
    let me = match lst.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let raw_params = EpParams {
        dev_addr: DevAddr {
            ip: *me.ip(),
            loopback_host: Some(addr::host_id()),
        }
        .pack(),
        iface_addr: addr::pack_iface_addr(me.port()),
        user_id: 1,
    };
    // b's endpoint dials us (connection A); we dial b (connection D).
    let mut ep = b.create_ep(&raw_params).unwrap();
    ep.am_short(9, 0, b"hi").unwrap();
    b.progress(&mut |ev| panic!("unexpected {ev:?}"));
    let (mut conn_a, _) = lst.accept().unwrap();
    let fd = sock::connect_nb(
        Some(IpAddr::V4(ip2)),
        SocketAddr::V4(b.listen_addr()),
        &TcpOptions::default(),
    )
    .unwrap();
    let mut conn_d = std::net::TcpStream::from(fd);
    conn_d.set_nonblocking(false).unwrap();
    let left = match conn_d.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let am = |id: u8, v: u64| {
        let mut f = wire::header(Kind::Am, id, 8).to_vec();
        f.extend_from_slice(&v.to_le_bytes());
        f
    };
    let mut d_bytes = wire::hello_frame(me);
    d_bytes.extend(am(1, 1));
    conn_d.write_all(&d_bytes).unwrap();
    let mut a_bytes = wire::hello_frame(me);
    a_bytes.extend(wire::joined_frame(left));
    a_bytes.extend(am(2, 2));
    conn_a.write_all(&a_bytes).unwrap();
    // b's hello and am on A, so A is open on both sides.
    let mut buf = [0u8; 256];
    let _ = conn_a.read(&mut buf).unwrap();
    let mut got = Vec::new();
    let start = Instant::now();
    while got.is_empty() || start.elapsed() < Duration::from_millis(100) {
        b.progress(&mut |ev| match ev {
            Event::Am { id, data } => got.push((id, wire::word(data, 0))),
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    assert_eq!(got, vec![(1, 1)], "the message after joined waits");
    conn_d.write_all(&wire::detach_frame()).unwrap();
    let start = Instant::now();
    while got.len() < 2 {
        b.progress(&mut |ev| match ev {
            Event::Am { id, data } => got.push((id, wire::word(data, 0))),
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    assert_eq!(got, vec![(1, 1), (2, 2)]);
    drop(ep);
}

/// Two interfaces with small socket buffers (so a large put arrives over many reads), `b`
/// exposing `target` for puts; returns the endpoint a to b and the remote key.
fn rma_pair(
    target: &mut [u8],
) -> (
    TcpIface,
    TcpIface,
    crate::md::TcpMd,
    crate::md::TcpMd,
    MemHandle,
    RemoteKey,
) {
    use rucx_uct::{MemRegion, MemoryDomain};
    let lo = addr::interfaces()
        .unwrap()
        .into_iter()
        .find(|d| d.loopback)
        .unwrap();
    let small = TcpOptions {
        sndbuf: Some(64 * 1024),
        rcvbuf: Some(64 * 1024),
        ..TcpOptions::default()
    };
    let (ma, mb) = (
        crate::md::TcpMd::new(vec![lo.clone()], small.clone()),
        crate::md::TcpMd::new(vec![lo.clone()], small.clone()),
    );
    let a = TcpIface::open(lo.clone(), addr::host_id(), ma.table(), small.clone()).unwrap();
    let b = TcpIface::open(lo, addr::host_id(), mb.table(), small).unwrap();
    // SAFETY: the caller keeps `target` alive and unmoved until after the handle is dropped.
    let th = unsafe { mb.mem_reg(MemRegion::of_slice(target)) }.unwrap();
    let rkey = ma.rkey_unpack(&mb.mkey_pack(&th).unwrap()).unwrap();
    (a, b, ma, mb, th, rkey)
}

/// Progress both until the completion of `token` on `a`; returns its result.
fn complete(a: &mut TcpIface, b: &mut TcpIface, token: u64) -> Result<()> {
    let start = Instant::now();
    let mut res = None;
    while res.is_none() {
        a.progress(&mut |ev| match ev {
            Event::Completion { token: t, result } if t == token => res = Some(result),
            other => panic!("unexpected {other:?}"),
        });
        b.progress(&mut |ev| panic!("unexpected {ev:?}"));
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    res.unwrap()
}

#[test]
fn large_puts_are_received_straight_into_the_destination() {
    use rucx_uct::{MemRegion, MemoryDomain};
    const LEN: usize = wire::RMA_MAX_ZCOPY;
    let mut target = vec![0xeeu8; LEN + 2 * 4096];
    let (mut a, mut b, ma, _mb, th, rkey) = rma_pair(&mut target);
    let src: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    // SAFETY: `src` outlives the handle.
    let sh = unsafe { ma.mem_reg(MemRegion::of_slice(&src)) }.unwrap();
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    let base = target.as_ptr() as u64 + 4096;
    for round in 0..3u64 {
        let iov = [Iov {
            addr: src.as_ptr() as usize,
            len: LEN,
            memh: &sh,
        }];
        ab.put_zcopy(&iov, base, &rkey, round).unwrap();
        complete(&mut a, &mut b, round).unwrap();
    }
    // b never buffered a whole put body: it went from the socket to the target.
    assert!(only_slot(&b).rx.rx.allocated() <= crate::stream::READ_CHUNK);
    assert!(target[4096..4096 + LEN] == src[..], "data intact");
    assert!(target[..4096].iter().all(|&x| x == 0xee), "nothing before");
    assert!(
        target[4096 + LEN..].iter().all(|&x| x == 0xee),
        "nothing after"
    );
    drop((ab, sh, th));
}

#[test]
fn a_put_to_a_destination_that_goes_away_is_drained_and_refused() {
    use rucx_uct::{MemRegion, MemoryDomain};
    const LEN: usize = wire::RMA_MAX_ZCOPY;
    let mut target = vec![0u8; LEN];
    let (mut a, mut b, ma, _mb, th, rkey) = rma_pair(&mut target);
    let src = vec![0x42u8; LEN];
    // SAFETY: `src` outlives the handle.
    let sh = unsafe { ma.mem_reg(MemRegion::of_slice(&src)) }.unwrap();
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    let iov = [Iov {
        addr: src.as_ptr() as usize,
        len: LEN,
        memh: &sh,
    }];
    let base = target.as_ptr() as u64;
    ab.put_zcopy(&iov, base, &rkey, 1).unwrap();
    // Deregister once part of the body landed.
    let start = Instant::now();
    while !b.live().any(|s| {
        s.rx.direct
            .as_ref()
            .is_some_and(|d| d.off > 0 && d.off < d.len)
    }) {
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        b.progress(&mut |ev| panic!("unexpected {ev:?}"));
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    drop(th);
    let err = complete(&mut a, &mut b, 1).unwrap_err();
    assert!(matches!(err, Error::InvalidRkey { .. }), "{err}");
    // A put to a range that was never registered: refused without a byte written.
    ab.put_zcopy(&iov, base, &rkey, 2).unwrap();
    let err = complete(&mut a, &mut b, 2).unwrap_err();
    assert!(err.to_string().contains("not live"), "{err}");
    // The stream is still in step.
    ab.am_short(5, 0, b"after").unwrap();
    deliver(&mut a, &mut b, 5);
    drop((ab, sh));
}

#[test]
fn large_gets_are_received_straight_into_the_requesters_buffers() {
    use rucx_uct::{MemRegion, MemoryDomain};
    const LEN: usize = wire::RMA_MAX_ZCOPY;
    let mut target: Vec<u8> = (0..LEN).map(|i| (i * 13 % 251) as u8).collect();
    let (mut a, mut b, ma, _mb, th, rkey) = rma_pair(&mut target);
    // Three destination pieces with guard bytes around each.
    let sizes = [100_000usize, 1, LEN - 100_001];
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xeeu8; n + 64]).collect();
    let handles: Vec<MemHandle> = bufs
        .iter()
        .map(|v| {
            // SAFETY: `bufs` outlives the handles (dropped first below).
            unsafe { ma.mem_reg(MemRegion::of_slice(v)) }.unwrap()
        })
        .collect();
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    for round in 0..2u64 {
        let iov: Vec<Iov<'_>> = bufs
            .iter_mut()
            .zip(&handles)
            .zip(sizes)
            .map(|((v, h), n)| Iov {
                addr: v.as_mut_ptr() as usize + 32,
                len: n,
                memh: h,
            })
            .collect();
        ab.get_zcopy(&iov, target.as_ptr() as u64, &rkey, round)
            .unwrap();
        complete(&mut a, &mut b, round).unwrap();
    }
    assert!(only_slot(&a).rx.rx.allocated() <= crate::stream::READ_CHUNK);
    let got: Vec<u8> = bufs
        .iter()
        .zip(sizes)
        .flat_map(|(v, n)| v[32..32 + n].to_vec())
        .collect();
    assert!(got == target, "data intact");
    for (v, n) in bufs.iter().zip(sizes) {
        assert!(
            v[..32].iter().chain(&v[32 + n..]).all(|&x| x == 0xee),
            "guards"
        );
    }
    drop((ab, handles, th));
}

/// The start of a large get answer that answers nothing outstanding is refused as soon as
/// its fixed fields arrive (the rest is never buffered).
#[test]
fn a_partial_get_answer_for_no_get_fails_the_endpoint() {
    use std::io::Write;
    let mut b = open();
    let lst = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let me = match lst.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let p = EpParams {
        dev_addr: DevAddr {
            ip: *me.ip(),
            loopback_host: Some(addr::host_id()),
        }
        .pack(),
        iface_addr: addr::pack_iface_addr(me.port()),
        user_id: 7,
    };
    let ep = b.create_ep(&p).unwrap();
    b.progress(&mut |ev| panic!("unexpected {ev:?}"));
    let (mut raw, _) = lst.accept().unwrap();
    let mut bytes = wire::hello_frame(me);
    bytes.extend(wire::header(Kind::GetRep, 0, 8 + 500_000));
    bytes.extend(77u64.to_le_bytes());
    bytes.extend([0u8; 1000]);
    raw.write_all(&bytes).unwrap();
    let mut failed = None;
    let start = Instant::now();
    while failed.is_none() {
        b.progress(&mut |ev| match ev {
            Event::EpError { user_id: 7, error } => failed = Some(error.to_string()),
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    assert!(failed.unwrap().contains("not the oldest outstanding"));
    drop(ep);
}

#[test]
fn a_lone_connection_is_read_without_readiness_checks_and_the_rest_still_happens() {
    let (mut a, mut b, mut c) = (open(), open(), open());
    let mut ba = b.create_ep(&params(&a, 1)).unwrap();
    ba.am_short(1, 0, b"wire-up").unwrap();
    deliver(&mut b, &mut a, 1);
    // One established connection that only waits for input: read speculatively, except on
    // the calls that check readiness anyway.
    settle(&mut a, &mut b, |a, _| a.speculative().is_some());
    let key = a.speculative().unwrap();
    assert_eq!(a.slot(key).map(|s| s.interest), Some(IN));
    for i in 0..100u8 {
        ba.am_short(5, u64::from(i) << 8, &[i]).unwrap();
        let mut got = None;
        let start = Instant::now();
        while got.is_none() {
            b.progress(&mut |ev| panic!("unexpected {ev:?}"));
            a.progress(&mut |ev| match ev {
                Event::Am { id: 5, data } => got = Some(data.to_vec()),
                other => panic!("unexpected {other:?}"),
            });
            assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
        }
        // The header (little endian) and then the payload.
        assert_eq!(got, Some(vec![0, i, 0, 0, 0, 0, 0, 0, i]));
    }
    // A new peer is still accepted (by the periodic readiness check), and with two
    // connections every call checks readiness again.
    let mut ca = c.create_ep(&params(&a, 2)).unwrap();
    ca.am_short(2, 0, b"newcomer").unwrap();
    deliver(&mut c, &mut a, 2);
    assert_eq!(a.connections(), 2);
    assert_eq!(a.speculative(), None);
    ba.am_short(3, 0, b"first peer").unwrap();
    deliver(&mut b, &mut a, 3);
    // The newcomer leaves: back to one connection, read speculatively again.
    drop(ca);
    settle(&mut a, &mut c, |a, c| {
        a.connections() == 1 && c.connections() == 0
    });
    // (from its next input on: the connection read is the one that last had input)
    ba.am_short(4, 0, b"again").unwrap();
    deliver(&mut b, &mut a, 4);
    settle(&mut a, &mut b, |a, _| a.speculative().is_some());
    ba.am_short(6, 0, b"and again").unwrap();
    deliver(&mut b, &mut a, 6);
    // The last peer leaving is noticed through the speculative reads too.
    drop(ba);
    settle(&mut a, &mut b, |a, b| {
        a.connections() == 0 && b.connections() == 0
    });
}

/// Progress `i` (with `peer` alongside) until it arms: nothing pending.
fn quiet(i: &mut TcpIface, peer: &mut TcpIface) {
    let start = Instant::now();
    loop {
        peer.progress(&mut |ev| panic!("unexpected {ev:?}"));
        i.progress(&mut |ev| panic!("unexpected {ev:?}"));
        match i.arm() {
            Ok(()) => return,
            Err(Error::Busy(_)) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
}

#[test]
fn a_sleep_names_the_ready_sockets_for_the_next_progress_and_a_timer_ends_it() {
    let (mut a, mut b) = (open(), open());
    // A new connection while `a` has none (it looks at its listener only now and then): the
    // sleep reports the listener, and the next progress accepts whatever call it is.
    let mut ba = b.create_ep(&params(&a, 1)).unwrap();
    ba.am_short(1, 0, b"wire-up").unwrap();
    b.progress(&mut |ev| panic!("unexpected {ev:?}"));
    a.calls = 0;
    a.arm_and_wait(Some(Duration::from_secs(60)), None).unwrap();
    assert!(a.woke && a.woke_listener, "the listener was ready");
    assert!(
        matches!(a.arm(), Err(Error::Busy(_))),
        "what the sleep found is pending"
    );
    a.progress(&mut |ev| panic!("unexpected {ev:?}"));
    assert_eq!(a.connections(), 1);
    deliver(&mut b, &mut a, 1);
    quiet(&mut a, &mut b);

    // A message sent while `a` sleeps ends the sleep; the next progress reads it without a
    // readiness check (the sleep's answer is used once).
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        ba.am_short(7, 0, b"wake").unwrap();
        (b, ba)
    });
    let mut woke = false;
    let start = Instant::now();
    while !woke {
        a.arm_and_wait(Some(Duration::from_secs(60)), None).unwrap();
        woke = a.woke;
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    let (key, ev) = a.work[0];
    assert_eq!((a.work.len(), ev & IN), (1, IN));
    assert_eq!(a.slot(key).map(|s| s.sock.0), Some(only_slot(&a).sock.0));
    let mut got = Vec::new();
    a.progress(&mut |ev| match ev {
        Event::Am { id: 7, data } => got.push(data.to_vec()),
        other => panic!("unexpected {other:?}"),
    });
    assert_eq!(got.len(), 1);
    assert!(!a.woke && a.work.is_empty());
    let (mut b, mut ba) = sender.join().unwrap();

    // Nothing to report: the caller's timer ends a sleep without a limit, once per expiry.
    quiet(&mut a, &mut b);
    let timer = rucx_ucs::event::TimerFd::new().unwrap();
    for _ in 0..2 {
        timer.set(Duration::from_millis(5)).unwrap();
        a.arm_and_wait(None, Some(timer.fd())).unwrap();
        assert!(!a.woke, "the timer is not a socket");
        a.arm().unwrap();
    }
    // A message already waiting ends a sleep at once (level triggered), timer or not.
    timer.set(Duration::from_secs(3600)).unwrap();
    ba.am_short(8, 0, b"already there").unwrap();
    b.progress(&mut |ev| panic!("unexpected {ev:?}"));
    let start = Instant::now();
    while !a.woke {
        a.arm_and_wait(None, Some(timer.fd())).unwrap();
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    let mut n = 0;
    a.progress(&mut |ev| match ev {
        Event::Am { id: 8, .. } => n += 1,
        other => panic!("unexpected {other:?}"),
    });
    assert_eq!(n, 1);
    drop(ba);
}

/// An idle interface's looks at its listener come about every `IDLE_POLL_GAP`: a spinning
/// caller's count grows (at most doubling per look, capped), a rare caller's shrinks to every
/// call, and the first look keeps the count it was given.
#[test]
fn idle_listener_looks_follow_the_callers_pace() {
    let us = Duration::from_micros;
    assert_eq!(idle_scale(32, None), 32);
    // 32 calls in 1 us: far faster than the gap, but the count only doubles.
    assert_eq!(idle_scale(32, Some(us(1))), 64);
    assert_eq!(idle_scale(2048, Some(us(1))), IDLE_POLL_MAX);
    assert_eq!(
        idle_scale(IDLE_POLL_MAX, Some(Duration::ZERO)),
        IDLE_POLL_MAX
    );
    // Exactly the gap: unchanged; twice the gap: half.
    assert_eq!(idle_scale(512, Some(IDLE_POLL_GAP)), 512);
    assert_eq!(idle_scale(512, Some(IDLE_POLL_GAP * 2)), 256);
    // A caller that sleeps a millisecond between progress calls looks on every call.
    assert_eq!(idle_scale(32, Some(Duration::from_millis(32))), 1);
    assert_eq!(idle_scale(1, Some(Duration::from_secs(5))), 1);
    // A spinning caller gets from 32 to the cap in a few looks.
    let mut every = IDLE_POLL_EVERY;
    for _ in 0..8 {
        every = idle_scale(every, Some(us(1)));
    }
    assert_eq!(every, IDLE_POLL_MAX);
}

/// A connection to an idle interface whose caller spins without arming is accepted within a
/// bounded number of progress calls, and one whose caller progresses only now and then within
/// a few of its calls: the listener's looks adapt to the caller's pace.
#[test]
fn an_idle_listener_accepts_a_new_connection_at_any_pace() {
    for pause in [Duration::ZERO, Duration::from_millis(2)] {
        let mut server = open();
        let mut sink = |_: Event<'_>| {};
        // Idle for a while at this pace, so the count has settled.
        for _ in 0..if pause.is_zero() { 100_000 } else { 80 } {
            server.progress(&mut sink);
            std::thread::sleep(pause);
        }
        let addr = server.listener.local_addr().unwrap();
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        let mut calls = 0u32;
        while server.slots.len() == server.free.len() {
            server.progress(&mut sink);
            calls += 1;
            std::thread::sleep(pause);
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "not accepted after {calls} calls"
            );
        }
        if pause.is_zero() {
            assert!(calls <= IDLE_POLL_MAX + 1, "{calls} calls");
        } else {
            assert!(calls <= 4, "{calls} calls with {pause:?} between them");
        }
    }
}

/// `am_short_word` sends the word before the rest, without a scratch buffer, and counts the
/// word against the short limit.
#[test]
fn am_short_word_delivers_the_word_then_the_rest() {
    let (mut a, mut b) = (open(), open());
    let mut ab = a.create_ep(&params(&b, 1)).unwrap();
    let rest: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let mut scratch = Vec::new();
    ab.am_short_word(3, 0xfeed, 0x0102_0304_0506_0708, &rest, &mut scratch)
        .unwrap();
    ab.am_short_word(4, 9, 5, &[], &mut scratch).unwrap();
    assert!(scratch.is_empty(), "the scratch buffer is not used");
    let too_long = vec![0u8; wire::AM_MAX_SHORT - 7];
    let e = ab
        .am_short_word(3, 0, 0, &too_long, &mut scratch)
        .unwrap_err();
    assert!(e.to_string().contains("exceeds tcp's limit"), "{e}");
    let mut got = Vec::new();
    let start = Instant::now();
    while got.len() < 2 {
        a.progress(&mut |ev| panic!("unexpected {ev:?}"));
        b.progress(&mut |ev| match ev {
            Event::Am { id, data } => got.push((id, data.to_vec())),
            other => panic!("unexpected {other:?}"),
        });
        assert!(start.elapsed() < Duration::from_secs(60), "hang guard");
    }
    let mut first = 0xfeedu64.to_le_bytes().to_vec();
    first.extend_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
    first.extend_from_slice(&rest);
    let mut second = 9u64.to_le_bytes().to_vec();
    second.extend_from_slice(&5u64.to_le_bytes());
    assert_eq!(got, vec![(3, first), (4, second)]);
}
