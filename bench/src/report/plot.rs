//! The PNG plots of a run, drawn by the binary itself from the run's
//! `results.json` (plotters' bitmap backend; text in DejaVu Sans, embedded,
//! so no system font or Python is needed). Charts are horizontal bars: one
//! row per run or state, its label on the left.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::Value;

/// The plots of `kind` (`compare`, `lifecycle`, `overhead`) for the run in
/// `dir`; returns the files written (relative to `dir`).
pub fn draw(kind: &str, dir: &Path) -> Result<Vec<String>, String> {
    let path = dir.join("results.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    // `{"run": …, "results": …}`, or a bare list from before the run header.
    let results = json.get("results").unwrap_or(&json);
    register_font();
    match kind {
        "compare" => compare(dir, results),
        "lifecycle" => lifecycle(dir, results),
        "overhead" => overhead(dir, results),
        other => Err(format!("no plots for {other:?}")),
    }
    .map_err(|e| format!("drawing the {kind} plots: {e}"))
}

fn register_font() {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        // A font that fails to load leaves plots without text, not without plots.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// One series of bars: a name for the legend, a value per row, a colour.
struct Series<'a> {
    name: &'a str,
    values: Vec<f64>,
    color: RGBColor,
}

/// A vertical reference line: where, its colour, its legend name.
struct Rule<'a> {
    at: f64,
    color: RGBColor,
    name: &'a str,
}

/// One panel of horizontal bars, `series` side by side within each row.
/// `log`: a log10 axis (values ≤ 0 drawn as the axis' minimum).
fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    labels: &[String],
    series: &[Series<'_>],
    rules: &[Rule<'_>],
    log: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let n = labels.len();
    let scale = |v: f64| if log { v.max(1e-3).log10() } else { v };
    let values = series.iter().flat_map(|s| s.values.iter().copied()).chain(rules.iter().map(|r| r.at));
    let max = values.clone().map(scale).fold(f64::NEG_INFINITY, f64::max);
    let min = if log { values.map(scale).fold(f64::INFINITY, f64::min).floor().min(max - 1.0) } else { 0.0 };
    let max = if max.is_finite() && max > min { max } else { min + 1.0 };
    // Room on the right for the legend box.
    let legend = series.len() > 1 || !rules.is_empty();
    let max = max + (max - min) * if legend { 0.35 } else { 0.08 };
    let label_width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(4) as u32 * 7 + 10;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(label_width)
        .build_cartesian_2d(min..max, -0.5..n as f64 - 0.5)
        .map_err(|e| e.to_string())?;
    // Row 0 is drawn at the top, at y = n - 1.
    let row = |y: &f64| {
        let i = y.round();
        if (y - i).abs() < 1e-6 && (0.0..n as f64).contains(&i) {
            labels[n - 1 - i as usize].clone()
        } else {
            String::new()
        }
    };
    // A log axis is labelled at powers of ten only.
    let tick = |x: &f64| match log {
        true if (x - x.round()).abs() < 1e-6 => short(10f64.powf(x.round())),
        true => String::new(),
        false => short(*x),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n.max(1))
        .x_labels(if log { (max - min).ceil() as usize + 1 } else { 8 })
        .y_label_formatter(&row)
        .x_label_formatter(&tick)
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| e.to_string())?;
    let height = 0.8 / series.len().max(1) as f64;
    for (k, s) in series.iter().enumerate() {
        let color = s.color;
        let rects = s.values.iter().enumerate().map(move |(i, &v)| {
            // Row 0 at the top.
            let top = (n - 1 - i) as f64 + 0.4 - k as f64 * height;
            Rectangle::new([(min, top), (scale(v), top - height)], color.filled())
        });
        chart
            .draw_series(rects)
            .map_err(|e| e.to_string())?
            .label(s.name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    for r in rules {
        let (color, at) = (r.color, scale(r.at));
        chart
            .draw_series(LineSeries::new([(at, -0.5), (at, n as f64 - 0.5)], color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(r.name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], color.stroke_width(2)));
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A tick label: at most three decimals, no trailing zeros.
fn short(x: f64) -> String {
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

/// A bitmap of `width` and a height for `rows` rows of bars.
fn canvas(path: &Path, width: u32, rows: usize) -> BitMapBackend<'_> {
    BitMapBackend::new(path, (width, 90 + 26 * rows.max(1) as u32))
}

/// Per workload and worker count: hit rate against the ceiling, TTFT
/// percentiles (log scale) and load spread, one row per policy run.
fn compare(dir: &Path, results: &Value) -> Result<Vec<String>, String> {
    let records = results.as_array().ok_or("results.json is not a list of runs")?;
    let mut groups: std::collections::BTreeMap<(String, u64), Vec<&Value>> = Default::default();
    for r in records {
        let key = (r["workload"].as_str().unwrap_or("?").to_owned(), r["workers"].as_u64().unwrap_or(0));
        groups.entry(key).or_default().push(r);
    }
    let mut written = Vec::new();
    for ((workload, workers), rs) in groups {
        // `--rounds N`: one row per run, labelled with its round.
        let rounds = rs.iter().any(|r| r["round"].as_u64().unwrap_or(1) > 1);
        let labels: Vec<String> = rs
            .iter()
            .map(|r| {
                let mut s = r["policy"].as_str().unwrap_or("?").to_owned();
                if r["routers"].as_u64().unwrap_or(1) > 1 {
                    s += &format!(" ×{}", r["routers"]);
                }
                if r["sidecars"] == Value::Bool(false) {
                    s += " (no sc)";
                }
                if rounds {
                    s += &format!(" #{}", r["round"].as_u64().unwrap_or(1));
                }
                s
            })
            .collect();
        let name = format!("compare_{workload}_w{workers}.png");
        let path = dir.join(&name);
        let root = canvas(&path, 1800, labels.len()).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root =
            root.titled(&format!("{workload}, {workers} workers"), ("sans-serif", 22)).map_err(|e| e.to_string())?;
        let panels = root.split_evenly((1, 3));
        let col = |key: &str| rs.iter().map(|r| num(r, key)).collect::<Vec<_>>();
        bars(
            &panels[0],
            "prefix hit rate (tokens)",
            &labels,
            &[Series { name: "hit rate", values: col("hit_rate"), color: RGBColor(31, 119, 180) }],
            &[Rule { at: num(rs[0], "ceiling"), color: BLACK, name: "infinite-cache ceiling" }],
            false,
        )?;
        bars(
            &panels[1],
            "TTFT (ms, client-side, log scale)",
            &labels,
            &[
                Series { name: "p50", values: col("ttft_p50_ms"), color: RGBColor(31, 119, 180) },
                Series { name: "p90", values: col("ttft_p90_ms"), color: RGBColor(255, 127, 14) },
                Series { name: "p99", values: col("ttft_p99_ms"), color: RGBColor(44, 160, 44) },
            ],
            &[],
            true,
        )?;
        bars(
            &panels[2],
            "load spread (max/mean requests per worker)",
            &labels,
            &[Series { name: "max/mean", values: col("max_mean_load"), color: RGBColor(255, 127, 14) }],
            &[Rule { at: 1.3, color: RED, name: "1.3" }],
            false,
        )?;
        root.present().map_err(|e| e.to_string())?;
        written.push(name);
    }
    Ok(written)
}

/// Each timed state's latency, green when it passed, red when not.
fn lifecycle(dir: &Path, results: &Value) -> Result<Vec<String>, String> {
    let steps: Vec<&Value> = results
        .as_array()
        .ok_or("results.json is not a list of states")?
        .iter()
        .filter(|s| s["latency_ms"].is_number())
        .collect();
    let labels: Vec<String> = steps
        .iter()
        .map(|s| format!("{} ({})", s["state"].as_str().unwrap_or("?"), s["latency_what"].as_str().unwrap_or("")))
        .collect();
    let value = |pass: bool| steps.iter().map(|s| if s["pass"] == pass { num(s, "latency_ms") } else { 0.0 }).collect();
    let name = "lifecycle_latencies.png".to_owned();
    let path = dir.join(&name);
    let root = canvas(&path, 1000, labels.len()).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    // A series per verdict present, one non-zero bar per row: the colour
    // tells PASS from FAIL (full-height bars when all states agree).
    let series: Vec<Series<'_>> = [("PASS", true, RGBColor(44, 160, 44)), ("FAIL", false, RGBColor(214, 39, 40))]
        .into_iter()
        .filter(|(_, pass, _)| steps.iter().any(|s| s["pass"] == *pass))
        .map(|(name, pass, color)| Series { name, values: value(pass), color })
        .collect();
    bars(&root, "lifecycle latencies (ms, green PASS, red FAIL)", &labels, &series, &[], false)?;
    root.present().map_err(|e| e.to_string())?;
    Ok(vec![name])
}

/// Latency at concurrency 1 and throughput at 64, one row per path.
fn overhead(dir: &Path, results: &Value) -> Result<Vec<String>, String> {
    let paths = results["paths"].as_array().ok_or("results.json has no paths")?;
    let labels: Vec<String> = paths
        .iter()
        .map(|p| {
            let path = p["path"].as_str().unwrap_or("?");
            match p["prompt_tokens"].as_u64() {
                Some(t) => format!("{path}, {t} tokens"),
                None => path.to_owned(),
            }
        })
        .collect();
    let col = |key: &str| paths.iter().map(|p| num(p, key)).collect::<Vec<_>>();
    let name = "overhead.png".to_owned();
    let path = dir.join(&name);
    let root = canvas(&path, 1400, labels.len()).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, 2));
    bars(
        &panels[0],
        "latency at concurrency 1 (ms)",
        &labels,
        &[
            Series { name: "p50", values: col("c1_p50_ms"), color: RGBColor(31, 119, 180) },
            Series { name: "p99", values: col("c1_p99_ms"), color: RGBColor(255, 127, 14) },
        ],
        &[],
        false,
    )?;
    bars(
        &panels[1],
        "throughput at concurrency 64 (req/s)",
        &labels,
        &[Series { name: "req/s", values: col("c64_throughput_rps"), color: RGBColor(148, 103, 189) }],
        &[],
        false,
    )?;
    root.present().map_err(|e| e.to_string())?;
    Ok(vec![name])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvroute-plot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A PNG file's width and height, from its IHDR chunk.
    fn png_size(path: &Path) -> (u32, u32) {
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
        let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[tokio::test]
    async fn the_plot_subcommand_draws_a_run_again() {
        use clap::Parser;
        let dir = scratch("cmd");
        let steps =
            serde_json::json!([{"state": "cold start", "pass": true, "latency_ms": 12.5, "latency_what": "burst"}]);
        std::fs::write(dir.join("results.json"), steps.to_string()).unwrap();
        let cli =
            crate::cli::Cli::try_parse_from(["kvroute-bench", "plot", "lifecycle", dir.to_str().unwrap()]).unwrap();
        let said = crate::run(cli.command).await.unwrap();
        assert!(said.starts_with("plot: lifecycle_latencies.png in "), "{said}");
        assert!(dir.join("lifecycle_latencies.png").is_file());
        assert!(crate::cli::Cli::try_parse_from(["kvroute-bench", "plot", "soak", "x"]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(short(0.30000000000000004), "0.3");
        assert_eq!(short(1000.0), "1000");
        assert_eq!(short(-0.0001), "0");
        assert_eq!(short(2.5), "2.5");
    }

    #[test]
    fn draws_every_kind_from_results_json() {
        let dir = scratch("all");
        let run = |r: Value| serde_json::json!({"run": {"commit": "x"}, "results": r});
        let record = |policy: &str, routers: u64| {
            serde_json::json!({"workload": "chat", "workers": 4, "policy": policy, "routers": routers,
                "sidecars": true, "hit_rate": 0.8, "ceiling": 0.9, "ttft_p50_ms": 4.9, "ttft_p90_ms": 20.0,
                "ttft_p99_ms": 40.0, "max_mean_load": 1.2})
        };
        std::fs::write(dir.join("results.json"), run(serde_json::json!([record("a", 1), record("b", 2)])).to_string())
            .unwrap();
        assert_eq!(draw("compare", &dir).unwrap(), ["compare_chat_w4.png"]);
        assert_eq!(png_size(&dir.join("compare_chat_w4.png")), (1800, 90 + 26 * 2));

        // A bare list (results.json from before the run header) still draws.
        let steps = serde_json::json!([
            {"state": "cold start", "pass": true, "latency_ms": 12.5, "latency_what": "whole burst"},
            {"state": "evicted", "pass": false, "latency_ms": 104.0, "latency_what": "to empty"},
            {"state": "untimed", "pass": true, "latency_ms": null, "latency_what": ""}
        ]);
        std::fs::write(dir.join("results.json"), steps.to_string()).unwrap();
        assert_eq!(draw("lifecycle", &dir).unwrap(), ["lifecycle_latencies.png"]);
        assert_eq!(png_size(&dir.join("lifecycle_latencies.png")), (1000, 90 + 26 * 2));

        let paths = serde_json::json!({"paths": [
            {"path": "direct", "c1_p50_ms": 1.0, "c1_p99_ms": 2.0, "c64_throughput_rps": 900.0},
            {"path": "kvroute", "prompt_tokens": 1024, "c1_p50_ms": 1.2, "c1_p99_ms": 2.5, "c64_throughput_rps": 850.0}
        ]});
        std::fs::write(dir.join("results.json"), run(paths).to_string()).unwrap();
        assert_eq!(draw("overhead", &dir).unwrap(), ["overhead.png"]);
        assert_eq!(png_size(&dir.join("overhead.png")).0, 1400);

        assert!(draw("soak", &dir).is_err());
        std::fs::write(dir.join("results.json"), "{}").unwrap();
        assert!(draw("compare", &dir).unwrap_err().contains("not a list"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
