//! The UCT conformance suite over the posix transport: in one process, and across two real
//! processes (the test spawns a child of its own binary).

mod common;

use rucx_uct::conformance::{self, ProcessPlan};

#[test]
fn conformance_in_process() {
    let a = common::open_side(&[]).unwrap();
    let b = common::open_side(&[]).unwrap();
    let report = conformance::run_in_process(a, b).unwrap();
    report.print();
    assert!(
        report.skipped.is_empty(),
        "posix skipped checks: {:?}",
        report.skipped
    );
}

#[test]
fn conformance_in_process_shm_segments_small_cells() {
    let opts = [
        ("POSIX_SEGMENT", "shm"),
        ("POSIX_FIFO_SIZE", "4"),
        ("POSIX_CELL_SIZE", "256"),
    ];
    let a = common::open_side(&opts).unwrap();
    let b = common::open_side(&opts).unwrap();
    conformance::run_in_process(a, b).unwrap().print();
}

/// In a spawned child, libtest has printed "test NAME ... " without a newline; the harness
/// looks for its address marker at the start of a line, so end that line first.
fn end_libtest_line() {
    if std::env::var(conformance::ROLE_ENV).is_ok() {
        println!();
    }
}

#[test]
fn conformance_two_process() {
    end_libtest_line();
    let report = conformance::two_process(
        "conformance_two_process",
        || common::open_side(&[]),
        &ProcessPlan::default(),
    )
    .unwrap();
    report.print();
}

#[test]
fn conformance_two_children() {
    end_libtest_line();
    // Both the initiator and the responder in children; this process only relays addresses.
    let plan = ProcessPlan {
        initiator_launcher: Some(vec![]),
        ..ProcessPlan::default()
    };
    conformance::two_process("conformance_two_children", || common::open_side(&[]), &plan)
        .unwrap()
        .print();
}
