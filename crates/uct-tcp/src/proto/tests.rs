//! The connection protocol in memory: each end is a connection object and its receiving half
//! over one end of an in-memory stream pair, driven by hand. Bytes go in, state, events and
//! bytes come out; no socket, no descriptor, no interface.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rucx_ucs::Error;
use rucx_uct::{Event, MemHandle, MemRegion, MemoryDomain, RemoteKey};

use super::merge::{self, Merge};
use super::rx::scatter;
use super::*;
use crate::TcpOptions;
use crate::md::{TcpMd, TcpRkey};
use crate::memsock::{self, MemSock};
use crate::ready::Kick;
use crate::stream::{Fill, OwnedSock, RxBuf};
use crate::wire::{self, Header, Kind, code};

const A: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), 7001);
const B: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), 7002);
const TIMEOUT: Duration = Duration::from_secs(10);
const BOTH: Ready = Ready {
    input: true,
    output: true,
};

/// One end: a connection, its receiving half, a memory domain for remote accesses, and what
/// progress handed out.
struct End {
    conn: Arc<Mutex<Conn<MemSock>>>,
    reader: MemSock,
    rx: Receiver<MemSock>,
    md: TcpMd,
    kick: Arc<Kick>,
    now: Instant,
    events: Vec<Owned>,
    ams: Vec<(u8, Vec<u8>)>,
}

impl End {
    /// An end listening on `listen`: dialed to `dialed` (connecting), or accepted from
    /// `remote` (open).
    fn new(
        sock: MemSock,
        listen: SocketAddrV4,
        dialed: Option<SocketAddrV4>,
        remote: SocketAddr,
    ) -> End {
        let kick = Arc::new(Kick::default());
        let setup = Setup {
            dev: "mem0".into(),
            listen,
            tx_limit: 4 << 20,
            timeout: TIMEOUT,
            kick: kick.clone(),
        };
        let state = if dialed.is_some() {
            State::Connecting
        } else {
            State::Open
        };
        let now = Instant::now();
        let reader = sock.reader();
        let conn = Conn::new(sock, state, dialed, remote, &setup, 0, now);
        End {
            conn: Arc::new(Mutex::new(conn)),
            reader,
            rx: Receiver::new(dialed.is_some()),
            md: TcpMd::new(Vec::new(), TcpOptions::default()),
            kick,
            now,
            events: Vec::new(),
            ams: Vec::new(),
        }
    }

    fn c(&self) -> MutexGuard<'_, Conn<MemSock>> {
        lock(&self.conn)
    }

    fn step_with(&mut self, ready: Ready) -> rx::Progress {
        let t = self.now;
        let table = self.md.table();
        let ams = &mut self.ams;
        self.rx.progress(
            &self.conn,
            &mut self.reader,
            ready,
            &move || t,
            &table,
            &mut |ev| match ev {
                Event::Am { id, data } => ams.push((id, data.to_vec())),
                other => panic!("unexpected {other:?}"),
            },
            &mut self.events,
        )
    }

    fn step(&mut self) -> rx::Progress {
        self.step_with(BOTH)
    }

    /// A step as the interface takes one on its lone connection without a readiness check:
    /// a read ahead, then (unless it found nothing) the step, told the socket is readable.
    fn step_ahead(&mut self) -> Option<rx::Progress> {
        let table = self.md.table();
        self.rx.read_ahead(&mut self.reader, &table).then(|| {
            self.step_with(Ready {
                input: true,
                output: false,
            })
        })
    }

    /// The completion of `token`, if it came.
    fn completion(&mut self, token: u64) -> Option<rucx_ucs::Result<()>> {
        let i = self
            .events
            .iter()
            .position(|e| matches!(e, Owned::Completion(t, _) if *t == token))?;
        match self.events.remove(i) {
            Owned::Completion(_, r) => Some(r),
            Owned::EpError(..) => unreachable!(),
        }
    }

    fn ep_error(&self) -> Option<String> {
        self.events.iter().find_map(|e| match e {
            Owned::EpError(_, e) => Some(e.to_string()),
            Owned::Completion(..) => None,
        })
    }

    fn failure(&self) -> Option<String> {
        match &self.c().state {
            State::Failed(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// Post an active message from our endpoint.
    fn am(&self, id: u8, data: &[u8]) -> bool {
        let h = wire::header(Kind::Am, id, data.len());
        self.c()
            .post(&[Part::Bytes(&h), Part::Bytes(data)], None)
            .unwrap()
    }
}

/// A dials B over an in-memory stream; each direction holds `cap` bytes, each call moves at
/// most `max_io`.
fn pair(cap: usize, max_io: usize) -> (End, End) {
    let (sa, sb) = memsock::pair(cap, max_io);
    let from = SocketAddr::V4(sa.local);
    let a = End::new(sa, A, Some(B), SocketAddr::V4(B));
    let b = End::new(sb, B, None, from);
    (a, b)
}

/// B accepted a connection from a raw peer (the test writes its bytes).
fn raw_to_b() -> (MemSock, End) {
    let (raw, sb) = memsock::pair(1 << 20, usize::MAX);
    let from = SocketAddr::V4(raw.local);
    (raw, End::new(sb, B, None, from))
}

/// Progress both ends until `done` (or fail the test).
fn drive(a: &mut End, b: &mut End, mut done: impl FnMut(&mut End, &mut End) -> bool) {
    for _ in 0..100_000 {
        if done(a, b) {
            return;
        }
        a.step();
        b.step();
    }
    panic!("no progress");
}

/// Every frame in `bytes`, which must be a valid frame sequence.
fn frames(bytes: &[u8]) -> Vec<(Header, Vec<u8>)> {
    let mut src = memsock::pair(bytes.len().max(1), usize::MAX);
    src.0.inject(bytes);
    let mut rx = RxBuf::new();
    while !matches!(rx.fill(&mut src.1).unwrap(), Fill::WouldBlock) {}
    let mut out = Vec::new();
    while let Some((h, body)) = rx.frame().unwrap() {
        out.push((h, body.to_vec()));
        rx.consume(&h);
    }
    assert_eq!(rx.buffered(), 0, "a partial frame at the end");
    out
}

fn am_frame(id: u8, data: &[u8]) -> Vec<u8> {
    let mut f = wire::header(Kind::Am, id, data.len()).to_vec();
    f.extend_from_slice(data);
    f
}

#[test]
fn hello_first_then_messages_both_ways_on_one_connection() {
    let (mut a, mut b) = pair(1 << 20, usize::MAX);
    a.c().ep = Some(1);
    a.c().sock.connecting = true;
    // Posted while connecting: queued behind our hello, and the interface is asked to look.
    assert!(!a.am(5, b"early"));
    let mut kicked = Vec::new();
    a.kick.take(&mut kicked);
    assert_eq!(kicked, vec![0]);
    assert_eq!(
        b.reader.pending_in(),
        0,
        "nothing sent before the connect finished"
    );
    // The connect finishes; the hello and the message go out, in that order.
    a.c().sock.connecting = false;
    let p = a.step_with(Ready {
        input: false,
        output: true,
    });
    assert!(p.read && !p.write && !p.timed && !p.gone, "{p:?}");
    let sent = frames(&b.reader.reader().take_all());
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].0.kind, Kind::Hello);
    assert_eq!(wire::check_hello(&sent[0].1).unwrap(), A);
    assert_eq!((sent[1].0.kind, sent[1].0.id), (Kind::Am, 5));
    // Re-send what the test took, and let B read it.
    let mut bytes = wire::hello_frame(A);
    bytes.extend(am_frame(5, b"early"));
    a.c().sock.inject(&bytes);
    b.step();
    assert!(b.rx.hello);
    assert_eq!(b.c().peer, Some(A), "the hello names the peer");
    assert_eq!(b.ams, vec![(5, b"early".to_vec())]);
    // B's endpoint to A takes over the connection A opened, and answers on it.
    assert!(b.c().free_for(A));
    b.c().ep = Some(2);
    assert!(b.am(6, b"reply"), "an idle connection sends at once");
    drive(&mut a, &mut b, |a, _| !a.ams.is_empty());
    assert_eq!(a.ams, vec![(6, b"reply".to_vec())]);
    assert!(a.events.is_empty() && b.events.is_empty());
}

#[test]
fn anything_but_hello_first_is_refused() {
    for (first, want) in [
        (
            am_frame(1, b"x"),
            "protocol violation by the peer: Am frame before hello",
        ),
        (
            wire::words_frame(Kind::Flush, &[1], &[]),
            "Flush frame before hello",
        ),
        (
            wire::fatal_frame(code::SHUTDOWN, "busy"),
            "the peer refused the connection: busy",
        ),
    ] {
        let (mut raw, mut b) = raw_to_b();
        raw.inject(&first);
        let p = b.step();
        let reason = b.failure().expect("failed");
        assert!(reason.contains(want), "{reason}");
        assert!(p.gone, "no endpoint to tell: let it go");
        // A violation is answered with its reason, after our hello; a refusal is not.
        let out = frames(&raw.take_all());
        let kinds: Vec<Kind> = out.iter().map(|(h, _)| h.kind).collect();
        if reason.contains("violation") {
            assert_eq!(kinds, [Kind::Hello, Kind::Fatal]);
            assert_eq!(out[1].1[0], code::PROTOCOL);
        } else {
            assert!(!kinds.contains(&Kind::Fatal), "{kinds:?}");
        }
        assert!(raw.peer_closed(), "and the connection is closed");
    }
}

#[test]
fn a_hello_must_name_the_peer() {
    // On a connection we dialed: the address dialed.
    let (mut raw, sa) = memsock::pair(1 << 20, usize::MAX);
    let mut a = End::new(sa, A, Some(B), SocketAddr::V4(B));
    raw.inject(&wire::hello_frame(SocketAddrV4::new(*B.ip(), 9999)));
    a.step();
    assert!(
        a.failure()
            .unwrap()
            .contains("hello announces 127.0.0.1:9999")
    );
    // On one we accepted: an address on the host it comes from.
    let (mut raw, mut b) = raw_to_b();
    raw.inject(&wire::hello_frame("10.0.0.1:5".parse().unwrap()));
    b.step();
    assert!(b.failure().unwrap().contains("hello announces 10.0.0.1:5"));
    // Garbage in the hello itself, and a second hello.
    let (mut raw, mut b) = raw_to_b();
    let mut h = wire::hello_frame(A);
    h[wire::HDR_LEN + 4] = 9;
    raw.inject(&h);
    b.step();
    assert!(b.failure().unwrap().contains("wire version 9"));
    let (mut raw, mut b) = raw_to_b();
    raw.inject(&wire::hello_frame(A));
    raw.inject(&wire::hello_frame(A));
    b.step();
    assert!(b.failure().unwrap().contains("second hello"));
}

#[test]
fn frames_that_break_the_rules_fail_the_connection_and_its_endpoint() {
    let cases: [(Vec<u8>, &str); 4] = [
        (
            wire::words_frame(Kind::Ack, &[5], &[]),
            "Ack for request 5, but none is outstanding",
        ),
        (
            wire::joined_frame(B).to_vec(),
            "joined on a connection the peer opened",
        ),
        (wire::header(Kind::Detach, 3, 0).to_vec(), "nonzero id byte"),
        (vec![0xff; 8], "bad frame mark"),
    ];
    for (frame, want) in cases {
        let (mut raw, mut b) = raw_to_b();
        b.c().ep = Some(7);
        raw.inject(&wire::hello_frame(A));
        raw.inject(&frame);
        b.step();
        let e = b.ep_error().expect("endpoint error");
        assert!(e.contains(want), "{e}");
        assert!(b.step().gone, "reported once, then let go");
        assert_eq!(b.events.len(), 1);
    }
}

#[test]
fn a_stream_cut_in_the_middle_of_a_frame_fails_at_its_end() {
    let (mut raw, mut b) = raw_to_b();
    b.c().ep = Some(3);
    raw.inject(&wire::hello_frame(A));
    raw.inject(&am_frame(1, &[7; 100])[..50]);
    b.step();
    assert!(
        b.ams.is_empty() && b.failure().is_none(),
        "waits for the rest"
    );
    raw.shutdown(std::net::Shutdown::Write);
    b.step();
    assert!(b.ams.is_empty());
    assert_eq!(
        b.failure().as_deref(),
        Some("the peer closed the connection")
    );
    assert!(b.ep_error().unwrap().contains("closed"));
}

#[test]
fn a_read_ahead_that_finds_nothing_skips_the_step_and_one_that_finds_the_end_fails() {
    let (mut raw, mut b) = raw_to_b();
    b.c().ep = Some(3);
    assert!(b.step_ahead().is_none(), "nothing arrived: no step");
    raw.inject(&wire::hello_frame(A));
    raw.inject(&am_frame(1, &[7; 100]));
    let p = b.step_ahead().expect("the hello and a message arrived");
    assert!(p.read && !p.gone && b.rx.hello, "{p:?}");
    assert_eq!(b.ams, vec![(1, vec![7; 100])]);
    assert!(b.step_ahead().is_none());
    raw.inject(&am_frame(2, b"last"));
    raw.shutdown(std::net::Shutdown::Write);
    b.step_ahead().expect("a message");
    assert_eq!(b.ams.last(), Some(&(2, b"last".to_vec())));
    assert!(
        b.failure().is_none(),
        "the read drained the socket: no second read"
    );
    b.step_ahead().expect("the end of the stream");
    assert_eq!(
        b.failure().as_deref(),
        Some("the peer closed the connection")
    );
    assert!(b.ep_error().unwrap().contains("closed"));
}

/// `b` registers `target`; returns its handle and the remote key `a` uses.
fn expose(a: &End, b: &End, target: &mut [u8]) -> (MemHandle, RemoteKey, TcpRkey) {
    // SAFETY: the caller keeps `target` alive and unmoved until after the handle is dropped.
    let th = unsafe { b.md.mem_reg(MemRegion::of_slice(target)) }.unwrap();
    let rkey = a.md.rkey_unpack(&b.md.mkey_pack(&th).unwrap()).unwrap();
    let k = *rkey.inner::<TcpRkey>().unwrap();
    (th, rkey, k)
}

fn complete(a: &mut End, b: &mut End, token: u64) -> rucx_ucs::Result<()> {
    let mut res = None;
    drive(a, b, |a, _| {
        res = res.take().or_else(|| a.completion(token));
        res.is_some()
    });
    res.unwrap()
}

#[test]
fn puts_gets_and_flushes_are_answered_in_order_through_tiny_reads() {
    // Seven bytes per call: every large body is received straight into its destination over
    // many reads, after its fixed fields came in pieces.
    let (mut a, mut b) = pair(4096, 7);
    a.c().ep = Some(1);
    let mut target = vec![0u8; 20_000];
    let base = target.as_ptr() as u64;
    let (th, _rkey, k) = expose(&a, &b, &mut target);
    let src: Vec<u8> = (0..12_000).map(|i| (i % 251) as u8).collect();
    let op = a.c().ops.next_op();
    let head = wire::put_head(op, k.md_id, k.reg_id, base + 100, src.len());
    a.c()
        .request(
            &[Part::Bytes(&head), Part::Bytes(&src)],
            Some(10),
            PendKind::Put,
        )
        .unwrap();
    assert!(!a.c().ops.all_answered());
    complete(&mut a, &mut b, 10).unwrap();
    assert!(target[100..12_100] == src[..] && target[..100].iter().all(|&x| x == 0));
    // A get of what was put, into two registered pieces.
    let mut dst = [vec![0u8; 5000], vec![0u8; 7000]];
    let dh: Vec<MemHandle> = dst
        .iter()
        .map(|v| {
            // SAFETY: `dst` outlives the handles (dropped first below).
            unsafe { a.md.mem_reg(MemRegion::of_slice(v)) }.unwrap()
        })
        .collect();
    let pieces = dst
        .iter_mut()
        .zip(&dh)
        .map(|(v, h)| (h.clone(), v.as_mut_ptr() as usize, v.len()))
        .collect();
    let op = a.c().ops.next_op();
    let f = wire::words_frame(
        Kind::GetReq,
        &[op, k.md_id, k.reg_id, base + 100, 12_000],
        &[],
    );
    a.c()
        .request(
            &[Part::Bytes(&f)],
            Some(11),
            PendKind::Get {
                dst: pieces,
                len: 12_000,
            },
        )
        .unwrap();
    // And a flush behind it: answered after the get.
    let op = a.c().ops.next_op();
    let f = wire::words_frame(Kind::Flush, &[op], &[]);
    a.c()
        .request(&[Part::Bytes(&f)], Some(12), PendKind::Flush)
        .unwrap();
    complete(&mut a, &mut b, 12).unwrap();
    assert!(
        matches!(a.completion(11), Some(Ok(()))),
        "the get came first"
    );
    drop(dh);
    assert!(dst.concat() == src);
    assert!(a.c().ops.all_answered());
    drop(th);
}

#[test]
fn a_flush_right_behind_a_request_completes_with_its_answer() {
    let (mut a, mut b) = pair(1 << 20, usize::MAX);
    a.c().ep = Some(1);
    let mut target = vec![0u8; 1000];
    let base = target.as_ptr() as u64;
    let (th, _rkey, k) = expose(&a, &b, &mut target);
    let put = |a: &End, token: u64, at: u64| {
        let op = a.c().ops.next_op();
        let head = wire::put_head(op, k.md_id, k.reg_id, at, 10);
        a.c()
            .request(
                &[Part::Bytes(&head), Part::Bytes(&[5u8; 10])],
                Some(token),
                PendKind::Put,
            )
            .unwrap();
    };
    put(&a, 10, base);
    let op = a.c().ops.next_op();
    assert!(a.c().ops.flush_behind_last(11));
    assert!(
        a.c().ops.flush_behind_last(12),
        "two flushes behind one put"
    );
    assert_eq!(a.c().ops.next_op(), op, "no request of their own");
    complete(&mut a, &mut b, 11).unwrap();
    assert!(matches!(a.completion(10), Some(Ok(()))));
    assert!(matches!(a.completion(12), Some(Ok(()))));
    assert!(a.c().ops.all_answered() && target[..10] == [5; 10]);
    // Refused (past the registration): the put fails, the flush behind it completes.
    put(&a, 13, base + 995);
    assert!(a.c().ops.flush_behind_last(14));
    complete(&mut a, &mut b, 14).unwrap();
    assert!(matches!(a.completion(13), Some(Err(_))));
    // An active message after the put: the flush needs a request of its own.
    put(&a, 15, base);
    a.am(3, b"x");
    assert!(!a.c().ops.flush_behind_last(16));
    complete(&mut a, &mut b, 15).unwrap();
    assert!(
        !a.c().ops.all_answered(),
        "the message is not known processed"
    );
    // The connection fails with a flush waiting: it fails too.
    put(&a, 17, base);
    assert!(a.c().ops.flush_behind_last(18));
    a.c().fail("cut");
    a.step();
    assert!(matches!(a.completion(17), Some(Err(_))));
    assert!(matches!(a.completion(18), Some(Err(_))));
    drop(th);
}

#[test]
fn a_refused_access_fails_the_operation_not_the_connection() {
    let (mut a, mut b) = pair(1 << 20, usize::MAX);
    a.c().ep = Some(1);
    let mut target = vec![0u8; 64];
    let base = target.as_ptr() as u64;
    let (th, _rkey, k) = expose(&a, &b, &mut target);
    drop(th);
    let op = a.c().ops.next_op();
    let head = wire::put_head(op, k.md_id, k.reg_id, base, 8);
    a.c()
        .request(
            &[Part::Bytes(&head), Part::Bytes(&[1; 8])],
            Some(4),
            PendKind::Put,
        )
        .unwrap();
    let e = complete(&mut a, &mut b, 4).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidRkey { reason, .. } if reason.contains("not live")),
        "{e}"
    );
    assert!(target.iter().all(|&x| x == 0));
    // A refused put_short has no completion: it fails the endpoint.
    let op = a.c().ops.next_op();
    let head = wire::put_head(op, k.md_id, k.reg_id, base, 8);
    a.c()
        .request(
            &[Part::Bytes(&head), Part::Bytes(&[1; 8])],
            None,
            PendKind::Put,
        )
        .unwrap();
    drive(&mut a, &mut b, |a, _| a.ep_error().is_some());
    assert!(a.ep_error().unwrap().contains("refused a put_short"));
}

#[test]
fn endpoints_leaving_detach_and_both_sides_close() {
    let (mut a, mut b) = pair(1 << 20, usize::MAX);
    a.c().ep = Some(1);
    b.c().ep = Some(2);
    a.am(1, b"x");
    drive(&mut a, &mut b, |_, b| !b.ams.is_empty());
    // A's endpoint goes: what it posted is still sent, then Detach; B keeps its endpoint and
    // the connection.
    a.am(2, b"last");
    a.c().endpoint_gone();
    assert!(a.c().detach_sent);
    drive(&mut a, &mut b, |_, b| b.c().peer_detached);
    assert_eq!(b.ams.len(), 2);
    assert!(!b.c().closing, "B's endpoint still uses it");
    b.am(3, b"still here");
    drive(&mut a, &mut b, |a, _| !a.ams.is_empty());
    // B's goes too: B has nothing left and half-closes; A sees the end and lets go; so does B.
    b.c().endpoint_gone();
    let mut gone = (false, false);
    drive(&mut a, &mut b, |a, b| {
        gone.0 |= a.step().gone;
        gone.1 |= b.step().gone;
        gone == (true, true)
    });
    assert!(a.events.is_empty() && b.events.is_empty(), "quietly");
}

#[test]
fn a_connect_that_never_finishes_times_out_and_fails_what_waited() {
    let (mut a, _b) = pair(1 << 20, usize::MAX);
    a.c().ep = Some(1);
    a.c().sock.connecting = true;
    a.c()
        .request(
            &[Part::Bytes(&wire::words_frame(Kind::Flush, &[1], &[]))],
            Some(9),
            PendKind::Flush,
        )
        .unwrap();
    let idle = Ready::default();
    assert!(a.step_with(idle).timed);
    assert!(a.failure().is_none());
    a.now += TIMEOUT + Duration::from_millis(1);
    let p = a.step_with(idle);
    assert!(a.failure().unwrap().contains("connect timed out"));
    assert!(!p.timed && !p.read && !p.write);
    assert!(matches!(
        a.completion(9),
        Some(Err(Error::EndpointFailure { .. }))
    ));
    assert!(a.ep_error().unwrap().contains("RUCX_TCP_CONNECT_TIMEOUT"));
    // A refused connect fails the same way.
    let (mut a, _b) = pair(1 << 20, usize::MAX);
    a.c().ep = Some(1);
    a.c().sock.connect = Some(std::io::ErrorKind::ConnectionRefused);
    a.step();
    assert!(a.failure().unwrap().starts_with("connect: "));
}

#[test]
fn the_larger_address_moves() {
    assert!(merge::we_move(B, A) && !merge::we_move(A, B));
    let lower_ip = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 1);
    assert!(
        merge::we_move(lower_ip, B),
        "the address orders before the port"
    );
}

/// Simultaneous connects: X (the larger address, which moves) and Y each dialed the other.
/// X moves its endpoint from the connection it dialed (D) onto the one Y dialed (J), with
/// `Joined` there and `Detach` on D; Y handles D up to that `Detach` before anything after
/// `Joined`, so X's messages arrive in order.
#[test]
fn a_moved_endpoint_keeps_its_messages_in_order() {
    // D: X dialed Y.
    let (d_x, d_y) = memsock::pair(1 << 20, usize::MAX);
    let d_x_local = d_x.local;
    let mut xd = End::new(d_x, B, Some(A), SocketAddr::V4(A));
    let mut yd = End::new(d_y, A, None, SocketAddr::V4(d_x_local));
    // J: Y dialed X.
    let (j_y, j_x) = memsock::pair(1 << 20, usize::MAX);
    let j_y_local = j_y.local;
    let mut yj = End::new(j_y, A, Some(B), SocketAddr::V4(B));
    let mut xj = End::new(j_x, B, None, SocketAddr::V4(j_y_local));
    xd.c().ep = Some(1);
    yj.c().ep = Some(2);
    drive(&mut xd, &mut yd, |_, y| y.rx.hello);
    drive(&mut yj, &mut xj, |_, x| x.rx.hello);
    xd.am(1, b"on D");
    // Nothing may move while a message is queued on D.
    xd.c().tx.push_owned(b"", Some(0));
    assert_eq!(merge::move_endpoint(&mut xd.c(), &mut xj.c()), Merge::Wait);
    xd.c().tx.clear();
    xd.step();
    // X moves: `xd`'s object (the endpoint's) now writes J; `xj`'s writes D.
    assert!(merge::movable(&xd.c(), A));
    assert_eq!(merge::move_endpoint(&mut xd.c(), &mut xj.c()), Merge::Done);
    assert!(xd.c().ep == Some(1) && xj.c().ep.is_none() && xj.c().detach_sent);
    assert_eq!(merge::move_endpoint(&mut xd.c(), &mut xj.c()), Merge::Abort);
    // X's next message goes out on J right behind `Joined`.
    xd.am(2, b"on J");
    // Y reads J first: `Joined` names D (by X's local address of it), and what follows waits.
    yj.step();
    assert_eq!(yj.rx.joined, Some(d_x_local));
    assert!(yj.ams.is_empty());
    // The interface resolves `Joined` to Y's side of D, whose `Detach` is still to come.
    let left = yj.rx.joined.take().unwrap();
    assert!(merge::left_and_pending(&yd.c(), left));
    assert!(!merge::left_and_pending(&yj.c(), left));
    yj.rx.wait = Some(yd.conn.clone());
    assert!(yj.step().again, "held back, to be looked at again");
    assert!(yj.ams.is_empty());
    // Y reads D: the message before the move, then `Detach`; now J's may follow.
    yd.step();
    assert_eq!(yd.ams, vec![(1, b"on D".to_vec())]);
    assert!(yd.c().peer_detached);
    yj.step();
    assert_eq!(yj.ams, vec![(2, b"on J".to_vec())]);
    assert!(yj.rx.wait.is_none());
}

#[test]
fn scatter_fills_pieces_from_any_offset() {
    let md = TcpMd::new(Vec::new(), TcpOptions::default());
    let mut bufs = [vec![0u8; 3], vec![0u8; 1], vec![0u8; 5]];
    let dst: Vec<(MemHandle, usize, usize)> = bufs
        .iter_mut()
        .map(|v| {
            // SAFETY: `bufs` outlives the handles.
            let h = unsafe { md.mem_reg(MemRegion::of_slice(v)) }.unwrap();
            (h, v.as_mut_ptr() as usize, v.len())
        })
        .collect();
    scatter(&dst, 0, &[1, 2]);
    scatter(&dst, 2, &[3, 4, 5]);
    scatter(&dst, 5, &[6, 7, 8, 9]);
    drop(dst);
    assert_eq!(bufs, [vec![1, 2, 3], vec![4], vec![5, 6, 7, 8, 9]]);
}

/// What B did with a stream: the active messages, its answers, and how the connection ended.
type Outcome = (Vec<(u8, Vec<u8>)>, Vec<u8>, Option<String>);

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A valid stream (hello, active messages, puts large and small, a refused put, flushes,
    /// a get request) gives the same messages, answers, memory and state however it is cut
    /// into reads, and whether each step reads ahead (the interface's lone-connection read)
    /// or is told the socket is ready.
    #[test]
    fn any_split_of_a_valid_stream_gives_the_same_result(
        sizes in proptest::collection::vec(0usize..6000, 1..8),
        cuts in proptest::collection::vec(0usize..60_000, 0..24),
        ahead in any::<bool>(),
    ) {
        let mut target = vec![0u8; 8192];
        let mut run = |cuts: &[usize], ahead: bool| -> (Outcome, Vec<u8>) {
            let (mut raw, mut b) = raw_to_b();
            target.fill(0);
            let base = target.as_ptr() as u64;
            // SAFETY: `target` outlives the handle (dropped below, first).
            let th = unsafe { b.md.mem_reg(MemRegion::of_slice(&target)) }.unwrap();
            let k = *b.md.rkey_unpack(&b.md.mkey_pack(&th).unwrap()).unwrap().inner::<TcpRkey>().unwrap();
            let mut stream = wire::hello_frame(A);
            for (i, &n) in sizes.iter().enumerate() {
                let op = 1 + i as u64 * 3;
                let data: Vec<u8> = (0..n.min(8000)).map(|j| (i * 31 + j) as u8).collect();
                stream.extend(am_frame(i as u8, &data[..n.min(300)]));
                stream.extend(wire::put_head(op, k.md_id, k.reg_id, base + (i as u64 * 13) % 100, data.len()));
                stream.extend(&data);
                // Refused: outside the registration.
                stream.extend(wire::put_head(op + 1, k.md_id, k.reg_id, base + 8000, 500));
                stream.extend([9u8; 500]);
                stream.extend(wire::words_frame(Kind::Flush, &[op + 2], &[]));
            }
            stream.extend(wire::words_frame(Kind::GetReq, &[999, k.md_id, k.reg_id, base, 64], &[]));
            stream.extend(wire::detach_frame());
            let mut cuts = cuts.to_vec();
            cuts.sort_unstable();
            let mut at = 0;
            for c in cuts.into_iter().chain([stream.len()]) {
                let c = c.clamp(at, stream.len());
                raw.inject(&stream[at..c]);
                at = c;
                if ahead {
                    // The interface's lone-connection read: straight into the buffer or the
                    // destination, the step only when something arrived.
                    b.step_ahead();
                } else {
                    b.step();
                }
            }
            for _ in 0..4 {
                b.step();
            }
            let answers = raw.take_all();
            drop(th);
            ((b.ams.clone(), answers, b.failure()), target.clone())
        };
        let (whole, whole_mem) = run(&[], false);
        prop_assert!(whole.2.is_none(), "{:?}", whole.2);
        prop_assert_eq!(whole.0.len(), sizes.len());
        let answers = frames(&whole.1);
        // Hello, then per round: ack, refusal, ack; then the get's data.
        prop_assert_eq!(answers.len(), 2 + sizes.len() * 3);
        prop_assert_eq!(answers.last().unwrap().0.kind, Kind::GetRep);
        let (split, split_mem) = run(&cuts, ahead);
        prop_assert_eq!(&split, &whole);
        prop_assert!(split_mem == whole_mem);
    }

    /// Garbage after a valid hello never panics; whatever B sent back is a valid frame
    /// sequence (its hello, maybe answers, maybe a `Fatal` with the reason), and a connection
    /// it gave up on is closed.
    #[test]
    fn garbage_after_hello_never_hurts(
        garbage in proptest::collection::vec(any::<u8>(), 0..400),
        cut in 1usize..64,
    ) {
        let (mut raw, mut b) = raw_to_b();
        b.c().ep = Some(1);
        raw.inject(&wire::hello_frame(A));
        b.step();
        for piece in garbage.chunks(cut) {
            raw.inject(piece);
            b.step();
        }
        let out = frames(&raw.take_all());
        prop_assert_eq!(out[0].0.kind, Kind::Hello);
        if let Some(reason) = b.failure() {
            prop_assert!(raw.peer_closed(), "{}", reason);
            prop_assert!(b.ep_error().is_some());
        }
    }
}
