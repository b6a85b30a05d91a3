//! Killing the peer process mid-stream: operations on the endpoint to it fail with an error
//! within seconds (never hang), the interface reports the endpoint error once, and the
//! survivor's own receive ring keeps working even if the peer died while writing into it.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rucx_ucs::Error;
use rucx_uct::conformance::ep_params_from_hex;
use rucx_uct::iface::pack_bytes;
use rucx_uct::{Event, Iov, MemRegion};

const ROLE: &str = "RUCX_POSIX_TEST_ROLE";
const AM_STREAM: u8 = 5;
/// Not a performance bound: only how long the test waits before calling the transport hung.
const HANG_GUARD: Duration = Duration::from_secs(30);

/// The child: streams messages to the parent as fast as it can, and consumes the parent's.
fn streamer() {
    println!();
    let mut side = common::open_side(&[]).unwrap();
    let buf = vec![0x5au8; 65536];
    // SAFETY: `buf` lives until the process is killed or exits.
    let memh = unsafe { side.md.mem_reg(MemRegion::of_slice(&buf)) }.unwrap();
    let rkey = side.md.mkey_pack(&memh).unwrap();
    println!(
        "ADDR {} {} {:x}",
        side.address_hex(),
        common::hex(&rkey),
        buf.as_ptr() as usize
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let mut ep = side
        .iface
        .create_ep(&ep_params_from_hex(&line, 1).unwrap())
        .unwrap();
    let start = Instant::now();
    let mut seq = 0u64;
    while start.elapsed() < HANG_GUARD {
        match ep.am_bcopy(AM_STREAM, &mut pack_bytes(&seq.to_le_bytes())) {
            Ok(_) => seq += 1,
            Err(e) if e.is_retryable() => {}
            Err(_) => return, // the parent is gone
        }
        side.iface.progress(&mut |_| {});
    }
}

#[test]
fn killed_peer_fails_operations_within_seconds() {
    if std::env::var(ROLE).is_ok() {
        return streamer();
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "killed_peer_fails_operations_within_seconds",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "streamer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let (addr, rkey, raddr) = loop {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "child exited before printing its address"
        );
        if let Some(rest) = l.trim().strip_prefix("ADDR ") {
            let f: Vec<&str> = rest.split(' ').collect();
            break (
                f[0].to_string(),
                common::unhex(f[1]),
                u64::from_str_radix(f[2], 16).unwrap(),
            );
        }
    };
    let mut side = common::open_side(&[]).unwrap();
    let mut ep = side
        .iface
        .create_ep(&ep_params_from_hex(&addr, 7).unwrap())
        .unwrap();
    let rkey = side.md.rkey_unpack(&rkey).unwrap();
    let stdin = child.stdin.as_mut().unwrap();
    writeln!(stdin, "{}", side.address_hex()).unwrap();
    stdin.flush().unwrap();

    // Stream both ways until well under way.
    let local = vec![1u8; 4096];
    // SAFETY: `local` outlives the handle (dropped at the end of the test).
    let memh = unsafe { side.md.mem_reg(MemRegion::of_slice(&local)) }.unwrap();
    let (mut got, mut sent, mut puts) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    while got < 5000 || sent < 5000 || puts < 100 {
        assert!(
            start.elapsed() < HANG_GUARD,
            "streaming stalled: got {got}, sent {sent}"
        );
        side.iface.progress(&mut |ev| match ev {
            Event::Am {
                id: AM_STREAM,
                data,
            } => {
                assert_eq!(
                    u64::from_le_bytes(data.try_into().unwrap()),
                    got,
                    "out of order"
                );
                got += 1;
            }
            other => panic!("unexpected event before the kill: {other:?}"),
        });
        match ep.am_short(AM_STREAM, sent, b"ping") {
            Ok(()) => sent += 1,
            Err(e) if e.is_retryable() => {}
            Err(e) => panic!("send failed before the kill: {e}"),
        }
        if puts < 100 {
            ep.put_zcopy(&[Iov::whole(&memh)], raddr + 1024, &rkey, 0)
                .unwrap();
            puts += 1;
        }
    }

    let pid = child.id();
    child.kill().unwrap(); // SIGKILL; not reaped yet, so the peer is a zombie for a while
    let killed = Instant::now();
    let (mut send_error, mut ep_error) = (None::<Error>, 0);
    while send_error.is_none() || ep_error == 0 {
        assert!(
            killed.elapsed() < HANG_GUARD,
            "no failure reported {HANG_GUARD:?} after killing pid {pid} (send error: {send_error:?}, ep errors: {ep_error})"
        );
        side.iface.progress(&mut |ev| {
            if let Event::EpError { user_id, error } = ev {
                assert_eq!(user_id, 7);
                assert!(matches!(error, Error::EndpointFailure { .. }), "{error}");
                ep_error += 1;
            }
        });
        if send_error.is_none() {
            match ep.am_short(AM_STREAM, 0, b"after") {
                Ok(()) => {}
                Err(e) if e.is_retryable() => {}
                Err(e) => send_error = Some(e),
            }
        }
    }
    println!(
        "peer pid {pid} killed; endpoint failure seen {:?} later: {}",
        killed.elapsed(),
        send_error.as_ref().unwrap()
    );
    assert!(matches!(send_error, Some(Error::EndpointFailure { .. })));
    // Reported once only.
    for _ in 0..1000 {
        side.iface
            .progress(&mut |ev| panic!("second event after the failure: {ev:?}"));
    }
    // Every later operation fails the same way, at once.
    let iov = [Iov::whole(&memh)];
    let results = [
        ep.am_short(1, 0, b"x").map(|_| ()),
        ep.am_bcopy(1, &mut pack_bytes(b"x")).map(|_| ()),
        ep.am_zcopy(1, &[], &iov, 1).map(|_| ()),
        ep.put_short(b"x", raddr, &rkey),
        ep.put_zcopy(&iov, raddr, &rkey, 2).map(|_| ()),
        ep.get_zcopy(&iov, raddr, &rkey, 3).map(|_| ()),
        ep.flush(4).map(|_| ()),
    ];
    for r in results {
        assert!(matches!(r, Err(Error::EndpointFailure { .. })), "{r:?}");
    }

    // Our own ring still flows, even if the child died half-way through writing a message.
    let mut me = side
        .iface
        .create_ep(&ep_params_from_hex(&side.address_hex(), 9).unwrap())
        .unwrap();
    let mut mine = 0;
    let t = Instant::now();
    let mut posted = 0;
    while mine < 3 {
        assert!(
            t.elapsed() < HANG_GUARD,
            "own ring wedged after the peer died"
        );
        if posted < 3 {
            match me.am_short(AM_STREAM + 1, posted, &[]) {
                Ok(()) => posted += 1,
                Err(e) => assert!(e.is_retryable(), "{e}"),
            }
        }
        side.iface.progress(&mut |ev| {
            if let Event::Am { id, .. } = ev
                && id == AM_STREAM + 1
            {
                mine += 1;
            }
        });
    }
    drop(memh);
    let status = child.wait().unwrap();
    assert!(!status.success());
}

#[test]
fn connecting_to_a_dead_process_fails_cleanly() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let mut side = common::open_side(&[]).unwrap();
    let other = common::open_side(&[]).unwrap();
    let params = ep_params_from_hex(&other.address_hex(), 3).unwrap();
    drop(other);
    // The descriptor is closed: connecting fails with an error, not a crash.
    let e = side.iface.create_ep(&params).unwrap_err();
    println!("{e}");
    // Garbage addresses are rejected.
    let mut bad = params.clone();
    bad.iface_addr.truncate(10);
    assert!(side.iface.create_ep(&bad).is_err());
    let mut bad = params.clone();
    bad.dev_addr = vec![1, 2, 3];
    assert!(side.iface.create_ep(&bad).is_err());
    assert!(!side.iface.is_reachable(&params.dev_addr, &[0; 8]));
}

#[test]
fn closed_peer_interface_fails_the_endpoint() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let mut a =
        common::open_side(&[("POSIX_FIFO_SIZE", "4"), ("POSIX_PEER_CHECK", "1ms")]).unwrap();
    let b = common::open_side(&[]).unwrap();
    let mut ep = a
        .iface
        .create_ep(&ep_params_from_hex(&b.address_hex(), 4).unwrap())
        .unwrap();
    ep.am_short(1, 0, b"hi").unwrap();
    drop(b);
    let t = Instant::now();
    let err = loop {
        assert!(
            t.elapsed() < HANG_GUARD,
            "sends into a closed interface never failed"
        );
        match ep.am_short(1, 0, b"hi") {
            Err(e) if !e.is_retryable() => break e,
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    assert!(err.to_string().contains("closed"), "{err}");
    let mut reported = 0;
    let t = Instant::now();
    while reported == 0 {
        assert!(t.elapsed() < HANG_GUARD);
        a.iface.progress(&mut |ev| {
            if let Event::EpError { user_id: 4, .. } = ev {
                reported += 1;
            }
        });
    }
}
