//! rucx-perftest: latency and bandwidth of rucx between two processes, with the conventions of
//! `ucx_perftest` (tests, flags, columns), an OSU-style sweep drawn as SVG, and
//! `rucx-bench-compare`, which runs it against UCX's `ucx_perftest` on the same machine.
//!
//! - [`args`]: the command line;
//! - [`run`]: the job of two (server rank 0, client rank 1) and one loop per test;
//! - [`stats`] and [`report`]: figures, the table, CSV and JSON;
//! - [`mem`]: host and GPU buffers (`-m`), and the GPU copy bounds (`--bounds`);
//! - [`plot`]: SVG plots;
//! - [`cli`]: the `rucx-perftest` program; [`compare`]: the `rucx-bench-compare` program.

pub mod args;
pub mod cli;
pub mod compare;
pub mod floors;
pub mod mem;
pub mod plot;
pub mod report;
pub mod run;
pub mod stats;
