//! `prefix-router bench`: a small comparison end to end (sims in-process, our router as
//! processes of the real binary), and a trace written and replayed.

mod common;

use clap::Parser;
use common::{fleet, instant};
use prefix_bench::{CompareArgs, RunArgs};
use serde_json::Value;

#[derive(Parser)]
struct Compare {
    #[command(flatten)]
    args: CompareArgs,
}

#[derive(Parser)]
struct Run {
    #[command(flatten)]
    args: RunArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_comparison_ranks_prefix_routing_above_round_robin() {
    let out = std::env::temp_dir().join(format!("prefix-bench-test-{}", std::process::id()));
    let trace = out.join("sent.jsonl");
    let out_s = out.to_string_lossy().into_owned();
    let trace_s = trace.to_string_lossy().into_owned();
    let args = Compare::parse_from([
        "compare",
        "--sim-servers",
        "3",
        "--sim-args=--kv-blocks 600 --time-scale 0.2",
        "--groups",
        "9",
        "--prompts-per-group",
        "6",
        "--system-len",
        "512",
        "--question-len",
        "32",
        "--output-len",
        "8",
        "--qps",
        "60",
        "--systems",
        "round_robin,prefix_load,oracle,smg",
        "--peers-venv",
        "/nonexistent",
        "--overhead-requests",
        "50",
        "--overhead-qps",
        "200",
        "--throughput-secs",
        "0.5",
        "--out",
        &out_s,
        "--write-trace",
        &trace_s,
        "--rounds",
        "2",
    ])
    .args;
    let results = prefix_bench::compare(args, env!("CARGO_BIN_EXE_prefix-router").into())
        .await
        .unwrap();
    assert_eq!(results.summaries.len(), 4);
    assert_eq!(results.rounds.len(), 2);
    // The second round starts one system further.
    let order =
        |r: usize| -> Vec<&str> { results.rounds[r].iter().map(|s| s.name.as_str()).collect() };
    assert_eq!(order(0), ["round_robin", "prefix_load", "oracle", "smg"]);
    assert_eq!(order(1), ["prefix_load", "oracle", "smg", "round_robin"]);
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    // Where it came from.
    let meta = &json["meta"];
    assert!(meta["cores"].as_u64().unwrap() >= 1, "{meta}");
    assert!(!meta["command"].as_str().unwrap().is_empty());
    assert_eq!(meta["rounds"], 2);
    assert_eq!(meta["fleet"], "3 sim servers");
    assert!(meta["commit"].is_string() || meta["commit"].is_null());
    let by_name = |name: &str| {
        json["systems"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()
            .clone()
    };
    let (rr, pl, oracle, smg) = (
        by_name("round_robin"),
        by_name("prefix_load"),
        by_name("oracle"),
        by_name("smg"),
    );
    assert_eq!(smg["skipped"], true);
    assert!(
        smg["reason"].as_str().unwrap().contains("not installed"),
        "{smg}"
    );
    for r in [&rr, &pl, &oracle] {
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["requests"], 54, "{r}");
        for key in [
            "hit_rate",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "ttft_mean_ms",
            "e2e_p50_ms",
            "throughput_rps",
            "output_tps",
            "imbalance",
            "router_overhead_p50_ms",
            "max_rps",
        ] {
            assert!(r[key].is_number(), "{key} in {r}");
        }
        // The two hit rates (sims' metrics, answers' usage) agree.
        let (a, b) = (
            r["hit_rate"].as_f64().unwrap(),
            r["hit_rate_usage"].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 0.05, "{a} vs {b}");
    }
    assert!(
        pl["hit_rate"].as_f64().unwrap() > rr["hit_rate"].as_f64().unwrap() + 0.1,
        "{pl} vs {rr}"
    );
    assert!(pl["router_added_p50_ms"].is_number());
    // Every round's figures, the intervals over them, and the ratios round by round.
    assert_eq!(pl["rounds"].as_array().unwrap().len(), 2);
    let interval = &pl["ttft_mean_ms_interval"];
    assert!(interval["low"].as_f64().unwrap() <= interval["median"].as_f64().unwrap());
    assert_eq!(pl["vs_oracle"]["against"], "oracle");
    assert!(pl["vs_best_ours"]["ttft_mean"]["median"].is_number());
    assert!(out.join("round-2/requests/prefix_load.jsonl").exists());
    assert!(std::fs::read_to_string(out.join("chart.svg"))
        .unwrap()
        .contains("<svg"));
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| prefix_load |"), "{md}");
    assert!(md.contains("Medians over 2 round(s)"), "{md}");

    // The trace of what was sent replays against a sim.
    let sim = fleet(instant(), 1).await;
    let url = sim.urls()[0].clone();
    let run = Run::parse_from([
        "run",
        "--url",
        &url,
        "--sim-url",
        &url,
        "--workload",
        "trace",
        "--trace",
        &trace_s,
    ])
    .args;
    let figures = prefix_bench::run_one(run).await.unwrap();
    // The trace holds what the last system sent (one round's 54 requests).
    assert_eq!((figures.requests, figures.errors), (54, 0));
    // One server: every group's prompt is cached after its first request.
    assert!(figures.hit_rate > 0.5, "{}", figures.hit_rate);
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(&out);
}

/// Streamed completions without `stream_options` report no usage: their output is counted by
/// the chunks that carry text (it was 0 output tokens a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_completions_without_usage_count_their_output() {
    let sim = fleet(instant(), 1).await;
    let url = sim.urls()[0].clone();
    let trace = std::env::temp_dir().join(format!("stream-trace-{}.jsonl", std::process::id()));
    let lines: Vec<String> = (0..3)
        .map(|i| {
            serde_json::json!({"t": 0.0, "endpoint": "completions", "body": {
                "model": "sim-model", "prompt": format!("tell me {i}"), "max_tokens": 8,
                "ignore_eos": true, "stream": true}})
            .to_string()
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let run = Run::parse_from([
        "run",
        "--url",
        &url,
        "--workload",
        "trace",
        "--trace",
        trace.to_str().unwrap(),
    ])
    .args;
    let figures = prefix_bench::run_one(run).await.unwrap();
    assert_eq!((figures.requests, figures.errors), (3, 0));
    assert!(
        figures.output_tps > 0.0,
        "output {} tokens/s",
        figures.output_tps
    );
    sim.shutdown().await;
    let _ = std::fs::remove_file(trace);
}

/// The agent workload end to end: every session's turns, its retry branches and the one-offs are
/// sent, and a session's later turns hit the history its earlier ones left (one server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_sessions_send_every_turn_retry_and_one_off() {
    let sim = fleet(instant(), 1).await;
    let url = sim.urls()[0].clone();
    let run = Run::parse_from([
        "run",
        "--url",
        &url,
        "--sim-url",
        &url,
        "--workload",
        "agent",
        "--sessions",
        "6",
        "--tool-spec-len",
        "300",
        "--speedup",
        "50",
    ])
    .args;
    let expected: usize = prefix_bench::workload::jobs(&run.workload)
        .unwrap()
        .iter()
        .map(prefix_bench::workload::Job::requests)
        .sum();
    assert!(expected > 6 * 4, "{expected}");
    let figures = prefix_bench::run_one(run).await.unwrap();
    assert_eq!((figures.requests, figures.errors), (expected, 0));
    // One server holds every spec and history: most of every prompt after the first is cached.
    assert!(figures.hit_rate > 0.6, "{}", figures.hit_rate);
    sim.shutdown().await;
}
