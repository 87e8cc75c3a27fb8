//! Precise mode (`--kv-events`) in front of simulated vLLM servers that publish KV-cache
//! events as vLLM does and tokenize with the real-vLLM fleet's tokenizer: the router matches by
//! what each server really holds — also what reached it without the router — and falls back to
//! the string index for a backend without events.

mod common;

use common::{eventually, metric};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use vllm_sim::SimConfig;

const MODEL: &str = "tiny-llama";

/// The real-vLLM model directory (tokenizer and chat template), written when missing; None
/// (skip) outside CI when the vLLM environment is not installed.
async fn model_dir() -> Option<std::path::PathBuf> {
    let installed = std::env::var_os("HOME").is_some_and(|h| {
        std::path::Path::new(&h)
            .join(".cache/prefix-router/vllm-venv/.requirements")
            .exists()
    });
    if !installed && std::env::var_os("PREFIX_ROUTER_CI").is_none() {
        eprintln!("skipping: no vLLM environment for the tokenizer (scripts/vllm-venv.sh)");
        return None;
    }
    let python = prefix_bench::vllm_fleet::python().await.unwrap();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("precise-model");
    Some(
        prefix_bench::vllm_fleet::model_dir(&python, &dir)
            .await
            .unwrap(),
    )
}

fn words(seed: u64, n: usize) -> String {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            [
                "river", "stone", "light", "paper", "garden", "window", "signal", "market",
            ][(s % 8) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

async fn chat(url: &str, system: &str, question: &str) -> Value {
    let resp = Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

async fn finished(url: &str) -> f64 {
    metric(url, "vllm:request_success_total", "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_matches_follow_what_each_server_really_holds() {
    let Some(dir) = model_dir().await else {
        return;
    };
    let sims = common::fleet(
        SimConfig {
            model: MODEL.into(),
            block_size: 32,
            kv_blocks: 512,
            tokenizer: Some(dir.clone()),
            kv_events: true,
            ..common::instant()
        },
        3,
    )
    .await;
    let urls = sims.urls();
    let endpoints = sims.kv_events();
    let replay = sims.servers[1].kv_replay.clone().unwrap();
    // Two backends publish events (the second with a replay socket); the third does not (the
    // string index answers for it).
    let config = std::env::temp_dir().join(format!("precise-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        format!(
            "[[backends]]\nurl = \"{}\"\nkv-events = \"{}\"\n\n[[backends]]\nurl = \"{}\"\nkv-events = \"{}\"\nkv-replay = \"{replay}\"\n\n[[backends]]\nurl = \"{}\"\nkv-events = \"tcp://127.0.0.1:1\"\n",
            urls[0], endpoints[0], urls[1], endpoints[1], urls[2]
        ),
    )
    .unwrap();
    let tokenizer = format!("{MODEL}={}", dir.display());
    let (r, _) = common::router(
        &[],
        &[
            "--config",
            config.to_str().unwrap(),
            "--kv-events",
            "--tokenizer",
            &tokenizer,
            "--kv-warmup",
            "0s",
        ],
    )
    .await;
    let url = r.url();
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_kv_event_feeds", "state=\"live\"").await == 2.0
        })
        .await,
        "both publishers are followed"
    );
    assert_eq!(
        metric(
            &url,
            "prefix_router_kv_event_replays_total",
            "outcome=\"filled\""
        )
        .await,
        1.0,
        "the replay socket asked at connection (nothing published yet: nothing missed)"
    );

    // A prompt sent straight to server 1, past the router: only its events tell.
    let system = words(1, 600);
    chat(&urls[1], &system, "first question").await;
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_kv_blocks", "").await > 0.0
        })
        .await
    );
    let before: Vec<f64> = futures_util::future::join_all(urls.iter().map(|u| finished(u))).await;
    let answer = chat(&url, &system, "second question").await;
    // A server counts a request as finished just after answering it.
    assert!(
        eventually(5, || async { finished(&urls[1]).await - before[1] == 1.0 }).await,
        "routed to the server that holds the prompt"
    );
    for i in [0, 2] {
        assert_eq!(finished(&urls[i]).await, before[i]);
    }
    assert!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 256,
        "{answer}"
    );
    assert_eq!(
        metric(
            &url,
            "prefix_router_routing_decisions_total",
            "policy=\"cost\",reason=\"cost_hit\",index=\"events\""
        )
        .await,
        1.0
    );

    // The server empties its cache: its events say so, and the prompt no longer pulls there.
    Client::new()
        .post(format!("{}/sim/reset", urls[1]))
        .send()
        .await
        .unwrap();
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_kv_blocks", "").await == 0.0
        })
        .await,
        "the cleared cache leaves the index"
    );
    assert_eq!(
        metric(&url, "prefix_router_kv_events_total", "kind=\"cleared\"").await,
        1.0
    );

    // Server 2 publishes no events: its matches come from the string index, in the same unit.
    // New prompts until one lands there (placed by load), then a sibling follows it.
    let strings_hits = "policy=\"cost\",reason=\"cost_hit\",index=\"strings\"";
    let mut landed = None;
    for seed in 10..20 {
        let prompt = words(seed, 600);
        let before = finished(&urls[2]).await;
        chat(&url, &prompt, "q0").await;
        let on_2 = eventually(1, || async { finished(&urls[2]).await > before }).await;
        if on_2 {
            landed = Some(prompt);
            break;
        }
    }
    let prompt = landed.expect("placement by load reaches every backend");
    let before = finished(&urls[2]).await;
    chat(&url, &prompt, "q1").await;
    assert!(
        eventually(5, || async { finished(&urls[2]).await == before + 1.0 }).await,
        "the sibling follows the string index's match"
    );
    assert_eq!(
        metric(&url, "prefix_router_routing_decisions_total", strings_hits).await,
        1.0
    );
    assert_eq!(
        metric(&url, "prefix_router_tokenize_fallbacks_total", "").await,
        0.0,
        "every request was tokenized"
    );

    // A rendering the router cannot reproduce (a template in the request) is not guessed: the
    // request is matched by strings, counted, and sent on (the sim, rendering with the same
    // code, refuses such a request as 400; vLLM would render it).
    let decided = metric(&url, "prefix_router_routing_decisions_total", "").await;
    let resp = Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "max_tokens": 2,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
            "messages": [{"role": "user", "content": words(3, 50)}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::BAD_REQUEST,
        "the backend's answer"
    );
    assert_eq!(
        metric(
            &url,
            "prefix_router_tokenize_fallbacks_total",
            "reason=\"unsupported\""
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&url, "prefix_router_routing_decisions_total", "").await,
        decided + 1.0,
        "routed all the same"
    );
}
