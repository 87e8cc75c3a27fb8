//! `prefix-router serve`: the OpenAI-compatible, prefix-cache-aware HTTP gateway.
//!
//! This module is wiring: it builds the decision core ([`crate::core`]) and the HTTP front end
//! around it (body limits, the request string, proxying, retries: [`route`]), starts the
//! monitor and discovery with the handles they use, and serves the routes.

pub mod config;
mod disagg;
pub mod discovery;
pub mod inference_pool;
pub(crate) mod metrics;
pub mod monitor;
mod prepare;
pub(crate) mod proxy;
pub mod request_string;
pub(crate) mod route;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prefix_index::{now_secs, PrefixStore};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;

use crate::api_error;
use crate::core::admission::Admission;
pub use crate::core::backend;
use crate::core::matches::StringIndex;
pub use crate::core::policy;
use crate::core::policy::PolicySettings;
use crate::core::{Core, CoreSettings};
use crate::http_metrics;
use crate::server::{self, Running};
use crate::upstream::HttpClient;
pub use config::ServeArgs;
use metrics::GatewayMetrics;
use monitor::{Monitor, MonitorSettings};
use request_string::Endpoint;

/// What the HTTP request path reads.
pub struct GatewaySettings {
    pub max_retries: usize,
    pub request_timeout: Duration,
    pub max_body: usize,
    pub session_header: HeaderName,
    /// Streamed requests: longest wait for one backend's answer to begin before the next is
    /// tried.
    pub upstream_timeout: Duration,
    /// Proxied requests in flight at once (`--max-concurrent`).
    pub max_concurrent: usize,
    /// Names a request's tenant for the gateway queue.
    pub tenant_header: HeaderName,
    /// Write each request's priority into its body for vLLM (`--forward-priority`).
    pub forward_priority: bool,
    /// Take `x-priority` and the tenant header from clients without a tenant
    /// (`--trust-client-headers`).
    pub trust_client_headers: bool,
    /// Precise mode tokenizes bodies up to this size (`--tokenize-max-bytes`).
    pub tokenize_max_bytes: usize,
    /// Disaggregated fleets: the longest wait for a prefill server (`--pd-prefill-timeout`).
    pub pd_prefill_timeout: Duration,
}

impl GatewaySettings {
    /// How many of `candidates` backends a request may try: the chosen one and up to
    /// `--max-retries` more.
    pub fn attempts(&self, candidates: usize) -> usize {
        candidates.min(self.max_retries + 1)
    }
}

/// The HTTP front end's state: the core it asks, and what it needs of its own.
pub struct Gateway {
    pub core: Arc<Core>,
    /// Tokenizers by model name (`--tokenizer`), for precise matching.
    pub tokenizers: HashMap<String, Arc<vllm_protocol::ChatTokenizer>>,
    pub client: HttpClient,
    pub settings: GatewaySettings,
    pub monitor: Monitor,
    /// The gateway queue, when a saturation bound is set.
    pub admission: Option<Arc<Admission>>,
    /// Requests being prepared off the async workers at once (one per core).
    pub(crate) cpu_slots: tokio::sync::Semaphore,
    /// Trace export (`--otlp-endpoint`).
    pub traces: Option<Arc<crate::traces::Traces>>,
    pub(crate) metrics: Arc<GatewayMetrics>,
    /// Every component's metrics, registered once at build.
    registry: Registry,
    pub(crate) keys: crate::access::Keys,
}

/// The prefix store a router uses: `--index-url`'s remote index, else `--store`. Notifies go
/// in the background to anything but the memory store.
async fn open_store(args: &ServeArgs) -> anyhow::Result<(Arc<dyn PrefixStore>, bool)> {
    let hasher = args.store.hasher()?;
    Ok(match &args.index_url {
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
    })
}

/// Builds the gateway from resolved arguments (without starting its background tasks).
pub async fn gateway(args: &ServeArgs) -> anyhow::Result<Arc<Gateway>> {
    Ok(gateway_with(args, |_| ()).await?.0)
}

/// [`gateway`], with a front end's own metrics registered beside the core's.
pub(crate) async fn gateway_with<T>(
    args: &ServeArgs,
    register: impl FnOnce(&mut Registry) -> T,
) -> anyhow::Result<(Arc<Gateway>, T)> {
    let (store, inline_notify) = open_store(args).await?;
    let header_name = |flag: &str, name: &str| {
        HeaderName::try_from(name.to_ascii_lowercase())
            .map_err(|_| anyhow::anyhow!("{flag} {name:?} is not a valid header name"))
    };
    let session_header = header_name("--session-header", &args.session_header)?;
    let tenant_header = header_name("--tenant-header", &args.queue.tenant_header)?;
    let bus = args.bus.settings()?;
    // The replicas' key seeds the hashes they exchange unless a seed is given.
    let seed = args
        .store
        .hash_seed
        .or_else(|| Some(bus.as_ref()?.key.as_ref()?.hash_seed()))
        .unwrap_or(0);
    let mut registry = Registry::default();
    let strings = StringIndex::new(
        store,
        args.store.hasher_seeded(seed)?,
        args.store_timeout,
        inline_notify,
        &mut registry,
    );
    let events = args.kv_events.then_some(crate::core::EventsSettings {
        events: crate::core::events::EventSettings {
            warmup: args.kv_warmup,
            credit: args.kv_credit,
            seed,
            max_message: args.kv_events_max_message,
        },
        default_port: args.kv_events_port,
        replay_port: args.kv_replay_port,
    });
    let mut tokenizers = HashMap::new();
    for (model, dir) in args.tokenizer_dirs()? {
        let tokenizer = vllm_protocol::ChatTokenizer::from_dir(&dir)
            .map_err(|e| anyhow::anyhow!("--tokenizer {model}={}: {e}", dir.display()))?;
        tokenizers.insert(model, tokenizer);
    }
    if args.kv_events && tokenizers.is_empty() {
        tracing::warn!("--kv-events without --tokenizer: no request can be matched by its tokens; the string index answers");
    }
    let core = Arc::new(Core::new(
        strings,
        events,
        &PolicySettings {
            kind: args.policy,
            cache_threshold: args.cache_threshold,
            balance_abs: args.balance_abs,
            balance_rel: args.balance_rel,
            session_load_factor: 1.25,
        },
        CoreSettings {
            unhealthy_after: args.unhealthy_after.max(1),
            default_capacity: args.store.capacity,
            pd: crate::core::disagg::PdSettings {
                threshold: args.pd_threshold,
            },
        },
        &mut registry,
    ));
    let mut keys = args.access.keys()?;
    if let Some(path) = &args.tenants.api_keys_file {
        let tenants = crate::tenants::Tenants::load(path, &mut registry)?;
        tenants.watch();
        keys = keys.with_tenants(tenants);
    }
    let metrics = Arc::new(GatewayMetrics::register(&mut registry));
    let front_end = register(&mut registry);
    {
        let metrics = metrics.clone();
        core.on_backend_left(move |b| metrics.forget_backend(b));
    }
    let client = crate::upstream::client(args.connect_timeout);
    let monitor = Monitor {
        core: core.clone(),
        client: client.clone(),
        settings: MonitorSettings {
            health_interval: args.health_interval,
            health_timeout: args.health_interval.min(Duration::from_secs(5)),
            metrics_interval: args.metrics_interval,
        },
    };
    monitor.apply(&args.backend_specs()?).await?;
    // After the configured backends joined: a peer's snapshot is merged for the backends this
    // replica knows.
    if let Some(bus) = bus {
        crate::replica_bus::ReplicaBus::start(bus, &core, &mut registry).await?;
    }
    let queue = args.queue.settings();
    let admission = queue.enabled().then(|| {
        let weak = Arc::downgrade(&core);
        Admission::start(
            queue,
            Box::new(move |model, bounds| {
                weak.upgrade().map_or(0, |core| core.room(model, bounds))
            }),
            &mut registry,
        )
    });
    let traces = match &args.otlp_endpoint {
        Some(endpoint) => Some(crate::traces::Traces::start(endpoint, args.otlp_interval)?),
        None => None,
    };
    let gateway = Arc::new(Gateway {
        admission,
        traces,
        core,
        tokenizers,
        client,
        settings: GatewaySettings {
            max_retries: args.max_retries,
            request_timeout: args.request_timeout,
            max_body: args.max_body,
            session_header,
            upstream_timeout: args.upstream_timeout,
            max_concurrent: args.limits.max_concurrent,
            tenant_header,
            forward_priority: args.queue.forward_priority,
            trust_client_headers: args.queue.trust_client_headers,
            tokenize_max_bytes: args.tokenize_max_bytes,
            pd_prefill_timeout: args.pd_prefill_timeout,
        },
        cpu_slots: tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        ),
        monitor,
        metrics,
        registry,
        keys,
    });
    Ok((gateway, front_end))
}

/// Re-reads the config file when it changes.
fn watch_config(monitor: &Monitor, args: ServeArgs) {
    let Some(path) = args.config.clone() else {
        return;
    };
    let weak = monitor.downgrade();
    tokio::spawn(async move {
        let mut seen = config::modified(&path);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(monitor) = weak.upgrade() else {
                return;
            };
            let now = config::modified(&path);
            if now == seen {
                continue;
            }
            seen = now;
            match args.backend_specs() {
                Ok(specs) => {
                    tracing::info!(path = %path.display(), backends = specs.len(), "config file changed");
                    if let Err(e) = monitor.apply(&specs).await {
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

async fn chat(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route::route(gw, Endpoint::Chat, req).await
}
async fn completions(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route::route(gw, Endpoint::Completions, req).await
}
async fn embeddings(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route::route(gw, Endpoint::Embeddings, req).await
}
async fn responses(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route::route(gw, Endpoint::Responses, req).await
}
async fn by_load(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    route::route(gw, Endpoint::Other, req).await
}

/// The union of the models the backends serve.
async fn models(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let mut names: Vec<Arc<str>> = Vec::new();
    for b in gw.core.fleet.snapshot().iter() {
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

pub(crate) async fn health(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let fleet = gw.core.fleet.snapshot();
    let healthy = fleet.iter().filter(|b| b.is_healthy()).count();
    Json(json!({"status": "ok", "backends": fleet.len(), "healthy_backends": healthy}))
}

pub(crate) async fn metrics_text(State(gw): State<Arc<Gateway>>) -> Response {
    gw.core.observe_fleet();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(http_metrics::CONTENT_TYPE),
        )],
        http_metrics::encode(&gw.registry),
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
        .with_state(gw.clone())
        .layer(axum::middleware::from_fn(move |req, next| {
            crate::access::guard(keys.clone(), need, req, next)
        }))
        .layer(axum::middleware::from_fn(move |req, next| {
            traced(gw.clone(), req, next)
        }))
        .layer(CatchPanicLayer::custom(api_error::panic_response))
}

/// Marks an answer whose body ends the request's span (at its last byte).
#[derive(Clone, Copy)]
pub(crate) struct SpanEndsWithBody;

/// Middleware: a trace span for every request sent to the router (POST), from its arrival:
/// the time spent reading, queueing and tokenizing is in it, and a refusal (401, 404, 429,
/// 503) is a span too. The request path reads it from the request's extensions.
async fn traced(gw: Arc<Gateway>, mut req: Request, next: axum::middleware::Next) -> Response {
    let Some(traces) = gw
        .traces
        .as_ref()
        .filter(|_| req.method() == axum::http::Method::POST)
    else {
        return next.run(req).await;
    };
    let name = format!("POST {}", req.uri().path());
    let span = traces.request(name, req.headers_mut());
    req.extensions_mut().insert(span.clone());
    let response = next.run(req).await;
    if response.extensions().get::<SpanEndsWithBody>().is_none() {
        span.end(response.status().as_u16());
    }
    response
}

/// Starts the background work: monitoring, config file, Kubernetes discovery. The flag turns
/// true once the backends are known (at once, unless they come from Kubernetes).
pub(crate) async fn start_background(
    gw: &Arc<Gateway>,
    args: &ServeArgs,
    k8s_client: Option<kube::Client>,
) -> anyhow::Result<Arc<std::sync::atomic::AtomicBool>> {
    monitor::spawn(&gw.monitor);
    match args.k8s() {
        Some(settings) => {
            let static_specs = args.backend_specs()?;
            discovery::spawn(
                &gw.monitor,
                settings,
                static_specs,
                args.backend_api_key.clone(),
                k8s_client,
            )
            .await
        }
        None => {
            watch_config(&gw.monitor, args.clone());
            Ok(Arc::new(std::sync::atomic::AtomicBool::new(true)))
        }
    }
}

/// Runs the gateway until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let listener = server::bind(args.listen).await?;
    let gw = gateway(&args).await?;
    start_background(&gw, &args, None).await?;
    tracing::info!(
        listen = %listener.local_addr()?,
        policy = gw.core.policy_name(),
        store = gw.core.store().kind(),
        discovery = args.discovery.as_str(),
        backends = gw.core.fleet.all().len(),
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
