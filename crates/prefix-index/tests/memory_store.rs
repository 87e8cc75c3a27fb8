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

/// A peer's export merged into a store that holds entries of its own is the store that would
/// have seen both streams of notifies (latest `last_used` wins); over capacity, the oldest go.
#[test]
fn merging_an_export_equals_replaying_its_notifies() {
    let config = StoreConfig {
        default_capacity: 10_000,
        ttl_ms: None,
    };
    let hasher = PrefixHasher::new(8, 1).unwrap();
    let request = |i: u64| {
        let text = format!("system {} / user {} / turn {}", i % 3, i % 11, i);
        hasher.hash(text.as_bytes())
    };
    let (peer, own, replayed) = (
        MemoryStore::new(config).unwrap(),
        MemoryStore::new(config).unwrap(),
        MemoryStore::new(config).unwrap(),
    );
    for i in 0..200u64 {
        let (server, t) = (i % 3, Tick::from_millis(1_000 + i * 7 % 130));
        if i % 2 == 0 {
            peer.notify_now(&request(i), server, t).unwrap();
        } else {
            own.notify_now(&request(i), server, t).unwrap();
        }
        replayed.notify_now(&request(i), server, t).unwrap();
    }
    for (server, _, mut entries) in peer.export() {
        assert_eq!(own.merge(server, &mut entries).unwrap(), 0);
    }
    assert_eq!(own.export(), replayed.export());
    assert_eq!(own.entries(), replayed.entries());

    // Over capacity: the merged server keeps its most recent entries, prefix-closed.
    own.set_capacity_now(0, 40).unwrap();
    let mut newer: Vec<_> = (0..8u64)
        .flat_map(|i| {
            request(10_000 + i)
                .as_slice()
                .iter()
                .enumerate()
                .map(|(d, &h)| (h, d as u32 + 1, Tick::from_millis(5_000)))
                .collect::<Vec<_>>()
        })
        .collect();
    let evicted = own.merge(0, &mut newer).unwrap();
    assert!(evicted > 0);
    let servers = own.servers_now();
    assert_eq!(
        servers.iter().find(|s| s.server_id == 0).unwrap().entries,
        40
    );
    let q = own
        .query_now(&request(10_000), &[0], Tick::from_millis(5_000))
        .unwrap();
    assert_eq!(q.matched, q.total, "the newest request is held whole");
}
