//! Watching the backends: health checks, model discovery, load and cache size from their
//! `/metrics`. The monitor holds what it uses — the core (the fleet, and the transitions a
//! failed or recovered backend causes), the upstream client and its intervals — not the
//! gateway.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::http::{Method, Request};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

use crate::core::backend::{Backend, BackendSpec};
use crate::core::Core;
use crate::upstream::HttpClient;

/// How often and how long the monitor checks.
#[derive(Clone, Debug)]
pub struct MonitorSettings {
    pub health_interval: Duration,
    pub health_timeout: Duration,
    pub metrics_interval: Duration,
}

/// What the monitor works with.
#[derive(Clone)]
pub struct Monitor {
    pub core: Arc<Core>,
    pub client: HttpClient,
    pub settings: MonitorSettings,
}

impl Monitor {
    /// Applies a new backend list: new backends are checked and scraped at once.
    pub async fn apply(&self, specs: &[BackendSpec]) -> anyhow::Result<()> {
        let added = self.core.set_backends(specs).await?;
        futures_util::future::join_all(added.iter().map(|b| async {
            check_backend(self, b).await;
            scrape_backend(self, b).await;
        }))
        .await;
        Ok(())
    }

    /// A handle that does not keep the core alive (for background tasks).
    pub fn downgrade(&self) -> WeakMonitor {
        WeakMonitor {
            core: Arc::downgrade(&self.core),
            client: self.client.clone(),
            settings: self.settings.clone(),
        }
    }
}

/// A [`Monitor`] whose core may be gone.
#[derive(Clone)]
pub struct WeakMonitor {
    core: Weak<Core>,
    client: HttpClient,
    settings: MonitorSettings,
}

impl WeakMonitor {
    pub fn upgrade(&self) -> Option<Monitor> {
        Some(Monitor {
            core: self.core.upgrade()?,
            client: self.client.clone(),
            settings: self.settings.clone(),
        })
    }
}

/// What a backend's `/metrics` tells the router.
#[derive(Debug, Default, PartialEq)]
pub struct Reported {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_usage: Option<f64>,
    pub block_size: Option<u64>,
    pub num_gpu_blocks: Option<u64>,
}

/// Reads the few vLLM metrics the router uses (summed over label sets, e.g. several engines).
pub fn parse_metrics(text: &str) -> Reported {
    let mut r = Reported::default();
    let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let (name_labels, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let name = name_labels.split('{').next().unwrap_or("");
        let value: f64 = value.parse().unwrap_or(f64::NAN);
        match name {
            "vllm:num_requests_running" => add(&mut r.running, value),
            "vllm:num_requests_waiting" => add(&mut r.waiting, value),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                r.kv_usage = Some(r.kv_usage.unwrap_or(0.0).max(value))
            }
            "vllm:cache_config_info" => {
                let label = |key: &str| -> Option<u64> {
                    let start = name_labels.find(&format!("{key}=\""))? + key.len() + 2;
                    let rest = &name_labels[start..];
                    rest[..rest.find('"')?].parse().ok()
                };
                r.block_size = label("block_size");
                r.num_gpu_blocks = label("num_gpu_blocks");
            }
            _ => {}
        }
    }
    r
}

/// GETs `path` on a backend, returning the body if the answer is a 2xx within `timeout`.
pub async fn get(
    client: &HttpClient,
    backend: &Backend,
    path: &str,
    timeout: Duration,
) -> Option<Bytes> {
    let mut req = Request::builder()
        .method(Method::GET)
        .uri(format!("{}{path}", backend.url()))
        .body(Full::new(Bytes::new()))
        .ok()?;
    if let Some(auth) = backend.authorization() {
        req.headers_mut()
            .insert(axum::http::header::AUTHORIZATION, auth);
    }
    let fetch = async {
        let resp = client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        // Limit what a misbehaving backend can make us buffer.
        Limited::new(resp.into_body(), 8 << 20)
            .collect()
            .await
            .ok()
            .map(|b| b.to_bytes())
    };
    tokio::time::timeout(timeout, fetch).await.ok().flatten()
}

/// Model ids from an OpenAI `/v1/models` answer.
pub fn parse_models(body: &[u8]) -> Option<Vec<String>> {
    parse_model_list(body).map(|(models, _)| models)
}

/// Model ids from an OpenAI `/v1/models` answer, and the longest `max_model_len` among them
/// (vLLM's model cards carry it).
pub fn parse_model_list(body: &[u8]) -> Option<(Vec<String>, Option<u64>)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = v.get("data")?.as_array()?;
    let models = data
        .iter()
        .filter_map(|m| m.get("id")?.as_str().map(str::to_owned))
        .collect();
    let longest = data
        .iter()
        .filter_map(|m| m.get("max_model_len")?.as_u64())
        .max();
    Some((models, longest))
}

/// One health round for one backend: `/health`, then (if healthy and not configured) its
/// models.
pub async fn check_backend(m: &Monitor, backend: &Arc<Backend>) {
    let timeout = m.settings.health_timeout;
    let ok = get(&m.client, backend, "/health", timeout).await.is_some();
    if !ok {
        m.core.backend_failed(backend);
        return;
    }
    if backend.spec().models.is_none() {
        match get(&m.client, backend, "/v1/models", timeout)
            .await
            .as_deref()
            .and_then(parse_model_list)
        {
            Some((models, longest)) => {
                backend
                    .max_model_len
                    .store(longest.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
                let current = backend.models.load();
                if current.len() != models.len()
                    || current.iter().zip(&models).any(|(a, b)| **a != **b)
                {
                    tracing::info!(backend = backend.url(), ?models, "models discovered");
                    backend.models.store(Arc::new(
                        models.iter().map(|m| Arc::from(m.as_str())).collect(),
                    ));
                }
            }
            None => {
                m.core.backend_failed(backend);
                return;
            }
        }
    }
    m.core.backend_succeeded(backend).await;
}

/// One load round for one backend: running, waiting, KV usage and cache size.
pub async fn scrape_backend(m: &Monitor, backend: &Arc<Backend>) {
    let Some(body) = get(&m.client, backend, "/metrics", m.settings.health_timeout).await else {
        return;
    };
    let r = parse_metrics(&String::from_utf8_lossy(&body));
    let running = r.running.unwrap_or(0.0).max(0.0) as u64;
    let waiting = r.waiting.unwrap_or(0.0).max(0.0) as u64;
    backend.reported_running.store(running, Relaxed);
    backend.report_waiting(waiting);
    backend.reported_queue.store(running + waiting, Relaxed);
    if let Some(kv) = r.kv_usage {
        backend.report_kv_usage(kv);
    }
    if let (Some(block_size), Some(blocks)) = (r.block_size, r.num_gpu_blocks) {
        backend.cache_tokens.store(blocks * block_size, Relaxed);
    }
    let cache_tokens = backend.cache_tokens.load(Relaxed);
    if cache_tokens > 0 && backend.spec().capacity.is_none() {
        // Chunks of request text that fit in the KV cache: its tokens × the request-string
        // bytes per token this backend's answers show (4 until they tell).
        let chunk = m.core.strings.hasher.chunk_size() as f64;
        let capacity = ((cache_tokens as f64 * backend.bytes_per_token() / chunk) as u64)
            .clamp(1, prefix_index::MAX_CAPACITY);
        let current = backend.capacity.load(Relaxed);
        // Small drifts of the learned ratio do not resize the index.
        let changed = current.abs_diff(capacity) * 20 > current.max(1);
        if changed && backend.capacity.swap(capacity, Relaxed) != capacity {
            m.core.set_capacity(backend, capacity).await;
        }
    }
}

/// Runs health checks and load scrapes until the core is dropped.
pub fn spawn(m: &Monitor) {
    let weak = m.downgrade();
    let health_every = m.settings.health_interval;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(health_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(m) = weak.upgrade() else { return };
            let backends = m.core.fleet.all();
            futures_util::future::join_all(backends.iter().map(|b| check_backend(&m, b))).await;
        }
    });
    let weak = m.downgrade();
    let scrape_every = m.settings.metrics_interval;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(scrape_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Vec<(u64, u64)> = Vec::new();
        let mut last_at = tokio::time::Instant::now();
        loop {
            tick.tick().await;
            let Some(m) = weak.upgrade() else { return };
            let backends = m.core.fleet.all();
            futures_util::future::join_all(backends.iter().map(|b| scrape_backend(&m, b))).await;
            // Requests per second since the last round.
            let now = tokio::time::Instant::now();
            let secs = now.duration_since(last_at).as_secs_f64().max(1e-3);
            for b in backends.iter() {
                let total = b.routed.load(Relaxed);
                let before = last
                    .iter()
                    .find(|(id, _)| *id == b.id)
                    .map_or(total, |(_, n)| *n);
                b.qps_bits.store(
                    ((total - before.min(total)) as f64 / secs).to_bits(),
                    Relaxed,
                );
            }
            last = backends
                .iter()
                .map(|b| (b.id, b.routed.load(Relaxed)))
                .collect();
            last_at = now;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_metrics() {
        let text = "# HELP x\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"24000\"} 1.0\n";
        assert_eq!(
            parse_metrics(text),
            Reported {
                running: Some(5.0),
                waiting: Some(7.0),
                kv_usage: Some(0.25),
                block_size: Some(16),
                num_gpu_blocks: Some(24000),
            }
        );
        assert_eq!(parse_metrics("garbage\n{}\n"), Reported::default());
    }

    #[test]
    fn reads_models() {
        let body = br#"{"object":"list","data":[{"id":"a","object":"model"},{"id":"b"}]}"#;
        assert_eq!(
            parse_models(body),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(parse_models(b"{}"), None);
    }
}
