//! Fault injection: a wrapper around any memory domain that fails registrations the way a real
//! driver would, so that every demotion path can run on machines where the real failure cannot
//! be caused (no GPU, no NIC).
//!
//! Rules come from `RUCX_FAULT_INJECT` (or [`FaultRules::parse`]): rules separated by `;`, each a
//! comma-separated list of `key=value`:
//!
//! - `md=NAME` (required): the domain to wrap (`posix`, `self`, `cuda_ipc`, ...);
//! - `mem=TYPE`: only buffers of this memory type (default: every type);
//! - `after=N`: let the first N registrations succeed, fail every later one;
//! - `times=N` (with `after`): fail only N registrations after the first `after`, then let them
//!   succeed again (a refusal of some buffers rather than of the domain; pair it with
//!   `kind=not_exportable`);
//! - `budget=SIZE`: fail a registration that would take the live registered bytes past SIZE
//!   (models a BAR1 aperture; released bytes count again);
//! - `kind=bad_address|aperture|not_exportable|no_memory`: the error kind to return (default:
//!   `aperture` for budget rules, `bad_address` otherwise).
//!
//! Example: `RUCX_FAULT_INJECT="md=posix,mem=host,budget=256M"`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rucx_ucs::units::parse_memunits;
use rucx_ucs::{Config, Error, MemUnits, MemoryType, RegErrorKind, Result};

use crate::attr::MdAttr;
use crate::iface::{Iface, IfaceParams};
use crate::md::{MemHandle, MemRegion, MemoryDomain, RemoteKey, TlResource};

/// Name of the option (without the `RUCX_` prefix).
pub const OPTION: &str = "FAULT_INJECT";

const ACCEPTED: &str = "rules separated by ';', each `md=NAME[,mem=TYPE][,after=N[,times=N]][,budget=SIZE][,kind=bad_address|aperture|not_exportable|no_memory]`, or empty";

/// One injection rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// Domain name to wrap.
    pub md: String,
    /// Memory type filter.
    pub mem: Option<MemoryType>,
    /// Successes allowed before failing.
    pub after: Option<u64>,
    /// How many registrations fail after `after` (`None`: every later one).
    pub times: Option<u64>,
    /// Live-bytes budget.
    pub budget: Option<u64>,
    /// Error kind to return.
    pub kind: RegErrorKind,
}

/// A parsed set of rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultRules {
    rules: Vec<FaultRule>,
}

fn cfg_err(value: &str, reason: String) -> Error {
    Error::Config {
        var: format!("RUCX_{OPTION}"),
        value: value.to_string(),
        reason,
        accepted: ACCEPTED.to_string(),
    }
}

impl FaultRules {
    /// Parse rules; an empty string means none.
    pub fn parse(text: &str) -> Result<FaultRules> {
        let mut rules = Vec::new();
        for rule_text in text.split(';').map(str::trim).filter(|r| !r.is_empty()) {
            let mut md = None;
            let mut mem = None;
            let mut after = None;
            let mut times = None;
            let mut budget = None;
            let mut kind = None;
            for kv in rule_text
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
            {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| cfg_err(text, format!("{kv:?} is not key=value")))?;
                let v = v.trim();
                match k.trim() {
                    "md" => md = Some(v.to_string()),
                    "mem" => {
                        mem = Some(
                            v.parse::<MemoryType>()
                                .map_err(|e| cfg_err(text, e.to_string()))?,
                        )
                    }
                    "after" => {
                        after = Some(v.parse::<u64>().map_err(|_| {
                            cfg_err(text, format!("after={v:?} is not a non-negative integer"))
                        })?)
                    }
                    "times" => {
                        times = Some(v.parse::<u64>().map_err(|_| {
                            cfg_err(text, format!("times={v:?} is not a non-negative integer"))
                        })?)
                    }
                    "budget" => {
                        budget = Some(match parse_memunits(v).map_err(|e| cfg_err(text, e))? {
                            MemUnits::Bytes(b) => b,
                            other => {
                                return Err(cfg_err(
                                    text,
                                    format!("budget={other} is not a byte count"),
                                ));
                            }
                        })
                    }
                    "kind" => {
                        kind = Some(match v {
                            "bad_address" => RegErrorKind::BadAddress,
                            "aperture" => RegErrorKind::ApertureExhausted,
                            "not_exportable" => RegErrorKind::NotExportable,
                            "no_memory" => RegErrorKind::NoMemory,
                            other => return Err(cfg_err(text, format!("unknown kind {other:?}"))),
                        })
                    }
                    other => return Err(cfg_err(text, format!("unknown key {other:?}"))),
                }
            }
            let md = md.ok_or_else(|| cfg_err(text, format!("rule {rule_text:?} has no md=")))?;
            if after.is_none() && budget.is_none() {
                return Err(cfg_err(
                    text,
                    format!("rule {rule_text:?} needs after=N or budget=SIZE"),
                ));
            }
            if times.is_some() && after.is_none() {
                return Err(cfg_err(
                    text,
                    format!("rule {rule_text:?}: times=N needs after=N"),
                ));
            }
            let kind = kind.unwrap_or(if budget.is_some() {
                RegErrorKind::ApertureExhausted
            } else {
                RegErrorKind::BadAddress
            });
            rules.push(FaultRule {
                md,
                mem,
                after,
                times,
                budget,
                kind,
            });
        }
        Ok(FaultRules { rules })
    }

    /// Rules from the `RUCX_FAULT_INJECT` option, if the configuration declares it.
    pub fn from_config(config: &Config) -> Result<FaultRules> {
        if config.has(OPTION) {
            Self::parse(config.string(OPTION))
        } else {
            Ok(FaultRules::default())
        }
    }

    /// True when no rule is set.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Wrap `md` when a rule names it, else return it unchanged.
    pub fn wrap(&self, md: Arc<dyn MemoryDomain>) -> Arc<dyn MemoryDomain> {
        let rules: Vec<_> = self
            .rules
            .iter()
            .filter(|r| r.md == md.name())
            .cloned()
            .collect();
        if rules.is_empty() {
            md
        } else {
            tracing::info!(
                "fault injection active on memory domain {}: {rules:?}",
                md.name()
            );
            Arc::new(FaultInjectingMd::new(md, rules))
        }
    }
}

#[derive(Debug)]
struct RuleState {
    rule: FaultRule,
    successes: AtomicU64,
    /// Registrations this rule failed (for `times`).
    failures: AtomicU64,
    live_bytes: Arc<AtomicU64>,
}

/// Releases budgeted bytes when the registration goes away.
#[derive(Debug)]
struct BudgetGuard {
    bytes: u64,
    live: Arc<AtomicU64>,
}

impl Drop for BudgetGuard {
    fn drop(&mut self) {
        self.live.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A memory domain that fails registrations according to rules, delegating everything else.
#[derive(Debug)]
pub struct FaultInjectingMd {
    inner: Arc<dyn MemoryDomain>,
    rules: Vec<RuleState>,
    /// Serializes budget check-and-add.
    lock: Mutex<()>,
    injected: AtomicU64,
}

impl FaultInjectingMd {
    /// Wrap `inner` with `rules` (rules naming other domains are ignored).
    pub fn new(inner: Arc<dyn MemoryDomain>, rules: Vec<FaultRule>) -> Self {
        let rules = rules
            .into_iter()
            .filter(|r| r.md == inner.name())
            .map(|rule| RuleState {
                rule,
                successes: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                live_bytes: Arc::new(AtomicU64::new(0)),
            })
            .collect();
        FaultInjectingMd {
            inner,
            rules,
            lock: Mutex::new(()),
            injected: AtomicU64::new(0),
        }
    }

    /// How many registrations were failed on purpose so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    fn fail(&self, region: &MemRegion, rule: &FaultRule, detail: String) -> Error {
        self.injected.fetch_add(1, Ordering::Relaxed);
        region.reg_error(
            self.inner.name(),
            rule.kind,
            format!("injected by RUCX_{OPTION}: {detail}"),
            format!("unset RUCX_{OPTION} to stop injecting"),
        )
    }
}

impl MemoryDomain for FaultInjectingMd {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn attr(&self) -> &MdAttr {
        self.inner.attr()
    }

    fn tl_resources(&self) -> Vec<TlResource> {
        self.inner.tl_resources()
    }

    fn open_iface(&self, tl: &TlResource, params: &IfaceParams) -> Result<Box<dyn Iface>> {
        self.inner.open_iface(tl, params)
    }

    unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut guards: Vec<BudgetGuard> = Vec::new();
        for st in &self.rules {
            if st.rule.mem.is_some_and(|m| m != region.mem_type) {
                continue;
            }
            if let Some(after) = st.rule.after
                && st.successes.load(Ordering::Acquire) >= after
                && st
                    .rule
                    .times
                    .is_none_or(|t| st.failures.load(Ordering::Acquire) < t)
            {
                st.failures.fetch_add(1, Ordering::AcqRel);
                return Err(self.fail(
                    &region,
                    &st.rule,
                    format!("{after} registrations allowed, this is a later one"),
                ));
            }
            if let Some(budget) = st.rule.budget {
                let live = st.live_bytes.load(Ordering::Acquire);
                if live.saturating_add(region.len as u64) > budget {
                    return Err(self.fail(
                        &region,
                        &st.rule,
                        format!(
                            "{live} bytes registered + {} requested exceeds the {budget}-byte budget",
                            region.len
                        ),
                    ));
                }
            }
        }
        // SAFETY: the caller upholds mem_reg's contract for `region`; we pass it on unchanged.
        let memh = unsafe { self.inner.mem_reg(region)? };
        for st in &self.rules {
            if st.rule.mem.is_some_and(|m| m != region.mem_type) {
                continue;
            }
            st.successes.fetch_add(1, Ordering::AcqRel);
            if st.rule.budget.is_some() {
                st.live_bytes.fetch_add(region.len as u64, Ordering::AcqRel);
                guards.push(BudgetGuard {
                    bytes: region.len as u64,
                    live: st.live_bytes.clone(),
                });
            }
        }
        Ok(if guards.is_empty() {
            memh
        } else {
            memh.with_guard(Arc::new(guards))
        })
    }

    fn mkey_pack(&self, memh: &MemHandle) -> Result<Vec<u8>> {
        self.inner.mkey_pack(memh)
    }

    fn rkey_unpack(&self, packed: &[u8]) -> Result<RemoteKey> {
        self.inner.rkey_unpack(packed)
    }

    fn detect_mem_type(&self, addr: usize, len: usize) -> Result<Option<MemRegion>> {
        self.inner.detect_mem_type(addr, len)
    }

    fn mem_still_valid(&self, memh: &MemHandle) -> bool {
        self.inner.mem_still_valid(memh)
    }

    fn allocation_of(&self, region: &MemRegion) -> Option<crate::md::AllocId> {
        self.inner.allocation_of(region)
    }

    fn gpu_uuid(&self, device: u32) -> Option<[u8; 16]> {
        self.inner.gpu_uuid(device)
    }

    fn mem_alloc_shared(&self, len: usize) -> Result<Option<crate::md::SharedAlloc>> {
        self.inner.mem_alloc_shared(len)
    }

    fn rkey_ptr(&self, rkey: &RemoteKey) -> Result<Option<usize>> {
        self.inner.rkey_ptr(rkey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rules() {
        let r = FaultRules::parse(
            "md=posix,mem=host,after=3; md=cuda_ipc,budget=256M,kind=not_exportable",
        )
        .unwrap();
        assert_eq!(r.rules.len(), 2);
        assert_eq!(r.rules[0].after, Some(3));
        assert_eq!(r.rules[0].kind, RegErrorKind::BadAddress);
        assert_eq!(r.rules[1].budget, Some(256 << 20));
        assert_eq!(r.rules[1].kind, RegErrorKind::NotExportable);
        assert!(FaultRules::parse("").unwrap().is_empty());
        let r = FaultRules::parse("md=posix,after=1,times=2,kind=not_exportable").unwrap();
        assert_eq!((r.rules[0].after, r.rules[0].times), (Some(1), Some(2)));
        assert_eq!(r.rules[0].times, Some(2));
    }

    /// A domain that registers anything (bookkeeping only).
    #[derive(Debug)]
    struct Plain(MdAttr);

    impl MemoryDomain for Plain {
        fn name(&self) -> &str {
            "plain"
        }
        fn attr(&self) -> &MdAttr {
            &self.0
        }
        fn tl_resources(&self) -> Vec<TlResource> {
            Vec::new()
        }
        fn open_iface(&self, _: &TlResource, _: &IfaceParams) -> Result<Box<dyn Iface>> {
            Err(Error::InvalidParam("no interfaces".into()))
        }
        unsafe fn mem_reg(&self, region: MemRegion) -> Result<MemHandle> {
            Ok(MemHandle::new(region, "plain", Arc::new(())))
        }
        fn mkey_pack(&self, _: &MemHandle) -> Result<Vec<u8>> {
            Ok(Vec::new())
        }
        fn rkey_unpack(&self, _: &[u8]) -> Result<RemoteKey> {
            Err(Error::InvalidParam("no keys".into()))
        }
    }

    #[test]
    fn times_fails_some_registrations_then_lets_them_through() {
        let rules = FaultRules::parse("md=plain,after=1,times=2,kind=not_exportable").unwrap();
        let md = rules.wrap(Arc::new(Plain(MdAttr::new("plain"))));
        let buf = [0u8; 64];
        let outcomes: Vec<Option<RegErrorKind>> = (0..5)
            // SAFETY: `buf` outlives every handle (each is dropped at once); the domain only
            // records the region.
            .map(|_| match unsafe { md.mem_reg(MemRegion::of_slice(&buf)) } {
                Ok(_) => None,
                Err(e) => Some(e.as_registration().expect("typed").kind),
            })
            .collect();
        let ne = Some(RegErrorKind::NotExportable);
        assert_eq!(outcomes, vec![None, ne, ne, None, None]);
    }

    #[test]
    fn malformed_rules_name_the_variable() {
        for bad in [
            "md=posix",
            "after=3",
            "md=x,after=q",
            "md=x,budget=inf",
            "md=x,after=1,kind=zap",
            "md=x,after=1,mem=vram",
            "md=x,foo=1",
            "md=x,budget=1M,times=2",
            "md=x,after=1,times=-1",
            "junk",
        ] {
            let e = FaultRules::parse(bad).unwrap_err().to_string();
            assert!(e.contains("RUCX_FAULT_INJECT"), "{bad}: {e}");
        }
    }
}
