//! Active messages and streams with GPU buffers on the sim fabric (device memory simulated by
//! `Fabric::mark_device`): host and GPU payloads both ways, copied in (small) and by rendezvous
//! (large: the handler fetches into a buffer it chooses), through the GPU zero-copy lane and
//! the staged pipeline, with registration faults; descriptors dropped unfetched; the byte
//! stream from and into GPU memory in any split. Every byte and the guard bytes around every
//! buffer are checked.

mod harness;

use std::sync::{Arc, Mutex};

use harness::{Buf, Mem, Pair, Watchdog, is_truncation, pattern, with_fault};
use rucx_ucp::plan::{MemKey, Op};
use rucx_ucp::proto::Proto;
use rucx_ucp::{AmMessage, Completion};
use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct_sim::{Delivery, FabricSpec};

/// Host table: copy-in below 64 KiB, rendezvous from there; 256 KiB staging fragments.
const VARS: &[(&str, &str)] = &[
    ("RUCX_ZCOPY_THRESH", "16K"),
    ("RUCX_RNDV_FRAG_SIZE", "256K"),
];
const AM_ID: u16 = 9;
const SIZES: &[usize] = &[0, 1, 200, 4096, 8000, 9000, 100_000, (1 << 20) + 3];

type Inbox = Arc<Mutex<Vec<AmMessage>>>;

/// Handlers of `AM_ID` on both sides that keep every message.
fn inboxes(pair: &Pair) -> [Inbox; 2] {
    [0, 1].map(|i| {
        let inbox: Inbox = Arc::default();
        let keep = inbox.clone();
        pair.w[i].set_am_handler(AM_ID, move |_, m| keep.lock().unwrap().push(m));
        inbox
    })
}

/// How an active message went.
struct AmOutcome {
    send: Result<Completion>,
    recv: Result<Completion>,
    header: Vec<u8>,
    remote: bool,
    mem: Option<MemoryType>,
}

/// Send `sbuf` as an active message from side `from`; the other side's handler keeps it and
/// the test fetches its payload into `rbuf`.
fn am_transfer(
    pair: &Pair,
    inbox: &[Inbox; 2],
    from: usize,
    sbuf: &Buf,
    rbuf: &mut Buf,
    header: &[u8],
) -> AmOutcome {
    let to = 1 - from;
    let _dog = Watchdog::arm(
        120,
        format!("active message of {} B {:?}", sbuf.len(), sbuf.mem()),
    );
    pair.w[from].scope(|ss| {
        let s = ss.am_send(pair.ep[from], AM_ID, header, sbuf.send());
        pair.drive(|| {
            !inbox[to].lock().unwrap().is_empty() || s.test().is_some_and(|r| r.is_err())
        })
        .expect("the active message arrives");
        if let Some(Err(e)) = s.test() {
            panic!("send of {} B {:?} failed: {e}", sbuf.len(), sbuf.mem());
        }
        let mut m = inbox[to].lock().unwrap().remove(0);
        assert_eq!((m.id, m.reply_ep), (AM_ID, pair.ep[to]));
        assert_eq!(m.len(), sbuf.len());
        let remote = m.is_remote();
        let mem = m.remote.as_ref().map(|r| r.mem_type());
        let header = std::mem::take(&mut m.header);
        let payload = m.take_payload();
        assert_eq!(payload.len(), sbuf.len());
        pair.w[to].scope(|sr| {
            let r = sr.am_recv_data(payload, rbuf.recv());
            let (mut so, mut ro) = (None, None);
            pair.drive(|| {
                so = so.take().or_else(|| s.test());
                ro = ro.take().or_else(|| r.test());
                so.is_some() && ro.is_some()
            })
            .unwrap_or_else(|e| panic!("{} B {:?}: {e}", sbuf.len(), sbuf.mem()));
            AmOutcome {
                send: so.unwrap(),
                recv: ro.unwrap(),
                header,
                remote,
                mem,
            }
        })
    })
}

fn am_every_size(pair: &Pair, mems: &[[Mem; 2]]) {
    let inbox = inboxes(pair);
    for (k, &[sm, rm]) in mems.iter().enumerate() {
        for from in [0, 1] {
            for (i, &n) in SIZES.iter().enumerate() {
                let id = (k * 100 + from * 10 + i) as u64;
                let send = Buf::filled(&pair.fabric, n, sm, id);
                let mut recv = Buf::new(&pair.fabric, n, rm);
                let header = pattern(id + 1000, (i * 7) % 40);
                let out = am_transfer(pair, &inbox, from, &send, &mut recv, &header);
                let what = format!("{n} B {sm:?} -> {rm:?} from side {from}");
                let s = out.send.unwrap_or_else(|e| panic!("{what}: send: {e}"));
                let r = out.recv.unwrap_or_else(|e| panic!("{what}: receive: {e}"));
                assert_eq!((s.len, r.len), (n, n), "{what}");
                assert_eq!(out.header, header, "{what}");
                assert!(recv.bytes() == pattern(id, n), "{what}: data differs");
                assert_eq!(recv.guard_damage(), None, "{what}");
                assert_eq!(send.guard_damage(), None, "{what}");
                // Large payloads stay with the sender, as the plan's table says; the
                // descriptor says where.
                let key = match sm {
                    Mem::Device(d) => MemKey::new(MemoryType::Cuda, Some(d)),
                    _ => MemKey::HOST,
                };
                let plan = pair.w[from].plan(pair.ep[from]).unwrap();
                let proto = plan.table(Op::Am, key).lookup(n).unwrap().proto;
                assert_eq!(out.remote, proto != Proto::AmCopy, "{what}: {proto:?}");
                if matches!(sm, Mem::Host | Mem::HostRaw) {
                    assert_eq!(out.remote, n >= 64 << 10, "{what}");
                } else {
                    assert_eq!(out.remote, n > 8000, "{what}");
                }
                if out.remote {
                    let want = if matches!(sm, Mem::Device(_)) {
                        MemoryType::Cuda
                    } else {
                        MemoryType::Host
                    };
                    assert_eq!(out.mem, Some(want), "{what}");
                }
            }
        }
    }
    for w in &pair.w {
        assert_eq!(w.live_requests(), 0);
    }
}

const ALL_MEMS: &[[Mem; 2]] = &[
    [Mem::Host, Mem::Host],
    [Mem::Device(0), Mem::Device(1)],
    [Mem::Device(0), Mem::Host],
    [Mem::Host, Mem::Device(1)],
    [Mem::HostRaw, Mem::Device(0)],
];

#[test]
fn am_payloads_of_every_size_host_and_gpu_both_ways_over_the_gpu_lane() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    am_every_size(&pair, ALL_MEMS);
    let c = pair.w[0].counters();
    for k in [
        "active message rendezvous",
        "active message payload fetched",
        "GPU buffer copied to host",
    ] {
        assert!(c.contains_key(k), "{k} never ran: {c:?}");
    }
    pair.check_clean();
}

#[test]
fn am_payloads_of_every_size_through_the_staged_pipeline() {
    let pair = Pair::new(FabricSpec::gpu().ipc(false), [VARS, VARS]);
    am_every_size(&pair, ALL_MEMS);
    pair.assert_ran(1, "rendezvous receive pipelined through host staging");
    pair.check_clean();
}

/// A registration refused on the GPU zero-copy lane demotes it, and the active message's
/// rendezvous goes on through the staged pipeline (the sender's side, and the receiver's).
#[test]
fn am_rendezvous_survives_registration_faults() {
    for (a, b) in [
        ("md=sim_ipc,mem=cuda,after=0", ""),
        ("", "md=sim_ipc,mem=cuda,after=0"),
        ("md=sim_copy,after=3", "md=sim_copy,after=5"),
    ] {
        let with = |f: &'static str| -> Vec<(&'static str, &'static str)> {
            let mut v = VARS.to_vec();
            if !f.is_empty() {
                v.push(("RUCX_FAULT_INJECT", f));
            }
            v
        };
        let (va, vb) = (with(a), with(b));
        let pair = Pair::new(FabricSpec::gpu(), [&va, &vb]);
        let inbox = inboxes(&pair);
        for (i, n) in [(1usize << 20) + 3, 300_000, 70_000, 100]
            .into_iter()
            .enumerate()
        {
            for from in [0, 1] {
                let id = (i * 2 + from) as u64;
                let send = Buf::filled(&pair.fabric, n, Mem::Device(from as u32), id);
                let mut recv = Buf::new(&pair.fabric, n, Mem::Device(1 - from as u32));
                let out = am_transfer(&pair, &inbox, from, &send, &mut recv, b"h");
                let what = format!("{n} B from side {from} with faults ({a}; {b})");
                match (&out.send, &out.recv) {
                    (Ok(s), Ok(r)) => {
                        assert_eq!((s.len, r.len), (n, n), "{what}");
                        assert!(recv.bytes() == pattern(id, n), "{what}: data differs");
                    }
                    // A copy lane that refuses its registrations leaves no path for some
                    // payloads: both sides end, with the reason.
                    (s, r) => {
                        assert!(a.contains("sim_copy"), "{what}: {s:?} {r:?}");
                        assert!(s.is_err() || r.is_err(), "{what}");
                    }
                }
                assert_eq!(recv.guard_damage(), None, "{what}");
            }
        }
        if a.contains("sim_ipc") || b.contains("sim_ipc") {
            assert!(
                pair.ctx.iter().any(|c| !c.demotions().is_empty()),
                "({a}; {b}): no demotion"
            );
        }
        for w in &pair.w {
            assert_eq!(w.live_requests(), 0);
        }
        pair.check_clean();
    }
}

/// A handler that drops the descriptor releases the sender: its request ends with
/// `PeerAborted` saying so (host and GPU payloads, both ways); the next message goes on.
#[test]
fn a_dropped_descriptor_releases_the_sender() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    // Side 1 drops everything; side 0 keeps.
    pair.w[1].set_am_handler(AM_ID, |_, m| assert!(m.is_remote()));
    let inbox: Inbox = Arc::default();
    let keep = inbox.clone();
    pair.w[0].set_am_handler(AM_ID, move |_, m| keep.lock().unwrap().push(m));
    for mem in [Mem::Host, Mem::Device(0)] {
        let send = Buf::filled(&pair.fabric, 1 << 20, mem, 1);
        let res = pair.w[0].scope(|s| {
            let r = s.am_send(pair.ep[0], AM_ID, b"", send.send());
            pair.drive(|| r.test().is_some()).unwrap_or_else(|e| {
                panic!(
                    "{mem:?}: the send never ended ({e}): {:?} / {:?}",
                    pair.w[0].counters(),
                    pair.w[1].counters()
                )
            });
            r.test().unwrap()
        });
        match res {
            Err(Error::PeerAborted { reason, .. }) => {
                assert!(reason.contains("dropped"), "{reason}")
            }
            other => panic!("{mem:?}: {other:?}"),
        }
    }
    // Kept by side 0's handler and dropped later, outside it, on another thread.
    let send = Buf::filled(&pair.fabric, 300_000, Mem::Device(1), 2);
    let res = pair.w[1].scope(|s| {
        let r = s.am_send(pair.ep[1], AM_ID, b"x", send.send());
        pair.drive(|| !inbox.lock().unwrap().is_empty())
            .expect("arrives");
        let m = inbox.lock().unwrap().pop().unwrap();
        std::thread::spawn(move || drop(m)).join().unwrap();
        pair.drive(|| r.test().is_some()).expect("the send ends");
        r.test().unwrap()
    });
    assert!(matches!(res, Err(Error::PeerAborted { .. })), "{res:?}");
    assert_eq!(
        pair.w[0].counters()["active message payload dropped unfetched"],
        1
    );
    for w in &pair.w {
        assert_eq!(w.live_requests(), 0);
    }
    pair.check_clean();
}

/// A payload longer than the buffer it is fetched into fills it and ends `Truncated`; the
/// sender completes; nothing is written past the buffer.
#[test]
fn a_payload_fetched_into_a_smaller_buffer_is_truncated() {
    for spec in [FabricSpec::gpu(), FabricSpec::gpu().ipc(false)] {
        let pair = Pair::new(spec, [VARS, VARS]);
        let inbox = inboxes(&pair);
        for (i, (n, cap, sm, rm)) in [
            (1 << 20, 300_000, Mem::Device(0), Mem::Device(1)),
            (1 << 20, 300_000, Mem::Host, Mem::Device(1)),
            (200_000, 70_000, Mem::Device(0), Mem::Host),
            (5000, 100, Mem::Device(0), Mem::Device(1)),
            (5000, 100, Mem::Host, Mem::Host),
        ]
        .into_iter()
        .enumerate()
        {
            let send = Buf::filled(&pair.fabric, n, sm, i as u64);
            let mut recv = Buf::new(&pair.fabric, cap, rm);
            let out = am_transfer(&pair, &inbox, 0, &send, &mut recv, b"");
            assert!(
                is_truncation(&out.recv, n, cap),
                "{n} into {cap}: {:?}",
                out.recv
            );
            assert!(out.send.is_ok(), "{:?}", out.send);
            assert!(recv.bytes() == &pattern(i as u64, n)[..cap]);
            assert_eq!(recv.guard_damage(), None);
        }
        pair.check_clean();
    }
}

/// Refusals are told when posted: a header too long for the rendezvous's request to send, and
/// a payload descriptor fetched through another worker.
#[test]
fn bad_active_message_requests_are_refused_with_the_reason() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let send = Buf::filled(&pair.fabric, 1 << 20, Mem::Device(0), 1);
    let long = vec![0u8; 60_000];
    let r = pair.w[0].scope(|s| s.am_send(pair.ep[0], AM_ID, &long, send.send()).wait());
    match r {
        Err(Error::InvalidParam(m)) => assert!(m.contains("header"), "{m}"),
        other => panic!("{other:?}"),
    }
    let too_long = vec![0u8; 70_000];
    let r = pair.w[0].scope(|s| s.am_send(pair.ep[0], AM_ID, &too_long, b"x").wait());
    assert!(matches!(r, Err(Error::InvalidParam(_))), "{r:?}");
    // A descriptor fetched through the worker that sent it.
    let inbox = inboxes(&pair);
    let mut wrong = Buf::new(&pair.fabric, 1 << 20, Mem::Host);
    let res = pair.w[0].scope(|s| {
        let r = s.am_send(pair.ep[0], AM_ID, b"", send.send());
        pair.drive(|| !inbox[1].lock().unwrap().is_empty()).unwrap();
        let mut m = inbox[1].lock().unwrap().pop().unwrap();
        let f = s.am_recv_data(m.take_payload(), wrong.recv()).wait();
        assert!(matches!(f, Err(Error::InvalidParam(_))), "{f:?}");
        pair.drive(|| r.test().is_some()).unwrap();
        r.test().unwrap()
    });
    // Refused and dropped: the sender is released.
    assert!(matches!(res, Err(Error::PeerAborted { .. })), "{res:?}");
    pair.check_clean();
}

/// The sender failing while the receiver's fetch of its payload is in flight: the fetch ends
/// with the failure rather than waiting forever, and nothing of it is left (host and GPU
/// payloads, host and GPU buffers).
#[test]
fn the_sender_failing_while_a_fetch_is_in_flight_ends_the_fetch() {
    for (sm, rm) in [
        (Mem::Device(0), Mem::Device(1)),
        (Mem::Host, Mem::Host),
        (Mem::Device(0), Mem::Host),
        (Mem::Host, Mem::Device(0)),
    ] {
        let pair = Pair::new(FabricSpec::gpu().ipc(false), [VARS, VARS]);
        let inbox = inboxes(&pair);
        let send = Buf::filled(&pair.fabric, 4 << 20, sm, 3);
        let mut recv = Buf::new(&pair.fabric, 4 << 20, rm);
        let (sres, rres) = pair.w[0].scope(|ss| {
            let s = ss.am_send(pair.ep[0], AM_ID, b"", send.send());
            pair.drive(|| !inbox[1].lock().unwrap().is_empty())
                .expect("the active message arrives");
            let mut m = inbox[1].lock().unwrap().remove(0);
            assert!(m.is_remote());
            pair.w[1].scope(|sr| {
                let r = sr.am_recv_data(m.take_payload(), recv.recv());
                assert!(r.test().is_none(), "{sm:?} -> {rm:?}: done when posted");
                pair.fabric
                    .fail_node(pair.nodes[0], "the sender's node failed on purpose");
                pair.drive(|| r.test().is_some() && s.test().is_some())
                    .unwrap_or_else(|e| panic!("{sm:?} -> {rm:?}: {e}"));
                (s.test().unwrap(), r.test().unwrap())
            })
        });
        assert!(rres.is_err(), "{sm:?} -> {rm:?}: the fetch {rres:?}");
        assert!(sres.is_err(), "{sm:?} -> {rm:?}: the send {sres:?}");
        assert_eq!(pair.w[1].live_requests(), 0);
        assert_eq!(recv.guard_damage(), None);
    }
}

// ----- streams -----

/// Send `data` (in `sends` pieces of the given memory) from side 0 and receive it on side 1
/// in pieces of `recvs` sizes and memory; every byte checked.
fn stream_case(pair: &Pair, id: u64, sends: &[(usize, Mem)], recvs: &[(usize, Mem)]) {
    let total: usize = sends.iter().map(|s| s.0).sum();
    assert_eq!(total, recvs.iter().map(|r| r.0).sum::<usize>());
    let all = pattern(id, total);
    let mut off = 0;
    let sbufs: Vec<Buf> = sends
        .iter()
        .map(|&(n, m)| {
            let mut b = Buf::new(&pair.fabric, n, m);
            b.bytes_mut().copy_from_slice(&all[off..off + n]);
            off += n;
            b
        })
        .collect();
    let mut rbufs: Vec<Buf> = recvs
        .iter()
        .map(|&(n, m)| Buf::new(&pair.fabric, n, m))
        .collect();
    let _dog = Watchdog::arm(120, format!("stream {sends:?} -> {recvs:?}"));
    pair.w[1].scope(|sr| {
        pair.w[0].scope(|ss| {
            let rr: Vec<_> = rbufs
                .iter_mut()
                .map(|b| sr.stream_recv(pair.ep[1], b.recv()))
                .collect();
            let sr_: Vec<_> = sbufs
                .iter()
                .map(|b| ss.stream_send(pair.ep[0], b.send()))
                .collect();
            pair.drive(|| rr.iter().chain(&sr_).all(|r| r.test().is_some()))
                .unwrap_or_else(|e| {
                    let st: Vec<String> = rr
                        .iter()
                        .chain(&sr_)
                        .map(|r| format!("{:?}", r.test().map(|x| x.map(|c| c.len))))
                        .collect();
                    panic!("{sends:?} -> {recvs:?}: {e}; done: {st:?}")
                });
            for (r, &(n, _)) in rr.iter().zip(recvs) {
                assert_eq!(r.test().unwrap().expect("received").len, n);
            }
            for (s, &(n, _)) in sr_.iter().zip(sends) {
                assert_eq!(s.test().unwrap().expect("sent").len, n);
            }
        })
    });
    let mut got = Vec::new();
    for b in &rbufs {
        got.extend_from_slice(b.bytes());
        assert_eq!(b.guard_damage(), None);
    }
    assert!(got == all, "{sends:?} -> {recvs:?}: bytes differ");
}

#[test]
fn stream_bytes_from_and_into_gpu_memory_in_any_split() {
    for spec in [FabricSpec::gpu(), FabricSpec::gpu().ipc(false)] {
        let pair = Pair::new(spec, [VARS, VARS]);
        let (d0, d1, h) = (Mem::Device(0), Mem::Device(1), Mem::Host);
        stream_case(&pair, 1, &[(100, d0)], &[(100, d1)]);
        stream_case(&pair, 2, &[(1 << 20, d0)], &[(1 << 20, h)]);
        stream_case(&pair, 3, &[(1 << 20, h)], &[(1 << 20, d1)]);
        stream_case(
            &pair,
            4,
            &[(3, d0), (70_000, h), (1, d0), (600_000, d0)],
            &[
                (10, d1),
                (5000, h),
                (1, d1),
                (600_000 - 7, d1),
                (65_000, Mem::HostRaw),
            ],
        );
        stream_case(&pair, 5, &[(0, d0), (9, d0)], &[(4, d1), (0, d1), (5, h)]);
        let c = pair.w[1].counters();
        assert!(c.contains_key("stream receive copied to GPU"), "{c:?}");
        assert!(
            pair.w[0]
                .counters()
                .contains_key("GPU buffer copied to host")
        );
        for w in &pair.w {
            assert_eq!(w.live_requests(), 0);
        }
        pair.check_clean();
    }
}

/// A GPU stream receive canceled part-way gives its bytes back: the next receive (host or
/// GPU) gets them, in order.
#[test]
fn a_canceled_gpu_stream_receive_gives_its_bytes_back() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let data = Buf::filled(&pair.fabric, 1000, Mem::Device(0), 7);
    let mut first = Buf::new(&pair.fabric, 5000, Mem::Device(1));
    let mut second = Buf::new(&pair.fabric, 600, Mem::Device(1));
    let mut third = Buf::new(&pair.fabric, 400, Mem::Host);
    pair.w[1].scope(|sr| {
        let r1 = sr.stream_recv(pair.ep[1], first.recv());
        pair.w[0].scope(|ss| {
            let s = ss.stream_send(pair.ep[0], data.send());
            pair.drive(|| s.test().is_some()).unwrap();
            pair.settle();
        });
        assert!(r1.test().is_none(), "not full yet");
        assert!(r1.cancel());
        assert!(matches!(r1.wait(), Err(Error::Canceled)));
        let r2 = sr.stream_recv(pair.ep[1], second.recv());
        let r3 = sr.stream_recv(pair.ep[1], third.recv());
        pair.drive(|| r2.test().is_some() && r3.test().is_some())
            .unwrap();
        assert_eq!(r2.wait().unwrap().len, 600);
        assert_eq!(r3.wait().unwrap().len, 400);
    });
    let want = pattern(7, 1000);
    assert!(second.bytes() == &want[..600]);
    assert!(third.bytes() == &want[600..]);
    assert_eq!(first.guard_damage(), None);
    pair.check_clean();
}

/// GPU memory the copy lane cannot register is refused when a stream receive is posted (with
/// the domain's reason); the stream is untouched and a host receive then gets the bytes.
#[test]
fn a_gpu_stream_receive_the_copy_lane_refuses_fails_when_posted() {
    let vb = with_fault(VARS, "md=sim_copy,mem=cuda,after=0");
    let pair = Pair::new(FabricSpec::gpu(), [VARS, &vb]);
    let data = Buf::filled(&pair.fabric, 100, Mem::Host, 3);
    let mut gpu = Buf::new(&pair.fabric, 100, Mem::Device(1));
    let mut host = Buf::new(&pair.fabric, 100, Mem::Host);
    pair.w[1].scope(|sr| {
        let bad = sr.stream_recv(pair.ep[1], gpu.recv());
        assert!(
            matches!(bad.test(), Some(Err(Error::Registration(_)))),
            "{:?}",
            bad.test()
        );
        let ok = sr.stream_recv(pair.ep[1], host.recv());
        pair.w[0].scope(|ss| ss.stream_send(pair.ep[0], data.send()).wait().unwrap());
        pair.drive(|| ok.test().is_some()).unwrap();
        assert_eq!(ok.wait().unwrap().len, 100);
    });
    assert!(host.bytes() == data.bytes());
    assert!(gpu.bytes().iter().all(|&b| b == harness::GUARD_BYTE));
    pair.check_warnings();
}

/// 64 KiB fragments: a 1 MiB stream receive lands in 17 copies through 4 slots.
const FINE: &[(&str, &str)] = &[("RUCX_ZCOPY_THRESH", "16K"), ("RUCX_RNDV_FRAG_SIZE", "64K")];

/// Large GPU stream receives go to the GPU in fragments through pinned slots, several copies in
/// flight and completing in any order (random delivery holds and reorders the copy lane's
/// completions, with push-back): every byte lands, the receives complete in full, and the
/// worker's pinned windows are reused (one per receive landing at the same time).
#[test]
fn gpu_stream_receives_land_through_pipelined_slots() {
    let vars = FINE;
    for delivery in [
        Delivery::InOrder,
        Delivery::Random {
            seed: 21,
            noresource_per_mille: 60,
        },
    ] {
        let pair = Pair::new(FabricSpec::gpu().delivery(delivery), [vars, vars]);
        let (d0, d1, h) = (Mem::Device(0), Mem::Device(1), Mem::Host);
        // 1 MiB + 3 is 17 fragments through 4 slots; then receives one after another.
        stream_case(&pair, 31, &[((1 << 20) + 3, d0)], &[((1 << 20) + 3, d1)]);
        stream_case(
            &pair,
            32,
            &[(700_000, h), (5, d0)],
            &[(300_001, d1), (4, h), (400_000, d1)],
        );
        // Seven GPU receives full at about the same time: more than the 4 windows the worker
        // has at most, so the last ones wait for a window to come back.
        stream_case(&pair, 33, &[(7 * 300_000, d0)], &[(300_000, d1); 7]);
        let c = pair.w[1].counters();
        assert_eq!(c.get("stream receive copied to GPU"), Some(&10), "{c:?}");
        // One window per receive landing at the same time, 4 at most.
        let made = c.get("staged put/get window made").copied().unwrap_or(0);
        assert!((1..=4).contains(&made), "{c:?}");
        for w in &pair.w {
            assert_eq!(w.live_requests(), 0);
        }
        pair.check_clean();
    }
}

/// A copy to the GPU that fails part way ends that stream receive with the error (no hang);
/// the stream goes on: the other receives get their bytes, intact and in order.
#[test]
fn a_failed_copy_ends_the_gpu_stream_receive_and_the_stream_goes_on() {
    for after in [2u64, 6, 20] {
        let pair = Pair::new(FabricSpec::gpu(), [FINE, FINE]);
        let n = (1 << 20) + 3;
        let all = pattern(77, 3 * n);
        let mut data = Buf::new(&pair.fabric, 3 * n, Mem::Host);
        data.bytes_mut().copy_from_slice(&all);
        let mut rbufs: Vec<Buf> = (0..3)
            .map(|_| Buf::new(&pair.fabric, n, Mem::Device(1)))
            .collect();
        let _dog = Watchdog::arm(60, format!("failed landing after {after}"));
        pair.fabric
            .fail_ops_after(pair.nodes[1], rucx_uct_sim::LaneKind::Copy, after, 1);
        let results: Vec<Result<Completion>> = pair.w[1].scope(|sr| {
            let rr: Vec<_> = rbufs
                .iter_mut()
                .map(|b| sr.stream_recv(pair.ep[1], b.recv()))
                .collect();
            pair.w[0].scope(|ss| {
                let s = ss.stream_send(pair.ep[0], data.send());
                pair.drive(|| s.test().is_some() && rr.iter().all(|r| r.test().is_some()))
                    .unwrap_or_else(|e| panic!("hangs: {e}"));
                assert_eq!(s.test().unwrap().expect("sent").len, 3 * n);
            });
            rr.iter().map(|r| r.test().unwrap()).collect()
        });
        let failed: Vec<usize> = (0..3).filter(|&k| results[k].is_err()).collect();
        assert_eq!(failed.len(), 1, "after {after}: {results:?}");
        let e = results[failed[0]].as_ref().unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
        for k in (0..3).filter(|k| *k != failed[0]) {
            assert_eq!(results[k].as_ref().unwrap().len, n);
            assert!(
                rbufs[k].bytes() == &all[k * n..(k + 1) * n],
                "after {after}: receive {k}'s bytes differ"
            );
        }
        for b in &rbufs {
            assert_eq!(b.guard_damage(), None);
        }
        pair.check_clean();
    }
}

/// A GPU stream send of 16 MiB + 7 in uneven pieces into host receives of other cuts, both
/// ways at once (the GPU machine's `gpu_am_stream` case that hung).
#[test]
fn gpu_stream_sends_into_host_receives_both_ways() {
    let pair = Pair::new(FabricSpec::gpu(), [VARS, VARS]);
    let total = (16 << 20) + 7;
    let cuts = [0, 3, 70_000, (1 << 20) + 1, total];
    let rcuts = [0, 1, 9_000, 5 << 20, total];
    let mk = |side: usize, mem: Mem, c: &[usize], fill: bool| -> Vec<Buf> {
        let all = pattern(side as u64 + 7, total);
        c.windows(2)
            .map(|w| {
                let mut b = Buf::new(&pair.fabric, w[1] - w[0], mem);
                if fill {
                    b.bytes_mut().copy_from_slice(&all[w[0]..w[1]]);
                }
                b
            })
            .collect()
    };
    let sends = [
        mk(0, Mem::Device(0), &cuts, true),
        mk(1, Mem::Device(1), &cuts, true),
    ];
    let mut recvs = [
        mk(0, Mem::Host, &rcuts, false),
        mk(1, Mem::Host, &rcuts, false),
    ];
    let _dog = Watchdog::arm(120, "GPU stream sends into host receives, both ways".into());
    let [r0, r1] = &mut recvs;
    pair.w[0].scope(|s0| {
        pair.w[1].scope(|s1| {
            let mut q0: Vec<_> = r0
                .iter_mut()
                .map(|b| s0.stream_recv(pair.ep[0], b.recv()))
                .collect();
            let mut q1: Vec<_> = r1
                .iter_mut()
                .map(|b| s1.stream_recv(pair.ep[1], b.recv()))
                .collect();
            q0.extend(
                sends[0]
                    .iter()
                    .map(|b| s0.stream_send(pair.ep[0], b.send())),
            );
            q1.extend(
                sends[1]
                    .iter()
                    .map(|b| s1.stream_send(pair.ep[1], b.send())),
            );
            let state = |q: &[rucx_ucp::Request<'_>]| -> Vec<String> {
                q.iter()
                    .map(|r| format!("{:?}", r.test().map(|x| x.map(|c| c.len))))
                    .collect()
            };
            pair.drive(|| q0.iter().chain(&q1).all(|r| r.test().is_some()))
                .unwrap_or_else(|e| {
                    panic!("{e}; side 0: {:?}; side 1: {:?}", state(&q0), state(&q1))
                });
            for r in q0.iter().chain(&q1) {
                r.test().unwrap().expect("done");
            }
        })
    });
    for (i, rb) in recvs.iter().enumerate() {
        let mut got = Vec::new();
        for b in rb {
            got.extend_from_slice(b.bytes());
        }
        assert!(
            got == pattern((1 - i) as u64 + 7, total),
            "side {i}: bytes differ"
        );
    }
}
