//! Is the router tokenizing as its engines do? A router whose tokenizer (or
//! chat template) differs from an engine's keys blocks that engine never
//! holds: every prefix misses, silently, and routing falls back to load
//! alone. Once per worker, after its first answered health probe, the router
//! asks the engine's `/tokenize` for a probe text and a one-message chat and
//! compares the token ids with its own. A difference is an error in the log,
//! naming the first token that differs, and `kvroute_worker_tokenizer_mismatch`
//! = 1 (an alert); routing goes on. An engine that does not answer
//! `/tokenize` (an API key the router lacks, a server without it) is not
//! compared; one that fails is asked again a minute later. A router with no
//! tokenizer for the model (byte-level keys) compares its bytes with the
//! engine's text tokens: an engine with a real tokenizer differs, and says
//! so (the most common misconfiguration: `--tokenizer` forgotten); a
//! simulated engine keying bytes too agrees. The comparison
//! runs in a task of its own, never in the health round (an engine whose
//! `/tokenize` hangs would hold up every worker's probe).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvroute_shared::openai::{Endpoint, PromptRequest};
use serde_json::{Value, json};

use crate::metrics::WorkerLabel;
use crate::state::{AppState, now_ms};
use crate::workers::Worker;

/// How long after a failed comparison the next is tried.
const RETRY_AFTER: Duration = Duration::from_secs(60);

/// Words, digits, punctuation, accents, CJK, an emoji and runs of spaces:
/// a different vocabulary, normaliser or pre-tokenizer shows in it.
pub const PROBE_TEXT: &str = "kvroute checks its tokenizer: Hello, world!  12345 ünïcödé Ωμέγα 日本語 🙂\n\tdone.";

/// What one comparison found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every form the router could tokenize matched the engine's.
    Same,
    /// The text matched; the chat was not compared (the engine would not
    /// render it, or the router keys bytes): a template difference would
    /// not show.
    SameTextOnly,
    /// The text matched, and the engine renders chats the router cannot:
    /// it has the tokenizer but no chat template, so it keys chats by their
    /// plain text, which no engine caches.
    NoChatTemplateHere,
    /// `what` (a text completion, a chat) tokenized otherwise: the first
    /// position that differs, and the lengths; `bytes`: the router has no
    /// tokenizer of the model (its "tokens" are bytes).
    Differs { what: &'static str, at: usize, ours: usize, theirs: usize, bytes: bool },
    /// The engine does not tokenize for the router.
    NotCompared,
}

/// The two request bodies compared, for `model`.
fn probes(model: &str) -> [(&'static str, Endpoint, Value); 2] {
    [
        ("a text completion", Endpoint::Completions, json!({"model": model, "prompt": PROBE_TEXT})),
        (
            "a chat (the chat template)",
            Endpoint::ChatCompletions,
            json!({"model": model, "messages": [{"role": "user", "content": PROBE_TEXT}]}),
        ),
    ]
}

/// Starts the comparison for `worker` in a task of its own, unless it is
/// settled, under way, or failed less than [`RETRY_AFTER`] ago.
pub fn start(state: &Arc<AppState>, worker: &Arc<Worker>) {
    let live = &worker.live;
    // Its models are not known yet (a static worker learns them at its
    // probes): the next probe starts it.
    if worker.models.is_empty()
        || live.tokenizer_checked.load(Ordering::Relaxed)
        || now_ms() < live.tokenizer_retry_ms.load(Ordering::Relaxed)
        || live.tokenizer_checking.swap(true, Ordering::Relaxed)
    {
        return;
    }
    let (state, worker) = (state.clone(), worker.clone());
    tokio::spawn(async move {
        check_once(&state, &worker).await;
        worker.live.tokenizer_checking.store(false, Ordering::Relaxed);
    });
}

/// Compares the worker's engine's tokenization with the router's (a
/// settled answer marks the worker checked), logging and exporting a
/// difference.
pub async fn check_once(state: &AppState, worker: &Worker) {
    let Some(verdict) = compare(state, worker).await else {
        let retry = now_ms() + RETRY_AFTER.as_millis() as u64;
        worker.live.tokenizer_retry_ms.store(retry, Ordering::Relaxed);
        return;
    };
    worker.live.tokenizer_checked.store(true, Ordering::Relaxed);
    let gauge =
        || state.metrics.worker_tokenizer_mismatch.get_or_create(&WorkerLabel { worker: worker.id.to_string() });
    match verdict {
        Verdict::Same => {
            gauge().set(0);
            tracing::debug!(worker.id = %worker.id, "the engine tokenizes as the router does");
        }
        Verdict::SameTextOnly => {
            gauge().set(0);
            let model = worker.models.first().map_or("", |m| m.as_str());
            if state.tokenizers.for_model(model).is_exact() {
                tracing::info!(
                    worker.id = %worker.id,
                    "the engine tokenizes text as the router does; its chat template was not compared (the engine \
                     would not render the probe chat)"
                );
            } else {
                tracing::info!(worker.id = %worker.id, "the engine keys text by bytes, as this router does");
            }
        }
        Verdict::NoChatTemplateHere => {
            // A chat_template.jinja not copied, vLLM's --chat-template.
            gauge().set(1);
            tracing::warn!(
                worker.id = %worker.id,
                "the engine renders chats with a template the router does not have: chats are keyed by their \
                 plain text here, which no engine caches, and placed by load alone. Give --tokenizer a directory \
                 with the chat template (tokenizer_config.json's chat_template or chat_template.jinja)"
            );
        }
        Verdict::Differs { what, at, ours, theirs, bytes } => {
            gauge().set(1);
            let why = if bytes {
                "the router has no tokenizer for this worker's model and keys bytes, and the engine tokenizes: no \
                 text or chat prompt's prefix matches there (token-id prompts are keyed exactly), and those are \
                 routed by load alone"
            } else {
                "the engine tokenizes otherwise than the router: the router's block keys are not this engine's \
                 blocks, and its prefixes never match there"
            };
            tracing::error!(
                worker.id = %worker.id,
                what,
                first_difference = at,
                router_tokens = ours,
                engine_tokens = theirs,
                "{why}. Give the router the engine's tokenizer.json and chat template (--tokenizer, per model with \
                 --model-tokenizer)"
            );
        }
        Verdict::NotCompared => {}
    }
}

/// `None` when the engine could not be asked now (ask again later).
pub async fn compare(state: &AppState, worker: &Worker) -> Option<Verdict> {
    let model = worker.models.first().map(|m| m.as_str().to_owned())?;
    let tokenizer = state.tokenizers.for_model(&model).clone();
    let bytes = !tokenizer.is_exact();
    let mut compared = 0;
    // In byte mode only the text: a chat's plain rendering is never the
    // engine's, whatever it tokenizes with.
    for (what, endpoint, body) in probes(&model).into_iter().take(if bytes { 1 } else { 2 }) {
        let Ok(mut req) = PromptRequest::parse(endpoint, body.to_string().as_bytes()) else { continue };
        if let PromptRequest::Chat(c) = &mut req {
            c.defaults = state.config.chat_defaults.clone();
        }
        // No chat template here: the engine is asked anyway, and one that
        // renders the chat has a template the router lacks.
        let ours = tokenizer.prompt_tokens(&req);
        let theirs = match engine_tokens(state, worker, &body).await {
            Asked::Tokens(t) => t,
            Asked::Refused => break,
            Asked::Failed => return None,
        };
        let Ok(ours) = ours else {
            if endpoint == Endpoint::ChatCompletions {
                return Some(Verdict::NoChatTemplateHere);
            }
            continue;
        };
        if ours != theirs {
            let at = ours.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
            return Some(Verdict::Differs { what, at, ours: ours.len(), theirs: theirs.len(), bytes });
        }
        compared += 1;
    }
    Some(match compared {
        0 => Verdict::NotCompared,
        1 => Verdict::SameTextOnly,
        _ => Verdict::Same,
    })
}

enum Asked {
    Tokens(Vec<u32>),
    /// It answers, but not this (a 4xx but 408 and 429: no `/tokenize`,
    /// an API key; a 501).
    Refused,
    /// No answer, 408, 429, another 5xx or a body that is not vLLM's: ask
    /// again later.
    Failed,
}

/// The engine's `POST /tokenize` answer's `tokens`.
async fn engine_tokens(state: &AppState, worker: &Worker, body: &Value) -> Asked {
    let timeout = state.config.raw.health_check_timeout;
    let sent = state.client.post(format!("{}/tokenize", worker.url)).json(body).timeout(timeout).send().await;
    let Ok(resp) = sent else { return Asked::Failed };
    let status = resp.status().as_u16();
    if (400..500).contains(&status) && status != 408 && status != 429 || status == 501 {
        return Asked::Refused;
    }
    if !resp.status().is_success() {
        return Asked::Failed;
    }
    let Ok(Some(bytes)) =
        kvroute_shared::body::read_within(reqwest::Body::from(resp), kvroute_shared::body::MAX_ENGINE_METRICS_BYTES)
            .await
    else {
        return Asked::Failed;
    };
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    match serde_json::from_slice::<Answer>(&bytes) {
        Ok(a) => Asked::Tokens(a.tokens),
        Err(_) => Asked::Failed,
    }
}
