//! rucx-uct: the transport API.
//!
//! A [`Component`] probes the host and opens [`MemoryDomain`]s; a domain registers memory
//! ([`MemHandle`]), packs and unpacks remote keys ([`RemoteKey`]) and opens [`Iface`]s, one per
//! transport and device; an interface creates [`Endpoint`]s to peers and delivers [`Event`]s
//! when progressed. Everything a protocol layer needs to choose among transports is in the
//! attributes ([`MdAttr`], [`IfaceAttr`]).
//!
//! Also here: the [`Registry`] of compiled-in components, the common envelope for packed keys
//! ([`rkey`]), a fault-injection wrapper for any domain ([`fault`]), a conformance suite that
//! every transport runs ([`conformance`]), and the addresses of transports that reach only their
//! own process ([`local`]).
//!
//! Depends only on `rucx-ucs`.

pub mod attr;
pub mod component;
pub mod conformance;
pub mod fault;
pub mod iface;
pub mod local;
pub mod md;
pub mod rkey;

pub use attr::{
    DeviceType, IfaceAttr, IfaceCaps, IfaceLimits, LinearCost, MdAttr, MemTypeFlags, PerfModel,
};
pub use component::{Availability, Component, Discovery, Registry};
pub use iface::{AmId, Endpoint, EpParams, Event, EventSource, Iface, IfaceParams, Iov, OpStatus};
pub use md::{AllocId, MemHandle, MemRegion, MemoryDomain, RemoteKey, SharedAlloc, TlResource};

use rucx_ucs::{OptKind, OptionSpec};

/// Options of the transport layer.
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "TLS",
        kind: OptKind::Tls,
        default: "all",
        help: "Transports to use: a comma-separated list of names (self, posix, tcp, cuda_copy, \
               cuda_ipc, gdr_copy, rc_verbs) or aliases (sm, cuda, ib, all); a leading ^ excludes \
               the listed ones.",
    },
    OptionSpec {
        name: fault::OPTION,
        kind: OptKind::Str,
        default: "",
        help: "Fail memory registrations on purpose, for testing demotion: rules separated by ';', \
               each md=NAME[,mem=TYPE][,after=N[,times=N]][,budget=SIZE][,kind=bad_address|aperture|\
               not_exportable|no_memory] (times=N: fail only N registrations after the first \
               `after`, then let them succeed again).",
    },
];
