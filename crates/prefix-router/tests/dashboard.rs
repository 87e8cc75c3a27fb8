//! deploy/grafana/prefix-router.json: the dashboard is valid JSON, and every metric its panels
//! query exists on a running router (with the features its panels show switched on) or on the
//! simulated vLLM servers behind it; the real-vLLM tier checks the vLLM metrics against real
//! vLLM (tests/real_vllm.rs).

mod common;

use std::collections::BTreeSet;

use common::dashboard::{dashboard, exposed, metric_names, queried_metrics};
use common::{fleet, metrics_text, router, text};
use serde_json::json;

#[test]
fn the_dashboard_is_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "prefix-router");
    let panels = d["panels"].as_array().unwrap();
    let mut titles = BTreeSet::new();
    for p in panels {
        assert!(
            titles.insert(p["title"].as_str().unwrap()),
            "duplicate title"
        );
        let g = &p["gridPos"];
        assert!(g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24);
    }
    // What the dashboard is for: requests, errors, TTFT, hit rate, decisions, backends, index,
    // store, events, queue.
    let names = queried_metrics();
    for needed in [
        "prefix_router_requests_total",
        "prefix_router_ttft_seconds_bucket",
        "vllm:prefix_cache_hits_total",
        "prefix_router_routing_decisions_total",
        "prefix_router_backend_healthy",
        "prefix_router_index_entries",
        "prefix_router_store_errors_total",
        "prefix_router_kv_event_feeds",
        "prefix_router_queue_depth",
    ] {
        assert!(names.contains(needed), "no panel shows {needed}");
    }
    assert_eq!(
        metric_names(r#"sum(rate(vllm:prefix_cache_hits_total{job=~"$j"}[5m])) / x_y"#),
        ["vllm:prefix_cache_hits_total"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_a_panel_queries_exists() {
    // Sims that publish no KV events: the router's feeds exist (and say they are down).
    let sims = fleet(common::instant(), 2).await;
    let urls = sims.urls();
    let keys = std::env::temp_dir().join(format!("dashboard-keys-{}.toml", std::process::id()));
    std::fs::write(&keys, "[tenants.team]\nkeys = [\"team-key-123\"]\n").unwrap();
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string()
    };
    let bus = format!("nats://127.0.0.1:{}", free_port());
    let bus_key = common::bus_key_file();
    let events_port = free_port();
    let (r, _) = router(
        &urls,
        &[
            "--kv-events",
            "--kv-events-port",
            &events_port,
            "--policy",
            "cost",
            "--max-queue-wait",
            "10s",
            "--api-keys-file",
            &keys.display().to_string(),
            "--replica-bus",
            &bus,
            "--replica-bus-key-file",
            &bus_key,
        ],
    )
    .await;
    let url = r.url();
    let client = reqwest::Client::new();
    for i in 0..4 {
        let mut resp = client
            .post(format!("{url}/v1/completions"))
            .bearer_auth("team-key-123")
            .json(&json!({"model": "sim-model", "prompt": text(i % 2, 2_000), "max_tokens": 2, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        while let Ok(Some(_)) = resp.chunk().await {}
    }
    let wanted = queried_metrics();
    let missing = |texts: &[String]| -> Vec<String> {
        let have = exposed(texts);
        wanted
            .iter()
            .filter(|m| !have.contains(*m))
            .cloned()
            .collect()
    };
    // Gauges refreshed on scrape and event feeds going live take a moment.
    let mut texts = Vec::new();
    for _ in 0..100 {
        texts.clear();
        texts.push(metrics_text(&url).await);
        for u in &urls {
            texts.push(metrics_text(u).await);
        }
        if missing(&texts).is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let found = missing(&texts).is_empty();
    std::fs::remove_file(&keys).unwrap();
    assert!(
        found,
        "metrics no running component exposes: {:?}",
        missing(&texts)
    );
}
