//! An in-process router on an ephemeral loopback port, shared by the
//! integration tests that talk to it over HTTP.

use std::time::Duration;

use kvroute_router::config::{RawConfig, Secret};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The internal token every test router accepts.
pub const TOKEN: &str = "test-internal-token-0123";

/// A running router; it stops when dropped.
pub struct TestRouter {
    pub url: String,
    pub http: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
}

impl TestRouter {
    /// The value of the series named by `series` (its name and labels) on
    /// the router's `/metrics` page, if it is there.
    #[allow(dead_code)] // not every test file needs it
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = self.http.get(format!("{}/metrics", self.url)).send().await.unwrap().text().await.unwrap();
        text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    /// Asks the router to stop, as a stop signal does.
    #[allow(dead_code)] // not every test file needs it
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Starts a router with `workers` (`(id, url)`) as static workers, active
/// health checks out of the way, and whatever `tweak` changes.
pub async fn router(workers: &[(&str, &str)], tweak: impl FnOnce(&mut RawConfig)) -> TestRouter {
    let mut raw = RawConfig {
        workers: workers.iter().map(|(id, url)| format!("{id}={url}")).collect(),
        internal_token: Some(Secret::new(TOKEN)),
        health_check_interval: Duration::from_secs(3600),
        retries: 2,
        ..Default::default()
    };
    tweak(&mut raw);
    serve(TcpListener::bind("127.0.0.1:0").await.unwrap(), raw)
}

/// Starts a router with `raw` on a listener the caller bound (to know its
/// own URL before the router starts).
#[allow(dead_code)] // not every test file needs it
pub fn serve(listener: TcpListener, raw: RawConfig) -> TestRouter {
    let config = raw.validate().unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(kvroute_router::run(listener, config, async move {
        let _ = stopped.await;
    }));
    TestRouter { url, http: reqwest::Client::new(), stop: Some(stop) }
}

/// Polls `check` every 20 ms until it yields a value, for at most 20 s
/// (a deadline for a broken build, not a wait for readiness).
#[allow(dead_code)] // not every test file needs it
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Serves `app` (an engine stand-in) on an ephemeral loopback port; its URL.
#[allow(dead_code)] // not every test file needs it
pub async fn serve_engine(app: axum::Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A loopback URL that refuses connections: a port the OS gave, bound and
/// not listening, held for as long as the value lives (released, another
/// test's listener could take it).
#[allow(dead_code)] // not every test file needs it
pub struct Refused {
    pub url: String,
    _held: tokio::net::TcpSocket,
}

#[allow(dead_code)] // not every test file needs it
pub fn refused_url() -> Refused {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    Refused { url: format!("http://{}", socket.local_addr().unwrap()), _held: socket }
}
