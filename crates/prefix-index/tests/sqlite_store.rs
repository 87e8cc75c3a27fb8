//! The SQLite store against the conformance suite, plus restart and schema checks.

mod conformance;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use conformance::{h, t};
use prefix_index::{PrefixStore, SqliteStore, StoreConfig, StoreError};

fn temp_db() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("prefix-index-sqlite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}.db", N.fetch_add(1, Ordering::Relaxed)))
}

async fn make(config: StoreConfig) -> SqliteStore {
    SqliteStore::open(&temp_db(), config).unwrap()
}

conformance_suite!(make);

/// The state after a reopen (journal replayed) and after a second one (snapshot loaded) is
/// exactly the state before, down to the eviction order.
#[test]
fn state_survives_reopens_exactly() {
    conformance::runtime().block_on(async {
        let path = temp_db();
        let config = conformance::config(6, None);
        let texts = ["aabbccdd", "aabbzz", "bbbbbbbbbb", "ab", "aabbccddee"];
        let before = {
            let store = SqliteStore::open(&path, config).unwrap();
            for (i, text) in texts.iter().enumerate() {
                store
                    .notify(&h(text), (i % 2) as u64, t(i as u64 * 3))
                    .await
                    .unwrap();
            }
            store.set_capacity(7, 3).await.unwrap();
            store.drop_server(5).await.unwrap();
            store.servers().await.unwrap()
        };
        for _ in 0..2 {
            let store = SqliteStore::open(&path, config).unwrap();
            assert_eq!(store.servers().await.unwrap(), before);
            for text in texts {
                let q = store.query(&h(text), &[0, 1, 7], t(100)).await.unwrap();
                assert_eq!(q.total, h(text).len() as u64);
            }
            let q = store.query(&h("aabbccddee"), &[0], t(100)).await.unwrap();
            assert_eq!(q.matched, 5);
        }
        // The same next notify evicts the same entries as it would have before the reopens.
        let store = SqliteStore::open(&path, config).unwrap();
        let out = store.notify(&h("zzzzzz"), 0, t(50)).await.unwrap();
        let reference = prefix_index::ReferenceStore::new(config);
        for (i, text) in texts.iter().enumerate() {
            reference
                .notify(&h(text), (i % 2) as u64, t(i as u64 * 3))
                .await
                .unwrap();
        }
        assert_eq!(out, reference.notify(&h("zzzzzz"), 0, t(50)).await.unwrap());
    });
}

#[test]
fn a_second_process_is_refused() {
    let path = temp_db();
    let config = conformance::config(6, None);
    let _owner = SqliteStore::open(&path, config).unwrap();
    let err = SqliteStore::open(&path, config)
        .err()
        .expect("the file is in use");
    assert!(err.to_string().contains("in use"), "{err}");
}

#[test]
fn foreign_and_newer_schemas_are_refused() {
    let config = conformance::config(100, None);
    let path = temp_db();
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE prefix_router_entries (x TEXT);")
            .unwrap();
    }
    let err = SqliteStore::open(&path, config).err().unwrap();
    assert!(matches!(err, StoreError::Incompatible(_)), "{err}");
    assert!(err.to_string().contains("foreign"), "{err}");

    let path = temp_db();
    drop(SqliteStore::open(&path, config).unwrap());
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "UPDATE prefix_router_meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
    }
    let err = SqliteStore::open(&path, config).err().unwrap();
    assert!(err.to_string().contains("newer"), "{err}");
}

/// Writing a snapshot (here of 128k entries) happens on the store's writer thread: the task
/// whose notify triggered it waits without holding its async worker, so on a one-thread runtime
/// a query answers while the snapshot is still being written. (Before, the snapshot ran inside
/// the notify's poll and the query could only run once it was done.)
#[test]
fn a_snapshot_does_not_stall_the_async_worker() {
    conformance::runtime().block_on(async {
        let path = temp_db();
        let rows = 2_001;
        let store = std::sync::Arc::new(
            SqliteStore::open_compacting_after(&path, conformance::config(1 << 20, None), rows)
                .unwrap(),
        );
        let text = |i: u64| format!("{i:08}").repeat(16);
        for i in 0..rows - 1 {
            store.notify(&h(&text(i)), i % 4, t(i)).await.unwrap();
        }
        let entries: u64 = store
            .servers()
            .await
            .unwrap()
            .iter()
            .map(|s| s.entries)
            .sum();
        assert!(entries >= 100_000, "{entries}");
        // This notify is the journal's last row before the snapshot.
        let writing = tokio::spawn({
            let store = store.clone();
            async move { store.notify(&h(&text(rows)), 0, t(rows)).await }
        });
        tokio::task::yield_now().await;
        let q = store
            .query(&h(&text(7)), &[0, 1, 2, 3], t(rows))
            .await
            .unwrap();
        assert_eq!((q.best, q.matched), (3, 64));
        assert!(
            !writing.is_finished(),
            "the query answered while the snapshot was being written"
        );
        writing.await.unwrap().unwrap();
        drop(store);
        let reopened = SqliteStore::open(&path, conformance::config(1 << 20, None)).unwrap();
        let q = reopened.query(&h(&text(7)), &[3], t(rows)).await.unwrap();
        assert_eq!(q.matched, q.total, "the snapshot holds the state");
    });
}
