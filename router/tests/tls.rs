//! TLS: the router serves HTTPS with a configured certificate (sidecars push
//! over it), and trusts a configured CA for https:// workers.

use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use kvroute_router::config::{RawConfig, Secret};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const TOKEN: &str = "tls-internal-token-0123";

struct Certs {
    _dir: TempDir,
    cert: PathBuf,
    key: PathBuf,
    pem: String,
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn certs(name: &str) -> Certs {
    let dir = std::env::temp_dir().join(format!("kvroute-tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let pem = ck.cert.pem();
    std::fs::write(&cert, &pem).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    Certs { _dir: TempDir(dir), cert, key, pem }
}

async fn serve_router(raw: RawConfig) -> String {
    let config = raw.validate().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(kvroute_router::run(listener, config, std::future::pending()));
    format!("127.0.0.1:{}", addr.port())
}

async fn fake_worker() -> String {
    let app = Router::new()
        .route("/v1/completions", post(|| async { axum::Json(json!({"choices": [{"text": "ok"}]})) }))
        .route("/health", get(|| async { "ok" }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

fn trusting(pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// A router serving HTTPS with `c`, its address.
async fn https_router(c: &Certs) -> String {
    serve_router(RawConfig {
        tls_cert: Some(c.cert.clone()),
        tls_key: Some(c.key.clone()),
        internal_token: Some(Secret::new(TOKEN)),
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn serves_https_and_refuses_plain_http() {
    let c = certs("serve");
    let addr = https_router(&c).await;
    let https = trusting(&c.pem);
    let health = https.get(format!("https://{addr}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    // A sidecar's sync over TLS.
    let ack: Value = https
        .post(format!("https://{addr}/internal/sync"))
        .bearer_auth(TOKEN)
        .json(&json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "hashes": []}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ack["outcome"], "applied");
    // Plain HTTP to the TLS port fails; so does a client that does not trust the cert.
    assert!(reqwest::Client::new().get(format!("http://{addr}/health")).send().await.is_err());
    assert!(reqwest::Client::new().get(format!("https://{addr}/health")).send().await.is_err());
}

/// Handshakes run side by side: clients that connect and then send nothing
/// (or half a ClientHello) do not hold up a real client behind them.
#[tokio::test]
async fn stalled_handshakes_do_not_block_other_clients() {
    use tokio::io::AsyncWriteExt;
    let c = certs("stalled");
    let addr = https_router(&c).await;
    let mut stalled = Vec::new();
    for i in 0..8 {
        let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        if i % 2 == 1 {
            // The first bytes of a TLS record header, then silence.
            tcp.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
        }
        stalled.push(tcp);
    }
    // Handshakes taken one at a time would wait out the stalled ones' 10 s
    // handshake timeouts first: served, the client finds them all still open.
    let health = trusting(&c.pem).get(format!("https://{addr}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    for (i, tcp) in stalled.iter().enumerate() {
        let mut buf = [0u8; 16];
        match tcp.try_read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("stalled connection {i} was closed before the client was served: {other:?}"),
        }
    }
}

/// A connection still in its handshake counts against `max_connections`:
/// with both slots held by sockets that never send a ClientHello, a real
/// client is served only once the handshake timeout has dropped one of
/// them. Uncounted, every silent socket held a descriptor for 10 s beyond
/// the cap.
#[tokio::test]
async fn connections_in_their_handshake_count_against_max_connections() {
    use tokio::io::AsyncReadExt;
    let c = certs("capped");
    let addr = serve_router(RawConfig {
        tls_cert: Some(c.cert.clone()),
        tls_key: Some(c.key.clone()),
        internal_token: Some(Secret::new(TOKEN)),
        max_connections: 2,
        ..Default::default()
    })
    .await;
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(c.pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(60)) // a deadline for a broken build
        .build()
        .unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let served = {
        let order = order.clone();
        let url = format!("https://{addr}/health");
        tokio::spawn(async move {
            let status = client.get(url).send().await.unwrap().status();
            order.lock().unwrap().push("served");
            status
        })
    };
    let mut first = silent.remove(0);
    let mut rest = Vec::new();
    let _ = first.read_to_end(&mut rest).await; // the router drops it at the handshake timeout
    order.lock().unwrap().push("dropped");
    assert_eq!(served.await.unwrap(), 200);
    assert_eq!(*order.lock().unwrap(), ["dropped", "served"], "the client was served past the cap");
}

/// ALPN offers h2 and http/1.1, and the router speaks both: curl (the tool
/// operators reach for) gets an answer with either.
#[tokio::test]
async fn curl_gets_answers_over_http2_and_http1() {
    let c = certs("curl");
    let addr = https_router(&c).await;
    for (flag, version) in [("--http2", "2"), ("--http1.1", "1.1")] {
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "--max-time", "10", flag, "--cacert"])
            .arg(&c.cert)
            .args(["-o", "/dev/null", "-w", "%{http_code} %{http_version}"])
            .arg(format!("https://{addr}/health"))
            .output()
            .await
            .expect("curl is needed for this test (apt-get install curl)");
        let got = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(got, format!("200 {version}"), "curl {flag}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[tokio::test]
async fn trusts_the_configured_ca_for_https_workers() {
    let c = certs("ca");
    let worker = fake_worker().await;
    // An HTTPS hop in front of the worker (a router is a convenient TLS server).
    let tls_hop = serve_router(RawConfig {
        tls_cert: Some(c.cert.clone()),
        tls_key: Some(c.key.clone()),
        workers: vec![format!("w={worker}")],
        ..Default::default()
    })
    .await;
    let front = serve_router(RawConfig {
        workers: vec![format!("hop=https://{tls_hop}")],
        tls_ca: Some(c.cert.clone()),
        ..Default::default()
    })
    .await;
    let resp = reqwest::Client::new()
        .post(format!("http://{front}/v1/completions"))
        .json(&json!({"model": "m", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    // 200 (not 502): the front router reached the https:// worker it was told to trust.
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kvroute-worker"], "hop");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["choices"][0]["text"], "ok");

    // Without the CA the same hop is untrusted: the attempt fails, 502.
    let untrusting =
        serve_router(RawConfig { workers: vec![format!("hop=https://{tls_hop}")], retries: 0, ..Default::default() })
            .await;
    let resp = reqwest::Client::new()
        .post(format!("http://{untrusting}/v1/completions"))
        .json(&json!({"model": "m", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
}

#[test]
fn missing_or_mismatched_tls_files_fail_clearly() {
    let e = RawConfig { tls_cert: Some("/nonexistent.pem".into()), ..Default::default() }.validate().unwrap_err();
    assert!(e.to_string().contains("tls_cert"), "{e}");
    let e = kvroute_router::tls::server_config("/nonexistent/cert.pem".as_ref(), "/nonexistent/key.pem".as_ref())
        .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");
}
