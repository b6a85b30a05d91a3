//! Jobs of real processes over real transports: every protocol threshold crossed, every byte
//! checked; injected registration failures on one side; a peer that dies mid-transfer; two
//! network namespaces.
//!
//! Each test spawns its ranks as children of this test binary (told apart by `RANK_ROLE`),
//! which meet through the launcher bootstrap like any rucx job.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rucx::{Error, Job, TAG_MASK_FULL};

const ROLE: &str = "RUCX_TEST_RANK_ROLE";
const SIZES: &[usize] = &[0, 1, 8191, 8192, 8193, 65536, (1 << 20) + 3, 16 << 20];

fn pattern(rank: usize, n: usize, salt: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(131) ^ (rank * 17) ^ salt) as u8)
        .collect()
}

/// A port for the rendezvous, outside the ephemeral range (a port-0 listener's port could be
/// handed to another test's connection before rank 0 binds it).
fn free_port() -> u16 {
    rucx::bootstrap::local_port().unwrap()
}

/// Spawn `size` ranks of `test` with per-rank extra environment and launcher prefix; wait for
/// all and return their exit statuses and output.
fn run_ranks(
    test: &str,
    size: usize,
    boot: &str,
    env: &[(&str, &str)],
    per_rank: &dyn Fn(usize) -> (Vec<String>, Vec<(String, String)>),
    limit: Duration,
) -> Vec<(bool, String)> {
    let exe = std::env::current_exe().unwrap();
    let mut kids: Vec<Child> = Vec::new();
    for rank in 0..size {
        let (prefix, extra) = per_rank(rank);
        let mut c = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        c.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, "1")
            .env("RUCX_RANK", rank.to_string())
            .env("RUCX_SIZE", size.to_string())
            .env("RUCX_BOOTSTRAP", boot)
            .env("RUCX_BOOTSTRAP_TIMEOUT", "30s")
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .envs(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        kids.push(c.spawn().unwrap());
    }
    let start = Instant::now();
    let mut out = Vec::new();
    for mut k in kids {
        loop {
            match k.try_wait().unwrap() {
                Some(_) => break,
                None if start.elapsed() > limit => {
                    let _ = k.kill();
                    break;
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let o = k.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        out.push((o.status.success(), text));
    }
    out
}

fn assert_all_ok(results: &[(bool, String)]) {
    for (rank, (ok, text)) in results.iter().enumerate() {
        assert!(ok, "rank {rank} failed:\n{text}");
    }
}

fn in_child() -> bool {
    std::env::var(ROLE).is_ok()
}

/// Every rank sends every size to the next rank and receives from the previous one.
fn ring_all_sizes(job: &Job) {
    let (rank, size) = (job.rank(), job.size());
    let w = job.worker();
    let next = job.ep((rank + 1) % size);
    let prev = (rank + size - 1) % size;
    for (k, &n) in SIZES.iter().enumerate() {
        let send = pattern(rank, n, k);
        let mut recv = vec![0u8; n];
        let c = w
            .scope(|s| {
                let r = s.tag_recv(&mut recv, k as u64, TAG_MASK_FULL);
                s.tag_send(next, &send, k as u64).wait()?;
                r.wait()
            })
            .unwrap_or_else(|e| panic!("rank {rank}: size {n}: {e}"));
        assert_eq!(c.len, n);
        assert_eq!(
            c.sender.and_then(|ep| job.rank_of(ep)),
            Some(prev),
            "rank {rank}: size {n}: the sender's rank"
        );
        assert!(
            recv == pattern(prev, n, k),
            "rank {rank}: size {n}: data differs"
        );
    }
    println!("rank {rank}: counters {:?}", w.counters());
}

/// [`ring_all_sizes`] with send and receive buffers from `Context::mem_alloc` (shared memory:
/// over posix every rendezvous byte moves by a plain copy through a mapping of the peer's
/// segment, in both halves of a split).
fn ring_all_sizes_shared(job: &Job) {
    let (rank, size) = (job.rank(), job.size());
    let w = job.worker();
    let next = job.ep((rank + 1) % size);
    let prev = (rank + size - 1) % size;
    for (k, &n) in SIZES.iter().enumerate() {
        let mut send = job.context().mem_alloc(n).unwrap();
        send.copy_from_slice(&pattern(rank, n, k));
        let mut recv = job.context().mem_alloc(n).unwrap();
        if n > 0 {
            assert_eq!(send.shared_by(), Some("posix"), "rank {rank}: size {n}");
        }
        // Twice into the same buffers (the second finds them registered).
        for round in 0..2 {
            recv.fill(0xee);
            let c = w
                .scope(|s| {
                    let r = s.tag_recv(&mut recv[..], k as u64, TAG_MASK_FULL);
                    s.tag_send(next, &send[..], k as u64).wait()?;
                    r.wait()
                })
                .unwrap_or_else(|e| panic!("rank {rank}: size {n}, round {round}: {e}"));
            assert_eq!(c.len, n);
            assert!(
                recv[..] == pattern(prev, n, k)[..],
                "rank {rank}: size {n}, round {round}: data differs"
            );
        }
    }
    println!("rank {rank}: counters {:?}", w.counters());
}

fn ring_test(test: &str, env: &[(&str, &str)]) -> Vec<(bool, String)> {
    let boot = format!("127.0.0.1:{}", free_port());
    let r = run_ranks(
        test,
        2,
        &boot,
        env,
        &|_| (vec![], vec![]),
        Duration::from_secs(120),
    );
    assert_all_ok(&r);
    r
}

#[test]
fn posix_two_processes_every_size() {
    if in_child() {
        return ring_all_sizes(&Job::from_env().unwrap());
    }
    let r = ring_test("posix_two_processes_every_size", &[("RUCX_TLS", "posix")]);
    // Nothing is a whole read on shared memory by default (below the split threshold eager
    // beats a read); 1 MiB + 3 and 16 MiB are split (head read, tail written).
    assert!(!r[0].1.contains("rendezvous receive by read"), "{}", r[0].1);
    assert!(
        r[0].1.contains("read head, remote writes tail"),
        "{}",
        r[0].1
    );
    // With a lower rendezvous threshold and a higher split one, 64 KiB is a whole read by the
    // receiver.
    let r = ring_test(
        "posix_two_processes_every_size",
        &[
            ("RUCX_TLS", "posix"),
            ("RUCX_RNDV_THRESH", "32K"),
            ("RUCX_RNDV_SPLIT_THRESH", "256K"),
        ],
    );
    assert!(r[0].1.contains("rendezvous receive by read"), "{}", r[0].1);
}

#[test]
fn posix_two_processes_shared_allocations_every_size() {
    if in_child() {
        return ring_all_sizes_shared(&Job::from_env().unwrap());
    }
    let test = "posix_two_processes_shared_allocations_every_size";
    let r = ring_test(test, &[("RUCX_TLS", "posix")]);
    assert!(
        r[0].1.contains("read head, remote writes tail"),
        "{}",
        r[0].1
    );
    for (k, v) in [
        ("RUCX_RNDV_SCHEME", "put_zcopy"),
        ("RUCX_RNDV_SPLIT_THRESH", "256K"),
    ] {
        ring_test(
            test,
            &[("RUCX_TLS", "posix"), ("RUCX_RNDV_THRESH", "32K"), (k, v)],
        );
    }
}

#[test]
fn posix_two_processes_each_rendezvous_scheme() {
    if in_child() {
        return ring_all_sizes(&Job::from_env().unwrap());
    }
    for (scheme, seen) in [
        ("put_zcopy", "rendezvous receive by remote write"),
        ("am", "rendezvous receive streamed"),
    ] {
        let r = ring_test(
            "posix_two_processes_each_rendezvous_scheme",
            &[("RUCX_TLS", "posix"), ("RUCX_RNDV_SCHEME", scheme)],
        );
        assert!(r[1].1.contains(seen), "{scheme}: {}", r[1].1);
    }
}

#[test]
fn tcp_two_processes_every_size() {
    if in_child() {
        return ring_all_sizes(&Job::from_env().unwrap());
    }
    ring_test(
        "tcp_two_processes_every_size",
        &[("RUCX_TLS", "tcp"), ("RUCX_TCP_IFACES", "lo")],
    );
}

/// Established tcp connections of this process whose other end is this process too (both of
/// its sockets counted): the loopback connections of an endpoint to itself. Read from
/// `/proc/self/net/tcp`, limited to this process's own socket inodes.
fn sockets_connected_to_self() -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let t = std::fs::read_link(e.path()).ok()?;
            let t = t.to_string_lossy();
            Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    // Columns: sl local_address rem_address st ... inode (the tenth).
    let ours: Vec<(String, String)> = std::fs::read_to_string("/proc/self/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c.len() > 9 && c[3] == "01" && inodes.contains(c[9]))
                .then(|| (c[1].to_string(), c[2].to_string()))
        })
        .collect();
    ours.iter()
        .filter(|(_, remote)| ours.iter().any(|(local, _)| local == remote))
        .count()
}

/// The endpoint of a rank to itself is made when first asked for: over tcp alone (no self
/// transport, so it is a loopback connection) a job that never sends to itself has no such
/// connection, whose sockets every progress call would look at (and which turned off the
/// tcp interface's one-connection read without a readiness check). Asked for, it appears (a
/// loopback connection, both ends in this process), carries messages to this rank and back, is the
/// same endpoint at every call, and `rank_of` names it.
#[test]
fn tcp_endpoint_to_self_made_when_first_asked_for() {
    if in_child() {
        let job = Job::from_env().unwrap();
        let (rank, w) = (job.rank(), job.worker());
        let peer = job.ep(1 - rank);
        // Traffic with the peer first: its connection is up, nothing to this rank itself.
        let (mut b, hi) = ([0u8; 8], [rank as u8; 8]);
        w.scope(|s| {
            let r = s.tag_recv(&mut b, 1, TAG_MASK_FULL);
            s.tag_send(peer, &hi, 1).wait()?;
            r.wait()
        })
        .unwrap();
        let before = sockets_connected_to_self();
        assert_eq!(
            before, 0,
            "rank {rank}: a connection to itself before it was asked for"
        );
        let me = job.ep(rank);
        assert_eq!(job.ep(rank), me, "rank {rank}: one endpoint to itself");
        assert_eq!(job.try_ep(rank).unwrap(), me);
        assert_eq!(job.rank_of(me), Some(rank));
        assert_eq!(job.rank_of(peer), Some(1 - rank));
        assert!(matches!(job.try_ep(2), Err(Error::InvalidParam(_))));
        let msg = pattern(rank, 5000, 3);
        let mut got = vec![0u8; msg.len()];
        let c = w
            .scope(|s| {
                let r = s.tag_recv(&mut got, 2, TAG_MASK_FULL);
                s.tag_send(me, &msg, 2).wait()?;
                r.wait()
            })
            .unwrap();
        assert_eq!(
            (c.len, c.sender.and_then(|e| job.rank_of(e))),
            (5000, Some(rank))
        );
        assert!(got == msg, "rank {rank}: data to itself differs");
        // Both ends of the loopback connection.
        assert_eq!(sockets_connected_to_self(), 2, "rank {rank}");
        return;
    }
    ring_test(
        "tcp_endpoint_to_self_made_when_first_asked_for",
        &[("RUCX_TLS", "tcp"), ("RUCX_TCP_IFACES", "lo")],
    );
}

#[test]
fn receiver_registration_failures_are_survived() {
    if in_child() {
        let job = Job::from_env().unwrap();
        ring_all_sizes(&job);
        for d in job.context().demotions() {
            println!("rank {}: DEMOTED {} {}", job.rank(), d.md, d.mem_type);
        }
        return;
    }
    let boot = format!("127.0.0.1:{}", free_port());
    // Only rank 1 fails registrations (after the first two): it must steer rank 0 to stream.
    let r = run_ranks(
        "receiver_registration_failures_are_survived",
        2,
        &boot,
        &[("RUCX_TLS", "posix"), ("RUCX_RNDV_THRESH", "16K")],
        &|rank| {
            let env = if rank == 1 {
                vec![(
                    "RUCX_FAULT_INJECT".to_string(),
                    "md=posix,mem=host,after=2".to_string(),
                )]
            } else {
                vec![]
            };
            (vec![], env)
        },
        Duration::from_secs(120),
    );
    assert_all_ok(&r);
    assert!(r[1].1.contains("DEMOTED posix host"), "{}", r[1].1);
    assert!(!r[0].1.contains("DEMOTED"), "{}", r[0].1);
    let warnings = r[1].1.matches("cannot register host memory").count();
    assert_eq!(warnings, 1, "exactly one warning expected:\n{}", r[1].1);
    assert!(r[1].1.contains("RUCX_REG_SKIP=posix:host"), "{}", r[1].1);
}

#[test]
fn buffer_refusals_do_not_demote_and_later_transfers_stay_zero_copy() {
    if in_child() {
        let job = Job::from_env().unwrap();
        ring_all_sizes(&job);
        ring_all_sizes(&job);
        for d in job.context().demotions() {
            println!("rank {}: DEMOTED {} {}", job.rank(), d.md, d.mem_type);
        }
        for r in job.context().refusals() {
            println!(
                "rank {}: REFUSED {} {} x{}",
                job.rank(),
                r.md,
                r.mem_type,
                r.count
            );
        }
        return;
    }
    let boot = format!("127.0.0.1:{}", free_port());
    // Rank 1's posix domain refuses one buffer as "cannot be exported" (a property of that
    // buffer, like a stream-ordered pool allocation for cuda_ipc): no demotion, one warning,
    // and the later rendezvous still move zero-copy.
    let r = run_ranks(
        "buffer_refusals_do_not_demote_and_later_transfers_stay_zero_copy",
        2,
        &boot,
        &[
            ("RUCX_TLS", "posix"),
            ("RUCX_RNDV_THRESH", "16K"),
            // 64 KiB a whole read, larger ones split (whatever the default threshold).
            ("RUCX_RNDV_SPLIT_THRESH", "256K"),
        ],
        &|rank| {
            let env = if rank == 1 {
                vec![(
                    "RUCX_FAULT_INJECT".to_string(),
                    "md=posix,mem=host,after=2,times=1,kind=not_exportable".to_string(),
                )]
            } else {
                vec![]
            };
            (vec![], env)
        },
        Duration::from_secs(120),
    );
    assert_all_ok(&r);
    for (rank, (_, out)) in r.iter().enumerate() {
        assert!(!out.contains("DEMOTED"), "rank {rank}:\n{out}");
        assert!(!out.contains("cannot register"), "rank {rank}:\n{out}");
    }
    assert!(r[1].1.contains("REFUSED posix host x1"), "{}", r[1].1);
    assert_eq!(
        r[1].1.matches("memory domain posix refused").count(),
        1,
        "exactly one warning:\n{}",
        r[1].1
    );
    // The second ring (after the refusal) received every rendezvous zero-copy: 64 KiB by a
    // read, 1 MiB + 3 and 16 MiB split (read head, written tail).
    let count = |line: &str, key: &str| -> u64 {
        line.split(&format!("\"{key}\": "))
            .nth(1)
            .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let lines: Vec<&str> = r[1].1.lines().filter(|l| l.contains("counters")).collect();
    assert_eq!(lines.len(), 2, "{}", r[1].1);
    for (key, per_ring) in [
        ("rendezvous receive by read", 1),
        ("rendezvous receive split: read head, remote writes tail", 2),
    ] {
        assert_eq!(
            count(lines[1], key) - count(lines[0], key),
            per_ring,
            "{key}:\n{}\n{}",
            lines[0],
            lines[1]
        );
    }
}

#[test]
fn peer_dying_mid_transfer_fails_pending_requests_and_others_go_on() {
    if in_child() {
        let job = Job::from_env().unwrap();
        let w = job.worker();
        match job.rank() {
            0 => {
                let big = pattern(0, 8 << 20, 1);
                let mut from2 = vec![0u8; 8 << 20];
                let t = Instant::now();
                let (s, r) = w.scope(|s| {
                    // Rank 2 dies without receiving this, maybe while we read its message.
                    let r = s.tag_recv(&mut from2, 99, TAG_MASK_FULL);
                    let sd = s.tag_send(job.ep(2), &big, 42);
                    (sd.wait(), r.wait_timeout(Duration::from_secs(20)))
                });
                let el = t.elapsed();
                println!(
                    "rank 0: send {s:?} recv {:?} after {el:?}",
                    r.as_ref().map(|c| c.len)
                );
                assert!(matches!(s, Err(Error::EndpointFailure { .. })), "{s:?}");
                match r {
                    Ok(c) => assert!(c.len == 8 << 20 && from2 == pattern(2, 8 << 20, 3)),
                    Err(Error::EndpointFailure { .. }) => {}
                    Err(e) => panic!("receive from the dying peer: {e}"),
                }
                assert!(el < Duration::from_secs(15), "took {el:?}");
                // Rank 1 still works.
                let msg = pattern(0, 100_000, 2);
                let mut back = vec![0u8; 100_000];
                w.scope(|s| {
                    let r = s.tag_recv(&mut back, 7, TAG_MASK_FULL);
                    s.tag_send(job.ep(1), &msg, 7).wait().unwrap();
                    r.wait().unwrap();
                });
                assert!(back == pattern(1, 100_000, 2));
                println!("rank 0: survived");
                std::mem::forget(job);
            }
            1 => {
                let msg = pattern(1, 100_000, 2);
                let mut got = vec![0u8; 100_000];
                w.scope(|s| {
                    let r = s.tag_recv(&mut got, 7, TAG_MASK_FULL);
                    s.tag_send(job.ep(0), &msg, 7).wait().unwrap();
                    r.wait().unwrap();
                });
                assert!(got == pattern(0, 100_000, 2));
                std::mem::forget(job);
            }
            _ => {
                // Offer a large message to rank 0, wait for its rendezvous request to arrive,
                // then die without answering either.
                let msg = pattern(2, 8 << 20, 3);
                w.scope(|s| {
                    let _pending = s.tag_send(job.ep(0), &msg, 99);
                    let t = Instant::now();
                    while w.probe(42, TAG_MASK_FULL).is_none()
                        && t.elapsed() < Duration::from_secs(20)
                    {
                        w.progress();
                    }
                    std::process::exit(0);
                })
            }
        }
        return;
    }
    let boot = format!("127.0.0.1:{}", free_port());
    let r = run_ranks(
        "peer_dying_mid_transfer_fails_pending_requests_and_others_go_on",
        3,
        &boot,
        &[("RUCX_TLS", "posix")],
        &|_| (vec![], vec![]),
        Duration::from_secs(90),
    );
    assert_all_ok(&r);
    assert!(r[0].1.contains("rank 0: survived"), "{}", r[0].1);
    println!("{}", r[0].1);
}

struct Netns {
    names: [String; 2],
    /// The veth end inside each namespace.
    devs: [String; 2],
}

impl Netns {
    fn create(tag: &str) -> Result<Netns, String> {
        // The pid keeps two test runs (two checkouts at once) out of each other's namespaces.
        let pid = std::process::id();
        let a = format!("rucx-{tag}-{pid}-a");
        let b = format!("rucx-{tag}-{pid}-b");
        let sh = |args: &[&str]| -> Result<(), String> {
            let o = Command::new("ip")
                .args(args)
                .output()
                .map_err(|e| format!("ip: {e}"))?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&o.stderr)
                ))
            }
        };
        let _ = Command::new("ip").args(["netns", "del", &a]).output();
        let _ = Command::new("ip").args(["netns", "del", &b]).output();
        // Interface names have at most 15 bytes.
        let va = format!("rx{}a{}", &tag[..1], pid % 100_000);
        let vb = format!("rx{}b{}", &tag[..1], pid % 100_000);
        let ns = Netns {
            names: [a.clone(), b.clone()],
            devs: [va.clone(), vb.clone()],
        };
        sh(&["netns", "add", &a])?;
        sh(&["netns", "add", &b])?;
        sh(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        sh(&["link", "set", &va, "netns", &a])?;
        sh(&["link", "set", &vb, "netns", &b])?;
        sh(&["-n", &a, "addr", "add", "10.213.77.1/24", "dev", &va])?;
        sh(&["-n", &b, "addr", "add", "10.213.77.2/24", "dev", &vb])?;
        for (n, v) in [(&a, &va), (&b, &vb)] {
            sh(&["-n", n, "link", "set", v, "up"])?;
            sh(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

#[test]
fn tcp_across_two_network_namespaces() {
    if in_child() {
        return ring_all_sizes(&Job::from_env().unwrap());
    }
    let ns = match Netns::create("ucp") {
        Ok(ns) => ns,
        Err(e) => {
            println!("SKIPPED: cannot create network namespaces here: {e}");
            return;
        }
    };
    let names = ns.names.clone();
    let devs = ns.devs.clone();
    let r = run_ranks(
        "tcp_across_two_network_namespaces",
        2,
        "10.213.77.1:29577",
        &[("RUCX_TLS", "tcp")],
        &|rank| {
            (
                vec![
                    "ip".into(),
                    "netns".into(),
                    "exec".into(),
                    names[rank].clone(),
                ],
                vec![("RUCX_TCP_IFACES".into(), devs[rank].clone())],
            )
        },
        Duration::from_secs(120),
    );
    drop(ns);
    assert_all_ok(&r);
}

#[test]
fn aperture_budget_exhausted_on_both_ranks_is_survived_and_queryable() {
    if in_child() {
        let job = Job::from_env().unwrap();
        ring_all_sizes(&job);
        for d in job.context().demotions() {
            println!("rank {}: DEMOTED {} {}", job.rank(), d.md, d.mem_type);
        }
        let next = job.ep((job.rank() + 1) % job.size());
        for p in job.worker().path_query(next, None).unwrap() {
            println!("rank {}: PATH {p}", job.rank());
        }
        return;
    }
    let boot = format!("127.0.0.1:{}", free_port());
    // A 2 MiB "BAR1": the 16 MiB rendezvous cannot be registered on either side.
    let r = run_ranks(
        "aperture_budget_exhausted_on_both_ranks_is_survived_and_queryable",
        2,
        &boot,
        &[
            ("RUCX_TLS", "posix"),
            ("RUCX_RNDV_THRESH", "16K"),
            ("RUCX_FAULT_INJECT", "md=posix,mem=host,budget=2M"),
        ],
        &|_| (vec![], vec![]),
        Duration::from_secs(120),
    );
    assert_all_ok(&r);
    for (rank, (_, out)) in r.iter().enumerate() {
        assert!(out.contains("DEMOTED posix host"), "rank {rank}:\n{out}");
        assert_eq!(
            out.matches("memory domain posix cannot register host memory")
                .count(),
            1,
            "rank {rank}: exactly one warning:\n{out}"
        );
        let host_path = out
            .lines()
            .find(|l| l.contains("PATH host -> host"))
            .unwrap_or_else(|| panic!("rank {rank}: no host path line:\n{out}"));
        assert!(
            !host_path.contains("(zero-copy)") && host_path.contains("demotions"),
            "{host_path}"
        );
    }
}

/// A barrier with its own limit: rank 1 works alone for 3 s before it arrives; rank 0's
/// barrier with a 500 ms limit times out (naming the limit), a second one without a limit
/// meets rank 1, and the job goes on.
#[test]
fn barrier_with_a_limit_of_its_own() {
    if in_child() {
        let job = Job::from_env().unwrap();
        if job.rank() == 1 {
            std::thread::sleep(Duration::from_secs(3));
        } else {
            let t = std::time::Instant::now();
            match job.barrier_timeout(Duration::from_millis(500)) {
                Err(rucx::Error::Timeout { after, .. }) => {
                    assert_eq!(after, Duration::from_millis(500));
                    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
                }
                other => panic!("rank 0: barrier with a 500 ms limit: {other:?}"),
            }
        }
        job.barrier_timeout(Duration::MAX).unwrap();
        println!("rank {}: met after the long work", job.rank());
        return;
    }
    let boot = format!("127.0.0.1:{}", free_port());
    let r = run_ranks(
        "barrier_with_a_limit_of_its_own",
        2,
        &boot,
        &[("RUCX_TLS", "posix")],
        &|_| (vec![], vec![]),
        Duration::from_secs(60),
    );
    assert_all_ok(&r);
    assert!(
        r[0].1.contains("rank 0: met after the long work"),
        "{}",
        r[0].1
    );
}
