//! Line plots with a log2 size axis, drawn with `plotters`: SVG (its SVG backend) or PNG (its
//! bitmap backend), the same drawing code for both.
//!
//! Text is laid out (and, in a PNG, rasterized) with `ab_glyph` and a font embedded in the
//! binary, DejaVu Sans (`assets/`, free license in `assets/DejaVu-LICENSE`): no fontconfig or
//! FreeType, nothing looked up at run time, so plots come out alike on every machine.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

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

/// Width of one panel, pixels.
const PW: u32 = 520;
/// Height of the panels, pixels (the caption goes below).
const PH: u32 = 360;
/// Height of the caption line.
const CAPTION_H: u32 = 24;
/// Room below each chart for its legend: two entries per row.
const LEGEND_ROW_H: u32 = 16;

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

/// A `#rrggbb` color (black for anything else).
fn color(css: &str) -> RGBColor {
    let hex = css.strip_prefix('#').unwrap_or("");
    let byte = |i: usize| {
        hex.get(i..i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0)
    };
    if hex.len() == 6 {
        RGBColor(byte(0), byte(2), byte(4))
    } else {
        BLACK
    }
}

/// A font size that `plotters`' SVG backend writes as `size` (it divides by 1.24).
fn px(size: f64) -> f64 {
    size * 1.24
}

type DrawResult = Result<(), String>;

/// DejaVu Sans, the font of every label (bold text uses it too: one file is enough).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Register the embedded font with `plotters` once (text layout needs it in SVGs too).
fn fonts() -> DrawResult {
    static DONE: OnceLock<DrawResult> = OnceLock::new();
    DONE.get_or_init(|| {
        for style in [FontStyle::Normal, FontStyle::Bold] {
            plotters::style::register_font("sans-serif", style, FONT)
                .map_err(|_| "the embedded font does not load".to_string())?;
        }
        Ok(())
    })
    .clone()
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("drawing the plot: {e:?}")
}

/// The points of a panel that can be drawn (positive sizes, finite values, positive on a log
/// axis).
fn drawable(p: &Panel, (x, y): (f64, f64)) -> bool {
    x > 0.0 && y.is_finite() && (!p.log_y || y > 0.0)
}

fn panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> DrawResult {
    let legend_rows = p.series.len().div_ceil(2) as u32;
    let legend_h = (6 + LEGEND_ROW_H * legend_rows).min(PH / 2);
    let (chart_area, legend_area) = area.split_vertically(PH - legend_h);
    let pts: Vec<(f64, f64)> = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|&pt| drawable(p, pt))
        .collect();
    let title = ("sans-serif", px(15.0)).into_font().style(FontStyle::Bold);
    if pts.is_empty() {
        let area = chart_area.titled(&p.title, title).map_err(err)?;
        let (w, h) = area.dim_in_pixel();
        area.draw(&Rectangle::new(
            [(52, 16), (w as i32 - 20, h as i32 - 60)],
            RGBColor(0x33, 0x33, 0x33).stroke_width(1),
        ))
        .map_err(err)?;
        let centered = TextStyle::from(("sans-serif", px(14.0)).into_font())
            .pos(Pos::new(HPos::Center, VPos::Center));
        area.draw(&Text::new(
            "no data",
            (w as i32 / 2, h as i32 / 2 - 20),
            centered,
        ))
        .map_err(err)?;
        return Ok(());
    }
    let (mut xmin, mut xmax) = (f64::MAX, f64::MIN);
    let (mut ymin, mut ymax) = (f64::MAX, f64::MIN);
    for (x, y) in &pts {
        xmin = xmin.min(x.log2());
        xmax = xmax.max(x.log2());
        ymin = ymin.min(*y);
        ymax = ymax.max(*y);
    }
    if xmax - xmin < 1.0 {
        xmin -= 0.5;
        xmax += 0.5;
    }
    // y: whole decades on a log axis (drawn in log10 units), from 0 on a linear one.
    let (ylo, yhi, ty): (f64, f64, fn(f64) -> f64) = if p.log_y {
        let lo = ymin.log10().floor();
        let hi = ymax.log10().ceil().max(lo + 1.0);
        (lo, hi, f64::log10)
    } else {
        (0.0, (ymax * 1.05).max(f64::MIN_POSITIVE), |y| y)
    };
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(&p.title, title)
        .margin_right(20)
        .x_label_area_size(40)
        .y_label_area_size(52)
        .build_cartesian_2d(xmin..xmax, ylo..yhi)
        .map_err(err)?;
    let log_y = p.log_y;
    let x_label = |v: &f64| {
        if (v - v.round()).abs() < 1e-9 {
            size_label(2f64.powf(v.round()))
        } else {
            String::new()
        }
    };
    let y_label = |v: &f64| {
        if !log_y {
            num_label(*v)
        } else if (v - v.round()).abs() < 1e-9 {
            num_label(10f64.powf(v.round()))
        } else {
            String::new()
        }
    };
    let x_steps = ((xmax - xmin).floor() as usize + 1).min(12);
    let y_steps = if log_y { (yhi - ylo) as usize + 1 } else { 6 };
    chart
        .configure_mesh()
        .x_labels(x_steps)
        .y_labels(y_steps)
        .x_label_formatter(&x_label)
        .y_label_formatter(&y_label)
        .x_desc("message size (bytes, log2 scale)")
        .y_desc(p.y_label.as_str())
        .label_style(("sans-serif", px(11.0)))
        .axis_desc_style(("sans-serif", px(12.0)))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
        .draw()
        .map_err(err)?;
    for s in &p.series {
        let c = color(&s.color);
        let line: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|&pt| drawable(p, pt))
            .map(|(x, y)| (x.log2(), ty(y)))
            .collect();
        let style = c.stroke_width(2);
        if s.dashed {
            chart
                .draw_series(DashedLineSeries::new(line.iter().copied(), 6, 4, style))
                .map_err(err)?;
        } else {
            chart
                .draw_series(LineSeries::new(line.iter().copied(), style))
                .map_err(err)?;
        }
        chart
            .draw_series(line.iter().map(|&pt| Circle::new(pt, 2.5, c.filled())))
            .map_err(err)?;
    }
    // The legend below the chart, two entries per row, so it never hides data.
    for (i, s) in p.series.iter().enumerate() {
        let c = color(&s.color);
        let y = 8 + (LEGEND_ROW_H * (i as u32 / 2)) as i32;
        let x = 62 + 210 * (i % 2) as i32;
        let style = c.stroke_width(3);
        if s.dashed {
            legend_area
                .draw(&DashedPathElement::new([(x, y), (x + 18, y)], 6, 4, style))
                .map_err(err)?;
        } else {
            legend_area
                .draw(&PathElement::new([(x, y), (x + 18, y)], style))
                .map_err(err)?;
        }
        let text = TextStyle::from(("sans-serif", px(12.0)).into_font())
            .pos(Pos::new(HPos::Left, VPos::Center));
        legend_area
            .draw(&Text::new(s.name.as_str(), (x + 24, y), text))
            .map_err(err)?;
    }
    Ok(())
}

/// Draw the panels side by side and the caption below them on `root` (`w` pixels wide).
fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    w: u32,
    panels: &[Panel],
    caption: &str,
) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    let (body, foot) = root.split_vertically(PH);
    for (p, area) in panels
        .iter()
        .zip(body.split_evenly((1, panels.len().max(1))))
    {
        panel(&area, p)?;
    }
    let text = TextStyle::from(("sans-serif", px(11.0)).into_font())
        .color(&RGBColor(0x55, 0x55, 0x55))
        .pos(Pos::new(HPos::Center, VPos::Center));
    foot.draw(&Text::new(
        caption,
        (w as i32 / 2, CAPTION_H as i32 / 2),
        text,
    ))
    .map_err(err)?;
    root.present().map_err(err)
}

/// Width and height of a figure of `n` panels, pixels.
fn dims(n: usize) -> (u32, u32) {
    (PW * n.max(1) as u32, PH + CAPTION_H)
}

/// An SVG document with the panels side by side and a caption below.
pub fn svg(panels: &[Panel], caption: &str) -> Result<String, String> {
    fonts()?;
    let (w, h) = dims(panels.len());
    let mut out = String::new();
    draw(
        SVGBackend::with_string(&mut out, (w, h)).into_drawing_area(),
        w,
        panels,
        caption,
    )?;
    Ok(out)
}

/// The same figure as a PNG file at `path`.
pub fn png(panels: &[Panel], caption: &str, path: &Path) -> Result<(), String> {
    fonts()?;
    let (w, h) = dims(panels.len());
    draw(
        BitMapBackend::new(path, (w, h)).into_drawing_area(),
        w,
        panels,
        caption,
    )
    .map_err(|e| format!("{e} (writing {})", path.display()))
}

/// Write the figure to `path`: PNG when its name ends in `.png` (any case), else SVG.
pub fn write(path: &Path, panels: &[Panel], caption: &str) -> Result<(), String> {
    let is_png = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if is_png {
        png(panels, caption, path)
    } else {
        let doc = svg(panels, caption)?;
        std::fs::write(path, doc).map_err(|e| format!("writing {}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panel(log_y: bool, pts: Vec<(f64, f64)>, dashed: bool) -> Panel {
        Panel {
            title: "latency <us>".into(),
            y_label: "usec".into(),
            log_y,
            series: vec![Series {
                name: "rucx & co".into(),
                color: PALETTE[0].into(),
                points: pts,
                dashed,
            }],
        }
    }

    /// The text of every `<text>` element, in order.
    fn texts(svg: &str) -> Vec<&str> {
        svg.split("<text")
            .skip(1)
            .map(|t| {
                let body = &t[t.find('>').expect("tag end") + 1..];
                body[..body.find("</text>").expect("closed")].trim()
            })
            .collect()
    }

    #[test]
    fn svg_has_the_panels_content_escaped() {
        let pts: Vec<(f64, f64)> = (0..23).map(|k| (2f64.powi(k), 1.0 + k as f64)).collect();
        let s = svg(
            &[panel(true, pts.clone(), true), panel(false, pts, false)],
            "caption & more",
        )
        .unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(
            s.contains(r#"width="1040" height="384""#),
            "two panels side by side"
        );
        let t = texts(&s);
        // Per panel: title, axis labels, size ticks from 1 to 4M, the legend entry.
        assert_eq!(t.iter().filter(|x| **x == "latency &lt;us&gt;").count(), 2);
        assert_eq!(t.iter().filter(|x| **x == "rucx &amp; co").count(), 2);
        assert_eq!(t.iter().filter(|x| **x == "usec").count(), 2);
        assert_eq!(
            t.iter()
                .filter(|x| **x == "message size (bytes, log2 scale)")
                .count(),
            2
        );
        for size in ["1", "4", "1K", "4K", "1M", "4M"] {
            assert!(t.contains(&size), "{size} in {t:?}");
        }
        // The log panel's y ticks are whole decades.
        assert!(t.contains(&"10") && t.contains(&"100"), "{t:?}");
        assert_eq!(t.last(), Some(&"caption &amp; more"));
        // One marker per point; the solid line is one polyline, the dashed one many pieces.
        assert_eq!(s.matches("<circle").count(), 46);
        let solid = svg(
            &[panel(
                true,
                (1..4).map(|k| (k as f64, 1.0)).collect(),
                false,
            )],
            "",
        )
        .unwrap();
        let dashed = svg(
            &[panel(true, (1..4).map(|k| (k as f64, 1.0)).collect(), true)],
            "",
        )
        .unwrap();
        assert!(
            dashed.matches("<polyline").count() > solid.matches("<polyline").count() + 2,
            "dashed lines are drawn in pieces"
        );
        assert!(s.contains(&PALETTE[0].to_uppercase()));
        // Every tag opened is closed or self-closed.
        assert_eq!(s.matches("<svg").count(), s.matches("</svg>").count());
        assert_eq!(s.matches("<text").count(), s.matches("</text>").count());
    }

    #[test]
    fn empty_and_degenerate_panels_do_not_panic() {
        let s = svg(&[panel(true, vec![], true)], "").unwrap();
        assert!(texts(&s).contains(&"no data"));
        let s = svg(&[panel(true, vec![(8.0, 0.0), (8.0, f64::NAN)], false)], "").unwrap();
        assert!(texts(&s).contains(&"no data"));
        let s = svg(&[panel(false, vec![(8.0, 5.0)], false)], "").unwrap();
        assert!(s.contains("<polyline") && s.contains("<circle"));
        assert!(!texts(&s).contains(&"no data"));
        assert!(!s.contains("NaN") && !s.contains("inf"));
        let s = svg(&[], "nothing").unwrap();
        assert!(s.contains(r#"width="520""#));
    }

    /// A PNG is written, decodes, has the figure's size and shows the lines in their color.
    #[test]
    fn png_is_written_and_decodes() {
        let dir = std::env::temp_dir().join(format!("rucx-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pts: Vec<(f64, f64)> = (0..23).map(|k| (2f64.powi(k), 1.0 + k as f64)).collect();
        let panels = [panel(true, pts.clone(), true), panel(false, pts, false)];
        let path = dir.join("sweep.PNG");
        write(&path, &panels, "caption").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
        assert_eq!((be(16), be(20)), (1040, 384), "two panels side by side");
        let img = image::load_from_memory(&bytes).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (1040, 384));
        let line = image::Rgb([0x1f, 0x77, 0xb4]);
        let colored = img.pixels().filter(|p| **p == line).count();
        assert!(
            colored > 500,
            "the series are drawn: {colored} pixels of their color"
        );
        // Text was rasterized: dark pixels besides the lines (titles, labels, caption).
        let dark = img
            .pixels()
            .filter(|p| p.0.iter().all(|&c| c < 0x40))
            .count();
        assert!(dark > 500, "{dark} dark pixels");
        // Another extension is SVG.
        let svg_path = dir.join("sweep.svg");
        write(&svg_path, &panels, "caption").unwrap();
        assert!(
            std::fs::read_to_string(&svg_path)
                .unwrap()
                .starts_with("<svg")
        );
        // An unwritable place is an error naming it, not a panic.
        let e = write(&dir.join("no/such/dir/x.png"), &panels, "").unwrap_err();
        assert!(e.contains("x.png"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn labels_and_colors() {
        assert_eq!(size_label(1.0), "1");
        assert_eq!(size_label(2048.0), "2K");
        assert_eq!(size_label(4194304.0), "4M");
        assert_eq!(num_label(1234.4), "1234");
        assert_eq!(num_label(2.345), "2.35");
        assert_eq!(num_label(0.5), "0.5");
        assert_eq!(color("#1f77b4"), RGBColor(0x1f, 0x77, 0xb4));
        assert_eq!(color("red"), BLACK);
    }
}
