//! The pooled HTTP/1.1 client for everything the router calls: backends (requests, health
//! checks, metrics scrapes) and a remote index.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled client with TCP_NODELAY, a connect timeout and idle connections reaped.
pub fn client(connect_timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_keepalive(Some(Duration::from_secs(30)));
    // Without a timer the pool never reaps idle connections: after a burst their descriptors and
    // buffers would stay until reused. vLLM (uvicorn) closes a connection idle for 5 s; reusing
    // one at that moment fails the request, so connections idle for 4 s are not reused.
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(4))
        .pool_max_idle_per_host(4096)
        .build(connector)
}
