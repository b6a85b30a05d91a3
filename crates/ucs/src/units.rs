//! Memory and time units. (Contract: helper hardens and adds proptests.)

use std::fmt;
use std::time::Duration;

/// A memory size as configured: a byte count, unlimited, or "let rucx decide".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemUnits {
    /// An exact number of bytes.
    Bytes(u64),
    /// No limit (`inf`).
    Infinite,
    /// Chosen automatically (`auto`).
    Auto,
}

impl MemUnits {
    /// The byte count, with `inf` as `u64::MAX` and `auto` as `auto_value`.
    pub fn resolve(self, auto_value: u64) -> u64 {
        match self {
            MemUnits::Bytes(b) => b,
            MemUnits::Infinite => u64::MAX,
            MemUnits::Auto => auto_value,
        }
    }
}

impl fmt::Display for MemUnits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemUnits::Infinite => f.write_str("inf"),
            MemUnits::Auto => f.write_str("auto"),
            MemUnits::Bytes(b) => f.write_str(&format_bytes(*b)),
        }
    }
}

/// Accepted forms, for error messages.
pub const MEMUNITS_FORMS: &str =
    "a byte count with an optional suffix b, K, M, G, T (powers of 1024), or inf, or auto";

/// Accepted time forms, for error messages.
pub const TIME_FORMS: &str = "a number with a unit: ns, us, ms, s, m (minutes), or inf";

/// Parse `8K`, `4M`, `1g`, `4096`, `inf`, `auto`.
pub fn parse_memunits(s: &str) -> Result<MemUnits, String> {
    let t = s.trim();
    match t.to_ascii_lowercase().as_str() {
        "inf" | "unlimited" => return Ok(MemUnits::Infinite),
        "auto" => return Ok(MemUnits::Auto),
        "" => return Err("empty value".into()),
        _ => {}
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("{t:?} does not start with a number"));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{num:?} is not a number that fits in 64 bits"))?;
    let mult: u64 = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size suffix {other:?}")),
    };
    n.checked_mul(mult)
        .map(MemUnits::Bytes)
        .ok_or_else(|| format!("{t:?} overflows 64 bits"))
}

/// Format a byte count compactly (`4K`, `1536`, `2M`).
pub fn format_bytes(b: u64) -> String {
    const SUFFIXES: [(u64, &str); 4] = [
        (1 << 40, "T"),
        (1 << 30, "G"),
        (1 << 20, "M"),
        (1 << 10, "K"),
    ];
    for (m, s) in SUFFIXES {
        if b >= m && b.is_multiple_of(m) {
            return format!("{}{s}", b / m);
        }
    }
    b.to_string()
}

/// Parse `10us`, `1.5ms`, `2s`, `inf`.
pub fn parse_time(s: &str) -> Result<Duration, String> {
    let t = s.trim().to_ascii_lowercase();
    if t == "inf" {
        return Ok(Duration::MAX);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("{t:?} has no unit"))?;
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{num:?} is not a number"))?;
    let secs = match unit {
        "ns" => v * 1e-9,
        "us" => v * 1e-6,
        "ms" => v * 1e-3,
        "s" => v,
        "m" => v * 60.0,
        other => return Err(format!("unknown time unit {other:?}")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{t:?}: {e}"))
}
