//! The string server's JSON handlers answer any body with a status below 500.
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
        let store = std::sync::Arc::new(prefix_index::MemoryStore::new(prefix_index::StoreConfig::default()).unwrap());
        let state = prefix_router::index::IndexState::new(store, prefix_index::PrefixHasher::default(), 1 << 20);
        prefix_router::index::app(state)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let (method, path) = match which % 5 {
        0 => (Method::POST, "/v1/notify"),
        1 => (Method::POST, "/v1/query"),
        2 => (Method::PUT, "/v1/servers/7"),
        3 => (Method::POST, "/v1/purge"),
        _ => (Method::POST, "/v1/compatibility"),
    };
    let req = Request::builder().method(method).uri(path).body(Body::from(body.to_vec())).unwrap();
    let status = runtime().block_on(app().clone().oneshot(req)).unwrap().status();
    assert!(status.as_u16() < 500, "{status}");
});
