//! The decision core's metrics: routing decisions, matched fractions, and the fleet's
//! per-backend gauges (ours and the production-stack router's names, so existing dashboards
//! keep working).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{linear_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::backend::Backend;
use crate::metric_label::{BackendLabels, Label, ServerLabels};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub policy: &'static str,
    pub reason: &'static str,
    /// Which index answered for the chosen backend: `events`, `strings`, or `none`.
    pub index: &'static str,
}

pub struct CoreMetrics {
    pub decisions: Family<DecisionLabels, Counter>,
    pub matched_ratio: Histogram,
    pub continued_elsewhere: Counter,
    fleet: FleetGauges,
}

/// Gauges refreshed from the fleet before each scrape.
struct FleetGauges {
    inflight: Family<BackendLabels, Gauge>,
    healthy: Family<BackendLabels, Gauge>,
    capacity: Family<BackendLabels, Gauge>,
    entries: Family<BackendLabels, Gauge>,
    peer_inflight: Family<BackendLabels, Gauge>,
    bytes_per_token: Family<BackendLabels, Gauge<f64, AtomicU64>>,
    queued_prefill: Family<BackendLabels, Gauge>,
    prefill_speed: Family<BackendLabels, Gauge<f64, AtomicU64>>,
    prefill_overhead: Family<BackendLabels, Gauge<f64, AtomicU64>>,
    ttft_calibration: Family<BackendLabels, Gauge<f64, AtomicU64>>,
    // production-stack names
    current_qps: Family<ServerLabels, Gauge<f64, AtomicU64>>,
    running: Family<ServerLabels, Gauge>,
    prefill: Family<ServerLabels, Gauge>,
    decoding: Family<ServerLabels, Gauge>,
    healthy_pods: Family<ServerLabels, Gauge>,
}

impl CoreMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            decisions: Family::default(),
            matched_ratio: Histogram::new(linear_buckets(0.1, 0.1, 10)),
            continued_elsewhere: Counter::default(),
            fleet: FleetGauges {
                inflight: Family::default(),
                healthy: Family::default(),
                capacity: Family::default(),
                entries: Family::default(),
                peer_inflight: Family::default(),
                bytes_per_token: Family::default(),
                queued_prefill: Family::default(),
                prefill_speed: Family::default(),
                prefill_overhead: Family::default(),
                ttft_calibration: Family::default(),
                current_qps: Family::default(),
                running: Family::default(),
                prefill: Family::default(),
                decoding: Family::default(),
                healthy_pods: Family::default(),
            },
        };
        let f = &m.fleet;
        r.register(
            "prefix_router_continued_elsewhere",
            "Requests continuing a prompt another router replica had in flight (its answer read): that request no longer counted in its backend's load here",
            m.continued_elsewhere.clone(),
        );
        r.register(
            "prefix_router_routing_decisions",
            "Routing decisions by policy, reason and the index that answered for the chosen backend",
            m.decisions.clone(),
        );
        r.register(
            "prefix_router_matched_ratio",
            "Matched tokens / request tokens of the chosen backend (prefix policies)",
            m.matched_ratio.clone(),
        );
        r.register(
            "prefix_router_inflight",
            "Requests in flight, by backend",
            f.inflight.clone(),
        );
        r.register(
            "prefix_router_backend_healthy",
            "1 if the backend is a routing candidate",
            f.healthy.clone(),
        );
        r.register(
            "prefix_router_index_capacity",
            "Index capacity in chunks, by backend (configured, or its KV cache in tokens × bytes per token ÷ chunk size)",
            f.capacity.clone(),
        );
        r.register(
            "prefix_router_index_entries",
            "String-index entries (chunks) held for the backend, as this router's notifies count them",
            f.entries.clone(),
        );
        r.register(
            "prefix_router_peer_inflight",
            "Requests in flight at the backend from the other router replicas (the replica bus)",
            f.peer_inflight.clone(),
        );
        r.register(
            "prefix_router_bytes_per_token",
            "Request-string bytes per prompt token, learned from the backend's answers (4 until enough were seen)",
            f.bytes_per_token.clone(),
        );
        r.register(
            "prefix_router_queued_prefill_tokens",
            "Uncached prompt tokens of the requests sent to the backend that have not started answering, by backend",
            f.queued_prefill.clone(),
        );
        r.register(
            "prefix_router_prefill_tokens_per_second",
            "The backend's prefill speed as learned from its TTFTs (the cost policy's model), by backend",
            f.prefill_speed.clone(),
        );
        r.register(
            "prefix_router_prefill_overhead_seconds",
            "The backend's TTFT with no prefill work, as learned from its TTFTs, by backend",
            f.prefill_overhead.clone(),
        );
        r.register(
            "prefix_router_ttft_calibration",
            "The factor on the backend's least-squares prefill line that makes its TTFT predictions a median (below 1: most TTFTs come sooner than their mean), by backend",
            f.ttft_calibration.clone(),
        );
        r.register(
            "vllm:current_qps",
            "Requests per second over the last metrics interval (production-stack name)",
            f.current_qps.clone(),
        );
        r.register(
            "vllm:num_requests_running",
            "Requests in flight at the router, by backend (production-stack name)",
            f.running.clone(),
        );
        r.register(
            "vllm:num_prefill_requests",
            "In-flight requests without a first byte yet (production-stack name)",
            f.prefill.clone(),
        );
        r.register(
            "vllm:num_decoding_requests",
            "In-flight requests that have begun answering (production-stack name)",
            f.decoding.clone(),
        );
        r.register(
            "vllm:healthy_pods_total",
            "1 per healthy backend (production-stack name)",
            f.healthy_pods.clone(),
        );
        m
    }

    /// Refreshes the per-backend gauges (before a scrape): exactly the fleet's backends.
    pub fn observe_fleet(&self, backends: &[Arc<Backend>]) {
        let f = &self.fleet;
        for family in [
            &f.inflight,
            &f.healthy,
            &f.capacity,
            &f.entries,
            &f.peer_inflight,
        ] {
            family.clear();
        }
        for family in [&f.running, &f.prefill, &f.decoding, &f.healthy_pods] {
            family.clear();
        }
        f.bytes_per_token.clear();
        f.queued_prefill.clear();
        f.prefill_speed.clear();
        f.prefill_overhead.clear();
        f.ttft_calibration.clear();
        f.current_qps.clear();
        for b in backends {
            let label = Label(b.label.clone());
            let inflight = b.inflight.load(Relaxed) as i64;
            let prefill = b.waiting_first_byte.load(Relaxed) as i64;
            let healthy = i64::from(b.is_healthy());
            let backend = BackendLabels {
                backend: label.clone(),
            };
            f.inflight.get_or_create(&backend).set(inflight);
            f.healthy.get_or_create(&backend).set(healthy);
            f.capacity
                .get_or_create(&backend)
                .set(b.capacity.load(Relaxed) as i64);
            f.entries
                .get_or_create(&backend)
                .set(b.entries.load(Relaxed) as i64);
            f.peer_inflight
                .get_or_create(&backend)
                .set(b.remote.inflight.load(Relaxed) as i64);
            f.bytes_per_token
                .get_or_create(&backend)
                .set(b.bytes_per_token());
            f.queued_prefill
                .get_or_create(&backend)
                .set(b.queued_prefill_tokens.load(Relaxed) as i64);
            let line = b.prefill.line();
            f.prefill_speed
                .get_or_create(&backend)
                .set(1.0 / line.seconds_per_token);
            f.prefill_overhead
                .get_or_create(&backend)
                .set(line.overhead_s);
            f.ttft_calibration
                .get_or_create(&backend)
                .set(b.prefill.calibration());
            let server = ServerLabels { server: label };
            f.running.get_or_create(&server).set(inflight);
            f.prefill.get_or_create(&server).set(prefill);
            f.decoding.get_or_create(&server).set(inflight - prefill);
            f.healthy_pods.get_or_create(&server).set(healthy);
            f.current_qps.get_or_create(&server).set(b.qps());
        }
    }
}
