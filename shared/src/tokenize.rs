//! Prompt tokenization: the token ids vLLM will compute for a request.
//!
//! The router keys requests by token ids, so it must tokenize exactly as the
//! engine does, or no key it computes matches a key the engine reports:
//! - completions: a text prompt is encoded *with* special tokens (vLLM's
//!   default, overridable by `add_special_tokens`); a token-id prompt passes
//!   through unchanged;
//! - chat: the model's Jinja chat template is rendered (HF semantics, see
//!   [`chat_template`]) and the text encoded *without* special tokens.
//!
//! Without a tokenizer, [`PromptTokenizer::Bytes`] keys the UTF-8 bytes of the
//! prompt (one "token" per byte). That cannot match a real engine's events; it
//! exists so a router can still place prefixes consistently (approximate index)
//! and so the simulator and router agree with no tokenizer files at all.

mod chat_messages;
pub mod chat_template;
mod fast_bpe;
mod segments;

use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};

use crate::openai::{ChatRequest, CompletionRequest, Prompt, PromptRequest, Truncation};
use chat_template::{ChatOptions, ChatTemplate, MAX_RENDERED_BYTES};
use segments::SegmentCache;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path} is not valid JSON: {source}")]
    Config {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("chat template error{}: {message}", line.map(|l| format!(" at template line {l}")).unwrap_or_default())]
    Template { line: Option<usize>, message: String },
    #[error("the model has no chat template (looked in tokenizer_config.json and chat_template.jinja)")]
    NoChatTemplate,
    #[error("tokenizer failed: {0}")]
    Encode(String),
    /// The prompt's text is longer than the caller accepts
    /// ([`PromptTokenizer::prompt_tokens_within`]).
    #[error("the prompt text exceeds {max_bytes} bytes")]
    TooLong { max_bytes: usize },
}

/// Tokenizes prompts for one served model.
#[derive(Debug)]
pub enum PromptTokenizer {
    /// A Hugging Face tokenizer (and chat template): exact, matches vLLM.
    Hf(Box<HfTokenizer>),
    /// One token per UTF-8 byte: approximate, matches nothing vLLM reports.
    Bytes,
}

/// A `tokenizer.json` plus what `tokenizer_config.json` says about chat.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
    /// The model's `tool_use` template, taken for a request that names
    /// tools, as HF's `get_chat_template` does (Hermes, Command-R).
    chat_tools: Option<ChatTemplate>,
    /// Present when segment-wise encoding is exact for this tokenizer.
    segments: Option<SegmentCache>,
    dir: PathBuf,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("dir", &self.dir)
            .field("chat", &self.chat)
            .field("segments", &self.segments)
            .finish()
    }
}

impl PromptTokenizer {
    /// Loads a model directory: `tokenizer.json` (required) and
    /// `tokenizer_config.json` / `chat_template.jinja` (optional; without a
    /// template, chat requests fail with [`TokenizeError::NoChatTemplate`]).
    pub fn load(dir: &Path) -> Result<Self, TokenizeError> {
        let tok_path = dir.join("tokenizer.json");
        let bytes =
            std::fs::read(&tok_path).map_err(|source| TokenizeError::Read { path: tok_path.clone(), source })?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TokenizeError::Load { path: tok_path.clone(), message: e.to_string() })?;

        let cfg_path = dir.join("tokenizer_config.json");
        let config: Map<String, Json> = match std::fs::read(&cfg_path) {
            Ok(b) => {
                serde_json::from_slice(&b).map_err(|source| TokenizeError::Config { path: cfg_path.clone(), source })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Map::new(),
            Err(source) => return Err(TokenizeError::Read { path: cfg_path, source }),
        };
        let sources = chat_template_sources(dir, &config)?;
        let template = |src: Option<String>| src.map(|s| ChatTemplate::new(s, special_tokens(&config))).transpose();
        let chat = template(sources.default)?;
        // A tool_use template this renderer cannot take leaves tool requests
        // to the default one (their keys approximate): it never stops a
        // router whose default template works.
        let chat_tools = template(sources.tool_use).unwrap_or_else(|e| {
            tracing::warn!(dir = %dir.display(), error = %e, "the model's tool_use chat template does not load here: requests with tools render with the default one");
            None
        });
        let segments = SegmentCache::new(&tokenizer);
        Ok(PromptTokenizer::Hf(Box::new(HfTokenizer { tokenizer, chat, chat_tools, segments, dir: dir.to_owned() })))
    }

    /// False for a tokenizer directory with no chat template: its model's
    /// chat requests cannot be rendered.
    pub fn has_chat_template(&self) -> bool {
        match self {
            PromptTokenizer::Hf(hf) => hf.chat.is_some(),
            PromptTokenizer::Bytes => true,
        }
    }

    /// True when ids equal the engine's (a real tokenizer is loaded).
    pub fn is_exact(&self) -> bool {
        matches!(self, PromptTokenizer::Hf(_))
    }

    /// The token ids the engine will compute for this request's prompt.
    /// A batch prompt is keyed by its first entry (the whole batch goes to one
    /// worker).
    pub fn prompt_tokens(&self, req: &PromptRequest) -> Result<Vec<u32>, TokenizeError> {
        self.prompt_tokens_within(req, MAX_RENDERED_BYTES)
    }

    /// [`Self::prompt_tokens`], refusing ([`TokenizeError::TooLong`]) a
    /// prompt whose text, as given or as the chat template renders it, is
    /// longer than `max_bytes`, before encoding it (a template can expand
    /// a small request hundreds of times).
    pub fn prompt_tokens_within(&self, req: &PromptRequest, max_bytes: usize) -> Result<Vec<u32>, TokenizeError> {
        let tokens = match req {
            PromptRequest::Completion(c) => self.completion_tokens(c, max_bytes)?,
            PromptRequest::Chat(c) => {
                let text = self.render_chat_within(c, Some(max_bytes))?;
                self.encode(&text, c.add_special_tokens.unwrap_or(false))?
            }
        };
        if let PromptRequest::Completion(c) = req
            && let Some(kept) = self.tokenizer_truncation(c, &tokens)?
        {
            return Ok(kept);
        }
        Ok(req.truncation().apply(tokens))
    }

    /// A text completion truncated without `truncation_side` is truncated
    /// by the tokenizer (vLLM passes `truncation=True, max_length=N`), which
    /// keeps the special tokens it adds (Llama's BOS) and cuts the text's:
    /// `[BOS] + the last N - 1`. Slicing the encoded prompt dropped the BOS,
    /// and every key missed. `None` where slicing is what the engine does.
    fn tokenizer_truncation(&self, c: &CompletionRequest, tokens: &[u32]) -> Result<Option<Vec<u32>>, TokenizeError> {
        let text = match c.prompt() {
            Prompt::Text(t) => t.as_str(),
            Prompt::TextBatch(ts) => ts.first().map_or("", String::as_str),
            Prompt::Tokens(_) | Prompt::TokenBatch(_) => return Ok(None),
        };
        let n = match c.truncation() {
            Truncation { keep: Some(n), side: None } if n < tokens.len() && c.add_special_tokens.unwrap_or(true) => n,
            _ => return Ok(None),
        };
        let plain = self.encode(text, false)?;
        let specials = tokens.len().saturating_sub(plain.len());
        // Where the text sits among the special tokens the tokenizer adds.
        let at = (0..=specials).find(|&p| tokens.get(p..p + plain.len()) == Some(plain.as_slice()));
        let (Some(at), true) = (at, specials > 0 && n >= specials) else { return Ok(None) };
        let keep = n - specials;
        let mut kept = tokens[..at].to_vec();
        kept.extend_from_slice(&plain[plain.len() - keep..]);
        kept.extend_from_slice(&tokens[at + plain.len()..]);
        Ok(Some(kept))
    }

    fn completion_tokens(&self, c: &CompletionRequest, max_bytes: usize) -> Result<Vec<u32>, TokenizeError> {
        let special = c.add_special_tokens.unwrap_or(true);
        let within = |t: &str| if t.len() > max_bytes { Err(TokenizeError::TooLong { max_bytes }) } else { Ok(()) };
        match c.prompt() {
            Prompt::Text(t) => within(t).and_then(|()| self.encode(t, special)),
            // Each of a batch's prompts is a request of its own for vLLM: each
            // is held to the bound, the first keyed.
            Prompt::TextBatch(ts) => {
                ts.iter().try_for_each(|t| within(t))?;
                self.encode(ts.first().map_or("", String::as_str), special)
            }
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::TokenBatch(b) => Ok(b.first().cloned().unwrap_or_default()),
        }
    }

    /// A chat's tokens when its template cannot render it (or there is
    /// none): its messages' plain text, encoded, held to `max_bytes`. Not the
    /// engine's tokens: a request routed by them is placed by load, not by
    /// what the engines cache. Truncated as the request asks.
    pub fn plain_chat_tokens(&self, c: &ChatRequest, max_bytes: usize) -> Result<Vec<u32>, TokenizeError> {
        let text = render_plain(&c.messages, c.add_generation_prompt.unwrap_or(true));
        if text.len() > max_bytes {
            return Err(TokenizeError::TooLong { max_bytes });
        }
        Ok(c.truncation().apply(self.encode(&text, false)?))
    }

    /// The chat prompt text, as `apply_chat_template(..., tokenize=False)`.
    pub fn render_chat(&self, c: &ChatRequest) -> Result<String, TokenizeError> {
        self.render_chat_within(c, None)
    }

    fn render_chat_within(&self, c: &ChatRequest, max_bytes: Option<usize>) -> Result<String, TokenizeError> {
        let opts = ChatOptions {
            max_bytes,
            tools: c.rendered_tools(),
            documents: c.documents.as_deref(),
            add_generation_prompt: c.add_generation_prompt.unwrap_or(true),
            continue_final_message: c.continue_final_message,
            kwargs: c.chat_template_kwargs.as_ref(),
            defaults: c.defaults.kwargs.as_deref(),
            reasoning_effort: c.reasoning_effort.as_deref(),
        };
        match self {
            PromptTokenizer::Hf(hf) => {
                // HF picks `tool_use` for a request with tools, the kwargs'
                // (or the engines' default kwargs') included (`render`).
                let kw_tools = |kw: Option<&serde_json::Map<String, serde_json::Value>>| {
                    kw.and_then(|k| k.get("tools")).is_some_and(chat_template::set)
                };
                let tools = opts.tools.is_some() || kw_tools(opts.kwargs) || kw_tools(opts.defaults);
                let tool_use = hf.chat_tools.as_ref().filter(|_| tools);
                tool_use.or(hf.chat.as_ref()).ok_or(TokenizeError::NoChatTemplate)?.render(&c.messages, &opts)
            }
            PromptTokenizer::Bytes => {
                let text = render_plain(&c.messages, opts.add_generation_prompt);
                match max_bytes {
                    Some(max_bytes) if text.len() > max_bytes => Err(TokenizeError::TooLong { max_bytes }),
                    _ => Ok(text),
                }
            }
        }
    }

    /// Encodes the whole text at once, bypassing the segment cache (the
    /// reference the cache is tested against).
    pub fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match self {
            PromptTokenizer::Hf(hf) => hf
                .tokenizer
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            PromptTokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
        }
    }

    /// True when repeated chat segments are served from a cache.
    pub fn caches_segments(&self) -> bool {
        matches!(self, PromptTokenizer::Hf(hf) if hf.segments.is_some())
    }

    /// Encodes text; `add_special_tokens` as in HF `encode`. Repeated
    /// segments, and the chunks of long texts, come from the segment cache.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let err = |e: tokenizers::Error| TokenizeError::Encode(e.to_string());
        match self {
            PromptTokenizer::Hf(hf) => match &hf.segments {
                Some(cache) if !add_special_tokens => cache.encode(&hf.tokenizer, text).map_err(err),
                Some(cache) => match cache.encode_with_special(&hf.tokenizer, text) {
                    Some(ids) => ids.map_err(err),
                    None => self.encode_uncached(text, true),
                },
                None => self.encode_uncached(text, add_special_tokens),
            },
            PromptTokenizer::Bytes => self.encode_uncached(text, add_special_tokens),
        }
    }

    /// True when cold ASCII text is split and BPE-encoded without HF's
    /// pipeline (checked exact when the tokenizer loaded).
    pub fn fast_path(&self) -> bool {
        matches!(self, PromptTokenizer::Hf(hf) if hf.segments.as_ref().is_some_and(SegmentCache::fast_path))
    }

    /// True when long texts are cut at line starts and cached chunk by chunk.
    pub fn caches_lines(&self) -> bool {
        matches!(self, PromptTokenizer::Hf(hf) if hf.segments.as_ref().is_some_and(SegmentCache::chunks_lines))
    }
}

/// A model's chat templates: the default, and the one for requests that
/// name tools when the model has one of its own.
struct TemplateSources {
    default: Option<String>,
    tool_use: Option<String>,
}

/// Where HF's tokenizer (hence vLLM) finds them: a `chat_template.jinja`
/// file beside the config replaces the config's `chat_template` (a string,
/// or a list of named templates: "default", else the first, and
/// "tool_use"), and `additional_chat_templates/tool_use.jinja` is the
/// tool_use one. The config was read first: a directory holding both
/// rendered the other one.
fn chat_template_sources(dir: &Path, config: &Map<String, Json>) -> Result<TemplateSources, TokenizeError> {
    let file = |path: PathBuf| match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::Read { path, source }),
    };
    let (mut default, mut tool_use) = (None, None);
    match config.get("chat_template") {
        Some(Json::String(s)) => default = Some(s.clone()),
        Some(Json::Array(named)) => {
            let source = |name: &str| {
                let t = named.iter().find(|t| t.get("name").and_then(Json::as_str) == Some(name));
                t.and_then(|t| t.get("template")).and_then(Json::as_str).map(str::to_owned)
            };
            default = source("default")
                .or_else(|| named.first().and_then(|t| t.get("template")).and_then(Json::as_str).map(str::to_owned));
            tool_use = source("tool_use");
        }
        _ => {}
    }
    // The file replaces the config's templates, named ones included, as HF
    // loads them.
    let jinja = file(dir.join("chat_template.jinja"))?;
    if jinja.is_some() {
        tool_use = None;
    }
    Ok(TemplateSources {
        default: jinja.or(default),
        tool_use: file(dir.join("additional_chat_templates").join("tool_use.jinja"))?.or(tool_use),
    })
}

/// HF passes its special-tokens map to the template: `bos_token`, `eos_token`,
/// `unk_token`, `pad_token` as strings (an AddedToken object gives its
/// `content`), and `additional_special_tokens`.
fn special_tokens(config: &Map<String, Json>) -> Map<String, Json> {
    let mut out = Map::new();
    for name in ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"] {
        let s = match config.get(name) {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(str::to_owned),
            _ => None,
        };
        if let Some(s) = s {
            out.insert(name.into(), Json::String(s));
        }
    }
    if let Some(extra) = config.get("additional_special_tokens") {
        out.insert("additional_special_tokens".into(), extra.clone());
    }
    out
}

/// The approximate mode's chat rendering: role and text, nothing model-specific.
fn render_plain(messages: &[Map<String, Json>], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        let role = m.get("role").and_then(Json::as_str).unwrap_or("");
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        match m.get("content") {
            Some(Json::String(s)) => out.push_str(s),
            Some(Json::Array(parts)) => {
                let texts: Vec<&str> = parts.iter().filter_map(|p| p.get("text").and_then(Json::as_str)).collect();
                out.push_str(&texts.join("\n"));
            }
            _ => {}
        }
        out.push('\n');
    }
    if add_generation_prompt {
        out.push_str("<|assistant|>\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::Endpoint;

    #[test]
    fn missing_tokenizer_names_the_path() {
        let err = PromptTokenizer::load(Path::new("/nonexistent/model")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/model/tokenizer.json"), "{err}");
    }

    #[test]
    fn corrupt_tokenizer_names_the_path() {
        let dir = std::env::temp_dir().join(format!("kvroute-bad-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), b"{\"not\": \"a tokenizer\"}").unwrap();
        let err = PromptTokenizer::load(&dir).unwrap_err();
        assert!(matches!(err, TokenizeError::Load { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The router warns at start for a model whose chat requests it cannot
    /// render: GPT-2's directory has no chat template, Qwen3's has one.
    #[test]
    fn a_directory_without_a_chat_template_says_so() {
        for (name, has) in [("gpt2", false), ("qwen3", true)] {
            let dir = crate::testdata::tokenizer_dir(name).unwrap_or_else(|why| panic!("no {name} tokenizer: {why}"));
            assert_eq!(PromptTokenizer::load(&dir).unwrap().has_chat_template(), has, "{name}");
        }
    }

    /// The template HF's tokenizer (hence vLLM) renders: `chat_template.jinja`
    /// over the config's, and a model's `tool_use` template for a request
    /// naming tools. The config's default was always taken.
    #[test]
    fn templates_are_chosen_as_hf_chooses_them() {
        let gpt2 = crate::testdata::tokenizer_dir("gpt2").unwrap_or_else(|why| panic!("no gpt2 tokenizer: {why}"));
        let dir = std::env::temp_dir().join(format!("kvroute-templates-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
        std::fs::copy(gpt2.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let named = serde_json::json!({"chat_template": [
            {"name": "default", "template": "D{{ messages | length }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
        ]});
        std::fs::write(dir.join("tokenizer_config.json"), named.to_string()).unwrap();
        let render = |body: &str| {
            let PromptRequest::Chat(chat) = PromptRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap()
            else {
                unreachable!()
            };
            PromptTokenizer::load(&dir).unwrap().render_chat(&chat).unwrap()
        };
        let plain = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let tools = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
        assert_eq!((render(plain), render(tools)), ("D1".to_owned(), "T1".to_owned()));
        std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
        assert_eq!((render(plain), render(tools)), ("J".to_owned(), "J".to_owned()), "the file replaces the list");
        std::fs::write(dir.join("additional_chat_templates").join("tool_use.jinja"), "U").unwrap();
        assert_eq!((render(plain), render(tools)), ("J".to_owned(), "U".to_owned()), "the files win");
        std::fs::write(dir.join("additional_chat_templates").join("tool_use.jinja"), "{% if %}").unwrap();
        assert_eq!(render(tools), "J", "a tool_use template that does not load is left out");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A tokenizer that adds a BOS (Llama's) keeps it when it truncates a
    /// text prompt (`[BOS] + the last N - 1`); slicing dropped it. With a
    /// `truncation_side`, vLLM slices the encoded prompt, BOS and all.
    #[test]
    fn truncation_keeps_the_bos_the_tokenizer_adds() {
        let gpt2 = crate::testdata::tokenizer_dir("gpt2").unwrap_or_else(|why| panic!("no gpt2 tokenizer: {why}"));
        let dir = std::env::temp_dir().join(format!("kvroute-bos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut tok: Json = serde_json::from_slice(&std::fs::read(gpt2.join("tokenizer.json")).unwrap()).unwrap();
        let bos = serde_json::json!({"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}});
        tok["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [50256], "tokens": ["<|endoftext|>"]}},
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let t = PromptTokenizer::load(&dir).unwrap();
        let tokens = |body: &str| {
            t.prompt_tokens(&PromptRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap()).unwrap()
        };
        let whole = tokens(r#"{"prompt":"one two three four five six"}"#);
        assert_eq!(whole.len(), 7, "BOS and six words: {whole:?}");
        assert_eq!(whole[0], 50256);
        let cut = tokens(r#"{"prompt":"one two three four five six","truncate_prompt_tokens":4}"#);
        assert_eq!(cut, [&whole[..1], &whole[4..]].concat(), "the BOS and the last three");
        let sliced =
            tokens(r#"{"prompt":"one two three four five six","truncate_prompt_tokens":4,"truncation_side":"left"}"#);
        assert_eq!(sliced, whole[3..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn byte_mode_is_deterministic_and_passes_token_ids_through() {
        let t = PromptTokenizer::Bytes;
        let req = PromptRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":"ab"}"#).unwrap();
        assert_eq!(t.prompt_tokens(&req).unwrap(), vec![97, 98]);
        let req = PromptRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":[7,8,9]}"#).unwrap();
        assert_eq!(t.prompt_tokens(&req).unwrap(), vec![7, 8, 9]);
        let req = PromptRequest::parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(
            t.render_chat(match &req {
                PromptRequest::Chat(c) => c,
                _ => unreachable!(),
            })
            .unwrap(),
            "<|user|>\nhi\n<|assistant|>\n"
        );
    }
}
