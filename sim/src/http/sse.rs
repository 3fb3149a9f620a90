//! Server-sent events framing as vLLM writes it: `data: {json}\n\n` per chunk,
//! then `data: [DONE]\n\n`. A batch of prompts streams as one response, each
//! entry's tokens under its own choice index, interleaved as they come.

use std::convert::Infallible;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::SelectAll;
use kvroute_shared::wire::ErrorBody;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::bodies::{self, Head, Kind};
use crate::engine::{Outcome, StreamEvent};

pub fn frame(v: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serializing a `Value` into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

type Tagged = futures::stream::BoxStream<'static, (usize, StreamEvent)>;

/// The state of one streamed response over all its prompts' engine streams.
struct Merge {
    head: Head,
    /// Per prompt: its last token finishes its choice.
    max_tokens: Vec<u32>,
    include_usage: bool,
    events: SelectAll<Tagged>,
    outcomes: Vec<Option<Outcome>>,
    /// The entry that answered first: vLLM's streamed `cached_tokens` is its.
    first: Option<usize>,
    over: bool,
}

impl Merge {
    /// The frames for the next engine event, or `None` at the end.
    async fn next_frames(&mut self) -> Option<Vec<Bytes>> {
        while !self.over {
            let (i, ev) = self.events.next().await?;
            let first = *self.first.get_or_insert(i);
            match ev {
                StreamEvent::Token { index } => {
                    let mut f = Vec::with_capacity(2);
                    if index == 0 && self.head.kind == Kind::Chat {
                        f.push(frame(&bodies::role_chunk(&self.head)));
                    }
                    f.push(frame(&bodies::token_chunk(
                        &self.head,
                        i,
                        index,
                        Some(&(index + 1)) == self.max_tokens.get(i),
                    )));
                    return Some(f);
                }
                StreamEvent::Done(o) => {
                    self.outcomes[i] = Some(o);
                    let all: Option<Vec<Outcome>> = self.outcomes.iter().copied().collect();
                    let Some(all) = all else { continue };
                    self.over = true;
                    let mut f = Vec::with_capacity(2);
                    if self.include_usage {
                        f.push(frame(&bodies::usage_chunk(&self.head, &Outcome::batch(&all, first))));
                    }
                    f.push(Bytes::from_static(DONE));
                    return Some(f);
                }
                StreamEvent::Failed(why) => {
                    self.over = true;
                    let err = ErrorBody::new(400, "BadRequestError", why.to_string());
                    let v = serde_json::to_value(err).unwrap_or(Value::Null);
                    return Some(vec![frame(&v), Bytes::from_static(DONE)]);
                }
            }
        }
        None
    }
}

/// Turns the engine's per-token events (one receiver per prompt) into an SSE
/// response body.
pub fn response(
    head: Head,
    max_tokens: Vec<u32>,
    include_usage: bool,
    receivers: Vec<mpsc::UnboundedReceiver<StreamEvent>>,
) -> Response {
    let outcomes = vec![None; receivers.len()];
    let events: SelectAll<Tagged> = futures::stream::select_all(
        receivers
            .into_iter()
            .enumerate()
            .map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |ev| (i, ev)).boxed()),
    );
    let merge = Merge { head, max_tokens, include_usage, events, outcomes, first: None, over: false };
    let stream = futures::stream::unfold(merge, |mut m| async move { m.next_frames().await.map(|f| (f, m)) })
        .flat_map(|frames| futures::stream::iter(frames.into_iter().map(Ok::<_, Infallible>)));
    (
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")],
        Body::from_stream(stream),
    )
        .into_response()
}
