//! OpenTelemetry traces (`--otlp-endpoint`): a span per request reaches an OTLP/HTTP receiver
//! started by the test, as the child of the client's `traceparent`, with the decision's
//! attributes; the span's own `traceparent` reaches the backend (a stand-in that records its
//! headers), so a backend's spans join the trace.

mod common;

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use common::{eventually, fake_backend, router, serve_loopback};
use parking_lot::Mutex;
use serde_json::{json, Value};

#[derive(Default)]
struct Seen {
    exports: Mutex<Vec<Value>>,
    traceparents: Mutex<Vec<String>>,
}

/// An OTLP/HTTP JSON receiver.
async fn collector(seen: Arc<Seen>) -> String {
    async fn traces(State(seen): State<Arc<Seen>>, Json(body): Json<Value>) -> Json<Value> {
        seen.exports.lock().push(body);
        Json(json!({}))
    }
    serve_loopback(
        Router::new()
            .route("/v1/traces", post(traces))
            .with_state(seen),
    )
    .await
}

/// A backend that answers completions (streamed or not) and records their `traceparent`.
async fn backend(seen: Arc<Seen>) -> String {
    async fn complete(
        State(seen): State<Arc<Seen>>,
        headers: HeaderMap,
        Json(body): Json<Value>,
    ) -> axum::response::Response {
        if let Some(tp) = headers.get("traceparent") {
            seen.traceparents
                .lock()
                .push(tp.to_str().unwrap().to_owned());
        }
        let choice = json!({"index": 0, "text": "hi", "finish_reason": "stop"});
        if body["stream"] == true {
            let chunk = json!({"id": "c", "object": "text_completion", "model": "fake-model", "choices": [choice]});
            (
                [("content-type", "text/event-stream")],
                format!("data: {chunk}\n\ndata: [DONE]\n\n"),
            )
                .into_response()
        } else {
            Json(json!({"id": "c", "object": "text_completion", "model": "fake-model", "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}))
            .into_response()
        }
    }
    fake_backend(
        Router::new()
            .route("/v1/completions", post(complete))
            .with_state(seen),
    )
    .await
}

/// Every span the collector received.
fn spans(seen: &Seen) -> Vec<Value> {
    seen.exports
        .lock()
        .iter()
        .flat_map(|e| e["resourceSpans"].as_array().cloned().unwrap_or_default())
        .flat_map(|r| r["scopeSpans"].as_array().cloned().unwrap_or_default())
        .flat_map(|s| s["spans"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn attribute<'a>(span: &'a Value, key: &str) -> &'a Value {
    let attr = span["attributes"]
        .as_array()
        .and_then(|a| a.iter().find(|kv| kv["key"] == key))
        .unwrap_or_else(|| panic!("no attribute {key} in {span}"));
    let value = &attr["value"];
    ["stringValue", "intValue", "doubleValue", "boolValue"]
        .iter()
        .map(|k| &value[*k])
        .find(|v| !v.is_null())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_span_per_request_continues_the_clients_trace_upstream() {
    let seen = Arc::new(Seen::default());
    let otlp = collector(seen.clone()).await;
    let vllm = backend(seen.clone()).await;
    let (r, _) = router(
        std::slice::from_ref(&vllm),
        &["--otlp-endpoint", &otlp, "--otlp-interval", "100ms"],
    )
    .await;
    let url = r.url();
    assert!(
        eventually(10, || async {
            reqwest::get(format!("{url}/health"))
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()["healthy_backends"]
                == 1
        })
        .await
    );
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let client = reqwest::Client::new();
    for stream in [false, true] {
        let resp = client
            .post(format!("{url}/v1/completions"))
            .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
            .json(&json!({"model": "fake-model", "prompt": "hello there", "max_tokens": 1, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
    }
    assert!(
        eventually(10, || async { spans(&seen).len() >= 2 }).await,
        "the collector received {} spans",
        spans(&seen).len()
    );
    let spans = spans(&seen);
    let upstream = seen.traceparents.lock().clone();
    assert_eq!(upstream.len(), 2);
    for span in &spans {
        assert_eq!(span["traceId"], trace_id, "{span}");
        assert_eq!(span["parentSpanId"], client_span);
        assert_eq!(span["name"], "POST /v1/completions");
        assert_eq!(attribute(span, "gen_ai.request.model"), "fake-model");
        assert_eq!(attribute(span, "prefix_router.policy"), "cost");
        assert!(attribute(span, "prefix_router.reason").is_string());
        assert_eq!(
            attribute(span, "server.address").as_str(),
            Some(vllm.as_str())
        );
        assert_eq!(
            attribute(span, "prefix_router.attempts")
                .to_string()
                .trim_matches('"'),
            "1"
        );
        assert_eq!(
            attribute(span, "http.response.status_code")
                .to_string()
                .trim_matches('"'),
            "200"
        );
        // The backend got this span as its parent, in the client's trace.
        let span_id = span["spanId"].as_str().unwrap();
        assert!(
            upstream.contains(&format!("00-{trace_id}-{span_id}-01")),
            "{upstream:?}"
        );
    }
    // The streamed one knows its time to first token.
    let ttfts: Vec<f64> = spans
        .iter()
        .filter_map(|s| {
            s["attributes"]
                .as_array()?
                .iter()
                .find(|kv| kv["key"] == "prefix_router.ttft_s")?["value"]["doubleValue"]
                .as_f64()
        })
        .collect();
    assert_eq!(ttfts.len(), 1, "one streamed request");
    assert!(ttfts[0] > 0.0);
}

/// Requests the router refuses (a missing key, an unknown model) are spans too, with their
/// status; and the span starts when the request arrives, before it waits anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_are_spans_too() {
    let seen = Arc::new(Seen::default());
    let otlp = collector(seen.clone()).await;
    let vllm = backend(seen.clone()).await;
    let (r, _) = router(
        std::slice::from_ref(&vllm),
        &[
            "--otlp-endpoint",
            &otlp,
            "--otlp-interval",
            "100ms",
            "--api-key",
            "client-key-123",
        ],
    )
    .await;
    let url = r.url();
    let client = reqwest::Client::new();
    let no_key = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "fake-model", "prompt": "hello", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(no_key.status(), 401);
    let unknown = client
        .post(format!("{url}/v1/completions"))
        .bearer_auth("client-key-123")
        .json(&json!({"model": "no-such-model", "prompt": "hello", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    assert!(
        eventually(10, || async { spans(&seen).len() >= 2 }).await,
        "the collector received {} spans",
        spans(&seen).len()
    );
    let mut statuses: Vec<String> = spans(&seen)
        .iter()
        .map(|s| {
            attribute(s, "http.response.status_code")
                .to_string()
                .trim_matches('"')
                .to_owned()
        })
        .collect();
    statuses.sort();
    assert_eq!(statuses, ["401", "404"]);
}

/// The endpoint picker makes spans too: one per request from its headers on, whose
/// `traceparent` the pick sets for the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_picker_makes_spans() {
    use common::envoy::*;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response;
    let seen = Arc::new(Seen::default());
    let otlp = collector(seen.clone()).await;
    let sims = common::fleet(common::instant(), 1).await;
    let p = picker(
        &sims.urls(),
        &["--otlp-endpoint", &otlp, "--otlp-interval", "100ms"],
    )
    .await;
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(request_headers("/v1/completions", None)).await;
    let body =
        serde_json::to_vec(&json!({"model": "sim-model", "prompt": "hello", "max_tokens": 1}))
            .unwrap();
    gw.send(body_message(true, &body, true)).await;
    let answer = gw.next().await;
    let Some(processing_response::Response::RequestHeaders(h)) = &answer.response else {
        panic!("{answer:?}");
    };
    let traceparent = h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "traceparent")
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        .expect("the pick continues the trace upstream");
    drop(gw);
    assert!(
        eventually(10, || async { !spans(&seen).is_empty() }).await,
        "no span from the picker"
    );
    let span = spans(&seen).remove(0);
    assert_eq!(span["name"], "POST /v1/completions");
    assert!(traceparent.contains(span["spanId"].as_str().unwrap()));
    assert_eq!(attribute(&span, "prefix_router.policy"), "cost");
}
