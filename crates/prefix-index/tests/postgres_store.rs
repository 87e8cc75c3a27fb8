//! The PostgreSQL store against the conformance suite, on a real server: each test in its own
//! schema. Without a server the tests skip, except in CI (`PREFIX_ROUTER_CI`), where they fail.
//! `PREFIX_ROUTER_TEST_POSTGRES` overrides the URL (default: postgres@127.0.0.1:5432/test).

mod conformance;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use conformance::{h, t};
use prefix_index::{PostgresStore, PrefixStore, StoreConfig, StoreError};

fn base_url() -> String {
    std::env::var("PREFIX_ROUTER_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Whether a server answers; in CI a missing server is a failure, not a skip.
fn pg_ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        let config: tokio_postgres::Config = base_url().parse().expect("a valid test URL");
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".into(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let up = std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))
            .ok()
            .and_then(|mut a| a.next())
            .is_some_and(|a| {
                std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok()
            });
        if !up {
            assert!(
                std::env::var_os("PREFIX_ROUTER_CI").is_none(),
                "PostgreSQL is required in CI but {} does not answer",
                base_url()
            );
            eprintln!("skipping: no PostgreSQL at {}", base_url());
        }
        up
    })
}

/// Drops the test schemas of test processes that are gone.
async fn sweep(client: &tokio_postgres::Client) {
    let rows = client
        .query(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'prefix_router_test_%'",
            &[],
        )
        .await
        .unwrap();
    for row in rows {
        let name: String = row.get(0);
        let pid = name
            .trim_start_matches("prefix_router_test_")
            .split('_')
            .next()
            .unwrap_or("");
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                .await;
        }
    }
}

/// A fresh schema and a URL whose connections use it.
async fn fresh_schema() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let schema = format!("prefix_router_test_{}_{n}", std::process::id());
    let (client, connection) = tokio_postgres::connect(&base_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    if n == 0 {
        sweep(&client).await;
    }
    client
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ))
        .await
        .unwrap();
    let sep = if base_url().contains('?') { '&' } else { '?' };
    format!("{}{sep}options=-csearch_path%3D{schema}", base_url())
}

async fn make(config: StoreConfig) -> PostgresStore {
    PostgresStore::open(&fresh_schema().await, config, 4)
        .await
        .unwrap()
}

conformance_suite!(make, ready = crate::pg_ready);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Two stores (two pools, as two processes would have) notify the same servers at once: no
/// update is lost and no server ends above its capacity.
#[test]
fn concurrent_notifies_from_two_processes_stay_within_capacity() {
    if !pg_ready() {
        return;
    }
    rt().block_on(async {
        let url = fresh_schema().await;
        let config = conformance::config(40, None);
        let a = Arc::new(PostgresStore::open(&url, config, 4).await.unwrap());
        let b = Arc::new(PostgresStore::open(&url, config, 4).await.unwrap());
        let tasks: Vec<_> = (0..8u64)
            .map(|i| {
                let store = if i % 2 == 0 { a.clone() } else { b.clone() };
                tokio::spawn(async move {
                    for j in 0..25u64 {
                        let text: String = (0..20)
                            .map(|k| {
                                if (i * 31 + j * 7 + k) % 3 == 0 {
                                    'a'
                                } else {
                                    'b'
                                }
                            })
                            .collect();
                        store
                            .notify(&h(&text), j % 3, t(i * 100 + j))
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        for s in a.servers().await.unwrap() {
            assert!(s.entries <= s.capacity, "{s:?}");
            let rows: i64 = client
                .query_one(
                    "SELECT count(*) FROM prefix_router_entries WHERE server_id = $1",
                    &[&prefix_index::sql::encode(s.server_id)],
                )
                .await
                .unwrap()
                .get(0);
            assert_eq!(rows as u64, s.entries, "the count matches the rows: {s:?}");
        }
    });
}

#[test]
fn foreign_and_newer_schemas_and_unreachable_servers_are_clear_errors() {
    if !pg_ready() {
        return;
    }
    rt().block_on(async {
        let config = conformance::config(10, None);
        let url = fresh_schema().await;
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .batch_execute("CREATE TABLE prefix_router_entries (x TEXT)")
            .await
            .unwrap();
        let err = PostgresStore::open(&url, config, 1).await.err().unwrap();
        assert!(err.to_string().contains("foreign"), "{err}");

        let url = fresh_schema().await;
        drop(PostgresStore::open(&url, config, 1).await.unwrap());
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .batch_execute("UPDATE prefix_router_meta SET value = '7' WHERE key = 'schema_version'")
            .await
            .unwrap();
        let err = PostgresStore::open(&url, config, 1).await.err().unwrap();
        assert!(err.to_string().contains("newer"), "{err}");
        // Opening the same schema twice is fine (a second router).
        let url = fresh_schema().await;
        let _first = PostgresStore::open(&url, config, 1).await.unwrap();
        let _second = PostgresStore::open(&url, config, 1).await.unwrap();

        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let err = PostgresStore::open(
            &format!("postgres://postgres@127.0.0.1:{closed}/test"),
            config,
            1,
        )
        .await
        .err()
        .unwrap();
        assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
        assert!(err.to_string().contains("cannot reach PostgreSQL"), "{err}");
    });
}

/// A TCP forwarder that can be cut and restored, standing for the network to the database.
async fn forwarder(target: std::net::SocketAddr) -> (u16, Arc<std::sync::atomic::AtomicBool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let gen = Arc::new(AtomicU64::new(0));
    let up2 = up.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            if !up2.load(Ordering::SeqCst) {
                continue; // dropped: refused in effect
            }
            let (up3, gen2) = (up2.clone(), gen.clone());
            let mine = gen2.load(Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let copy = tokio::io::copy_bidirectional(&mut inbound, &mut outbound);
                let cut = async {
                    while up3.load(Ordering::SeqCst) && gen2.load(Ordering::SeqCst) == mine {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                tokio::select! { _ = copy => {}, _ = cut => {} }
            });
        }
    });
    (port, up)
}

/// The database going away mid-run makes operations fail fast (no panic, no hang); when it is
/// back, the store reconnects by itself.
#[test]
fn an_outage_fails_operations_and_the_store_reconnects() {
    if !pg_ready() {
        return;
    }
    rt().block_on(async {
        let url = fresh_schema().await;
        let config: tokio_postgres::Config = url.parse().unwrap();
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let (proxy_port, up) = forwarder(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await;
        let proxied = url.replacen(
            &format!("127.0.0.1:{port}"),
            &format!("127.0.0.1:{proxy_port}"),
            1,
        );
        let store = PostgresStore::open(&proxied, conformance::config(100, None), 2)
            .await
            .unwrap();
        store.notify(&h("aabb"), 1, t(1)).await.unwrap();
        up.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = std::time::Instant::now();
        let failed =
            tokio::time::timeout(Duration::from_secs(20), store.query(&h("aabb"), &[1], t(2)))
                .await;
        assert!(
            matches!(failed, Ok(Err(StoreError::Unavailable(_)))),
            "{failed:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(15));
        up.store(true, Ordering::SeqCst);
        let mut back = false;
        for _ in 0..50 {
            if let Ok(q) = store.query(&h("aabb"), &[1], t(3)).await {
                assert_eq!(q.matched, 2);
                back = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(back, "the store reconnects when the database is back");
    });
}
