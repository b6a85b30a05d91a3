//! rucx tcp transport.
//!
//! - [`TcpComponent`]: component `tcp`, one memory domain `tcp`, one transport resource per
//!   network interface that is up and has an IPv4 address (`lo` included); the device name is
//!   the interface name.
//! - [`TcpMd`]: registers host memory, packs and unpacks remote keys and keeps the table of live
//!   registrations that remote puts and gets are checked against.
//! - [`TcpIface`]: listens on the device's address (ephemeral port, or one from
//!   `RUCX_TCP_PORT_RANGE`); endpoints connect to a peer interface. Everything is non-blocking
//!   and driven by [`Iface::progress`](rucx_uct::Iface::progress): one call without waiting
//!   names the sockets that are ready (`poll(2)` over a kept array while there are a few,
//!   `epoll_wait(2)` beyond), and only those are read or written.
//!
//! # Connections
//! Endpoints connect to a peer interface's listening address. A connection is full duplex and
//! carries at most one endpoint of each side: an endpoint to peer P takes over a connection
//! that P opened to us (P's `Hello` names its listening address) if our side of it has no
//! endpoint yet, else it opens its own. With the usual wire-up (one side creates its endpoint,
//! sends, and the other side creates its endpoint after receiving) both directions share one
//! connection, which halves the packets of a ping-pong (acknowledgements ride on the answers).
//! Endpoints created at the same moment on both sides first get one connection each; then the
//! side with the larger listening address moves its endpoint onto the connection the other
//! side opened (between two requests, keeping its messages in order: `Joined` in [`wire`]),
//! and its own connection closes. Requests are answered on the connection they came on, in
//! order. When an endpoint is dropped, what it posted is still sent, followed by `Detach`; a
//! connection with no endpoint left on either side is closed. Details in the `proto` module
//! and [`wire`].
//!
//! # Layout
//! - [`wire`]: the frame format, pure functions over bytes.
//! - `stream`: the byte stream under the frames: the socket traits the protocol uses, frame
//!   reassembly from reads of any size, the send queue.
//! - `proto`: the connection protocol as pure code (no descriptor, no system call): states,
//!   `Hello` checks, requests and answers, `Detach` and closing, simultaneous connects. Its
//!   tests run it over an in-memory stream.
//! - `sock` (sockets: listen, connect, accept, options, the socket types) and `ready` (epoll,
//!   `poll(2)`, the kick list): every system call.
//! - `iface` and `ep`: the interface and endpoint glue on top: the table of connections,
//!   progress, argument checks.
//!
//! # Errors
//! A peer that closes or resets the connection, a connect that fails or times out, a keepalive
//! or user timeout (a dead peer host is noticed within `TCP_KEEPIDLE + TCP_KEEPINTVL *
//! TCP_KEEPCNT` when idle and within `TCP_USER_TIMEOUT` with data in flight), or a malformed
//! frame fails that endpoint: an [`Event::EpError`](rucx_uct::Event::EpError), and every
//! operation in flight on it completes with an error. A malformed frame on an accepted
//! connection closes that connection only (after telling the peer why); other connections of
//! the interface are not affected.

pub mod addr;
mod ep;
mod iface;
pub mod md;
#[cfg(test)]
mod memsock;
mod proto;
mod ready;
mod sock;
mod stream;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use rucx_ucs::{Bounds, Config, Error, OptKind, OptionSpec, Result, Syntax};
use rucx_uct::{Availability, Component, MemoryDomain};

pub use ep::TcpEndpoint;
pub use iface::TcpIface;
pub use md::TcpMd;

/// Component and memory domain name.
pub const COMPONENT: &str = "tcp";
/// Transport name.
pub const TL_NAME: &str = "tcp";

/// Options of the tcp transport (names without the `RUCX_` prefix).
pub static CONFIG: &[OptionSpec] = &[
    OptionSpec {
        name: "TCP_IFACES",
        kind: OptKind::List,
        default: "",
        help: "Network interfaces the tcp transport uses, by name (e.g. eth0,lo); empty: every \
               interface that is up and has an IPv4 address, lo included.",
    },
    OptionSpec {
        name: "TCP_PORT_RANGE",
        kind: OptKind::Text(Syntax {
            check: check_port_range,
            accepted: PORT_RANGE_FORMS,
        }),
        default: "0",
        help: "Ports tcp interfaces listen on: 0 for an ephemeral port, or FIRST-LAST to take \
               the first free port of that range (for firewalls).",
    },
    OptionSpec {
        name: "TCP_SNDBUF",
        kind: OptKind::MemIn(SOCKBUF),
        default: "auto",
        help: "Socket send buffer size (SO_SNDBUF); auto keeps the kernel's default and autotuning.",
    },
    OptionSpec {
        name: "TCP_RCVBUF",
        kind: OptKind::MemIn(SOCKBUF),
        default: "auto",
        help: "Socket receive buffer size (SO_RCVBUF); auto keeps the kernel's default and autotuning.",
    },
    OptionSpec {
        name: "TCP_NODELAY",
        kind: OptKind::Bool,
        default: "y",
        help: "Disable Nagle's algorithm (TCP_NODELAY), for latency.",
    },
    OptionSpec {
        name: "TCP_KEEPALIVE",
        kind: OptKind::Bool,
        default: "y",
        help: "Probe idle connections (SO_KEEPALIVE) so a dead peer host is detected.",
    },
    OptionSpec {
        name: "TCP_KEEPIDLE",
        kind: OptKind::TimeIn(KEEPALIVE_TIME),
        default: "2s",
        help: "Idle time before the first keepalive probe (whole seconds, at least 1s).",
    },
    OptionSpec {
        name: "TCP_KEEPINTVL",
        kind: OptKind::TimeIn(KEEPALIVE_TIME),
        default: "1s",
        help: "Time between keepalive probes (whole seconds, at least 1s).",
    },
    OptionSpec {
        name: "TCP_KEEPCNT",
        kind: OptKind::UintIn(Bounds::new(1, 127)),
        default: "3",
        help: "Unanswered keepalive probes after which the peer is declared dead.",
    },
    OptionSpec {
        name: "TCP_USER_TIMEOUT",
        kind: OptKind::TimeIn(Bounds::millis(0, u32::MAX as u64)),
        default: "5s",
        help: "How long sent data may stay unacknowledged before the connection is declared \
               dead (TCP_USER_TIMEOUT); 0 for the kernel's default (minutes).",
    },
    OptionSpec {
        name: "TCP_CONNECT_TIMEOUT",
        kind: OptKind::TimeIn(Bounds::millis(1, 24 * 3600 * 1000)),
        default: "10s",
        help: "How long an endpoint's connection may take before it fails.",
    },
    OptionSpec {
        name: "TCP_TX_QUEUE",
        kind: OptKind::MemIn(Bounds::new(64 << 10, u64::MAX).or_inf()),
        default: "4M",
        help: "Bytes queued per connection beyond what the socket took; a send past this \
               returns 'no resources' until progress drains the queue.",
    },
];

/// Socket buffer sizes: the kernel's (auto) or 1 byte to 2G.
const SOCKBUF: Bounds = Bounds::new(1, i32::MAX as u64).or_auto();
/// Keepalive times: whole seconds the kernel takes.
const KEEPALIVE_TIME: Bounds = Bounds::secs(1, u16::MAX as u64);
/// What `RUCX_TCP_PORT_RANGE` accepts.
const PORT_RANGE_FORMS: &str = "0, or FIRST-LAST with 1 <= FIRST <= LAST <= 65535";

fn check_port_range(s: &str) -> std::result::Result<(), String> {
    parse_port_range(s).map(drop)
}

/// The tcp options, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// Interfaces to use (empty: all usable).
    pub ifaces: Vec<String>,
    /// Listening ports: `(0, 0)` for ephemeral, else an inclusive range.
    pub port_range: (u16, u16),
    /// `SO_SNDBUF`, `None` for the kernel default.
    pub sndbuf: Option<usize>,
    /// `SO_RCVBUF`, `None` for the kernel default.
    pub rcvbuf: Option<usize>,
    /// `TCP_NODELAY`.
    pub nodelay: bool,
    /// `SO_KEEPALIVE`.
    pub keepalive: bool,
    /// `TCP_KEEPIDLE`.
    pub keepidle: Duration,
    /// `TCP_KEEPINTVL`.
    pub keepintvl: Duration,
    /// `TCP_KEEPCNT`.
    pub keepcnt: u32,
    /// `TCP_USER_TIMEOUT` (zero: kernel default).
    pub user_timeout: Duration,
    /// Connect / handshake timeout.
    pub connect_timeout: Duration,
    /// Per-connection queue limit in bytes.
    pub tx_queue: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        let c = Config::new(&[CONFIG]).expect("tcp option defaults parse");
        TcpOptions::from_config(&c).expect("tcp option defaults are valid")
    }
}

fn parse_port_range(s: &str) -> std::result::Result<(u16, u16), String> {
    let s = s.trim();
    if s == "0" {
        return Ok((0, 0));
    }
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let a: u16 = a
        .trim()
        .parse()
        .map_err(|_| format!("{a:?} is not a port number"))?;
    let b: u16 = b
        .trim()
        .parse()
        .map_err(|_| format!("{b:?} is not a port number"))?;
    if a == 0 || b < a {
        return Err(format!("{a}-{b} is not a range of nonzero ports"));
    }
    Ok((a, b))
}

impl TcpOptions {
    /// Read the options from a configuration. Options missing from `config` (a configuration
    /// built without this crate's table) take their defaults.
    pub fn from_config(config: &Config) -> Result<TcpOptions> {
        if !config.has("TCP_PORT_RANGE") {
            return Ok(TcpOptions::default());
        }
        let port_raw = config.string("TCP_PORT_RANGE");
        let port_range = parse_port_range(port_raw).map_err(|reason| Error::Config {
            var: "RUCX_TCP_PORT_RANGE".into(),
            value: port_raw.into(),
            reason,
            accepted: PORT_RANGE_FORMS.into(),
        })?;
        let size = |name: &str| -> Result<Option<usize>> {
            match config.mem_units(name) {
                rucx_ucs::MemUnits::Auto => Ok(None),
                rucx_ucs::MemUnits::Bytes(b) if b > 0 && b <= i32::MAX as u64 => {
                    Ok(Some(b as usize))
                }
                other => Err(Error::Config {
                    var: format!("RUCX_{name}"),
                    value: other.to_string(),
                    reason: "must be auto or a size between 1 byte and 2G".into(),
                    accepted: rucx_ucs::units::MEMUNITS_FORMS.into(),
                }),
            }
        };
        let secs = |name: &str| -> Result<Duration> {
            let d = config.time(name);
            if d < Duration::from_secs(1) || d > Duration::from_secs(u64::from(u16::MAX)) {
                return Err(Error::Config {
                    var: format!("RUCX_{name}"),
                    value: config.raw(name)?.into(),
                    reason: "must be between 1s and 65535s".into(),
                    accepted: rucx_ucs::units::TIME_FORMS.into(),
                });
            }
            Ok(d)
        };
        let keepcnt = config.uint("TCP_KEEPCNT");
        if keepcnt == 0 || keepcnt > 127 {
            return Err(Error::Config {
                var: "RUCX_TCP_KEEPCNT".into(),
                value: keepcnt.to_string(),
                reason: "must be between 1 and 127".into(),
                accepted: "an integer 1..=127".into(),
            });
        }
        let tx_queue = match config.mem_units("TCP_TX_QUEUE") {
            rucx_ucs::MemUnits::Bytes(b) if b >= 64 * 1024 => b as usize,
            rucx_ucs::MemUnits::Infinite => usize::MAX,
            other => {
                return Err(Error::Config {
                    var: "RUCX_TCP_TX_QUEUE".into(),
                    value: other.to_string(),
                    reason: "must be at least 64K (or inf)".into(),
                    accepted: rucx_ucs::units::MEMUNITS_FORMS.into(),
                });
            }
        };
        let user_timeout = config.time("TCP_USER_TIMEOUT");
        if user_timeout.as_millis() > u128::from(u32::MAX) {
            return Err(Error::Config {
                var: "RUCX_TCP_USER_TIMEOUT".into(),
                value: config.raw("TCP_USER_TIMEOUT")?.into(),
                reason: "too large".into(),
                accepted: rucx_ucs::units::TIME_FORMS.into(),
            });
        }
        Ok(TcpOptions {
            ifaces: config.list("TCP_IFACES").to_vec(),
            port_range,
            sndbuf: size("TCP_SNDBUF")?,
            rcvbuf: size("TCP_RCVBUF")?,
            nodelay: config.bool("TCP_NODELAY"),
            keepalive: config.bool("TCP_KEEPALIVE"),
            keepidle: secs("TCP_KEEPIDLE")?,
            keepintvl: secs("TCP_KEEPINTVL")?,
            keepcnt: keepcnt as u32,
            user_timeout,
            connect_timeout: config.time("TCP_CONNECT_TIMEOUT"),
            tx_queue,
        })
    }
}

/// The tcp component.
#[derive(Debug, Default)]
pub struct TcpComponent;

impl TcpComponent {
    /// The component, ready to register.
    pub fn arc() -> Arc<dyn Component> {
        Arc::new(TcpComponent)
    }

    fn devices(options: &TcpOptions) -> Result<Vec<addr::NetIf>> {
        let all = addr::interfaces()?;
        if options.ifaces.is_empty() {
            return Ok(all);
        }
        Ok(all
            .into_iter()
            .filter(|d| options.ifaces.contains(&d.name))
            .collect())
    }
}

impl Component for TcpComponent {
    fn name(&self) -> &'static str {
        COMPONENT
    }

    fn transports(&self) -> &'static [&'static str] {
        &[TL_NAME]
    }

    fn query(&self, config: &Config) -> Availability {
        let options = match TcpOptions::from_config(config) {
            Ok(o) => o,
            Err(e) => return Availability::Unavailable(e.to_string()),
        };
        match Self::devices(&options) {
            Err(e) => Availability::Unavailable(e.to_string()),
            Ok(d) if d.is_empty() => Availability::Unavailable(if options.ifaces.is_empty() {
                "no network interface is up with an IPv4 address".into()
            } else {
                format!(
                    "none of the interfaces in RUCX_TCP_IFACES ({}) is up with an IPv4 address",
                    options.ifaces.join(",")
                )
            }),
            Ok(_) => Availability::Available(vec![COMPONENT.to_string()]),
        }
    }

    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        if md_name != COMPONENT {
            return Err(Error::InvalidParam(format!(
                "component tcp has no memory domain {md_name:?} (it has \"tcp\")"
            )));
        }
        let options = TcpOptions::from_config(config)?;
        let devices = Self::devices(&options)?;
        if devices.is_empty() {
            return Err(Error::Unavailable {
                component: COMPONENT.into(),
                reason: "no usable network interface (see RUCX_TCP_IFACES)".into(),
            });
        }
        Ok(Arc::new(TcpMd::new(devices, options)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        Config::from_vars(&[rucx_uct::CONFIG, CONFIG], vars.iter().copied())
    }

    #[test]
    fn defaults() {
        let o = TcpOptions::default();
        assert_eq!(o.port_range, (0, 0));
        assert!(o.nodelay && o.keepalive);
        assert_eq!(o.keepcnt, 3);
        assert_eq!(o.sndbuf, None);
        // A configuration without this crate's table gives the defaults too.
        let bare = Config::new(&[rucx_uct::CONFIG]).unwrap();
        assert_eq!(TcpOptions::from_config(&bare).unwrap(), o);
    }

    #[test]
    fn option_validation() {
        let o = TcpOptions::from_config(
            &cfg(&[
                ("RUCX_TCP_PORT_RANGE", "20000-20010"),
                ("RUCX_TCP_SNDBUF", "1M"),
            ])
            .unwrap(),
        )
        .unwrap();
        assert_eq!(o.port_range, (20000, 20010));
        assert_eq!(o.sndbuf, Some(1 << 20));
        for (k, v) in [
            ("RUCX_TCP_PORT_RANGE", "5-2"),
            ("RUCX_TCP_PORT_RANGE", "0-10"),
            ("RUCX_TCP_PORT_RANGE", "x"),
            ("RUCX_TCP_KEEPIDLE", "10ms"),
            ("RUCX_TCP_KEEPCNT", "0"),
            ("RUCX_TCP_TX_QUEUE", "1K"),
            ("RUCX_TCP_SNDBUF", "inf"),
            ("RUCX_TCP_PORT_RANGE", "garbage"),
            ("RUCX_TCP_USER_TIMEOUT", "100d"),
        ] {
            // Refused where they are read (the configuration), naming the variable, rather
            // than leaving tcp unavailable when an interface opens.
            let e = cfg(&[(k, v)]).unwrap_err();
            assert!(e.to_string().contains(k), "{k}={v}: {e}");
        }
        let e = cfg(&[("RUCX_TCP_PORT_RANGE", "garbage")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("FIRST-LAST"), "{e}");
    }

    #[test]
    fn component_offers_lo() {
        let c = TcpComponent;
        let config = cfg(&[]).unwrap();
        assert_eq!(
            c.query(&config),
            Availability::Available(vec!["tcp".into()])
        );
        let md = c.open_md("tcp", &config).unwrap();
        let res = md.tl_resources();
        assert!(
            res.iter().any(|r| r.dev_name == "lo" && r.tl_name == "tcp"),
            "{res:?}"
        );
        assert!(c.open_md("nope", &config).is_err());
        let only = cfg(&[("RUCX_TCP_IFACES", "no-such-if0")]).unwrap();
        assert!(
            matches!(c.query(&only), Availability::Unavailable(r) if r.contains("no-such-if0"))
        );
    }
}
