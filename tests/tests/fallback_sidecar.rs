//! A sidecar dies while its engine serves on: the router keeps the worker,
//! indexes it approximately (its own routing decisions) until the sidecar is
//! back and its full sync makes the index exact again. A worker whose sidecar
//! and engine both died leaves. Real binaries on loopback; the router's
//! `worker_expiry` is shortened so the test takes seconds, and every wait is
//! on an observable state, never a fixed sleep.

use std::time::Duration;

use kvroute_tests::{Client, converge, eventually, spec, start, text};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

/// A router config file with a short `worker_expiry` (no flag sets it).
fn config_file() -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let path = std::env::temp_dir().join(format!("kvroute-fallback-{}-{nanos}.toml", std::process::id()));
    std::fs::write(&path, "worker_expiry = \"3s\"\n").expect("temp dir is writable");
    path
}

/// Worker `id`'s row in `/admin/workers`, if it is registered.
async fn row(c: &Client, router: &str, id: &str) -> Option<Value> {
    let all = c.get(&format!("{router}/admin/workers")).await;
    all["workers"].as_array()?.iter().find(|w| w["id"] == id).cloned()
}

async fn index_of(c: &Client, router: &str, id: &str) -> Value {
    c.get(&format!("{router}/debug/index")).await["workers"][id].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sidecar_leaves_its_serving_worker_routable_and_approximate_until_it_returns() {
    let config = config_file();
    let mut s = spec(2);
    s.router_args =
        vec!["--config".into(), config.display().to_string(), "--health-check-interval".into(), "200ms".into()];
    let mut cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    for i in 0..6 {
        c.complete(&r, &text(i, 120), 2).await;
    }
    let engines: Vec<String> = cluster.engines.iter().map(|e| e.url.clone()).collect();
    converge(&c, &r, &engines, WAIT, "the map to hold both engines' blocks").await;

    // w1 loses its sidecar only; w2 its sidecar and its engine.
    cluster.sidecars[0].proc.kill().await;
    cluster.sidecars[1].proc.kill().await;
    cluster.engines[1].proc.kill().await;
    let w1 = eventually("w1 back on the approximate index and w2 gone", WAIT, || async {
        let w1 = row(&c, &r, "w1").await?;
        let w2_gone = row(&c, &r, "w2").await.is_none();
        (w1["sidecar"] == false && w1["index_mode"] == "approximate" && w2_gone).then_some(w1)
    })
    .await;
    assert_eq!(w1["healthy"], true, "{w1}");
    let index = index_of(&c, &r, "w1").await;
    assert_eq!(index["approximate_index"], true, "{index}");
    assert_eq!(index["confirmed"], 0, "the sidecar's entries went with it: {index}");

    // Still routable; the router indexes what it sends there.
    let fresh = text(100, 120);
    let (worker, _) = c.complete(&r, &fresh, 2).await;
    assert_eq!(worker, "w1");
    let index = index_of(&c, &r, "w1").await;
    assert!(index["approximate"].as_u64().unwrap_or(0) > 0, "{index}");
    assert!(kvroute_tests::matched(&c.debug_route(&r, &fresh).await, "w1") > 0);

    // The sidecar comes back: its full sync makes the index exact again.
    cluster.restart_sidecar(0).await.expect("sidecar restarts");
    eventually("w1's sidecar reporting again", WAIT, || async {
        let w1 = row(&c, &r, "w1").await?;
        (w1["sidecar"] == true && w1["index_mode"] == "exact").then_some(())
    })
    .await;
    converge(&c, &r, &engines[..1], WAIT, "w1's entries to equal its engine's blocks again").await;
    let index = index_of(&c, &r, "w1").await;
    assert_eq!((index["approximate_index"].clone(), index["approximate"].clone()), (false.into(), 0.into()), "{index}");
    cluster.shutdown().await;
    let _ = std::fs::remove_file(config);
}
