//! Memory and time units.

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
pub const TIME_FORMS: &str = "a number with a unit: ns, us, ms, s, m (minutes), h (hours), or inf";

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

/// Parse `10us`, `1.5ms`, `2s`, `5m`, `24h`, `inf`.
///
/// The number is read as an exact decimal (no floating-point rounding): whole nanoseconds are
/// kept, finer fractions are cut off. A value beyond the largest [`Duration`] is an error.
pub fn parse_time(s: &str) -> Result<Duration, String> {
    let t = s.trim().to_ascii_lowercase();
    if t == "inf" {
        return Ok(Duration::MAX);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("{t:?} has no unit"))?;
    let (num, unit) = t.split_at(split);
    let unit_ns: u128 = match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        other => return Err(format!("unknown time unit {other:?}")),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
        return Err(format!("{num:?} is not a number"));
    }
    let too_long = || format!("{t:?} is longer than the largest duration; use inf for no limit");
    // `int` and `frac` hold ASCII digits only (the split above stops at anything else).
    let whole: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_long())?
    };
    let mut ns = whole.checked_mul(unit_ns).ok_or_else(too_long)?;
    // 20 fraction digits are finer than a nanosecond even for minutes, and 10^20 * 6e10 fits
    // in u128.
    let frac = &frac[..frac.len().min(20)];
    if !frac.is_empty() {
        let digits: u128 = frac
            .parse()
            .map_err(|_| format!("{num:?} is not a number"))?;
        let scale = 10u128.pow(frac.len() as u32);
        ns += digits * unit_ns / scale;
    }
    let secs = u64::try_from(ns / 1_000_000_000).map_err(|_| too_long())?;
    Ok(Duration::new(secs, (ns % 1_000_000_000) as u32))
}

/// Format a duration so that [`parse_time`] reads it back exactly (`inf`, `1500us`, `2s`).
pub fn format_time(d: Duration) -> String {
    if d == Duration::MAX {
        return "inf".into();
    }
    let ns = d.as_nanos();
    const UNITS: [(u128, &str); 5] = [
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
    ];
    for (u, name) in UNITS {
        if ns >= u && ns.is_multiple_of(u) {
            return format!("{}{name}", ns / u);
        }
    }
    format!("{ns}ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hours_and_minutes() {
        assert_eq!(parse_time("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_time("1.5h"), Ok(Duration::from_secs(5_400)));
        assert_eq!(format_time(Duration::from_secs(7_200)), "2h");
        assert_eq!(format_time(Duration::from_secs(5_400)), "90m");
        assert!(parse_time("1d").unwrap_err().contains("unknown time unit"));
    }
    use proptest::prelude::*;

    #[test]
    fn memunits_examples() {
        assert_eq!(parse_memunits("8K"), Ok(MemUnits::Bytes(8192)));
        assert_eq!(parse_memunits(" 4mb "), Ok(MemUnits::Bytes(4 << 20)));
        assert_eq!(parse_memunits("1GiB"), Ok(MemUnits::Bytes(1 << 30)));
        assert_eq!(parse_memunits("4096"), Ok(MemUnits::Bytes(4096)));
        assert_eq!(parse_memunits("INF"), Ok(MemUnits::Infinite));
        assert_eq!(parse_memunits("auto"), Ok(MemUnits::Auto));
        for bad in ["", "12Q", "K", "-1", "1.5M", "4 K", "0x10"] {
            assert!(parse_memunits(bad).is_err(), "{bad:?}");
        }
        assert!(
            parse_memunits("16777216T")
                .unwrap_err()
                .contains("overflows")
        );
        assert!(
            parse_memunits("99999999999999999999")
                .unwrap_err()
                .contains("64 bits")
        );
        assert_eq!(MemUnits::Auto.resolve(7), 7);
        assert_eq!(MemUnits::Infinite.resolve(7), u64::MAX);
        assert_eq!(format_bytes(1536), "1536");
        assert_eq!(format_bytes(3 << 20), "3M");
        assert_eq!(format_bytes(0), "0");
    }

    #[test]
    fn time_examples() {
        assert_eq!(parse_time("10us"), Ok(Duration::from_micros(10)));
        assert_eq!(parse_time("1.5ms"), Ok(Duration::from_micros(1500)));
        assert_eq!(parse_time(".5s"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_time("2S"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_time("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(
            parse_time("0.0000000019s"),
            Ok(Duration::from_nanos(1)),
            "cut, not rounded"
        );
        assert_eq!(parse_time("inf"), Ok(Duration::MAX));
        for bad in [
            "",
            "10",
            "s",
            ".s",
            "1.2.3ms",
            "10 parsecs",
            "-1s",
            "1e3ms",
            "10d",
        ] {
            assert!(parse_time(bad).is_err(), "{bad:?}");
        }
        let e = parse_time("18446744073709551616s").unwrap_err();
        assert!(e.contains("largest duration"), "{e}");
        assert_eq!(format_time(Duration::from_micros(1500)), "1500us");
        assert_eq!(format_time(Duration::from_secs(120)), "2m");
        assert_eq!(format_time(Duration::ZERO), "0ns");
    }

    fn suffix() -> impl Strategy<Value = (&'static str, u32)> {
        prop::sample::select(vec![
            ("", 0),
            ("b", 0),
            ("B", 0),
            ("k", 10),
            ("K", 10),
            ("kb", 10),
            ("KiB", 10),
            ("m", 20),
            ("MB", 20),
            ("g", 30),
            ("GiB", 30),
            ("t", 40),
            ("Tb", 40),
        ])
    }

    fn time_unit() -> impl Strategy<Value = (&'static str, u128)> {
        prop::sample::select(vec![
            ("ns", 1u128),
            ("us", 1_000),
            ("US", 1_000),
            ("ms", 1_000_000),
            ("s", 1_000_000_000),
            ("m", 60_000_000_000),
            ("h", 3_600_000_000_000),
        ])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn format_bytes_round_trips(b in any::<u64>(), shift in 0u32..48) {
            // Both arbitrary values and values with many trailing zero bits (which get a suffix).
            for v in [b, b >> shift << shift, (b >> 50) << shift] {
                prop_assert_eq!(parse_memunits(&format_bytes(v)), Ok(MemUnits::Bytes(v)));
                prop_assert_eq!(parse_memunits(&MemUnits::Bytes(v).to_string()), Ok(MemUnits::Bytes(v)));
            }
        }

        #[test]
        fn memunits_number_and_suffix(n in any::<u64>(), (suf, shift) in suffix()) {
            let got = parse_memunits(&format!("{n}{suf}"));
            match n.checked_mul(1u64 << shift) {
                Some(v) => prop_assert_eq!(got, Ok(MemUnits::Bytes(v))),
                None => {
                    let e = got.unwrap_err();
                    prop_assert!(e.contains("overflows"), "{}", e);
                }
            }
        }

        #[test]
        fn memunits_overflow_is_an_error(extra in 1u64..1000, (suf, shift) in suffix()) {
            prop_assume!(shift > 0);
            let n = (u64::MAX >> shift) + extra;
            let overflowing = format!("{n}{suf}");
            prop_assert!(parse_memunits(&overflowing).is_err());
            // A number that does not fit in 64 bits at all.
            let huge = format!("{}{extra}{suf}", u64::MAX);
            prop_assert!(parse_memunits(&huge).is_err());
        }

        #[test]
        fn memunits_parser_never_panics(s in "\\PC{0,24}", t in "[0-9kKmMgGtTbBiI. +-]{0,24}") {
            let _ = parse_memunits(&s);
            let _ = parse_memunits(&t);
        }

        #[test]
        fn time_round_trips(ns in any::<u64>(), secs in any::<u64>(), sub in 0u32..1_000_000_000) {
            for d in [Duration::from_nanos(ns), Duration::new(secs, sub), Duration::from_secs(secs)] {
                prop_assert_eq!(parse_time(&format_time(d)), Ok(d), "{}", format_time(d));
            }
        }

        #[test]
        fn time_decimal_is_exact(int in 0u64..1_000_000, frac in "[0-9]{0,12}", (unit, unit_ns) in time_unit()) {
            let text = format!("{int}.{frac}{unit}");
            let scale = 10u128.pow(frac.len() as u32);
            let digits: u128 = if frac.is_empty() { 0 } else { frac.parse().unwrap() };
            let want = u128::from(int) * unit_ns + digits * unit_ns / scale;
            prop_assert_eq!(parse_time(&text).map(|d| d.as_nanos()), Ok(want), "{}", text);
        }

        #[test]
        fn time_overflow_is_an_error(extra in 1u64..1000) {
            let too_many_secs = u128::from(u64::MAX) + u128::from(extra);
            for text in [
                format!("{too_many_secs}s"),
                format!("{}m", u64::MAX),
                format!("{}{extra}ns", u128::MAX),
            ] {
                prop_assert!(parse_time(&text).is_err(), "{}", text);
            }
        }

        #[test]
        fn time_parser_never_panics(s in "\\PC{0,24}", t in "[0-9.]{0,30}(ns|us|ms|s|m|h|)") {
            let _ = parse_time(&s);
            let _ = parse_time(&t);
        }
    }
}
