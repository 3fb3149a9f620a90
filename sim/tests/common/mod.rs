//! Shared helpers for the HTTP and live-events tests: a `Sim` on
//! `127.0.0.1:0` (ZMQ endpoints on port 0) and a small client.
#![allow(dead_code)]

use kvroute_sim::{Config, Sim, SimInfo};
use serde_json::Value;
use tokio::net::TcpListener;

pub struct Running {
    pub base: String,
    pub info: SimInfo,
    pub client: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

pub async fn start(mut config: Config) -> Running {
    config.loras = vec!["sql-adapter".into()];
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let sim = Sim::start(listener, config).await.expect("start");
    let info = sim.info().clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(sim.serve(async {
        let _ = rx.await;
    }));
    Running { base: info.listen.clone(), info, client: reqwest::Client::new(), _stop: tx }
}

pub fn with_events(mut config: Config) -> Config {
    config.events = Some(kvroute_sim::config::EventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        topic: "kv-events".into(),
        format: kvroute_sim::events::EventFormat::Current,
        hash_mode: kvroute_sim::engine::hashing::HashMode::Int,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        buffer: 100,
    });
    config
}

impl Running {
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.client.post(format!("{}{path}", self.base)).json(&body).send().await.expect("send");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(format!("{}{path}", self.base)).send().await.expect("send");
        (r.status().as_u16(), r.text().await.expect("body"))
    }

    pub async fn post_raw(&self, path: &str, body: Value) -> (u16, String, String) {
        let r = self.client.post(format!("{}{path}", self.base)).json(&body).send().await.expect("send");
        let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        (r.status().as_u16(), ct, r.text().await.expect("body"))
    }
}
