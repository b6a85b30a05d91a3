//! The conformance suite every transport runs, like a provider test suite.
//!
//! An *initiator* drives checks against a *responder* over one endpoint; the responder answers
//! with digests of what it received, exposes registered buffers for put/get, and hashes regions
//! on request, so every byte is verified without trusting the transport under test.
//!
//! Three ways to run it:
//! - [`run_loopback`]: one interface that reaches itself (the `self` transport);
//! - [`run_in_process`]: two interfaces in one process, progressed alternately;
//! - [`two_process`]: the responder (and optionally the initiator) in child processes spawned from
//!   the current test binary, optionally under a launcher such as `ip netns exec NAME`.
//!   Inside the test function:
//!
//! ```ignore
//! #[test]
//! fn conformance_two_process() {
//!     let report = rucx_uct::conformance::two_process(
//!         "conformance_two_process",          // this test's name, so the child runs only it
//!         || open_my_side(),                   // opens md + iface in whichever process runs it
//!         &ProcessPlan::default(),
//!     ).unwrap();
//!     report.print();
//! }
//! ```
//!
//! Checks: active messages short/bcopy/zcopy at sizes 0, 1, limit-1 and limit (and an error just
//! past the limit), a burst of small messages delivered complete and in order, put short and
//! put/get zero-copy at several sizes and offsets, flush, completion tokens (each in-progress
//! operation completes exactly once, successfully), remote keys made of garbage or truncated
//! bytes rejected with an error, out-of-bounds remote access and unregistered local buffers
//! rejected with an error; and, for interfaces with an event descriptor, the wake-up protocol
//! (see [`Iface::arm`]): nothing pending means arming succeeds and the descriptor is idle;
//! armed, a message from the peer makes it readable within [`WAKE_BOUND`]; armed with a
//! message pending, arming again says busy; progress consumes the notification (arming
//! succeeds again). Transports that cannot signal are reported skipped; the other checks never
//! arm, so polling needs no wake-up.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rucx_ucs::{Error, MemoryType};

use crate::attr::IfaceCaps;
use crate::iface::{
    AmId, Endpoint, EpParams, Event, EventSource, Iface, Iov, OpStatus, pack_bytes,
};
use crate::md::{MemHandle, MemRegion, MemoryDomain, RemoteKey};
use crate::rkey::{Reader, put_lv};

/// Echo request: the responder replies with a digest of the data.
pub const AM_ECHO: AmId = 60;
/// Digest reply: header = length, payload = FNV-1a 64 of the data.
pub const AM_DIGEST: AmId = 61;
/// Ask the responder to expose a buffer: header = size, payload = seed.
pub const AM_SETUP_REQ: AmId = 62;
/// The exposed buffer: index, address, length, packed rkey.
pub const AM_SETUP_REP: AmId = 63;
/// Ask for a digest of an exposed region: index, offset, length.
pub const AM_CHECK_REQ: AmId = 59;
/// End of the run; the responder answers with a digest whose length is `u64::MAX`.
pub const AM_BYE: AmId = 58;
/// Ask for a delayed echo: header = delay in milliseconds; the responder sends the digest of
/// the whole message that much later (the initiator sleeps on its event descriptor meanwhile).
pub const AM_WAKE_REQ: AmId = 57;
/// How soon an armed interface's descriptor must become readable after the peer sent.
pub const WAKE_BOUND: Duration = Duration::from_secs(5);

/// Environment variable that tells a spawned test binary which role it plays.
pub const ROLE_ENV: &str = "RUCX_CONFORMANCE_ROLE";
const ADDR_LINE: &str = "RUCX-CONFORMANCE-ADDR ";
const DEADLINE: Duration = Duration::from_secs(30);

/// 64-bit FNV-1a.
pub fn fnv64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Deterministic test pattern: byte `i` of a buffer seeded with `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// One side: a memory domain and an interface opened from it.
#[derive(Debug)]
pub struct Side {
    /// The domain.
    pub md: Arc<dyn MemoryDomain>,
    /// The interface.
    pub iface: Box<dyn Iface>,
}

impl Side {
    /// The addresses a peer needs, hex-encoded on one line.
    pub fn address_hex(&self) -> String {
        let mut b = Vec::new();
        put_lv(&mut b, &self.iface.device_address());
        put_lv(&mut b, &self.iface.iface_address());
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}

/// Decode [`Side::address_hex`] into endpoint parameters.
pub fn ep_params_from_hex(hex: &str, user_id: u64) -> Result<EpParams, String> {
    let hex = hex.trim();
    if !hex.len().is_multiple_of(2) {
        return Err(format!("odd-length address {hex:?}"));
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|e| format!("bad hex address: {e}"))?;
    let mut r = Reader::new(&bytes, "conformance address");
    let dev = r.lv().map_err(|e| e.to_string())?.to_vec();
    let iface = r.lv().map_err(|e| e.to_string())?.to_vec();
    r.finish().map_err(|e| e.to_string())?;
    Ok(EpParams {
        dev_addr: dev,
        iface_addr: iface,
        user_id,
    })
}

/// What a run checked.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Transport and device under test.
    pub transport: String,
    /// One line per passed check.
    pub passed: Vec<String>,
    /// Checks skipped because the transport lacks the capability.
    pub skipped: Vec<String>,
}

impl Report {
    /// Print to stdout (visible with `--nocapture`).
    pub fn print(&self) {
        println!(
            "conformance of {}: {} checks passed",
            self.transport,
            self.passed.len()
        );
        for p in &self.passed {
            println!("  ok   {p}");
        }
        for s in &self.skipped {
            println!("  skip {s}");
        }
    }
}

struct Exposed {
    buf: Vec<u8>,
    _memh: MemHandle,
}

/// The responder state machine.
struct Responder {
    md: Arc<dyn MemoryDomain>,
    ep: Option<Box<dyn Endpoint>>,
    exposed: Vec<Exposed>,
    outbox: VecDeque<(AmId, Vec<u8>)>,
    /// Replies to send once their time came (delayed echoes).
    later: VecDeque<(Instant, AmId, Vec<u8>)>,
    done: bool,
    error: Option<String>,
}

impl Responder {
    fn new(md: Arc<dyn MemoryDomain>) -> Self {
        Responder {
            md,
            ep: None,
            exposed: Vec::new(),
            outbox: VecDeque::new(),
            later: VecDeque::new(),
            done: false,
            error: None,
        }
    }

    fn is_request(id: AmId) -> bool {
        matches!(
            id,
            AM_ECHO | AM_SETUP_REQ | AM_CHECK_REQ | AM_BYE | AM_WAKE_REQ
        )
    }

    fn digest(&mut self, len: u64, hash: u64) {
        let mut m = len.to_le_bytes().to_vec();
        m.extend_from_slice(&hash.to_le_bytes());
        self.outbox.push_back((AM_DIGEST, m));
    }

    fn handle(&mut self, id: AmId, data: &[u8]) {
        match id {
            AM_ECHO => self.digest(data.len() as u64, fnv64(data)),
            AM_WAKE_REQ => {
                let mut r = Reader::new(data, "wake request");
                match r.u64() {
                    Ok(ms) => {
                        let mut m = (data.len() as u64).to_le_bytes().to_vec();
                        m.extend_from_slice(&fnv64(data).to_le_bytes());
                        let at = Instant::now() + Duration::from_millis(ms.min(10_000));
                        self.later.push_back((at, AM_DIGEST, m));
                    }
                    Err(e) => self.error = Some(e.to_string()),
                }
            }
            AM_SETUP_REQ => {
                if let Err(e) = self.setup(data) {
                    self.error = Some(format!("responder setup failed: {e}"));
                }
            }
            AM_CHECK_REQ => {
                let mut r = Reader::new(data, "check request");
                let parsed = (|| Ok::<_, Error>((r.u64()?, r.u64()?, r.u64()?)))();
                match parsed {
                    Ok((idx, off, len)) => {
                        let region = self
                            .exposed
                            .get(idx as usize)
                            .and_then(|e| e.buf.get(off as usize..(off + len) as usize));
                        match region {
                            Some(s) => {
                                let h = fnv64(s);
                                self.digest(len, h)
                            }
                            None => {
                                self.error = Some(format!("check of bad region {idx}/{off}+{len}"))
                            }
                        }
                    }
                    Err(e) => self.error = Some(e.to_string()),
                }
            }
            AM_BYE => {
                self.digest(u64::MAX, 0);
                self.done = true;
            }
            other => self.error = Some(format!("unexpected active message id {other}")),
        }
    }

    fn setup(&mut self, data: &[u8]) -> Result<(), Error> {
        let mut r = Reader::new(data, "setup request");
        let size = r.u64()? as usize;
        let seed = r.u64()?;
        let buf = pattern(seed, size);
        let region = MemRegion::host(buf.as_ptr() as usize, buf.len());
        // SAFETY: `buf` is kept in `self.exposed` next to the handle and never resized, so the
        // heap block stays allocated and valid for as long as the handle lives.
        let memh = unsafe { self.md.mem_reg(region)? };
        let rkey = self.md.mkey_pack(&memh)?;
        let mut m = Vec::new();
        m.extend_from_slice(&(self.exposed.len() as u64).to_le_bytes());
        m.extend_from_slice(&(region.addr as u64).to_le_bytes());
        m.extend_from_slice(&(region.len as u64).to_le_bytes());
        put_lv(&mut m, &rkey);
        self.exposed.push(Exposed { buf, _memh: memh });
        self.outbox.push_back((AM_SETUP_REP, m));
        Ok(())
    }

    /// Send queued replies; stops at the first NoResource.
    fn flush_outbox(&mut self) {
        while self.later.front().is_some_and(|l| l.0 <= Instant::now()) {
            let (_, id, m) = self.later.pop_front().expect("checked");
            self.outbox.push_back((id, m));
        }
        let Some(ep) = self.ep.as_mut() else { return };
        while let Some((id, msg)) = self.outbox.front() {
            let res = ep.am_bcopy(*id, &mut pack_bytes(msg));
            match res {
                Ok(_) => {
                    self.outbox.pop_front();
                }
                Err(e) if e.is_retryable() => return,
                Err(e) => {
                    self.error = Some(format!("responder reply failed: {e}"));
                    return;
                }
            }
        }
    }
}

#[derive(Default)]
struct InitState {
    digests: VecDeque<(u64, u64)>,
    setups: VecDeque<Vec<u8>>,
    completions: BTreeMap<u64, Result<(), String>>,
    errors: Vec<String>,
}

impl InitState {
    fn on_event(&mut self, ev: Event<'_>) {
        match ev {
            Event::Am {
                id: AM_DIGEST,
                data,
            } => {
                let mut r = Reader::new(data, "digest");
                match (r.u64(), r.u64()) {
                    (Ok(l), Ok(h)) => self.digests.push_back((l, h)),
                    _ => self.errors.push("malformed digest".into()),
                }
            }
            Event::Am {
                id: AM_SETUP_REP,
                data,
            } => self.setups.push_back(data.to_vec()),
            Event::Am { id, .. } => self
                .errors
                .push(format!("initiator got unexpected am id {id}")),
            Event::Completion { token, result } => {
                if self
                    .completions
                    .insert(token, result.map_err(|e| e.to_string()))
                    .is_some()
                {
                    self.errors.push(format!("token {token} completed twice"));
                }
            }
            Event::EpError { user_id, error } => self
                .errors
                .push(format!("endpoint {user_id} failed: {error}")),
        }
    }
}

enum PeerMode {
    /// Responder shares the initiator's interface (loopback).
    SameIface(Responder),
    /// Responder has its own interface in this process.
    OtherIface(Side, Responder),
    /// Responder lives elsewhere.
    Remote,
}

struct Driver {
    local: Side,
    ep: Box<dyn Endpoint>,
    peer: PeerMode,
    st: InitState,
    next_token: u64,
    report: Report,
}

type R<T> = Result<T, String>;

impl Driver {
    fn progress(&mut self) {
        let st = &mut self.st;
        match &mut self.peer {
            PeerMode::SameIface(resp) => {
                self.local.iface.progress(&mut |ev| match ev {
                    Event::Am { id, data } if Responder::is_request(id) => resp.handle(id, data),
                    other => st.on_event(other),
                });
                resp.flush_outbox();
            }
            PeerMode::OtherIface(side, resp) => {
                self.local.iface.progress(&mut |ev| st.on_event(ev));
                side.iface.progress(&mut |ev| match ev {
                    Event::Am { id, data } if Responder::is_request(id) => resp.handle(id, data),
                    Event::EpError { error, .. } => resp.error = Some(error.to_string()),
                    _ => {}
                });
                resp.flush_outbox();
            }
            PeerMode::Remote => {
                self.local.iface.progress(&mut |ev| st.on_event(ev));
            }
        }
    }

    /// Let the responder work without progressing the initiator's interface (which would
    /// disarm it): its due replies go out (and, in process, its interface is progressed).
    fn peer_tick(&mut self) {
        match &mut self.peer {
            PeerMode::SameIface(resp) => resp.flush_outbox(),
            PeerMode::OtherIface(side, resp) => {
                side.iface.progress(&mut |ev| match ev {
                    Event::Am { id, data } if Responder::is_request(id) => resp.handle(id, data),
                    Event::EpError { error, .. } => resp.error = Some(error.to_string()),
                    _ => {}
                });
                resp.flush_outbox();
            }
            PeerMode::Remote => {}
        }
    }

    /// Progress until nothing is pending and the interface arms (busy answers are progressed
    /// away). Returns whether a digest arrived meanwhile.
    fn arm_when_quiet(&mut self) -> R<bool> {
        let start = Instant::now();
        let before = self.st.digests.len();
        loop {
            self.progress();
            self.check_errors()?;
            match self.local.iface.arm() {
                Ok(()) => return Ok(self.st.digests.len() > before),
                Err(Error::Busy(_)) => {}
                Err(e) => return Err(format!("arm: expected Ok or Busy, got {e}")),
            }
            if start.elapsed() > DEADLINE {
                return Err(format!("arm stayed busy for {DEADLINE:?}"));
            }
        }
    }

    /// The wake-up protocol; see the module documentation.
    fn event_checks(&mut self, seed: &mut u64) -> R<()> {
        let fd = match self.local.iface.event_source() {
            EventSource::Fd(fd) => fd,
            other => {
                self.report
                    .skipped
                    .push(format!("arm/wait: the interface is {other:?}"));
                return Ok(());
            }
        };
        let idle = |fd| rucx_ucs::event::wait_readable(fd, Some(Duration::ZERO));
        // Quiet: arming succeeds, twice, and the descriptor is idle.
        self.arm_when_quiet()?;
        self.local
            .iface
            .arm()
            .map_err(|e| format!("arming twice with nothing pending: {e}"))?;
        if idle(fd).map_err(|e| e.to_string())? {
            return Err("armed with nothing pending, the event descriptor is readable".into());
        }
        self.report
            .passed
            .push("arm with nothing pending succeeds, descriptor idle".into());
        // Armed, the peer's message wakes us. The request asks for a delayed answer; if the
        // answer beat the arm (a slow machine), ask again with a longer delay.
        let mut delay_ms = 100u64;
        let woke_after = loop {
            *seed += 1;
            let mut m = delay_ms.to_le_bytes().to_vec();
            m.extend_from_slice(&pattern(*seed, 24));
            let hash = fnv64(&m);
            self.retry("wake request", |ep| {
                ep.am_bcopy(AM_WAKE_REQ, &mut pack_bytes(&m))
            })?;
            if self.arm_when_quiet()? {
                self.expect_digest("early delayed echo", m.len(), hash)?;
                delay_ms *= 4;
                if delay_ms > 2000 {
                    return Err("the delayed echo always came before the interface armed".into());
                }
                continue;
            }
            let t = Instant::now();
            let readable = loop {
                self.peer_tick();
                self.check_errors()?;
                if rucx_ucs::event::wait_readable(fd, Some(Duration::from_millis(10)))
                    .map_err(|e| e.to_string())?
                {
                    break true;
                }
                if t.elapsed() > WAKE_BOUND + Duration::from_millis(delay_ms) {
                    break false;
                }
            };
            if !readable {
                return Err(format!(
                    "armed, the peer's message did not make the event descriptor readable \
                     within {WAKE_BOUND:?}"
                ));
            }
            let woke_after = t.elapsed();
            // The message is pending: arming says busy.
            match self.local.iface.arm() {
                Err(Error::Busy(_)) => {}
                other => {
                    return Err(format!(
                        "arm with a message pending: expected busy, got {other:?}"
                    ));
                }
            }
            self.expect_digest("delayed echo after a wake-up", m.len(), hash)?;
            break woke_after;
        };
        self.report.passed.push(format!(
            "armed: the peer's message woke the descriptor ({delay_ms} ms delay, woke after \
             {} ms); arm with it pending is busy",
            woke_after.as_millis()
        ));
        // Progress consumed the notification: quiet again, arming succeeds, descriptor idle.
        self.arm_when_quiet()?;
        if idle(fd).map_err(|e| e.to_string())? {
            return Err("after progress, armed again, the event descriptor is readable".into());
        }
        self.report
            .passed
            .push("progress consumes the wake-up (armed again, idle)".into());
        // Leave it disarmed for the checks that follow.
        self.progress();
        Ok(())
    }

    fn check_errors(&self) -> R<()> {
        if let Some(e) = self.st.errors.first() {
            return Err(e.clone());
        }
        match &self.peer {
            PeerMode::SameIface(r) | PeerMode::OtherIface(_, r) => match &r.error {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            },
            PeerMode::Remote => Ok(()),
        }
    }

    fn wait<T>(&mut self, what: &str, mut f: impl FnMut(&mut InitState) -> Option<T>) -> R<T> {
        let start = Instant::now();
        loop {
            self.check_errors()?;
            if let Some(v) = f(&mut self.st) {
                return Ok(v);
            }
            if start.elapsed() > DEADLINE {
                return Err(format!("timed out after {DEADLINE:?} waiting for {what}"));
            }
            self.progress();
        }
    }

    /// Retry an operation while it reports NoResource.
    fn retry<T>(
        &mut self,
        what: &str,
        mut op: impl FnMut(&mut dyn Endpoint) -> Result<T, Error>,
    ) -> R<T> {
        let start = Instant::now();
        loop {
            match op(self.ep.as_mut()) {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() => {
                    if start.elapsed() > DEADLINE {
                        return Err(format!("{what}: no resources for {DEADLINE:?}"));
                    }
                    self.check_errors()?;
                    self.progress();
                }
                Err(e) => return Err(format!("{what}: {e}")),
            }
        }
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    fn complete(&mut self, what: &str, token: u64, st: OpStatus) -> R<()> {
        match st {
            OpStatus::Done => Ok(()),
            OpStatus::InProgress => {
                let res = self.wait(what, |s| s.completions.remove(&token))?;
                res.map_err(|e| format!("{what} completed with error: {e}"))
            }
        }
    }

    fn expect_digest(&mut self, what: &str, data_len: usize, hash: u64) -> R<()> {
        let (l, h) = self.wait(what, |s| s.digests.pop_front())?;
        if l != data_len as u64 || h != hash {
            return Err(format!(
                "{what}: responder saw {l} bytes hash {h:#x}, sent {data_len} bytes hash {hash:#x}"
            ));
        }
        Ok(())
    }

    fn register(&self, buf: &[u8]) -> R<MemHandle> {
        // SAFETY: every caller keeps `buf` alive and unmoved until the handle and all operations
        // using it are finished (they are waited for before the buffer goes out of scope).
        unsafe { self.local.md.mem_reg(MemRegion::of_slice(buf)) }
            .map_err(|e| format!("registering {} bytes: {e}", buf.len()))
    }

    fn sizes(limit: usize, cap: usize) -> Vec<usize> {
        let limit = limit.min(cap);
        let mut v = vec![0, 1, limit.saturating_sub(1), limit];
        v.sort_unstable();
        v.dedup();
        v
    }

    fn run(&mut self) -> R<()> {
        let attr = self.local.iface.attr().clone();
        self.report.transport = format!("{}/{}", attr.tl_name, attr.dev_name);
        let lim = attr.limits;
        let mut seed = 1u64;

        if attr.has(IfaceCaps::AM_SHORT) {
            for n in Self::sizes(lim.am_max_short, usize::MAX) {
                seed += 1;
                let payload = pattern(seed, n);
                self.retry("am_short", |ep| ep.am_short(AM_ECHO, seed, &payload))?;
                let mut all = seed.to_le_bytes().to_vec();
                all.extend_from_slice(&payload);
                self.expect_digest(&format!("am_short {n} B"), all.len(), fnv64(&all))?;
                self.report.passed.push(format!("am_short payload {n} B"));
            }
            let too_big = vec![0u8; lim.am_max_short + 1];
            match self.ep.am_short(AM_ECHO, 0, &too_big) {
                Err(e) if !e.is_retryable() => self
                    .report
                    .passed
                    .push("am_short past limit rejected".into()),
                other => {
                    return Err(format!(
                        "am_short past the limit: expected an error, got {other:?}"
                    ));
                }
            }
        } else {
            self.report.skipped.push("am_short".into());
        }

        if attr.has(IfaceCaps::AM_BCOPY) {
            for n in Self::sizes(lim.am_max_bcopy, usize::MAX) {
                seed += 1;
                let data = pattern(seed, n);
                let sent = self.retry("am_bcopy", |ep| {
                    ep.am_bcopy(AM_ECHO, &mut pack_bytes(&data))
                })?;
                if sent != n {
                    return Err(format!("am_bcopy returned {sent} for {n} bytes"));
                }
                self.expect_digest(&format!("am_bcopy {n} B"), n, fnv64(&data))?;
                self.report.passed.push(format!("am_bcopy {n} B"));
            }
            let too_big = vec![0u8; lim.am_max_bcopy + 1];
            match self.ep.am_bcopy(AM_ECHO, &mut pack_bytes(&too_big)) {
                Err(e) if !e.is_retryable() => self
                    .report
                    .passed
                    .push("am_bcopy past limit rejected".into()),
                other => {
                    return Err(format!(
                        "am_bcopy past the limit: expected an error, got {other:?}"
                    ));
                }
            }
            // A burst: everything arrives, in order.
            let count = 500;
            for i in 0..count {
                let data = pattern(10_000 + i, (i as usize * 7) % 100);
                self.retry("am_bcopy burst", |ep| {
                    ep.am_bcopy(AM_ECHO, &mut pack_bytes(&data))
                })?;
            }
            for i in 0..count {
                let data = pattern(10_000 + i, (i as usize * 7) % 100);
                self.expect_digest(&format!("burst message {i}"), data.len(), fnv64(&data))?;
            }
            self.report
                .passed
                .push(format!("burst of {count} messages complete and in order"));
        } else {
            self.report.skipped.push("am_bcopy".into());
        }

        if attr.has(IfaceCaps::AM_ZCOPY) {
            let hdr_len = lim.am_max_hdr.min(8);
            for n in Self::sizes(lim.am_max_zcopy, 4 << 20) {
                seed += 1;
                let header = pattern(seed ^ 0xabc, hdr_len);
                let data = pattern(seed, n.max(1));
                let memh = self.register(&data)?;
                let iov = [Iov {
                    addr: data.as_ptr() as usize,
                    len: n,
                    memh: &memh,
                }];
                let iov: &[Iov<'_>] = if n == 0 { &[] } else { &iov };
                let token = self.token();
                let st = self.retry("am_zcopy", |ep| ep.am_zcopy(AM_ECHO, &header, iov, token))?;
                self.complete("am_zcopy", token, st)?;
                let mut all = header.clone();
                all.extend_from_slice(&data[..n]);
                self.expect_digest(&format!("am_zcopy {n} B"), all.len(), fnv64(&all))?;
                self.report
                    .passed
                    .push(format!("am_zcopy {n} B (+{hdr_len} B header)"));
            }
        } else {
            self.report.skipped.push("am_zcopy".into());
        }

        let rma = attr
            .caps
            .intersects(IfaceCaps::PUT_ZCOPY | IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_SHORT);
        if rma {
            self.rma_checks(&attr.caps, &lim, &mut seed)?;
        } else {
            self.report
                .skipped
                .push("put/get (no RMA capability)".into());
        }

        let token = self.token();
        let st = self.retry("flush", |ep| ep.flush(token))?;
        self.complete("flush", token, st)?;
        self.report.passed.push("flush".into());

        // Garbage remote keys never crash.
        for (name, garbage) in [
            ("empty", vec![]),
            ("random", pattern(99, 40)),
            ("all ones", vec![0xff; 64]),
        ] {
            if self.local.md.rkey_unpack(&garbage).is_ok() {
                return Err(format!("{name} rkey bytes were accepted"));
            }
        }
        self.report.passed.push("garbage rkeys rejected".into());

        // Unregistered local buffer (outside the handle) is rejected.
        if attr.has(IfaceCaps::AM_ZCOPY) {
            let data = [7u8; 64];
            let memh = self.register(&data[..32])?;
            let iov = [Iov {
                addr: data.as_ptr() as usize + 16,
                len: 32,
                memh: &memh,
            }];
            let token = self.token();
            match self.ep.am_zcopy(AM_ECHO, &[], &iov, token) {
                Err(e) if !e.is_retryable() => self
                    .report
                    .passed
                    .push("iov outside its handle rejected".into()),
                other => {
                    return Err(format!(
                        "iov outside its memory handle: expected an error, got {other:?}"
                    ));
                }
            }
        }

        self.event_checks(&mut seed)?;

        let st = self.retry("bye", |ep| ep.am_bcopy(AM_BYE, &mut pack_bytes(&[])))?;
        let _ = st;
        let (l, _) = self.wait("goodbye", |s| s.digests.pop_front())?;
        if l != u64::MAX {
            return Err(format!(
                "expected the goodbye answer, got a digest of {l} bytes"
            ));
        }
        // Nothing may be left over.
        if !self.st.completions.is_empty() {
            return Err(format!(
                "unexpected completions: {:?}",
                self.st.completions.keys()
            ));
        }
        Ok(())
    }

    fn setup_remote(&mut self, size: usize, seed: u64) -> R<(u64, u64, u64, Vec<u8>)> {
        let mut m = (size as u64).to_le_bytes().to_vec();
        m.extend_from_slice(&seed.to_le_bytes());
        self.retry("setup request", |ep| {
            ep.am_bcopy(AM_SETUP_REQ, &mut pack_bytes(&m))
        })?;
        let rep = self.wait("setup reply", |s| s.setups.pop_front())?;
        let mut r = Reader::new(&rep, "setup reply");
        let parsed = (|| {
            let idx = r.u64()?;
            let addr = r.u64()?;
            let len = r.u64()?;
            let rkey = r.lv()?.to_vec();
            Ok::<_, Error>((idx, addr, len, rkey))
        })();
        parsed.map_err(|e| e.to_string())
    }

    fn remote_digest(&mut self, idx: u64, off: u64, len: u64) -> R<(u64, u64)> {
        let mut m = Vec::new();
        for v in [idx, off, len] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        self.retry("check request", |ep| {
            ep.am_bcopy(AM_CHECK_REQ, &mut pack_bytes(&m))
        })?;
        self.wait("check digest", |s| s.digests.pop_front())
    }

    fn rma_checks(
        &mut self,
        caps: &IfaceCaps,
        lim: &crate::attr::IfaceLimits,
        seed: &mut u64,
    ) -> R<()> {
        const SIZE: usize = (1 << 20) + 64;
        *seed += 1;
        let remote_seed = *seed;
        let (idx, base, len, packed) = self.setup_remote(SIZE, remote_seed)?;
        if len != SIZE as u64 {
            return Err(format!("responder exposed {len} bytes, asked for {SIZE}"));
        }
        let rkey: RemoteKey = self
            .local
            .md
            .rkey_unpack(&packed)
            .map_err(|e| format!("unpacking the responder's rkey: {e}"))?;
        // Corrupted copies of a valid key are rejected.
        if self
            .local
            .md
            .rkey_unpack(&packed[..packed.len() - 1])
            .is_ok()
        {
            return Err("a truncated rkey was accepted".into());
        }
        let mut flipped = packed.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x40;
        if self.local.md.rkey_unpack(&flipped).is_ok() {
            return Err("a corrupted rkey was accepted".into());
        }
        self.report
            .passed
            .push("truncated and corrupted rkeys rejected".into());
        let remote_pattern = pattern(remote_seed, SIZE);

        if caps.contains(IfaceCaps::GET_ZCOPY) {
            for (off, n) in [
                (0usize, 1usize),
                (3, 4097),
                (64, lim.get_max_zcopy.min(SIZE - 64)),
            ] {
                let local = vec![0u8; n];
                let memh = self.register(&local)?;
                let token = self.token();
                let iov = [Iov::whole(&memh)];
                let st = self.retry("get_zcopy", |ep| {
                    ep.get_zcopy(&iov, base + off as u64, &rkey, token)
                })?;
                self.complete("get_zcopy", token, st)?;
                drop(memh);
                if local[..] != remote_pattern[off..off + n] {
                    let bad = local
                        .iter()
                        .zip(&remote_pattern[off..])
                        .position(|(a, b)| a != b);
                    return Err(format!(
                        "get_zcopy {n} B at offset {off}: first wrong byte at {bad:?}"
                    ));
                }
                self.report
                    .passed
                    .push(format!("get_zcopy {n} B at offset {off}"));
            }
            let local = vec![0u8; 2];
            let memh = self.register(&local)?;
            let iov = [Iov::whole(&memh)];
            let token = self.token();
            match self.ep.get_zcopy(&iov, base + len - 1, &rkey, token) {
                Err(e) if !e.is_retryable() => {
                    self.report.passed.push("out-of-bounds get rejected".into())
                }
                other => {
                    return Err(format!(
                        "get past the remote region: expected an error, got {other:?}"
                    ));
                }
            }
        } else {
            self.report.skipped.push("get_zcopy".into());
        }

        if caps.contains(IfaceCaps::PUT_ZCOPY) {
            for (off, n) in [
                (5usize, 1usize),
                (100, 4097),
                (0, lim.put_max_zcopy.min(SIZE)),
            ] {
                *seed += 1;
                let data = pattern(*seed, n);
                let memh = self.register(&data)?;
                let iov = [Iov::whole(&memh)];
                let token = self.token();
                let st = self.retry("put_zcopy", |ep| {
                    ep.put_zcopy(&iov, base + off as u64, &rkey, token)
                })?;
                self.complete("put_zcopy", token, st)?;
                let ft = self.token();
                let st = self.retry("flush after put", |ep| ep.flush(ft))?;
                self.complete("flush after put", ft, st)?;
                let (l, h) = self.remote_digest(idx, off as u64, n as u64)?;
                if l != n as u64 || h != fnv64(&data) {
                    return Err(format!(
                        "put_zcopy {n} B at offset {off}: remote content differs"
                    ));
                }
                self.report
                    .passed
                    .push(format!("put_zcopy {n} B at offset {off}"));
            }
            let data = vec![1u8; 2];
            let memh = self.register(&data)?;
            let iov = [Iov::whole(&memh)];
            let token = self.token();
            match self.ep.put_zcopy(&iov, base + len - 1, &rkey, token) {
                Err(e) if !e.is_retryable() => {
                    self.report.passed.push("out-of-bounds put rejected".into())
                }
                other => {
                    return Err(format!(
                        "put past the remote region: expected an error, got {other:?}"
                    ));
                }
            }
        } else {
            self.report.skipped.push("put_zcopy".into());
        }

        if caps.contains(IfaceCaps::PUT_SHORT) {
            for n in Self::sizes(lim.put_max_short, 4096) {
                *seed += 1;
                let data = pattern(*seed, n);
                let off = 7u64;
                self.retry("put_short", |ep| ep.put_short(&data, base + off, &rkey))?;
                let ft = self.token();
                let st = self.retry("flush after put_short", |ep| ep.flush(ft))?;
                self.complete("flush after put_short", ft, st)?;
                let (l, h) = self.remote_digest(idx, off, n as u64)?;
                if l != n as u64 || h != fnv64(&data) {
                    return Err(format!("put_short {n} B: remote content differs"));
                }
                self.report.passed.push(format!("put_short {n} B"));
            }
        } else {
            self.report.skipped.push("put_short".into());
        }
        Ok(())
    }
}

fn mem_type_check(md: &Arc<dyn MemoryDomain>) -> R<()> {
    if !md.attr().reg_mem_types().has(MemoryType::Host) {
        return Err(format!(
            "domain {} does not register host memory; the suite needs host buffers",
            md.name()
        ));
    }
    Ok(())
}

/// Run the suite on an interface that reaches itself (loopback transports).
pub fn run_loopback(mut side: Side) -> R<Report> {
    mem_type_check(&side.md)?;
    let addr = ep_params_from_hex(&side.address_hex(), 1)?;
    let ep = side.iface.create_ep(&addr).map_err(|e| e.to_string())?;
    let mut back = ep_params_from_hex(&side.address_hex(), 2)?;
    back.user_id = 2;
    let resp_ep = side.iface.create_ep(&back).map_err(|e| e.to_string())?;
    let mut resp = Responder::new(side.md.clone());
    resp.ep = Some(resp_ep);
    let mut d = Driver {
        local: side,
        ep,
        peer: PeerMode::SameIface(resp),
        st: InitState::default(),
        next_token: 0,
        report: Report::default(),
    };
    d.run()?;
    Ok(d.report)
}

/// Run the suite between two interfaces of this process (the responder uses `b`).
pub fn run_in_process(mut a: Side, mut b: Side) -> R<Report> {
    mem_type_check(&a.md)?;
    let ep = a
        .iface
        .create_ep(&ep_params_from_hex(&b.address_hex(), 1)?)
        .map_err(|e| e.to_string())?;
    let back = b
        .iface
        .create_ep(&ep_params_from_hex(&a.address_hex(), 2)?)
        .map_err(|e| e.to_string())?;
    let mut resp = Responder::new(b.md.clone());
    resp.ep = Some(back);
    let mut d = Driver {
        local: a,
        ep,
        peer: PeerMode::OtherIface(b, resp),
        st: InitState::default(),
        next_token: 0,
        report: Report::default(),
    };
    d.run()?;
    Ok(d.report)
}

/// Run the initiator against a responder elsewhere, given its [`Side::address_hex`].
pub fn run_initiator(mut side: Side, responder_hex: &str) -> R<Report> {
    mem_type_check(&side.md)?;
    let ep = side
        .iface
        .create_ep(&ep_params_from_hex(responder_hex, 1)?)
        .map_err(|e| format!("connecting to the responder: {e}"))?;
    let mut d = Driver {
        local: side,
        ep,
        peer: PeerMode::Remote,
        st: InitState::default(),
        next_token: 0,
        report: Report::default(),
    };
    d.run()?;
    Ok(d.report)
}

/// Serve as the responder until the initiator says goodbye (or the deadline passes without
/// any progress).
pub fn serve(mut side: Side, initiator_hex: &str) -> R<()> {
    let ep = side
        .iface
        .create_ep(&ep_params_from_hex(initiator_hex, 2)?)
        .map_err(|e| format!("connecting back to the initiator: {e}"))?;
    let mut resp = Responder::new(side.md.clone());
    resp.ep = Some(ep);
    let mut last_activity = Instant::now();
    while !(resp.done && resp.outbox.is_empty()) {
        let n = side.iface.progress(&mut |ev| match ev {
            Event::Am { id, data } if Responder::is_request(id) => resp.handle(id, data),
            Event::Am { id, .. } => {
                resp.error = Some(format!("responder got unexpected am id {id}"))
            }
            Event::EpError { error, .. } => resp.error = Some(error.to_string()),
            Event::Completion { .. } => {}
        });
        resp.flush_outbox();
        if let Some(e) = &resp.error {
            return Err(e.clone());
        }
        if n > 0 {
            last_activity = Instant::now();
        } else if last_activity.elapsed() > DEADLINE {
            return Err(format!("responder idle for {DEADLINE:?}; initiator gone?"));
        }
    }
    // Let the goodbye answer drain before the interface closes.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(200) {
        side.iface.progress(&mut |_| {});
    }
    Ok(())
}

/// How [`two_process`] launches its children.
#[derive(Clone, Debug, Default)]
pub struct ProcessPlan {
    /// Command prefix for the responder child (e.g. `["ip", "netns", "exec", "b"]`).
    pub responder_launcher: Vec<String>,
    /// When set, the initiator also runs in a child under this prefix (may be empty), and this
    /// process only relays addresses.
    pub initiator_launcher: Option<Vec<String>>,
    /// Extra environment for the children.
    pub env: Vec<(String, String)>,
}

struct ChildProc {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildProc {
    fn spawn(
        test_name: &str,
        role: &str,
        launcher: &[String],
        env: &[(String, String)],
    ) -> R<Self> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut cmd = match launcher.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().map_err(|e| format!("spawning {role}: {e}"))?;
        let out = child.stdout.take().ok_or("no child stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        let role_name = role.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if !line.starts_with(ADDR_LINE) {
                    println!("[{role_name}] {line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(ChildProc { child, lines: rx })
    }

    fn read_addr(&mut self) -> R<String> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(a) = l.strip_prefix(ADDR_LINE) {
                        return Ok(a.trim().to_string());
                    }
                }
                Err(_) => return Err("child printed no address (see its output above)".into()),
            }
        }
    }

    fn send_line(&mut self, s: &str) -> R<()> {
        let stdin = self.child.stdin.as_mut().ok_or("no child stdin")?;
        writeln!(stdin, "{s}").map_err(|e| format!("writing to child: {e}"))?;
        stdin.flush().map_err(|e| e.to_string())
    }

    fn wait(mut self, role: &str) -> R<()> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => return Err(format!("{role} child exited with {st}")),
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!(
                        "{role} child did not exit within {DEADLINE:?}; killed"
                    ));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn child_role(open: &dyn Fn() -> R<Side>, role: &str) -> R<Report> {
    let side = open()?;
    // Start on a fresh line: libtest may have printed "test NAME ... " without a newline.
    println!("\n{ADDR_LINE}{}", side.address_hex());
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| format!("reading the peer address: {e}"))?;
    if role == "responder" {
        serve(side, &line)?;
        Ok(Report::default())
    } else {
        let r = run_initiator(side, &line)?;
        r.print();
        Ok(r)
    }
}

/// Run the suite across real processes. Call it from a `#[test]` function named `test_name`;
/// in the spawned children (told apart by [`ROLE_ENV`]) it plays the responder or initiator
/// and returns an empty report.
pub fn two_process(test_name: &str, open: impl Fn() -> R<Side>, plan: &ProcessPlan) -> R<Report> {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        return child_role(&open, &role);
    }
    let mut resp = ChildProc::spawn(test_name, "responder", &plan.responder_launcher, &plan.env)?;
    let resp_addr = resp.read_addr()?;
    let report = match &plan.initiator_launcher {
        Some(l) => {
            let mut init = ChildProc::spawn(test_name, "initiator", l, &plan.env)?;
            let init_addr = init.read_addr()?;
            init.send_line(&resp_addr)?;
            resp.send_line(&init_addr)?;
            init.wait("initiator")?;
            Report {
                transport: "(initiator child, see its output)".into(),
                passed: vec!["initiator child passed every check".into()],
                skipped: vec![],
            }
        }
        None => {
            let side = open()?;
            resp.send_line(&side.address_hex())?;
            run_initiator(side, &resp_addr)?
        }
    };
    resp.wait("responder")?;
    Ok(report)
}
