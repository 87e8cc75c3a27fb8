//! What a request body yields before any decision: its routing facts (model, request string,
//! stream), its string-index key and, in precise mode, its token ids as vLLM computes them.
//!
//! This is the CPU-heavy part of a request (JSON parsing, hashing, chat-template rendering and
//! tokenization grow with the prompt). A large body is prepared on a blocking thread, at most
//! as many at once as the machine has cores, so that a few multi-megabyte prompts neither stall
//! the async workers (the liveness probe waited 2.45 s behind four 2 MB prompts) nor hold the
//! gateway queue's one place in transit (they are prepared before admission).

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::metrics::FallbackLabels;
use super::request_string::{self, Endpoint, Routing};
use super::Gateway;
use crate::api_error::ApiError;
use crate::core::matches::PromptKey;

/// Bodies up to this size are prepared on the request's own task: a blocking thread costs
/// more than their work.
const INLINE_BYTES: usize = 64 << 10;

/// A prepared request.
pub(crate) struct Prepared {
    pub routing: Routing,
    /// What the string index matches (prefix policies, generation endpoints).
    pub prompt: Option<PromptKey>,
    /// Its token ids exactly as vLLM computes them (precise mode), when the router could.
    pub tokens: Option<Vec<u32>>,
}

/// Prepares `body` for `endpoint`: a 400 in OpenAI's shape if it is no valid request.
pub(crate) async fn prepare(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    body: &Bytes,
) -> Result<Prepared, Response> {
    let result = if body.len() <= INLINE_BYTES {
        prepare_now(gw, endpoint, body)
    } else {
        // Waiting for a slot is async: the workers stay free.
        let _slot = gw
            .cpu_slots
            .acquire()
            .await
            .expect("the slots are never closed");
        let (gw, body) = (gw.clone(), body.clone());
        tokio::task::spawn_blocking(move || prepare_now(&gw, endpoint, &body))
            .await
            .unwrap_or_else(|e| {
                Err(ApiError::new(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("preparing the request failed: {e}"),
                ))
            })
    };
    result.map_err(IntoResponse::into_response)
}

fn prepare_now(gw: &Gateway, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let routing = request_string::routing(endpoint, body)?;
    let prompt = (gw.core.uses_prefixes() && endpoint != Endpoint::Other)
        .then(|| gw.core.strings.key(&routing.text));
    let tokens = if gw.core.events.is_some() && gw.core.uses_prefixes() {
        token_ids(gw, endpoint, routing.model.as_deref(), body)
    } else {
        None
    };
    Ok(Prepared {
        routing,
        prompt,
        tokens,
    })
}

/// The request's token ids exactly as vLLM computes them, or None (counted) where this router
/// cannot: no tokenizer for the model, an endpoint or a request it cannot reproduce, a body
/// above `--tokenize-max-bytes`.
fn token_ids(
    gw: &Gateway,
    endpoint: Endpoint,
    model: Option<&str>,
    body: &[u8],
) -> Option<Vec<u32>> {
    let fallback = |reason| {
        gw.metrics
            .tokenize_fallbacks
            .get_or_create(&FallbackLabels { reason })
            .inc();
        None
    };
    let Some(tokenizer) = model.and_then(|m| gw.tokenizers.get(m)) else {
        return fallback("no_tokenizer");
    };
    if body.len() > gw.settings.tokenize_max_bytes {
        return fallback("too_long");
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return fallback("unsupported");
    };
    let ids = match endpoint {
        Endpoint::Chat => tokenizer.chat_ids(&value),
        Endpoint::Completions => tokenizer.prompt_ids(&value["prompt"]),
        _ => return fallback("endpoint"),
    };
    match ids {
        Ok(ids) => Some(ids),
        Err(e) => {
            tracing::debug!(error = %e, "token ids not reproducible: matching by strings");
            fallback("unsupported")
        }
    }
}
