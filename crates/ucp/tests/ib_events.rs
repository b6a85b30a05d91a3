//! A worker on a host with an RDMA device (the ib component over its software fabric): its
//! rc_verbs interface sleeps through a completion channel, so the worker is not poll-only; the
//! channel's events reach the worker's descriptor; a device without completion channels makes
//! the worker poll-only.
//!
//! (UCP does not carry messages over rc_verbs, a connect-to-endpoint transport, but a worker
//! opens an interface for every resource it is allowed, so an RDMA NIC used to make every
//! worker on its host nap for a millisecond at a time instead of sleeping.)

use std::sync::Arc;
use std::time::Duration;

use rucx_ucp::{Context, POLL_ONLY_TICK, Worker};
use rucx_ucs::{Config, Error};
use rucx_uct::Registry;
use rucx_uct_ib::IbComponent;
use rucx_uct_ib::fake::{FakeFabric, device, ib_port};

fn fabric() -> FakeFabric {
    let fab = FakeFabric::new();
    fab.add_device(device("mlx5_0", vec![ib_port(1, 1)]));
    fab
}

fn worker(fab: &FakeFabric) -> Worker {
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let cfg = Config::from_vars(&tables, [("RUCX_TLS", "rc_verbs")]).unwrap();
    let mut reg = Registry::new();
    reg.register(Arc::new(IbComponent::with_verbs(fab.verbs())));
    let ctx = Context::new(&reg, cfg).unwrap();
    let w = Worker::new(&ctx).unwrap();
    assert_eq!(w.transports(), vec!["rc_verbs/mlx5_0:1".to_string()]);
    w
}

fn readable(fd: std::os::fd::RawFd) -> bool {
    rucx_ucs::event::wait_readable(fd, Some(Duration::ZERO)).unwrap()
}

/// Progress until the worker arms.
fn arm_quiet(w: &Worker) {
    for _ in 0..1000 {
        w.progress();
        match w.arm() {
            Ok(()) => return,
            Err(Error::Busy(_)) => {}
            Err(e) => panic!("arm: {e}"),
        }
    }
    panic!("the worker stayed busy");
}

#[test]
fn a_worker_with_rc_verbs_sleeps_and_the_channel_wakes_its_descriptor() {
    let fab = fabric();
    let w = worker(&fab);
    assert!(
        w.wait_tick() > POLL_ONLY_TICK,
        "rc_verbs with a completion channel does not make the worker poll-only ({:?})",
        w.wait_tick()
    );
    let fd = w.event_fd().unwrap();
    arm_quiet(&w);
    assert!(fab.cq_events().armed, "the worker's arm armed the CQ");
    assert!(!readable(fd), "armed and quiet: idle");
    // An event on the channel makes the worker's descriptor readable.
    fab.raise_cq_events();
    assert!(readable(fd));
    // Arming with it pending is busy and takes (and acknowledges) it.
    let acked = fab.cq_events().acked;
    assert!(matches!(w.arm(), Err(Error::Busy(_))));
    assert_eq!(fab.cq_events().acked, acked + 1);
    assert_eq!(fab.unacked_events(), 0);
    arm_quiet(&w);
    assert!(!readable(fd));
}

#[test]
fn a_device_without_completion_channels_makes_the_worker_poll_only() {
    let fab = fabric();
    fab.fail_comp_channel();
    let w = worker(&fab);
    assert_eq!(w.wait_tick(), POLL_ONLY_TICK);
    // Arming succeeds (for the others); the poll-only interface is left to the short naps.
    arm_quiet(&w);
    assert_eq!(fab.cq_events().notify_calls, 0);
    w.wait(Some(Duration::from_millis(1))).unwrap();
}
