//! The SQL stores behind the real binaries: crash safety of SQLite under SIGKILL, the router on
//! SQLite and PostgreSQL, and a database that cannot be reached at start.

#[path = "../../vllm-sim/tests/support.rs"]
mod support;

use std::time::Duration;

use prefix_index::{PrefixHasher, PrefixStore, SqliteStore, StoreConfig, Tick};
use reqwest::Client;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_prefix-router")
}

/// Starts the binary and waits for its "listen=ADDR" log line.
async fn start(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(exe())
        .args(args)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the process logs its address");
            if let Some(rest) = line.split("listen=").nth(1) {
                return rest.split_whitespace().next().unwrap().to_owned();
            }
        }
    })
    .await
    .expect("started within 30 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("prefix-router-stores-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Notifies stream into `index --store sqlite:PATH` until the process is killed with SIGKILL;
/// reopened, the store holds every notify that was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_every_acknowledged_notify_through_sigkill() {
    let db = temp("crash.db");
    let store_arg = format!("sqlite:{}", db.display());
    let (mut child, addr) = start(&[
        "index",
        "--listen",
        "127.0.0.1:0",
        "--store",
        &store_arg,
        "--chunk-size",
        "16",
    ])
    .await;
    let client = Client::new();
    let acknowledged = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let (client, addr, acked) = (client.clone(), addr.clone(), acknowledged.clone());
            tokio::spawn(async move {
                for i in 0.. {
                    let text = format!("writer {w} request {i} {}", "x".repeat(64));
                    let body = json!({"request": text, "server_id": w, "t": 1000.0 + i as f64});
                    match client
                        .post(format!("http://{addr}/v1/notify"))
                        .json(&body)
                        .send()
                        .await
                    {
                        Ok(r) if r.status().is_success() => acked.lock().push((w, text)),
                        _ => return,
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(600)).await;
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    for w in writers {
        w.await.unwrap();
    }
    let acked = acknowledged.lock().clone();
    assert!(acked.len() > 20, "the load ran: {}", acked.len());
    let store = SqliteStore::open(&db, StoreConfig::default()).unwrap();
    let hasher = PrefixHasher::new(16, 0).unwrap();
    for (server, text) in &acked {
        let hashes = hasher.hash(text.as_bytes());
        let q = store
            .query(&hashes, &[*server], Tick::from_secs(1e6))
            .await
            .unwrap();
        assert_eq!(q.matched, q.total, "acknowledged notify lost: {text}");
    }
}

async fn chat_through(router: &str, system: &str) -> u64 {
    let body = json!({"model": "sim-model", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]});
    let v: serde_json::Value = Client::new()
        .post(format!("http://{router}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

async fn postgres_schema() -> Option<String> {
    let base = std::env::var("PREFIX_ROUTER_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let connected = tokio_postgres::connect(&base, tokio_postgres::NoTls).await;
    let Ok((client, connection)) = connected else {
        assert!(
            !support::in_ci(),
            "PostgreSQL is required in CI: {:?}",
            connected.err()
        );
        eprintln!("skipping: no PostgreSQL at {base}");
        return None;
    };
    tokio::spawn(connection);
    let schema = format!("prefix_router_test_{}_router", std::process::id());
    client
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ))
        .await
        .unwrap();
    Some(format!("{base}?options=-csearch_path%3D{schema}"))
}

/// The router on each SQL store routes a shared prompt to the backend that cached it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_routes_by_prefix_on_sqlite_and_postgres() {
    let fleet = vllm_sim::Fleet::start(
        vllm_sim::SimConfig {
            time_scale: 0.0,
            ..vllm_sim::SimConfig::default()
        },
        3,
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
    )
    .await
    .unwrap();
    let mut stores = vec![format!("sqlite:{}", temp("router.db").display())];
    stores.extend(postgres_schema().await);
    for store in stores {
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            &store,
            "--log",
            "info",
        ];
        let urls = fleet.urls();
        for u in &urls {
            args.extend(["--backend", u.as_str()]);
        }
        let (mut child, addr) = start(&args).await;
        for u in &urls {
            Client::new()
                .post(format!("{u}/sim/reset"))
                .send()
                .await
                .unwrap();
        }
        let system = "You are a careful assistant. ".repeat(40);
        assert_eq!(chat_through(&addr, &system).await, 0);
        for _ in 0..3 {
            // Database stores notify in the background: give it a moment to land.
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(
                chat_through(&addr, &system).await > 200,
                "{store}: the prompt's backend is found again"
            );
        }
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_database_at_start_is_a_clear_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = Command::new(exe())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            &format!("postgres://postgres@127.0.0.1:{port}/test"),
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot reach PostgreSQL"), "{stderr}");
}
