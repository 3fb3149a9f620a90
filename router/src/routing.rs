//! From a parsed request to a routing plan: tokenize as the engine will, key
//! the blocks, match them against the index, and ask the policy. Shared by the
//! proxy and `/debug/route`, so the debug answer is the real decision.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::tokenize::TokenizeError;
use kvroute_shared::{BlockKey, KeyRoot, ModelName, WorkerId, block_keys};

use crate::error::RouterError;
use crate::index::{Index, MatchKind, Slot};
use crate::metrics::PolicyReason;
use crate::policy::{Candidate, Decision, Reason, RouteView};
use crate::state::{AppState, MapState, now_ms};
use crate::workers::Worker;

/// A routing decision with everything that led to it.
#[derive(Debug)]
pub struct Plan {
    pub model: String,
    pub tokens: Vec<u32>,
    /// Prompt tokens the engine computes beyond `tokens`, unkeyed: a
    /// truncated completion too long to tokenize here ([`prepare`]).
    pub unkeyed_tokens: usize,
    pub keys: Vec<BlockKey>,
    /// The engine reads nothing of this prompt from its cache
    /// ([`PromptRequest::skips_prefix_cache`]): no keys, placed by load.
    pub skips_prefix_cache: bool,
    pub block_size: usize,
    /// Candidates (healthy, serving the model), index-aligned with `candidates`.
    pub workers: Vec<Arc<Worker>>,
    pub candidates: Vec<Candidate>,
    pub decision: Decision,
    pub exact_tokenizer: bool,
    /// [`RouteView::sole_router`] and [`RouteView::routers_counted`] as
    /// the decision saw them.
    pub sole_router: bool,
    pub routers_counted: bool,
    /// The tick of the speculative entries recorded for the first choice
    /// (a live decision's), to take them back if its engine refuses the
    /// request ([`withdraw`]).
    pub recorded: Option<u64>,
}

impl Plan {
    /// Workers in the order to try them.
    pub fn attempts(&self) -> impl Iterator<Item = (&Arc<Worker>, &Candidate)> + Clone {
        self.decision.ranked.iter().map(|&i| (&self.workers[i], &self.candidates[i]))
    }

    pub fn uncached_tokens(&self, c: &Candidate) -> u64 {
        (self.tokens.len().saturating_sub(c.matched_blocks * self.block_size) + self.unkeyed_tokens) as u64
    }
}

fn tokenize_error(req: &PromptRequest, e: TokenizeError, max_prompt_tokens: usize) -> RouterError {
    let field = match req {
        PromptRequest::Completion(_) => "prompt",
        PromptRequest::Chat(_) => "messages",
    };
    match e {
        TokenizeError::Template { .. } | TokenizeError::NoChatTemplate | TokenizeError::Encode(_) => {
            RouterError::bad_request(field, e.to_string())
        }
        TokenizeError::TooLong { .. } => RouterError::PromptTooLong { tokens: None, max: max_prompt_tokens },
        other => RouterError::Internal(other.to_string()),
    }
}

/// A request rendered, tokenized and keyed: the CPU-heavy half of planning.
#[derive(Debug)]
pub struct Prepared {
    model: String,
    tokens: Vec<u32>,
    unkeyed_tokens: usize,
    keys: Vec<BlockKey>,
    head_hash: u64,
    prefix_hint: Option<usize>,
    exact_tokenizer: bool,
    /// The body's `request_id` (vLLM's extension).
    pub request_id: Option<String>,
    skips_prefix_cache: bool,
    /// A chat the model's template could not render here, keyed by its
    /// messages' plain text (counted by the caller that routes it, not by
    /// `/debug/route`).
    pub template_fallback: bool,
}

/// Upper bound of prompt bytes per token, for refusing a body, or a chat
/// template's rendering of it, before paying to tokenize it: byte-level BPE
/// tokens cover at least one byte each, and real text averages about 4;
/// JSON escapes can double a character.
const MAX_BYTES_PER_TOKEN: usize = 16;

/// The most bytes an acceptable prompt can take: a completion's prompt
/// past it is refused before it is tokenized (or, truncated, placed by
/// load), and so is a chat body naming no media, once read
/// ([`crate::proxy::read_client_body`]).
pub fn prompt_body_limit(state: &AppState) -> usize {
    state.config.raw.max_prompt_tokens.saturating_mul(MAX_BYTES_PER_TOKEN)
}

/// The healthy workers serving `model` (`""`: any). None: a 404 when workers
/// exist and none serves it (a wrong name, not an outage), else a 503.
pub fn serving(snapshot: &[Arc<Worker>], model: &str) -> Result<Vec<Arc<Worker>>, RouterError> {
    let serves = |w: &Worker| model.is_empty() || w.serves(model);
    let workers: Vec<Arc<Worker>> = snapshot.iter().filter(|w| w.live.is_healthy() && serves(w)).cloned().collect();
    if !workers.is_empty() {
        return Ok(workers);
    }
    let model = model.to_owned();
    if !snapshot.is_empty() && !snapshot.iter().any(|w| serves(w)) {
        return Err(RouterError::ModelNotFound { model });
    }
    Err(RouterError::NoHealthyWorker { model })
}

/// The model a request that names none is for: vLLM serves it its base
/// model, the first its `/v1/models` lists, and keys its blocks by it. The
/// first healthy worker's that has a list; `""` (any worker, keys of their
/// own) when none has.
pub fn served_model(state: &AppState) -> String {
    let snapshot = state.workers.snapshot();
    let listed =
        |healthy: bool| snapshot.iter().filter(|w| w.live.is_healthy() || !healthy).find_map(|w| w.models.first());
    listed(true).or_else(|| listed(false)).map(|m| m.as_str().to_owned()).unwrap_or_default()
}

/// The name `model`'s blocks are keyed by: the base's when every worker
/// listing it (the healthy ones, if any) says it is an alias of that same
/// base (`--served-model-name a b`); else its own. A worker that lists no
/// models (a static one before its list is read) has no say. One worker's word is not
/// enough: where maps differ (a rename rolling out, another engine's LoRA
/// adapter of that name, a sidecar that lies), the request keeps its own
/// name, as before aliases were known.
pub fn key_model<'a>(snapshot: &'a [Arc<Worker>], model: &'a str) -> &'a str {
    if snapshot.iter().all(|w| w.aliases.is_empty()) {
        return model;
    }
    let name = ModelName::new(model);
    let serves = |w: &&Arc<Worker>| w.models.contains(&name);
    let healthy = snapshot.iter().filter(serves).any(|w| w.live.is_healthy());
    let mut workers = snapshot.iter().filter(serves).filter(|w| !healthy || w.live.is_healthy());
    let Some(first) = workers.next() else { return model };
    match first.aliases.get(&name) {
        Some(base) if workers.all(|w| w.aliases.get(&name) == Some(base)) => base.as_str(),
        _ => model,
    }
}

/// Renders, tokenizes and keys `req` on the calling thread.
pub fn prepare(state: &AppState, req: &PromptRequest) -> Result<Prepared, RouterError> {
    let model = match req.model() {
        "" => served_model(state),
        named => named.to_owned(),
    };
    let snapshot = state.workers.snapshot();
    let key_model = key_model(&snapshot, &model);
    // An alias without a tokenizer of its own uses its base's.
    let tokenizer = state.tokenizers.named(&model).unwrap_or_else(|| state.tokenizers.for_model(key_model));
    let max = state.config.raw.max_prompt_tokens;
    // A chat template can expand a small body hundreds of times: the text
    // is held to the same bound as a body before it is tokenized.
    let cap = max.saturating_mul(MAX_BYTES_PER_TOKEN);
    let mut template_fallback = false;
    let mut unkeyed_tokens = 0;
    let truncation = req.truncation();
    // vLLM refuses a truncation past its input limit (`max_prompt_tokens`
    // here): any number was taken as the tokens a truncated prompt keeps,
    // added to the worker's pending prefill (up to 2⁶³, which wrapped the
    // counter and made the replicas refuse this router's whole report).
    if let Some(keep) = truncation.keep.filter(|keep| *keep > max) {
        let message = format!("truncate_prompt_tokens={keep} cannot be greater than the prompt limit, {max} tokens");
        return Err(RouterError::bad_request("truncate_prompt_tokens", message));
    }
    let tokens = match (tokenizer.prompt_tokens_within(req, cap), req, truncation.keep) {
        (Ok(tokens), ..) => tokens,
        // Longer than any prompt, but truncated by the engine, which checks
        // no length then: served, placed by load (no keys), counted as the
        // tokens the engine keeps (more bytes than 16 a token hold more
        // tokens than that). Tokenized whole, up to `max_body_bytes` of text
        // cost a job seconds and hundreds of megabytes.
        (Err(TokenizeError::TooLong { .. }), PromptRequest::Completion(_), Some(keep)) => {
            unkeyed_tokens = keep;
            Vec::new()
        }
        // The template cannot render it here (a construct minijinja lacks, a
        // template that refuses the conversation) or there is none (the
        // engine may have `--chat-template`): the engine decides, not the
        // router. Placed by its plain text, which no engine caches.
        (Err(e @ (TokenizeError::Template { .. } | TokenizeError::NoChatTemplate)), PromptRequest::Chat(chat), _) => {
            template_fallback = true;
            tracing::debug!(error = %e, "the chat template did not render: placed by the messages' plain text");
            tokenizer.plain_chat_tokens(chat, cap).map_err(|e| tokenize_error(req, e, max))?
        }
        (Err(e), ..) => return Err(tokenize_error(req, e, max)),
    };
    // Without the model's tokenizer the "tokens" of text are bytes, about
    // four to a token: counting them against the limit refused prompts a
    // quarter of the engine's. The byte bound above still holds (but for a
    // truncated completion, placed by load past it); the engine counts.
    // Token ids are tokens whatever the tokenizer.
    // A batch's prompts each count: only the first is keyed.
    let batched = req.longest_batched_token_ids().unwrap_or(0);
    let counted = tokens.len().max(truncation.keep.map_or(batched, |keep| batched.min(keep)));
    if (tokenizer.is_exact() || req.has_token_ids()) && counted > max {
        return Err(RouterError::PromptTooLong { tokens: Some(counted), max });
    }
    let root = KeyRoot::new(key_model, req.cache_salt());
    // Asking for its prompt's logprobs, it is computed from scratch wherever
    // it goes: placed by load, every token counted as prefill (matched, the
    // holder of its prefix was chosen and charged none; the engine computed
    // them all, and its pace read as fast).
    let skips_prefix_cache = req.skips_prefix_cache();
    let keys = if skips_prefix_cache { Vec::new() } else { block_keys(root, &tokens, state.config.block_size) };
    let head = &tokens[..tokens.len().min(state.config.raw.head_tokens)];
    let head_hash = BlockKey::chain(root.0, head).0;
    let prefix_hint = req.prefix_len().map(|n| n as usize);
    let exact_tokenizer = tokenizer.is_exact();
    let request_id = req.request_id().map(str::to_owned);
    Ok(Prepared {
        model,
        tokens,
        unkeyed_tokens,
        keys,
        head_hash,
        prefix_hint,
        exact_tokenizer,
        request_id,
        skips_prefix_cache,
        template_fallback,
    })
}

/// Parses `body` ([`crate::proxy::parse`]) and renders, tokenizes and keys
/// the request ([`prepare`]) in one job on tokio's blocking pool, at most one
/// per core at a time; returns whether it is streamed, and the prompt.
/// Rendering and tokenizing take from microseconds to seconds of CPU (a
/// megabyte prompt): on the async runtime they would stall health checks,
/// sidecar pushes and every other request, and a long enough stall expires
/// every worker. The parsed request (a chat body of many small content
/// parts parses to ~30 × its size) lives only inside the job: however many
/// requests wait for a slot, at most one per core is parsed at a time, and
/// none is held while its answer comes. Waiting for a slot is asynchronous.
///
/// After a body of [`RELEASE_MEMORY_AFTER_BYTES`] or more, the allocator is
/// asked to hand its free memory back to the system.
pub async fn parse_and_prepare(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    body: &Bytes,
) -> Result<(bool, Prepared), RouterError> {
    let (st, body) = (state.clone(), body.clone());
    on_tokenizer_pool(state, move || {
        let started = Instant::now();
        let req = crate::proxy::parse(&st, endpoint, &body)?;
        let stream = req.stream();
        let prepared = prepare(&st, &req);
        st.metrics.tokenize_seconds.observe(started.elapsed().as_secs_f64());
        drop(req);
        if body.len() >= RELEASE_MEMORY_AFTER_BYTES {
            release_free_memory();
        }
        Ok((stream, prepared?))
    })
    .await
}

/// Runs `job` on tokio's blocking pool under a tokenizer slot (one per
/// core), waiting for the slot asynchronously. The slot goes with the job: a
/// request dropped while its job runs (its client gone) does not give the
/// slot back until the job ends, or every dropped request would let another
/// job start, past one per core, each holding its body and parse.
pub async fn on_tokenizer_pool<T: Send + 'static>(
    state: &AppState,
    job: impl FnOnce() -> Result<T, RouterError> + Send + 'static,
) -> Result<T, RouterError> {
    let slot = state
        .tokenize_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| RouterError::Internal("tokenizer pool closed".into()))?;
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        job()
    })
    .await
    .map_err(|e| RouterError::Internal(format!("tokenizer task failed: {e}")))?
}

/// Tokenizing a prompt of several MB allocates hundreds of MB of
/// intermediates (a 6.4 MB prompt: RSS 25 → 468 MB), and glibc's malloc
/// keeps freed memory for reuse: without a trim the router stayed at 505 MB
/// after three such requests. Below this size a trim is not worth its cost.
pub const RELEASE_MEMORY_AFTER_BYTES: usize = 1 << 20;

/// Returns the allocator's free memory to the system (glibc `malloc_trim`).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of glibc's own arenas; it
    // takes no pointers and is safe to call at any time from any thread.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Plans a prepared request; `pinned` is the worker a live session points
/// at. A `live` plan is counted in the metrics; `/debug/route` plans are not.
pub fn plan(state: &AppState, prepared: Prepared, pinned: Option<&WorkerId>, live: bool) -> Result<Plan, RouterError> {
    plan_against(state, &state.workers.snapshot(), prepared, pinned, live)
}

/// [`plan`] among the workers of `snapshot`, which is taken before the index
/// lock and may be out of date by the time the lock is held.
fn plan_against(
    state: &AppState,
    snapshot: &[Arc<Worker>],
    prepared: Prepared,
    pinned: Option<&WorkerId>,
    live: bool,
) -> Result<Plan, RouterError> {
    let started = Instant::now();
    let Prepared {
        model,
        tokens,
        unkeyed_tokens,
        keys,
        head_hash,
        prefix_hint,
        exact_tokenizer,
        skips_prefix_cache,
        ..
    } = prepared;

    let workers = serving(snapshot, &model)?;
    let block_size = state.config.block_size.get();
    let pinned_at = pinned.and_then(|id| workers.iter().position(|w| &w.id == id));
    let now = now_ms();
    let sole_router = state.sole_router(now);
    let routers_counted = state.routers_counted(now);
    // What the other replicas just sent where (`replicas::prefixes`): a
    // prefix one of them is prefilling on a worker counts as sent there.
    let hints = state.replicas.hints();
    let hinted = hints.depths(&keys);
    let decide = |index: &Index| {
        let depths = index.match_depths(&keys);
        let depth_of = |slot: Slot| depths.iter().find(|(s, _)| *s == slot).map_or(0, |(_, d)| *d);
        let candidates: Vec<Candidate> = workers
            .iter()
            .map(|w| {
                let indexed = depth_of(w.slot);
                let sent_by_others = hinted.iter().find(|(id, _)| **id == w.id).map_or(0, |(_, d)| *d);
                let (matched_blocks, matched_kind) = if sent_by_others > indexed {
                    (sent_by_others, MatchKind::Sent)
                } else {
                    (indexed, index.match_kind(w.slot, &keys[..indexed]))
                };
                let load = w.live.load(now, index.held(w.slot));
                Candidate { slot: w.slot, matched_blocks, matched_kind, load, id_hash: w.id_hash }
            })
            .collect();
        let view = RouteView {
            prompt_tokens: tokens.len() + unkeyed_tokens,
            block_size,
            keys: &keys,
            head_hash,
            candidates: &candidates,
            mean_prompt_tokens: state.mean_prompt_tokens(),
            mean_uncached_tokens: state.mean_uncached_tokens(),
            prefix_hint,
            dry_run: !live,
            sole_router,
            routers_counted,
        };
        let decision = match pinned_at {
            Some(i) if !overloaded(&view, i, state) => Decision::with_fallbacks(&view, i, Reason::Session),
            _ => state.policy.choose(&view),
        };
        (candidates, decision)
    };
    // A live decision and its speculative entries are one step under the
    // index lock: otherwise two requests of a new prefix decided at the same
    // instant (one per runtime thread) both miss, and a burst scatters. The
    // lock is held for the match and the policy, microseconds.
    let (candidates, decision, recorded) = if live {
        let mut map = state.map.write();
        let (candidates, decision) = decide(&map.index);
        let recorded = decision.chosen().and_then(|i| record_routed(state, &mut map, &workers[i], &keys));
        (candidates, decision, recorded)
    } else {
        let (candidates, decision) = decide(&state.map.read().index);
        (candidates, decision, None)
    };

    let plan = Plan {
        model,
        tokens,
        unkeyed_tokens,
        keys,
        skips_prefix_cache,
        block_size,
        workers,
        candidates,
        decision,
        exact_tokenizer,
        sole_router,
        routers_counted,
        recorded,
    };
    if live {
        observe_decision(state, &plan);
        state.metrics.routing_seconds.observe(started.elapsed().as_secs_f64());
    }
    Ok(plan)
}

/// A live decision's metrics, and its prompt in the router's moving means.
fn observe_decision(state: &AppState, plan: &Plan) {
    let (m, tokens, block_size) = (&state.metrics, &plan.tokens, plan.block_size);
    let chosen = plan.decision.chosen().map(|i| &plan.candidates[i]);
    m.decisions
        .get_or_create(&PolicyReason { policy: state.policy.name(), reason: plan.decision.reason.as_str() })
        .inc();
    if let Some(c) = chosen
        && !tokens.is_empty()
    {
        let matched = (c.matched_blocks * block_size).min(tokens.len());
        m.matched_ratio.observe(matched as f64 / tokens.len() as f64);
        m.prompt_tokens.inc_by(tokens.len() as u64);
        m.matched_tokens.inc_by(matched as u64);
    }
    let uncached = chosen.map_or(tokens.len(), |c| tokens.len().saturating_sub(c.matched_blocks * block_size));
    state.observe_prompt_tokens(tokens.len(), uncached as u64);
}

/// A pinned worker is skipped when it carries far more than its share.
fn overloaded(view: &RouteView<'_>, i: usize, state: &AppState) -> bool {
    let p = match &state.config.policy {
        crate::config::PolicyConfig::CacheAware(p) => *p,
        _ => crate::policy::CacheAwareParams::default(),
    };
    let loads: Vec<u64> = view.candidates.iter().map(|c| c.load.requests()).collect();
    loads[i] as f64 > p.spill_limit(&loads)
}

/// Records that the request's blocks are being computed on `worker` (a retry
/// on another worker than the plan's first choice, which was recorded with
/// the decision).
pub fn record_dispatch(state: &AppState, worker: &Worker, keys: &[BlockKey]) -> Option<u64> {
    if keys.is_empty() {
        return None;
    }
    record_routed(state, &mut state.map.write(), worker, keys)
}

/// Takes back the speculative entries recorded at `tick` for a request
/// `worker`'s engine refused (a 4xx: a bad parameter, a prompt past its
/// context) or failed (a 5xx, a connection refused or closed, a stream
/// broken before its first chunk): whatever it computed, its sidecar
/// confirms. Left, a client sending prompts the engine refuses (which
/// costs the engine nothing) filled workers' speculative entries with
/// blocks nobody caches, and a failed request's drew the same prefix's
/// next requests to the worker that had just failed it. A request given
/// up for a late first token keeps them: its engine may have prefilled
/// some of it, which its sidecar confirms (the other replicas stop
/// counting it as sent there, as for any failed attempt).
pub fn withdraw(state: &AppState, worker: &Worker, keys: &[BlockKey], tick: Option<u64>) {
    let Some(tick) = tick else { return };
    let mut map = state.map.write();
    if map.is_member(&state.workers, worker) {
        map.index.withdraw_routed(worker.slot, keys, tick);
    }
}

/// Records `keys` as routed to `worker` if it is still its slot's member.
/// `worker` comes from a snapshot taken before the lock: since then it may
/// have been removed and another worker registered in its slot, which must
/// not get entries for blocks sent elsewhere.
///
/// Nor an ejected worker (a retry's, ejected while an earlier attempt
/// waited): its index was cleared, and entries recorded now would pull the
/// prompt's next turn to it once re-admitted, where nothing is cached.
fn record_routed(state: &AppState, map: &mut MapState, worker: &Worker, keys: &[BlockKey]) -> Option<u64> {
    (!keys.is_empty() && worker.live.is_healthy() && map.is_member(&state.workers, worker))
        .then(|| map.index.record_routed(worker.slot, keys, now_ms()))
}

#[cfg(test)]
mod tests {
    use kvroute_shared::openai::Endpoint;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::RawConfig;
    use crate::index::Counts;

    fn state() -> Arc<AppState> {
        crate::build_state(RawConfig::default().validate().unwrap(), CancellationToken::new()).unwrap()
    }

    fn register(state: &AppState, id: &str) -> Arc<Worker> {
        let mut map = state.map.write();
        map.register_sidecar(&state.workers, &WorkerId::new(id), Some("http://10.0.0.1:8000".into()), None, now_ms())
            .unwrap()
            .worker
    }

    /// `a` removed and `b` registered in its slot.
    fn replace(state: &AppState, a: &Worker) -> Arc<Worker> {
        assert!(state.map.write().remove(&state.workers, a));
        let b = register(state, "b");
        assert_eq!(b.slot, a.slot);
        b
    }

    fn prepared(state: &AppState) -> Prepared {
        let body = br#"{"model": "m", "prompt": "a prompt long enough to fill a block or two of bytes, at least"}"#;
        let req = crate::proxy::parse(state, Endpoint::Completions, body).unwrap();
        let p = prepare(state, &req).unwrap();
        assert!(!p.keys.is_empty());
        p
    }

    #[test]
    fn a_plan_from_an_old_snapshot_records_nothing_for_the_slots_new_member() {
        let state = state();
        let a = register(&state, "a");
        let prepared = prepared(&state);
        let old_snapshot = state.workers.snapshot();
        let b = replace(&state, &a);
        let plan = plan_against(&state, &old_snapshot, prepared, None, true).unwrap();
        assert_eq!(plan.decision.chosen().map(|i| plan.workers[i].id.as_str()), Some("a"));
        assert_eq!(state.map.read().index.counts(b.slot), Counts::default());
    }

    #[test]
    fn a_retry_on_a_removed_worker_records_nothing_for_the_slots_new_member() {
        let state = state();
        let a = register(&state, "a");
        let keys = prepared(&state).keys;
        let b = replace(&state, &a);
        record_dispatch(&state, &a, &keys);
        assert_eq!(state.map.read().index.counts(b.slot), Counts::default());
        record_dispatch(&state, &b, &keys);
        assert_eq!(state.map.read().index.counts(b.slot).speculative, keys.len());
    }

    #[test]
    fn a_retry_on_an_ejected_worker_records_nothing() {
        let state = state();
        let a = register(&state, "a");
        let keys = prepared(&state).keys;
        a.live.healthy.store(false, std::sync::atomic::Ordering::Relaxed);
        crate::health::eject(&state, &a, "test");
        record_dispatch(&state, &a, &keys);
        assert_eq!(state.map.read().index.counts(a.slot), Counts::default());
    }

    /// A request dropped while its tokenizer job runs (its client gone)
    /// keeps the slot until the job ends: the slot was given back at once,
    /// and every dropped request let another job start past one per core.
    #[tokio::test]
    async fn a_dropped_request_keeps_its_tokenizer_slot_until_its_job_ends() {
        let state = state();
        let slots = state.tokenize_slots.available_permits();
        let (started_tx, started) = std::sync::mpsc::channel::<()>();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let waiting = tokio::spawn({
            let state = state.clone();
            async move {
                let job = move || {
                    started_tx.send(()).unwrap();
                    released.recv().unwrap();
                    Ok(())
                };
                on_tokenizer_pool(&state, job).await
            }
        });
        tokio::task::spawn_blocking(move || started.recv().unwrap()).await.unwrap();
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(state.tokenize_slots.available_permits(), slots - 1, "the job still runs");
        release.send(()).unwrap();
        while state.tokenize_slots.available_permits() < slots {
            tokio::task::yield_now().await;
        }
    }
}
