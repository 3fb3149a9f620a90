//! A chat request's messages as vLLM hands them to the chat template
//! (`vllm/entrypoints/chat_utils.py`: `_parse_chat_message_content`,
//! `_postprocess_messages`; `renderers/hf.py`: the developer role), so the
//! router renders the prompt the engine renders. vLLM does not pass the
//! client's messages through: it builds each one anew, and templates written
//! for that shape fail on the raw one. Qwen3's, given an assistant turn of
//! `"content": null` (what vLLM itself answers a tool call with), raises
//! "cannot perform a containment check"; vLLM renders it as `""`.
//!
//! Media parts are kept as `{"type": "image"}` (and audio, video) where the
//! template takes content parts, and dropped where it takes a string: their
//! placeholder text is the model's own, which the router does not know, so
//! such prompts' block keys past the first image are approximate. A part vLLM
//! refuses (an unknown type) is dropped too: the engine answers it with its
//! 400, and the router need not refuse it first.

use serde_json::{Map, Value as Json, json};

/// How the template takes `content` (vLLM's "chat template content format").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string: text parts joined with newlines.
    String,
    /// A list of parts (`{"type": "text", "text": …}`, `{"type": "image"}`).
    Parts,
}

/// `messages` as vLLM renders them with a template whose content format is
/// `format`; `developer_role`: the template names the developer role (else
/// developer messages become system ones, merged into one at the start).
pub fn prepare(messages: &[Map<String, Json>], format: ContentFormat, developer_role: bool) -> Vec<Json> {
    let mut out: Vec<Map<String, Json>> = messages.iter().map(|m| message(m, format)).collect();
    if !developer_role && out.iter().any(|m| role(m) == "developer") {
        out = merge_system(out.into_iter().map(developer_as_system).collect());
    }
    out.into_iter().map(Json::Object).collect()
}

/// A request's tool as vLLM hands it to the template: `tool.model_dump()`
/// of its `ChatCompletionToolsParam` (vLLM 0.32 `online_renderer.py`), whose
/// serializers keep only the declared fields: `type` (`"function"` when
/// absent), then `function` with `name`, `description` and `parameters`
/// (null when absent), then `strict` and `defer_loading` when set (a tool's
/// `defer_loading` passed down to its function), and the tool's own
/// `defer_loading` when set. Other keys are dropped. The client's own object
/// rendered differently from the first tool on: on Qwen3, which prints the
/// tools in the system turn, a function without a description (vLLM:
/// `"description": null`) missed every block after the system text. Checked
/// against vLLM 0.32's `model_dump()`. Anything else is passed as it is
/// (vLLM refuses it).
pub fn tool(t: &Json) -> Json {
    let Some((obj, f)) = t.as_object().and_then(|o| Some((o, o.get("function")?.as_object()?))) else {
        return t.clone();
    };
    let set = |m: &Map<String, Json>, k: &str| m.get(k).filter(|v| !v.is_null()).cloned();
    let mut function = Map::new();
    for k in ["name", "description", "parameters"] {
        function.insert(k.to_owned(), f.get(k).cloned().unwrap_or(Json::Null));
    }
    if let Some(strict) = set(f, "strict") {
        function.insert("strict".to_owned(), strict);
    }
    if let Some(defer) = set(f, "defer_loading").or_else(|| set(obj, "defer_loading")) {
        function.insert("defer_loading".to_owned(), defer);
    }
    let mut out = Map::new();
    out.insert("type".to_owned(), obj.get("type").cloned().unwrap_or_else(|| Json::from("function")));
    out.insert("function".to_owned(), Json::Object(function));
    if let Some(defer) = set(obj, "defer_loading") {
        out.insert("defer_loading".to_owned(), defer);
    }
    Json::Object(out)
}

fn role(m: &Map<String, Json>) -> &str {
    m.get("role").and_then(Json::as_str).unwrap_or("")
}

/// One part of a message's content, as vLLM parses it.
enum Part<'a> {
    Text(&'a Json),
    Media(&'static str),
    ToolReference(&'a Json),
}

static NULL: Json = Json::Null;

/// A content part: a string is text; an object's `type` says what it is
/// (without a `type`, or with a `uuid`, the media key it carries does).
/// `None`: skipped (a text part whose text is null) or refused by vLLM.
fn part(p: &Json) -> Option<Part<'_>> {
    const MEDIA_KEYS: [&str; 10] = [
        "image_url",
        "image_pil",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "audio_url",
        "input_audio",
        "video_url",
        "tool_reference",
    ];
    let o = match p {
        Json::String(_) => return Some(Part::Text(p)),
        Json::Object(o) => o,
        _ => return None,
    };
    let kind = match o.get("type") {
        Some(Json::String(t)) if o.get("uuid").is_none_or(Json::is_null) => t.as_str(),
        Some(Json::Null) | None => *MEDIA_KEYS.iter().find(|k| o.contains_key(**k))?,
        Some(_) => *MEDIA_KEYS.iter().find(|k| o.contains_key(**k))?,
    };
    let text_key = match kind {
        "text" | "input_text" | "output_text" => Some("text"),
        "refusal" => Some("refusal"),
        "thinking" => Some("thinking"),
        _ => None,
    };
    if let Some(key) = text_key {
        let text = o.get(key).unwrap_or(&NULL);
        return (!(text.is_null() && matches!(kind, "text" | "refusal"))).then_some(Part::Text(text));
    }
    Some(match kind {
        "image_url" | "input_image" | "image_embeds" | "image_pil" => Part::Media("image"),
        "video_url" | "video_embeds" => Part::Media("video"),
        "audio_url" | "input_audio" | "audio_embeds" => Part::Media("audio"),
        "tool_reference" => Part::ToolReference(o.get("name").unwrap_or(&NULL)),
        _ => return None,
    })
}

/// Text parts joined with newlines, as a string-content template gets them.
fn joined<'a>(texts: impl Iterator<Item = &'a Json>) -> Json {
    let mut out = String::new();
    for (i, t) in texts.enumerate() {
        if i > 0 {
            out.push('\n');
        }
        match t.as_str() {
            Some(s) => out.push_str(s),
            None => out.push_str(&python_str(t)),
        }
    }
    Json::String(out)
}

/// Python's `str()` of a JSON value a client put where text belongs.
fn python_str(v: &Json) -> String {
    match v {
        Json::Null => "None".into(),
        Json::Bool(b) => if *b { "True" } else { "False" }.into(),
        other => other.to_string(),
    }
}

/// Claude Code's attribution line, which vLLM drops from a system
/// message's text (its `cch` value changes every request, and kept, every
/// request missed the cache from the first block on).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// A system message's content without Claude Code's attribution line, as
/// vLLM 0.32 renders it (`_strip_claude_code_billing_header`): a text that
/// starts with it loses its first line, and is dropped if nothing is left.
/// `None` when there is none.
fn without_billing_header(content: Option<&Json>) -> Option<Json> {
    let rest = |text: &str| text.split_once('\n').map_or("", |(_, rest)| rest).to_owned();
    match content? {
        Json::String(s) if s.starts_with(BILLING_HEADER) => {
            let rest = rest(s);
            Some(if rest.is_empty() { Json::Array(Vec::new()) } else { Json::String(rest) })
        }
        Json::Array(parts) => {
            let headed = |p: &Json| {
                let text = match p {
                    Json::Object(o) if o.get("type").and_then(Json::as_str) == Some("text") => o.get("text"),
                    Json::String(_) => Some(p),
                    _ => None,
                };
                text.and_then(Json::as_str).is_some_and(|t| t.starts_with(BILLING_HEADER))
            };
            if !parts.iter().any(headed) {
                return None;
            }
            let kept = parts.iter().filter_map(|p| {
                if !headed(p) {
                    return Some(p.clone());
                }
                let text = p.as_str().or_else(|| p["text"].as_str()).unwrap_or_default();
                let rest = rest(text);
                (!rest.is_empty()).then(|| match p {
                    Json::Object(o) => {
                        let mut o = o.clone();
                        o.insert("text".into(), Json::String(rest));
                        Json::Object(o)
                    }
                    _ => Json::String(rest),
                })
            });
            Some(Json::Array(kept.collect()))
        }
        _ => None,
    }
}

fn message(m: &Map<String, Json>, format: ContentFormat) -> Map<String, Json> {
    let role_value = m.get("role").cloned().unwrap_or(Json::Null);
    let role = role(m);
    let stripped = if role == "system" { without_billing_header(m.get("content")) } else { None };
    let content = stripped.as_ref().or(m.get("content"));
    let parts: Vec<Part> = match content {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(ps)) => ps.iter().filter_map(part).collect(),
        Some(other) => vec![Part::Text(other)],
    };
    let content = match format {
        ContentFormat::String => match content {
            // The common case, as it came.
            Some(text @ Json::String(_)) => text.clone(),
            // vLLM keeps the parts that parse to something: an empty or null
            // text joins nothing. A tool reference joins its name (vLLM
            // 0.32's `_parse_chat_message_content_part`); it was dropped.
            _ => joined(parts.iter().filter_map(|p| match p {
                Part::Text(t) | Part::ToolReference(t) if !t.is_null() && t.as_str() != Some("") => Some(*t),
                _ => None,
            })),
        },
        ContentFormat::Parts => Json::Array(
            parts
                .iter()
                .map(|p| match p {
                    Part::Text(t) => json!({"type": "text", "text": t}),
                    Part::Media(kind) => json!({"type": kind}),
                    Part::ToolReference(name) => json!({"type": "tool_reference", "name": name}),
                })
                .collect(),
        ),
    };
    let mut out = Map::new();
    out.insert("role".into(), role_value);
    out.insert("content".into(), content);
    match role {
        "assistant" => {
            if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()).and_then(tool_calls) {
                out.insert("tool_calls".into(), calls);
            }
            // A template may read either name; vLLM sets both from
            // `reasoning`, which a chat completion takes from the older
            // `reasoning_content` when it has none (vLLM 0.32's
            // `_normalize_messages_before`; its /tokenize does not, so
            // tests/vllm compares with the engine's own prompt_token_ids).
            let reasoning =
                [m.get("reasoning"), m.get("reasoning_content")].into_iter().flatten().find(|r| !r.is_null());
            if let Some(r) = reasoning {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
            // Most templates take a tool result as a string: text-only parts
            // are joined even for a template that takes parts.
            if let Json::Array(items) = &out["content"]
                && items.iter().all(|i| i["type"] == "text")
            {
                let joined = joined(items.iter().map(|i| &i["text"]));
                out.insert("content".into(), joined);
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v @ Json::String(_)) = m.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    if role == "developer" {
        out.insert("tools".into(), m.get("tools").cloned().unwrap_or(Json::Null));
    }
    out
}

/// An assistant turn's tool calls with each call's `arguments` an object,
/// as tool-use templates expect (the API sends them as a JSON string): an
/// empty, missing or unparsable one is `{}`. An empty list is no tool calls
/// (`None`). Each call's keys in the order vLLM's request model gives them
/// (`id`, `function` with `arguments` then `name`, `type`, then any others
/// as sent): a template that dumps a call with `tojson` renders them so.
fn tool_calls(calls: &Json) -> Option<Json> {
    let Json::Array(list) = calls else { return Some(calls.clone()) };
    if list.is_empty() {
        return None;
    }
    let list = list
        .iter()
        .map(|call| {
            let Json::Object(call) = call else { return call.clone() };
            let function = match call.get("function") {
                Some(Json::Object(f)) => {
                    let arguments = match f.get("arguments") {
                        Some(o @ Json::Object(m)) if !m.is_empty() => o.clone(),
                        Some(Json::String(s)) if !s.is_empty() => match serde_json::from_str::<Json>(s) {
                            Ok(o @ Json::Object(_)) => o,
                            _ => json!({}),
                        },
                        _ => json!({}),
                    };
                    Some(Json::Object(in_order(f, &["arguments", "name"], [("arguments", arguments)])))
                }
                _ => None,
            };
            Json::Object(in_order(call, &["id", "function", "type"], function.map(|f| ("function", f))))
        })
        .collect();
    Some(Json::Array(list))
}

/// `m`'s keys with `first` first (those present, in that order, each
/// replaced by `with` where it names one), then the others as they were.
fn in_order<'a>(
    m: &Map<String, Json>,
    first: &[&str],
    with: impl IntoIterator<Item = (&'a str, Json)>,
) -> Map<String, Json> {
    let mut with: Vec<(&str, Json)> = with.into_iter().collect();
    let mut out = Map::new();
    for &k in first {
        let replaced = with.iter().position(|(w, _)| *w == k).map(|i| with.swap_remove(i).1);
        if let Some(v) = replaced.or_else(|| m.get(k).cloned()) {
            out.insert(k.to_owned(), v);
        }
    }
    for (k, v) in m.iter().filter(|(k, _)| !first.contains(&k.as_str())) {
        out.insert(k.clone(), v.clone());
    }
    out
}

fn developer_as_system(mut m: Map<String, Json>) -> Map<String, Json> {
    if role(&m) == "developer" {
        m.insert("role".into(), "system".into());
        m.remove("tools");
    }
    m
}

/// Every system message merged into one at the start (text joined by a
/// blank line), where there is more than one or one not first: templates
/// such as Qwen's refuse a system message anywhere else.
fn merge_system(messages: Vec<Map<String, Json>>) -> Vec<Map<String, Json>> {
    let scattered = messages.iter().enumerate().filter(|(_, m)| role(m) == "system").any(|(i, _)| i > 0)
        || messages.iter().filter(|m| role(m) == "system").count() > 1;
    if !scattered {
        return messages;
    }
    let mut texts = Vec::new();
    let mut rest = Vec::new();
    for m in messages {
        if role(&m) != "system" {
            rest.push(m);
            continue;
        }
        let text = match m.get("content") {
            Some(Json::Array(parts)) => joined(parts.iter().filter_map(|p| p.get("text"))),
            Some(text @ Json::String(_)) => text.clone(),
            _ => continue,
        };
        if let Json::String(text) = text
            && !text.is_empty()
        {
            texts.push(text);
        }
    }
    let mut merged = Map::new();
    merged.insert("role".into(), "system".into());
    merged.insert("content".into(), Json::String(texts.join("\n\n")));
    std::iter::once(merged).chain(rest).collect()
}

/// vLLM's detection of a template's content format: it takes parts if it
/// loops over a message's content (`{% for part in message['content'] %}`,
/// the message being a loop variable over `messages` or a name set from
/// it, sliced or filtered), or over a variable named `content`. Anything
/// else, a containment test such as Qwen3's `'</think>' in message.content`
/// included, takes a string.
pub fn detect_format(source: &str) -> ContentFormat {
    let statements = statements(source);
    // `messages`, and the names set from it: `set loop_messages = messages[1:]`.
    let mut lists = vec!["messages".to_string()];
    let mut i = 0;
    while i < lists.len() {
        for s in &statements {
            if let Some((name, value)) = set_statement(s)
                && is_elems_of(value, &lists[i], None)
                && !lists.contains(&name.to_string())
            {
                lists.push(name.to_string());
            }
        }
        i += 1;
    }
    let loops: Vec<(&str, &str)> = statements.iter().filter_map(|s| for_statement(s)).collect();
    let messages: Vec<&str> =
        loops.iter().filter(|(_, iter)| lists.iter().any(|l| is_elems_of(iter, l, None))).map(|(t, _)| *t).collect();
    let over_content = loops
        .iter()
        .any(|(_, iter)| *iter == "content" || messages.iter().any(|m| is_elems_of(iter, m, Some("content"))));
    if over_content { ContentFormat::Parts } else { ContentFormat::String }
}

/// Does the template name the developer role (vLLM's test)?
pub fn names_developer_role(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

/// The text of each `{% … %}` statement, whitespace control and runs of
/// whitespace squashed.
fn statements(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    // Comments are no statements: `{# {% for p in message.content %} #}`.
    let mut uncommented = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{#") {
        uncommented.push_str(&rest[..start]);
        rest = rest[start + 2..].find("#}").map_or("", |end| &rest[start + 2 + end + 2..]);
    }
    uncommented.push_str(rest);
    let mut rest = uncommented.as_str();
    while let Some(start) = rest.find("{%") {
        let body = &rest[start + 2..];
        let Some(end) = body.find("%}") else { break };
        let inner = body[..end].trim_start_matches(['-', '+']).trim_end_matches(['-', '+']);
        out.push(inner.split_whitespace().collect::<Vec<_>>().join(" "));
        rest = &body[end + 2..];
    }
    out
}

/// `set NAME = VALUE` → (NAME, VALUE).
fn set_statement(s: &str) -> Option<(&str, &str)> {
    let (name, value) = s.strip_prefix("set ")?.split_once('=')?;
    let name = name.trim();
    is_name(name).then_some((name, value.trim()))
}

/// `for TARGET in ITER [if …] [recursive]` → (TARGET, ITER), TARGET a single
/// name (vLLM gives up on a tuple target).
fn for_statement(s: &str) -> Option<(&str, &str)> {
    let (target, iter) = s.strip_prefix("for ")?.split_once(" in ")?;
    let iter = iter.split(" if ").next()?.trim_end_matches(" recursive").trim();
    is_name(target.trim()).then_some((target.trim(), iter))
}

fn is_name(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_') && !s.starts_with(|c: char| c.is_numeric())
}

/// Is `expr` the variable `var` (with `key`: its `key` item or attribute),
/// perhaps sliced, filtered or tested?
fn is_elems_of(expr: &str, var: &str, key: Option<&str>) -> bool {
    // A filter or test applies to what precedes it.
    let mut base = expr.split('|').next().unwrap_or("").trim();
    if let Some((before, _)) = base.split_once(" is ") {
        base = before.trim();
    }
    // A slice of it: `x[1:]`, `x[:-1]`.
    while let Some(open) = base.rfind('[')
        && base.ends_with(']')
        && base[open..].contains(':')
    {
        base = base[..open].trim_end();
    }
    match key {
        None => base == var,
        Some(k) => {
            [format!("{var}['{k}']"), format!("{var}[\"{k}\"]"), format!("{var}.{k}")].contains(&base.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tools_are_passed_as_vllm_dumps_them() {
        // vLLM 0.32's `ChatCompletionToolsParam(**sent).model_dump()`, run.
        for (sent, want) in [
            (
                json!({"function": {"parameters": {"type": "object"}, "name": "get_weather"}}),
                json!({"type": "function", "function": {"name": "get_weather", "description": null, "parameters": {"type": "object"}}}),
            ),
            (
                json!({"function": {"name": "clock", "strict": true, "x": 1}, "type": "function", "cache_control": {"type": "ephemeral"}}),
                json!({"type": "function", "function": {"name": "clock", "description": null, "parameters": null, "strict": true}}),
            ),
            (
                json!({"function": {"name": "f", "strict": null}, "defer_loading": true}),
                json!({"type": "function", "function": {"name": "f", "description": null, "parameters": null, "defer_loading": true}, "defer_loading": true}),
            ),
        ] {
            let (got, want) = (serde_json::to_string(&tool(&sent)).unwrap(), serde_json::to_string(&want).unwrap());
            assert_eq!(got, want, "values and key order");
        }
        assert_eq!(tool(&json!("not a tool")), json!("not a tool"));
    }

    use super::*;

    fn msgs(v: Json) -> Vec<Map<String, Json>> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn content_format_is_detected_as_vllm_detects_it() {
        use ContentFormat::{Parts, String};
        for (source, want) in [
            (
                "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
                Parts,
            ),
            (
                "{%- for m in messages -%}{%- for c in m.content | selectattr('type', 'equalto', 'text') -%}{%- endfor -%}{%- endfor -%}",
                Parts,
            ),
            (
                "{% set loop_messages = messages[1:] %}{% for msg in loop_messages %}{% for p in msg[\"content\"] %}{% endfor %}{% endfor %}",
                Parts,
            ),
            ("{% macro render(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}", Parts),
            // Qwen3: a containment test, not a loop.
            ("{% for message in messages %}{% if '</think>' in message.content %}x{% endif %}{% endfor %}", String),
            (
                "{% for message in messages %}{% for line in message.content.split('\\n') %}{% endfor %}{% endfor %}",
                String,
            ),
            ("{% for message in messages %}{{ message['content'] }}{% endfor %}", String),
            // A loop over something else's content.
            ("{% for doc in documents %}{% for p in doc.content %}{% endfor %}{% endfor %}", String),
            // A loop in a comment.
            ("{% for m in messages %}{# {% for p in m.content %} #}{{ m.content }}{% endfor %}", String),
        ] {
            assert_eq!(detect_format(source), want, "{source}");
        }
    }

    #[test]
    fn null_or_missing_content_is_empty_and_parts_are_joined_or_listed() {
        let m = msgs(json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": null, "extra": 1},
            {"role": "assistant"},
            {"role": "user", "content": [{"type": "text", "text": null}, {"type": "bogus"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "thinking", "thinking": null}, "b"]},
            {"role": "user", "content": [{"type": "text", "text": "Use it"}, {"type": "tool_reference", "name": "get_weather"}]}
        ]));
        let s = prepare(&m, ContentFormat::String, true);
        assert_eq!(s[5], json!({"role": "user", "content": "Use it\nget_weather"}), "a tool reference joins its name");
        assert_eq!(s[0], json!({"role": "user", "content": "a\nb"}));
        assert_eq!(s[4], json!({"role": "user", "content": "a\nb"}), "empty parts join nothing");
        assert_eq!(s[1], json!({"role": "assistant", "content": ""}), "unknown keys are not passed on");
        assert_eq!(s[2], json!({"role": "assistant", "content": ""}));
        assert_eq!(s[3], json!({"role": "user", "content": ""}));
        let p = prepare(&m, ContentFormat::Parts, true);
        assert_eq!(
            p[0]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "image"}])
        );
        assert_eq!(p[1]["content"], json!([]));
    }

    #[test]
    fn claude_codes_attribution_line_is_dropped_from_system_text() {
        let header = "x-anthropic-billing-header: cc_version=2.1; cch=";
        let system =
            |content: Json| msgs(json!([{"role": "system", "content": content}, {"role": "user", "content": "u"}]));
        for cch in ["1a2b", "9f8e"] {
            let one = system(json!(format!("{header}{cch};\nYou are X")));
            assert_eq!(prepare(&one, ContentFormat::String, true)[0]["content"], json!("You are X"));
            let parts = system(
                json!([{"type": "text", "text": format!("{header}{cch};")}, {"type": "text", "text": "You are X"}]),
            );
            assert_eq!(prepare(&parts, ContentFormat::String, true)[0]["content"], json!("You are X"));
            assert_eq!(
                prepare(&parts, ContentFormat::Parts, true)[0]["content"],
                json!([{"type": "text", "text": "You are X"}])
            );
        }
        let alone = system(json!(format!("{header}1;")));
        assert_eq!(prepare(&alone, ContentFormat::String, true)[0]["content"], json!(""));
        // Only a system message's, and only at the start of a text.
        let user = msgs(json!([{"role": "user", "content": format!("{header}1;\nhi")}]));
        assert_eq!(prepare(&user, ContentFormat::String, true)[0]["content"], json!(format!("{header}1;\nhi")));
        let inside = system(json!(format!("Note: {header}1;\nYou are X")));
        assert_eq!(
            prepare(&inside, ContentFormat::String, true)[0]["content"],
            json!(format!("Note: {header}1;\nYou are X"))
        );
    }

    #[test]
    fn tool_turns_take_vllms_shape() {
        let m = msgs(json!([
            {"role": "assistant", "content": null, "reasoning": "hmm", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"q\": 7}"}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": "not json"}}
            ]},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
            {"role": "assistant", "content": "done", "tool_calls": []}
        ]));
        let p = prepare(&m, ContentFormat::Parts, true);
        // As vLLM's request model orders a call: id, function (arguments,
        // name, others), type, others.
        let keys = |v: &Json| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        let sent = msgs(json!([{"role": "assistant", "content": null, "tool_calls": [
            {"type": "function", "cache": 3, "function": {"extra": 1, "name": "f", "arguments": "{}"}, "id": "c1"}
        ]}]));
        let call = &prepare(&sent, ContentFormat::String, true)[0]["tool_calls"][0];
        assert_eq!(keys(call), ["id", "function", "type", "cache"]);
        assert_eq!(keys(&call["function"]), ["arguments", "name", "extra"]);
        let args: Vec<&Json> =
            p[0]["tool_calls"].as_array().unwrap().iter().map(|c| &c["function"]["arguments"]).collect();
        assert_eq!(args, [&json!({"q": 7}), &json!({}), &json!({})]);
        assert_eq!((&p[0]["reasoning"], &p[0]["reasoning_content"]), (&json!("hmm"), &json!("hmm")));
        assert_eq!(
            p[1],
            json!({"role": "tool", "tool_call_id": "1", "content": "x\ny"}),
            "a tool's text parts are joined"
        );
        assert!(p[2].get("tool_calls").is_none(), "an empty list is no tool calls");
        let old_name = msgs(json!([{"role": "assistant", "content": "x", "reasoning_content": "hmm"}]));
        assert_eq!(
            prepare(&old_name, ContentFormat::String, true)[0],
            json!({"role": "assistant", "content": "x", "reasoning": "hmm", "reasoning_content": "hmm"}),
            "the older name is taken as `reasoning`"
        );
        let both = msgs(json!([{"role": "assistant", "content": "x", "reasoning": "new", "reasoning_content": "old"}]));
        assert_eq!(prepare(&both, ContentFormat::String, true)[0]["reasoning_content"], json!("new"));
    }

    #[test]
    fn developer_messages_become_one_system_message_where_the_template_has_no_such_role() {
        let m = msgs(json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "d", "tools": []}
        ]));
        let merged = prepare(&m, ContentFormat::String, false);
        assert_eq!(merged, [json!({"role": "system", "content": "s\n\nd"}), json!({"role": "user", "content": "u"})]);
        let kept = prepare(&m, ContentFormat::String, true);
        assert_eq!(kept[2], json!({"role": "developer", "content": "d", "tools": []}));
    }
}
