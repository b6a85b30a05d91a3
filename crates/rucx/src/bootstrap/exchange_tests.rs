//! The rendezvous over loopback sockets, with stand-in worker addresses (no worker needed):
//! keys, forged and duplicate claims, garbage, silence, eviction, departures, the interface.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::server::{self, Limits};
use super::wire::{self, CHALLENGE_LEN, Challenge, Hello, Key, NONCE};
use super::{Placement, client};
use rucx_ucs::Error;

type Served = rucx_ucs::Result<(Vec<Vec<u8>>, Vec<TcpStream>)>;

const KEY: &str = "test-key-0123456789abcdef";
const LONG: Duration = Duration::from_secs(30);

fn free_addr(ip: [u8; 4]) -> SocketAddr {
    TcpListener::bind(SocketAddr::from((ip, 0)))
        .and_then(|l| l.local_addr())
        .unwrap()
}

fn place(rank: usize, size: usize) -> Placement {
    Placement {
        rank,
        size,
        source: "test",
        all_local: true,
        job_id: None,
    }
}

fn addr_of(rank: usize) -> Vec<u8> {
    format!("worker address of rank {rank}").into_bytes()
}

fn key(text: &str) -> Option<Key> {
    Key::from_text(text)
}

fn rank0(
    at: SocketAddr,
    size: usize,
    k: Option<Key>,
    timeout: Duration,
    limits: Limits,
) -> JoinHandle<Served> {
    let l = server::listen(at).unwrap();
    std::thread::spawn(move || {
        server::serve(
            &place(0, size),
            &l,
            &addr_of(0),
            k.as_ref(),
            timeout,
            limits,
        )
    })
}

fn rank(
    at: SocketAddr,
    r: usize,
    size: usize,
    k: Option<Key>,
) -> JoinHandle<rucx_ucs::Result<Vec<Vec<u8>>>> {
    std::thread::spawn(move || {
        client::join(
            &place(r, size),
            at,
            &addr_of(r),
            k.as_ref(),
            LONG,
            server::LIMITS,
        )
        .map(|(t, _s)| t)
    })
}

fn table(size: usize) -> Vec<Vec<u8>> {
    (0..size).map(addr_of).collect()
}

/// A handshake by hand: `Hello` for (`r`, `n`), then a `Join` proved with `k` (zeros without);
/// returns rank 0's verdict (status, reason) and the connection.
fn by_hand(at: SocketAddr, r: u32, n: u32, k: Option<&Key>) -> (u32, String, TcpStream) {
    let mut s = TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    let hello = Hello {
        rank: r,
        size: n,
        nonce: [r as u8; NONCE],
    };
    s.write_all(&hello.encode()).unwrap();
    let mut b = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut b).unwrap();
    let ch = Challenge::decode(&b).unwrap();
    let proof = wire::client_proof(k, &hello, &ch.nonce, b"forged");
    s.write_all(&wire::encode_join(b"forged", &proof)).unwrap();
    let mut v = [0u8; 8];
    if s.read_exact(&mut v).is_err() {
        return (u32::MAX, "closed".into(), s);
    }
    let len = u32::from_le_bytes(v[4..].try_into().unwrap()) as usize;
    let mut reason = vec![0u8; len];
    s.read_exact(&mut reason).unwrap();
    (
        u32::from_le_bytes(v[..4].try_into().unwrap()),
        String::from_utf8_lossy(&reason).into_owned(),
        s,
    )
}

#[test]
fn a_keyed_job_forms_and_every_rank_gets_the_same_table() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 3, key(KEY), LONG, server::LIMITS);
    let r1 = rank(at, 1, 3, key(KEY));
    let r2 = rank(at, 2, 3, key(KEY));
    let (t0, conns) = r0.join().unwrap().unwrap();
    assert_eq!(t0, table(3));
    assert_eq!(conns.len(), 2);
    assert_eq!(r1.join().unwrap().unwrap(), table(3));
    assert_eq!(r2.join().unwrap().unwrap(), table(3));
}

#[test]
fn a_wrong_key_is_refused_and_the_job_goes_on() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 2, key(KEY), LONG, server::LIMITS);
    let e = rank(at, 1, 2, key("another-key-0123456789"))
        .join()
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("RUCX_BOOTSTRAP_KEY differs"), "{e}");
    // A stranger that skips checking rank 0's proof still cannot join.
    let (status, reason, _s) = by_hand(at, 1, 2, key("another-key-0123456789").as_ref());
    assert_eq!((status, reason.as_str()), (u32::MAX, "closed"));
    let (status, _, _s) = by_hand(at, 1, 2, None);
    assert_eq!(
        status,
        u32::MAX,
        "a join without proof is dropped unanswered"
    );
    assert_eq!(rank(at, 1, 2, key(KEY)).join().unwrap().unwrap(), table(2));
    assert_eq!(r0.join().unwrap().unwrap().0, table(2));
}

#[test]
fn a_key_on_one_side_only_is_a_clear_error() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 2, key(KEY), LONG, server::LIMITS);
    let e = rank(at, 1, 2, None).join().unwrap().unwrap_err();
    assert!(e.to_string().contains("requires a job key"), "{e}");
    rank(at, 1, 2, key(KEY)).join().unwrap().unwrap();
    r0.join().unwrap().unwrap();

    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 2, None, LONG, server::LIMITS);
    let e = rank(at, 1, 2, key(KEY)).join().unwrap().unwrap_err();
    assert!(e.to_string().contains("refusing an unauthenticated"), "{e}");
    rank(at, 1, 2, None).join().unwrap().unwrap();
    r0.join().unwrap().unwrap();
}

#[test]
fn forged_and_out_of_range_claims_do_not_end_the_job() {
    // Without a key (the case of the original report: rank 5 of 2 ended the server).
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 2, None, LONG, server::LIMITS);
    let (status, reason, _s) = by_hand(at, 5, 2, None);
    assert_eq!(status, 1);
    assert!(reason.contains("rank 5 is not a rank"), "{reason}");
    let (status, reason, _s) = by_hand(at, 0, 2, None);
    assert_eq!(status, 1, "{reason}");
    let (status, reason, _s) = by_hand(at, 1, 7, None);
    assert_eq!(status, 1);
    assert!(reason.contains("claims a job of 7"), "{reason}");
    let e = rank(at, 1, 3, None).join().unwrap().unwrap_err();
    assert!(e.to_string().contains("same size"), "{e}");
    assert_eq!(rank(at, 1, 2, None).join().unwrap().unwrap(), table(2));
    r0.join().unwrap().unwrap();
}

#[test]
fn a_duplicate_rank_is_refused_and_the_first_stays() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 3, key(KEY), LONG, server::LIMITS);
    // The first rank 1 is in once its verdict came.
    let (status, reason, first) = by_hand(at, 1, 3, key(KEY).as_ref());
    assert_eq!(status, 0, "{reason}");
    let e = rank(at, 1, 3, key(KEY)).join().unwrap().unwrap_err();
    assert!(e.to_string().contains("rank 1 already joined"), "{e}");
    let mut want = table(3);
    want[1] = b"forged".to_vec();
    assert_eq!(rank(at, 2, 3, key(KEY)).join().unwrap().unwrap(), want);
    assert_eq!(r0.join().unwrap().unwrap().0, want);
    drop(first);
}

#[test]
fn garbage_truncation_and_silence_hold_nobody_up() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 2, key(KEY), LONG, server::LIMITS);
    let mut keep = Vec::new();
    // Random bytes, a foreign protocol, an older version, a truncated header, silence.
    let mut junk = TcpStream::connect(at).unwrap();
    junk.write_all(&[0x5a; 300]).unwrap();
    keep.push(junk);
    let mut http = TcpStream::connect(at).unwrap();
    http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    keep.push(http);
    let mut old = Hello {
        rank: 1,
        size: 2,
        nonce: [0; NONCE],
    }
    .encode();
    old[8] = 1;
    let mut v1 = TcpStream::connect(at).unwrap();
    v1.write_all(&old).unwrap();
    keep.push(v1);
    let mut cut = TcpStream::connect(at).unwrap();
    cut.write_all(&old[..10]).unwrap();
    keep.push(cut);
    for _ in 0..20 {
        keep.push(TcpStream::connect(at).unwrap());
    }
    let start = Instant::now();
    assert_eq!(rank(at, 1, 2, key(KEY)).join().unwrap().unwrap(), table(2));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(10), "a real rank took {took:?}");
    r0.join().unwrap().unwrap();
}

#[test]
fn a_full_house_evicts_the_handshakes_furthest_behind() {
    let at = free_addr([127, 0, 0, 1]);
    let limits = Limits {
        max_pending: 4,
        handshake: Duration::from_secs(30),
    };
    let r0 = rank0(at, 2, key(KEY), LONG, limits);
    let idle: Vec<TcpStream> = (0..50).map(|_| TcpStream::connect(at).unwrap()).collect();
    assert_eq!(rank(at, 1, 2, key(KEY)).join().unwrap().unwrap(), table(2));
    r0.join().unwrap().unwrap();
    drop(idle);
}

#[test]
fn silent_handshakes_expire() {
    let at = free_addr([127, 0, 0, 1]);
    let limits = Limits {
        max_pending: 128,
        handshake: Duration::from_millis(200),
    };
    let r0 = rank0(at, 2, key(KEY), LONG, limits);
    let mut idle = TcpStream::connect(at).unwrap();
    idle.set_read_timeout(Some(LONG)).unwrap();
    let start = Instant::now();
    let mut b = [0u8; 1];
    // Rank 0 hangs up on it once its handshake time is over.
    assert_eq!(idle.read(&mut b).unwrap_or(0), 0);
    assert!(start.elapsed() < Duration::from_secs(10));
    rank(at, 1, 2, key(KEY)).join().unwrap().unwrap();
    r0.join().unwrap().unwrap();
}

#[test]
fn a_rank_that_leaves_before_the_job_forms_frees_its_place() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 3, None, LONG, server::LIMITS);
    let (status, _, s) = by_hand(at, 1, 3, None);
    assert_eq!(status, 0, "accepted");
    drop(s);
    let r2 = rank(at, 2, 3, None);
    // The real rank 1 may come before rank 0 saw the first one leave: then it is refused as a
    // duplicate and tries again here.
    let start = Instant::now();
    let r1 = loop {
        match rank(at, 1, 3, None).join().unwrap() {
            Err(e) if e.to_string().contains("already joined") && start.elapsed() < LONG => {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => break other,
        }
    };
    assert_eq!(r1.unwrap(), table(3));
    assert_eq!(r2.join().unwrap().unwrap(), table(3));
    assert_eq!(r0.join().unwrap().unwrap().0, table(3));
}

#[test]
fn rank0_listens_only_on_the_address_asked_for() {
    let at = free_addr([127, 0, 0, 2]);
    let r0 = rank0(at, 2, None, LONG, server::LIMITS);
    let elsewhere = SocketAddr::from(([127, 0, 0, 1], at.port()));
    let e = TcpStream::connect(elsewhere).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    rank(at, 1, 2, None).join().unwrap().unwrap();
    r0.join().unwrap().unwrap();
}

#[test]
fn a_timeout_names_the_missing_ranks_and_what_was_dropped() {
    let at = free_addr([127, 0, 0, 1]);
    let r0 = rank0(at, 2, key(KEY), Duration::from_millis(500), server::LIMITS);
    let _ = by_hand(at, 1, 2, key("another-key-0123456789").as_ref());
    let e = r0.join().unwrap().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    let s = e.to_string();
    assert!(
        s.contains("[1]") && s.contains("without this job's key"),
        "{s}"
    );
}
