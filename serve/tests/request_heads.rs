//! A request head is bounded: hyper's HTTP/1 default let ~400 KiB of headers
//! be read and held for the request's life (HTTP/2's limit is 16 KiB).

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use kvroute_serve::{Limits, MAX_HEAD_BYTES, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

async fn status_of(addr: &str, header_bytes: usize) -> String {
    let mut sock = TcpStream::connect(addr).await.unwrap();
    let head =
        format!("GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\nconnection: close\r\n\r\n", "a".repeat(header_bytes));
    // The server may answer (and close) before the whole head is written.
    let _ = sock.write_all(head.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = sock.read_to_end(&mut answer).await;
    String::from_utf8_lossy(&answer).lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_request_head_past_its_bound_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let app = Router::new().route("/health", get(|| async { "ok" }));
    let limits = Limits {
        max_connections: 16,
        header_read_timeout: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(75),
        write_timeout: Duration::from_secs(30),
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(listener, app, limits, shutdown.clone()));
    assert!(status_of(&addr, 8 << 10).await.starts_with("HTTP/1.1 200"), "an 8 KiB header is served");
    let refused = status_of(&addr, 300 << 10).await;
    assert!(refused.starts_with("HTTP/1.1 431"), "a 300 KiB head (bound {MAX_HEAD_BYTES}) answered {refused:?}");
    shutdown.cancel();
}
