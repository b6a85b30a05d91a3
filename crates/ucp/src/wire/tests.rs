//! Tests of `wire`.

use super::*;
use proptest::prelude::*;

#[test]
fn rts_round_trip() {
    let mut b = Vec::new();
    put_u64s(&mut b, &[1, 2, 3, 4, 5]);
    b.push(1);
    put_keys(
        &mut b,
        &[NamedKey {
            md: "posix".into(),
            key: vec![1, 2],
        }],
    );
    match parse(AM_RNDV_RTS, &b).unwrap() {
        Msg::Rts {
            src,
            tag,
            sreq,
            size,
            addr,
            smem,
            keys,
        } => {
            assert_eq!((src, tag, sreq, size, addr, smem), (1, 2, 3, 4, 5, 1));
            assert_eq!(keys[0].md, "posix");
        }
        m => panic!("{m:?}"),
    }
}

#[test]
fn eager_sync_round_trip_and_short_ones_refused() {
    let mut b = Vec::new();
    put_u64s(&mut b, &[7, 8, 9]);
    b.extend_from_slice(b"data");
    match parse(AM_EAGER_SYNC, &b).unwrap() {
        Msg::EagerSync {
            src,
            tag,
            sreq,
            data,
        } => assert_eq!((src, tag, sreq, data), (7, 8, 9, &b"data"[..])),
        m => panic!("{m:?}"),
    }
    assert!(parse(AM_EAGER_SYNC, &b[..20]).is_err(), "truncated header");
}

fn abort(sreq: u64, rreq: u64, side: u8, reason: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    put_u64s(&mut b, &[7, sreq, rreq]);
    b.push(side);
    put_lv(&mut b, reason);
    b
}

#[test]
fn abort_round_trip_and_validation() {
    let mut b = Vec::new();
    put_u64s(&mut b, &[7, 8, 0]);
    b.push(1);
    put_reason(&mut b, "cuda_cpy refused; set RUCX_REG_SKIP");
    match parse(AM_RNDV_ABORT, &b).unwrap() {
        Msg::Abort {
            src,
            sreq,
            rreq,
            by_sender,
            reason,
        } => {
            assert_eq!((src, sreq, rreq, by_sender), (7, 8, 0, true));
            assert_eq!(reason, "cuda_cpy refused; set RUCX_REG_SKIP");
        }
        m => panic!("{m:?}"),
    }
    assert!(parse(AM_RNDV_ABORT, &abort(8, 9, 0, b"x")).is_ok());
    for (bad, why) in [
        (abort(8, 9, 2, b"x"), "unknown side"),
        (abort(0, 9, 1, b"x"), "no sender request"),
        (abort(8, 0, 0, b"x"), "the receiver always knows the send"),
        (abort(8, 9, 1, &[0xff, 0xfe]), "not UTF-8"),
        (abort(8, 9, 1, &[b'a'; MAX_ABORT_REASON + 1]), "too long"),
    ] {
        assert!(parse(AM_RNDV_ABORT, &bad).is_err(), "{why}");
    }
    let mut trailing = abort(8, 9, 1, b"x");
    trailing.push(0);
    assert!(parse(AM_RNDV_ABORT, &trailing).is_err(), "trailing bytes");
    // Long reasons are cut where a character ends.
    let long = "é".repeat(MAX_ABORT_REASON);
    let mut b = Vec::new();
    put_u64s(&mut b, &[7, 8, 9]);
    b.push(0);
    put_reason(&mut b, &long);
    match parse(AM_RNDV_ABORT, &b).unwrap() {
        Msg::Abort { reason, .. } => {
            assert!(reason.len() <= MAX_ABORT_REASON && reason.starts_with('é'))
        }
        m => panic!("{m:?}"),
    }
}

#[test]
fn disconnect_round_trip_and_validation() {
    let m = Msg::Disconnect { src: 0x1234 };
    let (id, b) = m.encode();
    assert_eq!((id, b.len()), (AM_DISCONNECT, 8));
    assert_eq!(parse(AM_DISCONNECT, &b).unwrap(), m);
    assert!(parse(AM_DISCONNECT, &b[..7]).is_err(), "truncated source");
    let mut long = b.clone();
    long.push(0);
    assert!(parse(AM_DISCONNECT, &long).is_err(), "trailing bytes");
}

#[test]
fn keepalive_round_trip_and_validation() {
    for reply in [false, true] {
        let m = Msg::Keepalive { src: 7, reply };
        let (id, b) = m.encode();
        assert_eq!(id, AM_KEEPALIVE);
        assert_eq!(b.len(), 9, "src and one byte");
        assert_eq!(parse(AM_KEEPALIVE, &b).unwrap(), m);
    }
    let mut b = Vec::new();
    put_u64s(&mut b, &[7]);
    assert!(parse(AM_KEEPALIVE, &b).is_err(), "no kind byte");
    assert!(parse(AM_KEEPALIVE, &b[..5]).is_err(), "truncated source");
    b.push(2);
    assert!(parse(AM_KEEPALIVE, &b).is_err(), "unknown kind");
    b[8] = 0;
    b.push(0);
    assert!(parse(AM_KEEPALIVE, &b).is_err(), "trailing bytes");
}

#[test]
fn cancel_round_trip_and_validation() {
    for step in [CancelStep::Ask, CancelStep::Dropped, CancelStep::TooLate] {
        let m = Msg::Cancel {
            src: 7,
            sreq: 9,
            step,
        };
        let (id, b) = m.encode();
        assert_eq!(id, AM_CANCEL);
        assert_eq!(b.len(), 17, "src, request and one byte");
        assert_eq!(parse(AM_CANCEL, &b).unwrap(), m);
    }
    let mut b = Vec::new();
    put_u64s(&mut b, &[7, 9]);
    assert!(parse(AM_CANCEL, &b).is_err(), "no step");
    assert!(parse(AM_CANCEL, &b[..12]).is_err(), "truncated request");
    b.push(3);
    assert!(parse(AM_CANCEL, &b).is_err(), "unknown step");
    b[16] = 1;
    b.push(0);
    assert!(parse(AM_CANCEL, &b).is_err(), "trailing bytes");
}

fn arb_key() -> impl Strategy<Value = NamedKey> {
    (
        "[a-z_]{1,12}",
        proptest::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(md, key)| NamedKey { md, key })
}

/// Every message kind with arbitrary fields (data borrowed from `buf`).
fn arb_msg() -> impl Strategy<Value = Msg<'static>> {
    let buf: &'static [u8] = &BUF;
    let u = any::<u64>;
    let nz = || 1u64..;
    let data = move || (0..=buf.len()).prop_map(move |n| &buf[..n]);
    prop_oneof![
        (u(), data()).prop_map(|(ep, addr)| Msg::Wireup { ep, addr }),
        u().prop_map(|src| Msg::Disconnect { src }),
        (u(), u(), data()).prop_map(|(src, tag, data)| Msg::EagerOne { src, tag, data }),
        (u(), data()).prop_map(|(src, data)| Msg::StreamData { src, data }),
        (u(), u(), u(), data()).prop_map(|(src, tag, sreq, data)| Msg::EagerSync {
            src,
            tag,
            sreq,
            data
        }),
        (u(), any::<bool>(), u(), u(), u(), data()).prop_map(
            |(src, am, tag, msg_id, total, data)| Msg::EagerFirst {
                src,
                kind: if am { MsgKind::Am } else { MsgKind::Tag },
                tag,
                msg_id,
                total,
                data
            }
        ),
        (u(), u(), u(), data()).prop_map(|(src, msg_id, offset, data)| Msg::EagerMiddle {
            src,
            msg_id,
            offset,
            data
        }),
        (
            u(),
            u(),
            u(),
            u(),
            u(),
            0u8..4,
            proptest::collection::vec(arb_key(), 0..3)
        )
            .prop_map(|(src, tag, sreq, size, addr, smem, keys)| Msg::Rts {
                src,
                tag,
                sreq,
                size,
                addr,
                smem,
                keys
            }),
        (u(), u(), u()).prop_map(|(src, sreq, rreq)| Msg::Pull { src, sreq, rreq }),
        (u(), u(), u(), u(), u(), u(), u(), arb_key()).prop_map(
            |(src, rreq, sreq, offset, len, addr, frag, key)| Msg::Frag {
                src,
                rreq,
                sreq,
                offset,
                len,
                addr,
                frag,
                key
            }
        ),
        (u(), arb_key()).prop_map(|(src, key)| Msg::StagingOffer { src, key }),
        (u(), u(), u(), u()).prop_map(|(src, sreq, frag, len)| Msg::FragAck {
            src,
            sreq,
            frag,
            len
        }),
        (u(), u(), any::<bool>()).prop_map(|(src, sreq, ok)| Msg::Ats { src, sreq, ok }),
        (
            u(),
            u(),
            u(),
            u(),
            0u64..1 << 40,
            any::<u64>(),
            proptest::collection::vec(arb_key(), 0..3)
        )
            .prop_map(|(src, sreq, rreq, addr, size, off, keys)| Msg::Rtr {
                src,
                sreq,
                rreq,
                addr,
                size,
                offset: off % (size + 1),
                keys
            }),
        (u(), u(), u(), data()).prop_map(|(src, rreq, offset, data)| Msg::RndvData {
            src,
            rreq,
            offset,
            data
        }),
        (u(), u()).prop_map(|(src, rreq)| Msg::Fin { src, rreq }),
        (u(), nz(), nz(), any::<bool>(), "[ -~]{0,100}").prop_map(
            |(src, sreq, rreq, by_sender, r)| {
                let reason: &'static str = Box::leak(r.into_boxed_str());
                Msg::Abort {
                    src,
                    sreq,
                    rreq,
                    by_sender,
                    reason,
                }
            }
        ),
        (u(), u(), "[ -~]{0,100}").prop_map(|(src, msg_id, r)| {
            let reason: &'static str = Box::leak(r.into_boxed_str());
            Msg::EagerAbort {
                src,
                msg_id,
                reason,
            }
        }),
        (u(), any::<bool>()).prop_map(|(src, reply)| Msg::Keepalive { src, reply }),
        (u(), u(), 0u8..3).prop_map(|(src, sreq, k)| Msg::Cancel {
            src,
            sreq,
            step: [CancelStep::Ask, CancelStep::Dropped, CancelStep::TooLate][k as usize],
        }),
        (u(), any::<u16>(), data(), data()).prop_map(|(src, id, header, data)| Msg::User {
            src,
            id,
            header,
            data
        }),
        (
            (u(), u(), u(), u(), 0u8..4),
            any::<u16>(),
            data(),
            proptest::collection::vec(arb_key(), 0..3)
        )
            .prop_map(
                |((src, sreq, size, addr, smem), id, header, keys)| Msg::AmRts {
                    src,
                    sreq,
                    size,
                    addr,
                    smem,
                    id,
                    header,
                    keys
                }
            ),
    ]
}

static BUF: [u8; 64] = {
    let mut b = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        b[i] = (i as u8).wrapping_mul(37);
        i += 1;
    }
    b
};

proptest! {
    /// What one side writes the other reads back unchanged, for every message kind; a cut
    /// message is refused, never misread as a shorter one of the same kind (except those
    /// that end with data, which are then the same message with less data).
    #[test]
    fn encode_then_parse_is_the_identity(m in arb_msg()) {
        let (id, bytes) = m.encode();
        prop_assert_eq!(id, m.am_id());
        let back = parse(id, &bytes).unwrap();
        prop_assert_eq!(&back, &m);
        // `encode` allocates once: the bound holds every encoding.
        prop_assert!(bytes.len() <= m.encoded_len_bound(), "{} > {}", bytes.len(), m.encoded_len_bound());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic(id in 0u8..24, g in proptest::collection::vec(any::<u8>(), 0..80)) {
        let _ = parse(id, &g);
    }
}

/// A mutation of a message's bytes, as a peer that lies or a stream that broke makes them.
#[derive(Clone, Debug)]
enum Mutation {
    /// Flip one bit.
    Flip(usize, u8),
    /// Cut the message.
    Cut(usize),
    /// Overwrite eight bytes (a size, an offset, a request id, a count) with this value.
    Word(usize, u64),
    /// Overwrite two bytes (a length prefix, a count) with the largest value.
    Huge16(usize),
    /// Append bytes.
    Extend(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        any::<usize>().prop_map(Mutation::Cut),
        (
            any::<usize>(),
            prop_oneof![
                Just(u64::MAX),
                Just(1 << 63),
                Just(u64::from(u32::MAX)),
                any::<u64>()
            ]
        )
            .prop_map(|(p, v)| Mutation::Word(p, v)),
        any::<usize>().prop_map(Mutation::Huge16),
        proptest::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Extend),
    ]
}

fn mutate(b: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::Flip(p, bit) if !b.is_empty() => {
            let i = p % b.len();
            b[i] ^= 1 << bit;
        }
        Mutation::Cut(p) => b.truncate(p % (b.len() + 1)),
        Mutation::Word(p, v) if b.len() >= 8 => {
            let i = p % (b.len() - 7);
            b[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        Mutation::Huge16(p) if b.len() >= 2 => {
            let i = p % (b.len() - 1);
            b[i..i + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        }
        Mutation::Extend(x) => b.extend_from_slice(x),
        _ => {}
    }
}

/// The bytes a parsed message borrows, and how many it copied to the heap (key names, keys).
fn parts<'a>(m: &Msg<'a>) -> (Vec<&'a [u8]>, usize) {
    let keys = |ks: &[NamedKey]| ks.iter().map(|k| k.md.len() + k.key.len()).sum::<usize>();
    match m {
        Msg::Wireup { addr, .. } => (vec![addr], 0),
        Msg::EagerOne { data, .. }
        | Msg::StreamData { data, .. }
        | Msg::EagerSync { data, .. }
        | Msg::EagerFirst { data, .. }
        | Msg::EagerMiddle { data, .. }
        | Msg::RndvData { data, .. } => (vec![data], 0),
        Msg::Rts { keys: k, .. } | Msg::Rtr { keys: k, .. } => (vec![], keys(k)),
        Msg::Frag { key, .. } | Msg::StagingOffer { key, .. } => {
            (vec![], keys(std::slice::from_ref(key)))
        }
        Msg::Abort { reason, .. } | Msg::EagerAbort { reason, .. } => (vec![reason.as_bytes()], 0),
        Msg::User { header, data, .. } => (vec![header, data], 0),
        Msg::AmRts {
            header, keys: k, ..
        } => (vec![header], keys(k)),
        Msg::Pull { .. }
        | Msg::FragAck { .. }
        | Msg::Ats { .. }
        | Msg::Fin { .. }
        | Msg::Keepalive { .. }
        | Msg::Cancel { .. }
        | Msg::Disconnect { .. } => (vec![], 0),
    }
}

proptest! {
    /// Valid encodings mutated (bits flipped, cut, size and length fields set to huge values,
    /// bytes appended), read under their own id or another: refused with a typed error, or read
    /// into a message whose borrowed parts lie inside the input and whose copies (keys) are no
    /// larger than it: no panic, no read past the input, no allocation a length field asked for.
    #[test]
    fn mutated_encodings_are_refused_or_read_within_bounds(
        m in arb_msg(),
        muts in proptest::collection::vec(mutation(), 1..4),
        other_id in 0u8..32,
    ) {
        let (id, mut b) = m.encode();
        for mu in &muts {
            mutate(&mut b, mu);
        }
        let range = b.as_ptr_range();
        for id in [id, other_id] {
            match parse(id, &b) {
                Ok(back) => {
                    let (borrowed, copied) = parts(&back);
                    for s in borrowed {
                        let r = s.as_ptr_range();
                        prop_assert!(s.is_empty() || (r.start >= range.start && r.end <= range.end));
                    }
                    prop_assert!(copied <= b.len(), "{copied} bytes copied from {}", b.len());
                }
                Err(e) => prop_assert!(
                    matches!(e, Error::InvalidAddress(ref s) if s.starts_with("malformed protocol message")),
                    "{e:?}"
                ),
            }
        }
    }
}
