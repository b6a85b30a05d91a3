//! The `ib` component: discovery, availability and domain opening.

use std::sync::Arc;

use rucx_ucs::{Config, Result};
use rucx_uct::{Availability, Component, MemoryDomain};

use crate::attr::{COMPONENT, TL_NAME};
use crate::config::IbConfig;
use crate::gpudirect::{GpuSupport, NoGpus};
use crate::md::IbMd;
use crate::probe::{HostProbe, availability, describe_port, probe};
use crate::sys::SystemVerbs;
use crate::verbs::Verbs;

/// The verbs component. Registered everywhere; on a host without libibverbs, without an RDMA
/// driver or without an ACTIVE port it reports *unavailable* with the precise reason.
#[derive(Debug, Clone)]
pub struct IbComponent {
    verbs: Arc<dyn Verbs>,
    gpu: Arc<dyn GpuSupport>,
}

impl Default for IbComponent {
    fn default() -> Self {
        Self::new()
    }
}

impl IbComponent {
    /// The component over this host's libibverbs, knowing no GPU.
    pub fn new() -> Self {
        Self::with_verbs(Arc::new(SystemVerbs::new()))
    }

    /// The component over another [`Verbs`] implementation (a software fabric in tests).
    pub fn with_verbs(verbs: Arc<dyn Verbs>) -> Self {
        IbComponent {
            verbs,
            gpu: Arc::new(NoGpus),
        }
    }

    /// Connect the CUDA side: GPU facts for the GPU-direct decisions and dma-buf export.
    pub fn with_gpu_support(mut self, gpu: Arc<dyn GpuSupport>) -> Self {
        self.gpu = gpu;
        self
    }

    /// The facts discovery gathers.
    pub fn probe(&self) -> HostProbe {
        probe(&*self.verbs)
    }

    /// Open the domain of device `name` with its concrete type (GPU-direct plan, ports, raw
    /// registration of dma-bufs).
    pub fn open(&self, name: &str, config: &Config) -> Result<IbMd> {
        IbMd::open(&*self.verbs, name, config, self.gpu.clone())
    }

    /// One line per port of every device, for `rucx-info -d`; the reason when there is none.
    pub fn describe(&self, config: &Config) -> std::result::Result<Vec<String>, String> {
        let p = self.probe();
        if let Availability::Unavailable(r) = self.availability(&p, config) {
            return Err(r);
        }
        let mut lines = Vec::new();
        for (_, r) in p.devices.into_iter().flatten().flatten() {
            if let Ok(rep) = r {
                lines.extend(rep.ports.iter().map(|port| describe_port(&rep, port)));
            }
        }
        Ok(lines)
    }

    fn availability(&self, p: &HostProbe, config: &Config) -> Availability {
        match IbConfig::from_config(config) {
            Ok(c) => availability(p, &c.devices),
            Err(e) => Availability::Unavailable(format!("configuration error: {e}")),
        }
    }
}

impl Component for IbComponent {
    fn name(&self) -> &'static str {
        COMPONENT
    }

    fn transports(&self) -> &'static [&'static str] {
        &[TL_NAME]
    }

    fn query(&self, config: &Config) -> Availability {
        self.availability(&self.probe(), config)
    }

    fn open_md(&self, md_name: &str, config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        Ok(Arc::new(self.open(md_name, config)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Neither machine of this project has libibverbs, an RDMA driver or a NIC: the component
    /// must say so precisely, and discovery must go on without it.
    #[test]
    fn availability_on_this_machine() {
        let c = IbComponent::new();
        let config = Config::new(&[crate::CONFIG]).unwrap();
        let p = c.probe();
        match c.query(&config) {
            Availability::Unavailable(reason) => {
                eprintln!("ib: unavailable: {reason}");
                match (&p.library, &p.sysfs) {
                    (Err(_), _) => assert!(
                        reason.starts_with(
                            "libibverbs.so.1 not found (install rdma-core/libibverbs1)"
                        ),
                        "{reason}"
                    ),
                    (Ok(()), crate::verbs::SysfsDevices::Missing) => {
                        assert!(
                            reason.contains("/sys/class/infiniband does not exist"),
                            "{reason}"
                        )
                    }
                    (Ok(()), _) => assert!(!reason.is_empty()),
                }
                assert!(c.describe(&config).is_err());
            }
            Availability::Available(mds) => {
                // A host with a NIC: every listed domain opens.
                for m in mds {
                    c.open_md(&m, &config).unwrap();
                }
            }
        }
        let mut reg = rucx_uct::Registry::new();
        reg.register(Arc::new(c));
        let d = reg.discover(&config, None).unwrap();
        if d.domains.is_empty() {
            assert_eq!(d.unavailable.len(), 1);
            assert_eq!(d.unavailable[0].0, "ib");
        }
    }

    #[test]
    fn bad_configuration_is_reported_as_the_reason() {
        let c = IbComponent::new();
        let config =
            Config::from_vars(&[crate::CONFIG], [("RUCX_IB_DEVICES", "mlx5_0:x")]).unwrap();
        match c.availability(&c.probe(), &config) {
            Availability::Unavailable(r) => assert!(r.contains("RUCX_IB_DEVICES"), "{r}"),
            a => panic!("{a:?}"),
        }
    }
}
