//! The string server's own metrics (beside the per-endpoint HTTP ones).

use prefix_index::{NotifyOutcome, ServerId, ServerInfo};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::http_metrics::HttpMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabels {
    pub server_id: String,
}

fn labels(server: ServerId) -> ServerLabels {
    ServerLabels {
        server_id: server.to_string(),
    }
}

pub struct IndexMetrics {
    pub registry: Registry,
    pub http: HttpMetrics,
    inserted: Family<ServerLabels, Counter>,
    evicted: Family<ServerLabels, Counter>,
    entries: Family<ServerLabels, Gauge>,
    capacity: Family<ServerLabels, Gauge>,
    store_errors: Counter,
}

impl IndexMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let http = HttpMetrics::register(&mut registry, "prefix_index");
        let inserted = Family::<ServerLabels, Counter>::default();
        let evicted = Family::<ServerLabels, Counter>::default();
        let entries = Family::<ServerLabels, Gauge>::default();
        let capacity = Family::<ServerLabels, Gauge>::default();
        let store_errors = Counter::default();
        registry.register(
            "prefix_index_inserted_entries",
            "Entries inserted by notify, per server",
            inserted.clone(),
        );
        registry.register(
            "prefix_index_evicted_entries",
            "Entries evicted to stay within capacity, per server",
            evicted.clone(),
        );
        registry.register(
            "prefix_index_entries",
            "Entries held, per server",
            entries.clone(),
        );
        registry.register(
            "prefix_index_capacity",
            "Capacity in entries, per server",
            capacity.clone(),
        );
        registry.register(
            "prefix_index_store_errors",
            "Store operations that failed",
            store_errors.clone(),
        );
        Self {
            registry,
            http,
            inserted,
            evicted,
            entries,
            capacity,
            store_errors,
        }
    }

    pub fn notified(&self, server: ServerId, outcome: &NotifyOutcome) {
        let labels = labels(server);
        self.inserted
            .get_or_create(&labels)
            .inc_by(outcome.inserted);
        self.evicted.get_or_create(&labels).inc_by(outcome.evicted);
    }

    pub fn evicted(&self, server: ServerId, n: u64) {
        self.evicted.get_or_create(&labels(server)).inc_by(n);
    }

    pub fn dropped(&self, server: ServerId) {
        let labels = labels(server);
        self.inserted.remove(&labels);
        self.evicted.remove(&labels);
    }

    pub fn store_error(&self) {
        self.store_errors.inc();
    }

    /// Sets the per-server gauges from the store's table, forgetting servers that left.
    pub fn set_servers(&self, servers: &[ServerInfo]) {
        self.entries.clear();
        self.capacity.clear();
        for s in servers {
            let labels = labels(s.server_id);
            self.entries.get_or_create(&labels).set(s.entries as i64);
            self.capacity.get_or_create(&labels).set(s.capacity as i64);
        }
    }
}
