//! Put/get on a peer process's shared allocation go through a mapping of its segment: the
//! bytes are right, and when the peer is killed the copies never fault; operations on the
//! endpoint fail with an endpoint error within the peer-check interval (as with cross-memory
//! attach) instead of reading on forever.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rucx_ucs::Error;
use rucx_uct::conformance::ep_params_from_hex;
use rucx_uct::{Iov, MemRegion};

const ROLE: &str = "RUCX_POSIX_MAPPED_ROLE";
const LEN: usize = 1 << 20;
/// Not a performance bound: only how long the test waits before calling the transport hung.
const HANG_GUARD: Duration = Duration::from_secs(30);

fn byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// The child: a shared allocation holding the pattern, a key of a region inside it (as the
/// registration cache makes), then it waits to be killed.
fn owner() {
    println!();
    let side = common::open_side(&[]).unwrap();
    let Some(a) = side.md.mem_alloc_shared(LEN + 8192).unwrap() else {
        println!("NOSHARE");
        return;
    };
    // SAFETY: the allocation is ours and alive until the process ends.
    let s = unsafe { std::slice::from_raw_parts_mut(a.addr as *mut u8, a.len) };
    for (i, b) in s[4096..4096 + LEN].iter_mut().enumerate() {
        *b = byte(i);
    }
    // SAFETY: the region lies inside the live allocation.
    let memh = unsafe { side.md.mem_reg(MemRegion::host(a.addr + 4096, LEN)) }.unwrap();
    let rkey = side.md.mkey_pack(&memh).unwrap();
    println!(
        "ADDR {} {} {:x}",
        side.address_hex(),
        common::hex(&rkey),
        a.addr + 4096
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    std::thread::sleep(HANG_GUARD);
}

#[test]
fn mapped_gets_of_a_killed_peer_never_fault_and_then_fail() {
    if std::env::var(ROLE).is_ok() {
        return owner();
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "mapped_gets_of_a_killed_peer_never_fault_and_then_fail",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "owner")
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
        if l.trim() == "NOSHARE" {
            println!("SKIPPED: posix cannot share memory here");
            let _ = child.wait();
            return;
        }
        if let Some(rest) = l.trim().strip_prefix("ADDR ") {
            let f: Vec<&str> = rest.split(' ').collect();
            break (
                f[0].to_string(),
                common::unhex(f[1]),
                u64::from_str_radix(f[2], 16).unwrap(),
            );
        }
    };
    let mut side = common::open_side(&[("POSIX_PEER_CHECK", "10ms")]).unwrap();
    let mut ep = side
        .iface
        .create_ep(&ep_params_from_hex(&addr, 7).unwrap())
        .unwrap();
    let rkey = side.md.rkey_unpack(&rkey).unwrap();
    let mut local = vec![0u8; LEN];
    // SAFETY: `local` outlives the handle (dropped at the end of the test).
    let memh = unsafe { side.md.mem_reg(MemRegion::of_slice(&local)) }.unwrap();
    let iov = [Iov {
        addr: local.as_mut_ptr() as usize,
        len: LEN,
        memh: &memh,
    }];
    ep.get_zcopy(&iov, raddr, &rkey, 0).unwrap();
    assert!(
        local.iter().enumerate().all(|(i, b)| *b == byte(i)),
        "the read of the peer's region is wrong"
    );

    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    // Reads go on through our mapping (never a fault) until the endpoint sees the death.
    let e = loop {
        assert!(
            killed.elapsed() < HANG_GUARD,
            "gets on a dead peer still succeed after {HANG_GUARD:?}"
        );
        local.fill(0);
        match ep.get_zcopy(&iov, raddr, &rkey, 0) {
            Ok(_) => assert!(
                local.iter().enumerate().all(|(i, b)| *b == byte(i)),
                "a read after the kill returned other bytes than the peer had written"
            ),
            Err(e) => break e,
        }
        side.iface.progress(&mut |_| {});
    };
    assert!(matches!(e, Error::EndpointFailure { .. }), "{e}");
    drop(memh);
}
