//! The protocols: their names (what a row of a plan's table, [`crate::plan`], says a size
//! takes), and protocol state machines that run without a transport.

use std::fmt;

pub(crate) mod am;
pub(crate) mod eager;
pub(crate) mod eager_multi;
#[cfg(test)]
pub(crate) mod fake_io;
pub(crate) mod gpu;
pub(crate) mod io;
pub(crate) mod rma;
pub(crate) mod rndv;
pub(crate) mod stream;

/// A send protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    /// One `am_short`.
    EagerShort,
    /// One `am_bcopy`.
    EagerBcopy,
    /// Several `am_bcopy` fragments.
    EagerBcopyMulti,
    /// `am_zcopy` fragments from the registered user buffer.
    EagerZcopy,
    /// Rendezvous, the receiver reads with `get_zcopy`.
    RndvGet,
    /// Rendezvous, the sender writes with `put_zcopy`.
    RndvPut,
    /// Rendezvous, the sender streams active messages once the receiver is ready.
    RndvAm,
    /// Rendezvous for GPU memory without a zero-copy path: the sender stages fragments in
    /// pinned host memory, the receiver reads each one and copies it on (pipelined).
    RndvPipeline,
    /// One eager message of a synchronous send; the receiver acknowledges its match.
    EagerSync,
    /// A small GPU message copied to a pinned bounce buffer and sent eagerly.
    EagerBounce,
    /// Stream bytes copied into active messages.
    StreamCopy,
    /// A user active message copied in (one message, or fragments).
    AmCopy,
    /// A remote write from a registered buffer.
    PutZcopy,
    /// A remote read into a registered buffer.
    GetZcopy,
    /// A remote write from GPU memory through pinned host staging: the copy lane copies each
    /// fragment out of the GPU, a remote-access lane writes it.
    PutStaged,
    /// A remote read into GPU memory through pinned host staging: a remote-access lane reads
    /// each fragment, the copy lane copies it into the GPU.
    GetStaged,
}

impl Proto {
    /// Name used in tables and logs.
    pub fn name(self) -> &'static str {
        match self {
            Proto::EagerShort => "eager short",
            Proto::EagerBcopy => "eager copy-in",
            Proto::EagerBcopyMulti => "multi-frag eager copy-in",
            Proto::EagerZcopy => "eager zero-copy",
            Proto::RndvGet => "rendezvous zero-copy read from remote",
            Proto::RndvPut => "rendezvous zero-copy write to remote",
            Proto::RndvAm => "rendezvous fragmented copy-in copy-out",
            Proto::RndvPipeline => "rendezvous pipelined through host staging",
            Proto::EagerSync => "eager copy-in, match acknowledged",
            Proto::EagerBounce => "eager through a pinned bounce buffer",
            Proto::StreamCopy => "stream copy-in",
            Proto::AmCopy => "active message copy-in",
            Proto::PutZcopy => "zero-copy put",
            Proto::GetZcopy => "zero-copy get",
            Proto::PutStaged => "put staged through pinned host memory",
            Proto::GetStaged => "get staged through pinned host memory",
        }
    }

    /// True for zero-copy protocols.
    pub fn is_zcopy(self) -> bool {
        matches!(
            self,
            Proto::EagerZcopy | Proto::RndvGet | Proto::RndvPut | Proto::PutZcopy | Proto::GetZcopy
        )
    }

    /// True for rendezvous protocols.
    pub fn is_rndv(self) -> bool {
        matches!(
            self,
            Proto::RndvGet | Proto::RndvPut | Proto::RndvAm | Proto::RndvPipeline
        )
    }
}

/// One row of a selection table: sizes `from..=to` use `proto` on `lane`.
#[derive(Clone, Debug, PartialEq)]
pub struct Range {
    /// Smallest size.
    pub from: usize,
    /// Largest size (`usize::MAX` for no limit).
    pub to: usize,
    /// Protocol.
    pub proto: Proto,
    /// `transport/device` of the lane.
    pub lane: String,
}

/// Bytes of protocol header in each kind of message (see `wire`).
pub const SHORT_OVERHEAD: usize = 8;
/// Header of a whole eager message.
pub const ONE_OVERHEAD: usize = 16;
/// Header of a first fragment.
pub const FIRST_OVERHEAD: usize = 33;
/// Header of a later fragment.
pub const MIDDLE_OVERHEAD: usize = 24;
/// Header of the eager message of a synchronous send (source, tag, request id).
pub const SYNC_OVERHEAD: usize = 24;

/// Look up the protocol for `size`.
pub fn lookup(table: &[Range], size: usize) -> Option<&Range> {
    table.iter().find(|r| r.from <= size && size <= r.to)
}

/// Render a table for `RUCX_PROTO_INFO=y` and `rucx-info -e`.
#[derive(Debug)]
pub struct TableDisplay<'a> {
    /// Title line.
    pub title: String,
    /// Rows.
    pub rows: &'a [Range],
}

impl fmt::Display for TableDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = |n: usize| {
            if n == usize::MAX {
                "inf".to_string()
            } else {
                rucx_ucs::units::format_bytes(n as u64)
            }
        };
        let ranges: Vec<String> = self
            .rows
            .iter()
            .map(|r| format!("{}..{}", size(r.from), size(r.to)))
            .collect();
        let w0 = ranges.iter().map(|r| r.len()).max().unwrap_or(0).max(18);
        let w1 = self
            .rows
            .iter()
            .map(|r| r.proto.name().len())
            .max()
            .unwrap_or(0)
            .max(38);
        let w2 = self
            .rows
            .iter()
            .map(|r| r.lane.len())
            .max()
            .unwrap_or(0)
            .max(14);
        let inner = (w0 + w1 + w2 + 8).max(self.title.len() + 2);
        let w2 = inner - w0 - w1 - 8;
        writeln!(f, "+{}+", "-".repeat(inner))?;
        writeln!(f, "| {:<w$} |", self.title, w = inner - 2)?;
        writeln!(f, "+{}+", "-".repeat(inner))?;
        for (r, range) in self.rows.iter().zip(&ranges) {
            writeln!(
                f,
                "| {:>w0$} | {:<w1$} | {:<w2$} |",
                range,
                r.proto.name(),
                r.lane
            )?;
        }
        write!(f, "+{}+", "-".repeat(inner))
    }
}
