//! `prefix_load`: the longest match unless it is below `cache_threshold` of the request or its
//! backend is too far above the least loaded (the load guard); then the least loaded.

use super::order::per_weight;
use super::prefix::{first, start, Start};
use super::{CandidateRow, Choice, Policy, Reason, RequestFacts};

pub struct PrefixLoad {
    pub cache_threshold: f64,
    /// The guard trips when the matched backend has more than this many requests in flight
    /// (per unit of weight) above the least loaded one...
    pub balance_abs: u64,
    /// ... and more than this times its load.
    pub balance_rel: f64,
}

impl Policy for PrefixLoad {
    fn name(&self) -> &'static str {
        "prefix_load"
    }

    fn needs_matches(&self) -> bool {
        true
    }

    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice {
        let (order, best, ratio) = match start(rows, facts) {
            Start::ByLoad(order, reason, matched_ratio) => {
                return Choice {
                    order,
                    reason,
                    matched_ratio,
                }
            }
            Start::Matched { order, best, ratio } => (order, best, ratio),
        };
        let by_load = |order, reason| Choice {
            order,
            reason,
            matched_ratio: Some(ratio),
        };
        if ratio < self.cache_threshold || rows[order[best]].matched_tokens == 0 {
            return by_load(order, Reason::BelowThreshold);
        }
        if LoadGuard::new(rows, self.balance_abs, self.balance_rel).trips(&rows[order[best]]) {
            return by_load(order, Reason::LoadGuard);
        }
        by_load(first(order, best), Reason::CacheHit)
    }
}

/// The load guard over one request's candidates: whether a backend is too far above the least
/// loaded to take a request for its match. Shared by `prefix_load` and `cost`.
pub struct LoadGuard {
    least: f64,
    margin: f64,
    balance_abs: u64,
    balance_rel: f64,
}

impl LoadGuard {
    pub fn new(rows: &[CandidateRow], balance_abs: u64, balance_rel: f64) -> Self {
        Self {
            least: rows.iter().map(per_weight).fold(f64::MAX, f64::min),
            margin: guard_margin(rows, balance_abs),
            balance_abs,
            balance_rel,
        }
    }

    /// In requests per unit of weight: a backend of weight 4 at 40 is as loaded as one of
    /// weight 1 at 10.
    pub fn trips(&self, row: &CandidateRow) -> bool {
        let load = per_weight(row);
        let margin = self.margin.max(still_to_prefill(row, self.balance_abs));
        load > self.least + margin && load > self.least * self.balance_rel
    }
}

/// How many requests (per unit of weight) the matched backend may carry above the least loaded
/// before the guard trips: one and a half times the fleet's mean load, at least
/// [`MIN_MARGIN`] and at most `balance_abs` (1.5: at 1× the sims' prefix-repetition lost 3
/// points of hit rate and doubled its p90 TTFT; at 1.5× it kept them, and multi-turn kept most
/// of the gain). A fixed margin fits one load only: at a few requests per backend (a
/// multi-turn chat fleet) a margin of 16 lets one backend gather every conversation that
/// shares a system prompt (imbalance 4.25 on the sims), while at a dozen per backend (a busy
/// shared-prefix fleet) a margin of 2 sends requests away from their prefix at every ripple.
pub fn guard_margin(rows: &[CandidateRow], balance_abs: u64) -> f64 {
    let mean = rows.iter().map(per_weight).sum::<f64>() / rows.len().max(1) as f64;
    let most = (balance_abs as f64).max(1.0);
    (1.5 * mean).clamp(MIN_MARGIN.min(most), most)
}

/// The fewest requests (per unit of weight) the guard lets a backend carry above the least
/// loaded, however light the fleet's load. With one, at low load a backend with two sessions
/// decoding against an idle one tripped the guard, and their next turns were sent away to
/// compute their whole history again: on the sims' agent workload (about 10 requests/s on 8
/// servers) 45 of the 48 hits `cost` gave away were the guard's, and its mean TTFT was 1.26×
/// `prefix`'s, though no queue had formed anywhere. A few sessions' decoding sequences delay
/// no prefill; the margin grows past six with the load (multi-turn's mean alone makes it six).
/// Measured, two rounds each, agent at its default and at three times its rate, multi-turn:
/// a floor of 3 left `cost` at 1.13× and 1.11× `prefix` on agent; 4 at 1.04× and 1.04×; 6 at
/// 1.00× and 0.97×, multi-turn unchanged (34.2–35.3 ms against 35.7 with 1).
pub const MIN_MARGIN: f64 = 6.0;

/// The matched backend's requests still waiting for their first byte (per unit of weight, at
/// most `balance_abs`), which the guard lets it carry above the least loaded whatever the
/// fleet's mean. They are most often the siblings of this request (agents fanning out: the
/// match is there because they were sent there), and vLLM prefills requests that wait
/// together in one engine step where the shared prefix is computed once; so gathering them
/// costs little, and splitting them computes the prefix again elsewhere. On real vLLM
/// (bursts of 4 siblings, 2 CPU servers) the guard used to split each burst 3/1 (hit rate
/// 0.479, mean TTFT 81–133 ms against smg's 41–49); counting them in the margin keeps bursts
/// whole (0.697, 58–74 ms against 53–56). Requests that already decode still count in full,
/// so the multi-turn balance it was shrunk for is kept (sims: imbalance 1.53 either way).
fn still_to_prefill(row: &CandidateRow, balance_abs: u64) -> f64 {
    (row.waiting_first_byte as f64 / row.weight.max(1) as f64).min(balance_abs as f64)
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{known, matched, rows};
    use super::super::MatchFacts;
    use super::*;

    fn policy() -> PrefixLoad {
        PrefixLoad {
            cache_threshold: 0.5,
            balance_abs: 2,
            balance_rel: 1.5,
        }
    }

    #[test]
    fn the_match_wins_unless_low_or_overloaded() {
        let mut r = matched(rows(3), &[0, 8, 2]);
        let c = policy().choose(&r, &known(10, 0));
        assert_eq!((c.order[0], c.reason), (1, Reason::CacheHit));
        assert_eq!(c.matched_ratio, Some(0.8));
        let low = matched(rows(3), &[0, 4, 2]);
        assert_eq!(
            policy().choose(&low, &known(10, 0)).reason,
            Reason::BelowThreshold
        );
        // Row 1 holds the prefix but has 5 more in flight than the least loaded (the fleet's
        // mean is 5/3, so the margin is 2.5): the guard trips.
        r[1].inflight = 5;
        let c = policy().choose(&r, &known(10, 0));
        assert_eq!(c.reason, Reason::LoadGuard);
        assert_ne!(c.order[0], 1);
        // One above the least loaded: within the margin (at least one request).
        r[1].inflight = 1;
        let c = policy().choose(&r, &known(10, 0));
        assert_eq!((c.order[0], c.reason), (1, Reason::CacheHit));
        assert_eq!(c.order.len(), 3, "every backend appears once");
        // Three above, with the others idle: beyond the margin (MIN_MARGIN, capped at
        // balance_abs 2), the guard trips.
        r[1].inflight = 3;
        assert_eq!(policy().choose(&r, &known(10, 0)).reason, Reason::LoadGuard);
    }

    #[test]
    fn siblings_waiting_to_be_prefilled_do_not_split_a_burst() {
        // A burst of four siblings: the first went to idle backend 1, the others match there.
        let mut r = matched(rows(2), &[0, 9]);
        for sent in 1..=7 {
            r[1].inflight = sent;
            r[1].waiting_first_byte = sent;
            let c = policy_with(16).choose(&r, &known(10, 0));
            assert_eq!(
                (c.order[0], c.reason),
                (1, Reason::CacheHit),
                "{sent} waiting"
            );
        }
        // The same seven once they decode: ordinary load, seven above the least loaded against
        // the margin of MIN_MARGIN, and the guard trips as before.
        r[1].waiting_first_byte = 0;
        assert_eq!(
            policy_with(16).choose(&r, &known(10, 0)).reason,
            Reason::LoadGuard
        );
        // Waiting requests count up to balance_abs only.
        r[1].inflight = 6;
        r[1].waiting_first_byte = 6;
        assert_eq!(
            policy_with(4).choose(&r, &known(10, 0)).reason,
            Reason::LoadGuard
        );
    }

    #[test]
    fn equal_load_spreads_new_prefixes() {
        let mut r = rows(4);
        let firsts: std::collections::HashSet<usize> = (0..4)
            .map(|turn| policy().choose(&r, &known(10, turn)).order[0])
            .collect();
        assert_eq!(
            firsts.len(),
            4,
            "four new prefixes on four idle backends go to four backends"
        );
        for (i, e) in [10, 10, 0, 10].into_iter().enumerate() {
            r[i].entries = e;
        }
        assert_eq!(
            policy().choose(&r, &known(10, 0)).order[0],
            2,
            "fewer index entries win"
        );
    }

    #[test]
    fn the_guards_margin_follows_the_fleets_mean_load_within_bounds() {
        let mut r = rows(4);
        assert_eq!(guard_margin(&r, 16), MIN_MARGIN, "at least MIN_MARGIN");
        assert_eq!(guard_margin(&r, 2), 2.0, "but never above balance_abs");
        for (i, n) in [2, 4, 6, 8].into_iter().enumerate() {
            r[i].inflight = n;
        }
        assert_eq!(guard_margin(&r, 16), 7.5, "1.5 times the mean");
        assert_eq!(guard_margin(&r, 3), 3.0, "at most balance_abs");
        // Row 3 holds the prefix with 8 in flight against 2: 6 above, within the margin of 7.5.
        let mut m = matched(r.clone(), &[0, 0, 0, 9]);
        let c = policy_with(16).choose(&m, &known(10, 0));
        assert_eq!((c.order[0], c.reason), (3, Reason::CacheHit));
        // With 14 in flight (mean 6.5, margin 9.75): 12 above, the guard trips.
        m[3].inflight = 14;
        assert_eq!(
            policy_with(16).choose(&m, &known(10, 0)).reason,
            Reason::LoadGuard
        );
    }

    fn policy_with(balance_abs: u64) -> PrefixLoad {
        PrefixLoad {
            balance_abs,
            ..policy()
        }
    }

    #[test]
    fn the_load_guard_compares_load_per_weight() {
        let mut r = matched(rows(2), &[0, 9]);
        r[1].weight = 4;
        r[1].inflight = 40;
        r[0].inflight = 10;
        let c = policy().choose(&r, &known(10, 0));
        assert_eq!(
            (c.order[0], c.reason),
            (1, Reason::CacheHit),
            "40 of weight 4 is as loaded as 10 of weight 1"
        );
        r[1].inflight = 80;
        assert_eq!(policy().choose(&r, &known(10, 0)).reason, Reason::LoadGuard);
    }

    #[test]
    fn an_unavailable_index_routes_by_load() {
        let mut r = rows(2);
        r[0].inflight = 3;
        let facts = RequestFacts {
            session: None,
            matches: MatchFacts::Unavailable,
            turn: 0,
            replica_rank: 0,
        };
        let c = policy().choose(&r, &facts);
        assert_eq!((c.order[0], c.reason), (1, Reason::StoreUnavailable));
    }
}
