//! A peer process killed in the middle of a stream: every operation in flight completes with
//! an error, the endpoint reports the failure, nothing hangs.

mod common;

use common::{ChildProc, ROLE, unhex};

#[test]
fn peer_killed_mid_stream() {
    if std::env::var(ROLE).is_ok() {
        common::victim_main(Some("lo"));
        return;
    }
    let mut victim = ChildProc::spawn("peer_killed_mid_stream", "victim", &[], &[]);
    let addr = victim.expect_line("RXADDR");
    let rkey = unhex(&victim.expect_line("RXRKEY"));
    let base: u64 = victim.expect_line("RXBASE").parse().unwrap();
    let mut side = common::open_lo().unwrap();
    let mut killed = false;
    let out = common::stream_until_failure(&mut side, &addr, &rkey, base, &mut |ok| {
        // Kill once a good stream is running, with a full window of operations in flight.
        if ok >= 200 && !killed {
            victim.child.kill().expect("kill the victim");
            killed = true;
        }
        killed
    });
    println!("{out:?}");
    let ep = out.ep_error.clone().expect("endpoint error");
    assert!(
        ep.contains("closed") || ep.contains("reset") || ep.contains("Broken pipe"),
        "{ep}"
    );
    assert!(out.ok >= 200);
    assert!(
        out.failed + out.refused >= 1,
        "operations in flight at the kill must fail: {out:?}"
    );
    println!("peer death detected {:?} after the kill", out.detect);
    let _ = victim.child.wait();
}
