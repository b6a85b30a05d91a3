//! The UCT conformance suite over the tcp transport: in one process over `lo`, and across two
//! real processes over `lo` (the test spawns children of its own binary). The run across two
//! network namespaces is in `netns.rs`.

mod common;

use rucx_uct::conformance::{self, ProcessPlan};

#[test]
fn conformance_in_process_lo() {
    let report =
        conformance::run_in_process(common::open_lo().unwrap(), common::open_lo().unwrap())
            .unwrap();
    report.print();
    assert!(
        report.skipped.is_empty(),
        "tcp skipped checks: {:?}",
        report.skipped
    );
}

#[test]
fn conformance_in_process_lo_tiny_socket_buffers() {
    // Small kernel buffers make every large frame go out and come in over many partial writes
    // and reads.
    let opts = [
        ("TCP_SNDBUF", "32K"),
        ("TCP_RCVBUF", "32K"),
        ("TCP_TX_QUEUE", "64K"),
    ];
    let a = common::open_side_on("lo", &opts).unwrap();
    let b = common::open_side_on("lo", &opts).unwrap();
    conformance::run_in_process(a, b).unwrap().print();
}

#[test]
fn conformance_two_process_lo() {
    common::end_libtest_line();
    let report = conformance::two_process(
        "conformance_two_process_lo",
        common::open_lo,
        &ProcessPlan::default(),
    )
    .unwrap();
    report.print();
}

#[test]
fn conformance_two_children_lo() {
    common::end_libtest_line();
    // Initiator and responder both in children; this process only relays the addresses.
    let plan = ProcessPlan {
        initiator_launcher: Some(vec![]),
        ..ProcessPlan::default()
    };
    conformance::two_process("conformance_two_children_lo", common::open_lo, &plan)
        .unwrap()
        .print();
}
