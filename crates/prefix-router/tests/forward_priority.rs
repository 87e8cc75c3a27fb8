//! `--forward-priority`: the request's priority (`x-priority`) reaches the backend in the body
//! as vLLM's `priority`, negated (vLLM serves lower values first), so a vLLM scheduling by
//! priority orders its own waiting requests like the gateway queue does. A stand-in backend
//! records the bodies it receives.

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
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_priority_reaches_the_backend_negated_unless_the_body_sets_its_own() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let b = backend(seen.clone()).await;
    let (r, _) = router(std::slice::from_ref(&b), &["--forward-priority"]).await;
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
    let (plain, _) = router(&[b], &[]).await;
    assert_eq!(send(&plain.url(), Some("5"), json!({})).await, 200);
    assert_eq!(seen.lock().last().unwrap().get("priority"), None);
}
