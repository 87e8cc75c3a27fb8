//! `session`: requests with the same session key to the same backend, by rendezvous hashing
//! with bounded load; without a key, least loaded.

use super::order::all_by_load;
use super::{CandidateRow, Choice, Policy, Reason, RequestFacts};

pub struct Session {
    /// No backend above this times its share (by weight) of the load, plus one.
    pub load_factor: f64,
}

impl Policy for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    /// Every backend gets a score from (key, backend id); the highest wins unless its load is
    /// above `load_factor` × its share of the total (+1) by weight, then the next.
    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice {
        let by_load = all_by_load(rows, facts.turn);
        let Some(key) = facts.session else {
            return Choice {
                order: by_load,
                reason: Reason::NoSession,
                matched_ratio: None,
            };
        };
        let key_hash = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
        let total: u64 = rows.iter().map(|r| r.inflight).sum();
        let total_weight: u64 = rows.iter().map(|r| r.weight.max(1)).sum();
        let per_weight_bound = (total + 1) as f64 / total_weight as f64 * self.load_factor;
        let bound =
            |r: &CandidateRow| ((per_weight_bound * r.weight.max(1) as f64).ceil() as u64).max(1);
        let mut ranked = by_load.clone();
        ranked.sort_by_key(|&p| {
            std::cmp::Reverse(xxhash_rust::xxh3::xxh3_64_with_seed(
                &rows[p].id.to_le_bytes(),
                key_hash,
            ))
        });
        let pick = ranked
            .iter()
            .position(|&p| rows[p].inflight < bound(&rows[p]))
            .unwrap_or(0);
        let chosen = ranked[pick];
        let mut order = vec![chosen];
        order.extend(by_load.into_iter().filter(|&p| p != chosen));
        Choice {
            order,
            reason: if pick == 0 {
                Reason::SessionAffinity
            } else {
                Reason::SessionOverflow
            },
            matched_ratio: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{plain, rows};
    use super::*;

    fn policy() -> Session {
        Session { load_factor: 1.25 }
    }

    #[test]
    fn sessions_stick_and_overflow_when_loaded() {
        let mut r = rows(4);
        let first = policy().choose(&r, &plain(Some("user-7"), 0));
        assert_eq!(first.reason, Reason::SessionAffinity);
        for turn in 0..5 {
            let again = policy().choose(&r, &plain(Some("user-7"), turn));
            assert_eq!(again.order[0], first.order[0]);
        }
        r[first.order[0]].inflight = 10;
        let moved = policy().choose(&r, &plain(Some("user-7"), 0));
        assert_eq!(moved.reason, Reason::SessionOverflow);
        assert_ne!(moved.order[0], first.order[0]);
        // Different sessions spread.
        r[first.order[0]].inflight = 0;
        let spread: std::collections::HashSet<usize> = (0..40)
            .map(|i| {
                policy()
                    .choose(&r, &plain(Some(&format!("user-{i}")), 0))
                    .order[0]
            })
            .collect();
        assert!(spread.len() >= 3);
        assert_eq!(
            policy().choose(&r, &plain(None, 0)).reason,
            Reason::NoSession
        );
    }

    #[test]
    fn the_session_bound_scales_with_weight() {
        let mut r = rows(2);
        r[1].weight = 4; // row 0 small, row 1 big
        let key_for = |favourite: usize, r: &[CandidateRow]| {
            (0..100)
                .map(|i| format!("user-{i}"))
                .find(|k| policy().choose(r, &plain(Some(k), 0)).order[0] == favourite)
                .unwrap()
        };
        let (big_key, small_key) = (key_for(1, &r), key_for(0, &r));
        // 16 in flight at big, 4 at small: big's bound is its 4/5 share of 21 × 1.25 = 21, so
        // it keeps its session (with weights ignored the bound is 14 and the session moved).
        r[1].inflight = 16;
        r[0].inflight = 4;
        let d = policy().choose(&r, &plain(Some(&big_key), 0));
        assert_eq!((d.order[0], d.reason), (1, Reason::SessionAffinity));
        // 3 at small, 4 at big: small's bound is its 1/5 share of 8 × 1.25 = 2, so its session
        // overflows (with weights ignored the bound is 5 and it stayed).
        r[1].inflight = 4;
        r[0].inflight = 3;
        let d = policy().choose(&r, &plain(Some(&small_key), 0));
        assert_eq!((d.order[0], d.reason), (1, Reason::SessionOverflow));
    }
}
