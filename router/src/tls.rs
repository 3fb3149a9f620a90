//! Optional TLS for the router's listener (rustls, ring provider), with
//! concurrent handshakes from `tls-listener`, counted against
//! `max_connections` ([`Capped`]).
//!
//! The serve loop stays `kvroute_serve::serve` (hyper-util), shared with plain HTTP,
//! rather than `axum-server`'s: axum-server has no cap on open connections
//! (`max_connections` pauses accepting at the cap), and its `tls-rustls`
//! feature builds aws-lc-rs (C, cmake) where the router uses ring.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tls_listener::{AsyncAccept, AsyncListener, AsyncTls, SpawningHandshakes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::PollSemaphore;

/// Handshakes slower than this are dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read TLS certificate chain {path}: {message}")]
    Cert { path: PathBuf, message: String },
    #[error("cannot read TLS private key {path}: {message}")]
    Key { path: PathBuf, message: String },
    #[error("invalid TLS certificate or key: {0}")]
    Config(#[from] rustls::Error),
}

/// A server config from PEM files: the certificate chain and its private key.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| TlsError::Cert { path: cert.into(), message: e.to_string() })?;
    if certs.is_empty() {
        return Err(TlsError::Cert { path: cert.into(), message: "no certificate in the file".into() });
    }
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key { path: key.into(), message: e.to_string() })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A listener whose connections are TLS-terminated: `tls-listener` runs each
/// handshake in its own task (a slow or hostile client cannot hold up the
/// others) under [`HANDSHAKE_TIMEOUT`]; this adapts it to axum's `Listener`,
/// which `serve` drives, logging failed handshakes at debug level (a port
/// scanner's are not errors).
pub struct TlsListener {
    inner: tls_listener::TlsListener<Capped, SpawningHandshakes<NoDelay>>,
}

/// The TCP listener under `tls-listener`, which takes every connection it
/// can into a handshake while the serve loop waits for one: each accepted
/// connection holds one of `max_connections` slots from its accept to its
/// close, handshake included. Without it, sockets that never sent a
/// ClientHello each held a descriptor for [`HANDSHAKE_TIMEOUT`] beyond the
/// serve loop's cap (`tls-listener` 0.11 has no limit of its own).
struct Capped {
    listener: TcpListener,
    slots: PollSemaphore,
    /// A slot taken for the next connection, while none is waiting.
    next: Option<OwnedSemaphorePermit>,
}

impl AsyncAccept for Capped {
    type Connection = Counted;
    type Address = SocketAddr;
    type Error = std::io::Error;

    fn poll_accept(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(Self::Connection, Self::Address), Self::Error>> {
        let this = &mut *self;
        if this.next.is_none() {
            match this.slots.poll_acquire(cx) {
                Poll::Ready(Some(slot)) => this.next = Some(slot),
                Poll::Ready(None) => return Poll::Ready(Err(std::io::Error::other("connection slots closed"))),
                Poll::Pending => return Poll::Pending,
            }
        }
        match this.listener.poll_accept(cx) {
            Poll::Ready(Ok((tcp, addr))) => Poll::Ready(Ok((Counted { tcp, _slot: this.next.take() }, addr))),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncListener for Capped {
    fn local_addr(&self) -> Result<Self::Address, Self::Error> {
        self.listener.local_addr()
    }
}

/// A TCP connection holding its slot until it is dropped.
#[derive(Debug)]
pub struct Counted {
    tcp: TcpStream,
    _slot: Option<OwnedSemaphorePermit>,
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener").field("local", &self.inner.local_addr().ok()).finish_non_exhaustive()
    }
}

/// rustls's acceptor, switching Nagle off first: streamed tokens must go out
/// at once (see `run`), and so must the handshake's flights.
#[derive(Clone)]
struct NoDelay(TlsAcceptor);

impl AsyncTls<Counted> for NoDelay {
    type Stream = TlsStream<Counted>;
    type Error = std::io::Error;
    type AcceptFuture = tokio_rustls::Accept<Counted>;

    fn accept(&self, conn: Counted) -> Self::AcceptFuture {
        let _ = conn.tcp.set_nodelay(true);
        self.0.accept(conn)
    }
}

impl TlsListener {
    /// At most `max_connections` connections, handshaking or open.
    pub fn new(listener: TcpListener, config: Arc<ServerConfig>, max_connections: usize) -> std::io::Result<Self> {
        let acceptor = SpawningHandshakes(NoDelay(TlsAcceptor::from(config)));
        let slots = PollSemaphore::new(Arc::new(Semaphore::new(max_connections)));
        let capped = Capped { listener, slots, next: None };
        let inner = tls_listener::builder(acceptor).handshake_timeout(HANDSHAKE_TIMEOUT).listen(capped);
        Ok(TlsListener { inner })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<Counted>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok(conn) => return conn,
                Err(tls_listener::Error::ListenerError(e)) => {
                    // Out of file descriptors and the like: back off briefly.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => tracing::debug!(error = %e, "TLS handshake failed"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
