//! Renders a model's Jinja chat template with Hugging Face `apply_chat_template`
//! semantics, as vLLM does before tokenizing a chat request.
//!
//! HF renders with `jinja2` (`trim_blocks`, `lstrip_blocks`, loop controls) and
//! adds `raise_exception`, `strftime_now` and a `tojson` that is Python's
//! `json.dumps` (`", "`/`": "` separators, no ASCII escaping, no HTML
//! escaping) — minijinja's own `tojson` is compact and HTML-safe, so it is
//! replaced. Python string methods (`startswith`, `split`, `strip`, …) come from
//! minijinja-contrib's pycompat layer.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

use super::TokenizeError;
use super::chat_messages::{self, ContentFormat};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, … from `tokenizer_config.json`.
    special_tokens: Map<String, Json>,
    /// How the template takes a message's content, as vLLM detects it.
    format: ContentFormat,
    /// Does the template name the developer role (else vLLM makes developer
    /// messages system ones)?
    developer_role: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("format", &self.format).finish()
    }
}

/// What `apply_chat_template` receives besides the messages.
#[derive(Debug, Default)]
pub struct ChatOptions<'a> {
    pub tools: Option<&'a [Json]>,
    pub documents: Option<&'a [Json]>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub kwargs: Option<&'a Map<String, Json>>,
    /// The engines' `--default-chat-template-kwargs`, under `kwargs`.
    pub defaults: Option<&'a Map<String, Json>>,
    /// The request's `reasoning_effort`.
    pub reasoning_effort: Option<&'a str>,
    /// The most the rendered prompt may take, bytes (`None`:
    /// [`MAX_RENDERED_BYTES`]); past it the render stops with
    /// [`TokenizeError::TooLong`].
    pub max_bytes: Option<usize>,
}

impl ChatTemplate {
    pub fn new(source: String, special_tokens: Map<String, Json>) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        let syntax =
            SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(|e| template_error(&e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_formatter(python_formatter);
        let format = chat_messages::detect_format(&source);
        let developer_role = chat_messages::names_developer_role(&source);
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| template_error(&e))?;
        Ok(ChatTemplate { env, special_tokens, format, developer_role })
    }

    /// Renders `messages` to the prompt text.
    pub fn render(&self, messages: &[Map<String, Json>], opts: &ChatOptions<'_>) -> Result<String, TokenizeError> {
        let mut messages = chat_messages::prepare(messages, self.format, self.developer_role);
        // What `continue_final_message` continues, marked where it ends.
        let continued = if opts.continue_final_message { Some(mark_final_message(&mut messages)?) } else { None };
        let mut ctx = self.special_tokens.clone();
        ctx.insert("messages".into(), Json::Array(messages));
        let tools = opts.tools.map(|t| Json::Array(t.iter().map(chat_messages::tool).collect()));
        ctx.insert("tools".into(), tools.unwrap_or(Json::Null));
        ctx.insert("documents".into(), opts.documents.map_or(Json::Null, |d| Json::Array(d.to_vec())));
        ctx.insert("add_generation_prompt".into(), Json::Bool(opts.add_generation_prompt));
        if let Some(defaults) = opts.defaults {
            // vLLM 0.32 (`ChatParams.with_defaults`): the server's kwargs go
            // under the request's, and under its tools and documents where
            // it has them; they are taken whole (`merge_kwargs` unsets only
            // the request's null and "auto").
            for (k, v) in defaults.iter().filter(|(k, _)| !RESERVED.contains(&k.as_str())) {
                if (k == "tools" && opts.tools.is_some()) || (k == "documents" && opts.documents.is_some()) {
                    continue;
                }
                ctx.insert(k.clone(), v.clone());
            }
        }
        if let Some(kw) = opts.kwargs {
            // vLLM 0.32 (`build_chat_params`, then `ChatParams.with_defaults`
            // through `merge_kwargs`): a kwarg that is null or "auto" is
            // unset; the request's `add_generation_prompt` (and `messages`,
            // which `apply_chat_template` takes once) win over the kwargs';
            // its `documents` win where given; a kwarg's `tools` win over the
            // request's (taken as given, not re-dumped).
            for (k, v) in kw.iter().filter(|(k, v)| set(v) && !RESERVED.contains(&k.as_str())) {
                if k == "documents" && opts.documents.is_some() {
                    continue;
                }
                ctx.insert(k.clone(), v.clone());
            }
        }
        // vLLM 0.32 (`ChatCompletionRequest.build_chat_params`): the effort
        // overrides a kwarg of that name, and turns thinking off for "none"
        // (on otherwise) unless the kwargs say which.
        if let Some(effort) = opts.reasoning_effort {
            ctx.insert("reasoning_effort".into(), Json::String(effort.into()));
            if !opts.kwargs.is_some_and(|kw| kw.contains_key("enable_thinking")) {
                ctx.insert("enable_thinking".into(), Json::Bool(effort != "none"));
            }
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| template_error(&e))?;
        let limit = opts.max_bytes.unwrap_or(MAX_RENDERED_BYTES).min(MAX_RENDERED_BYTES);
        let mut out = Capped { text: Vec::new(), limit, over: false };
        let rendered = tmpl.render_captured_to(Value::from(minijinja::value::Serde(&ctx)), &mut out).map(drop);
        if out.over {
            return Err(TokenizeError::TooLong { max_bytes: limit });
        }
        rendered.map_err(|e| template_error(&e))?;
        let mut out =
            String::from_utf8(out.text).map_err(|e| TokenizeError::Template { line: None, message: e.to_string() })?;
        if let Some(text) = continued {
            cut_at_final_message_end(&mut out, &text)?;
        }
        Ok(out)
    }
}

/// What HF transformers 5 appends to the final message's text to find where
/// it ends in the rendered prompt (`continue_final_message_tag`).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// HF transformers 5 (vLLM 0.32's): with `continue_final_message`, the final
/// message's text (its last text part, in a list of parts) gets
/// [`CONTINUE_TAG`] appended; its original text is returned.
fn mark_final_message(messages: &mut [Json]) -> Result<String, TokenizeError> {
    let no_text = || TokenizeError::Template {
        line: None,
        message: "continue_final_message: the final message has no text to continue".into(),
    };
    let text = match messages.last_mut().and_then(|m| m.get_mut("content")) {
        Some(Json::String(t)) => t,
        Some(Json::Array(parts)) => {
            let texts = parts.iter_mut().rev().filter_map(|p| p.get_mut("text"));
            match texts.into_iter().next() {
                Some(Json::String(t)) => t,
                _ => return Err(no_text()),
            }
        }
        _ => return Err(no_text()),
    };
    let original = text.clone();
    text.push_str(CONTINUE_TAG);
    Ok(original)
}

/// HF transformers 5: the prompt ends where the tag begins, so the model
/// continues the final message, its trailing whitespace kept when the
/// template kept the tag's; where the template trimmed the message, the
/// whitespace before the tag goes too. (Transformers 4 cut after the
/// message's trimmed text, dropping trailing whitespace and, for an empty
/// message, keeping the whole render.)
fn cut_at_final_message_end(out: &mut String, text: &str) -> Result<(), TokenizeError> {
    let tag = CONTINUE_TAG.trim();
    let Some(at) = out.rfind(tag).filter(|_| out.contains(text.trim())) else {
        return Err(TokenizeError::Template {
            line: None,
            message: "continue_final_message: the final message's content is not in the rendered prompt".into(),
        });
    };
    let spaced = out[at..].starts_with(CONTINUE_TAG);
    out.truncate(at);
    if !spaced {
        out.truncate(out.trim_end().len());
    }
    Ok(())
}

/// Prints values as Jinja2 on Python does: `None`, `True`, `False`.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &mut minijinja::State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    if value.is_none() {
        return out.write_str("None").map_err(Error::from);
    }
    if value.kind() == minijinja::value::ValueKind::Bool {
        return out.write_str(if value.is_true() { "True" } else { "False" }).map_err(Error::from);
    }
    minijinja::escape_formatter(out, state, value)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    // HF's `tojson(x, ensure_ascii=False, indent=None, separators=None,
    // sort_keys=False)`: Kimi's templates dump tools with (',', ':').
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be (item, key)"));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let json =
        serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    let opts =
        Dumps { indent, sort: sort_keys.unwrap_or(false), item_sep, key_sep, ascii: ensure_ascii.unwrap_or(false) };
    python_dumps(&json, &opts, 0, &mut out);
    if out.len() > MAX_RENDERED_BYTES {
        let message = format!("tojson: the text exceeds {MAX_RENDERED_BYTES} bytes");
        return Err(Error::new(ErrorKind::InvalidOperation, message));
    }
    Ok(Value::from_safe_string(out))
}

/// `json.dumps`'s options, as a template passes them.
struct Dumps {
    indent: Option<usize>,
    sort: bool,
    item_sep: String,
    key_sep: String,
    /// `ensure_ascii`: every non-ASCII character as `\uXXXX`.
    ascii: bool,
}

/// A JSON string as `json.dumps` writes it.
fn python_string(s: &str, ascii: bool, out: &mut String) {
    let quoted = Json::String(s.to_owned()).to_string();
    // Python's ASCII encoder escapes DEL too.
    if !ascii || (s.is_ascii() && !s.contains('\x7f')) {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() && c != '\x7f' {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
}

fn python_dumps(v: &Json, opts: &Dumps, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = opts.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = opts.item_sep.as_str();
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                // Past the cap the caller refuses the text: stop building it.
                if out.len() > MAX_RENDERED_BYTES {
                    return;
                }
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_dumps(item, opts, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if opts.sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if out.len() > MAX_RENDERED_BYTES {
                    return;
                }
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_string(k, opts.ascii, out);
                out.push_str(&opts.key_sep);
                python_dumps(item, opts, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Json::Number(n) if n.is_f64() => out.push_str(&python_float(n.as_f64().unwrap_or_default())),
        Json::String(s) => python_string(s, opts.ascii, out),
        // Other scalars, `[]` and `{}` print as serde_json prints them, which
        // for strings (escapes) and integers matches Python.
        other => out.push_str(&other.to_string()),
    }
}

/// Python's `repr` of a float, as `json.dumps` prints it: the shortest digits
/// that read back the same, fixed between 1e-4 and 1e16 (`0.0001`,
/// `123.0`), in exponent form outside (`1e-05`, `1.5e+16`). serde_json
/// printed `0.00001` and `1e16`: a tool schema's `"minimum": 1e-5` or a tool
/// call's arguments rendered differently from the engine's from there on.
fn python_float(f: f64) -> String {
    // Rust's `{:e}` is the shortest round-trip form: `-1.5e-7`, `1e16`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if digits.len() <= point as usize {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// Template variables the request itself sets; `chat_template_kwargs` cannot
/// replace them.
const RESERVED: [&str; 2] = ["messages", "add_generation_prompt"];

/// A kwarg vLLM passes on (`merge_kwargs` drops null and "auto").
pub fn set(v: &Json) -> bool {
    !matches!(v, Json::Null) && v.as_str() != Some("auto")
}

/// The most a template may render: ~16 M tokens, beyond any model's
/// context. A template that indents JSON (`tojson(indent=4)` of tools) can
/// expand a body of deeply nested arrays hundreds of times: a 4 MB request
/// rendered to a gigabyte before the token limit was checked.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// The rendered text, refused past `limit` bytes.
struct Capped {
    text: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("the rendered prompt is too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub(super) fn template_error(e: &Error) -> TokenizeError {
    let mut message = e.kind().to_string();
    if let Some(detail) = e.detail() {
        message = format!("{message}: {detail}");
    }
    TokenizeError::Template { line: e.line(), message }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, msgs: Json) -> Result<String, TokenizeError> {
        let t = ChatTemplate::new(src.into(), Map::new())?;
        let msgs: Vec<Map<String, Json>> = serde_json::from_value(msgs).unwrap();
        t.render(&msgs, &ChatOptions { add_generation_prompt: true, ..Default::default() })
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let out = render(
            "{% set x = messages[0].tool_calls[0].function.arguments %}{{ x | tojson }}|{{ x | tojson(indent=2) }}",
            serde_json::json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": {"b": [1, 2.5, "é<"], "a": {}}}}]}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é<\"], \"a\": {}}|{\n  \"b\": [\n    1,\n    2.5,\n    \"é<\"\n  ],\n  \"a\": {}\n}"
        );
    }

    /// HF's other `tojson` arguments: `separators` (Kimi dumps its tools
    /// with `(',', ':')`) and `ensure_ascii`; the expected strings are
    /// Python's `json.dumps`.
    #[test]
    fn tojson_takes_separators_and_ensure_ascii() {
        let args = serde_json::json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": {"a": [1, 2], "é": "ü🙂"}}}]}]);
        let x = "{% set x = messages[0].tool_calls[0].function.arguments %}";
        let out = render(&format!("{x}{{{{ x | tojson(separators=(',', ':')) }}}}"), args.clone()).unwrap();
        assert_eq!(out, "{\"a\":[1,2],\"é\":\"ü🙂\"}");
        let out = render(&format!("{x}{{{{ x | tojson(ensure_ascii=True) }}}}"), args.clone()).unwrap();
        assert_eq!(out, "{\"a\": [1, 2], \"\\u00e9\": \"\\u00fc\\ud83d\\ude42\"}");
        let del =
            serde_json::json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": {"d": "a\u{7f}b"}}}]}]);
        let out = render(&format!("{x}{{{{ x | tojson(ensure_ascii=True) }}}}"), del).unwrap();
        assert_eq!(out, "{\"d\": \"a\\u007fb\"}");
        let out = render(&format!("{x}{{{{ x | tojson(indent=1, separators=(',', ': ')) }}}}"), args).unwrap();
        assert_eq!(out, "{\n \"a\": [\n  1,\n  2\n ],\n \"é\": \"ü🙂\"\n}");
    }

    /// Floats as Python's `repr` (hence `json.dumps`) prints them; the
    /// expected strings are Python 3's.
    #[test]
    fn floats_print_as_python_prints_them() {
        let cases = [
            (0.00001, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123.0, "123.0"),
            (2.5, "2.5"),
            (-1.5e-7, "-1.5e-07"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (123456.789, "123456.789"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float(f), want, "{f:e}");
        }
        let out = render(
            "{{ messages[0].tool_calls[0].function.arguments | tojson }}",
            serde_json::json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": {"lr": 1e-6, "n": 3}}}]}]),
        )
        .unwrap();
        assert_eq!(out, "{\"lr\": 1e-06, \"n\": 3}");
    }

    /// `continue_final_message` ends the prompt where HF transformers 5 does:
    /// at a tag appended to the final message, its trailing whitespace kept
    /// (dropped where the template trims the message), and right after the
    /// final message's header when it is empty. Transformers 4's cut (after
    /// the trimmed text) dropped the whitespace, and kept an empty
    /// message's whole render.
    #[test]
    fn a_continued_message_ends_where_transformers_5_cuts() {
        let render = |template: &str, content: Json| {
            let t = ChatTemplate::new(template.into(), Map::new()).unwrap();
            let msgs: Vec<Map<String, Json>> = serde_json::from_value(serde_json::json!([
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": content}
            ]))
            .unwrap();
            t.render(&msgs, &ChatOptions { continue_final_message: true, ..Default::default() }).unwrap()
        };
        let keeps = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}";
        assert_eq!(render(keeps, Json::from("```json\n")), "<user>hi</s><assistant>```json\n");
        assert_eq!(render(keeps, Json::from("")), "<user>hi</s><assistant>");
        let parts = serde_json::json!([{"type": "text", "text": "a "}, {"type": "text", "text": "b "}]);
        let joined = "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}</s>{% endfor %}";
        assert_eq!(render(joined, parts), "<user>hi</s><assistant>a b ", "the last text part is continued");
        let trims = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}";
        assert_eq!(render(trims, Json::from("Hello  ")), "<user>hi</s><assistant>Hello");
    }

    /// `chat_template_kwargs` set the template's other variables as vLLM
    /// 0.32 merges them: never the request's own messages (which
    /// `max_messages` checked); their `tools` win over the request's, their
    /// `documents` only where it has none; null and "auto" are unset. The
    /// kwargs' tools and documents were dropped, and every block missed.
    #[test]
    fn template_kwargs_merge_as_vllms() {
        let t = ChatTemplate::new(
            "{{ messages | length }} {{ tools }} {{ documents }} {{ flag }} {{ gone is defined }} {{ auto is defined }}"
                .into(),
            Map::new(),
        )
        .unwrap();
        let msgs: Vec<Map<String, Json>> = serde_json::from_value(serde_json::json!([{"role": "user"}])).unwrap();
        let kwargs: Map<String, Json> = serde_json::from_value(serde_json::json!({
            "messages": [1, 2, 3], "tools": ["x"], "documents": ["d"], "flag": true, "gone": null, "auto": "auto"
        }))
        .unwrap();
        let (tools, docs) = (vec![serde_json::json!({"type": "function"})], vec![serde_json::json!("mine")]);
        let render = |tools: Option<&[Json]>, documents: Option<&[Json]>| {
            t.render(&msgs, &ChatOptions { kwargs: Some(&kwargs), tools, documents, ..Default::default() }).unwrap()
        };
        assert_eq!(render(None, None), "1 ['x'] ['d'] True False False");
        assert_eq!(render(Some(&tools), Some(&docs)), "1 ['x'] ['mine'] True False False");
    }

    /// The engines' `--default-chat-template-kwargs` go under the request's
    /// kwargs, tools and documents (vLLM 0.32's `ChatParams.with_defaults`),
    /// and under `reasoning_effort`'s `enable_thinking`. Without them a
    /// Qwen3 served with `{"enable_thinking": false}` missed the last block
    /// of every chat.
    #[test]
    fn the_engines_default_kwargs_go_under_the_requests() {
        let t =
            ChatTemplate::new("{{ flag }} {{ other }} {{ tools }} {{ enable_thinking }}".into(), Map::new()).unwrap();
        let msgs: Vec<Map<String, Json>> = serde_json::from_value(serde_json::json!([{"role": "user"}])).unwrap();
        let map = |v: Json| -> Map<String, Json> { serde_json::from_value(v).unwrap() };
        let defaults = map(serde_json::json!({"flag": "d", "other": "d", "tools": ["dt"], "enable_thinking": false}));
        let kwargs = map(serde_json::json!({"flag": "r", "other": null}));
        let tools = vec![serde_json::json!("rt")];
        let render = |kwargs: Option<&Map<String, Json>>, tools: Option<&[Json]>, effort: Option<&str>| {
            let opts = ChatOptions {
                kwargs,
                defaults: Some(&defaults),
                tools,
                reasoning_effort: effort,
                ..Default::default()
            };
            t.render(&msgs, &opts).unwrap()
        };
        assert_eq!(render(None, None, None), "d d ['dt'] False");
        assert_eq!(render(Some(&kwargs), Some(&tools), None), "r d ['rt'] False", "a null kwarg leaves the default");
        assert_eq!(render(None, None, Some("high")), "d d ['dt'] True", "the effort's enable_thinking wins");
    }

    /// `reasoning_effort` reaches the template, and with it `enable_thinking`
    /// unless the kwargs set that (vLLM 0.32's `build_chat_params`).
    #[test]
    fn reasoning_effort_sets_enable_thinking_unless_the_kwargs_do() {
        let t = ChatTemplate::new("{{ reasoning_effort }} {{ enable_thinking }}".into(), Map::new()).unwrap();
        let msgs: Vec<Map<String, Json>> = serde_json::from_value(serde_json::json!([{"role": "user"}])).unwrap();
        let render = |effort, kwargs: Json| {
            let kwargs: Map<String, Json> = serde_json::from_value(kwargs).unwrap();
            let opts = ChatOptions { reasoning_effort: effort, kwargs: Some(&kwargs), ..Default::default() };
            t.render(&msgs, &opts).unwrap()
        };
        assert_eq!(render(Some("none"), serde_json::json!({})), "none False");
        assert_eq!(render(Some("low"), serde_json::json!({"reasoning_effort": "high"})), "low True");
        assert_eq!(render(Some("none"), serde_json::json!({"enable_thinking": true})), "none True");
        assert_eq!(render(None, serde_json::json!({})), " ");
    }

    /// A template that expands its input (indented JSON of nested arrays)
    /// stops at MAX_RENDERED_BYTES instead of rendering gigabytes.
    #[test]
    fn a_render_past_the_cap_is_refused() {
        let mut nested = Json::from(0);
        for _ in 0..100 {
            nested = Json::Array(vec![nested; 2]);
            if serde_json::to_string(&nested).unwrap().len() > 2 << 20 {
                break;
            }
        }
        // 2 MB of nesting, indented 4 spaces a level: ~180 MB uncapped.
        let calls =
            serde_json::json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": {"x": nested}}}]}]);
        let out = render("{{ messages[0].tool_calls[0].function.arguments | tojson(indent=4) }}", calls);
        let Err(TokenizeError::Template { message, .. }) = out else { panic!("rendered {:?}", out.map(|s| s.len())) };
        assert!(message.contains("exceeds"), "{message}");
        // Plain output is capped as well.
        let line = "x".repeat(1_000);
        let src =
            format!("{{% for i in range(10000) %}}{{% for j in range(10000) %}}{line}{{% endfor %}}{{% endfor %}}");
        let out = render(&src, serde_json::json!([]));
        assert!(matches!(out, Err(TokenizeError::TooLong { max_bytes: MAX_RENDERED_BYTES })), "{out:?}");
    }

    /// The caller's cap (the router's: its longest acceptable prompt) stops
    /// a render that expands a small request far sooner than
    /// MAX_RENDERED_BYTES: a 100 kB body of nested arrays, indented, came
    /// to 64 MB, all of it tokenized before the token count was checked.
    #[test]
    fn a_render_stops_at_the_callers_cap() {
        let mut nested = Json::from(0);
        while serde_json::to_string(&nested).unwrap().len() < 100_000 {
            nested = Json::Array(vec![nested; 2]);
        }
        let t = ChatTemplate::new("{{ tools | tojson(indent=4) }}".into(), Map::new()).unwrap();
        let tools = [nested];
        let opts = |max_bytes| ChatOptions { tools: Some(&tools), max_bytes, ..Default::default() };
        let full = t.render(&[], &opts(None)).expect("under MAX_RENDERED_BYTES");
        assert!(full.len() > 2 << 20, "{} bytes", full.len());
        let out = t.render(&[], &opts(Some(1 << 20)));
        assert!(matches!(out, Err(TokenizeError::TooLong { max_bytes: 1_048_576 })), "{:?}", out.map(|s| s.len()));
        assert_eq!(t.render(&[], &opts(Some(full.len()))).unwrap(), full);
    }

    #[test]
    fn raise_exception_reports_message_and_line() {
        let err =
            render("ok\n{{ raise_exception('no system role') }}", serde_json::json!([{"role": "user"}])).unwrap_err();
        match err {
            TokenizeError::Template { line, message } => {
                assert_eq!(line, Some(2));
                assert!(message.contains("no system role"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn syntax_error_names_the_line() {
        let err = ChatTemplate::new("line one\n{% if %}".into(), Map::new()).unwrap_err();
        assert!(matches!(err, TokenizeError::Template { line: Some(2), .. }), "{err:?}");
    }

    #[test]
    fn content_parts_join_with_newlines_and_tool_args_parse() {
        let out = render(
            "{% for m in messages %}{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.q }}{% endif %};{% endfor %}",
            serde_json::json!([
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{\"q\": 7}"}}]}
            ]),
        )
        .unwrap();
        // vLLM renders a null content as "" (HF alone would print None).
        assert_eq!(out, "a\nb;7;");
    }

    #[test]
    fn trims_blocks_like_hf() {
        let out = render(
            "{% for m in messages %}\n  {% if true %}\n{{ m.role }}\n  {% endif %}\n{% endfor %}",
            serde_json::json!([{"role": "user"}]),
        )
        .unwrap();
        assert_eq!(out, "user\n");
    }
}
