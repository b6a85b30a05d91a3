//! Protocol selection: for a message size, which protocol and lane a send uses.
//!
//! The table is built per endpoint from the lanes' attributes and the configuration, and rebuilt
//! when the context's registration table changes (a demotion).

use std::fmt;

use rucx_ucs::{Config, MemUnits};
use rucx_uct::{IfaceAttr, IfaceCaps, LinearCost};

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
        }
    }

    /// True for zero-copy protocols.
    pub fn is_zcopy(self) -> bool {
        matches!(self, Proto::EagerZcopy | Proto::RndvGet | Proto::RndvPut)
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

/// Inputs for building a table.
#[derive(Clone, Debug)]
pub struct LaneInfo<'a> {
    /// Active-message lane.
    pub am: &'a IfaceAttr,
    /// Whether the AM lane's domain can register host memory now.
    pub am_can_reg: bool,
    /// Registration cost on the AM lane's domain.
    pub am_reg_cost: LinearCost,
    /// RMA lane for rendezvous (its domain registers host memory now).
    pub rma: Option<&'a IfaceAttr>,
}

/// Copy bandwidth assumed for the CPU copies of copy-in protocols, bytes per second.
const MEMCPY_BW: f64 = 10e9;

fn rndv_threshold(l: &LaneInfo<'_>, cfg: &Config) -> usize {
    match cfg.mem_units("RNDV_THRESH") {
        MemUnits::Bytes(b) => return b as usize,
        MemUnits::Infinite => return usize::MAX,
        MemUnits::Auto => {}
    }
    // Eager: copy in, move, copy out. Rendezvous: a round trip of control messages plus the
    // data moved once by the fastest lane.
    let am = l.am.perf;
    let data = l.rma.map_or(am, |r| r.perf);
    // Fixed cost of a rendezvous the lanes' models leave out: the request and the answer are
    // handled by the receiver's and the sender's progress, the read pins pages. Measured about
    // 3.5-8 us on posix (cross-memory attach) and loopback tcp.
    const RNDV_FIXED_NS: f64 = 8_000.0;
    let ctrl =
        2.0 * (am.latency_ns + am.overhead_ns) + data.latency_ns + data.overhead_ns + RNDV_FIXED_NS;
    let mut n = 1024usize;
    while n < (64 << 20) {
        let eager = am.time_ns(n) + 2.0 * n as f64 * 1e9 / MEMCPY_BW;
        let rndv =
            ctrl + if data.bandwidth > 0.0 {
                n as f64 * 1e9 / data.bandwidth
            } else {
                f64::INFINITY
            } + if l.rma.is_none() {
                2.0 * n as f64 * 1e9 / MEMCPY_BW
            } else {
                0.0
            };
        if rndv < eager {
            break;
        }
        n *= 2;
    }
    n.max(split_floor(l, cfg))
}

/// Smallest rendezvous worth it on a lane whose rendezvous is a split read (shared memory, the
/// `auto` scheme): below `RNDV_SPLIT_THRESH` the read is one core copying after a round trip,
/// which the pipelined eager copy beats (posix, measured: 128 KiB eager 7.8 GB/s and 6.6 us one
/// way, rendezvous 4.8 GB/s and 13.7 us; 256 KiB split rendezvous 12.0 GB/s, eager 7.4).
fn split_floor(l: &LaneInfo<'_>, cfg: &Config) -> usize {
    match l.rma {
        Some(r)
            if cfg.string("RNDV_SCHEME") == "auto"
                && r.dev_type != rucx_uct::DeviceType::Network
                && r.has(IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY) =>
        {
            cfg.mem_units("RNDV_SPLIT_THRESH")
                .resolve(256 << 10)
                .min(usize::MAX as u64) as usize
        }
        _ => 0,
    }
}

fn zcopy_threshold(l: &LaneInfo<'_>, cfg: &Config) -> usize {
    match cfg.mem_units("ZCOPY_THRESH") {
        MemUnits::Bytes(b) => return b as usize,
        MemUnits::Infinite => return usize::MAX,
        MemUnits::Auto => {}
    }
    // Worth it once one copy costs more than a (cached) registration.
    let mut n = 256usize;
    while n < (64 << 20) {
        if l.am_reg_cost.at(n) < n as f64 * 1e9 / MEMCPY_BW {
            return n;
        }
        n *= 2;
    }
    n
}

/// Build the tag-send table for host memory on both sides.
pub fn build_table(l: &LaneInfo<'_>, cfg: &Config) -> Vec<Range> {
    let am = l.am;
    let lane = |a: &IfaceAttr| format!("{}/{}", a.tl_name, a.dev_name);
    let mut rows: Vec<Range> = Vec::new();
    fn push(rows: &mut Vec<Range>, from: usize, to: usize, proto: Proto, lane: String) {
        if from <= to {
            rows.push(Range {
                from,
                to,
                proto,
                lane,
            });
        }
    }
    let rndv = rndv_threshold(l, cfg);
    let mut next = 0usize;
    // Sizes below `rndv` are eager; `rndv == usize::MAX` means "never rendezvous".
    let eager_end = if rndv == usize::MAX {
        Some(usize::MAX)
    } else {
        rndv.checked_sub(1)
    };
    if let Some(eager_end) = eager_end {
        let mut done = false;
        if am.has(IfaceCaps::AM_SHORT) && am.limits.am_max_short >= SHORT_OVERHEAD {
            let end = (am.limits.am_max_short - SHORT_OVERHEAD).min(eager_end);
            push(&mut rows, 0, end, Proto::EagerShort, lane(am));
            done = end == usize::MAX;
            next = end.saturating_add(1);
        }
        let one_end = am
            .limits
            .am_max_bcopy
            .saturating_sub(ONE_OVERHEAD)
            .min(eager_end);
        if !done && next <= one_end && am.limits.am_max_bcopy >= ONE_OVERHEAD {
            push(&mut rows, next, one_end, Proto::EagerBcopy, lane(am));
            done = one_end == usize::MAX;
            next = one_end.saturating_add(1);
        }
        let zc_ok =
            am.has(IfaceCaps::AM_ZCOPY) && l.am_can_reg && am.limits.am_max_hdr >= FIRST_OVERHEAD;
        let zthresh = if zc_ok {
            zcopy_threshold(l, cfg).max(next)
        } else {
            usize::MAX
        };
        if !done && next <= eager_end {
            let bend = if zthresh == usize::MAX {
                eager_end
            } else {
                (zthresh - 1).min(eager_end)
            };
            if next <= bend && (zthresh > next || !zc_ok) {
                push(&mut rows, next, bend, Proto::EagerBcopyMulti, lane(am));
                done = bend == usize::MAX;
                next = bend.saturating_add(1);
            }
            if !done && next <= eager_end {
                push(&mut rows, next, eager_end, Proto::EagerZcopy, lane(am));
                done = eager_end == usize::MAX;
                next = eager_end.saturating_add(1);
            }
        }
        if done {
            return rows;
        }
    }
    let _ = next;
    {
        let scheme = cfg.string("RNDV_SCHEME");
        let (proto, ln) = match (l.rma, scheme) {
            (_, "am") | (None, _) => (Proto::RndvAm, lane(am)),
            (Some(r), "put_zcopy") if r.has(IfaceCaps::PUT_ZCOPY) => (Proto::RndvPut, lane(r)),
            // Over a network the sender pushes: a read costs a request round trip per fragment
            // and the serving side's copy (measured on loopback tcp: 5.3 GB/s put vs 1.2 get).
            (Some(r), "auto")
                if r.dev_type == rucx_uct::DeviceType::Network && r.has(IfaceCaps::PUT_ZCOPY) =>
            {
                (Proto::RndvPut, lane(r))
            }
            (Some(r), _) if r.has(IfaceCaps::GET_ZCOPY) => (Proto::RndvGet, lane(r)),
            (Some(r), _) if r.has(IfaceCaps::PUT_ZCOPY) => (Proto::RndvPut, lane(r)),
            _ => (Proto::RndvAm, lane(am)),
        };
        push(&mut rows, next, usize::MAX, proto, ln);
    }
    rows
}

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
        writeln!(f, "+{}+", "-".repeat(78))?;
        writeln!(f, "| {:<76} |", self.title)?;
        writeln!(f, "+{}+", "-".repeat(78))?;
        for r in self.rows {
            let range = format!("{}..{}", size(r.from), size(r.to));
            writeln!(
                f,
                "| {:>18} | {:<38} | {:<14} |",
                range,
                r.proto.name(),
                r.lane
            )?;
        }
        write!(f, "+{}+", "-".repeat(78))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rucx_uct::{DeviceType, IfaceLimits, PerfModel};

    fn attr(short: usize, bcopy: usize, zcopy: bool, bw: f64) -> IfaceAttr {
        let mut caps =
            IfaceCaps::AM_SHORT | IfaceCaps::AM_BCOPY | IfaceCaps::GET_ZCOPY | IfaceCaps::PUT_ZCOPY;
        if zcopy {
            caps |= IfaceCaps::AM_ZCOPY;
        }
        IfaceAttr {
            tl_name: "t".into(),
            dev_name: "d".into(),
            dev_type: DeviceType::IntraNode,
            sys_device: None,
            caps,
            limits: IfaceLimits {
                am_max_short: short,
                am_max_bcopy: bcopy,
                am_max_zcopy: 1 << 20,
                am_max_hdr: 64,
                put_max_short: 0,
                put_max_zcopy: 1 << 30,
                get_max_zcopy: 1 << 30,
                max_iov: 4,
            },
            perf: PerfModel {
                latency_ns: 300.0,
                overhead_ns: 50.0,
                bandwidth: bw,
            },
            priority: 0,
            device_addr_len: 0,
            iface_addr_len: 0,
            ep_addr_len: 0,
            max_eps: None,
        }
    }

    fn cfg(vars: &[(&str, &str)]) -> Config {
        Config::from_vars(&[crate::config::CONFIG], vars.iter().copied()).unwrap()
    }

    fn check_contiguous(t: &[Range]) {
        assert_eq!(t[0].from, 0);
        for w in t.windows(2) {
            assert_eq!(w[0].to + 1, w[1].from, "{t:?}");
        }
        assert_eq!(t.last().unwrap().to, usize::MAX);
    }

    #[test]
    fn explicit_thresholds_are_honoured() {
        let a = attr(256, 8192, true, 5e9);
        let l = LaneInfo {
            am: &a,
            am_can_reg: true,
            am_reg_cost: LinearCost::fixed(1000.0),
            rma: Some(&a),
        };
        let t = build_table(
            &l,
            &cfg(&[("RUCX_RNDV_THRESH", "64K"), ("RUCX_ZCOPY_THRESH", "16K")]),
        );
        check_contiguous(&t);
        assert_eq!(lookup(&t, 0).unwrap().proto, Proto::EagerShort);
        assert_eq!(lookup(&t, 248).unwrap().proto, Proto::EagerShort);
        assert_eq!(lookup(&t, 249).unwrap().proto, Proto::EagerBcopy);
        assert_eq!(lookup(&t, 8176).unwrap().proto, Proto::EagerBcopy);
        assert_eq!(lookup(&t, 8177).unwrap().proto, Proto::EagerBcopyMulti);
        assert_eq!(lookup(&t, 16 << 10).unwrap().proto, Proto::EagerZcopy);
        assert_eq!(lookup(&t, (64 << 10) - 1).unwrap().proto, Proto::EagerZcopy);
        assert_eq!(lookup(&t, 64 << 10).unwrap().proto, Proto::RndvGet);
        let t = build_table(&l, &cfg(&[("RUCX_RNDV_SCHEME", "put_zcopy")]));
        assert_eq!(t.last().unwrap().proto, Proto::RndvPut);
    }

    #[test]
    fn demoted_domain_loses_zero_copy() {
        let a = attr(256, 8192, true, 5e9);
        let l = LaneInfo {
            am: &a,
            am_can_reg: false,
            am_reg_cost: LinearCost::fixed(1000.0),
            rma: None,
        };
        let t = build_table(&l, &cfg(&[]));
        check_contiguous(&t);
        assert!(t.iter().all(|r| !r.proto.is_zcopy()), "{t:?}");
        assert_eq!(t.last().unwrap().proto, Proto::RndvAm);
    }

    proptest! {
        #[test]
        fn tables_cover_every_size_once(short in 0usize..4096, bcopy in 16usize..65536, zc in any::<bool>(), reg in any::<bool>(),
                                        rma in any::<bool>(), bw in 1e8f64..1e11, rndv in prop_oneof![Just("auto".to_string()), (0u64..1<<22).prop_map(|n| n.to_string()), Just("inf".to_string())]) {
            let a = attr(short, bcopy, zc, bw);
            let l = LaneInfo { am: &a, am_can_reg: reg, am_reg_cost: LinearCost::fixed(500.0), rma: if rma { Some(&a) } else { None } };
            let t = build_table(&l, &cfg(&[("RUCX_RNDV_THRESH", rndv.as_str())]));
            prop_assert!(!t.is_empty());
            prop_assert_eq!(t[0].from, 0);
            for w in t.windows(2) { prop_assert_eq!(w[0].to + 1, w[1].from); }
            prop_assert_eq!(t.last().unwrap().to, usize::MAX);
            for r in &t {
                if r.proto == Proto::EagerShort { prop_assert!(r.to + SHORT_OVERHEAD <= short); }
                if r.proto == Proto::EagerBcopy { prop_assert!(r.to + ONE_OVERHEAD <= bcopy); }
                if r.proto == Proto::EagerZcopy { prop_assert!(zc && reg); }
            }
        }
    }
}
