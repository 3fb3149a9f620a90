//! Optional TLS for the router's listener (rustls, ring provider), with
//! concurrent handshakes from `tls-listener`.
//!
//! The serve loop stays `kvroute_serve::serve` (hyper-util), shared with plain HTTP,
//! rather than `axum-server`'s: axum-server has no cap on open connections
//! (`max_connections` pauses accepting at the cap), and its `tls-rustls`
//! feature builds aws-lc-rs (C, cmake) where the router uses ring.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tls_listener::{AsyncTls, SpawningHandshakes};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

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
    inner: tls_listener::TlsListener<TcpListener, SpawningHandshakes<NoDelay>>,
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

impl AsyncTls<TcpStream> for NoDelay {
    type Stream = TlsStream<TcpStream>;
    type Error = std::io::Error;
    type AcceptFuture = tokio_rustls::Accept<TcpStream>;

    fn accept(&self, tcp: TcpStream) -> Self::AcceptFuture {
        let _ = tcp.set_nodelay(true);
        self.0.accept(tcp)
    }
}

impl TlsListener {
    pub fn new(listener: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let acceptor = SpawningHandshakes(NoDelay(TlsAcceptor::from(config)));
        let inner = tls_listener::builder(acceptor).handshake_timeout(HANDSHAKE_TIMEOUT).listen(listener);
        Ok(TlsListener { inner })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
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
