//! The cost policy against simulated servers that take real time: it learns each server's
//! prefill speed from the TTFTs it sees and sends work where it finishes first.

mod common;

use common::{eventually, fleet, metric, metrics_text, router, series, text};
use serde_json::json;
use vllm_sim::SimConfig;

/// A sim that prefills `tokens_per_s` tokens a second after 10 ms, in real time.
fn timed(tokens_per_s: f64) -> SimConfig {
    SimConfig {
        prefill_tokens_per_s: tokens_per_s,
        prefill_overhead_ms: 10.0,
        itl_ms: 1.0,
        ..SimConfig::default()
    }
}

async fn stream(url: &str, prompt: String) {
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2, "stream": true});
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    resp.bytes().await.unwrap();
}

/// The learned speed of each backend, in `urls` order.
async fn learned(router: &str, urls: &[String]) -> Vec<f64> {
    let text = metrics_text(router).await;
    urls.iter()
        .map(|u| {
            series(&text, "prefix_router_prefill_tokens_per_second")
                .find(|l| l.contains(&format!("\"{u}\"")))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cost_policy_learns_each_servers_speed_and_prefers_the_faster() {
    let slow = fleet(timed(5_000.0), 1).await;
    let fast = fleet(timed(40_000.0), 1).await;
    let urls = vec![slow.urls()[0].clone(), fast.urls()[0].clone()];
    let (r, _) = router(&urls, &["--policy", "cost"]).await;
    let url = r.url();
    // Prompts of 250 to 2,000 tokens, one at a time: each server's TTFTs teach its line.
    for i in 0..40u64 {
        stream(&url, text(i, 1000 + (i as usize * 677) % 7000)).await;
    }
    let speeds = learned(&url, &urls).await;
    let served: Vec<f64> = {
        let mut v = Vec::new();
        for u in &urls {
            v.push(
                metric(
                    &url,
                    "prefix_router_requests_total",
                    &format!("backend=\"{u}\""),
                )
                .await,
            );
        }
        v
    };
    eprintln!("learned speeds {speeds:?} tokens/s, requests served {served:?}");
    assert!(
        served[1] > served[0] * 2.0,
        "the faster server took most of the work: {served:?}, learned {speeds:?}"
    );
    // The faster server's line, learned from most of the requests, is close to its speed.
    assert!(
        (speeds[1] - 40_000.0).abs() < 0.35 * 40_000.0,
        "learned {speeds:?} (served {served:?})"
    );
    assert!(speeds[0] < speeds[1], "learned {speeds:?}");
    // Servers whose TTFTs follow their line exactly need little calibration.
    let text = metrics_text(&url).await;
    let calibrations: Vec<f64> = series(&text, "prefix_router_ttft_calibration")
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(calibrations.len(), 2, "{text}");
    assert!(
        calibrations.iter().all(|c| (0.7..1.4).contains(c)),
        "{calibrations:?}"
    );
    // Every streamed answer's TTFT is recorded against its prediction.
    assert_eq!(
        metric(&url, "prefix_router_ttft_prediction_ratio_count", "").await,
        40.0
    );
    assert_eq!(
        metric(&url, "prefix_router_ttft_prediction_error_count", "").await,
        40.0
    );
    assert_eq!(
        metric(&url, "prefix_router_ttft_seconds_count", "").await,
        40.0
    );
    assert_eq!(
        metric(&url, "prefix_router_queued_prefill_tokens", "").await,
        0.0,
        "nothing queued once every request answered"
    );
}

/// Requests the router at `url` sent to each of `urls`, in their order.
async fn taken(url: &str, urls: &[String]) -> Vec<f64> {
    let mut taken = Vec::new();
    for u in urls {
        let filter = format!("backend=\"{u}\"");
        taken.push(metric(url, "prefix_router_requests_total", &filter).await);
    }
    taken
}

/// Nine streamed siblings of `prefix` through the router at `url`: the first alone, the other
/// eight `pause` after it is in flight (so that they can match it: siblings sent at the very
/// same instant all miss the index and spread by load). Returns when all have answered.
async fn siblings_after_the_first(url: &str, prefix: &str, pause: std::time::Duration) {
    let sibling = |i: u64| {
        let (url, prompt) = (url.to_string(), format!("{prefix} question {i}"));
        tokio::spawn(async move { stream(&url, prompt).await })
    };
    let first = sibling(0);
    assert!(
        eventually(10, || async {
            metric(url, "prefix_router_inflight", "").await == 1.0
        })
        .await
    );
    tokio::time::sleep(pause).await;
    let burst: Vec<_> = (1..9u64).map(sibling).collect();
    first.await.unwrap();
    for b in burst {
        b.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_siblings_spreads_over_equal_servers() {
    let sims = fleet(timed(10_000.0), 3).await;
    let urls = sims.urls();
    let (r, _) = router(&urls, &["--policy", "cost"]).await;
    let url = r.url();
    // Nine equal requests at once (1,500 tokens each, nothing shared): once a server has one
    // queued, the next is faster elsewhere, so the three share the burst.
    let burst: Vec<_> = (0..9u64)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { stream(&url, text(100 + i, 6000)).await })
        })
        .collect();
    for b in burst {
        b.await.unwrap();
    }
    let spread = taken(&url, &urls).await;
    assert!(spread.iter().all(|&n| n >= 2.0), "cost: {spread:?}");
    // Siblings of one 6,000-token prefix (0.6 s of prefill) sent 150 ms into the first one's
    // prefill: the holder finishes the prefix in ~0.45 s and then computes only their
    // questions, sooner than another server would compute the whole prefix (0.6 s), so they
    // wait there instead of computing the prefix again (the part of a queue already under way
    // is not charged; see `policy::ttft_after_queue`).
    let (r3, _) = router(&urls, &["--policy", "cost"]).await;
    let url3 = r3.url();
    siblings_after_the_first(
        &url3,
        &text(5, 24_000),
        std::time::Duration::from_millis(150),
    )
    .await;
    let gathered = taken(&url3, &urls).await;
    assert_eq!(gathered.iter().sum::<f64>(), 9.0);
    assert!(
        gathered.iter().any(|&n| n >= 7.0),
        "cost computed the prefix again elsewhere: {gathered:?}"
    );
    // prefix_load keeps it together: the siblings wait for their first byte on the server that
    // took the first, and its guard lets a server carry those (vLLM prefills them in one step
    // with the shared prefix computed once; see `prefix_load`'s `still_to_prefill`). The
    // first's 6,000-token prefill (0.6 s) leaves the others time to arrive while it waits.
    let (r2, _) = router(&urls, &["--policy", "prefix_load"]).await;
    let url2 = r2.url();
    siblings_after_the_first(&url2, &text(7, 24_000), std::time::Duration::ZERO).await;
    let taken = taken(&url2, &urls).await;
    eprintln!("prefix_load: the burst went {taken:?}");
    assert_eq!(taken.iter().sum::<f64>(), 9.0);
    assert!(
        taken.iter().any(|&n| n >= 7.0),
        "prefix_load split the burst: {taken:?}"
    );
}

/// Answers that are errors (a 400 at once, whatever the prompt) teach the backend's prefill
/// line nothing: four refused 200 kB prompts once made a backend look ten thousand times
/// faster, so that `cost` treated it as free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answers_teach_no_prefill_speed() {
    let sims = fleet(timed(20_000.0), 1).await;
    let urls = sims.urls();
    let (r, gw) = router(&urls, &["--policy", "cost"]).await;
    let url = r.url();
    for i in 0..12u64 {
        stream(&url, text(i, 2_000 + (i as usize * 377) % 3000)).await;
    }
    let backend = gw.core.fleet.snapshot()[0].clone();
    let learned_from = backend.prefill.observations();
    let line = backend.prefill.line();
    assert!(learned_from >= 12, "{learned_from}");
    let client = reqwest::Client::new();
    for i in 0..4u64 {
        let body = json!({"model": "sim-model", "prompt": text(100 + i, 200_000), "max_tokens": 2, "stream": true});
        let resp = client
            .post(format!("{url}/v1/completions"))
            .header("x-sim-fail", "400")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        resp.bytes().await.unwrap();
    }
    assert_eq!(backend.prefill.observations(), learned_from);
    assert_eq!(backend.prefill.line(), line);
    // Still a line a real answer fits.
    let speeds = learned(&url, &urls).await;
    assert!(speeds[0] < 100_000.0, "{speeds:?}");
}
