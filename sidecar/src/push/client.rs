//! Sending one message to one router: the HTTP implementation, behind a trait
//! so the push loop's timing can be tested without sockets.

use std::fmt;
use std::time::Duration;

use futures::future::BoxFuture;
use kvroute_shared::wire::{EVICTION_PATH, EvictionBatch, InternalAck, SYNC_PATH, SyncSnapshot};
use serde::Serialize;

use crate::config::Secret;
use crate::state::RouterTarget;

/// Timeout of one HTTP call to a router.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// A push that the router did not accept.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// No connection to the router: nothing was sent.
    #[error("cannot connect to {url}")]
    Unreachable {
        url: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("request to {url} failed")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered {status}")]
    Status { url: String, status: u16 },
}

impl PushError {
    /// The router never saw the request (retrying costs it nothing).
    pub fn nothing_sent(&self) -> bool {
        matches!(self, PushError::Unreachable { .. })
    }
}

/// Delivers the two internal messages to a router and returns its ack.
pub trait RouterClient: Send + Sync + fmt::Debug {
    fn eviction<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a EvictionBatch,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>>;
    fn sync<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a SyncSnapshot,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>>;
}

/// `POST {router}/internal/{eviction,sync}` with the bearer token.
#[derive(Debug)]
pub struct HttpRouterClient {
    http: reqwest::Client,
    token: Option<Secret>,
}

impl HttpRouterClient {
    pub fn new(http: reqwest::Client, token: Option<Secret>) -> Self {
        HttpRouterClient { http, token }
    }

    async fn post<T: Serialize + Sync>(
        &self,
        target: &RouterTarget,
        path: &str,
        body: &T,
    ) -> Result<InternalAck, PushError> {
        let url = format!("{}{path}", target.0);
        let mut req = self.http.post(&url).json(body).timeout(CALL_TIMEOUT);
        if let Some(token) = &self.token {
            req = req.bearer_auth(&token.0);
        }
        let http = |source| PushError::Http { url: url.clone(), source };
        let resp = req.send().await.map_err(|e| {
            if e.is_connect() { PushError::Unreachable { url: url.clone(), source: Box::new(e) } } else { http(e) }
        })?;
        if !resp.status().is_success() {
            return Err(PushError::Status { url, status: resp.status().as_u16() });
        }
        resp.json::<InternalAck>().await.map_err(http)
    }
}

impl RouterClient for HttpRouterClient {
    fn eviction<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a EvictionBatch,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>> {
        Box::pin(self.post(target, EVICTION_PATH, body))
    }

    fn sync<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a SyncSnapshot,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>> {
        Box::pin(self.post(target, SYNC_PATH, body))
    }
}
