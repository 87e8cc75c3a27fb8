//! Cutting a request into chunks and naming every prefix by one chained 64-bit hash.
//!
//! `h_1 = H(seed, c_1)`, `h_i = H(h_{i-1}, c_i)`: the hash of chunk `i` stands for the whole
//! prefix `c_1..c_i`, and all prefixes of a request cost one pass over its bytes.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Default chunk size in bytes (DESIGN.md).
pub const DEFAULT_CHUNK_SIZE: usize = 128;

/// Number of top bits of every prefix hash that come from the request's first chunk.
///
/// All prefixes of one request share these bits, so a store can keep a whole request in one shard
/// (one lock per query) and still find the shard of any single entry it evicts.
pub const SHARD_BITS: u32 = 6;
const SHARD_MASK: u64 = !(u64::MAX >> SHARD_BITS);

/// The chained hashes of every prefix of one request, computed once and shared by query and
/// notify.
///
/// Invariant: every hash carries the top [`SHARD_BITS`] bits of the first one. Collisions are
/// no likelier than with a plain 64-bit hash: two prefixes can only collide when their first
/// chunks agree on those bits, and then the other 58 bits must agree too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHashes(Vec<u64>);

impl PrefixHashes {
    /// Wraps hashes that did not come from a [`PrefixHasher`] (a remote client, a database),
    /// restoring the shard-bit invariant so stores can rely on it.
    pub fn from_raw(mut hashes: Vec<u64>) -> Self {
        if let Some(&first) = hashes.first() {
            let shard = first & SHARD_MASK;
            for h in &mut hashes {
                *h = (*h & !SHARD_MASK) | shard;
            }
        }
        Self(hashes)
    }

    /// The hashes, one per chunk, in prefix order: element `i` names the prefix of `i + 1` chunks.
    pub fn as_slice(&self) -> &[u64] {
        &self.0
    }

    /// Number of chunks of the request.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty request (no chunks).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The shard (0..2^SHARD_BITS) all prefixes of this request live in.
    pub fn shard(&self) -> usize {
        self.0.first().map_or(0, |&h| shard_of(h))
    }

    /// Gives back the vector (for reuse of its allocation).
    pub fn into_vec(self) -> Vec<u64> {
        self.0
    }
}

/// The shard a prefix hash belongs to.
#[inline]
pub fn shard_of(hash: u64) -> usize {
    (hash >> (64 - SHARD_BITS)) as usize
}

/// Cuts requests into fixed-size byte chunks and hashes every prefix.
///
/// Bytes are hashed, never decoded: a chunk boundary may fall inside a multi-byte character.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixHasher {
    chunk_size: usize,
    seed: u64,
}

impl Default for PrefixHasher {
    fn default() -> Self {
        Self {
            chunk_size: DEFAULT_CHUNK_SIZE,
            seed: 0,
        }
    }
}

impl PrefixHasher {
    /// A hasher with the given chunk size (bytes, at least 1) and seed.
    ///
    /// A secret seed keeps clients from crafting colliding prefixes to steer traffic.
    pub fn new(chunk_size: usize, seed: u64) -> Result<Self, crate::StoreError> {
        if chunk_size == 0 {
            return Err(crate::StoreError::InvalidArgument(
                "chunk size must be at least 1 byte".into(),
            ));
        }
        Ok(Self { chunk_size, seed })
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// A value that differs between hashers with different seeds (compare, never publish: it
    /// is a hash output for a fixed input).
    pub fn fingerprint(&self) -> u64 {
        xxh3_64_with_seed(b"prefix-router hasher fingerprint", self.seed)
    }

    /// Number of chunks a request of `len` bytes is cut into.
    pub fn chunk_count(&self, len: usize) -> usize {
        len.div_ceil(self.chunk_size)
    }

    /// The chained hash of every prefix of `bytes`, one per chunk.
    pub fn hash(&self, bytes: &[u8]) -> PrefixHashes {
        let mut out = Vec::with_capacity(self.chunk_count(bytes.len()));
        let mut chunks = bytes.chunks(self.chunk_size);
        if let Some(first) = chunks.next() {
            let h1 = xxh3_64_with_seed(first, self.seed);
            let shard = h1 & SHARD_MASK;
            out.push(h1);
            let mut prev = h1;
            for chunk in chunks {
                // The previous hash seeds the next: h_i = H(h_{i-1}, c_i).
                let h = (xxh3_64_with_seed(chunk, prev) & !SHARD_MASK) | shard;
                out.push(h);
                prev = h;
            }
        }
        PrefixHashes(out)
    }

    /// The last hash of the chain of `bytes[..len]`, from `chain` (the chain of `bytes`) and at
    /// most one chunk's hashing: whether a string is a prefix of another, known by this hash
    /// and its length, costs the longer's chain and a few bytes. None if `len` is 0 or beyond
    /// `bytes`, or `chain` is not as long as its full chunks need.
    pub fn last_hash_of_prefix(&self, chain: &[u64], bytes: &[u8], len: usize) -> Option<u64> {
        if len == 0 || len > bytes.len() {
            return None;
        }
        let full = len / self.chunk_size;
        let tail = &bytes[full * self.chunk_size..len];
        if tail.is_empty() {
            return chain.get(full - 1).copied();
        }
        if full == 0 {
            return Some(xxh3_64_with_seed(tail, self.seed));
        }
        let (first, prev) = (*chain.first()?, *chain.get(full - 1)?);
        Some((xxh3_64_with_seed(tail, prev) & !SHARD_MASK) | (first & SHARD_MASK))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(chunk: usize) -> PrefixHasher {
        PrefixHasher::new(chunk, 7).unwrap()
    }

    #[test]
    fn empty_request_has_no_chunks() {
        assert!(hasher(4).hash(b"").is_empty());
        assert_eq!(hasher(4).chunk_count(0), 0);
    }

    #[test]
    fn the_last_hash_of_a_prefix_is_its_chains_last() {
        let h = hasher(4);
        let bytes = b"abcdefghijklm";
        let chain = h.hash(bytes);
        for len in 1..=bytes.len() {
            assert_eq!(
                h.last_hash_of_prefix(chain.as_slice(), bytes, len),
                h.hash(&bytes[..len]).as_slice().last().copied(),
                "{len}"
            );
        }
        assert_eq!(h.last_hash_of_prefix(chain.as_slice(), bytes, 0), None);
        assert_eq!(h.last_hash_of_prefix(chain.as_slice(), bytes, 14), None);
        assert_eq!(h.last_hash_of_prefix(&[], bytes, 9), None);
    }

    #[test]
    fn exact_multiple_and_short_tail() {
        assert_eq!(hasher(4).hash(b"abcdefgh").len(), 2);
        assert_eq!(hasher(4).hash(b"abcdefghi").len(), 3);
        assert_eq!(hasher(4).hash(b"abc").len(), 1);
    }

    #[test]
    fn zero_chunk_size_is_rejected() {
        assert!(PrefixHasher::new(0, 0).is_err());
    }

    #[test]
    fn prefix_hashes_are_shared_by_extensions() {
        let h = hasher(4);
        let a = h.hash(b"abcdefgh-tail-one");
        let b = h.hash(b"abcdefgh-tail-two");
        // Chunks: "abcd" "efgh" "-tai" then "l-on" / "l-tw".
        assert_eq!(a.as_slice()[..3], b.as_slice()[..3]);
        assert_ne!(a.as_slice()[3], b.as_slice()[3]);
        // Same text, same hashes; a whole request equals the prefix of a longer one.
        let long = h.hash(b"abcdefgh-tail-one and more");
        assert_eq!(a.as_slice()[..4], long.as_slice()[..4]);
    }

    #[test]
    fn hash_depends_on_everything_before_the_chunk() {
        let h = hasher(4);
        let a = h.hash(b"AAAAxxxx");
        let b = h.hash(b"BBBBxxxx");
        // The second chunk is equal, but the prefixes differ, so the hashes do too.
        assert_ne!(a.as_slice()[1], b.as_slice()[1]);
    }

    #[test]
    fn multibyte_characters_across_boundaries() {
        // "é" is two bytes, "€" three: with 4-byte chunks boundaries fall inside characters.
        let text = "ééé€€€";
        let h = hasher(4);
        let hashes = h.hash(text.as_bytes());
        assert_eq!(hashes.len(), text.len().div_ceil(4));
        // Hashing is byte-exact: the same bytes split differently do not collide.
        let other = "éé€é€€";
        assert_eq!(other.len(), text.len());
        assert_ne!(h.hash(other.as_bytes()), hashes);
        // A prefix cut inside a character still matches the full text's prefix hash.
        let cut = &text.as_bytes()[..5];
        assert_eq!(h.hash(cut).as_slice()[0], hashes.as_slice()[0]);
    }

    #[test]
    fn seed_changes_every_hash() {
        let a = PrefixHasher::new(4, 1).unwrap().hash(b"abcdefgh");
        let b = PrefixHasher::new(4, 2).unwrap().hash(b"abcdefgh");
        assert_ne!(a.as_slice()[0], b.as_slice()[0]);
        assert_ne!(a.as_slice()[1], b.as_slice()[1]);
    }

    #[test]
    fn all_prefixes_share_the_first_chunks_shard() {
        let hashes = hasher(3).hash(b"the quick brown fox jumps over the lazy dog");
        let shard = hashes.shard();
        assert!(hashes.as_slice().iter().all(|&h| shard_of(h) == shard));
    }

    #[test]
    fn from_raw_restores_the_shard_invariant() {
        let raw = PrefixHashes::from_raw(vec![u64::MAX, 0, 12345]);
        assert!(raw.as_slice().iter().all(|&h| shard_of(h) == raw.shard()));
        // Hashes from the hasher are left unchanged.
        let hashes = hasher(2).hash(b"abcdefg");
        assert_eq!(PrefixHashes::from_raw(hashes.as_slice().to_vec()), hashes);
    }
}
