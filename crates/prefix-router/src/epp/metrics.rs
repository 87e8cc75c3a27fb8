//! The endpoint picker's own counters (the requests, TTFTs and decisions it makes are counted
//! by the same families as `serve`'s).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

pub struct EppMetrics {
    /// Requests answered by the picker itself (no endpoint), by why.
    refused: Family<ReasonLabels, Counter>,
    /// Endpoints offered per pick (the chosen one and its fallbacks).
    offered: Histogram,
    /// Answers the gateway reports served by another endpoint than the first picked.
    served_elsewhere: Family<ReasonLabels, Counter>,
}

impl EppMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            refused: Family::default(),
            offered: Histogram::new([1.0, 2.0, 3.0, 4.0, 8.0]),
            served_elsewhere: Family::default(),
        };
        // Every series at zero from the start, so rates and alerts have them.
        for reason in [
            "invalid",
            "unknown_model",
            "shed",
            "no_endpoint",
            "too_large",
            "unauthorized",
        ] {
            let _ = m.refused.get_or_create(&ReasonLabels { reason });
        }
        for reason in ["fallback", "unknown"] {
            let _ = m.served_elsewhere.get_or_create(&ReasonLabels { reason });
        }
        r.register(
            "prefix_router_epp_refused",
            "Requests the endpoint picker answered itself instead of picking, by reason",
            m.refused.clone(),
        );
        r.register(
            "prefix_router_epp_endpoints_offered",
            "Endpoints offered to the gateway per pick (the chosen one, then fallbacks)",
            m.offered.clone(),
        );
        r.register(
            "prefix_router_epp_served_elsewhere",
            "Answers the gateway reports served by another endpoint than the first picked",
            m.served_elsewhere.clone(),
        );
        m
    }

    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn picked(&self, endpoints: usize) {
        self.offered.observe(endpoints as f64);
    }

    pub fn served_elsewhere(&self, reason: &'static str) {
        self.served_elsewhere
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}
