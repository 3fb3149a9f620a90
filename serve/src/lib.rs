//! The HTTP server loop of `kvroute-router` and of `kvroute-sidecar`'s
//! `/health` and `/metrics` server: the axum app served by hyper (HTTP/1.1
//! and HTTP/2), with the limits `axum::serve` does not expose:
//!
//! - a deadline on reading a request's headers (`header_read_timeout`): a
//!   client sending its headers a byte at a time (slow-loris) is cut off
//!   instead of holding a connection and a task forever;
//! - a deadline on a connection's first request (`header_read_timeout`),
//!   and on each next one (`keep_alive_timeout` after the last answer
//!   ended): hyper's header deadline starts only once it knows the
//!   protocol, so a socket that sends nothing, or part of the HTTP/2
//!   preface, or an HTTP/2 connection that goes quiet, held its slot
//!   forever (10,000 of them shut every client, sidecar and replica out).
//!   A connection with a request under way (a long streamed answer) is
//!   never idle; past the deadline one is shut down gracefully;
//! - a write deadline (`idle_timeout`): a client that takes no bytes for
//!   that long is disconnected ([`WriteDeadline`]), and its answer's engine
//!   request cancelled;
//! - a cap on open connections (`max_connections`): at the cap the loop stops
//!   accepting until one closes, so a flood queues in the kernel backlog
//!   instead of exhausting file descriptors.
//!
//! Shutdown is graceful: on cancellation no new connection is accepted and
//! open ones finish their requests (the caller bounds the wait).
//!
//! The router's request-level load shedding (`max_concurrent_requests`, 503
//! with `retry-after`, `kvroute_shed_total`) is `proxy::admit`'s semaphore, not
//! tower's `ConcurrencyLimit` + `LoadShed`: those take the slot before the
//! body is read (a slow sender would hold one) and give it back when the
//! response's headers are ready, while a streamed answer must keep its slot
//! until its last chunk; and they would cover `/health`, `/metrics` and the
//! sidecars' pushes, which are never shed.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::TryFutureExt;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// Connection-level limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// A connection with nothing under way for this long after its last
    /// answer ended is shut down (75 s by default, nginx's
    /// `keepalive_timeout`): clients keep pools of idle connections, and
    /// this bounds the slots they hold for nothing.
    pub keep_alive_timeout: Duration,
    /// A connection whose client takes no bytes for this long is closed
    /// (`idle_timeout`): a client that never reads a long streamed answer
    /// would otherwise hold its concurrency slot, and its engine request,
    /// forever, the stream waiting on a full socket buffer.
    pub write_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then waits for
/// open connections to finish.
pub async fn serve<L>(mut listener: L, app: axum::Router, limits: Limits, shutdown: CancellationToken)
where
    L: axum::serve::Listener,
    L::Io: Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
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
        let activity = Arc::new(Activity::default());
        let app = app.clone();
        let counted = activity.clone();
        let service = TowerToHyperService::new(tower::service_fn(move |req| {
            let guard = Activity::begin(&counted);
            // The guard lives as long as the response body: a streamed answer
            // keeps its connection busy until its last chunk.
            app.clone().oneshot(req).map_ok(move |resp: axum::response::Response| {
                resp.map(|body| {
                    axum::body::Body::new(body.map_frame(move |frame| {
                        let _busy = &guard;
                        frame
                    }))
                })
            })
        }));
        let io = WriteDeadline::new(io, limits.write_timeout);
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service).into_owned();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            // The first request must start within the header deadline, each
            // next one within the keep-alive time of the last one's end.
            let mut wait = limits.header_read_timeout;
            let finished = loop {
                tokio::select! {
                    // Errors here are the client's (a reset, a header timeout): nothing to do.
                    _ = conn.as_mut() => break true,
                    () = tokio::time::sleep(wait) => {
                        let limit = if activity.started.load(Ordering::Relaxed) == 0 {
                            limits.header_read_timeout
                        } else {
                            limits.keep_alive_timeout
                        };
                        match activity.idle_for() {
                            Some(idle) if idle >= limit => break false,
                            Some(idle) => wait = limit - idle,
                            None => wait = limit,
                        }
                    }
                    () = shutdown.cancelled() => break false,
                }
            };
            if !finished {
                // No new request; those under way finish. A peer that never
                // completes the close (an HTTP/2 client that does not answer
                // the GOAWAY's ping) is dropped once nothing is under way.
                conn.as_mut().graceful_shutdown();
                loop {
                    tokio::select! {
                        _ = conn.as_mut() => break,
                        () = tokio::time::sleep(limits.header_read_timeout) => {
                            if activity.busy.load(Ordering::Relaxed) == 0 {
                                break;
                            }
                        }
                    }
                }
            }
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}

/// One connection's requests: how many started, how many are under way
/// (until their response body has been sent or dropped), and when the
/// last one began or ended.
#[derive(Debug)]
struct Activity {
    opened: Instant,
    started: AtomicU64,
    busy: AtomicU64,
    /// Ms after `opened` of the last request's start or end.
    last_ms: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            opened: Instant::now(),
            started: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        }
    }
}

impl Activity {
    fn begin(this: &Arc<Activity>) -> Busy {
        this.started.fetch_add(1, Ordering::Relaxed);
        this.busy.fetch_add(1, Ordering::Relaxed);
        this.touch();
        Busy(this.clone())
    }

    fn touch(&self) {
        self.last_ms.store(self.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long the connection has had nothing under way; `None` while a
    /// request is.
    fn idle_for(&self) -> Option<Duration> {
        (self.busy.load(Ordering::Acquire) == 0).then(|| {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            self.opened.elapsed().saturating_sub(last)
        })
    }
}

/// A request under way; dropped with its response body.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        // The end's time first: whoever sees nothing under way sees it.
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::Release);
    }
}

/// A socket whose writes fail once one has waited `timeout` for the client
/// to take bytes: hyper has no write deadline, and a streamed answer waits
/// on a full socket buffer for as long as the client does not read.
struct WriteDeadline<IO> {
    io: IO,
    timeout: Duration,
    /// Set while a write (or flush) is pending.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<IO> WriteDeadline<IO> {
    fn new(io: IO, timeout: Duration) -> Self {
        WriteDeadline { io, timeout, stalled: None }
    }

    /// `poll` made no progress: fails once it has made none for `timeout`.
    fn stall<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let timeout = self.timeout;
        let deadline = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no bytes within the write timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for WriteDeadline<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.stall(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.stall(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.stall(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_shutdown(cx);
        self.stall(cx, poll)
    }
}
