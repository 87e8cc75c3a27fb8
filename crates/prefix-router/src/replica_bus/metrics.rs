//! The replica bus's metrics: whether it is up, what crosses it, what it refused or dropped.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

pub struct BusMetrics {
    pub connected: Gauge,
    pub peers: Gauge,
    pub messages: Family<DirectionLabels, Counter>,
    pub bytes: Family<DirectionLabels, Counter>,
    pub decisions: Family<DirectionLabels, Counter>,
    pub first_bytes: Family<DirectionLabels, Counter>,
    pub dropped: Family<ReasonLabels, Counter>,
    pub rejected: Family<ReasonLabels, Counter>,
    pub snapshots: Family<OutcomeLabels, Counter>,
    pub snapshot_entries: Counter,
    pub unsynced_decisions: Counter,
    pub health_reports: Counter,
}

impl BusMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            connected: Gauge::default(),
            peers: Gauge::default(),
            messages: Family::default(),
            bytes: Family::default(),
            decisions: Family::default(),
            first_bytes: Family::default(),
            dropped: Family::default(),
            rejected: Family::default(),
            snapshots: Family::default(),
            snapshot_entries: Counter::default(),
            unsynced_decisions: Counter::default(),
            health_reports: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("prefix_router_replica_bus");
        r.register(
            "connected",
            "1 while this replica is connected to the replica bus",
            m.connected.clone(),
        );
        r.register(
            "peers",
            "Other replicas heard from recently",
            m.peers.clone(),
        );
        r.register(
            "messages",
            "Bus messages published (sent) and read (received)",
            m.messages.clone(),
        );
        r.register(
            "bytes",
            "Bytes of bus messages published (sent) and read (received)",
            m.bytes.clone(),
        );
        r.register(
            "decisions",
            "Routing decisions published (sent) and applied from peers (received)",
            m.decisions.clone(),
        );
        r.register(
            "first_bytes",
            "First bytes (TTFT observations) published (sent) and learned from peers (received)",
            m.first_bytes.clone(),
        );
        r.register(
            "dropped",
            "Decisions not published: outbox_full (the bus is slower than the router), disconnected, publish_failed",
            m.dropped.clone(),
        );
        r.register(
            "rejected",
            "Messages, decisions or first bytes read and not applied: unauthenticated (no valid tag under the fleet's key), stale, replayed, too_many_peers, foreign, too_large, compression, malformed, unknown_backend, implausible",
            m.rejected.clone(),
        );
        r.register(
            "snapshots",
            "Index snapshots asked of peers on (re)connecting, by outcome (applied, no_peer, timeout, failed), and served",
            m.snapshots.clone(),
        );
        r.register(
            "snapshot_entries",
            "Index entries merged from peers' snapshots",
            m.snapshot_entries.clone(),
        );
        r.register(
            "unsynced_decisions",
            "Requests routed before this replica caught up with its peers (since starting or reconnecting, until a snapshot is merged or no peer has one)",
            m.unsynced_decisions.clone(),
        );
        r.register(
            "health_reports",
            "Peers' reports of a backend they found unhealthy, applied here as one failed check",
            m.health_reports.clone(),
        );
        // Every series exists from the start at zero (dashboards, alerts on rates).
        for direction in ["sent", "received"] {
            for family in [&m.messages, &m.bytes, &m.decisions, &m.first_bytes] {
                drop(family.get_or_create(&DirectionLabels { direction }));
            }
        }
        for reason in ["outbox_full", "disconnected", "publish_failed"] {
            drop(m.dropped.get_or_create(&ReasonLabels { reason }));
        }
        for reason in [
            "foreign",
            "too_large",
            "compression",
            "malformed",
            "unknown_backend",
            "implausible",
        ] {
            drop(m.rejected.get_or_create(&ReasonLabels { reason }));
        }
        for outcome in ["applied", "no_peer", "timeout", "failed", "served"] {
            drop(m.snapshots.get_or_create(&OutcomeLabels { outcome }));
        }
        m
    }

    pub fn count(
        &self,
        family: &Family<DirectionLabels, Counter>,
        direction: &'static str,
        n: u64,
    ) {
        family
            .get_or_create(&DirectionLabels { direction })
            .inc_by(n);
    }

    pub fn drop_decisions(&self, reason: &'static str, n: u64) {
        self.dropped
            .get_or_create(&ReasonLabels { reason })
            .inc_by(n);
    }

    pub fn reject(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn snapshot(&self, outcome: &'static str) {
        self.snapshots
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}
