//! `prefix-router serve`: the OpenAI-compatible, prefix-cache-aware gateway.

pub mod backend;
pub mod config;
pub mod discovery;
mod metrics;
pub mod monitor;
pub mod policy;
pub(crate) mod proxy;
pub mod request_string;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prefix_index::{
    now_secs, PrefixHasher, PrefixHashes, PrefixStore, QueryOutcome, ServerId, Tick,
};
use serde_json::json;
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;

use crate::api_error::{self, ApiError};
use crate::http_metrics;
use crate::json_body::read_body;
use crate::server::{self, Running};
use backend::{Backend, Fleet, InflightGuard};
pub use config::ServeArgs;
use metrics::{
    DecisionLabels, Label, ModelLabels, OpLabels, RequestLabels, RouterMetrics, ServerLabels,
};
use policy::{Balancer, Decision, PolicySettings, Reason, StoreFailure};
use request_string::Endpoint;

/// Settings the request path reads.
pub struct GatewaySettings {
    pub health_interval: Duration,
    pub health_timeout: Duration,
    pub unhealthy_after: u32,
    pub metrics_interval: Duration,
    pub max_retries: usize,
    pub request_timeout: Duration,
    pub store_timeout: Duration,
    pub max_body: usize,
    pub session_header: HeaderName,
    pub default_capacity: u64,
    /// Streamed requests: longest wait for one backend's answer to begin before the next is
    /// tried.
    pub upstream_timeout: Duration,
    /// Proxied requests in flight at once (`--max-concurrent`).
    pub max_concurrent: usize,
}

/// Everything a request needs.
pub struct Gateway {
    pub fleet: Fleet,
    pub store: Arc<dyn PrefixStore>,
    pub hasher: PrefixHasher,
    pub balancer: Balancer,
    pub client: proxy::HttpClient,
    pub settings: GatewaySettings,
    metrics: RouterMetrics,
    /// Notify on the request path (a memory store answers in microseconds) or in the
    /// background (a database or a remote index).
    inline_notify: bool,
    /// Set while the store fails, so an outage is logged once, not per request.
    store_down: AtomicBool,
    keys: crate::access::Keys,
    /// Drops of backends' index entries still running, by server id: a backend that comes
    /// back (healthy again, or re-added) waits for its drop before its capacity is set again.
    pending_drops: parking_lot::Mutex<HashMap<ServerId, tokio::task::JoinHandle<()>>>,
}

impl Gateway {
    fn store_ok(&self) {
        if self.store_down.swap(false, Relaxed) {
            tracing::info!(
                store = self.store.kind(),
                "the prefix store answers again: prefix routing resumes"
            );
        }
    }

    fn store_failed(&self, op: &'static str, error: &str) {
        self.metrics
            .store_errors
            .get_or_create(&OpLabels { op })
            .inc();
        if !self.store_down.swap(true, Relaxed) {
            tracing::warn!(
                store = self.store.kind(),
                op,
                error,
                "the prefix store failed: routing by load until it answers"
            );
        }
    }

    async fn query(
        &self,
        hashes: &PrefixHashes,
        ids: Vec<ServerId>,
    ) -> Result<QueryOutcome, StoreFailure> {
        let start = Instant::now();
        let t = Tick::from_secs(now_secs());
        let result = tokio::time::timeout(
            self.settings.store_timeout,
            self.store.query(hashes, &ids, t),
        )
        .await;
        self.metrics
            .store_latency
            .get_or_create(&OpLabels { op: "query" })
            .observe(start.elapsed().as_secs_f64());
        match result {
            Ok(Ok(q)) => {
                self.store_ok();
                Ok(q)
            }
            Ok(Err(e)) => {
                self.store_failed("query", &e.to_string());
                Err(StoreFailure)
            }
            Err(_) => {
                self.store_failed("query", "timed out");
                Err(StoreFailure)
            }
        }
    }

    /// Records that `hashes` went to `backend` (whatever becomes of the request: vLLM keeps
    /// the prefill even of a failed one).
    async fn notify(self: &Arc<Self>, hashes: &PrefixHashes, backend: &Arc<Backend>) {
        let run = {
            let gw = self.clone();
            let hashes = hashes.clone();
            let backend = backend.clone();
            async move {
                let start = Instant::now();
                let t = Tick::from_secs(now_secs());
                let result = tokio::time::timeout(
                    gw.settings.store_timeout,
                    gw.store.notify(&hashes, backend.id, t),
                )
                .await;
                gw.metrics
                    .store_latency
                    .get_or_create(&OpLabels { op: "notify" })
                    .observe(start.elapsed().as_secs_f64());
                match result {
                    Ok(Ok(out)) => {
                        gw.store_ok();
                        let entries = &backend.entries;
                        let now = entries.load(Relaxed);
                        entries.store((now + out.inserted).saturating_sub(out.evicted), Relaxed);
                    }
                    Ok(Err(e)) => gw.store_failed("notify", &e.to_string()),
                    Err(_) => gw.store_failed("notify", "timed out"),
                }
            }
        };
        if self.inline_notify {
            run.await
        } else {
            tokio::spawn(run);
        }
    }

    /// A health check or a connection failed; after `--unhealthy-after` the backend leaves the
    /// candidates, and its index entries go (a restarted vLLM has an empty cache).
    pub fn backend_failed(self: &Arc<Self>, backend: &Arc<Backend>) {
        if backend.record_failure(self.settings.unhealthy_after) {
            tracing::warn!(
                backend = backend.url(),
                "backend is unhealthy: it leaves the candidates"
            );
            self.forget(backend.clone());
        }
    }

    /// A check succeeded: a backend that was unhealthy is a candidate again, and its index
    /// capacity (dropped with its entries) is set again once the drop has finished.
    pub async fn backend_succeeded(self: &Arc<Self>, backend: &Arc<Backend>) {
        if backend.record_success() {
            tracing::info!(backend = backend.url(), "backend is healthy");
            self.restore_capacity(backend).await;
        }
    }

    /// Drops a backend's index entries (it left, or it failed and may come back empty). The
    /// drop runs in the background; [`Gateway::restore_capacity`] waits for it.
    fn forget(self: &Arc<Self>, backend: Arc<Backend>) {
        let gw = self.clone();
        let id = backend.id;
        backend.entries.store(0, Relaxed);
        let mut pending = self.pending_drops.lock();
        let before = pending.remove(&id);
        let drop = tokio::spawn(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            if let Err(e) = gw.store.drop_server(backend.id).await {
                tracing::warn!(backend = backend.url(), error = %e, "could not drop the backend's index entries");
            }
        });
        pending.insert(id, drop);
    }

    /// Waits for a pending drop of the backend's entries, then sets its index capacity (the
    /// configured one or the one derived from its KV cache): a store forgets a server's
    /// capacity with its entries.
    async fn restore_capacity(&self, backend: &Backend) {
        let pending = self.pending_drops.lock().remove(&backend.id);
        if let Some(drop) = pending {
            let _ = drop.await;
        }
        let capacity = backend.capacity.load(Relaxed);
        if capacity != self.settings.default_capacity || backend.spec().capacity.is_some() {
            if let Err(e) = self.store.set_capacity(backend.id, capacity).await {
                tracing::warn!(backend = backend.url(), error = %e, "could not set the index capacity");
            }
        }
    }

    /// Applies a new backend list: new ones are checked at once, gone ones forgotten.
    pub async fn set_backends(
        self: &Arc<Self>,
        specs: &[backend::BackendSpec],
    ) -> anyhow::Result<()> {
        let change = self
            .fleet
            .reconcile(specs, self.settings.default_capacity)?;
        for gone in change.removed {
            tracing::info!(backend = gone.url(), "backend left");
            self.metrics.forget_backend(&gone);
            self.forget(gone);
        }
        for b in &change.updated {
            tracing::info!(backend = b.url(), "backend settings changed");
            if b.spec().capacity.is_some() {
                self.restore_capacity(b).await;
            }
        }
        let added = change.added;
        for b in &added {
            tracing::info!(backend = b.url(), "backend joined");
            self.restore_capacity(b).await;
        }
        futures_util::future::join_all(added.iter().map(|b| async {
            monitor::check_backend(self, b).await;
            monitor::scrape_backend(self, b).await;
        }))
        .await;
        Ok(())
    }
}

/// Builds the gateway from resolved arguments (without starting its background tasks).
pub async fn gateway(args: &ServeArgs) -> anyhow::Result<Arc<Gateway>> {
    let hasher = args.store.hasher()?;
    let (store, inline_notify): (Arc<dyn PrefixStore>, bool) = match &args.index_url {
        Some(url) => (
            Arc::new(
                crate::index_client::IndexClient::connect(
                    url,
                    hasher,
                    args.store_timeout.max(Duration::from_secs(1)),
                    args.index_key.as_deref(),
                )
                .await?,
            ),
            false,
        ),
        None => {
            let store = args.store.open().await?;
            let inline = store.kind() == "memory";
            (store, inline)
        }
    };
    let session_header =
        HeaderName::try_from(args.session_header.to_ascii_lowercase()).map_err(|_| {
            anyhow::anyhow!(
                "--session-header {:?} is not a valid header name",
                args.session_header
            )
        })?;
    let gw = Arc::new(Gateway {
        fleet: Fleet::default(),
        store,
        hasher,
        balancer: Balancer::new(PolicySettings {
            kind: args.policy,
            cache_threshold: args.cache_threshold,
            balance_abs: args.balance_abs,
            balance_rel: args.balance_rel,
            session_load_factor: 1.25,
        }),
        client: proxy::client(args.connect_timeout),
        settings: GatewaySettings {
            health_interval: args.health_interval,
            health_timeout: args.health_interval.min(Duration::from_secs(5)),
            unhealthy_after: args.unhealthy_after.max(1),
            metrics_interval: args.metrics_interval,
            max_retries: args.max_retries,
            request_timeout: args.request_timeout,
            store_timeout: args.store_timeout,
            max_body: args.max_body,
            session_header,
            default_capacity: args.store.capacity,
            upstream_timeout: args.upstream_timeout,
            max_concurrent: args.limits.max_concurrent,
        },
        keys: args.access.keys()?,
        metrics: RouterMetrics::new(),
        inline_notify,
        store_down: AtomicBool::new(false),
        pending_drops: Default::default(),
    });
    gw.set_backends(&args.backend_specs()?).await?;
    Ok(gw)
}

/// Re-reads the config file when it changes.
fn watch_config(gw: &Arc<Gateway>, args: ServeArgs) {
    let Some(path) = args.config.clone() else {
        return;
    };
    let weak = Arc::downgrade(gw);
    tokio::spawn(async move {
        let mut seen = config::modified(&path);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(gw) = weak.upgrade() else { return };
            let now = config::modified(&path);
            if now == seen {
                continue;
            }
            seen = now;
            match args.backend_specs() {
                Ok(specs) => {
                    tracing::info!(path = %path.display(), backends = specs.len(), "config file changed");
                    if let Err(e) = gw.set_backends(&specs).await {
                        tracing::warn!(error = %e, "could not apply the changed config file");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the changed config file is invalid; keeping the backends")
                }
            }
        }
    });
}

fn bad_gateway(why: impl std::fmt::Display) -> Response {
    ApiError::new(StatusCode::BAD_GATEWAY, format!("backend failure: {why}")).into_response()
}

/// The request path of every proxied endpoint.
async fn route(gw: Arc<Gateway>, endpoint: Endpoint, req: Request) -> Response {
    let received = Instant::now();
    let (parts, body) = req.into_parts();
    let body = match read_body(body, gw.settings.max_body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let routing = match request_string::routing(endpoint, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    // Candidates: healthy backends serving the model.
    let fleet = gw.fleet.snapshot();
    let mut model_label: Option<Arc<str>> = None;
    let mut known = false;
    let mut candidates = Vec::with_capacity(fleet.len());
    for b in fleet.iter() {
        let serves = match routing.model.as_deref() {
            Some(m) => b.serves(m),
            None => Some(Arc::from("")),
        };
        if let Some(name) = serves {
            known = true;
            model_label.get_or_insert(name);
            if b.is_healthy() {
                candidates.push(b.clone());
            }
        }
    }
    drop(fleet);
    // The label is a name some backend serves, or a constant: never the client's text.
    let model = model_label.unwrap_or_else(|| match routing.model {
        Some(_) => Arc::from(metrics::UNKNOWN_MODEL),
        None => Arc::from(""),
    });
    gw.metrics
        .incoming
        .get_or_create(&ModelLabels {
            model: Label(model.clone()),
        })
        .inc();
    if candidates.is_empty() {
        return match (&routing.model, known) {
            (Some(m), false) => {
                ApiError::not_found(format!("The model `{m}` does not exist.")).into_response()
            }
            _ => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy backend serves this model",
            )
            .into_response(),
        };
    }
    let kind = gw.balancer.settings.kind;
    let hashes = (kind.uses_prefixes() && endpoint != Endpoint::Other)
        .then(|| gw.hasher.hash(routing.text.as_bytes()));
    let session = parts
        .headers
        .get(&gw.settings.session_header)
        .and_then(|v| v.to_str().ok());
    let decision: Decision = if endpoint == Endpoint::Other {
        policy::by_load(&mut candidates, gw.balancer.next_turn());
        Decision {
            order: candidates,
            reason: Reason::LeastLoaded,
            matched_ratio: None,
        }
    } else {
        let gw2 = gw.clone();
        let hashes_ref = hashes.as_ref();
        gw.balancer
            .decide(candidates, hashes_ref, session, |ids| async move {
                gw2.query(hashes_ref.expect("prefix policies have hashes"), ids)
                    .await
            })
            .await
    };
    gw.metrics
        .decisions
        .get_or_create(&DecisionLabels {
            policy: if endpoint == Endpoint::Other {
                "least_loaded"
            } else {
                kind.name()
            },
            reason: decision.reason.label(),
        })
        .inc();
    if let Some(ratio) = decision.matched_ratio {
        gw.metrics.matched_ratio.observe(ratio);
    }
    forward(
        &gw,
        Outgoing {
            parts,
            body,
            stream: routing.stream,
            text_bytes: routing.text.len() as u64,
            received,
            model,
        },
        decision.order,
        hashes.as_ref(),
    )
    .await
}

/// A request on its way to a backend.
struct Outgoing {
    parts: axum::http::request::Parts,
    body: bytes::Bytes,
    /// Streamed: the backend's head comes at once, so waiting for it is bounded.
    stream: bool,
    /// Length of its request string (against the prompt tokens the answer reports).
    text_bytes: u64,
    received: Instant,
    /// The metric label of its model.
    model: Arc<str>,
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
    req: Outgoing,
    order: Vec<Arc<Backend>>,
    hashes: Option<&PrefixHashes>,
) -> Response {
    let Outgoing {
        parts,
        body,
        stream,
        text_bytes,
        received,
        model,
    } = req;
    let request_id = proxy::request_id(&parts.headers);
    let mut headers = parts.headers;
    headers.insert("x-request-id", request_id.clone());
    if !gw.keys.is_open() {
        // The client's bearer token is this router's key, not the backend's: it stays here.
        headers.remove(axum::http::header::AUTHORIZATION);
    }
    let deadline = received + gw.settings.request_timeout;
    let attempts = order.len().min(gw.settings.max_retries + 1);
    let mut last_error: Option<Response> = None;
    let timed_out = || {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "the backend did not answer in time",
        )
        .into_response()
    };
    for (attempt, backend) in order.into_iter().take(attempts).enumerate() {
        if let Some(hashes) = hashes {
            gw.notify(hashes, &backend).await;
        }
        let upstream =
            proxy::upstream_request(&backend, &parts.method, &parts.uri, &headers, body.clone());
        let guard = InflightGuard::new(backend.clone());
        backend.routed.fetch_add(1, Relaxed);
        if attempt == 0 {
            gw.metrics
                .added_latency
                .observe(received.elapsed().as_secs_f64());
        }
        let last = attempt + 1 == attempts;
        let attempt_deadline = if stream {
            deadline.min(Instant::now() + gw.settings.upstream_timeout)
        } else {
            deadline
        };
        match tokio::time::timeout_at(attempt_deadline.into(), gw.client.request(upstream)).await {
            Err(_) if !last && attempt_deadline < deadline => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), "the stream did not begin in time: trying the next backend");
                record(gw, &backend, &model, 504, received.elapsed());
                gw.metrics.count_retry(&backend);
                last_error = Some(timed_out());
            }
            Err(_) => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), "request timed out");
                record(gw, &backend, &model, 504, received.elapsed());
                return timed_out();
            }
            Ok(Err(e)) => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), error = %e, "backend connection failed");
                if e.is_connect() {
                    gw.backend_failed(&backend);
                }
                record(gw, &backend, &model, 502, received.elapsed());
                gw.metrics.count_retry(&backend);
                last_error = Some(bad_gateway(e));
            }
            Ok(Ok(resp)) if resp.status().is_server_error() && !last => {
                tracing::warn!(request_id = ?request_id, backend = backend.url(), status = resp.status().as_u16(), "backend error: trying the next backend");
                record(
                    gw,
                    &backend,
                    &model,
                    resp.status().as_u16(),
                    received.elapsed(),
                );
                gw.metrics.count_retry(&backend);
            }
            Ok(Ok(resp)) => {
                let gw2 = gw.clone();
                let b2 = backend.clone();
                let on_end = move |ended: proxy::Ended| {
                    if let (200, Some(tokens)) = (ended.status, ended.prompt_tokens) {
                        b2.observe_prompt(text_bytes, tokens);
                    }
                    record(&gw2, &b2, &model, ended.status, received.elapsed())
                };
                let mut response = proxy::downstream_response(resp, guard, on_end, deadline);
                response.headers_mut().insert("x-request-id", request_id);
                tracing::debug!(backend = backend.url(), attempt, "routed");
                return response;
            }
        }
    }
    last_error.unwrap_or_else(|| bad_gateway("every backend tried failed"))
}

fn record(gw: &Gateway, backend: &Backend, model: &Arc<str>, status: u16, elapsed: Duration) {
    gw.metrics.count_request(RequestLabels {
        backend: Label(backend.label.clone()),
        model: Label(model.clone()),
        status,
    });
    gw.metrics
        .request_latency
        .get_or_create(&ServerLabels {
            server: Label(backend.label.clone()),
        })
        .observe(elapsed.as_secs_f64());
}

async fn chat(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route(gw, Endpoint::Chat, req).await
}
async fn completions(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route(gw, Endpoint::Completions, req).await
}
async fn embeddings(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route(gw, Endpoint::Embeddings, req).await
}
async fn responses(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route(gw, Endpoint::Responses, req).await
}
async fn by_load(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route(gw, Endpoint::Other, req).await
}

/// The union of the models the backends serve.
async fn models(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let mut names: Vec<Arc<str>> = Vec::new();
    for b in gw.fleet.snapshot().iter() {
        for m in b.models.load().iter() {
            if !names.contains(m) {
                names.push(m.clone());
            }
        }
    }
    let created = now_secs() as u64;
    Json(json!({
        "object": "list",
        "data": names.iter().map(|m| json!({"id": &**m, "object": "model", "created": created, "owned_by": "vllm", "root": &**m, "parent": null})).collect::<Vec<_>>(),
    }))
}

async fn health(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let fleet = gw.fleet.snapshot();
    let healthy = fleet.iter().filter(|b| b.is_healthy()).count();
    Json(json!({"status": "ok", "backends": fleet.len(), "healthy_backends": healthy}))
}

async fn metrics_text(State(gw): State<Arc<Gateway>>) -> Response {
    gw.metrics.observe_backends(&gw.fleet.all());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(http_metrics::CONTENT_TYPE),
        )],
        http_metrics::encode(&gw.metrics.registry),
    )
        .into_response()
}

/// Health and metrics are open; everything else needs the API key when one is set.
fn need(req: &Request) -> crate::access::Need {
    match req.uri().path() {
        "/health" | "/metrics" => crate::access::Need::Open,
        _ => crate::access::Need::Client,
    }
}

/// The gateway's routes. Only the proxied ones count against `--max-concurrent`: the health
/// probe and the metrics answer on a router at its cap.
pub fn app(gw: Arc<Gateway>) -> Router {
    let keys = gw.keys.clone();
    let limit = server::ConcurrencyLimit::new(gw.settings.max_concurrent);
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route("/tokenize", post(by_load))
        .route("/detokenize", post(by_load))
        .route("/v1/rerank", post(by_load))
        .route("/rerank", post(by_load))
        .route("/v1/score", post(by_load))
        .route("/score", post(by_load))
        .route_layer(axum::middleware::from_fn(move |req, next| {
            limit.clone().admit(req, next)
        }))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .method_not_allowed_fallback(api_error::wrong_method)
        .fallback(api_error::unknown_path)
        .with_state(gw)
        .layer(axum::middleware::from_fn(move |req, next| {
            crate::access::guard(keys.clone(), need, req, next)
        }))
        .layer(CatchPanicLayer::custom(api_error::panic_response))
}

/// Starts the background work: monitoring, config file, Kubernetes discovery.
async fn start_background(
    gw: &Arc<Gateway>,
    args: &ServeArgs,
    k8s_client: Option<kube::Client>,
) -> anyhow::Result<()> {
    monitor::spawn(gw);
    match args.k8s() {
        Some(settings) => {
            let static_specs = args.backend_specs()?;
            discovery::spawn(
                gw,
                settings,
                static_specs,
                args.backend_api_key.clone(),
                k8s_client,
            )
            .await?;
        }
        None => watch_config(gw, args.clone()),
    }
    Ok(())
}

/// Runs the gateway until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let listener = server::bind(args.listen).await?;
    let gw = gateway(&args).await?;
    start_background(&gw, &args, None).await?;
    tracing::info!(
        listen = %listener.local_addr()?,
        policy = args.policy.name(),
        store = gw.store.kind(),
        discovery = args.discovery.as_str(),
        backends = gw.fleet.all().len(),
        "router ready"
    );
    server::serve_until_signal(listener, app(gw), args.limits.clone()).await
}

/// Starts the gateway in the background on an already bound listener (tests, demo, bench).
pub async fn spawn(
    args: ServeArgs,
    listener: TcpListener,
) -> anyhow::Result<(Running, Arc<Gateway>)> {
    spawn_with(args, listener, None).await
}

/// [`spawn`], with the Kubernetes client discovery should use (tests give a fake API server).
pub async fn spawn_with(
    args: ServeArgs,
    listener: TcpListener,
    k8s_client: Option<kube::Client>,
) -> anyhow::Result<(Running, Arc<Gateway>)> {
    let gw = gateway(&args).await?;
    start_background(&gw, &args, k8s_client).await?;
    Ok((
        Running::spawn(listener, app(gw.clone()), args.limits.clone())?,
        gw,
    ))
}
