//! Heap bytes per stored entry of the memory store, counted by a wrapping global allocator.
//!
//! `cargo bench -p prefix-index --bench entry_bytes`

mod fixtures;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use prefix_index::{MemoryStore, PrefixHasher, StoreConfig, Tick};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Relaxed);
        LIVE.fetch_sub(layout.size(), Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn report(name: &str, store: &MemoryStore, before: usize) {
    let bytes = LIVE.load(Relaxed) - before;
    let entries = store.entries();
    println!(
        "{name:<44} entries {entries:>9}  heap {:>7.1} MiB  bytes/entry {:>5.1}",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / entries as f64
    );
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    println!("memory store, heap bytes per stored (server, prefix) entry");
    for (servers, entries) in [(64u64, 1_000_000u64), (4, 1_000), (8, 4_000_000)] {
        let before = LIVE.load(Relaxed);
        let (store, _) = fixtures::filled_store(servers, entries);
        report(
            &format!("distinct 8 KiB requests, {servers} servers"),
            &store,
            before,
        );
    }
    // A shared 2 KiB system prompt on every server, then distinct 6 KiB tails.
    let before = LIVE.load(Relaxed);
    let store = MemoryStore::new(StoreConfig {
        default_capacity: 16_384,
        ttl_ms: None,
    })
    .unwrap();
    let hasher = PrefixHasher::default();
    let system = vec![b's'; 2048];
    for n in 0..15_625u64 {
        let mut text = system.clone();
        text.extend_from_slice(&fixtures::request(n)[..6144]);
        store
            .notify_now(&hasher.hash(&text), n % 64, Tick::from_millis(n))
            .unwrap();
    }
    report("shared 2 KiB system prompt, 64 servers", &store, before);
}
