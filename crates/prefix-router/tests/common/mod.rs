//! Helpers shared by the router's integration tests: simulated fleets, a router in-process on
//! a free loopback port, metrics read off `/metrics`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use prefix_router::serve::{self, Gateway, ServeArgs};
use prefix_router::server::Running;
use vllm_sim::{Fleet, SimConfig};

pub const LOOPBACK: ([u8; 4], u16) = ([127, 0, 0, 1], 0);

/// `n` simulated vLLM servers on free loopback ports.
pub async fn fleet(config: SimConfig, n: usize) -> Fleet {
    Fleet::start(config, n, SocketAddr::from(LOOPBACK))
        .await
        .unwrap()
}

/// Sims that answer at once (no simulated time).
pub fn instant() -> SimConfig {
    SimConfig {
        time_scale: 0.0,
        ..SimConfig::default()
    }
}

/// A router in front of `urls`, with fast health checks and load scrapes (100 ms, one failure
/// makes a backend unhealthy) and then `extra` command-line words.
pub async fn router(urls: &[String], extra: &[&str]) -> (Running, Arc<Gateway>) {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let mut words: Vec<String> = vec![
        "--listen".into(),
        listener.local_addr().unwrap().to_string(),
    ];
    words.extend(fast_checks(urls, extra));
    let args = ServeArgs::from_words(&words).unwrap();
    serve::spawn(args, listener).await.unwrap()
}

/// Health checks and load scrapes every 100 ms (one failure makes a backend unhealthy), the
/// backends `urls`, then `extra`: the words of a router or picker under test.
pub fn fast_checks(urls: &[String], extra: &[&str]) -> Vec<String> {
    let mut words: Vec<String> = [
        "--health-interval",
        "100ms",
        "--metrics-interval",
        "100ms",
        "--unhealthy-after",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for u in urls {
        words.push("--backend".into());
        words.push(u.clone());
    }
    words.extend(extra.iter().map(|s| s.to_string()));
    words
}

/// The `/metrics` text of a server.
pub async fn metrics_text(url: &str) -> String {
    reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The lines of metric `name` (any labels) in a `/metrics` text.
pub fn series<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = &'a str> {
    text.lines()
        .filter(move |l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
}

/// A metric's value from a server's `/metrics`, summed over the label sets containing `filter`.
pub async fn metric(url: &str, name: &str, filter: &str) -> f64 {
    let text = metrics_text(url).await;
    series(&text, name)
        .filter(|l| l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `check` every 50 ms until it holds or `secs` pass; returns whether it held.
pub async fn eventually<F, Fut>(secs: u64, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() > until {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
/// Distinct text of about `bytes` bytes (the sims' byte model: 4 bytes a token).
pub fn text(seed: u64, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    while s.len() < bytes {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(&format!("w{} ", x >> 40));
    }
    s
}

/// One sim prefilling 5,000 tokens a second: a 15,000-token request takes 3 s, a 100-token
/// one 25 ms (to hold a server busy while others queue).
pub fn slow() -> SimConfig {
    SimConfig {
        prefill_tokens_per_s: 5_000.0,
        prefill_overhead_ms: 5.0,
        itl_ms: 1.0,
        ..SimConfig::default()
    }
}

/// Sends a streamed completion with `headers`; returns its status and when its first chunk came.
pub async fn send(
    url: String,
    prompt: String,
    headers: Vec<(&'static str, String)>,
) -> (u16, std::time::Instant) {
    let mut req = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&serde_json::json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2, "stream": true}));
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let mut resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let _ = resp.chunk().await;
    let first = std::time::Instant::now();
    while let Ok(Some(_)) = resp.chunk().await {}
    (status, first)
}

/// Serves `app` on a free loopback port; returns its URL.
pub async fn serve_loopback(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A stand-in backend serving `fake-model`: `completions` (the test's own routes, which
/// record what they receive) plus the health, metrics and models routes the router polls.
pub async fn fake_backend(completions: axum::Router) -> String {
    fake_backend_of("fake-model", completions).await
}

/// [`fake_backend`] serving `model`.
pub async fn fake_backend_of(model: &'static str, completions: axum::Router) -> String {
    use axum::routing::get;
    let app = completions
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(|| async { "" }))
        .route(
            "/v1/models",
            get(move || async move {
                axum::Json(serde_json::json!(
                    {"object": "list", "data": [{"id": model, "object": "model"}]}
                ))
            }),
        );
    serve_loopback(app).await
}

pub mod dashboard;
pub mod envoy;
pub mod vllm;

/// A `nats-server` of this test's own.
pub struct Nats {
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Child,
}

impl Nats {
    /// Starts one on a free port; `None` (the test skips) where `nats-server` is not
    /// installed, except in CI, where that fails the test.
    pub async fn start() -> Option<Self> {
        Self::start_with(&[]).await
    }

    /// One started with `args` besides its address and port (e.g. `--user`, `--pass`).
    pub async fn start_with(args: &[&str]) -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        match Self::start_on(port, args).await {
            Some(n) => Some(n),
            None if std::env::var_os("PREFIX_ROUTER_CI").is_some() => {
                panic!("nats-server is needed in CI (Debian package nats-server)")
            }
            None => {
                eprintln!("skipped: nats-server is not installed");
                None
            }
        }
    }

    pub async fn start_on(port: u16, args: &[&str]) -> Option<Self> {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let nats = Self { port, child };
        let up = eventually(10, || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        assert!(up, "nats-server did not listen on {port}");
        Some(nats)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The key the tests' router replicas share (`--replica-bus-key-file`), written once.
pub fn bus_key_file() -> String {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("prefix-router-bus-key-{}", std::process::id()));
        std::fs::write(&path, "the tests' shared replica bus key\n").unwrap();
        path.display().to_string()
    })
    .clone()
}

/// A `prefix-router index` on a free loopback port (memory store, the defaults).
pub async fn index_server() -> Running {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let args = prefix_router::index::IndexArgs::with_listen(listener.local_addr().unwrap());
    prefix_router::index::spawn(args, listener).await.unwrap()
}
