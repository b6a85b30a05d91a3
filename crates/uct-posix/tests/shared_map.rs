//! A shared segment allocated by one process is mapped by another through its remote key, and
//! both see each other's writes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use rucx_ucs::Config;
use rucx_uct::{Component, MemoryDomain};
use rucx_uct_posix::PosixComponent;

fn md() -> std::sync::Arc<dyn MemoryDomain> {
    let cfg = Config::new(&[rucx_uct_posix::CONFIG]).unwrap();
    PosixComponent.open_md("posix", &cfg).unwrap()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn peer_maps_a_shared_segment() {
    let m = md();
    if let Ok(key) = std::env::var("RUCX_SHM_CHILD_KEY") {
        let k = m.rkey_unpack(&unhex(&key)).unwrap();
        let p = m.rkey_ptr(&k).unwrap().expect("a shared key maps");
        // SAFETY: the mapping covers the key's region (checked by rkey_ptr) and stays mapped
        // for the domain's life; the parent does not touch the region while we run.
        let s = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, k.len() as usize) };
        assert!(
            s[..4096]
                .iter()
                .enumerate()
                .all(|(i, b)| *b == (i % 251) as u8)
        );
        s[4096..8192].fill(0x5a);
        println!("CHILD-OK");
        return;
    }
    let Some(a) = m.mem_alloc_shared(8192).unwrap() else {
        println!("SKIPPED: posix cannot share memory here");
        return;
    };
    // SAFETY: the allocation is ours, 8192 bytes, alive while `a` lives.
    let s = unsafe { std::slice::from_raw_parts_mut(a.addr as *mut u8, a.len) };
    for (i, b) in s[..4096].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let key = m.mkey_pack(&a.memh).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["peer_maps_a_shared_segment", "--exact", "--nocapture"])
        .env("RUCX_SHM_CHILD_KEY", hex(&key))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let lines: Vec<String> = out.lines().map_while(Result::ok).collect();
    let saw = lines.iter().any(|l| l.contains("CHILD-OK"));
    assert!(
        child.wait().unwrap().success() && saw,
        "child failed: {lines:?}"
    );
    assert!(
        s[4096..].iter().all(|b| *b == 0x5a),
        "the child's writes are visible here"
    );
    std::io::stdout().flush().unwrap();
}
