//! The staged pipeline's send side over the fake I/O: the request to stage and its
//! registrations, copies in runs, push-back and resumption, fragments exhausted and refilled,
//! registration and copy failures at the start and mid-pipeline, an abort or the peer failing
//! mid-pipeline, and that every ending gives every staging fragment back.

use std::collections::BTreeSet;

use rucx_ucs::{Error, MemoryType};

use super::pipeline_recv::Posting;
use super::pipeline_send::PullChoice;
use super::stage_io::On;
use crate::plan::Op;
use crate::proto::Proto;
use crate::proto::fake_io::{COPY_MD, FAKE_UUID, FakeIo, Op as FakeOp, SEND_LO, SLOT, SLOT_BASE};
use crate::proto::gpu::stage_io::StageIo;
use crate::proto::rndv::{RndvSend, SendHead, SendNext};
use crate::wire::Msg;
use crate::worker::state::{SendWait, TokWhat};

const PEER: usize = 3;
const SREQ: u64 = 0x51;
const RREQ: u64 = 0x77;
/// The plan's host RMA lane to the receiver (its own domain in the fake).
const RMA: usize = 2;
/// The GPU send buffer.
const SRC: usize = 0x3000_0000;

fn head(len: usize) -> SendHead {
    SendHead {
        peer: PEER,
        addr: SRC,
        len,
        tag: 0x7a6,
        proto: Proto::RndvGet,
        op: Op::Tag,
        mem: MemoryType::Cuda,
        dev: Some(0),
    }
}

fn choice(max_get: usize) -> PullChoice {
    PullChoice {
        lane: Some(RMA),
        max_get,
        frag: SLOT,
    }
}

fn frag_addr(f: usize) -> usize {
    SLOT_BASE + f * SLOT
}

/// A staging copy or an announcement: (first fragment, offset, length).
type Staged = (usize, usize, usize);

/// A send of `h` that announced itself with a registration for the receiver's reads, then
/// was asked to stage: the pipeline is ready, that registration dropped, the buffer registered
/// with the copy lane.
fn pulled(io: &mut FakeIo, h: &SendHead, c: &PullChoice) -> RndvSend {
    io.regs.push((SREQ, RMA, h.region()));
    let mut rv = RndvSend::default();
    assert_eq!(rv.on_pull(io, SREQ, h, RREQ, c), SendNext::Post);
    assert_eq!(rv.wait, SendWait::Posting);
    assert_eq!(rv.peer_rreq(), RREQ);
    let regs: Vec<(u64, usize)> = io.regs.iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(
        regs,
        [(0, COPY_MD)],
        "only the copy lane's registration is left"
    );
    rv
}

/// The staging copies posted since the last call, as (first fragment, offset, length), each
/// checked against what the copy lane was asked to do.
fn take_copies(io: &mut FakeIo) -> Vec<(usize, usize, usize)> {
    let ops: Vec<FakeOp> = io.ep.ops.drain(..).collect();
    let copies: Vec<(usize, usize, usize)> = io
        .steps
        .drain(..)
        .map(|(req, on, what)| {
            assert_eq!((req, on), (SREQ, On::Copy));
            match what {
                TokWhat::StageD2H { frag, off, len } => (frag, off, len),
                w => panic!("not a staging copy: {w:?}"),
            }
        })
        .collect();
    assert_eq!(ops.len(), copies.len());
    for (op, &(f, off, len)) in ops.iter().zip(&copies) {
        match op {
            FakeOp::Rma {
                get: true,
                iov,
                remote,
                ..
            } => {
                assert_eq!(iov.as_slice(), [(frag_addr(f), len)]);
                assert_eq!(*remote, (SRC + off) as u64);
            }
            op => panic!("{op:?}"),
        }
    }
    copies
}

/// The fragments announced since the last call, as (fragment, offset, length).
fn take_announced(io: &mut FakeIo) -> Vec<(usize, usize, usize)> {
    let out = io
        .ctrl_msgs(PEER)
        .into_iter()
        .map(|m| match m {
            Msg::Frag {
                src,
                rreq,
                sreq,
                offset,
                len,
                addr,
                frag,
                key,
            } => {
                assert_eq!((src, rreq, sreq), (FAKE_UUID, RREQ, SREQ));
                assert_eq!(key.md, format!("fake{RMA}"));
                assert_eq!(addr as usize, frag_addr(frag as usize));
                (frag as usize, offset as usize, len as usize)
            }
            m => panic!("not an announcement: {m:?}"),
        })
        .collect();
    io.ctrls.clear();
    out
}

/// A pipeline of four fragments in one copy: one run, announced fragment by fragment (the
/// last one short); each acknowledgement frees its fragment, the last completes the send.
#[test]
fn a_pull_stages_the_message_in_runs_and_announces_each_fragment() {
    let mut io = FakeIo::with_send_frags(8);
    let h = head(3 * SLOT + 100);
    let mut rv = pulled(&mut io, &h, &choice(usize::MAX));
    assert_eq!(rv.post_staging(&mut io, SREQ, &h).unwrap(), Posting::Done);
    assert_eq!(take_copies(&mut io), [(SEND_LO, 0, h.len)]);
    assert_eq!(io.counted, ["staging fragments copied in runs"]);
    assert_eq!(io.free_send(), 4);
    // Posting again stages nothing more.
    assert_eq!(rv.post_staging(&mut io, SREQ, &h).unwrap(), Posting::Done);
    assert!(io.steps.is_empty());

    assert_eq!(
        rv.on_staged(&mut io, SREQ, &h, SEND_LO, 0, h.len, Ok(())),
        SendNext::Wait
    );
    let ann = take_announced(&mut io);
    assert_eq!(
        ann,
        [
            (SEND_LO, 0, SLOT),
            (SEND_LO + 1, SLOT, SLOT),
            (SEND_LO + 2, 2 * SLOT, SLOT),
            (SEND_LO + 3, 3 * SLOT, 100)
        ]
    );
    assert_eq!(
        io.staging_regs,
        [RMA],
        "the staging registered with the lane's domain"
    );
    // A second acknowledgement of a fragment counts for nothing (the send would otherwise
    // complete before the receiver read everything).
    let (f0, _, len0) = ann[0];
    assert_eq!(
        rv.on_frag_ack(&mut io, SREQ, f0, len0, h.len),
        SendNext::Post
    );
    assert_eq!(
        rv.on_frag_ack(&mut io, SREQ, f0, len0, h.len),
        SendNext::Wait
    );
    for (i, &(f, _, len)) in ann.iter().enumerate().skip(1) {
        let next = rv.on_frag_ack(&mut io, SREQ, f, len, h.len);
        if i + 1 < ann.len() {
            assert_eq!(next, SendNext::Post);
        } else {
            assert_eq!(next, SendNext::Complete);
        }
    }
    assert_eq!(io.free_send(), 8);
}

/// A lane that reads less than a fragment at once: one fragment per copy, holding what the
/// lane reads. A copy the copy lane pushes back gives its fragment back, and posting again
/// resumes at the first byte not staged: no gap, nothing twice, nothing past the message.
#[test]
fn a_push_back_resumes_where_it_stopped() {
    let mut io = FakeIo::with_send_frags(8);
    let h = head(3500);
    let mut rv = pulled(&mut io, &h, &choice(1000));
    io.push_back_after = Some(2);
    assert_eq!(rv.post_staging(&mut io, SREQ, &h).unwrap(), Posting::Later);
    let first = take_copies(&mut io);
    assert_eq!(
        first.iter().map(|c| (c.1, c.2)).collect::<Vec<_>>(),
        [(0, 1000), (1000, 1000)]
    );
    assert_eq!(
        io.free_send(),
        6,
        "the pushed-back copy's fragment is free again"
    );
    assert!(io.counted.is_empty(), "no runs");
    assert_eq!(rv.post_staging(&mut io, SREQ, &h).unwrap(), Posting::Done);
    let rest = take_copies(&mut io);
    assert_eq!(
        rest.iter().map(|c| (c.1, c.2)).collect::<Vec<_>>(),
        [(2000, 1000), (3000, 500)]
    );
    let frags: BTreeSet<usize> = first.iter().chain(&rest).map(|c| c.0).collect();
    assert_eq!(frags.len(), 4, "four fragments, each its own");
    // One announcement per copy, of what it holds.
    for &(f, off, len) in first.iter().chain(&rest) {
        assert_eq!(
            rv.on_staged(&mut io, SREQ, &h, f, off, len, Ok(())),
            SendNext::Wait
        );
        assert_eq!(take_announced(&mut io), [(f, off, len)]);
    }
}

/// Two fragments for a message of five: the send stages two, finds none free, and goes on
/// with each acknowledgement; it completes with the last acknowledgement, and never holds a
/// fragment twice.
#[test]
fn fragments_exhausted_and_refilled() {
    let mut io = FakeIo::with_send_frags(2);
    let h = head(5 * SLOT);
    let mut rv = pulled(&mut io, &h, &choice(usize::MAX));
    let mut staged: Vec<(usize, usize, usize)> = Vec::new();
    let mut acks = 0;
    let mut done = false;
    while !done {
        assert!(acks < 10, "no progress");
        let posting = rv.post_staging(&mut io, SREQ, &h).unwrap();
        let copies = take_copies(&mut io);
        staged.extend(copies.iter().copied());
        if staged.iter().map(|c| c.2).sum::<usize>() < h.len {
            assert_eq!(posting, Posting::NoSlot, "waits for a fragment");
            assert_eq!(io.free_send(), 0);
        } else {
            assert_eq!(posting, Posting::Done);
        }
        for &(f, off, len) in &copies {
            rv.on_staged(&mut io, SREQ, &h, f, off, len, Ok(()));
        }
        for (f, _, len) in take_announced(&mut io) {
            acks += 1;
            match rv.on_frag_ack(&mut io, SREQ, f, len, h.len) {
                SendNext::Post => {}
                SendNext::Complete => done = true,
                n => panic!("{n:?}"),
            }
        }
    }
    assert_eq!(acks, 5);
    let mut offs: Vec<(usize, usize)> = staged.iter().map(|c| (c.1, c.2)).collect();
    offs.sort();
    let mut at = 0;
    for (off, len) in offs {
        assert_eq!(off, at, "staged in order, once each");
        at += len;
    }
    assert_eq!(at, h.len);
    assert_eq!(io.free_send(), 2);
}

/// The buffer cannot be registered with the copy lane (the registration fails, or the
/// domain was demoted): the send ends; its abort names the receive that waits for fragments;
/// no fragment was taken.
#[test]
fn a_registration_failing_at_the_pull_ends_the_send() {
    for demoted in [false, true] {
        let mut io = FakeIo::with_send_frags(4);
        if demoted {
            io.demoted.push(COPY_MD);
        } else {
            io.fail_reg_after = Some(0);
        }
        let h = head(10_000);
        let mut rv = RndvSend::default();
        let next = rv.on_pull(&mut io, SREQ, &h, RREQ, &choice(usize::MAX));
        match (&next, demoted) {
            (SendNext::Fail(Error::Unsupported { .. }), true)
            | (SendNext::Fail(Error::NoMemory(_)), false) => {}
            _ => panic!("demoted {demoted}: {next:?}"),
        }
        assert!(rv.stage.is_none());
        rv.abort(&mut io, &h, SREQ, "no copy registration");
        assert!(matches!(
            io.ctrl_msgs(PEER).as_slice(),
            [Msg::Abort {
                sreq: SREQ,
                rreq: RREQ,
                by_sender: true,
                ..
            }]
        ));
        assert_eq!(io.free_send(), 4);
    }
}

/// The staging's registration with the lane's domain fails on the first announcement (mid
/// pipeline): the send ends and that copy's fragment comes back; the copies still in flight
/// complete after the send ended and come back unannounced (the worker's side). A failed
/// copy, or no lane to the receiver, ends the send the same way.
#[test]
fn failures_mid_pipeline_end_the_send_and_give_every_fragment_back() {
    for case in ["staging registration", "failed copy", "no lane"] {
        let mut io = FakeIo::with_send_frags(8);
        let h = head(4000);
        let c = PullChoice {
            lane: (case != "no lane").then_some(RMA),
            ..choice(1000)
        };
        let mut rv = pulled(&mut io, &h, &c);
        rv.post_staging(&mut io, SREQ, &h).unwrap();
        let copies = take_copies(&mut io);
        assert_eq!(copies.len(), 4, "{case}");
        let res = match case {
            "failed copy" => Err(Error::io("copying", std::io::Error::from_raw_os_error(5))),
            _ => Ok(()),
        };
        if case == "staging registration" {
            io.fail_reg_after = Some(0);
        }
        let (f, off, len) = copies[0];
        let next = rv.on_staged(&mut io, SREQ, &h, f, off, len, res);
        assert!(matches!(next, SendNext::Fail(_)), "{case}: {next:?}");
        assert!(take_announced(&mut io).is_empty(), "{case}");
        assert_eq!(
            io.free_send(),
            5,
            "{case}: the failed copy's fragment is back"
        );
        // The worker ended the send: the other copies come back unannounced.
        for &(f, _, len) in &copies[1..] {
            io.release_send(SREQ, f, len);
        }
        assert_eq!(io.free_send(), 8, "{case}");
        rv.abort(&mut io, &h, SREQ, "failed");
        assert!(matches!(
            io.ctrl_msgs(PEER).as_slice(),
            [Msg::Abort { rreq: RREQ, .. }]
        ));
    }
}

/// Four fragments for a message of eight, mid-pipeline: the first run copied and announced,
/// one fragment acknowledged and its next copy in flight; the others held by the receiver.
/// Returns the send, the announcements and the copy in flight.
fn mid_pipeline(io: &mut FakeIo) -> (RndvSend, Vec<Staged>, Vec<Staged>) {
    let h = head(8 * SLOT);
    let mut rv = pulled(io, &h, &choice(usize::MAX));
    rv.post_staging(io, SREQ, &h).unwrap();
    let [(f, off, len)] = take_copies(io)[..] else {
        panic!("one run")
    };
    rv.on_staged(io, SREQ, &h, f, off, len, Ok(()));
    let ann = take_announced(io);
    assert_eq!(ann.len(), 4);
    assert_eq!(
        rv.on_frag_ack(io, SREQ, ann[0].0, ann[0].2, h.len),
        SendNext::Post
    );
    assert_eq!(rv.post_staging(io, SREQ, &h).unwrap(), Posting::NoSlot);
    let in_flight = take_copies(io);
    assert_eq!(in_flight.len(), 1);
    assert_eq!(io.free_send(), 0);
    (rv, ann, in_flight)
}

/// The receiver gives up mid-pipeline (ABORT; the worker ends the send): the copy still in
/// flight comes back unannounced, and the fragments the receiver held come back with its
/// acknowledgements (it hands back what it did not read), after the send ended.
#[test]
fn an_abort_mid_pipeline_lets_every_fragment_come_back() {
    let mut io = FakeIo::with_send_frags(4);
    let (rv, ann, in_flight) = mid_pipeline(&mut io);
    // ABORT: the send ends (its state is gone); what comes later is the worker's.
    drop(rv);
    for &(f, _, len) in &in_flight {
        io.release_send(SREQ, f, len);
    }
    for &(f, _, len) in &ann[1..] {
        io.release_send(SREQ, f, len);
    }
    assert_eq!(io.free_send(), 4);
    assert!(io.ctrls.is_empty(), "nothing announced after the abort");
}

/// The peer fails mid-pipeline (the worker ends the send): the fragments announced to it
/// come back at once (it will never acknowledge them), not the one still being copied into,
/// which comes back when its copy completes; an acknowledgement from the dead peer that
/// arrives late frees nothing another send now uses.
#[test]
fn the_peer_failing_gives_back_what_it_held() {
    let mut io = FakeIo::with_send_frags(4);
    let (rv, ann, in_flight) = mid_pipeline(&mut io);
    // The peer fails: the send ends; the worker takes back what the peer held.
    drop(rv);
    let frags = io.send_frags.as_mut().expect("send fragments");
    assert_eq!(frags.release_peer(PEER), 3);
    assert_eq!(io.free_send(), 3);
    // Another send takes them; the dead peer's late acknowledgement frees none of them.
    let other = 0x99;
    let frags = io.send_frags.as_mut().expect("send fragments");
    let (g, k) = frags.take_run(other, 3).expect("free fragments");
    assert_eq!(k, 3);
    for &(f, _, len) in &ann[1..] {
        io.release_send(SREQ, f, len);
    }
    assert_eq!(io.free_send(), 0, "nothing of the other send freed");
    for &(f, _, len) in &in_flight {
        io.release_send(SREQ, f, len);
    }
    assert_eq!(
        io.free_send(),
        1,
        "the copy in flight came back when it completed"
    );
    io.release_send(other, g, 3 * SLOT);
    assert_eq!(io.free_send(), 4);
}

/// A model of the worker around one staged send: it posts when asked, hands copies'
/// completions and the receiver's acknowledgements to the send while it lives, and gives
/// fragments back itself once it ended.
struct Sim {
    io: FakeIo,
    h: SendHead,
    rv: Option<RndvSend>,
    /// Copies in flight, and fragments the receiver holds: (first fragment, offset, length).
    copies: Vec<(usize, usize, usize)>,
    held: Vec<(usize, usize, usize)>,
    /// Fragments in a copy or held by the receiver.
    busy: BTreeSet<usize>,
    /// Bytes staged, by offset (each byte once).
    staged: Vec<u8>,
    acked: usize,
    ends: Vec<SendNext>,
    completions: usize,
    fail_at: Option<usize>,
}

impl Sim {
    fn frags_of(len: usize) -> usize {
        len.div_ceil(SLOT).max(1)
    }

    fn end(&mut self, next: SendNext) {
        match next {
            SendNext::Wait | SendNext::Post => {}
            n => {
                self.ends.push(n);
                self.rv = None;
            }
        }
    }

    fn post(&mut self) -> Result<(), proptest::test_runner::TestCaseError> {
        let Some(rv) = self.rv.as_mut() else {
            return Ok(());
        };
        let res = rv.post_staging(&mut self.io, SREQ, &self.h);
        for (f, off, len) in take_copies(&mut self.io) {
            proptest::prop_assert!(off + len <= self.h.len, "staged past the buffer");
            for b in &mut self.staged[off..off + len] {
                proptest::prop_assert_eq!(*b, 0, "a byte staged twice");
                *b = 1;
            }
            for g in f..f + Self::frags_of(len) {
                proptest::prop_assert!(self.busy.insert(g), "fragment {} handed out twice", g);
            }
            self.copies.push((f, off, len));
        }
        if let Err(e) = res {
            self.end(SendNext::Fail(e));
        }
        Ok(())
    }

    fn complete(&mut self, i: usize) {
        if self.copies.is_empty() {
            return;
        }
        let (f, off, len) = self.copies.remove(i % self.copies.len());
        self.completions += 1;
        let res = if self.fail_at == Some(self.completions) {
            Err(Error::io("copying", std::io::Error::from_raw_os_error(5)))
        } else {
            Ok(())
        };
        match self.rv.as_mut() {
            Some(rv) => {
                let next = rv.on_staged(&mut self.io, SREQ, &self.h, f, off, len, res);
                let ann = take_announced(&mut self.io);
                if !ann.is_empty() {
                    self.held.push((f, off, len));
                } else {
                    self.free(f, len);
                }
                self.end(next);
            }
            None => {
                self.io.release_send(SREQ, f, len);
                self.free(f, len);
            }
        }
    }

    /// The receiver reads (or hands back) the fragments of one announced copy, one by one.
    fn ack(&mut self, i: usize) {
        if self.held.is_empty() {
            return;
        }
        let (f, _, len) = self.held.remove(i % self.held.len());
        let mut left = len;
        for g in f..f + Self::frags_of(len) {
            let n = left.min(SLOT);
            left -= n;
            match self.rv.as_mut() {
                Some(rv) => {
                    self.acked += n;
                    let next = rv.on_frag_ack(&mut self.io, SREQ, g, n, self.h.len);
                    self.end(next);
                }
                None => {
                    self.io.release_send(SREQ, g, n);
                }
            }
            self.busy.remove(&g);
        }
    }

    fn free(&mut self, f: usize, len: usize) {
        for g in f..f + Self::frags_of(len) {
            self.busy.remove(&g);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

    /// Whatever the order copies complete and fragments are acknowledged in, the push-backs,
    /// the fragments available, the lane's read size, a failing copy, an abort or the peer
    /// failing: every byte
    /// is staged once and none past the buffer, no fragment is handed out while in use, the
    /// send ends exactly once (complete only after every byte was acknowledged, unless it
    /// failed or was aborted), and every fragment is free again at the end.
    #[test]
    fn a_staged_send_ends_once_and_gives_every_fragment_back(
        len in 1usize..(12 * SLOT),
        frags in 1usize..6,
        small_reads in proptest::bool::ANY,
        actions in proptest::collection::vec((0u8..5, 0u8..16), 0..150),
        fail_at in proptest::option::weighted(0.3, 1usize..8),
        abort_at in proptest::option::weighted(0.2, 0usize..150),
        peer_fails in proptest::bool::ANY,
    ) {
        let mut io = FakeIo::with_send_frags(frags);
        let h = head(len);
        let c = choice(if small_reads { SLOT / 3 } else { usize::MAX });
        let rv = pulled(&mut io, &h, &c);
        let mut s = Sim {
            io, h, rv: Some(rv), copies: Vec::new(), held: Vec::new(), busy: BTreeSet::new(),
            staged: vec![0; len], acked: 0, ends: Vec::new(), completions: 0, fail_at,
        };
        let mut aborted = false;
        for (k, (a, x)) in actions.into_iter().enumerate() {
            if abort_at == Some(k) && s.rv.is_some() {
                s.rv = None;
                aborted = true;
                if peer_fails {
                    // What the peer held comes back now; it acknowledges nothing more.
                    let frags = s.io.send_frags.as_mut().expect("send fragments");
                    let back = frags.release_peer(PEER);
                    let held: usize = s.held.iter().map(|h| Sim::frags_of(h.2)).sum();
                    proptest::prop_assert_eq!(back, held);
                    for (f, _, len) in std::mem::take(&mut s.held) {
                        s.free(f, len);
                    }
                }
            }
            match a {
                0 | 1 => s.post()?,
                2 => s.complete(x as usize),
                3 => s.ack(x as usize),
                _ => s.io.push_back_after = Some(x as usize % 3),
            }
        }
        s.io.push_back_after = None;
        let mut rounds = 0;
        while s.rv.is_some() || !s.copies.is_empty() || !s.held.is_empty() {
            rounds += 1;
            proptest::prop_assert!(rounds < 10_000, "no progress");
            s.post()?;
            while !s.copies.is_empty() {
                s.complete(0);
            }
            while !s.held.is_empty() {
                s.ack(0);
            }
        }
        let failed = fail_at.is_some_and(|k| k <= s.completions);
        if aborted {
            proptest::prop_assert!(s.ends.len() <= 1);
        } else {
            proptest::prop_assert_eq!(s.ends.len(), 1, "ended {:?}", s.ends);
        }
        match s.ends.first() {
            Some(SendNext::Complete) => {
                proptest::prop_assert!(s.acked >= len);
                proptest::prop_assert!(s.staged.iter().all(|b| *b == 1), "complete with bytes not staged");
            }
            Some(SendNext::Fail(_)) => proptest::prop_assert!(failed),
            Some(n) => proptest::prop_assert!(false, "{:?}", n),
            None => proptest::prop_assert!(aborted),
        }
        proptest::prop_assert_eq!(s.io.free_send(), frags);
        proptest::prop_assert!(s.busy.is_empty());
    }
}
