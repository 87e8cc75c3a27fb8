//! The router's request path answers any body with a status below 500 (no backends here: a
//! valid request gets 404 for its unknown model, never a panic or a 500).
#![no_main]
use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{Method, Request};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

fn app() -> &'static axum::Router {
    static APP: OnceLock<axum::Router> = OnceLock::new();
    APP.get_or_init(|| {
        let args = prefix_router::serve::ServeArgs::from_words(&[]).unwrap();
        let gw = runtime().block_on(prefix_router::serve::gateway(&args)).unwrap();
        prefix_router::serve::app(gw)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let path = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/tokenize"][usize::from(which) % 5];
    let req = Request::builder().method(Method::POST).uri(path).body(Body::from(body.to_vec())).unwrap();
    let status = runtime().block_on(app().clone().oneshot(req)).unwrap().status();
    assert!(status.as_u16() < 500 || status.as_u16() == 503, "{status}");
});
