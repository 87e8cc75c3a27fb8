//! Token ids exactly as vLLM computes them for a request: chat messages normalized as vLLM's
//! `parse_chat_messages` does, rendered through the model's chat template the way
//! `transformers`' `apply_chat_template` renders it (Jinja with `trim_blocks`, `lstrip_blocks`,
//! Python's `json.dumps` as `tojson`), then tokenized with the model's `tokenizer.json`.
//!
//! What cannot be reproduced exactly (images and other non-text parts, a template this Jinja
//! engine cannot run, a `developer` role the template does not know) is an error
//! ([`TokenizeError::Unsupported`]), never a guess: callers fall back to matching strings.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as Jinja};

use crate::word_encoder::WordEncoder;
use serde_json::{Map, Value};

/// Why token ids could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot load the tokenizer from {dir}: {reason}")]
    Load { dir: PathBuf, reason: String },
    #[error("the model has no chat template")]
    NoTemplate,
    #[error("the chat template does not compile: {0}")]
    Template(String),
    #[error("this request's rendering cannot be reproduced: {0}")]
    Unsupported(String),
    #[error("the chat template failed on this request: {0}")]
    Render(String),
    #[error("tokenizing failed: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat template.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The direct path to the same ids, where the tokenizer is of its kind.
    words: Option<WordEncoder>,
    env: Option<Environment<'static>>,
    /// The template iterates over message contents (vLLM's "openai" content format): text
    /// parts stay a list of `{type, text}`; otherwise they are joined with newlines.
    content_as_parts: bool,
    /// The template knows the `developer` role (else vLLM turns it into `system`).
    developer_role: bool,
    /// `bos_token`, `eos_token`, ... from `tokenizer_config.json`, given to the template.
    special_tokens: Map<String, Value>,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer").finish_non_exhaustive()
    }
}

fn load_error(dir: &Path, reason: impl ToString) -> TokenizeError {
    TokenizeError::Load {
        dir: dir.to_owned(),
        reason: reason.to_string(),
    }
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and the chat template
    /// (`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Arc<Self>, TokenizeError> {
        let mut tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| load_error(dir, format!("tokenizer.json: {e}")))?;
        split_into_words(&mut tokenizer);
        let words = WordEncoder::new(&tokenizer);
        let config: Map<String, Value> = match std::fs::read(dir.join("tokenizer_config.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| load_error(dir, format!("tokenizer_config.json: {e}")))?,
            Err(_) => Map::new(),
        };
        let template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => config
                .get("chat_template")
                .and_then(Value::as_str)
                .map(str::to_owned),
        };
        let mut special_tokens = Map::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            let token = match config.get(key) {
                Some(Value::String(s)) => Some(s.clone()),
                // AddedToken objects: {"content": "<s>", ...}
                Some(Value::Object(o)) => {
                    o.get("content").and_then(Value::as_str).map(str::to_owned)
                }
                _ => None,
            };
            if let Some(t) = token {
                special_tokens.insert(key.to_owned(), Value::String(t));
            }
        }
        let (env, content_as_parts, developer_role) = match template {
            None => (None, false, false),
            Some(source) => {
                let parts = iterates_over_content(&source);
                let developer = source.contains("\"developer\"") || source.contains("'developer'");
                (Some(environment(source)?), parts, developer)
            }
        };
        Ok(Arc::new(Self {
            tokenizer,
            words,
            env,
            content_as_parts,
            developer_role,
            special_tokens,
        }))
    }

    /// The prompt text of a chat request, as vLLM renders it.
    pub fn render_chat(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> Result<String, TokenizeError> {
        let env = self.env.as_ref().ok_or(TokenizeError::NoTemplate)?;
        if continue_final_message {
            // transformers cuts the rendering after the final message's content.
            return Err(TokenizeError::Unsupported("continue_final_message".into()));
        }
        let conversation = self.conversation(messages)?;
        let mut context = self.special_tokens.clone();
        context.insert("messages".into(), Value::Array(conversation));
        let tools = match tools.filter(|t| !t.is_null()) {
            Some(t) => normalize_tools(t)?,
            None => Value::Null,
        };
        context.insert("tools".into(), tools);
        context.insert("documents".into(), Value::Null);
        context.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        context.insert(
            "continue_final_message".into(),
            Value::Bool(continue_final_message),
        );
        let template = env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        template
            .render(Jinja::from(minijinja::value::Serde(&context)))
            .map_err(|e| TokenizeError::Render(e.to_string()))
    }

    /// Token ids of `text`. vLLM encodes a rendered chat prompt without adding special
    /// tokens (the template has them) and a completions prompt with them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        if let Some(words) = &self.words {
            return words
                .encode(self.tokenizer.get_model(), text, add_special_tokens)
                .map_err(TokenizeError::Encode);
        }
        self.encode_by_pipeline(text, add_special_tokens)
    }

    /// [`ChatTokenizer::encode`] through the `tokenizers` pipeline (the reference the direct
    /// path is checked against).
    pub fn encode_by_pipeline(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The text of token ids, as vLLM detokenizes an answer.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The id of `token` if it is one token of the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Token ids of a chat request body (`messages`, `tools`, `add_generation_prompt`, ...).
    pub fn chat_ids(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        let flag =
            |name: &str, default: bool| body.get(name).and_then(Value::as_bool).unwrap_or(default);
        if body.get("chat_template").is_some_and(|t| !t.is_null())
            || body
                .get("chat_template_kwargs")
                .is_some_and(|t| !t.is_null())
        {
            return Err(TokenizeError::Unsupported(
                "a chat template or its arguments given in the request".into(),
            ));
        }
        let messages = body
            .get("messages")
            .ok_or_else(|| TokenizeError::Unsupported("no messages".into()))?;
        let text = self.render_chat(
            messages,
            body.get("tools"),
            flag("add_generation_prompt", true),
            flag("continue_final_message", false),
        )?;
        self.encode(&text, flag("add_special_tokens", false))
    }

    /// Token ids of a completions prompt: a string (tokenized with special tokens) or token
    /// ids (as given). Lists of prompts: the first.
    pub fn prompt_ids(&self, prompt: &Value) -> Result<Vec<u32>, TokenizeError> {
        let ids = |v: &[Value]| -> Option<Vec<u32>> {
            v.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect()
        };
        match prompt {
            Value::String(s) => self.encode(s, true),
            Value::Array(items) => match items.first() {
                Some(Value::String(s)) => self.encode(s, true),
                Some(Value::Array(first)) => ids(first)
                    .ok_or_else(|| TokenizeError::Unsupported("token ids out of range".into())),
                Some(Value::Number(_)) => ids(items)
                    .ok_or_else(|| TokenizeError::Unsupported("token ids out of range".into())),
                _ => Err(TokenizeError::Unsupported("an empty or odd prompt".into())),
            },
            _ => Err(TokenizeError::Unsupported(
                "a prompt that is not text or ids".into(),
            )),
        }
    }

    /// vLLM's `parse_chat_messages` for text-only conversations.
    fn conversation(&self, messages: &Value) -> Result<Vec<Value>, TokenizeError> {
        let unsupported = |why: &str| TokenizeError::Unsupported(why.to_owned());
        let messages = messages
            .as_array()
            .ok_or_else(|| unsupported("messages is not a list"))?;
        let mut out = Vec::with_capacity(messages.len());
        for message in messages {
            let message = message
                .as_object()
                .ok_or_else(|| unsupported("a message is not an object"))?;
            let role = message
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| unsupported("a message without a role"))?;
            if role == "developer" && !self.developer_role {
                return Err(unsupported(
                    "a developer message for a template without that role",
                ));
            }
            let texts: Vec<&str> = match message.get("content") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::String(s)) => vec![s.as_str()],
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|part| match part {
                        Value::String(s) => Ok(s.as_str()),
                        Value::Object(p)
                            if matches!(
                                p.get("type").and_then(Value::as_str),
                                Some("text") | Some("input_text") | Some("output_text") | None
                            ) && p.get("text").is_some_and(Value::is_string) =>
                        {
                            Ok(p["text"].as_str().unwrap_or_default())
                        }
                        _ => Err(unsupported("a non-text content part")),
                    })
                    .collect::<Result<_, _>>()?,
                Some(_) => return Err(unsupported("content that is not text or parts")),
            };
            if role == "system"
                && texts
                    .first()
                    .is_some_and(|t| t.starts_with("x-anthropic-billing-header"))
            {
                return Err(unsupported("a billing header vLLM strips"));
            }
            let mut result = Map::new();
            result.insert("role".into(), Value::String(role.to_owned()));
            let content = if self.content_as_parts && role != "tool" {
                Value::Array(
                    texts
                        .iter()
                        .map(|t| serde_json::json!({"type": "text", "text": t}))
                        .collect(),
                )
            } else {
                Value::String(texts.join("\n"))
            };
            result.insert("content".into(), content);
            match role {
                "assistant" => {
                    if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
                        result.insert("tool_calls".into(), tool_calls(calls)?);
                    }
                    if let Some(r) = message.get("reasoning").filter(|r| !r.is_null()) {
                        result.insert("reasoning".into(), r.clone());
                        result.insert("reasoning_content".into(), r.clone());
                    }
                }
                "tool" => {
                    if let Some(id) = message.get("tool_call_id") {
                        result.insert("tool_call_id".into(), id.clone());
                    }
                }
                _ => {}
            }
            for key in ["name", "task"] {
                if let Some(Value::String(v)) = message.get(key) {
                    result.insert(key.into(), Value::String(v.clone()));
                }
            }
            if role == "developer" {
                result.insert(
                    "tools".into(),
                    message.get("tools").cloned().unwrap_or(Value::Null),
                );
            }
            if result
                .get("tool_calls")
                .is_some_and(|c| c.as_array().is_some_and(Vec::is_empty))
            {
                result.remove("tool_calls");
            }
            out.push(Value::Object(result));
        }
        Ok(out)
    }
}

/// Copies the keys of `from` named in `keys`, in that order (pydantic rebuilds request
/// objects in its models' field order and drops what they do not declare).
fn pick(from: &Map<String, Value>, keys: &[&str]) -> Map<String, Value> {
    let mut out = Map::new();
    for key in keys {
        if let Some(v) = from.get(*key) {
            out.insert((*key).to_owned(), v.clone());
        }
    }
    out
}

/// Makes a SentencePiece-style tokenizer (`Metaspace` without splitting, as transformers
/// converts Llama and Mistral tokenizers) split its input into words before BPE, where that
/// cannot change a single id: BPE only merges adjacent symbols into vocabulary tokens, so if no
/// token of the vocabulary has a `▁` after another character, no merge ever crosses the start
/// of a `▁`-run, and cutting the input there gives the same ids. Words are then merged one by
/// one (and cached), instead of the whole prompt as one word, which costs time quadratic-ish in
/// its length (2 ms for 8 KiB here, against some tens of µs).
fn split_into_words(tokenizer: &mut tokenizers::Tokenizer) {
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::SplitDelimiterBehavior;
    let Some(PreTokenizerWrapper::Metaspace(meta)) = tokenizer.get_pre_tokenizer() else {
        return;
    };
    if meta.get_split() {
        return;
    }
    let mark = meta.get_replacement();
    let crosses = tokenizer.get_vocab(false).keys().any(|token| {
        let mut previous: Option<char> = None;
        token.chars().any(|c| {
            let crossing = c == mark && previous.is_some_and(|p| p != mark);
            previous = Some(c);
            crossing
        })
    });
    if crosses {
        return;
    }
    let meta = meta.clone();
    let Ok(words) = Split::new(
        SplitPattern::Regex(format!("{}+", regex_escape(mark))),
        SplitDelimiterBehavior::MergedWithNext,
        false,
    ) else {
        return;
    };
    tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Metaspace(meta),
        PreTokenizerWrapper::Split(words),
    ]))));
}

fn regex_escape(c: char) -> String {
    if c.is_alphanumeric() || !c.is_ascii() {
        c.to_string()
    } else {
        format!("\\{c}")
    }
}

/// Assistant tool calls as vLLM passes them to templates: `{id, function: {arguments, name},
/// type}` (the OpenAI types' field order), with `arguments` parsed into an object (malformed
/// or non-object arguments become `{}`).
fn tool_calls(calls: &Value) -> Result<Value, TokenizeError> {
    let unsupported = |why: &str| TokenizeError::Unsupported(why.to_owned());
    let Value::Array(items) = calls else {
        return Err(unsupported("tool_calls is not a list"));
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let item = item
            .as_object()
            .ok_or_else(|| unsupported("a tool call that is not an object"))?;
        let Some(Value::Object(function)) = item.get("function") else {
            return Err(unsupported("a tool call without a function"));
        };
        let mut function = pick(function, &["arguments", "name"]);
        let parsed = match function.get("arguments") {
            Some(Value::Object(o)) => Value::Object(o.clone()),
            Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(o)) => Value::Object(o),
                _ => Value::Object(Map::new()),
            },
            _ => Value::Object(Map::new()),
        };
        function.insert("arguments".into(), parsed);
        let mut call = pick(item, &["id", "function", "type"]);
        call.insert("function".into(), Value::Object(function));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

/// The request's tools as vLLM passes them to templates (`model_dump()` of its
/// `ChatCompletionToolsParam`): `{type, function: {name, description, parameters}}` with
/// absent descriptions and parameters as nulls.
fn normalize_tools(tools: &Value) -> Result<Value, TokenizeError> {
    let unsupported = |why: &str| TokenizeError::Unsupported(why.to_owned());
    let Value::Array(items) = tools else {
        return Err(unsupported("tools is not a list"));
    };
    let mut out = Vec::with_capacity(items.len());
    for tool in items {
        let tool = tool
            .as_object()
            .ok_or_else(|| unsupported("a tool that is not an object"))?;
        let Some(Value::Object(function)) = tool.get("function") else {
            return Err(unsupported("a tool without a function"));
        };
        if !function.get("name").is_some_and(Value::is_string) {
            return Err(unsupported("a tool function without a name"));
        }
        let mut f = Map::new();
        for key in ["name", "description", "parameters"] {
            f.insert(
                key.into(),
                function.get(key).cloned().unwrap_or(Value::Null),
            );
        }
        for key in ["strict", "defer_loading"] {
            if let Some(v) = function.get(key).filter(|v| !v.is_null()) {
                f.insert(key.into(), v.clone());
            }
        }
        let mut t = Map::new();
        t.insert(
            "type".into(),
            tool.get("type")
                .cloned()
                .unwrap_or_else(|| Value::from("function")),
        );
        t.insert("function".into(), Value::Object(f));
        if let Some(v) = tool.get("defer_loading").filter(|v| !v.is_null()) {
            t.insert("defer_loading".into(), v.clone());
        }
        out.push(Value::Object(t));
    }
    Ok(Value::Array(out))
}

/// vLLM's content-format detection, simplified: a template that loops over a message's
/// `content` takes the parts as a list.
fn iterates_over_content(template: &str) -> bool {
    let compact: String = template.chars().filter(|c| !c.is_whitespace()).collect();
    [
        "in message['content']",
        "in message[\"content\"]",
        "in message.content",
        "in m['content']",
        "in m.content",
        "in content",
    ]
    .iter()
    .any(|pattern| {
        let pattern: String = pattern.chars().filter(|c| !c.is_whitespace()).collect();
        compact.contains(&pattern)
    })
}

/// The Jinja environment transformers renders chat templates in.
fn environment(source: String) -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizeError::Template(e.to_string()))?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Jinja, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_template_owned("chat", source)
        .map_err(|e| TokenizeError::Template(e.to_string()))?;
    Ok(env)
}

/// `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False)`, with
/// `", "` and `": "` between items, optional `indent`, no HTML escaping.
fn tojson(value: Jinja, kwargs: minijinja::value::Kwargs) -> Result<Jinja, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<Jinja> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut json: Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if sort_keys == Some(true) {
        sort(&mut json);
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter::new(indent));
    serde::Serialize::serialize(&json, &mut ser)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Jinja::from_safe_string(
        String::from_utf8(out).expect("serde_json writes UTF-8"),
    ))
}

fn sort(v: &mut Value) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = std::mem::take(map).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut v) in entries {
                sort(&mut v);
                map.insert(k, v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(sort),
        _ => {}
    }
}

/// Writes JSON as Python's `json.dumps` does: `", "` and `": "` separators, or its indented
/// layout (`","` at line ends) with `indent`.
struct PythonFormatter {
    indent: Option<usize>,
    depth: usize,
    has_value: bool,
}

impl PythonFormatter {
    fn new(indent: Option<usize>) -> Self {
        Self {
            indent,
            depth: 0,
            has_value: false,
        }
    }

    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..n * self.depth {
                w.write_all(b" ")?;
            }
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn python(v: &Value, indent: Option<usize>) -> String {
        let mut out = Vec::new();
        let mut ser =
            serde_json::Serializer::with_formatter(&mut out, PythonFormatter::new(indent));
        serde::Serialize::serialize(v, &mut ser).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn tojson_writes_like_python() {
        let v = json!({"a": [1, 2, {"b": "é\"\n<"}], "c": {}, "d": []});
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            python(&v, None),
            r#"{"a": [1, 2, {"b": "é\"\n<"}], "c": {}, "d": []}"#
        );
        // json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(
            python(&v, Some(2)),
            "{\n  \"a\": [\n    1,\n    2,\n    {\n      \"b\": \"é\\\"\\n<\"\n    }\n  ],\n  \"c\": {},\n  \"d\": []\n}"
        );
    }

    /// A small SentencePiece-style tokenizer (Metaspace without splitting, BPE with byte
    /// fallback, `<s>` and `</s>` added), written to a directory as `transformers` would.
    fn sentencepiece_like(dir: &Path) {
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
        let mut vocab: std::collections::HashMap<String, u32> = Default::default();
        let mut add = |t: &str| {
            let n = vocab.len() as u32;
            vocab.entry(t.to_owned()).or_insert(n);
        };
        for t in ["<unk>", "<s>", "</s>"] {
            add(t);
        }
        for b in 0..=255u8 {
            add(&format!("<0x{b:02X}>"));
        }
        let merges: Vec<(&str, &str)> = vec![
            ("▁", "t"),
            ("h", "e"),
            ("▁t", "he"),
            ("▁", "a"),
            ("a", "b"),
            ("▁", "▁"),
            ("▁▁", "▁"),
            ("▁", "ab"),
            ("c", "d"),
            ("cd", "e"),
            ("d", "e"),
            ("▁", "c"),
            ("▁c", "de"),
        ];
        for c in ["▁", "t", "h", "e", "a", "b", "c", "d", "\n", "x"] {
            add(c);
        }
        for (a, b) in &merges {
            add(&format!("{a}{b}"));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(
                vocab
                    .into_iter()
                    .collect::<tokenizers::models::bpe::Vocab>(),
                merges
                    .iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect(),
            )
            .unk_token("<unk>".into())
            .byte_fallback(true)
            .build()
            .unwrap();
        let mut t = tokenizers::Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, false)));
        t.add_special_tokens(&[
            tokenizers::AddedToken::from("<s>", true),
            tokenizers::AddedToken::from("</s>", true),
        ]);
        t.save(dir.join("tokenizer.json"), false).unwrap();
    }

    #[test]
    fn the_direct_encoder_gives_the_pipelines_ids() {
        let dir = std::env::temp_dir().join(format!("vllm-protocol-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        sentencepiece_like(&dir);
        let ours = ChatTokenizer::from_dir(&dir).unwrap();
        assert!(ours.words.is_some(), "the direct path is taken");
        let reference = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        const PIECES: [&str; 14] = [
            "the", " the", "ab", " ab", "  ", "   ", " ", "\n", "cde", " cde", "é", "<s>", "</s>",
            "zz",
        ];
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..2000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let len = (s % 12) as usize;
            let text: String = (0..len)
                .map(|i| PIECES[((s >> (4 * i)) % PIECES.len() as u64) as usize])
                .collect();
            for special in [false, true] {
                let expected = reference.encode(text.as_str(), special).unwrap();
                assert_eq!(
                    ours.encode(&text, special).unwrap(),
                    expected.get_ids(),
                    "{text:?} special={special}"
                );
            }
        }
    }

    /// Long unique "words" (a base64 blob, a run without spaces) are tokenized but not kept,
    /// and what is kept is bounded in bytes, not in entries.
    #[test]
    fn the_word_cache_is_bounded_in_bytes() {
        let dir = std::env::temp_dir().join(format!("vllm-protocol-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        sentencepiece_like(&dir);
        let ours = ChatTokenizer::from_dir(&dir).unwrap();
        let words = ours.words.as_ref().unwrap();
        let reference = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        for i in 0..4u32 {
            // 64 kB, one word, unique per request.
            let blob: String = std::iter::repeat_n("ab", 32 << 10)
                .chain(std::iter::once(format!("cd{i}").as_str()))
                .collect();
            let ids = ours.encode(&blob, false).unwrap();
            if i == 0 {
                assert_eq!(
                    ids,
                    reference.encode(blob.as_str(), false).unwrap().get_ids()
                );
            }
        }
        assert!(
            words.cached_bytes() < 64 << 10,
            "{} bytes cached after 4 long words",
            words.cached_bytes()
        );
        // Many distinct short words: the cache stays within its byte bound.
        for i in 0..100_000u32 {
            ours.encode(&format!("x{i:x}"), false).unwrap();
        }
        assert!(words.cached_bytes() <= 16 << 20, "{}", words.cached_bytes());
    }

    #[test]
    fn content_format_detection() {
        assert!(iterates_over_content(
            "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
        ));
        assert!(!iterates_over_content("{{ message['content'] }}"));
    }

    #[test]
    fn tool_call_arguments_become_objects() {
        let calls = json!([
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
        ]);
        let out = tool_calls(&calls).unwrap();
        assert_eq!(out[0]["function"]["arguments"], json!({"x": 1}));
        let keys: Vec<&String> = out[0]["function"].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["arguments", "name"]);
        assert_eq!(out[1]["function"]["arguments"], json!({}));
        assert_eq!(out[2]["function"]["arguments"], json!({}));
    }
}
