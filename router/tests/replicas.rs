//! Router replicas exchanging what they have in flight (`/internal/replica`),
//! over HTTP between in-process routers on loopback, in front of fake
//! engines that never answer (so a prefill stays pending).

use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use kvroute_router::config::{RawConfig, Secret};
use serde_json::{Value, json};
use tokio::net::TcpListener;

mod support;
use support::{TOKEN, TestRouter, eventually, router, serve, serve_engine};

/// An engine that takes every completion and never answers it.
async fn hanging_engine() -> String {
    let app = Router::new()
        .route("/v1/completions", post(futures::future::pending::<&'static str>))
        .route("/health", get(|| async { "ok" }));
    serve_engine(app).await
}

fn words(seed: u64, n: usize) -> String {
    (0..n).map(|i| format!("w{}", (seed * 7919 + i as u64 * 104_729) % 100_000)).collect::<Vec<_>>().join(" ")
}

impl TestRouter {
    async fn route(&self, prompt: &str) -> Value {
        let body = json!({"model": "m", "prompt": prompt});
        let resp = self.http.post(format!("{}/debug/route", self.url)).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.json().await.unwrap()
    }

    /// `/admin/workers`' row for worker `id`.
    async fn worker(&self, id: &str) -> Value {
        let all: Value =
            self.http.get(format!("{}/admin/workers", self.url)).send().await.unwrap().json().await.unwrap();
        all["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).unwrap().clone()
    }
}

/// A prompt of `words` words that `r` would send to `worker` on an idle
/// cluster (where a new prompt goes is a hash of it).
async fn prompt_routed_to(r: &TestRouter, worker: &str, n: usize) -> String {
    for seed in 0..200 {
        let p = words(seed, n);
        if r.route(&p).await["decision"]["worker"] == worker {
            return p;
        }
    }
    panic!("no prompt of 200 goes to {worker}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_routes_around_the_prefill_another_replica_sent() {
    let (e1, e2) = (hanging_engine().await, hanging_engine().await);
    let engines = [("w1", e1.as_str()), ("w2", e2.as_str())];
    let a = router(&engines, |_| {}).await;
    // One link, configured on b alone: a's answers carry a's figures back.
    let b = router(&engines, |c| c.replicas = vec![a.url.clone()]).await;

    // a keeps its requests for its reports once a replica reports to it.
    eventually("a to hear b", || async { (a.metric("kvroute_replicas_heard").await == Some(1.0)).then_some(()) }).await;
    // A replica heard, a router is no longer the only one routing there.
    // It still counts every router's requests: b's come in b's reports.
    let view = a.route("hello").await;
    assert_eq!((&view["sole_router"], &view["routers_counted"]), (&json!(false), &json!(true)));
    let small = prompt_routed_to(&b, "w1", 40).await;
    let long = prompt_routed_to(&a, "w1", 1_500).await;
    let _hanging = send_hanging(&a, long.clone());

    // a's pending prefill on w1 (the whole uncached prompt) reaches b.
    let own = eventually("a to count its request pending", || async {
        let n = a.worker("w1").await["load"]["pending_prefill_tokens"].as_u64().unwrap();
        (n > 0).then_some(n)
    })
    .await;
    eventually("b to hear a's pending prefill on w1", || async {
        let load = b.worker("w1").await["load"].clone();
        (load["replica_pending_prefill_tokens"] == own && load["replica_inflight"] == 1).then_some(())
    })
    .await;
    let w2 = b.worker("w2").await["load"].clone();
    assert_eq!((w2["replica_pending_prefill_tokens"].as_u64(), w2["replica_inflight"].as_u64()), (Some(0), Some(0)));
    // b's own figures stay its own: it sent nothing.
    assert_eq!(b.worker("w1").await["load"]["inflight"], 0);

    // Before, b sent this prompt to w1; now w1 has a long prefill queued.
    let d = b.route(&small).await;
    assert_eq!(d["decision"]["worker"], "w2", "{} {}", d["decision"], d["workers"]);
    // But a prompt that continues a's follows it to w1: a's reports name
    // the prefix it is prefilling there, which no sidecar has reported yet.
    let d = b.route(&format!("{long} and one more question")).await;
    assert_eq!(d["decision"]["worker"], "w1", "{} {}", d["decision"], d["workers"]);
    let w1 = d["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w1").unwrap().clone();
    assert_eq!(w1["matched_kind"], "sent", "{w1}");
    assert!(w1["matched_blocks"].as_u64().unwrap() * 16 >= own * 4 / 5, "{w1}");

    // Both count the exchange; a reports nothing of b's (b has nothing in flight).
    assert!(b.metric("kvroute_replica_reports_total{direction=\"sent\",outcome=\"ok\"}").await.unwrap() > 0.0);
    assert!(a.metric("kvroute_replica_reports_total{direction=\"received\",outcome=\"applied\"}").await.unwrap() > 0.0);
    assert_eq!(b.metric("kvroute_replicas_heard").await, Some(1.0));
    assert_eq!(a.metric("kvroute_replicas_heard").await, Some(1.0));
    assert_eq!(a.worker("w1").await["load"]["replica_pending_prefill_tokens"], 0);
    let gauge = format!("kvroute_worker_replica_pending_prefill_tokens{{worker=\"w1\"}} {own}");
    let text = b.http.get(format!("{}/metrics", b.url)).send().await.unwrap().text().await.unwrap();
    assert!(text.lines().any(|l| l == gauge), "no {gauge} in\n{text}");
}

/// Between full reports, a router that routes a request tells its replicas
/// its new figures (news): the report after the request is loads-only and
/// counts it, though the next full report is 10 s away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_request_is_news_to_the_replicas_before_the_next_full_report() {
    let (r, mut heard) = reporting_router(Duration::from_secs(10)).await;
    let first = next_report(&mut heard).await;
    assert_eq!((&first["loads_only"], &first["workers"]), (&Value::Null, &json!([])), "{first}");

    let _hanging = send_hanging(&r, words(3, 300));
    let news = next_report(&mut heard).await;
    assert_eq!(news["loads_only"], true, "{news}");
    assert_eq!(news["sent"], json!([]), "{news}");
    let w1 = &news["workers"][0];
    assert_eq!((&w1["id"], &w1["inflight"]), (&json!("w1"), &json!(1)), "{news}");
    assert!(w1["pending_prefill_tokens"].as_u64().unwrap() > 256, "{news}");
}

/// One link per pair carries news both ways: while the replica at the other
/// end has something in flight, this router asks it for news every news
/// interval though it routes nothing itself (the answers carry it back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_replica_is_asked_for_its_news_though_this_router_routes_nothing() {
    let (told, mut heard) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let replica = Router::new().route(
        "/internal/replica",
        post(move |axum::Json(report): axum::Json<Value>| {
            let seq = report["seq"].clone();
            let loads_only = report["loads_only"].as_bool().unwrap_or(false);
            told.send(report).unwrap();
            let busy = [json!({"id": "w1", "pending_prefill_tokens": 5_000, "inflight": 2})];
            async move {
                axum::Json(
                    json!({"router_epoch": "busy-replica", "seq": seq, "workers": busy, "loads_only": loads_only}),
                )
            }
        }),
    );
    let replica = serve_engine(replica).await;
    let engine = hanging_engine().await;
    let _r = router(&[("w1", engine.as_str())], |c| {
        c.replicas = vec![replica];
        c.replica_exchange_interval = Duration::from_secs(10);
    })
    .await;
    let first = next_report(&mut heard).await;
    assert_eq!(first["loads_only"], Value::Null, "{first}");
    let news = next_report(&mut heard).await;
    assert_eq!((&news["loads_only"], &news["workers"]), (&json!(true), &json!([])), "{news}");
}

/// A router shutting down drains its requests and keeps reporting them
/// meanwhile: the other replicas still count what it has in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_router_keeps_reporting_what_it_has_in_flight() {
    let (r, mut heard) = reporting_router(Duration::from_millis(100)).await;
    let _hanging = send_hanging(&r, words(5, 50));
    let in_flight = |report: &Value| report["workers"].as_array().is_some_and(|w| w.iter().any(|w| w["inflight"] == 1));
    while !in_flight(&next_report(&mut heard).await) {}
    drop(r); // shutdown: the hanging request holds the drain open
    while heard.try_recv().is_ok() {}
    for _ in 0..3 {
        let report = next_report(&mut heard).await;
        assert!(in_flight(&report), "{report}");
    }
}

/// A router that exits tells its replicas it has nothing left (its last
/// report names no worker, though a request still hangs there): they stop
/// counting what it last reported at once, not when it expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exiting_router_tells_its_replicas_it_has_nothing_left() {
    let engine = hanging_engine().await;
    let (replica, mut heard) = listening_replica().await;
    let r = router(&[("w1", engine.as_str())], |c| {
        c.replicas = vec![replica];
        c.replica_exchange_interval = Duration::from_millis(100);
        c.shutdown_grace = Duration::from_millis(300);
    })
    .await;
    let _hanging = send_hanging(&r, words(6, 50));
    let in_flight = |report: &Value| report["workers"].as_array().is_some_and(|w| w.iter().any(|w| w["inflight"] == 1));
    while !in_flight(&next_report(&mut heard).await) {}
    drop(r);
    // While the grace lasts, reports name the request; the last names nothing.
    loop {
        let report = next_report(&mut heard).await;
        if report["workers"] == json!([]) {
            break;
        }
        assert!(in_flight(&report), "{report}");
    }
}

/// The same, for a router whose runtime ends as soon as `run` returns (the
/// binary's): its last report was a task of that runtime, cancelled unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_whose_runtime_ends_with_run_still_sends_its_last_report() {
    let engine = hanging_engine().await;
    let (replica, mut heard) = listening_replica().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let raw = RawConfig {
        workers: vec![format!("w1={engine}")],
        internal_token: Some(Secret::new(TOKEN)),
        health_check_interval: Duration::from_secs(3600),
        replicas: vec![replica],
        replica_exchange_interval: Duration::from_millis(100),
        shutdown_grace: Duration::from_millis(300),
        ..Default::default()
    };
    let config = raw.validate().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = TcpListener::from_std(listener).unwrap();
            kvroute_router::run(listener, config, async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        // The runtime, and every task still in it, ends here.
    });
    let body = json!({"model": "m", "prompt": words(7, 50), "stream": true});
    let _hanging = tokio::spawn(reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send());
    let in_flight = |report: &Value| report["workers"].as_array().is_some_and(|w| w.iter().any(|w| w["inflight"] == 1));
    while !in_flight(&next_report(&mut heard).await) {}
    stop.send(()).unwrap();
    tokio::task::spawn_blocking(move || router.join().unwrap()).await.unwrap();
    // Every report it sent is in: the last names nothing.
    let mut last = None;
    while let Ok(report) = heard.try_recv() {
        last = Some(report);
    }
    assert_eq!(last.map(|r| r["workers"].clone()), Some(json!([])));
}

/// A router with one worker (a hanging engine) that reports every
/// `interval` to a [`listening_replica`]: the router, and the reports.
async fn reporting_router(interval: Duration) -> (TestRouter, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    let engine = hanging_engine().await;
    let (replica, heard) = listening_replica().await;
    let r = router(&[("w1", engine.as_str())], |c| {
        c.replicas = vec![replica];
        c.replica_exchange_interval = interval;
    })
    .await;
    (r, heard)
}

/// Sends a completion of `prompt` through `r` that its hanging engine
/// never answers: in flight until the returned task is dropped with the test.
fn send_hanging(r: &TestRouter, prompt: String) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    // Streamed: its prompt is pending prefill until a first token that never
    // comes (a non-streamed one's only until the timing model's first token).
    let body = json!({"model": "m", "prompt": prompt, "stream": true});
    let sent = r.http.post(format!("{}/v1/completions", r.url)).json(&body);
    tokio::spawn(sent.send())
}

/// A replica that takes every report (sent on the channel) and has nothing
/// in flight itself: its URL, and the reports.
async fn listening_replica() -> (String, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    let (told, heard) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let replica = Router::new().route(
        "/internal/replica",
        post(move |axum::Json(report): axum::Json<Value>| {
            let seq = report["seq"].clone();
            told.send(report).unwrap();
            async move { axum::Json(json!({"router_epoch": "listening-replica", "seq": seq, "workers": []})) }
        }),
    );
    (serve_engine(replica).await, heard)
}

/// The next report a listening replica took (60 s at most, against a hang).
async fn next_report(heard: &mut tokio::sync::mpsc::UnboundedReceiver<Value>) -> Value {
    let next = tokio::time::timeout(Duration::from_secs(60), heard.recv()).await;
    next.expect("a report within 60 s").expect("the replica is up")
}

/// The same replica list on every replica, each one included (a headless
/// service's name): a router hears its own report, recognises it, asks
/// that address again only every 5 s, and never counts its own work twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_listed_as_its_own_replica_recognises_its_own_reports() {
    let engine = hanging_engine().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    // By name: a URL stands for every address its host resolves to.
    let url = format!("http://localhost:{}", listener.local_addr().unwrap().port());
    let raw = RawConfig {
        workers: vec![format!("w1={engine}")],
        internal_token: Some(Secret::new(TOKEN)),
        health_check_interval: Duration::from_secs(3600),
        replicas: vec![url],
        ..Default::default()
    };
    let r = serve(listener, raw);
    let _hanging = tokio::spawn(
        r.http.post(format!("{}/v1/completions", r.url)).json(&json!({"model": "m", "prompt": words(1, 300)})).send(),
    );
    // It asks itself again only every SELF_RECHECK (5 s).
    let sent = eventually("the router to find it is its own replica", || async {
        let sent = r.metric("kvroute_replica_reports_total{direction=\"sent\",outcome=\"self\"}").await;
        sent.filter(|n| *n >= 1.0)
    })
    .await;
    let received = r.metric("kvroute_replica_reports_total{direction=\"received\",outcome=\"self\"}").await;
    assert!(received.is_some_and(|n| n >= sent), "{received:?} own reports received, {sent} sent");
    assert_eq!(r.metric("kvroute_replicas_heard").await, Some(0.0));
    let load = eventually("the request to be pending", || async {
        let load = r.worker("w1").await["load"].clone();
        (load["inflight"] == 1).then_some(load)
    })
    .await;
    assert_eq!(load["replica_pending_prefill_tokens"], 0, "{load}");
    assert_eq!(load["replica_inflight"], 0, "{load}");
}

/// A replica address that once answered as this router and then as another
/// (a Service's virtual IP, which picks one replica a connection) is asked
/// again, and exchanged with: the first answer from itself ended the
/// exchange through that address for good, without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_that_answered_as_this_router_is_asked_again() {
    let engine = hanging_engine().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let own = format!("http://{}", listener.local_addr().unwrap());
    // The load-balanced address: its first report goes to the router
    // itself, every later one to another replica.
    let (told, mut heard) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let first = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let balancer = Router::new().route(
        "/internal/replica",
        post(move |body: String| {
            let (own, told, first) = (own.clone(), told.clone(), first.clone());
            async move {
                if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    let to_self = reqwest::Client::new().post(format!("{own}/internal/replica")).bearer_auth(TOKEN);
                    let answer = to_self.header("content-type", "application/json").body(body).send().await.unwrap();
                    return axum::Json(answer.json::<Value>().await.unwrap());
                }
                let report: Value = serde_json::from_str(&body).unwrap();
                let seq = report["seq"].clone();
                told.send(report).unwrap();
                axum::Json(json!({"router_epoch": "another-replica", "seq": seq, "workers": []}))
            }
        }),
    );
    let balanced = serve_engine(balancer).await;
    let raw = RawConfig {
        workers: vec![format!("w1={engine}")],
        internal_token: Some(Secret::new(TOKEN)),
        health_check_interval: Duration::from_secs(3600),
        replicas: vec![balanced],
        replica_exchange_interval: Duration::from_millis(100),
        ..Default::default()
    };
    let _r = serve(listener, raw);
    // After SELF_RECHECK (5 s) the address is asked again, answers as
    // another replica, and the reports go on.
    for _ in 0..3 {
        next_report(&mut heard).await;
    }
}

#[tokio::test]
async fn replica_reports_need_the_internal_token_and_a_valid_body() {
    let r = router(&[], |_| {}).await;
    let url = format!("{}/internal/replica", r.url);
    let report = json!({"router_epoch": "other", "seq": 1, "workers": [
        {"id": "w1", "pending_prefill_tokens": 10, "inflight": 1}]});
    assert_eq!(r.http.post(&url).json(&report).send().await.unwrap().status(), 401);
    let wrong = r.http.post(&url).bearer_auth("not-the-internal-token").json(&report).send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    let forged = json!({"router_epoch": "other", "seq": 2, "workers": [
        {"id": "w1", "pending_prefill_tokens": 10, "inflight": 1},
        {"id": "w1", "pending_prefill_tokens": 10, "inflight": 1}]});
    let bad = r.http.post(&url).bearer_auth(TOKEN).json(&forged).send().await.unwrap();
    assert_eq!(bad.status(), 400);
    let body: Value = bad.json().await.unwrap();
    assert_eq!(body["error"]["param"], "workers[1].id", "{body}");
    // A valid report is answered with the router's own.
    let ok = r.http.post(&url).bearer_auth(TOKEN).json(&report).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    let answer: Value = ok.json().await.unwrap();
    let epoch = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json::<Value>().await.unwrap()
        ["router_epoch"]
        .clone();
    assert_eq!(answer["router_epoch"], epoch);
    assert_eq!(answer["workers"], json!([]));
    assert_eq!(r.metric("kvroute_replicas_heard").await, Some(1.0));
}
