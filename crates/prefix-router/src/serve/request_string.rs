//! The request string: what of a request the prefix index sees.
//!
//! It must be prefix-preserving: when a conversation grows by a turn, the new request's string
//! starts with the old one's, so the chunks of the old turn match. Every part is rendered on
//! its own and appended in order; nothing is re-sorted or summarised.
//!
//! - Every string starts with the model name and a newline (prefixes of different models never
//!   match: they live in different KV caches).
//! - completions: the prompt text; of a list of prompts the first (one request goes to one
//!   backend); token-id prompts as their decimal ids, each followed by a space.
//! - chat: the tools (as sent), then every message in order: `\x1e role \x1f [name \x1f] content`
//!   with text parts concatenated and other parts (images, audio) as their JSON, then tool
//!   calls and the tool call id.
//! - responses: the instructions, then the input (a string, or its items rendered like chat
//!   messages). embeddings: the input, like a completions prompt.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

/// A body that is no valid request: the front end answers it with a 400 (its message is the
/// client's).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

/// Which routed endpoint a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Embeddings,
    Responses,
    /// `/tokenize`, `/v1/score`, ...: routed by load; only the model is read.
    Other,
}

#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    priority: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_call_id: Option<Cow<'a, str>>,
    /// Responses API items carry their kind here.
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// What routing needs of a request.
#[derive(Debug, PartialEq, Eq)]
pub struct Routing {
    /// The `model` field (None only for [`Endpoint::Other`] bodies without one).
    pub model: Option<String>,
    /// The request string (empty for [`Endpoint::Other`]).
    pub text: String,
    /// `"stream": true`: the backend answers with its head at once and then events, so a
    /// missing head means a hung backend; a non-streamed answer's head comes only at the end.
    pub stream: bool,
    /// The body sets vLLM's `priority` itself (then the router does not write its own).
    pub sets_priority: bool,
    /// That priority, when it is an integer (vLLM serves lower values first).
    pub priority: Option<i64>,
}

fn invalid(what: &str) -> InvalidRequest {
    InvalidRequest(what.to_owned())
}

fn is_null(raw: Option<&RawValue>) -> bool {
    raw.is_none_or(|r| r.get() == "null")
}

fn string<'a>(raw: &'a RawValue, what: &str) -> Result<Cow<'a, str>, InvalidRequest> {
    serde_json::from_str::<Cow<'_, str>>(raw.get())
        .map_err(|_| invalid(&format!("`{what}` must be a string")))
}

/// Reads the model and builds the request string of a body.
pub fn routing(endpoint: Endpoint, body: &[u8]) -> Result<Routing, InvalidRequest> {
    let body =
        std::str::from_utf8(body).map_err(|e| invalid(&format!("the body is not UTF-8: {e}")))?;
    let trimmed = body.trim_start();
    if !trimmed.starts_with('{') {
        return Err(
            crate::json_body::parse_json::<serde_json::Map<String, serde_json::Value>>(
                body.as_bytes(),
            )
            .err()
            .map_or_else(
                || invalid("the body must be a JSON object"),
                |e| InvalidRequest(e.message),
            ),
        );
    }
    let fields: Fields = serde_json::from_str(body).map_err(|e| {
        let what = if e.is_eof() {
            "truncated JSON body"
        } else {
            "malformed JSON body"
        };
        invalid(&format!("{what}: {e}"))
    })?;
    let model = match fields.model {
        Some(raw) if raw.get() != "null" => Some(string(raw, "model")?.into_owned()),
        _ => None,
    };
    let stream = fields.stream.is_some_and(|s| s.get() == "true");
    let sets_priority = !is_null(fields.priority);
    let priority = fields
        .priority
        .and_then(|p| p.get().trim().parse::<i64>().ok());
    if endpoint == Endpoint::Other {
        return Ok(Routing {
            model,
            text: String::new(),
            stream,
            sets_priority,
            priority,
        });
    }
    let Some(model) = model else {
        return Err(invalid("you must provide a `model` parameter"));
    };
    let mut text = String::with_capacity(body.len() / 2 + 64);
    text.push_str(&model);
    text.push('\n');
    match endpoint {
        Endpoint::Completions => {
            let prompt = fields
                .prompt
                .filter(|p| p.get() != "null")
                .ok_or_else(|| invalid("you must provide a `prompt`"))?;
            render_prompt(prompt, "prompt", &mut text)?
        }
        Endpoint::Embeddings => {
            let input = fields
                .input
                .ok_or_else(|| invalid("you must provide an `input`"))?;
            render_prompt(input, "input", &mut text)?
        }
        Endpoint::Chat => {
            if !is_null(fields.tools) {
                text.push_str("\u{1e}tools\u{1f}");
                text.push_str(fields.tools.expect("checked").get());
            }
            let messages = fields
                .messages
                .ok_or_else(|| invalid("you must provide `messages`"))?;
            let messages: Vec<Message> = serde_json::from_str(messages.get())
                .map_err(|e| invalid(&format!("`messages` must be a list of messages: {e}")))?;
            for m in &messages {
                render_message(m, &mut text)?;
            }
        }
        Endpoint::Responses => {
            if let Some(instructions) = fields.instructions.filter(|r| r.get() != "null") {
                text.push_str("\u{1e}instructions\u{1f}");
                text.push_str(&string(instructions, "instructions")?);
            }
            if !is_null(fields.tools) {
                text.push_str("\u{1e}tools\u{1f}");
                text.push_str(fields.tools.expect("checked").get());
            }
            let input = fields
                .input
                .ok_or_else(|| invalid("you must provide an `input`"))?;
            if input.get().starts_with('"') {
                text.push_str("\u{1e}user\u{1f}");
                text.push_str(&string(input, "input")?);
            } else {
                let items: Vec<Message> = serde_json::from_str(input.get()).map_err(|e| {
                    invalid(&format!("`input` must be a string or a list of items: {e}"))
                })?;
                for m in &items {
                    render_message(m, &mut text)?;
                }
            }
        }
        Endpoint::Other => unreachable!("handled above"),
    }
    Ok(Routing {
        model: Some(model),
        text,
        stream,
        sets_priority,
        priority,
    })
}

/// `body` (a JSON object, as [`routing`] checked) with `"priority": vllm_priority` as its first
/// field, for a vLLM that schedules by priority (lower first). The rest is passed byte for byte.
pub fn with_priority(body: &[u8], vllm_priority: i64) -> bytes::Bytes {
    let Some(open) = body.iter().position(|&b| b == b'{') else {
        return bytes::Bytes::copy_from_slice(body);
    };
    let rest = &body[open + 1..];
    let empty = rest
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_none_or(|&b| b == b'}');
    let field = format!(
        "\"priority\":{vllm_priority}{}",
        if empty { "" } else { "," }
    );
    let mut out = Vec::with_capacity(body.len() + field.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(field.as_bytes());
    out.extend_from_slice(rest);
    out.into()
}

/// `body` (a JSON object, as [`routing`] checked) with its own `priority` replaced by
/// `vllm_priority` (the rest re-serialized in its order); the body as it is if it cannot be.
pub fn replace_priority(body: &[u8], vllm_priority: i64) -> bytes::Bytes {
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(mut fields) => {
            fields.insert("priority".into(), vllm_priority.into());
            serde_json::to_vec(&fields)
                .map_or_else(|_| bytes::Bytes::copy_from_slice(body), Into::into)
        }
        Err(_) => bytes::Bytes::copy_from_slice(body),
    }
}

/// A completions prompt or embeddings input: a string, a list of strings (the first), token
/// ids, or a list of token-id lists (the first).
fn render_prompt(raw: &RawValue, what: &str, out: &mut String) -> Result<(), InvalidRequest> {
    let value = raw.get();
    if value.starts_with('"') {
        out.push_str(&string(raw, what)?);
        return Ok(());
    }
    let err = || {
        invalid(&format!(
            "`{what}` must be a string, a list of strings or token ids"
        ))
    };
    let items: Vec<&RawValue> = serde_json::from_str(value).map_err(|_| err())?;
    let Some(first) = items.first() else {
        return Err(invalid(&format!("`{what}` must not be empty")));
    };
    let first = first.get();
    if first.starts_with('"') {
        out.push_str(&serde_json::from_str::<Cow<str>>(first).map_err(|_| err())?);
    } else if first.starts_with('[') {
        let ids: Vec<u64> = serde_json::from_str(first).map_err(|_| err())?;
        push_ids(&ids, out);
    } else {
        let ids: Vec<u64> = serde_json::from_str(value).map_err(|_| err())?;
        push_ids(&ids, out);
    }
    Ok(())
}

fn push_ids(ids: &[u64], out: &mut String) {
    use std::fmt::Write;
    for id in ids {
        let _ = write!(out, "{id} ");
    }
}

fn render_message(m: &Message, out: &mut String) -> Result<(), InvalidRequest> {
    out.push('\u{1e}');
    out.push_str(m.role.as_deref().or(m.kind.as_deref()).unwrap_or(""));
    out.push('\u{1f}');
    if let Some(name) = &m.name {
        out.push_str(name);
        out.push('\u{1f}');
    }
    if let Some(content) = m.content.filter(|c| c.get() != "null") {
        let raw = content.get();
        if raw.starts_with('"') {
            out.push_str(&string(content, "content")?);
        } else if raw.starts_with('[') {
            let parts: Vec<&RawValue> = serde_json::from_str(raw)
                .map_err(|_| invalid("message `content` must be a string or a list of parts"))?;
            for part in parts {
                match serde_json::from_str::<Part>(part.get()) {
                    Ok(Part {
                        kind: Some(kind),
                        text: Some(text),
                    }) if kind == "text" || kind == "input_text" || kind == "output_text" => {
                        out.push_str(&text)
                    }
                    _ => out.push_str(part.get()),
                }
            }
        } else {
            return Err(invalid(
                "message `content` must be a string or a list of parts",
            ));
        }
    }
    if let Some(calls) = m.tool_calls.filter(|c| c.get() != "null") {
        out.push('\u{1d}');
        out.push_str(calls.get());
    }
    if let Some(id) = &m.tool_call_id {
        out.push('\u{1d}');
        out.push_str(id);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(endpoint: Endpoint, body: serde_json::Value) -> String {
        routing(endpoint, body.to_string().as_bytes()).unwrap().text
    }

    #[test]
    fn chat_turns_extend_each_others_strings() {
        let turn1 = json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ]});
        let turn2 = json!({"model": "m", "stream": true, "max_tokens": 9, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello.", "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "42", "tool_call_id": "1"},
        ]});
        assert!(
            routing(Endpoint::Chat, turn2.to_string().as_bytes())
                .unwrap()
                .stream
        );
        let (a, b) = (text(Endpoint::Chat, turn1), text(Endpoint::Chat, turn2));
        assert!(b.starts_with(&a), "{a:?} / {b:?}");
        assert_eq!(a, "m\n\u{1e}system\u{1f}Be brief.\u{1e}user\u{1f}Hi there");
        // Escapes in the JSON do not matter, only the decoded text.
        let escaped = r#"{"model":"m","messages":[{"role":"system","content":"Be\u0020brief."},{"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}]}"#;
        assert_eq!(routing(Endpoint::Chat, escaped.as_bytes()).unwrap().text, a);
    }

    #[test]
    fn tools_come_first_and_images_count() {
        let with_tools = text(
            Endpoint::Chat,
            json!({"model": "m", "tools": [{"type": "function"}],
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u1"}}]}]}),
        );
        assert!(with_tools.starts_with("m\n\u{1e}tools\u{1f}[{\"type\":\"function\"}]"));
        let other_image = text(
            Endpoint::Chat,
            json!({"model": "m", "tools": [{"type": "function"}],
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u2"}}]}]}),
        );
        assert_ne!(with_tools, other_image);
    }

    #[test]
    fn completion_prompts() {
        assert_eq!(
            text(
                Endpoint::Completions,
                json!({"model": "m", "prompt": "abc"})
            ),
            "m\nabc"
        );
        assert_eq!(
            text(
                Endpoint::Completions,
                json!({"model": "m", "prompt": ["abc", "zzz"]})
            ),
            "m\nabc"
        );
        assert_eq!(
            text(
                Endpoint::Completions,
                json!({"model": "m", "prompt": [1, 22, 333]})
            ),
            "m\n1 22 333 "
        );
        assert_eq!(
            text(
                Endpoint::Completions,
                json!({"model": "m", "prompt": [[7, 8], [9]]})
            ),
            "m\n7 8 "
        );
        assert_eq!(
            text(Endpoint::Embeddings, json!({"model": "m", "input": ["x"]})),
            "m\nx"
        );
        assert_eq!(
            text(
                Endpoint::Responses,
                json!({"model": "m", "instructions": "I", "input": "hello"})
            ),
            "m\n\u{1e}instructions\u{1f}I\u{1e}user\u{1f}hello"
        );
        assert_eq!(
            text(
                Endpoint::Responses,
                json!({"model": "m", "input": [{"role": "user", "content": "hi"}]})
            ),
            "m\n\u{1e}user\u{1f}hi"
        );
    }

    #[test]
    fn the_priority_is_written_first_and_the_rest_kept() {
        let body = br#" {"model": "m", "prompt": "{not a field}"}"#;
        let out = with_priority(body, -5);
        assert_eq!(
            &out[..],
            br#" {"priority":-5,"model": "m", "prompt": "{not a field}"}"#
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            json!({"priority": -5, "model": "m", "prompt": "{not a field}"})
        );
        assert_eq!(&with_priority(b"{ }", 3)[..], b"{\"priority\":3 }");
        assert!(!routing(Endpoint::Completions, body).unwrap().sets_priority);
        let own = br#"{"model": "m", "prompt": "x", "priority": 2}"#;
        assert!(routing(Endpoint::Completions, own).unwrap().sets_priority);
    }

    #[test]
    fn other_endpoints_only_need_the_model() {
        let r = routing(Endpoint::Other, br#"{"prompt": 5}"#).unwrap();
        assert_eq!(
            r,
            Routing {
                model: None,
                text: String::new(),
                stream: false,
                sets_priority: false,
                priority: None,
            }
        );
    }

    #[test]
    fn bad_bodies_are_400s() {
        for (endpoint, body) in [
            (Endpoint::Chat, &b"not json"[..]),
            (Endpoint::Chat, b"{\"model\": \"m\", \"messages\": ["),
            (Endpoint::Chat, b"[1, 2]"),
            (Endpoint::Chat, b"{\"messages\": []}"),
            (Endpoint::Chat, b"{\"model\": 5, \"messages\": []}"),
            (Endpoint::Chat, b"{\"model\": \"m\"}"),
            (Endpoint::Chat, b"{\"model\": \"m\", \"messages\": \"hi\"}"),
            (
                Endpoint::Chat,
                b"{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": 5}]}",
            ),
            (Endpoint::Completions, b"{\"model\": \"m\"}"),
            (Endpoint::Completions, b"{\"model\": \"m\", \"prompt\": []}"),
            (Endpoint::Completions, b"{\"model\": \"m\", \"prompt\": {}}"),
            (Endpoint::Completions, b"\xff\xfe"),
            (Endpoint::Completions, b""),
        ] {
            let err = routing(endpoint, body).unwrap_err();
            assert!(!err.0.is_empty(), "{:?}", String::from_utf8_lossy(body));
        }
    }
}
