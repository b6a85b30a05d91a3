//! Components and the registry that discovers them.

use std::fmt;
use std::sync::Arc;

use rucx_ucs::config::ENV_PREFIX;
use rucx_ucs::{Config, OptKind, Result};

use crate::md::MemoryDomain;

/// Whether a component can run on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    /// It can; these are the names of its memory domains.
    Available(Vec<String>),
    /// It cannot, and this is why (missing library, no device, old driver, ...).
    Unavailable(String),
}

/// A family of memory domains (posix, tcp, cuda_copy, ib, ...).
///
/// Every component is compiled in everywhere; one that cannot run here says so through
/// [`query`](Self::query) instead of failing to link or panicking.
pub trait Component: Send + Sync + fmt::Debug {
    /// Component name.
    fn name(&self) -> &'static str;

    /// Transport names this component provides (for `RUCX_TLS` filtering).
    fn transports(&self) -> &'static [&'static str];

    /// Probe the host.
    fn query(&self, config: &Config) -> Availability;

    /// Open one of the domains named by [`query`](Self::query).
    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>>;
}

/// What discovery found.
#[derive(Debug, Default)]
pub struct Discovery {
    /// Open memory domains, in component order.
    pub domains: Vec<Arc<dyn MemoryDomain>>,
    /// Components (or domains) that cannot run here, with the reason.
    pub unavailable: Vec<(String, String)>,
    /// Components left out by `RUCX_TLS`.
    pub deselected: Vec<String>,
}

/// The option that made a component unavailable: one the user changed from its default whose
/// variable the reason names.
pub fn configured_cause<'a>(config: &'a Config, reason: &str) -> Option<(String, &'a str)> {
    config
        .options()
        .filter(|(spec, raw, _)| *raw != spec.default && spec.kind != OptKind::Secret)
        .find_map(|(spec, raw, _)| {
            let var = format!("{ENV_PREFIX}{}", spec.name);
            let named = reason.match_indices(&var).any(|(at, _)| {
                !reason[at + var.len()..]
                    .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            });
            named.then_some((var, raw))
        })
}

/// One warning when a configured option, not the host, keeps a component out.
fn warn_if_configured(config: &Config, component: &str, reason: &str) {
    if let Some((var, raw)) = configured_cause(config, reason) {
        tracing::warn!("{component} is unavailable because of {var}={raw}: {reason}");
    }
}

/// The list of compiled-in components.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    components: Vec<Arc<dyn Component>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a component.
    pub fn register(&mut self, c: Arc<dyn Component>) -> &mut Self {
        self.components.push(c);
        self
    }

    /// The registered components.
    pub fn components(&self) -> &[Arc<dyn Component>] {
        &self.components
    }

    /// Probe every component and open the domains of those selected by `tls` (the `RUCX_TLS`
    /// option when `tls_option` names one) and available here.
    ///
    /// Errors only for a malformed fault-injection rule (`RUCX_FAULT_INJECT`).
    pub fn discover(&self, config: &Config, tls_option: Option<&str>) -> Result<Discovery> {
        let faults = crate::fault::FaultRules::from_config(config)?;
        let mut d = Discovery::default();
        for c in &self.components {
            if let Some(opt) = tls_option {
                let sel = config.tls(opt);
                if !c.transports().iter().any(|t| sel.allows(t)) {
                    d.deselected.push(c.name().to_string());
                    continue;
                }
            }
            match c.query(config) {
                Availability::Unavailable(reason) => {
                    warn_if_configured(config, c.name(), &reason);
                    d.unavailable.push((c.name().to_string(), reason));
                }
                Availability::Available(mds) => {
                    for md in mds {
                        match c.open_md(&md, config) {
                            Ok(m) => d.domains.push(faults.wrap(m)),
                            Err(e) => {
                                let name = format!("{}/{md}", c.name());
                                let reason = e.to_string();
                                warn_if_configured(config, &name, &reason);
                                d.unavailable.push((name, reason));
                            }
                        }
                    }
                }
            }
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rucx_ucs::OptionSpec;

    static TABLE: &[OptionSpec] = &[
        OptionSpec {
            name: "X_IFACES",
            kind: OptKind::List,
            default: "",
            help: "",
        },
        OptionSpec {
            name: "X_IFACES_EXTRA",
            kind: OptKind::List,
            default: "",
            help: "",
        },
    ];

    #[test]
    fn a_changed_option_named_by_the_reason_is_the_cause() {
        let reason = "none of the interfaces in RUCX_X_IFACES (eth9) is up";
        let c = Config::new(&[TABLE]).unwrap();
        assert_eq!(configured_cause(&c, reason), None, "defaults cause nothing");
        let c = Config::from_vars(&[TABLE], [("RUCX_X_IFACES", "eth9")]).unwrap();
        assert_eq!(
            configured_cause(&c, reason),
            Some(("RUCX_X_IFACES".to_string(), "eth9"))
        );
        // A longer name that merely starts with the variable is not it.
        let c = Config::from_vars(&[TABLE], [("RUCX_X_IFACES", "eth9")]).unwrap();
        assert_eq!(configured_cause(&c, "see RUCX_X_IFACES_EXTRA"), None);
    }
}
