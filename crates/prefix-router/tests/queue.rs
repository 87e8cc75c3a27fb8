//! The gateway queue in front of a simulated server that takes real time: requests held while
//! it is saturated leave by priority, then by tenants' turns, then in arrival order; a full
//! queue refuses with 429 and `Retry-After`; a client that leaves frees its place; nothing is
//! lost or sent twice.

mod common;

use std::time::{Duration, Instant};

use common::{eventually, fleet, metric, router, send, slow, text};
use serde_json::json;

async fn depth(url: &str) -> f64 {
    metric(url, "prefix_router_queue_depth", "").await
}

/// Waits until the router holds `n` requests.
async fn until_depth(url: &str, n: f64) {
    assert!(
        eventually(10, || async { depth(url).await == n }).await,
        "the queue never held {n}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_requests_leave_by_priority_then_tenant_turns_then_arrival() {
    let sims = fleet(slow(), 1).await;
    // One request prefilling at a time: every other one waits at the router.
    let (r, _) = router(
        &sims.urls(),
        &["--queue-when-waiting", "1", "--trust-client-headers"],
    )
    .await;
    let url = r.url();
    let blocker = tokio::spawn(send(url.clone(), text(1, 60_000), vec![]));
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_queue_admitted_total", "direct").await == 1.0
                && metric(&url, "prefix_router_inflight", "").await == 1.0
        })
        .await,
        "the blocker was admitted and counted against the server"
    );
    let arrivals = [
        ("a1", 0, "a"),
        ("a2", 0, "a"),
        ("a3", 0, "a"),
        ("b1", 0, "b"),
        ("urgent", 5, "c"),
        ("c1", 0, "c"),
    ];
    let mut held = Vec::new();
    for (i, (name, priority, tenant)) in arrivals.into_iter().enumerate() {
        let headers = vec![
            ("x-priority", priority.to_string()),
            ("x-tenant", tenant.to_owned()),
        ];
        held.push((
            name,
            tokio::spawn(send(url.clone(), text(10 + i as u64, 400), headers)),
        ));
        until_depth(&url, i as f64 + 1.0).await;
    }
    let (status, _) = blocker.await.unwrap();
    assert_eq!(status, 200);
    let mut done = Vec::new();
    for (name, h) in held {
        let (status, first) = h.await.unwrap();
        assert_eq!(status, 200, "{name}");
        done.push((first, name));
    }
    done.sort();
    let order: Vec<&str> = done.iter().map(|(_, n)| *n).collect();
    assert_eq!(order, ["urgent", "a1", "b1", "c1", "a2", "a3"]);
    assert_eq!(
        metric(&url, "prefix_router_queue_admitted_total", "queued").await,
        6.0
    );
    // Each request reached the server once.
    assert_eq!(
        metric(&url, "prefix_router_requests_total", "status=\"200\"").await,
        7.0
    );
    assert_eq!(depth(&url).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_and_a_client_that_leaves_frees_its_place() {
    let sims = fleet(slow(), 1).await;
    let (r, _) = router(
        &sims.urls(),
        &["--queue-when-waiting", "1", "--max-queued", "2"],
    )
    .await;
    let url = r.url();
    let blocker = tokio::spawn(send(url.clone(), text(1, 60_000), vec![]));
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_queue_admitted_total", "direct").await == 1.0
                && metric(&url, "prefix_router_inflight", "").await == 1.0
        })
        .await,
        "the blocker was admitted and counted against the server"
    );
    let first = tokio::spawn(send(url.clone(), text(2, 400), vec![]));
    until_depth(&url, 1.0).await;
    let leaving = tokio::spawn(send(url.clone(), text(3, 400), vec![]));
    until_depth(&url, 2.0).await;

    // Full: 429 in OpenAI's shape, with Retry-After, and nothing queued or sent.
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": text(4, 400), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(depth(&url).await, 2.0);

    // The second client gives up: its place frees, and a newcomer takes it.
    leaving.abort();
    until_depth(&url, 1.0).await;
    assert_eq!(
        metric(&url, "prefix_router_queue_refused_total", "cancelled").await,
        1.0
    );
    let newcomer = tokio::spawn(send(url.clone(), text(5, 400), vec![]));
    until_depth(&url, 2.0).await;

    assert_eq!(blocker.await.unwrap().0, 200);
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(newcomer.await.unwrap().0, 200);
    // The blocker, the first and the newcomer reached the server; the refused and the
    // cancelled did not.
    assert_eq!(metric(&url, "prefix_router_requests_total", "").await, 3.0);
    assert_eq!(
        metric(&url, "prefix_router_queue_refused_total", "full").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_too_long_gets_503_and_a_bad_priority_400() {
    let sims = fleet(slow(), 1).await;
    let (r, _) = router(
        &sims.urls(),
        &[
            "--queue-when-waiting",
            "1",
            "--queue-timeout",
            "200ms",
            "--trust-client-headers",
        ],
    )
    .await;
    let url = r.url();
    let blocker = tokio::spawn(send(url.clone(), text(1, 60_000), vec![]));
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_queue_admitted_total", "direct").await == 1.0
                && metric(&url, "prefix_router_inflight", "").await == 1.0
        })
        .await,
        "the blocker was admitted and counted against the server"
    );
    let started = Instant::now();
    let (status, _) = send(url.clone(), text(2, 400), vec![]).await;
    assert_eq!(status, 503);
    assert!(started.elapsed() >= Duration::from_millis(200));

    for bad in ["high", "1000", ""] {
        let resp = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .header("x-priority", bad)
            .json(&json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400, "x-priority {bad:?}");
    }
    assert_eq!(blocker.await.unwrap().0, 200);
    assert_eq!(metric(&url, "prefix_router_requests_total", "").await, 1.0);
}

/// `--max-queued` is shared fairly: with tenant A's requests filling the queue, tenant B's
/// first is queued in place of A's newest (which gets the 429), and both are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_keeps_a_place_for_each_tenant() {
    let sims = fleet(slow(), 1).await;
    let (r, _) = router(
        &sims.urls(),
        &[
            "--queue-when-waiting",
            "1",
            "--max-queued",
            "5",
            "--trust-client-headers",
        ],
    )
    .await;
    let url = r.url();
    let blocker = tokio::spawn(send(url.clone(), text(1, 60_000), vec![]));
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_inflight", "").await == 1.0
        })
        .await
    );
    let as_tenant = |t: &str| vec![("x-tenant", t.to_owned())];
    let mut a = Vec::new();
    for i in 0..5 {
        a.push(tokio::spawn(send(
            url.clone(),
            text(10 + i, 400),
            as_tenant("a"),
        )));
        until_depth(&url, i as f64 + 1.0).await;
    }
    // A's sixth and seventh: the queue is full and A holds all of it.
    for i in 5..7 {
        let (status, _) = send(url.clone(), text(10 + i, 400), as_tenant("a")).await;
        assert_eq!(status, 429);
    }
    let b = tokio::spawn(send(url.clone(), text(99, 400), as_tenant("b")));
    // A's newest leaves with a 429; B waits in its place.
    let newest = a.pop().unwrap();
    assert_eq!(newest.await.unwrap().0, 429);
    assert_eq!(depth(&url).await, 5.0);
    assert_eq!(blocker.await.unwrap().0, 200);
    assert_eq!(b.await.unwrap().0, 200);
    for h in a {
        assert_eq!(h.await.unwrap().0, 200);
    }
}
