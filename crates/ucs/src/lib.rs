//! rucx-ucs: the services every other rucx layer uses.
//!
//! - [`error`]: the typed [`Error`] and [`RegError`] (registration failures the planner acts on);
//! - [`memtype`]: [`MemoryType`] and [`MemoryTypes`];
//! - [`config`]: options declared once (name, kind, default, help), read from `RUCX_*` variables
//!   and overridable in code;
//! - [`units`]: memory units (`8K`, `4M`, `inf`, `auto`) and time units (`10us`, `2s`);
//! - [`tls`]: transport selection lists with aliases and negation (`RUCX_TLS`);
//! - [`log`]: logging through `tracing`, level from `RUCX_LOG_LEVEL`;
//! - [`rcache`]: a registration cache (interval map, reference counts, merging, LRU eviction).
//!
//! This crate depends on no other rucx crate.

pub mod config;
pub mod error;
pub mod log;
pub mod memtype;
pub mod rcache;
pub mod tls;
pub mod units;

pub use config::{Config, OptKind, OptionSpec, Ternary};
pub use error::{Error, RegError, RegErrorKind, Result};
pub use memtype::{MemoryType, MemoryTypes};
pub use units::MemUnits;
