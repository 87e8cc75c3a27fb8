//! Failure modes, tested: bad input, keys, limits, a hung backend, a backend killed under load,
//! and the shared database going away under load.

#[path = "../../vllm-sim/tests/support.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prefix_router::index::{self, IndexArgs};
use prefix_router::serve::{self, ServeArgs};
use prefix_router::server::Running;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::{Fleet, SimConfig};

const LOOPBACK: ([u8; 4], u16) = ([127, 0, 0, 1], 0);

async fn fleet(config: SimConfig, n: usize) -> Fleet {
    Fleet::start(config, n, SocketAddr::from(LOOPBACK))
        .await
        .unwrap()
}

fn fast() -> SimConfig {
    SimConfig {
        time_scale: 0.0,
        ..SimConfig::default()
    }
}

async fn router(urls: &[String], extra: &[&str]) -> Running {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let mut words: Vec<String> = vec![
        "--listen".into(),
        listener.local_addr().unwrap().to_string(),
        "--health-interval".into(),
        "100ms".into(),
        "--metrics-interval".into(),
        "100ms".into(),
        "--unhealthy-after".into(),
        "1".into(),
    ];
    for u in urls {
        words.push("--backend".into());
        words.push(u.clone());
    }
    words.extend(extra.iter().map(|s| s.to_string()));
    let args = ServeArgs::from_words(&words).unwrap();
    serve::spawn(args, listener).await.unwrap().0
}

async fn metric(url: &str, name: &str, filter: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(filter)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends raw bytes; returns the status codes of the answers read until the connection closes.
async fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> Vec<u16> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(bytes).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer);
    text.match_indices("HTTP/1.")
        .filter_map(|(i, _)| text[i..].split_whitespace().nth(1)?.parse().ok())
        .collect()
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/bad_requests");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "http"))
        .collect();
    files.sort();
    assert!(files.len() >= 20, "the corpus is there");
    files
        .into_iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// Every request of the corpus gets 4xx answers (or a clean close), never a 5xx, and changes
/// nothing: no request reaches a backend's generation path, no index entry appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bad_request_corpus_gets_4xx_and_changes_nothing() {
    let sims = fleet(fast(), 2).await;
    let r = router(&sims.urls(), &["--max-body", "1048576"]).await;
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let mut index_args = IndexArgs::with_listen(listener.local_addr().unwrap());
    index_args.max_body = 1 << 20;
    let idx = index::spawn(index_args, listener).await.unwrap();
    let index_before = reqwest::get(format!("{}/v1/servers", idx.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();

    for (name, bytes) in corpus() {
        for (target, addr) in [("router", r.addr), ("index", idx.addr)] {
            let statuses = raw_exchange(addr, &bytes).await;
            assert!(
                statuses.iter().all(|s| (400..500).contains(s)),
                "{name} against the {target}: {statuses:?}"
            );
        }
    }
    // A 10 MB prompt: over the router's 1 MiB limit here (413); with a larger limit the
    // backend refuses it (too many tokens), also a 4xx.
    // The router answers from the head alone (Content-Length), before the body is sent.
    let mut stream = tokio::net::TcpStream::connect(r.addr).await.unwrap();
    stream
        .write_all(format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", 10 << 20).as_bytes())
        .await
        .unwrap();
    let mut head = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 413"),
        "{}",
        String::from_utf8_lossy(&head[..n])
    );
    let big = json!({"model": "sim-model", "prompt": "x".repeat(10 << 20)});
    let roomy = router(&sims.urls(), &["--max-body", "33554432"]).await;
    let status = Client::new()
        .post(format!("{}/v1/completions", roomy.url()))
        .json(&big)
        .send()
        .await
        .unwrap()
        .status();
    assert!(status.is_client_error(), "{status}");

    // Nothing was generated, nothing indexed.
    for u in sims.urls() {
        assert_eq!(metric(&u, "vllm:request_success_total", "").await, 0.0);
    }
    assert_eq!(metric(&r.url(), "prefix_router_inflight", "").await, 0.0);
    let index_after = reqwest::get(format!("{}/v1/servers", idx.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(index_before, index_after);
    // And both still serve.
    let ok = Client::new()
        .post(format!("{}/v1/completions", r.url()))
        .json(&json!({"model": "sim-model", "prompt": "fine", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_guard_the_router_and_the_index() {
    let sims = fleet(fast(), 1).await;
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let mut args = IndexArgs::with_listen(listener.local_addr().unwrap());
    args.access.api_key = Some("client-secret".into());
    args.access.admin_key = Some("admin-secret".into());
    let idx = index::spawn(args, listener).await.unwrap();
    let call = |path: &str, key: Option<&str>, body: Value| {
        let mut req = Client::new()
            .post(format!("{}{path}", idx.url()))
            .json(&body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        async move { req.send().await.unwrap().status() }
    };
    let notify = json!({"request": "some text", "server_id": 1});
    let query = json!({"request": "some text", "server_ids": [1]});
    assert_eq!(
        call("/v1/notify", None, notify.clone()).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call("/v1/notify", Some("client-secret"), notify.clone()).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        call("/v1/notify", Some("admin-secret"), notify).await,
        StatusCode::OK
    );
    assert_eq!(
        call("/v1/query", None, query.clone()).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call("/v1/query", Some("wrong-key-here"), query.clone()).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call("/v1/query", Some("client-secret"), query).await,
        StatusCode::OK
    );
    assert_eq!(
        reqwest::get(format!("{}/health", idx.url()))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );

    // A router with its own key, using the guarded index with the admin key.
    let r = router(
        &sims.urls(),
        &[
            "--api-key",
            "router-secret",
            "--index-url",
            &idx.url(),
            "--index-key",
            "admin-secret",
        ],
    )
    .await;
    let body = json!({"model": "sim-model", "prompt": "hello", "max_tokens": 1});
    let resp = Client::new()
        .post(format!("{}/v1/completions", r.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    let resp = Client::new()
        .post(format!("{}/v1/completions", r.url()))
        .bearer_auth("router-secret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        reqwest::get(format!("{}/health", r.url()))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    // The router's notify reached the index (with the admin key).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let servers: Value = Client::new()
        .get(format!("{}/v1/servers", idx.url()))
        .bearer_auth("client-secret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(servers["servers"].as_array().unwrap().len(), 2, "{servers}");
}

/// The router's own key stays at the router; the backend gets its key (vLLM's `--api-key`), or,
/// when the router checks no key, whatever the client sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_key_is_not_forwarded_and_the_backend_key_is() {
    let sims = fleet(
        SimConfig {
            api_key: Some("shared-secret".into()),
            ..fast()
        },
        1,
    )
    .await;
    let body = json!({"model": "sim-model", "prompt": "hello", "max_tokens": 1});
    let status = |r: &Running, key: &'static str| {
        let req = Client::new()
            .post(format!("{}/v1/completions", r.url()))
            .bearer_auth(key)
            .json(&body);
        async move { req.send().await.unwrap().status() }
    };
    // Models are configured: without the backend key the router cannot list them.
    let models = ["--static-models", "sim-model"];

    // The client's token equals the backend's key, but it is the router's: it is not passed on.
    let r = router(
        &sims.urls(),
        &[&models[..], &["--api-key", "shared-secret"]].concat(),
    )
    .await;
    assert_eq!(status(&r, "shared-secret").await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        metric(&sims.urls()[0], "vllm:request_success_total", "").await,
        0.0
    );
    drop(r);

    let r = router(
        &sims.urls(),
        &[
            "--api-key",
            "router-secret",
            "--backend-api-key",
            "shared-secret",
        ],
    )
    .await;
    assert_eq!(status(&r, "router-secret").await, StatusCode::OK);
    assert_eq!(status(&r, "shared-secret").await, StatusCode::UNAUTHORIZED);
    drop(r);

    // A router without keys passes the client's Authorization through.
    let r = router(&sims.urls(), &models).await;
    assert_eq!(status(&r, "shared-secret").await, StatusCode::OK);
    assert_eq!(status(&r, "wrong-secret").await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        metric(&sims.urls()[0], "vllm:request_success_total", "").await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_slow_clients_big_heads_and_too_many_requests() {
    // Each request takes ~300 ms.
    let sims = fleet(
        SimConfig {
            time_scale: 1.0,
            itl_ms: 100.0,
            prefill_overhead_ms: 1.0,
            ..SimConfig::default()
        },
        1,
    )
    .await;
    let r = router(
        &sims.urls(),
        &[
            "--max-concurrent",
            "2",
            "--header-timeout",
            "300ms",
            "--max-header-bytes",
            "16384",
        ],
    )
    .await;
    let body = json!({"model": "sim-model", "prompt": "x", "max_tokens": 4, "ignore_eos": true});
    let calls = (0..3).map(|i| {
        let (url, body) = (r.url(), body.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(i * 50)).await;
            Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    let refused: Vec<_> = answers
        .iter()
        .filter(|a| a.status() == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!(
        refused.len(),
        1,
        "{:?}",
        answers.iter().map(|a| a.status()).collect::<Vec<_>>()
    );
    assert_eq!(refused[0].headers()["retry-after"], "1");

    // A client that never finishes its headers is disconnected.
    let mut slow = tokio::net::TcpStream::connect(r.addr).await.unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the slow client was dropped");

    // Heads above the limit are refused.
    let big = Client::new()
        .post(format!("{}/v1/completions", r.url()))
        .header("x-pad", "a".repeat(40_000))
        .json(&body)
        .send()
        .await;
    match big {
        Ok(resp) => assert!(resp.status().is_client_error(), "{}", resp.status()),
        Err(e) => assert!(e.is_request() || e.is_connect() || e.is_body(), "{e}"),
    }
}

/// A backend killed under load: every request that had not begun streaming succeeds elsewhere,
/// and no request completes twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_under_load_loses_and_duplicates_nothing() {
    let sims = fleet(
        SimConfig {
            time_scale: 1.0,
            itl_ms: 2.0,
            prefill_overhead_ms: 2.0,
            ..SimConfig::default()
        },
        3,
    )
    .await;
    let r = router(&sims.urls(), &[]).await;
    let victim = sims.urls()[0].clone();
    let load = (0..150u64).map(|i| {
        let url = r.url();
        async move {
            tokio::time::sleep(Duration::from_millis(i * 4)).await;
            Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"model": "sim-model", "prompt": format!("request {i} {}", "y".repeat(300)), "max_tokens": 5, "ignore_eos": true}))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let kill = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Client::new()
            .post(format!("{victim}/sim/kill"))
            .send()
            .await
            .unwrap();
    };
    let (statuses, ()) = tokio::join!(futures_util::future::join_all(load), kill);
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(ok, 150, "{statuses:?}");
    Client::new()
        .post(format!("{victim}/sim/revive"))
        .send()
        .await
        .unwrap();
    let mut completed = 0.0;
    for u in sims.urls() {
        completed += metric(
            &u,
            "vllm:request_success_total",
            "finished_reason=\"length\"",
        )
        .await;
    }
    assert_eq!(completed, 150.0, "each request completed exactly once");
    assert_eq!(metric(&r.url(), "prefix_router_inflight", "").await, 0.0);
}

/// A TCP forwarder to PostgreSQL that can be cut, standing for the database going away.
async fn forwarder(target: SocketAddr) -> (u16, Arc<AtomicBool>) {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let up = Arc::new(AtomicBool::new(true));
    let epoch = Arc::new(AtomicU64::new(0));
    let (up2, epoch2) = (up.clone(), epoch.clone());
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            if !up2.load(Ordering::SeqCst) {
                continue;
            }
            let (up3, mine) = (up2.clone(), epoch2.load(Ordering::SeqCst));
            let epoch3 = epoch2.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let cut = async {
                    while up3.load(Ordering::SeqCst) && epoch3.load(Ordering::SeqCst) == mine {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                tokio::select! { _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}, _ = cut => {} }
            });
        }
    });
    (port, up)
}

/// PostgreSQL stopped and started under load: routing continues by load with no client error,
/// and prefix routing resumes once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_degrades_to_load_routing_without_client_errors() {
    let base = std::env::var("PREFIX_ROUTER_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok((client, conn)) = tokio_postgres::connect(&base, tokio_postgres::NoTls).await else {
        assert!(!support::in_ci(), "PostgreSQL is required in CI");
        return;
    };
    tokio::spawn(conn);
    let schema = format!("prefix_router_test_{}_outage", std::process::id());
    client
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ))
        .await
        .unwrap();
    let config: tokio_postgres::Config = base.parse().unwrap();
    let pg_port = config.get_ports().first().copied().unwrap_or(5432);
    let (proxy_port, up) = forwarder(SocketAddr::from(([127, 0, 0, 1], pg_port))).await;
    let proxied = base.replacen(
        &format!("127.0.0.1:{pg_port}"),
        &format!("127.0.0.1:{proxy_port}"),
        1,
    );
    let url = format!("{proxied}?options=-csearch_path%3D{schema}");

    let sims = fleet(fast(), 3).await;
    let r = router(&sims.urls(), &["--store", &url, "--store-timeout", "100ms"]).await;
    let system = "Shared instructions for everyone. ".repeat(30);
    let send = |i: u64| {
        let (url, system) = (r.url(), system.clone());
        async move {
            Client::new()
                .post(format!("{url}/v1/chat/completions"))
                .json(&json!({"model": "sim-model", "max_tokens": 1, "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": format!("q{i}")}]}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    for i in 0..10 {
        assert_eq!(send(i).await, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let hits_before = metric(
        &r.url(),
        "prefix_router_routing_decisions_total",
        "reason=\"cost_hit\"",
    )
    .await;
    assert!(
        hits_before >= 5.0,
        "prefix routing works on PostgreSQL: {hits_before}"
    );
    up.store(false, Ordering::SeqCst);
    // The forwarder cuts open connections within 20 ms; a release build answers all twenty
    // requests below sooner than that, through the connections still open.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 10..30 {
        assert_eq!(
            send(i).await,
            StatusCode::OK,
            "no client error during the outage"
        );
    }
    assert!(
        metric(
            &r.url(),
            "prefix_router_routing_decisions_total",
            "reason=\"store_unavailable\""
        )
        .await
            >= 10.0
    );
    up.store(true, Ordering::SeqCst);
    let mut resumed = false;
    for i in 30..200 {
        assert_eq!(send(i).await, StatusCode::OK);
        if metric(
            &r.url(),
            "prefix_router_routing_decisions_total",
            "reason=\"cost_hit\"",
        )
        .await
            > hits_before + 2.0
        {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(resumed, "prefix routing resumes when the database is back");
    let _ = client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await;
}

/// A hostile KV-event publisher: it greets as PUB and declares a frame of 2^50 bytes (nine
/// bytes once aborted the router), then does so again on every reconnection. The router
/// refuses it before reading, counts it, matches that backend by strings, and serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_declaring_huge_frames_is_refused_and_the_router_serves_on() {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(LOOPBACK))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut greeting = [0u8; 64];
                greeting[0] = 0xFF;
                greeting[9] = 0x7F;
                greeting[10] = 3;
                greeting[11] = 1;
                greeting[12..16].copy_from_slice(b"NULL");
                let ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
                let mut hostile = greeting.to_vec();
                hostile.extend_from_slice(&[0x04, ready.len() as u8]);
                hostile.extend_from_slice(ready);
                hostile.push(0x02);
                hostile.extend_from_slice(&(1u64 << 50).to_be_bytes());
                let _ = stream.write_all(&hostile).await;
                let mut sink = [0u8; 1024];
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    let sims = fleet(fast(), 1).await;
    let r = router(
        &sims.urls(),
        &["--kv-events", "--kv-events-port", &port.to_string()],
    )
    .await;
    let url = r.url();
    let refused =
        || async { metric(&url, "prefix_router_kv_events_total", "kind=\"refused\"").await >= 1.0 };
    let mut seen = false;
    for _ in 0..100 {
        if refused().await {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen, "the hostile publisher was refused");
    let client = Client::new();
    for i in 0..5 {
        let resp = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "sim-model", "prompt": format!("hello {i}"), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    }
    let health: Value = client
        .get(format!("{url}/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["healthy_backends"], 1);
}
