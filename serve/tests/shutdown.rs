//! At shutdown the listening socket closes at once, while the answers under
//! way finish: a client then gets a refusal it can act on (another replica)
//! instead of a connection the kernel completes and nobody serves.

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use kvroute_serve::{Limits, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn a_draining_server_refuses_new_connections_and_finishes_its_answers() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // `/slow` tells the test it started, then answers when the test says.
    let (started_tx, mut started) = mpsc::channel::<()>(1);
    let (release, released) = oneshot::channel::<()>();
    let released = std::sync::Arc::new(Mutex::new(Some(released)));
    let app = Router::new().route(
        "/slow",
        get(move || async move {
            started_tx.send(()).await.unwrap();
            let wait = released.lock().await.take().unwrap();
            wait.await.unwrap();
            "done"
        }),
    );
    let limits = Limits {
        max_connections: 16,
        header_read_timeout: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(75),
        write_timeout: Duration::from_secs(30),
    };
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(serve(listener, app, limits, shutdown.clone()));

    let mut busy = TcpStream::connect(&addr).await.unwrap();
    busy.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    started.recv().await.unwrap();
    shutdown.cancel();

    // The test's own bound (20 s): without the fix connections are
    // completed by the kernel's backlog and never refused.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(&addr)).await {
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            _ => assert!(tokio::time::Instant::now() < deadline, "new connections are not refused while draining"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    release.send(()).unwrap();
    let mut answer = String::new();
    busy.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("done"), "{answer}");
    tokio::time::timeout(Duration::from_secs(20), server).await.expect("the server stops once drained").unwrap();
}
