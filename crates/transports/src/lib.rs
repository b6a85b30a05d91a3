//! Every transport component compiled into rucx, in one list.
//!
//! This is the only crate that names concrete components; the protocol layer receives the
//! [`Registry`] and sees traits and attributes only.

use std::sync::Arc;

use rucx_ucs::OptionSpec;
use rucx_uct::Registry;

/// What the CUDA side tells the ib component about each GPU (BAR1, GPUDirect and dma-buf
/// attributes), so that GPU-direct registrations are decided per GPU before the first transfer.
#[derive(Debug)]
struct CudaFacts;

impl rucx_uct_ib::gpudirect::GpuSupport for CudaFacts {
    fn gpus(&self) -> Vec<rucx_uct_ib::gpudirect::GpuFacts> {
        if rucx_cuda::driver().is_err() {
            return Vec::new();
        }
        rucx_cuda::report()
            .gpus
            .into_iter()
            .map(|g| rucx_uct_ib::gpudirect::GpuFacts {
                ordinal: g.ordinal,
                name: g.name,
                pci_bus_id: Some(g.pci_bus_id),
                memory_bytes: Some(g.total_mem),
                bar1_total: g.bar1.as_ref().ok().map(|b| b.total),
                bar1_free: g.bar1.as_ref().ok().map(|b| b.free),
                gdr_supported: Some(g.gpu_direct_rdma),
                dmabuf_supported: Some(g.dma_buf),
            })
            .collect()
    }

    fn can_export_dmabuf(&self) -> bool {
        // Exporting (cuMemGetHandleForAddressRange) is not wired yet: the domain uses the
        // peer-memory route where it exists, and says so otherwise.
        false
    }

    fn export_dmabuf(
        &self,
        region: &rucx_uct::MemRegion,
    ) -> rucx_ucs::Result<rucx_uct_ib::gpudirect::DmaBuf> {
        Err(rucx_ucs::Error::Unsupported {
            what: format!("dma-buf export of {} bytes of GPU memory", region.len),
            why: "not implemented in this build; GPU-direct RDMA uses the peer-memory module"
                .into(),
        })
    }
}

/// A registry holding every compiled-in component, in preference order.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Arc::new(rucx_uct_self::SelfComponent));
    r.register(Arc::new(rucx_uct_posix::PosixComponent));
    r.register(Arc::new(rucx_uct_tcp::TcpComponent));
    r.register(Arc::new(rucx_uct_cuda_copy::CudaCopyComponent));
    r.register(Arc::new(rucx_uct_cuda_ipc::CudaIpcComponent));
    r.register(Arc::new(rucx_uct_gdr_copy::GdrCopyComponent));
    r.register(Arc::new(
        rucx_uct_ib::IbComponent::new().with_gpu_support(Arc::new(CudaFacts)),
    ));
    r
}

/// The option tables of the services layer, the transport layer and every component.
pub fn config_tables() -> Vec<&'static [OptionSpec]> {
    vec![
        rucx_ucs::log::CONFIG,
        rucx_ucs::rcache::CONFIG,
        rucx_uct::CONFIG,
        rucx_uct_posix::CONFIG,
        rucx_uct_tcp::CONFIG,
        rucx_cuda::CONFIG,
        rucx_uct_cuda_copy::CONFIG,
        rucx_uct_cuda_ipc::CONFIG,
        rucx_uct_ib::CONFIG,
        rucx_uct_gdr_copy::CONFIG,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_component_reports_availability_and_tables_are_consistent() {
        let cfg = rucx_ucs::Config::new(&config_tables()).expect("option tables are valid");
        let d = registry().discover(&cfg, Some("TLS")).unwrap();
        assert!(d.domains.iter().any(|m| m.name() == "self"));
        for (name, reason) in &d.unavailable {
            assert!(!reason.is_empty(), "{name} is unavailable without a reason");
        }
    }
}
