//! Segments never outlive their users: nothing is left in /dev/shm, neither after a normal
//! close nor after the owner is killed, with either backing.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use rucx_uct::Event;
use rucx_uct::conformance::ep_params_from_hex;

const ROLE: &str = "RUCX_POSIX_TEST_ROLE";

fn owner_child() {
    println!();
    let mut a = common::open_side(&[("POSIX_SEGMENT", "shm")]).unwrap();
    let mut b = common::open_side(&[("POSIX_SEGMENT", "memfd")]).unwrap();
    let _ab = a
        .iface
        .create_ep(&ep_params_from_hex(&b.address_hex(), 1).unwrap())
        .unwrap();
    let _ba = b
        .iface
        .create_ep(&ep_params_from_hex(&a.address_hex(), 2).unwrap())
        .unwrap();
    println!("READY");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn no_segment_is_left_behind() {
    if std::env::var(ROLE).is_ok() {
        return owner_child();
    }
    let me = format!("rucx-posix-{}-", std::process::id());
    // In process: names are gone as soon as the interface exists; descriptors go with it.
    {
        let mut a = common::open_side(&[("POSIX_SEGMENT", "shm")]).unwrap();
        let b = common::open_side(&[("POSIX_SEGMENT", "memfd")]).unwrap();
        let mut ep = a
            .iface
            .create_ep(&ep_params_from_hex(&b.address_hex(), 1).unwrap())
            .unwrap();
        let mut back = a
            .iface
            .create_ep(&ep_params_from_hex(&a.address_hex(), 2).unwrap())
            .unwrap();
        ep.am_short(1, 0, b"x").unwrap();
        back.am_short(1, 0, b"y").unwrap();
        let mut n = 0;
        while n == 0 {
            a.iface.progress(&mut |ev| {
                if let Event::Am { data, .. } = ev {
                    assert_eq!(&data[8..], b"y");
                    n += 1;
                }
            });
        }
        let open = common::own_segment_fds();
        assert_eq!(open.len(), 2, "{open:?}");
        assert!(
            open.iter()
                .all(|p| p.ends_with("(deleted)") || p.starts_with("/memfd:")),
            "{open:?}"
        );
        let named: Vec<_> = common::shm_entries()
            .into_iter()
            .filter(|n| n.starts_with(&me))
            .collect();
        assert!(
            named.is_empty(),
            "segments still named in /dev/shm: {named:?}"
        );
    }
    assert!(
        common::own_segment_fds().is_empty(),
        "descriptors left: {:?}",
        common::own_segment_fds()
    );

    // Killed owner: nothing of it remains in /dev/shm.
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "no_segment_is_left_behind",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "owner")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "child exited early");
        if l.trim() == "READY" {
            break;
        }
    }
    let theirs = format!("rucx-posix-{}-", child.id());
    child.kill().unwrap();
    child.wait().unwrap();
    let left: Vec<_> = common::shm_entries()
        .into_iter()
        .filter(|n| n.starts_with(&theirs))
        .collect();
    assert!(left.is_empty(), "killed owner left {left:?} in /dev/shm");

    // And no posix segment of any process that no longer runs.
    let stale: Vec<_> = common::shm_entries()
        .into_iter()
        .filter(|n| {
            let pid = n
                .trim_start_matches("rucx-posix-")
                .split('-')
                .next()
                .unwrap_or("");
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
        })
        .collect();
    assert!(stale.is_empty(), "leaked segments in /dev/shm: {stale:?}");
}
