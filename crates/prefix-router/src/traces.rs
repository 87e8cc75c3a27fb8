//! OpenTelemetry traces (`--otlp-endpoint`): one span per proxied request, exported over
//! OTLP/HTTP (JSON) in batches, with what the router decided and saw — the model, the policy,
//! the decision's reason, the matched fraction, the backend, the retries, the TTFT and the
//! status. The W3C `traceparent` a client sent is the span's parent, and the span's own is
//! sent upstream, so vLLM's spans (`--otlp-traces-endpoint`) join the same trace.
//!
//! Off by default; when off, no span is made and nothing is allocated for one.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::KeyValue;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{BatchConfigBuilder, SdkTracer, SdkTracerProvider};
use parking_lot::Mutex;

/// The OTLP/HTTP traces URL for an endpoint given as the collector's base
/// (`http://collector:4318`) or as the full traces URL.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    }
}

/// The exporter and the tracer of this process.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl Traces {
    /// Starts exporting to `endpoint` (spans are sent every `every`, or sooner in full batches).
    pub fn start(endpoint: &str, every: Duration) -> anyhow::Result<Arc<Self>> {
        let url = traces_url(endpoint);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(url.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| anyhow::anyhow!("--otlp-endpoint {endpoint}: {e}"))?;
        let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(every)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name("prefix-router")
                    .build(),
            )
            .build();
        let tracer = provider.tracer("prefix-router");
        tracing::info!(url, "exporting traces over OTLP/HTTP");
        Ok(Arc::new(Self {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
        }))
    }

    /// Opens the span of a request, the child of the client's `traceparent` in `headers` if
    /// it sent one, and replaces that with the span's own (the headers go to the backend).
    pub fn request(&self, name: String, headers: &mut HeaderMap) -> RequestSpan {
        let parent = self.propagator.extract(&HeaderExtractor(headers));
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(&self.tracer, &parent);
        let cx = opentelemetry::Context::new()
            .with_remote_span_context(opentelemetry::trace::Span::span_context(&span).clone());
        headers.remove("tracestate");
        self.propagator
            .inject_context(&cx, &mut HeaderInjector(headers));
        RequestSpan(Arc::new(Mutex::new(Some(span))))
    }
}

impl Drop for Traces {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// A request's span, shared by the callbacks that see its first byte and its end; ended when
/// the last holder lets go.
#[derive(Clone)]
pub struct RequestSpan(Arc<Mutex<Option<opentelemetry_sdk::trace::Span>>>);

impl RequestSpan {
    /// Adds attributes.
    pub fn set(&self, attributes: impl IntoIterator<Item = KeyValue>) {
        if let Some(span) = self.0.lock().as_mut() {
            span.set_attributes(attributes);
        }
    }

    /// Ends the span with the answer's status (5xx and gateway errors mark it failed).
    pub fn end(&self, status: u16) {
        if let Some(mut span) = self.0.lock().take() {
            span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
            if status >= 500 {
                span.set_status(Status::error(format!("HTTP {status}")));
            }
            span.end();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::traces_url;

    #[test]
    fn the_traces_path_is_added_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }
}
