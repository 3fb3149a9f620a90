//! Test harness: a fake engine + router HTTP server (axum on 127.0.0.1:0), a
//! fake vLLM ZMQ publisher (PUB bound on tcp://127.0.0.1:0) and the sidecar's
//! `run` on an ephemeral listener. Waits poll conditions under a deadline.

#![allow(dead_code)]

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use bytes::Bytes;
use kvroute_shared::{BlockKey, BlockSize, KeyRoot, block_keys};
use kvroute_sidecar::RawConfig;
use parking_lot::Mutex;
use rmpv::Value as M;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

pub const TOKEN: &str = "sidecar-test-token-0123";
pub const BS: u32 = 4;
pub const TOPIC: &str = "kv-events";

/// One message the fake router accepted.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub body: Value,
}

impl Received {
    pub fn is_sync(&self) -> bool {
        self.path == "/internal/sync"
    }
}

#[derive(Debug)]
pub struct FakeState {
    pub received: Mutex<Vec<Received>>,
    pub router_epoch: Mutex<String>,
    pub down: AtomicBool,
    /// The next eviction push is answered `unknown_worker` (as by a router
    /// that lost the worker) instead of `applied`.
    pub refuse_next_eviction: AtomicBool,
}

async fn internal(
    State(s): State<Arc<FakeState>>,
    headers: HeaderMap,
    path: axum::extract::OriginalUri,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    if s.down.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({})));
    }
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(&format!("Bearer {TOKEN}")) {
        return (StatusCode::UNAUTHORIZED, Json(json!({})));
    }
    s.received.lock().push(Received { path: path.path().to_owned(), body });
    let epoch = s.router_epoch.lock().clone();
    let refused = path.path() == "/internal/eviction" && s.refuse_next_eviction.swap(false, Ordering::SeqCst);
    let outcome = if refused { "unknown_worker" } else { "applied" };
    (StatusCode::OK, Json(json!({"router_epoch": epoch, "outcome": outcome})))
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "m"}, {"id": "sql-adapter"}]}))
}

async fn engine_metrics() -> String {
    "vllm:num_requests_running{engine=\"0\"} 3.0\nvllm:num_requests_waiting{engine=\"0\"} 1.0\n\
     vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n"
        .to_owned()
}

/// A fake engine HTTP API and router on one ephemeral port.
pub async fn fake_server() -> (SocketAddr, Arc<FakeState>) {
    let state = Arc::new(FakeState {
        received: Mutex::new(Vec::new()),
        router_epoch: Mutex::new("r1".into()),
        down: AtomicBool::new(false),
        refuse_next_eviction: AtomicBool::new(false),
    });
    let app = axum::Router::new()
        .route("/internal/eviction", post(internal))
        .route("/internal/sync", post(internal))
        .route("/v1/models", get(models))
        .route("/metrics", get(engine_metrics))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, state)
}

/// Every batch published (or dropped), as a replay endpoint serves them.
#[derive(Clone, Debug, Default)]
pub struct History(Arc<Mutex<Vec<Published>>>);

impl History {
    /// Forgets every batch: the buffer of an engine that just restarted.
    pub fn clear(&self) {
        self.0.lock().clear();
    }
}

/// One batch: its seq and msgpack payload.
pub type Published = (u64, Vec<u8>);

/// A fake vLLM publisher, with the history a replay endpoint serves from.
pub struct Publisher {
    socket: PubSocket,
    pub endpoint: String,
    pub seq: u64,
    pub history: History,
}

impl Publisher {
    pub async fn bind() -> Self {
        let mut socket = PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        Publisher { socket, endpoint, seq: 0, history: History::default() }
    }

    /// The engine restarts on the same port: its connections close, its
    /// seq starts again from 0 and its replay buffer is empty.
    pub async fn restart(&mut self) {
        let endpoint = self.endpoint.clone();
        drop(std::mem::replace(&mut self.socket, PubSocket::new()));
        // The dropped socket's listener closes in its own task.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while let Err(e) = self.socket.bind(&endpoint).await {
            assert!(tokio::time::Instant::now() < deadline, "cannot bind {endpoint} again: {e}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.history.clear();
        self.seq = 0;
    }

    /// Publishes one batch with the next seq.
    pub async fn publish(&mut self, events: Vec<M>) {
        let seq = self.seq;
        self.seq += 1;
        self.publish_at(seq, events).await;
    }

    pub async fn publish_at(&mut self, seq: u64, events: Vec<M>) {
        let buf = self.record(seq, events);
        let frames = vec![Bytes::from_static(TOPIC.as_bytes()), Bytes::copy_from_slice(&seq.to_be_bytes()), buf.into()];
        self.socket.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
    }

    /// Encodes a batch and keeps it for replay, without sending it.
    pub fn record(&mut self, seq: u64, events: Vec<M>) -> Vec<u8> {
        let payload = M::Array(vec![M::F64(1.7e9), M::Array(events), M::from(0)]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &payload).unwrap();
        self.history.0.lock().push((seq, buf.clone()));
        buf
    }

    /// Takes the next seq without sending the batch: a message lost in transit.
    pub fn drop_next(&mut self, events: Vec<M>) {
        let seq = self.seq;
        self.seq += 1;
        self.record(seq, events);
    }
}

/// A fake vLLM replay endpoint (ROUTER) serving `history`, current reply
/// format `[topic, seq, payload]`; `keep_last` models a bounded buffer.
/// With `hold_first`, the first answer waits until that fake router has a
/// sync, or for a second: a replay slower than the sidecar's first push.
pub async fn replay_server(history: History, keep_last: usize, hold_first: Option<Arc<FakeState>>) -> String {
    let mut socket = zeromq::RouterSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        let mut hold = hold_first;
        while let Ok(req) = zeromq::SocketRecv::recv(&mut socket).await {
            if let Some(fake) = hold.take() {
                let synced = || fake.received.lock().iter().any(Received::is_sync);
                let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
                while !synced() && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            let frames = req.into_vec();
            let identity = frames[0].clone();
            let start = u64::from_be_bytes(frames[2][..8].try_into().unwrap());
            let held: Vec<Published> = {
                let h = history.0.lock();
                h.iter().skip(h.len().saturating_sub(keep_last)).filter(|(s, _)| *s >= start).cloned().collect()
            };
            for (seq, payload) in held {
                let msg = vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::from_static(TOPIC.as_bytes()),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload.into(),
                ];
                let _ = socket.send(ZmqMessage::try_from(msg).unwrap()).await;
            }
            let end = vec![
                identity,
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
            ];
            let _ = socket.send(ZmqMessage::try_from(end).unwrap()).await;
        }
    });
    endpoint
}

/// A fake `kvroute_hooks` snapshot endpoint (REP) answering with `held`.
pub async fn snapshot_server(held: Arc<Mutex<Vec<u64>>>) -> String {
    let mut socket = zeromq::RepSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        while zeromq::SocketRecv::recv(&mut socket).await.is_ok() {
            let hashes = M::Array(held.lock().iter().map(|h| M::from(*h)).collect());
            let reply = M::Map(vec![(M::from("ok"), M::Boolean(true)), (M::from("hashes"), hashes)]);
            let mut buf = Vec::new();
            rmpv::encode::write_value(&mut buf, &reply).unwrap();
            if socket.send(ZmqMessage::from(buf)).await.is_err() {
                break;
            }
        }
    });
    endpoint
}

/// How a test wants the sidecar wired.
#[derive(Clone, Debug)]
pub struct Options {
    pub sync_interval: &'static str,
    /// Serve replays, keeping the last N batches.
    pub replay_keep_last: Option<usize>,
    /// Serve engine snapshots holding these hashes.
    pub snapshot: Option<Arc<Mutex<Vec<u64>>>>,
    /// Batches the engine published before the sidecar started: in its
    /// replay buffer, never seen live.
    pub published_before: Vec<Vec<M>>,
    /// The replay endpoint's first answer is slower than the first push.
    pub slow_first_replay: bool,
}

impl Options {
    pub fn sync(sync_interval: &'static str) -> Self {
        Options {
            sync_interval,
            replay_keep_last: None,
            snapshot: None,
            published_before: Vec::new(),
            slow_first_replay: false,
        }
    }
}

pub fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> M {
    M::Map(vec![
        (M::from("type"), M::from("BlockStored")),
        (M::from("block_hashes"), M::Array(hashes.iter().map(|h| M::from(*h)).collect())),
        (M::from("parent_block_hash"), parent.map_or(M::Nil, M::from)),
        (M::from("token_ids"), M::Array(tokens.iter().map(|t| M::from(*t)).collect())),
        (M::from("block_size"), M::from(BS)),
        (M::from("lora_id"), M::Nil),
        (M::from("medium"), M::from("GPU")),
        (M::from("lora_name"), M::Nil),
    ])
}

pub fn removed(hashes: &[u64]) -> M {
    M::Map(vec![
        (M::from("type"), M::from("BlockRemoved")),
        (M::from("block_hashes"), M::Array(hashes.iter().map(|h| M::from(*h)).collect())),
        (M::from("medium"), M::from("GPU")),
    ])
}

fn probe() -> M {
    M::Map(vec![(M::from("type"), M::from("KvrouteTestProbe"))])
}

/// Router keys of every full block of `tokens` under model "m".
pub fn keys(tokens: &[u32]) -> Vec<BlockKey> {
    block_keys(KeyRoot::new("m", None), tokens, BlockSize::new(BS).unwrap())
}

pub fn hex_set(keys: &[BlockKey]) -> HashSet<String> {
    keys.iter().map(|k| k.to_hex()).collect()
}

/// A running sidecar wired to the fakes.
pub struct Harness {
    pub fake: Arc<FakeState>,
    pub publisher: Publisher,
    pub sidecar: SocketAddr,
    pub http: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    pub async fn start(sync_interval: &'static str) -> Self {
        Self::start_with(Options::sync(sync_interval)).await
    }

    pub async fn start_with(opts: Options) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let (addr, fake) = fake_server().await;
        let mut publisher = Publisher::bind().await;
        for batch in opts.published_before {
            publisher.drop_next(batch);
        }
        let replay = match opts.replay_keep_last {
            Some(n) => {
                let hold = opts.slow_first_replay.then(|| fake.clone());
                Some(replay_server(publisher.history.clone(), n, hold).await)
            }
            None => None,
        };
        let engine_snapshot = match &opts.snapshot {
            Some(held) => Some(snapshot_server(held.clone()).await),
            None => None,
        };
        let raw = RawConfig {
            replay,
            engine_snapshot,
            worker_id: Some("w1".into()),
            engine_url: Some(format!("http://{addr}")),
            advertise_url: Some("http://10.0.0.7:8000".into()),
            model: Some("m".into()),
            events: Some(publisher.endpoint.clone()),
            router: vec![format!("http://{addr}")],
            internal_token: Some(TOKEN.into()),
            fast_interval: Some(Duration::from_millis(20)),
            sync_interval: Some(humantime_serde::re::humantime::parse_duration(opts.sync_interval).unwrap()),
            // The paper's constant snapshots: these tests watch periodic syncs.
            full_sync_interval: Some(humantime_serde::re::humantime::parse_duration(opts.sync_interval).unwrap()),
            block_size: Some(BS),
            ..RawConfig::default()
        };
        let config = raw.validate("unused").unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sidecar = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            kvroute_sidecar::run(listener, config, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        let mut h = Harness {
            fake,
            publisher,
            sidecar,
            http: reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap(),
            stop: Some(stop),
            task: Some(task),
        };
        h.warm_up().await;
        h
    }

    pub async fn metrics(&self) -> String {
        let url = format!("http://{}/metrics", self.sidecar);
        match self.http.get(url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// One series' value; panics when the scrape fails or the series is
    /// absent (read as 0, a renamed series passed every `== 0` check).
    pub async fn metric(&self, series: &str) -> f64 {
        let url = format!("http://{}/metrics", self.sidecar);
        let resp = self.http.get(url).send().await.unwrap_or_else(|e| panic!("scraping the sidecar: {e}"));
        let text = resp.text().await.unwrap_or_else(|e| panic!("reading the sidecar's metrics: {e}"));
        series_value(&text, series).unwrap_or_else(|| panic!("no {series} in the sidecar's metrics:\n{text}"))
    }

    pub async fn health(&self) -> Option<Value> {
        let r = self.http.get(format!("http://{}/health", self.sidecar)).send().await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.json().await.ok()
    }

    /// The sidecar's current epoch, as routers see it: from the first push
    /// that arrives after this call (idle links send a heartbeat every 500 ms;
    /// `/health` no longer shows it).
    pub async fn epoch(&self) -> String {
        let seen = self.received().len();
        wait("a push carrying the current epoch", || async { self.received().len() > seen }).await;
        self.received()[seen..].last().unwrap().body["epoch"].as_str().unwrap().to_owned()
    }

    /// PUB/SUB joins late: publish probes until the sidecar counts one, then
    /// wait for the router to have a sync of the current epoch, so later
    /// events arrive as eviction pushes.
    async fn warm_up(&mut self) {
        let mut probes = 0u32;
        loop {
            self.publisher.publish(vec![probe()]).await;
            // A scrape may fail while it starts: read leniently here.
            let text = self.metrics().await;
            if series_value(&text, "kvroute_sidecar_events_total{kind=\"unknown\"}").is_some_and(|v| v >= 1.0) {
                break;
            }
            probes += 1;
            assert!(probes < 500, "sidecar never received an event");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let epoch = self.epoch().await;
        self.wait_for("a sync of the current epoch", |r| {
            r.iter().any(|m| m.is_sync() && m.body["epoch"] == epoch.as_str())
        })
        .await;
    }

    pub fn received(&self) -> Vec<Received> {
        self.fake.received.lock().clone()
    }

    /// Polls the fake router's log until `cond` holds (10 s deadline).
    pub async fn wait_for(&self, what: &str, cond: impl Fn(&[Received]) -> bool) {
        wait(what, || async { cond(&self.received()) }).await;
    }

    /// The router's view: syncs replace, evictions apply (in arrival order).
    pub fn router_view(&self) -> HashSet<String> {
        view(&self.received())
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

pub fn view(received: &[Received]) -> HashSet<String> {
    let mut set = HashSet::new();
    let strings = |v: &Value| -> Vec<String> {
        v.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect()).unwrap_or_default()
    };
    for m in received {
        if m.is_sync() {
            set = strings(&m.body["hashes"]).into_iter().collect();
        } else {
            if m.body["cleared"] == true {
                set.clear();
            }
            for k in strings(&m.body["evicted_hashes"]) {
                set.remove(&k);
            }
            set.extend(strings(&m.body["stored_hashes"]));
        }
    }
    set
}

/// Polls `cond` every 10 ms until it holds; panics after 10 s.
pub async fn wait<F, Fut>(what: &str, cond: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The value of `series` (a name with its labels) in a `/metrics` page.
fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}
