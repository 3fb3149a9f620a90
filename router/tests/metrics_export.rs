//! The router's `/metrics` against a fake worker on loopback: the request
//! duration, build and process series after real requests, and the metric
//! table in `deploy/OPERATIONS.md` checked name for name against what the
//! router exports from the start.

use std::collections::BTreeSet;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use serde_json::json;

mod support;
use support::{TOKEN, TestRouter, router, serve_engine};

/// A worker that answers every completion with `status`.
async fn fake_worker(status: u16) -> String {
    let answer = move || async move {
        (StatusCode::from_u16(status).unwrap(), axum::Json(json!({"choices": [{"text": "hi"}]})))
    };
    let app = Router::new().route("/v1/completions", post(answer)).route("/health", get(|| async { "ok" }));
    serve_engine(app).await
}

impl TestRouter {
    async fn scrape(&self) -> String {
        let resp = self.http.get(format!("{}/metrics", self.url)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap()
    }
}

/// The value of the sample `series` (name and labels exactly as exported).
fn value(text: &str, series: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(series).is_some_and(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"));
    line[series.len()..].trim().parse().unwrap()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

#[tokio::test]
async fn requests_build_process_and_sync_series_are_exported() {
    let w = fake_worker(200).await;
    let broken = fake_worker(500).await;
    let r = router(&[("w1", &w)], |_| {}).await;
    let prompt = "x".repeat(64);
    let resp = r
        .http
        .post(format!("{}/v1/completions", r.url))
        .json(&json!({"model": "m", "prompt": prompt}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap();
    // Refused before any worker is chosen: not JSON.
    let resp = r.http.post(format!("{}/v1/completions", r.url)).body("not json").send().await.unwrap();
    assert_eq!(resp.status(), 400);
    // A sidecar's full sync registers w2 and stamps its sync time.
    let before_sync = unix_now();
    let resp = r
        .http
        .post(format!("{}/internal/sync", r.url))
        .bearer_auth(TOKEN)
        .json(&json!({"worker_id": "w2", "url": w, "models": ["m"], "block_size": 16, "hashes": [], "seq": 1, "epoch": "e1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let text = r.scrape().await;
    assert_eq!(
        value(&text, r#"kvroute_request_duration_seconds_count{policy="predicted_ttft",worker="w1",status="2xx"}"#),
        1.0
    );
    let took =
        value(&text, r#"kvroute_request_duration_seconds_sum{policy="predicted_ttft",worker="w1",status="2xx"}"#);
    assert!(took > 0.0, "{took}");
    assert_eq!(
        value(&text, r#"kvroute_request_duration_seconds_count{policy="predicted_ttft",worker="none",status="4xx"}"#),
        1.0
    );
    assert_eq!(
        value(&text, r#"kvroute_request_duration_seconds_count{policy="predicted_ttft",worker="none",status="5xx"}"#),
        0.0
    );
    let build = format!(r#"kvroute_build_info{{version="{}"}}"#, env!("CARGO_PKG_VERSION"));
    assert_eq!(value(&text, &build), 1.0);

    let synced = value(&text, r#"kvroute_worker_last_sync_timestamp_seconds{worker="w2"}"#);
    assert!(synced >= before_sync.floor() && synced <= unix_now(), "{synced} not in [{before_sync}, now]");
    assert!(!text.contains(r#"kvroute_worker_last_sync_timestamp_seconds{worker="w1"}"#), "w1 has no sidecar");

    // Every attempt failing: counted against the worker that failed last.
    let r = router(&[("bad", &broken)], |_| {}).await;
    let resp = r
        .http
        .post(format!("{}/v1/completions", r.url))
        .json(&json!({"model": "m", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let text = r.scrape().await;
    assert_eq!(
        value(&text, r#"kvroute_request_duration_seconds_count{policy="predicted_ttft",worker="bad",status="5xx"}"#),
        1.0
    );
    assert_eq!(
        value(&text, r#"kvroute_request_duration_seconds_count{policy="predicted_ttft",worker="none",status="5xx"}"#),
        0.0
    );

    if cfg!(target_os = "linux") {
        assert!(value(&text, "process_resident_memory_bytes") > 1e6);
        assert!(value(&text, "process_cpu_seconds_total") >= 0.0);
        assert!(value(&text, "process_open_fds") >= 3.0);
        assert!(value(&text, "process_threads") >= 1.0);
        let started = value(&text, "process_start_time_seconds");
        assert!(started <= unix_now() && started > unix_now() - 86_400.0, "{started}");
    }
}

/// Metric names in the first column of OPERATIONS.md's "## 8. Metrics"
/// table (every name in backticks).
fn documented_names() -> BTreeSet<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/OPERATIONS.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let section = doc.split("\n## 8. Metrics").nth(1).expect("OPERATIONS.md has a section 8. Metrics");
    let section = section.split("\n## ").next().unwrap();
    let mut names = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let first_cell = row.split('|').nth(1).unwrap();
        names.extend(first_cell.split('`').skip(1).step_by(2).map(str::to_owned));
    }
    assert!(!names.is_empty(), "no metric table in section 8");
    names
}

/// The names a scrape's metric families are queried by: counters with
/// `_total`, everything else as declared.
fn exported_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut parts = l.split_whitespace();
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            if kind == "counter" { format!("{name}_total") } else { name.to_owned() }
        })
        .collect()
}

/// The router's own names: not vLLM's, not the sidecar's (served by the
/// sidecar), and the process ones only where they are read (Linux).
fn router_owned(name: &str) -> bool {
    (name.starts_with("kvroute_") && !name.starts_with("kvroute_sidecar_"))
        || (name.starts_with("process_") && cfg!(target_os = "linux"))
}

#[tokio::test]
async fn the_operations_metric_table_matches_what_a_fresh_router_exports() {
    let w = fake_worker(200).await;
    // No request yet: the table may only promise what exists from the start.
    let r = router(&[("w1", &w)], |_| {}).await;
    let exported: BTreeSet<String> =
        exported_names(&r.scrape().await).into_iter().filter(|n| router_owned(n)).collect();
    let documented: BTreeSet<String> = documented_names().into_iter().filter(|n| router_owned(n)).collect();
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&exported).collect();
    assert!(undocumented.is_empty(), "exported but not in OPERATIONS.md section 8: {undocumented:?}");
    assert!(missing.is_empty(), "in OPERATIONS.md section 8 but not exported: {missing:?}");
}
