//! The memory store against the conformance suite, plus its concurrency checks.

mod conformance;

use std::sync::Arc;

use prefix_index::{MemoryStore, PrefixHasher, PrefixStore, StoreConfig, Tick};

async fn make(config: StoreConfig) -> MemoryStore {
    MemoryStore::new(config).unwrap()
}

conformance_suite!(make);

/// Many threads notify and query at once; afterwards every server is within capacity and the
/// index holds exactly the entries the servers account for.
#[test]
fn concurrent_notify_query_drop_stay_consistent() {
    let store = Arc::new(
        MemoryStore::new(StoreConfig {
            default_capacity: 200,
            ttl_ms: None,
        })
        .unwrap(),
    );
    let hasher = PrefixHasher::new(8, 1).unwrap();
    let threads: Vec<_> = (0..4u64)
        .map(|thread| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..3_000u64 {
                    let text = format!("system prompt {} / user {} / turn {}", i % 7, i % 31, i);
                    let hashes = hasher.hash(text.as_bytes());
                    let server = (i * 7 + thread) % 6;
                    let t = Tick::from_millis(i);
                    store.notify_now(&hashes, server, t).unwrap();
                    let q = store.query_now(&hashes, &[0, 1, 2, 3, 4, 5], t).unwrap();
                    assert!(q.matched <= q.total);
                    if i % 500 == 499 {
                        store.drop_server_now((i + thread) % 6);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let servers = store.servers_now();
    assert!(servers.iter().all(|s| s.entries <= s.capacity));
    let accounted: u64 = servers.iter().map(|s| s.entries).sum();
    assert_eq!(store.index_stamps(), accounted);
    for s in &servers {
        store.drop_server_now(s.server_id);
    }
    assert_eq!(store.index_stamps(), 0);
    assert_eq!(store.entries(), 0);
}

#[test]
fn trait_object_use() {
    let store: Arc<dyn PrefixStore> = Arc::new(MemoryStore::new(StoreConfig::default()).unwrap());
    let hashes = PrefixHasher::default().hash(&[b'x'; 300]);
    conformance::runtime().block_on(async {
        store
            .notify(&hashes, 9, Tick::from_millis(1))
            .await
            .unwrap();
        let q = store
            .query(&hashes, &[1, 9], Tick::from_millis(2))
            .await
            .unwrap();
        assert_eq!((q.best, q.matched, q.total), (9, 3, 3));
        assert_eq!(store.kind(), "memory");
    });
}
