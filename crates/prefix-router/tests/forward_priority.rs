//! `--forward-priority`: the request's priority (`x-priority`) reaches the backend in the body
//! as vLLM's `priority`, negated (vLLM serves lower values first), so a vLLM scheduling by
//! priority orders its own waiting requests like the gateway queue does. Clients set
//! `x-priority` only when the router trusts them (`--trust-client-headers`); a keys-file
//! tenant's body cannot ask vLLM for more than its ceiling. A stand-in backend records the
//! bodies it receives.

mod common;

use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use common::{fake_backend, router};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// A backend that answers completions and records their bodies.
async fn backend(seen: Arc<Mutex<Vec<Value>>>) -> String {
    async fn complete(
        State(seen): State<Arc<Mutex<Vec<Value>>>>,
        Json(body): Json<Value>,
    ) -> Json<Value> {
        seen.lock().push(body);
        Json(
            json!({"id": "c", "object": "text_completion", "model": "fake-model",
            "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
        )
    }
    fake_backend(
        Router::new()
            .route("/v1/completions", post(complete))
            .with_state(seen),
    )
    .await
}

/// Sends one completion with these headers and body fields; returns the status.
async fn send(url: &str, priority: Option<&str>, extra: Value) -> u16 {
    send_as(url, None, priority, extra).await
}

/// [`send`], as the client holding `key`.
async fn send_as(url: &str, key: Option<&str>, priority: Option<&str>, extra: Value) -> u16 {
    let mut body = json!({"model": "fake-model", "prompt": "hello there", "max_tokens": 1});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let mut req = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body);
    if let Some(p) = priority {
        req = req.header("x-priority", p);
    }
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_priority_reaches_the_backend_negated_unless_the_body_sets_its_own() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let b = backend(seen.clone()).await;
    let (r, _) = router(
        std::slice::from_ref(&b),
        &["--forward-priority", "--trust-client-headers"],
    )
    .await;
    let url = r.url();
    assert_eq!(send(&url, Some("5"), json!({})).await, 200);
    assert_eq!(send(&url, Some("-2"), json!({})).await, 200);
    // vLLM's default is 0: nothing to write.
    assert_eq!(send(&url, None, json!({})).await, 200);
    // The client's own field wins.
    assert_eq!(send(&url, Some("5"), json!({"priority": 7})).await, 200);
    // A bad header is refused before anything is sent.
    assert_eq!(send(&url, Some("high"), json!({})).await, 400);
    let bodies = seen.lock().clone();
    let priorities: Vec<Value> = bodies.iter().map(|b| b["priority"].clone()).collect();
    assert_eq!(
        priorities,
        [json!(-5), json!(2), Value::Null, json!(7)],
        "{bodies:?}"
    );
    assert!(bodies.iter().all(|b| b["prompt"] == "hello there"));

    // Without the flag the body passes unchanged.
    let (plain, _) = router(std::slice::from_ref(&b), &[]).await;
    assert_eq!(send(&plain.url(), Some("5"), json!({})).await, 200);
    assert_eq!(seen.lock().last().unwrap().get("priority"), None);

    // A client the router does not trust sets no priority: its header is not read.
    let (untrusted, _) = router(&[b], &["--forward-priority"]).await;
    assert_eq!(send(&untrusted.url(), Some("100"), json!({})).await, 200);
    assert_eq!(seen.lock().last().unwrap().get("priority"), None);
    assert_eq!(send(&untrusted.url(), Some("high"), json!({})).await, 200);
}

/// A tenant capped at priority 2 cannot ask vLLM for more in its own body: `"priority": -1000`
/// reaches the backend as -2 (vLLM serves lower values first); a body asking for less passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_body_priority_is_held_to_its_ceiling() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let b = backend(seen.clone()).await;
    let keys = std::env::temp_dir().join(format!("priority-keys-{}.toml", std::process::id()));
    std::fs::write(
        &keys,
        "[tenants.capped]\nkeys = [\"capped-key-123\"]\npriority = 2\n",
    )
    .unwrap();
    let (r, _) = router(&[b], &["--api-keys-file", keys.to_str().unwrap()]).await;
    let url = r.url();
    let key = Some("capped-key-123");
    assert_eq!(
        send_as(&url, key, None, json!({"priority": -1000})).await,
        200
    );
    assert_eq!(send_as(&url, key, None, json!({"priority": 10})).await, 200);
    assert_eq!(send_as(&url, key, None, json!({"priority": -2})).await, 200);
    let priorities: Vec<Value> = seen.lock().iter().map(|b| b["priority"].clone()).collect();
    assert_eq!(priorities, [json!(-2), json!(10), json!(-2)]);
    assert!(seen.lock().iter().all(|b| b["prompt"] == "hello there"));
}
