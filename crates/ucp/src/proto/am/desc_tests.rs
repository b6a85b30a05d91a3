//! The payload descriptor's fetch and release over a fake ([`AmIo`]), and an inline payload
//! copied into a buffer over the fake copy lane.

use std::sync::Arc;

use super::*;
use crate::proto::memcopy::fake::{CopyFake, gpu};

const ME: u64 = 0x11;
const THEM: u64 = 0x22;
const PEER: usize = 4;
const SREQ: u64 = 0x77;
const LEN: usize = 5000;

/// The worker as a descriptor sees it: endpoints by worker id, memory types, and what it was
/// asked to do.
#[derive(Default)]
struct AmFake {
    uuid: u64,
    peers: Vec<(u64, usize)>,
    /// The memory type detection gives, or fails.
    detected: Option<(MemoryType, Option<u32>)>,
    /// Peers that failed: aborts to them are not sent.
    failed: Vec<usize>,
    aborts: Vec<(usize, u64, String)>,
    fetches: Vec<(MemRegion, u16, Unexp)>,
    counted: Vec<&'static str>,
}

impl AmFake {
    fn new() -> AmFake {
        AmFake {
            uuid: ME,
            peers: vec![(THEM, PEER)],
            detected: Some((MemoryType::Host, None)),
            ..AmFake::default()
        }
    }
}

impl AmIo for AmFake {
    fn uuid(&self) -> u64 {
        self.uuid
    }

    fn peer_of(&self, uuid: u64) -> Option<usize> {
        self.peers.iter().find(|(u, _)| *u == uuid).map(|(_, p)| *p)
    }

    fn detect(&self, addr: usize, len: usize) -> Result<(MemoryType, Option<u32>)> {
        self.detected.ok_or_else(|| {
            Error::InvalidParam(format!("injected: {len} bytes at {addr:#x} are nobody's"))
        })
    }

    fn abort_send(&mut self, p: usize, sreq: u64, reason: &str) {
        if !self.failed.contains(&p) {
            self.aborts.push((p, sreq, reason.to_string()));
        }
    }

    fn fetch_into(&mut self, buf: MemRegion, id: u16, rts: Unexp) -> u64 {
        self.fetches.push((buf, id, rts));
        1000 + self.fetches.len() as u64
    }

    fn count(&mut self, what: &'static str) {
        self.counted.push(what);
    }
}

fn key() -> NamedKey {
    NamedKey {
        md: "fake1".into(),
        key: vec![1, 2, 3],
    }
}

/// A descriptor of peer `THEM`'s send `SREQ` handed out by worker `ME`.
fn desc(rel: &Arc<AmReleases>) -> AmRemoteData {
    AmRemoteData {
        len: LEN,
        smem: 1,
        sender: EpId::from_parts(PEER, 1),
        id: 9,
        worker: ME,
        peer: THEM,
        sreq: SREQ,
        addr: 0xabc0,
        keys: vec![key()],
        releases: Some(rel.clone()),
    }
}

/// Release what was dropped, through `io`.
fn release_all(rel: &AmReleases, io: &mut AmFake) {
    for r in rel.take() {
        r.release(io);
    }
}

/// A fetch makes a receive of the buffer's capacity that takes the sender's rendezvous (the
/// whole payload, wherever it is): into a larger buffer, and into a smaller one (the
/// rendezvous receive fills it and ends `Truncated`). A fetched descriptor dropped releases
/// nothing.
#[test]
fn a_fetch_hands_the_rendezvous_to_a_receive_of_the_buffer() {
    for cap in [LEN + 100, 100] {
        let rel = Arc::new(AmReleases::default());
        let mut io = AmFake::new();
        let mut d = desc(&rel);
        let rid = d.fetch(&mut io, (0x9000, cap, None)).unwrap();
        assert_eq!(rid, 1001);
        let (buf, id, rts) = &io.fetches[0];
        assert_eq!(
            (buf.addr, buf.len, buf.mem_type),
            (0x9000, cap, MemoryType::Host)
        );
        assert_eq!(*id, 9);
        match rts {
            Unexp::Rts {
                src,
                sreq,
                size,
                addr,
                smem,
                keys,
            } => {
                assert_eq!(
                    (*src, *sreq, *size, *addr, *smem),
                    (PEER, SREQ, LEN, 0xabc0, 1)
                );
                assert_eq!(keys, &[key()]);
            }
            _ => panic!("not a rendezvous"),
        }
        assert_eq!(io.counted, ["active message payload fetched"]);
        drop(d);
        assert!(!rel.pending(), "a fetched payload released its sender");
        assert!(io.aborts.is_empty());
    }
    // The memory type the caller names is taken as it is.
    let rel = Arc::new(AmReleases::default());
    let mut io = AmFake::new();
    io.detected = None;
    let mut d = desc(&rel);
    d.fetch(&mut io, (0x9000, 10, Some((MemoryType::Cuda, Some(1)))))
        .unwrap();
    let want = MemRegion {
        device: Some(1),
        ..gpu(0x9000, 10)
    };
    assert_eq!(io.fetches[0].0, want);
}

/// A descriptor dropped unfetched releases its sender at the worker's next progress: the send
/// ends with `PeerAborted` saying the handler dropped it. A release for another worker, or of
/// a sender no longer an endpoint, is dropped; one to a failed peer sends nothing.
#[test]
fn a_dropped_descriptor_aborts_the_send() {
    let rel = Arc::new(AmReleases::default());
    let mut io = AmFake::new();
    drop(desc(&rel));
    assert!(rel.pending());
    release_all(&rel, &mut io);
    assert!(!rel.pending());
    let [(p, sreq, reason)] = io.aborts.as_slice() else {
        panic!("{:?}", io.aborts)
    };
    assert_eq!((*p, *sreq), (PEER, SREQ));
    assert!(
        reason.contains("dropped") && reason.contains("5000-byte"),
        "{reason}"
    );
    assert_eq!(io.counted, ["active message payload dropped unfetched"]);

    let mut other = AmFake::new();
    other.uuid = 0x99;
    drop(desc(&rel));
    release_all(&rel, &mut other);
    let mut gone = AmFake::new();
    gone.peers.clear();
    drop(desc(&rel));
    release_all(&rel, &mut gone);
    let mut failed = AmFake::new();
    failed.failed = vec![PEER];
    drop(desc(&rel));
    release_all(&rel, &mut failed);
    assert!(other.aborts.is_empty() && gone.aborts.is_empty() && failed.aborts.is_empty());
}

/// A descriptor is fetched once: a second fetch is refused and makes no second receive.
#[test]
fn a_descriptor_fetched_twice_is_refused() {
    let rel = Arc::new(AmReleases::default());
    let mut io = AmFake::new();
    let mut d = desc(&rel);
    d.fetch(&mut io, (0x9000, 100, None)).unwrap();
    let r = d.fetch(&mut io, (0xa000, 100, None));
    assert!(
        matches!(&r, Err(Error::InvalidParam(m)) if m.contains("already fetched")),
        "{r:?}"
    );
    assert_eq!(io.fetches.len(), 1);
    drop(d);
    assert!(!rel.pending());
}

/// Refused before it is fetched (another worker's descriptor, a sender no longer an
/// endpoint): an error, no receive, and the descriptor still releases its sender when dropped.
#[test]
fn a_refused_fetch_leaves_the_descriptor_to_release_its_sender() {
    let rel = Arc::new(AmReleases::default());
    let mut io = AmFake::new();
    io.uuid = 0x99;
    let mut d = desc(&rel);
    let r = d.fetch(&mut io, (0x9000, 100, None));
    assert!(
        matches!(&r, Err(Error::InvalidParam(m)) if m.contains("another worker")),
        "{r:?}"
    );
    let mut gone = AmFake::new();
    gone.peers.clear();
    let r = d.fetch(&mut gone, (0x9000, 100, None));
    assert!(
        matches!(&r, Err(Error::InvalidParam(m)) if m.contains("no longer")),
        "{r:?}"
    );
    assert!(io.fetches.is_empty() && gone.fetches.is_empty());
    drop(d);
    let mut mine = AmFake::new();
    release_all(&rel, &mut mine);
    assert_eq!(mine.aborts.len(), 1);
}

/// A buffer whose memory type cannot be told: the fetch fails with that error and the send is
/// aborted at once (the descriptor is spent: dropping it releases nothing more). When the
/// sender failed meanwhile, nothing is sent to it and the fetch still fails.
#[test]
fn a_refused_buffer_aborts_the_send() {
    let rel = Arc::new(AmReleases::default());
    let mut io = AmFake::new();
    io.detected = None;
    let mut d = desc(&rel);
    let r = d.fetch(&mut io, (0x9000, 100, None));
    assert!(matches!(r, Err(Error::InvalidParam(_))), "{r:?}");
    let [(p, sreq, reason)] = io.aborts.as_slice() else {
        panic!("{:?}", io.aborts)
    };
    assert_eq!((*p, *sreq), (PEER, SREQ));
    assert!(reason.contains("buffer was refused"), "{reason}");
    assert!(io.fetches.is_empty());
    drop(d);
    assert!(!rel.pending());

    let mut io = AmFake::new();
    io.detected = None;
    io.failed = vec![PEER];
    let mut d = desc(&rel);
    assert!(d.fetch(&mut io, (0x9000, 100, None)).is_err());
    assert!(io.aborts.is_empty() && io.fetches.is_empty());
    drop(d);
    assert!(!rel.pending());
}

// ----- inline payloads -----

/// An inline payload into host memory: copied whole into a larger buffer; into a smaller one,
/// the bytes that fit and `Truncated`, nothing written past the buffer.
#[test]
fn an_inline_payload_into_host_memory() {
    let data: Vec<u8> = (0..300).map(|i| i as u8).collect();
    let mut io = CopyFake::new(64, 1000, 1);
    let host = MemRegion::host(0x9000, 500);
    assert_eq!(copy_here(&mut io, &data, host).unwrap(), 300);
    assert_eq!(io.bytes(0x9000, 300), data);
    assert!(!io.touched(0x9000 + 300, 200));

    let mut io = CopyFake::new(64, 1000, 1);
    let r = copy_here(&mut io, &data, MemRegion::host(0x9000, 100));
    assert!(
        matches!(
            r,
            Err(Error::Truncated {
                incoming: 300,
                capacity: 100,
                tag: None,
            })
        ),
        "{r:?}"
    );
    assert_eq!(io.bytes(0x9000, 100), data[..100]);
    assert!(!io.touched(0x9000 + 100, 300));
    assert!(io.moves.is_empty(), "host memory is copied by the CPU");
}

/// An inline payload into GPU memory goes by the copy lane in short pieces (registered for the
/// copy, released after); truncated the same way; a buffer the copy lane refuses is the error.
#[test]
fn an_inline_payload_into_gpu_memory() {
    let data: Vec<u8> = (0..300).map(|i| (i * 3) as u8).collect();
    let mut io = CopyFake::new(64, 1000, 1);
    io.push_back = vec![1];
    let r = copy_here(&mut io, &data, gpu(0x9000, 250));
    assert!(matches!(r, Err(Error::Truncated { .. })), "{r:?}");
    assert_eq!(io.bytes(0x9000, 250), data[..250]);
    assert!(!io.touched(0x9000 + 250, 100));
    assert!(
        io.moves
            .iter()
            .all(|m| m.kind == "put_short" && m.len <= 64)
    );
    assert_eq!((io.regs.len(), io.live_regs()), (1, 0));

    let mut io = CopyFake::new(64, 1000, 1);
    io.refuse_reg = true;
    let r = copy_here(&mut io, &data, gpu(0x9000, 500));
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    assert!(!io.touched(0x9000, 500));
}

// ----- GPU payloads copied in -----

/// A GPU payload the plan copies in is copied out to host memory; when the copy lane refuses
/// its buffer (demoted) or no staging fragment is free, the table's rendezvous carries it, and
/// without one the send ends with the refusal.
#[test]
fn a_gpu_payload_copied_out_or_sent_by_rendezvous() {
    let data: Vec<u8> = (0..5000).map(|i| (i * 5) as u8).collect();
    let mut io = CopyFake::new(64, 4096, 1);
    io.rndv_row = Some(Proto::RndvGet);
    io.fill(0x9000, &data);
    match gpu_copy_out(&mut io, 0, 9, gpu(0x9000, 5000)).unwrap() {
        CopiedOut::Host(h) => assert_eq!(h, data),
        CopiedOut::Instead(p) => panic!("{p:?}"),
    }

    io.refuse_reg = true;
    match gpu_copy_out(&mut io, 0, 9, gpu(0x9000, 5000)).unwrap() {
        CopiedOut::Instead(p) => assert_eq!(p, Proto::RndvGet),
        CopiedOut::Host(_) => panic!("copied"),
    }
    io.refuse_reg = false;
    io.free.clear();
    assert!(matches!(
        gpu_copy_out(&mut io, 0, 9, gpu(0x9000, 10)),
        Ok(CopiedOut::Instead(Proto::RndvGet))
    ));

    io.rndv_row = None;
    io.refuse_reg = true;
    let r = gpu_copy_out(&mut io, 0, 9, gpu(0x9000, 10));
    assert!(matches!(r, Err(Error::Unsupported { .. })));
}
