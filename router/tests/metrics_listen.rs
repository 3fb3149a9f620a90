//! The optional metrics listener (`metrics_listen`, `--metrics-listen`,
//! `--prometheus-port`): `/metrics` served on a second port in plain HTTP,
//! nothing else there, and still on the API's port. Both listeners are bound
//! on ephemeral loopback ports by the test and passed in.

use std::time::Duration;

use kvroute_router::config::RawConfig;
use tokio::net::TcpListener;

/// GETs `url`. The listeners are bound before the router starts, so a
/// request sent before it serves waits in the accept backlog: no retry loop.
async fn get(http: &reqwest::Client, url: &str) -> reqwest::Response {
    http.get(url).send().await.unwrap_or_else(|e| panic!("{url}: {e}"))
}

#[tokio::test]
async fn metrics_are_served_on_both_listeners_and_only_metrics_on_the_second() {
    let raw = RawConfig { health_check_interval: Duration::from_secs(3600), ..Default::default() };
    let config = raw.validate().unwrap();
    let api = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_url = format!("http://{}", api.local_addr().unwrap());
    let metrics_url = format!("http://{}", metrics.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let listeners = kvroute_router::Listeners { api, metrics: Some(metrics) };
    let server = tokio::spawn(kvroute_router::run_with(listeners, config, async move {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();

    let resp = get(&http, &format!("{metrics_url}/metrics")).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = resp.text().await.unwrap();
    assert!(text.contains("kvroute_build_info{version="), "{text}");
    assert!(text.contains("# TYPE kvroute_request_duration_seconds histogram"), "{text}");
    assert!(text.trim_end().ends_with("# EOF"));

    // The API's port keeps /metrics (existing scrape configs), the same registry.
    let resp = get(&http, &format!("{api_url}/metrics")).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("kvroute_build_info{version="));

    // Nothing but /metrics on the metrics port: no API, no admin, no internal endpoints.
    for path in ["/health", "/v1/models", "/admin/workers", "/debug/index"] {
        let resp = get(&http, &format!("{metrics_url}{path}")).await;
        assert_eq!(resp.status(), 404, "{path} on the metrics listener");
        let resp = get(&http, &format!("{api_url}{path}")).await;
        assert_eq!(resp.status(), 200, "{path} on the API listener");
    }
    let resp = http.post(format!("{metrics_url}/internal/sync")).body("{}").send().await.unwrap();
    assert_eq!(resp.status(), 404);

    // Shutdown stops both.
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server).await.unwrap().unwrap().unwrap();
    assert!(http.get(format!("{metrics_url}/metrics")).send().await.is_err(), "metrics listener still open");
}

/// `--metrics-listen 127.0.0.1:0`: the router binds it itself and prints
/// where (`metrics on http://…`, after `listening on …`), and only
/// `/metrics` is served there.
#[tokio::test]
async fn the_binary_binds_the_configured_metrics_address() {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .env_remove("KVROUTE_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let api = lines.next_line().await.unwrap().expect("a listening line");
    let metrics = lines.next_line().await.unwrap().expect("a metrics line");
    let api_url = api.strip_prefix("listening on ").unwrap_or_else(|| panic!("{api:?}")).to_owned();
    let metrics_url = metrics.strip_prefix("metrics on ").unwrap_or_else(|| panic!("{metrics:?}")).to_owned();
    assert_ne!(api_url, metrics_url.trim_end_matches("/metrics"));
    let http = reqwest::Client::new();
    let resp = get(&http, &metrics_url).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("kvroute_build_info{version="));
    let health = metrics_url.replace("/metrics", "/health");
    assert_eq!(get(&http, &health).await.status(), 404, "only /metrics on the metrics listener");
    assert_eq!(get(&http, &format!("{api_url}/health")).await.status(), 200);
    child.kill().await.unwrap();
}
