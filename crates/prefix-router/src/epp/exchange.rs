//! One ext_proc stream: one HTTP request passing through the gateway, message by message.
//!
//! Request headers are kept until the body's last piece has come (full-duplex streaming);
//! then the request is placed exactly as `serve` places it (same candidates, tenants, queue and
//! policy) and the answer goes back in the order the gateway expects: the headers' answer with
//! the picked endpoints, then the body handed back in pieces. The response passes through
//! unchanged; the picker watches it for what the router learns from an answer (which endpoint
//! served it, its first byte, its prompt tokens, its status) and releases the backend's
//! in-flight count when it ends or when the stream closes.
//!
//! The client's key is checked at the request headers, before any of the body is buffered.
//! The picked backend gets its own key (`--backend-api-key` or its config's), or none: the
//! client's `Authorization`, a key of this router's, does not travel on. A request's trace span
//! covers it from the headers on, and continues upstream (`traceparent`).

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};

use super::envoy::{self, Direction, RequestHead};
use super::Picker;
use crate::api_error::ApiError;
use crate::core::backend::{Backend, InflightGuard};
use crate::core::matches::PromptKey;
use crate::serve::request_string::Endpoint;
use crate::serve::route::{self, Attempt, Placed};
use crate::tenants::{Tenant, TenantGuard};
use crate::traces::RequestSpan;

/// How the gateway sends bodies on this stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyMode {
    /// Pieces as they come; the picker hands each back (what the protocol asks for).
    FullDuplex,
    /// The whole body in one message; the answer leaves it unchanged.
    Buffered,
    /// No body at all (responses only): the answer's status comes with its headers, and its
    /// first byte is never seen.
    None,
}

impl BodyMode {
    /// The mode the gateway announces, or an error for one this picker cannot serve (in plain
    /// streamed mode the headers must be answered before the body comes, so nothing could be
    /// matched).
    fn of(mode: i32, which: &str) -> Result<Self, tonic::Status> {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::FullDuplexStreamed) => Ok(Self::FullDuplex),
            Ok(BodySendMode::Buffered) => Ok(Self::Buffered),
            _ => Err(tonic::Status::invalid_argument(format!(
                "the endpoint picker needs {which} in FULL_DUPLEX_STREAMED (or BUFFERED) mode; the gateway sends mode {mode}"
            ))),
        }
    }
}

/// The request once it has a backend.
struct Sent {
    backend: Arc<Backend>,
    guard: Option<InflightGuard>,
    /// Disaggregated: the prefill server named to the decode pod's sidecar, counted there
    /// until the decode server's answer begins (its prefill is over by then).
    prefill_guard: Option<InflightGuard>,
    /// Whether a prefill server was named (the decode servers pull the prompt).
    prefilled: bool,
    tenant_guard: Option<TenantGuard>,
    model: Arc<str>,
    text_bytes: u64,
    stream: bool,
    prompt: Option<PromptKey>,
    block_names: Option<crate::core::events::BlockNames>,
    /// The failover order and what each would have to prefill, for an answer served by
    /// another endpoint than the first.
    order: Vec<Arc<Backend>>,
    uncached: Vec<u64>,
    received: Instant,
    /// The answer's status, once its headers passed.
    status: u16,
    /// Whether the answer is an event stream.
    sse: bool,
    prompt_tokens: Option<u64>,
    ended: bool,
}

/// One stream's state.
pub(super) struct Exchange {
    picker: Arc<Picker>,
    request_mode: BodyMode,
    response_mode: BodyMode,
    head: Option<RequestHead>,
    /// The client's tenant, once its key was checked at the headers.
    tenant: Option<Arc<Tenant>>,
    span: Option<RequestSpan>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    sent: Option<Sent>,
    /// The picker answered the request itself: the gateway ends the stream, and anything it
    /// still sends is ignored.
    answered: bool,
}

impl Exchange {
    pub(super) fn new(picker: Arc<Picker>) -> Self {
        Self {
            picker,
            request_mode: BodyMode::FullDuplex,
            response_mode: BodyMode::FullDuplex,
            head: None,
            tenant: None,
            span: None,
            subset: None,
            body: Vec::new(),
            sent: None,
            answered: false,
        }
    }

    /// The answers to one message from the gateway, in order; an error ends the stream.
    pub(super) async fn on_message(
        &mut self,
        message: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, tonic::Status> {
        if let Some(config) = &message.protocol_config {
            self.request_mode = BodyMode::of(config.request_body_mode, "request bodies")?;
            // NONE: the gateway sends no response body: the answer is known by its headers.
            self.response_mode = if config.response_body_mode == BodySendMode::None as i32 {
                BodyMode::None
            } else {
                BodyMode::of(config.response_body_mode, "response bodies")?
            };
        }
        let metadata = message.metadata_context.as_ref();
        let Some(request) = message.request.filter(|_| !self.answered) else {
            return Ok(Vec::new());
        };
        let answers = match request {
            processing_request::Request::RequestHeaders(headers) => {
                self.subset = envoy::subset(metadata);
                self.on_request_headers(headers).await
            }
            processing_request::Request::RequestBody(body) => self.on_request_body(body).await,
            processing_request::Request::RequestTrailers(_) => {
                vec![envoy::trailers_unchanged(Direction::Request)]
            }
            processing_request::Request::ResponseHeaders(headers) => {
                self.on_response_headers(headers, envoy::served(metadata))
                    .await
            }
            processing_request::Request::ResponseBody(body) => self.on_response_body(body),
            processing_request::Request::ResponseTrailers(_) => {
                self.end(None);
                vec![envoy::trailers_unchanged(Direction::Response)]
            }
        };
        self.answered = answers.iter().any(envoy::is_immediate);
        Ok(answers)
    }

    async fn on_request_headers(&mut self, headers: HttpHeaders) -> Vec<ProcessingResponse> {
        let mut head = RequestHead::of(headers.headers.as_ref());
        let gw = &self.picker.gw;
        self.span = gw.traces.as_ref().map(|t| {
            t.request(
                format!(
                    "{} {}",
                    head.method,
                    head.path.split('?').next().unwrap_or("")
                ),
                &mut head.headers,
            )
        });
        // The key is checked now: a stranger's body is never buffered.
        match gw.keys.admit(crate::access::Need::Client, &head.headers) {
            Ok(tenant) => self.tenant = tenant,
            Err(e) => {
                self.picker.metrics.refused("unauthorized");
                return vec![self.refuse(e.into_response()).await];
            }
        }
        self.head = Some(head);
        if headers.end_of_stream {
            // No body (a GET): the least loaded eligible backend.
            return self.place(Instant::now(), None).await;
        }
        Vec::new()
    }

    async fn on_request_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        if self.sent.is_some() {
            // Pieces after the pick (none are expected): handed back as they are.
            return vec![self.hand_back(Direction::Request, body)];
        }
        if self.body.len() + body.body.len() > self.picker.gw.settings.max_body {
            self.body = Vec::new();
            self.picker.metrics.refused("too_large");
            let too_large = ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "request body larger than {} bytes",
                    self.picker.gw.settings.max_body
                ),
            );
            return vec![self.refuse(too_large.into_response()).await];
        }
        self.body.extend_from_slice(&body.body);
        if !body.end_of_stream {
            return match self.request_mode {
                // Buffered mode sends one message; a piece without the end is answered so
                // the gateway is not kept waiting.
                BodyMode::Buffered | BodyMode::None => {
                    vec![envoy::body_unchanged(Direction::Request)]
                }
                BodyMode::FullDuplex => Vec::new(),
            };
        }
        let body = bytes::Bytes::from(std::mem::take(&mut self.body));
        self.place(Instant::now(), Some(body)).await
    }

    /// Places the request and answers: the picked endpoints, then its body back.
    async fn place(
        &mut self,
        received: Instant,
        body: Option<bytes::Bytes>,
    ) -> Vec<ProcessingResponse> {
        let gw = self.picker.gw.clone();
        let head = self.head.take().unwrap_or(RequestHead {
            method: String::new(),
            path: String::new(),
            headers: Default::default(),
        });
        let tenant = self.tenant.take();
        let subset = self.subset.take();
        let eligible = |b: &Backend| {
            subset
                .as_ref()
                .is_none_or(|s| s.iter().any(|e| e == endpoint_of(b.url())))
        };
        let placed = match &body {
            Some(body) => {
                route::place(
                    &gw,
                    endpoint(&head.path),
                    &head.headers,
                    tenant.as_ref(),
                    body,
                    Some(&eligible),
                )
                .await
            }
            None => by_load(&gw, &eligible).map_err(IntoResponse::into_response),
        };
        let placed = match placed {
            Ok(p) => p,
            Err(refusal) => {
                self.picker
                    .metrics
                    .refused(match refusal.status().as_u16() {
                        400 => "invalid",
                        404 => "unknown_model",
                        429 => "shed",
                        _ => "no_endpoint",
                    });
                return vec![self.refuse(refusal).await];
            }
        };
        let Placed {
            stream,
            text_bytes,
            model,
            permit,
            tenant_guard,
            prompt,
            decision,
            // Envoy sends the body as the client wrote it: no priority is written here.
            vllm_priority: _,
        } = placed;
        let attempts = gw.settings.attempts(decision.order.len());
        let order: Vec<Arc<Backend>> = decision.order.into_iter().take(attempts).collect();
        let backend = order[0].clone();
        let load_eased = permit.waker();
        let mut permit = Some(permit);
        let guard = route::begin_attempt(
            &gw,
            Attempt {
                backend: &backend,
                load_eased,
                uncached: decision.uncached.first().copied(),
                text_bytes,
                stream,
                teaches_line: decision.prefill.is_none(),
                prompt: prompt.as_ref(),
                block_names: decision.block_names.as_ref(),
                span: None,
            },
            &mut permit,
        )
        .await;
        // Disaggregated: the decode pod's sidecar asks this prefill server first (llm-d's
        // routing sidecar protocol), so it is counted and taught here.
        let prefill = decision
            .prefill
            .as_ref()
            .and_then(|plan| Some((plan.order.first()?.clone(), plan.uncached.first().copied())));
        let prefill_guard = match &prefill {
            Some((prefill, uncached)) => Some(
                route::begin_attempt(
                    &gw,
                    Attempt {
                        backend: prefill,
                        load_eased: None,
                        uncached: *uncached,
                        text_bytes,
                        stream: true,
                        teaches_line: false,
                        prompt: prompt.as_ref(),
                        block_names: decision.block_names.as_ref(),
                        span: None,
                    },
                    &mut None,
                )
                .await,
            ),
            None => None,
        };
        gw.metrics
            .added_latency
            .observe(received.elapsed().as_secs_f64());
        let endpoints = order
            .iter()
            .map(|b| endpoint_of(b.url()))
            .collect::<Vec<_>>()
            .join(",");
        self.picker.metrics.picked(order.len());
        tracing::debug!(endpoints, reason = decision.reason.label(), "picked");
        if let Some(span) = &self.span {
            span.set([
                opentelemetry::KeyValue::new("server.address", backend.url().to_owned()),
                opentelemetry::KeyValue::new("gen_ai.request.model", model.to_string()),
                opentelemetry::KeyValue::new("prefix_router.policy", gw.core.policy_name()),
                opentelemetry::KeyValue::new("prefix_router.reason", decision.reason.label()),
                opentelemetry::KeyValue::new("prefix_router.index", decision.index),
            ]);
        }
        // The backend's own key, or none: the client's, when this router checks keys, is
        // this router's and stays here.
        let mut headers = envoy::PickedHeaders::default();
        match backend.authorization() {
            Some(key) => headers.set.push(("authorization", key.as_bytes().to_vec())),
            None if !gw.keys.is_open() => headers.remove.push("authorization"),
            None => {}
        }
        match &prefill {
            Some((prefill, _)) => headers.set.push((
                PREFILLER_HEADER,
                endpoint_of(prefill.url()).as_bytes().to_vec(),
            )),
            // In a disaggregated fleet a client's own would steer the sidecar: only the
            // picker names a prefiller.
            None if decision.pd.is_some() => headers.remove.push(PREFILLER_HEADER),
            None => {}
        }
        if let Some(traceparent) = head.headers.get("traceparent") {
            headers
                .set
                .push(("traceparent", traceparent.as_bytes().to_vec()));
        }
        self.sent = Some(Sent {
            backend,
            guard: Some(guard),
            prefilled: prefill_guard.is_some(),
            prefill_guard,
            tenant_guard,
            model,
            text_bytes,
            stream,
            prompt,
            block_names: decision.block_names,
            order,
            uncached: decision.uncached,
            received,
            status: 0,
            sse: false,
            prompt_tokens: None,
            ended: false,
        });
        let mut answers = vec![envoy::picked(
            &endpoints,
            body.as_ref().map(bytes::Bytes::len),
            headers,
        )];
        if let Some(body) = body {
            match self.request_mode {
                BodyMode::FullDuplex => answers.extend(envoy::streamed_request_body(body)),
                BodyMode::Buffered | BodyMode::None => {
                    answers.push(envoy::body_unchanged(Direction::Request))
                }
            }
        }
        answers
    }

    async fn on_response_headers(
        &mut self,
        headers: HttpHeaders,
        served: Option<String>,
    ) -> Vec<ProcessingResponse> {
        let status = envoy::header(headers.headers.as_ref(), ":status")
            .and_then(|s| std::str::from_utf8(s).ok()?.parse::<u16>().ok())
            .unwrap_or(200);
        if let Some(sent) = &mut self.sent {
            sent.status = status;
            drop(sent.prefill_guard.take());
            sent.sse = envoy::header(headers.headers.as_ref(), "content-type")
                .is_some_and(|ct| ct.starts_with(b"text/event-stream"));
            if self.response_mode == BodyMode::None {
                // No body will pass: the request's prefill is over as far as this picker
                // can tell, and nothing of its timing is learned.
                if let Some(guard) = &mut sent.guard {
                    guard.first_byte(false);
                }
            }
            if let Some(served) = served {
                self.picker.served_by(sent, &served).await;
            }
        }
        if headers.end_of_stream {
            self.end(None);
        }
        vec![envoy::response_headers_unchanged()]
    }

    fn on_response_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        if let Some(sent) = &mut self.sent {
            if !body.body.is_empty() {
                if let Some(guard) = &mut sent.guard {
                    let status = if sent.status == 0 { 200 } else { sent.status };
                    guard.first_byte(crate::serve::proxy::learnable_answer(
                        status, sent.sse, &body.body,
                    ));
                }
                if sent.prompt_tokens.is_none() {
                    sent.prompt_tokens = crate::serve::proxy::prompt_tokens_in(&body.body);
                }
            }
        }
        let end = body.end_of_stream;
        let answer = self.hand_back(Direction::Response, body);
        if end {
            self.end(None);
        }
        vec![answer]
    }

    fn hand_back(&self, direction: Direction, body: HttpBody) -> ProcessingResponse {
        let mode = match direction {
            Direction::Request => self.request_mode,
            Direction::Response => self.response_mode,
        };
        match mode {
            BodyMode::FullDuplex => envoy::streamed_body(direction, body.body, body.end_of_stream),
            BodyMode::Buffered | BodyMode::None => envoy::body_unchanged(direction),
        }
    }

    /// Answers the request itself with `response` (a refusal), ending its span.
    async fn refuse(&mut self, response: axum::response::Response) -> ProcessingResponse {
        if let Some(span) = self.span.take() {
            span.end(response.status().as_u16());
        }
        envoy::immediate(response).await
    }

    /// The answer ended (with its own status, or `status` when it did not finish): the
    /// request is counted and its backend's load released, once.
    fn end(&mut self, status: Option<u16>) {
        let Some(sent) = &mut self.sent else {
            return;
        };
        if sent.ended {
            return;
        }
        sent.ended = true;
        let status = status.unwrap_or(if sent.status == 0 { 200 } else { sent.status });
        drop(sent.guard.take());
        drop(sent.tenant_guard.take());
        if let (200, Some(tokens)) = (status, sent.prompt_tokens) {
            sent.backend.observe_prompt(sent.text_bytes, tokens);
        }
        let gw = &self.picker.gw;
        route::record(gw, &sent.backend, &sent.model, status, sent.received);
        if let Some(span) = self.span.take() {
            span.end(status);
        }
    }
}

impl Drop for Exchange {
    /// The stream closed: before the answer ended (the client or the gateway gave up), or,
    /// when no response body passes through the picker, after its headers said how it went.
    fn drop(&mut self) {
        let known = self.response_mode == BodyMode::None
            && self.sent.as_ref().is_some_and(|s| s.status != 0);
        self.end(if known { None } else { Some(499) });
    }
}

impl Picker {
    /// The gateway reports that `served` answered: when that is not the endpoint picked
    /// first, the first failed over: the load moves to the one that served, and the index learns
    /// it holds the prompt (the first keeps the entry the pick gave it).
    async fn served_by(&self, sent: &mut Sent, served: &str) {
        if endpoint_of(sent.backend.url()) == served {
            return;
        }
        let Some(at) = sent
            .order
            .iter()
            .position(|b| endpoint_of(b.url()) == served)
        else {
            self.metrics.served_elsewhere("unknown");
            tracing::warn!(
                served,
                "the gateway reports an endpoint this picker did not offer"
            );
            return;
        };
        self.metrics.served_elsewhere("fallback");
        let gw = &self.gw;
        route::record(gw, &sent.backend, &sent.model, 502, sent.received);
        gw.metrics.count_retry(&sent.backend);
        drop(sent.guard.take());
        let backend = sent.order[at].clone();
        let guard = route::begin_attempt(
            gw,
            Attempt {
                backend: &backend,
                load_eased: None,
                uncached: sent.uncached.get(at).copied(),
                text_bytes: sent.text_bytes,
                stream: sent.stream,
                teaches_line: !sent.prefilled,
                prompt: sent.prompt.as_ref(),
                block_names: sent.block_names.as_ref(),
                span: None,
            },
            &mut None,
        )
        .await;
        sent.guard = Some(guard);
        sent.backend = backend;
    }
}

/// A request without a body, placed by load alone.
fn by_load(
    gw: &Arc<crate::serve::Gateway>,
    eligible: &dyn Fn(&Backend) -> bool,
) -> Result<Placed, ApiError> {
    let mut candidates = gw.core.candidates(None);
    candidates.backends.retain(|b| eligible(b));
    if candidates.backends.is_empty() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no eligible endpoint is ready",
        ));
    }
    Ok(Placed {
        stream: false,
        text_bytes: 0,
        model: Arc::from(""),
        permit: crate::core::admission::Permit::free(),
        tenant_guard: None,
        prompt: None,
        vllm_priority: None,
        decision: gw.core.pick_by_load(candidates.backends),
    })
}

/// Which OpenAI endpoint a path is (the query left out); anything else is routed by load.
fn endpoint(path: &str) -> Endpoint {
    match path.split('?').next().unwrap_or_default() {
        "/v1/chat/completions" => Endpoint::Chat,
        "/v1/completions" => Endpoint::Completions,
        "/v1/embeddings" => Endpoint::Embeddings,
        "/v1/responses" => Endpoint::Responses,
        _ => Endpoint::Other,
    }
}

/// A backend's `host:port`, as the gateway names endpoints.
/// The request header naming the prefill endpoint to a decode pod's routing sidecar (llm-d's
/// name).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

pub(super) fn endpoint_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_url_names_its_endpoint_and_a_path_its_kind() {
        assert_eq!(endpoint_of("http://10.0.0.5:8000"), "10.0.0.5:8000");
        assert_eq!(endpoint_of("http://10.0.0.5:8000/"), "10.0.0.5:8000");
        assert_eq!(endpoint_of("http://[fd00::1]:8000"), "[fd00::1]:8000");
        assert_eq!(endpoint("/v1/chat/completions?x=1"), Endpoint::Chat);
        assert_eq!(endpoint("/v1/completions"), Endpoint::Completions);
        assert_eq!(endpoint("/tokenize"), Endpoint::Other);
    }

    #[test]
    fn only_full_duplex_and_buffered_bodies_are_served() {
        assert_eq!(BodyMode::of(4, "x").unwrap(), BodyMode::FullDuplex);
        assert_eq!(BodyMode::of(2, "x").unwrap(), BodyMode::Buffered);
        let e = BodyMode::of(1, "request bodies").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("FULL_DUPLEX_STREAMED"));
        assert!(BodyMode::of(99, "x").is_err());
    }
}
