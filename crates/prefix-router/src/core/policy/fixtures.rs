//! Rows for policy tests.

use super::{CandidateRow, MatchFacts, RequestFacts};

/// `n` idle candidates of weight 1, ids 0..n.
pub fn rows(n: usize) -> Vec<CandidateRow> {
    (0..n)
        .map(|i| CandidateRow {
            id: i as u64,
            weight: 1,
            ..CandidateRow::default()
        })
        .collect()
}

/// `rows` with these matched tokens.
pub fn matched(mut rows: Vec<CandidateRow>, tokens: &[u64]) -> Vec<CandidateRow> {
    for (r, &t) in rows.iter_mut().zip(tokens) {
        r.matched_tokens = t;
    }
    rows
}

/// Facts of a request of `total` tokens (matches known), at `turn`.
pub fn known(total: u64, turn: u64) -> RequestFacts<'static> {
    RequestFacts {
        session: None,
        matches: MatchFacts::Known {
            total_tokens: total,
        },
        turn,
        replica_rank: 0,
    }
}

/// Facts without matches, with an optional session key.
pub fn plain(session: Option<&str>, turn: u64) -> RequestFacts<'_> {
    RequestFacts {
        session,
        matches: MatchFacts::None,
        turn,
        replica_rank: 0,
    }
}
