//! Per-endpoint request counts and latencies, for any of our HTTP servers.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: String,
}

type HistogramFamily = Family<EndpointLabels, Histogram, fn() -> Histogram>;

/// Requests by endpoint and status, and a latency histogram by endpoint.
#[derive(Clone)]
pub struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    errors: Family<RequestLabels, Counter>,
    duration: HistogramFamily,
}

fn latency_histogram() -> Histogram {
    // 10 µs .. ~21 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 22))
}

impl HttpMetrics {
    /// Registers the metrics under `prefix` (e.g. `prefix_index`).
    pub fn register(registry: &mut Registry, prefix: &str) -> Self {
        let metrics = Self {
            requests: Family::default(),
            errors: Family::default(),
            duration: HistogramFamily::new_with_constructor(latency_histogram),
        };
        registry.register(
            format!("{prefix}_http_requests"),
            "HTTP requests by endpoint and status",
            metrics.requests.clone(),
        );
        registry.register(
            format!("{prefix}_http_errors"),
            "HTTP requests answered with a 4xx or 5xx, by endpoint and status",
            metrics.errors.clone(),
        );
        registry.register(
            format!("{prefix}_http_request_duration_seconds"),
            "Time to answer an HTTP request, by endpoint",
            metrics.duration.clone(),
        );
        metrics
    }

    fn record(&self, endpoint: &str, status: u16, seconds: f64) {
        let labels = RequestLabels {
            endpoint: endpoint.to_owned(),
            status,
        };
        self.requests.get_or_create(&labels).inc();
        if status >= 400 {
            self.errors.get_or_create(&labels).inc();
        }
        self.duration
            .get_or_create(&EndpointLabels {
                endpoint: labels.endpoint,
            })
            .observe(seconds);
    }
}

/// Middleware recording every request under its route (or `unmatched`).
pub async fn track(State(metrics): State<HttpMetrics>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    // Methods are client-chosen tokens: any but the standard ones share one label, so they
    // cannot grow the series without bound.
    let method = match *req.method() {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::HEAD
        | Method::OPTIONS
        | Method::PATCH => req.method().as_str().to_owned(),
        _ => "OTHER".to_owned(),
    };
    let start = Instant::now();
    let response = next.run(req).await;
    metrics.record(
        &format!("{method} {endpoint}"),
        response.status().as_u16(),
        start.elapsed().as_secs_f64(),
    );
    response
}

/// Encodes a registry in the Prometheus text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("writing to a String cannot fail");
    out
}

/// The content type of [`encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
