//! An HTTP/2 client that grants no flow-control window takes no bytes
//! without ever filling the socket: its connection must still be closed
//! after the write timeout, as an HTTP/1 client's that does not read is.

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use kvroute_serve::{Limits, serve};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A server whose `/` answers 1 MiB and whose write timeout is `write_timeout`.
async fn server(write_timeout: Duration) -> (String, CancellationToken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let app = Router::new().route("/", get(|| async { vec![b'x'; 1 << 20] }));
    let limits = Limits {
        max_connections: 16,
        header_read_timeout: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(75),
        write_timeout,
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(listener, app, limits, shutdown.clone()));
    (addr, shutdown)
}

/// Sends `GET /` over HTTP/2 granting no window and never reading: does the
/// server close the connection?
async fn stalled_get(addr: &str) -> bool {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, connection) =
        h2::client::Builder::new().initial_window_size(0).handshake::<_, Bytes>(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::get(format!("http://{addr}/")).body(()).unwrap();
    let (answer, _) = client.send_request(request, true).unwrap();
    let _headers = answer.await.unwrap();
    // The test's own bound, far past the server's write timeout: without
    // the watch the connection stays open for ever.
    tokio::time::timeout(Duration::from_secs(60), connection).await.is_ok()
}

#[tokio::test]
async fn an_http2_client_granting_no_window_is_disconnected_after_the_write_timeout() {
    let (addr, _shutdown) = server(Duration::from_millis(500)).await;
    assert!(stalled_get(&addr).await, "the connection of a client that takes no bytes stays open");
}

#[tokio::test]
async fn an_http2_client_that_reads_gets_the_whole_answer() {
    let (addr, shutdown) = server(Duration::from_millis(500)).await;
    let tcp = TcpStream::connect(&addr).await.unwrap();
    let (client, connection) = h2::client::Builder::new().handshake::<_, Bytes>(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::get(format!("http://{addr}/")).body(()).unwrap();
    let (answer, _) = client.send_request(request, true).unwrap();
    let mut body = answer.await.unwrap().into_body();
    let mut received = 0;
    while let Some(chunk) = body.data().await {
        let chunk: Bytes = chunk.unwrap();
        received += chunk.len();
        body.flow_control().release_capacity(chunk.len()).unwrap();
    }
    assert_eq!(received, 1 << 20);
    drop(client);
    shutdown.cancel();
    let _ = connection.await;
}
