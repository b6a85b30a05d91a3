//! `rc_verbs` over the software fabric: connection, active messages, flow control, put/get,
//! flush, error completions, and the UCT conformance suite through an in-process wire-up adapter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use rucx_ucs::{Config, Error};
use rucx_uct::conformance::{self, Side};
use rucx_uct::iface::pack_bytes;
use rucx_uct::{
    AmId, Availability, Component, Endpoint, EpParams, Event, EventSource, Iface, IfaceAttr,
    IfaceParams, Iov, MemHandle, MemRegion, MemoryDomain, OpStatus, RemoteKey,
};

use crate::IbComponent;
use crate::fake::{FakeFabric, device, ib_port, roce_port};
use crate::md::IbMd;

fn config(vars: &[(&str, &str)]) -> Config {
    Config::from_vars(&[crate::CONFIG], vars.iter().copied()).unwrap()
}

/// A fabric with two single-port IB devices on one subnet.
fn two_nics() -> FakeFabric {
    let fab = FakeFabric::new();
    fab.add_device(device("mlx5_0", vec![ib_port(1, 1)]));
    fab.add_device(device("mlx5_1", vec![ib_port(1, 2)]));
    fab
}

fn open_md(fab: &FakeFabric, name: &str, cfg: &Config) -> Arc<IbMd> {
    Arc::new(
        IbComponent::with_verbs(fab.verbs())
            .open(name, cfg)
            .unwrap(),
    )
}

fn open_iface(md: &Arc<IbMd>, cfg: &Config) -> Box<dyn Iface> {
    let tl = md.tl_resources().remove(0);
    md.open_iface(&tl, &IfaceParams { config: cfg }).unwrap()
}

fn ep(iface: &mut Box<dyn Iface>, user_id: u64) -> Box<dyn Endpoint> {
    iface
        .create_ep(&EpParams {
            user_id,
            ..Default::default()
        })
        .unwrap()
}

/// Wire two endpoints to each other.
fn wire(a: &dyn Iface, ea: &mut dyn Endpoint, b: &dyn Iface, eb: &mut dyn Endpoint) {
    let (aa, ab) = (ea.ep_address().unwrap(), eb.ep_address().unwrap());
    ea.connect_to_ep(&b.device_address(), &ab).unwrap();
    eb.connect_to_ep(&a.device_address(), &aa).unwrap();
}

struct Pair {
    fab: FakeFabric,
    mds: (Arc<IbMd>, Arc<IbMd>),
    a: Box<dyn Iface>,
    b: Box<dyn Iface>,
    ea: Box<dyn Endpoint>,
    eb: Box<dyn Endpoint>,
}

fn pair_with(vars: &[(&str, &str)]) -> Pair {
    let fab = two_nics();
    let cfg = config(vars);
    let (ma, mb) = (open_md(&fab, "mlx5_0", &cfg), open_md(&fab, "mlx5_1", &cfg));
    let (mut a, mut b) = (open_iface(&ma, &cfg), open_iface(&mb, &cfg));
    let (mut ea, mut eb) = (ep(&mut a, 1), ep(&mut b, 2));
    wire(&*a, &mut *ea, &*b, &mut *eb);
    Pair {
        fab,
        mds: (ma, mb),
        a,
        b,
        ea,
        eb,
    }
}

fn pair() -> Pair {
    pair_with(&[])
}

#[derive(Debug, Default)]
struct Seen {
    ams: Vec<(AmId, Vec<u8>)>,
    done: Vec<(u64, Result<(), String>)>,
    errors: Vec<(u64, String)>,
}

fn collect(iface: &mut Box<dyn Iface>, seen: &mut Seen) -> usize {
    iface.progress(&mut |ev| match ev {
        Event::Am { id, data } => seen.ams.push((id, data.to_vec())),
        Event::Completion { token, result } => {
            seen.done.push((token, result.map_err(|e| e.to_string())))
        }
        Event::EpError { user_id, error } => seen.errors.push((user_id, error.to_string())),
    })
}

/// Progress both sides until neither has anything to say.
fn settle(p: &mut Pair, sa: &mut Seen, sb: &mut Seen) {
    for _ in 0..1000 {
        if collect(&mut p.a, sa) + collect(&mut p.b, sb) == 0 {
            // One more round lets grants posted at the end of a progress call arrive.
            if collect(&mut p.a, sa) + collect(&mut p.b, sb) == 0 {
                return;
            }
        }
    }
    panic!("never settled");
}

fn reg(md: &Arc<IbMd>, buf: &[u8]) -> MemHandle {
    // SAFETY: every test keeps the buffer alive and unmoved while the handle lives.
    unsafe { md.mem_reg(MemRegion::of_slice(buf)) }.unwrap()
}

#[test]
fn discovery_over_the_fabric() {
    let fab = FakeFabric::new();
    fab.add_device(device("mlx5_0", vec![ib_port(1, 8)]));
    let mut down = ib_port(1, 0);
    down.state = crate::verbs::PortState::Down;
    fab.add_device(device("mlx5_1", vec![down]));
    let c = IbComponent::with_verbs(fab.verbs());
    let cfg = config(&[]);
    assert_eq!(
        c.query(&cfg),
        Availability::Available(vec!["mlx5_0".into()])
    );
    let md = c.open_md("mlx5_0", &cfg).unwrap();
    assert_eq!(md.name(), "mlx5_0");
    assert_eq!(md.tl_resources()[0].dev_name, "mlx5_0:1");
    assert_eq!(md.tl_resources()[0].tl_name, "rc_verbs");
    let lines = c.describe(&cfg).unwrap();
    assert!(
        lines.iter().any(|l| l.starts_with("mlx5_0:1: ACTIVE")),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("mlx5_1:1: DOWN")),
        "{lines:?}"
    );
    assert!(c.open_md("mlx5_1", &cfg).is_err());
    fab.set_library(Err("libibverbs.so.1: cannot open shared object file".into()));
    match c.query(&cfg) {
        Availability::Unavailable(r) => assert!(r.contains("libibverbs.so.1 not found"), "{r}"),
        a => panic!("{a:?}"),
    }
}

#[test]
fn active_messages_all_kinds() {
    let mut p = pair();
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    p.ea.am_short(3, 0x1122_3344_5566_7788, b"short").unwrap();
    assert_eq!(
        p.ea.am_bcopy(4, &mut pack_bytes(b"bcopy payload")).unwrap(),
        13
    );
    let data = vec![9u8; 3000];
    let memh = reg(&p.mds.0, &data);
    let iov = [Iov {
        addr: data.as_ptr() as usize + 100,
        len: 2000,
        memh: &memh,
    }];
    assert_eq!(
        p.ea.am_zcopy(5, b"hdr", &iov, 77).unwrap(),
        OpStatus::InProgress
    );
    settle(&mut p, &mut sa, &mut sb);
    let mut short = 0x1122_3344_5566_7788u64.to_le_bytes().to_vec();
    short.extend_from_slice(b"short");
    let mut zc = b"hdr".to_vec();
    zc.extend_from_slice(&data[100..2100]);
    assert_eq!(
        sb.ams,
        vec![(3, short), (4, b"bcopy payload".to_vec()), (5, zc)]
    );
    assert_eq!(sa.done, vec![(77, Ok(()))]);
    assert!(sa.errors.is_empty() && sb.errors.is_empty());
    // And back.
    p.eb.am_bcopy(6, &mut pack_bytes(b"reply")).unwrap();
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(sa.ams, vec![(6, b"reply".to_vec())]);
    assert_eq!(p.fab.cq_overruns(), 0);
}

#[test]
fn limits_are_enforced_without_side_effects() {
    let mut p = pair();
    let attr: IfaceAttr = p.a.attr().clone();
    let l = attr.limits;
    assert!(p.ea.am_short(1, 0, &vec![0; l.am_max_short + 1]).is_err());
    let e =
        p.ea.am_bcopy(1, &mut pack_bytes(&vec![0; l.am_max_bcopy + 1]))
            .unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    assert!(p.ea.am_short(64, 0, b"").is_err(), "am id out of range");
    let big = vec![0u8; l.am_max_zcopy + 1];
    let memh = reg(&p.mds.0, &big);
    assert!(p.ea.am_zcopy(1, b"", &[Iov::whole(&memh)], 1).is_err());
    assert!(p.ea.am_zcopy(1, &[0; 129], &[], 1).is_err());
    // Exactly at the limits works, and the bounce buffers given back above are reusable.
    for _ in 0..(2 * 64 + 5) {
        p.ea.am_bcopy(2, &mut pack_bytes(&vec![1; l.am_max_bcopy]))
            .map(|_| ())
            .or_else(|e| {
                assert!(e.is_retryable(), "{e}");
                let (mut sa, mut sb) = (Seen::default(), Seen::default());
                settle(&mut p, &mut sa, &mut sb);
                Ok::<(), Error>(())
            })
            .unwrap();
    }
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    settle(&mut p, &mut sa, &mut sb);
    assert!(sa.errors.is_empty() && sb.errors.is_empty());
}

#[test]
fn credits_stop_a_sender_and_grants_restart_it() {
    let mut p = pair_with(&[
        ("RUCX_RC_RX_QUEUE_LEN", "8"),
        ("RUCX_RC_TX_QUEUE_LEN", "16"),
    ]);
    let mut sent = 0;
    loop {
        match p.ea.am_short(1, sent, b"") {
            Ok(()) => sent += 1,
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                assert!(e.to_string().contains("credits"), "{e}");
                break;
            }
        }
    }
    assert_eq!(sent, 8, "exactly the peer's window");
    // The sender progressing alone gets nothing back.
    let mut sa = Seen::default();
    collect(&mut p.a, &mut sa);
    assert!(p.ea.am_short(1, 99, b"").is_err());
    // The receiver delivers and re-posts; it owes 8 >= threshold 4: a grant goes out.
    let mut sb = Seen::default();
    collect(&mut p.b, &mut sb);
    assert_eq!(sb.ams.len(), 8);
    collect(&mut p.a, &mut sa);
    for i in 0..8 {
        p.ea.am_short(1, 100 + i, b"").unwrap();
    }
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(sb.ams.len(), 16);
    let headers: Vec<u64> = sb
        .ams
        .iter()
        .map(|(_, d)| u64::from_le_bytes(d[..8].try_into().unwrap()))
        .collect();
    let want: Vec<u64> = (0..8).chain(100..108).collect();
    assert_eq!(headers, want, "in order");
    assert!(
        sa.errors.is_empty() && sb.errors.is_empty(),
        "{sa:?} {sb:?}"
    );
}

#[test]
fn sink_may_reply_from_inside_progress() {
    let mut p = pair();
    for i in 0..100u64 {
        p.ea.am_short(1, i, b"ping")
            .or_else(|e| {
                assert!(e.is_retryable());
                Ok::<(), Error>(())
            })
            .unwrap();
        let eb = &mut p.eb;
        p.b.progress(&mut |ev| {
            if let Event::Am { id: 1, data } = ev {
                // Reply while the interface is progressing: no lock may be held here.
                let _ = eb.am_bcopy(2, &mut pack_bytes(data));
            }
        });
        let mut sa = Seen::default();
        collect(&mut p.a, &mut sa);
    }
}

#[test]
fn put_get_flush() {
    let mut p = pair();
    let remote = vec![0u8; 8192];
    let rmemh = reg(&p.mds.1, &remote);
    let rkey = p
        .mds
        .0
        .rkey_unpack(&p.mds.1.mkey_pack(&rmemh).unwrap())
        .unwrap();
    let base = remote.as_ptr() as u64;
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let smemh = reg(&p.mds.0, &src);
    assert_eq!(
        p.ea.put_zcopy(&[Iov::whole(&smemh)], base + 100, &rkey, 1)
            .unwrap(),
        OpStatus::InProgress
    );
    p.ea.put_short(b"tiny", base + 10, &rkey).unwrap();
    assert_eq!(p.ea.flush(2).unwrap(), OpStatus::InProgress);
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(sa.done, vec![(1, Ok(())), (2, Ok(()))]);
    assert_eq!(&remote[100..4196], &src[..]);
    assert_eq!(&remote[10..14], b"tiny");
    // Nothing outstanding: flush is immediate.
    assert_eq!(p.ea.flush(3).unwrap(), OpStatus::Done);
    // Read it back, in two pieces (two iov entries).
    let dst = vec![0u8; 4096];
    let dmemh = reg(&p.mds.0, &dst);
    let iov = [
        Iov {
            addr: dst.as_ptr() as usize,
            len: 1000,
            memh: &dmemh,
        },
        Iov {
            addr: dst.as_ptr() as usize + 1000,
            len: 3096,
            memh: &dmemh,
        },
    ];
    p.ea.get_zcopy(&iov, base + 100, &rkey, 4).unwrap();
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(dst, src);
    // Out of bounds: rejected before anything is posted.
    assert!(matches!(
        p.ea.get_zcopy(&[Iov::whole(&dmemh)], base + 8000, &rkey, 5),
        Err(Error::OutOfBounds { .. })
    ));
    // Zero bytes: done at once.
    assert_eq!(p.ea.put_zcopy(&[], base, &rkey, 6).unwrap(), OpStatus::Done);
    assert!(sa.errors.is_empty() && sb.errors.is_empty());
    assert_eq!(sa.done.len(), 3);
}

#[test]
fn remote_access_error_fails_the_endpoint_once() {
    let mut p = pair();
    let remote = vec![0u8; 64];
    let rmemh = reg(&p.mds.1, &remote);
    let good = p
        .mds
        .0
        .rkey_unpack(&p.mds.1.mkey_pack(&rmemh).unwrap())
        .unwrap();
    // A key whose bounds pass but whose key the peer never issued.
    let forged = RemoteKey::new(
        "mlx5_0",
        good.base(),
        good.len(),
        Arc::new(crate::md::IbRkey { rkey: 0xdead }),
    );
    let src = vec![1u8; 32];
    let smemh = reg(&p.mds.0, &src);
    p.ea.put_zcopy(&[Iov::whole(&smemh)], good.base(), &forged, 10)
        .unwrap();
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(sa.errors.len(), 1, "{sa:?}");
    assert_eq!(sa.errors[0].0, 1);
    assert!(
        sa.errors[0].1.contains("remote access error"),
        "{}",
        sa.errors[0].1
    );
    assert_eq!(sa.done.len(), 1);
    assert_eq!(sa.done[0].0, 10);
    assert!(sa.done[0].1.is_err());
    // The endpoint is unusable from now on, with the reason.
    let e = p.ea.am_short(1, 0, b"").unwrap_err();
    assert!(matches!(e, Error::EndpointFailure { .. }), "{e}");
    assert!(p.ea.flush(11).is_err());
    // A second error is not reported again.
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(sa.errors.len(), 1);
}

#[test]
fn peer_failure_is_an_endpoint_error_and_pending_tokens_fail() {
    let mut p = pair();
    let qpn_b = p.fab.qps_of("mlx5_1")[0];
    p.fab.break_qp(qpn_b);
    let data = vec![3u8; 100];
    let memh = reg(&p.mds.0, &data);
    p.ea.am_zcopy(1, b"", &[Iov::whole(&memh)], 42).unwrap();
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    settle(&mut p, &mut sa, &mut sb);
    assert_eq!(sa.errors.len(), 1);
    assert!(
        sa.errors[0].1.contains("retry counter exceeded"),
        "{:?}",
        sa.errors
    );
    assert_eq!(sa.done.len(), 1);
    assert!(sa.done[0].1.as_ref().unwrap_err().contains("retry counter"));
    // The broken side's flushed receives are silent.
    assert!(sb.errors.is_empty(), "{sb:?}");
}

#[test]
fn endpoint_lifecycle_and_bad_addresses() {
    let fab = two_nics();
    let cfg = config(&[]);
    let md = open_md(&fab, "mlx5_0", &cfg);
    let mut a = open_iface(&md, &cfg);
    // Connect-to-interface is refused with the wire-up recipe.
    let e = a
        .create_ep(&EpParams {
            iface_addr: vec![1, 2, 3],
            ..Default::default()
        })
        .unwrap_err();
    assert!(e.to_string().contains("connect_to_ep"), "{e}");
    let mut e1 = ep(&mut a, 1);
    // Unconnected: operations say what to do.
    let err = e1.am_short(1, 0, b"").unwrap_err();
    assert!(err.to_string().contains("not connected"), "{err}");
    // Garbage addresses: errors, the endpoint stays connectable.
    assert!(e1.connect_to_ep(b"junk", b"junk").is_err());
    assert!(e1.connect_to_ep(&a.device_address(), &[0u8; 40]).is_err());
    assert!(!a.is_reachable(b"junk", b""));
    assert!(a.is_reachable(&a.device_address(), b""));
    // Loopback: an endpoint wired to itself.
    let me = e1.ep_address().unwrap();
    e1.connect_to_ep(&a.device_address(), &me).unwrap();
    assert!(
        e1.connect_to_ep(&a.device_address(), &me).is_err(),
        "connect twice"
    );
    e1.am_bcopy(7, &mut pack_bytes(b"to myself")).unwrap();
    let mut s = Seen::default();
    collect(&mut a, &mut s);
    assert_eq!(s.ams, vec![(7, b"to myself".to_vec())]);
    // Dropping the endpoint releases its QP and buffers.
    let (qps, mrs) = (fab.live_qps(), fab.live_mrs());
    drop(e1);
    assert_eq!(fab.live_qps(), qps - 1);
    assert_eq!(fab.live_mrs(), mrs - 1);
    // A buffer registered with another device is refused.
    let md1 = open_md(&fab, "mlx5_1", &cfg);
    let mut e2 = ep(&mut a, 2);
    let me2 = e2.ep_address().unwrap();
    e2.connect_to_ep(&a.device_address(), &me2).unwrap();
    let buf = vec![0u8; 16];
    let other = reg(&md1, &buf);
    let err = e2.am_zcopy(1, b"", &[Iov::whole(&other)], 1).unwrap_err();
    assert!(err.to_string().contains("mlx5_1"), "{err}");
}

#[test]
fn endpoint_count_is_bounded_by_the_cq() {
    let fab = two_nics();
    let cfg = config(&[("RUCX_RC_CQ_LEN", "300"), ("RUCX_RC_RX_QUEUE_LEN", "64")]);
    let md = open_md(&fab, "mlx5_0", &cfg);
    let mut a = open_iface(&md, &cfg);
    assert_eq!(a.attr().max_eps, Some(2));
    let _e1 = ep(&mut a, 1);
    let _e2 = ep(&mut a, 2);
    let e = a.create_ep(&EpParams::default()).unwrap_err();
    assert!(
        e.is_retryable() && e.to_string().contains("RUCX_RC_CQ_LEN"),
        "{e}"
    );
}

#[test]
fn roce_connects_through_the_grh() {
    let fab = FakeFabric::new();
    fab.add_device(device("rxe0", vec![roce_port(1, [10, 0, 0, 1])]));
    fab.add_device(device("rxe1", vec![roce_port(1, [10, 0, 0, 2])]));
    let cfg = config(&[]);
    let (ma, mb) = (open_md(&fab, "rxe0", &cfg), open_md(&fab, "rxe1", &cfg));
    let (mut a, mut b) = (open_iface(&ma, &cfg), open_iface(&mb, &cfg));
    let (mut ea, mut eb) = (ep(&mut a, 1), ep(&mut b, 2));
    wire(&*a, &mut *ea, &*b, &mut *eb);
    ea.am_bcopy(1, &mut pack_bytes(b"over roce")).unwrap();
    let mut s = Seen::default();
    collect(&mut b, &mut s);
    assert_eq!(s.ams, vec![(1, b"over roce".to_vec())]);
    // RoCE and InfiniBand ports do not reach each other.
    let fab2 = two_nics();
    let mi = open_md(&fab2, "mlx5_0", &cfg);
    let i = open_iface(&mi, &cfg);
    assert!(!a.is_reachable(&i.device_address(), b""));
}

/// Random traffic both ways with random progress: everything arrives once, in order, intact,
/// and no receive buffer is ever missing (the fabric fails a send that finds none).
mod random_traffic {
    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn both_ways(ops in proptest::collection::vec((0u8..4, 0usize..300), 1..400)) {
            let mut p = pair_with(&[("RUCX_RC_RX_QUEUE_LEN", "4"), ("RUCX_RC_TX_QUEUE_LEN", "4")]);
            let (mut sa, mut sb) = (Seen::default(), Seen::default());
            let (mut to_b, mut to_a) = (Vec::new(), Vec::new());
            for (i, (op, len)) in ops.into_iter().enumerate() {
                let msg: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
                match op {
                    0 => if p.ea.am_bcopy(1, &mut pack_bytes(&msg)).is_ok() { to_b.push(msg) },
                    1 => if p.eb.am_bcopy(2, &mut pack_bytes(&msg)).is_ok() { to_a.push(msg) },
                    2 => { collect(&mut p.a, &mut sa); }
                    _ => { collect(&mut p.b, &mut sb); }
                }
            }
            settle(&mut p, &mut sa, &mut sb);
            prop_assert!(sa.errors.is_empty() && sb.errors.is_empty(), "{:?} {:?}", sa.errors, sb.errors);
            prop_assert_eq!(sb.ams.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>(), to_b);
            prop_assert_eq!(sa.ams.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>(), to_a);
            prop_assert_eq!(p.fab.cq_overruns(), 0);
        }
    }
}

/// Progress `i` until it arms (nothing pending).
fn arm_quiet(i: &mut Box<dyn Iface>, seen: &mut Seen) {
    for _ in 0..1000 {
        collect(i, seen);
        match i.arm() {
            Ok(()) => return,
            Err(Error::Busy(_)) => {}
            Err(e) => panic!("arm: {e}"),
        }
    }
    panic!("arm stayed busy");
}

fn readable(fd: std::os::fd::RawFd) -> bool {
    rucx_ucs::event::wait_readable(fd, Some(std::time::Duration::ZERO)).unwrap()
}

fn fd_of(i: &dyn Iface) -> std::os::fd::RawFd {
    match i.event_source() {
        EventSource::Fd(fd) => fd,
        other => panic!("rc_verbs with a completion channel has a descriptor, not {other:?}"),
    }
}

/// A settled pair, what it delivered, and side a's event descriptor.
fn quiet_pair() -> (Pair, Seen, Seen, std::os::fd::RawFd) {
    let mut p = pair();
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    settle(&mut p, &mut sa, &mut sb);
    let fd = fd_of(&*p.a);
    (p, sa, sb, fd)
}

/// The active message `eb.am_short(3, 7, tag)` as `collect` records it.
fn am7(tag: &[u8]) -> (AmId, Vec<u8>) {
    let mut v = 7u64.to_le_bytes().to_vec();
    v.extend_from_slice(tag);
    (3, v)
}

/// Armed and quiet, the descriptor is idle; a completion on the armed CQ raises one event and
/// makes it readable; arming with that event pending takes it, acknowledges it once and is
/// busy (the descriptor idle again); progress then delivers the message.
#[test]
fn a_completion_on_the_armed_cq_makes_the_descriptor_readable_and_arm_busy() {
    let (mut p, mut sa, sb, fd) = quiet_pair();
    arm_quiet(&mut p.a, &mut sa);
    p.a.arm().expect("arming twice with nothing pending");
    assert!(!readable(fd), "armed and quiet: idle");
    let ev0 = p.fab.cq_events();
    assert!(ev0.armed);

    p.eb.am_short(3, 7, b"one").unwrap();
    assert!(
        readable(fd),
        "a completion on the armed CQ wakes the channel"
    );
    let ev1 = p.fab.cq_events();
    assert_eq!(ev1.raised, ev0.raised + 1);
    assert!(!ev1.armed, "an event disarms the CQ");

    assert!(matches!(p.a.arm(), Err(Error::Busy(_))));
    assert!(!readable(fd), "the event was taken");
    let ev2 = p.fab.cq_events();
    assert_eq!(ev2.acked, ev1.acked + 1, "acknowledged once");
    assert_eq!(
        ev2.notify_calls, ev1.notify_calls,
        "a busy arm does not re-arm the CQ"
    );
    assert_eq!(p.fab.unacked_events(), 0);
    collect(&mut p.a, &mut sa);
    assert_eq!(sa.ams.last(), Some(&am7(b"one")));
    // Quiet again: arms, idle.
    arm_quiet(&mut p.a, &mut sa);
    assert!(!readable(fd));
    assert!(sa.errors.is_empty() && sb.errors.is_empty());
}

/// A completion that lands after the last progress and before the CQ is armed raises no
/// event (the CQ was not armed). Arming polls once more after arming the CQ: it finds the
/// completion, keeps it and is busy, and the next progress delivers it. Without that poll the
/// arm would succeed and the caller would sleep past the message.
#[test]
fn a_completion_between_the_last_progress_and_arming_is_not_lost() {
    let (mut p, mut sa, sb, fd) = quiet_pair();
    // Progressed to quiet, not armed yet.
    assert!(!p.fab.cq_events().armed);
    p.eb.am_short(3, 7, b"between").unwrap();
    assert!(!readable(fd), "no event for a CQ that is not armed");
    let ev0 = p.fab.cq_events();
    assert!(matches!(p.a.arm(), Err(Error::Busy(_))));
    let ev1 = p.fab.cq_events();
    assert_eq!(ev1.notify_calls, ev0.notify_calls + 1, "the CQ was armed");
    assert_eq!(
        ev1.raised, ev0.raised,
        "and raised nothing for the queued completion"
    );
    // Kept completions are pending work: arming again is busy, without touching the CQ.
    assert!(matches!(p.a.arm(), Err(Error::Busy(_))));
    assert_eq!(p.fab.cq_events().notify_calls, ev1.notify_calls);
    // The next progress hands them out first, in order, then what the queue holds.
    p.eb.am_short(3, 7, b"after").unwrap();
    while sa.ams.len() < 2 {
        assert!(collect(&mut p.a, &mut sa) > 0, "kept completions were lost");
    }
    assert_eq!(sa.ams, vec![am7(b"between"), am7(b"after")]);
    arm_quiet(&mut p.a, &mut sa);
    assert!(!readable(fd));
    assert_eq!(p.fab.unacked_events(), 0);
    assert!(sa.errors.is_empty() && sb.errors.is_empty());
}

/// Every event put on the channel is taken and acknowledged exactly once, including one
/// without a completion behind it (which still makes arm busy once), and none is left
/// unacknowledged (a CQ with unacknowledged events cannot be destroyed).
#[test]
fn every_event_is_taken_and_acknowledged_once() {
    let (mut p, mut sa, mut sb, fd) = quiet_pair();
    let start = p.fab.cq_events();
    for round in 0..20u8 {
        arm_quiet(&mut p.a, &mut sa);
        assert!(!readable(fd));
        if round % 3 == 0 {
            p.fab.raise_cq_events();
        } else {
            p.eb.am_short(3, 7, &[round]).unwrap();
        }
        assert!(readable(fd), "round {round}");
        let before = p.fab.cq_events();
        assert!(matches!(p.a.arm(), Err(Error::Busy(_))));
        assert_eq!(p.fab.cq_events().acked, before.acked + 1, "round {round}");
        assert_eq!(p.fab.unacked_events(), 0);
        settle(&mut p, &mut sa, &mut sb);
    }
    let end = p.fab.cq_events();
    assert_eq!(end.raised - start.raised, 20);
    assert_eq!(end.acked, end.raised);
    assert_eq!(sa.ams.len(), 13);
    assert!(sa.errors.is_empty() && sb.errors.is_empty());
}

/// A CQ that fails while `arm` polls it after arming: the arm is busy (not an error of its
/// own, and not a sleep that would never end), and the next progress meets the failure and
/// fails the endpoint once.
#[test]
fn a_cq_failure_while_arming_is_busy_and_the_next_progress_reports_it() {
    let mut p = pair();
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    settle(&mut p, &mut sa, &mut sb);
    p.fab.overrun_cqs();
    assert!(matches!(p.a.arm(), Err(Error::Busy(_))));
    collect(&mut p.a, &mut sa);
    assert_eq!(sa.errors.len(), 1, "{:?}", sa.errors);
    assert_eq!(sa.errors[0].0, 1);
    assert!(
        sa.errors[0].1.contains("completion queue failed"),
        "{:?}",
        sa.errors
    );
    collect(&mut p.a, &mut sa);
    assert_eq!(sa.errors.len(), 1, "reported once");
}

/// As a worker sleeps on a lone interface (`Worker::wait` calls `arm_and_wait`): a thread
/// asleep on the rc interface is woken by the completion of a message the peer sends once the
/// CQ is armed, and its next progress delivers the message.
#[test]
fn a_thread_asleep_in_arm_and_wait_is_woken_by_a_completion() {
    let Pair {
        fab,
        mds: _mds,
        mut a,
        mut b,
        ea: _ea,
        mut eb,
    } = pair();
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    for _ in 0..100 {
        collect(&mut a, &mut sa);
        collect(&mut b, &mut sb);
    }
    let fd = fd_of(&*a);
    let raised = fab.cq_events().raised;
    let (armed_tx, armed_rx) = std::sync::mpsc::channel();
    let fab2 = fab.clone();
    let sleeper = std::thread::spawn(move || {
        arm_quiet(&mut a, &mut sa);
        armed_tx.send(()).unwrap();
        let acked = fab2.cq_events().acked;
        // A minute: far past any wake-up; a sleep that ends by it fails the test below.
        a.arm_and_wait(Some(std::time::Duration::from_secs(60)), None)
            .unwrap();
        // Woken by the event: it is pending on the channel, or (the message came before
        // `arm_and_wait` re-armed) its arm took it and did not sleep.
        let woke_by_event = readable(fd) || fab2.cq_events().acked > acked;
        for _ in 0..100 {
            if !sa.ams.is_empty() {
                break;
            }
            collect(&mut a, &mut sa);
        }
        (woke_by_event, sa, a)
    });
    // Send only once the sleeper armed its CQ, so that only the event can wake it.
    armed_rx.recv().unwrap();
    eb.am_short(3, 7, b"wake").unwrap();
    let (woke_by_event, sa, _a) = sleeper.join().unwrap();
    assert!(woke_by_event, "the sleep ended without an event");
    assert_eq!(sa.ams, vec![am7(b"wake")]);
    assert_eq!(fab.cq_events().raised, raised + 1);
}

/// A device without completion channels leaves rc_verbs poll-only: no descriptor, arming
/// refused as unsupported, traffic unaffected.
#[test]
fn without_a_completion_channel_the_interface_is_poll_only() {
    let fab = two_nics();
    fab.fail_comp_channel();
    let cfg = config(&[]);
    let (ma, mb) = (open_md(&fab, "mlx5_0", &cfg), open_md(&fab, "mlx5_1", &cfg));
    let (mut a, mut b) = (open_iface(&ma, &cfg), open_iface(&mb, &cfg));
    assert_eq!(a.event_source(), EventSource::PollOnly);
    assert!(matches!(a.arm(), Err(Error::Unsupported { .. })));
    let (mut ea, mut eb) = (ep(&mut a, 1), ep(&mut b, 2));
    wire(&*a, &mut *ea, &*b, &mut *eb);
    eb.am_short(3, 0, b"polled").unwrap();
    let mut sa = Seen::default();
    for _ in 0..100 {
        collect(&mut a, &mut sa);
        collect(&mut b, &mut Seen::default());
    }
    assert_eq!(sa.ams.len(), 1);
    assert_eq!(fab.cq_events().notify_calls, 0);
}

/// Runs `rucx_uct::conformance` (written for connect-to-interface transports) over `rc_verbs`:
/// the interface address is an in-process id, and the second of two endpoints created between
/// the same pair of interfaces wires both.
pub(super) mod conformance_adapter {
    use super::*;

    type Shared = Arc<Mutex<Box<dyn Endpoint>>>;
    /// Endpoints waiting for their partner, with their interface's device address.
    type Waiting = Vec<(Shared, Vec<u8>)>;

    #[derive(Default)]
    struct Board {
        /// (from, to) -> endpoints waiting for their partner, with their iface's device address.
        waiting: HashMap<(u64, u64), Waiting>,
    }

    #[derive(Debug)]
    struct WiredIface {
        inner: Box<dyn Iface>,
        id: u64,
        board: Arc<Mutex<BoardDbg>>,
    }

    #[derive(Default)]
    pub(super) struct BoardDbg(Board);

    impl std::fmt::Debug for BoardDbg {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Board")
        }
    }

    struct WiredEp(Shared);

    impl std::fmt::Debug for WiredEp {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("WiredEp")
        }
    }

    impl Iface for WiredIface {
        fn attr(&self) -> &IfaceAttr {
            self.inner.attr()
        }
        fn device_address(&self) -> Vec<u8> {
            self.inner.device_address()
        }
        fn iface_address(&self) -> Vec<u8> {
            self.id.to_le_bytes().to_vec()
        }
        fn is_reachable(&self, d: &[u8], _: &[u8]) -> bool {
            self.inner.is_reachable(d, &[])
        }
        fn create_ep(&mut self, params: &EpParams) -> rucx_ucs::Result<Box<dyn Endpoint>> {
            let to = u64::from_le_bytes(
                params
                    .iface_addr
                    .as_slice()
                    .try_into()
                    .map_err(|_| Error::InvalidAddress("id".into()))?,
            );
            let ep = self.inner.create_ep(&EpParams {
                dev_addr: params.dev_addr.clone(),
                iface_addr: vec![],
                user_id: params.user_id,
            })?;
            let shared: Shared = Arc::new(Mutex::new(ep));
            let mut board = self.board.lock().unwrap();
            let partner = board.0.waiting.get_mut(&(to, self.id)).and_then(|v| {
                if v.is_empty() {
                    None
                } else {
                    Some(v.remove(0))
                }
            });
            match partner {
                Some((other, other_dev)) => {
                    let mine_addr = shared.lock().unwrap().ep_address()?;
                    let other_addr = other.lock().unwrap().ep_address()?;
                    shared
                        .lock()
                        .unwrap()
                        .connect_to_ep(&other_dev, &other_addr)?;
                    other
                        .lock()
                        .unwrap()
                        .connect_to_ep(&self.inner.device_address(), &mine_addr)?;
                }
                None => board
                    .0
                    .waiting
                    .entry((self.id, to))
                    .or_default()
                    .push((shared.clone(), self.inner.device_address())),
            }
            Ok(Box::new(WiredEp(shared)))
        }
        fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
            self.inner.progress(sink)
        }
        fn event_source(&self) -> EventSource {
            self.inner.event_source()
        }
        fn arm(&mut self) -> rucx_ucs::Result<()> {
            self.inner.arm()
        }
    }

    impl Endpoint for WiredEp {
        fn am_short(&mut self, id: AmId, h: u64, p: &[u8]) -> rucx_ucs::Result<()> {
            self.0.lock().unwrap().am_short(id, h, p)
        }
        fn am_bcopy(
            &mut self,
            id: AmId,
            pack: &mut dyn FnMut(&mut [u8]) -> usize,
        ) -> rucx_ucs::Result<usize> {
            self.0.lock().unwrap().am_bcopy(id, pack)
        }
        fn am_zcopy(
            &mut self,
            id: AmId,
            h: &[u8],
            iov: &[Iov<'_>],
            t: u64,
        ) -> rucx_ucs::Result<OpStatus> {
            self.0.lock().unwrap().am_zcopy(id, h, iov, t)
        }
        fn put_short(&mut self, d: &[u8], a: u64, k: &RemoteKey) -> rucx_ucs::Result<()> {
            self.0.lock().unwrap().put_short(d, a, k)
        }
        fn put_zcopy(
            &mut self,
            iov: &[Iov<'_>],
            a: u64,
            k: &RemoteKey,
            t: u64,
        ) -> rucx_ucs::Result<OpStatus> {
            self.0.lock().unwrap().put_zcopy(iov, a, k, t)
        }
        fn get_zcopy(
            &mut self,
            iov: &[Iov<'_>],
            a: u64,
            k: &RemoteKey,
            t: u64,
        ) -> rucx_ucs::Result<OpStatus> {
            self.0.lock().unwrap().get_zcopy(iov, a, k, t)
        }
        fn flush(&mut self, t: u64) -> rucx_ucs::Result<OpStatus> {
            self.0.lock().unwrap().flush(t)
        }
    }

    /// A conformance side on `md`'s first port; `id` must be unique per board.
    pub(super) fn side_on(
        md: Arc<IbMd>,
        id: u64,
        board: &Arc<Mutex<BoardDbg>>,
        cfg: &Config,
    ) -> Side {
        let inner = open_iface(&md, cfg);
        Side {
            md,
            iface: Box::new(WiredIface {
                inner,
                id,
                board: board.clone(),
            }),
        }
    }

    fn side(
        fab: &FakeFabric,
        dev: &str,
        id: u64,
        board: &Arc<Mutex<BoardDbg>>,
        cfg: &Config,
    ) -> Side {
        let md = open_md(fab, dev, cfg);
        let inner = open_iface(&md, cfg);
        Side {
            md,
            iface: Box::new(WiredIface {
                inner,
                id,
                board: board.clone(),
            }),
        }
    }

    #[test]
    fn conformance_in_process_over_the_fabric() {
        let fab = two_nics();
        let cfg = config(&[]);
        let board = Arc::new(Mutex::new(BoardDbg::default()));
        let a = side(&fab, "mlx5_0", 1, &board, &cfg);
        let b = side(&fab, "mlx5_1", 2, &board, &cfg);
        let report = conformance::run_in_process(a, b).unwrap();
        report.print();
        assert!(report.passed.len() > 20, "{report:?}");
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        assert!(
            report
                .passed
                .iter()
                .any(|p| p.starts_with("armed: the peer's message woke")),
            "{report:?}"
        );
        assert_eq!(fab.cq_overruns(), 0);
        assert_eq!(fab.unacked_events(), 0);
    }

    #[test]
    fn conformance_loopback_over_the_fabric() {
        let fab = two_nics();
        let cfg = config(&[("RUCX_RC_RX_QUEUE_LEN", "4")]);
        let board = Arc::new(Mutex::new(BoardDbg::default()));
        let a = side(&fab, "mlx5_0", 1, &board, &cfg);
        let report = conformance::run_loopback(a).unwrap();
        report.print();
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        assert_eq!(fab.unacked_events(), 0);
    }
}

/// On a host with an RDMA NIC (neither machine of this project has one): the conformance suite
/// over the real device, two QPs talking through the NIC. Run with
/// `cargo test -p rucx-uct-ib -- --ignored --nocapture hardware`; `RUCX_IB_DEVICES=mlx5_0:1`
/// picks the port, other `RUCX_IB_*`/`RUCX_RC_*` variables apply too.
mod hardware {
    use super::conformance_adapter::{BoardDbg, side_on};
    use super::*;

    fn real_mds(cfg: &Config) -> Vec<Arc<IbMd>> {
        let c = IbComponent::new();
        match c.query(cfg) {
            Availability::Available(names) => names
                .iter()
                .map(|n| Arc::new(c.open(n, cfg).unwrap()))
                .collect(),
            Availability::Unavailable(r) => {
                panic!("this test needs an RDMA NIC with an ACTIVE port; ib is unavailable: {r}")
            }
        }
    }

    fn hw_config() -> Config {
        Config::from_env(&[crate::CONFIG]).unwrap()
    }

    #[test]
    #[ignore = "needs an RDMA NIC"]
    fn conformance_in_process_on_hardware() {
        let cfg = hw_config();
        let mds = real_mds(&cfg);
        for line in IbComponent::new().describe(&cfg).unwrap() {
            println!("{line}");
        }
        let board = Arc::new(Mutex::new(BoardDbg::default()));
        // Two devices when there are two (traffic crosses the fabric), else two QPs of one port.
        let a = side_on(mds[0].clone(), 1, &board, &cfg);
        let b = side_on(mds.get(1).unwrap_or(&mds[0]).clone(), 2, &board, &cfg);
        let report = conformance::run_in_process(a, b).unwrap();
        report.print();
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    }

    #[test]
    #[ignore = "needs an RDMA NIC"]
    fn conformance_loopback_on_hardware() {
        let cfg = hw_config();
        let mds = real_mds(&cfg);
        let board = Arc::new(Mutex::new(BoardDbg::default()));
        let report = conformance::run_loopback(side_on(mds[0].clone(), 1, &board, &cfg)).unwrap();
        report.print();
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    }
}
