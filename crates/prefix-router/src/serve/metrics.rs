//! The gateway's metrics: its own (`prefix_router_*`) and the production-stack router's names
//! where they map (`vllm:*`), so existing dashboards keep working.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, linear_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::backend::Backend;

/// A label value shared without copying (backend URLs, model names, static strings).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Label(pub Arc<str>);

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        write_escaped(encoder, &self.0)
    }
}

/// Writes a label value escaped as the exposition formats require (`\\`, `\"`, `\n`):
/// prometheus-client writes values as given, and one raw quote or newline from a client or a
/// backend would make the whole scrape invalid (or forge a line).
pub fn write_escaped(out: &mut impl std::fmt::Write, value: &str) -> std::fmt::Result {
    let mut rest = value;
    while let Some(i) = rest.find(['\\', '"', '\n']) {
        out.write_str(&rest[..i])?;
        out.write_str(match rest.as_bytes()[i] {
            b'\\' => "\\\\",
            b'"' => "\\\"",
            _ => "\\n",
        })?;
        rest = &rest[i + 1..];
    }
    out.write_str(rest)
}

/// The `model` label of a request whose model no backend serves: client-chosen names must not
/// become series (unbounded, and any text at all).
pub const UNKNOWN_MODEL: &str = "(unknown)";

impl From<&str> for Label {
    fn from(s: &str) -> Self {
        Label(s.into())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub backend: Label,
    pub model: Label,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub policy: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub backend: Label,
}

/// The production-stack router labels its per-backend metrics `server`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabels {
    pub server: Label,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: Label,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency() -> Histogram {
    // 10 µs .. ~42 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 23))
}

fn ratio() -> Histogram {
    Histogram::new(linear_buckets(0.1, 0.1, 10))
}

pub struct RouterMetrics {
    pub registry: Registry,
    requests: Family<RequestLabels, Counter>,
    /// The `requests` label sets created per backend, so they can go when the backend does
    /// (written only when a new set appears).
    request_series: parking_lot::Mutex<Vec<RequestLabels>>,
    pub decisions: Family<DecisionLabels, Counter>,
    pub matched_ratio: Histogram,
    pub added_latency: Histogram,
    pub retries: Family<BackendLabels, Counter>,
    pub store_errors: Family<OpLabels, Counter>,
    pub store_latency: Hist<OpLabels>,
    inflight: Family<BackendLabels, Gauge>,
    healthy: Family<BackendLabels, Gauge>,
    capacity: Family<BackendLabels, Gauge>,
    bytes_per_token: Family<BackendLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    // production-stack names
    pub incoming: Family<ModelLabels, Counter>,
    pub request_latency: Hist<ServerLabels>,
    current_qps: Family<ServerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    running: Family<ServerLabels, Gauge>,
    prefill: Family<ServerLabels, Gauge>,
    decoding: Family<ServerLabels, Gauge>,
    healthy_pods: Family<ServerLabels, Gauge>,
}

impl RouterMetrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Self {
            requests: Family::default(),
            request_series: Default::default(),
            decisions: Family::default(),
            matched_ratio: ratio(),
            added_latency: latency(),
            retries: Family::default(),
            store_errors: Family::default(),
            store_latency: Hist::new_with_constructor(latency),
            inflight: Family::default(),
            healthy: Family::default(),
            capacity: Family::default(),
            bytes_per_token: Family::default(),
            incoming: Family::default(),
            request_latency: Hist::new_with_constructor(latency),
            current_qps: Family::default(),
            running: Family::default(),
            prefill: Family::default(),
            decoding: Family::default(),
            healthy_pods: Family::default(),
            registry: Registry::default(),
        };
        r.register(
            "prefix_router_requests",
            "Requests answered, by backend, model and status",
            m.requests.clone(),
        );
        r.register(
            "prefix_router_routing_decisions",
            "Routing decisions by policy and reason",
            m.decisions.clone(),
        );
        r.register(
            "prefix_router_matched_ratio",
            "Matched chunks / request chunks of the chosen backend (prefix policies)",
            m.matched_ratio.clone(),
        );
        r.register(
            "prefix_router_added_latency_seconds",
            "Time from receiving a request to sending it upstream",
            m.added_latency.clone(),
        );
        r.register(
            "prefix_router_retries",
            "Requests retried on another backend after a failure, by the failed backend",
            m.retries.clone(),
        );
        r.register(
            "prefix_router_store_errors",
            "Prefix store operations that failed or timed out (routing fell back to load)",
            m.store_errors.clone(),
        );
        r.register(
            "prefix_router_store_latency_seconds",
            "Prefix store operation latency",
            m.store_latency.clone(),
        );
        r.register(
            "prefix_router_inflight",
            "Requests in flight, by backend",
            m.inflight.clone(),
        );
        r.register(
            "prefix_router_backend_healthy",
            "1 if the backend is a routing candidate",
            m.healthy.clone(),
        );
        r.register(
            "prefix_router_index_capacity",
            "Index capacity in chunks, by backend (configured, or its KV cache in tokens × bytes per token ÷ chunk size)",
            m.capacity.clone(),
        );
        r.register(
            "prefix_router_bytes_per_token",
            "Request-string bytes per prompt token, learned from the backend's answers (4 until enough were seen)",
            m.bytes_per_token.clone(),
        );
        r.register(
            "vllm:num_incoming_requests",
            "Total valid incoming requests to router (production-stack name)",
            m.incoming.clone(),
        );
        r.register(
            "vllm:request_latency_seconds",
            "End-to-end request latency through the router, by backend (production-stack name)",
            m.request_latency.clone(),
        );
        r.register(
            "vllm:current_qps",
            "Requests per second over the last metrics interval (production-stack name)",
            m.current_qps.clone(),
        );
        r.register(
            "vllm:num_requests_running",
            "Requests in flight at the router, by backend (production-stack name)",
            m.running.clone(),
        );
        r.register(
            "vllm:num_prefill_requests",
            "In-flight requests without a first byte yet (production-stack name)",
            m.prefill.clone(),
        );
        r.register(
            "vllm:num_decoding_requests",
            "In-flight requests that have begun answering (production-stack name)",
            m.decoding.clone(),
        );
        r.register(
            "vllm:healthy_pods_total",
            "1 per healthy backend (production-stack name)",
            m.healthy_pods.clone(),
        );
        Self { registry: r, ..m }
    }

    /// Counts one answered request.
    pub fn count_request(&self, labels: RequestLabels) {
        if let Some(counter) = self.requests.get(&labels) {
            counter.inc();
            return;
        }
        let mut series = self.request_series.lock();
        if !series.contains(&labels) {
            series.push(labels.clone());
        }
        self.requests.get_or_create(&labels).inc();
    }

    /// Counts a request moved on from `backend` to the next candidate.
    pub fn count_retry(&self, backend: &Backend) {
        self.retries
            .get_or_create(&BackendLabels {
                backend: Label(backend.label.clone()),
            })
            .inc();
    }

    /// Removes the series of a backend that left (pods come and go; their series must not
    /// pile up).
    pub fn forget_backend(&self, backend: &Backend) {
        let label = Label(backend.label.clone());
        self.request_series.lock().retain(|labels| {
            let gone = labels.backend == label;
            if gone {
                self.requests.remove(labels);
            }
            !gone
        });
        self.request_latency.remove(&ServerLabels {
            server: label.clone(),
        });
        self.retries.remove(&BackendLabels { backend: label });
    }

    /// Refreshes the per-backend gauges before a scrape.
    pub fn observe_backends(&self, backends: &[Arc<Backend>]) {
        for f in [&self.inflight, &self.healthy, &self.capacity] {
            f.clear();
        }
        self.bytes_per_token.clear();
        for f in [
            &self.running,
            &self.prefill,
            &self.decoding,
            &self.healthy_pods,
        ] {
            f.clear();
        }
        self.current_qps.clear();
        for b in backends {
            let label = Label(b.label.clone());
            let inflight = b.inflight.load(Relaxed) as i64;
            let prefill = b.waiting_first_byte.load(Relaxed) as i64;
            let healthy = i64::from(b.is_healthy());
            self.inflight
                .get_or_create(&BackendLabels {
                    backend: label.clone(),
                })
                .set(inflight);
            self.healthy
                .get_or_create(&BackendLabels {
                    backend: label.clone(),
                })
                .set(healthy);
            let backend = BackendLabels {
                backend: label.clone(),
            };
            self.capacity
                .get_or_create(&backend)
                .set(b.capacity.load(Relaxed) as i64);
            self.bytes_per_token
                .get_or_create(&backend)
                .set(b.bytes_per_token());
            let server = ServerLabels { server: label };
            self.running.get_or_create(&server).set(inflight);
            self.prefill.get_or_create(&server).set(prefill);
            self.decoding.get_or_create(&server).set(inflight - prefill);
            self.healthy_pods.get_or_create(&server).set(healthy);
            self.current_qps.get_or_create(&server).set(b.qps());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        write_escaped(&mut out, "a\"b\\c\nd").unwrap();
        assert_eq!(out, "a\\\"b\\\\c\\nd");
        let m = RouterMetrics::new();
        m.incoming
            .get_or_create(&ModelLabels {
                model: Label("x\"} 1\nfake_metric 7".into()),
            })
            .inc();
        let text = crate::http_metrics::encode(&m.registry);
        assert!(
            !text.lines().any(|l| l.starts_with("fake_metric")),
            "{text}"
        );
        assert!(text.contains(r#"model="x\"} 1\nfake_metric 7""#), "{text}");
    }
}
