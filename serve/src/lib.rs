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
//!   request cancelled. Over HTTP/2 a client can stop taking bytes without
//!   the socket ever filling: it grants no flow-control window, and hyper
//!   waits for one before it asks the answer for its next chunk, so no
//!   write is ever pending. So the loop also watches each answer: one that
//!   has had a chunk ready (or its headers sent) for that long without
//!   being asked for more ([`Watched`]) closes its connection, and every
//!   answer on it is dropped with its engine request and slot;
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

pub mod critical;
pub mod signals;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::TryFutureExt;
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

/// The largest HTTP/1 request head read (hyper's read buffer).
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// Serves `app` on `listener` until `shutdown` is cancelled, then closes the
/// listener and waits for open connections to finish.
pub async fn serve<L>(mut listener: L, app: axum::Router, limits: Limits, shutdown: CancellationToken)
where
    L: axum::serve::Listener,
    L::Io: Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    let mut builder = Builder::new(TokioExecutor::new());
    // A request head of HTTP/1 is held to 64 KiB (hyper reads up to ~400 KiB
    // by default, held for the request's life, where HTTP/2's are 16 KiB):
    // larger is a 431.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
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
                resp.map(|body| axum::body::Body::new(Watched::new(body, guard)))
            })
        }));
        let io = WriteDeadline::new(io, limits.write_timeout);
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service).into_owned();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            // The first request must start within the header deadline, each
            // next one within the keep-alive time of the last one's end.
            let mut wait = limits.header_read_timeout.min(limits.write_timeout);
            let end = loop {
                tokio::select! {
                    // Errors here are the client's (a reset, a header timeout): nothing to do.
                    _ = conn.as_mut() => break End::Finished,
                    () = tokio::time::sleep(wait) => {
                        let limit = if activity.started.load(Ordering::Relaxed) == 0 {
                            limits.header_read_timeout
                        } else {
                            limits.keep_alive_timeout
                        };
                        match (activity.idle_for(), activity.unasked_for()) {
                            (_, Some(unasked)) if unasked >= limits.write_timeout => break End::Stalled,
                            (_, Some(unasked)) => wait = limits.write_timeout - unasked,
                            (Some(idle), None) if idle >= limit => break End::Idle,
                            (Some(idle), None) => wait = limit - idle,
                            // Busy: an answer may stall from now on.
                            (None, None) => wait = limit.min(limits.write_timeout),
                        }
                    }
                    () = shutdown.cancelled() => break End::Idle,
                }
            };
            // A stalled client would never let a graceful close finish:
            // dropping the connection drops its answers, their engine
            // requests and their slots.
            if end == End::Idle {
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
    // Closed now, not when the last answer has drained: the kernel would
    // go on completing connections that nobody serves, and their clients
    // hang for the drain instead of being refused and trying elsewhere.
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Why a connection's watch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The connection closed.
    Finished,
    /// Nothing under way for too long, or shutdown: closed gracefully.
    Idle,
    /// An answer waited too long to be asked for its next chunk: dropped.
    Stalled,
}

/// One connection's requests: how many started, how many are under way
/// (until their response body has been sent or dropped), when the last
/// one began or ended, and since when each answer has waited to be asked
/// for its next chunk.
#[derive(Debug)]
struct Activity {
    opened: Instant,
    started: AtomicU64,
    busy: AtomicU64,
    /// Ms after `opened` of the last request's start or end.
    last_ms: AtomicU64,
    /// Each live answer's [`Watched::unasked`].
    answers: std::sync::Mutex<Vec<std::sync::Weak<AtomicU64>>>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            opened: Instant::now(),
            started: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            answers: std::sync::Mutex::new(Vec::new()),
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

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// The longest any live answer has waited to be asked for its next
    /// chunk; `None` when none waits (each is producing one, or done).
    fn unasked_for(&self) -> Option<Duration> {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        answers.retain(|a| a.strong_count() > 0);
        let since = answers.iter().filter_map(|a| a.upgrade()).map(|a| a.load(Ordering::Relaxed)).min()?;
        (since != ASKED).then(|| Duration::from_millis(self.now_ms().saturating_sub(since)))
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

/// [`Watched::unasked`] of an answer that is producing its next chunk.
const ASKED: u64 = u64::MAX;

/// An answer on its way, watched for a client that stops asking for it.
/// `unasked` is the ms (after the connection opened) since which it has
/// had something to give, its headers or a chunk, and hyper has not asked
/// for more: hyper asks at once unless the client is not taking bytes.
/// While it waits on its own source (the engine) it is [`ASKED`].
struct Watched<B> {
    inner: B,
    unasked: Arc<AtomicU64>,
    busy: Busy,
}

impl<B> Watched<B> {
    fn new(inner: B, busy: Busy) -> Self {
        let unasked = Arc::new(AtomicU64::new(busy.0.now_ms()));
        let mut answers = busy.0.answers.lock().unwrap_or_else(|e| e.into_inner());
        // Answers that ended are dropped here too, not only when the loop
        // looks (a keep-alive connection may carry thousands between looks).
        if answers.len() >= 64 && answers.len().is_power_of_two() {
            answers.retain(|a| a.strong_count() > 0);
        }
        answers.push(Arc::downgrade(&unasked));
        drop(answers);
        Watched { inner, unasked, busy }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        self.unasked.store(ASKED, Ordering::Relaxed);
        let poll = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &poll {
            self.unasked.store(self.busy.0.now_ms(), Ordering::Relaxed);
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A keep-alive connection carrying answer after answer keeps no
    /// record of those that ended, and knows when one waits to be asked.
    #[test]
    fn a_connection_remembers_only_its_live_answers() {
        let activity = Arc::new(Activity::default());
        for _ in 0..10_000 {
            drop(Watched::new(axum::body::Body::empty(), Activity::begin(&activity)));
        }
        assert!(activity.answers.lock().unwrap().len() < 128);
        let live = Watched::new(axum::body::Body::empty(), Activity::begin(&activity));
        assert!(activity.unasked_for().is_some(), "its headers are ready and nobody asked for its body");
        live.unasked.store(ASKED, Ordering::Relaxed);
        assert_eq!(activity.unasked_for(), None);
        assert_eq!(activity.busy.load(Ordering::Relaxed), 1);
    }
}
