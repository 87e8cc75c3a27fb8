//! `cost`: the backend where this request's predicted time to first token is lowest.
//!
//! For each candidate: the prefill work ahead of the request there (the uncached tokens of the
//! requests this router sent that have not started answering, plus the backend's own waiting
//! requests this router did not send, each counted as large as this one) plus the request's
//! own uncached tokens, through the backend's learned prefill line
//! ([`crate::core::prefill`]; a backend that has not learned its own yet is judged by the
//! others'), less what of that queue has already been worked on ([`ttft_after_queue`]); a
//! backend whose KV cache is over 80 % full costs up to twice as much. A match is worth exactly
//! the prefill it saves, and a queue exactly the wait it adds. To that TTFT it adds the delay
//! the placement imposes on the requests already waiting there ([`delay_imposed`]), so the
//! choice minimizes the sum of the TTFTs it affects.
//!
//! The prediction sees the queue of this moment, not the load a placement commits: a chat's
//! later turns follow its first to the backend holding its history, so a backend that holds a
//! shared system prompt and looks cheap now gathers conversations until its queue costs as much
//! as the prompt's prefill, and then every turn there pays that wait (8 sims, multi-turn:
//! imbalance 4.7–5.5). So the cost policy keeps `prefix_load`'s load guard
//! ([`LoadGuard`]): a backend too far above the least loaded in requests in flight (decoding
//! ones included) is tried only after the others.
//!
//! Near-equal costs (within 5 % or 2 ms) are not decided by position: the request goes to one
//! of them drawn by a hash of its turn, so a burst of equal requests spreads as soon as one
//! backend's queue makes it slower, and replicas with the same view (each counting its own
//! turns from a random start) seldom pick alike. A prompt no backend holds goes to the least
//! loaded of them (waiting for a first byte, in flight, index entries; in turn among equals):
//! its later requests will follow it there.

use xxhash_rust::xxh3::xxh3_64;

use super::order::by_prefill_load;
use super::prefix_load::LoadGuard;
use super::{CandidateRow, Choice, MatchFacts, Policy, Reason, RequestFacts};
use crate::core::prefill::PrefillLine;

/// Costs within this fraction of the lowest are near-ties...
const TIE_FRACTION: f64 = 0.05;
/// ... or within this many seconds.
const TIE_SECONDS: f64 = 0.002;
/// KV usage above which a backend is penalized: its new blocks evict cached prefixes, and
/// preemptions come near full.
const KV_PRESSURE_FROM: f64 = 0.8;
/// A backend with fewer TTFTs than this is judged by the fastest line seen ([`untried_line`]): a
/// prior of its own, slower than the fleet really is, would keep it from ever being tried.
const MIN_OBSERVATIONS: u64 = 8;

/// `--policy cost`, with the load guard's settings (`--balance-abs`, `--balance-rel`).
pub struct Cost {
    pub balance_abs: u64,
    pub balance_rel: f64,
}

/// The prompt tokens `row`'s backend computes before the first token of a request with
/// `uncached` tokens to compute there: the work queued ahead of it, and its own.
pub fn prefill_work(row: &CandidateRow, uncached: u64) -> u64 {
    row.queued_prefill_tokens + row.foreign_waiting * uncached.max(1) + uncached
}

/// The predicted TTFT of a request with `uncached` tokens to compute at `row`.
pub fn predicted_ttft(row: &CandidateRow, uncached: u64) -> f64 {
    ttft_after_queue(row, prefill_work(row, uncached), uncached)
}

/// The predicted TTFT at `row` of a request with `work` tokens to compute before its first
/// token, `uncached` of them its own: its own prefill plus what is left of the queue ahead.
///
/// The queue has been worked on for [`CandidateRow::stalled_secs`] (since its last first byte,
/// or since it formed). While that is less than the line's time for the queue, what is left is
/// the difference: a request arriving 60 ms into a 110 ms prefill there waits 50 ms, not 110
/// (charging the whole queue sent the siblings of a prefix being prefilled to a backend without
/// it, duplicating the prefix). Once the queue has taken longer than the line's time, the
/// backend is late by the excess and is predicted as late again: a stalled backend costs more
/// the longer it stalls, and the requests it holds stop drawing more.
pub fn ttft_after_queue(row: &CandidateRow, work: u64, uncached: u64) -> f64 {
    let own = ttft_of_work(row, uncached);
    let queue = ttft_of_work(row, work) - own;
    own + (queue - row.stalled_secs).abs()
}

/// The line's time for the work queued ahead of a request at `row`, or the time that queue has
/// already gone without moving if longer: how far from free the backend is, for the gateway
/// queue's saturation test (which asks whether there is room, not when a request would start).
pub fn queue_wait(row: &CandidateRow) -> f64 {
    let work = prefill_work(row, 0);
    (ttft_of_work(row, work) - ttft_of_work(row, 0)).max(row.stalled_secs)
}

/// The predicted TTFT at `row` of a request with `work` tokens to compute before its first
/// token (from `prefill_work`, for callers that need the work too).
pub fn ttft_of_work(row: &CandidateRow, work: u64) -> f64 {
    let ttft = row.prefill.ttft(work);
    let pressure = ((row.kv_usage - KV_PRESSURE_FROM) / (1.0 - KV_PRESSURE_FROM)).clamp(0.0, 1.0);
    ttft * (1.0 + pressure)
}

/// The line a backend that has not learned its own is judged by: the fastest of the candidates
/// that have seen any answer (for a prompt of `tokens`), if any has. Optimistic on purpose: a
/// backend is learned only by being tried. Judged by its prior (twice as slow as the sims)
/// until some backend had eight answers, and then by the others' mean line (which the faster
/// half beat), backends went untried (8 sims, prefix-repetition: two took their first requests
/// at the 40th and 42nd, and 14 and 8 of 256 in all, while the load guard tripped on the
/// others for being busier than them).
fn untried_line(rows: &[CandidateRow], tokens: u64) -> Option<PrefillLine> {
    if rows
        .iter()
        .all(|r| r.prefill_observations >= MIN_OBSERVATIONS)
    {
        return None;
    }
    rows.iter()
        .filter(|r| r.prefill_observations > 0)
        .map(|r| r.prefill)
        .min_by(|a, b| a.ttft(tokens).total_cmp(&b.ttft(tokens)))
}

/// What placing a request with `uncached` tokens to compute at `row` adds to the TTFTs of the
/// requests already waiting there that the engine has not started on: they share its next step
/// (or follow it), so each waits for its tokens too — all of ours waiting for a first byte but
/// the oldest (the one being prefilled), and the others' waiting requests.
///
/// A request's own TTFT alone sent a burst's first request (a 2,200-token miss) to a backend
/// 103 ms into another burst's first prefill, with that burst's sibling waiting behind it: the
/// newcomer's own TTFT there was within the near-tie margin of an idle backend's, but the
/// sibling, predicted at 122 ms, then shared a 2,368-token step and waited 254 ms (8 sims,
/// bursty: 15 of 512 requests over 200 ms, all such). Charging the delay makes the choice
/// minimize the sum of the TTFTs it affects, not the newcomer's alone.
pub fn delay_imposed(row: &CandidateRow, uncached: u64) -> f64 {
    let not_started = row.waiting_first_byte.saturating_sub(1) + row.foreign_waiting;
    not_started as f64 * (ttft_of_work(row, uncached) - ttft_of_work(row, 0))
}

/// Each candidate for a request of `total` tokens, judged by the line `cost` uses for it (an
/// untried backend by [`untried_line`]): its predicted TTFT and the delay it imposes there.
fn judged(rows: &[CandidateRow], total: u64) -> impl Iterator<Item = (f64, f64)> + '_ {
    let untried = untried_line(rows, total.max(1));
    rows.iter().map(move |r| {
        let uncached = total.saturating_sub(r.matched_tokens);
        let row = match untried {
            Some(line) if r.prefill_observations < MIN_OBSERVATIONS => &CandidateRow {
                prefill: line,
                ..r.clone()
            },
            _ => r,
        };
        (predicted_ttft(row, uncached), delay_imposed(row, uncached))
    })
}

/// The TTFT predicted at each candidate for a request of `total` tokens, and the delay placing
/// it there imposes on the requests waiting there ([`delay_imposed`]): `cost` chooses by their
/// sum, and the decision log shows both.
pub fn predicted_ttfts(rows: &[CandidateRow], total: u64) -> Vec<(f64, f64)> {
    judged(rows, total).collect()
}

impl Policy for Cost {
    fn name(&self) -> &'static str {
        "cost"
    }

    fn needs_matches(&self) -> bool {
        true
    }

    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice {
        let (total, reason_without_match) = match facts.matches {
            MatchFacts::Known { total_tokens } => (total_tokens, None),
            MatchFacts::Unavailable => (0, Some(Reason::StoreUnavailable)),
            MatchFacts::None => (0, Some(Reason::LeastLoaded)),
        };
        let costs: Vec<f64> = judged(rows, total)
            .map(|(own, imposed)| own + imposed)
            .collect();
        // Cheapest first, the backends the guard trips on after the others (the least loaded
        // never trips); equal costs by load, so the order's tail is sensible too.
        let guard = LoadGuard::new(rows, self.balance_abs, self.balance_rel);
        let tripped: Vec<bool> = rows.iter().map(|r| guard.trips(r)).collect();
        let mut order: Vec<usize> = (0..rows.len()).collect();
        by_prefill_load(rows, &mut order, 0);
        order.sort_by(|&a, &b| {
            tripped[a]
                .cmp(&tripped[b])
                .then(costs[a].total_cmp(&costs[b]))
        });
        let lowest = costs[order[0]];
        let bound = lowest + (lowest * TIE_FRACTION).max(TIE_SECONDS);
        let near = order
            .iter()
            .take_while(|&&p| !tripped[p] && costs[p] <= bound)
            .count();
        let best_match = rows.iter().map(|r| r.matched_tokens).max().unwrap_or(0);
        if near > 1 {
            if best_match == 0 {
                // A prompt no backend holds: the prediction sees prefill only, so the idle
                // backends tie, but the prompt's later requests will follow it, so it goes where
                // the load is least — waiting, in flight (decoding too), queue, index entries —
                // rotating among equals, as `prefix_load` places it. Taken in turn instead, the
                // rotation aliased with the load order (a backend just chosen sorts last, so turn
                // after turn picked every other one): 8 sims, prefix-repetition, the 16 prompts
                // landed 3/3/3/3/1/1/1/1 (`prefix_load`: 3/2/2/2/2/2/2/1), the holders of three
                // drew 1.5× the mean load, and the load guard sent 13 of their requests away to
                // compute the prompt again (hit 0.695 against 0.729).
                by_prefill_load(rows, &mut order[..near], facts.turn);
                // Router replicas with this view: each takes its own of them.
                order[..near].rotate_left(facts.replica_rank as usize % near);
            } else {
                // Any of them, drawn by the turn's hash. Taken in turn (`turn % near` over this
                // order) the pick aliased with the order itself, which the last choices shape:
                // 8 sims, prefix-repetition, the holders of a popular prompt were not taken
                // evenly (hit 0.705–0.708 against 0.717–0.723 drawn, mean TTFT 33.4–33.6 ms
                // against 31.5–32.1).
                let pick = xxh3_64(&facts.turn.to_le_bytes()) % near as u64;
                order[..near].rotate_left(pick as usize);
            }
        }
        let chosen = &rows[order[0]];
        // The guard decided if a backend it tripped on was cheaper than `lowest`, the cheapest
        // of the others (a near-tie drawn costs a little more than `lowest`: that is
        // not the guard's doing).
        let guard_decided = (0..rows.len()).any(|p| tripped[p] && costs[p] < lowest);
        let reason = match reason_without_match {
            Some(reason) => reason,
            None if guard_decided => Reason::LoadGuard,
            None if best_match == 0 => Reason::LeastLoaded,
            None if chosen.matched_tokens == best_match => Reason::CostHit,
            None => Reason::CostBalance,
        };
        Choice {
            order,
            reason,
            matched_ratio: (total > 0).then(|| chosen.matched_tokens as f64 / total as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{known, matched, plain, rows};
    use super::*;

    /// With the guard's defaults (`--balance-abs 16 --balance-rel 1.5`).
    fn cost() -> Cost {
        Cost {
            balance_abs: 16,
            balance_rel: 1.5,
        }
    }

    /// 10 ms + 10,000 tokens/s everywhere.
    fn line() -> PrefillLine {
        PrefillLine {
            overhead_s: 0.01,
            seconds_per_token: 1e-4,
        }
    }

    fn fleet(n: usize) -> Vec<CandidateRow> {
        let mut r = rows(n);
        for row in &mut r {
            row.prefill = line();
        }
        r
    }

    #[test]
    fn a_match_wins_by_the_prefill_it_saves() {
        let r = matched(fleet(3), &[0, 3000, 1000]);
        let c = cost().choose(&r, &known(4000, 0));
        assert_eq!(c.order[0], 1);
        assert_eq!(c.reason, Reason::CostHit);
        assert_eq!(c.order[1..], [2, 0]);
    }

    #[test]
    fn a_queue_outweighs_a_match_when_it_costs_more_than_it_saves() {
        let mut r = matched(fleet(2), &[3000, 0]);
        // 3,000 tokens saved, but 5,000 queued ahead there.
        r[0].queued_prefill_tokens = 5000;
        let c = cost().choose(&r, &known(4000, 0));
        assert_eq!((c.order[0], c.reason), (1, Reason::CostBalance));
        // 2,000 queued: the match still wins.
        r[0].queued_prefill_tokens = 2000;
        assert_eq!(cost().choose(&r, &known(4000, 0)).order[0], 0);
    }

    #[test]
    fn a_backend_far_above_the_fleets_load_is_tried_after_the_others() {
        // Backend 0 holds a shared system prompt and nothing waits there, so it is the cheapest;
        // but it carries 9 conversations decoding against 1 elsewhere (their next turns will
        // come back to it): the guard (margin max(1.5 × the mean of 3.67, MIN_MARGIN)) sends the
        // request away.
        let mut r = matched(fleet(3), &[2000, 0, 0]);
        r[0].inflight = 9;
        r[1].inflight = 1;
        r[2].inflight = 1;
        let c = cost().choose(&r, &known(2100, 0));
        assert_eq!(c.reason, Reason::LoadGuard);
        assert_ne!(c.order[0], 0);
        assert_eq!(c.order[2], 0, "tried last");
        // Near-equal costs chosen among are not the guard's decisions.
        let mut near = fleet(3);
        near[1].queued_prefill_tokens = 10;
        for turn in 0..3 {
            assert_ne!(
                cost().choose(&near, &known(2100, turn)).reason,
                Reason::LoadGuard
            );
        }
        // Within the margin (6 against 1): the match wins as before.
        r[0].inflight = 6;
        let c = cost().choose(&r, &known(2100, 0));
        assert_eq!((c.order[0], c.reason), (0, Reason::CostHit));
        // Siblings still waiting for their first byte there do not trip it (a burst stays whole).
        r[0].inflight = 9;
        r[0].waiting_first_byte = 9;
        r[0].queued_prefill_tokens = 900;
        assert_eq!(cost().choose(&r, &known(2100, 0)).order[0], 0);
    }

    #[test]
    fn a_stalled_backend_costs_the_time_it_has_stalled() {
        // Backend 0 holds the prefix and little work, but its waiting requests have had no
        // first byte for 2 s: a new request would wait behind them.
        let mut r = matched(fleet(2), &[3000, 0]);
        r[0].waiting_first_byte = 3;
        r[0].queued_prefill_tokens = 300;
        assert_eq!(
            cost().choose(&r, &known(4000, 0)).order[0],
            0,
            "not stalled"
        );
        r[0].stalled_secs = 2.0;
        let c = cost().choose(&r, &known(4000, 0));
        assert_eq!((c.order[0], c.reason), (1, Reason::CostBalance));
        // Its own 1,000 uncached tokens (0.11 s) + 1.97 s late (2 s for 0.03 s of work), as
        // late again.
        assert!((predicted_ttft(&r[0], 1000) - 2.08).abs() < 1e-9);
        // The gateway queue sees it 2 s from free.
        assert!((queue_wait(&r[0]) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_queue_under_way_costs_only_what_is_left_of_it() {
        // Backend 0 holds 1,000 tokens of the prompt and is prefilling a 1,500-token miss
        // (0.15 s of work on its line), 60 ms into it: the request waits the 90 ms left and
        // its own 100 uncached tokens (0.02 s), against a whole miss at idle backend 1 (1,100
        // tokens, 0.12 s).
        let mut r = matched(fleet(2), &[1000, 0]);
        r[0].waiting_first_byte = 1;
        r[0].queued_prefill_tokens = 1500;
        r[0].stalled_secs = 0.06;
        assert!((predicted_ttft(&r[0], 100) - 0.11).abs() < 1e-9);
        let c = cost().choose(&r, &known(1100, 0));
        assert_eq!((c.order[0], c.reason), (0, Reason::CostHit));
        // Just sent there, the whole queue is ahead (0.17 s): the miss elsewhere is cheaper.
        r[0].stalled_secs = 0.0;
        assert!((predicted_ttft(&r[0], 100) - 0.17).abs() < 1e-9);
        let c = cost().choose(&r, &known(1100, 0));
        assert_eq!((c.order[0], c.reason), (1, Reason::CostBalance));
        // The gateway queue sees the whole queue either way: it asks whether there is room.
        r[0].stalled_secs = 0.06;
        assert!((queue_wait(&r[0]) - 0.15).abs() < 1e-9);
    }

    #[test]
    fn a_placement_pays_for_the_delay_it_imposes_on_those_waiting_there() {
        // Backend 0 is 230 ms into a 2,208-token prefill (0.2308 s on its line), with a
        // sibling's 160 tokens waiting behind it; backend 1 is idle. A new 2,208-token miss
        // would itself start there within the near-tie margin of backend 1 (237.6 against
        // 230.8 ms), but the sibling would share its step and wait 0.2208 s more.
        let mut r = fleet(2);
        r[0].waiting_first_byte = 2;
        r[0].queued_prefill_tokens = 2368;
        r[0].stalled_secs = 0.23;
        assert!((predicted_ttft(&r[0], 2208) - 0.2376).abs() < 1e-9);
        assert!((delay_imposed(&r[0], 2208) - 0.2208).abs() < 1e-9);
        for turn in 0..4 {
            assert_eq!(cost().choose(&r, &known(2208, turn)).order[0], 1);
        }
        // The one being prefilled is not delayed: without the sibling, the two are a near-tie
        // again, and a prompt nobody holds goes to the less loaded of them.
        r[0].waiting_first_byte = 1;
        r[0].queued_prefill_tokens = 2208;
        assert_eq!(delay_imposed(&r[0], 2208), 0.0);
        let costs: Vec<f64> = predicted_ttfts(&r, 2208)
            .iter()
            .map(|(own, imposed)| own + imposed)
            .collect();
        assert!(costs[0] <= costs[1] * (1.0 + TIE_FRACTION), "{costs:?}");
        for turn in 0..2 {
            assert_eq!(cost().choose(&r, &known(2208, turn)).order[0], 1);
        }
        // A sibling holding the prefix, 100 ms into that prefill, still joins them: it delays
        // the waiting one by its own 160 tokens (16 ms); 163 + 16 ms against a whole miss
        // elsewhere (231 ms).
        let mut r = matched(r, &[2048, 0]);
        r[0].waiting_first_byte = 2;
        r[0].queued_prefill_tokens = 2368;
        r[0].stalled_secs = 0.1;
        assert!((delay_imposed(&r[0], 160) - 0.016).abs() < 1e-9);
        let c = cost().choose(&r, &known(2208, 0));
        assert_eq!((c.order[0], c.reason), (0, Reason::CostHit));
    }

    #[test]
    fn a_faster_backend_takes_more_work() {
        let mut r = fleet(2);
        r[0].prefill.seconds_per_token = 0.5e-4;
        r[0].queued_prefill_tokens = 1500;
        r[1].queued_prefill_tokens = 1000;
        // 0.01 + 0.5e-4 × 2500 = 135 ms against 0.01 + 1e-4 × 2000 = 210 ms.
        assert_eq!(cost().choose(&r, &known(1000, 0)).order[0], 0);
    }

    #[test]
    fn a_burst_of_equal_requests_spreads() {
        // Equal costs: the turn decides, so consecutive requests (and replicas at different
        // turns) go to different backends.
        let r = fleet(3);
        let firsts: Vec<usize> = (0..3)
            .map(|turn| cost().choose(&r, &known(500, turn)).order[0])
            .collect();
        let mut sorted = firsts.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2], "{firsts:?}");
        // Once one backend has the first request's work queued, the next goes elsewhere.
        let mut r = fleet(2);
        r[0].queued_prefill_tokens = 500;
        for turn in 0..4 {
            assert_eq!(cost().choose(&r, &known(500, turn)).order[0], 1);
        }
    }

    #[test]
    fn the_holders_of_a_prompt_share_its_requests_evenly() {
        // Backends 0 and 1 hold prompt P and cost the same for it; backend 2 alone holds Q.
        // Requests for Q and P alternate, so P's come at odd turns; each decodes where it went
        // for the next three turns, and the load order (ties' first key) puts the backend
        // just chosen last. Taken in turn over that order (`turn % 2`), every P went to the
        // busier of its two holders: the 200 landed 0/200.
        let mut r = matched(fleet(3), &[0; 3]);
        let mut decoding = std::collections::VecDeque::new();
        let mut taken = [0u32; 3];
        for turn in 0..400u64 {
            let holders: &[usize] = if turn % 2 == 0 { &[2] } else { &[0, 1] };
            for (p, row) in r.iter_mut().enumerate() {
                row.matched_tokens = if holders.contains(&p) { 1000 } else { 0 };
            }
            let c = cost().choose(&r, &known(1100, turn));
            assert_eq!(c.reason, Reason::CostHit);
            let chosen = c.order[0];
            taken[chosen] += 1;
            r[chosen].inflight += 1;
            decoding.push_back(chosen);
            if decoding.len() > 3 {
                let done = decoding.pop_front().unwrap();
                r[done].inflight -= 1;
            }
        }
        assert_eq!(taken[2], 200);
        assert!((80..=120).contains(&taken[0]), "{taken:?}");
    }

    #[test]
    fn new_prompts_spread_evenly_while_earlier_ones_decode() {
        // 16 prompts nobody holds, each sent once the one before has its first byte (so every
        // backend costs the same) and then decodes there: two on each of 8 backends. Taken in
        // turn over the load order (where the backend just chosen sorts last) they landed
        // 3/2/3/0/3/1/2/2.
        let mut r = fleet(8);
        for turn in 0..16 {
            let c = cost().choose(&r, &known(1300, turn));
            assert_eq!(c.reason, Reason::LeastLoaded);
            r[c.order[0]].inflight += 1;
            r[c.order[0]].entries += 1;
        }
        let placed: Vec<u64> = r.iter().map(|row| row.inflight).collect();
        assert_eq!(placed, vec![2; 8]);
    }

    #[test]
    fn a_nearly_full_cache_and_foreign_waiting_requests_cost() {
        let mut r = fleet(2);
        r[0].kv_usage = 0.99;
        assert_eq!(cost().choose(&r, &known(1000, 0)).order[0], 1);
        assert_eq!(cost().choose(&r, &known(1000, 1)).order[0], 1);
        let mut r = fleet(2);
        // Three requests waiting at backend 0 that another router sent.
        r[0].foreign_waiting = 3;
        assert_eq!(cost().choose(&r, &known(1000, 0)).order[0], 1);
        // The router's own waiting request is counted by its tokens, not as foreign.
        let mut r = fleet(2);
        r[0].waiting_first_byte = 1;
        r[0].queued_prefill_tokens = 10;
        r[1].queued_prefill_tokens = 200;
        assert_eq!(cost().choose(&r, &known(1000, 0)).order[0], 0);
    }

    #[test]
    fn a_backend_that_has_not_learned_its_line_is_judged_by_the_fastest() {
        // Backend 0 learned 50,000 tokens/s, backend 1 about 16,700; backend 2 still has the
        // (slower) prior. All three idle.
        let mut r = fleet(3);
        for (row, seconds_per_token) in r.iter_mut().zip([2e-5, 6e-5]) {
            row.prefill = PrefillLine {
                overhead_s: 0.01,
                seconds_per_token,
            };
            row.prefill_observations = 100;
        }
        // As fast as the fastest, backend 2 shares its near-tie and is tried in turn; judged
        // by its prior, or by the two lines' mean (90 ms against 50), it would never be.
        let chosen: Vec<usize> = (0..2)
            .map(|turn| cost().choose(&r, &known(2000, turn)).order[0])
            .collect();
        assert!(chosen.contains(&2) && chosen.contains(&0), "{chosen:?}");
        // With work queued at the learned ones, the untried one is the cheapest outright.
        for row in &mut r[..2] {
            row.queued_prefill_tokens = 400;
        }
        assert_eq!(cost().choose(&r, &known(2000, 0)).order[0], 2);
    }

    #[test]
    fn without_matches_the_least_queued_work_wins() {
        let mut r = fleet(3);
        r[0].queued_prefill_tokens = 900;
        r[1].queued_prefill_tokens = 100;
        r[2].queued_prefill_tokens = 4000;
        let c = cost().choose(&r, &plain(None, 0));
        assert_eq!(
            (c.order.clone(), c.reason),
            (vec![1, 0, 2], Reason::LeastLoaded)
        );
        let c = cost().choose(
            &r,
            &RequestFacts {
                matches: MatchFacts::Unavailable,
                ..plain(None, 0)
            },
        );
        assert_eq!((c.order[0], c.reason), (1, Reason::StoreUnavailable));
    }
}
