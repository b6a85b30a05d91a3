//! rucx `sim` transport: several workers of one process joined by a simulated fabric that the
//! test holds and steers, for deterministic protocol tests on machines without GPU or NIC.
//!
//! A test builds one [`Fabric`] from a [`FabricSpec`] (which lanes exist, how messages are
//! delivered), adds a node per worker ([`Fabric::add_node`]) and gives each context the registry
//! of its node ([`Fabric::registry`]). Every node gets the same lanes, each one memory domain and
//! one transport of the same name, chosen to look like a real transport to the protocol layer:
//!
//! | lane | like | memory | device type | operations |
//! |---|---|---|---|---|
//! | `sim_shm` | posix | host | intra-node | AM short/bcopy/zcopy, put short, put/get zcopy, shared staging |
//! | `sim_net` | tcp | host | network | the same, with tcp's limits and slower model |
//! | `sim_ipc` | cuda_ipc | simulated GPU | intra-node | put/get zcopy between workers |
//! | `sim_copy` | cuda_copy | host and simulated GPU | accelerator | put short, put/get zcopy inside one worker; classifies GPU memory |
//!
//! Simulated GPU memory is real host memory of the test that it marks as device memory of a GPU
//! ([`Fabric::mark_device`]); the copy domain classifies it as `MemoryType::Cuda`, and only the
//! ipc and copy lanes may touch it.
//!
//! The controls ([`Fabric`]): delivery in order, in seeded random order or by hand
//! ([`Delivery`]; active messages of one endpoint always stay in order), `NoResource` for the
//! next operations of a lane ([`Fabric::fail_next_ops`]), a failed n-th registration or a
//! registration budget per domain and node ([`Fabric::fail_registration`],
//! [`Fabric::set_reg_budget`]; `RUCX_FAULT_INJECT` works too, as for every domain), and the
//! failure of a node ([`Fabric::fail_node`]).
//!
//! Every copy is checked against the registration of its local buffer and the live registration
//! behind its remote key; what a correct protocol never does (an access past either, memory of
//! the wrong type on a lane, freed device memory, a released registration) is refused and
//! recorded in [`Fabric::violations`], which tests assert empty.

mod fabric;
mod iface;
mod md;
mod mem;

use std::sync::Arc;

use rucx_ucs::{Config, Error, Result};
use rucx_uct::{Availability, Component, MemoryDomain};

pub use fabric::{
    Delivery, Fabric, FabricSpec, HeldInfo, HeldWhat, HostLimits, LaneKind, NodeId, Stats,
    registration_node,
};
pub use iface::{SimEp, SimIface};
pub use md::SimMd;

/// Component name (also the name in every packed key and address of the sim).
pub const COMPONENT: &str = "sim";

/// The `sim` component of one node of a fabric.
#[derive(Debug)]
pub struct SimComponent {
    fabric: Fabric,
    node: NodeId,
}

impl SimComponent {
    /// The component of `node` (usually made through [`Fabric::registry`]).
    pub fn new(fabric: Fabric, node: NodeId) -> SimComponent {
        SimComponent { fabric, node }
    }
}

impl Component for SimComponent {
    fn name(&self) -> &'static str {
        COMPONENT
    }

    fn transports(&self) -> &'static [&'static str] {
        &["sim_shm", "sim_net", "sim_ipc", "sim_copy"]
    }

    fn query(&self, _config: &Config) -> Availability {
        let st = self.fabric.lock();
        if self.node.0 >= st.node_count() {
            return Availability::Unavailable(format!("no node {} in this fabric", self.node.0));
        }
        Availability::Available(
            st.spec
                .lanes()
                .into_iter()
                .map(|k| k.name().to_string())
                .collect(),
        )
    }

    fn open_md(&self, md_name: &str, _config: &Config) -> Result<Arc<dyn MemoryDomain>> {
        let kind = LaneKind::from_name(md_name)
            .filter(|k| self.fabric.spec().lanes().contains(k))
            .ok_or_else(|| {
                Error::InvalidParam(format!("this sim fabric has no memory domain {md_name:?}"))
            })?;
        Ok(Arc::new(SimMd::new(self.fabric.clone(), self.node, kind)))
    }
}

#[cfg(test)]
mod tests;
