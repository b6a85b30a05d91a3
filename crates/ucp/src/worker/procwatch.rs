//! Liveness of same-host peers by their process: a peer whose process exited (killed, crashed)
//! is found within `RUCX_PROC_CHECK_INTERVAL` (500 ms by default) even when nothing is in
//! flight, where the transports and the keepalive of `RUCX_PEER_TIMEOUT` notice only traffic.
//!
//! A worker's address carries its process's [`ProcStamp`] (boot id, pid namespace, start
//! time). A peer with the same boot and pid namespace is looked up in `/proc/<pid>/stat` from
//! progress, at most once per interval (a counter per progress call, the clock every
//! [`CHECK_POLLS`] calls, and from waits that ease off): gone, a zombie, or a process with
//! another start time (the pid was reused) means the peer process ended, and its endpoint
//! fails with the error handler called. Peers on other hosts or in other pid namespaces are
//! not checked (their transports report a broken connection).

use rucx_ucs::Config;

use crate::address::ProcStamp;
use crate::worker::prelude::*;

/// Progress calls between two looks at the clock.
const CHECK_POLLS: u32 = 64;

/// What a process's `/proc/<pid>/stat` says of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ProcState {
    /// Running (or sleeping, stopped: anything but ended) with this start time.
    Alive { start: u64 },
    /// Ended but not reaped by its parent yet (`Z`, `X`).
    Zombie,
    /// No such process.
    Gone,
}

/// Parse the contents of `/proc/<pid>/stat`: the state (field 3) and start time (field 22).
/// The command name (field 2) is in parentheses and may hold spaces and parentheses: the
/// fields are counted from the last `)`.
pub(super) fn parse_stat(stat: &str) -> Option<ProcState> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace();
    let state = f.next()?;
    // Fields 4 to 21 (18 of them), then the start time.
    let start: u64 = f.nth(18)?.parse().ok()?;
    Some(match state {
        "Z" | "X" | "x" => ProcState::Zombie,
        _ => ProcState::Alive { start },
    })
}

/// Look process `pid` up.
pub(super) fn proc_state(pid: u32) -> ProcState {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => parse_stat(&s).unwrap_or(ProcState::Gone),
        Err(_) => ProcState::Gone,
    }
}

/// This process's stamp (zeros for what cannot be read).
pub(super) fn own_stamp() -> ProcStamp {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| fnv1a(s.trim().as_bytes()))
        .unwrap_or(0);
    let pidns = std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0);
    let start = match std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| parse_stat(&s))
    {
        Some(ProcState::Alive { start }) => start,
        _ => 0,
    };
    ProcStamp { boot, pidns, start }
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Why the process behind a stamp is no longer the peer, if it is not.
pub(super) fn ended(pid: u32, stamp: &ProcStamp, now: ProcState) -> Option<String> {
    match now {
        ProcState::Alive { start } if start == stamp.start => None,
        ProcState::Alive { .. } => Some(format!(
            "its process {pid} ended (the pid now belongs to another process)"
        )),
        ProcState::Zombie => Some(format!(
            "its process {pid} ended (exited or killed; not reaped yet)"
        )),
        ProcState::Gone => Some(format!("its process {pid} ended (exited or killed)")),
    }
}

/// The worker's schedule of process checks.
pub(crate) struct ProcWatch {
    /// `None` when the checks are off.
    every: Option<Duration>,
    next: Option<Instant>,
    polls: u32,
}

impl ProcWatch {
    pub(super) fn from_config(cfg: &Config) -> ProcWatch {
        ProcWatch::new(cfg.time("PROC_CHECK_INTERVAL"))
    }

    fn new(every: Duration) -> ProcWatch {
        ProcWatch {
            every: (every != Duration::MAX && !every.is_zero()).then_some(every),
            next: None,
            polls: 0,
        }
    }

    /// The interval of the checks (`None`: off).
    pub(super) fn interval(&self) -> Option<Duration> {
        self.every
    }

    /// A progress call: true every [`CHECK_POLLS`] calls (time to read the clock).
    #[inline]
    pub(super) fn tick(&mut self) -> bool {
        if self.every.is_none() {
            return false;
        }
        self.polls += 1;
        if self.polls < CHECK_POLLS {
            return false;
        }
        self.polls = 0;
        true
    }
}

impl State {
    /// Look up the processes of same-host peers if the interval passed; fail the endpoints of
    /// those that ended.
    pub(super) fn check_procs(&mut self, now: Instant) {
        let Some(every) = self.procs.every else {
            return;
        };
        if self.procs.next.is_some_and(|t| now < t) {
            return;
        }
        self.procs.next = Some(now + every);
        let me = self.address.proc;
        for p in 0..self.peers.len() {
            let peer = &self.peers[p];
            if peer.failed.is_some() || !me.same_pid_space(&peer.remote.proc) {
                continue;
            }
            let (pid, stamp) = (peer.remote.pid, peer.remote.proc);
            if let Some(reason) = ended(pid, &stamp, proc_state(pid)) {
                self.fail_peer(p, &reason);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_whatever_the_command_name() {
        let tail = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 123456 99 100";
        assert_eq!(
            parse_stat(&format!("42 (bash) {tail}")),
            Some(ProcState::Alive { start: 123456 })
        );
        assert_eq!(
            parse_stat(&format!("42 (a b) (c)) {tail}")),
            Some(ProcState::Alive { start: 123456 })
        );
        let z = tail.replacen('S', "Z", 1);
        assert_eq!(parse_stat(&format!("7 (x) {z}")), Some(ProcState::Zombie));
        assert_eq!(parse_stat("7 (x) S 1 2"), None, "truncated");
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_under_its_own_stamp_and_other_starts_are_not_it() {
        let me = own_stamp();
        assert!(me.boot != 0 && me.pidns != 0 && me.start != 0, "{me:?}");
        assert!(me.same_pid_space(&me));
        let pid = std::process::id();
        assert_eq!(ended(pid, &me, proc_state(pid)), None);
        let reused = ProcStamp {
            start: me.start + 1,
            ..me
        };
        let why = ended(pid, &reused, proc_state(pid)).expect("another process");
        assert!(why.contains("another process"), "{why}");
        assert!(!me.same_pid_space(&ProcStamp::default()));
        assert!(!ProcStamp::default().same_pid_space(&ProcStamp::default()));
    }

    #[test]
    fn an_exited_child_is_found_ended_zombie_or_reaped() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = match proc_state(pid) {
            ProcState::Alive { start } => start,
            // Already exited (a zombie until waited for).
            other => {
                assert_eq!(other, ProcState::Zombie);
                0
            }
        };
        let stamp = ProcStamp {
            start,
            ..own_stamp()
        };
        // Exited, not reaped: a zombie.
        let t = Instant::now();
        while proc_state(pid) != ProcState::Zombie {
            assert!(t.elapsed() < Duration::from_secs(10), "never exited");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(ended(pid, &stamp, proc_state(pid)).is_some());
        child.wait().unwrap();
        assert_eq!(proc_state(pid), ProcState::Gone);
        assert!(
            ended(pid, &stamp, proc_state(pid))
                .unwrap()
                .contains("exited or killed")
        );
    }

    /// A peer whose process ended fails from progress, with nothing in flight, and the error
    /// handler is called once (here the worker's own endpoint, made to stand for a process
    /// that exited: the self transport cannot tell).
    #[test]
    fn a_peer_whose_process_ended_fails_from_progress_and_is_reported_once() {
        use std::sync::{Arc, Mutex};
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let cfg = rucx_ucs::Config::from_vars(
            &tables,
            [("RUCX_TLS", "self"), ("RUCX_PROC_CHECK_INTERVAL", "10ms")],
        )
        .unwrap();
        let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
        let w = super::super::Worker::new(&ctx).unwrap();
        let ep = w.connect(&w.address()).unwrap();
        let calls: Arc<Mutex<Vec<String>>> = Arc::default();
        let c = calls.clone();
        w.set_error_handler(move |_, e, err| {
            assert_eq!(e, ep);
            c.lock().unwrap().push(err.to_string())
        });
        let idle = |limit: Duration| {
            let t = Instant::now();
            while t.elapsed() < limit && calls.lock().unwrap().is_empty() {
                w.progress();
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        // Alive (it is this process): never failed.
        idle(Duration::from_millis(100));
        assert!(calls.lock().unwrap().is_empty() && w.ep_error(ep).is_none());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = match proc_state(pid) {
            ProcState::Alive { start } => start,
            _ => 0,
        };
        child.wait().unwrap();
        {
            let mut st = w.st.borrow_mut();
            let remote = &mut st.peers[ep.idx()].remote;
            remote.pid = pid;
            remote.proc.start = start;
        }
        idle(Duration::from_secs(5));
        idle(Duration::from_millis(50));
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert!(
            calls[0].contains(&format!("its process {pid} ended")),
            "{calls:?}"
        );
        assert!(w.ep_error(ep).is_some());
    }

    /// A worker that sleeps in `wait` makes one progress call per wake-up: the check runs
    /// from `arm` (which reads the clock each time) and the sleeps last at most the interval,
    /// so the dead peer is found in a few rounds, not after the [`CHECK_POLLS`] progress calls
    /// (a minute of one-second sleeps) that progress alone needs to read the clock.
    #[test]
    fn a_worker_asleep_in_wait_finds_an_ended_peer_process_within_a_few_wake_ups() {
        use std::sync::{Arc, Mutex};
        let mut tables = rucx_transports::config_tables();
        tables.push(crate::CONFIG);
        let cfg = rucx_ucs::Config::from_vars(
            &tables,
            [("RUCX_TLS", "self"), ("RUCX_PROC_CHECK_INTERVAL", "10ms")],
        )
        .unwrap();
        let ctx = crate::Context::new(&rucx_transports::registry(), cfg).unwrap();
        let w = super::super::Worker::new(&ctx).unwrap();
        assert_eq!(
            w.wait_tick(),
            Duration::from_millis(10),
            "sleeps end for the check"
        );
        let ep = w.connect(&w.address()).unwrap();
        let calls: Arc<Mutex<Vec<String>>> = Arc::default();
        let c = calls.clone();
        w.set_error_handler(move |_, _, err| c.lock().unwrap().push(err.to_string()));
        while w.progress() > 0 {}
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = match proc_state(pid) {
            ProcState::Alive { start } => start,
            _ => 0,
        };
        child.wait().unwrap();
        {
            let mut st = w.st.borrow_mut();
            let remote = &mut st.peers[ep.idx()].remote;
            remote.pid = pid;
            remote.proc.start = start;
        }
        let mut rounds = 0;
        while calls.lock().unwrap().is_empty() {
            assert!(
                rounds < CHECK_POLLS / 2,
                "not found after {rounds} wake-ups"
            );
            w.wait(None).unwrap();
            w.progress();
            rounds += 1;
        }
        assert!(calls.lock().unwrap()[0].contains(&format!("its process {pid} ended")));
    }

    #[test]
    fn the_interval_option_turns_the_checks_off_or_spaces_them() {
        assert!(ProcWatch::new(Duration::MAX).every.is_none());
        let mut w = ProcWatch::new(Duration::from_millis(500));
        let ticks = (0..CHECK_POLLS * 3).filter(|_| w.tick()).count();
        assert_eq!(ticks, 3);
        let mut off = ProcWatch::new(Duration::MAX);
        assert!((0..1000).all(|_| !off.tick()));
    }
}
