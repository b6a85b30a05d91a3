//! The remote memory access state machine over the fake I/O: a small driver does what the
//! worker does with each answer ([`RmaNext`]), and the fake tracks every byte.

use std::collections::{BTreeMap, VecDeque};

use rucx_ucs::{Error, MemoryType};

use super::fake::{At, LOCAL, REMOTE, peer_key};
use super::{RmaNext, RmaReq, RmaStart, RmaState};
use crate::context::RegGuard;
use crate::plan::{MemKey, Op, RmaPlan, RmaStep};
use crate::proto::Proto;
use crate::proto::fake_io::FakeIo;
use crate::proto::gpu::stage_io::On;
use crate::proto::io::ProtoIo;
use proptest::strategy::Strategy;

/// The lanes of the fake (each its own domain).
const LANE: usize = 3;
const LANE2: usize = 4;
/// Bytes between two requests' buffers (and remote ranges).
const STRIDE: usize = 1 << 20;

/// One request of the driver.
struct DReq {
    st: RmaState,
    put: bool,
    addr: usize,
    remote: u64,
    len: usize,
    /// How it ended (bytes moved, or the error), once.
    end: Option<Result<usize, Error>>,
    _guard: Option<RegGuard>,
}

/// What the worker does, over the fake.
struct Driver {
    io: FakeIo,
    reqs: BTreeMap<u64, DReq>,
    /// Requests to post for, in order.
    line: VecDeque<u64>,
    /// Flushes waiting for earlier requests.
    flushes: Vec<u64>,
    next_id: u64,
    /// Requests in the order they ended.
    ended: Vec<u64>,
}

fn staged(lane: usize) -> Vec<RmaStep> {
    vec![RmaStep::Staged { lane }]
}

fn zcopy(lane: usize) -> Vec<RmaStep> {
    vec![RmaStep::Zcopy { lane }]
}

impl Driver {
    fn new(io: FakeIo) -> Driver {
        Driver {
            io,
            reqs: BTreeMap::new(),
            line: VecDeque::new(),
            flushes: Vec::new(),
            next_id: 0,
            ended: Vec::new(),
        }
    }

    /// Start a put or get of `len` bytes, request `k`'s buffers, by `steps`: its id and
    /// protocol (none: no bytes), or the error of the start.
    fn post(
        &mut self,
        k: usize,
        put: bool,
        len: usize,
        steps: Vec<RmaStep>,
    ) -> Result<(u64, Option<Proto>), Error> {
        self.post_at(k, 0, put, len, steps)
    }

    /// [`Self::post`] from `off` bytes into request `k`'s local buffer, at `2 * off` into
    /// its remote range.
    fn post_at(
        &mut self,
        k: usize,
        off: usize,
        put: bool,
        len: usize,
        steps: Vec<RmaStep>,
    ) -> Result<(u64, Option<Proto>), Error> {
        let addr = LOCAL + k * STRIDE + off;
        let remote = REMOTE + (k * STRIDE + 2 * off) as u64;
        let local = MemKey::new(MemoryType::Cuda, Some(0));
        let keys = [peer_key(LANE), peer_key(LANE2)];
        let r = RmaReq {
            peer: 0,
            put,
            addr,
            len,
            local,
            remote,
            rmem: MemoryType::Host,
            keys: &keys,
            peer_name: "peer".into(),
        };
        let plan = RmaPlan {
            op: if put { Op::Put } else { Op::Get },
            local,
            remote: MemoryType::Host,
            steps,
            notes: Vec::new(),
        };
        self.next_id += 1;
        let id = self.next_id;
        let (st, guard, proto) = match RmaState::start(&mut self.io, &r, Some(&plan))? {
            RmaStart::Empty(st) => (st, None, None),
            RmaStart::Go {
                state,
                guard,
                proto,
            } => (state, Some(guard), Some(proto)),
        };
        self.reqs.insert(
            id,
            DReq {
                st,
                put,
                addr,
                remote,
                len,
                end: None,
                _guard: guard,
            },
        );
        match proto {
            Some(_) => self.line.push_back(id),
            None => self.end(id, Ok(0)),
        }
        Ok((id, proto))
    }

    /// A flush of `lanes` after every staged request not ended.
    fn flush(&mut self, lanes: Vec<usize>) -> u64 {
        let after = self
            .reqs
            .iter()
            .filter(|(_, r)| r.end.is_none() && r.st.pipelined())
            .map(|(i, _)| *i)
            .collect();
        self.next_id += 1;
        let id = self.next_id;
        let st = RmaState::flush(0, lanes, after);
        self.reqs.insert(
            id,
            DReq {
                st,
                put: false,
                addr: 0,
                remote: 0,
                len: 0,
                end: None,
                _guard: None,
            },
        );
        self.line.push_back(id);
        id
    }

    fn end(&mut self, id: u64, res: Result<usize, Error>) {
        let r = self.reqs.get_mut(&id).expect("request");
        assert!(r.end.is_none(), "request {id} ended twice");
        r.end = Some(res);
        self.io.rma.ended.push(id);
        self.ended.push(id);
        self.reclaim(id);
    }

    /// An ended request with nothing in flight gives its window back.
    fn reclaim(&mut self, id: u64) {
        if self.io.outstanding(id) == 0
            && let Some(w) = self.reqs.get_mut(&id).and_then(|r| r.st.take_window())
        {
            self.io.rma.windows.keep(w);
        }
    }

    fn act(&mut self, id: u64, next: Result<RmaNext, Error>) {
        match next {
            Err(e) => self.end(id, Err(e)),
            Ok(RmaNext::Wait) => {}
            Ok(RmaNext::NeedWindow) => {
                self.io.rma.windows.wait(0, id);
            }
            Ok(RmaNext::Post | RmaNext::Later) => self.line.push_back(id),
            Ok(RmaNext::Complete) => {
                let len = self.reqs[&id].len;
                self.end(id, Ok(len));
            }
            Ok(RmaNext::FlushWait) => self.flushes.push(id),
        }
    }

    /// Post for the requests in line until a transport pushes back.
    fn pump(&mut self) {
        while let Some(id) = self.line.pop_front() {
            let r = self.reqs.get_mut(&id).expect("request");
            if r.end.is_some() {
                continue;
            }
            let next = r.st.advance(&mut self.io, id);
            if next == Ok(RmaNext::Later) {
                self.line.push_front(id);
                return;
            }
            self.act(id, next);
        }
    }

    /// A progress call: waiting requests get the free windows, waiting flushes are looked at,
    /// and the line is posted.
    fn progress(&mut self) {
        let mut free = self.io.rma.windows.free();
        while free > 0
            && let Some((_, id)) = self.io.rma.windows.next_waiter()
        {
            if self.reqs[&id].end.is_none() {
                self.line.push_back(id);
                free -= 1;
            }
        }
        for id in std::mem::take(&mut self.flushes) {
            let r = self.reqs.get_mut(&id).expect("flush");
            if r.end.is_none()
                && let Some(next) = r.st.flush_ready(&mut self.io, id)
            {
                self.act(id, Ok(next));
            }
        }
        self.pump();
    }

    /// Operation `token` completed (`ok`: successfully).
    fn complete(&mut self, token: u64, ok: bool) {
        let id = self.io.complete(token, ok);
        let n = self.io.outstanding(id);
        let r = self.reqs.get_mut(&id).expect("request");
        r.st.note_outstanding(n);
        if r.end.is_some() {
            self.reclaim(id);
            return;
        }
        let res = if ok {
            Ok(())
        } else {
            Err(Error::Internal("injected: a failed operation".into()))
        };
        let next = r.st.on_done(&mut self.io, id, res);
        self.act(id, next);
    }

    /// Complete every operation in flight, newest first, with progress after each, until
    /// nothing is left to do.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            self.progress();
            match self.io.rma.tokens().last() {
                Some(&t) => self.complete(t, true),
                None if self.line.is_empty() => return,
                None => {}
            }
        }
        panic!("no end");
    }

    fn result(&self, id: u64) -> Option<&Result<usize, Error>> {
        self.reqs[&id].end.as_ref()
    }

    /// Every byte of request `id`'s target came from the right source offset, written once
    /// (`whole`), or at most once where written (a request that failed).
    fn check_bytes(&self, id: u64, whole: bool) {
        let r = &self.reqs[&id];
        let rma = &self.io.rma;
        for i in 0..r.len {
            let (dst, src) = if r.put {
                (At::Peer(r.remote + i as u64), At::Here(r.addr + i))
            } else {
                (At::Here(r.addr + i), At::Peer(r.remote + i as u64))
            };
            let n = rma.writes.get(&dst).copied().unwrap_or(0);
            if whole || n > 0 {
                assert_eq!(n, 1, "request {id}: byte {i} written {n} times");
                assert_eq!(rma.origin(dst), src, "request {id}: byte {i}");
            }
        }
    }

    /// Nothing but the requests' targets was written, no operation raced another, and every
    /// window is back.
    fn check_clean(&self) {
        let rma = &self.io.rma;
        assert!(rma.hazards.is_empty(), "{:?}", rma.hazards);
        for at in rma.writes.keys() {
            let inside = self.reqs.values().any(|r| {
                let (b, e) = (r.remote, r.remote + r.len as u64);
                match *at {
                    At::Peer(a) => r.put && (b..e).contains(&a),
                    At::Here(a) => !r.put && (r.addr..r.addr + r.len).contains(&a),
                }
            });
            assert!(inside, "{at:?} written outside every request's target");
        }
        assert_eq!(rma.windows.kept(), rma.windows.live(), "a window not back");
        assert!(self.io.in_flight.is_empty());
    }
}

#[test]
fn a_zero_copy_put_goes_in_fragments_and_completes_after_the_last_completion() {
    let mut io = FakeIo::rma(100);
    io.rma.in_progress = true;
    let mut d = Driver::new(io);
    let (id, proto) = d.post(0, true, 250, zcopy(LANE)).unwrap();
    assert_eq!(proto, Some(Proto::PutZcopy));
    d.progress();
    let lens: Vec<usize> = d.io.rma.posted.iter().map(|p| p.2).collect();
    assert_eq!(lens, [100, 100, 50]);
    assert!(
        d.io.rma
            .posted
            .iter()
            .all(|p| p.1 == On::Lane { p: 0, lane: LANE })
    );
    // Completions out of order: the request ends with the last one.
    let t = d.io.rma.tokens();
    d.complete(t[1], true);
    d.complete(t[2], true);
    assert!(d.result(id).is_none());
    d.complete(t[0], true);
    assert_eq!(d.result(id), Some(&Ok(250)));
    d.check_bytes(id, true);
    d.check_clean();
    // No bytes: ends at once, nothing posted.
    let n = d.io.rma.posted.len();
    let (e, proto) = d.post(1, false, 0, zcopy(LANE)).unwrap();
    assert_eq!((d.result(e), proto), (Some(&Ok(0)), None));
    assert_eq!(d.io.rma.posted.len(), n);
}

/// A staged put and get in fragments through a window, completions in reverse order: every
/// byte through both operations, the window pipelined (at most its 4 slots in use) and kept.
#[test]
fn staged_put_and_get_pipeline_fragments_with_completions_out_of_order() {
    for put in [true, false] {
        let mut io = FakeIo::rma(64);
        io.rma.in_progress = true;
        let mut d = Driver::new(io);
        let (id, proto) = d.post(0, put, 64 * 10 + 5, staged(LANE)).unwrap();
        assert_eq!(
            proto,
            Some(if put {
                Proto::PutStaged
            } else {
                Proto::GetStaged
            })
        );
        d.progress();
        // The first operation of 4 fragments (one per slot) is in flight.
        assert_eq!(d.io.rma.tokens().len(), 4);
        let first = if put {
            On::Copy
        } else {
            On::Lane { p: 0, lane: LANE }
        };
        assert!(d.io.rma.posted.iter().all(|p| p.1 == first));
        d.drain();
        assert_eq!(d.result(id), Some(&Ok(645)));
        d.check_bytes(id, true);
        d.check_clean();
        assert_eq!(d.io.rma.windows.live(), 1);
        assert_eq!(d.io.rma.posted.len(), 2 * 11, "two operations per fragment");
    }
}

/// The transport pushes back part-way: the request posts again from where it stopped.
#[test]
fn a_push_back_resumes_where_it_stopped() {
    for steps in [zcopy(LANE), staged(LANE)] {
        let mut io = FakeIo::rma(64);
        io.push_back_after = Some(2);
        let mut d = Driver::new(io);
        let (id, _) = d.post(0, true, 64 * 5, steps).unwrap();
        d.pump();
        assert!(d.result(id).is_none(), "pushed back");
        assert_eq!(d.line.front(), Some(&id));
        d.drain();
        assert_eq!(d.result(id), Some(&Ok(320)));
        d.check_bytes(id, true);
        d.check_clean();
    }
}

/// A registration failing at post time sends the request on to the plan's next step; with
/// none left the start fails naming why, and a window it took goes back.
#[test]
fn a_registration_failing_at_post_time_takes_the_next_step_or_fails() {
    let mut io = FakeIo::rma(64);
    io.fail_reg_after = Some(0);
    let mut d = Driver::new(io);
    let steps = vec![
        RmaStep::Zcopy { lane: LANE },
        RmaStep::Staged { lane: LANE },
    ];
    let (id, proto) = d.post(0, true, 200, steps).unwrap();
    assert_eq!(proto, Some(Proto::PutStaged));
    d.drain();
    assert_eq!(d.result(id), Some(&Ok(200)));
    d.check_bytes(id, true);

    // The window's registration with the lane fails (the copy key and the window's own
    // registration went through): no step left.
    let mut io = FakeIo::rma(64);
    io.fail_reg_after = Some(2);
    let mut d = Driver::new(io);
    let e = d.post(0, false, 200, staged(LANE)).err().unwrap();
    let s = e.to_string();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(
        s.contains("injected: registering a window with fake3"),
        "{s}"
    );
    assert_eq!((d.io.rma.windows.live(), d.io.rma.windows.kept()), (1, 1));
}

/// More staged requests than windows: the others wait in line and go on in the order they
/// came as windows come back; a waiting request whose window fails to register with its lane
/// mid-way ends with the error and hands the window on.
#[test]
fn requests_beyond_the_windows_wait_in_order_and_a_late_registration_failure_ends_one() {
    let mut io = FakeIo::rma(64);
    io.rma.in_progress = true;
    let mut d = Driver::new(io);
    let mut ids = Vec::new();
    for k in 0..7 {
        // Request 4 goes on another lane: its window needs a registration there.
        let lane = if k == 4 { LANE2 } else { LANE };
        ids.push(d.post(k, true, 64 * 6, staged(lane)).unwrap().0);
    }
    d.progress();
    assert_eq!(d.io.rma.windows.live(), 4);
    let posting: Vec<u64> = {
        let mut v: Vec<u64> = d.io.rma.posted.iter().map(|p| p.0).collect();
        v.dedup();
        v
    };
    assert_eq!(posting, ids[..4]);
    d.io.fail_reg_after = Some(0);
    d.drain();
    let e = d.result(ids[4]).expect("ended").as_ref().unwrap_err();
    assert!(e.to_string().contains("fake4"), "{e}");
    for (k, id) in ids.iter().enumerate() {
        if k != 4 {
            assert_eq!(d.result(*id), Some(&Ok(384)), "request {k}");
            d.check_bytes(*id, true);
        }
    }
    // They went on in order: the first of the waiting ones ended first.
    let waited: Vec<u64> = d.ended.iter().copied().filter(|i| *i > ids[3]).collect();
    assert_eq!(waited, ids[4..]);
    assert_eq!(d.io.rma.windows.live(), 4, "no window beyond the most");
    d.check_clean();
}

/// A flush ends only after every earlier request ended: a zero-copy put in flight (its
/// lane's flush) and staged puts still waiting for a window.
#[test]
fn a_flush_ends_after_every_earlier_request() {
    let mut io = FakeIo::rma(64);
    io.rma.in_progress = true;
    let mut d = Driver::new(io);
    let mut earlier = vec![d.post(0, true, 100, zcopy(LANE)).unwrap().0];
    for k in 1..7 {
        earlier.push(d.post(k, true, 64 * 3, staged(LANE)).unwrap().0);
    }
    let f = d.flush(vec![LANE]);
    for _ in 0..10_000 {
        d.progress();
        let Some(&t) = d.io.rma.tokens().first() else {
            // The last staged request ended in that progress call: the next one ends the
            // flush.
            d.progress();
            break;
        };
        d.complete(t, true);
        if d.result(f).is_some() {
            break;
        }
    }
    assert_eq!(d.result(f), Some(&Ok(0)), "ended {:?}", d.ended);
    assert_eq!(d.ended.last(), Some(&f), "{:?}", d.ended);
    for id in earlier {
        assert!(d.result(id).is_some_and(|r| r.is_ok()));
        d.check_bytes(id, true);
    }
    d.check_clean();
}

/// A staged request into the peer's region mapped here: one copy, no window.
#[test]
fn a_mapped_region_takes_one_copy_and_no_window() {
    for put in [true, false] {
        let mut io = FakeIo::rma(64);
        io.rma.maps = true;
        io.rma.in_progress = true;
        let mut d = Driver::new(io);
        let (id, _) = d.post(0, put, 1000, staged(LANE)).unwrap();
        d.drain();
        assert_eq!(d.result(id), Some(&Ok(1000)));
        assert_eq!(d.io.rma.posted.len(), 1);
        assert_eq!(d.io.rma.posted[0].1, On::Copy);
        assert_eq!(d.io.rma.windows.live(), 0);
        d.check_bytes(id, true);
        d.check_clean();
    }
}

/// Which step fails, if one does.
#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    /// The post after this many.
    Post(usize),
    /// The completion after this many.
    Completion(usize),
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

    /// Whatever the sizes, remote offsets, paths, completion order, push-backs and one
    /// failing post or completion: every byte of every target range is written exactly once
    /// from the right source offset (at most once for a request that failed), nothing
    /// outside them is, no operation races another, every request ends exactly once, and
    /// every window comes back.
    #[test]
    fn every_byte_once_every_request_ends_once_every_window_back(
        frag in 16usize..200,
        reqs in proptest::collection::vec((proptest::bool::ANY, 1usize..3000, 0usize..64, 0u8..3), 1..8),
        seed in 1u64..u64::MAX,
        maps in proptest::bool::ANY,
        fault in proptest::prop_oneof![
            proptest::strategy::Just(Fault::None),
            (0usize..60).prop_map(Fault::Post),
            (0usize..60).prop_map(Fault::Completion),
        ],
    ) {
        let mut io = FakeIo::rma(frag);
        io.rma.rng = Some(seed);
        io.rma.maps = maps;
        io.rma.lane_max = frag / 2 + 1;
        if let Fault::Post(n) = fault {
            io.fail_post_after = Some((n, Error::Internal("injected: a post failed".into())));
        }
        let mut d2 = Driver::new(io);
        let mut all = Vec::new();
        for (k, &(put, len, off, path)) in reqs.iter().enumerate() {
            let steps = match path {
                0 => zcopy(LANE),
                1 => staged(LANE),
                _ => staged(LANE2),
            };
            all.push(d2.post_at(k, off, put, len, steps).unwrap().0);
        }
        let mut completions = 0;
        for _ in 0..100_000 {
            d2.progress();
            let tokens = d2.io.rma.tokens();
            if tokens.is_empty() {
                if d2.line.is_empty() {
                    break;
                }
                continue;
            }
            let pick = d2.io.rma.roll().unwrap_or(0) as usize % tokens.len();
            let ok = !matches!(fault, Fault::Completion(n) if n == completions);
            completions += 1;
            d2.complete(tokens[pick], ok);
        }
        let mut failed = 0;
        for &id in &all {
            match d2.result(id) {
                Some(Ok(n)) => {
                    proptest::prop_assert_eq!(*n, d2.reqs[&id].len);
                    d2.check_bytes(id, true);
                }
                Some(Err(_)) => {
                    failed += 1;
                    d2.check_bytes(id, false);
                }
                None => proptest::prop_assert!(false, "request {} never ended", id),
            }
        }
        proptest::prop_assert!(failed <= 1, "{} requests failed of one fault", failed);
        if matches!(fault, Fault::None) {
            proptest::prop_assert_eq!(failed, 0);
        }
        d2.check_clean();
    }
}
