//! Prefill/decode disaggregation between simulated servers, as vLLM's NixlConnector speaks it:
//! the prefill's answer names its blocks, the decode pulls them, and prefills on a server hold
//! up its decoding sequences.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use reqwest::Client;
use serde_json::{json, Value};
use vllm_sim::SimConfig;

mod support;
use support::{fleet, instant, metric};

async fn post(url: &str, body: &Value) -> Value {
    let resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.json().await.unwrap()
}

/// A prefill on `p` for a decode elsewhere: its answer's `kv_transfer_params`.
async fn prefill(p: &str, prompt: &str) -> Value {
    let answer = post(
        p,
        &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1, "stream": false,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
    )
    .await;
    answer["kv_transfer_params"].clone()
}

#[tokio::test]
async fn a_decode_pulls_the_blocks_its_prefill_named_and_keeps_them() {
    let sims = fleet(instant(), 2).await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    // 1,000 bytes: 250 tokens, 15 full blocks of 16.
    let prompt = "abcd".repeat(250);
    let params = prefill(&p, &prompt).await;
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_block_ids"][0].as_array().unwrap().len(), 15);
    let port: u16 = p.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(params["remote_port"], port);
    let answer = post(
        &d,
        &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4,
                "kv_transfer_params": params}),
    )
    .await;
    // The decode found the 240 pulled tokens cached; its prefix cache did not have them.
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        240
    );
    assert_eq!(
        metric(&d, "vllm:external_prefix_cache_hits_total").await,
        240.0
    );
    assert_eq!(
        metric(&d, "vllm:external_prefix_cache_queries_total").await,
        250.0
    );
    assert_eq!(metric(&d, "vllm:prefix_cache_hits_total").await, 0.0);
    // Kept: the same prompt again is a local hit now.
    let again = post(
        &d,
        &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4}),
    )
    .await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        240
    );
    assert_eq!(metric(&d, "vllm:prefix_cache_hits_total").await, 240.0);
    sims.shutdown().await;
}

#[tokio::test]
async fn blocks_of_another_prompt_carry_nothing() {
    let sims = fleet(instant(), 2).await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    let params = prefill(&p, &"abcd".repeat(250)).await;
    let answer = post(
        &d,
        &json!({"model": "sim-model", "prompt": "wxyz".repeat(250), "max_tokens": 4,
                "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        metric(&d, "vllm:external_prefix_cache_hits_total").await,
        0.0
    );
    // A malformed pull is a 400, as the body's other fields are.
    let resp = Client::new()
        .post(format!("{d}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": "x",
                      "kv_transfer_params": {"do_remote_prefill": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    sims.shutdown().await;
}

#[tokio::test]
async fn the_first_pull_from_a_peer_pays_the_handshake() {
    let sims = fleet(
        SimConfig {
            kv_handshake_ms: 1000.0,
            ..SimConfig::default()
        },
        2,
    )
    .await;
    let (p, d) = (sims.urls()[0].clone(), sims.urls()[1].clone());
    let mut took = Vec::new();
    for prompt in ["abcd".repeat(250), "efgh".repeat(250)] {
        let params = prefill(&p, &prompt).await;
        let start = Instant::now();
        post(
            &d,
            &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1,
                    "kv_transfer_params": params}),
        )
        .await;
        took.push(start.elapsed());
    }
    assert!(took[0] >= Duration::from_millis(1000), "{took:?}");
    assert!(took[1] < Duration::from_millis(800), "{took:?}");
    sims.shutdown().await;
}

/// The longest gap between two streamed tokens of a long answer while another request's long
/// prompt is prefilled on the same server.
async fn longest_gap(stalls: f64) -> Duration {
    let sims = fleet(
        SimConfig {
            prefill_stalls_decode: stalls,
            ..SimConfig::default()
        },
        1,
    )
    .await;
    let url = sims.urls()[0].clone();
    let stream = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": "sim-model", "prompt": "hello", "max_tokens": 60,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        let mut body = stream.bytes_stream();
        let (mut last, mut longest) = (None::<Instant>, Duration::ZERO);
        while let Some(chunk) = body.next().await {
            chunk.unwrap();
            let now = Instant::now();
            if let Some(l) = last {
                longest = longest.max(now - l);
            }
            last = Some(now);
        }
        longest
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // 8,000 tokens: one step of about 410 ms.
    post(
        &url,
        &json!({"model": "sim-model", "prompt": "abcd".repeat(8000), "max_tokens": 1}),
    )
    .await;
    let longest = reader.await.unwrap();
    sims.shutdown().await;
    longest
}

#[tokio::test]
async fn a_prefill_holds_up_the_tokens_decoding_beside_it() {
    let stalled = longest_gap(1.0).await;
    assert!(stalled >= Duration::from_millis(250), "{stalled:?}");
    let free = longest_gap(0.0).await;
    assert!(free < Duration::from_millis(200), "{free:?}");
}
