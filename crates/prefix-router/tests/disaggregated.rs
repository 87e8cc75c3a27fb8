//! Prefill/decode disaggregation through the router, against sims that speak vLLM's
//! NixlConnector protocol: the prefill call, the decode call with the transfer parameters,
//! the skip rule, and every failure rule (a prefill server that fails, stalls or is down, a
//! decode server that fails, a client that leaves during the prefill).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use common::envoy::{body_message, mutation, picker, request_headers, Gateway};
use common::{eventually, fake_backend_of, fleet, instant, metric, router, text};
use serde_json::{json, Value};

/// A streamed completion of `prompt`: its status and the text of its answer.
async fn complete(url: &str, prompt: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// The usage a streamed answer reported.
fn usage(answer: &str) -> Value {
    answer
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .expect("the stream reports its usage")
}

async fn decisions(router: &str, reason: &str) -> f64 {
    metric(
        router,
        "prefix_router_routing_decisions_total",
        &format!("reason=\"{reason}\""),
    )
    .await
}

async fn prefills(router: &str, outcome: &str) -> f64 {
    metric(
        router,
        "prefix_router_pd_prefills_total",
        &format!("outcome=\"{outcome}\""),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_on_the_prefill_server_and_its_continuation_skips_it() {
    let sims = fleet(instant(), 2).await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    let (r, _) = router(&[], &["--prefill", &p, "--decode", &d]).await;
    let url = r.url();
    // 8,000 bytes: about 2,000 tokens, far above the threshold.
    let shared = text(1, 8_000);
    let (status, answer) = complete(&url, &shared).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("data: [DONE]"));
    assert_eq!(decisions(&url, "pd_disaggregated").await, 1.0);
    assert_eq!(prefills(&url, "ok").await, 1.0);
    // The prefill server computed the prompt; the decode server pulled it (vLLM's external
    // hits), and the client's usage counts the prompt once.
    let pulled = metric(&d, "vllm:external_prefix_cache_hits_total", "").await;
    assert!(pulled > 1_500.0, "the decode server pulled {pulled} tokens");
    assert_eq!(
        metric(&p, "vllm:request_success_total", "").await,
        1.0,
        "one prefill call"
    );
    let prompt_tokens = usage(&answer)["prompt_tokens"].as_u64().unwrap();
    assert!(
        (1_900..2_100).contains(&prompt_tokens),
        "usage {prompt_tokens}"
    );

    // The same prompt and a short question: the decode server holds all but a few tokens, so
    // it computes them itself, with no prefill call.
    let (status, answer) = complete(&url, &format!("{shared} and one more question")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(decisions(&url, "pd_skip_cached").await, 1.0);
    assert_eq!(prefills(&url, "ok").await, 1.0, "no second prefill call");
    assert_eq!(metric(&p, "vllm:request_success_total", "").await, 1.0);
    let cached = usage(&answer)["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > 1_900,
        "the decode server kept the pulled prefix: {cached}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_prompt_is_decoded_where_it_lands_without_a_transfer() {
    let sims = fleet(instant(), 2).await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    let (r, _) = router(&[], &["--prefill", &p, "--decode", &d]).await;
    let (status, _) = complete(&r.url(), "a short prompt").await;
    assert_eq!(status, 200);
    assert_eq!(decisions(&r.url(), "pd_skip_cached").await, 1.0);
    assert_eq!(metric(&p, "vllm:request_success_total", "").await, 0.0);
}

/// A stand-in server of `sim-model` (the sims' model): `completions` plus the routes the router
/// polls.
async fn stand_in(completions: axum::Router) -> String {
    fake_backend_of("sim-model", completions).await
}

/// A prefill server that answers completions with `answer` after `delay`, counting calls, and
/// telling (through `dropped`) how many of its calls were abandoned before it answered.
async fn prefill_stand_in(
    delay: Duration,
    status: u16,
    calls: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
) -> String {
    struct Abandoned(Arc<AtomicUsize>, bool);
    impl Drop for Abandoned {
        fn drop(&mut self) {
            if !self.1 {
                self.0.fetch_add(1, SeqCst);
            }
        }
    }
    let handler = move || {
        let (calls, dropped) = (calls.clone(), dropped.clone());
        async move {
            calls.fetch_add(1, SeqCst);
            let mut abandoned = Abandoned(dropped, false);
            tokio::time::sleep(delay).await;
            abandoned.1 = true;
            (
                axum::http::StatusCode::from_u16(status).unwrap(),
                axum::Json(json!({"error": {"message": "stand-in"}})),
            )
        }
    };
    stand_in(axum::Router::new().route("/v1/completions", post(handler))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_stalled_or_dead_prefill_server_costs_the_client_nothing() {
    let sims = fleet(instant(), 2).await;
    let d = sims.urls()[1].clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    // A prefill server answering 500.
    let failing = prefill_stand_in(Duration::ZERO, 500, calls.clone(), dropped.clone()).await;
    let (r, _) = router(&[], &["--prefill", &failing, "--decode", &d]).await;
    let (status, answer) = complete(&r.url(), &text(2, 8_000)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(prefills(&r.url(), "error").await, 1.0);
    assert_eq!(calls.load(SeqCst), 1);
    assert_eq!(
        metric(&d, "vllm:external_prefix_cache_hits_total", "").await,
        0.0,
        "the decode server computed the prompt itself"
    );

    // A prefill server that takes longer than --pd-prefill-timeout.
    let stalled = prefill_stand_in(Duration::from_secs(30), 200, calls.clone(), dropped).await;
    let (r, _) = router(
        &[],
        &[
            "--prefill",
            &stalled,
            "--decode",
            &d,
            "--pd-prefill-timeout",
            "300ms",
        ],
    )
    .await;
    let (status, _) = complete(&r.url(), &text(3, 8_000)).await;
    assert_eq!(status, 200);
    assert_eq!(prefills(&r.url(), "timeout").await, 1.0);

    // A prefill server that is gone: killed between two requests.
    let (r, _) = router(&[], &["--prefill", &sims.urls()[0], "--decode", &d]).await;
    let (status, _) = complete(&r.url(), &text(4, 8_000)).await;
    assert_eq!(status, 200);
    assert_eq!(prefills(&r.url(), "ok").await, 1.0);
    sims.shutdown().await;
    let sims = fleet(instant(), 1).await;
    let (r, _) = router(
        &[],
        &[
            "--prefill",
            "http://127.0.0.1:9",
            "--decode",
            &sims.urls()[0],
        ],
    )
    .await;
    let (status, answer) = complete(&r.url(), &text(5, 8_000)).await;
    assert_eq!(status, 200, "{answer}");
    let url = r.url();
    assert!(
        prefills(&url, "unreachable").await + decisions(&url, "pd_skip_no_prefill").await >= 1.0,
        "a dead prefill server is either tried and passed over or already known down"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_server_that_fails_gets_replaced_with_a_fresh_prefill() {
    let sims = fleet(instant(), 2).await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    // A decode server that is healthy but answers every completion with a 503.
    let broken = stand_in(axum::Router::new().route(
        "/v1/completions",
        post(|| async { axum::http::StatusCode::SERVICE_UNAVAILABLE }),
    ))
    .await;
    let (r, _) = router(
        &[],
        &[
            "--prefill",
            &p,
            "--decode",
            &d,
            "--decode",
            &broken,
            "--policy",
            "round_robin",
        ],
    )
    .await;
    let url = r.url();
    let mut retried = 0.0;
    for i in 0..4 {
        let resp = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "sim-model", "prompt": text(10 + i, 8_000), "max_tokens": 2, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
        retried = metric(&url, "prefix_router_retries_total", "").await;
    }
    assert!(retried >= 1.0, "some request met the broken decode server");
    // Every decode attempt had its own prefill.
    assert_eq!(prefills(&url, "ok").await, 4.0 + retried);
    assert_eq!(
        metric(&p, "vllm:request_success_total", "").await,
        4.0 + retried
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_the_prefill_cancels_it() {
    let sims = fleet(instant(), 1).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let slow = prefill_stand_in(Duration::from_secs(20), 200, calls.clone(), dropped.clone()).await;
    let (r, _) = router(&[], &["--prefill", &slow, "--decode", &sims.urls()[0]]).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(400))
        .build()
        .unwrap();
    let gone = client
        .post(format!("{}/v1/completions", r.url()))
        .json(&json!({"model": "sim-model", "prompt": text(6, 8_000), "max_tokens": 2, "stream": true}))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up");
    assert_eq!(calls.load(SeqCst), 1);
    assert!(
        eventually(5, || async { dropped.load(SeqCst) == 1 }).await,
        "the prefill call was abandoned with the client"
    );
    assert_eq!(
        metric(&sims.urls()[0], "vllm:request_success_total", "").await,
        0.0,
        "nothing reached the decode server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_names_the_prefiller_for_the_decode_pods_sidecar() {
    let sims = fleet(instant(), 2).await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    let picker = picker(&[], &["--prefill", &p, "--decode", &d]).await;
    let body = |prompt: &str| {
        serde_json::to_vec(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}))
            .unwrap()
    };
    let header = |answer: &_| -> (String, Option<String>, bool) {
        let (set, removed) = mutation(answer);
        (
            set["x-gateway-destination-endpoint"].clone(),
            set.get("x-prefiller-host-port").cloned(),
            removed.iter().any(|h| h == "x-prefiller-host-port"),
        )
    };
    let host = |u: &str| u.trim_start_matches("http://").to_owned();
    // A long prompt: the decode pod is the destination, the prefill pod named to its sidecar.
    let mut gw = Gateway::open(&picker.grpc_url()).await;
    gw.send(request_headers("/v1/completions", None)).await;
    gw.send(body_message(true, &body(&text(7, 8_000)), true))
        .await;
    let (destination, prefiller, _) = header(&gw.next().await);
    assert_eq!(destination, host(&d));
    assert_eq!(prefiller, Some(host(&p)));
    // A short one: no prefiller, and a client's own header is taken off.
    let mut gw = Gateway::open(&picker.grpc_url()).await;
    gw.send(request_headers("/v1/completions", None)).await;
    gw.send(body_message(true, &body("short"), true)).await;
    let (destination, prefiller, removed) = header(&gw.next().await);
    assert_eq!(destination, host(&d));
    assert_eq!(prefiller, None);
    assert!(removed);
}
