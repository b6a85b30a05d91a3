//! Tests of `context`.

use std::sync::atomic::AtomicUsize;

use rucx_ucs::RegErrorKind;
use rucx_uct::{
    Availability, Component, Iface, IfaceParams, MdAttr, MemTypeFlags, RemoteKey, TlResource,
};

use super::*;

/// What the test domain's "driver" knows: allocations (with ids) and which of them fail
/// to register, and how.
#[derive(Debug, Default)]
struct Driver {
    allocs: Mutex<Vec<AllocId>>,
    failing: Mutex<Vec<(usize, RegErrorKind)>>,
    calls: AtomicUsize,
}

impl Driver {
    fn alloc(&self, base: usize, len: usize, id: u64) {
        let mut a = self.allocs.lock().unwrap();
        a.retain(|x| x.base != base);
        a.push(AllocId { base, len, id });
    }
    fn fail(&self, base: usize, kind: RegErrorKind) {
        self.failing.lock().unwrap().push((base, kind));
    }
    fn heal(&self, base: usize) {
        self.failing.lock().unwrap().retain(|(b, _)| *b != base);
    }
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
    fn find(&self, addr: usize) -> Option<AllocId> {
        self.allocs
            .lock()
            .unwrap()
            .iter()
            .find(|a| addr >= a.base && addr < a.base + a.len)
            .copied()
    }
}

#[derive(Debug)]
struct TestMd {
    attr: MdAttr,
    drv: Arc<Driver>,
}

impl MemoryDomain for TestMd {
    fn name(&self) -> &str {
        "testmd"
    }
    fn attr(&self) -> &MdAttr {
        &self.attr
    }
    fn tl_resources(&self) -> Vec<TlResource> {
        Vec::new()
    }
    fn open_iface(&self, _: &TlResource, _: &IfaceParams) -> Result<Box<dyn Iface>> {
        Err(Error::InvalidParam("no interfaces".into()))
    }
    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        self.drv.calls.fetch_add(1, Ordering::SeqCst);
        // Fails when the range touches a failing allocation (a cached registration of host
        // memory is widened to whole pages).
        let allocs = self.drv.allocs.lock().unwrap().clone();
        let fail = self
            .drv
            .failing
            .lock()
            .unwrap()
            .iter()
            .find(|(b, _)| {
                let len = allocs.iter().find(|a| a.base == *b).map_or(1, |a| a.len);
                *b < region.end() && region.addr < b + len
            })
            .map(|(_, k)| *k);
        // The null page is no memory (as posix says of it).
        let fail =
            fail.or((region.addr == 0 && region.len > 0).then_some(RegErrorKind::BadAddress));
        // Zero bytes at a failing allocation's base: refused too.
        let fail = fail.or_else(|| {
            let refused = self.drv.failing.lock().unwrap().clone();
            refused
                .iter()
                .find(|(b, _)| region.len == 0 && *b == region.addr)
                .map(|(_, k)| *k)
        });
        match fail {
            Some(kind) => Err(region.reg_error("testmd", kind, "refused by the test", "")),
            None => Ok(MemHandle::new(region, "testmd", Arc::new(()))),
        }
    }
    fn mkey_pack(&self, _: &MemHandle) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn rkey_unpack(&self, _: &[u8]) -> Result<RemoteKey> {
        Err(Error::InvalidParam("no keys".into()))
    }
    fn allocation_of(&self, region: &MemRegion) -> Option<AllocId> {
        if region.mem_type.is_gpu() {
            self.drv.find(region.addr)
        } else {
            None
        }
    }
}

#[derive(Debug)]
struct TestComponent(Arc<Driver>);

impl Component for TestComponent {
    fn name(&self) -> &'static str {
        "testmd"
    }
    fn transports(&self) -> &'static [&'static str] {
        &["testmd"]
    }
    fn query(&self, _: &Config) -> Availability {
        Availability::Available(vec!["testmd".into()])
    }
    fn open_md(&self, _: &str, _: &Config) -> Result<Arc<dyn MemoryDomain>> {
        let attr = MdAttr::new("testmd")
            .with(MemoryType::Host, MemTypeFlags::REG | MemTypeFlags::ACCESS)
            .with(MemoryType::Cuda, MemTypeFlags::REG | MemTypeFlags::ACCESS);
        Ok(Arc::new(TestMd {
            attr,
            drv: self.0.clone(),
        }))
    }
}

fn context(vars: &[(&str, &str)]) -> (Context, Arc<Driver>) {
    let drv = Arc::new(Driver::default());
    let mut reg = Registry::new();
    reg.register(Arc::new(TestComponent(drv.clone())));
    let tables = [
        rucx_ucs::rcache::CONFIG,
        rucx_uct::CONFIG,
        crate::config::CONFIG,
    ];
    let cfg = Config::from_vars(&tables, vars.iter().copied()).unwrap();
    (Context::new(&reg, cfg).unwrap(), drv)
}

fn gpu(addr: usize, len: usize, device: u32) -> MemRegion {
    MemRegion {
        addr,
        len,
        mem_type: MemoryType::Cuda,
        device: Some(device),
    }
}

fn kind_of(r: Result<RegGuard>) -> RegErrorKind {
    r.unwrap_err()
        .as_registration()
        .expect("a registration error")
        .kind
}

#[test]
fn a_buffer_refusal_steers_that_buffer_and_keeps_the_domain() {
    let (ctx, drv) = context(&[]);
    drv.alloc(0x10_0000, 1 << 20, 1); // a pool allocation the domain cannot export
    drv.alloc(0x20_0000, 1 << 20, 2); // a plain one
    drv.fail(0x10_0000, RegErrorKind::NotExportable);
    let epoch = ctx.epoch();
    let k = kind_of(ctx.register(0, gpu(0x10_0000, 4096, 0)));
    assert_eq!(k, RegErrorKind::NotExportable);
    assert!(ctx.demotions().is_empty(), "{:?}", ctx.demotions());
    assert!(ctx.can_register(0, MemoryType::Cuda, Some(0)));
    assert_eq!(ctx.epoch(), epoch, "no re-planning of the tables");
    let r = ctx.refusals();
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!((r[0].md.as_str(), r[0].count), ("testmd", 1));
    assert_eq!(r[0].device, Some(0));
    assert!(r[0].to_string().contains("stays in use"), "{}", r[0]);
    // The same allocation again (another range of it): refused from memory, without asking
    // the driver, and counted once.
    let calls = drv.calls();
    let again = ctx.register(0, gpu(0x10_0000 + 8192, 100, 0)).unwrap_err();
    assert_eq!(drv.calls(), calls);
    let again = again.as_registration().unwrap();
    assert_eq!((again.addr, again.len), (0x10_0000 + 8192, 100));
    assert_eq!(ctx.refusals()[0].count, 1);
    // Other buffers of the same GPU still register with the domain.
    ctx.register(0, gpu(0x20_0000, 4096, 0)).unwrap();
    // The pool memory is freed and the range reused by an exportable allocation: the
    // remembered refusal must not outlive it.
    drv.alloc(0x10_0000, 1 << 20, 3);
    drv.heal(0x10_0000);
    ctx.register(0, gpu(0x10_0000, 4096, 0)).unwrap();
    assert!(ctx.demotions().is_empty());
}

#[test]
fn a_domain_failure_demotes_that_device_once() {
    let (ctx, drv) = context(&[]);
    drv.alloc(0x10_0000, 1 << 20, 1);
    drv.alloc(0x20_0000, 1 << 20, 2);
    drv.fail(0x10_0000, RegErrorKind::BadAddress);
    drv.fail(0x20_0000, RegErrorKind::BadAddress);
    let epoch = ctx.epoch();
    assert_eq!(
        kind_of(ctx.register(0, gpu(0x10_0000, 4096, 0))),
        RegErrorKind::BadAddress
    );
    assert_eq!(ctx.epoch(), epoch + 1, "tables are re-planned");
    let d = ctx.demotions();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(
        (d[0].md.as_str(), d[0].mem_type, d[0].device),
        ("testmd", MemoryType::Cuda, Some(0))
    );
    assert!(
        d[0].knob.contains("RUCX_REG_SKIP=testmd:cuda"),
        "{:?}",
        d[0]
    );
    assert!(!ctx.can_register(0, MemoryType::Cuda, Some(0)));
    assert!(ctx.demotion_of(0, MemoryType::Cuda, Some(0)).is_some());
    // Only that device, and only that memory type.
    assert!(ctx.can_register(0, MemoryType::Cuda, Some(1)));
    assert!(ctx.can_register(0, MemoryType::Host, None));
    // A second failure there adds nothing.
    let _ = ctx.register(0, gpu(0x20_0000, 4096, 0));
    assert_eq!(ctx.demotions().len(), 1);
    assert_eq!(ctx.epoch(), epoch + 1);
    assert!(ctx.refusals().is_empty());
}

#[test]
fn an_exhausted_aperture_is_retried_once_then_demotes() {
    let (ctx, drv) = context(&[]);
    drv.alloc(0x10_0000, 1 << 20, 1);
    drv.fail(0x10_0000, RegErrorKind::ApertureExhausted);
    let calls = drv.calls();
    assert_eq!(
        kind_of(ctx.register(0, gpu(0x10_0000, 4096, 0))),
        RegErrorKind::ApertureExhausted
    );
    assert_eq!(drv.calls(), calls + 2, "one retry after eviction");
    assert_eq!(ctx.demotions().len(), 1);
}

#[test]
fn host_refusals_without_an_allocation_identity_are_counted_not_remembered() {
    let (ctx, drv) = context(&[]);
    let buf = vec![0u8; 8192];
    let base = buf.as_ptr() as usize;
    drv.alloc(base, buf.len(), 1);
    drv.fail(base, RegErrorKind::NotExportable);
    for _ in 0..2 {
        let r = ctx.register_uncached(0, MemRegion::of_slice(&buf));
        assert_eq!(kind_of(r), RegErrorKind::NotExportable);
    }
    assert!(ctx.demotions().is_empty());
    assert_eq!(ctx.refusals()[0].count, 2);
    assert!(ctx.can_register(0, MemoryType::Host, None));
    drv.heal(base);
    assert!(ctx.register(0, MemRegion::of_slice(&buf)).is_ok());
}

#[test]
fn injected_faults_take_the_same_path() {
    // The fault injector wraps the test domain: not_exportable refuses the buffer only,
    // the default kind (bad address) demotes.
    let (ctx, _) = context(&[(
        "RUCX_FAULT_INJECT",
        "md=testmd,mem=host,after=0,times=1,kind=not_exportable",
    )]);
    let buf = vec![0u8; 4096];
    assert!(ctx.register(0, MemRegion::of_slice(&buf)).is_err());
    assert!(ctx.demotions().is_empty());
    assert!(ctx.register(0, MemRegion::of_slice(&buf)).is_ok());
    let (ctx, _) = context(&[("RUCX_FAULT_INJECT", "md=testmd,mem=host,after=0")]);
    assert!(ctx.register(0, MemRegion::of_slice(&buf)).is_err());
    assert_eq!(ctx.demotions().len(), 1);
    assert!(ctx.refusals().is_empty());
}

/// An empty buffer (an empty `Vec`'s pointer dangles just above 0) is registered as it is: not
/// widened by the cache to the null page, whose refusal as a bad address demoted the domain
/// for all host memory (`Worker::mem_map` of an empty `Vec` did so to posix). A domain that
/// refuses zero bytes demotes nothing and has nothing recorded.
#[test]
fn an_empty_buffer_is_registered_as_it_is_and_demotes_nothing() {
    let (ctx, drv) = context(&[]);
    let empty: Vec<u8> = Vec::new();
    let r = MemRegion::of_slice(&empty);
    assert!(r.addr < 4096, "an empty Vec's pointer dangles near 0");
    let g = ctx.register(0, r).unwrap();
    assert_eq!(*g.registration().region(), r, "registered as it is");
    assert!(ctx.register_uncached(0, r).is_ok());
    // The page it would have been widened to is refused, and would demote.
    let page = MemRegion {
        addr: 0,
        len: 4096,
        ..r
    };
    for region in [r, gpu(0x30_0000, 0, 0)] {
        drv.fail(region.addr, RegErrorKind::BadAddress);
        assert_eq!(kind_of(ctx.register(0, region)), RegErrorKind::BadAddress);
    }
    assert!(ctx.demotions().is_empty(), "{:?}", ctx.demotions());
    assert!(ctx.refusals().is_empty());
    assert!(ctx.can_register(0, MemoryType::Host, None));
    assert_eq!(kind_of(ctx.register(0, page)), RegErrorKind::BadAddress);
    assert_eq!(
        ctx.demotions().len(),
        1,
        "a real page is the domain's business"
    );
}
