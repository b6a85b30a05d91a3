//! The plan as text: what `RUCX_PROTO_INFO=y`, `rucx-info -e` and the planner tests print.

use std::fmt;

use super::{EpPlan, RecvStep, RmaStep};
use crate::proto::TableDisplay;

impl fmt::Display for EpPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.lanes;
        write!(f, "lanes: active messages {}", self.lane_name(l.am))?;
        match l.rma {
            Some(r) => write!(f, "; host memory access {}", self.lane_name(r))?,
            None => write!(f, "; host memory access none")?,
        }
        for (k, g) in &l.gpu {
            match g {
                Some(g) => write!(f, "; {k} zero-copy {}", self.lane_name(*g))?,
                None => write!(f, "; {k} zero-copy none")?,
            }
        }
        if let Some(c) = l.copy {
            write!(f, "; copy {}", self.lane_name(c))?;
        }
        writeln!(f)?;
        if !self.wanted.is_empty() {
            let w: Vec<&str> = self.wanted.iter().map(|i| self.lane_name(*i)).collect();
            writeln!(f, "not connected yet: {}", w.join(", "))?;
        }
        for t in &self.tables {
            let title = format!("{}, {} memory", t.op.name(), t.mem);
            if t.rows.is_empty() {
                writeln!(f, "{title}: refused ({})", t.notes.join("; "))?;
                continue;
            }
            writeln!(
                f,
                "{}",
                TableDisplay {
                    title,
                    rows: &t.rows
                }
            )?;
            for n in &t.notes {
                writeln!(f, "  note: {n}")?;
            }
        }
        for r in &self.recv {
            let steps: Vec<String> = r
                .steps
                .iter()
                .map(|s| match s {
                    RecvStep::Stream => s.name().to_string(),
                    s => format!(
                        "{} on {}",
                        s.name(),
                        self.lane_name(s.lane().unwrap_or(usize::MAX))
                    ),
                })
                .collect();
            write!(
                f,
                "rendezvous {} -> {}: {}",
                r.send,
                r.recv,
                if steps.is_empty() {
                    "refused".to_string()
                } else {
                    steps.join(", else ")
                }
            )?;
            if !r.notes.is_empty() {
                write!(f, " ({})", r.notes.join("; "))?;
            }
            writeln!(f)?;
        }
        for r in &self.rma {
            let steps: Vec<String> = r
                .steps
                .iter()
                .map(|s| {
                    let how = match s {
                        RmaStep::Zcopy { .. } => "zero-copy",
                        RmaStep::Staged { .. } => "staged through pinned host memory",
                    };
                    format!("{how} on {}", self.lane_name(s.lane()))
                })
                .collect();
            write!(
                f,
                "{} {} -> remote {}: {}",
                r.op.name(),
                r.local,
                r.remote,
                if steps.is_empty() {
                    "refused".to_string()
                } else {
                    steps.join(", else ")
                }
            )?;
            if !r.notes.is_empty() {
                write!(f, " ({})", r.notes.join("; "))?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
