//! The router's error type and the one place that maps errors to HTTP statuses.
//! Bodies are OpenAI-shaped; internal details are logged, never returned.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvroute_shared::WorkerId;
use kvroute_shared::wire::{DecodeError, ErrorBody};

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("{message}")]
    BadRequest { field: Option<String>, message: String },
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("request body exceeds {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("{0}")]
    NotFound(String),
    /// A route the router serves, asked with another method.
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("the router is at its concurrency limit; retry shortly")]
    Overloaded,
    #[error("no healthy worker serves model {model:?}")]
    NoHealthyWorker { model: String },
    /// No worker, healthy or not, serves the model: what vLLM answers (404),
    /// so clients do not retry a typo.
    #[error("The model `{model}` does not exist.")]
    ModelNotFound { model: String },
    #[error("the request body did not arrive within {after:?}")]
    BodyTimeout { after: std::time::Duration },
    /// Beyond `max_prompt_tokens` (the count when it was measured: a body too
    /// large is refused before tokenizing).
    #[error("{}", prompt_too_long(*tokens, *max))]
    PromptTooLong { tokens: Option<usize>, max: usize },
    #[error("upstream worker {worker} failed: {message}")]
    UpstreamFailed { worker: WorkerId, message: String },
    #[error("upstream worker {worker} timed out")]
    UpstreamTimeout { worker: WorkerId },
    #[error("internal error")]
    Internal(String),
}

fn prompt_too_long(tokens: Option<usize>, max: usize) -> String {
    match tokens {
        Some(n) => format!("the prompt has {n} tokens, more than this router's max_prompt_tokens ({max})"),
        // The body, or the chat template's rendering of it, before tokenizing.
        None => {
            format!("the prompt is longer than max_prompt_tokens ({max}) tokens can be (refused before tokenizing)")
        }
    }
}

impl RouterError {
    pub fn bad_request(field: impl Into<String>, message: impl Into<String>) -> Self {
        RouterError::BadRequest { field: Some(field.into()), message: message.into() }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            RouterError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            RouterError::Unauthorized => StatusCode::UNAUTHORIZED,
            RouterError::Forbidden(_) => StatusCode::FORBIDDEN,
            RouterError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            RouterError::PayloadTooLarge { .. } | RouterError::PromptTooLong { tokens: None, .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            RouterError::PromptTooLong { tokens: Some(_), .. } => StatusCode::BAD_REQUEST,
            RouterError::NotFound(_) | RouterError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            RouterError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            RouterError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            RouterError::Overloaded | RouterError::NoHealthyWorker { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RouterError::UpstreamFailed { .. } => StatusCode::BAD_GATEWAY,
            RouterError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            RouterError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            RouterError::BadRequest { .. }
            | RouterError::PayloadTooLarge { .. }
            | RouterError::PromptTooLong { .. }
            | RouterError::BodyTimeout { .. }
            | RouterError::MethodNotAllowed => "invalid_request_error",
            RouterError::Unauthorized | RouterError::Forbidden(_) => "authentication_error",
            RouterError::Unavailable(_) => "service_unavailable",
            RouterError::NotFound(_) => "not_found_error",
            RouterError::ModelNotFound { .. } => "NotFoundError",
            RouterError::Overloaded | RouterError::NoHealthyWorker { .. } => "service_unavailable",
            RouterError::UpstreamFailed { .. } | RouterError::UpstreamTimeout { .. } => "upstream_error",
            RouterError::Internal(_) => "internal_error",
        }
    }

    /// The OpenAI-shaped body for this error.
    pub fn body(&self) -> ErrorBody {
        let mut body = ErrorBody::new(self.status().as_u16(), self.kind(), self.to_string());
        if let RouterError::BadRequest { field: Some(f), .. } = self {
            body = body.with_param(f.clone());
        }
        if let RouterError::ModelNotFound { .. } = self {
            body = body.with_param("model".to_owned());
        }
        body
    }
}

impl From<DecodeError> for RouterError {
    fn from(e: DecodeError) -> Self {
        RouterError::BadRequest { message: e.to_string(), field: Some(e.field) }
    }
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        if let RouterError::Internal(detail) = &self {
            tracing::error!(error = %detail, "internal error");
        }
        let status = self.status();
        let mut resp = (status, axum::Json(self.body())).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies() {
        let e = RouterError::bad_request("messages[0].content", "must be a string");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.body().error.param.as_deref(), Some("messages[0].content"));
        let e = RouterError::Internal("db password is hunter2".into());
        assert_eq!(e.body().error.message, "internal error");
        assert_eq!(RouterError::Overloaded.into_response().headers()[header::RETRY_AFTER], "1");
        assert_eq!(RouterError::UpstreamTimeout { worker: WorkerId::new("w") }.status(), StatusCode::GATEWAY_TIMEOUT);
    }
}
