//! notify+query pairs per second on 8 KiB requests for every store, in one run:
//! memory, SQLite (one process), PostgreSQL (one process, then two processes together).
//!
//! Two mixes: `steady` (1,024 distinct requests, which fit the servers' capacity: after the
//! first round every query hits and every notify refreshes 64 entries) and `churn` (8,192
//! distinct requests: every notify inserts 64 entries and evicts 64, the worst case).
//!
//! `cargo bench -p prefix-index --bench store_pairs`   (PostgreSQL from
//! `PREFIX_ROUTER_TEST_POSTGRES`, default postgres@127.0.0.1:5432/test; skipped if absent)

mod fixtures;

use std::sync::Arc;
use std::time::{Duration, Instant};

use prefix_index::{
    MemoryStore, PostgresStore, PrefixHashes, PrefixStore, SqliteStore, StoreConfig, Tick,
};

const SERVERS: u64 = 8;
const SECONDS: f64 = 5.0;

#[derive(Clone, Copy)]
enum Mix {
    Steady,
    Churn,
}

fn requests(mix: Mix) -> Arc<Vec<PrefixHashes>> {
    let n = match mix {
        Mix::Steady => 1024,
        Mix::Churn => 8192,
    };
    Arc::new((0..n).map(fixtures::hashed).collect())
}

/// Runs pairs from `tasks` concurrent tasks for `SECONDS`; returns pairs per second. A query
/// that matches nothing sends the request to the next server in turn.
async fn pairs(store: Arc<dyn PrefixStore>, tasks: usize, offset: u64, mix: Mix) -> f64 {
    let reqs = requests(mix);
    let candidates: Arc<Vec<u64>> = Arc::new((0..SERVERS).collect());
    let until = Instant::now() + Duration::from_secs_f64(SECONDS);
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (store, reqs, candidates) = (store.clone(), reqs.clone(), candidates.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                let mut i = task as u64 * 7919 + offset;
                while Instant::now() < until {
                    i += 1;
                    let hashes = &reqs[(i % reqs.len() as u64) as usize];
                    let t = Tick::from_millis(1_000_000 + i);
                    let q = store.query(hashes, &candidates, t).await.expect("query");
                    let server = if q.matched > 0 { q.best } else { i % SERVERS };
                    store.notify(hashes, server, t).await.expect("notify");
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn config() -> StoreConfig {
    StoreConfig {
        default_capacity: 16_384,
        ttl_ms: None,
    }
}

fn pg_url() -> String {
    std::env::var("PREFIX_ROUTER_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The PostgreSQL part, also run by the second process (`--pg-worker`).
async fn postgres_pairs(url: &str, offset: u64, mix: Mix) -> f64 {
    let store: Arc<dyn PrefixStore> = Arc::new(
        PostgresStore::open(url, config(), 16)
            .await
            .expect("PostgreSQL"),
    );
    pairs(store, 16, offset, mix).await
}

async fn bench_schema() -> Option<String> {
    let (client, conn) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    client
        .batch_execute(
            "DROP SCHEMA IF EXISTS prefix_router_bench CASCADE; CREATE SCHEMA prefix_router_bench;",
        )
        .await
        .ok()?;
    let sep = if pg_url().contains('?') { '&' } else { '?' };
    Some(format!(
        "{}{sep}options=-csearch_path%3Dprefix_router_bench",
        pg_url()
    ))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mix_of = |name: &str| {
        if name == "churn" {
            Mix::Churn
        } else {
            Mix::Steady
        }
    };
    if let Some(pos) = args.iter().position(|a| a == "--pg-worker") {
        let (url, mix) = (&args[pos + 1], mix_of(&args[pos + 2]));
        println!("{}", postgres_pairs(url, 1 << 32, mix).await);
        return;
    }
    println!("notify+query pairs per second, 8 KiB requests (64 chunks), {SERVERS} servers, {SECONDS} s each");
    for (name, mix) in [("steady", Mix::Steady), ("churn", Mix::Churn)] {
        let memory: Arc<dyn PrefixStore> = Arc::new(MemoryStore::new(config()).unwrap());
        println!(
            "{name:<7} {:<36} {:>10.0}",
            "memory, 1 task",
            pairs(memory, 1, 0, mix).await
        );
        let db =
            std::env::temp_dir().join(format!("prefix-bench-{}-{name}.db", std::process::id()));
        let sqlite: Arc<dyn PrefixStore> = Arc::new(SqliteStore::open(&db, config()).unwrap());
        println!(
            "{name:<7} {:<36} {:>10.0}",
            "sqlite, 1 process",
            pairs(sqlite, 2, 0, mix).await
        );
        let _ = std::fs::remove_file(&db);
        let Some(url) = bench_schema().await else {
            println!("postgres: skipped (no server at {})", pg_url());
            continue;
        };
        let one = postgres_pairs(&url, 0, mix).await;
        println!(
            "{name:<7} {:<36} {:>10.0}",
            "postgres, 1 process (16 conns)", one
        );
        // Two processes together on the same schema.
        let exe = std::env::current_exe().unwrap();
        let child = tokio::process::Command::new(exe)
            .args(["--pg-worker", &url, name])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (mine, theirs) =
            tokio::join!(postgres_pairs(&url, 1 << 40, mix), child.wait_with_output());
        let theirs: f64 = String::from_utf8_lossy(&theirs.unwrap().stdout)
            .trim()
            .parse()
            .unwrap_or(0.0);
        println!(
            "{name:<7} {:<36} {:>10.0}   ({:.0} + {:.0}; {:.2}x one process)",
            "postgres, 2 processes together",
            mine + theirs,
            mine,
            theirs,
            (mine + theirs) / one
        );
    }
}
