//! Every transport component compiled into rucx, in one list.
//!
//! This is the only crate that names concrete components; the protocol layer receives the
//! [`Registry`] and sees traits and attributes only.

use std::sync::Arc;

use rucx_ucs::OptionSpec;
use rucx_uct::Registry;

/// A registry holding every compiled-in component, in preference order.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Arc::new(rucx_uct_self::SelfComponent));
    r.register(Arc::new(rucx_uct_posix::PosixComponent));
    r.register(Arc::new(rucx_uct_tcp::TcpComponent));
    r.register(Arc::new(rucx_uct_cuda_copy::CudaCopyComponent));
    r.register(Arc::new(rucx_uct_cuda_ipc::CudaIpcComponent));
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
