//! A hostile peer: protocol messages forged with every field chosen to hurt (request ids of
//! other peers' transfers, of the worker's own sends and receives, offsets and sizes past
//! every buffer, garbage keys, unknown senders, truncated and bit-flipped encodings, unknown
//! active-message ids), handed to a worker in the middle of real transfers with another peer,
//! as its transport would hand them (`State::on_event`: an error is logged and dropped).
//!
//! Three workers over one transport in this process: A (the victim), B (its honest peer) and
//! H (wired up to A honestly, then impersonated by the forged messages). Whatever H sends,
//! A's transfers with B complete whole and correct; forged in B's name (a peer can claim any
//! identity), they may fail or carry the forger's bytes, but nothing panics, nothing is written
//! past a buffer, and every request ends by the end of a `scope_timeout`.

use std::time::Duration;

use proptest::prelude::*;

use crate::TAG_MASK_FULL;
use crate::worker::prelude::*;

/// Guard bytes on each side of every receive buffer.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xa5;
/// Legitimate tags; forged messages use tags below this.
const LEGIT_TAG: u64 = 1 << 20;

fn worker(tls: &str) -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(crate::CONFIG);
    let cfg = rucx_ucs::Config::from_vars(&tables, [("RUCX_TLS", tls)]).unwrap();
    let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
    Worker::new(&ctx).unwrap()
}

fn uuid(w: &Worker) -> u64 {
    w.st.borrow().address.uuid
}

/// Who a forged message claims to come from.
#[derive(Clone, Copy, Debug)]
enum Src {
    /// H, a peer A knows.
    Hostile,
    /// B, A's honest peer (impersonated).
    Spoof,
    /// A worker A never heard of.
    Unknown(u64),
}

#[derive(Clone, Debug)]
struct Forge {
    kind: u8,
    src: Src,
    /// Request ids: an index into A's and B's live requests, or a raw number.
    ids: [Result<u16, u64>; 2],
    nums: [u64; 3],
    len: u16,
    flag: bool,
    key: u8,
    tag: u8,
}

#[derive(Clone, Debug)]
enum Op {
    /// Post the next legitimate operation of this kind (A receives from B, B sends to A,
    /// A sends to B, B receives from A).
    Legit(u8),
    Progress(u8),
    Forge(Forge),
    /// A forged message's encoding cut at `cut` and with one byte xored.
    Mangled(Forge, usize, usize, u8),
    /// Bytes under any active-message id.
    Garbage(u8, Vec<u8>),
    /// Cancel A's live request at this index (a user's cancel racing the forgery).
    Cancel(u16),
}

fn num() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1u64),
        0u64..400_000,
        Just(u64::MAX),
        Just(u64::MAX - 7),
        Just(1u64 << 40),
        Just(usize::MAX as u64 / 2),
        any::<u64>(),
    ]
}

fn id_sel() -> impl Strategy<Value = Result<u16, u64>> {
    prop_oneof![3 => any::<u16>().prop_map(Ok), 1 => num().prop_map(Err)]
}

fn forge(spoof: bool) -> impl Strategy<Value = Forge> {
    let src = if spoof {
        prop_oneof![
            2 => Just(Src::Spoof),
            1 => Just(Src::Hostile),
            1 => any::<u64>().prop_map(Src::Unknown),
        ]
        .boxed()
    } else {
        prop_oneof![4 => Just(Src::Hostile), 1 => any::<u64>().prop_map(Src::Unknown)].boxed()
    };
    (
        0u8..24,
        src,
        [id_sel(), id_sel()],
        [num(), num(), num()],
        prop_oneof![0u16..64, 0u16..9000],
        any::<bool>(),
        0u8..5,
        any::<u8>(),
    )
        .prop_map(|(kind, src, ids, nums, len, flag, key, tag)| Forge {
            kind,
            src,
            ids,
            nums,
            len,
            flag,
            key,
            tag,
        })
}

fn op(spoof: bool) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<u8>().prop_map(Op::Legit),
        2 => (1u8..20).prop_map(Op::Progress),
        6 => forge(spoof).prop_map(Op::Forge),
        1 => (forge(spoof), 0usize..200, any::<usize>(), 1u8..=255)
            .prop_map(|(f, c, i, x)| Op::Mangled(f, c, i, x)),
        1 => (0u8..32, prop::collection::vec(any::<u8>(), 0..80))
            .prop_map(|(i, b)| Op::Garbage(i, b)),
        1 => any::<u16>().prop_map(Op::Cancel),
    ]
}

/// Sizes of every class (short, one-fragment, multi-fragment eager, rendezvous).
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        1usize..200,
        200usize..9000,
        9000usize..70_000,
        70_000usize..400_000,
    ]
}

struct Env {
    a: Worker,
    b: Worker,
    h: Worker,
    /// A's endpoint to B, B's to A.
    a2b: EpId,
    b2a: EpId,
}

fn env(tls: &str) -> Env {
    let (a, b, h) = (worker(tls), worker(tls), worker(tls));
    let a2b = a.connect(&b.address()).unwrap();
    let b2a = b.connect(&a.address()).unwrap();
    h.connect(&a.address()).unwrap();
    let ua = uuid(&a);
    for _ in 0..100_000 {
        a.progress();
        b.progress();
        h.progress();
        let st = a.st.borrow();
        let hp = st.by_uuid.get(&uuid(&h)).copied();
        if hp.is_some_and(|p| st.peers[p].connected) && st.by_uuid.contains_key(&uuid(&b)) {
            drop(st);
            if b.st.borrow().by_uuid.contains_key(&ua) {
                return Env { a, b, h, a2b, b2a };
            }
        }
    }
    panic!("wire-up did not finish");
}

/// Message `i`'s bytes.
fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7 + 1) as u8).collect()
}

/// The live request ids of A and B (a forger that saw B's traffic knows B's), in id order.
fn live_ids(e: &Env) -> Vec<u64> {
    let mut v: Vec<u64> = [&e.a, &e.b]
        .iter()
        .flat_map(|w| {
            w.st.borrow()
                .reqs
                .iter()
                .map(|(id, _)| id)
                .collect::<Vec<_>>()
        })
        .collect();
    v.sort_unstable();
    v
}

/// A garbage key of one of A's domains, or of none.
fn key(sel: u8, n: u64, md: &str) -> NamedKey {
    let mut k = n.to_le_bytes().to_vec();
    match sel % 4 {
        0 => NamedKey {
            md: md.into(),
            key: k,
        },
        1 => {
            // An envelope naming the domain with a payload of random words.
            let mut e = vec![0u8, 0, 1, md.len() as u8];
            e.extend_from_slice(md.as_bytes());
            e.extend_from_slice(&(k.len() as u32 * 4).to_le_bytes());
            for _ in 0..4 {
                e.append(&mut k.clone());
            }
            NamedKey {
                md: md.into(),
                key: e,
            }
        }
        2 => NamedKey {
            md: "nowhere".into(),
            key: std::mem::take(&mut k),
        },
        _ => NamedKey {
            md: String::new(),
            key: Vec::new(),
        },
    }
}

/// The forged message's id and bytes.
fn build(f: &Forge, e: &Env, md: &str) -> (AmId, Vec<u8>) {
    let src = match f.src {
        Src::Hostile => uuid(&e.h),
        Src::Spoof => uuid(&e.b),
        Src::Unknown(u) => u | 1,
    };
    let live = live_ids(e);
    let rid = |i: usize| match f.ids[i] {
        Ok(k) if !live.is_empty() => live[k as usize % live.len()],
        Ok(k) => u64::from(k),
        Err(n) => n,
    };
    let (r0, r1) = (rid(0), rid(1));
    let [n0, n1, n2] = f.nums;
    let data = vec![0x5au8; f.len as usize];
    let tag = u64::from(f.tag % 16);
    let keys = if f.key == 4 {
        Vec::new()
    } else {
        vec![key(f.key, n2, md)]
    };
    let reason = "forged";
    // A wire-up names H (a reconnect), A itself, B (only when impersonating B), or garbage.
    let wireup_addr = match (n1 % 4, f.src) {
        (0, _) => data.clone(),
        (1, Src::Spoof) => e.b.address(),
        (2, _) => e.a.address(),
        _ => e.h.address(),
    };
    let m = match f.kind {
        0 => Msg::Wireup {
            ep: n0,
            addr: &wireup_addr,
        },
        1 => Msg::EagerOne {
            src,
            tag,
            data: &data,
        },
        2 => Msg::StreamData { src, data: &data },
        3 => Msg::EagerSync {
            src,
            tag,
            sreq: r0,
            data: &data,
        },
        4 => Msg::EagerFirst {
            src,
            kind: if f.flag { MsgKind::Am } else { MsgKind::Tag },
            tag,
            msg_id: n0 % 4,
            total: n1,
            data: &data,
        },
        5 => Msg::EagerMiddle {
            src,
            msg_id: n0 % 4,
            offset: n1,
            data: &data,
        },
        6 => Msg::Rts {
            src,
            tag,
            sreq: r0,
            size: n0,
            addr: n1,
            smem: (n2 % 5) as u8,
            keys,
        },
        7 => Msg::Pull {
            src,
            sreq: r0,
            rreq: r1,
        },
        8 => Msg::Frag {
            src,
            rreq: r0,
            sreq: r1,
            offset: n0,
            len: n1,
            addr: n2,
            frag: n2 % 8,
            key: key(f.key, n2, md),
        },
        9 => Msg::FragAck {
            src,
            sreq: r0,
            frag: n0 % 8,
            len: n1,
        },
        10 => Msg::Ats {
            src,
            sreq: r0,
            ok: f.flag,
        },
        11 => Msg::Rtr {
            src,
            sreq: r0,
            rreq: r1,
            addr: n0,
            size: n1,
            offset: n2,
            keys,
        },
        12 => Msg::RndvData {
            src,
            rreq: r0,
            offset: n0,
            data: &data,
        },
        13 => Msg::Fin { src, rreq: r0 },
        14 => Msg::Abort {
            src,
            sreq: r0,
            rreq: r1,
            by_sender: f.flag,
            reason,
        },
        15 => Msg::EagerAbort {
            src,
            msg_id: n0 % 4,
            reason,
        },
        16 => Msg::Keepalive { src, reply: f.flag },
        17 => Msg::Cancel {
            src,
            sreq: r0,
            step: match n0 % 3 {
                0 => wire::CancelStep::Ask,
                1 => wire::CancelStep::Dropped,
                _ => wire::CancelStep::TooLate,
            },
        },
        18 => Msg::Disconnect { src },
        19 => Msg::User {
            src,
            id: f.tag.into(),
            header: &data[..data.len().min(9)],
            data: &data,
        },
        20 => Msg::StagingOffer {
            src,
            key: key(f.key, n2, md),
        },
        21 => Msg::AmRts {
            src,
            sreq: r0,
            size: n0,
            addr: n1,
            smem: (n2 % 5) as u8,
            id: f.tag.into(),
            header: &data[..data.len().min(9)],
            keys,
        },
        // The short form, whose header is the tag.
        _ => {
            let mut b = tag.to_le_bytes().to_vec();
            b.extend_from_slice(&src.to_le_bytes());
            b.extend_from_slice(&data);
            return (wire::AM_EAGER_SHORT, b);
        }
    };
    m.encode()
}

/// Hand A a message as its transport would.
fn deliver(a: &Worker, id: AmId, bytes: &[u8]) {
    a.st.borrow_mut().on_event(0, Event::Am { id, data: bytes });
}

fn guarded(len: usize) -> Vec<u8> {
    vec![GUARD_BYTE; len + 2 * GUARD]
}

fn guards_intact(b: &[u8]) -> bool {
    let n = b.len();
    b[..GUARD].iter().all(|&x| x == GUARD_BYTE) && b[n - GUARD..].iter().all(|&x| x == GUARD_BYTE)
}

#[derive(Debug, Clone)]
struct Case {
    /// Legitimate message sizes, B to A and A to B (B's receives are exact; A's receives are
    /// exact too, so the data can be checked).
    b2a: Vec<(usize, bool)>,
    a2b: Vec<(usize, bool)>,
    ops: Vec<Op>,
}

fn case(spoof: bool) -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((size(), any::<bool>()), 0..5),
        prop::collection::vec((size(), any::<bool>()), 0..5),
        prop::collection::vec(op(spoof), 1..60),
    )
        .prop_map(|(b2a, a2b, ops)| Case { b2a, a2b, ops })
}

fn run(tls: &str, c: &Case, spoof: bool) {
    let e = env(tls);
    let md = tls.split(',').next().unwrap().to_string();
    let mut a_recv: Vec<Vec<u8>> = c.b2a.iter().map(|&(n, _)| guarded(n)).collect();
    let mut b_recv: Vec<Vec<u8>> = c.a2b.iter().map(|&(n, _)| guarded(n)).collect();
    let b_send: Vec<Vec<u8>> = c
        .b2a
        .iter()
        .enumerate()
        .map(|(i, &(n, _))| pattern(i, n))
        .collect();
    let a_send: Vec<Vec<u8>> = c
        .a2b
        .iter()
        .enumerate()
        .map(|(i, &(n, _))| pattern(100 + i, n))
        .collect();
    let limit = Duration::from_millis(300);
    let mut legit_ok = true;
    let mut report = String::new();
    let res = e.a.scope_timeout(limit, |sa| {
        e.b.scope_timeout(limit, |sb| {
            let mut ar = a_recv
                .iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    let n = b.len();
                    (i, &mut b[GUARD..n - GUARD])
                })
                .collect::<Vec<_>>()
                .into_iter();
            let mut br = b_recv
                .iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    let n = b.len();
                    (i, &mut b[GUARD..n - GUARD])
                })
                .collect::<Vec<_>>()
                .into_iter();
            let mut bs = b_send.iter().enumerate();
            let mut asend = a_send.iter().enumerate();
            // The next legitimate operation of kind `k`: (on A, what, request).
            let mut post = |k: u8| match k % 4 {
                0 => ar.next().map(|(i, buf)| {
                    let r = sa.tag_recv(buf, LEGIT_TAG + i as u64, TAG_MASK_FULL);
                    (true, format!("A recv {i}"), r)
                }),
                1 => bs.next().map(|(i, buf)| {
                    let t = LEGIT_TAG + i as u64;
                    let r = if c.b2a[i].1 {
                        sb.tag_send_sync(e.b2a, &buf[..], t)
                    } else {
                        sb.tag_send(e.b2a, &buf[..], t)
                    };
                    (false, format!("B send {i}"), r)
                }),
                2 => asend.next().map(|(i, buf)| {
                    let t = LEGIT_TAG + 100 + i as u64;
                    let r = if c.a2b[i].1 {
                        sa.tag_send_sync(e.a2b, &buf[..], t)
                    } else {
                        sa.tag_send(e.a2b, &buf[..], t)
                    };
                    (true, format!("A send {i}"), r)
                }),
                _ => br.next().map(|(i, buf)| {
                    let r = sb.tag_recv(buf, LEGIT_TAG + 100 + i as u64, TAG_MASK_FULL);
                    (false, format!("B recv {i}"), r)
                }),
            };
            let mut reqs_a = Vec::new();
            let mut reqs_b = Vec::new();
            let keep = |p: Option<(bool, String, _)>, reqs_a: &mut Vec<_>, reqs_b: &mut Vec<_>| {
                if let Some((on_a, what, r)) = p {
                    if on_a {
                        reqs_a.push((what, r));
                    } else {
                        reqs_b.push((what, r));
                    }
                }
            };
            let step = |n: usize| {
                for _ in 0..n {
                    e.a.progress();
                    e.b.progress();
                    e.h.progress();
                }
            };
            for o in &c.ops {
                match o {
                    Op::Legit(k) => keep(post(*k), &mut reqs_a, &mut reqs_b),
                    Op::Progress(n) => step(*n as usize),
                    Op::Forge(f) => {
                        let (id, bytes) = build(f, &e, &md);
                        deliver(&e.a, id, &bytes);
                    }
                    Op::Mangled(f, cut, at, x) => {
                        let (id, mut bytes) = build(f, &e, &md);
                        if !bytes.is_empty() {
                            let i = at % bytes.len();
                            bytes[i] ^= x;
                        }
                        bytes.truncate(*cut);
                        deliver(&e.a, id, &bytes);
                    }
                    Op::Garbage(id, bytes) => deliver(&e.a, *id, bytes),
                    Op::Cancel(i) => {
                        // Only in spoofing cases: a canceled legitimate request is not
                        // checked for its data.
                        if spoof && !reqs_a.is_empty() {
                            let k = *i as usize % reqs_a.len();
                            let _ = reqs_a[k].1.cancel();
                        }
                    }
                }
            }
            for k in 0..4 {
                for _ in 0..8 {
                    keep(post(k), &mut reqs_a, &mut reqs_b);
                }
            }
            // Drive until every legitimate request ended (or give up after a while: the
            // scope's end then ends them).
            for _ in 0..20_000 {
                if reqs_a
                    .iter()
                    .chain(reqs_b.iter())
                    .all(|(_, r)| r.test().is_some())
                {
                    break;
                }
                step(1);
            }
            for (what, r) in reqs_a.iter().chain(reqs_b.iter()) {
                match r.test() {
                    Some(Ok(_)) => {}
                    other => {
                        legit_ok = false;
                        report.push_str(&format!("{what}: {other:?}\n"));
                    }
                }
            }
        })
    });
    // Every request ended by the end of the scopes, whatever was forged.
    assert_eq!(e.a.live_requests(), 0, "A's requests outlived the scope");
    assert_eq!(e.b.live_requests(), 0, "B's requests outlived the scope");
    for b in a_recv.iter().chain(b_recv.iter()) {
        assert!(
            guards_intact(b),
            "a receive buffer's guard bytes were overwritten"
        );
    }
    if !spoof {
        // Nothing H forged touched A's transfers with B.
        assert!(res.is_ok(), "{res:?}");
        assert!(legit_ok, "legitimate transfers failed:\n{report}");
        for (i, b) in a_recv.iter().enumerate() {
            let n = b.len();
            assert_eq!(&b[GUARD..n - GUARD], &b_send[i][..], "A's receive {i}");
        }
        for (i, b) in b_recv.iter().enumerate() {
            let n = b.len();
            assert_eq!(&b[GUARD..n - GUARD], &a_send[i][..], "B's receive {i}");
        }
    }
    for (i, b) in b_send.iter().enumerate() {
        assert_eq!(b, &pattern(i, b.len()), "B's send buffer {i} was written");
    }
    for (i, b) in a_send.iter().enumerate() {
        assert_eq!(
            b,
            &pattern(100 + i, b.len()),
            "A's send buffer {i} was written"
        );
    }
    // The workers still progress and drop cleanly.
    for _ in 0..100 {
        e.a.progress();
        e.b.progress();
        e.h.progress();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn a_hostile_peer_does_not_touch_other_transfers_posix(c in case(false)) {
        run("posix", &c, false);
    }

    #[test]
    fn a_hostile_peer_does_not_touch_other_transfers_tcp(c in case(false)) {
        run("tcp", &c, false);
    }

    #[test]
    fn a_peer_impersonated_breaks_nothing_posix(c in case(true)) {
        run("posix", &c, true);
    }

    #[test]
    fn a_peer_impersonated_breaks_nothing_tcp(c in case(true)) {
        run("tcp", &c, true);
    }
}

/// A forged atomic request `op`/`size` at `addr` from H to A: handed to A as its transport
/// would; the result of A's handler.
fn forge_atomic(a: &Worker, h: &Worker, addr: u64, op: u8, size: u8) -> Result<()> {
    let mut b = Vec::new();
    wire::put_u64s(&mut b, &[uuid(h), 77, addr, 0xffff_ffff_ffff_ffff, 0]);
    b.push(op);
    b.push(size);
    a.st.borrow_mut().on_am(super::atomic::AM_ATOMIC_REQ, &b)
}

/// A hostile peer's atomics on A's memory: on memory A never mapped (a live buffer of its
/// own), just outside a mapped region, misaligned inside one, with a bad size or operation,
/// at an address that wraps: each is refused (answered, not applied) and no byte changes;
/// the same request on an aligned word inside the region is applied. A forged answer naming
/// A's receive (not an atomic) is refused and the receive is untouched.
#[test]
fn a_hostile_peer_cannot_apply_atomics_outside_mapped_memory() {
    for tls in ["posix", "tcp"] {
        let (a, h) = (worker(tls), worker(tls));
        let ah = a.connect(&h.address()).unwrap();
        h.connect(&a.address()).unwrap();
        let mut secret = vec![0x11u8; 64];
        let mut region = [0u8; 48];
        let off = (8 - region.as_ptr() as usize % 8) % 8;
        let map = a.mem_map(&mut region[off..off + 32]).unwrap();
        let base = map.address();
        let refused = |a: &Worker| a.counters().get("atomic refused").copied().unwrap_or(0);
        let cases = [
            (
                secret.as_mut_ptr() as u64,
                1u8,
                8u8,
                "memory A never mapped",
            ),
            (base + 32, 0, 8, "just past the region"),
            (base - 8, 0, 8, "just before the region"),
            (base + 28, 0, 8, "straddling the end"),
            (base + 4, 0, 8, "misaligned"),
            (base + 2, 0, 4, "misaligned 32-bit"),
            (base, 0, 16, "a 16-byte operand"),
            (base, 0, 0, "a 0-byte operand"),
            (base, 9, 8, "an unknown operation"),
            (u64::MAX - 3, 0, 8, "an address that wraps"),
        ];
        for (n, (addr, op, size, what)) in cases.into_iter().enumerate() {
            forge_atomic(&a, &h, addr, op, size).unwrap();
            assert_eq!(refused(&a), n as u64 + 1, "{tls}: {what} was not refused");
            assert_eq!(map.as_slice(), [0u8; 32], "{tls}: {what}");
        }
        assert_eq!(
            secret,
            vec![0x11u8; 64],
            "{tls}: A's own memory was written"
        );
        // The answers went back to H, which has no such request: dropped there.
        for _ in 0..50 {
            a.progress();
            h.progress();
        }
        // An honest-looking one inside the region is applied (add of all ones = -1).
        forge_atomic(&a, &h, base + 8, 0, 8).unwrap();
        assert_eq!(map.as_slice()[8..16], u64::MAX.to_ne_bytes(), "{tls}");
        drop(map);
        forge_atomic(&a, &h, base + 8, 0, 8).unwrap();
        assert_eq!(
            region[off + 8..off + 16],
            u64::MAX.to_ne_bytes(),
            "{tls}: applied after the unmap"
        );
        // A forged answer naming A's receive.
        let mut buf = vec![7u8; 16];
        a.scope(|s| {
            let r = s.tag_recv(&mut buf[..], 5, TAG_MASK_FULL);
            let rid = {
                let st = a.st.borrow();
                st.reqs
                    .iter()
                    .find(|(_, q)| matches!(q.kind, ReqKind::Recv(_)))
                    .map(|(id, _)| id)
                    .unwrap()
            };
            let bytes = super::atomic::encode_rep(uuid(&h), rid, u64::MAX, 0);
            let e =
                a.st.borrow_mut()
                    .on_am(super::atomic::AM_ATOMIC_REP, &bytes);
            assert!(matches!(e, Err(Error::InvalidParam(_))), "{e:?}");
            assert!(r.test().is_none());
            assert!(r.cancel());
        });
        assert_eq!(buf, vec![7u8; 16]);
        let _ = ah;
    }
}
