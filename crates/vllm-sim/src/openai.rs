//! vLLM's OpenAI-compatible request and response shapes, as far as the simulator needs them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::config::SimConfig;
use crate::tokens::{AnswerLimits, TokenId};

/// An error in vLLM's JSON shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct SimError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
}

impl SimError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "BadRequestError",
            401 => "UnauthorizedError",
            404 => "NotFoundError",
            429 => "TooManyRequestsError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for SimError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Which generation endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A generation request, parsed and tokenized.
#[derive(Debug)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: String,
    /// One token sequence per choice (completions may carry several prompts).
    pub prompts: Vec<Vec<TokenId>>,
    pub limits: AnswerLimits,
    /// `max_tokens` exactly as given (for the render endpoints).
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub raw_stream_options: Value,
    /// What its `kv_transfer_params` ask (prefill/decode disaggregation).
    pub transfer: crate::disagg::Transfer,
}

fn field<'a>(body: &'a Value, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

fn usize_field(body: &Value, name: &'static str) -> Result<Option<usize>, SimError> {
    match field(body, name) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| SimError {
                param: Some(name),
                ..SimError::bad_request(format!("`{name}` must be a non-negative integer"))
            }),
    }
}

/// Parses the body of `/v1/completions` or `/v1/chat/completions` (unknown fields are ignored,
/// as vLLM does).
pub fn parse(endpoint: Endpoint, body: &Value, config: &SimConfig) -> Result<GenRequest, SimError> {
    if !body.is_object() {
        return Err(SimError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    let model = match field(body, "model") {
        None => config.model.clone(),
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(SimError::bad_request("`model` must be a string")),
    };
    if model != config.model {
        return Err(SimError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        });
    }
    let prompts = match endpoint {
        Endpoint::Completions => completion_prompts(field(body, "prompt"), &config.text)?,
        Endpoint::Chat => {
            let Some(Value::Array(messages)) = field(body, "messages") else {
                return Err(SimError {
                    param: Some("messages"),
                    ..SimError::bad_request("`messages` must be a list of messages")
                });
            };
            if messages.iter().any(|m| !m.is_object()) {
                return Err(SimError::bad_request("every message must be an object"));
            }
            vec![config.text.chat(body).map_err(SimError::bad_request)?]
        }
    };
    if field(body, "n").and_then(Value::as_u64).unwrap_or(1) != 1 {
        return Err(SimError::bad_request("the simulator supports only n = 1"));
    }
    let max_tokens = match usize_field(body, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => usize_field(body, "max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(SimError {
            param: Some("max_tokens"),
            ..SimError::bad_request("max_tokens must be at least 1, got 0.")
        });
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if longest + max_tokens.unwrap_or(1) > config.max_model_len {
        return Err(SimError::bad_request(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion).",
            config.max_model_len,
            longest + max_tokens.unwrap_or(1),
            longest,
            max_tokens.unwrap_or(1)
        )));
    }
    let stop = match field(body, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| SimError::bad_request("`stop` must be a string or a list of strings"))?,
        Some(_) => {
            return Err(SimError::bad_request(
                "`stop` must be a string or a list of strings",
            ))
        }
    };
    let stream = match field(body, "stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(SimError::bad_request("`stream` must be a boolean")),
    };
    let raw_stream_options = field(body, "stream_options")
        .cloned()
        .unwrap_or(Value::Null);
    let include_usage = raw_stream_options
        .get("include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(GenRequest {
        endpoint,
        model,
        limits: AnswerLimits {
            max_tokens: max_tokens.unwrap_or(config.max_model_len - longest),
            min_tokens: usize_field(body, "min_tokens")?.unwrap_or(0),
            ignore_eos: field(body, "ignore_eos")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            stop,
        },
        max_tokens,
        prompts,
        stream,
        include_usage,
        raw_stream_options,
        transfer: crate::disagg::parse(body)?,
    })
}

fn completion_prompts(
    prompt: Option<&Value>,
    text: &crate::text::TextModel,
) -> Result<Vec<Vec<TokenId>>, SimError> {
    let invalid = || {
        SimError {
        param: Some("prompt"),
        ..SimError::bad_request(
            "`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    }
    };
    let ids =
        |items: &[Value]| -> Option<Vec<TokenId>> { items.iter().map(Value::as_u64).collect() };
    match prompt {
        Some(Value::String(s)) => Ok(vec![text.prompt(s).map_err(SimError::bad_request)?]),
        Some(Value::Array(items)) if items.is_empty() => Err(invalid()),
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
            Ok(vec![ids(items).ok_or_else(invalid)?])
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => text.prompt(s).map_err(SimError::bad_request),
                Value::Array(inner) => ids(inner).ok_or_else(invalid),
                _ => Err(invalid()),
            })
            .collect(),
        _ => Err(invalid()),
    }
}

/// `usage` as vLLM reports it (with `prompt_tokens_details.cached_tokens`).
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// One finished choice.
pub struct ChoiceOutcome {
    pub text: String,
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// The choice's end-to-end latency in simulated seconds, for `vllm:e2e_request_latency_seconds`.
    pub e2e_secs: f64,
}

/// The non-streaming answer.
/// A whole answer; `kv_transfer_params` is what a prefill for a remote decode tells it.
pub fn full_response(
    req: &GenRequest,
    id: &str,
    created: u64,
    choices: &[ChoiceOutcome],
    kv_transfer_params: Value,
) -> Value {
    let (p, c, k) = choices.iter().fold((0, 0, 0), |(p, c, k), o| {
        (
            p + o.prompt_tokens,
            c + o.completion_tokens,
            k + o.cached_tokens,
        )
    });
    match req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": req.model,
            "choices": choices.iter().enumerate().map(|(i, o)| json!({
                "index": i, "text": o.text, "logprobs": null,
                "finish_reason": o.finish_reason, "stop_reason": null, "prompt_logprobs": null,
            })).collect::<Vec<_>>(),
            "usage": usage(p, c, k),
            "kv_transfer_params": kv_transfer_params,
        }),
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion", "created": created, "model": req.model,
            "choices": choices.iter().enumerate().map(|(i, o)| json!({
                "index": i,
                "message": {"role": "assistant", "content": o.text, "refusal": null,
                            "annotations": null, "audio": null, "function_call": null,
                            "tool_calls": [], "reasoning_content": null},
                "logprobs": null, "finish_reason": o.finish_reason, "stop_reason": null,
            })).collect::<Vec<_>>(),
            "service_tier": null, "system_fingerprint": null,
            "usage": usage(p, c, k),
            "prompt_logprobs": null, "kv_transfer_params": kv_transfer_params,
        }),
    }
}

/// One SSE event, `data: {json}\n\n`.
pub fn sse(value: &Value) -> bytes::Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut out, value).expect("JSON values serialize");
    out.extend_from_slice(b"\n\n");
    out.into()
}

pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// A streaming chunk carrying `text` (and the finish reason on the last one).
pub fn stream_chunk(
    req: &GenRequest,
    id: &str,
    created: u64,
    index: usize,
    text: &str,
    finish_reason: Option<&str>,
) -> Value {
    match req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": index, "text": text, "logprobs": null,
                         "finish_reason": finish_reason, "stop_reason": null}],
        }),
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "choices": [{"index": index, "delta": {"content": text}, "logprobs": null,
                         "finish_reason": finish_reason}],
        }),
    }
}

/// The chat stream's first chunk: the assistant role with empty content.
pub fn role_chunk(req: &GenRequest, id: &str, created: u64, index: usize) -> Value {
    json!({
        "id": id, "object": "chat.completion.chunk", "created": created, "model": req.model,
        "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": null, "finish_reason": null}],
    })
}

/// The final chunk with `usage` and no choices (`stream_options.include_usage`).
pub fn usage_chunk(req: &GenRequest, id: &str, created: u64, usage: Value) -> Value {
    let object = match req.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    json!({"id": id, "object": object, "created": created, "model": req.model,
           "choices": [], "usage": usage})
}

/// vLLM's render answer (a `GenerateRequest`) for one prompt.
pub fn render_response(req: &GenRequest, prompt: &[TokenId], request_id: &str) -> Value {
    json!({
        "request_id": request_id,
        "token_ids": prompt,
        "features": null,
        "sampling_params": {
            "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0, "seed": null, "stop": req.limits.stop, "stop_token_ids": [],
            "ignore_eos": req.limits.ignore_eos, "max_tokens": req.max_tokens,
            "min_tokens": req.limits.min_tokens, "logprobs": null, "prompt_logprobs": null,
            "skip_special_tokens": true, "spaces_between_special_tokens": true,
        },
        "model": req.model,
        "stream": req.stream,
        "stream_options": req.raw_stream_options,
        "cache_salt": null,
        "priority": 0,
        "kv_transfer_params": null,
    })
}
