//! Chunking and chained hashing: the number of chunks, and that the hashes of a prefix cut at a
//! chunk boundary are the first hashes of the whole.
#![no_main]
use libfuzzer_sys::fuzz_target;
use prefix_index::PrefixHasher;

fuzz_target!(|data: &[u8]| {
    let Some((&size, bytes)) = data.split_first() else { return };
    let chunk = usize::from(size % 64) + 1;
    let hasher = PrefixHasher::new(chunk, 7).unwrap();
    let all = hasher.hash(bytes);
    assert_eq!(all.len(), bytes.len().div_ceil(chunk));
    for k in 0..=all.len() {
        let cut = (k * chunk).min(bytes.len());
        let prefix = hasher.hash(&bytes[..cut]);
        assert_eq!(prefix.as_slice(), &all.as_slice()[..prefix.len()]);
    }
    assert!(all.as_slice().iter().all(|&h| prefix_index::hashing::shard_of(h) == all.shard()));
});
