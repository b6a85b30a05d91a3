//! The staged receive and the GPU receiver's path choice over the fake I/O: fragments out of
//! order, push-back and resumption, registration failures at the start and mid-pipeline, copy
//! failures, truncation, and that every ending gives every staging slot back.

use rucx_ucs::{Error, MemoryType};
use rucx_uct::MemRegion;

use super::pipeline_recv::{FragMsg, Posting, StagedNext, step_orphaned};
use super::recv::{GpuRecvChoice, StepLane};
use crate::plan::RecvStep;
use crate::proto::fake_io::{FakeEp, FakeIo, Op, SLOT, SLOT_BASE};
use crate::proto::rndv::RndvRecv;
use crate::wire::{Msg, NamedKey};
use crate::worker::state::TokWhat;

const PEER: usize = 3;
const SREQ: u64 = 0x51;
const RREQ: u64 = 0x77;
/// The receive buffer.
const DST: usize = 0x9000_0000;
/// The sender's staging (fragment `i` at `SENDER + i * SLOT`).
const SENDER: u64 = 0x7000_0000;
/// The lane (and domain) the plan stages on; another domain a sender's key may name.
const LANE: usize = 1;
const OTHER: usize = 2;

fn key_of(md: usize) -> NamedKey {
    NamedKey {
        md: format!("fake{md}"),
        key: vec![md as u8],
    }
}

/// Fragment `i` of the sender, `len` bytes staged, keyed with domain `md`.
fn frag_in(md: usize, i: usize, len: usize) -> FragMsg {
    FragMsg {
        off: i * SLOT,
        len,
        addr: SENDER + (i * SLOT) as u64,
        frag: i as u64,
        key: key_of(md),
    }
}

fn frag(i: usize, len: usize) -> FragMsg {
    frag_in(LANE, i, len)
}

/// The choice of a plan whose steps are `steps`, for a receive of `want` bytes of `mem`.
fn choice<'a>(
    steps: &'a [RecvStep],
    keys: &'a [NamedKey],
    sgpu: bool,
    mem: MemoryType,
    want: usize,
) -> GpuRecvChoice<'a> {
    let lanes = steps
        .iter()
        .filter_map(|s| s.lane())
        .map(|lane| StepLane {
            lane,
            md: lane,
            key: keys.iter().position(|k| k.md == format!("fake{lane}")),
            max_get: usize::MAX,
        })
        .collect();
    GpuRecvChoice {
        steps,
        lanes,
        notes: String::new(),
        peer_name: "peer".into(),
        keys,
        sgpu,
        saddr: 0x1_0000,
        region: MemRegion {
            addr: DST,
            len: want,
            mem_type: mem,
            device: mem.is_gpu().then_some(0),
        },
        cap: want,
        frag: SLOT,
    }
}

/// A GPU receive of `want` bytes from a GPU sender with no zero-copy path: it asks the sender
/// to stage (PULL).
fn pulled(io: &mut FakeIo, mem: MemoryType, want: usize) -> RndvRecv {
    let mut rv = RndvRecv::new(PEER, SREQ, want);
    let steps = [RecvStep::Pull { lane: LANE }];
    let next = rv.start_gpu(io, RREQ, &choice(&steps, &[], true, mem, want));
    assert_eq!(next, StagedNext::Wait);
    assert!(rv.staged.pull);
    assert!(matches!(
        io.ctrl_msgs(PEER).as_slice(),
        [Msg::Pull {
            sreq: SREQ,
            rreq: RREQ,
            ..
        }]
    ));
    io.ctrls.clear();
    rv
}

/// The pipeline steps posted since the last call.
fn take_steps(io: &mut FakeIo) -> Vec<TokWhat> {
    io.steps
        .drain(..)
        .map(|(req, _, w)| {
            assert_eq!(req, RREQ);
            w
        })
        .collect()
}

/// The fragment acknowledgements queued, as (fragment, staged length), and forget them.
fn take_acks(io: &mut FakeIo) -> Vec<(u64, u64)> {
    let acks = io
        .ctrl_msgs(PEER)
        .into_iter()
        .map(|m| match m {
            Msg::FragAck {
                sreq, frag, len, ..
            } => {
                assert_eq!(sreq, SREQ);
                (frag, len)
            }
            m => panic!("not a fragment acknowledgement: {m:?}"),
        })
        .collect();
    io.ctrls.clear();
    acks
}

/// The operations the fake endpoint took, as (read, local address, length, remote address); a
/// CPU copy out of staging counts as a write from it.
fn ops(ep: &FakeEp) -> Vec<(bool, usize, usize, u64)> {
    ep.ops
        .iter()
        .map(|o| match o {
            Op::Rma {
                get, iov, remote, ..
            } => (*get, iov[0].0, iov[0].1, *remote),
            Op::Cpu { from, to, len } => (false, *from, *len, *to as u64),
            o => panic!("{o:?}"),
        })
        .collect()
}

/// Fragments announced out of order, read and copied in yet another order: each is read once
/// into a slot, acknowledged with its staged length once read, copied once to its own offset
/// of the GPU buffer; the receive completes with the last copy and every slot is free again.
#[test]
fn fragments_out_of_order_are_read_and_copied_once_each() {
    let mut io = FakeIo::with_slots(4);
    let want = 3 * SLOT - 100;
    let mut rv = pulled(&mut io, MemoryType::Cuda, want);
    for i in [2, 0, 1] {
        let len = if i == 2 { SLOT - 100 } else { SLOT };
        assert_eq!(rv.on_frag(&mut io, RREQ, frag(i, len)), StagedNext::Post);
    }
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));
    let reads = take_steps(&mut io);
    assert_eq!(reads.len(), 3, "one read per fragment");
    assert_eq!(io.free_slots(), 1);
    for i in [1, 2, 0] {
        assert_eq!(
            rv.on_step_done(&mut io, RREQ, reads[i], Ok(())),
            StagedNext::Wait
        );
    }
    assert_eq!(
        take_acks(&mut io),
        [(0, SLOT as u64), (1, SLOT as u64), (2, (SLOT - 100) as u64)],
        "acknowledged as read (read 1 was of fragment 0)"
    );
    let copies = take_steps(&mut io);
    assert_eq!(copies.len(), 3, "one copy per fragment");
    // Every copy takes the slot its read filled to the offset that read was of.
    let o = ops(&io.ep);
    for (i, r) in reads.iter().enumerate() {
        let TokWhat::PullGet {
            off,
            len,
            rfrag: Some(slot),
            ..
        } = *r
        else {
            panic!("{r:?}")
        };
        assert_eq!(
            o[i],
            (true, SLOT_BASE + slot * SLOT, len, SENDER + off as u64)
        );
        assert!(o[3..].contains(&(false, SLOT_BASE + slot * SLOT, len, (DST + off) as u64)));
    }
    assert_eq!(io.free_slots(), 1, "slots held until copied");
    let ends: Vec<StagedNext> = copies
        .iter()
        .map(|c| rv.on_step_done(&mut io, RREQ, *c, Ok(())))
        .collect();
    assert_eq!(
        ends,
        [StagedNext::Wait, StagedNext::Wait, StagedNext::Complete]
    );
    assert_eq!(rv.staged.landed, want);
    assert_eq!(io.free_slots(), 4);
    assert!(io.ctrls.is_empty(), "a pulled receive sends no ATS");
}

/// A read the transport pushes back gives its slot back and is posted on the next call; a copy
/// the copy lane pushes back keeps its slot and goes first on the next call.
#[test]
fn pushed_back_reads_and_copies_resume() {
    let mut io = FakeIo::with_slots(4);
    let want = 2 * SLOT;
    let mut rv = pulled(&mut io, MemoryType::Cuda, want);
    for i in 0..2 {
        rv.on_frag(&mut io, RREQ, frag(i, SLOT));
    }
    io.push_back_after = Some(1);
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Later));
    assert_eq!(io.steps.len(), 1);
    assert_eq!(
        rv.staged.chunks.len(),
        1,
        "the pushed-back read is still queued"
    );
    assert_eq!(io.free_slots(), 3, "its slot came back");
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));
    let reads = take_steps(&mut io);
    assert_eq!(reads.len(), 2);

    io.push_back_after = Some(0);
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, reads[0], Ok(())),
        StagedNext::Post,
        "the copy waits: the worker queues the receive"
    );
    assert_eq!(rv.staged.copies.len(), 1);
    assert_eq!(io.free_slots(), 2, "the pending copy keeps its slot");
    assert!(io.steps.is_empty());
    // The second read completes meanwhile: its copy goes behind the pending one.
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, reads[1], Ok(())),
        StagedNext::Wait
    );
    assert!(rv.staged.copies.is_empty());
    let copies = take_steps(&mut io);
    let slots: Vec<usize> = copies
        .iter()
        .map(|c| match c {
            TokWhat::H2D { rfrag, .. } => *rfrag,
            c => panic!("{c:?}"),
        })
        .collect();
    let read_slots: Vec<usize> = reads
        .iter()
        .map(|r| match r {
            TokWhat::PullGet { rfrag: Some(f), .. } => *f,
            r => panic!("{r:?}"),
        })
        .collect();
    assert_eq!(slots, read_slots, "copied in the order read");
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copies[0], Ok(())),
        StagedNext::Wait
    );
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copies[1], Ok(())),
        StagedNext::Complete
    );
    assert_eq!(io.free_slots(), 4);
    assert_eq!(take_acks(&mut io).len(), 2);
}

/// More fragments than slots: posting stops when none is free and resumes once a copy gives
/// one back.
#[test]
fn reads_wait_for_a_free_slot() {
    let mut io = FakeIo::with_slots(1);
    let mut rv = pulled(&mut io, MemoryType::Cuda, 2 * SLOT);
    for i in 0..2 {
        rv.on_frag(&mut io, RREQ, frag(i, SLOT));
    }
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::NoSlot));
    let read = take_steps(&mut io);
    assert_eq!(read.len(), 1);
    rv.on_step_done(&mut io, RREQ, read[0], Ok(()));
    let copy = take_steps(&mut io);
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::NoSlot));
    assert!(io.steps.is_empty());
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copy[0], Ok(())),
        StagedNext::Wait
    );
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));
    let read = take_steps(&mut io);
    rv.on_step_done(&mut io, RREQ, read[0], Ok(()));
    let copy = take_steps(&mut io);
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copy[0], Ok(())),
        StagedNext::Complete
    );
    assert_eq!(io.free_slots(), 1);
}

/// A host receive from a GPU sender whose buffer the first fragment's domain cannot register
/// (mid-pipeline: the plan's lane was demoted at the start) reads through receive staging and
/// copies on by the CPU; when the staging cannot be registered either, no path is left: the
/// receive fails, and the fragment goes back to the sender only after the abort.
#[test]
fn a_receive_buffer_registration_failing_mid_pipeline() {
    for staging_fails in [false, true] {
        let mut io = FakeIo::with_slots(2);
        io.demoted.push(LANE);
        let mut rv = pulled(&mut io, MemoryType::Host, SLOT);
        assert!(
            !rv.staged.active(),
            "no lane yet: the first fragment decides"
        );
        io.fail_reg_after = Some(0);
        io.staging_fails = staging_fails;
        let next = rv.on_frag(&mut io, RREQ, frag_in(OTHER, 0, SLOT));
        if staging_fails {
            assert!(
                matches!(&next, StagedNext::Fail(Error::NoMemory(m)) if m.contains("staging")),
                "{next:?}"
            );
            assert!(
                io.ctrls.is_empty(),
                "nothing acknowledged ahead of the abort"
            );
            rv.release_chunks(&mut io);
            assert_eq!(take_acks(&mut io), [(0, SLOT as u64)]);
            assert_eq!(io.free_slots(), 2);
            continue;
        }
        assert_eq!(next, StagedNext::Post);
        assert!(rv.staged.staged_host && rv.staged.lane == OTHER);
        assert!(
            io.counted
                .contains(&"rendezvous receive staged into host memory")
        );
        assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));
        let read = take_steps(&mut io);
        let TokWhat::PullGet {
            rfrag: Some(slot), ..
        } = read[0]
        else {
            panic!("{:?}", read[0])
        };
        assert_eq!(io.free_slots(), 1);
        assert_eq!(
            rv.on_step_done(&mut io, RREQ, read[0], Ok(())),
            StagedNext::Complete
        );
        assert_eq!(io.unstaged, [(slot, DST, SLOT)], "copied on by the CPU");
        assert!(io.steps.is_empty(), "no copy-lane step for host memory");
        assert_eq!(io.free_slots(), 2);
        assert_eq!(take_acks(&mut io), [(0, SLOT as u64)]);
    }
}

/// A host buffer whose first fragment's domain registers it is read into directly: no slot.
#[test]
fn a_registered_host_buffer_is_read_into_directly() {
    let mut io = FakeIo::with_slots(2);
    let mut rv = pulled(&mut io, MemoryType::Host, SLOT + 5);
    assert_eq!(rv.staged.lane, LANE, "registered at the start");
    assert_eq!(io.kept, [(RREQ, false)]);
    rv.on_frag(&mut io, RREQ, frag(0, SLOT));
    rv.on_frag(&mut io, RREQ, frag(1, 5));
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));
    assert_eq!(io.free_slots(), 2);
    let reads = take_steps(&mut io);
    assert_eq!(
        ops(&io.ep),
        [
            (true, DST, SLOT, SENDER),
            (true, DST + SLOT, 5, SENDER + SLOT as u64)
        ]
    );
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, reads[1], Ok(())),
        StagedNext::Wait
    );
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, reads[0], Ok(())),
        StagedNext::Complete
    );
}

/// At the start: a GPU buffer the copy lane cannot register has no other path (the receive
/// fails, nothing is asked of the sender); a zero-copy read whose registration fails falls back
/// to the plan's next step (the staged pipeline).
#[test]
fn registration_failures_at_the_start_follow_the_plan() {
    let mut io = FakeIo::with_slots(2);
    io.fail_reg_after = Some(0);
    let mut rv = RndvRecv::new(PEER, SREQ, 100);
    let steps = [RecvStep::Pull { lane: LANE }];
    let next = rv.start_gpu(
        &mut io,
        RREQ,
        &choice(&steps, &[], true, MemoryType::Cuda, 100),
    );
    assert!(
        matches!(next, StagedNext::Fail(Error::NoMemory(_))),
        "{next:?}"
    );
    assert!(io.ctrls.is_empty());

    let mut io = FakeIo::with_slots(2);
    io.fail_reg_after = Some(0);
    let keys = [key_of(OTHER)];
    let steps = [RecvStep::Get { lane: OTHER }, RecvStep::Pull { lane: LANE }];
    let mut rv = RndvRecv::new(PEER, SREQ, 100);
    let next = rv.start_gpu(
        &mut io,
        RREQ,
        &choice(&steps, &keys, true, MemoryType::Cuda, 100),
    );
    assert_eq!(next, StagedNext::Wait);
    assert!(!rv.via_get && rv.staged.pull);
    assert!(matches!(io.ctrl_msgs(PEER).as_slice(), [Msg::Pull { .. }]));

    // Without the failure: the zero-copy read, its registration first among the request's.
    let mut io = FakeIo::with_slots(2);
    let mut rv = RndvRecv::new(PEER, SREQ, 100);
    let next = rv.start_gpu(
        &mut io,
        RREQ,
        &choice(&steps, &keys, true, MemoryType::Cuda, 100),
    );
    assert_eq!(next, StagedNext::Post);
    assert!(rv.via_get && io.ctrls.is_empty());
    assert_eq!(io.kept, [(RREQ, true)]);
    assert_eq!(io.counted, ["rendezvous receive by read (GPU zero-copy)"]);

    // No step at all: the plan's reason.
    let mut rv = RndvRecv::new(PEER, SREQ, 100);
    let mut c = choice(&[], &[], true, MemoryType::Cuda, 100);
    c.notes = "no copy transport".into();
    let next = rv.start_gpu(&mut io, RREQ, &c);
    assert!(
        matches!(&next, StagedNext::Fail(Error::Unsupported { why, .. }) if why == "no copy transport"),
        "{next:?}"
    );
}

/// A host sender into GPU memory: its write offer is taken when made (RTR with our key), else
/// its buffer is read in fragments through staging (no PULL).
#[test]
fn a_host_sender_writes_or_is_read_in_fragments() {
    let keys = [key_of(LANE)];
    let steps = [
        RecvStep::Put { lane: OTHER },
        RecvStep::StagedRead { lane: LANE },
        RecvStep::Pull { lane: LANE },
    ];
    let want = 2 * SLOT + 1;
    let mut io = FakeIo::with_slots(2);
    io.write_key = Some(key_of(OTHER));
    let mut rv = RndvRecv::new(PEER, SREQ, want);
    let next = rv.start_gpu(
        &mut io,
        RREQ,
        &choice(&steps, &keys, false, MemoryType::Cuda, want),
    );
    assert_eq!(next, StagedNext::Wait);
    assert!(matches!(
        io.ctrl_msgs(PEER).as_slice(),
        [Msg::Rtr { keys, addr, .. }] if keys[0].md == "fake2" && *addr == DST as u64
    ));

    let mut io = FakeIo::with_slots(2);
    let mut rv = RndvRecv::new(PEER, SREQ, want);
    let next = rv.start_gpu(
        &mut io,
        RREQ,
        &choice(&steps, &keys, false, MemoryType::Cuda, want),
    );
    assert_eq!(next, StagedNext::Post);
    assert!(io.ctrls.is_empty() && !rv.staged.pull);
    let lens: Vec<usize> = rv.staged.chunks.iter().map(|c| c.len).collect();
    assert_eq!(lens, [SLOT, SLOT, 1]);
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::NoSlot));
    // Every read lands: the receive acknowledges the reads (ATS) and completes.
    let mut left = 3;
    while left > 0 {
        let reads = take_steps(&mut io);
        for r in reads {
            assert_eq!(rv.on_step_done(&mut io, RREQ, r, Ok(())), StagedNext::Wait);
            let copy = take_steps(&mut io);
            left -= 1;
            let next = rv.on_step_done(&mut io, RREQ, copy[0], Ok(()));
            assert_eq!(next == StagedNext::Complete, left == 0);
        }
        rv.post_chunks(&mut io, RREQ).unwrap();
    }
    assert!(matches!(
        io.ctrl_msgs(PEER).as_slice(),
        [Msg::Ats { ok: true, .. }]
    ));
    assert_eq!(io.free_slots(), 2);
}

/// A copy to the GPU, or a read, failing ends the receive: slots come back at once, the
/// sender's fragments after the abort (`release_chunks`), and a step of the ended receive
/// that completes later gives its slot and fragment back too.
#[test]
fn failed_steps_end_the_receive_and_every_slot_comes_back() {
    let mut io = FakeIo::with_slots(4);
    let mut rv = pulled(&mut io, MemoryType::Cuda, 4 * SLOT);
    for i in 0..4 {
        rv.on_frag(&mut io, RREQ, frag(i, SLOT));
    }
    io.push_back_after = Some(3);
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Later));
    let reads = take_steps(&mut io);
    assert_eq!(reads.len(), 3);
    // Read 0 lands and is copied; read 1 lands but its copy is pushed back.
    rv.on_step_done(&mut io, RREQ, reads[0], Ok(()));
    let copy0 = take_steps(&mut io);
    io.push_back_after = Some(0);
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, reads[1], Ok(())),
        StagedNext::Post
    );
    assert_eq!(take_acks(&mut io), [(0, SLOT as u64), (1, SLOT as u64)]);
    // The copy of read 0 fails.
    let e = Error::io("copying to the GPU", std::io::Error::from_raw_os_error(5));
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copy0[0], Err(e.clone())),
        StagedNext::Fail(e)
    );
    assert!(io.ctrls.is_empty());
    // The worker aborts, then releases what the receive holds: the pending copy's slot, and
    // the fragment still queued (3).
    rv.release_chunks(&mut io);
    assert_eq!(take_acks(&mut io), [(3, SLOT as u64)]);
    assert_eq!(io.free_slots(), 3, "read 2 is still in flight");
    // Read 2 completes for the ended receive.
    step_orphaned(&mut io, reads[2]);
    assert_eq!(take_acks(&mut io), [(2, SLOT as u64)]);
    assert_eq!(io.free_slots(), 4);

    // A failed read, and a failed copy of a mapped fragment.
    let mut io = FakeIo::with_slots(2);
    let mut rv = pulled(&mut io, MemoryType::Cuda, SLOT);
    rv.on_frag(&mut io, RREQ, frag(0, SLOT));
    rv.post_chunks(&mut io, RREQ).unwrap();
    let read = take_steps(&mut io);
    let e = Error::io("reading", std::io::Error::from_raw_os_error(5));
    assert!(matches!(
        rv.on_step_done(&mut io, RREQ, read[0], Err(e)),
        StagedNext::Fail(_)
    ));
    assert_eq!(io.free_slots(), 2);
    assert!(io.ctrls.is_empty());
    rv.release_chunks(&mut io);
    assert_eq!(take_acks(&mut io), [(0, SLOT as u64)]);

    let mut io = FakeIo::with_slots(2);
    io.maps = true;
    let mut rv = pulled(&mut io, MemoryType::Cuda, SLOT);
    rv.on_frag(&mut io, RREQ, frag(0, SLOT));
    rv.post_chunks(&mut io, RREQ).unwrap();
    let copy = take_steps(&mut io);
    assert!(matches!(copy[0], TokWhat::DirectH2D { .. }));
    let e = Error::io("copying", std::io::Error::from_raw_os_error(5));
    assert!(matches!(
        rv.on_step_done(&mut io, RREQ, copy[0], Err(e)),
        StagedNext::Fail(_)
    ));
    rv.release_chunks(&mut io);
    assert_eq!(take_acks(&mut io), [(0, SLOT as u64)]);
    assert_eq!(io.free_slots(), 2);
}

/// A post that fails outright (not a push-back) gives its slot back and reports the error.
#[test]
fn a_failed_post_gives_its_slot_back() {
    let mut io = FakeIo::with_slots(2);
    let mut rv = pulled(&mut io, MemoryType::Cuda, SLOT);
    rv.on_frag(&mut io, RREQ, frag(0, SLOT));
    io.fail_post_after = Some((0, Error::InvalidParam("injected".into())));
    assert!(matches!(
        rv.post_chunks(&mut io, RREQ),
        Err(Error::InvalidParam(_))
    ));
    assert_eq!(io.free_slots(), 2);
    rv.release_chunks(&mut io);
    assert_eq!(take_acks(&mut io), [(0, SLOT as u64)]);
}

/// A sender bigger than the receive: the fragment across the end is read only up to it, the
/// ones past it are handed back unread at once; every acknowledgement carries the whole staged
/// length (the sender counts it against its message).
#[test]
fn truncation_reads_only_what_fits() {
    let mut io = FakeIo::with_slots(4);
    let want = SLOT + 10;
    let mut rv = pulled(&mut io, MemoryType::Cuda, want);
    assert_eq!(rv.on_frag(&mut io, RREQ, frag(2, SLOT)), StagedNext::Wait);
    assert_eq!(
        take_acks(&mut io),
        [(2, SLOT as u64)],
        "past the end: unread"
    );
    assert_eq!(rv.on_frag(&mut io, RREQ, frag(1, SLOT)), StagedNext::Post);
    assert_eq!(rv.on_frag(&mut io, RREQ, frag(0, SLOT)), StagedNext::Post);
    rv.post_chunks(&mut io, RREQ).unwrap();
    let reads = take_steps(&mut io);
    let lens: Vec<usize> = reads
        .iter()
        .map(|r| match r {
            TokWhat::PullGet { len, .. } => *len,
            r => panic!("{r:?}"),
        })
        .collect();
    assert_eq!(lens, [10, SLOT], "clamped to the receive buffer");
    for r in &reads {
        rv.on_step_done(&mut io, RREQ, *r, Ok(()));
    }
    assert_eq!(take_acks(&mut io), [(1, SLOT as u64), (0, SLOT as u64)]);
    let copies = take_steps(&mut io);
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copies[0], Ok(())),
        StagedNext::Wait
    );
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copies[1], Ok(())),
        StagedNext::Complete
    );
    assert!(
        ops(&io.ep)
            .iter()
            .all(|o| o.0 || o.3 + o.2 as u64 <= (DST + want) as u64)
    );
    assert_eq!(io.free_slots(), 4);
}

/// Fragments mapped from a sender on this host that continue one another go to the GPU in one
/// copy, one completion and one acknowledgement covering them all; a gap starts a new run.
#[test]
fn mapped_fragments_are_copied_in_runs() {
    let mut io = FakeIo::with_slots(2);
    io.maps = true;
    let mut rv = pulled(&mut io, MemoryType::Cuda, 5 * SLOT);
    for i in [0, 1, 2, 4] {
        rv.on_frag(&mut io, RREQ, frag(i, SLOT));
    }
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));
    let copies = take_steps(&mut io);
    assert_eq!(copies.len(), 2);
    assert!(
        io.steps.is_empty() && io.free_slots() == 2,
        "no read, no slot"
    );
    assert!(
        matches!(copies[0], TokWhat::DirectH2D { len, sfrag: Some(a) } if len == 3 * SLOT && a.frag == 0 && a.staged == 3 * SLOT)
    );
    assert_eq!(
        ops(&io.ep),
        [
            (false, SENDER as usize, 3 * SLOT, DST as u64),
            (
                false,
                SENDER as usize + 4 * SLOT,
                SLOT,
                (DST + 4 * SLOT) as u64
            )
        ]
    );
    assert_eq!(
        io.counted
            .iter()
            .filter(|c| **c == "staged fragments copied to the GPU in runs")
            .count(),
        1
    );
    rv.on_step_done(&mut io, RREQ, copies[0], Ok(()));
    assert_eq!(take_acks(&mut io), [(0, 3 * SLOT as u64)]);
    rv.on_frag(&mut io, RREQ, frag(3, SLOT));
    rv.post_chunks(&mut io, RREQ).unwrap();
    let last = take_steps(&mut io);
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, copies[1], Ok(())),
        StagedNext::Wait
    );
    assert_eq!(
        rv.on_step_done(&mut io, RREQ, last[0], Ok(())),
        StagedNext::Complete
    );
}

/// Reads wait while their lane is being connected; a key that does not unpack, or a domain no
/// lane reads with, ends the receive.
#[test]
fn a_lane_being_connected_or_missing() {
    let mut io = FakeIo::with_slots(2);
    let mut rv = pulled(&mut io, MemoryType::Cuda, SLOT);
    rv.on_frag(&mut io, RREQ, frag(0, SLOT));
    io.connecting.push(LANE);
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Later));
    assert!(io.steps.is_empty() && io.free_slots() == 2);
    io.connecting.clear();
    assert_eq!(rv.post_chunks(&mut io, RREQ), Ok(Posting::Done));

    let mut io = FakeIo::with_slots(2);
    let mut rv = pulled(&mut io, MemoryType::Cuda, 2 * SLOT);
    io.no_read_lane.push(OTHER);
    let next = rv.on_frag(&mut io, RREQ, frag_in(OTHER, 0, SLOT));
    assert!(
        matches!(&next, StagedNext::Fail(Error::Unsupported { what, .. }) if what.contains("fake2")),
        "{next:?}"
    );
    let mut bad = frag(1, SLOT);
    bad.key.key = crate::proto::fake_io::BAD_KEY.to_vec();
    assert!(matches!(
        rv.on_frag(&mut io, RREQ, bad),
        StagedNext::Fail(Error::InvalidRkey { .. })
    ));
    assert!(io.ctrls.is_empty());
    rv.release_chunks(&mut io);
    assert_eq!(take_acks(&mut io), [(0, SLOT as u64), (1, SLOT as u64)]);
}

/// One staged receive driven by a random schedule (the property test below): fragments of
/// `sizes` arriving in `order`, the receive wanting `want` bytes, a pool of `slots`, and
/// `actions` choosing among: the next fragment arrives, the worker posts, a step in flight
/// completes (the `fail_at`th completion with an error), the transport pushes back.
struct Sched {
    io: FakeIo,
    rv: RndvRecv,
    sizes: Vec<usize>,
    order: Vec<usize>,
    next: usize,
    live: bool,
    outcome: Option<StagedNext>,
    inflight: Vec<TokWhat>,
    completions: usize,
    fail_at: Option<usize>,
}

impl Sched {
    fn handle(&mut self, n: StagedNext) {
        match n {
            StagedNext::Wait | StagedNext::Post => {}
            StagedNext::Complete => {
                self.live = false;
                self.outcome = Some(StagedNext::Complete);
            }
            StagedNext::Fail(e) => {
                // The worker aborts, then the receive lets go of what it holds.
                self.live = false;
                self.outcome = Some(StagedNext::Fail(e));
                self.rv.release_chunks(&mut self.io);
            }
        }
        self.inflight
            .extend(self.io.steps.drain(..).map(|(_, _, w)| w));
    }

    fn deliver(&mut self) -> bool {
        let Some(&f) = self.order.get(self.next) else {
            return false;
        };
        self.next += 1;
        let len = self.sizes[f];
        if self.live {
            let n = self.rv.on_frag(&mut self.io, RREQ, frag(f, len));
            self.handle(n);
        } else {
            // No live receive: the worker hands the fragment back unread.
            super::pipeline_recv::release_unread(&mut self.io, PEER, SREQ, f as u64, len);
        }
        true
    }

    fn post(&mut self) {
        if self.live {
            let n = match self.rv.post_chunks(&mut self.io, RREQ) {
                Ok(_) => StagedNext::Wait,
                Err(e) => StagedNext::Fail(e),
            };
            self.handle(n);
        }
    }

    fn complete(&mut self, i: usize) -> bool {
        if self.inflight.is_empty() {
            return false;
        }
        let w = self.inflight.remove(i % self.inflight.len());
        self.completions += 1;
        let res = if Some(self.completions) == self.fail_at {
            Err(Error::Device {
                device: "fake GPU".into(),
                reason: "injected".into(),
            })
        } else {
            Ok(())
        };
        if self.live {
            let n = self.rv.on_step_done(&mut self.io, RREQ, w, res);
            self.handle(n);
        } else {
            step_orphaned(&mut self.io, w);
        }
        true
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

    /// Whatever the order fragments arrive in, the slots available, push-backs and a failing
    /// step: the receive ends (complete unless a step failed), every byte it wants is written
    /// once from the right place and none past it, every fragment of the sender is handed back
    /// exactly once with its staged length, and every slot is free again.
    #[test]
    fn a_staged_receive_ends_and_accounts_for_everything(
        n in 1usize..10,
        last in 1usize..=SLOT,
        cut in 0.0f64..1.0,
        gpu in proptest::bool::ANY,
        maps in proptest::bool::ANY,
        through_staging in proptest::bool::ANY,
        slots in 1usize..4,
        seed_order in proptest::collection::vec(0usize..1000, 10),
        actions in proptest::collection::vec((0u8..4, 0u8..16), 0..120),
        fail_at in proptest::option::weighted(0.5, 1usize..12),
    ) {
        let sizes: Vec<usize> = (0..n).map(|i| if i + 1 == n { last } else { SLOT }).collect();
        let total: usize = sizes.iter().sum();
        let want = if cut < 0.3 { total } else { 1 + ((total - 1) as f64 * cut) as usize };
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| seed_order[i]);
        let mut io = FakeIo::with_slots(slots);
        io.maps = maps;
        let mem = if gpu { MemoryType::Cuda } else { MemoryType::Host };
        // A host buffer no lane registers (its domain demoted): read through staging, copied
        // on by the CPU.
        let through_staging = through_staging && !gpu;
        if through_staging {
            io.demoted.push(LANE);
        }
        let rv = pulled(&mut io, mem, want);
        let mut s = Sched {
            io, rv, sizes: sizes.clone(), order, next: 0, live: true, outcome: None,
            inflight: Vec::new(), completions: 0, fail_at,
        };
        for (a, x) in actions {
            match a {
                0 => { s.deliver(); }
                1 => s.post(),
                2 => { s.complete(x as usize); }
                _ => s.io.push_back_after = Some(x as usize % 3),
            }
        }
        s.io.push_back_after = None;
        let mut rounds = 0;
        loop {
            rounds += 1;
            proptest::prop_assert!(rounds < 10_000, "no progress");
            if s.deliver() { continue; }
            s.post();
            if !s.complete(0) { break; }
        }
        // Ended: complete, unless a step failed.
        let failed = fail_at.is_some_and(|k| k <= s.completions);
        match &s.outcome {
            Some(StagedNext::Complete) => proptest::prop_assert!(!failed),
            Some(StagedNext::Fail(_)) => proptest::prop_assert!(failed),
            o => proptest::prop_assert!(false, "the receive did not end: {:?}", o),
        }
        // Every fragment handed back once, with its whole staged length.
        let mut acked = vec![false; n];
        for m in s.io.ctrl_msgs(PEER) {
            let Msg::FragAck { frag, len, .. } = m else {
                return Err(proptest::test_runner::TestCaseError::fail(format!("{m:?}")));
            };
            let (mut f, mut left) = (frag as usize, len as usize);
            while left > 0 {
                proptest::prop_assert!(f < n && !acked[f], "fragment {} acknowledged twice", f);
                proptest::prop_assert!(left >= sizes[f]);
                acked[f] = true;
                left -= sizes[f];
                f += 1;
            }
        }
        proptest::prop_assert!(acked.iter().all(|a| *a), "{:?}", acked);
        // Through staging exactly when no lane registers the host buffer.
        proptest::prop_assert!(through_staging || s.io.unstaged.is_empty());
        proptest::prop_assert!(!through_staging || failed || !s.io.unstaged.is_empty());
        proptest::prop_assert_eq!(s.io.free_slots(), slots);
        // What reached the buffer: each wanted byte once, from its own offset; nothing past.
        let mut slot_holds = std::collections::HashMap::new();
        let mut written = vec![0u8; want];
        for (get, local, len, remote) in ops(&s.io.ep) {
            let into = if get {
                let from = (remote - SENDER) as usize;
                if (SLOT_BASE..SLOT_BASE + slots * SLOT).contains(&local) {
                    slot_holds.insert(local, from);
                    continue;
                }
                proptest::prop_assert_eq!(local - DST, from);
                from
            } else {
                let at = remote as usize - DST;
                let from = slot_holds.get(&local).copied().unwrap_or(local.wrapping_sub(SENDER as usize));
                proptest::prop_assert_eq!(from, at, "copied from the wrong place");
                at
            };
            proptest::prop_assert!(into + len <= want, "past the buffer: {}+{} > {}", into, len, want);
            for b in &mut written[into..into + len] { *b += 1; }
        }
        if !failed {
            proptest::prop_assert!(written.iter().all(|w| *w == 1), "bytes written other than once");
        } else {
            proptest::prop_assert!(written.iter().all(|w| *w <= 1), "a byte written twice");
        }
    }
}

/// A GPU sender on our GPU that is the pair's copier: its write offer is taken (RTR with our
/// key, and the read is not made: we never copy); without it (another GPU, no offer, a
/// registration refused: the worker yields no key) the receive reads the sender's buffer, and
/// a host receive never takes the step.
#[test]
fn a_shared_gpu_sender_writes_else_the_receiver_reads() {
    let keys = [key_of(OTHER)];
    let steps = [
        RecvStep::SharedGpuWrite { lane: OTHER },
        RecvStep::Get { lane: OTHER },
        RecvStep::Pull { lane: LANE },
    ];
    let mut io = FakeIo::with_slots(2);
    io.shared_write_key = Some(key_of(OTHER));
    io.write_key = Some(key_of(LANE));
    let mut rv = RndvRecv::new(PEER, SREQ, 100);
    let next = rv.start_gpu(
        &mut io,
        RREQ,
        &choice(&steps, &keys, true, MemoryType::Cuda, 100),
    );
    assert_eq!(next, StagedNext::Wait);
    assert!(!rv.via_get && rv.get.is_none() && !rv.staged.pull);
    assert!(matches!(
        io.ctrl_msgs(PEER).as_slice(),
        [Msg::Rtr { keys, addr, size: 100, offset: 0, .. }]
            if keys.len() == 1 && keys[0].md == "fake2" && *addr == DST as u64
    ));

    for mem in [MemoryType::Cuda, MemoryType::Host] {
        let mut io = FakeIo::with_slots(2);
        io.shared_write_key = (mem == MemoryType::Host).then(|| key_of(OTHER));
        let mut rv = RndvRecv::new(PEER, SREQ, 100);
        let next = rv.start_gpu(&mut io, RREQ, &choice(&steps, &keys, true, mem, 100));
        assert_eq!(next, StagedNext::Post, "{mem}");
        assert!(rv.via_get && io.ctrls.is_empty(), "{mem}");
        assert_eq!(io.counted, ["rendezvous receive by read (GPU zero-copy)"]);
    }
}
