//! Options of the protocol layer.

use rucx_ucs::{Bounds, OptKind, OptionSpec};

/// Protocol-layer options (names without the `RUCX_` prefix).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "RNDV_THRESH",
        kind: OptKind::MemUnits,
        default: "auto",
        help: "Messages of at least this size use the rendezvous protocol; auto derives it from \
               the transports' performance models (on shared memory, not below \
               RNDV_SPLIT_THRESH).",
    },
    OptionSpec {
        name: "ZCOPY_THRESH",
        kind: OptKind::MemUnits,
        default: "auto",
        help: "Eager messages of at least this size are sent zero-copy from a registered buffer; \
               auto derives it from the registration cost.",
    },
    OptionSpec {
        name: "RNDV_SCHEME",
        kind: OptKind::Enum(&["auto", "get_zcopy", "put_zcopy", "am"]),
        default: "auto",
        help: "Rendezvous data movement: the receiver reads (get_zcopy), the sender writes \
               (put_zcopy), or the sender streams active messages (am, no registration needed).",
    },
    OptionSpec {
        name: "RNDV_FRAG_SIZE",
        kind: OptKind::MemIn(Bounds::new(4 << 10, 1 << 30).or_auto()),
        default: "4M",
        help: "Largest single zero-copy operation of a rendezvous transfer (4K to 1G; auto: 4M).",
    },
    OptionSpec {
        name: "RNDV_SPLIT_THRESH",
        kind: OptKind::MemUnits,
        default: "64K",
        help: "Rendezvous reads of at least this size are split: the receiver reads the first half \
               while the sender writes the second, so both sides copy at once (inf: never).",
    },
    OptionSpec {
        name: "RNDV_FRAG_COUNT",
        kind: OptKind::UintIn(Bounds::new(1, 1024)),
        default: "8",
        help: "Pinned host staging fragments of RNDV_FRAG_SIZE for GPU memory pipelines, per \
               direction (sends and receives each get this many; 1 to 1024). Left unset, small \
               fragments get more (32 MiB in flight per direction, at most 8192 fragments). \
               Staging lives in host memory, so it never uses a GPU's BAR1 aperture.",
    },
    OptionSpec {
        name: "RNDV_STAGING_AHEAD",
        kind: OptKind::Bool,
        default: "y",
        help: "With a copy transport (cuda_copy) open, allocate and page-lock the staging \
               fragments (2 x RNDV_FRAG_COUNT x RNDV_FRAG_SIZE of host memory) on a helper thread \
               when the worker first meets GPU memory, so that the first transfer needing them \
               (e.g. one that demotes a zero-copy GPU path) does not wait tens of milliseconds \
               (n: on first use). A worker that only moves host memory makes none.",
    },
    OptionSpec {
        name: "PROTO_INFO",
        kind: OptKind::Bool,
        default: "n",
        help: "Print the protocol selection table of every endpoint when it is created.",
    },
    OptionSpec {
        name: "REG_SKIP",
        kind: OptKind::List,
        default: "",
        help: "Memory domains not to use for registering a memory type, as md:memtype pairs \
               (e.g. posix:host, cuda_ipc:cuda); the planner treats them as demoted from the \
               start, without trying.",
    },
    OptionSpec {
        name: "PEER_TIMEOUT",
        kind: OptKind::TimeIn(Bounds::millis(10, u64::MAX / 1_000_000).or_inf()),
        default: "inf",
        help: "Requests bound to a peer (sends, matched receives, rendezvous, flushes and \
               remote memory access) fail with an endpoint failure once that peer has answered \
               nothing for this long: no message, and no answer to the keepalive probes sent \
               to it after a quarter of this silence (10ms or more, or inf: never). A peer \
               answers probes whenever it calls into rucx; one that computes for longer without \
               doing so looks exactly like a frozen one, hence the default inf. Receives not \
               matched to a peer yet never time out.",
    },
    OptionSpec {
        name: "PROC_CHECK_INTERVAL",
        kind: OptKind::TimeIn(Bounds::millis(10, 3_600_000).or_inf()),
        default: "500ms",
        help: "How often a worker looks up the processes of its peers on this host (same kernel                and pid namespace) from progress: a peer process that exited or was killed fails                its endpoint (error handler, requests bound to it) even when nothing is in                flight (10ms to 1h, or inf: never).",
    },
];
