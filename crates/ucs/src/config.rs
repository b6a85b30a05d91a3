//! Configuration: every option is declared once, in a table of [`OptionSpec`]s owned by the crate
//! that uses it, and read from `RUCX_<NAME>` environment variables or set in code.
//!
//! Values are validated when they are set, so a malformed variable is reported up front with the
//! variable's name and the accepted forms, never later in the middle of a transfer. Beyond its
//! syntax, a value can be held to a range ([`OptKind::UintIn`], [`OptKind::MemIn`],
//! [`OptKind::TimeIn`] with [`Bounds`]) or a syntax of its own ([`OptKind::Text`]): an option
//! whose zero or tiny values would break a transport declares them here, and an out-of-range value
//! is rejected when it is read, naming the variable and the range, instead of silently making a
//! transport unavailable later.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::tls::{self, TlsSelection};
use crate::units::{self, MemUnits};

/// Prefix of every environment variable rucx reads.
pub const ENV_PREFIX: &str = "RUCX_";

/// What kind of value an option holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptKind {
    /// `y`/`n`, `yes`/`no`, `true`/`false`, `on`/`off`, `1`/`0`.
    Bool,
    /// `yes`, `no` or `try`.
    Ternary,
    /// A memory size ([`units::parse_memunits`]).
    MemUnits,
    /// A duration ([`units::parse_time`]).
    Time,
    /// A non-negative integer.
    Uint,
    /// Free text.
    Str,
    /// Comma-separated list of words.
    List,
    /// A transport selection ([`tls::TlsSelection`]).
    Tls,
    /// One word out of a fixed set.
    Enum(&'static [&'static str]),
    /// A non-negative integer within bounds (read with [`Config::uint`]).
    UintIn(Bounds),
    /// A memory size within bounds (read with [`Config::mem_units`]); `auto` and `inf` only
    /// where the bounds allow them.
    MemIn(Bounds),
    /// A duration within bounds in nanoseconds (read with [`Config::time`]); `inf` only where
    /// the bounds allow it.
    TimeIn(Bounds),
    /// Text that must pass a check of its own (read with [`Config::string`]).
    Text(Syntax),
    /// A secret (read with [`Config::string`]): empty, or at least [`SECRET_MIN_LEN`]
    /// characters. Never printed: [`Config`]'s `Debug` and `rucx-info -c` hide it.
    Secret,
}

/// Shortest accepted non-empty [`OptKind::Secret`].
pub const SECRET_MIN_LEN: usize = 16;

/// The accepted range of a numeric option: `min..=max`, optionally only powers of two or
/// multiples of a step, and for memory sizes and durations whether `auto`/`inf` are accepted.
/// Built in `const` context: `Bounds::new(2, 65536).power_of_two()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Smallest accepted value (bytes, nanoseconds or a count).
    pub min: u64,
    /// Largest accepted value.
    pub max: u64,
    /// Accepted values are multiples of this (1: any).
    pub step: u64,
    /// Only powers of two.
    pub pow2: bool,
    /// `auto` is accepted (memory sizes).
    pub auto: bool,
    /// `inf` is accepted (memory sizes, durations).
    pub inf: bool,
}

impl Bounds {
    /// Any value in `min..=max`.
    pub const fn new(min: u64, max: u64) -> Bounds {
        Bounds {
            min,
            max,
            step: 1,
            pow2: false,
            auto: false,
            inf: false,
        }
    }

    /// Durations from `min` to `max` seconds.
    pub const fn secs(min: u64, max: u64) -> Bounds {
        Bounds::new(min * 1_000_000_000, max * 1_000_000_000)
    }

    /// Durations from `min` to `max` milliseconds.
    pub const fn millis(min: u64, max: u64) -> Bounds {
        Bounds::new(min * 1_000_000, max * 1_000_000)
    }

    /// Only powers of two.
    pub const fn power_of_two(self) -> Bounds {
        Bounds { pow2: true, ..self }
    }

    /// Only multiples of `step`.
    pub const fn multiple_of(self, step: u64) -> Bounds {
        Bounds { step, ..self }
    }

    /// `auto` accepted too.
    pub const fn or_auto(self) -> Bounds {
        Bounds { auto: true, ..self }
    }

    /// `inf` accepted too.
    pub const fn or_inf(self) -> Bounds {
        Bounds { inf: true, ..self }
    }

    fn holds(&self, n: u64) -> bool {
        (self.min..=self.max).contains(&n)
            && (!self.pow2 || n.is_power_of_two())
            && (self.step <= 1 || n.is_multiple_of(self.step))
    }

    /// The accepted values in words, numbers written by `fmt`.
    fn describe(&self, fmt: fn(u64) -> String) -> String {
        let mut s = if self.pow2 {
            format!("a power of two from {} to {}", fmt(self.min), fmt(self.max))
        } else if self.step > 1 {
            format!(
                "a multiple of {} from {} to {}",
                fmt(self.step),
                fmt(self.min),
                fmt(self.max)
            )
        } else if self.max == u64::MAX {
            format!("at least {}", fmt(self.min))
        } else {
            format!("from {} to {}", fmt(self.min), fmt(self.max))
        };
        match (self.auto, self.inf) {
            (true, true) => s.push_str(", or auto, or inf"),
            (true, false) => s.push_str(", or auto"),
            (false, true) => s.push_str(", or inf"),
            (false, false) => {}
        }
        s
    }

    fn check(&self, n: u64, fmt: fn(u64) -> String) -> std::result::Result<(), String> {
        if self.holds(n) {
            Ok(())
        } else {
            Err(format!("{} is out of range", fmt(n)))
        }
    }
}

fn fmt_count(n: u64) -> String {
    n.to_string()
}

fn fmt_ns(n: u64) -> String {
    units::format_time(Duration::from_nanos(n))
}

/// A check of a text option beyond "any text": the check returns why a value is refused, and
/// `accepted` describes the forms (for messages and `rucx-info -c`).
#[derive(Clone, Copy, Debug)]
pub struct Syntax {
    /// Returns why the value is refused.
    pub check: fn(&str) -> std::result::Result<(), String>,
    /// The accepted forms, in words.
    pub accepted: &'static str,
}

impl PartialEq for Syntax {
    fn eq(&self, other: &Syntax) -> bool {
        std::ptr::fn_addr_eq(self.check, other.check) && self.accepted == other.accepted
    }
}

impl Eq for Syntax {}

impl OptKind {
    /// Accepted forms, for messages and `rucx-info -c`.
    pub fn accepted(&self) -> String {
        match self {
            OptKind::Bool => "y, n, yes, no, true, false, on, off, 1, 0".into(),
            OptKind::Ternary => "yes, no, try".into(),
            OptKind::MemUnits => units::MEMUNITS_FORMS.into(),
            OptKind::Time => units::TIME_FORMS.into(),
            OptKind::Uint => "a non-negative integer".into(),
            OptKind::Str => "any text".into(),
            OptKind::List => "comma-separated words".into(),
            OptKind::Tls => tls::accepted_forms(),
            OptKind::Enum(words) => words.join(", "),
            OptKind::UintIn(b) => format!("an integer {}", b.describe(fmt_count)),
            OptKind::MemIn(b) => format!(
                "a size {} (suffixes b, K, M, G, T: powers of 1024)",
                b.describe(units::format_bytes)
            ),
            OptKind::TimeIn(b) => format!(
                "a duration {} (units ns, us, ms, s, m, h)",
                b.describe(fmt_ns)
            ),
            OptKind::Text(syntax) => syntax.accepted.into(),
            OptKind::Secret => {
                format!("empty, or a secret of at least {SECRET_MIN_LEN} characters")
            }
        }
    }

    fn short_name(&self) -> &'static str {
        match self {
            OptKind::Bool => "bool",
            OptKind::Ternary => "ternary",
            OptKind::MemUnits => "memunits",
            OptKind::Time => "time",
            OptKind::Uint => "uint",
            OptKind::Str => "string",
            OptKind::List => "list",
            OptKind::Tls => "tls",
            OptKind::Enum(_) => "enum",
            OptKind::UintIn(_) => "uint",
            OptKind::MemIn(_) => "memunits",
            OptKind::TimeIn(_) => "time",
            OptKind::Text(_) => "string",
            OptKind::Secret => "secret",
        }
    }
}

impl fmt::Display for OptKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// Declaration of one option.
#[derive(Clone, Copy, Debug)]
pub struct OptionSpec {
    /// Name without the `RUCX_` prefix, upper case (e.g. `RNDV_THRESH`).
    pub name: &'static str,
    /// Value kind.
    pub kind: OptKind,
    /// Default value, in the same syntax a user would write.
    pub default: &'static str,
    /// One or two sentences for `rucx-info -c`.
    pub help: &'static str,
}

/// A yes/no/try switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ternary {
    /// Required: failing to provide it is an error.
    Yes,
    /// Disabled.
    No,
    /// Use it when it works.
    Try,
}

/// A parsed, validated value.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Bool(bool),
    Ternary(Ternary),
    Mem(MemUnits),
    Time(Duration),
    Uint(u64),
    Str(String),
    List(Vec<String>),
    Tls(TlsSelection),
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "true" | "on" | "1" => Some(true),
        "n" | "no" | "false" | "off" | "0" => Some(false),
        _ => None,
    }
}

fn parse_value(kind: OptKind, raw: &str) -> std::result::Result<Value, String> {
    Ok(match kind {
        OptKind::Bool => Value::Bool(parse_bool(raw).ok_or("not a boolean")?),
        OptKind::Ternary => Value::Ternary(match raw.trim().to_ascii_lowercase().as_str() {
            "try" | "auto" => Ternary::Try,
            other => match parse_bool(other) {
                Some(true) => Ternary::Yes,
                Some(false) => Ternary::No,
                None => return Err("not yes, no or try".into()),
            },
        }),
        OptKind::MemUnits => Value::Mem(units::parse_memunits(raw)?),
        OptKind::Time => Value::Time(units::parse_time(raw)?),
        OptKind::Uint => Value::Uint(
            raw.trim()
                .parse()
                .map_err(|_| "not a non-negative integer".to_string())?,
        ),
        OptKind::Str => Value::Str(raw.to_string()),
        OptKind::List => Value::List(
            raw.split(',')
                .map(str::trim)
                .filter(|w| !w.is_empty())
                .map(str::to_string)
                .collect(),
        ),
        OptKind::Tls => Value::Tls(TlsSelection::parse(raw)?),
        OptKind::Enum(words) => {
            let w = raw.trim().to_ascii_lowercase();
            if !words.contains(&w.as_str()) {
                return Err(format!("{w:?} is not one of the choices"));
            }
            Value::Str(w)
        }
        OptKind::UintIn(b) => {
            let Value::Uint(n) = parse_value(OptKind::Uint, raw)? else {
                unreachable!("a uint parses to Value::Uint")
            };
            b.check(n, fmt_count)?;
            Value::Uint(n)
        }
        OptKind::MemIn(b) => {
            let m = units::parse_memunits(raw)?;
            match m {
                MemUnits::Bytes(n) => b.check(n, units::format_bytes)?,
                MemUnits::Auto if !b.auto => return Err("auto is not accepted here".into()),
                MemUnits::Infinite if !b.inf => return Err("inf is not accepted here".into()),
                MemUnits::Auto | MemUnits::Infinite => {}
            }
            Value::Mem(m)
        }
        OptKind::TimeIn(b) => {
            let d = units::parse_time(raw)?;
            if d == Duration::MAX {
                if !b.inf {
                    return Err("inf is not accepted here".into());
                }
            } else {
                let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
                b.check(ns, fmt_ns)?;
            }
            Value::Time(d)
        }
        OptKind::Text(syntax) => {
            (syntax.check)(raw)?;
            Value::Str(raw.to_string())
        }
        OptKind::Secret => {
            let n = raw.chars().count();
            if n != 0 && n < SECRET_MIN_LEN {
                return Err(format!(
                    "a secret of {n} characters is too short to guess-proof (at least \
                     {SECRET_MIN_LEN})"
                ));
            }
            Value::Str(raw.to_string())
        }
    })
}

/// A type [`Config::try_get`] can read an option as (sealed: the types listed there).
pub trait OptionValue: Sized + pick::Pick {}

mod pick {
    /// A parsed value, opaque outside this module's parent.
    #[derive(Debug)]
    pub struct Parsed<'a>(pub(super) &'a super::Value);

    /// The typed value out of a parsed one, when the kinds agree.
    pub trait Pick: Sized {
        /// What the type reads, for messages.
        const WHAT: &'static str;
        fn pick(v: Parsed<'_>) -> Option<Self>;
    }
}

macro_rules! option_value {
    ($t:ty, $what:literal, $pat:pat => $out:expr) => {
        impl pick::Pick for $t {
            const WHAT: &'static str = $what;
            fn pick(v: pick::Parsed<'_>) -> Option<Self> {
                match v.0 {
                    $pat => Some($out),
                    _ => None,
                }
            }
        }
        impl OptionValue for $t {}
    };
}

option_value!(bool, "a bool", Value::Bool(b) => *b);
option_value!(Ternary, "a ternary", Value::Ternary(t) => *t);
option_value!(MemUnits, "a memory size", Value::Mem(m) => *m);
option_value!(Duration, "a time", Value::Time(t) => *t);
option_value!(u64, "an integer", Value::Uint(u) => *u);
option_value!(String, "text", Value::Str(s) => s.clone());
option_value!(Vec<String>, "a list", Value::List(l) => l.clone());
option_value!(TlsSelection, "a transport selection", Value::Tls(t) => t.clone());

#[derive(Clone)]
struct Entry {
    spec: OptionSpec,
    raw: String,
    value: Value,
    from_env: bool,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Entry");
        d.field("spec", &self.spec);
        if self.spec.kind == OptKind::Secret {
            d.field("raw", &"(hidden)");
        } else {
            d.field("raw", &self.raw).field("value", &self.value);
        }
        d.field("from_env", &self.from_env).finish()
    }
}

/// A set of validated option values.
#[derive(Clone, Debug)]
pub struct Config {
    entries: BTreeMap<&'static str, Entry>,
}

impl Config {
    /// Every declared option at its default. Fails only if a default does not parse (a bug in
    /// the table) or a name is declared twice.
    pub fn new(tables: &[&'static [OptionSpec]]) -> Result<Config> {
        let mut entries = BTreeMap::new();
        for spec in tables.iter().flat_map(|t| t.iter()) {
            let value = parse_value(spec.kind, spec.default).map_err(|reason| {
                Error::Internal(format!(
                    "default {:?} of option {}{} does not parse: {reason}",
                    spec.default, ENV_PREFIX, spec.name
                ))
            })?;
            let prev = entries.insert(
                spec.name,
                Entry {
                    spec: *spec,
                    raw: spec.default.to_string(),
                    value,
                    from_env: false,
                },
            );
            if prev.is_some() {
                return Err(Error::Internal(format!(
                    "option {}{} is declared twice",
                    ENV_PREFIX, spec.name
                )));
            }
        }
        Ok(Config { entries })
    }

    /// Defaults, then every `RUCX_*` variable of the process environment.
    pub fn from_env(tables: &[&'static [OptionSpec]]) -> Result<Config> {
        Self::from_vars(tables, std::env::vars())
    }

    /// Defaults, then the `RUCX_*` entries of `vars` (other names are ignored). An unknown
    /// `RUCX_` name is logged as a warning, since it is most likely a typo.
    pub fn from_vars<I, K, V>(tables: &[&'static [OptionSpec]], vars: I) -> Result<Config>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut cfg = Self::new(tables)?;
        for (k, v) in vars {
            let Some(name) = k.as_ref().strip_prefix(ENV_PREFIX) else {
                continue;
            };
            if cfg.entries.contains_key(name) {
                cfg.set(name, v.as_ref())?;
                if let Some(e) = cfg.entries.get_mut(name) {
                    e.from_env = true;
                }
            } else {
                tracing::warn!(
                    "{}{} is not a rucx option (run `rucx-info -c` for the list); ignored",
                    ENV_PREFIX,
                    name
                );
            }
        }
        Ok(cfg)
    }

    /// Set an option in code, validated like an environment variable. `name` may carry the
    /// `RUCX_` prefix or not.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let name = name.strip_prefix(ENV_PREFIX).unwrap_or(name);
        let entry = self.entries.get_mut(name).ok_or_else(|| {
            Error::InvalidParam(format!(
                "{ENV_PREFIX}{name} is not a rucx option (run `rucx-info -c` for the list)"
            ))
        })?;
        let parsed = parse_value(entry.spec.kind, value).map_err(|reason| Error::Config {
            var: format!("{ENV_PREFIX}{name}"),
            value: value.to_string(),
            reason,
            accepted: entry.spec.kind.accepted(),
        })?;
        entry.raw = value.to_string();
        entry.value = parsed;
        entry.from_env = false;
        Ok(())
    }

    /// The entry of `name` (with or without the `RUCX_` prefix), or the error a user gets for
    /// a name no table declares.
    fn entry(&self, name: &str) -> Result<&Entry> {
        let name = name.strip_prefix(ENV_PREFIX).unwrap_or(name);
        self.entries.get(name).ok_or_else(|| {
            Error::InvalidParam(format!(
                "{ENV_PREFIX}{name} is not a rucx option (run `rucx-info -c` for the list)"
            ))
        })
    }

    fn get(&self, name: &str) -> &Value {
        match self.entry(name) {
            Ok(e) => &e.value,
            // The typed getters take names declared in the tables the calling crate links, so
            // an undeclared one is a programming error in rucx; names that come from users go
            // through `raw`/`try_get`.
            Err(_) => panic!("rucx bug: option {ENV_PREFIX}{name} is not declared in any table"),
        }
    }

    /// True when the option is declared in this configuration.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The value of `name` as the user wrote it (or the default); `name` may carry the `RUCX_`
    /// prefix or not. A name no table declares is [`Error::InvalidParam`] naming it, never a
    /// panic, so names that come from users can be looked up as they are.
    ///
    /// ```
    /// use rucx_ucs::{Config, Error, OptKind, OptionSpec};
    ///
    /// static TABLE: &[OptionSpec] = &[OptionSpec {
    ///     name: "ZCOPY_THRESH",
    ///     kind: OptKind::MemUnits,
    ///     default: "auto",
    ///     help: "",
    /// }];
    /// let mut cfg = Config::new(&[TABLE])?;
    /// cfg.set("ZCOPY_THRESH", "16K")?;
    /// assert_eq!(cfg.raw("ZCOPY_THRESH")?, "16K");
    /// assert_eq!(cfg.raw("RUCX_ZCOPY_THRESH")?, "16K");
    /// let e = cfg.raw("ZCOPY_TRESH").unwrap_err();
    /// assert!(matches!(e, Error::InvalidParam(_)));
    /// assert!(e.to_string().contains("RUCX_ZCOPY_TRESH is not a rucx option"));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn raw(&self, name: &str) -> Result<&str> {
        self.entry(name).map(|e| e.raw.as_str())
    }

    /// The typed value of `name` (with or without the `RUCX_` prefix): `bool`, [`Ternary`],
    /// [`MemUnits`], [`Duration`], `u64`, `String` (text and enum options), `Vec<String>`
    /// (lists) or [`TlsSelection`]. A name no table declares, or an option of another kind, is
    /// [`Error::InvalidParam`], never a panic. The typed getters below ([`bool`](Self::bool),
    /// ...) are shorthands for rucx's own code, which names options it declares itself (a
    /// constant, never user input): they panic on an undeclared name or another kind, a bug in
    /// the caller. Names that come from users go through `raw` or `try_get`.
    ///
    /// ```
    /// use rucx_ucs::{Config, OptKind, OptionSpec};
    ///
    /// static TABLE: &[OptionSpec] = &[OptionSpec {
    ///     name: "ASYNC",
    ///     kind: OptKind::Bool,
    ///     default: "y",
    ///     help: "",
    /// }];
    /// let cfg = Config::new(&[TABLE])?;
    /// assert!(cfg.try_get::<bool>("RUCX_ASYNC")?);
    /// assert!(cfg.try_get::<u64>("ASYNC").unwrap_err().to_string().contains("a bool option"));
    /// assert!(cfg.try_get::<bool>("NO_SUCH").is_err());
    /// # Ok::<(), rucx_ucs::Error>(())
    /// ```
    pub fn try_get<T: OptionValue>(&self, name: &str) -> Result<T> {
        let e = self.entry(name)?;
        T::pick(pick::Parsed(&e.value)).ok_or_else(|| {
            Error::InvalidParam(format!(
                "{ENV_PREFIX}{} is a {} option, not {}",
                e.spec.name,
                e.spec.kind,
                T::WHAT
            ))
        })
    }

    /// A boolean option.
    pub fn bool(&self, name: &str) -> bool {
        match self.get(name) {
            Value::Bool(b) => *b,
            v => panic!("rucx bug: {name} is not a bool option: {v:?}"),
        }
    }

    /// A yes/no/try option.
    pub fn ternary(&self, name: &str) -> Ternary {
        match self.get(name) {
            Value::Ternary(t) => *t,
            v => panic!("rucx bug: {name} is not a ternary option: {v:?}"),
        }
    }

    /// A memory-size option.
    pub fn mem_units(&self, name: &str) -> MemUnits {
        match self.get(name) {
            Value::Mem(m) => *m,
            v => panic!("rucx bug: {name} is not a memunits option: {v:?}"),
        }
    }

    /// A duration option.
    pub fn time(&self, name: &str) -> Duration {
        match self.get(name) {
            Value::Time(t) => *t,
            v => panic!("rucx bug: {name} is not a time option: {v:?}"),
        }
    }

    /// An integer option.
    pub fn uint(&self, name: &str) -> u64 {
        match self.get(name) {
            Value::Uint(u) => *u,
            v => panic!("rucx bug: {name} is not a uint option: {v:?}"),
        }
    }

    /// A text or enum option.
    pub fn string(&self, name: &str) -> &str {
        match self.get(name) {
            Value::Str(s) => s,
            v => panic!("rucx bug: {name} is not a string option: {v:?}"),
        }
    }

    /// A list option.
    pub fn list(&self, name: &str) -> &[String] {
        match self.get(name) {
            Value::List(l) => l,
            v => panic!("rucx bug: {name} is not a list option: {v:?}"),
        }
    }

    /// A transport-selection option.
    pub fn tls(&self, name: &str) -> &TlsSelection {
        match self.get(name) {
            Value::Tls(t) => t,
            v => panic!("rucx bug: {name} is not a tls option: {v:?}"),
        }
    }

    /// Every option with its current raw value and whether it came from the environment.
    pub fn options(&self) -> impl Iterator<Item = (&OptionSpec, &str, bool)> {
        self.entries
            .values()
            .map(|e| (&e.spec, e.raw.as_str(), e.from_env))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    static TABLE: &[OptionSpec] = &[
        OptionSpec {
            name: "TLS",
            kind: OptKind::Tls,
            default: "all",
            help: "transports",
        },
        OptionSpec {
            name: "RNDV_THRESH",
            kind: OptKind::MemUnits,
            default: "auto",
            help: "rendezvous threshold",
        },
        OptionSpec {
            name: "GDR",
            kind: OptKind::Ternary,
            default: "try",
            help: "gpu direct",
        },
        OptionSpec {
            name: "SCHEME",
            kind: OptKind::Enum(&["auto", "get", "put"]),
            default: "auto",
            help: "scheme",
        },
    ];

    #[test]
    fn defaults_and_env() {
        let c = Config::from_vars(
            &[TABLE],
            [
                ("RUCX_RNDV_THRESH", "8K"),
                ("HOME", "/root"),
                ("RUCX_GDR", "no"),
            ],
        )
        .unwrap();
        assert_eq!(c.mem_units("RNDV_THRESH"), MemUnits::Bytes(8192));
        assert_eq!(c.ternary("GDR"), Ternary::No);
        assert_eq!(c.string("SCHEME"), "auto");
        assert!(
            c.options()
                .any(|(s, raw, env)| s.name == "GDR" && raw == "no" && env)
        );
    }

    #[test]
    fn malformed_values_name_the_variable_and_forms() {
        let e = Config::from_vars(&[TABLE], [("RUCX_RNDV_THRESH", "12Q")]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("RUCX_RNDV_THRESH") && s.contains("12Q") && s.contains("inf"),
            "{s}"
        );
        let e = Config::from_vars(&[TABLE], [("RUCX_TLS", "bogus")]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("RUCX_TLS") && s.contains("bogus") && s.contains("sm"),
            "{s}"
        );
        let e = Config::from_vars(&[TABLE], [("RUCX_SCHEME", "sideways")]).unwrap_err();
        assert!(e.to_string().contains("get, put"));
    }

    #[test]
    fn in_code_override_is_validated() {
        let mut c = Config::new(&[TABLE]).unwrap();
        c.set("RUCX_SCHEME", "put").unwrap();
        assert_eq!(c.string("SCHEME"), "put");
        assert!(c.set("SCHEME", "x").is_err());
        assert!(c.set("NOPE", "1").is_err());
        assert_eq!(c.string("SCHEME"), "put");
    }

    #[test]
    fn duplicate_declaration_is_rejected() {
        assert!(Config::new(&[TABLE, TABLE]).is_err());
    }

    #[test]
    fn malformed_values_report_kind_specific_forms() {
        let e = Config::from_vars(&[TABLE], [("RUCX_RNDV_THRESH", "12Q")]).unwrap_err();
        match &e {
            Error::Config {
                var,
                value,
                reason,
                accepted,
            } => {
                assert_eq!(var, "RUCX_RNDV_THRESH");
                assert_eq!(value, "12Q");
                assert!(reason.contains("\"q\""), "names the bad suffix: {reason}");
                assert_eq!(accepted, units::MEMUNITS_FORMS);
            }
            other => panic!("expected Error::Config, got {other:?}"),
        }
        let s = e.to_string();
        for want in ["K, M, G", "inf", "auto"] {
            assert!(s.contains(want), "{s:?} lacks {want:?}");
        }
        // The same through an in-code override, with or without the prefix.
        let mut c = Config::new(&[TABLE, KINDS]).unwrap();
        for name in ["RNDV_THRESH", "RUCX_RNDV_THRESH"] {
            let e = c.set(name, "4X").unwrap_err();
            assert!(e.to_string().contains("RUCX_RNDV_THRESH"), "{e}");
        }
        let e = c.set("K_TIME", "10 parsecs").unwrap_err();
        let s = e.to_string();
        assert!(s.contains("RUCX_K_TIME") && s.contains("ns, us, ms"), "{s}");
        // An unknown RUCX_ name in the environment is not an error (only a warning).
        assert!(Config::from_vars(&[TABLE], [("RUCX_NOT_AN_OPTION", "1")]).is_ok());
    }

    fn port_pair(s: &str) -> std::result::Result<(), String> {
        match s.split_once('-') {
            Some((a, b)) if a.parse::<u16>().is_ok() && b.parse::<u16>().is_ok() => Ok(()),
            _ => Err(format!("{s:?} is not FIRST-LAST")),
        }
    }

    static BOUNDED: &[OptionSpec] = &[
        OptionSpec {
            name: "B_FIFO",
            kind: OptKind::UintIn(Bounds::new(2, 65536).power_of_two()),
            default: "256",
            help: "",
        },
        OptionSpec {
            name: "B_CELL",
            kind: OptKind::MemIn(Bounds::new(128, 1 << 20).multiple_of(64)),
            default: "8K",
            help: "",
        },
        OptionSpec {
            name: "B_FRAG",
            kind: OptKind::MemIn(Bounds::new(4096, 1 << 30).or_auto()),
            default: "auto",
            help: "",
        },
        OptionSpec {
            name: "B_IDLE",
            kind: OptKind::TimeIn(Bounds::secs(1, 65535)),
            default: "2s",
            help: "",
        },
        OptionSpec {
            name: "B_WAIT",
            kind: OptKind::TimeIn(Bounds::millis(1, u64::MAX / 1_000_000).or_inf()),
            default: "inf",
            help: "",
        },
        OptionSpec {
            name: "B_PORTS",
            kind: OptKind::Text(Syntax {
                check: port_pair,
                accepted: "FIRST-LAST",
            }),
            default: "1-2",
            help: "",
        },
        OptionSpec {
            name: "B_KEY",
            kind: OptKind::Secret,
            default: "",
            help: "",
        },
    ];

    #[test]
    fn bounded_values_are_checked_where_read() {
        let c = Config::new(&[BOUNDED]).unwrap();
        assert_eq!(c.uint("B_FIFO"), 256);
        assert_eq!(c.mem_units("B_FRAG"), MemUnits::Auto);
        assert_eq!(c.time("B_WAIT"), Duration::MAX);
        for (name, bad, why) in [
            ("B_FIFO", "3", "a power of two from 2 to 65536"),
            ("B_FIFO", "0", "a power of two from 2 to 65536"),
            ("B_FIFO", "131072", "a power of two from 2 to 65536"),
            ("B_CELL", "100", "a multiple of 64 from 128 to 1M"),
            ("B_CELL", "8200", "a multiple of 64 from 128 to 1M"),
            ("B_CELL", "auto", "a multiple of 64 from 128 to 1M"),
            ("B_FRAG", "0", "from 4K to 1G, or auto"),
            ("B_FRAG", "inf", "from 4K to 1G, or auto"),
            ("B_IDLE", "10ms", "from 1s to 65535s"),
            ("B_IDLE", "inf", "from 1s to 65535s"),
            ("B_WAIT", "0s", "or inf"),
            ("B_PORTS", "garbage", "FIRST-LAST"),
            ("B_KEY", "short", "at least 16 characters"),
        ] {
            let e = Config::from_vars(&[BOUNDED], [(format!("RUCX_{name}"), bad)]).unwrap_err();
            let s = e.to_string();
            assert!(
                s.contains(&format!("RUCX_{name}")) && s.contains(why),
                "{name}={bad}: {s}"
            );
        }
        let c = Config::from_vars(
            &[BOUNDED],
            [
                ("RUCX_B_FIFO", "65536"),
                ("RUCX_B_CELL", "128"),
                ("RUCX_B_FRAG", "1G"),
                ("RUCX_B_IDLE", "65535s"),
                ("RUCX_B_WAIT", "1ms"),
                ("RUCX_B_PORTS", "20000-20010"),
                ("RUCX_B_KEY", "0123456789abcdef"),
            ],
        )
        .unwrap();
        assert_eq!(c.uint("B_FIFO"), 65536);
        assert_eq!(c.mem_units("B_CELL"), MemUnits::Bytes(128));
        assert_eq!(c.mem_units("B_FRAG"), MemUnits::Bytes(1 << 30));
        assert_eq!(c.string("B_PORTS"), "20000-20010");
        assert_eq!(c.string("B_KEY"), "0123456789abcdef");
        // The kinds read like their plain counterparts.
        assert_eq!(OptKind::UintIn(Bounds::new(1, 2)).to_string(), "uint");
        assert_eq!(OptKind::MemIn(Bounds::new(1, 2)).to_string(), "memunits");
    }

    #[test]
    fn secrets_are_never_printed() {
        let c = Config::from_vars(&[BOUNDED], [("RUCX_B_KEY", "a-very-secret-job-key")]).unwrap();
        let d = format!("{c:?}");
        assert!(!d.contains("a-very-secret-job-key"), "{d}");
        assert!(d.contains("hidden"), "{d}");
        let e = Config::from_vars(&[BOUNDED], [("RUCX_B_KEY", "short")]).unwrap_err();
        assert!(e.to_string().contains("RUCX_B_KEY"), "{e}");
    }

    proptest! {
        #[test]
        fn bounded_uints_accept_exactly_their_range(n in any::<u64>(), lo in 0u64..1000, span in 0u64..1000) {
            let b = Bounds::new(lo, lo + span);
            let r = parse_value(OptKind::UintIn(b), &n.to_string());
            prop_assert_eq!(r.is_ok(), (lo..=lo + span).contains(&n));
            let p2 = b.power_of_two();
            let r = parse_value(OptKind::UintIn(p2), &n.to_string());
            prop_assert_eq!(r.is_ok(), (lo..=lo + span).contains(&n) && n.is_power_of_two());
        }
    }

    /// One option of every kind.
    static KINDS: &[OptionSpec] = &[
        OptionSpec {
            name: "K_BOOL",
            kind: OptKind::Bool,
            default: "n",
            help: "",
        },
        OptionSpec {
            name: "K_TERNARY",
            kind: OptKind::Ternary,
            default: "try",
            help: "",
        },
        OptionSpec {
            name: "K_MEM",
            kind: OptKind::MemUnits,
            default: "8K",
            help: "",
        },
        OptionSpec {
            name: "K_TIME",
            kind: OptKind::Time,
            default: "1s",
            help: "",
        },
        OptionSpec {
            name: "K_UINT",
            kind: OptKind::Uint,
            default: "3",
            help: "",
        },
        OptionSpec {
            name: "K_STR",
            kind: OptKind::Str,
            default: "",
            help: "",
        },
        OptionSpec {
            name: "K_LIST",
            kind: OptKind::List,
            default: "a,b",
            help: "",
        },
        OptionSpec {
            name: "K_TLS",
            kind: OptKind::Tls,
            default: "all",
            help: "",
        },
        OptionSpec {
            name: "K_ENUM",
            kind: OptKind::Enum(&["first", "second", "third"]),
            default: "first",
            help: "",
        },
    ];

    /// A valid text for one option and a check of the typed value it must produce.
    #[derive(Clone, Debug)]
    enum Valid {
        Bool(String, bool),
        Ternary(String, Ternary),
        Mem(String, MemUnits),
        Time(String, Duration),
        Uint(String, u64),
        Str(String),
        List(String, Vec<String>),
        Tls(String, Vec<&'static str>, bool),
        Enum(String, &'static str),
    }

    fn any_case(word: &'static str) -> impl Strategy<Value = String> {
        prop::collection::vec(any::<bool>(), word.len()).prop_map(move |up| {
            word.chars()
                .zip(up)
                .map(|(c, u)| if u { c.to_ascii_uppercase() } else { c })
                .collect()
        })
    }

    fn valid() -> impl Strategy<Value = Valid> {
        let bool_words = prop::sample::select(vec![
            ("y", true),
            ("yes", true),
            ("true", true),
            ("on", true),
            ("1", true),
            ("n", false),
            ("no", false),
            ("false", false),
            ("off", false),
            ("0", false),
        ]);
        let ternary_words = prop::sample::select(vec![
            ("yes", Ternary::Yes),
            ("y", Ternary::Yes),
            ("on", Ternary::Yes),
            ("no", Ternary::No),
            ("off", Ternary::No),
            ("try", Ternary::Try),
            ("auto", Ternary::Try),
        ]);
        let mem = prop_oneof![
            any::<u64>().prop_map(|b| (units::format_bytes(b), MemUnits::Bytes(b))),
            (
                0u64..1 << 20,
                prop::sample::select(vec![("K", 10), ("m", 20), ("G", 30)])
            )
                .prop_map(|(n, (s, sh))| (format!("{n}{s}"), MemUnits::Bytes(n << sh))),
            Just(("inf".to_string(), MemUnits::Infinite)),
            Just(("auto".to_string(), MemUnits::Auto)),
        ];
        let tls = (1u32..(1 << tls::TRANSPORTS.len()), any::<bool>()).prop_map(|(mask, neg)| {
            let chosen: Vec<&'static str> = tls::TRANSPORTS
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, t)| *t)
                .collect();
            let text = format!("{}{}", if neg { "^" } else { "" }, chosen.join(","));
            Valid::Tls(text, chosen, neg)
        });
        prop_oneof![
            (bool_words, any::<bool>()).prop_flat_map(|((w, b), pad)| any_case(w)
                .prop_map(move |w| Valid::Bool(if pad { format!(" {w} ") } else { w }, b))),
            ternary_words
                .prop_flat_map(|(w, t)| any_case(w).prop_map(move |w| Valid::Ternary(w, t))),
            mem.prop_map(|(s, m)| Valid::Mem(s, m)),
            any::<u64>().prop_map(|ns| {
                let d = Duration::from_nanos(ns);
                Valid::Time(units::format_time(d), d)
            }),
            any::<u64>().prop_map(|n| Valid::Uint(n.to_string(), n)),
            ".{0,20}".prop_map(Valid::Str),
            prop::collection::vec("[a-z0-9_]{1,8}", 0..5)
                .prop_map(|words| { Valid::List(words.join(" , "), words) }),
            tls,
            prop::sample::select(vec!["first", "second", "third"])
                .prop_flat_map(|w| any_case(w).prop_map(move |c| Valid::Enum(c, w))),
        ]
    }

    fn name_of(v: &Valid) -> &'static str {
        match v {
            Valid::Bool(..) => "K_BOOL",
            Valid::Ternary(..) => "K_TERNARY",
            Valid::Mem(..) => "K_MEM",
            Valid::Time(..) => "K_TIME",
            Valid::Uint(..) => "K_UINT",
            Valid::Str(..) => "K_STR",
            Valid::List(..) => "K_LIST",
            Valid::Tls(..) => "K_TLS",
            Valid::Enum(..) => "K_ENUM",
        }
    }

    /// Names whose kind rejects the garbage below (free text and lists accept anything).
    const STRICT: &[&str] = &[
        "K_BOOL",
        "K_TERNARY",
        "K_MEM",
        "K_TIME",
        "K_UINT",
        "K_TLS",
        "K_ENUM",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn valid_values_round_trip_through_set(v in valid(), env in any::<bool>()) {
            let name = name_of(&v);
            let text = match &v {
                Valid::Bool(t, _) | Valid::Ternary(t, _) | Valid::Mem(t, _)
                | Valid::Time(t, _) | Valid::Uint(t, _) | Valid::Str(t)
                | Valid::List(t, _) | Valid::Tls(t, ..) | Valid::Enum(t, _) => t.clone(),
            };
            let c = if env {
                Config::from_vars(&[KINDS], [(format!("RUCX_{name}"), text.clone())]).unwrap()
            } else {
                let mut c = Config::new(&[KINDS]).unwrap();
                c.set(name, &text).unwrap();
                c
            };
            prop_assert_eq!(c.raw(name).unwrap(), text.as_str());
            prop_assert!(c.options().any(|(s, raw, from_env)| s.name == name && raw == text && from_env == env));
            match v {
                Valid::Bool(_, b) => prop_assert_eq!(c.bool(name), b),
                Valid::Ternary(_, t) => prop_assert_eq!(c.ternary(name), t),
                Valid::Mem(_, m) => prop_assert_eq!(c.mem_units(name), m),
                Valid::Time(_, d) => prop_assert_eq!(c.time(name), d),
                Valid::Uint(_, n) => prop_assert_eq!(c.uint(name), n),
                Valid::Str(s) => prop_assert_eq!(c.string(name), s.as_str()),
                Valid::List(_, words) => prop_assert_eq!(c.list(name), words.as_slice()),
                Valid::Tls(_, chosen, neg) => {
                    for tl in tls::TRANSPORTS {
                        prop_assert_eq!(c.tls(name).allows(tl), chosen.contains(tl) != neg);
                    }
                }
                Valid::Enum(_, w) => prop_assert_eq!(c.string(name), w),
            }
        }

        #[test]
        fn garbage_names_the_variable_and_keeps_the_old_value(
            idx in 0..STRICT.len(),
            garbage in "[#@!%&*?~][a-z0-9 ]{0,8}",
            prefixed in any::<bool>(),
        ) {
            let name = STRICT[idx];
            let mut c = Config::new(&[KINDS]).unwrap();
            let before = c.raw(name).unwrap().to_string();
            let arg = if prefixed { format!("RUCX_{name}") } else { name.to_string() };
            let e = c.set(&arg, &garbage).unwrap_err();
            let kind = KINDS.iter().find(|s| s.name == name).unwrap().kind;
            match &e {
                Error::Config { var, value, accepted, .. } => {
                    prop_assert_eq!(var, &format!("RUCX_{name}"));
                    prop_assert_eq!(value, &garbage);
                    prop_assert_eq!(accepted, &kind.accepted());
                }
                other => prop_assert!(false, "expected Error::Config, got {:?}", other),
            }
            let msg = e.to_string();
            prop_assert!(msg.contains(&format!("RUCX_{name}")) && msg.contains("accepted"), "{}", msg);
            prop_assert_eq!(c.raw(name).unwrap(), before.as_str(), "a rejected value must not stick");
            // The same value from the environment fails the same way.
            let from_env = Config::from_vars(&[KINDS], [(format!("RUCX_{name}"), garbage.clone())]);
            let is_config_err = matches!(from_env, Err(Error::Config { .. }));
            prop_assert!(is_config_err);
        }

        #[test]
        fn set_never_panics(idx in 0..KINDS.len(), value in "\\PC{0,24}") {
            let mut c = Config::new(&[KINDS]).unwrap();
            let name = KINDS[idx].name;
            let before = c.raw(name).unwrap().to_string();
            match c.set(name, &value) {
                Ok(()) => prop_assert_eq!(c.raw(name).unwrap(), value.as_str()),
                Err(e) => {
                    let is_config_err = matches!(e, Error::Config { .. });
                    prop_assert!(is_config_err);
                    prop_assert_eq!(c.raw(name).unwrap(), before.as_str());
                }
            }
        }
    }
}

/// Lookups by name: undeclared names and wrong kinds are errors on the `try_` paths.
#[cfg(test)]
mod lookup_tests {
    use super::*;
    use proptest::prelude::*;

    static TABLE: &[OptionSpec] = &[
        OptionSpec {
            name: "TLS",
            kind: OptKind::Tls,
            default: "all",
            help: "",
        },
        OptionSpec {
            name: "SEG",
            kind: OptKind::MemUnits,
            default: "8K",
            help: "",
        },
        OptionSpec {
            name: "WAIT",
            kind: OptKind::Time,
            default: "10ms",
            help: "",
        },
        OptionSpec {
            name: "ON",
            kind: OptKind::Bool,
            default: "n",
            help: "",
        },
        OptionSpec {
            name: "GDR",
            kind: OptKind::Ternary,
            default: "try",
            help: "",
        },
        OptionSpec {
            name: "N",
            kind: OptKind::Uint,
            default: "3",
            help: "",
        },
        OptionSpec {
            name: "WORDS",
            kind: OptKind::List,
            default: "a,b",
            help: "",
        },
        OptionSpec {
            name: "MODE",
            kind: OptKind::Enum(&["get", "put"]),
            default: "get",
            help: "",
        },
    ];

    #[test]
    fn raw_reads_declared_names_with_or_without_prefix() {
        let mut c = Config::new(&[TABLE]).unwrap();
        c.set("SEG", "16k").unwrap();
        assert_eq!(c.raw("SEG").unwrap(), "16k");
        assert_eq!(c.raw("RUCX_SEG").unwrap(), "16k");
        assert_eq!(c.raw("RUCX_MODE").unwrap(), "get");
    }

    #[test]
    fn undeclared_names_are_errors() {
        let c = Config::new(&[TABLE]).unwrap();
        for name in ["SEGG", "RUCX_", "", "rucx_seg", "RUCX_RUCX_SEG"] {
            let e = c.raw(name).unwrap_err();
            assert!(matches!(e, Error::InvalidParam(_)), "{name}: {e:?}");
            assert!(e.to_string().contains("is not a rucx option"), "{e}");
            assert!(c.try_get::<bool>(name).is_err());
        }
        // The message names the variable the way a user writes it.
        let e = c.raw("SEGG").unwrap_err().to_string();
        assert!(e.contains("RUCX_SEGG") && e.contains("rucx-info -c"), "{e}");
    }

    #[test]
    fn try_get_reads_every_kind_and_refuses_other_kinds() {
        let c = Config::new(&[TABLE]).unwrap();
        assert!(c.try_get::<TlsSelection>("TLS").unwrap().allows("tcp"));
        assert_eq!(c.try_get::<MemUnits>("SEG").unwrap(), MemUnits::Bytes(8192));
        assert_eq!(
            c.try_get::<Duration>("WAIT").unwrap(),
            Duration::from_millis(10)
        );
        assert!(!c.try_get::<bool>("ON").unwrap());
        assert_eq!(c.try_get::<Ternary>("GDR").unwrap(), Ternary::Try);
        assert_eq!(c.try_get::<u64>("RUCX_N").unwrap(), 3);
        assert_eq!(c.try_get::<Vec<String>>("WORDS").unwrap(), ["a", "b"]);
        assert_eq!(c.try_get::<String>("MODE").unwrap(), "get");
        // The typed getters agree with `try_get`.
        assert_eq!(c.uint("N"), 3);
        assert_eq!(c.string("MODE"), "get");
        let e = c.try_get::<u64>("SEG").unwrap_err();
        assert!(matches!(e, Error::InvalidParam(_)));
        assert_eq!(
            e.to_string(),
            Error::InvalidParam("RUCX_SEG is a memunits option, not an integer".into()).to_string()
        );
        assert!(c.try_get::<String>("WORDS").is_err());
        assert!(c.try_get::<bool>("GDR").is_err());
    }

    #[test]
    #[should_panic(expected = "rucx bug: option RUCX_NOPE is not declared in any table")]
    fn typed_getters_still_panic_on_undeclared_names() {
        let c = Config::new(&[TABLE]).unwrap();
        let _ = c.bool("NOPE");
    }

    proptest! {
        #[test]
        fn try_lookups_never_panic(name in "\\PC{0,24}") {
            let c = Config::new(&[TABLE]).unwrap();
            let declared = TABLE
                .iter()
                .any(|s| name.strip_prefix(ENV_PREFIX).unwrap_or(&name) == s.name);
            prop_assert_eq!(c.raw(&name).is_ok(), declared);
            let _ = c.try_get::<bool>(&name);
            let _ = c.try_get::<TlsSelection>(&name);
        }
    }
}
