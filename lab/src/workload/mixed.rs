//! `mixed`: tenants of different shapes sharing one cluster. Held out: no
//! routing default was tuned on it (it came after them, 2026-11-26), so it
//! checks that what was tuned on each shape alone still holds when they meet.
//!
//! A quarter of the requests each from `chat` (a shared system prompt,
//! growing conversations), `rag` (long documents, short questions), `agent`
//! (a 6,000-token tool prompt, short steps) and `eviction` (2,048-token
//! documents by Zipf popularity over 4 × the cluster's KV capacity: a long
//! tail of cold prompts that evicts the others' prefixes). Each generator's
//! first requests are taken as it makes them, their arrival times scaled so
//! that all four span the same time: each tenant keeps its own bursts and
//! lulls, at a rate that makes it a quarter of the traffic. Sessions keep
//! their turns, their ids made distinct per tenant; in a closed loop each
//! tenant's sessions are kept whole (a quarter of the requests start
//! sessions or stand alone, the tenants' shares then differ).

use super::{RequestSpec, Shape, agent, chat, eviction, rag};
use crate::time::Micros;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let quarter = Shape { requests: shape.requests.div_ceil(4), ..shape.clone() };
    let tenants: [fn(&Shape) -> Vec<RequestSpec>; 4] =
        [chat::generate, rag::generate, agent::generate, eviction::generate];
    let parts: Vec<Vec<RequestSpec>> = tenants
        .iter()
        .map(|generate| {
            let mut part = generate(&quarter);
            part.sort_by_key(|r| r.at);
            // A closed loop keeps whole sessions, as `Workload::generate` does.
            if !shape.closed_loop {
                part.truncate(quarter.requests);
            }
            part
        })
        .collect();
    let span = |part: &[RequestSpec]| part.last().map_or(0, |r| r.at.0).max(1);
    let common = parts.iter().map(|p| span(p)).max().unwrap_or(1);
    let mut out = Vec::with_capacity(quarter.requests * 4);
    for (tenant, part) in parts.into_iter().enumerate() {
        let factor = common as f64 / span(&part) as f64;
        for mut r in part {
            r.at = Micros((r.at.0 as f64 * factor).round() as u64);
            if let Some(turn) = r.turn.as_mut() {
                turn.session |= (tenant as u64) << 56;
            }
            out.push(r);
        }
    }
    out
}
