//! What the SQL stores share: how values are encoded, the schema's identity and version, and
//! the small computations done on the client side.

use std::collections::{HashMap, HashSet};

use crate::{PrefixHashes, QueryOutcome, ServerId};

/// The schema this build creates and understands. Bump it with a migration.
pub const SCHEMA_VERSION: i64 = 1;
/// Written into the meta table, so a database of another application is recognised.
pub const APPLICATION: &str = "prefix-router";

/// u64 → i64 preserving order (the sign bit flipped), so that SQL's `ORDER BY hash` is the
/// unsigned order the other stores use to break eviction ties.
pub fn encode(v: u64) -> i64 {
    (v ^ (1 << 63)) as i64
}

pub fn decode(v: i64) -> u64 {
    (v as u64) ^ (1 << 63)
}

/// The request's (hash, depth) pairs without repeats (a repeated 64-bit hash is a collision;
/// the first occurrence stands), encoded.
pub fn entries(hashes: &PrefixHashes) -> (Vec<i64>, Vec<i32>) {
    let mut seen = HashSet::with_capacity(hashes.len());
    let mut out_h = Vec::with_capacity(hashes.len());
    let mut out_d = Vec::with_capacity(hashes.len());
    for (i, &h) in hashes.as_slice().iter().enumerate() {
        if seen.insert(h) {
            out_h.push(encode(h));
            out_d.push(i32::try_from(i + 1).unwrap_or(i32::MAX));
        }
    }
    (out_h, out_d)
}

/// Computes the query answer from the (server, hash) pairs present among the candidates.
pub fn outcome(
    hashes: &PrefixHashes,
    candidates: &[ServerId],
    present: impl IntoIterator<Item = (ServerId, u64)>,
) -> QueryOutcome {
    let mut held: HashMap<ServerId, HashSet<u64>> = HashMap::new();
    for (server, hash) in present {
        held.entry(server).or_default().insert(hash);
    }
    let matches = candidates
        .iter()
        .map(|id| {
            held.get(id).map_or(0, |set| {
                hashes
                    .as_slice()
                    .iter()
                    .take_while(|h| set.contains(h))
                    .count() as u64
            })
        })
        .collect();
    QueryOutcome::from_matches(candidates, matches, hashes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_preserves_unsigned_order() {
        let values = [
            0u64,
            1,
            1 << 62,
            (1 << 63) - 1,
            1 << 63,
            u64::MAX - 1,
            u64::MAX,
        ];
        for w in values.windows(2) {
            assert!(encode(w[0]) < encode(w[1]), "{w:?}");
        }
        for v in values {
            assert_eq!(decode(encode(v)), v);
        }
    }

    #[test]
    fn repeated_hashes_keep_their_first_depth() {
        let (h, d) = entries(&PrefixHashes::from_raw(vec![5, 6, 5, 7]));
        assert_eq!(h.len(), 3);
        assert_eq!(d, vec![1, 2, 4]);
    }
}
