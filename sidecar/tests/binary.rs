//! The binary: layered configuration (file < env < flags), the
//! `listening on http://ADDR` line tools parse, `/health` + `/metrics`, and
//! the header deadline of that server.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn binary_prints_its_address_and_serves_health() {
    let dir = std::env::temp_dir().join(format!("kvroute-sidecar-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sidecar.toml");
    std::fs::write(&file, "worker_id = \"w-file\"\nsync_interval = \"2s\"\nblock_size = 32\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sidecar"))
        .args(["--config", file.to_str().unwrap(), "--listen", "127.0.0.1:0", "--model", "m"])
        .args(["--events", "tcp://127.0.0.1:1", "--engine-url", "http://127.0.0.1:1"])
        .env("KVROUTE_SIDECAR_WORKER_ID", "w-env")
        // Numeric-looking strings stay strings; numbers parse from strings.
        .env("KVROUTE_SIDECAR_INTERNAL_TOKEN", "1e5678901234567890")
        .env("KVROUTE_SIDECAR_DATA_PARALLEL_SIZE", "2")
        .env("KVROUTE_SIDECAR_ROUTER", "http://127.0.0.1:2,http://127.0.0.1:3")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("got {line:?}")).to_owned();

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let health = rt.block_on(async {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(r) = http.get(format!("http://{addr}/health")).send().await
                && r.status().is_success()
            {
                return r.json::<serde_json::Value>().await.unwrap();
            }
            assert!(Instant::now() < deadline, "sidecar never became healthy");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    assert_eq!(health["worker_id"], "w-env", "env overrides the config file");
    let metrics =
        rt.block_on(async { reqwest::get(format!("http://{addr}/metrics")).await.unwrap().text().await.unwrap() });
    assert!(metrics.contains("kvroute_sidecar_events_total"), "{metrics}");
    // Both routers from the comma-separated env list are pushed to (and fail).
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let m = reqwest::get(format!("http://{addr}/metrics")).await.unwrap().text().await.unwrap();
            if m.contains("router=\"http://127.0.0.1:2\"") && m.contains("router=\"http://127.0.0.1:3\"") {
                break;
            }
            assert!(Instant::now() < deadline, "routers from the env list not used: {m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    // A client that sends half its headers and stops is cut off at the
    // header deadline (10 s), not held for ever (slow-loris).
    {
        use std::io::{Read, Write};
        let mut sock = std::net::TcpStream::connect(&addr).unwrap();
        sock.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap(); // a deadline for a broken build
        let mut rest = Vec::new();
        let closed = sock.read_to_end(&mut rest);
        assert!(closed.is_ok(), "the half-sent request was not cut off: {closed:?}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// A `--block-size` other than the engine's is refused at start, naming
/// both: keys chunked by another size never match a request, and a counter
/// was all that said so.
#[tokio::test]
async fn a_block_size_other_than_the_engines_is_refused_at_start() {
    use axum::routing::get;
    let metrics = "vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\"} 1.0\n";
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_url = format!("http://{}", engine.local_addr().unwrap());
    let app = axum::Router::new().route("/metrics", get(move || async move { metrics }));
    tokio::spawn(async move { axum::serve(engine, app).await });
    let raw = |block_size| kvroute_sidecar::config::RawConfig {
        engine_url: Some(engine_url.clone()),
        model: Some("m".into()),
        events: Some("tcp://127.0.0.1:1".into()),
        block_size,
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = raw(Some(16)).validate("w").unwrap();
    let refused = kvroute_sidecar::run(listener, config, std::future::pending());
    let e = tokio::time::timeout(std::time::Duration::from_secs(20), refused) // a deadline for a broken build
        .await
        .expect("the sidecar started with the wrong block size")
        .unwrap_err();
    let message = e.to_string();
    assert!(message.contains("--block-size is 16") && message.contains("engine reports 32"), "{message}");
    // The engine's own size, given or read, starts.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = raw(Some(32)).validate("w").unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(kvroute_sidecar::run(listener, config, async move {
        let _ = stopped.await;
    }));
    stop.send(()).unwrap();
    running.await.unwrap().expect("a matching block size starts and stops cleanly");
}
