//! Output: the boxed table of `ucx_perftest`, CSV and JSON.

use std::fmt::Write as _;

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

/// One row of the table.
pub fn table_row(f: &Figures) -> String {
    let w = WIDTHS;
    format!(
        "|{:>a$} |{:>b$} |{:>c$.3} |{:>d$.3} |{:>e$.3} |{:>f$.2} |{:>g$.2} |{:>h$.0} |{:>i$.0} |",
        f.size,
        f.iterations,
        f.lat_p50_us,
        f.lat_avg_us,
        f.lat_overall_us,
        f.bw_avg_mbs,
        f.bw_overall_mbs,
        f.mr_avg,
        f.mr_overall,
        a = w[0] - 1,
        b = w[1] - 1,
        c = w[2] - 1,
        d = w[3] - 1,
        e = w[4] - 1,
        f = w[5] - 1,
        g = w[6] - 1,
        h = w[7] - 1,
        i = w[8] - 1,
    )
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

/// A JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// A JSON number (non-finite values become `null`).
pub fn json_num(x: f64) -> String {
    if x.is_finite() {
        // Shortest representation that parses back; integers without a fraction.
        format!("{x}")
    } else {
        "null".into()
    }
}

/// One result as a JSON object.
pub fn json_figures(f: &Figures) -> String {
    format!(
        "{{\"test\":{},\"size\":{},\"iterations\":{},\
\"latency_us\":{{\"p50\":{},\"average\":{},\"overall\":{}}},\
\"bandwidth_mbs\":{{\"average\":{},\"overall\":{}}},\
\"message_rate\":{{\"average\":{},\"overall\":{}}}}}",
        json_str(&f.test),
        f.size,
        f.iterations,
        json_num(f.lat_p50_us),
        json_num(f.lat_avg_us),
        json_num(f.lat_overall_us),
        json_num(f.bw_avg_mbs),
        json_num(f.bw_overall_mbs),
        json_num(f.mr_avg),
        json_num(f.mr_overall)
    )
}

/// The whole JSON document: what ran where, and the results.
pub fn json_document(meta: &[(&str, String)], results: &[Figures]) -> String {
    let mut s = String::from("{\"tool\":\"rucx-perftest\"");
    for (k, v) in meta {
        let _ = write!(s, ",{}:{}", json_str(k), json_str(v));
    }
    s.push_str(",\"results\":[");
    for (i, f) in results.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&json_figures(f));
    }
    s.push_str("]}");
    s
}

#[cfg(test)]
mod tests {
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
        assert_eq!(json_num(f64::NAN), "null");
        assert_eq!(json_str("\u{1}"), "\"\\u0001\"");
    }
}
