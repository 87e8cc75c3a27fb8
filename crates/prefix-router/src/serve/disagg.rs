//! The request path of a disaggregated fleet: the prefill call before the decode call.
//!
//! vLLM's NixlConnector protocol: the prefill server gets the request as a whole answer of one
//! token with `kv_transfer_params: {do_remote_decode: true}`; its answer's
//! `kv_transfer_params` say where its KV blocks are; the decode server gets the client's
//! request with those parameters, pulls the blocks and answers as the client asked. The
//! client sees the decode server's answer alone (its usage counts the prompt once).
//!
//! A prefill that fails, times out or answers without parameters costs the client nothing:
//! the decode server gets the plain request and computes the prompt itself.

use std::sync::Arc;
use std::time::Instant;

use axum::http::{HeaderMap, Method, Uri};
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Map, Value};

use super::proxy;
use super::route::{begin_attempt, Attempt};
use super::Gateway;
use crate::core::disagg::PrefillPlan;
use crate::core::matches::PromptKey;
use crate::traces::RequestSpan;

/// The largest prefill answer read (one token and the transfer parameters).
const PREFILL_ANSWER_MAX: usize = 1 << 20;

/// The client's request as a prefill for a remote decode: one token, a whole answer, and the
/// parameters that make the server keep its blocks for a pull. None if the body is not a JSON
/// object (it was parsed before routing, so only a bug gets here).
pub fn prefill_body(body: &[u8]) -> Option<Bytes> {
    let mut fields: Map<String, Value> = serde_json::from_slice(body).ok()?;
    fields.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    fields.insert("stream".into(), Value::Bool(false));
    fields.remove("stream_options");
    fields.insert("max_tokens".into(), json!(1));
    if fields.contains_key("max_completion_tokens") {
        fields.insert("max_completion_tokens".into(), json!(1));
    }
    // A one-token answer cannot honour a minimum length.
    fields.remove("min_tokens");
    fields.remove("min_completion_tokens");
    serde_json::to_vec(&fields).ok().map(Bytes::from)
}

/// The client's request for the decode server, with the prefill's transfer parameters.
pub fn decode_body(body: &[u8], kv_transfer_params: &Value) -> Option<Bytes> {
    let mut fields: Map<String, Value> = serde_json::from_slice(body).ok()?;
    fields.insert("kv_transfer_params".into(), kv_transfer_params.clone());
    serde_json::to_vec(&fields).ok().map(Bytes::from)
}

/// The transfer parameters of a prefill's answer: an object that asks for a remote prefill.
fn transfer_params(answer: &[u8]) -> Option<Value> {
    let answer: Value = serde_json::from_slice(answer).ok()?;
    let params = answer.get("kv_transfer_params")?;
    (params.get("do_remote_prefill").and_then(Value::as_bool) == Some(true)).then(|| params.clone())
}

/// What the prefill call needs of the request.
pub(crate) struct PrefillCall<'a> {
    pub plan: &'a PrefillPlan,
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub body: &'a Bytes,
    pub text_bytes: u64,
    pub prompt: Option<&'a PromptKey>,
    pub block_names: Option<&'a crate::core::events::BlockNames>,
    pub span: Option<&'a RequestSpan>,
}

/// Asks the plan's first prefill server to compute the prompt; returns the transfer
/// parameters for the decode server, or None (the decode server then computes it): every
/// failure is logged and counted, none reaches the client.
pub(crate) async fn prefill(gw: &Arc<Gateway>, call: PrefillCall<'_>) -> Option<Value> {
    let backend = call.plan.order.first()?;
    let Some(body) = prefill_body(call.body) else {
        gw.metrics.count_prefill(backend, "invalid");
        return None;
    };
    let mut guard = begin_attempt(
        gw,
        Attempt {
            backend,
            load_eased: None,
            uncached: call.plan.uncached.first().copied(),
            text_bytes: call.text_bytes,
            // Its answer comes when its prefill is done: that time teaches its prefill line.
            stream: true,
            teaches_line: true,
            prompt: call.prompt,
            block_names: call.block_names,
            span: call.span,
        },
        &mut None,
    )
    .await;
    let request = proxy::upstream_request(backend, call.method, call.uri, call.headers, body);
    let started = Instant::now();
    let outcome = tokio::time::timeout(
        gw.settings.pd_prefill_timeout,
        answer(gw, request, &mut guard),
    )
    .await;
    let (label, params) = match outcome {
        Err(_) => ("timeout", None),
        Ok(Err(why)) => (why, None),
        Ok(Ok(params)) => ("ok", Some(params)),
    };
    gw.metrics.count_prefill(backend, label);
    if params.is_none() {
        tracing::warn!(
            backend = backend.url(),
            outcome = label,
            after_ms = started.elapsed().as_millis() as u64,
            "the prefill server failed: the decode server computes the prompt itself"
        );
    }
    params
}

/// Sends the prefill request and reads its answer's transfer parameters.
async fn answer(
    gw: &Gateway,
    request: axum::http::Request<http_body_util::Full<Bytes>>,
    guard: &mut crate::core::backend::InflightGuard,
) -> Result<Value, &'static str> {
    let response = gw.client.request(request).await.map_err(|e| {
        if e.is_connect() {
            gw.core.backend_failed(guard.backend());
        }
        "unreachable"
    })?;
    if !response.status().is_success() {
        return Err("error");
    }
    let body = http_body_util::Limited::new(response.into_body(), PREFILL_ANSWER_MAX)
        .collect()
        .await
        .map_err(|_| "error")?
        .to_bytes();
    guard.first_byte(true);
    transfer_params(&body).ok_or("no_transfer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_asks_for_one_token_of_a_whole_answer() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},
                        "max_tokens":200,"max_completion_tokens":200,"min_tokens":5,"temperature":0}"#;
        let p: Value = serde_json::from_slice(&prefill_body(body).unwrap()).unwrap();
        assert_eq!(p["stream"], false);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(p["temperature"], 0);
        // A body without max_completion_tokens gets none.
        let p: Value =
            serde_json::from_slice(&prefill_body(br#"{"prompt":"x"}"#).unwrap()).unwrap();
        assert!(p.get("max_completion_tokens").is_none());
        assert!(prefill_body(b"[1]").is_none());
    }

    #[test]
    fn the_decode_gets_the_request_as_sent_with_the_parameters() {
        let params = json!({"do_remote_prefill": true, "remote_engine_id": "e"});
        let d: Value = serde_json::from_slice(
            &decode_body(br#"{"prompt":"x","stream":true,"max_tokens":9}"#, &params).unwrap(),
        )
        .unwrap();
        assert_eq!(d["stream"], true);
        assert_eq!(d["max_tokens"], 9);
        assert_eq!(d["kv_transfer_params"], params);
    }

    #[test]
    fn only_an_answer_asking_for_a_remote_prefill_carries_parameters() {
        let ok = br#"{"choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]]}}"#;
        assert!(transfer_params(ok).is_some());
        for no in [
            &br#"{"choices":[],"kv_transfer_params":null}"#[..],
            br#"{"choices":[]}"#,
            br#"{"kv_transfer_params":{"do_remote_prefill":false}}"#,
            b"not json",
        ] {
            assert!(transfer_params(no).is_none());
        }
    }
}
