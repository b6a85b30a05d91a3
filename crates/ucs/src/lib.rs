//! rucx-ucs: the services every other rucx layer uses.
//!
//! - [`error`]: the typed [`Error`] and [`RegError`] (registration failures the planner acts on);
//! - [`memtype`]: [`MemoryType`] and [`MemoryTypes`];
//! - [`memory`]: the [`Memory`] trait buffer types implement to be sent and received without
//!   `unsafe`, and its borrowed views [`MemRef`]/[`MemMut`];
//! - [`owned`]: buffers a request may own beyond any scope ([`OwnedBuf`], [`OwnedBufMut`],
//!   [`RawBuf`] for memory by address);
//! - [`config`]: options declared once (name, kind with its range, default, help), read from
//!   `RUCX_*` variables and overridable in code, every value checked when it is read;
//! - [`units`]: memory units (`8K`, `4M`, `inf`, `auto`) and time units (`10us`, `2s`);
//! - [`tls`]: transport selection lists with aliases and negation (`RUCX_TLS`);
//! - [`log`]: logging through `tracing`, level from `RUCX_LOG_LEVEL`;
//! - [`interval`]: an ordered map of non-overlapping half-open intervals;
//! - [`rcache`]: a registration cache (interval map, reference counts, merging, LRU eviction);
//! - [`memtype_cache`]: address range -> memory type and owning GPU;
//! - [`stats`]: small sets of named counters.
//!
//! This crate depends on no other rucx crate.

pub mod config;
pub mod error;
pub mod event;
pub mod interval;
pub mod log;
pub mod memory;
pub mod memtype;
pub mod memtype_cache;
pub mod owned;
pub mod profile;
pub mod rcache;
pub mod stats;
pub mod tls;
pub mod units;

pub use config::{Bounds, Config, OptKind, OptionSpec, OptionValue, Syntax, Ternary};
pub use error::{ClosedBy, Error, IoError, RegError, RegErrorKind, RegScope, Result};
pub use interval::IntervalMap;
pub use memory::{MemMut, MemRef, Memory};
pub use memtype::{MemoryType, MemoryTypes};
pub use memtype_cache::{MemInfo, MemtypeCache};
pub use owned::{OwnedBuf, OwnedBufMut, RawBuf};
pub use rcache::{Rcache, RcacheConfig, RcacheGuard};
pub use units::MemUnits;
