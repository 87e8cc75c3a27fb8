//! Shared set-up of the store benchmarks: a filled store and fresh requests.
#![allow(dead_code)]

use prefix_index::{MemoryStore, PrefixHasher, PrefixHashes, StoreConfig, Tick};

/// 8 KiB requests: 64 chunks of 128 bytes.
pub const REQUEST_BYTES: usize = 8 * 1024;

/// A deterministic 8 KiB request, different for every `n`.
pub fn request(n: u64) -> Vec<u8> {
    let mut state = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..REQUEST_BYTES)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b'a' + (state % 26) as u8
        })
        .collect()
}

pub fn hashed(n: u64) -> PrefixHashes {
    PrefixHasher::default().hash(&request(n))
}

/// A store holding `entries` entries spread round robin over `servers` servers, each at
/// capacity `entries / servers`, filled with distinct 8 KiB requests. Returns the store and
/// the number of requests used.
pub fn filled_store(servers: u64, entries: u64) -> (MemoryStore, u64) {
    let capacity = entries / servers;
    let store = MemoryStore::new(StoreConfig {
        default_capacity: capacity,
        ttl_ms: None,
    })
    .unwrap();
    let requests = entries / 64;
    for n in 0..requests {
        store
            .notify_now(&hashed(n), n % servers, Tick::from_millis(n))
            .unwrap();
    }
    (store, requests)
}
