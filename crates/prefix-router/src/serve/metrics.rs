//! The HTTP gateway's metrics: requests answered, the latency the router adds, retries; and the
//! production-stack router's names for them (`vllm:num_incoming_requests`,
//! `vllm:request_latency_seconds`), so existing dashboards keep working.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, linear_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::core::backend::Backend;
pub use crate::metric_label::{BackendLabels, Label, ServerLabels};

/// The `model` label of a request whose model no backend serves: client-chosen names must not
/// become series (unbounded, and any text at all).
pub const UNKNOWN_MODEL: &str = "(unknown)";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub backend: Label,
    pub model: Label,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: Label,
}

type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

/// 1/16 .. 16, four buckets per doubling.
fn ratio() -> Histogram {
    Histogram::new(exponential_buckets(1.0 / 16.0, 2f64.sqrt().sqrt(), 33))
}

/// 0.05 .. 1 in steps of 0.05, then 1.5, 2, 3, 5, 10: a median read off it is within 0.05.
fn relative_error() -> Histogram {
    Histogram::new(linear_buckets(0.05, 0.05, 20).chain([1.5, 2.0, 3.0, 5.0, 10.0]))
}

fn latency() -> Histogram {
    // 10 µs .. ~42 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 23))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    pub reason: &'static str,
}

/// How a prefill call ended: `ok`, or why the decode server computed the prompt itself.
pub const PREFILL_OUTCOMES: [&str; 6] = [
    "ok",
    "timeout",
    "unreachable",
    "error",
    "no_transfer",
    "invalid",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefillLabels {
    pub backend: Label,
    pub outcome: &'static str,
}

pub struct GatewayMetrics {
    /// Requests matched by strings because their token ids could not be computed exactly.
    pub tokenize_fallbacks: Family<FallbackLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
    /// The `requests` label sets created per backend, so they can go when the backend does
    /// (written only when a new set appears).
    request_series: parking_lot::Mutex<Vec<RequestLabels>>,
    pub added_latency: Histogram,
    retries: Family<BackendLabels, Counter>,
    prefills: Family<PrefillLabels, Counter>,
    pub incoming: Family<ModelLabels, Counter>,
    request_latency: Hist<ServerLabels>,
    ttft: Hist<BackendLabels>,
    ttft_prediction: Hist<BackendLabels>,
    ttft_prediction_error: Hist<BackendLabels>,
}

impl GatewayMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            tokenize_fallbacks: Family::default(),
            requests: Family::default(),
            request_series: Default::default(),
            added_latency: latency(),
            retries: Family::default(),
            prefills: Family::default(),
            incoming: Family::default(),
            request_latency: Hist::new_with_constructor(latency),
            ttft: Hist::new_with_constructor(latency),
            ttft_prediction: Hist::new_with_constructor(ratio),
            ttft_prediction_error: Hist::new_with_constructor(relative_error),
        };
        r.register(
            "prefix_router_requests",
            "Requests answered, by backend, model and status",
            m.requests.clone(),
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
            "prefix_router_pd_prefills",
            "Disaggregated fleets: prefill calls by prefill server and outcome (ok, or why the decode server computed the prompt itself)",
            m.prefills.clone(),
        );
        r.register(
            "prefix_router_tokenize_fallbacks",
            "Requests in precise mode whose token ids could not be computed exactly (matched by the string index), by reason",
            m.tokenize_fallbacks.clone(),
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
            "prefix_router_ttft_seconds",
            "Time to first byte of streamed answers through the router, by backend",
            m.ttft.clone(),
        );
        r.register(
            "prefix_router_ttft_prediction_ratio",
            "Observed ÷ predicted time to first byte of streamed answers, by backend (1: the learned prefill line was right)",
            m.ttft_prediction.clone(),
        );
        r.register(
            "prefix_router_ttft_prediction_error",
            "|observed - predicted| / observed time to first byte of streamed answers, by backend (its median is how far the cost model is off)",
            m.ttft_prediction_error.clone(),
        );
        m
    }

    /// A streamed answer's first byte came after `ttft` seconds, where `predicted` was
    /// expected.
    pub fn observe_ttft(&self, backend: &Backend, ttft: f64, predicted: f64) {
        let labels = BackendLabels {
            backend: Label(backend.label.clone()),
        };
        self.ttft.get_or_create(&labels).observe(ttft);
        if predicted > 0.0 {
            self.ttft_prediction
                .get_or_create(&labels)
                .observe(ttft / predicted);
        }
        if predicted > 0.0 && ttft > 0.0 {
            self.ttft_prediction_error
                .get_or_create(&labels)
                .observe((ttft - predicted).abs() / ttft);
        }
    }

    /// Counts one answered request, and its latency.
    pub fn count_request(&self, labels: RequestLabels, seconds: f64) {
        self.request_latency
            .get_or_create(&ServerLabels {
                server: labels.backend.clone(),
            })
            .observe(seconds);
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

    /// Counts one prefill call to `backend` that ended as `outcome`.
    pub fn count_prefill(&self, backend: &Backend, outcome: &'static str) {
        self.prefills
            .get_or_create(&PrefillLabels {
                backend: Label(backend.label.clone()),
                outcome,
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
        let backend = BackendLabels { backend: label };
        self.ttft.remove(&backend);
        self.ttft_prediction.remove(&backend);
        self.ttft_prediction_error.remove(&backend);
        self.retries.remove(&backend);
        for outcome in PREFILL_OUTCOMES {
            self.prefills.remove(&PrefillLabels {
                backend: backend.backend.clone(),
                outcome,
            });
        }
    }
}

/// A model label value.
pub fn model_label(name: Arc<str>) -> ModelLabels {
    ModelLabels { model: Label(name) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forged_model_names_stay_one_escaped_value() {
        let mut registry = Registry::default();
        let m = GatewayMetrics::register(&mut registry);
        m.incoming
            .get_or_create(&model_label("x\"} 1\nfake_metric 7".into()))
            .inc();
        let text = crate::http_metrics::encode(&registry);
        assert!(
            !text.lines().any(|l| l.starts_with("fake_metric")),
            "{text}"
        );
        assert!(text.contains(r#"model="x\"} 1\nfake_metric 7""#), "{text}");
    }
}
