//! Outputs: CSV, hand-written SVG plots (no fonts or plotting crates
//! needed) and the summary table in Markdown.

use std::fmt::Write as _;

/// Published GPU allocation ratio at 130% arrived demand (random, best-fit,
/// FGD), mean of seeds 42..51 (Weng et al., USENIX ATC '23).
pub fn published(workload: &str) -> Option<[f64; 3]> {
    Some(match workload {
        "default" => [87.47, 93.08, 95.39],
        "gpushare40" => [86.00, 91.69, 94.15],
        "gpushare100" => [79.44, 85.01, 86.90],
        "multigpu50" => [90.28, 95.74, 97.18],
        "gpuspec10" => [87.43, 93.31, 94.95],
        _ => return None,
    })
}

pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

pub fn stddev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

const COLORS: [&str; 6] = ["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A line plot: `series` of (label, points (x, y)); axes ranges given.
pub fn svg_plot(title: &str, xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)], x: (f64, f64), y: (f64, f64), note: &str) -> String {
    let (w, h) = (760.0, 480.0);
    let (l, r, t, b) = (70.0, 20.0, 40.0, 70.0);
    let px = |v: f64| l + (v - x.0) / (x.1 - x.0) * (w - l - r);
    let py = |v: f64| h - b - (v - y.0) / (y.1 - y.0) * (h - t - b);
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#, w / 2.0, esc(title));
    for i in 0..=5 {
        let v = y.0 + (y.1 - y.0) * i as f64 / 5.0;
        let (yy, x2, tx, ty) = (py(v), w - r, l - 6.0, py(v) + 4.0);
        let _ = writeln!(s, r##"<line x1="{l}" x2="{x2}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{v:.1}</text>"##);
    }
    for i in 0..=(((x.1 - x.0) / 10.0) as usize) {
        let v = x.0 + 10.0 * i as f64;
        let (xx, y2, ty) = (px(v), h - b, h - b + 16.0);
        let _ = writeln!(s, r##"<line y1="{t}" y2="{y2}" x1="{xx:.1}" x2="{xx:.1}" stroke="#eee"/><text x="{xx:.1}" y="{ty}" text-anchor="middle">{v:.0}</text>"##);
    }
    let _ = writeln!(s, r#"<rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="black"/>"#, w - l - r, h - t - b);
    let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#, (l + w - r) / 2.0, h - b + 34.0, esc(xlabel));
    let _ = writeln!(s, r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"#, (t + h - b) / 2.0, esc(ylabel));
    let _ = writeln!(s, r##"<text x="{l}" y="{}" fill="#555" font-size="11">{}</text>"##, h - 12.0, esc(note));
    for (k, (label, pts)) in series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let d: Vec<String> = pts.iter().map(|&(a, v)| format!("{:.1},{:.1}", px(a), py(v.clamp(y.0, y.1)))).collect();
        let _ = writeln!(s, r#"<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{}"/>"#, d.join(" "));
        let ly = t + 16.0 + 16.0 * k as f64;
        let _ = writeln!(s, r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#, l + 12.0, l + 34.0, l + 40.0, ly + 4.0, esc(label));
    }
    s.push_str("</svg>\n");
    s
}
