//! `prefix`: the backend holding the longest prefix of the request; ties, and requests with
//! no match, to the least loaded (by prefill queue first).

use super::order::by_prefill_load;
use super::{CandidateRow, Choice, MatchFacts, Policy, Reason, RequestFacts};

pub struct Prefix;

/// What the prefix policies start from: the candidates by prefill load, and where the longest
/// match is among them (the earliest of equals).
pub(super) enum Start {
    /// No match to look at: route by load for this reason, with this matched ratio.
    ByLoad(Vec<usize>, Reason, Option<f64>),
    /// `order[best]` holds the longest match, `ratio` of the request.
    Matched {
        order: Vec<usize>,
        best: usize,
        ratio: f64,
    },
}

pub(super) fn start(rows: &[CandidateRow], facts: &RequestFacts) -> Start {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    by_prefill_load(rows, &mut order, facts.turn);
    let total = match facts.matches {
        MatchFacts::Unavailable => return Start::ByLoad(order, Reason::StoreUnavailable, None),
        MatchFacts::None | MatchFacts::Known { total_tokens: 0 } => {
            return Start::ByLoad(order, Reason::BelowThreshold, Some(0.0))
        }
        MatchFacts::Known { total_tokens } => total_tokens,
    };
    let best = order
        .iter()
        .enumerate()
        .max_by_key(|&(i, &p)| (rows[p].matched_tokens, std::cmp::Reverse(i)))
        .map_or(0, |(i, _)| i);
    let ratio = rows[order[best]].matched_tokens as f64 / total as f64;
    Start::Matched { order, best, ratio }
}

/// `order` with its element at `best` moved to the front.
pub(super) fn first(mut order: Vec<usize>, best: usize) -> Vec<usize> {
    order[..=best].rotate_right(1);
    order
}

impl Policy for Prefix {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn needs_matches(&self) -> bool {
        true
    }

    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice {
        match start(rows, facts) {
            Start::ByLoad(order, reason, matched_ratio) => Choice {
                order,
                reason,
                matched_ratio,
            },
            Start::Matched { order, best, ratio } => Choice {
                order: first(order, best),
                reason: Reason::CacheHit,
                matched_ratio: Some(ratio),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{known, matched, rows};
    use super::*;

    #[test]
    fn the_longest_match_wins_whatever_the_load() {
        let mut r = matched(rows(3), &[2, 9, 9]);
        r[1].inflight = 50;
        let c = Prefix.choose(&r, &known(10, 0));
        assert_eq!(
            (c.order[0], c.reason),
            (2, Reason::CacheHit),
            "ties to the least loaded"
        );
        assert_eq!(c.matched_ratio, Some(0.9));
        assert_eq!(c.order.len(), 3);
    }
}
