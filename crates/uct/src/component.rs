//! Components and the registry that discovers them.

use std::fmt;
use std::sync::Arc;

use rucx_ucs::{Config, Result};

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
                    d.unavailable.push((c.name().to_string(), reason));
                }
                Availability::Available(mds) => {
                    for md in mds {
                        match c.open_md(&md, config) {
                            Ok(m) => d.domains.push(faults.wrap(m)),
                            Err(e) => d
                                .unavailable
                                .push((format!("{}/{md}", c.name()), e.to_string())),
                        }
                    }
                }
            }
        }
        Ok(d)
    }
}
