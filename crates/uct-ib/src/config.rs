//! Options of the ib component, declared once, and their validated, typed form.

use std::time::Duration;

use rucx_ucs::{Bounds, Config, Error, OptKind, OptionSpec, Result, Syntax, Ternary};

use crate::probe::DeviceFilter;
use crate::verbs::Mtu;

/// Options of the ib component and the `rc_verbs` transport (names without `RUCX_`).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: crate::gpudirect::OPTION,
        kind: OptKind::Ternary,
        default: "try",
        help: "Register GPU memory with RDMA NICs (GPUDirect RDMA through dma-buf or the peer-memory \
               module): yes requires it for every GPU (an error where impossible), no never tries \
               (GPU transfers are staged through host memory), try uses it where the per-GPU check \
               allows.",
    },
    OptionSpec {
        name: "IB_DEVICES",
        kind: OptKind::List,
        default: "",
        help: "RDMA devices or ports to use, e.g. mlx5_0 or mlx5_0:1 (comma-separated); empty for \
               every ACTIVE port.",
    },
    OptionSpec {
        name: "IB_GID_INDEX",
        kind: OptKind::Text(Syntax {
            check: check_gid_index,
            accepted: GID_INDEX_FORMS,
        }),
        default: "auto",
        help: "GID table index for RoCE ports; auto prefers a RoCE v2 GID holding an IPv4 address.",
    },
    OptionSpec {
        name: "IB_SL",
        kind: OptKind::UintIn(Bounds::new(0, 15)),
        default: "0",
        help: "InfiniBand service level (0-15).",
    },
    OptionSpec {
        name: "IB_TRAFFIC_CLASS",
        kind: OptKind::UintIn(Bounds::new(0, 255)),
        default: "0",
        help: "Traffic class of routed (RoCE or inter-subnet) packets (0-255).",
    },
    OptionSpec {
        name: "RC_PATH_MTU",
        kind: OptKind::Enum(&["auto", "256", "512", "1024", "2048", "4096"]),
        default: "auto",
        help: "Path MTU of RC connections; auto takes the smaller active MTU of both ports.",
    },
    OptionSpec {
        name: "RC_SEG_SIZE",
        kind: OptKind::MemIn(
            Bounds::new(SEG_SIZE_RANGE.0 as u64, SEG_SIZE_RANGE.1 as u64).or_auto(),
        ),
        default: "8K",
        help: "Size of the receive buffers of rc_verbs, hence the largest active message \
               (256 bytes to 1 MiB).",
    },
    OptionSpec {
        name: "RC_RX_QUEUE_LEN",
        kind: OptKind::UintIn(Bounds::new(2, 16384)),
        default: "64",
        help: "Receive buffers per rc_verbs endpoint: the credits a peer starts with (2-16384).",
    },
    OptionSpec {
        name: "RC_TX_QUEUE_LEN",
        kind: OptKind::UintIn(Bounds::new(2, 16384)),
        default: "64",
        help: "Send queue depth per rc_verbs endpoint (2-16384).",
    },
    OptionSpec {
        name: "RC_CQ_LEN",
        kind: OptKind::UintIn(Bounds::new(64, 1 << 22)),
        default: "4096",
        help: "Completion queue entries per rc_verbs interface; bounds the number of endpoints.",
    },
    OptionSpec {
        name: "RC_TIMEOUT",
        kind: OptKind::Time,
        default: "1s",
        help: "Transport ack timeout of RC connections (rounded up to 4.096 us * 2^n).",
    },
    OptionSpec {
        name: "RC_RETRY_COUNT",
        kind: OptKind::UintIn(Bounds::new(0, 7)),
        default: "7",
        help: "Transport retries before a connection fails (0-7).",
    },
    OptionSpec {
        name: "RC_RNR_RETRY",
        kind: OptKind::UintIn(Bounds::new(0, 7)),
        default: "7",
        help: "Receiver-not-ready retries (0-7; 7 retries forever).",
    },
];

/// Our own options: from `config` when it declares them, else defaults plus our `RUCX_*`
/// variables (so a caller that forgot to include [`CONFIG`] still gets a working component).
pub(crate) fn own_config(config: &Config) -> Result<std::borrow::Cow<'_, Config>> {
    if CONFIG.iter().all(|o| config.has(o.name)) {
        return Ok(std::borrow::Cow::Borrowed(config));
    }
    let ours = std::env::vars().filter(|(k, _)| {
        k.strip_prefix("RUCX_")
            .is_some_and(|n| CONFIG.iter().any(|o| o.name == n))
    });
    Ok(std::borrow::Cow::Owned(Config::from_vars(&[CONFIG], ours)?))
}

/// What `RUCX_IB_GID_INDEX` accepts.
const GID_INDEX_FORMS: &str = "auto, or 0 to 1023";

fn parse_gid_index(s: &str) -> std::result::Result<GidChoice, String> {
    match s.trim() {
        "" | "auto" => Ok(GidChoice::Auto),
        s => s
            .parse::<u32>()
            .ok()
            .filter(|i| *i < 1024)
            .map(GidChoice::Index)
            .ok_or_else(|| "not auto or a GID table index".into()),
    }
}

fn check_gid_index(s: &str) -> std::result::Result<(), String> {
    parse_gid_index(s).map(drop)
}

fn range_err(var: &str, value: impl ToString, accepted: &str) -> Error {
    Error::Config {
        var: format!("RUCX_{var}"),
        value: value.to_string(),
        reason: "out of range".into(),
        accepted: accepted.into(),
    }
}

fn uint_in(c: &Config, name: &str, lo: u64, hi: u64) -> Result<u64> {
    let v = c.uint(name);
    if v < lo || v > hi {
        Err(range_err(name, v, &format!("{lo} to {hi}")))
    } else {
        Ok(v)
    }
}

/// How to pick the GID of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidChoice {
    /// Prefer RoCE v2 with an IPv4 address, then any RoCE v2, then index 0.
    Auto,
    /// This index.
    Index(u32),
}

/// Device-level options.
#[derive(Clone, Debug, PartialEq)]
pub struct IbConfig {
    /// `RUCX_IB_GPU_DIRECT_RDMA`.
    pub gpu_direct: Ternary,
    /// `RUCX_IB_DEVICES`.
    pub devices: DeviceFilter,
    /// `RUCX_IB_GID_INDEX`.
    pub gid: GidChoice,
    /// `RUCX_IB_SL`.
    pub sl: u8,
    /// `RUCX_IB_TRAFFIC_CLASS`.
    pub traffic_class: u8,
}

impl IbConfig {
    /// Read and validate.
    pub fn from_config(config: &Config) -> Result<IbConfig> {
        let c = own_config(config)?;
        let raw = c.string("IB_GID_INDEX");
        let gid = parse_gid_index(raw).map_err(|reason| Error::Config {
            var: "RUCX_IB_GID_INDEX".into(),
            value: raw.into(),
            reason,
            accepted: GID_INDEX_FORMS.into(),
        })?;
        Ok(IbConfig {
            gpu_direct: c.ternary(crate::gpudirect::OPTION),
            devices: DeviceFilter::parse(c.list("IB_DEVICES"))?,
            gid,
            sl: uint_in(&c, "IB_SL", 0, 15)? as u8,
            traffic_class: uint_in(&c, "IB_TRAFFIC_CLASS", 0, 255)? as u8,
        })
    }
}

/// Transport options of `rc_verbs`.
#[derive(Clone, Debug, PartialEq)]
pub struct RcConfig {
    /// Path MTU override.
    pub path_mtu: Option<Mtu>,
    /// Receive buffer size.
    pub seg_size: usize,
    /// Receive buffers for data per endpoint (the credit window).
    pub rx_window: u32,
    /// Send queue depth per endpoint.
    pub tx_depth: u32,
    /// Completion queue size per interface.
    pub cq_len: u32,
    /// Ack timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
}

/// Smallest and largest receive buffer.
pub const SEG_SIZE_RANGE: (usize, usize) = (256, 1 << 20);

impl RcConfig {
    /// Read and validate.
    pub fn from_config(config: &Config) -> Result<RcConfig> {
        let c = own_config(config)?;
        let path_mtu = match c.string("RC_PATH_MTU") {
            "auto" => None,
            s => s.parse::<usize>().ok().and_then(Mtu::from_bytes),
        };
        let seg = c.mem_units("RC_SEG_SIZE").resolve(8192);
        if seg < SEG_SIZE_RANGE.0 as u64 || seg > SEG_SIZE_RANGE.1 as u64 {
            return Err(range_err("RC_SEG_SIZE", c.raw("RC_SEG_SIZE")?, "256 to 1M"));
        }
        Ok(RcConfig {
            path_mtu,
            seg_size: seg as usize,
            rx_window: uint_in(&c, "RC_RX_QUEUE_LEN", 2, 16384)? as u32,
            tx_depth: uint_in(&c, "RC_TX_QUEUE_LEN", 2, 16384)? as u32,
            cq_len: uint_in(&c, "RC_CQ_LEN", 64, 1 << 22)? as u32,
            timeout: ib_timeout_exponent(c.time("RC_TIMEOUT")),
            retry_cnt: uint_in(&c, "RC_RETRY_COUNT", 0, 7)? as u8,
            rnr_retry: uint_in(&c, "RC_RNR_RETRY", 0, 7)? as u8,
        })
    }
}

/// The IB ack-timeout exponent `t` (timeout = 4.096 us * 2^t) for at least `d`, within 1..=31.
pub fn ib_timeout_exponent(d: Duration) -> u8 {
    let ns = d.as_nanos();
    for t in 1u8..=31 {
        if 4096u128 << t >= ns {
            return t;
        }
    }
    31
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        let c = Config::new(&[CONFIG]).unwrap();
        let ib = IbConfig::from_config(&c).unwrap();
        assert_eq!(ib.gpu_direct, Ternary::Try);
        assert!(ib.devices.is_all());
        assert_eq!(ib.gid, GidChoice::Auto);
        let rc = RcConfig::from_config(&c).unwrap();
        assert_eq!(rc.seg_size, 8192);
        assert_eq!(rc.rx_window, 64);
        assert_eq!(rc.timeout, 18);
        assert_eq!(rc.path_mtu, None);
    }

    #[test]
    fn bad_values_name_the_variable() {
        // Checked where they are read: the configuration itself refuses them.
        for (var, value, range) in [
            ("RUCX_RC_SEG_SIZE", "64", "from 256 to 1M"),
            ("RUCX_IB_GID_INDEX", "x", "0 to 1023"),
            ("RUCX_RC_RETRY_COUNT", "9", "from 0 to 7"),
            ("RUCX_RC_CQ_LEN", "0", "from 64 to 4194304"),
            ("RUCX_IB_SL", "16", "from 0 to 15"),
        ] {
            let e = Config::from_vars(&[CONFIG], [(var, value)]).unwrap_err();
            let s = e.to_string();
            assert!(s.contains(var) && s.contains(range), "{s}");
        }
        assert!(Config::from_vars(&[CONFIG], [("RUCX_IB_GPU_DIRECT_RDMA", "maybe")]).is_err());
        let c = Config::from_vars(
            &[CONFIG],
            [
                ("RUCX_IB_GPU_DIRECT_RDMA", "no"),
                ("RUCX_RC_PATH_MTU", "2048"),
            ],
        )
        .unwrap();
        assert_eq!(IbConfig::from_config(&c).unwrap().gpu_direct, Ternary::No);
        assert_eq!(
            RcConfig::from_config(&c).unwrap().path_mtu,
            Some(Mtu::M2048)
        );
    }

    #[test]
    fn config_without_our_table_falls_back_to_defaults() {
        let c = Config::new(&[]).unwrap();
        let rc = RcConfig::from_config(&c).unwrap();
        assert!(rc.seg_size >= 256);
    }

    #[test]
    fn timeout_exponent() {
        assert_eq!(ib_timeout_exponent(Duration::from_secs(1)), 18);
        assert_eq!(ib_timeout_exponent(Duration::ZERO), 1);
        assert_eq!(ib_timeout_exponent(Duration::from_micros(8)), 1);
        assert_eq!(ib_timeout_exponent(Duration::from_micros(9)), 2);
        assert_eq!(ib_timeout_exponent(Duration::from_secs(100_000)), 31);
    }
}
