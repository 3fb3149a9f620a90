//! The context API (AIBrix-style sessions): `POST /v1/context` runs a
//! completion or chat request and pins its worker under a new session id,
//! returned in `x-session-id`; later requests carrying that header stick to
//! the worker; `DELETE /v1/context/{id}` ends the session.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::error::RouterError;
use crate::proxy::{proxy, read_client_body, refused, session_ttl};
use crate::request_id::RequestId;
use crate::state::AppState;

pub async fn create(
    State(state): State<Arc<AppState>>,
    id: Option<Extension<RequestId>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let id = id.map(|Extension(id)| id);
    let arrived = Instant::now();
    let run = async {
        // Read under the API's deadline and `max_body_bytes`, a chat's body
        // held to the prompt's bound as `proxy` holds it.
        // Read again (and counted again) by `proxy`: this read's share goes.
        let read = async {
            let (body, endpoint, _) = read_client_body(&state, body, None).await?;
            Ok((body, endpoint, session_ttl(&state, &headers)?))
        };
        let (body, endpoint, ttl) = read.await.inspect_err(|e| refused(&state, e, arrived))?;
        let session = format!("ctx-{:032x}", rand::random::<u128>());
        proxy(&state, endpoint, id.as_ref(), &headers, Body::from(body), Some((session, ttl)), arrived).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn delete(State(state): State<Arc<AppState>>, id: Result<Path<String>, PathRejection>) -> Response {
    // axum's own rejection (an id that is not UTF-8) is plain text.
    let Ok(Path(id)) = id else {
        return RouterError::bad_request("session id", "must be UTF-8 text").into_response();
    };
    if state.sessions.remove(&id, Instant::now()) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        RouterError::NotFound(format!("no live session {id:?}")).into_response()
    }
}
