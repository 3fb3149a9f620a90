//! The HTTP server loop: the axum app served by hyper (HTTP/1.1 and HTTP/2),
//! with the two limits `axum::serve` does not expose:
//!
//! - a deadline on reading a request's headers (`header_read_timeout`): a
//!   client sending its headers a byte at a time (slow-loris) is cut off
//!   instead of holding a connection and a task forever;
//! - a cap on open connections (`max_connections`): at the cap the loop stops
//!   accepting until one closes, so a flood queues in the kernel backlog
//!   instead of exhausting file descriptors.
//!
//! Shutdown is graceful: on cancellation no new connection is accepted and
//! open ones finish their requests (the caller bounds the wait).
//!
//! Request-level load shedding (`max_concurrent_requests`, 503 with
//! `retry-after`, `kvroute_shed_total`) is `proxy::admit`'s semaphore, not
//! tower's `ConcurrencyLimit` + `LoadShed`: those take the slot before the
//! body is read (a slow sender would hold one) and give it back when the
//! response's headers are ready, while a streamed answer must keep its slot
//! until its last chunk; and they would cover `/health`, `/metrics` and the
//! sidecars' pushes, which are never shed.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Connection-level limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then waits for
/// open connections to finish.
pub async fn serve<L>(mut listener: L, app: axum::Router, limits: Limits, shutdown: CancellationToken)
where
    L: axum::serve::Listener,
    L::Io: Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let (io, _peer) = tokio::select! {
            conn = listener.accept() => conn,
            () = shutdown.cancelled() => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // Errors here are the client's (a reset, a header timeout): nothing to do.
            let _ = conn.await;
            drop(permit);
        });
    }
    graceful.shutdown().await;
}
