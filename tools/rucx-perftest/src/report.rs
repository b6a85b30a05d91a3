//! Output: the boxed table of `ucx_perftest`, CSV and JSON.

use std::fmt::Write as _;

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};

use crate::stats::Figures;

/// Inner widths of the table's columns.
const WIDTHS: [usize; 9] = [14, 14, 10, 9, 9, 10, 10, 11, 11];

fn rule(widths: &[usize]) -> String {
    let mut s = String::from("+");
    for w in widths {
        s.push_str(&"-".repeat(*w));
        s.push('+');
    }
    s
}

fn centered(text: &str, w: usize) -> String {
    format!("{text:^w$}")
}

/// Width of the whole table, borders included.
pub fn table_width() -> usize {
    WIDTHS.iter().sum::<usize>() + WIDTHS.len() + 1
}

/// A box of `label: value` lines as wide as the table (the header `ucx_perftest` prints).
pub fn info_box(lines: &[(&str, String)]) -> String {
    let inner = table_width() - 2;
    let mut s = format!("+{}+\n", "-".repeat(inner));
    for (k, v) in lines {
        let label = format!("{k}:");
        let mut first = true;
        // Wrap long values onto continuation lines.
        let room = inner.saturating_sub(16).max(10);
        let mut rest = v.as_str();
        while first || !rest.is_empty() {
            let cut = if rest.len() <= room {
                rest.len()
            } else {
                rest[..room]
                    .rfind([' ', ','])
                    .map(|i| i + 1)
                    .unwrap_or(room)
            };
            let (chunk, tail) = rest.split_at(cut);
            let head = if first { label.as_str() } else { "" };
            let line = format!(" {head:<14}{chunk}");
            let _ = writeln!(s, "|{line:<inner$}|");
            rest = tail.trim_start();
            first = false;
        }
    }
    let _ = write!(s, "+{}+", "-".repeat(inner));
    s
}

/// The column header of the table.
pub fn table_header() -> String {
    let w = WIDTHS;
    let top = [
        w[0],
        w[1],
        w[2] + w[3] + w[4] + 2,
        w[5] + w[6] + 1,
        w[7] + w[8] + 1,
    ];
    let mut s = String::new();
    let _ = writeln!(s, "{}", rule(&top));
    let _ = writeln!(
        s,
        "|{}|{}|{}|{}|{}|",
        " ".repeat(w[0]),
        " ".repeat(w[1]),
        centered("latency (usec)", top[2]),
        centered("bandwidth (MB/s)", top[3]),
        centered("message rate (msg/s)", top[4])
    );
    let _ = writeln!(s, "{}", rule(&w));
    let names = [
        "Size",
        "# iterations",
        "50.0%ile",
        "average",
        "overall",
        "average",
        "overall",
        "average",
        "overall",
    ];
    s.push('|');
    for (n, w) in names.iter().zip(w) {
        s.push_str(&centered(n, w));
        s.push('|');
    }
    s.push('\n');
    s.push_str(&rule(&w));
    s
}

/// `x` with `decimals` digits after the point, or fewer when that does not fit `width`
/// characters (a latency of seconds in microseconds, a bandwidth of millions of MB/s), or in
/// scientific notation when even no digits do: a row keeps the table's width at every size.
fn fit(x: f64, width: usize, decimals: usize) -> String {
    for d in (0..=decimals).rev() {
        let s = format!("{x:>width$.d$}");
        if s.len() <= width {
            return s;
        }
    }
    for d in (0..=3).rev() {
        let s = format!("{x:>width$.d$e}");
        if s.len() <= width {
            return s;
        }
    }
    format!("{:>width$}", "#")
}

/// One row of the table.
pub fn table_row(f: &Figures) -> String {
    let w = WIDTHS;
    let cols = [
        format!("{:>a$}", f.size, a = w[0] - 1),
        format!("{:>b$}", f.iterations, b = w[1] - 1),
        fit(f.lat_p50_us, w[2] - 1, 3),
        fit(f.lat_avg_us, w[3] - 1, 3),
        fit(f.lat_overall_us, w[4] - 1, 3),
        fit(f.bw_avg_mbs, w[5] - 1, 2),
        fit(f.bw_overall_mbs, w[6] - 1, 2),
        fit(f.mr_avg, w[7] - 1, 0),
        fit(f.mr_overall, w[8] - 1, 0),
    ];
    let mut s = String::from("|");
    for c in cols {
        s.push_str(&c);
        s.push_str(" |");
    }
    s
}

/// The closing rule of the table.
pub fn table_footer() -> String {
    rule(&WIDTHS)
}

/// CSV column names: `ucx_perftest -v`'s, with the test and size in front.
pub const CSV_HEADER: &str = "test,size,iterations,50.0_percentile_lat,avg_lat,overall_lat,\
avg_bw,overall_bw,avg_mr,overall_mr";

/// One CSV line.
pub fn csv_row(f: &Figures) -> String {
    format!(
        "{},{},{},{:.3},{:.3},{:.3},{:.2},{:.2},{:.0},{:.0}",
        f.test,
        f.size,
        f.iterations,
        f.lat_p50_us,
        f.lat_avg_us,
        f.lat_overall_us,
        f.bw_avg_mbs,
        f.bw_overall_mbs,
        f.mr_avg,
        f.mr_overall
    )
}

/// A figure in JSON: integral values as integers (`1`, not `1.0`), other finite values as the
/// shortest decimal that reads back, non-finite values as `null`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Num(pub f64);

impl Serialize for Num {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let x = self.0;
        if !x.is_finite() {
            s.serialize_none()
        } else if x.fract() == 0.0 && x.abs() < 1e38 {
            // Exact: an integral f64 below 1e38 fits an i128.
            s.serialize_i128(x as i128)
        } else {
            s.serialize_f64(x)
        }
    }
}

#[derive(Serialize)]
struct Latency {
    p50: Num,
    average: Num,
    overall: Num,
}

#[derive(Serialize)]
struct AvgOverall {
    average: Num,
    overall: Num,
}

/// One result as it appears in the JSON document.
#[derive(Serialize)]
struct JsonFigures<'a> {
    test: &'a str,
    size: usize,
    iterations: usize,
    latency_us: Latency,
    bandwidth_mbs: AvgOverall,
    message_rate: AvgOverall,
}

impl<'a> From<&'a Figures> for JsonFigures<'a> {
    fn from(f: &'a Figures) -> Self {
        JsonFigures {
            test: &f.test,
            size: f.size,
            iterations: f.iterations,
            latency_us: Latency {
                p50: Num(f.lat_p50_us),
                average: Num(f.lat_avg_us),
                overall: Num(f.lat_overall_us),
            },
            bandwidth_mbs: AvgOverall {
                average: Num(f.bw_avg_mbs),
                overall: Num(f.bw_overall_mbs),
            },
            message_rate: AvgOverall {
                average: Num(f.mr_avg),
                overall: Num(f.mr_overall),
            },
        }
    }
}

/// A JSON object of `"tool"`, then the `meta` entries in order, then `key: items`.
#[derive(Debug)]
pub struct Document<'a, T> {
    /// The tool's name.
    pub tool: &'a str,
    /// What ran where, as text.
    pub meta: &'a [(&'a str, String)],
    /// Name of the list.
    pub key: &'a str,
    /// The list.
    pub items: &'a [T],
}

impl<T: Serialize> Serialize for Document<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.meta.len() + 2))?;
        m.serialize_entry("tool", self.tool)?;
        for (k, v) in self.meta {
            m.serialize_entry(k, v)?;
        }
        m.serialize_entry(self.key, self.items)?;
        m.end()
    }
}

/// Serialize to compact JSON; our types always serialize.
pub fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("JSON of plain data")
}

/// One result as a JSON object.
pub fn json_figures(f: &Figures) -> String {
    to_json(&JsonFigures::from(f))
}

/// The whole JSON document: what ran where, and the results.
pub fn json_document(meta: &[(&str, String)], results: &[Figures]) -> String {
    let items: Vec<JsonFigures<'_>> = results.iter().map(JsonFigures::from).collect();
    to_json(&Document {
        tool: "rucx-perftest",
        meta,
        key: "results",
        items: &items,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    fn sample() -> Figures {
        Figures::compute(
            "tag_lat",
            8,
            &[Duration::from_micros(2); 10],
            Duration::from_micros(25),
            true,
        )
    }

    #[test]
    fn table_lines_line_up() {
        let h = table_header();
        let w = table_width();
        for line in h.lines() {
            assert_eq!(line.chars().count(), w, "{line:?}");
        }
        let row = table_row(&sample());
        assert_eq!(row.chars().count(), w, "{row:?}");
        assert_eq!(table_footer().len(), w);
        assert!(h.contains("50.0%ile") && h.contains("message rate (msg/s)"));
        assert!(row.contains(" 8 |") && row.contains("1.000"), "{row}");
        let b = info_box(&[("Test", "tag_lat".into()), ("Long", "x, ".repeat(80))]);
        for line in b.lines() {
            assert_eq!(line.chars().count(), w, "{line:?}");
        }
    }

    #[test]
    fn columns_are_right_and_line_up_at_huge_sizes() {
        let w = table_width();
        let s = Duration::from_secs;
        // 2 GiB + 1 and 4 GiB messages, one a second (a window drained inside the last
        // iteration): about 2048 and 4096 MB/s both ways, and rows as wide as the table.
        for (size, mbs) in [((2usize << 30) + 1, 2048.0), (4usize << 30, 4096.0)] {
            let f = Figures::compute("tag_bw", size, &[s(1); 10], s(10), false);
            assert!((f.bw_avg_mbs - mbs).abs() < 0.01, "{f:?}");
            assert!((f.bw_overall_mbs - mbs).abs() < 0.01, "{f:?}");
            assert!((f.mr_avg - 1.0).abs() < 1e-9 && (f.lat_avg_us - 1e6).abs() < 1e-6);
            let row = table_row(&f);
            assert_eq!(row.chars().count(), w, "{row:?}");
            assert!(row.contains(&format!(" {size} |")), "{row}");
            assert!(row.contains(&format!("{mbs:.2}")), "{row}");
            // Latency columns of a million microseconds lose decimals, not their alignment.
            assert!(row.contains("1000000.0"), "{row}");
        }
        // Values past every column's width still keep it (scientific notation).
        let mut f = Figures::compute("tag_bw", 1 << 40, &[s(100_000)], s(100_000), false);
        f.bw_avg_mbs = 1.8e13;
        let row = table_row(&f);
        assert_eq!(row.chars().count(), w, "{row:?}");
        assert!(row.contains("1.8") && row.contains('e'), "{row}");
        assert_eq!(fit(2.5, 9, 3), "    2.500");
        assert_eq!(fit(19778.5, 8, 3), "19778.50");
        assert_eq!(fit(123456789.0, 8, 3), " 1.235e8");
    }

    #[test]
    fn csv_has_the_header_columns() {
        let row = csv_row(&sample());
        let cols: Vec<&str> = row.split(',').collect();
        assert_eq!(cols.len(), CSV_HEADER.split(',').count());
        assert_eq!(&cols[..3], &["tag_lat", "8", "10"]);
        assert_eq!(cols[3], "1.000");
        assert_eq!(cols[5], "1.250");
        for c in &cols[2..] {
            assert!(c.parse::<f64>().is_ok(), "{c}");
        }
    }

    #[test]
    fn json_is_valid_and_complete() {
        let doc = json_document(
            &[("transports", "posix/memory \"q\"\n".into())],
            &[sample(), sample()],
        );
        let v: serde_json::Value = serde_json::from_str(&doc).expect(&doc);
        assert_eq!(v["tool"], "rucx-perftest");
        assert_eq!(v["transports"], "posix/memory \"q\"\n");
        let r = &v["results"][1];
        assert_eq!(r["test"], "tag_lat");
        assert_eq!(r["size"], 8);
        assert_eq!(r["iterations"], 10);
        assert_eq!(r["latency_us"]["p50"], 1.0);
        assert_eq!(r["latency_us"]["overall"], 1.25);
        assert!(r["bandwidth_mbs"]["average"].as_f64().unwrap() > 0.0);
        assert!(r["message_rate"]["overall"].as_f64().unwrap() > 0.0);
        assert_eq!(to_json(&Num(f64::NAN)), "null");
        assert_eq!(to_json(&Num(f64::NEG_INFINITY)), "null");
        assert_eq!(to_json(&Num(2.0)), "2");
        assert_eq!(to_json(&Num(-3.5)), "-3.5");
        assert_eq!(to_json(&"\u{1}"), "\"\\u0001\"");
        let one: serde_json::Value = serde_json::from_str(&json_figures(&sample())).unwrap();
        assert_eq!(
            one, v["results"][0],
            "one result alone is what the document holds"
        );
    }

    /// Results with every kind of number: integral, fractional, tiny, huge, non-finite; and
    /// text that needs escaping.
    pub(crate) fn fixed() -> Vec<Figures> {
        vec![
            Figures {
                test: "tag_lat".into(),
                size: 8,
                iterations: 1000,
                lat_p50_us: 1.0,
                lat_avg_us: 1.25,
                lat_overall_us: 1.375,
                bw_avg_mbs: 6.103515625,
                bw_overall_mbs: 5.548650568181818,
                mr_avg: 800000.0,
                mr_overall: 727272.7272727273,
            },
            Figures {
                test: "tag_bw \"q\"\n\t\u{1}\u{e9}".into(),
                size: 0,
                iterations: 3,
                lat_p50_us: 0.0001,
                lat_avg_us: 0.0,
                lat_overall_us: 12345.678,
                bw_avg_mbs: f64::NAN,
                bw_overall_mbs: f64::INFINITY,
                mr_avg: 1e16,
                mr_overall: 123456789012.5,
            },
        ]
    }

    /// Numbers compared by value (`1` and `1.0` alike), everything else exactly.
    pub(crate) fn same_content(a: &serde_json::Value, b: &serde_json::Value) -> bool {
        use serde_json::Value as V;
        match (a, b) {
            (V::Number(x), V::Number(y)) => x.as_f64() == y.as_f64(),
            (V::Array(x), V::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_content(p, q))
            }
            (V::Object(x), V::Object(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .zip(y)
                        .all(|((kp, p), (kq, q))| kp == kq && same_content(p, q))
            }
            _ => a == b,
        }
    }

    /// The JSON and CSV of a fixed input are what the hand-written serializer produced
    /// (captured in `tests/golden/` before the move to serde_json): the same text, and the
    /// same keys in the same order with the same values.
    #[test]
    fn output_unchanged_for_a_fixed_input() {
        let f = fixed();
        let meta = [
            ("transports", "posix/memory \"q\"\n".to_string()),
            ("memory", "host -> cuda".to_string()),
        ];
        let doc = json_document(&meta, &f);
        let golden = include_str!("../tests/golden/report.json");
        assert_eq!(doc, golden);
        let key_order = |s: &str| -> Vec<String> {
            let v: serde_json::Value = serde_json::from_str(s).unwrap();
            v.as_object().unwrap().keys().cloned().collect()
        };
        assert_eq!(key_order(&doc), key_order(golden));
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_str(&doc).unwrap(),
            serde_json::from_str(golden).unwrap(),
        );
        assert!(same_content(&a, &b));
        let mut csv = format!("{CSV_HEADER}\n");
        for x in &f {
            csv.push_str(&csv_row(x));
            csv.push('\n');
        }
        assert_eq!(csv, include_str!("../tests/golden/report.csv"));
    }
}
