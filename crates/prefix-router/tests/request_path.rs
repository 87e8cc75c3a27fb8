//! Regressions from a review of the request path (issue "Defects found in a review of the
//! request path"): each test failed before its fix.

mod common;

use std::time::Duration;

use common::{eventually, fleet, instant, metric, metrics_text, router, series};
use prefix_router::serve::backend::BackendSpec;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::SimConfig;

/// Sims on the real clock whose answers take `itl_ms` per token.
fn slow(itl_ms: f64) -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        itl_ms,
        prefill_overhead_ms: 1.0,
        ..SimConfig::default()
    }
}

async fn complete(url: &str, body: &Value) -> (StatusCode, Value) {
    let resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// vLLM sends a non-streamed answer's head only when generation ends: a long completion must
/// not be cut by `--upstream-timeout`, nor count against the backend's health.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_non_streamed_completion_outlives_the_upstream_timeout() {
    let sims = fleet(slow(10.0), 2).await;
    let (r, _) = router(&sims.urls(), &["--upstream-timeout", "1s"]).await;
    // 150 tokens at 10 ms: 1.5 s, past the 1 s upstream timeout.
    let body = json!({"model": "sim-model", "prompt": "tell me a long story", "max_tokens": 150, "ignore_eos": true});
    let url = r.url();
    let (a, b) = tokio::join!(complete(&url, &body), complete(&url, &body));
    for (status, answer) in [a, b] {
        assert_eq!(status, StatusCode::OK, "{answer}");
        assert_eq!(answer["usage"]["completion_tokens"], 150);
    }
    assert_eq!(
        metric(&r.url(), "prefix_router_retries_total", "").await,
        0.0
    );
    assert_eq!(
        metric(&r.url(), "prefix_router_backend_healthy", "").await,
        2.0,
        "a slow answer is not a dead backend"
    );
}

/// A streamed request whose head does not come within `--upstream-timeout` goes to the next
/// backend (a stuck one costs that much, not the request timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_does_not_begin_moves_to_the_next_backend() {
    let hung = fleet(
        SimConfig {
            stall_ms: 10_000,
            ..instant()
        },
        1,
    )
    .await;
    let good = fleet(instant(), 1).await;
    let urls = vec![hung.urls()[0].clone(), good.urls()[0].clone()];
    let (r, _) = router(
        &urls,
        &["--upstream-timeout", "300ms", "--policy", "round_robin"],
    )
    .await;
    let started = std::time::Instant::now();
    for _ in 0..4 {
        let resp = Client::new()
            .post(format!("{}/v1/completions", r.url()))
            .json(&json!({"model": "sim-model", "prompt": "x", "max_tokens": 1, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(resp.text().await.unwrap().contains("[DONE]"));
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        metric(&good.urls()[0], "vllm:request_success_total", "").await,
        4.0
    );
}

/// Client-chosen model names never become label values: unknown models share one constant
/// label, and quotes and newlines cannot forge lines. Series of a backend that left go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_stay_valid_and_bounded() {
    let sims = fleet(instant(), 2).await;
    let (r, gw) = router(&sims.urls(), &[]).await;
    let forged = "x\"} 1\nfake_metric{a=\"b\"} 7\n#";
    let mut names = vec![forged.to_owned()];
    names.extend((0..50).map(|i| format!("random-model-{i}")));
    for name in &names {
        let (status, _) = complete(
            &r.url(),
            &json!({"model": name, "prompt": "hi", "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
    for _ in 0..4 {
        let (status, _) = complete(
            &r.url(),
            &json!({"model": "sim-model", "prompt": "hi", "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    let text = metrics_text(&r.url()).await;
    assert!(
        !text.lines().any(|l| l.starts_with("fake_metric")),
        "{text}"
    );
    let incoming: Vec<&str> = series(&text, "vllm:num_incoming_requests_total").collect();
    assert_eq!(incoming.len(), 2, "{incoming:?}");
    assert!(incoming.contains(&r#"vllm:num_incoming_requests_total{model="(unknown)"} 51"#));
    assert!(incoming.contains(&r#"vllm:num_incoming_requests_total{model="sim-model"} 4"#));
    // Every line of the exposition is a comment, a sample or the end.
    for line in text.lines() {
        assert!(
            line.starts_with('#') || line.contains(' ') || line.is_empty(),
            "{line}"
        );
    }

    // One backend leaves: its series go.
    let gone = sims.urls()[1].clone();
    let text = metrics_text(&r.url()).await;
    assert!(text.contains(&format!("backend=\"{gone}\"")), "{text}");
    gw.monitor
        .apply(&[BackendSpec::new(&sims.urls()[0])])
        .await
        .unwrap();
    let text = metrics_text(&r.url()).await;
    assert!(!text.contains(&gone), "{text}");
}

/// hyper stops polling a sized body once it has all of it: a complete non-streamed answer must
/// still be counted with its real status, not as a client that left (499).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_answer_is_counted_with_its_status() {
    let sims = fleet(instant(), 1).await;
    let (r, _) = router(&sims.urls(), &[]).await;
    for stream in [false, true] {
        let resp = Client::new()
            .post(format!("{}/v1/completions", r.url()))
            .json(&json!({"model": "sim-model", "prompt": "hi", "max_tokens": 3, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.bytes().await.unwrap();
    }
    let url = r.url();
    assert!(
        eventually(5, || async {
            metric(&url, "prefix_router_requests_total", "status=\"200\"").await == 2.0
        })
        .await
    );
    assert_eq!(
        metric(&url, "prefix_router_requests_total", "status=\"499\"").await,
        0.0
    );
}

/// A client that sends headers and then stalls its body gets 408 after `--body-timeout` and
/// holds no concurrency slot after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_and_frees_its_slot() {
    let sims = fleet(instant(), 1).await;
    let (r, _) = router(
        &sims.urls(),
        &["--max-concurrent", "2", "--body-timeout", "500ms"],
    )
    .await;
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(r.addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            .await
            .unwrap();
        stalled.push(s);
    }
    for mut s in stalled {
        let mut answer = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut answer))
            .await
            .expect("the stalled client gets an answer")
            .unwrap();
        let head = String::from_utf8_lossy(&answer[..n]);
        assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    }
    let (status, answer) = complete(
        &r.url(),
        &json!({"model": "sim-model", "prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

/// At `--max-concurrent`, the health probe and the metrics still answer; only proxied
/// requests are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_answer_at_the_cap() {
    let sims = fleet(slow(20.0), 1).await;
    let (r, _) = router(&sims.urls(), &["--max-concurrent", "1"]).await;
    let url = r.url();
    let busy = tokio::spawn({
        let url = url.clone();
        async move {
            complete(
                &url,
                &json!({"model": "sim-model", "prompt": "x", "max_tokens": 100, "ignore_eos": true}),
            )
            .await
            .0
        }
    });
    assert!(
        eventually(5, || async {
            metric(&url, "prefix_router_inflight", "").await == 1.0
        })
        .await
    );
    let (refused, _) = complete(
        &url,
        &json!({"model": "sim-model", "prompt": "y", "max_tokens": 1}),
    )
    .await;
    assert_eq!(refused, StatusCode::TOO_MANY_REQUESTS);
    for path in ["/health", "/metrics"] {
        let resp = reqwest::get(format!("{url}{path}")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
    }
    assert_eq!(busy.await.unwrap(), StatusCode::OK);
}

/// A backend that was dropped (unhealthy) and comes back gets the index capacity derived from
/// its KV cache again, not the store's default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_returns_gets_its_capacity_again() {
    let sims = fleet(
        SimConfig {
            kv_blocks: 750,
            ..instant()
        },
        1,
    )
    .await;
    let sim = sims.urls()[0].clone();
    let (_r, gw) = router(&sims.urls(), &[]).await;
    // 750 blocks × 16 tokens × 4 bytes ÷ 128-byte chunks.
    let derived = 375;
    let capacity = || async {
        let servers = gw.core.store().servers().await.unwrap();
        servers.first().map(|s| s.capacity)
    };
    assert!(eventually(5, || async { capacity().await == Some(derived) }).await);
    let client = Client::new();
    client.post(format!("{sim}/sim/kill")).send().await.unwrap();
    assert!(eventually(5, || async { capacity().await.is_none() }).await);
    client
        .post(format!("{sim}/sim/revive"))
        .send()
        .await
        .unwrap();
    assert!(
        eventually(5, || async { capacity().await == Some(derived) }).await,
        "capacity after the return: {:?}",
        capacity().await
    );
}

/// `--request-timeout` ends a stream whose client stopped reading: the upstream request and
/// the in-flight count go at the deadline, not when the client reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_timeout_holds_when_the_client_stops_reading() {
    let sims = fleet(instant(), 1).await;
    let (r, _) = router(&sims.urls(), &["--request-timeout", "2s"]).await;
    let body = json!({"model": "sim-model", "prompt": "x", "max_tokens": 120_000, "ignore_eos": true, "stream": true})
        .to_string();
    let mut client = tokio::net::TcpStream::connect(r.addr).await.unwrap();
    client
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // The client never reads; its socket buffers fill and the router stops polling the body.
    let url = r.url();
    assert!(
        eventually(5, || async {
            metric(&url, "prefix_router_inflight", "").await == 1.0
        })
        .await
    );
    assert!(
        eventually(8, || async {
            metric(&url, "prefix_router_inflight", "").await == 0.0
        })
        .await,
        "the stream is over at the request timeout"
    );
    assert_eq!(
        metric(&url, "prefix_router_requests_total", "status=\"504\"").await,
        1.0
    );
    drop(client);
}

/// `/tokenize` and the other load-routed endpoints take turns among equally loaded backends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_routed_endpoints_take_turns() {
    let sims = fleet(instant(), 2).await;
    let (r, _) = router(&sims.urls(), &[]).await;
    for _ in 0..10 {
        let resp = Client::new()
            .post(format!("{}/tokenize", r.url()))
            .json(&json!({"model": "sim-model", "prompt": "hello"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.bytes().await.unwrap();
    }
    for sim in sims.urls() {
        let n = metric(
            &r.url(),
            "prefix_router_requests_total",
            &format!("backend=\"{sim}\""),
        )
        .await;
        assert_eq!(n, 5.0, "{sim}");
    }
}
