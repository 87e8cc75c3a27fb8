//! The string server's HTTP API (see the README for the wire format).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{header, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use prefix_index::{now_secs, PrefixHasher, PrefixHashes, PrefixStore, ServerId, Tick};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tower_http::catch_panic::CatchPanicLayer;

use super::metrics::IndexMetrics;
use crate::access::{self, Keys, Need};
use crate::api_error::{self, ApiError};
use crate::http_metrics;
use crate::json_body::{BodyLimit, JsonBody};
use crate::server::ConcurrencyLimit;

/// What every handler shares.
#[derive(Clone)]
pub struct IndexState {
    store: Arc<dyn PrefixStore>,
    hasher: PrefixHasher,
    metrics: Arc<IndexMetrics>,
    max_body: usize,
    /// The latest `t` (ms) any notify brought: the store's notion of now for purging.
    clock: Arc<AtomicU64>,
    keys: Keys,
    concurrency: ConcurrencyLimit,
}

impl IndexState {
    pub fn new(store: Arc<dyn PrefixStore>, hasher: PrefixHasher, max_body: usize) -> Self {
        Self {
            store,
            hasher,
            metrics: Arc::new(IndexMetrics::new()),
            max_body,
            clock: Arc::default(),
            keys: Keys::default(),
            concurrency: ConcurrencyLimit::new(4096),
        }
    }

    /// Caps the requests handled at once (all but health and metrics).
    pub fn with_max_concurrent(mut self, max: usize) -> Self {
        self.concurrency = ConcurrencyLimit::new(max);
        self
    }

    /// Requires API and admin keys (see [`crate::access`]).
    pub fn with_keys(mut self, keys: Keys) -> Self {
        self.keys = keys;
        self
    }

    /// The latest `t` (ms) any notify brought.
    pub fn clock(&self) -> Arc<AtomicU64> {
        self.clock.clone()
    }

    fn store_result<T>(&self, r: Result<T, prefix_index::StoreError>) -> Result<T, ApiError> {
        r.map_err(|e| {
            if !matches!(e, prefix_index::StoreError::InvalidArgument(_)) {
                self.metrics.store_error();
            }
            ApiError::from(e)
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NotifyBody {
    request: Option<String>,
    hashes: Option<Vec<u64>>,
    server_id: ServerId,
    t: Option<f64>,
}

#[derive(Serialize)]
struct NotifyAnswer {
    chunks: u64,
    inserted: u64,
    evicted: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryBody {
    request: Option<String>,
    hashes: Option<Vec<u64>>,
    server_ids: Vec<ServerId>,
    t: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PurgeBody {
    t: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompatibilityBody {
    chunk_size: usize,
    hash_fingerprint: u64,
}

#[derive(Serialize)]
struct QueryAnswer {
    server_id: ServerId,
    matched_chunks: u64,
    total_chunks: u64,
    matches: Vec<Match>,
}

#[derive(Serialize)]
struct Match {
    server_id: ServerId,
    matched_chunks: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CapacityBody {
    capacity: u64,
}

/// `t` from the body (unix seconds), or now.
fn time(t: Option<f64>) -> Result<Tick, ApiError> {
    match t {
        None => Ok(Tick::from_secs(now_secs())),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Tick::from_secs(t)),
        Some(t) => Err(ApiError::bad_request(format!(
            "`t` must be a non-negative number of unix seconds, got {t}"
        ))),
    }
}

/// The prefix hashes of a body that carries either the request text or hashes computed by a
/// client with the same chunk size and seed (`POST /v1/compatibility` checks that).
fn prefix_hashes(
    hasher: &PrefixHasher,
    request: Option<String>,
    hashes: Option<Vec<u64>>,
) -> Result<PrefixHashes, ApiError> {
    match (request, hashes) {
        (Some(text), None) => Ok(hasher.hash(text.as_bytes())),
        (None, Some(hashes)) => Ok(PrefixHashes::from_raw(hashes)),
        _ => Err(ApiError::bad_request(
            "give exactly one of `request` (the text) and `hashes`",
        )),
    }
}

fn server_id(raw: &str) -> Result<ServerId, ApiError> {
    raw.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "server id must be an unsigned 64-bit integer, got {raw:?}"
        ))
    })
}

async fn notify(
    State(state): State<IndexState>,
    JsonBody(body): JsonBody<NotifyBody>,
) -> Result<Json<NotifyAnswer>, ApiError> {
    let t = time(body.t)?;
    let hashes = prefix_hashes(&state.hasher, body.request, body.hashes)?;
    let outcome = state.store_result(state.store.notify(&hashes, body.server_id, t).await)?;
    state.metrics.notified(body.server_id, &outcome);
    state.clock.fetch_max(t.millis(), Ordering::Relaxed);
    Ok(Json(NotifyAnswer {
        chunks: outcome.chunks,
        inserted: outcome.inserted,
        evicted: outcome.evicted,
    }))
}

async fn query(
    State(state): State<IndexState>,
    JsonBody(body): JsonBody<QueryBody>,
) -> Result<Json<QueryAnswer>, ApiError> {
    let t = time(body.t)?;
    if body.server_ids.is_empty() {
        return Err(ApiError::bad_request("`server_ids` must not be empty"));
    }
    let hashes = prefix_hashes(&state.hasher, body.request, body.hashes)?;
    let outcome = state.store_result(state.store.query(&hashes, &body.server_ids, t).await)?;
    Ok(Json(QueryAnswer {
        server_id: outcome.best,
        matched_chunks: outcome.matched,
        total_chunks: outcome.total,
        matches: body
            .server_ids
            .iter()
            .zip(&outcome.matches)
            .map(|(&server_id, &matched_chunks)| Match {
                server_id,
                matched_chunks,
            })
            .collect(),
    }))
}

async fn list_servers(State(state): State<IndexState>) -> Result<Response, ApiError> {
    let servers = state.store_result(state.store.servers().await)?;
    let servers: Vec<_> = servers
        .iter()
        .map(|s| json!({"server_id": s.server_id, "chunks": s.entries, "capacity": s.capacity}))
        .collect();
    Ok(Json(json!({ "servers": servers })).into_response())
}

async fn set_capacity(
    State(state): State<IndexState>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CapacityBody>,
) -> Result<Response, ApiError> {
    let id = server_id(&id)?;
    let evicted = state.store_result(state.store.set_capacity(id, body.capacity).await)?;
    state.metrics.evicted(id, evicted);
    Ok(
        Json(json!({"server_id": id, "capacity": body.capacity, "evicted": evicted}))
            .into_response(),
    )
}

async fn drop_server(
    State(state): State<IndexState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = server_id(&id)?;
    let removed = state.store_result(state.store.drop_server(id).await)?;
    state.metrics.dropped(id);
    Ok(Json(json!({"server_id": id, "removed": removed})).into_response())
}

/// Removes the entries a TTL already hides at `t` (default: now).
async fn purge(
    State(state): State<IndexState>,
    JsonBody(body): JsonBody<PurgeBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let t = time(body.t)?;
    let purged = state.store_result(state.store.purge_expired(t).await)?;
    Ok(Json(json!({ "purged": purged })))
}

/// Whether a client hashes requests as this server does (same chunk size and seed), without
/// revealing anything about the seed but the yes or no.
async fn compatibility(
    State(state): State<IndexState>,
    JsonBody(body): JsonBody<CompatibilityBody>,
) -> Json<serde_json::Value> {
    Json(json!({
        "compatible": body.chunk_size == state.hasher.chunk_size()
            && body.hash_fingerprint == state.hasher.fingerprint(),
        "chunk_size": state.hasher.chunk_size(),
        "store": state.store.kind(),
    }))
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn metrics(State(state): State<IndexState>) -> Result<Response, ApiError> {
    let servers = state.store_result(state.store.servers().await)?;
    state.metrics.set_servers(&servers);
    Ok((
        [(header::CONTENT_TYPE, http_metrics::CONTENT_TYPE)],
        http_metrics::encode(&state.metrics.registry),
    )
        .into_response())
}

/// Makes the configured body limit known to the [`JsonBody`] extractor.
async fn body_limit(State(limit): State<usize>, mut req: Request, next: Next) -> Response {
    req.extensions_mut().insert(BodyLimit(limit));
    next.run(req).await
}

/// Writes need the admin key; health and metrics are open; the rest needs the API key.
fn need(req: &Request) -> Need {
    let path = req.uri().path();
    match *req.method() {
        _ if path == "/health" || path == "/metrics" => Need::Open,
        Method::POST if path == "/v1/notify" || path == "/v1/purge" => Need::Admin,
        Method::PUT | Method::DELETE if path.starts_with("/v1/servers/") => Need::Admin,
        _ => Need::Client,
    }
}

/// The string server's routes.
pub fn app(state: IndexState) -> Router {
    let http = state.metrics.http.clone();
    let max_body = state.max_body;
    let keys = state.keys.clone();
    let limit = state.concurrency.clone();
    Router::new()
        .route("/v1/notify", post(notify))
        .route("/v1/query", post(query))
        .route("/v1/servers", get(list_servers))
        .route("/v1/servers/{id}", put(set_capacity).delete(drop_server))
        .route("/v1/compatibility", post(compatibility))
        .route("/v1/purge", post(purge))
        .route_layer(middleware::from_fn(move |req, next| {
            limit.clone().admit(req, next)
        }))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(api_error::wrong_method)
        .fallback(api_error::unknown_path)
        .with_state(state)
        .layer(middleware::from_fn_with_state(max_body, body_limit))
        .layer(middleware::from_fn(move |req, next| {
            access::guard(keys.clone(), need, req, next)
        }))
        .layer(middleware::from_fn_with_state(http, http_metrics::track))
        .layer(CatchPanicLayer::custom(api_error::panic_response))
}
