//! Endpoint lifecycle over real transports: close with flush (everything sent arrives, the
//! peer sees the endpoint closed, its error handler is called once), close with force
//! (outstanding requests canceled, buffers back intact), reconnect after a close; in one
//! process over posix and across real processes over posix and tcp.

mod ranks;

use ranks::{Calls, drive, record_errors, worker_pair};

use std::sync::Arc;
use std::time::{Duration, Instant};

use rucx::{CloseMode, Error, Job, TAG_MASK_FULL};

const SIZES: &[usize] = &[0, 10, 9000, 70_000, (1 << 20) + 5, 8 << 20];

#[test]
fn close_with_flush_delivers_everything_and_the_peer_sees_its_endpoint_closed() {
    let (w0, w1) = worker_pair("posix");
    let ep01 = w0.connect(&w1.address()).unwrap();
    let calls = record_errors(&w1);
    let recvs: Vec<_> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| w1.tag_recv_owned(vec![0u8; n], i as u64, TAG_MASK_FULL))
        .collect();
    let sends: Vec<_> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| w0.tag_send_owned(ep01, ranks::pattern(n, i), i as u64))
        .collect();
    // Closed before anything moved: the close waits for all of it.
    let close = w0.close(ep01, CloseMode::Flush);
    assert!(!close.is_done());
    drive(&[&w0, &w1], || close.is_done());
    for s in &sends {
        assert!(s.is_done(), "every send ended before the close");
        assert!(s.test().unwrap().is_ok());
    }
    close.try_take().unwrap().0.unwrap();
    drive(&[&w1], || recvs.iter().all(|r| r.is_done()));
    for (i, r) in recvs.into_iter().enumerate() {
        let (res, got) = r.try_take().unwrap();
        assert_eq!(res.unwrap().len, SIZES[i]);
        assert!(got == ranks::pattern(SIZES[i], i), "message {i}");
    }
    // The peer's endpoint is closed; its handler was called once, with that.
    drive(&[&w1], || !calls.lock().unwrap().is_empty());
    for _ in 0..1000 {
        w1.progress();
        w0.progress();
    }
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (ep10, msg) = &calls[0];
    assert!(msg.contains("the peer closed it"), "{msg}");
    let (res, _) = w1.tag_send_owned(*ep10, vec![1u8; 4], 0).wait(&w1);
    assert!(matches!(res, Err(Error::EndpointClosed { .. })), "{res:?}");
    // This side refuses the closed endpoint, naming who closed it.
    let (res, _) = w0.tag_send_owned(ep01, vec![1u8; 4], 0).wait(&w0);
    match res {
        Err(e @ Error::EndpointClosed { .. }) => {
            assert!(e.to_string().contains("closed by this worker"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // Closing twice is refused.
    assert!(matches!(
        w0.close(ep01, CloseMode::Flush).wait(&w0).0,
        Err(Error::EndpointClosed { .. })
    ));
}

#[test]
fn close_with_force_cancels_outstanding_requests_and_hands_their_buffers_back() {
    let (w0, w1) = worker_pair("posix");
    let ep01 = w0.connect(&w1.address()).unwrap();
    let calls = record_errors(&w1);
    // Wire the pair up, then announce two large messages w1 never receives.
    let (res, _) = w0.tag_send_owned(ep01, vec![0u8; 8], 99).wait(&w0);
    res.unwrap();
    let got = w1.tag_recv_owned(vec![0u8; 8], 99, TAG_MASK_FULL);
    drive(&[&w0, &w1], || got.is_done());
    let big: Vec<_> = (0..2)
        .map(|i| w0.tag_send_owned(ep01, ranks::pattern(4 << 20, i), 7))
        .collect();
    drive(&[&w0, &w1], || w1.probe(7, TAG_MASK_FULL).is_some());
    let (res, _) = w0.close(ep01, CloseMode::Force).wait(&w0);
    res.unwrap();
    for (i, r) in big.into_iter().enumerate() {
        let (res, b) = r.try_take().expect("ended by the close");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert!(b == ranks::pattern(4 << 20, i), "intact");
    }
    // The peer: handler called once, the announced messages are gone.
    drive(&[&w1], || !calls.lock().unwrap().is_empty());
    assert_eq!(w1.probe(7, TAG_MASK_FULL), None);
    let r = w1.tag_recv_owned(vec![0u8; 16], 7, TAG_MASK_FULL);
    let r = r
        .wait_timeout(&w1, Duration::from_millis(200))
        .expect_err("nothing to receive");
    assert!(r.cancel(&w1));
    assert_eq!(calls.lock().unwrap().len(), 1);
}

#[test]
fn connecting_again_after_a_close_gives_a_working_endpoint_on_both_sides() {
    let (w0, w1) = worker_pair("posix");
    let ep01 = w0.connect(&w1.address()).unwrap();
    let calls = record_errors(&w1);
    let first = w1.tag_recv_owned(vec![0u8; 3], 1, TAG_MASK_FULL);
    w0.tag_send_owned(ep01, vec![1u8; 3], 1)
        .wait(&w0)
        .0
        .unwrap();
    drive(&[&w0, &w1], || first.is_done());
    let old10 = first.try_take().unwrap().0.unwrap().sender.unwrap();
    // A rendezvous not received yet keeps the close going.
    let pending = w0.tag_send_owned(ep01, ranks::pattern(1 << 20, 7), 7);
    let close = w0.close(ep01, CloseMode::Flush);
    // Not while the old endpoint is still closing (its messages still arrive for it).
    assert!(!close.is_done());
    let early = w0.connect(&w1.address());
    assert!(matches!(early, Err(Error::NoResource(_))), "{early:?}");
    let late = w1.tag_recv_owned(vec![0u8; 1 << 20], 7, TAG_MASK_FULL);
    drive(&[&w0, &w1], || {
        close.is_done() && late.is_done() && !calls.lock().unwrap().is_empty()
    });
    pending.try_take().unwrap().0.unwrap();
    assert!(late.try_take().unwrap().1 == ranks::pattern(1 << 20, 7));

    let again = w0.connect(&w1.address()).unwrap();
    assert_ne!(again, ep01);
    let r = w1.tag_recv_owned(vec![0u8; 100_000], 2, TAG_MASK_FULL);
    let s = w0.tag_send_owned(again, ranks::pattern(100_000, 2), 2);
    drive(&[&w0, &w1], || r.is_done() && s.is_done());
    let (res, got) = r.try_take().unwrap();
    let new10 = res.unwrap().sender.unwrap();
    assert!(got == ranks::pattern(100_000, 2));
    assert_ne!(new10, old10, "the peer has a new endpoint too");
    // And back on it.
    let back = w0.tag_recv_owned(vec![0u8; 5], 3, TAG_MASK_FULL);
    let s = w1.tag_send_owned(new10, vec![9u8; 5], 3);
    drive(&[&w0, &w1], || back.is_done() && s.is_done());
    assert_eq!(back.try_take().unwrap().1, vec![9u8; 5]);
    assert_eq!(
        calls.lock().unwrap().len(),
        1,
        "one call, for the closed endpoint"
    );
}

#[test]
fn a_close_in_progress_when_the_worker_is_dropped_ends_canceled() {
    let (w0, w1) = worker_pair("posix");
    let ep01 = w0.connect(&w1.address()).unwrap();
    // A rendezvous nobody receives keeps the flush close waiting.
    let big = w0.tag_send_owned(ep01, ranks::pattern(4 << 20, 1), 3);
    let close = w0.close(ep01, CloseMode::Flush);
    for _ in 0..1000 {
        w0.progress();
        w1.progress();
    }
    assert!(!close.is_done());
    drop(w0);
    let (res, ()) = close.try_take().expect("ended by the drop");
    assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
    let (res, b) = big.try_take().expect("ended by the drop");
    assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
    assert!(b == ranks::pattern(4 << 20, 1));
}

#[test]
fn an_endpoint_handler_takes_precedence_and_is_called_once() {
    let (w0, w1) = worker_pair("posix");
    let ep01 = w0.connect(&w1.address()).unwrap();
    let worker_calls = record_errors(&w1);
    let first = w1.tag_recv_owned(vec![0u8; 1], 1, TAG_MASK_FULL);
    w0.tag_send_owned(ep01, vec![1u8; 1], 1)
        .wait(&w0)
        .0
        .unwrap();
    drive(&[&w0, &w1], || first.is_done());
    let ep10 = first.try_take().unwrap().0.unwrap().sender.unwrap();
    let ep_calls: Calls = Arc::default();
    let c = ep_calls.clone();
    w1.set_ep_error_handler(ep10, move |w, ep, e| {
        // The handler may use the worker.
        assert!(w.ep_error(ep).is_some());
        c.lock().unwrap().push((ep, e.to_string()))
    })
    .unwrap();
    w0.close(ep01, CloseMode::Force).wait(&w0).0.unwrap();
    drive(&[&w1], || !ep_calls.lock().unwrap().is_empty());
    for _ in 0..1000 {
        w1.progress();
    }
    assert_eq!(ep_calls.lock().unwrap().len(), 1);
    assert_eq!(ep_calls.lock().unwrap()[0].0, ep10);
    assert!(worker_calls.lock().unwrap().is_empty());
}

// ----- across processes -----

/// Rank 1 sends rank 0 its address (for the reconnect), then receives every size; rank 0
/// sends every size, closes with flush, reconnects and sends once more on the new endpoint;
/// rank 1's handler is called once for the closed endpoint, and it answers on the new one.
fn close_flush_and_reconnect_job() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let peer = job.ep(1 - job.rank());
    if job.rank() == 1 {
        let calls = record_errors(w);
        w.tag_send_owned(peer, w.address(), 50).wait(w).0.unwrap();
        let recvs: Vec<_> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| w.tag_recv_owned(vec![0u8; n], i as u64, TAG_MASK_FULL))
            .collect();
        for (i, r) in recvs.into_iter().enumerate() {
            let (res, got) = r.wait(w);
            assert_eq!(res.unwrap().len, SIZES[i]);
            assert!(got == ranks::pattern(SIZES[i], i), "message {i}");
        }
        // The close arrives after the data: the endpoint is closed, reported once.
        let t = Instant::now();
        while calls.lock().unwrap().is_empty() {
            w.progress();
            assert!(t.elapsed() < Duration::from_secs(30), "no close seen");
        }
        let (closed, msg) = calls.lock().unwrap()[0].clone();
        assert_eq!(closed, peer);
        assert!(msg.contains("the peer closed it"), "{msg}");
        // The reconnect: a message on a new endpoint, answered on it.
        let (res, got) = w
            .tag_recv_owned(vec![0u8; 1 << 20], 60, TAG_MASK_FULL)
            .wait(w);
        let back = res.unwrap().sender.unwrap();
        assert_ne!(back, peer);
        w.tag_send_owned(back, got, 61).wait(w).0.unwrap();
        assert_eq!(calls.lock().unwrap().len(), 1);
        job.barrier().unwrap();
        println!("rank 1: closed endpoint reported once, reconnect answered");
        return;
    }
    let (res, addr) = w
        .tag_recv_owned(vec![0u8; 64 << 10], 50, TAG_MASK_FULL)
        .wait(w);
    let addr = &addr[..res.unwrap().len];
    let sends: Vec<_> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| w.tag_send_owned(peer, ranks::pattern(n, i), i as u64))
        .collect();
    let t = Instant::now();
    w.close(peer, CloseMode::Flush).wait(w).0.unwrap();
    println!("rank 0: close with flush took {:.2?}", t.elapsed());
    for s in sends {
        s.try_take().expect("ended before the close").0.unwrap();
    }
    let again = w.connect(addr).unwrap();
    assert_ne!(again, peer);
    let back = w.tag_recv_owned(vec![0u8; 1 << 20], 61, TAG_MASK_FULL);
    w.tag_send_owned(again, ranks::pattern(1 << 20, 60), 60)
        .wait(w)
        .0
        .unwrap();
    let (res, got) = back.wait(w);
    res.unwrap();
    assert!(got == ranks::pattern(1 << 20, 60));
    job.barrier().unwrap();
    println!("rank 0: reconnected");
}

#[test]
fn close_with_flush_and_reconnect_across_processes_over_posix() {
    if ranks::in_child() {
        return close_flush_and_reconnect_job();
    }
    let out = ranks::run_both(
        "close_with_flush_and_reconnect_across_processes_over_posix",
        "posix",
        &[],
    );
    assert!(out[0].contains("rank 0: reconnected"), "{}", out[0]);
    println!("{}", out[0]);
}

#[test]
fn close_with_flush_and_reconnect_across_processes_over_tcp() {
    if ranks::in_child() {
        return close_flush_and_reconnect_job();
    }
    let out = ranks::run_both(
        "close_with_flush_and_reconnect_across_processes_over_tcp",
        "tcp",
        &[],
    );
    assert!(out[0].contains("rank 0: reconnected"), "{}", out[0]);
    println!("{}", out[0]);
}

/// Rank 0 announces large messages rank 1 never receives and closes with force: they end
/// canceled with their buffers intact; rank 1's handler is called once and the announcements
/// are gone.
fn close_force_job() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let peer = job.ep(1 - job.rank());
    if job.rank() == 1 {
        let calls = record_errors(w);
        let t = Instant::now();
        while calls.lock().unwrap().is_empty() {
            w.progress();
            assert!(t.elapsed() < Duration::from_secs(30), "no close seen");
        }
        for _ in 0..10_000 {
            w.progress();
        }
        assert_eq!(calls.lock().unwrap().len(), 1);
        assert_eq!(w.probe(7, TAG_MASK_FULL), None, "announcements dropped");
        job.barrier().unwrap();
        println!("rank 1: forced close reported once");
        return;
    }
    let big: Vec<_> = (0..3)
        .map(|i| w.tag_send_owned(peer, ranks::pattern(8 << 20, i), 7))
        .collect();
    // Let the announcements reach rank 1.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(300) {
        w.progress();
    }
    w.close(peer, CloseMode::Force).wait(w).0.unwrap();
    for (i, r) in big.into_iter().enumerate() {
        let (res, b) = r.try_take().expect("ended by the close");
        assert!(matches!(res, Err(Error::Canceled)), "{res:?}");
        assert!(b == ranks::pattern(8 << 20, i), "intact");
    }
    job.barrier().unwrap();
    println!("rank 0: forced close canceled its sends");
}

#[test]
fn close_with_force_across_processes_over_posix() {
    if ranks::in_child() {
        return close_force_job();
    }
    let out = ranks::run_both("close_with_force_across_processes_over_posix", "posix", &[]);
    assert!(out[1].contains("reported once"), "{}", out[1]);
}

#[test]
fn close_with_force_across_processes_over_tcp() {
    if ranks::in_child() {
        return close_force_job();
    }
    let out = ranks::run_both("close_with_force_across_processes_over_tcp", "tcp", &[]);
    assert!(out[1].contains("reported once"), "{}", out[1]);
}

// ----- a peer killed while nothing is in flight -----

/// Rank 1 tells rank 0 its pid and idles; rank 0 idles too (progress and naps, nothing in
/// flight), kills rank 1 with SIGKILL, and measures how long until its error handler is called
/// (exactly once); requests to the dead peer then fail.
fn killed_idle_peer_job() {
    let job = Job::from_env().unwrap();
    let w = job.worker();
    let peer = job.ep(1 - job.rank());
    if job.rank() == 1 {
        let pid = std::process::id().to_le_bytes().to_vec();
        w.tag_send_owned(peer, pid, 1).wait(w).0.unwrap();
        println!("rank 1: idle");
        loop {
            w.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let calls = record_errors(w);
    let (res, pid) = w.tag_recv_owned(vec![0u8; 4], 1, TAG_MASK_FULL).wait(w);
    res.unwrap();
    let pid = u32::from_le_bytes(pid.try_into().unwrap());
    // Idle a while: nothing in flight, nothing detected. The survivor either polls with naps,
    // or (`RUCX_TEST_SURVIVOR=asleep`) sleeps in `Worker::wait`, as a service does: then only
    // the worker's own timers or its descriptor wake it.
    let asleep = std::env::var("RUCX_TEST_SURVIVOR").as_deref() == Ok("asleep");
    let wakes = std::cell::Cell::new(0u32);
    let idle = |until: &dyn Fn() -> bool, limit: Duration| {
        let t = Instant::now();
        while !until() && t.elapsed() < limit {
            w.progress();
            if asleep {
                wakes.set(wakes.get() + 1);
                w.wait(Some(limit.saturating_sub(t.elapsed()))).unwrap();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    idle(&|| false, Duration::from_millis(1500));
    let (detected, call) =
        ranks::kill_and_detect(pid, peer, &calls, idle, Duration::from_millis(1000));
    println!(
        "rank 0: KILLED IDLE PEER detected after {detected:.2?}{}: {}",
        if asleep {
            format!(" (asleep in wait, woken {} times)", wakes.get())
        } else {
            String::new()
        },
        call.1
    );
    assert!(detected < Duration::from_secs(10), "{detected:?}");
    let (res, _) = w.tag_send_owned(peer, vec![0u8; 100_000], 2).wait(w);
    assert!(matches!(res, Err(Error::EndpointFailure { .. })), "{res:?}");
}

fn run_killed_idle_peer(test: &str, tls: &str, env: &[(&str, &str)]) -> String {
    let mut kids = ranks::spawn(test, tls, env);
    let rank1 = kids.pop().unwrap();
    let (ok, text) = ranks::finish(kids.pop().unwrap(), Duration::from_secs(60));
    // Reaped only now (a zombie while rank 0 watched it).
    let (_, text1) = ranks::finish(rank1, Duration::from_secs(5));
    assert!(ok, "rank 0 failed:\n{text}\nrank 1:\n{text1}");
    assert!(text1.contains("rank 1: idle"), "{text1}");
    println!(
        "{tls}: {}",
        text.lines().find(|l| l.contains("KILLED")).unwrap()
    );
    text
}

#[test]
fn killed_idle_peer_is_reported_once_over_posix() {
    if ranks::in_child() {
        return killed_idle_peer_job();
    }
    let text = run_killed_idle_peer("killed_idle_peer_is_reported_once_over_posix", "posix", &[]);
    assert!(text.contains("exited"), "found by its process:\n{text}");
}

#[test]
fn killed_idle_peer_is_reported_once_over_tcp_by_the_connection() {
    if ranks::in_child() {
        return killed_idle_peer_job();
    }
    // The process check off: the broken connection tells.
    run_killed_idle_peer(
        "killed_idle_peer_is_reported_once_over_tcp_by_the_connection",
        "tcp",
        &[("RUCX_PROC_CHECK_INTERVAL", "inf")],
    );
}

#[test]
fn killed_idle_peer_is_reported_once_over_tcp_on_one_host() {
    if ranks::in_child() {
        return killed_idle_peer_job();
    }
    run_killed_idle_peer(
        "killed_idle_peer_is_reported_once_over_tcp_on_one_host",
        "tcp",
        &[],
    );
}

#[test]
fn killed_idle_peer_wakes_a_survivor_asleep_in_wait_over_posix() {
    if ranks::in_child() {
        return killed_idle_peer_job();
    }
    let text = run_killed_idle_peer(
        "killed_idle_peer_wakes_a_survivor_asleep_in_wait_over_posix",
        "posix",
        &[("RUCX_TEST_SURVIVOR", "asleep")],
    );
    assert!(text.contains("exited"), "found by its process:\n{text}");
    assert!(text.contains("asleep in wait"), "{text}");
}

#[test]
fn killed_idle_peer_wakes_a_survivor_asleep_in_wait_over_tcp() {
    if ranks::in_child() {
        return killed_idle_peer_job();
    }
    // The process check off: the broken connection wakes the survivor.
    let text = run_killed_idle_peer(
        "killed_idle_peer_wakes_a_survivor_asleep_in_wait_over_tcp",
        "tcp",
        &[
            ("RUCX_TEST_SURVIVOR", "asleep"),
            ("RUCX_PROC_CHECK_INTERVAL", "inf"),
        ],
    );
    assert!(text.contains("asleep in wait"), "{text}");
}

#[test]
fn killed_idle_peer_wakes_a_survivor_asleep_in_wait_over_tcp_on_one_host() {
    if ranks::in_child() {
        return killed_idle_peer_job();
    }
    let text = run_killed_idle_peer(
        "killed_idle_peer_wakes_a_survivor_asleep_in_wait_over_tcp_on_one_host",
        "tcp",
        &[("RUCX_TEST_SURVIVOR", "asleep")],
    );
    assert!(text.contains("asleep in wait"), "{text}");
}
