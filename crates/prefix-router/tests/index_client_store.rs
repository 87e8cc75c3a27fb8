//! The router's remote-index client store against the store conformance suite: a real
//! `prefix-router index` per test on a free loopback port.

#[path = "../../prefix-index/tests/conformance/mod.rs"]
mod conformance;

use std::net::SocketAddr;
use std::time::Duration;

use prefix_index::StoreConfig;
use prefix_router::index::{self, IndexArgs};
use prefix_router::index_client::IndexClient;

async fn make(config: StoreConfig) -> IndexClient {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let mut args = IndexArgs::with_listen(listener.local_addr().unwrap());
    let hasher = conformance::hasher();
    args.store.chunk_size = hasher.chunk_size();
    args.store.hash_seed = Some(99);
    args.store.capacity = config.default_capacity;
    args.store.ttl = config.ttl_ms.map(|ms| ms as f64 / 1000.0);
    // The suite purges explicitly, and compares with the reference model.
    args.purge_interval = Duration::ZERO;
    let server = index::spawn(args, listener).await.unwrap();
    let url = server.url();
    // The server lives as long as the test's runtime.
    std::mem::forget(server);
    IndexClient::connect(&url, hasher, Duration::from_secs(5), None)
        .await
        .unwrap()
}

conformance_suite!(make);

#[tokio::test]
async fn a_mismatched_index_is_refused_at_connect() {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let args = IndexArgs::with_listen(listener.local_addr().unwrap());
    let server = index::spawn(args, listener).await.unwrap();
    let err = IndexClient::connect(
        &server.url(),
        conformance::hasher(),
        Duration::from_secs(5),
        None,
    )
    .await
    .err()
    .expect("different chunk size and seed");
    assert!(err.to_string().contains("hashes differently"), "{err}");
    server.shutdown().await;
}
