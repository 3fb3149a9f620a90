//! Goodput curves as PNG, drawn from a matrix's `results.json` (plotters'
//! bitmap backend, DejaVu Sans embedded: no system font, no Python).
//!
//! One chart per workload × workers × routers: TTFT p90 against the offered
//! request rate, a line per policy, and the SLO as a horizontal rule. A
//! policy's goodput is where its line crosses the rule: the further right,
//! the more traffic it serves within the SLO.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::Value;

/// Line colours, in policy order (the default policy is drawn first, thick).
const PALETTE: [RGBColor; 11] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
];

/// One chart's points: policy → (rate, TTFT p90 ms), sorted by rate.
type Curves = BTreeMap<String, Vec<(f64, f64)>>;

/// Draws every chart of the matrix in `dir/results.json` into `dir`; returns
/// the file names written. `default` is drawn first and thicker.
pub fn goodput_curves(dir: &Path, slo_p90_ms: f64, default: &str) -> Result<Vec<String>, String> {
    let path = dir.join("results.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let rows = json.get("rows").and_then(Value::as_array).ok_or_else(|| format!("{}: no rows", path.display()))?;
    let mut charts: BTreeMap<(String, u64, u64), Curves> = BTreeMap::new();
    for r in rows {
        let field = |k: &str| r.get(k).ok_or_else(|| format!("{}: a row without {k}", path.display()));
        let workload = field("workload")?.as_str().unwrap_or_default().to_owned();
        let workers = field("workers")?.as_u64().unwrap_or_default();
        let routers = field("routers")?.as_u64().unwrap_or_default();
        let policy = field("policy")?.as_str().unwrap_or_default().to_owned();
        let rate = field("rate")?.as_f64().unwrap_or(f64::NAN);
        let p90 = field("summary")?.get("ttft_p90_ms").and_then(Value::as_f64).unwrap_or(f64::NAN);
        if rate.is_finite() && p90.is_finite() {
            charts.entry((workload, workers, routers)).or_default().entry(policy).or_default().push((rate, p90));
        }
    }
    register_font();
    let mut written = Vec::new();
    for ((workload, workers, routers), mut curves) in charts {
        for points in curves.values_mut() {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        if curves.values().all(|p| p.len() < 2) {
            continue; // one load level: nothing to draw a curve through
        }
        let name = format!("goodput-{workload}-w{workers}-r{routers}.png");
        let title = format!("{workload}: {workers} workers, {routers} router(s), TTFT p90 vs rate");
        chart(&dir.join(&name), &title, &curves, slo_p90_ms, default).map_err(|e| format!("{name}: {e}"))?;
        written.push(name);
    }
    Ok(written)
}

fn register_font() {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        // A font that fails to load leaves charts without text, not without charts.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

fn chart(path: &Path, title: &str, curves: &Curves, slo: f64, default: &str) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let points = curves.values().flatten();
    let x_max = points.clone().map(|p| p.0).fold(0.0, f64::max) * 1.05;
    let y_min = points.clone().map(|p| p.1).fold(f64::INFINITY, f64::min).min(slo).max(1.0) / 1.5;
    let y_max = points.map(|p| p.1).fold(0.0, f64::max).max(slo) * 1.5;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max.max(1e-6), (y_min..y_max).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("offered rate (requests/s)")
        .y_desc("TTFT p90 (ms, log)")
        .label_style(("sans-serif", 13))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    // The default first, then the others in name order.
    let mut order: Vec<&String> = curves.keys().collect();
    order.sort_by_key(|p| (p.as_str() != default, (*p).clone()));
    for (i, policy) in order.into_iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let width = if policy == default { 3 } else { 1 };
        chart
            .draw_series(LineSeries::new(curves[policy].iter().copied(), color.stroke_width(width)))
            .map_err(|e| err(&e))?
            .label(policy.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(width)));
        chart.draw_series(curves[policy].iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
    }
    let rule = RGBColor(90, 90, 90);
    chart
        .draw_series(LineSeries::new([(0.0, slo), (x_max, slo)], rule.stroke_width(1)))
        .map_err(|e| err(&e))?
        .label(format!("SLO: TTFT p90 {slo:.0} ms"))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], rule.stroke_width(1)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_matrix_with_two_loads_gets_one_png_per_case() {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let row = |policy: &str, load: f64, p90: f64| {
            serde_json::json!({"workload": "chat", "workers": 4, "routers": 1, "load": load, "rate": load * 10.0,
                "policy": policy, "summary": {"ttft_p90_ms": p90}})
        };
        let rows = vec![
            row("predicted_ttft", 0.3, 100.0),
            row("predicted_ttft", 0.9, 900.0),
            row("round_robin", 0.3, 300.0),
            row("round_robin", 0.9, 4000.0),
        ];
        std::fs::write(dir.join("results.json"), serde_json::json!({"rows": rows, "goodput": []}).to_string()).unwrap();
        let written = goodput_curves(&dir, 1000.0, "predicted_ttft").unwrap();
        assert_eq!(written, ["goodput-chat-w4-r1.png"]);
        let png = std::fs::read(dir.join(&written[0])).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        assert!(png.len() > 5_000, "an empty chart: {} bytes", png.len());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
