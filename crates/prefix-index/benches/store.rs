//! Query, notify and hashing costs of an 8 KiB (64-chunk) request.
//!
//! `cargo bench -p prefix-index --bench store`

mod fixtures;

use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fixtures::{filled_store, hashed, request, REQUEST_BYTES};
use prefix_index::{PrefixHasher, PrefixStore, Tick};
use xxhash_rust::xxh3::xxh3_64;

/// Polls a future that completes without waiting (the memory store's), as a caller through
/// the trait pays for it.
fn ready<F: std::future::Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the memory store never waits"),
    }
}

fn store_ops(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_store");
    for (servers, entries) in [(4u64, 1_000u64), (64, 1_000_000)] {
        let (store, requests) = filled_store(servers, entries);
        let candidates: Vec<u64> = (0..servers).collect();
        let label = format!("{servers}srv_{entries}entries");
        // The most recent request is fully held by one server: the query walks all 64 chunks.
        let hit = hashed(requests - 1);
        let miss = hashed(u64::MAX);
        // A long context: 256 KiB (2,048 chunks), fully held by one server.
        let long_text: Vec<u8> = (0..32).flat_map(|i| request(1 << 50 | i)).collect();
        let long = prefix_index::PrefixHasher::default().hash(&long_text);
        if long.len() as u64 <= entries / servers {
            store
                .notify_now(&long, 0, Tick::from_millis(requests))
                .unwrap();
            group.bench_function(BenchmarkId::new("query_hit_256KiB", &label), |b| {
                b.iter(|| store.query_now(black_box(&long), &candidates, Tick::from_millis(1)))
            });
        }
        group.bench_function(BenchmarkId::new("query_hit", &label), |b| {
            b.iter(|| store.query_now(black_box(&hit), &candidates, Tick::from_millis(1)))
        });
        group.bench_function(BenchmarkId::new("query_hit_via_trait", &label), |b| {
            b.iter(|| ready(store.query(black_box(&hit), &candidates, Tick::from_millis(1))))
        });
        group.bench_function(BenchmarkId::new("query_miss", &label), |b| {
            b.iter(|| store.query_now(black_box(&miss), &candidates, Tick::from_millis(1)))
        });
        // Steady state: every notify inserts 64 new entries into a full server and evicts 64.
        let fresh: Vec<_> = (0..4096).map(|i| hashed(1 << 40 | i)).collect();
        let mut i = 0u64;
        group.bench_function(BenchmarkId::new("notify_insert_evict", &label), |b| {
            b.iter(|| {
                i += 1;
                let hashes = &fresh[(i % fresh.len() as u64) as usize];
                store
                    .notify_now(
                        black_box(hashes),
                        i % servers,
                        Tick::from_millis(requests + i),
                    )
                    .unwrap()
            })
        });
        // A request already held: every entry refreshed in place.
        group.bench_function(BenchmarkId::new("notify_refresh", &label), |b| {
            b.iter(|| {
                i += 1;
                store
                    .notify_now(
                        black_box(&hit),
                        (requests - 1) % servers,
                        Tick::from_millis(1 << 40 | i),
                    )
                    .unwrap()
            })
        });
    }
    group.finish();
}

fn hashing(c: &mut Criterion) {
    let bytes = request(1);
    let hasher = PrefixHasher::default();
    let mut group = c.benchmark_group("hashing_8KiB");
    group.throughput(Throughput::Bytes(REQUEST_BYTES as u64));
    group.bench_function("chained_128B_chunks", |b| {
        b.iter(|| hasher.hash(black_box(&bytes)))
    });
    group.bench_function("xxh3_64_whole", |b| b.iter(|| xxh3_64(black_box(&bytes))));
    group.bench_function("xxh3_64_per_128B_chunk", |b| {
        b.iter(|| {
            black_box(&bytes)
                .chunks(128)
                .fold(0u64, |acc, c| acc ^ xxh3_64(c))
        })
    });
    group.finish();
}

criterion_group!(benches, store_ops, hashing);
criterion_main!(benches);
