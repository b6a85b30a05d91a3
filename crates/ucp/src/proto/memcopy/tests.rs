//! The copy protocols over the fake copy lane ([`CopyFake`]): GPU buffers copied to host memory
//! through a staging fragment, host bytes copied into GPU memory in short pieces, and stream
//! receives landing in GPU memory through a window's slots.

use std::sync::Arc;

use proptest::prelude::*;
use rucx_ucs::Error;
use rucx_uct::{MemHandle, MemRegion};

use super::copy_io::BounceIo;
use super::fake::{CopyFake, FRAG_BASE, copy_error, gpu};
use super::state::*;
use crate::proto::rma::STAGED_FRAGS;

/// A GPU buffer, and a host window, of the fake.
const G: usize = 0x1000_0000;
const W: usize = 0x2000_0000;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

// ----- GPU to host -----

/// A GPU buffer comes to host memory in staging-fragment pieces, each copied into a fragment,
/// waited for and read out; the fragment goes back after each piece (one fragment suffices)
/// and so does each piece's registration.
#[test]
fn a_gpu_buffer_comes_to_host_in_fragments() {
    let mut io = CopyFake::new(64, 4096, 1);
    io.poll_delay = 2;
    let data = pattern(10_000, 1);
    io.fill(G, &data);
    let out = gpu_to_host(&mut io, gpu(G, data.len())).unwrap();
    assert_eq!(out, data);
    let pieces: Vec<_> = io.moves.iter().map(|m| (m.kind, m.from, m.len)).collect();
    assert_eq!(
        pieces,
        [
            ("get_zcopy", G, 4096),
            ("get_zcopy", G + 4096, 4096),
            ("get_zcopy", G + 8192, 10_000 - 8192)
        ]
    );
    assert!(io.moves.iter().all(|m| m.to == FRAG_BASE));
    assert_eq!((io.free.len(), io.live_regs(), io.regs.len()), (1, 0, 3));
    assert_eq!(io.counted, ["GPU buffer copied to host"]);
}

/// A copy the lane pushes back is posted again after progress: every byte arrives once.
#[test]
fn a_pushed_back_copy_out_is_posted_again() {
    let mut io = CopyFake::new(64, 1000, 2);
    io.push_back = vec![1, 2];
    let data = pattern(2500, 2);
    io.fill(G, &data);
    assert_eq!(gpu_to_host(&mut io, gpu(G, 2500)).unwrap(), data);
    assert_eq!(io.moves.len(), 3);
    assert!(io.polls >= 5, "progressed while pushed back: {}", io.polls);
    assert_eq!((io.free.len(), io.live_regs()), (2, 0));
}

/// A copy that fails, or a post that fails, ends the copy with its error; the fragment and the
/// registrations go back.
#[test]
fn a_failed_copy_out_gives_everything_back() {
    let mut io = CopyFake::new(64, 1000, 2);
    io.fail_copy = vec![1];
    io.fill(G, &pattern(3000, 3));
    let r = gpu_to_host(&mut io, gpu(G, 3000));
    assert!(matches!(r, Err(Error::Device { .. })), "{r:?}");
    assert_eq!((io.moves.len(), io.free.len(), io.live_regs()), (2, 2, 0));

    let mut io = CopyFake::new(64, 1000, 2);
    io.fail_post = Some((1, copy_error()));
    let r = gpu_to_host(&mut io, gpu(G, 3000));
    assert!(matches!(r, Err(Error::Device { .. })), "{r:?}");
    assert_eq!((io.free.len(), io.live_regs()), (2, 0));
}

/// The copy lane's domain refusing the GPU buffer (demoted), the staging that cannot be made,
/// and every fragment in use: a typed error, nothing copied, nothing held.
#[test]
fn refusals_copy_nothing_and_hold_nothing() {
    let mut io = CopyFake::new(64, 1000, 1);
    io.refuse_reg = true;
    let r = gpu_to_host(&mut io, gpu(G, 100));
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");

    let mut io = CopyFake::new(64, 1000, 1);
    io.staging_fails = true;
    let r = gpu_to_host(&mut io, gpu(G, 100));
    assert!(matches!(r, Err(Error::NoMemory(_))), "{r:?}");

    let mut io = CopyFake::new(64, 1000, 1);
    let held = io.take_bounce().unwrap();
    let r = gpu_to_host(&mut io, gpu(G, 100));
    assert!(matches!(r, Err(Error::NoResource(_))), "{r:?}");
    assert_eq!(io.live_regs(), 0);
    io.release_bounce(held.0);

    // Larger than a fragment: refused, the fragment back.
    let r = bounce_out(&mut io, gpu(G, 1001));
    assert!(matches!(r, Err(Error::InvalidParam(_))), "{r:?}");
    assert_eq!((io.free.len(), io.live_regs()), (1, 0));
    assert!(io.moves.is_empty());

    // Empty: nothing asked of the lane.
    let mut io = CopyFake::new(64, 1000, 1);
    io.staging_fails = true;
    assert_eq!(gpu_to_host(&mut io, gpu(G, 0)).unwrap(), Vec::<u8>::new());
    assert!(io.regs.is_empty());
}

// ----- host to GPU -----

/// Host bytes go into GPU memory in `put_short` pieces of at most the lane's size, in order;
/// a piece pushed back is posted again (not skipped, not doubled); the registration is made
/// once and released.
#[test]
fn host_bytes_go_to_gpu_in_short_pieces() {
    let mut io = CopyFake::new(100, 1000, 1);
    io.push_back = vec![3];
    let data = pattern(1050, 4);
    host_to_gpu(&mut io, gpu(G, 1050), &data).unwrap();
    assert_eq!(io.bytes(G, 1050), data);
    assert_eq!(io.moves.len(), 11);
    let mut at = G;
    for m in &io.moves {
        assert_eq!((m.kind, m.to), ("put_short", at));
        assert!(m.len <= 100);
        at += m.len;
    }
    assert_eq!((io.regs.len(), io.live_regs()), (1, 0));

    // Step by step: a push-back says so, and the next call goes on where it stopped.
    let mut io = CopyFake::new(100, 1000, 1);
    io.push_back = vec![2];
    let (_g, key) = super::copy_io::CopyIo::copy_key(&mut io, gpu(G, 450)).unwrap();
    let data = pattern(450, 5);
    let mut c = ShortCopy::new(&data, G);
    assert!(!c.post(&mut io, &key).unwrap());
    assert_eq!(io.moves.len(), 2);
    assert!(c.post(&mut io, &key).unwrap());
    assert_eq!(io.moves.len(), 5);
    assert_eq!(io.bytes(G, 450), data);
}

/// Nothing to copy asks nothing; a refused registration writes nothing.
#[test]
fn host_to_gpu_refusals() {
    let mut io = CopyFake::new(100, 1000, 1);
    io.refuse_reg = true;
    host_to_gpu(&mut io, gpu(G, 0), &[]).unwrap();
    let r = host_to_gpu(&mut io, gpu(G, 10), &[1; 10]);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    assert!(io.moves.is_empty() && !io.touched(G, 10));
}

/// Eager bytes into a GPU receive: the buffer is registered on the first bytes and kept for
/// the next; bytes past the capacity are not written (truncation).
#[test]
fn eager_bytes_register_once_and_stop_at_the_capacity() {
    let mut io = CopyFake::new(64, 1000, 1);
    let mut reg = None;
    let data = pattern(400, 6);
    let buf = gpu(G, 300);
    eager_to_gpu(&mut io, &mut reg, buf, 0, &data[..200]).unwrap();
    assert!(reg.is_some());
    eager_to_gpu(&mut io, &mut reg, buf, 200, &data[200..]).unwrap();
    assert_eq!(io.regs, [buf]);
    assert_eq!(io.bytes(G, 300), data[..300]);
    assert!(!io.touched(G + 300, 200), "written past the capacity");
    drop(reg);
    assert_eq!(io.live_regs(), 0);

    let mut io = CopyFake::new(64, 1000, 1);
    io.refuse_reg = true;
    let mut reg = None;
    let r = eager_to_gpu(&mut io, &mut reg, buf, 0, &data[..10]);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    assert!(reg.is_none() && !io.touched(G, 300));
}

/// A stream receive into GPU memory: registered first (a refusal is told before any host
/// buffer is made), then a zeroed host buffer of the capacity.
#[test]
fn a_stream_bounce_registers_first() {
    let mut io = CopyFake::new(64, 1000, 1);
    let (b, _k) = stream_bounce(&mut io, gpu(G, 777)).unwrap();
    assert_eq!(b, vec![0; 777]);
    assert_eq!(io.regs, [gpu(G, 777)]);
    io.refuse_reg = true;
    assert!(stream_bounce(&mut io, gpu(G, 777)).is_err());
}

// ----- stream receives landing in GPU memory -----

fn window() -> MemHandle {
    MemHandle::new(MemRegion::host(W, 1 << 20), "fakecopy", Arc::new(()))
}

/// Drive landing `l` to completion: pump, then hand over the completions in flight in the
/// order `pick` chooses, pumping after each, until it completes. Every copy posted reads a slot
/// no other copy in flight reads. Returns the pumps that were pushed back.
fn drive(
    io: &mut CopyFake,
    l: &mut LandState,
    key: &rucx_uct::RemoteKey,
    mut pick: impl FnMut(usize) -> usize,
) -> usize {
    let memh = window();
    let slots = Slots {
        base: W,
        memh: &memh,
    };
    let mut later = 0;
    for _ in 0..100_000 {
        match l.pump(io, 1, (G, key), &slots).unwrap() {
            LandNext::Complete => return later,
            LandNext::Later => later += 1,
            LandNext::Wait => {}
        }
        let mut from: Vec<_> = io.in_flight.iter().map(|(_, _, m, _)| m.from).collect();
        from.sort();
        from.dedup();
        assert_eq!(from.len(), io.in_flight.len(), "two copies read one slot");
        assert!(io.in_flight.len() <= STAGED_FRAGS);
        if !io.in_flight.is_empty() {
            let k = pick(io.in_flight.len());
            let t = io.in_flight[k].1;
            assert_eq!(io.complete(t), (Some(1), false));
            l.on_copies_done(|t| io.is_in_flight(t));
        }
    }
    panic!("the landing never completed");
}

/// A full receive lands through every slot at once, then slot by slot as copies complete (in
/// any order); every byte reaches its place in GPU memory.
#[test]
fn a_landing_receive_fills_the_slots_and_goes_on_as_copies_complete() {
    let frag = 1000;
    let cap = frag * (STAGED_FRAGS + 2) + 5;
    let data = pattern(cap, 7);
    let mut io = CopyFake::new(64, frag, 1);
    let (_g, key) = super::copy_io::CopyIo::copy_key(&mut io, gpu(G, cap)).unwrap();
    let mut l = LandState::new(3, data.clone(), frag);
    let memh = window();
    let slots = Slots {
        base: W,
        memh: &memh,
    };
    assert_eq!(
        l.pump(&mut io, 1, (G, &key), &slots).unwrap(),
        LandNext::Wait
    );
    assert_eq!(io.in_flight.len(), STAGED_FRAGS, "every slot in use");
    assert_eq!(l.landed(), 0);
    // The last one completes first.
    assert_eq!(drive(&mut io, &mut l, &key, |n| n - 1), 0);
    assert_eq!(l.landed(), cap);
    assert_eq!(io.bytes(G, cap), data);
    assert_eq!(io.moves.len(), cap.div_ceil(frag));
    assert!(!io.touched(G + cap, frag), "written past the receive");
}

/// The copy lane pushing back: the receive says so and goes on where it stopped.
#[test]
fn a_pushed_back_landing_copy_is_posted_again() {
    let data = pattern(5000, 8);
    let mut io = CopyFake::new(64, 1000, 1);
    io.push_back = vec![0, 2, 5];
    let (_g, key) = super::copy_io::CopyIo::copy_key(&mut io, gpu(G, 5000)).unwrap();
    let mut l = LandState::new(0, data.clone(), 1000);
    assert_eq!(drive(&mut io, &mut l, &key, |_| 0), 3);
    assert_eq!(io.bytes(G, 5000), data);
    assert_eq!(io.moves.len(), 5);
}

/// Copies done on return (no completion to wait for) complete the receive in one pump; a
/// failed post is the receive's error.
#[test]
fn landing_copies_done_at_once_or_failing() {
    let data = pattern(3500, 9);
    let mut io = CopyFake::new(64, 1000, 1);
    io.at_once = true;
    let (_g, key) = super::copy_io::CopyIo::copy_key(&mut io, gpu(G, 3500)).unwrap();
    let mut l = LandState::new(0, data.clone(), 1000);
    let memh = window();
    let slots = Slots {
        base: W,
        memh: &memh,
    };
    assert_eq!(
        l.pump(&mut io, 1, (G, &key), &slots).unwrap(),
        LandNext::Complete
    );
    assert_eq!(io.bytes(G, 3500), data);

    let mut io = CopyFake::new(64, 1000, 1);
    io.fail_post = Some((1, copy_error()));
    let mut l = LandState::new(0, data, 1000);
    let r = l.pump(&mut io, 1, (G, &key), &slots);
    assert!(matches!(r, Err(Error::Device { .. })), "{r:?}");
}

proptest! {
    /// Whatever the receive's size, the slot size, the push-backs and the order completions
    /// come in: every byte lands once, in place, no slot is reused while read.
    #[test]
    fn landing_any_size_any_order(
        cap in 1usize..20_000,
        frag in 1usize..3000,
        pushes in proptest::collection::vec(0usize..40, 0..6),
        order in proptest::collection::vec(0usize..100, 1..64),
    ) {
        let data = pattern(cap, 10);
        let mut io = CopyFake::new(64, frag, 1);
        io.push_back = pushes;
        let (_g, key) = super::copy_io::CopyIo::copy_key(&mut io, gpu(G, cap)).unwrap();
        let mut l = LandState::new(0, data.clone(), frag);
        let mut i = 0;
        drive(&mut io, &mut l, &key, |n| {
            i += 1;
            order[i % order.len()] % n
        });
        prop_assert_eq!(io.bytes(G, cap), data);
        prop_assert!(!io.touched(G + cap, frag));
        prop_assert_eq!(io.moves.len(), cap.div_ceil(frag));
    }

    /// Whatever the buffer's size, the fragment size, push-backs and how long copies take: the
    /// host copy is the GPU buffer, and nothing stays held.
    #[test]
    fn gpu_to_host_any_size(
        len in 0usize..20_000,
        frag in 1usize..5000,
        pushes in proptest::collection::vec(0usize..20, 0..4),
        delay in 0usize..3,
    ) {
        let data = pattern(len, 11);
        let mut io = CopyFake::new(64, frag, 2);
        io.push_back = pushes;
        io.poll_delay = delay;
        io.fill(G, &data);
        prop_assert_eq!(gpu_to_host(&mut io, gpu(G, len)).unwrap(), data);
        prop_assert_eq!((io.free.len(), io.live_regs()), (2, 0));
        prop_assert_eq!(io.moves.len(), len.div_ceil(frag));
    }
}
