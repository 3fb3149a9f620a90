//! Server-sent events framing as vLLM writes it: `data: {json}\n\n` per chunk,
//! then `data: [DONE]\n\n`.

use std::convert::Infallible;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use kvroute_shared::wire::ErrorBody;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::bodies::{self, Head, Kind};
use crate::engine::StreamEvent;

pub fn frame(v: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serializing a `Value` into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Turns the engine's per-token events into an SSE response body.
pub fn response(
    head: Head,
    max_tokens: u32,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<StreamEvent>,
) -> Response {
    let stream = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let frames: Vec<Bytes> = match ev {
            StreamEvent::Token { index } => {
                let mut f = Vec::with_capacity(2);
                if index == 0 && head.kind == Kind::Chat {
                    f.push(frame(&bodies::role_chunk(&head)));
                }
                f.push(frame(&bodies::token_chunk(&head, index, index + 1 == max_tokens)));
                f
            }
            StreamEvent::Done(o) => {
                let mut f = Vec::with_capacity(2);
                if include_usage {
                    f.push(frame(&bodies::usage_chunk(&head, &o)));
                }
                f.push(Bytes::from_static(DONE));
                f
            }
            StreamEvent::Failed(why) => {
                let err = ErrorBody::new(400, "BadRequestError", why.to_string());
                let v = serde_json::to_value(err).unwrap_or(Value::Null);
                vec![frame(&v), Bytes::from_static(DONE)]
            }
        };
        futures::stream::iter(frames.into_iter().map(Ok::<_, Infallible>))
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")],
        Body::from_stream(stream),
    )
        .into_response()
}
