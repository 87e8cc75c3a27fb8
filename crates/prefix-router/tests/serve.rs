//! `prefix-router serve` in front of simulated vLLM servers, all on free loopback ports.

#[path = "../../vllm-sim/tests/support.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prefix_router::serve::policy::PolicyKind;
use prefix_router::serve::{self, Gateway, ServeArgs};
use prefix_router::server::Running;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use vllm_sim::{Fleet, SimConfig};

const LOOPBACK: ([u8; 4], u16) = ([127, 0, 0, 1], 0);

fn sim(time_scale: f64) -> SimConfig {
    SimConfig {
        time_scale,
        ..SimConfig::default()
    }
}

async fn fleet(config: SimConfig, n: usize) -> Fleet {
    Fleet::start(config, n, SocketAddr::from(LOOPBACK))
        .await
        .unwrap()
}

struct Router {
    running: Running,
    gateway: Arc<Gateway>,
}

impl Router {
    fn url(&self) -> String {
        self.running.url()
    }
}

async fn router(urls: &[String], configure: impl FnOnce(&mut ServeArgs)) -> Router {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let mut args = ServeArgs::with_backends(listener.local_addr().unwrap(), urls);
    args.health_interval = Duration::from_millis(100);
    args.metrics_interval = Duration::from_millis(100);
    args.unhealthy_after = 1;
    configure(&mut args);
    let args = args.resolve(&[]).unwrap();
    let (running, gateway) = serve::spawn(args, listener).await.unwrap();
    Router { running, gateway }
}

async fn post(url: &str, path: &str, body: &Value) -> (StatusCode, Value) {
    let resp = Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// A metric's value from a `/metrics` text, summed over the label sets matching `filter`.
async fn metric(url: &str, name: &str, filter: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(filter)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests each sim server has finished.
async fn served(fleet: &Fleet) -> Vec<f64> {
    let mut out = Vec::new();
    for url in fleet.urls() {
        out.push(metric(&url, "vllm:request_success_total", "").await);
    }
    out
}

fn words(seed: u64, len: usize) -> String {
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

fn chat(system: &str, question: &str) -> Value {
    json!({"model": "sim-model", "max_tokens": 4, "ignore_eos": true, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]})
}

#[tokio::test]
async fn a_real_openai_client_through_the_router() {
    let Some(python) = support::python_with_openai() else {
        return;
    };
    let fleet = fleet(sim(0.0), 2).await;
    let router = router(&fleet.urls(), |_| {}).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../vllm-sim/tests/openai_client.py"
    );
    let out = support::run_python(&python, script, &[&router.url(), "sim-model"]).await;
    assert!(out.contains("models ok"), "{out}");
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn shared_prefixes_stick_and_distinct_ones_spread() {
    let fleet = fleet(sim(0.0), 4).await;
    let router = router(&fleet.urls(), |_| {}).await;
    let url = router.url();
    // 24 questions under one long system prompt: one backend, and its cache is hit.
    let system = words(1, 6000);
    for i in 0..24 {
        let (s, v) = post(
            &url,
            "/v1/chat/completions",
            &chat(&system, &format!("question {i}")),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        if i > 0 {
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(
                cached >= 1_488,
                "request {i} should hit the system prompt, cached {cached}"
            );
        }
    }
    let per_backend = served(&fleet).await;
    assert_eq!(
        per_backend.iter().filter(|&&n| n > 0.0).count(),
        1,
        "{per_backend:?}"
    );
    // 8 different system prompts: spread over the backends (ties go to the emptiest index).
    for p in 0..8 {
        let system = words(100 + p, 3000);
        post(&url, "/v1/chat/completions", &chat(&system, "hello")).await;
    }
    let after = served(&fleet).await;
    let new: Vec<f64> = after.iter().zip(&per_backend).map(|(a, b)| a - b).collect();
    assert!(
        new.iter().filter(|&&n| n > 0.0).count() >= 3,
        "new prefixes spread: {new:?}"
    );
    assert_eq!(
        metric(
            &url,
            "prefix_router_routing_decisions_total",
            "reason=\"cost_hit\""
        )
        .await,
        23.0
    );
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn multi_turn_conversations_keep_their_backend() {
    let fleet = fleet(sim(0.0), 4).await;
    let router = router(&fleet.urls(), |_| {}).await;
    let url = router.url();
    for user in 0..4u64 {
        let mut messages = vec![json!({"role": "system", "content": words(user, 800)})];
        let before = served(&fleet).await;
        for turn in 0..5 {
            messages.push(json!({"role": "user", "content": format!("turn {turn}: {}", words(user * 10 + turn, 300))}));
            let (s, v) = post(
                &url,
                "/v1/chat/completions",
                &json!({"model": "sim-model", "max_tokens": 8, "messages": messages}),
            )
            .await;
            assert_eq!(s, StatusCode::OK);
            if turn > 0 {
                assert!(
                    v["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap()
                        > 0
                );
            }
            messages.push(
                json!({"role": "assistant", "content": v["choices"][0]["message"]["content"]}),
            );
        }
        let after = served(&fleet).await;
        let used = after.iter().zip(&before).filter(|(a, b)| a > b).count();
        assert_eq!(
            used, 1,
            "user {user}'s five turns on one backend: {before:?} -> {after:?}"
        );
    }
    router.running.shutdown().await;
    fleet.shutdown().await;
}

/// 64 concurrent requests with one prefix, each taking ~100 ms of decode, through `policy`:
/// they spread, and the decisions say what spread them (`expected_reasons`, summed).
async fn a_hot_prefix_spreads(policy: PolicyKind, expected_reasons: &[&str]) {
    let config = SimConfig {
        time_scale: 1.0,
        itl_ms: 10.0,
        ..SimConfig::default()
    };
    let fleet = fleet(config, 4).await;
    let router = router(&fleet.urls(), |a| {
        a.policy = policy;
        a.balance_abs = 4;
        a.balance_rel = 1.5;
    })
    .await;
    let url = router.url();
    let system = words(9, 4000);
    let body = json!({"model": "sim-model", "max_tokens": 10, "ignore_eos": true, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "same question"}]});
    let calls = (0..64).map(|_| {
        let (url, body) = (url.clone(), body.clone());
        async move { post(&url, "/v1/chat/completions", &body).await.0 }
    });
    let statuses = futures_util::future::join_all(calls).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK));
    let per_backend = served(&fleet).await;
    let max = per_backend.iter().cloned().fold(0.0, f64::max);
    assert!(
        max < 64.0 * 0.75,
        "{policy:?} spreads a hot prefix: {per_backend:?}"
    );
    let mut spread_by = 0.0;
    for reason in expected_reasons {
        let filter = format!("reason=\"{reason}\"");
        spread_by += metric(&url, "prefix_router_routing_decisions_total", &filter).await;
    }
    assert!(
        spread_by > 0.0,
        "{policy:?}: no {expected_reasons:?} decision"
    );
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_hot_prefix_does_not_pile_onto_one_backend() {
    // prefix_load spreads it by its load guard alone; cost (the default) by its prediction (a
    // backend's queue makes it dearer than a miss elsewhere) or the same guard.
    a_hot_prefix_spreads(PolicyKind::PrefixLoad, &["load_guard"]).await;
    a_hot_prefix_spreads(PolicyKind::Cost, &["load_guard", "cost_balance"]).await;
}

#[tokio::test]
async fn a_killed_backend_fails_over_without_client_errors_and_comes_back() {
    let config = SimConfig {
        time_scale: 1.0,
        itl_ms: 2.0,
        prefill_overhead_ms: 2.0,
        ..SimConfig::default()
    };
    let fleet = fleet(config, 3).await;
    // Two failed checks, not one: on a loaded machine one health check of the survivors may
    // take longer than its 100 ms, and that must not empty the fleet. The victim's refused
    // connections fail at once, so it still leaves within two checks.
    let router = router(&fleet.urls(), |a| a.unhealthy_after = 2).await;
    let url = router.url();
    let victim = fleet.urls()[1].clone();
    let load = (0..120).map(|i| {
        let url = url.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(i * 5)).await;
            post(&url, "/v1/completions", &json!({"model": "sim-model", "prompt": words(i, 500), "max_tokens": 5, "ignore_eos": true})).await.0
        }
    });
    let kill = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        Client::new()
            .post(format!("{victim}/sim/kill"))
            .send()
            .await
            .unwrap();
    };
    let (statuses, ()) = tokio::join!(futures_util::future::join_all(load), kill);
    let failed = statuses.iter().filter(|s| **s != StatusCode::OK).count();
    assert_eq!(failed, 0, "{statuses:?}");
    // It left the candidates...
    let health: Value = reqwest::get(format!("{url}/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["healthy_backends"], 2, "{health}");
    // ...and comes back when revived.
    Client::new()
        .post(format!("{victim}/sim/revive"))
        .send()
        .await
        .unwrap();
    let mut back = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let h: Value = reqwest::get(format!("{url}/health"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if h["healthy_backends"] == 3 {
            back = true;
            break;
        }
    }
    assert!(back, "the revived backend returns");
    assert_eq!(metric(&url, "prefix_router_inflight", "").await, 0.0);
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn models_are_filtered_and_listed() {
    let a = fleet(
        SimConfig {
            model: "model-a".into(),
            time_scale: 0.0,
            ..SimConfig::default()
        },
        2,
    )
    .await;
    let b = fleet(
        SimConfig {
            model: "model-b".into(),
            time_scale: 0.0,
            ..SimConfig::default()
        },
        1,
    )
    .await;
    let mut urls = a.urls();
    urls.extend(b.urls());
    let router = router(&urls, |_| {}).await;
    let url = router.url();
    let models: Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["model-a", "model-b"]);
    for _ in 0..6 {
        let (s, v) = post(
            &url,
            "/v1/completions",
            &json!({"model": "model-b", "prompt": words(3, 100), "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["model"], "model-b");
    }
    let (s, v) = post(
        &url,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].clone()),
        (StatusCode::NOT_FOUND, json!(404))
    );
    // model-b's only backend dies: 503, not 404.
    Client::new()
        .post(format!("{}/sim/kill", b.urls()[0]))
        .send()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, v) = post(
        &url,
        "/v1/completions",
        &json!({"model": "model-b", "prompt": "x"}),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["code"], 503);
    router.running.shutdown().await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn errors_are_openai_shaped() {
    let fleet = fleet(sim(0.0), 1).await;
    let router = router(&fleet.urls(), |a| {
        a.max_body = 4096;
        a.request_timeout = Duration::from_millis(300);
    })
    .await;
    let url = router.url();
    let raw = |body: &'static str| {
        let url = url.clone();
        async move {
            let resp = Client::new()
                .post(format!("{url}/v1/chat/completions"))
                .body(body)
                .send()
                .await
                .unwrap();
            (resp.status(), resp.json::<Value>().await.unwrap())
        }
    };
    for body in ["{not json", "{\"messages\": []}", "[]", ""] {
        let (s, v) = raw(body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let big = json!({"model": "sim-model", "prompt": "x".repeat(10_000)});
    let (s, v) = post(&url, "/v1/completions", &big).await;
    assert_eq!(
        (s, v["error"]["code"].clone()),
        (StatusCode::PAYLOAD_TOO_LARGE, json!(413))
    );
    let (s, _) = post(&url, "/v1/nothing", &json!({})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // A backend that stalls past the request timeout: 504.
    let resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .header("X-Sim-Stall-Ms", "2000")
        .json(&json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
    // A backend error passes through after the retries (one backend: nothing else to try).
    let resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .header("X-Sim-Fail", "500")
        .json(&json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // Every backend gone: 502 for the request that finds out, 503 once health checks agree.
    Client::new()
        .post(format!("{}/sim/kill", fleet.urls()[0]))
        .send()
        .await
        .unwrap();
    let (s, v) = post(
        &url,
        "/v1/completions",
        &json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert!(
        s == StatusCode::BAD_GATEWAY || s == StatusCode::SERVICE_UNAVAILABLE,
        "{s} {v}"
    );
    assert!(v["error"]["message"].is_string());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(metric(&url, "prefix_router_inflight", "").await, 0.0);
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn streams_pass_through_and_a_client_leaving_cancels_upstream() {
    let config = SimConfig {
        time_scale: 1.0,
        itl_ms: 20.0,
        prefill_overhead_ms: 1.0,
        ..SimConfig::default()
    };
    let fleet = fleet(config, 1).await;
    let router = router(&fleet.urls(), |_| {}).await;
    let url = router.url();
    let body = json!({"model": "sim-model", "prompt": "tell me", "max_tokens": 500, "ignore_eos": true, "stream": true});
    let mut resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(resp.headers().contains_key("x-request-id"));
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"), "{first:?}");
    assert_eq!(
        metric(&fleet.urls()[0], "vllm:num_requests_running", "").await,
        1.0
    );
    drop(resp);
    let mut cancelled = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        if metric(&fleet.urls()[0], "vllm:num_requests_running", "").await == 0.0 {
            cancelled = true;
            break;
        }
    }
    assert!(cancelled, "the upstream request ends with the client");
    assert_eq!(metric(&url, "prefix_router_inflight", "").await, 0.0);
    assert_eq!(
        metric(
            &fleet.urls()[0],
            "vllm:request_success_total",
            "finished_reason=\"abort\""
        )
        .await,
        1.0
    );

    // A stream cut by the backend ends with an error event for the client.
    let mut resp = Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    resp.chunk().await.unwrap().unwrap();
    Client::new()
        .post(format!("{}/sim/kill", fleet.urls()[0]))
        .send()
        .await
        .unwrap();
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(c)) = resp.chunk().await {
            rest.extend_from_slice(&c);
        }
    })
    .await;
    assert!(end.is_ok(), "the cut stream ends");
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("\"error\""),
        "an error event ends the stream: {rest:?}"
    );
    assert!(!rest.contains("[DONE]"));
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn load_routed_endpoints_and_the_remote_index_store() {
    let fleet = fleet(sim(0.0), 2).await;
    // A shared string server, as several replicas would use it.
    let index_listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let index_args =
        prefix_router::index::IndexArgs::with_listen(index_listener.local_addr().unwrap());
    let index = prefix_router::index::spawn(index_args, index_listener)
        .await
        .unwrap();
    let router = router(&fleet.urls(), |a| a.index_url = Some(index.url())).await;
    let url = router.url();
    assert_eq!(router.gateway.core.store().kind(), "index");
    let (s, v) = post(
        &url,
        "/tokenize",
        &json!({"model": "sim-model", "prompt": "abcdefgh"}),
    )
    .await;
    assert_eq!((s, v["count"].clone()), (StatusCode::OK, json!(2)));
    let (s, v) = post(
        &url,
        "/v1/embeddings",
        &json!({"model": "sim-model", "input": "hi"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let system = words(5, 5000);
    for i in 0..6 {
        let (s, _) = post(
            &url,
            "/v1/chat/completions",
            &chat(&system, &format!("q{i}")),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
    }
    // Notifies go to the index in the background: wait until they have landed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let servers: Value = reqwest::get(format!("{}/v1/servers", index.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        !servers["servers"].as_array().unwrap().is_empty(),
        "{servers}"
    );
    assert_eq!(
        served(&fleet).await.iter().filter(|&&n| n >= 5.0).count(),
        1
    );
    // The index going away degrades routing to load, without client errors.
    index.shutdown().await;
    for i in 0..4 {
        let (s, _) = post(
            &url,
            "/v1/chat/completions",
            &chat(&system, &format!("later {i}")),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
    }
    assert!(
        metric(
            &url,
            "prefix_router_routing_decisions_total",
            "reason=\"store_unavailable\""
        )
        .await
            >= 4.0
    );
    assert!(metric(&url, "prefix_router_store_errors_total", "").await >= 4.0);
    router.running.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn the_config_file_is_reread_when_it_changes() {
    let fleet = fleet(sim(0.0), 2).await;
    let dir = std::env::temp_dir().join(format!("prefix-router-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.toml");
    let [a, b] = [fleet.urls()[0].clone(), fleet.urls()[1].clone()];
    std::fs::write(
        &path,
        format!("policy = \"round_robin\"\n[[backends]]\nurl = \"{a}\"\n"),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let words: Vec<String> = [
        "--listen",
        &listener.local_addr().unwrap().to_string(),
        "--config",
        path.to_str().unwrap(),
        "--health-interval",
        "100ms",
        "--metrics-interval",
        "100ms",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args = ServeArgs::from_words(&words).unwrap();
    assert_eq!(args.policy, PolicyKind::RoundRobin);
    let (running, gateway) = serve::spawn(args, listener).await.unwrap();
    let router = Router { running, gateway };
    let url = router.url();
    let health = |url: String| async move {
        reqwest::get(format!("{url}/health"))
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()["backends"]
            .clone()
    };
    assert_eq!(health(url.clone()).await, 1);
    // mtime granularity: make sure the next write is seen as a change.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    std::fs::write(&path, format!("policy = \"round_robin\"\n[[backends]]\nurl = \"{a}\"\n[[backends]]\nurl = \"{b}\"\nmodels = [\"sim-model\"]\n")).unwrap();
    let mut joined = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if health(url.clone()).await == 2 {
            joined = true;
            break;
        }
    }
    assert!(joined, "the new backend joins");
    for _ in 0..4 {
        post(
            &url,
            "/v1/completions",
            &json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}),
        )
        .await;
    }
    assert_eq!(
        served(&fleet).await,
        vec![2.0, 2.0],
        "round robin from the file"
    );
    router.running.shutdown().await;
    fleet.shutdown().await;
}
