//! The parts of OpenAI completions / chat-completions requests that decide the
//! prompt's tokens, parsed as vLLM's OpenAI server parses them.
//!
//! The router forwards the client's body untouched; this view only tells it
//! which tokens the engine will see. Unknown fields are ignored (clients send
//! many), but the fields read here are type-checked, as vLLM's pydantic
//! models check them (lax mode: `16.0` is 16), and named on error.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::wire::{DecodeError, decode};

/// A completions `prompt`: vLLM accepts text, token ids, or a batch of either.
///
/// Read by hand (`PromptVisitor`), not as an untagged enum: serde buffers
/// an untagged value whole before trying each variant, about 30 bytes a
/// token id, so a batch near `max_body_bytes` took hundreds of megabytes
/// to parse. Token ids are read as pydantic's lax `int` reads them (`7.0`
/// is 7).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokenBatch(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

/// The most prompts one batch may hold: 64 × vLLM's default
/// (`VLLM_MAX_COMPLETION_PROMPTS`, 1,024). A batch's body may be up to
/// `max_body_bytes`, and each prompt costs its own allocation: millions of
/// empty strings took 8 × the body's size.
pub const MAX_BATCH: usize = 65_536;

impl<'de> serde::de::Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, a list of token ids, or a list of strings or of token-id lists")
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(s.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, s: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(s))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        use serde::de::Error;
        // The first item decides the shape; every other must match it (an
        // empty list is token ids, the first of vLLM's list types).
        let mut prompt = match seq.next_element::<Item>()? {
            None => return Ok(Prompt::Tokens(Vec::new())),
            Some(Item::Id(id)) => Prompt::Tokens(vec![id]),
            Some(Item::Text(t)) => Prompt::TextBatch(vec![t]),
            Some(Item::Ids(ids)) => Prompt::TokenBatch(vec![ids]),
        };
        let mixed = || A::Error::custom("a list must hold token ids, strings or token-id lists, not a mix");
        let too_many = || A::Error::custom(format!("a batch holds at most {MAX_BATCH} prompts"));
        loop {
            match (&mut prompt, seq.next_element::<Item>()?) {
                (_, None) => return Ok(prompt),
                (Prompt::Tokens(v), Some(Item::Id(id))) => v.push(id),
                (Prompt::TextBatch(v), Some(Item::Text(_))) if v.len() == MAX_BATCH => return Err(too_many()),
                (Prompt::TokenBatch(v), Some(Item::Ids(_))) if v.len() == MAX_BATCH => return Err(too_many()),
                (Prompt::TextBatch(v), Some(Item::Text(t))) => v.push(t),
                (Prompt::TokenBatch(v), Some(Item::Ids(ids))) => v.push(ids),
                _ => return Err(mixed()),
            }
        }
    }
}

/// One item of a prompt list.
enum Item {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Item;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a token id, a string or a list of token ids")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Item, E> {
                TokenId::visit_u64::<E>(n).map(Item::Id)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Item, E> {
                TokenId::visit_i64::<E>(n).map(Item::Id)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Item, E> {
                TokenId::visit_f64::<E>(n).map(Item::Id)
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Item, E> {
                Ok(Item::Text(s.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, s: String) -> Result<Item, E> {
                Ok(Item::Text(s))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(TokenId(id)) = seq.next_element()? {
                    ids.push(id);
                }
                Ok(Item::Ids(ids))
            }
        }
        d.deserialize_any(V)
    }
}

/// A token id, as pydantic's lax `int` reads one: a whole number, or a
/// float with no fraction.
struct TokenId(u32);

impl TokenId {
    fn visit_u64<E: serde::de::Error>(n: u64) -> Result<u32, E> {
        u32::try_from(n).map_err(|_| E::custom(format!("token id {n} is out of range")))
    }
    fn visit_i64<E: serde::de::Error>(n: i64) -> Result<u32, E> {
        u32::try_from(n).map_err(|_| E::custom(format!("token id {n} is out of range")))
    }
    fn visit_f64<E: serde::de::Error>(n: f64) -> Result<u32, E> {
        lax::whole(n).ok_or_else(|| E::custom(format!("token id {n} is not a whole number in range")))
    }
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<TokenId, E> {
                TokenId::visit_u64(n).map(TokenId)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<TokenId, E> {
                TokenId::visit_i64(n).map(TokenId)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<TokenId, E> {
                TokenId::visit_f64(n).map(TokenId)
            }
        }
        d.deserialize_any(V)
    }
}

/// `POST /v1/completions`, as far as the prompt goes.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// Absent or null: the engine's served (base) model, as vLLM takes it.
    #[serde(default, deserialize_with = "null_is_empty")]
    pub model: String,
    /// Absent or null with `prompt_embeds` (vLLM's `--enable-prompt-embeds`):
    /// nothing the router can key ([`CompletionRequest::prompt`] is empty).
    #[serde(default)]
    pub prompt: Option<Prompt>,
    /// Only whether it is there: base64 tensors the router does not read.
    #[serde(default)]
    pub prompt_embeds: Option<serde::de::IgnoredAny>,
    #[serde(default, deserialize_with = "lax::flag")]
    pub stream: bool,
    /// vLLM's per-request cache isolation; folded into the key root.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// vLLM's extension: the request's id when no `X-Request-Id` names one.
    #[serde(default)]
    pub request_id: Option<String>,
    /// Whether they are there ([`PromptRequest::skips_prefix_cache`]).
    #[serde(default)]
    pub prompt_logprobs: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    pub logprobs: Option<serde::de::IgnoredAny>,
    #[serde(default, deserialize_with = "lax::flag")]
    pub echo: bool,
    /// vLLM's extension; completions default to `true`.
    #[serde(default, deserialize_with = "lax::opt_bool")]
    pub add_special_tokens: Option<bool>,
    #[serde(default, deserialize_with = "lax::opt_u32")]
    pub max_tokens: Option<u32>,
    /// vLLM's: only the last (or, `truncation_side: "right"`, the first)
    /// this many prompt tokens reach the engine, and are what it caches.
    #[serde(default, deserialize_with = "lax::opt_truncation")]
    pub truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    pub truncation_side: Option<TruncationSide>,
    /// The paper's hint: how many leading tokens form the shared prefix.
    #[serde(default, deserialize_with = "lax::opt_u32")]
    pub prefix_len: Option<u32>,
}

/// What the engines' own flags add to every chat's rendering: set by the
/// router from its configuration, never by the body.
#[derive(Clone, Debug, Default)]
pub struct ChatDefaults {
    /// vLLM's `--default-chat-template-kwargs`: under the request's own
    /// `chat_template_kwargs`.
    pub kwargs: Option<std::sync::Arc<Map<String, Value>>>,
    /// vLLM's `--exclude-tools-when-tool-choice-none`: a request with
    /// `tool_choice: "none"` is rendered without its tools.
    pub exclude_tools_when_tool_choice_none: bool,
}

/// `POST /v1/chat/completions`, as far as the prompt goes.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default, deserialize_with = "null_is_empty")]
    pub model: String,
    pub messages: Vec<Map<String, Value>>,
    #[serde(default, deserialize_with = "lax::flag")]
    pub stream: bool,
    #[serde(default)]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub request_id: Option<String>,
    /// Whether they are there ([`PromptRequest::skips_prefix_cache`]).
    #[serde(default)]
    pub prompt_logprobs: Option<serde::de::IgnoredAny>,
    #[serde(default, deserialize_with = "lax::flag")]
    pub echo: bool,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub documents: Option<Vec<Value>>,
    /// vLLM's extensions, with vLLM's defaults.
    #[serde(default, deserialize_with = "lax::opt_bool")]
    pub add_generation_prompt: Option<bool>,
    #[serde(default, deserialize_with = "lax::flag")]
    pub continue_final_message: bool,
    #[serde(default, deserialize_with = "lax::opt_bool")]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM passes it to the template, and with it `enable_thinking`
    /// (false for `"none"`) unless `chat_template_kwargs` sets that.
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    #[serde(default, deserialize_with = "lax::opt_u32")]
    pub max_tokens: Option<u32>,
    #[serde(default, deserialize_with = "lax::opt_u32")]
    pub max_completion_tokens: Option<u32>,
    /// vLLM's: only the last (or, `truncation_side: "right"`, the first)
    /// this many prompt tokens reach the engine, and are what it caches.
    #[serde(default, deserialize_with = "lax::opt_truncation")]
    pub truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    pub truncation_side: Option<TruncationSide>,
    #[serde(default, deserialize_with = "lax::opt_u32")]
    pub prefix_len: Option<u32>,
    /// The engines' defaults (the router's configuration).
    #[serde(skip)]
    pub defaults: ChatDefaults,
}

impl ChatRequest {
    /// The tools the template gets: none for `tool_choice: "none"` under
    /// `--exclude-tools-when-tool-choice-none`.
    pub fn rendered_tools(&self) -> Option<&[Value]> {
        let none = self.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
        self.tools.as_deref().filter(|_| !(none && self.defaults.exclude_tools_when_tool_choice_none))
    }
}

/// vLLM's `truncation_side` (a `Literal`: anything else is its 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TruncationSide {
    Left,
    Right,
}

/// What a request's `truncate_prompt_tokens` keeps of its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// How many tokens reach the engine; `None` for all (no limit, or -1
    /// not yet read as the engine's input limit:
    /// [`PromptRequest::resolve_truncation`]).
    pub keep: Option<usize>,
    pub side: Option<TruncationSide>,
}

impl Truncation {
    fn new(n: Option<i64>, side: Option<TruncationSide>) -> Self {
        Truncation { keep: n.and_then(|n| usize::try_from(n).ok()), side }
    }

    /// `tokens` as the engine keeps them (vLLM's `_token_truncation`): the
    /// last N by default (vLLM loads its tokenizers with
    /// `truncation_side="left"`), the first N with `"right"`. Keyed whole, a
    /// truncated prompt's keys were of blocks no engine ever held. A text
    /// completion the tokenizer truncates keeps its special tokens: see
    /// `PromptTokenizer::prompt_tokens_within`.
    pub fn apply(self, mut tokens: Vec<u32>) -> Vec<u32> {
        let Some(n) = self.keep.filter(|n| *n < tokens.len()) else { return tokens };
        if self.side == Some(TruncationSide::Right) {
            tokens.truncate(n);
        } else {
            tokens.drain(..tokens.len() - n);
        }
        tokens
    }
}

impl CompletionRequest {
    /// The prompt; empty token ids for a request of prompt embeddings only.
    pub fn prompt(&self) -> &Prompt {
        static NONE: Prompt = Prompt::Tokens(Vec::new());
        self.prompt.as_ref().unwrap_or(&NONE)
    }

    pub fn truncation(&self) -> Truncation {
        Truncation::new(self.truncate_prompt_tokens, self.truncation_side)
    }
}

impl ChatRequest {
    pub fn truncation(&self) -> Truncation {
        Truncation::new(self.truncate_prompt_tokens, self.truncation_side)
    }
}

/// Scalars read as pydantic reads them in its default (lax) mode, as
/// vLLM's request models do: `16.0` and `"16"` are the integer 16, `"true"`,
/// `"yes"`, `1` are true. Strict types refused what the engine takes (a
/// client sending `"max_tokens": 16.0` got the router's 400).
mod lax {
    use serde::de::Error;
    use serde_json::Value;

    fn to_bool(v: &Value) -> Option<bool> {
        match v {
            Value::Bool(b) => Some(*b),
            Value::Number(n) => match n.as_f64() {
                Some(0.0) => Some(false),
                Some(1.0) => Some(true),
                _ => None,
            },
            Value::String(s) => match s.to_ascii_lowercase().as_str() {
                "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
                "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
                _ => None,
            },
            _ => None,
        }
    }

    fn to_u32(v: &Value) -> Option<u32> {
        let f = match v {
            Value::Number(n) => return n.as_u64().map_or_else(|| whole(n.as_f64()?), |u| u32::try_from(u).ok()),
            Value::String(s) => s.trim().parse::<f64>().ok()?,
            Value::Bool(b) => return Some(u32::from(*b)),
            _ => return None,
        };
        whole(f)
    }

    /// A scalar field's value: null, a bool, a number or a string. A list
    /// or a map is refused at its first byte, not parsed into a `Value`
    /// (about 30 × its size): a completion's body is let through up to
    /// `max_body_bytes`, and a scalar field was where 16 MiB of small values
    /// could still be built.
    fn scalar<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Value;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a boolean, a number, a string or null")
            }
            fn visit_unit<E: Error>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_none<E: Error>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_bool<E: Error>(self, b: bool) -> Result<Value, E> {
                Ok(Value::Bool(b))
            }
            fn visit_u64<E: Error>(self, n: u64) -> Result<Value, E> {
                Ok(Value::from(n))
            }
            fn visit_i64<E: Error>(self, n: i64) -> Result<Value, E> {
                Ok(Value::from(n))
            }
            fn visit_f64<E: Error>(self, n: f64) -> Result<Value, E> {
                Ok(Value::from(n))
            }
            fn visit_str<E: Error>(self, s: &str) -> Result<Value, E> {
                Ok(Value::from(s))
            }
        }
        d.deserialize_any(V)
    }

    pub(super) fn whole(f: f64) -> Option<u32> {
        (f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&f)).then_some(f as u32)
    }

    /// A bool; null or absent is false (vLLM: `Optional[bool] = False`).
    pub fn flag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(opt_bool(d)?.unwrap_or(false))
    }

    pub fn opt_bool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        match scalar(d)? {
            Value::Null => Ok(None),
            v => to_bool(&v).map(Some).ok_or_else(|| D::Error::custom(format!("expected a boolean, got {v}"))),
        }
    }

    /// vLLM's `truncate_prompt_tokens` (`ge=-1`): -1 is the engine's own
    /// input limit, which the caller supplies
    /// ([`super::PromptRequest::resolve_truncation`]).
    pub fn opt_truncation<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        match scalar(d)? {
            Value::Null => Ok(None),
            Value::Number(n) if n.as_i64() == Some(-1) => Ok(Some(-1)),
            Value::String(s) if s.trim() == "-1" => Ok(Some(-1)),
            v => to_u32(&v)
                .map(|n| Some(i64::from(n)))
                .ok_or_else(|| D::Error::custom(format!("expected a whole number of at least -1, got {v}"))),
        }
    }

    pub fn opt_u32<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match scalar(d)? {
            Value::Null => Ok(None),
            v => to_u32(&v).map(Some).ok_or_else(|| D::Error::custom(format!("expected a whole number, got {v}"))),
        }
    }
}

/// vLLM declares `model` optional: absent or null, the request is for its
/// served model (the router picks it: `""` here).
fn null_is_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// Either kind of request, told apart by the endpoint it came to. One per
/// request, parsed and dropped within its tokenizing job: the variants'
/// sizes (a chat's 376 bytes) do not matter.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum PromptRequest {
    Completion(CompletionRequest),
    Chat(ChatRequest),
}

/// Which OpenAI endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

impl PromptRequest {
    /// Parses a body sent to `endpoint`, naming the field at fault.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, DecodeError> {
        let req = match endpoint {
            Endpoint::Completions => {
                let c: CompletionRequest = decode(body)?;
                // vLLM's 400 too (`validate_prompt_and_prompt_embeds`).
                if c.prompt.is_none() && c.prompt_embeds.is_none() {
                    return Err(DecodeError::new("prompt", "either prompt or prompt_embeds must be given"));
                }
                PromptRequest::Completion(c)
            }
            Endpoint::ChatCompletions => {
                let chat: ChatRequest = decode(body)?;
                validate_messages(&chat.messages)?;
                PromptRequest::Chat(chat)
            }
        };
        Ok(req)
    }

    pub fn model(&self) -> &str {
        match self {
            PromptRequest::Completion(r) => &r.model,
            PromptRequest::Chat(r) => &r.model,
        }
    }

    /// vLLM computes the prompt of a request that asks for its logprobs
    /// from scratch, reading nothing from its prefix cache
    /// (`skip_reading_prefix_cache` whenever `prompt_logprobs` is set; 0.32
    /// sets it from `echo` too: in a chat, `echo` alone; in a completion,
    /// `echo` with `logprobs`).
    pub fn skips_prefix_cache(&self) -> bool {
        match self {
            PromptRequest::Completion(r) => r.prompt_logprobs.is_some() || (r.echo && r.logprobs.is_some()),
            PromptRequest::Chat(r) => r.prompt_logprobs.is_some() || r.echo,
        }
    }

    /// vLLM's `request_id` extension.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            PromptRequest::Completion(r) => r.request_id.as_deref(),
            PromptRequest::Chat(r) => r.request_id.as_deref(),
        }
    }

    pub fn cache_salt(&self) -> Option<&str> {
        match self {
            PromptRequest::Completion(r) => r.cache_salt.as_deref(),
            PromptRequest::Chat(r) => r.cache_salt.as_deref(),
        }
    }

    pub fn stream(&self) -> bool {
        match self {
            PromptRequest::Completion(r) => r.stream,
            PromptRequest::Chat(r) => r.stream,
        }
    }

    pub fn prefix_len(&self) -> Option<u32> {
        match self {
            PromptRequest::Completion(r) => r.prefix_len,
            PromptRequest::Chat(r) => r.prefix_len,
        }
    }

    /// Reads `truncate_prompt_tokens: -1` as vLLM 0.32 does, from the
    /// engine's input limit (`max_model_len`), which the caller knows: one
    /// token less when the request leaves room to generate (a completion's
    /// `max_tokens`, 16 when absent; a chat's `max_completion_tokens` or
    /// `max_tokens`, when given and not 0), kept back for its output
    /// (`TokenizeParams.max_truncation_tokens`). Read as the whole limit,
    /// every key of such a prompt was one token off the engine's.
    pub fn resolve_truncation(&mut self, limit: usize) {
        let (n, generates) = match self {
            PromptRequest::Completion(r) => (&mut r.truncate_prompt_tokens, r.max_tokens != Some(0)),
            PromptRequest::Chat(r) => {
                let budget = r.max_completion_tokens.or(r.max_tokens);
                (&mut r.truncate_prompt_tokens, budget.is_some_and(|b| b > 0))
            }
        };
        if *n == Some(-1) {
            let keep = if generates { limit.saturating_sub(1) } else { limit };
            *n = Some(i64::try_from(keep).unwrap_or(i64::MAX));
        }
    }

    /// What `truncate_prompt_tokens` and `truncation_side` ask for.
    pub fn truncation(&self) -> Truncation {
        match self {
            PromptRequest::Completion(r) => r.truncation(),
            PromptRequest::Chat(r) => r.truncation(),
        }
    }

    /// Is the prompt given as token ids (counted as they are, whatever the
    /// tokenizer)?
    pub fn has_token_ids(&self) -> bool {
        matches!(self, PromptRequest::Completion(c) if matches!(c.prompt(), Prompt::Tokens(_) | Prompt::TokenBatch(_)))
    }

    /// The longest of a batch's token-id prompts (vLLM runs each as a
    /// request of its own, and refuses any too long); `None` unless the
    /// prompt is a batch of token ids.
    pub fn longest_batched_token_ids(&self) -> Option<usize> {
        match self {
            PromptRequest::Completion(CompletionRequest { prompt: Some(Prompt::TokenBatch(b)), .. }) => {
                b.iter().map(Vec::len).max()
            }
            _ => None,
        }
    }

    /// Tokens the engine will generate at most, when the request says.
    pub fn max_tokens(&self) -> Option<u32> {
        match self {
            PromptRequest::Completion(r) => r.max_tokens,
            PromptRequest::Chat(r) => r.max_completion_tokens.or(r.max_tokens),
        }
    }
}

/// An empty list is the template's to judge, as vLLM leaves it (a ChatML
/// template renders it; others raise, and the router places the request by
/// its plain text): vLLM's `messages` has no minimum.
fn validate_messages(messages: &[Map<String, Value>]) -> Result<(), DecodeError> {
    for (i, m) in messages.iter().enumerate() {
        match m.get("role") {
            Some(Value::String(_)) => {}
            _ => return Err(DecodeError::new(format!("messages[{i}].role"), "must be a string")),
        }
        match m.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, p) in parts.iter().enumerate() {
                    if !p.is_object() && !p.is_string() {
                        return Err(DecodeError::new(
                            format!("messages[{i}].content[{j}]"),
                            "must be a content part object",
                        ));
                    }
                }
            }
            Some(_) => {
                return Err(DecodeError::new(
                    format!("messages[{i}].content"),
                    "must be a string, an array of content parts, or null",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_of_every_shape() {
        for (body, want) in [
            (r#"{"model":"m","prompt":"hi"}"#, Prompt::Text("hi".into())),
            (r#"{"model":"m","prompt":[1,2,3]}"#, Prompt::Tokens(vec![1, 2, 3])),
            (r#"{"model":"m","prompt":["a","b"]}"#, Prompt::TextBatch(vec!["a".into(), "b".into()])),
            (r#"{"model":"m","prompt":[[1],[2]]}"#, Prompt::TokenBatch(vec![vec![1], vec![2]])),
            // pydantic's lax `int`: a float with no fraction is a token id.
            (r#"{"model":"m","prompt":[1.0,2]}"#, Prompt::Tokens(vec![1, 2])),
            (r#"{"model":"m","prompt":[[1.0],[]]}"#, Prompt::TokenBatch(vec![vec![1], vec![]])),
            (r#"{"model":"m","prompt":[]}"#, Prompt::Tokens(vec![])),
            // Prompt embeddings alone (vLLM's `--enable-prompt-embeds`).
            (r#"{"model":"m","prompt_embeds":"AAAA"}"#, Prompt::Tokens(vec![])),
            (r#"{"model":"m","prompt":null,"prompt_embeds":["AAAA"]}"#, Prompt::Tokens(vec![])),
        ] {
            match PromptRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap() {
                PromptRequest::Completion(c) => assert_eq!(c.prompt(), &want),
                PromptRequest::Chat(_) => panic!("completion expected"),
            }
        }
    }

    /// `truncate_prompt_tokens` keeps what vLLM keeps: the last N tokens,
    /// the first N with `truncation_side: "right"`, all with -1 or none.
    #[test]
    fn truncation_keeps_what_the_engine_keeps() {
        let tokens: Vec<u32> = (1..=40).collect();
        let kept = |body: &str| {
            PromptRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap().truncation().apply(tokens.clone())
        };
        assert_eq!(kept(r#"{"prompt":"x","truncate_prompt_tokens":8}"#), (33..=40).collect::<Vec<_>>());
        let right = r#"{"prompt":"x","truncate_prompt_tokens":"8","truncation_side":"right"}"#;
        assert_eq!(kept(right), (1..=8).collect::<Vec<_>>());
        for all in [
            r#"{"prompt":"x","truncate_prompt_tokens":-1}"#,
            r#"{"prompt":"x","truncate_prompt_tokens":99}"#,
            r#"{"prompt":"x"}"#,
        ] {
            assert_eq!(kept(all), tokens, "{all}");
        }
        assert!(PromptRequest::parse(Endpoint::Completions, br#"{"prompt":"x","truncate_prompt_tokens":-2}"#).is_err());
        let middle = br#"{"prompt":"x","truncate_prompt_tokens":2,"truncation_side":"middle"}"#;
        assert!(PromptRequest::parse(Endpoint::Completions, middle).is_err(), "vLLM takes left or right only");
        let chat = br#"{"messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":3}"#;
        assert_eq!(
            PromptRequest::parse(Endpoint::ChatCompletions, chat).unwrap().truncation().apply(tokens.clone()),
            [38, 39, 40]
        );
    }

    /// `truncate_prompt_tokens: -1` keeps the engine's limit less the one
    /// token vLLM 0.32 holds back for a request's output, when it has an
    /// output budget (a completion's default 16 included).
    #[test]
    fn minus_one_keeps_one_token_less_than_the_limit_for_a_request_that_generates() {
        let keep = |endpoint, body: &str| {
            let mut req = PromptRequest::parse(endpoint, body.as_bytes()).unwrap();
            req.resolve_truncation(100);
            req.truncation().keep
        };
        let c = Endpoint::Completions;
        assert_eq!(keep(c, r#"{"prompt":"x","truncate_prompt_tokens":-1}"#), Some(99));
        assert_eq!(keep(c, r#"{"prompt":"x","truncate_prompt_tokens":-1,"max_tokens":0}"#), Some(100));
        let chat = |extra: &str| {
            format!(r#"{{"messages":[{{"role":"user","content":"x"}}],"truncate_prompt_tokens":-1{extra}}}"#)
        };
        assert_eq!(keep(Endpoint::ChatCompletions, &chat("")), Some(100), "a chat without a budget");
        assert_eq!(keep(Endpoint::ChatCompletions, &chat(r#","max_tokens":5"#)), Some(99));
        let zero = r#","max_completion_tokens":0,"max_tokens":5"#;
        assert_eq!(keep(Endpoint::ChatCompletions, &chat(zero)), Some(100), "max_completion_tokens first");
    }

    /// vLLM takes `"stream": null` as not streamed; so does the router.
    #[test]
    fn a_null_stream_is_not_streamed() {
        let c = PromptRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":"x","stream":null}"#).unwrap();
        assert!(!c.stream());
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":null}"#;
        assert!(!PromptRequest::parse(Endpoint::ChatCompletions, chat).unwrap().stream());
        let streamed = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}"#;
        assert!(PromptRequest::parse(Endpoint::ChatCompletions, streamed).unwrap().stream());
    }

    /// Scalars as pydantic's lax mode (vLLM's request models) takes them.
    #[test]
    fn scalars_are_read_as_vllm_reads_them() {
        let c =
            br#"{"model":"m","prompt":"x","stream":"true","max_tokens":16.0,"add_special_tokens":0,"prefix_len":"32"}"#;
        let PromptRequest::Completion(c) = PromptRequest::parse(Endpoint::Completions, c).unwrap() else { panic!() };
        assert_eq!(
            (c.stream, c.max_tokens, c.add_special_tokens, c.prefix_len),
            (true, Some(16), Some(false), Some(32))
        );
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":"8","add_generation_prompt":"no","continue_final_message":null}"#;
        let PromptRequest::Chat(c) = PromptRequest::parse(Endpoint::ChatCompletions, chat).unwrap() else { panic!() };
        assert_eq!(
            (c.max_completion_tokens, c.add_generation_prompt, c.continue_final_message),
            (Some(8), Some(false), false)
        );
    }

    #[test]
    fn bad_requests_name_the_field() {
        for body in [&br#"{"model":"m"}"#[..], br#"{"model":"m","prompt":null,"prompt_embeds":null}"#] {
            let e = PromptRequest::parse(Endpoint::Completions, body).unwrap_err();
            assert_eq!(e.field, "prompt", "{e}");
        }
        for bad in [r#"[1,"a"]"#, r#"["a",[1]]"#, r#"[1.5]"#, r#"[-1]"#, r#"[4294967296]"#, r#"[[1,"a"]]"#, "{}", "7"] {
            let body = format!(r#"{{"model":"m","prompt":{bad}}}"#);
            let e = PromptRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap_err();
            assert!(e.field.starts_with("prompt"), "{bad}: {e}");
        }
        let batch = format!(r#"{{"model":"m","prompt":[{}"x"]}}"#, "\"\",".repeat(MAX_BATCH));
        let e = PromptRequest::parse(Endpoint::Completions, batch.as_bytes()).unwrap_err();
        assert!(e.message.contains("at most 65536 prompts"), "{e}");
        // A scalar field given a list is refused at the list, not parsed into
        // a `Value` of ~30 × its size first.
        let e = PromptRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":"x","max_tokens":[[1],[2]]}"#)
            .unwrap_err();
        assert_eq!(e.field, "max_tokens");
        assert!(e.message.contains("sequence"), "refused at the list, not read whole: {e}");
        let e =
            PromptRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":"x","stream":"maybe"}"#).unwrap_err();
        assert_eq!(e.field, "stream");
        let e = PromptRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":"x","max_tokens":16.5}"#)
            .unwrap_err();
        assert_eq!(e.field, "max_tokens");
        let e = PromptRequest::parse(Endpoint::ChatCompletions, br#"{"model":"m"}"#).unwrap_err();
        assert!(e.message.contains("messages"), "{e}");
        // No minimum (vLLM's neither): the template judges an empty list.
        assert!(PromptRequest::parse(Endpoint::ChatCompletions, br#"{"model":"m","messages":[]}"#).is_ok());
        let e = PromptRequest::parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "messages[0].content");
        let e = PromptRequest::parse(Endpoint::ChatCompletions, br#"{"model":7,"messages":[{"role":"user"}]}"#)
            .unwrap_err();
        assert_eq!(e.field, "model");
        // Absent, null or empty: the served model's (vLLM's `Optional[str]`).
        for body in [&br#"{"prompt":"x"}"#[..], br#"{"model":null,"prompt":"x"}"#, br#"{"model":"","prompt":"x"}"#] {
            assert_eq!(PromptRequest::parse(Endpoint::Completions, body).unwrap().model(), "");
        }
    }
}
