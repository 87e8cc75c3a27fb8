//! The HTTP request path: read the body, build the request string, ask the core where the
//! request goes, forward it (moving on after a failure while nothing reached the client), and
//! count it. Errors become OpenAI-shaped responses here, at the edge.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::disagg;
use super::metrics::{model_label, Label, RequestLabels, UNKNOWN_MODEL};
use super::prepare::{prepare, Prepared};
use super::proxy;
use super::request_string::{self, Endpoint, InvalidRequest, Routing};
use super::Gateway;
use crate::api_error::ApiError;
use crate::core::admission::{Permit, Refused, Ticket};
use crate::core::backend::{Backend, InflightGuard};
use crate::core::matches::PromptKey;
use crate::core::policy::{prefill_work, ttft_after_queue};
use crate::core::prefill::FirstByte;
use crate::core::RequestInput;
use crate::json_body::read_body;
use crate::tenants::{Limited, Tenant, TenantGuard};
use crate::traces::RequestSpan;
use opentelemetry::KeyValue;

impl From<InvalidRequest> for ApiError {
    fn from(e: InvalidRequest) -> Self {
        ApiError::bad_request(e.0)
    }
}

fn bad_gateway(why: impl std::fmt::Display) -> Response {
    ApiError::new(StatusCode::BAD_GATEWAY, format!("backend failure: {why}")).into_response()
}

use crate::core::admission::PRIORITIES;

/// The request's priority: its tenant's (the keys file), which `x-priority` may lower; without
/// a tenant, `x-priority` when `--trust-client-headers` says clients may set it; else 0.
fn priority(headers: &HeaderMap, tenant: Option<&Tenant>, trusted: bool) -> Result<i32, ApiError> {
    let ceiling = tenant.map(Tenant::priority);
    let value = match headers.get("x-priority") {
        Some(v) if tenant.is_some() || trusted => v,
        _ => return Ok(ceiling.unwrap_or(0)),
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .filter(|p| PRIORITIES.contains(p))
        .map(|p| ceiling.map_or(p, |c| p.min(c)))
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "x-priority must be an integer from {} to {}",
                PRIORITIES.start(),
                PRIORITIES.end()
            ))
        })
}

/// The request's tenant for the queue's turns: its tenant in the keys file, else the tenant
/// header when `--trust-client-headers`, else its bearer token (as a hash: the queue never
/// holds a key), else everyone without either is one tenant.
fn fairness_key(
    headers: &HeaderMap,
    tenant_header: &HeaderName,
    known: Option<&Tenant>,
    trusted: bool,
) -> u64 {
    if let Some(t) = known {
        return t.fairness_key;
    }
    let named = headers
        .get(tenant_header)
        .filter(|_| trusted)
        .map(|v| (1u8, v));
    let keyed = || {
        headers
            .get(axum::http::header::AUTHORIZATION)
            .map(|v| (2u8, v))
    };
    match named.or_else(keyed) {
        Some((kind, v)) => xxhash_rust::xxh3::xxh3_64_with_seed(v.as_bytes(), kind as u64),
        None => 0,
    }
}

/// A request the queue did not admit: 429 (full) or 503 (waited too long), with the time after
/// which a retry is likely to find room.
fn refused(r: Refused) -> Response {
    let (status, message, retry_after) = match r {
        Refused::Full { retry_after } => (
            StatusCode::TOO_MANY_REQUESTS,
            "every backend is saturated and the router's queue is full; retry later",
            retry_after,
        ),
        Refused::TimedOut { retry_after } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "every backend stayed saturated for as long as the router queues a request; retry later",
            retry_after,
        ),
    };
    let mut response = ApiError::new(status, message).into_response();
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        HeaderValue::from(retry_after.as_secs().max(1)),
    );
    response
}

/// A request its tenant's limits refuse: 429 with the time after which a retry may pass.
fn limited(tenant: &Tenant, why: Limited) -> Response {
    let (message, retry_after) = match why {
        Limited::Rate { retry_after } => (
            format!(
                "tenant {} is over its request rate; retry later",
                tenant.name
            ),
            retry_after,
        ),
        Limited::Concurrency => (
            format!(
                "tenant {} has as many requests in flight as it may; retry when one ends",
                tenant.name
            ),
            std::time::Duration::from_secs(1),
        ),
    };
    let mut response = ApiError::new(StatusCode::TOO_MANY_REQUESTS, message).into_response();
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        HeaderValue::from(retry_after.as_secs_f64().ceil().max(1.0) as u64),
    );
    response
}

/// A priority to write into a request's body for vLLM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VllmPriority {
    /// The body sets none: this one is added.
    Add(i64),
    /// The body asks for more than its tenant may: its own is replaced by this one.
    Replace(i64),
}

impl VllmPriority {
    pub fn write(self, body: &[u8]) -> bytes::Bytes {
        match self {
            VllmPriority::Add(p) => request_string::with_priority(body, p),
            VllmPriority::Replace(p) => request_string::replace_priority(body, p),
        }
    }
}

/// A request the core has placed: the choice, and what its sending and accounting need.
pub(crate) struct Placed {
    /// Streamed: the backend's head comes at once, so waiting for it is bounded.
    pub stream: bool,
    /// Length of its request string (against the prompt tokens the answer reports).
    pub text_bytes: u64,
    /// The metric label of its model.
    pub model: Arc<str>,
    /// Its admission: used up once the request is counted against a backend.
    pub permit: Permit,
    /// Its place under its tenant's concurrency cap, held until the answer ends.
    pub tenant_guard: Option<TenantGuard>,
    /// The priority to write into its body for vLLM (`--forward-priority`, or the tenant's
    /// ceiling over a body asking for more), if any.
    pub vllm_priority: Option<VllmPriority>,
    /// What the string index learns where it is sent.
    pub prompt: Option<PromptKey>,
    pub decision: crate::core::Decision,
}

/// Everything between a read body and the choice of backends, for every front end: the
/// request's priority and model, the candidates (only those `eligible` allows, when given),
/// its tenant's limits, the gateway queue, and the core's decision. A refusal is the
/// OpenAI-shaped response to answer with; nothing was taken or taught then.
pub(crate) async fn place(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    tenant: Option<&Arc<Tenant>>,
    body: &bytes::Bytes,
    eligible: Option<&(dyn Fn(&Backend) -> bool + Sync)>,
) -> Result<Placed, Response> {
    let trusted = gw.settings.trust_client_headers;
    let priority =
        priority(headers, tenant.map(|t| &**t), trusted).map_err(IntoResponse::into_response)?;
    // Parsed, hashed and tokenized before the queue: that work neither holds the queue's place
    // in transit nor runs on the async workers when the body is large.
    let Prepared {
        routing,
        prompt,
        tokens,
    } = prepare(gw, endpoint, body).await?;
    let mut candidates = gw.core.candidates(routing.model.as_deref());
    let known = candidates.model.is_some();
    // The label is a name some backend serves, or a constant: never the client's text.
    let model = candidates.model.unwrap_or_else(|| match routing.model {
        Some(_) => Arc::from(UNKNOWN_MODEL),
        None => Arc::from(""),
    });
    gw.metrics
        .incoming
        .get_or_create(&model_label(model.clone()))
        .inc();
    if let Some(eligible) = eligible {
        candidates.backends.retain(|b| eligible(b));
    }
    if candidates.backends.is_empty() {
        return Err(match (&routing.model, known) {
            (Some(m), false) => {
                ApiError::not_found(format!("The model `{m}` does not exist.")).into_response()
            }
            _ => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy backend serves this model",
            )
            .into_response(),
        });
    }
    // Within its tenant's rate and cap (held until the answer's last byte), or refused
    // before it waits or takes anything.
    let tenant_guard = match tenant {
        Some(t) => match t.admit(Instant::now()) {
            Ok(guard) => Some(guard),
            Err(why) => return Err(limited(t, why)),
        },
        None => None,
    };
    // Held here while the fleet is saturated; matched and routed once let go, on the state
    // it will meet.
    let permit = match &gw.admission {
        Some(admission) => {
            let ticket = Ticket {
                priority,
                tenant: fairness_key(
                    headers,
                    &gw.settings.tenant_header,
                    tenant.map(|t| &**t),
                    trusted,
                ),
                model: known.then(|| model.clone()),
            };
            admission.admit(ticket).await.map_err(refused)?
        }
        None => Permit::free(),
    };
    let released_under = gw.admission.as_ref().map(|a| a.bounds(priority));
    let decision = if endpoint == Endpoint::Other {
        gw.core.pick_by_load(candidates.backends)
    } else {
        let session = headers
            .get(&gw.settings.session_header)
            .and_then(|v| v.to_str().ok());
        gw.core
            .pick(
                candidates.backends,
                RequestInput {
                    session,
                    prompt: prompt.as_ref(),
                    text: Some(&routing.text),
                    tokens: tokens.as_deref(),
                    released_under: released_under.as_ref(),
                },
            )
            .await
    };
    let vllm_priority = vllm_priority(gw, endpoint, &routing, priority, tenant.map(|t| &**t));
    Ok(Placed {
        vllm_priority,
        stream: routing.stream,
        text_bytes: routing.text.len() as u64,
        model,
        permit,
        tenant_guard,
        prompt,
        decision,
    })
}

/// The priority to write into the body for vLLM (which serves lower values first; 0 by
/// default): the request's own with `--forward-priority`, unless the body sets one; and a
/// body asking for more than its tenant may (below minus its ceiling) is brought back to it,
/// so a capped tenant cannot jump vLLM's priority scheduler.
fn vllm_priority(
    gw: &Gateway,
    endpoint: Endpoint,
    routing: &Routing,
    priority: i32,
    tenant: Option<&Tenant>,
) -> Option<VllmPriority> {
    if endpoint == Endpoint::Other {
        return None;
    }
    if routing.sets_priority {
        let floor = -i64::from(tenant?.priority());
        return match routing.priority {
            Some(asked) if asked >= floor => None,
            // Above its ceiling, or no integer vLLM would take: the tenant's own.
            _ => Some(VllmPriority::Replace(floor)),
        };
    }
    (gw.settings.forward_priority && priority != 0).then(|| VllmPriority::Add(-i64::from(priority)))
}

/// The request path of every proxied endpoint.
pub async fn route(gw: Arc<Gateway>, endpoint: Endpoint, req: Request) -> Response {
    let received = Instant::now();
    let (mut parts, body) = req.into_parts();
    let tenant = parts.extensions.get::<Arc<Tenant>>().cloned();
    let body = match read_body(body, gw.settings.max_body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let placed = match place(&gw, endpoint, &parts.headers, tenant.as_ref(), &body, None).await {
        Ok(p) => p,
        Err(refusal) => return refusal,
    };
    let decision = &placed.decision;
    // Its span, started when it arrived (when traces are exported): the client's trace
    // continues here and upstream.
    let span = parts.extensions.remove::<RequestSpan>().inspect(|span| {
        span.set([
            KeyValue::new("gen_ai.request.model", placed.model.to_string()),
            KeyValue::new("prefix_router.policy", gw.core.policy_name()),
            KeyValue::new("prefix_router.reason", decision.reason.label()),
            KeyValue::new("prefix_router.index", decision.index),
            KeyValue::new(
                "prefix_router.matched_ratio",
                decision.matched_ratio.unwrap_or(0.0),
            ),
        ]);
        if let Some(pd) = decision.pd {
            span.set([KeyValue::new("prefix_router.pd", pd.label())]);
        }
    });
    forward(&gw, parts, body, received, placed, span).await
}

/// Sends the request to the first backend of `order`, moving on after a connection error or a
/// 5xx (at most `--max-retries` times) while nothing has reached the client yet.
///
/// A streamed request whose head has not come within `--upstream-timeout` also moves on (vLLM
/// sends a stream's head at once, so a missing one means a stuck backend); a non-streamed
/// answer's head comes only when generation ends, so its wait is bounded by
/// `--request-timeout` alone. A slow head is never counted against the backend's health: only
/// a failed connection is (and the health checks decide).
async fn forward(
    gw: &Arc<Gateway>,
    parts: axum::http::request::Parts,
    body: bytes::Bytes,
    received: Instant,
    placed: Placed,
    span: Option<RequestSpan>,
) -> Response {
    let Placed {
        stream,
        text_bytes,
        model,
        permit,
        tenant_guard,
        prompt,
        decision,
        vllm_priority,
    } = placed;
    let body = match vllm_priority {
        Some(p) => p.write(&body),
        None => body,
    };
    // A failure answered here ends the span; an answer passed through ends it at its end.
    let failed = |response: Response| {
        if let Some(s) = &span {
            s.end(response.status().as_u16());
        }
        response
    };
    let mut tenant_guard = tenant_guard;
    let load_eased = permit.waker();
    let mut permit = Some(permit);
    let request_id = proxy::request_id(&parts.headers);
    let mut headers = parts.headers;
    headers.insert("x-request-id", request_id.clone());
    if !gw.keys.is_open() {
        // The client's bearer token is this router's key, not the backend's: it stays here.
        headers.remove(axum::http::header::AUTHORIZATION);
    }
    let deadline = received + gw.settings.request_timeout;
    let attempts = gw.settings.attempts(decision.order.len());
    let mut last_error: Option<Response> = None;
    let timed_out = || {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "the backend did not answer in time",
        )
        .into_response()
    };
    for (attempt, backend) in decision.order.into_iter().take(attempts).enumerate() {
        let guard = begin_attempt(
            gw,
            Attempt {
                backend: &backend,
                load_eased: load_eased.clone(),
                uncached: decision.uncached.get(attempt).copied(),
                text_bytes,
                stream,
                teaches_line: decision.prefill.is_none(),
                prompt: prompt.as_ref(),
                block_names: decision.block_names.as_ref(),
                span: span.as_ref(),
            },
            &mut permit,
        )
        .await;
        if attempt == 0 {
            gw.metrics
                .added_latency
                .observe(received.elapsed().as_secs_f64());
        }
        // Disaggregated: a prefill server computes the prompt first (afresh for each decode
        // server tried: a failed decode's pull is released by the prefill server's lease).
        let attempt_body = match &decision.prefill {
            Some(plan) => disagg::prefill(
                gw,
                disagg::PrefillCall {
                    plan,
                    method: &parts.method,
                    uri: &parts.uri,
                    headers: &headers,
                    body: &body,
                    text_bytes,
                    prompt: prompt.as_ref(),
                    block_names: decision.block_names.as_ref(),
                    span: span.as_ref(),
                },
            )
            .await
            .and_then(|params| disagg::decode_body(&body, &params))
            .unwrap_or_else(|| body.clone()),
            None => body.clone(),
        };
        let upstream =
            proxy::upstream_request(&backend, &parts.method, &parts.uri, &headers, attempt_body);
        let last = attempt + 1 == attempts;
        let attempt_deadline = if stream {
            deadline.min(Instant::now() + gw.settings.upstream_timeout)
        } else {
            deadline
        };
        match tokio::time::timeout_at(attempt_deadline.into(), gw.client.request(upstream)).await {
            Err(_) if !last && attempt_deadline < deadline => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), "the stream did not begin in time: trying the next backend");
                record(gw, &backend, &model, 504, received);
                gw.metrics.count_retry(&backend);
                last_error = Some(timed_out());
            }
            Err(_) => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), "request timed out");
                record(gw, &backend, &model, 504, received);
                return failed(timed_out());
            }
            Ok(Err(e)) => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), error = %e, "backend connection failed");
                if e.is_connect() {
                    gw.core.backend_failed(&backend);
                }
                record(gw, &backend, &model, 502, received);
                gw.metrics.count_retry(&backend);
                last_error = Some(bad_gateway(e));
            }
            Ok(Ok(resp)) if resp.status().is_server_error() && !last => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), status = resp.status().as_u16(), "backend error: trying the next backend");
                record(gw, &backend, &model, resp.status().as_u16(), received);
                gw.metrics.count_retry(&backend);
            }
            Ok(Ok(resp)) => {
                let gw2 = gw.clone();
                let b2 = backend.clone();
                let held = tenant_guard.take();
                let span2 = span.clone();
                if let Some(s) = &span {
                    s.set([
                        KeyValue::new("server.address", backend.url().to_owned()),
                        KeyValue::new("prefix_router.attempts", attempt as i64 + 1),
                    ]);
                }
                let on_end = move |ended: proxy::Ended| {
                    drop(held);
                    if let Some(s) = &span2 {
                        s.end(ended.status);
                    }
                    if let (200, Some(tokens)) = (ended.status, ended.prompt_tokens) {
                        b2.observe_prompt(text_bytes, tokens);
                    }
                    record(&gw2, &b2, &model, ended.status, received)
                };
                let mut response = proxy::downstream_response(resp, guard, on_end, deadline);
                response.headers_mut().insert("x-request-id", request_id);
                response.extensions_mut().insert(super::SpanEndsWithBody);
                tracing::debug!(backend = backend.url(), attempt, "routed");
                return response;
            }
        }
    }
    failed(last_error.unwrap_or_else(|| bad_gateway("every backend tried failed")))
}

/// One try of a request on one backend.
pub(crate) struct Attempt<'a> {
    pub backend: &'a Arc<Backend>,
    /// Woken when this attempt's load leaves the backend (the gateway queue's waker).
    pub load_eased: Option<Arc<tokio::sync::Notify>>,
    /// The prompt tokens the backend lacks, where the matches are known.
    pub uncached: Option<u64>,
    pub text_bytes: u64,
    pub stream: bool,
    /// Whether its time to first byte is the backend's own prefill, to learn its line from:
    /// not for a decode server that pulls the prompt from a prefill server.
    pub teaches_line: bool,
    pub prompt: Option<&'a PromptKey>,
    pub block_names: Option<&'a crate::core::events::BlockNames>,
    pub span: Option<&'a RequestSpan>,
}

/// The longest a whole answer counts as prefill still queued at its backend.
const PREFILL_TIMER_MAX: Duration = Duration::from_secs(60);

/// Counts a request against the backend it is about to reach, for every front end: the index
/// learns where it went, the backend's in-flight count and queued prefill grow (the returned
/// guard shrinks them), the queue's permit is used up, and (streamed) its first byte will
/// teach the backend's prefill line; a whole answer leaves the prefill queue when its prefill is
/// predicted done.
pub(crate) async fn begin_attempt(
    gw: &Arc<Gateway>,
    attempt: Attempt<'_>,
    permit: &mut Option<Permit>,
) -> InflightGuard {
    let backend = attempt.backend;
    gw.core
        .sent(attempt.prompt, attempt.block_names, backend)
        .await;
    // The prefill it asks of the backend: what the backend does not hold, or the whole
    // prompt (estimated from its bytes) where matches are not known.
    let uncached = attempt.uncached.unwrap_or_else(|| {
        (attempt.text_bytes as f64 / backend.bytes_per_token().max(0.1)).round() as u64
    });
    // A backend computes no more than its longest prompt (it refuses a longer one at once).
    let uncached = match backend.max_model_len.load(Relaxed) {
        0 => uncached,
        longest => uncached.min(longest),
    };
    let row = backend.row();
    let mut guard = InflightGuard::new(backend.clone(), uncached);
    guard.tell_when_load_eases(attempt.load_eased);
    // Counted against a backend now: the queue may release the next request.
    drop(permit.take());
    let work = prefill_work(&row, uncached);
    let predicted = ttft_after_queue(&row, work, uncached);
    if !attempt.stream {
        // A whole answer's first byte is its end: it leaves the prefill queue when its prefill
        // is predicted done instead (at most a minute on: a prediction is no promise).
        let after = Duration::try_from_secs_f64(predicted).unwrap_or(PREFILL_TIMER_MAX);
        guard.leave_prefill_queue_after(after.min(PREFILL_TIMER_MAX));
    } else {
        // Its TTFT teaches the backend's prefill line, and says how right the line was.
        let (gw2, b2) = (gw.clone(), backend.clone());
        let teaches_line = attempt.teaches_line;
        let decoding = row.inflight.saturating_sub(row.waiting_first_byte);
        let span = attempt.span.cloned();
        guard.on_first_byte(Box::new(move |ttft| {
            let ttft = ttft.as_secs_f64();
            if let Some(s) = &span {
                s.set([KeyValue::new("prefix_router.ttft_s", ttft)]);
            }
            tracing::debug!(
                target: "prefix_router::ttft",
                backend = %b2.url(), work, uncached, decoding, kv_usage = row.kv_usage,
                stalled_secs = row.stalled_secs, predicted, ttft,
                "first byte"
            );
            if !teaches_line {
                // Its prompt came from elsewhere: its time says nothing of its own prefill.
                gw2.metrics.observe_ttft(&b2, ttft, 0.0);
                return;
            }
            gw2.metrics.observe_ttft(&b2, ttft, predicted);
            gw2.core.first_byte(
                &b2,
                FirstByte {
                    work,
                    uncached,
                    ttft_s: ttft,
                    under_way_s: row.stalled_secs,
                    kv_usage: row.kv_usage,
                },
            );
        }));
    }
    // Its end is told to the other replicas, by its chain's last hash: a request that
    // continues its prompt through another replica is routed as if it had ended there.
    if let Some(&last) = attempt
        .prompt
        .filter(|_| gw.core.tells_ends())
        .and_then(|p| p.chunks.as_slice().last())
    {
        let (gw, backend) = (gw.clone(), backend.clone());
        guard.on_end(Box::new(move || gw.core.ended(last, &backend)));
    }
    backend.routed.fetch_add(1, Relaxed);
    guard
}

pub(crate) fn record(
    gw: &Gateway,
    backend: &Backend,
    model: &Arc<str>,
    status: u16,
    received: Instant,
) {
    gw.metrics.count_request(
        RequestLabels {
            backend: Label(backend.label.clone()),
            model: Label(model.clone()),
            status,
        },
        received.elapsed().as_secs_f64(),
    );
}
