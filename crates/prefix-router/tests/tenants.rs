//! Tenants from a keys file (`--api-keys-file`): their keys are the clients' keys, their
//! rates and concurrency caps refuse with 429 and `Retry-After` (and take nothing), their
//! priority orders the gateway queue, the file is re-read when it changes, and the tenant is a
//! metric label.

mod common;

use std::path::PathBuf;
use std::time::Instant;

use common::{eventually, fleet, instant, metric, router, send, slow, text};
use serde_json::{json, Value};

struct KeysFile(PathBuf);

impl KeysFile {
    fn new(name: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(format!("tenants-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        Self(path)
    }

    fn arg(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for KeysFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A completion as `key`; its status, `Retry-After` and body.
async fn complete(url: &str, key: &str, prompt: &str) -> (u16, Option<String>, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, retry, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_rates_and_reloads() {
    let sims = fleet(instant(), 1).await;
    let file = KeysFile::new(
        "rates",
        "[tenants.alpha]\nkeys = [\"alpha-key-1\"]\nrate = 0.1\nburst = 2\n\
         [tenants.beta]\nkeys = [\"beta-key-1\"]\n",
    );
    let (r, _) = router(&sims.urls(), &["--api-keys-file", &file.arg()]).await;
    let url = r.url();

    // Unknown and missing keys: 401 in OpenAI's shape; health stays open.
    let (status, _, body) = complete(&url, "nobody-key", "hi").await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "authentication_error");
    assert_eq!(
        reqwest::get(format!("{url}/health"))
            .await
            .unwrap()
            .status(),
        200
    );

    // alpha's burst of 2, then 429 with Retry-After (0.1 req/s: 10 s); beta is not held back.
    assert_eq!(complete(&url, "alpha-key-1", "one").await.0, 200);
    assert_eq!(complete(&url, "alpha-key-1", "two").await.0, 200);
    let (status, retry, body) = complete(&url, "alpha-key-1", "three").await;
    assert_eq!(status, 429);
    assert_eq!(retry.as_deref(), Some("10"));
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(body["error"]["message"].as_str().unwrap().contains("alpha"));
    for i in 0..5 {
        assert_eq!(complete(&url, "beta-key-1", &format!("b{i}")).await.0, 200);
    }
    // The refused request reached no backend.
    assert_eq!(
        metric(&url, "prefix_router_requests_total", "status=\"200\"").await,
        7.0
    );
    let counted = |tenant: &'static str, outcome: &'static str| {
        let url = url.clone();
        async move {
            metric(
                &url,
                "prefix_router_tenant_requests_total",
                &format!("tenant=\"{tenant}\",outcome=\"{outcome}\""),
            )
            .await
        }
    };
    assert_eq!(counted("alpha", "admitted").await, 2.0);
    assert_eq!(counted("alpha", "rate_limited").await, 1.0);
    assert_eq!(counted("beta", "admitted").await, 5.0);

    // A key added to the file is accepted once the router re-reads it; an invalid file keeps
    // the tenants as they were.
    assert_eq!(complete(&url, "gamma-key-1", "g").await.0, 401);
    // File times have a coarse resolution: make sure the change is seen as one.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    std::fs::write(
        &file.0,
        "[tenants.alpha]\nkeys = [\"alpha-key-1\"]\nrate = 0.1\nburst = 2\n\
         [tenants.beta]\nkeys = [\"beta-key-1\", \"gamma-key-1\"]\n",
    )
    .unwrap();
    assert!(
        eventually(5, || async {
            complete(&url, "gamma-key-1", "g").await.0 == 200
        })
        .await,
        "the new key was never accepted"
    );
    assert_eq!(
        counted("beta", "admitted").await,
        6.0,
        "gamma's key is beta's"
    );
    // alpha's bucket survived the reload: still short of a token (a few seconds at 0.1/s).
    assert_eq!(complete(&url, "alpha-key-1", "four").await.0, 429);
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    std::fs::write(&file.0, "[tenants.alpha]\nkeys = [\"short\"]\n").unwrap();
    assert!(
        eventually(5, || async {
            metric(&url, "prefix_router_tenant_reloads_total", "invalid").await == 1.0
        })
        .await
    );
    assert_eq!(complete(&url, "beta-key-1", "still").await.0, 200);
}

/// A streamed completion as `key`; its status and when its first chunk came.
async fn stream(url: String, key: &'static str, prompt: String) -> (u16, Instant) {
    send(
        url,
        prompt,
        vec![("authorization", format!("Bearer {key}"))],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cap_and_priority_class_hold_under_load() {
    let sims = fleet(slow(), 1).await;
    let file = KeysFile::new(
        "classes",
        "[tenants.batch]\nkeys = [\"batch-key-1\"]\nmax-concurrent = 3\n\
         [tenants.interactive]\nkeys = [\"live-key-1\"]\npriority = 5\n",
    );
    let (r, _) = router(
        &sims.urls(),
        &["--api-keys-file", &file.arg(), "--queue-when-waiting", "1"],
    )
    .await;
    let url = r.url();
    let depth = || {
        let url = url.clone();
        async move { metric(&url, "prefix_router_queue_depth", "").await }
    };
    // batch's first request occupies the server; its next two wait in the queue.
    let blocker = tokio::spawn(stream(url.clone(), "batch-key-1", text(1, 60_000)));
    assert!(
        eventually(10, || async {
            metric(&url, "prefix_router_queue_admitted_total", "direct").await == 1.0
        })
        .await
    );
    let mut waiting = Vec::new();
    for i in 0..2u64 {
        waiting.push((
            "batch",
            tokio::spawn(stream(url.clone(), "batch-key-1", text(10 + i, 400))),
        ));
        assert!(eventually(10, || async { depth().await == i as f64 + 1.0 }).await);
    }
    // Its fourth is over its cap of 3 in flight: refused at once, not queued.
    let (status, retry, _) = complete(&url, "batch-key-1", &text(20, 400)).await;
    assert_eq!((status, retry.as_deref()), (429, Some("1")));
    assert_eq!(depth().await, 2.0);
    // interactive arrives last, and its key's class (5) puts it ahead of batch's.
    waiting.push((
        "interactive",
        tokio::spawn(stream(url.clone(), "live-key-1", text(30, 400))),
    ));
    assert!(eventually(10, || async { depth().await == 3.0 }).await);
    assert_eq!(blocker.await.unwrap().0, 200);
    let mut done = Vec::new();
    for (name, h) in waiting {
        let (status, first) = h.await.unwrap();
        assert_eq!(status, 200, "{name}");
        done.push((first, name));
    }
    done.sort();
    assert_eq!(done[0].1, "interactive", "{done:?}");
    // All ended: batch may send again.
    assert_eq!(complete(&url, "batch-key-1", &text(40, 400)).await.0, 200);
    assert_eq!(
        metric(&url, "prefix_router_tenant_inflight", "tenant=\"batch\"").await,
        0.0
    );
}
