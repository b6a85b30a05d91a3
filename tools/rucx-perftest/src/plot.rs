//! SVG line plots with a log2 size axis, written by hand (no plotting crate).

use std::fmt::Write as _;

/// One line of a panel.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Stroke color (CSS).
    pub color: String,
    /// Points: message size in bytes, value.
    pub points: Vec<(f64, f64)>,
    /// Draw the line dashed (e.g. the reference tool).
    pub dashed: bool,
}

/// One panel: a title, an axis label and its lines.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Title above the panel.
    pub title: String,
    /// Label of the y axis.
    pub y_label: String,
    /// Logarithmic y axis (base 10).
    pub log_y: bool,
    /// The lines.
    pub series: Vec<Series>,
}

/// Colors for successive series.
pub const PALETTE: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

const PW: f64 = 520.0;
const PH: f64 = 360.0;
const ML: f64 = 72.0;
const MR: f64 = 20.0;
const MT: f64 = 40.0;
const MB: f64 = 78.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Compact size label: 1, 2, ..., 512, 1K, ..., 4M.
pub fn size_label(b: f64) -> String {
    let b = b as u64;
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

fn num_label(v: f64) -> String {
    if v >= 1000.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{}", (v * 100.0).round() / 100.0)
    } else {
        format!("{v}")
    }
}

/// Nice linear ticks covering [lo, hi].
fn linear_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= 6.0)
        .unwrap_or(10.0 * mag);
    let mut v = (lo / step).floor() * step;
    let mut out = Vec::new();
    while v <= hi + step * 1e-9 {
        out.push(v);
        v += step;
    }
    out
}

fn panel_svg(out: &mut String, p: &Panel, ox: f64) {
    let pts: Vec<(f64, f64)> = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| *x > 0.0 && y.is_finite() && (!p.log_y || *y > 0.0))
        .collect();
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="24" font-size="15" text-anchor="middle" font-weight="bold">{}</text>"#,
        ox + ML + (PW - ML - MR) / 2.0,
        esc(&p.title)
    );
    let (x0, y0, x1, y1) = (ox + ML, MT, ox + PW - MR, PH - MB);
    let _ = writeln!(
        out,
        r##"<rect x="{x0:.1}" y="{y0:.1}" width="{:.1}" height="{:.1}" fill="#fafafa" stroke="#333"/>"##,
        x1 - x0,
        y1 - y0
    );
    if pts.is_empty() {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">no data</text>"#,
            (x0 + x1) / 2.0,
            (y0 + y1) / 2.0
        );
        return;
    }
    let lx = |x: f64| x.log2();
    let (mut xmin, mut xmax) = (f64::MAX, f64::MIN);
    let (mut ymin, mut ymax) = (f64::MAX, f64::MIN);
    for (x, y) in &pts {
        xmin = xmin.min(lx(*x));
        xmax = xmax.max(lx(*x));
        ymin = ymin.min(*y);
        ymax = ymax.max(*y);
    }
    if xmax - xmin < 1.0 {
        xmin -= 0.5;
        xmax += 0.5;
    }
    // y range: whole decades on a log axis, nice steps on a linear one.
    let (ty, yticks): (Box<dyn Fn(f64) -> f64>, Vec<f64>) = if p.log_y {
        let lo = ymin.log10().floor();
        let mut hi = ymax.log10().ceil();
        if hi <= lo {
            hi = lo + 1.0;
        }
        let ticks = (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect();
        (Box::new(move |y: f64| (y.log10() - lo) / (hi - lo)), ticks)
    } else {
        let ticks = linear_ticks(0.0, ymax * 1.05);
        let hi = *ticks.last().expect("ticks");
        (Box::new(move |y: f64| y / hi), ticks)
    };
    let sx = |x: f64| x0 + (lx(x) - xmin) / (xmax - xmin) * (x1 - x0);
    let sy = |y: f64| y1 - ty(y) * (y1 - y0);
    // Grid and tick labels.
    for t in &yticks {
        let y = sy(*t);
        let _ = writeln!(
            out,
            r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{x1:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            x0 - 5.0,
            y + 4.0,
            num_label(*t)
        );
    }
    let mut k = xmin.ceil() as i32;
    let every = if xmax - xmin > 12.0 { 2 } else { 1 };
    while f64::from(k) <= xmax + 1e-9 {
        let xv = 2f64.powi(k);
        let x = sx(xv);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{y0:.1}" x2="{x:.1}" y2="{y1:.1}" stroke="#eee"/>"##
        );
        if k.rem_euclid(every) == 0 {
            let _ = writeln!(
                out,
                r#"<text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
                y1 + 16.0,
                size_label(xv)
            );
        }
        k += 1;
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">message size (bytes, log2 scale)</text>"#,
        (x0 + x1) / 2.0,
        y1 + 36.0
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate({:.1},{:.1}) rotate(-90)" font-size="12" text-anchor="middle">{}</text>"#,
        ox + 16.0,
        (y0 + y1) / 2.0,
        esc(&p.y_label)
    );
    // Lines, markers, legend.
    for (i, s) in p.series.iter().enumerate() {
        let mut path = String::new();
        for (x, y) in &s.points {
            if *x <= 0.0 || !y.is_finite() || (p.log_y && *y <= 0.0) {
                continue;
            }
            let _ = write!(
                path,
                "{}{:.1},{:.1}",
                if path.is_empty() { "M" } else { " L" },
                sx(*x),
                sy(*y)
            );
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                sx(*x),
                sy(*y),
                esc(&s.color)
            );
        }
        let dash = if s.dashed {
            r#" stroke-dasharray="6,4""#
        } else {
            ""
        };
        let _ = writeln!(
            out,
            r#"<path d="{path}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
            esc(&s.color)
        );
        // Legend below the axis label, two entries per row, so it never hides data.
        let ly = y1 + 54.0 + 16.0 * (i / 2) as f64;
        let lxp = x0 + 10.0 + 210.0 * (i % 2) as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{lxp:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="3"{dash}/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            lxp + 18.0,
            esc(&s.color),
            lxp + 24.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
}

/// An SVG document with the panels side by side and a caption below.
pub fn svg(panels: &[Panel], caption: &str) -> String {
    let w = PW * panels.len().max(1) as f64;
    let h = PH + 24.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (i, p) in panels.iter().enumerate() {
        panel_svg(&mut out, p, PW * i as f64);
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle" fill="#555">{}</text>"##,
        w / 2.0,
        h - 8.0,
        esc(caption)
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panel(log_y: bool, pts: Vec<(f64, f64)>) -> Panel {
        Panel {
            title: "latency <us>".into(),
            y_label: "usec".into(),
            log_y,
            series: vec![Series {
                name: "rucx & co".into(),
                color: PALETTE[0].into(),
                points: pts,
                dashed: true,
            }],
        }
    }

    #[test]
    fn svg_is_well_formed_and_escaped() {
        let pts: Vec<(f64, f64)> = (0..23).map(|k| (2f64.powi(k), 1.0 + k as f64)).collect();
        let s = svg(&[panel(true, pts.clone()), panel(false, pts)], "caption");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("latency &lt;us&gt;") && s.contains("rucx &amp; co"));
        assert!(s.contains(">4M<") && s.contains(">1K<"));
        assert_eq!(s.matches("<path").count(), 2);
        assert!(s.contains("stroke-dasharray"));
        assert_eq!(s.matches("<circle").count(), 46);
        // Every tag opened is closed or self-closed.
        assert_eq!(s.matches("<svg").count(), s.matches("</svg>").count());
        assert_eq!(s.matches("<text").count(), s.matches("</text>").count());
    }

    #[test]
    fn empty_and_degenerate_panels_do_not_panic() {
        let s = svg(&[panel(true, vec![])], "");
        assert!(s.contains("no data"));
        let s = svg(&[panel(true, vec![(8.0, 0.0), (8.0, f64::NAN)])], "");
        assert!(s.contains("no data"));
        let s = svg(&[panel(false, vec![(8.0, 5.0)])], "");
        assert!(s.contains("<path"));
        assert!(!s.contains("NaN") && !s.contains("inf"));
    }

    #[test]
    fn labels() {
        assert_eq!(size_label(1.0), "1");
        assert_eq!(size_label(2048.0), "2K");
        assert_eq!(size_label(4194304.0), "4M");
        assert_eq!(linear_ticks(0.0, 10.0).last().copied(), Some(10.0));
    }
}
