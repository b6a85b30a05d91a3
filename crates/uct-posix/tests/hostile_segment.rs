//! A hostile peer process whose shared memory can shrink: a mapping of a file its owner may
//! truncate faults (`SIGBUS`, the whole process dies) on the next access past the new end.
//! rucx seals the size of every memfd segment it makes; a peer's segment that is not sealed
//! (a shm segment, or a file the peer made itself) is never mapped: its receive ring is refused,
//! and its shared-memory keys are served by cross-memory attach, which turns a vanished page
//! into an error.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdout, Command, Stdio};

use rucx_ucs::Error;
use rucx_uct::conformance::ep_params_from_hex;
use rucx_uct::{Iov, MemRegion};
use rucx_uct_posix::{IfaceAddr, RkeyData, ShmInfo};

const ROLE: &str = "RUCX_POSIX_HOSTILE_ROLE";
const LEN: usize = 1 << 16;

fn byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// FNV-1a 64 of what `/proc/<pid>/fd/<fd>` points to (how a shared key names its segment).
fn link_tag(fd: i32) -> u64 {
    let link = std::fs::read_link(format!("/proc/{}/fd/{fd}", std::process::id())).unwrap();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in link.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The hostile owner: an honest interface, and a shared-memory key of a file it made itself,
/// without seals; told to, it truncates the file to nothing.
fn shrinking_owner() {
    println!();
    let side = common::open_side(&[]).unwrap();
    // SAFETY: a valid NUL-terminated name; no flags (so no seals can ever be added).
    let fd = unsafe { libc::memfd_create(c"hostile".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` was just made and is owned here only.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(LEN as u64).unwrap();
    let map = memmap2::MmapOptions::new().len(LEN).map_raw(&file).unwrap();
    let base = map.as_mut_ptr() as u64;
    for i in 0..LEN {
        // SAFETY: inside the mapping, which lives until the process ends.
        unsafe { *map.as_mut_ptr().add(i) = byte(i) };
    }
    let me = IfaceAddr::unpack(&side.iface.iface_address()).unwrap();
    let key = RkeyData {
        pid: me.pid,
        token: me.token,
        base,
        len: LEN as u64,
        shm: None,
    }
    .pack_shared(ShmInfo {
        fd: file.as_raw_fd() as u32,
        seg_base: base,
        seg_len: LEN as u64,
        tag: link_tag(file.as_raw_fd()),
    });
    println!("ADDR {} {} {base:x}", side.address_hex(), common::hex(&key));
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    file.set_len(0).unwrap();
    println!("SHRUNK");
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_line(&mut line);
}

/// An interface whose receive ring is a shm segment (which cannot be sealed).
fn shm_owner() {
    println!();
    let side = common::open_side(&[("POSIX_SEGMENT", "shm")]).unwrap();
    println!("ADDR {} - 0", side.address_hex());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn spawn(test: &str, role: &str) -> (Child, BufReader<ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

fn line_with(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "child exited early");
        if let Some(rest) = l.trim().strip_prefix(prefix) {
            return rest.to_string();
        }
    }
}

#[test]
fn a_shared_key_of_a_segment_that_can_shrink_is_never_mapped() {
    const NAME: &str = "a_shared_key_of_a_segment_that_can_shrink_is_never_mapped";
    if std::env::var(ROLE).is_ok() {
        return shrinking_owner();
    }
    let (mut child, mut out) = spawn(NAME, "shrink");
    let rest = line_with(&mut out, "ADDR ");
    let f: Vec<&str> = rest.split(' ').collect();
    let raddr = u64::from_str_radix(f[2], 16).unwrap();
    let mut side = common::open_side(&[]).unwrap();
    let mut ep = side
        .iface
        .create_ep(&ep_params_from_hex(f[0], 7).unwrap())
        .unwrap();
    let rkey = side.md.rkey_unpack(&common::unhex(f[1])).unwrap();
    assert_eq!(
        side.md.rkey_ptr(&rkey).unwrap(),
        None,
        "a segment that can shrink is not mapped"
    );
    let mut local = vec![0u8; LEN];
    // SAFETY: `local` outlives the handle (dropped at the end of the test).
    let memh = unsafe { side.md.mem_reg(MemRegion::of_slice(&local)) }.unwrap();
    let iov = [Iov {
        addr: local.as_mut_ptr() as usize,
        len: LEN,
        memh: &memh,
    }];
    ep.get_zcopy(&iov, raddr, &rkey, 0).unwrap();
    assert!(local.iter().enumerate().all(|(i, b)| *b == byte(i)));
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "shrink").unwrap();
    line_with(&mut out, "SHRUNK");
    // Mapped, this read would kill the test with SIGBUS; by cross-memory attach it is an error.
    let e = ep.get_zcopy(&iov, raddr, &rkey, 0).unwrap_err();
    assert!(e.to_string().contains("not mapped any more"), "{e}");
    let e = ep.put_zcopy(&iov, raddr, &rkey, 0).unwrap_err();
    assert!(e.to_string().contains("not mapped any more"), "{e}");
    drop(memh);
    drop(stdin);
    child.wait().unwrap();
}

#[test]
fn a_peer_whose_receive_ring_can_shrink_is_refused() {
    const NAME: &str = "a_peer_whose_receive_ring_can_shrink_is_refused";
    if std::env::var(ROLE).is_ok() {
        return shm_owner();
    }
    let (mut child, mut out) = spawn(NAME, "shm");
    let rest = line_with(&mut out, "ADDR ");
    let addr = rest.split(' ').next().unwrap().to_string();
    let mut side = common::open_side(&[]).unwrap();
    let e = side
        .iface
        .create_ep(&ep_params_from_hex(&addr, 7).unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported { why, .. } if why.contains("not sealed")),
        "{e}"
    );
    drop(child.stdin.take());
    child.wait().unwrap();
}
