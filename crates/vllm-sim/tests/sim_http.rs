//! The simulator over HTTP: vLLM's surface, cache accounting, queueing, faults.

use std::time::Duration;

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use vllm_sim::SimConfig;

mod support;
use support::{fleet, instant, metric};

async fn post(url: &str, path: &str, body: Value) -> (StatusCode, Value) {
    let resp = Client::new()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// `len` bytes of text unique to `seed`.
fn text(seed: u64, len: usize) -> String {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (b'a' + (s % 26) as u8) as char
        })
        .collect()
}

fn completion(prompt: &str, max_tokens: u64) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true})
}

#[tokio::test]
async fn cache_accounting_matches_vllm() {
    let fleet = fleet(instant(), 1).await;
    let url = &fleet.urls()[0];
    // 1,002 bytes = 251 tokens = 15 full blocks of 16 and 11 tokens more.
    let prompt = text(1, 1002);
    let (s, first) = post(url, "/v1/completions", completion(&prompt, 4)).await;
    assert_eq!(s, StatusCode::OK, "{first}");
    assert_eq!(first["usage"]["prompt_tokens"], 251);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let (_, second) = post(url, "/v1/completions", completion(&prompt, 4)).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        240
    );
    // The same text gives the same answer.
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);

    // A request sharing the first 640 bytes (160 tokens, 10 blocks) hits exactly those.
    let shared = format!("{}{}", &prompt[..640], text(2, 400));
    let probe = post(url, "/sim/probe", json!({"prompt": shared})).await.1;
    assert_eq!(probe, json!({"prompt_tokens": 260, "cached_tokens": 160}));
    let (_, third) = post(url, "/v1/completions", completion(&shared, 4)).await;
    assert_eq!(
        third["usage"]["prompt_tokens_details"]["cached_tokens"],
        160
    );
    // A different prompt hits nothing.
    let (_, fourth) = post(url, "/v1/completions", completion(&text(3, 1002), 4)).await;
    assert_eq!(fourth["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // The metrics agree with usage.
    assert_eq!(
        metric(url, "vllm:prefix_cache_queries_total").await,
        251.0 * 3.0 + 260.0
    );
    assert_eq!(
        metric(url, "vllm:prefix_cache_hits_total").await,
        240.0 + 160.0
    );
    assert_eq!(
        metric(url, "vllm:prompt_tokens_total").await,
        251.0 * 3.0 + 260.0
    );
    assert_eq!(metric(url, "vllm:generation_tokens_total").await, 16.0);
    assert_eq!(metric(url, "vllm:request_success_total").await, 4.0);
    assert_eq!(metric(url, "vllm:num_requests_running").await, 0.0);
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("vllm:cache_config_info{block_size=\"16\""),
        "{text}"
    );
    assert!(text.contains("num_gpu_blocks=\"24000\""));
    assert!(text.contains(
        "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"sim-model\"} 4.0"
    ));

    // Reset empties the cache and the counters.
    post(url, "/sim/reset", json!({})).await;
    assert_eq!(metric(url, "vllm:prefix_cache_hits_total").await, 0.0);
    let probe = post(url, "/sim/probe", json!({"prompt": prompt})).await.1;
    assert_eq!(probe["cached_tokens"], 0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_probe_counts_the_prompts_ahead_in_the_queue() {
    // 2,000 tokens/s: a 251-token prompt takes ~125 ms of prefill (plus 10 ms overhead).
    let fleet = fleet(
        SimConfig {
            prefill_tokens_per_s: 2_000.0,
            ..SimConfig::default()
        },
        1,
    )
    .await;
    let url = fleet.urls()[0].clone();
    let prompt = text(20, 1002);
    let first = {
        let (url, body) = (url.clone(), completion(&prompt, 1));
        tokio::spawn(async move { post(&url, "/v1/completions", body).await })
    };
    // While the first is in prefill a request arriving now is prefilled after it and finds its
    // blocks (cached when its step was planned, as vLLM does): the probe says so.
    tokio::time::sleep(Duration::from_millis(40)).await;
    let probe = post(&url, "/sim/probe", json!({"prompt": prompt})).await.1;
    assert_eq!(probe["cached_tokens"], 240, "{probe}");
    let (_, second) = post(&url, "/v1/completions", completion(&prompt, 1)).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        240
    );
    let (_, first) = first.await.unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // An unrelated prompt finds nothing, in the cache or ahead.
    let other = post(&url, "/sim/probe", json!({"prompt": text(21, 1002)}))
        .await
        .1;
    assert_eq!(other["cached_tokens"], 0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn eviction_under_pressure_is_least_recently_used() {
    // 40 blocks: room for two 16-block prompts (plus their answers), not three.
    let fleet = fleet(
        SimConfig {
            kv_blocks: 40,
            ..instant()
        },
        1,
    )
    .await;
    let url = &fleet.urls()[0];
    let [a, b, c] = [text(10, 1030), text(11, 1030), text(12, 1030)]; // 258 tokens: 16 blocks
    let cached = |p: &str| {
        let body = json!({"prompt": p});
        async move {
            post(url, "/sim/probe", body).await.1["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    post(url, "/v1/completions", completion(&a, 1)).await;
    post(url, "/v1/completions", completion(&b, 1)).await;
    assert_eq!((cached(&a).await, cached(&b).await), (256, 256));
    // Use a again: now b is the least recently used, and c pushes b out, tail first.
    post(url, "/v1/completions", completion(&a, 1)).await;
    post(url, "/v1/completions", completion(&c, 1)).await;
    assert_eq!(cached(&a).await, 256);
    assert_eq!(cached(&c).await, 256);
    let b_left = cached(&b).await;
    assert!(b_left < 256, "b should lose its tail, kept {b_left}");
    // What is left of b is a prefix: its first blocks still hit.
    assert_eq!(b_left % 16, 0);
    fleet.shutdown().await;
}

/// Splits an SSE body into its JSON events, checking the framing.
fn sse_events(body: &str) -> Vec<Value> {
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "stream must end with [DONE]: {body:?}"
    );
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is a data line")
        })
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[tokio::test]
async fn streaming_is_shaped_like_vllm() {
    let fleet = fleet(instant(), 1).await;
    let url = &fleet.urls()[0];
    let resp = Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({
            "model": "sim-model",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
            "max_tokens": 5, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true},
            "some_router_field": {"ignored": true},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(&resp.text().await.unwrap());
    assert_eq!(events.len(), 1 + 5 + 1);
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let content: String = events[1..6]
        .iter()
        .map(|e| e["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(content.len(), 20);
    assert!(events[1..5]
        .iter()
        .all(|e| e["choices"][0]["finish_reason"].is_null()));
    assert_eq!(events[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[6]["choices"], json!([]));
    assert_eq!(events[6]["usage"]["completion_tokens"], 5);
    assert!(events.iter().all(|e| e["id"] == events[0]["id"]));

    // Completions: a text per token, no usage chunk unless asked.
    let resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": "Once upon", "max_tokens": 3, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let events = sse_events(&resp.text().await.unwrap());
    assert_eq!(events.len(), 3);
    assert_eq!(events[0]["object"], "text_completion");
    assert_eq!(events[2]["choices"][0]["finish_reason"], "length");
    assert!(events.iter().all(|e| e.get("usage").is_none()));

    // Without ignore_eos an answer may end by itself: finish_reason "stop".
    let (_, v) = post(
        url,
        "/v1/completions",
        json!({"model": "sim-model", "prompt": "x", "max_tokens": 5000}),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((16..=271).contains(&n), "{n}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn api_surface_and_errors() {
    let fleet = fleet(instant(), 2).await;
    let url = &fleet.urls()[1];
    let models: Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "sim-model");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    for path in [
        "/health",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/version",
    ] {
        let status = reqwest::get(format!("{url}{path}")).await.unwrap().status();
        assert_eq!(status, StatusCode::OK, "{path}");
    }

    let (s, v) = post(
        url,
        "/v1/completions",
        json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["code"], 404);
    assert_eq!(v["error"]["message"], "The model `other` does not exist.");
    let resp = Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "BadRequestError");
    for bad in [
        json!({"model": "sim-model"}),
        json!({"model": "sim-model", "messages": "hi"}),
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200000}),
    ] {
        let (s, v) = post(url, "/v1/chat/completions", bad.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad} -> {v}");
        assert_eq!(v["error"]["code"], 400);
    }

    // Render: the prompt's token ids in vLLM's GenerateRequest shape.
    let messages = json!([{"role": "user", "content": "Hello"}]);
    let (s, v) = post(
        url,
        "/v1/chat/completions/render",
        json!({"model": "sim-model", "messages": messages, "max_tokens": 7}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let ids = v["token_ids"].as_array().unwrap();
    // "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" is 55 bytes: 14 tokens.
    assert_eq!(ids.len(), 14);
    assert_eq!(v["sampling_params"]["max_tokens"], 7);
    assert_eq!(v["model"], "sim-model");
    let (_, v) = post(
        url,
        "/v1/completions/render",
        json!({"model": "sim-model", "prompt": ["ab", "cdefgh"]}),
    )
    .await;
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(v[1]["token_ids"].as_array().unwrap().len(), 2);
    // Rendering changes no state: the chat prompt is still uncached.
    let (_, p) = post(url, "/sim/probe", json!({"messages": messages})).await;
    assert_eq!(p, json!({"prompt_tokens": 14, "cached_tokens": 0}));

    // Tokenize agrees with the render; embeddings answer.
    let (_, t) = post(
        url,
        "/tokenize",
        json!({"model": "sim-model", "messages": messages}),
    )
    .await;
    assert_eq!(t["count"], 14);
    let (s, e) = post(
        url,
        "/v1/embeddings",
        json!({"model": "sim-model", "input": ["a", "b"]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(e["data"].as_array().unwrap().len(), 2);
    fleet.shutdown().await;
}

#[tokio::test]
async fn faults_fail_stall_kill_and_revive() {
    let fleet = fleet(instant(), 1).await;
    let url = &fleet.urls()[0];
    let resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .header("X-Sim-Fail", "503")
        .json(&completion("x", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);

    post(url, "/sim/kill", json!({})).await;
    let err = Client::new().get(format!("{url}/health")).send().await;
    assert!(
        err.is_err(),
        "a killed server drops the connection: {err:?}"
    );
    let err = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&completion("x", 1))
        .send()
        .await;
    assert!(err.is_err());
    let state: Value = reqwest::get(format!("{url}/sim/state"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["killed"], true);
    post(url, "/sim/revive", json!({})).await;
    assert_eq!(
        reqwest::get(format!("{url}/health"))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );

    // --fail-rate 1: every generation fails with a 500, health still answers.
    let failing = self::fleet(
        SimConfig {
            fail_rate: 1.0,
            ..instant()
        },
        1,
    )
    .await;
    let (s, v) = post(&failing.urls()[0], "/v1/completions", completion("x", 1)).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(v["error"]["code"], 500);
    failing.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_kill_cuts_a_stream_midway() {
    // Real time: 20 ms between tokens.
    let config = SimConfig {
        time_scale: 1.0,
        itl_ms: 20.0,
        prefill_overhead_ms: 1.0,
        ..SimConfig::default()
    };
    let fleet = fleet(config, 1).await;
    let url = fleet.urls()[0].clone();
    let mut resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": "x", "max_tokens": 200, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    post(&url, "/sim/kill", json!({})).await;
    let rest = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match resp.chunk().await {
                Ok(Some(_)) => continue,
                Ok(None) => return "ended",
                Err(_) => return "error",
            }
        }
    })
    .await
    .expect("the cut stream ends, it does not hang");
    assert_eq!(
        rest, "error",
        "the stream must end abruptly, without [DONE]"
    );
    // The aborted request gave back its seat.
    post(&url, "/sim/revive", json!({})).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(metric(&url, "vllm:num_requests_running").await, 0.0);
    assert_eq!(metric(&url, "vllm:kv_cache_usage_perc").await, 0.0);
    fleet.shutdown().await;
}

/// Above one server's prefill capacity, time to first token grows with the queue; with cache
/// hits the same arrival pattern does not queue.
#[tokio::test]
async fn queueing_grows_ttft_and_cache_hits_avoid_it() {
    // Simulated time runs twice as fast as real time.
    let config = SimConfig {
        time_scale: 0.5,
        ..SimConfig::default()
    };
    let fleet = fleet(config, 1).await;
    let url = fleet.urls()[0].clone();
    // 16,000 bytes = 4,000 tokens = 0.21 s of prefill each; ten at once = 2.1 s of work.
    let burst = |prompts: Vec<String>| {
        let url = url.clone();
        async move {
            let calls = prompts.into_iter().map(|p| {
                let url = url.clone();
                async move { post(&url, "/v1/completions", completion(&p, 1)).await }
            });
            futures_util::future::join_all(calls).await
        }
    };
    let mean_ttft = |url: String| async move {
        metric(&url, "vllm:time_to_first_token_seconds_sum").await
            / metric(&url, "vllm:time_to_first_token_seconds_count").await
    };
    burst((0..10).map(|i| text(100 + i, 16_000)).collect()).await;
    let misses = mean_ttft(url.clone()).await;

    let shared = text(7, 16_000);
    burst(vec![shared.clone()]).await; // warm the cache
    post(&url, "/sim/reset", json!({})).await;
    burst(vec![shared.clone()]).await; // reset emptied the cache: warm it again
    let before = metric(&url, "vllm:time_to_first_token_seconds_sum").await;
    burst((0..10).map(|_| shared.clone()).collect()).await;
    let hits = (metric(&url, "vllm:time_to_first_token_seconds_sum").await - before) / 10.0;

    // Misses: mean wait about half the burst (~1.1 s); hits: ~10 ms of overhead each.
    assert!(misses > 0.8, "misses mean TTFT {misses:.3} s");
    assert!(
        hits < misses / 5.0,
        "hits {hits:.3} s vs misses {misses:.3} s"
    );
    let hit_tokens = metric(&url, "vllm:prefix_cache_hits_total").await;
    assert_eq!(hit_tokens, 10.0 * 3_984.0);
    fleet.shutdown().await;
}

/// `--api-key` as vLLM has it: `/v1` paths need the bearer key; health and metrics stay open.
#[tokio::test]
async fn an_api_key_guards_the_v1_paths_only() {
    let sims = fleet(
        SimConfig {
            api_key: Some("sim-secret".into()),
            ..instant()
        },
        1,
    )
    .await;
    let url = &sims.urls()[0];
    let (status, body) = post(url, "/v1/completions", completion("hi", 1)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body, json!({"error": "Unauthorized"}));
    let with_key = |key: &str| {
        Client::new()
            .post(format!("{url}/v1/completions"))
            .bearer_auth(key)
            .json(&completion("hi", 1))
            .send()
    };
    assert_eq!(
        with_key("wrong").await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        with_key("sim-secret").await.unwrap().status(),
        StatusCode::OK
    );
    for open in ["/health", "/metrics", "/version"] {
        let status = reqwest::get(format!("{url}{open}")).await.unwrap().status();
        assert_eq!(status, StatusCode::OK, "{open}");
    }
    assert_eq!(metric(url, "vllm:request_success_total").await, 1.0);
}
