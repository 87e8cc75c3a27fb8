//! The router in front of real vLLM servers (vLLM's CPU build, a tiny Llama with random
//! weights, a real tokenizer): prefix routing checked against vLLM's own prefix-cache counters,
//! answers equal to vLLM's, load and capacity from vLLM's metrics, a vLLM crash under load.
//!
//! The servers are shared by the tests of this file (see `common::vllm`); each test resets
//! their prefix caches and takes its turn.

mod common;

use std::time::Duration;

use common::vllm::{self, MODEL};
use common::{eventually, metric, router};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

/// Servers in the shared fleet: 0 and 1 for routing, 2 is crashed by its test.
const SERVERS: usize = 3;

/// A router in front of real vLLM servers: health checks every second with a second to
/// answer (vLLM on two busy cores can take longer than the sims' 100 ms), then `extra`.
async fn vllm_router(
    urls: &[String],
    extra: &[&str],
) -> (
    prefix_router::server::Running,
    std::sync::Arc<prefix_router::serve::Gateway>,
) {
    let mut words = vec!["--health-interval", "1s", "--unhealthy-after", "2"];
    words.extend_from_slice(extra);
    router(urls, &words).await
}

fn words(seed: u64, n: usize) -> String {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            const W: [&str; 16] = [
                "river", "stone", "light", "paper", "garden", "window", "signal", "market",
                "silver", "forest", "engine", "letter", "winter", "castle", "number", "orange",
            ];
            W[(s % 16) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

async fn reset(urls: &[String]) {
    let client = Client::new();
    for url in urls {
        let resp = client
            .post(format!("{url}/reset_prefix_cache"))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{url}: {}", resp.status());
    }
}

/// (prefix-cache hits, queries, finished requests) of one vLLM server, in tokens.
async fn counters(url: &str) -> (f64, f64, f64) {
    (
        metric(url, "vllm:prefix_cache_hits_total", "").await,
        metric(url, "vllm:prefix_cache_queries_total", "").await,
        metric(url, "vllm:request_success_total", "").await,
    )
}

async fn chat(url: &str, messages: &[Value], max_tokens: u32) -> Value {
    let resp = Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

/// Which server finished each request, and how many prompt tokens vLLM's counters say hit.
struct Recorder<'a> {
    urls: &'a [String],
    before: Vec<(f64, f64, f64)>,
    /// (group, server, hit tokens) per request.
    requests: Vec<(usize, usize, f64)>,
    hits: f64,
    queries: f64,
}

impl<'a> Recorder<'a> {
    async fn new(urls: &'a [String]) -> Self {
        let mut before = Vec::new();
        for u in urls {
            before.push(counters(u).await);
        }
        Self {
            urls,
            before,
            requests: Vec::new(),
            hits: 0.0,
            queries: 0.0,
        }
    }

    async fn record(&mut self, group: usize, answer: &Value) {
        let mut now = Vec::new();
        for u in self.urls {
            now.push(counters(u).await);
        }
        let served: Vec<usize> = (0..self.urls.len())
            .filter(|&i| now[i].2 > self.before[i].2)
            .collect();
        assert_eq!(served.len(), 1, "one server finished the request");
        let s = served[0];
        let hits = now[s].0 - self.before[s].0;
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .unwrap();
        assert_eq!(hits, cached, "vLLM's counter and the answer agree");
        self.hits += hits;
        self.queries += now[s].1 - self.before[s].1;
        self.requests.push((group, s, hits));
        self.before = now;
    }
}

impl Recorder<'_> {
    /// Each group of [`run_workload`] (and its conversation) stayed on the server that took
    /// its first request, where vLLM counted its shared prefix as hits.
    fn assert_groups_stay_where_they_hit(&self) {
        let mut first_server: [Option<usize>; 4] = [None; 4];
        for &(group, server, hits) in &self.requests {
            match first_server[group] {
                None => first_server[group] = Some(server),
                Some(first) => {
                    assert_eq!(server, first, "group {group} stays on its server");
                    // A group's system prompt (700 words) is at least 21 blocks of 32
                    // tokens; a conversation's previous turn at least 8.
                    let floor = if group < 3 { 21.0 * 32.0 } else { 8.0 * 32.0 };
                    assert!(hits >= floor, "group {group}: {hits} tokens hit");
                }
            }
        }
    }
}

/// The routing test's requests, one at a time: 3 groups of 4 questions under a long system
/// prompt each, then a 4-turn conversation (each turn appends vLLM's answer).
async fn run_workload(router: &str, recorder: &mut Recorder<'_>) {
    for group in 0..3u64 {
        let system = json!({"role": "system", "content": words(100 + group, 700)});
        for q in 0..4u64 {
            let messages = [
                system.clone(),
                json!({"role": "user", "content": words(1000 + group * 10 + q, 20)}),
            ];
            let answer = chat(router, &messages, 4).await;
            recorder.record(group as usize, &answer).await;
        }
    }
    let mut conversation = vec![json!({"role": "system", "content": words(7, 300)})];
    for turn in 0..4u64 {
        conversation.push(json!({"role": "user", "content": words(70 + turn, 60)}));
        let answer = chat(router, &conversation, 16).await;
        recorder.record(3, &answer).await;
        conversation.push(answer["choices"][0]["message"].clone());
    }
}

/// Prefix routing sends each group's and each conversation's requests to one server, where
/// vLLM's own counters show the prefix-cache hits; round robin on the same requests hits less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_routing_lands_where_vllm_counts_the_hits() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let _turn = vllm::TURN.lock().await;
    let urls = &fleet.urls[..2];
    let mut hit_rates = Vec::new();
    for policy in ["prefix_load", "round_robin"] {
        reset(urls).await;
        let (r, _) = vllm_router(urls, &["--policy", policy]).await;
        let mut recorder = Recorder::new(urls).await;
        run_workload(&r.url(), &mut recorder).await;
        hit_rates.push(recorder.hits / recorder.queries);
        eprintln!("{policy}: hit rate {:.3}", recorder.hits / recorder.queries);
        if policy == "prefix_load" {
            recorder.assert_groups_stay_where_they_hit();
        }
        r.shutdown().await;
    }
    assert!(
        hit_rates[0] > hit_rates[1] + 0.1,
        "prefix_load {:.3} vs round_robin {:.3}",
        hit_rates[0],
        hit_rates[1]
    );
}

/// The endpoint picker behind a gateway (this test's minimal ext_proc gateway) places the same
/// workload as `serve`: each group and the conversation stay on one vLLM server, where vLLM's
/// counters show the hits, and answers pass through the picker intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_picker_lands_where_vllm_counts_the_hits() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let _turn = vllm::TURN.lock().await;
    let urls = &fleet.urls[..2];
    reset(urls).await;
    let picker =
        common::envoy::picker(urls, &["--health-interval", "1s", "--unhealthy-after", "2"]).await;
    let gateway = common::envoy::proxy(picker.grpc_url()).await;
    let http = picker.http.url();
    assert!(
        eventually(60, || async {
            metric(&http, "prefix_router_backend_healthy", "").await == 2.0
        })
        .await
    );
    let mut recorder = Recorder::new(urls).await;
    run_workload(&gateway, &mut recorder).await;
    recorder.assert_groups_stay_where_they_hit();
    let rate = recorder.hits / recorder.queries;
    eprintln!("epp: hit rate {rate:.3}");
    assert!(rate > 0.5, "hit rate {rate:.3}");
    assert_eq!(
        metric(&http, "prefix_router_requests_total", "status=\"200\"").await,
        recorder.requests.len() as f64
    );
}

/// Every vLLM metric the Grafana dashboard queries is one real vLLM exposes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboards_vllm_metrics_exist_on_real_vllm() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let exposed = common::dashboard::exposed(&[common::metrics_text(&fleet.urls[0]).await]);
    let wanted: Vec<String> = common::dashboard::queried_metrics()
        .into_iter()
        .filter(|m| m.starts_with("vllm:"))
        .collect();
    assert!(!wanted.is_empty());
    let missing: Vec<&String> = wanted.iter().filter(|m| !exposed.contains(*m)).collect();
    assert!(missing.is_empty(), "not on real vLLM: {missing:?}");
}

/// What a client gets through the router equals what vLLM answers directly: the generated text
/// and the usage, streamed and not, chat and completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_through_the_router_equal_vllms_own() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let _turn = vllm::TURN.lock().await;
    let server = &fleet.urls[0];
    let (r, _) = vllm_router(std::slice::from_ref(server), &[]).await;
    let prompt = words(42, 200);
    let bodies = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}),
        ),
    ];
    for (path, body) in bodies {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            let mut got = Vec::new();
            for base in [server.clone(), r.url()] {
                reset(std::slice::from_ref(server)).await;
                let resp = Client::new()
                    .post(format!("{base}{path}"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), StatusCode::OK);
                let content_type = resp.headers()["content-type"].to_str().unwrap().to_owned();
                got.push((content_type, content(&resp.text().await.unwrap(), stream)));
            }
            assert_eq!(got[0], got[1], "{path} stream={stream}");
            assert!(!got[0].1 .0.is_empty());
        }
    }
    r.shutdown().await;
}

/// The generated text and the usage of an answer (the ids and times differ per request).
fn content(body: &str, stream: bool) -> (String, Value) {
    let pieces: Vec<Value> = if stream {
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    } else {
        vec![serde_json::from_str(body).unwrap()]
    };
    let mut text = String::new();
    let mut usage = Value::Null;
    for p in &pieces {
        for choice in p["choices"].as_array().into_iter().flatten() {
            for field in [
                &choice["text"],
                &choice["message"]["content"],
                &choice["delta"]["content"],
            ] {
                if let Some(t) = field.as_str() {
                    text.push_str(t);
                }
            }
        }
        if !p["usage"].is_null() {
            usage = p["usage"].clone();
        }
    }
    (text, usage)
}

/// The router reads vLLM's `/metrics`: the KV cache size becomes the index capacity, and the
/// running requests its load; models come from vLLM's `/v1/models`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_capacity_and_models_come_from_vllm() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let _turn = vllm::TURN.lock().await;
    let server = fleet.urls[0].clone();
    let (r, gw) = vllm_router(std::slice::from_ref(&server), &[]).await;
    let backend = || gw.core.fleet.all()[0].clone();
    // 512 blocks × 32 tokens × 4 bytes ÷ 128-byte chunks.
    assert!(
        eventually(10, || async {
            backend()
                .capacity
                .load(std::sync::atomic::Ordering::Relaxed)
                == 512
        })
        .await
    );
    let models: Value = reqwest::get(format!("{}/v1/models", r.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    let (status, _) = {
        let resp = Client::new()
            .post(format!("{}/v1/completions", r.url()))
            .json(&json!({"model": "no-such-model", "prompt": "x"}))
            .send()
            .await
            .unwrap();
        (resp.status(), ())
    };
    assert_eq!(status, StatusCode::NOT_FOUND);
    // A long generation shows as running in vLLM's metrics, and so in the router's view.
    let long = tokio::spawn({
        let url = r.url();
        async move {
            Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": "count", "max_tokens": 1500, "ignore_eos": true}))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    // What vLLM itself reports is read beside the router's view, so a failure says which side
    // missed it (a scrape of a busy CPU server can time out; the next one is a second later).
    let vllm_saw = std::sync::atomic::AtomicU64::new(0);
    let reached = eventually(60, || async {
        let running = metric(&server, "vllm:num_requests_running", "").await as u64;
        vllm_saw.fetch_max(running, std::sync::atomic::Ordering::Relaxed);
        backend()
            .reported_running
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    })
    .await;
    assert!(
        reached,
        "vllm:num_requests_running never reached the router (vLLM reported up to {}; the long \
         request had ended: {})",
        vllm_saw.into_inner(),
        long.is_finished()
    );
    assert!(backend().kv_usage() > 0.0);
    assert_eq!(long.await.unwrap(), StatusCode::OK);
    r.shutdown().await;
}

/// A vLLM server killed under load costs no client error: requests that had not begun
/// answering are retried on the other server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_crash_under_load_costs_no_client_error() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    if fleet.external {
        eprintln!("skipping: a fleet started by hand cannot be crashed from here");
        return;
    }
    let _turn = vllm::TURN.lock().await;
    let (survivor, victim) = (fleet.urls[0].clone(), fleet.urls[2].clone());
    let (r, _) = vllm_router(
        &[survivor.clone(), victim.clone()],
        &["--policy", "round_robin"],
    )
    .await;
    let url = r.url();
    let load = (0..40u64).map(|i| {
        let url = url.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(i * 50)).await;
            Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": words(i, 100), "max_tokens": 40, "ignore_eos": true}))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let crash = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        fleet.crash(2).await.unwrap();
    };
    let (statuses, ()) = tokio::join!(futures_util::future::join_all(load), crash);
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert!(
        metric(&survivor, "vllm:request_success_total", "").await >= 20.0,
        "the survivor took the victim's share"
    );
    r.shutdown().await;
}

/// vLLM's KV-cache events, decoded and indexed by token blocks, say exactly what vLLM then
/// reports as cached: the ground truth the oracle (and precise routing) stands on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_tell_what_vllm_holds() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    if fleet.external {
        eprintln!("skipping: the KV-event endpoints of a fleet started by hand are not known");
        return;
    }
    let _turn = vllm::TURN.lock().await;
    let urls = &fleet.urls[..2];
    let view = prefix_bench::oracle::EventView::start(&fleet.kv_events[..2], 32)
        .await
        .unwrap();
    reset(urls).await;
    let client = Client::new();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": words(5, 400)}], "max_tokens": 2});
    let tokens = prefix_bench::oracle::tokenize(&client, &urls[0], &body)
        .await
        .unwrap();
    assert!(tokens.len() > 256, "{}", tokens.len());
    assert_eq!(view.cached(&tokens, 2), vec![0, 0]);
    // Server 1 computes the prompt; its events say it holds it.
    chat(&urls[1], body["messages"].as_array().unwrap(), 2).await;
    let expected = (tokens.len() as u64 - 1) / 32 * 32;
    assert!(
        eventually(10, || async {
            view.cached(&tokens, 2) == vec![0, expected]
        })
        .await,
        "{:?} vs {expected}",
        view.cached(&tokens, 2)
    );
    // vLLM's own answer to the same prompt agrees.
    let again = chat(&urls[1], body["messages"].as_array().unwrap(), 2).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        expected
    );
    // A reset clears it. vLLM publishes the AllBlocksCleared event with the next scheduler
    // step, so a small request follows the reset.
    reset(urls).await;
    chat(&urls[1], &[json!({"role": "user", "content": "hi"})], 1).await;
    assert!(eventually(10, || async { view.cached(&tokens, 2) == vec![0, 0] }).await);
    assert_eq!(view.skipped.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// Precise mode on vLLM itself: a prompt computed by a server the router never sent it to is
/// found through that server's KV events, the router sends the next request with that prefix
/// there, and vLLM's own counters show the hit; a reset moves the prompt's pull away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_routing_follows_vllms_events() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    if fleet.external {
        eprintln!("skipping: the KV-event endpoints of a fleet started by hand are not known");
        return;
    }
    let _turn = vllm::TURN.lock().await;
    let urls = &fleet.urls[..2];
    let config = std::env::temp_dir().join(format!("real-precise-{}.toml", std::process::id()));
    let mut text = String::new();
    for (url, events) in urls.iter().zip(&fleet.kv_events) {
        text.push_str(&format!(
            "[[backends]]\nurl = {url:?}\nkv-events = {events:?}\n"
        ));
    }
    std::fs::write(&config, text).unwrap();
    let tokenizer = format!("{MODEL}={}", fleet.model_dir.display());
    let (r, _) = vllm_router(
        &[],
        &[
            "--config",
            config.to_str().unwrap(),
            "--kv-events",
            "--tokenizer",
            &tokenizer,
        ],
    )
    .await;
    let url = r.url();
    // Emptied caches are known exactly once vLLM says so (with its next scheduler step).
    reset(urls).await;
    for u in urls {
        chat(u, &[json!({"role": "user", "content": "hi"})], 1).await;
    }
    assert!(
        eventually(20, || async {
            metric(&url, "prefix_router_kv_event_feeds", "state=\"live\"").await == 2.0
        })
        .await,
        "both feeds live after the reset"
    );
    // Server 1 computes a long system prompt, asked directly.
    let system = json!({"role": "system", "content": words(31, 700)});
    chat(
        &urls[1],
        &[system.clone(), json!({"role": "user", "content": "first"})],
        2,
    )
    .await;
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_kv_blocks", "").await >= 20.0
        })
        .await
    );
    let mut recorder = Recorder::new(urls).await;
    let answer = chat(
        &url,
        &[system.clone(), json!({"role": "user", "content": "second"})],
        2,
    )
    .await;
    recorder.record(0, &answer).await;
    assert_eq!(
        recorder.requests[0].1, 1,
        "routed to the server that holds the prompt"
    );
    assert!(recorder.requests[0].2 >= 640.0, "{:?}", recorder.requests);
    assert_eq!(
        metric(
            &url,
            "prefix_router_routing_decisions_total",
            "policy=\"cost\",reason=\"cost_hit\",index=\"events\""
        )
        .await,
        1.0
    );
    // vLLM empties server 1's cache: its events say so and the router forgets the prompt.
    reset(&urls[1..]).await;
    chat(&urls[1], &[json!({"role": "user", "content": "hi"})], 1).await;
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_kv_events_total", "kind=\"cleared\"").await >= 3.0
        })
        .await
    );
    assert_eq!(
        metric(&url, "prefix_router_tokenize_fallbacks_total", "").await,
        0.0
    );
    assert_eq!(
        metric(&url, "prefix_router_kv_events_total", "kind=\"skipped\"").await,
        0.0
    );
    let _ = std::fs::remove_file(config);
}

/// A router started while vLLM is running asks each publisher's replay socket for what it
/// published before (vLLM's `replay_endpoint`, libzmq's ROUTER against our DEALER): it knows
/// the servers' caches at once, without a warm-up and without resetting them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_joins_late_replays_what_vllm_published() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    if fleet.external {
        eprintln!("skipping: the replay endpoints of a fleet started by hand are not known");
        return;
    }
    let _turn = vllm::TURN.lock().await;
    let urls = &fleet.urls[..2];
    // Server 0 computes a long system prompt before the router exists.
    let system = json!({"role": "system", "content": words(47, 700)});
    chat(
        &urls[0],
        &[system.clone(), json!({"role": "user", "content": "first"})],
        2,
    )
    .await;
    let config = std::env::temp_dir().join(format!("real-replay-{}.toml", std::process::id()));
    let mut text = String::new();
    for ((url, events), replay) in urls.iter().zip(&fleet.kv_events).zip(&fleet.kv_replay) {
        text.push_str(&format!(
            "[[backends]]\nurl = {url:?}\nkv-events = {events:?}\nkv-replay = {replay:?}\n"
        ));
    }
    std::fs::write(&config, text).unwrap();
    let tokenizer = format!("{MODEL}={}", fleet.model_dir.display());
    let (r, _) = vllm_router(
        &[],
        &[
            "--config",
            config.to_str().unwrap(),
            "--kv-events",
            "--kv-warmup",
            "1h",
            "--tokenizer",
            &tokenizer,
        ],
    )
    .await;
    let url = r.url();
    assert!(
        eventually(20, || async {
            metric(&url, "prefix_router_kv_event_feeds", "state=\"live\"").await == 2.0
        })
        .await,
        "both feeds live without the hour's warm-up; replays: {} filled, {} lost, {} failed",
        metric(
            &url,
            "prefix_router_kv_event_replays_total",
            "outcome=\"filled\""
        )
        .await,
        metric(
            &url,
            "prefix_router_kv_event_replays_total",
            "outcome=\"lost\""
        )
        .await,
        metric(
            &url,
            "prefix_router_kv_event_replays_total",
            "outcome=\"failed\""
        )
        .await,
    );
    let mut recorder = Recorder::new(urls).await;
    let answer = chat(
        &url,
        &[system.clone(), json!({"role": "user", "content": "second"})],
        2,
    )
    .await;
    recorder.record(0, &answer).await;
    assert_eq!(
        recorder.requests[0].1, 0,
        "routed to the server that computed the prompt before the router started"
    );
    assert!(recorder.requests[0].2 >= 640.0, "{:?}", recorder.requests);
    assert_eq!(
        metric(
            &url,
            "prefix_router_routing_decisions_total",
            "policy=\"cost\",reason=\"cost_hit\",index=\"events\""
        )
        .await,
        1.0
    );
    let _ = std::fs::remove_file(config);
}

/// Requests the router-side tokenizer must turn into exactly vLLM's token ids.
fn tokenizer_corpus() -> Vec<Value> {
    let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather at a place", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let long = words(11, 3000);
    vec![
        json!({"messages": [{"role": "user", "content": "Hello there, how are you?"}]}),
        json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three rivers."},
            {"role": "assistant", "content": "Nile, Amazon, Danube."},
            {"role": "user", "content": "And three mountains?"},
        ]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " and part two"}]}]}),
        json!({"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}),
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}),
        json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "bare"}}]}),
        json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, clear"},
            {"role": "user", "content": "Thanks!"},
        ], "tools": [tool]}),
        json!({"messages": [{"role": "user", "content": "Grüße aus München — 東京 🌸 مرحبا"}]}),
        json!({"messages": [{"role": "user", "content": long}]}),
        json!({"messages": [{"role": "user", "name": "alice", "content": "Hi, I'm Alice"}]}),
        json!({"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": false}),
        json!({"messages": [{"role": "user", "content": "  leading and trailing spaces \n\n"}]}),
        json!({"messages": [{"role": "user", "content": "<s> looks special </s>"}]}),
        json!({"prompt": "Once upon a time"}),
        json!({"prompt": "Grüße 東京 🌸 and some\nnewlines\n"}),
        json!({"prompt": long}),
        json!({"prompt": [415, 2936, 9060, 285, 1142]}),
    ]
    .into_iter()
    .chain((0..40).map(|i| json!({"prompt": awkward_text(i)})))
    .collect()
}

/// Text with what tokenizers split differently: runs of spaces, tabs and newlines, code,
/// punctuation, digits, non-Latin scripts and emoji.
fn awkward_text(seed: u64) -> String {
    const PIECES: [&str; 24] = [
        " ",
        "  ",
        "    ",
        "\t",
        "\n",
        "\n\n",
        " \n ",
        "fn main() {",
        "}",
        "x = 1;",
        "==",
        "->",
        "naïve",
        "東京",
        "🌸",
        "مرحبا",
        "12345",
        "3.14",
        "...",
        "'s",
        "—",
        "river",
        "Stone",
        "ABC",
    ];
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..60)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            PIECES[(s % PIECES.len() as u64) as usize]
        })
        .collect()
}

/// Our rendering and tokenization (the model's own template and tokenizer files, loaded by
/// `vllm_protocol::ChatTokenizer`) give vLLM's token ids on every request of the corpus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_side_tokenization_equals_vllms() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let tokenizer = vllm_protocol::ChatTokenizer::from_dir(&fleet.model_dir).unwrap();
    let client = Client::new();
    for body in tokenizer_corpus() {
        let mut request = body.clone();
        request["model"] = json!(MODEL);
        if body["prompt"].is_array() {
            // vLLM takes token-id prompts as they are (its /tokenize has no such form).
            let ids: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
            assert_eq!(tokenizer.prompt_ids(&body["prompt"]).unwrap(), ids);
            continue;
        }
        let theirs: Value = client
            .post(format!("{}/tokenize", fleet.urls[0]))
            .json(&request)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let theirs: Vec<u32> = serde_json::from_value(theirs["tokens"].clone())
            .unwrap_or_else(|_| panic!("vLLM's answer to {body}: {theirs}"));
        let ours = if body.get("messages").is_some() {
            tokenizer.chat_ids(&body)
        } else {
            tokenizer.prompt_ids(&body["prompt"])
        }
        .unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(ours, theirs, "{body}");
    }
}

/// The simulator with the model's tokenizer (`--tokenizer`) and vLLM's block size counts
/// prompt and cached tokens exactly as vLLM does, request by request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sim_with_vllms_tokenizer_counts_tokens_as_vllm() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let _turn = vllm::TURN.lock().await;
    let server = fleet.urls[0].clone();
    let sims = common::fleet(
        vllm_sim::SimConfig {
            model: MODEL.into(),
            block_size: 32,
            kv_blocks: 512,
            tokenizer: Some(fleet.model_dir.clone()),
            ..common::instant()
        },
        1,
    )
    .await;
    let sim = sims.urls()[0].clone();
    let client = Client::new();
    for body in tokenizer_corpus() {
        if body["prompt"].is_array() {
            continue;
        }
        let mut request = body.clone();
        request["model"] = json!(MODEL);
        let mut counts = Vec::new();
        for base in [&server, &sim] {
            let v: Value = client
                .post(format!("{base}/tokenize"))
                .json(&request)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            counts.push(v["tokens"].clone());
        }
        assert_eq!(counts[0], counts[1], "{body}");
    }
    // The same requests, one at a time, on empty caches: equal usage, cached tokens included.
    reset(std::slice::from_ref(&server)).await;
    client
        .post(format!("{sim}/sim/reset"))
        .send()
        .await
        .unwrap();
    let system = words(21, 500);
    for i in 0..6u64 {
        let messages = [
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": words(300 + i % 3, 40)}),
        ];
        let theirs = chat(&server, &messages, 1).await;
        let ours = chat(&sim, &messages, 1).await;
        for key in ["prompt_tokens", "prompt_tokens_details"] {
            let field = |v: &Value| {
                let mut f = v["usage"][key].clone();
                if let Some(o) = f.as_object_mut() {
                    o.retain(|k, _| k == "cached_tokens");
                }
                f
            };
            assert_eq!(field(&ours), field(&theirs), "request {i}: {key}");
        }
    }
    sims.shutdown().await;
}

/// Japanese text of about `bytes` bytes (vLLM's tokenizer here gives ~2.6 bytes a token, far
/// from the 4 the router assumes before it learns).
fn japanese(seed: u64, bytes: usize) -> String {
    const PHRASES: [&str; 12] = [
        "東京の天気は晴れです。",
        "明日も良い天気でしょう。",
        "駅までは歩いて十分です。",
        "新しい本を買いました。",
        "会議は午後三時からです。",
        "猫が窓の外を見ています。",
        "富士山はとても高い山です。",
        "日曜日に友達と映画を見ました。",
        "この料理はとても美味しい。",
        "電車が少し遅れています。",
        "図書館は九時に開きます。",
        "春には桜が咲きます。",
    ];
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    while out.len() < bytes {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.push_str(PHRASES[(s % 12) as usize]);
    }
    out
}

/// The index is sized from vLLM's real tokens per byte: after some answers (streamed with usage
/// and not), the router's capacity for a backend is within 20% of the request text vLLM's
/// cache really holds, where the fixed 4 bytes a token is far off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_capacity_follows_vllms_bytes_per_token() {
    let Some(fleet) = vllm::shared(SERVERS).await else {
        return;
    };
    let _turn = vllm::TURN.lock().await;
    let server = fleet.urls[0].clone();
    let (r, gw) = vllm_router(
        std::slice::from_ref(&server),
        &["--metrics-interval", "200ms"],
    )
    .await;
    let client = Client::new();
    let (mut bytes, mut tokens) = (0u64, 0u64);
    for i in 0..16u64 {
        let prompt = japanese(i, 1500);
        let stream = i % 2 == 1;
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": stream});
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let resp = client
            .post(format!("{}/v1/completions", r.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.bytes().await.unwrap();
        let counted: Value = client
            .post(format!("{server}/tokenize"))
            .json(&json!({"model": MODEL, "prompt": prompt}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        // The router's request string: the model name, a newline, the prompt.
        bytes += (MODEL.len() + 1 + prompt.len()) as u64;
        tokens += counted["count"].as_u64().unwrap();
    }
    let true_ratio = bytes as f64 / tokens as f64;
    let cache_tokens = 512.0 * 32.0;
    let truth = cache_tokens * true_ratio / 128.0;
    let backend = gw.core.fleet.all()[0].clone();
    let capacity = || backend.capacity.load(std::sync::atomic::Ordering::Relaxed) as f64;
    let assumed = cache_tokens * 4.0 / 128.0;
    eprintln!(
        "bytes per token: true {true_ratio:.2}, learned {:.2}; capacity: true {truth:.0} chunks, \
         assumed at 4 bytes/token {assumed:.0}",
        backend.bytes_per_token()
    );
    assert!(
        eventually(10, || async { (capacity() - truth).abs() / truth <= 0.2 }).await,
        "learned capacity {} vs {truth:.0}",
        capacity()
    );
    eprintln!(
        "capacity learned: {:.0} chunks ({:+.1}% of the truth; assumed {:+.1}%)",
        capacity(),
        (capacity() - truth) / truth * 100.0,
        (assumed - truth) / truth * 100.0
    );
    assert!(
        (assumed - truth).abs() / truth > 0.2,
        "the workload must be far from 4 bytes a token"
    );
    r.shutdown().await;
}
