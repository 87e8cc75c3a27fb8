//! The store conformance suite: every store runs these scenarios and the random-sequence
//! comparison against the reference model. A store's test file calls
//! `conformance_suite!(make_store)` where `make_store(StoreConfig) -> impl Future<Output = S>`.
//!
//! Shared by path with other crates' tests, so it depends only on prefix-index, proptest and
//! tokio.
#![allow(dead_code)]

use std::future::Future;

use prefix_index::{
    PrefixHasher, PrefixHashes, PrefixStore, ReferenceStore, ServerId, StoreConfig, StoreError,
    Tick,
};
use proptest::prelude::*;

/// Small chunks over a two-letter alphabet make random requests share prefixes often.
pub fn hasher() -> PrefixHasher {
    PrefixHasher::new(2, 99).unwrap()
}

pub fn h(text: &str) -> PrefixHashes {
    hasher().hash(text.as_bytes())
}

pub fn t(ms: u64) -> Tick {
    Tick::from_millis(ms)
}

pub fn config(capacity: u64, ttl_ms: Option<u64>) -> StoreConfig {
    StoreConfig {
        default_capacity: capacity,
        ttl_ms,
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn matched<S: PrefixStore + ?Sized>(s: &S, text: &str, server: ServerId, at: u64) -> u64 {
    s.query(&h(text), &[server], t(at)).await.unwrap().matches[0]
}

async fn entries<S: PrefixStore + ?Sized>(s: &S, server: ServerId) -> u64 {
    s.servers()
        .await
        .unwrap()
        .iter()
        .find(|i| i.server_id == server)
        .map_or(0, |i| i.entries)
}

// ---- scenarios -------------------------------------------------------------------------------

pub async fn same_request_twice_is_a_full_hit<S: PrefixStore>(s: S) {
    let first = s.notify(&h("aabbccdd"), 1, t(1)).await.unwrap();
    assert_eq!((first.chunks, first.inserted, first.evicted), (4, 4, 0));
    let second = s.notify(&h("aabbccdd"), 1, t(2)).await.unwrap();
    assert_eq!((second.chunks, second.inserted, second.evicted), (4, 0, 0));
    assert_eq!(matched(&s, "aabbccdd", 1, 3).await, 4);
    // A longer request matches the stored prefix; a different one matches nothing.
    assert_eq!(matched(&s, "aabbccddee", 1, 3).await, 4);
    assert_eq!(matched(&s, "aabbXX", 1, 3).await, 2);
    assert_eq!(matched(&s, "zzbbccdd", 1, 3).await, 0);
}

pub async fn least_recently_used_goes_first<S: PrefixStore>(s: S) {
    // Capacity 4 from the config: two 2-chunk requests fit, the third evicts the oldest.
    s.notify(&h("aaaa"), 1, t(1)).await.unwrap();
    s.notify(&h("bbbb"), 1, t(2)).await.unwrap();
    s.notify(&h("aaaa"), 1, t(3)).await.unwrap(); // refresh: now "bbbb" is the oldest
    let out = s.notify(&h("cccc"), 1, t(4)).await.unwrap();
    assert_eq!((out.inserted, out.evicted), (2, 2));
    assert_eq!(matched(&s, "aaaa", 1, 5).await, 2);
    assert_eq!(matched(&s, "bbbb", 1, 5).await, 0);
    assert_eq!(matched(&s, "cccc", 1, 5).await, 2);
}

pub async fn deepest_first_keeps_the_set_prefix_closed<S: PrefixStore>(s: S) {
    // Capacity 4: a 6-chunk request keeps its first 4 chunks.
    let out = s.notify(&h("aabbccddeeff"), 1, t(1)).await.unwrap();
    assert_eq!((out.chunks, out.inserted, out.evicted), (6, 6, 2));
    assert_eq!(matched(&s, "aabbccddeeff", 1, 2).await, 4);
    // Another request at a later time evicts the old one's deepest entries first.
    s.notify(&h("xxyy"), 1, t(2)).await.unwrap();
    assert_eq!(matched(&s, "aabbccddeeff", 1, 3).await, 2);
    assert_eq!(entries(&s, 1).await, 4);
}

pub async fn refresh_never_moves_time_backwards<S: PrefixStore>(s: S) {
    s.notify(&h("aaaa"), 1, t(10)).await.unwrap();
    s.notify(&h("bbbb"), 1, t(5)).await.unwrap();
    // "aaaa" at an older time keeps last_used 10, so "bbbb" (5) is still the oldest.
    s.notify(&h("aaaa"), 1, t(1)).await.unwrap();
    s.notify(&h("cccc"), 1, t(11)).await.unwrap();
    assert_eq!(matched(&s, "aaaa", 1, 12).await, 2);
    assert_eq!(matched(&s, "bbbb", 1, 12).await, 0);
}

pub async fn ties_go_to_the_earliest_candidate<S: PrefixStore>(s: S) {
    s.notify(&h("aabbcc"), 7, t(1)).await.unwrap();
    s.notify(&h("aabbcc"), 3, t(1)).await.unwrap();
    s.notify(&h("aabb"), 5, t(1)).await.unwrap();
    let q = s.query(&h("aabbccdd"), &[5, 3, 7, 42], t(2)).await.unwrap();
    assert_eq!(q.best, 3);
    assert_eq!(q.matched, 3);
    assert_eq!(q.total, 4);
    assert_eq!(q.matches, vec![2, 3, 3, 0]);
    let q = s.query(&h("aabbccdd"), &[7, 3], t(2)).await.unwrap();
    assert_eq!(q.best, 7);
    // Nobody matches: the first candidate, with 0.
    let q = s.query(&h("zz"), &[42, 7], t(2)).await.unwrap();
    assert_eq!((q.best, q.matched, q.matches), (42, 0, vec![0, 0]));
}

pub async fn query_changes_nothing<S: PrefixStore>(s: S) {
    s.notify(&h("aaaa"), 1, t(1)).await.unwrap();
    s.notify(&h("bbbb"), 1, t(2)).await.unwrap();
    let before = s.servers().await.unwrap();
    // A query of the older request at a later time must not refresh it.
    s.query(&h("aaaa"), &[1, 2], t(100)).await.unwrap();
    assert_eq!(s.servers().await.unwrap(), before);
    s.notify(&h("cccc"), 1, t(3)).await.unwrap();
    assert_eq!(matched(&s, "aaaa", 1, 4).await, 0);
    assert_eq!(matched(&s, "bbbb", 1, 4).await, 2);
}

pub async fn empty_request_and_unknown_servers<S: PrefixStore>(s: S) {
    let out = s.notify(&h(""), 1, t(1)).await.unwrap();
    assert_eq!((out.chunks, out.inserted, out.evicted), (0, 0, 0));
    let q = s.query(&h(""), &[1, 2], t(1)).await.unwrap();
    assert_eq!((q.best, q.matched, q.total), (1, 0, 0));
    assert_eq!(matched(&s, "aabb", 99, 1).await, 0);
    let err = s.query(&h("aabb"), &[], t(1)).await.unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(_)), "{err}");
}

pub async fn ttl_hides_old_entries<S: PrefixStore>(s: S) {
    // TTL 10 ms from the config.
    s.notify(&h("aabbcc"), 1, t(100)).await.unwrap();
    s.notify(&h("aabb"), 1, t(105)).await.unwrap();
    assert_eq!(matched(&s, "aabbcc", 1, 110).await, 3);
    // At 112 the third chunk (last used 100) has expired; the first two (105) have not.
    assert_eq!(matched(&s, "aabbcc", 1, 112).await, 2);
    assert_eq!(matched(&s, "aabbcc", 1, 116).await, 0);
    // Expired entries still count until purged; a purge frees exactly the expired ones.
    assert_eq!(entries(&s, 1).await, 3);
    assert_eq!(s.purge_expired(t(112)).await.unwrap(), 1);
    assert_eq!(entries(&s, 1).await, 2);
    // A refresh brings a prefix back.
    s.notify(&h("aabbcc"), 1, t(200)).await.unwrap();
    assert_eq!(matched(&s, "aabbcc", 1, 205).await, 3);
}

pub async fn drop_and_capacity<S: PrefixStore>(s: S) {
    s.notify(&h("aabbccdd"), 1, t(1)).await.unwrap();
    s.notify(&h("aabbccdd"), 2, t(1)).await.unwrap();
    assert_eq!(s.set_capacity(2, 2).await.unwrap(), 2);
    assert_eq!(matched(&s, "aabbccdd", 2, 2).await, 2);
    assert_eq!(s.drop_server(1).await.unwrap(), 4);
    assert_eq!(s.drop_server(1).await.unwrap(), 0);
    assert_eq!(matched(&s, "aabbccdd", 1, 2).await, 0);
    let servers = s.servers().await.unwrap();
    assert_eq!(servers.len(), 1);
    assert_eq!(
        (
            servers[0].server_id,
            servers[0].entries,
            servers[0].capacity
        ),
        (2, 2, 2)
    );
    // A dropped server comes back with the default capacity.
    s.notify(&h("aabbccdd"), 1, t(3)).await.unwrap();
    assert_eq!(matched(&s, "aabbccdd", 1, 4).await, 4);
    // Capacity 0 holds nothing; capacities past the maximum are refused.
    s.set_capacity(1, 0).await.unwrap();
    assert_eq!(matched(&s, "aabbccdd", 1, 4).await, 0);
    let err = s
        .set_capacity(1, prefix_index::MAX_CAPACITY + 1)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(_)), "{err}");
    // Ids span the whole u64 range.
    s.notify(&h("aa"), u64::MAX, t(5)).await.unwrap();
    assert_eq!(matched(&s, "aa", u64::MAX, 5).await, 1);
}

/// Generates a `#[test]` per scenario for one store. `$make` is an async fn from StoreConfig
/// to the store.
#[macro_export]
macro_rules! conformance_suite {
    ($make:ident) => {
        $crate::conformance_suite!($make, ready = $crate::conformance::always);
    };
    ($make:ident, ready = $ready:path) => {
        mod scenarios {
            use super::conformance::*;
            macro_rules! scenario {
                ($name:ident, $capacity:expr, $ttl:expr) => {
                    #[test]
                    fn $name() {
                        if !$ready() {
                            return;
                        }
                        runtime().block_on(async {
                            let store = super::$make(config($capacity, $ttl)).await;
                            super::conformance::$name(store).await
                        })
                    }
                };
            }
            scenario!(same_request_twice_is_a_full_hit, 100, None);
            scenario!(least_recently_used_goes_first, 4, None);
            scenario!(deepest_first_keeps_the_set_prefix_closed, 4, None);
            scenario!(refresh_never_moves_time_backwards, 4, None);
            scenario!(ties_go_to_the_earliest_candidate, 100, None);
            scenario!(query_changes_nothing, 4, None);
            scenario!(empty_request_and_unknown_servers, 100, None);
            scenario!(ttl_hides_old_entries, 100, Some(10));
            scenario!(drop_and_capacity, 100, None);

            proptest::proptest! {
                #![proptest_config(proptest::prelude::ProptestConfig {
                    cases: $crate::conformance::cases(),
                    ..proptest::prelude::ProptestConfig::default()
                })]
                #[test]
                fn agrees_with_the_reference_model(
                    capacity in 0u64..12,
                    ttl in proptest::option::of(1u64..8),
                    ops in proptest::collection::vec(op(), 1..60),
                ) {
                    if !$ready() {
                        return Ok(());
                    }
                    runtime().block_on(async {
                        let store = super::$make(config(capacity, ttl)).await;
                        check_against_reference(&store, config(capacity, ttl), &ops).await
                    })
                }
            }
        }
    };
}

/// For suites whose store needs nothing external.
pub fn always() -> bool {
    true
}

// ---- random sequences against the reference model -------------------------------------------

/// Proptest cases per store; `CONFORMANCE_CASES` raises it for long runs.
pub fn cases() -> u32 {
    std::env::var("CONFORMANCE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

#[derive(Clone, Debug)]
pub enum Op {
    Notify {
        text: String,
        server: ServerId,
        at: u64,
    },
    Query {
        text: String,
        candidates: Vec<ServerId>,
        at: u64,
    },
    Drop {
        server: ServerId,
    },
    SetCapacity {
        server: ServerId,
        capacity: u64,
    },
    Purge {
        at: u64,
    },
}

fn text() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[ab]{0,14}").unwrap()
}

pub fn op() -> impl Strategy<Value = Op> {
    // Few servers and a small time range make collisions of time, depth and prefix common.
    let server = 0u64..4;
    let at = 0u64..20;
    prop_oneof![
        5 => (text(), server.clone(), at.clone())
            .prop_map(|(text, server, at)| Op::Notify { text, server, at }),
        4 => (text(), proptest::collection::vec(0u64..5, 0..5), at.clone())
            .prop_map(|(text, candidates, at)| Op::Query { text, candidates, at }),
        1 => server.clone().prop_map(|server| Op::Drop { server }),
        1 => (server, 0u64..10).prop_map(|(server, capacity)| Op::SetCapacity { server, capacity }),
        1 => at.prop_map(|at| Op::Purge { at }),
    ]
}

fn same<T: PartialEq + std::fmt::Debug>(
    a: Result<T, StoreError>,
    b: Result<T, StoreError>,
    op: &Op,
) {
    match (a, b) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "after {op:?}"),
        (Err(_), Err(_)) => {}
        (a, b) => panic!("store {a:?} vs reference {b:?} after {op:?}"),
    }
}

/// Runs `ops` on `store` and on a fresh reference model, comparing every answer and the server
/// table after every step.
pub async fn check_against_reference<S: PrefixStore>(store: &S, config: StoreConfig, ops: &[Op]) {
    let model = ReferenceStore::new(config);
    for op in ops {
        match op {
            Op::Notify { text, server, at } => same(
                store.notify(&h(text), *server, t(*at)).await,
                model.notify(&h(text), *server, t(*at)).await,
                op,
            ),
            Op::Query {
                text,
                candidates,
                at,
            } => same(
                store.query(&h(text), candidates, t(*at)).await,
                model.query(&h(text), candidates, t(*at)).await,
                op,
            ),
            Op::Drop { server } => same(
                store.drop_server(*server).await,
                model.drop_server(*server).await,
                op,
            ),
            Op::SetCapacity { server, capacity } => same(
                store.set_capacity(*server, *capacity).await,
                model.set_capacity(*server, *capacity).await,
                op,
            ),
            Op::Purge { at } => same(
                store.purge_expired(t(*at)).await,
                model.purge_expired(t(*at)).await,
                op,
            ),
        }
        same(store.servers().await, model.servers().await, op);
    }
}

/// Keeps `Future` in scope for store factories written as `async fn`.
pub fn _assert_future<F: Future>(f: F) -> F {
    f
}
