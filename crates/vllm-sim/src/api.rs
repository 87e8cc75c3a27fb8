//! The HTTP surface of one simulated server: vLLM's endpoints plus `/sim/` controls.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::engine::{Admitted, Engine, Job, Refusal};
use crate::kv_cache::block_hashes;
use crate::openai::{self, ChoiceOutcome, Endpoint, GenRequest, SimError};
use crate::tokens::{self, TokenId};

/// What the handlers of one server share.
#[derive(Clone)]
pub struct Server {
    pub engine: Arc<Engine>,
    /// Distinguishes this server's response ids from its neighbours'.
    pub name: Arc<str>,
    /// Where it listens (named to decode servers as the place to pull blocks from).
    pub addr: std::net::SocketAddr,
    started: u64,
    next_id: Arc<AtomicU64>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Server {
    pub fn new(engine: Arc<Engine>, addr: std::net::SocketAddr) -> Self {
        Self {
            engine,
            name: addr.port().to_string().into(),
            addr,
            started: unix_now(),
            next_id: Arc::default(),
        }
    }

    /// Its engine id in the KV-transfer protocol.
    fn engine_id(&self) -> String {
        format!("sim-{}", self.name)
    }

    fn next_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            self.name,
            self.next_id.fetch_add(1, Relaxed)
        )
    }

    /// Decides, from `--fail-rate` and the seed, whether this request fails.
    fn random_failure(&self) -> bool {
        let rate = self.engine.config.fail_rate;
        if rate <= 0.0 {
            return false;
        }
        let mut x = self.engine.config.seed
            ^ self
                .next_id
                .fetch_add(1, Relaxed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        (x as f64 / u64::MAX as f64) < rate
    }
}

/// vLLM's API-key check: `/v1` paths only, the same 401 body. `expected` is the whole header
/// value, `Bearer <key>`, built once.
async fn require_api_key(
    expected: Arc<str>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = req.headers().get(header::AUTHORIZATION);
    if req.uri().path().starts_with("/v1")
        && given.is_none_or(|v| v.as_bytes() != expected.as_bytes())
    {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "Unauthorized"})),
        )
            .into_response();
    }
    next.run(req).await
}

/// The routes of one server.
pub fn router(server: Server) -> Router {
    let expected_authorization: Option<Arc<str>> =
        (server.engine.config.api_key.as_deref()).map(|key| format!("Bearer {key}").into());
    let routes = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ping", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/sim/probe", post(probe))
        .route("/sim/reset", post(reset))
        .route("/sim/kill", post(kill))
        .route("/sim/revive", post(revive))
        .route("/sim/state", get(sim_state))
        .route("/sim/config", post(sim_config))
        .fallback(|| async { SimError::with_status(StatusCode::NOT_FOUND, "Not Found") })
        // vLLM takes long prompts; the length check is the model's (max_model_len), not HTTP's.
        .layer(axum::extract::DefaultBodyLimit::max(256 << 20))
        .with_state(server);
    match expected_authorization {
        Some(expected) => routes.layer(axum::middleware::from_fn(move |req, next| {
            require_api_key(expected.clone(), req, next)
        })),
        None => routes,
    }
}

fn parse_json(body: &Bytes) -> Result<Value, SimError> {
    serde_json::from_slice(body)
        .map_err(|e| SimError::bad_request(format!("malformed JSON body: {e}")))
}

/// Faults asked for by header (`X-Sim-Fail: <status>`, `X-Sim-Stall-Ms: <ms>`) or by flags.
async fn injected_fault(server: &Server, headers: &HeaderMap) -> Option<SimError> {
    let header_num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let stall = header_num("x-sim-stall-ms").unwrap_or(server.engine.config.stall_ms);
    if stall > 0 {
        tokio::time::sleep(Duration::from_millis(stall)).await;
    }
    if let Some(status) = header_num("x-sim-fail") {
        let status = u16::try_from(status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Some(SimError::with_status(
            status,
            "simulated failure (X-Sim-Fail)",
        ));
    }
    if server.random_failure() {
        return Some(SimError::with_status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated failure (--fail-rate)",
        ));
    }
    None
}

async fn completions(State(s): State<Server>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, Endpoint::Completions).await
}

async fn chat_completions(State(s): State<Server>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, Endpoint::Chat).await
}

async fn generate(server: Server, headers: HeaderMap, body: Bytes, endpoint: Endpoint) -> Response {
    if let Some(fault) = injected_fault(&server, &headers).await {
        return fault.into_response();
    }
    let req =
        match parse_json(&body).and_then(|v| openai::parse(endpoint, &v, &server.engine.config)) {
            Ok(req) => req,
            Err(e) => return e.into_response(),
        };
    let id = server.next_id(match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    });
    let run = Run {
        server,
        req: Arc::new(req),
        id: id.into(),
        created: unix_now(),
    };
    if run.req.stream {
        stream_response(run)
    } else {
        match run.to_end().await {
            Ok(choices) => {
                let kv_transfer_params = run.produced_kv();
                let mut answer = Json(openai::full_response(
                    &run.req,
                    &run.id,
                    run.created,
                    &choices,
                    kv_transfer_params,
                ))
                .into_response();
                answer.extensions_mut().insert(Counted);
                answer
            }
            Err(e) => e.into_response(),
        }
    }
}

/// Marks an answer the server has counted as a success: the kill switch lets it out even when the
/// kill lands after it was made, as the bytes of a finished answer are already on their way.
#[derive(Clone, Copy)]
pub(crate) struct Counted;

/// One generation request on its way through the engine.
#[derive(Clone)]
struct Run {
    server: Server,
    req: Arc<GenRequest>,
    id: Arc<str>,
    created: u64,
}

/// A choice admitted by the engine, with its answer.
struct Started {
    admitted: Admitted,
    words: Vec<&'static str>,
    stopped: bool,
    prompt_tokens: usize,
}

impl Run {
    async fn start(&self, prompt: &[TokenId]) -> Result<Started, SimError> {
        let engine = &self.server.engine;
        let text = &engine.config.text;
        let answer = tokens::answer(prompt, engine.config.seed, &self.req.limits, text.words());
        let mut sequence = prompt.to_vec();
        sequence.extend(answer.word_indexes.iter().map(|&i| text.word_id(i)));
        let block_hashes = block_hashes(&sequence, engine.config.block_size);
        let external_tokens = self.pull(&block_hashes, prompt, &sequence).await;
        let job = Job {
            block_hashes,
            prompt_tokens: prompt.len(),
            total_tokens: sequence.len(),
            tokens: sequence.into(),
            external_tokens,
        };
        let admitted = engine
            .submit(job)
            .await
            .map_err(|_| {
                SimError::with_status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the server is shutting down",
                )
            })?
            .map_err(
                |Refusal::TooLong {
                     needed_blocks,
                     total_blocks,
                 }| {
                    SimError::bad_request(format!(
                    "the request needs {needed_blocks} KV blocks but the cache has {total_blocks}"
                ))
                },
            )?;
        Ok(Started {
            admitted,
            words: answer.tokens,
            stopped: answer.stopped,
            prompt_tokens: prompt.len(),
        })
    }

    /// A decode after a remote prefill: pulls the prompt's blocks the prefill named and this
    /// server lacks (the handshake with a new peer, then their bytes), and caches them.
    /// Returns the tokens pulled (None for any other request).
    async fn pull(
        &self,
        hashes: &[u64],
        prompt: &[TokenId],
        sequence: &[TokenId],
    ) -> Option<usize> {
        let crate::disagg::Transfer::FromRemotePrefill {
            engine_id,
            block_ids,
        } = &self.req.transfer
        else {
            return None;
        };
        let engine = &self.server.engine;
        let block_size = engine.config.block_size;
        let prompt_blocks = &hashes[..(prompt.len() / block_size).min(hashes.len())];
        let carried = crate::disagg::carried(prompt_blocks, block_ids);
        let held = engine.probe(&prompt_blocks[..carried], carried * block_size) / block_size;
        let pulled = (carried - held.min(carried)) * block_size;
        let first = engine.peers.first_contact(engine_id);
        let secs = crate::disagg::pull_secs(&engine.config, pulled, first);
        if engine.time_scale() > 0.0 && secs > 0.0 {
            tokio::time::sleep(engine.real(secs)).await;
        }
        engine.receive(&prompt_blocks[..carried], sequence);
        Some(pulled)
    }

    /// The `kv_transfer_params` of this request's whole answer: for a prefill asked for a
    /// remote decode, where its blocks are.
    fn produced_kv(&self) -> Value {
        if self.req.transfer != crate::disagg::Transfer::ForRemoteDecode {
            return Value::Null;
        }
        let block_size = self.server.engine.config.block_size;
        let prompt = &self.req.prompts[0];
        let hashes = block_hashes(prompt, block_size);
        crate::disagg::produced(
            &self.server.engine_id(),
            self.server.addr,
            &hashes[..prompt.len() / block_size],
            prompt.len(),
        )
    }

    /// Waits until the token due at `due` is out: decode runs every `--itl-ms`, but a token due
    /// while this server computes a prefill step comes out when that step ends.
    async fn emit_at(&self, due: Instant) -> Instant {
        let engine = &self.server.engine;
        if engine.time_scale() <= 0.0 {
            return due;
        }
        tokio::time::sleep_until(due.into()).await;
        let mut at = due;
        loop {
            let delay = engine.decode_delay(at);
            if delay.is_zero() {
                return at;
            }
            at += delay;
            tokio::time::sleep_until(at.into()).await;
        }
    }

    /// The real time between two tokens.
    fn itl(&self) -> Duration {
        self.server
            .engine
            .real(self.server.engine.config.itl_ms / 1000.0)
    }

    /// Gives the choice's seat and blocks back; [`Run::record`] counts it once it is answered.
    /// `last_token_at`: when its last token came out.
    fn finish(&self, started: Started, last_token_at: Instant) -> ChoiceOutcome {
        let n = started.words.len();
        let finish_reason = if started.stopped { "stop" } else { "length" };
        let engine = &self.server.engine;
        let decode_secs = if engine.time_scale() > 0.0 {
            engine
                .simulated(last_token_at.saturating_duration_since(started.admitted.first_token_at))
        } else {
            n.saturating_sub(1) as f64 * engine.config.itl_ms / 1000.0
        };
        let e2e_secs = started.admitted.ttft_secs + decode_secs;
        let cached_tokens = started.admitted.cached_tokens;
        started.admitted.lease.finish(started.prompt_tokens + n);
        ChoiceOutcome {
            text: started.words.concat(),
            finish_reason,
            prompt_tokens: started.prompt_tokens,
            completion_tokens: n,
            cached_tokens,
            e2e_secs,
        }
    }

    /// Counts answered choices in the success metrics.
    fn record(&self, outcomes: &[ChoiceOutcome]) {
        let m = &self.server.engine.metrics;
        for outcome in outcomes {
            m.generation_tokens
                .fetch_add(outcome.completion_tokens as u64, Relaxed);
            if outcome.finish_reason == "stop" {
                m.success_stop.fetch_add(1, Relaxed);
            } else {
                m.success_length.fetch_add(1, Relaxed);
            }
            m.e2e.observe(outcome.e2e_secs);
        }
    }

    /// Waits for the server to be killed (never returns otherwise).
    async fn killed(&self) {
        loop {
            let signal = self.server.engine.kill_signal.notified();
            if self.server.engine.is_killed() {
                return;
            }
            signal.await;
        }
    }

    /// Runs every choice to its end (non-streaming).
    async fn to_end(&self) -> Result<Vec<ChoiceOutcome>, SimError> {
        let work = async {
            let mut outcomes = Vec::with_capacity(self.req.prompts.len());
            for prompt in &self.req.prompts {
                let started = self.start(prompt).await?;
                let mut at = started.admitted.first_token_at;
                for k in 0..started.words.len() {
                    let due = if k == 0 { at } else { at + self.itl() };
                    at = self.emit_at(due).await;
                }
                outcomes.push(self.finish(started, at));
            }
            // Counted only once every choice is done: a kill before this point drops the whole
            // answer, and the router's retry elsewhere must not make it count twice.
            self.record(&outcomes);
            Ok(outcomes)
        };
        tokio::select! {
            result = work => result,
            // The connection is dropped by the kill switch; this answer is never sent.
            _ = self.killed() => Err(SimError::with_status(StatusCode::SERVICE_UNAVAILABLE, "killed")),
        }
    }

    /// Sends the SSE events of every choice into `tx`; returns early when the client leaves
    /// (the caller stops polling) or the server is killed (an error ends the body abruptly).
    async fn stream(&self, tx: &mpsc::Sender<Result<Bytes, std::io::Error>>) {
        let send = |event: Bytes| async { tx.send(Ok(event)).await.is_ok() };
        let (mut prompt_sum, mut completion_sum, mut cached_sum) = (0, 0, 0);
        for (index, prompt) in self.req.prompts.iter().enumerate() {
            let started = match self.start(prompt).await {
                Ok(s) => s,
                Err(e) => {
                    // vLLM reports errors inside an open stream as an error event.
                    let _ = send(openai::sse(&e.body())).await;
                    let _ = send(Bytes::from_static(openai::SSE_DONE)).await;
                    return;
                }
            };
            if self.req.endpoint == Endpoint::Chat
                && !send(openai::sse(&openai::role_chunk(
                    &self.req,
                    &self.id,
                    self.created,
                    index,
                )))
                .await
            {
                return;
            }
            let n = started.words.len();
            let mut at = started.admitted.first_token_at;
            for k in 0..n {
                let due = if k == 0 { at } else { at + self.itl() };
                at = self.emit_at(due).await;
                if self.server.engine.is_killed() {
                    let _ = tx.send(Err(std::io::Error::other("server killed"))).await;
                    return;
                }
                let finish =
                    (k + 1 == n).then_some(if started.stopped { "stop" } else { "length" });
                let chunk = openai::stream_chunk(
                    &self.req,
                    &self.id,
                    self.created,
                    index,
                    started.words[k],
                    finish,
                );
                if !send(openai::sse(&chunk)).await {
                    return;
                }
            }
            if n == 0 {
                let reason = if started.stopped { "stop" } else { "length" };
                let chunk = openai::stream_chunk(
                    &self.req,
                    &self.id,
                    self.created,
                    index,
                    "",
                    Some(reason),
                );
                if !send(openai::sse(&chunk)).await {
                    return;
                }
            }
            let outcome = self.finish(started, at);
            self.record(std::slice::from_ref(&outcome));
            prompt_sum += outcome.prompt_tokens;
            completion_sum += outcome.completion_tokens;
            cached_sum += outcome.cached_tokens;
        }
        if self.req.include_usage {
            let usage = openai::usage(prompt_sum, completion_sum, cached_sum);
            if !send(openai::sse(&openai::usage_chunk(
                &self.req,
                &self.id,
                self.created,
                usage,
            )))
            .await
            {
                return;
            }
        }
        let _ = send(Bytes::from_static(openai::SSE_DONE)).await;
    }
}

fn stream_response(run: Run) -> Response {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        tokio::select! {
            _ = run.stream(&tx) => {}
            // The client went away: dropping the stream aborts the request (seat and blocks
            // are given back).
            _ = tx.closed() => {}
            _ = run.killed() => {
                let _ = tx.send(Err(std::io::Error::other("server killed"))).await;
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .expect("static headers are valid")
}

async fn render_chat(State(s): State<Server>, body: Bytes) -> Response {
    render(s, body, Endpoint::Chat).await
}

async fn render_completions(State(s): State<Server>, body: Bytes) -> Response {
    render(s, body, Endpoint::Completions).await
}

/// vLLM's render endpoints: the prompt's token ids without generating (a `GenerateRequest` for
/// chat, a list of them for completions).
async fn render(server: Server, body: Bytes, endpoint: Endpoint) -> Response {
    let req =
        match parse_json(&body).and_then(|v| openai::parse(endpoint, &v, &server.engine.config)) {
            Ok(req) => req,
            Err(e) => return e.into_response(),
        };
    let mut rendered: Vec<Value> = req
        .prompts
        .iter()
        .map(|p| openai::render_response(&req, p, &server.next_id("render")))
        .collect();
    match endpoint {
        Endpoint::Chat => Json(rendered.swap_remove(0)).into_response(),
        Endpoint::Completions => Json(Value::Array(rendered)).into_response(),
    }
}

/// `/sim/probe`: prompt tokens and the tokens a request with this body would find cached now.
async fn probe(State(server): State<Server>, body: Bytes) -> Response {
    let value = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let endpoint = if value.get("messages").is_some() {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let req = match openai::parse(endpoint, &value, &server.engine.config) {
        Ok(req) => req,
        Err(e) => return e.into_response(),
    };
    let prompt = &req.prompts[0];
    let hashes = block_hashes(prompt, server.engine.config.block_size);
    let cached = server.engine.probe(&hashes, prompt.len());
    Json(json!({"prompt_tokens": prompt.len(), "cached_tokens": cached})).into_response()
}

async fn reset(State(server): State<Server>) -> Json<Value> {
    server.engine.reset();
    Json(json!({"status": "reset"}))
}

async fn kill(State(server): State<Server>) -> Json<Value> {
    server.engine.kill();
    Json(json!({"status": "killed"}))
}

async fn revive(State(server): State<Server>) -> Json<Value> {
    server.engine.revive();
    Json(json!({"status": "alive"}))
}

/// Changes settings at run time: `{"time_scale": f}` (benchmarks measure router overhead
/// against servers that do not wait).
async fn sim_config(State(server): State<Server>, body: Bytes) -> Response {
    let value = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    match value.get("time_scale").and_then(Value::as_f64) {
        Some(scale) if scale >= 0.0 && scale.is_finite() => {
            server.engine.set_time_scale(scale);
            Json(json!({"time_scale": scale})).into_response()
        }
        _ => SimError::bad_request("give `time_scale`, a finite number >= 0").into_response(),
    }
}

async fn sim_state(State(server): State<Server>) -> Json<Value> {
    let g = server.engine.gauges();
    Json(json!({
        "running": g.running, "waiting": g.waiting, "kv_cache_usage": g.kv_usage,
        "cached_blocks": server.engine.cached_blocks(), "num_blocks": g.num_blocks,
        "block_size": g.block_size, "killed": server.engine.is_killed(),
    }))
}

async fn embeddings(State(server): State<Server>, body: Bytes) -> Response {
    let value = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let inputs: Vec<String> = match value.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => {
            return SimError::bad_request("`input` must be a string or a list of strings")
                .into_response()
        }
    };
    let mut tokens_used = 0;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, text)| {
            tokens_used += server
                .engine
                .config
                .text
                .prompt(text)
                .map_or(0, |ids| ids.len());
            let h = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
            let embedding: Vec<f64> = (0..8)
                .map(|i| ((h >> (i * 8)) & 0xff) as f64 / 255.0 - 0.5)
                .collect();
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Json(json!({
        "id": server.next_id("embd"), "object": "list", "created": unix_now(),
        "model": server.engine.config.model, "data": data,
        "usage": {"prompt_tokens": tokens_used, "total_tokens": tokens_used},
    }))
    .into_response()
}

async fn tokenize(State(server): State<Server>, body: Bytes) -> Response {
    let value = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let endpoint = if value.get("messages").is_some() {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    match openai::parse(endpoint, &value, &server.engine.config) {
        Ok(req) => Json(json!({
            "count": req.prompts[0].len(), "max_model_len": server.engine.config.max_model_len,
            "tokens": req.prompts[0], "token_strs": null,
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(server): State<Server>, body: Bytes) -> Response {
    let value = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let ids: Option<Vec<u64>> = value
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|items| items.iter().map(Value::as_u64).collect());
    match ids {
        Some(ids) => {
            Json(json!({"prompt": server.engine.config.text.detokenize(&ids)})).into_response()
        }
        None => SimError::bad_request("`tokens` must be a list of token ids").into_response(),
    }
}

async fn models(State(server): State<Server>) -> Json<Value> {
    let model = &server.engine.config.model;
    Json(json!({
        "object": "list",
        "data": [{
            "id": model, "object": "model", "created": server.started, "owned_by": "vllm",
            "root": model, "parent": null, "max_model_len": server.engine.config.max_model_len,
            "permission": [{
                "id": format!("modelperm-{}", server.name), "object": "model_permission",
                "created": server.started, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false,
            }],
        }],
    }))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn version() -> Json<Value> {
    Json(json!({"version": concat!("sim-", env!("CARGO_PKG_VERSION"))}))
}

async fn metrics(State(server): State<Server>) -> Response {
    let text = server
        .engine
        .metrics
        .render(&server.engine.config.model, &server.engine.gauges());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Enough of vLLM's and SGLang's server description for routers that probe it at start.
async fn server_info(State(server): State<Server>) -> Json<Value> {
    let c = &server.engine.config;
    Json(json!({
        "model": c.model, "model_path": c.model, "served_model_name": c.model,
        "tokenizer_path": c.model, "max_model_len": c.max_model_len,
        "max_total_num_tokens": c.kv_blocks * c.block_size, "page_size": c.block_size,
        "block_size": c.block_size, "num_gpu_blocks": c.kv_blocks,
        "max_num_seqs": c.max_num_seqs, "max_running_requests": c.max_num_seqs,
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "disaggregation_mode": "null",
        "is_embedding": false, "version": concat!("sim-", env!("CARGO_PKG_VERSION")),
    }))
}

async fn model_info(State(server): State<Server>) -> Json<Value> {
    let c = &server.engine.config;
    Json(json!({
        "model_path": c.model, "tokenizer_path": c.model, "is_generation": true,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "max_model_len": c.max_model_len, "served_model_name": c.model,
    }))
}
