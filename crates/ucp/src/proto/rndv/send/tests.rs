//! The rendezvous send's state machine over the fake I/O: the request to send and its key,
//! re-selection after a registration failure, the receiver's answers (stream, write, split),
//! push-back, completions, acknowledgements and what a failure tells the receiver.

use super::*;
use crate::proto::eager_multi::AmFrags;
use crate::proto::fake_io::{BAD_KEY, FAKE_UUID, FakeIo, Op as FakeOp};

const PEER: usize = 3;
const SREQ: u64 = 0x51;
const RREQ: u64 = 0x77;
const TAG: Tag = 0x7a6;
/// The plan's host RMA lane (its own domain in the fake).
const RMA: usize = 2;
/// The active-message lane.
const AM: usize = 1;

fn message(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 + 5) as u8).collect()
}

fn head_of(msg: &[u8], proto: Proto) -> SendHead {
    SendHead {
        peer: PEER,
        addr: msg.as_ptr() as usize,
        len: msg.len(),
        tag: TAG,
        proto,
        op: Op::Tag,
        mem: MemoryType::Host,
        dev: None,
    }
}

fn io_with_lane(lane: Option<usize>) -> FakeIo {
    FakeIo {
        rndv_lane: lane,
        ..FakeIo::default()
    }
}

fn am_lane(zcopy: bool) -> RtrChoice {
    RtrChoice {
        write: None,
        am: (AM, AM, zcopy),
    }
}

/// Writes on `lane` (whose domain is the fake's `lane` too), the rest on the AM lane.
fn write_lane(lane: usize, zcopy: bool) -> RtrChoice {
    RtrChoice {
        write: Some((lane, lane)),
        am: (AM, AM, zcopy),
    }
}

/// The receiver's key `key` of the fake's domain `md` (`fake{md}`).
fn fake_key(md: usize, key: &[u8]) -> NamedKey {
    NamedKey {
        md: format!("fake{md}"),
        key: key.to_vec(),
    }
}

const FRAGS: AmFrags = AmFrags {
    lane: AM,
    md: AM,
    max_bcopy: 100,
    max_zcopy: 256,
};

/// The request to send queued to the peer: its keys (and that it is ours and whole).
fn rts_keys(io: &FakeIo, len: usize) -> Vec<NamedKey> {
    match io.ctrl_msgs(PEER).as_slice() {
        [
            Msg::Rts {
                src,
                tag,
                sreq,
                size,
                keys,
                ..
            },
        ] => {
            assert_eq!(
                (*src, *tag, *sreq, *size),
                (FAKE_UUID, TAG, SREQ, len as u64)
            );
            keys.clone()
        }
        m => panic!("{m:?}"),
    }
}

/// A read rendezvous registers the buffer with the plan's lane and announces it with the key;
/// the send then waits for the receiver.
#[test]
fn the_request_to_send_carries_a_key_of_the_registration() {
    let msg = message(5000);
    let mut h = head_of(&msg, Proto::RndvGet);
    let mut io = io_with_lane(Some(RMA));
    let mut rv = RndvSend::default();
    assert_eq!(rv.send_rts(&mut io, SREQ, &mut h, None), SendNext::Wait);
    let keys = rts_keys(&io, msg.len());
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].md, "fake2");
    assert_eq!(io.regs.len(), 1);
    assert_eq!(io.regs[0].0, SREQ);
    assert_eq!(io.regs[0].2, MemRegion::host(h.addr, msg.len()));
    assert_eq!(
        (rv.wait, rv.lane, rv.deferred),
        (SendWait::Receiver, Some(RMA), false)
    );
    assert_eq!(h.proto, Proto::RndvGet);
    assert!(rv.untouched());
}

/// A user active message's rendezvous is announced with its id and header; a put rendezvous
/// asks for the receiver's key instead of offering one; a host send adds the GPU-write
/// marker when the worker has one.
#[test]
fn put_and_active_message_announcements() {
    let msg = message(3000);
    let mut h = head_of(&msg, Proto::RndvPut);
    let mut io = io_with_lane(Some(RMA));
    io.write_hint = Some(NamedKey {
        md: GPU_WRITE_HINT.into(),
        key: b"cuda_ipc".to_vec(),
    });
    let mut rv = RndvSend::default();
    assert_eq!(
        rv.send_rts(&mut io, SREQ, &mut h, Some((9, b"hdr"))),
        SendNext::Wait
    );
    assert!(
        io.regs.is_empty(),
        "a put registers when the receiver answers"
    );
    match io.ctrl_msgs(PEER).as_slice() {
        [
            Msg::AmRts {
                sreq,
                id,
                header,
                keys,
                ..
            },
        ] => {
            assert_eq!((*sreq, *id, *header), (SREQ, 9, &b"hdr"[..]));
            let names: Vec<&str> = keys.iter().map(|k| k.md.as_str()).collect();
            assert_eq!(names, [PUT_HINT, GPU_WRITE_HINT]);
        }
        m => panic!("{m:?}"),
    }
}

/// A registration that fails (or a domain demoted before it is asked) re-plans and selects the
/// send again: the lane the new plan offers is registered and announced; the send keeps that
/// lane.
#[test]
fn a_failed_registration_reselects_from_the_new_plan() {
    for demoted in [false, true] {
        let msg = message(5000);
        let mut h = head_of(&msg, Proto::RndvGet);
        let mut io = io_with_lane(Some(RMA));
        if demoted {
            io.demoted.push(RMA);
        } else {
            io.fail_reg_after = Some(0);
        }
        io.replans.push_back(RndvPick {
            proto: Proto::RndvGet,
            lane: Some(5),
            lanes_pending: false,
        });
        let mut rv = RndvSend::default();
        assert_eq!(rv.send_rts(&mut io, SREQ, &mut h, None), SendNext::Wait);
        assert_eq!(io.replanned, 1, "demoted {demoted}");
        let keys = rts_keys(&io, msg.len());
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].md, "fake5", "demoted {demoted}");
        assert_eq!(rv.lane, Some(5));
        assert_eq!(
            io.regs.iter().map(|r| r.1).collect::<Vec<_>>(),
            [5],
            "demoted {demoted}: only the new lane holds a registration"
        );
    }
}

/// A registration failure whose new plan has no lane connected yet defers the request to send
/// (posted again once the lane is there, selected from that plan); one whose plan has no lane
/// at all announces the send without a key (the receiver pulls the data as a stream).
#[test]
fn a_failed_registration_without_a_lane_defers_or_goes_without_a_key() {
    let msg = message(5000);
    let mut h = head_of(&msg, Proto::RndvGet);
    let mut io = io_with_lane(Some(RMA));
    io.fail_reg_after = Some(0);
    io.replans.push_back(RndvPick {
        proto: Proto::RndvGet,
        lane: None,
        lanes_pending: true,
    });
    let mut rv = RndvSend::default();
    assert_eq!(rv.send_rts(&mut io, SREQ, &mut h, None), SendNext::Post);
    assert!(rv.deferred && rv.wait == SendWait::Posting);
    assert!(io.ctrls.is_empty(), "nothing announced yet");
    // The lane is connected: the deferred send is selected again and announced.
    io.replans.push_back(RndvPick {
        proto: Proto::RndvGet,
        lane: Some(6),
        lanes_pending: false,
    });
    assert_eq!(rv.send_rts(&mut io, SREQ, &mut h, None), SendNext::Wait);
    assert_eq!(rts_keys(&io, msg.len())[0].md, "fake6");
    assert!(!rv.deferred);
    assert_eq!(rv.wait, SendWait::Receiver);

    // No lane anywhere: announced without a key.
    let mut io = io_with_lane(Some(RMA));
    io.fail_reg_after = Some(0);
    io.replans.push_back(RndvPick {
        proto: Proto::RndvGet,
        lane: None,
        lanes_pending: false,
    });
    let mut rv = RndvSend::default();
    assert_eq!(rv.send_rts(&mut io, SREQ, &mut h, None), SendNext::Wait);
    assert!(rts_keys(&io, msg.len()).is_empty());
    assert_eq!(rv.lane, None);
}

/// Announce a read rendezvous of `msg` on a fresh fake.
fn announced(msg: &[u8]) -> (FakeIo, RndvSend, SendHead) {
    let mut h = head_of(msg, Proto::RndvGet);
    let mut io = io_with_lane(Some(RMA));
    let mut rv = RndvSend::default();
    rv.send_rts(&mut io, SREQ, &mut h, None);
    io.ctrls.clear();
    (io, rv, h)
}

/// Rebuild what the streamed fragments carried (copied in: each is a whole message).
fn streamed(io: &FakeIo) -> Vec<(u64, Vec<u8>)> {
    io.ep
        .ops
        .iter()
        .map(|op| match op {
            FakeOp::Bcopy { id, bytes } => match crate::wire::parse(*id, bytes).unwrap() {
                Msg::RndvData {
                    rreq, offset, data, ..
                } => {
                    assert_eq!(rreq, RREQ);
                    (offset, data.to_vec())
                }
                m => panic!("{m:?}"),
            },
            op => panic!("{op:?}"),
        })
        .collect()
}

/// An answer without a key: the send streams the message (capped to the receive's size)
/// through active messages, copied in, and completes once all went out.
#[test]
fn an_answer_without_a_key_streams_the_message() {
    let msg = message(1000);
    let (mut io, mut rv, mut h) = announced(&msg);
    let next = rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0, 700, 0, &[], &am_lane(false));
    assert_eq!(next, SendNext::Post);
    assert_eq!(
        (h.len, rv.rreq, rv.wait),
        (700, Some(RREQ), SendWait::Posting)
    );
    assert!(
        io.regs.is_empty(),
        "copied in: the read registration is dropped"
    );
    assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 1).unwrap());
    assert_eq!(rv.wait, SendWait::Completions);
    let got: Vec<u8> = streamed(&io).into_iter().flat_map(|(_, d)| d).collect();
    assert_eq!(got, msg[..700]);
    assert_eq!(rv.on_transfer(&mut io, &h, 0, Ok(())), SendNext::Complete);
}

/// With a zero-copy AM lane the stream goes from a registration with that lane's domain, each
/// fragment in flight until its completion; the send completes with the last.
#[test]
fn a_zero_copy_stream_completes_with_its_last_fragment() {
    let msg = message(600);
    let (mut io, mut rv, mut h) = announced(&msg);
    rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0, 600, 0, &[], &am_lane(true));
    assert_eq!(
        io.regs.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(),
        [(SREQ, AM)],
        "only the AM lane's registration is kept"
    );
    assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 1).unwrap());
    assert_eq!(io.in_flight.len(), 3, "600 bytes in 256-byte fragments");
    assert_eq!(rv.on_transfer(&mut io, &h, 2, Ok(())), SendNext::Wait);
    assert_eq!(rv.on_transfer(&mut io, &h, 1, Ok(())), SendNext::Wait);
    assert_eq!(rv.on_transfer(&mut io, &h, 0, Ok(())), SendNext::Complete);
}

/// The receiver's key, of a domain we write with: the send writes its buffer in fragments,
/// resumes where a push-back stopped it (no gap, nothing twice), flushes, and once the writes
/// completed tells the receiver (FIN) and completes.
#[test]
fn a_put_resumes_after_a_push_back_and_finishes() {
    let msg = message(1000);
    let (mut io, mut rv, mut h) = announced(&msg);
    let keys = [fake_key(4, &[4])];
    let c = write_lane(4, false);
    let raddr = 0x9000;
    assert_eq!(
        rv.on_rtr(&mut io, SREQ, &mut h, RREQ, raddr, 1000, 0, &keys, &c),
        SendNext::Post
    );
    assert!(rv.put.is_some());
    assert!(
        io.regs.iter().any(|r| r.0 == SREQ && r.1 == 4),
        "registered to write"
    );
    io.push_back_after = Some(2);
    assert!(
        !rv.post_data(&mut io, SREQ, &h, &FRAGS, 300).unwrap(),
        "pushed back"
    );
    assert_eq!(rv.posted, 600);
    assert_eq!(rv.wait, SendWait::Posting);
    assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 300).unwrap());
    let writes: Vec<(usize, u64)> = io
        .ep
        .ops
        .iter()
        .map(|op| match op {
            FakeOp::Rma {
                get: false,
                iov,
                remote,
                ..
            } => (iov[0].1, *remote),
            op => panic!("{op:?}"),
        })
        .collect();
    assert_eq!(
        writes,
        [
            (300, raddr),
            (300, raddr + 300),
            (300, raddr + 600),
            (100, raddr + 900)
        ]
    );
    assert_eq!(io.in_flight.len(), 4, "the flush completed at once");
    assert!(io.ctrls.is_empty(), "no FIN before the writes completed");
    for left in (0..4).rev() {
        let next = rv.on_transfer(&mut io, &h, left, Ok(()));
        assert_eq!(
            next,
            if left == 0 {
                SendNext::Complete
            } else {
                SendNext::Wait
            }
        );
    }
    assert!(matches!(
        io.ctrl_msgs(PEER).as_slice(),
        [Msg::Fin { rreq: RREQ, .. }]
    ));
}

/// A split: the receiver reads the head, we write the tail from its offset; the send ends
/// after both halves (our writes with their FIN, its ATS), in either order. A key that does
/// not unpack streams the tail instead, copied in.
#[test]
fn a_split_ends_after_both_halves() {
    let msg = message(8192);
    let keys = [fake_key(4, &[4])];
    let c = write_lane(4, true);
    for ats_first in [false, true] {
        let (mut io, mut rv, mut h) = announced(&msg);
        rv.on_rtr(
            &mut io, SREQ, &mut h, RREQ, 0x10_0000, 8192, 4096, &keys, &c,
        );
        assert_eq!((rv.posted, rv.split_left), (4096, 2));
        if ats_first {
            assert_eq!(rv.on_ats(true), SendNext::Wait);
        }
        assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 1 << 20).unwrap());
        match &io.ep.ops[..] {
            [FakeOp::Rma { iov, remote, .. }] => {
                assert_eq!((iov[0], *remote), ((h.addr + 4096, 4096), 0x10_0000 + 4096))
            }
            ops => panic!("{ops:?}"),
        }
        let done = rv.on_transfer(&mut io, &h, 0, Ok(()));
        assert_eq!(io.ctrls.len(), 1, "FIN");
        if ats_first {
            assert_eq!(done, SendNext::Complete);
        } else {
            assert_eq!(done, SendNext::Wait);
            assert_eq!(rv.on_ats(true), SendNext::Complete);
        }
    }

    let (mut io, mut rv, mut h) = announced(&msg);
    let bad = [fake_key(4, BAD_KEY)];
    rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0x10_0000, 8192, 4096, &bad, &c);
    assert!(rv.put.is_none());
    assert_eq!((rv.posted, rv.split_left), (4096, 2));
    assert_eq!(
        io.counted,
        ["rendezvous split: tail streamed (no remote write)"]
    );
    assert!(
        io.regs.iter().any(|r| r.1 == RMA),
        "the head's registration stays for the receiver's reads"
    );
    assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 1).unwrap());
    let tail = streamed(&io);
    assert_eq!(tail[0].0, 4096);
    let got: Vec<u8> = tail.into_iter().flat_map(|(_, d)| d).collect();
    assert_eq!(got, msg[4096..], "the tail, copied in");
    assert!(io.in_flight.is_empty());
}

/// Writing needs our registration with the key's domain: when it fails the plan is refreshed
/// and the message is streamed instead (nothing is lost, the send goes on).
#[test]
fn a_write_registration_failure_streams_instead() {
    let msg = message(1000);
    let (mut io, mut rv, mut h) = announced(&msg);
    let keys = [fake_key(4, &[4])];
    let c = write_lane(4, false);
    io.fail_reg_after = Some(0);
    let replans = io.replanned;
    assert_eq!(
        rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0x9000, 1000, 0, &keys, &c),
        SendNext::Post
    );
    assert!(rv.put.is_none());
    assert_eq!(io.replanned, replans + 1);
    assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 1).unwrap());
    let got: Vec<u8> = streamed(&io).into_iter().flat_map(|(_, d)| d).collect();
    assert_eq!(got, msg, "streamed whole, in 76-byte fragments");
}

/// GPU memory cannot be streamed: an answer without a key fails the send, naming the receive
/// so that the receiver is told.
#[test]
fn a_gpu_send_asked_to_stream_fails() {
    let msg = message(100);
    let mut h = head_of(&msg, Proto::RndvGet);
    h.mem = MemoryType::Cuda;
    h.dev = Some(0);
    let mut io = FakeIo::default();
    let mut rv = RndvSend::default();
    let next = rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0, 100, 0, &[], &am_lane(false));
    assert!(
        matches!(next, SendNext::Fail(Error::Unsupported { .. })),
        "{next:?}"
    );
    assert_eq!(rv.peer_rreq(), RREQ);
}

/// A GPU send whose worker is the pair's copier on a shared GPU announces the key for a read
/// and, behind it, the shared-GPU marker; one that is not (no marker from the worker), the key
/// alone. A host send never carries it.
#[test]
fn a_gpu_send_offers_to_write_on_a_shared_gpu() {
    let msg = message(64);
    let marker = crate::proto::gpu::write::shared_gpu_marker("fake2", [7; 16]);
    for (mem, offered) in [
        (MemoryType::Cuda, true),
        (MemoryType::Cuda, false),
        (MemoryType::Host, true),
    ] {
        let mut h = head_of(&msg, Proto::RndvGet);
        h.mem = mem;
        h.dev = mem.is_gpu().then_some(0);
        let mut io = io_with_lane(Some(RMA));
        io.shared_hint = offered.then(|| marker.clone());
        let mut rv = RndvSend::default();
        assert_eq!(rv.send_rts(&mut io, SREQ, &mut h, None), SendNext::Wait);
        let names: Vec<String> = rts_keys(&io, msg.len()).into_iter().map(|k| k.md).collect();
        if mem.is_gpu() && offered {
            assert_eq!(names, ["fake2", GPU_SHARED_HINT]);
        } else {
            assert_eq!(names, ["fake2"], "{mem} offered {offered}");
        }
    }
}

/// The receiver on our GPU answers a GPU send with its key: the send writes into its buffer
/// (one copy, issued here), flushes, and tells it (FIN) once the write completed; a key that
/// does not unpack fails the send (GPU memory cannot be streamed) rather than losing data.
#[test]
fn a_gpu_send_writes_when_the_receiver_on_its_gpu_hands_its_key() {
    let msg = message(1000);
    let mut h = head_of(&msg, Proto::RndvGet);
    h.mem = MemoryType::Cuda;
    h.dev = Some(0);
    let mut io = io_with_lane(Some(RMA));
    let mut rv = RndvSend::default();
    rv.send_rts(&mut io, SREQ, &mut h, None);
    io.ctrls.clear();
    let c = write_lane(RMA, false);
    let keys = [fake_key(2, &[2])];
    assert_eq!(
        rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0x9000, 1000, 0, &keys, &c),
        SendNext::Post
    );
    assert!(
        io.counted
            .contains(&"rendezvous send by remote write on a shared GPU")
    );
    assert!(rv.post_data(&mut io, SREQ, &h, &FRAGS, 1 << 20).unwrap());
    let writes: Vec<(usize, u64)> = io
        .ep
        .ops
        .iter()
        .filter_map(|op| match op {
            FakeOp::Rma {
                get: false,
                iov,
                remote,
                ..
            } => Some((iov[0].1, *remote)),
            _ => None,
        })
        .collect();
    assert_eq!(writes, [(1000, 0x9000)], "the whole buffer in one write");
    // A key that does not unpack: the send fails.
    let mut h = head_of(&msg, Proto::RndvGet);
    h.mem = MemoryType::Cuda;
    h.dev = Some(0);
    let mut io = io_with_lane(Some(RMA));
    let mut rv = RndvSend::default();
    rv.send_rts(&mut io, SREQ, &mut h, None);
    let bad = [fake_key(2, BAD_KEY)];
    let next = rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0x9000, 1000, 0, &bad, &c);
    assert!(
        matches!(next, SendNext::Fail(Error::Unsupported { .. })),
        "{next:?}"
    );
}

/// A completion error ends the send; the abort it leads to names our request and the
/// receiver's (the staged pipeline's, once staging), with the reason.
#[test]
fn a_completion_error_ends_the_send_and_tells_the_receiver() {
    let msg = message(600);
    let (mut io, mut rv, mut h) = announced(&msg);
    rv.on_rtr(&mut io, SREQ, &mut h, RREQ, 0, 600, 0, &[], &am_lane(true));
    rv.post_data(&mut io, SREQ, &h, &FRAGS, 1).unwrap();
    io.ctrls.clear();
    let e = Error::io("sending", std::io::Error::from_raw_os_error(104));
    let next = rv.on_transfer(&mut io, &h, 2, Err(e.clone()));
    assert_eq!(next, SendNext::Fail(e.clone()));
    rv.abort(&mut io, &h, SREQ, &e.to_string());
    match io.ctrl_msgs(PEER).as_slice() {
        [
            Msg::Abort {
                src,
                sreq,
                rreq,
                by_sender,
                reason,
            },
        ] => {
            assert_eq!(
                (*src, *sreq, *rreq, *by_sender),
                (FAKE_UUID, SREQ, RREQ, true)
            );
            assert_eq!(*reason, e.to_string());
        }
        m => panic!("{m:?}"),
    }
    // Not answered yet: the receiver finds its receive by our request.
    assert_eq!(RndvSend::default().peer_rreq(), 0);
}

/// The receiver giving up (ATS not ok) ends the send without telling it anything.
#[test]
fn a_refused_acknowledgement_aborts_the_send() {
    let mut rv = RndvSend::default();
    assert!(matches!(rv.on_ats(false), SendNext::Aborted(_)));
    assert_eq!(rv.on_ats(true), SendNext::Complete);
}
