//! The binary: layered configuration (file < env < flags), the
//! `listening on http://ADDR` line tools parse, `/health` + `/metrics`, and
//! the header deadline of that server.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An engine's HTTP side: `/v1/models` lists `models`, `/metrics` is
/// `metrics`. Its base URL.
async fn fake_engine(models: &'static [&'static str], metrics: &'static str) -> String {
    use axum::routing::get;
    let data: Vec<serde_json::Value> = models.iter().map(|m| serde_json::json!({"id": m})).collect();
    let list = serde_json::json!({"object": "list", "data": data});
    let app = axum::Router::new()
        .route("/v1/models", get(move || async move { axum::Json(list) }))
        .route("/metrics", get(move || async move { metrics }));
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", engine.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(engine, app).await });
    url
}

/// A loopback port that refuses connections: one the OS gave, bound and
/// not listening, held as long as the socket lives (released, another
/// test's listener could take it).
fn refused_port() -> (u16, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    (socket.local_addr().unwrap().port(), socket)
}

#[test]
fn binary_prints_its_address_and_serves_health() {
    // The engine is served by this runtime's own thread while the test waits.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let engine_url = rt.block_on(fake_engine(&["m"], ""));
    let dir = std::env::temp_dir().join(format!("kvroute-sidecar-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sidecar.toml");
    std::fs::write(&file, "worker_id = \"w-file\"\nsync_interval = \"2s\"\nblock_size = 32\n").unwrap();
    let held = [refused_port(), refused_port(), refused_port()];
    let events = format!("tcp://127.0.0.1:{}", held[0].0);
    let (router_a, router_b) = (format!("http://127.0.0.1:{}", held[1].0), format!("http://127.0.0.1:{}", held[2].0));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sidecar"))
        .args(["--config", file.to_str().unwrap(), "--listen", "127.0.0.1:0", "--model", "m"])
        .args(["--events", &events, "--engine-url", &engine_url])
        .env("KVROUTE_SIDECAR_WORKER_ID", "w-env")
        // Numeric-looking strings stay strings; numbers parse from strings.
        .env("KVROUTE_SIDECAR_INTERNAL_TOKEN", "1e5678901234567890")
        .env("KVROUTE_SIDECAR_DATA_PARALLEL_SIZE", "2")
        .env("KVROUTE_SIDECAR_ROUTER", format!("{router_a},{router_b}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("got {line:?}")).to_owned();

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
            if m.contains(&format!("router=\"{router_a}\"")) && m.contains(&format!("router=\"{router_b}\"")) {
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

/// A `--block-size` other than the engine's, or a `--model` it does not
/// serve, is refused at start, naming both: keys chunked by another size or
/// rooted in another name never match a request, and a counter (or nothing)
/// was all that said so. Both were checked only when `--model` was not
/// given: with it the sidecar started without asking the engine.
#[tokio::test]
async fn a_block_size_or_model_other_than_the_engines_is_refused_at_start() {
    let metrics = "vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\"} 1.0\n";
    let engine_url = fake_engine(&["m", "sql-adapter"], metrics).await;
    let held = [refused_port(), refused_port()];
    let raw = |model: &str, block_size| kvroute_sidecar::config::RawConfig {
        engine_url: Some(engine_url.clone()),
        model: Some(model.into()),
        events: Some(format!("tcp://127.0.0.1:{}", held[0].0)),
        router: vec![format!("http://127.0.0.1:{}", held[1].0)],
        block_size,
        ..Default::default()
    };
    let refused = |config| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let refused = kvroute_sidecar::run(listener, config, std::future::pending());
        let e = tokio::time::timeout(std::time::Duration::from_secs(20), refused) // a deadline for a broken build
            .await
            .expect("the sidecar started against its engine")
            .unwrap_err();
        e.to_string()
    };
    let message = refused(raw("m", Some(16)).validate("w").unwrap()).await;
    assert!(message.contains("--block-size is 16") && message.contains("engine reports 32"), "{message}");
    let message = refused(raw("Qwen/Qwen3-0.6B", None).validate("w").unwrap()).await;
    assert!(message.contains("\"Qwen/Qwen3-0.6B\"") && message.contains("serves m, sql-adapter"), "{message}");
    // An engine started with --api-key refuses the sidecar without it: an
    // error naming the flag, not a wait for ever.
    let app = axum::Router::new().route(
        "/v1/models",
        axum::routing::get(|| async { (axum::http::StatusCode::UNAUTHORIZED, "missing api key") }),
    );
    let guarded = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let guarded_url = format!("http://{}", guarded.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(guarded, app).await });
    let config = kvroute_sidecar::config::RawConfig { engine_url: Some(guarded_url), ..raw("m", None) };
    let message = refused(config.validate("w").unwrap()).await;
    assert!(message.contains("401") && message.contains("--engine-api-key"), "{message}");
    // The engine's own size and a name it serves, given or read, start.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = raw("m", Some(32)).validate("w").unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(kvroute_sidecar::run(listener, config, async move {
        let _ = stopped.await;
    }));
    // Healthy once it has learnt the engine's facts and started.
    let deadline = Instant::now() + Duration::from_secs(20); // a deadline for a broken build
    loop {
        let r = reqwest::get(format!("http://{addr}/health")).await;
        if r.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        assert!(!running.is_finished(), "the sidecar stopped: {:?}", running.await);
        assert!(Instant::now() < deadline, "the sidecar never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().expect("a matching block size and model start and stop cleanly");
}

/// The engine (and the routers) are reached directly, whatever the proxy
/// variables say: a host's `HTTP_PROXY`, not excluded for pod addresses,
/// sent the sidecar's requests through the proxy.
#[test]
fn the_engine_is_reached_directly_whatever_the_proxy_variables_say() {
    let engine = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for (name, listener) in [("engine", engine.try_clone().unwrap()), ("proxy", proxy.try_clone().unwrap())] {
        let tx = tx.clone();
        // Each answers nothing: which one the first request reaches is all.
        std::thread::spawn(move || {
            if listener.accept().is_ok() {
                let _ = tx.send(name);
            }
        });
    }
    let held = [refused_port(), refused_port()];
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sidecar"))
        .args(["--listen", "127.0.0.1:0", "--worker-id", "w", "--model", "m"])
        .args(["--events", &format!("tcp://127.0.0.1:{}", held[0].0)])
        .args(["--router", &format!("http://127.0.0.1:{}", held[1].0)])
        .args(["--engine-url", &format!("http://{}", engine.local_addr().unwrap())])
        .envs(["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"].map(|k| (k, &proxy_url)))
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = rx.recv_timeout(Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(first, Ok("engine"));
}

/// A `--block-size` nothing can confirm (the engine's `/metrics` has no
/// `vllm:cache_config_info`) is said: vLLM may choose another size than it
/// was given, and only the flag's absence was warned about.
#[test]
fn a_block_size_the_engine_does_not_confirm_is_said() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let engine_url = rt.block_on(fake_engine(&["m"], "vllm:num_requests_running 0\n"));
    let held = [refused_port(), refused_port()];
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sidecar"))
        .args(["--listen", "127.0.0.1:0", "--worker-id", "w", "--model", "m", "--block-size", "16"])
        .args(["--events", &format!("tcp://127.0.0.1:{}", held[0].0)])
        .args(["--router", &format!("http://127.0.0.1:{}", held[1].0)])
        .args(["--engine-url", &engine_url])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            if line.contains("cannot be checked") && tx.send(line).is_err() {
                return;
            }
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    let line = line.expect("the unconfirmed block size said");
    assert!(line.contains("block_size=16"), "{line}");
}
